/* redistribute.c: redistribute a DTensor between placements, as planned by
 * PyTorch's _redistribute.py (greedy plan: gathers inner to outer, then
 * shards outer to inner; dtensor/spec.c builds the plan).  Each per-mesh-dim
 * transition is an entry of a table {check, apply, backward}:
 *
 *   S(d) -> R     all_gather along d (local padded to ceil(L/k), result narrowed to L)
 *   R -> S(d)     local torch.chunk copy, no communication
 *   P -> R        all_reduce(op)
 *   P -> S(d)     reduce_scatter(op) along d (input padded to k*ceil(n/k))
 *   S(a) -> S(b)  all_to_all (a padded to ceil(La/k), b to k*ceil(nb/k))
 *   R -> P        internal only: sum divides by k; avg/max/min keep the value;
 *                 in backward passes the value through (grads never become Partial)
 *   SS -> R       _StridedShard: all_gather (locals padded to coordinate 0's
 *                 size), then the chunks put back in place (dtensor/strided_shard.c)
 *   R -> SS       _StridedShard: local copy of this coordinate's chunks
 * Every other change involving a _StridedShard is planned as two steps
 * through Replicate on that mesh dim (dtensor/spec.c); _StridedShard -> Partial
 * is an error like Shard -> Partial.
 *
 * The collectives of eng/comm.h work along dim 0; other dims go through a
 * view with the dim moved to the front.  Dim 0 needs no copies beyond the
 * collective itself (uneven shards only fill the padding); other dims copy
 * once into the send buffer and once out of the receive buffer.
 *
 * Plans are cached per (mesh shape, coordinate, placements, global shape).
 * One autograd node per redistribute call: its backward redistributes the
 * gradient to the source placements with every Partial replaced by
 * Replicate.  Async: the last collective of a plan may be left pending; its
 * result's storage is registered and eng_dtensor_wait finishes it. */
#include "dtensor/dtensor_impl.h"
#include "comm/comm_impl.h"
#include "autograd/autograd.h"
#include "eng/ops_pointwise.h"
#include <pthread.h>
#include <stdio.h>

/* ------------------------------------------------------------------ helpers */
static int64_t cdiv(int64_t a, int64_t b) { return b > 0 ? (a + b - 1) / b : 0; }

static void chunk_of(int64_t n, int64_t k, int64_t idx, int64_t* size, int64_t* off) {
  int64_t full = cdiv(n, k);
  int64_t o = idx * full;
  if (o > n) o = n;
  *size = n - o < full ? n - o : full;
  if (off) *off = o;
}

eng_tensor* dt_plain(const eng_tensor* t) { return eng_view_of(t, t->ndim, t->shape, t->stride, t->offset); }

void dt_attach(eng_tensor* t, eng_dist_spec* s) {
  eng_dist_spec* old = t->dist;
  t->dist = eng_dist_spec_retain(s);
  if (old) eng_dist_spec_release(old);
}

static eng_tensor* new_like_shape(const eng_tensor* x, int ndim, const int64_t* shape) {
  return eng_new(ndim, shape, x->dtype, x->device);
}

/* View of x with dim d moved to the front (other dims keep their order). */
static void front_geometry(const eng_tensor* x, int d, int64_t* shape, int64_t* stride) {
  int k = 0;
  shape[k] = x->shape[d]; stride[k] = x->stride[d]; k++;
  for (int j = 0; j < x->ndim; j++) if (j != d) { shape[k] = x->shape[j]; stride[k] = x->stride[j]; k++; }
}

/* Geometry of a contiguous front-ordered buffer (dim d first, rows rows)
 * seen in the original dim order with dim d of size n: strides only. */
static void back_strides(int ndim, int d, const int64_t* front_stride, int64_t* stride) {
  int k = 1;
  for (int j = 0; j < ndim; j++) stride[j] = j == d ? front_stride[0] : front_stride[k++];
}

eng_tensor* dt_narrow_view(const eng_tensor* x, int d, int64_t start, int64_t len) {
  int64_t shape[ENG_MAX_DIMS];
  for (int j = 0; j < x->ndim; j++) shape[j] = x->shape[j];
  shape[d] = len;
  return eng_view_of(x, x->ndim, shape, x->stride, x->offset + start * x->stride[d]);
}

static void copy_into(eng_tensor* dst, const eng_tensor* src) {
  if (dst->numel > 0) eng_copy_raw(dst, src, src->stride);
}

/* Zero-filled contiguous tensor when `zero`, else uninitialized. */
static eng_tensor* buffer(const eng_tensor* like, int ndim, const int64_t* shape, int zero) {
  eng_tensor* t = new_like_shape(like, ndim, shape);
  if (t && zero && eng_zero_elems(t, 0, t->numel)) { eng_tensor_release(t); return NULL; }
  return t;
}

/* ------------------------------------------------------------------ pending (async) results */
typedef struct pending {
  eng_work* work;
  int kind;               /* 0 nothing after the wait, 1 strided copy, 2 all_to_all chunks */
  eng_tensor* src;        /* kind 1: view over the receive buffer; kind 2: the buffer */
  eng_tensor* result;     /* the tensor handed out (its storage is the key) */
  int a, k;
  int64_t fa, La, cs[ENG_MAX_DIMS];
  struct pending* next;
} pending;

static pthread_mutex_t g_pend_mu = PTHREAD_MUTEX_INITIALIZER;
static pending* g_pend;
static int g_npend;

static void a2a_unpack(pending* p) {
  /* result[.., i*fa + ia, .., ib, ..] = buf[i][.., ia, .., ib, ..] */
  eng_tensor* buf = p->src;
  eng_tensor* F = p->result;
  int nd = F->ndim;
  int64_t cst[ENG_MAX_DIMS];
  eng_contiguous_strides(nd, p->cs, cst);
  int64_t cn = eng_shape_numel(nd, p->cs);
  for (int i = 0; i < p->k; i++) {
    int64_t va = p->La - i * p->fa;
    if (va > p->fa) va = p->fa;
    if (va <= 0) break;
    int64_t shape[ENG_MAX_DIMS];
    for (int j = 0; j < nd; j++) shape[j] = F->shape[j];
    shape[p->a] = va;
    eng_tensor* s = eng_view_of(buf, nd, shape, cst, buf->offset + i * cn);
    eng_tensor* d = eng_view_of(F, nd, shape, F->stride, F->offset + i * p->fa * F->stride[p->a]);
    if (s && d) copy_into(d, s);
    eng_tensor_release(s);
    eng_tensor_release(d);
  }
}

static int pending_finish(pending* p) {
  int rc = 0;
  if (p->work) rc = eng_work_wait(p->work);
  if (!rc) {
    if (p->kind == 1) copy_into(p->result, p->src);
    else if (p->kind == 2) a2a_unpack(p);
  }
  eng_work_release(p->work);
  eng_tensor_release(p->src);
  eng_tensor_release(p->result);
  p->work = NULL; p->src = NULL; p->result = NULL;
  return rc;
}

static void pending_register(pending* p) {
  pending* q = malloc(sizeof *q);
  if (!q) { pending_finish(p); return; } /* degrade to synchronous */
  *q = *p;
  pthread_mutex_lock(&g_pend_mu);
  /* results nobody holds any more: finish them now */
  for (pending** pp = &g_pend; *pp;) {
    pending* e = *pp;
    if (e->result->refcount == 1) { /* only the registry holds it: waiting early is always safe */
      *pp = e->next; __atomic_sub_fetch(&g_npend, 1, __ATOMIC_RELEASE);
      pending_finish(e); free(e);
    } else pp = &e->next;
  }
  q->next = g_pend;
  g_pend = q;
  __atomic_add_fetch(&g_npend, 1, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&g_pend_mu);
}

int eng_dtensor_wait(eng_tensor* t) {
  if (!t || !__atomic_load_n(&g_npend, __ATOMIC_ACQUIRE)) return 0;
  int rc = 0;
  pthread_mutex_lock(&g_pend_mu);
  for (pending** pp = &g_pend; *pp;) {
    pending* e = *pp;
    if (e->result->storage == t->storage) {
      *pp = e->next; __atomic_sub_fetch(&g_npend, 1, __ATOMIC_RELEASE);
      if (pending_finish(e)) rc = -1;
      free(e);
    } else pp = &e->next;
  }
  pthread_mutex_unlock(&g_pend_mu);
  if (rc) eng_err_prefix("DTensor wait (async redistribute)");
  return rc;
}

int eng_dtensor_is_pending(const eng_tensor* t) {
  if (!t || !__atomic_load_n(&g_npend, __ATOMIC_ACQUIRE)) return 0;
  int r = 0;
  pthread_mutex_lock(&g_pend_mu);
  for (pending* e = g_pend; e; e = e->next) if (e->result->storage == t->storage) { r = 1; break; }
  pthread_mutex_unlock(&g_pend_mu);
  return r;
}

int eng_dtensor_wait_all(void) {
  int rc = 0;
  pthread_mutex_lock(&g_pend_mu);
  while (g_pend) {
    pending* e = g_pend;
    g_pend = e->next; __atomic_sub_fetch(&g_npend, 1, __ATOMIC_RELEASE);
    if (pending_finish(e)) rc = -1;
    free(e);
  }
  pthread_mutex_unlock(&g_pend_mu);
  return rc;
}

/* ------------------------------------------------------------------ transitions */
typedef struct step_ctx {
  const char* op;
  eng_pg* pg;
  int k, coord, mesh_dim;
  const int64_t* ls;   /* logical shape on this mesh dim */
  int async;           /* leave this step's collective pending */
  int is_backward;
  int owned;           /* the input is a temporary of this plan */
  pending* pend;       /* filled by a collective step */
} step_ctx;

/* Issues the collective (blocking unless ctx->async) and finishes it when
 * blocking.  kind/src/result describe the post-processing. */
static eng_tensor* complete(step_ctx* c, int rc, eng_work* w, int kind, eng_tensor* src, eng_tensor* result) {
  if (rc) {
    eng_work_release(w); eng_tensor_release(src); eng_tensor_release(result);
    return NULL;
  }
  c->pend->work = w;
  c->pend->kind = kind;
  c->pend->src = src;
  c->pend->result = eng_tensor_retain(result);
  if (!c->async) {
    if (pending_finish(c->pend)) { eng_tensor_release(result); return NULL; }
  }
  return result;
}

static eng_tensor* empty_result(const eng_tensor* x, int d1, int64_t s1, int d2, int64_t s2) {
  int64_t shape[ENG_MAX_DIMS];
  for (int j = 0; j < x->ndim; j++) shape[j] = x->shape[j];
  if (d1 >= 0) shape[d1] = s1;
  if (d2 >= 0) shape[d2] = s2;
  return new_like_shape(x, x->ndim, shape);
}

static int check_local_size(step_ctx* c, const eng_tensor* x, int d, int64_t L) {
  int64_t want;
  chunk_of(L, c->k, c->coord, &want, NULL);
  if (x->shape[d] != want)
    return eng_err("%s: the local shard %s has %lld entries on dim %d, but Shard of %lld entries over %d ranks "
                   "gives %lld at mesh coordinate %d of mesh dim %d", c->op, eng_desc(x), (long long)x->shape[d], d + dt_base(),
                   (long long)L, c->k, (long long)want, c->coord, c->mesh_dim + dt_base());
  return 0;
}

/* Synchronous exchanges of at least this many logical bytes take the
 * single-copy path (comm/cma.c) when the group allows it: no pack, no
 * padding, no unpack.  Smaller ones are latency-bound and keep the one MPI
 * collective.  The test depends only on the logical shape, so every rank of
 * the group decides the same. */
#define CMA_MIN_BYTES (256 << 10)

/* 0 done (*out set), 1 not taken (take the MPI path), -1 error.  bad: this
 * rank's local shard failed its checks (message set): on the single-copy
 * path every rank of the group then fails with it instead of waiting. */
static int try_cma(step_ctx* c, eng_tensor* x, int kind, int split, int cat, const int64_t* out_shape, int bad,
                   eng_tensor** out) {
  *out = NULL;
  int usable = c->async || eng_shape_numel(x->ndim, c->ls) * eng_dtype_size(x->dtype) < CMA_MIN_BYTES
                   ? 0 : comm_cma_usable(c->pg, x->device);
  if (usable < 0) return -1; /* the members met different operations (error set on every member) */
  if (!usable) return bad ? -1 : 1;
  eng_tensor* o = bad ? NULL : new_like_shape(x, x->ndim, out_shape);
  int rc = comm_cma_exchange(c->pg, c->op, kind, o, x, split, cat, bad || !o);
  if (rc) { eng_tensor_release(o); return rc; }
  *out = o;
  return 0;
}

/* S(d) -> R: all_gather along d. */
static eng_tensor* apply_s2r(step_ctx* c, eng_tensor* x, const eng_placement* s, const eng_placement* t) {
  int d = s->dim, nd = x->ndim, k = c->k;
  int64_t L = c->ls[d], full = cdiv(L, k), m = x->shape[d];
  int bad = check_local_size(c, x, d, L);
  int64_t fs[ENG_MAX_DIMS] = {0}, fst[ENG_MAX_DIMS] = {0};
  front_geometry(x, d, fs, fst);
  int64_t rest = eng_shape_numel(nd - 1, fs + 1);
  if (!bad && (full == 0 || rest == 0)) return empty_result(x, d, L, -1, 0);
  {
    int64_t os[ENG_MAX_DIMS];
    for (int j = 0; j < nd; j++) os[j] = x->shape[j];
    os[d] = L;
    eng_tensor* o;
    int rc = try_cma(c, x, ENG_COLL_ALL_GATHER, -1, d, os, bad, &o);
    if (rc <= 0) return o;
  }
  eng_tensor* send;
  if (m == full) send = eng_view_of(x, nd, fs, fst, x->offset);
  else {
    int64_t ps[ENG_MAX_DIMS];
    memcpy(ps, fs, sizeof ps);
    ps[0] = full;
    send = buffer(x, nd, ps, 0);
    if (!send) return NULL;
    if (eng_zero_elems(send, m * rest, (full - m) * rest)) { eng_tensor_release(send); return NULL; }
    if (m > 0) {
      eng_tensor* xv = eng_view_of(x, nd, fs, fst, x->offset);
      int64_t ms[ENG_MAX_DIMS];
      memcpy(ms, fs, sizeof ms);
      ms[0] = m;
      eng_tensor* dv = eng_view_of(send, nd, ms, send->stride, 0);
      copy_into(dv, xv);
      eng_tensor_release(xv); eng_tensor_release(dv);
    }
  }
  if (!send) return NULL;
  int64_t rs[ENG_MAX_DIMS];
  memcpy(rs, fs, sizeof rs);
  rs[0] = (int64_t)k * full;
  eng_tensor* R = buffer(x, nd, rs, 0);
  if (!R) { eng_tensor_release(send); return NULL; }
  eng_work* w = NULL;
  int rc = eng_pg_all_gather_into(c->pg, R, send, c->async ? &w : NULL);
  eng_tensor_release(send);
  int64_t shape[ENG_MAX_DIMS], st[ENG_MAX_DIMS];
  for (int j = 0; j < nd; j++) shape[j] = x->shape[j];
  shape[d] = L;
  eng_tensor* out;
  if (d == 0) {
    eng_contiguous_strides(nd, shape, st);
    out = eng_view_of(R, nd, shape, st, 0);
    eng_tensor_release(R);
    if (!out) { eng_work_release(w); return NULL; }
    return complete(c, rc, w, 0, NULL, out);
  }
  back_strides(nd, d, R->stride, st);
  eng_tensor* src = eng_view_of(R, nd, shape, st, 0);
  eng_tensor_release(R);
  out = new_like_shape(x, nd, shape);
  if (!src || !out) { eng_tensor_release(src); eng_tensor_release(out); eng_work_release(w); return NULL; }
  return complete(c, rc, w, 1, src, out);
}

/* R -> S(d): this rank's torch.chunk piece, copied. */
static eng_tensor* apply_r2s(step_ctx* c, eng_tensor* x, const eng_placement* s, const eng_placement* t) {
  int d = t->dim;
  int64_t sz, off;
  chunk_of(x->shape[d], c->k, c->coord, &sz, &off);
  eng_tensor* v = dt_narrow_view(x, d, off, sz);
  if (!v) return NULL;
  eng_tensor* out = new_like_shape(x, x->ndim, v->shape);
  if (out) copy_into(out, v);
  eng_tensor_release(v);
  return out;
}

/* P -> R: all_reduce, in place on a temporary of this plan, else out of
 * place from the input into the result (no copy of the input first). */
static eng_tensor* apply_p2r(step_ctx* c, eng_tensor* x, const eng_placement* s, const eng_placement* t) {
  eng_tensor* out;
  int in_place = c->owned && x->refcount == 1 && x->storage->refcount == 1 && eng_tensor_is_contiguous(x);
  if (in_place) out = eng_tensor_retain(x);
  else out = new_like_shape(x, x->ndim, x->shape);
  if (!out) return NULL;
  if (out->numel == 0) return out;
  eng_work* w = NULL;
  int rc = in_place ? eng_pg_all_reduce(c->pg, out, s->op, c->async ? &w : NULL)
                    : eng_pg_all_reduce_into(c->pg, out, x, s->op, c->async ? &w : NULL);
  return complete(c, rc, w, 0, NULL, out);
}

/* P -> S(d): reduce_scatter along d. */
static eng_tensor* apply_p2s(step_ctx* c, eng_tensor* x, const eng_placement* s, const eng_placement* t) {
  int d = t->dim, nd = x->ndim, k = c->k;
  int64_t n = x->shape[d], full = cdiv(n, k), ms;
  chunk_of(n, k, c->coord, &ms, NULL);
  int64_t fs[ENG_MAX_DIMS] = {0}, fst[ENG_MAX_DIMS] = {0};
  front_geometry(x, d, fs, fst);
  int64_t rest = eng_shape_numel(nd - 1, fs + 1);
  if (full == 0 || rest == 0) return empty_result(x, d, ms, -1, 0);
  eng_tensor* send;
  if (n == (int64_t)k * full) send = eng_view_of(x, nd, fs, fst, x->offset);
  else {
    int64_t ps[ENG_MAX_DIMS];
    memcpy(ps, fs, sizeof ps);
    ps[0] = (int64_t)k * full;
    send = buffer(x, nd, ps, 0);
    if (!send) return NULL;
    if (eng_zero_elems(send, n * rest, (ps[0] - n) * rest)) { eng_tensor_release(send); return NULL; }
    eng_tensor* xv = eng_view_of(x, nd, fs, fst, x->offset);
    int64_t vs[ENG_MAX_DIMS];
    memcpy(vs, fs, sizeof vs);
    eng_tensor* dv = eng_view_of(send, nd, vs, send->stride, 0);
    copy_into(dv, xv);
    eng_tensor_release(xv); eng_tensor_release(dv);
  }
  if (!send) return NULL;
  int64_t rs[ENG_MAX_DIMS];
  memcpy(rs, fs, sizeof rs);
  rs[0] = full;
  eng_tensor* R = buffer(x, nd, rs, 0);
  if (!R) { eng_tensor_release(send); return NULL; }
  eng_work* w = NULL;
  int rc = eng_pg_reduce_scatter_into(c->pg, R, send, s->op, c->async ? &w : NULL);
  eng_tensor_release(send);
  int64_t shape[ENG_MAX_DIMS], st[ENG_MAX_DIMS];
  for (int j = 0; j < nd; j++) shape[j] = x->shape[j];
  shape[d] = ms;
  if (d == 0) {
    eng_contiguous_strides(nd, shape, st);
    eng_tensor* out = eng_view_of(R, nd, shape, st, 0);
    eng_tensor_release(R);
    if (!out) { eng_work_release(w); return NULL; }
    return complete(c, rc, w, 0, NULL, out);
  }
  back_strides(nd, d, R->stride, st);
  eng_tensor* src = eng_view_of(R, nd, shape, st, 0);
  eng_tensor_release(R);
  eng_tensor* out = new_like_shape(x, nd, shape);
  if (!src || !out) { eng_tensor_release(src); eng_tensor_release(out); eng_work_release(w); return NULL; }
  return complete(c, rc, w, 1, src, out);
}

/* S(a) -> S(b): all_to_all. */
static eng_tensor* apply_s2s(step_ctx* c, eng_tensor* x, const eng_placement* s, const eng_placement* t) {
  int a = s->dim, b = t->dim, nd = x->ndim, k = c->k;
  int64_t La = c->ls[a], nb = c->ls[b];
  int bad = check_local_size(c, x, a, La);
  if (!bad && x->shape[b] != nb)
    bad = eng_err("%s: the local shard %s has %lld entries on dim %d, expected %lld (the logical size before "
                  "sharding it on mesh dim %d)", c->op, eng_desc(x), (long long)x->shape[b], b + dt_base(), (long long)nb,
                  c->mesh_dim + dt_base());
  int64_t fa = cdiv(La, k), ma = x->shape[a], fb = cdiv(nb, k), mb;
  chunk_of(nb, k, c->coord, &mb, NULL);
  int64_t cs[ENG_MAX_DIMS], cst[ENG_MAX_DIMS];
  for (int j = 0; j < nd; j++) cs[j] = x->shape[j];
  cs[a] = fa; cs[b] = fb;
  int64_t cn = eng_shape_numel(nd, cs);
  if (!bad && cn == 0) return empty_result(x, a, La, b, mb);
  {
    int64_t os[ENG_MAX_DIMS];
    for (int j = 0; j < nd; j++) os[j] = x->shape[j];
    os[a] = La; os[b] = mb;
    eng_tensor* o;
    int rc = try_cma(c, x, ENG_COLL_ALL_TO_ALL, b, a, os, bad, &o);
    if (rc <= 0) return o;
  }
  eng_contiguous_strides(nd, cs, cst);
  int64_t bs[2] = {k, cn};
  eng_tensor* send;
  if (b == 0 && ma == fa && nb == (int64_t)k * fb && eng_tensor_is_contiguous(x)) {
    int64_t st2[2] = {cn, 1};
    send = eng_view_of(x, 2, bs, st2, x->offset);
  } else {
    send = buffer(x, 2, bs, ma < fa || nb < (int64_t)k * fb);
    if (!send) return NULL;
    for (int j = 0; j < k && ma > 0; j++) {
      int64_t vb = nb - j * fb;
      if (vb > fb) vb = fb;
      if (vb <= 0) break;
      int64_t vs[ENG_MAX_DIMS];
      for (int q = 0; q < nd; q++) vs[q] = x->shape[q];
      vs[b] = vb;
      eng_tensor* dv = eng_view_of(send, nd, vs, cst, j * cn);
      eng_tensor* sv = eng_view_of(x, nd, vs, x->stride, x->offset + j * fb * x->stride[b]);
      if (dv && sv) copy_into(dv, sv);
      eng_tensor_release(dv); eng_tensor_release(sv);
    }
  }
  if (!send) return NULL;
  eng_tensor* R = buffer(x, 2, bs, 0);
  if (!R) { eng_tensor_release(send); return NULL; }
  eng_work* w = NULL;
  int rc = eng_pg_all_to_all_into(c->pg, R, send, c->async ? &w : NULL);
  eng_tensor_release(send);
  int64_t shape[ENG_MAX_DIMS], st[ENG_MAX_DIMS];
  for (int j = 0; j < nd; j++) shape[j] = x->shape[j];
  shape[a] = La; shape[b] = mb;
  if (a == 0 && mb == fb) {
    eng_contiguous_strides(nd, shape, st);
    eng_tensor* out = eng_view_of(R, nd, shape, st, 0);
    eng_tensor_release(R);
    if (!out) { eng_work_release(w); return NULL; }
    return complete(c, rc, w, 0, NULL, out);
  }
  eng_tensor* out = new_like_shape(x, nd, shape);
  if (!out) { eng_tensor_release(R); eng_work_release(w); return NULL; }
  c->pend->a = a; c->pend->k = k; c->pend->fa = fa; c->pend->La = La;
  memcpy(c->pend->cs, cs, sizeof cs);
  return complete(c, rc, w, 2, R, out);
}

/* R -> P (internal). */
static eng_tensor* apply_r2p(step_ctx* c, eng_tensor* x, const eng_placement* s, const eng_placement* t) {
  if (c->is_backward || t->op != ENG_REDUCE_SUM) {
    if (t->op == ENG_REDUCE_PROD && !c->is_backward)
      return eng_errp("%s: Replicate() -> Partial(prod) is not supported (only sum, avg, max and min)", c->op);
    return eng_tensor_retain(x);
  }
  eng_tensor* out = new_like_shape(x, x->ndim, x->shape);
  if (!out) return NULL;
  copy_into(out, x);
  if (out->numel > 0 && eng_mul_scalar_(out, 1.0 / c->k)) { eng_tensor_release(out); return NULL; }
  return out;
}

/* _StridedShard -> R: all_gather and reorder (synchronous even in an async
 * redistribute: the result is complete when returned). */
static eng_tensor* apply_ss2r(step_ctx* c, eng_tensor* x, const eng_placement* s, const eng_placement* t) {
  return dt_strided_gather(c->op, c->pg, x, s->dim, c->k, s->split_factor, c->coord, c->ls[s->dim]);
}

/* R -> _StridedShard: this coordinate's chunks, copied. */
static eng_tensor* apply_r2ss(step_ctx* c, eng_tensor* x, const eng_placement* s, const eng_placement* t) {
  return dt_strided_select(x, t->dim, c->k, t->split_factor, c->coord);
}

static eng_tensor* apply_ss2p(step_ctx* c, eng_tensor* x, const eng_placement* s, const eng_placement* t) {
  char a[48];
  return eng_errp("%s: redistribute from %s to Partial is not supported", c->op, eng_placement_describe(s, a, sizeof a));
}

static eng_tensor* apply_noop(step_ctx* c, eng_tensor* x, const eng_placement* s, const eng_placement* t) {
  return eng_tensor_retain(x);
}

static eng_tensor* apply_p2p(step_ctx* c, eng_tensor* x, const eng_placement* s, const eng_placement* t) {
  return eng_errp("%s: Redistribution from one partial type (%s) to another (%s) is unsupported", c->op,
                  eng_reduce_op_name(s->op), eng_reduce_op_name(t->op));
}

static eng_tensor* apply_s2p(step_ctx* c, eng_tensor* x, const eng_placement* s, const eng_placement* t) {
  return eng_errp("%s: redistribute from Shard to Partial is not supported", c->op);
}

static int is_s(const eng_placement* p) { return p->kind == ENG_PLACEMENT_SHARD; }
static int is_r(const eng_placement* p) { return p->kind == ENG_PLACEMENT_REPLICATE; }
static int is_p(const eng_placement* p) { return p->kind == ENG_PLACEMENT_PARTIAL; }

static int chk_noop(const eng_placement* s, const eng_placement* t) { return eng_placement_equal(s, t); }
static int chk_s2r(const eng_placement* s, const eng_placement* t) { return is_s(s) && is_r(t); }
static int chk_r2s(const eng_placement* s, const eng_placement* t) { return is_r(s) && is_s(t); }
static int chk_p2r(const eng_placement* s, const eng_placement* t) { return is_p(s) && is_r(t); }
static int chk_p2s(const eng_placement* s, const eng_placement* t) { return is_p(s) && is_s(t); }
static int chk_s2s(const eng_placement* s, const eng_placement* t) { return is_s(s) && is_s(t) && s->dim != t->dim; }
static int chk_r2p(const eng_placement* s, const eng_placement* t) { return is_r(s) && is_p(t); }
static int chk_p2p(const eng_placement* s, const eng_placement* t) { return is_p(s) && is_p(t) && s->op != t->op; }
static int chk_s2p(const eng_placement* s, const eng_placement* t) { return is_s(s) && is_p(t); }
static int is_ss(const eng_placement* p) { return p->kind == ENG_PLACEMENT_STRIDED_SHARD; }
static int chk_ss2r(const eng_placement* s, const eng_placement* t) { return is_ss(s) && is_r(t); }
static int chk_r2ss(const eng_placement* s, const eng_placement* t) { return is_r(s) && is_ss(t); }
static int chk_ss2p(const eng_placement* s, const eng_placement* t) { return is_ss(s) && is_p(t); }

/* Where a gradient that arrives with placement g goes back to on a mesh dim
 * whose forward source was s: s, except that a Partial source receives a
 * Shard/Replicate gradient as Replicate (gradients are never turned into
 * Partial sums; PyTorch's Redistribute.backward). */
static eng_placement bwd_source(const eng_placement* s, const eng_placement* g) {
  eng_placement r = *s;
  if (is_p(s) && !is_p(g)) r = dt_replicate();
  return r;
}

typedef struct transition {
  const char* name;
  int collective;  /* issues a collective */
  int (*check)(const eng_placement* s, const eng_placement* t);
  eng_tensor* (*apply)(step_ctx* c, eng_tensor* x, const eng_placement* s, const eng_placement* t);
  /* placement a gradient arriving as g is redistributed to, given the forward source s */
  eng_placement (*backward)(const eng_placement* s, const eng_placement* g);
} transition;

static const transition g_transitions[] = {
    {"noop", 0, chk_noop, apply_noop, bwd_source},
    {"shard_to_replicate (all_gather)", 1, chk_s2r, apply_s2r, bwd_source},
    {"replicate_to_shard (local chunk)", 0, chk_r2s, apply_r2s, bwd_source},
    {"partial_to_replicate (all_reduce)", 1, chk_p2r, apply_p2r, bwd_source},
    {"partial_to_shard (reduce_scatter)", 1, chk_p2s, apply_p2s, bwd_source},
    {"shard_to_shard (all_to_all)", 1, chk_s2s, apply_s2s, bwd_source},
    {"replicate_to_partial (internal)", 0, chk_r2p, apply_r2p, bwd_source},
    {"partial_to_partial", 0, chk_p2p, apply_p2p, bwd_source},
    {"shard_to_partial", 0, chk_s2p, apply_s2p, bwd_source},
    {"strided_shard_to_replicate (all_gather)", 1, chk_ss2r, apply_ss2r, bwd_source},
    {"replicate_to_strided_shard (local chunks)", 0, chk_r2ss, apply_r2ss, bwd_source},
    {"strided_shard_to_partial", 0, chk_ss2p, apply_ss2p, bwd_source},
};
#define N_TRANSITIONS ((int)(sizeof g_transitions / sizeof g_transitions[0]))

static const transition* find_transition(const eng_placement* s, const eng_placement* t) {
  for (int i = 0; i < N_TRANSITIONS; i++) if (g_transitions[i].check(s, t)) return &g_transitions[i];
  return NULL;
}

/* ------------------------------------------------------------------ plan cache */
typedef struct plan_key {
  int32_t mesh_ndim, ndim;
  int64_t mesh_shape[ENG_MAX_DIMS];
  int32_t coord[ENG_MAX_DIMS];
  eng_placement src[ENG_MAX_DIMS], dst[ENG_MAX_DIMS];
  int64_t shape[ENG_MAX_DIMS];
} plan_key;

typedef struct plan_entry {
  int used;
  uint64_t hash;
  plan_key key;
  int n;
  eng_transform_info steps[2 * ENG_MAX_DIMS];
} plan_entry;

#define PLAN_CAP 512
static plan_entry* g_plans;
static int g_nplans;
static pthread_mutex_t g_plan_mu = PTHREAD_MUTEX_INITIALIZER;

static uint64_t key_hash(const plan_key* k) {
  const unsigned char* b = (const unsigned char*)k;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < sizeof *k; i++) { h ^= b[i]; h *= 1099511628211ull; }
  return h;
}

static void make_key(plan_key* k, const eng_dist_spec* src, const eng_dist_spec* dst) {
  memset(k, 0, sizeof *k);
  k->mesh_ndim = src->mesh_ndim;
  k->ndim = src->ndim;
  for (int i = 0; i < src->mesh_ndim; i++) {
    k->mesh_shape[i] = src->mesh_shape[i];
    k->coord[i] = src->coord[i];
    k->src[i] = src->placements[i];
    k->dst[i] = dst->placements[i];
  }
  for (int d = 0; d < src->ndim; d++) k->shape[d] = src->shape[d];
}

/* The plan for src -> dst on this rank (a member): copied into out. */
static int get_plan(const eng_dist_spec* src, const eng_dist_spec* dst, eng_transform_info* out, int cap) {
  plan_key key;
  make_key(&key, src, dst);
  uint64_t h = key_hash(&key);
  pthread_mutex_lock(&g_plan_mu);
  if (!g_plans) g_plans = calloc(PLAN_CAP, sizeof *g_plans);
  if (g_plans) {
    unsigned i = (unsigned)(h & (PLAN_CAP - 1));
    for (int probe = 0; probe < PLAN_CAP && g_plans[i].used; probe++, i = (i + 1) & (PLAN_CAP - 1)) {
      plan_entry* e = &g_plans[i];
      if (e->hash == h && !memcmp(&e->key, &key, sizeof key)) {
        int n = e->n <= cap ? e->n : cap;
        memcpy(out, e->steps, sizeof *out * (size_t)n);
        pthread_mutex_unlock(&g_plan_mu);
        return e->n <= cap ? e->n : eng_err("redistribute plan: %d steps do not fit in %d", e->n, cap);
      }
    }
  }
  pthread_mutex_unlock(&g_plan_mu);
  eng_transform_info steps[2 * ENG_MAX_DIMS];
  int n = eng_redistribute_plan(src->mesh_ndim, src->mesh_shape, src->coord, src->placements, dst->placements,
                                src->ndim, src->shape, steps, 2 * ENG_MAX_DIMS);
  if (n < 0) return -1;
  pthread_mutex_lock(&g_plan_mu);
  if (g_plans) {
    if (g_nplans >= PLAN_CAP / 2) { memset(g_plans, 0, sizeof *g_plans * PLAN_CAP); g_nplans = 0; }
    unsigned i = (unsigned)(h & (PLAN_CAP - 1));
    while (g_plans[i].used) i = (i + 1) & (PLAN_CAP - 1);
    plan_entry* e = &g_plans[i];
    e->used = 1; e->hash = h; e->key = key; e->n = n;
    memcpy(e->steps, steps, sizeof *steps * (size_t)n);
    g_nplans++;
  }
  pthread_mutex_unlock(&g_plan_mu);
  if (n > cap) return eng_err("redistribute plan: %d steps do not fit in %d", n, cap);
  memcpy(out, steps, sizeof *out * (size_t)n);
  return n;
}

int eng_dtensor_transform_infos(const eng_dist_spec* src, const eng_dist_spec* dst, eng_transform_info* out, int cap) {
  if (!src || !dst || !out) return eng_err("transform_infos: NULL argument");
  if (src->mesh_ndim != dst->mesh_ndim || src->ndim != dst->ndim)
    return eng_err("transform_infos: the specs have different meshes or tensor ranks");
  if (!src->member) return 0;
  return get_plan(src, dst, out, cap);
}

/* ------------------------------------------------------------------ redistribute a local tensor */
eng_tensor* dt_redistribute_local(eng_tensor* local, const eng_dist_spec* src, const eng_dist_spec* dst, int async,
                                  int is_backward) {
  const char* op = is_backward ? "redistribute (backward)" : "redistribute";
  if (src->mesh != dst->mesh && !eng_mesh_equal(src->mesh, dst->mesh)) {
    char a[512], b[512], note[700];
    return eng_errp("%s: %s -> %s: Cross device mesh comm not supported yet!%s", op,
                    eng_dist_spec_describe(src, local->dtype, a, sizeof a), eng_dist_spec_describe(dst, -1, b, sizeof b),
                    dt_mesh_diff_note(src->mesh, dst->mesh, note, sizeof note));
  }
  if (src->ndim != dst->ndim || src->ndim != local->ndim)
    return eng_errp("%s: tensor ranks differ (local %s, source %dd, target %dd)", op, eng_desc(local), src->ndim,
                    dst->ndim);
  for (int d = 0; d < src->ndim; d++)
    if (src->shape[d] != dst->shape[d])
      return eng_errp("%s: global shapes differ: %s vs %s", op, eng_shape_str(src->ndim, src->shape),
                      eng_shape_str(dst->ndim, dst->shape));
  if (!src->member) return dt_plain(local); /* not in the mesh: nothing to do */
  if (local->device == ENG_META) return eng_new(dst->ndim, dst->local_shape, local->dtype, ENG_META); /* shapes only */
  eng_transform_info steps[2 * ENG_MAX_DIMS];
  int n = get_plan(src, dst, steps, 2 * ENG_MAX_DIMS);
  if (n < 0) return NULL;
  /* which step may stay pending: the last one, when it communicates */
  const transition* tr[2 * ENG_MAX_DIMS];
  int last_comm = -1;
  for (int s = 0; s < n; s++) {
    tr[s] = find_transition(&steps[s].src, &steps[s].dst);
    if (!tr[s]) {
      char a[48], b[48];
      return eng_errp("%s: no transition from %s to %s", op, eng_placement_describe(&steps[s].src, a, sizeof a),
                      eng_placement_describe(&steps[s].dst, b, sizeof b));
    }
    if (tr[s]->collective && src->mesh_shape[steps[s].mesh_dim] > 1) last_comm = s;
  }
  eng_tensor* x = dt_plain(local);
  if (!x) return NULL;
  int owned = 0;
  for (int s = 0; s < n; s++) {
    int i = steps[s].mesh_dim;
    if (src->mesh_shape[i] == 1 && tr[s]->apply != apply_p2p && tr[s]->apply != apply_s2p &&
        tr[s]->apply != apply_ss2p)
      continue;
    step_ctx c;
    memset(&c, 0, sizeof c);
    pending pend;
    memset(&pend, 0, sizeof pend);
    c.op = op;
    c.k = (int)src->mesh_shape[i];
    c.coord = src->coord[i];
    c.mesh_dim = i;
    c.ls = steps[s].logical_shape;
    c.async = async && s == last_comm && s == n - 1;
    c.is_backward = is_backward;
    c.owned = owned;
    c.pend = &pend;
    if (tr[s]->collective) {
      c.pg = eng_mesh_get_group(src->mesh, i);
      if (!c.pg) { eng_tensor_release(x); return NULL; }
    }
    /* the gradient reductions of backward (Partial -> Replicate / Shard) run in the group's backward reduce
     * dtype when one is set (FSDP's reduce_dtype over tensor parallelism); an explicit backward_dtype
     * (is_backward == 2) keeps its own */
    int rdt = is_backward == 1 && c.pg && (tr[s]->apply == apply_p2r || tr[s]->apply == apply_p2s)
                  ? c.pg->bwd_reduce_dtype - 1 : -1;
    int xdt = x->dtype;
    if (rdt >= 0 && (rdt == xdt || !eng_dtype_is_floating(xdt))) rdt = -1;
    if (rdt >= 0) {
      eng_tensor* xc = eng_tensor_to_dtype(x, rdt);
      eng_tensor_release(x);
      if (!xc) { eng_pg_release(c.pg); return NULL; }
      x = xc;
      c.owned = 1;
    }
    eng_tensor* y = tr[s]->apply(&c, x, &steps[s].src, &steps[s].dst);
    eng_pg_release(c.pg);
    eng_tensor_release(x);
    if (y && rdt >= 0) {
      eng_tensor* yc = eng_tensor_to_dtype(y, xdt);
      eng_tensor_release(y);
      y = yc;
    }
    if (!y) {
      char a[512], b[400];
      eng_err_prefix("%s: %s -> %s: step %d (mesh dim %d, %s)", op,
                     eng_dist_spec_describe(src, local->dtype, a, sizeof a),
                     dt_placements_str(dst->mesh_ndim, dst->placements, b, sizeof b), s + 1, i + dt_base(), tr[s]->name);
      return NULL;
    }
    if (c.async && pend.result) pending_register(&pend);
    x = y;
    owned = 1;
  }
  return x;
}

/* ------------------------------------------------------------------ autograd */
eng_dist_spec* dt_grad_target(const eng_dist_spec* src, const eng_dist_spec* grad) {
  eng_placement gp[ENG_MAX_DIMS];
  int same = 1;
  for (int i = 0; i < src->mesh_ndim; i++) {
    const eng_placement* s = &src->placements[i];
    const eng_placement* g = &grad->placements[i];
    const transition* tr = find_transition(s, g);
    gp[i] = tr ? tr->backward(s, g) : bwd_source(s, g);
    if (!eng_placement_equal(&gp[i], s)) same = 0;
  }
  if (same) return eng_dist_spec_retain((eng_dist_spec*)src);
  return dt_spec_make(src->mesh, gp, src->ndim, src->shape, src->stride);
}

typedef struct rd_ctx {
  eng_dist_spec* src;   /* the forward input's spec */
  eng_dist_spec* out;   /* the forward result's spec */
  int bwd_dtype;        /* dtype the gradient travels in (-1: the input's) */
} rd_ctx;

static void rd_free(eng_node* n) {
  rd_ctx* c = n->ctx;
  if (!c) return;
  eng_dist_spec_release(c->src);
  eng_dist_spec_release(c->out);
  free(c);
  n->ctx = NULL;
}

static int rd_backward(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  rd_ctx* c = n->ctx;
  eng_tensor* g = go[0];
  if (!eng_node_needs_grad(n, 0)) return 0;
  eng_dist_spec* gs = g->dist ? g->dist : c->out;
  if (gs->mesh_ndim != c->src->mesh_ndim) return eng_err("gradient spec does not match the forward mesh");
  eng_dist_spec* target = dt_grad_target(c->src, gs);
  if (!target) return -1;
  /* backward_dtype (default: the input's dtype) is what the communication carries */
  int bdt = c->bwd_dtype >= 0 ? c->bwd_dtype : eng_node_in_dtype(n, 0);
  eng_tensor* gp = dt_plain(g);
  eng_tensor* gc = !gp ? NULL : g->dtype != bdt ? eng_tensor_to_dtype(gp, bdt) : eng_tensor_retain(gp);
  eng_tensor_release(gp);
  if (!gc) { eng_dist_spec_release(target); return -1; }
  eng_tensor* r = eng_dist_spec_equal(gs, target) ? dt_plain(gc)
                 : dt_redistribute_local(gc, gs, target, 0, c->bwd_dtype >= 0 ? 2 : 1);
  eng_tensor_release(gc);
  if (r && r->dtype != eng_node_in_dtype(n, 0)) {
    eng_tensor* cv = eng_tensor_to_dtype(r, eng_node_in_dtype(n, 0));
    eng_tensor_release(r);
    r = cv;
  }
  if (r) dt_attach(r, target);
  eng_dist_spec_release(target);
  if (!r) return -1;
  gi[0] = r;
  return 0;
}

eng_tensor* dt_redistribute_autograd(const char* op, eng_tensor* t, eng_dist_spec* dst, int async, int is_backward) {
  return dt_redistribute_autograd_ex(op, t, dst, async, is_backward, -1, -1);
}

eng_tensor* dt_redistribute_autograd_ex(const char* op, eng_tensor* t, eng_dist_spec* dst, int async, int is_backward,
                                        int fwd_dtype, int bwd_dtype) {
  if (eng_dtensor_wait(t)) return NULL;
  eng_dist_spec* src = t->dist;
  eng_tensor* out;
  eng_tensor* x = t;
  if (fwd_dtype >= 0 && fwd_dtype != t->dtype) { /* forward_dtype: cast the local before the communication */
    eng_tensor* v = dt_plain(t);
    int prev = eng_set_grad_enabled(0);
    x = v ? eng_tensor_to_dtype(v, fwd_dtype) : NULL;
    eng_set_grad_enabled(prev);
    eng_tensor_release(v);
    if (!x) return NULL;
  }
  if (eng_dist_spec_equal(src, dst)) out = dt_plain(x);
  else out = dt_redistribute_local(x, src, dst, async, is_backward);
  if (x != t) eng_tensor_release(x);
  if (!out) return NULL;
  dt_attach(out, dst);
  if (eng_any_requires_grad(1, &t) && eng_dtype_is_floating(out->dtype)) {
    rd_ctx* c = calloc(1, sizeof *c);
    eng_node* node = c ? eng_node_new("RedistributeBackward", rd_backward, 1, &t, 1) : NULL;
    if (!node) { free(c); eng_tensor_release(out); return c ? NULL : eng_errp("%s: out of memory", op); }
    node->ctx = c;
    node->free_ctx = rd_free;
    c->src = eng_dist_spec_retain(src);
    c->out = eng_dist_spec_retain(dst);
    c->bwd_dtype = bwd_dtype;
    eng_node_set_output(node, out, 0);
    eng_node_release(node);
  }
  return out;
}

/* ------------------------------------------------------------------ public entry points */
static eng_tensor* redistribute_impl(const char* op, eng_tensor* t, eng_mesh* mesh, int n,
                                     const eng_placement* pl, int async, int allow_partial, int fwd_dtype,
                                     int bwd_dtype) {
  ENG_CHECK(t, op);
  if (!t->dist) return eng_errp("%s: %s is not a DTensor (use from_local or distribute_tensor first)", op, eng_desc(t));
  eng_dist_spec* src = t->dist;
  char a[512], b[400];
  for (int k = 0; k < 2; k++) {
    int dt = k ? bwd_dtype : fwd_dtype;
    if (dt < 0) continue;
    if (dt >= ENG_NUM_DTYPES || !eng_dtype_is_floating(dt) || !eng_dtype_is_floating(t->dtype))
      return eng_errp("%s: %s: %s %s is invalid (a floating dtype, for a floating DTensor)", op,
                      eng_dist_spec_describe(src, t->dtype, a, sizeof a), k ? "backward_dtype" : "forward_dtype",
                      dt < ENG_NUM_DTYPES ? eng_dtype_name(dt) : "(unknown)");
  }
  if (mesh && mesh != src->mesh && !eng_mesh_equal(mesh, src->mesh)) {
    char ms[160], note[700];
    return eng_errp("%s: %s to %s: Cross device mesh comm not supported yet!%s", op,
                    eng_dist_spec_describe(src, t->dtype, a, sizeof a), dt_mesh_str(mesh, ms, sizeof ms),
                    dt_mesh_diff_note(src->mesh, mesh, note, sizeof note));
  }
  if (!pl) return eng_errp("%s: %s: placements is needed for redistribute!", op,
                           eng_dist_spec_describe(src, t->dtype, a, sizeof a));
  eng_placement norm[ENG_MAX_DIMS];
  if (dt_check_placements(op, src->mesh, n, pl, src->ndim, norm)) {
    eng_err_prefix("%s", eng_dist_spec_describe(src, t->dtype, a, sizeof a));
    return NULL;
  }
  if (!allow_partial) {
    for (int i = 0; i < n; i++) {
      if (norm[i].kind != ENG_PLACEMENT_PARTIAL) continue;
      if (!eng_placement_equal(&src->placements[i], &norm[i])) {
        char x[48], y[48];
        return eng_errp("%s: %s -> %s: Can not redistribute from %s to %s (mesh dim %d), redistributing to Partial is "
                        "for internal use only!", op, eng_dist_spec_describe(src, t->dtype, a, sizeof a),
                        dt_placements_str(n, norm, b, sizeof b),
                        eng_placement_describe(&src->placements[i], x, sizeof x), eng_placement_describe(&norm[i], y, sizeof y),
                        i + dt_base());
      }
    }
  }
  eng_dist_spec* dst;
  int same = 1;
  for (int i = 0; i < n; i++) if (!eng_placement_equal(&src->placements[i], &norm[i])) same = 0;
  if (same) dst = eng_dist_spec_retain(src);
  else dst = dt_spec_make(src->mesh, norm, src->ndim, src->shape, src->stride);
  if (!dst) return NULL;
  eng_tensor* out = dt_redistribute_autograd_ex(op, t, dst, async, 0, fwd_dtype, bwd_dtype);
  eng_dist_spec_release(dst);
  return out;
}

int eng_dtensor_set_backward_reduce_dtype(eng_mesh* mesh, int dim, int dtype) {
  const char* op = "set_backward_reduce_dtype";
  if (!mesh) return eng_err("%s: mesh is NULL", op);
  if (dtype >= ENG_NUM_DTYPES || (dtype >= 0 && !eng_dtype_is_floating(dtype)))
    return eng_err("%s: %s is not a floating dtype", op, dtype < ENG_NUM_DTYPES ? eng_dtype_name(dtype) : "(unknown)");
  eng_pg* pg = eng_mesh_get_group(mesh, dim);
  if (!pg) return -1;
  pg->bwd_reduce_dtype = dtype < 0 ? 0 : dtype + 1;
  eng_pg_release(pg);
  return 0;
}

int eng_dtensor_get_backward_reduce_dtype(const eng_mesh* mesh, int dim) {
  eng_pg* pg = eng_mesh_get_group(mesh, dim);
  if (!pg) return -2;
  int d = pg->bwd_reduce_dtype - 1;
  eng_pg_release(pg);
  return d;
}

eng_tensor* eng_dtensor_redistribute(eng_tensor* t, eng_mesh* mesh, int n, const eng_placement* pl, int async_op) {
  return redistribute_impl("redistribute", t, mesh, n, pl, async_op, 0, -1, -1);
}

eng_tensor* eng_dtensor_redistribute_dtype(eng_tensor* t, eng_mesh* mesh, int n, const eng_placement* pl,
                                           int async_op, int forward_dtype, int backward_dtype) {
  return redistribute_impl("redistribute", t, mesh, n, pl, async_op, 0, forward_dtype, backward_dtype);
}

eng_tensor* eng_dtensor_redistribute_spec(eng_tensor* t, eng_dist_spec* dst, int flags) {
  const char* op = "redistribute";
  ENG_CHECK(t, op);
  if (!dst) return eng_errp("%s: target spec is NULL", op);
  if (!t->dist) return eng_errp("%s: %s is not a DTensor", op, eng_desc(t));
  eng_dist_spec* src = t->dist;
  char a[512], b[512];
  if (src->ndim != dst->ndim || src->mesh_ndim != dst->mesh_ndim)
    return eng_errp("%s: %s -> %s: the target spec has a different rank or mesh", op,
                    eng_dist_spec_describe(src, t->dtype, a, sizeof a), eng_dist_spec_describe(dst, -1, b, sizeof b));
  if (!(flags & 2))
    for (int i = 0; i < dst->mesh_ndim; i++)
      if (dst->placements[i].kind == ENG_PLACEMENT_PARTIAL && !eng_placement_equal(&src->placements[i], &dst->placements[i]))
        return eng_errp("%s: %s -> %s: Can not redistribute to a Partial placement (mesh dim %d), redistributing to "
                        "Partial is for internal use only!", op, eng_dist_spec_describe(src, t->dtype, a, sizeof a),
                        eng_dist_spec_describe(dst, -1, b, sizeof b), i + dt_base());
  return dt_redistribute_autograd(op, t, dst, flags & 1, 0);
}
