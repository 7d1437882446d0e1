/* parallel.c: the kernels' worker pool.
 *
 * kc_parallel_for(n, grain, fn, ctx) runs fn over [0, n) in contiguous chunks
 * on the calling thread and (threads - 1) persistent worker threads.  Chunks
 * are claimed dynamically, so a worker that the OS does not schedule (a busy
 * machine) only makes the caller do more of the work, never blocks it.  The
 * chunk boundaries depend only on n, grain and the thread count, so results
 * do not depend on which thread ran which chunk.  A call made from inside a
 * chunk, or from a second thread while the pool is busy, runs inline on the
 * calling thread.
 *
 * Idle workers spin for a short while (the gaps between the kernels of a
 * training step are microseconds), then yield, then sleep on a futex. */
#define _GNU_SOURCE
#include "kcpu.h"
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define POOL_MAX 64
/* chunks per thread: a little slack for dynamic balancing */
#define CHUNKS_PER_THREAD 4
/* how long an idle worker polls before it sleeps (pause, then sched_yield) */
#define SPIN_NS 200000
#define YIELD_NS 2000000

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static _Atomic int g_threads = 1;    /* pool size, the caller included */
static int g_started;                /* workers created */
static pthread_mutex_t g_start_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t g_busy = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static __thread int t_inside;        /* running a chunk (or a worker) */

/* The current job.  g_word = generation << 32 | next unclaimed chunk: a
 * claim (CAS) succeeds only while the job it read is still the current one,
 * and a job cannot end (nor a new one start) while a claimed chunk runs. */
static _Atomic uint64_t g_word;
static _Atomic uint32_t g_gen;       /* futex word: generation of the last job posted */
static _Atomic int g_sleepers;
static _Atomic int g_done;           /* chunks finished in the current job */
static _Atomic(kc_range_fn) g_fn;
static _Atomic(void*) g_ctx;
static _Atomic int64_t g_n, g_chunk;
static _Atomic uint32_t g_nchunks;

static void futex_wait(_Atomic uint32_t* w, uint32_t v) {
  syscall(SYS_futex, (uint32_t*)w, FUTEX_WAIT_PRIVATE, v, NULL, NULL, 0);
}
static void futex_wake_all(_Atomic uint32_t* w) {
  syscall(SYS_futex, (uint32_t*)w, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0);
}

/* Claims and runs chunks of job gen until none is left.  The job's fields
 * are published with release stores after g_word was set to "gen + 1,
 * closed", so a worker that reads any field of a newer job also sees the
 * newer generation in g_word and claims nothing. */
static void run_chunks(uint32_t gen) {
  kc_range_fn fn = atomic_load_explicit(&g_fn, memory_order_acquire);
  void* ctx = atomic_load_explicit(&g_ctx, memory_order_acquire);
  int64_t n = atomic_load_explicit(&g_n, memory_order_acquire);
  int64_t chunk = atomic_load_explicit(&g_chunk, memory_order_acquire);
  uint32_t nch = atomic_load_explicit(&g_nchunks, memory_order_acquire);
  uint64_t w = atomic_load_explicit(&g_word, memory_order_acquire);
  for (;;) {
    if ((uint32_t)(w >> 32) != gen || (uint32_t)w >= nch) return;
    if (!atomic_compare_exchange_weak_explicit(&g_word, &w, w + 1, memory_order_acq_rel, memory_order_acquire))
      continue;
    int64_t c = (int64_t)(uint32_t)w;
    int64_t lo = c * chunk, hi = lo + chunk < n ? lo + chunk : n;
    fn(ctx, lo, hi);
    atomic_fetch_add_explicit(&g_done, 1, memory_order_acq_rel);
    w = atomic_load_explicit(&g_word, memory_order_acquire);
  }
}

static void* worker_main(void* arg) {
  int id = (int)(intptr_t)arg; /* 1 .. POOL_MAX - 1 */
  t_inside = 1;
  uint32_t seen = atomic_load(&g_gen);
  for (;;) {
    uint32_t g = atomic_load_explicit(&g_gen, memory_order_acquire);
    if (g == seen) {
      int64_t t0 = now_ns();
      int spins = 0;
      for (;;) {
        g = atomic_load_explicit(&g_gen, memory_order_acquire);
        if (g != seen) break;
        if (++spins < 64) { cpu_relax(); continue; }
        spins = 0;
        int64_t dt = now_ns() - t0;
        if (dt < SPIN_NS) continue;
        if (dt < YIELD_NS) { sched_yield(); continue; }
        atomic_fetch_add(&g_sleepers, 1);
        if (atomic_load(&g_gen) == seen) futex_wait(&g_gen, seen);
        atomic_fetch_sub(&g_sleepers, 1);
        t0 = now_ns();
      }
    }
    seen = g;
    if (id < atomic_load_explicit(&g_threads, memory_order_relaxed)) run_chunks(g);
  }
  return NULL;
}

/* Starts workers up to n - 1 (under g_start_mu); returns how many run. */
static int start_workers(int n) {
  pthread_mutex_lock(&g_start_mu);
  while (g_started < n - 1) {
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &at, worker_main, (void*)(intptr_t)(g_started + 1));
    pthread_attr_destroy(&at);
    if (rc != 0) break;
    g_started++;
  }
  int s = g_started;
  pthread_mutex_unlock(&g_start_mu);
  return s;
}

void kc_set_threads(int n) {
  if (n < 1) n = 1;
  if (n > POOL_MAX) n = POOL_MAX;
  atomic_store(&g_threads, n);
}

int kc_get_threads(void) { return atomic_load(&g_threads); }

int kc_in_parallel(void) { return t_inside; }

void kc_parallel_for(int64_t n, int64_t grain, kc_range_fn fn, void* ctx) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  int threads = atomic_load_explicit(&g_threads, memory_order_relaxed);
  if (threads <= 1 || t_inside || n < 2 * grain || pthread_mutex_trylock(&g_busy) != 0) {
    fn(ctx, 0, n);
    return;
  }
  int workers = start_workers(threads);
  if (workers < 1) { pthread_mutex_unlock(&g_busy); fn(ctx, 0, n); return; }
  if (workers + 1 < threads) threads = workers + 1;
  int64_t parts = (n + grain - 1) / grain;
  if (parts > (int64_t)threads * CHUNKS_PER_THREAD) parts = (int64_t)threads * CHUNKS_PER_THREAD;
  int64_t chunk = (n + parts - 1) / parts;
  uint32_t nch = (uint32_t)((n + chunk - 1) / chunk);
  uint32_t gen = atomic_load_explicit(&g_gen, memory_order_relaxed) + 1;
  atomic_store_explicit(&g_word, (uint64_t)gen << 32 | 0xffffffffu, memory_order_seq_cst); /* closed */
  atomic_store_explicit(&g_fn, fn, memory_order_release);
  atomic_store_explicit(&g_ctx, ctx, memory_order_release);
  atomic_store_explicit(&g_n, n, memory_order_release);
  atomic_store_explicit(&g_chunk, chunk, memory_order_release);
  atomic_store_explicit(&g_nchunks, nch, memory_order_release);
  atomic_store_explicit(&g_done, 0, memory_order_relaxed);
  atomic_store_explicit(&g_word, (uint64_t)gen << 32, memory_order_release);
  atomic_store_explicit(&g_gen, gen, memory_order_release);
  if (atomic_load(&g_sleepers) > 0) futex_wake_all(&g_gen);
  t_inside = 1;
  run_chunks(gen);
  t_inside = 0;
  int spins = 0;
  while (atomic_load_explicit(&g_done, memory_order_acquire) < (int)nch) {
    if (++spins < 2048) cpu_relax();
    else sched_yield();
  }
  pthread_mutex_unlock(&g_busy);
}
