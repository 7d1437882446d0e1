/* rope.cu: rotary position embedding on interleaved pairs, fused (kernels/cpu/rope.c is the reference):
 *   out[2i] = x[2i] cos(t, i) - x[2i + 1] sin(t, i),  out[2i + 1] = x[2i] sin(t, i) + x[2i + 1] cos(t, i)
 * for x [B, T, H, D] (element strides of b, t, h; the last dim contiguous), tables contiguous [T, D / 2], out
 * contiguous; inverse = 1 rotates by -angle (the backward).
 * One thread per pair, f32 math (f64 for f64 data), one rounding per output. */
#include "common.cuh"

namespace {

template <typename T, typename C>
__global__ void rope_kernel(int64_t pairs, int64_t T_, int64_t H, int64_t half, const T* x, int64_t sb, int64_t st,
                            int64_t sh, const C* cs, const C* sn, float sg, T* out) {
  typedef typename kacc<T>::type A;
  const int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < pairs; p += step) {
    const int64_t i = p % half, row = p / half;      /* row: (b, t, h) */
    const int64_t h = row % H, t = (row / H) % T_, b = row / H / T_;
    const A c = (A)kload(cs[t * half + i]), s = (A)sg * (A)kload(sn[t * half + i]);
    const T* xp = x + b * sb + t * st + h * sh + 2 * i;
    const A x0 = (A)kload(xp[0]), x1 = (A)kload(xp[1]);
    out[2 * p] = kstore<T>(x0 * c - x1 * s);
    out[2 * p + 1] = kstore<T>(x0 * s + x1 * c);
  }
}

template <typename T, typename C>
int rope_run(int64_t B, int64_t T_, int64_t H, int64_t D, const void* x, const int64_t* xs, const void* cs,
             const void* sn, int inverse, void* out, cudaStream_t s) {
  const int64_t pairs = B * T_ * H * (D / 2);
  rope_kernel<T, C><<<kcu_grid(pairs, 256, 1 << 16), 256, 0, s>>>(pairs, T_, H, D / 2, (const T*)x, xs[0], xs[1], xs[2],
                                                                   (const C*)cs, (const C*)sn, inverse ? -1.0f : 1.0f,
                                                                   (T*)out);
  return kcu_launch_status();
}

template <typename T>
int rope_tables(int cdt, int64_t B, int64_t T_, int64_t H, int64_t D, const void* x, const int64_t* xs, const void* cs,
                const void* sn, int inverse, void* out, cudaStream_t s) {
  switch (cdt) {
    case KCU_F32: return rope_run<T, float>(B, T_, H, D, x, xs, cs, sn, inverse, out, s);
    case KCU_F64: return rope_run<T, double>(B, T_, H, D, x, xs, cs, sn, inverse, out, s);
    case KCU_BF16: return rope_run<T, kbf16>(B, T_, H, D, x, xs, cs, sn, inverse, out, s);
    case KCU_F16: return rope_run<T, kf16>(B, T_, H, D, x, xs, cs, sn, inverse, out, s);
    default: return KCU_EARG;
  }
}

}  // namespace

extern "C" int kcu_rope(int dt, int cdt, int64_t B, int64_t T, int64_t H, int64_t D, const void* x, const int64_t* xs,
                        const void* cos, const void* sin, int inverse, void* out, cudaStream_t s) {
  if (B < 0 || T < 0 || H < 0 || D < 0 || D % 2 || !xs) return KCU_EARG;
  if (B == 0 || T == 0 || H == 0 || D == 0) return KCU_OK;
  if (!x || !cos || !sin || !out) return KCU_EARG;
  switch (dt) {
    case KCU_F32: return rope_tables<float>(cdt, B, T, H, D, x, xs, cos, sin, inverse, out, s);
    case KCU_F64: return rope_tables<double>(cdt, B, T, H, D, x, xs, cos, sin, inverse, out, s);
    case KCU_BF16: return rope_tables<kbf16>(cdt, B, T, H, D, x, xs, cos, sin, inverse, out, s);
    case KCU_F16: return rope_tables<kf16>(cdt, B, T, H, D, x, xs, cos, sin, inverse, out, s);
    default: return KCU_EARG;
  }
}
