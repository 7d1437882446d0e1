/* grad_math.h: the registration point through which the ops give autograd
 * the arithmetic of gradient accumulation (autograd sits below the ops:
 * ops record nodes; autograd never calls ops/ by name).  ops/grad_math.c
 * installs the table when the library loads.  Not public. */
#ifndef ENG_AUTOGRAD_GRAD_MATH_H
#define ENG_AUTOGRAD_GRAD_MATH_H
#include "core/internal.h"

typedef struct eng_autograd_math {
  eng_tensor* (*add)(eng_tensor* a, eng_tensor* b);              /* a + b, new reference (DTensors too) */
  int (*add_)(eng_tensor* a, eng_tensor* b, double alpha);       /* a += alpha * b */
  eng_tensor* (*sum_to_shape)(eng_tensor* g, int ndim, const int64_t* shape); /* a broadcast gradient reduced */
  eng_tensor* (*clone)(eng_tensor* t);                           /* retain_grad's first copy */
  eng_tensor* (*to_dtype)(eng_tensor* t, int dtype);             /* a gradient cast to its input's dtype */
} eng_autograd_math;

/* Installs the table (copied). */
void eng_autograd_set_math(const eng_autograd_math* m);

#endif
