/* sharding_shape.h: DTensor paths of the shape ops (ops/view.c, ops/join.c).
 * Internal.  Each validates its arguments against the GLOBAL shape (a
 * DTensor's own shape is its local shard), resolves -1 sizes and negative
 * positions, and dispatches to the rules in sharding/shape.c.  The ops call
 * them from their one-line guard:
 *   if (ENG_DT_ACTIVE(t->dist)) return eng_dt_reshape(t, ndim, shape, 0, "view"); */
#ifndef ENG_SHARDING_SHAPE_H
#define ENG_SHARDING_SHAPE_H
#include "core/internal.h"

/* view (kind 0) and reshape (kind 1: copies when the local cannot be viewed). */
eng_tensor* eng_dt_reshape(eng_tensor* t, int ndim, const int64_t* shape, int kind, const char* op);
/* squeeze of dim (all: every size-1 dim), unsqueeze, flatten: reshapes. */
eng_tensor* eng_dt_squeeze(eng_tensor* t, int dim, int all);
eng_tensor* eng_dt_unsqueeze(eng_tensor* t, int dim);
eng_tensor* eng_dt_flatten(eng_tensor* t, int start_dim, int end_dim);
eng_tensor* eng_dt_transpose(eng_tensor* t, int d0, int d1);
eng_tensor* eng_dt_permute(eng_tensor* t, int ndim, const int* dims);
eng_tensor* eng_dt_expand(eng_tensor* t, int ndim, const int64_t* shape);
eng_tensor* eng_dt_narrow(eng_tensor* t, int dim, int64_t start, int64_t length);
eng_tensor* eng_dt_select(eng_tensor* t, int dim, int64_t index);
eng_tensor* eng_dt_index_select(eng_tensor* t, int dim, eng_tensor* index);
/* cat (stack 0) and stack (stack 1) of n tensors, some of them DTensors. */
eng_tensor* eng_dt_join(int n, eng_tensor** ts, int dim, int stack);
/* split (mode 0: pieces of arg elements), split_sizes (mode 1: n sizes),
 * chunk (mode 2: arg chunks); returns the number of pieces or -1. */
int eng_dt_split(eng_tensor* t, int mode, int64_t arg, int n, const int64_t* sizes, int dim, int max_out,
                 eng_tensor** out);

#endif
