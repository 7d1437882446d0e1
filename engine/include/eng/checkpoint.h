/* checkpoint.h: distributed checkpoints (dist.checkpoint, lua/engine/distributed/checkpoint.lua).
 *
 * A checkpoint is a directory: one data file per rank ("__<rank>_0.distcp")
 * holding the chunks that rank wrote, back to back after a 64-byte header
 * (magic "ENGDCP01", then the checkpoint id, NUL padded), and one metadata
 * file (".metadata", a safetensors file without tensors whose __metadata__
 * pairs describe every tensor: global shape, dtype and its chunks) written
 * last.  Offsets and sizes are 0-based, in C's dim order. */
#ifndef ENG_CHECKPOINT_H
#define ENG_CHECKPOINT_H
#include <stdint.h>
#include <stddef.h>
#include "tensor.h"

/* ---- rank data files */
typedef struct eng_ckpt_writer eng_ckpt_writer;
/* Starts the data file path (written as "<path>.tmp<pid>" until finish),
 * creating missing directories; id (at most 55 bytes) goes in the header. */
eng_ckpt_writer* eng_ckpt_writer_open(const char* path, const char* id);
/* Queues t's values (row-major bytes of its dtype) as the next chunk and
 * returns its file offset (-1 on error).  copy = 1: copied now into a staging
 * buffer (t may change afterwards: async saves); copy = 0: t (or a contiguous
 * copy) is retained and written by start/finish, so t must not change before. */
int64_t eng_ckpt_writer_add(eng_ckpt_writer* w, eng_tensor* t, int copy);
/* Begins writing the queued chunks: in a new thread when async, else now.
 * A file already at path is deleted first (the caller has voided its
 * checkpoint). */
int eng_ckpt_writer_start(eng_ckpt_writer* w, int async);
/* Waits for the writes, fsyncs, renames to the final name and fsyncs the
 * directory.  0, or -1 with an error naming the file (the temporary file is
 * removed).  Test hooks: when ENGINE_CKPT_TEST_FAIL is set and is a substring of
 * the path, half of the data is written and the write fails (the partial
 * temporary file is left); ENGINE_CKPT_TEST_KILL the same, then the process
 * SIGKILLs itself here, before the rename (a rank killed during a save). */
int eng_ckpt_writer_finish(eng_ckpt_writer* w);
/* The checksum of chunk i (XXH64 of its bytes, computed while writing), after finish. */
uint64_t eng_ckpt_writer_checksum(const eng_ckpt_writer* w, int i);
int eng_ckpt_writer_count(const eng_ckpt_writer* w);
/* Frees; an unfinished writer waits for its thread and removes its temp file. */
void eng_ckpt_writer_free(eng_ckpt_writer* w);

/* Checks that path is a data file of checkpoint id whose size is at least
 * min_size bytes: 0, or -1 with an error naming the file (missing, short,
 * not a data file, another checkpoint's). */
int eng_ckpt_file_check(const char* path, const char* id, int64_t min_size);
/* Reading: a data file mapped read-only (checked as eng_ckpt_file_check:
 * header, id, at least min_size bytes); algo is the checksum its chunks carry
 * (ENG_CHECKSUM_XXH64 for format engine-dcp/2, ENG_CHECKSUM_FNV for /1). */
typedef struct eng_ckpt_reader eng_ckpt_reader;
eng_ckpt_reader* eng_ckpt_reader_open(const char* path, const char* id, int64_t min_size, int algo);
/* Checks the checksum of the nbytes at offset (read once: pread in 4 MiB
 * blocks, each hashed while in the cache): 0, or -1 with an error naming the
 * file and the chunk. */
int eng_ckpt_reader_verify(eng_ckpt_reader* r, int64_t offset, int64_t nbytes, uint64_t checksum);
/* Copies from the chunk at offset (dtype, its box's ndim sizes, row-major)
 * the region starting at src_offsets (NULL: 0) of out's shape into out (any
 * CPU or CUDA tensor, strides and dtype converted; a region contiguous in the
 * chunk is read straight into a contiguous CPU out of the same dtype).  No
 * checksum: verify the chunk first. */
int eng_ckpt_reader_copy(eng_ckpt_reader* r, int64_t offset, int dtype, int ndim, const int64_t* sizes,
                         const int64_t* src_offsets, eng_tensor* out);
/* 0 when the file's bytes are as they were at open (size, mtime), else -1
 * with an error naming it: after copying, a write in place since the open is
 * caught (a later save deleting or renaming over the file is not a change). */
int eng_ckpt_reader_unchanged(eng_ckpt_reader* r);
const char* eng_ckpt_reader_path(const eng_ckpt_reader* r);
void eng_ckpt_reader_close(eng_ckpt_reader* r);
/* fsync tmp, rename it to path, fsync the directory: a committed file. */
int eng_ckpt_commit_file(const char* tmp, const char* path);
/* Swaps the directories staged and dir in one step (renameat2 RENAME_EXCHANGE), then fsyncs their parent:
 * dir holds the new checkpoint and staged the old one, and no instant sees neither.  On a filesystem
 * without RENAME_EXCHANGE: three renames through staged ".old" (a crash between them can leave dir
 * missing, the old checkpoint under that name).  0, or -1 with an error naming both. */
int eng_ckpt_exchange_dirs(const char* staged, const char* dir);
/* The canonical absolute path of an existing path (symlinks resolved), in a thread-local buffer; NULL with
 * an error naming it. */
const char* eng_ckpt_realpath(const char* path);

/* ---- metadata entries
 * One tensor: "<dtype>|<shape>|<chunk>;<chunk>;..." with shape "d0,d1,..."
 * and a chunk "<file>:<offset>:<nbytes>:<checksum, 16 hex>:<offsets>:<sizes>"
 * (offsets and sizes comma separated; empty for a 0-d tensor). */
typedef struct eng_ckpt_chunk {
  int32_t file;
  int32_t ndim;
  int64_t offset, nbytes;
  uint64_t checksum;
  int64_t offsets[8], sizes[8];
} eng_ckpt_chunk;
/* Parses and validates an entry against n_files data files: a known dtype,
 * at most 8 dims, each chunk inside the tensor with nbytes = its bytes and
 * offset past the header, no two overlapping, together covering the tensor
 * exactly.  Writes dtype, ndim, shape (8) and up to cap chunks; returns the
 * chunk count (which may exceed cap: call again with room), or -1 with an
 * error naming op. */
int eng_ckpt_entry_parse(const char* op, const char* text, int n_files, int* dtype, int* ndim, int64_t* shape,
                         eng_ckpt_chunk* chunks, int cap);
/* Formats an entry into out (cap bytes); returns its length, or -1 when it
 * does not fit or the input is bad. */
int64_t eng_ckpt_entry_format(int dtype, int ndim, const int64_t* shape, int n, const eng_ckpt_chunk* chunks,
                              char* out, int64_t cap);

#endif
