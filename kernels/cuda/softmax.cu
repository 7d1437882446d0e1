/* softmax.cu: softmax / log_softmax over D of contiguous [outer, D, inner],
 * forward and backward.
 *
 * Rows (inner == 1): one block per row; each thread keeps a running
 * (max, sum of exp) pair over its elements (kcm_lse_add: one read pass),
 * the pairs are merged across the block (kcm_lse_merge), then a second pass
 * writes the outputs.  Columns (inner > 1): one thread per (outer, inner)
 * column, reading with stride inner (coalesced across the warp).  Math in f32
 * (f64 for f64 data). */
#include "common.cuh"

namespace {

__device__ __forceinline__ void lse_add(float* m, float* s, float x) { kcm_lse_add(m, s, x); }
__device__ __forceinline__ void lse_add(double* m, double* s, double x) { kcm_lse_add_f64(m, s, x); }
__device__ __forceinline__ void lse_merge(float* m, float* s, float m2, float s2) { kcm_lse_merge(m, s, m2, s2); }
__device__ __forceinline__ void lse_merge(double* m, double* s, double m2, double s2) {
  kcm_lse_merge_f64(m, s, m2, s2);
}
__device__ __forceinline__ float kexp(float x) { return expf(x); }
__device__ __forceinline__ double kexp(double x) { return exp(x); }
__device__ __forceinline__ float klog(float x) { return logf(x); }
__device__ __forceinline__ double klog(double x) { return log(x); }

/* Merge the (m, s) pairs of the block; every thread gets the result. */
template <typename A> __device__ void block_lse(A* m, A* s, A* shm, A* shs) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    A m2 = __shfl_xor_sync(0xffffffffu, *m, o), s2 = __shfl_xor_sync(0xffffffffu, *s, o);
    lse_merge(m, s, m2, s2);
  }
  __syncthreads();
  if (lane == 0) { shm[w] = *m; shs[w] = *s; }
  __syncthreads();
  A mm = -INFINITY, ss = 0;
  for (int k = 0; k < nw; k++) lse_merge(&mm, &ss, shm[k], shs[k]);
  *m = mm; *s = ss;
  __syncthreads();
}

template <typename T>
__global__ void softmax_rows(int64_t rows, int64_t D, const T* x, T* y, int log_) {
  typedef typename kacc<T>::type A;
  __shared__ A shm[32], shs[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * D;
    T* yr = y + r * D;
    A m = -INFINITY, s = 0;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) lse_add(&m, &s, kload(xr[j]));
    block_lse(&m, &s, shm, shs);
    if (log_) {
      A lse = m + klog(s);
      for (int64_t j = threadIdx.x; j < D; j += blockDim.x) yr[j] = kstore<T>(kload(xr[j]) - lse);
    } else {
      A inv = (A)1 / s;
      for (int64_t j = threadIdx.x; j < D; j += blockDim.x) yr[j] = kstore<T>(kexp(kload(xr[j]) - m) * inv);
    }
  }
}

template <typename T>
__global__ void softmax_cols(int64_t outer, int64_t D, int64_t inner, const T* x, T* y, int log_) {
  typedef typename kacc<T>::type A;
  int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < outer * inner; c += step) {
    int64_t o = c / inner, i = c % inner;
    const T* xc = x + o * D * inner + i;
    T* yc = y + o * D * inner + i;
    A m = -INFINITY, s = 0;
    for (int64_t d = 0; d < D; d++) lse_add(&m, &s, kload(xc[d * inner]));
    if (log_) {
      A lse = m + klog(s);
      for (int64_t d = 0; d < D; d++) yc[d * inner] = kstore<T>(kload(xc[d * inner]) - lse);
    } else {
      A inv = (A)1 / s;
      for (int64_t d = 0; d < D; d++) yc[d * inner] = kstore<T>(kexp(kload(xc[d * inner]) - m) * inv);
    }
  }
}

/* softmax: gx = y (g - sum(g y));  log_softmax: gx = g - exp(y) sum(g). */
template <typename T>
__global__ void softmax_bwd_rows(int64_t rows, int64_t D, const T* y, const T* g, T* gx, int log_) {
  typedef typename kacc<T>::type A;
  __shared__ A sh[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* yr = y + r * D;
    const T* gr = g + r * D;
    T* gxr = gx + r * D;
    A acc = 0;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x)
      acc += log_ ? kload(gr[j]) : kload(gr[j]) * kload(yr[j]);
    acc = block_sum(acc, sh);
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      A yv = kload(yr[j]), gv = kload(gr[j]);
      gxr[j] = kstore<T>(log_ ? gv - kexp(yv) * acc : yv * (gv - acc));
    }
  }
}

template <typename T>
__global__ void softmax_bwd_cols(int64_t outer, int64_t D, int64_t inner, const T* y, const T* g, T* gx, int log_) {
  typedef typename kacc<T>::type A;
  int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < outer * inner; c += step) {
    int64_t base = (c / inner) * D * inner + c % inner;
    A acc = 0;
    for (int64_t d = 0; d < D; d++) {
      int64_t k = base + d * inner;
      acc += log_ ? kload(g[k]) : kload(g[k]) * kload(y[k]);
    }
    for (int64_t d = 0; d < D; d++) {
      int64_t k = base + d * inner;
      A yv = kload(y[k]), gv = kload(g[k]);
      gx[k] = kstore<T>(log_ ? gv - kexp(yv) * acc : yv * (gv - acc));
    }
  }
}

int row_threads(int64_t D) { return D >= 2048 ? 256 : (D >= 512 ? 128 : (D >= 128 ? 64 : 32)); }

template <typename T>
int softmax_t(int64_t outer, int64_t D, int64_t inner, const void* x, void* y, int log_, cudaStream_t s) {
  if (inner == 1)
    softmax_rows<T><<<kcu_grid(outer, 1, 1 << 20), row_threads(D), 0, s>>>(outer, D, (const T*)x, (T*)y, log_);
  else
    softmax_cols<T><<<kcu_grid(outer * inner, 256, 1 << 16), 256, 0, s>>>(outer, D, inner, (const T*)x, (T*)y, log_);
  return kcu_launch_status();
}

template <typename T>
int softmax_bwd_t(int64_t outer, int64_t D, int64_t inner, const void* y, const void* g, void* gx, int log_,
                  cudaStream_t s) {
  if (inner == 1)
    softmax_bwd_rows<T><<<kcu_grid(outer, 1, 1 << 20), row_threads(D), 0, s>>>(outer, D, (const T*)y, (const T*)g,
                                                                                (T*)gx, log_);
  else
    softmax_bwd_cols<T><<<kcu_grid(outer * inner, 256, 1 << 16), 256, 0, s>>>(outer, D, inner, (const T*)y,
                                                                               (const T*)g, (T*)gx, log_);
  return kcu_launch_status();
}

}  // namespace

extern "C" int kcu_softmax(int dt, int64_t outer, int64_t D, int64_t inner, const void* x, void* y, int log_,
                           cudaStream_t s) {
  if (outer < 0 || D < 0 || inner < 1) return KCU_EARG;
  if (outer == 0 || D == 0) return KCU_OK;
  if (!x || !y) return KCU_EARG;
  switch (dt) {
    case KCU_F32: return softmax_t<float>(outer, D, inner, x, y, log_, s);
    case KCU_F64: return softmax_t<double>(outer, D, inner, x, y, log_, s);
    case KCU_BF16: return softmax_t<kbf16>(outer, D, inner, x, y, log_, s);
    case KCU_F16: return softmax_t<kf16>(outer, D, inner, x, y, log_, s);
    default: return KCU_EARG;
  }
}

extern "C" int kcu_softmax_bwd(int dt, int64_t outer, int64_t D, int64_t inner, const void* y, const void* gy,
                               void* gx, int log_, cudaStream_t s) {
  if (outer < 0 || D < 0 || inner < 1) return KCU_EARG;
  if (outer == 0 || D == 0) return KCU_OK;
  if (!y || !gy || !gx) return KCU_EARG;
  switch (dt) {
    case KCU_F32: return softmax_bwd_t<float>(outer, D, inner, y, gy, gx, log_, s);
    case KCU_F64: return softmax_bwd_t<double>(outer, D, inner, y, gy, gx, log_, s);
    case KCU_BF16: return softmax_bwd_t<kbf16>(outer, D, inner, y, gy, gx, log_, s);
    case KCU_F16: return softmax_bwd_t<kf16>(outer, D, inner, y, gy, gx, log_, s);
    default: return KCU_EARG;
  }
}
