/* index.cu: gather / scatter along a dim and the row puts of index_add /
 * index_copy.  One thread per index element (64-bit index math); additions
 * with atomics (f32, f64, i32, i64), so duplicate indices accumulate;
 * replacements with duplicates keep one of the writes (as PyTorch on CUDA). */
#include "common.cuh"
#include "kindex_cuda.h"

namespace {

const int kThreads = 256;
const int64_t kMaxBlocks = 65536;

struct IGeo {
  int nd, d;
  int64_t ishape[KCU_MAX_DIMS];
  int64_t xstride[KCU_MAX_DIMS];
};

__device__ __forceinline__ int64_t xoff(const IGeo& g, int64_t p, int64_t k) {
  int64_t off = 0;
  for (int d = g.nd - 1; d >= 0; d--) {
    int64_t c = p % g.ishape[d];
    p /= g.ishape[d];
    off += (d == g.d ? k : c) * g.xstride[d];
  }
  return off;
}

__device__ __forceinline__ void copy_es(char* d, const char* s, int es) {
  switch (es) {
    case 1: *(uint8_t*)d = *(const uint8_t*)s; break;
    case 2: *(uint16_t*)d = *(const uint16_t*)s; break;
    case 4: *(uint32_t*)d = *(const uint32_t*)s; break;
    default: *(uint64_t*)d = *(const uint64_t*)s; break;
  }
}

__device__ __forceinline__ void add_dt(char* d, const char* s, int dt, double alpha) {
  switch (dt) {
    case KCU_F32: atomicAdd((float*)d, (float)(alpha * *(const float*)s)); break;
    case KCU_F64: atomicAdd((double*)d, alpha * *(const double*)s); break;
    case KCU_I32: atomicAdd((int*)d, (int)((int64_t)alpha * *(const int32_t*)s)); break;
    default:
      atomicAdd((unsigned long long*)d, (unsigned long long)((int64_t)alpha * *(const int64_t*)s));
      break;
  }
}

__global__ void k_gather(int64_t n, IGeo g, int es, const int64_t* idx, const char* x, char* out) {
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < n; p += (int64_t)gridDim.x * blockDim.x)
    copy_es(out + p * es, x + xoff(g, p, idx[p]) * es, es);
}

__global__ void k_scatter(int64_t n, IGeo g, int dt, int es, int acc, const int64_t* idx, const char* src, char* dst) {
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < n; p += (int64_t)gridDim.x * blockDim.x) {
    char* d = dst + xoff(g, p, idx[p]) * es;
    if (acc) add_dt(d, src + p * es, dt, 1.0);
    else copy_es(d, src + p * es, es);
  }
}

__global__ void k_index_put(int64_t n, int64_t n_idx, int64_t inner, int64_t dst_n, int dt, int es, int acc,
                            double alpha, const int64_t* idx, const char* src, char* dst) {
  for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < n; t += (int64_t)gridDim.x * blockDim.x) {
    int64_t o = t / (n_idx * inner), r = t % (n_idx * inner), j = r / inner, k = r % inner;
    char* d = dst + ((o * dst_n + idx[j]) * inner + k) * es;
    if (acc) add_dt(d, src + t * es, dt, alpha);
    else copy_es(d, src + t * es, es);
  }
}

int acc_ok(int dt) { return dt == KCU_F32 || dt == KCU_F64 || dt == KCU_I32 || dt == KCU_I64; }

int geo(IGeo* g, int ndim, const int64_t* ishape, const int64_t* xshape, int d, int64_t* n) {
  if (ndim < 1 || ndim > KCU_MAX_DIMS || d < 0 || d >= ndim) return -1;
  g->nd = ndim; g->d = d;
  int64_t s = 1, m = 1;
  for (int k = ndim - 1; k >= 0; k--) {
    g->ishape[k] = ishape[k];
    g->xstride[k] = s;
    s *= xshape[k];
    m *= ishape[k];
  }
  *n = m;
  return 0;
}

}  // namespace

extern "C" int kcu_gather(int es, int ndim, const int64_t* ishape, const int64_t* xshape, int d, void* out,
                          const void* x, const int64_t* idx, cudaStream_t s) {
  IGeo g;
  int64_t n;
  if (geo(&g, ndim, ishape, xshape, d, &n) || !(es == 1 || es == 2 || es == 4 || es == 8)) return KCU_EARG;
  if (n == 0) return KCU_OK;
  k_gather<<<kcu_grid(n, kThreads, kMaxBlocks), kThreads, 0, s>>>(n, g, es, idx, (const char*)x, (char*)out);
  return kcu_launch_status();
}

extern "C" int kcu_scatter(int dt, int accumulate, int ndim, const int64_t* ishape, const int64_t* dshape, int d,
                           void* dst, const void* src, const int64_t* idx, cudaStream_t s) {
  IGeo g;
  int64_t n;
  int es = kcu_dtype_size(dt);
  if (geo(&g, ndim, ishape, dshape, d, &n) || es == 0 || (accumulate && !acc_ok(dt))) return KCU_EARG;
  if (n == 0) return KCU_OK;
  k_scatter<<<kcu_grid(n, kThreads, kMaxBlocks), kThreads, 0, s>>>(n, g, dt, es, accumulate, idx, (const char*)src,
                                                                    (char*)dst);
  return kcu_launch_status();
}

extern "C" int kcu_index_put(int dt, int accumulate, double alpha, int64_t outer, int64_t dst_n, int64_t n_idx,
                             int64_t inner, void* dst, const void* src, const int64_t* idx, cudaStream_t s) {
  int es = kcu_dtype_size(dt);
  if (es == 0 || (accumulate && !acc_ok(dt)) || (!accumulate && alpha != 1.0)) return KCU_EARG;
  int64_t n = outer * n_idx * inner;
  if (n == 0) return KCU_OK;
  k_index_put<<<kcu_grid(n, kThreads, kMaxBlocks), kThreads, 0, s>>>(n, n_idx, inner, dst_n, dt, es, accumulate, alpha,
                                                                      idx, (const char*)src, (char*)dst);
  return kcu_launch_status();
}
