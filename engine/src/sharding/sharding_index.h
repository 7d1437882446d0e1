/* sharding_index.h: DTensor paths of the indexing ops (ops/index.c).
 * Internal.  Each validates against the GLOBAL shapes and dispatches to the
 * rules in sharding/index.c; the ops call them from their guard. */
#ifndef ENG_SHARDING_INDEX_H
#define ENG_SHARDING_INDEX_H
#include "core/internal.h"

eng_tensor* eng_dt_gather(eng_tensor* x, int dim, eng_tensor* index);
eng_tensor* eng_dt_scatter(eng_tensor* x, int dim, eng_tensor* index, eng_tensor* src, int reduce);
/* index_add (acc 1, alpha) / index_copy (acc 0) */
eng_tensor* eng_dt_index_put(eng_tensor* x, int dim, eng_tensor* index, eng_tensor* src, int acc, double alpha);

#endif
