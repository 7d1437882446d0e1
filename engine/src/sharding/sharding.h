/* sharding.h: DTensor op dispatch (sharding propagation).  Internal.
 *
 * Subsystem sharding/: the per-op sharding rules (strategies per mesh dim)
 * and the op defs that ops' guards hand to the dispatcher.  May call: core/,
 * autograd/, comm/, dtensor/ (strategy building blocks), ops/ (local compute).
 *
 * Every public op that takes tensors starts with a one-line guard:
 *
 *   if (ENG_DT_ACTIVE(a->dist || b->dist))
 *     return eng_op_dispatch(ENG_OP_BINARY, &(eng_op_call){.n_in = 2, .in = {a, b}, .ints = {which}});
 *
 * (core/dispatch.h: the op id names the call; the op def registered for that
 * id in sharding/registry.c says how it is sharded.) *
 * (ENG_DT_ACTIVE is false in local mode, when the dispatcher runs an op on
 * local shards.)  Ops without a rule use eng_no_rule / eng_no_rule_i, which
 * raise "<op>: no sharding strategy registered for DTensor arguments (...)".
 *
 * HOW TO ADD A RULE (one rule function + one op-def line, e.g. in a
 * sharding_<concept>.c file):
 *
 *   1. The rule, written for ONE mesh dim: given the inputs' specs (global
 *      shapes, placements[mesh_dim] = current placement on that mesh dim),
 *      write candidate strategies into out[0..cap) and return their count
 *      (or -1 after eng_err).  A strategy gives the REQUIRED placement of each
 *      tensor input (in[i]; ignored for NULL inputs) and the placement of each
 *      output (out[j]) on that mesh dim.  List preferred candidates first and
 *      always include all-Replicate unless impossible.  The dispatcher picks,
 *      per mesh dim, the candidate whose input redistribution is cheapest
 *      (see dt_redistribute_cost); ties go to the earlier candidate.
 *        static int softmax_rule(const eng_op_call* c, const eng_dist_spec* const* s,
 *                                int m, eng_strategy* out, int cap) { ... }
 *      Helpers: sh_R(), sh_S(d), sh_P(op), sh_is_S/R/P, sh_push (append with
 *      a cap check), sh_all_replicate.
 *   2. A shape function giving the GLOBAL output shapes from the input specs
 *      (sh_shape_same0, sh_shape_broadcast, ... or your own).
 *   3. The local function (optional): runs with local mode on, given the
 *      call whose in[] are the redistributed DTensors (ops ignore `dist` in
 *      local mode, so calling the public op computes on the local shards),
 *      the chosen input specs and the output specs; writes new references to
 *      n_out outputs (plain tensors with the local shard).  Default (.local =
 *      NULL): .fn, a one-liner calling the op itself:
 *        static eng_tensor* softmax_fn(const eng_op_call* c) { return eng_softmax(c->in[0], (int)c->ints[0]); }
 *      Variants (mean over a sharded dim = local sum * 1/N_global) read the
 *      specs, e.g. in_specs[0]->shape.  Collectives over a mesh dim's group
 *      are allowed inside (eng_mesh_get_group(in_specs[0]->mesh, m)).
 *   4. The op def, one line:
 *        const eng_op_def eng_opdef_softmax = {"softmax", 1, softmax_rule, sh_shape_same0, softmax_fn, NULL};
 *      declare it below (extern const eng_op_def eng_opdef_softmax;), give the op
 *      an id in core/dispatch.h (ENG_OP_SOFTMAX), register the def for that id
 *      in sharding/registry.c, and put the guard at the top of the op.
 *
 * Autograd is generic: every node created while a local function runs is
 * marked; its backward redistributes incoming DTensor grads to the adjoint of
 * the output specs, runs in local mode, and wraps the grads of the op's
 * DTensor inputs with their adjoint specs (Shard(d) -> Shard(d), Partial ->
 * Replicate, Replicate -> Replicate where the outputs are Replicate on that
 * mesh dim, else Partial(sum)).  A local function therefore needs no backward
 * of its own unless it communicates (then write an autograd node whose
 * backward does the matching collective).
 *
 * Call encoding: ints/scalars are op-specific and dims are 0-based and
 * normalized before the call is built.  Strategies depending on ints are
 * cached per ints; scalars enter the cache key only when .scalars_in_key is
 * set.  c->needs_grad (set by the dispatcher, part of the key) tells rules
 * whether a gradient will flow (Partial(max/min) outputs are exact in value
 * but have no sum-decomposable gradient: rules offer them only without grad).
 */
#ifndef ENG_SHARDING_H
#define ENG_SHARDING_H
#include "dtensor/dispatch.h"

/* ---- helpers for rules */
static inline eng_placement sh_R(void) { eng_placement p = {ENG_PLACEMENT_REPLICATE, 0, 0}; return p; }
static inline eng_placement sh_S(int d) { eng_placement p = {ENG_PLACEMENT_SHARD, d, 0}; return p; }
static inline eng_placement sh_P(int op) { eng_placement p = {ENG_PLACEMENT_PARTIAL, 0, op}; return p; }
static inline int sh_is_R(const eng_placement* p) { return p->kind == ENG_PLACEMENT_REPLICATE; }
static inline int sh_is_S(const eng_placement* p) { return p->kind == ENG_PLACEMENT_SHARD; }
static inline int sh_is_P(const eng_placement* p) { return p->kind == ENG_PLACEMENT_PARTIAL; }
/* Partial(sum) or Partial(avg): commutes with linear maps. */
int sh_is_linear_P(const eng_placement* p);
/* Appends s to out (n = current count); returns the new count or -1 if full. */
int sh_push(eng_strategy* out, int cap, int n, const eng_strategy* s);
/* Appends the strategy (inputs a, b, c; one output o): three-input ops (linear, linear_gelu, rotary_emb). */
int sh_push3(eng_strategy* out, int cap, int n, eng_placement a, eng_placement b, eng_placement c, eng_placement o);
/* Appends the all-Replicate strategy for n_in inputs and n_out outputs. */
int sh_all_replicate(eng_strategy* out, int cap, int n, int n_in, int n_out);

/* ---- shape helpers */
int sh_shape_same0(const eng_op_call* c, const eng_dist_spec* const* s, int* ndims, int64_t (*shapes)[8]);
int sh_shape_broadcast(const eng_op_call* c, const eng_dist_spec* const* s, int* ndims, int64_t (*shapes)[8]);

/* ---- op defs (sharding/pointwise.c, sharding/reduce.c, sharding/matmul.c) */
/* unary: ints[0] = unary op code (sharding/pointwise.c), scalars = params */
extern const eng_op_def eng_opdef_unary;
extern const eng_op_def eng_opdef_cast;           /* ints[0] = dtype */
extern const eng_op_def eng_opdef_clone;            /* ints[0]: 0 clone, 1 contiguous */
/* scalar forms: ints[0] = which (ENG_SC_*), scalars[0] = s */
extern const eng_op_def eng_opdef_scalar;
/* binary: ints[0] = which (ENG_BIN_*) */
extern const eng_op_def eng_opdef_binary;
extern const eng_op_def eng_opdef_compare;        /* ints[0] = cmp */
extern const eng_op_def eng_opdef_compare_scalar; /* ints[0] = cmp, scalars[0] = s */
extern const eng_op_def eng_opdef_where;
extern const eng_op_def eng_opdef_masked_fill;    /* scalars[0] = value */
/* reductions: ints[0] = dim mask, ints[1] = keepdim */
extern const eng_op_def eng_opdef_sum, eng_opdef_mean;
/* ints[0] = dim, ints[1] = keepdim, ints[2] = 1 max / 0 min; n_out 2 (values, indices) or values only */
extern const eng_op_def eng_opdef_max_dim, eng_opdef_max_dim_values;
extern const eng_op_def eng_opdef_extreme_all;    /* ints[0] = 1 max / 0 min */
extern const eng_op_def eng_opdef_argext;         /* ints[0] = dim, ints[1] = keepdim, ints[2] = 1 argmax / 0 argmin */
extern const eng_op_def eng_opdef_argmax_all;
/* linear_gelu: ints[0] = approximate (0 erf, 1 tanh) */
extern const eng_op_def eng_opdef_matmul, eng_opdef_linear, eng_opdef_linear_gelu;
/* sharding/embedding.c: ints[0] = padding_idx (-1 none); sharding/loss.c: cross_entropy ints[0] = ignore_index,
 * ints[1] = reduction (0 none, 1 mean, 2 sum), scalars[0] = label_smoothing (R3) */
extern const eng_op_def eng_opdef_embedding, eng_opdef_cross_entropy;
/* sharding/loss.c: nll_loss (logp, target, weight) ints as cross_entropy, ints[2] = 1: cross_entropy with
 * class weights (scalars[0] = label_smoothing); the elementwise losses (x, y,
 * weight, pos_weight; ops/loss_ext.c) ints[0] = kind (KC_PL_*), ints[1] = reduction (0 none, 1 mean, 2 sum,
 * 3 batchmean), scalars[0] = beta / delta; _checked: binary_cross_entropy (agree_local) */
extern const eng_op_def eng_opdef_nll_loss, eng_opdef_ploss, eng_opdef_ploss_checked;
/* sharding/loss_parallel.c: eng_cross_entropy_vocab_parallel with an optional replicated class weight
 * [vocab_total] (NULL: none); *wsum_out (may be NULL) gets the mean's divisor: the count of non-ignored targets,
 * or the sum of their weights.  New reference or NULL. */
eng_tensor* sh_cross_entropy_vocab_parallel_w(eng_tensor* logits, eng_tensor* target, eng_tensor* weight,
                                              int64_t vocab_offset, int64_t vocab_total, struct eng_pg* group,
                                              int64_t ignore_index, int reduction, double* wsum_out);
/* R1: softmax ints[0] = dim, ints[1] = log; norm (layer_norm/rms_norm, inputs x, w, b) ints[0] = n_norm,
 * ints[1] = rms, scalars[0] = eps; dropout scalars[0] = p; sdpa (q, k, v, mask) ints[0] = is_causal,
 * scalars[0] = dropout_p, scalars[1] = scale */
extern const eng_op_def eng_opdef_softmax, eng_opdef_norm, eng_opdef_dropout, eng_opdef_sdpa;
/* sharding/rope.c: rotary_emb (x [B, T, H, D], cos, sin [T, D / 2]) */
extern const eng_op_def eng_opdef_rotary_emb;
/* sharding/pointwise.c: silu_mul (a, b) of one shape */
extern const eng_op_def eng_opdef_silu_mul;


/* ---- autograd glue: dtensor/dispatch.c installs its node marking and
 * backward into autograd through autograd/dist_hooks.h */

#endif
