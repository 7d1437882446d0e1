/* loss.c: fused log-softmax + negative log-likelihood (cross entropy with
 * label smoothing) over the class dim of contiguous [N, C, inner] logits. */
/* FP compares must not count as traps, or GCC will not if-convert (and so not
 * vectorize) the selects in kc_expf and the masked loops. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif
#include "kcpu.h"
#include <math.h>
#include <stdlib.h>

#define DEF_CE(T, SUF, EXPF, LOGF)                                                      \
  int kc_cross_entropy_##SUF(int64_t N, int64_t C, int64_t inner, const T* x, const int64_t* tgt, \
                             int64_t ignore, double eps, T* loss, T* lse) {             \
    const T w_t = (T)(1.0 - eps), w_all = (T)(C > 0 ? eps / (double)C : 0.0);           \
    if (inner == 1) {                                                                   \
      for (int64_t n = 0; n < N; n++) {                                                 \
        const T* r = x + n * C;                                                         \
        int64_t t = tgt[n];                                                             \
        if (t == ignore) { loss[n] = 0; lse[n] = 0; continue; }                         \
        T m = kc_row_max_##SUF(C, r);                                                   \
        T l = m + LOGF(kc_row_expsum_##SUF(C, r, m, NULL));                             \
        T v = l - w_t * r[t];                                                           \
        if (eps != 0.0) v -= w_all * kc_row_sum_##SUF(C, r);                            \
        loss[n] = v; lse[n] = l;                                                        \
      }                                                                                 \
      return 0;                                                                         \
    }                                                                                   \
    T* buf = malloc((size_t)(3 * inner) * sizeof(T));                                   \
    if (!buf) return -1;                                                                \
    T *m = buf, *s = buf + inner, *sx = buf + 2 * inner;                                \
    for (int64_t n = 0; n < N; n++) {                                                   \
      const T* X = x + n * C * inner;                                                   \
      const int64_t* tg = tgt + n * inner;                                              \
      for (int64_t j = 0; j < inner; j++) { m[j] = -INFINITY; s[j] = 0; sx[j] = 0; }    \
      for (int64_t c = 0; c < C; c++) {                                                 \
        const T* r = X + c * inner;                                                     \
        for (int64_t j = 0; j < inner; j++) { m[j] = r[j] > m[j] ? r[j] : m[j]; sx[j] += r[j]; } \
      }                                                                                 \
      for (int64_t c = 0; c < C; c++) {                                                 \
        const T* r = X + c * inner;                                                     \
        for (int64_t j = 0; j < inner; j++) s[j] += EXPF(r[j] - m[j]);                  \
      }                                                                                 \
      for (int64_t j = 0; j < inner; j++) {                                             \
        int64_t i = n * inner + j, t = tg[j];                                           \
        if (t == ignore) { loss[i] = 0; lse[i] = 0; continue; }                         \
        T l = m[j] + LOGF(s[j]);                                                        \
        lse[i] = l;                                                                     \
        loss[i] = l - w_t * X[t * inner + j] - w_all * sx[j];                           \
      }                                                                                 \
    }                                                                                   \
    free(buf);                                                                          \
    return 0;                                                                           \
  }                                                                                     \
  int kc_cross_entropy_bw_##SUF(int64_t N, int64_t C, int64_t inner, const T* x,        \
                                const int64_t* tgt, int64_t ignore, double eps, const T* lse, \
                                const T* gs, double gconst, T* gx) {                    \
    const T w_t = (T)(1.0 - eps), w_all = (T)(C > 0 ? eps / (double)C : 0.0);           \
    for (int64_t n = 0; n < N; n++) {                                                   \
      for (int64_t j = 0; j < inner; j++) {                                             \
        int64_t i = n * inner + j, t = tgt[i];                                          \
        const T* r = x + n * C * inner + j;                                             \
        T* o = gx + n * C * inner + j;                                                  \
        if (t == ignore) {                                                              \
          for (int64_t c = 0; c < C; c++) o[c * inner] = 0;                             \
          continue;                                                                     \
        }                                                                               \
        T sc = gs ? gs[i] : (T)gconst, l = lse[i], sub = w_all * sc;                    \
        if (inner == 1) for (int64_t c = 0; c < C; c++) o[c] = sc * EXPF(r[c] - l) - sub; \
        else for (int64_t c = 0; c < C; c++) o[c * inner] = sc * EXPF(r[c * inner] - l) - sub; \
        o[t * inner] -= sc * w_t;                                                       \
      }                                                                                 \
    }                                                                                   \
    return 0;                                                                           \
  }

DEF_CE(float, f32, kc_expf, logf)
DEF_CE(double, f64, exp, log)
