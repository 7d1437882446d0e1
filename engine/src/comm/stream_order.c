/* stream_order.c: which stream a GPU collective runs on, and the order of the stream and event
 * operations around it; device-free, so that the order is checked on any device.
 *
 * All-gathers (and every other collective) run on the communication stream, reduce-scatters on a stream
 * of their own (ENG_CUDA_STREAM_REDUCE), as FSDP2 separates its all-gather and reduce-scatter streams: an
 * all-gather issued after a reduce-scatter (FSDP's prefetch in backward) waits only for the compute work
 * queued before it, not for the reduce-scatter.  Around a collective #k on stream s (comm/nccl.c):
 *   issue:  s waits for the compute stream (an event: the inputs were produced there), the collective on s,
 *           then for an async one an event e<k> recorded on s; for a blocking one the compute stream waits
 *           for s at once;
 *   wait:   the host polls e<k> (comm/gpu_wait.c), then the compute stream waits for e<k>: kernels that read
 *           the output, and the caching allocator's reuse of the input and output blocks (in compute-stream
 *           order; the work holds both until then), come after the collective.
 * With ENGINE_COMM_STREAM_TRACE=1 (or eng_comm_stream_trace(1)) every collective, on any device, appends
 * these operations to a trace, one line each, as the NCCL backend performs them:
 *   "wait s<s> <- s0", "coll #<k> <kind> on s<s> group <name>", "record e<k> on s<s>", "wait s0 <- s<s>",
 *   "wait s0 <- e<k>", and marks that callers add ("fsdp forward <group>", "fsdp backward <group>"). */
#include "comm/comm_impl.h"
#include "eng/cuda.h"
#include <stdarg.h>
#include <stdio.h>

int comm_stream_for(int kind) { return kind == ENG_COLL_REDUCE_SCATTER ? ENG_CUDA_STREAM_REDUCE : ENG_CUDA_STREAM_COMM; }

static int g_trace = -1;
static char* g_buf;
static size_t g_len, g_cap;

int comm_stream_trace_on(void) {
  if (g_trace < 0) {
    const char* e = getenv("ENGINE_COMM_STREAM_TRACE");
    g_trace = e && *e && *e != '0';
  }
  return g_trace;
}

void comm_stream_trace(const char* fmt, ...) {
  if (!comm_stream_trace_on()) return;
  char line[256];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if (n >= (int)sizeof line) n = (int)sizeof line - 1;
  if (g_len + (size_t)n + 2 > g_cap) {
    size_t cap = g_cap ? g_cap * 2 : 65536;
    while (cap < g_len + (size_t)n + 2) cap *= 2;
    if (cap > ((size_t)64 << 20)) return; /* a bounded trace: it is for the specs */
    char* b = realloc(g_buf, cap);
    if (!b) return;
    g_buf = b;
    g_cap = cap;
  }
  memcpy(g_buf + g_len, line, (size_t)n);
  g_len += (size_t)n;
  g_buf[g_len++] = '\n';
  g_buf[g_len] = 0;
}

void comm_stream_trace_issue(const eng_pg* pg, int kind, int64_t seq, int async) {
  if (!comm_stream_trace_on()) return;
  int s = comm_stream_for(kind);
  comm_stream_trace("wait s%d <- s0", s);
  comm_stream_trace("coll #%lld %s on s%d group %s", (long long)seq, eng_coll_kind_name(kind), s, pg->name);
  if (async) comm_stream_trace("record e%lld on s%d", (long long)seq, s);
  else comm_stream_trace("wait s0 <- s%d", s);
}

int eng_comm_stream_trace(int on) {
  g_trace = on ? 1 : 0;
  g_len = 0;
  if (g_buf) g_buf[0] = 0;
  return 0;
}

const char* eng_comm_stream_trace_text(void) { return g_buf ? g_buf : ""; }

void eng_comm_stream_trace_mark(const char* what) { comm_stream_trace("%s", what ? what : ""); }
