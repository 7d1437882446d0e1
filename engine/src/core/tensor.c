/* Subsystem core/: tensors and storage, the caching allocator, dtypes,
 * errors, the counter-based RNG, the process runtime (threads, clocks),
 * module objects with their hooks, the Lua closure bridge and the meta device.
 * May call: kernels/, cuda/ (device memory and copies).  Known upward calls,
 * each listed in spec/layering_spec.lua: the op guard of tensor.c and meta.c
 * into sharding/ (op defs), rng.c into dtensor/ (sharded random fills). */
/* tensor.c: tensor objects, creation, element access, copies, casts. */
#include "core/internal.h"
#include "core/dispatch.h"
#include "core/device.h"
#include "kernels/cpu/kcpu.h"
#include <math.h>
#include <stdio.h>

static int64_t g_live;

int64_t eng_tensor_live_count(void) { return __atomic_load_n(&g_live, __ATOMIC_RELAXED); }

void eng_contiguous_strides(int ndim, const int64_t* shape, int64_t* stride) {
  int64_t s = 1;
  for (int d = ndim - 1; d >= 0; d--) { stride[d] = s; if (d > 0) s *= shape[d] > 0 ? shape[d] : 1; }
}

/* torch.chunk arithmetic, used by every layer that splits a dim (DTensor layouts, the single-copy exchanges of
 * comm/, FSDP): core, so that comm/ needs no placement code. */
int eng_shard_size_and_offset(int64_t n, int k, int idx, int64_t* size, int64_t* offset) {
  if (k < 1) return eng_err("shard_size_and_offset: %d chunks requested (need >= 1)", k);
  if (idx < 0 || idx >= k) return eng_err("shard_size_and_offset: chunk index %d out of range for %d chunks", idx, k);
  if (n < 0) return eng_err("shard_size_and_offset: negative size %lld", (long long)n);
  int64_t full = (n + k - 1) / k;
  int64_t off = (int64_t)idx * full;
  if (off > n) off = n;
  int64_t sz = n - off < full ? n - off : full;
  if (size) *size = sz;
  if (offset) *offset = off;
  return 0;
}

/* 0 for a shape with a zero size, whatever the other sizes ([5, 2^62, 0] has no elements, and its
 * partial products must not be formed: they overflow); else the product, which eng_numel_checked
 * has bounded for every shape a tensor was made with. */
int64_t eng_shape_numel(int ndim, const int64_t* shape) {
  for (int d = 0; d < ndim; d++) if (shape[d] == 0) return 0;
  uint64_t n = 1;
  for (int d = 0; d < ndim; d++) n *= (uint64_t)shape[d];
  return (int64_t)n;
}

int eng_numel_checked(int ndim, const int64_t* shape, int dtype, int64_t* numel, const char* op) {
  int64_t n = 1, nb;
  int zero = 0, ok = 1;
  for (int d = 0; d < ndim; d++) zero |= shape[d] == 0;
  if (!zero) {
    for (int d = 0; d < ndim && ok; d++) ok = eng_mul_ok(n, shape[d], &n);
    if (ok && dtype >= 0) ok = eng_mul_ok(n, eng_dtype_size(dtype), &nb);
  } else {
    /* no elements, but the contiguous strides (products of the sizes, a 0 taken as 1) must exist:
     * [0, 2^62, 2^62] is refused (spec/fuzz_regressions_spec.lua) */
    int64_t s = 1;
    for (int d = ndim - 1; d >= 1 && ok; d--) ok = eng_mul_ok(s, shape[d] > 0 ? shape[d] : 1, &s);
    n = 0;
    if (!ok)
      return eng_err("%s: shape %s is too large: its strides overflow a 64-bit integer", op,
                     eng_shape_str(ndim, shape));
  }
  if (!ok)
    return eng_err("%s: shape %s is too large: its number of elements%s overflows a 64-bit integer", op,
                   eng_shape_str(ndim, shape), dtype >= 0 ? " (or of bytes)" : "");
  if (numel) *numel = n;
  return 0;
}

int eng_check_value(double v, int dtype, const char* op) {
  double lo, hi; /* v must satisfy lo < v < hi (truncation toward zero) */
  switch (dtype) {
    case ENG_I64: lo = -9223372036854775809.0; hi = 9223372036854775808.0; break; /* lo rounds to -2^63 */
    case ENG_I32: lo = -2147483649.0; hi = 2147483648.0; break;
    case ENG_U8: lo = -1.0; hi = 256.0; break;
    default: return 0;
  }
  if (isnan(v)) return eng_err("%s: cannot convert nan to %s", op, eng_dtype_name(dtype));
  if (dtype == ENG_I64 ? !(v >= lo && v < hi) : !(v > lo && v < hi))
    return eng_err("%s: value %.17g is out of range for %s (%s)", op, v, eng_dtype_name(dtype),
                   dtype == ENG_I64 ? "-2^63..2^63-1" : dtype == ENG_I32 ? "-2^31..2^31-1" : "0..255");
  return 0;
}

int eng_same_shape(const eng_tensor* a, const eng_tensor* b) {
  if (a->ndim != b->ndim) return 0;
  for (int d = 0; d < a->ndim; d++) if (a->shape[d] != b->shape[d]) return 0;
  return 1;
}

static eng_tensor* alloc_struct(void) {
  eng_tensor* t = calloc(1, sizeof *t);
  if (!t) return eng_errp("tensor: out of memory");
  t->refcount = 1;
  __atomic_add_fetch(&g_live, 1, __ATOMIC_RELAXED);
  return t;
}

static int check_geometry(int ndim, const int64_t* shape, int dtype, const char* op) {
  if (ndim < 0 || ndim > ENG_MAX_DIMS)
    return eng_err("%s: %d dims requested; tensors have 0 to %d dims", op, ndim, ENG_MAX_DIMS);
  if (ndim > 0 && !shape) return eng_err("%s: shape is NULL", op);
  for (int d = 0; d < ndim; d++)
    if (shape[d] < 0)
      return eng_err("%s: negative size %lld in shape %s", op, (long long)shape[d], eng_shape_str(ndim, shape));
  if (dtype < 0 || dtype >= ENG_NUM_DTYPES) return eng_err("%s: invalid dtype code %d", op, dtype);
  return eng_numel_checked(ndim, shape, dtype, NULL, op);
}

static int check_device(int device, const char* op) { return eng_device_check(device, op); }

eng_tensor* eng_new(int ndim, const int64_t* shape, int dtype, int device) {
  if (eng_numel_checked(ndim, shape, dtype, NULL, "tensor")) return NULL;
  eng_tensor* t = alloc_struct();
  if (!t) return NULL;
  t->dtype = dtype; t->device = device; t->ndim = ndim;
  for (int d = 0; d < ndim; d++) t->shape[d] = shape[d];
  eng_contiguous_strides(ndim, shape, t->stride);
  t->numel = eng_shape_numel(ndim, shape);
  t->storage = eng_storage_new(t->numel * eng_dtype_size(dtype), device);
  if (!t->storage) { free(t); __atomic_sub_fetch(&g_live, 1, __ATOMIC_RELAXED); return NULL; }
  return t;
}

eng_tensor* eng_new_pinned(int ndim, const int64_t* shape, int dtype) {
  if (eng_numel_checked(ndim, shape, dtype, NULL, "pin_memory")) return NULL;
  eng_tensor* t = alloc_struct();
  if (!t) return NULL;
  t->dtype = dtype; t->device = ENG_CPU; t->ndim = ndim;
  for (int d = 0; d < ndim; d++) t->shape[d] = shape[d];
  eng_contiguous_strides(ndim, shape, t->stride);
  t->numel = eng_shape_numel(ndim, shape);
  t->storage = eng_storage_new_pinned(t->numel * eng_dtype_size(dtype));
  if (!t->storage) { free(t); __atomic_sub_fetch(&g_live, 1, __ATOMIC_RELAXED); return NULL; }
  return t;
}

eng_tensor* eng_view_of(const eng_tensor* base, int ndim, const int64_t* shape,
                        const int64_t* stride, int64_t offset) {
  if (eng_numel_checked(ndim, shape, base->dtype, NULL, "view")) return NULL;
  eng_tensor* t = alloc_struct();
  if (!t) return NULL;
  t->dtype = base->dtype; t->device = base->device; t->ndim = ndim;
  for (int d = 0; d < ndim; d++) { t->shape[d] = shape[d]; t->stride[d] = stride[d]; }
  t->offset = offset;
  t->numel = eng_shape_numel(ndim, shape);
  t->storage = base->storage;
  eng_storage_retain(t->storage);
  return t;
}

eng_tensor* eng_wrap_external(void* data, int64_t nbytes, int ndim, const int64_t* shape, const int64_t* stride,
                              int64_t offset, int dtype) {
  if (eng_numel_checked(ndim, shape, dtype, NULL, "view")) return NULL;
  eng_storage* st = calloc(1, sizeof *st);
  if (!st) return eng_errp("view: out of memory");
  st->refcount = 1;
  st->device = ENG_CPU;
  st->external = 1;
  st->data = data;
  st->nbytes = nbytes;
  eng_tensor base;
  memset(&base, 0, sizeof base);
  base.dtype = dtype;
  base.device = ENG_CPU;
  base.storage = st;
  eng_tensor* t = eng_view_of(&base, ndim, shape, stride, offset);
  eng_storage_release(st); /* the view holds it now (or it is freed) */
  return t;
}

eng_tensor* eng_tensor_retain(eng_tensor* t) {
  if (t) __atomic_add_fetch(&t->refcount, 1, __ATOMIC_RELAXED);
  return t;
}

int32_t eng_tensor_refcount(const eng_tensor* t) { return t ? t->refcount : 0; }

/* What autograd keeps on a tensor (grad_fn, hooks, a retain_grad hook) is freed by the function autograd
 * registers (a registration point: core does not call autograd). */
static void (*g_autograd_free)(eng_tensor* t);
void eng_tensor_set_autograd_free(void (*fn)(eng_tensor* t)) { g_autograd_free = fn; }

void eng_tensor_release(eng_tensor* t) {
  if (!t) return;
  if (__atomic_sub_fetch(&t->refcount, 1, __ATOMIC_ACQ_REL) != 0) return;
  if (g_autograd_free && (t->retains_grad || t->grad_fn || t->hooks || t->post_hooks)) g_autograd_free(t);
  eng_tensor_release(t->grad);
  if (t->dist) eng_spec_release(t->dist);
  eng_storage_release(t->storage);
  free(t);
  __atomic_sub_fetch(&g_live, 1, __ATOMIC_RELAXED);
}

eng_tensor* eng_tensor_empty(int ndim, const int64_t* shape, int dtype, int device) {
  if (check_geometry(ndim, shape, dtype, "empty") || check_device(device, "empty")) return NULL;
  return eng_new(ndim, shape, dtype, device);
}

static eng_tensor* full_op(int ndim, const int64_t* shape, double value, int dtype, int device, const char* op) {
  if (check_geometry(ndim, shape, dtype, op) || check_device(device, op) || eng_check_value(value, dtype, op))
    return NULL;
  eng_tensor* t = eng_new(ndim, shape, dtype, device);
  if (t && device == ENG_META) return t;
  if (t && eng_is_device(device)) {
    if (eng_device_ops_of(device)->fill(eng_ptr(t), dtype, t->numel, value, op)) { eng_tensor_release(t); return NULL; }
  } else if (t) {
    kc_fill(t->numel, eng_ptr(t), dtype, value);
  }
  return t;
}

eng_tensor* eng_tensor_zeros(int ndim, const int64_t* shape, int dtype, int device) {
  return full_op(ndim, shape, 0.0, dtype, device, "zeros");
}

eng_tensor* eng_tensor_full(int ndim, const int64_t* shape, double value, int dtype, int device) {
  return full_op(ndim, shape, value, dtype, device, "full");
}

eng_tensor* eng_tensor_from_data(int ndim, const int64_t* shape, int dtype, const void* data,
                                 int src_dtype, int64_t n) {
  if (check_geometry(ndim, shape, dtype, "from_data")) return NULL;
  if (src_dtype < 0 || src_dtype >= ENG_NUM_DTYPES) return eng_errp("from_data: invalid source dtype %d", src_dtype);
  int64_t numel = eng_shape_numel(ndim, shape);
  if (n != numel)
    return eng_errp("from_data: %lld values given for shape %s (%lld elements)", (long long)n,
                    eng_shape_str(ndim, shape), (long long)numel);
  if (numel > 0 && !data) return eng_errp("from_data: data pointer is NULL");
  if (src_dtype == ENG_F64 || src_dtype == ENG_F32) /* numbers from Lua into an integer dtype must fit */
    for (int64_t i = 0; i < numel; i++) {
      double v = src_dtype == ENG_F64 ? ((const double*)data)[i] : ((const float*)data)[i];
      if (eng_check_value(v, dtype, "from_data")) {
        if (numel > 1) eng_err_prefix("from_data: element %lld", (long long)i + 1);
        return NULL;
      }
    }
  eng_tensor* t = eng_new(ndim, shape, dtype, ENG_CPU);
  if (t && numel) kc_convert(numel, eng_ptr(t), dtype, data, src_dtype);
  return t;
}

eng_tensor* eng_tensor_arange(double start, double end, double step, int dtype, int device) {
  if (step == 0 || isnan(step)) return eng_errp("arange: step must be non-zero (got %g)", step);
  if (!isfinite(start) || !isfinite(end)) return eng_errp("arange: bounds must be finite (got %g, %g)", start, end);
  if (dtype < 0 || dtype >= ENG_NUM_DTYPES) return eng_errp("arange: invalid dtype code %d", dtype);
  if (check_device(device, "arange")) return NULL;
  if (eng_is_device(device)) { /* made on the host, then copied */
    eng_tensor* h = eng_tensor_arange(start, end, step, dtype, ENG_CPU);
    eng_tensor* r = h ? eng_device_copy(h, device) : NULL;
    eng_tensor_release(h);
    return r;
  }
  double cnt = ceil((end - start) / step);
  if (!(cnt < 4611686018427387904.0))
    return eng_errp("arange: %.17g..%.17g by %.17g is too large (%.3g elements)", start, end, step, cnt);
  int64_t n = cnt > 0 ? (int64_t)cnt : 0;
  if (n > 0 && (eng_check_value(start, dtype, "arange") || eng_check_value(start + (double)(n - 1) * step, dtype, "arange")))
    return NULL;
  eng_tensor* t = eng_new(1, &n, dtype, device);
  if (!t || device == ENG_META) return t;
  char* p = eng_ptr(t);
  int es = eng_dtype_size(dtype);
  for (int64_t i = 0; i < n; i++) kc_store(p + i * es, dtype, start + (double)i * step);
  return t;
}

int eng_meta_check(const eng_tensor* t, const char* op) {
  if (t && t->device == ENG_META)
    return eng_err("%s: %s is a meta tensor (shape and dtype only, no data); materialise it first (module:to_empty, "
                   "empty_like(t, {device = \"cpu\"}))", op, eng_desc(t));
  return 0;
}

int eng_meta_check_local(const eng_tensor* t, const char* op) {
  return eng_dispatch_local_mode() ? eng_meta_check(t, op) : 0;
}

eng_tensor* eng_tensor_empty_like(const eng_tensor* t) {
  ENG_CHECK(t, "empty_like");
  return eng_new(t->ndim, t->shape, t->dtype, t->device);
}

eng_tensor* eng_tensor_zeros_like(const eng_tensor* t) {
  ENG_CHECK(t, "zeros_like");
  return eng_tensor_full(t->ndim, t->shape, 0.0, t->dtype, t->device);
}

void* eng_tensor_data(const eng_tensor* t) { return t ? eng_ptr(t) : NULL; }

int eng_tensor_is_contiguous(const eng_tensor* t) {
  int64_t s = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    if (t->shape[d] == 1) continue;
    if (t->stride[d] != s) return 0;
    s *= t->shape[d];
  }
  return 1;
}

static int64_t elem_offset(const eng_tensor* t, const int64_t* idx, const char* op, int* err) {
  int64_t off = t->offset;
  for (int d = 0; d < t->ndim; d++) {
    if (idx[d] < 0 || idx[d] >= t->shape[d]) {
      *err = eng_err("%s: index %lld out of range for dim %d of size %lld in %s (indices are 1-based)", op,
                     ENG_U(idx[d]), d + 1, (long long)t->shape[d], eng_desc(t));
      return 0;
    }
    off += idx[d] * t->stride[d];
  }
  return off;
}

/* Element at storage offset off (elements) as double; device tensors are
 * read back (a sync). */
static int load_elem(const eng_tensor* t, int64_t off, double* out, const char* op) {
  if (eng_meta_check(t, op)) return -1;
  int es = eng_dtype_size(t->dtype);
  const char* p = (const char*)t->storage->data + off * es;
  if (eng_is_device(t->device)) {
    _Alignas(8) char buf[8];
    if (eng_device_ops_of(t->device)->copy_d2h(buf, p, es)) { eng_err_prefix("%s", op); return -1; }
    *out = eng_lua_double(kc_load(buf, t->dtype));
    return 0;
  }
  *out = eng_lua_double(kc_load(p, t->dtype));
  return 0;
}

void eng_lua_doubles(void* buf, int dtype, int64_t n) {
  if (dtype == ENG_F64) {
    double* d = buf;
    for (int64_t i = 0; i < n; i++) d[i] = eng_lua_double(d[i]);
  } else if (dtype == ENG_F32) { /* widened by LuaJIT: NaNs become the canonical f32 quiet NaN */
    uint32_t* u = buf;
    for (int64_t i = 0; i < n; i++)
      if ((u[i] & 0x7fffffffu) > 0x7f800000u) u[i] = 0x7fc00000u;
  }
}

int eng_tensor_item(const eng_tensor* t, double* out) {
  ENG_CHECK_I(t, "item");
  if (t->numel != 1)
    return eng_err("item: only one-element tensors can be converted to a number, got %s", eng_desc(t));
  int64_t off = t->offset;  /* all dims are 1 */
  return load_elem(t, off, out, "item");
}

int eng_tensor_get(const eng_tensor* t, const int64_t* index, double* out) {
  ENG_CHECK_I(t, "get");
  int err = 0;
  int64_t off = elem_offset(t, index, "get", &err);
  if (err) return -1;
  return load_elem(t, off, out, "get");
}

int eng_tensor_set(eng_tensor* t, const int64_t* index, double value) {
  ENG_CHECK_I(t, "set");
  if (eng_check_inplace(t, "set") || eng_check_value(value, t->dtype, "set")) return -1;
  int err = 0;
  int64_t off = elem_offset(t, index, "set", &err);
  if (err) return -1;
  if (eng_meta_check(t, "set")) return -1;
  char* p = (char*)t->storage->data + off * eng_dtype_size(t->dtype);
  if (eng_is_device(t->device)) {
    _Alignas(8) char buf[8];
    kc_store(buf, t->dtype, value);
    if (eng_device_ops_of(t->device)->copy_h2d(p, buf, eng_dtype_size(t->dtype))) { eng_err_prefix("set"); return -1; }
  } else {
    kc_store(p, t->dtype, value);
  }
  eng_bump_version(t);
  return 0;
}

int eng_copy_raw(eng_tensor* dst, const eng_tensor* src, const int64_t* src_stride) {
  if (dst->device != src->device) /* callers move data between devices first (eng_device_copy) */
    return eng_err("copy: internal error: %s and %s are on different devices", eng_desc(dst), eng_desc(src));
  if (dst->device == ENG_META) return 0; /* shapes only */
  if (eng_is_device(dst->device))
    return eng_device_ops_of(dst->device)->copy_strided(dst->ndim, dst->shape, eng_ptr(dst), dst->dtype, dst->stride,
                                                        eng_ptr(src), src->dtype, src_stride, "copy");
  kc_copy(dst->ndim, dst->shape, eng_ptr(dst), dst->dtype, dst->stride, eng_ptr(src), src->dtype, src_stride);
  return 0;
}

int eng_zero_elems(eng_tensor* t, int64_t first, int64_t n) {
  if (n <= 0 || t->device == ENG_META) return 0;
  int64_t es = eng_dtype_size(t->dtype);
  char* p = eng_ptr(t) + first * es;
  if (eng_is_device(t->device)) return eng_device_ops_of(t->device)->memset(p, 0, n * es);
  memset(p, 0, (size_t)(n * es));
  return 0;
}

int eng_tensor_read(const eng_tensor* t, void* out, int dtype, int64_t n) {
  ENG_CHECK_I(t, "read");
  if (eng_meta_check(t, "read")) return -1;
  if (dtype < 0 || dtype >= ENG_NUM_DTYPES) return eng_err("read: invalid dtype code %d", dtype);
  if (n != t->numel) return eng_err("read: buffer of %lld elements for %s", (long long)n, eng_desc(t));
  int64_t st[ENG_MAX_DIMS];
  eng_contiguous_strides(t->ndim, t->shape, st);
  if (eng_is_device(t->device)) { /* converted on the device, then one copy back */
    eng_tensor* c = eng_new(t->ndim, t->shape, dtype, t->device);
    int rc = c ? eng_copy_raw(c, t, t->stride) : -1;
    if (rc == 0 && n > 0) rc = eng_device_ops_of(t->device)->copy_d2h(out, eng_ptr(c), n * eng_dtype_size(dtype));
    eng_tensor_release(c);
    if (rc) eng_err_prefix("read");
    else eng_lua_doubles(out, dtype, n);
    return rc;
  }
  kc_copy(t->ndim, t->shape, out, dtype, st, eng_ptr(t), t->dtype, t->stride);
  eng_lua_doubles(out, dtype, n);
  return 0;
}

int eng_broadcast_shapes(int na, const int64_t* sa, int nb, const int64_t* sb, int64_t* out,
                         const char* op, const eng_tensor* a, const eng_tensor* b) {
  int n = na > nb ? na : nb;
  for (int i = 0; i < n; i++) {
    int ia = na - n + i, ib = nb - n + i;
    int64_t x = ia >= 0 ? sa[ia] : 1, y = ib >= 0 ? sb[ib] : 1;
    if (x != y && x != 1 && y != 1) {
      if (a && b)
        return eng_err("%s: %s and %s do not broadcast: size %lld vs %lld at dim %d of the result (aligned from the "
                       "right)", op, eng_desc(a), eng_desc(b), (long long)x, (long long)y, i + 1);
      return eng_err("%s: shapes %s and %s do not broadcast", op, eng_shape_str(na, sa), eng_shape_str(nb, sb));
    }
    out[i] = x == 1 ? y : x;
  }
  return n;
}

int eng_check_broadcast_to(const eng_tensor* a, const eng_tensor* x, const char* op) {
  int64_t shape[ENG_MAX_DIMS];
  int nd = eng_broadcast_shapes(a->ndim, a->shape, x->ndim, x->shape, shape, op, a, x);
  if (nd < 0) return -1;
  int ok = nd == a->ndim;
  for (int d = 0; ok && d < nd; d++) ok = shape[d] == a->shape[d];
  if (!ok) return eng_err("%s: %s cannot be broadcast to the in-place target %s", op, eng_desc(x), eng_desc(a));
  return 0;
}

void eng_broadcast_strides(const eng_tensor* t, int ndim, const int64_t* shape, int64_t* stride) {
  for (int i = 0; i < ndim; i++) {
    int it = t->ndim - ndim + i;
    stride[i] = (it < 0 || (t->shape[it] == 1 && shape[i] != 1)) ? 0 : t->stride[it];
  }
}

eng_tensor* eng_as_contig(eng_tensor* t, int dtype) {
  if (t->dtype == dtype && eng_tensor_is_contiguous(t)) return eng_tensor_retain(t);
  eng_tensor* r = eng_new(t->ndim, t->shape, dtype, t->device);
  if (r && eng_copy_raw(r, t, t->stride)) { eng_tensor_release(r); return NULL; }
  return r;
}

eng_tensor* eng_unit_last_stride(eng_tensor* t) {
  if (t->ndim == 0 || t->shape[t->ndim - 1] <= 1 || t->stride[t->ndim - 1] == 1) return eng_tensor_retain(t);
  return eng_as_contig(t, t->dtype);
}

int eng_check_inplace(eng_tensor* t, const char* op) {
  if (eng_grad_enabled() && t->requires_grad) {
    if (!t->grad_fn)
      return eng_err("%s: a leaf tensor that requires grad (%s) cannot be modified in place while grad "
                     "mode is on (use no_grad)", op, eng_desc(t));
    return eng_err("%s: %s requires grad (grad_fn %s); in-place writes to tensors in the autograd graph are "
                   "not supported (use the out-of-place op, or no_grad)", op, eng_desc(t), t->grad_fn->name);
  }
  return 0;
}

/* ------------------------------------------------------------ memory overlap (PyTorch's MemOverlap) */
/* Dense without overlap: its dims of size > 1, ordered by stride, have the strides of a contiguous tensor
 * of some permutation of its shape (PyTorch's is_non_overlapping_and_dense). */
static int non_overlapping_and_dense(const eng_tensor* t) {
  int idx[ENG_MAX_DIMS], n = 0;
  for (int d = 0; d < t->ndim; d++) if (t->shape[d] != 1) idx[n++] = d;
  for (int i = 1; i < n; i++) /* insertion sort by stride */
    for (int j = i; j > 0 && t->stride[idx[j]] < t->stride[idx[j - 1]]; j--) { int x = idx[j]; idx[j] = idx[j - 1]; idx[j - 1] = x; }
  int64_t expect = 1;
  for (int i = 0; i < n; i++) {
    if (t->stride[idx[i]] != expect) return 0;
    expect *= t->shape[idx[i]];
  }
  return 1;
}

int eng_internal_overlap(const eng_tensor* t) {
  if (t->numel <= 1 || non_overlapping_and_dense(t)) return ENG_OVERLAP_NO;
  for (int d = 0; d < t->ndim; d++) if (t->stride[d] == 0 && t->shape[d] > 1) return ENG_OVERLAP_YES;
  return ENG_OVERLAP_TOO_HARD;
}

int eng_overlap_status(const eng_tensor* a, const eng_tensor* b) {
  if (a == b) return ENG_OVERLAP_FULL;
  if (a->numel == 0 || b->numel == 0 || a->device != b->device || a->device == ENG_META) return ENG_OVERLAP_NO;
  if (!a->storage || !b->storage || !a->storage->data || !b->storage->data) return ENG_OVERLAP_NO;
  /* the byte spans: an element-wise view spans from its lowest to its highest element (strides >= 0) */
  const char *ab = eng_ptr(a), *bb = eng_ptr(b);
  int64_t asp = 1, bsp = 1;
  for (int d = 0; d < a->ndim; d++) asp += (a->shape[d] - 1) * a->stride[d];
  for (int d = 0; d < b->ndim; d++) bsp += (b->shape[d] - 1) * b->stride[d];
  const char *ae = ab + asp * eng_dtype_size(a->dtype), *be = bb + bsp * eng_dtype_size(b->dtype);
  if (!(ab < be && bb < ae)) return ENG_OVERLAP_NO;
  if (!non_overlapping_and_dense(a) || !non_overlapping_and_dense(b)) return ENG_OVERLAP_TOO_HARD;
  if (ab == bb && ae == be) {
    int same = a->ndim == b->ndim && a->dtype == b->dtype;
    for (int d = 0; same && d < a->ndim; d++) same = a->shape[d] == b->shape[d] && (a->shape[d] == 1 || a->stride[d] == b->stride[d]);
    return same ? ENG_OVERLAP_FULL : ENG_OVERLAP_PARTIAL;
  }
  return ENG_OVERLAP_PARTIAL;
}

int eng_check_internal_overlap(const eng_tensor* t, const char* op) {
  if (eng_internal_overlap(t) != ENG_OVERLAP_YES) return 0;
  return eng_err("%s: unsupported operation: more than one element of the written-to tensor refers to a single "
                 "memory location. Please clone() the tensor before performing the operation. (%s has a stride "
                 "of 0 over a dim of size > 1: an expanded or broadcast view)", op, eng_desc(t));
}

int eng_check_partial_overlap(const eng_tensor* dst, const eng_tensor* src, const char* op) {
  if (eng_overlap_status(dst, src) != ENG_OVERLAP_PARTIAL) return 0;
  char b[160];
  snprintf(b, sizeof b, "%s", eng_desc(src));
  return eng_err("%s: unsupported operation: some elements of the input tensor and the written-to tensor refer to a "
                 "single memory location. Please clone() the tensor before performing the operation. (the input "
                 "%s from element %lld and the written-to %s from element %lld overlap in one storage)", op, b,
                 (long long)src->offset, eng_desc(dst), (long long)dst->offset);
}

int eng_tensor_check_overlap(const eng_tensor* dst, const eng_tensor* src, const char* op) {
  if (!op) op = "check_overlap";
  ENG_CHECK_I(dst, op);
  if (eng_check_internal_overlap(dst, op)) return -1;
  return src ? eng_check_partial_overlap(dst, src, op) : 0;
}

/* src when reading it while writing dst is safe element by element (no shared memory, or the very same
 * elements), else a fresh contiguous copy of it (memmove semantics for the overlaps the checks above let
 * through: a broadcast or strided source over the destination's memory).  A new reference. */
eng_tensor* eng_unaliased(eng_tensor* dst, eng_tensor* src) {
  int st = eng_overlap_status(dst, src);
  if (st == ENG_OVERLAP_NO || st == ENG_OVERLAP_FULL) return eng_tensor_retain(src);
  eng_tensor* r = eng_new(src->ndim, src->shape, src->dtype, src->device);
  if (r && r->numel > 0 && eng_copy_raw(r, src, src->stride)) { eng_tensor_release(r); return NULL; }
  return r;
}

/* ------------------------------------------------------------ devices */
/* A contiguous copy of t on device (same dtype and shape), no autograd:
 * host <-> device through the runtime's pinned staging buffers. */
eng_tensor* eng_device_copy(eng_tensor* t, int device) {
  if (check_device(device, "to_device")) return NULL;
  if (device == ENG_META) return eng_new(t->ndim, t->shape, t->dtype, ENG_META); /* shape only */
  if (t->device == ENG_META)
    return eng_errp("to_device: cannot copy out of meta tensor %s: it has no data (allocate with to_empty or "
                    "empty_like, then initialise)", eng_desc(t));
  eng_tensor* src = eng_as_contig(t, t->dtype); /* on t's device */
  if (!src) return NULL;
  eng_tensor* r = eng_new(t->ndim, t->shape, t->dtype, device);
  int rc = r ? 0 : -1;
  int64_t nb = t->numel * eng_dtype_size(t->dtype);
  if (r && nb > 0) {
    const eng_device_ops* to = eng_device_ops_of(device);
    const eng_device_ops* from = eng_device_ops_of(src->device);
    if (src->device == device) rc = to ? to->copy_d2d(eng_ptr(r), eng_ptr(src), nb)
                                       : (memcpy(eng_ptr(r), eng_ptr(src), (size_t)nb), 0);
    else if (to && from) rc = eng_err("to_device: %s to %s: copies between two devices go through the host", from->name,
                                      to->name);
    else if (to) rc = to->copy_h2d(eng_ptr(r), eng_ptr(src), nb);
    else rc = from->copy_d2h(eng_ptr(r), eng_ptr(src), nb);
    if (rc) eng_err_prefix("to_device");
  }
  eng_tensor_release(src);
  if (rc) { eng_tensor_release(r); return NULL; }
  return r;
}

int eng_tensor_is_pinned(const eng_tensor* t) {
  return t && t->storage && t->storage->external == 2 ? 1 : 0;
}

eng_tensor* eng_tensor_pin_memory(eng_tensor* t) {
  ENG_CHECK(t, "pin_memory");
  if (t->dist) return eng_errp("pin_memory: %s is a DTensor; pin its local tensor", eng_desc(t));
  if (t->device != ENG_CPU)
    return eng_errp("pin_memory: %s is not on the CPU (only host memory can be pinned)", eng_desc(t));
  if (eng_tensor_is_pinned(t) && eng_tensor_is_contiguous(t)) return eng_tensor_retain(t);
  eng_tensor* r = eng_new_pinned(t->ndim, t->shape, t->dtype);
  if (!r) return NULL;
  if (t->numel > 0 && eng_copy_raw(r, t, t->stride)) { eng_tensor_release(r); return NULL; }
  return r;
}

int eng_tensor_set_data(eng_tensor* t, eng_tensor* src) {
  ENG_CHECK_I(t, "set_data"); ENG_CHECK_I(src, "set_data");
  if (src->dist)
    return eng_err("set_data: %s: the new data must be a plain tensor, got a DTensor", eng_desc(t));
  if (t->dist && !eng_same_shape(t, src)) /* a DTensor takes a new local shard of the same shape */
    return eng_err("set_data: DTensor with local %s: the new local shard %s must have the same shape", eng_desc(t),
                   eng_desc(src));
  if (t->grad_fn) return eng_err("set_data: %s is not a leaf (it has grad_fn %s)", eng_desc(t), t->grad_fn->name);
  if (t->requires_grad && !eng_dtype_is_floating(src->dtype))
    return eng_err("set_data: %s requires grad and %s is not floating point", eng_desc(t), eng_desc(src));
  if (t->grad && (t->grad->dtype != src->dtype || t->grad->device != src->device || !eng_same_shape(t->grad, src)))
    return eng_err("set_data: %s has a gradient %s that would not match %s (convert or clear the gradient first)",
                   eng_desc(t), eng_desc(t->grad), eng_desc(src));
  if (t == src) return 0;
  eng_storage_retain(src->storage);
  eng_storage_release(t->storage);
  t->storage = src->storage;
  t->dtype = src->dtype; t->device = src->device; t->ndim = src->ndim;
  for (int d = 0; d < ENG_MAX_DIMS; d++) {
    t->shape[d] = d < src->ndim ? src->shape[d] : 0;
    t->stride[d] = d < src->ndim ? src->stride[d] : 0;
  }
  t->offset = src->offset;
  t->numel = src->numel;
  return 0;
}

/* DTensor copy_: src already laid out as dst (eng_dispatch_inplace), copied local to local. */
static int copy_local(eng_op_call* c) { return eng_tensor_copy_(c->in[0], c->in[1]); }

int eng_tensor_copy_(eng_tensor* dst, eng_tensor* src) {
  ENG_CHECK_I(dst, "copy_"); ENG_CHECK_I(src, "copy_");
  if (eng_check_inplace(dst, "copy_")) return -1;
  if (eng_grad_enabled() && src->requires_grad)
    return eng_err("copy_: source %s requires grad and copy_ is not differentiable here; use clone() "
                   "or copy under no_grad", eng_desc(src));
  if (ENG_DT_ACTIVE(dst->dist && src->dist)) /* PyTorch: the source is redistributed to the destination's layout */
    return eng_op_dispatch_inplace("copy_", 1, &(eng_op_call){.name = "copy_", .n_in = 2, .in = {dst, src}}, copy_local);
  int64_t bs[ENG_MAX_DIMS];
  int64_t tmp[ENG_MAX_DIMS];
  int n = eng_broadcast_shapes(dst->ndim, dst->shape, src->ndim, src->shape, tmp, "copy_", dst, src);
  if (n < 0) return -1;
  {
    int ok = n == dst->ndim;
    for (int d = 0; ok && d < n; d++) ok = tmp[d] == dst->shape[d];
    if (!ok) return eng_err("copy_: source %s cannot be broadcast to destination %s", eng_desc(src), eng_desc(dst));
  }
  eng_broadcast_strides(src, dst->ndim, dst->shape, bs);
  /* PyTorch's checks: no element of dst written twice, no source partly over the destination (the same
   * elements are a no-op); a source over dst's memory in another way is read from a copy */
  if (eng_check_internal_overlap(dst, "copy_")) return -1;
  if (dst->device == ENG_META) return 0; /* shapes only: nothing to write */
  if (src->device == ENG_META)
    return eng_err("copy_: cannot copy out of meta tensor %s into %s: it has no data", eng_desc(src), eng_desc(dst));
  if (dst->device == src->device) {
    int st = eng_overlap_status(dst, src);
    if (st == ENG_OVERLAP_FULL && dst->dtype == src->dtype) { eng_bump_version(dst); return 0; }
    if (eng_check_partial_overlap(dst, src, "copy_")) return -1;
  }
  int rc;
  eng_tensor* tmpt = dst->device != src->device ? eng_device_copy(src, dst->device) : eng_unaliased(dst, src);
  if (!tmpt) return -1;
  if (tmpt != src) eng_broadcast_strides(tmpt, dst->ndim, dst->shape, bs);
  rc = eng_copy_raw(dst, tmpt, bs);
  eng_tensor_release(tmpt);
  if (rc) return -1;
  eng_bump_version(dst);
  return 0;
}

static void fill_row(int64_t n, char** p, const int64_t* s, void* ctx) {
  const double* v = ctx;
  const int* dt = (const int*)(v + 1);
  for (int64_t i = 0; i < n; i++) kc_store(p[0] + i * s[0], *dt, *v);
}

int eng_tensor_fill_(eng_tensor* t, double value) {
  ENG_CHECK_I(t, "fill_");
  if (eng_check_inplace(t, "fill_") || eng_check_value(value, t->dtype, "fill_")) return -1;
  if (t->device == ENG_META) return 0; /* shapes only: nothing to write */
  if (eng_is_device(t->device)) {
    int rc;
    if (eng_tensor_is_contiguous(t)) {
      rc = eng_device_ops_of(t->device)->fill(eng_ptr(t), t->dtype, t->numel, value, "fill_");
    } else { /* a filled scalar broadcast (stride 0) into the strided view */
      eng_tensor* v = eng_tensor_full(0, NULL, value, t->dtype, t->device);
      int64_t zs[ENG_MAX_DIMS] = {0};
      rc = v ? eng_copy_raw(t, v, zs) : -1;
      eng_tensor_release(v);
    }
    if (rc) return -1;
  } else if (eng_tensor_is_contiguous(t)) kc_fill(t->numel, eng_ptr(t), t->dtype, value);
  else {
    struct { double v; int dt; } ctx = {value, t->dtype};
    char* base[1] = {eng_ptr(t)};
    const int64_t* st[1] = {t->stride};
    int esz[1] = {eng_dtype_size(t->dtype)};
    kc_foreach(t->ndim, t->shape, 1, base, st, esz, fill_row, &ctx);
  }
  eng_bump_version(t);
  return 0;
}

int eng_tensor_zero_(eng_tensor* t) { return eng_tensor_fill_(t, 0.0); }

eng_tensor* eng_tensor_detach(eng_tensor* t) {
  ENG_CHECK(t, "detach");
  eng_tensor* r = eng_view_of(t, t->ndim, t->shape, t->stride, t->offset);
  if (r && t->dist) r->dist = eng_spec_retain(t->dist); /* a detached DTensor stays a DTensor */
  return r;
}

int eng_tensor_set_requires_grad(eng_tensor* t, int flag) {
  ENG_CHECK_I(t, "requires_grad_");
  if (flag && !eng_dtype_is_floating(t->dtype))
    return eng_err("requires_grad_: only floating point tensors can require gradients, got %s", eng_desc(t));
  if (!flag && t->grad_fn)
    return eng_err("requires_grad_: %s is not a leaf (it has grad_fn %s); use detach()", eng_desc(t),
                   t->grad_fn->name);
  t->requires_grad = flag ? 1 : 0;
  return 0;
}

eng_tensor* eng_tensor_grad(eng_tensor* t) { return t ? t->grad : NULL; }

int eng_tensor_set_grad(eng_tensor* t, eng_tensor* g) {
  ENG_CHECK_I(t, "set_grad");
  if (g && (!eng_same_shape(t, g) || g->dtype != t->dtype || g->device != t->device))
    return eng_err("set_grad: gradient %s does not match tensor %s (shape, dtype and device must agree)",
                   eng_desc(g), eng_desc(t));
  if (g) eng_tensor_retain(g);
  eng_tensor_release(t->grad);
  t->grad = g;
  return 0;
}

int32_t eng_tensor_version(const eng_tensor* t) { return t ? t->storage->version : 0; }
