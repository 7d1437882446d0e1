/* flight_recorder.c: what the process groups have issued.  Per-kind counters
 * (collectives and bytes, eng_comm_count) and the flight recorder: the last
 * HIST collectives of this rank with their group, sequence number, kind,
 * dtype, shape, op, root and state, kept for a dump (eng_comm_history_format),
 * for the reports of a failed signature check and for the goodbye a rank
 * sends when it ends (PyTorch's NCCL flight recorder). */
#include "comm/comm_impl.h"
#include "eng/comm.h"
#include <stdio.h>

/* ------------------------------------------------------------------ counters */
static int64_t g_counts[ENG_NUM_COLL_KINDS], g_bytes[ENG_NUM_COLL_KINDS];

int64_t eng_comm_count(int kind) { return kind >= 0 && kind < ENG_NUM_COLL_KINDS ? g_counts[kind] : 0; }
int64_t eng_comm_bytes(int kind) { return kind >= 0 && kind < ENG_NUM_COLL_KINDS ? g_bytes[kind] : 0; }
void eng_comm_reset_counts(void) {
  memset(g_counts, 0, sizeof g_counts);
  memset(g_bytes, 0, sizeof g_bytes);
}

void comm_count(int kind, int64_t bytes) {
  g_counts[kind]++;
  g_bytes[kind] += bytes;
}

/* ------------------------------------------------------------------ flight recorder */
#define HIST 64
static eng_coll_record g_hist[HIST];
static char g_hist_group[HIST][96];
static int64_t g_hist_n; /* records ever made */

int64_t comm_record_start(const eng_pg* pg, int64_t seq, int kind, int dtype, int op, int root, int ndim,
                          const int64_t* shape, int async) {
  int64_t id = g_hist_n++;
  eng_coll_record* r = &g_hist[id % HIST];
  memset(r, 0, sizeof *r);
  r->id = id; r->seq = seq; r->group_id = pg->id; r->group_size = pg->size;
  r->kind = kind; r->dtype = dtype; r->op = op; r->root = root; r->async = async;
  r->ndim = ndim;
  for (int d = 0; d < ndim && d < 8; d++) r->shape[d] = shape[d];
  r->state = 0;
  r->t_start = eng_time();
  snprintf(g_hist_group[id % HIST], sizeof g_hist_group[0], "%s", pg->name);
  return id;
}

void comm_record_end(int64_t id, int state) {
  if (id < 0 || id < g_hist_n - HIST) return; /* overwritten meanwhile */
  eng_coll_record* r = &g_hist[id % HIST];
  if (r->id != id) return;
  r->state = state;
  r->t_end = eng_time();
}

int64_t comm_account_begin(eng_pg* pg, int kind, const eng_tensor* key) {
  int64_t seq = pg->seq++;
  comm_count(kind, key ? key->numel * eng_dtype_size(key->dtype) : 0);
  return comm_record_start(pg, seq, kind, key ? key->dtype : -1, 0, 0, key ? key->ndim : 0, key ? key->shape : NULL, 0);
}

void comm_account_end(int64_t rec, int state) { comm_record_end(rec, state); }

void comm_account_undo(int kind, const eng_tensor* key) {
  g_counts[kind]--;
  g_bytes[kind] -= key ? key->numel * eng_dtype_size(key->dtype) : 0;
}

int eng_comm_history_len(void) { return (int)(g_hist_n < HIST ? g_hist_n : HIST); }

static int hist_slot(int i) {
  int len = eng_comm_history_len();
  if (i < 0 || i >= len) return -1;
  return (int)((g_hist_n - len + i) % HIST);
}

int eng_comm_history_get(int i, eng_coll_record* out) {
  int s = hist_slot(i);
  if (s < 0) return eng_err("comm history: index %d out of range (%d records)", i, eng_comm_history_len());
  *out = g_hist[s];
  return 0;
}

const char* eng_comm_history_group_name(int i) {
  int s = hist_slot(i);
  return s < 0 ? "?" : g_hist_group[s];
}

static const char* state_name(int s) { return s == 0 ? "issued" : s == 1 ? "completed" : "failed"; }

static int format_record(char* b, int cap, const eng_coll_record* r, const char* group) {
  int k = snprintf(b, cap, "  #%lld %s seq %lld %s%s%s%s", (long long)r->id, group, (long long)r->seq,
                   eng_coll_kind_name(r->kind) ? eng_coll_kind_name(r->kind) : "?",
                   r->kind == ENG_COLL_BARRIER ? "" : " ",
                   r->kind == ENG_COLL_BARRIER ? "" : (eng_dtype_name(r->dtype) ? eng_dtype_name(r->dtype) : "?"),
                   r->kind == ENG_COLL_BARRIER ? "" : eng_shape_str(r->ndim, r->shape));
  if (k < cap && (r->kind == ENG_COLL_ALL_REDUCE || r->kind == ENG_COLL_REDUCE_SCATTER))
    k += snprintf(b + k, cap - k, " op=%s", eng_reduce_op_name(r->op) ? eng_reduce_op_name(r->op) : "?");
  if (k < cap && comm_kind_rooted(r->kind)) k += snprintf(b + k, cap - k, " root=%d", r->root);
  if (k < cap)
    k += snprintf(b + k, cap - k, "%s %s", r->async ? " async" : "", state_name(r->state));
  if (k < cap && r->state != 0) k += snprintf(b + k, cap - k, " %.3f ms", 1e3 * (r->t_end - r->t_start));
  if (k < cap) k += snprintf(b + k, cap - k, "\n");
  return k < cap ? k : cap;
}

static char g_fmt[HIST * 192 + 256];

const char* eng_comm_history_format(int max_entries) {
  int len = eng_comm_history_len();
  int n = max_entries <= 0 || max_entries > len ? len : max_entries;
  int k = snprintf(g_fmt, sizeof g_fmt, "collective flight recorder, rank %d: last %d of %lld collectives, oldest first%s\n",
                   comm_world_rank(), n, (long long)g_hist_n, n ? ":" : "");
  for (int i = len - n; i < len && k < (int)sizeof g_fmt - 1; i++) {
    int s = hist_slot(i);
    k += format_record(g_fmt + k, (int)sizeof g_fmt - k, &g_hist[s], g_hist_group[s]);
  }
  return g_fmt;
}

/* Appends the most recent records to the current error message. */
void comm_err_append_history(void) {
  char buf[2048];
  const char* h = eng_comm_history_format(6);
  snprintf(buf, sizeof buf, "%s\n%s", eng_last_error(), h);
  size_t n = strlen(buf);
  if (n && buf[n - 1] == '\n') buf[n - 1] = 0;
  eng_set_error_message(buf);
}

/* This rank's last n collectives, one line each (oldest first). */
void comm_recent_text(char* b, int cap, int n) {
  int len = eng_comm_history_len(), k = 0;
  b[0] = 0;
  if (len == 0) { snprintf(b, cap, "  (none)\n"); return; }
  for (int i = len > n ? len - n : 0; i < len && k < cap - 1; i++) {
    int s = hist_slot(i);
    k += format_record(b + k, cap - k, &g_hist[s], g_hist_group[s]);
  }
}

int64_t comm_record_total(void) { return g_hist_n; }
