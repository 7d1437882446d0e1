/* cma.c: single-copy strided exchanges between the ranks of one node,
 * through Linux cross-memory attach (process_vm_writev / process_vm_readv).
 *
 * Why: DTensor's S(a)->S(b) all_to_all and S(d)->R all_gather along a dim
 * other than the first move strided blocks.  Through MPI they need a pack
 * into a contiguous send buffer (and, for the gather, an unpack after it):
 * one extra pass over the data, which on a node with fewer cores than ranks
 * costs as much as the collective itself (S(1)->S(2) of 64 MiB on 4 ranks:
 * 2.5x the bare MPI_Alltoall).  Here every rank describes its input and
 * output (pid, addresses, shapes, strides) in one small all_gather; each
 * block then moves once, straight from the sender's input into the
 * receiver's output, written by the sender or read by the receiver (see
 * sender_moves), with iovecs of the strided runs (one copy per byte, as Open
 * MPI's vader does for large contiguous messages); a closing all_reduce of
 * the status both
 * keeps the inputs alive until everyone has read them and makes any failure
 * a failure of every rank.
 *
 * Used only when every member of the group is on this node and every member
 * can read every other member's memory (a probe, collective, once per group),
 * not in debug mode (whose
 * fingerprint exchange belongs to the ordinary path), for CPU tensors, and
 * when every strided run is at least CMA_MIN_RUN bytes.  Otherwise the caller
 * takes the MPI path; the decision is the same on every rank.  ENGINE_CMA=0
 * turns it off. */
#define _GNU_SOURCE
#include "comm/comm_impl.h"
#include "comm/guard.h"
#include "eng/comm.h"
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <sys/types.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/uio.h>
#endif

#define CMA_MIN_RUN 256 /* bytes: shorter runs cost more in iovec handling than a pack saves */
#define CMA_IOV 1024    /* entries per process_vm_readv call (IOV_MAX on Linux) */

/* A blocking MPI call under the comm timeout (comm/guard.c): a peer lost on the way fails the job
 * instead of hanging it. */
static int guarded_end(int rc) { comm_guard_end(); return rc; }
#define PROBE "single-copy probe"
#define XCHG "single-copy exchange"
#define GUARDED(what, call) (comm_guard_begin(pg, (what)), guarded_end(call))

typedef struct cma_desc {
  int64_t pid;
  uint64_t base, obase;               /* addresses of the input's and the output's element 0 */
  int32_t dtype, ndim, split, cat, kind, err;
  int64_t shape[8], stride[8];        /* the input */
  int64_t oshape[8], ostride[8];      /* the output */
  char msg[200];                      /* err: this rank's message */
} cma_desc;

static int g_enabled = -1; /* -1: not read from the environment yet */
static int64_t g_count;

static int enabled(void) {
  if (g_enabled < 0) {
    const char* e = getenv("ENGINE_CMA");
    g_enabled = !(e && !strcmp(e, "0"));
  }
  return g_enabled;
}

int eng_comm_set_single_copy(int on) { g_enabled = on ? 1 : 0; return 0; }
int eng_comm_get_single_copy(void) { return enabled(); }
int64_t eng_comm_single_copy_count(void) { return g_count; }

/* pg->cma: 0 not probed yet, 1 usable, else why not (the same on every member): */
enum {
  CMA_NO_OTHER = -1,     /* an exchange failed after the probe (cma_* below), or not Linux */
  CMA_NO_NODES = -2,     /* the members are on different nodes (shared-memory communicator smaller) */
  CMA_NO_ACCESS = -3,    /* a member could not read a peer's memory (ptrace rules, pid namespaces) */
  CMA_NO_PROBE = -4,     /* the probe itself failed (out of memory, MPI error) */
};

#ifdef __linux__
#include <sys/syscall.h>
#include <time.h>
/* This process's probe token: random, so that a read that returns it proves that the pid a peer
 * published is this very process (not another process with the same pid number in another pid
 * namespace or on another host) and that the peer may access its memory. */
static volatile uint64_t g_probe_word;

static uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static uint64_t probe_token(void) {
  if (g_probe_word) return g_probe_word;
  uint64_t t = 0;
#ifdef SYS_getrandom
  if (syscall(SYS_getrandom, &t, sizeof t, 0) != (long)sizeof t) t = 0;
#endif
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  t ^= mix64((uint64_t)getpid() << 32 ^ (uint64_t)ts.tv_nsec ^ (uint64_t)ts.tv_sec << 20 ^ (uint64_t)(uintptr_t)&ts);
  g_probe_word = t ? t : 1;
  return g_probe_word;
}

/* Collective on the members of pg, once per group: 1 when every member is on this node and every
 * member can read the memory of every other member (each reads every peer's token: the single-copy
 * exchanges write into and read from every peer, not only a neighbour).  process_vm_writev needs
 * the same access as process_vm_readv (PTRACE_MODE_ATTACH_REALCREDS), so a successful read of the
 * right token also vouches for the writes.  Else the reason (CMA_NO_*). */
static int probe(eng_pg* pg) {
  int why = 0;
  MPI_Comm node = MPI_COMM_NULL;
  int nsize = 0;
  if (MPI_Comm_split_type(pg->comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) != MPI_SUCCESS) why = CMA_NO_PROBE;
  else {
    MPI_Comm_size(node, &nsize);
    MPI_Comm_free(&node);
    if (nsize != pg->size) why = CMA_NO_NODES;
  }
  struct { int64_t pid; uint64_t addr, token; } me, *all;
  me.pid = (int64_t)getpid();
  me.addr = (uint64_t)(uintptr_t)&g_probe_word;
  me.token = probe_token();
  all = malloc(sizeof *all * (size_t)pg->size);
  if (!all && !why) why = CMA_NO_PROBE;
  int rc = GUARDED(PROBE, MPI_Allgather(&me, (int)sizeof me, MPI_BYTE, all ? (void*)all : (void*)&me,
                                        all ? (int)sizeof me : 0, MPI_BYTE, pg->comm));
  if (rc != MPI_SUCCESS && !why) why = CMA_NO_PROBE;
  for (int step = 1; !why && all && step < pg->size; step++) {
    int peer = (pg->rank + step) % pg->size;
    uint64_t v = 0;
    struct iovec l = {&v, sizeof v}, r = {(void*)(uintptr_t)all[peer].addr, sizeof v};
    ssize_t n = process_vm_readv((pid_t)all[peer].pid, &l, 1, &r, 1, 0);
    if (n != (ssize_t)sizeof v || v != all[peer].token) why = CMA_NO_ACCESS;
  }
  free(all);
  /* the first reason in the order NODES, ACCESS, PROBE on every member (MIN of the negated codes) */
  int code = why == CMA_NO_NODES ? 1 : why == CMA_NO_ACCESS ? 2 : why ? 3 : 4, first = 3;
  if (GUARDED(PROBE, MPI_Allreduce(&code, &first, 1, MPI_INT, MPI_MIN, pg->comm)) != MPI_SUCCESS)
    first = 3;
  return first == 4 ? 1 : first == 1 ? CMA_NO_NODES : first == 2 ? CMA_NO_ACCESS : CMA_NO_PROBE;
}
#endif

int comm_cma_usable(eng_pg* pg, int device) {
  if (!pg || !pg->member || device != ENG_CPU || pg->size < 2 || !enabled() || eng_comm_get_debug()) return 0;
#ifdef __linux__
  if (pg->cma == 0) {
    /* the probe's collectives run on the data communicator: agree first (on the control one), so that a
     * rank meeting another rank's collective here fails with a mismatch instead of waiting for ever */
    if (comm_check_on() && eng_pg_agree(pg, 0, COMM_FNV_SEED ^ 0x5c0b, "single-copy probe")) return -1;
    pg->cma = probe(pg);
  }
  return pg->cma > 0;
#else
  pg->cma = CMA_NO_OTHER;
  return 0;
#endif
}

const char* eng_pg_single_copy_reason(eng_pg* pg) {
  if (!pg) return "no process group";
  if (!pg->member) return "this rank is not a member of the group";
  if (pg->size < 2) return "the group has one member";
  if (!enabled()) return "turned off (set_single_copy(false) or ENGINE_CMA=0)";
  if (eng_comm_get_debug()) return "the comm debug mode is on (it checks every collective the MPI way)";
  switch (pg->cma) {
    case 1: return "";
    case 0: return "not probed yet (ask single_copy_usable first, on every member)";
    case CMA_NO_NODES: return "the members are on different nodes";
    case CMA_NO_ACCESS:
      return "a member may not read or write another member's memory (ptrace rules or pid namespaces)";
    case CMA_NO_PROBE: return "the probe of the members failed (out of memory or an MPI error)";
    default:
#ifdef __linux__
      return "an exchange failed on some member; the group uses the MPI path from then on";
#else
      return "cross-memory attach needs Linux";
#endif
  }
}

int eng_pg_single_copy_usable(eng_pg* pg) { return comm_cma_usable(pg, ENG_CPU) > 0; }

#ifdef __linux__
/* The largest block of trailing dims that is contiguous in both geometries
 * (in elements), and the number of outer dims left to walk. */
static int64_t common_run(int nd, const int64_t* shape, const int64_t* sa, const int64_t* sb, int* outer) {
  int64_t m = 1;
  int d = nd - 1;
  for (; d >= 0; d--) {
    if (shape[d] == 1) continue;
    if (sa[d] != m || sb[d] != m) break;
    m *= shape[d];
  }
  *outer = d + 1;
  return m;
}

/* The block that rank `src` sends to rank `dst`: shape, and the element
 * offsets in src's input and dst's output. */
static void block_of(const cma_desc* all, int k, int src, int dst, int64_t* shape, int64_t* in_off, int64_t* out_off) {
  const cma_desc* s = &all[src];
  const cma_desc* d = &all[dst];
  int nd = s->ndim, cat = s->cat, split = s->split;
  for (int j = 0; j < nd; j++) shape[j] = s->shape[j];
  *in_off = 0;
  if (split >= 0) {
    int64_t sz, off;
    eng_shard_size_and_offset(s->shape[split], k, dst, &sz, &off);
    shape[split] = sz;
    *in_off = off * s->stride[split];
  }
  int64_t c = 0;
  for (int q = 0; q < src; q++) c += all[q].shape[cat];
  *out_off = c * d->ostride[cat];
}

/* Checks the descriptors (the same verdict on every rank): -1 error (message
 * set), 1 declined, 0 go. */
static int check_all(const cma_desc* all, int k, int me, const char* op, const char* what, const char* group) {
  for (int i = 0; i < k; i++)
    if (all[i].err) {
      if (i != me) eng_err("%s: %s on group %s: group rank %d failed its checks: %s", op, what, group, i, all[i].msg);
      return -1;
    }
  const cma_desc* z = &all[0];
  for (int i = 1; i < k; i++) {
    const cma_desc* d = &all[i];
    int bad = d->dtype != z->dtype || d->ndim != z->ndim || d->split != z->split || d->cat != z->cat || d->kind != z->kind;
    for (int j = 0; !bad && j < z->ndim; j++) if (j != z->cat && d->shape[j] != z->shape[j]) bad = 1;
    if (bad) {
      char a[128], b[128];
      snprintf(a, sizeof a, "%s%s", eng_dtype_name(z->dtype) ? eng_dtype_name(z->dtype) : "?", eng_shape_str(z->ndim, z->shape));
      snprintf(b, sizeof b, "%s%s", eng_dtype_name(d->dtype) ? eng_dtype_name(d->dtype) : "?", eng_shape_str(d->ndim, d->shape));
      return eng_err("%s: %s on group %s: group rank 0 sends %s (split dim %d, concat dim %d) but group rank %d sends %s "
                     "(split dim %d, concat dim %d): every rank must send the same layout except the size of the "
                     "concat dim", op, what, group, a, z->split, z->cat, i, b, d->split, d->cat);
    }
  }
  int64_t es = eng_dtype_size(z->dtype), total = 0;
  for (int i = 0; i < k; i++) total += all[i].shape[z->cat];
  for (int dst = 0; dst < k; dst++) {
    if (all[dst].oshape[z->cat] != total) {
      return eng_err("%s: %s on group %s: group rank %d's output has %lld entries on the concat dim, the inputs "
                     "add up to %lld", op, what, group, dst, (long long)all[dst].oshape[z->cat], (long long)total);
    }
    for (int src = 0; src < k; src++) {
      if (src == dst) continue;
      int64_t shape[8], io, oo;
      block_of(all, k, src, dst, shape, &io, &oo);
      if (eng_shape_numel(z->ndim, shape) == 0) continue;
      int outer;
      int64_t run = common_run(z->ndim, shape, all[src].stride, all[dst].ostride, &outer);
      if (run * es < CMA_MIN_RUN) return 1;
    }
  }
  return 0;
}

/* Number of contiguous segments of a box in one geometry. */
static int64_t segments(int nd, const int64_t* shape, const int64_t* st) {
  int outer;
  int64_t m = common_run(nd, shape, st, st, &outer);
  return m ? eng_shape_numel(nd, shape) / m : 0;
}

/* Who moves the block src -> dst: the sender writes it (1) or the receiver
 * reads it (0).  The kernel pins the pages of the REMOTE side one iovec at a
 * time, so the side whose block is in fewer pieces should be the remote one:
 * S(1)->S(2) reads 4 KiB rows out of each peer's rows but writes them into
 * one contiguous range of the peer's output, so senders write.  Computed
 * from the descriptors alone: both ranks of a pair agree. */
static int sender_moves(const cma_desc* all, int k, int src, int dst) {
  int64_t shape[8], io, oo;
  block_of(all, k, src, dst, shape, &io, &oo);
  int nd = all[src].ndim;
  return segments(nd, shape, all[dst].ostride) < segments(nd, shape, all[src].stride);
}

/* Moves one block between this process and pid: write (process_vm_writev)
 * from the local geometry into the remote one, or read the other way;
 * iovecs of the runs, merged where a side is contiguous across runs. */
static int xfer(pid_t pid, int write, char* rbase, const int64_t* rst, char* lbase, const int64_t* lst, int nd,
                const int64_t* shape, int64_t es) {
  int outer;
  int64_t run = common_run(nd, shape, rst, lst, &outer);
  int64_t nruns = eng_shape_numel(outer, shape), rb = run * es;
  struct iovec liov[CMA_IOV], riov[CMA_IOV];
  int nl = 0, nr = 0;
  ssize_t want = 0;
  int64_t idx[8] = {0};
  for (int64_t u = 0; u < nruns; u++) {
    int64_t ro = 0, lo = 0;
    for (int j = 0; j < outer; j++) { ro += idx[j] * rst[j]; lo += idx[j] * lst[j]; }
    char* rp = rbase + ro * es;
    char* lp = lbase + lo * es;
    if (nr && (char*)riov[nr - 1].iov_base + riov[nr - 1].iov_len == rp) riov[nr - 1].iov_len += (size_t)rb;
    else { riov[nr].iov_base = rp; riov[nr].iov_len = (size_t)rb; nr++; }
    if (nl && (char*)liov[nl - 1].iov_base + liov[nl - 1].iov_len == lp) liov[nl - 1].iov_len += (size_t)rb;
    else { liov[nl].iov_base = lp; liov[nl].iov_len = (size_t)rb; nl++; }
    want += (ssize_t)rb;
    for (int j = outer - 1; j >= 0; j--) { if (++idx[j] < shape[j]) break; idx[j] = 0; }
    if (nr == CMA_IOV || nl == CMA_IOV || u == nruns - 1 || want > (ssize_t)1 << 30) {
      ssize_t got = write ? process_vm_writev(pid, liov, (unsigned long)nl, riov, (unsigned long)nr, 0)
                          : process_vm_readv(pid, liov, (unsigned long)nl, riov, (unsigned long)nr, 0);
      if (got != want) return got < 0 ? errno : EIO;
      nl = nr = 0;
      want = 0;
    }
  }
  return 0;
}
#endif

int comm_cma_exchange(eng_pg* pg, const char* op, int kind, eng_tensor* out, const eng_tensor* in, int split, int cat,
                      int local_err) {
#ifndef __linux__
  (void)pg; (void)op; (void)kind; (void)out; (void)in; (void)split; (void)cat; (void)local_err;
  return 1;
#else
  const char* what = eng_coll_kind_name(kind);
  if (comm_check(pg, what, kind, in, local_err)) return -1; /* every rank issued this exchange */
  int k = pg->size, me = pg->rank, nd = in->ndim;
  cma_desc mine;
  memset(&mine, 0, sizeof mine);
  mine.pid = (int64_t)getpid();
  mine.base = (uint64_t)(uintptr_t)(in->numel ? eng_ptr(in) : NULL);
  mine.obase = (uint64_t)(uintptr_t)(out && out->numel ? eng_ptr(out) : NULL);
  mine.dtype = in->dtype; mine.ndim = nd; mine.split = split; mine.cat = cat; mine.kind = kind;
  for (int j = 0; j < nd; j++) {
    mine.shape[j] = in->shape[j]; mine.stride[j] = in->stride[j];
    if (out) { mine.oshape[j] = out->shape[j]; mine.ostride[j] = out->stride[j]; }
  }
  /* local checks: the output must be this rank's block layout */
  if (local_err) mine.err = 1; /* the caller's message stands */
  else if (!out) {
    mine.err = 1;
    eng_err("%s: %s: no output tensor", op, what);
  } else if (out->ndim != nd || out->dtype != in->dtype || in->device != ENG_CPU || out->device != ENG_CPU) {
    mine.err = 1;
    eng_err("%s: %s: output %s does not match input %s", op, what, eng_desc(out), eng_desc(in));
  } else {
    for (int j = 0; j < nd && !mine.err; j++) {
      int64_t want = in->shape[j], off;
      if (j == split) eng_shard_size_and_offset(in->shape[j], k, me, &want, &off);
      if (j != cat && out->shape[j] != want) {
        mine.err = 1;
        eng_err("%s: %s: output %s does not match input %s (dim %d: %lld entries expected)", op, what, eng_desc(out),
                eng_desc(in), j + 1, (long long)want);
      }
    }
  }
  cma_desc* all = malloc(sizeof *all * (size_t)k);
  if (!all) { mine.err = 1; eng_err("%s: %s: out of memory", op, what); }
  if (mine.err) snprintf(mine.msg, sizeof mine.msg, "%s", eng_last_error());
  int rc = GUARDED(XCHG, MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, all ? (void*)all : (void*)&mine,
                                       all ? (int)sizeof mine : 0, MPI_BYTE, pg->comm));
  if (rc != MPI_SUCCESS) { free(all); return eng_err("%s: %s on group %s: %s", op, what, pg->name, comm_mpi_errstr(rc)); }
  if (!all) return -1;
  int verdict = check_all(all, k, me, op, what, pg->name);
  if (verdict) { free(all); return verdict; }

  int64_t rec = comm_account_begin(pg, kind, in);
  int64_t es = eng_dtype_size(in->dtype);
  int err = 0;
  for (int step = 0; step < k && !err; step++) {
    /* step 0: this rank's own block; step s: the block to (me + s) and the
     * one from (me - s), so that at each step every rank works with a
     * different peer */
    int to = (me + step) % k, from = (me + k - step) % k;
    int64_t shape[8], io, oo;
    if (step == 0) {
      block_of(all, k, me, me, shape, &io, &oo);
      if (eng_shape_numel(nd, shape) == 0) continue;
      eng_tensor* s = eng_view_of(in, nd, shape, in->stride, in->offset + io);
      eng_tensor* d = eng_view_of(out, nd, shape, out->stride, out->offset + oo);
      if (!s || !d || eng_copy_raw(d, s, s->stride)) err = ENOMEM;
      eng_tensor_release(s);
      eng_tensor_release(d);
      continue;
    }
    if (sender_moves(all, k, me, to)) {
      block_of(all, k, me, to, shape, &io, &oo);
      if (eng_shape_numel(nd, shape) > 0)
        err = xfer((pid_t)all[to].pid, 1, (char*)(uintptr_t)all[to].obase + oo * es, all[to].ostride,
                   eng_ptr(in) + io * es, in->stride, nd, shape, es);
    }
    if (!err && !sender_moves(all, k, from, me)) {
      block_of(all, k, from, me, shape, &io, &oo);
      if (eng_shape_numel(nd, shape) > 0)
        err = xfer((pid_t)all[from].pid, 0, (char*)(uintptr_t)all[from].base + io * es, all[from].stride,
                   eng_ptr(out) + oo * es, out->stride, nd, shape, es);
    }
  }
  free(all);
  int any = 0;
  rc = GUARDED(XCHG, MPI_Allreduce(&err, &any, 1, MPI_INT, MPI_MAX, pg->comm));
  if (rc != MPI_SUCCESS) {
    comm_account_end(rec, 2);
    return eng_err("%s: %s on group %s: %s", op, what, pg->name, comm_mpi_errstr(rc));
  }
  if (any) {
    /* a read failed somewhere (e.g. a peer's memory became unreadable): stop
     * using this path on the group; the caller redoes the exchange over MPI */
    pg->cma = -1;
    comm_account_end(rec, 2);
    comm_account_undo(kind, in);
    return 1;
  }
  eng_bump_version(out);
  comm_account_end(rec, 1);
  g_count++;
  return 0;
#endif
}

/* ---- box exchanges (eng_pg_box_exchange): the moves of any two layouts of
 * a tensor sharded into boxes, each rank holding any number of them.  Every
 * rank publishes a fixed header (pid, tensor counts, a hash of its move
 * list, its verdict) in one all_gather, then its tensors' geometries in an
 * all_gatherv; every rank checks all of it the same way, then moves the
 * boxes it is the mover of (see sender_moves), peer by peer as above. */
typedef struct box_head {
  int64_t pid;
  uint64_t hash;
  int32_t nsrc, ndst, err, decline, dtype, ndim, nmoves, pad;
  char msg[200];
} box_head;

typedef struct box_desc {
  uint64_t base;               /* element 0 (0 when empty) */
  int32_t device, dtype, ndim, pad;
  int64_t shape[8], stride[8];
} box_desc;

static uint64_t box_hash(const void* p, size_t n, uint64_t h) {
  const unsigned char* b = p;
  for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 1099511628211ull; }
  return h;
}

static void box_fill(box_desc* d, const eng_tensor* t) {
  memset(d, 0, sizeof *d);
  if (!t) return;
  d->base = (uint64_t)(uintptr_t)(t->numel && t->storage && t->storage->data ? eng_ptr(t) : NULL);
  d->device = t->device; d->dtype = t->dtype; d->ndim = t->ndim;
  for (int j = 0; j < t->ndim && j < 8; j++) { d->shape[j] = t->shape[j]; d->stride[j] = t->stride[j]; }
}

static int64_t box_at(const box_desc* d, const int64_t* off, int nd) {
  int64_t o = 0;
  for (int j = 0; j < nd; j++) o += off[j] * d->stride[j];
  return o;
}

/* The sender writes the box (1) or the receiver reads it (0): the side that
 * holds it in fewer pieces is the remote one (see sender_moves). */
static int box_sender_moves(const eng_box_move* m, int nd, const box_desc* s, const box_desc* d) {
  return segments(nd, m->shape, d->stride) < segments(nd, m->shape, s->stride);
}

int eng_pg_box_exchange(eng_pg* pg, const char* op, int kind, int ndim, int dtype, const eng_box_move* moves, int nmoves,
                        eng_tensor* const* srcs, int nsrc, eng_tensor* const* dsts, int ndst) {
  if (!op) op = "box_exchange";
  if (!pg) return eng_err("%s: process group is NULL", op);
#ifndef __linux__
  (void)kind; (void)ndim; (void)dtype; (void)moves; (void)nmoves; (void)srcs; (void)nsrc; (void)dsts; (void)ndst;
  return 1;
#else
  if (kind < 0 || kind >= ENG_NUM_COLL_KINDS || kind == ENG_COLL_BARRIER)
    return eng_err("%s: box exchange: collective kind %d is not one that moves data", op, kind);
  int usable = comm_cma_usable(pg, ENG_CPU);
  if (usable < 0) return -1;
  if (!usable) return 1; /* the same on every member (non-members: nothing to move) */
  const char* what = eng_coll_kind_name(kind);
  eng_tensor key; /* identifies the collective: dtype, and later the elements this rank sends */
  memset(&key, 0, sizeof key);
  key.dtype = dtype; key.ndim = 1;
  if (comm_check(pg, what, kind, &key, 0)) return -1;
  int k = pg->size, me = pg->rank;
  box_head mine;
  memset(&mine, 0, sizeof mine);
  mine.pid = (int64_t)getpid();
  mine.nsrc = nsrc; mine.ndst = ndst; mine.dtype = dtype; mine.ndim = ndim; mine.nmoves = nmoves;
  /* local checks */
  if (ndim < 1 || ndim > 8 || nmoves < 0 || nsrc < 0 || ndst < 0 || (nmoves && !moves) || (nsrc && !srcs) ||
      (ndst && !dsts) || !eng_dtype_name(dtype)) {
    mine.err = 1;
    eng_err("%s: %s on group %s: bad arguments (ndim %d, %d moves, %d sources, %d destinations, dtype %d)", op, what,
            pg->name, ndim, nmoves, nsrc, ndst, dtype);
  }
  for (int i = 0; i < nsrc + ndst && !mine.err; i++) {
    const eng_tensor* t = i < nsrc ? srcs[i] : dsts[i - nsrc];
    const char* side = i < nsrc ? "source" : "destination";
    int idx = i < nsrc ? i : i - nsrc;
    if (!t) {
      mine.err = 1;
      eng_err("%s: %s on group %s: %s tensor %d is NULL", op, what, pg->name, side, idx);
    } else if (t->dtype != dtype || t->ndim != ndim) {
      mine.err = 1;
      eng_err("%s: %s on group %s: %s tensor %d is %s, the exchange moves %s boxes of %d dims", op, what, pg->name,
              side, idx, eng_desc(t), eng_dtype_name(dtype), ndim);
    } else if (t->device != ENG_CPU) mine.decline = 1;
  }
  if (!mine.err) {
    uint64_t h = box_hash(&ndim, sizeof ndim, 1469598103934665603ull);
    h = box_hash(&dtype, sizeof dtype, h);
    mine.hash = box_hash(moves, sizeof *moves * (size_t)nmoves, h);
  }
  box_head* head = malloc(sizeof *head * (size_t)k);
  if (!head) { mine.err = 1; eng_err("%s: %s: out of memory", op, what); }
  if (mine.err) snprintf(mine.msg, sizeof mine.msg, "%s", eng_last_error());
  int rc = GUARDED(XCHG, MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, head ? (void*)head : (void*)&mine,
                                       head ? (int)sizeof mine : 0, MPI_BYTE, pg->comm));
  if (rc != MPI_SUCCESS) { free(head); return eng_err("%s: %s on group %s: %s", op, what, pg->name, comm_mpi_errstr(rc)); }
  if (!head) return -1;
  int decline = 0;
  for (int i = 0; i < k; i++) {
    if (head[i].err) {
      if (i != me) eng_err("%s: %s on group %s: group rank %d failed its checks: %s", op, what, pg->name, i, head[i].msg);
      free(head);
      return -1;
    }
    decline |= head[i].decline;
  }
  for (int i = 1; i < k; i++)
    if (head[i].hash != head[0].hash || head[i].nmoves != head[0].nmoves) {
      int n0 = head[0].nmoves, ni = head[i].nmoves;
      free(head);
      return eng_err("%s: %s on group %s: group rank 0 passed %d moves and group rank %d %d moves%s: every rank must "
                     "pass the same list of moves, dims and dtype", op, what, pg->name, n0, i, ni,
                     n0 == ni ? " (different ones)" : "");
    }
  if (decline) { free(head); return 1; }

  /* the geometries: sources then destinations of each rank */
  int* counts = malloc(sizeof(int) * (size_t)k * 2);
  int64_t* first = malloc(sizeof(int64_t) * (size_t)k); /* index of rank i's first descriptor */
  int64_t total = 0;
  for (int i = 0; i < k; i++) total += (int64_t)head[i].nsrc + head[i].ndst;
  box_desc* desc = malloc(sizeof *desc * (size_t)(total + 1));
  box_desc* own = malloc(sizeof *own * (size_t)(nsrc + ndst + 1));
  int err = 0;
  if (!counts || !first || !desc || !own || total * (int64_t)sizeof *desc > INT_MAX) err = 1;
  /* the same verdict on every rank: the sizes come from the headers; only malloc can differ */
  int any = 0;
  rc = GUARDED(XCHG, MPI_Allreduce(&err, &any, 1, MPI_INT, MPI_MAX, pg->comm));
  if (rc != MPI_SUCCESS || any) {
    free(counts); free(first); free(desc); free(own); free(head);
    if (rc != MPI_SUCCESS) return eng_err("%s: %s on group %s: %s", op, what, pg->name, comm_mpi_errstr(rc));
    return eng_err("%s: %s on group %s: out of memory for %lld tensor descriptors", op, what, pg->name, (long long)total);
  }
  int* displs = counts + k;
  int64_t at = 0;
  for (int i = 0; i < k; i++) {
    first[i] = at;
    counts[i] = (head[i].nsrc + head[i].ndst) * (int)sizeof *desc;
    displs[i] = (int)(at * (int64_t)sizeof *desc);
    at += head[i].nsrc + head[i].ndst;
  }
  for (int i = 0; i < nsrc; i++) box_fill(&own[i], srcs[i]);
  for (int i = 0; i < ndst; i++) box_fill(&own[nsrc + i], dsts[i]);
  rc = GUARDED(XCHG, MPI_Allgatherv(own, (nsrc + ndst) * (int)sizeof *own, MPI_BYTE, desc, counts, displs,
                                    MPI_BYTE, pg->comm));
  free(own);
  if (rc != MPI_SUCCESS) {
    free(counts); free(first); free(desc); free(head);
    return eng_err("%s: %s on group %s: %s", op, what, pg->name, comm_mpi_errstr(rc));
  }

  /* every move against the geometries (the same data, so the same verdict, on every rank) */
  int64_t es = eng_dtype_size(dtype), sent = 0;
  int verdict = 0;
  for (int i = 0; i < nmoves && !verdict; i++) {
    const eng_box_move* m = &moves[i];
    if (m->src < 0 || m->src >= k || m->dst < 0 || m->dst >= k || m->src_idx < 0 || m->src_idx >= head[m->src].nsrc ||
        m->dst_idx < 0 || m->dst_idx >= head[m->dst].ndst) {
      verdict = eng_err("%s: %s on group %s: move %d takes source %d of group rank %d to destination %d of group rank "
                        "%d (0-based), which is not a tensor that rank passed", op, what, pg->name, i, m->src_idx, m->src,
                        m->dst_idx, m->dst);
      break;
    }
    const box_desc* s = &desc[first[m->src] + m->src_idx];
    const box_desc* d = &desc[first[m->dst] + head[m->dst].nsrc + m->dst_idx];
    for (int j = 0; j < ndim; j++)
      if (m->shape[j] < 0 || m->src_off[j] < 0 || m->dst_off[j] < 0 || m->src_off[j] + m->shape[j] > s->shape[j] ||
          m->dst_off[j] + m->shape[j] > d->shape[j]) {
        verdict = eng_err("%s: %s on group %s: move %d (0-based)'s box %s at dim %d (offsets %lld -> %lld) does not fit in its "
                          "source %s or destination %s", op, what, pg->name, i, eng_shape_str(ndim, m->shape), j + 1,
                          (long long)m->src_off[j], (long long)m->dst_off[j], eng_shape_str(ndim, s->shape),
                          eng_shape_str(ndim, d->shape));
        break;
      }
    if (verdict) break;
    if (m->src == me) sent += eng_shape_numel(ndim, m->shape);
    if (m->src != m->dst && eng_shape_numel(ndim, m->shape) > 0) {
      int outer;
      if (common_run(ndim, m->shape, s->stride, d->stride, &outer) * es < CMA_MIN_RUN) verdict = 1;
    }
  }
  if (verdict) { free(counts); free(first); free(desc); free(head); return verdict; }

  key.shape[0] = key.numel = sent;
  int64_t rec = comm_account_begin(pg, kind, &key);
  for (int step = 0; step < k && !err; step++) {
    int to = (me + step) % k, from = (me + k - step) % k;
    for (int i = 0; i < nmoves && !err; i++) {
      const eng_box_move* m = &moves[i];
      if (eng_shape_numel(ndim, m->shape) == 0) continue;
      const box_desc* s = &desc[first[m->src] + m->src_idx];
      const box_desc* d = &desc[first[m->dst] + head[m->dst].nsrc + m->dst_idx];
      if (step == 0) {
        if (m->src != me || m->dst != me) continue;
        const eng_tensor* st = srcs[m->src_idx];
        eng_tensor* dt = dsts[m->dst_idx];
        eng_tensor* sv = eng_view_of(st, ndim, m->shape, st->stride, st->offset + box_at(s, m->src_off, ndim));
        eng_tensor* dv = eng_view_of(dt, ndim, m->shape, dt->stride, dt->offset + box_at(d, m->dst_off, ndim));
        if (!sv || !dv || eng_copy_raw(dv, sv, sv->stride)) err = ENOMEM;
        eng_tensor_release(sv);
        eng_tensor_release(dv);
      } else if (m->src == me && m->dst == to && box_sender_moves(m, ndim, s, d)) {
        err = xfer((pid_t)head[to].pid, 1, (char*)(uintptr_t)d->base + box_at(d, m->dst_off, ndim) * es, d->stride,
                   eng_ptr(srcs[m->src_idx]) + box_at(s, m->src_off, ndim) * es, s->stride, ndim, m->shape, es);
      } else if (m->dst == me && m->src == from && !box_sender_moves(m, ndim, s, d)) {
        err = xfer((pid_t)head[from].pid, 0, (char*)(uintptr_t)s->base + box_at(s, m->src_off, ndim) * es, s->stride,
                   eng_ptr(dsts[m->dst_idx]) + box_at(d, m->dst_off, ndim) * es, d->stride, ndim, m->shape, es);
      }
    }
  }
  free(counts); free(first); free(desc); free(head);
  any = 0;
  rc = GUARDED(XCHG, MPI_Allreduce(&err, &any, 1, MPI_INT, MPI_MAX, pg->comm));
  if (rc != MPI_SUCCESS) {
    comm_account_end(rec, 2);
    return eng_err("%s: %s on group %s: %s", op, what, pg->name, comm_mpi_errstr(rc));
  }
  if (any) {
    pg->cma = -1; /* as comm_cma_exchange: the caller moves the boxes another way */
    comm_account_end(rec, 2);
    comm_account_undo(kind, &key);
    return 1;
  }
  for (int i = 0; i < ndst; i++) if (dsts[i]->numel) eng_bump_version(dsts[i]);
  comm_account_end(rec, 1);
  g_count++;
  return 0;
#endif
}

/* ---- FSDP's all-gather into place (eng_pg_gather_blocks) */
typedef struct gb_head {
  int64_t pid;
  uint64_t base;
  int32_t eligible, err;
} gb_head;

#ifdef __linux__
/* One process_vm_readv of n iovec pairs (want bytes): 0, or the errno (EIO for a short read). */
static int read_iov(pid_t pid, const struct iovec* liov, const struct iovec* riov, int n, ssize_t want) {
  ssize_t got = process_vm_readv(pid, liov, (unsigned long)n, riov, (unsigned long)n, 0);
  return got == want ? 0 : got < 0 ? errno : EIO;
}
#endif

int eng_pg_gather_blocks(eng_pg* pg, const char* op, int dtype, const void* src, int64_t src_numel, int nblocks,
                         const int64_t* src_off, const int64_t* lens, const int64_t* dst_off, void* dst,
                         int64_t dst_numel, int eligible) {
  if (!op) op = "gather_blocks";
  if (!pg) return eng_err("%s: process group is NULL", op);
#ifndef __linux__
  (void)dtype; (void)src; (void)src_numel; (void)nblocks; (void)src_off; (void)lens; (void)dst_off; (void)dst;
  (void)dst_numel; (void)eligible;
  return 1;
#else
  int usable = comm_cma_usable(pg, ENG_CPU);
  if (usable < 0) return -1;
  if (!usable) return 1; /* the same on every member */
  int k = pg->size, me = pg->rank;
  int64_t es = eng_dtype_size(dtype);
  /* local checks: every block inside src and dst */
  int bad = es <= 0 || nblocks < 0 || (nblocks && (!src_off || !lens || !dst_off)) || ((eligible & 1) && src_numel && !src) ||
            (dst_numel && !dst);
  for (int b = 0; b < nblocks && !bad; b++)
    for (int r = 0; r < k && !bad; r++) {
      int64_t n = lens[b * k + r], so = src_off[b], dof = dst_off[b * k + r];
      if (n < 0 || (n > 0 && (so < 0 || dof < 0 || so + n > src_numel || dof + n > dst_numel))) bad = 1;
    }
  if (bad) eng_err("%s: all_gather on group %s: a block lies outside its chunk (%lld elements) or the output (%lld)", op,
                   pg->name, (long long)src_numel, (long long)dst_numel);
  eng_tensor key; /* the signature: kind, dtype and the chunk's size */
  memset(&key, 0, sizeof key);
  key.dtype = dtype; key.ndim = 1; key.shape[0] = key.numel = src_numel;
  if (comm_check(pg, "all_gather", ENG_COLL_ALL_GATHER, &key, bad)) return -1;
  /* the headers: every rank's verdict (1 bad blocks: an error everywhere; 2 out of memory: declined) */
  /* eligible: bit 0 this rank takes part, bit 1 the caller defers the closing exchange (below) */
  gb_head mine = {(int64_t)getpid(), (uint64_t)(uintptr_t)src, eligible & 3, bad ? 1 : 0};
  gb_head* all = malloc(sizeof *all * (size_t)k);
  if (!all && !mine.err) mine.err = 2;
  int rc = GUARDED(XCHG, MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, all ? (void*)all : (void*)&mine,
                                       all ? (int)sizeof mine : 0, MPI_BYTE, pg->comm));
  if (rc != MPI_SUCCESS) { free(all); return eng_err("%s: all_gather on group %s: %s", op, pg->name, comm_mpi_errstr(rc)); }
  if (!all) return mine.err == 1 ? -1 : 1;
  for (int r = 0; r < k; r++)
    if (all[r].err == 1) {
      if (r != me) eng_err("%s: all_gather on group %s: group rank %d's blocks lie outside its chunk or output", op,
                           pg->name, r);
      free(all);
      return -1;
    }
  int defer = 1;
  for (int r = 0; r < k; r++) {
    if (all[r].err || !(all[r].eligible & 1)) { free(all); return 1; } /* the same headers on every rank */
    defer &= (all[r].eligible >> 1) & 1;
  }
  int64_t rec = comm_account_begin(pg, ENG_COLL_ALL_GATHER, &key);
  int err = 0;
  for (int step = 0; step < k && !err; step++) {
    int from = (me + k - step) % k;
    if (step == 0) { /* this rank's own blocks */
      for (int b = 0; b < nblocks; b++)
        if (lens[b * k + me] > 0)
          memcpy((char*)dst + dst_off[b * k + me] * es, (const char*)src + src_off[b] * es, (size_t)(lens[b * k + me] * es));
      continue;
    }
    struct iovec liov[CMA_IOV], riov[CMA_IOV];
    int n = 0;
    ssize_t want = 0;
    for (int b = 0; b < nblocks && !err; b++) {
      int64_t len = lens[b * k + from] * es;
      if (len <= 0) continue;
      char* lp = (char*)dst + dst_off[b * k + from] * es;
      char* rp = (char*)(uintptr_t)all[from].base + src_off[b] * es;
      liov[n].iov_base = lp; liov[n].iov_len = (size_t)len;
      riov[n].iov_base = rp; riov[n].iov_len = (size_t)len;
      n++;
      want += (ssize_t)len;
      if (n == CMA_IOV || want > (ssize_t)1 << 30) { err = read_iov((pid_t)all[from].pid, liov, riov, n, want); n = 0; want = 0; }
    }
    if (!err && n > 0) err = read_iov((pid_t)all[from].pid, liov, riov, n, want);
  }
  if (defer) {
    /* every rank asked for it: no closing exchange.  The caller's next exchange on pg (a signature check, a
     * header exchange, any collective) is what keeps the chunks unchanged until all have read: every rank
     * waits there until every other rank has left this call, and this rank's reads end inside it.  A failed
     * read can no longer be declined on every rank: it is this rank's error (the others find it at that next
     * exchange). */
    if (err) {
      free(all);
      comm_account_end(rec, 2);
      return eng_err("%s: all_gather on group %s: a single-copy read of a peer's chunk failed (%s); the group's "
                     "other ranks fail at their next collective on it", op, pg->name, strerror(err));
    }
    free(all);
    comm_account_end(rec, 1);
    g_count++;
    return 0;
  }
  free(all);
  /* every rank has read every chunk before any rank goes on (and may change its chunk); a failed read anywhere
   * declines on every rank */
  int any = 0;
  rc = GUARDED(XCHG, MPI_Allreduce(&err, &any, 1, MPI_INT, MPI_MAX, pg->comm));
  if (rc != MPI_SUCCESS) {
    comm_account_end(rec, 2);
    return eng_err("%s: all_gather on group %s: %s", op, pg->name, comm_mpi_errstr(rc));
  }
  if (any) {
    pg->cma = -1;
    comm_account_end(rec, 2);
    comm_account_undo(ENG_COLL_ALL_GATHER, &key);
    return 1;
  }
  comm_account_end(rec, 1);
  g_count++;
  return 0;
#endif
}
