/* guard.c: a deadline on blocking MPI calls.
 *
 * Why: a blocking MPI collective whose peer is alive but unreachable (a link
 * down between two nodes, a switch lost) never returns: TCP retransmits for
 * a quarter of an hour and Open MPI waits for ever.  The signature check
 * before each collective has its own timeout (process_group.c, check_wait),
 * but once the check has passed the data phase is a plain blocking call.
 * Here each such call records its start; a watcher thread, started with the
 * first call, sleeps until the deadline of the call in flight, and when that
 * same call is still in flight then, prints what this rank waits for and its
 * recent collectives, gives the other ranks of its node a moment to report
 * theirs (they are stuck in the same collective), and ends the process with
 * status 3 (mpirun then stops the rest of the job), as PyTorch's NCCL
 * watchdog does.  The cost per call: a clock read and two atomic stores.
 * The watcher polls once a second while no call is in flight. */
#define _GNU_SOURCE
#include "comm/guard.h"
#include "eng/comm.h"
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

static int64_t g_gen;            /* odd: a call is in flight; bumped at begin and end */
static int64_t g_start_ns;       /* CLOCK_MONOTONIC of the call's start */
static const eng_pg* g_pg;       /* the call's group and what it is (read by the watcher) */
static const char* g_what;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void sleep_until(int64_t t) {
  struct timespec ts = {(time_t)(t / 1000000000), (long)(t % 1000000000)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {}
}

static void* watcher(void* arg) {
  (void)arg;
  for (;;) {
    int64_t gen = __atomic_load_n(&g_gen, __ATOMIC_ACQUIRE);
    if (!(gen & 1)) { sleep_until(now_ns() + 1000000000); continue; }
    int64_t start = __atomic_load_n(&g_start_ns, __ATOMIC_RELAXED);
    double timeout = eng_comm_get_timeout();
    int64_t deadline = start + (int64_t)(timeout * 1e9);
    if (now_ns() < deadline) { sleep_until(deadline); continue; }
    const eng_pg* pg = g_pg;
    const char* what = g_what;
    if (__atomic_load_n(&g_gen, __ATOMIC_ACQUIRE) != gen) continue; /* it returned meanwhile */
    fprintf(stderr,
            "\n[rank %d] %s on group %s has not completed within %.0f s (ENGINE_COMM_TIMEOUT; "
            "dist.set_comm_timeout): a peer has failed, the network between the ranks is down, or a rank is stuck "
            "elsewhere. Aborting the job.\n%s",
            eng_process_rank(), what ? what : "a collective", pg ? pg->name : "?", timeout,
            eng_comm_history_format(16));
    fflush(stderr);
    fflush(stdout);
    /* the other ranks of this node wait in the same collective and report within a moment: give them
     * that moment before this exit makes mpirun stop them */
    sleep_until(now_ns() + (int64_t)(timeout < 4 ? timeout / 2 * 1e9 : 2e9));
    _exit(3);
  }
  return NULL;
}

static void start_watcher(void) {
  pthread_t th;
  pthread_attr_t a;
  pthread_attr_init(&a);
  pthread_attr_setstacksize(&a, 256 * 1024);
  if (pthread_create(&th, &a, watcher, NULL) == 0) pthread_detach(th); /* else: no deadline */
  pthread_attr_destroy(&a);
}

void comm_guard_begin(const eng_pg* pg, const char* what) {
  pthread_once(&g_once, start_watcher);
  g_pg = pg;
  g_what = what;
  __atomic_store_n(&g_start_ns, now_ns(), __ATOMIC_RELAXED);
  __atomic_add_fetch(&g_gen, 1, __ATOMIC_RELEASE); /* odd: in flight */
}

void comm_guard_end(void) {
  if (__atomic_load_n(&g_gen, __ATOMIC_RELAXED) & 1) __atomic_add_fetch(&g_gen, 1, __ATOMIC_RELEASE);
}
