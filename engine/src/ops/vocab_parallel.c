/* vocab_parallel.c: the local phases of vocab-parallel cross entropy (ops/vocab_parallel.h) on the CPU (the
 * reference loops) or on CUDA (cuda/cuda_vocab.h).  Pure local compute: the all_reduces between the phases are
 * the caller's, on the same buffers. */
#include "ops/vocab_parallel.h"
#include "ops/cuda_vocab.h"
#include <math.h>

static const char* OP = "cross_entropy_vocab_parallel";

#define P64(t) ((t) ? (double*)eng_ptr(t) : NULL)

static inline double rd(const eng_tensor* t, int64_t i) {
  return t->dtype == ENG_F32 ? (double)((const float*)eng_ptr(t))[i] : ((const double*)eng_ptr(t))[i];
}
static inline void wr(eng_tensor* t, int64_t i, double v) {
  if (t->dtype == ENG_F32) ((float*)eng_ptr(t))[i] = (float)v; else ((double*)eng_ptr(t))[i] = v;
}

int eng_vp_ce_prep(eng_tensor* T, eng_tensor* W, int64_t total, int64_t ignore, double slice_err, eng_tensor* rw,
                   eng_tensor* mx, eng_tensor* ws) {
  int64_t M = T->numel;
  if (T->device == ENG_CUDA)
    return eng_cu_vp_ce_prep(M, (const int64_t*)eng_ptr(T), total, ignore, P64(W), P64(rw), slice_err, P64(mx) + M,
                             P64(ws), OP);
  const int64_t* tg = (const int64_t*)eng_ptr(T);
  const double* wv = P64(W);
  double *r = P64(rw), wsum = 0.0, err = slice_err;
  for (int64_t i = 0; i < M; i++) {
    if (r) r[i] = 0.0;
    if (tg[i] == ignore) continue;
    if (tg[i] < 0 || tg[i] >= total) { if (err < 2.0) err = 2.0; continue; }
    if (r) r[i] = wv[tg[i]];
    wsum += wv ? wv[tg[i]] : 1.0;
  }
  P64(mx)[M] = err;
  P64(ws)[0] = wsum;
  return 0;
}

int eng_vp_ce_max(eng_tensor* X, eng_tensor* mx) {
  int64_t V = X->shape[X->ndim - 1], M = V ? X->numel / V : mx->numel - 1;
  if (X->device == ENG_CUDA) return eng_cu_vp_ce_max(X->dtype, M, V, eng_ptr(X), P64(mx), OP);
  double* pm = P64(mx);
  for (int64_t i = 0; i < M; i++) {
    double m = -INFINITY;
    for (int64_t c = 0; c < V; c++) { double v = rd(X, i * V + c); if (v > m) m = v; }
    pm[i] = m;
  }
  return 0;
}

int eng_vp_ce_sumexp(eng_tensor* X, eng_tensor* mx, eng_tensor* T, int64_t off, int64_t ignore, eng_tensor* se,
                     eng_tensor* tl) {
  int64_t V = X->shape[X->ndim - 1], M = T->numel;
  if (X->device == ENG_CUDA)
    return eng_cu_vp_ce_sumexp(X->dtype, M, V, eng_ptr(X), P64(mx), (const int64_t*)eng_ptr(T), off, ignore, P64(se),
                               P64(tl), OP);
  const int64_t* tg = (const int64_t*)eng_ptr(T);
  double *pm = P64(mx), *ps = P64(se), *pt = P64(tl);
  for (int64_t i = 0; i < M; i++) {
    double m = pm[i], s = 0.0;
    if (isfinite(m)) for (int64_t c = 0; c < V; c++) s += exp(rd(X, i * V + c) - m);
    ps[i] = s;
    int64_t t = tg[i] - off;
    pt[i] = (tg[i] != ignore && t >= 0 && t < V) ? rd(X, i * V + t) : 0.0;
  }
  ps[M] = (double)V;
  return 0;
}

int eng_vp_ce_loss(eng_tensor* mx, eng_tensor* se, eng_tensor* tl, eng_tensor* T, int64_t ignore, eng_tensor* rw,
                   eng_tensor* ws, int reduction, eng_tensor* lse, eng_tensor* out) {
  int64_t M = T->numel;
  if (T->device == ENG_CUDA)
    return eng_cu_vp_ce_loss(lse->dtype, M, P64(mx), P64(se), P64(tl), (const int64_t*)eng_ptr(T), ignore, P64(rw),
                             P64(ws), reduction, eng_ptr(lse), eng_ptr(out), OP);
  const int64_t* tg = (const int64_t*)eng_ptr(T);
  const double *pm = P64(mx), *ps = P64(se), *pt = P64(tl), *r = P64(rw);
  double total = 0.0;
  for (int64_t i = 0; i < M; i++) {
    double l = pm[i] + log(ps[i]);
    wr(lse, i, l);
    double loss = tg[i] == ignore ? 0.0 : (l - pt[i]) * (r ? r[i] : 1.0);
    total += loss;
    if (reduction == 0) wr(out, i, loss);
  }
  if (reduction != 0) wr(out, 0, reduction == 1 ? total / P64(ws)[0] : total); /* no target: NaN, as cross_entropy */
  return 0;
}

eng_tensor* eng_vp_ce_grad(eng_tensor* X, eng_tensor* lse, eng_tensor* T, int64_t off, int64_t ignore, eng_tensor* g,
                           int per_row, eng_tensor* rw, eng_tensor* div) {
  int64_t V = X->shape[X->ndim - 1], M = T->numel;
  int cdt = X->dtype;
  eng_tensor* gx = eng_new(X->ndim, X->shape, cdt, X->device);
  if (!gx) return NULL;
  if (X->device == ENG_CUDA) {
    if (eng_cu_vp_ce_bwd(cdt, M, V, eng_ptr(X), eng_ptr(lse), (const int64_t*)eng_ptr(T), off, ignore, eng_ptr(g),
                         g->dtype, per_row, P64(rw), P64(div), eng_ptr(gx), OP)) {
      eng_tensor_release(gx);
      return NULL;
    }
    return gx;
  }
  const int64_t* tg = (const int64_t*)eng_ptr(T);
  const double* r = P64(rw);
  double gconst = per_row ? 0.0 : rd(g, 0);
  if (!per_row && div) gconst = gconst / P64(div)[0];
  for (int64_t i = 0; i < M; i++) {
    int64_t t = tg[i];
    double s = t == ignore ? 0.0 : (per_row ? rd(g, i) : gconst) * (r ? r[i] : 1.0);
    int64_t tl = t - off;
    if (cdt == ENG_F32) {
      const float* x = (const float*)eng_ptr(X) + i * V;
      float* o = (float*)eng_ptr(gx) + i * V;
      float l = ((const float*)eng_ptr(lse))[i];
      if (s == 0.0) { for (int64_t c = 0; c < V; c++) o[c] = 0.0f; continue; }
      for (int64_t c = 0; c < V; c++) o[c] = (float)(s * (double)expf(x[c] - l));
      if (tl >= 0 && tl < V) o[tl] -= (float)s;
    } else {
      const double* x = (const double*)eng_ptr(X) + i * V;
      double* o = (double*)eng_ptr(gx) + i * V;
      double l = ((const double*)eng_ptr(lse))[i];
      if (s == 0.0) { for (int64_t c = 0; c < V; c++) o[c] = 0.0; continue; }
      for (int64_t c = 0; c < V; c++) o[c] = s * exp(x[c] - l);
      if (tl >= 0 && tl < V) o[tl] -= s;
    }
  }
  return gx;
}

int eng_vp_read(eng_tensor* t, int64_t i, int n, double* out) {
  if (t->device == ENG_CUDA) return eng_cu_read_f64(P64(t) + i, out, n, OP);
  for (int k = 0; k < n; k++) out[k] = P64(t)[i + k];
  return 0;
}
