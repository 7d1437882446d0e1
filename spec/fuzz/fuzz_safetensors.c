/* fuzz_safetensors.c: libFuzzer target for the safetensors reader
 * (engine/src/io/safetensors.c).  The input is a whole file image, read with
 * eng_safetensors_load_memory (the file loader shares every step after the
 * bytes are read).  A bad file must be an error with a message naming the
 * file, never a crash, leak or out-of-bounds read; a good file must hand out
 * every tensor with exactly the bytes its data_offsets cover.
 *   make fuzz-build && build-fuzz/fuzz/fuzz_safetensors spec/fuzz/corpus/safetensors */
#include <engine.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(c)                                                                        \
  do {                                                                                  \
    if (!(c)) { fprintf(stderr, "fuzz_safetensors: check failed: %s\n", #c); abort(); } \
  } while (0)

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  eng_safetensors* f = eng_safetensors_load_memory(data, size, "fuzz.safetensors");
  if (!f) {
    const char* e = eng_last_error();
    CHECK(e && strstr(e, "safetensors_load: ") == e);
    return 0;
  }
  int n = eng_safetensors_count(f);
  CHECK(n >= 0);
  uint64_t total = 0;
  for (int i = 0; i < n; i++) {
    const char* name = eng_safetensors_name(f, i);
    CHECK(name != NULL);
    eng_tensor* t = eng_safetensors_get(f, name);
    CHECK(t != NULL);
    CHECK(t->ndim >= 0 && t->ndim <= 8 && t->numel >= 0);
    int64_t numel = 1;
    for (int d = 0; d < t->ndim; d++) numel *= t->shape[d];
    CHECK(numel == t->numel);
    total += (uint64_t)t->numel * (uint64_t)eng_dtype_size(t->dtype);
    /* read every element back (out-of-bounds reads would trip ASan) */
    uint64_t sum = 0;
    CHECK(eng_tensor_checksum(t, &sum) == 0);
    eng_tensor_release(t);
  }
  CHECK(total <= size);
  CHECK(eng_safetensors_name(f, n) == NULL); /* out of range: an error, not a read */
  int m = eng_safetensors_meta_count(f);
  CHECK(m >= 0);
  for (int i = 0; i < m; i++) {
    const char* k = eng_safetensors_meta_key(f, i);
    const char* v = eng_safetensors_meta_value(f, i);
    CHECK(k && v);
    for (int j = 0; j < i; j++) CHECK(strcmp(k, eng_safetensors_meta_key(f, j)) != 0); /* keys are unique */
  }
  CHECK(eng_safetensors_get(f, "\x01no such tensor") == NULL);
  eng_safetensors_free(f);
  return 0;
}
