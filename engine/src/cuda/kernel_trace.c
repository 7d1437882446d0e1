/* kernel_trace.c: every kernel, memcpy and memset the GPU runs, with its own GPU time, from CUPTI's activity API
 * (eng/cuda.h: eng_cuda_kernel_trace_*).  The op profiler (core/profiler.c) times each op between two events on the
 * compute stream, which also counts the gaps where the GPU waits for the host; this trace is what nsys's
 * "cuda_gpu_kern_sum" shows: per kernel name, the launches, the summed GPU time, the mean and the extremes, sorted by
 * total.  ENGINE_PROFILE_KERNELS=1 starts it when the device is first initialised and prints the table on stderr at
 * exit (rank 0; =all: every rank).
 *
 * libcupti is loaded at run time (dlopen "libcupti.so.<CUDA major>", then "libcupti.so"; ENGINE_CUPTI_LIB names
 * another file), so the engine does not link it and runs where it is missing (the start then reports why).  The
 * records' layout is the one of the CUPTI headers this file was built with: load the libcupti of the same CUDA
 * major version.  Records arrive in buffers CUPTI hands back from its own thread (bufferCompleted); they are folded
 * into a table by name under a mutex.  At exit (an atexit handler registered after CUDA's and CUPTI's own, so it
 * runs before them) the device is synchronised and the buffers flushed. */
#include "core/internal.h"
#include "eng/cuda.h"
#include "cuda/cuda_runtime.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(ENG_HAVE_CUDA) && defined(__has_include)
#if __has_include(<cupti_activity.h>)
#define ENG_HAVE_CUPTI 1
#endif
#endif

#ifdef ENG_HAVE_CUPTI
#include <cupti_activity.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pthread.h>

#define KT_TABLE 4096
#define KT_NAME 160
#define KT_BUF (8u << 20)

typedef struct {
  char name[KT_NAME];
  int kind; /* 0 kernel, 1 memcpy, 2 memset */
  int64_t calls, ns, min_ns, max_ns, bytes;
} kt_entry;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static kt_entry* g_tab;
static int g_n, g_on, g_exit_registered, g_dropped;
static int64_t g_records;
static char g_why[256];

static CUptiResult (*p_enable)(CUpti_ActivityKind);
static CUptiResult (*p_disable)(CUpti_ActivityKind);
static CUptiResult (*p_register)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc);
static CUptiResult (*p_flush)(uint32_t);
static CUptiResult (*p_next)(uint8_t*, size_t, CUpti_Activity**);
static CUptiResult (*p_result_string)(CUptiResult, const char**);

/* C++ names demangled when the C++ runtime is in the process (it is: the CUDA kernels' library needs it) */
extern char* __cxa_demangle(const char* mangled, char* buf, size_t* n, int* status) __attribute__((weak));

static uint64_t kt_hash(const char* s, int kind) {
  uint64_t h = 1469598103934665603ull ^ (uint64_t)kind;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

/* the entry of (name, kind), created when new; NULL when the table is full (counted as dropped) */
static kt_entry* kt_entry_of(const char* name, int kind) {
  uint64_t h = kt_hash(name, kind);
  for (int k = 0; k < KT_TABLE; k++) {
    kt_entry* e = &g_tab[(h + (uint64_t)k) % KT_TABLE];
    if (!e->calls && !e->name[0]) {
      if (g_n >= KT_TABLE - 1) return NULL;
      g_n++;
      snprintf(e->name, sizeof e->name, "%s", name);
      e->kind = kind;
      e->min_ns = INT64_MAX;
      return e;
    }
    if (e->kind == kind && !strncmp(e->name, name, KT_NAME - 1)) return e;
  }
  return NULL;
}

static void kt_add(const char* name, int kind, uint64_t start, uint64_t end, int64_t bytes) {
  kt_entry* e = kt_entry_of(name, kind);
  if (!e) { g_dropped++; return; }
  int64_t d = end > start ? (int64_t)(end - start) : 0;
  e->calls++;
  e->ns += d;
  e->bytes += bytes;
  if (d < e->min_ns) e->min_ns = d;
  if (d > e->max_ns) e->max_ns = d;
}

static const char* copy_kind(int k) {
  switch (k) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "[memcpy HtoD]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "[memcpy DtoH]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "[memcpy DtoD]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "[memcpy HtoH]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "[memcpy PtoP]";
    default: return "[memcpy]";
  }
}

static void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = aligned_alloc(8, KT_BUF);
  *size = *buffer ? KT_BUF : 0;
  *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t* buffer, size_t size, size_t valid) {
  (void)ctx; (void)stream; (void)size;
  if (!buffer) return;
  pthread_mutex_lock(&g_mu);
  CUpti_Activity* r = NULL;
  while (valid > 0 && p_next(buffer, valid, &r) == CUPTI_SUCCESS) {
    g_records++;
    if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || r->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const CUpti_ActivityKernel10* k = (const CUpti_ActivityKernel10*)r;
      kt_add(k->name ? k->name : "(unnamed kernel)", 0, k->start, k->end, 0);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const CUpti_ActivityMemcpy6* m = (const CUpti_ActivityMemcpy6*)r;
      kt_add(copy_kind(m->copyKind), 1, m->start, m->end, (int64_t)m->bytes);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const CUpti_ActivityMemset4* m = (const CUpti_ActivityMemset4*)r;
      kt_add("[memset]", 2, m->start, m->end, (int64_t)m->bytes);
    }
  }
  pthread_mutex_unlock(&g_mu);
  free(buffer);
}

static int kt_fail(const char* what, CUptiResult rc) {
  const char* s = NULL;
  if (p_result_string) p_result_string(rc, &s);
  snprintf(g_why, sizeof g_why, "kernel trace: %s failed: %s (CUPTI error %d)", what, s ? s : "unknown", (int)rc);
  return eng_err("%s", g_why);
}

static void* kt_open(void) {
  const char* env = getenv("ENGINE_CUPTI_LIB");
  if (env && *env) return dlopen(env, RTLD_NOW | RTLD_LOCAL);
  char name[64];
  snprintf(name, sizeof name, "libcupti.so.%d", CUDART_VERSION / 1000);
  void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  return h ? h : dlopen("libcupti.so", RTLD_NOW | RTLD_LOCAL);
}

static void kt_at_exit(void) {
  if (!g_on) return;
  const char* e = getenv("ENGINE_PROFILE_KERNELS");
  int all = e && !strcmp(e, "all");
  if (!all && eng_process_rank() > 0) { g_on = 0; return; }
  int64_t need = eng_cuda_kernel_trace_report(NULL, 0);
  char* buf = need > 0 ? malloc((size_t)need + 1) : NULL;
  if (buf) {
    eng_cuda_kernel_trace_report(buf, need + 1);
    fprintf(stderr, "%s", buf);
    fflush(stderr);
    free(buf);
  }
  g_on = 0;
}

int eng_cuda_kernel_trace_start(void) {
  if (g_on) return 0;
  if (!eng_cuda_is_available()) return eng_err("kernel trace: %s", eng_cuda_unavailable_reason());
  void* h = kt_open();
  if (!h)
    return eng_err("kernel trace: libcupti could not be loaded (%s); put the CUDA toolkit's or PyTorch's "
                   "libcupti.so.%d on LD_LIBRARY_PATH or name it in ENGINE_CUPTI_LIB", dlerror(),
                   CUDART_VERSION / 1000);
  *(void**)&p_enable = dlsym(h, "cuptiActivityEnable");
  *(void**)&p_disable = dlsym(h, "cuptiActivityDisable");
  *(void**)&p_register = dlsym(h, "cuptiActivityRegisterCallbacks");
  *(void**)&p_flush = dlsym(h, "cuptiActivityFlushAll");
  *(void**)&p_next = dlsym(h, "cuptiActivityGetNextRecord");
  *(void**)&p_result_string = dlsym(h, "cuptiGetResultString");
  if (!p_enable || !p_disable || !p_register || !p_flush || !p_next)
    return eng_err("kernel trace: the loaded libcupti lacks the activity API (cuptiActivityEnable ...)");
  pthread_mutex_lock(&g_mu);
  if (!g_tab) g_tab = calloc(KT_TABLE, sizeof *g_tab);
  pthread_mutex_unlock(&g_mu);
  if (!g_tab) return eng_err("kernel trace: out of memory");
  if (eng_cuda_synchronize()) return -1; /* the device initialised before the callbacks */
  CUptiResult rc = p_register(buffer_requested, buffer_completed);
  if (rc != CUPTI_SUCCESS) return kt_fail("cuptiActivityRegisterCallbacks", rc);
  rc = p_enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  if (rc != CUPTI_SUCCESS) return kt_fail("cuptiActivityEnable(CONCURRENT_KERNEL)", rc);
  if ((rc = p_enable(CUPTI_ACTIVITY_KIND_MEMCPY)) != CUPTI_SUCCESS) return kt_fail("cuptiActivityEnable(MEMCPY)", rc);
  if ((rc = p_enable(CUPTI_ACTIVITY_KIND_MEMSET)) != CUPTI_SUCCESS) return kt_fail("cuptiActivityEnable(MEMSET)", rc);
  g_on = 1;
  if (!g_exit_registered) { atexit(kt_at_exit); g_exit_registered = 1; }
  return 0;
}

int eng_cuda_kernel_trace_active(void) { return g_on; }

/* everything the device has done so far folded into the table */
static void kt_flush(void) {
  if (!g_on) return;
  cudaDeviceSynchronize();
  p_flush(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
}

void eng_cuda_kernel_trace_reset(void) {
  kt_flush();
  pthread_mutex_lock(&g_mu);
  if (g_tab) memset(g_tab, 0, KT_TABLE * sizeof *g_tab);
  g_n = 0; g_dropped = 0; g_records = 0;
  pthread_mutex_unlock(&g_mu);
}

static int by_total(const void* a, const void* b) {
  const kt_entry *x = a, *y = b;
  return x->ns < y->ns ? 1 : x->ns > y->ns ? -1 : strcmp(x->name, y->name);
}

/* the kernel's name for the table: demangled, without its return type, its parameter list and "(anonymous
 * namespace)::", at most w - 1 characters (cut with "...") */
static void short_name(const char* raw, char* out, size_t w) {
  char* dem = NULL;
  int st = -1;
  if (__cxa_demangle && raw[0] == '_' && raw[1] == 'Z') dem = __cxa_demangle(raw, NULL, NULL, &st);
  const char* s = dem && st == 0 ? dem : raw;
  char tmp[1024];
  size_t n = 0;
  static const char anon[] = "(anonymous namespace)::";
  for (const char* p = s; *p && n + 1 < sizeof tmp;) { /* drop every "(anonymous namespace)::" */
    if (!strncmp(p, anon, sizeof anon - 1)) { p += sizeof anon - 1; continue; }
    tmp[n++] = *p++;
  }
  tmp[n] = 0;
  /* the parameter list: the '(' that matches a final ')' (kernels return void: no trailing qualifiers) */
  if (n > 0 && tmp[n - 1] == ')') {
    int depth = 0;
    for (size_t i = n; i-- > 0;) {
      if (tmp[i] == ')') depth++;
      else if (tmp[i] == '(' && --depth == 0) { if (i > 0) tmp[i] = 0; break; }
    }
  }
  const char* b = tmp;
  if (!strncmp(b, "void ", 5) && b[5]) b += 5;
  size_t len = strlen(b);
  if (len >= w) snprintf(out, w, "%.*s...", (int)(w - 4), b);
  else snprintf(out, w, "%s", b);
  free(dem);
}

int64_t eng_cuda_kernel_trace_report(char* buf, int64_t cap) {
  if (!g_tab) {
    int64_t len = 0;
    eng_text_append(buf, cap, &len, "kernel trace: not started (ENGINE_PROFILE_KERNELS=1 at launch, or "
                    "engine.profiler.kernel_trace())\n");
    return len;
  }
  kt_flush();
  pthread_mutex_lock(&g_mu);
  kt_entry* e = malloc(sizeof *e * (size_t)(g_n ? g_n : 1));
  int n = 0;
  int64_t total = 0, launches = 0;
  for (int i = 0; e && i < KT_TABLE; i++)
    if (g_tab[i].calls) { e[n++] = g_tab[i]; total += g_tab[i].ns; launches += g_tab[i].calls; }
  int dropped = g_dropped;
  pthread_mutex_unlock(&g_mu);
  if (!e) return eng_err("kernel trace: out of memory");
  qsort(e, (size_t)n, sizeof *e, by_total);
  int64_t len = 0;
  eng_text_append(buf, cap, &len,
                  "kernels (rank %d): %d names, %lld launches and copies, GPU %.3f ms in all (CUPTI activity "
                  "records; each kernel's own time)%s\n", eng_process_rank(), n, (long long)launches, total / 1e6,
                  dropped ? " [table full: some records dropped]" : "");
  eng_text_append(buf, cap, &len, "%-72s %8s %11s %9s %9s %9s %6s\n", "kernel", "calls", "GPU ms", "avg us", "min us",
                  "max us", "share");
  for (int i = 0; i < n; i++) {
    char nm[73];
    short_name(e[i].name, nm, sizeof nm);
    eng_text_append(buf, cap, &len, "%-72s %8lld %11.3f %9.2f %9.2f %9.2f %5.1f%%\n", nm, (long long)e[i].calls,
                    e[i].ns / 1e6, e[i].ns / 1e3 / (double)e[i].calls, e[i].min_ns / 1e3, e[i].max_ns / 1e3,
                    total ? 100.0 * (double)e[i].ns / (double)total : 0.0);
  }
  free(e);
  return len;
}

/* ENGINE_PROFILE_KERNELS set: start with the device (cuda/runtime.c calls this once it is initialised) */
void eng_cuda_kernel_trace_autostart(void) {
  const char* e = getenv("ENGINE_PROFILE_KERNELS");
  if (!e || !*e || !strcmp(e, "0")) return;
  if (eng_cuda_kernel_trace_start())
    fprintf(stderr, "engine: ENGINE_PROFILE_KERNELS is set but the kernel trace did not start: %s\n", eng_last_error());
}

#else /* ---------------------------------------------------------------- no CUDA backend or no CUPTI headers */

#ifdef ENG_HAVE_CUDA
#define KT_NONE "kernel trace: this build found no CUPTI headers (cupti_activity.h) in the CUDA toolkit"
#else
#define KT_NONE "kernel trace: CUDA is not available: this build has no CUDA backend"
#endif
int eng_cuda_kernel_trace_start(void) { return eng_err("%s", KT_NONE); }
int eng_cuda_kernel_trace_active(void) { return 0; }
void eng_cuda_kernel_trace_reset(void) {}
int64_t eng_cuda_kernel_trace_report(char* buf, int64_t cap) {
  int k = snprintf(buf, buf ? (size_t)cap : 0, "kernel trace: not started (%s)\n", KT_NONE + 14);
  return k < 0 ? 0 : k;
}
void eng_cuda_kernel_trace_autostart(void) {
  const char* e = getenv("ENGINE_PROFILE_KERNELS");
  if (e && *e && strcmp(e, "0")) fprintf(stderr, "engine: ENGINE_PROFILE_KERNELS is set: %s\n", KT_NONE);
}
#endif
