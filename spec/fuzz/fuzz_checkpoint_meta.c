/* fuzz_checkpoint_meta.c: libFuzzer target for the checkpoint metadata reader
 * (engine.checkpoint reads every number, checksum and name it restores from
 * the safetensors __metadata__ object, parsed by engine/src/io/safetensors.c).
 *
 * The input is the JSON text of the __metadata__ value, placed in an
 * otherwise valid checkpoint image (one tensor "model.w", f32[2]).  Checks:
 * - a bad object is an error naming the file, never a crash or leak;
 * - an accepted object gives unique keys, and the tensor is intact;
 * - round trip: the pairs written back with an independent JSON string writer
 *   (this file's) and parsed again are the same pairs, in the same order, so
 *   what a checkpoint saves is what it loads (escapes, UTF-8, surrogates).
 *   make fuzz-build && build-fuzz/fuzz/fuzz_checkpoint_meta spec/fuzz/corpus/checkpoint_meta */
#include <engine.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(c)                                                                             \
  do {                                                                                       \
    if (!(c)) { fprintf(stderr, "fuzz_checkpoint_meta: check failed: %s\n", #c); abort(); } \
  } while (0)

typedef struct { char* p; size_t n, cap; } buf;

static void put(buf* b, const void* s, size_t n) {
  if (b->n + n > b->cap) {
    size_t c = b->cap ? b->cap : 256;
    while (c < b->n + n) c *= 2;
    b->p = realloc(b->p, c);
    CHECK(b->p);
    b->cap = c;
  }
  memcpy(b->p + b->n, s, n);
  b->n += n;
}
static void puts_(buf* b, const char* s) { put(b, s, strlen(s)); }

/* JSON string as RFC 8259 allows (\u escapes for every control character,
 * raw bytes otherwise): a writer unlike the engine's. */
static void put_json(buf* b, const char* s) {
  put(b, "\"", 1);
  for (const unsigned char* c = (const unsigned char*)s; *c; c++) {
    char t[8];
    if (*c == '"' || *c == '\\') { t[0] = '\\'; t[1] = (char)*c; put(b, t, 2); }
    else if (*c < 0x20) { snprintf(t, sizeof t, "\\u%04X", *c); put(b, t, 6); }
    else put(b, c, 1);
  }
  put(b, "\"", 1);
}

static const float W[2] = {1.5f, -2.0f};

/* A checkpoint image whose __metadata__ value is meta (n bytes). */
static void image(buf* out, const char* meta, size_t n) {
  buf h = {0};
  puts_(&h, "{\"__metadata__\":");
  put(&h, meta, n);
  puts_(&h, ",\"model.w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}");
  unsigned char len[8];
  for (int k = 0; k < 8; k++) len[k] = (unsigned char)((uint64_t)h.n >> (8 * k));
  out->n = 0;
  put(out, len, 8);
  put(out, h.p, h.n);
  put(out, W, sizeof W);
  free(h.p);
}

/* The input may add tensors after its object ("{},\"x\":{...}"): model.w must still be intact. */
static void check_tensor(eng_safetensors* f) {
  CHECK(eng_safetensors_count(f) >= 1);
  eng_tensor* t = eng_safetensors_get(f, "model.w");
  CHECK(t && t->numel == 2 && t->dtype == 0);
  CHECK(!memcmp(eng_tensor_data(t), W, sizeof W));
  eng_tensor_release(t);
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  buf img = {0};
  image(&img, (const char*)data, size);
  eng_safetensors* f = eng_safetensors_load_memory(img.p, img.n, "ckpt.safetensors");
  if (!f) {
    const char* e = eng_last_error();
    CHECK(e && strstr(e, "safetensors_load: ckpt.safetensors") == e);
    free(img.p);
    return 0;
  }
  check_tensor(f);
  int m = eng_safetensors_meta_count(f);
  buf meta = {0};
  puts_(&meta, "{");
  for (int i = 0; i < m; i++) {
    const char* k = eng_safetensors_meta_key(f, i);
    const char* v = eng_safetensors_meta_value(f, i);
    CHECK(k && v);
    for (int j = 0; j < i; j++) CHECK(strcmp(k, eng_safetensors_meta_key(f, j)) != 0);
    if (i) puts_(&meta, ",");
    put_json(&meta, k);
    puts_(&meta, ":");
    put_json(&meta, v);
  }
  puts_(&meta, "}");
  buf img2 = {0};
  image(&img2, meta.p, meta.n);
  eng_safetensors* g = eng_safetensors_load_memory(img2.p, img2.n, "ckpt2.safetensors");
  if (!g) { fprintf(stderr, "round trip failed: %s\n", eng_last_error()); abort(); }
  check_tensor(g);
  CHECK(eng_safetensors_count(g) == 1);
  CHECK(eng_safetensors_meta_count(g) == m);
  for (int i = 0; i < m; i++) {
    CHECK(!strcmp(eng_safetensors_meta_key(f, i), eng_safetensors_meta_key(g, i)));
    CHECK(!strcmp(eng_safetensors_meta_value(f, i), eng_safetensors_meta_value(g, i)));
  }
  eng_safetensors_free(g);
  eng_safetensors_free(f);
  free(meta.p); free(img.p); free(img2.p);
  return 0;
}
