/* autograd.h: the dynamic graph, backward, grad mode and hooks.
 *
 * A node is one backward step.  It has n_inputs edges (one per
 * differentiable input of the forward op, in order) and n_outputs grad slots
 * (one per output of the forward op).  backward() receives the gradients of
 * the outputs (NULL where an output got none: treat as zero) and writes new
 * references into grad_inputs[i] (leave NULL for "no gradient").  Backward
 * functions may call any eng_ op; grad mode is off while they run.
 */
#ifndef ENG_AUTOGRAD_H
#define ENG_AUTOGRAD_H
#include <stdint.h>
#include <stddef.h>
#include "tensor.h"

struct eng_node;
struct eng_node_dist;
typedef int (*eng_backward_fn)(struct eng_node* node, eng_tensor** grad_outputs,
                               eng_tensor** grad_inputs);
typedef void (*eng_node_free_fn)(struct eng_node* node);

typedef struct eng_edge {
  struct eng_node* node;  /* owned; NULL: input does not need grad */
  int32_t input_nr;       /* which output slot of node this feeds */
} eng_edge;

typedef struct eng_node {
  int32_t refcount;
  int32_t n_inputs;
  int32_t n_outputs;
  int32_t n_saved;
  int64_t seq;             /* creation order; later nodes run first */
  const char* name;        /* static string, e.g. "MulBackward" */
  eng_backward_fn backward;
  eng_node_free_fn free_ctx;
  eng_edge* next;          /* n_inputs edges */
  eng_tensor** saved;      /* n_saved tensors (detached aliases) */
  int32_t* saved_version;  /* storage version at save time */
  int32_t released;        /* saved tensors freed after backward */
  int32_t edges_last_first; /* the inputs' nodes become ready last input first: a fused node standing for several
                             * PyTorch ops (linear's bias before its weight, a fused projection's parts last to
                             * first), so gradients reach the leaves (and their hooks: DDP's buckets) in the order
                             * PyTorch's graph of the separate ops gives */
  int32_t n_in_shapes;
  int64_t* in_shapes;      /* shape of each input: n_inputs * 9 (ndim + 8) */
  int32_t* in_dtypes;
  double scalars[4];       /* small op context */
  int64_t ints[8];
  void* ctx;               /* larger op context, freed by free_ctx */
  struct eng_hook_list* pre_hooks;  /* per-output gradient hooks */
  struct eng_tensor* leaf; /* AccumulateGrad: the leaf (owned) */
  struct eng_node_dist* dist; /* DTensor dispatch: node of a local region (adjoint specs), or NULL */
} eng_node;

/* Grad mode (thread-local).  set returns the previous value. */
int eng_grad_enabled(void);
int eng_set_grad_enabled(int enabled);

/* Runs backward from tensors[0..n) with gradients grads[0..n) (a NULL grad
 * means ones for a one-element tensor).  If inputs is non-NULL (n_inputs
 * entries), gradients are not accumulated into any .grad: instead the
 * gradient of each inputs[i] is returned in input_grads[i] (new references,
 * NULL if none): that is autograd.grad.  retain_graph keeps saved tensors. */
int eng_backward(int n, eng_tensor** tensors, eng_tensor** grads, int retain_graph,
                 int n_inputs, eng_tensor** inputs, eng_tensor** input_grads);

/* End-of-backward callbacks (PyTorch's queue_callback): fn(ud) runs once when
 * the outermost backward now running has finished its graph, in queue order,
 * with grad mode off; all queued callbacks run even when the backward failed
 * (they release what it held), and the first error is the backward's.  FSDP's
 * root waits for its pending gradient reductions here.  Outside a backward:
 * -1 and an error.  in_backward: the nesting depth of running backwards. */
typedef int (*eng_backward_callback_fn)(void* ud);
int eng_autograd_queue_callback(eng_backward_callback_fn fn, void* ud);
int eng_autograd_in_backward(void);

/* Custom autograd functions (C).  Creates a node with n_inputs edges taken
 * from the given tensors (NULL or non-requiring entries give empty edges).
 * Returns a new reference. */
eng_node* eng_node_new(const char* name, eng_backward_fn fn, int n_inputs,
                       eng_tensor** inputs, int n_outputs);
void eng_node_retain(eng_node* n);
void eng_node_release(eng_node* n);
/* Saves a detached alias of t (records its version). */
int eng_node_save(eng_node* n, eng_tensor* t);
/* Saved tensor i (borrowed); NULL and an error if freed or modified in place. */
eng_tensor* eng_node_saved(eng_node* n, int i);
/* Makes out the output_nr-th output of n: out->grad_fn = n, requires_grad = 1. */
int eng_node_set_output(eng_node* n, eng_tensor* out, int output_nr);
/* 1 if any of the n tensors requires grad and grad mode is on. */
int eng_any_requires_grad(int n, eng_tensor** ts);
/* Does input i of node n need a gradient? */
int eng_node_needs_grad(const eng_node* n, int i);
/* Name of t's grad_fn ("" for leaves). Borrowed. */
const char* eng_tensor_grad_fn_name(const eng_tensor* t);

/* Hooks.
 * A tensor gradient hook gets the gradient and may replace it: it returns 0
 * and sets *out to a new reference (or leaves *out NULL to keep the gradient),
 * or returns -1 with an error set.  Post-accumulate-grad hooks get the leaf
 * after its .grad was updated (out is NULL).  ud is the caller's pointer.
 * register returns a handle (> 0) for remove, or -1. */
typedef int (*eng_tensor_hook_fn)(eng_tensor* t, eng_tensor* grad, eng_tensor** out, void* ud);
int64_t eng_tensor_register_hook(eng_tensor* t, eng_tensor_hook_fn fn, void* ud);
int64_t eng_tensor_register_post_accumulate_hook(eng_tensor* t, eng_tensor_hook_fn fn, void* ud);
int eng_tensor_remove_hook(eng_tensor* t, int64_t handle);

/* Lua callbacks go through one dispatcher (one FFI callback for the whole
 * process).  kind: 0 tensor hook, 1 post-accumulate hook, 2 function backward,
 * 3 module hook.  id selects the Lua closure.  n_in tensors in, n_out slots
 * out (to fill with new references).  Returns 0, or -1 after
 * eng_set_error_message. */
typedef int (*eng_lua_dispatch_fn)(int kind, int64_t id, int n_in, eng_tensor** in,
                                   int n_out, eng_tensor** out);
void eng_set_lua_dispatcher(eng_lua_dispatch_fn fn);
/* Hooks that call the Lua closure id through the dispatcher. */
int64_t eng_tensor_register_lua_hook(eng_tensor* t, int64_t id, int post_accumulate);
/* Closure ids whose hook or node was freed, so the Lua side can drop them.
 * Writes up to max ids into out and returns how many.  (Polled by Lua:
 * calling into Lua from a finalizer would not be safe.) */
int eng_lua_released(int64_t* out, int max);

/* A Lua autograd function: its outputs get a node whose backward calls the
 * Lua closure id with the output grads and expects n_inputs input grads. */
int eng_lua_function_attach(int64_t id, int n_inputs, eng_tensor** inputs,
                            int n_outputs, eng_tensor** outputs);

#endif
