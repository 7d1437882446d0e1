/* optim.cu: multi-tensor AdamW, global norms and gradient scaling.
 *
 * Multi-tensor launches: the host cuts every tensor into chunks of kChunk
 * elements and packs a table (up to kMtT tensors, kMtB chunks) into the
 * kernel's parameters; block b works on chunk tab.bc[b] of tensor
 * tab.bt[b].  A step over all parameters of a model is a handful of launches
 * and no device-side table.  The AdamW element update is kcuda_math.cuh's
 * (torch.optim.AdamW's operation order, as kernels/cpu/optim.c); f32
 * weights and states (f32 params, or f32 master weights with a bf16/f16
 * copy) take a vectorised kernel without per-element dtype switches.  Norms
 * write one partial per chunk into a workspace and a final single-block
 * kernel combines them in order: deterministic. */
#include "common.cuh"

namespace {

const int kMtT = 24;
const int kMtB = 320;
const int64_t kChunk = 65536;
const int kMtThreads = 512;

struct MtTable {
  void* p[kMtT];
  const void* g[kMtT];
  void* m[kMtT];
  void* v[kMtT];
  void* c[kMtT];
  int64_t n[kMtT];
  int32_t bc[kMtB];
  uint8_t bt[kMtB];
};

/* Packs the non-empty tensors t with keep(t) into tables and calls
 * launch(tab, nblocks, first_global_block) for each; stops at the first
 * non-zero status. */
template <typename K, typename L>
int mt_foreach_if(int n, const int64_t* numel, void* const* p, const void* const* g, void* const* m,
                  void* const* v, void* const* c, K keep, L launch) {
  MtTable tab;
  memset(&tab, 0, sizeof tab);
  int nt = 0, nb = 0;
  int64_t base = 0;
  for (int t = 0; t < n; t++) {
    if (numel[t] <= 0 || !keep(t)) continue;
    tab.p[nt] = p ? p[t] : NULL;
    tab.g[nt] = g ? g[t] : NULL;
    tab.m[nt] = m ? m[t] : NULL;
    tab.v[nt] = v ? v[t] : NULL;
    tab.c[nt] = c ? c[t] : NULL;
    tab.n[nt] = numel[t];
    int64_t nch = kcu_cdiv(numel[t], kChunk);
    for (int64_t ch = 0; ch < nch; ch++) {
      tab.bt[nb] = (uint8_t)nt;
      tab.bc[nb] = (int32_t)ch;
      nb++;
      if (nb == kMtB) {
        int e = launch(tab, nb, base);
        if (e) return e;
        base += nb;
        nb = 0;
        if (ch + 1 < nch) { /* the tensor goes on in the next table, as entry 0 */
          tab.p[0] = tab.p[nt]; tab.g[0] = tab.g[nt]; tab.m[0] = tab.m[nt]; tab.v[0] = tab.v[nt];
          tab.c[0] = tab.c[nt]; tab.n[0] = tab.n[nt];
          nt = 0;
        } else {
          nt = -1;
        }
      }
    }
    nt++;
    if (nt == kMtT) {
      if (nb > 0) {
        int e = launch(tab, nb, base);
        if (e) return e;
        base += nb;
        nb = 0;
      }
      nt = 0;
    }
  }
  if (nb > 0) return launch(tab, nb, base);
  return KCU_OK;
}

template <typename L>
int mt_foreach(int n, const int64_t* numel, void* const* p, const void* const* g, void* const* m, void* const* v,
               void* const* c, L launch) {
  return mt_foreach_if(n, numel, p, g, m, v, c, [](int) { return true; }, launch);
}

__global__ void __launch_bounds__(kMtThreads) adamw_kernel(MtTable tab, int pdt, int gdt, int sdt, int cdt,
                                                           kcm_adamw_f32c c32, kcm_adamw_f64c c64,
                                                           const float* gscale) {
  const int t = tab.bt[blockIdx.x];
  const int64_t n = tab.n[t], start = (int64_t)tab.bc[blockIdx.x] * kChunk;
  const int64_t end = start + kChunk < n ? start + kChunk : n;
  void *P = tab.p[t], *M = tab.m[t], *V = tab.v[t], *Cp = tab.c[t];
  const void* G = tab.g[t];
  const float gs = gscale ? *gscale : 1.0f;
  if (pdt == KCU_F64) {
    for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
      double p = ((double*)P)[i], m = kld_dt(M, sdt, i), v = kld_dt(V, sdt, i);
      double g = kld_dt(G, gdt, i) * (double)gs;
      kcm_adamw_f64(&c64, &p, g, &m, &v);
      ((double*)P)[i] = p;
      kst_dt(M, sdt, i, m);
      kst_dt(V, sdt, i, v);
      if (Cp) kst_dt(Cp, cdt, i, p);
    }
    return;
  }
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    float p = kldf_dt(P, pdt, i), m = kldf_dt(M, sdt, i), v = kldf_dt(V, sdt, i);
    float g = kldf_dt(G, gdt, i);
    if (gscale) g *= gs;
    kcm_adamw_f32(&c32, &p, g, &m, &v);
    kstf_dt(P, pdt, i, p);
    kstf_dt(M, sdt, i, m);
    kstf_dt(V, sdt, i, v);
    if (Cp) kstf_dt(Cp, cdt, i, p);
  }
}

/* The vectorised AdamW of the common mixed-precision cases: f32 updated
 * weights (f32 params, or the f32 master weights of half params) and f32
 * states, grads GT (f32 bf16 f16), optional copy CT (bf16 f16: the half
 * params of master weights).  Each thread takes 4 consecutive elements per
 * iteration with 16-byte loads of the f32 arrays and 8-byte loads of half
 * ones (the host sends only tensors whose pointers are aligned for that);
 * chunk starts are multiples of kChunk, so only a tensor's last chunk has a
 * tail (< 4 elements), done element by element.  No dtype switch per
 * element: the element math is kcm_adamw_f32, as in adamw_kernel. */
template <typename T> struct alignas(4 * sizeof(T)) vec4 { T v[4]; };
__device__ __forceinline__ float vload(float x) { return x; }
__device__ __forceinline__ float vload(kbf16 x) { return kload(x); }
__device__ __forceinline__ float vload(kf16 x) { return kload(x); }

/* PT, ST: the weights' and states' types (f32, or bf16/f16 for all-half training, whose element math is the same
 * f32 update between a load and a rounding store, as in adamw_kernel). */
template <typename PT, typename ST, typename GT, typename CT, bool COPY>
__global__ void __launch_bounds__(kMtThreads) adamw_vec_kernel(MtTable tab, kcm_adamw_f32c c, const float* gscale) {
  const int t = tab.bt[blockIdx.x];
  const int64_t n = tab.n[t], start = (int64_t)tab.bc[blockIdx.x] * kChunk;
  const int64_t end = start + kChunk < n ? start + kChunk : n;
  const int64_t vend = start + ((end - start) & ~(int64_t)3);
  PT* P = (PT*)tab.p[t];
  ST* M = (ST*)tab.m[t];
  ST* V = (ST*)tab.v[t];
  const GT* G = (const GT*)tab.g[t];
  CT* Cp = (CT*)tab.c[t];
  const float gs = gscale ? *gscale : 1.0f;
  for (int64_t i = start + 4 * (int64_t)threadIdx.x; i < vend; i += 4 * (int64_t)blockDim.x) {
    vec4<PT> pv = *reinterpret_cast<const vec4<PT>*>(P + i);
    vec4<ST> mv = *reinterpret_cast<const vec4<ST>*>(M + i);
    vec4<ST> vv = *reinterpret_cast<const vec4<ST>*>(V + i);
    vec4<GT> g = *reinterpret_cast<const vec4<GT>*>(G + i);
    float p[4], m[4], v[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
      float gk = vload(g.v[k]);
      if (gscale) gk *= gs;
      p[k] = vload(pv.v[k]); m[k] = vload(mv.v[k]); v[k] = vload(vv.v[k]);
      kcm_adamw_f32(&c, &p[k], gk, &m[k], &v[k]);
      pv.v[k] = kstore<PT>(p[k]); mv.v[k] = kstore<ST>(m[k]); vv.v[k] = kstore<ST>(v[k]);
    }
    *reinterpret_cast<vec4<PT>*>(P + i) = pv;
    *reinterpret_cast<vec4<ST>*>(M + i) = mv;
    *reinterpret_cast<vec4<ST>*>(V + i) = vv;
    if (COPY) {
      vec4<CT> o;
#pragma unroll
      for (int k = 0; k < 4; k++) o.v[k] = kstore<CT>(p[k]);
      *reinterpret_cast<vec4<CT>*>(Cp + i) = o;
    }
  }
  for (int64_t i = vend + threadIdx.x; i < end; i += blockDim.x) {
    float p = vload(P[i]), m = vload(M[i]), v = vload(V[i]), g = vload(G[i]);
    if (gscale) g *= gs;
    kcm_adamw_f32(&c, &p, g, &m, &v);
    P[i] = kstore<PT>(p); M[i] = kstore<ST>(m); V[i] = kstore<ST>(v);
    if (COPY) Cp[i] = kstore<CT>(p);
  }
}

template <typename GT, typename CT, bool COPY, typename K>
int adamw_vec_launch(int n, void* const* p, const void* const* g, void* const* m, void* const* v, void* const* pc,
                     const int64_t* numel, const kcm_adamw_f32c& c, const float* gscale, K keep, cudaStream_t s) {
  return mt_foreach_if(n, numel, p, g, m, v, pc, keep, [&](const MtTable& tab, int nb, int64_t) {
    adamw_vec_kernel<float, float, GT, CT, COPY><<<nb, kMtThreads, 0, s>>>(tab, c, gscale);
    return kcu_launch_status();
  });
}

template <typename GT, typename K>
int adamw_vec_copy(int cdt, int n, void* const* p, const void* const* g, void* const* m, void* const* v,
                   void* const* pc, const int64_t* numel, const kcm_adamw_f32c& c, const float* gscale, K keep,
                   cudaStream_t s) {
  if (!pc) return adamw_vec_launch<GT, float, false>(n, p, g, m, v, NULL, numel, c, gscale, keep, s);
  if (cdt == KCU_BF16) return adamw_vec_launch<GT, kbf16, true>(n, p, g, m, v, pc, numel, c, gscale, keep, s);
  return adamw_vec_launch<GT, kf16, true>(n, p, g, m, v, pc, numel, c, gscale, keep, s);
}

/* All-half training (bf16 or f16 weights, gradients and states, no copy): the vectorised kernel in that type. */
template <typename T, typename K>
int adamw_half_launch(int n, void* const* p, const void* const* g, void* const* m, void* const* v,
                      const int64_t* numel, const kcm_adamw_f32c& c, const float* gscale, K keep, cudaStream_t s) {
  return mt_foreach_if(n, numel, p, g, m, v, NULL, keep, [&](const MtTable& tab, int nb, int64_t) {
    adamw_vec_kernel<T, T, T, T, false><<<nb, kMtThreads, 0, s>>>(tab, c, gscale);
    return kcu_launch_status();
  });
}

/* 1 when kcu_adamw's arguments take the vectorised kernel: f32 weights and
 * states, f32/bf16/f16 grads, no copy or a bf16/f16 one. */
int adamw_vec_types(int pdt, int gdt, int sdt, int has_copy, int cdt) {
  return pdt == KCU_F32 && sdt == KCU_F32 && (gdt == KCU_F32 || gdt == KCU_BF16 || gdt == KCU_F16) &&
         (!has_copy || cdt == KCU_BF16 || cdt == KCU_F16);
}
/* Tensor i's pointers allow 4-element vector accesses. */
int adamw_vec_aligned(const void* p, const void* g, const void* m, const void* v, const void* c, int gsz, int csz) {
  return ((uintptr_t)p % 16) == 0 && ((uintptr_t)m % 16) == 0 && ((uintptr_t)v % 16) == 0 &&
         ((uintptr_t)g % (uintptr_t)(4 * gsz)) == 0 && (!c || ((uintptr_t)c % (uintptr_t)(4 * csz)) == 0);
}

/* kind 1: sum of squares, 3: max |x| (NaN propagates). */
__global__ void __launch_bounds__(kMtThreads) norm_partial(MtTable tab, int dt, int kind, double* ws, int64_t base) {
  __shared__ double sh[32];
  const int t = tab.bt[blockIdx.x];
  const int64_t n = tab.n[t], start = (int64_t)tab.bc[blockIdx.x] * kChunk;
  const int64_t end = start + kChunk < n ? start + kChunk : n;
  const void* X = tab.p[t];
  double acc = 0.0;
  if (kind == 1) {
    float a = 0.0f;
    for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
      float x = dt == KCU_F64 ? 0.0f : kldf_dt(X, dt, i);
      if (dt == KCU_F64) { double xd = ((const double*)X)[i]; acc += xd * xd; }
      else a += x * x;
    }
    acc += (double)a;
    acc = block_sum(acc, sh);
  } else {
    for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) acc = kmax_nan(acc, fabs(kld_dt(X, dt, i)));
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc = kmax_nan(acc, __shfl_xor_sync(0xffffffffu, acc, o));
    if (lane == 0) sh[w] = acc;
    __syncthreads();
    acc = 0.0;
    for (int k = 0; k < nw; k++) acc = kmax_nan(acc, sh[k]);
  }
  if (threadIdx.x == 0) ws[base + blockIdx.x] = acc;
}

__global__ void norm_final(int64_t nb, const double* ws, int kind, double* out) {
  __shared__ double sh[32];
  double acc = 0.0;
  if (kind == 1) {
    for (int64_t i = threadIdx.x; i < nb; i += blockDim.x) acc += ws[i];
    acc = block_sum(acc, sh);
    if (threadIdx.x == 0) *out = sqrt(acc);
  } else {
    for (int64_t i = threadIdx.x; i < nb; i += blockDim.x) acc = kmax_nan(acc, ws[i]);
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc = kmax_nan(acc, __shfl_xor_sync(0xffffffffu, acc, o));
    if (lane == 0) sh[w] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
      double r = 0.0;
      for (int k = 0; k < nw; k++) r = kmax_nan(r, sh[k]);
      *out = r;
    }
  }
}

__global__ void clip_coef_kernel(const double* norm, double max_norm, float* coef) {
  *coef = (float)kcm_clip_coef(*norm, max_norm);
}

__global__ void __launch_bounds__(kMtThreads) scale_kernel(MtTable tab, int dt, const float* scale, double scale_host) {
  const int t = tab.bt[blockIdx.x];
  const int64_t n = tab.n[t], start = (int64_t)tab.bc[blockIdx.x] * kChunk;
  const int64_t end = start + kChunk < n ? start + kChunk : n;
  void* X = tab.p[t];
  if (dt == KCU_F64) {
    double s = (scale ? (double)*scale : 1.0) * scale_host;
    for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) ((double*)X)[i] *= s;
  } else {
    float s = (float)((scale ? (double)*scale : 1.0) * scale_host);
    for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) kstf_dt(X, dt, i, kldf_dt(X, dt, i) * s);
  }
}

int is_float(int dt) { return dt == KCU_F32 || dt == KCU_F64 || dt == KCU_BF16 || dt == KCU_F16; }

}  // namespace

extern "C" int kcu_adamw(int n, void* const* p, const void* const* g, void* const* m, void* const* v,
                         const int64_t* numel, int pdt, int gdt, int sdt, void* const* pcopy, int cdt,
                         const kcu_adamw_hparams* hp, const float* grad_scale, cudaStream_t s) {
  if (n < 0 || !hp || hp->step < 1) return KCU_EARG;
  if (n == 0) return KCU_OK;
  if (!p || !g || !m || !v || !numel) return KCU_EARG;
  if (!is_float(pdt) || !is_float(gdt) || !is_float(sdt) || (pcopy && !is_float(cdt))) return KCU_EARG;
  if (pdt == KCU_F64 && (gdt != KCU_F64 || sdt != KCU_F64)) return KCU_EARG;
  for (int i = 0; i < n; i++)
    if (numel[i] > 0 && (!p[i] || !g[i] || !m[i] || !v[i] || (pcopy && !pcopy[i]))) return KCU_EARG;
  kcm_adamw_f32c c32 = kcm_adamw_consts_f32(hp->lr, hp->beta1, hp->beta2, hp->eps, hp->weight_decay, hp->step);
  kcm_adamw_f64c c64 = kcm_adamw_consts_f64(hp->lr, hp->beta1, hp->beta2, hp->eps, hp->weight_decay, hp->step);
  if ((pdt == KCU_BF16 || pdt == KCU_F16) && gdt == pdt && sdt == pdt && !pcopy) {
    auto aligned = [&](int i) {
      return ((uintptr_t)p[i] % 8) == 0 && ((uintptr_t)g[i] % 8) == 0 && ((uintptr_t)m[i] % 8) == 0 &&
             ((uintptr_t)v[i] % 8) == 0;
    };
    auto unaligned = [&](int i) { return !aligned(i); };
    int e = pdt == KCU_BF16 ? adamw_half_launch<kbf16>(n, p, g, m, v, numel, c32, grad_scale, aligned, s)
                            : adamw_half_launch<kf16>(n, p, g, m, v, numel, c32, grad_scale, aligned, s);
    if (e) return e;
    return mt_foreach_if(n, numel, p, g, m, v, pcopy, unaligned, [&](const MtTable& tab, int nb, int64_t) {
      adamw_kernel<<<nb, kMtThreads, 0, s>>>(tab, pdt, gdt, sdt, cdt, c32, c64, grad_scale);
      return kcu_launch_status();
    });
  }
  if (adamw_vec_types(pdt, gdt, sdt, pcopy != NULL, cdt)) {
    /* aligned tensors through the vectorised kernel, the others (views at odd offsets) through the generic one */
    const int gsz = gdt == KCU_F32 ? 4 : 2;
    auto aligned = [&](int i) { return adamw_vec_aligned(p[i], g[i], m[i], v[i], pcopy ? pcopy[i] : NULL, gsz, 2) != 0; };
    auto unaligned = [&](int i) { return !aligned(i); };
    int e;
    if (gdt == KCU_F32) e = adamw_vec_copy<float>(cdt, n, p, g, m, v, pcopy, numel, c32, grad_scale, aligned, s);
    else if (gdt == KCU_BF16) e = adamw_vec_copy<kbf16>(cdt, n, p, g, m, v, pcopy, numel, c32, grad_scale, aligned, s);
    else e = adamw_vec_copy<kf16>(cdt, n, p, g, m, v, pcopy, numel, c32, grad_scale, aligned, s);
    if (e) return e;
    return mt_foreach_if(n, numel, p, g, m, v, pcopy, unaligned, [&](const MtTable& tab, int nb, int64_t) {
      adamw_kernel<<<nb, kMtThreads, 0, s>>>(tab, pdt, gdt, sdt, cdt, c32, c64, grad_scale);
      return kcu_launch_status();
    });
  }
  return mt_foreach(n, numel, p, g, m, v, pcopy, [&](const MtTable& tab, int nb, int64_t) {
    adamw_kernel<<<nb, kMtThreads, 0, s>>>(tab, pdt, gdt, sdt, cdt, c32, c64, grad_scale);
    return kcu_launch_status();
  });
}

extern "C" size_t kcu_global_norm_workspace(int n, const int64_t* numel) {
  int64_t nb = 0;
  for (int i = 0; i < n && numel; i++)
    if (numel[i] > 0) nb += kcu_cdiv(numel[i], kChunk);
  return (size_t)(nb > 0 ? nb : 1) * sizeof(double);
}

extern "C" int kcu_global_norm(int kind, int n, const void* const* x, const int64_t* numel, int dt, double* out,
                               void* ws, cudaStream_t s) {
  if ((kind != 1 && kind != 3) || n < 0 || !is_float(dt) || !out) return KCU_EARG;
  if (n > 0 && (!x || !numel)) return KCU_EARG;
  int64_t total = 0;
  for (int i = 0; i < n; i++) {
    if (numel[i] <= 0) continue;
    if (!x[i]) return KCU_EARG;
    total += kcu_cdiv(numel[i], kChunk);
  }
  if (total > 0 && !ws) return KCU_EARG;
  int e = mt_foreach(n, numel, (void* const*)x, NULL, NULL, NULL, NULL, [&](const MtTable& tab, int nb, int64_t base) {
    norm_partial<<<nb, kMtThreads, 0, s>>>(tab, dt, kind, (double*)ws, base);
    return kcu_launch_status();
  });
  if (e) return e;
  norm_final<<<1, 1024, 0, s>>>(total, (const double*)ws, kind, out);
  return kcu_launch_status();
}

extern "C" int kcu_clip_coef(const double* norm, double max_norm, float* coef, cudaStream_t s) {
  if (!norm || !coef || !(max_norm >= 0)) return KCU_EARG;
  clip_coef_kernel<<<1, 1, 0, s>>>(norm, max_norm, coef);
  return kcu_launch_status();
}

extern "C" int kcu_scale(int n, void* const* x, const int64_t* numel, int dt, const float* scale, double scale_host,
                         cudaStream_t s) {
  if (n < 0 || !is_float(dt)) return KCU_EARG;
  if (n == 0) return KCU_OK;
  if (!x || !numel) return KCU_EARG;
  for (int i = 0; i < n; i++)
    if (numel[i] > 0 && !x[i]) return KCU_EARG;
  return mt_foreach(n, numel, x, NULL, NULL, NULL, NULL, [&](const MtTable& tab, int nb, int64_t) {
    scale_kernel<<<nb, kMtThreads, 0, s>>>(tab, dt, scale, scale_host);
    return kcu_launch_status();
  });
}
