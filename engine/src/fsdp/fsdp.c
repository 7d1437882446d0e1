/* Subsystem fsdp/: fully sharded data parallelism's parameter groups and
 * their C hooks (engine/include/eng/fsdp.h says what they do).
 * May call: core/, autograd/ (nodes, hooks, end-of-backward callbacks),
 * comm/ (collectives), dtensor/ (the sharded parameters' specs).
 * The Lua side (lua/engine/distributed/fsdp.lua) builds the sharded
 * parameters, makes the groups, finds the root and looks parameters up; no
 * Lua runs inside these hooks. */
#include "core/internal.h"
#include <stdio.h>

enum { ST_SHARDED = 0, ST_UNSHARDED = 1, ST_POST_FWD = 2 };

typedef struct fparam {
  eng_tensor* sharded;  /* the registered DTensor parameter */
  eng_tensor* leaf;     /* the unsharded parameter (view of g->ubase's storage) */
  eng_tensor* acc;      /* unsharded gradient accumulated so far (reduce dtype) */
  int dim;              /* shard dim */
  int ndim;
  int64_t shape[8];     /* global shape */
  int64_t ceil_d[2];    /* rows of dim per rank, padded: [0] over the shard group, [1] the post-forward subgroup */
  int64_t coff[2];      /* offset of its block in a rank's chunk (same two layouts) */
  eng_tensor* post;     /* ST_POST_FWD: the registered DTensor on the post-forward mesh (its shard views g->kept) */
  eng_dist_spec* uspec; /* FSDP over TP: the unsharded parameter's TP layout (the leaf is that DTensor), or NULL */
  int64_t uoff;         /* offset in the unsharded buffer */
  int ready;            /* got its gradient in this backward */
  int in_rs;            /* its gradient is in the group's reduce-scatter (in flight until rs_finish) */
  int in_partial;       /* HSDP: its gradient is in g->partial (reduce-scattered, not all-reduced yet) */
  int packed;           /* its gradient is already in g->rs_in (packed as it arrived) */
} fparam;

struct eng_fsdp_group {
  int32_t refcount;
  eng_mesh* mesh;
  eng_pg* pg;           /* shard group */
  eng_pg* rep_pg;       /* replicate group (HSDP) or NULL */
  eng_pg* post_pg;      /* post-forward subgroup (reshard_after_forward = N) or NULL */
  int W, rank, dp_size;
  int dev;              /* the mesh's device: unsharded parameters, collective buffers, compute */
  int offload, pin;     /* CPUOffloadPolicy on a CUDA mesh: the sharded parameters and their .grad live on the
                         * CPU (pinned host memory with pin: the runtime then copies them by DMA, unstaged) */
  int n;
  fparam* p;
  int64_t chunk;        /* elements of one rank's chunk */
  int64_t chunk_n;      /* the same in the post-forward layout (N ranks) */
  eng_mesh* post_mesh;  /* (dp/N, N) mesh of the post-forward layout, or NULL */
  int64_t utotal;       /* elements of the unsharded buffer */
  int udtype;           /* dtype of the unsharded buffer */
  eng_tensor* ubase;    /* 1-D tensor over the unsharded buffer */
  int param_dtype, reduce_dtype, output_dtype, cast_inputs;
  int state;
  /* all-gather in flight */
  eng_work* ag_work; eng_tensor* ag_in; eng_tensor* ag_out; int ag_L;
  eng_tensor* kept;     /* ST_POST_FWD: this rank's chunk of the unsharded parameters chunked over the N-rank
                         * post-forward subgroup (torch.chunk over N: ceil(size/N) rows each, padded; chunk_n) */
  /* reduce-scatter in flight */
  eng_work* rs_work; eng_tensor* rs_in; eng_tensor* rs_out;
  eng_tensor* partial;  /* HSDP with requires_all_reduce off: the sum of the reduce-scatter outputs not all-reduced
                         * over the replicas yet (reduce dtype, g->chunk elements, not divided); the next reduction
                         * with all-reduce on adds it before its all-reduce (PyTorch's partial reduce output) */
  int64_t* blocks;      /* gather_in_place's block table (src_off | lens | dst_off), made on first use */
  eng_tensor* flat;     /* this rank's chunk (g->chunk elements) whose blocks the sharded parameters' local shards
                         * view (alias_shards), or NULL: a synchronous unshard sends it without a copy-in */
  int raf, rab, sync, all_reduce, is_last;
  /* CUDA meshes: implicit prefetch of the next group and reduce-scatters left in flight (NCCL runs them on
   * its stream beside the compute).  CPU meshes: neither by default (no MPI progress thread: a pending
   * collective advances only inside MPI calls, so both only held an extra group's buffers; measured by
   * recipes/bench/fsdp_memory.lua); ENGINE_FSDP_PREFETCH=1 / ENGINE_FSDP_ASYNC_REDUCE=1 turn them on, and
   * explicit prefetch lists always run. */
  int implicit_prefetch, async_reduce;
  double divide;
  /* per backward */
  int pre_done, post_done, n_ready;
  int64_t n_ag, n_rs;
  /* tree */
  eng_fsdp_group* root;  /* weak */
  eng_fsdp_group** tree; int n_tree, cap_tree;   /* root only: every group (retained) */
  eng_fsdp_group** fwd_order; int n_fwd, cap_fwd;   /* root only: last forward's pre-forward order (weak) */
  eng_fsdp_group** cur_fwd; int n_cur, cap_cur;
  eng_fsdp_group** post_order; int n_post, cap_post; /* root only: post-forward order of this forward */
  int cb_queued;        /* root: end-of-backward callback queued */
  eng_fsdp_group** fwd_prefetch; int n_fwd_prefetch, explicit_fwd;
  eng_fsdp_group** bwd_prefetch; int n_bwd_prefetch, explicit_bwd;
  eng_module* module;   /* weak */
  int64_t h_pre, h_post;
  int64_t* post_hooks;
};

/* ---------------------------------------------------------------- helpers */
static int push(eng_fsdp_group*** arr, int* n, int* cap, eng_fsdp_group* g) {
  if (*n == *cap) {
    int c = *cap ? *cap * 2 : 8;
    eng_fsdp_group** a = realloc(*arr, (size_t)c * sizeof *a);
    if (!a) return eng_err("fully_shard: out of memory");
    *arr = a; *cap = c;
  }
  (*arr)[(*n)++] = g;
  return 0;
}

static int eff_param_dtype(const eng_fsdp_group* g, const fparam* q) {
  return g->param_dtype >= 0 ? g->param_dtype : q->sharded->dtype;
}
static int eff_reduce_dtype(const eng_fsdp_group* g) {
  if (g->reduce_dtype >= 0) return g->reduce_dtype;
  return g->udtype;
}

/* Rows of chunk c on the shard dim in layout L (torch.chunk: ceil-sized, the last ones short or empty). */
static int64_t rows_of(const fparam* q, int64_t c, int L) {
  int64_t r = q->shape[q->dim] - c * q->ceil_d[L];
  return r < 0 ? 0 : (r > q->ceil_d[L] ? q->ceil_d[L] : r);
}

/* View of parameter q's block in chunk c of buf (chunk laid out as the
 * parameter's shape with ceil_d rows on dim, contiguous), its first rows
 * rows on dim. */
static eng_tensor* block_view(eng_tensor* buf, int64_t chunk_index, int64_t chunk, const fparam* q, int64_t rows, int L) {
  int64_t sh[8], st[8];
  for (int d = 0; d < q->ndim; d++) sh[d] = q->shape[d];
  sh[q->dim] = q->ceil_d[L];
  eng_contiguous_strides(q->ndim, sh, st);
  sh[q->dim] = rows;
  return eng_view_of(buf, q->ndim, sh, st, buf->offset + chunk_index * chunk + q->coff[L]);
}

/* View of rows [r0, r0+rows) on dim of a full (unsharded-shape) tensor t. */
static eng_tensor* rows_view(eng_tensor* t, const fparam* q, int64_t r0, int64_t rows) {
  int64_t sh[8];
  for (int d = 0; d < q->ndim; d++) sh[d] = t->shape[d];
  sh[q->dim] = rows;
  return eng_view_of(t, q->ndim, sh, t->stride, t->offset + r0 * t->stride[q->dim]);
}

/* dst <- src (both released), converting dtype; across devices (CPU offload: a sharded parameter on the host
 * into the all-gather's send buffer on the device, the reduce-scatter's output back into the host gradient)
 * ONE host<->device copy: straight into dst when both are contiguous and of one dtype, else src is moved
 * contiguous to dst's device and copied there. */
static int copy_into(eng_tensor* dst, eng_tensor* src) {
  if (!dst || !src) { eng_tensor_release(dst); eng_tensor_release(src); return -1; }
  int rc = 0;
  if (dst->numel > 0 && dst->device != src->device) {
    if (dst->dtype == src->dtype && eng_tensor_is_contiguous(dst) && eng_tensor_is_contiguous(src)) {
      int64_t nb = dst->numel * (int64_t)eng_dtype_size(dst->dtype);
      rc = dst->device == ENG_CUDA ? eng_cuda_memcpy_h2d(eng_ptr(dst), eng_ptr(src), nb)
                                   : eng_cuda_memcpy_d2h(eng_ptr(dst), eng_ptr(src), nb);
      eng_tensor_release(dst); eng_tensor_release(src);
      if (rc) eng_err_prefix("FSDP CPU offload copy");
      return rc;
    }
    eng_tensor* moved = eng_tensor_to_device(src, dst->device);
    eng_tensor_release(src);
    if (!moved) { eng_tensor_release(dst); return -1; }
    src = moved;
  }
  rc = dst->numel > 0 ? eng_copy_raw(dst, src, src->stride) : 0;
  eng_tensor_release(dst); eng_tensor_release(src);
  return rc;
}

/* Packs chunks [c0, c0+nc) of layout L of parameter i's full tensor (NULL: zeros) into buf. */
static int pack_param(eng_fsdp_group* g, int L, int i, eng_tensor* full, eng_tensor* buf, int64_t c0, int64_t nc) {
  int64_t chunk = L ? g->chunk_n : g->chunk;
  fparam* q = &g->p[i];
  for (int64_t c = c0; c < c0 + nc; c++) {
    int64_t rows = rows_of(q, c, L);
    if (full) {
      if (copy_into(block_view(buf, c - c0, chunk, q, rows, L), rows_view(full, q, c * q->ceil_d[L], rows))) return -1;
    } else {
      eng_tensor* v = block_view(buf, c - c0, chunk, q, q->ceil_d[L], L);
      if (!v) return -1;
      int rc = v->numel ? eng_tensor_zero_(v) : 0;
      eng_tensor_release(v);
      if (rc) return -1;
    }
  }
  return 0;
}

/* Packs chunks [c0, c0+nc) of layout L of the full tensors full[i] (NULL: zeros) into buf. */
static int pack_full(eng_fsdp_group* g, int L, eng_tensor** full, eng_tensor* buf, int64_t c0, int64_t nc) {
  for (int i = 0; i < g->n; i++)
    if (pack_param(g, L, i, full[i], buf, c0, nc)) return -1;
  return 0;
}

/* Copies chunks [c0, c0+nc) of layout L of buf out into the full tensors full[i]. */
static int unpack_full(eng_fsdp_group* g, int L, eng_tensor* buf, int64_t c0, int64_t nc, eng_tensor** full) {
  int64_t chunk = L ? g->chunk_n : g->chunk;
  for (int64_t c = c0; c < c0 + nc; c++)
    for (int i = 0; i < g->n; i++) {
      fparam* q = &g->p[i];
      int64_t rows = rows_of(q, c, L);
      if (copy_into(rows_view(full[i], q, c * q->ceil_d[L], rows), block_view(buf, c - c0, chunk, q, rows, L))) return -1;
    }
  return 0;
}

static void free_tensor(eng_tensor** t) { eng_tensor_release(*t); *t = NULL; }

static void drop_post(eng_fsdp_group* g) {
  free_tensor(&g->kept);
  for (int i = 0; i < g->n; i++) free_tensor(&g->p[i].post);
}

/* ---------------------------------------------------------------- unshard / reshard */
static int ensure_leaves(eng_fsdp_group* g);

/* 1 when every sharded parameter still views its block of g->flat (set_data or a dtype change since breaks it:
 * the unshard then packs the send buffer as usual). */
static int shards_aliased(const eng_fsdp_group* g) {
  if (!g->flat || g->flat->dtype != g->udtype || g->flat->device != g->dev) return 0;
  for (int i = 0; i < g->n; i++) {
    const eng_tensor* s = g->p[i].sharded;
    if (s->numel == 0) continue;
    if (s->storage != g->flat->storage || s->offset != g->flat->offset + g->p[i].coff[0] || s->dtype != g->flat->dtype ||
        !eng_tensor_is_contiguous(s))
      return 0;
  }
  return 1;
}

/* Makes the sharded parameters' local shards views of one flat buffer laid out as this rank's all-gather chunk
 * (each parameter's block, padding rows after it), at group creation, before anything else views them; where a
 * block's layout is not the shard's contiguous one (uneven rows on a dim other than the first), with mixed
 * precision (the send buffer is of param_dtype) or CPU offload, nothing changes.  Saves the copy-in of every
 * unshard (the reference GPT at 2 ranks: 9 a step, half the parameters' bytes each). */
static void alias_shards(eng_fsdp_group* g) {
  if (g->n == 0 || g->offload) return;
  int ud = eff_param_dtype(g, &g->p[0]);
  for (int i = 0; i < g->n; i++) {
    const eng_tensor* s = g->p[i].sharded;
    if (!s->dist || !s->dist->member || s->dtype != ud || eff_param_dtype(g, &g->p[i]) != ud || s->device != g->dev ||
        s->grad || s->grad_fn || (s->numel > 0 && !eng_tensor_is_contiguous(s)))
      return;
  }
  eng_tensor* flat = eng_new(1, &g->chunk, ud, g->dev);
  if (!flat || (g->chunk > 0 && eng_tensor_zero_(flat))) { eng_tensor_release(flat); eng_clear_error(); return; }
  eng_tensor** views = calloc((size_t)g->n, sizeof *views);
  int ok = views != NULL;
  for (int i = 0; i < g->n && ok; i++) {
    fparam* q = &g->p[i];
    eng_tensor* s = q->sharded;
    views[i] = block_view(flat, 0, g->chunk, q, s->shape[q->dim], 0);
    if (!views[i]) { ok = 0; break; }
    for (int d = 0; d < s->ndim; d++)
      if (s->shape[d] > 1 && views[i]->stride[d] != s->stride[d]) ok = 0;
    if (ok && s->numel > 0)
      ok = copy_into(eng_tensor_retain(views[i]), eng_view_of(s, s->ndim, s->shape, s->stride, s->offset)) == 0;
  }
  for (int i = 0; i < g->n && ok; i++)
    if (g->p[i].sharded->numel > 0 && eng_tensor_set_data(g->p[i].sharded, views[i])) ok = 0;
  for (int i = 0; views && i < g->n; i++) eng_tensor_release(views[i]);
  free(views);
  if (ok) g->flat = flat;
  else { eng_tensor_release(flat); eng_clear_error(); }
}

/* The unshard's all-gather straight into the unsharded buffer (eng_pg_gather_blocks, single copy on one node):
 * CPU groups without mixed precision, offload or TP whose parameters are sharded on their first dim (each rank's
 * rows of a parameter are one range of it); a rank whose shards no longer view g->flat makes every rank take the
 * MPI all-gather.  No gathered buffer and no copy-out: the reference GPT's step at 2 ranks all-gathers 9 groups
 * of 3 MB.  0 done, 1 not taken (the MPI all-gather follows), -1 error. */
static int gather_in_place(eng_fsdp_group* g) {
  if (g->dev != ENG_CPU || g->offload || g->n == 0) return 1;
  for (int i = 0; i < g->n; i++) {
    const fparam* q = &g->p[i];
    if (q->dim != 0 || q->uspec || q->sharded->dtype != g->udtype) return 1; /* the same on every rank */
  }
  int W = g->W;
  if (!g->blocks) { /* the layout is fixed at fully_shard: one table per group */
    int64_t* a = malloc(sizeof(int64_t) * (size_t)g->n * (1 + 2 * (size_t)W));
    if (!a) return eng_err("fully_shard: out of memory");
    for (int i = 0; i < g->n; i++) {
      const fparam* q = &g->p[i];
      int64_t rowlen = 1;
      for (int d = 1; d < q->ndim; d++) rowlen *= q->shape[d];
      a[i] = q->coff[0];
      for (int r = 0; r < W; r++) {
        a[g->n + (size_t)i * W + r] = rows_of(q, r, 0) * rowlen;
        a[g->n + (size_t)g->n * W + (size_t)i * W + r] = q->uoff + r * q->ceil_d[0] * rowlen;
      }
    }
    g->blocks = a;
  }
  const int64_t *src_off = g->blocks, *lens = g->blocks + g->n, *dst_off = g->blocks + g->n + (size_t)g->n * W;
  int elig = shards_aliased(g);
  int32_t v = g->ubase->storage->version; /* as the copy-out: the aliases autograd saved stay valid */
  int rc = eng_pg_gather_blocks(g->pg, "FSDP unshard", g->udtype, elig ? eng_ptr(g->flat) : NULL, g->chunk, g->n,
                                src_off, lens, dst_off, eng_ptr(g->ubase), g->utotal, elig);
  g->ubase->storage->version = v;
  return rc;
}

static int alloc_unsharded(eng_fsdp_group* g) {
  if (ensure_leaves(g)) return -1;
  return eng_storage_alloc_data(g->ubase->storage, g->utotal * (int64_t)eng_dtype_size(g->udtype));
}

/* Copies the gathered chunks into the unsharded buffer, keeping its version
 * counter (the aliases autograd saved stay valid: the data is the same). */
static int ag_copy_out(eng_fsdp_group* g, eng_tensor* gathered, int L) {
  int32_t v = g->ubase->storage->version;
  eng_tensor** leaves = malloc((size_t)(g->n ? g->n : 1) * sizeof *leaves);
  if (!leaves) return eng_err("fully_shard: out of memory");
  for (int i = 0; i < g->n; i++) leaves[i] = g->p[i].leaf;
  int rc = unpack_full(g, L, gathered, 0, L ? eng_pg_size(g->post_pg) : g->W, leaves);
  free(leaves);
  g->ubase->storage->version = v;
  return rc;
}

/* The unshard of a shard group of one rank: each local shard copied (cast to param_dtype, moved to the mesh's
 * device) into its unsharded parameter; the version counter kept as ag_copy_out keeps it. */
static int unshard_local(eng_fsdp_group* g) {
  int32_t v = g->ubase->storage->version;
  int rc = 0;
  for (int i = 0; i < g->n && !rc; i++) {
    fparam* q = &g->p[i];
    eng_tensor* s = q->sharded;
    if (s->numel == 0) continue;
    rc = copy_into(rows_view(q->leaf, q, 0, q->shape[q->dim]), eng_view_of(s, s->ndim, s->shape, s->stride, s->offset));
  }
  g->ubase->storage->version = v;
  return rc;
}

static int ag_finish(eng_fsdp_group* g) {
  if (!g->ag_out) return 0;
  int rc = 0;
  if (g->ag_work) { rc = eng_work_wait(g->ag_work); eng_work_release(g->ag_work); g->ag_work = NULL; }
  if (!rc) rc = ag_copy_out(g, g->ag_out, g->ag_L);
  free_tensor(&g->ag_in); free_tensor(&g->ag_out);
  if (rc) { eng_err_prefix("FSDP unshard"); return -1; }
  drop_post(g);
  g->state = ST_UNSHARDED;
  return 0;
}

int eng_fsdp_group_unshard(eng_fsdp_group* g, int async_op) {
  if (!g) return eng_err("unshard: group is NULL");
  if (g->state == ST_UNSHARDED) return 0;
  if (g->ag_out) return async_op ? 0 : ag_finish(g);
  if (g->n == 0) { g->state = ST_UNSHARDED; return 0; }
  int prev = eng_set_grad_enabled(0);
  int rc = -1;
  if (alloc_unsharded(g)) goto out;
  int dev = g->dev;
  int L = g->state == ST_POST_FWD && g->kept ? 1 : 0;
  if (!L && g->W == 1) {
    /* a shard group of one rank: its local shards are the whole parameters (nothing to all-gather) */
    if (unshard_local(g)) { eng_err_prefix("FSDP unshard"); goto out; }
    drop_post(g);
    g->state = ST_UNSHARDED;
    rc = 0;
    goto out;
  }
  if (!L && !async_op) {
    int ip = gather_in_place(g);
    if (ip < 0) { eng_err_prefix("FSDP unshard (all_gather)"); goto out; }
    if (ip == 0) {
      g->n_ag++;
      drop_post(g);
      g->state = ST_UNSHARDED;
      rc = 0;
      goto out;
    }
  }
  int64_t full = L ? (int64_t)eng_pg_size(g->post_pg) * g->chunk_n : (int64_t)g->W * g->chunk;
  g->ag_out = eng_new(1, &full, g->udtype, dev);
  if (!g->ag_out) goto out;
  g->ag_L = L;
  eng_pg* pg = g->pg;
  if (L) {
    pg = g->post_pg;
    g->ag_in = eng_tensor_retain(g->kept);
  } else if (!async_op && shards_aliased(g)) {
    /* the shards are the send buffer (an async unshard still snapshots them: the caller may change the
     * parameters before it waits, as with PyTorch's copy-in at issue) */
    g->ag_in = eng_tensor_retain(g->flat);
  } else {
    g->ag_in = eng_new(1, &g->chunk, g->udtype, dev);
    if (!g->ag_in) goto out;
    for (int i = 0; i < g->n; i++) {
      fparam* q = &g->p[i];
      eng_tensor* s = q->sharded;
      if (copy_into(block_view(g->ag_in, 0, g->chunk, q, s->shape[q->dim], 0),
                    eng_view_of(s, s->ndim, s->shape, s->stride, s->offset))) goto out;
    }
  }
  g->n_ag++;
  if (eng_pg_all_gather_into(pg, g->ag_out, g->ag_in, async_op ? &g->ag_work : NULL)) {
    eng_err_prefix("FSDP unshard (all_gather)");
    goto out;
  }
  rc = async_op ? 0 : ag_finish(g);
out:
  if (rc) { free_tensor(&g->ag_in); free_tensor(&g->ag_out); if (g->ag_work) { eng_work_release(g->ag_work); g->ag_work = NULL; } }
  eng_set_grad_enabled(prev);
  return rc;
}

int eng_fsdp_group_wait_unshard(eng_fsdp_group* g) {
  if (!g) return eng_err("unshard: group is NULL");
  int prev = eng_set_grad_enabled(0);
  int rc = ag_finish(g);
  eng_set_grad_enabled(prev);
  return rc;
}

int eng_fsdp_group_reshard(eng_fsdp_group* g) {
  if (!g) return eng_err("reshard: group is NULL");
  if (g->ag_out && ag_finish(g)) return -1;
  if (g->ubase) eng_storage_free_data(g->ubase->storage);
  drop_post(g);
  g->state = ST_SHARDED;
  return 0;
}

/* Keeps this rank's shard of the unsharded parameters over the post-forward
 * subgroup of N ranks (torch.chunk over N: the registered parameters become
 * [Replicate, Shard(d)] DTensors on the (dp/N, N) post-forward mesh, viewing
 * it) and frees the rest; the backward all-gather runs on the N ranks. */
static int reshard_post_forward(eng_fsdp_group* g) {
  if (g->state != ST_UNSHARDED || !g->post_pg || !g->post_mesh || g->n == 0) return eng_fsdp_group_reshard(g);
  int64_t j = eng_pg_rank(g->post_pg);
  eng_tensor* kept = eng_new(1, &g->chunk_n, g->udtype, g->dev);
  if (!kept) return -1;
  eng_tensor** leaves = malloc((size_t)g->n * sizeof *leaves);
  if (!leaves) { eng_tensor_release(kept); return eng_err("fully_shard: out of memory"); }
  for (int i = 0; i < g->n; i++) leaves[i] = g->p[i].leaf;
  int rc = pack_full(g, 1, leaves, kept, j, 1);
  free(leaves);
  for (int i = 0; i < g->n && !rc; i++) {
    fparam* q = &g->p[i];
    eng_placement pl[2] = { { ENG_PLACEMENT_REPLICATE, 0, 0, 0 }, { ENG_PLACEMENT_SHARD, q->dim, 0, 0 } };
    eng_dist_spec* sp = eng_dist_spec_new(g->post_mesh, 2, pl, q->ndim, q->shape, NULL);
    eng_tensor* v = sp ? block_view(kept, 0, g->chunk_n, q, rows_of(q, j, 1), 1) : NULL;
    if (!v || eng_dtensor_wrap_output(v, sp)) rc = -1;
    eng_dist_spec_release(sp);
    eng_tensor_release(q->post);
    q->post = rc ? NULL : v;
    if (rc) eng_tensor_release(v);
  }
  if (rc) { eng_tensor_release(kept); drop_post(g); return -1; }
  eng_storage_free_data(g->ubase->storage);
  g->kept = kept;
  g->state = ST_POST_FWD;
  return 0;
}

/* ---------------------------------------------------------------- gradients */
static int rs_finish(eng_fsdp_group* g) {
  if (!g->rs_out) return 0;
  int rc = 0;
  if (g->rs_work) { rc = eng_work_wait(g->rs_work); eng_work_release(g->rs_work); g->rs_work = NULL; }
  free_tensor(&g->rs_in);
  if (!rc && g->rep_pg) {
    /* HSDP: the reduce-scatters run with all-reduce off (set_requires_all_reduce(false)) summed so far join this
     * output before its all-reduce, so that every microbatch reaches the other replicas */
    if (g->partial) {
      rc = eng_add_(g->rs_out, g->partial, 1.0);
      free_tensor(&g->partial);
      for (int i = 0; i < g->n; i++) {
        if (g->p[i].in_partial) g->p[i].in_rs = 1;
        g->p[i].in_partial = 0;
      }
    }
    if (!rc && !g->all_reduce) {
      /* all-reduce off: keep the replica's partial sum (not divided) for the next all-reduce; .grad waits */
      g->partial = g->rs_out;
      g->rs_out = NULL;
      for (int i = 0; i < g->n; i++) {
        if (g->p[i].in_rs) g->p[i].in_partial = 1;
        g->p[i].in_rs = 0;
      }
      return 0;
    }
    if (!rc && eng_pg_size(g->rep_pg) > 1) rc = eng_pg_all_reduce(g->rep_pg, g->rs_out, ENG_REDUCE_SUM, NULL);
  }
  double scale = g->divide > 0 ? 1.0 / g->divide : 1.0 / g->dp_size;
  /* where every gradient is of the reduce dtype and on the output's device (no mixed precision, no CPU
   * offload), the sharded gradients ARE views of the output: one in-place scaling pass over it, no copy and no
   * allocation per parameter (the views keep the output's storage) */
  int views = !rc;
  for (int i = 0; i < g->n && views; i++) {
    const eng_tensor* s = g->p[i].sharded;
    if (g->p[i].in_rs && (s->dtype != g->rs_out->dtype || s->device != g->rs_out->device || g->pin)) views = 0;
  }
  if (views && scale != 1.0 && g->rs_out->numel > 0) rc = eng_mul_scalar_(g->rs_out, scale);
  int prev_local = eng_dtensor_set_local_mode(1);
  for (int i = 0; i < g->n && !rc; i++) {
    fparam* q = &g->p[i];
    if (!q->in_rs) continue;
    q->in_rs = 0;
    eng_tensor* s = q->sharded;
    eng_tensor* gl;
    if (views) {
      gl = block_view(g->rs_out, 0, g->chunk, q, s->shape[q->dim], 0);
      if (!gl) { rc = -1; break; }
    } else {
      /* CPU offload: the gradient goes to the host (pinned with pin_memory), where the optimizer steps */
      gl = g->pin && s->device == ENG_CPU && !s->grad ? eng_new_pinned(s->ndim, s->shape, s->dtype)
                                                     : eng_new(s->ndim, s->shape, s->dtype, s->device);
      if (!gl) { rc = -1; break; }
      if (copy_into(eng_tensor_retain(gl), block_view(g->rs_out, 0, g->chunk, q, s->shape[q->dim], 0)) ||
          (scale != 1.0 && eng_mul_scalar_(gl, scale))) { eng_tensor_release(gl); rc = -1; break; }
    }
    eng_tensor* old = s->grad;
    if (old) {
      eng_tensor* ov = eng_view_of(old, old->ndim, old->shape, old->stride, old->offset);
      rc = ov ? eng_add_(ov, gl, 1.0) : -1;
      eng_tensor_release(ov);
      eng_tensor_release(gl);
    } else {
      rc = eng_dtensor_wrap_output(gl, s->dist);
      if (!rc) rc = eng_tensor_set_grad(s, gl);
      eng_tensor_release(gl);
    }
  }
  eng_dtensor_set_local_mode(prev_local);
  free_tensor(&g->rs_out);
  if (rc) eng_err_prefix("FSDP post-backward (reduce_scatter)");
  return rc;
}

/* Reduces the accumulated gradients (when syncing) and reshards. */
static int post_backward(eng_fsdp_group* g) {
  if (g->post_done) return 0;
  g->post_done = 1;
  int rc = 0;
  int any = 0;
  for (int i = 0; i < g->n; i++) if (g->p[i].acc) any = 1;
  /* every gradient of the group is in: the unsharded parameters are not needed any more (free them before the
   * reduce-scatter's buffers are made) */
  if (g->rab && g->root != g && eng_fsdp_group_reshard(g)) return -1;
  if (g->sync && g->n > 0) {
    /* every rank reduces when any parameter of the group takes gradients (the
     * same decision everywhere: it depends on requires_grad only) */
    int want = 0;
    for (int i = 0; i < g->n; i++) if (g->p[i].leaf && g->p[i].leaf->requires_grad) want = 1;
    if (want) {
      if (g->rs_out && rs_finish(g)) return -1;
      int rd = eff_reduce_dtype(g);
      int dev = g->dev;
      int64_t full = (int64_t)g->W * g->chunk;
      /* the send buffer: filled as the gradients arrived (post_acc_hook), or made now */
      if (!g->rs_in) g->rs_in = eng_new(1, &full, rd, dev);
      /* a shard group of one rank: the packed gradients are the output (nothing to reduce-scatter) */
      g->rs_out = !g->rs_in ? NULL : g->W == 1 ? eng_tensor_retain(g->rs_in) : eng_new(1, &g->chunk, rd, dev);
      rc = g->rs_out ? 0 : -1;
      for (int i = 0; i < g->n && !rc; i++) {
        fparam* q = &g->p[i];
        q->in_rs = q->acc != NULL || q->packed;
        if (!q->packed) rc = pack_param(g, 0, i, q->acc, g->rs_in, 0, g->W);
      }
      for (int i = 0; i < g->n; i++) { free_tensor(&g->p[i].acc); g->p[i].packed = 0; }
      if (!rc) {
        /* at most one reduce-scatter in flight in the tree: its send buffer is a whole group's gradients,
         * and MPI progresses a pending collective only inside MPI calls (no progress thread), so waiting
         * later would only hold the memory longer */
        eng_fsdp_group* r = g->root ? g->root : g;
        for (int k = 0; k < r->n_tree && !rc; k++)
          if (r->tree[k] != g && r->tree[k]->rs_out) rc = rs_finish(r->tree[k]);
      }
      if (!rc && g->W > 1) {
        g->n_rs++;
        rc = eng_pg_reduce_scatter_into(g->pg, g->rs_out, g->rs_in, ENG_REDUCE_SUM, &g->rs_work);
        if (rc) eng_err_prefix("FSDP post-backward (reduce_scatter)");
      }
      if (!rc && (g->W == 1 || !g->async_reduce)) rc = rs_finish(g);
      if (rc) { free_tensor(&g->rs_in); free_tensor(&g->rs_out); }
    }
  }
  (void)any;
  if (!rc && g->rab && g->root != g) rc = eng_fsdp_group_reshard(g);
  return rc;
}

static int root_final(void* ud);

static int queue_final(eng_fsdp_group* g) {
  eng_fsdp_group* r = g->root ? g->root : g;
  if (r->cb_queued || !eng_autograd_in_backward()) return 0;
  if (eng_autograd_queue_callback(root_final, r)) return -1;
  r->cb_queued = 1;
  return 0;
}

static int post_acc_hook(eng_tensor* t, eng_tensor* grad, eng_tensor** out, void* ud) {
  (void)grad; (void)out;
  eng_fsdp_group* g = ud;
  int i = 0;
  while (i < g->n && g->p[i].leaf != t) i++;
  if (i == g->n || !t->grad) return 0;
  fparam* q = &g->p[i];
  if (queue_final(g)) return -1;
  int rd = eff_reduce_dtype(g);
  eng_tensor* gv = t->grad;
  /* a TP leaf's gradient is a DTensor in the leaf's layout: reduce its local tensor over dp */
  eng_tensor* gr = gv->dist ? eng_view_of(gv, gv->ndim, gv->shape, gv->stride, gv->offset) : eng_tensor_retain(gv);
  if (!gr) return -1;
  int rc = 0;
  if (g->sync && !q->acc && !q->packed && !g->post_done) {
    /* pack it into the reduce-scatter's send buffer now and free it: the group's full gradients and the
     * packed copy are never held together */
    if (g->rs_out && rs_finish(g)) { eng_tensor_release(gr); return -1; }  /* its buffer is in flight */
    if (!g->rs_in) {
      int64_t full = (int64_t)g->W * g->chunk;
      g->rs_in = eng_new(1, &full, rd, gr->device);
    }
    rc = g->rs_in ? pack_param(g, 0, i, gr, g->rs_in, 0, g->W) : -1;
    eng_tensor_release(gr);
    if (rc) return -1;
    q->packed = 1;
  } else if (!q->acc) {
    q->acc = gr->dtype == rd ? eng_tensor_retain(gr) : eng_tensor_to_dtype(gr, rd);
    eng_tensor_release(gr);
    if (!q->acc) return -1;
  } else {
    eng_tensor* c = gr->dtype == rd ? eng_tensor_retain(gr) : eng_tensor_to_dtype(gr, rd);
    eng_tensor_release(gr);
    if (!c) return -1;
    rc = eng_add_(q->acc, c, 1.0);
    eng_tensor_release(c);
    if (rc) return -1;
  }
  if (eng_tensor_set_grad(t, NULL)) return -1;
  if (!q->ready) { q->ready = 1; g->n_ready++; }
  int need = 0;
  for (int k = 0; k < g->n; k++) if (g->p[k].leaf->requires_grad) need++;
  if (g->n_ready >= need) return post_backward(g);
  return 0;
}

/* ---------------------------------------------------------------- backward-pre (identity node) */
static void prefetch_list(eng_fsdp_group** list, int n) {
  for (int i = 0; i < n; i++)
    if (list[i] && list[i]->state != ST_UNSHARDED && !list[i]->ag_out) eng_fsdp_group_unshard(list[i], 1);
}

static int pre_backward(eng_fsdp_group* g) {
  if (queue_final(g)) return -1;
  if (g->pre_done) return 0;
  g->pre_done = 1;
  for (int i = 0; i < g->n; i++) g->p[i].ready = 0;
  g->n_ready = 0;
  g->post_done = 0;
  if (eng_fsdp_group_unshard(g, 0)) return -1;
  if (g->explicit_bwd) prefetch_list(g->bwd_prefetch, g->n_bwd_prefetch);
  else if (g->implicit_prefetch) {
    eng_fsdp_group* r = g->root;
    if (r) for (int k = r->n_post - 1; k > 0; k--)
      if (r->post_order[k] == g) {
        eng_fsdp_group* prevg = r->post_order[k - 1];
        if (!prevg->pre_done) prefetch_list(&prevg, 1);
        break;
      }
  }
  return 0;
}

static int prebw_backward(eng_node* nd, eng_tensor** go, eng_tensor** gi) {
  eng_fsdp_group* g = nd->ctx;
  int prev = eng_set_grad_enabled(0);
  int rc = pre_backward(g);
  eng_set_grad_enabled(prev);
  if (rc) return -1;
  gi[0] = go[0] ? eng_tensor_retain(go[0]) : NULL;
  return 0;
}

static void prebw_free(eng_node* nd) { eng_fsdp_group_release(nd->ctx); nd->ctx = NULL; }

/* Replaces *t (requiring grad) by an alias whose grad_fn runs the pre-backward hook. */
static int arm_backward(eng_fsdp_group* g, eng_tensor** t) {
  eng_node* nd = eng_node_new("FSDPPreBackward", prebw_backward, 1, t, 1);
  if (!nd) return -1;
  nd->ctx = eng_fsdp_group_retain(g);
  nd->free_ctx = prebw_free;
  eng_tensor* y = eng_tensor_detach(*t);
  if (!y || eng_node_set_output(nd, y, 0)) { eng_tensor_release(y); eng_node_release(nd); return -1; }
  eng_node_release(nd);
  eng_tensor_release(*t);
  *t = y;
  return 0;
}

/* ---------------------------------------------------------------- forward hooks */
static int cast_floating(eng_tensor** ts, int n, int dtype) {
  for (int i = 0; i < n; i++) {
    eng_tensor* t = ts[i];
    if (!t || dtype < 0 || t->dtype == dtype || !eng_dtype_is_floating(t->dtype)) continue;
    eng_tensor* c = eng_tensor_to_dtype(t, dtype);
    if (!c) return -1;
    eng_tensor_release(t);
    ts[i] = c;
  }
  return 0;
}

static int in_list(eng_fsdp_group** a, int n, eng_fsdp_group* g) {
  for (int i = 0; i < n; i++) if (a[i] == g) return 1;
  return 0;
}

int eng_fsdp_group_pre_forward(eng_fsdp_group* g, eng_tensor** ts, int n) {
  eng_fsdp_group* r = g->root;
  int in_bw = eng_autograd_in_backward();
  int prev = eng_set_grad_enabled(0);
  int rc = 0;
  if (r == g && !in_bw) {
    /* a new forward of the root: the last one's order drives this one's implicit prefetch */
    if (g->n_cur > 0) {
      eng_fsdp_group** t = g->fwd_order; g->fwd_order = g->cur_fwd; g->cur_fwd = t;
      int tc = g->cap_fwd; g->cap_fwd = g->cap_cur; g->cap_cur = tc;
      g->n_fwd = g->n_cur;
    }
    g->n_cur = 0;
    g->n_post = 0;
  }
  if (r && !in_bw && !in_list(r->cur_fwd, r->n_cur, g)) rc = push(&r->cur_fwd, &r->n_cur, &r->cap_cur, g);
  if (!rc) rc = eng_fsdp_group_unshard(g, 0);
  if (!rc && !in_bw) {
    if (g->explicit_fwd) prefetch_list(g->fwd_prefetch, g->n_fwd_prefetch);
    else if (r && g->implicit_prefetch) {
      for (int k = 0; k + 1 < r->n_fwd; k++)
        if (r->fwd_order[k] == g) { prefetch_list(&r->fwd_order[k + 1], 1); break; }
    }
  }
  eng_set_grad_enabled(prev);
  if (rc) return -1;
  /* the root moves plain inputs to the mesh's device; cast_forward_inputs */
  if (r == g) {
    int dev = eng_mesh_device(g->mesh);
    for (int i = 0; i < n; i++)
      if (ts[i] && !ts[i]->dist && ts[i]->device != dev && ts[i]->device != ENG_META) {
        eng_tensor* c = eng_tensor_to_device(ts[i], dev);
        if (!c) return -1;
        eng_tensor_release(ts[i]); ts[i] = c;
      }
  }
  if (g->cast_inputs && g->param_dtype >= 0 && cast_floating(ts, n, g->param_dtype)) return -1;
  return 0;
}

int eng_fsdp_group_post_forward(eng_fsdp_group* g, eng_tensor** ts, int n) {
  eng_fsdp_group* r = g->root;
  int in_bw = eng_autograd_in_backward();
  if (g->output_dtype >= 0 && cast_floating(ts, n, g->output_dtype)) return -1;
  int grad = eng_grad_enabled();
  if (r && !in_bw && !in_list(r->post_order, r->n_post, g) && push(&r->post_order, &r->n_post, &r->cap_post, g)) return -1;
  if (grad) {
    int prev = eng_set_grad_enabled(0);
    int rc = 0;
    for (int i = 0; i < n && !rc; i++)
      if (ts[i] && ts[i]->requires_grad) rc = arm_backward(g, &ts[i]);
    eng_set_grad_enabled(prev);
    if (rc) return -1;
    if (in_bw) return 0;  /* a recompute inside backward: keep them for the backward that follows */
    if (g->raf == 0) return 0;  /* (a root keeps its parameters by default: its lazy init sets false) */
    if (g->raf > 1) return reshard_post_forward(g);
    return eng_fsdp_group_reshard(g);
  }
  if (in_bw) return 0;
  return eng_fsdp_group_reshard(g);
}

static int hook_pre(eng_module* m, int kind, eng_tensor** ts, int n, void* ud) {
  (void)m; (void)kind;
  return eng_fsdp_group_pre_forward(ud, ts, n);
}

static int hook_post(eng_module* m, int kind, eng_tensor** ts, int n, void* ud) {
  (void)m; (void)kind;
  return eng_fsdp_group_post_forward(ud, ts, n);
}

/* ---------------------------------------------------------------- end of backward (root) */
/* set_is_last_backward(false) (the seed's meaning): the root's end of backward does not wait for the
 * reductions still in flight (reduce_scatters left async: set_overlap's async_reduce, the CUDA default) nor
 * for prefetched all-gathers; their gradients land in .grad when the next backward (or
 * eng_fsdp_group_wait_reductions) finishes them. */
static int root_final(void* ud) {
  eng_fsdp_group* r = ud;
  int rc = 0;
  r->cb_queued = 0;
  for (int k = 0; k < r->n_tree; k++) {
    eng_fsdp_group* g = r->tree[k];
    if (g->n_ready > 0 && !g->post_done && post_backward(g) && !rc) rc = -1;
  }
  for (int k = 0; k < r->n_tree; k++) {
    eng_fsdp_group* g = r->tree[k];
    if (r->is_last && rs_finish(g) && !rc) rc = -1;
    if (r->is_last && g->ag_out && ag_finish(g) && !rc) rc = -1;
    if (g->rab && g->state != ST_SHARDED && eng_fsdp_group_reshard(g) && !rc) rc = -1;
    g->pre_done = 0; g->post_done = 0; g->n_ready = 0;
    for (int i = 0; i < g->n; i++) g->p[i].ready = 0;
  }
  return rc;
}

/* ---------------------------------------------------------------- construction */
static int ensure_leaves(eng_fsdp_group* g) {
  int ud = g->n ? eff_param_dtype(g, &g->p[0]) : 0;
  for (int i = 1; i < g->n; i++)
    if (eff_param_dtype(g, &g->p[i]) != ud)
      return eng_err("fully_shard: the parameters of one group must share a dtype (got %s and %s)",
                     eng_dtype_name(ud), eng_dtype_name(eff_param_dtype(g, &g->p[i])));
  if (g->ubase && g->udtype == ud) {
    /* requires_grad_ on a sharded parameter after fully_shard: its leaf follows (and takes the hook) */
    for (int i = 0; i < g->n; i++)
      if (g->p[i].leaf->requires_grad != g->p[i].sharded->requires_grad) {
        if (eng_tensor_set_requires_grad(g->p[i].leaf, g->p[i].sharded->requires_grad)) return -1;
        if (g->p[i].leaf->requires_grad && g->post_hooks[i] <= 0) {
          g->post_hooks[i] = eng_tensor_register_post_accumulate_hook(g->p[i].leaf, post_acc_hook, g);
          if (g->post_hooks[i] < 0) return -1;
        }
      }
    return 0;
  }
  /* (re)build: first use, or the parameters changed dtype (module:to) */
  for (int i = 0; i < g->n; i++) {
    if (g->p[i].leaf && g->post_hooks && g->post_hooks[i] > 0) eng_tensor_remove_hook(g->p[i].leaf, g->post_hooks[i]);
    if (g->post_hooks) g->post_hooks[i] = 0;
    free_tensor(&g->p[i].leaf);
  }
  free_tensor(&g->ubase);
  g->udtype = ud;
  int64_t tot = g->utotal > 0 ? g->utotal : 1;
  g->ubase = eng_new(1, &tot, ud, g->dev);
  if (!g->ubase) return -1;
  if (!g->post_hooks) g->post_hooks = calloc((size_t)(g->n ? g->n : 1), sizeof *g->post_hooks);
  if (!g->post_hooks) return eng_err("fully_shard: out of memory");
  for (int i = 0; i < g->n; i++) {
    fparam* q = &g->p[i];
    int64_t st[8];
    eng_contiguous_strides(q->ndim, q->shape, st);
    q->leaf = eng_view_of(g->ubase, q->ndim, q->shape, st, q->uoff);
    if (!q->leaf) return -1;
    if (q->uspec && eng_dtensor_wrap_output(q->leaf, q->uspec)) return -1;
    /* frozen parameters (requires_grad false) take no hook: the group's gradients are complete when every
     * parameter that requires grad has its own (post_acc_hook counts those) */
    if (!q->sharded->requires_grad) continue;
    eng_tensor_set_requires_grad(q->leaf, 1);
    g->post_hooks[i] = eng_tensor_register_post_accumulate_hook(q->leaf, post_acc_hook, g);
    if (g->post_hooks[i] < 0) return -1;
  }
  eng_storage_free_data(g->ubase->storage);
  return 0;
}

eng_fsdp_group* eng_fsdp_group_new(eng_mesh* mesh, int n, eng_tensor** params, const int* fsdp_dims,
                                   eng_dist_spec** unsharded_specs, int param_dtype, int reduce_dtype,
                                   int output_dtype, int cast_forward_inputs) {
  if (!mesh) return eng_errp("fully_shard: mesh is NULL");
  int mnd = eng_mesh_ndim(mesh);
  if (mnd != 1 && mnd != 2) return eng_errp("fully_shard expects a 1D or 2D DeviceMesh but got a %dD mesh", mnd);
  if (n < 0 || (n > 0 && (!params || !fsdp_dims))) return eng_errp("fully_shard: bad parameter list");
  eng_fsdp_group* g = calloc(1, sizeof *g);
  if (!g) return eng_errp("fully_shard: out of memory");
  g->refcount = 1;
  g->mesh = eng_mesh_retain(mesh);
  g->pg = eng_mesh_get_group(mesh, mnd - 1);
  if (g->pg) eng_pg_retain(g->pg);
  if (mnd == 2) { g->rep_pg = eng_mesh_get_group(mesh, 0); if (g->rep_pg) eng_pg_retain(g->rep_pg); }
  g->W = eng_mesh_size(mesh, mnd - 1);
  g->dp_size = g->W * (mnd == 2 ? eng_mesh_size(mesh, 0) : 1);
  g->rank = g->pg ? eng_pg_rank(g->pg) : 0;
  g->dev = eng_mesh_device(mesh);
  g->param_dtype = param_dtype; g->reduce_dtype = reduce_dtype; g->output_dtype = output_dtype;
  g->cast_inputs = cast_forward_inputs;
  g->raf = 1; g->rab = 1; g->sync = 1; g->all_reduce = 1; g->is_last = 1;
  {
    int cuda = eng_mesh_device(mesh) == ENG_CUDA;
    const char* e1 = getenv("ENGINE_FSDP_PREFETCH");
    const char* e2 = getenv("ENGINE_FSDP_ASYNC_REDUCE");
    g->implicit_prefetch = e1 && *e1 ? atoi(e1) != 0 : cuda;
    g->async_reduce = e2 && *e2 ? atoi(e2) != 0 : cuda;
  }
  g->n = n;
  g->p = calloc((size_t)(n ? n : 1), sizeof *g->p);
  if (!g->p || !g->pg) { eng_err("fully_shard: out of memory"); goto fail; }
  for (int i = 0; i < n; i++) {
    eng_tensor* s = params[i];
    fparam* q = &g->p[i];
    if (!s || !s->dist) { eng_err("fully_shard: parameter %d is not a DTensor", i + 1); goto fail; }
    eng_dist_spec* sp = s->dist;
    int fd = fsdp_dims[i];
    if (fd < 0 || fd >= sp->mesh_ndim) { eng_err("fully_shard: parameter %d: bad FSDP mesh dim %d", i + 1, fd); goto fail; }
    const eng_placement* pl = &sp->placements[fd];
    if ((pl->kind != ENG_PLACEMENT_SHARD && pl->kind != ENG_PLACEMENT_STRIDED_SHARD) ||
        (mnd == 2 && (fd < 1 || sp->placements[fd - 1].kind != ENG_PLACEMENT_REPLICATE))) {
      eng_err("fully_shard: parameter %d must be Shard on the FSDP mesh dim (Replicate before it for HSDP)", i + 1);
      goto fail;
    }
    if (s->numel > 0 && !eng_tensor_is_contiguous(s)) { eng_err("fully_shard: parameter %d's local shard is not contiguous", i + 1); goto fail; }
    /* its local shard lives on the mesh's device, or (CPU offload on a CUDA mesh) every one on the CPU */
    int off = s->device == ENG_CPU && g->dev == ENG_CUDA;
    if ((s->device != g->dev && !off) || (i > 0 && off != g->offload)) {
      eng_err("fully_shard: parameter %d's local shard %s is on %s on a %s mesh (the sharded parameters live on the "
              "mesh's device, or all on the CPU with CPUOffloadPolicy)", i + 1, eng_desc(s),
              s->device == ENG_CUDA ? "cuda" : "cpu", g->dev == ENG_CUDA ? "cuda" : "cpu");
      goto fail;
    }
    g->offload = off;
    eng_dist_spec* us = unsharded_specs ? unsharded_specs[i] : NULL;
    q->sharded = eng_tensor_retain(s);
    q->dim = pl->dim;
    q->ndim = sp->ndim;
    /* the unsharded parameter: the full tensor, or (FSDP over TP) the TP DTensor's local shard */
    for (int d = 0; d < q->ndim; d++) q->shape[d] = us ? us->local_shape[d] : sp->shape[d];
    if (us) q->uspec = eng_dist_spec_retain(us);
    q->ceil_d[0] = (q->shape[q->dim] + g->W - 1) / g->W;
    int64_t block = q->ceil_d[0];
    for (int d = 0; d < q->ndim; d++) if (d != q->dim) block *= q->shape[d];
    q->coff[0] = g->chunk;
    g->chunk += block;
    if (sp->member && s->shape[q->dim] != rows_of(q, g->rank, 0)) {
      eng_err("fully_shard: parameter %d: its local shard has %lld rows on dim %d where chunking the unsharded "
              "parameter over %d ranks gives %lld", i + 1, (long long)s->shape[q->dim], q->dim + 1, g->W,
              (long long)rows_of(q, g->rank, 0));
      goto fail;
    }
    q->uoff = g->utotal;
    g->utotal += sp->numel;
  }
  if (ensure_leaves(g)) goto fail;
  alias_shards(g);
  return g;
fail:
  eng_fsdp_group_release(g);
  return NULL;
}

eng_fsdp_group* eng_fsdp_group_retain(eng_fsdp_group* g) {
  if (g) __atomic_add_fetch(&g->refcount, 1, __ATOMIC_RELAXED);
  return g;
}

void eng_fsdp_group_release(eng_fsdp_group* g) {
  if (!g || __atomic_sub_fetch(&g->refcount, 1, __ATOMIC_ACQ_REL) != 0) return;
  if (g->ag_work) { eng_work_wait(g->ag_work); eng_work_release(g->ag_work); }
  if (g->rs_work) { eng_work_wait(g->rs_work); eng_work_release(g->rs_work); }
  eng_tensor_release(g->ag_in); eng_tensor_release(g->ag_out); eng_tensor_release(g->kept);
  eng_tensor_release(g->rs_in); eng_tensor_release(g->rs_out); eng_tensor_release(g->flat);
  eng_tensor_release(g->partial);
  free(g->blocks);
  for (int i = 0; i < g->n && g->p; i++) {
    fparam* q = &g->p[i];
    if (q->leaf && g->post_hooks && g->post_hooks[i] > 0) eng_tensor_remove_hook(q->leaf, g->post_hooks[i]);
    eng_tensor_release(q->leaf); eng_tensor_release(q->sharded); eng_tensor_release(q->acc); eng_tensor_release(q->post);
    eng_dist_spec_release(q->uspec);
  }
  eng_tensor_release(g->ubase);
  for (int k = 0; k < g->n_tree; k++) if (g->tree[k] != g) eng_fsdp_group_release(g->tree[k]);
  free(g->tree); free(g->fwd_order); free(g->cur_fwd); free(g->post_order);
  free(g->fwd_prefetch); free(g->bwd_prefetch); free(g->post_hooks); free(g->p);
  if (g->post_pg) eng_pg_release(g->post_pg);
  if (g->post_mesh) eng_mesh_release(g->post_mesh);
  if (g->rep_pg) eng_pg_release(g->rep_pg);
  if (g->pg) eng_pg_release(g->pg);
  eng_mesh_release(g->mesh);
  free(g);
}

int eng_fsdp_group_attach(eng_fsdp_group* g, eng_module* m) {
  if (!g || !m) return eng_err("fully_shard: attach needs a group and a module");
  if (g->module) return eng_err("fully_shard: the group is already attached to module %s", eng_module_name(g->module));
  g->h_pre = eng_module_register_hook(m, ENG_HOOK_FORWARD_PRE, hook_pre, g, 1);
  g->h_post = eng_module_register_hook(m, ENG_HOOK_FORWARD_POST, hook_post, g, 0);
  if (g->h_pre < 0 || g->h_post < 0) return -1;
  g->module = m;
  return 0;
}

int eng_fsdp_group_set_root(eng_fsdp_group* g, eng_fsdp_group* root) {
  if (!g || !root) return eng_err("fully_shard: set_root needs two groups");
  if (g->root == root) return 0;
  g->root = root;
  if (push(&root->tree, &root->n_tree, &root->cap_tree, g)) return -1;
  if (g != root) eng_fsdp_group_retain(g);
  return 0;
}

int eng_fsdp_group_size(const eng_fsdp_group* g) { return g ? g->n : 0; }
eng_tensor* eng_fsdp_group_param(eng_fsdp_group* g, int i) {
  if (!g || i < 0 || i >= g->n) return NULL;
  if (g->state == ST_POST_FWD) return g->p[i].post;
  return g->state == ST_UNSHARDED ? g->p[i].leaf : NULL;
}
eng_tensor* eng_fsdp_group_leaf(eng_fsdp_group* g, int i) {
  if (!g || i < 0 || i >= g->n) return NULL;
  return g->p[i].leaf;
}
int eng_fsdp_group_state(const eng_fsdp_group* g) { return g ? g->state : -1; }
int eng_fsdp_group_pending(const eng_fsdp_group* g) { return g && g->ag_out ? 1 : 0; }
int eng_fsdp_group_reduce_pending(const eng_fsdp_group* g) { return g && g->rs_out ? 1 : 0; }

int eng_fsdp_group_wait_reductions(eng_fsdp_group* g) {
  if (!g) return eng_err("wait_reductions: group is NULL");
  eng_fsdp_group* r = g->root ? g->root : g;
  int prev = eng_set_grad_enabled(0);
  int rc = 0;
  if (r->n_tree == 0) rc = rs_finish(g);
  for (int k = 0; k < r->n_tree; k++)
    if (rs_finish(r->tree[k]) && !rc) rc = -1;
  eng_set_grad_enabled(prev);
  return rc;
}

int eng_fsdp_group_set_reshard_after_forward(eng_fsdp_group* g, int value, eng_mesh* post_mesh) {
  if (!g) return eng_err("set_reshard_after_forward: group is NULL");
  if (value > 1) {
    if (value >= g->W || g->W % value != 0)
      return eng_err("reshard_after_forward: %d is not a non-trivial divisor of the shard dim size %d "
                     "(a divisor other than 1 and %d)", value, g->W, g->W);
    if (!post_mesh || eng_mesh_ndim(post_mesh) != 2 || eng_mesh_size(post_mesh, 1) != value)
      return eng_err("reshard_after_forward = %d needs its post-forward mesh of shape (dp/%d, %d)", value, value, value);
    eng_pg* sub = eng_mesh_get_group(post_mesh, 1);
    if (!sub) return -1;
    if (g->state == ST_POST_FWD && eng_fsdp_group_reshard(g)) return -1;
    if (g->post_pg) eng_pg_release(g->post_pg);
    if (g->post_mesh) eng_mesh_release(g->post_mesh);
    g->post_pg = eng_pg_retain(sub);
    g->post_mesh = eng_mesh_retain(post_mesh);
    g->chunk_n = 0;
    for (int i = 0; i < g->n; i++) {
      fparam* q = &g->p[i];
      q->ceil_d[1] = (q->shape[q->dim] + value - 1) / value;
      int64_t block = q->ceil_d[1];
      for (int d = 0; d < q->ndim; d++) if (d != q->dim) block *= q->shape[d];
      q->coff[1] = g->chunk_n;
      g->chunk_n += block;
    }
  } else if (value < 0) {
    return eng_err("reshard_after_forward: expected true, false or a positive integer, got %d", value);
  }
  g->raf = value;
  return 0;
}

int eng_fsdp_group_get_reshard_after_forward(const eng_fsdp_group* g) { return g ? g->raf : -1; }
int eng_fsdp_group_set_reshard_after_backward(eng_fsdp_group* g, int flag) { if (!g) return -1; g->rab = flag != 0; return 0; }
int eng_fsdp_group_set_requires_gradient_sync(eng_fsdp_group* g, int flag) { if (!g) return -1; g->sync = flag != 0; return 0; }
int eng_fsdp_group_set_requires_all_reduce(eng_fsdp_group* g, int flag) { if (!g) return -1; g->all_reduce = flag != 0; return 0; }
int eng_fsdp_group_set_gradient_divide_factor(eng_fsdp_group* g, double f) { if (!g) return -1; g->divide = f > 0 ? f : 0; return 0; }
int eng_fsdp_group_set_is_last_backward(eng_fsdp_group* g, int flag) { if (!g) return -1; g->is_last = flag != 0; return 0; }

static int set_list(eng_fsdp_group*** dst, int* dn, int* flag, int n, eng_fsdp_group** groups) {
  free(*dst); *dst = NULL; *dn = 0;
  if (n > 0) {
    *dst = malloc((size_t)n * sizeof **dst);
    if (!*dst) return eng_err("fully_shard: out of memory");
    memcpy(*dst, groups, (size_t)n * sizeof **dst);
    *dn = n;
  }
  *flag = 1;
  return 0;
}
int eng_fsdp_group_set_forward_prefetch(eng_fsdp_group* g, int n, eng_fsdp_group** groups) {
  return g ? set_list(&g->fwd_prefetch, &g->n_fwd_prefetch, &g->explicit_fwd, n, groups) : -1;
}
int eng_fsdp_group_set_backward_prefetch(eng_fsdp_group* g, int n, eng_fsdp_group** groups) {
  return g ? set_list(&g->bwd_prefetch, &g->n_bwd_prefetch, &g->explicit_bwd, n, groups) : -1;
}
int64_t eng_fsdp_group_count(const eng_fsdp_group* g, int what) {
  if (!g) return -1;
  return what == 0 ? g->n_ag : g->n_rs;
}

int eng_fsdp_group_set_offload(eng_fsdp_group* g, int cpu_offload, int pin_memory) {
  if (!g) return eng_err("fully_shard: set_offload: group is NULL");
  if (g->dev != ENG_CUDA) { g->offload = 0; g->pin = 0; return 0; }  /* a CPU mesh: nothing to offload */
  if (g->n > 0 && (cpu_offload != 0) != g->offload)
    return eng_err("fully_shard: offload_policy %s, but the group's sharded parameters are on %s (with "
                   "CPUOffloadPolicy on a CUDA mesh they live on the CPU, else on the mesh's device)",
                   cpu_offload ? "CPUOffloadPolicy" : "OffloadPolicy()", g->offload ? "the CPU" : "cuda");
  g->offload = cpu_offload != 0;
  g->pin = g->offload && pin_memory != 0;
  return 0;
}

int eng_fsdp_group_offload(const eng_fsdp_group* g) { return g ? (g->offload ? 1 + g->pin : 0) : -1; }

int eng_fsdp_group_set_overlap(eng_fsdp_group* g, int implicit_prefetch, int async_reduce) {
  if (!g) return eng_err("set_overlap: group is NULL");
  if (implicit_prefetch >= 0) g->implicit_prefetch = implicit_prefetch != 0;
  if (async_reduce >= 0) g->async_reduce = async_reduce != 0;
  return 0;
}
