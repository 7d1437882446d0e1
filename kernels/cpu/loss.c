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
#include <string.h>

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

/* ------------------------------------------------------------ fused classifier (bf16/f16 logits)
 * Each row is converted into a per-call f32 row buffer (C floats, never the
 * [N, C] logits) and runs the f32 formulas above: the loss and lse equal
 * kc_cross_entropy_f32 on the converted logits, and the gradient equals
 * kc_cross_entropy_bw_f32's rounded to the logits' dtype. */
static void half_row(int dt, int64_t C, const uint16_t* x, float* buf) {
  if (dt == KC_BF16) for (int64_t c = 0; c < C; c++) buf[c] = kc_bf16_to_f32(x[c]);
  else for (int64_t c = 0; c < C; c++) buf[c] = kc_f16_to_f32(x[c]);
}

int kc_cross_entropy_half(int dt, int64_t N, int64_t C, const uint16_t* x, const int64_t* tgt, int64_t ignore,
                          double eps, float* loss, float* lse) {
  float* buf = malloc((size_t)(C > 0 ? C : 1) * sizeof(float));
  if (!buf) return -1;
  for (int64_t n = 0; n < N; n++) {
    if (tgt[n] == ignore) { loss[n] = 0; lse[n] = 0; continue; }
    half_row(dt, C, x + n * C, buf);
    if (kc_cross_entropy_f32(1, C, 1, buf, tgt + n, ignore, eps, loss + n, lse + n)) { free(buf); return -1; }
  }
  free(buf);
  return 0;
}

int kc_cross_entropy_half_bw(int dt, int64_t N, int64_t C, const uint16_t* x, const int64_t* tgt, int64_t ignore,
                             double eps, const float* lse, const float* gs, double gconst, uint16_t* gx) {
  float* buf = malloc((size_t)(C > 0 ? C : 1) * sizeof(float));
  if (!buf) return -1;
  for (int64_t n = 0; n < N; n++) {
    uint16_t* o = gx + n * C;
    if (tgt[n] == ignore) { memset(o, 0, (size_t)C * sizeof(uint16_t)); continue; }
    half_row(dt, C, x + n * C, buf);
    if (kc_cross_entropy_bw_f32(1, C, 1, buf, tgt + n, ignore, eps, lse + n, gs ? gs + n : NULL, gconst, buf)) {
      free(buf);
      return -1;
    }
    if (dt == KC_BF16) for (int64_t c = 0; c < C; c++) o[c] = kc_f32_to_bf16(buf[c]);
    else for (int64_t c = 0; c < C; c++) o[c] = kc_f32_to_f16(buf[c]);
  }
  free(buf);
  return 0;
}

/* ------------------------------------------------------------ nll_loss
 * loss[i] = -w[t_i] x[n, t_i, j] (w NULL: 1), 0 where t_i == ignore; the
 * per-position losses go to out when it is non-NULL, else their sum to *sum;
 * *wsum gets the sum of w[t_i] over the non-ignored positions. */
#define DEF_NLL(T, SUF)                                                                 \
  void kc_nll_##SUF(int64_t N, int64_t C, int64_t inner, const T* x, const int64_t* tgt, \
                    int64_t ignore, const T* w, T* out, double* sum, double* wsum) {     \
    double s = 0, ws = 0;                                                               \
    for (int64_t n = 0; n < N; n++)                                                     \
      for (int64_t j = 0; j < inner; j++) {                                             \
        int64_t i = n * inner + j, t = tgt[i];                                          \
        T l = 0;                                                                        \
        if (t != ignore) {                                                              \
          T wt = w ? w[t] : (T)1;                                                       \
          l = -wt * x[(n * C + t) * inner + j];                                         \
          ws += wt;                                                                     \
        }                                                                               \
        if (out) out[i] = l; else s += l;                                               \
      }                                                                                 \
    *sum = s; *wsum = ws;                                                               \
  }                                                                                     \
  void kc_nll_bw_##SUF(int64_t N, int64_t C, int64_t inner, const int64_t* tgt, int64_t ignore, \
                       const T* w, const T* gs, double gconst, T* gx) {                 \
    for (int64_t i = 0; i < N * C * inner; i++) gx[i] = 0;                              \
    for (int64_t n = 0; n < N; n++)                                                     \
      for (int64_t j = 0; j < inner; j++) {                                             \
        int64_t i = n * inner + j, t = tgt[i];                                          \
        if (t == ignore) continue;                                                      \
        T g = gs ? gs[i] : (T)gconst;                                                   \
        gx[(n * C + t) * inner + j] = -(w ? w[t] : (T)1) * g;                           \
      }                                                                                 \
  }

DEF_NLL(float, f32)
DEF_NLL(double, f64)

/* ------------------------------------------------------------ elementwise losses
 * PyTorch's formulas (aten/src/ATen/native/Loss.cpp, BinaryOps):
 *   KC_PL_BCE        (y - 1) max(log1p(-x), -100) - y max(log x, -100)
 *   KC_PL_BCE_LOGITS (1 - y) x + (1 + (pw - 1) y) (max(-x, 0) + log1p(exp(-|x|)))
 *   KC_PL_KL_DIV     y log y - y x (0 log term for y <= 0); log_target: exp(y) (y - x)
 *   KC_PL_SMOOTH_L1  |d| < beta ? 0.5 d^2 / beta : |d| - beta / 2 (beta 0: |d|), d = x - y
 *   KC_PL_HUBER      |d| < delta ? 0.5 d^2 : delta (|d| - delta / 2)
 * times w[i] when w is given.  Returns 1 when KC_PL_BCE met an x outside [0, 1]
 * (or NaN), else 0. */
#define PL_SP(T, EXPF, LOG1PF, xv) ((xv) < 0 ? -(xv) : (T)0) + LOG1PF(EXPF(-((xv) < 0 ? -(xv) : (xv))))
#define DEF_PL(T, SUF, EXPF, LOGF, LOG1PF)                                              \
  int kc_ploss_##SUF(int kind, int64_t n, const T* x, const T* y, const T* w, const T* pw, \
                     double param, T* out, double* sum) {                               \
    double s = 0;                                                                       \
    int bad = 0;                                                                        \
    const T p = (T)param;                                                               \
    for (int64_t i = 0; i < n; i++) {                                                   \
      T xi = x[i], yi = y[i], l;                                                        \
      switch (kind) {                                                                   \
        case KC_PL_BCE: {                                                               \
          if (!(xi >= 0 && xi <= 1)) bad = 1;                                           \
          T a = LOG1PF(-xi), b = LOGF(xi);                                              \
          l = (yi - 1) * (a > (T)-100 ? a : (T)-100) - yi * (b > (T)-100 ? b : (T)-100); \
          break;                                                                        \
        }                                                                               \
        case KC_PL_BCE_LOGITS: {                                                        \
          T sp = PL_SP(T, EXPF, LOG1PF, xi);                                            \
          l = (1 - yi) * xi + (pw ? (1 + (pw[i] - 1) * yi) * sp : sp);                   \
          break;                                                                        \
        }                                                                               \
        case KC_PL_KL_DIV: l = (yi > 0 ? yi * LOGF(yi) : (T)0) - yi * xi; break;         \
        case KC_PL_KL_DIV_LOG: l = EXPF(yi) * (yi - xi); break;                         \
        case KC_PL_SMOOTH_L1: {                                                         \
          T d = xi - yi, ad = d < 0 ? -d : d;                                           \
          l = p == 0 ? ad : ad < p ? (T)0.5 * d * d / p : ad - (T)0.5 * p;              \
          break;                                                                        \
        }                                                                               \
        default: {                                                                      \
          T d = xi - yi, ad = d < 0 ? -d : d;                                           \
          l = ad < p ? (T)0.5 * d * d : p * (ad - (T)0.5 * p);                          \
          break;                                                                        \
        }                                                                               \
      }                                                                                 \
      if (w) l *= w[i];                                                                 \
      if (out) out[i] = l; else s += l;                                                 \
    }                                                                                   \
    if (sum) *sum = s;                                                                  \
    return bad;                                                                         \
  }                                                                                     \
  /* gx, gy (either NULL): the gradients for upstream gs[i] (or gconst when gs is NULL). */ \
  void kc_ploss_bw_##SUF(int kind, int64_t n, const T* x, const T* y, const T* w, const T* pw, \
                         double param, const T* gs, double gconst, T* gx, T* gy) {      \
    const T p = (T)param;                                                               \
    for (int64_t i = 0; i < n; i++) {                                                   \
      T xi = x[i], yi = y[i], g = gs ? gs[i] : (T)gconst, dx, dy;                       \
      if (w) g *= w[i];                                                                 \
      switch (kind) {                                                                   \
        case KC_PL_BCE: {                                                               \
          T den = (1 - xi) * xi, a = LOG1PF(-xi), b = LOGF(xi);                         \
          dx = (xi - yi) / (den > (T)1e-12 ? den : (T)1e-12);                           \
          dy = (a > (T)-100 ? a : (T)-100) - (b > (T)-100 ? b : (T)-100);               \
          break;                                                                        \
        }                                                                               \
        case KC_PL_BCE_LOGITS: {                                                        \
          T sg = 1 / (1 + EXPF(-xi)), sp = PL_SP(T, EXPF, LOG1PF, xi);                  \
          if (pw) {                                                                     \
            T t = pw[i] * yi;                                                           \
            dx = (t + 1 - yi) * sg - t;                                                 \
            dy = -xi + (pw[i] - 1) * sp;                                                \
          } else {                                                                      \
            dx = sg - yi;                                                               \
            dy = -xi;                                                                   \
          }                                                                             \
          break;                                                                        \
        }                                                                               \
        case KC_PL_KL_DIV: dx = -yi; dy = yi > 0 ? LOGF(yi) + 1 - xi : -xi; break;       \
        case KC_PL_KL_DIV_LOG: { T e = EXPF(yi); dx = -e; dy = e * (yi - xi + 1); break; } \
        case KC_PL_SMOOTH_L1: {                                                         \
          T d = xi - yi;                                                                \
          if (p == 0) dx = d > 0 ? (T)1 : d < 0 ? (T)-1 : (T)0;                         \
          else dx = d <= -p ? (T)-1 : d >= p ? (T)1 : d / p;                            \
          dy = -dx;                                                                     \
          break;                                                                        \
        }                                                                               \
        default: {                                                                      \
          T d = xi - yi;                                                                \
          dx = d <= -p ? -p : d >= p ? p : d;                                           \
          dy = -dx;                                                                     \
          break;                                                                        \
        }                                                                               \
      }                                                                                 \
      if (gx) gx[i] = g * dx;                                                           \
      if (gy) gy[i] = g * dy;                                                           \
    }                                                                                   \
  }

DEF_PL(float, f32, expf, logf, log1pf)
DEF_PL(double, f64, exp, log, log1p)

/* ------------------------------------------------------------ cross_entropy with class weights
 * PyTorch's weighted formula (label smoothing eps, W = sum_c w_c), per position:
 *   loss = (1 - eps) w_t (lse - x_t) + eps / C (W lse - sum_c w_c x_c),  0 where t == ignore;
 * mean divides by the sum of w_t over the non-ignored positions (*wsum).  lse gets
 * the logsumexp per position; out (per position) or *sum as kc_nll_*. */
#define DEF_CEW(T, SUF, EXPF, LOGF)                                                     \
  void kc_cross_entropy_w_##SUF(int64_t N, int64_t C, int64_t inner, const T* x, const int64_t* tgt, \
                                int64_t ignore, double eps, const T* w, T* out, T* lse, double* sum, \
                                double* wsum) {                                         \
    double s = 0, ws = 0;                                                               \
    T W = 0;                                                                            \
    for (int64_t c = 0; c < C; c++) W += w[c];                                          \
    const T a = (T)(1.0 - eps), b = (T)(C > 0 ? eps / (double)C : 0.0);                 \
    for (int64_t n = 0; n < N; n++)                                                     \
      for (int64_t j = 0; j < inner; j++) {                                             \
        int64_t i = n * inner + j, t = tgt[i];                                          \
        const T* r = x + n * C * inner + j;                                             \
        T l = 0, ls = 0;                                                                \
        if (t != ignore) {                                                              \
          T m = -INFINITY, e = 0, wx = 0;                                               \
          for (int64_t c = 0; c < C; c++) m = r[c * inner] > m ? r[c * inner] : m;      \
          for (int64_t c = 0; c < C; c++) e += EXPF(r[c * inner] - m);                  \
          ls = m + LOGF(e);                                                             \
          l = a * w[t] * (ls - r[t * inner]);                                           \
          if (eps != 0.0) {                                                             \
            for (int64_t c = 0; c < C; c++) wx += w[c] * r[c * inner];                  \
            l += b * (W * ls - wx);                                                     \
          }                                                                             \
          ws += w[t];                                                                   \
        }                                                                               \
        lse[i] = ls;                                                                    \
        if (out) out[i] = l; else s += l;                                               \
      }                                                                                 \
    *sum = s; *wsum = ws;                                                               \
  }                                                                                     \
  /* gx_c = g (p_c ((1 - eps) w_t + eps W / C) - (1 - eps) w_t [c == t] - eps / C w_c) */ \
  void kc_cross_entropy_w_bw_##SUF(int64_t N, int64_t C, int64_t inner, const T* x, const int64_t* tgt, \
                                   int64_t ignore, double eps, const T* w, const T* lse, const T* gs, \
                                   double gconst, T* gx) {                              \
    T W = 0;                                                                            \
    for (int64_t c = 0; c < C; c++) W += w[c];                                          \
    const T a = (T)(1.0 - eps), b = (T)(C > 0 ? eps / (double)C : 0.0);                 \
    for (int64_t n = 0; n < N; n++)                                                     \
      for (int64_t j = 0; j < inner; j++) {                                             \
        int64_t i = n * inner + j, t = tgt[i];                                          \
        const T* r = x + n * C * inner + j;                                             \
        T* o = gx + n * C * inner + j;                                                  \
        if (t == ignore) {                                                              \
          for (int64_t c = 0; c < C; c++) o[c * inner] = 0;                             \
          continue;                                                                     \
        }                                                                               \
        T g = gs ? gs[i] : (T)gconst, k = g * (a * w[t] + b * W), l = lse[i];           \
        for (int64_t c = 0; c < C; c++) o[c * inner] = k * EXPF(r[c * inner] - l) - g * b * w[c]; \
        o[t * inner] -= g * a * w[t];                                                   \
      }                                                                                 \
  }

DEF_CEW(float, f32, expf, logf)
DEF_CEW(double, f64, exp, log)
