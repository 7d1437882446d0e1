/* sharding_math.h: op defs of the ops in ops/math.c, ops/reduce2.c and
 * ops/sort.c (rules in sharding/math.c).  Internal.
 *   math_unary: ints[0] = KM_* op, scalars = params (round's decimals,
 *     nan_to_num's replacements); output = input placement, Partial -> R.
 *   math_binary: ints[0] = KM_* op; broadcasting, no Partial (math_binary_int:
 *     the same for integer fmod/remainder/floor_divide, agree_local: a zero
 *     divisor on one rank fails every rank).
 *   reduce2: ints[0] = ENG_R2_* op, ints[1] = dim mask, ints[2] = keepdim,
 *     scalars[0] = correction (var/std) or ord (norm); reduced dims are
 *     replicated first, the other sharded dims stay sharded.
 *   along / along2 (one / two outputs): ints[0] = ENG_AL_* op, ints[1] = dim,
 *     ints[2] = k, ints[3] = flag (descending / largest | sorted << 1 / keepdim); the dim
 *     is replicated first, the other sharded dims stay sharded. */
#ifndef ENG_SHARDING_MATH_H
#define ENG_SHARDING_MATH_H
#include "sharding/sharding.h"

extern const eng_op_def eng_opdef_math_unary, eng_opdef_math_binary, eng_opdef_math_binary_int, eng_opdef_reduce2,
    eng_opdef_along, eng_opdef_along2;

#endif
