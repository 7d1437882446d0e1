/* dtensor.h: placements, DTensor specs, redistribute and the DTensor API.
 *
 * A DTensor is an ordinary eng_tensor whose `dist` field is non-NULL.  Its
 * storage, shape and strides are this rank's LOCAL shard; the spec holds the
 * mesh, one placement per mesh dim and the GLOBAL shape and stride.  Specs
 * are immutable and refcounted (many tensors share one).  Autograd works on
 * the tensor itself: a DTensor that requires grad is a leaf or has a grad_fn
 * like any tensor, and gradients of DTensors are DTensors.
 *
 * Placements: Shard(dim) splits tensor dim `dim` over the mesh dim with
 * torch.chunk rules (chunk = ceil(n/k); trailing shards may be short or
 * empty); Replicate() holds the full value on each rank of the mesh dim;
 * Partial(op) holds values still to be reduced with op (sum, avg, max, min,
 * prod) over the mesh dim.  Dims are 0-based here and negative dims count
 * from the end; specs store them normalized.
 *
 * _StridedShard(dim, split_factor) (PyTorch's `_StridedShard`, the layout
 * FSDP2 + TP produce when both shard one tensor dim): the dim, with the size
 * n it has at that point of the left-to-right application of the placements,
 * is cut with torch.chunk rules into split_factor pieces, each piece into k
 * sub-pieces (torch.chunk again), and mesh coordinate i holds sub-piece i of
 * every piece concatenated in order (PyTorch's right-to-left nested
 * sharding: [_StridedShard(d, sf=tp), Shard(d)] on (dp, tp) is each TP shard
 * chunked over dp, for any size; when k*sf divides n it is torch.chunk into
 * k*sf chunks, coordinate i holding chunks i, i+k, ...).  sf = 1 is
 * the same layout as Shard(dim) but a different placement.  Its local shard
 * is in general not one contiguous slice of the global tensor: see
 * eng_local_shard_runs and the `offset` field of eng_dist_spec.  Op dispatch
 * replicates _StridedShard inputs first; redistribute goes to and from it
 * through Replicate on its mesh dim (_StridedShard -> Replicate: one
 * all_gather and a local reorder; Replicate -> _StridedShard: local, no
 * communication).
 *
 * Ranks outside the mesh hold an empty local tensor (every size 0, same
 * number of dims as the global shape) and skip all communication.
 *
 * Async redistribute: the last collective of the plan is posted and the call
 * returns; the result's storage is registered as pending.  It is waited for
 * (and finished: strided copies out of the receive buffer) by
 * eng_dtensor_wait, which to_local, full_tensor, redistribute, the DTensor
 * op dispatch and the Lua layer call before reading the local data.
 * Gradients (backward) are always redistributed synchronously.
 *
 * Gradient rules (PyTorch's): redistribute's backward sends the gradient back
 * to the source placements, except that a Partial source receives a
 * Shard/Replicate gradient as Replicate (never as a Partial sum); so S->R
 * costs nothing backward, R->S one all_gather, P->R nothing (the Partial
 * local's gradient is the full upstream gradient).  from_local's backward
 * does the same towards the from_local layout and returns the local part;
 * to_local's backward wraps the plain local gradient as a DTensor.  A DTensor
 * leaf's .grad is a DTensor (a plain gradient is taken in the leaf's layout). */
#ifndef ENG_DTENSOR_H
#define ENG_DTENSOR_H
#include <stdint.h>
#include <stddef.h>
#include "mesh.h"

typedef enum eng_placement_kind {
  ENG_PLACEMENT_REPLICATE = 0, ENG_PLACEMENT_SHARD = 1, ENG_PLACEMENT_PARTIAL = 2, ENG_PLACEMENT_STRIDED_SHARD = 3
} eng_placement_kind;

/* Fields a kind does not use are 0 in every normalized placement (specs,
 * plans), so placements compare and hash bytewise. */
typedef struct eng_placement {
  int32_t kind;          /* eng_placement_kind */
  int32_t dim;           /* SHARD, STRIDED_SHARD: tensor dim */
  int32_t op;            /* PARTIAL: eng_reduce_op */
  int32_t split_factor;  /* STRIDED_SHARD: >= 1 */
} eng_placement;

/* Immutable once created; fields may be read (also from Lua). */
typedef struct eng_dist_spec {
  int32_t refcount;
  int32_t ndim;                /* tensor dims (global == local) */
  int32_t mesh_ndim;           /* number of placements */
  int32_t member;              /* 1 when this rank is in the mesh */
  eng_mesh* mesh;              /* owned reference */
  eng_placement placements[8];
  int64_t shape[8];            /* global shape */
  int64_t stride[8];           /* global stride */
  int64_t numel;               /* global numel */
  int64_t local_shape[8];      /* this rank's shard (all 0 for non-members) */
  /* Global offset of this rank's shard.  On a dim split by a _StridedShard
   * the shard may be several runs of the global dim (eng_local_shard_runs):
   * offset is then the start of the first run, exact only when there is one
   * run (as for FSDP2 + TP's [_StridedShard(d, sf=k2), Shard(d)] with even
   * sizes); code that needs the box of the shard checks has_strided. */
  int64_t offset[8];
  int64_t mesh_shape[8];
  int32_t coord[8];            /* this rank's mesh coordinate (members) */
  int32_t has_partial, has_shard; /* has_shard: a Shard or _StridedShard */
  int32_t has_strided;         /* a _StridedShard placement */
  uint64_t hash;
} eng_dist_spec;

/* One step of a redistribute plan: mesh dim, placement change on it, and
 * the logical shape of the tensor on that mesh dim (sizes before that mesh
 * dim's own sharding, from the source layout). */
typedef struct eng_transform_info {
  int32_t mesh_dim;
  eng_placement src, dst;
  int64_t logical_shape[8];
} eng_transform_info;

/* ---- specs */
/* n placements (must equal the mesh's ndim); shape has ndim entries; stride
 * NULL means contiguous.  Shard dims are checked and normalized. */
eng_dist_spec* eng_dist_spec_new(eng_mesh* mesh, int n, const eng_placement* placements, int ndim,
                                 const int64_t* shape, const int64_t* stride);
/* Same mesh, global shape and stride; other placements. */
eng_dist_spec* eng_dist_spec_with_placements(const eng_dist_spec* s, const eng_placement* placements);
eng_dist_spec* eng_dist_spec_retain(eng_dist_spec* s);
void eng_dist_spec_release(eng_dist_spec* s);
/* Equal meshes (eng_mesh_equal), placements, global shape and stride. */
int eng_dist_spec_equal(const eng_dist_spec* a, const eng_dist_spec* b);
uint64_t eng_dist_spec_hash(const eng_dist_spec* s);
int eng_placement_equal(const eng_placement* a, const eng_placement* b);
/* "f32[12,3] on mesh(2x2: dp,tp) [Shard(1), Replicate()]" (dtype < 0: no
 * dtype).  Returns buf. */
const char* eng_dist_spec_describe(const eng_dist_spec* s, int dtype, char* buf, int buflen);
/* "Shard(1)", "Replicate()", "Partial(sum)", "_StridedShard(dim=1, sf=2)". */
const char* eng_placement_describe(const eng_placement* p, char* buf, int buflen);
/* Base used when messages print Shard dims: 0 (C, default) or 1 (the Lua
 * library sets 1 so messages match what Lua users write).  Returns the
 * previous base. */
int eng_dtensor_set_display_base(int base);

/* ---- layout math (pure; no communication) */
/* (eng_shard_size_and_offset, the torch.chunk arithmetic, is declared in eng/tensor.h: core defines it) */
/* Resharding math (a saved chunk against the shard this rank holds now, as a
 * distributed checkpoint loads into another layout).  A box is per-dim
 * 0-based element offsets and sizes.  overlap: 1 when the boxes intersect
 * (an empty box intersects nothing), 0 when not, -1 on bad input.  region:
 * for each dim d, out[4d..4d+3] = (d, offset of the intersection in the saved
 * chunk, offset in the current shard, length); -1 with an error when the
 * boxes do not intersect. */
int eng_shard_boxes_overlap(int ndim, const int64_t* off_a, const int64_t* size_a, const int64_t* off_b,
                            const int64_t* size_b);
int eng_shard_overlap_region(int ndim, const int64_t* saved_off, const int64_t* saved_size, const int64_t* cur_off,
                             const int64_t* cur_size, int64_t* out);
/* Local shape and global offset of the shard at mesh coordinate coord of a
 * global tensor, applying the placements left to right (PyTorch's
 * compute_local_shape_and_global_offset). */
int eng_local_shape_and_offset(int ndim, const int64_t* global_shape, int mesh_ndim, const int64_t* mesh_shape,
                               const int* coord, const eng_placement* placements, int64_t* local_shape,
                               int64_t* offset);
/* The shard at mesh coordinate coord on tensor dim `dim` as runs of the
 * global dim, in the order the local tensor holds them (adjacent runs
 * merged): writes min(count, cap) 0-based starts and lengths and returns the
 * count (0 for an empty shard), or -1.  One run unless a _StridedShard with
 * split_factor > 1 splits the dim.  On a dim that is not sharded the run is
 * the whole dim. */
int eng_local_shard_runs(int ndim, const int64_t* global_shape, int mesh_ndim, const int64_t* mesh_shape,
                         const int* coord, const eng_placement* placements, int dim, int64_t* starts,
                         int64_t* lengths, int cap);
/* The greedy redistribute plan (PyTorch's generate_greedy_transform_infos)
 * for a rank at coord: writes up to cap steps, returns the number of steps
 * (or -1).  Pure: no mesh needed. */
int eng_redistribute_plan(int mesh_ndim, const int64_t* mesh_shape, const int* coord, const eng_placement* src,
                          const eng_placement* dst, int ndim, const int64_t* global_shape,
                          eng_transform_info* out, int cap);
/* Same for two specs on one mesh (cached per (src, dst)); this rank. */
int eng_dtensor_transform_infos(const eng_dist_spec* src, const eng_dist_spec* dst, eng_transform_info* out,
                                int cap);

/* ---- DTensor queries */
int eng_is_dtensor(const eng_tensor* t);
/* Borrowed; NULL for a plain tensor. */
eng_dist_spec* eng_dtensor_spec(const eng_tensor* t);
/* Global numel (t->numel for a plain tensor). */
int64_t eng_dtensor_numel(const eng_tensor* t);
/* "DTensor(f32[12,3] on mesh(4) [Shard(0)], local f32[3,3])" style. */
const char* eng_dtensor_describe(const eng_tensor* t, char* buf, int buflen);
/* A plain view of the local shard (no dist, no autograd). */
eng_tensor* eng_dtensor_local_view(eng_tensor* t);

/* ---- creation and conversion (autograd-recorded where differentiable) */
/* No data movement: local becomes this rank's shard.  placements NULL: all
 * Replicate.  shape and stride (both or neither) give the global metadata
 * for uneven shards; otherwise the global shape is the local shape times
 * the mesh size on each Shard dim.  run_check: all ranks of the mesh check
 * that dtype, requires_grad (and shape/stride when not given) agree, and
 * rank 0's data is broadcast over every Replicate mesh dim. */
eng_tensor* eng_dtensor_from_local(eng_tensor* local, eng_mesh* mesh, int n, const eng_placement* placements,
                                   int run_check, const int64_t* shape, const int64_t* stride);
/* A new plain view of the local shard (also under no_grad: a view sharing
 * the storage, never t itself, which carries the spec); the backward wraps the
 * local grad as a DTensor with t's placements or grad_placements (mesh ndim
 * entries, or NULL; they must give the same local shape). */
eng_tensor* eng_dtensor_to_local(eng_tensor* t, const eng_placement* grad_placements);
/* redistribute to all Replicate, then to_local (differentiable). */
eng_tensor* eng_dtensor_full_tensor(eng_tensor* t, const eng_placement* grad_placements);
/* The cost the op dispatcher assigns to redistributing t to placements (mesh
 * NULL or t's): per mesh dim, bytes moved on that dim's group (all_gather,
 * all_to_all, reduce_scatter: (k-1)/k of the logical bytes; all_reduce twice
 * that), a tiny cost for local re-sharding of a Replicate (R->S, R->P), 0 for
 * no change; INFINITY for another mesh, S->P and P(op1)->P(op2). */
int eng_dtensor_redistribute_cost(const eng_tensor* t, const eng_mesh* mesh, int n, const eng_placement* placements,
                                  double* out);
/* Public redistribute: mesh NULL or equal to t's; a Partial target is legal
 * only where t already has the identical Partial. */
eng_tensor* eng_dtensor_redistribute(eng_tensor* t, eng_mesh* mesh, int n, const eng_placement* placements,
                                     int async_op);
/* Same with PyTorch's forward_dtype / backward_dtype (a dtype code, or -1 for
 * none): the local shard is cast to forward_dtype before the communication
 * (the result has that dtype); in backward the gradient is cast to
 * backward_dtype (default: t's dtype) before the communication, and t's
 * gradient comes back in t's dtype. */
eng_tensor* eng_dtensor_redistribute_dtype(eng_tensor* t, eng_mesh* mesh, int n, const eng_placement* placements,
                                           int async_op, int forward_dtype, int backward_dtype);
/* The backward reduce dtype of mesh dim `dim` (0-based): the gradient
 * reductions autograd issues in backward on that dim's group (a Partial
 * gradient to Replicate, all_reduce, or to Shard, reduce_scatter) are cast to
 * dtype before the collective and back after; -1 clears it (the gradient's own
 * dtype).  It belongs to the group, so every mesh that shares it (the parent
 * mesh and its slices) follows.  fully_shard sets it on the TP dim to its
 * MixedPrecisionPolicy's reduce_dtype.  A redistribute with an explicit
 * backward_dtype keeps its own.  get: the dtype, -1 when none, -2 on error. */
int eng_dtensor_set_backward_reduce_dtype(eng_mesh* mesh, int dim, int dtype);
int eng_dtensor_get_backward_reduce_dtype(const eng_mesh* mesh, int dim);
/* Building block for op dispatch: redistribute t to spec dst (same mesh and
 * global shape), autograd-recorded.  flags: 1 async, 2 allow Partial targets
 * (Replicate -> Partial: sum divides by the mesh dim size; avg/max/min keep
 * the value). */
eng_tensor* eng_dtensor_redistribute_spec(eng_tensor* t, eng_dist_spec* dst, int flags);
/* Scatter (Shard) or broadcast (Replicate) from group rank src_data_rank of
 * each mesh dim, left to right; src_data_rank < 0: every rank takes its
 * chunk of its own t, no communication.  t must be a leaf; the result is a
 * leaf with t's requires_grad. */
eng_tensor* eng_dtensor_distribute_tensor(eng_tensor* t, eng_mesh* mesh, int n, const eng_placement* placements,
                                          int src_data_rank);
/* Factories: only the local shard is allocated; global stride contiguous. */
eng_tensor* eng_dtensor_full(int ndim, const int64_t* shape, double value, int dtype, eng_mesh* mesh, int n,
                             const eng_placement* placements);
eng_tensor* eng_dtensor_empty(int ndim, const int64_t* shape, int dtype, eng_mesh* mesh, int n,
                              const eng_placement* placements);
/* kind: ENG_RNG_UNIFORM U[a, b) or ENG_RNG_NORMAL N(a, b^2).  Draws the
 * shard's slice of the global random tensor from the global generator and
 * advances it by the global numel, as eng_rand does: full_tensor() is the
 * same for every layout and equals eng_rand/eng_randn with the same seed. */
eng_tensor* eng_dtensor_random(int kind, int ndim, const int64_t* shape, double a, double b, int dtype,
                               eng_mesh* mesh, int n, const eng_placement* placements);

/* ---- building blocks for op dispatch (sharding propagation) */
/* Thread-local: while on, ops ignore `dist` and work on the local tensors.
 * Returns the previous value. */
int eng_dtensor_set_local_mode(int on);
int eng_dtensor_local_mode(void);
/* Thread-local (PyTorch's implicit_replication, C15): while on, a plain
 * tensor mixed with DTensors is taken as Replicate.  Returns the previous value. */
int eng_dtensor_set_implicit_replication(int on);
int eng_dtensor_implicit_replication(void);
/* Thread-local (PyTorch's loss_parallel context): while on, cross_entropy on logits sharded on the class dim
 * accepts only Shard or Replicate beside it (a Partial is an error, as PyTorch).  Returns the previous value. */
int eng_dtensor_set_loss_parallel(int on);
int eng_dtensor_loss_parallel(void);
/* Attaches spec (new reference taken) to an op output computed on local
 * tensors; checks the local shape on members. */
int eng_dtensor_wrap_output(eng_tensor* out, eng_dist_spec* spec);
/* Implicit root gradient of backward(): ones in t's local shape, as a DTensor
 * with the adjoint spec (Partial -> Replicate). */
eng_tensor* eng_dtensor_ones_grad(eng_tensor* t);

/* DTensor data parallelism with buckets: while marked (on != 0), the DTensor leaf takes each gradient as this rank's
 * partial sum in its own layout, with no communication at AccumulateGrad (a Partial(sum) gradient keeps its local
 * values; a Replicate one counts on the first rank of each mesh dim, zeros elsewhere); a bucketing reducer
 * (eng_ddp_new_partial) sums it over the group.  Returns the previous mark, -1 on error. */
int eng_dtensor_set_grad_deferred(eng_tensor* leaf, int on);

/* ---- async */
/* Waits for a pending async redistribute whose result shares t's storage
 * (no-op otherwise). */
int eng_dtensor_wait(eng_tensor* t);
int eng_dtensor_is_pending(const eng_tensor* t);
int eng_dtensor_wait_all(void);

#endif
