/* comm.h: process groups and collectives.
 *
 * A process group (eng_pg) wraps an MPI sub-communicator of the world.  Every
 * world rank takes part in creating a group (as in PyTorch's new_group); the
 * ranks outside it get a "not a member" group object (eng_pg_is_member() == 0)
 * on which every collective is skipped: nothing is sent, nothing is counted, an
 * in-place collective leaves the tensor alone, an out-of-place one returns a
 * new reference to its input, and an async one returns a completed handle.
 *
 * Collectives work along dim 0 of contiguous or strided tensors of any dtype
 * (f32, f64, bf16, f16, i32, i64, u8, bool).  CPU tensors go through MPI;
 * CUDA tensors through NCCL when the library was built with it.  bf16/f16
 * sums (and avg, prod) are computed in f32 and rounded once, so they equal
 * the single-process f32 result rounded to the dtype: bf16/f16 travel as a
 * 2-byte MPI datatype reduced by custom MPI ops that compute in f32 and round
 * (exact for max/min, and for sum/prod on 2 ranks where each element is
 * combined once); on larger groups sums and products are widened to f32
 * through a staging buffer instead.  avg divides the sum by the group size
 * (as a single process's mean).  avg needs a floating
 * dtype; on bool, sum is logical or (max) and prod logical and (min), as in
 * PyTorch.  Non-contiguous tensors are staged through persistent, reused
 * communication buffers.
 *
 * Async: pass a non-NULL `work` to get a handle (a new reference) in *work
 * and return at once; the result (in place, or the tensor returned by the
 * out-of-place call) is valid after eng_work_wait.  With work == NULL the call
 * blocks until the collective is done.
 *
 * Reliability (always on): each group numbers its collectives (sequence
 * numbers), and before every collective its members compare its signature
 * (seq, kind, op, root, dtype, shape) with one small all_reduce of a hash on
 * a control communicator of the group.  When they differ, or a member failed
 * its argument checks, every member fails with an error naming what each rank
 * issued and each rank's last collectives, and the group stays usable.  A
 * member that waits finds out within a second when a peer of the group has
 * ended (finalized MPI: eng_dist_finalize tells every rank) and fails naming
 * it; one that waits longer than the timeout (env ENGINE_COMM_TIMEOUT,
 * seconds, default 300) prints the flight recorder and aborts the job.  Env
 * ENGINE_COMM_CHECK=0 (or eng_comm_set_check(0) on every rank) turns the
 * signature check off (benchmarks); debug mode (env ENGINE_COMM_DEBUG=1 or
 * eng_comm_set_debug(1)) keeps it on and also logs every collective to
 * stderr.  The flight recorder keeps the last 64 collectives of this
 * process; error messages from collectives end with the most recent entries. */
#ifndef ENG_COMM_H
#define ENG_COMM_H
#include <stdint.h>
#include <stddef.h>
#include "tensor.h"

typedef struct eng_pg eng_pg;
typedef struct eng_work eng_work;

typedef enum eng_reduce_op {
  ENG_REDUCE_SUM = 0, ENG_REDUCE_AVG = 1, ENG_REDUCE_MAX = 2, ENG_REDUCE_MIN = 3,
  ENG_REDUCE_PROD = 4, ENG_NUM_REDUCE_OPS = 5
} eng_reduce_op;

typedef enum eng_coll_kind {
  ENG_COLL_ALL_REDUCE = 0, ENG_COLL_ALL_GATHER = 1, ENG_COLL_REDUCE_SCATTER = 2,
  ENG_COLL_ALL_TO_ALL = 3, ENG_COLL_BROADCAST = 4, ENG_COLL_SCATTER = 5,
  ENG_COLL_BARRIER = 6, ENG_COLL_GATHER = 7, ENG_NUM_COLL_KINDS = 8
} eng_coll_kind;

/* "sum", "avg", ... (borrowed; NULL for an invalid code) and back (-1 and an
 * error for an unknown name). */
const char* eng_reduce_op_name(int op);
int eng_reduce_op_from_name(const char* name);
/* "all_reduce", "all_gather", ... (borrowed; NULL for an invalid code). */
const char* eng_coll_kind_name(int kind);

/* ---- groups.  Creation is collective over the whole world. */
/* The world group (a duplicate of MPI_COMM_WORLD).  New reference. */
eng_pg* eng_pg_world(void);
/* The group of the n world ranks listed (distinct, in [0, world)); group rank
 * i is ranks[i].  Every world rank must call it with the same list. */
eng_pg* eng_pg_new(const int* ranks, int n);
/* (An invalid rank list still takes part in the world-wide agreement, so
 * every rank fails instead of some hanging; eng_pg_new(NULL, 0) does only
 * that, for callers that found the arguments invalid themselves.) */
/* MPI_Comm_split of parent: ranks with the same color form a group, ordered
 * by key (ties by parent rank); color < 0 gives a non-member object.  Every
 * member of parent must call it. */
eng_pg* eng_pg_split(eng_pg* parent, int color, int key);
eng_pg* eng_pg_retain(eng_pg* pg);
void eng_pg_release(eng_pg* pg);
int eng_pg_is_member(const eng_pg* pg);
/* This process's rank in the group and the group size (both -1 on a
 * non-member, as in PyTorch). */
int eng_pg_rank(const eng_pg* pg);
int eng_pg_size(const eng_pg* pg);
/* World ranks of the members in group-rank order into out (at most cap);
 * returns the group size (0 on a non-member). */
int eng_pg_ranks(const eng_pg* pg, int* out, int cap);
/* Group rank of world rank r, or -1 with an error when r is not a member. */
int eng_pg_group_rank(const eng_pg* pg, int world_rank);
/* Unique id of the group within this process (the world group is 0). */
int64_t eng_pg_id(const eng_pg* pg);
/* Collectives issued on the group so far (its next sequence number). */
int64_t eng_pg_seq(const eng_pg* pg);
/* "world" or "group[0,2]" (or the name given by a mesh); borrowed. */
const char* eng_pg_name(const eng_pg* pg);

/* ---- collectives (op: eng_reduce_op; roots are group ranks). */
/* In place: every member ends with the reduction of all members' t. */
int eng_pg_all_reduce(eng_pg* pg, eng_tensor* t, int op, eng_work** work);
/* Out of place: out (same shape, dtype and device as in) receives the
 * reduction of all members' in; in is left alone.  out may be in itself (then
 * as eng_pg_all_reduce) but must not overlap it otherwise. */
int eng_pg_all_reduce_into(eng_pg* pg, eng_tensor* out, eng_tensor* in, int op, eng_work** work);
/* New tensor [size*d0, d1, ...]: the members' inputs (equal shapes)
 * concatenated along dim 0 in group-rank order. */
eng_tensor* eng_pg_all_gather(eng_pg* pg, eng_tensor* in, eng_work** work);
/* Same into out (shape [size*d0, d1, ...], same dtype). */
int eng_pg_all_gather_into(eng_pg* pg, eng_tensor* out, eng_tensor* in, eng_work** work);
/* in: [size*c, d1, ...] on every member; new tensor [c, d1, ...] holding the
 * reduction of every member's chunk number (group rank). */
eng_tensor* eng_pg_reduce_scatter(eng_pg* pg, eng_tensor* in, int op, eng_work** work);
int eng_pg_reduce_scatter_into(eng_pg* pg, eng_tensor* out, eng_tensor* in, int op, eng_work** work);
/* in: [size*c, d1, ...]: chunk j goes to rank j; result chunk i came from
 * rank i.  New tensor of in's shape. */
eng_tensor* eng_pg_all_to_all(eng_pg* pg, eng_tensor* in, eng_work** work);
int eng_pg_all_to_all_into(eng_pg* pg, eng_tensor* out, eng_tensor* in, eng_work** work);
/* In place: t on every member becomes root's t (same shape everywhere). */
int eng_pg_broadcast(eng_pg* pg, eng_tensor* t, int root, eng_work** work);
/* out [c, d1, ...] on every member receives chunk (group rank) of root's
 * in [size*c, d1, ...]; in is ignored (may be NULL) on the other ranks. */
int eng_pg_scatter(eng_pg* pg, eng_tensor* out, eng_tensor* in, int root, eng_work** work);
/* The converse (MPI_Gather): in [c, d1, ...] on every member (the same shape
 * everywhere, checked by the signature); out [size*c, d1, ...] on root receives
 * the members' inputs concatenated along dim 0 in group-rank order.  out is
 * ignored (may be NULL) on the other ranks, which allocate nothing beyond
 * their own input (a non-contiguous input is staged once). */
int eng_pg_gather(eng_pg* pg, eng_tensor* out, eng_tensor* in, int root, eng_work** work);
/* The same with inputs that differ in dim 0 (MPI_Gatherv): sizes[i] is the
 * dim-0 length of group rank i's input (size entries, the same list on every
 * member, part of the signature), out on root is [sum of sizes, d1, ...]. */
int eng_pg_gatherv(eng_pg* pg, eng_tensor* out, eng_tensor* in, const int64_t* sizes, int root, eng_work** work);
int eng_pg_barrier(eng_pg* pg, eng_work** work);
/* For checks made outside C (e.g. by the Lua layer) on a collective of
 * kind `kind` about to be issued on pg: sets msg as the error and returns -1.
 * A member first takes part in the signature check with the failure, so the
 * other ranks fail too (naming this rank) instead of waiting. */
int eng_pg_report_error(eng_pg* pg, int kind, const char* msg);
/* Agreement before a collective whose arguments were validated locally (data
 * a rank alone sees, e.g. targets out of range): collective over pg (every
 * member calls it at the same point).  local_err: 0 this rank is fine; 1 it
 * failed (message set); 2 it failed because an earlier agreement failed (the
 * message, naming the origin, is passed on unchanged).  key: a value every
 * member must have computed alike (0 if none).  Returns 0 when every member
 * is fine and the keys agree, else -1 on every member with an error naming
 * op and the failing rank and its message.  One small all_reduce; not
 * counted or numbered as a collective.  Non-members and groups of one
 * return at once (-1 when local_err). */
int eng_pg_agree(eng_pg* pg, int local_err, uint64_t key, const char* op);
/* eng_pg_agree with n (<= 64) values carried in the same all_reduce: when the
 * agreement passes, vals[i] becomes the maximum of vals[i] over the members
 * (e.g. a value only one rank sets, the others passing 0 or less; or a flag
 * any rank may raise); on failure vals is left as it was. */
int eng_pg_agree_max(eng_pg* pg, int local_err, uint64_t key, const char* op, int64_t* vals, int n);
/* The bare MPI collective on raw contiguous CPU buffers, for benchmarks that
 * compare against the checked path above: no staging, no counters, no
 * recorder, no debug checks; blocking.  count: elements (all_reduce,
 * broadcast), per rank (all_gather and gather send, reduce_scatter receive,
 * scatter receive) or per peer (all_to_all); recv of a gather is read only on
 * root, and op 1 issues a gather as MPI_Gatherv (equal counts) instead of
 * MPI_Gather.  send NULL means in place (all_reduce).
 * dtype: f32, f64, i32, i64, u8 (sum/max/min/prod; no avg). */
int eng_pg_raw_collective(eng_pg* pg, int kind, const void* send, void* recv, int64_t count,
                          int dtype, int op, int root);
/* The bare MPI_Alltoall doing a layout change (benchmarks): the send side is
 * an MPI vector datatype, so peer j receives the `block`-wide column block j
 * of a [rows, row_stride] send buffer (block i of it at send + j*block +
 * i*row_stride elements), contiguous: rows*block elements per peer. */
int eng_pg_raw_all_to_all_strided(eng_pg* pg, const void* send, void* recv, int64_t rows, int64_t block,
                                  int64_t row_stride, int dtype);

/* ---- async handles. */
/* Blocks until done; finishes the result (copies from staging buffers).
 * 0, or -1 with the collective's error.  Idempotent. */
int eng_work_wait(eng_work* w);
/* 1 when done (finished as by wait), 0 if still running, -1 on error. */
int eng_work_is_completed(eng_work* w);
/* The out-of-place result or the in-place tensor (borrowed; NULL for a
 * barrier).  Valid after wait. */
eng_tensor* eng_work_result(eng_work* w);
eng_work* eng_work_retain(eng_work* w);
/* Releasing the last reference of an unfinished handle waits for it. */
void eng_work_release(eng_work* w);

/* ---- counters (CommDebugMode-like): collectives issued by this process
 * since the last reset, per kind, and the bytes of their inputs. */
int64_t eng_comm_count(int kind);
int64_t eng_comm_bytes(int kind);
void eng_comm_reset_counts(void);

/* ---- single-copy exchanges on one node (engine/src/comm/cma.c): DTensor's
 * S(a)->S(b) all_to_all and S(d)->R all_gather of at least 256 KiB move each
 * strided block once, straight between the ranks' memories (Linux
 * cross-memory attach), instead of packing it for MPI, when every rank of
 * the group is on this node.  On by default (env ENGINE_CMA=0 turns it off);
 * set it the same way on every rank.  The count is of the exchanges done
 * that way by this process (each also counts as its collective). */
int eng_comm_set_single_copy(int on);
int eng_comm_get_single_copy(void);
int64_t eng_comm_single_copy_count(void);
/* 1 when the single-copy path may be used on pg for CPU tensors (enabled,
 * not in debug mode, 2 or more members, all on this node, and every member
 * read a token from every other member's memory).  Collective the first time
 * it is asked on a group (every member must call it); cached after that. */
int eng_pg_single_copy_usable(eng_pg* pg);
/* Why the path is not usable on pg ("" when it is; e.g. "the members are on
 * different nodes"): a static string, the same on every member once
 * eng_pg_single_copy_usable has been asked.  Not collective. */
const char* eng_pg_single_copy_reason(eng_pg* pg);
/* Single-copy box exchange (ShardedTensor's reshard of any two layouts):
 * a list of moves, each taking the box `shape` at element offsets src_off of
 * group rank src's source tensor number src_idx to offsets dst_off of group
 * rank dst's destination tensor number dst_idx (all 0-based; ndim dims of
 * each).  Every member passes the same list, and its own source and
 * destination tensors (any strides) in the numbering the list uses; each box
 * moves once, straight from the source tensor into the destination tensor
 * across the processes (written by the sender or read by the receiver,
 * whichever side holds it in fewer pieces), with no pack, padding or unpack.
 * Destination boxes must not overlap.  Collective on the members of pg,
 * counted as one collective of `kind` (ENG_COLL_ALL_TO_ALL for a reshard,
 * GATHER for a gather to one rank, SCATTER for a scatter; bytes: the boxes this rank
 * sends).  Returns 0
 * done; 1 declined, the same on every member (single copy not usable on pg,
 * see eng_pg_single_copy_usable; a tensor not on the CPU; a strided run of a
 * box between ranks shorter than 256 bytes; or a copy failing, after which the
 * group stops using the path): the caller then moves the boxes another way
 * (e.g. packed into one all_to_all); -1 error on every member (the lists
 * differ between ranks, a move names a tensor its rank did not pass or a box
 * outside it, a tensor's dtype or ndim differs from the call's). */
typedef struct eng_box_move {
  int32_t src, src_idx, dst, dst_idx;
  int64_t src_off[8], dst_off[8], shape[8];
} eng_box_move;
int eng_pg_box_exchange(eng_pg* pg, const char* op, int kind, int ndim, int dtype, const eng_box_move* moves, int nmoves,
                        eng_tensor* const* srcs, int nsrc, eng_tensor* const* dsts, int ndst);

/* An all-gather of blocks straight into their places (FSDP's unshard: each
 * rank's chunk holds one block per parameter; every rank reads each peer's
 * blocks out of the peer's chunk into its unsharded parameters, with no
 * gathered buffer and no copy-out).  src: this rank's chunk (the same layout
 * on every rank); block b starts at element src_off[b] of every chunk, holds
 * lens[b * W + r] elements on group rank r (W = the group's size) and goes to
 * element dst_off[b * W + r] of dst (dst_numel elements, on every rank).
 * eligible: bit 0 clear when this rank cannot take part (its chunk is not
 * current); the ranks agree on it.  Bit 1 (2 | 1: set on every member, or it
 * is ignored) drops the closing exchange: the caller then makes sure that its
 * next exchange on pg (any collective or agreement) comes before it changes
 * src, and a failed read is this rank's error (-1) instead of a decline.
 * Collective on the members of pg, counted as one
 * all_gather.  Returns 0 done; 1 declined, the same on every member (single
 * copy not usable on pg, a rank not eligible, or a read failing, after which
 * the group stops using the path): the caller then all-gathers over MPI; -1
 * error on every member (the signature check, the blocks outside src or dst). */
int eng_pg_gather_blocks(eng_pg* pg, const char* op, int dtype, const void* src, int64_t src_numel, int nblocks,
                         const int64_t* src_off, const int64_t* lens, const int64_t* dst_off, void* dst,
                         int64_t dst_numel, int eligible);

/* ---- debug mode and the flight recorder. */
int eng_comm_set_debug(int on);
int eng_comm_get_debug(void);
/* The signature check before every collective (on by default). */
int eng_comm_set_check(int on);
int eng_comm_get_check(void);
/* Seconds a rank waits for its peers in the signature check before it
 * prints the flight recorder and aborts the job (default 300, env
 * ENGINE_COMM_TIMEOUT). */
int eng_comm_set_timeout(double seconds);
double eng_comm_get_timeout(void);
/* The comm watchdog: after a rank has waited this many seconds in a signature
 * check or agreement it tells the other ranks what it waits for, and ranks
 * waiting on different groups for each other fail with the same error naming
 * what each waits for (default 1, env ENGINE_COMM_WATCHDOG; 0 turns it off;
 * set it the same way on every rank). */
int eng_comm_set_watchdog(double seconds);
double eng_comm_get_watchdog(void);
/* The straggler report: a rank that has waited this many seconds in a collective's signature check for members
 * that wait in no collective (they compute, or are stuck outside the comm layer) prints once what each member of
 * the group does, and goes on waiting (the job ends at the timeout unless they come); the lowest waiting rank of
 * the group prints it.  Default 30, env ENGINE_COMM_STRAGGLER; 0 turns it off. */
int eng_comm_set_straggler(double seconds);
double eng_comm_get_straggler(void);
typedef struct eng_coll_record {
  int64_t id;        /* position in this process's history (0, 1, ...) */
  int64_t seq;       /* sequence number within its group */
  int64_t group_id;
  int32_t kind, dtype, op, root;
  int32_t ndim, state; /* state: 0 issued, 1 completed, 2 failed */
  int32_t async, group_size;
  int64_t shape[8];
  double t_start, t_end; /* eng_time() */
} eng_coll_record;
/* Number of records kept (at most 64); records from oldest to newest. */
int eng_comm_history_len(void);
int eng_comm_history_get(int i, eng_coll_record* out);
/* Group name of a record (borrowed, valid until the group is freed or 64
 * more collectives); "?" when unknown. */
const char* eng_comm_history_group_name(int i);
/* The recorder as text (borrowed, valid until the next call). */
const char* eng_comm_history_format(int max_entries);

/* ---- CUDA (NCCL backend). */
/* Number of usable CUDA devices (0 without a GPU or without the CUDA build). */
int eng_comm_cuda_device_count(void);
/* 1 when CUDA tensors use NCCL in this build. */
int eng_comm_have_nccl(void);

/* For the specs: the device-free logic of the NCCL path (comm/gpu_wait.c) driven on any device by a stub.
 * test_gpu_wait: the host-side wait on GPU collective #seq (an all_reduce) of pg whose stub event behaves as
 * scenario says: "complete" (done after some polls), "never" (never completes: the comm timeout ends the
 * wait), "async_error" (the communicator reports an asynchronous error after 50 ms).  0 or -1 (error set,
 * pg unusable).  test_gpu_init: the agreed creation of pg's communicator (collective on pg), where this
 * rank's stub creation is mode: 0 succeeds after a few polls, 1 not ready (no GPU), 2 fails after 50 ms,
 * 3 never completes unless aborted.  0 or -1 (the same error on every member).  test_gpu_aborts: stub
 * communicators aborted so far on this rank. */
int eng_comm_test_gpu_wait(eng_pg* pg, const char* scenario, int64_t seq);
int eng_comm_test_gpu_init(eng_pg* pg, int mode);
int eng_comm_test_gpu_aborts(void);
/* The order of stream and event operations around GPU collectives (comm/stream_order.c), recorded for the
 * specs on every device: stream_trace(1) clears the trace and starts recording (0 stops; also
 * ENGINE_COMM_STREAM_TRACE=1), trace_text is what was recorded, one operation a line (borrowed),
 * trace_mark appends a line of the caller's. */
int eng_comm_stream_trace(int on);
const char* eng_comm_stream_trace_text(void);
void eng_comm_stream_trace_mark(const char* what);

#endif
