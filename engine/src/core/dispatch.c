/* dispatch.c: the registration point between the ops and the DTensor layer
 * (core/dispatch.h): the installed entry points, local mode, and the helpers
 * every guard uses. */
#include "core/dispatch.h"
#include <stdio.h>

static eng_dispatcher g_dispatcher;
static __thread int t_local_mode;

void eng_dispatcher_install(const eng_dispatcher* d) {
  if (d) g_dispatcher = *d;
  else memset(&g_dispatcher, 0, sizeof g_dispatcher);
}

int eng_dispatch_local_mode(void) { return t_local_mode; }

int eng_dispatch_set_local_mode(int on) {
  int prev = t_local_mode;
  t_local_mode = on ? 1 : 0;
  return prev;
}

static void* no_layer(const char* name) {
  return eng_errp("%s: DTensor or meta arguments need the DTensor layer, which this build lacks", name ? name : "op");
}

eng_tensor* eng_op_dispatch(eng_op_id op, eng_op_call* c) {
  if (!g_dispatcher.call) return no_layer(c->name);
  return g_dispatcher.call(op, c);
}

int eng_op_dispatch_multi(eng_op_id op, eng_op_call* c, eng_tensor** outs) {
  if (!g_dispatcher.call_multi) { no_layer(c->name); return -1; }
  return g_dispatcher.call_multi(op, c, outs);
}

int eng_op_dispatch_inplace(const char* name, int mode, eng_op_call* c, int (*fn)(eng_op_call* c)) {
  if (!g_dispatcher.call_inplace) { no_layer(name); return -1; }
  return g_dispatcher.call_inplace(name, mode, c, fn);
}

eng_dist_spec* eng_spec_retain(eng_dist_spec* s) {
  return s && g_dispatcher.spec_retain ? g_dispatcher.spec_retain(s) : s;
}

void eng_spec_release(eng_dist_spec* s) {
  if (s && g_dispatcher.spec_release) g_dispatcher.spec_release(s);
}

const char* eng_spec_describe(const eng_dist_spec* s, int dtype, char* buf, int cap) {
  if (g_dispatcher.spec_describe) return g_dispatcher.spec_describe(s, dtype, buf, cap);
  snprintf(buf, (size_t)cap, "?");
  return buf;
}

const char* eng_dist_desc(const eng_tensor* t, char* buf, int cap) {
  if (!t) snprintf(buf, (size_t)cap, "(NULL)");
  else if (!t->dist) snprintf(buf, (size_t)cap, "%s", eng_desc(t));
  else {
    char s[600];
    snprintf(buf, (size_t)cap, "DTensor(%s, local %s)", eng_spec_describe(t->dist, t->dtype, s, sizeof s), eng_desc(t));
  }
  return buf;
}

int eng_spec_equal(const eng_dist_spec* a, const eng_dist_spec* b) {
  if (!a || !b) return a == b;
  return g_dispatcher.spec_equal ? g_dispatcher.spec_equal(a, b) : a == b;
}

int eng_dist_wait(eng_tensor* t) { return t && g_dispatcher.wait ? g_dispatcher.wait(t) : 0; }

int eng_dist_norm_reduce(const char* op, int n, const eng_dist_spec* const* layouts, const uint32_t* masks,
                         const double* acc, int kind, int err, double* out) {
  if (!g_dispatcher.norm_reduce) { no_layer(op); return -1; }
  return g_dispatcher.norm_reduce(op, n, layouts, masks, acc, kind, err, out);
}

int64_t eng_dims_mask(int ndim, int n_dims, const int* dims, const char* op) {
  if (n_dims == 0) return ndim >= 64 ? -1 : (int64_t)((1ull << ndim) - 1);
  int64_t m = 0;
  for (int i = 0; i < n_dims; i++) {
    int d = eng_norm_dim(dims[i], ndim, op);
    if (d < 0) return -1;
    m |= (int64_t)1 << d;
  }
  return m;
}
