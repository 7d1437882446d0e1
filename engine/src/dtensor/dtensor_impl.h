/* dtensor_impl.h: internals shared by dtensor/spec.c (placements, specs, layout
 * math, the greedy planner), dtensor/redistribute.c (transitions, plan cache, async
 * results, the redistribute autograd node) and dtensor/dtensor.c (the DTensor API).
 * Not public. */
#ifndef ENG_DTENSOR_IMPL_H
#define ENG_DTENSOR_IMPL_H
#include "core/dispatch.h"
#include "eng/comm.h"
#include "eng/mesh.h"
#include "eng/dtensor.h"

/* Base (0 or 1) for dims printed in messages (eng_dtensor_set_display_base). */
int dt_base(void);
/* "[Shard(1), Replicate()]" into buf (returns buf). */
const char* dt_placements_str(int n, const eng_placement* pl, char* buf, int cap);
/* "mesh(2x2: dp,tp)" into buf. */
const char* dt_mesh_str(const eng_mesh* m, char* buf, int cap);
/* "" when the short forms of two different meshes differ (dt_mesh_str), else a note that names both
 * meshes' ranks (" (DeviceMesh('cpu', [0, 1]) and DeviceMesh('cpu', [1, 0]): ...)"): the same shape over
 * other ranks or in another rank order, which "mesh(2) and mesh(2)" does not show. */
const char* dt_mesh_diff_note(const eng_mesh* a, const eng_mesh* b, char* buf, int cap);
/* Checks n placements against a mesh and tensor ndim and writes normalized
 * copies into out; errors name op. */
int dt_check_placements(const char* op, const eng_mesh* mesh, int n, const eng_placement* pl, int ndim,
                        eng_placement* out);
/* Spec from already checked placements. */
eng_dist_spec* dt_spec_make(eng_mesh* mesh, const eng_placement* pl, int ndim, const int64_t* shape,
                            const int64_t* stride);
/* The spec with every Partial replaced by Replicate (new reference; s
 * itself retained when it has no Partial). */
eng_dist_spec* dt_spec_adjoint(eng_dist_spec* s);

/* Shard or _StridedShard. */
int dt_is_shard_like(const eng_placement* p);
/* Replicate() with every other field 0. */
eng_placement dt_replicate(void);
/* _StridedShard(sf) on a mesh dim of size k (PyTorch's right-to-left nested
 * sharding): the n entries are cut into sf torch.chunk pieces, each piece
 * into k torch.chunk sub-pieces, and coordinate idx holds sub-piece idx of
 * every piece in turn.  dt_strided_piece gives sub-piece idx of piece j (its
 * size and offset in the n entries) and returns 0 when piece j itself is
 * empty (so is every later one), else 1; dt_strided_size the local size. */
int dt_strided_piece(int64_t n, int k, int sf, int idx, int j, int64_t* size, int64_t* offset);
int64_t dt_strided_size(int64_t n, int k, int sf, int idx);
/* Runs (global start, length) of tensor dim d of the shard at coord, in
 * local order, adjacent runs merged: malloc'd arrays in *st / *len (free
 * both), count in *nr, local size in *total, start of the shard (also when
 * empty) in *anchor.  0 or -1 (message set). */
int dt_dim_runs(const int64_t* gshape, int ndim, int mesh_ndim, const int64_t* mesh_shape, const int* coord,
                const eng_placement* pl, int d, int64_t** st, int64_t** len, int* nr, int64_t* total,
                int64_t* anchor);

/* _StridedShard data movement (dtensor/strided_shard.c).  x is a plain tensor; d the
 * tensor dim, k the mesh dim size, sf the split factor, coord this rank's
 * coordinate on the mesh dim.  All return new contiguous plain tensors. */
/* Replicate -> _StridedShard: this coordinate's chunks of x, no communication. */
eng_tensor* dt_strided_select(const eng_tensor* x, int d, int k, int sf, int coord);
/* _StridedShard -> Replicate: one all_gather over pg (the locals padded to
 * coordinate 0's size), then the chunks put back in place; L is the size of
 * dim d before this mesh dim's sharding.  op names the caller in messages. */
eng_tensor* dt_strided_gather(const char* op, eng_pg* pg, const eng_tensor* x, int d, int k, int sf, int coord,
                              int64_t L);
/* distribute_tensor's step on a _StridedShard mesh dim i: a scatter from
 * group rank src_data_rank (< 0 or a mesh dim of size 1: local selection). */
eng_tensor* dt_strided_distribute_step(eng_mesh* mesh, int mesh_dim, eng_tensor* x, const eng_placement* p,
                                       int coord, int src_data_rank);
/* The local shard of spec s (a member) of a global random tensor drawn with
 * (seed, offset): one slice when the shard is a box (eng_random_slice over
 * s->offset and s->local_shape), else one slice per box of runs. */
eng_tensor* dt_random_local(int kind, const eng_dist_spec* s, double a, double b, int dtype, uint64_t seed,
                            uint64_t offset);

/* A plain view of x with dim d narrowed to [start, start+len) (dtensor/redistribute.c). */
eng_tensor* dt_narrow_view(const eng_tensor* x, int d, int64_t start, int64_t len);
/* Sets t->dist to s (new reference; replaces any previous spec). */
void dt_attach(eng_tensor* t, eng_dist_spec* s);
/* A plain view (no dist, no autograd) with t's geometry. */
eng_tensor* dt_plain(const eng_tensor* t);

/* Redistributes a local tensor from src to dst (same mesh and global shape)
 * and returns a new plain tensor (no dist, no autograd) holding this rank's
 * dst shard.  async: the last collective is left pending on the result.
 * is_backward: Replicate -> Partial keeps the value (gradients are never
 * turned into Partial sums). */
eng_tensor* dt_redistribute_local(eng_tensor* local, const eng_dist_spec* src, const eng_dist_spec* dst,
                                  int async, int is_backward);
/* Where a gradient with spec grad goes back to for a forward input with
 * spec src: src's placements, Partial -> Replicate where the gradient is not
 * Partial on that mesh dim (new reference). */
eng_dist_spec* dt_grad_target(const eng_dist_spec* src, const eng_dist_spec* grad);
/* Redistribute with autograd (one node); out gets spec dst. */
eng_tensor* dt_redistribute_autograd(const char* op, eng_tensor* t, eng_dist_spec* dst, int async,
                                     int is_backward_flag);
/* Same with forward_dtype / backward_dtype (-1: none): the local is cast to
 * fwd_dtype before the communication (the result has that dtype); in
 * backward the gradient is cast to bwd_dtype (default: t's dtype) before the
 * communication and returned in t's dtype. */
eng_tensor* dt_redistribute_autograd_ex(const char* op, eng_tensor* t, eng_dist_spec* dst, int async,
                                        int is_backward_flag, int fwd_dtype, int bwd_dtype);

#endif
