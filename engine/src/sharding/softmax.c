/* softmax.c: sharding rule of softmax / log_softmax (sharding/sharding.h).
 * Per mesh dim: input S(d) with d != the softmax dim -> output S(d) (rows are
 * independent); S(softmax dim) and Partial inputs are replicated first (the
 * op is not linear); R -> R. */
#include "sharding/sharding.h"
#include "eng/ops_nn.h"

static int softmax_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  int n = 0;
  eng_placement p = s[0]->placements[m];
  if (sh_is_S(&p) && p.dim != (int)c->ints[0]) {
    eng_strategy st;
    memset(&st, 0, sizeof st);
    st.in[0] = p; st.out[0] = p;
    if ((n = sh_push(out, cap, n, &st)) < 0) return n;
  }
  return sh_all_replicate(out, cap, n, 1, 1);
}

static eng_tensor* softmax_fn(const eng_op_call* c) {
  return c->ints[1] ? eng_log_softmax(c->in[0], (int)c->ints[0]) : eng_softmax(c->in[0], (int)c->ints[0]);
}

const eng_op_def eng_opdef_softmax = {"softmax", 1, softmax_rule, sh_shape_same0, softmax_fn, NULL, 0};
