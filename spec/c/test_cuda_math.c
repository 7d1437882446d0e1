/* test_cuda_math.c: the per-element formulas of the CUDA kernels
 * (kernels/cuda/kcuda_math.cuh, compiled here by gcc as plain C) against the
 * CPU kernels of libengine, on any machine (no GPU needed):
 *   - bf16 / f16 conversions bit-identical to kernels/cpu/half.h (all 65536
 *     half values, special and random f32 values);
 *   - dropout masks and uniform numbers bit-identical to kc_dropout_run /
 *     kc_random_run for the same (seed, offset, index), normal numbers to
 *     rounding; bernoulli identical;
 *   - unary functions / derivatives and binary ops against kc_unary_row,
 *     kc_unary_grad_row, kc_binary_row;
 *   - the AdamW element update against kc_adamw_row (f32, f64, bf16 params) and, with f32 master weights and
 *     a bf16 copy, against kc_adamw_master_row (plus the vectorised kernel's index split);
 *   - online logsumexp, cross-entropy loss/grad and norm dx against the CPU
 *     loss and norm kernels.
 * Prints "N passed, N failed" last. */
#include <stdio.h>
#include <string.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "engine.h"
#include "../../kernels/cpu/kcpu.h"
#include "../../kernels/cuda/kcuda_math.cuh"

static int g_pass, g_fail;
#define CHECK(cond, ...)                                                        \
  do {                                                                          \
    if (cond) g_pass++;                                                         \
    else { g_fail++; printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); } \
  } while (0)

static uint64_t g_rs = 0x1234567887654321ull;
static uint32_t rnd32(void) {
  g_rs ^= g_rs << 13; g_rs ^= g_rs >> 7; g_rs ^= g_rs << 17;
  return (uint32_t)(g_rs >> 11);
}
static double rndu(void) { return (rnd32() + 0.5) / 4294967296.0; }
static double rndn(double s) { return s * (rndu() + rndu() + rndu() + rndu() - 2.0) * 1.7; }

static int same_f32(float a, float b) { return memcmp(&a, &b, 4) == 0 || (a != a && b != b); }
static int close_rel(double a, double b, double rtol, double atol) {
  if (a != a || b != b) return a != a && b != b;
  if (isinf(a) || isinf(b)) return a == b;
  return fabs(a - b) <= atol + rtol * fabs(b);
}

/* ---------------------------------------------------------------- halves */
static void test_halves(void) {
  int bad_bf = 0, bad_h = 0;
  for (uint32_t h = 0; h < 65536; h++) {
    float a = kcm_bf16_to_f32((uint16_t)h), b = kc_bf16_to_f32((uint16_t)h);
    if (memcmp(&a, &b, 4)) bad_bf++;
    a = kcm_f16_to_f32((uint16_t)h); b = kc_f16_to_f32((uint16_t)h);
    if (memcmp(&a, &b, 4)) bad_h++;
  }
  CHECK(bad_bf == 0, "bf16 -> f32 differs for %d of 65536 values", bad_bf);
  CHECK(bad_h == 0, "f16 -> f32 differs for %d of 65536 values", bad_h);
  static const uint32_t special[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u,
                                     0xffc12345u, 0x00000001u, 0x807fffffu, 0x3f808000u, 0x3f818000u, 0x3f80ffffu,
                                     0x477fe000u, 0x477ff000u, 0x47800000u, 0x33800000u, 0x33000000u, 0x38800000u,
                                     0x387fc000u, 0x7f7fffffu, 0x3effffffu, 0x38fff000u, 0xb8800001u};
  int bad2b = 0, bad2h = 0;
  for (int i = 0; i < (int)(sizeof special / sizeof special[0]) + 2000000; i++) {
    uint32_t u = i < (int)(sizeof special / sizeof special[0]) ? special[i] : rnd32() ^ (rnd32() << 21);
    float f;
    memcpy(&f, &u, 4);
    if (kcm_f32_to_bf16(f) != kc_f32_to_bf16(f)) bad2b++;
    if (kcm_f32_to_f16(f) != kc_f32_to_f16(f)) bad2h++;
  }
  CHECK(bad2b == 0, "f32 -> bf16 differs for %d values", bad2b);
  CHECK(bad2h == 0, "f32 -> f16 differs for %d values", bad2h);
  /* round to nearest even on a tie */
  float tie;
  uint32_t tu = 0x3f808000u; /* 1 + 2^-8: halfway between two bf16 values */
  memcpy(&tie, &tu, 4);
  CHECK(kcm_f32_to_bf16(tie) == 0x3f80, "bf16 tie rounds to even (got %04x)", kcm_f32_to_bf16(tie));
}

/* ---------------------------------------------------------------- random numbers */
static uint32_t word_at(uint64_t seed, uint64_t j) {
  uint32_t w[4];
  kc_philox_block(seed, j >> 2, w);
  return w[j & 3];
}

static void test_dropout(void) {
  enum { N = 1003 };
  static float x[N], y_cpu[N], y_gpu[N];
  static double xd[N], yd_cpu[N];
  static uint16_t xb[N], yb_cpu[N];
  const uint64_t seeds[3] = {0, 42, 0x9E3779B97F4A7C15ull};
  const uint64_t offs[4] = {0, 4, 7, (1ull << 33) + 1};
  const double keeps[3] = {0.9, 0.5, 0.0};
  for (int i = 0; i < N; i++) { x[i] = (float)rndn(1.0); xd[i] = rndn(1.0); xb[i] = kc_f32_to_bf16(x[i]); }
  int bad = 0, badd = 0, badb = 0, kept = 0, total = 0;
  for (int si = 0; si < 3; si++)
    for (int oi = 0; oi < 4; oi++)
      for (int ki = 0; ki < 3; ki++) {
        double keep = keeps[ki], scale = keep > 0 ? 1.0 / keep : 0.0, thr = kcm_dropout_threshold(keep);
        kc_dropout_run(seeds[si], offs[oi], N, keep, scale, (const char*)x, 4, (char*)y_cpu, 4, KC_F32);
        kc_dropout_run(seeds[si], offs[oi], N, keep, scale, (const char*)xd, 8, (char*)yd_cpu, 8, KC_F64);
        kc_dropout_run(seeds[si], offs[oi], N, keep, scale, (const char*)xb, 2, (char*)yb_cpu, 2, KC_BF16);
        for (int i = 0; i < N; i++) {
          uint32_t w = word_at(seeds[si], offs[oi] + (uint64_t)i);
          y_gpu[i] = kcm_dropout_f32(x[i], w, thr, (float)scale);
          if (!same_f32(y_gpu[i], y_cpu[i])) bad++;
          double yd = kcm_dropout_f64(xd[i], w, thr, scale);
          if (memcmp(&yd, &yd_cpu[i], 8)) badd++;
          uint16_t yb = kcm_f32_to_bf16(kcm_dropout_f32(kcm_bf16_to_f32(xb[i]), w, thr, (float)scale));
          if (yb != yb_cpu[i]) badb++;
          if (ki == 0) { kept += kcm_dropout_keep(w, thr); total++; }
        }
      }
  CHECK(bad == 0, "f32 dropout differs from kc_dropout_run in %d elements", bad);
  CHECK(badd == 0, "f64 dropout differs from kc_dropout_run in %d elements", badd);
  CHECK(badb == 0, "bf16 dropout differs from kc_dropout_run in %d elements", badb);
  double frac = (double)kept / total;
  CHECK(fabs(frac - 0.9) < 0.02, "keep fraction %.4f for keep = 0.9", frac);
}

static void test_random(void) {
  enum { N = 999 };
  static float u_cpu[N];
  static double n_cpu[N], ud_cpu[N];
  static uint8_t b_cpu[N];
  const uint64_t seed = 1234, off = 6;
  /* uniform f32 in [a, b) with the open-bound fix */
  double a = -0.5, b = 2.25;
  kc_random_run(KC_RNG_UNIFORM, seed, off, N, (char*)u_cpu, 4, KC_F32, a, b);
  kc_random_run(KC_RNG_UNIFORM, seed, off, N, (char*)ud_cpu, 8, KC_F64, a, b);
  int bad = 0, badd = 0;
  for (int i = 0; i < N; i++) {
    uint32_t w = word_at(seed, off + (uint64_t)i);
    float f = (float)kcm_uniform(w, a, b - a);
    if ((double)f >= b) f = (float)a;
    if (!same_f32(f, u_cpu[i])) bad++;
    double d = kcm_uniform(w, a, b - a);
    if (d >= b) d = a;
    if (memcmp(&d, &ud_cpu[i], 8)) badd++;
  }
  CHECK(bad == 0, "uniform f32 differs from kc_random_run in %d elements", bad);
  CHECK(badd == 0, "uniform f64 differs from kc_random_run in %d elements", badd);
  /* normal f64: Box-Muller on word pairs (0,1) and (2,3) of each block */
  double mean = 0.25, sd = 3.0, maxrel = 0;
  kc_random_run(KC_RNG_NORMAL, seed, off, N, (char*)n_cpu, 8, KC_F64, mean, sd);
  int badn = 0;
  for (int i = 0; i < N; i++) {
    uint64_t j = off + (uint64_t)i;
    uint32_t w[4];
    kc_philox_block(seed, j >> 2, w);
    double z[4];
    kcm_box_muller(w[0], w[1], &z[0], &z[1]);
    kcm_box_muller(w[2], w[3], &z[2], &z[3]);
    double v = mean + sd * z[j & 3];
    double rel = fabs(v - n_cpu[i]) / (fabs(n_cpu[i]) + 1e-300);
    if (rel > maxrel) maxrel = rel;
    if (!close_rel(v, n_cpu[i], 1e-14, 1e-14)) badn++;
  }
  CHECK(badn == 0, "normal f64 differs from kc_random_run in %d elements (max rel %.3g)", badn, maxrel);
  /* bernoulli into bool bytes */
  kc_random_run(KC_RNG_BERNOULLI, seed, off, N, (char*)b_cpu, 1, KC_BOOL, 0.3, 0.0);
  int badb = 0;
  for (int i = 0; i < N; i++)
    if ((kcm_u01(word_at(seed, off + (uint64_t)i)) < 0.3) != b_cpu[i]) badb++;
  CHECK(badb == 0, "bernoulli differs from kc_random_run in %d elements", badb);
}

/* ---------------------------------------------------------------- unary / binary */
static void test_unary(void) {
  enum { N = 4001 };
  static double xd[N], yd[N], gd[N], gid[N];
  static float yf[N], gf[N], gif[N];
  for (int i = 0; i < N; i++) {
    xd[i] = i < 8 ? (double[]){0.0, -0.0, 1.0, -1.0, 20.0, -20.0, 1e-8, -9.5}[i] : rndn(4.0);
    gd[i] = rndn(1.0);
    gf[i] = (float)gd[i];
  }
  static const char* names[] = {"neg", "exp", "log", "sqrt", "rsqrt", "abs", "tanh", "sigmoid", "relu",
                                "gelu", "gelu_tanh", "silu", "clamp", "leaky_relu", "elu", "hardtanh", "softplus"};
  _Static_assert(sizeof names / sizeof names[0] == KCM_NUM_UNARY, "one name per unary op");
  for (int op = 0; op < KCM_NUM_UNARY; op++) {
    /* parameters: clamp/hardtanh bounds, leaky_relu slope, elu alpha, softplus beta and threshold */
    double p0 = NAN, p1 = NAN;
    if (op == KCM_CLAMP || op == KCM_HARDTANH) { p0 = -0.75; p1 = 1.5; }
    if (op == KCM_LEAKY_RELU) p0 = 0.05;
    if (op == KCM_ELU) p0 = 0.7;
    if (op == KCM_SOFTPLUS) { p0 = 1.5; p1 = 4.0; }
    int positive = op == KCM_LOG || op == KCM_SQRT || op == KCM_RSQRT;
    static double xs[N];
    static float xsf[N];
    for (int i = 0; i < N; i++) { xs[i] = positive ? fabs(xd[i]) + 1e-3 : xd[i]; xsf[i] = (float)xs[i]; }
    kc_unary_row(op, KC_F64, N, (char*)yd, 8, (const char*)xs, 8, p0, p1);
    kc_unary_row(op, KC_F32, N, (char*)yf, 4, (const char*)xsf, 4, p0, p1);
    int bad64 = 0, bad32 = 0;
    for (int i = 0; i < N; i++) {
      double lo = p0 != p0 ? -INFINITY : p0, hi = p1 != p1 ? INFINITY : p1;
      if (!close_rel(kcm_unary_f64(op, xs[i], lo, hi), yd[i], 1e-14, 1e-300)) bad64++;
      if (!close_rel(kcm_unary_f32(op, xsf[i], (float)lo, (float)hi), yf[i], 4e-6, 1e-7)) bad32++;
    }
    CHECK(bad64 == 0, "unary %s f64: %d elements differ from kc_unary_row", names[op], bad64);
    CHECK(bad32 == 0, "unary %s f32: %d elements differ from kc_unary_row", names[op], bad32);
    kc_unary_grad_row(op, KC_F64, N, (char*)gid, 8, (const char*)gd, 8, (const char*)xs, 8, (const char*)yd, 8, p0, p1);
    kc_unary_grad_row(op, KC_F32, N, (char*)gif, 4, (const char*)gf, 4, (const char*)xsf, 4, (const char*)yf, 4, p0,
                      p1);
    bad64 = bad32 = 0;
    for (int i = 0; i < N; i++) {
      double lo = p0 != p0 ? -INFINITY : p0, hi = p1 != p1 ? INFINITY : p1;
      if (!close_rel(kcm_unary_grad_f64(op, gd[i], xs[i], yd[i], lo, hi), gid[i], 1e-13, 1e-300)) bad64++;
      if (!close_rel(kcm_unary_grad_f32(op, gf[i], xsf[i], yf[i], (float)lo, (float)hi), gif[i], 2e-5, 1e-6)) bad32++;
    }
    CHECK(bad64 == 0, "unary grad %s f64: %d elements differ from kc_unary_grad_row", names[op], bad64);
    CHECK(bad32 == 0, "unary grad %s f32: %d elements differ from kc_unary_grad_row", names[op], bad32);
  }
  /* NaN stays NaN through relu and clamp */
  CHECK(isnan(kcm_unary_f32(KCM_RELU, NAN, 0, 0)) && isnan(kcm_unary_f32(KCM_CLAMP, NAN, -1, 1)),
        "relu / clamp keep NaN");
}

static void test_binary(void) {
  enum { N = 1000 };
  static float a[N], b[N], o[N];
  static double ad[N], bd[N], od[N];
  static int64_t ai[N], bi[N], oi[N];
  for (int i = 0; i < N; i++) {
    a[i] = (float)rndn(3.0); b[i] = (float)rndn(3.0);
    if (i == 5) a[i] = NAN;
    if (i == 6) b[i] = NAN;
    ad[i] = a[i]; bd[i] = b[i];
    ai[i] = (int64_t)(rnd32() % 2001) - 1000; bi[i] = (int64_t)(rnd32() % 41) - 20;
  }
  for (int op = 0; op < KCM_NUM_BINARY; op++) {
    kc_binary_row(op, KC_F32, N, (char*)o, 4, (const char*)a, 4, (const char*)b, 4);
    kc_binary_row(op, KC_F64, N, (char*)od, 8, (const char*)ad, 8, (const char*)bd, 8);
    int bad = 0, badd = 0, badi = 0;
    for (int i = 0; i < N; i++) {
      if (!same_f32(kcm_binary_f32(op, a[i], b[i]), o[i])) bad++;
      double r = kcm_binary_f64(op, ad[i], bd[i]);
      if (!(memcmp(&r, &od[i], 8) == 0 || (r != r && od[i] != od[i]))) badd++;
    }
    if (op != KCM_POW) {
      kc_binary_row(op, KC_I64, N, (char*)oi, 8, (const char*)ai, 8, (const char*)bi, 8);
      for (int i = 0; i < N; i++)
        if (kcm_binary_i64(op, ai[i], bi[i]) != oi[i]) badi++;
    }
    CHECK(bad == 0 && badd == 0 && badi == 0, "binary op %d: %d f32, %d f64, %d i64 elements differ", op, bad, badd,
          badi);
  }
}

/* ---------------------------------------------------------------- AdamW */
static void test_adamw(void) {
  enum { N = 777 };
  static float p0[N], g[N], m0[N], v0[N], pc[N], mc[N], vc[N];
  static double pd[N], gd[N], md[N], vd[N], pdc[N], mdc[N], vdc[N];
  static uint16_t pb[N], pbc[N];
  static float mb[N], vb[N], mbc[N], vbc[N];
  const double betas1[2] = {0.9, 0.3};
  for (int bi = 0; bi < 2; bi++) {
    for (int i = 0; i < N; i++) {
      p0[i] = (float)rndn(1.0); g[i] = (float)rndn(0.1); m0[i] = (float)rndn(0.01); v0[i] = (float)fabs(rndn(1e-3));
      pc[i] = p0[i]; mc[i] = m0[i]; vc[i] = v0[i];
      pd[i] = pdc[i] = p0[i]; gd[i] = g[i]; md[i] = mdc[i] = m0[i]; vd[i] = vdc[i] = v0[i];
      pb[i] = pbc[i] = kc_f32_to_bf16(p0[i]); mb[i] = mbc[i] = m0[i]; vb[i] = vbc[i] = v0[i];
    }
    double lr = 3e-3, b1 = betas1[bi], b2 = 0.999, eps = 1e-8, wd = 0.1;
    int bad = 0, badd = 0, badb = 0;
    for (int64_t step = 1; step <= 5; step++) {
      double bc1 = 1.0 - pow(b1, (double)step), bc2 = 1.0 - pow(b2, (double)step);
      kc_adamw_args a32 = {lr, b1, b2, eps, wd, lr / bc1, sqrt(bc2), KC_F32, KC_F32, KC_F32};
      kc_adamw_row(&a32, N, (char*)pc, 4, (const char*)g, 4, (char*)mc, 4, (char*)vc, 4);
      kc_adamw_args a64 = {lr, b1, b2, eps, wd, lr / bc1, sqrt(bc2), KC_F64, KC_F64, KC_F64};
      kc_adamw_row(&a64, N, (char*)pdc, 8, (const char*)gd, 8, (char*)mdc, 8, (char*)vdc, 8);
      kc_adamw_args ab = {lr, b1, b2, eps, wd, lr / bc1, sqrt(bc2), KC_BF16, KC_F32, KC_F32};
      kc_adamw_row(&ab, N, (char*)pbc, 2, (const char*)g, 4, (char*)mbc, 4, (char*)vbc, 4);
      kcm_adamw_f32c c = kcm_adamw_consts_f32(lr, b1, b2, eps, wd, step);
      kcm_adamw_f64c cd = kcm_adamw_consts_f64(lr, b1, b2, eps, wd, step);
      for (int i = 0; i < N; i++) {
        kcm_adamw_f32(&c, &p0[i], g[i], &m0[i], &v0[i]);
        kcm_adamw_f64(&cd, &pd[i], gd[i], &md[i], &vd[i]);
        float pf = kcm_bf16_to_f32(pb[i]);
        kcm_adamw_f32(&c, &pf, g[i], &mb[i], &vb[i]);
        pb[i] = kcm_f32_to_bf16(pf);
      }
    }
    for (int i = 0; i < N; i++) {
      if (!close_rel(p0[i], pc[i], 1e-6, 1e-9) || !close_rel(m0[i], mc[i], 1e-6, 1e-12) ||
          !close_rel(v0[i], vc[i], 1e-6, 1e-15))
        bad++;
      if (!close_rel(pd[i], pdc[i], 1e-14, 1e-300) || !close_rel(md[i], mdc[i], 1e-14, 1e-300) ||
          !close_rel(vd[i], vdc[i], 1e-14, 1e-300))
        badd++;
      if (abs((int)pb[i] - (int)pbc[i]) > 1 || !close_rel(mb[i], mbc[i], 1e-6, 1e-12)) badb++;
    }
    CHECK(bad == 0, "AdamW f32 (beta1 %g): %d elements differ from kc_adamw_row", b1, bad);
    CHECK(badd == 0, "AdamW f64 (beta1 %g): %d elements differ from kc_adamw_row", b1, badd);
    CHECK(badb == 0, "AdamW bf16 params (beta1 %g): %d elements differ from kc_adamw_row", b1, badb);
  }
  CHECK(kcm_clip_coef(10.0, 1.0) < 0.1 && kcm_clip_coef(0.5, 1.0) == 1.0 && isnan(kcm_clip_coef(NAN, 1.0)),
        "clip coefficient clamps to 1 and keeps NaN");
}

/* Master weights (optim.cu's adamw_vec_kernel with a bf16 copy, against the CPU path kc_adamw_master_row):
 * per element kcm_adamw_f32 on the f32 master from a bf16 gradient, then the copy rounded to bf16; and the
 * kernel's index split (4-element vectors from the chunk start up to vend, then a scalar tail) visits every
 * element of every chunk exactly once, for sizes around the vector width and the chunk size. */
static void test_adamw_master(void) {
  enum { N = 1001 };
  static float w[N], wc[N], m[N], mc[N], v[N], vc[N];
  static uint16_t g[N], pb[N], pbc[N];
  for (int i = 0; i < N; i++) {
    w[i] = wc[i] = (float)rndn(1.0); g[i] = kc_f32_to_bf16((float)rndn(0.1));
    m[i] = mc[i] = (float)rndn(0.01); v[i] = vc[i] = (float)fabs(rndn(1e-3));
    pb[i] = pbc[i] = kc_f32_to_bf16(w[i]);
  }
  double lr = 1e-4, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  for (int64_t step = 1; step <= 20; step++) {
    double bc1 = 1.0 - pow(b1, (double)step), bc2 = 1.0 - pow(b2, (double)step);
    kc_adamw_args a = {lr, b1, b2, eps, wd, lr / bc1, sqrt(bc2), KC_BF16, KC_BF16, KC_F32};
    kc_adamw_master_row(&a, N, (char*)wc, 4, (const char*)g, 2, (char*)mc, 4, (char*)vc, 4, (char*)pbc, 2);
    kcm_adamw_f32c c = kcm_adamw_consts_f32(lr, b1, b2, eps, wd, step);
    for (int i = 0; i < N; i++) {
      kcm_adamw_f32(&c, &w[i], kcm_bf16_to_f32(g[i]), &m[i], &v[i]);
      pb[i] = kcm_f32_to_bf16(w[i]);
    }
  }
  int bad = 0, badc = 0;
  for (int i = 0; i < N; i++) {
    /* 20 steps: the compilers contract different products into FMAs, about an f32 ulp per step */
    if (!close_rel(w[i], wc[i], 5e-6, 1e-9) || !close_rel(m[i], mc[i], 1e-6, 1e-12) ||
        !close_rel(v[i], vc[i], 2e-6, 1e-15))
      bad++;
    if (pbc[i] != kc_f32_to_bf16(wc[i]) || abs((int)pb[i] - (int)pbc[i]) > 1) badc++;
  }
  CHECK(bad == 0, "AdamW master weights: %d elements differ from kc_adamw_master_row", bad);
  CHECK(badc == 0, "AdamW master weights: %d bf16 copies are not the rounded master", badc);
  /* index split of adamw_vec_kernel: kChunk 65536, 512 threads */
  const int64_t chunk = 65536, threads = 512;
  const int64_t sizes[] = {1, 3, 4, 5, 7, 2047, 2048, 2049, 65535, 65536, 65537, 131075};
  static unsigned char seen[131075];
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    int64_t n = sizes[k];
    memset(seen, 0, sizeof seen);
    for (int64_t start = 0; start < n; start += chunk) {
      int64_t end = start + chunk < n ? start + chunk : n, vend = start + ((end - start) & ~(int64_t)3);
      for (int64_t t = 0; t < threads; t++) {
        for (int64_t i = start + 4 * t; i < vend; i += 4 * threads)
          for (int q = 0; q < 4; q++) seen[i + q]++;
        for (int64_t i = vend + t; i < end; i += threads) seen[i]++;
      }
    }
    int wrong = 0;
    for (int64_t i = 0; i < n; i++) wrong += seen[i] != 1;
    CHECK(wrong == 0, "adamw_vec_kernel index split, n = %lld: %d elements not visited exactly once", (long long)n,
          wrong);
  }
}

/* ---------------------------------------------------------------- softmax pieces */
/* kcm_lse_add_n (the classifier forward's vector update): 8 values at a time per "thread", 5 threads merged, against
 * float64 and against kcm_lse_add element by element; rows of large logits, -inf runs, NaN and +inf. */
static double lse_rows_n(const float* x, int C, int by_vec) {
  float m[5], s[5];
  for (int t = 0; t < 5; t++) { m[t] = -INFINITY; s[t] = 0; }
  for (int j = 0; j < C; j += 8) {
    int t = (j / 8) % 5, n = C - j < 8 ? C - j : 8;
    if (by_vec && n == 8) kcm_lse_add_n(&m[t], &s[t], x + j, 8);
    else for (int k = 0; k < n; k++) kcm_lse_add(&m[t], &s[t], x[j + k]);
  }
  float mm = -INFINITY, ss = 0;
  for (int t = 0; t < 5; t++) kcm_lse_merge(&mm, &ss, m[t], s[t]);
  return (double)(mm + logf(ss));
}

static void test_lse_n(void) {
  enum { C = 50304 + 5 };
  static float x[C];
  int bad = 0;
  double worst = 0;
  for (int row = 0; row < 12; row++) {
    double scale = row < 4 ? 3.0 : (row < 8 ? 15.0 : 40.0);
    for (int i = 0; i < C; i++) x[i] = (float)rndn(scale) + (row % 3 == 1 ? 30.0f : 0.0f);
    if (row % 4 == 2) for (int i = 0; i < 100; i++) x[i] = -INFINITY;    /* a -inf run first */
    if (row % 4 == 3) x[C / 2] = (float)(scale * 12.0);                   /* one dominant logit late */
    double mx = -INFINITY, sum = 0;
    for (int i = 0; i < C; i++) mx = x[i] > mx ? x[i] : mx;
    for (int i = 0; i < C; i++) sum += exp((double)x[i] - mx);
    double ref = mx + log(sum), got = lse_rows_n(x, C, 1), el = lse_rows_n(x, C, 0);
    double e = fabs(got - ref) / (fabs(ref) + 1.0);
    if (e > worst) worst = e;
    if (!(e < 2e-6) || !(fabs(got - el) < 2e-6 * (fabs(ref) + 1.0))) bad++;
  }
  CHECK(bad == 0, "vector logsumexp off float64 or the element-wise update (worst relative %g)", worst);
  float v[8] = {1, 2, 3, -INFINITY, 4, 5, 6, 7}, m = -INFINITY, sm = 0;
  kcm_lse_add_n(&m, &sm, v, 8);
  double r = 0;
  for (int k = 0; k < 8; k++) if (k != 3) r += exp(v[k] - 7.0);
  CHECK(m == 7.0f && fabs(sm - r) < 1e-6 * r, "one vector: (m, s) = (%g, %g), want (7, %g)", m, sm, r);
  float ninf[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
  m = -INFINITY; sm = 0;
  kcm_lse_add_n(&m, &sm, ninf, 8);
  CHECK(m == -INFINITY && sm == 0.0f, "all -inf keeps s = 0 (%g, %g)", m, sm);
  kcm_lse_add_n(&m, &sm, v, 8);
  CHECK(m == 7.0f && fabs(sm - r) < 1e-6 * r, "-inf vector then finite");
  v[5] = NAN;
  kcm_lse_add_n(&m, &sm, v, 8);
  v[5] = 5;
  kcm_lse_add_n(&m, &sm, v, 8);
  CHECK(isnan(m + logf(sm)), "NaN poisons the row, also after more finite vectors");
  m = -INFINITY; sm = 0;
  v[2] = INFINITY;
  kcm_lse_add_n(&m, &sm, v, 8);
  v[2] = 3;
  kcm_lse_add_n(&m, &sm, v, 8);
  CHECK(m == INFINITY && m + logf(sm) == INFINITY, "+inf gives lse = +inf (%g, %g)", m, sm);
}

static void test_lse(void) {
  enum { C = 1000 };
  static double x[C];
  for (int i = 0; i < C; i++) x[i] = rndn(5.0);
  x[3] = -INFINITY;
  /* 7 "threads" each taking every 7th element, then merged (as the kernels) */
  float m[7], s[7];
  for (int t = 0; t < 7; t++) { m[t] = -INFINITY; s[t] = 0; }
  for (int i = 0; i < C; i++) kcm_lse_add(&m[i % 7], &s[i % 7], (float)x[i]);
  float mm = -INFINITY, ss = 0;
  for (int t = 0; t < 7; t++) kcm_lse_merge(&mm, &ss, m[t], s[t]);
  double mx = -INFINITY, sum = 0;
  for (int i = 0; i < C; i++) mx = x[i] > mx ? x[i] : mx;
  for (int i = 0; i < C; i++) sum += exp(x[i] - mx);
  double ref = mx + log(sum);
  CHECK(fabs((double)(mm + logf(ss)) - ref) < 1e-5 * fabs(ref) + 1e-5, "online logsumexp %.7g vs %.7g",
        (double)(mm + logf(ss)), ref);
  double md = -INFINITY, sd = 0;
  for (int i = 0; i < C; i++) kcm_lse_add_f64(&md, &sd, x[i]);
  CHECK(fabs(md + log(sd) - ref) < 1e-12 * fabs(ref), "online logsumexp f64");
  /* -inf first, then finite; a NaN poisons; all -inf gives s = 0 */
  float a = -INFINITY, b = 0;
  kcm_lse_add(&a, &b, -INFINITY);
  kcm_lse_add(&a, &b, 1.0f);
  CHECK(a == 1.0f && b == 1.0f, "-inf then 1: (m, s) = (%g, %g)", a, b);
  kcm_lse_add(&a, &b, NAN);
  CHECK(isnan(a + logf(b)), "NaN poisons the row");
  a = -INFINITY; b = 0;
  kcm_lse_add(&a, &b, -INFINITY);
  CHECK(a == -INFINITY && b == 0.0f, "all -inf keeps s = 0");
  test_lse_n();
}

static void test_cross_entropy(void) {
  enum { N = 6, C = 37 };
  static double x[N * C], loss[N], lse[N], gx[N * C];
  int64_t tgt[N] = {0, 36, 5, -100, 17, 2};
  for (int i = 0; i < N * C; i++) x[i] = rndn(2.0);
  double eps = 0.1;
  kc_cross_entropy_f64(N, C, 1, x, tgt, -100, eps, loss, lse);
  kc_cross_entropy_bw_f64(N, C, 1, x, tgt, -100, eps, lse, NULL, 0.5, gx);
  int bad = 0, badg = 0;
  for (int n = 0; n < N; n++) {
    if (tgt[n] == -100) continue;
    float m = -INFINITY, s = 0, sx = 0;
    for (int c = 0; c < C; c++) { kcm_lse_add(&m, &s, (float)x[n * C + c]); sx += (float)x[n * C + c]; }
    float l = m + logf(s);
    float lv = kcm_ce_loss(l, (float)x[n * C + tgt[n]], sx, (float)eps, 1.0f / C);
    if (!close_rel(lv, loss[n], 1e-5, 1e-5)) bad++;
    for (int c = 0; c < C; c++) {
      double gv = kcm_ce_grad_f64(x[n * C + c], lse[n], c == tgt[n], eps, 1.0 / C, 0.5);
      if (!close_rel(gv, gx[n * C + c], 1e-12, 1e-15)) badg++;
    }
  }
  CHECK(bad == 0, "cross entropy loss: %d rows differ from kc_cross_entropy_f64", bad);
  CHECK(badg == 0, "cross entropy grad: %d elements differ from kc_cross_entropy_bw_f64", badg);
}

static void test_norm(void) {
  enum { M = 5, NN = 33 };
  static double x[M * NN], w[NN], b[NN], y[M * NN], go[M * NN], dx[M * NN], dw[NN], db[NN];
  static double mean[M], rstd[M];
  for (int i = 0; i < M * NN; i++) { x[i] = rndn(2.0) + 3.0; go[i] = rndn(1.0); }
  for (int j = 0; j < NN; j++) { w[j] = 1.0 + rndn(0.2); b[j] = rndn(0.2); }
  for (int rms = 0; rms < 2; rms++) {
    kc_norm_fwd(KC_F64, rms, M, NN, x, w, b, 1e-5, y, mean, rstd);
    memset(dw, 0, sizeof dw); memset(db, 0, sizeof db);
    kc_norm_bwd(KC_F64, rms, M, NN, go, x, w, mean, rstd, dx, dw, db);
    int bad = 0;
    for (int r = 0; r < M; r++) {
      double mu = rms ? 0.0 : mean[r], rs = rstd[r], sa = 0, sb = 0;
      for (int j = 0; j < NN; j++) {
        double wdy = go[r * NN + j] * w[j], xh = (x[r * NN + j] - mu) * rs;
        sa += wdy; sb += wdy * xh;
      }
      for (int j = 0; j < NN; j++) {
        double wdy = go[r * NN + j] * w[j], xh = (x[r * NN + j] - mu) * rs;
        double v = kcm_norm_dx_f64(rms, wdy, xh, rs, sa / NN, sb / NN);
        if (!close_rel(v, dx[r * NN + j], 1e-9, 1e-12)) bad++;
        float vf = kcm_norm_dx(rms, (float)wdy, (float)xh, (float)rs, (float)(sa / NN), (float)(sb / NN));
        if (!close_rel(vf, dx[r * NN + j], 1e-4, 1e-5)) bad++;
      }
    }
    CHECK(bad == 0, "%s dx: %d elements differ from kc_norm_bwd", rms ? "rms_norm" : "layer_norm", bad);
  }
}

int main(void) {
  test_halves();
  test_dropout();
  test_random();
  test_unary();
  test_binary();
  test_adamw();
  test_adamw_master();
  test_lse();
  test_cross_entropy();
  test_norm();
  printf("%d passed, %d failed\n", g_pass, g_fail);
  return g_fail ? 1 : 0;
}
