/* fsdp.h: fully sharded data parallelism (PyTorch's FSDP2 fully_shard) in C.
 *
 * A parameter group is what one fully_shard call makes: the sharded
 * parameters of a module (DTensors, [Shard(d)] on a 1-D mesh or
 * [Replicate, Shard(d)] on a 2-D (replicate, shard) mesh, each local shard
 * contiguous; torch.chunk sizes, so the last ranks may hold fewer rows or
 * none), and the unsharded parameters: plain leaf tensors (requires_grad as
 * their sharded parameter) viewing one flat buffer whose data exists only
 * between an unshard and the next reshard.
 *
 * Unshard = ONE all-gather of the group: each rank packs its shards into a
 * padded chunk (every parameter padded to ceil(size/W) rows), the chunks are
 * gathered, and copied out into the flat buffer (cast to param_dtype).
 * Gradients: a post-accumulate hook on each unsharded parameter moves its
 * gradient into an accumulator (reduce_dtype); when every parameter that
 * requires grad has one (or at the end of backward), ONE reduce-scatter of the
 * packed accumulators (HSDP: then one all-reduce over the replicate dim),
 * divided by the divide factor (default: the data-parallel size), gives each
 * rank its shard, stored (original dtype) as the sharded parameter's .grad
 * DTensor (added when one exists).  Without gradient sync the accumulators
 * keep growing across backwards until a backward with sync.  HSDP with
 * all-reduce off (eng_fsdp_group_set_requires_all_reduce(g, 0)): the
 * reduce-scatter's output is summed into the group's partial sum instead of
 * .grad, and the next reduction with all-reduce on adds that sum before its
 * all-reduce.  A shard group of one rank issues no collective of its own: the
 * unshard copies the local shards, the gradients are the output as packed.
 *
 * Hooks (C, on the module object): forward-pre unshards (waiting for a
 * prefetched all-gather), prefetches the next group, casts floating inputs to
 * param_dtype (cast_forward_inputs) and moves the root's inputs to the mesh's
 * device; forward-post casts floating outputs to output_dtype, reshards per
 * reshard_after_forward (the root's default is false: set by the Lua lazy
 * init; always under no_grad; never while a backward runs: an
 * activation-checkpoint recompute keeps them for the backward that follows)
 * and passes each output that requires grad through
 * an identity node whose backward is the pre-backward hook (unshard again
 * where resharded, prefetch the group that runs backward next).  The root's
 * end-of-backward callback flushes groups with pending gradients, waits for
 * every reduction (not after set_is_last_backward(false)) and reshards
 * (reshard_after_backward).  Frozen parameters take no post-accumulate hook.
 *
 * CPU offload (CPUOffloadPolicy on a CUDA mesh; eng_fsdp_group_set_offload):
 * the sharded parameters' local shards and their .grad live on the CPU
 * (pinned host memory with pin_memory), so the optimizer steps there; the
 * unshard copies each local shard host-to-device into the all-gather's send
 * buffer on the device, the post-backward copies the reduce-scatter's output
 * device-to-host into (or adds it to) the host .grad; the unsharded
 * parameters, the collective buffers and the compute stay on the device.
 * On a CPU mesh it is a no-op. */
#ifndef ENG_FSDP_H
#define ENG_FSDP_H
#include <stdint.h>
#include <stddef.h>
#include "module.h"
#include "dtensor.h"

typedef struct eng_fsdp_group eng_fsdp_group;

/* mesh: the FSDP mesh (1-D shard, or 2-D (replicate, shard) for HSDP; its
 * last dim is the shard group).  params: n sharded DTensor parameters (new
 * references taken); fsdp_dims[i]: the dim of params[i]'s own mesh holding
 * its FSDP Shard / _StridedShard placement (for HSDP, Replicate just before
 * it): its mesh is the FSDP mesh itself, or (FSDP over tensor parallelism)
 * their common parent with the TP dims after.  unsharded_specs (NULL, or n
 * entries, NULL for a plain parameter): the TP layout of the unsharded
 * parameter, which then is a DTensor leaf holding the TP local shard (the
 * all-gather and reduce-scatter run over the FSDP dims only).
 * param_dtype / reduce_dtype / output_dtype: -1 keeps the dtype.  The group is
 * not attached to a module yet (eng_fsdp_group_attach). */
eng_fsdp_group* eng_fsdp_group_new(eng_mesh* mesh, int n, eng_tensor** params, const int* fsdp_dims,
                                   eng_dist_spec** unsharded_specs, int param_dtype, int reduce_dtype,
                                   int output_dtype, int cast_forward_inputs);
eng_fsdp_group* eng_fsdp_group_retain(eng_fsdp_group* g);
void eng_fsdp_group_release(eng_fsdp_group* g);
/* Registers the forward-pre (first) and forward-post hooks on m. */
int eng_fsdp_group_attach(eng_fsdp_group* g, eng_module* m);
/* Joins g to root's tree (root: the group of the root module, itself
 * included): the root keeps every group's end-of-backward work and the
 * forward / post-forward orders for implicit prefetching. */
int eng_fsdp_group_set_root(eng_fsdp_group* g, eng_fsdp_group* root);
int eng_fsdp_group_size(const eng_fsdp_group* g);
/* Current tensor of parameter i: the unsharded leaf while unsharded, the
 * post-forward DTensor while resharded to N, else NULL (the registered sharded
 * DTensor).  Borrowed. */
eng_tensor* eng_fsdp_group_param(eng_fsdp_group* g, int i);
/* The unsharded leaf of parameter i, whatever the state (borrowed). */
eng_tensor* eng_fsdp_group_leaf(eng_fsdp_group* g, int i);
/* 0 sharded, 1 unsharded, 2 resharded to the post-forward world. */
int eng_fsdp_group_state(const eng_fsdp_group* g);
/* 1 when an async unshard is in flight. */
int eng_fsdp_group_pending(const eng_fsdp_group* g);
/* 1 when the group's reduce-scatter is in flight (its gradients not in .grad yet). */
int eng_fsdp_group_reduce_pending(const eng_fsdp_group* g);
/* Finishes every reduction still in flight in g's tree (its root's groups), writing the sharded .grad. */
int eng_fsdp_group_wait_reductions(eng_fsdp_group* g);
int eng_fsdp_group_unshard(eng_fsdp_group* g, int async_op);
int eng_fsdp_group_wait_unshard(eng_fsdp_group* g);
int eng_fsdp_group_reshard(eng_fsdp_group* g);
/* 1 true, 0 false, N > 1: reshard to N ranks after forward (N a divisor of the
 * shard group's size other than 1 and the size); post_mesh (N > 1 only): the
 * (dp/N, N) mesh over the group's ranks whose dim 1 groups are the post-forward
 * subgroups (ranks k*N .. k*N+N-1 of the shard group); after forward the
 * registered parameters are [Replicate, Shard(d)] DTensors on it. */
int eng_fsdp_group_set_reshard_after_forward(eng_fsdp_group* g, int value, eng_mesh* post_mesh);
int eng_fsdp_group_get_reshard_after_forward(const eng_fsdp_group* g);
int eng_fsdp_group_set_reshard_after_backward(eng_fsdp_group* g, int flag);
int eng_fsdp_group_set_requires_gradient_sync(eng_fsdp_group* g, int flag);
int eng_fsdp_group_set_requires_all_reduce(eng_fsdp_group* g, int flag);
/* factor <= 0: back to the default (the data-parallel size). */
int eng_fsdp_group_set_gradient_divide_factor(eng_fsdp_group* g, double factor);
/* flag 0: the root's end of backward leaves reductions and prefetched all-gathers in flight (the next
 * backward or eng_fsdp_group_wait_reductions finishes them); read on the root's group. */
int eng_fsdp_group_set_is_last_backward(eng_fsdp_group* g, int flag);
/* Explicit prefetch lists (replace the implicit next-group prefetch). */
int eng_fsdp_group_set_forward_prefetch(eng_fsdp_group* g, int n, eng_fsdp_group** groups);
int eng_fsdp_group_set_backward_prefetch(eng_fsdp_group* g, int n, eng_fsdp_group** groups);
/* Runs what the hooks run, for a method other than forward
 * (register_fsdp_forward_method): pre unshards, post reshards / arms backward. */
int eng_fsdp_group_pre_forward(eng_fsdp_group* g, eng_tensor** tensors, int n);
int eng_fsdp_group_post_forward(eng_fsdp_group* g, eng_tensor** tensors, int n);
/* Overlap controls (an engine extension; -1 keeps a setting): implicit prefetch of the next group's
 * all-gather (forward and backward) and reduce-scatters left in flight until the end of backward.  Default
 * on for CUDA meshes, off for CPU meshes (env ENGINE_FSDP_PREFETCH / ENGINE_FSDP_ASYNC_REDUCE override). */
int eng_fsdp_group_set_overlap(eng_fsdp_group* g, int implicit_prefetch, int async_reduce);
/* cpu_offload: the group's sharded parameters are on the CPU while its mesh
 * is CUDA (an error when they are not where the policy says: the Lua side
 * places them); pin_memory: new host gradients in pinned memory.  A no-op on
 * a CPU mesh.  Call before the first unshard. */
int eng_fsdp_group_set_offload(eng_fsdp_group* g, int cpu_offload, int pin_memory);
/* 0 no offload (always on a CPU mesh), 1 CPU offload, 2 CPU offload with pinned memory. */
int eng_fsdp_group_offload(const eng_fsdp_group* g);
/* Counters for tests: all-gathers / reduce-scatters this group issued. */
int64_t eng_fsdp_group_count(const eng_fsdp_group* g, int what);

#endif
