/* kcuda_math.cuh: the per-element formulas of the CUDA kernels, written once
 * for both compilers.  nvcc compiles every function here as
 * __host__ __device__; gcc compiles this file as plain C (KCM_FN is
 * `static inline` there), so spec/c/test_cuda_math.c checks each formula on
 * the CPU against the CPU kernels (kernels/cpu) without a GPU.
 *
 *  - bf16 / f16 <-> f32 conversions, bit-identical to kernels/cpu/half.h
 *    (round to nearest even, same NaN handling);
 *  - the Philox generator itself is kernels/cpu/philox.h, included here with
 *    KC_PHILOX_FN set to KCM_FN: CPU and GPU run the same source;
 *  - uniform / normal transforms and the dropout keep test of the engine's
 *    counter-based RNG (addressing in philox.h), the same arithmetic as
 *    kernels/cpu/random.c: a dropout mask is identical on CPU and GPU for the
 *    same (seed, offset, element index);
 *  - unary functions and derivatives (formulas of kernels/cpu/unary.c, with
 *    libm / CUDA math functions), binary ops;
 *  - the AdamW element update in PyTorch's operation order (kernels/cpu/optim.c);
 *  - online logsumexp merging, cross-entropy and norm gradient elements.
 * Pure C: no engine types, no CUDA types. */
#ifndef KCUDA_MATH_CUH
#define KCUDA_MATH_CUH
#include <stdint.h>
#include <string.h>
#include <math.h>

#ifdef __CUDACC__
#define KCM_FN static __host__ __device__ __forceinline__
#else
#define KCM_FN static inline
#endif

#ifndef KC_PHILOX_FN
#define KC_PHILOX_FN KCM_FN
#endif
#include "../cpu/philox.h"

/* dtype codes (same as eng_dtype / kcpu.h) */
enum { KCM_F32 = 0, KCM_F64, KCM_BF16, KCM_F16, KCM_I32, KCM_I64, KCM_U8, KCM_BOOL };

/* ---------------------------------------------------------------- bit casts */
KCM_FN uint32_t kcm_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
KCM_FN float kcm_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
KCM_FN uint64_t kcm_d2u(double d) { uint64_t u; memcpy(&u, &d, 8); return u; }
KCM_FN double kcm_u2d(uint64_t u) { double d; memcpy(&d, &u, 8); return d; }

/* ---------------------------------------------------------------- half types */
KCM_FN float kcm_bf16_to_f32(uint16_t h) { return kcm_u2f((uint32_t)h << 16); }
KCM_FN uint16_t kcm_f32_to_bf16(float f) {
  uint32_t u = kcm_f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
KCM_FN float kcm_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (uint32_t)(h >> 10) & 0x1f, man = (uint32_t)h & 0x3ff, u;
  if (exp == 0) {
    if (man == 0) u = sign;
    else { /* subnormal: normalize */
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) { man <<= 1; exp--; }
      man &= 0x3ff;
      u = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 31) u = sign | 0x7f800000u | (man << 13);
  else u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  return kcm_u2f(u);
}
KCM_FN uint16_t kcm_f32_to_f16(float f) {
  uint32_t u = kcm_f2u(f);
  uint32_t sign = (u >> 16) & 0x8000; int32_t exp = (int32_t)((u >> 23) & 0xff); uint32_t man = u & 0x7fffff;
  if (exp == 255) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
  int32_t e = exp - 127 + 15;
  if (e >= 31) return (uint16_t)(sign | 0x7c00);
  if (e <= 0) {
    if (e < -10) return (uint16_t)sign;
    man |= 0x800000;
    uint32_t shift = (uint32_t)(14 - e);
    uint32_t half = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) half++;
    return (uint16_t)(sign | half);
  }
  uint32_t half = sign | ((uint32_t)e << 10) | (man >> 13);
  uint32_t rem = man & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) half++;
  return (uint16_t)half;
}

/* ---------------------------------------------------------------- random numbers
 * Stream position j (= offset + row-major element index) uses word j % 4 of
 * Philox block j / 4 (kc_philox_block).  u = word * 2^-32 in [0, 1). */
KCM_FN double kcm_u01(uint32_t w) { return (double)w * (1.0 / 4294967296.0); }
/* Dropout keeps element j iff u_j < keep, i.e. (double)w < keep * 2^32 (exact). */
KCM_FN double kcm_dropout_threshold(double keep) { return keep * 4294967296.0; }
KCM_FN int kcm_dropout_keep(uint32_t w, double threshold) { return (double)w < threshold; }
/* Dropout element in f32 math (f32, bf16, f16 data): x * (keep ? scale : 0). */
KCM_FN float kcm_dropout_f32(float x, uint32_t w, double threshold, float scale) {
  return x * (kcm_dropout_keep(w, threshold) ? scale : 0.0f);
}
KCM_FN double kcm_dropout_f64(double x, uint32_t w, double threshold, double scale) {
  return x * (kcm_dropout_keep(w, threshold) ? scale : 0.0);
}
/* Uniform U[a, b) before rounding to the output dtype: a + (b - a) u.  The
 * caller replaces a rounded value >= b by a when b > a (as random.c does). */
KCM_FN double kcm_uniform(uint32_t w, double a, double range) { return a + range * kcm_u01(w); }

/* Box-Muller on the word pair (w0, w1) of a Philox block: z0 = r cos(theta),
 * z1 = r sin(theta), r = sqrt(-2 ln((w0 + 1) 2^-32)), theta = 2 pi w1 2^-32,
 * with the branch-free polynomial ln and sincos of kernels/cpu/random.c (same
 * constants, same operation order), so CPU and GPU agree to rounding. */
#define KCM_TWO52 4503599627370496.0
#define KCM_MAGIC 0x4330000000000000ull
KCM_FN void kcm_box_muller(uint32_t w0, uint32_t w1, double* z0, double* z1) {
  double d = kcm_u2d((uint64_t)w0 | KCM_MAGIC) - KCM_TWO52 + 1.0; /* exact, in [1, 2^32] */
  uint64_t bits = kcm_d2u(d);
  uint64_t mant = bits & 0x000FFFFFFFFFFFFFull;
  uint64_t big = (mant + (0x000FFFFFFFFFFFFFull - 0x6A09E667F3BCDull)) >> 52; /* m > sqrt(2) */
  double e = kcm_u2d(((bits >> 52) + big) | KCM_MAGIC) - KCM_TWO52 - (1023.0 + 32.0);
  double m = kcm_u2d(mant | ((0x3FFull - big) << 52));
  double s = (m - 1.0) / (m + 1.0), s2 = s * s;
  double p = 1.0 / 21;
  p = p * s2 + 1.0 / 19; p = p * s2 + 1.0 / 17; p = p * s2 + 1.0 / 15; p = p * s2 + 1.0 / 13;
  p = p * s2 + 1.0 / 11; p = p * s2 + 1.0 / 9; p = p * s2 + 1.0 / 7; p = p * s2 + 1.0 / 5;
  p = p * s2 + 1.0 / 3; p = p * s2 + 1.0;
  double ln = e * 6.93147180369123816490e-01 + (e * 1.90821492927058770002e-10 + 2.0 * s * p);
  double v = -2.0 * ln;
  double t = (kcm_u2d((uint64_t)w1 | KCM_MAGIC) - KCM_TWO52) * (1.0 / 4294967296.0);
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
  uint64_t qi = kcm_d2u(q + KCM_TWO52);
  double c1 = (qi & 1) ? sx : cp, s1 = (qi & 1) ? cp : sx;
  double cs = ((qi + 1) & 2) ? -c1 : c1;
  double sn = (qi & 2) ? -s1 : s1;
  double r = sqrt(v);
  *z0 = r * cs;
  *z1 = r * sn;
}

/* ---------------------------------------------------------------- unary functions
 * Op codes are kcpu.h's KU_*: neg exp log sqrt rsqrt abs tanh sigmoid relu
 * gelu gelu_tanh silu clamp leaky_relu elu hardtanh softplus.  lo/hi: clamp
 * bounds (already +-inf when absent); the parameters of the others (as
 * given): leaky_relu lo = negative_slope, elu lo = alpha, hardtanh lo/hi =
 * min_val/max_val, softplus lo = beta, hi = threshold. */
enum { KCM_NEG = 0, KCM_EXP, KCM_LOG, KCM_SQRT, KCM_RSQRT, KCM_ABS, KCM_TANH, KCM_SIGMOID, KCM_RELU,
       KCM_GELU, KCM_GELU_TANH, KCM_SILU, KCM_CLAMP, KCM_LEAKY_RELU, KCM_ELU, KCM_HARDTANH, KCM_SOFTPLUS,
       KCM_NUM_UNARY };
#define KCM_SQRT1_2 0.70710678118654752440
#define KCM_SQRT_2_PI 0.79788456080286535588 /* sqrt(2/pi) */
#define KCM_GELU_C 0.044715
#define KCM_INV_SQRT_2PI 0.39894228040143267794

KCM_FN float kcm_sigmoid_f32(float x) { return 1.0f / (1.0f + expf(-x)); }
KCM_FN double kcm_sigmoid_f64(double x) { return 1.0 / (1.0 + exp(-x)); }
/* gelu tanh as x * sigmoid(2u), u = sqrt(2/pi) (x + c x^3) (accurate negative tail) */
KCM_FN float kcm_gelu_tanh_f32(float x) {
  float u = (float)KCM_SQRT_2_PI * (x + (float)KCM_GELU_C * x * x * x);
  return x / (1.0f + expf(-2.0f * u));
}
KCM_FN double kcm_gelu_tanh_f64(double x) {
  double u = KCM_SQRT_2_PI * (x + KCM_GELU_C * x * x * x);
  return x / (1.0 + exp(-2.0 * u));
}
KCM_FN float kcm_gelu_f32(float x) { return 0.5f * x * erfcf(-x * (float)KCM_SQRT1_2); }
KCM_FN double kcm_gelu_f64(double x) { return 0.5 * x * erfc(-x * KCM_SQRT1_2); }

KCM_FN float kcm_unary_f32(int op, float x, float lo, float hi) {
  switch (op) {
    case KCM_NEG: return -x;
    case KCM_EXP: return expf(x);
    case KCM_LOG: return logf(x);
    case KCM_SQRT: return sqrtf(x);
    case KCM_RSQRT: return 1.0f / sqrtf(x);
    case KCM_ABS: return fabsf(x);
    case KCM_TANH: return tanhf(x);
    case KCM_SIGMOID: return kcm_sigmoid_f32(x);
    case KCM_RELU: return x > 0.0f ? x : (x != x ? x : 0.0f);
    case KCM_GELU: return kcm_gelu_f32(x);
    case KCM_GELU_TANH: return kcm_gelu_tanh_f32(x);
    case KCM_SILU: return x * kcm_sigmoid_f32(x);
    case KCM_LEAKY_RELU: return x > 0.0f ? x : x * lo;
    case KCM_ELU: return x <= 0.0f ? expm1f(x) * lo : x;
    case KCM_SOFTPLUS: return x * lo > hi ? x : log1pf(expf(x * lo)) / lo;
    default: { /* clamp, hardtanh; NaN stays NaN */
      float c = x < lo ? lo : x;
      return x != x ? x : (c > hi ? hi : c);
    }
  }
}
KCM_FN double kcm_unary_f64(int op, double x, double lo, double hi) {
  switch (op) {
    case KCM_NEG: return -x;
    case KCM_EXP: return exp(x);
    case KCM_LOG: return log(x);
    case KCM_SQRT: return sqrt(x);
    case KCM_RSQRT: return 1.0 / sqrt(x);
    case KCM_ABS: return fabs(x);
    case KCM_TANH: return tanh(x);
    case KCM_SIGMOID: return kcm_sigmoid_f64(x);
    case KCM_RELU: return x > 0.0 ? x : (x != x ? x : 0.0);
    case KCM_GELU: return kcm_gelu_f64(x);
    case KCM_GELU_TANH: return kcm_gelu_tanh_f64(x);
    case KCM_SILU: return x * kcm_sigmoid_f64(x);
    case KCM_LEAKY_RELU: return x > 0.0 ? x : x * lo;
    case KCM_ELU: return x <= 0.0 ? expm1(x) * lo : x;
    case KCM_SOFTPLUS: return x * lo > hi ? x : log1p(exp(x * lo)) / lo;
    default: {
      double c = x < lo ? lo : x;
      return x != x ? x : (c > hi ? hi : c);
    }
  }
}

/* gi = g * f'(x), y = f(x) (the saved output, used where the CPU uses it). */
KCM_FN float kcm_unary_grad_f32(int op, float g, float x, float y, float lo, float hi) {
  switch (op) {
    case KCM_NEG: return -g;
    case KCM_EXP: return g * y;
    case KCM_LOG: return g / x;
    case KCM_SQRT: return g / (2.0f * y);
    case KCM_RSQRT: return -0.5f * g * y * y * y;
    case KCM_ABS: return x > 0 ? g : (x < 0 ? -g : 0.0f * g);
    case KCM_TANH: return g * (1.0f - y * y);
    case KCM_SIGMOID: return g * y * (1.0f - y);
    case KCM_RELU: return y > 0 ? g : 0.0f;
    case KCM_GELU: {
      float cdf = 0.5f * erfcf(-x * (float)KCM_SQRT1_2);
      float pdf = (float)KCM_INV_SQRT_2PI * expf(-0.5f * x * x);
      return g * (cdf + x * pdf);
    }
    case KCM_GELU_TANH: {
      float x2 = x * x;
      float u = (float)KCM_SQRT_2_PI * (x + (float)KCM_GELU_C * x2 * x);
      float s = 1.0f / (1.0f + expf(-2.0f * u));
      float du = (float)KCM_SQRT_2_PI * (1.0f + 3.0f * (float)KCM_GELU_C * x2);
      return g * (s + 2.0f * x * s * (1.0f - s) * du);
    }
    case KCM_SILU: {
      float s = kcm_sigmoid_f32(x);
      return g * (s * (1.0f + x * (1.0f - s)));
    }
    case KCM_LEAKY_RELU: return x > 0.0f ? g : g * lo;
    case KCM_ELU: return x <= 0.0f ? g * lo * expf(x) : g;
    case KCM_HARDTANH: return (x <= lo || x >= hi) ? 0.0f : g;
    case KCM_SOFTPLUS: {
      float z = expf(x * lo);
      return x * lo > hi ? g : g * z / (z + 1.0f);
    }
    default: return (x >= lo && x <= hi) ? g : 0.0f;
  }
}
KCM_FN double kcm_unary_grad_f64(int op, double g, double x, double y, double lo, double hi) {
  switch (op) {
    case KCM_NEG: return -g;
    case KCM_EXP: return g * y;
    case KCM_LOG: return g / x;
    case KCM_SQRT: return g / (2.0 * y);
    case KCM_RSQRT: return -0.5 * g * y * y * y;
    case KCM_ABS: return x > 0 ? g : (x < 0 ? -g : 0.0 * g);
    case KCM_TANH: return g * (1.0 - y * y);
    case KCM_SIGMOID: return g * y * (1.0 - y);
    case KCM_RELU: return y > 0 ? g : 0.0;
    case KCM_GELU: {
      double cdf = 0.5 * erfc(-x * KCM_SQRT1_2);
      double pdf = KCM_INV_SQRT_2PI * exp(-0.5 * x * x);
      return g * (cdf + x * pdf);
    }
    case KCM_GELU_TANH: {
      double x2 = x * x;
      double u = KCM_SQRT_2_PI * (x + KCM_GELU_C * x2 * x);
      double s = 1.0 / (1.0 + exp(-2.0 * u));
      double du = KCM_SQRT_2_PI * (1.0 + 3.0 * KCM_GELU_C * x2);
      return g * (s + 2.0 * x * s * (1.0 - s) * du);
    }
    case KCM_SILU: {
      double s = kcm_sigmoid_f64(x);
      return g * (s * (1.0 + x * (1.0 - s)));
    }
    case KCM_LEAKY_RELU: return x > 0.0 ? g : g * lo;
    case KCM_ELU: return x <= 0.0 ? g * lo * exp(x) : g;
    case KCM_HARDTANH: return (x <= lo || x >= hi) ? 0.0 : g;
    case KCM_SOFTPLUS: {
      double z = exp(x * lo);
      return x * lo > hi ? g : g * z / (z + 1.0);
    }
    default: return (x >= lo && x <= hi) ? g : 0.0;
  }
}

/* ---------------------------------------------------------------- binary ops
 * kcpu.h's KB_*: add sub mul div pow max min (max/min propagate NaN). */
enum { KCM_ADD = 0, KCM_SUB, KCM_MUL, KCM_DIV, KCM_POW, KCM_MAX, KCM_MIN, KCM_NUM_BINARY };
KCM_FN float kcm_binary_f32(int op, float x, float y) {
  switch (op) {
    case KCM_ADD: return x + y;
    case KCM_SUB: return x - y;
    case KCM_MUL: return x * y;
    case KCM_DIV: return x / y;
    case KCM_POW: return powf(x, y);
    case KCM_MAX: return (x != x || x > y) ? x : y;
    default: return (x != x || x < y) ? x : y;
  }
}
KCM_FN double kcm_binary_f64(int op, double x, double y) {
  switch (op) {
    case KCM_ADD: return x + y;
    case KCM_SUB: return x - y;
    case KCM_MUL: return x * y;
    case KCM_DIV: return x / y;
    case KCM_POW: return pow(x, y);
    case KCM_MAX: return (x != x || x > y) ? x : y;
    default: return (x != x || x < y) ? x : y;
  }
}
/* Integers: wrapping add/sub/mul, division by zero gives 0 (as kcpu), pow
 * through double. */
KCM_FN int64_t kcm_binary_i64(int op, int64_t x, int64_t y) {
  switch (op) {
    case KCM_ADD: return (int64_t)((uint64_t)x + (uint64_t)y);
    case KCM_SUB: return (int64_t)((uint64_t)x - (uint64_t)y);
    case KCM_MUL: return (int64_t)((uint64_t)x * (uint64_t)y);
    case KCM_DIV: return y ? x / y : 0;
    case KCM_POW: return (int64_t)pow((double)x, (double)y);
    case KCM_MAX: return x > y ? x : y;
    default: return x < y ? x : y;
  }
}

/* ---------------------------------------------------------------- AdamW
 * torch.optim.AdamW (single tensor), as kernels/cpu/optim.c:
 *   p *= 1 - lr wd;  m = lerp(m, g, 1 - beta1);  v = v beta2 + (1 - beta2) g g
 *   p += -(lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps),  bc_i = 1 - beta_i^step.
 * Constants are formed in double and rounded once, like the CPU. */
typedef struct { float decay, w1, b2, omb2, bc2, eps, nss; int lo; } kcm_adamw_f32c;
typedef struct { double decay, w1, b2, omb2, bc2, eps, nss; int lo; } kcm_adamw_f64c;

KCM_FN kcm_adamw_f32c kcm_adamw_consts_f32(double lr, double beta1, double beta2, double eps, double wd,
                                           int64_t step) {
  double bc1 = 1.0 - pow(beta1, (double)step), bc2 = 1.0 - pow(beta2, (double)step);
  kcm_adamw_f32c c;
  c.decay = (float)(1.0 - lr * wd); c.w1 = (float)(1.0 - beta1); c.b2 = (float)beta2;
  c.omb2 = (float)(1.0 - beta2); c.bc2 = (float)sqrt(bc2); c.eps = (float)eps; c.nss = (float)(-(lr / bc1));
  c.lo = fabsf(c.w1) < 0.5f;
  return c;
}
KCM_FN kcm_adamw_f64c kcm_adamw_consts_f64(double lr, double beta1, double beta2, double eps, double wd,
                                           int64_t step) {
  double bc1 = 1.0 - pow(beta1, (double)step), bc2 = 1.0 - pow(beta2, (double)step);
  kcm_adamw_f64c c;
  c.decay = 1.0 - lr * wd; c.w1 = 1.0 - beta1; c.b2 = beta2; c.omb2 = 1.0 - beta2; c.bc2 = sqrt(bc2);
  c.eps = eps; c.nss = -(lr / bc1); c.lo = fabs(c.w1) < 0.5;
  return c;
}
/* One element: updates *p, *m, *v from g. */
KCM_FN void kcm_adamw_f32(const kcm_adamw_f32c* c, float* p, float g, float* m, float* v) {
  float p_ = *p * c->decay, m_ = *m, v_ = *v;
  m_ = c->lo ? m_ + c->w1 * (g - m_) : g - (g - m_) * (1.0f - c->w1);
  v_ = v_ * c->b2;
  v_ = v_ + c->omb2 * g * g;
  float den = sqrtf(v_) / c->bc2 + c->eps;
  *p = p_ + c->nss * m_ / den; *m = m_; *v = v_;
}
KCM_FN void kcm_adamw_f64(const kcm_adamw_f64c* c, double* p, double g, double* m, double* v) {
  double p_ = *p * c->decay, m_ = *m, v_ = *v;
  m_ = c->lo ? m_ + c->w1 * (g - m_) : g - (g - m_) * (1.0 - c->w1);
  v_ = v_ * c->b2;
  v_ = v_ + c->omb2 * g * g;
  double den = sqrt(v_) / c->bc2 + c->eps;
  *p = p_ + c->nss * m_ / den; *m = m_; *v = v_;
}
/* clip_grad_norm_'s coefficient: max_norm / (norm + 1e-6), clamped to <= 1
 * (NaN stays NaN, as torch.clamp(max=1) does). */
KCM_FN double kcm_clip_coef(double norm, double max_norm) {
  double c = max_norm / (norm + 1e-6);
  return (c < 1.0 || c != c) ? c : 1.0;
}

/* ---------------------------------------------------------------- softmax pieces
 * A running (max m, sum s of exp(x - m)) pair; merging two pairs. */
KCM_FN void kcm_lse_merge(float* m, float* s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (*m == -INFINITY) { *m = m2; *s = s2; return; }
  float nm = *m > m2 ? *m : m2;
  *s = *s * expf(*m - nm) + s2 * expf(m2 - nm);
  *m = nm;
}
KCM_FN void kcm_lse_merge_f64(double* m, double* s, double m2, double s2) {
  if (m2 == -INFINITY) return;
  if (*m == -INFINITY) { *m = m2; *s = s2; return; }
  double nm = *m > m2 ? *m : m2;
  *s = *s * exp(*m - nm) + s2 * exp(m2 - nm);
  *m = nm;
}
/* Adds x to a running pair (NaN poisons the max, so the result is NaN). */
/* Start from m = -inf, s = 0.  -inf elements add nothing (an all -inf row
 * ends with s = 0, so its softmax is NaN, as in PyTorch). */
KCM_FN void kcm_lse_add(float* m, float* s, float x) {
  if (x > *m) { *s = (*m == -INFINITY ? 0.0f : *s * expf(*m - x)) + 1.0f; *m = x; }
  else if (x == x) { if (x != -INFINITY) *s += expf(x - *m); }
  else { *m = x; *s = x; }
}
/* Adds n values (a vector load's worth) at once: one max over them, at most one rescale of s, and each term as
 * exp2f((x - m) * log2(e)) (one multiply-add and the hardware exp2 on the GPU) instead of an expf with a branch per
 * element: the online update's compare, rescale and serial dependence per element made the classifier's forward
 * instruction-bound (630 us for 8192 x 50304 bf16 logits on the H200).  The same result as n calls of kcm_lse_add
 * to f32 rounding of the terms; a vector holding NaN or +inf takes kcm_lse_add's path element by element, so those
 * rows end as there (NaN poisons, +inf gives lse = +inf). */
KCM_FN void kcm_lse_add_n(float* m, float* s, const float* x, int n) {
  float vm = x[0];
  int odd = 0;
  for (int k = 0; k < n; k++) {
    vm = x[k] > vm ? x[k] : vm;
    odd |= (x[k] != x[k]) | (x[k] == INFINITY);
  }
  if (odd) {
    for (int k = 0; k < n; k++) kcm_lse_add(m, s, x[k]);
    return;
  }
  const float l2e = 1.4426950408889634f;
  if (vm > *m) {
    *s = *m == -INFINITY ? 0.0f : *s * exp2f((*m - vm) * l2e);
    *m = vm;
  }
  if (*m == -INFINITY) return; /* every value so far -inf: nothing to add */
  const float mb = *m * l2e;
  float t = 0.0f;
  for (int k = 0; k < n; k++) t += exp2f(x[k] * l2e - mb);
  *s += t;
}
KCM_FN void kcm_lse_add_f64(double* m, double* s, double x) {
  if (x > *m) { *s = (*m == -INFINITY ? 0.0 : *s * exp(*m - x)) + 1.0; *m = x; }
  else if (x == x) { if (x != -INFINITY) *s += exp(x - *m); }
  else { *m = x; *s = x; }
}

/* Cross entropy with label smoothing eps over C classes (as kcpu's loss.c):
 *   loss = lse - (1 - eps) x_t - eps/C sum_c x_c
 *   d loss / d x_c = softmax_c - (1 - eps) [c == t] - eps / C. */
KCM_FN float kcm_ce_loss(float lse, float x_t, float sum_x, float eps, float inv_c) {
  return lse - (1.0f - eps) * x_t - eps * inv_c * sum_x;
}
KCM_FN float kcm_ce_grad(float x, float lse, int is_target, float eps, float inv_c, float scale) {
  return scale * (expf(x - lse) - (is_target ? 1.0f - eps : 0.0f) - eps * inv_c);
}
KCM_FN double kcm_ce_grad_f64(double x, double lse, int is_target, double eps, double inv_c, double scale) {
  return scale * (exp(x - lse) - (is_target ? 1.0 - eps : 0.0) - eps * inv_c);
}

/* layer_norm (rms = 0) / rms_norm (rms = 1) input gradient of one element:
 * wdy = w_j go_j, xhat = (x_j - mean) rstd (mean = 0 for rms),
 * a = mean over the row of wdy, b = mean of wdy * xhat:
 *   dx = rstd (wdy - a - xhat b)   (a = 0 for rms). */
KCM_FN float kcm_norm_dx(int rms, float wdy, float xhat, float rstd, float a, float b) {
  return rstd * (wdy - (rms ? 0.0f : a) - xhat * b);
}
KCM_FN double kcm_norm_dx_f64(int rms, double wdy, double xhat, double rstd, double a, double b) {
  return rstd * (wdy - (rms ? 0.0 : a) - xhat * b);
}
#endif
