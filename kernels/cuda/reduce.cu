/* reduce.cu: sum / max / min over one dim of [outer, D, inner] and over all
 * elements.  Rows (inner == 1) take one block per row; columns (inner > 1)
 * a 32 x 8 thread tile per 32 columns.  Reductions over all elements run in
 * two passes through a workspace of per-block partials.  Every launch
 * configuration depends on the sizes only, and every tree is fixed, so
 * results are deterministic. */
#include "common.cuh"

namespace {

const int kRowThreads = 256;
const int kAllBlocks = 1024;
const int kAllThreads = 256;

/* Accumulator of a storage type: f32 for f32/bf16/f16, f64 otherwise. */
template <typename T> struct racc { typedef double type; };
template <> struct racc<float> { typedef float type; };
template <> struct racc<kbf16> { typedef float type; };
template <> struct racc<kf16> { typedef float type; };

template <typename T> __device__ __forceinline__ typename racc<T>::type rload(T v) {
  return (typename racc<T>::type)v;
}
template <> __device__ __forceinline__ float rload<kbf16>(kbf16 v) { return kcm_bf16_to_f32(v.u); }
template <> __device__ __forceinline__ float rload<kf16>(kf16 v) { return kcm_f16_to_f32(v.u); }

template <typename A> __device__ __forceinline__ A rinit(int kind) {
  return kind == KCU_RED_SUM ? (A)0 : (kind == KCU_RED_MAX ? (A)-INFINITY : (A)INFINITY);
}
template <typename A> __device__ __forceinline__ A rcomb(int kind, A a, A b) {
  return kind == KCU_RED_SUM ? a + b : (kind == KCU_RED_MAX ? kmax_nan(a, b) : kmin_nan(a, b));
}

/* Block-wide reduction (blockDim.x multiple of 32); all threads get it. */
template <typename A> __device__ A block_reduce(int kind, A v, A* sh) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = rcomb(kind, v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  A r = lane < nw ? sh[lane] : rinit<A>(kind);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) r = rcomb(kind, r, __shfl_xor_sync(0xffffffffu, r, o));
  __syncthreads();
  return r;
}

template <typename T>
__global__ void reduce_rows(int kind, int64_t rows, int64_t D, const T* x, void* out, int odt, double scale) {
  typedef typename racc<T>::type A;
  __shared__ A sh[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * D;
    A acc = rinit<A>(kind);
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) acc = rcomb(kind, acc, rload(xr[j]));
    acc = block_reduce(kind, acc, sh);
    if (threadIdx.x == 0) kst_dt(out, odt, r, kind == KCU_RED_SUM ? (double)acc * scale : (double)acc);
  }
}

/* blockDim (32, 8): x over 32 columns, y over D. */
template <typename T>
__global__ void reduce_cols(int kind, int64_t outer, int64_t D, int64_t inner, const T* x, void* out, int odt,
                            double scale) {
  typedef typename racc<T>::type A;
  __shared__ A sh[8][33];
  int64_t col = (int64_t)blockIdx.x * 32 + threadIdx.x;
  for (int64_t o = blockIdx.y; o < outer; o += gridDim.y) {
    A acc = rinit<A>(kind);
    if (col < inner)
      for (int64_t d = threadIdx.y; d < D; d += 8) acc = rcomb(kind, acc, rload(x[(o * D + d) * inner + col]));
    sh[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && col < inner) {
      A r = sh[0][threadIdx.x];
      for (int k = 1; k < 8; k++) r = rcomb(kind, r, sh[k][threadIdx.x]);
      kst_dt(out, odt, o * inner + col, kind == KCU_RED_SUM ? (double)r * scale : (double)r);
    }
    __syncthreads();
  }
}

template <typename T>
__global__ void reduce_all_pass1(int kind, int64_t n, const T* x, double* ws) {
  typedef typename racc<T>::type A;
  __shared__ A sh[32];
  A acc = rinit<A>(kind);
  int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) acc = rcomb(kind, acc, rload(x[i]));
  acc = block_reduce(kind, acc, sh);
  if (threadIdx.x == 0) ws[blockIdx.x] = (double)acc;
}

__global__ void reduce_all_pass2(int kind, int nb, const double* ws, void* out, int odt, double scale) {
  __shared__ double sh[32];
  double acc = rinit<double>(kind);
  for (int i = threadIdx.x; i < nb; i += blockDim.x) acc = rcomb(kind, acc, ws[i]);
  acc = block_reduce(kind, acc, sh);
  if (threadIdx.x == 0) kst_dt(out, odt, 0, kind == KCU_RED_SUM ? acc * scale : acc);
}

template <typename T>
int reduce_dim_t(int kind, int64_t outer, int64_t D, int64_t inner, const void* x, void* out, int odt, double scale,
                 cudaStream_t s) {
  if (inner == 1) {
    reduce_rows<T><<<kcu_grid(outer, 1, 1 << 20), kRowThreads, 0, s>>>(kind, outer, D, (const T*)x, out, odt, scale);
  } else {
    dim3 grid((unsigned)kcu_cdiv(inner, 32), (unsigned)(outer < 65535 ? outer : 65535));
    reduce_cols<T><<<grid, dim3(32, 8), 0, s>>>(kind, outer, D, inner, (const T*)x, out, odt, scale);
  }
  return kcu_launch_status();
}

template <typename T>
int reduce_all_t(int kind, int64_t n, const void* x, void* out, int odt, double scale, void* ws, cudaStream_t s) {
  int nb = (int)kcu_grid(n, (int64_t)kAllThreads * 16, kAllBlocks);
  reduce_all_pass1<T><<<nb, kAllThreads, 0, s>>>(kind, n, (const T*)x, (double*)ws);
  reduce_all_pass2<<<1, kAllThreads, 0, s>>>(kind, nb, (const double*)ws, out, odt, scale);
  return kcu_launch_status();
}

int valid_out(int odt) { return odt >= KCU_F32 && odt <= KCU_BOOL; }

}  // namespace

extern "C" int kcu_reduce_dim(int kind, int dt, int64_t outer, int64_t D, int64_t inner, const void* x, void* out,
                              int odt, double scale, cudaStream_t s) {
  if (kind < KCU_RED_SUM || kind > KCU_RED_MIN || !valid_out(odt) || outer < 0 || D < 0 || inner < 1) return KCU_EARG;
  if (outer == 0) return KCU_OK;
  if (!out) return KCU_EARG;
  if (D == 0) {
    if (kind != KCU_RED_SUM) return KCU_EARG;
    return kcu_fill(odt, outer * inner, out, 0.0, s);
  }
  if (!x) return KCU_EARG;
  switch (dt) {
    case KCU_F32: return reduce_dim_t<float>(kind, outer, D, inner, x, out, odt, scale, s);
    case KCU_F64: return reduce_dim_t<double>(kind, outer, D, inner, x, out, odt, scale, s);
    case KCU_BF16: return reduce_dim_t<kbf16>(kind, outer, D, inner, x, out, odt, scale, s);
    case KCU_F16: return reduce_dim_t<kf16>(kind, outer, D, inner, x, out, odt, scale, s);
    case KCU_I32: return reduce_dim_t<int32_t>(kind, outer, D, inner, x, out, odt, scale, s);
    case KCU_I64: return reduce_dim_t<int64_t>(kind, outer, D, inner, x, out, odt, scale, s);
    case KCU_U8: case KCU_BOOL: return reduce_dim_t<uint8_t>(kind, outer, D, inner, x, out, odt, scale, s);
    default: return KCU_EARG;
  }
}

extern "C" size_t kcu_reduce_all_workspace(int64_t n) {
  (void)n;
  return (size_t)kAllBlocks * sizeof(double);
}

extern "C" int kcu_reduce_all(int kind, int dt, int64_t n, const void* x, void* out, int odt, double scale, void* ws,
                              cudaStream_t s) {
  if (kind < KCU_RED_SUM || kind > KCU_RED_MIN || !valid_out(odt) || n < 0 || !out) return KCU_EARG;
  if (n == 0) {
    if (kind != KCU_RED_SUM) return KCU_EARG;
    return kcu_fill(odt, 1, out, 0.0, s);
  }
  if (!x || !ws) return KCU_EARG;
  switch (dt) {
    case KCU_F32: return reduce_all_t<float>(kind, n, x, out, odt, scale, ws, s);
    case KCU_F64: return reduce_all_t<double>(kind, n, x, out, odt, scale, ws, s);
    case KCU_BF16: return reduce_all_t<kbf16>(kind, n, x, out, odt, scale, ws, s);
    case KCU_F16: return reduce_all_t<kf16>(kind, n, x, out, odt, scale, ws, s);
    case KCU_I32: return reduce_all_t<int32_t>(kind, n, x, out, odt, scale, ws, s);
    case KCU_I64: return reduce_all_t<int64_t>(kind, n, x, out, odt, scale, ws, s);
    case KCU_U8: case KCU_BOOL: return reduce_all_t<uint8_t>(kind, n, x, out, odt, scale, ws, s);
    default: return KCU_EARG;
  }
}
