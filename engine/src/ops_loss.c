/* ops_loss.c: cross_entropy with class-index targets (PyTorch semantics:
 * ignore_index, reduction none/mean/sum, label_smoothing), as one fused
 * log-softmax + NLL kernel.  Backward is softmax - smoothed one-hot, scaled,
 * computed from the saved logits and per-position logsumexp only. */
#include "internal.h"
#include "../../kernels/cpu/kcpu.h"
#include <math.h>

enum { RED_NONE = 0, RED_MEAN = 1, RED_SUM = 2 };

static int compute_dtype(int dt) { return dt == ENG_F64 ? ENG_F64 : ENG_F32; }

/* Big inputs are split over N across the engine's threads. */
#define PAR_MIN_NUMEL (1 << 17)

typedef struct {
  int dt, bw;
  int64_t C, inner, ignore;
  double eps, gconst;
  const char *x, *lse_in, *gs;
  const int64_t* tgt;
  char *loss, *lse, *gx;
  int fail;
} ce_ctx;

static void ce_range(void* vc, int64_t lo, int64_t hi) {
  ce_ctx* c = vc;
  int es = c->dt == ENG_F32 ? 4 : 8;
  int64_t xo = lo * c->C * c->inner * es, po = lo * c->inner;
  const int64_t* t = c->tgt + po;
  int r;
  if (c->bw) {
    if (c->dt == ENG_F32)
      r = kc_cross_entropy_bw_f32(hi - lo, c->C, c->inner, (const float*)(c->x + xo), t, c->ignore, c->eps,
                                  (const float*)c->lse_in + po, c->gs ? (const float*)c->gs + po : NULL, c->gconst,
                                  (float*)(c->gx + xo));
    else
      r = kc_cross_entropy_bw_f64(hi - lo, c->C, c->inner, (const double*)(c->x + xo), t, c->ignore, c->eps,
                                  (const double*)c->lse_in + po, c->gs ? (const double*)c->gs + po : NULL,
                                  c->gconst, (double*)(c->gx + xo));
  } else {
    if (c->dt == ENG_F32)
      r = kc_cross_entropy_f32(hi - lo, c->C, c->inner, (const float*)(c->x + xo), t, c->ignore, c->eps,
                               (float*)c->loss + po, (float*)c->lse + po);
    else
      r = kc_cross_entropy_f64(hi - lo, c->C, c->inner, (const double*)(c->x + xo), t, c->ignore, c->eps,
                               (double*)c->loss + po, (double*)c->lse + po);
  }
  if (r) __atomic_store_n(&c->fail, 1, __ATOMIC_RELAXED);
}

static int run_ce(ce_ctx* c, int64_t N) {
  int threads = N * c->C * c->inner >= PAR_MIN_NUMEL ? eng_threads() : 1;
  kc_parallel_blas(threads, N, ce_range, c);
  return c->fail ? eng_err("cross_entropy: out of memory") : 0;
}

/* saved: 0 logits (contiguous, compute dtype), 1 target (contiguous i64),
 * 2 lse.  ints: 0 N, 1 C, 2 inner, 3 ignore_index, 4 reduction, 5 count.
 * scalars: 0 label_smoothing. */
static int ce_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor *X = eng_node_saved(n, 0), *T = eng_node_saved(n, 1), *lse = eng_node_saved(n, 2);
  if (!X || !T || !lse) return -1;
  if (!eng_node_needs_grad(n, 0)) return 0;
  int64_t N = n->ints[0], C = n->ints[1], inner = n->ints[2], ignore = n->ints[3], count = n->ints[5];
  int red = (int)n->ints[4];
  double eps = n->scalars[0];
  int cdt = X->dtype;
  eng_tensor *G = NULL, *gx = NULL;
  double gconst = 0.0;
  int rc = -1;
  if (red == RED_NONE) {
    if (!(G = eng_as_contig(go[0], cdt))) goto done;
  } else {
    double g;
    if (eng_tensor_item(go[0], &g)) goto done;
    gconst = red == RED_MEAN ? g / (double)count : g;
  }
  if (!(gx = eng_new(X->ndim, X->shape, cdt, X->device))) goto done;
  ce_ctx c = {0};
  c.dt = cdt; c.bw = 1; c.C = C; c.inner = inner; c.ignore = ignore; c.eps = eps; c.gconst = gconst;
  c.x = eng_ptr(X); c.tgt = (const int64_t*)eng_ptr(T); c.lse_in = eng_ptr(lse); c.gs = G ? eng_ptr(G) : NULL;
  c.gx = eng_ptr(gx);
  if (run_ce(&c, N)) goto done;
  if ((gi[0] = eng_grad_to_input(n, 0, gx))) rc = 0;
done:
  eng_tensor_release(G); eng_tensor_release(gx);
  return rc;
}

eng_tensor* eng_cross_entropy(eng_tensor* logits, eng_tensor* target, int64_t ignore_index,
                              int reduction, double label_smoothing) {
  ENG_CHECK(logits, "cross_entropy"); ENG_CHECK(target, "cross_entropy");
  eng_tensor* x = logits;
  if (!eng_dtype_is_floating(x->dtype))
    return eng_errp("cross_entropy: logits %s must be floating point", eng_desc(x));
  if (target->dtype != ENG_I64 && target->dtype != ENG_I32)
    return eng_errp("cross_entropy: target %s must hold class indices (i64 or i32); probability targets "
                    "are not supported", eng_desc(target));
  if (x->device != target->device)
    return eng_errp("cross_entropy: logits %s and target %s on different devices", eng_desc(x), eng_desc(target));
  if (reduction < RED_NONE || reduction > RED_SUM)
    return eng_errp("cross_entropy: reduction code %d is invalid (0 none, 1 mean, 2 sum)", reduction);
  if (!(label_smoothing >= 0.0 && label_smoothing <= 1.0))
    return eng_errp("cross_entropy: label_smoothing must be between 0.0 and 1.0, got %g", label_smoothing);
  if (x->ndim < 1)
    return eng_errp("cross_entropy: logits %s must be [C], [N, C] or [N, C, d1, ...]", eng_desc(x));
  /* expected target shape: logits without the class dim */
  int cdim = x->ndim == 1 ? 0 : 1;
  int64_t tshape[ENG_MAX_DIMS];
  int tnd = 0;
  for (int d = 0; d < x->ndim; d++) if (d != cdim) tshape[tnd++] = x->shape[d];
  int ok = target->ndim == tnd;
  for (int d = 0; ok && d < tnd; d++) ok = target->shape[d] == tshape[d];
  if (!ok)
    return eng_errp("cross_entropy: target %s does not match logits %s (expected target shape %s: the "
                    "logits' shape without the class dim %d)", eng_desc(target), eng_desc(x),
                    eng_shape_str(tnd, tshape), cdim);
  int64_t C = x->shape[cdim], N = x->ndim == 1 ? 1 : x->shape[0], inner = 1;
  for (int d = 2; d < x->ndim; d++) inner *= x->shape[d];
  int rdt = x->dtype, cdt = compute_dtype(rdt);
  eng_tensor *X = NULL, *T = NULL, *lse = NULL, *loss = NULL, *out = NULL;
  if (!(T = eng_as_contig(target, ENG_I64))) goto fail;
  const int64_t* tg = (const int64_t*)eng_ptr(T);
  int64_t npos = N * inner, count = 0;
  for (int64_t i = 0; i < npos; i++) {
    if (tg[i] == ignore_index) continue;
    if (tg[i] < 0 || tg[i] >= C) {
      eng_errp("cross_entropy: target %lld at (0-based, flat) position %lld is out of range for %lld classes "
               "(valid: 0..%lld, or ignore_index %lld); logits %s", (long long)tg[i], (long long)i, (long long)C,
               (long long)C - 1, (long long)ignore_index, eng_desc(x));
      goto fail;
    }
    count++;
  }
  if (!(X = eng_as_contig(x, cdt))) goto fail;
  int64_t np = npos;
  if (!(lse = eng_new(1, &np, cdt, x->device)) || !(loss = eng_new(tnd, tshape, cdt, x->device))) goto fail;
  ce_ctx c = {0};
  c.dt = cdt; c.C = C; c.inner = inner; c.ignore = ignore_index; c.eps = label_smoothing;
  c.x = eng_ptr(X); c.tgt = tg; c.loss = eng_ptr(loss); c.lse = eng_ptr(lse);
  if (run_ce(&c, N)) goto fail;
  if (reduction == RED_NONE) {
    out = loss; loss = NULL;
  } else {
    double s = 0.0;
    if (cdt == ENG_F32) { const float* l = (const float*)eng_ptr(loss); for (int64_t i = 0; i < npos; i++) s += l[i]; }
    else { const double* l = (const double*)eng_ptr(loss); for (int64_t i = 0; i < npos; i++) s += l[i]; }
    if (reduction == RED_MEAN) s = count ? s / (double)count : NAN;
    if (!(out = eng_tensor_full(0, NULL, s, cdt, x->device))) goto fail;
  }
  if (rdt != cdt) {
    eng_tensor* r = eng_as_contig(out, rdt);
    eng_tensor_release(out);
    if (!(out = r)) goto fail;
  }
  if (eng_any_requires_grad(1, &x)) {
    eng_node* nd = eng_record("CrossEntropyBackward", ce_bw, 1, &x, out);
    if (!nd || eng_node_save(nd, X) || eng_node_save(nd, T) || eng_node_save(nd, lse)) goto fail;
    nd->ints[0] = N; nd->ints[1] = C; nd->ints[2] = inner; nd->ints[3] = ignore_index;
    nd->ints[4] = reduction; nd->ints[5] = count;
    nd->scalars[0] = label_smoothing;
  }
  eng_tensor_release(X); eng_tensor_release(T); eng_tensor_release(lse); eng_tensor_release(loss);
  return out;
fail:
  eng_tensor_release(X); eng_tensor_release(T); eng_tensor_release(lse); eng_tensor_release(loss);
  eng_tensor_release(out);
  return NULL;
}
