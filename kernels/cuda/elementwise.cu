/* elementwise.cu: N-d strided unary / binary ops with broadcasting (0
 * strides), their unary derivatives, dtype conversion copies and fills.
 *
 * The host coalesces the index space (drops size-1 dims, merges dims that
 * are contiguous in every operand).  A fully contiguous problem runs a
 * grid-stride kernel with 16-byte vector loads and stores (4 f32, 8 bf16,
 * ...) when every pointer is 16-byte aligned; otherwise each thread maps its
 * linear index to per-operand offsets (32-bit index math when everything
 * fits).  The element math is kcuda_math.cuh's, in f32 for f32/bf16/f16 and
 * f64 for f64. */
#include "common.cuh"

namespace {

const int kThreads = 256;
const int64_t kMaxBlocks = 65536;

struct Geo {
  int nd;
  int64_t shape[KCU_MAX_DIMS];
  int64_t st[4][KCU_MAX_DIMS];
};

/* Coalesced geometry of k operands; returns the element count (-1 for an
 * invalid ndim / shape). */
int64_t make_geo(Geo* g, int ndim, const int64_t* shape, int k, const int64_t* const* strides) {
  if (ndim < 0 || ndim > KCU_MAX_DIMS || (ndim > 0 && !shape)) return -1;
  int64_t cst[KCU_MAX_DIMS];
  int64_t numel = 1;
  for (int d = ndim - 1; d >= 0; d--) {
    if (shape[d] < 0) return -1;
    cst[d] = numel;
    numel *= shape[d];
  }
  g->nd = 0;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] == 1) continue;
    int64_t st[4];
    for (int o = 0; o < k; o++) st[o] = strides[o] ? strides[o][d] : cst[d];
    int p = g->nd - 1;
    int merge = p >= 0;
    for (int o = 0; o < k && merge; o++) merge = g->st[o][p] == st[o] * shape[d];
    if (merge) {
      g->shape[p] *= shape[d];
      for (int o = 0; o < k; o++) g->st[o][p] = st[o];
    } else {
      g->shape[g->nd] = shape[d];
      for (int o = 0; o < k; o++) g->st[o][g->nd] = st[o];
      g->nd++;
    }
  }
  if (g->nd == 0) {
    g->nd = 1; g->shape[0] = 1;
    for (int o = 0; o < k; o++) g->st[o][0] = 1;
  }
  return numel;
}

int geo_contiguous(const Geo& g, int k) {
  if (g.nd != 1) return 0;
  for (int o = 0; o < k; o++) if (g.st[o][0] != 1) return 0;
  return 1;
}

/* 32-bit offsets suffice when every reachable offset and the count fit. */
int geo_fits32(const Geo& g, int k, int64_t n) {
  if (n >= ((int64_t)1 << 31)) return 0;
  for (int o = 0; o < k; o++) {
    int64_t lo = 0, hi = 0;
    for (int d = 0; d < g.nd; d++) {
      int64_t e = (g.shape[d] - 1) * g.st[o][d];
      if (e > 0) hi += e; else lo += e;
    }
    if (hi >= ((int64_t)1 << 31) || lo <= -((int64_t)1 << 31)) return 0;
  }
  return 1;
}

template <int K, typename IT>
__device__ __forceinline__ void geo_offsets(const Geo& g, IT i, IT (&off)[K]) {
#pragma unroll
  for (int k = 0; k < K; k++) off[k] = 0;
#pragma unroll
  for (int d = KCU_MAX_DIMS - 1; d >= 1; d--) {
    if (d < g.nd) {
      IT sz = (IT)g.shape[d];
      IT c = i % sz;
      i /= sz;
#pragma unroll
      for (int k = 0; k < K; k++) off[k] += c * (IT)g.st[k][d];
    }
  }
#pragma unroll
  for (int k = 0; k < K; k++) off[k] += i * (IT)g.st[k][0];
}

template <typename T, int V> struct alignas(sizeof(T) * V) kvec { T v[V]; };
template <typename T, int N> struct kptrs { const T* p[N]; };

/* ---------------------------------------------------------------- generic kernels */
template <typename T, int NIN, int V, typename F>
__global__ void ew_contig(int64_t n, T* out, kptrs<T, NIN> in, F f) {
  int64_t step = (int64_t)gridDim.x * blockDim.x * V;
  for (int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * V; i < n; i += step) {
    if (V > 1 && i + V <= n) {
      kvec<T, V> a[NIN];
#pragma unroll
      for (int k = 0; k < NIN; k++) a[k] = *reinterpret_cast<const kvec<T, V>*>(in.p[k] + i);
      kvec<T, V> r;
#pragma unroll
      for (int j = 0; j < V; j++) {
        T v[NIN];
#pragma unroll
        for (int k = 0; k < NIN; k++) v[k] = a[k].v[j];
        r.v[j] = f(v);
      }
      *reinterpret_cast<kvec<T, V>*>(out + i) = r;
    } else {
      for (int j = 0; j < V && i + j < n; j++) {
        T v[NIN];
#pragma unroll
        for (int k = 0; k < NIN; k++) v[k] = in.p[k][i + j];
        out[i + j] = f(v);
      }
    }
  }
}

template <typename T, int NIN, typename IT, typename F>
__global__ void ew_strided(IT n, Geo g, T* out, kptrs<T, NIN> in, F f) {
  IT step = (IT)gridDim.x * blockDim.x;
  for (IT i = (IT)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    IT off[NIN + 1];
    geo_offsets<NIN + 1, IT>(g, i, off);
    T v[NIN];
#pragma unroll
    for (int k = 0; k < NIN; k++) v[k] = in.p[k][off[k + 1]];
    out[off[0]] = f(v);
  }
}

int aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }

/* Runs f over the geometry: operand 0 is out, 1..NIN the inputs. */
template <typename T, int NIN, typename F>
int launch_ew(int ndim, const int64_t* shape, T* out, const int64_t* so, const T* const* in,
              const int64_t* const* sin, F f, cudaStream_t s) {
  Geo g;
  const int64_t* strides[NIN + 1];
  strides[0] = so;
  for (int k = 0; k < NIN; k++) strides[k + 1] = sin[k];
  int64_t n = make_geo(&g, ndim, shape, NIN + 1, strides);
  if (n < 0) return KCU_EARG;
  if (n == 0) return KCU_OK;
  if (!out) return KCU_EARG;
  kptrs<T, NIN> p;
  for (int k = 0; k < NIN; k++) {
    if (!in[k]) return KCU_EARG;
    p.p[k] = in[k];
  }
  if (geo_contiguous(g, NIN + 1)) {
    const int V = 16 / sizeof(T) > 0 ? 16 / sizeof(T) : 1;
    int al = aligned16(out);
    for (int k = 0; k < NIN; k++) al = al && aligned16(in[k]);
    if (al && V > 1)
      ew_contig<T, NIN, V, F><<<kcu_grid(n, (int64_t)kThreads * V, kMaxBlocks), kThreads, 0, s>>>(n, out, p, f);
    else
      ew_contig<T, NIN, 1, F><<<kcu_grid(n, kThreads, kMaxBlocks), kThreads, 0, s>>>(n, out, p, f);
  } else if (geo_fits32(g, NIN + 1, n)) {
    ew_strided<T, NIN, int32_t, F><<<kcu_grid(n, kThreads, kMaxBlocks), kThreads, 0, s>>>((int32_t)n, g, out, p, f);
  } else {
    ew_strided<T, NIN, int64_t, F><<<kcu_grid(n, kThreads, kMaxBlocks), kThreads, 0, s>>>(n, g, out, p, f);
  }
  return kcu_launch_status();
}

/* ---------------------------------------------------------------- functors */
__device__ __forceinline__ float unary_acc(int op, float x, float lo, float hi) { return kcm_unary_f32(op, x, lo, hi); }
__device__ __forceinline__ double unary_acc(int op, double x, double lo, double hi) {
  return kcm_unary_f64(op, x, lo, hi);
}
__device__ __forceinline__ float ugrad_acc(int op, float g, float x, float y, float lo, float hi) {
  return kcm_unary_grad_f32(op, g, x, y, lo, hi);
}
__device__ __forceinline__ double ugrad_acc(int op, double g, double x, double y, double lo, double hi) {
  return kcm_unary_grad_f64(op, g, x, y, lo, hi);
}
__device__ __forceinline__ float binary_acc(int op, float x, float y) { return kcm_binary_f32(op, x, y); }
__device__ __forceinline__ double binary_acc(int op, double x, double y) { return kcm_binary_f64(op, x, y); }

template <typename T> struct UnaryF {
  typedef typename kacc<T>::type A;
  int op; A lo, hi;
  __device__ __forceinline__ T operator()(const T (&v)[1]) const { return kstore<T>(unary_acc(op, kload(v[0]), lo, hi)); }
};

/* The same with the op fixed at compile time (the hot activations: GELU, tanh GELU, SiLU, ReLU): the switch over
 * ops folds away, so a thread's V elements compute side by side instead of one switch dispatch each.  Same
 * formula, same results. */
template <typename T, int OP> struct UnaryOpF {
  typedef typename kacc<T>::type A;
  A lo, hi;
  __device__ __forceinline__ T operator()(const T (&v)[1]) const { return kstore<T>(unary_acc(OP, kload(v[0]), lo, hi)); }
};

template <typename T> struct UnaryI {
  int op; T lo, hi;
  __device__ __forceinline__ T operator()(const T (&v)[1]) const {
    T x = v[0];
    T neg = (T)(0ull - (uint64_t)(int64_t)x);
    switch (op) {
      case KCM_NEG: return neg;
      case KCM_ABS:
        if constexpr ((T)-1 < (T)0) return x < (T)0 ? neg : x;
        else return x;
      case KCM_RELU: return x > (T)0 ? x : (T)0;
      case KCM_CLAMP: { T c = x < lo ? lo : x; return c > hi ? hi : c; }
      default: return x;
    }
  }
};

template <typename T> struct UnaryGradF {
  typedef typename kacc<T>::type A;
  int op; A lo, hi;
  __device__ __forceinline__ T operator()(const T (&v)[3]) const {
    return kstore<T>(ugrad_acc(op, kload(v[0]), kload(v[1]), kload(v[2]), lo, hi));
  }
};

template <typename T, int OP> struct UnaryGradOpF {
  typedef typename kacc<T>::type A;
  A lo, hi;
  __device__ __forceinline__ T operator()(const T (&v)[3]) const {
    return kstore<T>(ugrad_acc(OP, kload(v[0]), kload(v[1]), kload(v[2]), lo, hi));
  }
};

/* Runs the statement (using f) with f the functor F<T, op> for the hot activations, else with the generic one. */
#define HOT_UNARY(op, F, G, ...)                                  \
  switch (op) {                                                   \
    case KCM_GELU: { F<T, KCM_GELU> f{G.lo, G.hi}; __VA_ARGS__; }         \
    case KCM_GELU_TANH: { F<T, KCM_GELU_TANH> f{G.lo, G.hi}; __VA_ARGS__; } \
    case KCM_SILU: { F<T, KCM_SILU> f{G.lo, G.hi}; __VA_ARGS__; }         \
    case KCM_RELU: { F<T, KCM_RELU> f{G.lo, G.hi}; __VA_ARGS__; }         \
    default: { auto& f = G; __VA_ARGS__; }                                \
  }

template <typename T> struct BinaryF {
  int op;
  __device__ __forceinline__ T operator()(const T (&v)[2]) const {
    return kstore<T>(binary_acc(op, kload(v[0]), kload(v[1])));
  }
};

template <typename T> struct BinaryI {
  int op;
  __device__ __forceinline__ T operator()(const T (&v)[2]) const {
    return (T)kcm_binary_i64(op, (int64_t)v[0], (int64_t)v[1]);
  }
};

/* Integer clamp bounds, saturated to T's range (NaN = no bound), as kcpu. */
template <typename T> void int_bounds(double p0, double p1, double tmin, double tmax, T* lo, T* hi) {
  *lo = (p0 != p0 || p0 <= tmin) ? (T)tmin : (p0 >= tmax ? (T)tmax : (T)p0);
  *hi = (p1 != p1 || p1 >= tmax) ? (T)tmax : (p1 <= tmin ? (T)tmin : (T)p1);
}

template <typename T>
int unary_float(int op, int ndim, const int64_t* shape, void* out, const int64_t* so, const void* x,
                const int64_t* sx, double p0, double p1, cudaStream_t s) {
  typedef typename kacc<T>::type A;
  UnaryF<T> gf;
  gf.op = op;
  gf.lo = (op == KCM_CLAMP && p0 != p0) ? (A)-INFINITY : (A)p0; /* NaN = no clamp bound; others' parameters as given */
  gf.hi = (op == KCM_CLAMP && p1 != p1) ? (A)INFINITY : (A)p1;
  const T* in[1] = {(const T*)x};
  const int64_t* sin[1] = {sx};
  HOT_UNARY(op, UnaryOpF, gf, return launch_ew<T, 1>(ndim, shape, (T*)out, so, in, sin, f, s));
}

template <typename T>
int unary_int(int op, int ndim, const int64_t* shape, void* out, const int64_t* so, const void* x,
              const int64_t* sx, double p0, double p1, double tmin, double tmax, cudaStream_t s) {
  if (op != KCM_NEG && op != KCM_ABS && op != KCM_RELU && op != KCM_CLAMP) return KCU_EARG;
  UnaryI<T> f;
  f.op = op;
  int_bounds<T>(p0, p1, tmin, tmax, &f.lo, &f.hi);
  const T* in[1] = {(const T*)x};
  const int64_t* sin[1] = {sx};
  return launch_ew<T, 1>(ndim, shape, (T*)out, so, in, sin, f, s);
}

template <typename T>
int unary_grad_float(int op, int ndim, const int64_t* shape, void* gi, const int64_t* sgi, const void* g,
                     const int64_t* sg, const void* x, const int64_t* sx, const void* y, const int64_t* sy,
                     double p0, double p1, cudaStream_t s) {
  typedef typename kacc<T>::type A;
  UnaryGradF<T> gf;
  gf.op = op;
  gf.lo = (op == KCM_CLAMP && p0 != p0) ? (A)-INFINITY : (A)p0; /* NaN = no clamp bound; others' parameters as given */
  gf.hi = (op == KCM_CLAMP && p1 != p1) ? (A)INFINITY : (A)p1;
  /* an operand the op does not read is replaced by g (any valid pointer) */
  const T* in[3] = {(const T*)g, x ? (const T*)x : (const T*)g, y ? (const T*)y : (const T*)g};
  const int64_t* sin[3] = {sg, x ? sx : sg, y ? sy : sg};
  HOT_UNARY(op, UnaryGradOpF, gf, return launch_ew<T, 3>(ndim, shape, (T*)gi, sgi, in, sin, f, s));
}

template <typename T, typename F>
int binary_run(F f, int ndim, const int64_t* shape, void* out, const int64_t* so, const void* a, const int64_t* sa,
               const void* b, const int64_t* sb, cudaStream_t s) {
  const T* in[2] = {(const T*)a, (const T*)b};
  const int64_t* sin[2] = {sa, sb};
  return launch_ew<T, 2>(ndim, shape, (T*)out, so, in, sin, f, s);
}

/* ---------------------------------------------------------------- conversions */
struct kbool { uint8_t u; };

template <typename T> __device__ __forceinline__ double to_d(T v) { return (double)v; }
template <> __device__ __forceinline__ double to_d<kbf16>(kbf16 v) { return kcm_bf16_to_f32(v.u); }
template <> __device__ __forceinline__ double to_d<kf16>(kf16 v) { return kcm_f16_to_f32(v.u); }
template <> __device__ __forceinline__ double to_d<kbool>(kbool v) { return v.u ? 1.0 : 0.0; }
template <typename T> __device__ __forceinline__ T from_d(double v) { return (T)v; }
template <> __device__ __forceinline__ float from_d<float>(double v) { return (float)v; }
template <> __device__ __forceinline__ kbf16 from_d<kbf16>(double v) { kbf16 r; r.u = kcm_f32_to_bf16((float)v); return r; }
template <> __device__ __forceinline__ kf16 from_d<kf16>(double v) { kf16 r; r.u = kcm_f32_to_f16((float)v); return r; }
template <> __device__ __forceinline__ uint8_t from_d<uint8_t>(double v) { return (uint8_t)(int64_t)v; }
template <> __device__ __forceinline__ kbool from_d<kbool>(double v) { kbool r; r.u = v != 0.0; return r; }

/* f32 <-> bf16 <-> f16 go through f32 (exact, and the same result as
 * through f64); everything else through f64 like kc_load / kc_store. */
template <typename T> struct is_fl { static const bool v = false; };
template <> struct is_fl<float> { static const bool v = true; };
template <> struct is_fl<kbf16> { static const bool v = true; };
template <> struct is_fl<kf16> { static const bool v = true; };

template <typename A, typename B> struct same_t { static const bool v = false; };
template <typename A> struct same_t<A, A> { static const bool v = true; };

template <typename TO, typename TI> __device__ __forceinline__ TO convert(TI x) {
  if constexpr (same_t<TO, TI>::v) return x; /* exact for i64 too */
  else if constexpr (is_fl<TO>::v && is_fl<TI>::v) return kstore<TO>(kload(x));
  else return from_d<TO>(to_d<TI>(x));
}

template <typename TO, typename TI, typename IT>
__global__ void copy_kernel(IT n, Geo g, TO* dst, const TI* src) {
  IT step = (IT)gridDim.x * blockDim.x;
  for (IT i = (IT)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    IT off[2];
    geo_offsets<2, IT>(g, i, off);
    dst[off[0]] = convert<TO, TI>(src[off[1]]);
  }
}

template <typename TO, typename TI>
int copy_run(const Geo& g, int64_t n, void* dst, const void* src, cudaStream_t s) {
  unsigned grid = kcu_grid(n, kThreads, kMaxBlocks);
  if (geo_fits32(g, 2, n))
    copy_kernel<TO, TI, int32_t><<<grid, kThreads, 0, s>>>((int32_t)n, g, (TO*)dst, (const TI*)src);
  else
    copy_kernel<TO, TI, int64_t><<<grid, kThreads, 0, s>>>(n, g, (TO*)dst, (const TI*)src);
  return kcu_launch_status();
}

template <typename TO>
int copy_from(int sdt, const Geo& g, int64_t n, void* dst, const void* src, cudaStream_t s) {
  switch (sdt) {
    case KCU_F32: return copy_run<TO, float>(g, n, dst, src, s);
    case KCU_F64: return copy_run<TO, double>(g, n, dst, src, s);
    case KCU_BF16: return copy_run<TO, kbf16>(g, n, dst, src, s);
    case KCU_F16: return copy_run<TO, kf16>(g, n, dst, src, s);
    case KCU_I32: return copy_run<TO, int32_t>(g, n, dst, src, s);
    case KCU_I64: return copy_run<TO, int64_t>(g, n, dst, src, s);
    case KCU_U8: return copy_run<TO, uint8_t>(g, n, dst, src, s);
    case KCU_BOOL: return copy_run<TO, kbool>(g, n, dst, src, s);
    default: return KCU_EARG;
  }
}

template <typename T>
__global__ void fill_kernel(int64_t n, T* dst, T v) {
  int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) dst[i] = v;
}

}  // namespace

/* ================================================================ C interface */
extern "C" int kcu_dtype_size(int dt) {
  switch (dt) {
    case KCU_F32: case KCU_I32: return 4;
    case KCU_F64: case KCU_I64: return 8;
    case KCU_BF16: case KCU_F16: return 2;
    case KCU_U8: case KCU_BOOL: return 1;
    default: return 0;
  }
}

extern "C" const char* kcu_status_string(int status) {
  if (status == KCU_OK) return "success";
  if (status == KCU_EARG) return "invalid argument (unsupported dtype, size or configuration)";
  if (status == KCU_ENOALGO) return "cuBLASLt found no algorithm for this GEMM configuration";
  if (status <= KCU_ECUBLAS) {
    switch (KCU_ECUBLAS - status) {
      case 1: return "cuBLAS error: CUBLAS_STATUS_NOT_INITIALIZED";
      case 3: return "cuBLAS error: CUBLAS_STATUS_ALLOC_FAILED";
      case 7: return "cuBLAS error: CUBLAS_STATUS_INVALID_VALUE";
      case 8: return "cuBLAS error: CUBLAS_STATUS_ARCH_MISMATCH";
      case 11: return "cuBLAS error: CUBLAS_STATUS_MAPPING_ERROR";
      case 13: return "cuBLAS error: CUBLAS_STATUS_EXECUTION_FAILED";
      case 14: return "cuBLAS error: CUBLAS_STATUS_INTERNAL_ERROR";
      case 15: return "cuBLAS error: CUBLAS_STATUS_NOT_SUPPORTED";
      default: return "cuBLAS error";
    }
  }
  if (status > 0) return cudaGetErrorString((cudaError_t)status);
  return "unknown kcu status";
}

extern "C" int kcu_unary(int op, int dt, int ndim, const int64_t* shape, void* out, const int64_t* so,
                         const void* x, const int64_t* sx, double p0, double p1, cudaStream_t s) {
  if (op < 0 || op >= KCM_NUM_UNARY) return KCU_EARG;
  switch (dt) {
    case KCU_F32: return unary_float<float>(op, ndim, shape, out, so, x, sx, p0, p1, s);
    case KCU_F64: return unary_float<double>(op, ndim, shape, out, so, x, sx, p0, p1, s);
    case KCU_BF16: return unary_float<kbf16>(op, ndim, shape, out, so, x, sx, p0, p1, s);
    case KCU_F16: return unary_float<kf16>(op, ndim, shape, out, so, x, sx, p0, p1, s);
    case KCU_I32: return unary_int<int32_t>(op, ndim, shape, out, so, x, sx, p0, p1, -2147483648.0, 2147483647.0, s);
    case KCU_I64:
      return unary_int<int64_t>(op, ndim, shape, out, so, x, sx, p0, p1, -9223372036854775808.0,
                                9223372036854775807.0, s);
    case KCU_U8: case KCU_BOOL: return unary_int<uint8_t>(op, ndim, shape, out, so, x, sx, p0, p1, 0.0, 255.0, s);
    default: return KCU_EARG;
  }
}

extern "C" int kcu_unary_grad(int op, int dt, int ndim, const int64_t* shape, void* gi, const int64_t* sgi,
                              const void* g, const int64_t* sg, const void* x, const int64_t* sx, const void* y,
                              const int64_t* sy, double p0, double p1, cudaStream_t s) {
  if (op < 0 || op >= KCM_NUM_UNARY) return KCU_EARG;
  switch (dt) {
    case KCU_F32: return unary_grad_float<float>(op, ndim, shape, gi, sgi, g, sg, x, sx, y, sy, p0, p1, s);
    case KCU_F64: return unary_grad_float<double>(op, ndim, shape, gi, sgi, g, sg, x, sx, y, sy, p0, p1, s);
    case KCU_BF16: return unary_grad_float<kbf16>(op, ndim, shape, gi, sgi, g, sg, x, sx, y, sy, p0, p1, s);
    case KCU_F16: return unary_grad_float<kf16>(op, ndim, shape, gi, sgi, g, sg, x, sx, y, sy, p0, p1, s);
    default: return KCU_EARG;
  }
}

extern "C" int kcu_binary(int op, int dt, int ndim, const int64_t* shape, void* out, const int64_t* so,
                          const void* a, const int64_t* sa, const void* b, const int64_t* sb, cudaStream_t s) {
  if (op < 0 || op >= KCM_NUM_BINARY) return KCU_EARG;
  switch (dt) {
    case KCU_F32: { BinaryF<float> f = {op}; return binary_run<float>(f, ndim, shape, out, so, a, sa, b, sb, s); }
    case KCU_F64: { BinaryF<double> f = {op}; return binary_run<double>(f, ndim, shape, out, so, a, sa, b, sb, s); }
    case KCU_BF16: { BinaryF<kbf16> f = {op}; return binary_run<kbf16>(f, ndim, shape, out, so, a, sa, b, sb, s); }
    case KCU_F16: { BinaryF<kf16> f = {op}; return binary_run<kf16>(f, ndim, shape, out, so, a, sa, b, sb, s); }
    case KCU_I32: { BinaryI<int32_t> f = {op}; return binary_run<int32_t>(f, ndim, shape, out, so, a, sa, b, sb, s); }
    case KCU_I64: { BinaryI<int64_t> f = {op}; return binary_run<int64_t>(f, ndim, shape, out, so, a, sa, b, sb, s); }
    case KCU_U8: case KCU_BOOL: {
      BinaryI<uint8_t> f = {op};
      return binary_run<uint8_t>(f, ndim, shape, out, so, a, sa, b, sb, s);
    }
    default: return KCU_EARG;
  }
}

extern "C" int kcu_copy(int ndim, const int64_t* shape, void* dst, int ddt, const int64_t* sd, const void* src,
                        int sdt, const int64_t* ss, cudaStream_t s) {
  if (kcu_dtype_size(ddt) == 0 || kcu_dtype_size(sdt) == 0) return KCU_EARG;
  Geo g;
  const int64_t* strides[2] = {sd, ss};
  int64_t n = make_geo(&g, ndim, shape, 2, strides);
  if (n < 0) return KCU_EARG;
  if (n == 0) return KCU_OK;
  if (!dst || !src) return KCU_EARG;
  if (ddt == sdt && geo_contiguous(g, 2))
    return (int)cudaMemcpyAsync(dst, src, (size_t)n * kcu_dtype_size(ddt), cudaMemcpyDeviceToDevice, s);
  switch (ddt) {
    case KCU_F32: return copy_from<float>(sdt, g, n, dst, src, s);
    case KCU_F64: return copy_from<double>(sdt, g, n, dst, src, s);
    case KCU_BF16: return copy_from<kbf16>(sdt, g, n, dst, src, s);
    case KCU_F16: return copy_from<kf16>(sdt, g, n, dst, src, s);
    case KCU_I32: return copy_from<int32_t>(sdt, g, n, dst, src, s);
    case KCU_I64: return copy_from<int64_t>(sdt, g, n, dst, src, s);
    case KCU_U8: return copy_from<uint8_t>(sdt, g, n, dst, src, s);
    default: return copy_from<kbool>(sdt, g, n, dst, src, s);
  }
}

extern "C" int kcu_cast(int64_t n, void* dst, int ddt, const void* src, int sdt, cudaStream_t s) {
  if (n < 0) return KCU_EARG;
  return kcu_copy(1, &n, dst, ddt, NULL, src, sdt, NULL, s);
}

extern "C" int kcu_fill(int dt, int64_t n, void* dst, double v, cudaStream_t s) {
  if (n < 0 || kcu_dtype_size(dt) == 0) return KCU_EARG;
  if (n == 0) return KCU_OK;
  if (!dst) return KCU_EARG;
  uint64_t bits = 0;
  switch (dt) {
    case KCU_F32: { float f = (float)v; memcpy(&bits, &f, 4); break; }
    case KCU_F64: memcpy(&bits, &v, 8); break;
    case KCU_BF16: bits = kcm_f32_to_bf16((float)v); break;
    case KCU_F16: bits = kcm_f32_to_f16((float)v); break;
    case KCU_I32: { int32_t i = (int32_t)v; memcpy(&bits, &i, 4); break; }
    case KCU_I64: { int64_t i = (int64_t)v; memcpy(&bits, &i, 8); break; }
    case KCU_U8: bits = (uint8_t)(int64_t)v; break;
    default: bits = v != 0.0; break;
  }
  int es = kcu_dtype_size(dt);
  if (bits == 0) return (int)cudaMemsetAsync(dst, 0, (size_t)n * es, s);
  unsigned grid = kcu_grid(n, kThreads, kMaxBlocks);
  switch (es) {
    case 1: fill_kernel<uint8_t><<<grid, kThreads, 0, s>>>(n, (uint8_t*)dst, (uint8_t)bits); break;
    case 2: fill_kernel<uint16_t><<<grid, kThreads, 0, s>>>(n, (uint16_t*)dst, (uint16_t)bits); break;
    case 4: fill_kernel<uint32_t><<<grid, kThreads, 0, s>>>(n, (uint32_t*)dst, (uint32_t)bits); break;
    default: fill_kernel<uint64_t><<<grid, kThreads, 0, s>>>(n, (uint64_t*)dst, bits); break;
  }
  return kcu_launch_status();
}
