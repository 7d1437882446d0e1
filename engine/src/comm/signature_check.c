/* signature_check.c: the consistency checks of collectives and the agreements
 * built on them.  Settings (ENGINE_COMM_CHECK, ENGINE_COMM_DEBUG,
 * ENGINE_COMM_TIMEOUT), the signature of one collective, the blocking and
 * deferred checks, the report every member builds after a mismatch, and
 * eng_pg_agree / eng_pg_report_error.  While waiting, a rank asks
 * comm/peer_health.c for peers that have ended and aborts the job after the
 * timeout. */
#include "comm/comm_impl.h"
#include "eng/comm.h"
#include "eng/dist.h"
#include <sched.h>
#include <stdio.h>
#include <time.h>

/* ------------------------------------------------------------------ settings */
static int g_debug = -1;       /* -1: not read from the environment yet */
static double g_timeout = -1;  /* seconds; -1: not read yet */
static int g_check = -1;       /* signature checks; -1: not read from the environment yet */

static int debug_on(void) {
  if (g_debug < 0) {
    const char* e = getenv("ENGINE_COMM_DEBUG");
    g_debug = e && *e && strcmp(e, "0") != 0;
  }
  return g_debug;
}

static double g_straggler = -1;  /* seconds; 0: off; -1: not read yet */
static double straggler_s(void) {
  if (g_straggler < 0) {
    const char* e = getenv("ENGINE_COMM_STRAGGLER");
    double v = e ? atof(e) : 30;
    g_straggler = v > 0 ? v : 0;
  }
  return g_straggler;
}

static double timeout_s(void) {
  if (g_timeout < 0) {
    const char* e = getenv("ENGINE_COMM_TIMEOUT");
    double v = e ? atof(e) : 0;
    g_timeout = v > 0 ? v : 300;
  }
  return g_timeout;
}

/* The signature check: on unless ENGINE_COMM_CHECK=0 (debug mode keeps it on).  g_check: 0 off, 1 on (blocking on
 * MPI, deferred on NCCL), 2 "sync" (blocking everywhere), 3 "async" (deferred everywhere).  Deferred: the check's
 * all_reduce starts and the collective is issued at once (no host round trip in front of an NCCL call); the check is
 * completed when the next call on the group begins (or the group is freed, or the runtime ends), and a mismatch
 * fails that call on every rank and aborts the group. */
static int check_on(void) {
  if (g_check < 0) {
    const char* e = getenv("ENGINE_COMM_CHECK");
    g_check = !e ? 1 : !strcmp(e, "0") ? 0 : !strcmp(e, "sync") ? 2 : !strcmp(e, "async") ? 3 : 1;
  }
  return g_check || debug_on();
}

static int check_deferred(int nccl) {
  if (!check_on() || debug_on()) return 0;
  return g_check == 3 || (g_check == 1 && nccl);
}

int eng_comm_set_check(int on) { g_check = on < 0 || on > 3 ? 1 : on; return 0; }
int eng_comm_get_check(void) { return check_on(); }
double eng_comm_get_timeout(void) { return timeout_s(); }
int eng_comm_set_debug(int on) { g_debug = on ? 1 : 0; return 0; }
int eng_comm_get_debug(void) { return debug_on(); }
int eng_comm_set_straggler(double seconds) {
  if (!(seconds >= 0)) return eng_err("comm: the straggler report's delay must be >= 0 seconds (0: off), got %g", seconds);
  g_straggler = seconds;
  return 0;
}
double eng_comm_get_straggler(void) { return straggler_s(); }

int eng_comm_set_timeout(double seconds) {
  if (!(seconds > 0)) return eng_err("comm: timeout must be a positive number of seconds, got %g", seconds);
  g_timeout = seconds;
  return 0;
}

int comm_check_on(void) { return check_on(); }

/* ------------------------------------------------------------------ signature check */
/* Before every collective the members of its group compare its signature
 * (seq, kind, op, root, dtype, shape): one MPI_Iallreduce(MAX) of {h, -h,
 * err} on the group's control communicator, h a hash of the signature.
 * Equal hashes and no error: go on (the fast path).  Otherwise every member
 * knows, and they exchange their full signatures, messages and last
 * collectives (an allgather) to build the same error on every rank.  While
 * waiting, a rank watches for peers that have ended (comm_say_goodbye) and
 * for the timeout. */
#define KIND_AGREE ENG_NUM_COLL_KINDS /* eng_pg_agree: not a collective of its own */
#define HIST_TXT 400                  /* a rank's last collectives in a mismatch report */

typedef struct fprint {
  int64_t seq;
  int32_t kind, dtype, op, root, ndim, err;
  int64_t shape[8];
  uint64_t key;
  int32_t n_vals;   /* agreements: values carried (a second all_reduce once the signatures agreed) */
  char name[36];    /* what the rank calls it (agreements: the operation, e.g. checkpoint.save) */
  char msg[232];
} fprint;

typedef struct report {
  fprint f;
  char hist[HIST_TXT];
} report;

static void fp_make(fprint* f, eng_pg* pg, int kind, int op, int root, const eng_tensor* t, int err) {
  memset(f, 0, sizeof *f);
  f->seq = pg->seq; f->kind = kind; f->err = err ? (err == 2 ? 2 : 1) : 0; /* 1 failed here, 2 relayed */
  f->op = (kind == ENG_COLL_ALL_REDUCE || kind == ENG_COLL_REDUCE_SCATTER) ? op : -1;
  f->root = comm_kind_rooted(kind) ? root : -1;
  f->dtype = t ? t->dtype : -1;
  if (t) { f->ndim = t->ndim; for (int d = 0; d < t->ndim && d < 8; d++) f->shape[d] = t->shape[d]; }
}

static int fp_same(const fprint* a, const fprint* b) {
  if (a->seq != b->seq || a->kind != b->kind || a->dtype != b->dtype || a->op != b->op || a->root != b->root ||
      a->ndim != b->ndim || a->key != b->key || a->n_vals != b->n_vals ||
      (a->kind == KIND_AGREE && strcmp(a->name, b->name)))
    return 0;
  for (int d = 0; d < a->ndim; d++) if (a->shape[d] != b->shape[d]) return 0;
  return 1;
}

static uint64_t fp_hash(const fprint* f) {
  int64_t v[16] = {f->seq, f->kind, f->dtype, f->op, f->root, f->ndim, (int64_t)f->key, f->n_vals};
  for (int d = 0; d < f->ndim && d < 8; d++) v[8 + d] = f->shape[d];
  return comm_fnv(f->name, strlen(f->name), comm_fnv(v, sizeof v, COMM_FNV_SEED));
}

static const char* kind_name_any(int kind) { return kind == KIND_AGREE ? "agreement" : eng_coll_kind_name(kind); }

static int fp_desc(char* b, int cap, const fprint* f) {
  int k = snprintf(b, cap, "#%lld %s", (long long)f->seq, kind_name_any(f->kind) ? kind_name_any(f->kind) : "?");
  if (k < cap && f->dtype >= 0) k += snprintf(b + k, cap - k, " %s%s", eng_dtype_name(f->dtype), eng_shape_str(f->ndim, f->shape));
  if (k < cap && f->op >= 0) k += snprintf(b + k, cap - k, " op=%s", eng_reduce_op_name(f->op));
  if (k < cap && f->root >= 0) k += snprintf(b + k, cap - k, " root=%d", f->root);
  if (k < cap && f->kind == KIND_AGREE && f->name[0]) k += snprintf(b + k, cap - k, " (%s)", f->name);
  return k < cap ? k : cap;
}

static int ended_error(eng_pg* pg, const char* name, const fprint* f, int who) {
  char mine[HIST_TXT], d[200];
  fp_desc(d, sizeof d, f);
  comm_recent_text(mine, sizeof mine, 3);
  pg->broken = 1;
  return eng_err("%s: rank %d has ended (finalized MPI: its script returned or called os.exit) while this rank "
                 "(%d) waits for it in %s on group %s; group %s is unusable from now on.\n%s"
                 "last collectives of rank %d:\n%s",
                 name, who, comm_world_rank(), d, pg->name, pg->name, comm_peer_goodbye(who), comm_world_rank(), mine);
}

static void timeout_abort(eng_pg* pg, const char* name, const fprint* f, double waited) {
  char d[200], who[1024];
  fp_desc(d, sizeof d, f);
  comm_wd_members_text(pg, who, sizeof who);
  fprintf(stderr,
          "[rank %d] %s: the other ranks of group %s did not join %s within %.0f s (ENGINE_COMM_TIMEOUT; "
          "dist.set_comm_timeout): a rank is stuck (computing, or waiting in a collective on another group) or "
          "has failed. Aborting the job.\n%s%s",
          comm_world_rank(), name, pg->name, d, waited, who, eng_comm_history_format(16));
  fflush(stderr);
  fflush(stdout);
  /* the other waiting ranks reach their own timeout within a moment: let them report before MPI_Abort
   * ends them (a rank of this node may be killed at once) */
  double t = eng_time(), pause = timeout_s() < 4 ? timeout_s() / 2 : 2;
  while (eng_time() - t < pause) {
    struct timespec ts = {0, 20000000};
    nanosleep(&ts, NULL);
  }
  MPI_Abort(MPI_COMM_WORLD, 3);
  exit(3);
}

/* Waits for the check's all_reduce; -1 (error set) when a member has ended. */
static int check_wait_loop(eng_pg* pg, MPI_Request* r, const char* name, const fprint* f, int* watched);

static int check_wait(eng_pg* pg, MPI_Request* r, const char* name, const fprint* f) {
  int watched = 0;
  int rc = check_wait_loop(pg, r, name, f, &watched);
  if (watched) comm_wd_end();
  return rc;
}

/* The straggler report (once per wait): members that wait in no collective after straggler_s() seconds. */
static void straggler_report(eng_pg* pg, const char* name, const fprint* f, double waited) {
  char d[200], who[1024];
  if (!comm_wd_straggler_text(pg, who, sizeof who)) return;
  fp_desc(d, sizeof d, f);
  fprintf(stderr,
          "[rank %d] %s: waited %.0f s in %s on group %s for members that are in no collective (ENGINE_COMM_STRAGGLER; "
          "dist.set_comm_straggler); still waiting: the job ends at ENGINE_COMM_TIMEOUT (%.0f s) unless they come.\n%s",
          comm_world_rank(), name, waited, d, pg->name, timeout_s(), who);
  fflush(stderr);
}

static int check_wait_loop(eng_pg* pg, MPI_Request* r, const char* name, const fprint* f, int* watched) {
  int flag = 0, reported = 0;
  double t0 = 0;
  for (long spin = 0;; spin++) {
    if (MPI_Test(r, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) return eng_err("%s: signature check failed on group %s", name, pg->name);
    if (flag) return 0;
    if (spin < 32) continue;
    sched_yield();
    if ((spin & 31) != 0) continue;
    double now = eng_time();
    if (t0 == 0) t0 = now;
    if (now - t0 > 0.02) {
      comm_peers_poll();
      if (*watched && comm_wd_poll(pg, 0)) return -1; /* a verdict (sent before any goodbye) names this group */
      int who = comm_peer_ended(pg);
      if (who >= 0) {
        /* A peer that finished this check and then ended sends its goodbye on another communicator: the
         * goodbye can be seen before our request has made its last progress.  Keep testing for a grace
         * second before calling the peer gone (seen on a loaded machine: a rank failed an agreement its
         * peer had completed). */
        double tg = eng_time();
        while (eng_time() - tg < 1.0) {
          if (MPI_Test(r, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag) return 0;
          struct timespec g = {0, 1000000};
          nanosleep(&g, NULL);
        }
        return ended_error(pg, name, f, who); /* *r stays pending: the peer is gone */
      }
      if (!*watched) {
        /* waiting longer than a collective takes: tell the watchdog what for (it publishes it when the
         * wait goes on, and finds ranks waiting on different groups) */
        char d[240];
        int k = fp_desc(d, sizeof d, f);
        if (f->kind != KIND_AGREE && strcmp(name, kind_name_any(f->kind)) && k < (int)sizeof d)
          snprintf(d + k, sizeof d - k, " (%s)", name);
        comm_wd_begin(pg, d);
        *watched = 1;
      }
      if (comm_wd_poll(pg, now - t0)) return -1; /* *r stays pending: the group is unusable */
      struct timespec ts = {0, 200000};
      nanosleep(&ts, NULL);
    }
    if (!reported && straggler_s() > 0 && now - t0 > straggler_s() && *watched) {
      reported = 1;
      straggler_report(pg, name, f, now - t0);
    }
    if (now - t0 > timeout_s()) timeout_abort(pg, name, f, now - t0);
  }
}

/* Builds the error every member reports after a failed check (all members
 * take part: each knows the check failed). */
static int check_report(eng_pg* pg, const char* name, const fprint* mine_f, int local_err, int resync) {
  int W = pg->size;
  report* me = calloc(1, sizeof *me);
  report* all = calloc((size_t)W, sizeof *all);
  if (!me || !all) { free(me); free(all); return eng_err("%s: out of memory (signature check)", name); }
  me->f = *mine_f;
  if (local_err) snprintf(me->f.msg, sizeof me->f.msg, "%s", eng_last_error());
  comm_recent_text(me->hist, sizeof me->hist, 3);
  int rc = MPI_Allgather(me, (int)sizeof *me, MPI_BYTE, all, (int)sizeof *me, MPI_BYTE, pg->ctl);
  free(me);
  if (rc != MPI_SUCCESS) { free(all); return eng_err("%s: signature check failed: %s", name, comm_mpi_errstr(rc)); }
  if (resync) {
    /* the members may have met different operations (an agreement, which takes no sequence number, and a
     * collective, which does): every member goes on from the same number, so the group stays usable */
    int64_t next = 0;
    for (int i = 0; i < W; i++) {
      int64_t s = all[i].f.seq + (all[i].f.kind != KIND_AGREE);
      if (s > next) next = s;
    }
    pg->seq = next - (mine_f->kind != KIND_AGREE); /* a collective's caller counts it afterwards */
  }
  if (local_err == 1) { free(all); return -1; } /* our own message stands */
  char msg[2048];
  int k = 0, first_err = -1, relayed = -1;
  for (int i = 0; i < W; i++) {
    if (all[i].f.err == 1 && first_err < 0) first_err = i;
    if (all[i].f.err == 2 && relayed < 0) relayed = i;
  }
  if (first_err < 0 && relayed >= 0) { /* the origin failed in an earlier agreement: pass its message on */
    if (local_err != 2) eng_set_error_message(all[relayed].f.msg);
    free(all);
    return -1;
  }
  if (local_err) { free(all); return -1; }
  if (first_err >= 0) {
    snprintf(msg, sizeof msg, "%s: rank %d (group rank %d of %s) failed its checks: %s", name, pg->ranks[first_err],
             first_err, pg->name, all[first_err].f.msg);
  } else {
    int agreements = 1; /* the same agreement everywhere: its arguments differ */
    for (int i = 0; i < W; i++) agreements &= all[i].f.kind == KIND_AGREE && !strcmp(all[i].f.name, all[0].f.name);
    if (agreements) {
      free(all);
      return eng_err("%s: the ranks of group %s reached it with different arguments", name, pg->name);
    }
    k = snprintf(msg, sizeof msg, "%s: collective mismatch on group %s: ", name, pg->name);
    /* ranks grouped by what they issued */
    char* done = calloc((size_t)W, 1);
    for (int i = 0; i < W && done && k < (int)sizeof msg - 64; i++) {
      if (done[i]) continue;
      int cnt = 0;
      for (int j = i; j < W; j++) if (!done[j] && fp_same(&all[j].f, &all[i].f)) cnt++;
      k += snprintf(msg + k, sizeof msg - k, "%s%s ", i ? "; " : "", cnt > 1 ? "ranks" : "rank");
      int first = 1;
      for (int j = i; j < W && k < (int)sizeof msg - 64; j++)
        if (!done[j] && fp_same(&all[j].f, &all[i].f)) {
          done[j] = 1;
          k += snprintf(msg + k, sizeof msg - k, first ? "%d" : ",%d", pg->ranks[j]);
          first = 0;
        }
      k += snprintf(msg + k, sizeof msg - k, ": ");
      k += fp_desc(msg + k, (int)sizeof msg - k, &all[i].f);
    }
    free(done);
    if (k < (int)sizeof msg)
      k += snprintf(msg + k, sizeof msg - k, " (every rank of a group must issue the same collectives in the same "
                    "order, with the same shapes, dtypes, ops and roots)");
    for (int i = 0; i < W && i < 4 && k < (int)sizeof msg; i++)
      k += snprintf(msg + k, sizeof msg - k, "\nlast collectives of rank %d:\n%s", pg->ranks[i], all[i].hist);
    if (W > 4 && k < (int)sizeof msg) snprintf(msg + k, sizeof msg - k, "(%d more ranks)", W - 4);
    k = (int)strlen(msg);
    if (k && msg[k - 1] == '\n') msg[k - 1] = 0;
  }
  free(all);
  eng_set_error_message(msg);
  return -1;
}

/* The check itself; f describes this rank's call. */
/* check_run_vals: check_run with n_vals values carried in the same all_reduce (MAX over the members; written
 * back to vals only when the check passes). */
static int check_run_vals(eng_pg* pg, const char* name, const fprint* f, int64_t* vals, int n_vals);

static int check_run(eng_pg* pg, const char* name, const fprint* f, int local_err) {
  (void)local_err;
  return check_run_vals(pg, name, f, NULL, 0);
}

/* ---- deferred checks */
typedef struct pend_check {
  MPI_Request r;
  int64_t v[6];
  fprint f;
  char name[64];
} pend_check;

#define MAX_PEND_GROUPS 256
static eng_pg* g_pend_pgs[MAX_PEND_GROUPS];
static int g_npend_pgs;

static int group_aborted(const eng_pg* pg, const char* name) {
  return eng_err("%s: group %s is unusable: the ranks issued different collectives at #%lld (found by the deferred "
                 "signature check, after the collectives had started); create a new group", name, pg->name,
                 (long long)pg->aborted_seq);
}

/* Complete pg's deferred check: 0 when the signatures agreed, else -1 on every member (the report names what each
 * rank issued) and the group is aborted (NCCL: its communicator is aborted, so a mismatched kernel cannot hang). */
int comm_check_finish(eng_pg* pg) {
  pend_check* p = pg->pend_check;
  if (!p) return 0;
  pg->pend_check = NULL;
  for (int i = 0; i < g_npend_pgs; i++)
    if (g_pend_pgs[i] == pg) { g_pend_pgs[i] = g_pend_pgs[--g_npend_pgs]; break; }
  if (check_wait(pg, &p->r, p->name, &p->f)) return -1; /* a peer has ended: p stays allocated (request pending) */
  int ok = p->v[3] == -p->v[4] && p->v[5] == 0;
  if (ok) { free(p); return 0; }
  check_report(pg, p->name, &p->f, 0, 0);
  pg->aborted = 1;
  pg->aborted_seq = p->f.seq;
#if defined(ENG_HAVE_CUDA) && defined(ENG_HAVE_NCCL)
  if (pg->nccl) { comm_nccl_pg_abort(pg->nccl); pg->nccl = NULL; }
#endif
  char msg[2048];
  snprintf(msg, sizeof msg, "%s (found by the deferred signature check when the next call on the group began; the "
           "group is aborted)", eng_last_error());
  eng_set_error_message(msg);
  free(p);
  return -1;
}

/* Start a deferred check of f on pg (the collective is issued right after, without waiting). */
static int check_start(eng_pg* pg, const char* name, const fprint* f) {
  if (pg->broken || pg->size < 2 || g_npend_pgs >= MAX_PEND_GROUPS) return check_run(pg, name, f, f->err);
  if (pg->pend_check && comm_check_finish(pg)) return -1;
  if (pg->aborted) return group_aborted(pg, name);
  pend_check* p = calloc(1, sizeof *p);
  if (!p) return check_run(pg, name, f, f->err);
  pg->nctl++;
  int64_t h = (int64_t)(fp_hash(f) >> 1);
  p->v[0] = h; p->v[1] = -h; p->v[2] = f->err ? 1 : 0;
  p->f = *f;
  snprintf(p->name, sizeof p->name, "%s", name);
  int rc = MPI_Iallreduce(p->v, p->v + 3, 3, MPI_INT64_T, MPI_MAX, pg->ctl, &p->r);
  if (rc != MPI_SUCCESS) { free(p); return eng_err("%s: signature check failed: %s", name, comm_mpi_errstr(rc)); }
  pg->pend_check = p;
  g_pend_pgs[g_npend_pgs++] = pg;
  return 0;
}

/* Every deferred check still in flight (before MPI ends). */
void comm_check_finish_all(void) {
  while (g_npend_pgs > 0) {
    eng_pg* pg = g_pend_pgs[g_npend_pgs - 1];
    if (comm_check_finish(pg) && pg->pend_check) break; /* a peer ended: leave it */
  }
}

static int check_run_vals(eng_pg* pg, const char* name, const fprint* f, int64_t* vals, int n_vals) {
  int local_err = f->err;
  if (pg->pend_check && comm_check_finish(pg)) return -1;
  if (pg->aborted) return local_err ? -1 : group_aborted(pg, name);
  if (pg->broken) {
    int who = comm_peer_ended(pg);
    if (local_err) return -1;
    if (pg->broken == 2)
      return eng_err("%s: group %s is unusable: the comm watchdog found it in a deadlock: %s", name, pg->name,
                     pg->broken_msg ? pg->broken_msg : "?");
    if (pg->broken == 3) return comm_gpu_refuse(pg, name);
    return eng_err("%s: group %s is unusable: rank %d has ended while this rank waited for it", name, pg->name, who);
  }
  if (pg->size < 2) return local_err ? -1 : 0;
  /* one fixed-size exchange for every check and agreement: control operations that meet each other (a
   * checkpoint's agreement and another rank's all_reduce) then always match in MPI and the hashes tell the
   * mismatch; an agreement's values follow in a second all_reduce once the signatures agreed */
  int64_t* v = malloc(6 * sizeof(int64_t)); /* leaked when a peer has ended (the request stays pending) */
  if (!v) return eng_err("%s: out of memory (signature check)", name);
  int64_t h = (int64_t)(fp_hash(f) >> 1);
  v[0] = h; v[1] = -h; v[2] = local_err ? 1 : 0;
  pg->nctl++;
  MPI_Request r;
  int rc = MPI_Iallreduce(v, v + 3, 3, MPI_INT64_T, MPI_MAX, pg->ctl, &r);
  if (rc != MPI_SUCCESS) { free(v); return eng_err("%s: signature check failed: %s", name, comm_mpi_errstr(rc)); }
  if (check_wait(pg, &r, name, f)) return -1;
  int ok = v[3] == -v[4] && v[5] == 0;
  free(v);
  if (!ok) return check_report(pg, name, f, local_err, 1);
  if (n_vals <= 0) return 0;
  int64_t* w = malloc(2 * (size_t)n_vals * sizeof(int64_t));
  if (!w) return eng_err("%s: out of memory (agreement)", name);
  memcpy(w, vals, (size_t)n_vals * sizeof(int64_t));
  pg->nctl++;
  rc = MPI_Iallreduce(w, w + n_vals, n_vals, MPI_INT64_T, MPI_MAX, pg->ctl, &r);
  if (rc != MPI_SUCCESS) { free(w); return eng_err("%s: agreement failed: %s", name, comm_mpi_errstr(rc)); }
  if (check_wait(pg, &r, name, f)) return -1;
  memcpy(vals, w + n_vals, (size_t)n_vals * sizeof(int64_t));
  free(w);
  return 0;
}

static void debug_log(const eng_pg* pg, const char* name, const fprint* f) {
  char d[200];
  fp_desc(d, sizeof d, f);
  fprintf(stderr, "[rank %d] comm: %s on group %s: %s\n", comm_world_rank(), name, pg->name, d);
}

int comm_check(eng_pg* pg, const char* name, int kind, const eng_tensor* key, int local_err) {
  if (!check_on()) return 0; /* the caller's own exchange handles local_err */
  fprint f;
  /* the shards exchanged may differ in shape between ranks (uneven torch.chunk pieces): the exchange
   * checks them itself; the signature carries kind and dtype */
  fp_make(&f, pg, kind, 0, 0, NULL, local_err);
  f.dtype = key ? key->dtype : -1;
  if (debug_on()) debug_log(pg, name, &f);
  if (!check_run(pg, name, &f, local_err)) return 0;
  pg->seq++; /* as run() counts a failed collective (the caller counts a passed one) */
  return -1;
}

int eng_pg_agree(eng_pg* pg, int local_err, uint64_t key, const char* op) {
  return eng_pg_agree_max(pg, local_err, key, op, NULL, 0);
}

int eng_pg_agree_max(eng_pg* pg, int local_err, uint64_t key, const char* op, int64_t* vals, int n) {
  if (!op) op = "agreement";
  if (!pg) return eng_err("%s: process group is NULL", op);
  if (n < 0 || n > 64 || (n > 0 && !vals)) return eng_err("%s: agreement values: %d of at most 64, not NULL", op, n);
  if (!pg->member || pg->size < 2 || !eng_dist_is_initialized()) return local_err ? -1 : 0;
  fprint f;
  fp_make(&f, pg, KIND_AGREE, 0, 0, NULL, local_err ? (local_err == 2 ? 2 : 1) : 0);
  f.key = key;
  f.n_vals = n;
  snprintf(f.name, sizeof f.name, "%s", op);
  return check_run_vals(pg, op, &f, vals, n);
}

/* The check of one collective issued by run() (comm/process_group.c); rows: a gather's per-rank sizes or NULL. */
int comm_check_collective(eng_pg* pg, const char* name, int kind, int op, int root, const eng_tensor* key,
                          const int64_t* rows, int err, int on_cuda) {
  fprint f;
  fp_make(&f, pg, kind, op, root, key, err);
  if (rows && !err) { /* inputs differ in dim 0: the signature carries the sizes and the gathered shape */
    f.key = comm_fnv(rows, sizeof(int64_t) * (size_t)pg->size, COMM_FNV_SEED);
    int64_t total = 0;
    for (int i = 0; i < pg->size; i++) total += rows[i];
    if (f.ndim) f.shape[0] = total;
  }
  if (debug_on()) debug_log(pg, name, &f);
  return !err && check_deferred(on_cuda && kind != ENG_COLL_BARRIER) ? check_start(pg, name, &f)
                                                                     : check_run(pg, name, &f, err);
}

int eng_pg_report_error(eng_pg* pg, int kind, const char* msg) {
  eng_set_error_message(msg ? msg : "collective: invalid arguments");
  if (!pg || !pg->member || !check_on() || !eng_dist_is_initialized()) return -1;
  if (kind < 0 || kind >= ENG_NUM_COLL_KINDS) kind = ENG_COLL_BARRIER;
  fprint f;
  fp_make(&f, pg, kind, 0, 0, NULL, 1);
  check_run(pg, eng_coll_kind_name(kind), &f, 1);
  eng_set_error_message(msg ? msg : "collective: invalid arguments");
  pg->seq++;
  return -1;
}
