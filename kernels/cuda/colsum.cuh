/* colsum.cuh: the 2-D column-sum kernel (internal; included by colsum.cu and
 * norm.cu).  Partition and order: kcuda_norm.cuh ("Column sums").
 *
 * colsum_tile<T, V, TY>: x is [rows, n] of T; block (bx, by) of 32 x TY
 * threads sums the rows [by rt, min(rows, (by + 1) rt)) of its 32 V columns
 * in f32.  part != NULL: the sums go to part[by, col] (f32 partial rows);
 * else to dst[col] in dtype odt, times scale. */
#ifndef KCUDA_COLSUM_CUH
#define KCUDA_COLSUM_CUH
#include "common.cuh"
#include "kcuda_norm.cuh"

namespace {

/* 16 bytes of T as V values. */
template <typename T, int V> union kvec {
  uint4 u;
  T e[V];
};
template <typename T, int V> __device__ __forceinline__ void kvec_load(const T* p, float* f) {
  if (V * sizeof(T) == 16) {
    kvec<T, V> v;
    v.u = *(const uint4*)p;
#pragma unroll
    for (int k = 0; k < V; k++) f[k] = kload(v.e[k]);
  } else {
#pragma unroll
    for (int k = 0; k < V; k++) f[k] = kload(p[k]);
  }
}
template <typename T, int V> __device__ __forceinline__ void kvec_store(T* p, const float* f) {
  if (V * sizeof(T) == 16) {
    kvec<T, V> v;
#pragma unroll
    for (int k = 0; k < V; k++) v.e[k] = kstore<T>(f[k]);
    *(uint4*)p = v.u;
  } else {
#pragma unroll
    for (int k = 0; k < V; k++) p[k] = kstore<T>(f[k]);
  }
}

template <typename T, int V, int TY>
__global__ void __launch_bounds__(32 * TY) colsum_tile(int64_t rows, int64_t n, int64_t rt, const T* x, float* part,
                                                       void* dst, int odt, float scale) {
  __shared__ float sh[TY][32 * V + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c0 = ((int64_t)blockIdx.x * 32 + tx) * V;
  const int64_t r0 = (int64_t)blockIdx.y * rt;
  int64_t r1 = r0 + rt;
  if (r1 > rows) r1 = rows;
  float acc[V];
#pragma unroll
  for (int k = 0; k < V; k++) acc[k] = 0.0f;
  if (c0 < n) {
    for (int64_t r = r0 + ty; r < r1; r += TY) {
      float f[V];
      if (V > 1) { /* V > 1 only when n % V == 0: the vector is whole */
        kvec_load<T, V>(x + r * n + c0, f);
      } else {
        f[0] = kload(x[r * n + c0]);
      }
#pragma unroll
      for (int k = 0; k < V; k++) acc[k] = KCM_ADD(acc[k], f[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < V; k++) sh[ty][tx * V + k] = acc[k];
  __syncthreads();
  if (ty == 0 && c0 < n) {
#pragma unroll
    for (int k = 0; k < V; k++) {
      float s = sh[0][tx * V + k];
      for (int j = 1; j < TY; j++) s = KCM_ADD(s, sh[j][tx * V + k]);
      if (c0 + k < n) {
        if (part) part[(int64_t)blockIdx.y * n + c0 + k] = s;
        else kstf_dt(dst, odt, c0 + k, scale == 1.0f ? s : KCM_MUL(s, scale));
      }
    }
  }
}

/* Stage 2: dst[j] = scale * sum over the P partial rows (f32) of part[:, j]. */
inline void colsum_partials_launch(int64_t P, int64_t n, const float* part, void* dst, int odt, float scale,
                                   cudaStream_t s) {
  dim3 grid((unsigned)kcu_cdiv(n, 32), 1);
  colsum_tile<float, 1, KCM_COLSUM2_TY><<<grid, dim3(32, KCM_COLSUM2_TY), 0, s>>>(P, n, P, part, NULL, dst, odt,
                                                                                scale);
}

}  // namespace
#endif
