/* ops_dropout.c: inverted dropout with the counter-based generator.
 * Element i (row-major) is kept iff the uniform of stream position
 * offset + i is < 1 - p, i.e. the mask equals
 * eng_random_slice(ENG_RNG_BERNOULLI, ..., a = 1 - p, seed, offset), so any
 * shard can rebuild its part of the mask.  Backward regenerates the mask from
 * the (seed, offset) saved in the node: no mask is stored. */
#include "internal.h"
#include "sharding.h"
#include "../../kernels/cpu/kcpu.h"
#include "cuda_ops.h"
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

static int dropout_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor* g = go[0];
  eng_tensor* G = eng_dtype_is_floating(g->dtype) ? eng_tensor_retain(g) : eng_as_contig(g, ENG_F32);
  if (!G) return -1;
  eng_tensor* r = apply_mask(G, (uint64_t)n->ints[0], (uint64_t)n->ints[1], n->scalars[0], n->scalars[1]);
  eng_tensor_release(G);
  if (!r) return -1;
  gi[0] = eng_grad_to_input(n, 0, r);
  eng_tensor_release(r);
  return gi[0] ? 0 : -1;
}

eng_tensor* eng_dropout(eng_tensor* x, double p, int training) {
  ENG_CHECK(x, "dropout");
  if (ENG_DT_ACTIVE(x->dist)) return eng_no_rule("dropout", &(eng_op_call){.n_in = 1, .in = {x}});
  if (!(p >= 0.0 && p <= 1.0))
    return eng_errp("dropout: probability has to be between 0 and 1, but got %g (input %s)", p, eng_desc(x));
  if (!training || p == 0.0 || x->numel == 0) return eng_tensor_retain(x);
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
