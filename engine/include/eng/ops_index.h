/* ops_index.h: torch's indexing ops along a dim.  Dims are 0-based
 * here; index VALUES are 0-based data (as index_select and token ids), i32 or
 * i64.  All return a new tensor (the in-place forms live in Lua: computed out
 * of place, then copied).  CUDA: kernels for gather/scatter/index_copy (all
 * dtypes) and scatter_add/index_add (f32, f64, i32, i64); the other cases and
 * nonzero go through the host (a documented fallback, see ops/index.c). */
#ifndef ENG_OPS_INDEX_H
#define ENG_OPS_INDEX_H
#include <stdint.h>
#include <stddef.h>
#include "tensor.h"

/* torch.gather: out[..., i_d, ...] = x[..., index[..., i_d, ...], ...];
 * index has x's ndim, index.size(k) <= x.size(k) for k != dim; out has
 * index's shape and x's dtype. */
eng_tensor* eng_gather(eng_tensor* x, int dim, eng_tensor* index);
/* Tensor.scatter (reduce 0: replace) / scatter_add (reduce 1: add): x's
 * copy with src[p] written (added) at p's coordinates with dim replaced by
 * index[p]; src has x's dtype and index.size(k) <= src.size(k) for all k. */
eng_tensor* eng_scatter(eng_tensor* x, int dim, eng_tensor* index, eng_tensor* src, int reduce);
/* Tensor.index_add: x's copy with alpha * src's slices along dim added at the
 * positions of the 1-D index (src: x's shape with size(dim) = numel(index)). */
eng_tensor* eng_index_add(eng_tensor* x, int dim, eng_tensor* index, eng_tensor* src, double alpha);
/* Tensor.index_copy: the same with the slices copied. */
eng_tensor* eng_index_copy(eng_tensor* x, int dim, eng_tensor* index, eng_tensor* src);
/* torch.nonzero: i64 [count, ndim] of the 0-based coordinates of the nonzero
 * elements in row-major order (plain tensors only). */
eng_tensor* eng_nonzero(eng_tensor* x);
/* Plain tensors only (the Lua API takes composites for DTensors).  one_hot:
 * integer classes (>= 0) -> i64 [..., num_classes]; num_classes -1 infers
 * max + 1.  masked_select: the elements of x where the bool mask (broadcast
 * together with x) is true, 1-D, with autograd to x. */
eng_tensor* eng_one_hot(eng_tensor* t, int64_t num_classes);
eng_tensor* eng_masked_select(eng_tensor* x, eng_tensor* mask);

#endif
