/* compare.c: comparisons (bool results, no gradient), where and
 * masked_fill (differentiable in their tensor arguments). */
#include "core/internal.h"
#include "core/dispatch.h"
#include "kernels/cpu/kcpu.h"
#include "ops/cuda_ops.h"
#include "autograd/autograd.h"
#include "eng/ops_pointwise.h"
#include <math.h>

static const char* const cmp_names[] = {"eq", "ne", "lt", "le", "gt", "ge"};

static int compute_dtype(int dt) {
  if (dt == ENG_BF16 || dt == ENG_F16) return ENG_F32;
  if (dt == ENG_BOOL) return ENG_U8;
  return dt;
}

typedef struct { int op, dt; } crow_ctx;
static void crow(int64_t n, char** p, const int64_t* s, void* vc) {
  crow_ctx* c = vc;
  kc_compare_row(c->op, c->dt, n, p[0], s[0], p[1], s[1], p[2], s[2]);
}

/* a cmp b computed in dtype cdt (both converted), broadcast, bool result. */
static eng_tensor* compare_in(eng_tensor* a, eng_tensor* b, int op, int cdt, const char* name) {
  int64_t shape[ENG_MAX_DIMS];
  int nd = eng_broadcast_shapes(a->ndim, a->shape, b->ndim, b->shape, shape, name, a, b);
  if (nd < 0) return NULL;
  eng_tensor* A = a->dtype == cdt ? eng_tensor_retain(a) : eng_as_contig(a, cdt);
  eng_tensor* B = b->dtype == cdt ? eng_tensor_retain(b) : eng_as_contig(b, cdt);
  eng_tensor* out = (A && B) ? eng_new(nd, shape, ENG_BOOL, a->device) : NULL;
  if (out && out->numel > 0) {
    int64_t sa[ENG_MAX_DIMS], sb[ENG_MAX_DIMS];
    eng_broadcast_strides(A, nd, shape, sa);
    eng_broadcast_strides(B, nd, shape, sb);
    if (out->device == ENG_CUDA) {
      if (eng_cu_compare(op, cdt, nd, shape, eng_ptr(out), out->stride, eng_ptr(A), sa, eng_ptr(B), sb, name)) {
        eng_tensor_release(out);
        out = NULL;
      }
    } else {
      crow_ctx c = {op, cdt};
      char* base[3] = {eng_ptr(out), eng_ptr(A), eng_ptr(B)};
      const int64_t* st[3] = {out->stride, sa, sb};
      int es = eng_dtype_size(cdt);
      int esz[3] = {1, es, es};
      kc_foreach(nd, shape, 3, base, st, esz, crow, &c);
    }
  }
  eng_tensor_release(A); eng_tensor_release(B);
  return out;
}

eng_tensor* eng_compare(eng_tensor* a, eng_tensor* b, int op) {
  if (op < 0 || op > ENG_GE) return eng_errp("compare: invalid comparison code %d (0..5: eq ne lt le gt ge)", op);
  const char* name = cmp_names[op];
  ENG_CHECK(a, name); ENG_CHECK(b, name);
  if (eng_meta_check_local(a, name)) return NULL;
  if (eng_meta_check_local(b, name)) return NULL;
  if (ENG_DT_ACTIVE(a->dist || ENG_META_T(a) || b->dist || ENG_META_T(b)))
    return eng_op_dispatch(ENG_OP_COMPARE, &(eng_op_call){.name = name, .n_in = 2, .in = {a, b}, .ints = {op}});
  if (a->device != b->device)
    return eng_errp("%s: tensors on different devices: %s and %s", name, eng_desc(a), eng_desc(b));
  return compare_in(a, b, op, compute_dtype(eng_promote_types(a->dtype, b->dtype)), name);
}

eng_tensor* eng_compare_scalar(eng_tensor* a, double s, int op) {
  if (op < 0 || op > ENG_GE) return eng_errp("compare: invalid comparison code %d (0..5: eq ne lt le gt ge)", op);
  const char* name = cmp_names[op];
  ENG_CHECK(a, name);
  if (eng_meta_check_local(a, name)) return NULL;
  if (ENG_DT_ACTIVE(a->dist || ENG_META_T(a)))
    return eng_op_dispatch(ENG_OP_COMPARE_SCALAR, &(eng_op_call){.name = name, .n_in = 1, .in = {a}, .ints = {op}, .scalars = {s}});
  /* The scalar takes a's dtype if a is floating (so bf16(x) == x holds as in
   * PyTorch); with an integer tensor, an integral scalar compares as i64,
   * any other as f64. */
  int sdt;
  if (eng_dtype_is_floating(a->dtype)) sdt = a->dtype;
  else if (isfinite(s) && s == floor(s) && fabs(s) < 9.2e18) {
    /* an integral scalar that fits a's type compares in a's type (no copy) */
    if (a->dtype == ENG_I32 && s >= -2147483648.0 && s <= 2147483647.0) sdt = ENG_I32;
    else if ((a->dtype == ENG_U8 || a->dtype == ENG_BOOL) && s >= 0 && s <= 255) sdt = ENG_U8;
    else sdt = ENG_I64;
  }
  else sdt = ENG_F64;
  eng_tensor* st = eng_tensor_full(0, NULL, s, sdt, a->device);
  if (!st) return NULL;
  eng_tensor* out = compare_in(a, st, op, compute_dtype(eng_promote_types(a->dtype, sdt)), name);
  eng_tensor_release(st);
  return out;
}

/* ------------------------------------------------------------ where */
static void wrow(int64_t n, char** p, const int64_t* s, void* vc) {
  kc_where_row(*(int*)vc, n, p[0], s[0], p[1], s[1], p[2], s[2], p[3], s[3]);
}

/* Forward without autograd. */
static eng_tensor* where_fwd(eng_tensor* cond, eng_tensor* a, eng_tensor* b) {
  int64_t s1[ENG_MAX_DIMS], shape[ENG_MAX_DIMS];
  int n1 = eng_broadcast_shapes(a->ndim, a->shape, b->ndim, b->shape, s1, "where", a, b);
  if (n1 < 0) return NULL;
  int nd = eng_broadcast_shapes(cond->ndim, cond->shape, n1, s1, shape, "where", NULL, NULL);
  if (nd < 0) {
    return eng_errp("where: condition %s, %s and %s do not broadcast together", eng_desc(cond), eng_desc(a),
                    eng_desc(b));
  }
  int rdt = eng_promote_types(a->dtype, b->dtype);
  eng_tensor* A = a->dtype == rdt ? eng_tensor_retain(a) : eng_as_contig(a, rdt);
  eng_tensor* B = b->dtype == rdt ? eng_tensor_retain(b) : eng_as_contig(b, rdt);
  eng_tensor* out = (A && B) ? eng_new(nd, shape, rdt, a->device) : NULL;
  if (out && out->numel > 0) {
    int64_t sc[ENG_MAX_DIMS], sa[ENG_MAX_DIMS], sb[ENG_MAX_DIMS];
    eng_broadcast_strides(cond, nd, shape, sc);
    eng_broadcast_strides(A, nd, shape, sa);
    eng_broadcast_strides(B, nd, shape, sb);
    int es = eng_dtype_size(rdt);
    if (out->device == ENG_CUDA) {
      if (eng_cu_same_device("where", out, cond) ||
          eng_cu_where(es, nd, shape, eng_ptr(out), out->stride, eng_ptr(cond), sc, eng_ptr(A), sa, eng_ptr(B), sb,
                       "where")) {
        eng_tensor_release(out);
        out = NULL;
      }
    } else {
      char* base[4] = {eng_ptr(out), eng_ptr(cond), eng_ptr(A), eng_ptr(B)};
      const int64_t* st[4] = {out->stride, sc, sa, sb};
      int esz[4] = {es, 1, es, es};
      kc_foreach(nd, shape, 4, base, st, esz, wrow, &es);
    }
  }
  eng_tensor_release(A); eng_tensor_release(B);
  return out;
}

static int where_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor* cond = eng_node_saved(n, 0);
  if (!cond) return -1;
  eng_tensor* zero = eng_tensor_zeros(0, NULL, go[0]->dtype, go[0]->device);
  if (!zero) return -1;
  int rc = 0;
  for (int i = 0; i < 2 && !rc; i++) {
    if (!eng_node_needs_grad(n, i)) continue;
    eng_tensor* r = i == 0 ? where_fwd(cond, go[0], zero) : where_fwd(cond, zero, go[0]);
    if (!r) { rc = -1; break; }
    gi[i] = eng_grad_to_input(n, i, r);
    eng_tensor_release(r);
    if (!gi[i]) rc = -1;
  }
  eng_tensor_release(zero);
  return rc;
}

static int check_mask(eng_tensor* m, const char* op, const char* what) {
  if (m->dtype != ENG_BOOL && m->dtype != ENG_U8)
    return eng_err("%s: %s must be a bool tensor, got %s", op, what, eng_desc(m));
  return 0;
}

eng_tensor* eng_where(eng_tensor* cond, eng_tensor* a, eng_tensor* b) {
  ENG_CHECK(cond, "where"); ENG_CHECK(a, "where"); ENG_CHECK(b, "where");
  if (eng_meta_check_local(cond, "where")) return NULL;
  if (eng_meta_check_local(a, "where")) return NULL;
  if (eng_meta_check_local(b, "where")) return NULL;
  if (ENG_DT_ACTIVE(cond->dist || ENG_META_T(cond) || a->dist || ENG_META_T(a) || b->dist || ENG_META_T(b)))
    return eng_op_dispatch(ENG_OP_WHERE, &(eng_op_call){.n_in = 3, .in = {cond, a, b}});
  if (check_mask(cond, "where", "condition")) return NULL;
  if (a->device != b->device || cond->device != a->device)
    return eng_errp("where: tensors on different devices: %s, %s and %s", eng_desc(cond), eng_desc(a), eng_desc(b));
  eng_tensor* out = where_fwd(cond, a, b);
  if (!out) return NULL;
  eng_tensor* in[2] = {a, b};
  if (!eng_any_requires_grad(2, in) || !eng_dtype_is_floating(out->dtype)) return out;
  eng_node* nd = eng_record("WhereBackward", where_bw, 2, in, out);
  if (!nd) { eng_tensor_release(out); return NULL; }
  if (eng_node_save(nd, cond)) { eng_tensor_release(out); return NULL; }
  return out;
}

/* ------------------------------------------------------------ masked_fill */
typedef struct { _Alignas(8) char val[8]; int es; } mrow_ctx;
static void mrow(int64_t n, char** p, const int64_t* s, void* vc) {
  mrow_ctx* c = vc;
  kc_masked_fill_row(c->es, n, p[0], s[0], p[1], s[1], p[2], s[2], c->val);
}

static eng_tensor* masked_fill_fwd(eng_tensor* t, eng_tensor* mask, double value) {
  int64_t shape[ENG_MAX_DIMS];
  int nd = eng_broadcast_shapes(t->ndim, t->shape, mask->ndim, mask->shape, shape, "masked_fill", t, mask);
  if (nd < 0) return NULL;
  eng_tensor* out = eng_new(nd, shape, t->dtype, t->device);
  if (out && out->numel > 0) {
    mrow_ctx c;
    c.es = eng_dtype_size(t->dtype);
    memset(c.val, 0, sizeof c.val);
    kc_store(c.val, t->dtype, value);
    int64_t sx[ENG_MAX_DIMS], sm[ENG_MAX_DIMS];
    eng_broadcast_strides(t, nd, shape, sx);
    eng_broadcast_strides(mask, nd, shape, sm);
    if (out->device == ENG_CUDA) {
      if (eng_cu_same_device("masked_fill", out, mask) ||
          eng_cu_masked_fill(c.es, nd, shape, eng_ptr(out), out->stride, eng_ptr(t), sx, eng_ptr(mask), sm, c.val,
                             "masked_fill")) {
        eng_tensor_release(out);
        out = NULL;
      }
    } else {
      char* base[3] = {eng_ptr(out), eng_ptr(t), eng_ptr(mask)};
      const int64_t* st[3] = {out->stride, sx, sm};
      int esz[3] = {c.es, c.es, 1};
      kc_foreach(nd, shape, 3, base, st, esz, mrow, &c);
    }
  }
  return out;
}

static int masked_fill_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor* mask = eng_node_saved(n, 0);
  if (!mask) return -1;
  eng_tensor* r = masked_fill_fwd(go[0], mask, 0.0);
  if (!r) return -1;
  gi[0] = eng_grad_to_input(n, 0, r);
  eng_tensor_release(r);
  return gi[0] ? 0 : -1;
}

eng_tensor* eng_masked_fill(eng_tensor* t, eng_tensor* mask, double value) {
  ENG_CHECK(t, "masked_fill"); ENG_CHECK(mask, "masked_fill");
  if (eng_meta_check_local(t, "masked_fill")) return NULL;
  if (eng_meta_check_local(mask, "masked_fill")) return NULL;
  if (ENG_DT_ACTIVE(t->dist || ENG_META_T(t) || mask->dist || ENG_META_T(mask)))
    return eng_op_dispatch(ENG_OP_MASKED_FILL, &(eng_op_call){.n_in = 2, .in = {t, mask}, .scalars = {value}});
  if (check_mask(mask, "masked_fill", "mask")) return NULL;
  if (t->device != mask->device)
    return eng_errp("masked_fill: tensors on different devices: %s and %s", eng_desc(t), eng_desc(mask));
  if (eng_check_value(value, t->dtype, "masked_fill")) return NULL;
  eng_tensor* out = masked_fill_fwd(t, mask, value);
  if (!out) return NULL;
  if (!eng_any_requires_grad(1, &t) || !eng_dtype_is_floating(out->dtype)) return out;
  eng_node* nd = eng_record("MaskedFillBackward", masked_fill_bw, 1, &t, out);
  if (!nd) { eng_tensor_release(out); return NULL; }
  if (eng_node_save(nd, mask)) { eng_tensor_release(out); return NULL; }
  return out;
}
