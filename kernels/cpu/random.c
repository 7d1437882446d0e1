/* random.c: runs of counter-based random numbers (see philox.h for the
 * addressing scheme) and the dropout mask kernel. */
#include "kcpu.h"
#include "philox.h"

/* Per-run cache of the current Philox block and normal pair. */
typedef struct {
  uint64_t seed, blk_id, pair_id;
  uint32_t blk[4];
  double z[2];
} rng_cursor;

static inline void cur_init(rng_cursor* c, uint64_t seed) {
  c->seed = seed; c->blk_id = UINT64_MAX; c->pair_id = UINT64_MAX;
}

static inline uint32_t cur_word(rng_cursor* c, uint64_t j) {
  uint64_t b = j >> 2;
  if (b != c->blk_id) { kc_philox_block(c->seed, b, c->blk); c->blk_id = b; }
  return c->blk[j & 3];
}

static inline double cur_normal(rng_cursor* c, uint64_t j) {
  uint64_t pr = j >> 1;
  if (pr != c->pair_id) {
    uint64_t b = j >> 2;
    if (b != c->blk_id) { kc_philox_block(c->seed, b, c->blk); c->blk_id = b; }
    int e = (int)(j & 2);
    double u1 = ((double)c->blk[e] + 1.0) * (1.0 / 4294967296.0);
    double u2 = (double)c->blk[e + 1] * (1.0 / 4294967296.0);
    double r = sqrt(-2.0 * log(u1));
    double th = 6.283185307179586476925286766559 * u2;
    c->z[0] = r * cos(th); c->z[1] = r * sin(th);
    c->pair_id = pr;
  }
  return c->z[j & 1];
}

double kc_random_value(int kind, uint64_t seed, uint64_t j, double a, double b) {
  uint32_t blk[4];
  kc_philox_block(seed, j >> 2, blk);
  switch (kind) {
    case KC_RNG_UNIFORM: return a + (b - a) * kc_philox_u01(blk[j & 3]);
    case KC_RNG_NORMAL: return a + b * kc_philox_normal(blk, (int)(j & 3));
    default: return kc_philox_u01(blk[j & 3]) < a ? 1.0 : 0.0;
  }
}

void kc_random_run(int kind, uint64_t seed, uint64_t j0, int64_t n, char* dst, int64_t stride, int dt,
                   double a, double b) {
  rng_cursor c;
  cur_init(&c, seed);
  if (kind == KC_RNG_UNIFORM) {
    double range = b - a;
    if (dt == KC_F32) {
      float fa = (float)a;
      for (int64_t i = 0; i < n; i++) {
        double v = a + range * kc_philox_u01(cur_word(&c, j0 + (uint64_t)i));
        float f = (float)v;
        if ((double)f >= b && b > a) f = fa; /* rounding must not reach the open bound */
        *(float*)(dst + i * stride) = f;
      }
    } else if (dt == KC_F64) {
      for (int64_t i = 0; i < n; i++) {
        double v = a + range * kc_philox_u01(cur_word(&c, j0 + (uint64_t)i));
        if (v >= b && b > a) v = a;
        *(double*)(dst + i * stride) = v;
      }
    } else {
      for (int64_t i = 0; i < n; i++) {
        double v = a + range * kc_philox_u01(cur_word(&c, j0 + (uint64_t)i));
        char* p = dst + i * stride;
        kc_store(p, dt, v);
        if (kc_load(p, dt) >= b && b > a) kc_store(p, dt, a);
      }
    }
  } else if (kind == KC_RNG_NORMAL) {
    if (dt == KC_F32) {
      for (int64_t i = 0; i < n; i++)
        *(float*)(dst + i * stride) = (float)(a + b * cur_normal(&c, j0 + (uint64_t)i));
    } else if (dt == KC_F64) {
      for (int64_t i = 0; i < n; i++)
        *(double*)(dst + i * stride) = a + b * cur_normal(&c, j0 + (uint64_t)i);
    } else {
      for (int64_t i = 0; i < n; i++) kc_store(dst + i * stride, dt, a + b * cur_normal(&c, j0 + (uint64_t)i));
    }
  } else {
    for (int64_t i = 0; i < n; i++) {
      double u = kc_philox_u01(cur_word(&c, j0 + (uint64_t)i));
      kc_store(dst + i * stride, dt, u < a ? 1.0 : 0.0);
    }
  }
}

void kc_dropout_run(uint64_t seed, uint64_t j0, int64_t n, double keep, double scale, const char* x,
                    int64_t sx, char* y, int64_t sy, int dt) {
  rng_cursor c;
  cur_init(&c, seed);
  if (dt == KC_F32) {
    float s = (float)scale;
    for (int64_t i = 0; i < n; i++) {
      int k = kc_philox_u01(cur_word(&c, j0 + (uint64_t)i)) < keep;
      *(float*)(y + i * sy) = *(const float*)(x + i * sx) * (k ? s : 0.0f);
    }
  } else if (dt == KC_F64) {
    for (int64_t i = 0; i < n; i++) {
      int k = kc_philox_u01(cur_word(&c, j0 + (uint64_t)i)) < keep;
      *(double*)(y + i * sy) = *(const double*)(x + i * sx) * (k ? scale : 0.0);
    }
  } else {
    float s = (float)scale;
    for (int64_t i = 0; i < n; i++) {
      int k = kc_philox_u01(cur_word(&c, j0 + (uint64_t)i)) < keep;
      kc_store(y + i * sy, dt, (double)((float)kc_load(x + i * sx, dt) * (k ? s : 0.0f)));
    }
  }
}
