/* reduce2.c: more reductions over dims with keepdim: prod, amax, amin,
 * logsumexp, var/std (correction), vector norm (any ord), all, any.
 *
 * prod, amax and amin have kernels (kernels/cpu/math.c: the input is
 * permuted so the reduced dims are innermost, then each row is reduced) and
 * autograd nodes: prod's gradient is exact with zeros (prefix and suffix
 * products), amax/amin split the gradient evenly among the tied extremes
 * (PyTorch's rule); norm has a node with PyTorch's formulas (0 gradient at a
 * zero vector for ord 2 and p).  logsumexp, var, std, all and any are made of
 * dispatching ops (autograd from them).  bf16/f16 inputs of logsumexp, var,
 * std and norm are computed in f32 and rounded back.  CUDA tensors: prod,
 * amax and amin use the host fallback (copy, CPU kernel, copy back); the
 * composites run on the device ops.  DTensors: sharding/math.c (reduced dims
 * replicated first). */
#include "core/internal.h"
#include "ops/ops.h"
#include "kernels/cpu/kcpu.h"
#include "kernels/cpu/kmath.h"
#include "autograd/autograd.h"
#include "eng/ops_math.h"
#include "eng/ops_pointwise.h"
#include "eng/ops_reduce.h"
#include "eng/ops_shape.h"
#include <math.h>

static const char* const r2_names[] = {"prod", "amax", "amin", "logsumexp", "var", "std", "norm", "all", "any"};

static int mask_dims(int64_t mask, int ndim, int* dims) {
  int n = 0;
  for (int d = 0; d < ndim; d++) if (mask >> d & 1) dims[n++] = d;
  return n;
}

/* Output shape of a reduction; keep: the keepdim shape (1 at reduced dims). */
static int out_shape(const eng_tensor* t, int64_t mask, int keepdim, int64_t* shape) {
  int k = 0;
  for (int d = 0; d < t->ndim; d++) {
    if (mask >> d & 1) { if (keepdim) shape[k++] = 1; }
    else shape[k++] = t->shape[d];
  }
  return k;
}

/* t (detached) permuted so the reduced dims come last, contiguous, of dtype dt:
 * [M, R] rows.  perm gets the permutation. */
static eng_tensor* to_rows(eng_tensor* t, int64_t mask, int dt, int* perm, int64_t* M, int64_t* R) {
  int k = 0;
  *M = 1; *R = 1;
  for (int d = 0; d < t->ndim; d++) if (!(mask >> d & 1)) { perm[k++] = d; *M *= t->shape[d]; }
  for (int d = 0; d < t->ndim; d++) if (mask >> d & 1) { perm[k++] = d; *R *= t->shape[d]; }
  int ident = 1;
  for (int d = 0; d < t->ndim; d++) if (perm[d] != d) ident = 0;
  if (ident && t->dtype == dt && eng_tensor_is_contiguous(t)) return eng_tensor_retain(t); /* rows already */
  eng_tensor* det = eng_tensor_detach(t);
  eng_tensor* p = det ? (t->ndim ? eng_permute(det, t->ndim, perm) : eng_tensor_retain(det)) : NULL;
  eng_tensor* r = p ? eng_as_contig(p, dt) : NULL;
  eng_tensor_release(det); eng_tensor_release(p);
  return r;
}

/* Rows [M, R] (contiguous, the permuted shape of t) back to t's layout. */
static eng_tensor* from_rows(eng_tensor* rows, const eng_tensor* t, const int* perm) {
  int64_t ps[ENG_MAX_DIMS];
  int inv[ENG_MAX_DIMS];
  int ident = 1;
  for (int i = 0; i < t->ndim; i++) { ps[i] = t->shape[perm[i]]; inv[perm[i]] = i; if (perm[i] != i) ident = 0; }
  if (ident) return eng_view(rows, t->ndim, ps);
  eng_tensor* v = eng_view(rows, t->ndim, ps);
  eng_tensor* p = v ? (t->ndim ? eng_permute(v, t->ndim, inv) : eng_tensor_retain(v)) : NULL;
  eng_tensor* r = p ? eng_tensor_contiguous(p) : NULL;
  eng_tensor_release(v); eng_tensor_release(p);
  return r;
}

static eng_tensor* host_of(eng_tensor* t) {
  if (t->device != ENG_CUDA) return eng_tensor_retain(t);
  eng_tensor* d = eng_tensor_detach(t);
  eng_tensor* h = d ? eng_tensor_to_device(d, ENG_CPU) : NULL;
  eng_tensor_release(d);
  return h;
}
static eng_tensor* to_dev(eng_tensor* out, int device) {
  if (!out || device != ENG_CUDA) return out;
  eng_tensor* r = eng_tensor_to_device(out, device);
  eng_tensor_release(out);
  return r;
}

/* g (the reduction's output gradient) viewed with the keepdim shape. */
static eng_tensor* g_keep(eng_tensor* g, const eng_tensor* x, int64_t mask) {
  int64_t ks[ENG_MAX_DIMS];
  int nd = out_shape(x, mask, 1, ks);
  return eng_reshape(g, nd, ks);
}

/* ------------------------------------------------------------ prod / amax / amin */
static int prod_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor* x = eng_node_saved(n, 0);
  if (!x) return -1;
  int64_t mask = n->ints[0];
  int dt = go[0]->dtype == ENG_F64 ? ENG_F64 : ENG_F32;
  int perm[ENG_MAX_DIMS];
  int64_t M, R;
  eng_tensor* xh = host_of(x);
  eng_tensor* gh = xh ? host_of(go[0]) : NULL;
  eng_tensor* X = gh ? to_rows(xh, mask, dt, perm, &M, &R) : NULL;
  eng_tensor* G = X ? eng_as_contig(gh, dt) : NULL;
  eng_tensor* GI = G ? eng_new(2, (int64_t[]){M, R}, dt, ENG_CPU) : NULL;
  eng_tensor* r = NULL;
  if (GI) {
    if (M * R > 0) km_prod_grad_rows(dt, M, R, eng_ptr(X), eng_ptr(G), eng_ptr(GI));
    r = to_dev(from_rows(GI, xh, perm), x->device);
  }
  eng_tensor_release(xh); eng_tensor_release(gh); eng_tensor_release(X); eng_tensor_release(G);
  eng_tensor_release(GI);
  if (!r) return -1;
  gi[0] = eng_grad_to_input(n, 0, r);
  eng_tensor_release(r);
  return gi[0] ? 0 : -1;
}

/* amax/amin: g * (x == out) / count(x == out). */
static int ext_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor *x = eng_node_saved(n, 0), *y = eng_node_saved(n, 1);
  if (!x || !y) return -1;
  int64_t mask = n->ints[0];
  int dims[ENG_MAX_DIMS];
  int nd = mask_dims(mask, x->ndim, dims);
  eng_tensor* yk = g_keep(y, x, mask);
  eng_tensor* gk = yk ? g_keep(go[0], x, mask) : NULL;
  eng_tensor* eq = gk ? eng_compare(x, yk, ENG_EQ) : NULL;
  eng_tensor* cnt = eq ? eng_sum(eq, nd, dims, 1) : NULL;
  eng_tensor* w = cnt ? eng_div(eq, cnt) : NULL;
  eng_tensor* r = w ? eng_mul(gk, w) : NULL;
  eng_tensor_release(yk); eng_tensor_release(gk); eng_tensor_release(eq); eng_tensor_release(cnt);
  eng_tensor_release(w);
  if (!r) return -1;
  gi[0] = eng_grad_to_input(n, 0, r);
  eng_tensor_release(r);
  return gi[0] ? 0 : -1;
}

static eng_tensor* row_reduce(int op, eng_tensor* t, int64_t mask, int keepdim) {
  const char* name = r2_names[op];
  int kop = op == ENG_R2_PROD ? KM_RPROD : op == ENG_R2_AMAX ? KM_RMAX : KM_RMIN;
  int fl = eng_dtype_is_floating(t->dtype);
  int odt = op == ENG_R2_PROD && !fl ? ENG_I64 : t->dtype;
  int perm[ENG_MAX_DIMS];
  int64_t M, R, shape[ENG_MAX_DIMS];
  int nd = out_shape(t, mask, keepdim, shape);
  if (op != ENG_R2_PROD && t->numel == 0) {
    for (int d = 0; d < t->ndim; d++)
      if ((mask >> d & 1) && t->shape[d] == 0)
        return eng_errp("%s: %s: the reduction over dim %d is empty (size 0); %s needs at least one element", name,
                        eng_desc(t), d + 1, name);
  }
  eng_tensor* h = host_of(t);
  eng_tensor* X = h ? to_rows(h, mask, t->dtype, perm, &M, &R) : NULL;
  eng_tensor* out = X ? eng_new(nd, shape, odt, ENG_CPU) : NULL;
  if (out && M > 0) km_reduce_rows(kop, t->dtype, odt, M, R, eng_ptr(X), eng_ptr(out));
  eng_tensor_release(h); eng_tensor_release(X);
  out = to_dev(out, t->device);
  if (!out || !fl || !eng_any_requires_grad(1, &t)) return out;
  eng_node* n = eng_record(op == ENG_R2_PROD ? "ProdBackward" : op == ENG_R2_AMAX ? "AmaxBackward" : "AminBackward",
                           op == ENG_R2_PROD ? prod_bw : ext_bw, 1, &t, out);
  if (!n) { eng_tensor_release(out); return NULL; }
  n->ints[0] = mask;
  if (eng_node_save(n, t) || (op != ENG_R2_PROD && eng_node_save(n, out))) { eng_tensor_release(out); return NULL; }
  return out;
}

/* ------------------------------------------------------------ composites */
static eng_tensor* rel3(eng_tensor* keep, eng_tensor* a, eng_tensor* b, eng_tensor* c) {
  eng_tensor_release(a); eng_tensor_release(b); eng_tensor_release(c);
  return keep;
}

static int low_prec(int dt) { return dt == ENG_BF16 || dt == ENG_F16; }

/* Result r (keepdim shape, compute dtype) to the output shape and dtype dt. */
static eng_tensor* finish(eng_tensor* r, const eng_tensor* t, int64_t mask, int keepdim, int dt) {
  if (!r) return NULL;
  if (!keepdim) {
    int64_t s[ENG_MAX_DIMS];
    int nd = out_shape(t, mask, 0, s);
    eng_tensor* v = eng_reshape(r, nd, s);
    eng_tensor_release(r);
    r = v;
  }
  if (r && r->dtype != dt) { eng_tensor* c = eng_tensor_to_dtype(r, dt); eng_tensor_release(r); r = c; }
  return r;
}

static eng_tensor* lse(eng_tensor* t0, int64_t mask, int keepdim) {
  int odt = eng_dtype_is_floating(t0->dtype) ? t0->dtype : ENG_F32;
  int cdt = low_prec(odt) ? ENG_F32 : odt;
  int dims[ENG_MAX_DIMS];
  int nd = mask_dims(mask, t0->ndim, dims);
  eng_tensor* x = eng_tensor_to_dtype(t0, cdt);
  if (!x) return NULL;
  int empty = 0;
  for (int i = 0; i < nd; i++) if (t0->shape[dims[i]] == 0) empty = 1;
  eng_tensor* m;
  if (empty || t0->numel == 0) {
    int64_t ks[ENG_MAX_DIMS];
    int kn = out_shape(t0, mask, 1, ks);
    m = eng_tensor_zeros(kn, ks, cdt, t0->device);
  } else {
    eng_tensor* xd = eng_tensor_detach(x);
    eng_tensor* mx = xd ? row_reduce(ENG_R2_AMAX, xd, mask, 1) : NULL;
    eng_tensor* inf = mx ? eng_isinf(mx) : NULL;
    m = inf ? eng_masked_fill(mx, inf, 0.0) : NULL;
    rel3(NULL, xd, mx, inf);
  }
  eng_tensor* d = m ? eng_sub(x, m) : NULL;
  eng_tensor* e = d ? eng_exp(d) : NULL;
  eng_tensor* s = e ? eng_sum(e, nd, dims, 1) : NULL;
  eng_tensor* l = s ? eng_log(s) : NULL;
  eng_tensor* r = l ? eng_add(l, m) : NULL;
  rel3(NULL, x, m, d); rel3(NULL, e, s, l);
  return finish(r, t0, mask, keepdim, odt);
}

static int std_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor* y = eng_node_saved(n, 0);
  if (!y) return -1;
  eng_tensor* d = eng_mul_scalar(y, 2.0);
  eng_tensor* r = d ? eng_div(go[0], d) : NULL;
  eng_tensor* z = r ? eng_compare_scalar(y, 0.0, ENG_EQ) : NULL;
  eng_tensor* r2 = z ? eng_masked_fill(r, z, 0.0) : NULL;
  rel3(NULL, d, r, z);
  if (!r2) return -1;
  gi[0] = eng_grad_to_input(n, 0, r2);
  eng_tensor_release(r2);
  return gi[0] ? 0 : -1;
}

static eng_tensor* var_std(int op, eng_tensor* t0, int64_t mask, int keepdim, double correction) {
  const char* name = r2_names[op];
  if (!eng_dtype_is_floating(t0->dtype))
    return eng_errp("%s: only floating point tensors are supported, got %s (convert with :float() first)", name,
                    eng_desc(t0));
  int cdt = low_prec(t0->dtype) ? ENG_F32 : t0->dtype;
  int dims[ENG_MAX_DIMS];
  int nd = mask_dims(mask, t0->ndim, dims);
  double N = 1;
  for (int i = 0; i < nd; i++) N *= (double)t0->shape[dims[i]];
  double div = N - correction > 0 ? N - correction : 0;
  eng_tensor* x = eng_tensor_to_dtype(t0, cdt);
  eng_tensor* mu = x ? eng_mean(x, nd, dims, 1) : NULL;
  eng_tensor* d = mu ? eng_sub(x, mu) : NULL;
  eng_tensor* sq = d ? eng_mul(d, d) : NULL;
  eng_tensor* s = sq ? eng_sum(sq, nd, dims, 1) : NULL;
  eng_tensor* v = s ? eng_div_scalar(s, div) : NULL;
  rel3(NULL, x, mu, d); rel3(NULL, sq, s, NULL);
  if (v && op == ENG_R2_STD) {
    /* sqrt with PyTorch's std gradient: g / (2 std), 0 where std == 0 (not inf * 0) */
    eng_tensor* vd = eng_tensor_detach(v);
    eng_tensor* y = vd ? eng_sqrt(vd) : NULL;
    eng_tensor_release(vd);
    if (y && eng_any_requires_grad(1, &v)) {
      eng_node* n = eng_record("StdBackward", std_bw, 1, &v, y);
      if (!n || eng_node_save(n, y)) { eng_tensor_release(y); y = NULL; }
    }
    eng_tensor_release(v);
    v = y;
  }
  return finish(v, t0, mask, keepdim, t0->dtype);
}

static eng_tensor* all_any(int op, eng_tensor* t, int64_t mask, int keepdim) {
  int dims[ENG_MAX_DIMS];
  int nd = mask_dims(mask, t->ndim, dims);
  eng_tensor* z = eng_compare_scalar(t, 0.0, op == ENG_R2_ALL ? ENG_EQ : ENG_NE);
  eng_tensor* s = z ? eng_sum(z, nd, dims, keepdim) : NULL;
  eng_tensor* r = s ? eng_compare_scalar(s, 0.0, op == ENG_R2_ALL ? ENG_EQ : ENG_GT) : NULL;
  return rel3(r, z, s, NULL);
}

/* ------------------------------------------------------------ vector norm */
static int norm_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor *x = eng_node_saved(n, 0), *y = eng_node_saved(n, 1);
  if (!x || !y) return -1;
  int64_t mask = n->ints[0];
  double p = n->scalars[0];
  eng_tensor* yk = g_keep(y, x, mask);
  eng_tensor* gk = yk ? g_keep(go[0], x, mask) : NULL;
  eng_tensor* r = NULL;
  if (gk) {
    if (p == 0) {
      r = eng_tensor_zeros(x->ndim, x->shape, x->dtype, x->device);
    } else if (p == 1) {
      eng_tensor* sg = eng_sign(x);
      r = sg ? eng_mul(gk, sg) : NULL;
      eng_tensor_release(sg);
    } else if (isinf(p)) {
      /* sign(x) * (|x| == norm) / count */
      int dims[ENG_MAX_DIMS];
      int nd = mask_dims(mask, x->ndim, dims);
      eng_tensor* ax = eng_abs(x);
      eng_tensor* eq = ax ? eng_compare(ax, yk, ENG_EQ) : NULL;
      eng_tensor* cnt = eq ? eng_sum(eq, nd, dims, 1) : NULL;
      eng_tensor* w = cnt ? eng_div(eq, cnt) : NULL;
      eng_tensor* sg = w ? eng_sign(x) : NULL;
      eng_tensor* sw = sg ? eng_mul(sg, w) : NULL;
      r = sw ? eng_mul(gk, sw) : NULL;
      rel3(NULL, ax, eq, cnt); rel3(NULL, w, sg, sw);
    } else {
      /* g * x |x|^(p-2) / norm^(p-1), 0 where norm == 0 (and where x == 0 for p < 2) */
      eng_tensor* a = NULL;
      if (p == 2) a = eng_tensor_retain(x);
      else {
        eng_tensor* ax = eng_abs(x);
        eng_tensor* pw = ax ? eng_pow_scalar(ax, p - 2) : NULL;
        a = pw ? eng_mul(x, pw) : NULL;
        eng_tensor* xz = (a && p < 2) ? eng_compare_scalar(x, 0.0, ENG_EQ) : NULL;
        if (xz) { eng_tensor* a2 = eng_masked_fill(a, xz, 0.0); eng_tensor_release(a); a = a2; }
        rel3(NULL, ax, pw, xz);
      }
      eng_tensor* yp = a ? (p == 2 ? eng_tensor_retain(yk) : eng_pow_scalar(yk, p - 1)) : NULL;
      eng_tensor* sc = yp ? eng_div(gk, yp) : NULL;
      eng_tensor* yz = sc ? eng_compare_scalar(yk, 0.0, ENG_EQ) : NULL;
      eng_tensor* sc2 = yz ? eng_masked_fill(sc, yz, 0.0) : NULL;
      r = sc2 ? eng_mul(a, sc2) : NULL;
      rel3(NULL, a, yp, sc); rel3(NULL, yz, sc2, NULL);
    }
  }
  eng_tensor_release(yk); eng_tensor_release(gk);
  if (!r) return -1;
  gi[0] = eng_grad_to_input(n, 0, r);
  eng_tensor_release(r);
  return gi[0] ? 0 : -1;
}

static eng_tensor* vnorm(eng_tensor* t0, int64_t mask, int keepdim, double p) {
  if (!eng_dtype_is_floating(t0->dtype))
    return eng_errp("norm: expected a floating point tensor, got %s (convert with :float() first)", eng_desc(t0));
  if (isnan(p)) return eng_errp("norm: ord must be a number, got NaN");
  int cdt = low_prec(t0->dtype) ? ENG_F32 : t0->dtype;
  int dims[ENG_MAX_DIMS];
  int nd = mask_dims(mask, t0->ndim, dims);
  eng_tensor* x = eng_tensor_to_dtype(t0, cdt);
  eng_tensor* xd = x ? eng_tensor_detach(x) : NULL;
  eng_tensor* r = NULL;
  if (xd) {
    if (p == 0) {
      eng_tensor* nz = eng_compare_scalar(xd, 0.0, ENG_NE);
      eng_tensor* s = nz ? eng_sum(nz, nd, dims, 1) : NULL;
      r = s ? eng_tensor_to_dtype(s, cdt) : NULL;
      rel3(NULL, nz, s, NULL);
    } else if (isinf(p)) {
      eng_tensor* ax = eng_abs(xd);
      if (ax && ax->numel == 0 && p < 0)
        r = eng_errp("norm: %s: ord -inf of an empty tensor is undefined", eng_desc(t0));
      else if (ax && ax->numel == 0) {
        int64_t ks[ENG_MAX_DIMS];
        int kn = out_shape(t0, mask, 1, ks);
        r = eng_tensor_zeros(kn, ks, cdt, t0->device);
      } else if (ax) r = row_reduce(p > 0 ? ENG_R2_AMAX : ENG_R2_AMIN, ax, mask, 1);
      eng_tensor_release(ax);
    } else if (p == 1) {
      eng_tensor* ax = eng_abs(xd);
      r = ax ? eng_sum(ax, nd, dims, 1) : NULL;
      eng_tensor_release(ax);
    } else if (p == 2) {
      eng_tensor* sq = eng_mul(xd, xd);
      eng_tensor* s = sq ? eng_sum(sq, nd, dims, 1) : NULL;
      r = s ? eng_sqrt(s) : NULL;
      rel3(NULL, sq, s, NULL);
    } else {
      eng_tensor* ax = eng_abs(xd);
      eng_tensor* pw = ax ? eng_pow_scalar(ax, p) : NULL;
      eng_tensor* s = pw ? eng_sum(pw, nd, dims, 1) : NULL;
      r = s ? eng_pow_scalar(s, 1.0 / p) : NULL;
      rel3(NULL, ax, pw, s);
    }
  }
  eng_tensor_release(xd);
  if (r && eng_any_requires_grad(1, &x)) {
    eng_node* n = eng_record("NormBackward", norm_bw, 1, &x, r);
    if (!n || eng_node_save(n, x) || eng_node_save(n, r)) { eng_tensor_release(r); r = NULL; }
    else { n->ints[0] = mask; n->scalars[0] = p; }
  }
  eng_tensor_release(x);
  return finish(r, t0, mask, keepdim, t0->dtype);
}

/* ------------------------------------------------------------ entry points */
eng_tensor* eng_reduce2_op(int op, eng_tensor* t, int64_t mask, int keepdim, double s) {
  const char* name = r2_names[op];
  ENG_CHECK(t, name);
  if (eng_meta_check(t, name)) return NULL;
  switch (op) {
    case ENG_R2_PROD: case ENG_R2_AMAX: case ENG_R2_AMIN: return row_reduce(op, t, mask, keepdim);
    case ENG_R2_LSE: return lse(t, mask, keepdim);
    case ENG_R2_VAR: case ENG_R2_STD: return var_std(op, t, mask, keepdim, s);
    case ENG_R2_NORM: return vnorm(t, mask, keepdim, s);
    case ENG_R2_ALL: case ENG_R2_ANY: return all_any(op, t, mask, keepdim);
  }
  return eng_errp("reduce: unknown op %d", op);
}

static eng_tensor* r2(int op, eng_tensor* t, int n_dims, const int* dims, int keepdim, double s) {
  const char* name = r2_names[op];
  ENG_CHECK(t, name);
  int64_t mask = eng_dims_mask(t->ndim, n_dims, dims, name);
  if (mask < 0) return NULL;
  keepdim = keepdim ? 1 : 0;
  if (ENG_DT_ACTIVE(t->dist || ENG_META_T(t)))
    return eng_op_dispatch(ENG_OP_REDUCE2, &(eng_op_call){.name = name, .n_in = 1, .in = {t},
                                                            .ints = {op, mask, keepdim}, .scalars = {s}});
  return eng_reduce2_op(op, t, mask, keepdim, s);
}

eng_tensor* eng_prod(eng_tensor* t, int n_dims, const int* dims, int keepdim) {
  return r2(ENG_R2_PROD, t, n_dims, dims, keepdim, 0);
}
eng_tensor* eng_amax(eng_tensor* t, int n_dims, const int* dims, int keepdim) {
  return r2(ENG_R2_AMAX, t, n_dims, dims, keepdim, 0);
}
eng_tensor* eng_amin(eng_tensor* t, int n_dims, const int* dims, int keepdim) {
  return r2(ENG_R2_AMIN, t, n_dims, dims, keepdim, 0);
}
eng_tensor* eng_logsumexp(eng_tensor* t, int n_dims, const int* dims, int keepdim) {
  return r2(ENG_R2_LSE, t, n_dims, dims, keepdim, 0);
}
eng_tensor* eng_var(eng_tensor* t, int n_dims, const int* dims, double correction, int keepdim) {
  return r2(ENG_R2_VAR, t, n_dims, dims, keepdim, correction);
}
eng_tensor* eng_std(eng_tensor* t, int n_dims, const int* dims, double correction, int keepdim) {
  return r2(ENG_R2_STD, t, n_dims, dims, keepdim, correction);
}
eng_tensor* eng_vector_norm(eng_tensor* t, double ord, int n_dims, const int* dims, int keepdim) {
  return r2(ENG_R2_NORM, t, n_dims, dims, keepdim, ord);
}
eng_tensor* eng_all(eng_tensor* t, int n_dims, const int* dims, int keepdim) {
  return r2(ENG_R2_ALL, t, n_dims, dims, keepdim, 0);
}
eng_tensor* eng_any(eng_tensor* t, int n_dims, const int* dims, int keepdim) {
  return r2(ENG_R2_ANY, t, n_dims, dims, keepdim, 0);
}
