/* sharded_tensor.h: ShardedTensor metadata (PyTorch's torch.distributed._shard):
 * shard boxes of a global tensor, torch.chunk sharding specs and their checks.
 * Offsets and sizes are per tensor dim in C's 0-based dim order; element
 * offsets are 0-based.  Numbers in messages: shards 1-based (Lua list order). */
#ifndef ENG_SHARDED_TENSOR_H
#define ENG_SHARDED_TENSOR_H
#include <stdint.h>
#include <stddef.h>
#include "mesh.h"

/* Checks n shard boxes of ndim dims (offsets/sizes: n x ndim, row-major)
 * against a tensor of the given shape: non-negative, inside the tensor, no
 * two overlapping; with check_cover also that together they cover it
 * exactly.  0, or -1 with an error naming op and the shards involved. */
int eng_shards_validate(const char* op, int n, int ndim, const int64_t* offsets, const int64_t* sizes,
                        const int64_t* shape, int check_cover);

/* torch.chunk of a dim of `size` elements over n_chunks placements: the
 * offset and size of chunk i (sizes ceil(size/n), trailing chunks smaller or
 * empty; empty chunks start at `size`). */
void eng_chunk_box(int64_t size, int n_chunks, int i, int64_t* offset, int64_t* len);

#endif
