/* norm.c: fused layer_norm / rms_norm forward and backward over rows of n
 * contiguous elements (f32 and f64).
 *
 * Row statistics of f64 rows accumulate in double over 8 independent lanes;
 * those of f32 rows in f32 vector lanes combined in double (a fixed order either
 * way, so results are deterministic, and the compiler vectorizes it at full
 * width), the variance by the corrected two-pass algorithm around the f32
 * mean; mean and rstd are kept in double.  The elementwise math runs in the
 * data type; the mean is applied as a hi + lo pair (x - hi is exact near the
 * mean), so rows with a large mean and a small spread keep their precision in
 * f32.  The weight/bias gradients are column sums per block of BLK rows (f32
 * within a block of f32 rows), added block by block in double. */
#include "kcpu.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8

/* Sum over k in [0, N) of EXPR (which uses k), in double, 8 lanes. */
#define LANE_SUM(N, EXPR)                                               \
  ({                                                                    \
    double acc_[LANES] = {0};                                           \
    int64_t j_ = 0;                                                     \
    for (; j_ + LANES <= (N); j_ += LANES)                              \
      for (int l_ = 0; l_ < LANES; l_++) { int64_t k = j_ + l_; acc_[l_] += (EXPR); } \
    for (; j_ < (N); j_++) { int64_t k = j_; acc_[0] += (EXPR); }       \
    ((acc_[0] + acc_[1]) + (acc_[2] + acc_[3])) + ((acc_[4] + acc_[5]) + (acc_[6] + acc_[7])); \
  })

#define NORM_FWD(T, NAME)                                                                         \
  static void NAME(int rms, int64_t m, int64_t n, const T* x, const T* w, const T* b, double eps,  \
                   T* y, double* mean, double* rstd) {                                            \
    for (int64_t r = 0; r < m; r++) {                                                             \
      const T* restrict xr = x + r * n;                                                           \
      T* restrict yr = y + r * n;                                                                 \
      double mu = 0.0, var = 0.0;                                                                 \
      if (n > 0) {                                                                                \
        if (!rms) mu = LANE_SUM(n, (double)xr[k]) / (double)n;                                    \
        var = LANE_SUM(n, ((double)xr[k] - mu) * ((double)xr[k] - mu)) / (double)n;               \
      }                                                                                           \
      double rs = 1.0 / sqrt(var + eps);                                                          \
      if (mean) mean[r] = mu;                                                                     \
      rstd[r] = rs;                                                                               \
      const T mh = (T)mu, ml = (T)(mu - (double)mh), fr = (T)rs;                                  \
      if (w && b) for (int64_t j = 0; j < n; j++) yr[j] = ((xr[j] - mh) - ml) * fr * w[j] + b[j]; \
      else if (w) for (int64_t j = 0; j < n; j++) yr[j] = ((xr[j] - mh) - ml) * fr * w[j];        \
      else if (b) for (int64_t j = 0; j < n; j++) yr[j] = ((xr[j] - mh) - ml) * fr + b[j];        \
      else for (int64_t j = 0; j < n; j++) yr[j] = ((xr[j] - mh) - ml) * fr;                      \
    }                                                                                             \
  }

/* f32 rows: the same formulas with the sums over a row in KVL f32 lanes (the target's vector width: 16 with
 * AVX-512, 8 with AVX, else 4) combined in double, so they vectorize at full width: the mean (pass 1), then the
 * centered sums around its f32 rounding mf (pass 2: x - mf is exact for x near the mean), corrected as the
 * two-pass algorithm does: mean = mf + S1 / n, var = (S2 - S1^2 / n) / n.  (Vectors move by pointer or macro
 * only: passed by value they would change the ABI between targets.) */
#if defined(__AVX512F__)
#define KVL 16
#elif defined(__AVX__)
#define KVL 8
#else
#define KVL 4
#endif
typedef float kvf __attribute__((vector_size(KVL * 4)));
#define ldv(p) ({ kvf v_; memcpy(&v_, (p), sizeof v_); v_; })
/* the lanes' sum in double, in a fixed tree (lane l + lane l + KVL / 2, then halves) */
static inline double sumv(const kvf* vp) {
#if KVL == 16
  typedef float kv8 __attribute__((vector_size(32)));
  typedef double kd8 __attribute__((vector_size(64)));
  typedef double kd4 __attribute__((vector_size(32)));
  typedef double kd2 __attribute__((vector_size(16)));
  const kvf v = *vp;
  kv8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  kv8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  kd8 d = __builtin_convertvector(lo, kd8) + __builtin_convertvector(hi, kd8);
  kd4 e = __builtin_shufflevector(d, d, 0, 1, 2, 3) + __builtin_shufflevector(d, d, 4, 5, 6, 7);
  kd2 f = __builtin_shufflevector(e, e, 0, 1) + __builtin_shufflevector(e, e, 2, 3);
  return f[0] + f[1];
#else
  float a[KVL];
  double h[KVL / 2];
  memcpy(a, vp, sizeof a);
  for (int l = 0; l < KVL / 2; l++) h[l] = (double)a[l] + (double)a[l + KVL / 2];
#if KVL == 8
  return (h[0] + h[2]) + (h[1] + h[3]);
#else
  return h[0] + h[1];
#endif
#endif
}

/* Rows are taken FWD_ROWS at a time through the two statistics passes, so the short per-row dependency chains
 * (sums, reductions, division, square root) of neighbouring rows overlap. */
#define FWD_ROWS 4
static void fwd_f32(int rms, int64_t m, int64_t n, const float* x, const float* w, const float* b, double eps,
                    float* y, double* mean, double* rstd) {
  const int64_t nv = n & ~(int64_t)(KVL - 1);
  for (int64_t r0 = 0; r0 < m; r0 += FWD_ROWS) {
    const int nr = m - r0 < FWD_ROWS ? (int)(m - r0) : FWD_ROWS;
    float mf[FWD_ROWS] = {0};
    if (!rms && n > 0) {
      kvf a[FWD_ROWS] = {{0}};
      for (int64_t k = 0; k < nv; k += KVL)
        for (int i = 0; i < nr; i++) a[i] += ldv(x + (r0 + i) * n + k);
      for (int i = 0; i < nr; i++) {
        const float* xr = x + (r0 + i) * n;
        double s = sumv(&a[i]);
        for (int64_t k = nv; k < n; k++) s += (double)xr[k];
        mf[i] = (float)(s / (double)n);
      }
    }
    kvf c1[FWD_ROWS] = {{0}}, c2[FWD_ROWS] = {{0}};
    for (int64_t k = 0; k < nv; k += KVL)
      for (int i = 0; i < nr; i++) {
        kvf d = ldv(x + (r0 + i) * n + k) - mf[i];
        c1[i] += d; c2[i] += d * d;
      }
    for (int i = 0; i < nr; i++) {
      const int64_t r = r0 + i;
      const float* restrict xr = x + r * n;
      float* restrict yr = y + r * n;
      double mu = 0.0, var = 0.0;
      if (n > 0) {
        double s1 = sumv(&c1[i]), s2 = sumv(&c2[i]);
        for (int64_t k = nv; k < n; k++) { double d = (double)(xr[k] - mf[i]); s1 += d; s2 += d * d; }
        if (rms) var = s2 / (double)n;
        else {
          mu = (double)mf[i] + s1 / (double)n;
          var = (s2 - s1 * s1 / (double)n) / (double)n;
          if (var < 0.0) var = 0.0;
        }
      }
      double rs = 1.0 / sqrt(var + eps);
      if (mean) mean[r] = mu;
      rstd[r] = rs;
      const float mh = (float)mu, ml = (float)(mu - (double)mh), fr = (float)rs;
      if (w && b) for (int64_t j = 0; j < n; j++) yr[j] = ((xr[j] - mh) - ml) * fr * w[j] + b[j];
      else if (w) for (int64_t j = 0; j < n; j++) yr[j] = ((xr[j] - mh) - ml) * fr * w[j];
      else if (b) for (int64_t j = 0; j < n; j++) yr[j] = ((xr[j] - mh) - ml) * fr + b[j];
      else for (int64_t j = 0; j < n; j++) yr[j] = ((xr[j] - mh) - ml) * fr;
    }
  }
}

NORM_FWD(double, fwd_f64)

/* g_j = go_j * w_j, xhat_j = (x_j - mean) * rstd
 * layer: dx_j = rstd * (g_j - mean(g) - xhat_j * mean(g * xhat))
 * rms:   dx_j = rstd * (g_j - xhat_j * mean(g * xhat))
 * dw += go * xhat, db += go (column sums over rows, in double). */
#define NORM_BWD(T, NAME)                                                                          \
  static void NAME(int rms, int64_t m, int64_t n, const T* go, const T* x, const T* w,             \
                   const double* mean, const double* rstd, T* dx, double* dw, double* db) {       \
    for (int64_t r = 0; r < m; r++) {                                                              \
      const T* restrict xr = x + r * n;                                                            \
      const T* restrict gr = go + r * n;                                                           \
      const double mu = rms ? 0.0 : mean[r];                                                       \
      const T mh = (T)mu, ml = (T)(mu - (double)mh), rs = (T)rstd[r];                              \
      if (dw) for (int64_t j = 0; j < n; j++) dw[j] += (double)gr[j] * (double)(((xr[j] - mh) - ml) * rs); \
      if (db) for (int64_t j = 0; j < n; j++) db[j] += (double)gr[j];                             \
      if (!dx || n == 0) continue;                                                                 \
      double sg = 0.0, sgx;                                                                        \
      if (w) {                                                                                     \
        if (!rms) sg = LANE_SUM(n, (double)(gr[k] * w[k]));                                        \
        sgx = LANE_SUM(n, (double)(gr[k] * w[k]) * (double)(((xr[k] - mh) - ml) * rs));            \
      } else {                                                                                     \
        if (!rms) sg = LANE_SUM(n, (double)gr[k]);                                                 \
        sgx = LANE_SUM(n, (double)gr[k] * (double)(((xr[k] - mh) - ml) * rs));                     \
      }                                                                                            \
      const T a = (T)(sg / (double)n), c = (T)(sgx / (double)n);                                   \
      T* restrict dr = dx + r * n;                                                                 \
      if (w) for (int64_t j = 0; j < n; j++) dr[j] = rs * (gr[j] * w[j] - a - ((xr[j] - mh) - ml) * rs * c); \
      else for (int64_t j = 0; j < n; j++) dr[j] = rs * (gr[j] - a - ((xr[j] - mh) - ml) * rs * c); \
    }                                                                                              \
  }

NORM_BWD(double, bwd_f64)
NORM_BWD(float, bwd_f32_wide)

/* f32 rows: the same formulas, the row sums in KVL f32 lanes combined in double (as the forward), and the weight/bias
 * gradients of the block's rows (at most BLK) summed per column in f32, then added to the double sums once. */
#define BWD_F32_MAX_N 4096
static void bwd_f32(int rms, int64_t m, int64_t n, const float* go, const float* x, const float* w,
                    const double* mean, const double* rstd, float* dx, double* dw, double* db) {
  if (n > BWD_F32_MAX_N) { bwd_f32_wide(rms, m, n, go, x, w, mean, rstd, dx, dw, db); return; }
  float fw[BWD_F32_MAX_N], fb[BWD_F32_MAX_N];
  if (dw) memset(fw, 0, (size_t)n * sizeof *fw);
  if (db) memset(fb, 0, (size_t)n * sizeof *fb);
  const int64_t nv = n & ~(int64_t)(KVL - 1);
  for (int64_t r = 0; r < m; r++) {
    const float* restrict xr = x + r * n;
    const float* restrict gr = go + r * n;
    const double mu = rms ? 0.0 : mean[r];
    const float mh = (float)mu, ml = (float)(mu - (double)mh), rs = (float)rstd[r];
    if (dw) for (int64_t j = 0; j < n; j++) fw[j] += gr[j] * (((xr[j] - mh) - ml) * rs);
    if (db) for (int64_t j = 0; j < n; j++) fb[j] += gr[j];
    if (!dx || n == 0) continue;
    kvf a = {0}, c = {0};
    for (int64_t k = 0; k < nv; k += KVL) {
      kvf gw = w ? ldv(gr + k) * ldv(w + k) : ldv(gr + k);
      a += gw; c += gw * (((ldv(xr + k) - mh) - ml) * rs);
    }
    double sg = sumv(&a), sgx = sumv(&c);
    for (int64_t k = nv; k < n; k++) {
      float gw = w ? gr[k] * w[k] : gr[k];
      sg += (double)gw; sgx += (double)(gw * (((xr[k] - mh) - ml) * rs));
    }
    if (rms) sg = 0.0;
    const float av = (float)(sg / (double)n), cv = (float)(sgx / (double)n);
    float* restrict dr = dx + r * n;
    if (w) for (int64_t j = 0; j < n; j++) dr[j] = rs * (gr[j] * w[j] - av - ((xr[j] - mh) - ml) * rs * cv);
    else for (int64_t j = 0; j < n; j++) dr[j] = rs * (gr[j] - av - ((xr[j] - mh) - ml) * rs * cv);
  }
  if (dw) for (int64_t j = 0; j < n; j++) dw[j] += (double)fw[j];
  if (db) for (int64_t j = 0; j < n; j++) db[j] += (double)fb[j];
}

/* ---------------------------------------------------------------- parallel drivers
 * Rows are independent in the forward pass and for dx; the weight/bias
 * gradients are column sums, accumulated per fixed block of BLK rows (in
 * parallel) and then added block by block in order, so their value does not
 * depend on the thread count. */
#define BLK 32
#define ROW_GRAIN 16384 /* elements per chunk */

typedef struct {
  int dt, rms;
  int64_t m, n;
  const void *x, *w, *b, *go;
  double eps;
  void *y, *dx;
  double *mean, *rstd, *pw, *pb;
  const double *cmean, *crstd;
  int64_t pstride;
  const void* r;    /* forward with a residual: h = x + r is normalized (and written to h) */
  void* h;
  const void* gres; /* backward: added to dx (the gradient of h from its other uses) */
} norm_job;

/* h = x + r over rows [lo, hi) (the add of kc_binary_row, element by element) */
static void add_rows(const norm_job* j, int64_t lo, int64_t hi) {
  int64_t a = lo * j->n, e = hi * j->n;
  if (j->dt == KC_F64) {
    const double *x = j->x, *r = j->r;
    double* h = j->h;
    for (int64_t i = a; i < e; i++) h[i] = x[i] + r[i];
  } else {
    const float *x = j->x, *r = j->r;
    float* h = j->h;
    for (int64_t i = a; i < e; i++) h[i] = x[i] + r[i];
  }
}

static void fwd_part(void* vj, int64_t lo, int64_t hi) {
  const norm_job* j = vj;
  size_t es = j->dt == KC_F64 ? 8 : 4;
  if (j->r) add_rows(j, lo, hi);
  const char* x = (const char*)(j->r ? j->h : j->x) + (size_t)(lo * j->n) * es;
  char* y = (char*)j->y + (size_t)(lo * j->n) * es;
  double* mean = j->mean ? j->mean + lo : NULL;
  if (j->dt == KC_F64) fwd_f64(j->rms, hi - lo, j->n, (const double*)x, j->w, j->b, j->eps, (double*)y, mean, j->rstd + lo);
  else fwd_f32(j->rms, hi - lo, j->n, (const float*)x, j->w, j->b, j->eps, (float*)y, mean, j->rstd + lo);
}

void kc_norm_fwd(int dt, int rms, int64_t m, int64_t n, const void* x, const void* w, const void* b,
                 double eps, void* y, double* mean, double* rstd) {
  kc_add_norm_fwd(dt, rms, m, n, x, NULL, NULL, w, b, eps, y, mean, rstd);
}

void kc_add_norm_fwd(int dt, int rms, int64_t m, int64_t n, const void* x, const void* r, void* h, const void* w,
                     const void* b, double eps, void* y, double* mean, double* rstd) {
  norm_job j = {dt, rms, m, n, x, w, b, NULL, eps, y, NULL, mean, rstd, NULL, NULL, NULL, NULL, 0, r, h, NULL};
  int64_t g = n > 0 ? ROW_GRAIN / n : m;
  kc_parallel_for(m, g > 1 ? g : 1, fwd_part, &j);
}

/* blocks [lo, hi) of BLK rows; block k's column sums go to pw/pb + k * pstride
 * (pstride 0: every block accumulates into the same sums, serially) */
static void bwd_part(void* vj, int64_t lo, int64_t hi) {
  const norm_job* j = vj;
  size_t es = j->dt == KC_F64 ? 8 : 4;
  for (int64_t k = lo; k < hi; k++) {
    int64_t r0 = k * BLK, r1 = r0 + BLK < j->m ? r0 + BLK : j->m;
    size_t off = (size_t)(r0 * j->n) * es;
    double* pw = j->pw ? j->pw + k * j->pstride : NULL;
    double* pb = j->pb ? j->pb + k * j->pstride : NULL;
    const double* mean = j->rms ? NULL : j->cmean + r0;
    void* dx = j->dx ? (char*)j->dx + off : NULL;
    if (j->dt == KC_F64)
      bwd_f64(j->rms, r1 - r0, j->n, (const double*)((const char*)j->go + off), (const double*)((const char*)j->x + off),
              j->w, mean, j->crstd + r0, dx, pw, pb);
    else
      bwd_f32(j->rms, r1 - r0, j->n, (const float*)((const char*)j->go + off), (const float*)((const char*)j->x + off),
              j->w, mean, j->crstd + r0, dx, pw, pb);
    if (dx && j->gres) { /* + the residual's gradient, after dx is stored (one rounding each, as two ops) */
      int64_t cnt = (r1 - r0) * j->n;
      if (j->dt == KC_F64) {
        double* d = dx;
        const double* g = (const double*)((const char*)j->gres + off);
        for (int64_t i = 0; i < cnt; i++) d[i] = d[i] + g[i];
      } else {
        float* d = dx;
        const float* g = (const float*)((const char*)j->gres + off);
        for (int64_t i = 0; i < cnt; i++) d[i] = d[i] + g[i];
      }
    }
  }
}

void kc_norm_bwd(int dt, int rms, int64_t m, int64_t n, const void* go, const void* x, const void* w,
                 const double* mean, const double* rstd, void* dx, double* dw, double* db) {
  kc_norm_bwd_res(dt, rms, m, n, go, x, w, mean, rstd, NULL, dx, dw, db);
}

void kc_norm_bwd_res(int dt, int rms, int64_t m, int64_t n, const void* go, const void* x, const void* w,
                     const double* mean, const double* rstd, const void* gres, void* dx, double* dw, double* db) {
  int64_t nblk = (m + BLK - 1) / BLK;
  norm_job j = {dt, rms, m, n, x, w, NULL, go, 0, NULL, dx, NULL, NULL, dw, db, mean, rstd, 0, NULL, NULL, gres};
  double* part = NULL;
  if ((dw || db) && nblk > 1 && n > 0)
    part = calloc((size_t)nblk * (size_t)n * ((dw ? 1 : 0) + (db ? 1 : 0)), sizeof *part);
  if (!part) { /* one block, no gradient sums, or no memory for the partials: serially */
    bwd_part(&j, 0, nblk);
    return;
  }
  j.pstride = n;
  j.pw = dw ? part : NULL;
  j.pb = db ? part + (dw ? nblk * n : 0) : NULL;
  int64_t g = ROW_GRAIN / (n * BLK);
  kc_parallel_for(nblk, g > 1 ? g : 1, bwd_part, &j);
  for (int64_t k = 0; k < nblk; k++)
    for (int64_t c = 0; c < n; c++) {
      if (dw) dw[c] += j.pw[k * n + c];
      if (db) db[c] += j.pb[k * n + c];
    }
  free(part);
}
