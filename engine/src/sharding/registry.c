/* registry.c: the sharding rules' entries in the dispatcher's op table
 * (dtensor/dispatch.h): one op def per op id with a rule, one handler per
 * shape or index op with its own DTensor form (sharding/shape.c,
 * sharding/index.c).  Installed when the library loads. */
#include "sharding/sharding.h"
#include "sharding/sharding_math.h"
#include "sharding/sharding_shape.h"
#include "sharding/sharding_index.h"

/* ---- handlers: the call encoding of core/dispatch.h unpacked */
static eng_tensor* h_view(eng_op_call* c) {
  return eng_dt_reshape(c->in[0], c->n_list, c->list, (int)c->ints[0], c->ints[0] ? "reshape" : "view");
}
static eng_tensor* h_squeeze(eng_op_call* c) { return eng_dt_squeeze(c->in[0], (int)c->ints[0], (int)c->ints[1]); }
static eng_tensor* h_unsqueeze(eng_op_call* c) { return eng_dt_unsqueeze(c->in[0], (int)c->ints[0]); }
static eng_tensor* h_flatten(eng_op_call* c) { return eng_dt_flatten(c->in[0], (int)c->ints[0], (int)c->ints[1]); }
static eng_tensor* h_transpose(eng_op_call* c) {
  return eng_dt_transpose(c->in[0], (int)c->ints[0], (int)c->ints[1]);
}
static eng_tensor* h_permute(eng_op_call* c) {
  int dims[ENG_MAX_DIMS];
  if (c->n_list > ENG_MAX_DIMS) return eng_errp("permute: %d dims (at most %d)", c->n_list, ENG_MAX_DIMS);
  for (int i = 0; i < c->n_list; i++) dims[i] = (int)c->list[i];
  return eng_dt_permute(c->in[0], c->n_list, dims);
}
static eng_tensor* h_expand(eng_op_call* c) { return eng_dt_expand(c->in[0], c->n_list, c->list); }
static eng_tensor* h_narrow(eng_op_call* c) {
  return eng_dt_narrow(c->in[0], (int)c->ints[0], c->ints[1], c->ints[2]);
}
static eng_tensor* h_select(eng_op_call* c) { return eng_dt_select(c->in[0], (int)c->ints[0], c->ints[1]); }
static eng_tensor* h_index_select(eng_op_call* c) {
  return eng_dt_index_select(c->in[0], (int)c->ints[0], c->in[1]);
}
static eng_tensor* h_join(eng_op_call* c) {
  return eng_dt_join(c->n_tensors, c->tensors, (int)c->ints[0], (int)c->ints[1]);
}
static int h_split(eng_op_call* c, eng_tensor** outs) {
  return eng_dt_split(c->in[0], (int)c->ints[0], c->ints[1], c->n_list, c->list, (int)c->ints[2], (int)c->ints[3],
                      outs);
}
static eng_tensor* h_gather(eng_op_call* c) { return eng_dt_gather(c->in[0], (int)c->ints[0], c->in[1]); }
static eng_tensor* h_scatter(eng_op_call* c) {
  return eng_dt_scatter(c->in[0], (int)c->ints[0], c->in[1], c->in[2], (int)c->ints[1]);
}
static eng_tensor* h_index_put(eng_op_call* c) {
  return eng_dt_index_put(c->in[0], (int)c->ints[0], c->in[1], c->in[2], (int)c->ints[1], c->scalars[0]);
}

__attribute__((constructor)) static void register_sharding(void) {
  static const struct { eng_op_id op; const eng_op_def* def; } defs[] = {
      {ENG_OP_UNARY, &eng_opdef_unary},
      {ENG_OP_CAST, &eng_opdef_cast},
      {ENG_OP_CLONE, &eng_opdef_clone},
      {ENG_OP_SCALAR, &eng_opdef_scalar},
      {ENG_OP_BINARY, &eng_opdef_binary},
      {ENG_OP_COMPARE, &eng_opdef_compare},
      {ENG_OP_COMPARE_SCALAR, &eng_opdef_compare_scalar},
      {ENG_OP_WHERE, &eng_opdef_where},
      {ENG_OP_MASKED_FILL, &eng_opdef_masked_fill},
      {ENG_OP_SUM, &eng_opdef_sum},
      {ENG_OP_MEAN, &eng_opdef_mean},
      {ENG_OP_MAX_DIM, &eng_opdef_max_dim},
      {ENG_OP_MAX_DIM_VALUES, &eng_opdef_max_dim_values},
      {ENG_OP_EXTREME_ALL, &eng_opdef_extreme_all},
      {ENG_OP_ARGEXT, &eng_opdef_argext},
      {ENG_OP_ARGMAX_ALL, &eng_opdef_argmax_all},
      {ENG_OP_MATMUL, &eng_opdef_matmul},
      {ENG_OP_LINEAR, &eng_opdef_linear},
      {ENG_OP_LINEAR_GELU, &eng_opdef_linear_gelu},
      {ENG_OP_EMBEDDING, &eng_opdef_embedding},
      {ENG_OP_CROSS_ENTROPY, &eng_opdef_cross_entropy},
      {ENG_OP_NLL_LOSS, &eng_opdef_nll_loss},
      {ENG_OP_PLOSS, &eng_opdef_ploss},
      {ENG_OP_PLOSS_CHECKED, &eng_opdef_ploss_checked},
      {ENG_OP_SOFTMAX, &eng_opdef_softmax},
      {ENG_OP_NORM, &eng_opdef_norm},
      {ENG_OP_DROPOUT, &eng_opdef_dropout},
      {ENG_OP_SDPA, &eng_opdef_sdpa},
      {ENG_OP_ROTARY_EMB, &eng_opdef_rotary_emb},
      {ENG_OP_SILU_MUL, &eng_opdef_silu_mul},
      {ENG_OP_MATH_UNARY, &eng_opdef_math_unary},
      {ENG_OP_MATH_BINARY, &eng_opdef_math_binary},
      {ENG_OP_MATH_BINARY_INT, &eng_opdef_math_binary_int},
      {ENG_OP_REDUCE2, &eng_opdef_reduce2},
      {ENG_OP_ALONG, &eng_opdef_along},
      {ENG_OP_ALONG2, &eng_opdef_along2},
  };
  for (size_t i = 0; i < sizeof defs / sizeof defs[0]; i++) eng_dt_register_def(defs[i].op, defs[i].def);
  static const struct { eng_op_id op; eng_op_handler fn; } handlers[] = {
      {ENG_OP_VIEW, h_view},           {ENG_OP_SQUEEZE, h_squeeze}, {ENG_OP_UNSQUEEZE, h_unsqueeze},
      {ENG_OP_FLATTEN, h_flatten},     {ENG_OP_TRANSPOSE, h_transpose}, {ENG_OP_PERMUTE, h_permute},
      {ENG_OP_EXPAND, h_expand},       {ENG_OP_NARROW, h_narrow},   {ENG_OP_SELECT, h_select},
      {ENG_OP_INDEX_SELECT, h_index_select}, {ENG_OP_JOIN, h_join}, {ENG_OP_GATHER, h_gather},
      {ENG_OP_SCATTER, h_scatter},     {ENG_OP_INDEX_PUT, h_index_put},
  };
  for (size_t i = 0; i < sizeof handlers / sizeof handlers[0]; i++)
    eng_dt_register_handler(handlers[i].op, handlers[i].fn, NULL);
  eng_dt_register_handler(ENG_OP_SPLIT, NULL, h_split);
}
