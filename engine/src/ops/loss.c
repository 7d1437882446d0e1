/* loss.c: cross_entropy with class-index targets (PyTorch semantics:
 * ignore_index, reduction none/mean/sum, label_smoothing), as one fused
 * log-softmax + NLL kernel.  Backward is softmax - smoothed one-hot, scaled,
 * computed from the saved logits and per-position logsumexp only. */
#include "core/internal.h"
#include "core/dispatch.h"
#include "kernels/cpu/kcpu.h"
#include "ops/cuda_ops.h"
#include "autograd/autograd.h"
#include "eng/ops_pointwise.h"
#include "eng/ops_nn.h"
#include "eng/ops_shape.h"
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
/* The incoming gradient of a loss: for reduction none a contiguous copy in dtype dt (*G, new reference), else
 * the scalar it scales every element's gradient by (*gconst: g, or g / count for mean).  0 or -1. */
static int upstream_grad(eng_tensor* go, int red, int64_t count, int dt, eng_tensor** G, double* gconst) {
  if (red == RED_NONE) return (*G = eng_as_contig(go, dt)) ? 0 : -1;
  double g;
  if (eng_tensor_item(go, &g)) return -1;
  *gconst = red == RED_MEAN ? g / (double)count : g;
  return 0;
}

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
  if (upstream_grad(go[0], red, count, cdt, &G, &gconst)) goto done;
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

/* ------------------------------------------------------------ CUDA
 * Logits [N, C] (or [C]) in their own dtype (the kernels read bf16/f16
 * directly), targets i32/i64, loss and lse f32 (f64 for f64 logits).
 * 'mean' divides by the count of non-ignored targets, computed on the device
 * with the mean (saved for backward: no host sync on the way). */
static int ce_bw_cuda(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor *X = eng_node_saved(n, 0), *T = eng_node_saved(n, 1), *lse = eng_node_saved(n, 2);
  eng_tensor* stats = n->ints[4] == RED_MEAN ? eng_node_saved(n, 3) : NULL;
  if (!X || !T || !lse || (n->ints[4] == RED_MEAN && !stats)) return -1;
  if (!eng_node_needs_grad(n, 0)) return 0;
  if (eng_cu_same_device(n->name, X, go[0])) return -1;
  int64_t N = n->ints[0], C = n->ints[1], ignore = n->ints[3];
  int red = (int)n->ints[4], ldt = lse->dtype;
  int prev = eng_set_grad_enabled(0);
  eng_tensor *G = eng_as_contig(go[0], ldt), *sc = NULL, *gx = NULL;
  int rc = -1;
  if (G && red == RED_MEAN) { /* upstream gradient / count, on the device */
    eng_tensor* cnt = eng_view_of(stats, 0, NULL, NULL, 1);
    sc = cnt ? eng_div(G, cnt) : NULL;
    eng_tensor_release(cnt);
    if (sc && sc->dtype != ldt) { eng_tensor* t = eng_as_contig(sc, ldt); eng_tensor_release(sc); sc = t; }
  } else if (G && red == RED_SUM) {
    sc = eng_tensor_retain(G);
  }
  if (G && (red == RED_NONE || sc) && (gx = eng_new(X->ndim, X->shape, X->dtype, X->device)) &&
      eng_cu_cross_entropy_bwd(X->dtype, N, C, eng_ptr(X), eng_ptr(T), T->dtype, ignore, n->scalars[0], eng_ptr(lse),
                               red == RED_NONE ? eng_ptr(G) : NULL, sc ? eng_ptr(sc) : NULL, 1.0, eng_ptr(gx),
                               n->name) == 0)
    rc = (gi[0] = eng_grad_to_input(n, 0, gx)) ? 0 : -1;
  eng_set_grad_enabled(prev);
  eng_tensor_release(G); eng_tensor_release(sc); eng_tensor_release(gx);
  return rc;
}

static eng_tensor* ce_cuda(eng_tensor* x, eng_tensor* target, int64_t N, int64_t C, int64_t ignore, int red,
                           double eps, int tnd, const int64_t* tshape, int f32_loss) {
  const char* op = f32_loss ? "fused_classifier" : "cross_entropy";
  int rdt = x->dtype, ldt = rdt == ENG_F64 ? ENG_F64 : ENG_F32;
  eng_tensor *X = NULL, *T = NULL, *lse = NULL, *loss = NULL, *stats = NULL, *out = NULL;
  int64_t two = 2;
  if (!(X = eng_as_contig(x, rdt)) || !(T = eng_as_contig(target, target->dtype))) goto fail;
  if (!(lse = eng_new(1, &N, ldt, x->device)) || !(loss = eng_new(tnd, tshape, ldt, x->device))) goto fail;
  if (eng_cu_cross_entropy_fwd(rdt, N, C, eng_ptr(X), eng_ptr(T), T->dtype, ignore, eps, eng_ptr(loss), eng_ptr(lse),
                               op))
    goto fail;
  if (red == RED_NONE) {
    out = eng_tensor_retain(loss);
  } else if (red == RED_MEAN) {
    if (!(stats = eng_new(1, &two, ldt, x->device)) ||
        eng_cu_masked_mean(rdt, N, eng_ptr(loss), eng_ptr(T), T->dtype, ignore, eng_ptr(stats), op) ||
        !(out = eng_view_of(stats, 0, NULL, NULL, 0)))
      goto fail;
  } else {
    if (!(out = eng_new(0, NULL, ldt, x->device)) ||
        eng_cu_reduce_all(0, ldt, N, eng_ptr(loss), eng_ptr(out), ldt, 1.0, op))
      goto fail;
  }
  if (rdt != ldt && !f32_loss) {
    eng_tensor* r = eng_as_contig(out, rdt);
    eng_tensor_release(out);
    if (!(out = r)) goto fail;
  }
  if (eng_any_requires_grad(1, &x)) {
    eng_node* nd = eng_record(f32_loss ? "FusedClassifierBackward" : "CrossEntropyBackward", ce_bw_cuda, 1, &x, out);
    if (!nd || eng_node_save(nd, X) || eng_node_save(nd, T) || eng_node_save(nd, lse) ||
        (stats && eng_node_save(nd, stats)))
      goto fail;
    nd->ints[0] = N; nd->ints[1] = C; nd->ints[2] = 1; nd->ints[3] = ignore; nd->ints[4] = red;
    nd->scalars[0] = eps;
  }
  eng_tensor_release(X); eng_tensor_release(T); eng_tensor_release(lse); eng_tensor_release(loss);
  eng_tensor_release(stats);
  return out;
fail:
  eng_tensor_release(X); eng_tensor_release(T); eng_tensor_release(lse); eng_tensor_release(loss);
  eng_tensor_release(stats); eng_tensor_release(out);
  return NULL;
}

/* Logits [N, C, d1, ...] on CUDA: the class dim moved last and the positions flattened, [N d1 ..., C] rows for the
 * row kernels (autograd through the permute and reshapes); 'none' gives the losses back in the target's shape,
 * 'mean' averages over every position not ignored, as PyTorch. */
static eng_tensor* ce_cuda_spatial(eng_tensor* x, eng_tensor* target, int64_t N, int64_t C, int64_t inner,
                                   int64_t ignore_index, int reduction, double label_smoothing, int tnd,
                                   const int64_t* tshape) {
  int perm[ENG_MAX_DIMS], nd = x->ndim;
  perm[0] = 0;
  for (int d = 2; d < nd; d++) perm[d - 1] = d;
  perm[nd - 1] = 1;
  int64_t rows[2] = {N * inner, C}, flat[1] = {N * inner};
  eng_tensor *xp = eng_permute(x, nd, perm), *xr = xp ? eng_reshape(xp, 2, rows) : NULL;
  eng_tensor *tr = xr ? eng_reshape(target, 1, flat) : NULL;
  eng_tensor* r = tr ? eng_cross_entropy(xr, tr, ignore_index, reduction, label_smoothing) : NULL;
  eng_tensor_release(xp); eng_tensor_release(xr); eng_tensor_release(tr);
  if (r && reduction == RED_NONE) {
    eng_tensor* s = eng_reshape(r, tnd, tshape);
    eng_tensor_release(r);
    r = s;
  }
  return r;
}

eng_tensor* eng_cross_entropy(eng_tensor* logits, eng_tensor* target, int64_t ignore_index,
                              int reduction, double label_smoothing) {
  ENG_CHECK(logits, "cross_entropy"); ENG_CHECK(target, "cross_entropy");
  if (eng_meta_check_local(logits, "cross_entropy")) return NULL;
  if (eng_meta_check_local(target, "cross_entropy")) return NULL;
  if (ENG_DT_ACTIVE(logits->dist || ENG_META_T(logits) || target->dist || ENG_META_T(target)))
    return eng_op_dispatch(ENG_OP_CROSS_ENTROPY,
                        &(eng_op_call){.name = "cross_entropy", .n_in = 2, .in = {logits, target},
                                       .ints = {ignore_index, reduction}, .scalars = {label_smoothing}});
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
                    eng_shape_str(tnd, tshape), cdim + 1);
  int64_t C = x->shape[cdim], N = x->ndim == 1 ? 1 : x->shape[0], inner = 1;
  for (int d = 2; d < x->ndim; d++) inner *= x->shape[d];
  if (x->device == ENG_CUDA) {
    if (inner != 1) return ce_cuda_spatial(x, target, N, C, inner, ignore_index, reduction, label_smoothing, tnd,
                                           tshape);
    return ce_cuda(x, target, N, C, ignore_index, reduction, label_smoothing, tnd, tshape, 0);
  }
  int rdt = x->dtype, cdt = compute_dtype(rdt);
  eng_tensor *X = NULL, *T = NULL, *lse = NULL, *loss = NULL, *out = NULL;
  if (!(T = eng_as_contig(target, ENG_I64))) goto fail;
  const int64_t* tg = (const int64_t*)eng_ptr(T);
  int64_t npos = N * inner, count = 0;
  for (int64_t i = 0; i < npos; i++) {
    if (tg[i] == ignore_index) continue;
    if (tg[i] < 0 || tg[i] >= C) {
      eng_errp("cross_entropy: target %lld at flat position %lld is out of range for %lld classes "
               "(class ids are 0-based: valid 0..%lld, or ignore_index %lld); logits %s", (long long)tg[i],
               (long long)i + 1, (long long)C,
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

/* ------------------------------------------------------------ fused classifier
 * llm.c's fused_classifier for an autograd engine: cross entropy on bf16/f16
 * logits [N, C] without f32 logits.  Forward: one pass over the logits in
 * their dtype (f32 accumulation, online logsumexp on CUDA), the loss in f32
 * (not rounded to the logits' dtype), lse saved per row.  Backward: one pass
 * writing the gradient in the logits' dtype from the logits, lse and the
 * upstream gradient (read on the device: no host sync on CUDA).  About 6
 * bytes of traffic per logit (read, read + write) where cross_entropy on
 * :float() logits moves about 24 (cast, read, read + write in f32, cast
 * back); llm.c's 4 comes from writing the gradient over the logits in the
 * forward, which an autograd op may not do (the logits stay the caller's).
 * Other dtypes, [C] logits and DTensors (no sharding rule of its own) take
 * cross_entropy on f32 logits, the result the fused path approximates. */

/* Rows split over the engine's threads (as run_ce). */
typedef struct {
  int dt, bw;
  int64_t C, ignore;
  double eps, gconst;
  const uint16_t* x;
  const int64_t* tgt;
  const float *lse_in, *gs;
  float *loss, *lse;
  uint16_t* gx;
  int fail;
} fc_ctx;

static void fc_range(void* vc, int64_t lo, int64_t hi) {
  fc_ctx* c = vc;
  int r = c->bw ? kc_cross_entropy_half_bw(c->dt, hi - lo, c->C, c->x + lo * c->C, c->tgt + lo, c->ignore, c->eps,
                                           c->lse_in + lo, c->gs ? c->gs + lo : NULL, c->gconst, c->gx + lo * c->C)
                : kc_cross_entropy_half(c->dt, hi - lo, c->C, c->x + lo * c->C, c->tgt + lo, c->ignore, c->eps,
                                        c->loss + lo, c->lse + lo);
  if (r) __atomic_store_n(&c->fail, 1, __ATOMIC_RELAXED);
}

static int run_fc(fc_ctx* c, int64_t N) {
  kc_parallel_blas(N * c->C >= PAR_MIN_NUMEL ? eng_threads() : 1, N, fc_range, c);
  return c->fail ? eng_err("fused_classifier: out of memory") : 0;
}

/* saved: 0 logits (contiguous half), 1 target (contiguous i64), 2 lse (f32).
 * ints: 0 N, 1 C, 3 ignore_index, 4 reduction, 5 count; scalars: 0 eps. */
static int fc_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor *X = eng_node_saved(n, 0), *T = eng_node_saved(n, 1), *lse = eng_node_saved(n, 2);
  if (!X || !T || !lse) return -1;
  if (!eng_node_needs_grad(n, 0)) return 0;
  int64_t N = n->ints[0], C = n->ints[1], ignore = n->ints[3], count = n->ints[5];
  int red = (int)n->ints[4];
  eng_tensor *G = NULL, *gx = NULL;
  double gconst = 0.0;
  int rc = -1;
  if (upstream_grad(go[0], red, count, ENG_F32, &G, &gconst)) goto done;
  if (!(gx = eng_new(X->ndim, X->shape, X->dtype, X->device))) goto done;
  fc_ctx c = {0};
  c.dt = X->dtype; c.bw = 1; c.C = C; c.ignore = ignore; c.eps = n->scalars[0]; c.gconst = gconst;
  c.x = (const uint16_t*)eng_ptr(X); c.tgt = (const int64_t*)eng_ptr(T); c.lse_in = (const float*)eng_ptr(lse);
  c.gs = G ? (const float*)eng_ptr(G) : NULL; c.gx = (uint16_t*)eng_ptr(gx);
  if (run_fc(&c, N)) goto done;
  if ((gi[0] = eng_grad_to_input(n, 0, gx))) rc = 0;
done:
  eng_tensor_release(G); eng_tensor_release(gx);
  return rc;
}

eng_tensor* eng_fused_classifier(eng_tensor* logits, eng_tensor* target, int64_t ignore_index, int reduction,
                                 double label_smoothing) {
  const char* op = "fused_classifier";
  ENG_CHECK(logits, "fused_classifier"); ENG_CHECK(target, "fused_classifier");
  eng_tensor* x = logits;
  int half = x->dtype == ENG_BF16 || x->dtype == ENG_F16;
  if (ENG_DT_ACTIVE(x->dist || ENG_META_T(x) || target->dist || ENG_META_T(target)) || !half || x->ndim != 2) {
    /* the reference: cross_entropy on f32 (f64 stays f64) logits, DTensor rules included */
    if (!eng_dtype_is_floating(x->dtype))
      return eng_errp("%s: logits %s must be floating point", op, eng_desc(x));
    eng_tensor* xf = x->dtype == ENG_F64 ? eng_tensor_retain(x) : eng_tensor_to_dtype(x, ENG_F32);
    if (!xf) return NULL;
    eng_tensor* r = eng_cross_entropy(xf, target, ignore_index, reduction, label_smoothing);
    eng_tensor_release(xf);
    if (!r) eng_err_prefix("%s", op);
    return r;
  }
  if (target->dtype != ENG_I64 && target->dtype != ENG_I32)
    return eng_errp("%s: target %s must hold class indices (i64 or i32)", op, eng_desc(target));
  if (x->device != target->device)
    return eng_errp("%s: logits %s and target %s on different devices", op, eng_desc(x), eng_desc(target));
  if (reduction < RED_NONE || reduction > RED_SUM)
    return eng_errp("%s: reduction code %d is invalid (0 none, 1 mean, 2 sum)", op, reduction);
  if (!(label_smoothing >= 0.0 && label_smoothing <= 1.0))
    return eng_errp("%s: label_smoothing must be between 0.0 and 1.0, got %g", op, label_smoothing);
  int64_t N = x->shape[0], C = x->shape[1];
  if (target->ndim != 1 || target->shape[0] != N)
    return eng_errp("%s: target %s does not match logits %s (expected target shape [%lld])", op, eng_desc(target),
                    eng_desc(x), (long long)N);
  if (C < 1) return eng_errp("%s: logits %s have no classes", op, eng_desc(x));
  if (x->device == ENG_CUDA) return ce_cuda(x, target, N, C, ignore_index, reduction, label_smoothing, 1, &N, 1);
  eng_tensor *X = NULL, *T = NULL, *lse = NULL, *loss = NULL, *out = NULL;
  if (!(T = eng_as_contig(target, ENG_I64))) goto fail;
  const int64_t* tg = (const int64_t*)eng_ptr(T);
  int64_t count = 0;
  for (int64_t i = 0; i < N; i++) {
    if (tg[i] == ignore_index) continue;
    if (tg[i] < 0 || tg[i] >= C) {
      eng_errp("%s: target %lld at position %lld is out of range for %lld classes (class ids are 0-based: valid "
               "0..%lld, or ignore_index %lld); logits %s", op, (long long)tg[i], (long long)i + 1, (long long)C,
               (long long)C - 1, (long long)ignore_index, eng_desc(x));
      goto fail;
    }
    count++;
  }
  if (!(X = eng_as_contig(x, x->dtype))) goto fail;
  if (!(lse = eng_new(1, &N, ENG_F32, x->device)) || !(loss = eng_new(1, &N, ENG_F32, x->device))) goto fail;
  fc_ctx c = {0};
  c.dt = x->dtype; c.C = C; c.ignore = ignore_index; c.eps = label_smoothing; c.x = (const uint16_t*)eng_ptr(X);
  c.tgt = tg; c.loss = (float*)eng_ptr(loss); c.lse = (float*)eng_ptr(lse);
  if (run_fc(&c, N)) goto fail;
  if (reduction == RED_NONE) {
    out = loss; loss = NULL;
  } else {
    double s = 0.0;
    const float* l = (const float*)eng_ptr(loss);
    for (int64_t i = 0; i < N; i++) s += l[i];
    if (reduction == RED_MEAN) s = count ? s / (double)count : NAN;
    if (!(out = eng_tensor_full(0, NULL, s, ENG_F32, x->device))) goto fail;
  }
  if (eng_any_requires_grad(1, &x)) {
    eng_node* nd = eng_record("FusedClassifierBackward", fc_bw, 1, &x, out);
    if (!nd || eng_node_save(nd, X) || eng_node_save(nd, T) || eng_node_save(nd, lse)) goto fail;
    nd->ints[0] = N; nd->ints[1] = C; nd->ints[2] = 1; nd->ints[3] = ignore_index;
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
