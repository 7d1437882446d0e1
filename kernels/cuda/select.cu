/* select.cu: comparisons (bool results), where, masked_fill, and the
 * arg-extreme / scatter pair of max/min over one dim.
 *
 * Strided N-d kernels with broadcasting (0 strides), one thread per output
 * element (64-bit index math).  Simple rather than tuned: these ops are off
 * the hot path of training (masks, backward of maximum/minimum and max). */
#include "common.cuh"
#include <string.h>

namespace {

const int kThreads = 256;
const int64_t kMaxBlocks = 65536;

struct SGeo {
  int nd;
  int64_t shape[KCU_MAX_DIMS];
  int64_t st[4][KCU_MAX_DIMS];
};

/* Geometry of k operands (NULL strides = contiguous); -1 when invalid. */
int64_t sgeo(SGeo* g, int ndim, const int64_t* shape, int k, const int64_t* const* strides) {
  if (ndim < 0 || ndim > KCU_MAX_DIMS || (ndim > 0 && !shape)) return -1;
  int64_t cst[KCU_MAX_DIMS];
  int64_t n = 1;
  for (int d = ndim - 1; d >= 0; d--) {
    if (shape[d] < 0) return -1;
    cst[d] = n;
    n *= shape[d];
  }
  g->nd = ndim;
  for (int d = 0; d < ndim; d++) {
    g->shape[d] = shape[d];
    for (int o = 0; o < k; o++) g->st[o][d] = strides[o] ? strides[o][d] : cst[d];
  }
  return n;
}

template <int K>
__device__ __forceinline__ void soffsets(const SGeo& g, int64_t i, int64_t (&off)[K]) {
#pragma unroll
  for (int k = 0; k < K; k++) off[k] = 0;
  for (int d = g.nd - 1; d >= 0; d--) {
    int64_t sz = g.shape[d];
    int64_t c = i % sz;
    i /= sz;
#pragma unroll
    for (int k = 0; k < K; k++) off[k] += c * g.st[k][d];
  }
}

__device__ __forceinline__ int cmp_apply(int op, double a, double b) {
  switch (op) {
    case 0: return a == b;
    case 1: return a != b;
    case 2: return a < b;
    case 3: return a <= b;
    case 4: return a > b;
    default: return a >= b;
  }
}
__device__ __forceinline__ int cmp_apply_i64(int op, int64_t a, int64_t b) {
  switch (op) {
    case 0: return a == b;
    case 1: return a != b;
    case 2: return a < b;
    case 3: return a <= b;
    case 4: return a > b;
    default: return a >= b;
  }
}

__global__ void k_compare(int64_t n, SGeo g, int op, int dt, uint8_t* out, const char* a, const char* b, int es) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t off[3];
    soffsets<3>(g, i, off);
    int r;
    if (dt == KCU_I64)
      r = cmp_apply_i64(op, *(const int64_t*)(a + off[1] * es), *(const int64_t*)(b + off[2] * es));
    else
      r = cmp_apply(op, kld_dt(a + off[1] * es, dt, 0), kld_dt(b + off[2] * es, dt, 0));
    out[off[0]] = (uint8_t)r;
  }
}

__device__ __forceinline__ void copy_elem(char* d, const char* s, int es) {
  switch (es) {
    case 1: *(uint8_t*)d = *(const uint8_t*)s; break;
    case 2: *(uint16_t*)d = *(const uint16_t*)s; break;
    case 4: *(uint32_t*)d = *(const uint32_t*)s; break;
    default: *(uint64_t*)d = *(const uint64_t*)s; break;
  }
}

__global__ void k_where(int64_t n, SGeo g, int es, char* out, const uint8_t* c, const char* a, const char* b) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t off[4];
    soffsets<4>(g, i, off);
    const char* s = c[off[1]] ? a + off[2] * es : b + off[3] * es;
    copy_elem(out + off[0] * es, s, es);
  }
}

__global__ void k_masked_fill(int64_t n, SGeo g, int es, char* out, const char* x, const uint8_t* m,
                              uint64_t val) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t off[3];
    soffsets<3>(g, i, off);
    if (m[off[2]]) copy_elem(out + off[0] * es, (const char*)&val, es);
    else copy_elem(out + off[0] * es, x + off[1] * es, es);
  }
}

/* One thread per (o, i) of contiguous [outer, D, inner]: the first extreme
 * element along D (a NaN wins, the first one), as kc_argext_row. */
__global__ void k_argext(int64_t outer, int64_t D, int64_t inner, int dt, int is_max, const char* x, int es,
                         char* vals, int64_t* idx) {
  int64_t n = outer * inner;
  for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < n; t += (int64_t)gridDim.x * blockDim.x) {
    int64_t o = t / inner, i = t % inner;
    const char* base = x + (o * D * inner + i) * es;
    int64_t bi = 0;
    if (dt == KCU_I64) {
      int64_t best = *(const int64_t*)base;
      for (int64_t d = 1; d < D; d++) {
        int64_t v = *(const int64_t*)(base + d * inner * es);
        if (is_max ? v > best : v < best) { best = v; bi = d; }
      }
    } else {
      double best = kld_dt(base, dt, 0);
      for (int64_t d = 1; d < D && best == best; d++) {
        double v = kld_dt(base + d * inner * es, dt, 0);
        if (v != v || (is_max ? v > best : v < best)) { best = v; bi = d; }
      }
    }
    idx[t] = bi;
    if (vals) copy_elem(vals + t * es, base + bi * inner * es, es);
  }
}

/* out[o, idx[o, i], i] = g[o, i] (out contiguous [outer, D, inner], zeroed
 * by the caller; g and idx contiguous [outer, inner]). */
__global__ void k_scatter_dim(int64_t outer, int64_t D, int64_t inner, int es, const int64_t* idx, const char* g,
                              char* out) {
  int64_t n = outer * inner;
  for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < n; t += (int64_t)gridDim.x * blockDim.x) {
    int64_t o = t / inner, i = t % inner, k = idx[t];
    if (k >= 0 && k < D) copy_elem(out + ((o * D + k) * inner + i) * es, g + t * es, es);
  }
}

int esize_ok(int es) { return es == 1 || es == 2 || es == 4 || es == 8; }

}  // namespace

extern "C" int kcu_compare(int op, int dt, int ndim, const int64_t* shape, void* out, const int64_t* so,
                           const void* a, const int64_t* sa, const void* b, const int64_t* sb, cudaStream_t s) {
  int es = kcu_dtype_size(dt);
  if (op < 0 || op > 5 || es == 0) return KCU_EARG;
  SGeo g;
  const int64_t* st[3] = {so, sa, sb};
  int64_t n = sgeo(&g, ndim, shape, 3, st);
  if (n < 0) return KCU_EARG;
  if (n == 0) return KCU_OK;
  if (!out || !a || !b) return KCU_EARG;
  k_compare<<<kcu_grid(n, kThreads, kMaxBlocks), kThreads, 0, s>>>(n, g, op, dt, (uint8_t*)out, (const char*)a,
                                                                    (const char*)b, es);
  return kcu_launch_status();
}

extern "C" int kcu_where(int es, int ndim, const int64_t* shape, void* out, const int64_t* so, const void* cond,
                         const int64_t* sc, const void* a, const int64_t* sa, const void* b, const int64_t* sb,
                         cudaStream_t s) {
  if (!esize_ok(es)) return KCU_EARG;
  SGeo g;
  const int64_t* st[4] = {so, sc, sa, sb};
  int64_t n = sgeo(&g, ndim, shape, 4, st);
  if (n < 0) return KCU_EARG;
  if (n == 0) return KCU_OK;
  if (!out || !cond || !a || !b) return KCU_EARG;
  k_where<<<kcu_grid(n, kThreads, kMaxBlocks), kThreads, 0, s>>>(n, g, es, (char*)out, (const uint8_t*)cond,
                                                                  (const char*)a, (const char*)b);
  return kcu_launch_status();
}

extern "C" int kcu_masked_fill(int es, int ndim, const int64_t* shape, void* out, const int64_t* so, const void* x,
                               const int64_t* sx, const void* mask, const int64_t* sm, const void* value,
                               cudaStream_t s) {
  if (!esize_ok(es) || !value) return KCU_EARG;
  SGeo g;
  const int64_t* st[3] = {so, sx, sm};
  int64_t n = sgeo(&g, ndim, shape, 3, st);
  if (n < 0) return KCU_EARG;
  if (n == 0) return KCU_OK;
  if (!out || !x || !mask) return KCU_EARG;
  uint64_t v = 0;
  memcpy(&v, value, (size_t)es);
  k_masked_fill<<<kcu_grid(n, kThreads, kMaxBlocks), kThreads, 0, s>>>(n, g, es, (char*)out, (const char*)x,
                                                                        (const uint8_t*)mask, v);
  return kcu_launch_status();
}

extern "C" int kcu_argext_dim(int dt, int is_max, int64_t outer, int64_t D, int64_t inner, const void* x, void* vals,
                              int64_t* idx, cudaStream_t s) {
  int es = kcu_dtype_size(dt);
  if (es == 0 || outer < 0 || D < 1 || inner < 0) return KCU_EARG;
  int64_t n = outer * inner;
  if (n == 0) return KCU_OK;
  if (!x || !idx) return KCU_EARG;
  k_argext<<<kcu_grid(n, kThreads, kMaxBlocks), kThreads, 0, s>>>(outer, D, inner, dt, is_max, (const char*)x, es,
                                                                   (char*)vals, idx);
  return kcu_launch_status();
}

extern "C" int kcu_scatter_dim(int es, int64_t outer, int64_t D, int64_t inner, const int64_t* idx, const void* g,
                               void* out, cudaStream_t s) {
  if (!esize_ok(es) || outer < 0 || D < 0 || inner < 0) return KCU_EARG;
  int64_t n = outer * inner;
  if (n == 0) return KCU_OK;
  if (!idx || !g || !out) return KCU_EARG;
  k_scatter_dim<<<kcu_grid(n, kThreads, kMaxBlocks), kThreads, 0, s>>>(outer, D, inner, es, idx, (const char*)g,
                                                                        (char*)out);
  return kcu_launch_status();
}
