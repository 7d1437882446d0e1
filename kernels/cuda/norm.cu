/* norm.cu: fused layer_norm / rms_norm forward and backward over rows of n
 * contiguous elements, in the data's dtype (f32, bf16, f16: f32 arithmetic;
 * f64), optionally of h = x + r (the residual add fused in front: h is
 * written, rounded to the dtype, and normalised as stored) and, backward,
 * with the gradient of h from its other uses added to dx.
 *
 * Vector path (f32/bf16/f16, n a multiple of the 16-byte vector, aligned,
 * n <= 256 vectors: GPT-2's 768 in bf16 is 3 vectors per lane): one warp per
 * row with the row in registers; forward: mean, then the exact two-pass
 * variance from the registers, then y.  Backward: KCM_NORM_WARPS warps per
 * block over a contiguous range of rows; per row a = mean(w go), c =
 * mean(w go xhat) and dx; each lane keeps the weight/bias gradient sums of
 * its columns in registers over its rows, the block adds its warps in order
 * in shared memory and writes one f32 partial row; a second small 2-D pass
 * (colsum.cuh) sums the partial rows.  Partition, order and rounding:
 * kcuda_norm.cuh, emulated on the CPU by spec/c/test_cuda_norm.c.
 *
 * Generic path (other widths, misaligned views, f64): one block per row,
 * two passes for the variance; backward partials of P = min(m, 512) blocks
 * over the rows p, p + P, ...; the same second pass (f64: its own).
 * Every launch configuration depends on the sizes only, every sum has a
 * fixed order, no atomics: deterministic. */
#include "colsum.cuh"

namespace {

const int kMaxPartials = 512;
const int kVecThreads = 32 * KCM_NORM_WARPS;

__device__ __forceinline__ float ksqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double ksqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float norm_dx(int rms, float wdy, float xh, float rs, float a, float b) {
  return kcm_norm_dx(rms, wdy, xh, rs, a, b);
}
__device__ __forceinline__ double norm_dx(int rms, double wdy, double xh, double rs, double a, double b) {
  return kcm_norm_dx_f64(rms, wdy, xh, rs, a, b);
}

int norm_threads(int64_t n) { return n >= 2048 ? 256 : (n >= 512 ? 128 : (n >= 128 ? 64 : 32)); }

/* v rounded to T, back in the compute type */
template <typename T> __device__ __forceinline__ typename kacc<T>::type round_to(typename kacc<T>::type v) {
  return kload(kstore<T>(v));
}
template <typename T> int kdt_of();
template <> int kdt_of<float>() { return KCU_F32; }
template <> int kdt_of<double>() { return KCU_F64; }
template <> int kdt_of<kbf16>() { return KCU_BF16; }
template <> int kdt_of<kf16>() { return KCU_F16; }

/* ---------------------------------------------------------------- generic path */
template <typename T>
__global__ void norm_fwd(int rms, int64_t m, int64_t n, const T* x, const T* res, T* h, const T* w, const T* b,
                         double eps, T* y, typename kacc<T>::type* mean, typename kacc<T>::type* rstd) {
  typedef typename kacc<T>::type A;
  __shared__ A sh[32];
  for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    if (res) { /* h = x + r first; this thread reads back only what it wrote */
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) h[r * n + j] = kstore<T>(kload(xr[j]) + kload(res[r * n + j]));
      xr = h + r * n;
    }
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
                         const typename kacc<T>::type* mean, const typename kacc<T>::type* rstd, const T* gres, T* dx,
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
        A d = norm_dx(rms, wdy, xh, rs, a, bb);
        /* + h's other gradient after dx is rounded: the add of two gradients, as autograd would */
        dxr[j] = gres ? kstore<T>(round_to<T>(d) + kload(gres[r * n + j])) : kstore<T>(d);
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

/* dst[j] = sum_p part[p, j] in order (P partial rows of n; f64 only: f32
 * partials take colsum_partials_launch). */
__global__ void column_sums_f64(int64_t P, int64_t n, const double* part, double* dst) {
  int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += step) {
    double acc = 0;
    for (int64_t p = 0; p < P; p++) acc += part[p * n + j];
    dst[j] = acc;
  }
}

int64_t n_partials(int64_t m) { return m < kMaxPartials ? (m < 1 ? 1 : m) : kMaxPartials; }

/* ---------------------------------------------------------------- vector path */
__device__ __forceinline__ float warp_sum_rn(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = KCM_ADD(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/* One warp per row; lane l holds the vectors l, l + 32, ... (NV at most). */
template <typename T, int NV>
__global__ void __launch_bounds__(kVecThreads) norm_fwd_vec(int rms, int64_t m, int64_t n, const T* x, const T* res,
                                                            T* h, const T* w, const T* b, float eps, T* y, float* mean,
                                                            float* rstd) {
  constexpr int V = 16 / sizeof(T);
  const int lane = threadIdx.x & 31;
  const int64_t row = (int64_t)blockIdx.x * KCM_NORM_WARPS + (threadIdx.x >> 5);
  if (row >= m) return; /* whole warps: no block-wide sync below */
  const int64_t off = row * n;
  float v[NV][V];
#pragma unroll
  for (int i = 0; i < NV; i++) {
    const int64_t c = ((int64_t)i * 32 + lane) * V;
    if (c < n) {
      kvec_load<T, V>(x + off + c, v[i]);
      if (res) {
        float r[V];
        kvec_load<T, V>(res + off + c, r);
#pragma unroll
        for (int k = 0; k < V; k++) v[i][k] = kload(kstore<T>(KCM_ADD(v[i][k], r[k])));
        kvec_store<T, V>(h + off + c, v[i]); /* exact: v holds T values */
      }
    }
  }
  float mu = 0.0f;
  if (!rms) {
    float s1 = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; i++)
      if (((int64_t)i * 32 + lane) * V < n)
#pragma unroll
        for (int k = 0; k < V; k++) s1 = KCM_ADD(s1, v[i][k]);
    mu = kcm_norm_mean(warp_sum_rn(s1), n);
  }
  float s2 = 0.0f;
#pragma unroll
  for (int i = 0; i < NV; i++)
    if (((int64_t)i * 32 + lane) * V < n)
#pragma unroll
      for (int k = 0; k < V; k++) s2 = kcm_norm_var_term(s2, v[i][k], mu);
  const float rs = kcm_norm_rstd(warp_sum_rn(s2), n, eps);
  if (lane == 0) {
    if (mean) mean[row] = mu;
    rstd[row] = rs;
  }
#pragma unroll
  for (int i = 0; i < NV; i++) {
    const int64_t c = ((int64_t)i * 32 + lane) * V;
    if (c < n) {
      float wv[V] = {0}, bv[V] = {0}, o[V];
      if (w) kvec_load<T, V>(w + c, wv);
      if (b) kvec_load<T, V>(b + c, bv);
#pragma unroll
      for (int k = 0; k < V; k++) o[k] = kcm_norm_y(v[i][k], mu, rs, w != NULL, w ? wv[k] : 0.0f, b != NULL, b ? bv[k] : 0.0f);
      kvec_store<T, V>(y + off + c, o);
    }
  }
}

/* The end of the vectorised backward: the block adds its warps' weight / bias gradient sums in order 0..W-1 in
 * shared memory (2 n floats) and writes them as its partial rows of ws (dw: row blockIdx.x, db: row P + blockIdx.x). */
template <int NV, int V>
__device__ __forceinline__ void block_partials(const float (&adw)[NV][V], const float (&adb)[NV][V], int64_t n, int lane,
                                               int warp, float* shp, float* ws, int need_dw, int need_db) {
  float* sdw = shp;
  float* sdb = shp + n;
  for (int q = 0; q < KCM_NORM_WARPS; q++) { /* warps in order 0..W-1 */
    if (warp == q) {
#pragma unroll
      for (int i = 0; i < NV; i++) {
        const int64_t c = ((int64_t)i * 32 + lane) * V;
        if (c < n)
#pragma unroll
          for (int k = 0; k < V; k++) {
            if (need_dw) sdw[c + k] = q == 0 ? adw[i][k] : KCM_ADD(sdw[c + k], adw[i][k]);
            if (need_db) sdb[c + k] = q == 0 ? adb[i][k] : KCM_ADD(sdb[c + k], adb[i][k]);
          }
      }
    }
    __syncthreads();
  }
  const int64_t P = gridDim.x;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    if (need_dw) ws[(int64_t)blockIdx.x * n + j] = sdw[j];
    if (need_db) ws[(P + blockIdx.x) * n + j] = sdb[j];
  }
}

/* Block p: rows [p R, min(m, (p + 1) R)), warp w the rows p R + w + k W.
 * ws: rows p (dw partials) and P + p (db partials), f32.  Shared memory:
 * 2 n floats. */
template <typename T, int NV>
__global__ void __launch_bounds__(kVecThreads) norm_bwd_vec(int rms, int64_t m, int64_t n, int64_t R, const T* go,
                                                            const T* x, const T* w, const float* mean,
                                                            const float* rstd, const T* gres, T* dx, float* ws,
                                                            int need_dw, int need_db) {
  extern __shared__ float shp[];
  constexpr int V = 16 / sizeof(T);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r0 = (int64_t)blockIdx.x * R;
  const int64_t r1 = r0 + R < m ? r0 + R : m;
  float wv[NV][V], adw[NV][V], adb[NV][V];
#pragma unroll
  for (int i = 0; i < NV; i++) {
    const int64_t c = ((int64_t)i * 32 + lane) * V;
#pragma unroll
    for (int k = 0; k < V; k++) { wv[i][k] = 1.0f; adw[i][k] = 0.0f; adb[i][k] = 0.0f; }
    if (w && c < n) kvec_load<T, V>(w + c, wv[i]);
  }
  for (int64_t row = r0 + warp; row < r1; row += KCM_NORM_WARPS) {
    const int64_t off = row * n;
    const float mu = (rms || !mean) ? 0.0f : mean[row], rs = rstd[row];
    float g[NV][V], xh[NV][V];
#pragma unroll
    for (int i = 0; i < NV; i++) {
      const int64_t c = ((int64_t)i * 32 + lane) * V;
      if (c < n) {
        kvec_load<T, V>(go + off + c, g[i]);
        kvec_load<T, V>(x + off + c, xh[i]);
#pragma unroll
        for (int k = 0; k < V; k++) xh[i][k] = kcm_norm_xhat(xh[i][k], mu, rs);
      }
    }
    if (dx) {
      float sa = 0.0f, sb = 0.0f;
#pragma unroll
      for (int i = 0; i < NV; i++)
        if (((int64_t)i * 32 + lane) * V < n)
#pragma unroll
          for (int k = 0; k < V; k++) {
            const float wdy = w ? KCM_MUL(g[i][k], wv[i][k]) : g[i][k];
            if (!rms) sa = KCM_ADD(sa, wdy);
            sb = KCM_FMA(wdy, xh[i][k], sb);
          }
      const float a = rms ? 0.0f : KCM_DIV(warp_sum_rn(sa), (float)n);
      const float cc = KCM_DIV(warp_sum_rn(sb), (float)n);
#pragma unroll
      for (int i = 0; i < NV; i++) {
        const int64_t c = ((int64_t)i * 32 + lane) * V;
        if (c < n) {
          float d[V], gr[V];
          if (gres) kvec_load<T, V>(gres + off + c, gr);
#pragma unroll
          for (int k = 0; k < V; k++) {
            const float wdy = w ? KCM_MUL(g[i][k], wv[i][k]) : g[i][k];
            d[k] = kcm_norm_dx_rn(rms, wdy, xh[i][k], rs, a, cc);
            if (gres) d[k] = KCM_ADD(kload(kstore<T>(d[k])), gr[k]);
          }
          kvec_store<T, V>(dx + off + c, d);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < NV; i++)
      if (((int64_t)i * 32 + lane) * V < n)
#pragma unroll
        for (int k = 0; k < V; k++) {
          if (need_dw) adw[i][k] = KCM_FMA(g[i][k], xh[i][k], adw[i][k]);
          if (need_db) adb[i][k] = KCM_ADD(adb[i][k], g[i][k]);
        }
  }
  if (!need_dw && !need_db) return; /* uniform over the block */
  block_partials<NV, V>(adw, adb, n, lane, warp, shp, ws, need_dw, need_db);
}

/* norm_bwd_vec with fewer registers (the default for half rows; ENGINE_NORM_BWD=wide runs norm_bwd_vec): the same
 * partition, the same operations in the same order, so the same bits (spec/c/test_cuda_norm.c compares both with its
 * emulation), but the row's gradient, input and the weight stay packed in their 16-byte vectors (T values) and each
 * xhat is recomputed from them where it is used, instead of NV x V floats each held across the row: 162 registers
 * (one 256-thread block per SM) become about half, so two or more blocks share an SM and hide the loads' latency.
 * On the H200 the backward ran at about 460 GB/s (82 us for a 8192 x 768 bf16 layer norm, docs/gpu-runs/2026-11-28-b.md). */
template <typename T, int NV>
__global__ void __launch_bounds__(kVecThreads, NV <= 3 ? 2 : 1) norm_bwd_vec_lean(int rms, int64_t m, int64_t n, int64_t R,
                                                                    const T* go, const T* x, const T* w,
                                                                    const float* mean, const float* rstd,
                                                                    const T* gres, T* dx, float* ws, int need_dw,
                                                                    int need_db) {
  extern __shared__ float shp[];
  constexpr int V = 16 / sizeof(T);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r0 = (int64_t)blockIdx.x * R;
  const int64_t r1 = r0 + R < m ? r0 + R : m;
  kvec<T, V> wp[NV];
  float adw[NV][V], adb[NV][V];
#pragma unroll
  for (int i = 0; i < NV; i++) {
    const int64_t c = ((int64_t)i * 32 + lane) * V;
    wp[i].u = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int k = 0; k < V; k++) { adw[i][k] = 0.0f; adb[i][k] = 0.0f; }
    if (w && c < n) wp[i].u = *(const uint4*)(w + c);
  }
  for (int64_t row = r0 + warp; row < r1; row += KCM_NORM_WARPS) {
    const int64_t off = row * n;
    const float mu = (rms || !mean) ? 0.0f : mean[row], rs = rstd[row];
    kvec<T, V> gp[NV], xp[NV];
#pragma unroll
    for (int i = 0; i < NV; i++) {
      const int64_t c = ((int64_t)i * 32 + lane) * V;
      if (c < n) {
        gp[i].u = *(const uint4*)(go + off + c);
        xp[i].u = *(const uint4*)(x + off + c);
      }
    }
    if (dx) {
      float sa = 0.0f, sb = 0.0f;
#pragma unroll
      for (int i = 0; i < NV; i++)
        if (((int64_t)i * 32 + lane) * V < n)
#pragma unroll
          for (int k = 0; k < V; k++) {
            const float g = kload(gp[i].e[k]), xh = kcm_norm_xhat(kload(xp[i].e[k]), mu, rs);
            const float wdy = w ? KCM_MUL(g, kload(wp[i].e[k])) : g;
            if (!rms) sa = KCM_ADD(sa, wdy);
            sb = KCM_FMA(wdy, xh, sb);
          }
      const float a = rms ? 0.0f : KCM_DIV(warp_sum_rn(sa), (float)n);
      const float cc = KCM_DIV(warp_sum_rn(sb), (float)n);
#pragma unroll
      for (int i = 0; i < NV; i++) {
        const int64_t c = ((int64_t)i * 32 + lane) * V;
        if (c < n) {
          kvec<T, V> gr, o;
          if (gres) gr.u = *(const uint4*)(gres + off + c);
#pragma unroll
          for (int k = 0; k < V; k++) {
            const float g = kload(gp[i].e[k]), xh = kcm_norm_xhat(kload(xp[i].e[k]), mu, rs);
            const float wdy = w ? KCM_MUL(g, kload(wp[i].e[k])) : g;
            float d = kcm_norm_dx_rn(rms, wdy, xh, rs, a, cc);
            if (gres) d = KCM_ADD(kload(kstore<T>(d)), kload(gr.e[k]));
            o.e[k] = kstore<T>(d);
          }
          *(uint4*)(dx + off + c) = o.u;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < NV; i++)
      if (((int64_t)i * 32 + lane) * V < n)
#pragma unroll
        for (int k = 0; k < V; k++) {
          const float g = kload(gp[i].e[k]);
          if (need_dw) adw[i][k] = KCM_FMA(g, kcm_norm_xhat(kload(xp[i].e[k]), mu, rs), adw[i][k]);
          if (need_db) adb[i][k] = KCM_ADD(adb[i][k], g);
        }
  }
  if (!need_dw && !need_db) return; /* uniform over the block */
  block_partials<NV, V>(adw, adb, n, lane, warp, shp, ws, need_dw, need_db);
}

/* Half-precision rows take norm_bwd_vec_lean unless ENGINE_NORM_BWD=wide (norm_bwd_vec; read once).  The lean
 * kernel became the default after two H200 measurements in run 3 of 2026-11-28-b: the GPT-2 step 22.1 -> 21.0 ms
 * in one pair, and the op alone (recipes/bench/gpu_kernels.lua) layer_norm backward 181 -> 145 us, add_layer_norm
 * 392 -> 347 us; test_cuda_norm passed it bit for bit against the emulation there. */
int norm_bwd_lean() {
  static int on = -1;
  if (on < 0) {
    const char* e = getenv("ENGINE_NORM_BWD");
    on = !(e && strcmp(e, "wide") == 0);
  }
  return on;
}

/* ---------------------------------------------------------------- launchers */
int aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }

/* NV of the vector path, rounded up to an instantiated one (0: generic). */
template <typename T>
int vec_nv(int64_t n, const void* a, const void* b, const void* c, const void* d, const void* e, const void* f) {
  if (sizeof(T) == 8) return 0;
  int nv = kcm_norm_nv(n, 16 / (int)sizeof(T));
  if (!nv || !aligned16(a) || !aligned16(b) || !aligned16(c) || !aligned16(d) || !aligned16(e) || !aligned16(f))
    return 0;
  return nv <= 4 ? nv : (nv <= 6 ? 6 : 8);
}

template <typename T, int NV>
void fwd_vec_launch(int rms, int64_t m, int64_t n, const void* x, const void* res, void* h, const void* w,
                    const void* b, double eps, void* y, void* mean, void* rstd, cudaStream_t s) {
  norm_fwd_vec<T, NV><<<(unsigned)kcu_cdiv(m, KCM_NORM_WARPS), kVecThreads, 0, s>>>(
      rms, m, n, (const T*)x, (const T*)res, (T*)h, (const T*)w, (const T*)b, (float)eps, (T*)y, (float*)mean,
      (float*)rstd);
}

template <typename T, int NV>
void bwd_vec_launch(int rms, int64_t m, int64_t n, const void* go, const void* x, const void* w, const void* mean,
                    const void* rstd, const void* gres, void* dx, void* ws, int need_dw, int need_db, cudaStream_t s) {
  int64_t R = kcm_norm_bwd_rows(m), P = kcm_norm_bwd_blocks(m);
  size_t shm = need_dw || need_db ? (size_t)(2 * n) * sizeof(float) : 0;
  if constexpr (sizeof(T) == 2) {
    if (norm_bwd_lean()) {
      norm_bwd_vec_lean<T, NV><<<(unsigned)P, kVecThreads, shm, s>>>(rms, m, n, R, (const T*)go, (const T*)x,
                                                                    (const T*)w, (const float*)mean,
                                                                    (const float*)rstd, (const T*)gres, (T*)dx,
                                                                    (float*)ws, need_dw, need_db);
      return;
    }
  }
  norm_bwd_vec<T, NV><<<(unsigned)P, kVecThreads, shm, s>>>(rms, m, n, R, (const T*)go, (const T*)x, (const T*)w,
                                                           (const float*)mean, (const float*)rstd, (const T*)gres,
                                                           (T*)dx, (float*)ws, need_dw, need_db);
}

#define NV_SWITCH(nv, F, ...)                 \
  switch (nv) {                               \
    case 1: F<T, 1>(__VA_ARGS__); break;      \
    case 2: F<T, 2>(__VA_ARGS__); break;      \
    case 3: F<T, 3>(__VA_ARGS__); break;      \
    case 4: F<T, 4>(__VA_ARGS__); break;      \
    case 6: F<T, 6>(__VA_ARGS__); break;      \
    default: F<T, 8>(__VA_ARGS__); break;     \
  }

template <typename T>
int norm_fwd_t(int rms, int64_t m, int64_t n, const void* x, const void* res, void* h, const void* w, const void* b,
               double eps, void* y, void* mean, void* rstd, cudaStream_t s) {
  typedef typename kacc<T>::type A;
  int nv = vec_nv<T>(n, x, res, h, w, b, y);
  if constexpr (sizeof(T) != 8) {
    if (nv) NV_SWITCH(nv, fwd_vec_launch, rms, m, n, x, res, h, w, b, eps, y, mean, rstd, s)
  }
  if (!nv) {
    norm_fwd<T><<<kcu_grid(m, 1, 1 << 20), norm_threads(n), 0, s>>>(rms, m, n, (const T*)x, (const T*)res, (T*)h,
                                                                    (const T*)w, (const T*)b, eps, (T*)y, (A*)mean,
                                                                    (A*)rstd);
  }
  return kcu_launch_status();
}

template <typename T>
int norm_bwd_t(int rms, int64_t m, int64_t n, const void* go, const void* x, const void* w, const void* mean,
               const void* rstd, const void* gres, void* dx, void* dw, void* db, void* ws, cudaStream_t s) {
  typedef typename kacc<T>::type A;
  int nv = vec_nv<T>(n, go, x, w, gres, dx, NULL);
  int64_t P = kcm_norm_bwd_blocks(m);
  if constexpr (sizeof(T) != 8) {
    if (nv) NV_SWITCH(nv, bwd_vec_launch, rms, m, n, go, x, w, mean, rstd, gres, dx, ws, dw != NULL, db != NULL, s)
  }
  if (!nv) {
    P = n_partials(m);
    norm_bwd<T><<<(unsigned)P, norm_threads(n), 0, s>>>(rms, m, n, (const T*)go, (const T*)x, (const T*)w,
                                                         (const A*)mean, (const A*)rstd, (const T*)gres, (T*)dx,
                                                         (A*)ws, dw != NULL, db != NULL);
  }
  if (sizeof(A) == 8) {
    unsigned grid = kcu_grid(n, 256, 1 << 16);
    if (dw) column_sums_f64<<<grid, 256, 0, s>>>(P, n, (const double*)ws, (double*)dw);
    if (db) column_sums_f64<<<grid, 256, 0, s>>>(P, n, (const double*)ws + P * n, (double*)db);
  } else {
    if (dw) colsum_partials_launch(P, n, (const float*)ws, dw, kdt_of<T>(), 1.0f, s);
    if (db) colsum_partials_launch(P, n, (const float*)ws + P * n, db, kdt_of<T>(), 1.0f, s);
  }
  return kcu_launch_status();
}

}  // namespace

extern "C" int kcu_add_norm_fwd(int dt, int rms, int64_t m, int64_t n, const void* x, const void* r, void* h,
                                const void* w, const void* b, double eps, void* y, void* mean, void* rstd,
                                cudaStream_t s) {
  if (m < 0 || n < 1 || !(eps >= 0)) return KCU_EARG;
  if (m == 0) return KCU_OK;
  if (!x || !y || !rstd || (r && !h)) return KCU_EARG;
  if (!r) h = NULL;
  switch (dt) {
    case KCU_F32: return norm_fwd_t<float>(rms, m, n, x, r, h, w, b, eps, y, mean, rstd, s);
    case KCU_F64: return norm_fwd_t<double>(rms, m, n, x, r, h, w, b, eps, y, mean, rstd, s);
    case KCU_BF16: return norm_fwd_t<kbf16>(rms, m, n, x, r, h, w, b, eps, y, mean, rstd, s);
    case KCU_F16: return norm_fwd_t<kf16>(rms, m, n, x, r, h, w, b, eps, y, mean, rstd, s);
    default: return KCU_EARG;
  }
}

extern "C" int kcu_norm_fwd(int dt, int rms, int64_t m, int64_t n, const void* x, const void* w, const void* b,
                            double eps, void* y, void* mean, void* rstd, cudaStream_t s) {
  return kcu_add_norm_fwd(dt, rms, m, n, x, NULL, NULL, w, b, eps, y, mean, rstd, s);
}

extern "C" size_t kcu_norm_bwd_workspace(int64_t m, int64_t n, int dt) {
  if (m < 0 || n < 1) return 0;
  /* the generic path's partial rows; the vector path needs fewer (f32) */
  return (size_t)(2 * n_partials(m) * n) * (dt == KCU_F64 ? sizeof(double) : sizeof(float));
}

extern "C" int kcu_norm_bwd_res(int dt, int rms, int64_t m, int64_t n, const void* gy, const void* x, const void* w,
                                const void* mean, const void* rstd, const void* gres, void* dx, void* dw, void* db,
                                void* ws, cudaStream_t s) {
  if (m < 0 || n < 1) return KCU_EARG;
  if (gres && !dx) return KCU_EARG;
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
    case KCU_F32: return norm_bwd_t<float>(rms, m, n, gy, x, w, mean, rstd, gres, dx, dw, db, ws, s);
    case KCU_F64: return norm_bwd_t<double>(rms, m, n, gy, x, w, mean, rstd, gres, dx, dw, db, ws, s);
    case KCU_BF16: return norm_bwd_t<kbf16>(rms, m, n, gy, x, w, mean, rstd, gres, dx, dw, db, ws, s);
    case KCU_F16: return norm_bwd_t<kf16>(rms, m, n, gy, x, w, mean, rstd, gres, dx, dw, db, ws, s);
    default: return KCU_EARG;
  }
}

extern "C" int kcu_norm_bwd(int dt, int rms, int64_t m, int64_t n, const void* gy, const void* x, const void* w,
                            const void* mean, const void* rstd, void* dx, void* dw, void* db, void* ws,
                            cudaStream_t s) {
  return kcu_norm_bwd_res(dt, rms, m, n, gy, x, w, mean, rstd, NULL, dx, dw, db, ws, s);
}
