/* loss_parallel.c: vocab-parallel cross entropy (Megatron's "parallel
 * cross entropy", PyTorch's loss_parallel).  Each rank of a process group
 * holds a contiguous slice [vocab_offset, vocab_offset + V_local) of the class
 * (last) dim of the logits.  Forward: three all_reduces over the group (row
 * max, row sum of exp(x - max), target logit), never an all_gather of the
 * logits; the loss is the same on every rank.  Backward: no communication;
 * the local logits gradient is (softmax - onehot) restricted to the local
 * classes, scaled by the upstream gradient (and 1/count for mean).
 *
 * Ranks must call it with the same row count (the same targets).  Local
 * argument errors that could differ between ranks (the vocab slice, targets
 * out of range) are exchanged inside the first all_reduce, so every rank
 * fails with the same message instead of some waiting in a collective.
 *
 * With class weights (PyTorch's loss_parallel with a weight): every rank
 * holds the replicated weight [vocab_total] and the replicated targets, so the
 * weight of each row's target class is known locally: row i's loss is scaled
 * by weight[t_i], mean divides by the sum of those weights, and the gradient
 * of row i is scaled the same way (only the target's weight enters it) -- the
 * same three all_reduces, no more.
 *
 * A distributed op (it takes a process group): it lives with the sharding
 * rules, whose cross_entropy rule for logits sharded on the class dim runs it. */
#include "core/internal.h"
#include "ops/ops.h"
#include "sharding/sharding.h"
#include <math.h>

enum { RED_NONE = 0, RED_MEAN = 1, RED_SUM = 2 };

/* saved: 0 logits (contiguous [..., V_local], compute dtype), 1 targets (i64,
 * [M]), 2 lse ([M], global log-sum-exp), 3 (weighted only) the row weights
 * weight[t_i] (f64, [M]).  ints: 0 M, 1 V_local, 2 vocab_offset,
 * 3 ignore_index, 4 reduction, 6 weighted; scalars[0] the mean's divisor
 * (the count, or the sum of the row weights). */
static int cevp_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  if (!eng_node_needs_grad(n, 0)) return 0;
  eng_tensor *X = eng_node_saved(n, 0), *T = eng_node_saved(n, 1), *L = eng_node_saved(n, 2);
  eng_tensor* RW = n->ints[6] ? eng_node_saved(n, 3) : NULL;
  if (!X || !T || !L || (n->ints[6] && !RW)) return -1;
  int64_t M = n->ints[0], V = n->ints[1], off = n->ints[2], ignore = n->ints[3];
  const double* rw = RW ? (const double*)eng_ptr(RW) : NULL;
  int red = (int)n->ints[4];
  int cdt = X->dtype;
  eng_tensor *G = NULL, *gx = NULL;
  int rc = -1;
  double gconst = 0.0;
  if (red == RED_NONE) {
    if (!(G = eng_as_contig(go[0], ENG_F64))) goto done;
  } else {
    double g;
    if (eng_tensor_item(go[0], &g)) goto done;
    gconst = red == RED_MEAN ? g / n->scalars[0] : g;
  }
  if (!(gx = eng_new(X->ndim, X->shape, cdt, X->device))) goto done;
  const int64_t* tg = (const int64_t*)eng_ptr(T);
  const double* gs = G ? (const double*)eng_ptr(G) : NULL;
  for (int64_t i = 0; i < M; i++) {
    int64_t t = tg[i];
    double s = t == ignore ? 0.0 : (gs ? gs[i] : gconst) * (rw ? rw[i] : 1.0);
    int64_t tl = t - off;
    if (cdt == ENG_F32) {
      const float* x = (const float*)eng_ptr(X) + i * V;
      float* o = (float*)eng_ptr(gx) + i * V;
      float lse = ((const float*)eng_ptr(L))[i];
      if (s == 0.0) { for (int64_t c = 0; c < V; c++) o[c] = 0.0f; continue; }
      for (int64_t c = 0; c < V; c++) o[c] = (float)(s * (double)expf(x[c] - lse));
      if (tl >= 0 && tl < V) o[tl] -= (float)s;
    } else {
      const double* x = (const double*)eng_ptr(X) + i * V;
      double* o = (double*)eng_ptr(gx) + i * V;
      double lse = ((const double*)eng_ptr(L))[i];
      if (s == 0.0) { for (int64_t c = 0; c < V; c++) o[c] = 0.0; continue; }
      for (int64_t c = 0; c < V; c++) o[c] = s * exp(x[c] - lse);
      if (tl >= 0 && tl < V) o[tl] -= s;
    }
  }
  if ((gi[0] = eng_grad_to_input(n, 0, gx))) rc = 0;
done:
  eng_tensor_release(G); eng_tensor_release(gx);
  return rc;
}

/* Reads element i of a contiguous f32/f64 tensor as double. */
static inline double rd(const eng_tensor* t, int64_t i) {
  return t->dtype == ENG_F32 ? (double)((const float*)eng_ptr(t))[i] : ((const double*)eng_ptr(t))[i];
}

static int allreduce(struct eng_pg* g, eng_tensor* t, int op) {
  if (!g) return 0;
  return eng_pg_all_reduce(g, t, op, NULL);
}

eng_tensor* eng_cross_entropy_vocab_parallel(eng_tensor* logits, eng_tensor* target, int64_t vocab_offset,
                                             int64_t vocab_total, struct eng_pg* group, int64_t ignore_index,
                                             int reduction) {
  return sh_cross_entropy_vocab_parallel_w(logits, target, NULL, vocab_offset, vocab_total, group, ignore_index,
                                           reduction, NULL);
}

eng_tensor* sh_cross_entropy_vocab_parallel_w(eng_tensor* logits, eng_tensor* target, eng_tensor* weight,
                                              int64_t vocab_offset, int64_t vocab_total, struct eng_pg* group,
                                              int64_t ignore_index, int reduction, double* wsum_out) {
  const char* op = "cross_entropy_vocab_parallel";
  ENG_CHECK(logits, op); ENG_CHECK(target, op);
  if (eng_meta_check(logits, op)) return NULL;
  if (eng_meta_check(target, op)) return NULL;
  eng_tensor* x = logits;
  if (!eng_dispatch_local_mode() && (x->dist || target->dist))
    return eng_errp("%s: takes this rank's local logits and the (replicated) targets as plain tensors, got %s and "
                    "%s (use to_local(), or cross_entropy on a DTensor sharded on the class dim)", op,
                    x->dist ? "a DTensor" : eng_desc(x), target->dist ? "a DTensor" : eng_desc(target));
  if (!eng_dtype_is_floating(x->dtype)) return eng_errp("%s: logits %s must be floating point", op, eng_desc(x));
  if (target->dtype != ENG_I64 && target->dtype != ENG_I32)
    return eng_errp("%s: target %s must hold class indices (i64 or i32)", op, eng_desc(target));
  if (x->device != target->device)
    return eng_errp("%s: logits %s and target %s are on different devices", op, eng_desc(x), eng_desc(target));
  if (x->device == ENG_CUDA) {
    /* host fallback (no device kernel yet): the logits go to the host through a differentiable copy, the
     * collectives run over MPI on the same group, and the loss comes back to the device (so does the
     * gradient, through the copies' backward) */
    eng_tensor* xh = eng_tensor_to_device(x, ENG_CPU);
    eng_tensor* th = xh ? eng_op_host(target, target->dtype) : NULL;
    eng_tensor* wh = th && weight ? eng_op_host(weight, weight->dtype) : NULL;
    eng_tensor* r = th && (wh || !weight) ? sh_cross_entropy_vocab_parallel_w(xh, th, wh, vocab_offset, vocab_total,
                                                                              group, ignore_index, reduction,
                                                                              wsum_out) : NULL;
    eng_tensor* out = r ? eng_tensor_to_device(r, ENG_CUDA) : NULL;
    eng_tensor_release(xh); eng_tensor_release(th); eng_tensor_release(wh); eng_tensor_release(r);
    return out;
  }
  if (reduction < RED_NONE || reduction > RED_SUM)
    return eng_errp("%s: reduction code %d is invalid (0 none, 1 mean, 2 sum)", op, reduction);
  if (x->ndim < 1)
    return eng_errp("%s: logits %s must be [..., V_local] (classes in the last dim)", op, eng_desc(x));
  int tnd = x->ndim - 1;
  int ok = target->ndim == tnd;
  for (int d = 0; ok && d < tnd; d++) ok = target->shape[d] == x->shape[d];
  if (!ok)
    return eng_errp("%s: target %s does not match logits %s (expected target shape %s: the logits' shape without "
                    "the class (last) dim)", op, eng_desc(target), eng_desc(x), eng_shape_str(tnd, x->shape));
  if (weight && (weight->ndim != 1 || weight->shape[0] != vocab_total || !eng_dtype_is_floating(weight->dtype)))
    return eng_errp("%s: weight %s must be a floating 1-d tensor of vocab_total = %lld class weights", op,
                    eng_desc(weight), (long long)vocab_total);
  if (group && !eng_pg_is_member(group))
    return eng_errp("%s: this rank is not a member of the process group %s", op, eng_pg_name(group));
  int64_t V = x->shape[x->ndim - 1], M = 1;
  for (int d = 0; d < tnd; d++) M *= x->shape[d];
  int rdt = x->dtype, cdt = rdt == ENG_F64 ? ENG_F64 : ENG_F32;
  eng_tensor *X = NULL, *T = NULL, *mx = NULL, *se = NULL, *tl = NULL, *lse = NULL, *out = NULL, *Wt = NULL, *RW = NULL;
  /* Local errors are reported through the max all_reduce (code in the last
   * slot): 1 slice out of range, 2 a target out of range. */
  double err = 0.0;
  int64_t bad_pos = -1, bad_t = 0;
  if (vocab_total < 1 || vocab_offset < 0 || vocab_offset + V > vocab_total) err = 1.0;
  if (!(T = eng_as_contig(target, ENG_I64))) goto fail;
  const int64_t* tg = (const int64_t*)eng_ptr(T);
  /* the row weights weight[t_i] (targets and weight are replicated: no communication) */
  if (weight && (!(Wt = eng_as_contig(weight, ENG_F64)) || !(RW = eng_new(1, &M, ENG_F64, ENG_CPU)))) goto fail;
  const double* wv = Wt ? (const double*)eng_ptr(Wt) : NULL;
  double* rw = RW ? (double*)eng_ptr(RW) : NULL;
  double wsum = 0.0;
  for (int64_t i = 0; i < M; i++) {
    if (rw) rw[i] = 0.0;
    if (tg[i] == ignore_index) continue;
    if (tg[i] < 0 || tg[i] >= vocab_total) {
      if (err == 0.0) { err = 2.0; bad_pos = i; bad_t = tg[i]; }
      break;
    }
    if (rw) rw[i] = wv[tg[i]];
    wsum += rw ? rw[i] : 1.0;
  }
  int64_t Mp1 = M + 1, two = M + 1;
  if (!(X = eng_as_contig(x, cdt))) goto fail;
  if (!(mx = eng_new(1, &Mp1, ENG_F64, ENG_CPU)) || !(se = eng_new(1, &two, ENG_F64, ENG_CPU)) ||
      !(tl = eng_new(1, &M, ENG_F64, ENG_CPU)) || !(lse = eng_new(1, &M, cdt, ENG_CPU)))
    goto fail;
  double *pm = (double*)eng_ptr(mx), *ps = (double*)eng_ptr(se), *pt = (double*)eng_ptr(tl);
  for (int64_t i = 0; i < M; i++) {
    double m = -INFINITY;
    for (int64_t c = 0; c < V; c++) { double v = rd(X, i * V + c); if (v > m) m = v; }
    pm[i] = m;
  }
  pm[M] = err;
  /* 1: row max (and the error code) */
  if (allreduce(group, mx, ENG_REDUCE_MAX)) goto fail;
  if (pm[M] != 0.0) {
    if (err == 1.0)
      eng_errp("%s: this rank's vocab slice [%lld, %lld) (logits %s) is not inside [0, vocab_total = %lld)", op,
               (long long)vocab_offset, (long long)(vocab_offset + V), eng_desc(x), (long long)vocab_total);
    else if (err == 2.0)
      eng_errp("%s: target %lld at flat position %lld is out of range for %lld classes (class ids are 0-based: valid "
               "0..%lld, or ignore_index %lld)", op, (long long)bad_t, (long long)bad_pos + 1, (long long)vocab_total,
               (long long)vocab_total - 1, (long long)ignore_index);
    else
      eng_errp("%s: invalid arguments on another rank of the group %s (vocab slice or targets out of range)", op,
               group ? eng_pg_name(group) : "?");
    goto fail;
  }
  for (int64_t i = 0; i < M; i++) {
    double m = pm[i], s = 0.0;
    if (isfinite(m)) for (int64_t c = 0; c < V; c++) s += exp(rd(X, i * V + c) - m);
    ps[i] = s;
    int64_t t = tg[i] - vocab_offset;
    pt[i] = (tg[i] != ignore_index && t >= 0 && t < V) ? rd(X, i * V + t) : 0.0;
  }
  ps[M] = (double)V;
  /* 2: sum of exp (and the vocab sizes); 3: the target logit */
  if (allreduce(group, se, ENG_REDUCE_SUM) || allreduce(group, tl, ENG_REDUCE_SUM)) goto fail;
  if (ps[M] != (double)vocab_total) {
    eng_errp("%s: the local vocab sizes over the group %s add up to %lld, not vocab_total = %lld (logits %s on this "
             "rank)", op, group ? eng_pg_name(group) : "(none)", (long long)ps[M], (long long)vocab_total, eng_desc(x));
    goto fail;
  }
  int64_t oshape[ENG_MAX_DIMS];
  for (int d = 0; d < tnd; d++) oshape[d] = x->shape[d];
  if (!(out = eng_new(reduction == RED_NONE ? tnd : 0, oshape, cdt, ENG_CPU))) goto fail;
  double total = 0.0;
  for (int64_t i = 0; i < M; i++) {
    double l = pm[i] + log(ps[i]);
    if (cdt == ENG_F32) ((float*)eng_ptr(lse))[i] = (float)l; else ((double*)eng_ptr(lse))[i] = l;
    double loss = tg[i] == ignore_index ? 0.0 : (l - pt[i]) * (rw ? rw[i] : 1.0);
    total += loss;
    if (reduction == RED_NONE) {
      if (cdt == ENG_F32) ((float*)eng_ptr(out))[i] = (float)loss; else ((double*)eng_ptr(out))[i] = loss;
    }
  }
  if (reduction != RED_NONE) {
    if (reduction == RED_MEAN) total = total / wsum; /* no target (count 0): NaN, as cross_entropy */
    if (cdt == ENG_F32) *(float*)eng_ptr(out) = (float)total; else *(double*)eng_ptr(out) = total;
  }
  if (rdt != cdt) {
    eng_tensor* r = eng_as_contig(out, rdt);
    eng_tensor_release(out);
    if (!(out = r)) goto fail;
  }
  if (eng_any_requires_grad(1, &x)) {
    eng_node* nd = eng_record("CrossEntropyVocabParallelBackward", cevp_bw, 1, &x, out);
    if (!nd || eng_node_save(nd, X) || eng_node_save(nd, T) || eng_node_save(nd, lse) || (RW && eng_node_save(nd, RW)))
      goto fail;
    nd->ints[0] = M; nd->ints[1] = V; nd->ints[2] = vocab_offset; nd->ints[3] = ignore_index;
    nd->ints[4] = reduction; nd->ints[6] = RW != NULL;
    nd->scalars[0] = wsum;
  }
  if (wsum_out) *wsum_out = wsum;
  eng_tensor_release(X); eng_tensor_release(T); eng_tensor_release(mx); eng_tensor_release(se);
  eng_tensor_release(tl); eng_tensor_release(lse); eng_tensor_release(Wt); eng_tensor_release(RW);
  return out;
fail:
  eng_tensor_release(X); eng_tensor_release(T); eng_tensor_release(mx); eng_tensor_release(se);
  eng_tensor_release(tl); eng_tensor_release(lse); eng_tensor_release(out); eng_tensor_release(Wt);
  eng_tensor_release(RW);
  return NULL;
}
