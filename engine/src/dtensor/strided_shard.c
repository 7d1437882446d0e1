/* strided_shard.c: data movement for the _StridedShard placement (PyTorch's
 * `_StridedShard._split_tensor`): on a mesh dim of size k with split factor
 * sf, the dim (n entries at that point of the left-to-right application of
 * the placements) is cut into sf torch.chunk pieces, each piece into k
 * torch.chunk sub-pieces, and coordinate i holds sub-piece i of every piece
 * concatenated (the right-to-left nested sharding of FSDP over TP: the TP
 * split first, then each TP shard over FSDP; equal to torch.chunk into k*sf
 * pieces, i, i+k, ..., when k*sf divides n).  Layout math (sizes, runs of the global dim) is in
 * dtensor/spec.c; the redistribute transitions in dtensor/redistribute.c call the
 * gather and the selection here, distribute_tensor the scatter, the random
 * factories and fills dt_random_local.
 *
 * The collectives of eng/comm.h work on dim 0 of contiguous buffers: dim d
 * is moved to the front of a contiguous buffer ("front order"), every
 * coordinate's local padded to coordinate 0's size (the largest: sub-piece 0
 * of every piece is its largest). */
#include "dtensor/dtensor_impl.h"
#include "eng/rng.h"

static int copy_view(eng_tensor* dst, const eng_tensor* src) {
  if (!dst || !src) return -1;
  return dst->numel > 0 ? eng_copy_raw(dst, src, src->stride) : 0;
}

/* Shape of x in front order (dim d first) with `rows` entries on it. */
static void front_shape(const eng_tensor* x, int d, int64_t rows, int64_t* fs) {
  int q = 0;
  fs[q++] = rows;
  for (int j = 0; j < x->ndim; j++) if (j != d) fs[q++] = x->shape[j];
}

/* The rows [row, row+len) of a contiguous front-order buffer B, seen in the
 * original dim order of a tensor with ndim dims and other sizes from like. */
static eng_tensor* front_rows(const eng_tensor* B, const eng_tensor* like, int d, int64_t row, int64_t len) {
  int nd = like->ndim;
  int64_t shape[ENG_MAX_DIMS], st[ENG_MAX_DIMS];
  int q = 1;
  for (int j = 0; j < nd; j++) {
    shape[j] = j == d ? len : like->shape[j];
    st[j] = j == d ? B->stride[0] : B->stride[q++];
  }
  return eng_view_of(B, nd, shape, st, B->offset + row * B->stride[0]);
}

static void zero_rows(eng_tensor* B, int64_t row, int64_t len) {
  if (len > 0) eng_zero_elems(B, row * B->stride[0], len * B->stride[0]);
}

/* Between the full tensor (dim d of length L) and a front-order buffer in
 * which coordinate r's sub-pieces follow each other from row r*M:
 * to_packed copies full -> packed (the scatter's send buffer), else
 * packed -> full (the gathered buffer).  0 or -1. */
static int move_pieces(const eng_tensor* packed, const eng_tensor* full, const eng_tensor* like, int d, int64_t L, int k, int sf,
                       int64_t M, int to_packed) {
  int rc = 0;
  for (int r = 0; r < k && !rc; r++) {
    int64_t at = (int64_t)r * M;
    for (int j = 0; j < sf && !rc; j++) {
      int64_t sz, off;
      if (!dt_strided_piece(L, k, sf, r, j, &sz, &off)) break; /* later pieces are empty too */
      if (sz == 0) continue;
      eng_tensor* p = front_rows(packed, like, d, at, sz);
      eng_tensor* f = dt_narrow_view(full, d, off, sz);
      rc = to_packed ? copy_view(p, f) : copy_view(f, p);
      eng_tensor_release(p);
      eng_tensor_release(f);
      at += sz;
    }
  }
  return rc;
}

eng_tensor* dt_strided_select(const eng_tensor* x, int d, int k, int sf, int coord) {
  int64_t n = x->shape[d];
  int64_t m = dt_strided_size(n, k, sf, coord);
  int64_t shape[ENG_MAX_DIMS];
  for (int j = 0; j < x->ndim; j++) shape[j] = x->shape[j];
  shape[d] = m;
  eng_tensor* out = eng_new(x->ndim, shape, x->dtype, x->device);
  if (!out || out->numel == 0) return out;
  int64_t at = 0;
  for (int j = 0; j < sf; j++) {
    int64_t sz, off;
    if (!dt_strided_piece(n, k, sf, coord, j, &sz, &off)) break; /* later pieces are empty too */
    if (sz == 0) continue;
    eng_tensor* s = dt_narrow_view(x, d, off, sz);
    eng_tensor* t = dt_narrow_view(out, d, at, sz);
    int rc = copy_view(t, s);
    eng_tensor_release(s);
    eng_tensor_release(t);
    if (rc) { eng_tensor_release(out); return NULL; }
    at += sz;
  }
  return out;
}

eng_tensor* dt_strided_gather(const char* op, eng_pg* pg, const eng_tensor* x, int d, int k, int sf, int coord,
                              int64_t L) {
  int nd = x->ndim;
  int64_t m = dt_strided_size(L, k, sf, coord), M = dt_strided_size(L, k, sf, 0);
  if (x->shape[d] != m)
    return eng_errp("%s: the local shard %s has %lld entries on dim %d, but _StridedShard(dim=%d, sf=%d) of %lld "
                    "entries over %d ranks gives %lld at mesh coordinate %d", op, eng_desc(x),
                    (long long)x->shape[d], d + dt_base(), d + dt_base(), sf, (long long)L, k, (long long)m, coord);
  int64_t shape[ENG_MAX_DIMS];
  for (int j = 0; j < nd; j++) shape[j] = x->shape[j];
  shape[d] = L;
  eng_tensor* out = eng_new(nd, shape, x->dtype, x->device);
  if (!out || out->numel == 0 || M == 0) return out; /* same decision on every rank: no communication */
  int64_t fs[ENG_MAX_DIMS];
  front_shape(x, d, M, fs);
  eng_tensor* send = eng_new(nd, fs, x->dtype, x->device);
  fs[0] = (int64_t)k * M;
  eng_tensor* R = send ? eng_new(nd, fs, x->dtype, x->device) : NULL;
  if (!send || !R) { eng_tensor_release(send); eng_tensor_release(R); eng_tensor_release(out); return NULL; }
  zero_rows(send, m, M - m);
  eng_tensor* sv = front_rows(send, x, d, 0, m);
  int rc = copy_view(sv, x);
  eng_tensor_release(sv);
  if (!rc) rc = eng_pg_all_gather_into(pg, R, send, NULL);
  eng_tensor_release(send);
  /* coordinate r's rows start at r*M: its sub-piece of each piece in order */
  if (!rc) rc = move_pieces(R, out, x, d, L, k, sf, M, 0);
  eng_tensor_release(R);
  if (rc) { eng_tensor_release(out); return NULL; }
  return out;
}

/* Scatter from group rank src: src packs coordinate r's sub-pieces into rows
 * [r*M, r*M + m_r) (the rest zero), every rank receives M rows and keeps its m. */
static eng_tensor* strided_scatter(eng_pg* pg, const eng_tensor* x, int d, int k, int sf, int coord, int src) {
  int nd = x->ndim;
  int64_t L = x->shape[d], M = dt_strided_size(L, k, sf, 0), m = dt_strided_size(L, k, sf, coord);
  int64_t rest = 1;
  for (int j = 0; j < nd; j++) if (j != d) rest *= x->shape[j];
  if (M == 0 || rest == 0) { /* nothing to move; the same decision on every rank */
    int64_t shape[ENG_MAX_DIMS];
    for (int j = 0; j < nd; j++) shape[j] = x->shape[j];
    shape[d] = m;
    return eng_new(nd, shape, x->dtype, x->device);
  }
  int64_t fs[ENG_MAX_DIMS];
  eng_tensor* send = NULL;
  int rc = 0;
  if (coord == src) {
    front_shape(x, d, (int64_t)k * M, fs);
    send = eng_new(nd, fs, x->dtype, x->device);
    if (!send) return NULL;
    zero_rows(send, 0, (int64_t)k * M); /* the padding of short coordinates */
    rc = move_pieces(send, x, x, d, L, k, sf, M, 1);
    if (rc) { eng_tensor_release(send); return NULL; }
  }
  front_shape(x, d, M, fs);
  eng_tensor* R = eng_new(nd, fs, x->dtype, x->device);
  if (!R) { eng_tensor_release(send); return NULL; }
  rc = eng_pg_scatter(pg, R, send, src, NULL);
  eng_tensor_release(send);
  if (rc) { eng_tensor_release(R); return NULL; }
  eng_tensor* v = front_rows(R, x, d, 0, m);
  eng_tensor* out = v ? eng_new(nd, v->shape, x->dtype, x->device) : NULL;
  if (out && copy_view(out, v)) { eng_tensor_release(out); out = NULL; }
  eng_tensor_release(v);
  eng_tensor_release(R);
  return out;
}

eng_tensor* dt_strided_distribute_step(eng_mesh* mesh, int mesh_dim, eng_tensor* x, const eng_placement* p,
                                       int coord, int src_data_rank) {
  int k = eng_mesh_size(mesh, mesh_dim);
  if (src_data_rank < 0 || k == 1) return dt_strided_select(x, p->dim, k, p->split_factor, coord);
  eng_pg* pg = eng_mesh_get_group(mesh, mesh_dim);
  if (!pg) return NULL;
  eng_tensor* out = strided_scatter(pg, x, p->dim, k, p->split_factor, coord, src_data_rank);
  eng_pg_release(pg);
  return out;
}

eng_tensor* dt_random_local(int kind, const eng_dist_spec* s, double a, double b, int dtype, uint64_t seed,
                            uint64_t offset) {
  if (!s->has_strided)
    return eng_random_slice(kind, s->ndim, s->shape, s->offset, s->local_shape, a, b, dtype, seed, offset);
  int nd = s->ndim;
  int64_t* st[ENG_MAX_DIMS] = {0};
  int64_t* len[ENG_MAX_DIMS] = {0};
  int nr[ENG_MAX_DIMS] = {0};
  eng_tensor* out = NULL;
  int rc = 0;
  for (int d = 0; d < nd && !rc; d++) {
    int64_t total, anchor;
    rc = dt_dim_runs(s->shape, nd, s->mesh_ndim, s->mesh_shape, s->coord, s->placements, d, &st[d], &len[d], &nr[d],
                     &total, &anchor);
  }
  if (!rc) out = eng_new(nd, s->local_shape, dtype, ENG_CPU);
  if (out && out->numel > 0) {
    /* every box of runs (one run per dim), odometer order */
    int idx[ENG_MAX_DIMS] = {0};
    for (;;) {
      int64_t start[ENG_MAX_DIMS], size[ENG_MAX_DIMS], at = out->offset;
      for (int d = 0; d < nd; d++) {
        int64_t lpos = 0;
        for (int r = 0; r < idx[d]; r++) lpos += len[d][r];
        start[d] = st[d][idx[d]];
        size[d] = len[d][idx[d]];
        at += lpos * out->stride[d];
      }
      eng_tensor* box = eng_random_slice(kind, nd, s->shape, start, size, a, b, dtype, seed, offset);
      eng_tensor* dst = box ? eng_view_of(out, nd, size, out->stride, at) : NULL;
      int crc = copy_view(dst, box);
      eng_tensor_release(box);
      eng_tensor_release(dst);
      if (crc) { eng_tensor_release(out); out = NULL; break; }
      int d = nd - 1;
      while (d >= 0 && ++idx[d] == nr[d]) idx[d--] = 0;
      if (d < 0) break;
    }
  }
  for (int d = 0; d < nd; d++) { free(st[d]); free(len[d]); }
  return out;
}
