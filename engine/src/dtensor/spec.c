/* spec.c: placements, DTensor specs (mesh + placements + global shape
 * and stride), torch.chunk layout math and the greedy redistribute planner
 * (PyTorch's generate_greedy_transform_infos).  No communication here. */
#include "dtensor/dtensor_impl.h"
#include <stdio.h>
#include <string.h>

static int g_display_base;

int dt_base(void) { return g_display_base; }

int eng_dtensor_set_display_base(int base) {
  int prev = g_display_base;
  g_display_base = base ? 1 : 0;
  return prev;
}

/* ------------------------------------------------------------------ text */
const char* eng_placement_describe(const eng_placement* p, char* buf, int cap) {
  if (!buf || cap <= 0) return "";
  if (!p) { snprintf(buf, cap, "?"); return buf; }
  switch (p->kind) {
    case ENG_PLACEMENT_SHARD:
      snprintf(buf, cap, "Shard(%lld)", p->dim >= 0 ? (long long)p->dim + g_display_base : (long long)p->dim);
      break;
    case ENG_PLACEMENT_STRIDED_SHARD:
      snprintf(buf, cap, "_StridedShard(dim=%lld, sf=%d)", p->dim >= 0 ? (long long)p->dim + g_display_base : (long long)p->dim,
               p->split_factor);
      break;
    case ENG_PLACEMENT_REPLICATE: snprintf(buf, cap, "Replicate()"); break;
    case ENG_PLACEMENT_PARTIAL: {
      const char* op = eng_reduce_op_name(p->op);
      snprintf(buf, cap, "Partial(%s)", op ? op : "?");
      break;
    }
    default: snprintf(buf, cap, "Placement(kind %d)", p->kind);
  }
  return buf;
}

const char* dt_placements_str(int n, const eng_placement* pl, char* buf, int cap) {
  int k = snprintf(buf, cap, "[");
  for (int i = 0; i < n && k < cap; i++) {
    char one[48];
    k += snprintf(buf + k, cap - k, "%s%s", i ? ", " : "", eng_placement_describe(&pl[i], one, sizeof one));
  }
  if (k < cap) snprintf(buf + k, cap - k, "]");
  return buf;
}

const char* dt_mesh_str(const eng_mesh* m, char* buf, int cap) {
  if (!m) { snprintf(buf, cap, "mesh(NULL)"); return buf; }
  int nd = eng_mesh_ndim(m);
  int k = snprintf(buf, cap, "mesh(");
  for (int d = 0; d < nd && k < cap; d++) k += snprintf(buf + k, cap - k, "%s%d", d ? "x" : "", eng_mesh_size(m, d));
  if (eng_mesh_has_names(m))
    for (int d = 0; d < nd && k < cap; d++)
      k += snprintf(buf + k, cap - k, "%s%s", d ? "," : ": ", eng_mesh_dim_name(m, d));
  if (k < cap) snprintf(buf + k, cap - k, ")");
  return buf;
}

const char* dt_mesh_diff_note(const eng_mesh* a, const eng_mesh* b, char* buf, int cap) {
  char s1[160], s2[160], d1[240], d2[240];
  buf[0] = 0;
  if (!a || !b || strcmp(dt_mesh_str(a, s1, sizeof s1), dt_mesh_str(b, s2, sizeof s2))) return buf;
  snprintf(buf, cap, " (%s and %s: the same shape over other ranks or in another rank order, so shard i of one is "
           "not shard i of the other; move the data with full_tensor() and distribute_tensor() onto one mesh)",
           eng_mesh_describe(a, d1, sizeof d1), eng_mesh_describe(b, d2, sizeof d2));
  return buf;
}

const char* eng_dist_spec_describe(const eng_dist_spec* s, int dtype, char* buf, int cap) {
  if (!buf || cap <= 0) return "";
  if (!s) { snprintf(buf, cap, "(no spec)"); return buf; }
  char ms[160], ps[400];
  const char* dn = dtype >= 0 ? eng_dtype_name(dtype) : NULL;
  snprintf(buf, cap, "%s%s on %s %s", dn ? dn : "", eng_shape_str(s->ndim, s->shape), dt_mesh_str(s->mesh, ms, sizeof ms),
           dt_placements_str(s->mesh_ndim, s->placements, ps, sizeof ps));
  return buf;
}

/* ------------------------------------------------------------------ placements */
int eng_placement_equal(const eng_placement* a, const eng_placement* b) {
  if (a->kind != b->kind) return 0;
  if (a->kind == ENG_PLACEMENT_SHARD) return a->dim == b->dim;
  if (a->kind == ENG_PLACEMENT_PARTIAL) return a->op == b->op;
  /* unlike PyTorch 2.5, where _StridedShard(d, sf) == Shard(d) ignoring sf */
  if (a->kind == ENG_PLACEMENT_STRIDED_SHARD) return a->dim == b->dim && a->split_factor == b->split_factor;
  return 1;
}

int dt_is_shard_like(const eng_placement* p) {
  return p->kind == ENG_PLACEMENT_SHARD || p->kind == ENG_PLACEMENT_STRIDED_SHARD;
}

eng_placement dt_replicate(void) {
  eng_placement p;
  memset(&p, 0, sizeof p);
  p.kind = ENG_PLACEMENT_REPLICATE;
  return p;
}

/* Unused fields zeroed (placements compare and hash bytewise in specs and plans). */
static eng_placement canonical(eng_placement p) {
  switch (p.kind) {
    case ENG_PLACEMENT_SHARD: p.op = 0; p.split_factor = 0; break;
    case ENG_PLACEMENT_STRIDED_SHARD: p.op = 0; break;
    case ENG_PLACEMENT_PARTIAL: p.dim = 0; p.split_factor = 0; break;
    default: p.dim = 0; p.op = 0; p.split_factor = 0; break;
  }
  return p;
}

int dt_check_placements(const char* op, const eng_mesh* mesh, int n, const eng_placement* pl, int ndim,
                        eng_placement* out) {
  if (!mesh) return eng_err("%s: device mesh is NULL", op);
  int mnd = eng_mesh_ndim(mesh);
  if (!pl) return eng_err("%s: placements are NULL", op);
  if (n != mnd)
    return eng_err("%s: `placements` must have the same length as `device_mesh.ndim`! Found placements length: "
                   "%d, and device_mesh.ndim: %d.", op, n, mnd);
  for (int i = 0; i < n; i++) {
    eng_placement p = pl[i];
    switch (p.kind) {
      case ENG_PLACEMENT_REPLICATE: p.dim = 0; p.op = 0; p.split_factor = 0; break;
      case ENG_PLACEMENT_SHARD:
        if (p.dim < -ndim || p.dim >= ndim) {
          long long shown = p.dim >= 0 ? (long long)p.dim + g_display_base : p.dim;  /* dim may be INT_MAX */
          if (ndim == 0)
            return eng_err("%s: Shard(%lld) (placement %d) cannot shard a 0-d tensor", op, shown, i + g_display_base);
          return eng_err("%s: Shard(%lld) (placement %d) is out of range for a %d-d tensor (valid: %d..%d or -%d..-1)",
                         op, shown, i + g_display_base, ndim, g_display_base, ndim - 1 + g_display_base, ndim);
        }
        if (p.dim < 0) p.dim += ndim;
        p.op = 0;
        p.split_factor = 0;
        break;
      case ENG_PLACEMENT_STRIDED_SHARD:
        if (p.split_factor < 1)
          return eng_err("%s: _StridedShard(dim=%lld, sf=%d) (placement %d): split_factor must be >= 1", op,
                         p.dim >= 0 ? (long long)p.dim + g_display_base : (long long)p.dim, p.split_factor, i + g_display_base);
        if (p.dim < -ndim || p.dim >= ndim) {
          long long shown = p.dim >= 0 ? (long long)p.dim + g_display_base : p.dim;  /* dim may be INT_MAX */
          if (ndim == 0)
            return eng_err("%s: _StridedShard(dim=%lld, sf=%d) (placement %d) cannot shard a 0-d tensor", op, shown,
                           p.split_factor, i + g_display_base);
          return eng_err("%s: _StridedShard(dim=%lld, sf=%d) (placement %d) is out of range for a %d-d tensor (valid "
                         "dims: %d..%d or -%d..-1)", op, shown, p.split_factor, i + g_display_base, ndim,
                         g_display_base, ndim - 1 + g_display_base, ndim);
        }
        if (p.dim < 0) p.dim += ndim;
        p.op = 0;
        break;
      case ENG_PLACEMENT_PARTIAL:
        if (p.op < 0 || p.op >= ENG_NUM_REDUCE_OPS)
          return eng_err("%s: Partial placement %d has an invalid reduce op code %d", op, i + g_display_base, p.op);
        p.dim = 0;
        p.split_factor = 0;
        break;
      default:
        return eng_err("%s: placement %d has an invalid kind %d (0 Replicate, 1 Shard, 2 Partial, 3 _StridedShard)",
                       op, i + g_display_base, p.kind);
    }
    out[i] = p;
  }
  return 0;
}

/* ------------------------------------------------------------------ layout math */

static void chunk(int64_t n, int64_t k, int64_t idx, int64_t* size, int64_t* offset) {
  int64_t full = (n + k - 1) / k;
  int64_t off = idx * full;
  if (off > n) off = n;
  *size = n - off < full ? n - off : full;
  *offset = off;
}

/* Pieces past the end of the dim are empty (offsets grow with the index), so
 * the loops over a _StridedShard's pieces stop at the first empty piece:
 * O(min(sf, n)) work and memory, whatever the split factor.  A sub-piece
 * may be empty in a non-empty piece and not in a later, shorter one (4 and 3
 * entries over 3: sub-piece 2 holds 0 and 1), so only an empty piece ends
 * the loops. */
int dt_strided_piece(int64_t n, int k, int sf, int idx, int j, int64_t* size, int64_t* offset) {
  int64_t psz, poff, sz, off;
  chunk(n, sf, j, &psz, &poff);
  if (psz == 0) { *size = 0; *offset = poff; return 0; }
  chunk(psz, k, idx, &sz, &off);
  *size = sz;
  *offset = poff + off;
  return 1;
}

int64_t dt_strided_size(int64_t n, int k, int sf, int idx) {
  int64_t total = 0, sz, off;
  for (int j = 0; j < sf; j++) {
    if (!dt_strided_piece(n, k, sf, idx, j, &sz, &off)) break;
    total += sz;
  }
  return total;
}

/* Local position p of a shard held as runs (global start, length) -> global
 * index; p == the local length maps to the end of the last run, an empty
 * shard to its anchor. */
static int64_t runs_map(const int64_t* st, const int64_t* len, int n, int64_t anchor, int64_t p) {
  int64_t acc = 0;
  for (int r = 0; r < n; r++) {
    if (p < acc + len[r]) return st[r] + (p - acc);
    acc += len[r];
  }
  return n > 0 ? st[n - 1] + len[n - 1] : anchor;
}

int dt_dim_runs(const int64_t* gshape, int ndim, int mesh_ndim, const int64_t* mesh_shape, const int* coord,
                const eng_placement* pl, int d, int64_t** st_out, int64_t** len_out, int* nr, int64_t* total,
                int64_t* anchor) {
  int64_t n = gshape[d];
  int cap = 1, cnt = 0;
  int64_t* st = malloc(sizeof *st);
  int64_t* len = malloc(sizeof *len);
  if (!st || !len) { free(st); free(len); return eng_err("local_shard_runs: out of memory"); }
  if (n > 0) { st[0] = 0; len[0] = n; cnt = 1; }
  int64_t L = n, anc = 0;
  for (int i = 0; i < mesh_ndim; i++) {
    if (!dt_is_shard_like(&pl[i])) continue;
    int pd = pl[i].dim < 0 ? pl[i].dim + ndim : pl[i].dim;
    if (pd != d) continue;
    int64_t k = mesh_shape[i];
    int sf = pl[i].kind == ENG_PLACEMENT_STRIDED_SHARD ? pl[i].split_factor : 1;
    if (sf < 1) { free(st); free(len); return eng_err("local_shard_runs: split_factor %d (need >= 1)", sf); }
    int64_t npieces = sf < L ? sf : L; /* non-empty pieces */
    if (npieces > INT32_MAX - 2 - cnt) { free(st); free(len); return eng_err("local_shard_runs: too many runs"); }
    int ncap = cnt + (int)npieces + 1;
    int64_t* nst = malloc(sizeof *nst * (size_t)ncap);
    int64_t* nlen = malloc(sizeof *nlen * (size_t)ncap);
    if (!nst || !nlen) { free(st); free(len); free(nst); free(nlen); return eng_err("local_shard_runs: out of memory"); }
    int nc = 0;
    int64_t nL = 0;
    for (int j = 0; j < sf; j++) {
      int64_t sz, off;
      int more = dt_strided_piece(L, (int)k, sf, coord[i], j, &sz, &off);
      if (j == 0) anc = runs_map(st, len, cnt, anc, off);
      if (!more) break; /* and every later piece */
      nL += sz;
      /* local range [off, off+sz) through the current runs */
      int64_t acc = 0;
      for (int r = 0; r < cnt && sz > 0; r++) {
        int64_t lo = off > acc ? off : acc, hi = off + sz < acc + len[r] ? off + sz : acc + len[r];
        if (lo < hi) {
          int64_t g = st[r] + (lo - acc);
          if (nc > 0 && nst[nc - 1] + nlen[nc - 1] == g) nlen[nc - 1] += hi - lo;
          else { nst[nc] = g; nlen[nc] = hi - lo; nc++; }
        }
        acc += len[r];
      }
    }
    free(st); free(len);
    st = nst; len = nlen; cnt = nc; cap = ncap; L = nL;
  }
  (void)cap;
  if (cnt > 0) anc = st[0];
  *st_out = st; *len_out = len; *nr = cnt; *total = L; *anchor = anc;
  return 0;
}

static int check_layout_args(const char* op, int ndim, int mesh_ndim, const int64_t* mesh_shape, const int* coord,
                             const eng_placement* pl) {
  if (ndim < 0 || ndim > ENG_MAX_DIMS) return eng_err("%s: invalid ndim %d", op, ndim);
  if (mesh_ndim < 1 || mesh_ndim > ENG_MAX_DIMS) return eng_err("%s: invalid mesh ndim %d", op, mesh_ndim);
  for (int i = 0; i < mesh_ndim; i++) {
    if (!dt_is_shard_like(&pl[i])) continue;
    int d = pl[i].dim < 0 ? pl[i].dim + ndim : pl[i].dim;
    if (d < 0 || d >= ndim) return eng_err("%s: Shard dim %d out of range for %d dims", op, pl[i].dim, ndim);
    if (pl[i].kind == ENG_PLACEMENT_STRIDED_SHARD && pl[i].split_factor < 1)
      return eng_err("%s: _StridedShard split_factor %d on mesh dim %d (need >= 1)", op, pl[i].split_factor,
                     i + g_display_base);
    if (mesh_shape[i] < 1 || coord[i] < 0 || coord[i] >= mesh_shape[i])
      return eng_err("%s: coordinate %d out of range for mesh dim %d of size %lld", op, coord[i], i + g_display_base,
                     (long long)mesh_shape[i]);
  }
  return 0;
}

int eng_local_shard_runs(int ndim, const int64_t* gshape, int mesh_ndim, const int64_t* mesh_shape, const int* coord,
                         const eng_placement* pl, int dim, int64_t* starts, int64_t* lengths, int cap) {
  const char* op = "local_shard_runs";
  if (!gshape || !mesh_shape || !coord || !pl) return eng_err("%s: NULL argument", op);
  if (check_layout_args(op, ndim, mesh_ndim, mesh_shape, coord, pl)) return -1;
  if (dim < 0 || dim >= ndim) return eng_err("%s: dim %lld out of range for %d dims", op, (long long)dim + g_display_base, ndim);
  int64_t *st, *len, total, anc;
  int n;
  if (dt_dim_runs(gshape, ndim, mesh_ndim, mesh_shape, coord, pl, dim, &st, &len, &n, &total, &anc)) return -1;
  for (int r = 0; r < n && r < cap; r++) {
    if (starts) starts[r] = st[r];
    if (lengths) lengths[r] = len[r];
  }
  free(st); free(len);
  return n;
}

int eng_local_shape_and_offset(int ndim, const int64_t* gshape, int mesh_ndim, const int64_t* mesh_shape,
                               const int* coord, const eng_placement* pl, int64_t* lshape, int64_t* offset) {
  if (ndim < 0 || ndim > ENG_MAX_DIMS) return eng_err("local_shape_and_offset: invalid ndim %d", ndim);
  if (mesh_ndim < 1 || mesh_ndim > ENG_MAX_DIMS) return eng_err("local_shape_and_offset: invalid mesh ndim %d", mesh_ndim);
  for (int d = 0; d < ndim; d++) { lshape[d] = gshape[d]; offset[d] = 0; }
  unsigned strided_dims = 0;
  for (int i = 0; i < mesh_ndim; i++) {
    if (pl[i].kind != ENG_PLACEMENT_STRIDED_SHARD) continue;
    int d = pl[i].dim < 0 ? pl[i].dim + ndim : pl[i].dim;
    if (d >= 0 && d < ndim) strided_dims |= 1u << d;
  }
  if (strided_dims && check_layout_args("local_shape_and_offset", ndim, mesh_ndim, mesh_shape, coord, pl)) return -1;
  for (int d = 0; d < ndim; d++) {
    if (!(strided_dims >> d & 1u)) continue;
    /* a _StridedShard on this dim: size and first run from the runs */
    int64_t *st, *len, total, anc;
    int n;
    if (dt_dim_runs(gshape, ndim, mesh_ndim, mesh_shape, coord, pl, d, &st, &len, &n, &total, &anc)) return -1;
    free(st); free(len);
    lshape[d] = total;
    offset[d] = anc;
  }
  for (int i = 0; i < mesh_ndim; i++) {
    if (pl[i].kind != ENG_PLACEMENT_SHARD) continue;
    int d = pl[i].dim < 0 ? pl[i].dim + ndim : pl[i].dim;
    if (d < 0 || d >= ndim) return eng_err("local_shape_and_offset: Shard dim %d out of range for %d dims", pl[i].dim, ndim);
    if (strided_dims >> d & 1u) continue; /* done above */
    if (mesh_shape[i] < 1 || coord[i] < 0 || coord[i] >= mesh_shape[i])
      return eng_err("local_shape_and_offset: coordinate %d out of range for mesh dim %d of size %lld", coord[i], i + g_display_base,
                     (long long)mesh_shape[i]);
    int64_t sz, off;
    chunk(lshape[d], mesh_shape[i], coord[i], &sz, &off);
    lshape[d] = sz;
    offset[d] += off;
  }
  return 0;
}

/* ------------------------------------------------------------------ specs */
static uint64_t fnv(uint64_t h, const void* p, size_t n) {
  const unsigned char* b = p;
  for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 1099511628211ull; }
  return h;
}

eng_dist_spec* dt_spec_make(eng_mesh* mesh, const eng_placement* pl, int ndim, const int64_t* shape,
                            const int64_t* stride) {
  eng_dist_spec* s = calloc(1, sizeof *s);
  if (!s) return eng_errp("DTensor spec: out of memory");
  s->refcount = 1;
  s->ndim = ndim;
  s->mesh_ndim = eng_mesh_ndim(mesh);
  s->mesh = eng_mesh_retain(mesh);
  for (int i = 0; i < s->mesh_ndim; i++) {
    s->placements[i] = canonical(pl[i]);
    s->mesh_shape[i] = eng_mesh_size(mesh, i);
    if (pl[i].kind == ENG_PLACEMENT_PARTIAL) s->has_partial = 1;
    if (dt_is_shard_like(&pl[i])) s->has_shard = 1;
    if (pl[i].kind == ENG_PLACEMENT_STRIDED_SHARD) s->has_strided = 1;
  }
  for (int d = 0; d < ndim; d++) s->shape[d] = shape[d];
  if (stride) for (int d = 0; d < ndim; d++) s->stride[d] = stride[d];
  else eng_contiguous_strides(ndim, shape, s->stride);
  s->numel = eng_shape_numel(ndim, shape);
  int coord[ENG_MAX_DIMS];
  s->member = eng_mesh_get_coordinate(mesh, coord) ? 1 : 0;
  if (s->member) {
    for (int i = 0; i < s->mesh_ndim; i++) s->coord[i] = coord[i];
    if (eng_local_shape_and_offset(ndim, s->shape, s->mesh_ndim, s->mesh_shape, coord, s->placements, s->local_shape,
                                   s->offset)) {
      eng_mesh_release(s->mesh);
      free(s);
      return NULL;
    }
  } else {
    for (int d = 0; d < ndim; d++) { s->local_shape[d] = 0; s->offset[d] = 0; }
  }
  uint64_t h = 1469598103934665603ull;
  h = fnv(h, &s->ndim, sizeof s->ndim);
  h = fnv(h, &s->mesh_ndim, sizeof s->mesh_ndim);
  h = fnv(h, s->mesh_shape, sizeof(int64_t) * (size_t)s->mesh_ndim);
  h = fnv(h, s->placements, sizeof(eng_placement) * (size_t)s->mesh_ndim);
  h = fnv(h, s->shape, sizeof(int64_t) * (size_t)ndim);
  h = fnv(h, s->stride, sizeof(int64_t) * (size_t)ndim);
  s->hash = h;
  return s;
}

eng_dist_spec* eng_dist_spec_new(eng_mesh* mesh, int n, const eng_placement* pl, int ndim, const int64_t* shape,
                                 const int64_t* stride) {
  const char* op = "DTensor spec";
  if (ndim < 0 || ndim > ENG_MAX_DIMS) return eng_errp("%s: %d dims (tensors have 0 to %d dims)", op, ndim, ENG_MAX_DIMS);
  if (ndim > 0 && !shape) return eng_errp("%s: shape is NULL", op);
  for (int d = 0; d < ndim; d++)
    if (shape[d] < 0) return eng_errp("%s: negative size in shape %s", op, eng_shape_str(ndim, shape));
  eng_placement norm[ENG_MAX_DIMS];
  if (dt_check_placements(op, mesh, n, pl, ndim, norm)) return NULL;
  return dt_spec_make(mesh, norm, ndim, shape, stride);
}

eng_dist_spec* eng_dist_spec_with_placements(const eng_dist_spec* s, const eng_placement* pl) {
  if (!s) return eng_errp("DTensor spec: spec is NULL");
  eng_placement norm[ENG_MAX_DIMS];
  if (dt_check_placements("DTensor spec", s->mesh, s->mesh_ndim, pl, s->ndim, norm)) return NULL;
  return dt_spec_make(s->mesh, norm, s->ndim, s->shape, s->stride);
}

eng_dist_spec* eng_dist_spec_retain(eng_dist_spec* s) {
  if (s) __atomic_add_fetch(&s->refcount, 1, __ATOMIC_RELAXED);
  return s;
}

/* Strong definition of the hook core/tensor.c calls when a DTensor dies. */
void eng_dist_spec_release(eng_dist_spec* s) {
  if (!s) return;
  if (__atomic_sub_fetch(&s->refcount, 1, __ATOMIC_ACQ_REL) != 0) return;
  eng_mesh_release(s->mesh);
  free(s);
}

uint64_t eng_dist_spec_hash(const eng_dist_spec* s) { return s ? s->hash : 0; }

int eng_dist_spec_equal(const eng_dist_spec* a, const eng_dist_spec* b) {
  if (a == b) return 1;
  if (!a || !b || a->hash != b->hash || a->ndim != b->ndim || a->mesh_ndim != b->mesh_ndim) return 0;
  for (int i = 0; i < a->mesh_ndim; i++) if (!eng_placement_equal(&a->placements[i], &b->placements[i])) return 0;
  for (int d = 0; d < a->ndim; d++) if (a->shape[d] != b->shape[d] || a->stride[d] != b->stride[d]) return 0;
  return a->mesh == b->mesh || eng_mesh_equal(a->mesh, b->mesh);
}

eng_dist_spec* dt_spec_adjoint(eng_dist_spec* s) {
  if (!s->has_partial) return eng_dist_spec_retain(s);
  eng_placement pl[ENG_MAX_DIMS];
  for (int i = 0; i < s->mesh_ndim; i++) {
    pl[i] = s->placements[i];
    if (pl[i].kind == ENG_PLACEMENT_PARTIAL) pl[i] = dt_replicate();
  }
  return dt_spec_make(s->mesh, pl, s->ndim, s->shape, s->stride);
}

/* ------------------------------------------------------------------ planner */
static int emit1(eng_transform_info* out, int cap, int* n, int mesh_dim, const eng_placement* src,
                 const eng_placement* dst, int ndim, const int64_t* ls) {
  if (*n >= cap) return eng_err("redistribute plan: more than %d steps", cap);
  eng_transform_info* t = &out[*n];
  memset(t, 0, sizeof *t);
  t->mesh_dim = mesh_dim;
  t->src = *src;
  t->dst = *dst;
  for (int d = 0; d < ndim; d++) t->logical_shape[d] = ls[d];
  (*n)++;
  return 0;
}

/* A change involving a _StridedShard other than to or from Replicate (or to
 * Partial, an error step): it goes through Replicate on that mesh dim. */
static int via_replicate(const eng_placement* a, const eng_placement* b) {
  if (eng_placement_equal(a, b)) return 0;
  if (a->kind != ENG_PLACEMENT_STRIDED_SHARD && b->kind != ENG_PLACEMENT_STRIDED_SHARD) return 0;
  if (a->kind == ENG_PLACEMENT_REPLICATE || b->kind == ENG_PLACEMENT_REPLICATE) return 0;
  if (a->kind == ENG_PLACEMENT_STRIDED_SHARD && b->kind == ENG_PLACEMENT_PARTIAL) return 0;
  return 1;
}

static int emit(eng_transform_info* out, int cap, int* n, int mesh_dim, const eng_placement* src,
                const eng_placement* dst, int ndim, const int64_t* ls) {
  if (via_replicate(src, dst)) {
    eng_placement r = dt_replicate();
    return emit1(out, cap, n, mesh_dim, src, &r, ndim, ls) || emit1(out, cap, n, mesh_dim, &r, dst, ndim, ls);
  }
  return emit1(out, cap, n, mesh_dim, src, dst, ndim, ls);
}

int eng_redistribute_plan(int mesh_ndim, const int64_t* mesh_shape, const int* coord, const eng_placement* src,
                          const eng_placement* dst, int ndim, const int64_t* gshape, eng_transform_info* out,
                          int cap) {
  if (mesh_ndim < 1 || mesh_ndim > ENG_MAX_DIMS) return eng_err("redistribute plan: invalid mesh ndim %d", mesh_ndim);
  if (ndim < 0 || ndim > ENG_MAX_DIMS) return eng_err("redistribute plan: invalid tensor ndim %d", ndim);
  eng_placement s[ENG_MAX_DIMS], t[ENG_MAX_DIMS], cur[ENG_MAX_DIMS];
  for (int i = 0; i < mesh_ndim; i++) {
    s[i] = canonical(src[i]); t[i] = canonical(dst[i]);
    if (dt_is_shard_like(&s[i]) && s[i].dim < 0) s[i].dim += ndim;
    if (dt_is_shard_like(&t[i]) && t[i].dim < 0) t[i].dim += ndim;
    if ((dt_is_shard_like(&s[i]) && (s[i].dim < 0 || s[i].dim >= ndim)) ||
        (dt_is_shard_like(&t[i]) && (t[i].dim < 0 || t[i].dim >= ndim)))
      return eng_err("redistribute plan: Shard dim out of range for a %d-d tensor on mesh dim %d", ndim, i + g_display_base);
    if ((s[i].kind == ENG_PLACEMENT_STRIDED_SHARD && s[i].split_factor < 1) ||
        (t[i].kind == ENG_PLACEMENT_STRIDED_SHARD && t[i].split_factor < 1))
      return eng_err("redistribute plan: _StridedShard split_factor < 1 on mesh dim %d", i + g_display_base);
    if (coord[i] < 0 || coord[i] >= mesh_shape[i])
      return eng_err("redistribute plan: coordinate %d out of range for mesh dim %d of size %lld", coord[i], i + g_display_base,
                     (long long)mesh_shape[i]);
  }
  int n = 0;
  /* logical shapes per mesh dim, from the source layout */
  int64_t ls[ENG_MAX_DIMS + 1][ENG_MAX_DIMS];
  for (int d = 0; d < ndim; d++) ls[0][d] = gshape[d];
  if (mesh_ndim == 1) {
    if (emit(out, cap, &n, 0, &s[0], &t[0], ndim, ls[0])) return -1;
    return n;
  }
  int64_t num_shards = 1;
  for (int i = 0; i < mesh_ndim; i++) {
    for (int d = 0; d < ndim; d++) ls[i + 1][d] = ls[i][d];
    if (dt_is_shard_like(&s[i])) {
      num_shards *= mesh_shape[i];
      if (i < mesh_ndim - 1) {
        int64_t sz, off;
        if (s[i].kind == ENG_PLACEMENT_STRIDED_SHARD)
          sz = dt_strided_size(ls[i][s[i].dim], (int)mesh_shape[i], s[i].split_factor, coord[i]);
        else chunk(ls[i][s[i].dim], mesh_shape[i], coord[i], &sz, &off);
        ls[i + 1][s[i].dim] = sz;
      }
    }
    cur[i] = s[i];
  }
  if (num_shards > 1) {
    /* inner -> outer: gathers first; a target Shard whose tensor dim is sharded
     * differently by the outer mesh dims (now vs in the target) passes through
     * Replicate.  A _StridedShard counts as sharding its dim, and the outer
     * placements on that dim must then be identical (split factors too).
     * A change through Replicate (involving a _StridedShard) only gathers
     * here; the re-sharding waits for the outer -> inner pass. */
    for (int i = mesh_ndim - 1; i >= 0; i--) {
      eng_placement tg = t[i];
      if (dt_is_shard_like(&tg)) {
        int same = 1;
        for (int j = 0; j < i; j++) {
          int a = dt_is_shard_like(&cur[j]) && cur[j].dim == tg.dim;
          int b = dt_is_shard_like(&t[j]) && t[j].dim == tg.dim;
          if (a != b || (a && !eng_placement_equal(&cur[j], &t[j]))) { same = 0; break; }
        }
        if (!same) tg = dt_replicate();
      }
      if (via_replicate(&cur[i], &tg)) tg = dt_replicate();
      if (!eng_placement_equal(&cur[i], &tg)) {
        if (emit(out, cap, &n, i, &cur[i], &tg, ndim, ls[i])) return -1;
        cur[i] = tg;
      }
    }
  }
  /* outer -> inner: the remaining (re-)sharding */
  for (int i = 0; i < mesh_ndim; i++) {
    if (!eng_placement_equal(&cur[i], &t[i])) {
      if (emit(out, cap, &n, i, &cur[i], &t[i], ndim, ls[i])) return -1;
      cur[i] = t[i];
    }
  }
  return n;
}
