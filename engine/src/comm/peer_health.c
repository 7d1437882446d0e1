/* peer_health.c: which peers have ended, and what each peer waits for.
 *
 * Ended peers: every rank listens on a dup of the world for a goodbye (its
 * last collectives as text) that a rank sends when it finalizes MPI
 * (comm_say_goodbye), so that a rank waiting for an ended peer in a
 * signature check fails with that peer's last collectives instead of
 * hanging (comm/signature_check.c asks here).
 *
 * The watchdog (PyTorch's flight recorder and watchdog, at the level of the
 * world): on the same channel, a rank that has waited in a signature check or
 * agreement for ENGINE_COMM_WATCHDOG seconds (default 1) sends every other
 * rank a record of what it waits for (the group, by its key and members, the
 * number of the control operation on it, a description), and a "cleared"
 * record when that wait ends.  Nothing is sent while collectives complete
 * in time, so a training step pays nothing.  From the records it holds, a
 * waiting rank builds the wait-for graph: a waiting rank waits for the
 * members of its group that are not waiting in the same operation; a rank
 * with no record may still come (it is computing, or in a call without a
 * check), a rank waiting for a rank that can never come can never go on.
 * When this rank is among those that can never go on and that has held for
 * half a second (records in flight settle), it fails with a verdict naming
 * what each of them waits for and sends the verdict to every rank: the
 * others of the cycle raise the same error, and every group named in it
 * refuses later calls (its control exchange stays pending: it cannot be
 * used again).  Records from an operation this rank has already completed
 * on the same group are stale and ignored.  Only the main thread calls MPI
 * here (MPI_THREAD_FUNNELED). */
#include "comm/comm_impl.h"
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <unistd.h>

#define BYE_TAG 7
#define BYE_LEN 1024
static MPI_Comm g_bye_comm = MPI_COMM_NULL;
static MPI_Request g_bye_req = MPI_REQUEST_NULL;
static char g_bye_buf[BYE_LEN];
static char** g_ended; /* per world rank: its goodbye text, NULL while running */
static int g_world_n;

static void bye_listen(void) {
  if (g_bye_comm == MPI_COMM_NULL) return;
  if (MPI_Irecv(g_bye_buf, BYE_LEN, MPI_CHAR, MPI_ANY_SOURCE, BYE_TAG, g_bye_comm, &g_bye_req) != MPI_SUCCESS)
    g_bye_req = MPI_REQUEST_NULL;
}

/* ------------------------------------------------------------------ the watchdog's records */
#define WD_TAG 8
#define WD_MAXMEM 160 /* members listed in a record (a larger group's record lists none: no edges from it) */
#define WD_MAXV 48    /* ranks named in a verdict */
#define WD_TEXT 1800
enum { WD_WAIT = 1, WD_CLEAR = 2, WD_VERDICT = 3 };

typedef struct wd_rec { /* what one rank waits for */
  int32_t type, rank;
  int64_t epoch;        /* the rank's wait counter */
  uint64_t gkey;        /* eng_pg.key */
  int64_t nctl;         /* the control operation's number on the group */
  int32_t nmem, pad;
  char desc[240];       /* e.g. "#3 all_reduce f32[2] op=sum on group world" */
  int32_t mem[WD_MAXMEM];
} wd_rec;

typedef struct wd_verdict {
  int32_t type, rank, n, pad;
  struct { int32_t rank, pad; uint64_t gkey; int64_t nctl; } e[WD_MAXV];
  char text[WD_TEXT];
} wd_verdict;

#define WD_BUF 4096 /* under Open MPI's eager limits (vader 4 KiB): sent without a matching receive */
_Static_assert(sizeof(wd_rec) <= WD_BUF && sizeof(wd_verdict) <= WD_BUF, "watchdog records must be sent eagerly");

static double g_wd_after = -1;      /* seconds of waiting before a record is sent; 0: off; -1: not read yet */
static MPI_Request g_wd_req = MPI_REQUEST_NULL;
static char g_wd_buf[WD_BUF];
static wd_rec* g_st;                /* per world rank: its last record (type WD_WAIT while it waits) */
static wd_rec g_me;                 /* this rank's wait */
static eng_pg* g_me_pg;
static int g_waiting, g_published;
static int64_t g_epoch;
static double g_next_eval, g_cycle_since;
static uint64_t g_cycle_hash;

typedef struct wd_out { void* buf; MPI_Request* rq; int n; } wd_out;
#define WD_OUT 32
static wd_out g_out[WD_OUT];

static double wd_after(void) {
  if (g_wd_after < 0) {
    const char* e = getenv("ENGINE_COMM_WATCHDOG");
    double v = e && *e ? atof(e) : 1.0;
    g_wd_after = v > 0 ? v : 0;
  }
  return g_wd_after;
}

int eng_comm_set_watchdog(double seconds) {
  if (!(seconds >= 0)) return eng_err("comm watchdog: seconds must be >= 0 (0 turns it off), got %g", seconds);
  g_wd_after = seconds;
  return 0;
}
double eng_comm_get_watchdog(void) { return wd_after(); }

static void wd_listen(void) {
  if (g_bye_comm == MPI_COMM_NULL) return;
  if (MPI_Irecv(g_wd_buf, WD_BUF, MPI_BYTE, MPI_ANY_SOURCE, WD_TAG, g_bye_comm, &g_wd_req) != MPI_SUCCESS)
    g_wd_req = MPI_REQUEST_NULL;
}

/* Completes the sends that have gone out; 1 when slot i is free. */
static int out_free(int i) {
  wd_out* o = &g_out[i];
  if (!o->buf) return 1;
  int flag = 0;
  if (MPI_Testall(o->n, o->rq, &flag, MPI_STATUSES_IGNORE) != MPI_SUCCESS) flag = 1;
  if (!flag) return 0;
  free(o->buf); free(o->rq);
  o->buf = NULL; o->rq = NULL; o->n = 0;
  return 1;
}

/* Sends n bytes to every other world rank (not waiting for them). */
static void wd_send_all(const void* msg, int n) {
  if (g_bye_comm == MPI_COMM_NULL) return;
  int slot = -1;
  for (int i = 0; i < WD_OUT && slot < 0; i++) if (out_free(i)) slot = i;
  void* buf = malloc((size_t)n);
  MPI_Request* rq = malloc(sizeof *rq * (size_t)g_world_n);
  if (!buf || !rq) { free(buf); free(rq); return; }
  memcpy(buf, msg, (size_t)n);
  int k = 0, me = comm_world_rank();
  for (int r = 0; r < g_world_n; r++)
    if (r != me && MPI_Isend(buf, n, MPI_BYTE, r, WD_TAG, g_bye_comm, &rq[k]) == MPI_SUCCESS) k++;
  if (slot >= 0) { g_out[slot].buf = buf; g_out[slot].rq = rq; g_out[slot].n = k; }
  /* else: every slot still sending (peers not progressing): the buffers stay with MPI */
}

/* 1 once this rank made or received a watchdog verdict (eng_dist_abort_grace) */
static int g_had_verdict;

/* Seconds a failing rank waits before it ends the job (bindings/host.c): a verdict goes to every rank it names, and
 * each raises it within a poll or two (50 ms each); ending the job at once would kill them before they print it. */
double eng_dist_abort_grace(void) { return __atomic_load_n(&g_had_verdict, __ATOMIC_RELAXED) ? 1.0 : 0.0; }

static void mark_dead(eng_pg* pg, const char* text) {
  __atomic_store_n(&g_had_verdict, 1, __ATOMIC_RELAXED);
  if (!pg || pg->broken) return;
  pg->broken = 2;
  free(pg->broken_msg);
  pg->broken_msg = strdup(text);
}

static void wd_take(const char* buf, int src) {
  int32_t type;
  memcpy(&type, buf, sizeof type);
  if (!g_st || src < 0 || src >= g_world_n) return;
  if (type == WD_WAIT) {
    const wd_rec* r = (const wd_rec*)buf;
    if (r->epoch >= g_st[src].epoch) g_st[src] = *r;
  } else if (type == WD_CLEAR) {
    const wd_rec* r = (const wd_rec*)buf;
    if (r->epoch >= g_st[src].epoch) { g_st[src].type = 0; g_st[src].epoch = r->epoch; }
  } else if (type == WD_VERDICT) {
    const wd_verdict* v = (const wd_verdict*)buf;
    char text[WD_TEXT];
    snprintf(text, sizeof text, "%s", v->text);
    for (int i = 0; i < v->n && i < WD_MAXV; i++) mark_dead(comm_pg_find(v->e[i].gkey), text);
  }
}

static void last_words(int sig);

void comm_peers_listen(void) {
  if (g_bye_comm != MPI_COMM_NULL) return;
  MPI_Comm_size(MPI_COMM_WORLD, &g_world_n);
  if (g_world_n < 2) return;
  if (MPI_Comm_dup(MPI_COMM_WORLD, &g_bye_comm) != MPI_SUCCESS) { g_bye_comm = MPI_COMM_NULL; return; }
  MPI_Comm_set_errhandler(g_bye_comm, MPI_ERRORS_RETURN);
  g_ended = calloc((size_t)g_world_n, sizeof *g_ended);
  g_st = calloc((size_t)g_world_n, sizeof *g_st);
  bye_listen();
  wd_listen();
  /* a rank stuck in compute says where it stands when the launcher ends the job (after another rank's
   * timeout or failure), instead of vanishing without a word */
  struct sigaction old;
  if (sigaction(SIGTERM, NULL, &old) == 0 && old.sa_handler == SIG_DFL) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = last_words;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND;
    sigaction(SIGTERM, &sa, NULL);
  }
}

/* SIGTERM (mpirun ending the job): what this rank was doing, then the default action.  Formatting here is
 * not async-signal-safe in the strict sense (snprintf into static buffers, no allocation); the process is
 * ending either way. */
static void last_words(int sig) {
  static char b[16384];
  int k = snprintf(b, sizeof b, "\n[rank %d] ended by signal %d (the launcher ends the job: another rank failed or "
                   "timed out); this rank %s%s\n", comm_world_rank(), sig,
                   g_waiting ? "waits in " : "waits in no collective's check (it computes, is stuck outside the comm "
                   "layer, or is in a data transfer)", g_waiting ? g_me.desc : "");
  if (k > 0 && k < (int)sizeof b) snprintf(b + k, sizeof b - (size_t)k, "%s", eng_comm_history_format(8));
  ssize_t w = write(2, b, strlen(b));
  (void)w;
  raise(sig); /* SA_RESETHAND: the default action now */
}

void comm_peers_poll(void) {
  while (g_bye_req != MPI_REQUEST_NULL) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Test(&g_bye_req, &flag, &st) != MPI_SUCCESS || !flag) break;
    int src = st.MPI_SOURCE;
    g_bye_buf[BYE_LEN - 1] = 0;
    if (g_ended && src >= 0 && src < g_world_n && !g_ended[src]) g_ended[src] = strdup(g_bye_buf);
    bye_listen();
  }
  while (g_wd_req != MPI_REQUEST_NULL) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Test(&g_wd_req, &flag, &st) != MPI_SUCCESS || !flag) return;
    wd_take(g_wd_buf, st.MPI_SOURCE);
    wd_listen();
  }
}

void comm_say_goodbye(void) {
  comm_check_finish_all();
  if (g_bye_comm == MPI_COMM_NULL) return;
  char text[BYE_LEN];
  int me = comm_world_rank();
  int k = snprintf(text, sizeof text, "last collectives of rank %d (%lld in all):\n", me, (long long)comm_record_total());
  if (k < (int)sizeof text) comm_recent_text(text + k, (int)sizeof text - k, 4);
  MPI_Request* rq = malloc(sizeof(MPI_Request) * (size_t)g_world_n);
  int n = 0;
  for (int r = 0; rq && r < g_world_n; r++)
    if (r != me && MPI_Isend(text, (int)strlen(text) + 1, MPI_CHAR, r, BYE_TAG, g_bye_comm, &rq[n]) == MPI_SUCCESS) n++;
  if (rq) MPI_Waitall(n, rq, MPI_STATUSES_IGNORE); /* small: sent eagerly, no receiver needed */
  free(rq);
  if (g_bye_req != MPI_REQUEST_NULL) {
    MPI_Cancel(&g_bye_req);
    MPI_Wait(&g_bye_req, MPI_STATUS_IGNORE);
  }
  if (g_wd_req != MPI_REQUEST_NULL) {
    MPI_Cancel(&g_wd_req);
    MPI_Wait(&g_wd_req, MPI_STATUS_IGNORE);
  }
  g_bye_comm = MPI_COMM_NULL; /* not freed: goodbyes from the others may still arrive */
}

/* A member of pg that has ended, or -1. */
int comm_peer_ended(const eng_pg* pg) {
  if (!g_ended) return -1;
  for (int i = 0; i < pg->size; i++)
    if (pg->ranks[i] >= 0 && pg->ranks[i] < g_world_n && g_ended[pg->ranks[i]]) return pg->ranks[i];
  return -1;
}

const char* comm_peer_goodbye(int world_rank) {
  return g_ended && world_rank >= 0 && world_rank < g_world_n ? g_ended[world_rank] : NULL;
}

/* ------------------------------------------------------------------ the watchdog's verdict */
void comm_wd_begin(eng_pg* pg, const char* what) {
  if (!wd_after() || !g_st || g_world_n < 2) return;
  memset(&g_me, 0, sizeof g_me);
  g_me.type = WD_WAIT;
  g_me.rank = comm_world_rank();
  g_me.epoch = ++g_epoch;
  g_me.gkey = pg->key;
  g_me.nctl = pg->nctl - 1; /* the operation just begun */
  g_me.nmem = pg->size <= WD_MAXMEM ? pg->size : 0;
  for (int i = 0; i < g_me.nmem; i++) g_me.mem[i] = pg->ranks[i];
  snprintf(g_me.desc, sizeof g_me.desc, "%s on group %s", what, pg->name);
  g_me_pg = pg;
  g_waiting = 1;
  g_published = 0;
  g_next_eval = 0;
  g_cycle_hash = 0;
}

void comm_wd_end(void) {
  if (!g_waiting) return;
  g_waiting = 0;
  g_me_pg = NULL;
  if (g_published) {
    wd_rec c;
    memset(&c, 0, sizeof c);
    c.type = WD_CLEAR; c.rank = g_me.rank; c.epoch = g_me.epoch;
    wd_send_all(&c, (int)offsetof(wd_rec, desc));
  }
  g_published = 0;
}

/* The record of world rank x while it waits (this rank's own included), or NULL: stale records (an
 * operation this rank has completed on a group it belongs to) do not count. */
static const wd_rec* waits(int x) {
  if (x == g_me.rank) return &g_me;
  const wd_rec* r = &g_st[x];
  if (r->type != WD_WAIT) return NULL;
  eng_pg* pg = comm_pg_find(r->gkey);
  if (pg) {
    int64_t done = pg->nctl - (pg == g_me_pg ? 1 : 0);
    if (done > r->nctl) return NULL;
  }
  return r;
}

static int same_op(const wd_rec* a, const wd_rec* b) { return a && b && a->gkey == b->gkey && a->nctl == b->nctl; }

/* The ranks that can never go on (dead[x]); 1 when this rank is one of them. */
static int find_dead(char* dead) {
  int n = g_world_n;
  for (int x = 0; x < n; x++) dead[x] = waits(x) != NULL;
  for (int changed = 1; changed;) {
    changed = 0;
    for (int x = 0; x < n; x++) {
      if (!dead[x]) continue;
      const wd_rec* r = waits(x);
      int blocked = 0;
      for (int i = 0; i < r->nmem && !blocked; i++) {
        int y = r->mem[i];
        if (y == x || y < 0 || y >= n) continue;
        blocked = dead[y] && !same_op(waits(y), r); /* y waits elsewhere, for ever */
      }
      if (!blocked) { dead[x] = 0; changed = 1; }
    }
  }
  return dead[g_me.rank];
}

static void verdict_text(const char* dead, wd_verdict* v) {
  int n = g_world_n, k = 0, cap = (int)sizeof v->text;
  k += snprintf(v->text, cap, "deadlock across groups (found by the comm watchdog, ENGINE_COMM_WATCHDOG): ranks wait "
                "in collectives of different groups and none of them can go on:");
  v->n = 0;
  for (int x = 0; x < n; x++) {
    if (!dead[x]) continue;
    const wd_rec* r = waits(x);
    if (v->n < WD_MAXV) {
      v->e[v->n].rank = x; v->e[v->n].gkey = r->gkey; v->e[v->n].nctl = r->nctl;
      v->n++;
    }
    if (k < cap) k += snprintf(v->text + k, cap - k, "%s rank %d waits in %s for rank", v->n > 1 ? ";" : "", x, r->desc);
    int first = 1, shown = 0, missing = 0;
    for (int i = 0; i < r->nmem; i++) missing += r->mem[i] != x && !same_op(waits(r->mem[i]), r);
    for (int i = 0; i < r->nmem && k < cap; i++) {
      int y = r->mem[i];
      if (y == x || same_op(waits(y), r)) continue;
      if (shown++ < 8) {
        if (first) k += snprintf(v->text + k, cap - k, "%s %d", missing > 1 ? "s" : "", y);
        else k += snprintf(v->text + k, cap - k, ",%d", y);
      }
      first = 0;
    }
    if (shown > 8 && k < cap) k += snprintf(v->text + k, cap - k, " (+%d)", shown - 8);
    for (int i = 0; i < r->nmem && k < cap; i++) {
      int y = r->mem[i];
      if (y == x || y < 0 || y >= n || same_op(waits(y), r) || dead[y]) continue;
      k += snprintf(v->text + k, cap - k, " (rank %d waits in nothing)", y);
    }
  }
  if (k < cap)
    snprintf(v->text + k, cap - k, ". Every rank must reach the collectives of each group in the same order (a rank "
             "that skipped one, after an error caught by pcall or a forward run on some ranks only, waits elsewhere); "
             "the groups named are unusable from now on");
}

int comm_wd_poll(eng_pg* pg, double waited) {
  if (!g_waiting || pg != g_me_pg) return 0;
  if (pg->broken == 2) /* a verdict from another rank names this group */
    return eng_set_error_message(pg->broken_msg ? pg->broken_msg : "deadlock across groups");
  double after = wd_after();
  if (!after || waited < after) return 0;
  if (!g_published) {
    wd_send_all(&g_me, (int)sizeof g_me);
    g_published = 1;
  }
  double now = eng_time();
  if (now < g_next_eval) return 0;
  g_next_eval = now + 0.05;
  comm_peers_poll();
  if (pg->broken == 2) return eng_set_error_message(pg->broken_msg ? pg->broken_msg : "deadlock across groups");
  char* dead = calloc((size_t)g_world_n, 1);
  if (!dead) return 0;
  if (!find_dead(dead)) { free(dead); g_cycle_hash = 0; return 0; }
  uint64_t h = COMM_FNV_SEED;
  for (int x = 0; x < g_world_n; x++)
    if (dead[x]) { const wd_rec* r = waits(x); h = comm_fnv(&x, sizeof x, comm_fnv(&r->gkey, 16, h)); }
  if (h != g_cycle_hash) { g_cycle_hash = h; g_cycle_since = now; free(dead); return 0; }
  if (now - g_cycle_since < 0.5) { free(dead); return 0; }
  wd_verdict* v = calloc(1, sizeof *v);
  if (!v) { free(dead); return 0; }
  v->type = WD_VERDICT;
  v->rank = comm_world_rank();
  verdict_text(dead, v);
  free(dead);
  wd_send_all(v, (int)sizeof *v);
  for (int i = 0; i < v->n; i++) mark_dead(comm_pg_find(v->e[i].gkey), v->text);
  mark_dead(pg, v->text);
  eng_set_error_message(v->text);
  free(v);
  return -1;
}

int comm_wd_straggler_text(const eng_pg* pg, char* b, int cap) {
  b[0] = 0;
  if (!g_st || !pg->member || !g_waiting || !wd_after()) return 0;
  comm_peers_poll();
  int idle = 0, me = comm_world_rank();
  for (int i = 0; i < pg->size; i++) {
    int x = pg->ranks[i];
    if (x == me || x < 0 || x >= g_world_n) continue;
    if (g_ended && g_ended[x]) continue;
    if (g_st[x].type == WD_WAIT) {
      /* a lower rank waiting in this same operation reports instead */
      if (x < me && g_st[x].gkey == g_me.gkey && g_st[x].nctl == g_me.nctl) return 0;
    } else idle++;
  }
  if (!idle) return 0;
  comm_wd_members_text(pg, b, cap);
  return b[0] != 0;
}

void comm_wd_members_text(const eng_pg* pg, char* b, int cap) {
  int k = 0;
  b[0] = 0;
  if (!g_st || !pg->member) return;
  comm_peers_poll();
  for (int i = 0; i < pg->size && k < cap - 1; i++) {
    int x = pg->ranks[i];
    if (x == comm_world_rank() || x < 0 || x >= g_world_n) continue;
    if (g_ended && g_ended[x]) k += snprintf(b + k, cap - k, "  rank %d: has ended\n", x);
    else if (g_st[x].type == WD_WAIT) k += snprintf(b + k, cap - k, "  rank %d: waits in %s\n", x, g_st[x].desc);
    else if (wd_after())
      k += snprintf(b + k, cap - k, "  rank %d: waits in no collective (computing or stuck outside the comm layer, "
                    "or in a data transfer)\n", x);
  }
  if (k && k < cap) {
    char head[64];
    snprintf(head, sizeof head, "what the other members of %s do:\n", pg->name);
    int hl = (int)strlen(head);
    if (k + hl < cap) { memmove(b + hl, b, (size_t)k + 1); memcpy(b, head, (size_t)hl); }
  }
}
