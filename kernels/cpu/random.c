/* random.c: runs of counter-based random numbers (see philox.h for the
 * addressing scheme) and the dropout mask kernel.
 *
 * A run [j0, j0 + n) of stream positions is produced in chunks of up to CH
 * Philox blocks: the blocks of a chunk are computed together (structure of
 * arrays, so the compiler vectorizes the rounds), then each element is
 * transformed from its own word(s).  Every element goes through the same
 * arithmetic wherever it falls in a chunk, so values depend only on
 * (seed, position), never on how a tensor is split into runs. */
#include "kcpu.h"
#include "philox.h"
#include <string.h>

#define CH 64 /* blocks per chunk (256 words) */

/* words[4 i + w] = word w of block b0 + i, for i < nb: the word of stream
 * position p is words[p - 4 b0].  Same arithmetic as kc_philox4x32_10. */
static void philox_words(uint64_t seed, uint64_t b0, int nb, uint32_t* restrict words) {
  uint32_t c0[CH], c1[CH], c2[CH], c3[CH];
  for (int i = 0; i < nb; i++) {
    uint64_t b = b0 + (uint64_t)i;
    c0[i] = (uint32_t)b; c1[i] = (uint32_t)(b >> 32); c2[i] = 0; c3[i] = 0;
  }
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  for (int r = 0; r < 10; r++) {
    for (int i = 0; i < nb; i++) {
      uint64_t p0 = (uint64_t)KC_PHILOX_M0 * c0[i];
      uint64_t p1 = (uint64_t)KC_PHILOX_M1 * c2[i];
      uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1[i] ^ k0;
      uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3[i] ^ k1;
      c1[i] = (uint32_t)p1; c3[i] = (uint32_t)p0;
      c0[i] = n0; c2[i] = n2;
    }
    k0 += KC_PHILOX_W0; k1 += KC_PHILOX_W1;
  }
  for (int i = 0; i < nb; i++) {
    words[4 * i] = c0[i]; words[4 * i + 1] = c1[i]; words[4 * i + 2] = c2[i]; words[4 * i + 3] = c3[i];
  }
}

/* Calls fn(words, k0, k1, i0, ctx) for each chunk: elements k0..k1-1 of
 * words belong to run elements i0, i0 + 1, ... */
typedef void (*chunk_fn)(const uint32_t* words, int k0, int k1, int64_t i0, void* ctx);

static void for_chunks(uint64_t seed, uint64_t j0, int64_t n, chunk_fn fn, void* ctx) {
  uint32_t words[4 * CH];
  uint64_t j = j0, end = j0 + (uint64_t)n;
  while (j < end) {
    uint64_t b0 = j >> 2, bend = ((end - 1) >> 2) + 1;
    int nb = bend - b0 < CH ? (int)(bend - b0) : CH;
    philox_words(seed, b0, nb, words);
    uint64_t base = b0 << 2;
    uint64_t hi = end < base + 4 * (uint64_t)nb ? end : base + 4 * (uint64_t)nb;
    fn(words, (int)(j - base), (int)(hi - base), (int64_t)(j - j0), ctx);
    j = hi;
  }
}

#define U01(w) ((double)(w) * (1.0 / 4294967296.0))

typedef struct { int kind, dt; char* dst; int64_t stride; double a, b; } run_ctx;

static void uniform_chunk(const uint32_t* w, int k0, int k1, int64_t i0, void* vc) {
  run_ctx* c = vc;
  const double a = c->a, range = c->b - c->a, b = c->b;
  const int open = b > a; /* rounding must not reach the open bound b */
  char* out = c->dst + i0 * c->stride;
  int64_t s = c->stride;
  if (c->dt == KC_F32) {
    const float fa = (float)a;
    if (s == 4) {
      float* restrict o = (float*)out;
      for (int k = k0; k < k1; k++) {
        float f = (float)(a + range * U01(w[k]));
        o[k - k0] = (open && (double)f >= b) ? fa : f;
      }
    } else {
      for (int k = k0; k < k1; k++) {
        float f = (float)(a + range * U01(w[k]));
        *(float*)(out + (k - k0) * s) = (open && (double)f >= b) ? fa : f;
      }
    }
  } else if (c->dt == KC_F64) {
    for (int k = k0; k < k1; k++) {
      double v = a + range * U01(w[k]);
      *(double*)(out + (k - k0) * s) = (open && v >= b) ? a : v;
    }
  } else {
    for (int k = k0; k < k1; k++) {
      char* p = out + (k - k0) * s;
      kc_store(p, c->dt, a + range * U01(w[k]));
      if (open && kc_load(p, c->dt) >= b) kc_store(p, c->dt, a);
    }
  }
}

static void bernoulli_chunk(const uint32_t* w, int k0, int k1, int64_t i0, void* vc) {
  run_ctx* c = vc;
  char* out = c->dst + i0 * c->stride;
  for (int k = k0; k < k1; k++) kc_store(out + (k - k0) * c->stride, c->dt, U01(w[k]) < c->a ? 1.0 : 0.0);
}

/* Box-Muller on a word pair: z0 = r cos(theta), z1 = r sin(theta) with
 * r = sqrt(-2 ln u1), u1 = (w0 + 1) 2^-32, theta = 2 pi w1 2^-32.
 * Branch-free polynomial log and sincos (accurate to a few ulp) written with
 * integer bit tricks only, so the compiler vectorizes a chunk, and every
 * element gets identical arithmetic wherever it falls:
 *   ln u1: u1 = m 2^e with m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(s),
 *          s = (m - 1)/(m + 1), |s| < 0.172 (series to s^21).
 *   theta: t = w1 2^-32 is reduced exactly to x = 2 pi (t - q/4), q = round(4t),
 *          |x| <= pi/4 (Taylor series to x^17 / x^18), then rotated by q.
 * The first pass stores -2 ln u1 and (cos, sin); the sqrt runs in a second,
 * scalar pass (a vectorized sqrt would need -fno-math-errno). */
static inline double bm_u2d(uint64_t u) { double d; memcpy(&d, &u, 8); return d; }
static inline uint64_t bm_d2u(double d) { uint64_t u; memcpy(&u, &d, 8); return u; }
#define BM_TWO52 4503599627370496.0
#define BM_MAGIC 0x4330000000000000ull /* 2^52 as a double: u2d(MAGIC | k) - 2^52 = k */

static void box_muller_pass(const uint32_t* restrict w, int p0, int p1, double* restrict v,
                            double* restrict cs, double* restrict sn) {
  for (int pr = p0; pr < p1; pr++) {
    /* ln((w0 + 1) 2^-32) */
    double d = bm_u2d((uint64_t)w[2 * pr] | BM_MAGIC) - BM_TWO52 + 1.0; /* exact, in [1, 2^32] */
    uint64_t bits = bm_d2u(d);
    uint64_t mant = bits & 0x000FFFFFFFFFFFFFull;
    uint64_t big = (mant + (0x000FFFFFFFFFFFFFull - 0x6A09E667F3BCDull)) >> 52; /* m > sqrt(2) */
    double e = bm_u2d(((bits >> 52) + big) | BM_MAGIC) - BM_TWO52 - (1023.0 + 32.0);
    double m = bm_u2d(mant | ((0x3FFull - big) << 52));
    double s = (m - 1.0) / (m + 1.0), s2 = s * s;
    double p = 1.0 / 21;
    p = p * s2 + 1.0 / 19; p = p * s2 + 1.0 / 17; p = p * s2 + 1.0 / 15; p = p * s2 + 1.0 / 13;
    p = p * s2 + 1.0 / 11; p = p * s2 + 1.0 / 9; p = p * s2 + 1.0 / 7; p = p * s2 + 1.0 / 5;
    p = p * s2 + 1.0 / 3; p = p * s2 + 1.0;
    double ln = e * 6.93147180369123816490e-01 + (e * 1.90821492927058770002e-10 + 2.0 * s * p);
    v[pr] = -2.0 * ln;
    /* cos and sin of 2 pi t */
    double t = (bm_u2d((uint64_t)w[2 * pr + 1] | BM_MAGIC) - BM_TWO52) * (1.0 / 4294967296.0);
    double q = nearbyint(t * 4.0);
    double x = (t - q * 0.25) * 6.283185307179586476925286766559, x2 = x * x;
    double sp = 1.0 / 355687428096000.0; /* 1/17! */
    sp = sp * -x2 + 1.0 / 1307674368000.0; sp = sp * -x2 + 1.0 / 6227020800.0; sp = sp * -x2 + 1.0 / 39916800.0;
    sp = sp * -x2 + 1.0 / 362880.0; sp = sp * -x2 + 1.0 / 5040.0; sp = sp * -x2 + 1.0 / 120.0;
    sp = sp * -x2 + 1.0 / 6.0; sp = sp * -x2 + 1.0;
    double sx = x * sp;
    double cp = 1.0 / 6402373705728000.0; /* 1/18! */
    cp = cp * -x2 + 1.0 / 20922789888000.0; cp = cp * -x2 + 1.0 / 87178291200.0; cp = cp * -x2 + 1.0 / 479001600.0;
    cp = cp * -x2 + 1.0 / 3628800.0; cp = cp * -x2 + 1.0 / 40320.0; cp = cp * -x2 + 1.0 / 720.0;
    cp = cp * -x2 + 1.0 / 24.0; cp = cp * -x2 + 0.5; cp = cp * -x2 + 1.0;
    /* theta = x + q pi/2: rotate (cos x, sin x) by q quarter turns */
    uint64_t qi = bm_d2u(q + BM_TWO52);
    double c1 = (qi & 1) ? sx : cp, s1 = (qi & 1) ? cp : sx;
    cs[pr] = ((qi + 1) & 2) ? -c1 : c1;
    sn[pr] = (qi & 2) ? -s1 : s1;
  }
}

static void normal_chunk(const uint32_t* w, int k0, int k1, int64_t i0, void* vc) {
  run_ctx* c = vc;
  double v[2 * CH], cs[2 * CH], sn[2 * CH], z[4 * CH];
  int p0 = k0 >> 1, p1 = (k1 + 1) >> 1;
  box_muller_pass(w, p0, p1, v, cs, sn);
  for (int pr = p0; pr < p1; pr++) {
    double r = sqrt(v[pr]);
    z[2 * pr] = r * cs[pr];
    z[2 * pr + 1] = r * sn[pr];
  }
  const double a = c->a, b = c->b;
  char* out = c->dst + i0 * c->stride;
  int64_t s = c->stride;
  if (c->dt == KC_F32) for (int k = k0; k < k1; k++) *(float*)(out + (k - k0) * s) = (float)(a + b * z[k]);
  else if (c->dt == KC_F64) for (int k = k0; k < k1; k++) *(double*)(out + (k - k0) * s) = a + b * z[k];
  else for (int k = k0; k < k1; k++) kc_store(out + (k - k0) * s, c->dt, a + b * z[k]);
}

void kc_random_run(int kind, uint64_t seed, uint64_t j0, int64_t n, char* dst, int64_t stride, int dt,
                   double a, double b) {
  run_ctx c = {kind, dt, dst, stride, a, b};
  for_chunks(seed, j0, n, kind == KC_RNG_UNIFORM ? uniform_chunk : kind == KC_RNG_NORMAL ? normal_chunk : bernoulli_chunk,
             &c);
}

typedef struct { double thr; const char* x; int64_t sx; char* y; int64_t sy; double scale; int dt; } drop_ctx;

/* keep iff u < keep  <=>  (double)w < keep * 2^32 (exact: a power-of-two scale). */
static void dropout_chunk(const uint32_t* w, int k0, int k1, int64_t i0, void* vc) {
  drop_ctx* c = vc;
  const double thr = c->thr;
  const char* x = c->x + i0 * c->sx;
  char* y = c->y + i0 * c->sy;
  if (c->dt == KC_F32) {
    const float s = (float)c->scale;
    if (c->sx == 4 && c->sy == 4) {
      const float* restrict X = (const float*)x;
      float* restrict Y = (float*)y;
      for (int k = k0; k < k1; k++) Y[k - k0] = X[k - k0] * ((double)w[k] < thr ? s : 0.0f);
    } else {
      for (int k = k0; k < k1; k++)
        *(float*)(y + (k - k0) * c->sy) = *(const float*)(x + (k - k0) * c->sx) * ((double)w[k] < thr ? s : 0.0f);
    }
  } else if (c->dt == KC_F64) {
    for (int k = k0; k < k1; k++)
      *(double*)(y + (k - k0) * c->sy) = *(const double*)(x + (k - k0) * c->sx) * ((double)w[k] < thr ? c->scale : 0.0);
  } else {
    const float s = (float)c->scale;
    for (int k = k0; k < k1; k++)
      kc_store(y + (k - k0) * c->sy, c->dt,
               (double)((float)kc_load(x + (k - k0) * c->sx, c->dt) * ((double)w[k] < thr ? s : 0.0f)));
  }
}

void kc_dropout_run(uint64_t seed, uint64_t j0, int64_t n, double keep, double scale, const char* x,
                    int64_t sx, char* y, int64_t sy, int dt) {
  drop_ctx c = {keep * 4294967296.0, x, sx, y, sy, scale, dt};
  for_chunks(seed, j0, n, dropout_chunk, &c);
}
