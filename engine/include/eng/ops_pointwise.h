/* ops_pointwise.h: elementwise ops with broadcasting and autograd.
 * Binary ops broadcast like PyTorch and promote dtypes (eng_promote_types).
 * bf16/f16 compute in f32 and round the result. */
#ifndef ENG_OPS_POINTWISE_H
#define ENG_OPS_POINTWISE_H
#include <stdint.h>
#include <stddef.h>
#include "tensor.h"

eng_tensor* eng_add(eng_tensor* a, eng_tensor* b);
eng_tensor* eng_sub(eng_tensor* a, eng_tensor* b);
eng_tensor* eng_mul(eng_tensor* a, eng_tensor* b);
eng_tensor* eng_div(eng_tensor* a, eng_tensor* b);
eng_tensor* eng_pow(eng_tensor* a, eng_tensor* b);
eng_tensor* eng_maximum(eng_tensor* a, eng_tensor* b);
eng_tensor* eng_minimum(eng_tensor* a, eng_tensor* b);

/* Tensor-scalar forms (the scalar does not change the dtype of a float
 * tensor). rsub: s - a, rdiv: s / a, rpow: s ^ a. */
eng_tensor* eng_add_scalar(eng_tensor* a, double s);
eng_tensor* eng_sub_scalar(eng_tensor* a, double s);
eng_tensor* eng_mul_scalar(eng_tensor* a, double s);
eng_tensor* eng_div_scalar(eng_tensor* a, double s);
eng_tensor* eng_pow_scalar(eng_tensor* a, double s);
eng_tensor* eng_rsub_scalar(double s, eng_tensor* a);
eng_tensor* eng_rdiv_scalar(double s, eng_tensor* a);
eng_tensor* eng_rpow_scalar(double s, eng_tensor* a);

/* Unary. gelu: approximate 0 = exact (erf), 1 = tanh. */
eng_tensor* eng_neg(eng_tensor* a);
eng_tensor* eng_exp(eng_tensor* a);
eng_tensor* eng_log(eng_tensor* a);
eng_tensor* eng_sqrt(eng_tensor* a);
eng_tensor* eng_rsqrt(eng_tensor* a);
eng_tensor* eng_abs(eng_tensor* a);
eng_tensor* eng_tanh(eng_tensor* a);
eng_tensor* eng_sigmoid(eng_tensor* a);
eng_tensor* eng_relu(eng_tensor* a);
eng_tensor* eng_gelu(eng_tensor* a, int approximate);
eng_tensor* eng_silu(eng_tensor* a);
eng_tensor* eng_clamp(eng_tensor* a, double lo, double hi); /* NaN bound = none */
/* torch.nn.functional's activations with PyTorch's gradients: leaky_relu
 * (negative_slope, also at 0), elu (alpha), hardtanh (min_val <= max_val;
 * gradient 0 at and outside the bounds; integer tensors clamp to the
 * truncated bounds), softplus (beta, threshold: x where x beta > threshold). */
eng_tensor* eng_leaky_relu(eng_tensor* a, double negative_slope);
eng_tensor* eng_elu(eng_tensor* a, double alpha);
eng_tensor* eng_hardtanh(eng_tensor* a, double min_val, double max_val);
eng_tensor* eng_softplus(eng_tensor* a, double beta, double threshold);

/* Comparisons give bool tensors; no gradient. */
typedef enum eng_cmp { ENG_EQ = 0, ENG_NE = 1, ENG_LT = 2, ENG_LE = 3, ENG_GT = 4, ENG_GE = 5 } eng_cmp;
eng_tensor* eng_compare(eng_tensor* a, eng_tensor* b, int op);
eng_tensor* eng_compare_scalar(eng_tensor* a, double s, int op);
/* cond ? a : b (cond bool/u8; broadcast all three). */
eng_tensor* eng_where(eng_tensor* cond, eng_tensor* a, eng_tensor* b);
/* t with value where mask is true (mask broadcast to t). */
eng_tensor* eng_masked_fill(eng_tensor* t, eng_tensor* mask, double value);

/* In-place arithmetic for optimizers and initialisation.  Not recorded by
 * autograd; an error if t is a leaf that requires grad while grad mode is
 * on (as in PyTorch).  b broadcasts to a. */
int eng_add_(eng_tensor* a, eng_tensor* b, double alpha);      /* a += alpha*b */
int eng_sub_(eng_tensor* a, eng_tensor* b);                    /* a -= b */
int eng_mul_(eng_tensor* a, eng_tensor* b);                    /* a *= b */
int eng_div_(eng_tensor* a, eng_tensor* b);                    /* a /= b */
int eng_add_scalar_(eng_tensor* a, double s);
int eng_mul_scalar_(eng_tensor* a, double s);
int eng_addcmul_(eng_tensor* a, eng_tensor* b, eng_tensor* c, double v); /* a += v*b*c */
int eng_addcdiv_(eng_tensor* a, eng_tensor* b, eng_tensor* c, double v); /* a += v*b/c */
int eng_lerp_(eng_tensor* a, eng_tensor* b, double w);         /* a += w*(b-a) */
int eng_clamp_(eng_tensor* a, double lo, double hi);

#endif
