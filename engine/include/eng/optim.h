/* optim.h: fused multi-tensor optimizer kernels and gradient norms.
 * All operate in place on n parameters without autograd. */
#ifndef ENG_OPTIM_H
#define ENG_OPTIM_H
#include <stdint.h>
#include <stddef.h>
#include "tensor.h"

/* AdamW (decoupled weight decay, torch.optim.AdamW semantics); step is the
 * 1-based step count after increment.  Entries whose grad is NULL are skipped. */
int eng_adamw_step(int n, eng_tensor** params, eng_tensor** grads, eng_tensor** exp_avg,
                   eng_tensor** exp_avg_sq, double lr, double beta1, double beta2, double eps,
                   double weight_decay, int64_t step);
/* AdamW with f32 master weights for half-precision params (mixed precision:
 * apex / Transformer Engine FusedAdam's master_weights): where master[i] is
 * not NULL, params[i] is bf16/f16, master[i] an f32 tensor of its shape,
 * layout and device and the states f32; the update runs on master[i] in f32
 * and params[i] gets the result rounded to nearest even.  Entries with a
 * NULL master are plain eng_adamw_step updates. */
int eng_adamw_step_master(int n, eng_tensor** params, eng_tensor** grads, eng_tensor** exp_avg,
                          eng_tensor** exp_avg_sq, eng_tensor** master, double lr, double beta1, double beta2,
                          double eps, double weight_decay, int64_t step);
/* SGD with momentum/dampening/nesterov/weight decay (torch.optim.SGD).
 * momentum_buf entries may be NULL when momentum == 0; on the first step
 * (first_step = 1) the buffer is set to the gradient as in PyTorch. */
int eng_sgd_step(int n, eng_tensor** params, eng_tensor** grads, eng_tensor** momentum_buf,
                 double lr, double momentum, double dampening, double weight_decay,
                 int nesterov, int first_step);
/* Total p-norm of all n tensors (p = inf allowed) as if concatenated. */
int eng_global_norm(int n, eng_tensor** ts, double p, double* out);
/* Scales the grads of params in place so their total norm is at most
 * max_norm (torch.nn.utils.clip_grad_norm_); returns the norm before.
 * Params without a grad are skipped; a DTensor gradient's local part is
 * combined over its param's mesh: one all_reduce per mesh dim where any
 * gradient on that mesh is sharded (PyTorch's count), none for replicated
 * and plain ones. */
int eng_clip_grad_norm_(int n, eng_tensor** params, double max_norm, double p, double* total);
/* The same, returning the norm as torch.nn.utils.clip_grad_norm_ does: a new
 * 0-dim plain tensor, f64 when a gradient is f64 and f32 otherwise, on the
 * gradients' device (the CPU when none has one); the caller makes it a
 * Replicate DTensor where the gradients are DTensors.  error_if_nonfinite: a
 * NaN or infinite norm is an error and nothing is scaled.  NULL on error. */
eng_tensor* eng_clip_grad_norm_tensor(int n, eng_tensor** params, double max_norm, double p, int error_if_nonfinite);
/* The norm of the params' gradients as eng_clip_grad_norm_tensor gives it,
 * without scaling them (torch.nn.utils.get_total_norm of the grads, with
 * the params' layouts deciding the reductions). */
eng_tensor* eng_grad_norm_tensor(int n, eng_tensor** params, double p, int error_if_nonfinite);

#endif
