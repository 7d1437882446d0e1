/* ops.h: declarations shared by the ops and the sharding rules.  Internal.
 *
 * Subsystem ops/: the engine's ops (pointwise, reductions, views and joins,
 * matmul, softmax, norms, losses, embedding, dropout, attention, fused
 * optimizer updates) with their autograd formulas; each public op opens with
 * the guard that hands DTensor arguments to the dispatcher (sharding/sharding.h).
 * May call: core/, autograd/ (recording nodes), cuda/ (device side),
 * sharding/ (op defs), kernels/. */
#ifndef ENG_OPS_H
#define ENG_OPS_H
#include "core/internal.h"

/* Sharded random ops (local mode; the box of the shard is spec->offset +
 * x->shape of spec->shape; the generator advances by the global count):
 * dropout.c, attention.c (pshape/pstart: the global attention weights' shape
 * and the shard's start in it). */
eng_tensor* eng_dropout_shard(eng_tensor* x, double p, const eng_dist_spec* spec);
eng_tensor* eng_sdpa_shard(eng_tensor* q, eng_tensor* k, eng_tensor* v, eng_tensor* mask, double dropout_p,
                           int is_causal, double scale, const int64_t* pshape, const int64_t* pstart);

#endif
