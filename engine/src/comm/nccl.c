/* nccl.c: the NCCL backend of the process groups (CUDA builds).
 *
 * One NCCL communicator per process group, created on the group's first CUDA
 * collective: group rank 0 makes the unique id, MPI_Bcast hands it to the
 * other members over the group's MPI communicator (as llm.c does), and every
 * member calls ncclCommInitRank on the process's device
 * (eng_cuda_current_device(): the node-local rank modulo the GPU count, see
 * eng/cuda.h).  Collectives run on the runtime's communication stream
 * (ENG_CUDA_STREAM_COMM): it first waits, through an event, for the work
 * queued so far on the compute stream (which produced the inputs), and the
 * compute stream waits, through an event, for the collective before any later
 * kernel reads the results: no host synchronization on the way, as
 * PyTorch's NCCL process groups.  A blocking call makes the compute stream
 * wait at once; an async one records an event on the communication stream
 * that eng_work_wait hands to the compute stream (eng_work_test queries it).
 * Freed inputs are safe: the allocator reuses blocks in compute-stream
 * order, which runs after the collective once the compute stream waited (a
 * work released without a wait makes it wait too).  Without ENG_HAVE_CUDA
 * (and ENG_HAVE_NCCL) only the two capability queries are compiled, and
 * they report no GPU / no NCCL. */
#include "comm/comm_impl.h"
#include "eng/comm.h"
#include "eng/cuda.h"

#if defined(ENG_HAVE_CUDA)
#include <cuda_runtime.h>
int eng_comm_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) { cudaGetLastError(); return 0; }
  return n;
}
#else
int eng_comm_cuda_device_count(void) { return 0; }
#endif

#if defined(ENG_HAVE_CUDA) && defined(ENG_HAVE_NCCL)
#include <nccl.h>
#include <sched.h>
#include <stdio.h>

int eng_comm_have_nccl(void) { return 1; }

typedef struct nccl_state {
  ncclComm_t comm;
  int device;
  int nonblocking; /* created with config blocking = 0: calls may return ncclInProgress (see settle) */
} nccl_state;

static int cuda_check(cudaError_t e, const char* what, const char* group) {
  if (e == cudaSuccess) return 0;
  return eng_err("%s on group %s: CUDA error %d: %s", what, group, (int)e, cudaGetErrorString(e));
}

static int nccl_check(ncclResult_t r, const char* what, const char* group) {
  if (r == ncclSuccess) return 0;
  return eng_err("%s on group %s: NCCL error %d: %s", what, group, (int)r, ncclGetErrorString(r));
}

/* NCCL's own last message for comm (its detail: which peer, which transport), "" when none. */
static const char* nccl_detail(ncclComm_t comm) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
  const char* m = ncclGetLastError(comm);
  return m ? m : "";
#else
  (void)comm;
  return "";
#endif
}

/* A non-blocking communicator: a call that returned ncclInProgress is finished (enqueued on the stream)
 * once the async error leaves ncclInProgress; wait for that, under the comm timeout. */
static ncclResult_t settle(nccl_state* s, ncclResult_t r) {
  if (r != ncclInProgress) return r;
  double t0 = eng_time(), timeout = eng_comm_get_timeout();
  for (;;) {
    ncclResult_t st = ncclSuccess;
    ncclResult_t q = ncclCommGetAsyncError(s->comm, &st);
    if (q != ncclSuccess) return q;
    if (st != ncclInProgress) return st;
    if (eng_time() - t0 > timeout) return ncclInProgress;
    sched_yield();
  }
}

/* ---- the device calls of comm/gpu_wait.c */
typedef struct init_ctx {
  ncclUniqueId id;
  nccl_state* s;
} init_ctx;

static int init_fail(init_ctx* c, ncclResult_t r, char* msg, int cap) {
  const char* d = c->s->comm ? nccl_detail(c->s->comm) : "";
  snprintf(msg, (size_t)cap, "ncclCommInitRank: NCCL error %d: %s%s%s", (int)r, ncclGetErrorString(r), d[0] ? ": " : "", d);
  if (c->s->comm) { ncclCommAbort(c->s->comm); c->s->comm = NULL; }
  return -1;
}

static int nc_init_poll(eng_pg* pg, void* ctx, char* msg, int cap) {
  (void)pg;
  init_ctx* c = ctx;
  ncclResult_t st = ncclSuccess;
  ncclResult_t q = ncclCommGetAsyncError(c->s->comm, &st);
  if (q != ncclSuccess) return init_fail(c, q, msg, cap);
  if (st == ncclInProgress) return 0;
  return st == ncclSuccess ? 1 : init_fail(c, st, msg, cap);
}

static int nc_init_start(eng_pg* pg, void* ctx, char* msg, int cap) {
  init_ctx* c = ctx;
  ncclResult_t r;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0)
  /* non-blocking: the creation can be abandoned (a peer failed) and collectives never block the host */
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  c->s->nonblocking = 1;
  r = ncclCommInitRankConfig(&c->s->comm, pg->size, c->id, pg->rank, &cfg);
#else
  r = ncclCommInitRank(&c->s->comm, pg->size, c->id, pg->rank);
#endif
  if (r == ncclInProgress || (r == ncclSuccess && c->s->nonblocking)) return c->s->comm ? nc_init_poll(pg, ctx, msg, cap) : 0;
  if (r == ncclSuccess) return 1;
  return init_fail(c, r, msg, cap);
}

static void nc_init_abort(eng_pg* pg, void* ctx) {
  (void)pg;
  init_ctx* c = ctx;
  if (c->s->comm) ncclCommAbort(c->s->comm);
  c->s->comm = NULL;
}

static int nc_query(void* ev) {
  cudaError_t e = cudaEventQuery((cudaEvent_t)ev);
  if (e == cudaSuccess) return 1;
  if (e == cudaErrorNotReady) return 0;
  cudaGetLastError();
  eng_err("CUDA error %d: %s", (int)e, cudaGetErrorString(e));
  return -1;
}

static int nc_async_error(eng_pg* pg, char* msg, int cap) {
  nccl_state* s = pg->nccl;
  if (!s || !s->comm) return 0;
  ncclResult_t st = ncclSuccess;
  if (ncclCommGetAsyncError(s->comm, &st) != ncclSuccess || st == ncclSuccess || st == ncclInProgress) return 0;
  const char* d = nccl_detail(s->comm);
  snprintf(msg, (size_t)cap, "NCCL error %d: %s%s%s", (int)st, ncclGetErrorString(st), d[0] ? ": " : "", d);
  return 1;
}

static void nc_abort(eng_pg* pg) {
  if (pg->nccl) comm_nccl_pg_abort(pg->nccl);
  pg->nccl = NULL;
}

static const comm_gpu_ops g_nccl_ops = {nc_query, nc_async_error, nc_abort, nc_init_start, nc_init_poll, nc_init_abort};

static nccl_state* ensure_comm(eng_pg* pg) {
  if (pg->nccl) return pg->nccl;
  comm_gpu_ops_set(&g_nccl_ops);
  /* the runtime's device (chosen by node-local rank at its first use), current on this thread; a rank
   * without one still takes part in the id broadcast and the agreement, so that every member fails */
  char why[512] = "";
  int dev = eng_cuda_current_device();
  if (dev < 0) snprintf(why, sizeof why, "no CUDA device: %s", eng_last_error());
  struct { int32_t ok; ncclUniqueId id; } msg;
  memset(&msg, 0, sizeof msg);
  if (pg->rank == 0) {
    msg.ok = nccl_check(ncclGetUniqueId(&msg.id), "ncclGetUniqueId", pg->name) == 0;
    if (!msg.ok && !why[0]) snprintf(why, sizeof why, "%s", eng_last_error());
  }
  int rc = MPI_Bcast(&msg, (int)sizeof msg, MPI_BYTE, 0, pg->comm);
  if (rc != MPI_SUCCESS) return eng_errp("NCCL id broadcast on group %s: %s", pg->name, comm_mpi_errstr(rc));
  int ready = dev >= 0 && (msg.ok || pg->rank != 0);
  init_ctx c;
  memset(&c, 0, sizeof c);
  c.id = msg.id;
  c.s = calloc(1, sizeof *c.s);
  if (!c.s) ready = 0, snprintf(why, sizeof why, "out of memory");
  /* agreed over MPI before and after ncclCommInitRank: a failure on some ranks fails on all, naming them */
  if (comm_gpu_init_agree(&g_nccl_ops, pg, ready, why, &c)) {
    if (c.s && c.s->comm) ncclCommAbort(c.s->comm);
    free(c.s);
    return NULL;
  }
  c.s->device = dev;
  pg->nccl = c.s;
  return c.s;
}

void comm_nccl_pg_free(void* state) {
  nccl_state* s = state;
  if (!s) return;
  /* a non-blocking destroy may return ncclInProgress: the communicator is then finalised in the background */
  if (s->comm) ncclCommDestroy(s->comm);
  free(s);
}

/* Abort (not destroy: a destroy waits for the kernels, which a mismatched collective never ends) and free. */
void comm_nccl_pg_abort(void* state) {
  nccl_state* s = state;
  if (!s) return;
  if (s->comm) ncclCommAbort(s->comm);
  free(s);
}

static ncclDataType_t nccl_type(int dtype) {
  switch (dtype) {
    case ENG_F32: return ncclFloat32;
    case ENG_F64: return ncclFloat64;
    case ENG_BF16: return ncclBfloat16;
    case ENG_F16: return ncclFloat16;
    case ENG_I32: return ncclInt32;
    case ENG_I64: return ncclInt64;
    default: return ncclUint8;
  }
}

static ncclRedOp_t nccl_op(int op) {
  switch (op) {
    case ENG_REDUCE_AVG: return ncclAvg;
    case ENG_REDUCE_MAX: return ncclMax;
    case ENG_REDUCE_MIN: return ncclMin;
    case ENG_REDUCE_PROD: return ncclProd;
    default: return ncclSum;
  }
}

int comm_nccl_issue(eng_pg* pg, const comm_args* a, void** event) {
  const char* kind = eng_coll_kind_name(a->kind);
  nccl_state* s = ensure_comm(pg);
  if (!s) return -1;
  /* reduce-scatters on their own stream, everything else on the communication stream (comm/stream_order.c) */
  int sid = comm_stream_for(a->kind);
  cudaStream_t stream = (cudaStream_t)eng_cuda_stream(sid);
  /* run after the compute-stream work that produced the inputs (an event, no host sync) */
  if (!stream || eng_cuda_stream_wait(sid, ENG_CUDA_STREAM_COMPUTE)) {
    eng_err_prefix("%s on group %s", kind ? kind : "collective", pg->name);
    return -1;
  }

  ncclDataType_t dt = nccl_type(a->dtype);
  size_t n = (size_t)a->count, es = (size_t)eng_dtype_size(a->dtype);
  const char* send = a->send;
  char* recv = a->recv;
  ncclResult_t r = ncclSuccess;
  switch (a->kind) {
    case ENG_COLL_ALL_REDUCE:
      r = ncclAllReduce(send ? send : recv, recv, n, dt, nccl_op(a->op), s->comm, stream);
      break;
    case ENG_COLL_ALL_GATHER:
      r = ncclAllGather(send, recv, n, dt, s->comm, stream);
      break;
    case ENG_COLL_REDUCE_SCATTER:
      r = ncclReduceScatter(send, recv, n, dt, nccl_op(a->op), s->comm, stream);
      break;
    case ENG_COLL_BROADCAST:
      r = ncclBroadcast(recv, recv, n, dt, a->root, s->comm, stream);
      break;
    case ENG_COLL_ALL_TO_ALL:
      r = ncclGroupStart();
      for (int p = 0; p < pg->size && r == ncclSuccess; p++) {
        r = ncclSend(send + (size_t)p * n * es, n, dt, p, s->comm, stream);
        if (r == ncclSuccess) r = ncclRecv(recv + (size_t)p * n * es, n, dt, p, s->comm, stream);
      }
      {
        ncclResult_t e = ncclGroupEnd();
        if (r == ncclSuccess) r = e;
      }
      break;
    case ENG_COLL_SCATTER:
      r = ncclGroupStart();
      if (pg->rank == a->root)
        for (int p = 0; p < pg->size && r == ncclSuccess; p++)
          r = ncclSend(send + (size_t)p * n * es, n, dt, p, s->comm, stream);
      if (r == ncclSuccess) r = ncclRecv(recv, n, dt, a->root, s->comm, stream);
      {
        ncclResult_t e = ncclGroupEnd();
        if (r == ncclSuccess) r = e;
      }
      break;
    case ENG_COLL_GATHER:
      /* per-rank sizes (vcounts): a rank with nothing to send takes no part */
      r = ncclGroupStart();
      if (pg->rank == a->root)
        for (int p = 0; p < pg->size && r == ncclSuccess; p++) {
          size_t cnt = a->vcounts ? (size_t)a->vcounts[p] : n, off = a->vcounts ? (size_t)a->vdispls[p] : (size_t)p * n;
          if (cnt) r = ncclRecv(recv + off * es, cnt, dt, p, s->comm, stream);
        }
      if (r == ncclSuccess && n) r = ncclSend(send, n, dt, a->root, s->comm, stream);
      {
        ncclResult_t e = ncclGroupEnd();
        if (r == ncclSuccess) r = e;
      }
      break;
    default:
      return eng_err("%s: the NCCL backend does not run this collective", kind ? kind : "?");
  }
  r = s->nonblocking ? settle(s, r) : r; /* enqueued on the stream before the event is recorded */
  if (nccl_check(r, kind, pg->name)) {
    const char* d = nccl_detail(s->comm);
    if (d[0]) eng_err("%s: %s", eng_last_error(), d);
    return -1;
  }
  if (event) {
    cudaEvent_t ev;
    if (cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), kind, pg->name)) return -1;
    if (cuda_check(cudaEventRecord(ev, stream), kind, pg->name)) { cudaEventDestroy(ev); return -1; }
    *event = (void*)ev;
    return 0;
  }
  /* blocking: later compute-stream work (kernels, copies to the host) sees the results */
  if (eng_cuda_stream_wait(ENG_CUDA_STREAM_COMPUTE, sid)) {
    eng_err_prefix("%s on group %s", kind ? kind : "collective", pg->name);
    return -1;
  }
  char m[512];
  if (nc_async_error(pg, m, (int)sizeof m)) {
    eng_err("#%lld %s on group %s failed: NCCL reported an asynchronous error: %s; the communicator is aborted and "
            "group %s is unusable from now on", (long long)(pg->seq - 1), kind, pg->name, m, pg->name);
    nc_abort(pg);
    pg->broken = 3;
    free(pg->broken_msg);
    pg->broken_msg = strdup(eng_last_error());
    return -1;
  }
  return 0;
}

/* The compute stream waits for the collective (no host sync): kernels and
 * host copies queued after eng_work_wait see its results. */
int comm_nccl_wait(void* event) {
  if (!event) return 0;
  cudaStream_t cs = (cudaStream_t)eng_cuda_stream(ENG_CUDA_STREAM_COMPUTE);
  if (!cs) { eng_err_prefix("NCCL collective (async)"); return -1; }
  cudaError_t e = cudaStreamWaitEvent(cs, (cudaEvent_t)event, 0);
  if (e != cudaSuccess) return eng_err("NCCL collective (async): CUDA error %d: %s", (int)e, cudaGetErrorString(e));
  return 0;
}

int comm_nccl_test(void* event) {
  if (!event) return 1;
  cudaError_t e = cudaEventQuery((cudaEvent_t)event);
  if (e == cudaSuccess) return 1;
  if (e == cudaErrorNotReady) return 0;
  eng_err("NCCL collective (async): CUDA error %d: %s", (int)e, cudaGetErrorString(e));
  return -1;
}

void comm_nccl_event_free(void* event) {
  if (!event) return;
  /* a work released without a wait: order the compute stream (and so the
   * allocator's reuse of the buffers) after the collective anyway */
  cudaStream_t cs = (cudaStream_t)eng_cuda_stream(ENG_CUDA_STREAM_COMPUTE);
  if (cs && cudaStreamWaitEvent(cs, (cudaEvent_t)event, 0) != cudaSuccess) cudaGetLastError();
  cudaEventDestroy((cudaEvent_t)event);
}

#else
int eng_comm_have_nccl(void) { return 0; }
#endif
