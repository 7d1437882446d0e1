/* token_shard.c: the header of llm.c token shards (engine.data.read_shard,
 * lua/engine/data/shards.lua, reads the tokens after this check).
 *
 * Layout: 256 little-endian int32, then the tokens.  Two kinds, as llm.c's
 * dev/data/data_common.py writes them:
 *   header[0] = 20240520 magic, header[1] = 1 version: little-endian uint16 tokens (GPT-2 vocabularies);
 *   header[0] = 20240801 magic, header[1] = 7 version: little-endian uint32 tokens (Llama 3 vocabularies).
 * header[2] = number of tokens.  header[3] = the vocabulary size the tokens
 * index (written by engine.data.write_shard; llm.c writes 0 and ignores the
 * slot): 0 = unknown, negative = an error.  The rest is unused.  The check
 * reads the header bytewise (any host byte order, any alignment of the
 * caller's buffer) and accepts a file only when its size is exactly the
 * header plus the token bytes, so the reader never reads past the end or
 * leaves bytes unread. */
#include "core/internal.h"

#define SHARD_MAGIC_U16 20240520
#define SHARD_VERSION_U16 1
#define SHARD_MAGIC_U32 20240801
#define SHARD_VERSION_U32 7
#define SHARD_HEADER_BYTES 1024

static int32_t le32(const unsigned char* p) {
  return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
}

int eng_token_shard_parse_header(const char* path, const void* header, int64_t header_bytes, int64_t file_size,
                                 int64_t* n_tokens, int32_t* token_bytes, int32_t* vocab_size) {
  const char* op = "read_shard";
  if (!path) path = "(memory)";
  if (!header && header_bytes > 0) return eng_err("%s: %s: header buffer is NULL", op, path);
  if (header_bytes < SHARD_HEADER_BYTES || file_size < SHARD_HEADER_BYTES)
    return eng_err("%s: %s: file has %lld bytes, less than the %d-byte header of an llm.c token shard", op, path,
                   (long long)(file_size < header_bytes ? file_size : header_bytes), SHARD_HEADER_BYTES);
  const unsigned char* h = header;
  int32_t magic = le32(h), version = le32(h + 4), n = le32(h + 8), vocab = le32(h + 12);
  int width;
  if (magic == SHARD_MAGIC_U16) {
    if (version != SHARD_VERSION_U16)
      return eng_err("%s: %s: unsupported version %d for magic %d (expected %d: uint16 tokens)", op, path, version,
                     magic, SHARD_VERSION_U16);
    width = 2;
  } else if (magic == SHARD_MAGIC_U32) {
    if (version != SHARD_VERSION_U32)
      return eng_err("%s: %s: unsupported version %d for magic %d (expected %d: uint32 tokens)", op, path, version,
                     magic, SHARD_VERSION_U32);
    width = 4;
  } else {
    return eng_err("%s: %s: bad magic number %d (expected %d for uint16 tokens or %d for uint32 tokens): not an "
                   "llm.c token shard", op, path, magic, SHARD_MAGIC_U16, SHARD_MAGIC_U32);
  }
  int64_t expect = SHARD_HEADER_BYTES + width * (int64_t)n;
  if (n < 0 || file_size != expect)
    return eng_err("%s: %s: the header says %d tokens (%lld bytes expected) but the file has %lld bytes: truncated "
                   "or corrupt", op, path, n, (long long)expect, (long long)file_size);
  if (vocab < 0)
    return eng_err("%s: %s: the header's vocabulary size (slot 3) is %d: corrupt", op, path, vocab);
  if (n_tokens) *n_tokens = n;
  if (token_bytes) *token_bytes = width;
  if (vocab_size) *vocab_size = vocab;
  return 0;
}
