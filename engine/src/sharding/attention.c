/* attention.c: sharding rule of scaled_dot_product_attention(q, k, v
 * [, mask]) with q [..., L, E], k [..., S, E], v [..., S, Ev] and batch dims
 * broadcast (sharding/sharding.h).  Per mesh dim: a batch dim d (B or H of [B, H, T, D])
 * sharded -> q, k, v (and the mask) Shard on their dim aligned with d (an input
 * broadcast over d, size 1 or missing, stays Replicate) -> output S(d); the
 * sequence and embedding dims (T, D) sharded and Partial inputs are replicated
 * first; all R -> R.  With dropout_p > 0 the local function draws each shard's
 * slice of the global dropout mask (eng_sdpa_shard), so every layout gives what
 * one process gives. */
#include "sharding/sharding.h"
#include "ops/ops.h"
#include "eng/ops_nn.h"

/* out: the attention weights' dim count (batch dims + 2), or -1 */
static int weights_ndim(const eng_dist_spec* const* s) {
  int nd = 0;
  for (int i = 0; i < 3; i++) if (s[i]->ndim > nd) nd = s[i]->ndim;
  for (int i = 0; i < 3; i++) if (s[i]->ndim < 2) return -1;
  return nd;
}

/* Global size of batch dim d (aligned from the right over q, k, v). */
static int64_t batch_size(const eng_dist_spec* const* s, int pnd, int d) {
  int64_t r = 1;
  for (int i = 0; i < 3; i++) {
    int a = d - (pnd - s[i]->ndim);
    if (a >= 0 && s[i]->shape[a] != 1) r = s[i]->shape[a];
  }
  return r;
}

static int sdpa_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  int n = 0, pnd = weights_ndim(s);
  for (int d = 0; d < pnd - 2 && n >= 0; d++) {
    int64_t size = batch_size(s, pnd, d);
    if (size <= 1) continue;
    eng_strategy st;
    memset(&st, 0, sizeof st);
    int ok = 1;
    for (int i = 0; i < 4 && ok; i++) {
      if (!s[i]) continue;
      int a = d - (pnd - s[i]->ndim);
      if (i == 3 && s[i]->ndim > pnd) ok = 0;
      else if (a >= 0 && s[i]->shape[a] == size) st.in[i] = sh_S(a);
      else if (a < 0 || s[i]->shape[a] == 1) st.in[i] = sh_R();
      else ok = 0; /* shapes do not broadcast: the local op reports it */
    }
    st.out[0] = sh_S(d);
    if (ok) n = sh_push(out, cap, n, &st);
  }
  if (n < 0) return n;
  return sh_all_replicate(out, cap, n, 4, 1);
}

/* [batch..., L, Ev] (batch broadcast over q, k, v). */
static int sdpa_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* nd, int64_t (*shapes)[8]) {
  int pnd = weights_ndim(s);
  if (pnd < 0)
    return eng_err("q, k and v need at least 2 dims ([..., L, E], [..., S, E], [..., S, Ev]), got %s, %s and %s",
                   eng_shape_str(s[0]->ndim, s[0]->shape), eng_shape_str(s[1]->ndim, s[1]->shape),
                   eng_shape_str(s[2]->ndim, s[2]->shape));
  nd[0] = pnd;
  for (int d = 0; d < pnd - 2; d++) shapes[0][d] = batch_size(s, pnd, d);
  shapes[0][pnd - 2] = s[0]->shape[s[0]->ndim - 2];
  shapes[0][pnd - 1] = s[2]->shape[s[2]->ndim - 1];
  return 0;
}

static int sdpa_local(const eng_op_call* c, const eng_dist_spec* const* in_specs,
                      const eng_dist_spec* const* out_specs, eng_tensor** outs) {
  eng_tensor *q = c->in[0], *k = c->in[1], *v = c->in[2], *mask = c->in[3];
  int causal = (int)c->ints[0];
  double dp = c->scalars[0], scale = c->scalars[1];
  if (dp > 0.0) { /* the shard's box in the global weights [batch..., L, S] */
    const eng_dist_spec* o = out_specs[0];
    int pnd = o->ndim;
    int64_t pshape[8], pstart[8];
    for (int d = 0; d < pnd - 2; d++) { pshape[d] = o->shape[d]; pstart[d] = o->offset[d]; }
    pshape[pnd - 2] = o->shape[pnd - 2]; pstart[pnd - 2] = 0;
    pshape[pnd - 1] = in_specs[1]->shape[in_specs[1]->ndim - 2]; pstart[pnd - 1] = 0;
    outs[0] = eng_sdpa_shard(q, k, v, mask, dp, causal, scale, pshape, pstart);
  } else outs[0] = eng_scaled_dot_product_attention(q, k, v, mask, dp, causal, scale);
  return outs[0] ? 0 : -1;
}

const eng_op_def eng_opdef_sdpa = {"scaled_dot_product_attention", 1, sdpa_rule, sdpa_shape, NULL, sdpa_local, 0};
