/* dist_runtime.c: MPI start-up and shutdown, rank and world size, merged
 * test counts and the test watchdog. */
#include "comm/comm_impl.h"
#include "eng/comm.h"
#include <pthread.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

static int g_owned; /* we called MPI_Init */

/* Open MPI's nonblocking all_reduce (coll/libnbc) takes a binomial tree (a reduce to one rank, then a broadcast)
 * whenever the group has fewer than 4 ranks or the buffer is reduced in place, whatever its size; the engine's
 * asynchronous all_reduce is in place (DistributedDataParallel's buckets, every async_op all_reduce).  12.4 MiB at
 * 2 ranks (recipes/bench/comm.lua 12.4, row "all_reduce async"): 4.8-5.6 ms where the blocking MPI_Allreduce takes
 * 1.4-1.7; reduce-scatter + all-gather (Rabenseifner's algorithm, libnbc's choice 3) takes 1.35-1.4 ms, and from 4
 * KiB up no longer than the binomial tree (docs/benchmarks.md, "Nonblocking all_reduce").  Set before MPI_Init
 * unless the user chose (mpirun --mca coll_libnbc_iallreduce_algorithm N puts the same variable in the
 * environment); other MPIs ignore it. */
static void tune_open_mpi(void) {
  setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "3", 0);
}

int eng_dist_init(void) {
  int inited = 0, fin = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&fin);
  if (fin) return eng_err("dist.init: MPI was already finalized in this process");
  /* the world group is created here, at the same point on every rank */
  if (inited) return comm_ensure_init("dist.init");
  eng_runtime_init(); /* malloc settings must precede MPI's own allocations */
  tune_open_mpi();
  int provided = 0;
  if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
    return eng_err("dist.init: MPI_Init_thread failed");
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  g_owned = 1;
  return comm_ensure_init("dist.init");
}

int eng_dist_is_initialized(void) {
  int inited = 0, fin = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&fin);
  return inited && !fin;
}

int eng_dist_finalize(void) {
  if (!g_owned || !eng_dist_is_initialized()) return 0;
  comm_say_goodbye(); /* a rank still waiting for this one in a collective fails instead of hanging */
  MPI_Finalize();
  g_owned = 0;
  return 0;
}

int eng_dist_rank(void) {
  if (!eng_dist_is_initialized()) return 0;
  int r = 0; MPI_Comm_rank(MPI_COMM_WORLD, &r); return r;
}

int eng_dist_world_size(void) {
  if (!eng_dist_is_initialized()) return 1;
  int w = 1; MPI_Comm_size(MPI_COMM_WORLD, &w); return w;
}

int eng_dist_local_rank(void) {
  if (!eng_dist_is_initialized()) return 0;
  MPI_Comm local;
  if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local) != MPI_SUCCESS)
    return 0;
  int r = 0; MPI_Comm_rank(local, &r);
  MPI_Comm_free(&local);
  return r;
}

int eng_dist_barrier(void) {
  if (!eng_dist_is_initialized()) return 0;
  if (MPI_Barrier(MPI_COMM_WORLD) != MPI_SUCCESS) return eng_err("barrier: MPI_Barrier failed");
  return 0;
}

void eng_dist_abort(int code) {
  if (eng_dist_is_initialized()) MPI_Abort(MPI_COMM_WORLD, code);
  exit(code);
}

int eng_dist_allreduce_counts(int64_t* counts, int n) {
  if (n < 0 || (n > 0 && !counts)) return eng_err("dist.allreduce_counts: bad arguments (n = %d)", n);
  if (!eng_dist_is_initialized() || eng_dist_world_size() == 1 || n == 0) return 0;
  int rc = MPI_Allreduce(MPI_IN_PLACE, counts, n, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  if (rc != MPI_SUCCESS) return eng_err("dist.allreduce_counts: %s", comm_mpi_errstr(rc));
  return 0;
}

int eng_dist_allreduce_counts_timeout(int64_t* counts, int n, double seconds) {
  if (n < 0 || (n > 0 && !counts)) return eng_err("dist.allreduce_counts: bad arguments (n = %d)", n);
  if (!eng_dist_is_initialized() || eng_dist_world_size() == 1 || n == 0) return 0;
  int64_t* send = malloc(sizeof(int64_t) * (size_t)n);
  if (!send) return eng_err("dist.allreduce_counts: out of memory");
  memcpy(send, counts, sizeof(int64_t) * (size_t)n);
  MPI_Request r;
  int rc = MPI_Iallreduce(send, counts, n, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD, &r);
  if (rc != MPI_SUCCESS) { free(send); return eng_err("dist.allreduce_counts: %s", comm_mpi_errstr(rc)); }
  double t0 = eng_time();
  int flag = 0;
  for (long spin = 0;; spin++) {
    rc = MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) { free(send); return eng_err("dist.allreduce_counts: %s", comm_mpi_errstr(rc)); }
    if (flag) break;
    if (eng_time() - t0 > seconds) return 1; /* send stays allocated: MPI may still read it */
    if (spin > 100) { struct timespec ts = {0, 100000}; nanosleep(&ts, NULL); }
  }
  free(send);
  return 0;
}

/* ---- watchdog: a thread that ends the process when a deadline passes. */
static pthread_mutex_t g_wd_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_wd_cv;
static int g_wd_started;
static int64_t g_wd_gen;     /* bumped by every arm/disarm */
static double g_wd_deadline; /* CLOCK_MONOTONIC seconds; 0: disarmed */
static char g_wd_label[512];
static int g_wd_rank;        /* world rank, read on the main thread */

static void* watchdog_main(void* arg) {
  (void)arg;
  pthread_mutex_lock(&g_wd_mu);
  for (;;) {
    if (g_wd_deadline <= 0) { pthread_cond_wait(&g_wd_cv, &g_wd_mu); continue; }
    struct timespec ts;
    ts.tv_sec = (time_t)g_wd_deadline;
    ts.tv_nsec = (long)((g_wd_deadline - (double)ts.tv_sec) * 1e9);
    int64_t gen = g_wd_gen;
    pthread_cond_timedwait(&g_wd_cv, &g_wd_mu, &ts);
    if (gen != g_wd_gen || g_wd_deadline <= 0 || eng_time() < g_wd_deadline) continue;
    fprintf(stderr,
            "\n[rank %d] watchdog: '%s' did not finish in time; another rank has probably failed or issued a "
            "different collective. Ending this rank (mpirun stops the others).\n%s",
            g_wd_rank, g_wd_label, eng_comm_history_format(16));
    fflush(stderr);
    fflush(stdout);
    _exit(3);
  }
  return NULL;
}

int eng_dist_watchdog_arm(double seconds, const char* label) {
  if (!(seconds > 0)) return eng_err("watchdog: seconds must be positive, got %g", seconds);
  pthread_mutex_lock(&g_wd_mu);
  if (!g_wd_started) {
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&g_wd_cv, &a);
    pthread_condattr_destroy(&a);
    pthread_t th;
    if (pthread_create(&th, NULL, watchdog_main, NULL) != 0) {
      pthread_mutex_unlock(&g_wd_mu);
      return eng_err("watchdog: cannot start its thread");
    }
    pthread_detach(th);
    g_wd_started = 1;
  }
  snprintf(g_wd_label, sizeof g_wd_label, "%s", label ? label : "(unnamed)");
  g_wd_rank = eng_dist_rank();
  g_wd_deadline = eng_time() + seconds;
  g_wd_gen++;
  pthread_cond_signal(&g_wd_cv);
  pthread_mutex_unlock(&g_wd_mu);
  return 0;
}

void eng_dist_watchdog_disarm(void) {
  pthread_mutex_lock(&g_wd_mu);
  g_wd_deadline = 0;
  g_wd_gen++;
  if (g_wd_started) pthread_cond_signal(&g_wd_cv);
  pthread_mutex_unlock(&g_wd_mu);
}
