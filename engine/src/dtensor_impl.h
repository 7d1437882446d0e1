/* dtensor_impl.h: internals shared by dist_spec.c (placements, specs, layout
 * math, the greedy planner), redistribute.c (transitions, plan cache, async
 * results, the redistribute autograd node) and dtensor.c (the DTensor API).
 * Not public. */
#ifndef ENG_DTENSOR_IMPL_H
#define ENG_DTENSOR_IMPL_H
#include "internal.h"

/* Base (0 or 1) for dims printed in messages (eng_dtensor_set_display_base). */
int dt_base(void);
/* "[Shard(1), Replicate()]" into buf (returns buf). */
const char* dt_placements_str(int n, const eng_placement* pl, char* buf, int cap);
/* "mesh(2x2: dp,tp)" into buf. */
const char* dt_mesh_str(const eng_mesh* m, char* buf, int cap);
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
