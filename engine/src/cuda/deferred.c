/* deferred.c: device error checks without host synchronisation (issue 28, item 2).
 *
 * A kernel that can find bad input (embedding: an index out of range; cross entropy: a target out of range)
 * writes a flag instead of the host reading one back after it (a stream sync per op).  Each check takes a slot
 * of a ring of flags in mapped pinned host memory (the kernel writes it through its device address, only on
 * error, so a good step moves no byte over PCIe) and records an event after the kernel; the op returns at once.
 * The host looks at the slots whose events have completed:
 *   - eng_cuda_poll_errors(): without waiting (the optimizers call it at each step: an error of step N is
 *     raised at step N + 1 at the latest);
 *   - after every host synchronisation of the runtime (a device-to-host copy such as loss:item(), tensor
 *     printing, eng_cuda_synchronize): the work is done, every pending slot is looked at, and an error is
 *     raised there (that copy fails with the op's message);
 *   - eng_cuda_check_errors(): waits for the pending checks (one event sync), then looks.
 * The error is the op's own message, the one it raised when it read its flag back (formatted by the op's
 * formatter from the values it registered).  The first bad slot (in launch order) wins; every pending check
 * is retired with it.
 *
 * The ring logic is device-free: eng_deferred_test_flag() registers a slot in plain host memory that is complete
 * at once, so the specs check the bookkeeping and the messages on machines without a GPU. */
#include "core/internal.h"
#include "cuda/cuda_runtime.h"
#include "eng/cuda.h"
#include <stdio.h>
#include <string.h>
#include <pthread.h>
#ifdef ENG_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#define RING 1024
#define OPLEN 64

typedef struct pending {
  int slot;
  void* ev;                 /* cudaEvent_t recorded after the kernel; NULL: complete (test slots) */
  eng_deferred_fmt fmt;
  int64_t a, b;
  char op[OPLEN];
} pending;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static volatile int* g_host;    /* RING flags, host address (mapped pinned memory, or malloc for tests) */
static int* g_dev;              /* their device address (NULL: not allocated on a device) */
static int g_mapped;            /* g_host is mapped pinned memory */
static pending g_ring[RING];
#ifdef ENG_HAVE_CUDA
static void* g_events[RING];    /* one event per ring position, created on first use */
#endif
static int g_head, g_count;     /* oldest pending entry, number pending */
static int64_t g_syncs;         /* host synchronisations counted by eng_cuda_count_sync */

void eng_cuda_count_sync(void) { __atomic_add_fetch(&g_syncs, 1, __ATOMIC_RELAXED); }
int64_t eng_cuda_sync_count(void) { return __atomic_load_n(&g_syncs, __ATOMIC_RELAXED); }
int eng_cuda_pending_checks(void) {
  pthread_mutex_lock(&g_mu);
  int n = g_count;
  pthread_mutex_unlock(&g_mu);
  return n;
}

#define UNCOMMITTED ((void*)1) /* a device check whose event is not recorded yet */

static int ev_done(void* ev, int wait) {
  if (!ev) return 1;
#ifdef ENG_HAVE_CUDA
  cudaError_t e;
  if (ev == UNCOMMITTED) {
    if (!wait) return 0;
    eng_cuda_count_sync();
    e = cudaStreamSynchronize((cudaStream_t)eng_cuda_stream(ENG_CUDA_STREAM_COMPUTE));
    if (e != cudaSuccess) cudaGetLastError();
    return 1;
  }
  if (wait) {
    e = cudaEventQuery((cudaEvent_t)ev);
    if (e == cudaErrorNotReady) {
      eng_cuda_count_sync();
      e = cudaEventSynchronize((cudaEvent_t)ev);
    }
  } else {
    e = cudaEventQuery((cudaEvent_t)ev);
  }
  if (e == cudaSuccess) return 1;
  cudaGetLastError();
  return e == cudaErrorNotReady ? 0 : 1; /* a failed event (sticky error): look at the flag anyway */
#else
  (void)wait;
  return 1;
#endif
}

static void default_fmt(char* buf, size_t n, const char* op, int64_t a, int64_t b) {
  (void)a; (void)b;
  snprintf(buf, n, "%s: the device reported bad input", op);
}

/* Retires complete entries from the oldest; wait: wait for each.  On a set flag: formats its message into
 * msg, retires every pending entry and returns 1. */
static int retire_locked(int wait, char* msg, size_t msglen) {
  while (g_count > 0) {
    pending* p = &g_ring[g_head];
    if (!ev_done(p->ev, wait)) return 0;
    int v = g_host[p->slot];
    g_host[p->slot] = 0;
    g_head = (g_head + 1) % RING;
    g_count--;
    if (v) {
      (p->fmt ? p->fmt : default_fmt)(msg, msglen, p->op, p->a, p->b);
      while (g_count > 0) { /* the rest of the step ran on bad data: drop their checks */
        pending* q = &g_ring[g_head];
        ev_done(q->ev, 1);
        g_host[q->slot] = 0;
        g_head = (g_head + 1) % RING;
        g_count--;
      }
      return 1;
    }
  }
  return 0;
}

static int check(int wait) {
  char msg[512];
  pthread_mutex_lock(&g_mu);
  if (g_count == 0) { pthread_mutex_unlock(&g_mu); return 0; }
  int bad = retire_locked(wait, msg, sizeof msg);
  pthread_mutex_unlock(&g_mu);
  return bad ? eng_err("%s", msg) : 0;
}

int eng_cuda_poll_errors(void) { return check(0); }
int eng_cuda_check_errors(void) { return check(1); }
/* After a host synchronisation every pending kernel is done: look at all of them without waiting more. */
int eng_cuda_after_sync(void) { return check(1); }

static int ensure_ring(int device, const char* op) {
  if (g_host && (!device || g_dev)) return 0;
  if (!device) {
    if (!g_host) {
      g_host = calloc(RING, sizeof(int));
      if (!g_host) return eng_err("%s: out of host memory", op);
    }
    return 0;
  }
#ifdef ENG_HAVE_CUDA
  if (g_host && !g_mapped) {
    if (g_count > 0) return eng_err("%s: test checks are pending (eng_cuda_poll_errors first)", op);
    free((void*)g_host);
    g_host = NULL;
  }
  void* h = NULL;
  cudaError_t e = cudaHostAlloc(&h, RING * sizeof(int), cudaHostAllocMapped);
  void* d = NULL;
  if (e == cudaSuccess) e = cudaHostGetDevicePointer(&d, h, 0);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (h) cudaFreeHost(h);
    return eng_err("%s: allocating the mapped error flags failed: CUDA error %d %s", op, (int)e, cudaGetErrorName(e));
  }
  memset(h, 0, RING * sizeof(int));
  g_host = h;
  g_dev = d;
  g_mapped = 1;
  return 0;
#else
  return eng_err("%s: this build has no CUDA backend", op);
#endif
}

/* Takes the next slot for op; waits for the oldest pending check when the ring is full (after RING checks
 * without a poll or a sync).  Returns the ring index or -1 (error set). */
static int take_locked(const char* op, eng_deferred_fmt fmt, int64_t a, int64_t b, int device, char* msg,
                       size_t msglen, int* bad) {
  *bad = 0;
  if (ensure_ring(device, op)) return -1;
  if (g_count == RING && retire_locked(0, msg, msglen)) { *bad = 1; return -1; }
  while (g_count == RING) {
    if (retire_locked(1, msg, msglen)) { *bad = 1; return -1; }
  }
  int i = (g_head + g_count) % RING;
  pending* p = &g_ring[i];
  p->slot = i;
  p->ev = NULL;
  p->fmt = fmt;
  p->a = a;
  p->b = b;
  snprintf(p->op, OPLEN, "%s", op ? op : "cuda");
  g_host[i] = 0;
  g_count++;
  return i;
}

int* eng_cuda_deferred_flag(const char* op, eng_deferred_fmt fmt, int64_t a, int64_t b) {
#ifdef ENG_HAVE_CUDA
  char msg[512];
  int bad;
  pthread_mutex_lock(&g_mu);
  int i = take_locked(op, fmt, a, b, 1, msg, sizeof msg, &bad);
  if (i >= 0) g_ring[i].ev = UNCOMMITTED;
  pthread_mutex_unlock(&g_mu);
  if (bad) { eng_err("%s", msg); return NULL; }
  if (i < 0) return NULL;
  return g_dev + i;
#else
  (void)fmt; (void)a; (void)b;
  return eng_errp("%s: this build has no CUDA backend", op);
#endif
}

int eng_cuda_deferred_commit(int* flag) {
#ifdef ENG_HAVE_CUDA
  if (!flag || !g_dev) return 0;
  int i = (int)(flag - g_dev);
  cudaStream_t s = (cudaStream_t)eng_cuda_stream(ENG_CUDA_STREAM_COMPUTE);
  if (!s) return -1;
  pthread_mutex_lock(&g_mu);
  cudaError_t e = cudaSuccess;
  if (!g_events[i]) e = cudaEventCreateWithFlags((cudaEvent_t*)&g_events[i], cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventRecord((cudaEvent_t)g_events[i], s);
  if (e == cudaSuccess) g_ring[i].ev = g_events[i];
  pthread_mutex_unlock(&g_mu);
  if (e != cudaSuccess) {
    cudaGetLastError();
    /* no event: the entry stays UNCOMMITTED and its check waits for the whole stream */
    return eng_err("deferred check: recording an event failed: CUDA error %d %s", (int)e, cudaGetErrorName(e));
  }
  return 0;
#else
  (void)flag;
  return 0;
#endif
}

static void test_fmt(char* buf, size_t n, const char* op, int64_t a, int64_t b) {
  snprintf(buf, n, "%s: test check failed (a = %lld, b = %lld)", op, (long long)a, (long long)b);
}

int* eng_deferred_test_flag(const char* op, int64_t a, int64_t b) {
  char msg[512];
  int bad;
  pthread_mutex_lock(&g_mu);
  int i = take_locked(op, test_fmt, a, b, g_mapped, msg, sizeof msg, &bad);
  pthread_mutex_unlock(&g_mu);
  if (bad) { eng_err("%s", msg); return NULL; }
  if (i < 0) return NULL;
  return (int*)g_host + i;
}
