/* profiler.c: per-op host and GPU time (engine/include/eng/profiler.h says what it records).
 * Entries live in an open-addressing table keyed by name; an open region is a slot of a small stack (host start
 * time, the start event); GPU time comes from event pairs queued in a ring and resolved as they complete (polled at
 * each begin, without waiting) or at the report (waiting). */
#include "core/internal.h"
#include "core/device.h"
#include "eng/profiler.h"
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define TABLE 1024    /* entries (distinct names) */
#define DEPTH 64      /* nesting */
#define RING 8192     /* GPU event pairs in flight */

typedef struct { int entry; int64_t t0; void* ev0; } open_region;
typedef struct { int entry; void* a; void* b; } gpu_pair;

static int g_on, g_at_exit, g_registered, g_gpu = -1;
static eng_profile_entry g_tab[TABLE];
static int g_used[TABLE];
static int g_n;
static open_region g_stack[DEPTH];
static int g_depth;
static gpu_pair g_ring[RING];
static int g_head, g_tail; /* ring: [g_head, g_tail) pending */
static void* g_free[2 * RING];
static int g_nfree;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static uint64_t hash(const char* s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

static int entry_of(const char* name) {
  uint64_t h = hash(name);
  for (int k = 0; k < TABLE; k++) {
    int i = (int)((h + (uint64_t)k) % TABLE);
    if (!g_used[i]) {
      if (g_n >= TABLE - 1) return -1;
      g_used[i] = 1;
      g_n++;
      memset(&g_tab[i], 0, sizeof g_tab[i]);
      snprintf(g_tab[i].name, sizeof g_tab[i].name, "%s", name);
      return i;
    }
    if (!strncmp(g_tab[i].name, name, sizeof g_tab[i].name - 1)) return i;
  }
  return -1;
}

/* The device whose events time the ops (the first registered device with events that is available). */
static const eng_device_ops* g_dev;

static void* event_get(void) { return g_nfree ? g_free[--g_nfree] : g_dev->event_create(); }
static void event_put(void* e) {
  if (!e) return;
  if (g_nfree < 2 * RING) g_free[g_nfree++] = e;
  else g_dev->event_destroy(e);
}

/* resolve completed pairs from the oldest; wait: also the ones not complete yet */
static void resolve(int wait) {
  while (g_head != g_tail) {
    gpu_pair* p = &g_ring[g_head % RING];
    if (!wait && g_dev->event_query(p->b) != 1) break;
    double ms = g_dev->event_elapsed_ms(p->a, p->b);
    if (ms >= 0) { g_tab[p->entry].gpu_ns += (int64_t)(ms * 1e6); g_tab[p->entry].gpu_calls++; }
    event_put(p->a);
    event_put(p->b);
    g_head++;
  }
}

static int gpu_on(void) {
  /* only once a device is in use: a CPU run never creates a context for the profiler */
  if (g_gpu < 0) {
    g_gpu = 0;
    for (int d = 0; d < ENG_MAX_DEVICES && !g_gpu; d++) {
      const eng_device_ops* dv = eng_device_ops_of(d);
      if (dv && dv->event_create && dv->available()) { g_dev = dv; g_gpu = 1; }
    }
  }
  return g_gpu;
}

static void print_at_exit(void) {
  if (!g_at_exit) return;
  const char* e = getenv("ENGINE_PROFILE");
  int all = e && !strcmp(e, "all");
  if (!all && eng_process_rank() != 0) return;
  int64_t need = eng_profiler_report(NULL, 0);
  char* buf = malloc((size_t)need + 1);
  if (!buf) return;
  eng_profiler_report(buf, need + 1);
  fprintf(stderr, "%s", buf);
  fflush(stderr);
  free(buf);
}

int eng_profiler_enable(int on, int at_exit) {
  g_on = on ? 1 : 0;
  if (at_exit) {
    g_at_exit = 1;
    if (!g_registered) { atexit(print_at_exit); g_registered = 1; }
  }
  return 0;
}

int eng_profiler_enabled(void) { return g_on; }

void eng_profiler_reset(void) {
  resolve(1);
  memset(g_used, 0, sizeof g_used);
  g_n = 0;
  g_depth = 0;
}

int64_t eng_profiler_begin(const char* name) {
  if (!g_on || !name || g_depth >= DEPTH) return -1;
  int e = entry_of(name);
  if (e < 0) return -1;
  open_region* r = &g_stack[g_depth];
  r->entry = e;
  r->ev0 = NULL;
  if (gpu_on() && g_tail - g_head < RING) {
    if (g_head != g_tail) resolve(0);
    r->ev0 = event_get();
    if (r->ev0 && g_dev->event_record(r->ev0)) { event_put(r->ev0); r->ev0 = NULL; }
  }
  r->t0 = now_ns();
  return g_depth++;
}

void eng_profiler_end(int64_t token, int64_t bytes) {
  if (token < 0 || token != g_depth - 1) return;
  open_region* r = &g_stack[--g_depth];
  eng_profile_entry* e = &g_tab[r->entry];
  e->host_ns += now_ns() - r->t0;
  e->calls++;
  if (bytes > 0) e->bytes += bytes;
  if (r->ev0) {
    void* ev1 = event_get();
    if (ev1 && !g_dev->event_record(ev1) && g_tail - g_head < RING) {
      g_ring[g_tail % RING] = (gpu_pair){r->entry, r->ev0, ev1};
      g_tail++;
    } else {
      event_put(r->ev0);
      event_put(ev1);
    }
  }
}

static int by_total(const void* a, const void* b) {
  const eng_profile_entry *x = a, *y = b;
  int64_t tx = x->gpu_ns > 0 ? x->gpu_ns : x->host_ns, ty = y->gpu_ns > 0 ? y->gpu_ns : y->host_ns;
  return tx < ty ? 1 : tx > ty ? -1 : strcmp(x->name, y->name);
}

int eng_profiler_entries(eng_profile_entry* out, int cap) {
  resolve(1);
  eng_profile_entry* all = malloc(sizeof *all * (size_t)(g_n ? g_n : 1));
  if (!all) return eng_err("profiler: out of memory");
  int n = 0;
  for (int i = 0; i < TABLE; i++) if (g_used[i]) all[n++] = g_tab[i];
  qsort(all, (size_t)n, sizeof *all, by_total);
  for (int i = 0; i < n && i < cap && out; i++) out[i] = all[i];
  free(all);
  return n;
}

int64_t eng_profiler_report(char* buf, int64_t cap) {
  int n = eng_profiler_entries(NULL, 0);
  if (n < 0) return -1;
  eng_profile_entry* e = malloc(sizeof *e * (size_t)(n ? n : 1));
  if (!e) return eng_err("profiler: out of memory");
  eng_profiler_entries(e, n);
  int64_t host = 0, gpu = 0, calls = 0;
  for (int i = 0; i < n; i++) { host += e[i].host_ns; gpu += e[i].gpu_ns; calls += e[i].calls; }
  int64_t len = 0;
  eng_text_append(buf, cap, &len,
                  "profile (rank %d): %d ops, %lld calls, host %.3f ms, GPU %.3f ms (nested ops count in their "
      "callers too)\n", eng_process_rank(), n, (long long)calls, host / 1e6, gpu / 1e6);
  eng_text_append(buf, cap, &len, "%-36s %10s %12s %12s %10s %12s\n", "op", "calls", "GPU ms", "host ms", "host us",
                  "MiB out");
  for (int i = 0; i < n; i++)
    eng_text_append(buf, cap, &len, "%-36s %10lld %12.3f %12.3f %10.2f %12.2f\n", e[i].name, (long long)e[i].calls,
        e[i].gpu_ns / 1e6, e[i].host_ns / 1e6, e[i].calls ? e[i].host_ns / 1e3 / (double)e[i].calls : 0.0,
        e[i].bytes / 1048576.0);
  free(e);
  return len;
}
