/* attention.c: the fused pieces of scaled dot-product attention between
 * its GEMMs: masked (bool / additive / causal) row softmax of a score block,
 * and inverted dropout applied from a precomputed keep mask. */
/* FP compares must not count as traps, or GCC will not if-convert (and so not
 * vectorize) the selects in kc_expf and the masked loops. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif
#include "kcpu.h"
#include "half.h"
#include <math.h>
#include <string.h>

#define DEF_ATTN(T, SUF)                                                                \
  void kc_attn_softmax_##SUF(int64_t L, int64_t S, T* s, int64_t lds, const void* mask, int mkind, \
                             int64_t mrs, int64_t mcs, int causal) {                    \
    for (int64_t i = 0; i < L; i++) {                                                   \
      T* r = s + i * lds;                                                               \
      int64_t n = causal ? (i + 1 < S ? i + 1 : S) : S;                                 \
      if (mkind == 1) {                                                                 \
        const uint8_t* mb = (const uint8_t*)mask + i * mrs;                             \
        for (int64_t j = 0; j < n; j++) if (!mb[j * mcs]) r[j] = -INFINITY;             \
      } else if (mkind == 2) {                                                          \
        const T* mf = (const T*)mask + i * mrs;                                         \
        if (mcs == 1) for (int64_t j = 0; j < n; j++) r[j] += mf[j];                    \
        else for (int64_t j = 0; j < n; j++) r[j] += mf[j * mcs];                       \
      }                                                                                 \
      /* causal rows run over whole 16-lane groups, the masked part as -inf \
         (exp gives exactly 0), so no row ends in a scalar tail */           \
      int64_t nv = causal ? ((n + 15) & ~(int64_t)15) : n;                              \
      if (nv > S) nv = S;                                                               \
      for (int64_t j = n; j < nv; j++) r[j] = -INFINITY;                                \
      for (int64_t j = nv; j < S; j++) r[j] = 0;                                        \
      T m = kc_row_max_##SUF(nv, r);                                                    \
      if (m == -INFINITY) { for (int64_t j = 0; j < nv; j++) r[j] = 0; continue; }      \
      T inv = 1 / kc_row_expsum_##SUF(nv, r, m, r);                                     \
      for (int64_t j = 0; j < nv; j++) r[j] *= inv;                                     \
    }                                                                                   \
  }

DEF_ATTN(float, f32)
DEF_ATTN(double, f64)

void kc_dropout_apply_f32(int64_t n, const float* x, const uint8_t* keep, float scale, float* out) {
  for (int64_t i = 0; i < n; i++) out[i] = keep[i] ? x[i] * scale : 0.0f;
}

void kc_dropout_apply_f64(int64_t n, const double* x, const uint8_t* keep, double scale, double* out) {
  for (int64_t i = 0; i < n; i++) out[i] = keep[i] ? x[i] * scale : 0.0;
}

/* One query row against S keys (decoding with a KV cache): p = softmax(scale * K q) over the S rows of K (row j at
 * k + j*ldk, E contiguous values), out = p @ V (row j at v + j*ldv, Ev values).  The same softmax as
 * kc_attn_softmax_f32; the products in 16-lane partial sums (fixed order), without BLAS's per-call cost.  Keys and
 * values are read once each, in order, left to the hardware prefetchers: explicit prefetches (non-temporal or into
 * every level) made the op slower in decoding at context 1024 (ENGINE_PROFILE=1 over 64 tokens, three alternating
 * runs: 86 / 117 / 102 us a call non-temporal, 81 / 87 / 99 into every level, 66 / 78 / 57 without). */
static inline float dot16_f32(const float* a, const float* b, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
  float s = 0;
  for (int l = 0; l < 16; l++) s += acc[l];
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

/* p <- softmax(p) over S scores and out[0, Ev) <- 0; 0 when every score is -inf (p and out left zero: nothing to
 * attend to), else 1 (the caller then adds p @ V into out). */
static int decode_softmax(int64_t S, int64_t Ev, float* p, float* out) {
  for (int64_t e = 0; e < Ev; e++) out[e] = 0;
  float m = kc_row_max_f32(S, p);
  if (m == -INFINITY) {
    for (int64_t j = 0; j < S; j++) p[j] = 0;
    return 0;
  }
  float inv = 1 / kc_row_expsum_f32(S, p, m, p);
  for (int64_t j = 0; j < S; j++) p[j] *= inv;
  return 1;
}

void kc_attn_decode_f32(int64_t S, int64_t E, int64_t Ev, float scale, const float* q, const float* k, int64_t ldk,
                        const float* v, int64_t ldv, float* p, float* out) {
  for (int64_t j = 0; j < S; j++) p[j] = scale * dot16_f32(q, k + j * ldk, E);
  if (!decode_softmax(S, Ev, p, out)) return;
  for (int64_t j = 0; j < S; j++) {
    const float pj = p[j], *vj = v + j * ldv;
    for (int64_t e = 0; e < Ev; e++) out[e] += pj * vj[e];
  }
}

/* The same over keys and values stored in bf16 (a 16-bit KV cache): each element widened to f32 as it is read (a
 * shift), the arithmetic in f32 as above. */
static inline float dot16_bf16(const float* a, const uint16_t* b, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; l++) acc[l] += a[i + l] * kc_bf16_to_f32(b[i + l]);
  float s = 0;
  for (int l = 0; l < 16; l++) s += acc[l];
  for (; i < n; i++) s += a[i] * kc_bf16_to_f32(b[i]);
  return s;
}

void kc_attn_decode_bf16kv(int64_t S, int64_t E, int64_t Ev, float scale, const float* q, const uint16_t* k,
                           int64_t ldk, const uint16_t* v, int64_t ldv, float* p, float* out) {
  for (int64_t j = 0; j < S; j++) p[j] = scale * dot16_bf16(q, k + j * ldk, E);
  if (!decode_softmax(S, Ev, p, out)) return;
  for (int64_t j = 0; j < S; j++) {
    const float pj = p[j];
    const uint16_t* vj = v + j * ldv;
    for (int64_t e = 0; e < Ev; e++) out[e] += pj * kc_bf16_to_f32(vj[e]);
  }
}
