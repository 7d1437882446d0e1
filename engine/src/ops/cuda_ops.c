/* cuda_ops.c: the device side of the engine's ops (see ops/cuda_ops.h): thin
 * wrappers over the kernels of kernels/cuda (kcuda.h) that take the compute
 * stream and workspaces from the runtime (cuda/runtime.c) and turn kernel
 * statuses into engine errors, plus the pieces with more logic: batched
 * GEMM planning over cuBLASLt, flash attention, multi-tensor optimizer
 * launches grouped by dtype. */
#include "ops/cuda_ops.h"
#include "ops/ops.h"
#include <math.h>
#include <stdio.h>

int eng_cu_same_device(const char* op, const eng_tensor* a, const eng_tensor* b) {
  if (!a || !b || a->device == b->device) return 0;
  return eng_err("%s: expected all tensors on the same device, got %s on %s and %s on %s", op, eng_desc(a),
                 a->device == ENG_CUDA ? "cuda" : "cpu", eng_desc(b), b->device == ENG_CUDA ? "cuda" : "cpu");
}

#ifdef ENG_HAVE_CUDA
#include "kernels/cuda/kcuda.h"
#include "eng/cuda.h"

static cudaStream_t S(void) { return (cudaStream_t)eng_cuda_stream(ENG_CUDA_STREAM_COMPUTE); }
/* Kernel status -> engine error (also when the stream could not be had). */
static int ck(int st, const char* op) {
  if (st == 0) return 0;
  return eng_cuda_check(st, op);
}
#define STREAM_OR_FAIL(op)                                   \
  cudaStream_t s = S();                                      \
  if (!s) { eng_err_prefix("%s", op); return -1; }



int eng_cu_unary(int uop, int dt, int nd, const int64_t* shape, void* out, const int64_t* so, const void* x,
                 const int64_t* sx, double p0, double p1, const char* op) {
  if (eng_shape_numel(nd, shape) == 0) return 0;
  STREAM_OR_FAIL(op);
  return ck(kcu_unary(uop, dt, nd, shape, out, so, x, sx, p0, p1, s), op);
}

int eng_cu_unary_grad(int uop, int dt, int nd, const int64_t* shape, void* gi, const int64_t* sgi, const void* g,
                      const int64_t* sg, const void* x, const int64_t* sx, const void* y, const int64_t* sy,
                      double p0, double p1, const char* op) {
  if (eng_shape_numel(nd, shape) == 0) return 0;
  STREAM_OR_FAIL(op);
  return ck(kcu_unary_grad(uop, dt, nd, shape, gi, sgi, g, sg, x, sx, y, sy, p0, p1, s), op);
}

int eng_cu_binary(int bop, int dt, int nd, const int64_t* shape, void* out, const int64_t* so, const void* a,
                  const int64_t* sa, const void* b, const int64_t* sb, const char* op) {
  if (eng_shape_numel(nd, shape) == 0) return 0;
  STREAM_OR_FAIL(op);
  return ck(kcu_binary(bop, dt, nd, shape, out, so, a, sa, b, sb, s), op);
}

int eng_cu_compare(int cop, int dt, int nd, const int64_t* shape, void* out, const int64_t* so, const void* a,
                   const int64_t* sa, const void* b, const int64_t* sb, const char* op) {
  if (eng_shape_numel(nd, shape) == 0) return 0;
  STREAM_OR_FAIL(op);
  return ck(kcu_compare(cop, dt, nd, shape, out, so, a, sa, b, sb, s), op);
}

int eng_cu_where(int es, int nd, const int64_t* shape, void* out, const int64_t* so, const void* c,
                 const int64_t* sc, const void* a, const int64_t* sa, const void* b, const int64_t* sb,
                 const char* op) {
  if (eng_shape_numel(nd, shape) == 0) return 0;
  STREAM_OR_FAIL(op);
  return ck(kcu_where(es, nd, shape, out, so, c, sc, a, sa, b, sb, s), op);
}

int eng_cu_masked_fill(int es, int nd, const int64_t* shape, void* out, const int64_t* so, const void* x,
                       const int64_t* sx, const void* m, const int64_t* sm, const void* value, const char* op) {
  if (eng_shape_numel(nd, shape) == 0) return 0;
  STREAM_OR_FAIL(op);
  return ck(kcu_masked_fill(es, nd, shape, out, so, x, sx, m, sm, value, s), op);
}

int eng_cu_reduce_dim(int kind, int dt, int64_t outer, int64_t D, int64_t inner, const void* x, void* out, int odt,
                      double scale, const char* op) {
  if (outer * inner == 0) return 0;
  STREAM_OR_FAIL(op);
  return ck(kcu_reduce_dim(kind, dt, outer, D, inner, x, out, odt, scale, s), op);
}

int eng_cu_reduce_all(int kind, int dt, int64_t n, const void* x, void* out, int odt, double scale, const char* op) {
  STREAM_OR_FAIL(op);
  size_t wsb = kcu_reduce_all_workspace(n);
  void* ws = eng_cuda_malloc((int64_t)(wsb > 0 ? wsb : 1));
  if (!ws) { eng_err_prefix("%s", op); return -1; }
  int rc = ck(kcu_reduce_all(kind, dt, n, x, out, odt, scale, ws, s), op);
  eng_cuda_free(ws); /* stream-ordered: the next user runs after the kernel */
  return rc;
}

int eng_cu_argext_dim(int dt, int is_max, int64_t outer, int64_t D, int64_t inner, const void* x, void* vals,
                      int64_t* idx, const char* op) {
  if (outer * inner == 0) return 0;
  STREAM_OR_FAIL(op);
  return ck(kcu_argext_dim(dt, is_max, outer, D, inner, x, vals, idx, s), op);
}

int eng_cu_scatter_dim(int es, int64_t outer, int64_t D, int64_t inner, const int64_t* idx, const void* g,
                       void* out, const char* op) {
  if (outer * inner == 0) return 0;
  STREAM_OR_FAIL(op);
  return ck(kcu_scatter_dim(es, outer, D, inner, idx, g, out, s), op);
}

int eng_cu_softmax(int dt, int log_, int bw, int64_t outer, int64_t D, int64_t inner, const void* x, const void* g,
                   void* y, const char* op) {
  if (outer * D * inner == 0) return 0;
  STREAM_OR_FAIL(op);
  if (bw) return ck(kcu_softmax_bwd(dt, outer, D, inner, x, g, y, log_, s), op);
  return ck(kcu_softmax(dt, outer, D, inner, x, y, log_, s), op);
}

int eng_cu_norm_fwd(int dt, int rms, int64_t m, int64_t n, const void* x, const void* r, void* h, const void* w,
                    const void* b, double eps, void* y, void* mean, void* rstd, const char* op) {
  if (m == 0) return 0;
  STREAM_OR_FAIL(op);
  return ck(kcu_add_norm_fwd(dt, rms, m, n, x, r, h, w, b, eps, y, mean, rstd, s), op);
}

int eng_cu_norm_bwd(int dt, int rms, int64_t m, int64_t n, const void* gy, const void* x, const void* w,
                    const void* mean, const void* rstd, const void* gres, void* dx, void* dw, void* db,
                    const char* op) {
  STREAM_OR_FAIL(op);
  size_t wsb = kcu_norm_bwd_workspace(m, n, dt);
  void* ws = eng_cuda_malloc((int64_t)(wsb > 0 ? wsb : 1));
  if (!ws) { eng_err_prefix("%s", op); return -1; }
  int rc = ck(kcu_norm_bwd_res(dt, rms, m, n, gy, x, w, mean, rstd, gres, dx, dw, db, ws, s), op);
  eng_cuda_free(ws);
  return rc;
}

int eng_cu_colsum(int dt, int64_t rows, int64_t n, const void* x, void* out, int odt, double scale, const char* op) {
  if (n == 0) return 0;
  STREAM_OR_FAIL(op);
  size_t wsb = kcu_colsum_workspace(rows, n, dt);
  void* ws = wsb ? eng_cuda_malloc((int64_t)wsb) : NULL;
  if (wsb && !ws) { eng_err_prefix("%s", op); return -1; }
  int rc = ck(kcu_colsum(dt, rows, n, x, out, odt, scale, ws, s), op);
  eng_cuda_free(ws); /* stream-ordered */
  return rc;
}

/* The error messages of the deferred checks (cuda/deferred.c): the ones these ops raised when they read
 * their flags back after each launch (a host sync per op). */
static void emb_fmt(char* buf, size_t n, const char* op, int64_t V, int64_t unused) {
  (void)unused;
  snprintf(buf, n, "%s: an index is out of range for a weight of %lld rows (valid 0..%lld)", op, (long long)V,
           (long long)V - 1);
}

static void ce_fmt(char* buf, size_t n, const char* op, int64_t C, int64_t ignore) {
  snprintf(buf, n, "%s: a target is out of range for %lld classes (valid: 0..%lld, or ignore_index %lld)", op,
           (long long)C, (long long)C - 1, (long long)ignore);
}

int eng_cu_embedding_fwd(int64_t n_idx, const void* idx, int idt, const void* w, int64_t V, int64_t row_bytes,
                         void* out, const char* op) {
  if (n_idx == 0) return 0;
  STREAM_OR_FAIL(op);
  int* bad = eng_cuda_deferred_flag(op, emb_fmt, V, 0);
  if (!bad) return -1;
  int st = kcu_embedding_fwd(n_idx, idx, idt, w, V, row_bytes, out, bad, s);
  int rc = eng_cuda_deferred_commit(bad);
  return st ? ck(st, op) : rc;
}

int eng_cu_embedding_bwd(int gdt, int64_t n_idx, const void* idx, int idt, const void* go, int64_t dim, int64_t V,
                         int64_t pad, void* gw, const char* op) {
  STREAM_OR_FAIL(op);
  return ck(kcu_embedding_bwd(gdt, n_idx, idx, idt, go, dim, V, pad, gw, s), op);
}

int eng_cu_cross_entropy_fwd(int dt, int64_t N, int64_t C, const void* x, const void* tgt, int tdt, int64_t ignore,
                             double eps, void* loss, void* lse, const char* op) {
  if (N == 0) return 0;
  STREAM_OR_FAIL(op);
  int* bad = eng_cuda_deferred_flag(op, ce_fmt, C, ignore);
  if (!bad) return -1;
  int st = kcu_cross_entropy_fwd(dt, N, C, x, tgt, tdt, ignore, eps, loss, lse, bad, s);
  int rc = eng_cuda_deferred_commit(bad);
  return st ? ck(st, op) : rc;
}

int eng_cu_cross_entropy_bwd(int dt, int64_t N, int64_t C, const void* x, const void* tgt, int tdt, int64_t ignore,
                             double eps, const void* lse, const void* gs, const void* gscale, double gconst, void* gx,
                             const char* op) {
  if (N == 0) return 0;
  STREAM_OR_FAIL(op);
  return ck(kcu_cross_entropy_bwd(dt, N, C, x, tgt, tdt, ignore, eps, lse, gs, gscale, gconst, gx, s), op);
}

int eng_cu_masked_mean(int dt, int64_t N, const void* vals, const void* tgt, int tdt, int64_t ignore, void* out,
                       const char* op) {
  STREAM_OR_FAIL(op);
  return ck(kcu_masked_mean(dt, N, vals, tgt, tdt, ignore, out, s), op);
}


int eng_cu_dropout(int dt, int64_t n, uint64_t seed, uint64_t offset, double keep, double scale, const void* x,
                   void* y, const char* op) {
  if (n == 0) return 0;
  STREAM_OR_FAIL(op);
  return ck(kcu_dropout(dt, n, seed, offset, keep, scale, x, y, s), op);
}

int eng_cu_rope(int dt, int cdt, int64_t B, int64_t T, int64_t H, int64_t D, const void* x, const int64_t* xs,
                const void* cos, const void* sin, int inverse, void* out, const char* op) {
  if (B * T * H * D == 0) return 0;
  STREAM_OR_FAIL(op);
  return ck(kcu_rope(dt, cdt, B, T, H, D, x, xs, cos, sin, inverse, out, s), op);
}

int eng_cu_silu_mul(int dt, int64_t n, const void* a, const void* b, void* out, const char* op) {
  if (n == 0) return 0;
  STREAM_OR_FAIL(op);
  return ck(kcu_silu_mul(dt, n, a, b, out, s), op);
}

int eng_cu_silu_mul_grad(int dt, int64_t n, const void* g, const void* a, const void* b, void* ga, void* gb,
                         const char* op) {
  if (n == 0) return 0;
  STREAM_OR_FAIL(op);
  return ck(kcu_silu_mul_grad(dt, n, g, a, b, ga, gb, s), op);
}

/* ------------------------------------------------------------------ attention */
static void strides3(const eng_tensor* t, int64_t* s) { s[0] = t->stride[0]; s[1] = t->stride[1]; s[2] = t->stride[2]; }

/* A new dense tensor of the given shape whose dims lie in memory in the order of like's strides (largest first;
 * PyTorch's empty_like with preserve_format): attention's output and gradients take the layout of the
 * projections they come from ([B, L, H, D] under a [B, H, L, D] view), so the transposes and views around
 * attention need no copies. */
static eng_tensor* new_ordered_like(const eng_tensor* like, int ndim, const int64_t* shape, int dtype) {
  int perm[ENG_MAX_DIMS];
  for (int d = 0; d < ndim; d++) perm[d] = d;
  for (int i = 1; i < ndim; i++) /* stable: equal strides keep their order */
    for (int j = i; j > 0 && like->stride[perm[j]] > like->stride[perm[j - 1]]; j--) {
      int x = perm[j]; perm[j] = perm[j - 1]; perm[j - 1] = x;
    }
  int64_t st[ENG_MAX_DIMS], n = 1;
  for (int i = ndim - 1; i >= 0; i--) { st[perm[i]] = n; n *= shape[perm[i]]; }
  eng_tensor* buf = eng_new(1, &n, dtype, like->device);
  if (!buf) return NULL;
  eng_tensor* t = eng_view_of(buf, ndim, shape, st, 0);
  eng_tensor_release(buf);
  return t;
}

int eng_cu_sdpa_supported(const eng_tensor* q, const eng_tensor* k, const eng_tensor* v) {
  if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4) return 0;
  if (q->dtype != ENG_F32 && q->dtype != ENG_BF16 && q->dtype != ENG_F16) return 0;
  for (int d = 0; d < 2; d++)
    if (k->shape[d] != q->shape[d] || v->shape[d] != q->shape[d]) return 0;
  if (q->shape[3] > 128 || v->shape[3] != q->shape[3]) return 0;
  return q->shape[0] <= INT32_MAX && q->shape[1] <= INT32_MAX && q->shape[2] <= INT32_MAX && k->shape[2] <= INT32_MAX;
}

/* The op sends every other layout to its math path (ops/attention.c), so a refusal here is a caller's error. */
static int attn_check(eng_tensor* q, eng_tensor* k, eng_tensor* v, const char* op) {
  if (eng_cu_sdpa_supported(q, k, v)) return 0;
  return eng_err("%s: internal error: q %s, k %s, v %s are not a layout the flash kernels take (4-D [B, H, L, D], "
                 "the same B and H, f32/bf16/f16, head dim <= 128 shared by q and v)", op, eng_desc(q), eng_desc(k),
                 eng_desc(v));
}

static void attn_fill(kcu_attn_args* a, eng_tensor* q, eng_tensor* k, int causal, double scale) {
  memset(a, 0, sizeof *a);
  a->dt = q->dtype;
  a->B = (int)q->shape[0]; a->H = (int)q->shape[1]; a->Lq = (int)q->shape[2]; a->Lk = (int)k->shape[2];
  a->D = (int)q->shape[3];
  a->causal = causal;
  a->scale = (float)scale;
}

eng_tensor* eng_cu_sdpa_fwd(eng_tensor* q, eng_tensor* k, eng_tensor* v, int causal, double scale,
                            eng_tensor** lse, const char* op) {
  *lse = NULL;
  if (attn_check(q, k, v, op)) return NULL;
  cudaStream_t s = S();
  if (!s) { eng_err_prefix("%s", op); return NULL; }
  eng_tensor *Q = eng_unit_last_stride(q), *K = eng_unit_last_stride(k), *V = eng_unit_last_stride(v);
  eng_tensor *O = NULL, *L = NULL;
  if (!Q || !K || !V) goto fail;
  int64_t osh[4] = {q->shape[0], q->shape[1], q->shape[2], v->shape[3]};
  int64_t lsh[3] = {q->shape[0], q->shape[1], q->shape[2]};
  if (!(O = new_ordered_like(q, 4, osh, q->dtype)) || !(L = eng_new(3, lsh, ENG_F32, q->device))) goto fail;
  if (O->numel > 0) {
    kcu_attn_args a;
    attn_fill(&a, q, k, causal, scale);
    a.q = eng_ptr(Q); a.k = eng_ptr(K); a.v = eng_ptr(V); a.o = eng_ptr(O); a.lse = (float*)eng_ptr(L);
    strides3(Q, a.sq); strides3(K, a.sk); strides3(V, a.sv); strides3(O, a.so);
    if (ck(kcu_attention_fwd(&a, s), op)) goto fail;
  }
  eng_tensor_release(Q); eng_tensor_release(K); eng_tensor_release(V);
  *lse = L;
  return O;
fail:
  eng_tensor_release(Q); eng_tensor_release(K); eng_tensor_release(V);
  eng_tensor_release(O); eng_tensor_release(L);
  return NULL;
}

int eng_cu_sdpa_bwd(eng_tensor* q, eng_tensor* k, eng_tensor* v, eng_tensor* o, eng_tensor* lse, eng_tensor* dout,
                    int causal, double scale, eng_tensor** dq, eng_tensor** dk, eng_tensor** dv, const char* op) {
  if (attn_check(q, k, v, op)) return -1;
  cudaStream_t s = S();
  if (!s) { eng_err_prefix("%s", op); return -1; }
  int rc = -1;
  eng_tensor *Q = eng_unit_last_stride(q), *K = eng_unit_last_stride(k), *V = eng_unit_last_stride(v), *G = NULL;
  eng_tensor *gq = NULL, *gk = NULL, *gv = NULL, *delta = NULL;
  if (!Q || !K || !V) goto done;
  if (!(G = dout->dtype == q->dtype ? eng_unit_last_stride(dout) : eng_as_contig(dout, q->dtype))) goto done;
  /* the kernel writes all three (unneeded ones go to scratch tensors), in the layouts of q, k and v */
  if (eng_sdpa_fused_qkv(q, k, v)) {
    int64_t n = q->shape[0] * q->shape[2] * 3 * q->shape[1] * q->shape[3];
    eng_tensor* buf = eng_new(1, &n, q->dtype, q->device);
    if (!buf) goto done;
    int64_t hd = q->shape[1] * q->shape[3];
    gq = eng_view_of(buf, 4, q->shape, q->stride, 0);
    gk = eng_view_of(buf, 4, k->shape, k->stride, hd);
    gv = eng_view_of(buf, 4, v->shape, v->stride, 2 * hd);
    eng_tensor_release(buf);
    if (!gq || !gk || !gv) goto done;
  } else if (!(gq = new_ordered_like(q, 4, q->shape, q->dtype)) || !(gk = new_ordered_like(k, 4, k->shape, q->dtype)) ||
             !(gv = new_ordered_like(v, 4, v->shape, q->dtype))) {
    goto done;
  }
  if (!(delta = eng_new(3, lse->shape, ENG_F32, q->device))) goto done;
  if (o->numel > 0 && k->shape[2] > 0) {
    kcu_attn_args a;
    attn_fill(&a, q, k, causal, scale);
    a.q = eng_ptr(Q); a.k = eng_ptr(K); a.v = eng_ptr(V); a.o = eng_ptr(o); a.lse = (float*)eng_ptr(lse);
    a.dout = eng_ptr(G); a.dq = eng_ptr(gq); a.dk = eng_ptr(gk); a.dv = eng_ptr(gv);
    a.delta = (float*)eng_ptr(delta);
    strides3(Q, a.sq); strides3(K, a.sk); strides3(V, a.sv); strides3(o, a.so); strides3(G, a.sdo);
    strides3(gq, a.sdq); strides3(gk, a.sdk); strides3(gv, a.sdv);
    /* the f32 dq accumulator of the one-pass backward (the default up to head dim 64), else none */
    size_t wsb = kcu_attention_bwd_workspace(&a);
    if (wsb && !(a.ws = eng_cuda_malloc((int64_t)wsb))) { eng_err_prefix("%s", op); goto done; }
    int krc = ck(kcu_attention_bwd(&a, s), op);
    eng_cuda_free(a.ws); /* stream-ordered */
    if (krc) goto done;
  } else {
    /* nothing to attend: all gradients are zero */
    if (eng_cu_fill(eng_ptr(gq), q->dtype, gq->numel, 0.0, op) || eng_cu_fill(eng_ptr(gk), q->dtype, gk->numel, 0.0, op) ||
        eng_cu_fill(eng_ptr(gv), q->dtype, gv->numel, 0.0, op))
      goto done;
  }
  if (dq) { *dq = gq; gq = NULL; }
  if (dk) { *dk = gk; gk = NULL; }
  if (dv) { *dv = gv; gv = NULL; }
  rc = 0;
done:
  eng_tensor_release(Q); eng_tensor_release(K); eng_tensor_release(V); eng_tensor_release(G);
  eng_tensor_release(gq); eng_tensor_release(gk); eng_tensor_release(gv); eng_tensor_release(delta);
  return rc;
}

/* ------------------------------------------------------------------ optimizers */
int eng_cu_adamw(int n, eng_tensor** p, eng_tensor** g, eng_tensor** m, eng_tensor** v, eng_tensor** w, double lr,
                 double beta1, double beta2, double eps, double wd, int64_t step, const char* op) {
  STREAM_OR_FAIL(op);
  for (int i = 0; i < n; i++) {
    if (!g[i]) continue;
    eng_tensor* ts[5] = {p[i], g[i], m[i], v[i], w ? w[i] : NULL};
    for (int k = 0; k < 5; k++)
      if (ts[k] && !eng_tensor_is_contiguous(ts[k]))
        return eng_err("%s: cuda tensors must be contiguous, got %s (param %d)", op, eng_desc(ts[k]), i + 1);
  }
  void** pp = calloc((size_t)(n > 0 ? n : 1), 5 * sizeof(void*));
  int64_t* numel = calloc((size_t)(n > 0 ? n : 1), sizeof(int64_t));
  char* done = calloc((size_t)(n > 0 ? n : 1), 1);
  if (!pp || !numel || !done) { free(pp); free(numel); free(done); return eng_err("%s: out of memory", op); }
  void **P = pp, **G = pp + n, **M = pp + 2 * n, **Vv = pp + 3 * n, **Cp = pp + 4 * n;
  kcu_adamw_hparams hp = {lr, beta1, beta2, eps, wd, step};
  int rc = 0;
  /* one multi-tensor launch per (updated weights, grad, state, copy) dtype combination; with a master weight the
   * update runs on the f32 master and the half param is the copy */
#define ADAMW_MASTER(j) (w && w[j])
  for (int i = 0; i < n && rc == 0; i++) {
    if (!g[i] || done[i]) continue;
    int mw = ADAMW_MASTER(i) ? 1 : 0;
    int pdt = mw ? w[i]->dtype : p[i]->dtype, cdt = mw ? p[i]->dtype : -1, gdt = g[i]->dtype, sdt = m[i]->dtype;
    int k = 0;
    for (int j = i; j < n; j++) {
      int mj = ADAMW_MASTER(j) ? 1 : 0;
      if (!g[j] || done[j] || mj != mw || (mj ? w[j]->dtype : p[j]->dtype) != pdt || g[j]->dtype != gdt ||
          m[j]->dtype != sdt || (mj && p[j]->dtype != cdt))
        continue;
      done[j] = 1;
      if (p[j]->numel == 0) continue;
      P[k] = eng_ptr(mj ? w[j] : p[j]); G[k] = eng_ptr(g[j]); M[k] = eng_ptr(m[j]); Vv[k] = eng_ptr(v[j]);
      Cp[k] = mj ? eng_ptr(p[j]) : NULL;
      numel[k] = p[j]->numel;
      k++;
    }
    if (k > 0)
      rc = ck(kcu_adamw(k, P, (const void* const*)G, M, Vv, numel, pdt, gdt, sdt, mw ? Cp : NULL, mw ? cdt : 0, &hp,
                        NULL, s),
              op);
  }
#undef ADAMW_MASTER
  free(pp); free(numel); free(done);
  return rc;
}

static eng_tensor* pick(eng_tensor** ts, int i, int from_grads) {
  return ts[i] ? (from_grads ? ts[i]->grad : ts[i]) : NULL;
}

int eng_cu_global_norm(int n, eng_tensor** ts, int from_grads, double p, double* out, const char* op) {
  int kind = p == 2.0 ? 1 : (isinf(p) && p > 0 ? 3 : -1);
  if (kind < 0) return eng_err("%s: norm order %g is not implemented for cuda tensors (2 or inf)", op, p);
  STREAM_OR_FAIL(op);
  for (int i = 0; i < n; i++) {
    eng_tensor* t = pick(ts, i, from_grads);
    if (t && !eng_tensor_is_contiguous(t))
      return eng_err("%s: cuda tensors must be contiguous, got %s (tensor %d)", op, eng_desc(t), i + 1);
  }
  const void** X = calloc((size_t)(n > 0 ? n : 1), sizeof(void*));
  int64_t* numel = calloc((size_t)(n > 0 ? n : 1), sizeof(int64_t));
  char* done = calloc((size_t)(n > 0 ? n : 1), 1);
  double* dres = eng_cuda_malloc(sizeof(double));
  void* ws = NULL;
  double acc = 0.0;
  int rc = 0;
  if (!X || !numel || !done) rc = eng_err("%s: out of memory", op);
  else if (!dres) { eng_err_prefix("%s", op); rc = -1; }
  for (int i = 0; i < n && rc == 0; i++) {
    eng_tensor* t = pick(ts, i, from_grads);
    if (!t || done[i]) continue;
    int dt = t->dtype, k = 0;
    for (int j = i; j < n; j++) {
      eng_tensor* u = pick(ts, j, from_grads);
      if (!u || done[j] || u->dtype != dt) continue;
      done[j] = 1;
      if (u->numel == 0) continue;
      X[k] = eng_ptr(u); numel[k] = u->numel; k++;
    }
    if (k == 0) continue;
    size_t wsb = kcu_global_norm_workspace(k, numel);
    ws = eng_cuda_malloc((int64_t)(wsb > 0 ? wsb : 1));
    if (!ws) { eng_err_prefix("%s", op); rc = -1; break; }
    double r = 0.0;
    rc = ck(kcu_global_norm(kind, k, X, numel, dt, dres, ws, s), op);
    if (rc == 0 && eng_cuda_memcpy_d2h(&r, dres, sizeof r)) { eng_err_prefix("%s", op); rc = -1; }
    eng_cuda_free(ws);
    ws = NULL;
    if (rc) break;
    if (kind == 1) acc += r * r;
    else if (r > acc || isnan(r)) acc = r;
  }
  eng_cuda_free(dres);
  free(X); free(numel); free(done);
  if (rc) return -1;
  *out = kind == 1 ? sqrt(acc) : acc;
  return 0;
}

int eng_cu_scale(int n, eng_tensor** ts, int from_grads, double sc, const char* op) {
  STREAM_OR_FAIL(op);
  for (int i = 0; i < n; i++) {
    eng_tensor* t = pick(ts, i, from_grads);
    if (!t || t->numel == 0) continue;
    if (!eng_tensor_is_contiguous(t))
      return eng_err("%s: cuda tensors must be contiguous, got %s (tensor %d)", op, eng_desc(t), i + 1);
    void* x = eng_ptr(t);
    int64_t ne = t->numel;
    if (ck(kcu_scale(1, &x, &ne, t->dtype, NULL, sc, s), op)) return -1;
  }
  return 0;
}

/* ------------------------------------------------------------------ GEMM */
static int gemm1(int abdt, int cdt, int ta, int64_t lda, const void* A, int tb, int64_t ldb, const void* B,
                 int64_t ldc, void* C, int64_t M, int64_t N, int64_t K, double alpha, double beta, int64_t batch,
                 int64_t sa, int64_t sb, int64_t sc, const void* bias, const char* op) {
  kcu_gemm_ctx* ctx = eng_cuda_gemm_context();
  if (!ctx) { eng_err_prefix("%s", op); return -1; }
  cudaStream_t s = S();
  if (!s) { eng_err_prefix("%s", op); return -1; }
  kcu_gemm_args a;
  memset(&a, 0, sizeof a);
  a.ta = ta; a.tb = tb; a.M = M; a.N = N; a.K = K;
  a.abdt = abdt; a.cdt = cdt; a.tf32 = 0;
  a.alpha = alpha; a.beta = beta;
  a.A = A; a.lda = lda; a.B = B; a.ldb = ldb; a.C = C; a.ldc = ldc;
  a.batch = batch; a.sa = sa; a.sb = sb; a.sc = sc;
  a.epilogue = bias ? KCU_EPI_BIAS : KCU_EPI_NONE;
  a.bias = bias; a.bias_dt = cdt;
  return ck(kcu_gemm(ctx, &a, s), op);
}

static int view_gemm(int abdt, int cdt, const eng_mview* A, const eng_mview* B, const eng_mview* C, int64_t oa,
                     int64_t ob, int64_t oc, double alpha, double beta, const void* bias, const char* op) {
  int ta, tb, tc;
  int64_t lda, ldb, ldc;
  if (!eng_mview_layout(A, &ta, &lda) || !eng_mview_layout(B, &tb, &ldb) || !eng_mview_layout(C, &tc, &ldc) || tc)
    return eng_err("%s: internal error: operand layout not usable by cuBLASLt", op);
  int ea = eng_dtype_size(abdt), ec = eng_dtype_size(cdt);
  return gemm1(abdt, cdt, ta, lda, A->p + oa * ea, tb, ldb, B->p + ob * ea, ldc, C->p + oc * ec, A->rows, B->cols,
               A->cols, alpha, beta, 1, 0, 0, 0, bias, op);
}

/* Is the batch offset a single stride times the row-major batch index? */
static int uniform_batch(int nb, const int64_t* bshape, const int64_t* bs, int64_t* stride) {
  int64_t inner = 1, s = 0;
  int have = 0;
  for (int d = nb - 1; d >= 0; d--) {
    if (bshape[d] == 1) continue;
    if (!have) { s = bs[d] / (inner ? inner : 1); have = 1; if (s * inner != bs[d]) return 0; }
    else if (bs[d] != s * inner) return 0;
    inner *= bshape[d];
  }
  *stride = s;
  return 1;
}

/* C[b] = bias broadcast over the rows (before a beta = 1 product). */
static int fill_bias(int cdt, const eng_mview* C, int64_t oc, const void* bias, const char* op) {
  int64_t shape[2] = {C->rows, C->cols}, sd[2] = {C->rs, C->cs}, ss[2] = {0, 1};
  return eng_cu_copy(2, shape, C->p + oc * eng_dtype_size(cdt), cdt, sd, bias, cdt, ss, op);
}

/* C[b] = 0 (its previous contents may be anything, NaN included). */
static int zero_matrix(int cdt, const eng_mview* C, int64_t oc, const char* op) {
  int64_t shape[2] = {C->rows, C->cols}, sd[2] = {C->rs, C->cs}, zs[2] = {0, 0};
  double z = 0.0;
  void* zd = eng_cuda_malloc(sizeof z);
  if (!zd) { eng_err_prefix("%s", op); return -1; }
  int rc = eng_cuda_memcpy_h2d(zd, &z, sizeof z) ? -1
                                                 : eng_cu_copy(2, shape, C->p + oc * eng_dtype_size(cdt), cdt, sd, zd,
                                                               ENG_F64, zs, op);
  eng_cuda_free(zd);
  return rc;
}

/* Every distinct C[b] = bias rows (bias != NULL) or 0. */
static int prefill(int cdt, int nb, const int64_t* bshape, const eng_mview* C, const void* bias, const char* op) {
  int64_t tot = eng_shape_numel(nb, bshape), idx[ENG_MAX_DIMS] = {0};
  for (int64_t it = 0; it < tot; it++) {
    int64_t oc = 0;
    int first = 1;
    for (int d = 0; d < nb; d++) { oc += idx[d] * C->bs[d]; if (idx[d] && C->bs[d] == 0) first = 0; }
    if (first && (bias ? fill_bias(cdt, C, oc, bias, op) : zero_matrix(cdt, C, oc, op))) return -1;
    for (int d = nb - 1; d >= 0; d--) { if (++idx[d] < bshape[d]) break; idx[d] = 0; }
  }
  return 0;
}

int eng_cu_linear_gelu(int dt, int64_t rows, int64_t N, int64_t K, const void* X, const void* W, const void* bias,
                       void* y, void* h, const char* op) {
  if (rows == 0 || N == 0) return 0;
  kcu_gemm_ctx* ctx = eng_cuda_gemm_context();
  if (!ctx) { eng_err_prefix("%s", op); return -1; }
  STREAM_OR_FAIL(op);
  kcu_gemm_args a;
  memset(&a, 0, sizeof a);
  a.ta = 0; a.tb = 1; a.M = rows; a.N = N; a.K = K;
  a.abdt = dt; a.cdt = dt; a.tf32 = 0;
  a.alpha = 1.0; a.beta = 0.0;
  a.A = X; a.lda = K; a.B = W; a.ldb = K; a.C = y; a.ldc = N;
  a.batch = 1;
  a.epilogue = bias ? KCU_EPI_BIAS_GELU_AUX : KCU_EPI_GELU_AUX;
  a.bias = bias; a.bias_dt = dt;
  a.aux = h; a.ldaux = N;
  int st = kcu_gemm(ctx, &a, s);
  if (st == KCU_ENOALGO) return 1;
  return ck(st, op);
}

int eng_cu_bmm_run(int abdt, int cdt, int nb, const int64_t* bshape, const eng_mview* A, const eng_mview* B,
                   const eng_mview* C, double alpha, double beta, const void* bias, const char* op) {
  int64_t M = A->rows, K = A->cols, N = B->cols;
  int64_t tot = eng_shape_numel(nb, bshape);
  if (M == 0 || N == 0 || tot == 0) return 0;
  if (K == 0) return (beta == 0.0 || bias) ? prefill(cdt, nb, bshape, C, bias, op) : 0;
  if (tot == 1) return view_gemm(abdt, cdt, A, B, C, 0, 0, 0, alpha, beta, bias, op);
  int acc = 0;
  for (int d = 0; d < nb; d++) if (bshape[d] > 1 && C->bs[d] == 0) acc = 1;
  if (tot > 1) {
    int64_t fa, fc, fb, sa, sb, sc;
    /* rows fold: B shared by every batch, A and C batches stacked row-wise */
    if (eng_mview_zero_strides(nb, bshape, B->bs) && eng_mview_fold(nb, bshape, A->bs, M, A->rs, &fa) &&
        eng_mview_fold(nb, bshape, C->bs, M, C->rs, &fc)) {
      eng_mview A2 = *A, C2 = *C;
      A2.rows = C2.rows = M * tot; A2.rs = fa; C2.rs = fc;
      int t1, t2; int64_t l1, l2;
      if (eng_mview_layout(&A2, &t1, &l1) && eng_mview_layout(&C2, &t2, &l2) && !t2)
        return view_gemm(abdt, cdt, &A2, B, &C2, 0, 0, 0, alpha, beta, bias, op);
    }
    /* contraction fold: one C for all batches, the sum runs over (b, k) */
    if (eng_mview_zero_strides(nb, bshape, C->bs) && eng_mview_fold(nb, bshape, A->bs, K, A->cs, &fa) &&
        eng_mview_fold(nb, bshape, B->bs, K, B->rs, &fb)) {
      eng_mview A2 = *A, B2 = *B;
      A2.cols = B2.rows = K * tot; A2.cs = fa; B2.rs = fb;
      int t1, t2; int64_t l1, l2;
      if (eng_mview_layout(&A2, &t1, &l1) && eng_mview_layout(&B2, &t2, &l2))
        return view_gemm(abdt, cdt, &A2, &B2, C, 0, 0, 0, alpha, beta, bias, op);
    }
    if (bias) { /* no single product: the bias goes in first */
      if (prefill(cdt, nb, bshape, C, bias, op)) return -1;
      beta = 1.0;
      bias = NULL;
    }
    /* one strided-batched GEMM */
    if (!acc && uniform_batch(nb, bshape, A->bs, &sa) && uniform_batch(nb, bshape, B->bs, &sb) &&
        uniform_batch(nb, bshape, C->bs, &sc) && sc != 0) {
      int ta, tb, tc;
      int64_t lda, ldb, ldc;
      if (!eng_mview_layout(A, &ta, &lda) || !eng_mview_layout(B, &tb, &ldb) || !eng_mview_layout(C, &tc, &ldc) || tc)
        return eng_err("%s: internal error: operand layout not usable by cuBLASLt", op);
      return gemm1(abdt, cdt, ta, lda, A->p, tb, ldb, B->p, ldc, C->p, M, N, K, alpha, beta, tot, sa, sb, sc, NULL,
                   op);
    }
  }
  /* general case: one product per batch, in order (sums into shared C slots) */
  int64_t idx[ENG_MAX_DIMS] = {0};
  for (int64_t it = 0; it < tot; it++) {
    int64_t oa = 0, ob = 0, oc = 0;
    int first = 1;
    for (int d = 0; d < nb; d++) {
      oa += idx[d] * A->bs[d]; ob += idx[d] * B->bs[d]; oc += idx[d] * C->bs[d];
      if (idx[d] && C->bs[d] == 0) first = 0;
    }
    if (view_gemm(abdt, cdt, A, B, C, oa, ob, oc, alpha, first ? beta : 1.0, NULL, op)) return -1;
    for (int d = nb - 1; d >= 0; d--) { if (++idx[d] < bshape[d]) break; idx[d] = 0; }
  }
  return 0;
}

#else /* ------------------------------------------------------------------ no CUDA backend */

#define NOCU(op) eng_err("%s: CUDA is not available: this build has no CUDA backend", op)

int eng_cu_unary(int uop, int dt, int nd, const int64_t* shape, void* out, const int64_t* so, const void* x,
                 const int64_t* sx, double p0, double p1, const char* op) { return NOCU(op); }
int eng_cu_unary_grad(int uop, int dt, int nd, const int64_t* shape, void* gi, const int64_t* sgi, const void* g,
                      const int64_t* sg, const void* x, const int64_t* sx, const void* y, const int64_t* sy,
                      double p0, double p1, const char* op) { return NOCU(op); }
int eng_cu_binary(int bop, int dt, int nd, const int64_t* shape, void* out, const int64_t* so, const void* a,
                  const int64_t* sa, const void* b, const int64_t* sb, const char* op) { return NOCU(op); }
int eng_cu_compare(int cop, int dt, int nd, const int64_t* shape, void* out, const int64_t* so, const void* a,
                   const int64_t* sa, const void* b, const int64_t* sb, const char* op) { return NOCU(op); }
int eng_cu_where(int es, int nd, const int64_t* shape, void* out, const int64_t* so, const void* c,
                 const int64_t* sc, const void* a, const int64_t* sa, const void* b, const int64_t* sb,
                 const char* op) { return NOCU(op); }
int eng_cu_masked_fill(int es, int nd, const int64_t* shape, void* out, const int64_t* so, const void* x,
                       const int64_t* sx, const void* m, const int64_t* sm, const void* value, const char* op) {
  return NOCU(op);
}
int eng_cu_reduce_dim(int kind, int dt, int64_t outer, int64_t D, int64_t inner, const void* x, void* out, int odt,
                      double scale, const char* op) { return NOCU(op); }
int eng_cu_reduce_all(int kind, int dt, int64_t n, const void* x, void* out, int odt, double scale, const char* op) {
  return NOCU(op);
}
int eng_cu_argext_dim(int dt, int is_max, int64_t outer, int64_t D, int64_t inner, const void* x, void* vals,
                      int64_t* idx, const char* op) { return NOCU(op); }
int eng_cu_scatter_dim(int es, int64_t outer, int64_t D, int64_t inner, const int64_t* idx, const void* g,
                       void* out, const char* op) { return NOCU(op); }
int eng_cu_softmax(int dt, int log_, int bw, int64_t outer, int64_t D, int64_t inner, const void* x, const void* g,
                   void* y, const char* op) { return NOCU(op); }
int eng_cu_norm_fwd(int dt, int rms, int64_t m, int64_t n, const void* x, const void* r, void* h, const void* w,
                    const void* b, double eps, void* y, void* mean, void* rstd, const char* op) { return NOCU(op); }
int eng_cu_norm_bwd(int dt, int rms, int64_t m, int64_t n, const void* gy, const void* x, const void* w,
                    const void* mean, const void* rstd, const void* gres, void* dx, void* dw, void* db,
                    const char* op) {
  return NOCU(op);
}
int eng_cu_colsum(int dt, int64_t rows, int64_t n, const void* x, void* out, int odt, double scale, const char* op) {
  return NOCU(op);
}
int eng_cu_embedding_fwd(int64_t n_idx, const void* idx, int idt, const void* w, int64_t V, int64_t row_bytes,
                         void* out, const char* op) { return NOCU(op); }
int eng_cu_embedding_bwd(int gdt, int64_t n_idx, const void* idx, int idt, const void* go, int64_t dim, int64_t V,
                         int64_t pad, void* gw, const char* op) { return NOCU(op); }
int eng_cu_cross_entropy_fwd(int dt, int64_t N, int64_t C, const void* x, const void* tgt, int tdt, int64_t ignore,
                             double eps, void* loss, void* lse, const char* op) { return NOCU(op); }
int eng_cu_cross_entropy_bwd(int dt, int64_t N, int64_t C, const void* x, const void* tgt, int tdt, int64_t ignore,
                             double eps, const void* lse, const void* gs, const void* gscale, double gconst, void* gx,
                             const char* op) { return NOCU(op); }
int eng_cu_masked_mean(int dt, int64_t N, const void* vals, const void* tgt, int tdt, int64_t ignore, void* out,
                       const char* op) { return NOCU(op); }
eng_tensor* eng_cu_sdpa_fwd(eng_tensor* q, eng_tensor* k, eng_tensor* v, int causal, double scale,
                            eng_tensor** lse, const char* op) { *lse = NULL; NOCU(op); return NULL; }
int eng_cu_sdpa_bwd(eng_tensor* q, eng_tensor* k, eng_tensor* v, eng_tensor* o, eng_tensor* lse, eng_tensor* dout,
                    int causal, double scale, eng_tensor** dq, eng_tensor** dk, eng_tensor** dv, const char* op) {
  return NOCU(op);
}
int eng_cu_dropout(int dt, int64_t n, uint64_t seed, uint64_t offset, double keep, double scale, const void* x,
                   void* y, const char* op) { return NOCU(op); }
int eng_cu_rope(int dt, int cdt, int64_t B, int64_t T, int64_t H, int64_t D, const void* x, const int64_t* xs,
                const void* cos, const void* sin, int inverse, void* out, const char* op) {
  return NOCU(op);
}
int eng_cu_adamw(int n, eng_tensor** p, eng_tensor** g, eng_tensor** m, eng_tensor** v, eng_tensor** w, double lr,
                 double beta1, double beta2, double eps, double wd, int64_t step, const char* op) {
  return NOCU(op);
}
int eng_cu_silu_mul(int dt, int64_t n, const void* a, const void* b, void* out, const char* op) { return NOCU(op); }
int eng_cu_silu_mul_grad(int dt, int64_t n, const void* g, const void* a, const void* b, void* ga, void* gb,
                         const char* op) {
  return NOCU(op);
}
int eng_cu_global_norm(int n, eng_tensor** ts, int from_grads, double p, double* out, const char* op) {
  return NOCU(op);
}
int eng_cu_scale(int n, eng_tensor** ts, int from_grads, double s, const char* op) { return NOCU(op); }
int eng_cu_bmm_run(int abdt, int cdt, int nb, const int64_t* bshape, const eng_mview* A, const eng_mview* B,
                   const eng_mview* C, double alpha, double beta, const void* bias, const char* op) {
  return NOCU(op);
}
int eng_cu_linear_gelu(int dt, int64_t rows, int64_t N, int64_t K, const void* X, const void* W, const void* bias,
                       void* y, void* h, const char* op) {
  return NOCU(op);
}
int eng_cu_sdpa_supported(const eng_tensor* q, const eng_tensor* k, const eng_tensor* v) { return 0; }
#endif
