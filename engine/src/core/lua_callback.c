/* lua_callback.c: calls from C into Lua closures (the host registers one
 * dispatcher: eng_set_lua_dispatcher).  Tensor hooks and custom functions
 * (autograd/) and module hooks (core/module.c) hold Lua closures by id; a
 * closure whose owner dies is queued here and Lua releases it at its next
 * safe point (eng_lua_released), never from inside a C callback. */
#include "core/internal.h"
#include <pthread.h>

/* ---------------------------------------------------------------- the Lua dispatcher */
static eng_lua_dispatch_fn g_lua;
void eng_set_lua_dispatcher(eng_lua_dispatch_fn fn) { g_lua = fn; }
eng_lua_dispatch_fn eng_lua_dispatcher(void) { return g_lua; }

static pthread_mutex_t g_rel_mu = PTHREAD_MUTEX_INITIALIZER;
static int64_t* g_rel; static int g_rel_n, g_rel_cap;

static void lua_release_id(int64_t id) {
  pthread_mutex_lock(&g_rel_mu);
  if (g_rel_n == g_rel_cap) {
    int cap = g_rel_cap ? g_rel_cap * 2 : 64;
    int64_t* p = realloc(g_rel, (size_t)cap * sizeof *p);
    if (p) { g_rel = p; g_rel_cap = cap; }
  }
  if (g_rel_n < g_rel_cap) g_rel[g_rel_n++] = id;
  pthread_mutex_unlock(&g_rel_mu);
}

int eng_lua_released(int64_t* out, int max) {
  pthread_mutex_lock(&g_rel_mu);
  int n = g_rel_n < max ? g_rel_n : max;
  if (n > 0) memcpy(out, g_rel + (g_rel_n - n), (size_t)n * sizeof *out);
  g_rel_n -= n;
  pthread_mutex_unlock(&g_rel_mu);
  return n;
}

/* ---------------------------------------------------------------- module hooks from Lua */
void eng_lua_queue_release(int64_t id) { lua_release_id(id); }

int eng_lua_dispatch_module(int64_t id, eng_tensor** ts, int n, eng_tensor** unused) {
  (void)unused;
  if (!eng_lua_dispatcher()) return eng_err("module hook: no Lua dispatcher registered");
  eng_tensor* out[64] = {0};
  if (n > 64) return eng_err("module hook: %d tensors (at most 64)", n);
  int rc = eng_lua_dispatcher()(3, id, n, ts, n, out);
  if (rc) { for (int i = 0; i < n; i++) eng_tensor_release(out[i]); return -1; }
  for (int i = 0; i < n; i++)
    if (out[i]) { eng_tensor_release(ts[i]); ts[i] = out[i]; }
  return 0;
}
