/* reduce.c: sharding rules of the reductions (sharding/sharding.h).
 *   sum/mean over dims (keepdim or not, or all): a reduced sharded dim gives
 *     Partial(sum) (mean = local sum * 1/N_global: exact for uneven shards);
 *     unreduced sharded dims stay Shard (index shifted without keepdim);
 *     Partial(sum/avg) input stays Partial; Partial(max/min) -> Replicate.
 *   max/min values over a sharded dim: Partial(max/min) when no gradient is
 *     needed and the indices are not asked for, else replicate that dim.
 *   argmax/argmin over a sharded dim: replicate that dim first. */
#include "dtensor/dtensor_impl.h"
#include "sharding/sharding.h"
#include "eng/ops_pointwise.h"
#include "eng/ops_reduce.h"

static int popcount_below(int64_t mask, int d) {
  return __builtin_popcountll((unsigned long long)mask & ((1ull << d) - 1));
}

/* Output dim of input dim d (not reduced). */
static int kept_dim(int64_t mask, int keepdim, int d) { return keepdim ? d : d - popcount_below(mask, d); }

static int reduce_shape(int64_t mask, int keepdim, const eng_dist_spec* s, int* nd, int64_t* shape) {
  int k = 0;
  for (int d = 0; d < s->ndim; d++) {
    if (mask >> d & 1) { if (keepdim) shape[k++] = 1; }
    else shape[k++] = s->shape[d];
  }
  *nd = k;
  return 0;
}

/* Can some rank's shard of tensor dim d be empty when mesh dim m shards it
 * (the other mesh dims as now)?  Partial(max/min) needs every shard non-empty. */
static int may_be_empty(const eng_dist_spec* s, int m, int d) {
  int64_t sizes[64];
  int n = 1;
  sizes[0] = s->shape[d];
  for (int j = 0; j < s->mesh_ndim; j++) {
    int shards = j == m || (s->placements[j].kind == ENG_PLACEMENT_SHARD && s->placements[j].dim == d);
    if (!shards) continue;
    int64_t k = s->mesh_shape[j], next[64];
    int nn = 0;
    for (int i = 0; i < n; i++)
      for (int64_t c = 0; c < k; c++) {
        int64_t full = (sizes[i] + k - 1) / k, off = c * full;
        if (off > sizes[i]) off = sizes[i];
        int64_t sz = sizes[i] - off < full ? sizes[i] - off : full;
        int seen = 0;
        for (int q = 0; q < nn; q++) if (next[q] == sz) seen = 1;
        if (!seen && nn < 64) next[nn++] = sz;
      }
    memcpy(sizes, next, sizeof(int64_t) * (size_t)nn);
    n = nn;
  }
  for (int i = 0; i < n; i++) if (sizes[i] == 0) return 1;
  return 0;
}

/* One strategy for a reduction of input placement p with `reduced` the
 * placement a sharded reduced dim turns into (kind < 0: not allowed). */
static int reduce_like(const eng_dist_spec* s, int m, int64_t mask, int keepdim, int n_out, eng_placement reduced,
                       int keep_partial_op, eng_strategy* out, int cap) {
  int n = 0;
  eng_placement p = s->placements[m];
  eng_strategy st;
  memset(&st, 0, sizeof st);
  st.in[0] = p;
  int ok = 0;
  eng_placement o = sh_R();
  if (sh_is_S(&p)) {
    if (mask >> p.dim & 1) {
      int extreme = reduced.kind == ENG_PLACEMENT_PARTIAL && (reduced.op == ENG_REDUCE_MAX || reduced.op == ENG_REDUCE_MIN);
      if (reduced.kind >= 0 && !(extreme && may_be_empty(s, m, p.dim))) { o = reduced; ok = 1; }
    }
    else { o = sh_S(kept_dim(mask, keepdim, p.dim)); ok = 1; }
  } else if (sh_is_P(&p) && keep_partial_op >= 0) {
    if (p.op == keep_partial_op || (keep_partial_op == ENG_REDUCE_SUM && p.op == ENG_REDUCE_AVG)) { o = p; ok = 1; }
  }
  if (ok) {
    for (int j = 0; j < n_out; j++) st.out[j] = o;
    n = sh_push(out, cap, n, &st);
  }
  return sh_all_replicate(out, cap, n, 1, n_out);
}

/* ------------------------------------------------------------------ sum / mean */
static int sum_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  return reduce_like(s[0], m, c->ints[0], (int)c->ints[1], 1, sh_P(ENG_REDUCE_SUM), ENG_REDUCE_SUM, out, cap);
}

static int sum_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* nd, int64_t (*shapes)[8]) {
  return reduce_shape(c->ints[0], (int)c->ints[1], s[0], &nd[0], shapes[0]);
}

static int mask_dims(int64_t mask, int ndim, int* dims) {
  int n = 0;
  for (int d = 0; d < ndim; d++) if (mask >> d & 1) dims[n++] = d;
  return n;
}

static eng_tensor* sum_fn(const eng_op_call* c) {
  int dims[ENG_MAX_DIMS];
  int n = mask_dims(c->ints[0], c->in[0]->ndim, dims);
  return eng_sum(c->in[0], n, dims, (int)c->ints[1]);
}
const eng_op_def eng_opdef_sum = {"sum", 1, sum_rule, sum_shape, sum_fn, NULL, 0};

/* mean = local sum * (1 / global count of the reduced dims) */
static int mean_local(const eng_op_call* c, const eng_dist_spec* const* is, const eng_dist_spec* const* os,
                      eng_tensor** outs) {
  (void)os;
  int dims[ENG_MAX_DIMS];
  eng_tensor* x = c->in[0];
  int n = mask_dims(c->ints[0], x->ndim, dims);
  if (!eng_dtype_is_floating(x->dtype)) { outs[0] = eng_mean(x, n, dims, (int)c->ints[1]); return outs[0] ? 0 : -1; }
  double N = 1;
  for (int i = 0; i < n; i++) N *= (double)is[0]->shape[dims[i]];
  eng_tensor* sm = eng_sum(x, n, dims, (int)c->ints[1]);
  if (!sm) return -1;
  outs[0] = eng_mul_scalar(sm, N > 0 ? 1.0 / N : (0.0 / 0.0));
  eng_tensor_release(sm);
  return outs[0] ? 0 : -1;
}
const eng_op_def eng_opdef_mean = {"mean", 1, sum_rule, sum_shape, NULL, mean_local, 0};

/* ------------------------------------------------------------------ max / min over a dim */
/* ints[0] = dim, ints[1] = keepdim, ints[2] = 1 max / 0 min */
static int ext_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* nd, int64_t (*shapes)[8]) {
  reduce_shape((int64_t)1 << c->ints[0], (int)c->ints[1], s[0], &nd[0], shapes[0]);
  nd[1] = nd[0];
  memcpy(shapes[1], shapes[0], sizeof shapes[0]);
  return 0;
}

static int max_dim_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  eng_placement none = {-1, 0, 0};
  return reduce_like(s[0], m, (int64_t)1 << c->ints[0], (int)c->ints[1], 2, none, -1, out, cap);
}
static int max_dim_local(const eng_op_call* c, const eng_dist_spec* const* is, const eng_dist_spec* const* os,
                         eng_tensor** outs) {
  (void)is; (void)os;
  eng_tensor* x = c->in[0];
  outs[0] = c->ints[2] ? eng_max_dim(x, (int)c->ints[0], (int)c->ints[1], &outs[1])
                       : eng_min_dim(x, (int)c->ints[0], (int)c->ints[1], &outs[1]);
  return outs[0] ? 0 : -1;
}
const eng_op_def eng_opdef_max_dim = {"max", 2, max_dim_rule, ext_shape, NULL, max_dim_local, 0};

static int max_values_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  int op = c->ints[2] ? ENG_REDUCE_MAX : ENG_REDUCE_MIN;
  eng_placement red = c->needs_grad ? (eng_placement){-1, 0, 0} : sh_P(op);
  return reduce_like(s[0], m, (int64_t)1 << c->ints[0], (int)c->ints[1], 1, red, c->needs_grad ? -1 : op, out, cap);
}
static eng_tensor* max_values_fn(const eng_op_call* c) {
  return c->ints[2] ? eng_max_dim(c->in[0], (int)c->ints[0], (int)c->ints[1], NULL)
                    : eng_min_dim(c->in[0], (int)c->ints[0], (int)c->ints[1], NULL);
}
const eng_op_def eng_opdef_max_dim_values = {"max", 1, max_values_rule, ext_shape, max_values_fn, NULL, 0};

/* ------------------------------------------------------------------ over all elements */
static int all_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* nd, int64_t (*shapes)[8]) {
  (void)c; (void)s; (void)shapes;
  nd[0] = 0;
  return 0;
}

static int ext_all_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  int op = c->ints[0] ? ENG_REDUCE_MAX : ENG_REDUCE_MIN;
  int64_t all = s[0]->ndim ? (int64_t)((1ull << s[0]->ndim) - 1) : 0;
  eng_placement red = c->needs_grad ? (eng_placement){-1, 0, 0} : sh_P(op);
  return reduce_like(s[0], m, all, 0, 1, red, c->needs_grad ? -1 : op, out, cap);
}
static eng_tensor* ext_all_fn(const eng_op_call* c) { return c->ints[0] ? eng_max_all(c->in[0]) : eng_min_all(c->in[0]); }
const eng_op_def eng_opdef_extreme_all = {"max", 1, ext_all_rule, all_shape, ext_all_fn, NULL, 0};

/* ------------------------------------------------------------------ argmax / argmin */
static int argext_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  eng_placement none = {-1, 0, 0};
  return reduce_like(s[0], m, (int64_t)1 << c->ints[0], (int)c->ints[1], 1, none, -1, out, cap);
}
static eng_tensor* argext_fn(const eng_op_call* c) {
  return c->ints[2] ? eng_argmax(c->in[0], (int)c->ints[0], (int)c->ints[1])
                    : eng_argmin(c->in[0], (int)c->ints[0], (int)c->ints[1]);
}
const eng_op_def eng_opdef_argext = {"argmax", 1, argext_rule, ext_shape, argext_fn, NULL, 0};

static int argmax_all_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  (void)c; (void)s; (void)m;
  return sh_all_replicate(out, cap, 0, 1, 1);
}
static eng_tensor* argmax_all_fn(const eng_op_call* c) { return eng_argmax_all(c->in[0]); }
const eng_op_def eng_opdef_argmax_all = {"argmax", 1, argmax_all_rule, all_shape, argmax_all_fn, NULL, 0};
