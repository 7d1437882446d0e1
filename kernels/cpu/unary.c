/* unary.c: elementwise unary kernels and their derivatives over strided rows.
 * Floating ops run in f32 or f64 (bf16/f16 are upcast by the engine);
 * neg, abs, relu and clamp also have integer kernels.  Formulas follow
 * PyTorch: gelu exact = x * Phi(x), gelu tanh = 0.5 x (1 + tanh(sqrt(2/pi)
 * (x + 0.044715 x^3))), silu = x * sigmoid(x); clamp = min(max(x, lo), hi)
 * with a NaN bound meaning "no bound" and a NaN input staying NaN. */
/* Exception flags and errno are not part of the kernels' contract; without
 * them gcc vectorizes the branch-free f32 functions below. */
#pragma GCC optimize("no-trapping-math", "no-math-errno")
#include "kcpu.h"
#include <math.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

#define K_SQRT1_2 0.70710678118654752440
#define K_2_SQRTPI 1.12837916709551257390
#define K_SQRT_2_PI 0.79788456080286535588 /* sqrt(2/pi) */
#define K_GELU_C 0.044715
#define K_INV_SQRT_2PI 0.39894228040143267794 /* 1/sqrt(2 pi) */

/* ---------------------------------------------------------------- f32 math
 * Vectorizable expf: range reduction x = k ln2 + r, |r| <= ln2/2, degree-6
 * polynomial (relative error below 2 ulp), scale by 2^k through the
 * exponent bits.  Handles overflow/underflow and NaN like expf. */
static inline float k_expf(float x) {
  const float hi = 88.7228390f, lo = -103.972084f;
  float xc = x > hi ? hi : (x < lo ? lo : x);
  xc = xc != xc ? 0.0f : xc; /* NaN: any finite value (the result is x) */
  /* round to nearest through the 1.5 * 2^23 trick (|xc * log2 e| < 2^22) */
  float kf = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = xc - kf * 0.693145751953125f;        /* ln2 high part */
  r = r - kf * 1.428606765330187045e-06f;          /* ln2 low part */
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  /* 2^k in two steps so that k down to -150 and up to 128 stay finite/exact */
  int32_t k = (int32_t)kf;
  int32_t k1 = k >> 1, k2 = k - k1;
  float s1, s2;
  int32_t b1 = (int32_t)((uint32_t)(k1 + 127) << 23), b2 = (int32_t)((uint32_t)(k2 + 127) << 23);
  __builtin_memcpy(&s1, &b1, 4);
  __builtin_memcpy(&s2, &b2, 4);
  float res = p * s1 * s2;
  res = x > hi ? __builtin_inff() : res;
  res = x < lo ? 0.0f : res;
  return x != x ? x : res;
}

/* Vectorizable logf (Cephes-style): x = m 2^e with m in [sqrt(1/2), sqrt(2)),
 * log(1 + f) by a degree-9 polynomial; about 1 ulp.  Subnormals are scaled
 * first; x < 0 -> NaN, 0 -> -inf, inf and NaN pass through. */
static inline float k_logf(float x) {
  int sub = x < 1.17549435e-38f;
  float xs = sub ? x * 8388608.0f : x; /* 2^23 */
  int32_t bits;
  __builtin_memcpy(&bits, &xs, 4);
  int32_t e = ((bits >> 23) & 0xff) - 126;
  int32_t mb = (bits & 0x007fffff) | 0x3f000000; /* m in [0.5, 1) */
  float m;
  __builtin_memcpy(&m, &mb, 4);
  float ef = (float)e - (sub ? 23.0f : 0.0f);
  int small = m < 0.70710678118654752f;
  ef = small ? ef - 1.0f : ef;
  float f = small ? m + m - 1.0f : m - 1.0f;
  float z = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z;
  y += -2.12194440e-4f * ef;
  y += -0.5f * z;
  float r = f + y;
  r += 0.693359375f * ef;
  r = x == 0.0f ? -__builtin_inff() : r;
  r = x < 0.0f ? __builtin_nanf("") : r;
  r = x == __builtin_inff() ? x : r;
  return x != x ? x : r;
}

/* expm1 for |x| <= 1 (no cancellation): Taylor to x^11 (relative error
 * below 3e-9 at |x| = 1). */
static inline float k_expm1f_small(float x) {
  float p = 1.0f / 39916800.0f;
  p = p * x + 1.0f / 3628800.0f;
  p = p * x + 1.0f / 362880.0f;
  p = p * x + 1.0f / 40320.0f;
  p = p * x + 1.0f / 5040.0f;
  p = p * x + 1.0f / 720.0f;
  p = p * x + 1.0f / 120.0f;
  p = p * x + 1.0f / 24.0f;
  p = p * x + 1.0f / 6.0f;
  p = p * x + 0.5f;
  p = p * x + 1.0f;
  return p * x;
}

/* tanh(|x|) = -m / (2 + m) with m = expm1(-2|x|) for |x| < 0.5 (accurate
 * for small |x|), (1 - e) / (1 + e) with e = exp(-2|x|) beyond. */
static inline float k_tanhf(float x) {
  float ax = x < 0 ? -x : x;
  float y = -2.0f * ax;
  float m = k_expm1f_small(y < -1.0f ? -1.0f : y);
  float e = k_expf(y);
  float t = ax < 0.5f ? -m / (2.0f + m) : (1.0f - e) / (1.0f + e);
  t = x < 0 ? -t : t;
  return x != x ? x : t;
}

/* erfc for z >= 0 (Numerical Recipes' Chebyshev fit, fractional error below
 * 1.2e-7 everywhere, so the tail keeps its relative accuracy). */
static inline float k_erfcf_pos(float z) {
  float t = 1.0f / (1.0f + 0.5f * z);
  float p = 0.17087277f;
  p = p * t - 0.82215223f;
  p = p * t + 1.48851587f;
  p = p * t - 1.13520398f;
  p = p * t + 0.27886807f;
  p = p * t - 0.18628806f;
  p = p * t + 0.09678418f;
  p = p * t + 0.37409196f;
  p = p * t + 1.00002368f;
  p = p * t - 1.26551223f;
  return t * k_expf(p - z * z);
}
/* Standard normal CDF Phi(x) in float. */
static inline float k_phif(float x) {
  float z = (x < 0 ? -x : x) * (float)K_SQRT1_2;
  float h = 0.5f * k_erfcf_pos(z);
  return x < 0 ? h : 1.0f - h;
}

static inline float k_sigmoidf(float x) { return 1.0f / (1.0f + k_expf(-x)); }
static inline double k_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* gelu tanh: 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + c x^3)
 * (the sigmoid form keeps the negative tail accurate). */
static inline float k_gelu_tanhf(float x) {
  float u = (float)K_SQRT_2_PI * (x + (float)K_GELU_C * x * x * x);
  return x / (1.0f + k_expf(-2.0f * u));
}
static inline double k_gelu_tanh(double x) {
  double u = K_SQRT_2_PI * (x + K_GELU_C * x * x * x);
  return x / (1.0 + exp(-2.0 * u));
}
/* gelu exact: x * Phi(x); f64 through erfc so the negative tail keeps its
 * relative accuracy. */
static inline float k_geluf(float x) { return x * k_phif(x); }
static inline double k_gelu(double x) { return 0.5 * x * erfc(-x * K_SQRT1_2); }

/* ---------------------------------------------------------------- forward rows */
#define UROW(T, EXPR)                                                                \
  do {                                                                               \
    if (so == (int64_t)sizeof(T) && sa == (int64_t)sizeof(T) && o != a) {            \
      T* restrict O = (T*)o; const T* restrict A = (const T*)a;                      \
      for (int64_t i = 0; i < n; i++) { T x = A[i]; O[i] = (EXPR); }                \
    } else {                                                                         \
      for (int64_t i = 0; i < n; i++) {                                              \
        T x = *(const T*)(a + i * sa);                                               \
        *(T*)(o + i * so) = (EXPR);                                                  \
      }                                                                              \
    }                                                                                \
  } while (0)

/* sqrt / rsqrt of a contiguous f32 row with the vector sqrt instruction
 * (gcc keeps a scalar errno path for sqrtf otherwise). */
static int sqrt_f32_contig(int op, int64_t n, float* o, const float* a) {
#ifdef __AVX__
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    __m256 r = _mm256_sqrt_ps(_mm256_loadu_ps(a + i));
    if (op == KU_RSQRT) r = _mm256_div_ps(one, r);
    _mm256_storeu_ps(o + i, r);
  }
  for (; i < n; i++) o[i] = op == KU_RSQRT ? 1.0f / sqrtf(a[i]) : sqrtf(a[i]);
  return 1;
#else
  (void)op; (void)n; (void)o; (void)a;
  return 0;
#endif
}

static void unary_f32(int op, int64_t n, char* o, int64_t so, const char* a, int64_t sa, double p0,
                      double p1) {
  if ((op == KU_SQRT || op == KU_RSQRT) && so == 4 && sa == 4 && o != a &&
      sqrt_f32_contig(op, n, (float*)o, (const float*)a))
    return;
  switch (op) {
    case KU_NEG: UROW(float, -x); break;
    case KU_EXP: UROW(float, k_expf(x)); break;
    case KU_LOG: UROW(float, k_logf(x)); break;
    case KU_SQRT: UROW(float, sqrtf(x)); break;
    case KU_RSQRT: UROW(float, 1.0f / sqrtf(x)); break;
    case KU_ABS: UROW(float, fabsf(x)); break;
    case KU_TANH: UROW(float, k_tanhf(x)); break;
    case KU_SIGMOID: UROW(float, k_sigmoidf(x)); break;
    case KU_RELU: UROW(float, x > 0.0f ? x : (x != x ? x : 0.0f)); break;
    case KU_GELU: UROW(float, k_geluf(x)); break;
    case KU_GELU_TANH: UROW(float, k_gelu_tanhf(x)); break;
    case KU_SILU: UROW(float, x * k_sigmoidf(x)); break;
    case KU_CLAMP: {
      float lo = p0 != p0 ? -__builtin_inff() : (float)p0;
      float hi = p1 != p1 ? __builtin_inff() : (float)p1;
      UROW(float, x != x ? x : (x < lo ? lo : x) > hi ? hi : (x < lo ? lo : x));
      break;
    }
  }
}

static void unary_f64(int op, int64_t n, char* o, int64_t so, const char* a, int64_t sa, double p0,
                      double p1) {
  switch (op) {
    case KU_NEG: UROW(double, -x); break;
    case KU_EXP: UROW(double, exp(x)); break;
    case KU_LOG: UROW(double, log(x)); break;
    case KU_SQRT: UROW(double, sqrt(x)); break;
    case KU_RSQRT: UROW(double, 1.0 / sqrt(x)); break;
    case KU_ABS: UROW(double, fabs(x)); break;
    case KU_TANH: UROW(double, tanh(x)); break;
    case KU_SIGMOID: UROW(double, k_sigmoid(x)); break;
    case KU_RELU: UROW(double, x > 0.0 ? x : (x != x ? x : 0.0)); break;
    case KU_GELU: UROW(double, k_gelu(x)); break;
    case KU_GELU_TANH: UROW(double, k_gelu_tanh(x)); break;
    case KU_SILU: UROW(double, x * k_sigmoid(x)); break;
    case KU_CLAMP: {
      double lo = p0 != p0 ? -INFINITY : p0;
      double hi = p1 != p1 ? INFINITY : p1;
      UROW(double, x != x ? x : (x < lo ? lo : x) > hi ? hi : (x < lo ? lo : x));
      break;
    }
  }
}

/* Integer kernels: neg (wrapping), abs, relu, clamp (bounds saturated to
 * the type's range). */
#define UNARY_INT(T, TMIN, TMAX, NEG, ABS)                                           \
  do {                                                                               \
    switch (op) {                                                                    \
      case KU_NEG: UROW(T, NEG); break;                                              \
      case KU_ABS: UROW(T, ABS); break;                                              \
      case KU_RELU: UROW(T, x > 0 ? x : (T)0); break;                                \
      case KU_CLAMP: {                                                               \
        T lo = (p0 != p0 || p0 <= (double)(TMIN)) ? (TMIN)                           \
               : (p0 >= (double)(TMAX) ? (TMAX) : (T)p0);                            \
        T hi = (p1 != p1 || p1 >= (double)(TMAX)) ? (TMAX)                           \
               : (p1 <= (double)(TMIN) ? (TMIN) : (T)p1);                            \
        UROW(T, (x < lo ? lo : x) > hi ? hi : (x < lo ? lo : x));                    \
        break;                                                                       \
      }                                                                              \
      default: UROW(T, x); break;                                                    \
    }                                                                                \
  } while (0)

void kc_unary_row(int op, int dt, int64_t n, char* o, int64_t so, const char* a, int64_t sa,
                  double p0, double p1) {
  switch (dt) {
    case KC_F32: unary_f32(op, n, o, so, a, sa, p0, p1); break;
    case KC_F64: unary_f64(op, n, o, so, a, sa, p0, p1); break;
    case KC_I32: UNARY_INT(int32_t, INT32_MIN, INT32_MAX, (int32_t)(0u - (uint32_t)x),
                           x < 0 ? (int32_t)(0u - (uint32_t)x) : x); break;
    case KC_I64: UNARY_INT(int64_t, INT64_MIN, INT64_MAX, (int64_t)(0ull - (uint64_t)x),
                           x < 0 ? (int64_t)(0ull - (uint64_t)x) : x); break;
    default: UNARY_INT(uint8_t, 0, UINT8_MAX, (uint8_t)(0u - x), x); break;
  }
}

/* ---------------------------------------------------------------- derivatives */
#define GROW(T, EXPR)                                                                \
  do {                                                                               \
    if (sgi == (int64_t)sizeof(T) && sg == (int64_t)sizeof(T) && sx == (int64_t)sizeof(T) && \
        sy == (int64_t)sizeof(T)) {                                                  \
      T* O = (T*)gi; const T* G = (const T*)g; const T* X = (const T*)x;            \
      const T* Y = (const T*)y;                                                      \
      for (int64_t i = 0; i < n; i++) {                                              \
        T gv = G[i], xv = X[i], yv = Y[i]; (void)xv; (void)yv;                       \
        O[i] = (EXPR);                                                               \
      }                                                                              \
    } else {                                                                         \
      for (int64_t i = 0; i < n; i++) {                                              \
        T gv = *(const T*)(g + i * sg), xv = *(const T*)(x + i * sx);                \
        T yv = *(const T*)(y + i * sy); (void)xv; (void)yv;                          \
        *(T*)(gi + i * sgi) = (EXPR);                                                \
      }                                                                              \
    }                                                                                \
  } while (0)

static inline float d_geluf(float x) {
  float pdf = (float)K_INV_SQRT_2PI * k_expf(-0.5f * x * x);
  return k_phif(x) + x * pdf;
}
static inline double d_gelu(double x) {
  double cdf = 0.5 * erfc(-x * K_SQRT1_2);
  double pdf = K_INV_SQRT_2PI * exp(-0.5 * x * x);
  return cdf + x * pdf;
}
/* d/dx [x s(2u)] = s + x * 2 s (1 - s) u', s = sigmoid(2u). */
static inline float d_gelu_tanhf(float x) {
  float x2 = x * x;
  float u = (float)K_SQRT_2_PI * (x + (float)K_GELU_C * x2 * x);
  float s = 1.0f / (1.0f + k_expf(-2.0f * u));
  float du = (float)K_SQRT_2_PI * (1.0f + 3.0f * (float)K_GELU_C * x2);
  return s + 2.0f * x * s * (1.0f - s) * du;
}
static inline double d_gelu_tanh(double x) {
  double x2 = x * x;
  double u = K_SQRT_2_PI * (x + K_GELU_C * x2 * x);
  double s = 1.0 / (1.0 + exp(-2.0 * u));
  double du = K_SQRT_2_PI * (1.0 + 3.0 * K_GELU_C * x2);
  return s + 2.0 * x * s * (1.0 - s) * du;
}
static inline float d_siluf(float x) { float s = k_sigmoidf(x); return s * (1.0f + x * (1.0f - s)); }
static inline double d_silu(double x) { double s = k_sigmoid(x); return s * (1.0 + x * (1.0 - s)); }

void kc_unary_grad_row(int op, int dt, int64_t n, char* gi, int64_t sgi, const char* g, int64_t sg,
                       const char* x, int64_t sx, const char* y, int64_t sy, double p0, double p1) {
  if (dt == KC_F32) {
    float lo = p0 != p0 ? -__builtin_inff() : (float)p0, hi = p1 != p1 ? __builtin_inff() : (float)p1;
    switch (op) {
      case KU_NEG: GROW(float, -gv); break;
      case KU_EXP: GROW(float, gv * yv); break;
      case KU_LOG: GROW(float, gv / xv); break;
      case KU_SQRT: GROW(float, gv / (2.0f * yv)); break;
      case KU_RSQRT: GROW(float, -0.5f * gv * yv * yv * yv); break;
      case KU_ABS: GROW(float, xv > 0 ? gv : (xv < 0 ? -gv : 0.0f * gv)); break;
      case KU_TANH: GROW(float, gv * (1.0f - yv * yv)); break;
      case KU_SIGMOID: GROW(float, gv * yv * (1.0f - yv)); break;
      case KU_RELU: GROW(float, yv > 0 ? gv : 0.0f); break;
      case KU_GELU: GROW(float, gv * d_geluf(xv)); break;
      case KU_GELU_TANH: GROW(float, gv * d_gelu_tanhf(xv)); break;
      case KU_SILU: GROW(float, gv * d_siluf(xv)); break;
      case KU_CLAMP: GROW(float, (xv >= lo && xv <= hi) ? gv : 0.0f); break;
    }
  } else {
    double lo = p0 != p0 ? -INFINITY : p0, hi = p1 != p1 ? INFINITY : p1;
    switch (op) {
      case KU_NEG: GROW(double, -gv); break;
      case KU_EXP: GROW(double, gv * yv); break;
      case KU_LOG: GROW(double, gv / xv); break;
      case KU_SQRT: GROW(double, gv / (2.0 * yv)); break;
      case KU_RSQRT: GROW(double, -0.5 * gv * yv * yv * yv); break;
      case KU_ABS: GROW(double, xv > 0 ? gv : (xv < 0 ? -gv : 0.0 * gv)); break;
      case KU_TANH: GROW(double, gv * (1.0 - yv * yv)); break;
      case KU_SIGMOID: GROW(double, gv * yv * (1.0 - yv)); break;
      case KU_RELU: GROW(double, yv > 0 ? gv : 0.0); break;
      case KU_GELU: GROW(double, gv * d_gelu(xv)); break;
      case KU_GELU_TANH: GROW(double, gv * d_gelu_tanh(xv)); break;
      case KU_SILU: GROW(double, gv * d_silu(xv)); break;
      case KU_CLAMP: GROW(double, (xv >= lo && xv <= hi) ? gv : 0.0); break;
    }
  }
}
