/* math.cu: the extra pointwise math on the device (sin, cos, floor, ceil,
 * round, trunc, sign, erf, log1p, expm1, reciprocal, square, isnan, isinf,
 * isfinite, logical_not, nan_to_num; fmod, remainder, floor_divide,
 * logical_and/or): one grid-stride kernel over N-d strided operands, the
 * formulas of kernels/cpu/math.c in double. */
#include "common.cuh"
#include "kmath_cuda.h"
#include "../cpu/kmath.h"
#include <float.h>

namespace {

struct Geo {
  int nd;
  int64_t shape[KCU_MAX_DIMS], so[KCU_MAX_DIMS], sa[KCU_MAX_DIMS], sb[KCU_MAX_DIMS];
};

__device__ double fmax_of(int dt) {
  switch (dt) {
    case KCU_F32: return FLT_MAX;
    case KCU_BF16: return 3.3895313892515355e38;
    case KCU_F16: return 65504.0;
    default: return DBL_MAX;
  }
}

__device__ double unary_d(int op, double x, double p0, double p1, double p2, int odt) {
  switch (op) {
    case KM_SIN: return sin(x);
    case KM_COS: return cos(x);
    case KM_FLOOR: return floor(x);
    case KM_CEIL: return ceil(x);
    case KM_ROUND:
      if (p0 == 0) return rint(x);
      if (p0 > 0) { double t = pow(10.0, p0); return rint(x * t) / t; }
      else { double t = pow(10.0, -p0); return rint(x / t) * t; }
    case KM_TRUNC: return trunc(x);
    case KM_SIGN: return (double)((x > 0) - (x < 0));
    case KM_ERF: return erf(x);
    case KM_LOG1P: return log1p(x);
    case KM_EXPM1: return expm1(x);
    case KM_RECIP: return 1.0 / x;
    case KM_SQUARE: return x * x;
    case KM_ISNAN: return isnan(x) ? 1 : 0;
    case KM_ISINF: return isinf(x) ? 1 : 0;
    case KM_ISFINITE: return isfinite(x) ? 1 : 0;
    case KM_LNOT: return x == 0 ? 1 : 0;
    case KM_NAN_TO_NUM:
      if (isnan(x)) return p0;
      if (isinf(x)) {
        double r = x > 0 ? p1 : p2;
        if (isnan(r)) r = x > 0 ? fmax_of(odt) : -fmax_of(odt);
        return r;
      }
      return x;
  }
  return x;
}

__device__ double binary_d(int op, double a, double b) {
  switch (op) {
    case KM_FMOD: return fmod(a, b);
    case KM_REMAINDER: {
      double m = fmod(a, b);
      if (m != 0 && ((b < 0) != (m < 0))) m += b;
      return m;
    }
    case KM_FLOORDIV: {
      if (b == 0) return a / b;
      double mod = fmod(a, b);
      double div = (a - mod) / b;
      if (mod != 0 && ((b < 0) != (mod < 0))) div -= 1;
      if (div != 0) {
        double fd = floor(div);
        if (div - fd > 0.5) fd += 1.0;
        return fd;
      }
      return copysign(0.0, a / b);
    }
    case KM_LAND: return (a != 0) && (b != 0);
    case KM_LOR: return (a != 0) || (b != 0);
    case KM_TRUNCDIV: return trunc(a / b);
  }
  return 0;
}

__global__ void k_unary(int op, int idt, int odt, int64_t n, Geo g, void* out, const void* x, double p0, double p1,
                        double p2) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = i, oo = 0, ox = 0;
    for (int d = g.nd - 1; d >= 0; d--) {
      int64_t c = r % g.shape[d];
      r /= g.shape[d];
      oo += c * g.so[d];
      ox += c * g.sa[d];
    }
    kst_dt(out, odt, oo, unary_d(op, kld_dt(x, idt, ox), p0, p1, p2, odt));
  }
}

__global__ void k_binary(int op, int dt, int odt, int64_t n, Geo g, void* out, const void* a, const void* b) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = i, oo = 0, oa = 0, ob = 0;
    for (int d = g.nd - 1; d >= 0; d--) {
      int64_t c = r % g.shape[d];
      r /= g.shape[d];
      oo += c * g.so[d];
      oa += c * g.sa[d];
      ob += c * g.sb[d];
    }
    kst_dt(out, odt, oo, binary_d(op, kld_dt(a, dt, oa), kld_dt(b, dt, ob)));
  }
}

int is_float(int dt) { return dt == KCU_F32 || dt == KCU_F64 || dt == KCU_BF16 || dt == KCU_F16; }

int make_geo(Geo* g, int ndim, const int64_t* shape, const int64_t* so, const int64_t* sa, const int64_t* sb,
             int64_t* n) {
  if (ndim < 0 || ndim > KCU_MAX_DIMS) return KCU_EARG;
  g->nd = ndim;
  *n = 1;
  for (int d = 0; d < ndim; d++) {
    g->shape[d] = shape[d];
    g->so[d] = so[d];
    g->sa[d] = sa[d];
    g->sb[d] = sb ? sb[d] : 0;
    *n *= shape[d];
  }
  return 0;
}

}  // namespace

extern "C" int kcu_math_unary(int op, int idt, int odt, int ndim, const int64_t* shape, void* out, const int64_t* so,
                              const void* x, const int64_t* sx, const double* p, cudaStream_t stream) {
  if (!is_float(idt) || (odt != idt && odt != KCU_BOOL) || op < 0 || op >= KM_UCOUNT) return KCU_EARG;
  Geo g;
  int64_t n;
  if (make_geo(&g, ndim, shape, so, sx, NULL, &n)) return KCU_EARG;
  if (n == 0) return 0;
  k_unary<<<kcu_grid(n, 256, 4096), 256, 0, stream>>>(op, idt, odt, n, g, out, x, p[0], p[1], p[2]);
  return kcu_launch_status();
}

extern "C" int kcu_math_binary(int op, int dt, int odt, int ndim, const int64_t* shape, void* out, const int64_t* so,
                               const void* a, const int64_t* sa, const void* b, const int64_t* sb,
                               cudaStream_t stream) {
  int logical = op == KM_LAND || op == KM_LOR;
  if (op < 0 || op >= KM_BCOUNT || (logical ? odt != KCU_BOOL : (!is_float(dt) || odt != dt))) return KCU_EARG;
  Geo g;
  int64_t n;
  if (make_geo(&g, ndim, shape, so, sa, sb, &n)) return KCU_EARG;
  if (n == 0) return 0;
  k_binary<<<kcu_grid(n, 256, 4096), 256, 0, stream>>>(op, dt, odt, n, g, out, a, b);
  return kcu_launch_status();
}
