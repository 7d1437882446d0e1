/* kindex_cuda.h: CUDA kernels of the indexing ops (kernels/cuda/index.cu),
 * C-callable, on contiguous device buffers; index arrays are int64 on the
 * device, already checked in range.  Statuses as kcuda.h (KCU_EARG for an
 * unsupported dtype: the caller then takes the host path). */
#ifndef KINDEX_CUDA_H
#define KINDEX_CUDA_H
#include <stdint.h>
#include <cuda_runtime_api.h>
#ifdef __cplusplus
extern "C" {
#endif

/* torch.gather: out (contiguous over ishape) from x (contiguous over xshape); es: element size. */
int kcu_gather(int es, int ndim, const int64_t* ishape, const int64_t* xshape, int d, void* out, const void* x,
               const int64_t* idx, cudaStream_t s);
/* scatter (accumulate 0: any dtype) / scatter_add (accumulate 1: f32 f64 i32 i64, atomics) into dst. */
int kcu_scatter(int dt, int accumulate, int ndim, const int64_t* ishape, const int64_t* dshape, int d, void* dst,
                const void* src, const int64_t* idx, cudaStream_t s);
/* dst[o, idx[j], :] = (accumulate: += alpha *) src[o, j, :]; accumulate: f32 f64 i32 i64. */
int kcu_index_put(int dt, int accumulate, double alpha, int64_t outer, int64_t dst_n, int64_t n_idx, int64_t inner,
                  void* dst, const void* src, const int64_t* idx, cudaStream_t s);

#ifdef __cplusplus
}
#endif
#endif
