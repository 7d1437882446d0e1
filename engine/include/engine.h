/* engine.h: the public C API of libengine.
 *
 * The Lua FFI module (lua/engine/ffi.lua) reads this file and the headers it
 * includes, in this order, and hands their declarations to ffi.cdef.  So every
 * header under eng/ must stay plain C declarations: no macros inside
 * declarations, no function-like macros, no inline code.  Preprocessor lines
 * (include guards, includes, extern "C") are dropped by the reader.
 *
 * Conventions: every public symbol starts with eng_.  Functions that return a
 * pointer return a NEW reference (release it) unless documented as borrowed,
 * and return NULL on error with eng_last_error() describing it.  Functions that
 * return int return 0 on success and -1 on error.  Dims are 0-based here.
 */
#ifndef ENGINE_H
#define ENGINE_H
#include <stdint.h>
#include <stddef.h>
#ifdef __cplusplus
extern "C" {
#endif
#include "eng/base.h"
#include "eng/tensor.h"
#include "eng/autograd.h"
#include "eng/module.h"
#include "eng/ops_pointwise.h"
#include "eng/ops_reduce.h"
#include "eng/ops_shape.h"
#include "eng/ops_nn.h"
#include "eng/ops_math.h"
#include "eng/ops_index.h"
#include "eng/optim.h"
#include "eng/rng.h"
#include "eng/io.h"
#include "eng/dist.h"
#include "eng/comm.h"
#include "eng/mesh.h"
#include "eng/dtensor.h"
#include "eng/sharded_tensor.h"
#include "eng/fsdp.h"
#include "eng/ddp.h"
#include "eng/profiler.h"
#include "eng/checkpoint.h"
#include "eng/cuda.h"
#ifdef __cplusplus
}
#endif
#endif
