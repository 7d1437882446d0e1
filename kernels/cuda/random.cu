/* random.cu: uniform / normal / bernoulli numbers and dropout from the
 * engine's counter-based generator.
 *
 * Stream position j = offset + i (i the element index) uses word j % 4 of
 * Philox-4x32-10 block j / 4 for the key seed (kernels/cpu/philox.h, the
 * same source the CPU compiles).  One thread computes one Philox block and
 * produces the (up to) four elements that fall into [offset, offset + n).
 * The transforms are kcuda_math.cuh's copies of kernels/cpu/random.c's, so
 * a dropout mask is bit-identical to the CPU's and uniform numbers round the
 * same way; normal numbers agree to ~1e-15 relative (fused multiply-adds
 * may round the polynomials differently). */
#include "common.cuh"

namespace {

const int kThreads = 256;

__global__ void rng_kernel(int kind, int dt, int64_t n, uint64_t seed, uint64_t offset, double a, double b,
                           void* out) {
  const uint64_t blk0 = offset >> 2, blk1 = (offset + (uint64_t)n - 1) >> 2;
  const uint64_t nblk = blk1 - blk0 + 1;
  const uint64_t step = (uint64_t)gridDim.x * blockDim.x;
  const double range = b - a;
  const int open = b > a;
  for (uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; t < nblk; t += step) {
    uint64_t blk = blk0 + t;
    uint32_t w[4];
    kc_philox_block(seed, blk, w);
    double z[4];
    if (kind == KCU_RNG_NORMAL) {
      kcm_box_muller(w[0], w[1], &z[0], &z[1]);
      kcm_box_muller(w[2], w[3], &z[2], &z[3]);
    }
#pragma unroll
    for (int q = 0; q < 4; q++) {
      uint64_t j = (blk << 2) + (uint64_t)q;
      if (j < offset || j >= offset + (uint64_t)n) continue;
      int64_t i = (int64_t)(j - offset);
      if (kind == KCU_RNG_UNIFORM) {
        kst_dt(out, dt, i, kcm_uniform(w[q], a, range));
        if (open && kld_dt(out, dt, i) >= b) kst_dt(out, dt, i, a); /* rounding reached the open bound */
      } else if (kind == KCU_RNG_NORMAL) {
        kst_dt(out, dt, i, a + b * z[q]);
      } else {
        kst_dt(out, dt, i, kcm_u01(w[q]) < a ? 1.0 : 0.0);
      }
    }
  }
}

__device__ __forceinline__ float drop(float x, uint32_t w, double thr, double scale) {
  return kcm_dropout_f32(x, w, thr, (float)scale);
}
__device__ __forceinline__ double drop(double x, uint32_t w, double thr, double scale) {
  return kcm_dropout_f64(x, w, thr, scale);
}

template <typename T>
__global__ void dropout_kernel(int64_t n, uint64_t seed, uint64_t offset, double thr, double scale, const T* x, T* y) {
  const uint64_t blk0 = offset >> 2, blk1 = (offset + (uint64_t)n - 1) >> 2;
  const uint64_t nblk = blk1 - blk0 + 1;
  const uint64_t step = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; t < nblk; t += step) {
    uint64_t blk = blk0 + t;
    uint32_t w[4];
    kc_philox_block(seed, blk, w);
#pragma unroll
    for (int q = 0; q < 4; q++) {
      uint64_t j = (blk << 2) + (uint64_t)q;
      if (j < offset || j >= offset + (uint64_t)n) continue;
      int64_t i = (int64_t)(j - offset);
      y[i] = kstore<T>(drop(kload(x[i]), w[q], thr, scale));
    }
  }
}

uint64_t n_blocks(int64_t n, uint64_t offset) { return ((offset + (uint64_t)n - 1) >> 2) - (offset >> 2) + 1; }

template <typename T>
int dropout_t(int64_t n, uint64_t seed, uint64_t offset, double keep, double scale, const void* x, void* y,
              cudaStream_t s) {
  dropout_kernel<T><<<kcu_grid((int64_t)n_blocks(n, offset), kThreads, 1 << 16), kThreads, 0, s>>>(
      n, seed, offset, kcm_dropout_threshold(keep), scale, (const T*)x, (T*)y);
  return kcu_launch_status();
}

}  // namespace

extern "C" int kcu_random(int kind, int dt, int64_t n, uint64_t seed, uint64_t offset, double a, double b, void* out,
                          cudaStream_t s) {
  if (n < 0 || kind < KCU_RNG_UNIFORM || kind > KCU_RNG_BERNOULLI || kcu_dtype_size(dt) == 0) return KCU_EARG;
  if (kind != KCU_RNG_BERNOULLI && dt != KCU_F32 && dt != KCU_F64 && dt != KCU_BF16 && dt != KCU_F16) return KCU_EARG;
  if (n == 0) return KCU_OK;
  if (!out) return KCU_EARG;
  rng_kernel<<<kcu_grid((int64_t)n_blocks(n, offset), kThreads, 1 << 16), kThreads, 0, s>>>(kind, dt, n, seed, offset,
                                                                                            a, b, out);
  return kcu_launch_status();
}

extern "C" int kcu_dropout(int dt, int64_t n, uint64_t seed, uint64_t offset, double keep, double scale,
                           const void* x, void* y, cudaStream_t s) {
  if (n < 0 || !(keep >= 0.0 && keep <= 1.0)) return KCU_EARG;
  if (n == 0) return KCU_OK;
  if (!x || !y) return KCU_EARG;
  switch (dt) {
    case KCU_F32: return dropout_t<float>(n, seed, offset, keep, scale, x, y, s);
    case KCU_F64: return dropout_t<double>(n, seed, offset, keep, scale, x, y, s);
    case KCU_BF16: return dropout_t<kbf16>(n, seed, offset, keep, scale, x, y, s);
    case KCU_F16: return dropout_t<kf16>(n, seed, offset, keep, scale, x, y, s);
    default: return KCU_EARG;
  }
}
