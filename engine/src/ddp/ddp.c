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

typedef struct bucket {
  int n;             /* parameters */
  int* idx;          /* their indices into d->p */
  int64_t* off;      /* element offset of each in buf */
  eng_tensor* buf;   /* flat [numel], the bucket's dtype and device */
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

/* Start bucket k's all_reduce (avg). */
static int start(eng_ddp* d, int k) {
  bucket* b = &d->b[k];
  if (d->partial && eng_pg_size(d->pg) == 1) return 0; /* as the DTensor path: a group of one rank issues nothing */
  if (eng_pg_all_reduce(d->pg, b->buf, d->partial ? ENG_REDUCE_SUM : ENG_REDUCE_AVG, &b->work)) {
    eng_err_prefix("DistributedDataParallel: bucket %d of %d (%d parameters)", k, d->nb, b->n);
    return -1;
  }
  d->run_coll++;
  d->run_bytes += b->buf->numel * eng_dtype_size(b->buf->dtype);
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
  d->next = 0;
  d->queued = 0;
}

/* End of backward: start what is left (zero slices for gradients this rank did not produce), wait in order, copy
 * the averages back into the gradients this backward produced. */
static int finish(void* ud) {
  eng_ddp* d = ud;
  int rc = 0;
  for (int k = d->next; k < d->nb && !rc; k++) {
    bucket* b = &d->b[k];
    for (int j = 0; j < b->n && !rc; j++) {
      int i = b->idx[j];
      if (d->got[i]) continue;
      /* a gradient that is its slice (gradient_as_bucket_view) holds what this rank accumulated: it is reduced
       * as it is; otherwise the slice is zero */
      if (!(d->as_view && is_slice(d, i, d->p[i]->grad))) rc = eng_zero_elems(b->buf, b->off[j], d->p[i]->numel);
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
    if (wrc && !rc) { eng_err_prefix("DistributedDataParallel: bucket %d of %d", k, d->nb); rc = -1; }
  }
  for (int i = 0; i < d->np && !rc; i++) {
    eng_tensor* p = d->p[i];
    if (!p->grad) continue;
    if (is_slice(d, i, p->grad)) { eng_bump_version(p->grad); continue; } /* reduced in place */
    if (!d->got[i]) continue;
    eng_tensor* v = slice_of(d, i);
    rc = v ? eng_copy_raw(p->grad, v, v->stride) : -1;
    if (!rc) eng_bump_version(p->grad);
    eng_tensor_release(v);
  }
  if (!rc) { d->stat_coll = d->run_coll; d->stat_bytes = d->run_bytes; }
  d->run_coll = d->run_bytes = 0;
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
    d->b[d->bucket_of[i]].ready++;
  }
  return start_ready(d);
}

static uint64_t mix(uint64_t h, uint64_t v) { h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); return h; }

static eng_ddp* make(eng_pg* pg, int n, eng_tensor** params, int64_t bucket_bytes, int partial) {
  const char* op = partial ? "replicate_parameters (bucketed)" : "DistributedDataParallel";
  if (!pg) return eng_errp("%s: process group is NULL", op);
  if (n < 0 || (n > 0 && !params)) return eng_errp("%s: %d parameters given without a list", op, n);
  if (bucket_bytes <= 0) bucket_bytes = DEFAULT_BUCKET_BYTES;
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
  d->pg = eng_pg_retain(pg);
  d->p = calloc((size_t)(n ? n : 1), sizeof *d->p);
  d->hook = calloc((size_t)(n ? n : 1), sizeof *d->hook);
  d->ctx = calloc((size_t)(n ? n : 1), sizeof *d->ctx);
  d->bucket_of = calloc((size_t)(n ? n : 1), sizeof *d->bucket_of);
  d->offset_of = calloc((size_t)(n ? n : 1), sizeof *d->offset_of);
  d->got = calloc((size_t)(n ? n : 1), 1);
  d->b = calloc((size_t)(n ? n : 1), sizeof *d->b);
  if (!d->p || !d->hook || !d->ctx || !d->bucket_of || !d->offset_of || !d->got || !d->b) { eng_ddp_release(d); return eng_errp("%s: out of memory", op); }
  for (int i = 0; i < n; i++) if (params[i]->requires_grad) d->p[d->np++] = eng_tensor_retain(params[i]);
  /* buckets in reverse registration order, one dtype and device each, at most bucket_bytes (a larger parameter
   * gets a bucket of its own) */
  int cur = -1;
  int64_t cur_bytes = 0;
  for (int i = d->np - 1; i >= 0; i--) {
    eng_tensor* p = d->p[i];
    int64_t nbytes = p->numel * eng_dtype_size(p->dtype);
    bucket* b = cur >= 0 ? &d->b[cur] : NULL;
    const eng_tensor* first = b ? d->p[b->idx[0]] : NULL;
    if (!b || first->dtype != p->dtype || first->device != p->device || (cur_bytes > 0 && cur_bytes + nbytes > bucket_bytes)) {
      cur = d->nb++;
      b = &d->b[cur];
      cur_bytes = 0;
      b->idx = calloc((size_t)d->np, sizeof *b->idx);
      b->off = calloc((size_t)d->np, sizeof *b->off);
      if (!b->idx || !b->off) { eng_ddp_release(d); return eng_errp("%s: out of memory", op); }
    }
    b->off[b->n] = b->n ? b->off[b->n - 1] + d->p[b->idx[b->n - 1]]->numel : 0;
    b->idx[b->n++] = i;
    d->bucket_of[i] = cur;
    d->offset_of[i] = b->off[b->n - 1];
    cur_bytes += nbytes;
  }
  for (int k = 0; k < d->nb; k++) {
    bucket* b = &d->b[k];
    const eng_tensor* last = d->p[b->idx[b->n - 1]];
    int64_t numel = b->off[b->n - 1] + last->numel;
    b->buf = eng_new(1, &numel, last->dtype, last->device);
    if (!b->buf) { eng_ddp_release(d); return NULL; }
  }
  for (int i = 0; i < d->np; i++) {
    d->ctx[i] = (pctx){d, i};
    d->hook[i] = eng_tensor_register_post_accumulate_hook(d->p[i], post_acc, &d->ctx[i]);
    if (d->hook[i] < 0) { d->hook[i] = 0; eng_ddp_release(d); return NULL; }
  }
  return d;
}

eng_ddp* eng_ddp_new(eng_pg* pg, int n, eng_tensor** params, int64_t bucket_bytes) {
  return make(pg, n, params, bucket_bytes, 0);
}

eng_ddp* eng_ddp_new_partial(eng_pg* pg, int n, eng_tensor** params, int64_t bucket_bytes) {
  return make(pg, n, params, bucket_bytes, 1);
}

eng_ddp* eng_ddp_retain(eng_ddp* d) { if (d) d->refcount++; return d; }

void eng_ddp_release(eng_ddp* d) {
  if (!d || --d->refcount > 0) return;
  for (int i = 0; i < d->np; i++) {
    if (d->hook && d->hook[i] > 0) eng_tensor_remove_hook(d->p[i], d->hook[i]);
    eng_tensor_release(d->p[i]);
  }
  for (int k = 0; k < d->nb; k++) {
    if (d->b[k].work) { eng_work_wait(d->b[k].work); eng_work_release(d->b[k].work); }
    eng_tensor_release(d->b[k].buf);
    free(d->b[k].idx);
    free(d->b[k].off);
  }
  eng_pg_release(d->pg);
  free(d->p); free(d->hook); free(d->ctx); free(d->bucket_of); free(d->offset_of); free(d->got); free(d->b);
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

int eng_ddp_num_buckets(const eng_ddp* d) { return d ? d->nb : 0; }

int eng_ddp_bucket_info(const eng_ddp* d, int b, int* n_params, int64_t* bytes) {
  if (!d || b < 0 || b >= d->nb) return eng_err("DistributedDataParallel: bucket %d out of range (%d buckets)", b, d ? d->nb : 0);
  if (n_params) *n_params = d->b[b].n;
  if (bytes) *bytes = d->b[b].buf->numel * eng_dtype_size(d->b[b].buf->dtype);
  return 0;
}

int eng_ddp_last_stats(const eng_ddp* d, int64_t* collectives, int64_t* bytes) {
  if (!d) return eng_err("DistributedDataParallel: reducer is NULL");
  if (collectives) *collectives = d->stat_coll;
  if (bytes) *bytes = d->stat_bytes;
  return 0;
}
