/* Subsystem fsdp/: fully sharded data parallelism's parameter groups and
 * their C hooks (engine/include/eng/fsdp.h says what they do).
 * May call: core/, autograd/ (nodes, hooks, end-of-backward callbacks),
 * comm/ (collectives), dtensor/ (the sharded parameters' specs).
 * The Lua side (lua/engine/distributed/fsdp.lua) builds the sharded
 * parameters, makes the groups, finds the root and looks parameters up; no
 * Lua runs inside these hooks. */
#include "core/internal.h"
#include "eng/comm.h"
#include "eng/cuda.h"
#include "eng/dtensor.h"
#include "eng/fsdp.h"
#include "eng/mesh.h"
#include "eng/module.h"
#include "eng/ops_pointwise.h"
#include <stdio.h>

enum { ST_SHARDED = 0, ST_UNSHARDED = 1, ST_POST_FWD = 2 };

typedef struct fparam {
  eng_tensor* sharded;  /* the registered DTensor parameter */
  eng_tensor* leaf;     /* the unsharded parameter (view of g->buffers.unsharded's storage) */
  eng_tensor* acc;      /* unsharded gradient accumulated so far (reduce dtype) */
  int dim;              /* shard dim */
  int ndim;
  int64_t shape[8];     /* global shape */
  int64_t ceil_d[2];    /* rows of dim per rank, padded: [0] over the shard group, [1] the post-forward subgroup */
  int64_t coff[2];      /* offset of its block in a rank's chunk (same two layouts) */
  eng_tensor* post;     /* ST_POST_FWD: the registered DTensor on the post-forward mesh (its shard views
                         * g->buffers.post_forward_shard) */
  eng_dist_spec* uspec; /* FSDP over TP: the unsharded parameter's TP layout (the leaf is that DTensor), or NULL */
  int64_t uoff;         /* offset in the unsharded buffer */
  int ready;            /* got its gradient in this backward */
  int in_rs;            /* its gradient is in the group's reduce-scatter (in flight until rs_finish) */
  int in_partial;       /* HSDP: its gradient is in g->in_flight.partial_sum (reduce-scattered, not all-reduced yet) */
  int packed;           /* its gradient is already in g->in_flight.reduce_scatter_input (packed as it arrived) */
} fparam;

/* A list of groups that grows (push). */
typedef struct group_list {
  eng_fsdp_group** items;
  int count;
  int capacity;         /* slots allocated */
} group_list;

/* What fully_shard was given (mesh, MixedPrecisionPolicy, OffloadPolicy, reshard_after_forward) and the switches
 * PyTorch's FSDPModule sets on a group (set_reshard_after_backward, set_requires_gradient_sync, ...). */
typedef struct fsdp_config {
  eng_mesh* mesh;                 /* the data-parallel mesh: 1-D (FSDP) or (replicate, shard) (HSDP) */
  eng_pg* shard_group;            /* the ranks the parameters are sharded over (the mesh's last dim) */
  eng_pg* replicate_group;        /* HSDP: the replicas of this rank's shard (mesh dim 0), else NULL */
  eng_pg* post_forward_group;     /* reshard_after_forward = N: this rank's N-rank subgroup, else NULL */
  eng_mesh* post_forward_mesh;    /* reshard_after_forward = N: the (dp/N, N) mesh of that layout, else NULL */
  int shard_size;                 /* ranks in the shard group */
  int shard_rank;                 /* this rank in the shard group */
  int data_parallel_size;         /* shard_size times the replicas: the default gradient divisor */
  int device;                     /* the mesh's device: unsharded parameters, collective buffers, compute */
  int cpu_offload;                /* CPUOffloadPolicy on a CUDA mesh: the sharded parameters and their .grad live on
                                   * the CPU */
  int pin_memory;                 /* with cpu_offload: in pinned host memory (the runtime copies them by DMA) */
  int param_dtype;                /* MixedPrecisionPolicy: dtype of the unsharded parameters, -1: their own */
  int reduce_dtype;               /* dtype of the gradient reductions, -1: the unsharded buffer's */
  int output_dtype;               /* dtype the forward's outputs are cast to, -1: left alone */
  int cast_inputs;                /* cast the forward's floating inputs to param_dtype */
  int reshard_after_forward;      /* 0: keep the parameters unsharded after forward; 1: reshard them; N > 1:
                                   * reshard to the N-rank post-forward layout */
  int reshard_after_backward;     /* reshard after this group's backward */
  int requires_gradient_sync;     /* reduce the gradients in this backward (off: accumulate unsharded) */
  int requires_all_reduce;        /* HSDP: all-reduce over the replicas in this backward (off: keep partial_sum) */
  int is_last_backward;           /* this backward is the last before the optimizer step (finish every reduction) */
  /* CUDA meshes: implicit prefetch of the next group and reduce-scatters left in flight (NCCL runs them on
   * its stream beside the compute).  CPU meshes: neither by default (no MPI progress thread: a pending
   * collective advances only inside MPI calls, so both only held an extra group's buffers; measured by
   * recipes/bench/fsdp_memory.lua); ENGINE_FSDP_PREFETCH=1 / ENGINE_FSDP_ASYNC_REDUCE=1 turn them on, and
   * explicit prefetch lists always run. */
  int implicit_prefetch;
  int async_reduce;
  double gradient_divide_factor;  /* divisor of the summed gradients, 0: data_parallel_size */
} fsdp_config;

/* The flat buffers the group's parameters are packed into: a rank's chunk holds one block per parameter (its
 * torch.chunk rows on the shard dim, padded to ceil rows); the unsharded buffer is every rank's chunk in turn. */
typedef struct fsdp_buffers {
  int64_t chunk_numel;            /* elements of one rank's chunk */
  int64_t post_forward_chunk_numel; /* the same in the post-forward layout (N ranks) */
  int64_t unsharded_numel;        /* elements of the unsharded buffer */
  int unsharded_dtype;            /* dtype of the unsharded buffer */
  eng_tensor* unsharded;          /* 1-D tensor over the unsharded buffer (the unsharded parameters view it) */
  eng_tensor* flat_shard;         /* this rank's chunk whose blocks the sharded parameters' local shards view
                                   * (alias_shards), or NULL: a synchronous unshard sends it without a copy-in */
  int64_t* gather_blocks;         /* gather_in_place's block table (src_off | lens | dst_off), made on first use */
  eng_tensor* post_forward_shard; /* ST_POST_FWD: this rank's chunk of the unsharded parameters chunked over the
                                   * N-rank post-forward subgroup (torch.chunk over N: ceil(size/N) rows each,
                                   * padded; post_forward_chunk_numel elements) */
} fsdp_buffers;

/* Communication in flight, and the reductions that wait for a later backward. */
typedef struct fsdp_in_flight {
  eng_work* all_gather;           /* the unshard's all-gather, or NULL */
  eng_tensor* all_gather_input;   /* its send buffer (this rank's chunk) */
  eng_tensor* all_gather_output;  /* its receive buffer (the unsharded buffer), NULL when none is in flight */
  int all_gather_layout;          /* 0: gathered over the shard group; 1: over the post-forward subgroup */
  eng_work* reduce_scatter;       /* the gradients' reduce-scatter, or NULL */
  eng_tensor* reduce_scatter_input;  /* its send buffer: the unsharded gradients packed (reduce dtype) */
  eng_tensor* reduce_scatter_output; /* its receive buffer: this rank's chunk of the summed gradients */
  eng_tensor* partial_sum;        /* HSDP with requires_all_reduce off: the sum of the reduce-scatter outputs not
                                   * all-reduced over the replicas yet (reduce dtype, chunk_numel elements, not
                                   * divided); the next reduction with all-reduce on adds it before its all-reduce
                                   * (PyTorch's partial reduce output) */
  int close_pending;              /* an in-place all-gather (gather_in_place) ran without its closing exchange:
                                   * a later exchange on the shard group must come before the shards can change
                                   * (synced() clears it, flush_closes() makes that exchange) */
  int64_t all_gathers_issued;     /* collectives issued so far (eng_fsdp_group_count) */
  int64_t reduce_scatters_issued;
} fsdp_in_flight;

/* Where the current backward is in this group. */
typedef struct fsdp_backward {
  int pre_backward_done;          /* the pre-backward hook has run (parameters unsharded again) */
  int post_backward_done;         /* the gradients have been reduced */
  int gradients_ready;            /* parameters whose gradient has arrived */
} fsdp_backward;

/* The group's place among the groups of one model: its root and, on the root, every group and the orders in
 * which the last forward ran them (which drive implicit prefetch). */
typedef struct fsdp_tree {
  eng_fsdp_group* root;           /* the root group (weak; itself on the root) */
  group_list all;                 /* root only: every group of the tree (retained, but the root itself) */
  group_list forward_order;       /* root only: the last forward's pre-forward order (weak) */
  group_list current_forward;     /* root only: this forward's pre-forward order, being recorded (weak) */
  group_list post_forward_order;  /* root only: this forward's post-forward order (weak) */
  int end_of_backward_queued;     /* root: the end-of-backward callback is queued */
  int in_forward;                 /* root: between its pre-forward and post-forward (outside backward) */
  group_list forward_prefetch;    /* set_modules_to_forward_prefetch: groups unsharded in this one's pre-forward */
  int explicit_forward_prefetch;  /* that list was set (it replaces the implicit forward prefetch) */
  group_list backward_prefetch;   /* set_modules_to_backward_prefetch: groups unsharded in this one's pre-backward */
  int explicit_backward_prefetch; /* that list was set (it replaces the implicit backward prefetch) */
} fsdp_tree;

/* The hooks that run the group (C functions, no Lua). */
typedef struct fsdp_hooks {
  eng_module* module;             /* the module the group is attached to (weak) */
  int64_t pre_forward;            /* hook ids on the module */
  int64_t post_forward;
  int64_t* post_accumulate_grad;  /* per parameter: the post-accumulate-grad hook id on its unsharded leaf, 0: none */
} fsdp_hooks;

/* One fully_shard group (PyTorch's FSDPParamGroup): its parameters and how they are sharded, gathered and
 * reduced. */
struct eng_fsdp_group {
  int32_t refcount;
  int state;                      /* ST_SHARDED, ST_UNSHARDED or ST_POST_FWD: where the parameters are now */
  int n_params;
  fparam* params;                 /* n_params entries */
  fsdp_config config;
  fsdp_buffers buffers;
  fsdp_in_flight in_flight;
  fsdp_backward backward;
  fsdp_tree tree;
  fsdp_hooks hooks;
};

/* ---------------------------------------------------------------- helpers */
static int push(group_list* l, eng_fsdp_group* g) {
  if (l->count == l->capacity) {
    int c = l->capacity ? l->capacity * 2 : 8;
    eng_fsdp_group** a = realloc(l->items, (size_t)c * sizeof *a);
    if (!a) return eng_err("fully_shard: out of memory");
    l->items = a; l->capacity = c;
  }
  l->items[l->count++] = g;
  return 0;
}

static int eff_param_dtype(const eng_fsdp_group* g, const fparam* q) {
  return g->config.param_dtype >= 0 ? g->config.param_dtype : q->sharded->dtype;
}
static int eff_reduce_dtype(const eng_fsdp_group* g) {
  if (g->config.reduce_dtype >= 0) return g->config.reduce_dtype;
  return g->buffers.unsharded_dtype;
}

/* Rows of chunk c on the shard dim in layout L (torch.chunk: ceil-sized, the last ones short or empty). */
static int64_t rows_of(const fparam* q, int64_t c, int L) {
  int64_t r = q->shape[q->dim] - c * q->ceil_d[L];
  return r < 0 ? 0 : (r > q->ceil_d[L] ? q->ceil_d[L] : r);
}

/* View of parameter q's block in chunk c of buf (chunk laid out as the
 * parameter's shape with ceil_d rows on dim, contiguous), its first rows
 * rows on dim. */
static eng_tensor* block_view(eng_tensor* buf, int64_t chunk_index, int64_t chunk, const fparam* q, int64_t rows,
                              int L) {
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
  int64_t chunk = L ? g->buffers.post_forward_chunk_numel : g->buffers.chunk_numel;
  fparam* q = &g->params[i];
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
  for (int i = 0; i < g->n_params; i++)
    if (pack_param(g, L, i, full[i], buf, c0, nc)) return -1;
  return 0;
}

/* Copies chunks [c0, c0+nc) of layout L of buf out into the full tensors full[i]. */
static int unpack_full(eng_fsdp_group* g, int L, eng_tensor* buf, int64_t c0, int64_t nc, eng_tensor** full) {
  int64_t chunk = L ? g->buffers.post_forward_chunk_numel : g->buffers.chunk_numel;
  for (int64_t c = c0; c < c0 + nc; c++)
    for (int i = 0; i < g->n_params; i++) {
      fparam* q = &g->params[i];
      int64_t rows = rows_of(q, c, L);
      if (copy_into(rows_view(full[i], q, c * q->ceil_d[L], rows), block_view(buf, c - c0, chunk, q, rows, L)))
        return -1;
    }
  return 0;
}

static void free_tensor(eng_tensor** t) { eng_tensor_release(*t); *t = NULL; }

static void drop_post(eng_fsdp_group* g) {
  free_tensor(&g->buffers.post_forward_shard);
  for (int i = 0; i < g->n_params; i++) free_tensor(&g->params[i].post);
}

/* ---------------------------------------------------------------- unshard / reshard */
static int ensure_leaves(eng_fsdp_group* g);

/* 1 when every sharded parameter still views its block of g->flat (set_data or a dtype change since breaks it:
 * the unshard then packs the send buffer as usual). */
static int shards_aliased(const eng_fsdp_group* g) {
  if (!g->buffers.flat_shard || g->buffers.flat_shard->dtype != g->buffers.unsharded_dtype ||
      g->buffers.flat_shard->device != g->config.device)
    return 0;
  for (int i = 0; i < g->n_params; i++) {
    const eng_tensor* s = g->params[i].sharded;
    if (s->numel == 0) continue;
    if (s->storage != g->buffers.flat_shard->storage ||
        s->offset != g->buffers.flat_shard->offset + g->params[i].coff[0] || s->dtype != g->buffers.flat_shard->dtype ||
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
  if (g->n_params == 0 || g->config.cpu_offload) return;
  int ud = eff_param_dtype(g, &g->params[0]);
  for (int i = 0; i < g->n_params; i++) {
    const eng_tensor* s = g->params[i].sharded;
    if (!s->dist || !s->dist->member || s->dtype != ud || eff_param_dtype(g, &g->params[i]) != ud ||
        s->device != g->config.device || s->grad || s->grad_fn || (s->numel > 0 && !eng_tensor_is_contiguous(s)))
      return;
  }
  eng_tensor* flat = eng_new(1, &g->buffers.chunk_numel, ud, g->config.device);
  if (!flat || (g->buffers.chunk_numel > 0 && eng_tensor_zero_(flat))) {
    eng_tensor_release(flat);
    eng_clear_error();
    return;
  }
  eng_tensor** views = calloc((size_t)g->n_params, sizeof *views);
  int ok = views != NULL;
  for (int i = 0; i < g->n_params && ok; i++) {
    fparam* q = &g->params[i];
    eng_tensor* s = q->sharded;
    views[i] = block_view(flat, 0, g->buffers.chunk_numel, q, s->shape[q->dim], 0);
    if (!views[i]) { ok = 0; break; }
    for (int d = 0; d < s->ndim; d++)
      if (s->shape[d] > 1 && views[i]->stride[d] != s->stride[d]) ok = 0;
    if (ok && s->numel > 0)
      ok = copy_into(eng_tensor_retain(views[i]), eng_view_of(s, s->ndim, s->shape, s->stride, s->offset)) == 0;
  }
  for (int i = 0; i < g->n_params && ok; i++)
    if (g->params[i].sharded->numel > 0 && eng_tensor_set_data(g->params[i].sharded, views[i])) ok = 0;
  for (int i = 0; views && i < g->n_params; i++) eng_tensor_release(views[i]);
  free(views);
  if (ok) g->buffers.flat_shard = flat;
  else { eng_tensor_release(flat); eng_clear_error(); }
}

/* The unshard's all-gather straight into the unsharded buffer (eng_pg_gather_blocks, single copy on one node):
 * CPU groups without mixed precision, offload or TP whose parameters are sharded on their first dim (each rank's
 * rows of a parameter are one range of it); a rank whose shards no longer view g->buffers.flat_shard makes every rank
 * take the MPI all-gather.  No gathered buffer and no copy-out: the reference GPT's step at 2 ranks all-gathers 9
 * groups of 3 MB.  0 done, 1 not taken (the MPI all-gather follows), -1 error. */
static void synced(eng_fsdp_group* g);

static int gather_in_place(eng_fsdp_group* g, int defer) {
  if (g->config.device != ENG_CPU || g->config.cpu_offload || g->n_params == 0) return 1;
  for (int i = 0; i < g->n_params; i++) {
    const fparam* q = &g->params[i];
    if (q->dim != 0 || q->uspec || q->sharded->dtype != g->buffers.unsharded_dtype)
      return 1; /* the same on every rank */
  }
  int W = g->config.shard_size;
  if (!g->buffers.gather_blocks) { /* the layout is fixed at fully_shard: one table per group */
    int64_t* a = malloc(sizeof(int64_t) * (size_t)g->n_params * (1 + 2 * (size_t)W));
    if (!a) return eng_err("fully_shard: out of memory");
    for (int i = 0; i < g->n_params; i++) {
      const fparam* q = &g->params[i];
      int64_t rowlen = 1;
      for (int d = 1; d < q->ndim; d++) rowlen *= q->shape[d];
      a[i] = q->coff[0];
      for (int r = 0; r < W; r++) {
        a[g->n_params + (size_t)i * W + r] = rows_of(q, r, 0) * rowlen;
        a[g->n_params + (size_t)g->n_params * W + (size_t)i * W + r] = q->uoff + r * q->ceil_d[0] * rowlen;
      }
    }
    g->buffers.gather_blocks = a;
  }
  const int64_t *src_off = g->buffers.gather_blocks, *lens = g->buffers.gather_blocks + g->n_params,
                *dst_off = g->buffers.gather_blocks + g->n_params + (size_t)g->n_params * W;
  int elig = shards_aliased(g);
  int32_t v = g->buffers.unsharded->storage->version; /* as the copy-out: the aliases autograd saved stay valid */
  int rc =
      eng_pg_gather_blocks(g->config.shard_group, "FSDP unshard", g->buffers.unsharded_dtype,
                           elig ? eng_ptr(g->buffers.flat_shard) : NULL, g->buffers.chunk_numel, g->n_params, src_off,
                           lens, dst_off, eng_ptr(g->buffers.unsharded), g->buffers.unsharded_numel,
                           elig | (defer ? 2 : 0));
  g->buffers.unsharded->storage->version = v;
  if (rc == 0) {
    /* its header exchange waited for every rank: the earlier in-place all-gathers on this group are closed */
    synced(g);
    g->in_flight.close_pending = defer;
  }
  return rc;
}

static int alloc_unsharded(eng_fsdp_group* g) {
  if (ensure_leaves(g)) return -1;
  return eng_storage_alloc_data(g->buffers.unsharded->storage,
                                g->buffers.unsharded_numel * (int64_t)eng_dtype_size(g->buffers.unsharded_dtype));
}

/* Copies the gathered chunks into the unsharded buffer, keeping its version
 * counter (the aliases autograd saved stay valid: the data is the same). */
static int ag_copy_out(eng_fsdp_group* g, eng_tensor* gathered, int L) {
  int32_t v = g->buffers.unsharded->storage->version;
  eng_tensor** leaves = malloc((size_t)(g->n_params ? g->n_params : 1) * sizeof *leaves);
  if (!leaves) return eng_err("fully_shard: out of memory");
  for (int i = 0; i < g->n_params; i++) leaves[i] = g->params[i].leaf;
  int rc = unpack_full(g, L, gathered, 0, L ? eng_pg_size(g->config.post_forward_group) : g->config.shard_size, leaves);
  free(leaves);
  g->buffers.unsharded->storage->version = v;
  return rc;
}

/* The unshard of a shard group of one rank: each local shard copied (cast to param_dtype, moved to the mesh's
 * device) into its unsharded parameter; the version counter kept as ag_copy_out keeps it. */
static int unshard_local(eng_fsdp_group* g) {
  int32_t v = g->buffers.unsharded->storage->version;
  int rc = 0;
  for (int i = 0; i < g->n_params && !rc; i++) {
    fparam* q = &g->params[i];
    eng_tensor* s = q->sharded;
    if (s->numel == 0) continue;
    rc = copy_into(rows_view(q->leaf, q, 0, q->shape[q->dim]), eng_view_of(s, s->ndim, s->shape, s->stride, s->offset));
  }
  g->buffers.unsharded->storage->version = v;
  return rc;
}

static int ag_finish(eng_fsdp_group* g) {
  if (!g->in_flight.all_gather_output) return 0;
  int rc = 0;
  if (g->in_flight.all_gather) {
    rc = eng_work_wait(g->in_flight.all_gather);
    eng_work_release(g->in_flight.all_gather);
    g->in_flight.all_gather = NULL;
  }
  if (!rc && g->in_flight.all_gather_layout == 0) synced(g); /* every rank has joined it */
  if (!rc) eng_comm_stream_trace_mark("fsdp copy-out"); /* compute reads the all-gather's output */
  if (!rc) rc = ag_copy_out(g, g->in_flight.all_gather_output, g->in_flight.all_gather_layout);
  free_tensor(&g->in_flight.all_gather_input); free_tensor(&g->in_flight.all_gather_output);
  if (rc) { eng_err_prefix("FSDP unshard"); return -1; }
  drop_post(g);
  g->state = ST_UNSHARDED;
  return 0;
}

/* defer: the hooks' unshard inside the root's forward or a backward whose end-of-backward callback is queued,
 * where the root's post-forward or that callback closes an in-place all-gather that nothing closed before
 * (flush_closes): the in-place all-gather then skips its closing exchange. */
static int unshard(eng_fsdp_group* g, int async_op, int defer) {
  if (g->state == ST_UNSHARDED) return 0;
  if (g->in_flight.all_gather_output) return async_op ? 0 : ag_finish(g);
  if (g->n_params == 0) { g->state = ST_UNSHARDED; return 0; }
  int prev = eng_set_grad_enabled(0);
  int rc = -1;
  if (alloc_unsharded(g)) goto out;
  int dev = g->config.device;
  int L = g->state == ST_POST_FWD && g->buffers.post_forward_shard ? 1 : 0;
  if (!L && g->config.shard_size == 1) {
    /* a shard group of one rank: its local shards are the whole parameters (nothing to all-gather) */
    if (unshard_local(g)) { eng_err_prefix("FSDP unshard"); goto out; }
    drop_post(g);
    g->state = ST_UNSHARDED;
    rc = 0;
    goto out;
  }
  if (!L && !async_op) {
    int ip = gather_in_place(g, defer);
    if (ip < 0) { eng_err_prefix("FSDP unshard (all_gather)"); goto out; }
    if (ip == 0) {
      g->in_flight.all_gathers_issued++;
      drop_post(g);
      g->state = ST_UNSHARDED;
      rc = 0;
      goto out;
    }
  }
  int64_t full = L ? (int64_t)eng_pg_size(g->config.post_forward_group) * g->buffers.post_forward_chunk_numel
                   : (int64_t)g->config.shard_size * g->buffers.chunk_numel;
  g->in_flight.all_gather_output = eng_new(1, &full, g->buffers.unsharded_dtype, dev);
  if (!g->in_flight.all_gather_output) goto out;
  g->in_flight.all_gather_layout = L;
  eng_pg* pg = g->config.shard_group;
  if (L) {
    pg = g->config.post_forward_group;
    g->in_flight.all_gather_input = eng_tensor_retain(g->buffers.post_forward_shard);
  } else if (!async_op && shards_aliased(g)) {
    /* the shards are the send buffer (an async unshard still snapshots them: the caller may change the
     * parameters before it waits, as with PyTorch's copy-in at issue) */
    g->in_flight.all_gather_input = eng_tensor_retain(g->buffers.flat_shard);
  } else {
    g->in_flight.all_gather_input = eng_new(1, &g->buffers.chunk_numel, g->buffers.unsharded_dtype, dev);
    if (!g->in_flight.all_gather_input) goto out;
    for (int i = 0; i < g->n_params; i++) {
      fparam* q = &g->params[i];
      eng_tensor* s = q->sharded;
      if (copy_into(block_view(g->in_flight.all_gather_input, 0, g->buffers.chunk_numel, q, s->shape[q->dim], 0),
                    eng_view_of(s, s->ndim, s->shape, s->stride, s->offset))) goto out;
    }
  }
  g->in_flight.all_gathers_issued++;
  if (eng_pg_all_gather_into(pg, g->in_flight.all_gather_output, g->in_flight.all_gather_input,
                             async_op ? &g->in_flight.all_gather : NULL)) {
    eng_err_prefix("FSDP unshard (all_gather)");
    goto out;
  }
  rc = async_op ? 0 : ag_finish(g);
out:
  if (rc) {
    free_tensor(&g->in_flight.all_gather_input);
    free_tensor(&g->in_flight.all_gather_output);
    if (g->in_flight.all_gather) {
      eng_work_release(g->in_flight.all_gather);
      g->in_flight.all_gather = NULL;
    }
  }
  eng_set_grad_enabled(prev);
  return rc;
}

int eng_fsdp_group_unshard(eng_fsdp_group* g, int async_op) {
  if (!g) return eng_err("unshard: group is NULL");
  return unshard(g, async_op, 0);
}

/* Clears close_pending on every group of g's tree that shares g's shard group: called after an exchange on that
 * group that every member joined (an in-place all-gather's header exchange, a completed all-gather or
 * reduce-scatter), which no rank leaves before every rank has finished the reads of the earlier ones. */
static void synced(eng_fsdp_group* g) {
  eng_fsdp_group* r = g->tree.root;
  g->in_flight.close_pending = 0;
  if (!r) return;
  for (int k = 0; k < r->tree.all.count; k++)
    if (r->tree.all.items[k]->config.shard_group == g->config.shard_group)
      r->tree.all.items[k]->in_flight.close_pending = 0;
}

/* The closing exchange (one agreement) of every in-place all-gather of r's tree that skipped its own and that no
 * later exchange closed: after it, each rank may change its shards. */
static int flush_closes(eng_fsdp_group* r) {
  int rc = 0;
  int n = r->tree.all.count ? r->tree.all.count : 1;
  for (int k = 0; k < n; k++) {
    eng_fsdp_group* g = r->tree.all.count ? r->tree.all.items[k] : r;
    if (!g->in_flight.close_pending) continue;
    if (eng_pg_agree(g->config.shard_group, 0, 0x46534450u, "FSDP unshard (closing exchange)") && !rc) rc = -1;
    synced(g);
  }
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
  if (g->in_flight.all_gather_output && ag_finish(g)) return -1;
  if (g->buffers.unsharded) eng_storage_free_data(g->buffers.unsharded->storage);
  drop_post(g);
  g->state = ST_SHARDED;
  return 0;
}

/* Keeps this rank's shard of the unsharded parameters over the post-forward
 * subgroup of N ranks (torch.chunk over N: the registered parameters become
 * [Replicate, Shard(d)] DTensors on the (dp/N, N) post-forward mesh, viewing
 * it) and frees the rest; the backward all-gather runs on the N ranks. */
static int reshard_post_forward(eng_fsdp_group* g) {
  if (g->state != ST_UNSHARDED || !g->config.post_forward_group || !g->config.post_forward_mesh || g->n_params == 0)
    return eng_fsdp_group_reshard(g);
  int64_t j = eng_pg_rank(g->config.post_forward_group);
  eng_tensor* kept = eng_new(1, &g->buffers.post_forward_chunk_numel, g->buffers.unsharded_dtype, g->config.device);
  if (!kept) return -1;
  eng_tensor** leaves = malloc((size_t)g->n_params * sizeof *leaves);
  if (!leaves) { eng_tensor_release(kept); return eng_err("fully_shard: out of memory"); }
  for (int i = 0; i < g->n_params; i++) leaves[i] = g->params[i].leaf;
  int rc = pack_full(g, 1, leaves, kept, j, 1);
  free(leaves);
  for (int i = 0; i < g->n_params && !rc; i++) {
    fparam* q = &g->params[i];
    eng_placement pl[2] = { { ENG_PLACEMENT_REPLICATE, 0, 0, 0 }, { ENG_PLACEMENT_SHARD, q->dim, 0, 0 } };
    eng_dist_spec* sp = eng_dist_spec_new(g->config.post_forward_mesh, 2, pl, q->ndim, q->shape, NULL);
    eng_tensor* v = sp ? block_view(kept, 0, g->buffers.post_forward_chunk_numel, q, rows_of(q, j, 1), 1) : NULL;
    if (!v || eng_dtensor_wrap_output(v, sp)) rc = -1;
    eng_dist_spec_release(sp);
    eng_tensor_release(q->post);
    q->post = rc ? NULL : v;
    if (rc) eng_tensor_release(v);
  }
  if (rc) { eng_tensor_release(kept); drop_post(g); return -1; }
  eng_storage_free_data(g->buffers.unsharded->storage);
  g->buffers.post_forward_shard = kept;
  g->state = ST_POST_FWD;
  return 0;
}

/* ---------------------------------------------------------------- gradients */
static int rs_finish(eng_fsdp_group* g) {
  if (!g->in_flight.reduce_scatter_output) return 0;
  int rc = 0;
  if (g->in_flight.reduce_scatter) {
    rc = eng_work_wait(g->in_flight.reduce_scatter);
    eng_work_release(g->in_flight.reduce_scatter);
    g->in_flight.reduce_scatter = NULL;
    if (!rc) synced(g); /* every rank has joined it */
  }
  free_tensor(&g->in_flight.reduce_scatter_input);
  if (!rc && g->config.replicate_group) {
    /* HSDP: the reduce-scatters run with all-reduce off (set_requires_all_reduce(false)) summed so far join this
     * output before its all-reduce, so that every microbatch reaches the other replicas */
    if (g->in_flight.partial_sum) {
      rc = eng_add_(g->in_flight.reduce_scatter_output, g->in_flight.partial_sum, 1.0);
      free_tensor(&g->in_flight.partial_sum);
      for (int i = 0; i < g->n_params; i++) {
        if (g->params[i].in_partial) g->params[i].in_rs = 1;
        g->params[i].in_partial = 0;
      }
    }
    if (!rc && !g->config.requires_all_reduce) {
      /* all-reduce off: keep the replica's partial sum (not divided) for the next all-reduce; .grad waits */
      g->in_flight.partial_sum = g->in_flight.reduce_scatter_output;
      g->in_flight.reduce_scatter_output = NULL;
      for (int i = 0; i < g->n_params; i++) {
        if (g->params[i].in_rs) g->params[i].in_partial = 1;
        g->params[i].in_rs = 0;
      }
      return 0;
    }
    if (!rc && eng_pg_size(g->config.replicate_group) > 1)
      rc = eng_pg_all_reduce(g->config.replicate_group, g->in_flight.reduce_scatter_output, ENG_REDUCE_SUM, NULL);
  }
  double scale = g->config.gradient_divide_factor > 0 ? 1.0 / g->config.gradient_divide_factor
                                                      : 1.0 / g->config.data_parallel_size;
  /* where every gradient is of the reduce dtype and on the output's device (no mixed precision, no CPU
   * offload), the sharded gradients ARE views of the output: one in-place scaling pass over it, no copy and no
   * allocation per parameter (the views keep the output's storage) */
  int views = !rc;
  for (int i = 0; i < g->n_params && views; i++) {
    const eng_tensor* s = g->params[i].sharded;
    if (g->params[i].in_rs && (s->dtype != g->in_flight.reduce_scatter_output->dtype ||
                               s->device != g->in_flight.reduce_scatter_output->device || g->config.pin_memory))
      views = 0;
  }
  if (views && scale != 1.0 && g->in_flight.reduce_scatter_output->numel > 0)
    rc = eng_mul_scalar_(g->in_flight.reduce_scatter_output, scale);
  int prev_local = eng_dtensor_set_local_mode(1);
  for (int i = 0; i < g->n_params && !rc; i++) {
    fparam* q = &g->params[i];
    if (!q->in_rs) continue;
    q->in_rs = 0;
    eng_tensor* s = q->sharded;
    eng_tensor* gl;
    if (views) {
      gl = block_view(g->in_flight.reduce_scatter_output, 0, g->buffers.chunk_numel, q, s->shape[q->dim], 0);
      if (!gl) { rc = -1; break; }
    } else {
      /* CPU offload: the gradient goes to the host (pinned with pin_memory), where the optimizer steps */
      gl = g->config.pin_memory && s->device == ENG_CPU && !s->grad ? eng_new_pinned(s->ndim, s->shape, s->dtype)
                                                     : eng_new(s->ndim, s->shape, s->dtype, s->device);
      if (!gl) { rc = -1; break; }
      if (copy_into(eng_tensor_retain(gl), block_view(g->in_flight.reduce_scatter_output, 0, g->buffers.chunk_numel, q,
                                                      s->shape[q->dim], 0)) ||
          (scale != 1.0 && eng_mul_scalar_(gl, scale))) {
        eng_tensor_release(gl);
        rc = -1;
        break;
      }
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
  free_tensor(&g->in_flight.reduce_scatter_output);
  if (rc) eng_err_prefix("FSDP post-backward (reduce_scatter)");
  return rc;
}

/* Reduces the accumulated gradients (when syncing) and reshards. */
static int post_backward(eng_fsdp_group* g) {
  if (g->backward.post_backward_done) return 0;
  g->backward.post_backward_done = 1;
  int rc = 0;
  int any = 0;
  for (int i = 0; i < g->n_params; i++) if (g->params[i].acc) any = 1;
  /* every gradient of the group is in: the unsharded parameters are not needed any more (free them before the
   * reduce-scatter's buffers are made) */
  if (g->config.reshard_after_backward && g->tree.root != g && eng_fsdp_group_reshard(g)) return -1;
  if (g->config.requires_gradient_sync && g->n_params > 0) {
    /* every rank reduces when any parameter of the group takes gradients (the
     * same decision everywhere: it depends on requires_grad only) */
    int want = 0;
    for (int i = 0; i < g->n_params; i++) if (g->params[i].leaf && g->params[i].leaf->requires_grad) want = 1;
    if (want) {
      if (g->in_flight.reduce_scatter_output && rs_finish(g)) return -1;
      int rd = eff_reduce_dtype(g);
      int dev = g->config.device;
      int64_t full = (int64_t)g->config.shard_size * g->buffers.chunk_numel;
      /* the send buffer: filled as the gradients arrived (post_acc_hook), or made now */
      if (!g->in_flight.reduce_scatter_input) g->in_flight.reduce_scatter_input = eng_new(1, &full, rd, dev);
      /* a shard group of one rank: the packed gradients are the output (nothing to reduce-scatter) */
      g->in_flight.reduce_scatter_output = !g->in_flight.reduce_scatter_input ? NULL
                                           : g->config.shard_size == 1
                                               ? eng_tensor_retain(g->in_flight.reduce_scatter_input)
                                               : eng_new(1, &g->buffers.chunk_numel, rd, dev);
      rc = g->in_flight.reduce_scatter_output ? 0 : -1;
      for (int i = 0; i < g->n_params && !rc; i++) {
        fparam* q = &g->params[i];
        q->in_rs = q->acc != NULL || q->packed;
        if (!q->packed) rc = pack_param(g, 0, i, q->acc, g->in_flight.reduce_scatter_input, 0, g->config.shard_size);
      }
      for (int i = 0; i < g->n_params; i++) { free_tensor(&g->params[i].acc); g->params[i].packed = 0; }
      if (!rc) {
        /* at most one reduce-scatter in flight in the tree: its send buffer is a whole group's gradients,
         * and MPI progresses a pending collective only inside MPI calls (no progress thread), so waiting
         * later would only hold the memory longer */
        eng_fsdp_group* r = g->tree.root ? g->tree.root : g;
        for (int k = 0; k < r->tree.all.count && !rc; k++)
          if (r->tree.all.items[k] != g && r->tree.all.items[k]->in_flight.reduce_scatter_output)
            rc = rs_finish(r->tree.all.items[k]);
      }
      if (!rc && g->config.shard_size > 1) {
        g->in_flight.reduce_scatters_issued++;
        eng_comm_stream_trace_mark("fsdp gradients packed"); /* compute produced the reduce-scatter's input */
        rc =
            eng_pg_reduce_scatter_into(g->config.shard_group, g->in_flight.reduce_scatter_output,
                                       g->in_flight.reduce_scatter_input, ENG_REDUCE_SUM, &g->in_flight.reduce_scatter);
        if (rc) eng_err_prefix("FSDP post-backward (reduce_scatter)");
      }
      if (!rc && (g->config.shard_size == 1 || !g->config.async_reduce)) rc = rs_finish(g);
      if (rc) { free_tensor(&g->in_flight.reduce_scatter_input); free_tensor(&g->in_flight.reduce_scatter_output); }
    }
  }
  (void)any;
  if (!rc && g->config.reshard_after_backward && g->tree.root != g) rc = eng_fsdp_group_reshard(g);
  return rc;
}

static int root_final(void* ud);

static int queue_final(eng_fsdp_group* g) {
  eng_fsdp_group* r = g->tree.root ? g->tree.root : g;
  if (r->tree.end_of_backward_queued || !eng_autograd_in_backward()) return 0;
  if (eng_autograd_queue_callback(root_final, r)) return -1;
  r->tree.end_of_backward_queued = 1;
  return 0;
}

static int post_acc_hook(eng_tensor* t, eng_tensor* grad, eng_tensor** out, void* ud) {
  (void)grad; (void)out;
  eng_fsdp_group* g = ud;
  int i = 0;
  while (i < g->n_params && g->params[i].leaf != t) i++;
  if (i == g->n_params || !t->grad) return 0;
  fparam* q = &g->params[i];
  if (queue_final(g)) return -1;
  int rd = eff_reduce_dtype(g);
  eng_tensor* gv = t->grad;
  /* a TP leaf's gradient is a DTensor in the leaf's layout: reduce its local tensor over dp */
  eng_tensor* gr = gv->dist ? eng_view_of(gv, gv->ndim, gv->shape, gv->stride, gv->offset) : eng_tensor_retain(gv);
  if (!gr) return -1;
  int rc = 0;
  if (g->config.requires_gradient_sync && !q->acc && !q->packed && !g->backward.post_backward_done) {
    /* pack it into the reduce-scatter's send buffer now and free it: the group's full gradients and the
     * packed copy are never held together */
    if (g->in_flight.reduce_scatter_output && rs_finish(g)) {
      eng_tensor_release(gr);
      return -1;
    } /* its buffer is in flight */
    if (!g->in_flight.reduce_scatter_input) {
      int64_t full = (int64_t)g->config.shard_size * g->buffers.chunk_numel;
      g->in_flight.reduce_scatter_input = eng_new(1, &full, rd, gr->device);
    }
    rc = g->in_flight.reduce_scatter_input
             ? pack_param(g, 0, i, gr, g->in_flight.reduce_scatter_input, 0, g->config.shard_size)
             : -1;
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
  if (!q->ready) { q->ready = 1; g->backward.gradients_ready++; }
  int need = 0;
  for (int k = 0; k < g->n_params; k++) if (g->params[k].leaf->requires_grad) need++;
  if (g->backward.gradients_ready >= need) return post_backward(g);
  return 0;
}

/* ---------------------------------------------------------------- backward-pre (identity node) */
static void prefetch_list(eng_fsdp_group** list, int n) {
  for (int i = 0; i < n; i++)
    if (list[i] && list[i]->state != ST_UNSHARDED && !list[i]->in_flight.all_gather_output)
      eng_fsdp_group_unshard(list[i], 1);
}

static int pre_backward(eng_fsdp_group* g) {
  if (queue_final(g)) return -1;
  if (g->backward.pre_backward_done) return 0;
  g->backward.pre_backward_done = 1;
  for (int i = 0; i < g->n_params; i++) g->params[i].ready = 0;
  g->backward.gradients_ready = 0;
  g->backward.post_backward_done = 0;
  if (unshard(g, 0, g->tree.root && g->tree.root->tree.end_of_backward_queued)) return -1;
  if (g->tree.explicit_backward_prefetch)
    prefetch_list(g->tree.backward_prefetch.items, g->tree.backward_prefetch.count);
  else if (g->config.implicit_prefetch) {
    eng_fsdp_group* r = g->tree.root;
    if (r) for (int k = r->tree.post_forward_order.count - 1; k > 0; k--)
      if (r->tree.post_forward_order.items[k] == g) {
        eng_fsdp_group* prevg = r->tree.post_forward_order.items[k - 1];
        if (!prevg->backward.pre_backward_done) prefetch_list(&prevg, 1);
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

static int in_list(const group_list* l, const eng_fsdp_group* g) {
  for (int i = 0; i < l->count; i++) if (l->items[i] == g) return 1;
  return 0;
}

int eng_fsdp_group_pre_forward(eng_fsdp_group* g, eng_tensor** ts, int n) {
  eng_fsdp_group* r = g->tree.root;
  int in_bw = eng_autograd_in_backward();
  int prev = eng_set_grad_enabled(0);
  int rc = 0;
  if (r == g && !in_bw) {
    /* a new forward of the root: the last one's order drives this one's implicit prefetch */
    if (g->tree.current_forward.count > 0) { /* swapped: the recorded order becomes the last one, its slots reused */
      group_list t = g->tree.forward_order;
      g->tree.forward_order = g->tree.current_forward;
      g->tree.current_forward = t;
    }
    g->tree.current_forward.count = 0;
    g->tree.post_forward_order.count = 0;
    g->tree.in_forward = 1;
  }
  if (r && !in_bw && !in_list(&r->tree.current_forward, g)) rc = push(&r->tree.current_forward, g);
  if (!rc) rc = unshard(g, 0, r && (in_bw ? r->tree.end_of_backward_queued : r->tree.in_forward));
  if (!rc && !in_bw) {
    if (g->tree.explicit_forward_prefetch)
      prefetch_list(g->tree.forward_prefetch.items, g->tree.forward_prefetch.count);
    else if (r && g->config.implicit_prefetch) {
      for (int k = 0; k + 1 < r->tree.forward_order.count; k++)
        if (r->tree.forward_order.items[k] == g) { prefetch_list(&r->tree.forward_order.items[k + 1], 1); break; }
    }
  }
  eng_set_grad_enabled(prev);
  if (rc) return -1;
  /* the root moves plain inputs to the mesh's device; cast_forward_inputs */
  if (r == g) {
    int dev = eng_mesh_device(g->config.mesh);
    for (int i = 0; i < n; i++)
      if (ts[i] && !ts[i]->dist && ts[i]->device != dev && ts[i]->device != ENG_META) {
        eng_tensor* c = eng_tensor_to_device(ts[i], dev);
        if (!c) return -1;
        eng_tensor_release(ts[i]); ts[i] = c;
      }
  }
  if (g->config.cast_inputs && g->config.param_dtype >= 0 && cast_floating(ts, n, g->config.param_dtype)) return -1;
  return 0;
}

int eng_fsdp_group_post_forward(eng_fsdp_group* g, eng_tensor** ts, int n) {
  eng_fsdp_group* r = g->tree.root;
  int in_bw = eng_autograd_in_backward();
  if (r == g && !in_bw) {
    /* the end of the root's forward: close the in-place all-gathers no later exchange closed, before the
     * caller can change a shard */
    g->tree.in_forward = 0;
    if (flush_closes(g)) return -1;
  }
  if (g->config.output_dtype >= 0 && cast_floating(ts, n, g->config.output_dtype)) return -1;
  int grad = eng_grad_enabled();
  if (r && !in_bw && !in_list(&r->tree.post_forward_order, g) && push(&r->tree.post_forward_order, g)) return -1;
  if (grad) {
    int prev = eng_set_grad_enabled(0);
    int rc = 0;
    for (int i = 0; i < n && !rc; i++)
      if (ts[i] && ts[i]->requires_grad) rc = arm_backward(g, &ts[i]);
    eng_set_grad_enabled(prev);
    if (rc) return -1;
    if (in_bw) return 0;  /* a recompute inside backward: keep them for the backward that follows */
    if (g->config.reshard_after_forward == 0)
      return 0; /* (a root keeps its parameters by default: its lazy init sets false) */
    if (g->config.reshard_after_forward > 1) return reshard_post_forward(g);
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
  r->tree.end_of_backward_queued = 0;
  for (int k = 0; k < r->tree.all.count; k++) {
    eng_fsdp_group* g = r->tree.all.items[k];
    if (g->backward.gradients_ready > 0 && !g->backward.post_backward_done && post_backward(g) && !rc) rc = -1;
  }
  for (int k = 0; k < r->tree.all.count; k++) {
    eng_fsdp_group* g = r->tree.all.items[k];
    if (r->config.is_last_backward && rs_finish(g) && !rc) rc = -1;
    if (r->config.is_last_backward && g->in_flight.all_gather_output && ag_finish(g) && !rc) rc = -1;
    if (g->config.reshard_after_backward && g->state != ST_SHARDED && eng_fsdp_group_reshard(g) && !rc) rc = -1;
    g->backward.pre_backward_done = 0; g->backward.post_backward_done = 0; g->backward.gradients_ready = 0;
    for (int i = 0; i < g->n_params; i++) g->params[i].ready = 0;
  }
  if (flush_closes(r) && !rc) rc = -1;
  return rc;
}

/* ---------------------------------------------------------------- construction */
static int ensure_leaves(eng_fsdp_group* g) {
  int ud = g->n_params ? eff_param_dtype(g, &g->params[0]) : 0;
  for (int i = 1; i < g->n_params; i++)
    if (eff_param_dtype(g, &g->params[i]) != ud)
      return eng_err("fully_shard: the parameters of one group must share a dtype (got %s and %s)",
                     eng_dtype_name(ud), eng_dtype_name(eff_param_dtype(g, &g->params[i])));
  if (g->buffers.unsharded && g->buffers.unsharded_dtype == ud) {
    /* requires_grad_ on a sharded parameter after fully_shard: its leaf follows (and takes the hook) */
    for (int i = 0; i < g->n_params; i++)
      if (g->params[i].leaf->requires_grad != g->params[i].sharded->requires_grad) {
        if (eng_tensor_set_requires_grad(g->params[i].leaf, g->params[i].sharded->requires_grad)) return -1;
        if (g->params[i].leaf->requires_grad && g->hooks.post_accumulate_grad[i] <= 0) {
          g->hooks.post_accumulate_grad[i] =
              eng_tensor_register_post_accumulate_hook(g->params[i].leaf, post_acc_hook, g);
          if (g->hooks.post_accumulate_grad[i] < 0) return -1;
        }
      }
    return 0;
  }
  /* (re)build: first use, or the parameters changed dtype (module:to) */
  for (int i = 0; i < g->n_params; i++) {
    if (g->params[i].leaf && g->hooks.post_accumulate_grad && g->hooks.post_accumulate_grad[i] > 0)
      eng_tensor_remove_hook(g->params[i].leaf, g->hooks.post_accumulate_grad[i]);
    if (g->hooks.post_accumulate_grad) g->hooks.post_accumulate_grad[i] = 0;
    free_tensor(&g->params[i].leaf);
  }
  free_tensor(&g->buffers.unsharded);
  g->buffers.unsharded_dtype = ud;
  int64_t tot = g->buffers.unsharded_numel > 0 ? g->buffers.unsharded_numel : 1;
  g->buffers.unsharded = eng_new(1, &tot, ud, g->config.device);
  if (!g->buffers.unsharded) return -1;
  if (!g->hooks.post_accumulate_grad)
    g->hooks.post_accumulate_grad =
        calloc((size_t)(g->n_params ? g->n_params : 1), sizeof *g->hooks.post_accumulate_grad);
  if (!g->hooks.post_accumulate_grad) return eng_err("fully_shard: out of memory");
  for (int i = 0; i < g->n_params; i++) {
    fparam* q = &g->params[i];
    int64_t st[8];
    eng_contiguous_strides(q->ndim, q->shape, st);
    q->leaf = eng_view_of(g->buffers.unsharded, q->ndim, q->shape, st, q->uoff);
    if (!q->leaf) return -1;
    if (q->uspec && eng_dtensor_wrap_output(q->leaf, q->uspec)) return -1;
    /* frozen parameters (requires_grad false) take no hook: the group's gradients are complete when every
     * parameter that requires grad has its own (post_acc_hook counts those) */
    if (!q->sharded->requires_grad) continue;
    eng_tensor_set_requires_grad(q->leaf, 1);
    g->hooks.post_accumulate_grad[i] = eng_tensor_register_post_accumulate_hook(q->leaf, post_acc_hook, g);
    if (g->hooks.post_accumulate_grad[i] < 0) return -1;
  }
  eng_storage_free_data(g->buffers.unsharded->storage);
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
  g->config.mesh = eng_mesh_retain(mesh);
  g->config.shard_group = eng_mesh_get_group(mesh, mnd - 1);
  if (g->config.shard_group) eng_pg_retain(g->config.shard_group);
  if (mnd == 2) {
    g->config.replicate_group = eng_mesh_get_group(mesh, 0);
    if (g->config.replicate_group) eng_pg_retain(g->config.replicate_group);
  }
  g->config.shard_size = eng_mesh_size(mesh, mnd - 1);
  g->config.data_parallel_size = g->config.shard_size * (mnd == 2 ? eng_mesh_size(mesh, 0) : 1);
  g->config.shard_rank = g->config.shard_group ? eng_pg_rank(g->config.shard_group) : 0;
  g->config.device = eng_mesh_device(mesh);
  g->config.param_dtype = param_dtype; g->config.reduce_dtype = reduce_dtype; g->config.output_dtype = output_dtype;
  g->config.cast_inputs = cast_forward_inputs;
  g->config.reshard_after_forward = 1;
  g->config.reshard_after_backward = 1;
  g->config.requires_gradient_sync = 1;
  g->config.requires_all_reduce = 1;
  g->config.is_last_backward = 1;
  {
    int cuda = eng_mesh_device(mesh) == ENG_CUDA;
    const char* e1 = getenv("ENGINE_FSDP_PREFETCH");
    const char* e2 = getenv("ENGINE_FSDP_ASYNC_REDUCE");
    g->config.implicit_prefetch = e1 && *e1 ? atoi(e1) != 0 : cuda;
    g->config.async_reduce = e2 && *e2 ? atoi(e2) != 0 : cuda;
  }
  g->n_params = n;
  g->params = calloc((size_t)(n ? n : 1), sizeof *g->params);
  if (!g->params || !g->config.shard_group) { eng_err("fully_shard: out of memory"); goto fail; }
  for (int i = 0; i < n; i++) {
    eng_tensor* s = params[i];
    fparam* q = &g->params[i];
    if (!s || !s->dist) { eng_err("fully_shard: parameter %d is not a DTensor", i + 1); goto fail; }
    eng_dist_spec* sp = s->dist;
    int fd = fsdp_dims[i];
    if (fd < 0 || fd >= sp->mesh_ndim) {
      eng_err("fully_shard: parameter %d: bad FSDP mesh dim %d", i + 1, fd);
      goto fail;
    }
    const eng_placement* pl = &sp->placements[fd];
    if ((pl->kind != ENG_PLACEMENT_SHARD && pl->kind != ENG_PLACEMENT_STRIDED_SHARD) ||
        (mnd == 2 && (fd < 1 || sp->placements[fd - 1].kind != ENG_PLACEMENT_REPLICATE))) {
      eng_err("fully_shard: parameter %d must be Shard on the FSDP mesh dim (Replicate before it for HSDP)", i + 1);
      goto fail;
    }
    if (s->numel > 0 && !eng_tensor_is_contiguous(s)) {
      eng_err("fully_shard: parameter %d's local shard is not contiguous", i + 1);
      goto fail;
    }
    /* its local shard lives on the mesh's device, or (CPU offload on a CUDA mesh) every one on the CPU */
    int off = s->device == ENG_CPU && g->config.device == ENG_CUDA;
    if ((s->device != g->config.device && !off) || (i > 0 && off != g->config.cpu_offload)) {
      eng_err("fully_shard: parameter %d's local shard %s is on %s on a %s mesh (the sharded parameters live on the "
              "mesh's device, or all on the CPU with CPUOffloadPolicy)", i + 1, eng_desc(s),
              s->device == ENG_CUDA ? "cuda" : "cpu", g->config.device == ENG_CUDA ? "cuda" : "cpu");
      goto fail;
    }
    g->config.cpu_offload = off;
    eng_dist_spec* us = unsharded_specs ? unsharded_specs[i] : NULL;
    q->sharded = eng_tensor_retain(s);
    q->dim = pl->dim;
    q->ndim = sp->ndim;
    /* the unsharded parameter: the full tensor, or (FSDP over TP) the TP DTensor's local shard */
    for (int d = 0; d < q->ndim; d++) q->shape[d] = us ? us->local_shape[d] : sp->shape[d];
    if (us) q->uspec = eng_dist_spec_retain(us);
    q->ceil_d[0] = (q->shape[q->dim] + g->config.shard_size - 1) / g->config.shard_size;
    int64_t block = q->ceil_d[0];
    for (int d = 0; d < q->ndim; d++) if (d != q->dim) block *= q->shape[d];
    q->coff[0] = g->buffers.chunk_numel;
    g->buffers.chunk_numel += block;
    if (sp->member && s->shape[q->dim] != rows_of(q, g->config.shard_rank, 0)) {
      eng_err(
          "fully_shard: parameter %d: its local shard has %lld rows on dim %d where chunking the unsharded "
          "parameter over %d ranks gives %lld",
          i + 1, (long long)s->shape[q->dim], q->dim + 1, g->config.shard_size,
          (long long)rows_of(q, g->config.shard_rank, 0));
      goto fail;
    }
    /* the unsharded parameter's elements: the full tensor, or (FSDP over TP) the TP local shard only */
    int64_t unumel = 1;
    for (int d = 0; d < q->ndim; d++) unumel *= q->shape[d];
    q->uoff = g->buffers.unsharded_numel;
    g->buffers.unsharded_numel += unumel;
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
  if (g->in_flight.all_gather) { eng_work_wait(g->in_flight.all_gather); eng_work_release(g->in_flight.all_gather); }
  if (g->in_flight.reduce_scatter) {
    eng_work_wait(g->in_flight.reduce_scatter);
    eng_work_release(g->in_flight.reduce_scatter);
  }
  eng_tensor_release(g->in_flight.all_gather_input);
  eng_tensor_release(g->in_flight.all_gather_output);
  eng_tensor_release(g->buffers.post_forward_shard);
  eng_tensor_release(g->in_flight.reduce_scatter_input);
  eng_tensor_release(g->in_flight.reduce_scatter_output);
  eng_tensor_release(g->buffers.flat_shard);
  eng_tensor_release(g->in_flight.partial_sum);
  free(g->buffers.gather_blocks);
  for (int i = 0; i < g->n_params && g->params; i++) {
    fparam* q = &g->params[i];
    if (q->leaf && g->hooks.post_accumulate_grad && g->hooks.post_accumulate_grad[i] > 0)
      eng_tensor_remove_hook(q->leaf, g->hooks.post_accumulate_grad[i]);
    eng_tensor_release(q->leaf);
    eng_tensor_release(q->sharded);
    eng_tensor_release(q->acc);
    eng_tensor_release(q->post);
    eng_dist_spec_release(q->uspec);
  }
  eng_tensor_release(g->buffers.unsharded);
  for (int k = 0; k < g->tree.all.count; k++)
    if (g->tree.all.items[k] != g) eng_fsdp_group_release(g->tree.all.items[k]);
  free(g->tree.all.items);
  free(g->tree.forward_order.items);
  free(g->tree.current_forward.items);
  free(g->tree.post_forward_order.items);
  free(g->tree.forward_prefetch.items);
  free(g->tree.backward_prefetch.items);
  free(g->hooks.post_accumulate_grad);
  free(g->params);
  if (g->config.post_forward_group) eng_pg_release(g->config.post_forward_group);
  if (g->config.post_forward_mesh) eng_mesh_release(g->config.post_forward_mesh);
  if (g->config.replicate_group) eng_pg_release(g->config.replicate_group);
  if (g->config.shard_group) eng_pg_release(g->config.shard_group);
  eng_mesh_release(g->config.mesh);
  free(g);
}

int eng_fsdp_group_attach(eng_fsdp_group* g, eng_module* m) {
  if (!g || !m) return eng_err("fully_shard: attach needs a group and a module");
  if (g->hooks.module)
    return eng_err("fully_shard: the group is already attached to module %s", eng_module_name(g->hooks.module));
  g->hooks.pre_forward = eng_module_register_hook(m, ENG_HOOK_FORWARD_PRE, hook_pre, g, 1);
  g->hooks.post_forward = eng_module_register_hook(m, ENG_HOOK_FORWARD_POST, hook_post, g, 0);
  if (g->hooks.pre_forward < 0 || g->hooks.post_forward < 0) return -1;
  g->hooks.module = m;
  return 0;
}

int eng_fsdp_group_set_root(eng_fsdp_group* g, eng_fsdp_group* root) {
  if (!g || !root) return eng_err("fully_shard: set_root needs two groups");
  if (g->tree.root == root) return 0;
  g->tree.root = root;
  if (push(&root->tree.all, g)) return -1;
  if (g != root) eng_fsdp_group_retain(g);
  return 0;
}

int eng_fsdp_group_size(const eng_fsdp_group* g) { return g ? g->n_params : 0; }
eng_tensor* eng_fsdp_group_param(eng_fsdp_group* g, int i) {
  if (!g || i < 0 || i >= g->n_params) return NULL;
  if (g->state == ST_POST_FWD) return g->params[i].post;
  return g->state == ST_UNSHARDED ? g->params[i].leaf : NULL;
}
eng_tensor* eng_fsdp_group_leaf(eng_fsdp_group* g, int i) {
  if (!g || i < 0 || i >= g->n_params) return NULL;
  return g->params[i].leaf;
}
int eng_fsdp_group_state(const eng_fsdp_group* g) { return g ? g->state : -1; }
int eng_fsdp_group_pending(const eng_fsdp_group* g) { return g && g->in_flight.all_gather_output ? 1 : 0; }
int eng_fsdp_group_reduce_pending(const eng_fsdp_group* g) { return g && g->in_flight.reduce_scatter_output ? 1 : 0; }

int eng_fsdp_group_wait_reductions(eng_fsdp_group* g) {
  if (!g) return eng_err("wait_reductions: group is NULL");
  eng_fsdp_group* r = g->tree.root ? g->tree.root : g;
  int prev = eng_set_grad_enabled(0);
  int rc = 0;
  if (r->tree.all.count == 0) rc = rs_finish(g);
  for (int k = 0; k < r->tree.all.count; k++)
    if (rs_finish(r->tree.all.items[k]) && !rc) rc = -1;
  eng_set_grad_enabled(prev);
  return rc;
}

int eng_fsdp_group_set_reshard_after_forward(eng_fsdp_group* g, int value, eng_mesh* post_mesh) {
  if (!g) return eng_err("set_reshard_after_forward: group is NULL");
  if (value > 1) {
    if (value >= g->config.shard_size || g->config.shard_size % value != 0)
      return eng_err("reshard_after_forward: %d is not a non-trivial divisor of the shard dim size %d "
                     "(a divisor other than 1 and %d)", value, g->config.shard_size, g->config.shard_size);
    if (!post_mesh || eng_mesh_ndim(post_mesh) != 2 || eng_mesh_size(post_mesh, 1) != value)
      return eng_err("reshard_after_forward = %d needs its post-forward mesh of shape (dp/%d, %d)", value, value,
                     value);
    eng_pg* sub = eng_mesh_get_group(post_mesh, 1);
    if (!sub) return -1;
    if (g->state == ST_POST_FWD && eng_fsdp_group_reshard(g)) return -1;
    if (g->config.post_forward_group) eng_pg_release(g->config.post_forward_group);
    if (g->config.post_forward_mesh) eng_mesh_release(g->config.post_forward_mesh);
    g->config.post_forward_group = eng_pg_retain(sub);
    g->config.post_forward_mesh = eng_mesh_retain(post_mesh);
    g->buffers.post_forward_chunk_numel = 0;
    for (int i = 0; i < g->n_params; i++) {
      fparam* q = &g->params[i];
      q->ceil_d[1] = (q->shape[q->dim] + value - 1) / value;
      int64_t block = q->ceil_d[1];
      for (int d = 0; d < q->ndim; d++) if (d != q->dim) block *= q->shape[d];
      q->coff[1] = g->buffers.post_forward_chunk_numel;
      g->buffers.post_forward_chunk_numel += block;
    }
  } else if (value < 0) {
    return eng_err("reshard_after_forward: expected true, false or a positive integer, got %d", value);
  }
  g->config.reshard_after_forward = value;
  return 0;
}

int eng_fsdp_group_get_reshard_after_forward(const eng_fsdp_group* g) {
  return g ? g->config.reshard_after_forward : -1;
}
int eng_fsdp_group_set_reshard_after_backward(eng_fsdp_group* g, int flag) {
  if (!g) return -1;
  g->config.reshard_after_backward = flag != 0;
  return 0;
}
int eng_fsdp_group_set_requires_gradient_sync(eng_fsdp_group* g, int flag) {
  if (!g) return -1;
  g->config.requires_gradient_sync = flag != 0;
  return 0;
}
int eng_fsdp_group_set_requires_all_reduce(eng_fsdp_group* g, int flag) {
  if (!g) return -1;
  g->config.requires_all_reduce = flag != 0;
  return 0;
}
int eng_fsdp_group_set_gradient_divide_factor(eng_fsdp_group* g, double f) {
  if (!g) return -1;
  g->config.gradient_divide_factor = f > 0 ? f : 0;
  return 0;
}
int eng_fsdp_group_set_is_last_backward(eng_fsdp_group* g, int flag) {
  if (!g) return -1;
  g->config.is_last_backward = flag != 0;
  return 0;
}

static int set_list(group_list* dst, int* flag, int n, eng_fsdp_group** groups) {
  free(dst->items); dst->items = NULL; dst->count = dst->capacity = 0;
  if (n > 0) {
    dst->items = malloc((size_t)n * sizeof *dst->items);
    if (!dst->items) return eng_err("fully_shard: out of memory");
    memcpy(dst->items, groups, (size_t)n * sizeof *dst->items);
    dst->count = dst->capacity = n;
  }
  *flag = 1;
  return 0;
}
int eng_fsdp_group_set_forward_prefetch(eng_fsdp_group* g, int n, eng_fsdp_group** groups) {
  return g ? set_list(&g->tree.forward_prefetch, &g->tree.explicit_forward_prefetch, n, groups) : -1;
}
int eng_fsdp_group_set_backward_prefetch(eng_fsdp_group* g, int n, eng_fsdp_group** groups) {
  return g ? set_list(&g->tree.backward_prefetch, &g->tree.explicit_backward_prefetch, n, groups) : -1;
}
int64_t eng_fsdp_group_count(const eng_fsdp_group* g, int what) {
  if (!g) return -1;
  return what == 0 ? g->in_flight.all_gathers_issued : g->in_flight.reduce_scatters_issued;
}

int eng_fsdp_group_set_offload(eng_fsdp_group* g, int cpu_offload, int pin_memory) {
  if (!g) return eng_err("fully_shard: set_offload: group is NULL");
  if (g->config.device != ENG_CUDA) {
    g->config.cpu_offload = 0;
    g->config.pin_memory = 0;
    return 0;
  } /* a CPU mesh: nothing to offload */
  if (g->n_params > 0 && (cpu_offload != 0) != g->config.cpu_offload)
    return eng_err("fully_shard: offload_policy %s, but the group's sharded parameters are on %s (with "
                   "CPUOffloadPolicy on a CUDA mesh they live on the CPU, else on the mesh's device)",
                   cpu_offload ? "CPUOffloadPolicy" : "OffloadPolicy()", g->config.cpu_offload ? "the CPU" : "cuda");
  g->config.cpu_offload = cpu_offload != 0;
  g->config.pin_memory = g->config.cpu_offload && pin_memory != 0;
  return 0;
}

int eng_fsdp_group_offload(const eng_fsdp_group* g) {
  return g ? (g->config.cpu_offload ? 1 + g->config.pin_memory : 0) : -1;
}

int eng_fsdp_group_set_overlap(eng_fsdp_group* g, int implicit_prefetch, int async_reduce) {
  if (!g) return eng_err("set_overlap: group is NULL");
  if (implicit_prefetch >= 0) g->config.implicit_prefetch = implicit_prefetch != 0;
  if (async_reduce >= 0) g->config.async_reduce = async_reduce != 0;
  return 0;
}
