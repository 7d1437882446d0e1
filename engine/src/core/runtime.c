/* runtime.c: process-wide set-up, threads, clocks. */
#include <stdlib.h>
#include "core/internal.h"
#include "kernels/cpu/kcpu.h"
#include <malloc.h>
#include <time.h>
#include <stdio.h>

#ifndef ENG_VERSION_STRING
#define ENG_VERSION_STRING "0.1.0"
#endif

/* OpenBLAS extensions (declared here to avoid depending on its cblas.h). */
extern void openblas_set_num_threads(int);
extern int openblas_get_num_threads(void);
extern char* openblas_get_corename(void);

static int g_inited;
static int g_threads = 1;

const char* eng_version(void) { return "engine " ENG_VERSION_STRING; }

/* This process's rank among the processes of its node (the shared-memory communicator's rank), set by comm/ when
 * the distributed runtime starts; -1 before.  The CUDA runtime picks the local GPU from it. */
static int g_node_rank = -1, g_node_size = 0, g_process_rank = 0;
void eng_set_node_local_rank(int rank, int size) { g_node_rank = rank; g_node_size = size; }
void eng_set_process_rank(int rank) { g_process_rank = rank; }
int eng_process_rank(void) { return g_process_rank; }
int eng_node_local_rank(void) { return g_node_rank; }
int eng_node_local_size(void) { return g_node_size; }

int eng_runtime_init(void) {
  if (g_inited) return 0;
  g_inited = 1;
  /* First-touch page faults are expensive here: keep big blocks in the heap
   * and never trim, so freed memory is reused without faulting again. */
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 64 << 20);
  /* The thread count OpenBLAS chose (OPENBLAS_NUM_THREADS, CPU affinity)
   * sizes the engine's own pool; OpenBLAS itself runs single-threaded and
   * the engine splits big GEMMs over the pool (kernels/cpu/gemm.c), so no
   * BLAS thread spins against the engine's parallel kernels. */
  g_threads = openblas_get_num_threads();
  if (g_threads < 1) g_threads = 1;
  /* ENGINE_NUM_THREADS wins; otherwise, with several ranks on one node
   * (mpirun's local size) and no explicit OPENBLAS_NUM_THREADS, each rank
   * takes its share of the cores (as torchrun does) so that idle pool
   * workers of one rank do not spin against another rank's work. */
  const char* env = getenv("ENGINE_NUM_THREADS");
  const char* local = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  if (!local) local = getenv("MPI_LOCALNRANKS");
  if (env && atoi(env) > 0) g_threads = atoi(env) > 64 ? 64 : atoi(env);
  else if (local && atoi(local) > 1 && !getenv("OPENBLAS_NUM_THREADS")) {
    g_threads /= atoi(local);
    if (g_threads < 1) g_threads = 1;
  }
  openblas_set_num_threads(1);
  kc_set_threads(g_threads);
  return 0;
}

int eng_set_num_threads(int n) {
  if (n < 1) return eng_err("set_num_threads: %d is not a positive thread count", n);
  if (n > 64) n = 64;
  kc_set_threads(n);
  g_threads = n;
  return 0;
}

int eng_get_num_threads(void) { return g_threads; }
int eng_threads(void) { return g_threads; }
const char* eng_blas_corename(void) { const char* s = openblas_get_corename(); return s ? s : "?"; }

const char* eng_gemm_library(void) { return kc_gemm_library(); }

double eng_time(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
