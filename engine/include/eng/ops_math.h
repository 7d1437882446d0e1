/* ops_math.h: more of torch's pointwise math, reductions, scans and sorting.
 * Dims are 0-based here (negative counts from the end);
 * n_dims = 0 reduces over all dims.  Every op takes DTensors too (sharding
 * rules in engine/src/sharding/math.c; the composites clamp_tensor, lerp,
 * addcmul and addcdiv are made of dispatching ops and follow their rules).
 * CUDA tensors: a documented host fallback (engine/src/ops/math.c). */
#ifndef ENG_OPS_MATH_H
#define ENG_OPS_MATH_H
#include <stdint.h>
#include <stddef.h>
#include "tensor.h"

/* Unary math with autograd (floor/ceil/round/trunc/sign: zero gradient).
 * Integer inputs: floor, ceil, round, trunc, sign, square keep the dtype;
 * the others compute in f32.  round: half to even; decimals as PyTorch. */
eng_tensor* eng_sin(eng_tensor* a);
eng_tensor* eng_cos(eng_tensor* a);
eng_tensor* eng_floor(eng_tensor* a);
eng_tensor* eng_ceil(eng_tensor* a);
eng_tensor* eng_round(eng_tensor* a, int decimals);
eng_tensor* eng_trunc(eng_tensor* a);
eng_tensor* eng_sign(eng_tensor* a);
eng_tensor* eng_erf(eng_tensor* a);
eng_tensor* eng_log1p(eng_tensor* a);
eng_tensor* eng_expm1(eng_tensor* a);
eng_tensor* eng_reciprocal(eng_tensor* a);
eng_tensor* eng_square(eng_tensor* a);
/* Predicates (bool results, no gradient). */
eng_tensor* eng_isnan(eng_tensor* a);
eng_tensor* eng_isinf(eng_tensor* a);
eng_tensor* eng_isfinite(eng_tensor* a);
eng_tensor* eng_logical_not(eng_tensor* a);
/* NaN -> nan, +inf -> posinf, -inf -> neginf; a NaN posinf/neginf means the
 * dtype's largest/lowest finite value (PyTorch's default). */
eng_tensor* eng_nan_to_num(eng_tensor* a, double nan, double posinf, double neginf);

/* Broadcasting binary ops.  fmod: sign of a; remainder: sign of b;
 * floor_divide: rounds toward -inf (no gradient, as PyTorch); integer
 * division by zero is an error.  logical_and/or give bool. */
eng_tensor* eng_fmod(eng_tensor* a, eng_tensor* b);
eng_tensor* eng_remainder(eng_tensor* a, eng_tensor* b);
eng_tensor* eng_floor_divide(eng_tensor* a, eng_tensor* b);
eng_tensor* eng_logical_and(eng_tensor* a, eng_tensor* b);
eng_tensor* eng_logical_or(eng_tensor* a, eng_tensor* b);
/* div with a rounding mode: 0 none (true division, eng_div), 1 "trunc", 2 "floor" (eng_floor_divide);
 * integers stay integers with a rounding mode. */
eng_tensor* eng_div_rounding(eng_tensor* a, eng_tensor* b, int mode);

/* Composites.  clamp with tensor bounds (lo or hi may be NULL); lerp:
 * a + w (b - a) with a tensor weight (0-d for a number); out-of-place
 * addcmul a + v b c and addcdiv a + v b / c. */
eng_tensor* eng_clamp_tensor(eng_tensor* a, eng_tensor* lo, eng_tensor* hi);
eng_tensor* eng_lerp(eng_tensor* a, eng_tensor* b, eng_tensor* w);
eng_tensor* eng_addcmul(eng_tensor* a, eng_tensor* b, eng_tensor* c, double v);
eng_tensor* eng_addcdiv(eng_tensor* a, eng_tensor* b, eng_tensor* c, double v);

/* Reductions over dims.  prod: i64 for integer/bool input; amax/amin:
 * gradient split evenly among ties, NaN propagates, empty reductions are an
 * error; var/std: floating only, divisor max(0, N - correction); norm: ord
 * any p (INFINITY, -INFINITY and 0 included), computed in f32 for bf16/f16;
 * all/any: bool. */
eng_tensor* eng_prod(eng_tensor* t, int n_dims, const int* dims, int keepdim);
eng_tensor* eng_amax(eng_tensor* t, int n_dims, const int* dims, int keepdim);
eng_tensor* eng_amin(eng_tensor* t, int n_dims, const int* dims, int keepdim);
eng_tensor* eng_logsumexp(eng_tensor* t, int n_dims, const int* dims, int keepdim);
eng_tensor* eng_var(eng_tensor* t, int n_dims, const int* dims, double correction, int keepdim);
eng_tensor* eng_std(eng_tensor* t, int n_dims, const int* dims, double correction, int keepdim);
eng_tensor* eng_vector_norm(eng_tensor* t, double ord, int n_dims, const int* dims, int keepdim);
eng_tensor* eng_all(eng_tensor* t, int n_dims, const int* dims, int keepdim);
eng_tensor* eng_any(eng_tensor* t, int n_dims, const int* dims, int keepdim);

/* Along one dim.  cumsum/cumprod keep float dtypes (integer/bool -> i64). */
eng_tensor* eng_cumsum(eng_tensor* t, int dim);
eng_tensor* eng_cumprod(eng_tensor* t, int dim);
/* sort: values and i64 indices (stable: ties keep their order; NaN sorts
 * as the largest).  topk: the k largest (or smallest), sorted or in the
 * order PyTorch's CPU kernel leaves them (sorted = 0).
 * kthvalue: the k-th smallest (k 1-based as PyTorch) and its index.  Each
 * writes the indices to *indices when non-NULL; argsort returns them. */
eng_tensor* eng_sort(eng_tensor* t, int dim, int descending, eng_tensor** indices);
eng_tensor* eng_argsort(eng_tensor* t, int dim, int descending);
eng_tensor* eng_topk(eng_tensor* t, int64_t k, int dim, int largest, int sorted, eng_tensor** indices);
eng_tensor* eng_kthvalue(eng_tensor* t, int64_t k, int dim, int keepdim, eng_tensor** indices);

#endif
