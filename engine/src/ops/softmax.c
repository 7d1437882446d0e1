/* softmax.c: softmax and log_softmax over any dim, with autograd.
 * The input is seen as a contiguous [outer, D, inner] block (the last dim
 * contiguous is the fast path, inner == 1); bf16/f16 compute in f32. */
#include "core/internal.h"
#include "core/dispatch.h"
#include "kernels/cpu/kcpu.h"
#include "ops/cuda_ops.h"
#include "autograd/autograd.h"

static int compute_dtype(int dt) { return dt == ENG_F64 ? ENG_F64 : ENG_F32; }

static void split_dims(const eng_tensor* t, int dim, int64_t* outer, int64_t* D, int64_t* inner) {
  *outer = 1; *inner = 1; *D = t->ndim ? t->shape[dim] : 1;
  for (int d = 0; d < dim; d++) *outer *= t->shape[d];
  for (int d = dim + 1; d < t->ndim; d++) *inner *= t->shape[d];
}

/* Big inputs are split over outer rows across the engine's threads. */
#define PAR_MIN_NUMEL (1 << 17)

typedef struct {
  int dt, log_, bw;
  int64_t D, inner;
  const char *x, *g;
  char* y;
  int fail;
} sm_ctx;

static void sm_range(void* vc, int64_t lo, int64_t hi) {
  sm_ctx* c = vc;
  int64_t off = lo * c->D * c->inner * (c->dt == ENG_F32 ? 4 : 8);
  int r;
  if (c->bw)
    r = c->dt == ENG_F32 ? kc_softmax_bw_f32(hi - lo, c->D, c->inner, (const float*)(c->x + off),
                                             (const float*)(c->g + off), (float*)(c->y + off), c->log_)
                         : kc_softmax_bw_f64(hi - lo, c->D, c->inner, (const double*)(c->x + off),
                                             (const double*)(c->g + off), (double*)(c->y + off), c->log_);
  else
    r = c->dt == ENG_F32 ? kc_softmax_f32(hi - lo, c->D, c->inner, (const float*)(c->x + off),
                                          (float*)(c->y + off), c->log_)
                         : kc_softmax_f64(hi - lo, c->D, c->inner, (const double*)(c->x + off),
                                          (double*)(c->y + off), c->log_);
  if (r) __atomic_store_n(&c->fail, 1, __ATOMIC_RELAXED);
}

/* y = (log_)softmax(x) (bw: its backward from saved output x and grad g);
 * -1 when out of memory. */
static int run_softmax(int dt, int log_, int bw, int64_t outer, int64_t D, int64_t inner, const char* x,
                       const char* g, char* y) {
  sm_ctx c = {dt, log_, bw, D, inner, x, g, y, 0};
  int threads = outer * D * inner >= PAR_MIN_NUMEL ? eng_threads() : 1;
  kc_parallel_blas(threads, outer, sm_range, &c);
  return c.fail ? -1 : 0;
}

static int softmax_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor* y = eng_node_saved(n, 0);
  if (!y) return -1;
  int dim = (int)n->ints[0], log_ = (int)n->ints[1];
  int cdt = compute_dtype(y->dtype);
  eng_tensor *Y = eng_as_contig(y, cdt), *G = Y ? eng_as_contig(go[0], cdt) : NULL;
  eng_tensor* gx = G ? eng_new(y->ndim, y->shape, cdt, y->device) : NULL;
  int rc = -1;
  if (gx) {
    int64_t outer, D, inner;
    split_dims(y, dim, &outer, &D, &inner);
    int k;
    if (y->device == ENG_CUDA)
      k = eng_cu_same_device(n->name, y, go[0]) ||
          eng_cu_softmax(cdt, log_, 1, outer, D, inner, eng_ptr(Y), eng_ptr(G), eng_ptr(gx), n->name);
    else if ((k = run_softmax(cdt, log_, 1, outer, D, inner, eng_ptr(Y), eng_ptr(G), eng_ptr(gx))))
      eng_err("%s: out of memory", n->name);
    if (!k) rc = (gi[0] = eng_grad_to_input(n, 0, gx)) ? 0 : -1;
  }
  eng_tensor_release(Y); eng_tensor_release(G); eng_tensor_release(gx);
  return rc;
}

static eng_tensor* softmax_op(eng_tensor* t, int dim, int log_) {
  const char* op = log_ ? "log_softmax" : "softmax";
  ENG_CHECK(t, op);
  if (eng_meta_check_local(t, op)) return NULL;
  if (!eng_dtype_is_floating(t->dtype))
    return eng_errp("%s: %s: floating point input expected (convert with :float())", op, eng_desc(t));
  int d = eng_norm_dim(dim, t->ndim, op);
  if (d < 0) return NULL;
  if (ENG_DT_ACTIVE(t->dist || ENG_META_T(t))) return eng_op_dispatch(ENG_OP_SOFTMAX, &(eng_op_call){.name = op, .n_in = 1, .in = {t}, .ints = {d, log_}});
  int rdt = t->dtype, cdt = compute_dtype(rdt);
  eng_tensor* X = eng_as_contig(t, cdt);
  eng_tensor* out = X ? eng_new(t->ndim, t->shape, cdt, t->device) : NULL;
  if (!out) { eng_tensor_release(X); return NULL; }
  int64_t outer, D, inner;
  split_dims(t, d, &outer, &D, &inner);
  if (t->device == ENG_CUDA) {
    int kc = eng_cu_softmax(cdt, log_, 0, outer, D, inner, eng_ptr(X), NULL, eng_ptr(out), op);
    eng_tensor_release(X);
    if (kc) { eng_tensor_release(out); return NULL; }
  } else {
    int k = run_softmax(cdt, log_, 0, outer, D, inner, eng_ptr(X), NULL, eng_ptr(out));
    eng_tensor_release(X);
    if (k) { eng_tensor_release(out); return eng_errp("%s: out of memory", op); }
  }
  if (rdt != cdt) {
    eng_tensor* r = eng_as_contig(out, rdt);
    eng_tensor_release(out);
    if (!(out = r)) return NULL;
  }
  if (eng_any_requires_grad(1, &t)) {
    eng_node* nd = eng_record(log_ ? "LogSoftmaxBackward" : "SoftmaxBackward", softmax_bw, 1, &t, out);
    if (!nd || eng_node_save(nd, out)) { eng_tensor_release(out); return NULL; }
    nd->ints[0] = d; nd->ints[1] = log_;
  }
  return out;
}

eng_tensor* eng_softmax(eng_tensor* t, int dim) { return softmax_op(t, dim, 0); }
eng_tensor* eng_log_softmax(eng_tensor* t, int dim) { return softmax_op(t, dim, 1); }
