/* norm.cu: fused layer_norm / rms_norm forward and backward over rows of n
 * contiguous elements.
 *
 * Forward: one block per row; mean and variance in two passes over the row
 * (the second pass re-reads it from L1/L2: exact two-pass variance), then
 * y = (x - mean) rstd w + b.  mean/rstd are saved per row.
 * Backward: one block per row computes a = mean(w go) and b = mean(w go xhat),
 * then dx (kcm_norm_dx).  The weight/bias gradients are column sums over the
 * rows: each of P blocks (P = min(m, 512), fixed by the sizes) accumulates
 * its rows in order into its own slice of the workspace, and a second
 * kernel sums the P slices in order: deterministic, no atomics. */
#include "common.cuh"

namespace {

const int kMaxPartials = 512;

__device__ __forceinline__ float ksqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double ksqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float norm_dx(int rms, float wdy, float xh, float rs, float a, float b) {
  return kcm_norm_dx(rms, wdy, xh, rs, a, b);
}
__device__ __forceinline__ double norm_dx(int rms, double wdy, double xh, double rs, double a, double b) {
  return kcm_norm_dx_f64(rms, wdy, xh, rs, a, b);
}

int norm_threads(int64_t n) { return n >= 2048 ? 256 : (n >= 512 ? 128 : (n >= 128 ? 64 : 32)); }

template <typename T>
__global__ void norm_fwd(int rms, int64_t m, int64_t n, const T* x, const T* w, const T* b, double eps, T* y,
                         typename kacc<T>::type* mean, typename kacc<T>::type* rstd) {
  typedef typename kacc<T>::type A;
  __shared__ A sh[32];
  for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    A mu = 0;
    if (!rms) {
      A acc = 0;
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) acc += kload(xr[j]);
      mu = block_sum(acc, sh) / (A)n;
    }
    A acc = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      A d = kload(xr[j]) - mu;
      acc += d * d;
    }
    A var = block_sum(acc, sh) / (A)n;
    A rs = (A)1 / ksqrt(var + (A)eps);
    if (threadIdx.x == 0) {
      if (mean) mean[r] = mu;
      rstd[r] = rs;
    }
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      A v = (kload(xr[j]) - mu) * rs;
      if (w) v *= kload(w[j]);
      if (b) v += kload(b[j]);
      yr[j] = kstore<T>(v);
    }
  }
}

/* Block p handles rows p, p + P, ...; ws rows p (dw) and P + p (db). */
template <typename T>
__global__ void norm_bwd(int rms, int64_t m, int64_t n, const T* go, const T* x, const T* w,
                         const typename kacc<T>::type* mean, const typename kacc<T>::type* rstd, T* dx,
                         typename kacc<T>::type* ws, int need_dw, int need_db) {
  typedef typename kacc<T>::type A;
  __shared__ A sh[32];
  const int64_t P = gridDim.x;
  A* pdw = ws + (int64_t)blockIdx.x * n;
  A* pdb = ws + (P + blockIdx.x) * n;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    if (need_dw) pdw[j] = 0;
    if (need_db) pdb[j] = 0;
  }
  for (int64_t r = blockIdx.x; r < m; r += P) {
    const T* xr = x + r * n;
    const T* gr = go + r * n;
    A mu = (rms || !mean) ? (A)0 : mean[r], rs = rstd[r];
    if (dx) {
      A sa = 0, sb = 0;
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
        A wdy = kload(gr[j]) * (w ? kload(w[j]) : (A)1);
        A xh = (kload(xr[j]) - mu) * rs;
        sa += wdy;
        sb += wdy * xh;
      }
      A a = block_sum(sa, sh) / (A)n;
      A bb = block_sum(sb, sh) / (A)n;
      T* dxr = dx + r * n;
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
        A g = kload(gr[j]);
        A wdy = g * (w ? kload(w[j]) : (A)1);
        A xh = (kload(xr[j]) - mu) * rs;
        dxr[j] = kstore<T>(norm_dx(rms, wdy, xh, rs, a, bb));
        if (need_dw) pdw[j] += g * xh;
        if (need_db) pdb[j] += g;
      }
    } else {
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
        A g = kload(gr[j]);
        A xh = (kload(xr[j]) - mu) * rs; /* same rounding as the dx path */
        if (need_dw) pdw[j] += g * xh;
        if (need_db) pdb[j] += g;
      }
    }
  }
}

/* dst[j] = sum_p part[p, j] in order (P partial rows of n). */
template <typename T>
__global__ void column_sums(int64_t P, int64_t n, const typename kacc<T>::type* part, T* dst) {
  typedef typename kacc<T>::type A;
  int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += step) {
    A acc = 0;
    for (int64_t p = 0; p < P; p++) acc += part[p * n + j];
    dst[j] = kstore<T>(acc);
  }
}

int64_t n_partials(int64_t m) { return m < kMaxPartials ? (m < 1 ? 1 : m) : kMaxPartials; }

template <typename T>
int norm_fwd_t(int rms, int64_t m, int64_t n, const void* x, const void* w, const void* b, double eps, void* y,
               void* mean, void* rstd, cudaStream_t s) {
  typedef typename kacc<T>::type A;
  norm_fwd<T><<<kcu_grid(m, 1, 1 << 20), norm_threads(n), 0, s>>>(rms, m, n, (const T*)x, (const T*)w, (const T*)b,
                                                                  eps, (T*)y, (A*)mean, (A*)rstd);
  return kcu_launch_status();
}

template <typename T>
int norm_bwd_t(int rms, int64_t m, int64_t n, const void* go, const void* x, const void* w, const void* mean,
               const void* rstd, void* dx, void* dw, void* db, void* ws, cudaStream_t s) {
  typedef typename kacc<T>::type A;
  int64_t P = n_partials(m);
  norm_bwd<T><<<(unsigned)P, norm_threads(n), 0, s>>>(rms, m, n, (const T*)go, (const T*)x, (const T*)w,
                                                       (const A*)mean, (const A*)rstd, (T*)dx, (A*)ws, dw != NULL,
                                                       db != NULL);
  unsigned grid = kcu_grid(n, 256, 1 << 16);
  if (dw) column_sums<T><<<grid, 256, 0, s>>>(P, n, (const A*)ws, (T*)dw);
  if (db) column_sums<T><<<grid, 256, 0, s>>>(P, n, (const A*)ws + P * n, (T*)db);
  return kcu_launch_status();
}

}  // namespace

extern "C" int kcu_norm_fwd(int dt, int rms, int64_t m, int64_t n, const void* x, const void* w, const void* b,
                            double eps, void* y, void* mean, void* rstd, cudaStream_t s) {
  if (m < 0 || n < 1 || !(eps >= 0)) return KCU_EARG;
  if (m == 0) return KCU_OK;
  if (!x || !y || !rstd) return KCU_EARG;
  switch (dt) {
    case KCU_F32: return norm_fwd_t<float>(rms, m, n, x, w, b, eps, y, mean, rstd, s);
    case KCU_F64: return norm_fwd_t<double>(rms, m, n, x, w, b, eps, y, mean, rstd, s);
    case KCU_BF16: return norm_fwd_t<kbf16>(rms, m, n, x, w, b, eps, y, mean, rstd, s);
    case KCU_F16: return norm_fwd_t<kf16>(rms, m, n, x, w, b, eps, y, mean, rstd, s);
    default: return KCU_EARG;
  }
}

extern "C" size_t kcu_norm_bwd_workspace(int64_t m, int64_t n, int dt) {
  if (m < 0 || n < 1) return 0;
  return (size_t)(2 * n_partials(m) * n) * (dt == KCU_F64 ? sizeof(double) : sizeof(float));
}

extern "C" int kcu_norm_bwd(int dt, int rms, int64_t m, int64_t n, const void* gy, const void* x, const void* w,
                            const void* mean, const void* rstd, void* dx, void* dw, void* db, void* ws,
                            cudaStream_t s) {
  if (m < 0 || n < 1) return KCU_EARG;
  if (m == 0) {
    /* empty batch: dw and db are zero */
    int e = KCU_OK;
    if (dw) e = kcu_fill(dt, n, dw, 0.0, s);
    if (!e && db) e = kcu_fill(dt, n, db, 0.0, s);
    return e;
  }
  if (!gy || !x || !rstd || (!rms && !mean) || ((dw || db) && !ws)) return KCU_EARG;
  if (!dx && !dw && !db) return KCU_OK;
  switch (dt) {
    case KCU_F32: return norm_bwd_t<float>(rms, m, n, gy, x, w, mean, rstd, dx, dw, db, ws, s);
    case KCU_F64: return norm_bwd_t<double>(rms, m, n, gy, x, w, mean, rstd, dx, dw, db, ws, s);
    case KCU_BF16: return norm_bwd_t<kbf16>(rms, m, n, gy, x, w, mean, rstd, dx, dw, db, ws, s);
    case KCU_F16: return norm_bwd_t<kf16>(rms, m, n, gy, x, w, mean, rstd, dx, dw, db, ws, s);
    default: return KCU_EARG;
  }
}
