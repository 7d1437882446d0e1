/* implicit_replication.c: PyTorch's implicit_replication() (semantics C15): while
 * the thread-local flag is on, a plain tensor mixed with DTensors in an op is
 * taken as Replicate on the DTensors' mesh (the dispatcher's mixing check in
 * dtensor/dispatch.c reads it) instead of raising "mixed DTensor and Tensor
 * arguments".  Lua: dist.implicit_replication(fn, ...). */
#include "core/internal.h"

static __thread int g_implicit;

int eng_dtensor_set_implicit_replication(int on) {
  int prev = g_implicit;
  g_implicit = on ? 1 : 0;
  return prev;
}

int eng_dtensor_implicit_replication(void) { return g_implicit; }

/* PyTorch's loss_parallel() context (dist.loss_parallel): cross_entropy's rule (sharding/loss.c) holds class-dim
 * sharded logits to what PyTorch's loss_parallel accepts (Shard or Replicate beside the class dim); outside it,
 * other layouts take the general path (a Partial is reduced first). */
static __thread int g_loss_parallel;

int eng_dtensor_set_loss_parallel(int on) {
  int prev = g_loss_parallel;
  g_loss_parallel = on ? 1 : 0;
  return prev;
}

int eng_dtensor_loss_parallel(void) { return g_loss_parallel; }
