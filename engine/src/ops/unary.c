/* unary.c: elementwise unary ops (neg, exp, log, sqrt, rsqrt, abs, tanh,
 * sigmoid, relu, gelu, silu, clamp, leaky_relu, elu, hardtanh, softplus)
 * with autograd.
 * Floating inputs keep their dtype (bf16/f16 compute in f32); integer inputs
 * of the float-only functions are promoted to f32 as in PyTorch; neg, abs,
 * relu and clamp with integral bounds keep integer dtypes. */
#include "core/internal.h"
#include "core/dispatch.h"
#include "kernels/cpu/kcpu.h"
#include "ops/cuda_ops.h"
#include "autograd/autograd.h"
#include <math.h>

static const char* const u_names[KU_COUNT] = {"neg", "exp", "log", "sqrt", "rsqrt", "abs", "tanh",
                                              "sigmoid", "relu", "gelu", "gelu", "silu", "clamp",
                                              "leaky_relu", "elu", "hardtanh", "softplus"};
static const char* const u_bw_names[KU_COUNT] = {
    "NegBackward", "ExpBackward", "LogBackward", "SqrtBackward", "RsqrtBackward", "AbsBackward",
    "TanhBackward", "SigmoidBackward", "ReluBackward", "GeluBackward", "GeluBackward", "SiluBackward",
    "ClampBackward", "LeakyReluBackward", "EluBackward", "HardtanhBackward", "SoftplusBackward"};
/* What backward needs: 1 = the input x, 2 = the output y. */
static const int u_saves[KU_COUNT] = {0, 2, 1, 2, 2, 1, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1};

static int int_capable(int op) { return op == KU_NEG || op == KU_ABS || op == KU_RELU || op == KU_CLAMP; }

static int compute_dtype(int dt) { return (dt == ENG_BF16 || dt == ENG_F16) ? ENG_F32 : dt; }

typedef struct { int op, dt; double p0, p1; } urow_ctx;
static void urow(int64_t n, char** p, const int64_t* s, void* vc) {
  urow_ctx* c = vc;
  kc_unary_row(c->op, c->dt, n, p[0], s[0], p[1], s[1], c->p0, c->p1);
}

/* Forward without autograd. */
static eng_tensor* unary_fwd(int op, eng_tensor* a, double p0, double p1) {
  const char* name = u_names[op];
  ENG_CHECK(a, name);
  int rdt = a->dtype;
  if (!eng_dtype_is_floating(rdt)) {
    if (int_capable(op)) {
      if (rdt == ENG_BOOL)
        return eng_errp("%s: not supported for bool tensors (%s); convert with :long() or :float() first",
                        name, eng_desc(a));
      if (op == KU_CLAMP && ((!isnan(p0) && p0 != floor(p0)) || (!isnan(p1) && p1 != floor(p1))))
        rdt = ENG_F32; /* float bound on an integer tensor: float result (PyTorch promotion) */
    } else {
      rdt = ENG_F32;
    }
  }
  int cdt = a->device == ENG_CUDA ? rdt : compute_dtype(rdt); /* the CUDA kernels take bf16/f16 as is */
  eng_tensor* A = a->dtype == cdt ? eng_tensor_retain(a) : eng_as_contig(a, cdt);
  if (!A) return NULL;
  eng_tensor* out = eng_new(a->ndim, a->shape, cdt, a->device);
  if (out && out->numel > 0 && a->device == ENG_CUDA) {
    if (eng_cu_unary(op, cdt, out->ndim, out->shape, eng_ptr(out), out->stride, eng_ptr(A), A->stride, p0, p1, name)) {
      eng_tensor_release(out);
      out = NULL;
    }
  } else if (out && out->numel > 0) {
    int es = eng_dtype_size(cdt);
    urow_ctx c = {op, cdt, p0, p1};
    char* base[2] = {eng_ptr(out), eng_ptr(A)};
    const int64_t* st[2] = {out->stride, A->stride};
    int esz[2] = {es, es};
    kc_foreach_par(out->ndim, out->shape, 2, base, st, esz, urow, &c);
  }
  eng_tensor_release(A);
  if (out && rdt != cdt) { eng_tensor* r = eng_as_contig(out, rdt); eng_tensor_release(out); out = r; }
  return out;
}

/* ------------------------------------------------------------ backward */
typedef struct { int op, dt; double p0, p1; } grow_ctx;
static void grow(int64_t n, char** p, const int64_t* s, void* vc) {
  grow_ctx* c = vc;
  kc_unary_grad_row(c->op, c->dt, n, p[0], s[0], p[1], s[1], p[2], s[2], p[3], s[3], c->p0, c->p1);
}

/* gi = g * f'(x) (x, y = f(x) as needed by op; NULL where unused).  No autograd. */
static eng_tensor* unary_grad(int op, eng_tensor* g, eng_tensor* x, eng_tensor* y, double p0, double p1) {
  int cdt = g->device == ENG_CUDA ? g->dtype : compute_dtype(g->dtype);
  if (!eng_dtype_is_floating(cdt)) cdt = ENG_F32;
  if ((x && eng_cu_same_device(u_bw_names[op], g, x)) || (y && eng_cu_same_device(u_bw_names[op], g, y))) return NULL;
  eng_tensor* G = g->dtype == cdt ? eng_tensor_retain(g) : eng_as_contig(g, cdt);
  eng_tensor* X = x ? (x->dtype == cdt ? eng_tensor_retain(x) : eng_as_contig(x, cdt)) : NULL;
  eng_tensor* Y = y ? (y->dtype == cdt ? eng_tensor_retain(y) : eng_as_contig(y, cdt)) : NULL;
  eng_tensor* out = NULL;
  if (G && (!x || X) && (!y || Y)) out = eng_new(g->ndim, g->shape, cdt, g->device);
  if (out && out->numel > 0 && g->device == ENG_CUDA) {
    eng_tensor* xs = X ? X : G;
    eng_tensor* ys = Y ? Y : G;
    if (eng_cu_unary_grad(op, cdt, out->ndim, out->shape, eng_ptr(out), out->stride, eng_ptr(G), G->stride,
                          eng_ptr(xs), xs->stride, eng_ptr(ys), ys->stride, p0, p1, u_bw_names[op])) {
      eng_tensor_release(out);
      out = NULL;
    }
  } else if (out && out->numel > 0) {
    eng_tensor* xs = X ? X : G;
    eng_tensor* ys = Y ? Y : G;
    int es = eng_dtype_size(cdt);
    grow_ctx c = {op, cdt, p0, p1};
    char* base[4] = {eng_ptr(out), eng_ptr(G), eng_ptr(xs), eng_ptr(ys)};
    const int64_t* st[4] = {out->stride, G->stride, xs->stride, ys->stride};
    int esz[4] = {es, es, es, es};
    kc_foreach_par(out->ndim, out->shape, 4, base, st, esz, grow, &c);
  }
  eng_tensor_release(G); eng_tensor_release(X); eng_tensor_release(Y);
  return out;
}

static int unary_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  int op = (int)n->ints[0];
  int sv = u_saves[op];
  eng_tensor *x = NULL, *y = NULL;
  if (sv) {
    eng_tensor* s = eng_node_saved(n, 0);
    if (!s) return -1;
    if (sv == 1) x = s; else y = s;
  }
  eng_tensor* r = unary_grad(op, go[0], x, y, n->scalars[0], n->scalars[1]);
  if (!r) return -1;
  gi[0] = eng_grad_to_input(n, 0, r);
  eng_tensor_release(r);
  return gi[0] ? 0 : -1;
}

static eng_tensor* unary(int op, eng_tensor* a, double p0, double p1) {
  if (eng_meta_check(a, u_names[op])) return NULL;
  eng_tensor* out = unary_fwd(op, a, p0, p1);
  if (!out) return NULL;
  if (!eng_any_requires_grad(1, &a) || !eng_dtype_is_floating(out->dtype)) return out;
  eng_node* nd = eng_record(u_bw_names[op], unary_bw, 1, &a, out);
  if (!nd) { eng_tensor_release(out); return NULL; }
  nd->ints[0] = op;
  nd->scalars[0] = p0; nd->scalars[1] = p1;
  int sv = u_saves[op];
  if (sv && eng_node_save(nd, sv == 1 ? a : out)) { eng_tensor_release(out); return NULL; }
  return out;
}

/* DTensor arguments go through the dispatcher (sharding/pointwise.c). */
#define UN_GUARD(which, nm, a, i1, p0, p1)                                                       \
  if (a && ENG_DT_ACTIVE(a->dist || ENG_META_T(a)))                                                                 \
    return eng_op_dispatch(ENG_OP_UNARY, &(eng_op_call){.name = nm, .n_in = 1, .in = {a}, .ints = {which, i1}, .scalars = {p0, p1}})

eng_tensor* eng_neg(eng_tensor* a) { UN_GUARD(ENG_UN_NEG, "neg", a, 0, NAN, NAN); return unary(KU_NEG, a, NAN, NAN); }
eng_tensor* eng_exp(eng_tensor* a) { UN_GUARD(ENG_UN_EXP, "exp", a, 0, NAN, NAN); return unary(KU_EXP, a, NAN, NAN); }
eng_tensor* eng_log(eng_tensor* a) { UN_GUARD(ENG_UN_LOG, "log", a, 0, NAN, NAN); return unary(KU_LOG, a, NAN, NAN); }
eng_tensor* eng_sqrt(eng_tensor* a) { UN_GUARD(ENG_UN_SQRT, "sqrt", a, 0, NAN, NAN); return unary(KU_SQRT, a, NAN, NAN); }
eng_tensor* eng_rsqrt(eng_tensor* a) { UN_GUARD(ENG_UN_RSQRT, "rsqrt", a, 0, NAN, NAN); return unary(KU_RSQRT, a, NAN, NAN); }
eng_tensor* eng_abs(eng_tensor* a) { UN_GUARD(ENG_UN_ABS, "abs", a, 0, NAN, NAN); return unary(KU_ABS, a, NAN, NAN); }
eng_tensor* eng_tanh(eng_tensor* a) { UN_GUARD(ENG_UN_TANH, "tanh", a, 0, NAN, NAN); return unary(KU_TANH, a, NAN, NAN); }
eng_tensor* eng_sigmoid(eng_tensor* a) { UN_GUARD(ENG_UN_SIGMOID, "sigmoid", a, 0, NAN, NAN); return unary(KU_SIGMOID, a, NAN, NAN); }
eng_tensor* eng_relu(eng_tensor* a) { UN_GUARD(ENG_UN_RELU, "relu", a, 0, NAN, NAN); return unary(KU_RELU, a, NAN, NAN); }
eng_tensor* eng_silu(eng_tensor* a) { UN_GUARD(ENG_UN_SILU, "silu", a, 0, NAN, NAN); return unary(KU_SILU, a, NAN, NAN); }

eng_tensor* eng_gelu(eng_tensor* a, int approximate) {
  if (approximate != 0 && approximate != 1)
    return eng_errp("gelu: approximate must be 0 (exact, erf) or 1 (tanh), got %d", approximate);
  UN_GUARD(ENG_UN_GELU, "gelu", a, approximate, NAN, NAN);
  return unary(approximate ? KU_GELU_TANH : KU_GELU, a, NAN, NAN);
}

eng_tensor* eng_clamp(eng_tensor* a, double lo, double hi) {
  ENG_CHECK(a, "clamp");
  if (isnan(lo) && isnan(hi))
    return eng_errp("clamp: %s: at least one of min and max must be given (both are NaN/nil)", eng_desc(a));
  UN_GUARD(ENG_UN_CLAMP, "clamp", a, 0, lo, hi);
  return unary(KU_CLAMP, a, lo, hi);
}

/* Activations of torch.nn.functional with their scalar parameters (PyTorch's
 * forward and *_backward formulas: kernels/cpu/unary.c). */
eng_tensor* eng_leaky_relu(eng_tensor* a, double negative_slope) {
  UN_GUARD(ENG_UN_LEAKY_RELU, "leaky_relu", a, 0, negative_slope, NAN);
  return unary(KU_LEAKY_RELU, a, negative_slope, NAN);
}

eng_tensor* eng_elu(eng_tensor* a, double alpha) {
  UN_GUARD(ENG_UN_ELU, "elu", a, 0, alpha, NAN);
  return unary(KU_ELU, a, alpha, NAN);
}

eng_tensor* eng_softplus(eng_tensor* a, double beta, double threshold) {
  UN_GUARD(ENG_UN_SOFTPLUS, "softplus", a, 0, beta, threshold);
  return unary(KU_SOFTPLUS, a, beta, threshold);
}

/* Integer tensors: clamp with the bounds truncated to integers (PyTorch's
 * hardtanh: no promotion by the bounds); no gradient. */
eng_tensor* eng_hardtanh(eng_tensor* a, double min_val, double max_val) {
  ENG_CHECK(a, "hardtanh");
  if (isnan(min_val) || isnan(max_val))
    return eng_errp("hardtanh: %s: min_val and max_val must be numbers, got %g and %g", eng_desc(a), min_val, max_val);
  if (min_val > max_val)
    return eng_errp("hardtanh: min_val (%g) cannot be greater than max_val (%g)", min_val, max_val);
  if (a->dtype == ENG_BOOL) return eng_errp("hardtanh: not supported for bool tensors (%s)", eng_desc(a));
  UN_GUARD(ENG_UN_HARDTANH, "hardtanh", a, 0, min_val, max_val);
  if (!eng_dtype_is_floating(a->dtype)) {
    double lo = trunc(min_val), hi = trunc(max_val);
    if (a->dtype == ENG_U8 && (lo < 0 || hi < 0))
      return eng_errp("hardtanh: cannot do hardtanh on an unsigned type with negative limits (%s, %g, %g)",
                      eng_desc(a), min_val, max_val);
    return unary(KU_CLAMP, a, lo, hi);
  }
  return unary(KU_HARDTANH, a, min_val, max_val);
}
