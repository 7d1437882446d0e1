/* token_shard.c: the header of llm.c token shards (engine.data.read_shard,
 * lua/engine/data/shards.lua, reads the tokens after this check).
 *
 * Layout: 256 little-endian int32 (header[0] = 20240520 magic, header[1] = 1
 * version: uint16 tokens, header[2] = number of tokens, the rest unused), then
 * the tokens as little-endian uint16.  The check reads the header bytewise
 * (any host byte order, any alignment of the caller's buffer) and accepts a
 * file only when its size is exactly the header plus 2 bytes per token, so
 * the reader never reads past the end or leaves bytes unread. */
#include "core/internal.h"

#define SHARD_MAGIC 20240520
#define SHARD_VERSION 1
#define SHARD_HEADER_BYTES 1024

static int32_t le32(const unsigned char* p) {
  return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
}

int eng_token_shard_parse_header(const char* path, const void* header, int64_t header_bytes, int64_t file_size,
                                 int64_t* n_tokens) {
  const char* op = "read_shard";
  if (!path) path = "(memory)";
  if (!header && header_bytes > 0) return eng_err("%s: %s: header buffer is NULL", op, path);
  if (header_bytes < SHARD_HEADER_BYTES || file_size < SHARD_HEADER_BYTES)
    return eng_err("%s: %s: file has %lld bytes, less than the %d-byte header of an llm.c token shard", op, path,
                   (long long)(file_size < header_bytes ? file_size : header_bytes), SHARD_HEADER_BYTES);
  const unsigned char* h = header;
  int32_t magic = le32(h), version = le32(h + 4), n = le32(h + 8);
  if (magic != SHARD_MAGIC)
    return eng_err("%s: %s: bad magic number %d (expected %d): not an llm.c token shard", op, path, magic,
                   SHARD_MAGIC);
  if (version != SHARD_VERSION)
    return eng_err("%s: %s: unsupported version %d (expected %d: uint16 tokens)", op, path, version, SHARD_VERSION);
  int64_t expect = SHARD_HEADER_BYTES + 2 * (int64_t)n;
  if (n < 0 || file_size != expect)
    return eng_err("%s: %s: the header says %d tokens (%lld bytes expected) but the file has %lld bytes: truncated "
                   "or corrupt", op, path, n, (long long)expect, (long long)file_size);
  if (n_tokens) *n_tokens = n;
  return 0;
}
