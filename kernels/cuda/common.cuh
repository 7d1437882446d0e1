/* common.cuh: helpers shared by the .cu files of kernels/cuda (not part of
 * the C interface): storage types for bf16/f16, typed loads and stores in
 * the compute type, warp/block reductions, launch status. */
#ifndef KCUDA_COMMON_CUH
#define KCUDA_COMMON_CUH
#include "kcuda.h"
#include "kcuda_math.cuh"
#include <cuda_runtime.h>
#include <stdint.h>

/* bf16 / f16 as raw 16-bit storage; converted with kcuda_math.cuh. */
struct kbf16 { uint16_t u; };
struct kf16 { uint16_t u; };

/* Compute ("accumulate") type of a storage type: f32, except f64. */
template <typename T> struct kacc { typedef float type; };
template <> struct kacc<double> { typedef double type; };

__device__ __forceinline__ float kload(float v) { return v; }
__device__ __forceinline__ double kload(double v) { return v; }
__device__ __forceinline__ float kload(kbf16 v) { return kcm_bf16_to_f32(v.u); }
__device__ __forceinline__ float kload(kf16 v) { return kcm_f16_to_f32(v.u); }

template <typename T> __device__ __forceinline__ T kstore(typename kacc<T>::type v);
template <> __device__ __forceinline__ float kstore<float>(float v) { return v; }
template <> __device__ __forceinline__ double kstore<double>(double v) { return v; }
template <> __device__ __forceinline__ kbf16 kstore<kbf16>(float v) { kbf16 r; r.u = kcm_f32_to_bf16(v); return r; }
template <> __device__ __forceinline__ kf16 kstore<kf16>(float v) { kf16 r; r.u = kcm_f32_to_f16(v); return r; }

/* Runtime-dtype element access (uniform branches), for kernels whose
 * operands mix dtypes (optimizer, reductions' outputs). */
__device__ __forceinline__ double kld_dt(const void* p, int dt, int64_t i) {
  switch (dt) {
    case KCU_F32: return ((const float*)p)[i];
    case KCU_F64: return ((const double*)p)[i];
    case KCU_BF16: return kcm_bf16_to_f32(((const uint16_t*)p)[i]);
    case KCU_F16: return kcm_f16_to_f32(((const uint16_t*)p)[i]);
    case KCU_I32: return ((const int32_t*)p)[i];
    case KCU_I64: return (double)((const int64_t*)p)[i];
    case KCU_U8: return ((const uint8_t*)p)[i];
    default: return ((const uint8_t*)p)[i] ? 1.0 : 0.0;
  }
}
__device__ __forceinline__ float kldf_dt(const void* p, int dt, int64_t i) {
  switch (dt) {
    case KCU_F32: return ((const float*)p)[i];
    case KCU_BF16: return kcm_bf16_to_f32(((const uint16_t*)p)[i]);
    case KCU_F16: return kcm_f16_to_f32(((const uint16_t*)p)[i]);
    default: return (float)kld_dt(p, dt, i);
  }
}
__device__ __forceinline__ void kst_dt(void* p, int dt, int64_t i, double v) {
  switch (dt) {
    case KCU_F32: ((float*)p)[i] = (float)v; break;
    case KCU_F64: ((double*)p)[i] = v; break;
    case KCU_BF16: ((uint16_t*)p)[i] = kcm_f32_to_bf16((float)v); break;
    case KCU_F16: ((uint16_t*)p)[i] = kcm_f32_to_f16((float)v); break;
    case KCU_I32: ((int32_t*)p)[i] = (int32_t)v; break;
    case KCU_I64: ((int64_t*)p)[i] = (int64_t)v; break;
    case KCU_U8: ((uint8_t*)p)[i] = (uint8_t)(int64_t)v; break;
    default: ((uint8_t*)p)[i] = v != 0.0; break;
  }
}
__device__ __forceinline__ void kstf_dt(void* p, int dt, int64_t i, float v) {
  switch (dt) {
    case KCU_F32: ((float*)p)[i] = v; break;
    case KCU_BF16: ((uint16_t*)p)[i] = kcm_f32_to_bf16(v); break;
    case KCU_F16: ((uint16_t*)p)[i] = kcm_f32_to_f16(v); break;
    default: kst_dt(p, dt, i, (double)v); break;
  }
}
/* Index (i32 or i64 data) */
__device__ __forceinline__ int64_t kidx(const void* idx, int idt, int64_t i) {
  return idt == KCU_I32 ? (int64_t)((const int32_t*)idx)[i] : ((const int64_t*)idx)[i];
}

/* ---------------------------------------------------------------- reductions */
template <typename T> __device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
/* Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread
 * gets the result.  Fixed tree: deterministic.  sh: 32 elements of shared
 * memory; the function syncs before returning so sh may be reused. */
template <typename T> __device__ __forceinline__ T block_sum(T v, T* sh) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  T r = lane < nw ? sh[lane] : (T)0;
  r = warp_sum(r);
  __syncthreads();
  return r;
}
/* max / min propagating NaN (a NaN on either side wins). */
template <typename T> __device__ __forceinline__ T kmax_nan(T a, T b) { return (b != b || b > a) ? b : a; }
template <typename T> __device__ __forceinline__ T kmin_nan(T a, T b) { return (b != b || b < a) ? b : a; }

/* Status of the launches just made on this thread. */
static inline int kcu_launch_status(void) { return (int)cudaGetLastError(); }

static inline int64_t kcu_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline unsigned kcu_grid(int64_t work, int64_t per_block, int64_t cap) {
  int64_t g = kcu_cdiv(work, per_block);
  if (g < 1) g = 1;
  if (g > cap) g = cap;
  return (unsigned)g;
}
#endif
