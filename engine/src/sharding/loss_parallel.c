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
 * Devices: the local phases (ops/vocab_parallel.c) run on the logits' device,
 * CPU loops (the reference) or CUDA kernels (kernels/cuda/vocab_parallel.cu),
 * and the all_reduces take the same buffers (NCCL on a CUDA group): on CUDA
 * the logits never leave the device; the host reads two agreed numbers (the
 * error code and the vocab-size sum) once, after the three all_reduces.
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
#include "ops/vocab_parallel.h"
#include "autograd/autograd.h"

enum { RED_NONE = 0, RED_MEAN = 1, RED_SUM = 2 };

/* saved: 0 logits (contiguous [..., V_local], compute dtype), 1 targets (i64, [M]), 2 lse ([M], global
 * log-sum-exp), 3 ws (f64 [1]: the mean's divisor, the count or the sum of the row weights), 4 (weighted only) the
 * row weights weight[t_i] (f64, [M]); all on the logits' device.  ints: 0 M, 1 V_local, 2 vocab_offset,
 * 3 ignore_index, 4 reduction, 6 weighted. */
static int cevp_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  if (!eng_node_needs_grad(n, 0)) return 0;
  eng_tensor *X = eng_node_saved(n, 0), *T = eng_node_saved(n, 1), *L = eng_node_saved(n, 2);
  eng_tensor* WS = eng_node_saved(n, 3);
  eng_tensor* RW = n->ints[6] ? eng_node_saved(n, 4) : NULL;
  if (!X || !T || !L || !WS || (n->ints[6] && !RW)) return -1;
  int red = (int)n->ints[4];
  /* the upstream gradient stays on the device: per row (none) or one element (mean divides by ws there) */
  eng_tensor* G = eng_as_contig(go[0], X->dtype == ENG_F64 ? ENG_F64 : ENG_F32);
  eng_tensor* gx = G ? eng_vp_ce_grad(X, L, T, n->ints[2], n->ints[3], G, red == RED_NONE, RW,
                                      red == RED_MEAN ? WS : NULL) : NULL;
  int rc = -1;
  if (gx && (gi[0] = eng_grad_to_input(n, 0, gx))) rc = 0;
  eng_tensor_release(G); eng_tensor_release(gx);
  return rc;
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
  int rdt = x->dtype, cdt = rdt == ENG_F64 ? ENG_F64 : ENG_F32, dev = x->device;
  eng_tensor *X = NULL, *T = NULL, *mx = NULL, *se = NULL, *tl = NULL, *lse = NULL, *out = NULL, *Wt = NULL, *RW = NULL,
             *WS = NULL;
  /* Every buffer lives on the logits' device (CUDA: the kernels of ops/vocab_parallel.c, NCCL all_reduces; no host
   * copy of the logits).  Local errors travel in the last slot of the max all_reduce (1 slice out of range, 2 a
   * target out of range) and the local vocab sizes in the last slot of the sum; both are read once, after the three
   * all_reduces (every rank reads the same values, so every rank fails alike; the kernels are safe with bad
   * targets). */
  double slice_err = (vocab_total < 1 || vocab_offset < 0 || vocab_offset + V > vocab_total) ? 1.0 : 0.0;
  int64_t Mp1 = M + 1, one = 1;
  if (!(T = eng_as_contig(target, ENG_I64)) || !(X = eng_as_contig(x, cdt))) goto fail;
  if (weight && (!(Wt = eng_as_contig(weight, ENG_F64)) || !(RW = eng_new(1, &M, ENG_F64, dev)))) goto fail;
  if (!(mx = eng_new(1, &Mp1, ENG_F64, dev)) || !(se = eng_new(1, &Mp1, ENG_F64, dev)) ||
      !(tl = eng_new(1, &M, ENG_F64, dev)) || !(lse = eng_new(1, &M, cdt, dev)) || !(WS = eng_new(1, &one, ENG_F64, dev)))
    goto fail;
  /* 1: row max (and the error code); 2: sum of exp (and the vocab sizes); 3: the target logit */
  if (eng_vp_ce_prep(T, Wt, vocab_total, ignore_index, slice_err, RW, mx, WS) || eng_vp_ce_max(X, mx) ||
      allreduce(group, mx, ENG_REDUCE_MAX) ||
      eng_vp_ce_sumexp(X, mx, T, vocab_offset, ignore_index, se, tl) ||
      allreduce(group, se, ENG_REDUCE_SUM) || allreduce(group, tl, ENG_REDUCE_SUM))
    goto fail;
  double flags[2];
  if (eng_vp_read(mx, M, 1, &flags[0]) || eng_vp_read(se, M, 1, &flags[1])) goto fail;
  if (flags[0] != 0.0) {
    if (slice_err == 1.0)
      eng_errp("%s: this rank's vocab slice [%lld, %lld) (logits %s) is not inside [0, vocab_total = %lld)", op,
               (long long)vocab_offset, (long long)(vocab_offset + V), eng_desc(x), (long long)vocab_total);
    else if (flags[0] == 2.0) {
      /* the error path reads the targets back to name the first bad one */
      eng_tensor* th = eng_op_host(T, ENG_I64);
      const int64_t* tg = th ? (const int64_t*)eng_ptr(th) : NULL;
      int64_t i = 0;
      while (tg && i < M && (tg[i] == ignore_index || (tg[i] >= 0 && tg[i] < vocab_total))) i++;
      if (tg && i < M)
        eng_errp("%s: target %lld at flat position %lld is out of range for %lld classes (class ids are 0-based: "
                 "valid 0..%lld, or ignore_index %lld)", op, (long long)tg[i], (long long)i + 1,
                 (long long)vocab_total, (long long)vocab_total - 1, (long long)ignore_index);
      else if (tg)
        eng_errp("%s: a target out of range on another rank of the group %s (the targets must be replicated)", op,
                 group ? eng_pg_name(group) : "?");
      eng_tensor_release(th);
    } else
      eng_errp("%s: invalid arguments on another rank of the group %s (vocab slice or targets out of range)", op,
               group ? eng_pg_name(group) : "?");
    goto fail;
  }
  if (flags[1] != (double)vocab_total) {
    eng_errp("%s: the local vocab sizes over the group %s add up to %lld, not vocab_total = %lld (logits %s on this "
             "rank)", op, group ? eng_pg_name(group) : "(none)", (long long)flags[1], (long long)vocab_total,
             eng_desc(x));
    goto fail;
  }
  int64_t oshape[ENG_MAX_DIMS];
  for (int d = 0; d < tnd; d++) oshape[d] = x->shape[d];
  if (!(out = eng_new(reduction == RED_NONE ? tnd : 0, oshape, cdt, dev))) goto fail;
  if (eng_vp_ce_loss(mx, se, tl, T, ignore_index, RW, WS, reduction, lse, out)) goto fail;
  if (rdt != cdt) {
    eng_tensor* r = eng_as_contig(out, rdt);
    eng_tensor_release(out);
    if (!(out = r)) goto fail;
  }
  if (eng_any_requires_grad(1, &x)) {
    eng_node* nd = eng_record("CrossEntropyVocabParallelBackward", cevp_bw, 1, &x, out);
    if (!nd || eng_node_save(nd, X) || eng_node_save(nd, T) || eng_node_save(nd, lse) || eng_node_save(nd, WS) ||
        (RW && eng_node_save(nd, RW)))
      goto fail;
    nd->ints[0] = M; nd->ints[1] = V; nd->ints[2] = vocab_offset; nd->ints[3] = ignore_index;
    nd->ints[4] = reduction; nd->ints[6] = RW != NULL;
  }
  if (wsum_out && eng_vp_read(WS, 0, 1, wsum_out)) goto fail;
  eng_tensor_release(X); eng_tensor_release(T); eng_tensor_release(mx); eng_tensor_release(se);
  eng_tensor_release(tl); eng_tensor_release(lse); eng_tensor_release(Wt); eng_tensor_release(RW);
  eng_tensor_release(WS);
  return out;
fail:
  eng_tensor_release(X); eng_tensor_release(T); eng_tensor_release(mx); eng_tensor_release(se);
  eng_tensor_release(tl); eng_tensor_release(lse); eng_tensor_release(out); eng_tensor_release(Wt);
  eng_tensor_release(RW); eng_tensor_release(WS);
  return NULL;
}
