/* error.c: the thread-local error message and formatting helpers. */
#include "core/internal.h"
#include "core/device.h"
#include <stdio.h>

static __thread char g_msg[2048];
static __thread char g_ring[8][256];
static __thread int g_ring_i;

const char* eng_last_error(void) { return g_msg; }
void eng_clear_error(void) { g_msg[0] = 0; }

int eng_set_error_message(const char* msg) {
  snprintf(g_msg, sizeof g_msg, "%s", msg ? msg : "unknown error");
  return -1;
}

static void vset(const char* fmt, va_list ap) { vsnprintf(g_msg, sizeof g_msg, fmt, ap); }

int eng_err(const char* fmt, ...) {
  va_list ap; va_start(ap, fmt); vset(fmt, ap); va_end(ap);
  return -1;
}

void* eng_errp(const char* fmt, ...) {
  va_list ap; va_start(ap, fmt); vset(fmt, ap); va_end(ap);
  return NULL;
}

void eng_err_prefix(const char* fmt, ...) {
  char pre[512], old[sizeof g_msg];
  va_list ap; va_start(ap, fmt); vsnprintf(pre, sizeof pre, fmt, ap); va_end(ap);
  memcpy(old, g_msg, sizeof old);
  /* One op name per message: when the message already starts with the
   * prefix's leading name ("cross_entropy: target ..." under the prefix
   * "cross_entropy" or "cross_entropy: (layouts)"), that name is not repeated. */
  size_t k = strcspn(pre, ":");
  const char* rest = old;
  if (k > 0 && strncmp(old, pre, k) == 0 && old[k] == ':' && old[k + 1] == ' ') rest = old + k + 2;
  snprintf(g_msg, sizeof g_msg, "%s: %s", pre, rest);
}

static char* ring(void) { char* b = g_ring[g_ring_i]; g_ring_i = (g_ring_i + 1) & 7; return b; }

static int put_shape(char* b, int cap, int ndim, const int64_t* shape) {
  int k = snprintf(b, cap, "[");
  for (int i = 0; i < ndim && k < cap; i++)
    k += snprintf(b + k, cap - k, i ? ",%lld" : "%lld", (long long)shape[i]);
  if (k < cap) k += snprintf(b + k, cap - k, "]");
  return k;
}

const char* eng_shape_str(int ndim, const int64_t* shape) {
  char* b = ring();
  put_shape(b, 256, ndim, shape);
  return b;
}

const char* eng_desc(const eng_tensor* t) {
  char* b = ring();
  if (!t) { snprintf(b, 256, "nil"); return b; }
  int k = snprintf(b, 256, "%s", eng_dtype_name(t->dtype));
  put_shape(b + k, 256 - k, t->ndim, t->shape);
  if (t->device != ENG_CPU) { strncat(b, "@", 255 - strlen(b)); strncat(b, eng_device_name(t->device), 255 - strlen(b)); }
  return b;
}

const char* eng_tensor_describe(const eng_tensor* t, char* buf, int buflen) {
  snprintf(buf, buflen, "%s", eng_desc(t));
  return buf;
}

int eng_norm_dim(int dim, int ndim, const char* op) {
  int n = ndim > 0 ? ndim : 1;
  if (dim < -n || dim >= n)
    return eng_err("%s: dim %lld out of range for a %d-d tensor (dims are 1-based; valid: 1..%d or %d..-1)",
                   op, ENG_U(dim), ndim, n, -n);
  return dim < 0 ? dim + n : dim;
}

void eng_text_append(char* buf, int64_t cap, int64_t* len, const char* fmt, ...) {
  char line[512];
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  if (k < 0) return;
  if (k >= (int)sizeof line) k = (int)sizeof line - 1;
  if (buf && *len < cap) snprintf(buf + *len, (size_t)(cap - *len), "%s", line);
  *len += k;
}
