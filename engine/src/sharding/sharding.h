/* sharding.h: DTensor op dispatch (sharding propagation).  Internal.
 *
 * Subsystem sharding/: the per-op sharding rules (strategies per mesh dim)
 * and the op defs that ops' guards hand to the dispatcher.  May call: core/,
 * autograd/, comm/, dtensor/ (strategy building blocks), ops/ (local compute).
 *
 * Every public op that takes tensors starts with a one-line guard:
 *
 *   if (ENG_DT_ACTIVE(a->dist || b->dist))
 *     return eng_dispatch(&eng_opdef_add, &(eng_op_call){.n_in = 2, .in = {a, b}});
 *
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
 *      declare it below (extern const eng_op_def eng_opdef_softmax;) and put the
 *      guard at the top of the op.
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
#include "core/internal.h"

#define ENG_OP_MAX_IN 8
#define ENG_OP_MAX_OUT 4

typedef struct eng_op_call {
  const char* name;               /* for messages; NULL: the def's name */
  int n_in;                       /* tensor inputs (NULL entries allowed: optional ones) */
  eng_tensor* in[ENG_OP_MAX_IN];
  int64_t ints[8];
  double scalars[4];
  int needs_grad;                 /* set by the dispatcher */
} eng_op_call;

typedef struct eng_strategy {
  eng_placement in[ENG_OP_MAX_IN];   /* required placement per tensor input */
  eng_placement out[ENG_OP_MAX_OUT]; /* placement per output */
} eng_strategy;

typedef int (*eng_rule_fn)(const eng_op_call* c, const eng_dist_spec* const* in_specs, int mesh_dim,
                           eng_strategy* out, int cap);
/* Global output shapes: writes ndims[j] and shapes[j][..] for each output. */
typedef int (*eng_shape_fn)(const eng_op_call* c, const eng_dist_spec* const* in_specs, int* ndims,
                            int64_t (*shapes)[8]);
typedef eng_tensor* (*eng_op_fn)(const eng_op_call* c);
typedef int (*eng_local_fn)(const eng_op_call* c, const eng_dist_spec* const* in_specs,
                            const eng_dist_spec* const* out_specs, eng_tensor** outs);

typedef struct eng_op_def {
  const char* name;
  int n_out;
  eng_rule_fn rule;
  eng_shape_fn shape;
  eng_op_fn fn;          /* default local function (one output) */
  eng_local_fn local;    /* rule-specific local function, or NULL */
  int scalars_in_key;
  int keeps_dtype;       /* the output has in[0]'s dtype (shape ops; core/meta.c uses it) */
  int agree_local;       /* the local function checks data that may differ between ranks (indices,
                          * targets): the dispatcher agrees on its success over every mesh dim where
                          * an input is not Replicate, so a failure on one rank fails every rank
                          * (naming it) before any later collective, instead of leaving the others
                          * waiting (eng_pg_agree; one small all_reduce per such dim) */
  int keeps_strided;     /* one input whose layout the output keeps (clone): a _StridedShard input is not
                          * replicated first; the rule must accept _StridedShard placements */
} eng_op_def;

/* ---- guard */
#define ENG_DT_ACTIVE(cond) (__builtin_expect(!!(cond), 0) && !eng_dtensor_local_mode())

/* ---- dispatch */
eng_tensor* eng_dispatch(const eng_op_def* def, eng_op_call* c);
/* Several outputs: writes def->n_out new references into outs. */
int eng_dispatch_multi(const eng_op_def* def, eng_op_call* c, eng_tensor** outs);
/* "<name>: no sharding strategy registered for DTensor arguments (...)". */
eng_tensor* eng_no_rule(const char* name, const eng_op_call* c);
int eng_no_rule_i(const char* name, const eng_op_call* c);
/* In-place ops (a op= others): others are redistributed to a's spec (a must
 * not be Partial unless mode allows it), then the op runs on the locals in
 * local mode via fn.  mode: 0 a may not be Partial; 1 linear (a may be
 * Partial when every DTensor other has a's exact spec); 2 scaling (a may be
 * Partial(sum/avg); no tensor others). */
int eng_dispatch_inplace(const char* name, int mode, eng_op_call* c, int (*fn)(eng_op_call* c));

/* ---- meta tensors (core/meta.c) */
/* The guards send an op to the dispatcher when an operand is meta too. */
#define ENG_META_T(t) ((t) && (t)->device == ENG_META)
/* 1 when some tensor operand of c is on the meta device. */
int eng_meta_any(const eng_op_call* c);
/* New meta outputs of def for call c: shapes from def->shape (out_specs NULL:
 * plain meta operands) or the local shapes of out_specs (meta DTensors);
 * dtypes from the op run on tiny CPU stand-ins.  0 or -1. */
int eng_meta_outputs(const eng_op_def* def, eng_op_call* c, eng_dist_spec* const* out_specs, eng_tensor** outs);
/* An in-place op into a plain meta tensor: checks devices and broadcasting,
 * writes nothing.  0 or -1. */
int eng_meta_inplace(const char* name, eng_op_call* c);

/* Dim list -> bit mask (n_dims 0: all dims); -1 on a bad dim. */
int64_t eng_dims_mask(int ndim, int n_dims, const int* dims, const char* op);

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
extern const eng_op_def eng_opdef_matmul, eng_opdef_linear;
/* sharding/embedding.c: ints[0] = padding_idx (-1 none); sharding/loss.c: cross_entropy ints[0] = ignore_index,
 * ints[1] = reduction (0 none, 1 mean, 2 sum), scalars[0] = label_smoothing (R3) */
extern const eng_op_def eng_opdef_embedding, eng_opdef_cross_entropy;
/* sharding/loss.c: nll_loss (logp, target, weight) ints as cross_entropy, ints[2] = 1: cross_entropy with
 * class weights (scalars[0] = label_smoothing); the elementwise losses (x, y,
 * weight, pos_weight; ops/loss_ext.c) ints[0] = kind (KC_PL_*), ints[1] = reduction (0 none, 1 mean, 2 sum,
 * 3 batchmean), scalars[0] = beta / delta; _checked: binary_cross_entropy (agree_local) */
extern const eng_op_def eng_opdef_nll_loss, eng_opdef_ploss, eng_opdef_ploss_checked;
/* R1: softmax ints[0] = dim, ints[1] = log; norm (layer_norm/rms_norm, inputs x, w, b) ints[0] = n_norm,
 * ints[1] = rms, scalars[0] = eps; dropout scalars[0] = p; sdpa (q, k, v, mask) ints[0] = is_causal,
 * scalars[0] = dropout_p, scalars[1] = scale */
extern const eng_op_def eng_opdef_softmax, eng_opdef_norm, eng_opdef_dropout, eng_opdef_sdpa;

/* op codes for the generic defs */
enum { ENG_SC_ADD, ENG_SC_SUB, ENG_SC_MUL, ENG_SC_DIV, ENG_SC_POW, ENG_SC_RSUB, ENG_SC_RDIV, ENG_SC_RPOW };
enum { ENG_BIN_ADD, ENG_BIN_SUB, ENG_BIN_MUL, ENG_BIN_DIV, ENG_BIN_POW, ENG_BIN_MAX, ENG_BIN_MIN };
enum { ENG_UN_NEG, ENG_UN_EXP, ENG_UN_LOG, ENG_UN_SQRT, ENG_UN_RSQRT, ENG_UN_ABS, ENG_UN_TANH, ENG_UN_SIGMOID,
       ENG_UN_RELU, ENG_UN_SILU, ENG_UN_GELU, ENG_UN_CLAMP, ENG_UN_LEAKY_RELU, ENG_UN_ELU, ENG_UN_HARDTANH,
       ENG_UN_SOFTPLUS };

/* ---- autograd glue: dtensor/dispatch.c installs its node marking and
 * backward into autograd through autograd/dist_hooks.h */

#endif
