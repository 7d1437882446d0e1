/* ops_attention.c: scaled_dot_product_attention as one op with its own
 * backward: batched GEMM (q k^T * scale) -> fused masked softmax (bool,
 * additive or causal mask) -> optional inverted dropout -> batched GEMM (@ v).
 * The attention probabilities are saved for backward; the dropout mask is
 * not: backward regenerates it from the counter-based RNG (seed, offset),
 * with the same Bernoulli draws as eng_dropout on the probabilities.
 * Rows with nothing to attend to give zeros (PyTorch's math path uses the
 * same "safe softmax" since 2.5). */
#include "bmm.h"
#include "../../kernels/cpu/kcpu.h"
#include <math.h>

static int compute_dtype(int dt) { return dt == ENG_F64 ? ENG_F64 : ENG_F32; }

static eng_tensor* in_dtype(eng_tensor* t, int cdt) {
  return t->dtype == cdt ? eng_tensor_retain(t) : eng_as_contig(t, cdt);
}

typedef struct {
  int nb;
  int64_t L, S, E, Ev;
  int64_t bshape[ENG_MAX_DIMS];
  int64_t pshape[ENG_MAX_DIMS]; /* [bshape..., L, S] */
} at_plan;

static int at_plan_make(const eng_tensor* q, const eng_tensor* k, const eng_tensor* v, at_plan* p) {
  const char* op = "scaled_dot_product_attention";
  if (q->ndim < 2 || k->ndim < 2 || v->ndim < 2)
    return eng_err("%s: q %s, k %s, v %s: each needs at least 2 dims ([..., L, E], [..., S, E], [..., S, Ev])",
                   op, eng_desc(q), eng_desc(k), eng_desc(v));
  p->L = q->shape[q->ndim - 2]; p->E = q->shape[q->ndim - 1];
  p->S = k->shape[k->ndim - 2]; p->Ev = v->shape[v->ndim - 1];
  if (k->shape[k->ndim - 1] != p->E)
    return eng_err("%s: q %s and k %s: embedding dims (last) %lld and %lld differ", op, eng_desc(q), eng_desc(k),
                   (long long)p->E, (long long)k->shape[k->ndim - 1]);
  if (v->shape[v->ndim - 2] != p->S)
    return eng_err("%s: k %s and v %s: sequence dims (second to last) %lld and %lld differ", op, eng_desc(k),
                   eng_desc(v), (long long)p->S, (long long)v->shape[v->ndim - 2]);
  int nq = q->ndim - 2, nk = k->ndim - 2, nv = v->ndim - 2;
  p->nb = nq > nk ? nq : nk;
  if (nv > p->nb) p->nb = nv;
  for (int i = 0; i < p->nb; i++) {
    int iq = nq - p->nb + i, ik = nk - p->nb + i, iv = nv - p->nb + i;
    int64_t a = iq >= 0 ? q->shape[iq] : 1, b = ik >= 0 ? k->shape[ik] : 1, c = iv >= 0 ? v->shape[iv] : 1;
    int64_t r = a;
    if (r == 1) r = b; else if (b != 1 && b != r) r = -1;
    if (r == 1) r = c; else if (r != -1 && c != 1 && c != r) r = -1;
    if (r < 0)
      return eng_err("%s: batch dims of q %s, k %s and v %s do not broadcast", op, eng_desc(q), eng_desc(k),
                     eng_desc(v));
    p->bshape[i] = r;
    p->pshape[i] = r;
  }
  p->pshape[p->nb] = p->L;
  p->pshape[p->nb + 1] = p->S;
  return 0;
}

/* Contiguous [bshape, rows, cols] view (for P, dP and the outputs). */
static void contig_view(const eng_tensor* t, int nb, eng_mview* m) {
  m->p = eng_ptr(t);
  for (int d = 0; d < nb; d++) m->bs[d] = t->shape[d] == 1 ? 0 : t->stride[d];
  m->rows = t->shape[nb]; m->cols = t->shape[nb + 1];
  m->rs = t->stride[nb]; m->cs = t->stride[nb + 1];
}

/* The dropout keep mask (u8, shape pshape) drawn with (seed, offset): the
 * same Bernoulli(1 - p) draws eng_dropout makes for that offset. */
static eng_tensor* dropout_keep(const at_plan* p, double dp, uint64_t seed, uint64_t offset) {
  return eng_random_slice(ENG_RNG_BERNOULLI, p->nb + 2, p->pshape, NULL, NULL, 1.0 - dp, 0.0, ENG_U8, seed,
                          offset);
}

static void dropout_apply(int cdt, eng_tensor* x, const eng_tensor* keep, double dp, eng_tensor* out) {
  double sc = dp < 1.0 ? 1.0 / (1.0 - dp) : 0.0;
  if (cdt == ENG_F32)
    kc_dropout_apply_f32(x->numel, (void*)eng_ptr(x), (void*)eng_ptr(keep), (float)sc, (void*)eng_ptr(out));
  else
    kc_dropout_apply_f64(x->numel, (void*)eng_ptr(x), (void*)eng_ptr(keep), sc, (void*)eng_ptr(out));
}

static eng_tensor* grad_buffer(const eng_tensor* like, int cdt, int zero) {
  return zero ? eng_tensor_zeros(like->ndim, like->shape, cdt, like->device)
              : eng_new(like->ndim, like->shape, cdt, like->device);
}

/* saved: 0 q, 1 k, 2 v, 3 P (probabilities before dropout, compute dtype).
 * scalars: 0 scale, 1 dropout_p.  ints: 0 seed, 1 offset. */
static int sdpa_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor *q = eng_node_saved(n, 0), *k = eng_node_saved(n, 1), *v = eng_node_saved(n, 2);
  eng_tensor* P = eng_node_saved(n, 3);
  if (!q || !k || !v || !P) return -1;
  at_plan p;
  if (at_plan_make(q, k, v, &p)) return -1;
  double scale = n->scalars[0], dp = n->scalars[1];
  int cdt = P->dtype, nb = p.nb;
  const int64_t* bs = p.bshape;
  int zero = eng_shape_numel(nb, bs) == 0;
  const char* op = "scaled_dot_product_attention backward";
  eng_tensor *G = NULL, *Q = NULL, *K = NULL, *V = NULL, *U = NULL, *Pd = NULL, *dP = NULL;
  eng_tensor *hg = NULL, *hq = NULL, *hk = NULL, *hv = NULL, *gq = NULL, *gk = NULL, *gv = NULL;
  int rc = -1;
  eng_mview vg, vP, vPd, vdP, vq, vk, vv, vc;
  if (!(G = in_dtype(go[0], cdt)) || eng_mview_prep(G, 0, 0, nb, bs, &vg, &hg)) goto done;
  contig_view(P, nb, &vP);
  vPd = vP;
  if (dp > 0.0) {
    if (!(U = dropout_keep(&p, dp, (uint64_t)n->ints[0], (uint64_t)n->ints[1]))) goto done;
    if (!(Pd = eng_new(P->ndim, P->shape, cdt, P->device))) goto done;
    dropout_apply(cdt, P, U, dp, Pd);
    contig_view(Pd, nb, &vPd);
  }
  if (eng_node_needs_grad(n, 2)) { /* dv = Pd^T @ dO */
    eng_mview t = eng_mview_t(vPd);
    if (!(gv = grad_buffer(v, cdt, zero))) goto done;
    eng_mview_of(gv, 0, nb, bs, &vc);
    if (eng_bmm_run(cdt, nb, bs, &t, &vg, &vc, 1.0, 0.0, op)) goto done;
    if (!(gi[2] = eng_grad_to_input(n, 2, gv))) goto done;
  }
  if (eng_node_needs_grad(n, 0) || eng_node_needs_grad(n, 1) || eng_node_needs_grad(n, 3)) {
    /* dP = dO @ v^T, through dropout, then through the softmax: dS */
    if (!(V = in_dtype(v, cdt)) || eng_mview_prep(V, 0, 1, nb, bs, &vv, &hv)) goto done;
    if (!(dP = eng_new(P->ndim, P->shape, cdt, P->device))) goto done;
    contig_view(dP, nb, &vdP);
    if (eng_bmm_run(cdt, nb, bs, &vg, &vv, &vdP, 1.0, 0.0, op)) goto done;
    if (U) dropout_apply(cdt, dP, U, dp, dP);
    int64_t rows = eng_shape_numel(nb, bs) * p.L;
    int kr = cdt == ENG_F32 ? kc_softmax_bw_f32(rows, p.S, 1, (void*)eng_ptr(P), (void*)eng_ptr(dP), (void*)eng_ptr(dP), 0)
                            : kc_softmax_bw_f64(rows, p.S, 1, (void*)eng_ptr(P), (void*)eng_ptr(dP), (void*)eng_ptr(dP), 0);
    if (kr) { eng_err("%s: out of memory", op); goto done; }
    if (eng_node_needs_grad(n, 0)) { /* dq = scale * dS @ k */
      if (!(K = in_dtype(k, cdt)) || eng_mview_prep(K, 0, 0, nb, bs, &vk, &hk)) goto done;
      if (!(gq = grad_buffer(q, cdt, zero))) goto done;
      eng_mview_of(gq, 0, nb, bs, &vc);
      if (eng_bmm_run(cdt, nb, bs, &vdP, &vk, &vc, scale, 0.0, op)) goto done;
      if (!(gi[0] = eng_grad_to_input(n, 0, gq))) goto done;
    }
    if (eng_node_needs_grad(n, 1)) { /* dk = scale * dS^T @ q */
      eng_mview t = eng_mview_t(vdP);
      if (!(Q = in_dtype(q, cdt)) || eng_mview_prep(Q, 0, 0, nb, bs, &vq, &hq)) goto done;
      if (!(gk = grad_buffer(k, cdt, zero))) goto done;
      eng_mview_of(gk, 0, nb, bs, &vc);
      if (eng_bmm_run(cdt, nb, bs, &t, &vq, &vc, scale, 0.0, op)) goto done;
      if (!(gi[1] = eng_grad_to_input(n, 1, gk))) goto done;
    }
    if (eng_node_needs_grad(n, 3) && !(gi[3] = eng_grad_to_input(n, 3, dP))) goto done;
  }
  rc = 0;
done:
  eng_tensor_release(G); eng_tensor_release(Q); eng_tensor_release(K); eng_tensor_release(V);
  eng_tensor_release(U); eng_tensor_release(Pd); eng_tensor_release(dP);
  eng_tensor_release(hg); eng_tensor_release(hq); eng_tensor_release(hk); eng_tensor_release(hv);
  eng_tensor_release(gq); eng_tensor_release(gk); eng_tensor_release(gv);
  return rc;
}

eng_tensor* eng_scaled_dot_product_attention(eng_tensor* q, eng_tensor* k, eng_tensor* v,
                                             eng_tensor* mask, double dropout_p, int is_causal,
                                             double scale) {
  const char* op = "scaled_dot_product_attention";
  ENG_CHECK(q, op); ENG_CHECK(k, op); ENG_CHECK(v, op);
  if (q->dtype != k->dtype || q->dtype != v->dtype)
    return eng_errp("%s: q %s, k %s and v %s must have the same dtype", op, eng_desc(q), eng_desc(k), eng_desc(v));
  if (!eng_dtype_is_floating(q->dtype))
    return eng_errp("%s: q %s: floating point tensors expected", op, eng_desc(q));
  if (q->device != k->device || q->device != v->device || (mask && mask->device != q->device))
    return eng_errp("%s: q %s, k %s, v %s: tensors on different devices", op, eng_desc(q), eng_desc(k), eng_desc(v));
  if (!(dropout_p >= 0.0 && dropout_p <= 1.0))
    return eng_errp("%s: dropout_p must be in [0, 1], got %g", op, dropout_p);
  at_plan p;
  if (at_plan_make(q, k, v, &p)) return NULL;
  if (mask && is_causal)
    return eng_errp("%s: an explicit attn_mask %s cannot be combined with is_causal = true", op, eng_desc(mask));
  int nb = p.nb, pnd = nb + 2;
  const int64_t* bs = p.bshape;
  if (mask) {
    if (mask->dtype != ENG_BOOL && !eng_dtype_is_floating(mask->dtype))
      return eng_errp("%s: attn_mask %s must be bool (true = attend) or floating (added to the scores)", op,
                      eng_desc(mask));
    int64_t tmp[ENG_MAX_DIMS];
    int r = eng_broadcast_shapes(mask->ndim, mask->shape, pnd, p.pshape, tmp, op, NULL, NULL);
    int ok = r == pnd;
    for (int d = 0; ok && d < pnd; d++) ok = tmp[d] == p.pshape[d];
    if (!ok) {
      eng_clear_error();
      return eng_errp("%s: attn_mask %s does not broadcast to the attention weights %s (q %s, k %s)", op,
                      eng_desc(mask), eng_shape_str(pnd, p.pshape), eng_desc(q), eng_desc(k));
    }
  }
  if (!(scale > 0.0)) scale = p.E > 0 ? 1.0 / sqrt((double)p.E) : 1.0;
  int rdt = q->dtype, cdt = compute_dtype(rdt);
  int64_t oshape[ENG_MAX_DIMS];
  for (int d = 0; d < nb; d++) oshape[d] = bs[d];
  oshape[nb] = p.L; oshape[nb + 1] = p.Ev;
  eng_tensor *Q = NULL, *K = NULL, *V = NULL, *Mk = NULL, *hq = NULL, *hk = NULL, *hv = NULL;
  eng_tensor *P = NULL, *U = NULL, *Pd = NULL, *out = NULL;
  uint64_t seed = 0, offset = 0;
  eng_mview vq, vk, vv, vP, vPd, vo;
  if (!(Q = in_dtype(q, cdt)) || !(K = in_dtype(k, cdt)) || !(V = in_dtype(v, cdt))) goto fail;
  if (eng_mview_prep(Q, 0, 0, nb, bs, &vq, &hq) || eng_mview_prep(K, 0, 1, nb, bs, &vk, &hk) ||
      eng_mview_prep(V, 0, 0, nb, bs, &vv, &hv))
    goto fail;
  if (!(P = eng_new(pnd, p.pshape, cdt, q->device)) || !(out = eng_new(pnd, oshape, cdt, q->device))) goto fail;
  contig_view(P, nb, &vP);
  contig_view(out, nb, &vo);
  /* scores = scale * q @ k^T */
  if (eng_bmm_run(cdt, nb, bs, &vq, &vk, &vP, scale, 0.0, op)) goto fail;
  /* masked softmax, batch by batch */
  int mkind = 0;
  int64_t mst[ENG_MAX_DIMS] = {0};
  if (mask) {
    if (mask->dtype == ENG_BOOL) { Mk = eng_tensor_retain(mask); mkind = 1; }
    else { if (!(Mk = in_dtype(mask, cdt))) goto fail; mkind = 2; }
    eng_broadcast_strides(Mk, pnd, p.pshape, mst);
  }
  {
    int64_t tot = eng_shape_numel(nb, bs), idx[ENG_MAX_DIMS] = {0};
    int es = eng_dtype_size(cdt), mes = Mk ? eng_dtype_size(Mk->dtype) : 0;
    for (int64_t it = 0; it < tot && p.L > 0; it++) {
      int64_t op_ = 0, om = 0;
      for (int d = 0; d < nb; d++) { op_ += idx[d] * vP.bs[d]; om += idx[d] * mst[d]; }
      char* blk = vP.p + op_ * es;
      const void* mp = Mk ? (const void*)(eng_ptr(Mk) + om * mes) : NULL;
      if (cdt == ENG_F32)
        kc_attn_softmax_f32(p.L, p.S, (float*)blk, p.S, mp, mkind, mst[nb], mst[nb + 1], is_causal);
      else
        kc_attn_softmax_f64(p.L, p.S, (double*)blk, p.S, mp, mkind, mst[nb], mst[nb + 1], is_causal);
      for (int d = nb - 1; d >= 0; d--) { if (++idx[d] < bs[d]) break; idx[d] = 0; }
    }
  }
  vPd = vP;
  if (dropout_p > 0.0) {
    uint64_t cur;
    eng_rng_get_state(&seed, &cur);
    offset = eng_rng_reserve((uint64_t)P->numel);
    if (!(U = dropout_keep(&p, dropout_p, seed, offset))) goto fail;
    if (!(Pd = eng_new(pnd, p.pshape, cdt, q->device))) goto fail;
    dropout_apply(cdt, P, U, dropout_p, Pd);
    contig_view(Pd, nb, &vPd);
  }
  /* out = P @ v */
  if (eng_bmm_run(cdt, nb, bs, &vPd, &vv, &vo, 1.0, 0.0, op)) goto fail;
  eng_tensor_release(Q); eng_tensor_release(K); eng_tensor_release(V); eng_tensor_release(Mk);
  eng_tensor_release(hq); eng_tensor_release(hk); eng_tensor_release(hv);
  eng_tensor_release(U); eng_tensor_release(Pd);
  Q = K = V = Mk = hq = hk = hv = U = Pd = NULL;
  if (rdt != cdt) {
    eng_tensor* r = eng_as_contig(out, rdt);
    eng_tensor_release(out);
    if (!(out = r)) goto fail;
  }
  eng_tensor* in[4] = {q, k, v, mask && mask->dtype != ENG_BOOL ? mask : NULL};
  if (eng_any_requires_grad(4, in)) {
    eng_node* nd = eng_record("ScaledDotProductAttentionBackward", sdpa_bw, 4, in, out);
    if (!nd || eng_node_save(nd, q) || eng_node_save(nd, k) || eng_node_save(nd, v) || eng_node_save(nd, P))
      goto fail;
    nd->scalars[0] = scale; nd->scalars[1] = dropout_p;
    nd->ints[0] = (int64_t)seed; nd->ints[1] = (int64_t)offset;
  }
  eng_tensor_release(P);
  return out;
fail:
  eng_tensor_release(Q); eng_tensor_release(K); eng_tensor_release(V); eng_tensor_release(Mk);
  eng_tensor_release(hq); eng_tensor_release(hk); eng_tensor_release(hv);
  eng_tensor_release(P); eng_tensor_release(U); eng_tensor_release(Pd); eng_tensor_release(out);
  return NULL;
}
