/* cuda_index.c: device side of gather / scatter / index_add / index_copy (see
 * ops/cuda_index.h): the host-checked index goes to the device once per
 * call, then one kernel of kernels/cuda/index.cu runs on the compute stream. */
#include "ops/cuda_index.h"

#ifdef ENG_HAVE_CUDA
#include "kernels/cuda/kcuda.h"
#include "kernels/cuda/kindex_cuda.h"
#include "eng/cuda.h"

static cudaStream_t S(void) { return (cudaStream_t)eng_cuda_stream(ENG_CUDA_STREAM_COMPUTE); }

static int64_t* upload(const int64_t* idx, int64_t n, const char* op) {
  void* d = eng_cuda_malloc((n > 0 ? n : 1) * (int64_t)sizeof(int64_t));
  if (!d) { eng_err_prefix("%s", op); return NULL; }
  if (n > 0 && eng_cuda_memcpy_h2d(d, idx, n * (int64_t)sizeof(int64_t))) {
    eng_cuda_free(d);
    eng_err_prefix("%s", op);
    return NULL;
  }
  return (int64_t*)d;
}

static int finish(int st, int64_t* didx, const char* op) {
  eng_cuda_free(didx); /* stream-ordered: the next user runs after the kernel */
  if (st == KCU_EARG) return 1;
  if (st != 0) return eng_cuda_check(st, op);
  return 0;
}

int eng_cu_index_gather(int es, int ndim, const int64_t* ishape, const int64_t* xshape, int d, void* out,
                        const void* x, const int64_t* idx_host, int64_t n_idx, const char* op) {
  cudaStream_t s = S();
  if (!s) { eng_err_prefix("%s", op); return -1; }
  int64_t* didx = upload(idx_host, n_idx, op);
  if (!didx) return -1;
  return finish(kcu_gather(es, ndim, ishape, xshape, d, out, x, didx, s), didx, op);
}

int eng_cu_index_scatter(int dt, int accumulate, int ndim, const int64_t* ishape, const int64_t* dshape, int d,
                         void* dst, const void* src, const int64_t* idx_host, int64_t n_idx, const char* op) {
  cudaStream_t s = S();
  if (!s) { eng_err_prefix("%s", op); return -1; }
  int64_t* didx = upload(idx_host, n_idx, op);
  if (!didx) return -1;
  return finish(kcu_scatter(dt, accumulate, ndim, ishape, dshape, d, dst, src, didx, s), didx, op);
}

int eng_cu_index_put(int dt, int accumulate, double alpha, int64_t outer, int64_t dst_n, int64_t n_idx,
                     int64_t inner, void* dst, const void* src, const int64_t* idx_host, const char* op) {
  cudaStream_t s = S();
  if (!s) { eng_err_prefix("%s", op); return -1; }
  int64_t* didx = upload(idx_host, n_idx, op);
  if (!didx) return -1;
  return finish(kcu_index_put(dt, accumulate, alpha, outer, dst_n, n_idx, inner, dst, src, didx, s), didx, op);
}

#else /* no CUDA backend: never reached with CUDA tensors; the callers take the host path */

int eng_cu_index_gather(int es, int ndim, const int64_t* ishape, const int64_t* xshape, int d, void* out,
                        const void* x, const int64_t* idx_host, int64_t n_idx, const char* op) {
  (void)es; (void)ndim; (void)ishape; (void)xshape; (void)d; (void)out; (void)x; (void)idx_host; (void)n_idx; (void)op;
  return 1;
}
int eng_cu_index_scatter(int dt, int accumulate, int ndim, const int64_t* ishape, const int64_t* dshape, int d,
                         void* dst, const void* src, const int64_t* idx_host, int64_t n_idx, const char* op) {
  (void)dt; (void)accumulate; (void)ndim; (void)ishape; (void)dshape; (void)d; (void)dst; (void)src; (void)idx_host;
  (void)n_idx; (void)op;
  return 1;
}
int eng_cu_index_put(int dt, int accumulate, double alpha, int64_t outer, int64_t dst_n, int64_t n_idx,
                     int64_t inner, void* dst, const void* src, const int64_t* idx_host, const char* op) {
  (void)dt; (void)accumulate; (void)alpha; (void)outer; (void)dst_n; (void)n_idx; (void)inner; (void)dst; (void)src;
  (void)idx_host; (void)op;
  return 1;
}
#endif
