/* autograd.h: what autograd/ gives the ops that record nodes (not public;
 * the public side is eng/autograd.h).  Defined in autograd/autograd.c. */
#ifndef ENG_AUTOGRAD_AUTOGRAD_H
#define ENG_AUTOGRAD_AUTOGRAD_H
#include "core/internal.h"

/* Helpers for op implementations. */
/* Shape/dtype of input i recorded in node n. */
int eng_node_in_ndim(const eng_node* n, int i);
const int64_t* eng_node_in_shape(const eng_node* n, int i);
int eng_node_in_dtype(const eng_node* n, int i);
/* For a backward function of node n while it runs: the gradient already
 * summed for input i by other consumers when only the backward pass holds it
 * (contiguous, input i's shape and dtype), else NULL.  The function may add
 * its contribution into it in place and return it (retained) as gi[i]; the
 * engine then adds nothing more.  Borrowed. */
eng_tensor* eng_grad_accum_slot(eng_node* n, int i);
/* Reduce a gradient g (broadcast result) to input i's shape and dtype. */
eng_tensor* eng_grad_to_input(eng_node* n, int i, eng_tensor* g);
/* Record a one-output node for out if any input needs grad.  Returns the node
 * (borrowed, owned by out) or NULL if no grad is needed. */
eng_node* eng_record(const char* name, eng_backward_fn fn, int n_inputs, eng_tensor** inputs,
                     eng_tensor* out);
/* Same for several outputs. */
eng_node* eng_record_multi(const char* name, eng_backward_fn fn, int n_inputs,
                           eng_tensor** inputs, int n_outputs, eng_tensor** outputs);

#endif
