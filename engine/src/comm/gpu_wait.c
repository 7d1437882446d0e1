/* gpu_wait.c: the host-side wait on a collective queued on a GPU stream, and the NCCL communicator's
 * agreed creation; device-free (the device calls come through comm_gpu_ops, so the specs drive the same
 * code on the CPU with a stub device: eng_comm_test_gpu_wait, eng_comm_test_gpu_init).
 *
 * Wait: NCCL kernels never return when a rank never issues the collective or a peer died: the event that
 * follows the collective never completes.  So a wait does not block in CUDA: it polls the event and the
 * communicator's asynchronous error (ncclCommGetAsyncError), and while it waits it behaves as the MPI
 * waits of signature_check.c do: after 20 ms it takes in the goodbyes of ended ranks and publishes what it
 * waits for to the comm watchdog (peer_health.c), which finds ranks waiting for each other on different
 * groups; after ENGINE_COMM_TIMEOUT seconds it gives up.  On a timeout, an asynchronous error, a peer
 * that ended or a watchdog verdict it aborts the communicator (ncclCommAbort: the kernels end, the stream
 * drains) and marks the group unusable (broken = 3, the message kept), then raises an error naming the
 * group, the collective and its sequence number.  Every waiting rank ends the same way: the ranks stuck
 * in the same collective time out (or see the error NCCL raises once a peer aborted), and later calls on
 * the group refuse, naming the first failure.
 *
 * Creation: ncclCommInitRank is collective and NCCL cannot tell a rank that failed before calling it (no
 * GPU, a bad NCCL_* variable) from a slow one, so the others wait for ever.  comm_gpu_init_agree agrees
 * over MPI (the group's control communicator) before NCCL is called: every member's readiness (a device,
 * the unique id) is exchanged with the members' messages; then the communicator is created non-blocking
 * and polled, and every rank whose creation ended (either way) tells the others through a notice on the
 * control communicator; a rank still creating that hears of a failure aborts its own creation.  A last
 * exchange of every member's outcome makes every rank raise the same error, naming the failing ranks and
 * what NCCL said on each. */
#define _GNU_SOURCE
#include "comm/comm_impl.h"
#include "eng/comm.h"
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static const comm_gpu_ops* g_ops;

void comm_gpu_ops_set(const comm_gpu_ops* ops) { g_ops = ops; }
const comm_gpu_ops* comm_gpu_ops_get(void) { return g_ops; }

static void nap(long ns) {
  struct timespec ts = {0, ns};
  nanosleep(&ts, NULL);
}

int comm_gpu_refuse(const eng_pg* pg, const char* name) {
  if (pg->broken != 3) return 0;
  return eng_err("%s: group %s is unusable: %s", name, pg->name, pg->broken_msg ? pg->broken_msg : "its NCCL communicator was aborted");
}

/* Abort pg's communicator, mark the group unusable with msg (the current error) and return -1. */
static int fail(eng_pg* pg, const comm_gpu_ops* ops) {
  if (ops && ops->abort) ops->abort(pg);
  if (!pg->broken) {
    pg->broken = 3;
    free(pg->broken_msg);
    pg->broken_msg = strdup(eng_last_error());
  }
  return -1;
}

int comm_gpu_wait_with(const comm_gpu_ops* ops, eng_pg* pg, void* ev, int kind, int64_t seq) {
  const char* kn = eng_coll_kind_name(kind) ? eng_coll_kind_name(kind) : "collective";
  char what[160];
  snprintf(what, sizeof what, "#%lld %s (NCCL, on the GPU)", (long long)seq, kn);
  double t0 = 0, timeout = eng_comm_get_timeout();
  int watched = 0, rc = 0;
  char msg[512];
  for (long spin = 0;; spin++) {
    int q = ops->query(ev);
    if (q > 0) break;
    if (q < 0) {
      eng_err_prefix("%s on group %s", what, pg->name);
      rc = fail(pg, ops);
      break;
    }
    msg[0] = 0;
    if (ops->async_error && ops->async_error(pg, msg, (int)sizeof msg)) {
      eng_err("%s on group %s failed: NCCL reported an asynchronous error: %s (a peer has failed or aborted); "
              "the communicator is aborted and group %s is unusable from now on", what, pg->name, msg, pg->name);
      comm_err_append_history();
      rc = fail(pg, ops);
      break;
    }
    if (spin < 64) { sched_yield(); continue; }
    double now = eng_time();
    if (t0 == 0) t0 = now;
    if (now - t0 > 0.02) {
      comm_peers_poll();
      int who = comm_peer_ended(pg);
      if (who >= 0) {
        eng_err("%s on group %s: rank %d has ended while this rank (%d) waits for it; the communicator is aborted "
                "and group %s is unusable from now on.\n%s",
                what, pg->name, who, comm_world_rank(), pg->name, comm_peer_goodbye(who) ? comm_peer_goodbye(who) : "");
        rc = fail(pg, ops);
        break;
      }
      if (!watched) { comm_wd_begin(pg, what); watched = 1; }
      if (comm_wd_poll(pg, now - t0)) { /* a verdict names this group (broken = 2, message set) */
        if (ops->abort) ops->abort(pg);
        rc = -1;
        break;
      }
      nap(now - t0 > 1 ? 1000000 : 100000);
    }
    if (now - t0 > timeout) {
      char who[1024];
      comm_wd_members_text(pg, who, sizeof who);
      eng_err("%s on group %s has not completed within %.0f s (ENGINE_COMM_TIMEOUT; dist.set_comm_timeout): a rank "
              "never issued it (stuck computing, or waiting in a collective on another group) or a peer has failed; "
              "the communicator is aborted and group %s is unusable from now on.\n%s",
              what, pg->name, now - t0, pg->name, who);
      comm_err_append_history();
      rc = fail(pg, ops);
      break;
    }
  }
  if (watched) comm_wd_end();
  return rc;
}

int comm_gpu_wait(eng_pg* pg, void* ev, int kind, int64_t seq) {
  if (!g_ops) return 0;
  return comm_gpu_wait_with(g_ops, pg, ev, kind, seq);
}

/* ------------------------------------------------------------------ agreed creation */
#define INIT_TAG 7001 /* notices of finished creations on the control communicator (no collective matches it) */
#define INIT_MSG 320

typedef struct init_report {
  int32_t state; /* 0 created, 1 failed here, 2 aborted because another rank failed */
  int32_t pad;
  char msg[INIT_MSG];
} init_report;

/* The common verdict from every member's report (all, W entries): 0 when none failed, else -1 with the error. */
static int init_verdict(eng_pg* pg, const init_report* all, int my_state, const char* stage) {
  int W = pg->size, nfail = 0;
  for (int i = 0; i < W; i++) nfail += all[i].state == 1;
  if (!nfail) return 0;
  char b[2048];
  int k = snprintf(b, sizeof b, "NCCL communicator for group %s could not be created (%s) on rank%s", pg->name, stage,
                   nfail > 1 ? "s" : "");
  for (int i = 0, first = 1; i < W && k < (int)sizeof b; i++)
    if (all[i].state == 1) { k += snprintf(b + k, sizeof b - k, "%s %d", first ? "" : ",", pg->ranks[i]); first = 0; }
  for (int i = 0; i < W && k < (int)sizeof b; i++)
    if (all[i].state == 1) k += snprintf(b + k, sizeof b - k, "; rank %d: %s", pg->ranks[i], all[i].msg);
  if (k < (int)sizeof b)
    snprintf(b + k, sizeof b - k, " (every member of group %s raises this error%s)", pg->name,
             my_state == 2 ? "; this rank aborted its own creation" : "");
  return eng_set_error_message(b);
}

/* Gathers every member's report into all (W entries) on the control communicator. */
static int init_gather(eng_pg* pg, const init_report* me, init_report* all) {
  int rc = MPI_Allgather(me, (int)sizeof *me, MPI_BYTE, all, (int)sizeof *me, MPI_BYTE, pg->ctl);
  if (rc == MPI_SUCCESS) return 0;
  return eng_err("NCCL communicator for group %s: exchange of the outcome failed: %s", pg->name, comm_mpi_errstr(rc));
}

int comm_gpu_init_agree(const comm_gpu_ops* ops, eng_pg* pg, int ready, const char* why, void* ctx) {
  int W = pg->size;
  init_report me;
  memset(&me, 0, sizeof me);
  if (!ready) { me.state = 1; snprintf(me.msg, sizeof me.msg, "%s", why ? why : "not ready"); }
  if (W == 1) {
    if (!ready) return eng_err("NCCL communicator for group %s could not be created: %s", pg->name, me.msg);
  } else {
    /* 1. readiness: no rank calls NCCL unless every rank will */
    init_report* all = calloc((size_t)W, sizeof *all);
    if (!all) return eng_err("NCCL communicator for group %s: out of memory", pg->name);
    int rc = init_gather(pg, &me, all);
    if (!rc) rc = init_verdict(pg, all, 0, "before NCCL was called");
    free(all);
    if (rc) return -1;
  }
  /* 2. create, non-blocking: poll the creation and the other ranks' notices */
  char msg[INIT_MSG] = "";
  int st = ops->init_start(pg, ctx, msg, (int)sizeof msg); /* 1 done, 0 in progress, -1 failed */
  double t0 = eng_time(), timeout = eng_comm_get_timeout();
  int taken = 0;
  while (st == 0) {
    st = ops->init_poll(pg, ctx, msg, (int)sizeof msg);
    if (st) break;
    int flag = 0;
    MPI_Status s;
    if (W > 1 && MPI_Iprobe(MPI_ANY_SOURCE, INIT_TAG, pg->ctl, &flag, &s) == MPI_SUCCESS && flag) {
      int32_t v = 0;
      MPI_Recv(&v, 1, MPI_INT32_T, s.MPI_SOURCE, INIT_TAG, pg->ctl, MPI_STATUS_IGNORE);
      taken++;
      if (v) { ops->init_abort(pg, ctx); st = -2; break; } /* a peer failed: this creation can never finish */
    }
    if (eng_time() - t0 > timeout) {
      snprintf(msg, sizeof msg, "ncclCommInitRank has not completed within %.0f s (ENGINE_COMM_TIMEOUT)", timeout);
      ops->init_abort(pg, ctx);
      st = -1;
      break;
    }
    nap(200000);
  }
  memset(&me, 0, sizeof me);
  me.state = st > 0 ? 0 : st == -1 ? 1 : 2;
  if (me.state == 1) snprintf(me.msg, sizeof me.msg, "%s", msg[0] ? msg : "ncclCommInitRank failed");
  if (W == 1) {
    if (me.state) return eng_err("NCCL communicator for group %s could not be created: %s", pg->name, me.msg);
    return 0;
  }
  /* 3. a rank whose creation ended by itself tells the others (one still creating aborts on a failure);
   * then every report is exchanged and every notice addressed to this rank is received */
  int32_t v = me.state == 1;
  int n = 0;
  MPI_Request* rq = calloc((size_t)W, sizeof *rq);
  init_report* all = calloc((size_t)W, sizeof *all);
  if (!rq || !all) { free(rq); free(all); return eng_err("NCCL communicator for group %s: out of memory", pg->name); }
  if (me.state != 2)
    for (int r = 0; r < W; r++)
      if (r != pg->rank) MPI_Isend(&v, 1, MPI_INT32_T, r, INIT_TAG, pg->ctl, &rq[n++]);
  int rc = init_gather(pg, &me, all);
  if (!rc) {
    int expect = -taken;
    for (int r = 0; r < W; r++) expect += r != pg->rank && all[r].state != 2;
    for (int i = 0; i < expect; i++) {
      int32_t x;
      MPI_Recv(&x, 1, MPI_INT32_T, MPI_ANY_SOURCE, INIT_TAG, pg->ctl, MPI_STATUS_IGNORE);
    }
  }
  MPI_Waitall(n, rq, MPI_STATUSES_IGNORE);
  free(rq);
  if (!rc) rc = init_verdict(pg, all, me.state, "ncclCommInitRank");
  free(all);
  if (rc) {
    if (me.state == 0) ops->init_abort(pg, ctx); /* created here, unusable: the others have none */
    return -1;
  }
  return 0;
}

/* ------------------------------------------------------------------ the stub device of the specs */
static int g_stub_scenario; /* 0 complete, 1 never, 2 async error */
static double g_stub_t0;
static int g_stub_aborts;
static long g_stub_polls;

static int stub_query(void* ev) {
  (void)ev;
  return g_stub_scenario == 0 && ++g_stub_polls > 200;
}
static int stub_async_error(eng_pg* pg, char* msg, int cap) {
  (void)pg;
  if (g_stub_scenario != 2 || eng_time() - g_stub_t0 < 0.05) return 0;
  snprintf(msg, (size_t)cap, "NCCL error 6: remote process exited or there was a network error (stub)");
  return 1;
}
static void stub_abort(eng_pg* pg) { (void)pg; g_stub_aborts++; }

static int stub_init_start(eng_pg* pg, void* ctx, char* msg, int cap) {
  (void)pg; (void)msg; (void)cap;
  int mode = *(int*)ctx;
  g_stub_t0 = eng_time();
  g_stub_polls = 0;
  return mode == 0 || mode == 2 || mode == 3 ? 0 : -1;
}
static int stub_init_poll(eng_pg* pg, void* ctx, char* msg, int cap) {
  (void)pg;
  int mode = *(int*)ctx;
  if (mode == 0) return ++g_stub_polls > 5 ? 1 : 0;
  if (mode == 2 && eng_time() - g_stub_t0 > 0.05) {
    snprintf(msg, (size_t)cap, "ncclCommInitRank: NCCL error 5: invalid usage (stub: a bad NCCL_* variable)");
    return -1;
  }
  return 0;
}
static void stub_init_abort(eng_pg* pg, void* ctx) { (void)pg; (void)ctx; g_stub_aborts++; }

static const comm_gpu_ops g_stub_ops = {stub_query, stub_async_error, stub_abort,
                                        stub_init_start, stub_init_poll, stub_init_abort};

int eng_comm_test_gpu_wait(eng_pg* pg, const char* scenario, int64_t seq) {
  if (!pg || !pg->member) return eng_err("test_gpu_wait: not a member of the group");
  if (comm_gpu_refuse(pg, "test_gpu_wait")) return -1;
  g_stub_scenario = scenario && !strcmp(scenario, "never") ? 1 : scenario && !strcmp(scenario, "async_error") ? 2 : 0;
  g_stub_t0 = eng_time();
  g_stub_polls = 0;
  return comm_gpu_wait_with(&g_stub_ops, pg, NULL, ENG_COLL_ALL_REDUCE, seq);
}

int eng_comm_test_gpu_init(eng_pg* pg, int mode) {
  if (!pg || !pg->member) return eng_err("test_gpu_init: not a member of the group");
  return comm_gpu_init_agree(&g_stub_ops, pg, mode != 1, mode == 1 ? "no GPU (stub: cudaGetDeviceCount failed)" : NULL,
                             &mode);
}

int eng_comm_test_gpu_aborts(void) { return g_stub_aborts; }
