/* ops_shape.h: views and shape ops (autograd through all of them).
 * Views share storage with their input. */
#ifndef ENG_OPS_SHAPE_H
#define ENG_OPS_SHAPE_H
#include <stdint.h>
#include <stddef.h>
#include "tensor.h"

/* shape may contain one -1 (inferred).  view errors if the strides do not
 * allow it; reshape copies then. */
eng_tensor* eng_view(eng_tensor* t, int ndim, const int64_t* shape);
eng_tensor* eng_reshape(eng_tensor* t, int ndim, const int64_t* shape);
eng_tensor* eng_transpose(eng_tensor* t, int d0, int d1);
eng_tensor* eng_permute(eng_tensor* t, int ndim, const int* dims);
eng_tensor* eng_narrow(eng_tensor* t, int dim, int64_t start, int64_t length);
/* Removes dim (index 0-based, negative counts from the end). */
eng_tensor* eng_select(eng_tensor* t, int dim, int64_t index);
/* -1 in shape keeps that size; new leading dims may be added. */
eng_tensor* eng_expand(eng_tensor* t, int ndim, const int64_t* shape);
eng_tensor* eng_squeeze(eng_tensor* t, int dim);   /* no-op if size != 1 */
eng_tensor* eng_squeeze_all(eng_tensor* t);
eng_tensor* eng_unsqueeze(eng_tensor* t, int dim);
eng_tensor* eng_flatten(eng_tensor* t, int start_dim, int end_dim);
eng_tensor* eng_cat(int n, eng_tensor** ts, int dim);
eng_tensor* eng_stack(int n, eng_tensor** ts, int dim);
/* cat along (0-based) dim of tensors that already lie side by side in one storage (eng_tensors_adjacent): a VIEW
 * of that storage, no copy, with cat's gradient (each input gets its slice); otherwise eng_cat (a copy).  The
 * fused QKV weight of the models (lua/engine/models.lua). */
eng_tensor* eng_cat_adjacent(int n, eng_tensor** ts, int dim);
int eng_tensors_adjacent(int n, eng_tensor** ts, int dim);
/* Split into pieces of split_size (last one smaller); writes up to max_out
 * new references into out and returns how many, or -1. */
int eng_split(eng_tensor* t, int64_t split_size, int dim, int max_out, eng_tensor** out);
int eng_split_sizes(eng_tensor* t, int n, const int64_t* sizes, int dim, eng_tensor** out);
/* torch.chunk rules: ceil(size/chunks) per piece, may give fewer pieces. */
int eng_chunk(eng_tensor* t, int chunks, int dim, int max_out, eng_tensor** out);
/* index: 1-D i32/i64 tensor of 0-based indices. */
eng_tensor* eng_index_select(eng_tensor* t, int dim, eng_tensor* index);

#endif
