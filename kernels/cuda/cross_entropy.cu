/* cross_entropy.cu: fused log-softmax + NLL (with label smoothing and an
 * ignore index) over rows of C logits, for large vocabularies.
 *
 * Forward: one block per row, one read of the row: each thread keeps an
 * online (max, sum of exp) pair and the plain sum (for smoothing) over
 * 16-byte vector loads (the pair updated once per vector: kcm_lse_add_n),
 * then the block merges them; loss and logsumexp are
 * saved per row.  Backward: one block per row writes
 * s (softmax - (1 - eps) onehot - eps/C) from the saved logsumexp.
 * kcu_masked_mean turns per-row losses into the 'mean' reduction (one
 * block, fixed order). */
#include "common.cuh"

namespace {

const int kThreads = 512;

template <typename T, int V> struct alignas(sizeof(T) * V) cvec { T v[V]; };

__device__ __forceinline__ void lse_add(float* m, float* s, float x) { kcm_lse_add(m, s, x); }
__device__ __forceinline__ void lse_add(double* m, double* s, double x) { kcm_lse_add_f64(m, s, x); }
__device__ __forceinline__ void lse_merge(float* m, float* s, float m2, float s2) { kcm_lse_merge(m, s, m2, s2); }
__device__ __forceinline__ void lse_merge(double* m, double* s, double m2, double s2) {
  kcm_lse_merge_f64(m, s, m2, s2);
}
/* A vector load's V values at once (f32 accumulation: kcm_lse_add_n); f64 element by element. */
template <int V> __device__ __forceinline__ void lse_add_vec(float* m, float* s, const float (&v)[V]) {
  kcm_lse_add_n(m, s, v, V);
}
template <int V> __device__ __forceinline__ void lse_add_vec(double* m, double* s, const double (&v)[V]) {
#pragma unroll
  for (int k = 0; k < V; k++) kcm_lse_add_f64(m, s, v[k]);
}
__device__ __forceinline__ float klog(float x) { return logf(x); }
__device__ __forceinline__ double klog(double x) { return log(x); }
__device__ __forceinline__ float ce_grad(float x, float lse, int is_t, float eps, float inv_c, float sc) {
  return kcm_ce_grad(x, lse, is_t, eps, inv_c, sc);
}
__device__ __forceinline__ double ce_grad(double x, double lse, int is_t, double eps, double inv_c, double sc) {
  return kcm_ce_grad_f64(x, lse, is_t, eps, inv_c, sc);
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) ce_fwd(int64_t N, int64_t C, const T* x, const void* tgt, int tdt,
                                                   int64_t ignore, double eps, typename kacc<T>::type* loss,
                                                   typename kacc<T>::type* lse, int* bad) {
  typedef typename kacc<T>::type A;
  __shared__ A shm[32], shs[32], sh[32];
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    int64_t t = kidx(tgt, tdt, r);
    if (t == ignore) {
      if (threadIdx.x == 0) { loss[r] = 0; lse[r] = 0; }
      continue;
    }
    const T* xr = x + r * C;
    A m = -INFINITY, s = 0, sx = 0;
    for (int64_t j = (int64_t)threadIdx.x * V; j < C; j += (int64_t)blockDim.x * V) {
      if (V > 1 && j + V <= C) {
        cvec<T, V> a = *reinterpret_cast<const cvec<T, V>*>(xr + j);
        A v[V];
#pragma unroll
        for (int k = 0; k < V; k++) { v[k] = kload(a.v[k]); sx += v[k]; }
        lse_add_vec<V>(&m, &s, v);
      } else {
        for (int k = 0; k < V && j + k < C; k++) { A v = kload(xr[j + k]); lse_add(&m, &s, v); sx += v; }
      }
    }
    /* merge (m, s) over the block, then the plain sums */
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      A m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
      lse_merge(&m, &s, m2, s2);
    }
    __syncthreads();
    if (lane == 0) { shm[w] = m; shs[w] = s; }
    __syncthreads();
    sx = block_sum(sx, sh);
    if (threadIdx.x == 0) {
      A mm = -INFINITY, ss = 0;
      for (int k = 0; k < nw; k++) lse_merge(&mm, &ss, shm[k], shs[k]);
      A l = mm + klog(ss);
      lse[r] = l;
      if (t < 0 || t >= C) {
        loss[r] = (A)NAN;
        if (bad) *bad = 1;
      } else {
        A e = (A)eps;
        loss[r] = l - ((A)1 - e) * kload(xr[t]) - e / (A)C * sx;
      }
    }
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) ce_bwd(int64_t N, int64_t C, const T* x, const void* tgt, int tdt,
                                                   int64_t ignore, double eps, const typename kacc<T>::type* lse,
                                                   const typename kacc<T>::type* gs,
                                                   const typename kacc<T>::type* gscale, double gconst, T* gx) {
  typedef typename kacc<T>::type A;
  const A e = (A)eps, inv_c = (A)1 / (A)C;
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    int64_t t = kidx(tgt, tdt, r);
    const T* xr = x + r * C;
    T* gr = gx + r * C;
    if (t == ignore) {
      for (int64_t j = threadIdx.x; j < C; j += blockDim.x) gr[j] = kstore<T>((A)0);
      continue;
    }
    A sc = (A)gconst * (gs ? gs[r] : (A)1) * (gscale ? *gscale : (A)1);
    A l = lse[r];
    for (int64_t j = (int64_t)threadIdx.x * V; j < C; j += (int64_t)blockDim.x * V) {
      if (V > 1 && j + V <= C) {
        cvec<T, V> a = *reinterpret_cast<const cvec<T, V>*>(xr + j), o;
#pragma unroll
        for (int k = 0; k < V; k++) o.v[k] = kstore<T>(ce_grad(kload(a.v[k]), l, j + k == t, e, inv_c, sc));
        *reinterpret_cast<cvec<T, V>*>(gr + j) = o;
      } else {
        for (int k = 0; k < V && j + k < C; k++) gr[j + k] = kstore<T>(ce_grad(kload(xr[j + k]), l, j + k == t, e, inv_c, sc));
      }
    }
  }
}

template <typename A>
__global__ void masked_mean(int64_t N, const A* vals, const void* tgt, int tdt, int64_t ignore, A* out) {
  __shared__ double sh[32];
  double acc = 0, cnt = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    if (kidx(tgt, tdt, i) == ignore) continue;
    acc += (double)vals[i];
    cnt += 1.0;
  }
  acc = block_sum(acc, sh);
  cnt = block_sum(cnt, sh);
  if (threadIdx.x == 0) {
    out[0] = (A)(acc / cnt); /* 0/0 = NaN when every target is ignored */
    out[1] = (A)cnt;
  }
}

int vec_ok(const void* p, int64_t C, int es) { return ((uintptr_t)p & 15) == 0 && (C * es) % 16 == 0; }

template <typename T>
int ce_fwd_t(int64_t N, int64_t C, const void* x, const void* tgt, int tdt, int64_t ignore, double eps, void* loss,
             void* lse, int* bad, cudaStream_t s) {
  typedef typename kacc<T>::type A;
  const int V = 16 / sizeof(T);
  unsigned grid = kcu_grid(N, 1, 1 << 20);
  if (vec_ok(x, C, sizeof(T)))
    ce_fwd<T, V><<<grid, kThreads, 0, s>>>(N, C, (const T*)x, tgt, tdt, ignore, eps, (A*)loss, (A*)lse, bad);
  else
    ce_fwd<T, 1><<<grid, kThreads, 0, s>>>(N, C, (const T*)x, tgt, tdt, ignore, eps, (A*)loss, (A*)lse, bad);
  return kcu_launch_status();
}

template <typename T>
int ce_bwd_t(int64_t N, int64_t C, const void* x, const void* tgt, int tdt, int64_t ignore, double eps,
             const void* lse, const void* gs, const void* gscale, double gconst, void* gx, cudaStream_t s) {
  typedef typename kacc<T>::type A;
  const int V = 16 / sizeof(T);
  unsigned grid = kcu_grid(N, 1, 1 << 20);
  if (vec_ok(x, C, sizeof(T)) && vec_ok(gx, C, sizeof(T)))
    ce_bwd<T, V><<<grid, kThreads, 0, s>>>(N, C, (const T*)x, tgt, tdt, ignore, eps, (const A*)lse, (const A*)gs,
                                           (const A*)gscale, gconst, (T*)gx);
  else
    ce_bwd<T, 1><<<grid, kThreads, 0, s>>>(N, C, (const T*)x, tgt, tdt, ignore, eps, (const A*)lse, (const A*)gs,
                                           (const A*)gscale, gconst, (T*)gx);
  return kcu_launch_status();
}

}  // namespace

extern "C" int kcu_cross_entropy_fwd(int dt, int64_t N, int64_t C, const void* x, const void* tgt, int tdt,
                                     int64_t ignore, double eps, void* loss, void* lse, int* bad, cudaStream_t s) {
  if (N < 0 || C < 1 || (tdt != KCU_I32 && tdt != KCU_I64) || !(eps >= 0 && eps <= 1)) return KCU_EARG;
  if (N == 0) return KCU_OK;
  if (!x || !tgt || !loss || !lse) return KCU_EARG;
  switch (dt) {
    case KCU_F32: return ce_fwd_t<float>(N, C, x, tgt, tdt, ignore, eps, loss, lse, bad, s);
    case KCU_F64: return ce_fwd_t<double>(N, C, x, tgt, tdt, ignore, eps, loss, lse, bad, s);
    case KCU_BF16: return ce_fwd_t<kbf16>(N, C, x, tgt, tdt, ignore, eps, loss, lse, bad, s);
    case KCU_F16: return ce_fwd_t<kf16>(N, C, x, tgt, tdt, ignore, eps, loss, lse, bad, s);
    default: return KCU_EARG;
  }
}

extern "C" int kcu_cross_entropy_bwd(int dt, int64_t N, int64_t C, const void* x, const void* tgt, int tdt,
                                     int64_t ignore, double eps, const void* lse, const void* gs, const void* gscale,
                                     double gconst, void* gx, cudaStream_t s) {
  if (N < 0 || C < 1 || (tdt != KCU_I32 && tdt != KCU_I64) || !(eps >= 0 && eps <= 1)) return KCU_EARG;
  if (N == 0) return KCU_OK;
  if (!x || !tgt || !lse || !gx) return KCU_EARG;
  switch (dt) {
    case KCU_F32: return ce_bwd_t<float>(N, C, x, tgt, tdt, ignore, eps, lse, gs, gscale, gconst, gx, s);
    case KCU_F64: return ce_bwd_t<double>(N, C, x, tgt, tdt, ignore, eps, lse, gs, gscale, gconst, gx, s);
    case KCU_BF16: return ce_bwd_t<kbf16>(N, C, x, tgt, tdt, ignore, eps, lse, gs, gscale, gconst, gx, s);
    case KCU_F16: return ce_bwd_t<kf16>(N, C, x, tgt, tdt, ignore, eps, lse, gs, gscale, gconst, gx, s);
    default: return KCU_EARG;
  }
}

extern "C" int kcu_masked_mean(int dt, int64_t N, const void* vals, const void* tgt, int tdt, int64_t ignore,
                               void* out, cudaStream_t s) {
  if (N < 0 || (tdt != KCU_I32 && tdt != KCU_I64) || !out || (N > 0 && (!vals || !tgt))) return KCU_EARG;
  if (dt == KCU_F64) masked_mean<double><<<1, 1024, 0, s>>>(N, (const double*)vals, tgt, tdt, ignore, (double*)out);
  else masked_mean<float><<<1, 1024, 0, s>>>(N, (const float*)vals, tgt, tdt, ignore, (float*)out);
  return kcu_launch_status();
}
