/* math.c: more pointwise math with autograd (sin, cos, floor, ceil, round,
 * trunc, sign, erf, log1p, expm1, reciprocal, square, isnan, isinf,
 * isfinite, logical_not, nan_to_num; fmod, remainder, floor_divide,
 * logical_and, logical_or) and the composites clamp with tensor bounds,
 * lerp, addcmul, addcdiv (made of dispatching ops: DTensors follow those
 * ops' rules, autograd comes from them; bf16/f16 ones compute in f32 and
 * round once, as PyTorch's opmath).
 *
 * Kernels: kernels/cpu/math.c; on CUDA kernels/cuda/math.cu for floating
 * inputs (and logical_and/or of any dtype).  Integer CUDA tensors take a host
 * fallback (operands copied to the host, the CPU kernel, the result copied
 * back; it also detects integer division by zero).  Gradients are made of
 * dispatching ops (cos, mul, ...), so they run on the device. */
#include "core/internal.h"
#include "ops/ops.h"
#include "kernels/cpu/kcpu.h"
#include "kernels/cpu/kmath.h"
#include "ops/cuda_math.h"
#include "autograd/autograd.h"
#include "eng/ops_math.h"
#include "eng/ops_pointwise.h"
#include <math.h>

static const char* const mu_names[KM_UCOUNT] = {"sin", "cos", "floor", "ceil", "round", "trunc", "sign", "erf",
                                                "log1p", "expm1", "reciprocal", "square", "isnan", "isinf",
                                                "isfinite", "logical_not", "nan_to_num"};
static const char* const mu_bw_names[KM_UCOUNT] = {
    "SinBackward", "CosBackward", "FloorBackward", "CeilBackward", "RoundBackward", "TruncBackward",
    "SignBackward", "ErfBackward", "Log1pBackward", "Expm1Backward", "ReciprocalBackward", "SquareBackward",
    "", "", "", "", "NanToNumBackward"};
static const char* const mb_names[KM_BCOUNT] = {"fmod", "remainder", "floor_divide", "logical_and", "logical_or",
                                                "div"};

/* ------------------------------------------------------------ host fallback */
/* A CPU tensor with t's values (t itself for CPU tensors).  New reference. */
static eng_tensor* host_of(eng_tensor* t) {
  if (t->device != ENG_CUDA) return eng_tensor_retain(t);
  eng_tensor* d = eng_tensor_detach(t);
  eng_tensor* h = d ? eng_tensor_to_device(d, ENG_CPU) : NULL;
  eng_tensor_release(d);
  return h;
}
/* out moved to device (consumes out). */
static eng_tensor* to_dev(eng_tensor* out, int device) {
  if (!out || device != ENG_CUDA) return out;
  eng_tensor* r = eng_tensor_to_device(out, device);
  eng_tensor_release(out);
  return r;
}

static eng_tensor* rel(eng_tensor* keep, eng_tensor* a, eng_tensor* b) {
  eng_tensor_release(a);
  eng_tensor_release(b);
  return keep;
}

/* ------------------------------------------------------------ unary */
static int is_pred(int op) { return op == KM_ISNAN || op == KM_ISINF || op == KM_ISFINITE || op == KM_LNOT; }

static int mu_out_dtype(int op, int dt) {
  if (is_pred(op)) return ENG_BOOL;
  if (eng_dtype_is_floating(dt)) return dt;
  switch (op) {
    case KM_FLOOR: case KM_CEIL: case KM_ROUND: case KM_TRUNC: case KM_SIGN: case KM_NAN_TO_NUM: return dt;
    case KM_SQUARE: return dt == ENG_BOOL ? ENG_I64 : dt;
  }
  return ENG_F32;
}

typedef struct { int op, idt, odt; const double* p; } mrow_ctx;
static void mrow(int64_t n, char** p, const int64_t* s, void* vc) {
  mrow_ctx* c = vc;
  km_unary_row(c->op, c->idt, c->odt, n, p[0], s[0], p[1], s[1], c->p);
}

static eng_tensor* mu_fwd(int op, eng_tensor* a0, const double* prm) {
  if (a0->device == ENG_CUDA && eng_dtype_is_floating(a0->dtype)) {
    int odt = mu_out_dtype(op, a0->dtype);
    eng_tensor* out = eng_new(a0->ndim, a0->shape, odt, ENG_CUDA);
    if (out && eng_cu_math_unary(op, a0->dtype, odt, out->ndim, out->shape, eng_ptr(out), out->stride, eng_ptr(a0),
                                 a0->stride, prm, mu_names[op])) {
      eng_tensor_release(out);
      return NULL;
    }
    return out;
  }
  eng_tensor* a = host_of(a0);
  if (!a) return NULL;
  int odt = mu_out_dtype(op, a->dtype);
  eng_tensor* out = eng_new(a->ndim, a->shape, odt, ENG_CPU);
  if (out && out->numel > 0) {
    mrow_ctx c = {op, a->dtype, odt, prm};
    char* base[2] = {eng_ptr(out), eng_ptr(a)};
    const int64_t* st[2] = {out->stride, a->stride};
    int esz[2] = {eng_dtype_size(odt), eng_dtype_size(a->dtype)};
    kc_foreach_par(out->ndim, out->shape, 2, base, st, esz, mrow, &c);
  }
  eng_tensor_release(a);
  return to_dev(out, a0->device);
}

typedef eng_tensor* (*un_fn)(eng_tensor*);
/* f(t), releasing t. */
static eng_tensor* own(un_fn f, eng_tensor* t) {
  if (!t) return NULL;
  eng_tensor* r = f(t);
  eng_tensor_release(t);
  return r;
}
/* g * t, releasing t. */
static eng_tensor* mul_own(eng_tensor* g, eng_tensor* t) {
  if (!t) return NULL;
  eng_tensor* r = eng_mul(g, t);
  eng_tensor_release(t);
  return r;
}
static eng_tensor* scale_own(eng_tensor* t, double s) {
  if (!t) return NULL;
  eng_tensor* r = eng_mul_scalar(t, s);
  eng_tensor_release(t);
  return r;
}

static int mu_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  int op = (int)n->ints[0];
  eng_tensor* s = eng_node_saved(n, 0); /* x, or y for expm1 and reciprocal */
  eng_tensor* g = go[0];
  eng_tensor* r = NULL;
  if (!s) return -1;
  switch (op) {
    case KM_SIN: r = mul_own(g, eng_cos(s)); break;
    case KM_COS: r = mul_own(g, own(eng_neg, eng_sin(s))); break;
    case KM_ERF: r = mul_own(g, scale_own(own(eng_exp, own(eng_neg, eng_square(s))), 1.12837916709551257390)); break;
    case KM_LOG1P: {
      eng_tensor* d = eng_add_scalar(s, 1.0);
      r = d ? eng_div(g, d) : NULL;
      eng_tensor_release(d);
      break;
    }
    case KM_EXPM1: r = mul_own(g, eng_add_scalar(s, 1.0)); break;
    case KM_RECIP: r = mul_own(g, own(eng_neg, eng_square(s))); break;
    case KM_SQUARE: r = mul_own(g, eng_mul_scalar(s, 2.0)); break;
    case KM_NAN_TO_NUM: {
      eng_tensor* m = own(eng_logical_not, eng_isfinite(s));
      r = m ? eng_masked_fill(g, m, 0.0) : NULL;
      eng_tensor_release(m);
      break;
    }
    default: r = eng_tensor_zeros(g->ndim, g->shape, g->dtype, g->device); break; /* floor, ceil, round, trunc, sign */
  }
  if (!r) return -1;
  gi[0] = eng_grad_to_input(n, 0, r);
  eng_tensor_release(r);
  return gi[0] ? 0 : -1;
}

eng_tensor* eng_math_unary_op(int op, eng_tensor* a, const double* p) {
  const char* name = mu_names[op];
  ENG_CHECK(a, name);
  if (eng_meta_check(a, name)) return NULL;
  eng_tensor* out = mu_fwd(op, a, p);
  if (!out) return NULL;
  if (is_pred(op) || !eng_any_requires_grad(1, &a) || !eng_dtype_is_floating(out->dtype)) return out;
  eng_node* nd = eng_record(mu_bw_names[op], mu_bw, 1, &a, out);
  if (!nd) { eng_tensor_release(out); return NULL; }
  nd->ints[0] = op;
  if (eng_node_save(nd, (op == KM_EXPM1 || op == KM_RECIP) ? out : a)) { eng_tensor_release(out); return NULL; }
  return out;
}

static eng_tensor* mu(int op, eng_tensor* a, double p0, double p1, double p2) {
  ENG_CHECK(a, mu_names[op]);
  if (ENG_DT_ACTIVE(a->dist || ENG_META_T(a)))
    return eng_op_dispatch(ENG_OP_MATH_UNARY, &(eng_op_call){.name = mu_names[op], .n_in = 1, .in = {a},
                                                               .ints = {op}, .scalars = {p0, p1, p2}});
  double p[3] = {p0, p1, p2};
  return eng_math_unary_op(op, a, p);
}

eng_tensor* eng_sin(eng_tensor* a) { return mu(KM_SIN, a, 0, 0, 0); }
eng_tensor* eng_cos(eng_tensor* a) { return mu(KM_COS, a, 0, 0, 0); }
eng_tensor* eng_floor(eng_tensor* a) { return mu(KM_FLOOR, a, 0, 0, 0); }
eng_tensor* eng_ceil(eng_tensor* a) { return mu(KM_CEIL, a, 0, 0, 0); }
eng_tensor* eng_round(eng_tensor* a, int decimals) { return mu(KM_ROUND, a, decimals, 0, 0); }
eng_tensor* eng_trunc(eng_tensor* a) { return mu(KM_TRUNC, a, 0, 0, 0); }
eng_tensor* eng_sign(eng_tensor* a) { return mu(KM_SIGN, a, 0, 0, 0); }
eng_tensor* eng_erf(eng_tensor* a) { return mu(KM_ERF, a, 0, 0, 0); }
eng_tensor* eng_log1p(eng_tensor* a) { return mu(KM_LOG1P, a, 0, 0, 0); }
eng_tensor* eng_expm1(eng_tensor* a) { return mu(KM_EXPM1, a, 0, 0, 0); }
eng_tensor* eng_reciprocal(eng_tensor* a) { return mu(KM_RECIP, a, 0, 0, 0); }
eng_tensor* eng_square(eng_tensor* a) { return mu(KM_SQUARE, a, 0, 0, 0); }
eng_tensor* eng_isnan(eng_tensor* a) { return mu(KM_ISNAN, a, 0, 0, 0); }
eng_tensor* eng_isinf(eng_tensor* a) { return mu(KM_ISINF, a, 0, 0, 0); }
eng_tensor* eng_isfinite(eng_tensor* a) { return mu(KM_ISFINITE, a, 0, 0, 0); }
eng_tensor* eng_logical_not(eng_tensor* a) { return mu(KM_LNOT, a, 0, 0, 0); }
eng_tensor* eng_nan_to_num(eng_tensor* a, double nan, double posinf, double neginf) {
  if (isnan(nan)) nan = 0.0;
  return mu(KM_NAN_TO_NUM, a, nan, posinf, neginf);
}

/* ------------------------------------------------------------ binary */
typedef struct { int op, idt, odt; int64_t zeros; } mbrow_ctx;
static void mbrow(int64_t n, char** p, const int64_t* s, void* vc) {
  mbrow_ctx* c = vc;
  int64_t z = km_binary_row(c->op, c->idt, c->odt, n, p[0], s[0], p[1], s[1], p[2], s[2]);
  if (z) __atomic_fetch_add(&c->zeros, z, __ATOMIC_RELAXED);
}

static eng_tensor* mb_fwd(int op, eng_tensor* a0, eng_tensor* b0) {
  const char* name = mb_names[op];
  if (a0->device != b0->device)
    return eng_errp("%s: tensors on different devices: %s and %s", name, eng_desc(a0), eng_desc(b0));
  int rdt = eng_promote_types(a0->dtype, b0->dtype);
  int logical = op == KM_LAND || op == KM_LOR;
  if (!logical && rdt == ENG_BOOL)
    return eng_errp("%s: not supported for bool tensors (%s, %s); convert with :long() or :float() first", name,
                    eng_desc(a0), eng_desc(b0));
  int cdt = (rdt == ENG_BF16 || rdt == ENG_F16) ? ENG_F32 : rdt;
  int odt = logical ? ENG_BOOL : cdt;
  int64_t shape[ENG_MAX_DIMS];
  int nd = eng_broadcast_shapes(a0->ndim, a0->shape, b0->ndim, b0->shape, shape, name, a0, b0);
  if (nd < 0) return NULL;
  if (a0->device == ENG_CUDA && (logical || eng_dtype_is_floating(rdt))) {
    int ddt = rdt; /* the device kernels compute bf16/f16 in double and round */
    int dodt = logical ? ENG_BOOL : rdt;
    eng_tensor* A = eng_as_contig(a0, ddt);
    eng_tensor* B = A ? eng_as_contig(b0, ddt) : NULL;
    eng_tensor* out = B ? eng_new(nd, shape, dodt, ENG_CUDA) : NULL;
    if (out) {
      int64_t sa[ENG_MAX_DIMS], sb[ENG_MAX_DIMS];
      eng_broadcast_strides(A, nd, shape, sa);
      eng_broadcast_strides(B, nd, shape, sb);
      if (eng_cu_math_binary(op, ddt, dodt, nd, shape, eng_ptr(out), out->stride, eng_ptr(A), sa, eng_ptr(B), sb,
                             name)) {
        eng_tensor_release(out);
        out = NULL;
      }
    }
    eng_tensor_release(A); eng_tensor_release(B);
    return out;
  }
  eng_tensor* ah = host_of(a0);
  eng_tensor* bh = ah ? host_of(b0) : NULL;
  eng_tensor* A = bh ? (ah->dtype == cdt ? eng_tensor_retain(ah) : eng_as_contig(ah, cdt)) : NULL;
  eng_tensor* B = A ? (bh->dtype == cdt ? eng_tensor_retain(bh) : eng_as_contig(bh, cdt)) : NULL;
  eng_tensor* out = B ? eng_new(nd, shape, odt, ENG_CPU) : NULL;
  eng_tensor_release(ah); eng_tensor_release(bh);
  if (out && out->numel > 0) {
    int64_t sa[ENG_MAX_DIMS], sb[ENG_MAX_DIMS];
    eng_broadcast_strides(A, nd, shape, sa);
    eng_broadcast_strides(B, nd, shape, sb);
    mbrow_ctx c = {op, cdt, odt, 0};
    char* base[3] = {eng_ptr(out), eng_ptr(A), eng_ptr(B)};
    const int64_t* st[3] = {out->stride, sa, sb};
    int es = eng_dtype_size(cdt);
    int esz[3] = {eng_dtype_size(odt), es, es};
    kc_foreach_par(nd, shape, 3, base, st, esz, mbrow, &c);
    if (c.zeros) {
      eng_tensor_release(out);
      out = eng_errp("%s: ZeroDivisionError: integer division by zero (%s, %s: %lld zero divisor element(s))",
                     name, eng_desc(a0), eng_desc(b0), (long long)c.zeros);
    }
  }
  eng_tensor_release(A); eng_tensor_release(B);
  if (out && odt != rdt && !logical) { eng_tensor* r = eng_as_contig(out, rdt); eng_tensor_release(out); out = r; }
  return to_dev(out, a0->device);
}

/* fmod: da = g, db = -g trunc(a / b); remainder: db = -g floor(a / b). */
static int mb_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  int op = (int)n->ints[0];
  eng_tensor *a = eng_node_saved(n, 0), *b = eng_node_saved(n, 1);
  if (!a || !b) return -1;
  if (eng_node_needs_grad(n, 0)) {
    gi[0] = eng_grad_to_input(n, 0, go[0]);
    if (!gi[0]) return -1;
  }
  if (eng_node_needs_grad(n, 1)) {
    eng_tensor* q = op == KM_FMOD ? own(eng_trunc, eng_div(a, b)) : eng_floor_divide(a, b);
    eng_tensor* r = own(eng_neg, mul_own(go[0], q));
    if (!r) return -1;
    gi[1] = eng_grad_to_input(n, 1, r);
    eng_tensor_release(r);
    if (!gi[1]) return -1;
  }
  return 0;
}

eng_tensor* eng_math_binary_op(int op, eng_tensor* a, eng_tensor* b) {
  const char* name = mb_names[op];
  ENG_CHECK(a, name); ENG_CHECK(b, name);
  if (eng_meta_check(a, name) || eng_meta_check(b, name)) return NULL;
  eng_tensor* out = mb_fwd(op, a, b);
  if (!out) return NULL;
  eng_tensor* in[2] = {a, b};
  if ((op != KM_FMOD && op != KM_REMAINDER) || !eng_any_requires_grad(2, in) || !eng_dtype_is_floating(out->dtype))
    return out;
  eng_node* nd = eng_record(op == KM_FMOD ? "FmodBackward" : "RemainderBackward", mb_bw, 2, in, out);
  if (!nd) { eng_tensor_release(out); return NULL; }
  nd->ints[0] = op;
  if (eng_node_save(nd, a) || eng_node_save(nd, b)) { eng_tensor_release(out); return NULL; }
  return out;
}

static eng_tensor* mb(int op, eng_tensor* a, eng_tensor* b) {
  ENG_CHECK(a, mb_names[op]); ENG_CHECK(b, mb_names[op]);
  if (ENG_DT_ACTIVE(a->dist || ENG_META_T(a) || b->dist || ENG_META_T(b))) {
    int int_div = op != KM_LAND && op != KM_LOR && !eng_dtype_is_floating(eng_promote_types(a->dtype, b->dtype));
    return eng_op_dispatch(int_div ? ENG_OP_MATH_BINARY_INT : ENG_OP_MATH_BINARY,
                        &(eng_op_call){.name = mb_names[op], .n_in = 2, .in = {a, b}, .ints = {op}});
  }
  return eng_math_binary_op(op, a, b);
}
eng_tensor* eng_fmod(eng_tensor* a, eng_tensor* b) { return mb(KM_FMOD, a, b); }
eng_tensor* eng_remainder(eng_tensor* a, eng_tensor* b) { return mb(KM_REMAINDER, a, b); }
eng_tensor* eng_floor_divide(eng_tensor* a, eng_tensor* b) { return mb(KM_FLOORDIV, a, b); }
eng_tensor* eng_logical_and(eng_tensor* a, eng_tensor* b) { return mb(KM_LAND, a, b); }
eng_tensor* eng_logical_or(eng_tensor* a, eng_tensor* b) { return mb(KM_LOR, a, b); }

/* torch.div(a, b, rounding_mode=): 0 true division (eng_div), 1 "trunc" (toward zero), 2 "floor"
 * (floor_divide).  Integer operands stay integers with a rounding mode (an integer zero divisor is an
 * error); no gradient flows through a rounded quotient. */
eng_tensor* eng_div_rounding(eng_tensor* a, eng_tensor* b, int mode) {
  switch (mode) {
    case 0: return eng_div(a, b);
    case 1: return mb(KM_TRUNCDIV, a, b);
    case 2: return eng_floor_divide(a, b);
  }
  return eng_errp("div: rounding mode %d is not one of 0 (none), 1 (trunc), 2 (floor)", mode);
}

/* ------------------------------------------------------------ composites */
/* PyTorch's clamp(x, min, max) = min(max(x, min), max) with the gradient of
 * x where min <= x <= max, of min where x < min, of max where the result
 * would exceed max: where(x < lo, lo, x), then where(r > hi, hi, r). */
eng_tensor* eng_clamp_tensor(eng_tensor* a, eng_tensor* lo, eng_tensor* hi) {
  ENG_CHECK(a, "clamp");
  if (!lo && !hi) return eng_errp("clamp: %s: at least one of min and max must be given", eng_desc(a));
  eng_tensor* r = eng_tensor_retain(a);
  if (lo) {
    eng_tensor* m = eng_compare(r, lo, ENG_LT);
    eng_tensor* t = m ? eng_where(m, lo, r) : NULL;
    r = rel(t, m, r);
    if (!r) return NULL;
  }
  if (hi) {
    eng_tensor* m = eng_compare(r, hi, ENG_GT);
    eng_tensor* t = m ? eng_where(m, hi, r) : NULL;
    r = rel(t, m, r);
  }
  return r;
}

/* bf16/f16 composites compute in f32 and round once, as PyTorch's kernels do in their opmath type (each
 * step in bf16 would round every intermediate: addcdiv off by tens of ulps).  fn(in[0..n)) on f32 copies,
 * then the result cast to dt.  NULL when the inputs are not low precision (*done = 0). */
static eng_tensor* via_f32(eng_tensor* (*fn)(eng_tensor**, double, int), eng_tensor** in, int n, double v, int flag,
                           int* done) {
  int dt = in[0]->dtype;
  for (int i = 1; i < n; i++)
    if (in[i]->ndim > 0 || in[i]->dist) dt = eng_promote_types(dt, in[i]->dtype);
  *done = 0;
  if (dt != ENG_BF16 && dt != ENG_F16) return NULL;
  *done = 1;
  eng_tensor* up[4] = {NULL, NULL, NULL, NULL};
  eng_tensor* r = NULL;
  int ok = 1;
  for (int i = 0; i < n && ok; i++) ok = (up[i] = eng_tensor_to_dtype(in[i], ENG_F32)) != NULL;
  eng_tensor* r32 = ok ? fn(up, v, flag) : NULL;
  if (r32) r = eng_tensor_to_dtype(r32, dt);
  eng_tensor_release(r32);
  for (int i = 0; i < n; i++) eng_tensor_release(up[i]);
  return r;
}

static eng_tensor* lerp_impl(eng_tensor* a, eng_tensor* b, eng_tensor* w);
static eng_tensor* lerp_f32(eng_tensor** in, double v, int flag) {
  (void)v; (void)flag;
  return lerp_impl(in[0], in[1], in[2]);
}

eng_tensor* eng_lerp(eng_tensor* a, eng_tensor* b, eng_tensor* w) {
  ENG_CHECK(a, "lerp"); ENG_CHECK(b, "lerp"); ENG_CHECK(w, "lerp");
  int done;
  eng_tensor* r = via_f32(lerp_f32, (eng_tensor*[]){a, b, w}, 3, 0, 0, &done);
  if (done) return r;
  return lerp_impl(a, b, w);
}

static eng_tensor* lerp_impl(eng_tensor* a, eng_tensor* b, eng_tensor* w) {
  double wv;
  if (w->ndim == 0 && !w->dist && w->device == ENG_CPU && !w->requires_grad && !eng_tensor_item(w, &wv) &&
      fabs(wv) >= 0.5) {
    /* a number weight: PyTorch's second form b - (b - a)(1 - w) for |w| >= 0.5 (same gradients) */
    eng_tensor* d = eng_sub(b, a);
    eng_tensor* t = d ? eng_mul_scalar(d, 1.0 - wv) : NULL;
    eng_tensor* r = t ? eng_sub(b, t) : NULL;
    return rel(r, d, t);
  }
  eng_tensor* d = eng_sub(b, a);
  eng_tensor* t = d ? eng_mul(w, d) : NULL;
  eng_tensor* r = t ? eng_add(a, t) : NULL;
  return rel(r, d, t);
}

static eng_tensor* addc_impl(eng_tensor* a, eng_tensor* b, eng_tensor* c, double v, int div, const char* name);
static eng_tensor* addc_f32(eng_tensor** in, double v, int div) {
  return addc_impl(in[0], in[1], in[2], v, div, div ? "addcdiv" : "addcmul");
}
static eng_tensor* addc(eng_tensor* a, eng_tensor* b, eng_tensor* c, double v, int div, const char* name) {
  ENG_CHECK(a, name); ENG_CHECK(b, name); ENG_CHECK(c, name);
  int done;
  eng_tensor* r = via_f32(addc_f32, (eng_tensor*[]){a, b, c}, 3, v, div, &done);
  if (done) {
    if (!r) eng_err_prefix("%s", name);
    return r;
  }
  return addc_impl(a, b, c, v, div, name);
}
static eng_tensor* addc_impl(eng_tensor* a, eng_tensor* b, eng_tensor* c, double v, int div, const char* name) {
  eng_tensor* vb = v == 1.0 ? eng_tensor_retain(b) : eng_mul_scalar(b, v); /* PyTorch: a + (v*b) op c */
  eng_tensor* t = vb ? (div ? eng_div(vb, c) : eng_mul(vb, c)) : NULL;
  eng_tensor* r = t ? eng_add(a, t) : NULL;
  if (!r) eng_err_prefix("%s", name);
  return rel(r, vb, t);
}
eng_tensor* eng_addcmul(eng_tensor* a, eng_tensor* b, eng_tensor* c, double v) { return addc(a, b, c, v, 0, "addcmul"); }
eng_tensor* eng_addcdiv(eng_tensor* a, eng_tensor* b, eng_tensor* c, double v) { return addc(a, b, c, v, 1, "addcdiv"); }
