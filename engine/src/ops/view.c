/* view.c: views that share storage with their input (view, reshape,
 * transpose, permute, narrow, select, expand, squeeze, unsqueeze, flatten)
 * and their autograd.  reshape copies when the strides do not allow a view.
 * cat/stack/split/chunk/index_select live in ops/join.c. */
#include "core/internal.h"
#include "core/dispatch.h"
#include "autograd/autograd.h"
#include "eng/ops_shape.h"
#include <stdio.h>

/* "[1,3]" strides of t, for error messages. */
static const char* stride_str(const eng_tensor* t) { return eng_shape_str(t->ndim, t->stride); }

/* Wraps dim (negative counts from the end) for a tensor of ndim dims (a 0-d
 * tensor accepts 0 and -1); -1 with an error naming op and t otherwise. */
static int wrap_dim(int dim, int ndim, const char* op, const eng_tensor* t) {
  int n = ndim > 0 ? ndim : 1;
  if (dim < -n || dim >= n)
    return eng_err("%s: dim %lld out of range for %s (dims are 1-based; valid: 1..%d or %d..-1)", op, ENG_U(dim),
                   eng_desc(t), n, -n);
  return dim < 0 ? dim + n : dim;
}

/* A view of t with the given geometry; records fn as the backward of out
 * when t needs grad.  Returns a new reference or NULL. */
static eng_tensor* view_rec(eng_tensor* t, int nd, const int64_t* shape, const int64_t* stride,
                            int64_t offset, const char* name, eng_backward_fn fn, eng_node** node) {
  if (node) *node = NULL;
  eng_tensor* out = eng_view_of(t, nd, shape, stride, offset);
  if (!out) return NULL;
  if (fn && eng_any_requires_grad(1, &t) && eng_dtype_is_floating(t->dtype)) {
    eng_node* n = eng_record(name, fn, 1, &t, out);
    if (!n) { eng_tensor_release(out); return NULL; }
    if (node) *node = n;
  }
  return out;
}

/* ------------------------------------------------------------ backwards */
static int finish(eng_node* n, eng_tensor* g, eng_tensor** gi) {
  if (!g) return -1;
  gi[0] = eng_grad_to_input(n, 0, g);
  eng_tensor_release(g);
  return gi[0] ? 0 : -1;
}

/* view, reshape, squeeze, unsqueeze, flatten: reshape the gradient back. */
static int reshape_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  return finish(n, eng_reshape(go[0], eng_node_in_ndim(n, 0), eng_node_in_shape(n, 0)), gi);
}

static int transpose_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  return finish(n, eng_transpose(go[0], (int)n->ints[0], (int)n->ints[1]), gi);
}

static int permute_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  int nd = eng_node_in_ndim(n, 0), inv[ENG_MAX_DIMS];
  for (int d = 0; d < nd; d++) inv[n->ints[d]] = d;
  return finish(n, eng_permute(go[0], nd, inv), gi);
}

/* narrow (ints: 0, dim, start, length) and select (ints: 1, dim, index):
 * zeros of the input's shape with the gradient copied into the slice. */
static int slice_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor* z = eng_tensor_zeros(eng_node_in_ndim(n, 0), eng_node_in_shape(n, 0), eng_node_in_dtype(n, 0),
                                   go[0]->device);
  if (!z) return -1;
  eng_tensor* v = n->ints[0] == 0 ? eng_narrow(z, (int)n->ints[1], n->ints[2], n->ints[3])
                                  : eng_select(z, (int)n->ints[1], n->ints[2]);
  int rc = v ? eng_tensor_copy_(v, go[0]) : -1;
  eng_tensor_release(v);
  if (rc) { eng_tensor_release(z); return -1; }
  gi[0] = z;
  return 0;
}

/* expand: sum over the broadcast dims. */
static int expand_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  gi[0] = eng_grad_to_input(n, 0, go[0]);
  return gi[0] ? 0 : -1;
}

/* ------------------------------------------------------------ view / reshape */
/* Resolves one -1 in shape against t's numel into out. */
static int infer_shape(const char* op, const eng_tensor* t, int ndim, const int64_t* shape, int64_t* out) {
  if (ndim < 0 || ndim > ENG_MAX_DIMS)
    return eng_err("%s: %d dims requested for %s; tensors have 0 to %d dims", op, ndim, eng_desc(t), ENG_MAX_DIMS);
  if (ndim > 0 && !shape) return eng_err("%s: shape is NULL", op);
  int infer = -1;
  int64_t prod = 1;
  for (int d = 0; d < ndim; d++) {
    out[d] = shape[d];
    if (shape[d] == -1) {
      if (infer >= 0)
        return eng_err("%s: only one dimension can be inferred (-1) in shape %s for %s", op,
                       eng_shape_str(ndim, shape), eng_desc(t));
      infer = d;
    } else if (shape[d] < 0) {
      return eng_err("%s: invalid size %lld at dim %d of shape %s for %s", op, (long long)shape[d], d + 1,
                     eng_shape_str(ndim, shape), eng_desc(t));
    } else {
      if (shape[d] > 0 && prod > INT64_MAX / shape[d])
        return eng_err("%s: shape %s is too large", op, eng_shape_str(ndim, shape));
      prod *= shape[d];
    }
  }
  if (infer >= 0) {
    if (prod == 0)
      return eng_err("%s: cannot reshape %s (%lld elements) into shape %s because the unspecified dimension "
                     "size -1 can be any value and is ambiguous", op, eng_desc(t), (long long)t->numel,
                     eng_shape_str(ndim, shape));
    if (t->numel % prod != 0)
      return eng_err("%s: shape %s is invalid for input of size %lld (%s)", op, eng_shape_str(ndim, shape),
                     (long long)t->numel, eng_desc(t));
    out[infer] = t->numel / prod;
  } else if (prod != t->numel) {
    return eng_err("%s: shape %s is invalid for input of size %lld (%s)", op, eng_shape_str(ndim, shape),
                   (long long)t->numel, eng_desc(t));
  }
  return 0;
}

/* Strides for viewing t as shape (PyTorch's computeStride); 0 on success,
 * -1 when the view is impossible without a copy. */
static int compute_stride(const eng_tensor* t, int nd, const int64_t* shape, int64_t* stride) {
  int on = t->ndim;
  const int64_t* os = t->shape;
  const int64_t* ost = t->stride;
  if (on == 0) { for (int d = 0; d < nd; d++) stride[d] = 1; return 0; }
  if (t->numel == 0) {
    int same = on == nd;
    for (int d = 0; same && d < nd; d++) same = os[d] == shape[d];
    if (same) { for (int d = 0; d < nd; d++) stride[d] = ost[d]; return 0; }
    eng_contiguous_strides(nd, shape, stride);
    return 0;
  }
  int view_d = nd - 1;
  int64_t chunk_base = ost[on - 1], tensor_numel = 1, view_numel = 1;
  for (int td = on - 1; td >= 0; td--) {
    tensor_numel *= os[td];
    if (td == 0 || (os[td - 1] != 1 && ost[td - 1] != tensor_numel * chunk_base)) {
      while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
        stride[view_d] = view_numel * chunk_base;
        view_numel *= shape[view_d];
        view_d--;
      }
      if (view_numel != tensor_numel) return -1;
      if (td > 0) { chunk_base = ost[td - 1]; tensor_numel = 1; view_numel = 1; }
    }
  }
  return view_d == -1 ? 0 : -1;
}

eng_tensor* eng_view(eng_tensor* t, int ndim, const int64_t* shape) {
  ENG_CHECK(t, "view");
  if (ENG_DT_ACTIVE(t->dist)) return eng_op_dispatch(ENG_OP_VIEW, &(eng_op_call){.name = "view", .n_in = 1, .in = {t}, .list = shape, .n_list = ndim});
  int64_t sh[ENG_MAX_DIMS], st[ENG_MAX_DIMS];
  if (infer_shape("view", t, ndim, shape, sh)) return NULL;
  if (compute_stride(t, ndim, sh, st))
    return eng_errp("view: %s with strides %s cannot be viewed as shape %s: view size is not compatible with "
                    "input tensor's size and stride (at least one dimension spans across two contiguous "
                    "subspaces); use reshape instead", eng_desc(t), stride_str(t), eng_shape_str(ndim, sh));
  return view_rec(t, ndim, sh, st, t->offset, "ViewBackward", reshape_bw, NULL);
}

/* reshape under a given op name: a view when possible, else a copy. */
static eng_tensor* reshape_as(eng_tensor* t, int ndim, const int64_t* sh, const char* name) {
  int64_t st[ENG_MAX_DIMS];
  if (!compute_stride(t, ndim, sh, st)) return view_rec(t, ndim, sh, st, t->offset, name, reshape_bw, NULL);
  eng_tensor* c = eng_as_contig(t, t->dtype);
  if (!c) return NULL;
  eng_contiguous_strides(ndim, sh, st);
  eng_tensor* out = eng_view_of(c, ndim, sh, st, c->offset);
  eng_tensor_release(c);
  if (!out) return NULL;
  if (eng_any_requires_grad(1, &t) && eng_dtype_is_floating(t->dtype) &&
      !eng_record(name, reshape_bw, 1, &t, out)) {
    eng_tensor_release(out);
    return NULL;
  }
  return out;
}

eng_tensor* eng_reshape(eng_tensor* t, int ndim, const int64_t* shape) {
  ENG_CHECK(t, "reshape");
  if (ENG_DT_ACTIVE(t->dist)) return eng_op_dispatch(ENG_OP_VIEW, &(eng_op_call){.name = "reshape", .n_in = 1, .in = {t}, .ints = {1}, .list = shape, .n_list = ndim});
  int64_t sh[ENG_MAX_DIMS];
  if (infer_shape("reshape", t, ndim, shape, sh)) return NULL;
  return reshape_as(t, ndim, sh, "ReshapeBackward");
}

/* ------------------------------------------------------------ transpose / permute */
eng_tensor* eng_transpose(eng_tensor* t, int d0, int d1) {
  ENG_CHECK(t, "transpose");
  if (ENG_DT_ACTIVE(t->dist)) return eng_op_dispatch(ENG_OP_TRANSPOSE, &(eng_op_call){.name = "transpose", .n_in = 1, .in = {t}, .ints = {d0, d1}});
  int a = wrap_dim(d0, t->ndim, "transpose", t), b = a < 0 ? -1 : wrap_dim(d1, t->ndim, "transpose", t);
  if (a < 0 || b < 0) return NULL;
  int64_t sh[ENG_MAX_DIMS], st[ENG_MAX_DIMS];
  for (int d = 0; d < t->ndim; d++) { sh[d] = t->shape[d]; st[d] = t->stride[d]; }
  if (t->ndim > 0) {
    sh[a] = t->shape[b]; st[a] = t->stride[b];
    sh[b] = t->shape[a]; st[b] = t->stride[a];
  }
  eng_node* n;
  eng_tensor* out = view_rec(t, t->ndim, sh, st, t->offset, "TransposeBackward", transpose_bw, &n);
  if (n) { n->ints[0] = a; n->ints[1] = b; }
  return out;
}

eng_tensor* eng_permute(eng_tensor* t, int ndim, const int* dims) {
  ENG_CHECK(t, "permute");
  if (ENG_DT_ACTIVE(t->dist)) {
    int64_t l[ENG_MAX_DIMS];
    if (ndim < 0 || ndim > ENG_MAX_DIMS || (ndim > 0 && !dims))
      return eng_errp("permute: %d dims given for %s (at most %d)", ndim, eng_desc(t), ENG_MAX_DIMS);
    for (int i = 0; i < ndim; i++) l[i] = dims[i];
    return eng_op_dispatch(ENG_OP_PERMUTE, &(eng_op_call){.name = "permute", .n_in = 1, .in = {t}, .list = l, .n_list = ndim});
  }
  if (ndim != t->ndim)
    return eng_errp("permute: number of dims does not match: %d dims given for %s", ndim, eng_desc(t));
  if (ndim > 0 && !dims) return eng_errp("permute: dims is NULL");
  int p[ENG_MAX_DIMS], seen[ENG_MAX_DIMS] = {0};
  for (int d = 0; d < ndim; d++) {
    p[d] = wrap_dim(dims[d], ndim, "permute", t);
    if (p[d] < 0) return NULL;
    if (seen[p[d]]++) {
      char buf[128]; int k = 0;
      for (int i = 0; i < ndim && k < 120; i++) k += snprintf(buf + k, sizeof buf - k, i ? ",%lld" : "%lld", ENG_U(dims[i]));
      return eng_errp("permute: dim %lld is repeated in dims [%s] for %s", ENG_U(dims[d]), buf, eng_desc(t));
    }
  }
  int64_t sh[ENG_MAX_DIMS], st[ENG_MAX_DIMS];
  for (int d = 0; d < ndim; d++) { sh[d] = t->shape[p[d]]; st[d] = t->stride[p[d]]; }
  eng_node* n;
  eng_tensor* out = view_rec(t, ndim, sh, st, t->offset, "PermuteBackward", permute_bw, &n);
  if (n) for (int d = 0; d < ndim; d++) n->ints[d] = p[d];
  return out;
}

/* ------------------------------------------------------------ narrow / select */
eng_tensor* eng_narrow(eng_tensor* t, int dim, int64_t start, int64_t length) {
  ENG_CHECK(t, "narrow");
  if (ENG_DT_ACTIVE(t->dist)) return eng_op_dispatch(ENG_OP_NARROW, &(eng_op_call){.name = "narrow", .n_in = 1, .in = {t}, .ints = {dim, start, length}});
  if (t->ndim == 0) return eng_errp("narrow: cannot be applied to a 0-d tensor (%s)", eng_desc(t));
  int d = wrap_dim(dim, t->ndim, "narrow", t);
  if (d < 0) return NULL;
  int64_t size = t->shape[d];
  if (start < -size || start > size)
    return eng_errp("narrow: start %lld out of range for dim %d of size %lld in %s (positions are 1-based; expected "
                    "1..%lld or %lld..-1)", ENG_U(start), d + 1, (long long)size, eng_desc(t), (long long)size + 1,
                    (long long)-size);
  if (start < 0) start += size;
  if (length < 0) return eng_errp("narrow: length must be non-negative, got %lld for %s", (long long)length, eng_desc(t));
  if (start + length > size)
    return eng_errp("narrow: start %lld with length %lld runs past the end of dim %d (size %lld) in %s",
                    (long long)start + 1, (long long)length, d + 1, (long long)size, eng_desc(t));
  int64_t sh[ENG_MAX_DIMS];
  for (int i = 0; i < t->ndim; i++) sh[i] = t->shape[i];
  sh[d] = length;
  eng_node* n;
  eng_tensor* out = view_rec(t, t->ndim, sh, t->stride, t->offset + start * t->stride[d], "NarrowBackward",
                             slice_bw, &n);
  if (n) { n->ints[0] = 0; n->ints[1] = d; n->ints[2] = start; n->ints[3] = length; }
  return out;
}

eng_tensor* eng_select(eng_tensor* t, int dim, int64_t index) {
  ENG_CHECK(t, "select");
  if (ENG_DT_ACTIVE(t->dist)) return eng_op_dispatch(ENG_OP_SELECT, &(eng_op_call){.name = "select", .n_in = 1, .in = {t}, .ints = {dim, index}});
  if (t->ndim == 0) return eng_errp("select: cannot be applied to a 0-d tensor (%s)", eng_desc(t));
  int d = wrap_dim(dim, t->ndim, "select", t);
  if (d < 0) return NULL;
  int64_t size = t->shape[d];
  if (index < -size || index >= size)
    return eng_errp("select: index %lld out of range for dim %d of size %lld in %s (indices are 1-based)",
                    ENG_U(index), d + 1, (long long)size, eng_desc(t));
  if (index < 0) index += size;
  int64_t sh[ENG_MAX_DIMS], st[ENG_MAX_DIMS];
  int k = 0;
  for (int i = 0; i < t->ndim; i++)
    if (i != d) { sh[k] = t->shape[i]; st[k] = t->stride[i]; k++; }
  eng_node* n;
  eng_tensor* out = view_rec(t, k, sh, st, t->offset + index * t->stride[d], "SelectBackward", slice_bw, &n);
  if (n) { n->ints[0] = 1; n->ints[1] = d; n->ints[2] = index; }
  return out;
}

/* ------------------------------------------------------------ expand */
eng_tensor* eng_expand(eng_tensor* t, int ndim, const int64_t* shape) {
  ENG_CHECK(t, "expand");
  if (ENG_DT_ACTIVE(t->dist)) return eng_op_dispatch(ENG_OP_EXPAND, &(eng_op_call){.name = "expand", .n_in = 1, .in = {t}, .list = shape, .n_list = ndim});
  if (ndim < t->ndim)
    return eng_errp("expand: %d sizes given for %s: the number of sizes must be at least the number of dims (%d)",
                    ndim, eng_desc(t), t->ndim);
  if (ndim > ENG_MAX_DIMS) return eng_errp("expand: %d dims requested; at most %d are supported", ndim, ENG_MAX_DIMS);
  if (ndim > 0 && !shape) return eng_errp("expand: shape is NULL");
  int64_t sh[ENG_MAX_DIMS], st[ENG_MAX_DIMS];
  int lead = ndim - t->ndim;
  for (int d = 0; d < ndim; d++) {
    int64_t s = shape[d];
    if (d < lead) {
      if (s < 0)
        return eng_errp("expand: size %lld is not allowed in the new leading dim %d (target %s, tensor %s)",
                        (long long)s, d + 1, eng_shape_str(ndim, shape), eng_desc(t));
      sh[d] = s; st[d] = 0;
      continue;
    }
    int64_t cur = t->shape[d - lead];
    if (s == -1) s = cur;
    if (s < 0)
      return eng_errp("expand: invalid size %lld at dim %d (target %s, tensor %s)", (long long)s, d + 1,
                      eng_shape_str(ndim, shape), eng_desc(t));
    if (s == cur) { sh[d] = s; st[d] = t->stride[d - lead]; }
    else if (cur == 1) { sh[d] = s; st[d] = 0; }
    else
      return eng_errp("expand: the expanded size %lld must match the existing size %lld at non-singleton dim %d "
                      "(target %s, tensor %s)", (long long)s, (long long)cur, d + 1, eng_shape_str(ndim, shape),
                      eng_desc(t));
  }
  if (eng_numel_checked(ndim, sh, t->dtype, NULL, "expand")) return NULL;
  return view_rec(t, ndim, sh, st, t->offset, "ExpandBackward", expand_bw, NULL);
}

/* ------------------------------------------------------------ squeeze / unsqueeze / flatten */
eng_tensor* eng_squeeze(eng_tensor* t, int dim) {
  ENG_CHECK(t, "squeeze");
  if (ENG_DT_ACTIVE(t->dist)) return eng_op_dispatch(ENG_OP_SQUEEZE, &(eng_op_call){.name = "squeeze", .n_in = 1, .in = {t}, .ints = {dim, 0}});
  int d = wrap_dim(dim, t->ndim, "squeeze", t);
  if (d < 0) return NULL;
  int64_t sh[ENG_MAX_DIMS], st[ENG_MAX_DIMS];
  int k = 0;
  for (int i = 0; i < t->ndim; i++)
    if (i != d || t->shape[i] != 1) { sh[k] = t->shape[i]; st[k] = t->stride[i]; k++; }
  return view_rec(t, k, sh, st, t->offset, "SqueezeBackward", reshape_bw, NULL);
}

eng_tensor* eng_squeeze_all(eng_tensor* t) {
  ENG_CHECK(t, "squeeze");
  if (ENG_DT_ACTIVE(t->dist)) return eng_op_dispatch(ENG_OP_SQUEEZE, &(eng_op_call){.name = "squeeze", .n_in = 1, .in = {t}, .ints = {0, 1}});
  int64_t sh[ENG_MAX_DIMS], st[ENG_MAX_DIMS];
  int k = 0;
  for (int i = 0; i < t->ndim; i++)
    if (t->shape[i] != 1) { sh[k] = t->shape[i]; st[k] = t->stride[i]; k++; }
  return view_rec(t, k, sh, st, t->offset, "SqueezeBackward", reshape_bw, NULL);
}

eng_tensor* eng_unsqueeze(eng_tensor* t, int dim) {
  ENG_CHECK(t, "unsqueeze");
  if (ENG_DT_ACTIVE(t->dist)) return eng_op_dispatch(ENG_OP_UNSQUEEZE, &(eng_op_call){.name = "unsqueeze", .n_in = 1, .in = {t}, .ints = {dim}});
  if (t->ndim >= ENG_MAX_DIMS)
    return eng_errp("unsqueeze: %s already has %d dims, the maximum", eng_desc(t), ENG_MAX_DIMS);
  int d = wrap_dim(dim, t->ndim + 1, "unsqueeze", t);
  if (d < 0) return NULL;
  int64_t sh[ENG_MAX_DIMS], st[ENG_MAX_DIMS];
  for (int i = 0, k = 0; i <= t->ndim; i++) {
    if (i == d) {
      sh[i] = 1;
      st[i] = d < t->ndim ? t->shape[d] * t->stride[d] : 1;
    } else {
      sh[i] = t->shape[k]; st[i] = t->stride[k]; k++;
    }
  }
  return view_rec(t, t->ndim + 1, sh, st, t->offset, "UnsqueezeBackward", reshape_bw, NULL);
}

eng_tensor* eng_flatten(eng_tensor* t, int start_dim, int end_dim) {
  ENG_CHECK(t, "flatten");
  if (ENG_DT_ACTIVE(t->dist)) return eng_op_dispatch(ENG_OP_FLATTEN, &(eng_op_call){.name = "flatten", .n_in = 1, .in = {t}, .ints = {start_dim, end_dim}});
  int s = wrap_dim(start_dim, t->ndim, "flatten", t), e = s < 0 ? -1 : wrap_dim(end_dim, t->ndim, "flatten", t);
  if (s < 0 || e < 0) return NULL;
  if (s > e)
    return eng_errp("flatten: start_dim %lld comes after end_dim %lld (%s)", ENG_U(start_dim), ENG_U(end_dim), eng_desc(t));
  int64_t one = 1;
  if (t->ndim == 0) return reshape_as(t, 1, &one, "FlattenBackward");
  if (s == e) return eng_tensor_retain(t);
  int64_t sh[ENG_MAX_DIMS];
  int k = 0;
  for (int i = 0; i < s; i++) sh[k++] = t->shape[i];
  int64_t m = 1;
  for (int i = s; i <= e; i++) m *= t->shape[i];
  sh[k++] = m;
  for (int i = e + 1; i < t->ndim; i++) sh[k++] = t->shape[i];
  return reshape_as(t, k, sh, "FlattenBackward");
}
