/* dist_runtime.c: MPI start-up and shutdown, rank and world size. */
#include "internal.h"
#include <mpi.h>

static int g_owned; /* we called MPI_Init */

int eng_dist_init(void) {
  int inited = 0;
  MPI_Initialized(&inited);
  if (inited) return 0;
  eng_runtime_init(); /* malloc settings must precede MPI's own allocations */
  int provided = 0;
  if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
    return eng_err("dist.init: MPI_Init_thread failed");
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  g_owned = 1;
  return 0;
}

int eng_dist_is_initialized(void) {
  int inited = 0, fin = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&fin);
  return inited && !fin;
}

int eng_dist_finalize(void) {
  if (!g_owned || !eng_dist_is_initialized()) return 0;
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
