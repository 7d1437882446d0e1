/* dist.h: the distributed runtime (MPI).  Process groups, meshes and
 * collectives build on it. */
#ifndef ENG_DIST_H
#define ENG_DIST_H
#include <stdint.h>
#include <stddef.h>
#include "tensor.h"

/* Initializes MPI if it is not yet (a singleton run is world size 1);
 * idempotent.  The engine host calls it before running a recipe. */
int eng_dist_init(void);
int eng_dist_is_initialized(void);
int eng_dist_finalize(void);
int eng_dist_rank(void);
int eng_dist_world_size(void);
/* Rank among the processes on this node (for picking a GPU). */
int eng_dist_local_rank(void);
int eng_dist_barrier(void);
/* Aborts every rank with the given exit code (after an unrecoverable error
 * on one rank, so the others do not hang in a collective). */
void eng_dist_abort(int code);
/* Seconds a failing rank should wait before eng_dist_abort so that the other ranks print their own error: 1 after a
 * comm-watchdog verdict (every rank it names raises the same error), else 0. */
double eng_dist_abort_grace(void);
/* Sums n counters element-wise over all world ranks, in place (for merging
 * test results; collective over the world, not counted as a collective). */
int eng_dist_allreduce_counts(int64_t* counts, int n);
/* Same, but gives up after `seconds`: 0 done, 1 timed out (the others did
 * not arrive; the caller should abort the job), -1 error. */
int eng_dist_allreduce_counts_timeout(int64_t* counts, int n, double seconds);
/* Watchdog: unless disarmed within `seconds`, prints `label` and the
 * collective flight recorder to stderr and ends this process with exit code
 * 3 (mpirun then stops the other ranks).  Re-arming replaces the deadline. */
int eng_dist_watchdog_arm(double seconds, const char* label);
void eng_dist_watchdog_disarm(void);

#endif
