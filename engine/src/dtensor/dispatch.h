/* dispatch.h: the DTensor dispatcher's side of core/dispatch.h (not public).
 * What an op def is (the rule, shape and local functions of one op, written
 * in sharding/), the generic dispatch that runs one, the table that maps op
 * ids to op defs or handlers, and the meta device (dtensor/meta.c), whose ops
 * run through the same op defs for their shapes. */
#ifndef ENG_DTENSOR_DISPATCH_H
#define ENG_DTENSOR_DISPATCH_H
#include "core/dispatch.h"
#include "eng/dtensor.h"

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
  int keeps_dtype;       /* the output has in[0]'s dtype (shape ops, rotary_emb; dtensor/meta.c uses it) */
  int agree_local;       /* the local function checks data that may differ between ranks (indices,
                          * targets): the dispatcher agrees on its success over every mesh dim where
                          * an input is not Replicate, so a failure on one rank fails every rank
                          * (naming it) before any later collective, instead of leaving the others
                          * waiting (eng_pg_agree; one small all_reduce per such dim) */
  int keeps_strided;     /* one input whose layout the output keeps (clone): a _StridedShard input is not
                          * replicated first; the rule must accept _StridedShard placements */
} eng_op_def;

/* ---- dispatch by op def (dtensor/dispatch.c) */
eng_tensor* eng_dispatch(const eng_op_def* def, eng_op_call* c);
/* Several outputs: writes def->n_out new references into outs. */
int eng_dispatch_multi(const eng_op_def* def, eng_op_call* c, eng_tensor** outs);
/* "<name>: no sharding strategy registered for DTensor arguments (...)". */
eng_tensor* eng_no_rule(const char* name, const eng_op_call* c);
int eng_no_rule_i(const char* name, const eng_op_call* c);
/* In-place ops: see eng_dispatcher.call_inplace in core/dispatch.h. */
int eng_dispatch_inplace(const char* name, int mode, eng_op_call* c, int (*fn)(eng_op_call* c));

/* ---- the op table: what handles each op id.  An op def (sharding rule) or
 * a handler (an op with its own DTensor form); multi handlers write up to
 * c->n_tensors outputs into c->tensors and return their count. */
typedef eng_tensor* (*eng_op_handler)(eng_op_call* c);
typedef int (*eng_op_handler_multi)(eng_op_call* c, eng_tensor** outs);
void eng_dt_register_def(eng_op_id op, const eng_op_def* def);
void eng_dt_register_handler(eng_op_id op, eng_op_handler fn, eng_op_handler_multi multi);
/* The op def registered for op, or NULL. */
const eng_op_def* eng_dt_op_def(eng_op_id op);

/* ---- global norms over DTensor shards (dtensor/norm_reduce.c): eng_dispatcher.norm_reduce */
int eng_dt_norm_reduce(const char* op, int n, const eng_dist_spec* const* layouts, const uint32_t* masks,
                       const double* acc, int kind, int err, double* out);

/* ---- meta tensors (dtensor/meta.c) */
/* 1 when some tensor operand of c is on the meta device. */
int eng_meta_any(const eng_op_call* c);
/* New meta outputs of def for call c: shapes from def->shape (out_specs NULL:
 * plain meta operands) or the local shapes of out_specs (meta DTensors);
 * dtypes from the op run on tiny CPU stand-ins.  0 or -1. */
int eng_meta_outputs(const eng_op_def* def, eng_op_call* c, eng_dist_spec* const* out_specs, eng_tensor** outs);
/* An in-place op into a plain meta tensor: checks devices and broadcasting,
 * writes nothing.  0 or -1. */
int eng_meta_inplace(const char* name, eng_op_call* c);

#endif
