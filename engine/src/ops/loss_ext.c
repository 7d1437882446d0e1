/* loss_ext.c: the remaining torch.nn.functional losses as single fused ops (one
 * dispatch each; PyTorch's forward and backward formulas):
 *   nll_loss (class weights, ignore_index, none / mean = sum(w_i l_i) / sum(w_i) / sum);
 *   the elementwise losses binary_cross_entropy (the 0..1 input check done by
 *   the kernel), binary_cross_entropy_with_logits (weight, pos_weight),
 *   kl_div (log_target, batchmean), smooth_l1_loss (beta), huber_loss (delta).
 * Gradients flow to the input (and, for the elementwise losses, to the
 * target); weight and pos_weight are constants here (engine.ops.loss takes
 * its composite path when they require grad).  f32 / f64 are computed in
 * their dtype, bf16 / f16 in f32 and rounded once.
 *
 * CUDA: the documented host fallback (as the index ops' remaining cases):
 * the operands are copied to the host, the CPU kernel runs there and the
 * result (and in backward the gradients) go back to the device.
 *
 * DTensor rules: sharding/loss.c (ENG_OP_NLL_LOSS, ENG_OP_PLOSS). */
#include "core/internal.h"
#include "core/dispatch.h"
#include "ops/ops.h"
#include "kernels/cpu/kcpu.h"
#include "autograd/autograd.h"
#include "eng/dtensor.h"
#include "eng/ops_nn.h"
#include "eng/ops_shape.h"
#include <math.h>
#include <stdio.h>

enum { RED_NONE = 0, RED_MEAN = 1, RED_SUM = 2, RED_BATCHMEAN = 3 };

static int compute_dtype(int dt) { return dt == ENG_F64 ? ENG_F64 : ENG_F32; }

/* r (a host result in the compute dtype) as dtype on device (no autograd; consumes r). */
static eng_tensor* finish(eng_tensor* r, int dtype, int device) {
  if (r && r->dtype != dtype) {
    int prev = eng_set_grad_enabled(0);
    eng_tensor* t = eng_as_contig(r, dtype);
    eng_set_grad_enabled(prev);
    eng_tensor_release(r);
    r = t;
  }
  return eng_op_to_device(r, device);
}

/* Global shape and description (a DTensor's eng_tensor holds its local shard). */
static const int64_t* gsh(const eng_tensor* t) { return t->dist ? t->dist->shape : t->shape; }
static const char* gdesc(const eng_tensor* t) {
  static __thread char ring[4][160];
  static __thread int k;
  if (!t->dist) return eng_desc(t);
  char* b = ring[k++ & 3];
  snprintf(b, sizeof ring[0], "%s%s", eng_dtype_name(t->dtype), eng_shape_str(t->ndim, gsh(t)));
  return b;
}

/* The upstream gradient: per position (host, cdt) for reduction none, else
 * *gconst = g / divisor. */
static int upstream(eng_tensor* go, int red, double divisor, int cdt, eng_tensor** G, double* gconst) {
  *G = NULL; *gconst = 0;
  if (red == RED_NONE) return (*G = eng_op_host(go, cdt)) ? 0 : -1;
  double g;
  if (eng_tensor_item(go, &g)) return -1;
  *gconst = g / divisor;
  return 0;
}

/* ============================================================ nll_loss */
/* The targets as a host i64 tensor, checked in range (the message of the
 * composite: its range with ignored ids read as 0). */
static eng_tensor* read_targets(const char* op, eng_tensor* target, int64_t C, int64_t ignore) {
  eng_tensor* T = eng_op_host(target, ENG_I64);
  if (!T) return NULL;
  const int64_t* tg = (const int64_t*)eng_ptr(T);
  int64_t lo = INT64_MAX, hi = INT64_MIN;
  for (int64_t i = 0; i < T->numel; i++) {
    int64_t v = tg[i] == ignore ? 0 : tg[i];
    if (v < lo) lo = v;
    if (v > hi) hi = v;
  }
  if (T->numel > 0 && (lo < 0 || hi >= C)) {
    eng_errp("%s: target %lld is out of bounds for %lld classes (class ids are 0-based; ignore_index %lld)", op,
             (long long)(lo < 0 ? lo : hi), (long long)C, (long long)ignore);
    eng_tensor_release(T);
    return NULL;
  }
  return T;
}
#define PTR(T, t) ((t) ? (T*)eng_ptr(t) : NULL)

/* saved: 0 target (host i64), [1 weight (host cdt)].  ints: 0 N, 1 C, 2 inner,
 * 3 ignore, 4 reduction (none / sum), 5 device, 6 has weight.  scalars: 0 divisor. */
static int nll_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor *T = eng_node_saved(n, 0), *W = n->ints[6] ? eng_node_saved(n, 1) : NULL;
  if (!T || (n->ints[6] && !W)) return -1;
  if (!eng_node_needs_grad(n, 0) || !go[0]) return 0;
  int64_t N = n->ints[0], C = n->ints[1], inner = n->ints[2], ignore = n->ints[3];
  int red = (int)n->ints[4], cdt = compute_dtype(eng_node_in_dtype(n, 0));
  eng_tensor *G = NULL, *gx = NULL;
  double gc;
  int rc = -1;
  if (upstream(go[0], red, n->scalars[0], cdt, &G, &gc)) goto done;
  if (!(gx = eng_new(eng_node_in_ndim(n, 0), eng_node_in_shape(n, 0), cdt, ENG_CPU))) goto done;
  const int64_t* t = (const int64_t*)eng_ptr(T);
  if (cdt == ENG_F32)
    kc_nll_bw_f32(N, C, inner, t, ignore, W ? (const float*)eng_ptr(W) : NULL, G ? (const float*)eng_ptr(G) : NULL,
                  gc, (float*)eng_ptr(gx));
  else
    kc_nll_bw_f64(N, C, inner, t, ignore, W ? (const double*)eng_ptr(W) : NULL,
                  G ? (const double*)eng_ptr(G) : NULL, gc, (double*)eng_ptr(gx));
  if (!(gx = finish(gx, cdt, (int)n->ints[5]))) goto done;
  rc = (gi[0] = eng_grad_to_input(n, 0, gx)) ? 0 : -1;
done:
  eng_tensor_release(G); eng_tensor_release(gx);
  return rc;
}

/* The op on local tensors (red none / mean / sum); *wsum_out (if non-NULL)
 * receives the sum of the weights of the non-ignored targets (mean's divisor). */
eng_tensor* eng_nll_loss_local(eng_tensor* x, eng_tensor* target, eng_tensor* weight, int64_t ignore, int red,
                               double* wsum_out) {
  const char* op = "nll_loss";
  if (!eng_dtype_is_floating(x->dtype)) return eng_errp("%s: input %s must be floating point", op, eng_desc(x));
  if (x->device != target->device || (weight && weight->device != x->device))
    return eng_errp("%s: input %s, target %s%s%s on different devices", op, eng_desc(x), eng_desc(target),
                    weight ? " and weight " : "", weight ? eng_desc(weight) : "");
  int nd = x->ndim, cdim = nd == 1 ? 0 : 1;
  int64_t C = x->shape[cdim], N = nd == 1 ? 1 : x->shape[0], inner = 1;
  for (int d = 2; d < nd; d++) inner *= x->shape[d];
  int rdt = x->dtype, cdt = compute_dtype(rdt);
  eng_tensor *T = NULL, *X = NULL, *W = NULL, *out = NULL;
  if (!(T = read_targets(op, target, C, ignore))) goto fail;
  const int64_t* tg = (const int64_t*)eng_ptr(T);
  if (!(X = eng_op_host(x, cdt)) || (weight && !(W = eng_op_host(weight, cdt)))) goto fail;
  double s = 0, ws = 0;
  if (red == RED_NONE) {
    int64_t ts[ENG_MAX_DIMS];
    int k = 0;
    for (int d = 0; d < nd; d++) if (d != cdim) ts[k++] = x->shape[d];
    if (!(out = eng_new(k, ts, cdt, ENG_CPU))) goto fail;
  }
  if (cdt == ENG_F32)
    kc_nll_f32(N, C, inner, (const float*)eng_ptr(X), tg, ignore, W ? (const float*)eng_ptr(W) : NULL,
               out ? (float*)eng_ptr(out) : NULL, &s, &ws);
  else
    kc_nll_f64(N, C, inner, (const double*)eng_ptr(X), tg, ignore, W ? (const double*)eng_ptr(W) : NULL,
               out ? (double*)eng_ptr(out) : NULL, &s, &ws);
  double divisor = red == RED_MEAN ? ws : 1.0;
  if (wsum_out) *wsum_out = ws;
  if (!out && !(out = eng_tensor_full(0, NULL, s / divisor, cdt, ENG_CPU))) goto fail;
  if (!(out = finish(out, rdt, x->device))) goto fail;
  if (eng_any_requires_grad(1, &x)) {
    eng_node* n = eng_record("NllLossBackward", nll_bw, 1, &x, out);
    if (!n || eng_node_save(n, T) || (W && eng_node_save(n, W))) goto fail;
    n->ints[0] = N; n->ints[1] = C; n->ints[2] = inner; n->ints[3] = ignore;
    n->ints[4] = red == RED_MEAN ? RED_SUM : red; n->ints[5] = x->device; n->ints[6] = W != NULL;
    n->scalars[0] = divisor;
  }
  eng_tensor_release(T); eng_tensor_release(X); eng_tensor_release(W);
  return out;
fail:
  eng_tensor_release(T); eng_tensor_release(X); eng_tensor_release(W); eng_tensor_release(out);
  return NULL;
}

/* The checks of nll_loss / weighted cross_entropy on global shapes, in the
 * composites' order (cross_entropy checks the weight first). */
static int nll_args(const char* op, eng_tensor* x, eng_tensor* target, eng_tensor* weight, int reduction,
                    int weight_first) {
  if (eng_meta_check_local(x, op) || eng_meta_check_local(target, op)) return -1;
  if (reduction < RED_NONE || reduction > RED_SUM)
    return eng_err("%s: reduction code %d is invalid (0 none, 1 mean, 2 sum)", op, reduction);
  int nd = x->ndim;
  if (nd == 0) return eng_err("%s: input must have at least 1 dim ([C], [N, C] or [N, C, d1, ...])", op);
  int cdim = nd == 1 ? 0 : 1;
  const int64_t *xs = gsh(x), *tsh = gsh(target);
  for (int pass = 0; pass < 2; pass++) {
    if (pass == (weight_first ? 0 : 1)) {
      if (weight && (weight->ndim != 1 || gsh(weight)[0] != xs[cdim]))
        return eng_err("%s: weight must be a 1-D tensor of %lld entries (one per class), got %s", op,
                       (long long)xs[cdim], gdesc(weight));
      continue;
    }
    if (eng_dtype_is_floating(target->dtype) || target->dtype == ENG_BOOL)
      return eng_err("%s: target must hold class ids (i64/i32), got %s", op, gdesc(target));
    int64_t ts[ENG_MAX_DIMS];
    int k = 0;
    for (int d = 0; d < nd; d++) if (d != cdim) ts[k++] = xs[d];
    int ok = target->ndim == k;
    for (int d = 0; ok && d < k; d++) ok = tsh[d] == ts[d];
    if (!ok)
      return eng_err("%s: input %s (classes in dim %d) expects target of shape %s, got %s", op, gdesc(x), cdim + 1,
                     eng_shape_str(k, ts), gdesc(target));
  }
  return 0;
}

eng_tensor* eng_nll_loss(eng_tensor* x, eng_tensor* target, eng_tensor* weight, int64_t ignore_index,
                         int reduction) {
  const char* op = "nll_loss";
  ENG_CHECK(x, op); ENG_CHECK(target, op);
  if (nll_args(op, x, target, weight, reduction, 0)) return NULL;
  if (ENG_DT_ACTIVE(x->dist || target->dist || (weight && weight->dist) || ENG_META_T(x) || ENG_META_T(target) ||
                    ENG_META_T(weight)))
    return eng_op_dispatch(ENG_OP_NLL_LOSS, &(eng_op_call){.name = op, .n_in = 3, .in = {x, target, weight},
                                                             .ints = {ignore_index, reduction, 0}});
  return eng_nll_loss_local(x, target, weight, ignore_index, reduction, NULL);
}

/* ============================================================ cross_entropy with class weights */
/* saved: 0 logits, 1 target (i64), 2 lse, 3 weight (host).  ints: 0 N, 1 C,
 * 2 inner, 3 ignore, 4 reduction (none / sum), 5 device.  scalars: 0
 * label_smoothing, 1 divisor. */
static int cew_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor *X = eng_node_saved(n, 0), *T = eng_node_saved(n, 1), *L = eng_node_saved(n, 2),
             *W = eng_node_saved(n, 3);
  if (!X || !T || !L || !W) return -1;
  if (!eng_node_needs_grad(n, 0) || !go[0]) return 0;
  int64_t N = n->ints[0], C = n->ints[1], inner = n->ints[2], ignore = n->ints[3];
  int red = (int)n->ints[4], cdt = X->dtype;
  eng_tensor *G = NULL, *gx = NULL;
  double gc;
  int rc = -1;
  if (upstream(go[0], red, n->scalars[1], cdt, &G, &gc)) goto done;
  if (!(gx = eng_new(X->ndim, X->shape, cdt, ENG_CPU))) goto done;
  const int64_t* t = (const int64_t*)eng_ptr(T);
  if (cdt == ENG_F32)
    kc_cross_entropy_w_bw_f32(N, C, inner, PTR(const float, X), t, ignore, n->scalars[0], PTR(const float, W),
                              PTR(const float, L), PTR(const float, G), gc, PTR(float, gx));
  else
    kc_cross_entropy_w_bw_f64(N, C, inner, PTR(const double, X), t, ignore, n->scalars[0], PTR(const double, W),
                              PTR(const double, L), PTR(const double, G), gc, PTR(double, gx));
  if (!(gx = finish(gx, cdt, (int)n->ints[5]))) goto done;
  rc = (gi[0] = eng_grad_to_input(n, 0, gx)) ? 0 : -1;
done:
  eng_tensor_release(G); eng_tensor_release(gx);
  return rc;
}

eng_tensor* eng_cross_entropy_weighted_local(eng_tensor* x, eng_tensor* target, eng_tensor* weight, int64_t ignore,
                                             int red, double eps, double* wsum_out) {
  const char* op = "cross_entropy";
  if (!eng_dtype_is_floating(x->dtype)) return eng_errp("%s: logits %s must be floating point", op, eng_desc(x));
  if (x->device != target->device || weight->device != x->device)
    return eng_errp("%s: logits %s, target %s and weight %s on different devices", op, eng_desc(x),
                    eng_desc(target), eng_desc(weight));
  int nd = x->ndim, cdim = nd == 1 ? 0 : 1;
  int64_t C = x->shape[cdim], N = nd == 1 ? 1 : x->shape[0], inner = 1;
  for (int d = 2; d < nd; d++) inner *= x->shape[d];
  int rdt = x->dtype, cdt = compute_dtype(rdt);
  eng_tensor *T = NULL, *X = NULL, *W = NULL, *L = NULL, *out = NULL;
  if (!(T = read_targets(op, target, C, ignore))) goto fail;
  if (!(X = eng_op_host(x, cdt)) || !(W = eng_op_host(weight, cdt))) goto fail;
  int64_t np = N * inner;
  if (!(L = eng_new(1, &np, cdt, ENG_CPU))) goto fail;
  double s = 0, ws = 0;
  if (red == RED_NONE) {
    int64_t ts[ENG_MAX_DIMS];
    int k = 0;
    for (int d = 0; d < nd; d++) if (d != cdim) ts[k++] = x->shape[d];
    if (!(out = eng_new(k, ts, cdt, ENG_CPU))) goto fail;
  }
  const int64_t* tg = (const int64_t*)eng_ptr(T);
  if (cdt == ENG_F32)
    kc_cross_entropy_w_f32(N, C, inner, PTR(const float, X), tg, ignore, eps, PTR(const float, W), PTR(float, out),
                           PTR(float, L), &s, &ws);
  else
    kc_cross_entropy_w_f64(N, C, inner, PTR(const double, X), tg, ignore, eps, PTR(const double, W),
                           PTR(double, out), PTR(double, L), &s, &ws);
  double divisor = red == RED_MEAN ? ws : 1.0;
  if (wsum_out) *wsum_out = ws;
  if (!out && !(out = eng_tensor_full(0, NULL, s / divisor, cdt, ENG_CPU))) goto fail;
  if (!(out = finish(out, rdt, x->device))) goto fail;
  if (eng_any_requires_grad(1, &x)) {
    eng_node* n = eng_record("CrossEntropyBackward", cew_bw, 1, &x, out);
    if (!n || eng_node_save(n, X) || eng_node_save(n, T) || eng_node_save(n, L) || eng_node_save(n, W)) goto fail;
    n->ints[0] = N; n->ints[1] = C; n->ints[2] = inner; n->ints[3] = ignore;
    n->ints[4] = red == RED_MEAN ? RED_SUM : red; n->ints[5] = x->device;
    n->scalars[0] = eps; n->scalars[1] = divisor;
  }
  eng_tensor_release(T); eng_tensor_release(X); eng_tensor_release(W); eng_tensor_release(L);
  return out;
fail:
  eng_tensor_release(T); eng_tensor_release(X); eng_tensor_release(W); eng_tensor_release(L);
  eng_tensor_release(out);
  return NULL;
}

eng_tensor* eng_cross_entropy_weighted(eng_tensor* logits, eng_tensor* target, eng_tensor* weight,
                                       int64_t ignore_index, int reduction, double label_smoothing) {
  const char* op = "cross_entropy";
  ENG_CHECK(logits, op); ENG_CHECK(target, op);
  if (!weight) return eng_cross_entropy(logits, target, ignore_index, reduction, label_smoothing);
  if (!(label_smoothing >= 0.0 && label_smoothing <= 1.0))
    return eng_errp("%s: label_smoothing must be between 0.0 and 1.0, got %g", op, label_smoothing);
  if (nll_args(op, logits, target, weight, reduction, 1)) return NULL;
  if (ENG_DT_ACTIVE(logits->dist || target->dist || weight->dist || ENG_META_T(logits) || ENG_META_T(target) ||
                    ENG_META_T(weight)))
    return eng_op_dispatch(ENG_OP_NLL_LOSS, &(eng_op_call){.name = op, .n_in = 3, .in = {logits, target, weight},
                                                             .ints = {ignore_index, reduction, 1},
                                                             .scalars = {label_smoothing}});
  return eng_cross_entropy_weighted_local(logits, target, weight, ignore_index, reduction, label_smoothing, NULL);
}

/* ============================================================ elementwise losses */
static const char* ploss_name(int kind) {
  switch (kind) {
    case KC_PL_BCE: return "binary_cross_entropy";
    case KC_PL_BCE_LOGITS: return "binary_cross_entropy_with_logits";
    case KC_PL_KL_DIV: case KC_PL_KL_DIV_LOG: return "kl_div";
    case KC_PL_SMOOTH_L1: return "smooth_l1_loss";
    default: return "huber_loss";
  }
}

/* saved: 0 x, 1 y, [w], [pw] (host, cdt).  ints: 0 kind, 1 reduction (none /
 * sum), 2 device, 3 has w, 4 has pw.  scalars: 0 param, 1 divisor. */
static int ploss_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  int hw = (int)n->ints[3], hp = (int)n->ints[4];
  eng_tensor *X = eng_node_saved(n, 0), *Y = eng_node_saved(n, 1);
  eng_tensor *W = hw ? eng_node_saved(n, 2) : NULL, *PW = hp ? eng_node_saved(n, 2 + hw) : NULL;
  if (!X || !Y || (hw && !W) || (hp && !PW)) return -1;
  int nx = eng_node_needs_grad(n, 0), ny = eng_node_needs_grad(n, 1);
  if ((!nx && !ny) || !go[0]) return 0;
  int kind = (int)n->ints[0], red = (int)n->ints[1], dev = (int)n->ints[2], cdt = X->dtype;
  eng_tensor *G = NULL, *gx = NULL, *gy = NULL;
  double gc;
  int rc = -1;
  if (upstream(go[0], red, n->scalars[1], cdt, &G, &gc)) goto done;
  if ((nx && !(gx = eng_new(X->ndim, X->shape, cdt, ENG_CPU))) || (ny && !(gy = eng_new(X->ndim, X->shape, cdt, ENG_CPU))))
    goto done;
  if (cdt == ENG_F32)
    kc_ploss_bw_f32(kind, X->numel, PTR(const float, X), PTR(const float, Y), PTR(const float, W),
                    PTR(const float, PW), n->scalars[0], PTR(const float, G), gc, PTR(float, gx), PTR(float, gy));
  else
    kc_ploss_bw_f64(kind, X->numel, PTR(const double, X), PTR(const double, Y), PTR(const double, W),
                    PTR(const double, PW), n->scalars[0], PTR(const double, G), gc, PTR(double, gx),
                    PTR(double, gy));
  if (nx) {
    if (!(gx = finish(gx, cdt, dev)) || !(gi[0] = eng_grad_to_input(n, 0, gx))) goto done;
  }
  if (ny) {
    if (!(gy = finish(gy, cdt, dev)) || !(gi[1] = eng_grad_to_input(n, 1, gy))) goto done;
  }
  rc = 0;
done:
  eng_tensor_release(G); eng_tensor_release(gx); eng_tensor_release(gy);
  return rc;
}

/* min / max of x (NaN propagates) for the range message. */
static void minmax(const eng_tensor* X, double* lo, double* hi) {
  double a = INFINITY, b = -INFINITY;
  for (int64_t i = 0; i < X->numel; i++) {
    double v = X->dtype == ENG_F32 ? ((const float*)eng_ptr((eng_tensor*)X))[i] : ((const double*)eng_ptr((eng_tensor*)X))[i];
    if (v != v) { a = b = v; break; }
    if (v < a) a = v;
    if (v > b) b = v;
  }
  *lo = a; *hi = b;
}

/* On local tensors: red none, or the sum divided by divisor (mean, batchmean,
 * sum as the caller computed it).  w / pw: x's shape. */
eng_tensor* eng_ploss_local(int kind, eng_tensor* x, eng_tensor* y, eng_tensor* w, eng_tensor* pw, int red,
                            double param, double divisor) {
  const char* op = ploss_name(kind);
  if (x->device != y->device || (w && w->device != x->device) || (pw && pw->device != x->device))
    return eng_errp("%s: input %s and target %s (and weights) on different devices", op, eng_desc(x), eng_desc(y));
  int rdt = x->dtype, cdt = compute_dtype(rdt);
  eng_tensor *X = NULL, *Y = NULL, *W = NULL, *PW = NULL, *out = NULL;
  if (!(X = eng_op_host(x, cdt)) || !(Y = eng_op_host(y, cdt)) || (w && !(W = eng_op_host(w, cdt))) ||
      (pw && !(PW = eng_op_host(pw, cdt))))
    goto fail;
  if (red == RED_NONE && !(out = eng_new(x->ndim, x->shape, cdt, ENG_CPU))) goto fail;
  double s = 0;
  int bad;
  if (cdt == ENG_F32)
    bad = kc_ploss_f32(kind, X->numel, PTR(const float, X), PTR(const float, Y), PTR(const float, W),
                       PTR(const float, PW), param, PTR(float, out), &s);
  else
    bad = kc_ploss_f64(kind, X->numel, PTR(const double, X), PTR(const double, Y), PTR(const double, W),
                       PTR(const double, PW), param, PTR(double, out), &s);
  if (bad) {
    double lo, hi;
    minmax(X, &lo, &hi);
    eng_errp("%s: all elements of input should be between 0 and 1 (got min %g, max %g)", op, lo, hi);
    goto fail;
  }
  if (!out && !(out = eng_tensor_full(0, NULL, s / divisor, cdt, ENG_CPU))) goto fail;
  if (!(out = finish(out, rdt, x->device))) goto fail;
  eng_tensor* ins[2] = {x, y};
  if (eng_any_requires_grad(2, ins)) {
    eng_node* n = eng_record("PointwiseLossBackward", ploss_bw, 2, ins, out);
    if (!n || eng_node_save(n, X) || eng_node_save(n, Y) || (W && eng_node_save(n, W)) ||
        (PW && eng_node_save(n, PW)))
      goto fail;
    n->ints[0] = kind; n->ints[1] = red == RED_NONE ? RED_NONE : RED_SUM; n->ints[2] = x->device;
    n->ints[3] = W != NULL; n->ints[4] = PW != NULL;
    n->scalars[0] = param; n->scalars[1] = divisor;
  }
  eng_tensor_release(X); eng_tensor_release(Y); eng_tensor_release(W); eng_tensor_release(PW);
  return out;
fail:
  eng_tensor_release(X); eng_tensor_release(Y); eng_tensor_release(W); eng_tensor_release(PW);
  eng_tensor_release(out);
  return NULL;
}

/* The divisor of a reduction over x's (global) shape. */
double eng_ploss_divisor(int red, int ndim, const int64_t* shape, int64_t numel) {
  if (red == RED_MEAN) return (double)numel;
  if (red == RED_BATCHMEAN) return ndim > 0 ? (double)shape[0] : 1.0;
  return 1.0;
}

static int same_shape(const eng_tensor* a, const eng_tensor* b) {
  if (a->ndim != b->ndim) return 0;
  const int64_t *sa = gsh(a), *sb = gsh(b);
  for (int d = 0; d < a->ndim; d++) if (sa[d] != sb[d]) return 0;
  return 1;
}

static eng_tensor* ploss(int kind, eng_tensor* x, eng_tensor* y, eng_tensor* w, eng_tensor* pw, int red,
                         double param) {
  const char* op = ploss_name(kind);
  ENG_CHECK(x, op); ENG_CHECK(y, op);
  if (eng_meta_check_local(x, op) || eng_meta_check_local(y, op)) return NULL;
  if (red < RED_NONE || red > (kind == KC_PL_KL_DIV || kind == KC_PL_KL_DIV_LOG ? RED_BATCHMEAN : RED_SUM))
    return eng_errp("%s: reduction code %d is invalid", op, red);
  if (!same_shape(x, y))
    return eng_errp("%s: target %s must have the input's shape %s", op, gdesc(y), gdesc(x));
  if (!eng_dtype_is_floating(x->dtype) || x->dtype != y->dtype)
    return eng_errp("%s: input %s and target %s must have the same floating-point dtype", op, gdesc(x), gdesc(y));
  eng_tensor *we = NULL, *pe = NULL, *r = NULL;
  if (w && !same_shape(w, x) && !(w = we = eng_expand(w, x->ndim, gsh(x)))) return NULL;
  if (pw && !same_shape(pw, x) && !(pw = pe = eng_expand(pw, x->ndim, gsh(x)))) {
    eng_tensor_release(we);
    return NULL;
  }
  if (ENG_DT_ACTIVE(x->dist || y->dist || (w && w->dist) || (pw && pw->dist) || ENG_META_T(x) || ENG_META_T(y) ||
                    ENG_META_T(w) || ENG_META_T(pw)))
    r = eng_op_dispatch(kind == KC_PL_BCE ? ENG_OP_PLOSS_CHECKED : ENG_OP_PLOSS,
                     &(eng_op_call){.name = op, .n_in = 4, .in = {x, y, w, pw}, .ints = {kind, red},
                                    .scalars = {param}});
  else
    r = eng_ploss_local(kind, x, y, w, pw, red == RED_NONE ? RED_NONE : RED_SUM, param,
                        eng_ploss_divisor(red, x->ndim, x->shape, x->numel));
  eng_tensor_release(we); eng_tensor_release(pe);
  return r;
}

eng_tensor* eng_binary_cross_entropy(eng_tensor* p, eng_tensor* target, eng_tensor* weight, int reduction) {
  return ploss(KC_PL_BCE, p, target, weight, NULL, reduction, 0.0);
}
eng_tensor* eng_binary_cross_entropy_with_logits(eng_tensor* x, eng_tensor* target, eng_tensor* weight,
                                                 eng_tensor* pos_weight, int reduction) {
  return ploss(KC_PL_BCE_LOGITS, x, target, weight, pos_weight, reduction, 0.0);
}
eng_tensor* eng_kl_div(eng_tensor* input, eng_tensor* target, int reduction, int log_target) {
  return ploss(log_target ? KC_PL_KL_DIV_LOG : KC_PL_KL_DIV, input, target, NULL, NULL, reduction, 0.0);
}
eng_tensor* eng_smooth_l1_loss(eng_tensor* x, eng_tensor* y, int reduction, double beta) {
  if (!(beta >= 0)) return eng_errp("smooth_l1_loss: beta must be non-negative, got %g", beta);
  return ploss(KC_PL_SMOOTH_L1, x, y, NULL, NULL, reduction, beta);
}
eng_tensor* eng_huber_loss(eng_tensor* x, eng_tensor* y, int reduction, double delta) {
  if (!(delta > 0)) return eng_errp("huber_loss: delta must be positive, got %g", delta);
  return ploss(KC_PL_HUBER, x, y, NULL, NULL, reduction, delta);
}
