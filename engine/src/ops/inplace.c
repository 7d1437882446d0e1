/* inplace.c: fused in-place updates for optimizers and initialisation:
 * addcmul_ (a += v*b*c), addcdiv_ (a += v*b/c), lerp_ (a += w*(b-a)) and
 * clamp_.  Not recorded by autograd (eng_check_inplace refuses leaves that
 * require grad in grad mode); b and c broadcast to a; the version counter
 * of a's storage is bumped. */
#include "core/internal.h"
#include "core/dispatch.h"
#include "kernels/cpu/kcpu.h"
#include "ops/cuda_ops.h"
#include "eng/ops_pointwise.h"
#include <math.h>

/* The in-place target must keep its shape: x broadcast to a. */
static int check_operand(eng_tensor* a, eng_tensor* x, const char* name) {
  if (eng_meta_check(a, name) || eng_meta_check(x, name)) return -1;
  if (a->device != x->device)
    return eng_err("%s: tensors on different devices: %s and %s", name, eng_desc(a), eng_desc(x));
  return eng_check_broadcast_to(a, x, name);
}

/* x as an operand of dtype dt that does not overlap a's memory (a copy when
 * it shares a's storage with a different layout, or has another dtype). */
static eng_tensor* operand(eng_tensor* a, eng_tensor* x, int dt) {
  int same_view = x->storage == a->storage && x->offset == a->offset && eng_same_shape(x, a) &&
                  !memcmp(x->stride, a->stride, sizeof(int64_t) * (size_t)a->ndim);
  if (x->dtype == dt && (x->storage != a->storage || same_view)) return eng_tensor_retain(x);
  eng_tensor* r = eng_new(x->ndim, x->shape, dt, x->device);
  if (r && r->numel > 0) eng_copy_raw(r, x, x->stride);
  return r;
}

typedef struct { int op, dt; double v; } i3_ctx;
static void i3_row(int64_t n, char** p, const int64_t* s, void* vc) {
  i3_ctx* c = vc;
  kc_inplace3_row(c->op, c->dt, n, p[0], s[0], p[1], s[1], p[2], s[2], c->v);
}

typedef struct { int op, adt; double v; } i3g_ctx;
static void i3_row_generic(int64_t n, char** p, const int64_t* s, void* vc) {
  i3g_ctx* c = vc;
  for (int64_t i = 0; i < n; i++) {
    char* x = p[0] + i * s[0];
    double a = kc_load(x, c->adt);
    double b = *(const double*)(p[1] + i * s[1]), cc = *(const double*)(p[2] + i * s[2]), r;
    switch (c->op) {
      case KI_ADDCMUL: r = a + c->v * b * cc; break;
      case KI_ADDCDIV: r = a + c->v * b / cc; break;
      default: r = a + c->v * (b - a); break;
    }
    kc_store(x, c->adt, r);
  }
}

/* a op= (b, c, v); c may be NULL (lerp). */
static int inplace3(int op, eng_tensor* a, eng_tensor* b, eng_tensor* c, double v, const char* name) {
  ENG_CHECK_I(a, name); ENG_CHECK_I(b, name);
  if (op != KI_LERP) ENG_CHECK_I(c, name);
  if (eng_check_inplace(a, name)) return -1;
  if (!eng_dtype_is_floating(a->dtype))
    return eng_err("%s: the in-place target must be floating point, got %s", name, eng_desc(a));
  if (check_operand(a, b, name) || (c && check_operand(a, c, name))) return -1;
  /* PyTorch's overlap checks (operand() reads any other overlapping operand from a copy) */
  if (eng_check_internal_overlap(a, name) || eng_check_partial_overlap(a, b, name) ||
      (c && eng_check_partial_overlap(a, c, name)))
    return -1;
  if (a->numel == 0) { eng_bump_version(a); return 0; }
  if (a->device == ENG_CUDA) { /* composed from the device's binary ops */
    int prev = eng_set_grad_enabled(0);
    /* in the target's precision (f64 stays f64, half targets compute in f32), as the CPU path: an f64
     * target with f32 operands must not take their f32 product */
    int cdt = a->dtype == ENG_F64 ? ENG_F64 : ENG_F32;
    eng_tensor* B = b->dtype == cdt || !eng_dtype_is_floating(b->dtype) ? eng_tensor_retain(b) : eng_tensor_to_dtype(b, cdt);
    eng_tensor* Cc = !c ? NULL : (c->dtype == cdt || !eng_dtype_is_floating(c->dtype) ? eng_tensor_retain(c) : eng_tensor_to_dtype(c, cdt));
    eng_tensor* t = !B || (c && !Cc) ? NULL
                  : op == KI_ADDCMUL ? eng_mul(B, Cc) : op == KI_ADDCDIV ? eng_div(B, Cc) : eng_sub(B, a);
    int rc = t ? eng_add_(a, t, v) : -1;
    eng_set_grad_enabled(prev);
    eng_tensor_release(B); eng_tensor_release(Cc);
    eng_tensor_release(t);
    if (rc) eng_err_prefix("%s", name);
    return rc;
  }
  /* f32 and f64 targets compute in their own dtype; bf16/f16 targets load
   * and store through double with operands converted to f64. */
  int fast = a->dtype == ENG_F32 || a->dtype == ENG_F64;
  int odt = fast ? a->dtype : ENG_F64;
  eng_tensor* B = operand(a, b, odt);
  eng_tensor* Cc = c ? operand(a, c, odt) : (B ? eng_tensor_retain(B) : NULL);
  if (!B || !Cc) { eng_tensor_release(B); eng_tensor_release(Cc); return -1; }
  int64_t sb[ENG_MAX_DIMS], sc[ENG_MAX_DIMS];
  eng_broadcast_strides(B, a->ndim, a->shape, sb);
  eng_broadcast_strides(Cc, a->ndim, a->shape, sc);
  char* base[3] = {eng_ptr(a), eng_ptr(B), eng_ptr(Cc)};
  const int64_t* st[3] = {a->stride, sb, sc};
  int oes = eng_dtype_size(odt);
  int esz[3] = {eng_dtype_size(a->dtype), oes, oes};
  if (fast) {
    i3_ctx ctx = {op, a->dtype, v};
    kc_foreach(a->ndim, a->shape, 3, base, st, esz, i3_row, &ctx);
  } else {
    i3g_ctx ctx = {op, a->dtype, v};
    kc_foreach(a->ndim, a->shape, 3, base, st, esz, i3_row_generic, &ctx);
  }
  eng_tensor_release(B); eng_tensor_release(Cc);
  eng_bump_version(a);
  return 0;
}

/* DTensor targets: operands laid out like the target, then the op runs on the locals. */
static int i3_local(eng_op_call* c) {
  return inplace3((int)c->ints[0], c->in[0], c->in[1], c->n_in > 2 ? c->in[2] : NULL, c->scalars[0], c->name);
}
#define I3_GUARD(op, nm, mode, a, b, c, v)                                                        \
  if (a && b && ENG_DT_ACTIVE(a->dist || b->dist || (c && c->dist)))                                \
    return eng_op_dispatch_inplace(nm, mode, &(eng_op_call){.name = nm, .n_in = c ? 3 : 2, .in = {a, b, c}, .ints = {op}, .scalars = {v}}, i3_local)

int eng_addcmul_(eng_tensor* a, eng_tensor* b, eng_tensor* c, double v) {
  I3_GUARD(KI_ADDCMUL, "addcmul_", 0, a, b, c, v);
  return inplace3(KI_ADDCMUL, a, b, c, v, "addcmul_");
}
int eng_addcdiv_(eng_tensor* a, eng_tensor* b, eng_tensor* c, double v) {
  I3_GUARD(KI_ADDCDIV, "addcdiv_", 0, a, b, c, v);
  return inplace3(KI_ADDCDIV, a, b, c, v, "addcdiv_");
}
int eng_lerp_(eng_tensor* a, eng_tensor* b, double w) {
  eng_tensor* none = NULL;
  I3_GUARD(KI_LERP, "lerp_", 1, a, b, none, w);
  return inplace3(KI_LERP, a, b, NULL, w, "lerp_");
}

/* ------------------------------------------------------------ clamp_ */
typedef struct { int dt; double lo, hi; } cl_ctx;
static void clamp_row(int64_t n, char** p, const int64_t* s, void* vc) {
  cl_ctx* c = vc;
  kc_unary_row(KU_CLAMP, c->dt, n, p[0], s[0], p[0], s[0], c->lo, c->hi);
}
static void clamp_row_generic(int64_t n, char** p, const int64_t* s, void* vc) {
  cl_ctx* c = vc;
  for (int64_t i = 0; i < n; i++) {
    char* x = p[0] + i * s[0];
    double v = kc_load(x, c->dt);
    if (v != v) continue;
    if (!isnan(c->lo) && v < c->lo) v = c->lo;
    if (!isnan(c->hi) && v > c->hi) v = c->hi;
    kc_store(x, c->dt, v);
  }
}

static int clamp_local(eng_op_call* c);
int eng_clamp_(eng_tensor* a, double lo, double hi) {
  ENG_CHECK_I(a, "clamp_");
  if (ENG_DT_ACTIVE(a->dist))
    return eng_op_dispatch_inplace("clamp_", 0, &(eng_op_call){.name = "clamp_", .n_in = 1, .in = {a}, .scalars = {lo, hi}}, clamp_local);
  if (eng_check_inplace(a, "clamp_") || eng_check_internal_overlap(a, "clamp_")) return -1;
  if (isnan(lo) && isnan(hi))
    return eng_err("clamp_: %s: at least one of min and max must be given (both are NaN/nil)", eng_desc(a));
  if (a->dtype == ENG_BOOL) return eng_err("clamp_: not supported for bool tensors (%s)", eng_desc(a));
  if (!eng_dtype_is_floating(a->dtype) && ((!isnan(lo) && lo != floor(lo)) || (!isnan(hi) && hi != floor(hi))))
    return eng_err("clamp_: bounds %g, %g are not integers and the in-place target %s is an integer tensor "
                   "(its dtype cannot change)", lo, hi, eng_desc(a));
  if (a->numel > 0 && a->device == ENG_CUDA) {
    if (eng_cu_unary(KU_CLAMP, a->dtype, a->ndim, a->shape, eng_ptr(a), a->stride, eng_ptr(a), a->stride, lo, hi,
                     "clamp_"))
      return -1;
  } else if (a->numel > 0) {
    cl_ctx c = {a->dtype, lo, hi};
    char* base[1] = {eng_ptr(a)};
    const int64_t* st[1] = {a->stride};
    int esz[1] = {eng_dtype_size(a->dtype)};
    int direct = a->dtype == ENG_F32 || a->dtype == ENG_F64 || a->dtype == ENG_I32 || a->dtype == ENG_I64 ||
                 a->dtype == ENG_U8;
    kc_foreach(a->ndim, a->shape, 1, base, st, esz, direct ? clamp_row : clamp_row_generic, &c);
  }
  eng_bump_version(a);
  return 0;
}

static int clamp_local(eng_op_call* c) { return eng_clamp_(c->in[0], c->scalars[0], c->scalars[1]); }
