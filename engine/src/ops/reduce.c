/* reduce.c: sum, mean, max/min (over a dim or all elements), argmax,
 * argmin and sum_to_shape, with autograd.
 * Floating sums accumulate in double (f32 inputs lose nothing to the
 * accumulation); integer and bool sums give i64; mean of integers is an
 * error as in PyTorch. */
#include "core/internal.h"
#include "core/dispatch.h"
#include <stdio.h>
#include "kernels/cpu/kcpu.h"
#include "ops/cuda_ops.h"
#include "autograd/autograd.h"
#include "eng/ops_pointwise.h"
#include "eng/ops_shape.h"
#include "eng/dtensor.h" /* reads the layout of a DTensor operand (its global shape) */
#include <math.h>

/* ------------------------------------------------------------ helpers */

/* Reduced-dims mask from a dims list (n_dims == 0: all dims). */
static int dims_mask(const eng_tensor* t, int n_dims, const int* dims, const char* op, uint8_t* mask) {
  memset(mask, 0, ENG_MAX_DIMS);
  if (n_dims < 0 || n_dims > ENG_MAX_DIMS)
    return eng_err("%s: %d dims given for %s (0 to %d allowed)", op, n_dims, eng_desc(t), ENG_MAX_DIMS);
  if (n_dims == 0) { memset(mask, 1, ENG_MAX_DIMS); return 0; }
  if (!dims) return eng_err("%s: dims list is NULL", op);
  for (int i = 0; i < n_dims; i++) {
    int d = eng_norm_dim(dims[i], t->ndim, op);
    if (d < 0) return eng_err("%s: dim %lld out of range for %s (dims are 1-based; valid: 1..%d or %d..-1)", op,
                              ENG_U(dims[i]), eng_desc(t), t->ndim > 0 ? t->ndim : 1, t->ndim > 0 ? -t->ndim : -1);
    if (mask[d]) return eng_err("%s: dim %d appears more than once in the dims list for %s", op, d + 1, eng_desc(t));
    mask[d] = 1;
  }
  return 0;
}

/* Reshapes a freshly made, exclusively owned contiguous tensor in place. */
static void set_shape(eng_tensor* r, int ndim, const int64_t* shape) {
  r->ndim = ndim;
  for (int d = 0; d < ndim; d++) r->shape[d] = shape[d];
  eng_contiguous_strides(ndim, shape, r->stride);
}

/* Output shape of a reduction: reduced dims become 1 (keepdim) or vanish. */
static int reduced_shape(const eng_tensor* t, const uint8_t* mask, int keepdim, int64_t* out) {
  int n = 0;
  for (int d = 0; d < t->ndim; d++) {
    if (mask[d]) { if (keepdim) out[n++] = 1; }
    else out[n++] = t->shape[d];
  }
  return n;
}

static void sum_cb(int64_t n, char** p, const int64_t* s, void* vc) {
  kc_sum_row(*(int*)vc, n, p[0], s[0], p[1], s[1]);
}

/* sum_raw on the device: one [outer, D, inner] reduction per reduced dim
 * (innermost first; f32 intermediates for f32/bf16/f16 data, f64 for f64,
 * i64 for integers), or one reduction over everything. */
static eng_tensor* sum_raw_cuda(eng_tensor* t, const uint8_t* mask, int keepdim, double scale, int out_dt) {
  const char* op = "sum";
  int nd = t->ndim, floating = eng_dtype_is_floating(t->dtype);
  int odt = floating ? out_dt : ENG_I64, adt = floating ? (t->dtype == ENG_F64 ? ENG_F64 : ENG_F32) : ENG_I64;
  int64_t sh[ENG_MAX_DIMS];
  int all = 1, last = -1;
  for (int d = 0; d < nd; d++) {
    sh[d] = t->shape[d];
    if (!mask[d] && sh[d] != 1) all = 0;
  }
  for (int d = 0; d < nd; d++) if (mask[d] && sh[d] != 1) { last = d; break; } /* reduced last */
  eng_tensor* cur = eng_as_contig(t, t->dtype);
  if (!cur) return NULL;
  if (all && last >= 0) {
    int64_t ks[ENG_MAX_DIMS];
    for (int d = 0; d < nd; d++) ks[d] = 1;
    eng_tensor* r = eng_new(nd, ks, odt, t->device);
    if (r && eng_cu_reduce_all(0 /* sum */, cur->dtype, cur->numel, eng_ptr(cur), eng_ptr(r), odt, scale, op)) {
      eng_tensor_release(r);
      r = NULL;
    }
    eng_tensor_release(cur);
    cur = r;
  } else {
    for (int d = nd - 1; d >= 0 && cur; d--) {
      if (!mask[d] || sh[d] == 1) continue;
      int64_t outer = 1, inner = 1, D = sh[d];
      for (int k = 0; k < d; k++) outer *= sh[k];
      for (int k = d + 1; k < nd; k++) inner *= sh[k];
      sh[d] = 1;
      int fin = d == last, rdt = fin ? odt : adt;
      eng_tensor* r = eng_new(nd, sh, rdt, t->device);
      if (r && eng_cu_reduce_dim(0 /* sum */, cur->dtype, outer, D, inner, eng_ptr(cur), eng_ptr(r), rdt,
                                 fin ? scale : 1.0, op)) {
        eng_tensor_release(r);
        r = NULL;
      }
      eng_tensor_release(cur);
      cur = r;
    }
    if (cur && last < 0) { /* nothing to reduce (dims of size 1): a converted copy, never t itself (callers
                            * reshape the result in place: an alias of t changed t's shape, and AddBackward
                            * of [1, T, D] + [T, D] gave a [T, D] gradient to the [1, T, D] input) */
      eng_tensor* r = eng_new(nd, cur->shape, odt, t->device);
      if (r && eng_copy_raw(r, cur, cur->stride)) { eng_tensor_release(r); r = NULL; }
      eng_tensor_release(cur);
      cur = r;
    }
  }
  if (cur && !keepdim) {
    int64_t os[ENG_MAX_DIMS];
    int on = reduced_shape(t, mask, 0, os);
    set_shape(cur, on, os);
  }
  return cur;
}

/* Sum over the masked dims (keepdim layout), times scale, as a new tensor of
 * dtype out_dt (floating inputs) or i64.  No autograd. */
static eng_tensor* sum_raw(eng_tensor* t, const uint8_t* mask, int keepdim, double scale, int out_dt) {
  if (t->device == ENG_CUDA) return sum_raw_cuda(t, mask, keepdim, scale, out_dt);
  int nd = t->ndim;
  int floating = eng_dtype_is_floating(t->dtype);
  int64_t kshape[ENG_MAX_DIMS];
  for (int d = 0; d < nd; d++) kshape[d] = mask[d] ? 1 : t->shape[d];
  eng_tensor* acc = eng_new(nd, kshape, floating ? ENG_F64 : ENG_I64, t->device);
  if (!acc) return NULL;
  kc_fill(acc->numel, eng_ptr(acc), acc->dtype, 0.0);
  if (t->numel > 0) {
    /* iterate all input dims; the accumulator has stride 0 on reduced dims.
     * Dims are ordered by decreasing input stride so the inner loop walks
     * memory in order (a stable insertion sort keeps ties in place). */
    int perm[ENG_MAX_DIMS];
    for (int d = 0; d < nd; d++) perm[d] = d;
    for (int i = 1; i < nd; i++) {
      int k = perm[i], j = i - 1;
      int64_t sk = t->shape[k] == 1 ? 0 : llabs(t->stride[k]);
      while (j >= 0) {
        int64_t sj = t->shape[perm[j]] == 1 ? 0 : llabs(t->stride[perm[j]]);
        if (sj >= sk) break;
        perm[j + 1] = perm[j]; j--;
      }
      perm[j + 1] = k;
    }
    int64_t shp[ENG_MAX_DIMS], sa[ENG_MAX_DIMS], st[ENG_MAX_DIMS];
    for (int i = 0; i < nd; i++) {
      int d = perm[i];
      shp[i] = t->shape[d];
      sa[i] = mask[d] ? 0 : acc->stride[d];
      st[i] = t->stride[d];
    }
    int dt = t->dtype;
    char* base[2] = {eng_ptr(acc), eng_ptr(t)};
    const int64_t* strides[2] = {sa, st};
    int esz[2] = {8, eng_dtype_size(dt)};
    kc_foreach(nd, shp, 2, base, strides, esz, sum_cb, &dt);
  }
  if (scale != 1.0) {
    double* a = (double*)eng_ptr(acc);
    for (int64_t i = 0; i < acc->numel; i++) a[i] *= scale;
  }
  eng_tensor* out = eng_as_contig(acc, floating ? out_dt : ENG_I64);
  eng_tensor_release(acc);
  if (out && !keepdim) {
    int64_t os[ENG_MAX_DIMS];
    int on = reduced_shape(t, mask, 0, os);
    set_shape(out, on, os);
  }
  return out;
}

/* g (the gradient of a reduction's output) spread back over in_shape: a new
 * contiguous tensor of dtype dt.  mask/keepdim describe the reduction. */
static eng_tensor* expand_back(eng_tensor* g, int nd, const int64_t* in_shape, const uint8_t* mask,
                               int keepdim, int dt) {
  int64_t st[ENG_MAX_DIMS];
  int j = 0;
  for (int d = 0; d < nd; d++) {
    if (mask[d]) { st[d] = 0; if (keepdim) j++; }
    else st[d] = g->stride[j++];
  }
  eng_tensor* r = eng_new(nd, in_shape, dt, g->device);
  if (r && r->numel > 0) eng_copy_raw(r, g, st);
  return r;
}

/* ------------------------------------------------------------ sum / mean */
static void mask_store(eng_node* n, const uint8_t* mask) {
  int64_t bits = 0;
  for (int d = 0; d < ENG_MAX_DIMS; d++) if (mask[d]) bits |= (int64_t)1 << d;
  n->ints[1] = bits;
}
static void mask_load(const eng_node* n, uint8_t* mask) {
  for (int d = 0; d < ENG_MAX_DIMS; d++) mask[d] = (n->ints[1] >> d) & 1;
}

static int sum_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  uint8_t mask[ENG_MAX_DIMS];
  mask_load(n, mask);
  double scale = n->scalars[0];
  eng_tensor* g = go[0];
  eng_tensor* gs = scale != 1.0 ? eng_mul_scalar(g, scale) : eng_tensor_retain(g);
  if (!gs) return -1;
  gi[0] = expand_back(gs, eng_node_in_ndim(n, 0), eng_node_in_shape(n, 0), mask, (int)n->ints[0],
                      eng_node_in_dtype(n, 0));
  eng_tensor_release(gs);
  return gi[0] ? 0 : -1;
}

static eng_tensor* sum_mean(eng_tensor* t, int n_dims, const int* dims, int keepdim, int is_mean) {
  const char* name = is_mean ? "mean" : "sum";
  ENG_CHECK(t, name);
  if (eng_meta_check_local(t, name)) return NULL;
  if (is_mean && !eng_dtype_is_floating(t->dtype))
    return eng_errp("mean: input %s is not floating point (mean of integer or bool tensors is not "
                    "defined, as in PyTorch); convert it with :float() or :double() first", eng_desc(t));
  if (ENG_DT_ACTIVE(t->dist || ENG_META_T(t))) {
    int64_t m = eng_dims_mask(t->ndim, n_dims, dims, name);
    if (m < 0) return NULL;
    return eng_op_dispatch(is_mean ? ENG_OP_MEAN : ENG_OP_SUM,
                        &(eng_op_call){.name = name, .n_in = 1, .in = {t}, .ints = {m, keepdim ? 1 : 0}});
  }
  uint8_t mask[ENG_MAX_DIMS];
  if (dims_mask(t, n_dims, dims, name, mask)) return NULL;
  double scale = 1.0;
  if (is_mean) {
    int64_t cnt = 1;
    for (int d = 0; d < t->ndim; d++) if (mask[d]) cnt *= t->shape[d];
    scale = cnt > 0 ? 1.0 / (double)cnt : NAN;
  }
  eng_tensor* out = sum_raw(t, mask, keepdim, scale, t->dtype);
  if (!out || !eng_any_requires_grad(1, &t) || !eng_dtype_is_floating(out->dtype)) return out;
  eng_node* nd = eng_record(is_mean ? "MeanBackward" : "SumBackward", sum_bw, 1, &t, out);
  if (!nd) { eng_tensor_release(out); return NULL; }
  nd->ints[0] = keepdim ? 1 : 0;
  mask_store(nd, mask);
  nd->scalars[0] = scale;
  return out;
}

eng_tensor* eng_sum(eng_tensor* t, int n_dims, const int* dims, int keepdim) {
  return sum_mean(t, n_dims, dims, keepdim, 0);
}
eng_tensor* eng_mean(eng_tensor* t, int n_dims, const int* dims, int keepdim) {
  return sum_mean(t, n_dims, dims, keepdim, 1);
}

/* ------------------------------------------------------------ sum_to_shape */
static int sum_to_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  int nd = eng_node_in_ndim(n, 0);
  const int64_t* sh = eng_node_in_shape(n, 0);
  eng_tensor* g = go[0];
  int64_t st[ENG_MAX_DIMS];
  eng_broadcast_strides(g, nd, sh, st);
  eng_tensor* r = eng_new(nd, sh, eng_node_in_dtype(n, 0), g->device);
  if (!r) return -1;
  if (r->numel > 0) eng_copy_raw(r, g, st);
  gi[0] = r;
  return 0;
}

/* DTensor form: a composition of ops that have sharding rules (sum over the
 * broadcast dims with keepdim, then a view), checked on the GLOBAL shape. */
static eng_tensor* sum_to_shape_dtensor(eng_tensor* t, int ndim, const int64_t* shape) {
  const eng_dist_spec* sp = t->dist;
  char desc[900], spec[600];
  snprintf(desc, sizeof desc, "DTensor(%s, local %s)", eng_spec_describe(sp, t->dtype, spec, sizeof spec), eng_desc(t));
  if (ndim < 0 || ndim > sp->ndim || (ndim > 0 && !shape))
    return eng_errp("sum_to_shape: %d dims requested for %s", ndim, desc);
  int off = sp->ndim - ndim, dims[ENG_MAX_DIMS], nd = 0;
  for (int i = 0; i < ndim; i++)
    if (shape[i] != sp->shape[off + i] && shape[i] != 1)
      return eng_errp("sum_to_shape: %s cannot be summed to shape %s (the shape must broadcast to the tensor's)",
                      desc, eng_shape_str(ndim, shape));
  for (int d = 0; d < sp->ndim; d++)
    if (d < off || (shape[d - off] == 1 && sp->shape[d] != 1)) dims[nd++] = d;
  if (nd == 0 && off == 0) return eng_tensor_retain(t);
  eng_tensor* r = nd ? eng_sum(t, nd, dims, 1) : eng_tensor_retain(t);
  if (!r) return NULL;
  eng_tensor* v = eng_view(r, ndim, shape);
  eng_tensor_release(r);
  return v;
}

eng_tensor* eng_sum_to_shape(eng_tensor* t, int ndim, const int64_t* shape) {
  ENG_CHECK(t, "sum_to_shape");
  if (eng_meta_check(t, "sum_to_shape")) return NULL;
  if (ENG_DT_ACTIVE(t->dist)) return sum_to_shape_dtensor(t, ndim, shape);
  if (ndim < 0 || ndim > ENG_MAX_DIMS) return eng_errp("sum_to_shape: %d dims requested for %s", ndim, eng_desc(t));
  if (ndim > 0 && !shape) return eng_errp("sum_to_shape: shape is NULL");
  int ok = ndim <= t->ndim;
  int off = t->ndim - ndim;
  for (int i = 0; ok && i < ndim; i++) ok = shape[i] == t->shape[off + i] || shape[i] == 1;
  if (!ok)
    return eng_errp("sum_to_shape: %s cannot be summed to shape %s (the shape must broadcast to the tensor's)",
                    eng_desc(t), eng_shape_str(ndim, shape));
  uint8_t mask[ENG_MAX_DIMS] = {0};
  int any = 0;
  for (int d = 0; d < t->ndim; d++) {
    mask[d] = d < off || (shape[d - off] == 1 && t->shape[d] != 1);
    any |= mask[d];
  }
  if (!any && off == 0) return eng_tensor_retain(t);
  eng_tensor* out = sum_raw(t, mask, 1, 1.0, t->dtype);
  if (!out) return NULL;
  set_shape(out, ndim, shape);
  if (!eng_any_requires_grad(1, &t) || !eng_dtype_is_floating(out->dtype)) return out;
  if (!eng_record("SumToShapeBackward", sum_to_bw, 1, &t, out)) { eng_tensor_release(out); return NULL; }
  return out;
}

/* ------------------------------------------------------------ max / min over a dim */
typedef struct { int dt, is_max, es; int64_t len, sdim; } ext_ctx;
static void ext_cb(int64_t n, char** p, const int64_t* s, void* vc) {
  ext_ctx* c = vc;
  for (int64_t i = 0; i < n; i++) {
    const char* x = p[2] + i * s[2];
    int64_t bi = kc_argext_row(c->dt, c->is_max, c->len, x, c->sdim);
    if (p[0]) memcpy(p[0] + i * s[0], x + bi * c->sdim, (size_t)c->es);
    *(int64_t*)(p[1] + i * s[1]) = bi;
  }
}

/* Values (if vals) and i64 indices of the extreme along dim d (keepdim layout
 * first, squeezed after). */
static int extreme_dim_raw(eng_tensor* t, int d, int keepdim, int is_max, eng_tensor** vals,
                           eng_tensor** idx, const char* name) {
  int nd = t->ndim;
  int64_t ks[ENG_MAX_DIMS];
  for (int k = 0; k < nd; k++) ks[k] = k == d ? 1 : t->shape[k];
  eng_tensor* v = vals ? eng_new(nd, ks, t->dtype, t->device) : NULL;
  eng_tensor* ix = eng_new(nd, ks, ENG_I64, t->device);
  if ((vals && !v) || !ix) { eng_tensor_release(v); eng_tensor_release(ix); return -1; }
  int es = eng_dtype_size(t->dtype);
  if (t->device == ENG_CUDA) {
    int64_t outer = 1, inner = 1, len = nd ? t->shape[d] : 1;
    for (int k = 0; k < d; k++) outer *= t->shape[k];
    for (int k = d + 1; k < nd; k++) inner *= t->shape[k];
    eng_tensor* X = eng_as_contig(t, t->dtype);
    int rc = X ? eng_cu_argext_dim(t->dtype, is_max, outer, len, inner, eng_ptr(X), v ? eng_ptr(v) : NULL,
                                   (int64_t*)eng_ptr(ix), name)
               : -1;
    eng_tensor_release(X);
    if (rc) { eng_tensor_release(v); eng_tensor_release(ix); return -1; }
  } else if (nd == 0) {
    if (v) memcpy(eng_ptr(v), eng_ptr(t), (size_t)es);
    *(int64_t*)eng_ptr(ix) = 0;
  } else if (ix->numel > 0 && eng_tensor_is_contiguous(t) && d < nd - 1 && t->shape[nd - 1] > 1) {
    /* contiguous, reducing an outer dim: scan row by row ([outer, len, inner]) */
    int64_t inner = 1, outer = 1, len = t->shape[d];
    for (int k = d + 1; k < nd; k++) inner *= t->shape[k];
    for (int k = 0; k < d; k++) outer *= t->shape[k];
    eng_tensor* vv = v ? eng_tensor_retain(v) : eng_new(nd, ks, t->dtype, t->device);
    if (!vv) { eng_tensor_release(ix); return -1; }
    const char* x = eng_ptr(t);
    for (int64_t o = 0; o < outer; o++)
      kc_argext_cols(t->dtype, is_max, len, inner, x + o * len * inner * es, eng_ptr(vv) + o * inner * es,
                     (int64_t*)eng_ptr(ix) + o * inner);
    eng_tensor_release(vv);
  } else if (ix->numel > 0) {
    ext_ctx c = {t->dtype, is_max, es, t->shape[d], t->stride[d] * es};
    int64_t zero[ENG_MAX_DIMS] = {0};
    char* base[3] = {v ? eng_ptr(v) : NULL, eng_ptr(ix), eng_ptr(t)};
    const int64_t* st[3] = {v ? v->stride : zero, ix->stride, t->stride};
    int esz[3] = {es, 8, es};
    kc_foreach(nd, ks, 3, base, st, esz, ext_cb, &c);
  }
  (void)name;
  if (!keepdim && nd > 0) {
    int64_t os[ENG_MAX_DIMS];
    int on = 0;
    for (int k = 0; k < nd; k++) if (k != d) os[on++] = t->shape[k];
    if (v) set_shape(v, on, os);
    set_shape(ix, on, os);
  }
  if (vals) *vals = v;
  *idx = ix;
  return 0;
}

typedef struct { int es; int64_t sdim; } scat_ctx;
static void scat_cb(int64_t n, char** p, const int64_t* s, void* vc) {
  scat_ctx* c = vc;
  for (int64_t i = 0; i < n; i++) {
    int64_t k = *(const int64_t*)(p[2] + i * s[2]);
    memcpy(p[0] + i * s[0] + k * c->sdim, p[1] + i * s[1], (size_t)c->es);
  }
}

/* Gradient of max/min over a dim: g placed at the index positions. */
static int extreme_dim_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor* idx = eng_node_saved(n, 0);
  if (!idx) return -1;
  int d = (int)n->ints[0], keepdim = (int)n->ints[1];
  int nd = eng_node_in_ndim(n, 0);
  const int64_t* sh = eng_node_in_shape(n, 0);
  eng_tensor* g = go[0];
  int gdt = eng_dtype_is_floating(g->dtype) ? g->dtype : eng_node_in_dtype(n, 0);
  eng_tensor* r = eng_tensor_zeros(nd, sh, gdt, g->device);
  if (!r) return -1;
  eng_tensor* G = g->dtype == gdt ? eng_tensor_retain(g) : eng_as_contig(g, gdt);
  if (!G) { eng_tensor_release(r); return -1; }
  if (r->device == ENG_CUDA) {
    int64_t outer = 1, inner = 1;
    for (int k = 0; k < d; k++) outer *= sh[k];
    for (int k = d + 1; k < nd; k++) inner *= sh[k];
    eng_tensor* Gc = eng_as_contig(G, gdt);
    eng_tensor* I = Gc ? eng_as_contig(idx, ENG_I64) : NULL;
    int rc = I ? eng_cu_scatter_dim(eng_dtype_size(gdt), outer, nd ? sh[d] : 1, inner, (const int64_t*)eng_ptr(I),
                                    eng_ptr(Gc), eng_ptr(r), n->name)
               : -1;
    eng_tensor_release(Gc); eng_tensor_release(I);
    if (rc) { eng_tensor_release(G); eng_tensor_release(r); return -1; }
  } else if (r->numel > 0) {
    int64_t ks[ENG_MAX_DIMS], sg[ENG_MAX_DIMS], si[ENG_MAX_DIMS];
    int j = 0;
    for (int k = 0; k < nd; k++) {
      ks[k] = k == d ? 1 : sh[k];
      if (k == d) { sg[k] = 0; si[k] = 0; if (keepdim) j++; }
      else { sg[k] = G->stride[j]; si[k] = idx->stride[j]; j++; }
    }
    int es = eng_dtype_size(gdt);
    scat_ctx c = {es, r->stride[d] * es};
    char* base[3] = {eng_ptr(r), eng_ptr(G), eng_ptr(idx)};
    const int64_t* st[3] = {r->stride, sg, si};
    int esz[3] = {es, es, 8};
    kc_foreach(nd, ks, 3, base, st, esz, scat_cb, &c);
  } else if (nd == 0) {
    memcpy(eng_ptr(r), eng_ptr(G), (size_t)eng_dtype_size(gdt));
  }
  eng_tensor_release(G);
  gi[0] = eng_grad_to_input(n, 0, r);
  eng_tensor_release(r);
  return gi[0] ? 0 : -1;
}

static int check_dim_nonempty(eng_tensor* t, int d, const char* name) {
  if (t->ndim > 0 && t->shape[d] == 0)
    return eng_err("%s: cannot reduce over dim %d of size 0 in %s (the reduction has no identity)", name, d + 1,
                   eng_desc(t));
  return 0;
}

static eng_tensor* extreme_dim(eng_tensor* t, int dim, int keepdim, eng_tensor** indices, int is_max) {
  const char* name = is_max ? "max" : "min";
  ENG_CHECK(t, name);
  if (eng_meta_check_local(t, name)) return NULL;
  int d = eng_norm_dim(dim, t->ndim, name);
  if (d < 0) return NULL;
  if (ENG_DT_ACTIVE(t->dist || ENG_META_T(t))) {
    eng_op_call c = {.name = name, .n_in = 1, .in = {t}, .ints = {d, keepdim ? 1 : 0, is_max}};
    if (!indices) return eng_op_dispatch(ENG_OP_MAX_DIM_VALUES, &c);
    eng_tensor* o[2];
    if (eng_op_dispatch_multi(ENG_OP_MAX_DIM, &c, o) < 0) return NULL;
    *indices = o[1];
    return o[0];
  }
  if (check_dim_nonempty(t, d, name)) return NULL;
  eng_tensor *v = NULL, *ix = NULL;
  if (extreme_dim_raw(t, d, keepdim, is_max, &v, &ix, name)) return NULL;
  if (eng_any_requires_grad(1, &t) && eng_dtype_is_floating(v->dtype)) {
    eng_node* nd = eng_record(is_max ? "MaxBackward" : "MinBackward", extreme_dim_bw, 1, &t, v);
    if (!nd || eng_node_save(nd, ix)) { eng_tensor_release(v); eng_tensor_release(ix); return NULL; }
    nd->ints[0] = d; nd->ints[1] = keepdim ? 1 : 0;
  }
  if (indices) *indices = ix; else eng_tensor_release(ix);
  return v;
}

eng_tensor* eng_max_dim(eng_tensor* t, int dim, int keepdim, eng_tensor** indices) {
  return extreme_dim(t, dim, keepdim, indices, 1);
}
eng_tensor* eng_min_dim(eng_tensor* t, int dim, int keepdim, eng_tensor** indices) {
  return extreme_dim(t, dim, keepdim, indices, 0);
}

static eng_tensor* arg_dim(eng_tensor* t, int dim, int keepdim, int is_max) {
  const char* name = is_max ? "argmax" : "argmin";
  ENG_CHECK(t, name);
  if (eng_meta_check_local(t, name)) return NULL;
  int d = eng_norm_dim(dim, t->ndim, name);
  if (d < 0) return NULL;
  if (ENG_DT_ACTIVE(t->dist || ENG_META_T(t)))
    return eng_op_dispatch(ENG_OP_ARGEXT, &(eng_op_call){.name = name, .n_in = 1, .in = {t}, .ints = {d, keepdim ? 1 : 0, is_max}});
  if (check_dim_nonempty(t, d, name)) return NULL;
  eng_tensor* ix = NULL;
  if (extreme_dim_raw(t, d, keepdim, is_max, NULL, &ix, name)) return NULL;
  return ix;
}

eng_tensor* eng_argmax(eng_tensor* t, int dim, int keepdim) { return arg_dim(t, dim, keepdim, 1); }
eng_tensor* eng_argmin(eng_tensor* t, int dim, int keepdim) { return arg_dim(t, dim, keepdim, 0); }

/* ------------------------------------------------------------ over all elements */
/* Index (row-major) of the first extreme element of a non-empty tensor. */
static int64_t argext_all(eng_tensor* t, int is_max, int* err) {
  eng_tensor* c = eng_as_contig(t, t->dtype);
  if (!c) { *err = 1; return 0; }
  int64_t bi = kc_argext_row(c->dtype, is_max, c->numel, eng_ptr(c), eng_dtype_size(c->dtype));
  eng_tensor_release(c);
  return bi;
}

/* Gradient split evenly among the elements equal to the result (or among the
 * NaNs when the result is NaN), as PyTorch. */
static int extreme_all_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor *x = eng_node_saved(n, 0), *v = eng_node_saved(n, 1);
  if (!x || !v) return -1;
  double val;
  if (eng_tensor_item(v, &val)) return -1;
  eng_tensor* m = isnan(val) ? eng_compare(x, x, ENG_NE) : eng_compare(x, v, ENG_EQ);
  eng_tensor* mf = m ? eng_tensor_to_dtype(m, go[0]->dtype) : NULL;
  eng_tensor* cnt = mf ? eng_sum(mf, 0, NULL, 0) : NULL;
  eng_tensor* q = cnt ? eng_div(go[0], cnt) : NULL;
  eng_tensor* r = q ? eng_mul(mf, q) : NULL;
  eng_tensor_release(m); eng_tensor_release(mf); eng_tensor_release(cnt); eng_tensor_release(q);
  if (!r) return -1;
  gi[0] = eng_grad_to_input(n, 0, r);
  eng_tensor_release(r);
  return gi[0] ? 0 : -1;
}

static eng_tensor* extreme_all(eng_tensor* t, int is_max) {
  const char* name = is_max ? "max" : "min";
  ENG_CHECK(t, name);
  if (eng_meta_check_local(t, name)) return NULL;
  if (ENG_DT_ACTIVE(t->dist || ENG_META_T(t)))
    return eng_op_dispatch(ENG_OP_EXTREME_ALL, &(eng_op_call){.name = name, .n_in = 1, .in = {t}, .ints = {is_max}});
  if (t->numel == 0)
    return eng_errp("%s: %s is empty; the %s over all elements needs at least one element", name,
                    eng_desc(t), name);
  eng_tensor* out;
  if (t->device == ENG_CUDA) {
    eng_tensor* X = eng_as_contig(t, t->dtype);
    out = X ? eng_new(0, NULL, t->dtype, t->device) : NULL;
    if (out && eng_cu_reduce_all(is_max ? 1 : 2, X->dtype, X->numel, eng_ptr(X), eng_ptr(out), X->dtype, 1.0, name)) {
      eng_tensor_release(out);
      out = NULL;
    }
    eng_tensor_release(X);
    if (!out) return NULL;
    goto record;
  }
  int err = 0;
  int64_t bi = argext_all(t, is_max, &err);
  if (err) return NULL;
  out = eng_new(0, NULL, t->dtype, t->device);
  if (!out) return NULL;
  /* element bi in row-major order -> its address in t */
  int64_t off = 0, rem = bi;
  for (int d = t->ndim - 1; d >= 0; d--) { off += (rem % t->shape[d]) * t->stride[d]; rem /= t->shape[d]; }
  int es = eng_dtype_size(t->dtype);
  memcpy(eng_ptr(out), eng_ptr(t) + off * es, (size_t)es);
record:
  if (eng_any_requires_grad(1, &t) && eng_dtype_is_floating(out->dtype)) {
    eng_node* nd = eng_record(is_max ? "MaxBackward" : "MinBackward", extreme_all_bw, 1, &t, out);
    if (!nd || eng_node_save(nd, t) || eng_node_save(nd, out)) { eng_tensor_release(out); return NULL; }
  }
  return out;
}

eng_tensor* eng_max_all(eng_tensor* t) { return extreme_all(t, 1); }
eng_tensor* eng_min_all(eng_tensor* t) { return extreme_all(t, 0); }

eng_tensor* eng_argmax_all(eng_tensor* t) {
  ENG_CHECK(t, "argmax");
  if (eng_meta_check_local(t, "argmax")) return NULL;
  if (ENG_DT_ACTIVE(t->dist || ENG_META_T(t))) return eng_op_dispatch(ENG_OP_ARGMAX_ALL, &(eng_op_call){.n_in = 1, .in = {t}});
  if (t->numel == 0) return eng_errp("argmax: %s is empty; argmax over all elements needs at least one element", eng_desc(t));
  if (t->device == ENG_CUDA) { /* the index stays on the device */
    eng_tensor* X = eng_as_contig(t, t->dtype);
    eng_tensor* ix = X ? eng_new(0, NULL, ENG_I64, t->device) : NULL;
    if (ix && eng_cu_argext_dim(X->dtype, 1, 1, X->numel, 1, eng_ptr(X), NULL, (int64_t*)eng_ptr(ix), "argmax")) {
      eng_tensor_release(ix);
      ix = NULL;
    }
    eng_tensor_release(X);
    return ix;
  }
  int err = 0;
  int64_t bi = argext_all(t, 1, &err);
  if (err) return NULL;
  return eng_tensor_full(0, NULL, (double)bi, ENG_I64, t->device);
}
