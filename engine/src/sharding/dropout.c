/* dropout.c: sharding rule of dropout (sharding/sharding.h).  Per mesh dim:
 * the output has the input's placement (Shard and Replicate); Partial inputs
 * are replicated first (design: P -> R, as PyTorch's random ops).  The local
 * function draws each shard's slice of the
 * mask one process would draw with the same seed (counter RNG addressed by the
 * global index of every element of the shard's box) and advances the
 * generator by the GLOBAL numel, so the full result and later random calls
 * agree across layouts (eng_dropout_shard in ops/dropout.c). */
#include "sharding/sharding.h"
#include "ops/ops.h"

static int dropout_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  int n = 0;
  eng_placement p = s[0]->placements[m];
  if (!sh_is_P(&p)) {
    eng_strategy st;
    memset(&st, 0, sizeof st);
    st.in[0] = p; st.out[0] = p;
    if ((n = sh_push(out, cap, n, &st)) < 0) return n;
  }
  return sh_all_replicate(out, cap, n, 1, 1);
}

static int dropout_local(const eng_op_call* c, const eng_dist_spec* const* in_specs,
                         const eng_dist_spec* const* out_specs, eng_tensor** outs) {
  outs[0] = eng_dropout_shard(c->in[0], c->scalars[0], in_specs[0]);
  return outs[0] ? 0 : -1;
}

const eng_op_def eng_opdef_dropout = {"dropout", 1, dropout_rule, sh_shape_same0, NULL, dropout_local, 0};
