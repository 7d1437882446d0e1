/* fuzz_token_shard.c: libFuzzer target for the llm.c token shard reader's
 * header check (engine/src/io/token_shard.c, called by
 * lua/engine/data/shards.lua before it reads the tokens).  The input is a
 * whole shard file; the reader hands the C check the first (up to) 1024
 * bytes and the file size, exactly as here.  Checks: a bad file is an error
 * naming it; an accepted one has a token count >= 0 whose tokens fill the
 * rest of the file exactly at the width it reports (so the Lua reader never
 * reads past the end), the header says magic 20240520 with version 1 (2-byte
 * tokens) or magic 20240801 with version 7 (4-byte tokens), and the vocabulary
 * size is slot 3, never negative.
 *   make fuzz-build && build-fuzz/fuzz/fuzz_token_shard spec/fuzz/corpus/token_shard */
#include <engine.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(c)                                                                         \
  do {                                                                                   \
    if (!(c)) { fprintf(stderr, "fuzz_token_shard: check failed: %s\n", #c); abort(); } \
  } while (0)

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  int64_t head = size < 1024 ? (int64_t)size : 1024;
  /* the header in its own allocation, so a read past `head` is an ASan report */
  uint8_t* h = malloc(head > 0 ? (size_t)head : 1);
  CHECK(h);
  memcpy(h, data, (size_t)head);
  int64_t n = -7;
  int32_t width = -7, vocab = -7;
  int rc = eng_token_shard_parse_header("fuzz.bin", h, head, (int64_t)size, &n, &width, &vocab);
  if (rc != 0) {
    const char* e = eng_last_error();
    CHECK(rc == -1 && e && strstr(e, "read_shard: fuzz.bin: ") == e);
    CHECK(n == -7 && width == -7 && vocab == -7);
  } else {
    CHECK(size >= 1024 && n >= 0 && (width == 2 || width == 4) && (uint64_t)n * (uint64_t)width + 1024 == size);
    if (width == 2) {
      CHECK(data[0] == 0x88 && data[1] == 0xD8 && data[2] == 0x34 && data[3] == 0x01); /* 20240520 LE */
      CHECK(data[4] == 1 && data[5] == 0 && data[6] == 0 && data[7] == 0);
    } else {
      CHECK(data[0] == 0xA1 && data[1] == 0xD9 && data[2] == 0x34 && data[3] == 0x01); /* 20240801 LE */
      CHECK(data[4] == 7 && data[5] == 0 && data[6] == 0 && data[7] == 0);
    }
    CHECK(vocab >= 0 && vocab == (int32_t)((uint32_t)data[12] | (uint32_t)data[13] << 8 | (uint32_t)data[14] << 16 |
                                           (uint32_t)data[15] << 24));
  }
  /* a file size the bytes at hand do not reach (the reader got a short read) */
  if (size >= 8) {
    int64_t fake = (int64_t)((uint64_t)data[size - 8] | (uint64_t)data[size - 7] << 8 | (uint64_t)data[size - 6] << 16 |
                             (uint64_t)data[size - 5] << 24 | (uint64_t)data[size - 4] << 32);
    if (eng_token_shard_parse_header(NULL, h, head, fake, &n, &width, NULL) == 0)
      CHECK(n * width + 1024 == fake && head == 1024);
  }
  free(h);
  return 0;
}
