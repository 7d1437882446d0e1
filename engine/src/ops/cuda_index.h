/* cuda_index.h: the device side of the indexing ops (ops/index.c) over the
 * kernels of kernels/cuda/index.cu.  Internal.  Each takes contiguous device
 * buffers and the HOST int64 index array (checked in range), uploads the
 * index and launches; returns 0 when done, 1 when the dtype has no kernel
 * (the caller takes the host path: scatter_add / index_add of bf16, f16, u8,
 * bool) or when the build has no CUDA backend, -1 on an error (set). */
#ifndef ENG_CUDA_INDEX_H
#define ENG_CUDA_INDEX_H
#include "core/internal.h"

int eng_cu_index_gather(int es, int ndim, const int64_t* ishape, const int64_t* xshape, int d, void* out,
                        const void* x, const int64_t* idx_host, int64_t n_idx, const char* op);
int eng_cu_index_scatter(int dt, int accumulate, int ndim, const int64_t* ishape, const int64_t* dshape, int d,
                         void* dst, const void* src, const int64_t* idx_host, int64_t n_idx, const char* op);
int eng_cu_index_put(int dt, int accumulate, double alpha, int64_t outer, int64_t dst_n, int64_t n_idx,
                     int64_t inner, void* dst, const void* src, const int64_t* idx_host, const char* op);

#endif
