/* Subsystem comm/: process groups and their collectives (MPI, NCCL,
 * single-copy exchanges on one node), the distributed runtime (MPI start-up,
 * watchdog) and DeviceMesh.  May call: core/, cuda/ (NCCL streams).
 * Knows nothing of DTensor placements. */
/* process_group.c: process groups (world, new_group, split), collective
 * dispatch (argument checks, staging buffers, the plan handed to a backend,
 * sequence numbers) and work handles.  The files beside it: the counters and
 * flight recorder (flight_recorder.c), the signature checks and agreements
 * (signature_check.c), peers that have ended (peer_health.c), the backends
 * (mpi.c, nccl.c: they only see raw contiguous buffers), single-copy
 * exchanges (cma.c), DeviceMesh (mesh.c) and the runtime (dist_runtime.c). */
#include "comm/comm_impl.h"
#include "comm/guard.h"
#include "kernels/cpu/kcpu.h"
#include "eng/comm.h"
#include "eng/dist.h"
#include <limits.h>
#include <stdio.h>

/* ------------------------------------------------------------------ names */
static const char* const g_op_names[ENG_NUM_REDUCE_OPS] = {"sum", "avg", "max", "min", "prod"};
static const char* const g_kind_names[ENG_NUM_COLL_KINDS] = {
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "scatter", "barrier", "gather"};

const char* eng_reduce_op_name(int op) { return op >= 0 && op < ENG_NUM_REDUCE_OPS ? g_op_names[op] : NULL; }
const char* eng_coll_kind_name(int kind) {
  return kind >= 0 && kind < ENG_NUM_COLL_KINDS ? g_kind_names[kind] : NULL;
}

int eng_reduce_op_from_name(const char* name) {
  if (!name) return eng_err("reduce op: name is NULL");
  for (int i = 0; i < ENG_NUM_REDUCE_OPS; i++) if (!strcmp(name, g_op_names[i])) return i;
  if (!strcmp(name, "mean")) return ENG_REDUCE_AVG;
  if (!strcmp(name, "product")) return ENG_REDUCE_PROD;
  return eng_err("reduce op: unknown op '%s' (expected sum, avg, max, min or prod)", name);
}

/* ------------------------------------------------------------------ state */
static eng_pg* g_world;
static int g_my_rank; /* world rank, cached so other threads can print it */

int comm_world_rank(void) { return g_my_rank; }
static int64_t g_next_id = 1;

/* ------------------------------------------------------------------ groups */
int comm_ensure_init(const char* op) {
  if (!eng_dist_is_initialized()) {
    int inited = 0;
    MPI_Initialized(&inited);
    if (inited) return eng_err("%s: the distributed runtime was finalized", op);
    if (eng_dist_init()) return -1;
  }
  if (!g_world) {
    MPI_Comm c;
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &c);
    if (rc != MPI_SUCCESS) return eng_err("%s: cannot create the world group: %s", op, comm_mpi_errstr(rc));
    g_world = comm_pg_from_mpi(c, "world");
    if (!g_world) return -1;
    g_world->id = 0;
    g_next_id--;
    g_my_rank = g_world->rank;
    eng_set_process_rank(g_world->rank);
    comm_peers_listen();
    /* the node-local rank, from the shared-memory communicator (launcher variables may be missing or wrong) */
    MPI_Comm local;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local) == MPI_SUCCESS) {
      int lr = 0, ls = 1;
      MPI_Comm_rank(local, &lr);
      MPI_Comm_size(local, &ls);
      MPI_Comm_free(&local);
      eng_set_node_local_rank(lr, ls);
    }
  }
  return 0;
}

static int registry_add(eng_pg* pg);
static void registry_remove(const eng_pg* pg);

static void name_from_ranks(char* b, int cap, const int* ranks, int n) {
  int k = snprintf(b, cap, "group[");
  for (int i = 0; i < n && k < cap - 8; i++) k += snprintf(b + k, cap - k, i ? ",%d" : "%d", ranks[i]);
  if (k >= cap - 8) snprintf(b + cap - 6, 6, "...]");
  else snprintf(b + k, cap - k, "]");
}

eng_pg* comm_pg_from_mpi(MPI_Comm c, const char* name) {
  eng_pg* pg = calloc(1, sizeof *pg);
  if (!pg) return eng_errp("process group: out of memory");
  pg->refcount = 1;
  pg->id = g_next_id++;
  pg->comm = c;
  pg->ctl = MPI_COMM_NULL;
  pg->rank = pg->size = -1;
  if (c != MPI_COMM_NULL) {
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    if (MPI_Comm_dup(c, &pg->ctl) != MPI_SUCCESS) { free(pg); return eng_errp("process group: MPI_Comm_dup failed"); }
    MPI_Comm_set_errhandler(pg->ctl, MPI_ERRORS_RETURN);
    pg->member = 1;
    MPI_Comm_rank(c, &pg->rank);
    MPI_Comm_size(c, &pg->size);
    pg->ranks = malloc(sizeof(int) * (size_t)pg->size);
    int* mine = malloc(sizeof(int) * (size_t)pg->size);
    if (!pg->ranks || !mine) { free(mine); free(pg->ranks); free(pg); return eng_errp("process group: out of memory"); }
    MPI_Group g, w;
    MPI_Comm_group(c, &g);
    MPI_Comm_group(MPI_COMM_WORLD, &w);
    for (int i = 0; i < pg->size; i++) mine[i] = i;
    MPI_Group_translate_ranks(g, pg->size, mine, w, pg->ranks);
    MPI_Group_free(&g);
    MPI_Group_free(&w);
    free(mine);
  }
  if (name) snprintf(pg->name, sizeof pg->name, "%s", name);
  else if (pg->member) name_from_ranks(pg->name, sizeof pg->name, pg->ranks, pg->size);
  else snprintf(pg->name, sizeof pg->name, "(not a member)");
  if (pg->member && registry_add(pg)) { eng_pg_release(pg); return NULL; }
  return pg;
}

/* ------------------------------------------------------------------ group keys (the watchdog's names) */
/* The key of a group is the same on its members and differs between live groups, even two over the same
 * ranks (the world and a 1-D mesh over it): the members take the maximum of their creation counters (one
 * small all_reduce on the new control communicator, once per group) and hash it with the member list. */
static int64_t g_key_next = 1;
static eng_pg** g_live;
static int g_nlive, g_cap_live;

static int registry_add(eng_pg* pg) {
  int64_t mine = g_key_next, uid = mine;
  if (pg->size > 1) {
    int rc = MPI_Allreduce(&mine, &uid, 1, MPI_INT64_T, MPI_MAX, pg->ctl);
    if (rc != MPI_SUCCESS) return eng_err("process group: %s", comm_mpi_errstr(rc));
  }
  g_key_next = uid + 1;
  pg->key = comm_fnv(pg->ranks, sizeof(int) * (size_t)pg->size, comm_fnv(&uid, sizeof uid, COMM_FNV_SEED));
  if (g_nlive == g_cap_live) {
    int cap = g_cap_live ? 2 * g_cap_live : 16;
    eng_pg** n = realloc(g_live, sizeof *n * (size_t)cap);
    if (!n) return 0; /* not findable: the watchdog then treats its records as unknown */
    g_live = n; g_cap_live = cap;
  }
  g_live[g_nlive++] = pg;
  return 0;
}

static void registry_remove(const eng_pg* pg) {
  for (int i = 0; i < g_nlive; i++)
    if (g_live[i] == pg) { g_live[i] = g_live[--g_nlive]; return; }
}

eng_pg* comm_pg_find(uint64_t key) {
  for (int i = 0; i < g_nlive; i++) if (g_live[i]->key == key) return g_live[i];
  return NULL;
}

eng_pg* eng_pg_world(void) {
  if (comm_ensure_init("world group")) return NULL;
  return eng_pg_retain(g_world);
}

eng_pg* eng_pg_retain(eng_pg* pg) {
  if (pg) __atomic_add_fetch(&pg->refcount, 1, __ATOMIC_RELAXED);
  return pg;
}

void eng_pg_release(eng_pg* pg) {
  if (!pg) return;
  if (__atomic_sub_fetch(&pg->refcount, 1, __ATOMIC_ACQ_REL) != 0) return;
  registry_remove(pg);
  if (pg->pend_check && eng_dist_is_initialized()) comm_check_finish(pg); /* complete the request before freeing ctl */
#if defined(ENG_HAVE_CUDA) && defined(ENG_HAVE_NCCL)
  if (pg->nccl) comm_nccl_pg_free(pg->nccl);
#endif
  if (pg->comm != MPI_COMM_NULL && eng_dist_is_initialized()) MPI_Comm_free(&pg->comm);
  if (pg->ctl != MPI_COMM_NULL && eng_dist_is_initialized() && !pg->broken) MPI_Comm_free(&pg->ctl);
  free(pg->ranks);
  free(pg->broken_msg);
  free(pg);
}

/* Fails on every rank when `data` differs between the world ranks (a cheap
 * guard against ranks creating groups with different arguments). */
int comm_world_agree(const void* data, size_t n, const char* op, const char* what) {
  if (eng_dist_world_size() == 1) return 0;
  /* an agreement on the world group: a rank that meets another rank's collective there (group creation on
   * some ranks only) fails with a mismatch instead of waiting for ever, and the watchdog sees the wait */
  uint64_t h = comm_fnv(data, n, COMM_FNV_SEED);
  if (!eng_pg_agree(g_world, 0, h, op)) return 0;
  if (strstr(eng_last_error(), "reached it with different arguments"))
    return eng_err("%s: the ranks called it with different %s (it is collective: every rank must pass the same "
                   "arguments)", op, what);
  return -1;
}

static int new_group_key(const int* ranks, int n, int* key);

eng_pg* eng_pg_new(const int* ranks, int n) {
  if (comm_ensure_init("new_group")) return NULL;
  int key = -1;
  if (new_group_key(ranks, n, &key)) {
    /* still take part in the agreement, so ranks with valid arguments fail too instead of hanging */
    char saved[2048];
    snprintf(saved, sizeof saved, "%s", eng_last_error());
    static const char tag[] = "invalid rank list";
    comm_world_agree(tag, sizeof tag, "new_group", "rank lists");
    eng_set_error_message(saved);
    return NULL;
  }
  if (comm_world_agree(ranks, sizeof(int) * (size_t)n, "new_group", "rank lists")) return NULL;
  MPI_Comm c;
  int rc = MPI_Comm_split(MPI_COMM_WORLD, key >= 0 ? 0 : MPI_UNDEFINED, key, &c);
  if (rc != MPI_SUCCESS) return eng_errp("new_group: MPI_Comm_split failed: %s", comm_mpi_errstr(rc));
  char name[96];
  name_from_ranks(name, sizeof name, ranks, n);
  return comm_pg_from_mpi(c, name);
}

static int new_group_key(const int* ranks, int n, int* keyp) {
  int world = eng_dist_world_size(), me = eng_dist_rank();
  if (n < 1) return eng_err("new_group: the rank list is empty");
  if (!ranks) return eng_err("new_group: ranks is NULL");
  char* seen = calloc((size_t)world, 1);
  if (!seen) return eng_err("new_group: out of memory");
  for (int i = 0; i < n; i++) {
    if (ranks[i] < 0 || ranks[i] >= world) {
      free(seen);
      return eng_err("new_group: rank %d is out of range for world size %d (ranks are 0-based)", ranks[i], world);
    }
    if (seen[ranks[i]]) { free(seen); return eng_err("new_group: rank %d is listed twice", ranks[i]); }
    seen[ranks[i]] = 1;
    if (ranks[i] == me) *keyp = i;
  }
  free(seen);
  return 0;
}

eng_pg* eng_pg_split(eng_pg* parent, int color, int key) {
  if (!parent) return eng_errp("split_group: parent group is NULL");
  if (!parent->member) return comm_pg_from_mpi(MPI_COMM_NULL, NULL);
  MPI_Comm c;
  int rc = MPI_Comm_split(parent->comm, color < 0 ? MPI_UNDEFINED : color, key, &c);
  if (rc != MPI_SUCCESS) return eng_errp("split_group: MPI_Comm_split of %s failed: %s", parent->name, comm_mpi_errstr(rc));
  return comm_pg_from_mpi(c, NULL);
}

int eng_pg_is_member(const eng_pg* pg) { return pg && pg->member; }
int eng_pg_rank(const eng_pg* pg) { return pg ? pg->rank : -1; }
int eng_pg_size(const eng_pg* pg) { return pg ? pg->size : -1; }
int64_t eng_pg_id(const eng_pg* pg) { return pg ? pg->id : -1; }
int64_t eng_pg_seq(const eng_pg* pg) { return pg ? pg->seq : 0; }
const char* eng_pg_name(const eng_pg* pg) { return pg ? pg->name : "nil"; }

int eng_pg_ranks(const eng_pg* pg, int* out, int cap) {
  if (!pg) return eng_err("group ranks: group is NULL");
  if (!pg->member) return 0;
  for (int i = 0; i < pg->size && i < cap; i++) out[i] = pg->ranks[i];
  return pg->size;
}

int eng_pg_group_rank(const eng_pg* pg, int world_rank) {
  if (!pg) return eng_err("group rank: group is NULL");
  if (pg->member)
    for (int i = 0; i < pg->size; i++) if (pg->ranks[i] == world_rank) return i;
  return eng_err("global rank %d is not part of group %s", world_rank, pg->name);
}

/* ------------------------------------------------------------------ staging buffers */
/* Persistent buffers, touched once when they grow and reused afterwards. */
#define POOL 32
static struct { char* p; int64_t cap; int busy; } g_pool[POOL];

typedef struct sbuf { void* p; int64_t size; int slot; } sbuf;

static int pool_get(int64_t nbytes, sbuf* b) {
  if (nbytes <= 0) nbytes = 1;
  int best = -1, grow = -1;
  for (int i = 0; i < POOL; i++) {
    if (g_pool[i].busy) continue;
    if (g_pool[i].cap >= nbytes) { if (best < 0 || g_pool[i].cap < g_pool[best].cap) best = i; }
    else if (grow < 0 || g_pool[i].cap > g_pool[grow].cap) grow = i;
  }
  if (best < 0 && grow >= 0) {
    if (g_pool[grow].p) eng_free_raw(g_pool[grow].p, g_pool[grow].cap);
    int64_t got = 0;
    g_pool[grow].p = eng_alloc_raw(nbytes, &got);
    if (!g_pool[grow].p) { g_pool[grow].cap = 0; return eng_err("comm: out of memory for a %lld-byte buffer", (long long)nbytes); }
    g_pool[grow].cap = got;
    memset(g_pool[grow].p, 0, (size_t)got); /* first touch now, not inside MPI */
    best = grow;
  }
  if (best >= 0) {
    g_pool[best].busy = 1;
    b->p = g_pool[best].p; b->size = g_pool[best].cap; b->slot = best;
    return 0;
  }
  /* every slot busy (many async collectives in flight): a one-off buffer */
  int64_t got = 0;
  b->p = eng_alloc_raw(nbytes, &got);
  if (!b->p) return eng_err("comm: out of memory for a %lld-byte buffer", (long long)nbytes);
  b->size = got; b->slot = -1;
  return 0;
}

static void pool_put(sbuf* b) {
  if (!b->p) return;
  if (b->slot >= 0) g_pool[b->slot].busy = 0;
  else eng_free_raw(b->p, b->size);
  b->p = NULL;
}

/* ------------------------------------------------------------------ collective plan */
typedef struct fin {
  sbuf buf[2];
  const void* res; int res_dt; eng_tensor* target; /* copy res -> target */
  void* scale_p; int64_t scale_n; int scale_dt; double divisor; /* avg */
  eng_tensor* bump; /* written in place */
  int* v;           /* gather with per-rank sizes: counts and displacements (malloc) */
  eng_tensor *cin, *cout, *cout_target; /* NCCL: contiguous stand-ins of strided CUDA views, cout copied back */
} fin;

struct eng_work {
  int32_t refcount;
  int32_t done, status, backend; /* backend: 0 none, 1 MPI, 2 NCCL */
  int kind;
  int64_t rec;
  int64_t seq;                   /* the collective's sequence number on pg (named by a failed GPU wait) */
  eng_pg* pg;
  MPI_Request req;
  void* event;
  eng_tensor* result;
  eng_tensor* keep;
  fin f;
  char err[1024];
};

static void contig_strides(int ndim, const int64_t* shape, int64_t* st) { eng_contiguous_strides(ndim, shape, st); }

/* Contiguous bf16 <-> f32 conversions written so that the compiler
 * vectorizes them (the staging of bf16 sums over more than 2 ranks). */
static void bf16_to_f32(const uint16_t* s, float* d, int64_t n) {
  uint32_t* u = (uint32_t*)d;
  for (int64_t i = 0; i < n; i++) u[i] = (uint32_t)s[i] << 16;
}

static void f32_to_bf16(const float* s, uint16_t* d, int64_t n) {
  const uint32_t* u = (const uint32_t*)s;
  for (int64_t i = 0; i < n; i++) {
    uint32_t x = u[i];
    uint16_t r = (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
    uint16_t q = (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    d[i] = (x & 0x7fffffffu) > 0x7f800000u ? q : r;
  }
}

static void copy_to_buf(const eng_tensor* t, void* buf, int dt) {
  if (!t->numel) return;
  if (t->dtype == ENG_BF16 && dt == ENG_F32 && eng_tensor_is_contiguous(t)) {
    bf16_to_f32((const uint16_t*)eng_ptr(t), buf, t->numel);
    return;
  }
  int64_t st[8];
  contig_strides(t->ndim, t->shape, st);
  kc_copy(t->ndim, t->shape, buf, dt, st, eng_ptr(t), t->dtype, t->stride);
}

static void copy_from_buf(eng_tensor* t, const void* buf, int dt) {
  if (!t->numel) return;
  if (t->dtype == ENG_BF16 && dt == ENG_F32 && eng_tensor_is_contiguous(t)) {
    f32_to_bf16(buf, (uint16_t*)eng_ptr(t), t->numel);
    return;
  }
  int64_t st[8];
  contig_strides(t->ndim, t->shape, st);
  kc_copy(t->ndim, t->shape, eng_ptr(t), t->dtype, t->stride, buf, dt, st);
}

/* avg: divide the sum by the group size (as a single process's mean does). */
/* avg: the sum divided by the group size.  A power-of-two size multiplies by its reciprocal instead, which is exact
 * (x / 2^k and x * 2^-k are both the correctly rounded x * 2^-k) and leaves the pass bound by memory alone (a
 * vector division takes 5 or more cycles per vector). */
static void divide_buf(void* p, int64_t n, int dt, double d) {
  float f = (float)d;
  int pow2 = d >= 1 && d <= 1048576 && ((int64_t)d & ((int64_t)d - 1)) == 0 && (double)(int64_t)d == d;
  if (dt == ENG_F32 && pow2) { float* x = p; float r = 1.0f / f; for (int64_t i = 0; i < n; i++) x[i] *= r; }
  else if (dt == ENG_F64 && pow2) { double* x = p; double r = 1.0 / d; for (int64_t i = 0; i < n; i++) x[i] *= r; }
  else if (dt == ENG_F32) { float* x = p; for (int64_t i = 0; i < n; i++) x[i] /= f; }
  else if (dt == ENG_F64) { double* x = p; for (int64_t i = 0; i < n; i++) x[i] /= d; }
  else if (dt == ENG_BF16) { uint16_t* x = p; for (int64_t i = 0; i < n; i++) x[i] = kc_f32_to_bf16(kc_bf16_to_f32(x[i]) / f); }
  else if (dt == ENG_F16) { uint16_t* x = p; for (int64_t i = 0; i < n; i++) x[i] = kc_f32_to_f16(kc_f16_to_f32(x[i]) / f); }
}

static void fin_stand_ins(fin* f, int copy_back) {
  if (copy_back && f->cout && f->cout_target) eng_copy_raw(f->cout_target, f->cout, f->cout->stride);
  if (f->cin != f->cout) eng_tensor_release(f->cin);
  eng_tensor_release(f->cout);
  f->cin = f->cout = f->cout_target = NULL;
}

static void fin_run(fin* f) {
  if (f->scale_p) divide_buf(f->scale_p, f->scale_n, f->scale_dt, f->divisor);
  if (f->target) copy_from_buf(f->target, f->res, f->res_dt);
  fin_stand_ins(f, 1);
  if (f->bump) eng_bump_version(f->bump);
  pool_put(&f->buf[0]);
  pool_put(&f->buf[1]);
  free(f->v);
  f->v = NULL;
}

static void fin_abort(fin* f) {
  fin_stand_ins(f, 0);
  pool_put(&f->buf[0]); pool_put(&f->buf[1]); free(f->v); f->v = NULL;
}

/* Byte range [lo, hi) of t in its storage. */
static void byte_range(const eng_tensor* t, int64_t* lo, int64_t* hi) {
  int64_t es = eng_dtype_size(t->dtype), a = t->offset, b = t->offset;
  for (int d = 0; d < t->ndim; d++) {
    if (t->shape[d] == 0) { *lo = *hi = 0; return; }
    int64_t ext = (t->shape[d] - 1) * t->stride[d];
    if (ext < 0) a += ext; else b += ext;
  }
  *lo = a * es; *hi = (b + 1) * es;
}

static int overlaps(const eng_tensor* x, const eng_tensor* y) {
  if (!x || !y || x->storage != y->storage || !x->numel || !y->numel) return 0;
  int64_t a0, a1, b0, b1;
  byte_range(x, &a0, &a1);
  byte_range(y, &b0, &b1);
  return a0 < b1 && b0 < a1;
}

/* x and y are the same view (same elements in the same order). */
static int same_view(const eng_tensor* x, const eng_tensor* y) {
  if (x == y) return 1;
  if (!x || !y || x->storage != y->storage || x->offset != y->offset || x->ndim != y->ndim) return 0;
  for (int d = 0; d < x->ndim; d++)
    if (x->shape[d] != y->shape[d] || (x->shape[d] > 1 && x->stride[d] != y->stride[d])) return 0;
  return 1;
}

typedef struct coll {
  const char* name;
  int kind, op, root;
  eng_pg* pg;
  eng_tensor* in;
  eng_tensor* out;
  const int64_t* rows; /* gather: dim-0 length of each group rank's input (NULL: all alike) */
} coll;

static int is_float(int dt) { return dt == ENG_F32 || dt == ENG_F64 || dt == ENG_BF16 || dt == ENG_F16; }

static int check_tensor(const coll* c, const eng_tensor* t, const char* what) {
  if (!t) return eng_err("%s: %s tensor is nil/NULL", c->name, what);
  if (t->dtype < 0 || t->dtype >= ENG_NUM_DTYPES) return eng_err("%s: invalid dtype code %d", c->name, t->dtype);
  if (t->device == ENG_META)
    return eng_err("%s: %s %s is a meta tensor (shape only, no data): collectives need materialised tensors", c->name,
                   what, eng_desc(t));
  if (t->device == ENG_CUDA && !eng_comm_have_nccl())
    return eng_err("%s: %s %s is a CUDA tensor but this build has no NCCL backend", c->name, what, eng_desc(t));
  return 0;
}

/* The chunk along dim 0: a 0-d tensor counts as one row. */
static int64_t rows(const eng_tensor* t) { return t->ndim ? t->shape[0] : 1; }

static int same_rest(const eng_tensor* a, const eng_tensor* b) {
  int na = a->ndim ? a->ndim : 1, nb = b->ndim ? b->ndim : 1;
  if (na != nb) return 0;
  for (int d = 1; d < a->ndim; d++) if (a->shape[d] != b->shape[d]) return 0;
  return 1;
}

/* Local checks of one collective's arguments (pg is a member). */
static int validate(const coll* c) {
  int W = c->pg->size;
  if (c->kind == ENG_COLL_ALL_REDUCE || c->kind == ENG_COLL_REDUCE_SCATTER) {
    if (c->op < 0 || c->op >= ENG_NUM_REDUCE_OPS) return eng_err("%s: invalid reduce op code %d", c->name, c->op);
  }
  if (comm_kind_rooted(c->kind) && (c->root < 0 || c->root >= W))
    return eng_err("%s: root %d is out of range for group %s of size %d (roots are group ranks)", c->name, c->root,
                   c->pg->name, W);
  switch (c->kind) {
    case ENG_COLL_BARRIER: return 0;
    case ENG_COLL_ALL_REDUCE: case ENG_COLL_BROADCAST:
      if (check_tensor(c, c->out, "the")) return -1;
      if (c->kind == ENG_COLL_ALL_REDUCE && c->op == ENG_REDUCE_AVG && !is_float(c->out->dtype))
        return eng_err("%s: op avg needs a floating dtype, got %s", c->name, eng_desc(c->out));
      if (c->kind == ENG_COLL_ALL_REDUCE && !same_view(c->in, c->out)) { /* out of place */
        if (check_tensor(c, c->in, "input")) return -1;
        int same = c->in->dtype == c->out->dtype && c->in->device == c->out->device && c->in->ndim == c->out->ndim;
        for (int d = 0; same && d < c->in->ndim; d++) same = c->in->shape[d] == c->out->shape[d];
        if (!same)
          return eng_err("%s: output %s does not match input %s (same shape, dtype and device expected)", c->name,
                         eng_desc(c->out), eng_desc(c->in));
        if (overlaps(c->in, c->out))
          return eng_err("%s: output %s and input %s share memory", c->name, eng_desc(c->out), eng_desc(c->in));
      }
      return 0;
    case ENG_COLL_ALL_GATHER:
      if (check_tensor(c, c->in, "input") || check_tensor(c, c->out, "output")) return -1;
      if (c->out->dtype != c->in->dtype || c->out->device != c->in->device || !same_rest(c->in, c->out) ||
          c->out->ndim != (c->in->ndim ? c->in->ndim : 1) || c->out->shape[0] != W * rows(c->in))
        return eng_err("%s: output %s does not match input %s gathered over group %s of size %d (expected %s[%lld,...] "
                       "with the input's trailing dims)", c->name, eng_desc(c->out), eng_desc(c->in), c->pg->name, W,
                       eng_dtype_name(c->in->dtype), (long long)(W * rows(c->in)));
      return 0;
    case ENG_COLL_REDUCE_SCATTER: case ENG_COLL_ALL_TO_ALL: {
      if (check_tensor(c, c->in, "input")) return -1;
      if (c->in->ndim == 0) return eng_err("%s: input %s is 0-d; it needs a dim 0 to split", c->name, eng_desc(c->in));
      if (c->in->shape[0] % W)
        return eng_err("%s: input %s: dim 0 (%lld) is not divisible by the size %d of group %s (uneven chunks are "
                       "not supported; pad first)", c->name, eng_desc(c->in), (long long)c->in->shape[0], W,
                       c->pg->name);
      if (c->kind == ENG_COLL_REDUCE_SCATTER && c->op == ENG_REDUCE_AVG && !is_float(c->in->dtype))
        return eng_err("%s: op avg needs a floating dtype, got %s", c->name, eng_desc(c->in));
      if (check_tensor(c, c->out, "output")) return -1;
      int64_t want0 = c->kind == ENG_COLL_REDUCE_SCATTER ? c->in->shape[0] / W : c->in->shape[0];
      if (c->out->dtype != c->in->dtype || c->out->device != c->in->device || c->out->ndim != c->in->ndim ||
          c->out->shape[0] != want0 || !same_rest(c->in, c->out))
        return eng_err("%s: output %s does not match input %s over group %s of size %d (expected %s[%lld,...])",
                       c->name, eng_desc(c->out), eng_desc(c->in), c->pg->name, W, eng_dtype_name(c->in->dtype),
                       (long long)want0);
      if (c->kind == ENG_COLL_ALL_TO_ALL && overlaps(c->in, c->out))
        return eng_err("%s: output %s and input %s share memory", c->name, eng_desc(c->out), eng_desc(c->in));
      return 0;
    }
    case ENG_COLL_SCATTER:
      if (check_tensor(c, c->out, "output")) return -1;
      if (c->pg->rank == c->root) {
        if (!c->in) return eng_err("%s: the root (group rank %d) must pass the input tensor", c->name, c->root);
        if (check_tensor(c, c->in, "input")) return -1;
        if (c->in->dtype != c->out->dtype || c->in->device != c->out->device ||
            c->in->ndim != (c->out->ndim ? c->out->ndim : 1) || c->in->shape[0] != W * rows(c->out) ||
            !same_rest(c->in, c->out))
          return eng_err("%s: input %s on the root does not match output %s over group %s of size %d (expected "
                         "%s[%lld,...])", c->name, eng_desc(c->in), eng_desc(c->out), c->pg->name, W,
                         eng_dtype_name(c->out->dtype), (long long)(W * rows(c->out)));
      }
      return 0;
    case ENG_COLL_GATHER: {
      if (check_tensor(c, c->in, "input")) return -1;
      int64_t total = W * rows(c->in);
      if (c->rows) {
        total = 0;
        for (int i = 0; i < W; i++) {
          if (c->rows[i] < 0) return eng_err("%s: sizes[%d] is %lld (negative)", c->name, i + 1, (long long)c->rows[i]);
          total += c->rows[i];
        }
        if (c->rows[c->pg->rank] != rows(c->in))
          return eng_err("%s: input %s has %lld rows, but sizes[%d] (this rank's) says %lld", c->name, eng_desc(c->in),
                         (long long)rows(c->in), c->pg->rank + 1, (long long)c->rows[c->pg->rank]);
      }
      if (c->pg->rank == c->root) {
        if (!c->out) return eng_err("%s: the destination (group rank %d) must pass the output tensor", c->name, c->root);
        if (check_tensor(c, c->out, "output")) return -1;
        if (c->out->dtype != c->in->dtype || c->out->device != c->in->device ||
            c->out->ndim != (c->in->ndim ? c->in->ndim : 1) || c->out->shape[0] != total ||
            !same_rest(c->in, c->out))
          return eng_err("%s: output %s on the destination does not match input %s gathered over group %s of size %d "
                         "(expected %s[%lld,...] with the input's trailing dims)", c->name, eng_desc(c->out),
                         eng_desc(c->in), c->pg->name, W, eng_dtype_name(c->in->dtype), (long long)total);
        if (overlaps(c->in, c->out))
          return eng_err("%s: output %s and input %s share memory", c->name, eng_desc(c->out), eng_desc(c->in));
      }
      return 0;
    }
  }
  return eng_err("%s: invalid collective kind %d", c->name, c->kind);
}

/* The tensor whose shape identifies the collective in the records. */
static const eng_tensor* key_tensor(const coll* c) {
  if (c->kind == ENG_COLL_BARRIER) return NULL;
  if (c->kind == ENG_COLL_ALL_REDUCE || c->kind == ENG_COLL_BROADCAST || c->kind == ENG_COLL_SCATTER) return c->out;
  return c->in;
}

/* ------------------------------------------------------------------ dispatch */
static eng_work* work_new(eng_pg* pg, int kind) {
  eng_work* w = calloc(1, sizeof *w);
  if (!w) return eng_errp("comm: out of memory");
  w->refcount = 1;
  w->kind = kind;
  w->rec = -1;
  w->pg = eng_pg_retain(pg);
  w->req = MPI_REQUEST_NULL;
  return w;
}

static eng_work* work_done(eng_pg* pg, int kind, eng_tensor* result) {
  eng_work* w = work_new(pg, kind);
  if (!w) return NULL;
  w->done = 1;
  w->result = eng_tensor_retain(result);
  return w;
}

static int64_t tbytes(const eng_tensor* t) { return t ? t->numel * eng_dtype_size(t->dtype) : 0; }

/* gather with per-rank sizes: element counts and offsets of each rank's rows
 * in the output (on every rank: MPI_Gatherv is a collective of its own). */
static int gather_counts(const coll* c, comm_args* a, fin* f) {
  int W = c->pg->size;
  int64_t inner = 1;
  for (int d = 1; d < c->in->ndim; d++) inner *= c->in->shape[d];
  f->v = malloc(sizeof(int) * 2 * (size_t)W);
  if (!f->v) return eng_err("%s: out of memory", c->name);
  int64_t off = 0;
  for (int i = 0; i < W; i++) {
    int64_t n = c->rows[i] * inner;
    if (n > INT_MAX || off > INT_MAX)
      return eng_err("%s: %lld elements from rank %d at offset %lld exceed the MPI limit of %d", c->name, (long long)n,
                     i, (long long)off, INT_MAX);
    f->v[i] = (int)n;
    f->v[W + i] = (int)off;
    off += n;
  }
  a->vcounts = f->v;
  a->vdispls = f->v + W;
  return 0;
}

/* Sets up buffers for the CPU path; fills a and f. */
static int plan_cpu(const coll* c, comm_args* a, fin* f) {
  int W = c->pg->size;
  eng_tensor* in = c->in;
  eng_tensor* out = c->out;
  int dt = out ? out->dtype : in ? in->dtype : ENG_F32;
  int op = c->op;
  a->kind = c->kind; a->root = c->root; a->dtype = dt;
  if (dt == ENG_BOOL && (c->kind == ENG_COLL_ALL_REDUCE || c->kind == ENG_COLL_REDUCE_SCATTER))
    op = op == ENG_REDUCE_SUM ? ENG_REDUCE_MAX : op == ENG_REDUCE_PROD ? ENG_REDUCE_MIN : op;
  a->op = op;
  /* bf16/f16 sums and products: with 2 ranks each element is combined once
   * (the custom 2-byte MPI op rounds once, half the traffic); with more the
   * values are widened to f32 so that they are still rounded only once. */
  int half = dt == ENG_BF16 || dt == ENG_F16;
  int widen = half && W > 2 && (c->kind == ENG_COLL_ALL_REDUCE || c->kind == ENG_COLL_REDUCE_SCATTER) &&
              (op == ENG_REDUCE_SUM || op == ENG_REDUCE_AVG || op == ENG_REDUCE_PROD);
  int wdt = widen ? ENG_F32 : dt;
  int64_t wes = eng_dtype_size(wdt);
  a->dtype = wdt;
  int scale = (op == ENG_REDUCE_AVG) && W > 1;
  switch (c->kind) {
    case ENG_COLL_BARRIER:
      a->count = 0;
      return 0;
    case ENG_COLL_ALL_REDUCE: case ENG_COLL_BROADCAST: {
      /* the values reduced: in (out of place, all_reduce_into) or out itself */
      const eng_tensor* src = c->kind == ENG_COLL_ALL_REDUCE && in && !same_view(in, out) ? in : out;
      a->count = out->numel;
      if (!widen && eng_tensor_is_contiguous(out)) {
        a->recv = eng_ptr(out); a->send = NULL;
        if (src != out) {
          if (eng_tensor_is_contiguous(src)) a->send = eng_ptr(src); /* MPI reads in, writes out */
          else copy_to_buf(src, a->recv, wdt);                       /* stage in out, reduce in place */
        }
        if (scale) { f->scale_p = a->recv; f->scale_n = out->numel; f->scale_dt = wdt; f->divisor = W; }
      } else {
        if (pool_get(out->numel * wes, &f->buf[0])) return -1;
        if (c->kind == ENG_COLL_ALL_REDUCE || c->pg->rank == c->root) copy_to_buf(src, f->buf[0].p, wdt);
        a->recv = f->buf[0].p; a->send = NULL;
        f->res = a->recv; f->res_dt = wdt; f->target = out;
        if (scale) { f->scale_p = a->recv; f->scale_n = out->numel; f->scale_dt = wdt; f->divisor = W; }
      }
      f->bump = out;
      return 0;
    }
    case ENG_COLL_ALL_GATHER: case ENG_COLL_ALL_TO_ALL: case ENG_COLL_REDUCE_SCATTER: case ENG_COLL_SCATTER: {
      int send_here = c->kind != ENG_COLL_SCATTER || c->pg->rank == c->root;
      if (send_here) {
        if (!widen && eng_tensor_is_contiguous(in) && !overlaps(in, out)) a->send = eng_ptr(in);
        else {
          if (pool_get(in->numel * wes, &f->buf[0])) return -1;
          copy_to_buf(in, f->buf[0].p, wdt);
          a->send = f->buf[0].p;
        }
      } else a->send = NULL;
      if (!widen && eng_tensor_is_contiguous(out)) {
        a->recv = eng_ptr(out);
      } else {
        if (pool_get(out->numel * wes, &f->buf[1])) { pool_put(&f->buf[0]); return -1; }
        a->recv = f->buf[1].p;
        f->res = a->recv; f->res_dt = wdt; f->target = out;
      }
      if (c->kind == ENG_COLL_ALL_GATHER) a->count = in->numel;
      else if (c->kind == ENG_COLL_ALL_TO_ALL) a->count = in->numel / W;
      else a->count = out->numel;
      if (scale && c->kind == ENG_COLL_REDUCE_SCATTER) {
        f->scale_p = a->recv; f->scale_n = out->numel; f->scale_dt = wdt; f->divisor = W;
      }
      f->bump = out;
      return 0;
    }
    case ENG_COLL_GATHER: {
      /* every rank sends its input; only root receives (out is NULL elsewhere) */
      if (eng_tensor_is_contiguous(in)) a->send = eng_ptr(in);
      else {
        if (pool_get(in->numel * wes, &f->buf[0])) return -1;
        copy_to_buf(in, f->buf[0].p, wdt);
        a->send = f->buf[0].p;
      }
      a->recv = NULL;
      if (c->pg->rank == c->root) {
        if (eng_tensor_is_contiguous(out)) a->recv = eng_ptr(out);
        else {
          if (pool_get(out->numel * wes, &f->buf[1])) { pool_put(&f->buf[0]); return -1; }
          a->recv = f->buf[1].p;
          f->res = a->recv; f->res_dt = wdt; f->target = out;
        }
        f->bump = out;
      }
      a->count = in->numel;
      if (c->rows && gather_counts(c, a, f)) { pool_put(&f->buf[0]); pool_put(&f->buf[1]); return -1; }
      return 0;
    }
  }
  return eng_err("%s: invalid collective kind %d", c->name, c->kind);
}

#if defined(ENG_HAVE_CUDA) && defined(ENG_HAVE_NCCL)
static int plan_cuda(const coll* c, comm_args* a, fin* f) {
  eng_tensor* in = c->in;
  eng_tensor* out = c->out;
  int W = c->pg->size;
  if (in && out && !same_view(in, out) && c->kind != ENG_COLL_SCATTER && overlaps(in, out))
    return eng_err("%s: output %s and input %s share memory", c->name, eng_desc(out), eng_desc(in));
  /* NCCL reads and writes flat buffers: a strided view goes through a contiguous stand-in made on the compute
   * stream (which the communication stream waits for), and a strided output is copied back when the collective
   * is finished (fin_run: after the compute stream waited for it) */
  if ((in && !eng_tensor_is_contiguous(in)) || (out && !eng_tensor_is_contiguous(out))) {
    int inplace = in && out && same_view(in, out);
    int reads_out = c->kind == ENG_COLL_BROADCAST || (c->kind == ENG_COLL_ALL_REDUCE && (!in || inplace));
    if (out && !eng_tensor_is_contiguous(out)) {
      f->cout = reads_out || inplace ? eng_as_contig(out, out->dtype)
                                     : eng_new(out->ndim, out->shape, out->dtype, out->device);
      if (!f->cout) return eng_err("%s: no memory for a contiguous copy of %s", c->name, eng_desc(out));
      f->cout_target = out;
    }
    if (in && !eng_tensor_is_contiguous(in)) {
      if (inplace) f->cin = f->cout;
      else if (!(f->cin = eng_as_contig(in, in->dtype))) {
        fin_stand_ins(f, 0);
        return eng_err("%s: no memory for a contiguous copy of %s", c->name, eng_desc(in));
      }
    }
    if (f->cin) in = f->cin;
    if (f->cout) out = f->cout;
  }
  int op = c->op;
  int dt = out ? out->dtype : in ? in->dtype : ENG_F32;
  if (dt == ENG_BOOL) op = op == ENG_REDUCE_SUM ? ENG_REDUCE_MAX : op == ENG_REDUCE_PROD ? ENG_REDUCE_MIN : op;
  a->kind = c->kind; a->op = op; a->root = c->root; a->dtype = dt;
  a->send = in ? eng_ptr(in) : NULL;
  a->recv = out ? eng_ptr(out) : NULL;
  switch (c->kind) {
    case ENG_COLL_ALL_REDUCE: case ENG_COLL_BROADCAST:
      a->count = out->numel;
      if (c->kind == ENG_COLL_BROADCAST || !in || same_view(in, out)) a->send = a->recv;
      break;
    case ENG_COLL_ALL_GATHER: a->count = in->numel; break;
    case ENG_COLL_GATHER:
      a->count = in->numel;
      if (c->rows && gather_counts(c, a, f)) return -1;
      break;
    case ENG_COLL_ALL_TO_ALL: a->count = in->numel / W; break;
    case ENG_COLL_REDUCE_SCATTER: case ENG_COLL_SCATTER: a->count = out->numel; break;
    default: a->count = 0;
  }
  f->bump = c->out;
  return 0;
}
#endif

static int run(const coll* c, eng_work** work) {
  if (work) *work = NULL;
  if (!c->pg) return eng_err("%s: process group is nil/NULL", c->name);
  if (!c->pg->member) {
    /* not in the group: skip, as PyTorch does */
    if (work) { *work = work_done(c->pg, c->kind, c->out ? c->out : c->in); if (!*work) return -1; }
    return 0;
  }
  if (!eng_dist_is_initialized()) return eng_err("%s: the distributed runtime is not running", c->name);
  if (comm_gpu_refuse(c->pg, c->name)) return -1; /* a GPU wait aborted its communicator */
  int err = validate(c);
  int64_t seq = c->pg->seq;
  const eng_tensor* kt = key_tensor(c);
  if (comm_check_on()) {
    int on_cuda = (c->out && c->out->device == ENG_CUDA) || (c->in && c->in->device == ENG_CUDA);
    int rc = comm_check_collective(c->pg, c->name, c->kind, c->op, c->root, kt, c->rows, err, on_cuda);
    /* every rank took part in the check, so every rank counts it */
    c->pg->seq++;
    if (rc) {
      if (!err) {
        int64_t id = comm_record_start(c->pg, seq, c->kind, kt ? kt->dtype : -1, c->op, c->root, kt ? kt->ndim : 0,
                                       kt ? kt->shape : NULL, work != NULL);
        comm_record_end(id, 2);
      }
      return -1;
    }
  } else if (err) {
    return -1;
  } else {
    c->pg->seq++;
  }
  int64_t rec = comm_record_start(c->pg, seq, c->kind, kt ? kt->dtype : -1, c->op, c->root, kt ? kt->ndim : 0,
                                  kt ? kt->shape : NULL, work != NULL);
  comm_count(c->kind, tbytes(c->kind == ENG_COLL_SCATTER ? c->out : (c->in ? c->in : c->out)));

  comm_args a;
  memset(&a, 0, sizeof a);
  fin f;
  memset(&f, 0, sizeof f);
  f.buf[0].slot = f.buf[1].slot = -1;
  int cuda = (c->out && c->out->device == ENG_CUDA) || (c->in && c->in->device == ENG_CUDA);
  int rc;
#if defined(ENG_HAVE_CUDA) && defined(ENG_HAVE_NCCL)
  rc = cuda ? plan_cuda(c, &a, &f) : plan_cpu(c, &a, &f);
#else
  rc = cuda ? eng_err("%s: CUDA tensors need a build with NCCL", c->name) : plan_cpu(c, &a, &f);
#endif
  if (rc) { comm_record_end(rec, 2); return -1; }

  eng_work* w = NULL;
  if (work) {
    w = work_new(c->pg, c->kind);
    if (!w) { fin_abort(&f); comm_record_end(rec, 2); return -1; }
    w->rec = rec;
    w->seq = seq;
  }
#if defined(ENG_HAVE_CUDA) && defined(ENG_HAVE_NCCL)
  if (cuda && c->kind != ENG_COLL_BARRIER) rc = comm_nccl_issue(c->pg, &a, w ? &w->event : NULL);
  else rc = comm_mpi_issue(c->pg, &a, w ? &w->req : NULL);
#else
  rc = comm_mpi_issue(c->pg, &a, w ? &w->req : NULL);
#endif
  if (rc) {
    fin_abort(&f);
    comm_record_end(rec, 2);
    comm_err_append_history();
    if (w) { w->done = 1; eng_work_release(w); }
    return -1;
  }
  if (c->kind != ENG_COLL_BARRIER) comm_stream_trace_issue(c->pg, c->kind, seq, w != NULL);
  if (!w) {
    fin_run(&f);
    comm_record_end(rec, 1);
    return 0;
  }
  w->backend = (cuda && c->kind != ENG_COLL_BARRIER) ? 2 : 1;
  w->f = f;
  w->result = eng_tensor_retain(c->out);
  w->keep = eng_tensor_retain(c->in);
  *work = w;
  return 0;
}

/* ------------------------------------------------------------------ public collectives */
int eng_pg_all_reduce(eng_pg* pg, eng_tensor* t, int op, eng_work** work) {
  coll c = {"all_reduce", ENG_COLL_ALL_REDUCE, op, 0, pg, t, t};
  return run(&c, work);
}

int eng_pg_all_reduce_into(eng_pg* pg, eng_tensor* out, eng_tensor* in, int op, eng_work** work) {
  coll c = {"all_reduce_into", ENG_COLL_ALL_REDUCE, op, 0, pg, in ? in : out, out};
  if (!in && pg && pg->member) { if (work) *work = NULL; return eng_err("all_reduce_into: input tensor is nil/NULL"); }
  return run(&c, work);
}

int eng_pg_broadcast(eng_pg* pg, eng_tensor* t, int root, eng_work** work) {
  coll c = {"broadcast", ENG_COLL_BROADCAST, 0, root, pg, t, t};
  return run(&c, work);
}

int eng_pg_barrier(eng_pg* pg, eng_work** work) {
  coll c = {"barrier", ENG_COLL_BARRIER, 0, 0, pg, NULL, NULL};
  return run(&c, work);
}

int eng_pg_all_gather_into(eng_pg* pg, eng_tensor* out, eng_tensor* in, eng_work** work) {
  coll c = {"all_gather_into", ENG_COLL_ALL_GATHER, 0, 0, pg, in, out};
  return run(&c, work);
}

int eng_pg_reduce_scatter_into(eng_pg* pg, eng_tensor* out, eng_tensor* in, int op, eng_work** work) {
  coll c = {"reduce_scatter_into", ENG_COLL_REDUCE_SCATTER, op, 0, pg, in, out};
  return run(&c, work);
}

int eng_pg_all_to_all_into(eng_pg* pg, eng_tensor* out, eng_tensor* in, eng_work** work) {
  coll c = {"all_to_all_into", ENG_COLL_ALL_TO_ALL, 0, 0, pg, in, out};
  return run(&c, work);
}

int eng_pg_scatter(eng_pg* pg, eng_tensor* out, eng_tensor* in, int root, eng_work** work) {
  coll c = {"scatter", ENG_COLL_SCATTER, 0, root, pg, in, out};
  return run(&c, work);
}

int eng_pg_gather(eng_pg* pg, eng_tensor* out, eng_tensor* in, int root, eng_work** work) {
  return eng_pg_gatherv(pg, out, in, NULL, root, work);
}

int eng_pg_gatherv(eng_pg* pg, eng_tensor* out, eng_tensor* in, const int64_t* sizes, int root, eng_work** work) {
  /* out is ignored away from root */
  coll c = {"gather", ENG_COLL_GATHER, 0, root, pg, in, pg && pg->member && pg->rank == root ? out : NULL, sizes};
  return run(&c, work);
}


/* Out-of-place forms: allocate the output when the input allows it; the
 * checks (and, in debug mode, the exchange) then run as for the _into form. */
static eng_tensor* out_of_place(const char* name, int kind, eng_pg* pg, eng_tensor* in, int op, eng_work** work) {
  if (work) *work = NULL;
  if (!pg) return eng_errp("%s: process group is nil/NULL", name);
  if (!pg->member) {
    if (!in) return eng_errp("%s: input tensor is nil/NULL", name);
    if (work) { *work = work_done(pg, kind, in); if (!*work) return NULL; }
    return eng_tensor_retain(in);
  }
  int W = pg->size;
  eng_tensor* out = NULL;
  if (in && in->dtype >= 0 && in->dtype < ENG_NUM_DTYPES) {
    int64_t shape[8];
    int nd = in->ndim ? in->ndim : 1;
    for (int d = 0; d < in->ndim; d++) shape[d] = in->shape[d];
    int ok = 1;
    if (kind == ENG_COLL_ALL_GATHER) shape[0] = W * rows(in);
    else if (kind == ENG_COLL_REDUCE_SCATTER) { ok = in->ndim > 0 && in->shape[0] % W == 0; if (ok) shape[0] /= W; }
    else ok = in->ndim > 0;
    if (ok) {
      out = eng_new(nd, shape, in->dtype, in->device);
      if (!out) return NULL;
    }
  }
  coll c = {name, kind, op, 0, pg, in, out};
  if (run(&c, work)) { eng_tensor_release(out); return NULL; }
  return out;
}

eng_tensor* eng_pg_all_gather(eng_pg* pg, eng_tensor* in, eng_work** work) {
  return out_of_place("all_gather", ENG_COLL_ALL_GATHER, pg, in, 0, work);
}

eng_tensor* eng_pg_reduce_scatter(eng_pg* pg, eng_tensor* in, int op, eng_work** work) {
  return out_of_place("reduce_scatter", ENG_COLL_REDUCE_SCATTER, pg, in, op, work);
}

eng_tensor* eng_pg_all_to_all(eng_pg* pg, eng_tensor* in, eng_work** work) {
  return out_of_place("all_to_all", ENG_COLL_ALL_TO_ALL, pg, in, 0, work);
}

int eng_pg_raw_collective(eng_pg* pg, int kind, const void* send, void* recv, int64_t count, int dtype, int op,
                          int root) {
  if (!pg) return eng_err("raw_collective: process group is NULL");
  if (!pg->member) return 0;
  if (kind < 0 || kind >= ENG_NUM_COLL_KINDS) return eng_err("raw_collective: invalid kind %d", kind);
  if (dtype != ENG_F32 && dtype != ENG_F64 && dtype != ENG_I32 && dtype != ENG_I64 && dtype != ENG_U8)
    return eng_err("raw_collective: dtype %s is not supported (f32, f64, i32, i64, u8)",
                   eng_dtype_name(dtype) ? eng_dtype_name(dtype) : "?");
  if ((kind == ENG_COLL_ALL_REDUCE || kind == ENG_COLL_REDUCE_SCATTER) &&
      (op < 0 || op >= ENG_NUM_REDUCE_OPS || op == ENG_REDUCE_AVG))
    return eng_err("raw_collective: op %d is not supported (sum, max, min, prod)", op);
  if (root < 0 || root >= pg->size) return eng_err("raw_collective: root %d out of range", root);
  comm_args a = {kind, op, root, dtype, send, recv, count, NULL, NULL};
  if (kind == ENG_COLL_GATHER && op == 1) { /* as MPI_Gatherv with equal counts */
    if (count > INT_MAX || count * pg->size > INT_MAX) return eng_err("raw_collective: count %lld too large", (long long)count);
    int* v = malloc(sizeof(int) * 2 * (size_t)pg->size);
    if (!v) return eng_err("raw_collective: out of memory");
    for (int i = 0; i < pg->size; i++) { v[i] = (int)count; v[pg->size + i] = (int)(count * i); }
    a.vcounts = v; a.vdispls = v + pg->size;
    int rc = comm_mpi_issue(pg, &a, NULL);
    free(v);
    return rc;
  }
  return comm_mpi_issue(pg, &a, NULL);
}

int eng_pg_raw_all_to_all_strided(eng_pg* pg, const void* send, void* recv, int64_t rows, int64_t block,
                                  int64_t row_stride, int dtype) {
  if (!pg) return eng_err("raw_all_to_all_strided: process group is NULL");
  if (!pg->member) return 0;
  if (dtype != ENG_F32 && dtype != ENG_F64 && dtype != ENG_I32 && dtype != ENG_I64 && dtype != ENG_U8)
    return eng_err("raw_all_to_all_strided: dtype %s is not supported (f32, f64, i32, i64, u8)",
                   eng_dtype_name(dtype) ? eng_dtype_name(dtype) : "?");
  return comm_mpi_alltoall_vector(pg, send, recv, rows, block, row_stride, dtype);
}

/* ------------------------------------------------------------------ work handles */
static int work_finish(eng_work* w, int ok) {
  w->done = 1;
  if (ok) {
    fin_run(&w->f);
    comm_record_end(w->rec, 1);
    w->status = 0;
  } else {
    fin_abort(&w->f);
    comm_record_end(w->rec, 2);
    w->status = -1;
    snprintf(w->err, sizeof w->err, "%s", eng_last_error());
  }
#if defined(ENG_HAVE_CUDA) && defined(ENG_HAVE_NCCL)
  if (w->backend == 2) comm_nccl_event_free(w->event);
#endif
  w->event = NULL;
  return w->status;
}

int eng_work_wait(eng_work* w) {
  if (!w) return eng_err("wait: work handle is NULL");
  if (!w->done) {
    int ok = 1;
    if (w->backend == 1) {
      comm_guard_begin(w->pg, eng_coll_kind_name(w->kind)); /* under the comm timeout, as blocking calls */
      int rc = MPI_Wait(&w->req, MPI_STATUS_IGNORE);
      comm_guard_end();
      if (rc != MPI_SUCCESS) {
        eng_err("%s: %s on group %s (async)", eng_coll_kind_name(w->kind), comm_mpi_errstr(rc), w->pg->name);
        ok = 0;
      }
    } else if (w->backend == 2) {
#if defined(ENG_HAVE_CUDA) && defined(ENG_HAVE_NCCL)
      /* on the host, under the comm timeout and the watchdog, then the compute stream waits too */
      if (comm_gpu_wait(w->pg, w->event, w->kind, w->seq) || comm_nccl_wait(w->event)) ok = 0;
#endif
    }
    if (ok && w->kind != ENG_COLL_BARRIER) comm_stream_trace("wait s0 <- e%lld", (long long)w->seq);
    work_finish(w, ok);
  }
  if (w->status) return eng_set_error_message(w->err);
  return 0;
}

int eng_work_is_completed(eng_work* w) {
  if (!w) return eng_err("is_completed: work handle is NULL");
  if (!w->done) {
    if (w->backend == 1) {
      int flag = 0;
      int rc = MPI_Test(&w->req, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        eng_err("%s: %s on group %s (async)", eng_coll_kind_name(w->kind), comm_mpi_errstr(rc), w->pg->name);
        work_finish(w, 0);
      } else if (flag) work_finish(w, 1);
      else return 0;
    } else if (w->backend == 2) {
#if defined(ENG_HAVE_CUDA) && defined(ENG_HAVE_NCCL)
      int r = comm_nccl_test(w->event);
      if (r == 0) return 0;
      work_finish(w, r > 0);
#endif
    }
  }
  if (w->status) return eng_set_error_message(w->err);
  return 1;
}

eng_tensor* eng_work_result(eng_work* w) { return w ? w->result : NULL; }

eng_work* eng_work_retain(eng_work* w) {
  if (w) __atomic_add_fetch(&w->refcount, 1, __ATOMIC_RELAXED);
  return w;
}

void eng_work_release(eng_work* w) {
  if (!w) return;
  if (__atomic_sub_fetch(&w->refcount, 1, __ATOMIC_ACQ_REL) != 0) return;
  if (!w->done && eng_dist_is_initialized()) eng_work_wait(w); /* buffers must outlive the transfer */
  eng_tensor_release(w->result);
  eng_tensor_release(w->keep);
  eng_pg_release(w->pg);
  free(w);
}

