/* softmax.c: numerically stable softmax / log_softmax over one dim of a
 * contiguous [outer, D, inner] block, their backward formulas, and the row
 * primitives (max, sum of exp) the fused attention and loss kernels share.
 * f32 uses kc_expf (vectorizable, ~1 ulp); f64 uses libm. */
/* FP compares must not count as traps, or GCC will not if-convert (and so not
 * vectorize) the selects in kc_expf and the masked loops. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif
#include "kcpu.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#define LANES 16

/* ---------------------------------------------------------------- row primitives */
#define DEF_ROW_MAX(T, SUF)                                                             \
  T kc_row_max_##SUF(int64_t n, const T* x) {                                           \
    T acc[LANES];                                                                       \
    for (int j = 0; j < LANES; j++) acc[j] = -INFINITY;                                 \
    int64_t i = 0;                                                                      \
    for (; i + LANES <= n; i += LANES)                                                  \
      for (int j = 0; j < LANES; j++) acc[j] = x[i + j] > acc[j] ? x[i + j] : acc[j];   \
    T m = -INFINITY;                                                                    \
    for (int j = 0; j < LANES; j++) m = acc[j] > m ? acc[j] : m;                        \
    for (; i < n; i++) m = x[i] > m ? x[i] : m;                                         \
    return m;                                                                           \
  }
#define DEF_ROW_PRIMS(T, SUF, EXPF)                                                     \
  /* sum_i exp(x[i] - m); also stores the exps into y when y != NULL. */                \
  T kc_row_expsum_##SUF(int64_t n, const T* x, T m, T* y) {                             \
    T acc[LANES] = {0};                                                                 \
    int64_t i = 0;                                                                      \
    if (y) {                                                                            \
      for (; i + LANES <= n; i += LANES)                                                \
        for (int j = 0; j < LANES; j++) { T e = EXPF(x[i + j] - m); y[i + j] = e; acc[j] += e; } \
    } else {                                                                            \
      for (; i + LANES <= n; i += LANES)                                                \
        for (int j = 0; j < LANES; j++) acc[j] += EXPF(x[i + j] - m);                   \
    }                                                                                   \
    T s = 0;                                                                            \
    for (int j = 0; j < LANES; j++) s += acc[j];                                        \
    for (; i < n; i++) { T e = EXPF(x[i] - m); if (y) y[i] = e; s += e; }               \
    return s;                                                                           \
  }                                                                                     \
  T kc_row_dot_##SUF(int64_t n, const T* a, const T* b) {                               \
    T acc[LANES] = {0};                                                                 \
    int64_t i = 0;                                                                      \
    for (; i + LANES <= n; i += LANES)                                                  \
      for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];                    \
    T s = 0;                                                                            \
    for (int j = 0; j < LANES; j++) s += acc[j];                                        \
    for (; i < n; i++) s += a[i] * b[i];                                                \
    return s;                                                                           \
  }                                                                                     \
  T kc_row_sum_##SUF(int64_t n, const T* a) {                                           \
    T acc[LANES] = {0};                                                                 \
    int64_t i = 0;                                                                      \
    for (; i + LANES <= n; i += LANES)                                                  \
      for (int j = 0; j < LANES; j++) acc[j] += a[i + j];                               \
    T s = 0;                                                                            \
    for (int j = 0; j < LANES; j++) s += acc[j];                                        \
    for (; i < n; i++) s += a[i];                                                       \
    return s;                                                                           \
  }

static inline double kc_exp_d(double x) { return exp(x); }
DEF_ROW_PRIMS(float, f32, kc_expf)
DEF_ROW_PRIMS(double, f64, kc_exp_d)
DEF_ROW_MAX(double, f64)
#if !defined(__AVX__)
DEF_ROW_MAX(float, f32)
#else
/* the f32 row max with explicit vectors: GCC leaves DEF_ROW_MAX's select loop scalar (16 maxss per 16 values).
 * max(v, acc) keeps acc when v is NaN, as the select does, and max is exact, so the value is the same. */
float kc_row_max_f32(int64_t n, const float* x) {
  int64_t i = 0;
  float m = -INFINITY;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 a0 = _mm512_set1_ps(-INFINITY), a1 = a0;
    for (; i + 32 <= n; i += 32) {
      a0 = _mm512_max_ps(_mm512_loadu_ps(x + i), a0);
      a1 = _mm512_max_ps(_mm512_loadu_ps(x + i + 16), a1);
    }
    if (i + 16 <= n) { a0 = _mm512_max_ps(_mm512_loadu_ps(x + i), a0); i += 16; }
    m = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
  }
#elif defined(__AVX__)
  if (n >= 8) {
    __m256 a0 = _mm256_set1_ps(-INFINITY), a1 = a0;
    for (; i + 16 <= n; i += 16) {
      a0 = _mm256_max_ps(_mm256_loadu_ps(x + i), a0);
      a1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), a1);
    }
    if (i + 8 <= n) { a0 = _mm256_max_ps(_mm256_loadu_ps(x + i), a0); i += 8; }
    a0 = _mm256_max_ps(a0, a1);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    m = _mm_cvtss_f32(h);
  }
#endif
  for (; i < n; i++) m = x[i] > m ? x[i] : m;
  return m;
}
#endif

/* ---------------------------------------------------------------- forward */
#define DEF_SOFTMAX(T, SUF, EXPF, LOGF)                                                 \
  static void softmax_inner_##SUF(int64_t outer, int64_t D, int64_t inner, const T* x, T* y, \
                                  int log_, T* buf) {                                   \
    T* m = buf; T* s = buf + inner;                                                     \
    for (int64_t o = 0; o < outer; o++) {                                               \
      const T* X = x + o * D * inner;                                                   \
      T* Y = y + o * D * inner;                                                         \
      for (int64_t j = 0; j < inner; j++) { m[j] = -INFINITY; s[j] = 0; }               \
      for (int64_t d = 0; d < D; d++) {                                                 \
        const T* r = X + d * inner;                                                     \
        for (int64_t j = 0; j < inner; j++) m[j] = r[j] > m[j] ? r[j] : m[j];           \
      }                                                                                 \
      for (int64_t d = 0; d < D; d++) {                                                 \
        const T* r = X + d * inner;                                                     \
        T* w = Y + d * inner;                                                           \
        for (int64_t j = 0; j < inner; j++) { T e = EXPF(r[j] - m[j]); s[j] += e; if (!log_) w[j] = e; } \
      }                                                                                 \
      if (log_) for (int64_t j = 0; j < inner; j++) m[j] += LOGF(s[j]);                 \
      else for (int64_t j = 0; j < inner; j++) s[j] = 1 / s[j];                         \
      for (int64_t d = 0; d < D; d++) {                                                 \
        const T* r = X + d * inner;                                                     \
        T* w = Y + d * inner;                                                           \
        if (log_) for (int64_t j = 0; j < inner; j++) w[j] = r[j] - m[j];               \
        else for (int64_t j = 0; j < inner; j++) w[j] *= s[j];                          \
      }                                                                                 \
    }                                                                                   \
  }                                                                                     \
  int kc_softmax_##SUF(int64_t outer, int64_t D, int64_t inner, const T* x, T* y, int log_) { \
    if (outer <= 0 || D <= 0 || inner <= 0) return 0;                                   \
    if (inner > 1) {                                                                    \
      T* buf = malloc((size_t)(2 * inner) * sizeof(T));                                 \
      if (!buf) return -1;                                                              \
      softmax_inner_##SUF(outer, D, inner, x, y, log_, buf);                            \
      free(buf);                                                                        \
      return 0;                                                                         \
    }                                                                                   \
    for (int64_t o = 0; o < outer; o++) {                                               \
      const T* X = x + o * D;                                                           \
      T* Y = y + o * D;                                                                 \
      T m = kc_row_max_##SUF(D, X);                                                     \
      if (log_) {                                                                       \
        T s = kc_row_expsum_##SUF(D, X, m, NULL);                                       \
        T c = m + LOGF(s);                                                              \
        for (int64_t i = 0; i < D; i++) Y[i] = X[i] - c;                                \
      } else {                                                                          \
        T s = kc_row_expsum_##SUF(D, X, m, Y);                                          \
        T r = 1 / s;                                                                    \
        for (int64_t i = 0; i < D; i++) Y[i] *= r;                                      \
      }                                                                                 \
    }                                                                                   \
    return 0;                                                                           \
  }

DEF_SOFTMAX(float, f32, kc_expf, logf)
DEF_SOFTMAX(double, f64, exp, log)

/* ---------------------------------------------------------------- backward */
/* softmax:     gx = y * (g - sum_d(g * y))
 * log_softmax: gx = g - exp(y) * sum_d(g)
 * gx may alias g. */
#define DEF_SOFTMAX_BW(T, SUF, EXPF)                                                    \
  int kc_softmax_bw_##SUF(int64_t outer, int64_t D, int64_t inner, const T* y, const T* g, T* gx, \
                          int log_) {                                                   \
    if (outer <= 0 || D <= 0 || inner <= 0) return 0;                                   \
    if (inner == 1) {                                                                   \
      for (int64_t o = 0; o < outer; o++) {                                             \
        const T* Y = y + o * D; const T* G = g + o * D; T* O = gx + o * D;              \
        if (log_) {                                                                     \
          T s = kc_row_sum_##SUF(D, G);                                                 \
          for (int64_t i = 0; i < D; i++) O[i] = G[i] - EXPF(Y[i]) * s;                 \
        } else {                                                                        \
          T s = kc_row_dot_##SUF(D, G, Y);                                              \
          for (int64_t i = 0; i < D; i++) O[i] = Y[i] * (G[i] - s);                     \
        }                                                                               \
      }                                                                                 \
      return 0;                                                                         \
    }                                                                                   \
    T* s = malloc((size_t)inner * sizeof(T));                                           \
    if (!s) return -1;                                                                  \
    for (int64_t o = 0; o < outer; o++) {                                               \
      const T* Y = y + o * D * inner; const T* G = g + o * D * inner; T* O = gx + o * D * inner; \
      for (int64_t j = 0; j < inner; j++) s[j] = 0;                                     \
      for (int64_t d = 0; d < D; d++) {                                                 \
        const T* yr = Y + d * inner; const T* gr = G + d * inner;                       \
        if (log_) for (int64_t j = 0; j < inner; j++) s[j] += gr[j];                    \
        else for (int64_t j = 0; j < inner; j++) s[j] += gr[j] * yr[j];                 \
      }                                                                                 \
      for (int64_t d = 0; d < D; d++) {                                                 \
        const T* yr = Y + d * inner; const T* gr = G + d * inner; T* orow = O + d * inner; \
        if (log_) for (int64_t j = 0; j < inner; j++) orow[j] = gr[j] - EXPF(yr[j]) * s[j]; \
        else for (int64_t j = 0; j < inner; j++) orow[j] = yr[j] * (gr[j] - s[j]);     \
      }                                                                                 \
    }                                                                                   \
    free(s);                                                                            \
    return 0;                                                                           \
  }

DEF_SOFTMAX_BW(float, f32, kc_expf)
DEF_SOFTMAX_BW(double, f64, exp)
