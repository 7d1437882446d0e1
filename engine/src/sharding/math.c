/* math.c: sharding rules of the ops of ops/math.c, ops/reduce2.c and
 * ops/sort.c (sharding/sharding_math.h).  Per mesh dim:
 *   math_unary (sin, floor, isnan, nan_to_num, ...): Shard(d) stays Shard(d);
 *     Partial is reduced first (none of them is linear); the rule is the
 *     pointwise one of the scalar comparisons (sharding/pointwise.c).
 *   math_binary (fmod, remainder, floor_divide, logical_and/or): the
 *     broadcasting rule of the comparisons: follow a sharded operand, the
 *     others shard the same output dim or stay Replicate where they
 *     broadcast; no Partial.
 *   reduce2 (prod, amax, amin, logsumexp, var, std, norm, all, any): a
 *     reduced dim that is sharded is replicated first (one all-gather;
 *     amax/amin without gradient and with no empty shard: Partial(max/min)
 *     instead, reduced when read), a
 *     sharded dim that is kept stays sharded (index shifted without
 *     keepdim), Partial is reduced first.  The local function then reduces
 *     whole rows, so every result is exact for uneven shards.
 *   along/along2 (cumsum, cumprod, argsort, sort, topk, kthvalue): the scan
 *     or sort dim is replicated first, other sharded dims stay sharded
 *     (kthvalue without keepdim shifts the ones after it). */
#include "dtensor/dtensor_impl.h"
#include "sharding/sharding_math.h"
#include "ops/ops.h"

/* ------------------------------------------------------------------ pointwise */
static int mu_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  return eng_opdef_compare_scalar.rule(c, s, m, out, cap);
}
static eng_tensor* mu_fn(const eng_op_call* c) {
  double p[3] = {c->scalars[0], c->scalars[1], c->scalars[2]};
  return eng_math_unary_op((int)c->ints[0], c->in[0], p);
}
const eng_op_def eng_opdef_math_unary = {"math_unary", 1, mu_rule, sh_shape_same0, mu_fn, NULL, 0};

static int mb_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  return eng_opdef_compare.rule(c, s, m, out, cap);
}
static eng_tensor* mb_fn(const eng_op_call* c) { return eng_math_binary_op((int)c->ints[0], c->in[0], c->in[1]); }
const eng_op_def eng_opdef_math_binary = {"math_binary", 1, mb_rule, sh_shape_broadcast, mb_fn, NULL, 0};
/* Integer fmod/remainder/floor_divide: a zero divisor fails on the ranks that hold it; agreed on every rank. */
const eng_op_def eng_opdef_math_binary_int = {"math_binary", 1, mb_rule, sh_shape_broadcast, mb_fn, NULL, 0, 0, 1};

/* ------------------------------------------------------------------ reductions */
/* Can a shard of tensor dim d be empty when mesh dim m shards it (the other
 * mesh dims as now)?  Partial(max/min) needs every shard non-empty. */
static int may_be_empty(const eng_dist_spec* s, int m, int d) {
  int64_t n = s->shape[d];
  for (int j = 0; j < s->mesh_ndim; j++) {
    int shards = j == m || (s->placements[j].kind == ENG_PLACEMENT_SHARD && s->placements[j].dim == d);
    if (!shards) continue;
    int64_t k = s->mesh_shape[j];
    /* the smallest chunk (torch.chunk): the last one */
    int64_t full = (n + k - 1) / k, last = n - full * (k - 1);
    if (last <= 0) return 1;
    n = last;
  }
  return 0;
}

static int r2_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  int64_t mask = c->ints[1];
  int keepdim = (int)c->ints[2];
  eng_placement p = s[0]->placements[m];
  int n = 0;
  if (sh_is_S(&p) && !(mask >> p.dim & 1)) {
    eng_strategy st;
    memset(&st, 0, sizeof st);
    st.in[0] = p;
    int od = keepdim ? p.dim : p.dim - __builtin_popcountll((unsigned long long)mask & ((1ull << p.dim) - 1));
    st.out[0] = sh_S(od);
    n = sh_push(out, cap, n, &st);
  }
  /* amax/amin over a sharded dim without gradient: each rank reduces its shard -> Partial(max/min) */
  int op = (int)c->ints[0];
  if ((op == ENG_R2_AMAX || op == ENG_R2_AMIN) && !c->needs_grad && sh_is_S(&p) && (mask >> p.dim & 1) &&
      !may_be_empty(s[0], m, p.dim)) {
    eng_strategy st;
    memset(&st, 0, sizeof st);
    st.in[0] = p;
    st.out[0] = sh_P(op == ENG_R2_AMAX ? ENG_REDUCE_MAX : ENG_REDUCE_MIN);
    n = sh_push(out, cap, n, &st);
  }
  return sh_all_replicate(out, cap, n, 1, 1);
}
static int r2_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* nd, int64_t (*shapes)[8]) {
  int64_t mask = c->ints[1];
  int k = 0;
  for (int d = 0; d < s[0]->ndim; d++) {
    if (mask >> d & 1) { if (c->ints[2]) shapes[0][k++] = 1; }
    else shapes[0][k++] = s[0]->shape[d];
  }
  nd[0] = k;
  return 0;
}
static eng_tensor* r2_fn(const eng_op_call* c) {
  return eng_reduce2_op((int)c->ints[0], c->in[0], c->ints[1], (int)c->ints[2], c->scalars[0]);
}
const eng_op_def eng_opdef_reduce2 = {"reduce", 1, r2_rule, r2_shape, r2_fn, NULL, 0};

/* ------------------------------------------------------------------ along a dim */
static int al_removes_dim(const eng_op_call* c) { return c->ints[0] == ENG_AL_KTH && !c->ints[3]; }

static int al_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  int dim = (int)c->ints[1];
  eng_placement p = s[0]->placements[m];
  int n = 0;
  if (sh_is_S(&p) && p.dim != dim) {
    eng_strategy st;
    memset(&st, 0, sizeof st);
    st.in[0] = p;
    int od = (al_removes_dim(c) && p.dim > dim) ? p.dim - 1 : p.dim;
    for (int j = 0; j < ENG_OP_MAX_OUT; j++) st.out[j] = sh_S(od);
    n = sh_push(out, cap, n, &st);
  }
  return sh_all_replicate(out, cap, n, 1, 2);
}
static int al_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* nd, int64_t (*shapes)[8]) {
  int dim = (int)c->ints[1];
  int k = 0;
  int64_t sh[8];
  for (int d = 0; d < s[0]->ndim; d++) {
    if (d != dim) { sh[k++] = s[0]->shape[d]; continue; }
    switch ((int)c->ints[0]) {
      case ENG_AL_TOPK: sh[k++] = c->ints[2]; break;
      case ENG_AL_KTH: if (c->ints[3]) sh[k++] = 1; break;
      default: sh[k++] = s[0]->shape[d];
    }
  }
  for (int j = 0; j < 2; j++) { nd[j] = k; memcpy(shapes[j], sh, sizeof(int64_t) * (size_t)k); }
  return 0;
}
static eng_tensor* al_fn(const eng_op_call* c) {
  eng_tensor *v = NULL, *i = NULL;
  int op = (int)c->ints[0];
  if (eng_along_op(op, c->in[0], (int)c->ints[1], c->ints[2], (int)c->ints[3], &v, op == ENG_AL_ARGSORT ? &i : NULL))
    return NULL;
  if (op == ENG_AL_ARGSORT) { eng_tensor_release(v); return i; }
  return v;
}
const eng_op_def eng_opdef_along = {"along", 1, al_rule, al_shape, al_fn, NULL, 0};

static int al2_local(const eng_op_call* c, const eng_dist_spec* const* is, const eng_dist_spec* const* os,
                     eng_tensor** outs) {
  (void)is; (void)os;
  return eng_along_op((int)c->ints[0], c->in[0], (int)c->ints[1], c->ints[2], (int)c->ints[3], &outs[0], &outs[1]);
}
const eng_op_def eng_opdef_along2 = {"along", 2, al_rule, al_shape, NULL, al2_local, 0};
