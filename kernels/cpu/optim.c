/* optim.c: fused optimizer updates (AdamW, SGD) and p-norm accumulation.
 * Each update is one pass over a strided row doing exactly the sequence of
 * operations of torch.optim's single-tensor implementation, in f32 for f32
 * (and bf16/f16, with converted loads and stores) and in f64 for f64. */
#include "kcpu.h"
#include <math.h>

/* torch.lerp: self + w (end - self) for |w| < 0.5, else end - (end - self)(1 - w). */
#define LERP(s, e, w, lo) ((lo) ? (s) + (w) * ((e) - (s)) : (e) - ((e) - (s)) * (1 - (w)))

#define ADAMW_BODY(T, P, G, M, V)                                                \
  do {                                                                           \
    T p_ = (P), g_ = (G), m_ = (M), v_ = (V);                                    \
    p_ = p_ * decay;                                                             \
    m_ = LERP(m_, g_, w1, lo);                                                   \
    v_ = v_ * b2;                                                                \
    v_ = v_ + omb2 * g_ * g_;                                                    \
    T den_ = SQRT(v_) / bc2 + eps;                                               \
    p_ = p_ + nss * m_ / den_;                                                   \
    STORE_P(p_); STORE_M(m_); STORE_V(v_);                                       \
  } while (0)

static void adamw_f32(const kc_adamw_args* a, int64_t n, char* p, int64_t sp, const char* g, int64_t sg,
                      char* m, int64_t sm, char* v, int64_t sv) {
  const float decay = (float)(1.0 - a->lr * a->weight_decay), w1 = (float)(1.0 - a->beta1);
  const float b2 = (float)a->beta2, omb2 = (float)(1.0 - a->beta2), bc2 = (float)a->bc2_sqrt;
  const float eps = (float)a->eps, nss = (float)(-a->step_size);
  const int lo = fabsf(w1) < 0.5f;
#define SQRT sqrtf
  if (a->pdt == KC_F32 && a->gdt == KC_F32 && a->sdt == KC_F32 && sp == 4 && sg == 4 && sm == 4 && sv == 4) {
    float* restrict P = (float*)p; const float* restrict Gr = (const float*)g;
    float* restrict Mm = (float*)m; float* restrict Vv = (float*)v;
#define STORE_P(x) P[i] = (x)
#define STORE_M(x) Mm[i] = (x)
#define STORE_V(x) Vv[i] = (x)
    if (lo) { /* split so the compiler sees a branch-free loop */
      for (int64_t i = 0; i < n; i++) {
        float p_ = P[i], g_ = Gr[i], m_ = Mm[i], v_ = Vv[i];
        p_ = p_ * decay;
        m_ = m_ + w1 * (g_ - m_);
        v_ = v_ * b2;
        v_ = v_ + omb2 * g_ * g_;
        float den_ = sqrtf(v_) / bc2 + eps;
        P[i] = p_ + nss * m_ / den_; Mm[i] = m_; Vv[i] = v_;
      }
    } else {
      for (int64_t i = 0; i < n; i++) ADAMW_BODY(float, P[i], Gr[i], Mm[i], Vv[i]);
    }
#undef STORE_P
#undef STORE_M
#undef STORE_V
    return;
  }
#define STORE_P(x) kc_store(p + i * sp, a->pdt, (double)(x))
#define STORE_M(x) kc_store(m + i * sm, a->sdt, (double)(x))
#define STORE_V(x) kc_store(v + i * sv, a->sdt, (double)(x))
  for (int64_t i = 0; i < n; i++)
    ADAMW_BODY(float, (float)kc_load(p + i * sp, a->pdt), (float)kc_load(g + i * sg, a->gdt),
               (float)kc_load(m + i * sm, a->sdt), (float)kc_load(v + i * sv, a->sdt));
#undef SQRT
}

static void adamw_f64(const kc_adamw_args* a, int64_t n, char* p, int64_t sp, const char* g, int64_t sg,
                      char* m, int64_t sm, char* v, int64_t sv) {
  const double decay = 1.0 - a->lr * a->weight_decay, w1 = 1.0 - a->beta1;
  const double b2 = a->beta2, omb2 = 1.0 - a->beta2, bc2 = a->bc2_sqrt, eps = a->eps, nss = -a->step_size;
  const int lo = fabs(w1) < 0.5;
#define SQRT sqrt
  for (int64_t i = 0; i < n; i++)
    ADAMW_BODY(double, kc_load(p + i * sp, a->pdt), kc_load(g + i * sg, a->gdt), kc_load(m + i * sm, a->sdt),
               kc_load(v + i * sv, a->sdt));
#undef SQRT
#undef STORE_P
#undef STORE_M
#undef STORE_V
}

void kc_adamw_row(const kc_adamw_args* a, int64_t n, char* p, int64_t sp, const char* g, int64_t sg,
                  char* m, int64_t sm, char* v, int64_t sv) {
  if (a->pdt == KC_F64) adamw_f64(a, n, p, sp, g, sg, m, sm, v, sv);
  else adamw_f32(a, n, p, sp, g, sg, m, sm, v, sv);
}

/* Master weights: the AdamW step on the f32 master row (grads of any float
 * dtype, f32 states), then the half-precision param gets the updated master
 * rounded to nearest even: p[i] = (pdt) master[i]. */
void kc_adamw_master_row(const kc_adamw_args* a, int64_t n, char* master, int64_t sw, const char* g, int64_t sg,
                         char* m, int64_t sm, char* v, int64_t sv, char* p, int64_t sp) {
  kc_adamw_args f = *a;
  f.pdt = KC_F32; f.sdt = KC_F32;
  adamw_f32(&f, n, master, sw, g, sg, m, sm, v, sv);
  if (a->pdt == KC_BF16)
    for (int64_t i = 0; i < n; i++) *(uint16_t*)(p + i * sp) = kc_f32_to_bf16(*(const float*)(master + i * sw));
  else
    for (int64_t i = 0; i < n; i++) kc_store(p + i * sp, a->pdt, (double)*(const float*)(master + i * sw));
}

#define SGD_BODY(T, LOADP, LOADG, LOADB, STOREP, STOREB)                          \
  for (int64_t i = 0; i < n; i++) {                                              \
    T p_ = LOADP, d_ = LOADG;                                                    \
    if (wd != 0) d_ = d_ + wd * p_;                                              \
    if (mom != 0) {                                                              \
      T b_ = first ? d_ : LOADB * mom + omd * d_;                                \
      STOREB(b_);                                                                \
      d_ = nesterov ? d_ + mom * b_ : b_;                                        \
    }                                                                            \
    STOREP(p_ + nlr * d_);                                                       \
  }

void kc_sgd_row(const kc_sgd_args* a, int64_t n, char* p, int64_t sp, const char* g, int64_t sg,
                char* buf, int64_t sb) {
  const int first = a->first, nesterov = a->nesterov;
  if (a->pdt == KC_F64) {
    const double wd = a->weight_decay, mom = a->momentum, omd = 1.0 - a->dampening, nlr = -a->lr;
#define ST_P(x) kc_store(p + i * sp, a->pdt, (x))
#define ST_B(x) kc_store(buf + i * sb, a->bdt, (x))
    SGD_BODY(double, kc_load(p + i * sp, a->pdt), kc_load(g + i * sg, a->gdt), kc_load(buf + i * sb, a->bdt),
             ST_P, ST_B)
#undef ST_P
#undef ST_B
    return;
  }
  const float wd = (float)a->weight_decay, mom = (float)a->momentum, omd = (float)(1.0 - a->dampening);
  const float nlr = (float)(-a->lr);
  if (a->pdt == KC_F32 && a->gdt == KC_F32 && (!buf || a->bdt == KC_F32) && sp == 4 && sg == 4 &&
      (!buf || sb == 4)) {
    float* restrict P = (float*)p; const float* restrict Gr = (const float*)g; float* restrict B = (float*)buf;
#define ST_P(x) P[i] = (x)
#define ST_B(x) B[i] = (x)
    SGD_BODY(float, P[i], Gr[i], B[i], ST_P, ST_B)
#undef ST_P
#undef ST_B
    return;
  }
#define ST_P(x) kc_store(p + i * sp, a->pdt, (double)(x))
#define ST_B(x) kc_store(buf + i * sb, a->bdt, (double)(x))
  SGD_BODY(float, (float)kc_load(p + i * sp, a->pdt), (float)kc_load(g + i * sg, a->gdt),
           (float)kc_load(buf + i * sb, a->bdt), ST_P, ST_B)
#undef ST_P
#undef ST_B
}

void kc_pnorm_row(int kind, double p, int dt, int64_t n, const char* x, int64_t sx, double* acc) {
  if (kind == KN_L2 && dt == KC_F32 && sx == 4) {
    const float* restrict X = (const float*)x;
    double s[4] = {0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
      for (int k = 0; k < 4; k++) s[k] += (double)X[i + k] * (double)X[i + k];
    for (; i < n; i++) s[0] += (double)X[i] * (double)X[i];
    *acc += (s[0] + s[1]) + (s[2] + s[3]);
    return;
  }
  double a = *acc;
  for (int64_t i = 0; i < n; i++) {
    double v = kc_load(x + i * sx, dt);
    double av = fabs(v);
    switch (kind) {
      case KN_L2: a += v * v; break;
      case KN_L1: a += av; break;
      case KN_MAX: if (av > a || av != av) a = (a != a) ? a : av; break;
      case KN_MIN: if (av < a || av != av) a = (a != a) ? a : av; break;
      case KN_COUNT: a += v != 0.0; break;
      default: a += pow(av, p); break;
    }
  }
  *acc = a;
}

void kc_scale_row(int dt, int64_t n, char* x, int64_t sx, double s) {
  if (dt == KC_F64) { for (int64_t i = 0; i < n; i++) *(double*)(x + i * sx) *= s; return; }
  const float f = (float)s;
  if (dt == KC_F32) {
    if (sx == 4) { float* restrict X = (float*)x; for (int64_t i = 0; i < n; i++) X[i] *= f; return; }
    for (int64_t i = 0; i < n; i++) *(float*)(x + i * sx) *= f;
    return;
  }
  for (int64_t i = 0; i < n; i++) kc_store(x + i * sx, dt, (double)((float)kc_load(x + i * sx, dt) * f));
}
