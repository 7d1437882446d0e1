/* ops_reduce.h: reductions.  dims are 0-based, negative counts from the end;
 * n_dims = 0 reduces over all dims.  Results of sum/mean keep the input's
 * float dtype; integer and bool sums give i64. */
#ifndef ENG_OPS_REDUCE_H
#define ENG_OPS_REDUCE_H
#include <stdint.h>
#include <stddef.h>
#include "tensor.h"

eng_tensor* eng_sum(eng_tensor* t, int n_dims, const int* dims, int keepdim);
eng_tensor* eng_mean(eng_tensor* t, int n_dims, const int* dims, int keepdim);
/* Max/min over one dim: values (differentiable) and, if indices is non-NULL,
 * the i64 indices of the first extreme element. */
eng_tensor* eng_max_dim(eng_tensor* t, int dim, int keepdim, eng_tensor** indices);
eng_tensor* eng_min_dim(eng_tensor* t, int dim, int keepdim, eng_tensor** indices);
/* Over all elements (0-d result; gradient split evenly among ties as PyTorch). */
eng_tensor* eng_max_all(eng_tensor* t);
eng_tensor* eng_min_all(eng_tensor* t);
eng_tensor* eng_argmax(eng_tensor* t, int dim, int keepdim);
eng_tensor* eng_argmin(eng_tensor* t, int dim, int keepdim);
eng_tensor* eng_argmax_all(eng_tensor* t);
/* Sums t down to shape (the reverse of broadcasting), differentiable. */
eng_tensor* eng_sum_to_shape(eng_tensor* t, int ndim, const int64_t* shape);

#endif
