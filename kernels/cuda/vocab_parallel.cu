/* vocab_parallel.cu: the local parts of vocab-parallel cross entropy (kvocab_cuda.h).  Row kernels: one block per
 * row (grid-stride over rows), f64 accumulation, fixed reduction trees; the one-block kernels (prep, loss) loop
 * over the rows in a fixed order.  The formulas mirror the CPU reference (sharding/loss_parallel.c, through
 * ops/vocab_parallel.c) element by element: f64 max / sum of exp / log-sum-exp; the f32 gradient as
 * (float)(s * expf(x - lse_f32)). */
#include "common.cuh"
#include "kvocab_cuda.h"
#include <math.h>

namespace {

const int kThreads = 256;
const int64_t kMaxBlocks = 65536;

template <typename T> __device__ __forceinline__ double ld(const T* p, int64_t i) { return (double)p[i]; }

__device__ __forceinline__ double block_max(double v, double* sh) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = kmax_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  double r = lane < nw ? sh[lane] : -INFINITY;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) r = kmax_nan(r, __shfl_xor_sync(0xffffffffu, r, o));
  __syncthreads();
  return r;
}

__global__ void k_prep(int64_t M, const int64_t* tgt, int64_t total, int64_t ignore, const double* w, double* rw,
                       double slice_err, double* err, double* wsum) {
  __shared__ double sh[32];
  double acc = 0.0, e = 0.0;
  for (int64_t i = threadIdx.x; i < M; i += blockDim.x) {
    int64_t t = tgt[i];
    double r = 0.0;
    if (t != ignore) {
      if (t < 0 || t >= total) e = 2.0;
      else { r = w ? w[t] : 1.0; acc += r; }
    }
    if (rw) rw[i] = w ? r : 0.0;
  }
  acc = block_sum(acc, sh);
  e = block_max(e, sh);
  if (threadIdx.x == 0) { *wsum = acc; *err = e > slice_err ? e : slice_err; }
}

template <typename T> __global__ void k_max(int64_t M, int64_t V, const T* x, double* mx) {
  __shared__ double sh[32];
  for (int64_t i = blockIdx.x; i < M; i += gridDim.x) {
    double m = -INFINITY;
    for (int64_t c = threadIdx.x; c < V; c += blockDim.x) m = kmax_nan(m, ld(x, i * V + c));
    m = block_max(m, sh);
    if (threadIdx.x == 0) mx[i] = m;
  }
}

template <typename T>
__global__ void k_sumexp(int64_t M, int64_t V, const T* x, const double* mx, const int64_t* tgt, int64_t off,
                         int64_t ignore, double* se, double* tl) {
  __shared__ double sh[32];
  if (blockIdx.x == 0 && threadIdx.x == 0) se[M] = (double)V;
  for (int64_t i = blockIdx.x; i < M; i += gridDim.x) {
    double m = mx[i], s = 0.0;
    if (isfinite(m))
      for (int64_t c = threadIdx.x; c < V; c += blockDim.x) s += exp(ld(x, i * V + c) - m);
    s = block_sum(s, sh);
    if (threadIdx.x == 0) {
      se[i] = s;
      int64_t t = tgt[i], l = t - off;
      tl[i] = (t != ignore && l >= 0 && l < V) ? ld(x, i * V + l) : 0.0;
    }
  }
}

template <typename T>
__global__ void k_loss(int64_t M, const double* mx, const double* se, const double* tl, const int64_t* tgt,
                       int64_t ignore, const double* rw, const double* wsum, int reduction, T* lse, T* out) {
  __shared__ double sh[32];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < M; i += blockDim.x) {
    double l = mx[i] + log(se[i]);
    lse[i] = (T)l;
    double loss = tgt[i] == ignore ? 0.0 : (l - tl[i]) * (rw ? rw[i] : 1.0);
    if (reduction == 0) out[i] = (T)loss;
    else acc += loss;
  }
  if (reduction == 0) return;
  acc = block_sum(acc, sh);
  if (threadIdx.x == 0) out[0] = (T)(reduction == 1 ? acc / *wsum : acc);
}

template <typename T>
__global__ void k_bwd(int64_t M, int64_t V, const T* x, const T* lse, const int64_t* tgt, int64_t off, int64_t ignore,
                      const void* g, int gdt, int per_row, const double* rw, const double* div, T* gx) {
  int64_t n = M * V, step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += step) {
    int64_t i = e / V, c = e - i * V;
    int64_t t = tgt[i];
    double s = 0.0;
    if (t != ignore) {
      double gv = gdt == KCU_F64 ? ((const double*)g)[per_row ? i : 0] : (double)((const float*)g)[per_row ? i : 0];
      if (div) gv = gv / *div;
      s = gv * (rw ? rw[i] : 1.0);
    }
    if (s == 0.0) { gx[e] = (T)0; continue; }
    double v;
    if (sizeof(T) == 4) v = (double)(float)(s * (double)expf((float)x[e] - (float)lse[i]));
    else v = s * exp((double)x[e] - (double)lse[i]);
    T o = (T)v;
    if (c == t - off) o -= (T)s;
    gx[e] = o;
  }
}

template <typename T>
int run_all(int what, int64_t M, int64_t V, const void* x, const double* mx, const int64_t* tgt, int64_t off,
            int64_t ignore, double* se, double* tl, cudaStream_t s) {
  unsigned grid = kcu_grid(M, 1, kMaxBlocks);
  if (what == 0) k_max<T><<<grid, kThreads, 0, s>>>(M, V, (const T*)x, (double*)mx);
  else k_sumexp<T><<<grid, kThreads, 0, s>>>(M, V, (const T*)x, mx, tgt, off, ignore, se, tl);
  return kcu_launch_status();
}

}  // namespace

extern "C" int kcu_vp_ce_prep(int64_t M, const int64_t* tgt, int64_t total, int64_t ignore, const double* w,
                              double* rw, double slice_err, double* err, double* wsum, cudaStream_t s) {
  if (M < 0 || !err || !wsum || (M > 0 && !tgt)) return KCU_EARG;
  k_prep<<<1, 1024, 0, s>>>(M, tgt, total, ignore, w, rw, slice_err, err, wsum);
  return kcu_launch_status();
}

extern "C" int kcu_vp_ce_max(int dt, int64_t M, int64_t V, const void* x, double* mx, cudaStream_t s) {
  if (M < 0 || V < 0 || (dt != KCU_F32 && dt != KCU_F64)) return KCU_EARG;
  if (M == 0) return KCU_OK;
  return dt == KCU_F32 ? run_all<float>(0, M, V, x, mx, NULL, 0, 0, NULL, NULL, s)
                       : run_all<double>(0, M, V, x, mx, NULL, 0, 0, NULL, NULL, s);
}

extern "C" int kcu_vp_ce_sumexp(int dt, int64_t M, int64_t V, const void* x, const double* mx, const int64_t* tgt,
                                int64_t off, int64_t ignore, double* se, double* tl, cudaStream_t s) {
  if (M < 0 || V < 0 || (dt != KCU_F32 && dt != KCU_F64) || !se) return KCU_EARG;
  return dt == KCU_F32 ? run_all<float>(1, M, V, x, mx, tgt, off, ignore, se, tl, s)
                       : run_all<double>(1, M, V, x, mx, tgt, off, ignore, se, tl, s);
}

extern "C" int kcu_vp_ce_loss(int dt, int64_t M, const double* mx, const double* se, const double* tl,
                              const int64_t* tgt, int64_t ignore, const double* rw, const double* wsum, int reduction,
                              void* lse, void* out, cudaStream_t s) {
  if (M < 0 || reduction < 0 || reduction > 2 || (dt != KCU_F32 && dt != KCU_F64) || (reduction == 1 && !wsum))
    return KCU_EARG;
  if (M == 0 && reduction == 0) return KCU_OK;
  if (dt == KCU_F32)
    k_loss<float><<<1, 1024, 0, s>>>(M, mx, se, tl, tgt, ignore, rw, wsum, reduction, (float*)lse, (float*)out);
  else
    k_loss<double><<<1, 1024, 0, s>>>(M, mx, se, tl, tgt, ignore, rw, wsum, reduction, (double*)lse, (double*)out);
  return kcu_launch_status();
}

extern "C" int kcu_vp_ce_bwd(int dt, int64_t M, int64_t V, const void* x, const void* lse, const int64_t* tgt,
                             int64_t off, int64_t ignore, const void* g, int gdt, int per_row, const double* rw,
                             const double* div, void* gx, cudaStream_t s) {
  if (M < 0 || V < 0 || (dt != KCU_F32 && dt != KCU_F64) || (gdt != KCU_F32 && gdt != KCU_F64)) return KCU_EARG;
  int64_t n = M * V;
  if (n == 0) return KCU_OK;
  unsigned grid = kcu_grid(n, kThreads, kMaxBlocks);
  if (dt == KCU_F32)
    k_bwd<float><<<grid, kThreads, 0, s>>>(M, V, (const float*)x, (const float*)lse, tgt, off, ignore, g, gdt, per_row,
                                           rw, div, (float*)gx);
  else
    k_bwd<double><<<grid, kThreads, 0, s>>>(M, V, (const double*)x, (const double*)lse, tgt, off, ignore, g, gdt,
                                            per_row, rw, div, (double*)gx);
  return kcu_launch_status();
}
