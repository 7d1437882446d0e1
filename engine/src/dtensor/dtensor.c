/* Subsystem dtensor/: DTensor specs and placements (Shard, Replicate,
 * Partial, _StridedShard), torch.chunk layout math, redistribute with its
 * planner and cost model, resharding math, implicit replication and the op
 * dispatcher (sharding propagation), which installs itself into autograd.
 * May call: core/, autograd/, comm/, ops/ (local compute).  The per-op
 * rules (sharding/) sit above it and register their op defs in its op table
 * (dtensor/dispatch.h); the dispatcher never names them. */
/* dtensor.c: the DTensor API: from_local / to_local / full_tensor (with
 * their autograd nodes), distribute_tensor, factories, the building blocks
 * for op dispatch (local mode, wrap_output) and descriptions.
 * Redistribution itself is in dtensor/redistribute.c; specs and layout math in
 * dtensor/spec.c. */
#include "dtensor/dtensor_impl.h"
#include "autograd/autograd.h"
#include "eng/rng.h"
#include <stdio.h>

/* ------------------------------------------------------------------ queries */
int eng_is_dtensor(const eng_tensor* t) { return t && t->dist != NULL; }
eng_dist_spec* eng_dtensor_spec(const eng_tensor* t) { return t ? t->dist : NULL; }
int64_t eng_dtensor_numel(const eng_tensor* t) {
  if (!t) return 0;
  return t->dist ? t->dist->numel : t->numel;
}

const char* eng_dtensor_describe(const eng_tensor* t, char* buf, int cap) {
  if (!buf || cap <= 0) return "";
  if (!t) { snprintf(buf, cap, "(NULL)"); return buf; }
  if (!t->dist) { snprintf(buf, cap, "%s", eng_desc(t)); return buf; }
  char s[600];
  snprintf(buf, cap, "DTensor(%s, local %s)", eng_dist_spec_describe(t->dist, t->dtype, s, sizeof s), eng_desc(t));
  return buf;
}

eng_tensor* eng_dtensor_local_view(eng_tensor* t) {
  ENG_CHECK(t, "local_view");
  if (eng_dtensor_wait(t)) return NULL;
  return dt_plain(t);
}

static const char* spec_desc(const eng_tensor* t, char* buf, int cap) {
  return eng_dist_spec_describe(t->dist, t->dtype, buf, cap);
}

/* ------------------------------------------------------------------ local mode, wrapping */
/* The flag lives with the guards that read it (core/dispatch.c). */
int eng_dtensor_set_local_mode(int on) { return eng_dispatch_set_local_mode(on); }

int eng_dtensor_local_mode(void) { return eng_dispatch_local_mode(); }

static int check_local_shape(const char* op, const eng_tensor* local, const eng_dist_spec* s) {
  if (local->ndim != s->ndim) {
    char b[600];
    return eng_err("%s: local tensor %s has %d dims but the spec %s has %d", op, eng_desc(local), local->ndim,
                   eng_dist_spec_describe(s, local->dtype, b, sizeof b), s->ndim);
  }
  if (!s->member) return 0;
  for (int d = 0; d < s->ndim; d++)
    if (local->shape[d] != s->local_shape[d]) {
      char b[600];
      return eng_err("%s: local tensor %s does not match this rank's shard %s of %s (torch.chunk rules)", op,
                     eng_desc(local), eng_shape_str(s->ndim, s->local_shape),
                     eng_dist_spec_describe(s, local->dtype, b, sizeof b));
    }
  return 0;
}

int eng_dtensor_wrap_output(eng_tensor* out, eng_dist_spec* spec) {
  if (!out) return eng_err("wrap_output: output tensor is NULL");
  if (!spec) return eng_err("wrap_output: spec is NULL");
  if (check_local_shape("wrap_output", out, spec)) return -1;
  dt_attach(out, spec);
  return 0;
}

eng_tensor* eng_dtensor_ones_grad(eng_tensor* t) {
  ENG_CHECK(t, "backward");
  eng_tensor* g = eng_tensor_full(t->ndim, t->shape, 1.0, t->dtype, t->device);
  if (!g || !t->dist) return g;
  eng_dist_spec* adj = dt_spec_adjoint(t->dist);
  if (!adj) { eng_tensor_release(g); return NULL; }
  dt_attach(g, adj);
  eng_dist_spec_release(adj);
  return g;
}

/* An empty local (every size 0) for ranks outside the mesh. */
static eng_tensor* empty_local(int ndim, int dtype, int device) {
  int64_t z[ENG_MAX_DIMS] = {0};
  return eng_new(ndim, z, dtype, device);
}

/* t on the mesh's device, as PyTorch's distribute_tensor moves a tensor to device_mesh.device_type: t itself
 * (retained) when it is there already or on meta, else a copy there (no autograd: the result is a new leaf).
 * NULL with the op's name on failure.  (eng_dtensor_from_local keeps the local where it is, as PyTorch's
 * DTensor constructor does for FSDP's CPU-offloaded shards; the Lua from_local moves it first.) */
static eng_tensor* to_mesh_device(const char* op, eng_tensor* t, const eng_mesh* mesh) {
  int dev = eng_mesh_device(mesh);
  if (t->device == dev || t->device == ENG_META) return eng_tensor_retain(t);
  int was = eng_set_grad_enabled(0);
  eng_tensor* r = eng_tensor_to_device(t, dev);
  eng_set_grad_enabled(was);
  if (!r) eng_err_prefix("%s: moving %s to the mesh's device", op, eng_desc(t));
  return r;
}

/* Placements argument: NULL means all Replicate. */
static int placements_arg(const char* op, const eng_mesh* mesh, int n, const eng_placement* pl, int ndim,
                          eng_placement* out) {
  if (!mesh) return eng_err("%s: device mesh is NULL", op);
  if (!pl) {
    int mnd = eng_mesh_ndim(mesh);
    for (int i = 0; i < mnd; i++) { out[i].kind = ENG_PLACEMENT_REPLICATE; out[i].dim = 0; out[i].op = 0; }
    return 0;
  }
  return dt_check_placements(op, mesh, n, pl, ndim, out);
}

/* ------------------------------------------------------------------ from_local */
typedef struct fl_ctx { eng_dist_spec* spec; } fl_ctx;

static void spec_ctx_free(eng_node* n) {
  fl_ctx* c = n->ctx;
  if (c) { eng_dist_spec_release(c->spec); free(c); }
  n->ctx = NULL;
}

static eng_tensor* cast_to(eng_tensor* r, int dtype) {
  if (!r || r->dtype == dtype) return r;
  eng_tensor* c = eng_tensor_to_dtype(r, dtype);
  eng_tensor_release(r);
  return c;
}

/* Gradient of the plain local input: the DTensor gradient redistributed to
 * the from_local layout (a Partial layout takes a Shard/Replicate gradient as
 * Replicate: grads never become Partial), as a plain local tensor. */
static int from_local_backward(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  fl_ctx* c = n->ctx;
  eng_tensor* g = go[0];
  eng_tensor* r;
  if (!c->spec->member) {
    r = eng_tensor_zeros(eng_node_in_ndim(n, 0), eng_node_in_shape(n, 0), eng_node_in_dtype(n, 0),
                         eng_mesh_device(c->spec->mesh));
  } else if (g->dist && !eng_dist_spec_equal(g->dist, c->spec)) {
    eng_dist_spec* target = dt_grad_target(c->spec, g->dist);
    if (!target) return -1;
    r = eng_dist_spec_equal(g->dist, target) ? dt_plain(g) : dt_redistribute_local(g, g->dist, target, 0, 1);
    eng_dist_spec_release(target);
  } else {
    r = dt_plain(g);
  }
  r = cast_to(r, eng_node_in_dtype(n, 0));
  if (!r) return -1;
  gi[0] = r;
  return 0;
}

/* All ranks of the mesh compare v (n values): 0 when equal everywhere, 1 when
 * not (same answer on every rank), -1 on error.  lo/hi get the extremes. */
static int mesh_agree(const char* op, eng_mesh* mesh, const int64_t* v, int n, int64_t* lo, int64_t* hi) {
  int64_t shape = 2 * n;
  eng_tensor* buf = eng_new(1, &shape, ENG_I64, ENG_CPU);
  if (!buf) return -1;
  int64_t* p = (int64_t*)eng_ptr(buf);
  for (int j = 0; j < n; j++) { p[j] = v[j]; p[n + j] = -v[j]; }
  int nd = eng_mesh_ndim(mesh);
  for (int i = 0; i < nd; i++) {
    eng_pg* pg = eng_mesh_get_group(mesh, i);
    int rc = pg ? eng_pg_all_reduce(pg, buf, ENG_REDUCE_MAX, NULL) : -1;
    eng_pg_release(pg);
    if (rc) { eng_tensor_release(buf); eng_err_prefix("%s: run_check", op); return -1; }
  }
  int bad = 0;
  for (int j = 0; j < n; j++) {
    hi[j] = p[j]; lo[j] = -p[n + j];
    if (hi[j] != lo[j]) bad = 1;
  }
  eng_tensor_release(buf);
  return bad;
}

eng_tensor* eng_dtensor_from_local(eng_tensor* local, eng_mesh* mesh, int n, const eng_placement* pl,
                                   int run_check, const int64_t* shape, const int64_t* stride) {
  const char* op = "from_local";
  ENG_CHECK(local, op);
  if (local->dist) {
    char b[700];
    return eng_errp("%s: the local tensor must be a plain tensor, got %s", op, eng_dtensor_describe(local, b, sizeof b));
  }
  if ((shape == NULL) != (stride == NULL))
    return eng_errp("%s: %s: Please pass both shape and stride at the same time.", op, eng_desc(local));
  if (eng_dtensor_wait(local)) return NULL;
  int nd = local->ndim;
  eng_placement norm[ENG_MAX_DIMS];
  if (placements_arg(op, mesh, n, pl, nd, norm)) { eng_err_prefix("%s: %s", op, eng_desc(local)); return NULL; }
  int mnd = eng_mesh_ndim(mesh);
  int64_t gshape[ENG_MAX_DIMS], gstride[ENG_MAX_DIMS];
  if (shape) {
    for (int d = 0; d < nd; d++) {
      if (shape[d] < 0) return eng_errp("%s: negative size in the global shape %s", op, eng_shape_str(nd, shape));
      gshape[d] = shape[d]; gstride[d] = stride[d];
    }
  } else {
    /* PyTorch's compute_global_tensor_info: even shards assumed */
    for (int d = 0; d < nd; d++) { gshape[d] = local->shape[d]; gstride[d] = local->stride[d]; }
    for (int i = 0; i < mnd; i++) {
      if (!dt_is_shard_like(&norm[i])) continue; /* Shard or _StridedShard */
      int sd = norm[i].dim;
      int64_t k = eng_mesh_size(mesh, i);
      int64_t ref = gstride[sd];
      gshape[sd] *= k;
      for (int j = 0; j < nd; j++) if (j != sd && gstride[j] >= ref) gstride[j] *= k;
    }
  }
  if (run_check) {
    int64_t v[2 + 2 * ENG_MAX_DIMS + 1], lo[2 + 2 * ENG_MAX_DIMS + 1], hi[2 + 2 * ENG_MAX_DIMS + 1];
    int m = 0;
    v[m++] = local->dtype;
    v[m++] = local->requires_grad;
    if (!shape) {
      v[m++] = nd;
      for (int d = 0; d < nd; d++) v[m++] = local->shape[d];
      for (int d = 0; d < nd; d++) v[m++] = local->stride[d];
    }
    int bad = mesh_agree(op, mesh, v, m, lo, hi);
    if (bad < 0) return NULL;
    if (bad) {
      char what[160];
      if (lo[0] != hi[0]) snprintf(what, sizeof what, "dtypes %s and %s", eng_dtype_name((int)lo[0]), eng_dtype_name((int)hi[0]));
      else if (lo[1] != hi[1]) snprintf(what, sizeof what, "requires_grad differs");
      else snprintf(what, sizeof what, "local shapes or strides differ");
      return eng_errp("%s: %s: Inconsistent tensor metadata (including shape and stride) across ranks (%s).", op,
                      eng_desc(local), what);
    }
  }
  eng_dist_spec* spec = dt_spec_make(mesh, norm, nd, gshape, gstride);
  if (!spec) return NULL;
  eng_tensor* out;
  if (!spec->member) {
    out = empty_local(nd, local->dtype, local->device);
  } else {
    if (shape && check_local_shape(op, local, spec)) { eng_dist_spec_release(spec); return NULL; }
    int bcast = 0;
    for (int i = 0; i < mnd; i++) if (run_check && norm[i].kind == ENG_PLACEMENT_REPLICATE) bcast = 1;
    if (local->device == ENG_META) bcast = 0; /* no data to broadcast */
    if (bcast) {
      out = eng_new(nd, local->shape, local->dtype, local->device);
      if (out) {
        if (out->numel) eng_copy_raw(out, local, local->stride);
        for (int i = 0; i < mnd; i++) {
          if (norm[i].kind != ENG_PLACEMENT_REPLICATE || out->numel == 0) continue;
          eng_pg* pg = eng_mesh_get_group(mesh, i);
          int rc = pg ? eng_pg_broadcast(pg, out, 0, NULL) : -1;
          eng_pg_release(pg);
          if (rc) { eng_tensor_release(out); out = NULL; eng_err_prefix("%s: run_check broadcast", op); break; }
        }
      }
    } else {
      out = dt_plain(local);
    }
  }
  if (!out) { eng_dist_spec_release(spec); return NULL; }
  dt_attach(out, spec);
  if (eng_any_requires_grad(1, &local) && eng_dtype_is_floating(out->dtype)) {
    fl_ctx* c = calloc(1, sizeof *c);
    eng_node* node = c ? eng_node_new("FromLocalBackward", from_local_backward, 1, &local, 1) : NULL;
    if (!node) { free(c); eng_dist_spec_release(spec); eng_tensor_release(out); return c ? NULL : eng_errp("%s: out of memory", op); }
    c->spec = eng_dist_spec_retain(spec);
    node->ctx = c;
    node->free_ctx = spec_ctx_free;
    eng_node_set_output(node, out, 0);
    eng_node_release(node);
  }
  eng_dist_spec_release(spec);
  return out;
}

/* ------------------------------------------------------------------ to_local */
/* The local gradient, wrapped as a DTensor with the recorded layout. */
static int to_local_backward(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  fl_ctx* c = n->ctx;
  eng_tensor* r = cast_to(dt_plain(go[0]), eng_node_in_dtype(n, 0));
  if (!r) return -1;
  dt_attach(r, c->spec);
  gi[0] = r;
  return 0;
}

eng_tensor* eng_dtensor_to_local(eng_tensor* t, const eng_placement* grad_pl) {
  const char* op = "to_local";
  ENG_CHECK(t, op);
  if (!t->dist) return eng_errp("%s: %s is not a DTensor", op, eng_desc(t));
  if (eng_dtensor_wait(t)) return NULL;
  eng_dist_spec* src = t->dist;
  eng_dist_spec* gspec = NULL;
  char a[600];
  if (grad_pl) {
    eng_placement norm[ENG_MAX_DIMS];
    if (dt_check_placements("to_local: grad_placements", src->mesh, src->mesh_ndim, grad_pl, src->ndim, norm)) {
      eng_err_prefix("%s", spec_desc(t, a, sizeof a));
      return NULL;
    }
    gspec = dt_spec_make(src->mesh, norm, src->ndim, src->shape, src->stride);
    if (!gspec) return NULL;
    if (gspec->member)
      for (int d = 0; d < src->ndim; d++)
        if (gspec->local_shape[d] != src->local_shape[d]) {
          char b[400];
          eng_errp("%s: %s: grad_placements %s give local shards of shape %s, not the local shape %s", op,
                   spec_desc(t, a, sizeof a), dt_placements_str(src->mesh_ndim, norm, b, sizeof b),
                   eng_shape_str(src->ndim, gspec->local_shape), eng_shape_str(t->ndim, t->shape));
          eng_dist_spec_release(gspec);
          return NULL;
        }
  }
  eng_tensor* out = dt_plain(t);
  if (!out) { eng_dist_spec_release(gspec); return NULL; }
  if (eng_any_requires_grad(1, &t) && eng_dtype_is_floating(out->dtype)) {
    fl_ctx* c = calloc(1, sizeof *c);
    eng_node* node = c ? eng_node_new("ToLocalBackward", to_local_backward, 1, &t, 1) : NULL;
    if (!node) {
      free(c); eng_dist_spec_release(gspec); eng_tensor_release(out);
      return c ? NULL : eng_errp("%s: out of memory", op);
    }
    c->spec = gspec ? gspec : eng_dist_spec_retain(src);
    gspec = NULL;
    node->ctx = c;
    node->free_ctx = spec_ctx_free;
    eng_node_set_output(node, out, 0);
    eng_node_release(node);
  }
  eng_dist_spec_release(gspec);
  return out;
}

eng_tensor* eng_dtensor_full_tensor(eng_tensor* t, const eng_placement* grad_pl) {
  const char* op = "full_tensor";
  ENG_CHECK(t, op);
  if (!t->dist) return eng_errp("%s: %s is not a DTensor", op, eng_desc(t));
  eng_placement rep[ENG_MAX_DIMS];
  for (int i = 0; i < t->dist->mesh_ndim; i++) { rep[i].kind = ENG_PLACEMENT_REPLICATE; rep[i].dim = 0; rep[i].op = 0; }
  eng_tensor* r = eng_dtensor_redistribute(t, NULL, t->dist->mesh_ndim, rep, 0);
  if (!r) { eng_err_prefix("%s", op); return NULL; }
  eng_tensor* out = eng_dtensor_to_local(r, grad_pl);
  eng_tensor_release(r);
  if (!out) eng_err_prefix("%s", op);
  return out;
}

/* ------------------------------------------------------------------ distribute_tensor */
/* Scatter along dim d of x from group rank src (k ranks); returns the local
 * chunk (contiguous) for this rank at coordinate coord. */
static eng_tensor* scatter_dim(eng_pg* pg, eng_tensor* x, int d, int k, int coord, int src) {
  int nd = x->ndim;
  int64_t L = x->shape[d], full = L > 0 ? (L + k - 1) / k : 0, ms, off;
  eng_shard_size_and_offset(L, k, coord, &ms, &off);
  int64_t fs[ENG_MAX_DIMS] = {0}, fst[ENG_MAX_DIMS] = {0};
  int q = 0;
  fs[q] = x->shape[d]; fst[q] = x->stride[d]; q++;
  for (int j = 0; j < nd; j++) if (j != d) { fs[q] = x->shape[j]; fst[q] = x->stride[j]; q++; }
  int64_t rest = eng_shape_numel(nd - 1, fs + 1);
  int64_t shape[ENG_MAX_DIMS];
  for (int j = 0; j < nd; j++) shape[j] = x->shape[j];
  shape[d] = ms;
  if (full == 0 || rest == 0) return eng_new(nd, shape, x->dtype, x->device);
  eng_tensor* send = NULL;
  if (coord == src) {
    int64_t ps[ENG_MAX_DIMS];
    memcpy(ps, fs, sizeof ps);
    ps[0] = (int64_t)k * full;
    send = eng_new(nd, ps, x->dtype, x->device);
    if (!send) return NULL;
    if (eng_zero_elems(send, L * rest, (ps[0] - L) * rest)) { eng_tensor_release(send); return NULL; }
    eng_tensor* xv = eng_view_of(x, nd, fs, fst, x->offset);
    eng_tensor* dv = eng_view_of(send, nd, fs, send->stride, 0);
    if (xv && dv) eng_copy_raw(dv, xv, xv->stride);
    eng_tensor_release(xv); eng_tensor_release(dv);
  }
  int64_t rs[ENG_MAX_DIMS];
  memcpy(rs, fs, sizeof rs);
  rs[0] = full;
  eng_tensor* R = eng_new(nd, rs, x->dtype, x->device);
  if (!R) { eng_tensor_release(send); return NULL; }
  int rc = eng_pg_scatter(pg, R, send, src, NULL);
  eng_tensor_release(send);
  if (rc) { eng_tensor_release(R); return NULL; }
  int64_t st[ENG_MAX_DIMS];
  if (d == 0) {
    eng_contiguous_strides(nd, shape, st);
    eng_tensor* out = eng_view_of(R, nd, shape, st, 0);
    eng_tensor_release(R);
    return out;
  }
  int k2 = 1;
  for (int j = 0; j < nd; j++) st[j] = j == d ? R->stride[0] : R->stride[k2++];
  eng_tensor* v = eng_view_of(R, nd, shape, st, 0);
  eng_tensor* out = eng_new(nd, shape, x->dtype, x->device);
  if (v && out && out->numel) eng_copy_raw(out, v, v->stride);
  eng_tensor_release(v);
  eng_tensor_release(R);
  return out;
}

eng_tensor* eng_dtensor_distribute_tensor(eng_tensor* t, eng_mesh* mesh, int n, const eng_placement* pl,
                                          int src_data_rank) {
  const char* op = "distribute_tensor";
  ENG_CHECK(t, op);
  if (!mesh) return eng_errp("%s: device mesh is NULL", op);
  char a[600], b[400], c2[400];
  if (t->grad_fn)
    return eng_errp("%s: %s: `distribute_tensor` should be used to distribute leaf tensors! but found non-leaf "
                    "tensor (grad_fn %s)!", op, eng_desc(t), t->grad_fn->name);
  eng_placement norm[ENG_MAX_DIMS];
  if (placements_arg(op, mesh, n, pl, t->ndim, norm)) { eng_err_prefix("%s: %s", op, eng_desc(t)); return NULL; }
  int mnd = eng_mesh_ndim(mesh);
  if (t->dist) {
    eng_dist_spec* s = t->dist;
    if (s->mesh != mesh && !eng_mesh_equal(s->mesh, mesh)) {
      char m1[160], m2[160];
      return eng_errp("%s: Cannot distribute a DTensor with device mesh %s to a different device mesh %s.", op,
                      dt_mesh_str(s->mesh, m1, sizeof m1), dt_mesh_str(mesh, m2, sizeof m2));
    }
    for (int i = 0; i < mnd; i++)
      if (!eng_placement_equal(&s->placements[i], &norm[i]))
        return eng_errp("%s: Cannot distribute a DTensor with placements %s to a different placements %s. do you "
                        "want to call `redistribute` instead?", op, dt_placements_str(mnd, s->placements, b, sizeof b),
                        dt_placements_str(mnd, norm, c2, sizeof c2));
    return eng_tensor_retain(t);
  }
  for (int i = 0; i < mnd; i++)
    if (norm[i].kind == ENG_PLACEMENT_PARTIAL)
      return eng_errp("%s: %s: Trying to distribute tensor with unsupported placements %s on device mesh dimension "
                      "%d!", op, eng_desc(t), eng_placement_describe(&norm[i], b, sizeof b), i + dt_base());
  if (t->device != ENG_META && t->device != eng_mesh_device(mesh)) {
    /* PyTorch: tensor.to(device_mesh.device_type); the result is a new leaf */
    eng_tensor* moved = to_mesh_device(op, t, mesh);
    if (!moved) return NULL;
    eng_tensor* r = eng_dtensor_distribute_tensor(moved, mesh, n, pl, src_data_rank);
    eng_tensor_release(moved);
    if (r) r->requires_grad = t->requires_grad && eng_dtype_is_floating(r->dtype);
    return r;
  }
  if (src_data_rank >= 0)
    for (int i = 0; i < mnd; i++)
      if (src_data_rank >= eng_mesh_size(mesh, i))
        return eng_errp("%s: src_data_rank %d is out of range for mesh dim %d of size %d", op, src_data_rank, i + dt_base(),
                        eng_mesh_size(mesh, i));
  if (eng_dtensor_wait(t)) return NULL;
  if (t->device == ENG_META) src_data_rank = -1; /* shapes only: every rank takes its chunk, no communication */
  eng_dist_spec* spec = dt_spec_make(mesh, norm, t->ndim, t->shape, t->stride);
  if (!spec) return NULL;
  eng_tensor* cur;
  if (!spec->member) cur = empty_local(t->ndim, t->dtype, t->device);
  else {
    cur = dt_plain(t);
    int owned = 0;
    for (int i = 0; cur && i < mnd; i++) {
      int k = eng_mesh_size(mesh, i);
      eng_tensor* next = NULL;
      if (norm[i].kind == ENG_PLACEMENT_STRIDED_SHARD) {
        next = dt_strided_distribute_step(mesh, i, cur, &norm[i], spec->coord[i], src_data_rank);
      } else if (norm[i].kind == ENG_PLACEMENT_SHARD) {
        int d = norm[i].dim;
        if (src_data_rank < 0 || k == 1) {
          int64_t sz, off;
          eng_shard_size_and_offset(cur->shape[d], k, spec->coord[i], &sz, &off);
          int64_t shape[ENG_MAX_DIMS];
          for (int j = 0; j < cur->ndim; j++) shape[j] = cur->shape[j];
          shape[d] = sz;
          eng_tensor* v = eng_view_of(cur, cur->ndim, shape, cur->stride, cur->offset + off * cur->stride[d]);
          next = v ? eng_new(cur->ndim, shape, cur->dtype, cur->device) : NULL;
          if (next && next->numel) eng_copy_raw(next, v, v->stride);
          eng_tensor_release(v);
        } else {
          eng_pg* pg = eng_mesh_get_group(mesh, i);
          next = pg ? scatter_dim(pg, cur, d, k, spec->coord[i], src_data_rank) : NULL;
          eng_pg_release(pg);
        }
      } else {
        if (owned && eng_tensor_is_contiguous(cur)) next = eng_tensor_retain(cur);
        else {
          next = eng_new(cur->ndim, cur->shape, cur->dtype, cur->device);
          if (next && next->numel) eng_copy_raw(next, cur, cur->stride);
        }
        if (next && src_data_rank >= 0 && k > 1 && next->numel) {
          eng_pg* pg = eng_mesh_get_group(mesh, i);
          int rc = pg ? eng_pg_broadcast(pg, next, src_data_rank, NULL) : -1;
          eng_pg_release(pg);
          if (rc) { eng_tensor_release(next); next = NULL; }
        }
      }
      eng_tensor_release(cur);
      cur = next;
      owned = 1;
    }
    if (cur && !owned) { /* no mesh dims (cannot happen) or nothing copied: detach from the input */
      eng_tensor* c = eng_new(cur->ndim, cur->shape, cur->dtype, cur->device);
      if (c && c->numel) eng_copy_raw(c, cur, cur->stride);
      eng_tensor_release(cur);
      cur = c;
    }
  }
  if (!cur) {
    eng_err_prefix("%s: %s", op, eng_dist_spec_describe(spec, t->dtype, a, sizeof a));
    eng_dist_spec_release(spec);
    return NULL;
  }
  dt_attach(cur, spec);
  eng_dist_spec_release(spec);
  cur->requires_grad = t->requires_grad && eng_dtype_is_floating(cur->dtype);
  return cur;
}

/* ------------------------------------------------------------------ factories */
static eng_dist_spec* factory_spec(const char* op, int ndim, const int64_t* shape, int dtype, eng_mesh* mesh, int n,
                                   const eng_placement* pl) {
  if (ndim < 0 || ndim > ENG_MAX_DIMS) return eng_errp("%s: %d dims requested; tensors have 0 to %d dims", op, ndim, ENG_MAX_DIMS);
  if (ndim > 0 && !shape) return eng_errp("%s: shape is NULL", op);
  for (int d = 0; d < ndim; d++)
    if (shape[d] < 0) return eng_errp("%s: negative size in shape %s", op, eng_shape_str(ndim, shape));
  if (dtype < 0 || dtype >= ENG_NUM_DTYPES) return eng_errp("%s: invalid dtype code %d", op, dtype);
  if (!mesh) return eng_errp("%s: device mesh is NULL", op);
  eng_placement norm[ENG_MAX_DIMS];
  if (placements_arg(op, mesh, n, pl, ndim, norm)) return NULL;
  return dt_spec_make(mesh, norm, ndim, shape, NULL);
}

static eng_tensor* finish_factory(eng_tensor* local, eng_dist_spec* spec) {
  if (local) dt_attach(local, spec);
  eng_dist_spec_release(spec);
  return local;
}

eng_tensor* eng_dtensor_full(int ndim, const int64_t* shape, double value, int dtype, eng_mesh* mesh, int n,
                             const eng_placement* pl) {
  eng_dist_spec* spec = factory_spec("full", ndim, shape, dtype, mesh, n, pl);
  if (!spec) return NULL;
  return finish_factory(eng_tensor_full(ndim, spec->local_shape, value, dtype, eng_mesh_device(mesh)), spec);
}

eng_tensor* eng_dtensor_empty(int ndim, const int64_t* shape, int dtype, eng_mesh* mesh, int n,
                              const eng_placement* pl) {
  eng_dist_spec* spec = factory_spec("empty", ndim, shape, dtype, mesh, n, pl);
  if (!spec) return NULL;
  return finish_factory(eng_tensor_empty(ndim, spec->local_shape, dtype, eng_mesh_device(mesh)), spec);
}

eng_tensor* eng_dtensor_random(int kind, int ndim, const int64_t* shape, double a, double b, int dtype,
                               eng_mesh* mesh, int n, const eng_placement* pl) {
  const char* op = kind == ENG_RNG_NORMAL ? "randn" : "rand";
  if (kind != ENG_RNG_UNIFORM && kind != ENG_RNG_NORMAL)
    return eng_errp("random: distribution kind %d is not supported for DTensors (0 uniform, 1 normal)", kind);
  eng_dist_spec* spec = factory_spec(op, ndim, shape, dtype, mesh, n, pl);
  if (!spec) return NULL;
  if (spec->has_partial) {
    char b2[400];
    dt_placements_str(spec->mesh_ndim, spec->placements, b2, sizeof b2);
    eng_dist_spec_release(spec);
    return eng_errp("%s: random DTensors cannot have Partial placements, got %s", op, b2);
  }
  if (!eng_dtype_is_floating(dtype)) {
    eng_dist_spec_release(spec);
    return eng_errp("%s: random numbers need a floating point dtype, got %s", op, eng_dtype_name(dtype));
  }
  /* every rank advances the generator by the global numel, as eng_rand does */
  uint64_t seed;
  uint64_t off = eng_rng_reserve_seeded((uint64_t)spec->numel, &seed);
  eng_tensor* local;
  if (spec->member) {
    /* drawn on the host (the CPU and CUDA Philox streams are bit-identical), then moved to a CUDA mesh */
    local = dt_random_local(kind, spec, a, b, dtype, seed, off); /* also _StridedShard (several runs) */
    if (local && eng_mesh_device(mesh) != ENG_CPU) {
      eng_tensor* d = eng_tensor_to_device(local, eng_mesh_device(mesh));
      eng_tensor_release(local);
      local = d;
    }
  } else local = empty_local(ndim, dtype, eng_mesh_device(mesh));
  if (!local) eng_err_prefix("%s", op);
  return finish_factory(local, spec);
}
