/* index.c: indexing ops along a dim (torch.gather / scatter family): gather, scatter /
 * scatter_add, index_add, index_copy (with their autograd) and nonzero.
 * Index values are 0-based data (i32/i64), checked in range on the host.
 *
 * Backward formulas call the same public ops (so they run on DTensor locals
 * and on any device): gather -> scatter_add into zeros; scatter (replace) ->
 * x: g with the written positions zeroed, src: gather(g); scatter_add -> x: g,
 * src: gather(g); index_add -> x: g, src: alpha * index_select(g);
 * index_copy -> x: index_copy(g, zeros), src: index_select(g).
 *
 * CUDA: gather, scatter (replace) and index_copy of every dtype, scatter_add
 * and index_add of f32/f64/i32/i64 run the kernels of kernels/cuda/index.cu
 * (ops/cuda_index.c); the index is checked on the host first (one small copy to
 * the host and back).  The remaining cases (scatter_add / index_add of
 * bf16, f16, u8, bool: no atomics for them there) and nonzero take the
 * documented fallback: the CUDA operands are copied to the host, the CPU
 * kernel runs there and the result goes back to the device.  The DTensor
 * rules are in sharding/index.c. */
#include "core/internal.h"
#include "ops/ops.h"
#include "core/dispatch.h"
#include "kernels/cpu/kindex.h"
#include "ops/cuda_index.h"
#include "autograd/autograd.h"
#include "eng/ops_index.h"
#include "eng/ops_pointwise.h"
#include "eng/ops_shape.h"

/* The host fallback's copies (ops.h). */
eng_tensor* eng_op_host(eng_tensor* t, int dtype) {
  eng_tensor* c = eng_as_contig(t, dtype);
  if (!c || c->device == ENG_CPU) return c;
  int prev = eng_set_grad_enabled(0);
  eng_tensor* h = eng_tensor_to_device(c, ENG_CPU);
  eng_set_grad_enabled(prev);
  eng_tensor_release(c);
  return h;
}

eng_tensor* eng_op_to_device(eng_tensor* r, int device) {
  if (!r || device == ENG_CPU) return r;
  int prev = eng_set_grad_enabled(0);
  eng_tensor* d = eng_tensor_to_device(r, device);
  eng_set_grad_enabled(prev);
  eng_tensor_release(r);
  return d;
}

/* The index values as a host i64 tensor, each checked in [0, size). */
static eng_tensor* read_index(eng_tensor* index, int64_t size, const char* op, int d, const eng_tensor* x) {
  eng_tensor* h = eng_op_host(index, ENG_I64);
  if (!h) return NULL;
  const int64_t* p = (const int64_t*)eng_ptr(h);
  for (int64_t j = 0; j < h->numel; j++)
    if (p[j] < 0 || p[j] >= size) {
      eng_errp("%s: index %lld (at flat position %lld of index %s) is out of range for dim %d of size %lld in %s "
               "(index values are 0-based)", op, (long long)p[j], (long long)j + 1, eng_desc(index), d + 1,
               (long long)size, eng_desc(x));
      eng_tensor_release(h);
      return NULL;
    }
  return h;
}

static int index_dtype_ok(const eng_tensor* index) { return index->dtype == ENG_I32 || index->dtype == ENG_I64; }

static int64_t shp(const eng_tensor* t, int k) { return t->ndim ? t->shape[k] : 1; }

/* ------------------------------------------------------------------ gather */
static int gather_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor* index = eng_node_saved(n, 0);
  if (!index || !go[0]) return index ? 0 : -1;
  eng_tensor* z = eng_tensor_zeros(eng_node_in_ndim(n, 0), eng_node_in_shape(n, 0), go[0]->dtype, go[0]->device);
  eng_tensor* g = z ? eng_scatter(z, (int)n->ints[0], index, go[0], 1) : NULL;
  eng_tensor_release(z);
  if (!g) return -1;
  gi[0] = eng_grad_to_input(n, 0, g);
  eng_tensor_release(g);
  return gi[0] ? 0 : -1;
}

eng_tensor* eng_gather(eng_tensor* x, int dim, eng_tensor* index) {
  const char* op = "gather";
  ENG_CHECK(x, op); ENG_CHECK(index, op);
  if (eng_meta_check_local(x, op) || eng_meta_check_local(index, op)) return NULL;
  if (ENG_DT_ACTIVE(x->dist || index->dist || ENG_META_T(x) || ENG_META_T(index)))
    return eng_op_dispatch(ENG_OP_GATHER, &(eng_op_call){.name = "gather", .n_in = 2, .in = {x, index}, .ints = {dim}});
  if (!index_dtype_ok(index)) return eng_errp("%s: index must be i32 or i64, got %s", op, eng_desc(index));
  if (index->ndim != x->ndim)
    return eng_errp("%s: index %s and input %s must have the same number of dims", op, eng_desc(index), eng_desc(x));
  if (index->device != x->device)
    return eng_errp("%s: index %s and input %s are on different devices", op, eng_desc(index), eng_desc(x));
  int nd = x->ndim ? x->ndim : 1;
  int d = eng_norm_dim(dim, nd, op);
  if (d < 0) return NULL;
  for (int k = 0; k < x->ndim; k++)
    if (k != d && index->shape[k] > x->shape[k])
      return eng_errp("%s: index %s is larger than input %s in dim %d (index.size(k) <= input.size(k) for every "
                      "dim k other than dim %d)", op, eng_desc(index), eng_desc(x), k + 1, d + 1);
  eng_tensor* I = read_index(index, shp(x, d), op, d, x);
  if (!I) return NULL;
  int64_t ish[8], xsh[8];
  for (int k = 0; k < nd; k++) { ish[k] = shp(index, k); xsh[k] = shp(x, k); }
  eng_tensor* out = NULL;
  int rc = 1;
  if (x->device == ENG_CUDA) { /* native kernel */
    eng_tensor* Xd = eng_as_contig(x, x->dtype);
    out = Xd ? eng_new(index->ndim, index->shape, x->dtype, ENG_CUDA) : NULL;
    rc = out ? eng_cu_index_gather(eng_dtype_size(x->dtype), nd, ish, xsh, d, eng_ptr(out), eng_ptr(Xd),
                                   (const int64_t*)eng_ptr(I), I->numel, op) : -1;
    eng_tensor_release(Xd);
    if (rc != 0) { eng_tensor_release(out); out = NULL; }
    if (rc < 0) { eng_tensor_release(I); return NULL; }
  }
  if (rc == 1) { /* CPU, or the host fallback */
    eng_tensor* X = eng_op_host(x, x->dtype);
    out = X ? eng_new(index->ndim, index->shape, x->dtype, ENG_CPU) : NULL;
    if (out)
      kc_gather(eng_dtype_size(x->dtype), nd, ish, xsh, d, eng_ptr(out), eng_ptr(X), (const int64_t*)eng_ptr(I));
    out = eng_op_to_device(out, x->device);
    eng_tensor_release(X);
  }
  if (out && eng_dtype_is_floating(x->dtype) && eng_any_requires_grad(1, &x)) {
    eng_node* n = eng_record("GatherBackward", gather_bw, 1, &x, out);
    if (!n || eng_node_save(n, index)) { eng_tensor_release(out); out = NULL; }
    else n->ints[0] = d;
  }
  eng_tensor_release(I);
  return out;
}

/* ------------------------------------------------------------------ scatter / scatter_add */
static int scatter_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor* index = eng_node_saved(n, 0);
  if (!index) return -1;
  if (!go[0]) return 0;
  int d = (int)n->ints[0], reduce = (int)n->ints[1];
  if (eng_node_needs_grad(n, 0)) {
    eng_tensor* g;
    if (reduce) g = eng_tensor_retain(go[0]);
    else {
      eng_tensor* z = eng_tensor_zeros(index->ndim, index->shape, go[0]->dtype, go[0]->device);
      g = z ? eng_scatter(go[0], d, index, z, 0) : NULL;
      eng_tensor_release(z);
    }
    if (!g) return -1;
    gi[0] = eng_grad_to_input(n, 0, g);
    eng_tensor_release(g);
    if (!gi[0]) return -1;
  }
  if (eng_node_needs_grad(n, 1)) {
    eng_tensor* g = eng_gather(go[0], d, index);
    if (!g) return -1;
    gi[1] = eng_grad_to_input(n, 1, g);
    eng_tensor_release(g);
    if (!gi[1]) return -1;
  }
  return 0;
}

eng_tensor* eng_scatter(eng_tensor* x, int dim, eng_tensor* index, eng_tensor* src, int reduce) {
  const char* op = reduce ? "scatter_add" : "scatter";
  ENG_CHECK(x, op); ENG_CHECK(index, op); ENG_CHECK(src, op);
  if (eng_meta_check_local(x, op) || eng_meta_check_local(index, op) || eng_meta_check_local(src, op)) return NULL;
  if (ENG_DT_ACTIVE(x->dist || index->dist || src->dist || ENG_META_T(x) || ENG_META_T(index) || ENG_META_T(src)))
    return eng_op_dispatch(ENG_OP_SCATTER, &(eng_op_call){.name = "scatter", .n_in = 3, .in = {x, index, src}, .ints = {dim, reduce}});
  if (!index_dtype_ok(index)) return eng_errp("%s: index must be i32 or i64, got %s", op, eng_desc(index));
  if (src->dtype != x->dtype)
    return eng_errp("%s: src %s must have the dtype of the input %s", op, eng_desc(src), eng_desc(x));
  if (index->ndim != x->ndim || src->ndim != x->ndim)
    return eng_errp("%s: input %s, index %s and src %s must have the same number of dims", op, eng_desc(x),
                    eng_desc(index), eng_desc(src));
  if (index->device != x->device || src->device != x->device)
    return eng_errp("%s: input %s, index %s and src %s are on different devices", op, eng_desc(x), eng_desc(index),
                    eng_desc(src));
  int nd = x->ndim ? x->ndim : 1;
  int d = eng_norm_dim(dim, nd, op);
  if (d < 0) return NULL;
  for (int k = 0; k < x->ndim; k++) {
    if (index->shape[k] > src->shape[k])
      return eng_errp("%s: index %s is larger than src %s in dim %d (index.size(k) <= src.size(k) for every dim)",
                      op, eng_desc(index), eng_desc(src), k + 1);
    if (k != d && index->shape[k] > x->shape[k])
      return eng_errp("%s: index %s is larger than input %s in dim %d (index.size(k) <= input.size(k) for every "
                      "dim k other than dim %d)", op, eng_desc(index), eng_desc(x), k + 1, d + 1);
  }
  /* a src larger than index: its leading box (a view, recorded by autograd) */
  eng_tensor* S = eng_tensor_retain(src);
  for (int k = 0; k < x->ndim && S; k++)
    if (S->shape[k] != index->shape[k]) {
      eng_tensor* v = eng_narrow(S, k, 0, index->shape[k]);
      eng_tensor_release(S);
      S = v;
    }
  if (!S) return NULL;
  eng_tensor* I = read_index(index, shp(x, d), op, d, x);
  if (!I) { eng_tensor_release(S); return NULL; }
  int64_t ish[8], xsh[8];
  for (int k = 0; k < nd; k++) { ish[k] = shp(index, k); xsh[k] = shp(x, k); }
  eng_tensor* out = NULL;
  int rc = 1;
  if (x->device == ENG_CUDA) { /* native kernel into a device copy of x */
    eng_tensor* Sd = eng_as_contig(S, x->dtype);
    out = Sd ? eng_new(x->ndim, x->shape, x->dtype, ENG_CUDA) : NULL;
    rc = out && eng_copy_raw(out, x, x->stride) == 0 ? 0 : -1;
    if (rc == 0)
      rc = eng_cu_index_scatter(x->dtype, reduce, nd, ish, xsh, d, eng_ptr(out), eng_ptr(Sd),
                                (const int64_t*)eng_ptr(I), I->numel, op);
    eng_tensor_release(Sd);
    if (rc != 0) { eng_tensor_release(out); out = NULL; }
    if (rc < 0) { eng_tensor_release(I); eng_tensor_release(S); return NULL; }
  }
  if (rc == 1) { /* CPU, or the host fallback */
    eng_tensor* X = eng_op_host(x, x->dtype);
    eng_tensor* Sh = X ? eng_op_host(S, x->dtype) : NULL;
    out = Sh ? eng_new(x->ndim, x->shape, x->dtype, ENG_CPU) : NULL;
    if (out) {
      memcpy(eng_ptr(out), eng_ptr(X), (size_t)(out->numel * eng_dtype_size(out->dtype)));
      kc_scatter(x->dtype, reduce, nd, ish, xsh, d, eng_ptr(out), eng_ptr(Sh), (const int64_t*)eng_ptr(I));
    }
    out = eng_op_to_device(out, x->device);
    eng_tensor_release(X); eng_tensor_release(Sh);
  }
  eng_tensor* ins[2] = {x, S};
  if (out && eng_dtype_is_floating(x->dtype) && eng_any_requires_grad(2, ins)) {
    eng_node* n = eng_record(reduce ? "ScatterAddBackward" : "ScatterBackward", scatter_bw, 2, ins, out);
    if (!n || eng_node_save(n, index)) { eng_tensor_release(out); out = NULL; }
    else { n->ints[0] = d; n->ints[1] = reduce; }
  }
  eng_tensor_release(I); eng_tensor_release(S);
  return out;
}

/* ------------------------------------------------------------------ index_add / index_copy */
static int index_put_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor* index = eng_node_saved(n, 0);
  if (!index) return -1;
  if (!go[0]) return 0;
  int d = (int)n->ints[0], acc = (int)n->ints[1];
  double alpha = n->scalars[0];
  if (eng_node_needs_grad(n, 0)) {
    eng_tensor* g;
    if (acc) g = eng_tensor_retain(go[0]);
    else {
      eng_tensor* z = eng_tensor_zeros(eng_node_in_ndim(n, 1), eng_node_in_shape(n, 1), go[0]->dtype, go[0]->device);
      g = z ? eng_index_copy(go[0], d, index, z) : NULL;
      eng_tensor_release(z);
    }
    if (!g) return -1;
    gi[0] = eng_grad_to_input(n, 0, g);
    eng_tensor_release(g);
    if (!gi[0]) return -1;
  }
  if (eng_node_needs_grad(n, 1)) {
    eng_tensor* g = eng_index_select(go[0], d, index);
    if (g && acc && alpha != 1.0) {
      eng_tensor* s = eng_mul_scalar(g, alpha);
      eng_tensor_release(g);
      g = s;
    }
    if (!g) return -1;
    gi[1] = eng_grad_to_input(n, 1, g);
    eng_tensor_release(g);
    if (!gi[1]) return -1;
  }
  return 0;
}

static eng_tensor* index_put(eng_tensor* x, int dim, eng_tensor* index, eng_tensor* src, int acc, double alpha) {
  const char* op = acc ? "index_add" : "index_copy";
  ENG_CHECK(x, op); ENG_CHECK(index, op); ENG_CHECK(src, op);
  if (eng_meta_check_local(x, op) || eng_meta_check_local(index, op) || eng_meta_check_local(src, op)) return NULL;
  if (ENG_DT_ACTIVE(x->dist || index->dist || src->dist || ENG_META_T(x) || ENG_META_T(index) || ENG_META_T(src)))
    return eng_op_dispatch(ENG_OP_INDEX_PUT, &(eng_op_call){.name = "index_put", .n_in = 3, .in = {x, index, src}, .ints = {dim, acc}, .scalars = {alpha}});
  if (!index_dtype_ok(index)) return eng_errp("%s: index must be i32 or i64, got %s", op, eng_desc(index));
  if (index->ndim > 1) return eng_errp("%s: index must be a 1-D tensor (a vector), got %s", op, eng_desc(index));
  if (src->dtype != x->dtype)
    return eng_errp("%s: source %s must have the dtype of the input %s", op, eng_desc(src), eng_desc(x));
  if (index->device != x->device || src->device != x->device)
    return eng_errp("%s: input %s, index %s and source %s are on different devices", op, eng_desc(x),
                    eng_desc(index), eng_desc(src));
  int nd = x->ndim ? x->ndim : 1;
  int d = eng_norm_dim(dim, nd, op);
  if (d < 0) return NULL;
  int bad = src->ndim != x->ndim;
  for (int k = 0; k < x->ndim && !bad; k++)
    bad = src->shape[k] != (k == d ? index->numel : x->shape[k]);
  if (x->ndim == 0) bad = src->numel != index->numel || index->numel > 1;
  if (bad)
    return eng_errp("%s: source %s must have the input's shape %s with size %lld in dim %d (the number of indices "
                    "in %s)", op, eng_desc(src), eng_desc(x), (long long)index->numel, d + 1, eng_desc(index));
  eng_tensor* I = read_index(index, shp(x, d), op, d, x);
  if (!I) return NULL;
  int64_t outer = 1, inner = 1;
  for (int k = 0; k < d; k++) outer *= x->shape[k];
  for (int k = d + 1; k < x->ndim; k++) inner *= x->shape[k];
  eng_tensor* out = NULL;
  int rc = 1;
  if (x->device == ENG_CUDA) { /* native kernel into a device copy of x */
    eng_tensor* Sd = eng_as_contig(src, x->dtype);
    out = Sd ? eng_new(x->ndim, x->shape, x->dtype, ENG_CUDA) : NULL;
    rc = out && eng_copy_raw(out, x, x->stride) == 0 ? 0 : -1;
    if (rc == 0)
      rc = eng_cu_index_put(x->dtype, acc, acc ? alpha : 1.0, outer, shp(x, d), index->numel, inner, eng_ptr(out),
                            eng_ptr(Sd), (const int64_t*)eng_ptr(I), op);
    eng_tensor_release(Sd);
    if (rc != 0) { eng_tensor_release(out); out = NULL; }
    if (rc < 0) { eng_tensor_release(I); return NULL; }
  }
  if (rc == 1) { /* CPU, or the host fallback */
    eng_tensor* X = eng_op_host(x, x->dtype);
    eng_tensor* Sh = X ? eng_op_host(src, x->dtype) : NULL;
    out = Sh ? eng_new(x->ndim, x->shape, x->dtype, ENG_CPU) : NULL;
    if (out) {
      memcpy(eng_ptr(out), eng_ptr(X), (size_t)(out->numel * eng_dtype_size(out->dtype)));
      kc_index_put(x->dtype, acc, acc ? alpha : 1.0, outer, shp(x, d), index->numel, inner, eng_ptr(out),
                   eng_ptr(Sh), (const int64_t*)eng_ptr(I));
    }
    out = eng_op_to_device(out, x->device);
    eng_tensor_release(X); eng_tensor_release(Sh);
  }
  eng_tensor* ins[2] = {x, src};
  if (out && eng_dtype_is_floating(x->dtype) && eng_any_requires_grad(2, ins)) {
    eng_node* n = eng_record(acc ? "IndexAddBackward" : "IndexCopyBackward", index_put_bw, 2, ins, out);
    if (!n || eng_node_save(n, index)) { eng_tensor_release(out); out = NULL; }
    else { n->ints[0] = d; n->ints[1] = acc; n->scalars[0] = alpha; }
  }
  eng_tensor_release(I);
  return out;
}

eng_tensor* eng_index_add(eng_tensor* x, int dim, eng_tensor* index, eng_tensor* src, double alpha) {
  return index_put(x, dim, index, src, 1, alpha);
}
eng_tensor* eng_index_copy(eng_tensor* x, int dim, eng_tensor* index, eng_tensor* src) {
  return index_put(x, dim, index, src, 0, 1.0);
}

/* ------------------------------------------------------------------ nonzero */
eng_tensor* eng_nonzero(eng_tensor* x) {
  const char* op = "nonzero";
  ENG_CHECK(x, op);
  if (eng_meta_check(x, op)) return NULL;
  if (x->dist && !eng_dispatch_local_mode())
    return eng_errp("%s: %s is a DTensor: the output's size depends on the data; use nonzero on full_tensor() "
                    "(engine.nonzero does that for DTensors and returns a Replicate DTensor)", op, eng_desc(x));
  eng_tensor* X = eng_op_host(x, x->dtype);
  if (!X) return NULL;
  int nd = X->ndim;
  int64_t cnt = kc_count_nonzero(X->dtype, X->numel, eng_ptr(X));
  int64_t sh[2] = {cnt, nd};
  eng_tensor* out = eng_new(2, sh, ENG_I64, ENG_CPU);
  if (out && cnt > 0 && nd > 0) kc_nonzero(X->dtype, nd, X->shape, eng_ptr(X), (int64_t*)eng_ptr(out));
  eng_tensor_release(X);
  return eng_op_to_device(out, x->device);
}

/* ------------------------------------------------------------------ one_hot / masked_select
 * Plain tensors (engine.ops.index keeps its composites for DTensors).
 * one_hot: integer classes -> i64 [..., num_classes] (num_classes -1: max + 1),
 * computed on the host (CUDA: the documented fallback, result moved back).
 * masked_select: expand both to the broadcast shape, the flat positions of
 * the mask's true entries (nonzero), index_select of the flat input: one
 * dispatch from Lua, autograd through index_select. */
eng_tensor* eng_one_hot(eng_tensor* t, int64_t num_classes) {
  const char* op = "one_hot";
  ENG_CHECK(t, op);
  if (t->dist) return eng_errp("%s: DTensor inputs are not supported here (engine.one_hot handles them)", op);
  if (eng_dtype_is_floating(t->dtype) || t->dtype == ENG_BOOL)
    return eng_errp("%s: one_hot is only applicable to index tensors (i32/i64/u8), got %s", op, eng_desc(t));
  if (num_classes < -1) return eng_errp("%s: num_classes must be a non-negative integer or -1, got %lld", op,
                                        (long long)num_classes);
  if (t->ndim >= ENG_MAX_DIMS) return eng_errp("%s: %s has too many dims", op, eng_desc(t));
  eng_tensor* I = eng_op_host(t, ENG_I64);
  if (!I) return NULL;
  const int64_t* p = (const int64_t*)eng_ptr(I);
  int64_t mn = INT64_MAX, mx = INT64_MIN, n = I->numel;
  for (int64_t i = 0; i < n; i++) { if (p[i] < mn) mn = p[i]; if (p[i] > mx) mx = p[i]; }
  eng_tensor* out = NULL;
  if (n == 0 && num_classes == -1) {
    eng_errp("%s: can not infer total number of classes from an empty tensor", op);
  } else if (n > 0 && mn < 0) {
    eng_errp("%s: class values must be non-negative, got %lld", op, (long long)mn);
  } else if (n > 0 && num_classes != -1 && mx >= num_classes) {
    eng_errp("%s: class values must be smaller than num_classes %lld, got %lld", op, (long long)num_classes,
             (long long)mx);
  } else {
    int64_t K = num_classes == -1 ? mx + 1 : num_classes, sh[ENG_MAX_DIMS];
    for (int d = 0; d < t->ndim; d++) sh[d] = t->shape[d];
    sh[t->ndim] = K;
    if ((out = eng_tensor_zeros(t->ndim + 1, sh, ENG_I64, ENG_CPU))) {
      int64_t* o = (int64_t*)eng_ptr(out);
      for (int64_t i = 0; i < n; i++) o[i * K + p[i]] = 1;
      out = eng_op_to_device(out, t->device);
    }
  }
  eng_tensor_release(I);
  return out;
}

eng_tensor* eng_masked_select(eng_tensor* t, eng_tensor* mask) {
  const char* op = "masked_select";
  ENG_CHECK(t, op); ENG_CHECK(mask, op);
  if (t->dist || mask->dist)
    return eng_errp("%s: DTensor inputs are not supported here (Tensor:masked_select handles them)", op);
  if (mask->dtype != ENG_BOOL) return eng_errp("%s: mask must be a bool tensor, got %s", op, eng_desc(mask));
  int n = t->ndim > mask->ndim ? t->ndim : mask->ndim;
  int64_t sh[ENG_MAX_DIMS];
  for (int i = 0; i < n; i++) {
    int a = t->ndim - n + i, b = mask->ndim - n + i;
    int64_t x = a >= 0 ? t->shape[a] : 1, y = b >= 0 ? mask->shape[b] : 1;
    if (x != y && x != 1 && y != 1)
      return eng_errp("%s: shapes %s and %s cannot be broadcast together (dim %d: %lld vs %lld)", op,
                      eng_shape_str(t->ndim, t->shape), eng_shape_str(mask->ndim, mask->shape), i + 1,
                      (long long)x, (long long)y);
    sh[i] = x == 1 ? y : x;
  }
  int64_t flat = -1;
  eng_tensor *tb = eng_expand(t, n, sh), *mb = tb ? eng_expand(mask, n, sh) : NULL;
  eng_tensor *mf = mb ? eng_reshape(mb, 1, &flat) : NULL, *nz = mf ? eng_nonzero(mf) : NULL;
  eng_tensor *idx = nz ? eng_view(nz, 1, &flat) : NULL, *tf = idx ? eng_reshape(tb, 1, &flat) : NULL;
  eng_tensor* r = tf ? eng_index_select(tf, 0, idx) : NULL;
  eng_tensor_release(tb); eng_tensor_release(mb); eng_tensor_release(mf); eng_tensor_release(nz);
  eng_tensor_release(idx); eng_tensor_release(tf);
  return r;
}
