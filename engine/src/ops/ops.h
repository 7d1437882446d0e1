/* ops.h: declarations shared by the ops and the sharding rules.  Internal.
 *
 * Subsystem ops/: the engine's ops (pointwise, reductions, views and joins,
 * matmul, softmax, norms, losses, embedding, dropout, attention, fused
 * optimizer updates) with their autograd formulas; each public op opens with
 * the guard that hands DTensor and meta arguments to the dispatcher through
 * the registration point core/dispatch.h (by op id: ops never name the
 * dispatcher, an op def or the DTensor layer).
 * The device side of the ops is here too (ops/cuda_*.c over kernels/cuda/,
 * declared in ops/cuda_*.h).
 * May call: core/, autograd/ (recording nodes), cuda/ (the runtime: streams,
 * memory, deferred checks), kernels/. */
#ifndef ENG_OPS_H
#define ENG_OPS_H
#include "core/dispatch.h"

/* Sharded random ops (local mode; the box of the shard is spec->offset +
 * x->shape of spec->shape; the generator advances by the global count):
 * dropout.c, attention.c (pshape/pstart: the global attention weights' shape
 * and the shard's start in it). */
eng_tensor* eng_dropout_shard(eng_tensor* x, double p, const eng_dist_spec* spec);
eng_tensor* eng_sdpa_shard(eng_tensor* q, eng_tensor* k, eng_tensor* v, eng_tensor* mask, double dropout_p,
                           int is_causal, double scale, const int64_t* pshape, const int64_t* pstart);

/* attention.c: 1 when q, k, v are [B, H, L, D] views of one [B, L, 3 H D] tensor, its three last-dim thirds (the
 * models' fused QKV projection): their gradients then go to the same places of one new tensor, which the split's
 * backward takes whole (adjacent pieces: no cat).  Used by the CPU and CUDA backwards. */
int eng_sdpa_fused_qkv(const eng_tensor* q, const eng_tensor* k, const eng_tensor* v);

/* The CUDA host fallback of ops without device kernels (index.c; used by loss_ext.c): a contiguous host copy
 * of t in dtype (new reference), and a host result moved to device (consumes r); neither records autograd. */
eng_tensor* eng_op_host(eng_tensor* t, int dtype);
eng_tensor* eng_op_to_device(eng_tensor* r, int device);

/* loss_ext.c: the fused losses on local tensors, for their sharding rules
 * (sharding/loss.c).  nll: red 0 none, 1 mean, 2 sum; *wsum_out (if non-NULL)
 * gets the local sum of the non-ignored targets' weights.  Elementwise losses
 * (kind KC_PL_* of kernels/cpu/kcpu.h; w / pw NULL or x's shape): red 0 none,
 * else the sum divided by divisor (eng_ploss_divisor of the GLOBAL shape:
 * red 1 mean -> numel, 3 batchmean -> shape[0], 2 sum -> 1). */
eng_tensor* eng_nll_loss_local(eng_tensor* x, eng_tensor* target, eng_tensor* weight, int64_t ignore, int red,
                               double* wsum_out);
/* cross_entropy with class weights (weight non-NULL), as eng_nll_loss_local. */
eng_tensor* eng_cross_entropy_weighted_local(eng_tensor* x, eng_tensor* target, eng_tensor* weight, int64_t ignore,
                                             int red, double eps, double* wsum_out);
eng_tensor* eng_ploss_local(int kind, eng_tensor* x, eng_tensor* y, eng_tensor* w, eng_tensor* pw, int red,
                            double param, double divisor);
double eng_ploss_divisor(int red, int ndim, const int64_t* shape, int64_t numel);

/* The ops of ops/math.c, ops/reduce2.c and ops/sort.c by op code (ENG_R2_*, ENG_AL_* in core/dispatch.h; the math
 * codes KM_* of kernels/cpu/kmath.h), for their sharding rules (sharding/math.c). */
eng_tensor* eng_math_unary_op(int op, eng_tensor* a, const double* p);
eng_tensor* eng_math_binary_op(int op, eng_tensor* a, eng_tensor* b);
eng_tensor* eng_reduce2_op(int op, eng_tensor* t, int64_t mask, int keepdim, double s);
int eng_along_op(int op, eng_tensor* t, int dim, int64_t k, int flag, eng_tensor** values, eng_tensor** indices);

#endif
