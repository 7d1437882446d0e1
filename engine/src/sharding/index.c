/* index.c: sharding rules of the indexing ops (ops/index.c), per mesh dim,
 * dims 0-based, d = the indexed dim:
 *
 *   gather(x, index):    x S(k), index S(k), k != d, equal sizes in k -> S(k)
 *                        (each rank gathers its rows); x R, index S(d) ->
 *                        S(d) (every position of the index dim reads the
 *                        whole replicated x); x P(sum/avg), index R -> P
 *                        (gather is linear in x); all Replicate.
 *   scatter/scatter_add(x, index, src):
 *                        x, index, src S(k), k != d, equal sizes in k ->
 *                        S(k); x P, src P (linear), index R -> P (the
 *                        result is linear in (x, src) for a fixed index);
 *                        all Replicate.
 *   index_add/index_copy(x, index, src):
 *                        x S(k), src S(k), k != d, equal sizes in k, index R
 *                        -> S(k); x P, src P, index R -> P; all Replicate.
 *
 * A Replicate x or src beside a Partial(sum/avg) one is split into a Partial
 * of the same op (local); Partial(max/min), or Partials of different ops, are
 * reduced first (spec/dist/sharding_index_spec.lua holds these cases).
 *
 * The index values are per-rank data: the defs are agree_local, so an index
 * out of range on one rank fails every rank naming it.  Gradients come from
 * the generic local-region autograd (the backward formulas are these ops). */
#include "dtensor/dtensor_impl.h"
#include "sharding/sharding.h"
#include "sharding/sharding_index.h"
#include "eng/ops_index.h"
#include "eng/ops_shape.h"

static const char* dt_desc(const eng_tensor* t) {
  static __thread char buf[4][700];
  static __thread int i;
  char* b = buf[i = (i + 1) & 3];
  if (t && t->dist) return eng_dtensor_describe(t, b, 700);
  return eng_desc(t);
}

static int gnd(const eng_tensor* t) { return t->dist ? t->dist->ndim : t->ndim; }
static const int64_t* gsh(const eng_tensor* t) { return t->dist ? t->dist->shape : t->shape; }

/* ------------------------------------------------------------------ gather */
/* inputs x, index; ints[0] = d */
static int gather_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  eng_placement px = s[0]->placements[m], pi = s[1]->placements[m];
  int d = (int)c->ints[0], n = 0;
  eng_strategy st;
  memset(&st, 0, sizeof st);
  int k = sh_is_S(&px) ? px.dim : (sh_is_S(&pi) ? pi.dim : -1);
  if (k >= 0 && k != d && s[0]->shape[k] == s[1]->shape[k]) {
    st.in[0] = sh_S(k); st.in[1] = sh_S(k); st.out[0] = sh_S(k);
    n = sh_push(out, cap, n, &st);
  }
  if (sh_is_S(&pi) && pi.dim == d) {
    st.in[0] = sh_R(); st.in[1] = sh_S(d); st.out[0] = sh_S(d);
    n = sh_push(out, cap, n, &st);
  }
  if (sh_is_linear_P(&px)) {
    st.in[0] = px; st.in[1] = sh_R(); st.out[0] = px;
    n = sh_push(out, cap, n, &st);
  }
  if (n < 0) return -1;
  return sh_all_replicate(out, cap, n, 2, 1);
}
static int gather_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* ndims, int64_t (*shapes)[8]) {
  (void)c;
  ndims[0] = s[1]->ndim;
  for (int k = 0; k < s[1]->ndim; k++) shapes[0][k] = s[1]->shape[k];
  return 0;
}
static eng_tensor* gather_fn(const eng_op_call* c) { return eng_gather(c->in[0], (int)c->ints[0], c->in[1]); }
static const eng_op_def eng_opdef_gather = {"gather", 1, gather_rule, gather_shape, gather_fn, NULL, 0, 1, 1};

static int check_index(const char* op, const eng_tensor* x, const eng_tensor* index, int dim, int* d) {
  if (index->dtype != ENG_I32 && index->dtype != ENG_I64)
    return eng_err("%s: index must be i32 or i64, got %s", op, dt_desc(index));
  int nd = gnd(x) ? gnd(x) : 1;
  *d = eng_norm_dim(dim, nd, op);
  return *d < 0 ? -1 : 0;
}

eng_tensor* eng_dt_gather(eng_tensor* x, int dim, eng_tensor* index) {
  const char* op = "gather";
  int d = 0;
  if (check_index(op, x, index, dim, &d)) return NULL;
  if (gnd(index) != gnd(x))
    return eng_errp("%s: index %s and input %s must have the same number of dims", op, dt_desc(index), dt_desc(x));
  for (int k = 0; k < gnd(x); k++)
    if (k != d && gsh(index)[k] > gsh(x)[k])
      return eng_errp("%s: index %s is larger than input %s in dim %d (index.size(k) <= input.size(k) for every "
                      "dim k other than dim %d)", op, dt_desc(index), dt_desc(x), k + 1, d + 1);
  return eng_dispatch(&eng_opdef_gather, &(eng_op_call){.name = op, .n_in = 2, .in = {x, index}, .ints = {d}});
}

/* ------------------------------------------------------------------ scatter, index_add, index_copy */
/* inputs x, index, src; ints[0] = d, ints[1] = 1 for the index_* ops (index replicated, 1-D) */
static int put_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  eng_placement px = s[0]->placements[m], pi = s[1]->placements[m], ps = s[2]->placements[m];
  int d = (int)c->ints[0], index_op = (int)c->ints[1], n = 0;
  eng_strategy st;
  memset(&st, 0, sizeof st);
  int k = sh_is_S(&px) ? px.dim : (sh_is_S(&ps) ? ps.dim : (!index_op && sh_is_S(&pi) ? pi.dim : -1));
  if (k >= 0 && k != d && s[0]->shape[k] == s[2]->shape[k] && (index_op || s[1]->shape[k] == s[0]->shape[k])) {
    st.in[0] = sh_S(k); st.in[1] = index_op ? sh_R() : sh_S(k); st.in[2] = sh_S(k); st.out[0] = sh_S(k);
    n = sh_push(out, cap, n, &st);
  }
  eng_placement p = sh_is_linear_P(&px) ? px : ps;
  if (sh_is_linear_P(&p)) {
    st.in[0] = p; st.in[1] = sh_R(); st.in[2] = p; st.out[0] = p;
    n = sh_push(out, cap, n, &st);
  }
  if (n < 0) return -1;
  return sh_all_replicate(out, cap, n, 3, 1);
}
static eng_tensor* scatter_fn(const eng_op_call* c) {
  return eng_scatter(c->in[0], (int)c->ints[0], c->in[1], c->in[2], (int)c->ints[2]);
}
static eng_tensor* index_put_fn(const eng_op_call* c) {
  if (c->ints[2]) return eng_index_add(c->in[0], (int)c->ints[0], c->in[1], c->in[2], c->scalars[0]);
  return eng_index_copy(c->in[0], (int)c->ints[0], c->in[1], c->in[2]);
}
static const eng_op_def eng_opdef_scatter = {"scatter", 1, put_rule, sh_shape_same0, scatter_fn, NULL, 0, 1, 1};
static const eng_op_def eng_opdef_index_put = {"index_put", 1, put_rule, sh_shape_same0, index_put_fn, NULL, 0, 1, 1};

eng_tensor* eng_dt_scatter(eng_tensor* x, int dim, eng_tensor* index, eng_tensor* src, int reduce) {
  const char* op = reduce ? "scatter_add" : "scatter";
  int d = 0;
  if (check_index(op, x, index, dim, &d)) return NULL;
  if (src->dtype != x->dtype)
    return eng_errp("%s: src %s must have the dtype of the input %s", op, dt_desc(src), dt_desc(x));
  if (gnd(index) != gnd(x) || gnd(src) != gnd(x))
    return eng_errp("%s: input %s, index %s and src %s must have the same number of dims", op, dt_desc(x),
                    dt_desc(index), dt_desc(src));
  for (int k = 0; k < gnd(x); k++) {
    if (gsh(index)[k] > gsh(src)[k])
      return eng_errp("%s: index %s is larger than src %s in dim %d (index.size(k) <= src.size(k) for every dim)",
                      op, dt_desc(index), dt_desc(src), k + 1);
    if (k != d && gsh(index)[k] > gsh(x)[k])
      return eng_errp("%s: index %s is larger than input %s in dim %d (index.size(k) <= input.size(k) for every "
                      "dim k other than dim %d)", op, dt_desc(index), dt_desc(x), k + 1, d + 1);
  }
  /* a src larger than the index: its leading box first (a narrow, dispatched itself) */
  eng_tensor* S = eng_tensor_retain(src);
  for (int k = 0; k < gnd(x) && S; k++)
    if (gsh(S)[k] != gsh(index)[k]) {
      eng_tensor* v = eng_narrow(S, k, 0, gsh(index)[k]);
      eng_tensor_release(S);
      S = v;
    }
  if (!S) return NULL;
  eng_tensor* r = eng_dispatch(&eng_opdef_scatter, &(eng_op_call){.name = op, .n_in = 3, .in = {x, index, S},
                                                                  .ints = {d, 0, reduce}});
  eng_tensor_release(S);
  return r;
}

eng_tensor* eng_dt_index_put(eng_tensor* x, int dim, eng_tensor* index, eng_tensor* src, int acc, double alpha) {
  const char* op = acc ? "index_add" : "index_copy";
  int d = 0;
  if (check_index(op, x, index, dim, &d)) return NULL;
  if (gnd(index) > 1) return eng_errp("%s: index must be a 1-D tensor (a vector), got %s", op, dt_desc(index));
  if (src->dtype != x->dtype)
    return eng_errp("%s: source %s must have the dtype of the input %s", op, dt_desc(src), dt_desc(x));
  int64_t ni = gnd(index) ? gsh(index)[0] : 1;
  int bad = gnd(src) != gnd(x);
  for (int k = 0; k < gnd(x) && !bad; k++) bad = gsh(src)[k] != (k == d ? ni : gsh(x)[k]);
  if (bad)
    return eng_errp("%s: source %s must have the input's shape %s with size %lld in dim %d (the number of indices "
                    "in %s)", op, dt_desc(src), dt_desc(x), (long long)ni, d + 1, dt_desc(index));
  return eng_dispatch(&eng_opdef_index_put, &(eng_op_call){.name = op, .n_in = 3, .in = {x, index, src},
                                                           .ints = {d, 1, acc}, .scalars = {alpha}});
}
