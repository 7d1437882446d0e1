/* rope.c: sharding rule of rotary_emb(x [B, T, H, D], cos [T, D / 2], sin [T, D / 2]) (ops/rope.c;
 * sharding/sharding.h).  The rotation is per element pair of x with the tables' row t, and linear in x.  Per mesh
 * dim: x S(0) (batch) or S(2) (heads), tables R -> S(0) / S(2); x S(1) (sequence), tables S(0) (their T rows,
 * chunked as x's T dim: the same rows on every rank, uneven chunks included) -> S(1); x Partial(sum/avg), tables
 * R -> the same Partial; all R -> R.  x sharded on D (the pairs) is not offered: it is redistributed.  The local
 * function is the op itself on the local shards; autograd is generic (the gradient of x follows its layout, the
 * tables get none).  The output keeps x's dtype (keeps_dtype: meta outputs need no probe, whose stand-ins of
 * size 1 would have an odd D). */
#include <stdio.h>
#include "sharding/sharding.h"
#include "eng/ops_nn.h"

/* The tables' placement for x S(1): S(0); on a one-rank mesh dim a Replicate table is already that chunk (the whole
 * table) and stays, so x keeps Shard(1) there instead of the dispatcher preferring x S(0) (one change, not two). */
static eng_placement table_rows(const eng_dist_spec* t, int m) {
  if (t->mesh_shape[m] == 1 && sh_is_R(&t->placements[m])) return sh_R();
  return sh_S(0);
}

static int rope_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  (void)c;
  int n = 0;
  if (s[0]->ndim == 4 && s[1]->ndim == 2 && s[2]->ndim == 2) { /* else the shape function reports it */
    n = sh_push3(out, cap, n, sh_S(0), sh_R(), sh_R(), sh_S(0));
    n = sh_push3(out, cap, n, sh_S(1), table_rows(s[1], m), table_rows(s[2], m), sh_S(1));
    n = sh_push3(out, cap, n, sh_S(2), sh_R(), sh_R(), sh_S(2));
    const eng_placement* px = &s[0]->placements[m];
    if (sh_is_linear_P(px)) n = sh_push3(out, cap, n, *px, sh_R(), sh_R(), *px);
    if (n < 0) return n;
  }
  return sh_all_replicate(out, cap, n, 3, 1);
}

/* An argument as the messages show it (a DTensor with its global shape): DTensor(f32[2,8,4,16] on mesh(2)
 * [Shard(1)]), or f32[2,8,4,16]@meta. */
static const char* arg_desc(const eng_tensor* t, char* buf, int cap) {
  if (!t || !t->dist) { snprintf(buf, (size_t)cap, "%s", eng_desc(t)); return buf; }
  char s[560];
  snprintf(buf, (size_t)cap, "DTensor(%s)", eng_dist_spec_describe(t->dist, t->dtype, s, sizeof s));
  return buf;
}

/* The plain op's shape checks on the global shapes (its dtype checks are in its guard: the dispatcher's strategy
 * cache keys on the layouts, not the dtypes); output: x's shape. */
static int rope_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* nd, int64_t (*shapes)[8]) {
  const char* op = "rotary_emb";
  const eng_dist_spec *x = s[0], *cs = s[1], *sn = s[2];
  const eng_tensor *xt = c->in[0], *ct = c->in[1], *st = c->in[2];
  char bx[600], bc[600], bs[600];
  if (x->ndim != 4 || x->shape[3] % 2 != 0)
    return eng_err("%s: expected x of shape [B, T, H, D] with an even D, got %s", op, arg_desc(xt, bx, sizeof bx));
  int64_t T = x->shape[1], half = x->shape[3] / 2;
  if (cs->ndim != 2 || sn->ndim != 2 || cs->shape[0] != T || cs->shape[1] != half || sn->shape[0] != T ||
      sn->shape[1] != half)
    return eng_err("%s: expected cos and sin of shape [T, D / 2] = [%lld, %lld] and one dtype for x %s, got cos %s, "
                   "sin %s", op, (long long)T, (long long)half, arg_desc(xt, bx, sizeof bx),
                   arg_desc(ct, bc, sizeof bc), arg_desc(st, bs, sizeof bs));
  nd[0] = 4;
  for (int d = 0; d < 4; d++) shapes[0][d] = x->shape[d];
  return 0;
}

static eng_tensor* rope_fn(const eng_op_call* c) { return eng_rotary_emb(c->in[0], c->in[1], c->in[2]); }
const eng_op_def eng_opdef_rotary_emb = {"rotary_emb", 1, rope_rule, rope_shape, rope_fn, NULL, 0, 1, 0, 0};
