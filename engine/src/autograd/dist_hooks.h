/* dist_hooks.h: the registration point through which the DTensor layer takes
 * part in autograd.  autograd/ never calls dtensor/ by name (layering: dtensor
 * -> autograd -> core); dtensor/dispatch.c installs this table when the library
 * is loaded.  Members may be NULL (no DTensor layer): autograd then treats
 * every tensor as a plain one.  Not public. */
#ifndef ENG_AUTOGRAD_DIST_HOOKS_H
#define ENG_AUTOGRAD_DIST_HOOKS_H
#include "core/internal.h"

struct eng_node_dist;

typedef struct eng_autograd_dist_hooks {
  /* Called for every new node: marks n when a dispatcher local region is
   * active (the node then runs through node_backward). */
  void (*mark_node)(eng_node* n, int n_inputs, eng_tensor** inputs);
  /* Backward of a marked node: grads to the output adjoint specs, the node's
   * backward in local mode, input grads wrapped with their adjoint specs. */
  int (*node_backward)(eng_node* n, eng_tensor** go, eng_tensor** gi);
  void (*node_free)(struct eng_node_dist* d);
  /* The gradient g of a DTensor leaf in the leaf's layout (new reference). */
  eng_tensor* (*grad_for_leaf)(eng_tensor* leaf, eng_tensor* g);
  /* Global element count of a DTensor; ones of its global shape in its layout. */
  int64_t (*numel)(const eng_tensor* t);
  eng_tensor* (*ones_grad)(eng_tensor* t);
} eng_autograd_dist_hooks;

/* Installs the table (copied); NULL uninstalls. */
void eng_autograd_set_dist_hooks(const eng_autograd_dist_hooks* hooks);

#endif
