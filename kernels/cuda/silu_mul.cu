/* silu_mul.cu: silu(a) * b (SwiGLU's product) and its gradients in one pass each (kernels/cpu/unary.c is the CPU
 * form).  The composition's operations and roundings in its order: s = silu(a) rounded to the data type (the silu
 * kernel's output), out = s * b; backward gs = g * b rounded (mul's gradient), ga = silu'(a) * gs (silu's gradient
 * kernel), gb = g * s; so the values equal the two kernels' bit for bit.  f32 math for half data (f64 for f64). */
#include "common.cuh"

namespace {

template <typename T> __device__ __forceinline__ typename kacc<T>::type silu_of(typename kacc<T>::type x);
template <> __device__ __forceinline__ float silu_of<float>(float x) { return kcm_unary_f32(KCM_SILU, x, 0.0f, 0.0f); }
template <> __device__ __forceinline__ float silu_of<kbf16>(float x) { return kcm_unary_f32(KCM_SILU, x, 0.0f, 0.0f); }
template <> __device__ __forceinline__ float silu_of<kf16>(float x) { return kcm_unary_f32(KCM_SILU, x, 0.0f, 0.0f); }
template <> __device__ __forceinline__ double silu_of<double>(double x) { return kcm_unary_f64(KCM_SILU, x, 0.0, 0.0); }

__device__ __forceinline__ float silu_grad_of(float g, float x) { return kcm_unary_grad_f32(KCM_SILU, g, x, 0.0f, 0.0f, 0.0f); }
__device__ __forceinline__ double silu_grad_of(double g, double x) { return kcm_unary_grad_f64(KCM_SILU, g, x, 0.0, 0.0, 0.0); }

template <typename T>
__global__ void silu_mul_kernel(int64_t n, const T* a, const T* b, T* out) {
  typedef typename kacc<T>::type A;
  const int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    const A s = (A)kload(kstore<T>(silu_of<T>((A)kload(a[i]))));
    out[i] = kstore<T>(s * (A)kload(b[i]));
  }
}

template <typename T>
__global__ void silu_mul_grad_kernel(int64_t n, const T* g, const T* a, const T* b, T* ga, T* gb) {
  typedef typename kacc<T>::type A;
  const int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    const A gv = (A)kload(g[i]), x = (A)kload(a[i]);
    if (ga) {
      const A gs = (A)kload(kstore<T>(gv * (A)kload(b[i])));
      ga[i] = kstore<T>(silu_grad_of(gs, x));
    }
    if (gb) {
      const A s = (A)kload(kstore<T>(silu_of<T>(x)));
      gb[i] = kstore<T>(gv * s);
    }
  }
}

template <typename T>
int run(int64_t n, const void* g, const void* a, const void* b, void* out, void* ga, void* gb, cudaStream_t s) {
  const unsigned grid = kcu_grid(n, 256, 1 << 16);
  if (out) silu_mul_kernel<T><<<grid, 256, 0, s>>>(n, (const T*)a, (const T*)b, (T*)out);
  else silu_mul_grad_kernel<T><<<grid, 256, 0, s>>>(n, (const T*)g, (const T*)a, (const T*)b, (T*)ga, (T*)gb);
  return kcu_launch_status();
}

int dispatch(int dt, int64_t n, const void* g, const void* a, const void* b, void* out, void* ga, void* gb,
             cudaStream_t s) {
  switch (dt) {
    case KCU_F32: return run<float>(n, g, a, b, out, ga, gb, s);
    case KCU_F64: return run<double>(n, g, a, b, out, ga, gb, s);
    case KCU_BF16: return run<kbf16>(n, g, a, b, out, ga, gb, s);
    case KCU_F16: return run<kf16>(n, g, a, b, out, ga, gb, s);
    default: return KCU_EARG;
  }
}

}  // namespace

extern "C" int kcu_silu_mul(int dt, int64_t n, const void* a, const void* b, void* out, cudaStream_t s) {
  if (n < 0) return KCU_EARG;
  if (n == 0) return KCU_OK;
  if (!a || !b || !out) return KCU_EARG;
  return dispatch(dt, n, NULL, a, b, out, NULL, NULL, s);
}

extern "C" int kcu_silu_mul_grad(int dt, int64_t n, const void* g, const void* a, const void* b, void* ga, void* gb,
                                 cudaStream_t s) {
  if (n < 0) return KCU_EARG;
  if (n == 0 || (!ga && !gb)) return KCU_OK;
  if (!g || !a || !b) return KCU_EARG;
  return dispatch(dt, n, g, a, b, NULL, ga, gb, s);
}
