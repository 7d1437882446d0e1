/* join.c: ops that join or split tensors along a dim (cat, stack,
 * split, split_sizes, chunk) and index_select, with their autograd.
 * Pieces of split/chunk are views of the input; cat/stack/index_select copy. */
#include "core/internal.h"
#include "core/dispatch.h"
#include "kernels/cpu/kcpu.h"
#include "ops/cuda_ops.h"
#include "autograd/autograd.h"
#include "eng/cuda.h"
#include "eng/ops_shape.h"
#include <stdio.h>

static int wrap_dim(int dim, int ndim, const char* op, const eng_tensor* t) {
  int n = ndim > 0 ? ndim : 1;
  if (dim < -n || dim >= n)
    return eng_err("%s: dim %lld out of range for %s (dims are 1-based; valid: 1..%d or %d..-1)", op, ENG_U(dim),
                   eng_desc(t), n, -n);
  return dim < 0 ? dim + n : dim;
}

/* ------------------------------------------------------------ cat / stack */
/* cat skips 1-d empty tensors of shape [0] in the shape checks (as PyTorch). */
static int legacy_empty(const eng_tensor* t) { return t->ndim == 1 && t->shape[0] == 0; }

/* ints: dim, stack flag.  Each input gets its slice of the gradient. */
static int join_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  int dim = (int)n->ints[0], stack = (int)n->ints[1];
  eng_tensor* g = go[0];
  int64_t off = 0;
  for (int i = 0; i < n->n_inputs; i++) {
    int nd = eng_node_in_ndim(n, i);
    const int64_t* sh = eng_node_in_shape(n, i);
    int skipped = !stack && nd != g->ndim;
    int64_t s = stack ? 1 : (skipped ? 0 : sh[dim]);
    if (eng_node_needs_grad(n, i)) {
      eng_tensor* p;
      if (stack) p = eng_select(g, dim, i);
      else if (skipped) p = eng_tensor_zeros(nd, sh, eng_node_in_dtype(n, i), g->device);
      else p = eng_narrow(g, dim, off, s);
      if (!p) return -1;
      gi[i] = eng_grad_to_input(n, i, p);
      eng_tensor_release(p);
      if (!gi[i]) return -1;
    }
    off += s;
  }
  return 0;
}

static eng_tensor* join(int n, eng_tensor** ts, int dim, int stack) {
  const char* op = stack ? "stack" : "cat";
  if (n < 1 || !ts) return eng_errp("%s: expected a non-empty list of tensors", op);
  if (!eng_dispatch_local_mode())
    for (int i = 0; i < n; i++)
      if (ts[i] && ts[i]->dist)
        return eng_op_dispatch(ENG_OP_JOIN, &(eng_op_call){.name = op, .ints = {dim, stack}, .tensors = ts, .n_tensors = n});
  int dt = -1;
  const eng_tensor* ref = NULL;
  for (int i = 0; i < n; i++) {
    if (!ts[i]) return eng_errp("%s: tensor %d of the list is nil/NULL", op, i + 1);
    if (!stack && ts[i]->ndim == 0)
      return eng_errp("cat: zero-dimensional tensor %s (at position %d) cannot be concatenated", eng_desc(ts[i]), i + 1);
    if (ts[i]->device != ts[0]->device)
      return eng_errp("%s: tensors on different devices: %s at position 1 and %s at position %d", op,
                      eng_desc(ts[0]), eng_desc(ts[i]), i + 1);
    dt = i == 0 ? ts[i]->dtype : eng_promote_types(dt, ts[i]->dtype);
    if (!ref && (stack || !legacy_empty(ts[i]))) ref = ts[i];
  }
  if (!ref) ref = ts[0]; /* all are [0]: the result is [0] */
  int rnd = ref->ndim, ond = rnd + (stack ? 1 : 0);
  if (ond > ENG_MAX_DIMS) return eng_errp("stack: the result would have %d dims; at most %d are supported", ond, ENG_MAX_DIMS);
  int d = wrap_dim(dim, ond, op, ref);
  if (d < 0) return NULL;
  int ri = 0;
  while (ts[ri] != ref) ri++;
  int64_t osh[ENG_MAX_DIMS];
  for (int k = 0, j = 0; k < ond; k++) osh[k] = (stack && k == d) ? n : ref->shape[j++];
  if (!stack) osh[d] = 0;
  for (int i = 0; i < n; i++) {
    const eng_tensor* t = ts[i];
    if (stack) {
      if (!eng_same_shape(t, ref))
        return eng_errp("stack: expects each tensor to be equal size, but got %s at entry %d and %s at entry %d",
                        eng_desc(ref), ri + 1, eng_desc(t), i + 1);
      continue;
    }
    if (legacy_empty(t) && t != ref) continue;
    if (t->ndim != rnd)
      return eng_errp("cat: tensors must have the same number of dims: got %s at position %d and %s at position %d",
                      eng_desc(ref), ri + 1, eng_desc(t), i + 1);
    for (int k = 0; k < rnd; k++)
      if (k != d && t->shape[k] != ref->shape[k])
        return eng_errp("cat: sizes of tensors must match except in dim %d: expected size %lld but got size %lld "
                        "at dim %d for tensor %d in the list (%s vs %s)", d + 1, (long long)ref->shape[k],
                        (long long)t->shape[k], k + 1, i + 1, eng_desc(t), eng_desc(ref));
    if (__builtin_add_overflow(osh[d], t->shape[d], &osh[d]))
      return eng_errp("cat: the concatenated size along dim %d overflows a 64-bit integer (tensor %d: %s)", d + 1,
                      i + 1, eng_desc(t));
  }
  eng_tensor* out = eng_new(ond, osh, dt, ref->device);
  if (!out) return NULL;
  if (out->numel > 0 && out->device != ENG_META) { /* meta: the shape is the result */
    int es = eng_dtype_size(dt);
    int fast = out->device != ENG_CUDA; /* CUDA: one strided copy per input */
    for (int i = 0; i < n && fast; i++)
      fast = (ts[i]->dtype == dt && eng_tensor_is_contiguous(ts[i])) || ts[i]->numel == 0;
    int64_t outer = 1, inner = 1;
    for (int k = 0; k < d; k++) outer *= osh[k];
    for (int k = d + 1; k < ond; k++) inner *= osh[k];
    if (fast) {
      char* srcs_s[16]; int64_t blk_s[16];
      char** srcs = n <= 16 ? srcs_s : malloc((size_t)n * sizeof *srcs);
      int64_t* blk = n <= 16 ? blk_s : malloc((size_t)n * sizeof *blk);
      if (!srcs || !blk) {
        if (n > 16) { free(srcs); free(blk); }
        eng_tensor_release(out);
        return eng_errp("%s: out of memory", op);
      }
      for (int i = 0; i < n; i++) {
        int64_t s = stack ? 1 : ((legacy_empty(ts[i]) && ts[i] != ref) ? 0 : ts[i]->shape[d]);
        srcs[i] = eng_ptr(ts[i]);
        blk[i] = ts[i]->numel == 0 ? 0 : s * inner * es;
      }
      kc_cat_blocks(n, outer, eng_ptr(out), srcs, blk);
      if (n > 16) { free(srcs); free(blk); }
    } else {
      int64_t off = 0;
      for (int i = 0; i < n; i++) {
        const eng_tensor* t = ts[i];
        if (!stack && legacy_empty(t) && t != ref) continue;
        int64_t sh[ENG_MAX_DIMS], sst[ENG_MAX_DIMS];
        for (int k = 0, j = 0; k < ond; k++) {
          if (stack && k == d) { sh[k] = 1; sst[k] = 0; continue; }
          sh[k] = t->shape[j]; sst[k] = t->stride[j]; j++;
        }
        if (t->numel > 0 && out->device == ENG_CUDA) {
          if (eng_cu_copy(ond, sh, eng_ptr(out) + off * out->stride[d] * es, dt, out->stride, eng_ptr(t), t->dtype, sst,
                          op)) {
            eng_tensor_release(out);
            return NULL;
          }
        } else if (t->numel > 0)
          kc_copy(ond, sh, eng_ptr(out) + off * out->stride[d] * es, dt, out->stride, eng_ptr(t), t->dtype, sst);
        off += sh[d];
      }
    }
  }
  if (eng_any_requires_grad(n, ts) && eng_dtype_is_floating(dt)) {
    eng_node* nd = eng_record(stack ? "StackBackward" : "CatBackward", join_bw, n, ts, out);
    if (!nd) { eng_tensor_release(out); return NULL; }
    nd->ints[0] = d; nd->ints[1] = stack;
  }
  return out;
}

eng_tensor* eng_cat(int n, eng_tensor** ts, int dim) { return join(n, ts, dim, 0); }
eng_tensor* eng_stack(int n, eng_tensor** ts, int dim) { return join(n, ts, dim, 1); }

/* 1 when the plain tensors ts lie side by side along (normalized) dim d in one storage: same dtype, device,
 * rank, strides and sizes except along d, each starting where the previous one ends. */
static int adjacent(int n, eng_tensor** ts, int d) {
  const eng_tensor* a = ts[0];
  if (d < 0 || d >= a->ndim) return 0;
  for (int i = 0; i < n; i++) {
    const eng_tensor* t = ts[i];
    if (t->dist || t->device == ENG_META || !t->storage || t->storage != a->storage || t->dtype != a->dtype ||
        t->device != a->device || t->ndim != a->ndim)
      return 0;
    for (int k = 0; k < a->ndim; k++)
      if (t->stride[k] != a->stride[k] || (k != d && t->shape[k] != a->shape[k])) return 0;
    if (i > 0 && t->offset != ts[i - 1]->offset + ts[i - 1]->shape[d] * a->stride[d]) return 0;
  }
  return 1;
}

int eng_tensors_adjacent(int n, eng_tensor** ts, int dim) {
  if (n < 1 || !ts) return 0;
  for (int i = 0; i < n; i++) if (!ts[i]) return 0;
  int nd = ts[0]->ndim;
  if (nd < 1 || dim < -nd || dim >= nd) return 0;
  return adjacent(n, ts, dim < 0 ? dim + nd : dim);
}

/* The parts' gradients reach them last part first (edges_last_first): a fused projection's weights get theirs in
 * the order the separate projections' backward gives them (PyTorch runs the latest-created one first). */
eng_tensor* eng_cat_adjacent(int n, eng_tensor** ts, int dim) {
  if (!eng_tensors_adjacent(n, ts, dim)) {
    eng_tensor* out = eng_cat(n, ts, dim);
    if (out && out->grad_fn) out->grad_fn->edges_last_first = 1;
    return out;
  }
  const eng_tensor* a = ts[0];
  int d = dim < 0 ? dim + a->ndim : dim;
  int64_t sh[ENG_MAX_DIMS];
  for (int k = 0; k < a->ndim; k++) sh[k] = a->shape[k];
  sh[d] = 0;
  for (int i = 0; i < n; i++) sh[d] += ts[i]->shape[d];
  eng_tensor* out = eng_view_of(ts[0], a->ndim, sh, a->stride, a->offset);
  if (!out) return NULL;
  if (eng_any_requires_grad(n, ts) && eng_dtype_is_floating(a->dtype)) {
    eng_node* nd = eng_record("CatBackward", join_bw, n, ts, out);
    if (!nd) { eng_tensor_release(out); return NULL; }
    nd->ints[0] = d; nd->ints[1] = 0;
    nd->edges_last_first = 1;
  }
  return out;
}

/* ------------------------------------------------------------ split / chunk */
/* ctx: the n_outputs piece sizes; ints[0]: dim.  A zero tensor of the
 * input's shape with each piece's gradient (NULL: zero) copied in. */
static int split_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  const int64_t* sizes = n->ctx;
  int dim = (int)n->ints[0];
  int all = n->n_outputs > 0 && n->n_outputs <= 16;
  for (int k = 0; k < n->n_outputs && all; k++)
    all = go[k] && go[k]->dtype == eng_node_in_dtype(n, 0) && go[k]->ndim == eng_node_in_ndim(n, 0);
  if (all) { /* every piece has a gradient: one cat (no zero fill; the QKV split of the models), or none when the
               * pieces already lie side by side (attention's gradients of a fused QKV projection on CUDA) */
    gi[0] = eng_cat_adjacent(n->n_outputs, go, dim);
    return gi[0] ? 0 : -1;
  }
  int dev = ENG_CPU;
  for (int k = 0; k < n->n_outputs; k++) if (go[k]) { dev = go[k]->device; break; }
  eng_tensor* z = eng_tensor_zeros(eng_node_in_ndim(n, 0), eng_node_in_shape(n, 0), eng_node_in_dtype(n, 0), dev);
  if (!z) return -1;
  int64_t off = 0;
  for (int k = 0; k < n->n_outputs; k++) {
    if (go[k]) {
      eng_tensor* v = eng_narrow(z, dim, off, sizes[k]);
      int rc = v ? eng_tensor_copy_(v, go[k]) : -1;
      eng_tensor_release(v);
      if (rc) { eng_tensor_release(z); return -1; }
    }
    off += sizes[k];
  }
  gi[0] = z;
  return 0;
}

static void split_free(eng_node* n) { free(n->ctx); n->ctx = NULL; }

/* n views of t along (normalized) dim d with the given sizes (which sum to
 * the dim's size); one multi-output node for autograd. */
static int split_core(eng_tensor* t, int n, const int64_t* sizes, int d, eng_tensor** out, const char* op) {
  int64_t off = 0;
  for (int k = 0; k < n; k++) {
    int64_t sh[ENG_MAX_DIMS];
    for (int i = 0; i < t->ndim; i++) sh[i] = t->shape[i];
    sh[d] = sizes[k];
    out[k] = eng_view_of(t, t->ndim, sh, t->stride, t->offset + off * t->stride[d]);
    if (!out[k]) goto fail;
    off += sizes[k];
  }
  if (n > 0 && eng_any_requires_grad(1, &t) && eng_dtype_is_floating(t->dtype)) {
    int64_t* ctx = malloc((size_t)n * sizeof *ctx);
    if (!ctx) { eng_err("%s: out of memory", op); goto fail; }
    memcpy(ctx, sizes, (size_t)n * sizeof *ctx);
    eng_node* nd = eng_record_multi("SplitBackward", split_bw, 1, &t, n, out);
    if (!nd) { free(ctx); goto fail; }
    nd->ctx = ctx; nd->free_ctx = split_free; nd->ints[0] = d;
  }
  return n;
fail:
  for (int k = 0; k < n; k++) { eng_tensor_release(out[k]); out[k] = NULL; }
  return -1;
}

static int split_even(eng_tensor* t, int64_t split_size, int d, int max_out, eng_tensor** out, const char* op,
                      int min_pieces) {
  int64_t size = t->shape[d];
  int64_t cnt = split_size > 0 ? (size + split_size - 1) / split_size : 1;
  if (cnt < min_pieces) cnt = min_pieces;
  if (cnt > max_out)
    return eng_err("%s: %s along dim %d gives %lld pieces but there is room for only %d outputs", op, eng_desc(t),
                   d + 1, (long long)cnt, max_out);
  int64_t sz_s[64];
  int64_t* sz = cnt <= 64 ? sz_s : malloc((size_t)cnt * sizeof *sz);
  if (!sz) return eng_err("%s: out of memory", op);
  for (int64_t k = 0; k < cnt; k++) {
    int64_t rem = size - k * split_size;
    sz[k] = rem < split_size ? (rem > 0 ? rem : 0) : split_size;
  }
  int rc = split_core(t, (int)cnt, sz, d, out, op);
  if (sz != sz_s) free(sz);
  return rc;
}

int eng_split(eng_tensor* t, int64_t split_size, int dim, int max_out, eng_tensor** out) {
  ENG_CHECK_I(t, "split");
  if (ENG_DT_ACTIVE(t->dist))
    return eng_op_dispatch_multi(ENG_OP_SPLIT, &(eng_op_call){.name = "split", .n_in = 1, .in = {t}, .ints = {0, split_size, dim, max_out}}, out);
  if (t->ndim == 0) return eng_err("split: cannot split a 0-d tensor (%s)", eng_desc(t));
  if (!out || max_out < 1) return eng_err("split: no room for outputs (max_out %d)", max_out);
  int d = wrap_dim(dim, t->ndim, "split", t);
  if (d < 0) return -1;
  if (split_size < 0) return eng_err("split: split_size must be non-negative, got %lld for %s", (long long)split_size, eng_desc(t));
  if (split_size == 0 && t->shape[d] != 0)
    return eng_err("split: split_size can only be 0 if the dim's size is 0, but dim %d of %s has size %lld", d + 1,
                   eng_desc(t), (long long)t->shape[d]);
  return split_even(t, split_size, d, max_out, out, "split", 1);
}

int eng_split_sizes(eng_tensor* t, int n, const int64_t* sizes, int dim, eng_tensor** out) {
  ENG_CHECK_I(t, "split_sizes");
  if (ENG_DT_ACTIVE(t->dist))
    return eng_op_dispatch_multi(ENG_OP_SPLIT, &(eng_op_call){.name = "split", .n_in = 1, .in = {t}, .ints = {1, 0, dim, n}, .list = sizes, .n_list = n}, out);
  if (t->ndim == 0) return eng_err("split_sizes: cannot split a 0-d tensor (%s)", eng_desc(t));
  int d = wrap_dim(dim, t->ndim, "split_sizes", t);
  if (d < 0) return -1;
  if (n < 0 || (n > 0 && (!sizes || !out))) return eng_err("split_sizes: invalid sizes list (n = %d)", n);
  int64_t sum = 0;
  for (int k = 0; k < n; k++) {
    if (sizes[k] < 0)
      return eng_err("split_sizes: size %d is negative (%lld) for %s", k + 1, (long long)sizes[k], eng_desc(t));
    if (__builtin_add_overflow(sum, sizes[k], &sum))
      return eng_err("split_sizes: sizes overflow a 64-bit integer for %s", eng_desc(t));
  }
  if (sum != t->shape[d]) {
    char buf[200]; int k = 0;
    for (int i = 0; i < n && k < 180; i++) k += snprintf(buf + k, sizeof buf - k, i ? ",%lld" : "%lld", (long long)sizes[i]);
    if (k >= 180) snprintf(buf + 180, sizeof buf - 180, ",...");
    return eng_err("split_sizes: sizes [%s] must sum exactly to %lld (the size of dim %d of %s), but sum to %lld",
                   buf, (long long)t->shape[d], d + 1, eng_desc(t), (long long)sum);
  }
  return split_core(t, n, sizes, d, out, "split_sizes");
}

int eng_chunk(eng_tensor* t, int chunks, int dim, int max_out, eng_tensor** out) {
  ENG_CHECK_I(t, "chunk");
  if (ENG_DT_ACTIVE(t->dist))
    return eng_op_dispatch_multi(ENG_OP_SPLIT, &(eng_op_call){.name = "chunk", .n_in = 1, .in = {t}, .ints = {2, chunks, dim, max_out}}, out);
  if (t->ndim == 0) return eng_err("chunk: cannot chunk a 0-d tensor (%s)", eng_desc(t));
  if (chunks <= 0) return eng_err("chunk: chunks must be greater than 0, got %d for %s", chunks, eng_desc(t));
  if (!out || max_out < 1) return eng_err("chunk: no room for outputs (max_out %d)", max_out);
  int d = wrap_dim(dim, t->ndim, "chunk", t);
  if (d < 0) return -1;
  int64_t size = t->shape[d];
  int64_t split_size = (size + chunks - 1) / chunks;
  /* a 0-size dim gives `chunks` empty pieces (as torch.chunk) */
  return split_even(t, split_size, d, max_out, out, "chunk", size == 0 ? chunks : 1);
}

/* ------------------------------------------------------------ index_select */
/* Reads index (1-D or 0-d, i32/i64) into a new int64 array checked against size. */
static int64_t* read_index(const eng_tensor* index, int64_t size, const eng_tensor* t, int d, int64_t* n_out) {
  int64_t n = index->numel;
  int64_t* idx = malloc((size_t)(n > 0 ? n : 1) * sizeof *idx);
  if (!idx) return eng_errp("index_select: out of memory");
  if (n > 0 && eng_tensor_read(index, idx, ENG_I64, n)) { free(idx); return NULL; }
  for (int64_t j = 0; j < n; j++)
    if (idx[j] < 0 || idx[j] >= size) {
      eng_errp("index_select: index %lld (at position %lld) is out of range for dim %d of size %lld in %s "
               "(indices are 0-based)", (long long)idx[j], (long long)j + 1, d + 1, (long long)size, eng_desc(t));
      free(idx);
      return NULL;
    }
  *n_out = n;
  return idx;
}

/* CUDA index_select / its backward as row gathers / scatter-adds (the
 * embedding kernels) over each of the `outer` blocks; idx (host, checked)
 * goes to the device once.  bw: dst (zeroed, [outer, size, inner] of f32 or
 * f64) gets the sums of g ([outer, n_idx, inner]) rows. */
static int index_cuda(int bw, int dt, int64_t outer, int64_t size, int64_t n_idx, int64_t inner, char* dst,
                      const char* src, const int64_t* idx, const char* op) {
  if (outer * n_idx * inner == 0) return 0;
  void* didx = eng_cuda_malloc(n_idx * (int64_t)sizeof(int64_t));
  if (!didx) { eng_err_prefix("%s", op); return -1; }
  int es = eng_dtype_size(dt), rc = eng_cuda_memcpy_h2d(didx, idx, n_idx * (int64_t)sizeof(int64_t));
  for (int64_t o = 0; o < outer && rc == 0; o++) {
    if (bw)
      rc = eng_cu_embedding_bwd(dt, n_idx, didx, ENG_I64, src + o * n_idx * inner * es, inner, size, -1,
                                dst + o * size * inner * es, op);
    else
      rc = eng_cu_embedding_fwd(n_idx, didx, ENG_I64, src + o * size * inner * es, size, inner * es,
                                dst + o * n_idx * inner * es, op);
  }
  eng_cuda_free(didx);
  return rc;
}

static void split_dims(const int64_t* shape, int ndim, int d, int64_t* outer, int64_t* inner) {
  *outer = 1; *inner = 1;
  for (int k = 0; k < d; k++) *outer *= shape[k];
  for (int k = d + 1; k < ndim; k++) *inner *= shape[k];
}

static int index_select_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor* index = eng_node_saved(n, 0);
  if (!index) return -1;
  int d = (int)n->ints[0];
  int nd = eng_node_in_ndim(n, 0);
  const int64_t* sh = eng_node_in_shape(n, 0);
  int cdt = go[0]->dtype == ENG_F64 ? ENG_F64 : ENG_F32;
  int64_t n_idx;
  int64_t* idx = read_index(index, sh[d], go[0], d, &n_idx);
  if (!idx) return -1;
  eng_tensor* g = eng_as_contig(go[0], cdt);
  eng_tensor* z = g ? eng_tensor_zeros(nd, sh, cdt, go[0]->device) : NULL;
  if (z && z->device == ENG_CUDA) {
    int64_t outer, inner;
    split_dims(sh, nd, d, &outer, &inner);
    if (index_cuda(1, cdt, outer, sh[d], n_idx, inner, eng_ptr(z), eng_ptr(g), idx, n->name)) {
      eng_tensor_release(z);
      z = NULL;
    }
  } else if (z) {
    int64_t outer, inner;
    split_dims(sh, nd, d, &outer, &inner);
    kc_index_add(cdt, outer, sh[d], n_idx, inner, eng_ptr(z), eng_ptr(g), idx);
  }
  free(idx);
  eng_tensor_release(g);
  if (!z) return -1;
  gi[0] = eng_grad_to_input(n, 0, z);
  eng_tensor_release(z);
  return gi[0] ? 0 : -1;
}

eng_tensor* eng_index_select(eng_tensor* t, int dim, eng_tensor* index) {
  ENG_CHECK(t, "index_select"); ENG_CHECK(index, "index_select");
  if (eng_meta_check_local(t, "index_select") || eng_meta_check_local(index, "index_select")) return NULL;
  if (ENG_DT_ACTIVE(t->dist || index->dist || ENG_META_T(t) || ENG_META_T(index)))
    return eng_op_dispatch(ENG_OP_INDEX_SELECT, &(eng_op_call){.name = "index_select", .n_in = 2, .in = {t, index}, .ints = {dim}});
  if (t->ndim == 0) return eng_errp("index_select: cannot index a 0-d tensor (%s)", eng_desc(t));
  if (index->ndim > 1)
    return eng_errp("index_select: index must be a 1-D tensor (a vector), got %s for %s", eng_desc(index), eng_desc(t));
  if (index->dtype != ENG_I32 && index->dtype != ENG_I64)
    return eng_errp("index_select: index must be i32 or i64, got %s for %s", eng_desc(index), eng_desc(t));
  if (index->device != t->device)
    return eng_errp("index_select: index %s and tensor %s are on different devices", eng_desc(index), eng_desc(t));
  int d = wrap_dim(dim, t->ndim, "index_select", t);
  if (d < 0) return NULL;
  int64_t n_idx;
  int64_t* idx = read_index(index, t->shape[d], t, d, &n_idx);
  if (!idx) return NULL;
  int64_t sh[ENG_MAX_DIMS];
  for (int k = 0; k < t->ndim; k++) sh[k] = t->shape[k];
  sh[d] = n_idx;
  eng_tensor* src = eng_as_contig(t, t->dtype);
  eng_tensor* out = src ? eng_new(t->ndim, sh, t->dtype, t->device) : NULL;
  if (out && out->numel > 0 && out->device == ENG_CUDA) {
    int64_t outer, inner;
    split_dims(t->shape, t->ndim, d, &outer, &inner);
    if (index_cuda(0, t->dtype, outer, t->shape[d], n_idx, inner, eng_ptr(out), eng_ptr(src), idx, "index_select")) {
      eng_tensor_release(out);
      out = NULL;
    }
  } else if (out && out->numel > 0) {
    int64_t outer, inner;
    split_dims(t->shape, t->ndim, d, &outer, &inner);
    kc_index_select(outer, t->shape[d], n_idx, inner * eng_dtype_size(t->dtype), eng_ptr(out), eng_ptr(src), idx);
  }
  free(idx);
  eng_tensor_release(src);
  if (!out) return NULL;
  if (eng_any_requires_grad(1, &t) && eng_dtype_is_floating(t->dtype)) {
    eng_node* nd = eng_record("IndexSelectBackward", index_select_bw, 1, &t, out);
    if (!nd || eng_node_save(nd, index)) { eng_tensor_release(out); return NULL; }
    nd->ints[0] = d;
  }
  return out;
}
