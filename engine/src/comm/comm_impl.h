/* comm_impl.h: process-group internals shared by the files of comm/:
 * process_group.c (groups, dispatch), flight_recorder.c (counters, the last
 * collectives), signature_check.c (consistency checks, agreements),
 * peer_health.c (peers that have ended), the backends mpi.c and nccl.c,
 * cma.c and mesh.c.  Not public. */
#ifndef ENG_COMM_IMPL_H
#define ENG_COMM_IMPL_H
#include "core/internal.h"
#include "eng/comm.h"
#include <mpi.h>

/* The comm_* functions below are internal to libengine (not exported). */
#define COMM_INTERNAL __attribute__((visibility("hidden")))

struct eng_pg {
  int32_t refcount;
  int32_t member;
  int32_t rank, size;   /* -1, -1 on a non-member */
  int64_t id;
  int64_t seq;          /* collectives issued on this group */
  MPI_Comm comm;        /* MPI_COMM_NULL on a non-member */
  MPI_Comm ctl;         /* control traffic (signature checks, agreements): a dup of comm */
  int broken;           /* collectives fail: 1 a member has ended while this rank waited on the group; 2 the
                           watchdog found the group in a deadlock across groups (broken_msg says which); 3 a wait
                           on a GPU collective failed (timeout, NCCL async error: comm/gpu_wait.c) */
  char* broken_msg;     /* broken == 2, 3: the verdict, the failure (malloc) */
  uint64_t key;         /* the group's identity across its members (the watchdog's records name groups by it) */
  int64_t nctl;         /* control operations (signature checks, agreements) begun on this group */
  int* ranks;           /* world ranks of the members (size entries) */
  char name[96];
  void* nccl;           /* NCCL backend state, created on first use */
  int cma;              /* single-copy exchanges (comm/cma.c): 0 not probed yet, 1 usable, -1 not */
  int bwd_reduce_dtype; /* DTensor backward Partial reductions on this group: dtype + 1 (0: their own dtype) */
  void* pend_check;     /* a deferred signature check in flight (signature_check.c), or NULL */
  int aborted;          /* a deferred check found mismatched collectives: every later call fails */
  int64_t aborted_seq;  /* the first mismatched collective */
};

/* One collective on raw contiguous buffers, as handed to a backend.
 * count: all_reduce/broadcast: elements; all_gather, gather: elements sent per rank;
 * reduce_scatter/scatter: elements received per rank; all_to_all: elements
 * per peer.  send == recv (or send NULL) means in place.  op is already
 * mapped for bool (sum -> max, prod -> min); avg reaches the MPI backend as
 * sum (comm/process_group.c scales afterwards) and NCCL as avg. */
typedef struct comm_args {
  int kind, op, root, dtype;
  const void* send;
  void* recv;
  int64_t count;
  /* gather with per-rank sizes (root only; NULL: count from every rank):
   * elements received from group rank i and their offset in recv */
  const int* vcounts;
  const int* vdispls;
} comm_args;

/* Backend: MPI (comm/mpi.c).  req NULL: blocking. */
COMM_INTERNAL int comm_mpi_issue(eng_pg* pg, const comm_args* a, MPI_Request* req);
/* Bare MPI_Alltoall whose send side is a vector datatype: peer j gets rows
 * blocks of `block` elements, block i at send + j*block + i*row_stride;
 * received contiguous (rows*block per peer).  Benchmarks only. */
COMM_INTERNAL int comm_mpi_alltoall_vector(eng_pg* pg, const void* send, void* recv, int64_t rows, int64_t block,
                                           int64_t row_stride, int dtype);
/* "MPI error N: text" for an MPI return code (thread-local buffer). */
COMM_INTERNAL const char* comm_mpi_errstr(int rc);

/* Backend: NCCL (comm/nccl.c, CUDA builds).  event NULL: blocking. */
COMM_INTERNAL int comm_nccl_issue(eng_pg* pg, const comm_args* a, void** event);
COMM_INTERNAL int comm_nccl_wait(void* event);
COMM_INTERNAL int comm_nccl_test(void* event); /* 1 done, 0 running, -1 error */
COMM_INTERNAL void comm_nccl_event_free(void* event);
COMM_INTERNAL void comm_nccl_pg_free(void* state);
COMM_INTERNAL void comm_nccl_pg_abort(void* state);

/* The host-side wait on a GPU collective and the agreed communicator creation (comm/gpu_wait.c,
 * device-free): the device calls come through this table (nccl.c installs NCCL's; the specs a stub).
 * query: 1 the event has completed, 0 not yet, -1 error (message set); async_error: 1 and msg when the
 * communicator of pg has an asynchronous error; abort: abort pg's communicator (and forget it);
 * init_start / init_poll: begin / go on creating pg's communicator (ctx: the backend's), 1 done, 0 in
 * progress, -1 failed (msg); init_abort: abandon a creation in progress, or a communicator just made. */
typedef struct comm_gpu_ops {
  int (*query)(void* ev);
  int (*async_error)(eng_pg* pg, char* msg, int cap);
  void (*abort)(eng_pg* pg);
  int (*init_start)(eng_pg* pg, void* ctx, char* msg, int cap);
  int (*init_poll)(eng_pg* pg, void* ctx, char* msg, int cap);
  void (*init_abort)(eng_pg* pg, void* ctx);
} comm_gpu_ops;
COMM_INTERNAL void comm_gpu_ops_set(const comm_gpu_ops* ops);
/* Waits on the host for ev (the event after collective #seq of kind on pg), polling the event and the
 * communicator's async error, published to the watchdog, under ENGINE_COMM_TIMEOUT; 0 done, else -1: the
 * communicator is aborted, pg is marked unusable (broken = 3) and the error names group, collective, seq. */
COMM_INTERNAL int comm_gpu_wait(eng_pg* pg, void* ev, int kind, int64_t seq);
COMM_INTERNAL int comm_gpu_wait_with(const comm_gpu_ops* ops, eng_pg* pg, void* ev, int kind, int64_t seq);
/* Creates pg's communicator with ops' init functions, agreed over MPI on every member: ready 0 (why: the
 * reason) fails every member before NCCL is called; a creation failing on some ranks fails on all, naming
 * them and each one's message.  0 or -1 (the same error on every member). */
COMM_INTERNAL int comm_gpu_init_agree(const comm_gpu_ops* ops, eng_pg* pg, int ready, const char* why, void* ctx);
/* -1 naming pg's failure when a GPU wait marked it unusable (broken = 3), else 0. */
COMM_INTERNAL int comm_gpu_refuse(const eng_pg* pg, const char* name);

/* GPU streams of the collectives and the trace of their stream/event order (comm/stream_order.c):
 * stream_for: the stream (eng_cuda_stream_id) collective kind runs on; trace_issue: appends the operations
 * of issuing collective #seq (async: an event follows, else the compute stream waits) when tracing. */
COMM_INTERNAL int comm_stream_for(int kind);
COMM_INTERNAL int comm_stream_trace_on(void);
COMM_INTERNAL void comm_stream_trace(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
COMM_INTERNAL void comm_stream_trace_issue(const eng_pg* pg, int kind, int64_t seq, int async);

/* FNV-1a hash of n bytes (signature checks, comm_world_agree); h: COMM_FNV_SEED or a previous hash. */
#define COMM_FNV_SEED 1469598103934665603ull
static inline uint64_t comm_fnv(const void* p, size_t n, uint64_t h) {
  const unsigned char* s = p;
  for (size_t i = 0; i < n; i++) { h ^= s[i]; h *= 1099511628211ull; }
  return h;
}

/* Collectives with a root (broadcast, scatter, gather). */
static inline int comm_kind_rooted(int kind) {
  return kind == ENG_COLL_BROADCAST || kind == ENG_COLL_SCATTER || kind == ENG_COLL_GATHER;
}

/* Groups (comm/process_group.c): a group over an MPI communicator (taken over; may be
 * MPI_COMM_NULL for a non-member). */
COMM_INTERNAL eng_pg* comm_pg_from_mpi(MPI_Comm c, const char* name);
/* Starts MPI if needed and creates the world group; 0 or -1. */
COMM_INTERNAL int comm_ensure_init(const char* op);
/* Collective over the world: -1 on every rank (error naming op and what)
 * when `data` is not the same on all ranks. */
COMM_INTERNAL int comm_world_agree(const void* data, size_t n, const char* op, const char* what);
/* This process's world rank, cached at start-up so that any thread can print it. */
COMM_INTERNAL int comm_world_rank(void);

/* Counters and flight recorder (comm/flight_recorder.c).  record_start notes one collective as issued and
 * returns its record id; record_end sets its state (1 completed, 2 failed; a record overwritten meanwhile is
 * left alone).  count adds one collective of kind and its bytes to the counters. */
COMM_INTERNAL int64_t comm_record_start(const eng_pg* pg, int64_t seq, int kind, int dtype, int op, int root, int ndim,
                                        const int64_t* shape, int async);
COMM_INTERNAL void comm_record_end(int64_t id, int state);
COMM_INTERNAL void comm_count(int kind, int64_t bytes);
/* Records ever made on this rank. */
COMM_INTERNAL int64_t comm_record_total(void);
/* This rank's last n collectives into b (cap bytes), one line each, oldest first. */
COMM_INTERNAL void comm_recent_text(char* b, int cap, int n);
/* Appends the most recent records to the current error message. */
COMM_INTERNAL void comm_err_append_history(void);

/* Signature checks (comm/signature_check.c).  check_on: checks are on (ENGINE_COMM_CHECK, debug mode).
 * check_collective: the check of one collective about to be issued by process_group.c's dispatch (key: the
 * tensor whose dtype and shape identify it; rows: a gather's per-rank dim-0 sizes or NULL; err: this rank's
 * own failure, message set; on_cuda: NCCL, where the check may be deferred): 0 when every member issued the
 * same valid collective, else -1 on every member.  check_finish completes pg's deferred check (0 agreed, -1
 * on every member otherwise: the group is aborted); check_finish_all every one still in flight. */
COMM_INTERNAL int comm_check_on(void);
COMM_INTERNAL int comm_check_collective(eng_pg* pg, const char* name, int kind, int op, int root, const eng_tensor* key,
                                        const int64_t* rows, int err, int on_cuda);
COMM_INTERNAL int comm_check_finish(eng_pg* pg);
COMM_INTERNAL void comm_check_finish_all(void);

/* The signature check of one collective about to be issued on pg (a member)
 * outside run() (comm/cma.c): kind, the tensor whose dtype identifies it
 * (its shape may differ between ranks), this rank's own failure (message set).  0 when every member
 * issued the same valid collective, else -1 on every member. */
COMM_INTERNAL int comm_check(eng_pg* pg, const char* name, int kind, const eng_tensor* key, int local_err);

/* The watchdog (comm/peer_health.c): what each rank waits for, readable by its peers.  A rank that has
 * waited in a signature check or agreement (signature_check.c, check_wait) for ENGINE_COMM_WATCHDOG seconds
 * (default 1; 0 turns it off) sends every other world rank a record of that wait (the group, by key and
 * members, the control operation's number, what it is); from the records it holds a waiting rank builds
 * the wait-for graph (a rank waits for the members of its group that are not in the same operation) and,
 * when it and the ranks it waits for can never go on (a cycle of waiting ranks), fails with a verdict that
 * names what every rank of the cycle waits for; it sends the verdict to all, so every rank of the cycle
 * raises the same error, and the groups involved refuse further calls.
 * wd_begin: this rank starts waiting on pg (what: a description of the operation); wd_poll: called while
 * waiting (waited: seconds so far): -1 with the error set (pg marked broken) when a deadlock is found;
 * wd_end: the wait is over;
 * wd_members_text: for the timeout report, what each member of pg is known to do. */
COMM_INTERNAL void comm_wd_begin(eng_pg* pg, const char* what);
COMM_INTERNAL int comm_wd_poll(eng_pg* pg, double waited);
COMM_INTERNAL void comm_wd_end(void);
COMM_INTERNAL void comm_wd_members_text(const eng_pg* pg, char* b, int cap);
/* wd_straggler_text: for the straggler report, the members of pg that wait in no collective and what each
 * member does; 0 when none, or when a lower member of pg waits in the same operation (it reports). */
COMM_INTERNAL int comm_wd_straggler_text(const eng_pg* pg, char* b, int cap);
/* Live member groups by key (process_group.c), for the watchdog. */
COMM_INTERNAL eng_pg* comm_pg_find(uint64_t key);

/* Peers that have ended (comm/peer_health.c).  listen: at start-up, starts listening for the other ranks'
 * goodbyes; poll: takes in the goodbyes arrived; peer_ended: a member of pg that has ended (world rank), or
 * -1; peer_goodbye: the last collectives an ended world rank sent, or NULL. */
COMM_INTERNAL void comm_peers_listen(void);
COMM_INTERNAL void comm_peers_poll(void);
COMM_INTERNAL int comm_peer_ended(const eng_pg* pg);
COMM_INTERNAL const char* comm_peer_goodbye(int world_rank);
/* At MPI finalize: tells every other world rank that this one has ended
 * (with its last collectives), so that a rank waiting for it fails instead
 * of hanging; then stops listening. */
COMM_INTERNAL void comm_say_goodbye(void);

/* Collectives done outside run() (comm/cma.c) are accounted (comm/flight_recorder.c) as one
 * collective of `kind`: sequence number, counters, flight recorder.  begin
 * returns the record id for end (state 1 completed, 2 failed); undo takes the
 * counters back when the caller redoes the collective another way. */
COMM_INTERNAL int64_t comm_account_begin(eng_pg* pg, int kind, const eng_tensor* key);
COMM_INTERNAL void comm_account_end(int64_t rec, int state);
COMM_INTERNAL void comm_account_undo(int kind, const eng_tensor* key);

/* Single-copy strided exchanges between the ranks of one node (comm/cma.c).
 * usable: collective on a group's first call (every member must call it with
 * the same device), then cached; 1 when the path may be taken, -1 (error set,
 * on every member) when the members met different operations there.
 * exchange: `in` (any strides) is split along `split` by torch.chunk rules
 * (split < 0: not split, every rank gets all of it), piece r goes to group
 * rank r, and `out` is the pieces received from ranks 0..k-1 concatenated
 * along `cat`; counted as one collective of `kind`.  local_err: this rank
 * already failed its own checks (message set; out may be NULL): every rank
 * fails instead of waiting for it.  Returns 0 done, 1 declined (the same on
 * every rank; the caller takes the MPI path), -1 error on every rank. */
COMM_INTERNAL int comm_cma_usable(eng_pg* pg, int device);
COMM_INTERNAL int comm_cma_exchange(eng_pg* pg, const char* op, int kind, eng_tensor* out, const eng_tensor* in,
                                    int split, int cat, int local_err);

#endif
