/* loss.c: sharding rule of cross_entropy(logits, target) (sharding/sharding.h).
 * Logits [C], [N, C] or [N, C, d1, ...] (class dim cd = 1, or 0 for 1-d);
 * target = logits' shape without the class dim.  Per mesh dim:
 *   logits S(d), d != cd, target S(d') (the same dim of the target) ->
 *     none: S(d'); sum: Partial(sum); mean: Partial(sum) of local sum / GLOBAL
 *     count of non-ignored targets (one all_reduce of that count over each
 *     mesh dim that shards the batch, inside the local function);
 *   logits S(cd), target R, no label smoothing (loss parallel) -> Replicate,
 *     via eng_cross_entropy_vocab_parallel over that mesh dim's group (3
 *     all_reduces forward, none backward; the logits gradient stays Shard(cd):
 *     no all_gather of the logits); a class dim that is not the last is moved
 *     last by a permute of the local shard.  Offered on the first mesh dim
 *     that shards the class dim only (one group);
 *   all R -> R.
 * Partial logits are replicated first (the loss is not linear); inside
 * dist.loss_parallel, with the class dim sharded on another mesh dim, a
 * Partial is an error before any communication (PyTorch's loss_parallel
 * accepts only Shard or Replicate beside it). */
#include "dtensor/dtensor_impl.h"
#include "sharding/sharding.h"
#include "ops/ops.h"
#include "eng/ops_nn.h"
#include "eng/ops_pointwise.h"
#include "eng/ops_shape.h"

enum { RED_NONE = 0, RED_MEAN = 1, RED_SUM = 2 };

static int class_dim(const eng_dist_spec* x) { return x->ndim == 1 ? 0 : 1; }
static int target_dim(int cd, int d) { return d < cd ? d : d - 1; }

/* The mesh dim that shards the class dim first (-1 none).  With a Partial on another mesh dim: inside
 * loss_parallel an error (PyTorch's loss_parallel: "accepts only Shard or Replicate on non-class mesh
 * dimensions"); outside, -1 (no vocab-parallel offer: the general path reduces the Partial first, as PyTorch's
 * log_softmax + nll_loss strategies do). */
static int class_mesh_dim(const eng_dist_spec* x, int cd) {
  int vm = -1;
  for (int j = 0; j < x->mesh_ndim && vm < 0; j++)
    if (sh_is_S(&x->placements[j]) && x->placements[j].dim == cd) vm = j;
  if (vm < 0) return -1;
  for (int j = 0; j < x->mesh_ndim; j++)
    if (x->placements[j].kind == ENG_PLACEMENT_PARTIAL) {
      if (!eng_dtensor_loss_parallel()) return -1;
      char b[64];
      eng_placement_describe(&x->placements[j], b, sizeof b);
      return eng_err("loss parallel (logits sharded on the class dim %d over mesh dim %d) accepts only Shard or "
                     "Replicate on the other mesh dims, got %s on mesh dim %d (reduce the Partial first: "
                     "redistribute the logits to Replicate there)", cd + dt_base(), vm + dt_base(), b,
                     j + dt_base()) - 1;
    }
  return vm;
}

static int ce_push(eng_strategy* out, int cap, int n, eng_placement x, eng_placement t, eng_placement o) {
  eng_strategy st;
  memset(&st, 0, sizeof st);
  st.in[0] = x; st.in[1] = t; st.out[0] = o;
  return sh_push(out, cap, n, &st);
}

static int ce_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  const eng_dist_spec* x = s[0];
  int cd = class_dim(x), red = (int)c->ints[1], n = 0;
  for (int d = 0; d < x->ndim && n >= 0; d++) {
    if (d == cd) continue;
    int td = target_dim(cd, d);
    n = ce_push(out, cap, n, sh_S(d), sh_S(td), red == RED_NONE ? sh_S(td) : sh_P(ENG_REDUCE_SUM));
  }
  /* vocab parallel on the first mesh dim that shards the class dim now (not where another placement would have
   * to become Shard(class) too: the class dim would end up on two mesh dims) */
  int vm = class_mesh_dim(x, cd);
  if (vm < -1) return -1;
  if (n >= 0 && vm == m && c->scalars[0] == 0.0) n = ce_push(out, cap, n, sh_S(cd), sh_R(), sh_R());
  if (n < 0) return n;
  return sh_all_replicate(out, cap, n, 2, 1);
}

static int ce_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* nd, int64_t (*shapes)[8]) {
  const eng_dist_spec *x = s[0], *t = s[1];
  if (x->ndim < 1) return eng_err("logits must be [C], [N, C] or [N, C, d1, ...], got a 0-d tensor");
  int cd = class_dim(x), k = 0;
  int64_t ts[8];
  for (int d = 0; d < x->ndim; d++) if (d != cd) ts[k++] = x->shape[d];
  int ok = t->ndim == k;
  for (int d = 0; ok && d < k; d++) ok = t->shape[d] == ts[d];
  if (!ok)
    return eng_err("target %s does not match logits %s (expected target shape %s: the logits' shape without the "
                   "class dim)", eng_shape_str(t->ndim, t->shape), eng_shape_str(x->ndim, x->shape),
                   eng_shape_str(k, ts));
  if (c->ints[1] == RED_NONE) {
    nd[0] = k;
    memcpy(shapes[0], ts, sizeof(int64_t) * (size_t)k);
  } else nd[0] = 0;
  return 0;
}

/* Non-ignored targets of this rank's (contiguous CPU) target shard. */
static int local_count(eng_tensor* t, int64_t ignore, double* out) {
  eng_tensor* tp = dt_plain(t); /* the local targets (a plain view) */
  eng_tensor* T = tp ? eng_op_host(tp, ENG_I64) : NULL; /* CUDA targets: read back (one copy of this rank's targets) */
  eng_tensor_release(tp);
  if (!T) return -1;
  const int64_t* p = (const int64_t*)eng_ptr(T);
  int64_t n = 0;
  for (int64_t i = 0; i < T->numel; i++) n += p[i] != ignore;
  eng_tensor_release(T);
  *out = (double)n;
  return 0;
}

/* mean over a sharded batch: outs[0] = r (this rank's sum) / the sum over the
 * batch groups of den (this rank's part of the divisor: the count, or the
 * weights, of its non-ignored targets); rc != 0 when this rank failed.  The
 * local loss may fail on some ranks only (their targets out of range): agree
 * over the batch groups first, so that every rank fails (naming the rank)
 * instead of the others waiting in the divisor's all_reduce.  Consumes r. */
static int batch_mean(const eng_dist_spec* x, const int* batch, int nb, eng_tensor* r, int rc, double den,
                      eng_tensor** outs) {
  eng_tensor* ct = NULL;
  int agreed = rc ? 1 : 0;
  for (int i = 0; i < nb; i++) {
    eng_pg* g = eng_mesh_get_group(x->mesh, batch[i]);
    if (eng_pg_agree(g, agreed, 0, "mean over the sharded batch") && !agreed) agreed = 2;
    eng_pg_release(g);
  }
  if (agreed && !rc) rc = -1;
  if (!rc) rc = (ct = eng_tensor_full(0, NULL, den, ENG_F64, ENG_CPU)) ? 0 : -1;
  for (int i = 0; i < nb && !rc; i++) {
    eng_pg* g = eng_mesh_get_group(x->mesh, batch[i]);
    rc = eng_pg_all_reduce(g, ct, ENG_REDUCE_SUM, NULL);
    eng_pg_release(g);
  }
  if (!rc) rc = eng_tensor_item(ct, &den);
  eng_tensor_release(ct);
  if (!rc) outs[0] = eng_mul_scalar(r, den != 0 ? 1.0 / den : (0.0 / 0.0));
  eng_tensor_release(r);
  return rc ? -1 : (outs[0] ? 0 : -1);
}

/* The vocab-parallel loss of this rank's logits shard (class dim cd sharded over mesh dim vm), the class dim moved
 * last by a permute of the local shard when it is not; *den: the mean's divisor on this rank's rows. */
static eng_tensor* vocab_parallel(const eng_dist_spec* x, int vm, int cd, eng_tensor* logits, eng_tensor* target,
                                  eng_tensor* weight, int64_t ignore, int red, double* den) {
  eng_tensor* lx = logits;
  int nd = logits->ndim;
  if (cd != nd - 1) {
    int perm[ENG_MAX_DIMS], k = 0;
    for (int d = 0; d < nd; d++) if (d != cd) perm[k++] = d;
    perm[k] = cd;
    if (!(lx = eng_permute(logits, nd, perm))) return NULL;
  } else eng_tensor_retain(lx);
  eng_pg* g = eng_mesh_get_group(x->mesh, vm);
  eng_tensor* r = sh_cross_entropy_vocab_parallel_w(lx, target, weight, x->offset[cd], x->shape[cd], g, ignore, red,
                                                    den);
  eng_pg_release(g);
  eng_tensor_release(lx);
  return r;
}

static int ce_local(const eng_op_call* c, const eng_dist_spec* const* is, const eng_dist_spec* const* os,
                    eng_tensor** outs) {
  (void)os;
  const eng_dist_spec* x = is[0];
  eng_tensor *logits = c->in[0], *target = c->in[1];
  int cd = class_dim(x), red = (int)c->ints[1], vm = -1, batch[8], nb = 0;
  int64_t ignore = c->ints[0];
  for (int m = 0; m < x->mesh_ndim; m++) {
    const eng_placement* p = &x->placements[m];
    if (!sh_is_S(p)) continue;
    if (p->dim != cd) batch[nb++] = m;
    else if (vm < 0) vm = m;
    else return eng_err("the class dim is sharded over two mesh dims (%d and %d)", vm + dt_base(), m + dt_base());
  }
  if (!x->member) return eng_err("not a member of the mesh");
  int rd = red == RED_MEAN && nb > 0 ? RED_SUM : red;
  eng_tensor* r;
  double cnt = 0;
  if (vm >= 0) r = vocab_parallel(x, vm, cd, logits, target, NULL, ignore, rd, &cnt);
  else
    r = eng_cross_entropy(logits, target, ignore, rd, c->scalars[0]);
  if (rd == red) { outs[0] = r; return r ? 0 : -1; }
  int rc = r ? (vm >= 0 ? 0 : local_count(target, ignore, &cnt)) : -1;
  return batch_mean(x, batch, nb, r, rc, cnt, outs);
}

const eng_op_def eng_opdef_cross_entropy = {"cross_entropy", 1, ce_rule, ce_shape, NULL, ce_local, 1, 0, 1};

/* ------------------------------------------------------------ nll_loss
 * nll_loss(logp, target, weight) and (ints[2] = 1) cross_entropy(logits,
 * target, weight) with class weights (scalars[0] = label_smoothing): as cross_entropy's batch rule (logp S(d),
 * d not the class dim, target S(d'), weight R -> none: S(d'); sum:
 * Partial(sum); mean: Partial(sum) of the local sum / the GLOBAL sum of the
 * non-ignored targets' weights: one all_reduce per batch mesh dim).  A
 * sharded class dim is replicated first (the all-Replicate strategy). */
static int nll_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  const eng_dist_spec* x = s[0];
  int cd = class_dim(x), red = (int)c->ints[1], n = 0;
  for (int d = 0; d < x->ndim && n >= 0; d++) {
    if (d == cd) continue;
    int td = target_dim(cd, d);
    eng_strategy st;
    memset(&st, 0, sizeof st);
    st.in[0] = sh_S(d); st.in[1] = sh_S(td); st.in[2] = sh_R();
    st.out[0] = red == RED_NONE ? sh_S(td) : sh_P(ENG_REDUCE_SUM);
    n = sh_push(out, cap, n, &st);
  }
  /* cross_entropy with class weights on class-sharded logits: vocab parallel as cross_entropy's rule (the
   * replicated weight gives every row's target weight locally: still 3 all_reduces) */
  if (c->ints[2] && n >= 0) {
    int vm = class_mesh_dim(x, cd);
    if (vm < -1) return -1;
    if (vm == m && c->scalars[0] == 0.0) {
      eng_strategy st;
      memset(&st, 0, sizeof st);
      st.in[0] = sh_S(cd); st.in[1] = sh_R(); st.in[2] = sh_R(); st.out[0] = sh_R();
      n = sh_push(out, cap, n, &st);
    }
  }
  if (n < 0) return n;
  return sh_all_replicate(out, cap, n, 3, 1);
}

static int nll_local(const eng_op_call* c, const eng_dist_spec* const* is, const eng_dist_spec* const* os,
                     eng_tensor** outs) {
  (void)os;
  const eng_dist_spec* x = is[0];
  int cd = class_dim(x), red = (int)c->ints[1], batch[8], nb = 0, vm = -1;
  for (int m = 0; m < x->mesh_ndim; m++) {
    const eng_placement* p = &x->placements[m];
    if (!sh_is_S(p)) continue;
    if (p->dim != cd) batch[nb++] = m;
    else if (vm < 0 && c->ints[2]) vm = m;
    else return eng_err("the class dim is sharded over two mesh dims (%d and %d)", vm + dt_base(), m + dt_base());
  }
  if (!x->member) return eng_err("not a member of the mesh");
  int rd = red == RED_MEAN && nb > 0 ? RED_SUM : red;
  double ws = 0;
  eng_tensor* r = vm >= 0 ? vocab_parallel(x, vm, cd, c->in[0], c->in[1], c->in[2], c->ints[0], rd, &ws)
                : c->ints[2] ? eng_cross_entropy_weighted_local(c->in[0], c->in[1], c->in[2], c->ints[0], rd,
                                                                c->scalars[0], &ws)
                             : eng_nll_loss_local(c->in[0], c->in[1], c->in[2], c->ints[0], rd, &ws);
  if (rd == red) { outs[0] = r; return r ? 0 : -1; }
  return batch_mean(x, batch, nb, r, r ? 0 : -1, ws, outs);
}

static eng_tensor* nll_fn(const eng_op_call* c) {
  if (c->ints[2])
    return eng_cross_entropy_weighted_local(c->in[0], c->in[1], c->in[2], c->ints[0], (int)c->ints[1], c->scalars[0],
                                            NULL);
  return eng_nll_loss_local(c->in[0], c->in[1], c->in[2], c->ints[0], (int)c->ints[1], NULL);
}

/* agree_local: the targets (data) may be out of range on some ranks only */
const eng_op_def eng_opdef_nll_loss = {"nll_loss", 1, nll_rule, ce_shape, nll_fn, nll_local, 0, 0, 1};

/* ------------------------------------------------------------ elementwise losses
 * (x, y, w, pw) of one shape (w / pw expanded by the op; NULL when absent):
 * every input S(d) -> none: S(d); mean / sum / batchmean: Partial(sum) of the
 * local sum / the divisor of the GLOBAL shape (no communication).  Partial
 * inputs are replicated first (the losses are not linear). */
static int ploss_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  (void)m;
  const eng_dist_spec* x = s[0];
  int red = (int)c->ints[1], n = 0;
  for (int d = 0; d < x->ndim && n >= 0; d++) {
    eng_strategy st;
    memset(&st, 0, sizeof st);
    for (int i = 0; i < 4; i++) st.in[i] = sh_S(d);
    st.out[0] = red == RED_NONE ? sh_S(d) : sh_P(ENG_REDUCE_SUM);
    n = sh_push(out, cap, n, &st);
  }
  if (n < 0) return n;
  return sh_all_replicate(out, cap, n, 4, 1);
}

static int ploss_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* nd, int64_t (*shapes)[8]) {
  if (c->ints[1] == RED_NONE) return sh_shape_same0(c, s, nd, shapes);
  nd[0] = 0;
  return 0;
}

static int ploss_local(const eng_op_call* c, const eng_dist_spec* const* is, const eng_dist_spec* const* os,
                       eng_tensor** outs) {
  (void)os;
  const eng_dist_spec* x = is[0];
  int red = (int)c->ints[1];
  outs[0] = eng_ploss_local((int)c->ints[0], c->in[0], c->in[1], c->in[2], c->in[3], red == RED_NONE ? RED_NONE : RED_SUM,
                            c->scalars[0], eng_ploss_divisor(red, x->ndim, x->shape, x->numel));
  return outs[0] ? 0 : -1;
}

static eng_tensor* ploss_fn(const eng_op_call* c) {
  return eng_ploss_local((int)c->ints[0], c->in[0], c->in[1], c->in[2], c->in[3],
                         c->ints[1] == RED_NONE ? RED_NONE : RED_SUM, c->scalars[0], 1.0);
}

const eng_op_def eng_opdef_ploss = {"pointwise_loss", 1, ploss_rule, ploss_shape, ploss_fn, ploss_local, 0, 0, 0};
/* binary_cross_entropy: its input range check may fail on some ranks only */
const eng_op_def eng_opdef_ploss_checked = {"pointwise_loss", 1, ploss_rule, ploss_shape, ploss_fn, ploss_local,
                                            0, 0, 1};
