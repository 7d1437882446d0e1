/* ddp.h: data parallelism with gradient buckets (PyTorch's DistributedDataParallel reducer) in C.
 *
 * The parameters that require grad are grouped into buckets as PyTorch's reducer groups them: until the first
 * synced backward has run (rebuild_after 1; the second: 2, PyTorch's static_graph), one bucket per dtype and device
 * holds them all (reduced when backward ends); after it, the buckets are rebuilt in the order that backward
 * produced the gradients, one dtype and device per bucket, each closed once it holds at least its limit
 * (first_bucket_bytes for the first, bucket_bytes after it: the last parameter may take a bucket over it), so the
 * first all_reduce starts early in backward.  rebuild_after 0 (PyTorch's find_unused_parameters): buckets by the
 * same limits in registration order from the start, launched last bucket first, never rebuilt.  A post-accumulate
 * hook on each parameter copies its .grad into its bucket's flat buffer; when every parameter of the next bucket in
 * order has its gradient, that bucket's ONE all_reduce (avg) starts asynchronously (NCCL: on the communication
 * stream; MPI: a nonblocking collective), so communication overlaps the rest of backward.  Buckets start strictly
 * in index order, so every rank issues the same collectives in the same order.  The end-of-backward callback
 * starts the buckets still waiting (a parameter this backward gave no gradient contributes the .grad it holds, or
 * zeros), waits for every bucket in order and copies the averaged values back into the .grads.  The last bucket
 * also carries one flag per parameter (this rank has a gradient for it), reduced with it: a parameter no rank has a
 * gradient for keeps none, as in one process, and one only some ranks have a gradient for gets the average on every
 * rank, so the ranks never diverge (no extra collective; PyTorch needs find_unused_parameters for that).  With
 * require_sync off (no_sync), nothing is reduced and gradients accumulate locally; the next synced backward reduces
 * the accumulated .grad.  The DTensor reducer (eng_ddp_new_partial) reduces what backward produced and leaves the
 * rest as it is.
 * Collectives per synced backward: the number of buckets, at most floor(gradient bytes / bucket_bytes) + 2 for one
 * dtype (1 in the first). */
#ifndef ENG_DDP_H
#define ENG_DDP_H
#include <stdint.h>
#include <stddef.h>
#include "module.h"
#include "dtensor.h"

typedef struct eng_ddp eng_ddp;

/* A reducer over pg for the n tensors params (leaves; those not requiring grad are left out).  Every member of pg
 * must pass the same shapes and dtypes in the same order (checked: one agreement over pg, the same error on every
 * member).  bucket_bytes <= 0: 25 MiB; first_bucket_bytes <= 0: bucket_bytes (PyTorch's DDP passes 1 MiB when
 * bucket_cap_mb is not given); rebuild_after: see above (0, 1 or 2).  NULL and an error on failure. */
eng_ddp* eng_ddp_new(eng_pg* pg, int n, eng_tensor** params, int64_t bucket_bytes, int64_t first_bucket_bytes,
                     int rebuild_after);
/* The same reducer for DTensor data parallelism: params are DTensors (Replicate over pg's ranks) whose gradients
 * arrive as this rank's partial sums (leaves marked with eng_dtensor_set_grad_deferred); each bucket is ONE
 * all_reduce (sum), so .grad ends with the reduced value, as the per-parameter Partial -> Replicate would give. */
eng_ddp* eng_ddp_new_partial(eng_pg* pg, int n, eng_tensor** params, int64_t bucket_bytes,
                             int64_t first_bucket_bytes, int rebuild_after);
eng_ddp* eng_ddp_retain(eng_ddp* d);
void eng_ddp_release(eng_ddp* d);
/* no_sync: 0 keeps gradients local (accumulating), 1 (the default) reduces in the next backward. */
int eng_ddp_set_require_sync(eng_ddp* d, int on);
/* gradient_as_bucket_view (PyTorch's option of the same name): 1 makes each parameter's .grad a view of its slice
 * of the bucket (an existing .grad is copied in now; one produced later, after zero_grad set it to none, is copied in
 * once and replaced by the view), so backward accumulates into the buckets and the all_reduce averages the
 * gradients in place: no copy back after it, and none into the bucket while .grad is kept (zero_grad with
 * set_to_none = false).  Not while a backward runs; not for the DTensor reducer. */
int eng_ddp_set_gradient_as_bucket_view(eng_ddp* d, int on);
/* PyTorch's register_comm_hook with a built-in hook (torch.distributed.algorithms.ddp_comm_hooks.default_hooks):
 * 1 allreduce_hook (what the reducer does without a hook), 2 fp16_compress_hook, 3 bf16_compress_hook: each bucket
 * is cast to f16 / bf16, averaged in it (the sum over the ranks, then divided: PyTorch divides first, the same
 * values but where the sum would overflow) and cast back, half the bytes on the wire for f32 gradients.  Once per
 * reducer, not while a backward runs, not for the DTensor reducer. */
int eng_ddp_set_comm_hook(eng_ddp* d, int hook);
int eng_ddp_num_buckets(const eng_ddp* d);
/* Parameters of bucket b (0-based, in launch order) and its size in bytes; -1 when b is out of range.  The buckets
 * are those the next synced backward launches (rebuilt after the first). */
int eng_ddp_bucket_info(const eng_ddp* d, int b, int* n_params, int64_t* bytes);
/* The parameters of bucket b in their order in its buffer, as 0-based positions in the list given to eng_ddp_new,
 * into out (room for cap); returns their number, -1 when b is out of range or cap too small. */
int eng_ddp_bucket_params(const eng_ddp* d, int b, int* out, int cap);
/* What the last synced backward did: collectives issued and bytes all-reduced. */
int eng_ddp_last_stats(const eng_ddp* d, int64_t* collectives, int64_t* bytes);

#endif
