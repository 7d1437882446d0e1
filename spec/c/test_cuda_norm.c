/* test_cuda_norm.c: the vectorised norm kernels and the 2-D column sum of
 * kernels/cuda (norm.cu, colsum.cuh) run on the CPU in their exact partition,
 * summation order and f32 rounding (kernels/cuda/kcuda_norm.cuh, compiled
 * here by gcc as C, FP contraction off as on the device), on any machine:
 *   - the plans cover every row / column exactly once (many sizes);
 *   - forward (layer/rms, residual add, affine or not; f32 and bf16): mean
 *     and rstd against float64 to 2e-6 relative, y in f32 to 1e-5 of the
 *     float64 value, in bf16 within 1 ulp of it rounded (or 2e-6 of its
 *     terms where xhat w + b cancels); h bit-exact;
 *   - backward (dx, dw, db, the residual gradient): against float64 from the
 *     same saved statistics, f32 to 1e-5 (relative to the row's / column's
 *     largest term), bf16 within 1 ulp (dx: 2 ulps);
 *   - column sums (bias gradients) against float64 (f32 2e-6 of the
 *     column's absolute sum; bf16 output within 1 ulp);
 *   - where libengine has the CUDA kernels and a GPU is present: the kernels'
 *     outputs bit for bit against this emulation (skipped otherwise).
 * Prints "N passed, N failed" last. */
/* no FP contraction: the kernels round every product (kcuda_norm.cuh); test_contraction_off checks it */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <stdio.h>
#include <string.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "engine.h"
#include "eng/cuda.h"
#include "../../kernels/cpu/kcpu.h"
#include "../../kernels/cuda/kcuda_norm.cuh"

static int g_pass, g_fail;
#define CHECK(cond, ...)                                                        \
  do {                                                                          \
    if (cond) g_pass++;                                                         \
    else { g_fail++; printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); } \
  } while (0)

/* The kernels, when libengine has them (weak: a CPU-only build links too). */
__attribute__((weak)) int kcu_add_norm_fwd(int dt, int rms, int64_t m, int64_t n, const void* x, const void* r,
                                           void* h, const void* w, const void* b, double eps, void* y, void* mean,
                                           void* rstd, void* stream);
__attribute__((weak)) size_t kcu_norm_bwd_workspace(int64_t m, int64_t n, int dt);
__attribute__((weak)) int kcu_norm_bwd_res(int dt, int rms, int64_t m, int64_t n, const void* gy, const void* x,
                                           const void* w, const void* mean, const void* rstd, const void* gres,
                                           void* dx, void* dw, void* db, void* ws, void* stream);
__attribute__((weak)) size_t kcu_colsum_workspace(int64_t rows, int64_t n, int dt);
__attribute__((weak)) int kcu_colsum(int dt, int64_t rows, int64_t n, const void* x, void* dst, int odt,
                                     double scale, void* ws, void* stream);

static uint64_t g_rs = 0x9e3779b97f4a7c15ull;
static uint32_t rnd32(void) {
  g_rs ^= g_rs << 13; g_rs ^= g_rs >> 7; g_rs ^= g_rs << 17;
  return (uint32_t)(g_rs >> 11);
}
static double rndu(void) { return (rnd32() + 0.5) / 4294967296.0; }
static double rndn(void) { return (rndu() + rndu() + rndu() + rndu() - 2.0) * 1.7; }

/* ---------------------------------------------------------------- storage: f32 or bf16 */
static size_t esz(int dt) { return dt == KCM_F32 ? 4 : 2; }
static float ld(int dt, const void* p, int64_t i) {
  return dt == KCM_F32 ? ((const float*)p)[i] : kcm_bf16_to_f32(((const uint16_t*)p)[i]);
}
static void st(int dt, void* p, int64_t i, float v) {
  if (dt == KCM_F32) ((float*)p)[i] = v;
  else ((uint16_t*)p)[i] = kcm_f32_to_bf16(v);
}
static float rnd_to(int dt, float v) { return dt == KCM_F32 ? v : kcm_bf16_to_f32(kcm_f32_to_bf16(v)); }
static void* fill(int dt, int64_t cnt, double scale, double shift) {
  void* p = malloc((size_t)(cnt > 0 ? cnt : 1) * esz(dt));
  for (int64_t i = 0; i < cnt; i++) st(dt, p, i, (float)(rndn() * scale + shift));
  return p;
}
/* distance in bf16 ulps between got (bf16 value) and want rounded to bf16 */
static int64_t bf16_ord(float v) {
  uint16_t u = kcm_f32_to_bf16(v);
  return (u & 0x8000) ? -(int64_t)(u & 0x7fff) : (int64_t)u;
}
static int64_t ulps(float got, double want) {
  int64_t d = bf16_ord(got) - bf16_ord((float)want);
  return d < 0 ? -d : d;
}
/* the double rounded to f32 then bf16 can round twice; within 1 ulp anyway (the tolerance) */

/* ---------------------------------------------------------------- emulation: forward */
static void emu_fwd(int dt, int rms, int64_t m, int64_t n, const void* x, const void* r, void* h, const void* w,
                    const void* b, float eps, void* y, float* mean, float* rstd) {
  const int V = dt == KCM_F32 ? 4 : 8, nv = kcm_norm_nv(n, V);
  float* v = malloc(sizeof(float) * (size_t)n);
  for (int64_t row = 0; row < m; row++) {
    const int64_t off = row * n;
    for (int64_t j = 0; j < n; j++) {
      float t = ld(dt, x, off + j);
      if (r) { t = rnd_to(dt, KCM_ADD(t, ld(dt, r, off + j))); st(dt, h, off + j, t); }
      v[j] = t;
    }
    float lane[32], mu = 0.0f;
    if (!rms) {
      for (int l = 0; l < 32; l++) {
        float s = 0.0f;
        for (int i = 0; i < nv; i++) {
          int64_t c = ((int64_t)i * 32 + l) * V;
          if (c < n) for (int k = 0; k < V; k++) s = KCM_ADD(s, v[c + k]);
        }
        lane[l] = s;
      }
      kcm_warp_butterfly(lane);
      mu = kcm_norm_mean(lane[0], n);
    }
    for (int l = 0; l < 32; l++) {
      float s = 0.0f;
      for (int i = 0; i < nv; i++) {
        int64_t c = ((int64_t)i * 32 + l) * V;
        if (c < n) for (int k = 0; k < V; k++) s = kcm_norm_var_term(s, v[c + k], mu);
      }
      lane[l] = s;
    }
    kcm_warp_butterfly(lane);
    float rs = kcm_norm_rstd(lane[0], n, eps);
    if (mean) mean[row] = mu;
    rstd[row] = rs;
    for (int64_t j = 0; j < n; j++)
      st(dt, y, off + j, kcm_norm_y(v[j], mu, rs, w != NULL, w ? ld(dt, w, j) : 0.0f, b != NULL, b ? ld(dt, b, j) : 0.0f));
  }
  free(v);
}

/* ---------------------------------------------------------------- emulation: column sums */
/* colsum_tile<T, V, TY> over x[rows, n] (dt; F32 with V = 1 for partials), one row tile of rt rows per by;
 * part != NULL: f32 partial rows, else dst (odt) times scale. */
static void emu_colsum_tile(int dt, int V, int TY, int64_t rows, int64_t n, int64_t rt, const void* x, float* part,
                            void* dst, int odt, float scale) {
  int64_t gy = rows < 1 ? 1 : kcm_cdiv(rows, rt), gx = kcm_colsum_col_tiles(n, V);
  float acc[32][8];
  for (int64_t by = 0; by < gy; by++) {
    int64_t r0 = by * rt, r1 = r0 + rt < rows ? r0 + rt : rows;
    for (int64_t bx = 0; bx < gx; bx++)
      for (int tx = 0; tx < 32; tx++) {
        int64_t c0 = (bx * 32 + tx) * V;
        if (c0 >= n) continue;
        for (int ty = 0; ty < TY; ty++) {
          for (int k = 0; k < V; k++) acc[ty][k] = 0.0f;
          for (int64_t rr = r0 + ty; rr < r1; rr += TY)
            for (int k = 0; k < V; k++) acc[ty][k] = KCM_ADD(acc[ty][k], ld(dt, x, rr * n + c0 + k));
        }
        for (int k = 0; k < V && c0 + k < n; k++) {
          float s = acc[0][k];
          for (int j = 1; j < TY; j++) s = KCM_ADD(s, acc[j][k]);
          if (part) part[by * n + c0 + k] = s;
          else st(odt, dst, c0 + k, scale == 1.0f ? s : KCM_MUL(s, scale));
        }
      }
  }
}
static void emu_colsum(int dt, int V, int64_t rows, int64_t n, const void* x, void* dst, int odt, float scale) {
  int64_t rt = kcm_colsum_tile_rows(rows, n, V), gy = kcm_colsum_row_tiles(rows, n, V);
  float* part = gy > 1 ? malloc(sizeof(float) * (size_t)(gy * n)) : NULL;
  emu_colsum_tile(dt, V, KCM_COLSUM_TY, rows, n, rt, x, part, dst, odt, scale);
  if (gy > 1) emu_colsum_tile(KCM_F32, 1, KCM_COLSUM2_TY, gy, n, gy, part, NULL, dst, odt, scale);
  free(part);
}

/* ---------------------------------------------------------------- emulation: backward */
static void emu_bwd(int dt, int rms, int64_t m, int64_t n, const void* go, const void* x, const void* w,
                    const float* mean, const float* rstd, const void* gres, void* dx, void* dw, void* db) {
  const int V = dt == KCM_F32 ? 4 : 8, nv = kcm_norm_nv(n, V), W = KCM_NORM_WARPS;
  const int64_t R = kcm_norm_bwd_rows(m), P = kcm_norm_bwd_blocks(m);
  float* part = calloc((size_t)(2 * P * n), sizeof(float));
  float *adw = malloc(sizeof(float) * (size_t)(W * n)), *adb = malloc(sizeof(float) * (size_t)(W * n));
  float *g = malloc(sizeof(float) * (size_t)n), *xh = malloc(sizeof(float) * (size_t)n);
  for (int64_t p = 0; p < P; p++) {
    int64_t r0 = p * R, r1 = r0 + R < m ? r0 + R : m;
    for (int64_t i = 0; i < W * n; i++) adw[i] = adb[i] = 0.0f;
    for (int q = 0; q < W; q++)
      for (int64_t row = r0 + q; row < r1; row += W) {
        const int64_t off = row * n;
        const float mu = rms ? 0.0f : mean[row], rs = rstd[row];
        for (int64_t j = 0; j < n; j++) { g[j] = ld(dt, go, off + j); xh[j] = kcm_norm_xhat(ld(dt, x, off + j), mu, rs); }
        if (dx) {
          float la[32], lb[32];
          for (int l = 0; l < 32; l++) {
            float sa = 0.0f, sb = 0.0f;
            for (int i = 0; i < nv; i++) {
              int64_t c = ((int64_t)i * 32 + l) * V;
              if (c < n)
                for (int k = 0; k < V; k++) {
                  float wdy = w ? KCM_MUL(g[c + k], ld(dt, w, c + k)) : g[c + k];
                  if (!rms) sa = KCM_ADD(sa, wdy);
                  sb = KCM_FMA(wdy, xh[c + k], sb);
                }
            }
            la[l] = sa; lb[l] = sb;
          }
          kcm_warp_butterfly(la);
          kcm_warp_butterfly(lb);
          float a = rms ? 0.0f : KCM_DIV(la[0], (float)n), c = KCM_DIV(lb[0], (float)n);
          for (int64_t j = 0; j < n; j++) {
            float wdy = w ? KCM_MUL(g[j], ld(dt, w, j)) : g[j];
            float d = kcm_norm_dx_rn(rms, wdy, xh[j], rs, a, c);
            if (gres) d = KCM_ADD(rnd_to(dt, d), ld(dt, gres, off + j));
            st(dt, dx, off + j, d);
          }
        }
        for (int64_t j = 0; j < n; j++) {
          adw[q * n + j] = KCM_FMA(g[j], xh[j], adw[q * n + j]);
          adb[q * n + j] = KCM_ADD(adb[q * n + j], g[j]);
        }
      }
    for (int64_t j = 0; j < n; j++) { /* the block's warps in order */
      float sw = adw[j], sb = adb[j];
      for (int q = 1; q < W; q++) { sw = KCM_ADD(sw, adw[q * n + j]); sb = KCM_ADD(sb, adb[q * n + j]); }
      part[p * n + j] = sw;
      part[(P + p) * n + j] = sb;
    }
  }
  if (dw) emu_colsum_tile(KCM_F32, 1, KCM_COLSUM2_TY, P, n, P, part, NULL, dw, dt, 1.0f);
  if (db) emu_colsum_tile(KCM_F32, 1, KCM_COLSUM2_TY, P, n, P, part + P * n, NULL, db, dt, 1.0f);
  free(part); free(adw); free(adb); free(g); free(xh);
}

/* ---------------------------------------------------------------- the GPU, when present */
static int g_gpu = -1;
static void* g_stream;
static int gpu(void) {
  if (g_gpu < 0) {
    g_gpu = kcu_add_norm_fwd && kcu_norm_bwd_res && kcu_colsum && eng_cuda_is_available() == 1;
    if (g_gpu) g_stream = eng_cuda_stream(0);
  }
  return g_gpu;
}
static void* up(const void* h, size_t nb) {
  if (!h) return NULL;
  void* d = eng_cuda_malloc((int64_t)(nb ? nb : 1));
  if (d && nb) eng_cuda_memcpy_h2d(d, h, (int64_t)nb);
  return d;
}
static void* dnew(size_t nb) { return eng_cuda_malloc((int64_t)(nb ? nb : 1)); }
static int same_bytes_dev(const void* dptr, const void* host, size_t nb) {
  void* t = malloc(nb ? nb : 1);
  eng_cuda_synchronize();
  eng_cuda_memcpy_d2h(t, dptr, (int64_t)nb);
  int ok = memcmp(t, host, nb) == 0;
  free(t);
  return ok;
}

/* ---------------------------------------------------------------- tests */
static void test_contraction_off(void) {
  /* a*b+c where the fused result differs: the emulation must round the product */
  volatile float a = 1.0f + 1.0f / 4096, b = 1.0f + 1.0f / 4096, c = -(1.0f + 1.0f / 2048);
  float unfused = KCM_ADD(KCM_MUL(a, b), c), fused = fmaf(a, b, c);
  volatile float prod = a * b;
  CHECK(unfused == prod + c && unfused != fused, "FP contraction is off in the emulation (%g vs fused %g)",
        (double)unfused, (double)fused);
}

static void test_plans(void) {
  int bad = 0;
  for (int64_t m = 1; m < 5000; m += (m < 64 ? 1 : 37)) {
    int64_t R = kcm_norm_bwd_rows(m), P = kcm_norm_bwd_blocks(m);
    if (P > KCM_NORM_BWD_BLOCKS || P < 1 || (P - 1) * R >= m || P * R < m) bad++;
  }
  CHECK(!bad, "norm backward: every row in exactly one block, at most %d blocks (%d bad sizes)", KCM_NORM_BWD_BLOCKS,
        bad);
  int64_t sizes[][2] = {{1, 1}, {1, 768}, {31, 33}, {32, 8}, {33, 2048}, {1000, 768}, {8192, 768}, {8192, 3072},
                        {8191, 50304}, {3, 100000}, {70000, 5}};
  bad = 0;
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
    for (int V = 1; V <= 8; V *= 2) {
      int64_t rows = sizes[s][0], n = sizes[s][1];
      int64_t rt = kcm_colsum_tile_rows(rows, n, V), gy = kcm_colsum_row_tiles(rows, n, V);
      int64_t gx = kcm_colsum_col_tiles(n, V);
      if ((gy - 1) * rt >= rows || gy * rt < rows || gx * 32 * V < n || (gx - 1) * 32 * V >= n) bad++;
      if (gy > KCM_COLSUM_BLOCKS || (gy > 1 && rt < KCM_COLSUM_MIN_ROWS)) bad++;
    }
  CHECK(!bad, "column sums: row and column tiles cover the matrix exactly (%d bad)", bad);
  CHECK(kcm_norm_nv(768, 8) == 3 && kcm_norm_nv(768, 4) == 6 && kcm_norm_nv(2048, 8) == 8 &&
            kcm_norm_nv(2056, 8) == 0 && kcm_norm_nv(33, 4) == 0 && kcm_norm_nv(8, 8) == 1,
        "vector path: GPT-2's 768 is 3 bf16 / 6 f32 vectors per lane; 2048 bf16 the widest");
}

typedef struct { int dt, rms, res, affine; int64_t m, n; } ncase;

static void test_norm_case(ncase c) {
  const int dt = c.dt, rms = c.rms;
  const int64_t m = c.m, n = c.n, mn = m * n;
  const float eps = 1e-5f;
  const char* dn = dt == KCM_F32 ? "f32" : "bf16";
  char what[128];
  snprintf(what, sizeof what, "%s %s %lldx%lld%s%s", rms ? "rms_norm" : "layer_norm", dn, (long long)m, (long long)n,
           c.res ? " +residual" : "", c.affine ? "" : " (no affine)");
  void* x = fill(dt, mn, 2.0, 3.0);
  void* r = c.res ? fill(dt, mn, 1.0, -1.0) : NULL;
  void* w = c.affine ? fill(dt, n, 0.3, 1.0) : NULL;
  void* b = c.affine && !rms ? fill(dt, n, 0.3, 0.0) : NULL;
  void* go = fill(dt, mn, 1.0, 0.0);
  void* gres = c.res ? fill(dt, mn, 1.0, 0.0) : NULL;
  size_t nb = (size_t)mn * esz(dt);
  void *h = c.res ? malloc(nb) : NULL, *y = malloc(nb), *dx = malloc(nb), *dxr = c.res ? malloc(nb) : NULL;
  void *dw = malloc((size_t)n * esz(dt)), *db = malloc((size_t)n * esz(dt));
  float *mean = malloc(sizeof(float) * (size_t)m), *rstd = malloc(sizeof(float) * (size_t)m);
  emu_fwd(dt, rms, m, n, x, r, h, w, b, eps, y, rms ? NULL : mean, rstd);
  /* forward against float64 */
  const void* hx = c.res ? h : x;
  int bad_h = 0, bad_stat = 0, bad_y = 0;
  double worst_y = 0;
  for (int64_t row = 0; row < m; row++) {
    double mu = 0, var = 0;
    for (int64_t j = 0; j < n; j++) {
      if (c.res) {
        float want = rnd_to(dt, ld(dt, x, row * n + j) + ld(dt, r, row * n + j));
        if (ld(dt, h, row * n + j) != want) bad_h++;
      }
      if (!rms) mu += ld(dt, hx, row * n + j);
    }
    mu /= (double)n;
    for (int64_t j = 0; j < n; j++) { double d = ld(dt, hx, row * n + j) - mu; var += d * d; }
    double rs = 1.0 / sqrt(var / (double)n + (double)eps);
    if (!rms && fabs(mean[row] - mu) > 2e-6 * (fabs(mu) + 1.0 / rs)) bad_stat++;
    if (fabs(rstd[row] - rs) > 2e-6 * rs) bad_stat++;
    for (int64_t j = 0; j < n; j++) {
      double want = (ld(dt, hx, row * n + j) - mu) * rs;
      if (w) want *= ld(dt, w, j);
      double terms = fabs(want) + (b ? fabs(ld(dt, b, j)) : 0.0); /* y cancels when b ~ -xhat w */
      if (b) want += ld(dt, b, j);
      float got = ld(dt, y, row * n + j);
      if (dt == KCM_F32) {
        double e = fabs(got - want) / (1.0 + fabs(want));
        if (e > worst_y) worst_y = e;
        if (e > 1e-5) bad_y++;
      } else if (ulps(got, want) > 1 && fabs(got - want) > 2e-6 * terms) {
        if (!bad_y) printf("  %s row %lld col %lld: got %.9g want %.9g (%lld ulps)\n", what, (long long)row, (long long)j, got, want, (long long)ulps(got, want));
        bad_y++;
      }
    }
  }
  CHECK(!bad_h, "%s: h = x + r rounded to the dtype (%d differ)", what, bad_h);
  CHECK(!bad_stat, "%s: mean and rstd within 2e-6 of float64 (%d rows off)", what, bad_stat);
  CHECK(!bad_y, "%s: y within %s of float64 (%d off, worst %.3g)", what, dt == KCM_F32 ? "1e-5" : "1 bf16 ulp", bad_y,
        worst_y);
  /* f32: the CPU kernel agrees too */
  if (dt == KCM_F32) {
    float* yc = malloc(nb);
    double *mc = malloc(sizeof(double) * (size_t)m), *rc = malloc(sizeof(double) * (size_t)m);
    kc_norm_fwd(KC_F32, rms, m, n, hx, w, b, eps, yc, rms ? NULL : mc, rc);
    int bad = 0;
    for (int64_t i = 0; i < mn; i++) if (fabs(yc[i] - ((float*)y)[i]) > 1e-5 * (1 + fabs(yc[i]))) bad++;
    CHECK(!bad, "%s: y within 1e-5 of kc_norm_fwd (%d off)", what, bad);
    free(yc); free(mc); free(rc);
  }
  /* backward against float64 from the saved statistics */
  emu_bwd(dt, rms, m, n, go, hx, w, rms ? NULL : mean, rstd, NULL, dx, dw, db);
  double* rdw = calloc((size_t)n, sizeof(double));
  double* rdb = calloc((size_t)n, sizeof(double));
  double* adw = calloc((size_t)n, sizeof(double)); /* sums of |terms|: the scale of the rounding */
  double* adb = calloc((size_t)n, sizeof(double));
  int bad_dx = 0;
  for (int64_t row = 0; row < m; row++) {
    double mu = rms ? 0.0 : mean[row], rs = rstd[row], sa = 0, sb = 0, big = 0;
    for (int64_t j = 0; j < n; j++) {
      double g = ld(dt, go, row * n + j), xh = (ld(dt, hx, row * n + j) - mu) * rs, wdy = g * (w ? ld(dt, w, j) : 1.0);
      sa += wdy; sb += wdy * xh;
      rdw[j] += g * xh; rdb[j] += g; adw[j] += fabs(g * xh); adb[j] += fabs(g);
      if (fabs(wdy) > big) big = fabs(wdy);
    }
    double a = rms ? 0.0 : sa / (double)n, cc = sb / (double)n;
    for (int64_t j = 0; j < n; j++) {
      double g = ld(dt, go, row * n + j), xh = (ld(dt, hx, row * n + j) - mu) * rs, wdy = g * (w ? ld(dt, w, j) : 1.0);
      double want = rs * (wdy - a - xh * cc);
      float got = ld(dt, dx, row * n + j);
      if (dt == KCM_F32 ? fabs(got - want) > 1e-5 * rs * (big + fabs(a) + fabs(xh * cc)) : ulps(got, want) > 2) bad_dx++;
    }
  }
  int bad_dw = 0, bad_db = 0;
  for (int64_t j = 0; j < n; j++) {
    float gw = ld(dt, dw, j), gb = ld(dt, db, j);
    if (dt == KCM_F32) {
      if (fabs(gw - rdw[j]) > 1e-5 * adw[j] + 1e-30) bad_dw++;
      if (fabs(gb - rdb[j]) > 1e-5 * adb[j] + 1e-30) bad_db++;
    } else {
      /* f32 sums then one rounding: within 1 ulp unless the f32 error is comparable to an ulp */
      if (ulps(gw, rdw[j]) > 1 && fabs(gw - rdw[j]) > 1e-5 * adw[j]) bad_dw++;
      if (ulps(gb, rdb[j]) > 1 && fabs(gb - rdb[j]) > 1e-5 * adb[j]) bad_db++;
    }
  }
  CHECK(!bad_dx, "%s: dx within %s of float64 (%d off)", what, dt == KCM_F32 ? "1e-5" : "2 bf16 ulps", bad_dx);
  CHECK(!bad_dw && !bad_db, "%s: dw, db (%lld partial rows) within %s of float64 (%d, %d off)", what,
        (long long)kcm_norm_bwd_blocks(m), dt == KCM_F32 ? "1e-5" : "1 bf16 ulp", bad_dw, bad_db);
  if (c.res) { /* the residual's gradient: added after dx is rounded, as two autograd gradients */
    emu_bwd(dt, rms, m, n, go, hx, w, rms ? NULL : mean, rstd, gres, dxr, NULL, NULL);
    int bad = 0;
    for (int64_t i = 0; i < mn; i++)
      if (ld(dt, dxr, i) != rnd_to(dt, ld(dt, dx, i) + ld(dt, gres, i))) bad++;
    CHECK(!bad, "%s: dx + the residual gradient = the sum of the rounded gradients (%d differ)", what, bad);
  }
  /* the kernels on the GPU: bit for bit */
  if (gpu()) {
    int kdt = dt == KCM_F32 ? 0 : 2;
    void *dX = up(x, nb), *dR = up(r, nb), *dW = up(w, (size_t)n * esz(dt)), *dB = up(b, (size_t)n * esz(dt));
    void *dH = c.res ? dnew(nb) : NULL, *dY = dnew(nb), *dM = dnew((size_t)m * 4), *dS = dnew((size_t)m * 4);
    int st1 = kcu_add_norm_fwd(kdt, rms, m, n, dX, dR, dH, dW, dB, eps, dY, rms ? NULL : dM, dS, g_stream);
    CHECK(st1 == 0, "%s: kcu_add_norm_fwd status %d", what, st1);
    CHECK(same_bytes_dev(dY, y, nb) && same_bytes_dev(dS, rstd, (size_t)m * 4) &&
              (rms || same_bytes_dev(dM, mean, (size_t)m * 4)) && (!c.res || same_bytes_dev(dH, h, nb)),
          "%s: GPU forward (y, mean, rstd, h) bit-identical to the emulation", what);
    void *dG = up(go, nb), *dGr = up(gres, nb), *dDX = dnew(nb), *dDW = dnew((size_t)n * esz(dt)),
         *dDB = dnew((size_t)n * esz(dt)), *dWS = dnew(kcu_norm_bwd_workspace(m, n, kdt));
    void* dHX = c.res ? dH : dX;
    int st2 = kcu_norm_bwd_res(kdt, rms, m, n, dG, dHX, dW, rms ? NULL : dM, dS, NULL, dDX, dDW, rms ? NULL : dDB,
                               dWS, g_stream);
    CHECK(st2 == 0, "%s: kcu_norm_bwd_res status %d", what, st2);
    CHECK(same_bytes_dev(dDX, dx, nb) && same_bytes_dev(dDW, dw, (size_t)n * esz(dt)) &&
              (rms || same_bytes_dev(dDB, db, (size_t)n * esz(dt))),
          "%s: GPU backward (dx, dw, db) bit-identical to the emulation", what);
    if (c.res) {
      int st3 = kcu_norm_bwd_res(kdt, rms, m, n, dG, dHX, dW, rms ? NULL : dM, dS, dGr, dDX, NULL, NULL, dWS, g_stream);
      CHECK(st3 == 0 && same_bytes_dev(dDX, dxr, nb), "%s: GPU dx + residual gradient bit-identical", what);
    }
    void* ps[] = {dX, dR, dW, dB, dH, dY, dM, dS, dG, dGr, dDX, dDW, dDB, dWS};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) eng_cuda_free(ps[i]);
  }
  free(x); free(r); free(w); free(b); free(go); free(gres); free(h); free(y); free(dx); free(dxr); free(dw); free(db);
  free(mean); free(rstd); free(rdw); free(rdb); free(adw); free(adb);
}

static void test_colsum_case(int dt, int64_t rows, int64_t n, int odt) {
  const int V = dt == KCM_F32 ? 4 : 8;
  const int vec = n % V == 0; /* allocations are aligned: the kernel takes the vector path iff n % V == 0 */
  char what[96];
  snprintf(what, sizeof what, "colsum %s %lldx%lld -> %s", dt == KCM_F32 ? "f32" : "bf16", (long long)rows,
           (long long)n, odt == KCM_F32 ? "f32" : "bf16");
  void* x = fill(dt, rows * n, 1.0, 0.1);
  void* dst = malloc((size_t)n * 4);
  emu_colsum(dt, vec ? V : 1, rows, n, x, dst, odt, 1.0f);
  int bad = 0;
  for (int64_t j = 0; j < n; j++) {
    double s = 0, a = 0;
    for (int64_t r = 0; r < rows; r++) { double v = ld(dt, x, r * n + j); s += v; a += fabs(v); }
    float got = ld(odt, dst, j);
    if (odt == KCM_F32 ? fabs(got - s) > 2e-6 * a + 1e-30 : (ulps(got, s) > 1 && fabs(got - s) > 2e-6 * a)) bad++;
  }
  CHECK(!bad, "%s (%lld x %lld tiles): within %s of float64 (%d off)", what,
        (long long)kcm_colsum_row_tiles(rows, n, vec ? V : 1), (long long)kcm_colsum_col_tiles(n, vec ? V : 1),
        odt == KCM_F32 ? "2e-6 of the absolute sum" : "1 bf16 ulp", bad);
  if (gpu()) {
    int kdt = dt == KCM_F32 ? 0 : 2, kodt = odt == KCM_F32 ? 0 : 2;
    size_t wsb = kcu_colsum_workspace(rows, n, kdt);
    void *dX = up(x, (size_t)(rows * n) * esz(dt)), *dD = dnew((size_t)n * 4), *dWS = wsb ? dnew(wsb) : NULL;
    int s = kcu_colsum(kdt, rows, n, dX, dD, kodt, 1.0, dWS, g_stream);
    CHECK(s == 0 && same_bytes_dev(dD, dst, (size_t)n * esz(odt)), "%s: GPU bit-identical to the emulation", what);
    eng_cuda_free(dX); eng_cuda_free(dD); eng_cuda_free(dWS);
  }
  free(x); free(dst);
}

int main(void) {
  test_contraction_off();
  test_plans();
  ncase cases[] = {
      {KCM_BF16, 0, 1, 1, 64, 768},  {KCM_BF16, 0, 0, 1, 1, 768},   {KCM_BF16, 1, 0, 1, 37, 768},
      {KCM_BF16, 0, 1, 0, 13, 8},    {KCM_BF16, 0, 0, 1, 130, 2048}, {KCM_BF16, 1, 1, 1, 9, 1000},
      {KCM_F32, 0, 1, 1, 37, 768},   {KCM_F32, 1, 0, 1, 1, 768},    {KCM_F32, 0, 0, 0, 70, 1024},
      {KCM_F32, 0, 1, 1, 5, 4},      {KCM_F32, 1, 1, 0, 300, 132},  {KCM_BF16, 0, 0, 1, 4100, 64},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) test_norm_case(cases[i]);
  test_colsum_case(KCM_BF16, 8192, 768, KCM_BF16);
  test_colsum_case(KCM_BF16, 1, 768, KCM_BF16);
  test_colsum_case(KCM_BF16, 1000, 3072, KCM_F32);
  test_colsum_case(KCM_BF16, 100, 33, KCM_BF16);
  test_colsum_case(KCM_F32, 8192, 768, KCM_F32);
  test_colsum_case(KCM_F32, 37, 50, KCM_F32);
  test_colsum_case(KCM_F32, 65, 1, KCM_F32);
  printf("GPU comparison: %s\n", gpu() ? "ran (bit for bit against the emulation)"
                                       : kcu_colsum ? "skipped (no GPU)" : "skipped (a build without CUDA kernels)");
  printf("%d passed, %d failed\n", g_pass, g_fail);
  return g_fail ? 1 : 0;
}
