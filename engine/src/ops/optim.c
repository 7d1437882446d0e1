/* optim.c: fused multi-tensor optimizer steps (AdamW, SGD), global gradient
 * norms and clip_grad_norm_.  Everything is validated before any tensor is
 * touched, so an error leaves all parameters and states unchanged. */
#include "core/dispatch.h"
#include "kernels/cpu/kcpu.h"
#include "ops/cuda_ops.h"
#include "ops/ops.h"
#include "eng/dtensor.h"
#include "eng/mesh.h"
#include "eng/ops_pointwise.h"
#include <math.h>

static int is_half(int dt) { return dt == ENG_BF16 || dt == ENG_F16; }

/* DTensors: param, grad and state must have the same layout (then the step
 * works on the local shards); a plain tensor matches only a plain one. */
static int check_layout(const char* op, const char* what, int i, eng_tensor* p, eng_tensor* t) {
  if (!p->dist && !t->dist) return eng_dist_wait(t);
  if (p->dist && t->dist && eng_spec_equal(p->dist, t->dist)) return eng_dist_wait(t) || eng_dist_wait(p);
  char a[900], b[900];
  return eng_err("%s: %s %d has layout %s but its param has layout %s (param, grad and optimizer state must have "
                 "the same DTensor layout)", op, what, i + 1, eng_dist_desc(t, a, sizeof a),
                 eng_dist_desc(p, b, sizeof b));
}

/* t must be a CPU float tensor shaped like p, with dtype p's dtype or (for
 * half-precision p) f32, and p's DTensor layout. */
static int check_like(const char* op, const char* what, int i, eng_tensor* p, eng_tensor* t) {
  if (!t) return eng_err("%s: %s %d is NULL (param %s)", op, what, i + 1, eng_desc(p));
  if (check_layout(op, what, i, p, t)) return -1;
  if (!eng_same_shape(p, t))
    return eng_err("%s: %s %d %s does not match the shape of param %s", op, what, i + 1, eng_desc(t), eng_desc(p));
  if (!(t->dtype == p->dtype || (is_half(p->dtype) && t->dtype == ENG_F32)))
    return eng_err("%s: %s %d %s has the wrong dtype for param %s (expected %s%s)", op, what, i + 1, eng_desc(t),
                   eng_desc(p), eng_dtype_name(p->dtype), is_half(p->dtype) ? " or f32" : "");
  if (t->device != p->device)
    return eng_err("%s: %s %d %s and its param %s are on different devices", op, what, i + 1, eng_desc(t), eng_desc(p));
  return 0;
}

static int check_param(const char* op, int i, eng_tensor* p) {
  if (!p) return eng_err("%s: param %d is NULL", op, i + 1);
  if (!eng_dtype_is_floating(p->dtype)) return eng_err("%s: param %d %s is not floating point", op, i + 1, eng_desc(p));
  return 0;
}

static int check_list(const char* op, int n, void* list) {
  if (n < 0) return eng_err("%s: negative tensor count %d", op, n);
  if (n > 0 && !list) return eng_err("%s: tensor list is NULL", op);
  eng_tensor** ts = list;
  for (int i = 0; i < n; i++)
    if (eng_meta_check(ts[i], op)) return -1;
  return 0;
}

typedef struct { const kc_adamw_args* a; } adamw_ctx;
static void adamw_rows(int64_t n, char** p, const int64_t* s, void* vc) {
  kc_adamw_row(((adamw_ctx*)vc)->a, n, p[0], s[0], p[1], s[1], p[2], s[2], p[3], s[3]);
}
/* Master weights with all five tensors contiguous: one fused pass, in chunks
 * over the worker pool (kc_foreach takes at most 4 operands). */
typedef struct { const kc_adamw_args* a; char *w, *m, *v, *p; const char* g; int64_t n; int gsz, psz; } master_ctx;
#define MASTER_CHUNK 16384
static void adamw_master_range(void* vc, int64_t lo, int64_t hi) {
  master_ctx* c = vc;
  int64_t i0 = lo * MASTER_CHUNK, i1 = hi * MASTER_CHUNK < c->n ? hi * MASTER_CHUNK : c->n;
  if (i1 > i0)
    kc_adamw_master_row(c->a, i1 - i0, c->w + i0 * 4, 4, c->g + i0 * c->gsz, c->gsz, c->m + i0 * 4, 4, c->v + i0 * 4, 4,
                        c->p + i0 * c->psz, c->psz);
}
/* Strided tensors: the step on the master, then the rounded copy. */
typedef struct { int dt; } cast_ctx;
static void master_copy_rows(int64_t n, char** p, const int64_t* s, void* vc) {
  int dt = ((cast_ctx*)vc)->dt;
  for (int64_t i = 0; i < n; i++) kc_store(p[0] + i * s[0], dt, (double)*(const float*)(p[1] + i * s[1]));
}

/* A master weight: an f32 tensor of its bf16/f16 param's shape, layout and
 * device, with f32 states. */
static int check_master(const char* op, int i, eng_tensor* p, eng_tensor* w, eng_tensor* m, eng_tensor* v) {
  if (!is_half(p->dtype))
    return eng_err("%s: param %d %s has a master weight, but master weights are for bf16/f16 params only", op, i + 1,
                   eng_desc(p));
  if (check_like(op, "master weight", i, p, w)) return -1;
  if (w->dtype != ENG_F32)
    return eng_err("%s: master weight %d %s must be f32 (param %s)", op, i + 1, eng_desc(w), eng_desc(p));
  if (m->dtype != ENG_F32)
    return eng_err("%s: with a master weight, exp_avg %d %s and exp_avg_sq %s must be f32 (param %s)", op, i + 1,
                   eng_desc(m), eng_desc(v), eng_desc(p));
  return 0;
}

static int adamw_impl(int n, eng_tensor** params, eng_tensor** grads, eng_tensor** exp_avg, eng_tensor** exp_avg_sq,
                      eng_tensor** master, double lr, double beta1, double beta2, double eps, double weight_decay,
                      int64_t step) {
  const char* op = "adamw_step";
  if (check_list(op, n, params) || check_list(op, n, grads) || check_list(op, n, exp_avg) ||
      check_list(op, n, exp_avg_sq))
    return -1;
  if (master)
    for (int i = 0; i < n; i++)
      if (master[i] && eng_meta_check(master[i], op)) return -1;
  if (!(lr >= 0) || !isfinite(lr)) return eng_err("%s: invalid learning rate %g (expected finite >= 0)", op, lr);
  if (!(beta1 >= 0 && beta1 < 1)) return eng_err("%s: invalid beta1 %g (expected 0 <= beta1 < 1)", op, beta1);
  if (!(beta2 >= 0 && beta2 < 1)) return eng_err("%s: invalid beta2 %g (expected 0 <= beta2 < 1)", op, beta2);
  if (!(eps >= 0) || !isfinite(eps)) return eng_err("%s: invalid eps %g (expected finite >= 0)", op, eps);
  if (!(weight_decay >= 0) || !isfinite(weight_decay))
    return eng_err("%s: invalid weight_decay %g (expected finite >= 0)", op, weight_decay);
  if (step < 1) return eng_err("%s: step must be >= 1 (the count after increment), got %lld", op, (long long)step);
  for (int i = 0; i < n; i++) {
    if (!grads[i]) continue;
    eng_tensor* p = params[i];
    if (check_param(op, i, p) || check_like(op, "grad", i, p, grads[i]) ||
        check_like(op, "exp_avg", i, p, exp_avg[i]) || check_like(op, "exp_avg_sq", i, p, exp_avg_sq[i]))
      return -1;
    if (exp_avg[i]->dtype != exp_avg_sq[i]->dtype)
      return eng_err("%s: exp_avg %d %s and exp_avg_sq %s differ in dtype", op, i + 1, eng_desc(exp_avg[i]),
                     eng_desc(exp_avg_sq[i]));
    if (master && master[i] && check_master(op, i, p, master[i], exp_avg[i], exp_avg_sq[i])) return -1;
  }
  int n_cuda = 0;
  for (int i = 0; i < n; i++) n_cuda += grads[i] && params[i]->device == ENG_CUDA;
  if (n_cuda) { /* multi-tensor launches over the CUDA params (the others below) */
    eng_tensor** gc = calloc((size_t)n, sizeof *gc);
    if (!gc) return eng_err("%s: out of memory", op);
    for (int i = 0; i < n; i++) gc[i] = grads[i] && params[i]->device == ENG_CUDA ? grads[i] : NULL;
    int rc = eng_cu_adamw(n, params, gc, exp_avg, exp_avg_sq, master, lr, beta1, beta2, eps, weight_decay, step, op);
    free(gc);
    if (rc) return -1;
    for (int i = 0; i < n; i++)
      if (grads[i] && params[i]->device == ENG_CUDA) {
        eng_bump_version(params[i]); eng_bump_version(exp_avg[i]); eng_bump_version(exp_avg_sq[i]);
        if (master && master[i]) eng_bump_version(master[i]);
      }
  }
  double bc1 = 1.0 - pow(beta1, (double)step), bc2 = 1.0 - pow(beta2, (double)step);
  for (int i = 0; i < n; i++) {
    if (!grads[i] || params[i]->device == ENG_CUDA) continue;
    eng_tensor *p = params[i], *g = grads[i], *m = exp_avg[i], *v = exp_avg_sq[i], *w = master ? master[i] : NULL;
    kc_adamw_args a = {lr, beta1, beta2, eps, weight_decay, lr / bc1, sqrt(bc2), p->dtype, g->dtype, m->dtype};
    adamw_ctx c = {&a};
    if (w && p->numel > 0 && eng_tensor_is_contiguous(w) && eng_tensor_is_contiguous(g) &&
        eng_tensor_is_contiguous(m) && eng_tensor_is_contiguous(v) && eng_tensor_is_contiguous(p)) {
      master_ctx mc = {&a, eng_ptr(w), eng_ptr(m), eng_ptr(v), eng_ptr(p), eng_ptr(g), p->numel,
                       eng_dtype_size(g->dtype), eng_dtype_size(p->dtype)};
      int64_t chunks = (p->numel + MASTER_CHUNK - 1) / MASTER_CHUNK;
      kc_parallel_blas(p->numel >= (1 << 17) ? eng_threads() : 1, chunks, adamw_master_range, &mc);
      eng_bump_version(w);
    } else if (w) {
      kc_adamw_args f = a;
      f.pdt = ENG_F32;
      adamw_ctx fc = {&f};
      char* base[4] = {eng_ptr(w), eng_ptr(g), eng_ptr(m), eng_ptr(v)};
      const int64_t* st[4] = {w->stride, g->stride, m->stride, v->stride};
      int esz[4] = {4, eng_dtype_size(g->dtype), 4, 4};
      if (p->numel > 0) kc_foreach_par(p->ndim, p->shape, 4, base, st, esz, adamw_rows, &fc);
      cast_ctx cc = {p->dtype};
      char* cb[2] = {eng_ptr(p), eng_ptr(w)};
      const int64_t* cs[2] = {p->stride, w->stride};
      int ce[2] = {eng_dtype_size(p->dtype), 4};
      if (p->numel > 0) kc_foreach_par(p->ndim, p->shape, 2, cb, cs, ce, master_copy_rows, &cc);
      eng_bump_version(w);
    } else {
      char* base[4] = {eng_ptr(p), eng_ptr(g), eng_ptr(m), eng_ptr(v)};
      const int64_t* st[4] = {p->stride, g->stride, m->stride, v->stride};
      int esz[4] = {eng_dtype_size(p->dtype), eng_dtype_size(g->dtype), eng_dtype_size(m->dtype),
                    eng_dtype_size(v->dtype)};
      if (p->numel > 0) kc_foreach_par(p->ndim, p->shape, 4, base, st, esz, adamw_rows, &c);
    }
    eng_bump_version(p); eng_bump_version(m); eng_bump_version(v);
  }
  return 0;
}

int eng_adamw_step(int n, eng_tensor** params, eng_tensor** grads, eng_tensor** exp_avg,
                   eng_tensor** exp_avg_sq, double lr, double beta1, double beta2, double eps,
                   double weight_decay, int64_t step) {
  return adamw_impl(n, params, grads, exp_avg, exp_avg_sq, NULL, lr, beta1, beta2, eps, weight_decay, step);
}

int eng_adamw_step_master(int n, eng_tensor** params, eng_tensor** grads, eng_tensor** exp_avg,
                          eng_tensor** exp_avg_sq, eng_tensor** master, double lr, double beta1, double beta2,
                          double eps, double weight_decay, int64_t step) {
  if (n > 0 && !master) return eng_err("adamw_step: master weight list is NULL");
  return adamw_impl(n, params, grads, exp_avg, exp_avg_sq, master, lr, beta1, beta2, eps, weight_decay, step);
}

typedef struct { const kc_sgd_args* a; int has_buf; } sgd_ctx;
static void sgd_rows(int64_t n, char** p, const int64_t* s, void* vc) {
  sgd_ctx* c = vc;
  kc_sgd_row(c->a, n, p[0], s[0], p[1], s[1], c->has_buf ? p[2] : NULL, c->has_buf ? s[2] : 0);
}

/* SGD on a device tensor, torch.optim.SGD's foreach form from the in-place ops (each rounds to the tensor's dtype,
 * as PyTorch's CUDA path): d = g + wd p; buf = g on the first step, else buf = momentum buf + (1 - dampening) d;
 * d = nesterov ? d + momentum buf : buf; p -= lr d.  The caller runs it with gradients off. */
/* dst += alpha src, src first converted to dst's dtype (an f32 gradient or buffer of a bf16 parameter). */
static int add_as(eng_tensor* dst, eng_tensor* src, double alpha) {
  if (src->dtype == dst->dtype) return eng_add_(dst, src, alpha);
  eng_tensor* t = eng_as_contig(src, dst->dtype);
  int rc = t ? eng_add_(dst, t, alpha) : -1;
  eng_tensor_release(t);
  return rc;
}

static int sgd_device(eng_tensor* p, eng_tensor* g, eng_tensor* b, double lr, double momentum, double dampening,
                      double weight_decay, int nesterov, int first_step) {
  eng_tensor* d = (weight_decay != 0 || nesterov) ? eng_tensor_clone(g) : eng_tensor_retain(g);
  int rc = d ? 0 : -1;
  if (!rc && weight_decay != 0) rc = add_as(d, p, weight_decay);
  if (!rc && b) {
    if (first_step) rc = eng_tensor_copy_(b, d);
    else rc = eng_mul_scalar_(b, momentum) || add_as(b, d, 1.0 - dampening);
    if (!rc && nesterov) rc = add_as(d, b, momentum);
    else if (!rc) { eng_tensor_release(d); d = eng_tensor_retain(b); }
  }
  if (!rc) rc = add_as(p, d, -lr);
  eng_tensor_release(d);
  return rc ? -1 : 0;
}

int eng_sgd_step(int n, eng_tensor** params, eng_tensor** grads, eng_tensor** momentum_buf,
                 double lr, double momentum, double dampening, double weight_decay,
                 int nesterov, int first_step) {
  const char* op = "sgd_step";
  if (check_list(op, n, params) || check_list(op, n, grads)) return -1;
  if (!(lr >= 0) || !isfinite(lr)) return eng_err("%s: invalid learning rate %g (expected finite >= 0)", op, lr);
  if (!(momentum >= 0) || !isfinite(momentum)) return eng_err("%s: invalid momentum %g (expected finite >= 0)", op, momentum);
  if (!isfinite(dampening)) return eng_err("%s: invalid dampening %g", op, dampening);
  if (!(weight_decay >= 0) || !isfinite(weight_decay))
    return eng_err("%s: invalid weight_decay %g (expected finite >= 0)", op, weight_decay);
  if (nesterov && (momentum <= 0 || dampening != 0))
    return eng_err("%s: nesterov momentum requires a momentum > 0 and zero dampening (got momentum %g, dampening %g)",
                   op, momentum, dampening);
  if (momentum != 0 && !momentum_buf) return eng_err("%s: momentum %g needs momentum buffers (got NULL)", op, momentum);
  for (int i = 0; i < n; i++) {
    if (!grads[i]) continue;
    if (check_param(op, i, params[i]) || check_like(op, "grad", i, params[i], grads[i])) return -1;
    if (momentum != 0 && check_like(op, "momentum buffer", i, params[i], momentum_buf[i])) return -1;
  }
  for (int i = 0; i < n; i++) {
    if (!grads[i]) continue;
    eng_tensor *p = params[i], *g = grads[i], *b = momentum != 0 ? momentum_buf[i] : NULL;
    if (p->device == ENG_CUDA) {
      if (sgd_device(p, g, b, lr, momentum, dampening, weight_decay, nesterov, first_step)) {
        eng_err_prefix("%s (parameter %d)", op, i + 1);
        return -1;
      }
      continue;
    }
    kc_sgd_args a = {lr, momentum, dampening, weight_decay, nesterov != 0, first_step != 0, p->dtype, g->dtype,
                     b ? b->dtype : p->dtype};
    sgd_ctx c = {&a, b != NULL};
    char* base[3] = {eng_ptr(p), eng_ptr(g), b ? eng_ptr(b) : eng_ptr(p)};
    const int64_t* st[3] = {p->stride, g->stride, b ? b->stride : p->stride};
    int esz[3] = {eng_dtype_size(p->dtype), eng_dtype_size(g->dtype), eng_dtype_size(b ? b->dtype : p->dtype)};
    if (p->numel > 0) kc_foreach_par(p->ndim, p->shape, 3, base, st, esz, sgd_rows, &c);
    eng_bump_version(p);
    if (b) eng_bump_version(b);
  }
  return 0;
}

/* Norm kind for order p, or -1 with an error. */
static int norm_kind(const char* op, double p) {
  if (p == 2.0) return KN_L2;
  if (p == 1.0) return KN_L1;
  if (isinf(p)) return p > 0 ? KN_MAX : KN_MIN;
  if (p == 0.0) return KN_COUNT;
  if (p > 0 && isfinite(p)) return KN_POW;
  return eng_err("%s: unsupported norm order p = %g (use p > 0, 0, inf or -inf)", op, p);
}

typedef struct { int kind, dt; double p, acc; } norm_ctx;
static void norm_rows(int64_t n, char** ptr, const int64_t* s, void* vc) {
  norm_ctx* c = vc;
  kc_pnorm_row(c->kind, c->p, c->dt, n, ptr[0], s[0], &c->acc);
}

/* DTensors: each tensor's local accumulator is combined over the mesh dims
 * where it is Shard (not where it is Replicate).  Tensors with the same mesh
 * and set of Shard mesh dims share one accumulator (a group); plain and fully
 * replicated tensors need no reduction (group 0).  The groups of one mesh are
 * reduced together: one all_reduce per mesh dim where any of them is sharded,
 * PyTorch's count (one per Partial placement of the norm).  A group
 * replicated along such a dim contributes from coordinate 0 of that dim only,
 * so every shard is counted once. */
typedef struct { eng_mesh* mesh; uint32_t mask; const eng_dist_spec* spec; norm_ctx c; } norm_group;

static int reduce_kind_of(int kind) { return kind == KN_MAX ? ENG_NORM_MAX : kind == KN_MIN ? ENG_NORM_MIN : ENG_NORM_SUM; }

static double combine(int kind, double a, double b) {
  if (kind == KN_MAX) return (a > b || isnan(a)) ? a : b;
  if (kind == KN_MIN) return (a < b || isnan(a)) ? a : b;
  return a + b;
}

/* The tensor whose layout decides the all_reduces for entry i: the
 * parameter itself when norming gradients (its layout is the same on every
 * rank, even where a rank has no gradient), else the tensor. */
static eng_tensor* layout_of(eng_tensor* x, int from_grads) {
  if (!x) return NULL;
  if (from_grads && !x->dist && x->grad) return x->grad;
  return x;
}

/* *out: the norm; *dtype, *device (may be NULL): those of its tensor as
 * torch.linalg.vector_norm gives it (f64 when a tensor is f64, else f32; the
 * first tensor's device, the CPU when there is none). */
static int total_norm(const char* op, int n, eng_tensor** ts, double p, double* out, int from_grads, int* dtype,
                      int* device) {
  int kind = norm_kind(op, p);
  if (kind < 0) return -1;
  int first_dev = -1, err = 0, any_f64 = 0;
  for (int i = 0; i < n && !err; i++) {
    eng_tensor* t = ts[i] ? (from_grads ? ts[i]->grad : ts[i]) : NULL;
    if (!t) continue;
    if (!eng_dtype_is_floating(t->dtype))
      err = eng_err("%s: %s %d %s is not floating point", op, from_grads ? "grad of param" : "tensor", i + 1, eng_desc(t));
    else if (first_dev >= 0 && t->device != first_dev)
      err = eng_err("%s: %s %d %s is on %s, the first one on %s (all on one device)", op,
                    from_grads ? "grad of param" : "tensor", i + 1, eng_desc(t), t->device == ENG_CUDA ? "cuda" : "cpu",
                    first_dev == ENG_CUDA ? "cuda" : "cpu");
    else if (t->dist && t->dist->has_partial) {
      char a[900];
      err = eng_err("%s: %s %d is %s: a Partial placement has no norm (redistribute it to Replicate or Shard first)",
                    op, from_grads ? "grad of param" : "tensor", i + 1, eng_dist_desc(t, a, sizeof a));
    } else if (eng_dist_wait(t)) err = -1;
    if (!err) first_dev = t->device;
    any_f64 |= t->dtype == ENG_F64;
  }
  if (dtype) *dtype = any_f64 ? ENG_F64 : ENG_F32;
  if (device) *device = first_dev >= 0 ? first_dev : ENG_CPU;
  err = err ? 1 : 0;
  int any_dist = 0;
  for (int i = 0; i < n && !any_dist; i++) { eng_tensor* L = layout_of(ts[i], from_grads); any_dist = L && L->dist; }
  /* the CUDA kernels do p = 2 and inf; other orders read a host copy of each device tensor (the CPU's kernels) */
  int cuda = first_dev == ENG_CUDA && (kind == KN_L2 || kind == KN_MAX);
  if (cuda && !err && !any_dist) return eng_cu_global_norm(n, ts, from_grads, p, out, op);
  /* CUDA DTensors: each layout group's local part is normed on the device (eng_cu_global_norm of its tensors),
   * then the groups' accumulators are reduced over their meshes below, as on the CPU */
  eng_tensor** cu_t = cuda ? calloc((size_t)n + 1, sizeof *cu_t) : NULL;
  int* cu_g = cuda ? calloc((size_t)n + 1, sizeof *cu_g) : NULL;
  int n_cu = 0;
  if (cuda && (!cu_t || !cu_g)) { free(cu_t); free(cu_g); return eng_err("%s: out of memory", op); }
  double init = kind == KN_MIN ? INFINITY : 0.0;
  norm_group* groups = calloc((size_t)n + 1, sizeof *groups);
  if (!groups) { free(cu_t); free(cu_g); return eng_err("%s: out of memory", op); }
  int ng = 1; /* group 0: plain and fully replicated tensors */
  groups[0].c = (norm_ctx){kind, 0, p, init};
  int64_t count = 0;
  for (int i = 0; i < n; i++) {
    eng_tensor* L = layout_of(ts[i], from_grads);
    eng_tensor* t = ts[i] ? (from_grads ? ts[i]->grad : ts[i]) : NULL;
    if (!L) continue;
    int g = 0;
    if (L->dist) {
      uint32_t mask = 0;
      for (int d = 0; d < L->dist->mesh_ndim; d++)
        if ((L->dist->placements[d].kind == ENG_PLACEMENT_SHARD ||
             L->dist->placements[d].kind == ENG_PLACEMENT_STRIDED_SHARD) && L->dist->mesh_shape[d] > 1)
          mask |= 1u << d;
      if (mask) {
        for (g = 1; g < ng; g++) /* one group per mesh object and mask; equal meshes combine in eng_dist_norm_reduce */
          if (groups[g].mask == mask && groups[g].mesh == L->dist->mesh) break;
        if (g == ng) {
          groups[g].mesh = L->dist->mesh; groups[g].mask = mask; groups[g].spec = L->dist;
          groups[g].c = (norm_ctx){kind, 0, p, init};
          ng++;
        }
      }
    }
    if (g > 0) count += L->dist->numel; /* its shards elsewhere count, with or without a local gradient */
    if (!t || err) continue;
    if (g == 0) count += t->dist ? t->dist->numel : t->numel;
    if (t->numel == 0) continue;
    if (cuda) { cu_t[n_cu] = t; cu_g[n_cu++] = g; continue; }
    eng_tensor* h = t->device == ENG_CUDA ? eng_op_host(t, t->dtype) : eng_tensor_retain(t);
    if (!h) { err = 1; continue; }
    norm_ctx* c = &groups[g].c;
    c->dt = h->dtype;
    char* base[1] = {eng_ptr(h)};
    const int64_t* st[1] = {h->stride};
    int esz[1] = {eng_dtype_size(h->dtype)};
    kc_foreach(h->ndim, h->shape, 1, base, st, esz, norm_rows, c);
    eng_tensor_release(h);
  }
  for (int g = 0; g < ng && cuda && !err; g++) {
    int k = 0;
    eng_tensor** mine = calloc((size_t)n_cu + 1, sizeof *mine);
    if (!mine) { err = 1; eng_err("%s: out of memory", op); break; }
    for (int j = 0; j < n_cu; j++) if (cu_g[j] == g) mine[k++] = cu_t[j];
    double nrm = 0.0;
    if (k > 0 && eng_cu_global_norm(k, mine, 0, p, &nrm, op)) err = 1;
    else if (k > 0) groups[g].c.acc = kind == KN_L2 ? nrm * nrm : nrm; /* the CUDA kernels do p = 2 and inf */
    free(mine);
  }
  free(cu_t);
  free(cu_g);
  /* the DTensor groups: combined per mesh and reduced over their sharded mesh dims by the DTensor layer (the
   * checks above may fail on some ranks only: it agrees on err before any all_reduce) */
  double r = groups[0].c.acc;
  int rc = 0;
  if (ng > 1) {
    const eng_dist_spec** layouts = calloc((size_t)ng, sizeof *layouts);
    uint32_t* masks = calloc((size_t)ng, sizeof *masks);
    double* accs = calloc((size_t)ng, sizeof *accs);
    double dist_acc = init;
    if (!layouts || !masks || !accs) rc = eng_err("%s: out of memory", op);
    for (int g = 1; g < ng && rc == 0; g++) {
      layouts[g - 1] = groups[g].spec; masks[g - 1] = groups[g].mask; accs[g - 1] = groups[g].c.acc;
    }
    if (rc == 0) rc = eng_dist_norm_reduce(op, ng - 1, layouts, masks, accs, reduce_kind_of(kind), err, &dist_acc);
    if (rc == 0) r = combine(kind, r, dist_acc);
    free(layouts); free(masks); free(accs);
  } else if (err) rc = -1;
  free(groups);
  if (rc) return -1;
  if (count == 0) r = 0.0;
  else if (kind == KN_L2) r = sqrt(r);
  else if (kind == KN_POW) r = pow(r, 1.0 / p);
  *out = r;
  return 0;
}

int eng_global_norm(int n, eng_tensor** ts, double p, double* out) {
  if (check_list("global_norm", n, ts)) return -1;
  if (!out) return eng_err("global_norm: output pointer is NULL");
  int rc = total_norm("global_norm", n, ts, p, out, 0, NULL, NULL);
  if (rc == 0) *out = eng_lua_double(*out); /* read by Lua */
  return rc;
}

typedef struct { int dt; double s; } scale_ctx;
static void scale_rows(int64_t n, char** ptr, const int64_t* s, void* vc) {
  scale_ctx* c = vc;
  kc_scale_row(c->dt, n, ptr[0], s[0], c->s);
}

/* The norm of the params' gradients, then (clip) their scaling; nonfinite_err:
 * a NaN or infinite norm is an error before anything is scaled (the norm is
 * the same on every rank that reduced it, so they all fail). */
static int clip_impl(const char* op, int n, eng_tensor** params, double max_norm, double p, int clip, int nonfinite_err,
                     double* total, int* dtype, int* device) {
  if (check_list(op, n, params)) return -1;
  if (clip && !(max_norm >= 0)) return eng_err("%s: max_norm must be >= 0, got %g", op, max_norm);
  double tn;
  if (total_norm(op, n, params, p, &tn, 1, dtype, device)) return -1;
  *total = tn;
  if (nonfinite_err && !isfinite(tn))
    return eng_err("%s: the total norm of order %g of the gradients is non-finite, so it cannot be clipped (pass "
                   "error_if_nonfinite = false to scale the gradients by it anyway)", op, p);
  if (!clip) return 0;
  double coef = max_norm / (tn + 1e-6);
  if (coef >= 1.0) return 0; /* NaN coefficients scale (to NaN), as clamp(max=1) does in PyTorch */
  int any_cuda = 0;
  for (int i = 0; i < n; i++) any_cuda |= params[i] && params[i]->grad && params[i]->grad->device == ENG_CUDA;
  if (any_cuda) {
    if (eng_cu_scale(n, params, 1, coef, op)) return -1;
    for (int i = 0; i < n; i++) if (params[i] && params[i]->grad) eng_bump_version(params[i]->grad);
    return 0;
  }
  for (int i = 0; i < n; i++) {
    eng_tensor* g = params[i] ? params[i]->grad : NULL;
    if (!g) continue;
    scale_ctx c = {g->dtype, coef};
    char* base[1] = {eng_ptr(g)};
    const int64_t* st[1] = {g->stride};
    int esz[1] = {eng_dtype_size(g->dtype)};
    if (g->numel > 0) kc_foreach(g->ndim, g->shape, 1, base, st, esz, scale_rows, &c);
    eng_bump_version(g);
  }
  return 0;
}

int eng_clip_grad_norm_(int n, eng_tensor** params, double max_norm, double p, double* total) {
  double tn = 0.0;
  int rc = clip_impl("clip_grad_norm_", n, params, max_norm, p, 1, 0, &tn, NULL, NULL);
  if (rc == 0 && total) *total = eng_lua_double(tn); /* read by Lua */
  return rc;
}

static eng_tensor* norm_tensor(int rc, double v, int dtype, int device) {
  if (rc) return NULL;
  return eng_tensor_full(0, NULL, v, dtype, device);
}

eng_tensor* eng_clip_grad_norm_tensor(int n, eng_tensor** params, double max_norm, double p, int error_if_nonfinite) {
  double tn = 0.0;
  int dt = ENG_F32, dev = ENG_CPU;
  int rc = clip_impl("clip_grad_norm_", n, params, max_norm, p, 1, error_if_nonfinite, &tn, &dt, &dev);
  return norm_tensor(rc, tn, dt, dev);
}

eng_tensor* eng_grad_norm_tensor(int n, eng_tensor** params, double p, int error_if_nonfinite) {
  double tn = 0.0;
  int dt = ENG_F32, dev = ENG_CPU;
  int rc = clip_impl("grad_norm", n, params, 0.0, p, 0, error_if_nonfinite, &tn, &dt, &dev);
  return norm_tensor(rc, tn, dt, dev);
}
