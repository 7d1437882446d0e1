/* Subsystem autograd/: grad mode, graph nodes, saved tensors, tensor and
 * node hooks, custom (Lua) functions and the backward pass.
 * May call: core/ (and ops' add / sum_to_shape to accumulate gradients).
 * The DTensor layer takes part only through the table it installs
 * (dist_hooks.h); autograd never names dtensor/. */
/* autograd.c: graph nodes, saved tensors, hooks and the backward pass. */
#include "core/internal.h"
#include "core/dispatch.h"
#include "autograd/dist_hooks.h"
#include "autograd/grad_math.h"
#include "autograd/autograd.h"
#include "eng/profiler.h"
#include <pthread.h>
#include <stdint.h>


/* ---------------------------------------------------------------- hooks */
typedef struct eng_hook {
  struct eng_hook* next;
  int64_t handle;
  int32_t output_nr;        /* node pre-hooks: which output slot */
  eng_tensor_hook_fn fn;    /* C hook, or NULL for a Lua hook */
  void* ud;
  int64_t lua_id;
  int32_t post;             /* Lua hook kind: 0 gradient hook, 1 post-accumulate */
} eng_hook;

struct eng_hook_list { eng_hook* head; };

static int64_t g_handle;
static int64_t next_handle(void) { return __atomic_add_fetch(&g_handle, 1, __ATOMIC_RELAXED); }

/* ---------------------------------------------------------------- DTensor layer */
static eng_autograd_dist_hooks g_dist;
/* The arithmetic of accumulation, installed by ops/grad_math.c. */
static eng_autograd_math g_math;

void eng_autograd_set_math(const eng_autograd_math* m) { g_math = *m; }

void eng_autograd_set_dist_hooks(const eng_autograd_dist_hooks* hooks) {
  if (hooks) g_dist = *hooks;
  else memset(&g_dist, 0, sizeof g_dist);
}


void eng_hook_list_free(struct eng_hook_list* h) {
  if (!h) return;
  for (eng_hook* k = h->head; k;) {
    eng_hook* nx = k->next;
    if (!k->fn) eng_lua_queue_release(k->lua_id);
    free(k);
    k = nx;
  }
  free(h);
}

static int64_t hook_add(struct eng_hook_list** lp, eng_tensor_hook_fn fn, void* ud, int64_t lua_id,
                        int post, int output_nr) {
  if (!*lp) { *lp = calloc(1, sizeof **lp); if (!*lp) return eng_err("register_hook: out of memory"); }
  eng_hook* k = calloc(1, sizeof *k);
  if (!k) return eng_err("register_hook: out of memory");
  k->handle = next_handle(); k->fn = fn; k->ud = ud; k->lua_id = lua_id; k->post = post;
  k->output_nr = output_nr;
  eng_hook** pp = &(*lp)->head;       /* append: hooks run in registration order */
  while (*pp) pp = &(*pp)->next;
  *pp = k;
  return k->handle;
}

static int hook_remove(struct eng_hook_list* l, int64_t handle) {
  if (!l) return 0;
  for (eng_hook** pp = &l->head; *pp; pp = &(*pp)->next) {
    if ((*pp)->handle == handle) {
      eng_hook* k = *pp; *pp = k->next;
      if (!k->fn) eng_lua_queue_release(k->lua_id);
      free(k);
      return 1;
    }
  }
  return 0;
}

/* Runs one hook on grad; replaces *grad with the hook's result if any. */
static int hook_call(eng_hook* k, eng_tensor* t, eng_tensor** grad) {
  eng_tensor* out = NULL;
  int rc;
  if (k->fn) rc = k->fn(t, *grad, &out, k->ud);
  else if (!eng_lua_dispatcher()) rc = eng_err("hook: no Lua dispatcher registered");
  else if (k->post) rc = eng_lua_dispatcher()(1, k->lua_id, 1, &t, 0, &out); /* post hooks get the leaf */
  else rc = eng_lua_dispatcher()(0, k->lua_id, 1, grad, 1, &out);
  if (rc) { eng_tensor_release(out); return -1; }
  if (out) {
    if (*grad && !eng_same_shape(out, *grad)) {
      int e = eng_err("hook: returned gradient %s does not match the gradient %s it replaces",
                      eng_desc(out), eng_desc(*grad));
      eng_tensor_release(out);
      return e;
    }
    eng_tensor_release(*grad);
    *grad = out;
  }
  return 0;
}

/* ---------------------------------------------------------------- nodes */
static int64_t g_seq;

static int accumulate_backward(eng_node* n, eng_tensor** go, eng_tensor** gi);

static eng_node* node_alloc(const char* name, eng_backward_fn fn, int n_inputs, int n_outputs) {
  eng_node* n = calloc(1, sizeof *n);
  if (!n) return eng_errp("autograd: out of memory");
  n->refcount = 1; n->name = name; n->backward = fn;
  n->n_inputs = n_inputs; n->n_outputs = n_outputs;
  n->seq = __atomic_add_fetch(&g_seq, 1, __ATOMIC_RELAXED);
  if (n_inputs) {
    n->next = calloc((size_t)n_inputs, sizeof *n->next);
    n->in_shapes = calloc((size_t)n_inputs * 9, sizeof *n->in_shapes);
    n->in_dtypes = calloc((size_t)n_inputs, sizeof *n->in_dtypes);
    if (!n->next || !n->in_shapes || !n->in_dtypes) {
      free(n->next); free(n->in_shapes); free(n->in_dtypes); free(n);
      return eng_errp("autograd: out of memory");
    }
    n->n_in_shapes = n_inputs;
  }
  return n;
}

static eng_node* accumulator(eng_tensor* t) {
  if (t->grad_acc) { eng_node_retain(t->grad_acc); return t->grad_acc; }
  eng_node* n = node_alloc("AccumulateGrad", accumulate_backward, 0, 1);
  if (!n) return NULL;
  n->seq = INT64_MAX; /* run as soon as ready */
  n->leaf = eng_tensor_retain(t);
  t->grad_acc = n;   /* weak */
  return n;
}

void eng_node_retain(eng_node* n) { if (n) __atomic_add_fetch(&n->refcount, 1, __ATOMIC_RELAXED); }

static void release_saved(eng_node* n) {
  for (int i = 0; i < n->n_saved; i++) { eng_tensor_release(n->saved[i]); n->saved[i] = NULL; }
}

void eng_node_release(eng_node* n) {
  if (!n) return;
  if (__atomic_sub_fetch(&n->refcount, 1, __ATOMIC_ACQ_REL) != 0) return;
  for (int i = 0; i < n->n_inputs; i++) eng_node_release(n->next[i].node);
  release_saved(n);
  if (n->free_ctx) n->free_ctx(n);
  eng_hook_list_free(n->pre_hooks);
  if (n->dist && g_dist.node_free) g_dist.node_free(n->dist);
  if (n->leaf) {
    if (n->leaf->grad_acc == n) n->leaf->grad_acc = NULL;
    eng_tensor_release(n->leaf);
  }
  free(n->next); free(n->saved); free(n->saved_version); free(n->in_shapes); free(n->in_dtypes);
  free(n);
}

eng_node* eng_node_new(const char* name, eng_backward_fn fn, int n_inputs, eng_tensor** inputs,
                       int n_outputs) {
  if (n_inputs < 0 || n_outputs < 1) return eng_errp("autograd: node %s needs >= 1 output", name);
  eng_node* n = node_alloc(name, fn, n_inputs, n_outputs);
  if (!n) return NULL;
  for (int i = 0; i < n_inputs; i++) {
    eng_tensor* t = inputs ? inputs[i] : NULL;
    if (!t) continue;
    int64_t* s = n->in_shapes + 9 * i;
    s[0] = t->ndim;
    for (int d = 0; d < t->ndim; d++) s[1 + d] = t->shape[d];
    n->in_dtypes[i] = t->dtype;
    if (!t->requires_grad) continue;
    if (t->grad_fn) { eng_node_retain(t->grad_fn); n->next[i].node = t->grad_fn; n->next[i].input_nr = t->output_nr; }
    else {
      n->next[i].node = accumulator(t);
      if (!n->next[i].node) { eng_node_release(n); return NULL; }
    }
  }
  if (g_dist.mark_node) g_dist.mark_node(n, n_inputs, inputs); /* no-op outside a DTensor dispatch local region */
  return n;
}

int eng_node_in_ndim(const eng_node* n, int i) { return (int)n->in_shapes[9 * i]; }
const int64_t* eng_node_in_shape(const eng_node* n, int i) { return n->in_shapes + 9 * i + 1; }
int eng_node_in_dtype(const eng_node* n, int i) { return n->in_dtypes[i]; }
int eng_node_needs_grad(const eng_node* n, int i) { return i >= 0 && i < n->n_inputs && n->next[i].node; }

int eng_node_save(eng_node* n, eng_tensor* t) {
  eng_tensor* a = NULL;
  if (t) { a = eng_tensor_detach(t); if (!a) return -1; }
  eng_tensor** s = realloc(n->saved, (size_t)(n->n_saved + 1) * sizeof *s);
  if (!s) { eng_tensor_release(a); return eng_err("autograd: out of memory"); }
  n->saved = s;
  int32_t* v = realloc(n->saved_version, (size_t)(n->n_saved + 1) * sizeof *v);
  if (!v) { eng_tensor_release(a); return eng_err("autograd: out of memory"); }
  n->saved_version = v;
  n->saved[n->n_saved] = a;
  n->saved_version[n->n_saved] = t ? t->storage->version : 0;
  n->n_saved++;
  return 0;
}

eng_tensor* eng_node_saved(eng_node* n, int i) {
  if (n->released)
    return eng_errp("%s: trying to backward through the graph a second time (saved tensors were freed "
                    "after the first backward; pass retain_graph = true)", n->name);
  if (i < 0 || i >= n->n_saved) return eng_errp("%s: saved tensor %d does not exist", n->name, i);
  eng_tensor* t = n->saved[i];
  if (t && t->storage->version != n->saved_version[i])
    return eng_errp("%s: a tensor saved for backward (%s) was modified by an in-place operation "
                    "(version %d, expected %d)", n->name, eng_desc(t), t->storage->version, n->saved_version[i]);
  return t;
}

int eng_node_set_output(eng_node* n, eng_tensor* out, int output_nr) {
  if (output_nr < 0 || output_nr >= n->n_outputs)
    return eng_err("autograd: output %d of %s out of range", output_nr, n->name);
  if (out->grad_fn) eng_node_release(out->grad_fn);
  eng_node_retain(n);
  out->grad_fn = n; out->output_nr = output_nr; out->requires_grad = 1;
  return 0;
}

int eng_any_requires_grad(int n, eng_tensor** ts) {
  if (!eng_grad_enabled()) return 0;
  for (int i = 0; i < n; i++) if (ts[i] && ts[i]->requires_grad) return 1;
  return 0;
}

eng_node* eng_record(const char* name, eng_backward_fn fn, int n_inputs, eng_tensor** inputs,
                     eng_tensor* out) {
  return eng_record_multi(name, fn, n_inputs, inputs, 1, &out);
}

eng_node* eng_record_multi(const char* name, eng_backward_fn fn, int n_inputs, eng_tensor** inputs,
                           int n_outputs, eng_tensor** outputs) {
  if (!eng_any_requires_grad(n_inputs, inputs)) return NULL;
  eng_node* n = eng_node_new(name, fn, n_inputs, inputs, n_outputs);
  if (!n) return NULL;
  for (int k = 0; k < n_outputs; k++)
    if (outputs[k] && eng_dtype_is_floating(outputs[k]->dtype)) eng_node_set_output(n, outputs[k], k);
  eng_node_release(n);
  return n; /* owned by the outputs */
}

const char* eng_tensor_grad_fn_name(const eng_tensor* t) {
  return t && t->grad_fn ? t->grad_fn->name : "";
}

eng_tensor* eng_grad_to_input(eng_node* n, int i, eng_tensor* g) {
  int nd = eng_node_in_ndim(n, i);
  const int64_t* sh = eng_node_in_shape(n, i);
  eng_tensor* r;
  int same = g->ndim == nd;
  for (int d = 0; same && d < nd; d++) same = g->shape[d] == sh[d];
  if (same) r = eng_tensor_retain(g);
  else { r = g_math.sum_to_shape(g, nd, sh); if (!r) return NULL; }
  if (r->dtype != eng_node_in_dtype(n, i)) {
    eng_tensor* c = g_math.to_dtype(r, eng_node_in_dtype(n, i));
    eng_tensor_release(r);
    r = c;
  }
  return r;
}

/* ---------------------------------------------------------------- tensor hooks */
int64_t eng_tensor_register_hook(eng_tensor* t, eng_tensor_hook_fn fn, void* ud) {
  ENG_CHECK_I(t, "register_hook");
  if (!fn) return eng_err("register_hook: hook function is NULL");
  if (!t->requires_grad)
    return eng_err("register_hook: cannot register a hook on %s, which does not require grad", eng_desc(t));
  if (t->grad_fn) return hook_add(&t->grad_fn->pre_hooks, fn, ud, 0, 0, t->output_nr);
  return hook_add(&t->hooks, fn, ud, 0, 0, 0);
}

int64_t eng_tensor_register_post_accumulate_hook(eng_tensor* t, eng_tensor_hook_fn fn, void* ud) {
  ENG_CHECK_I(t, "register_post_accumulate_grad_hook");
  if (!fn) return eng_err("register_post_accumulate_grad_hook: hook function is NULL");
  if (!t->requires_grad || t->grad_fn)
    return eng_err("register_post_accumulate_grad_hook: only leaf tensors that require grad take "
                   "post-accumulate hooks, got %s", eng_desc(t));
  return hook_add(&t->post_hooks, fn, ud, 0, 1, 0);
}

int64_t eng_tensor_register_lua_hook(eng_tensor* t, int64_t id, int post_accumulate) {
  ENG_CHECK_I(t, "register_hook");
  if (!t->requires_grad)
    return eng_err("register_hook: cannot register a hook on %s, which does not require grad", eng_desc(t));
  if (post_accumulate) {
    if (t->grad_fn)
      return eng_err("register_post_accumulate_grad_hook: only leaf tensors take post-accumulate hooks, "
                     "%s has grad_fn %s", eng_desc(t), t->grad_fn->name);
    return hook_add(&t->post_hooks, NULL, NULL, id, 1, 0);
  }
  if (t->grad_fn) return hook_add(&t->grad_fn->pre_hooks, NULL, NULL, id, 0, t->output_nr);
  return hook_add(&t->hooks, NULL, NULL, id, 0, 0);
}

int eng_tensor_remove_hook(eng_tensor* t, int64_t handle) {
  ENG_CHECK_I(t, "remove_hook");
  if (hook_remove(t->hooks, handle) || hook_remove(t->post_hooks, handle) ||
      (t->grad_fn && hook_remove(t->grad_fn->pre_hooks, handle)))
    return 0;
  return eng_err("remove_hook: no hook with handle %lld on %s", (long long)handle, eng_desc(t));
}

/* retain_grad: a node pre-hook that stores the gradient in the (weakly
 * referenced) tensor; the tensor removes it when it dies. */
static int retain_hook(eng_tensor* t, eng_tensor* grad, eng_tensor** out, void* ud) {
  (void)t; (void)out;
  eng_tensor* owner = ud;
  if (!grad) return 0;
  if (!owner->grad) { owner->grad = g_math.clone(grad); return owner->grad ? 0 : -1; }
  return g_math.add_(owner->grad, grad, 1.0);
}

int eng_tensor_retain_grad(eng_tensor* t) {
  ENG_CHECK_I(t, "retain_grad");
  if (!t->requires_grad)
    return eng_err("retain_grad: %s does not require grad", eng_desc(t));
  if (!t->grad_fn || t->retains_grad) return 0; /* leaves keep .grad anyway */
  int64_t h = hook_add(&t->grad_fn->pre_hooks, retain_hook, t, 0, 0, t->output_nr);
  if (h < 0) return -1;
  t->retains_grad = (int32_t)h;
  return 0;
}

void eng_tensor_drop_retain_hook(eng_tensor* t) {
  if (t->grad_fn) hook_remove(t->grad_fn->pre_hooks, t->retains_grad);
  t->retains_grad = 0;
}

/* ---------------------------------------------------------------- Lua functions */
static int lua_fn_backward(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  if (!eng_lua_dispatcher()) return eng_err("%s: no Lua dispatcher registered", n->name);
  return eng_lua_dispatcher()(2, n->ints[0], n->n_outputs, go, n->n_inputs, gi);
}

static void lua_fn_free(eng_node* n) { eng_lua_queue_release(n->ints[0]); }

int eng_lua_function_attach(int64_t id, int n_inputs, eng_tensor** inputs, int n_outputs,
                            eng_tensor** outputs) {
  if (!eng_any_requires_grad(n_inputs, inputs)) { eng_lua_queue_release(id); return 0; }
  eng_node* n = eng_node_new("LuaFunctionBackward", lua_fn_backward, n_inputs, inputs, n_outputs);
  if (!n) { eng_lua_queue_release(id); return -1; }
  n->ints[0] = id;
  n->free_ctx = lua_fn_free;
  for (int k = 0; k < n_outputs; k++)
    if (outputs[k] && eng_dtype_is_floating(outputs[k]->dtype)) eng_node_set_output(n, outputs[k], k);
  eng_node_release(n);
  return 0;
}

/* ---------------------------------------------------------------- backward */
typedef struct {
  eng_node* node;
  int deps;
  int queued;
  eng_tensor** buf;       /* n_outputs gradient buffers */
  int capture;            /* inputs mode: index into inputs + 1 */
  int64_t pushed;         /* when it became ready: breaks ties of seq (AccumulateGrad's) first come, first run */
} nstate;

typedef struct {
  nstate* st; int n, cap;
  int* table; int tcap;   /* open addressing: node -> index+1 */
  int* heap; int hn;
  int64_t pushes;
} graph;

static unsigned ptr_hash(const void* p, int cap) {
  uint64_t h = (uint64_t)(uintptr_t)p * 0x9E3779B97F4A7C15ull;
  return (unsigned)(h >> 32) & (unsigned)(cap - 1);
}

static int g_find(graph* g, eng_node* n) {
  unsigned i = ptr_hash(n, g->tcap);
  while (g->table[i]) {
    if (g->st[g->table[i] - 1].node == n) return g->table[i] - 1;
    i = (i + 1) & (unsigned)(g->tcap - 1);
  }
  return -1;
}

static int g_grow_table(graph* g) {
  int cap = g->tcap ? g->tcap * 2 : 256;
  int* t = calloc((size_t)cap, sizeof *t);
  if (!t) return -1;
  free(g->table); g->table = t; g->tcap = cap;
  for (int k = 0; k < g->n; k++) {
    unsigned i = ptr_hash(g->st[k].node, cap);
    while (t[i]) i = (i + 1) & (unsigned)(cap - 1);
    t[i] = k + 1;
  }
  return 0;
}

static int g_add(graph* g, eng_node* n) {
  if ((g->n + 1) * 2 > g->tcap && g_grow_table(g)) return eng_err("backward: out of memory");
  if (g->n == g->cap) {
    int cap = g->cap ? g->cap * 2 : 128;
    nstate* s = realloc(g->st, (size_t)cap * sizeof *s);
    if (!s) return eng_err("backward: out of memory");
    g->st = s; g->cap = cap;
  }
  nstate* s = &g->st[g->n];
  memset(s, 0, sizeof *s);
  s->node = n;
  s->buf = calloc((size_t)n->n_outputs, sizeof *s->buf);
  if (!s->buf) return eng_err("backward: out of memory");
  unsigned i = ptr_hash(n, g->tcap);
  while (g->table[i]) i = (i + 1) & (unsigned)(g->tcap - 1);
  g->table[i] = g->n + 1;
  return g->n++;
}

/* Ready nodes run latest-created first (seq, as PyTorch's ready queue); the AccumulateGrad nodes, which all share
 * the highest seq, in the order they became ready. */
static int heap_less(graph* g, int a, int b) {
  const nstate *x = &g->st[a], *y = &g->st[b];
  return x->node->seq < y->node->seq || (x->node->seq == y->node->seq && x->pushed > y->pushed);
}

static void heap_push(graph* g, int k) {
  g->st[k].pushed = g->pushes++;
  int i = g->hn++;
  g->heap[i] = k;
  while (i > 0) {
    int p = (i - 1) / 2;
    if (!heap_less(g, g->heap[p], g->heap[i])) break;
    int t = g->heap[p]; g->heap[p] = g->heap[i]; g->heap[i] = t; i = p;
  }
}

static int heap_pop(graph* g) {
  int top = g->heap[0];
  g->heap[0] = g->heap[--g->hn];
  int i = 0;
  for (;;) {
    int l = 2 * i + 1, r = l + 1, m = i;
    if (l < g->hn && heap_less(g, g->heap[m], g->heap[l])) m = l;
    if (r < g->hn && heap_less(g, g->heap[m], g->heap[r])) m = r;
    if (m == i) break;
    int t = g->heap[m]; g->heap[m] = g->heap[i]; g->heap[i] = t; i = m;
  }
  return top;
}

/* A plain gradient buffer nothing else can see: it may be summed into in
 * place (DTensor gradients keep the out-of-place path). */
static int exclusive(const eng_tensor* t, int refs) {
  return t->refcount == refs && t->storage->refcount == 1 && !t->grad_fn && !t->dist && eng_tensor_is_contiguous(t);
}

/* slot += g.  In place into whichever of the two only the backward pass
 * holds (g: the caller's one reference); a new sum otherwise. */
static int buf_add(eng_tensor** slot, eng_tensor* g) {
  if (!*slot) { *slot = eng_tensor_retain(g); return 0; }
  if (*slot == g) return 0; /* the backward function summed into the slot itself (eng_grad_accum_slot) */
  if (eng_same_shape(*slot, g) && (*slot)->dtype == g->dtype) {
    if (exclusive(*slot, 1) && (*slot)->storage != g->storage) return g_math.add_(*slot, g, 1.0);
    if (exclusive(g, 1) && (*slot)->storage != g->storage) {
      if (g_math.add_(g, *slot, 1.0)) return -1;
      eng_tensor_release(*slot);
      *slot = eng_tensor_retain(g);
      return 0;
    }
  }
  eng_tensor* s = g_math.add(*slot, g);
  if (!s) return -1;
  eng_tensor_release(*slot);
  *slot = s;
  return 0;
}

/* The graph and node whose backward function runs now (eng_grad_accum_slot). */
static __thread graph* t_graph;
static __thread eng_node* t_node;

eng_tensor* eng_grad_accum_slot(eng_node* n, int i) {
  if (!t_graph || n != t_node || i < 0 || i >= n->n_inputs || !n->next[i].node) return NULL;
  int k = g_find(t_graph, n->next[i].node);
  if (k < 0) return NULL;
  eng_tensor* s = t_graph->st[k].buf[n->next[i].input_nr];
  if (!s || !exclusive(s, 1) || s->dtype != eng_node_in_dtype(n, i) || s->ndim != eng_node_in_ndim(n, i)) return NULL;
  const int64_t* sh = eng_node_in_shape(n, i);
  for (int d = 0; d < s->ndim; d++) if (s->shape[d] != sh[d]) return NULL;
  return s;
}

static void graph_free(graph* g) {
  for (int k = 0; k < g->n; k++) {
    nstate* s = &g->st[k];
    if (s->buf) for (int j = 0; j < s->node->n_outputs; j++) eng_tensor_release(s->buf[j]);
    free(s->buf);
  }
  /* release the graph's node references only after the buffers (a node held
   * by the graph alone, e.g. a root leaf's accumulator, dies here) */
  for (int k = 0; k < g->n; k++) eng_node_release(g->st[k].node);
  free(g->st); free(g->table); free(g->heap);
}

/* AccumulateGrad: leaf gradient hooks, accumulate into .grad, post hooks. */
static int accumulate_backward(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  (void)gi;
  eng_tensor* leaf = n->leaf;
  /* a DTensor leaf takes its gradient in its own layout (Partial grads are reduced here) */
  eng_tensor* g = leaf->dist && g_dist.grad_for_leaf ? g_dist.grad_for_leaf(leaf, go[0]) : eng_tensor_retain(go[0]);
  if (!g) return -1;
  if (leaf->hooks)
    for (eng_hook* k = leaf->hooks->head; k; k = k->next)
      if (hook_call(k, leaf, &g)) { eng_tensor_release(g); return -1; }
  if (!leaf->grad) {
    /* steal g only when nothing else can see its memory; otherwise copy
     * (.grad is accumulated in place later and must not alias the caller's
     * gradient or another leaf's) */
    int others = g == go[0] ? 1 : 0; /* the backward pass's buffer slot, released after this node */
    if (g->refcount == 1 + others && g->storage->refcount == 1 && eng_tensor_is_contiguous(g) &&
        g->dtype == leaf->dtype && !g->grad_fn)
      leaf->grad = g;
    else {
      leaf->grad = eng_new(leaf->ndim, leaf->shape, leaf->dtype, leaf->device);
      if (leaf->grad) eng_copy_raw(leaf->grad, g, g->stride);
      if (leaf->grad && g->dist) leaf->grad->dist = eng_spec_retain(g->dist); /* DTensor grads stay DTensors */
      eng_tensor_release(g);
      if (!leaf->grad) return -1;
    }
    /* a plain local gradient of a DTensor leaf is in the leaf's layout */
    if (leaf->dist && !leaf->grad->dist) leaf->grad->dist = eng_spec_retain(leaf->dist);
  } else {
    int rc = g_math.add_(leaf->grad, g, 1.0);
    eng_tensor_release(g);
    if (rc) return -1;
  }
  if (leaf->post_hooks)
    for (eng_hook* k = leaf->post_hooks->head; k; k = k->next) {
      eng_tensor* gg = leaf->grad;
      eng_tensor_retain(gg);
      int rc = hook_call(k, leaf, &gg);
      eng_tensor_release(gg);
      if (rc) return -1;
    }
  return 0;
}

static int check_grad_shape(eng_node* n, int i, eng_tensor* g) {
  int nd = eng_node_in_ndim(n, i);
  const int64_t* sh = eng_node_in_shape(n, i);
  int ok = g->ndim == nd;
  for (int d = 0; ok && d < nd; d++) ok = g->shape[d] == sh[d];
  if (!ok)
    return eng_err("%s returned a gradient %s for input %d of shape %s", n->name, eng_desc(g), i,
                   eng_shape_str(nd, sh));
  return 0;
}

/* ---------------------------------------------------------------- end-of-backward callbacks */
/* Queued while a backward runs (FSDP's root waits for its gradient reductions
 * there); run in order by the outermost backward once its graph is done. */
typedef struct { eng_backward_callback_fn fn; void* ud; } bw_callback;
static __thread int t_bw_depth;
static __thread bw_callback* t_cb; static __thread int t_cb_n, t_cb_cap;

int eng_autograd_in_backward(void) { return t_bw_depth; }

int eng_autograd_queue_callback(eng_backward_callback_fn fn, void* ud) {
  if (!fn) return eng_err("queue_callback: no function given");
  if (t_bw_depth == 0) return eng_err("queue_callback: only valid while a backward is running");
  if (t_cb_n == t_cb_cap) {
    int cap = t_cb_cap ? 2 * t_cb_cap : 8;
    bw_callback* c2 = realloc(t_cb, (size_t)cap * sizeof *c2);
    if (!c2) return eng_err("queue_callback: out of memory");
    t_cb = c2; t_cb_cap = cap;
  }
  t_cb[t_cb_n].fn = fn; t_cb[t_cb_n].ud = ud; t_cb_n++;
  return 0;
}

static int backward_graph(int n, eng_tensor** tensors, eng_tensor** grads, int retain_graph, int n_inputs,
                          eng_tensor** inputs, eng_tensor** input_grads);

int eng_backward(int n, eng_tensor** tensors, eng_tensor** grads, int retain_graph, int n_inputs,
                 eng_tensor** inputs, eng_tensor** input_grads) {
  t_bw_depth++;
  int rc = backward_graph(n, tensors, grads, retain_graph, n_inputs, inputs, input_grads);
  if (t_bw_depth == 1) {
    /* callbacks may queue more; each runs once, all run even after a failure
     * (they release what the backward held), the first error wins */
    int prev_mode = eng_set_grad_enabled(0);
    char* first = rc && t_cb_n ? strdup(eng_last_error()) : NULL;
    for (int i = 0; i < t_cb_n; i++) {
      bw_callback cb = t_cb[i];
      if (cb.fn(cb.ud) && rc == 0) { rc = -1; first = strdup(eng_last_error()); }
    }
    if (first) { eng_err("%s", first); free(first); }
    eng_set_grad_enabled(prev_mode);
    t_cb_n = 0;
  }
  t_bw_depth--;
  return rc;
}

static int backward_graph(int n, eng_tensor** tensors, eng_tensor** grads, int retain_graph, int n_inputs,
                          eng_tensor** inputs, eng_tensor** input_grads) {
  if (n < 1 || !tensors) return eng_err("backward: no tensors given");
  graph g = {0};
  int rc = -1;
  int prev_mode = eng_set_grad_enabled(0);
  eng_tensor** roots_grad = calloc((size_t)n, sizeof *roots_grad);
  int* roots = calloc((size_t)n, sizeof *roots);
  int* stack = NULL; int sn = 0, scap = 0;
  if (!roots_grad || !roots) { eng_err("backward: out of memory"); goto done; }
  if (g_grow_table(&g)) { eng_err("backward: out of memory"); goto done; }

  /* roots */
  for (int i = 0; i < n; i++) {
    eng_tensor* t = tensors[i];
    if (!t) { eng_err("backward: tensor %d is nil", i); goto done; }
    if (!t->requires_grad) {
      eng_err("backward: tensor %d (%s) does not require grad and has no grad_fn", i, eng_desc(t));
      goto done;
    }
    eng_tensor* gr = grads ? grads[i] : NULL;
    if (!gr) {
      if ((t->dist && g_dist.numel ? g_dist.numel(t) : t->numel) != 1) {
        eng_err("backward: grad can be implicitly created only for one-element outputs, got %s "
                "(pass a gradient)", eng_desc(t));
        goto done;
      }
      /* a DTensor root gets a DTensor of ones with the adjoint spec (Partial -> Replicate) */
      roots_grad[i] = t->dist && g_dist.ones_grad ? g_dist.ones_grad(t) : eng_tensor_full(t->ndim, t->shape, 1.0, t->dtype, t->device);
    } else {
      if (!eng_same_shape(gr, t)) {
        eng_err("backward: gradient %s does not match output %s", eng_desc(gr), eng_desc(t));
        goto done;
      }
      roots_grad[i] = eng_tensor_retain(gr);
    }
    if (!roots_grad[i]) goto done;
    eng_node* rn;
    if (t->grad_fn) { rn = t->grad_fn; eng_node_retain(rn); }
    else if (!(rn = accumulator(t))) goto done;
    int k = g_find(&g, rn);
    if (k >= 0) eng_node_release(rn);           /* the graph already holds it */
    else if ((k = g_add(&g, rn)) < 0) { eng_node_release(rn); goto done; }
    roots[i] = k;
  }
  /* discover the graph and count dependencies */
  for (int i = 0; i < g.n; i++) {
    if (sn == scap) { scap = scap ? scap * 2 : 256; int* s2 = realloc(stack, (size_t)scap * sizeof *s2); if (!s2) goto oom; stack = s2; }
    stack[sn++] = i;
  }
  while (sn) {
    eng_node* nd = g.st[stack[--sn]].node;
    for (int e = 0; e < nd->n_inputs; e++) {
      eng_node* c = nd->next[e].node;
      if (!c) continue;
      int k = g_find(&g, c);
      if (k < 0) {
        k = g_add(&g, c);
        if (k < 0) goto done;
        eng_node_retain(c);
        if (sn == scap) { scap = scap ? scap * 2 : 256; int* s2 = realloc(stack, (size_t)scap * sizeof *s2); if (!s2) goto oom; stack = s2; }
        stack[sn++] = k;
      }
      g.st[k].deps++;
    }
  }
  /* inputs mode: mark capture points */
  if (n_inputs > 0) {
    for (int j = 0; j < n_inputs; j++) {
      eng_tensor* t = inputs[j];
      if (!t || !t->requires_grad) { eng_err("grad: input %d does not require grad", j); goto done; }
      eng_node* cn = t->grad_fn ? t->grad_fn : t->grad_acc;
      int k = cn ? g_find(&g, cn) : -1;
      if (k >= 0) g.st[k].capture = j + 1;
      input_grads[j] = NULL;
    }
  }
  g.heap = malloc((size_t)(g.n + 1) * sizeof *g.heap);
  if (!g.heap) goto oom;
  for (int i = 0; i < n; i++) if (buf_add(&g.st[roots[i]].buf[tensors[i]->grad_fn ? tensors[i]->output_nr : 0], roots_grad[i])) goto done;
  for (int i = 0; i < n; i++) {
    nstate* s = &g.st[roots[i]];
    if (s->deps == 0 && !s->queued) { s->queued = 1; heap_push(&g, roots[i]); }
  }
  while (g.hn) {
    int k = heap_pop(&g);
    nstate* s = &g.st[k];
    eng_node* nd = s->node;
    int any = 0;
    for (int j = 0; j < nd->n_outputs; j++) if (s->buf[j]) any = 1;
    eng_tensor** gi = NULL;
    if (any) {
      /* gradient hooks registered on the outputs of this node */
      if (nd->pre_hooks)
        for (eng_hook* h = nd->pre_hooks->head; h; h = h->next)
          if (h->output_nr < nd->n_outputs && s->buf[h->output_nr] && hook_call(h, NULL, &s->buf[h->output_nr])) {
            eng_err_prefix("backward: in a hook on an output of %s", nd->name);
            goto done;
          }
      if (s->capture) {
        int j = s->capture - 1;
        eng_tensor* t = inputs[j];
        eng_tensor* cg = s->buf[t->grad_fn ? t->output_nr : 0];
        input_grads[j] = cg ? eng_tensor_retain(cg) : NULL;
      }
      int skip = n_inputs > 0 && nd->leaf;  /* grad(): never touch .grad */
      if (!skip) {
        if (nd->released && nd->n_saved > 0 && !nd->leaf) {
          eng_err("backward: trying to backward through %s a second time (saved tensors were freed "
                  "after the first backward; pass retain_graph = true)", nd->name);
          goto done;
        }
        if (nd->n_inputs) {
          gi = calloc((size_t)nd->n_inputs, sizeof *gi);
          if (!gi) goto oom;
        }
        eng_clear_error();
        graph* prev_graph = t_graph;
        eng_node* prev_node = t_node;
        t_graph = &g; t_node = nd;
        int64_t prof = eng_profiler_enabled() ? eng_profiler_begin(nd->name) : -1;
        int brc = nd->dist && g_dist.node_backward ? g_dist.node_backward(nd, s->buf, gi) : nd->backward(nd, s->buf, gi);
        if (prof >= 0) eng_profiler_end(prof, 0);
        t_graph = prev_graph; t_node = prev_node;
        if (brc) {
          if (!eng_last_error()[0]) eng_err("failed");
          eng_err_prefix("backward: in %s", nd->name);
          for (int e = 0; e < nd->n_inputs; e++) eng_tensor_release(gi[e]);
          free(gi);
          goto done;
        }
      }
    }
    for (int j = 0; j < nd->n_outputs; j++) { eng_tensor_release(s->buf[j]); s->buf[j] = NULL; }
    for (int e = 0; e < nd->n_inputs; e++) {
      eng_node* c = nd->next[e].node;
      eng_tensor* ge = gi ? gi[e] : NULL;
      if (!c) { eng_tensor_release(ge); continue; }
      int ck = g_find(&g, c);
      nstate* cs = &g.st[ck];
      if (ge) {
        if (check_grad_shape(nd, e, ge) || buf_add(&cs->buf[nd->next[e].input_nr], ge)) {
          eng_tensor_release(ge);
          for (int r = e + 1; r < nd->n_inputs; r++) eng_tensor_release(gi[r]);
          free(gi);
          goto done;
        }
        eng_tensor_release(ge);
      }
      if (--cs->deps == 0 && !cs->queued && !nd->edges_last_first) { cs->queued = 1; heap_push(&g, ck); }
    }
    for (int e = nd->n_inputs - 1; e >= 0 && nd->edges_last_first; e--) { /* see eng_node.edges_last_first */
      int ck = nd->next[e].node ? g_find(&g, nd->next[e].node) : -1;
      if (ck >= 0 && g.st[ck].deps == 0 && !g.st[ck].queued) { g.st[ck].queued = 1; heap_push(&g, ck); }
    }
    free(gi);
    if (!retain_graph && !nd->leaf) { release_saved(nd); nd->released = 1; }
  }
  rc = 0;
  goto done;
oom:
  eng_err("backward: out of memory");
done:
  if (rc && n_inputs > 0 && input_grads)
    for (int j = 0; j < n_inputs; j++) { eng_tensor_release(input_grads[j]); input_grads[j] = NULL; }
  graph_free(&g);
  if (roots_grad) for (int i = 0; i < n; i++) eng_tensor_release(roots_grad[i]);
  free(roots_grad); free(roots); free(stack);
  eng_set_grad_enabled(prev_mode);
  return rc;
}


/* ---------------------------------------------------------------- tensor release */
/* What autograd keeps on a dying tensor: its retain_grad hook, its grad_fn, its hooks (core calls this through
 * the function registered below: core does not call autograd). */
static void free_autograd_state(eng_tensor* t) {
  if (t->retains_grad) eng_tensor_drop_retain_hook(t);
  if (t->grad_fn) eng_node_release(t->grad_fn);
  eng_hook_list_free(t->hooks);
  eng_hook_list_free(t->post_hooks);
}

__attribute__((constructor)) static void register_autograd_free(void) { eng_tensor_set_autograd_free(free_autograd_state); }
