/* ddp.c: the bucketed gradient reducer of data parallelism (engine/include/eng/ddp.h says what it does).
 * C hooks only: a post-accumulate hook per parameter and one end-of-backward callback per synced backward.
 *
 * Subsystem ddp/: DistributedDataParallel's reducer.  May call: core/, autograd/ (hooks, end-of-backward
 * callbacks, through the public API), comm/ (all_reduce, agreement). */
#include "core/internal.h"
#include "eng/comm.h"
#include "eng/ddp.h"
#include <stdio.h>

#define DEFAULT_BUCKET_BYTES ((int64_t)25 << 20)
#define NO_LIMIT INT64_MAX

typedef struct bucket {
  int n;             /* parameters */
  int* idx;          /* their indices into d->p */
  int64_t* off;      /* element offset of each in buf */
  eng_tensor* buf;   /* flat [gnumel (+ np flags in the last bucket)], the bucket's dtype and device */
  int64_t gnumel;    /* gradient elements */
  eng_tensor* cbuf;  /* the compress hook's copy of buf in its dtype (made at the first start) */
  int via_c;         /* this backward's all_reduce runs on cbuf */
  int ready;         /* parameters whose gradient this backward copied in */
  eng_work* work;    /* the all_reduce in flight */
} bucket;

typedef struct pctx { struct eng_ddp* d; int i; } pctx;

struct eng_ddp {
  int refcount;
  eng_pg* pg;
  int np;
  eng_tensor** p;
  int64_t* hook;
  pctx* ctx;
  int* bucket_of;
  int64_t* offset_of; /* parameter i's element offset in its bucket's buffer */
  uint8_t* got;      /* parameter i's gradient is in its bucket this backward */
  int nb;
  bucket* b;
  int next;          /* next bucket to start */
  int require_sync;
  int queued;        /* the end-of-backward callback is queued */
  int partial;       /* DTensor data parallelism: gradients are partial sums, each bucket all_reduce(sum) */
  int as_view;       /* gradient_as_bucket_view: each .grad is its slice of the bucket (no copies in or out) */
  int64_t cap, first_cap; /* bucket size limits after the rebuild: the first bucket's, then every other's */
  int rebuild_left;  /* synced backwards before the buckets are rebuilt in gradient order (0: never again) */
  int comm_hook;     /* the communication hook: 0 none yet, 1 allreduce_hook, 2 fp16 / 3 bf16 compress */
  int* order;        /* that backward's gradients, in the order they arrived (n_order of them) */
  int* src;          /* parameter i's position in the list given to eng_ddp_new */
  int n_order;
  int64_t stat_coll, stat_bytes, run_coll, run_bytes;
};

static eng_tensor* slice_of(const eng_ddp* d, int i) {
  const bucket* b = &d->b[d->bucket_of[i]];
  const eng_tensor* p = d->p[i];
  int64_t st[ENG_MAX_DIMS];
  eng_contiguous_strides(p->ndim, p->shape, st);
  return eng_view_of(b->buf, p->ndim, p->shape, st, b->buf->offset + d->offset_of[i]);
}

/* 1 when g is parameter i's slice of its bucket (gradient_as_bucket_view: the gradient lives in the bucket) */
static int is_slice(const eng_ddp* d, int i, const eng_tensor* g) {
  const bucket* b = &d->b[d->bucket_of[i]];
  return g && g->storage == b->buf->storage && g->offset == b->buf->offset + d->offset_of[i] &&
         eng_tensor_is_contiguous(g) && g->numel == d->p[i]->numel;
}

/* gradient_as_bucket_view: parameter i's gradient becomes its slice (its current values copied in first) */
static int adopt(eng_ddp* d, int i) {
  eng_tensor* p = d->p[i];
  if (!p->grad || is_slice(d, i, p->grad)) return 0;
  eng_tensor* v = slice_of(d, i);
  int rc = v ? eng_copy_raw(v, p->grad, p->grad->stride) : -1;
  if (!rc) rc = eng_tensor_set_grad(p, v);
  eng_tensor_release(v);
  return rc;
}

/* The last bucket carries, after its gradients, one flag per parameter: 1 where this rank has a gradient for it
 * (from this backward, or accumulated before it), 0 where it has none.  Reduced with the gradients, it tells every
 * rank which parameters some rank had a gradient for, without another collective: a rank that got none for a
 * parameter another rank used takes the reduced value too (PyTorch needs find_unused_parameters and one more
 * all_reduce for that; without it its ranks fail), so the ranks never diverge. */
static int write_flags(eng_ddp* d, bucket* b) {
  int64_t st = 1, n = d->np;
  eng_tensor* f = eng_view_of(b->buf, 1, &n, &st, b->buf->offset + b->gnumel);
  int rc = f ? eng_tensor_fill_(f, 1.0) : -1;
  eng_tensor_release(f);
  for (int i = 0; i < d->np && !rc; i++)
    if (!d->got[i] && (!d->p[i]->grad || d->partial)) rc = eng_zero_elems(b->buf, b->gnumel + i, 1);
  return rc;
}

/* Start bucket k's all_reduce (avg). */
static int start(eng_ddp* d, int k) {
  bucket* b = &d->b[k];
  if (d->partial && eng_pg_size(d->pg) == 1) return 0; /* as the DTensor path: a group of one rank issues nothing */
  if (k == d->nb - 1 && write_flags(d, b)) {
    eng_err_prefix("DistributedDataParallel: bucket %d of %d", k, d->nb);
    return -1;
  }
  /* fp16 / bf16 compress hooks (PyTorch's default_hooks): the bucket cast to the hook's dtype, averaged in it, cast
   * back when it is done */
  int cdt = d->comm_hook == 2 ? ENG_F16 : d->comm_hook == 3 ? ENG_BF16 : -1;
  b->via_c = cdt >= 0 && cdt != b->buf->dtype;
  if (b->via_c) {
    if (!b->cbuf && !(b->cbuf = eng_new(1, &b->buf->numel, cdt, b->buf->device))) return -1;
    if (eng_copy_raw(b->cbuf, b->buf, b->buf->stride)) return -1;
  }
  if (eng_pg_all_reduce(d->pg, b->via_c ? b->cbuf : b->buf, d->partial ? ENG_REDUCE_SUM : ENG_REDUCE_AVG, &b->work)) {
    eng_err_prefix("DistributedDataParallel: bucket %d of %d (%d parameters)", k, d->nb, b->n);
    return -1;
  }
  d->run_coll++;
  d->run_bytes += b->gnumel * eng_dtype_size(b->via_c ? b->cbuf->dtype : b->buf->dtype);
  return 0;
}

/* Start every bucket, in order, that is complete and whose predecessors have started. */
static int start_ready(eng_ddp* d) {
  while (d->next < d->nb && d->b[d->next].ready == d->b[d->next].n)
    if (start(d, d->next++)) return -1;
  return 0;
}

static void reset(eng_ddp* d) {
  for (int k = 0; k < d->nb; k++) {
    if (d->b[k].work) { eng_work_wait(d->b[k].work); eng_work_release(d->b[k].work); d->b[k].work = NULL; }
    d->b[k].ready = 0;
  }
  memset(d->got, 0, (size_t)d->np);
  d->n_order = 0;
  d->next = 0;
  d->queued = 0;
}

static int rebuild(eng_ddp* d);

/* The last bucket's reduced flags as host doubles (malloc'd), or NULL and an error. */
static double* read_flags(eng_ddp* d) {
  const bucket* b = &d->b[d->nb - 1];
  double* out = malloc((size_t)(d->np ? d->np : 1) * sizeof *out);
  if (!out) return eng_errp("DistributedDataParallel: out of memory");
  int64_t st = 1, n = d->np;
  eng_tensor* f = eng_view_of(b->buf, 1, &n, &st, b->buf->offset + b->gnumel);
  eng_tensor* h = f ? (f->device == ENG_CPU ? eng_tensor_retain(f) : eng_device_copy(f, ENG_CPU)) : NULL;
  eng_tensor* c = h ? eng_as_contig(h, ENG_F64) : NULL;
  if (c) memcpy(out, eng_ptr(c), (size_t)d->np * sizeof *out);
  eng_tensor_release(f); eng_tensor_release(h); eng_tensor_release(c);
  if (!c) { free(out); eng_err_prefix("DistributedDataParallel: reading the gradient flags"); return NULL; }
  return out;
}

/* End of backward: start what is left (a gradient this backward did not produce goes in as this rank holds it, or
 * zeros), wait in order, copy the averages back into the .grads, and give one to a parameter this rank has none
 * for when another rank had one (the flags); then, once, rebuild the buckets. */
static int finish(void* ud) {
  eng_ddp* d = ud;
  int rc = 0;
  for (int k = d->next; k < d->nb && !rc; k++) {
    bucket* b = &d->b[k];
    for (int j = 0; j < b->n && !rc; j++) {
      int i = b->idx[j];
      if (d->got[i]) continue;
      /* a gradient this backward did not produce (accumulated under no_sync) is reduced as it is: a slice
       * (gradient_as_bucket_view) already holds it, else it is copied in; no gradient: the slice is zero */
      eng_tensor* g = d->p[i]->grad;
      if (g && d->partial) g = NULL; /* a DTensor's .grad is already the sum over the ranks: not again */
      if (g && !is_slice(d, i, g)) {
        eng_tensor* v = slice_of(d, i);
        rc = v ? eng_copy_raw(v, g, g->stride) : -1;
        eng_tensor_release(v);
      } else if (!g) {
        rc = eng_zero_elems(b->buf, b->off[j], d->p[i]->numel);
      }
      b->ready++;
    }
  }
  if (!rc) rc = start_ready(d);
  for (int k = 0; k < d->nb; k++) {
    bucket* b = &d->b[k];
    if (!b->work) continue;
    int wrc = eng_work_wait(b->work);
    eng_work_release(b->work);
    b->work = NULL;
    if (!wrc && b->via_c) wrc = eng_copy_raw(b->buf, b->cbuf, b->cbuf->stride);
    if (wrc && !rc) { eng_err_prefix("DistributedDataParallel: bucket %d of %d", k, d->nb); rc = -1; }
  }
  double* used = NULL; /* the reduced flags, read only where this rank has no gradient for some parameter */
  for (int i = 0; i < d->np && !rc; i++) {
    eng_tensor* p = d->p[i];
    if (!p->grad || (d->partial && !d->got[i])) {
      if (d->partial) continue; /* DTensor data parallelism: the parameters no rank left out (as before) */
      if (!used && !(used = read_flags(d))) { rc = -1; break; }
      if (used[i] == 0.0) continue; /* no rank had a gradient: none here either */
      eng_tensor* v = slice_of(d, i); /* another rank's: this rank takes the reduced value too */
      eng_tensor* g = v && !d->as_view ? eng_new(v->ndim, v->shape, v->dtype, v->device) : eng_tensor_retain(v);
      rc = g && (d->as_view || !eng_copy_raw(g, v, v->stride)) ? eng_tensor_set_grad(p, g) : -1;
      eng_tensor_release(g); eng_tensor_release(v);
      continue;
    }
    if (is_slice(d, i, p->grad)) { eng_bump_version(p->grad); continue; } /* reduced in place */
    eng_tensor* v = slice_of(d, i);
    rc = v ? eng_copy_raw(p->grad, v, v->stride) : -1;
    if (!rc) eng_bump_version(p->grad);
    eng_tensor_release(v);
  }
  free(used);
  if (!rc) { d->stat_coll = d->run_coll; d->stat_bytes = d->run_bytes; }
  d->run_coll = d->run_bytes = 0;
  if (!rc && d->rebuild_left > 0 && --d->rebuild_left == 0) rc = rebuild(d);
  reset(d);
  eng_ddp_release(d); /* the reference the queued callback held */
  return rc;
}

static int post_acc(eng_tensor* t, eng_tensor* grad, eng_tensor** out, void* ud) {
  pctx* c = ud;
  eng_ddp* d = c->d;
  if (!d->require_sync || !t->grad) return 0;
  if (!d->queued) {
    if (eng_autograd_queue_callback(finish, eng_ddp_retain(d))) { eng_ddp_release(d); return -1; }
    d->queued = 1;
  }
  int i = c->i;
  const eng_tensor* g = t->grad;
  if (!(d->as_view && is_slice(d, i, g))) { /* else accumulated in its slice already */
    eng_tensor* v = slice_of(d, i);
    int rc = v ? 0 : -1;
    if (!rc && (g->device != v->device || g->ndim != v->ndim))
      rc = eng_err("DistributedDataParallel: the gradient %s of parameter %d does not match the parameter %s",
                   eng_desc(g), i, eng_desc(t));
    if (!rc) rc = eng_copy_raw(v, g, g->stride);
    /* gradient_as_bucket_view: from now on the gradient is the slice (the next backward accumulates into it) */
    if (!rc && d->as_view) rc = eng_tensor_set_grad(t, v);
    eng_tensor_release(v);
    if (rc) return -1;
  }
  if (!d->got[i]) { /* a gradient accumulated twice in one backward is copied again, counted once */
    d->got[i] = 1;
    if (d->rebuild_left == 1) d->order[d->n_order++] = i;
    d->b[d->bucket_of[i]].ready++;
  }
  return start_ready(d);
}

static uint64_t mix(uint64_t h, uint64_t v) { h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); return h; }

static void free_buckets(bucket* b, int nb) {
  for (int k = 0; k < nb; k++) {
    if (b[k].work) { eng_work_wait(b[k].work); eng_work_release(b[k].work); }
    eng_tensor_release(b[k].buf);
    eng_tensor_release(b[k].cbuf);
    free(b[k].idx);
    free(b[k].off);
  }
  free(b);
}

/* Buckets for the parameters taken in `order` (PyTorch's compute_bucket_assignment_by_size): one open bucket per
 * dtype and device; a parameter joins the open bucket of its kind, which closes (the next bucket to launch) once it
 * holds at least its limit, first_limit for the first bucket of each kind and limit after it; the buckets still open
 * come last, in the order their kinds first appeared.  by_index: instead, the buckets launch in descending order of
 * their first (smallest) parameter index (PyTorch's initial buckets: sorted by it, then reversed).  Within a bucket
 * the parameters keep their order.  Sets d->b, d->nb, bucket_of and offset_of (d->b is replaced only on success);
 * new zero buffers. */
static int assign(eng_ddp* d, const int* order, int64_t first_limit, int64_t limit, int by_index) {
  int np = d->np, nb = 0, na = 0, nprov = 0, rc = -1;
  size_t cap = (size_t)(np ? np : 1);
  /* a provisional bucket per opening; rank[]: its launch position */
  int *prov = malloc(cap * sizeof *prov), *rank = malloc(cap * sizeof *rank);
  int *cur = malloc(cap * sizeof *cur), *kdt = malloc(cap * sizeof *kdt), *kdev = malloc(cap * sizeof *kdev);
  int64_t *bytes = malloc(cap * sizeof *bytes), *lim = malloc(cap * sizeof *lim);
  bucket* b = calloc(cap, sizeof *b);
  if (!prov || !rank || !cur || !kdt || !kdev || !bytes || !lim || !b) {
    eng_err("DistributedDataParallel: out of memory");
    goto out;
  }
  for (int j = 0; j < np; j++) {
    const eng_tensor* p = d->p[order[j]];
    int k = 0;
    while (k < na && (kdt[k] != (int)p->dtype || kdev[k] != (int)p->device)) k++;
    if (k == na) { kdt[na] = (int)p->dtype; kdev[na] = (int)p->device; cur[na] = -1; lim[na] = first_limit; na++; }
    if (cur[k] < 0) { cur[k] = nprov; rank[nprov] = -1; nprov++; bytes[k] = 0; }
    prov[j] = cur[k];
    bytes[k] += p->numel * eng_dtype_size(p->dtype);
    if (bytes[k] >= lim[k]) { rank[cur[k]] = nb++; cur[k] = -1; lim[k] = limit; }
  }
  for (int k = 0; k < na; k++) if (cur[k] >= 0) rank[cur[k]] = nb++;
  if (by_index) { /* a bucket's first parameter in `order` is its smallest index when order is ascending */
    int* lead = malloc(cap * sizeof *lead);
    if (!lead) { eng_err("DistributedDataParallel: out of memory"); goto out; }
    for (int j = np - 1; j >= 0; j--) lead[prov[j]] = order[j]; /* ends at each bucket's first parameter */
    for (int q = 0; q < nprov; q++) { /* rank: how many buckets lead with a larger index */
      int r = 0;
      for (int u = 0; u < nprov; u++) r += lead[u] > lead[q];
      rank[q] = r;
    }
    free(lead);
  }
  for (int j = 0; j < np; j++) b[rank[prov[j]]].n++;
  for (int k = 0; k < nb; k++) {
    b[k].idx = malloc((size_t)b[k].n * sizeof *b[k].idx);
    b[k].off = malloc((size_t)b[k].n * sizeof *b[k].off);
    if (!b[k].idx || !b[k].off) { eng_err("DistributedDataParallel: out of memory"); goto out; }
    b[k].n = 0;
  }
  for (int j = 0; j < np; j++) {
    bucket* bk = &b[rank[prov[j]]];
    bk->off[bk->n] = bk->n ? bk->off[bk->n - 1] + d->p[bk->idx[bk->n - 1]]->numel : 0;
    bk->idx[bk->n++] = order[j];
  }
  for (int k = 0; k < nb; k++) {
    const eng_tensor* last = d->p[b[k].idx[b[k].n - 1]];
    b[k].gnumel = b[k].off[b[k].n - 1] + last->numel;
    int64_t numel = b[k].gnumel + (k == nb - 1 ? np : 0); /* the flags (write_flags) */
    if (!(b[k].buf = eng_new(1, &numel, last->dtype, last->device))) goto out;
  }
  for (int k = 0; k < nb; k++)
    for (int j = 0; j < b[k].n; j++) { d->bucket_of[b[k].idx[j]] = k; d->offset_of[b[k].idx[j]] = b[k].off[j]; }
  d->b = b; d->nb = nb; b = NULL;
  rc = 0;
out:
  if (b) free_buckets(b, nb);
  free(prov); free(rank); free(cur); free(kdt); free(kdev); free(bytes); free(lim);
  return rc;
}

/* After the first synced backward (the second with static_graph; PyTorch's rebuild_buckets): the buckets again, from
 * the order that backward's gradients arrived in (those that got none last, last registered first), with the first bucket at first_cap and the others
 * at cap, so the first all_reduce starts as soon as the last layers' gradients exist.  Every rank must build the
 * same buckets: one agreement compares the orders, and where they differ (rank-dependent graphs; PyTorch takes rank
 * 0's) every rank takes reverse registration order instead.  gradient_as_bucket_view moves each .grad into its new
 * slice. */
static int rebuild(eng_ddp* d) {
  const char* op = d->partial ? "replicate_parameters (bucketed)" : "DistributedDataParallel";
  int n = d->n_order;
  for (int i = d->np - 1; i >= 0; i--) if (!d->got[i]) d->order[n++] = i;
  if (eng_pg_size(d->pg) > 1) {
    uint64_t h = 1469598103934665603ull;
    for (int j = 0; j < d->np; j++) h = mix(h, (uint64_t)d->order[j]);
    int64_t v[2] = {(int64_t)(h >> 2), -(int64_t)(h >> 2)}; /* max and -min over the ranks */
    if (eng_pg_agree_max(d->pg, 0, 0, op, v, 2)) { eng_err_prefix("%s: rebuilding the buckets", op); return -1; }
    if (v[0] != -v[1])
      for (int j = 0; j < d->np; j++) d->order[j] = d->np - 1 - j;
  }
  bucket* old = d->b;
  int old_nb = d->nb;
  if (assign(d, d->order, d->first_cap, d->cap, 0)) {
    d->b = old; d->nb = old_nb; /* unchanged: bucket_of and offset_of are set only on success */
    eng_err_prefix("%s: rebuilding the buckets", op);
    return -1;
  }
  int rc = 0;
  for (int i = 0; i < d->np && d->as_view && !rc; i++) rc = adopt(d, i);
  free_buckets(old, old_nb);
  if (rc) eng_err_prefix("%s: gradient_as_bucket_view after rebuilding the buckets", op);
  return rc;
}

static eng_ddp* make(eng_pg* pg, int n, eng_tensor** params, int64_t bucket_bytes, int64_t first_bytes,
                     int rebuild_after, int partial) {
  const char* op = partial ? "replicate_parameters (bucketed)" : "DistributedDataParallel";
  if (!pg) return eng_errp("%s: process group is NULL", op);
  if (n < 0 || (n > 0 && !params)) return eng_errp("%s: %d parameters given without a list", op, n);
  if (bucket_bytes <= 0) bucket_bytes = DEFAULT_BUCKET_BYTES;
  if (first_bytes <= 0) first_bytes = bucket_bytes;
  if (rebuild_after < 0 || rebuild_after > 2)
    return eng_errp("%s: rebuild_after must be 0, 1 or 2, got %d", op, rebuild_after);
  /* local checks, then one agreement over the group (shapes and dtypes hashed): the same error everywhere */
  int err = 0;
  uint64_t key = 1469598103934665603ull;
  for (int i = 0; i < n && !err; i++) {
    eng_tensor* p = params[i];
    if (!p) { err = 1; eng_err("%s: parameter %d is NULL", op, i); break; }
    if (p->dist && !partial) { err = 1; eng_err("%s: parameter %d is a DTensor %s: DistributedDataParallel takes plain "
                                                "tensors (use replicate_parameters or fully_shard for DTensors)", op, i,
                                                eng_desc(p)); break; }
    if (!p->dist && partial && p->requires_grad) {
      err = 1; eng_err("%s: parameter %d %s is a plain tensor: the bucketed DTensor path takes DTensors whose "
                       "gradients are partial sums (replicate_parameters)", op, i, eng_desc(p)); break; }
    if (p->grad_fn) { err = 1; eng_err("%s: parameter %d %s is not a leaf", op, i, eng_desc(p)); break; }
    if (p->device == ENG_META) { err = 1; eng_err("%s: parameter %d %s is on the meta device", op, i, eng_desc(p)); break; }
    if (!p->requires_grad) continue;
    key = mix(key, (uint64_t)p->dtype);
    key = mix(key, (uint64_t)p->device);
    for (int k = 0; k < p->ndim; k++) key = mix(key, (uint64_t)p->shape[k]);
    key = mix(key, 0xfeedull);
  }
  if (eng_pg_agree(pg, err, key, op)) return NULL;
  if (!eng_pg_is_member(pg)) return eng_errp("%s: this rank is not a member of the process group %s", op, eng_pg_name(pg));
  eng_ddp* d = calloc(1, sizeof *d);
  if (!d) return eng_errp("%s: out of memory", op);
  d->refcount = 1;
  d->require_sync = 1;
  d->partial = partial;
  d->cap = bucket_bytes;
  d->first_cap = first_bytes;
  d->rebuild_left = rebuild_after;
  d->pg = eng_pg_retain(pg);
  size_t cap = (size_t)(n ? n : 1);
  d->p = calloc(cap, sizeof *d->p);
  d->hook = calloc(cap, sizeof *d->hook);
  d->ctx = calloc(cap, sizeof *d->ctx);
  d->bucket_of = calloc(cap, sizeof *d->bucket_of);
  d->offset_of = calloc(cap, sizeof *d->offset_of);
  d->got = calloc(cap, 1);
  d->order = calloc(cap, sizeof *d->order);
  d->src = calloc(cap, sizeof *d->src);
  if (!d->p || !d->hook || !d->ctx || !d->bucket_of || !d->offset_of || !d->got || !d->order || !d->src) {
    eng_ddp_release(d);
    return eng_errp("%s: out of memory", op);
  }
  for (int i = 0; i < n; i++)
    if (params[i]->requires_grad) { d->src[d->np] = i; d->p[d->np++] = eng_tensor_retain(params[i]); }
  /* until the rebuild, as PyTorch: one bucket of every parameter per dtype and device (registration order), reduced
   * when backward ends; never rebuilt (find_unused_parameters): buckets by size in registration order */
  for (int i = 0; i < d->np; i++) d->order[i] = i;
  int64_t lim0 = rebuild_after ? NO_LIMIT : first_bytes, lim = rebuild_after ? NO_LIMIT : bucket_bytes;
  if (assign(d, d->order, lim0, lim, 1)) { eng_ddp_release(d); return NULL; }
  for (int i = 0; i < d->np; i++) {
    d->ctx[i] = (pctx){d, i};
    d->hook[i] = eng_tensor_register_post_accumulate_hook(d->p[i], post_acc, &d->ctx[i]);
    if (d->hook[i] < 0) { d->hook[i] = 0; eng_ddp_release(d); return NULL; }
  }
  return d;
}

eng_ddp* eng_ddp_new(eng_pg* pg, int n, eng_tensor** params, int64_t bucket_bytes, int64_t first_bucket_bytes,
                     int rebuild_after) {
  return make(pg, n, params, bucket_bytes, first_bucket_bytes, rebuild_after, 0);
}

eng_ddp* eng_ddp_new_partial(eng_pg* pg, int n, eng_tensor** params, int64_t bucket_bytes, int64_t first_bucket_bytes,
                             int rebuild_after) {
  return make(pg, n, params, bucket_bytes, first_bucket_bytes, rebuild_after, 1);
}

eng_ddp* eng_ddp_retain(eng_ddp* d) { if (d) d->refcount++; return d; }

void eng_ddp_release(eng_ddp* d) {
  if (!d || --d->refcount > 0) return;
  for (int i = 0; i < d->np; i++) {
    if (d->hook && d->hook[i] > 0) eng_tensor_remove_hook(d->p[i], d->hook[i]);
    eng_tensor_release(d->p[i]);
  }
  if (d->b) free_buckets(d->b, d->nb);
  eng_pg_release(d->pg);
  free(d->p); free(d->hook); free(d->ctx); free(d->bucket_of); free(d->offset_of); free(d->got); free(d->order); free(d->src);
  free(d);
}

int eng_ddp_set_require_sync(eng_ddp* d, int on) {
  if (!d) return eng_err("DistributedDataParallel: reducer is NULL");
  if (d->queued) return eng_err("DistributedDataParallel: no_sync cannot change while a backward is running");
  d->require_sync = on ? 1 : 0;
  return 0;
}

int eng_ddp_set_gradient_as_bucket_view(eng_ddp* d, int on) {
  if (!d) return eng_err("DistributedDataParallel: reducer is NULL");
  if (d->queued) return eng_err("DistributedDataParallel: gradient_as_bucket_view cannot change while a backward is running");
  if (on && d->partial)
    return eng_err("replicate_parameters (bucketed): gradient_as_bucket_view is for DistributedDataParallel's plain "
                   "tensors (DTensor gradients keep their own storage)");
  d->as_view = on ? 1 : 0;
  for (int i = 0; i < d->np && on; i++)
    if (adopt(d, i)) { eng_err_prefix("DistributedDataParallel: gradient_as_bucket_view"); return -1; }
  return 0;
}

int eng_ddp_set_comm_hook(eng_ddp* d, int hook) {
  if (!d) return eng_err("register_comm_hook: reducer is NULL");
  if (hook < 1 || hook > 3) return eng_err("register_comm_hook: unknown built-in hook %d (1 allreduce, 2 fp16, 3 bf16)", hook);
  if (d->partial) return eng_err("register_comm_hook: the DTensor reducer (replicate_parameters) takes no hook");
  if (d->comm_hook) return eng_err("register_comm_hook: a communication hook is registered already (it can only be "
                              "registered once, as PyTorch's)");
  if (d->queued) return eng_err("register_comm_hook: not while a backward is running");
  d->comm_hook = hook;
  return 0;
}

int eng_ddp_num_buckets(const eng_ddp* d) { return d ? d->nb : 0; }

int eng_ddp_bucket_info(const eng_ddp* d, int b, int* n_params, int64_t* bytes) {
  if (!d || b < 0 || b >= d->nb) return eng_err("DistributedDataParallel: bucket %d out of range (%d buckets)", b, d ? d->nb : 0);
  if (n_params) *n_params = d->b[b].n;
  if (bytes) *bytes = d->b[b].gnumel * eng_dtype_size(d->b[b].buf->dtype);
  return 0;
}

int eng_ddp_bucket_params(const eng_ddp* d, int b, int* out, int cap) {
  if (!d || b < 0 || b >= d->nb) return eng_err("DistributedDataParallel: bucket %d out of range (%d buckets)", b, d ? d->nb : 0);
  if (cap < d->b[b].n || !out) return eng_err("DistributedDataParallel: bucket %d has %d parameters, room for %d", b, d->b[b].n, cap);
  for (int j = 0; j < d->b[b].n; j++) out[j] = d->src[d->b[b].idx[j]];
  return d->b[b].n;
}

int eng_ddp_last_stats(const eng_ddp* d, int64_t* collectives, int64_t* bytes) {
  if (!d) return eng_err("DistributedDataParallel: reducer is NULL");
  if (collectives) *collectives = d->stat_coll;
  if (bytes) *bytes = d->stat_bytes;
  return 0;
}
