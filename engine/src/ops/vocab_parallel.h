/* vocab_parallel.h: the local phases of vocab-parallel cross entropy (the op and its collectives live in
 * sharding/loss_parallel.c), one function per phase, each run on the device of its tensors: the CPU loops here
 * (the reference) or the CUDA kernels (kernels/cuda/vocab_parallel.cu).  Internal.
 *
 * X: the local logits [M, V] (contiguous, f32 or f64), T: targets (contiguous i64 [M]), off: the slice's first
 * class; per-row buffers f64 on X's device: mx [M + 1] (row max; mx[M] the error code), se [M + 1] (sum of exp;
 * se[M] the local V), tl [M] (target logit), rw [M] (weight of the row's target, or NULL), ws [1] (the mean's
 * divisor).  0, or -1 with the error set. */
#ifndef ENG_OPS_VOCAB_PARALLEL_H
#define ENG_OPS_VOCAB_PARALLEL_H
#include "core/internal.h"

/* rw, ws, and mx[M] = max(slice_err, 2 if a target is neither ignore nor in [0, total)); W f64 [total] or NULL. */
int eng_vp_ce_prep(eng_tensor* T, eng_tensor* W, int64_t total, int64_t ignore, double slice_err, eng_tensor* rw,
                   eng_tensor* mx, eng_tensor* ws);
/* mx[i] = the row max of X. */
int eng_vp_ce_max(eng_tensor* X, eng_tensor* mx);
/* After the max all_reduce: se[i], se[M] = V, tl[i]. */
int eng_vp_ce_sumexp(eng_tensor* X, eng_tensor* mx, eng_tensor* T, int64_t off, int64_t ignore, eng_tensor* se,
                     eng_tensor* tl);
/* After the sum all_reduces: lse [M] (X's dtype) and out (X's dtype: [M] for reduction 0, else [1]/0-d). */
int eng_vp_ce_loss(eng_tensor* mx, eng_tensor* se, eng_tensor* tl, eng_tensor* T, int64_t ignore, eng_tensor* rw,
                   eng_tensor* ws, int reduction, eng_tensor* lse, eng_tensor* out);
/* The local logits gradient (new, X's shape and dtype): g contiguous f32/f64 on X's device, [M] (per_row) or one
 * element; div: ws for the mean, else NULL. */
eng_tensor* eng_vp_ce_grad(eng_tensor* X, eng_tensor* lse, eng_tensor* T, int64_t off, int64_t ignore, eng_tensor* g,
                           int per_row, eng_tensor* rw, eng_tensor* div);
/* Reads n f64 values of a contiguous f64 tensor from element i (a device tensor: one sync). */
int eng_vp_read(eng_tensor* t, int64_t i, int n, double* out);

/* embedding_masked (ops/embedding_masked.c) with the global range check of a row-sharded embedding's indices: an
 * index outside [0, total) fails, naming it (on CUDA checked by the gather kernel: one flag read, the indices stay
 * on the device). */
eng_tensor* eng_embedding_masked_bounded(eng_tensor* weight, eng_tensor* indices, int64_t row_offset, int64_t total);

#endif
