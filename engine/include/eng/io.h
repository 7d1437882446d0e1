/* io.h: safetensors files of named tensors. */
#ifndef ENG_IO_H
#define ENG_IO_H

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

/* llm.c token shards (engine.data.read_shard): a header of 256 little-endian
 * int32 (magic 20240520, version 1, token count), then the tokens as
 * little-endian uint16.  Checks the first header_bytes bytes of a file of
 * file_size bytes (header_bytes may be short: the file is then too short)
 * and writes the token count; -1 with an error naming path (NULL: "(memory)")
 * on a bad magic, version or count, or a size that does not match the count. */
int eng_token_shard_parse_header(const char* path, const void* header, int64_t header_bytes, int64_t file_size,
                                 int64_t* n_tokens);

#endif
