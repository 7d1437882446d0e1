/* guard.h: a deadline on the blocking MPI calls of the comm layer (comm/guard.c).  Not public. */
#ifndef ENG_COMM_GUARD_H
#define ENG_COMM_GUARD_H
#include "comm/comm_impl.h"

/* Around one blocking MPI call on pg (the main thread's; calls do not nest): when it has not returned
 * after the comm timeout (ENGINE_COMM_TIMEOUT, dist.set_comm_timeout), a watcher thread prints what
 * the rank waits for and its last collectives, and ends the process (exit status 3), so that a dead
 * peer or network ends the job instead of hanging it.  what: a static string (the collective). */
COMM_INTERNAL void comm_guard_begin(const eng_pg* pg, const char* what);
COMM_INTERNAL void comm_guard_end(void);

#endif
