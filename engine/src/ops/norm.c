/* norm.c: layer_norm and rms_norm over the last n_norm dims, with fused
 * forward (saves per-row mean and rstd, in f64) and fused backward for x, weight and
 * bias.  f64 inputs compute in f64, everything else in f32 (weight and bias
 * are converted to the compute type; the output has x's dtype).  On CUDA,
 * bf16/f16 inputs whose weight and bias share their dtype run natively (the
 * kernels read and write the half type, f32 arithmetic, f32 mean/rstd; no
 * casts); add_layer_norm runs fused on CUDA for f32/bf16/f16. */
#include "core/internal.h"
#include "core/dispatch.h"
#include "kernels/cpu/kcpu.h"
#include "ops/cuda_ops.h"
#include "autograd/autograd.h"
#include "eng/ops_pointwise.h"
#include <math.h>

static int check_param(const char* op, const char* what, eng_tensor* x, int n_norm, eng_tensor* p) {
  if (!p) return 0;
  if (!eng_dtype_is_floating(p->dtype))
    return eng_err("%s: %s must be floating point, got %s", op, what, eng_desc(p));
  if (p->device != x->device) return eng_err("%s: %s %s and input %s are on different devices", op, what, eng_desc(p), eng_desc(x));
  int ok = p->ndim == n_norm;
  for (int d = 0; ok && d < n_norm; d++) ok = p->shape[d] == x->shape[x->ndim - n_norm + d];
  if (!ok)
    return eng_err("%s: %s %s does not match the normalized shape %s (the last %d dims of input %s)", op, what,
                   eng_desc(p), eng_shape_str(n_norm, x->shape + x->ndim - n_norm), n_norm, eng_desc(x));
  return 0;
}

/* The weight and bias gradients summed on the host in f64 (dw, db: n values each, NULL when not needed) as the
 * node's inputs first_slot and first_slot + 1 (their shapes and dtypes).  0 or -1. */
static int affine_grads(eng_node* nd, int first_slot, int64_t n, int cdt, int device, const double* dw,
                        const double* db, eng_tensor** gi) {
  for (int k = 0; k < 2; k++) {
    const double* acc = k == 0 ? dw : db;
    if (!acc) continue;
    int slot = first_slot + k;
    eng_tensor* t = eng_new(eng_node_in_ndim(nd, slot), eng_node_in_shape(nd, slot), cdt, device);
    if (!t) return -1;
    kc_convert(n, eng_ptr(t), cdt, acc, KC_F64);
    gi[slot] = eng_grad_to_input(nd, slot, t);
    eng_tensor_release(t);
    if (!gi[slot]) return -1;
  }
  return 0;
}

static int norm_bw(eng_node* nd, eng_tensor** go, eng_tensor** gi) {
  int rms = (int)nd->ints[0];
  int64_t m = nd->ints[1], n = nd->ints[2];
  int cdt = (int)nd->ints[3];
  eng_tensor *x = eng_node_saved(nd, 0), *w = eng_node_saved(nd, 1);
  eng_tensor *mean = eng_node_saved(nd, 2), *rstd = eng_node_saved(nd, 3);
  int has_w = (int)nd->ints[4];
  if (!x || !rstd || (!rms && !mean) || (has_w && !w)) return -1;
  int need_x = eng_node_needs_grad(nd, 0);
  int need_w = w && eng_node_needs_grad(nd, 1);
  int need_b = !rms && eng_node_needs_grad(nd, 2);
  eng_tensor *G = eng_as_contig(go[0], cdt), *X = eng_as_contig(x, cdt);
  eng_tensor* W = w ? eng_as_contig(w, cdt) : NULL;
  eng_tensor* dx = need_x ? eng_new(x->ndim, x->shape, cdt, x->device) : NULL;
  double* dw = need_w ? calloc((size_t)(n > 0 ? n : 1), sizeof(double)) : NULL;
  double* db = need_b ? calloc((size_t)(n > 0 ? n : 1), sizeof(double)) : NULL;
  int rc = -1;
  if ((need_w && !dw) || (need_b && !db)) { eng_err("%s: out of memory", nd->name); goto done; }
  if (!G || !X || (w && !W) || (need_x && !dx)) goto done;
  if (x->device == ENG_CUDA) { /* dw, db written (not accumulated) by the kernel, in cdt */
    eng_tensor* dwt = need_w ? eng_new(eng_node_in_ndim(nd, 1), eng_node_in_shape(nd, 1), cdt, x->device) : NULL;
    eng_tensor* dbt = need_b ? eng_new(eng_node_in_ndim(nd, 2), eng_node_in_shape(nd, 2), cdt, x->device) : NULL;
    int ok = (!need_w || dwt) && (!need_b || dbt) && eng_cu_same_device(nd->name, x, go[0]) == 0 &&
             eng_cu_norm_bwd(cdt, rms, m, n, eng_ptr(G), eng_ptr(X), W ? eng_ptr(W) : NULL,
                             rms ? NULL : eng_ptr(mean), eng_ptr(rstd), NULL, dx ? eng_ptr(dx) : NULL,
                             dwt ? eng_ptr(dwt) : NULL, dbt ? eng_ptr(dbt) : NULL, nd->name) == 0;
    if (ok && need_x) ok = (gi[0] = eng_grad_to_input(nd, 0, dx)) != NULL;
    if (ok && need_w) ok = (gi[1] = eng_grad_to_input(nd, 1, dwt)) != NULL;
    if (ok && need_b) ok = (gi[2] = eng_grad_to_input(nd, 2, dbt)) != NULL;
    eng_tensor_release(dwt); eng_tensor_release(dbt);
    if (ok) rc = 0;
    goto done;
  }
  kc_norm_bwd(cdt, rms, m, n, eng_ptr(G), eng_ptr(X), W ? eng_ptr(W) : NULL,
              rms ? NULL : (const double*)eng_ptr(mean), (const double*)eng_ptr(rstd), dx ? eng_ptr(dx) : NULL, dw, db);
  if (need_x) { gi[0] = eng_grad_to_input(nd, 0, dx); if (!gi[0]) goto done; }
  if (affine_grads(nd, 1, n, cdt, x->device, dw, db, gi)) goto done;
  rc = 0;
done:
  eng_tensor_release(G); eng_tensor_release(X); eng_tensor_release(W); eng_tensor_release(dx);
  free(dw); free(db);
  return rc;
}

static eng_tensor* norm(const char* op, int rms, eng_tensor* x, int n_norm, eng_tensor* w, eng_tensor* b,
                        double eps) {
  ENG_CHECK(x, op);
  if (eng_meta_check_local(x, op)) return NULL;
  if (eng_meta_check_local(w, op)) return NULL;
  if (eng_meta_check_local(b, op)) return NULL;
  if (!eng_dtype_is_floating(x->dtype)) return eng_errp("%s: expects a floating point input, got %s", op, eng_desc(x));
  if (n_norm < 1 || n_norm > x->ndim)
    return eng_errp("%s: cannot normalize over the last %d dims of input %s (need 1 to %d)", op, n_norm,
                    eng_desc(x), x->ndim);
  if (!(eps >= 0.0) || !isfinite(eps)) return eng_errp("%s: eps must be finite and >= 0, got %g", op, eps);
  if (ENG_DT_ACTIVE(x->dist || ENG_META_T(x) || ((w && w->dist) || ENG_META_T(w)) || ((b && b->dist) || ENG_META_T(b))))
    return eng_op_dispatch(ENG_OP_NORM, &(eng_op_call){.name = op, .n_in = 3, .in = {x, w, b}, .ints = {n_norm, rms}, .scalars = {eps}});
  if (check_param(op, "weight", x, n_norm, w) || check_param(op, "bias", x, n_norm, b)) return NULL;
  int cdt = x->dtype == ENG_F64 ? ENG_F64 : ENG_F32;
  if (x->device == ENG_CUDA && (x->dtype == ENG_BF16 || x->dtype == ENG_F16) && (!w || w->dtype == x->dtype) &&
      (!b || b->dtype == x->dtype))
    cdt = x->dtype; /* the half-precision kernels: no casts */
  int64_t n = 1, m = 1;
  for (int d = 0; d < x->ndim; d++) { if (d < x->ndim - n_norm) m *= x->shape[d]; else n *= x->shape[d]; }
  eng_tensor *X = eng_as_contig(x, cdt), *W = w ? eng_as_contig(w, cdt) : NULL, *B = b ? eng_as_contig(b, cdt) : NULL;
  eng_tensor* y = eng_new(x->ndim, x->shape, cdt, x->device);
  int sdt = x->device == ENG_CUDA && cdt != ENG_F64 ? ENG_F32 : ENG_F64; /* the CUDA kernels save f32 stats */
  eng_tensor* mean = rms ? NULL : eng_new(1, &m, sdt, x->device);
  eng_tensor* rstd = eng_new(1, &m, sdt, x->device);
  eng_tensor* out = NULL;
  if (!X || (w && !W) || (b && !B) || !y || (!rms && !mean) || !rstd) goto done;
  if (x->device == ENG_CUDA) {
    if (eng_cu_norm_fwd(cdt, rms, m, n, eng_ptr(X), NULL, NULL, W ? eng_ptr(W) : NULL, B ? eng_ptr(B) : NULL, eps,
                        eng_ptr(y), mean ? eng_ptr(mean) : NULL, eng_ptr(rstd), op))
      goto done;
  } else {
    kc_norm_fwd(cdt, rms, m, n, eng_ptr(X), W ? eng_ptr(W) : NULL, B ? eng_ptr(B) : NULL, eps, eng_ptr(y),
                mean ? (double*)eng_ptr(mean) : NULL, (double*)eng_ptr(rstd));
  }
  out = cdt == x->dtype ? eng_tensor_retain(y) : eng_as_contig(y, x->dtype);
  if (!out) goto done;
  eng_tensor* in[3] = {x, w, b};
  int nin = rms ? 2 : 3;
  if (eng_any_requires_grad(nin, in)) {
    eng_node* nd = eng_record(rms ? "RmsNormBackward" : "LayerNormBackward", norm_bw, nin, in, out);
    if (!nd || eng_node_save(nd, x) || eng_node_save(nd, w) || eng_node_save(nd, mean) || eng_node_save(nd, rstd)) {
      eng_tensor_release(out); out = NULL; goto done;
    }
    nd->ints[0] = rms; nd->ints[1] = m; nd->ints[2] = n; nd->ints[3] = cdt; nd->ints[4] = w != NULL;
  }
done:
  eng_tensor_release(X); eng_tensor_release(W); eng_tensor_release(B); eng_tensor_release(y);
  eng_tensor_release(mean); eng_tensor_release(rstd);
  return out;
}

eng_tensor* eng_layer_norm(eng_tensor* x, int n_norm, eng_tensor* weight, eng_tensor* bias, double eps) {
  return norm("layer_norm", 0, x, n_norm, weight, bias, eps);
}

eng_tensor* eng_rms_norm(eng_tensor* x, int n_norm, eng_tensor* weight, double eps) {
  return norm("rms_norm", 1, x, n_norm, weight, NULL, eps);
}

/* ------------------------------------------------------------------ add + layer_norm */
/* h = x + r and y = layer_norm(h) as one op (the pre-norm block's residual
 * add and the norm after it): one pass over the rows forward; backward adds
 * h's gradient from its other uses (go[0]) into the norm's input gradient in
 * the same pass, and gives that sum to x and r.  saved: 0 h, 1 w, 2 mean,
 * 3 rstd; inputs 0 x, 1 r, 2 w, 3 b; outputs 0 h, 1 y; ints as norm_bw. */
static int add_norm_bw(eng_node* nd, eng_tensor** go, eng_tensor** gi) {
  int64_t m = nd->ints[1], n = nd->ints[2];
  int cdt = (int)nd->ints[3];
  eng_tensor *h = eng_node_saved(nd, 0), *w = eng_node_saved(nd, 1);
  eng_tensor *mean = eng_node_saved(nd, 2), *rstd = eng_node_saved(nd, 3);
  if (!h || !mean || !rstd || (nd->ints[4] && !w)) return -1;
  int need_x = eng_node_needs_grad(nd, 0), need_r = eng_node_needs_grad(nd, 1);
  int need_w = w && eng_node_needs_grad(nd, 2), need_b = eng_node_needs_grad(nd, 3);
  if (!go[1]) { /* only h's gradient: the add's backward */
    if (need_x && !(gi[0] = eng_grad_to_input(nd, 0, go[0]))) return -1;
    if (need_r && !(gi[1] = eng_grad_to_input(nd, 1, go[0]))) return -1;
    return 0;
  }
  eng_tensor *G = eng_as_contig(go[1], cdt), *R = go[0] ? eng_as_contig(go[0], cdt) : NULL;
  eng_tensor* W = w ? eng_as_contig(w, cdt) : NULL;
  eng_tensor* dx = need_x || need_r ? eng_new(h->ndim, h->shape, cdt, h->device) : NULL;
  double* dw = need_w ? calloc((size_t)(n > 0 ? n : 1), sizeof(double)) : NULL;
  double* db = need_b ? calloc((size_t)(n > 0 ? n : 1), sizeof(double)) : NULL;
  int rc = -1;
  if ((need_w && !dw) || (need_b && !db)) { eng_err("%s: out of memory", nd->name); goto done; }
  if (!G || (go[0] && !R) || (w && !W) || ((need_x || need_r) && !dx)) goto done;
  if (h->device == ENG_CUDA) { /* dw, db written in cdt by the kernel */
    eng_tensor* dwt = need_w ? eng_new(eng_node_in_ndim(nd, 2), eng_node_in_shape(nd, 2), cdt, h->device) : NULL;
    eng_tensor* dbt = need_b ? eng_new(eng_node_in_ndim(nd, 3), eng_node_in_shape(nd, 3), cdt, h->device) : NULL;
    int ok = (!need_w || dwt) && (!need_b || dbt) && eng_cu_same_device(nd->name, h, go[1]) == 0 &&
             eng_cu_norm_bwd(cdt, 0, m, n, eng_ptr(G), eng_ptr(h), W ? eng_ptr(W) : NULL, eng_ptr(mean),
                             eng_ptr(rstd), R && dx ? eng_ptr(R) : NULL, dx ? eng_ptr(dx) : NULL,
                             dwt ? eng_ptr(dwt) : NULL, dbt ? eng_ptr(dbt) : NULL, nd->name) == 0;
    if (ok && need_x) ok = (gi[0] = eng_grad_to_input(nd, 0, dx)) != NULL;
    if (ok && need_r) ok = (gi[1] = eng_grad_to_input(nd, 1, dx)) != NULL;
    if (ok && need_w) ok = (gi[2] = eng_grad_to_input(nd, 2, dwt)) != NULL;
    if (ok && need_b) ok = (gi[3] = eng_grad_to_input(nd, 3, dbt)) != NULL;
    eng_tensor_release(dwt); eng_tensor_release(dbt);
    if (ok) rc = 0;
    goto done;
  }
  kc_norm_bwd_res(cdt, 0, m, n, eng_ptr(G), eng_ptr(h), W ? eng_ptr(W) : NULL, (const double*)eng_ptr(mean),
                  (const double*)eng_ptr(rstd), R ? eng_ptr(R) : NULL, dx ? eng_ptr(dx) : NULL, dw, db);
  if (need_x && !(gi[0] = eng_grad_to_input(nd, 0, dx))) goto done;
  if (need_r && !(gi[1] = eng_grad_to_input(nd, 1, dx))) goto done;
  if (affine_grads(nd, 2, n, cdt, h->device, dw, db, gi)) goto done;
  rc = 0;
done:
  eng_tensor_release(G); eng_tensor_release(R); eng_tensor_release(W); eng_tensor_release(dx);
  free(dw); free(db);
  return rc;
}

eng_tensor* eng_add_layer_norm(eng_tensor* x, eng_tensor* r, int n_norm, eng_tensor* weight, eng_tensor* bias,
                               double eps, eng_tensor** sum) {
  const char* op = "add_layer_norm";
  ENG_CHECK(x, op); ENG_CHECK(r, op);
  if (!sum) return eng_errp("%s: sum (the output h = x + r) must not be NULL", op);
  *sum = NULL;
  /* CPU: f32/f64 (f64 stats); CUDA: f32/bf16/f16 in their dtype (f32 stats) */
  int cuda = x->device == ENG_CUDA;
  int fused = ((x->device == ENG_CPU && (x->dtype == ENG_F32 || x->dtype == ENG_F64)) ||
               (cuda && (x->dtype == ENG_F32 || x->dtype == ENG_BF16 || x->dtype == ENG_F16))) &&
              r->device == x->device && !x->dist && !r->dist && r->dtype == x->dtype && eng_same_shape(x, r) &&
              n_norm >= 1 && n_norm <= x->ndim && eps >= 0.0 && isfinite(eps);
  eng_tensor* p[2] = {weight, bias};
  for (int k = 0; k < 2; k++)
    if (p[k] && (p[k]->device != x->device || p[k]->dist || p[k]->dtype != x->dtype)) fused = 0;
  if (!fused) { /* the composition: its ops check, dispatch DTensors and run other devices */
    eng_tensor* h = eng_add(x, r);
    if (!h) return NULL;
    eng_tensor* y = eng_layer_norm(h, n_norm, weight, bias, eps);
    if (!y) { eng_tensor_release(h); return NULL; }
    *sum = h;
    return y;
  }
  if (check_param(op, "weight", x, n_norm, weight) || check_param(op, "bias", x, n_norm, bias)) return NULL;
  int cdt = x->dtype;
  int64_t n = 1, m = 1;
  for (int d = 0; d < x->ndim; d++) { if (d < x->ndim - n_norm) m *= x->shape[d]; else n *= x->shape[d]; }
  eng_tensor *X = eng_as_contig(x, cdt), *R = eng_as_contig(r, cdt);
  eng_tensor *W = weight ? eng_as_contig(weight, cdt) : NULL, *B = bias ? eng_as_contig(bias, cdt) : NULL;
  eng_tensor* h = eng_new(x->ndim, x->shape, cdt, x->device);
  eng_tensor* y = eng_new(x->ndim, x->shape, cdt, x->device);
  eng_tensor* mean = eng_new(1, &m, cuda ? ENG_F32 : ENG_F64, x->device);
  eng_tensor* rstd = eng_new(1, &m, cuda ? ENG_F32 : ENG_F64, x->device);
  int ok = 0;
  if (!X || !R || (weight && !W) || (bias && !B) || !h || !y || !mean || !rstd) goto done;
  if (cuda) {
    if (eng_cu_norm_fwd(cdt, 0, m, n, eng_ptr(X), eng_ptr(R), eng_ptr(h), W ? eng_ptr(W) : NULL,
                        B ? eng_ptr(B) : NULL, eps, eng_ptr(y), eng_ptr(mean), eng_ptr(rstd), op))
      goto done;
  } else {
    kc_add_norm_fwd(cdt, 0, m, n, eng_ptr(X), eng_ptr(R), eng_ptr(h), W ? eng_ptr(W) : NULL, B ? eng_ptr(B) : NULL,
                    eps, eng_ptr(y), (double*)eng_ptr(mean), (double*)eng_ptr(rstd));
  }
  eng_tensor* in[4] = {x, r, weight, bias};
  if (eng_any_requires_grad(4, in)) {
    eng_tensor* outs[2] = {h, y};
    eng_node* nd = eng_record_multi("AddLayerNormBackward", add_norm_bw, 4, in, 2, outs);
    if (!nd || eng_node_save(nd, h) || eng_node_save(nd, weight) || eng_node_save(nd, mean) ||
        eng_node_save(nd, rstd))
      goto done;
    nd->ints[0] = 0; nd->ints[1] = m; nd->ints[2] = n; nd->ints[3] = cdt; nd->ints[4] = weight != NULL;
  }
  ok = 1;
done:
  eng_tensor_release(X); eng_tensor_release(R); eng_tensor_release(W); eng_tensor_release(B);
  eng_tensor_release(mean); eng_tensor_release(rstd);
  if (!ok) { eng_tensor_release(h); eng_tensor_release(y); return NULL; }
  *sum = h;
  return y;
}
