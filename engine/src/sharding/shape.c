/* shape.c: sharding rules of the shape ops (PyTorch's _view_ops.py
 * dim mapping, made exact for uneven shards) and their DTensor entry points
 * (sharding/sharding_shape.h), which validate against the GLOBAL shape.
 *
 *   view/reshape/squeeze/unsqueeze/flatten (one "reshape" def): each Shard(d)
 *     maps to the output dim that starts at the same place in row-major order
 *     (same suffix product): a merged group [B, T, C] -> [B*T, C] keeps Shard
 *     when d is the outermost dim of the group, a split dim [B*T] -> [B, T]
 *     keeps it on the outermost resulting dim; inner dims of a merged group
 *     are replicated.  The candidate is then checked exactly: on every mesh
 *     coordinate the input shard, read in row-major order, must be the output
 *     shard (torch.chunk sizes and offsets, nested shards on 2-D meshes);
 *     otherwise the innermost remaining sharded mesh dim is replicated and the
 *     check repeated.  The local function views (reshapes) the local shard to
 *     the output's local shape: zero collectives for the kept shards.
 *   transpose/permute: Shard dims renumbered.  expand: expanded dims
 *     Replicate, others keep Shard (shifted by the new leading dims).
 *   narrow/select/index_select: a sharded narrowed/selected dim is replicated
 *     first; index_select also takes a Shard(0) index with a Replicate input
 *     (output Shard on the indexed dim).
 *   cat/stack: the cat dim Replicate; inputs sharded alike keep Shard (stack
 *     shifts dims after the new one).  split/split_sizes/chunk: the split dim
 *     is replicated once, then each piece is a narrow (a view; no more
 *     communication).
 *   Partial passes through every shape op (each output element is a copy of
 *   one input element, so any reduce op commutes with it).  */
#include "dtensor/dtensor_impl.h"
#include "sharding/sharding.h"
#include "sharding/sharding_shape.h"
#include "eng/ops_shape.h"
#include <stdio.h>

static const char* dt_desc(const eng_tensor* t) {
  static __thread char buf[4][700];
  static __thread int i;
  char* b = buf[i = (i + 1) & 3];
  if (t && t->dist) return eng_dtensor_describe(t, b, 700);
  return eng_desc(t);
}

/* ------------------------------------------------------------------ exact layout check */
/* The row-major set of global flat indices of a box (per-dim offset and
 * length in a tensor of global shape g), in a unique merged form: dims of
 * size 1 dropped, a dim merged into the block inside it when that block is
 * full or the dim holds one index. */
typedef struct box { int n, empty; int64_t g[ENG_MAX_DIMS], o[ENG_MAX_DIMS], l[ENG_MAX_DIMS]; } box;

static void canon(int nd, const int64_t* gs, const int64_t* ls, const int64_t* off, box* b) {
  b->n = 0; b->empty = 0;
  for (int d = 0; d < nd; d++) if (ls[d] == 0) { b->empty = 1; return; }
  int have = 0;
  int64_t G = 1, O = 0, L = 1;
  for (int d = nd - 1; d >= 0; d--) {
    int64_t g = gs[d], o = off[d], l = ls[d];
    if (g == 1) continue;
    if (!have) { G = g; O = o; L = l; have = 1; continue; }
    if (L == G) { O = o * G; L = l * G; G *= g; }
    else if (l == 1) { O = o * G + O; G *= g; }
    else { b->g[b->n] = G; b->o[b->n] = O; b->l[b->n] = L; b->n++; G = g; O = o; L = l; }
  }
  if (have) { b->g[b->n] = G; b->o[b->n] = O; b->l[b->n] = L; b->n++; }
}

static int box_equal(const box* a, const box* b) {
  if (a->empty || b->empty) return a->empty == b->empty;
  if (a->n != b->n) return 0;
  for (int i = 0; i < a->n; i++)
    if (a->g[i] != b->g[i] || a->o[i] != b->o[i] || a->l[i] != b->l[i]) return 0;
  return 1;
}

/* 1 when on every mesh coordinate the input shard (s's shape, placements ipl)
 * read in row-major order is exactly the output shard (oshape, opl); 0 when
 * not; -1 on error. */
static int layouts_match(const eng_dist_spec* s, const eng_placement* ipl, int ond, const int64_t* oshape,
                         const eng_placement* opl) {
  int mnd = s->mesh_ndim, coord[ENG_MAX_DIMS] = {0};
  for (;;) {
    int64_t ls[ENG_MAX_DIMS], lo[ENG_MAX_DIMS], os[ENG_MAX_DIMS], oo[ENG_MAX_DIMS];
    if (eng_local_shape_and_offset(s->ndim, s->shape, mnd, s->mesh_shape, coord, ipl, ls, lo)) return -1;
    if (eng_local_shape_and_offset(ond, oshape, mnd, s->mesh_shape, coord, opl, os, oo)) return -1;
    box a, b;
    canon(s->ndim, s->shape, ls, lo, &a);
    canon(ond, oshape, os, oo, &b);
    if (!box_equal(&a, &b)) return 0;
    int m = mnd - 1;
    while (m >= 0 && ++coord[m] >= s->mesh_shape[m]) { coord[m] = 0; m--; }
    if (m < 0) return 1;
  }
}

/* The layout of a reshape of s to (ond, osh): required input placements ipl
 * and output placements opl, per mesh dim (see the top of the file). */
static int reshape_plan(const eng_dist_spec* s, int ond, const int64_t* osh, eng_placement* ipl, eng_placement* opl) {
  int mnd = s->mesh_ndim, ind = s->ndim;
  int64_t isuf[ENG_MAX_DIMS + 1], osuf[ENG_MAX_DIMS + 1];
  isuf[ind] = 1;
  for (int d = ind - 1; d >= 0; d--) isuf[d] = isuf[d + 1] * s->shape[d];
  osuf[ond] = 1;
  for (int d = ond - 1; d >= 0; d--) osuf[d] = osuf[d + 1] * osh[d];
  for (int m = 0; m < mnd; m++) {
    eng_placement p = s->placements[m];
    ipl[m] = p; opl[m] = p;
    /* (the dispatcher replicates _StridedShard inputs before any rule; were one
     * to get here, it would be replicated: its shard is not one box) */
    if (p.kind == ENG_PLACEMENT_STRIDED_SHARD) { ipl[m] = opl[m] = sh_R(); continue; }
    if (!sh_is_S(&p)) continue;
    int d = p.dim, j = -1;
    if (s->numel > 0)
      for (int k = 0; k < ond && j < 0; k++)
        if (osuf[k] == isuf[d] && (osh[k] == 1) == (s->shape[d] == 1)) j = k;
    if (j < 0) ipl[m] = opl[m] = sh_R();
    else opl[m] = sh_S(j);
  }
  for (;;) {
    int ok = layouts_match(s, ipl, ond, osh, opl);
    if (ok < 0) return -1;
    if (ok) return 0;
    int m = mnd - 1;
    while (m >= 0 && !sh_is_S(&opl[m])) m--;
    if (m < 0) return eng_err("no layout for the reshape"); /* unreachable: all Replicate always matches */
    ipl[m] = opl[m] = sh_R();
  }
}

/* ------------------------------------------------------------------ reshape-like ops */
/* ints[0..ndim) = global output shape, scalars[0] = ndim, scalars[1] = 1 reshape / 0 view */
static int shape_from_ints(const eng_op_call* c, const eng_dist_spec* const* s, int* ndims, int64_t (*shapes)[8]) {
  (void)s;
  ndims[0] = (int)c->scalars[0];
  for (int d = 0; d < ndims[0]; d++) shapes[0][d] = c->ints[d];
  return 0;
}

static int reshape_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  eng_placement ipl[ENG_MAX_DIMS], opl[ENG_MAX_DIMS];
  if (reshape_plan(s[0], (int)c->scalars[0], c->ints, ipl, opl)) return -1;
  eng_strategy st;
  memset(&st, 0, sizeof st);
  st.in[0] = ipl[m]; st.out[0] = opl[m];
  int n = sh_push(out, cap, 0, &st);
  return sh_all_replicate(out, cap, n, 1, 1);
}

static int reshape_local(const eng_op_call* c, const eng_dist_spec* const* in_specs,
                         const eng_dist_spec* const* out_specs, eng_tensor** outs) {
  (void)in_specs;
  const eng_dist_spec* o = out_specs[0];
  outs[0] = c->scalars[1] != 0 ? eng_reshape(c->in[0], o->ndim, o->local_shape)
                               : eng_view(c->in[0], o->ndim, o->local_shape);
  return outs[0] ? 0 : -1;
}

static const eng_op_def eng_opdef_reshape = {"reshape", 1, reshape_rule, shape_from_ints, NULL, reshape_local, 1, 1};

static eng_tensor* dispatch_reshape(eng_tensor* t, int ndim, const int64_t* sh, int kind, const char* op) {
  eng_op_call c = {.name = op, .n_in = 1, .in = {t}};
  for (int d = 0; d < ndim; d++) c.ints[d] = sh[d];
  c.scalars[0] = ndim;
  c.scalars[1] = kind;
  return eng_dispatch(&eng_opdef_reshape, &c);
}

eng_tensor* eng_dt_reshape(eng_tensor* t, int ndim, const int64_t* shape, int kind, const char* op) {
  const eng_dist_spec* s = t->dist;
  if (ndim < 0 || ndim > ENG_MAX_DIMS)
    return eng_errp("%s: %d dims requested for %s; tensors have 0 to %d dims", op, ndim, dt_desc(t), ENG_MAX_DIMS);
  if (ndim > 0 && !shape) return eng_errp("%s: shape is NULL", op);
  int64_t sh[ENG_MAX_DIMS], prod = 1;
  int infer = -1;
  for (int d = 0; d < ndim; d++) {
    sh[d] = shape[d];
    if (shape[d] == -1) {
      if (infer >= 0)
        return eng_errp("%s: only one dimension can be inferred (-1) in shape %s for %s", op,
                        eng_shape_str(ndim, shape), dt_desc(t));
      infer = d;
    } else if (shape[d] < 0) {
      return eng_errp("%s: invalid size %lld at dim %d of shape %s for %s", op, (long long)shape[d], d + 1,
                      eng_shape_str(ndim, shape), dt_desc(t));
    } else {
      if (shape[d] > 0 && prod > INT64_MAX / shape[d]) return eng_errp("%s: shape %s is too large", op, eng_shape_str(ndim, shape));
      prod *= shape[d];
    }
  }
  if (infer >= 0) {
    if (prod == 0)
      return eng_errp("%s: cannot reshape %s (%lld elements) into shape %s because the unspecified dimension "
                      "size -1 can be any value and is ambiguous", op, dt_desc(t), (long long)s->numel,
                      eng_shape_str(ndim, shape));
    if (s->numel % prod != 0)
      return eng_errp("%s: shape %s is invalid for input of size %lld (%s)", op, eng_shape_str(ndim, shape),
                      (long long)s->numel, dt_desc(t));
    sh[infer] = s->numel / prod;
  } else if (prod != s->numel) {
    return eng_errp("%s: shape %s is invalid for input of size %lld (%s)", op, eng_shape_str(ndim, shape),
                    (long long)s->numel, dt_desc(t));
  }
  return dispatch_reshape(t, ndim, sh, kind, op);
}

eng_tensor* eng_dt_squeeze(eng_tensor* t, int dim, int all) {
  const eng_dist_spec* s = t->dist;
  int d = all ? -1 : eng_norm_dim(dim, s->ndim, "squeeze");
  if (!all && d < 0) return NULL;
  int64_t sh[ENG_MAX_DIMS];
  int k = 0;
  for (int i = 0; i < s->ndim; i++)
    if (s->shape[i] != 1 || (!all && i != d)) sh[k++] = s->shape[i];
  return dispatch_reshape(t, k, sh, 0, "squeeze");
}

eng_tensor* eng_dt_unsqueeze(eng_tensor* t, int dim) {
  const eng_dist_spec* s = t->dist;
  if (s->ndim >= ENG_MAX_DIMS)
    return eng_errp("unsqueeze: %s already has %d dims, the maximum", dt_desc(t), ENG_MAX_DIMS);
  int d = eng_norm_dim(dim, s->ndim + 1, "unsqueeze");
  if (d < 0) return NULL;
  int64_t sh[ENG_MAX_DIMS];
  for (int i = 0, k = 0; i <= s->ndim; i++) sh[i] = i == d ? 1 : s->shape[k++];
  return dispatch_reshape(t, s->ndim + 1, sh, 0, "unsqueeze");
}

eng_tensor* eng_dt_flatten(eng_tensor* t, int start_dim, int end_dim) {
  const eng_dist_spec* s = t->dist;
  int a = eng_norm_dim(start_dim, s->ndim, "flatten"), e = a < 0 ? -1 : eng_norm_dim(end_dim, s->ndim, "flatten");
  if (a < 0 || e < 0) return NULL;
  if (a > e)
    return eng_errp("flatten: start_dim %lld comes after end_dim %lld (%s)", ENG_U(start_dim), ENG_U(end_dim), dt_desc(t));
  int64_t one = 1;
  if (s->ndim == 0) return dispatch_reshape(t, 1, &one, 1, "flatten");
  if (a == e) return eng_tensor_retain(t);
  int64_t sh[ENG_MAX_DIMS], mm = 1;
  int k = 0;
  for (int i = 0; i < a; i++) sh[k++] = s->shape[i];
  for (int i = a; i <= e; i++) mm *= s->shape[i];
  sh[k++] = mm;
  for (int i = e + 1; i < s->ndim; i++) sh[k++] = s->shape[i];
  return dispatch_reshape(t, k, sh, 1, "flatten");
}

/* ------------------------------------------------------------------ transpose / permute */
/* ints[0..ndim) = permutation (output dim j is input dim ints[j]) */
static int permute_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  eng_placement p = s[0]->placements[m];
  eng_strategy st;
  memset(&st, 0, sizeof st);
  st.in[0] = p; st.out[0] = p;
  if (sh_is_S(&p))
    for (int j = 0; j < s[0]->ndim; j++) if (c->ints[j] == p.dim) st.out[0] = sh_S(j);
  int n = sh_push(out, cap, 0, &st);
  return sh_all_replicate(out, cap, n, 1, 1);
}

static int permute_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* ndims, int64_t (*shapes)[8]) {
  ndims[0] = s[0]->ndim;
  for (int j = 0; j < s[0]->ndim; j++) shapes[0][j] = s[0]->shape[c->ints[j]];
  return 0;
}

static eng_tensor* permute_fn(const eng_op_call* c) {
  int p[ENG_MAX_DIMS], nd = c->in[0]->ndim;
  for (int j = 0; j < nd; j++) p[j] = (int)c->ints[j];
  return eng_permute(c->in[0], nd, p);
}

static const eng_op_def eng_opdef_permute = {"permute", 1, permute_rule, permute_shape, permute_fn, NULL, 0, 1};

eng_tensor* eng_dt_transpose(eng_tensor* t, int d0, int d1) {
  int nd = t->dist->ndim;
  int a = eng_norm_dim(d0, nd, "transpose"), b = a < 0 ? -1 : eng_norm_dim(d1, nd, "transpose");
  if (a < 0 || b < 0) return NULL;
  eng_op_call c = {.name = "transpose", .n_in = 1, .in = {t}};
  for (int j = 0; j < nd; j++) c.ints[j] = j;
  if (nd > 0) { c.ints[a] = b; c.ints[b] = a; }
  return eng_dispatch(&eng_opdef_permute, &c);
}

eng_tensor* eng_dt_permute(eng_tensor* t, int ndim, const int* dims) {
  int nd = t->dist->ndim;
  if (ndim != nd) return eng_errp("permute: number of dims does not match: %d dims given for %s", ndim, dt_desc(t));
  if (ndim > 0 && !dims) return eng_errp("permute: dims is NULL");
  eng_op_call c = {.name = "permute", .n_in = 1, .in = {t}};
  int seen[ENG_MAX_DIMS] = {0};
  for (int j = 0; j < nd; j++) {
    int p = eng_norm_dim(dims[j], nd, "permute");
    if (p < 0) return NULL;
    if (seen[p]++) return eng_errp("permute: dim %lld is repeated in dims for %s", ENG_U(dims[j]), dt_desc(t));
    c.ints[j] = p;
  }
  return eng_dispatch(&eng_opdef_permute, &c);
}

/* ------------------------------------------------------------------ expand */
/* ints[0..ndim) = global target shape (resolved), scalars[0] = ndim */
static int expand_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  eng_placement p = s[0]->placements[m];
  int lead = (int)c->scalars[0] - s[0]->ndim;
  eng_strategy st;
  memset(&st, 0, sizeof st);
  st.in[0] = p; st.out[0] = p;
  if (sh_is_S(&p)) {
    if (s[0]->shape[p.dim] == c->ints[p.dim + lead]) st.out[0] = sh_S(p.dim + lead);
    else st.in[0] = st.out[0] = sh_R();
  }
  int n = sh_push(out, cap, 0, &st);
  return sh_all_replicate(out, cap, n, 1, 1);
}

static int expand_local(const eng_op_call* c, const eng_dist_spec* const* in_specs,
                        const eng_dist_spec* const* out_specs, eng_tensor** outs) {
  (void)in_specs;
  outs[0] = eng_expand(c->in[0], out_specs[0]->ndim, out_specs[0]->local_shape);
  return outs[0] ? 0 : -1;
}

static const eng_op_def eng_opdef_expand = {"expand", 1, expand_rule, shape_from_ints, NULL, expand_local, 1, 1};

eng_tensor* eng_dt_expand(eng_tensor* t, int ndim, const int64_t* shape) {
  const eng_dist_spec* s = t->dist;
  if (ndim < s->ndim)
    return eng_errp("expand: %d sizes given for %s: the number of sizes must be at least the number of dims (%d)",
                    ndim, dt_desc(t), s->ndim);
  if (ndim > ENG_MAX_DIMS) return eng_errp("expand: %d dims requested; at most %d are supported", ndim, ENG_MAX_DIMS);
  if (ndim > 0 && !shape) return eng_errp("expand: shape is NULL");
  eng_op_call c = {.name = "expand", .n_in = 1, .in = {t}};
  int lead = ndim - s->ndim;
  for (int d = 0; d < ndim; d++) {
    int64_t v = shape[d];
    if (d < lead) {
      if (v < 0)
        return eng_errp("expand: size %lld is not allowed in the new leading dim %d (target %s, tensor %s)",
                        (long long)v, d + 1, eng_shape_str(ndim, shape), dt_desc(t));
      c.ints[d] = v;
      continue;
    }
    int64_t cur = s->shape[d - lead];
    if (v == -1) v = cur;
    if (v < 0)
      return eng_errp("expand: invalid size %lld at dim %d (target %s, tensor %s)", (long long)v, d + 1,
                      eng_shape_str(ndim, shape), dt_desc(t));
    if (v != cur && cur != 1)
      return eng_errp("expand: the expanded size %lld must match the existing size %lld at non-singleton dim %d "
                      "(target %s, tensor %s)", (long long)v, (long long)cur, d + 1, eng_shape_str(ndim, shape), dt_desc(t));
    c.ints[d] = v;
  }
  c.scalars[0] = ndim;
  return eng_dispatch(&eng_opdef_expand, &c);
}

/* ------------------------------------------------------------------ narrow / select */
/* Placement of a slicing op: the sliced dim `dim` is replicated; with
 * removed, dims after it shift down. */
static int slice_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap,
                      int removed) {
  eng_placement p = s[0]->placements[m];
  int dim = (int)c->ints[0];
  eng_strategy st;
  memset(&st, 0, sizeof st);
  st.in[0] = p; st.out[0] = p;
  if (sh_is_S(&p)) {
    if (p.dim == dim) st.in[0] = st.out[0] = sh_R();
    else if (removed && p.dim > dim) st.out[0] = sh_S(p.dim - 1);
  }
  int n = sh_push(out, cap, 0, &st);
  return sh_all_replicate(out, cap, n, 1, 1);
}

/* narrow: ints = dim, start (normalized), length */
static int narrow_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  return slice_rule(c, s, m, out, cap, 0);
}
static int narrow_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* ndims, int64_t (*shapes)[8]) {
  sh_shape_same0(c, s, ndims, shapes);
  shapes[0][c->ints[0]] = c->ints[2];
  return 0;
}
static eng_tensor* narrow_fn(const eng_op_call* c) {
  return eng_narrow(c->in[0], (int)c->ints[0], c->ints[1], c->ints[2]);
}
static const eng_op_def eng_opdef_narrow = {"narrow", 1, narrow_rule, narrow_shape, narrow_fn, NULL, 0, 1};

eng_tensor* eng_dt_narrow(eng_tensor* t, int dim, int64_t start, int64_t length) {
  const eng_dist_spec* s = t->dist;
  if (s->ndim == 0) return eng_errp("narrow: cannot be applied to a 0-d tensor (%s)", dt_desc(t));
  int d = eng_norm_dim(dim, s->ndim, "narrow");
  if (d < 0) return NULL;
  int64_t size = s->shape[d];
  if (start < -size || start > size)
    return eng_errp("narrow: start %lld out of range for dim %d of size %lld in %s (positions are 1-based; expected "
                    "1..%lld or %lld..-1)", ENG_U(start), d + 1, (long long)size, dt_desc(t), (long long)size + 1,
                    (long long)-size);
  if (start < 0) start += size;
  if (length < 0) return eng_errp("narrow: length must be non-negative, got %lld for %s", (long long)length, dt_desc(t));
  if (start + length > size)
    return eng_errp("narrow: start %lld with length %lld runs past the end of dim %d (size %lld) in %s",
                    (long long)start + 1, (long long)length, d + 1, (long long)size, dt_desc(t));
  return eng_dispatch(&eng_opdef_narrow, &(eng_op_call){.name = "narrow", .n_in = 1, .in = {t}, .ints = {d, start, length}});
}

/* select: ints = dim, index (normalized) */
static int select_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  return slice_rule(c, s, m, out, cap, 1);
}
static int select_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* ndims, int64_t (*shapes)[8]) {
  int k = 0;
  for (int d = 0; d < s[0]->ndim; d++) if (d != c->ints[0]) shapes[0][k++] = s[0]->shape[d];
  ndims[0] = k;
  return 0;
}
static eng_tensor* select_fn(const eng_op_call* c) { return eng_select(c->in[0], (int)c->ints[0], c->ints[1]); }
static const eng_op_def eng_opdef_select = {"select", 1, select_rule, select_shape, select_fn, NULL, 0, 1};

eng_tensor* eng_dt_select(eng_tensor* t, int dim, int64_t index) {
  const eng_dist_spec* s = t->dist;
  if (s->ndim == 0) return eng_errp("select: cannot be applied to a 0-d tensor (%s)", dt_desc(t));
  int d = eng_norm_dim(dim, s->ndim, "select");
  if (d < 0) return NULL;
  int64_t size = s->shape[d];
  if (index < -size || index >= size)
    return eng_errp("select: index %lld out of range for dim %d of size %lld in %s (indices are 1-based)",
                    ENG_U(index), d + 1, (long long)size, dt_desc(t));
  if (index < 0) index += size;
  return eng_dispatch(&eng_opdef_select, &(eng_op_call){.name = "select", .n_in = 1, .in = {t}, .ints = {d, index}});
}

/* ------------------------------------------------------------------ index_select */
/* inputs t, index; ints[0] = dim */
static int index_select_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  eng_placement pt = s[0]->placements[m], pi = s[1]->placements[m];
  int dim = (int)c->ints[0], n = 0;
  eng_strategy st;
  memset(&st, 0, sizeof st);
  if ((sh_is_S(&pt) && pt.dim != dim) || sh_is_P(&pt)) {
    st.in[0] = pt; st.in[1] = sh_R(); st.out[0] = pt;
    n = sh_push(out, cap, n, &st);
  }
  if (s[1]->ndim == 1 && sh_is_S(&pi)) {
    st.in[0] = sh_R(); st.in[1] = sh_S(0); st.out[0] = sh_S(dim);
    n = sh_push(out, cap, n, &st);
  }
  return sh_all_replicate(out, cap, n, 2, 1);
}
static int index_select_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* ndims, int64_t (*shapes)[8]) {
  sh_shape_same0(c, s, ndims, shapes);
  shapes[0][c->ints[0]] = s[1]->ndim ? s[1]->shape[0] : 1;
  return 0;
}
static eng_tensor* index_select_fn(const eng_op_call* c) {
  return eng_index_select(c->in[0], (int)c->ints[0], c->in[1]);
}
static const eng_op_def eng_opdef_index_select = {"index_select", 1, index_select_rule, index_select_shape, index_select_fn,
                                           NULL, 0, 0, 1};

eng_tensor* eng_dt_index_select(eng_tensor* t, int dim, eng_tensor* index) {
  int tnd = t->dist ? t->dist->ndim : t->ndim, ind = index->dist ? index->dist->ndim : index->ndim;
  if (tnd == 0) return eng_errp("index_select: cannot index a 0-d tensor (%s)", dt_desc(t));
  if (ind > 1)
    return eng_errp("index_select: index must be a 1-D tensor (a vector), got %s for %s", dt_desc(index), dt_desc(t));
  if (index->dtype != ENG_I32 && index->dtype != ENG_I64)
    return eng_errp("index_select: index must be i32 or i64, got %s for %s", dt_desc(index), dt_desc(t));
  int d = eng_norm_dim(dim, tnd, "index_select");
  if (d < 0) return NULL;
  return eng_dispatch(&eng_opdef_index_select,
                      &(eng_op_call){.name = "index_select", .n_in = 2, .in = {t, index}, .ints = {d}});
}

/* ------------------------------------------------------------------ cat / stack */
static void gshape(const eng_tensor* t, int* nd, const int64_t** sh) {
  if (t->dist) { *nd = t->dist->ndim; *sh = t->dist->shape; }
  else { *nd = t->ndim; *sh = t->shape; }
}
static int spec_legacy_empty(const eng_dist_spec* s) { return s->ndim == 1 && s->shape[0] == 0; }

/* ints[0] = dim (of the output), ints[1] = stack */
static int join_rule(const eng_op_call* c, const eng_dist_spec* const* s, int m, eng_strategy* out, int cap) {
  int dim = (int)c->ints[0], stack = (int)c->ints[1], n = 0;
  int ond = 0;
  for (int i = 0; i < c->n_in; i++)
    if (stack || !spec_legacy_empty(s[i])) { ond = s[i]->ndim + stack; break; }
  for (int i = 0; i < c->n_in; i++) {
    eng_placement p = s[i]->placements[m];
    int legacy = !stack && s[i]->ndim + stack != ond;
    if (legacy) continue;
    eng_strategy st;
    memset(&st, 0, sizeof st);
    if (sh_is_S(&p)) {
      int od = stack && p.dim >= dim ? p.dim + 1 : p.dim;
      if (od == dim) continue;
      for (int k = 0; k < c->n_in; k++)
        st.in[k] = (!stack && s[k]->ndim != ond) ? sh_R() : p;
      st.out[0] = sh_S(od);
    } else if (sh_is_P(&p)) {
      for (int k = 0; k < c->n_in; k++) st.in[k] = p;
      st.out[0] = p;
    } else continue;
    int dup = 0;
    for (int k = 0; k < n; k++) dup |= eng_placement_equal(&out[k].out[0], &st.out[0]);
    if (!dup) n = sh_push(out, cap, n, &st);
  }
  return sh_all_replicate(out, cap, n, c->n_in, 1);
}

static int join_shape(const eng_op_call* c, const eng_dist_spec* const* s, int* ndims, int64_t (*shapes)[8]) {
  int dim = (int)c->ints[0], stack = (int)c->ints[1];
  const eng_dist_spec* ref = NULL;
  for (int i = 0; i < c->n_in && !ref; i++) if (stack || !spec_legacy_empty(s[i])) ref = s[i];
  if (!ref) ref = s[0];
  int ond = ref->ndim + stack;
  for (int k = 0, j = 0; k < ond; k++) shapes[0][k] = (stack && k == dim) ? c->n_in : ref->shape[j++];
  if (!stack) {
    shapes[0][dim] = 0;
    for (int i = 0; i < c->n_in; i++) if (s[i]->ndim == ond) shapes[0][dim] += s[i]->shape[dim];
  }
  ndims[0] = ond;
  return 0;
}

static eng_tensor* join_fn(const eng_op_call* c) {
  eng_tensor* ts[ENG_OP_MAX_IN];
  for (int i = 0; i < c->n_in; i++) ts[i] = c->in[i];
  return c->ints[1] ? eng_stack(c->n_in, ts, (int)c->ints[0]) : eng_cat(c->n_in, ts, (int)c->ints[0]);
}

static const eng_op_def eng_opdef_join = {"cat", 1, join_rule, join_shape, join_fn, NULL, 0};

eng_tensor* eng_dt_join(int n, eng_tensor** ts, int dim, int stack) {
  const char* op = stack ? "stack" : "cat";
  const int64_t *rsh = NULL, *sh;
  int rnd = 0, ri = -1, nd;
  for (int i = 0; i < n; i++) {
    if (!ts[i]) return eng_errp("%s: tensor %d of the list is nil/NULL", op, i + 1);
    gshape(ts[i], &nd, &sh);
    if (!stack && nd == 0)
      return eng_errp("cat: zero-dimensional tensor %s (at position %d) cannot be concatenated", dt_desc(ts[i]), i + 1);
    if (ts[i]->device != ts[0]->device)
      return eng_errp("%s: tensors on different devices: %s at position 1 and %s at position %d", op,
                      dt_desc(ts[0]), dt_desc(ts[i]), i + 1);
    if (ri < 0 && (stack || !(nd == 1 && sh[0] == 0))) { ri = i; rnd = nd; rsh = sh; }
  }
  if (ri < 0) { ri = 0; gshape(ts[0], &rnd, &rsh); }
  int ond = rnd + stack;
  if (ond > ENG_MAX_DIMS) return eng_errp("stack: the result would have %d dims; at most %d are supported", ond, ENG_MAX_DIMS);
  int d = eng_norm_dim(dim, ond, op);
  if (d < 0) return NULL;
  for (int i = 0; i < n; i++) {
    gshape(ts[i], &nd, &sh);
    if (stack) {
      int same = nd == rnd;
      for (int k = 0; same && k < nd; k++) same = sh[k] == rsh[k];
      if (!same)
        return eng_errp("stack: expects each tensor to be equal size, but got %s at entry %d and %s at entry %d",
                        dt_desc(ts[ri]), ri + 1, dt_desc(ts[i]), i + 1);
      continue;
    }
    if (nd == 1 && sh[0] == 0 && i != ri) continue;
    if (nd != rnd)
      return eng_errp("cat: tensors must have the same number of dims: got %s at position %d and %s at position %d",
                      dt_desc(ts[ri]), ri + 1, dt_desc(ts[i]), i + 1);
    for (int k = 0; k < rnd; k++)
      if (k != d && sh[k] != rsh[k])
        return eng_errp("cat: sizes of tensors must match except in dim %d: expected size %lld but got size %lld "
                        "at dim %d for tensor %d in the list (%s vs %s)", d + 1, (long long)rsh[k], (long long)sh[k], k + 1, i + 1,
                        dt_desc(ts[i]), dt_desc(ts[ri]));
  }
  if (n > ENG_OP_MAX_IN) {
    /* more inputs than one dispatch takes: stack = cat of unsqueezed
     * tensors; cat = cat of the cats of groups of ENG_OP_MAX_IN */
    int ng = (n + ENG_OP_MAX_IN - 1) / ENG_OP_MAX_IN;
    eng_tensor** parts = calloc((size_t)(stack ? n : ng), sizeof *parts);
    if (!parts) return eng_errp("%s: out of memory", op);
    eng_tensor* r = NULL;
    int np = 0, ok = 1;
    if (stack) {
      for (int i = 0; i < n && ok; i++) ok = (parts[np++] = eng_unsqueeze(ts[i], d)) != NULL;
    } else {
      for (int gi = 0; gi < n && ok; gi += ENG_OP_MAX_IN) {
        int cnt = n - gi < ENG_OP_MAX_IN ? n - gi : ENG_OP_MAX_IN;
        ok = (parts[np++] = eng_cat(cnt, ts + gi, d)) != NULL;
      }
    }
    if (ok) r = eng_cat(np, parts, d);
    for (int i = 0; i < np; i++) eng_tensor_release(parts[i]);
    free(parts);
    return r;
  }
  eng_op_call c = {.name = op, .n_in = n, .ints = {d, stack}};
  for (int i = 0; i < n; i++) c.in[i] = ts[i];
  return eng_dispatch(&eng_opdef_join, &c);
}

/* ------------------------------------------------------------------ split / chunk */
int eng_dt_split(eng_tensor* t, int mode, int64_t arg, int n, const int64_t* sizes, int dim, int max_out,
                 eng_tensor** out) {
  static const char* names[] = {"split", "split_sizes", "chunk"};
  const char* op = names[mode];
  const eng_dist_spec* s = t->dist;
  if (s->ndim == 0) return eng_err("%s: cannot %s a 0-d tensor (%s)", op, mode == 2 ? "chunk" : "split", dt_desc(t));
  int d = eng_norm_dim(dim, s->ndim, op);
  if (d < 0) return -1;
  int64_t size = s->shape[d];
  int64_t cnt, step = 0;
  if (mode == 1) {
    if (n < 0 || (n > 0 && (!sizes || !out))) return eng_err("split_sizes: invalid sizes list (n = %d)", n);
    int64_t sum = 0;
    for (int k = 0; k < n; k++) {
      if (sizes[k] < 0) return eng_err("split_sizes: size %d is negative (%lld) for %s", k + 1, (long long)sizes[k], dt_desc(t));
      if (__builtin_add_overflow(sum, sizes[k], &sum))
        return eng_err("split_sizes: sizes overflow a 64-bit integer for %s", dt_desc(t));
    }
    if (sum != size)
      return eng_err("split_sizes: sizes must sum exactly to %lld (the size of dim %d of %s), but sum to %lld",
                     (long long)size, d + 1, dt_desc(t), (long long)sum);
    cnt = n;
  } else {
    if (!out || max_out < 1) return eng_err("%s: no room for outputs (max_out %d)", op, max_out);
    int min_pieces = 1;
    if (mode == 0) {
      if (arg < 0) return eng_err("split: split_size must be non-negative, got %lld for %s", (long long)arg, dt_desc(t));
      if (arg == 0 && size != 0)
        return eng_err("split: split_size can only be 0 if the dim's size is 0, but dim %d of %s has size %lld", d + 1,
                       dt_desc(t), (long long)size);
      step = arg;
    } else {
      if (arg <= 0) return eng_err("chunk: chunks must be greater than 0, got %lld for %s", (long long)arg, dt_desc(t));
      step = (size + arg - 1) / arg;
      if (size == 0) min_pieces = (int)arg;
    }
    cnt = step > 0 ? (size + step - 1) / step : 1;
    if (cnt < min_pieces) cnt = min_pieces;
    if (cnt > max_out)
      return eng_err("%s: %s along dim %d gives %lld pieces but there is room for only %d outputs", op, dt_desc(t), d + 1,
                     (long long)cnt, max_out);
  }
  /* replicate the split dim once (every piece then is a narrow without communication) */
  eng_placement pl[ENG_MAX_DIMS];
  int change = 0;
  for (int m = 0; m < s->mesh_ndim; m++) {
    pl[m] = s->placements[m];
    if ((sh_is_S(&pl[m]) && pl[m].dim == d) || pl[m].kind == ENG_PLACEMENT_STRIDED_SHARD) { pl[m] = sh_R(); change = 1; }
  }
  eng_tensor* src;
  if (change) {
    eng_dist_spec* to = eng_dist_spec_with_placements(s, pl);
    src = to ? eng_dtensor_redistribute_spec(t, to, 0) : NULL;
    eng_dist_spec_release(to);
    if (!src) { eng_err_prefix("%s", op); return -1; }
  } else {
    if (eng_dtensor_wait(t)) return -1;
    src = eng_tensor_retain(t);
  }
  int64_t off = 0;
  for (int64_t k = 0; k < cnt; k++) {
    int64_t len = mode == 1 ? sizes[k] : (size - k * step < step ? (size - k * step > 0 ? size - k * step : 0) : step);
    out[k] = eng_narrow(src, d, off, len);
    if (!out[k]) {
      for (int64_t j = 0; j < k; j++) { eng_tensor_release(out[j]); out[j] = NULL; }
      eng_tensor_release(src);
      return -1;
    }
    off += len;
  }
  eng_tensor_release(src);
  return (int)cnt;
}
