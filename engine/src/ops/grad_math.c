/* grad_math.c: the ops autograd accumulates gradients with, installed into
 * autograd's registration point (autograd/grad_math.h) when the library
 * loads. */
#include "core/internal.h"
#include "autograd/grad_math.h"
#include "eng/ops_pointwise.h"
#include "eng/ops_reduce.h"

__attribute__((constructor)) static void install_grad_math(void) {
  eng_autograd_set_math(&(eng_autograd_math){.add = eng_add, .add_ = eng_add_, .sum_to_shape = eng_sum_to_shape,
                                           .clone = eng_tensor_clone, .to_dtype = eng_tensor_to_dtype});
}
