/* matmul.c: sharding rules of matmul (1-d, 2-d, batched with
 * broadcast) and linear (sharding/sharding.h).  Per mesh dim:
 *   matmul: S(batch)·S(batch) -> S(batch) (a broadcast batch dim stays R);
 *     S(m)·R -> S(m); R·S(n) -> S(n); S(k)·S(k) -> Partial(sum);
 *     P·R -> P, R·P -> P (sum/avg); R·R -> R.
 *   linear(x [..., in], W [out, in], b [out]): x S(batch), W R, b R -> S(batch);
 *     x S(in), W S(1), b Partial (R -> P internally: b/k) -> Partial(sum);
 *     x R, W S(0), b S(0) -> S(last); x P, W R, b P -> P; all R -> R. */
#include "dtensor/dtensor_impl.h"
#include "sharding/sharding.h"
#include "eng/ops_nn.h"

typedef struct mm_dims {
  int nb;          /* output batch dims */
  int ond;         /* output ndim */
  int ka, kb;      /* contraction dims of a and b */
  int ma, nbd;     /* a's m dim (-1 if a is 1-d), b's n dim (-1 if b is 1-d) */
  int om, on;      /* output dims of m and n (-1 when absent) */
  int ba, bb;      /* batch dims of a and b */
} mm_dims;

static void mm_layout(const eng_dist_spec* a, const eng_dist_spec* b, mm_dims* d) {
  d->ba = a->ndim >= 2 ? a->ndim - 2 : 0;
  d->bb = b->ndim >= 2 ? b->ndim - 2 : 0;
  d->nb = d->ba > d->bb ? d->ba : d->bb;
  d->ka = a->ndim - 1;
  d->kb = b->ndim >= 2 ? b->ndim - 2 : 0;
  d->ma = a->ndim >= 2 ? a->ndim - 2 : -1;
  d->nbd = b->ndim >= 2 ? b->ndim - 1 : -1;
  int o = d->nb;
  d->om = d->ma >= 0 ? o++ : -1;
  d->on = d->nbd >= 0 ? o++ : -1;
  d->ond = o;
}

static int64_t batch_size(const eng_dist_spec* a, const eng_dist_spec* b, const mm_dims* d, int o) {
  int ia = o - (d->nb - d->ba), ib = o - (d->nb - d->bb);
  int64_t r = 1;
  if (ia >= 0 && a->shape[ia] != 1) r = a->shape[ia];
  if (ib >= 0 && b->shape[ib] != 1) r = b->shape[ib];
  return r;
}

static int matmul_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* nd, int64_t (*shapes)[8]) {
  (void)c;
  const eng_dist_spec *a = s[0], *b = s[1];
  if (a->ndim == 0 || b->ndim == 0) return eng_err("both arguments to matmul need to be at least 1D");
  mm_dims d;
  mm_layout(a, b, &d);
  if (a->shape[d.ka] != b->shape[d.kb])
    return eng_err("shapes %s and %s cannot be multiplied", eng_shape_str(a->ndim, a->shape), eng_shape_str(b->ndim, b->shape));
  for (int o = 0; o < d.nb; o++) {
    int ia = o - (d.nb - d.ba), ib = o - (d.nb - d.bb);
    if (ia >= 0 && ib >= 0 && a->shape[ia] != b->shape[ib] && a->shape[ia] != 1 && b->shape[ib] != 1)
      return eng_err("batch dims of %s and %s cannot be broadcast", eng_shape_str(a->ndim, a->shape),
                     eng_shape_str(b->ndim, b->shape));
    shapes[0][o] = batch_size(a, b, &d, o);
  }
  if (d.om >= 0) shapes[0][d.om] = a->shape[d.ma];
  if (d.on >= 0) shapes[0][d.on] = b->shape[d.nbd];
  nd[0] = d.ond;
  return 0;
}

static int push2(eng_strategy* out, int cap, int n, eng_placement a, eng_placement b, eng_placement o) {
  eng_strategy st;
  memset(&st, 0, sizeof st);
  st.in[0] = a; st.in[1] = b; st.out[0] = o;
  return sh_push(out, cap, n, &st);
}

static int matmul_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  (void)c;
  const eng_dist_spec *a = s[0], *b = s[1];
  mm_dims d;
  mm_layout(a, b, &d);
  int n = 0;
  for (int o = 0; o < d.nb; o++) {
    int64_t sz = batch_size(a, b, &d, o);
    int ia = o - (d.nb - d.ba), ib = o - (d.nb - d.bb);
    int ha = ia >= 0 && a->shape[ia] == sz, hb = ib >= 0 && b->shape[ib] == sz;
    if (!ha && !hb) continue;
    n = push2(out, cap, n, ha ? sh_S(ia) : sh_R(), hb ? sh_S(ib) : sh_R(), sh_S(o));
  }
  if (d.ma >= 0) n = push2(out, cap, n, sh_S(d.ma), sh_R(), sh_S(d.om));
  if (d.nbd >= 0) n = push2(out, cap, n, sh_R(), sh_S(d.nbd), sh_S(d.on));
  n = push2(out, cap, n, sh_S(d.ka), sh_S(d.kb), sh_P(ENG_REDUCE_SUM));
  const eng_placement *pa = &a->placements[m], *pb = &b->placements[m];
  if (sh_is_linear_P(pa)) n = push2(out, cap, n, *pa, sh_R(), *pa);
  if (sh_is_linear_P(pb)) n = push2(out, cap, n, sh_R(), *pb, *pb);
  return sh_all_replicate(out, cap, n, 2, 1);
}

static eng_tensor* matmul_fn(const eng_op_call* c) { return eng_matmul(c->in[0], c->in[1]); }
const eng_op_def eng_opdef_matmul = {"matmul", 1, matmul_rule, matmul_shape, matmul_fn, NULL, 0};

/* ------------------------------------------------------------------ linear */
static int linear_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* nd, int64_t (*shapes)[8]) {
  (void)c;
  const eng_dist_spec *x = s[0], *w = s[1];
  if (x->ndim < 1 || w->ndim != 2 || x->shape[x->ndim - 1] != w->shape[1])
    return eng_err("input %s and weight %s do not match (weight [out, in])", eng_shape_str(x->ndim, x->shape),
                   eng_shape_str(w->ndim, w->shape));
  for (int d = 0; d < x->ndim - 1; d++) shapes[0][d] = x->shape[d];
  shapes[0][x->ndim - 1] = w->shape[0];
  nd[0] = x->ndim;
  return 0;
}

static int linear_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  (void)c;
  const eng_dist_spec* x = s[0];
  int last = x->ndim - 1, n = 0;
  for (int d = 0; d < last; d++) n = sh_push3(out, cap, n, sh_S(d), sh_R(), sh_R(), sh_S(d));
  n = sh_push3(out, cap, n, sh_S(last), sh_S(1), sh_P(ENG_REDUCE_SUM), sh_P(ENG_REDUCE_SUM));
  n = sh_push3(out, cap, n, sh_R(), sh_S(0), sh_S(0), sh_S(last));
  const eng_placement* px = &x->placements[m];
  if (sh_is_linear_P(px)) n = sh_push3(out, cap, n, *px, sh_R(), *px, *px);
  return sh_all_replicate(out, cap, n, 3, 1);
}

static eng_tensor* linear_fn(const eng_op_call* c) { return eng_linear(c->in[0], c->in[1], c->in[2]); }
const eng_op_def eng_opdef_linear = {"linear", 1, linear_rule, linear_shape, linear_fn, NULL, 0};

/* ------------------------------------------------------------------ linear + gelu */
static int linear_gelu_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  (void)c; (void)m;
  const eng_dist_spec* x = s[0];
  int last = x->ndim - 1, n = 0;
  for (int d = 0; d < last && n >= 0; d++) n = sh_push3(out, cap, n, sh_S(d), sh_R(), sh_R(), sh_S(d));
  if (n >= 0) n = sh_push3(out, cap, n, sh_R(), sh_S(0), sh_S(0), sh_S(last));
  if (n < 0) return n;
  return sh_all_replicate(out, cap, n, 3, 1);
}

static eng_tensor* linear_gelu_fn(const eng_op_call* c) {
  return eng_linear_gelu(c->in[0], c->in[1], c->in[2], (int)c->ints[0]);
}
const eng_op_def eng_opdef_linear_gelu = {"linear_gelu", 1, linear_gelu_rule, linear_shape, linear_gelu_fn, NULL, 0};
