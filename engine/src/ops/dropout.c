/* dropout.c: inverted dropout with the counter-based generator.
 * Element i (row-major) is kept iff the uniform of stream position
 * offset + i is < 1 - p, i.e. the mask equals
 * eng_random_slice(ENG_RNG_BERNOULLI, ..., a = 1 - p, seed, offset), so any
 * shard can rebuild its part of the mask.  Backward regenerates the mask from
 * the (seed, offset) saved in the node: no mask is stored. */
#include "core/internal.h"
#include "core/dispatch.h"
#include "kernels/cpu/kcpu.h"
#include "ops/cuda_ops.h"
#include "ops/ops.h"
#include "autograd/autograd.h"
#include "eng/dtensor.h" /* reads the layout of a DTensor operand (its global shape) */
#include <math.h>

typedef struct { uint64_t seed, j; double keep, scale; int dt; } drop_ctx;

static void drop_row(int64_t n, char** p, const int64_t* s, void* vc) {
  drop_ctx* c = vc;
  kc_dropout_run(c->seed, c->j, n, c->keep, c->scale, p[1], s[1], p[0], s[0], c->dt);
  c->j += (uint64_t)n;
}

/* out = x * mask * scale, out contiguous of x's shape and dtype. */
static eng_tensor* apply_mask(eng_tensor* x, uint64_t seed, uint64_t off, double keep, double scale) {
  eng_tensor* out = eng_new(x->ndim, x->shape, x->dtype, x->device);
  if (!out || out->numel == 0) return out;
  if (x->device == ENG_CUDA) { /* element i (row-major) uses stream position off + i, as below */
    eng_tensor* X = eng_as_contig(x, x->dtype);
    int rc = X ? eng_cu_dropout(x->dtype, x->numel, seed, off, keep, scale, eng_ptr(X), eng_ptr(out), "dropout") : -1;
    eng_tensor_release(X);
    if (rc) { eng_tensor_release(out); return NULL; }
    return out;
  }
  drop_ctx c = {seed, off, keep, scale, x->dtype};
  char* base[2] = {eng_ptr(out), eng_ptr(x)};
  const int64_t* st[2] = {out->stride, x->stride};
  int es = eng_dtype_size(x->dtype);
  int esz[2] = {es, es};
  kc_foreach(x->ndim, x->shape, 2, base, st, esz, drop_row, &c);
  return out;
}

/* The mask of a shard: x holds the box global[start .. start + x->shape) of a
 * tensor of global shape gshape; element g (global row-major index) uses
 * stream position off + g, so the shard's mask is the slice of the mask one
 * process draws.  The box is walked in runs that are contiguous in the global
 * row-major order (the innermost dims the box spans fully, plus the next one). */
typedef struct { int64_t gshape[ENG_MAX_DIMS], start[ENG_MAX_DIMS]; } drop_box;

static eng_tensor* apply_mask_box(eng_tensor* x, uint64_t seed, uint64_t off, double keep, double scale,
                                  const drop_box* b) {
  int nd = x->ndim, full = 1;
  for (int d = 0; d < nd; d++) full &= b->start[d] == 0 && b->gshape[d] == x->shape[d];
  if (full) return apply_mask(x, seed, off, keep, scale);
  eng_tensor* X = eng_as_contig(x, x->dtype);
  eng_tensor* out = X ? eng_new(nd, x->shape, x->dtype, x->device) : NULL;
  if (!out || out->numel == 0) { eng_tensor_release(X); return out; }
  int64_t gst[ENG_MAX_DIMS], run = 1, idx[ENG_MAX_DIMS] = {0};
  eng_contiguous_strides(nd, b->gshape, gst);
  int q = nd - 1; /* dims after q are spanned fully: a run is x->shape[q..] */
  while (q > 0 && x->shape[q] == b->gshape[q]) q--;
  for (int d = q; d < nd; d++) run *= x->shape[d];
  int64_t runs = x->numel / run, es = eng_dtype_size(x->dtype);
  const char* src = eng_ptr(X);
  char* dst = eng_ptr(out);
  int rc = 0;
  for (int64_t r = 0; r < runs && !rc; r++) {
    uint64_t j = off;
    for (int d = 0; d <= q; d++) j += (uint64_t)((b->start[d] + (d < q ? idx[d] : 0)) * gst[d]);
    if (x->device == ENG_CUDA)
      rc = eng_cu_dropout(x->dtype, run, seed, j, keep, scale, src + r * run * es, dst + r * run * es, "dropout");
    else kc_dropout_run(seed, j, run, keep, scale, src + r * run * es, es, dst + r * run * es, es, x->dtype);
    for (int d = q - 1; d >= 0; d--) { if (++idx[d] < x->shape[d]) break; idx[d] = 0; }
  }
  eng_tensor_release(X);
  if (rc) { eng_tensor_release(out); return NULL; }
  return out;
}

static void box_free(eng_node* n) { free(n->ctx); n->ctx = NULL; }

static int dropout_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor* g = go[0];
  eng_tensor* G = eng_dtype_is_floating(g->dtype) ? eng_tensor_retain(g) : eng_as_contig(g, ENG_F32);
  if (!G) return -1;
  eng_tensor* r = n->ctx ? apply_mask_box(G, (uint64_t)n->ints[0], (uint64_t)n->ints[1], n->scalars[0], n->scalars[1], n->ctx)
                        : apply_mask(G, (uint64_t)n->ints[0], (uint64_t)n->ints[1], n->scalars[0], n->scalars[1]);
  eng_tensor_release(G);
  if (!r) return -1;
  gi[0] = eng_grad_to_input(n, 0, r);
  eng_tensor_release(r);
  return gi[0] ? 0 : -1;
}

eng_tensor* eng_dropout(eng_tensor* x, double p, int training) {
  ENG_CHECK(x, "dropout");
  if (eng_meta_check_local(x, "dropout")) return NULL;
  if (!(p >= 0.0 && p <= 1.0))
    return eng_errp("dropout: probability has to be between 0 and 1, but got %g (input %s)", p, eng_desc(x));
  if (!training || p == 0.0) return eng_tensor_retain(x);
  if (ENG_DT_ACTIVE(x->dist || ENG_META_T(x))) return eng_op_dispatch(ENG_OP_DROPOUT, &(eng_op_call){.name = "dropout", .n_in = 1, .in = {x}, .scalars = {p}});
  if (x->numel == 0) return eng_tensor_retain(x);
  if (!eng_dtype_is_floating(x->dtype))
    return eng_errp("dropout: expects a floating point input, got %s", eng_desc(x));
  uint64_t seed;
  uint64_t off = eng_rng_reserve_seeded((uint64_t)x->numel, &seed);
  double keep = 1.0 - p;
  double scale = p == 1.0 ? 0.0 : 1.0 / keep;
  eng_tensor* out = apply_mask(x, seed, off, keep, scale);
  if (!out || !eng_any_requires_grad(1, &x)) return out;
  eng_node* nd = eng_record("DropoutBackward", dropout_bw, 1, &x, out);
  if (!nd) { eng_tensor_release(out); return NULL; }
  nd->ints[0] = (int64_t)seed;
  nd->ints[1] = (int64_t)off;
  nd->scalars[0] = keep;
  nd->scalars[1] = scale;
  return out;
}

/* Dropout of a DTensor's local shard x (local mode; sharding/dropout.c): the
 * shard is the box spec->offset + x->shape of the global tensor spec->shape;
 * the generator advances by the GLOBAL numel on every rank (also outside the
 * mesh), so every layout draws the same mask as one process. */
eng_tensor* eng_dropout_shard(eng_tensor* x, double p, const eng_dist_spec* spec) {
  ENG_CHECK(x, "dropout");
  if (eng_meta_check(x, "dropout")) return NULL;
  if (!eng_dtype_is_floating(x->dtype))
    return eng_errp("dropout: expects a floating point input, got %s", eng_desc(x));
  uint64_t seed;
  uint64_t off = eng_rng_reserve_seeded((uint64_t)spec->numel, &seed);
  double keep = 1.0 - p;
  double scale = p == 1.0 ? 0.0 : 1.0 / keep;
  drop_box b;
  for (int d = 0; d < x->ndim; d++) { b.gshape[d] = spec->shape[d]; b.start[d] = spec->offset[d]; }
  if (x->numel == 0 || !spec->member) return eng_tensor_retain(x);
  eng_tensor* out = apply_mask_box(x, seed, off, keep, scale, &b);
  if (!out || !eng_any_requires_grad(1, &x)) return out;
  drop_box* ctx = malloc(sizeof *ctx);
  if (!ctx) { eng_tensor_release(out); return eng_errp("dropout: out of memory"); }
  *ctx = b;
  eng_node* nd = eng_record("DropoutBackward", dropout_bw, 1, &x, out);
  if (!nd) { free(ctx); eng_tensor_release(out); return NULL; }
  nd->ints[0] = (int64_t)seed;
  nd->ints[1] = (int64_t)off;
  nd->scalars[0] = keep;
  nd->scalars[1] = scale;
  nd->ctx = ctx;
  nd->free_ctx = box_free;
  return out;
}
