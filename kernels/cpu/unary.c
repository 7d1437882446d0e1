/* unary.c: elementwise unary kernels and their derivatives over strided rows.
 * Floating ops run in f32 or f64 (bf16/f16 are upcast by the engine);
 * neg, abs, relu and clamp also have integer kernels.  Formulas follow
 * PyTorch: gelu exact = x * Phi(x), gelu tanh = 0.5 x (1 + tanh(sqrt(2/pi)
 * (x + 0.044715 x^3))), silu = x * sigmoid(x); clamp = min(max(x, lo), hi)
 * with a NaN bound meaning "no bound" and a NaN input staying NaN;
 * leaky_relu = x > 0 ? x : x s; elu = x <= 0 ? expm1(x) a : x; hardtanh =
 * clamp; softplus = x b > t ? x : log1p(exp(x b)) / b.  Derivatives as
 * PyTorch's *_backward kernels: leaky_relu s at and below 0, elu a exp(x) at
 * and below 0, hardtanh 0 at and outside the bounds, softplus
 * z / (z + 1), z = exp(x b), up to the threshold and 1 above it. */
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

/* Phi(x) for gelu in float, with its relative accuracy kept in the
 * negative tail: Phi(-|x|) = erfc(z) / 2 with z = |x| / sqrt 2 and
 *   erfc(z) = t * Q(t) * exp(-x^2 / 2),  t = 1 / (1 + z / 2),
 * Q a degree-10 polynomial fit of erfc(z) exp(z^2) / t on t in [0, 1]
 * (relative error 1.2e-8; Numerical Recipes' substitution).  exp(-x^2/2) is
 * taken of the exact square (x^2 = hi + lo by an FMA), so the tail keeps
 * ~4e-7 relative accuracy; the same exponential serves the derivative's
 * pdf.  Kept identical to the AVX2 version below. */
#define GQ0 0.282094806432724f
#define GQ1 0.28209376335144043f
#define GQ2 0.24688458442687988f
#define GQ3 0.17531581223011017f
#define GQ4 0.09346336871385574f
#define GQ5 -0.05921443924307823f
#define GQ6 0.13218338787555695f
#define GQ7 -0.4549821615219116f
#define GQ8 0.49370133876800537f
#define GQ9 -0.2347363829612732f
#define GQ10 0.043195951730012894f
#define K_EXP_LO -87.3365479f /* below: exp flushed to 0 (the f32 normal range) */

/* exp(a + b) for a <= 88, |b| <= ulp(a) (a + b = -x^2/2 split exactly):
 * k_expf's reduction with b folded into the reduced argument; 0 below
 * K_EXP_LO and for NaN. */
static inline float k_exp_hilo(float a, float b) {
  float ac = a < K_EXP_LO ? K_EXP_LO : a;
  float kf = __builtin_rintf(ac * 1.44269504088896341f);
  float r = __builtin_fmaf(-kf, 0.693145751953125f, ac);
  r = __builtin_fmaf(-kf, 1.428606765330187045e-06f, r) + b;
  float p = 1.0f / 720.0f;
  p = __builtin_fmaf(p, r, 1.0f / 120.0f);
  p = __builtin_fmaf(p, r, 1.0f / 24.0f);
  p = __builtin_fmaf(p, r, 1.0f / 6.0f);
  p = __builtin_fmaf(p, r, 0.5f);
  p = __builtin_fmaf(p, r, 1.0f);
  p = __builtin_fmaf(p, r, 1.0f);
  int32_t bits = (int32_t)((uint32_t)((int32_t)kf + 127) << 23);
  float sc;
  __builtin_memcpy(&sc, &bits, 4);
  return a >= K_EXP_LO ? p * sc : 0.0f;
}
/* exp(-x^2 / 2) */
static inline float k_gauss(float x) {
  float hi = x * x, lo = __builtin_fmaf(x, x, -hi);
  return k_exp_hilo(-0.5f * hi, -0.5f * lo);
}
static inline float k_phif_e(float x, float e) {
  float z = (x < 0 ? -x : x) * (float)K_SQRT1_2;
  float t = 1.0f / __builtin_fmaf(0.5f, z, 1.0f);
  float q = GQ10;
  q = __builtin_fmaf(q, t, GQ9); q = __builtin_fmaf(q, t, GQ8); q = __builtin_fmaf(q, t, GQ7);
  q = __builtin_fmaf(q, t, GQ6); q = __builtin_fmaf(q, t, GQ5); q = __builtin_fmaf(q, t, GQ4);
  q = __builtin_fmaf(q, t, GQ3); q = __builtin_fmaf(q, t, GQ2); q = __builtin_fmaf(q, t, GQ1);
  q = __builtin_fmaf(q, t, GQ0);
  /* 1 - h as one fused operation, written out: GCC's default contraction fused it here while the vector code
   * rounded h first (1-2 ulp apart on 2.4% of positive inputs, so a strided tensor's GELU differed from a
   * contiguous one's), and clang would not fuse it at all */
  float a = 0.5f * t * q;
  return x < 0 ? a * e : __builtin_fmaf(-a, e, 1.0f);
}
static inline float k_phif(float x) { return k_phif_e(x, k_gauss(x)); }

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

/* ---------------------------------------------------------------- vector exact gelu
 * The same formulas and operation order as k_geluf / d_geluf, 8 lanes (AVX2) and, on AVX-512 builds, 16 lanes at a
 * time: one definition (DEF_GELU_VEC) over each width's intrinsics prefix and a few adapters (rounding, the
 * compare-and-select forms), so an element's value is the same at either width and in the scalar code.  16 lanes
 * halve the instructions per element, which is what bounds this latency-bound math on cores that split 512-bit
 * operations (docs/benchmarks.md, "GELU").  A row's tail runs through the 8-lane code on a padded copy, so an
 * element's value does not depend on where a row (or a thread's chunk of it) starts. */
#if defined(__AVX2__) && defined(__FMA__)
#define K_HAVE_GELU_VEC 1
static inline __m256 v_round(__m256 x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline __m256 v_bits(__m256i k) { return _mm256_castsi256_ps(k); }
static inline __m256 v_abs(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
static inline __m256 v_if_ge(__m256 a, __m256 b, __m256 v) { return _mm256_and_ps(v, _mm256_cmp_ps(a, b, _CMP_GE_OQ)); }
static inline __m256 v_if_neg(__m256 x, __m256 yes, __m256 no) {
  return _mm256_blendv_ps(no, yes, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}
#ifdef __AVX512F__
static inline __m512 w_round(__m512 x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline __m512 w_bits(__m512i k) { return _mm512_castsi512_ps(k); }
static inline __m512 w_abs(__m512 x) { return _mm512_abs_ps(x); }
static inline __m512 w_if_ge(__m512 a, __m512 b, __m512 v) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, b, _CMP_GE_OQ), v);
}
static inline __m512 w_if_neg(__m512 x, __m512 yes, __m512 no) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), no, yes);
}
#endif

/* N: the adapters' prefix (v, w); V / VI: the float / int vector types; P: the intrinsics' prefix.
 * N##_gauss: k_gauss, exp(-x^2 / 2) of the exact square, 0 below the normal range and for NaN (NaN still propagates
 * through t and x); N##_phif_e: k_phif_e; N##_gelu; N##_gelu_grad: g * (Phi(x) + x * pdf(x)). */
#define DEF_GELU_VEC(N, V, VI, P)                                                                            \
  static inline V N##_gauss(V x) {                                                                           \
    const V lo = P##_set1_ps(K_EXP_LO);                                                                      \
    V hi2 = P##_mul_ps(x, x);                                                                                \
    V lo2 = P##_fmsub_ps(x, x, hi2);                                                                         \
    V a = P##_mul_ps(P##_set1_ps(-0.5f), hi2), b = P##_mul_ps(P##_set1_ps(-0.5f), lo2);                      \
    V ac = P##_max_ps(a, lo);                                                                                \
    V kf = N##_round(P##_mul_ps(ac, P##_set1_ps(1.44269504088896341f)));                                     \
    V r = P##_fnmadd_ps(kf, P##_set1_ps(0.693145751953125f), ac);                                            \
    r = P##_add_ps(P##_fnmadd_ps(kf, P##_set1_ps(1.428606765330187045e-06f), r), b);                         \
    V p = P##_set1_ps(1.0f / 720.0f);                                                                        \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f / 120.0f));                                                      \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f / 24.0f));                                                       \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f / 6.0f));                                                        \
    p = P##_fmadd_ps(p, r, P##_set1_ps(0.5f));                                                               \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f));                                                               \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f));                                                               \
    VI k = P##_cvtps_epi32(kf);                                                                              \
    V sc = N##_bits(P##_slli_epi32(P##_add_epi32(k, P##_set1_epi32(127)), 23));                              \
    return N##_if_ge(a, lo, P##_mul_ps(p, sc));                                                              \
  }                                                                                                          \
  static inline V N##_phif_e(V x, V e) {                                                                     \
    V z = P##_mul_ps(N##_abs(x), P##_set1_ps((float)K_SQRT1_2));                                             \
    V t = P##_div_ps(P##_set1_ps(1.0f), P##_fmadd_ps(P##_set1_ps(0.5f), z, P##_set1_ps(1.0f)));              \
    V q = P##_set1_ps(GQ10);                                                                                 \
    q = P##_fmadd_ps(q, t, P##_set1_ps(GQ9));                                                                \
    q = P##_fmadd_ps(q, t, P##_set1_ps(GQ8));                                                                \
    q = P##_fmadd_ps(q, t, P##_set1_ps(GQ7));                                                                \
    q = P##_fmadd_ps(q, t, P##_set1_ps(GQ6));                                                                \
    q = P##_fmadd_ps(q, t, P##_set1_ps(GQ5));                                                                \
    q = P##_fmadd_ps(q, t, P##_set1_ps(GQ4));                                                                \
    q = P##_fmadd_ps(q, t, P##_set1_ps(GQ3));                                                                \
    q = P##_fmadd_ps(q, t, P##_set1_ps(GQ2));                                                                \
    q = P##_fmadd_ps(q, t, P##_set1_ps(GQ1));                                                                \
    q = P##_fmadd_ps(q, t, P##_set1_ps(GQ0));                                                                \
    V a = P##_mul_ps(P##_mul_ps(P##_set1_ps(0.5f), t), q);                                                   \
    return N##_if_neg(x, P##_mul_ps(a, e), P##_fnmadd_ps(a, e, P##_set1_ps(1.0f)));                          \
  }                                                                                                          \
  static inline V N##_gelu(V x) { return P##_mul_ps(x, N##_phif_e(x, N##_gauss(x))); }                       \
  static inline V N##_gelu_grad(V g, V x) {                                                                  \
    V e = N##_gauss(x);                                                                                      \
    V pdf = P##_mul_ps(P##_set1_ps((float)K_INV_SQRT_2PI), e);                                               \
    return P##_mul_ps(g, P##_fmadd_ps(x, pdf, N##_phif_e(x, e)));                                            \
  }

/* Four independent chains of L lanes a step (the math is latency bound): OUT + k gets EXPR, an expression of the
 * offset k. */
#define GELU_VEC_LOOP(V, P, L, OUT, EXPR)                                                                 \
  for (; i + 4 * (L) <= n; i += 4 * (L)) {                                                                   \
    V y0, y1, y2, y3;                                                                                        \
    { int64_t k = i; y0 = EXPR; } { int64_t k = i + (L); y1 = EXPR; }                                        \
    { int64_t k = i + 2 * (L); y2 = EXPR; } { int64_t k = i + 3 * (L); y3 = EXPR; }                          \
    P##_storeu_ps(OUT + i, y0); P##_storeu_ps(OUT + i + (L), y1);                                            \
    P##_storeu_ps(OUT + i + 2 * (L), y2); P##_storeu_ps(OUT + i + 3 * (L), y3);                              \
  }

DEF_GELU_VEC(v, __m256, __m256i, _mm256)
#ifdef __AVX512F__
DEF_GELU_VEC(w, __m512, __m512i, _mm512)
#endif

static void gelu_f32_vec(int64_t n, float* o, const float* a) {
  int64_t i = 0;
#ifdef __AVX512F__
  GELU_VEC_LOOP(__m512, _mm512, 16, o, w_gelu(_mm512_loadu_ps(a + k)))
#endif
  GELU_VEC_LOOP(__m256, _mm256, 8, o, v_gelu(_mm256_loadu_ps(a + k)))
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(o + i, v_gelu(_mm256_loadu_ps(a + i)));
  if (i < n) {
    float xb[8] = {0}, yb[8];
    for (int64_t j = i; j < n; j++) xb[j - i] = a[j];
    _mm256_storeu_ps(yb, v_gelu(_mm256_loadu_ps(xb)));
    for (int64_t j = i; j < n; j++) o[j] = yb[j - i];
  }
}

static void gelu_grad_f32_vec(int64_t n, float* gi, const float* g, const float* x) {
  int64_t i = 0;
#ifdef __AVX512F__
  GELU_VEC_LOOP(__m512, _mm512, 16, gi, w_gelu_grad(_mm512_loadu_ps(g + k), _mm512_loadu_ps(x + k)))
#endif
  GELU_VEC_LOOP(__m256, _mm256, 8, gi, v_gelu_grad(_mm256_loadu_ps(g + k), _mm256_loadu_ps(x + k)))
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(gi + i, v_gelu_grad(_mm256_loadu_ps(g + i), _mm256_loadu_ps(x + i)));
  if (i < n) {
    float gb[8] = {0}, xb[8] = {0}, yb[8];
    for (int64_t j = i; j < n; j++) { gb[j - i] = g[j]; xb[j - i] = x[j]; }
    _mm256_storeu_ps(yb, v_gelu_grad(_mm256_loadu_ps(gb), _mm256_loadu_ps(xb)));
    for (int64_t j = i; j < n; j++) gi[j] = yb[j - i];
  }
}
#endif

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
#ifdef K_HAVE_GELU_VEC
  if (op == KU_GELU && so == 4 && sa == 4) { gelu_f32_vec(n, (float*)o, (const float*)a); return; }
#endif
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
    case KU_CLAMP: case KU_HARDTANH: {
      float lo = p0 != p0 ? -__builtin_inff() : (float)p0;
      float hi = p1 != p1 ? __builtin_inff() : (float)p1;
      UROW(float, x != x ? x : (x < lo ? lo : x) > hi ? hi : (x < lo ? lo : x));
      break;
    }
    case KU_LEAKY_RELU: { float s = (float)p0; UROW(float, x > 0.0f ? x : x * s); break; }
    case KU_ELU: { float al = (float)p0; UROW(float, x <= 0.0f ? expm1f(x) * al : x); break; }
    case KU_SOFTPLUS: {
      float b = (float)p0, t = (float)p1;
      UROW(float, x * b > t ? x : log1pf(expf(x * b)) / b);
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
    case KU_CLAMP: case KU_HARDTANH: {
      double lo = p0 != p0 ? -INFINITY : p0;
      double hi = p1 != p1 ? INFINITY : p1;
      UROW(double, x != x ? x : (x < lo ? lo : x) > hi ? hi : (x < lo ? lo : x));
      break;
    }
    case KU_LEAKY_RELU: UROW(double, x > 0.0 ? x : x * p0); break;
    case KU_ELU: UROW(double, x <= 0.0 ? expm1(x) * p0 : x); break;
    case KU_SOFTPLUS: UROW(double, x * p0 > p1 ? x : log1p(exp(x * p0)) / p0); break;
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
  float e = k_gauss(x);
  return __builtin_fmaf(x, (float)K_INV_SQRT_2PI * e, k_phif_e(x, e));
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
/* silu'(x) from s = sigmoid(x) (silu_mul's backward has s already) */
static inline float d_siluf_s(float x, float s) { return s * (1.0f + x * (1.0f - s)); }
static inline double d_silu_s(double x, double s) { return s * (1.0 + x * (1.0 - s)); }
static inline float d_siluf(float x) { return d_siluf_s(x, k_sigmoidf(x)); }
static inline double d_silu(double x) { return d_silu_s(x, k_sigmoid(x)); }

void kc_unary_grad_row(int op, int dt, int64_t n, char* gi, int64_t sgi, const char* g, int64_t sg,
                       const char* x, int64_t sx, const char* y, int64_t sy, double p0, double p1) {
  if (dt == KC_F32) {
#ifdef K_HAVE_GELU_VEC
    if (op == KU_GELU && sgi == 4 && sg == 4 && sx == 4) {
      gelu_grad_f32_vec(n, (float*)gi, (const float*)g, (const float*)x);
      return;
    }
#endif
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
      case KU_LEAKY_RELU: { float s = (float)p0; GROW(float, xv > 0.0f ? gv : gv * s); break; }
      case KU_ELU: { float al = (float)p0; GROW(float, xv <= 0.0f ? gv * al * expf(xv) : gv); break; }
      case KU_HARDTANH: {
        float l = (float)p0, h = (float)p1;
        GROW(float, (xv <= l || xv >= h) ? 0.0f : gv);
        break;
      }
      case KU_SOFTPLUS: {
        float b = (float)p0, t = (float)p1;
        GROW(float, xv * b > t ? gv : gv * expf(xv * b) / (expf(xv * b) + 1.0f));
        break;
      }
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
      case KU_LEAKY_RELU: GROW(double, xv > 0.0 ? gv : gv * p0); break;
      case KU_ELU: GROW(double, xv <= 0.0 ? gv * p0 * exp(xv) : gv); break;
      case KU_HARDTANH: GROW(double, (xv <= p0 || xv >= p1) ? 0.0 : gv); break;
      case KU_SOFTPLUS: GROW(double, xv * p0 > p1 ? gv : gv * exp(xv * p0) / (exp(xv * p0) + 1.0)); break;
    }
  }
}

/* ---------------------------------------------------------------- silu(a) * b (SwiGLU)
 * The composition's operations in its order, so the values and gradients are those of silu(a) * b bit for bit:
 * s = a * sigmoid(a) rounded, out = s * b; backward gb = g * s, ga = (g * b) * silu'(a).  One pass each way
 * instead of three (silu, mul; mul's two products, silu's gradient) and no intermediate s in memory. */
typedef struct { int dt; const char *g, *a, *b; char *o, *ga, *gb; } silu_mul_job;
#define SILU_MUL_GRAIN 8192

static void silu_mul_part(void* vj, int64_t lo, int64_t hi) {
  const silu_mul_job* j = vj;
  if (j->dt == KC_F32) {
    const float* restrict A = (const float*)j->a + lo;
    const float* restrict B = (const float*)j->b + lo;
    float* restrict O = (float*)j->o + lo;
    for (int64_t i = 0; i < hi - lo; i++) { float x = A[i], s = x * k_sigmoidf(x); O[i] = s * B[i]; }
  } else {
    const double* restrict A = (const double*)j->a + lo;
    const double* restrict B = (const double*)j->b + lo;
    double* restrict O = (double*)j->o + lo;
    for (int64_t i = 0; i < hi - lo; i++) { double x = A[i], s = x * k_sigmoid(x); O[i] = s * B[i]; }
  }
}

static void silu_mul_grad_part(void* vj, int64_t lo, int64_t hi) {
  const silu_mul_job* j = vj;
  if (j->dt == KC_F32) {
    const float* restrict G = (const float*)j->g + lo;
    const float* restrict A = (const float*)j->a + lo;
    const float* restrict B = (const float*)j->b + lo;
    float* restrict GA = j->ga ? (float*)j->ga + lo : NULL;
    float* restrict GB = j->gb ? (float*)j->gb + lo : NULL;
    if (GA && GB) /* one sigmoid for both */
      for (int64_t i = 0; i < hi - lo; i++) {
        float x = A[i], sg = k_sigmoidf(x), gs = G[i] * B[i];
        GA[i] = gs * d_siluf_s(x, sg);
        GB[i] = G[i] * (x * sg);
      }
    else if (GA) for (int64_t i = 0; i < hi - lo; i++) { float gs = G[i] * B[i]; GA[i] = gs * d_siluf(A[i]); }
    else if (GB) for (int64_t i = 0; i < hi - lo; i++) { float x = A[i], s = x * k_sigmoidf(x); GB[i] = G[i] * s; }
  } else {
    const double* restrict G = (const double*)j->g + lo;
    const double* restrict A = (const double*)j->a + lo;
    const double* restrict B = (const double*)j->b + lo;
    double* restrict GA = j->ga ? (double*)j->ga + lo : NULL;
    double* restrict GB = j->gb ? (double*)j->gb + lo : NULL;
    if (GA && GB)
      for (int64_t i = 0; i < hi - lo; i++) {
        double x = A[i], sg = k_sigmoid(x), gs = G[i] * B[i];
        GA[i] = gs * d_silu_s(x, sg);
        GB[i] = G[i] * (x * sg);
      }
    else if (GA) for (int64_t i = 0; i < hi - lo; i++) { double gs = G[i] * B[i]; GA[i] = gs * d_silu(A[i]); }
    else if (GB) for (int64_t i = 0; i < hi - lo; i++) { double x = A[i], s = x * k_sigmoid(x); GB[i] = G[i] * s; }
  }
}

int kc_silu_mul(int dt, int64_t n, const void* a, const void* b, void* out) {
  if ((dt != KC_F32 && dt != KC_F64) || n < 0) return -1;
  silu_mul_job j = {dt, NULL, a, b, out, NULL, NULL};
  kc_parallel_for(n, SILU_MUL_GRAIN, silu_mul_part, &j);
  return 0;
}

int kc_silu_mul_grad(int dt, int64_t n, const void* g, const void* a, const void* b, void* ga, void* gb) {
  if ((dt != KC_F32 && dt != KC_F64) || n < 0) return -1;
  silu_mul_job j = {dt, g, a, b, NULL, ga, gb};
  kc_parallel_for(n, SILU_MUL_GRAIN, silu_mul_grad_part, &j);
  return 0;
}
