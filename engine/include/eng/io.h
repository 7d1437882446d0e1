/* io.h: safetensors files of named tensors. */
#ifndef ENG_IO_H
#define ENG_IO_H
#include <stdint.h>
#include <stddef.h>
#include "tensor.h"

/* Writes n named tensors (any dtype, any strides) and an optional
 * __metadata__ of string pairs (n_meta keys and values; may be 0). */
int eng_safetensors_save(const char* path, int n, const char** names, eng_tensor** tensors,
                         int n_meta, const char** meta_keys, const char** meta_values);

typedef struct eng_safetensors eng_safetensors;
/* Reads and validates the whole file; NULL with an error on a bad file. */
eng_safetensors* eng_safetensors_load(const char* path);
/* The same from the n bytes of a whole file image in memory (copied; the
 * buffer may be freed after the call); name stands for the path in error
 * messages (NULL: "(memory)"). */
eng_safetensors* eng_safetensors_load_memory(const void* bytes, size_t n, const char* name);
void eng_safetensors_free(eng_safetensors* f);
int eng_safetensors_count(const eng_safetensors* f);
/* Borrowed names, in file order. */
const char* eng_safetensors_name(const eng_safetensors* f, int i);
/* New tensor for name; NULL with an error if absent. */
eng_tensor* eng_safetensors_get(const eng_safetensors* f, const char* name);
int eng_safetensors_meta_count(const eng_safetensors* f);
const char* eng_safetensors_meta_key(const eng_safetensors* f, int i);
const char* eng_safetensors_meta_value(const eng_safetensors* f, int i);

/* A 64-bit checksum of t's values: its elements in row-major order, as the
 * bytes of its dtype (the bytes a safetensors file stores), so any strides
 * or device give the same value for the same data.  Checkpoints store one per
 * tensor and verify it on load (engine.checkpoint). */
int eng_tensor_checksum(const eng_tensor* t, uint64_t* out);

/* Checksums of raw bytes (distributed checkpoint chunks).  ENG_CHECKSUM_FNV is
 * eng_tensor_checksum's function (format engine-dcp/1); ENG_CHECKSUM_XXH64 is
 * xxHash64 with seed 0, bit for bit (format engine-dcp/2): four lanes, several
 * times faster, and checkable by other tools. */
enum { ENG_CHECKSUM_FNV = 1, ENG_CHECKSUM_XXH64 = 2 };
int eng_checksum_bytes(int algo, const void* data, int64_t n, uint64_t* out);
uint64_t eng_checksum_fnv(const void* data, int64_t n);
/* XXH64 over bytes fed in pieces of any size (the value equals the one-shot
 * eng_xxh64 of their concatenation). */
typedef struct eng_xxh64_state {
  uint64_t v[4];
  uint64_t total;
  unsigned char buf[32];
  uint32_t buffered;
} eng_xxh64_state;
void eng_xxh64_reset(eng_xxh64_state* s);
void eng_xxh64_update(eng_xxh64_state* s, const void* data, int64_t n);
uint64_t eng_xxh64_digest(const eng_xxh64_state* s);
uint64_t eng_xxh64(const void* data, int64_t n);

/* llm.c token shards (engine.data.read_shard): a header of 256 little-endian
 * int32 (magic 20240520 and version 1: uint16 tokens, or magic 20240801 and
 * version 7: uint32 tokens; token count; slot 3: vocabulary size, 0 when
 * unknown), then the tokens, little-endian.  Checks the first header_bytes
 * bytes of a file of file_size bytes (header_bytes may be short: the file is
 * then too short) and writes the token count, the bytes per token (2 or 4)
 * and the vocabulary size (each pointer may be NULL); -1 with an error naming
 * path (NULL: "(memory)") on a bad magic, version, count or vocabulary size,
 * or a size that does not match the count. */
int eng_token_shard_parse_header(const char* path, const void* header, int64_t header_bytes, int64_t file_size,
                                 int64_t* n_tokens, int32_t* token_bytes, int32_t* vocab_size);

#endif
