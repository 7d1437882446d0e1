/* pointwise.c: sharding rules of the pointwise ops (unary, casts,
 * clone, scalar forms, broadcasting binary ops, comparisons, where,
 * masked_fill).  Rules are per mesh dim (sharding/sharding.h).
 *   unary/scalar: output = input placement; Partial(sum/avg) kept only by
 *     linear ops (neg, mul/div by a scalar, float casts, clone), else P -> R.
 *   binary with broadcasting: follow a sharded input (the others shard the
 *     same output dim, or stay Replicate where they broadcast); Partial:
 *     add/sub all the same Partial (Replicate operands become Partial
 *     internally: divided by k for sum); mul/div the Partial operand with the
 *     others Replicate (div: numerator only); maximum/minimum Partial(max/min)
 *     on every operand, only without grad; comparisons/where/masked_fill no
 *     Partial. */
#include "dtensor/dtensor_impl.h"
#include "sharding/sharding.h"
#include "eng/ops_pointwise.h"
#include "eng/ops_nn.h"

/* ------------------------------------------------------------------ unary */
static int unary_like(const eng_dist_spec* s, int m, int keep_linear_partial, int keep_any_partial,
                      eng_strategy* out, int cap) {
  int n = 0;
  eng_placement p = s->placements[m];
  eng_strategy st;
  memset(&st, 0, sizeof st);
  if (sh_is_S(&p) || (sh_is_P(&p) && (keep_any_partial || (keep_linear_partial && sh_is_linear_P(&p))))) {
    st.in[0] = p; st.out[0] = p;
    n = sh_push(out, cap, n, &st);
  }
  return sh_all_replicate(out, cap, n, 1, 1);
}

static int unary_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  return unary_like(s[0], m, c->ints[0] == ENG_UN_NEG, 0, out, cap);
}

static eng_tensor* unary_fn(const eng_op_call* c) {
  eng_tensor* a = c->in[0];
  switch ((int)c->ints[0]) {
    case ENG_UN_NEG: return eng_neg(a);
    case ENG_UN_EXP: return eng_exp(a);
    case ENG_UN_LOG: return eng_log(a);
    case ENG_UN_SQRT: return eng_sqrt(a);
    case ENG_UN_RSQRT: return eng_rsqrt(a);
    case ENG_UN_ABS: return eng_abs(a);
    case ENG_UN_TANH: return eng_tanh(a);
    case ENG_UN_SIGMOID: return eng_sigmoid(a);
    case ENG_UN_RELU: return eng_relu(a);
    case ENG_UN_SILU: return eng_silu(a);
    case ENG_UN_GELU: return eng_gelu(a, (int)c->ints[1]);
    case ENG_UN_CLAMP: return eng_clamp(a, c->scalars[0], c->scalars[1]);
    case ENG_UN_LEAKY_RELU: return eng_leaky_relu(a, c->scalars[0]);
    case ENG_UN_ELU: return eng_elu(a, c->scalars[0]);
    case ENG_UN_HARDTANH: return eng_hardtanh(a, c->scalars[0], c->scalars[1]);
    case ENG_UN_SOFTPLUS: return eng_softplus(a, c->scalars[0], c->scalars[1]);
  }
  return eng_errp("unary: unknown op code %lld", (long long)c->ints[0]);
}

const eng_op_def eng_opdef_unary = {"unary", 1, unary_rule, sh_shape_same0, unary_fn, NULL, 0};

/* casts: Partial kept between floating dtypes (sums of rounded partials are
 * what PyTorch gives too); integer targets need the reduced value first. */
static int cast_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  int keep = eng_dtype_is_floating((int)c->ints[0]) && eng_dtype_is_floating(c->in[0]->dtype);
  return unary_like(s[0], m, keep, 0, out, cap);
}
static eng_tensor* cast_fn(const eng_op_call* c) { return eng_tensor_to_dtype(c->in[0], (int)c->ints[0]); }
const eng_op_def eng_opdef_cast = {"to_dtype", 1, cast_rule, sh_shape_same0, cast_fn, NULL, 0};

static int clone_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  (void)c;
  const eng_placement* p = &s[0]->placements[m];
  if (p->kind == ENG_PLACEMENT_STRIDED_SHARD) { /* kept as it is (keeps_strided): a copy keeps the layout */
    eng_strategy st;
    memset(&st, 0, sizeof st);
    st.in[0] = *p; st.out[0] = *p;
    return sh_push(out, cap, 0, &st);
  }
  return unary_like(s[0], m, 1, 1, out, cap);
}
static eng_tensor* clone_fn(const eng_op_call* c) {
  return c->ints[0] ? eng_tensor_contiguous(c->in[0]) : eng_tensor_clone(c->in[0]);
}
/* ints[0]: 0 clone, 1 contiguous; a _StridedShard input keeps its layout (PyTorch's clone follows its input) */
const eng_op_def eng_opdef_clone = {"clone", 1, clone_rule, sh_shape_same0, clone_fn, NULL, 0, 0, 0, 1};

/* ------------------------------------------------------------------ scalar forms */
static int scalar_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  int k = (int)c->ints[0];
  return unary_like(s[0], m, k == ENG_SC_MUL || k == ENG_SC_DIV, 0, out, cap);
}
static eng_tensor* scalar_fn(const eng_op_call* c) {
  eng_tensor* a = c->in[0];
  double v = c->scalars[0];
  switch ((int)c->ints[0]) {
    case ENG_SC_ADD: return eng_add_scalar(a, v);
    case ENG_SC_SUB: return eng_sub_scalar(a, v);
    case ENG_SC_MUL: return eng_mul_scalar(a, v);
    case ENG_SC_DIV: return eng_div_scalar(a, v);
    case ENG_SC_POW: return eng_pow_scalar(a, v);
    case ENG_SC_RSUB: return eng_rsub_scalar(v, a);
    case ENG_SC_RDIV: return eng_rdiv_scalar(v, a);
    case ENG_SC_RPOW: return eng_rpow_scalar(v, a);
  }
  return eng_errp("scalar op: unknown code %lld", (long long)c->ints[0]);
}
const eng_op_def eng_opdef_scalar = {"scalar op", 1, scalar_rule, sh_shape_same0, scalar_fn, NULL, 0};

static int cmp_scalar_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  (void)c;
  return unary_like(s[0], m, 0, 0, out, cap);
}
static eng_tensor* cmp_scalar_fn(const eng_op_call* c) {
  return eng_compare_scalar(c->in[0], c->scalars[0], (int)c->ints[0]);
}
const eng_op_def eng_opdef_compare_scalar = {"compare", 1, cmp_scalar_rule, sh_shape_same0, cmp_scalar_fn, NULL, 0};

/* ------------------------------------------------------------------ broadcasting */
enum { PM_NONE, PM_ADD, PM_MUL, PM_DIV, PM_MAX, PM_MIN };

static int out_ndim(const eng_op_call* c, const eng_dist_spec* const* s) {
  int nd = 0;
  for (int i = 0; i < c->n_in; i++) if (s[i] && s[i]->ndim > nd) nd = s[i]->ndim;
  return nd;
}

/* Size of output dim o (broadcast of the inputs). */
static int64_t out_size(const eng_op_call* c, const eng_dist_spec* const* s, int ond, int o) {
  int64_t r = 1;
  for (int i = 0; i < c->n_in; i++) {
    if (!s[i]) continue;
    int e = o - (ond - s[i]->ndim);
    if (e >= 0 && s[i]->shape[e] != 1) r = s[i]->shape[e];
  }
  return r;
}

/* Input i's dim for output dim o, or -1 when it is missing or broadcast. */
static int in_dim(const eng_dist_spec* si, int ond, int o, int64_t osize) {
  int e = o - (ond - si->ndim);
  if (e < 0) return -1;
  if (si->shape[e] != osize) return -1;
  return e;
}

static int broadcast_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap,
                          int pm) {
  int n = 0, nin = c->n_in;
  int ond = out_ndim(c, s);
  eng_strategy st;
  /* follow each sharded input */
  for (int i = 0; i < nin; i++) {
    if (!s[i] || !sh_is_S(&s[i]->placements[m])) continue;
    int o = s[i]->placements[m].dim + (ond - s[i]->ndim);
    int64_t osz = out_size(c, s, ond, o);
    if (in_dim(s[i], ond, o, osz) < 0) continue; /* sharding a broadcast dim: replicate it */
    memset(&st, 0, sizeof st);
    for (int j = 0; j < nin; j++) {
      if (!s[j]) continue;
      int e = in_dim(s[j], ond, o, osz);
      st.in[j] = e >= 0 ? sh_S(e) : sh_R();
    }
    for (int k = 0; k < ENG_OP_MAX_OUT; k++) st.out[k] = sh_S(o);
    n = sh_push(out, cap, n, &st);
  }
  /* Partial */
  if (pm == PM_ADD || pm == PM_MAX || pm == PM_MIN) {
    int op = -1;
    for (int i = 0; i < nin && op < 0; i++) {
      if (!s[i] || !sh_is_P(&s[i]->placements[m])) continue;
      const eng_placement* p = &s[i]->placements[m];
      if (pm == PM_ADD && sh_is_linear_P(p)) op = p->op;
      if (pm == PM_MAX && p->op == ENG_REDUCE_MAX && !c->needs_grad) op = p->op;
      if (pm == PM_MIN && p->op == ENG_REDUCE_MIN && !c->needs_grad) op = p->op;
    }
    if (op >= 0) {
      memset(&st, 0, sizeof st);
      for (int j = 0; j < nin; j++) if (s[j]) st.in[j] = sh_P(op);
      for (int k = 0; k < ENG_OP_MAX_OUT; k++) st.out[k] = sh_P(op);
      n = sh_push(out, cap, n, &st);
    }
  } else if (pm == PM_MUL || pm == PM_DIV) {
    for (int i = 0; i < (pm == PM_DIV ? 1 : nin); i++) {
      if (!s[i] || !sh_is_linear_P(&s[i]->placements[m])) continue;
      memset(&st, 0, sizeof st);
      for (int j = 0; j < nin; j++) if (s[j]) st.in[j] = j == i ? s[i]->placements[m] : sh_R();
      for (int k = 0; k < ENG_OP_MAX_OUT; k++) st.out[k] = s[i]->placements[m];
      n = sh_push(out, cap, n, &st);
    }
  }
  return sh_all_replicate(out, cap, n, nin, 1);
}

static int binary_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  static const int pm[] = {PM_ADD, PM_ADD, PM_MUL, PM_DIV, PM_NONE, PM_MAX, PM_MIN};
  int k = (int)c->ints[0];
  return broadcast_rule(c, s, m, out, cap, k >= 0 && k <= ENG_BIN_MIN ? pm[k] : PM_NONE);
}
static eng_tensor* binary_fn(const eng_op_call* c) {
  eng_tensor *a = c->in[0], *b = c->in[1];
  switch ((int)c->ints[0]) {
    case ENG_BIN_ADD: return eng_add(a, b);
    case ENG_BIN_SUB: return eng_sub(a, b);
    case ENG_BIN_MUL: return eng_mul(a, b);
    case ENG_BIN_DIV: return eng_div(a, b);
    case ENG_BIN_POW: return eng_pow(a, b);
    case ENG_BIN_MAX: return eng_maximum(a, b);
    case ENG_BIN_MIN: return eng_minimum(a, b);
  }
  return eng_errp("binary: unknown op code %lld", (long long)c->ints[0]);
}
const eng_op_def eng_opdef_binary = {"binary", 1, binary_rule, sh_shape_broadcast, binary_fn, NULL, 0};

static int nopartial_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  return broadcast_rule(c, s, m, out, cap, PM_NONE);
}
static eng_tensor* compare_fn(const eng_op_call* c) { return eng_compare(c->in[0], c->in[1], (int)c->ints[0]); }
const eng_op_def eng_opdef_compare = {"compare", 1, nopartial_rule, sh_shape_broadcast, compare_fn, NULL, 0};

static eng_tensor* where_fn(const eng_op_call* c) { return eng_where(c->in[0], c->in[1], c->in[2]); }
const eng_op_def eng_opdef_where = {"where", 1, nopartial_rule, sh_shape_broadcast, where_fn, NULL, 0};

static eng_tensor* masked_fill_fn(const eng_op_call* c) { return eng_masked_fill(c->in[0], c->in[1], c->scalars[0]); }
const eng_op_def eng_opdef_masked_fill = {"masked_fill", 1, nopartial_rule, sh_shape_same0, masked_fill_fn, NULL, 0};

/* ------------------------------------------------------------------ silu_mul (a, b of one shape)
 * Elementwise: a and b sharded on the same dim give that shard of the output (the other operand, Replicate, is
 * sliced locally by the redistribution); silu is not linear, so a Partial a is reduced first, while a Partial(sum/
 * avg) b with a Replicate a stays Partial (the product is linear in b). */
static int silu_mul_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  (void)c;
  int n = 0;
  eng_strategy st;
  for (int k = 0; k < 2 && n >= 0; k++) {
    const eng_placement* p = &s[k]->placements[m];
    if (!sh_is_S(p) || (k == 1 && sh_is_S(&s[0]->placements[m]) && s[0]->placements[m].dim == p->dim)) continue;
    memset(&st, 0, sizeof st);
    st.in[0] = st.in[1] = st.out[0] = sh_S(p->dim);
    n = sh_push(out, cap, n, &st);
  }
  const eng_placement* pb = &s[1]->placements[m];
  if (n >= 0 && sh_is_linear_P(pb)) {
    memset(&st, 0, sizeof st);
    st.in[0] = sh_R(); st.in[1] = *pb; st.out[0] = *pb;
    n = sh_push(out, cap, n, &st);
  }
  if (n < 0) return n;
  return sh_all_replicate(out, cap, n, 2, 1);
}

static int silu_mul_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* nd, int64_t (*shapes)[8]) {
  const eng_dist_spec *a = s[0], *b = s[1];
  int same = a->ndim == b->ndim;
  for (int d = 0; same && d < a->ndim; d++) same = a->shape[d] == b->shape[d];
  if (!same) {
    char ba[1024], bb[1024];
    return eng_err("silu_mul: expected a and b of one shape, got a %s, b %s", eng_dist_desc(c->in[0], ba, sizeof ba),
                   eng_dist_desc(c->in[1], bb, sizeof bb));
  }
  nd[0] = a->ndim;
  for (int d = 0; d < a->ndim; d++) shapes[0][d] = a->shape[d];
  return 0;
}

static eng_tensor* silu_mul_fn(const eng_op_call* c) { return eng_silu_mul(c->in[0], c->in[1]); }
const eng_op_def eng_opdef_silu_mul = {"silu_mul", 1, silu_mul_rule, silu_mul_shape, silu_mul_fn, NULL, 0, 1, 0, 0};
