/* norm.c: sharding rule of layer_norm / rms_norm (inputs x, weight,
 * bias; weight and bias may be NULL; sharding/sharding.h).  Per mesh dim: x S(d) with
 * d before the normalized dims -> output S(d), weight and bias Replicate (their
 * gradients come out Partial(sum) by the adjoint rule and AccumulateGrad
 * all-reduces them into .grad); x sharded on a normalized dim, Partial x
 * (not linear) and sharded weight/bias are replicated first; all R -> R. */
#include "sharding/sharding.h"
#include "eng/ops_nn.h"

static int norm_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  int n = 0, n_batch = s[0]->ndim - (int)c->ints[0];
  eng_placement p = s[0]->placements[m];
  if (sh_is_S(&p) && p.dim < n_batch) {
    eng_strategy st;
    memset(&st, 0, sizeof st);
    st.in[0] = p; st.in[1] = sh_R(); st.in[2] = sh_R(); st.out[0] = p;
    if ((n = sh_push(out, cap, n, &st)) < 0) return n;
  }
  return sh_all_replicate(out, cap, n, 3, 1);
}

static eng_tensor* norm_fn(const eng_op_call* c) {
  int n_norm = (int)c->ints[0];
  return c->ints[1] ? eng_rms_norm(c->in[0], n_norm, c->in[1], c->scalars[0])
                    : eng_layer_norm(c->in[0], n_norm, c->in[1], c->in[2], c->scalars[0]);
}

const eng_op_def eng_opdef_norm = {"layer_norm", 1, norm_rule, sh_shape_same0, norm_fn, NULL, 0};
