/* dispatch.c: the DTensor op dispatcher (sharding propagation, as
 * PyTorch's _dispatch.py + _sharding_prop.py).  See sharding/sharding.h for how rules
 * are written.  Flow of eng_dispatch:
 *   1. check the arguments (mixed DTensor/Tensor, meshes), take plain 0-d
 *      one-element tensors as Replicate, wait for pending async results;
 *   2. look the selection up in a per-thread cache keyed by (op def, input
 *      spec hashes, ints, scalars when the def asks, needs_grad); on a miss run
 *      the rule once per mesh dim and pick the cheapest candidate per mesh dim
 *      (redistribute cost of the inputs' current placements to the required
 *      ones), then build the required input specs, output specs and their
 *      adjoint specs;
 *   3. redistribute the inputs (autograd-recorded, Replicate -> Partial allowed);
 *   4. run the local function in local mode inside a "local region": every
 *      autograd node created meanwhile is marked with the adjoint specs of the
 *      op's DTensor inputs it consumes, and the nodes producing the outputs with
 *      the adjoint specs of the outputs' gradients;
 *   5. wrap the outputs with the output specs.
 * A marked node's backward (dist_node_backward) redistributes incoming
 * DTensor grads to the output adjoint specs, runs the node's backward in local
 * mode on plain views and wraps the grads of the op's inputs with their
 * adjoint specs.  AccumulateGrad of a DTensor leaf redistributes the gradient
 * to the leaf's spec (dist_grad_for_leaf). */
#include "dtensor/dtensor_impl.h"
#include "autograd/dist_hooks.h"
#include "dtensor/dispatch.h"
#include <math.h>
#include <stdio.h>

/* ------------------------------------------------------------------ messages */
static const char* call_name(const eng_op_def* def, const eng_op_call* c) {
  return c->name ? c->name : def->name;
}

/* "DTensor(f32[8,4] on mesh(4) [Shard(1)]), f32[4], None" */
static const char* layouts(const eng_op_call* c, char* buf, int cap) {
  int k = 0;
  buf[0] = 0;
  for (int i = 0; i < c->n_in && k < cap; i++) {
    const eng_tensor* t = c->in[i];
    char one[600];
    if (!t) snprintf(one, sizeof one, "None");
    else if (t->dist) {
      char s[560];
      snprintf(one, sizeof one, "DTensor(%s)", eng_dist_spec_describe(t->dist, t->dtype, s, sizeof s));
    } else snprintf(one, sizeof one, "%s", eng_desc(t));
    k += snprintf(buf + k, cap - k, "%s%s", i ? ", " : "", one);
  }
  return buf;
}

eng_tensor* eng_no_rule(const char* name, const eng_op_call* c) {
  char b[2048];
  return eng_errp("%s: no sharding strategy registered for DTensor arguments (%s)", name, layouts(c, b, sizeof b));
}

int eng_no_rule_i(const char* name, const eng_op_call* c) {
  eng_no_rule(name, c);
  return -1;
}

/* Partial(sum) or Partial(avg): a scaling in place keeps it. */
static int linear_partial(const eng_placement* p) {
  return p->kind == ENG_PLACEMENT_PARTIAL && (p->op == ENG_REDUCE_SUM || p->op == ENG_REDUCE_AVG);
}

/* ------------------------------------------------------------------ cost */
#define COST_INF 1e30

/* Bytes of the logical tensor on mesh dim m: the global tensor divided by the
 * other mesh dims where it is currently sharded. */
static double logical_bytes(const eng_dist_spec* s, int dtype, int m) {
  double b = (double)s->numel * eng_dtype_size(dtype);
  for (int j = 0; j < s->mesh_ndim; j++)
    if (j != m && dt_is_shard_like(&s->placements[j])) b /= (double)s->mesh_shape[j];
  return b;
}

/* alpha-beta like PyTorch's redistribute_cost; R->S and R->P (local work, no
 * communication) get a tiny cost so that a candidate needing no change wins.
 * A _StridedShard changes through Replicate: from it, an all_gather (then
 * local work); to it, what reaching Replicate costs (P: an all_reduce). */
static double move_cost(const eng_placement* cur, const eng_placement* req, double bytes, int k) {
  if (eng_placement_equal(cur, req)) return 0;
  if (req->kind == ENG_PLACEMENT_PARTIAL && cur->kind != ENG_PLACEMENT_REPLICATE) return COST_INF;
  if (k <= 1) return 1e-12; /* one rank on this mesh dim: every change is free (but prefer none) */
  double f = k > 1 ? (double)(k - 1) / k : 0;
  double local = 1e-3 * bytes / (k > 0 ? k : 1) + 1e-9;
  switch (cur->kind) {
    case ENG_PLACEMENT_REPLICATE: return local;                      /* R->S chunk, R->P internal */
    case ENG_PLACEMENT_SHARD:
    case ENG_PLACEMENT_STRIDED_SHARD:
      if (req->kind == ENG_PLACEMENT_PARTIAL) return COST_INF;
      return f * bytes + 1e-6;                                      /* S->R all_gather, S->S all_to_all */
    case ENG_PLACEMENT_PARTIAL:
      if (req->kind == ENG_PLACEMENT_PARTIAL) return COST_INF;       /* P(op1) -> P(op2) */
      if (req->kind == ENG_PLACEMENT_SHARD) return f * bytes + 1e-6; /* reduce_scatter */
      return 2 * f * bytes + 1e-6;                                  /* all_reduce */
  }
  return COST_INF;
}

/* The cost model as users see it (PyTorch's redistribute_cost, A9): the sum
 * over mesh dims of moving t's placement to the target's on that dim, with
 * the logical bytes of t's current layout; INFINITY for another mesh or a
 * change that cannot be made (S->P, P(op1)->P(op2)). */
int eng_dtensor_redistribute_cost(const eng_tensor* t, const eng_mesh* mesh, int n, const eng_placement* pl,
                                  double* out) {
  const char* op = "redistribute_cost";
  ENG_CHECK_I(t, op);
  if (!out) return eng_err("%s: output is NULL", op);
  if (!t->dist) return eng_err("%s: %s is not a DTensor", op, eng_desc(t));
  const eng_dist_spec* s = t->dist;
  if (mesh && mesh != s->mesh && !eng_mesh_equal(mesh, s->mesh)) { *out = INFINITY; return 0; }
  eng_placement norm[ENG_MAX_DIMS];
  if (!pl) return eng_err("%s: placements is needed", op);
  if (dt_check_placements(op, s->mesh, n, pl, s->ndim, norm)) return -1;
  double cost = 0;
  for (int m = 0; m < s->mesh_ndim && cost < COST_INF; m++)
    cost += move_cost(&s->placements[m], &norm[m], logical_bytes(s, t->dtype, m), (int)s->mesh_shape[m]);
  *out = cost >= COST_INF ? INFINITY : cost;
  return 0;
}

/* ------------------------------------------------------------------ cache */
typedef struct cache_entry {
  const eng_op_def* def;
  uint64_t h;
  int n_in, needs_grad;
  int64_t ints[8];
  double scalars[4];
  eng_dist_spec* key[ENG_OP_MAX_IN];
  eng_dist_spec* req[ENG_OP_MAX_IN];
  eng_dist_spec* in_adj[ENG_OP_MAX_IN];
  eng_dist_spec* out[ENG_OP_MAX_OUT];
  eng_dist_spec* out_adj[ENG_OP_MAX_OUT];
} cache_entry;

#define CACHE_CAP 1024
static __thread cache_entry** t_cache;
static __thread int t_cache_n;

static void entry_free(cache_entry* e) {
  for (int i = 0; i < ENG_OP_MAX_IN; i++) {
    eng_dist_spec_release(e->key[i]); eng_dist_spec_release(e->req[i]); eng_dist_spec_release(e->in_adj[i]);
  }
  for (int j = 0; j < ENG_OP_MAX_OUT; j++) { eng_dist_spec_release(e->out[j]); eng_dist_spec_release(e->out_adj[j]); }
  free(e);
}

static uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  return h * 0x100000001B3ull;
}

static uint64_t call_hash(const eng_op_def* def, const eng_op_call* c, eng_dist_spec* const* specs) {
  uint64_t h = mix(1469598103934665603ull, (uint64_t)(uintptr_t)def);
  h = mix(h, (uint64_t)c->n_in * 2 + (uint64_t)c->needs_grad);
  for (int i = 0; i < c->n_in; i++) h = mix(h, specs[i] ? specs[i]->hash : 0x55);
  for (int i = 0; i < 8; i++) h = mix(h, (uint64_t)c->ints[i]);
  if (def->scalars_in_key)
    for (int i = 0; i < 4; i++) { uint64_t b; memcpy(&b, &c->scalars[i], 8); h = mix(h, b); }
  return h;
}

static cache_entry* cache_find(const eng_op_def* def, const eng_op_call* c, eng_dist_spec* const* specs, uint64_t h) {
  if (!t_cache) return NULL;
  unsigned i = (unsigned)(h & (CACHE_CAP - 1));
  for (int probe = 0; probe < CACHE_CAP && t_cache[i]; probe++, i = (i + 1) & (CACHE_CAP - 1)) {
    cache_entry* e = t_cache[i];
    if (e->h != h || e->def != def || e->n_in != c->n_in || e->needs_grad != c->needs_grad) continue;
    if (memcmp(e->ints, c->ints, sizeof e->ints)) continue;
    if (def->scalars_in_key && memcmp(e->scalars, c->scalars, sizeof e->scalars)) continue;
    int ok = 1;
    /* the same mesh OBJECT, not only an equal one: the cached specs carry their mesh, whose groups the
     * redistributions and outputs use; two meshes over the same ranks (each with its own groups) compare
     * equal, and a hit on one rank where another rank's cache (flushed at other times: ranks dispatch
     * different numbers of ops) misses sent the ranks' collectives to different groups: a deadlock */
    for (int k = 0; ok && k < c->n_in; k++)
      ok = (!e->key[k] && !specs[k]) ||
           (e->key[k] && specs[k] && e->key[k]->mesh == specs[k]->mesh && eng_dist_spec_equal(e->key[k], specs[k]));
    if (ok) return e;
  }
  return NULL;
}

static void cache_insert(cache_entry* e) {
  if (!t_cache) {
    t_cache = calloc(CACHE_CAP, sizeof *t_cache);
    if (!t_cache) { entry_free(e); return; }
  }
  if (t_cache_n >= CACHE_CAP / 2) {
    for (int i = 0; i < CACHE_CAP; i++) if (t_cache[i]) { entry_free(t_cache[i]); t_cache[i] = NULL; }
    t_cache_n = 0;
  }
  unsigned i = (unsigned)(e->h & (CACHE_CAP - 1));
  while (t_cache[i]) i = (i + 1) & (CACHE_CAP - 1);
  t_cache[i] = e;
  t_cache_n++;
}

/* ------------------------------------------------------------------ selection */
/* Adjoint spec of an input gradient (sharding.md, Mechanism 4). */
static eng_dist_spec* input_adjoint(const eng_dist_spec* req, const eng_strategy* chosen_unused, int n_out,
                                    eng_dist_spec* const* outs) {
  (void)chosen_unused;
  eng_placement pl[ENG_MAX_DIMS];
  int same = 1;
  for (int m = 0; m < req->mesh_ndim; m++) {
    eng_placement p = req->placements[m];
    if (p.kind == ENG_PLACEMENT_PARTIAL) p = (eng_placement){ENG_PLACEMENT_REPLICATE, 0, 0};
    else if (p.kind == ENG_PLACEMENT_REPLICATE) {
      int out_rep = 1;
      for (int j = 0; j < n_out; j++) if (outs[j] && outs[j]->placements[m].kind != ENG_PLACEMENT_REPLICATE) out_rep = 0;
      if (!out_rep) p = (eng_placement){ENG_PLACEMENT_PARTIAL, 0, ENG_REDUCE_SUM};
    }
    if (!eng_placement_equal(&p, &req->placements[m])) same = 0;
    pl[m] = p;
  }
  if (same) return eng_dist_spec_retain((eng_dist_spec*)req);
  return dt_spec_make(req->mesh, pl, req->ndim, req->shape, req->stride);
}

static cache_entry* select_strategy(const eng_op_def* def, const eng_op_call* c, eng_dist_spec* const* specs,
                                    const char* name) {
  const eng_dist_spec* first = NULL;
  for (int i = 0; i < c->n_in; i++) if (specs[i]) { first = specs[i]; break; }
  int mnd = first->mesh_ndim;
  eng_strategy chosen[ENG_MAX_DIMS];
  for (int m = 0; m < mnd; m++) {
    eng_strategy cand[64];
    memset(cand, 0, sizeof cand);
    int n = def->rule(c, (const eng_dist_spec* const*)specs, m, cand, 64);
    if (n < 0) { eng_err_prefix("%s", name); return NULL; }
    int best = -1;
    double best_cost = COST_INF;
    for (int k = 0; k < n; k++) {
      double cost = 0;
      for (int i = 0; i < c->n_in && cost < COST_INF; i++) {
        if (!specs[i]) continue;
        cost += move_cost(&specs[i]->placements[m], &cand[k].in[i], logical_bytes(specs[i], c->in[i]->dtype, m),
                          (int)specs[i]->mesh_shape[m]);
      }
      if (cost < best_cost) { best_cost = cost; best = k; }
    }
    if (best < 0) {
      char b[2048];
      eng_err("%s: no sharding strategy for %s (mesh dim %d)", name, layouts(c, b, sizeof b), m + dt_base());
      return NULL;
    }
    chosen[m] = cand[best];
  }
  int ondim[ENG_OP_MAX_OUT] = {0};
  int64_t oshape[ENG_OP_MAX_OUT][8];
  memset(oshape, 0, sizeof oshape);
  if (def->shape(c, (const eng_dist_spec* const*)specs, ondim, oshape)) { eng_err_prefix("%s", name); return NULL; }
  cache_entry* e = calloc(1, sizeof *e);
  if (!e) return eng_errp("%s: out of memory", name);
  e->def = def; e->n_in = c->n_in; e->needs_grad = c->needs_grad;
  memcpy(e->ints, c->ints, sizeof e->ints);
  memcpy(e->scalars, c->scalars, sizeof e->scalars);
  eng_placement pl[ENG_MAX_DIMS];
  for (int j = 0; j < def->n_out; j++) {
    for (int m = 0; m < mnd; m++) pl[m] = chosen[m].out[j];
    for (int m = 0; m < mnd; m++)
      if (pl[m].kind == ENG_PLACEMENT_SHARD && (pl[m].dim < 0 || pl[m].dim >= ondim[j])) {
        entry_free(e);
        return eng_errp("%s: sharding rule produced Shard(%d) for a %d-d output", name, pl[m].dim + dt_base(), ondim[j]);
      }
    e->out[j] = dt_spec_make(first->mesh, pl, ondim[j], oshape[j], NULL);
    e->out_adj[j] = e->out[j] ? dt_spec_adjoint(e->out[j]) : NULL;
    if (!e->out_adj[j]) { entry_free(e); return NULL; }
  }
  for (int i = 0; i < c->n_in; i++) {
    if (!specs[i]) continue;
    e->key[i] = eng_dist_spec_retain(specs[i]);
    int same = 1;
    for (int m = 0; m < mnd; m++) {
      pl[m] = chosen[m].in[i];
      if (pl[m].kind == ENG_PLACEMENT_SHARD && (pl[m].dim < 0 || pl[m].dim >= specs[i]->ndim)) {
        entry_free(e);
        return eng_errp("%s: sharding rule required Shard(%d) of a %d-d input", name, pl[m].dim + dt_base(), specs[i]->ndim);
      }
      if (!eng_placement_equal(&pl[m], &specs[i]->placements[m])) same = 0;
    }
    e->req[i] = same ? eng_dist_spec_retain(specs[i]) : dt_spec_make(first->mesh, pl, specs[i]->ndim, specs[i]->shape, specs[i]->stride);
    e->in_adj[i] = e->req[i] ? input_adjoint(e->req[i], NULL, def->n_out, e->out) : NULL;
    if (!e->in_adj[i]) { entry_free(e); return NULL; }
  }
  e->h = call_hash(def, c, specs);
  return e;
}

/* ------------------------------------------------------------------ local regions */
typedef struct region {
  uint64_t id;
  int n;
  eng_tensor* const* in;
  eng_dist_spec* const* adj;
} region;

static __thread region* t_region;
static uint64_t g_region_id;

struct eng_node_dist {
  uint64_t region;
  int n_in, n_out;
  eng_dist_spec** in_adj;
  eng_dist_spec** out_adj;
};

static void dist_mark_node(eng_node* n, int n_inputs, eng_tensor** inputs) {
  region* r = t_region;
  if (!r || !n || n->dist) return;
  struct eng_node_dist* d = calloc(1, sizeof *d + sizeof(eng_dist_spec*) * (size_t)(n_inputs + n->n_outputs));
  if (!d) return;
  d->region = r->id;
  d->n_in = n_inputs; d->n_out = n->n_outputs;
  d->in_adj = (eng_dist_spec**)(d + 1);
  d->out_adj = d->in_adj + n_inputs;
  for (int i = 0; i < n_inputs && inputs; i++)
    for (int j = 0; j < r->n; j++)
      if (inputs[i] && inputs[i] == r->in[j] && r->adj[j]) { d->in_adj[i] = eng_dist_spec_retain(r->adj[j]); break; }
  n->dist = d;
}

static void dist_node_free(struct eng_node_dist* d) {
  if (!d) return;
  for (int i = 0; i < d->n_in + d->n_out; i++) eng_dist_spec_release(d->in_adj[i]);
  free(d);
}

static int dist_node_backward(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  struct eng_node_dist* d = n->dist;
  eng_tensor* lg[64] = {0};
  eng_tensor** lgp = n->n_outputs <= 64 ? lg : calloc((size_t)n->n_outputs, sizeof *lgp);
  if (!lgp) return eng_err("%s: out of memory", n->name);
  int rc = 0;
  for (int j = 0; j < n->n_outputs && !rc; j++) {
    eng_tensor* g = go[j];
    if (!g) continue;
    if (!g->dist) { lgp[j] = eng_tensor_retain(g); continue; }
    if (eng_dtensor_wait(g)) { rc = -1; break; }
    eng_dist_spec* want = j < d->n_out ? d->out_adj[j] : NULL;
    if (want && !eng_dist_spec_equal(g->dist, want)) lgp[j] = dt_redistribute_local(g, g->dist, want, 0, 1);
    else lgp[j] = dt_plain(g);
    if (!lgp[j]) rc = -1;
  }
  if (!rc) {
    int prev = eng_dispatch_set_local_mode(1);
    rc = n->backward(n, lgp, gi);
    eng_dispatch_set_local_mode(prev);
  }
  for (int j = 0; j < n->n_outputs; j++) eng_tensor_release(lgp[j]);
  if (lgp != lg) free(lgp);
  if (rc) return -1;
  for (int i = 0; i < n->n_inputs && i < d->n_in; i++) {
    if (!gi[i] || !d->in_adj[i]) continue;
    eng_tensor* r = dt_plain(gi[i]);
    if (!r) return -1;
    eng_tensor_release(gi[i]);
    dt_attach(r, d->in_adj[i]);
    gi[i] = r;
  }
  return 0;
}

/* The gradient of a leaf takes the leaf's spec with every Partial replaced by
 * Replicate (the adjoint: a gradient is never a Partial sum, PyTorch's
 * Redistribute.backward; a Replicate gradient relabelled Partial would count
 * the gradient once per rank). */
/* Leaves whose gradients a bucketing reducer sums (eng_dtensor_set_grad_deferred): a small set of pointers (the
 * reducer holds a reference to each until it unmarks them). */
static eng_tensor** g_deferred;
static int g_ndeferred, g_capdeferred;

static int deferred_find(const eng_tensor* t) {
  for (int i = 0; i < g_ndeferred; i++) if (g_deferred[i] == t) return i;
  return -1;
}

int eng_dtensor_set_grad_deferred(eng_tensor* leaf, int on) {
  ENG_CHECK_I(leaf, "set_grad_deferred");
  int i = deferred_find(leaf), prev = i >= 0;
  if (on && !prev) {
    if (!leaf->dist) return eng_err("set_grad_deferred: %s is not a DTensor", eng_desc(leaf));
    if (g_ndeferred == g_capdeferred) {
      int cap = g_capdeferred ? 2 * g_capdeferred : 64;
      eng_tensor** n = realloc(g_deferred, (size_t)cap * sizeof *n);
      if (!n) return eng_err("set_grad_deferred: out of memory");
      g_deferred = n; g_capdeferred = cap;
    }
    g_deferred[g_ndeferred++] = leaf;
  } else if (!on && prev) {
    g_deferred[i] = g_deferred[--g_ndeferred];
  }
  return prev;
}

/* A deferred leaf's gradient: this rank's partial sum in the leaf's layout, no communication.  The gradient goes to
 * Partial(sum) on every mesh dim where the leaf is Replicate (Partial stays, Replicate keeps its values on the first
 * rank of the dim and zeros elsewhere: local steps) and is labelled with the leaf's spec; the reducer's all_reduce
 * (sum) over the group makes it the reduced value. */
static eng_tensor* deferred_grad(eng_tensor* g, eng_dist_spec* want) {
  eng_placement pl[ENG_MAX_DIMS];
  for (int i = 0; i < want->mesh_ndim; i++) {
    pl[i] = want->placements[i];
    if (pl[i].kind == ENG_PLACEMENT_REPLICATE) { memset(&pl[i], 0, sizeof pl[i]); pl[i].kind = ENG_PLACEMENT_PARTIAL; pl[i].op = ENG_REDUCE_SUM; }
  }
  eng_dist_spec* part = dt_spec_make(want->mesh, pl, want->ndim, want->shape, want->stride);
  if (!part) return NULL;
  eng_tensor* r = NULL;
  /* a plain gradient is in the leaf's layout (the reduced value, as AccumulateGrad takes it) */
  const eng_dist_spec* src = g->dist ? g->dist : want;
  if (!g->dist || eng_dtensor_wait(g) == 0) {
    if (eng_dist_spec_equal(src, part)) r = dt_plain(g);
    else {
      eng_tensor* p = dt_redistribute_local(g, src, part, 0, 0); /* forward rule: R -> P divides by the dim size */
      r = p ? dt_plain(p) : NULL;
      eng_tensor_release(p);
    }
  }
  eng_dist_spec_release(part);
  return r;
}

static eng_tensor* dist_grad_for_leaf(eng_tensor* leaf, eng_tensor* g) {
  if (!g) return NULL;
  if (!leaf->dist) return eng_tensor_retain(g);
  eng_dist_spec* want = dt_spec_adjoint(leaf->dist);
  if (!want) return NULL;
  eng_tensor* r = NULL;
  if (g_ndeferred && deferred_find(leaf) >= 0) {
    if (!(r = deferred_grad(g, want))) eng_err_prefix("AccumulateGrad");
    else dt_attach(r, want);
  } else if (g->dist && eng_dist_spec_equal(g->dist, want)) r = eng_tensor_retain(g);
  else {
    if (g->dist) {
      if (eng_dtensor_wait(g) == 0) r = dt_redistribute_local(g, g->dist, want, 0, 1);
    } else r = dt_plain(g);
    if (!r) eng_err_prefix("AccumulateGrad");
    else dt_attach(r, want);
  }
  eng_dist_spec_release(want);
  return r;
}

/* ------------------------------------------------------------------ dispatch */
static int is_scalar_plain(const eng_tensor* t) { return t && !t->dist && t->ndim == 0 && t->numel == 1; }

/* Checks the arguments; plain scalars become Replicate DTensors (new
 * references in conv[i]; others NULL). */
static int prepare(const char* name, eng_op_call* c, eng_tensor** conv) {
  const eng_tensor* first = NULL;
  for (int i = 0; i < c->n_in; i++) if (c->in[i] && c->in[i]->dist) { first = c->in[i]; break; }
  if (!first) return eng_err("%s: dispatcher called without DTensor arguments", name);
  char a[700], b[160], m1[160], m2[160];
  for (int i = 0; i < c->n_in; i++) {
    eng_tensor* t = c->in[i];
    if (!t) continue;
    if (!t->dist) {
      if (is_scalar_plain(t) || eng_dtensor_implicit_replication()) continue; /* R3: implicit_replication */
      char s[600];
      snprintf(a, sizeof a, "DTensor(%s)", eng_dist_spec_describe(first->dist, first->dtype, s, sizeof s));
      snprintf(b, sizeof b, "%s", eng_desc(t));
      return eng_err("%s: mixed DTensor and Tensor arguments: %s and %s (distribute the tensor, or pass a 0-d "
                     "one-element tensor or a number)", name, a, b);
    }
    if (t->dist->mesh != first->dist->mesh && !eng_mesh_equal(t->dist->mesh, first->dist->mesh)) {
      char note[700];
      return eng_err("%s: DTensor arguments on different device meshes: %s and %s%s", name,
                     dt_mesh_str(first->dist->mesh, m1, sizeof m1), dt_mesh_str(t->dist->mesh, m2, sizeof m2),
                     dt_mesh_diff_note(first->dist->mesh, t->dist->mesh, note, sizeof note));
    }
    if (eng_dtensor_wait(t)) return -1;
  }
  for (int i = 0; i < c->n_in; i++) {
    eng_tensor* t = c->in[i];
    if (!t || t->dist) continue;
    conv[i] = eng_dtensor_from_local(t, first->dist->mesh, first->dist->mesh_ndim, NULL, 0, NULL, NULL);
    if (!conv[i]) { eng_err_prefix("%s", name); return -1; }
    c->in[i] = conv[i];
  }
  return 0;
}

/* The rules know Shard, Replicate and Partial only: an argument with a
 * _StridedShard is first redistributed (autograd-recorded) to Replicate on
 * those mesh dims, one all_gather each (the same tensor passed twice is
 * gathered once).  New references in conv[i]. */
static int replicate_strided(const char* name, const eng_op_def* def, eng_op_call* c, eng_tensor** conv) {
  eng_tensor* orig[ENG_OP_MAX_IN] = {0};
  if (def->keeps_strided && c->n_in == 1) return 0; /* its rule takes the _StridedShard as it is */
  int any = 0;
  for (int i = 0; i < c->n_in; i++) if (c->in[i] && c->in[i]->dist && c->in[i]->dist->has_strided) any = 1;
  if (!any) return 0;
  { /* shape errors before any communication (shape functions read global shapes only) */
    eng_dist_spec* specs[ENG_OP_MAX_IN] = {0};
    for (int i = 0; i < c->n_in; i++) specs[i] = c->in[i] ? c->in[i]->dist : NULL;
    int ondim[ENG_OP_MAX_OUT] = {0};
    int64_t oshape[ENG_OP_MAX_OUT][8];
    if (def->shape(c, (const eng_dist_spec* const*)specs, ondim, oshape)) {
      char b[2048];
      eng_err_prefix("%s: (%s)", name, layouts(c, b, sizeof b));
      return -1;
    }
  }
  for (int i = 0; i < c->n_in; i++) {
    eng_tensor* t = c->in[i];
    orig[i] = t;
    if (!t || !t->dist || !t->dist->has_strided) continue;
    eng_tensor* r = NULL;
    for (int j = 0; j < i && !r; j++) if (orig[j] == t && conv[j]) r = eng_tensor_retain(conv[j]);
    if (!r) {
      const eng_dist_spec* s = t->dist;
      eng_placement pl[ENG_MAX_DIMS];
      for (int m = 0; m < s->mesh_ndim; m++)
        pl[m] = s->placements[m].kind == ENG_PLACEMENT_STRIDED_SHARD ? dt_replicate() : s->placements[m];
      eng_dist_spec* to = dt_spec_make(s->mesh, pl, s->ndim, s->shape, s->stride);
      r = to ? eng_dtensor_redistribute_spec(t, to, 0) : NULL;
      eng_dist_spec_release(to);
      if (!r) {
        char b[2048];
        eng_err_prefix("%s: replicating the _StridedShard mesh dims of argument %d (%s)", name, i + dt_base(),
                       layouts(c, b, sizeof b));
        return -1;
      }
    }
    eng_tensor_release(conv[i]);
    conv[i] = r;
    c->in[i] = r;
  }
  return 0;
}

static int any_dtensor(const eng_op_call* c) {
  for (int i = 0; i < c->n_in; i++) if (c->in[i] && c->in[i]->dist) return 1;
  return 0;
}

/* An op whose local function checks per-rank data (def->agree_local): every
 * mesh dim where an input is not Replicate agrees on the local result, in
 * mesh-dim order (the same on every rank, as the layouts are).  Returns -1
 * (error set, naming the failing rank) when any rank of those groups failed. */
static int agree_local_result(const eng_op_def* def, int n_in, eng_dist_spec* const* req, int lrc) {
  const eng_dist_spec* any = NULL;
  for (int i = 0; i < n_in && !any; i++) if (req[i]) any = req[i];
  if (!any) return lrc ? -1 : 0;
  int state = lrc ? 1 : 0;
  for (int m = 0; m < any->mesh_ndim; m++) {
    int differs = 0;
    for (int i = 0; i < n_in; i++)
      if (req[i] && req[i]->placements[m].kind != ENG_PLACEMENT_REPLICATE) differs = 1;
    if (!differs) continue;
    eng_pg* g = eng_mesh_get_group(any->mesh, m);
    if (!g) return -1;
    if (eng_pg_agree(g, state, 0, def->name) && !state) state = 2;
    eng_pg_release(g);
  }
  return state ? -1 : 0;
}

static int empty_outputs(const cache_entry* e, int n_out, int dtype, eng_tensor** outs) {
  int64_t z[ENG_MAX_DIMS] = {0};
  int dev = eng_mesh_device(e->out[0]->mesh);
  for (int j = 0; j < n_out; j++) {
    eng_tensor_release(outs[j]);
    outs[j] = eng_new(e->out[j]->ndim, z, j == 1 && n_out == 2 ? ENG_I64 : dtype, dev);
    if (!outs[j]) return -1;
  }
  return 0;
}

int eng_dispatch_multi(const eng_op_def* def, eng_op_call* c, eng_tensor** outs) {
  const char* name = call_name(def, c);
  eng_tensor* conv[ENG_OP_MAX_IN] = {0};
  eng_tensor* rin[ENG_OP_MAX_IN] = {0};
  int n_out = def->n_out;
  for (int j = 0; j < n_out; j++) outs[j] = NULL;
  int rc = -1;
  if (c->n_in > ENG_OP_MAX_IN) return eng_err("%s: too many tensor inputs for the dispatcher", name);
  int meta = eng_meta_any(c);
  if (meta && !any_dtensor(c)) return eng_meta_outputs(def, c, NULL, outs); /* shapes and dtypes only */
  if (prepare(name, c, conv) || replicate_strided(name, def, c, conv)) goto done;
  c->needs_grad = eng_any_requires_grad(c->n_in, c->in);
  eng_dist_spec* specs[ENG_OP_MAX_IN] = {0};
  for (int i = 0; i < c->n_in; i++) specs[i] = c->in[i] ? c->in[i]->dist : NULL;
  uint64_t h = call_hash(def, c, specs);
  cache_entry* e = cache_find(def, c, specs, h);
  if (!e) {
    e = select_strategy(def, c, specs, name);
    if (!e) goto done;
    cache_insert(e);
    if (!cache_find(def, c, specs, h)) { /* could not be cached (out of memory): use once */ }
  }
  /* redistribute the inputs */
  for (int i = 0; i < c->n_in; i++) {
    eng_tensor* t = c->in[i];
    if (!t) continue;
    if (eng_dist_spec_equal(t->dist, e->req[i])) rin[i] = eng_tensor_retain(t);
    else {
      rin[i] = eng_dtensor_redistribute_spec(t, e->req[i], 2);
      if (!rin[i]) { eng_err_prefix("%s", name); goto done; }
    }
  }
  /* run the local function inside a local region */
  eng_op_call lc = *c;
  for (int i = 0; i < c->n_in; i++) lc.in[i] = rin[i];
  region r;
  r.id = __atomic_add_fetch(&g_region_id, 1, __ATOMIC_RELAXED);
  r.n = c->n_in; r.in = rin; r.adj = e->in_adj;
  region* prev_region = t_region;
  t_region = &r;
  int prev_mode = eng_dispatch_set_local_mode(1);
  int lrc;
  if (meta) lrc = eng_meta_outputs(def, &lc, e->out, outs); /* meta DTensors: the chosen layout's local shapes */
  else if (def->local) lrc = def->local(&lc, (const eng_dist_spec* const*)e->req, (const eng_dist_spec* const*)e->out, outs);
  else { outs[0] = def->fn(&lc); lrc = outs[0] ? 0 : -1; }
  eng_dispatch_set_local_mode(prev_mode);
  t_region = prev_region;
  int member = e->out[0]->member;
  if (lrc && !member) { /* ranks outside the mesh: empty outputs */
    eng_clear_error();
    int dt = ENG_F32;
    for (int i = 0; i < c->n_in; i++) if (c->in[i]) { dt = c->in[i]->dtype; break; }
    lrc = empty_outputs(e, n_out, dt, outs);
  }
  if (def->agree_local && member && !meta && agree_local_result(def, c->n_in, e->req, lrc)) lrc = -1;
  if (lrc) { eng_err_prefix("%s", name); goto done; }
  for (int j = 0; j < n_out; j++) {
    eng_tensor* o = outs[j];
    if (!o) continue;
    if (o->dist) { /* the local function returned an input tensor itself */
      if (eng_dist_spec_equal(o->dist, e->out[j])) continue;
      eng_err("%s: the local function returned an input whose layout differs from the output's", name);
      goto done;
    }
    if (eng_dtensor_wrap_output(o, e->out[j])) { eng_err_prefix("%s", name); goto done; }
    eng_node* gn = o->grad_fn;
    if (gn && gn->dist && gn->dist->region == r.id && o->output_nr < gn->dist->n_out) {
      eng_dist_spec** slot = &gn->dist->out_adj[o->output_nr];
      if (!*slot) *slot = eng_dist_spec_retain(e->out_adj[j]);
    }
  }
  rc = 0;
done:
  for (int i = 0; i < ENG_OP_MAX_IN; i++) { eng_tensor_release(conv[i]); eng_tensor_release(rin[i]); }
  if (rc) for (int j = 0; j < n_out; j++) { eng_tensor_release(outs[j]); outs[j] = NULL; }
  return rc;
}

eng_tensor* eng_dispatch(const eng_op_def* def, eng_op_call* c) {
  eng_tensor* outs[ENG_OP_MAX_OUT] = {0};
  if (eng_dispatch_multi(def, c, outs)) return NULL;
  for (int j = 1; j < def->n_out; j++) eng_tensor_release(outs[j]);
  return outs[0];
}

/* ------------------------------------------------------------------ in-place ops */
int eng_dispatch_inplace(const char* name, int mode, eng_op_call* c, int (*fn)(eng_op_call* c)) {
  eng_tensor* a = c->in[0];
  char b[2048];
  eng_tensor* tmp[ENG_OP_MAX_IN] = {0};
  if (eng_meta_any(c)) { /* in place into meta: nothing to write */
    if (!any_dtensor(c)) return eng_meta_inplace(name, c);
    for (int i = 0; i < c->n_in; i++)
      if (c->in[i] && c->in[i]->device != ENG_META && c->in[i]->ndim > 0)
        return eng_err("%s: tensors on different devices: %s and %s", name, eng_desc(a), eng_desc(c->in[i]));
    return 0;
  }
  if (!a->dist) {
    for (int i = 1; i < c->n_in; i++)
      if (c->in[i] && c->in[i]->dist) {
        char s[600];
        return eng_err("%s: mixed DTensor and Tensor arguments: %s and DTensor(%s)", name, eng_desc(a),
                       eng_dist_spec_describe(c->in[i]->dist, c->in[i]->dtype, s, sizeof s));
      }
  }
  eng_tensor* conv[ENG_OP_MAX_IN] = {0};
  if (prepare(name, c, conv)) return -1;
  /* prepare turned plain scalars into Replicate DTensors; a stays a DTensor */
  const eng_dist_spec* as = a->dist;
  int rc = -1;
  for (int i = 1; i < c->n_in; i++) {
    eng_tensor* t = c->in[i];
    if (!t) continue;
    if (eng_dist_spec_equal(t->dist, as)) { tmp[i] = dt_plain(t); }
    else {
      int same_shape = t->dist->ndim == as->ndim;
      for (int d = 0; same_shape && d < as->ndim; d++) same_shape = t->dist->shape[d] == as->shape[d];
      if (as->has_partial || !same_shape) {
        /* broadcast operands (PyTorch's in-place pointwise strategy): the operand follows the target's
         * placements, sharded where the target is on the dims it has at full size, Replicate where it
         * broadcasts; a Partial target only takes operands already laid out so */
        eng_dist_spec* to = NULL;
        const eng_dist_spec* ts = t->dist;
        if (ts->ndim <= as->ndim) {
          eng_placement pl[ENG_MAX_DIMS];
          int lead = as->ndim - ts->ndim;
          for (int m = 0; m < as->mesh_ndim; m++) {
            pl[m] = as->placements[m];
            if (pl[m].kind == ENG_PLACEMENT_SHARD || pl[m].kind == ENG_PLACEMENT_STRIDED_SHARD) {
              int od = pl[m].dim - lead;
              if (od >= 0 && ts->shape[od] == as->shape[pl[m].dim]) pl[m].dim = od;
              else pl[m] = dt_replicate();
            }
          }
          to = dt_spec_make(ts->mesh, pl, ts->ndim, ts->shape, ts->stride);
          if (!to) { eng_err_prefix("%s", name); goto done; }
        }
        int same = to && eng_dist_spec_equal(ts, to);
        if (to && (same || !as->has_partial)) {
          tmp[i] = same ? dt_plain(t) : dt_redistribute_local(t, ts, to, 0, 0);
          eng_dist_spec_release(to);
          if (!tmp[i]) { eng_err_prefix("%s", name); goto done; }
        } else {
          eng_dist_spec_release(to);
          eng_err("%s: no sharding strategy for %s (in-place: the other operands must have the target's layout)",
                  name, layouts(c, b, sizeof b));
          goto done;
        }
      } else {
        tmp[i] = dt_redistribute_local(t, t->dist, as, 0, 0);
        if (!tmp[i]) { eng_err_prefix("%s", name); goto done; }
      }
    }
  }
  if (as->has_partial) {
    int ok = mode == 1 || (mode == 2 && c->n_in == 1);
    for (int m = 0; ok && m < as->mesh_ndim; m++)
      if (as->placements[m].kind == ENG_PLACEMENT_PARTIAL && mode == 2 && !linear_partial(&as->placements[m])) ok = 0;
    if (!ok) {
      eng_err("%s: no sharding strategy for %s (in-place on a Partial DTensor)", name, layouts(c, b, sizeof b));
      goto done;
    }
  }
  {
    eng_op_call lc = *c;
    for (int i = 1; i < c->n_in; i++) if (tmp[i]) lc.in[i] = tmp[i];
    int prev = eng_dispatch_set_local_mode(1);
    rc = fn(&lc);
    eng_dispatch_set_local_mode(prev);
  }
done:
  for (int i = 0; i < ENG_OP_MAX_IN; i++) { eng_tensor_release(tmp[i]); eng_tensor_release(conv[i]); }
  return rc;
}

/* ------------------------------------------------------------------ the op table */
static struct { const eng_op_def* def; eng_op_handler fn; eng_op_handler_multi multi; } g_ops[ENG_OP_COUNT];

void eng_dt_register_def(eng_op_id op, const eng_op_def* def) {
  if ((unsigned)op < ENG_OP_COUNT) g_ops[op].def = def;
}

void eng_dt_register_handler(eng_op_id op, eng_op_handler fn, eng_op_handler_multi multi) {
  if ((unsigned)op < ENG_OP_COUNT) { g_ops[op].fn = fn; g_ops[op].multi = multi; }
}

const eng_op_def* eng_dt_op_def(eng_op_id op) { return (unsigned)op < ENG_OP_COUNT ? g_ops[op].def : NULL; }

static eng_tensor* op_call(eng_op_id op, eng_op_call* c) {
  if ((unsigned)op < ENG_OP_COUNT) {
    if (g_ops[op].def) return eng_dispatch(g_ops[op].def, c);
    if (g_ops[op].fn) return g_ops[op].fn(c);
  }
  return eng_no_rule(c->name ? c->name : "op", c);
}

static int op_call_multi(eng_op_id op, eng_op_call* c, eng_tensor** outs) {
  if ((unsigned)op < ENG_OP_COUNT) {
    const eng_op_def* def = g_ops[op].def;
    if (def) return eng_dispatch_multi(def, c, outs) ? -1 : def->n_out;
    if (g_ops[op].multi) return g_ops[op].multi(c, outs);
  }
  return eng_no_rule_i(c->name ? c->name : "op", c);
}

static const char* spec_describe(const eng_dist_spec* s, int dtype, char* buf, int cap) {
  return eng_dist_spec_describe(s, dtype, buf, cap);
}

/* The DTensor layer's entry points in core (core/dispatch.h) and its part in
 * autograd (autograd/dist_hooks.h), installed when the library is loaded. */
__attribute__((constructor)) static void install_dispatcher(void) {
  eng_dispatcher_install(&(eng_dispatcher){.call = op_call, .call_multi = op_call_multi,
                                           .call_inplace = eng_dispatch_inplace,
                                           .spec_retain = eng_dist_spec_retain, .spec_release = eng_dist_spec_release,
                                           .spec_describe = spec_describe, .spec_equal = eng_dist_spec_equal,
                                           .wait = eng_dtensor_wait, .norm_reduce = eng_dt_norm_reduce});
  eng_autograd_set_dist_hooks(&(eng_autograd_dist_hooks){
      .mark_node = dist_mark_node, .node_backward = dist_node_backward, .node_free = dist_node_free,
      .grad_for_leaf = dist_grad_for_leaf,
      .numel = eng_dtensor_numel, .ones_grad = eng_dtensor_ones_grad});
}
