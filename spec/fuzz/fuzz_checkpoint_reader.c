/* fuzz_checkpoint_reader.c: libFuzzer target for the distributed checkpoint readers
 * (engine/src/checkpoint: dist.checkpoint's metadata entries and rank data files).
 *
 * The first byte picks the reader:
 * - even: the rest is a metadata entry ("<dtype>|<shape>|<chunks>", eng_ckpt_entry_parse, 4 data
 *   files).  A bad entry is an error, never a crash or leak; an accepted one is checked here
 *   independently (every box inside the shape, bytes = box numel x dtype size, offsets past the
 *   64-byte header, no two boxes overlapping (pairwise, brute force), the boxes' numel summing to the
 *   tensor's), and the round trip holds: eng_ckpt_entry_format of the parsed entry parses again to
 *   the same dtype, shape and chunks.
 * - odd: the next 8 bytes are a chunk (offset, length: 4 little-endian bytes each), the rest the
 *   image of a data file written to a temporary file: eng_ckpt_file_check and a reader
 *   (eng_ckpt_reader_open, _verify with the checksum the bytes should have, XXH64 or FNV as bit 1 of
 *   the first byte says, then _copy of the whole chunk and of its second half) with the id "fuzz"
 *   must fail cleanly on a short file, a bad header or another id, and when they succeed the bytes
 *   copied are the file's bytes.
 *   make fuzz-build && build-fuzz/fuzz/fuzz_checkpoint_reader spec/fuzz/corpus/checkpoint_reader */
#include <engine.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CHECK(c)                                                                               \
  do {                                                                                         \
    if (!(c)) { fprintf(stderr, "fuzz_checkpoint_reader: check failed: %s\n", #c); abort(); } \
  } while (0)

#define CAP 64

static void entry(const uint8_t* data, size_t n) {
  char* s = malloc(n + 1);
  CHECK(s);
  memcpy(s, data, n);
  s[n] = 0;
  int dt, nd;
  int64_t shape[8];
  eng_ckpt_chunk* ch = calloc(CAP, sizeof *ch);
  CHECK(ch);
  int k = eng_ckpt_entry_parse("fuzz", s, 4, &dt, &nd, shape, ch, CAP);
  if (k < 0) {
    CHECK(strlen(eng_last_error()) > 0);
  } else if (k <= CAP) {
    int64_t numel = 1, es = eng_dtype_size(dt), covered = 0;
    CHECK(nd >= 0 && nd <= 8 && es > 0);
    for (int d = 0; d < nd; d++) numel *= shape[d];
    for (int i = 0; i < k; i++) {
      int64_t cn = 1;
      CHECK(ch[i].ndim == nd && ch[i].file >= 0 && ch[i].file < 4 && ch[i].offset >= 64);
      for (int d = 0; d < nd; d++) {
        CHECK(ch[i].offsets[d] >= 0 && ch[i].sizes[d] > 0 && ch[i].offsets[d] + ch[i].sizes[d] <= shape[d]);
        cn *= ch[i].sizes[d];
      }
      CHECK(ch[i].nbytes == cn * es);
      covered += cn;
      for (int j = 0; j < i; j++) {
        int disjoint = 0;
        for (int d = 0; d < nd; d++)
          if (ch[i].offsets[d] >= ch[j].offsets[d] + ch[j].sizes[d] ||
              ch[j].offsets[d] >= ch[i].offsets[d] + ch[i].sizes[d])
            disjoint = 1;
        CHECK(disjoint);
      }
    }
    CHECK(covered == numel);
    /* round trip */
    int64_t cap = 512 + (int64_t)k * 512;
    char* out = malloc((size_t)cap);
    CHECK(out);
    int64_t len = eng_ckpt_entry_format(dt, nd, shape, k, ch, out, cap);
    CHECK(len > 0 && len < cap);
    int dt2, nd2;
    int64_t shape2[8];
    eng_ckpt_chunk* ch2 = calloc(CAP, sizeof *ch2);
    CHECK(ch2);
    CHECK(eng_ckpt_entry_parse("fuzz", out, 4, &dt2, &nd2, shape2, ch2, CAP) == k);
    CHECK(dt2 == dt && nd2 == nd);
    for (int d = 0; d < nd; d++) CHECK(shape2[d] == shape[d]);
    for (int i = 0; i < k; i++) {
      CHECK(ch2[i].file == ch[i].file && ch2[i].offset == ch[i].offset && ch2[i].nbytes == ch[i].nbytes &&
            ch2[i].checksum == ch[i].checksum);
      for (int d = 0; d < nd; d++) CHECK(ch2[i].offsets[d] == ch[i].offsets[d] && ch2[i].sizes[d] == ch[i].sizes[d]);
    }
    free(ch2);
    free(out);
  }
  free(ch);
  free(s);
}

static char path[64];

static void data_file(const uint8_t* data, size_t n, int algo) {
  if (n < 8) return;
  uint32_t off = 0, len = 0;
  for (int i = 0; i < 4; i++) { off |= (uint32_t)data[i] << (8 * i); len |= (uint32_t)data[4 + i] << (8 * i); }
  off %= 4096;
  len %= 4096;
  data += 8;
  n -= 8;
  if (!path[0]) snprintf(path, sizeof path, "/tmp/fuzz_ckpt_%ld.distcp", (long)getpid());
  FILE* f = fopen(path, "wb");
  CHECK(f);
  CHECK(fwrite(data, 1, n, f) == n);
  fclose(f);
  int ok = eng_ckpt_file_check(path, "fuzz", (int64_t)off + len) == 0;
  if (!ok) CHECK(strlen(eng_last_error()) > 0);
  if (len == 0) return;
  int64_t shape[1] = {len};
  eng_tensor* t = eng_tensor_empty(1, shape, ENG_U8, ENG_CPU);
  CHECK(t);
  /* the checksum the chunk's bytes have when they are there (else 0: then a mismatch) */
  uint64_t want = 0;
  if ((size_t)off + len <= n) CHECK(eng_checksum_bytes(algo, data + off, len, &want) == 0);
  int rc = -1;
  eng_ckpt_reader* r = eng_ckpt_reader_open(path, "fuzz", (int64_t)off + len, algo);
  if (r) {
    CHECK(ok);
    rc = eng_ckpt_reader_verify(r, off, len, want);
    if (rc == 0) rc = eng_ckpt_reader_copy(r, off, ENG_U8, 1, shape, NULL, t);
    if (rc == 0) {
      /* the second half as a region of the chunk */
      int64_t half[1] = {len - len / 2}, start[1] = {len / 2};
      eng_tensor* h = eng_tensor_empty(1, half, ENG_U8, ENG_CPU);
      CHECK(h);
      CHECK(eng_ckpt_reader_copy(r, off, ENG_U8, 1, shape, start, h) == 0);
      CHECK(memcmp(eng_tensor_data(h), data + off + len / 2, (size_t)half[0]) == 0);
      /* a region past the chunk's box is refused */
      start[0] = len / 2 + 1;
      CHECK(eng_ckpt_reader_copy(r, off, ENG_U8, 1, shape, start, h) != 0);
      eng_tensor_release(h);
      CHECK(eng_ckpt_reader_unchanged(r) == 0);
    }
    eng_ckpt_reader_close(r);
  }
  if (rc == 0) {
    CHECK(ok && (size_t)off + len <= n && off >= 64);
    CHECK(memcmp(eng_tensor_data(t), data + off, len) == 0);
    CHECK(n >= 64 && memcmp(data, "ENGDCP01fuzz", 12) == 0 && data[12] == 0);
  } else {
    CHECK(strlen(eng_last_error()) > 0);
  }
  eng_tensor_release(t);
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t n) {
  if (n < 1) return 0;
  if (data[0] % 2 == 0) entry(data + 1, n - 1);
  else data_file(data + 1, n - 1, data[0] & 2 ? ENG_CHECKSUM_FNV : ENG_CHECKSUM_XXH64);
  return 0;
}
