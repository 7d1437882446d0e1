/* module.c: module objects owning forward-pre / forward-post hooks. */
#include "core/internal.h"
#include "eng/module.h"

typedef struct mhook {
  struct mhook* next;
  int64_t handle;
  int kind;
  eng_module_hook_fn fn;   /* NULL: Lua hook */
  void* ud;
  int64_t lua_id;
} mhook;

struct eng_module {
  int32_t refcount;
  char* name;
  mhook* hooks;
};

static int64_t g_mh;

eng_module* eng_module_new(const char* name) {
  eng_module* m = calloc(1, sizeof *m);
  if (!m) return eng_errp("module: out of memory");
  m->refcount = 1;
  m->name = strdup(name ? name : "Module");
  return m;
}

void eng_module_retain(eng_module* m) { if (m) m->refcount++; }

void eng_module_release(eng_module* m) {
  if (!m || --m->refcount > 0) return;
  for (mhook* h = m->hooks; h;) {
    mhook* nx = h->next;
    if (!h->fn) eng_lua_queue_release(h->lua_id);
    free(h);
    h = nx;
  }
  free(m->name);
  free(m);
}

const char* eng_module_name(const eng_module* m) { return m ? m->name : ""; }

static int64_t add(eng_module* m, int kind, eng_module_hook_fn fn, void* ud, int64_t lua_id, int prepend) {
  if (!m) return eng_err("register_forward_hook: module is NULL");
  if (kind != ENG_HOOK_FORWARD_PRE && kind != ENG_HOOK_FORWARD_POST)
    return eng_err("register_forward_hook: unknown hook kind %d", kind);
  mhook* h = calloc(1, sizeof *h);
  if (!h) return eng_err("register_forward_hook: out of memory");
  h->handle = ++g_mh; h->kind = kind; h->fn = fn; h->ud = ud; h->lua_id = lua_id;
  if (prepend) { h->next = m->hooks; m->hooks = h; }
  else { mhook** pp = &m->hooks; while (*pp) pp = &(*pp)->next; *pp = h; }
  return h->handle;
}

int64_t eng_module_register_hook(eng_module* m, int kind, eng_module_hook_fn fn, void* ud, int prepend) {
  if (!fn) return eng_err("register_forward_hook: hook function is NULL");
  return add(m, kind, fn, ud, 0, prepend);
}

int64_t eng_module_register_lua_hook(eng_module* m, int kind, int64_t id, int prepend) {
  return add(m, kind, NULL, NULL, id, prepend);
}

int eng_module_remove_hook(eng_module* m, int64_t handle) {
  if (!m) return eng_err("remove_hook: module is NULL");
  for (mhook** pp = &m->hooks; *pp; pp = &(*pp)->next)
    if ((*pp)->handle == handle) {
      mhook* h = *pp; *pp = h->next;
      if (!h->fn) eng_lua_queue_release(h->lua_id);
      free(h);
      return 0;
    }
  return eng_err("remove_hook: module %s has no hook with handle %lld", m->name, (long long)handle);
}

int eng_module_hook_count(const eng_module* m, int kind) {
  int c = 0;
  if (m) for (mhook* h = m->hooks; h; h = h->next) c += h->kind == kind;
  return c;
}

int eng_module_run_hooks(eng_module* m, int kind, eng_tensor** ts, int n) {
  if (!m) return eng_err("run_hooks: module is NULL");
  for (mhook* h = m->hooks; h; h = h->next) {
    if (h->kind != kind) continue;
    int rc;
    if (h->fn) rc = h->fn(m, kind, ts, n, h->ud);
    else rc = eng_lua_dispatch_module(h->lua_id, ts, n, NULL);
    if (rc) {
      eng_err_prefix("%s hook of module %s", kind == ENG_HOOK_FORWARD_PRE ? "forward-pre" : "forward", m->name);
      return -1;
    }
  }
  return 0;
}
