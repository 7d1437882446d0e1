/* embedding.c: sharding rule of embedding(weight [num, dim], idx)
 * (sharding/sharding.h).  Per mesh dim:
 *   weight S(1), idx R    -> out S(last)   (each rank looks up its columns)
 *   weight S(0), idx R    -> out Partial(sum) via eng_embedding_masked (rows
 *     outside the shard give zeros; backward adds only into owned rows; not
 *     offered with a padding_idx, whose rows must get no gradient; on a mesh
 *     dim of one rank the shard is the whole table: the plain lookup)
 *   weight R, idx S(d)    -> out S(d)
 *   weight P(sum/avg), idx R -> out P (the lookup is linear in the weight)
 *   all R                 -> R
 * ints[0] = padding_idx (-1: none). */
#include "dtensor/dtensor_impl.h"
#include "sharding/sharding.h"
#include "ops/ops.h"
#include "ops/vocab_parallel.h"
#include "eng/ops_nn.h"

static int emb_push(eng_strategy* out, int cap, int n, eng_placement w, eng_placement i, eng_placement o) {
  eng_strategy st;
  memset(&st, 0, sizeof st);
  st.in[0] = w; st.in[1] = i; st.out[0] = o;
  return sh_push(out, cap, n, &st);
}

static int emb_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  const eng_dist_spec *w = s[0], *ix = s[1];
  eng_placement pw = w->placements[m];
  int n = 0, last = ix->ndim;
  if (n >= 0) n = emb_push(out, cap, n, sh_S(1), sh_R(), sh_S(last));
  if (n >= 0 && c->ints[0] < 0) n = emb_push(out, cap, n, sh_S(0), sh_R(), sh_P(ENG_REDUCE_SUM));
  for (int d = 0; d < ix->ndim && n >= 0; d++) n = emb_push(out, cap, n, sh_R(), sh_S(d), sh_S(d));
  if (n >= 0 && sh_is_P(&pw) && sh_is_linear_P(&pw)) n = emb_push(out, cap, n, pw, sh_R(), pw);
  if (n < 0) return n;
  return sh_all_replicate(out, cap, n, 2, 1);
}

static int emb_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* nd, int64_t (*shapes)[8]) {
  (void)c;
  const eng_dist_spec *w = s[0], *ix = s[1];
  if (w->ndim != 2) return eng_err("weight must be 2-D [num_embeddings, embedding_dim], got %d-d", w->ndim);
  if (ix->ndim + 1 > 8) return eng_err("indices have too many dims (%d)", ix->ndim);
  for (int d = 0; d < ix->ndim; d++) shapes[0][d] = ix->shape[d];
  shapes[0][ix->ndim] = w->shape[1];
  nd[0] = ix->ndim + 1;
  return 0;
}

static int emb_local(const eng_op_call* c, const eng_dist_spec* const* is, const eng_dist_spec* const* os,
                     eng_tensor** outs) {
  (void)os;
  const eng_dist_spec* w = is[0];
  int rows_sharded = 0;
  for (int m = 0; m < w->mesh_ndim; m++) /* a mesh dim of one rank holds every row: the plain lookup */
    if (sh_is_S(&w->placements[m]) && w->placements[m].dim == 0 && w->mesh_shape[m] > 1) rows_sharded = 1;
  if (!rows_sharded) { outs[0] = eng_embedding(c->in[0], c->in[1], c->ints[0]); return outs[0] ? 0 : -1; }
  /* Row-sharded weight: the masked op does not know the table size; check
   * the indices against the GLOBAL row count here (the same on the ranks
   * that share these indices). */
  eng_tensor* I = c->in[1];
  if (I->dtype != ENG_I32 && I->dtype != ENG_I64)
    return eng_err("indices must be i32 or i64, got %s", eng_desc(I));
  if (I->numel > 0 && I->device == ENG_CUDA) {
    /* CUDA: the gather kernel checks the range (one flag read; the indices stay on the device) */
    eng_tensor* Ip = dt_plain(I);
    outs[0] = Ip ? eng_embedding_masked_bounded(c->in[0], Ip, w->offset[0], w->shape[0]) : NULL;
    eng_tensor_release(Ip);
    return outs[0] ? 0 : -1;
  }
  if (I->numel > 0) {
    eng_tensor* Ip = dt_plain(I); /* the local indices (a plain view) */
    eng_tensor* Ic = Ip ? eng_op_host(Ip, ENG_I64) : NULL; /* CUDA indices: read back once for the range check */
    eng_tensor_release(Ip);
    if (!Ic) return -1;
    const int64_t* p = (const int64_t*)eng_ptr(Ic);
    int64_t num = w->shape[0];
    for (int64_t i = 0; i < Ic->numel; i++)
      if (p[i] < 0 || p[i] >= num) {
        eng_err("index %lld out of range for weight of %lld rows (valid 0..%lld), at flat position %lld of the "
                "local indices %s", (long long)p[i], (long long)num, (long long)num - 1, (long long)i, eng_desc(I));
        eng_tensor_release(Ic);
        return -1;
      }
    eng_tensor_release(Ic);
  }
  outs[0] = eng_embedding_masked(c->in[0], I, w->offset[0]);
  return outs[0] ? 0 : -1;
}

const eng_op_def eng_opdef_embedding = {"embedding", 1, emb_rule, emb_shape, NULL, emb_local, 0, 0, 1};
