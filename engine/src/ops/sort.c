/* sort.c: ops along one dim: cumsum, cumprod, sort, argsort, topk,
 * kthvalue, with autograd.  The input is transposed so the dim is innermost
 * and made contiguous ([M, r] rows); the kernels (kernels/cpu/math.c) work
 * on rows; results are transposed back.
 *   cumsum: gradient = reverse cumsum of g; cumprod: exact with zeros
 *   (kernel); sort/topk/kthvalue: the gradient of the values goes to the
 *   selected positions (indices have none).
 * Ordering as PyTorch on CPU: sort is stable (equal values keep their
 * order, in both directions), NaN larger than every number (last
 * ascending, first descending); topk and kthvalue run PyTorch's selection
 * algorithms (kernels/cpu/math.c), so which of equal values (and which NaN)
 * is returned, and in what order, matches PyTorch exactly.
 * CUDA tensors: host fallback (copy, CPU kernel, copy back).  DTensors:
 * sharding/math.c (the dim replicated first). */
#include "core/internal.h"
#include "ops/ops.h"
#include "kernels/cpu/kcpu.h"
#include "kernels/cpu/kmath.h"
#include "autograd/autograd.h"
#include "eng/ops_shape.h"
#include <math.h>

static const char* const al_names[] = {"cumsum", "cumprod", "argsort", "sort", "topk", "kthvalue"};

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

/* t (detached, host) with dim moved last, contiguous, of dtype dt. */
static eng_tensor* rows_of(eng_tensor* t, int dim, int dt) {
  if ((t->ndim <= 1 || dim == t->ndim - 1) && t->dtype == dt && t->device != ENG_CUDA && eng_tensor_is_contiguous(t))
    return eng_tensor_retain(t); /* rows already */
  eng_tensor* d = eng_tensor_detach(t);
  eng_tensor* h = d ? host_of(d) : NULL;
  eng_tensor* tr = h ? (t->ndim > 1 ? eng_transpose(h, dim, t->ndim - 1) : eng_tensor_retain(h)) : NULL;
  eng_tensor* r = tr ? eng_as_contig(tr, dt) : NULL;
  eng_tensor_release(d); eng_tensor_release(h); eng_tensor_release(tr);
  return r;
}
/* Rows (contiguous, shape = t's with dim last and size r there) back: dim in place, contiguous, on device. */
static eng_tensor* unrows(eng_tensor* rows, int dim, int device) {
  if (rows->ndim <= 1 || dim == rows->ndim - 1) return to_dev(eng_tensor_retain(rows), device);
  eng_tensor* tr = rows->ndim > 1 ? eng_transpose(rows, dim, rows->ndim - 1) : eng_tensor_retain(rows);
  eng_tensor* c = tr ? eng_tensor_contiguous(tr) : NULL;
  eng_tensor_release(tr);
  return to_dev(c, device);
}
/* New contiguous rows tensor: t's shape with dim moved last and sized r. */
static eng_tensor* new_rows(const eng_tensor* t, int dim, int64_t r, int dt) {
  int64_t s[ENG_MAX_DIMS];
  int nd = t->ndim ? t->ndim : 1;
  for (int i = 0; i < t->ndim; i++) s[i] = t->shape[i];
  if (t->ndim == 0) s[0] = 1;
  int64_t last = s[nd - 1];
  s[dim] = last;
  s[nd - 1] = r;
  return eng_new(t->ndim, s, dt, ENG_CPU);
}

static int scan_dt(int dt) {
  if (!eng_dtype_is_floating(dt)) return ENG_I64;
  return dt;
}

/* ------------------------------------------------------------ cumsum / cumprod */
static eng_tensor* cumsum_raw(eng_tensor* t, int dim, int reverse, int odt) {
  int cdt = (odt == ENG_BF16 || odt == ENG_F16) ? ENG_F32 : odt;
  eng_tensor* X = rows_of(t, dim, cdt);
  if (!X) return NULL;
  int64_t r = t->ndim ? t->shape[dim] : 1, m = r ? X->numel / r : 0;
  eng_tensor* Y = eng_new(X->ndim, X->shape, cdt, ENG_CPU);
  if (Y && X->numel) km_cumsum_rows(cdt, reverse, m, r, eng_ptr(X), eng_ptr(Y));
  eng_tensor_release(X);
  if (!Y) return NULL;
  eng_tensor* out = unrows(Y, dim, t->device);
  eng_tensor_release(Y);
  if (out && out->dtype != odt) { eng_tensor* c = eng_tensor_to_dtype(out, odt); eng_tensor_release(out); out = c; }
  return out;
}

static int cumsum_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor* r = cumsum_raw(go[0], (int)n->ints[0], 1, go[0]->dtype);
  if (!r) return -1;
  gi[0] = eng_grad_to_input(n, 0, r);
  eng_tensor_release(r);
  return gi[0] ? 0 : -1;
}

static eng_tensor* cumprod_raw(eng_tensor* t, int dim, int odt) {
  int cdt = (odt == ENG_BF16 || odt == ENG_F16) ? ENG_F32 : odt;
  eng_tensor* X = rows_of(t, dim, cdt);
  if (!X) return NULL;
  int64_t r = t->ndim ? t->shape[dim] : 1, m = r ? X->numel / r : 0;
  eng_tensor* Y = eng_new(X->ndim, X->shape, cdt, ENG_CPU);
  if (Y && X->numel) km_cumprod_rows(cdt, m, r, eng_ptr(X), eng_ptr(Y));
  eng_tensor_release(X);
  if (!Y) return NULL;
  eng_tensor* out = unrows(Y, dim, t->device);
  eng_tensor_release(Y);
  if (out && out->dtype != odt) { eng_tensor* c = eng_tensor_to_dtype(out, odt); eng_tensor_release(out); out = c; }
  return out;
}

static int cumprod_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor* x = eng_node_saved(n, 0);
  if (!x) return -1;
  int dim = (int)n->ints[0];
  int dt = go[0]->dtype == ENG_F64 ? ENG_F64 : ENG_F32;
  eng_tensor* X = rows_of(x, dim, dt);
  eng_tensor* G = X ? rows_of(go[0], dim, dt) : NULL;
  eng_tensor* GI = G ? eng_new(X->ndim, X->shape, dt, ENG_CPU) : NULL;
  eng_tensor* r = NULL;
  if (GI) {
    int64_t rr = x->ndim ? x->shape[dim] : 1;
    if (X->numel) km_cumprod_grad_rows(dt, X->numel / rr, rr, eng_ptr(X), eng_ptr(G), eng_ptr(GI));
    r = unrows(GI, dim, x->device);
  }
  eng_tensor_release(X); eng_tensor_release(G); eng_tensor_release(GI);
  if (!r) return -1;
  gi[0] = eng_grad_to_input(n, 0, r);
  eng_tensor_release(r);
  return gi[0] ? 0 : -1;
}

/* ------------------------------------------------------------ selections */
/* Values' gradient to the selected positions: ints[0] = dim, ints[1] = keepdim
 * (kthvalue without keepdim: g lacks dim); saved 0 = indices (i64, the output's shape). */
static int select_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor* idx = eng_node_saved(n, 0);
  if (!idx) return -1;
  int dim = (int)n->ints[0];
  int nd = eng_node_in_ndim(n, 0);
  const int64_t* ishape = eng_node_in_shape(n, 0);
  eng_tensor* g = go[0];
  eng_tensor *gu = NULL, *iu = NULL;
  if (!n->ints[1]) {
    gu = eng_unsqueeze(g, dim);
    iu = gu ? eng_unsqueeze(idx, dim) : NULL;
  } else {
    gu = eng_tensor_retain(g);
    iu = eng_tensor_retain(idx);
  }
  int dt = g->dtype == ENG_F64 ? ENG_F64 : ENG_F32;
  eng_tensor* G = iu ? rows_of(gu, dim, dt) : NULL;
  eng_tensor* I = G ? rows_of(iu, dim, ENG_I64) : NULL;
  eng_tensor* r = NULL;
  if (I) {
    int64_t R = nd ? ishape[dim] : 1, k = nd ? gu->shape[dim] : 1;
    eng_tensor* shp = eng_tensor_empty(nd, ishape, dt, ENG_CPU); /* geometry for new_rows */
    eng_tensor* GI = shp ? new_rows(shp, dim, R, dt) : NULL;
    if (GI) {
      memset(eng_ptr(GI), 0, (size_t)(GI->numel * eng_dtype_size(dt)));
      if (G->numel) km_scatter_rows(dt, G->numel / k, R, k, (const int64_t*)eng_ptr(I), eng_ptr(G), eng_ptr(GI));
      r = unrows(GI, dim, g->device);
    }
    eng_tensor_release(shp); eng_tensor_release(GI);
  }
  eng_tensor_release(gu); eng_tensor_release(iu); eng_tensor_release(G); eng_tensor_release(I);
  if (!r) return -1;
  gi[0] = eng_grad_to_input(n, 0, r);
  eng_tensor_release(r);
  return gi[0] ? 0 : -1;
}

/* sort / argsort / topk / kthvalue values and indices (plain tensors). */
static int select_op(int op, eng_tensor* t, int dim, int64_t k, int flag, eng_tensor** values, eng_tensor** indices) {
  const char* name = al_names[op];
  int64_t r = t->ndim ? t->shape[dim] : 1;
  int desc = (op == ENG_AL_SORT || op == ENG_AL_ARGSORT) ? flag : 0;
  int64_t take = r, start = 0;
  if (op == ENG_AL_TOPK) {
    if (k < 0 || k > r)
      return eng_err("topk: k = %lld is out of range for dim %d of %s (size %lld)", (long long)k, dim + 1,
                     eng_desc(t), (long long)r);
    take = k;
  } else if (op == ENG_AL_KTH) {
    if (k < 1 || k > r)
      return eng_err("kthvalue: k = %lld is out of range for dim %d of %s (k is 1-based, size %lld)", (long long)k,
                     dim + 1, eng_desc(t), (long long)r);
    start = k - 1;
    take = 1;
  }
  eng_tensor* X = rows_of(t, dim, t->dtype);
  if (!X) return -1;
  int64_t m = r ? X->numel / r : 0;
  int64_t* perm = malloc(sizeof(int64_t) * (size_t)(m * r > 0 ? m * r : 1));
  eng_tensor* V = perm ? new_rows(t, dim, take, t->dtype) : NULL;
  eng_tensor* I = V ? new_rows(t, dim, take, ENG_I64) : NULL;
  if (!perm) eng_err("%s: out of memory", name);
  if (I && m * r > 0) {
    int64_t* ip = (int64_t*)eng_ptr(I);
    if (op == ENG_AL_TOPK) {
      km_topk_rows(t->dtype, flag & 1, (flag >> 1) & 1, m, r, take, eng_ptr(X), ip);
    } else if (op == ENG_AL_KTH) {
      km_kth_rows(t->dtype, m, r, start, eng_ptr(X), ip);
    } else {
      km_sort_rows(t->dtype, desc, m, r, eng_ptr(X), perm);
      memcpy(ip, perm, sizeof(int64_t) * (size_t)(m * r));
    }
    km_gather_rows(eng_dtype_size(t->dtype), m, r, take, ip, eng_ptr(X), eng_ptr(V));
  }
  free(perm);
  eng_tensor_release(X);
  eng_tensor* vo = V ? unrows(V, dim, t->device) : NULL;
  eng_tensor* io = (vo && I) ? unrows(I, dim, t->device) : NULL;
  eng_tensor_release(V); eng_tensor_release(I);
  if (!io) { eng_tensor_release(vo); return -1; }
  if (op == ENG_AL_KTH && !flag && t->ndim > 0) {
    int64_t s[ENG_MAX_DIMS];
    int nd = 0;
    for (int d = 0; d < t->ndim; d++) if (d != dim) s[nd++] = t->shape[d];
    eng_tensor* v2 = eng_view(vo, nd, s);
    eng_tensor* i2 = v2 ? eng_view(io, nd, s) : NULL;
    eng_tensor_release(vo); eng_tensor_release(io);
    vo = v2; io = i2;
    if (!io) { eng_tensor_release(vo); return -1; }
  }
  if (eng_any_requires_grad(1, &t) && eng_dtype_is_floating(t->dtype)) {
    eng_node* nd = eng_record(op == ENG_AL_KTH ? "KthvalueBackward" : op == ENG_AL_TOPK ? "TopkBackward" : "SortBackward",
                              select_bw, 1, &t, vo);
    if (!nd || eng_node_save(nd, io)) { eng_tensor_release(vo); eng_tensor_release(io); return -1; }
    nd->ints[0] = dim;
    nd->ints[1] = op == ENG_AL_KTH ? flag : 1;
  }
  *values = vo;
  if (indices) *indices = io; else eng_tensor_release(io);
  return 0;
}

int eng_along_op(int op, eng_tensor* t, int dim, int64_t k, int flag, eng_tensor** values, eng_tensor** indices) {
  const char* name = al_names[op];
  ENG_CHECK_I(t, name);
  if (eng_meta_check(t, name)) return -1;
  if (indices) *indices = NULL;
  *values = NULL;
  if (op == ENG_AL_CUMSUM || op == ENG_AL_CUMPROD) {
    int odt = scan_dt(t->dtype);
    eng_tensor* out = op == ENG_AL_CUMSUM ? cumsum_raw(t, dim, 0, odt) : cumprod_raw(t, dim, odt);
    if (!out) return -1;
    if (eng_any_requires_grad(1, &t) && eng_dtype_is_floating(out->dtype)) {
      eng_node* nd = eng_record(op == ENG_AL_CUMSUM ? "CumsumBackward" : "CumprodBackward",
                                op == ENG_AL_CUMSUM ? cumsum_bw : cumprod_bw, 1, &t, out);
      if (!nd || (op == ENG_AL_CUMPROD && eng_node_save(nd, t))) { eng_tensor_release(out); return -1; }
      nd->ints[0] = dim;
    }
    *values = out;
    return 0;
  }
  return select_op(op, t, dim, k, flag, values, indices);
}

/* ------------------------------------------------------------ public */
/* Plain meta tensors: shapes and dtypes only (k checked against the real size). */
static int meta_along(int op, eng_tensor* t, int dim, int64_t k, int flag, eng_tensor** values, eng_tensor** indices) {
  const char* name = al_names[op];
  int64_t r = t->ndim ? t->shape[dim] : 1;
  if (op == ENG_AL_TOPK && (k < 0 || k > r))
    return eng_err("topk: k = %lld is out of range for dim %d of %s (size %lld)", (long long)k, dim + 1, eng_desc(t),
                   (long long)r);
  if (op == ENG_AL_KTH && (k < 1 || k > r))
    return eng_err("kthvalue: k = %lld is out of range for dim %d of %s (k is 1-based, size %lld)", (long long)k,
                   dim + 1, eng_desc(t), (long long)r);
  int64_t s[ENG_MAX_DIMS];
  int nd = 0;
  for (int i = 0; i < t->ndim; i++) {
    if (i != dim) { s[nd++] = t->shape[i]; continue; }
    if (op == ENG_AL_TOPK) s[nd++] = k;
    else if (op == ENG_AL_KTH) { if (flag) s[nd++] = 1; }
    else s[nd++] = t->shape[i];
  }
  int vdt = (op == ENG_AL_CUMSUM || op == ENG_AL_CUMPROD) ? scan_dt(t->dtype) : t->dtype;
  *values = eng_tensor_empty(nd, s, vdt, ENG_META);
  if (!*values) return eng_err("%s: cannot make a meta tensor", name);
  if (indices) {
    *indices = eng_tensor_empty(nd, s, ENG_I64, ENG_META);
    if (!*indices) { eng_tensor_release(*values); *values = NULL; return -1; }
  }
  return 0;
}

static int along(int op, eng_tensor* t, int dim, int64_t k, int flag, eng_tensor** values, eng_tensor** indices) {
  const char* name = al_names[op];
  ENG_CHECK_I(t, name);
  int d = eng_norm_dim(dim, t->ndim ? t->ndim : 1, name);
  if (d < 0) return -1;
  if (t->ndim == 0) d = 0;
  if (ENG_META_T(t) && !t->dist && !eng_dispatch_local_mode()) return meta_along(op, t, d, k, flag, values, indices);
  if (ENG_DT_ACTIVE(t->dist || ENG_META_T(t))) {
    eng_op_call c = {.name = name, .n_in = 1, .in = {t}, .ints = {op, d, k, flag}};
    if (op == ENG_AL_SORT || op == ENG_AL_TOPK || op == ENG_AL_KTH) {
      eng_tensor* outs[2] = {NULL, NULL};
      if (eng_op_dispatch_multi(ENG_OP_ALONG2, &c, outs) < 0) return -1;
      *values = outs[0];
      if (indices) *indices = outs[1]; else eng_tensor_release(outs[1]);
      return 0;
    }
    *values = eng_op_dispatch(ENG_OP_ALONG, &c);
    return *values ? 0 : -1;
  }
  return eng_along_op(op, t, d, k, flag, values, indices);
}

eng_tensor* eng_cumsum(eng_tensor* t, int dim) {
  eng_tensor* v = NULL;
  return along(ENG_AL_CUMSUM, t, dim, 0, 0, &v, NULL) ? NULL : v;
}
eng_tensor* eng_cumprod(eng_tensor* t, int dim) {
  eng_tensor* v = NULL;
  return along(ENG_AL_CUMPROD, t, dim, 0, 0, &v, NULL) ? NULL : v;
}
eng_tensor* eng_sort(eng_tensor* t, int dim, int descending, eng_tensor** indices) {
  eng_tensor* v = NULL;
  return along(ENG_AL_SORT, t, dim, 0, descending ? 1 : 0, &v, indices) ? NULL : v;
}
eng_tensor* eng_argsort(eng_tensor* t, int dim, int descending) {
  ENG_CHECK(t, "argsort");
  int d = eng_norm_dim(dim, t->ndim ? t->ndim : 1, "argsort");
  if (d < 0) return NULL;
  if (t->ndim == 0) d = 0;
  if (ENG_META_T(t) && !t->dist && !eng_dispatch_local_mode()) {
    eng_tensor *v = NULL, *i = NULL;
    if (meta_along(ENG_AL_SORT, t, d, 0, 0, &v, &i)) return NULL;
    eng_tensor_release(v);
    return i;
  }
  if (ENG_DT_ACTIVE(t->dist || ENG_META_T(t)))
    return eng_op_dispatch(ENG_OP_ALONG, &(eng_op_call){.name = "argsort", .n_in = 1, .in = {t},
                                                          .ints = {ENG_AL_ARGSORT, d, 0, descending ? 1 : 0}});
  eng_tensor *v = NULL, *i = NULL;
  if (eng_along_op(ENG_AL_SORT, t, d, 0, descending ? 1 : 0, &v, &i)) return NULL;
  eng_tensor_release(v);
  return i;
}
eng_tensor* eng_topk(eng_tensor* t, int64_t k, int dim, int largest, int sorted, eng_tensor** indices) {
  eng_tensor* v = NULL;
  return along(ENG_AL_TOPK, t, dim, k, (largest ? 1 : 0) | (sorted ? 2 : 0), &v, indices) ? NULL : v;
}
eng_tensor* eng_kthvalue(eng_tensor* t, int64_t k, int dim, int keepdim, eng_tensor** indices) {
  eng_tensor* v = NULL;
  return along(ENG_AL_KTH, t, dim, k, keepdim ? 1 : 0, &v, indices) ? NULL : v;
}
