/* binary.c: broadcasting binary ops (add, sub, mul, div, pow, maximum,
 * minimum), their scalar forms, autograd, and in-place arithmetic. */
#include "core/internal.h"
#include "core/dispatch.h"
#include "kernels/cpu/kcpu.h"
#include "ops/cuda_ops.h"
#include "autograd/autograd.h"
#include "eng/ops_pointwise.h"
#include <math.h>
#include <string.h>

static int compute_dtype(int rdt) {
  if (rdt == ENG_BF16 || rdt == ENG_F16) return ENG_F32;
  if (rdt == ENG_BOOL) return ENG_U8;
  return rdt;
}

typedef struct { int op, dt; } brow_ctx;
static void brow(int64_t n, char** p, const int64_t* s, void* vc) {
  brow_ctx* c = vc;
  kc_binary_row(c->op, c->dt, n, p[0], s[0], p[1], s[1], p[2], s[2]);
}

static const char* const g_names[] = {"add", "sub", "mul", "div", "pow", "maximum", "minimum"};

/* PyTorch refuses subtraction with bool operands (sub_check): its messages. */
static const char* bool_sub_msg(int both) {
  return both ? "Subtraction, the `-` operator, with two bool tensors is not supported. Use the `^` or "
                "`logical_xor()` operator instead."
              : "Subtraction, the `-` operator, with a bool tensor is not supported. If you are trying to invert a "
                "mask, use the `~` or `logical_not()` operator instead.";
}

/* Forward only: out = a op b with broadcasting and type promotion. */
static eng_tensor* binary_fwd(int op, eng_tensor* a, eng_tensor* b) {
  const char* name = g_names[op];
  ENG_CHECK(a, name); ENG_CHECK(b, name);
  if (a->device != b->device)
    return eng_errp("%s: tensors on different devices: %s and %s", name, eng_desc(a), eng_desc(b));
  if (op == KB_SUB && (a->dtype == ENG_BOOL || b->dtype == ENG_BOOL))
    return eng_errp("%s: %s (%s, %s)", name, bool_sub_msg(a->dtype == ENG_BOOL && b->dtype == ENG_BOOL), eng_desc(a),
                    eng_desc(b));
  int rdt = eng_promote_types(a->dtype, b->dtype);
  if (op == KB_DIV && !eng_dtype_is_floating(rdt)) rdt = ENG_F32; /* true division */
  int cdt = a->device == ENG_CUDA ? rdt : compute_dtype(rdt); /* the CUDA kernels take every dtype as is */
  int64_t shape[ENG_MAX_DIMS];
  int nd = eng_broadcast_shapes(a->ndim, a->shape, b->ndim, b->shape, shape, name, a, b);
  if (nd < 0) return NULL;
  eng_tensor* A = a->dtype == cdt ? eng_tensor_retain(a) : eng_as_contig(a, cdt);
  eng_tensor* B = b->dtype == cdt ? eng_tensor_retain(b) : eng_as_contig(b, cdt);
  eng_tensor* out = (A && B) ? eng_new(nd, shape, cdt, a->device) : NULL;
  if (out && a->device == ENG_CUDA) {
    int64_t sa[ENG_MAX_DIMS], sb[ENG_MAX_DIMS];
    eng_broadcast_strides(A, nd, shape, sa);
    eng_broadcast_strides(B, nd, shape, sb);
    if (eng_cu_binary(op, cdt, nd, shape, eng_ptr(out), out->stride, eng_ptr(A), sa, eng_ptr(B), sb, name)) {
      eng_tensor_release(out);
      out = NULL;
    }
  } else if (out) {
    int64_t sa[ENG_MAX_DIMS], sb[ENG_MAX_DIMS];
    eng_broadcast_strides(A, nd, shape, sa);
    eng_broadcast_strides(B, nd, shape, sb);
    brow_ctx c = {op, cdt};
    char* base[3] = {eng_ptr(out), eng_ptr(A), eng_ptr(B)};
    const int64_t* st[3] = {out->stride, sa, sb};
    int es = eng_dtype_size(cdt);
    int esz[3] = {es, es, es};
    kc_foreach_par(nd, shape, 3, base, st, esz, brow, &c);
  }
  eng_tensor_release(A); eng_tensor_release(B);
  if (out && rdt != cdt) { eng_tensor* r = eng_as_contig(out, rdt); eng_tensor_release(out); out = r; }
  return out;
}

/* ------------------------------------------------------------ backward */
static int give(eng_node* n, int i, eng_tensor* g, eng_tensor** gi) {
  if (!g) return -1;
  gi[i] = eng_grad_to_input(n, i, g);
  eng_tensor_release(g);
  return gi[i] ? 0 : -1;
}

static int add_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  if (eng_node_needs_grad(n, 0) && give(n, 0, eng_tensor_retain(go[0]), gi)) return -1;
  if (eng_node_needs_grad(n, 1) && give(n, 1, eng_tensor_retain(go[0]), gi)) return -1;
  return 0;
}

static int sub_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  if (eng_node_needs_grad(n, 0) && give(n, 0, eng_tensor_retain(go[0]), gi)) return -1;
  if (eng_node_needs_grad(n, 1) && give(n, 1, eng_neg(go[0]), gi)) return -1;
  return 0;
}

static int mul_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor *a = eng_node_saved(n, 0), *b = eng_node_saved(n, 1);
  if (!a || !b) return -1;
  if (eng_node_needs_grad(n, 0) && give(n, 0, eng_mul(go[0], b), gi)) return -1;
  if (eng_node_needs_grad(n, 1) && give(n, 1, eng_mul(go[0], a), gi)) return -1;
  return 0;
}

static int div_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor *a = eng_node_saved(n, 0), *b = eng_node_saved(n, 1);
  if (!a || !b) return -1;
  if (eng_node_needs_grad(n, 0) && give(n, 0, eng_div(go[0], b), gi)) return -1;
  if (eng_node_needs_grad(n, 1)) {
    eng_tensor* t1 = eng_mul(go[0], a);
    eng_tensor* t2 = t1 ? eng_mul(b, b) : NULL;
    eng_tensor* t3 = t2 ? eng_div(t1, t2) : NULL;
    eng_tensor_release(t1); eng_tensor_release(t2);
    if (give(n, 1, t3 ? eng_neg(t3) : NULL, gi)) { eng_tensor_release(t3); return -1; }
    eng_tensor_release(t3);
  }
  return 0;
}

/* d/da a^b = b a^(b-1); d/db = a^b ln a (0 where a == 0 and b >= 0, as PyTorch). */
static int pow_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor *a = eng_node_saved(n, 0), *b = eng_node_saved(n, 1), *out = eng_node_saved(n, 2);
  if (!a || !b || !out) return -1;
  if (eng_node_needs_grad(n, 0)) {
    eng_tensor* bm1 = eng_sub_scalar(b, 1.0);
    eng_tensor* p = bm1 ? eng_pow(a, bm1) : NULL;
    eng_tensor* q = p ? eng_mul(p, b) : NULL;
    eng_tensor* r = q ? eng_mul(go[0], q) : NULL;
    /* b == 0 gives 0 even where a == 0 */
    eng_tensor* bz = r ? eng_compare_scalar(b, 0.0, ENG_EQ) : NULL;
    eng_tensor* r2 = bz ? eng_masked_fill(r, bz, 0.0) : NULL;
    eng_tensor_release(bm1); eng_tensor_release(p); eng_tensor_release(q); eng_tensor_release(r);
    eng_tensor_release(bz);
    if (give(n, 0, r2, gi)) return -1;
  }
  if (eng_node_needs_grad(n, 1)) {
    eng_tensor* la = eng_log(a);
    eng_tensor* p = la ? eng_mul(out, la) : NULL;
    eng_tensor* az = p ? eng_compare_scalar(a, 0.0, ENG_EQ) : NULL;
    eng_tensor* bp = az ? eng_compare_scalar(b, 0.0, ENG_GE) : NULL;
    eng_tensor* m = bp ? eng_mul(az, bp) : NULL;
    eng_tensor* p2 = m ? eng_masked_fill(p, m, 0.0) : NULL;
    eng_tensor* r = p2 ? eng_mul(go[0], p2) : NULL;
    eng_tensor_release(la); eng_tensor_release(p); eng_tensor_release(az); eng_tensor_release(bp);
    eng_tensor_release(m); eng_tensor_release(p2);
    if (give(n, 1, r, gi)) return -1;
  }
  return 0;
}

/* maximum/minimum: the gradient goes to the selected input, split evenly on ties. */
static int maxmin_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor *a = eng_node_saved(n, 0), *b = eng_node_saved(n, 1);
  if (!a || !b) return -1;
  int is_max = (int)n->ints[0];
  for (int i = 0; i < 2; i++) {
    if (!eng_node_needs_grad(n, i)) continue;
    eng_tensor* self = i == 0 ? a : b; eng_tensor* other = i == 0 ? b : a;
    eng_tensor* win = eng_compare(self, other, is_max ? ENG_GT : ENG_LT);
    eng_tensor* tie = win ? eng_compare(self, other, ENG_EQ) : NULL;
    eng_tensor* wf = tie ? eng_tensor_to_dtype(win, go[0]->dtype) : NULL;
    eng_tensor* tf = wf ? eng_tensor_to_dtype(tie, go[0]->dtype) : NULL;
    eng_tensor* th = tf ? eng_mul_scalar(tf, 0.5) : NULL;
    eng_tensor* w = th ? eng_add(wf, th) : NULL;
    eng_tensor* r = w ? eng_mul(go[0], w) : NULL;
    eng_tensor_release(win); eng_tensor_release(tie); eng_tensor_release(wf); eng_tensor_release(tf);
    eng_tensor_release(th); eng_tensor_release(w);
    if (give(n, i, r, gi)) return -1;
  }
  return 0;
}

static eng_tensor* binary(int op, eng_tensor* a, eng_tensor* b) {
  if (eng_meta_check(a, g_names[op])) return NULL;
  if (eng_meta_check(b, g_names[op])) return NULL;
  eng_tensor* out = binary_fwd(op, a, b);
  if (!out) return NULL;
  eng_tensor* in[2] = {a, b};
  if (!eng_any_requires_grad(2, in) || !eng_dtype_is_floating(out->dtype)) return out;
  static const char* const bw_names[] = {"AddBackward", "SubBackward", "MulBackward", "DivBackward",
                                         "PowBackward", "MaximumBackward", "MinimumBackward"};
  static const eng_backward_fn fns[] = {add_bw, sub_bw, mul_bw, div_bw, pow_bw, maxmin_bw, maxmin_bw};
  eng_node* nd = eng_record(bw_names[op], fns[op], 2, in, out);
  if (!nd) { eng_tensor_release(out); return NULL; }
  nd->ints[0] = op == KB_MAX;
  int save = op >= KB_MUL;
  if (save && (eng_node_save(nd, a) || eng_node_save(nd, b) || (op == KB_POW && eng_node_save(nd, out)))) {
    eng_tensor_release(out);
    return NULL;
  }
  return out;
}

/* DTensor arguments go through the dispatcher (sharding/pointwise.c). */
#define BIN_GUARD(which, a, b)                                                                     \
  if (a && b && ENG_DT_ACTIVE(a->dist || ENG_META_T(a) || b->dist || ENG_META_T(b)))                                                 \
    return eng_op_dispatch(ENG_OP_BINARY, &(eng_op_call){.name = g_names[which], .n_in = 2, .in = {a, b}, .ints = {which}})

eng_tensor* eng_add(eng_tensor* a, eng_tensor* b) { BIN_GUARD(ENG_BIN_ADD, a, b); return binary(KB_ADD, a, b); }
eng_tensor* eng_sub(eng_tensor* a, eng_tensor* b) { BIN_GUARD(ENG_BIN_SUB, a, b); return binary(KB_SUB, a, b); }
eng_tensor* eng_mul(eng_tensor* a, eng_tensor* b) { BIN_GUARD(ENG_BIN_MUL, a, b); return binary(KB_MUL, a, b); }
eng_tensor* eng_div(eng_tensor* a, eng_tensor* b) { BIN_GUARD(ENG_BIN_DIV, a, b); return binary(KB_DIV, a, b); }
eng_tensor* eng_pow(eng_tensor* a, eng_tensor* b) { BIN_GUARD(ENG_BIN_POW, a, b); return binary(KB_POW, a, b); }
eng_tensor* eng_maximum(eng_tensor* a, eng_tensor* b) { BIN_GUARD(ENG_BIN_MAX, a, b); return binary(KB_MAX, a, b); }
eng_tensor* eng_minimum(eng_tensor* a, eng_tensor* b) { BIN_GUARD(ENG_BIN_MIN, a, b); return binary(KB_MIN, a, b); }

/* ------------------------------------------------------------ scalar forms */
static eng_tensor* scalar_like(eng_tensor* a, double s) {
  int dt = a->dtype;
  if (!eng_dtype_is_floating(dt)) {
    if (s != floor(s) || !isfinite(s)) dt = ENG_F32;
    else if (dt == ENG_BOOL) dt = ENG_I64;
  }
  return eng_tensor_full(0, NULL, s, dt, a->device);
}

enum { SC_ADD, SC_SUB, SC_MUL, SC_DIV, SC_POW, SC_RSUB, SC_RDIV, SC_RPOW };

static int scalar_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  double s = n->scalars[0];
  eng_tensor* g = go[0];
  eng_tensor* r = NULL;
  switch ((int)n->ints[0]) {
    case SC_ADD: case SC_SUB: r = eng_tensor_retain(g); break;
    case SC_MUL: r = eng_mul_scalar(g, s); break;
    case SC_DIV: r = eng_div_scalar(g, s); break;
    case SC_RSUB: r = eng_neg(g); break;
    case SC_POW: {
      eng_tensor* a = eng_node_saved(n, 0);
      if (!a) return -1;
      if (s == 0.0) { r = eng_mul_scalar(g, 0.0); break; }
      eng_tensor* p = eng_pow_scalar(a, s - 1.0);
      eng_tensor* q = p ? eng_mul_scalar(p, s) : NULL;
      r = q ? eng_mul(g, q) : NULL;
      eng_tensor_release(p); eng_tensor_release(q);
      break;
    }
    case SC_RDIV: { /* d(s/a) = -s/a^2 */
      eng_tensor* a = eng_node_saved(n, 0);
      if (!a) return -1;
      eng_tensor* a2 = eng_mul(a, a);
      eng_tensor* q = a2 ? eng_rdiv_scalar(-s, a2) : NULL;
      r = q ? eng_mul(g, q) : NULL;
      eng_tensor_release(a2); eng_tensor_release(q);
      break;
    }
    case SC_RPOW: { /* d(s^a) = s^a ln s */
      eng_tensor* out = eng_node_saved(n, 0);
      if (!out) return -1;
      eng_tensor* q = eng_mul_scalar(out, log(s));
      r = q ? eng_mul(g, q) : NULL;
      eng_tensor_release(q);
      break;
    }
  }
  return give(n, 0, r, gi);
}

static eng_tensor* scalar_op(int kind, eng_tensor* a, double s) {
  static const int ops[] = {KB_ADD, KB_SUB, KB_MUL, KB_DIV, KB_POW, KB_SUB, KB_DIV, KB_POW};
  static const char* const names[] = {"AddBackward", "SubBackward", "MulBackward", "DivBackward",
                                      "PowBackward", "RsubBackward", "RdivBackward", "RpowBackward"};
  ENG_CHECK(a, g_names[ops[kind]]);
  if (eng_meta_check(a, g_names[ops[kind]])) return NULL;
  if (kind == SC_POW && s < 0 && s == floor(s) && !eng_dtype_is_floating(a->dtype))
    return eng_errp("pow: Integers to negative integer powers are not allowed (%s ^ %g; convert to a floating dtype first)",
                    eng_desc(a), s);
  eng_tensor* st = scalar_like(a, s);
  if (!st) return NULL;
  int rev = kind >= SC_RSUB;
  int prev = eng_set_grad_enabled(0);
  eng_tensor* out = rev ? binary_fwd(ops[kind], st, a) : binary_fwd(ops[kind], a, st);
  eng_set_grad_enabled(prev);
  eng_tensor_release(st);
  if (!out || !eng_any_requires_grad(1, &a) || !eng_dtype_is_floating(out->dtype)) return out;
  eng_node* nd = eng_record(names[kind], scalar_bw, 1, &a, out);
  if (!nd) { eng_tensor_release(out); return NULL; }
  nd->ints[0] = kind; nd->scalars[0] = s;
  int rc = 0;
  if (kind == SC_POW || kind == SC_RDIV) rc = eng_node_save(nd, a);
  if (kind == SC_RPOW) rc = eng_node_save(nd, out);
  if (rc) { eng_tensor_release(out); return NULL; }
  return out;
}

#define SC_GUARD(which, nm, a, s)                                                                \
  if (a && ENG_DT_ACTIVE(a->dist || ENG_META_T(a)))                                                                 \
    return eng_op_dispatch(ENG_OP_SCALAR, &(eng_op_call){.name = nm, .n_in = 1, .in = {a}, .ints = {which}, .scalars = {s}})

eng_tensor* eng_add_scalar(eng_tensor* a, double s) { SC_GUARD(ENG_SC_ADD, "add", a, s); return scalar_op(SC_ADD, a, s); }
eng_tensor* eng_sub_scalar(eng_tensor* a, double s) { SC_GUARD(ENG_SC_SUB, "sub", a, s); return scalar_op(SC_SUB, a, s); }
eng_tensor* eng_mul_scalar(eng_tensor* a, double s) { SC_GUARD(ENG_SC_MUL, "mul", a, s); return scalar_op(SC_MUL, a, s); }
eng_tensor* eng_div_scalar(eng_tensor* a, double s) { SC_GUARD(ENG_SC_DIV, "div", a, s); return scalar_op(SC_DIV, a, s); }
eng_tensor* eng_pow_scalar(eng_tensor* a, double s) { SC_GUARD(ENG_SC_POW, "pow", a, s); return scalar_op(SC_POW, a, s); }
eng_tensor* eng_rsub_scalar(double s, eng_tensor* a) { SC_GUARD(ENG_SC_RSUB, "rsub", a, s); return scalar_op(SC_RSUB, a, s); }
eng_tensor* eng_rdiv_scalar(double s, eng_tensor* a) { SC_GUARD(ENG_SC_RDIV, "rdiv", a, s); return scalar_op(SC_RDIV, a, s); }
eng_tensor* eng_rpow_scalar(double s, eng_tensor* a) { SC_GUARD(ENG_SC_RPOW, "rpow", a, s); return scalar_op(SC_RPOW, a, s); }

/* ------------------------------------------------------------ in place */
typedef struct { int op; double alpha; } ip_ctx;

static void ip_row_f32(int64_t n, char** p, const int64_t* s, void* vc) {
  ip_ctx* c = vc;
  float* restrict a = (float*)p[0];
  const char* b = p[1];
  int64_t sa = s[0] / 4, sb = s[1];
  float al = (float)c->alpha;
  if (sa == 1 && sb == 4) {
    const float* restrict B = (const float*)b;
    switch (c->op) {
      case KB_ADD: for (int64_t i = 0; i < n; i++) a[i] += al * B[i]; return;
      case KB_MUL: for (int64_t i = 0; i < n; i++) a[i] *= B[i]; return;
      case KB_DIV: for (int64_t i = 0; i < n; i++) a[i] /= B[i]; return;
    }
  }
  for (int64_t i = 0; i < n; i++) {
    float y = *(const float*)(b + i * sb);
    float* x = a + i * sa;
    switch (c->op) {
      case KB_ADD: *x += al * y; break;
      case KB_MUL: *x *= y; break;
      default: *x /= y; break;
    }
  }
}

typedef struct { int op; double alpha; int adt, bdt; } ipg_ctx;
static int is_int_code(int dt) { return dt == ENG_I32 || dt == ENG_I64 || dt == ENG_U8 || dt == ENG_BOOL; }
static int64_t load_int(const char* p, int dt) {
  switch (dt) {
    case ENG_I32: return *(const int32_t*)p;
    case ENG_I64: return *(const int64_t*)p;
    default: return *(const uint8_t*)p;
  }
}
static void store_int(char* p, int dt, int64_t v) {
  switch (dt) {
    case ENG_I32: *(int32_t*)p = (int32_t)(uint32_t)(uint64_t)v; break;
    case ENG_I64: *(int64_t*)p = v; break;
    case ENG_BOOL: *(uint8_t*)p = v != 0; break;
    default: *(uint8_t*)p = (uint8_t)(uint64_t)v; break;
  }
}
static void ip_row_generic(int64_t n, char** p, const int64_t* s, void* vc) {
  ipg_ctx* c = vc;
  if (is_int_code(c->adt) && is_int_code(c->bdt)) { /* exact, wrapping as PyTorch's integer kernels */
    uint64_t al = (uint64_t)(int64_t)c->alpha;
    for (int64_t i = 0; i < n; i++) {
      char* x = p[0] + i * s[0];
      uint64_t a = (uint64_t)load_int(x, c->adt), b = (uint64_t)load_int(p[1] + i * s[1], c->bdt);
      store_int(x, c->adt, (int64_t)(c->op == KB_MUL ? a * b : a + al * b));
    }
    return;
  }
  for (int64_t i = 0; i < n; i++) {
    char* x = p[0] + i * s[0];
    double a = kc_load(x, c->adt), b = kc_load(p[1] + i * s[1], c->bdt), r;
    switch (c->op) {
      case KB_ADD: r = a + c->alpha * b; break;
      case KB_MUL: r = a * b; break;
      default: r = a / b; break;
    }
    kc_store(x, c->adt, r);
  }
}

/* a op= alpha * B on the device (B does not overlap a; broadcast to a).
 * Half-precision targets compute in f32 and are written back once. */
static int inplace_cuda(int op, eng_tensor* a, eng_tensor* B, double alpha, const char* name) {
  /* half operands of one dtype with alpha 1 (autograd's gradient sums): one kernel in place, f32 math and one
   * rounding, the same bits as the f32 round trip below (two conversions in, the op, one out: four kernels) */
  if ((a->dtype == ENG_BF16 || a->dtype == ENG_F16) && B->dtype == a->dtype && alpha == 1.0) {
    int64_t sb[ENG_MAX_DIMS];
    eng_broadcast_strides(B, a->ndim, a->shape, sb);
    return eng_cu_binary(op, a->dtype, a->ndim, a->shape, eng_ptr(a), a->stride, eng_ptr(a), a->stride, eng_ptr(B), sb,
                         name);
  }
  int cdt = (a->dtype == ENG_BF16 || a->dtype == ENG_F16) ? ENG_F32 : a->dtype;
  eng_tensor* A = a->dtype == cdt ? eng_tensor_retain(a) : eng_as_contig(a, cdt);
  eng_tensor* Bc = A ? (B->dtype == cdt ? eng_tensor_retain(B) : eng_as_contig(B, cdt)) : NULL;
  int rc = -1;
  if (Bc && alpha != 1.0) { /* alpha only comes with add */
    int prev = eng_set_grad_enabled(0);
    eng_tensor* t = eng_mul_scalar(Bc, alpha);
    eng_set_grad_enabled(prev);
    eng_tensor_release(Bc);
    Bc = t && t->dtype != cdt ? eng_as_contig(t, cdt) : eng_tensor_retain(t);
    eng_tensor_release(t);
  }
  if (A && Bc) {
    int64_t sb[ENG_MAX_DIMS];
    eng_broadcast_strides(Bc, a->ndim, a->shape, sb);
    rc = eng_cu_binary(op, cdt, a->ndim, a->shape, eng_ptr(A), A->stride, eng_ptr(A), A->stride, eng_ptr(Bc), sb, name);
    if (rc == 0 && A != a) rc = eng_copy_raw(a, A, A->stride);
  }
  eng_tensor_release(A); eng_tensor_release(Bc);
  return rc;
}

/* The result of a op= b must be representable in a's dtype without changing its kind (PyTorch's canCast):
 * no floating result into an integer or bool tensor (true division always gives one), no integer result
 * into a bool tensor; an integral target takes an integral alpha only. */
static int check_inplace_types(int op, const eng_tensor* a, const eng_tensor* b, double alpha, const char* name) {
  if (strcmp(name, "sub_") == 0 && (a->dtype == ENG_BOOL || b->dtype == ENG_BOOL))
    return eng_err("%s: %s (%s, %s)", name, bool_sub_msg(a->dtype == ENG_BOOL && b->dtype == ENG_BOOL), eng_desc(a),
                   eng_desc(b));
  int rdt = eng_promote_types(a->dtype, b->dtype);
  if (op == KB_DIV && !eng_dtype_is_floating(rdt)) rdt = ENG_F32;
  if ((eng_dtype_is_floating(rdt) && !eng_dtype_is_floating(a->dtype)) || (a->dtype == ENG_BOOL && rdt != ENG_BOOL))
    return eng_err("%s: result type %s can't be cast to the desired output type %s (%s, %s)%s", name,
                   eng_dtype_name(rdt), eng_dtype_name(a->dtype), eng_desc(a), eng_desc(b),
                   op == KB_DIV ? ": true division gives floats; use {rounding_mode = \"trunc\"} or \"floor\", or "
                                  "convert the tensor first" : "");
  if (!eng_dtype_is_floating(a->dtype) && alpha != floor(alpha))
    return eng_err("%s: For integral input tensors, argument alpha must not be a floating point number (alpha %g, %s)",
                   name, alpha, eng_desc(a));
  return 0;
}

static int inplace(int op, eng_tensor* a, eng_tensor* b, double alpha, const char* name) {
  ENG_CHECK_I(a, name); ENG_CHECK_I(b, name);
  if (check_inplace_types(op, a, b, alpha, name)) return -1;
  if (eng_meta_check(a, name)) return -1;
  if (eng_meta_check(b, name)) return -1;
  if (eng_check_inplace(a, name)) return -1;
  if (a->device != b->device) return eng_err("%s: tensors on different devices: %s and %s", name, eng_desc(a), eng_desc(b));
  if (eng_check_broadcast_to(a, b, name)) return -1;
  /* PyTorch's overlap checks; an operand over a's memory otherwise (broadcast, strided) is read from a copy */
  if (eng_check_internal_overlap(a, name) || eng_check_partial_overlap(a, b, name)) return -1;
  eng_tensor* B = eng_unaliased(a, b);
  if (!B) return -1;
  if (a->device == ENG_CUDA) {
    int rc = inplace_cuda(op, a, B, alpha, name);
    eng_tensor_release(B);
    if (rc) return -1;
    eng_bump_version(a);
    return 0;
  }
  int64_t sb[ENG_MAX_DIMS];
  eng_broadcast_strides(B, a->ndim, a->shape, sb);
  char* base[2] = {eng_ptr(a), eng_ptr(B)};
  const int64_t* st[2] = {a->stride, sb};
  int esz[2] = {eng_dtype_size(a->dtype), eng_dtype_size(B->dtype)};
  if (a->dtype == ENG_F32 && B->dtype == ENG_F32) {
    ip_ctx c = {op, alpha};
    kc_foreach_par(a->ndim, a->shape, 2, base, st, esz, ip_row_f32, &c);
  } else {
    ipg_ctx c = {op, alpha, a->dtype, B->dtype};
    kc_foreach_par(a->ndim, a->shape, 2, base, st, esz, ip_row_generic, &c);
  }
  eng_tensor_release(B);
  eng_bump_version(a);
  return 0;
}

/* DTensor in-place: the operand is laid out like the target, then the op runs on the locals. */
static int ip_local(eng_op_call* c) {
  return inplace((int)c->ints[0], c->in[0], c->in[1], c->scalars[0], c->name);
}
#define IP_GUARD(op, nm, mode, a, b, alpha)                                                      \
  if (a && b && ENG_DT_ACTIVE(a->dist || ENG_META_T(a) || b->dist || ENG_META_T(b)))                                                 \
    return eng_op_dispatch_inplace(nm, mode, &(eng_op_call){.name = nm, .n_in = 2, .in = {a, b}, .ints = {op}, .scalars = {alpha}}, ip_local)

int eng_add_(eng_tensor* a, eng_tensor* b, double alpha) { IP_GUARD(KB_ADD, "add_", 1, a, b, alpha); return inplace(KB_ADD, a, b, alpha, "add_"); }
int eng_sub_(eng_tensor* a, eng_tensor* b) { IP_GUARD(KB_ADD, "sub_", 1, a, b, -1.0); return inplace(KB_ADD, a, b, -1.0, "sub_"); }
int eng_mul_(eng_tensor* a, eng_tensor* b) { IP_GUARD(KB_MUL, "mul_", 0, a, b, 1.0); return inplace(KB_MUL, a, b, 1.0, "mul_"); }
int eng_div_(eng_tensor* a, eng_tensor* b) { IP_GUARD(KB_DIV, "div_", 0, a, b, 1.0); return inplace(KB_DIV, a, b, 1.0, "div_"); }

static int inplace_scalar(int op, eng_tensor* a, double s, const char* name) {
  ENG_CHECK_I(a, name);
  /* an integral number next to an integer tensor is an integer (PyTorch's scalars), anything else a double */
  int sdt = a->dtype == ENG_F32 ? ENG_F32 : ENG_F64;
  if (!eng_dtype_is_floating(a->dtype) && s == floor(s) && fabs(s) < 9223372036854775808.0)
    sdt = a->dtype == ENG_BOOL && (s == 0 || s == 1) ? ENG_BOOL : ENG_I64;
  eng_tensor* st = eng_tensor_full(0, NULL, s, sdt, a->device);
  if (!st) return -1;
  int rc = inplace(op, a, st, 1.0, name);
  eng_tensor_release(st);
  return rc;
}

static int ips_local(eng_op_call* c) { return inplace_scalar((int)c->ints[0], c->in[0], c->scalars[0], c->name); }

int eng_add_scalar_(eng_tensor* a, double s) {
  if (a && ENG_DT_ACTIVE(a->dist || ENG_META_T(a)))
    return eng_op_dispatch_inplace("add_", 0, &(eng_op_call){.name = "add_", .n_in = 1, .in = {a}, .ints = {KB_ADD}, .scalars = {s}}, ips_local);
  return inplace_scalar(KB_ADD, a, s, "add_");
}
int eng_mul_scalar_(eng_tensor* a, double s) {
  if (a && ENG_DT_ACTIVE(a->dist || ENG_META_T(a)))
    return eng_op_dispatch_inplace("mul_", 2, &(eng_op_call){.name = "mul_", .n_in = 1, .in = {a}, .ints = {KB_MUL}, .scalars = {s}}, ips_local);
  return inplace_scalar(KB_MUL, a, s, "mul_");
}
