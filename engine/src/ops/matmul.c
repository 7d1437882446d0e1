/* matmul.c: matmul (torch.matmul semantics: dot, mv, mm and batched
 * products with broadcast batch dims) and linear, over BLAS, with autograd.
 *
 * Every product goes through eng_bmm_run(), which sees each operand as a batch
 * of strided matrices (eng_mview) and hands BLAS transposed layouts instead of
 * copies wherever the strides allow.  Batched products whose batch dims fold
 * into the rows (x[B, T, K] @ w[K, N]) or into the contraction (the weight
 * gradient of the same product) become a single GEMM. */
#include "ops/bmm.h"
#include "core/dispatch.h"
#include "kernels/cpu/kcpu.h"
#include "ops/cuda_ops.h"
#include "autograd/autograd.h"
#include "eng/ops_pointwise.h"
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void eng_mview_of(const eng_tensor* t, int vec, int nb, const int64_t* bshape, eng_mview* m) {
  int tb;
  m->p = eng_ptr(t);
  if (vec == 1) { m->rows = 1; m->cols = t->shape[0]; m->rs = 0; m->cs = t->stride[0]; tb = 0; }
  else if (vec == 2) { m->rows = t->shape[0]; m->cols = 1; m->rs = t->stride[0]; m->cs = 0; tb = 0; }
  else {
    tb = t->ndim - 2;
    m->rows = t->shape[tb]; m->cols = t->shape[tb + 1];
    m->rs = t->stride[tb]; m->cs = t->stride[tb + 1];
  }
  for (int i = 0; i < nb; i++) {
    int it = tb - nb + i;
    m->bs[i] = (it < 0 || t->shape[it] == 1 || bshape[i] == 1) ? 0 : t->stride[it];
  }
}

eng_mview eng_mview_t(eng_mview m) {
  int64_t t = m.rows; m.rows = m.cols; m.cols = t;
  t = m.rs; m.rs = m.cs; m.cs = t;
  return m;
}

/* Can BLAS read m directly?  trans 0: row-major with leading dim ld;
 * trans 1: the transpose of a row-major (cols x rows) matrix. */
static int blas_layout(const eng_mview* m, int* trans, int64_t* ld) {
  int64_t r1 = m->rows > 1 ? m->rows : 1, c1 = m->cols > 1 ? m->cols : 1;
  if ((m->cols <= 1 || m->cs == 1) && (m->rows <= 1 || m->rs >= c1)) {
    *trans = 0; *ld = m->rows <= 1 ? c1 : m->rs;
  } else if ((m->rows <= 1 || m->rs == 1) && (m->cols <= 1 || m->cs >= r1)) {
    *trans = 1; *ld = m->cols <= 1 ? r1 : m->cs;
  } else {
    return 0;
  }
  return *ld <= INT_MAX;
}

int eng_mview_layout(const eng_mview* m, int* trans, int64_t* ld) { return blas_layout(m, trans, ld); }

/* The view of t (already in the compute dtype), transposed if asked; t is
 * copied to a contiguous tensor (owned by *hold) if BLAS cannot read it. */
int eng_mview_prep(eng_tensor* t, int vec, int transpose, int nb, const int64_t* bshape, eng_mview* m,
                   eng_tensor** hold) {
  int tr; int64_t ld;
  *hold = NULL;
  eng_mview_of(t, vec, nb, bshape, m);
  if (transpose) *m = eng_mview_t(*m);
  if (blas_layout(m, &tr, &ld)) return 0;
  *hold = eng_as_contig(t, t->dtype);
  if (!*hold) return -1;
  eng_mview_of(*hold, vec, nb, bshape, m);
  if (transpose) *m = eng_mview_t(*m);
  return 0;
}

int eng_mview_fold(int nb, const int64_t* bshape, const int64_t* bs, int64_t n, int64_t s, int64_t* fs) {
  int64_t expect = 0;
  int have = 0;
  *fs = s;
  if (n > 1) { expect = s * n; have = 1; }
  for (int d = nb - 1; d >= 0; d--) {
    if (bshape[d] == 1) continue;
    if (!have) { *fs = bs[d]; expect = bs[d] * bshape[d]; have = 1; continue; }
    if (bs[d] != expect) return 0;
    expect *= bshape[d];
  }
  return 1;
}

int eng_mview_zero_strides(int nb, const int64_t* bshape, const int64_t* bs) {
  for (int d = 0; d < nb; d++) if (bshape[d] > 1 && bs[d] != 0) return 0;
  return 1;
}

static int gemm1(int dt, const eng_mview* A, const eng_mview* B, const eng_mview* C, double alpha,
                 double beta, const char* op) {
  int ta, tb, tc;
  int64_t lda, ldb, ldc;
  if (!blas_layout(A, &ta, &lda) || !blas_layout(B, &tb, &ldb) || !blas_layout(C, &tc, &ldc) || tc)
    return eng_err("%s: internal error: operand layout not usable by BLAS", op);
  kc_gemm(dt, ta, tb, A->rows, B->cols, A->cols, alpha, A->p, lda, B->p, ldb, beta, C->p, ldc);
  return 0;
}

/* Batches with at most this many multiply-adds per product run in parallel
 * (BLAS threads do not pay at these sizes). */
#define SMALL_GEMM ((int64_t)1 << 22)

typedef struct {
  int dt, nb, es;
  int64_t M, N, K;
  double alpha, beta;
  const eng_mview *A, *B, *C;
  const int64_t* bshape;
  int ta, tb, tc;
  int64_t lda, ldb, ldc;
} bmm_ctx;

/* Independent products b in [lo, hi) (row-major over the batch shape). */
static void bmm_range(void* vc, int64_t lo, int64_t hi) {
  bmm_ctx* c = vc;
  int64_t idx[ENG_MAX_DIMS];
  int64_t rem = lo;
  for (int d = c->nb - 1; d >= 0; d--) { idx[d] = rem % c->bshape[d]; rem /= c->bshape[d]; }
  for (int64_t it = lo; it < hi; it++) {
    int64_t oa = 0, ob = 0, oc = 0;
    for (int d = 0; d < c->nb; d++) {
      oa += idx[d] * c->A->bs[d]; ob += idx[d] * c->B->bs[d]; oc += idx[d] * c->C->bs[d];
    }
    kc_gemm(c->dt, c->ta, c->tb, c->M, c->N, c->K, c->alpha, c->A->p + oa * c->es, c->lda, c->B->p + ob * c->es,
            c->ldb, c->beta, c->C->p + oc * c->es, c->ldc);
    for (int d = c->nb - 1; d >= 0; d--) { if (++idx[d] < c->bshape[d]) break; idx[d] = 0; }
  }
}

/* C[b] = alpha * A[b] @ B[b] + beta * C[b] over the batch index space
 * bshape (nb dims); A: M x K, B: K x N, C: M x N (row-major, written by
 * BLAS).  Where C has stride 0 in a batch dim of size > 1, the products are
 * summed into C.  A and B must pass blas_layout. */
int eng_bmm_run(int dt, int nb, const int64_t* bshape, const eng_mview* A, const eng_mview* B,
                const eng_mview* C, double alpha, double beta, const char* op) {
  int64_t M = A->rows, K = A->cols, N = B->cols;
  int64_t tot = eng_shape_numel(nb, bshape);
  if (M > INT_MAX || N > INT_MAX || K > INT_MAX)
    return eng_err("%s: matrix dims %lld x %lld x %lld exceed the BLAS int range", op, (long long)M,
                   (long long)K, (long long)N);
  if (M == 0 || N == 0 || tot == 0) return 0;
  int es = dt == ENG_F32 ? 4 : 8;
  if (tot > 1) {
    int64_t fa, fc, fb;
    /* rows fold: B shared by every batch, A and C batches stacked row-wise */
    if (M * tot <= INT_MAX && eng_mview_zero_strides(nb, bshape, B->bs) &&
        eng_mview_fold(nb, bshape, A->bs, M, A->rs, &fa) && eng_mview_fold(nb, bshape, C->bs, M, C->rs, &fc)) {
      eng_mview A2 = *A, C2 = *C;
      A2.rows = C2.rows = M * tot; A2.rs = fa; C2.rs = fc;
      int t1, t2; int64_t l1, l2;
      if (blas_layout(&A2, &t1, &l1) && blas_layout(&C2, &t2, &l2) && !t2)
        return gemm1(dt, &A2, B, &C2, alpha, beta, op);
    }
    /* contraction fold: one C for all batches, the sum runs over (b, k) */
    if (K * tot <= INT_MAX && eng_mview_zero_strides(nb, bshape, C->bs) &&
        eng_mview_fold(nb, bshape, A->bs, K, A->cs, &fa) && eng_mview_fold(nb, bshape, B->bs, K, B->rs, &fb)) {
      eng_mview A2 = *A, B2 = *B;
      A2.cols = B2.rows = K * tot; A2.cs = fa; B2.rs = fb;
      int t1, t2; int64_t l1, l2;
      if (blas_layout(&A2, &t1, &l1) && blas_layout(&B2, &t2, &l2))
        return gemm1(dt, &A2, &B2, C, alpha, beta, op);
    }
  }
  int acc = 0;
  for (int d = 0; d < nb; d++) if (bshape[d] > 1 && C->bs[d] == 0) acc = 1;
  bmm_ctx c = {dt, nb, es, M, N, K, alpha, beta, A, B, C, bshape, 0, 0, 0, 0, 0, 0};
  if (!blas_layout(A, &c.ta, &c.lda) || !blas_layout(B, &c.tb, &c.ldb) || !blas_layout(C, &c.tc, &c.ldc) || c.tc)
    return eng_err("%s: internal error: operand layout not usable by BLAS", op);
  if (acc) {
    /* sums into shared C slots: in order, beta only on each slot's first product */
    int64_t idx[ENG_MAX_DIMS] = {0};
    for (int64_t it = 0; it < tot; it++) {
      int64_t oa = 0, ob = 0, oc = 0;
      int first = 1;
      for (int d = 0; d < nb; d++) {
        oa += idx[d] * A->bs[d]; ob += idx[d] * B->bs[d]; oc += idx[d] * C->bs[d];
        if (idx[d] && C->bs[d] == 0) first = 0;
      }
      kc_gemm(dt, c.ta, c.tb, M, N, K, alpha, A->p + oa * es, c.lda, B->p + ob * es, c.ldb, first ? beta : 1.0,
              C->p + oc * es, c.ldc);
      for (int d = nb - 1; d >= 0; d--) { if (++idx[d] < bshape[d]) break; idx[d] = 0; }
    }
    return 0;
  }
  /* independent products: small ones run batch-parallel on one BLAS thread each */
  int threads = M * N * K <= SMALL_GEMM ? eng_threads() : 1;
  kc_parallel_blas(threads, tot, bmm_range, &c);
  return 0;
}

static int compute_dtype(int dt) { return (dt == ENG_F32 || dt == ENG_BF16 || dt == ENG_F16) ? ENG_F32 : ENG_F64; }
/* Compute dtype on t's device: cuBLASLt multiplies bf16/f16 as is (f32
 * accumulation), BLAS needs f32/f64. */
static int mm_cdt(const eng_tensor* t) { return t->device == ENG_CUDA ? t->dtype : compute_dtype(t->dtype); }

/* eng_bmm_run on the device of the tensors (dev). */
static int bmm_dev(int dev, int cdt, int nb, const int64_t* bshape, const eng_mview* A, const eng_mview* B,
                   const eng_mview* C, double alpha, double beta, const char* op) {
  if (dev == ENG_CUDA) return eng_cu_bmm_run(cdt, cdt, nb, bshape, A, B, C, alpha, beta, NULL, op);
  return eng_bmm_run(cdt, nb, bshape, A, B, C, alpha, beta, op);
}

/* t in dtype cdt (a new reference; t itself when it already is). */
static eng_tensor* in_dtype(eng_tensor* t, int cdt) {
  return t->dtype == cdt ? eng_tensor_retain(t) : eng_as_contig(t, cdt);
}

/* ------------------------------------------------------------------ matmul */
typedef struct {
  int nb, va, vb, ond;
  int64_t M, K, N;
  int64_t bshape[ENG_MAX_DIMS], oshape[ENG_MAX_DIMS];
} mm_plan;

static int mm_plan_make(const eng_tensor* a, const eng_tensor* b, mm_plan* p) {
  if (a->ndim == 0 || b->ndim == 0)
    return eng_err("matmul: %s x %s: both arguments need at least 1 dim (0-d tensors are scalars; use mul)",
                   eng_desc(a), eng_desc(b));
  p->va = a->ndim == 1 ? 1 : 0;
  p->vb = b->ndim == 1 ? 2 : 0;
  int64_t ka = a->shape[a->ndim - 1];
  int64_t kb = b->ndim == 1 ? b->shape[0] : b->shape[b->ndim - 2];
  if (ka != kb)
    return eng_err("matmul: %s x %s: inner dims %lld and %lld differ", eng_desc(a), eng_desc(b),
                   (long long)ka, (long long)kb);
  p->M = p->va ? 1 : a->shape[a->ndim - 2];
  p->N = p->vb ? 1 : b->shape[b->ndim - 1];
  p->K = ka;
  int nba = a->ndim > 2 ? a->ndim - 2 : 0, nbb = b->ndim > 2 ? b->ndim - 2 : 0;
  p->nb = nba > nbb ? nba : nbb;
  for (int i = 0; i < p->nb; i++) {
    int ia = nba - p->nb + i, ib = nbb - p->nb + i;
    int64_t x = ia >= 0 ? a->shape[ia] : 1, y = ib >= 0 ? b->shape[ib] : 1;
    if (x != y && x != 1 && y != 1)
      return eng_err("matmul: %s x %s: batch dims %s and %s do not broadcast", eng_desc(a), eng_desc(b),
                     eng_shape_str(nba, a->shape), eng_shape_str(nbb, b->shape));
    p->bshape[i] = x == 1 ? y : x;
  }
  p->ond = 0;
  for (int i = 0; i < p->nb; i++) p->oshape[p->ond++] = p->bshape[i];
  if (!p->va) p->oshape[p->ond++] = p->M;
  if (!p->vb) p->oshape[p->ond++] = p->N;
  return 0;
}

/* The output (or its gradient) g, shaped like the plan's output, as a batch
 * of M x N matrices. */
static void out_view(const eng_tensor* g, const mm_plan* p, eng_mview* m) {
  m->p = eng_ptr(g);
  for (int d = 0; d < p->nb; d++) m->bs[d] = g->shape[d] == 1 ? 0 : g->stride[d];
  m->rows = p->M; m->cols = p->N;
  m->rs = p->va ? 0 : g->stride[p->nb];
  m->cs = p->vb ? 0 : g->stride[g->ndim - 1];
}

static int prep_out(eng_tensor* g, const mm_plan* p, eng_mview* m, eng_tensor** hold) {
  int tr; int64_t ld;
  *hold = NULL;
  out_view(g, p, m);
  if (blas_layout(m, &tr, &ld)) return 0;
  *hold = eng_as_contig(g, g->dtype);
  if (!*hold) return -1;
  out_view(*hold, p, m);
  return 0;
}

static int check_pair(const char* op, const eng_tensor* a, const eng_tensor* b) {
  if (a->device != b->device)
    return eng_err("%s: %s x %s: tensors on different devices", op, eng_desc(a), eng_desc(b));
  if (a->dtype != b->dtype)
    return eng_err("%s: %s x %s: dtypes differ (%s and %s); convert one first", op, eng_desc(a), eng_desc(b),
                   eng_dtype_name(a->dtype), eng_dtype_name(b->dtype));
  if (a->dtype == ENG_BOOL)
    return eng_err("%s: %s x %s: bool tensors cannot be multiplied", op, eng_desc(a), eng_desc(b));
  if (a->device == ENG_CUDA && !eng_dtype_is_floating(a->dtype))
    return eng_err("%s: %s x %s: integer products are not implemented for cuda tensors", op, eng_desc(a), eng_desc(b));
  return 0;
}

static int matmul_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor *a = eng_node_saved(n, 0), *b = eng_node_saved(n, 1);
  if (!a || !b) return -1;
  mm_plan p;
  if (mm_plan_make(a, b, &p)) return -1;
  if (eng_cu_same_device(n->name, a, go[0])) return -1;
  int cdt = mm_cdt(a);
  eng_tensor *G = in_dtype(go[0], cdt), *A = NULL, *B = NULL, *hg = NULL, *ha = NULL, *hb = NULL;
  eng_tensor *ga = NULL, *gb = NULL;
  int rc = -1;
  eng_mview vg, va, vb, vc;
  if (!G || prep_out(G, &p, &vg, &hg)) goto done;
  int zero = eng_shape_numel(p.nb, p.bshape) == 0;
  if (eng_node_needs_grad(n, 0)) { /* ga = g @ b^T, summed over a's broadcast batch dims */
    if (!(B = in_dtype(b, cdt)) || eng_mview_prep(B, p.vb, 1, p.nb, p.bshape, &vb, &hb)) goto done;
    ga = zero ? eng_tensor_zeros(a->ndim, a->shape, cdt, a->device) : eng_new(a->ndim, a->shape, cdt, a->device);
    if (!ga) goto done;
    eng_mview_of(ga, p.va, p.nb, p.bshape, &vc);
    if (bmm_dev(a->device, cdt, p.nb, p.bshape, &vg, &vb, &vc, 1.0, 0.0, "matmul backward")) goto done;
    if (!(gi[0] = eng_grad_to_input(n, 0, ga))) goto done;
  }
  if (eng_node_needs_grad(n, 1)) { /* gb = a^T @ g, summed over b's broadcast batch dims */
    if (!(A = in_dtype(a, cdt)) || eng_mview_prep(A, p.va, 1, p.nb, p.bshape, &va, &ha)) goto done;
    gb = zero ? eng_tensor_zeros(b->ndim, b->shape, cdt, b->device) : eng_new(b->ndim, b->shape, cdt, b->device);
    if (!gb) goto done;
    eng_mview_of(gb, p.vb, p.nb, p.bshape, &vc);
    if (bmm_dev(a->device, cdt, p.nb, p.bshape, &va, &vg, &vc, 1.0, 0.0, "matmul backward")) goto done;
    if (!(gi[1] = eng_grad_to_input(n, 1, gb))) goto done;
  }
  rc = 0;
done:
  eng_tensor_release(G); eng_tensor_release(A); eng_tensor_release(B);
  eng_tensor_release(hg); eng_tensor_release(ha); eng_tensor_release(hb);
  eng_tensor_release(ga); eng_tensor_release(gb);
  return rc;
}

eng_tensor* eng_matmul(eng_tensor* a, eng_tensor* b) {
  ENG_CHECK(a, "matmul"); ENG_CHECK(b, "matmul");
  if (eng_meta_check_local(a, "matmul")) return NULL;
  if (eng_meta_check_local(b, "matmul")) return NULL;
  if (check_pair("matmul", a, b)) return NULL;
  if (ENG_DT_ACTIVE(a->dist || ENG_META_T(a) || b->dist || ENG_META_T(b))) return eng_op_dispatch(ENG_OP_MATMUL, &(eng_op_call){.n_in = 2, .in = {a, b}});
  mm_plan p;
  if (mm_plan_make(a, b, &p)) return NULL;
  int rdt = a->dtype, cdt = mm_cdt(a);
  eng_tensor *A = in_dtype(a, cdt), *B = A ? in_dtype(b, cdt) : NULL, *ha = NULL, *hb = NULL, *out = NULL;
  eng_mview va, vb, vc;
  if (!A || !B || eng_mview_prep(A, p.va, 0, p.nb, p.bshape, &va, &ha) ||
      eng_mview_prep(B, p.vb, 0, p.nb, p.bshape, &vb, &hb))
    goto fail;
  if (!(out = eng_new(p.ond, p.oshape, cdt, a->device))) goto fail;
  out_view(out, &p, &vc);
  if (bmm_dev(a->device, cdt, p.nb, p.bshape, &va, &vb, &vc, 1.0, 0.0, "matmul")) goto fail;
  eng_tensor_release(A); eng_tensor_release(B); eng_tensor_release(ha); eng_tensor_release(hb);
  A = B = ha = hb = NULL;
  if (rdt != cdt) {
    eng_tensor* r = eng_as_contig(out, rdt);
    eng_tensor_release(out);
    if (!(out = r)) return NULL;
  }
  eng_tensor* in[2] = {a, b};
  if (eng_dtype_is_floating(rdt) && eng_any_requires_grad(2, in)) {
    eng_node* nd = eng_record("MatmulBackward", matmul_bw, 2, in, out);
    if (!nd || eng_node_save(nd, a) || eng_node_save(nd, b)) { eng_tensor_release(out); return NULL; }
  }
  return out;
fail:
  eng_tensor_release(A); eng_tensor_release(B); eng_tensor_release(ha); eng_tensor_release(hb);
  eng_tensor_release(out);
  return NULL;
}

/* ------------------------------------------------------------------ linear */
/* x [..., in] is a batch (x's dims but the last two) of [rows, in] matrices
 * (a 1-D x is one row); the weight is shared by every batch. */
typedef struct { int nb, vec; int64_t bshape[ENG_MAX_DIMS]; } lin_plan;

static void lin_plan_make(const eng_tensor* x, lin_plan* p) {
  p->vec = x->ndim == 1 ? 1 : 0;
  p->nb = x->ndim > 2 ? x->ndim - 2 : 0;
  for (int i = 0; i < p->nb; i++) p->bshape[i] = x->shape[i];
}

/* One product of linear's backward (gx or gw), run as a task of the pool. */
typedef struct {
  int dt, nb;
  const int64_t* bshape;
  eng_mview A, B, C;
  double beta;
  int rc;
  char err[256];
} lin_task;

static void lin_tasks_run(void* vt, int64_t lo, int64_t hi) {
  lin_task* t = vt;
  for (int64_t i = lo; i < hi; i++) {
    t[i].rc = eng_bmm_run(t[i].dt, t[i].nb, t[i].bshape, &t[i].A, &t[i].B, &t[i].C, 1.0, t[i].beta, "linear backward");
    if (t[i].rc) snprintf(t[i].err, sizeof t[i].err, "%s", eng_last_error());
  }
}

/* Linear's backward for the output gradient g0 (inputs x, w[, bias] saved
 * as 0, 1).  gb0: the bias gradient when the caller has it already (the
 * fused linear + gelu), else it is the column sums of g0. */
static int linear_bw_g(eng_node* n, eng_tensor* g0, eng_tensor* gb0, eng_tensor** gi) {
  eng_tensor *x = eng_node_saved(n, 0), *w = eng_node_saved(n, 1);
  if (!x || !w) return -1;
  lin_plan p;
  lin_plan_make(x, &p);
  if (eng_cu_same_device(n->name, x, g0)) return -1;
  int cdt = mm_cdt(x), dev = x->device;
  eng_tensor *G = NULL, *X = NULL, *W = NULL, *hg = NULL, *hx = NULL, *hw = NULL;
  eng_tensor *gx = NULL, *gw = NULL, *gb = NULL;
  int rc = -1, nt = 0;
  lin_task task[2];
  eng_mview vg, vx, vw, vc;
  if (!(G = in_dtype(g0, cdt)) || eng_mview_prep(G, p.vec, 0, p.nb, p.bshape, &vg, &hg)) goto done;
  int zero = eng_shape_numel(p.nb, p.bshape) == 0;
  int need_x = eng_node_needs_grad(n, 0), need_w = eng_node_needs_grad(n, 1);
  if (need_x) { /* gx = g @ w, summed straight into x's gradient buffer when it has one */
    if (!(W = in_dtype(w, cdt)) || eng_mview_prep(W, 0, 0, p.nb, p.bshape, &vw, &hw)) goto done;
    eng_tensor* acc = cdt == x->dtype && !zero ? eng_grad_accum_slot(n, 0) : NULL;
    if (!(gx = acc ? eng_tensor_retain(acc) : eng_new(x->ndim, x->shape, cdt, x->device))) goto done;
    eng_mview_of(gx, p.vec, p.nb, p.bshape, &vc);
    task[nt++] = (lin_task){cdt, p.nb, p.bshape, vg, vw, vc, acc ? 1.0 : 0.0, 0, {0}};
  }
  if (need_w) { /* gw = g^T @ x over all leading dims: one GEMM */
    if (!(X = in_dtype(x, cdt)) || eng_mview_prep(X, p.vec, 0, p.nb, p.bshape, &vx, &hx)) goto done;
    gw = zero ? eng_tensor_zeros(2, w->shape, cdt, w->device) : eng_new(2, w->shape, cdt, w->device);
    if (!gw) goto done;
    eng_mview_of(gw, 0, p.nb, p.bshape, &vc);
    task[nt++] = (lin_task){cdt, p.nb, p.bshape, eng_mview_t(vg), vx, vc, 0.0, 0, {0}};
  }
  /* gx and gw cost the same: two threads run one each, whole (no product is
   * split, so neither repacks the other's operands); one thread runs both */
  if (dev == ENG_CUDA) { /* queued in order on the compute stream */
    for (int i = 0; i < nt; i++)
      if (eng_cu_bmm_run(cdt, cdt, task[i].nb, task[i].bshape, &task[i].A, &task[i].B, &task[i].C, 1.0, task[i].beta,
                         NULL, "linear backward"))
        goto done;
  } else {
    kc_parallel_for(nt, 1, lin_tasks_run, task);
    for (int i = 0; i < nt; i++) if (task[i].rc) { eng_err("%s", task[i].err); goto done; }
  }
  if (need_x && !(gi[0] = eng_grad_to_input(n, 0, gx))) goto done;
  if (need_w && !(gi[1] = eng_grad_to_input(n, 1, gw))) goto done;
  if (n->n_inputs > 2 && eng_node_needs_grad(n, 2) && gb0) {
    if (!(gi[2] = eng_grad_to_input(n, 2, gb0))) goto done;
  } else if (n->n_inputs > 2 && eng_node_needs_grad(n, 2)) { /* gb = column sums of g */
    eng_tensor* Gc = eng_as_contig(hg ? hg : G, cdt);
    int64_t of = w->shape[0];
    if (!Gc || !(gb = eng_new(1, &of, cdt, w->device))) { eng_tensor_release(Gc); goto done; }
    int64_t rows = of ? Gc->numel / of : 0;
    int rc2 = 0;
    if (dev == ENG_CUDA) /* f32/bf16/f16: the 2-D column sum (row x column tiles, then the partial rows) */
      rc2 = cdt == ENG_F64 ? eng_cu_reduce_dim(0, cdt, 1, rows, of, eng_ptr(Gc), eng_ptr(gb), cdt, 1.0, n->name)
                           : eng_cu_colsum(cdt, rows, of, eng_ptr(Gc), eng_ptr(gb), cdt, 1.0, n->name);
    else kc_sum_rows(cdt, rows, of, (void*)eng_ptr(Gc), of, (void*)eng_ptr(gb));
    eng_tensor_release(Gc);
    if (rc2) goto done;
    if (!(gi[2] = eng_grad_to_input(n, 2, gb))) goto done;
  }
  rc = 0;
done:
  eng_tensor_release(G); eng_tensor_release(X); eng_tensor_release(W);
  eng_tensor_release(hg); eng_tensor_release(hx); eng_tensor_release(hw);
  eng_tensor_release(gx); eng_tensor_release(gw); eng_tensor_release(gb);
  return rc;
}

static int linear_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) { return linear_bw_g(n, go[0], NULL, gi); }

eng_tensor* eng_linear(eng_tensor* x, eng_tensor* w, eng_tensor* bias) {
  ENG_CHECK(x, "linear"); ENG_CHECK(w, "linear");
  if (eng_meta_check_local(x, "linear")) return NULL;
  if (eng_meta_check_local(w, "linear")) return NULL;
  if (eng_meta_check_local(bias, "linear")) return NULL;
  if (x->ndim < 1)
    return eng_errp("linear: input %s must have at least 1 dim ([..., in_features])", eng_desc(x));
  if (w->ndim != 2)
    return eng_errp("linear: weight %s must be 2-D [out_features, in_features]", eng_desc(w));
  if (check_pair("linear", x, w)) return NULL;
  if (ENG_DT_ACTIVE(x->dist || ENG_META_T(x) || w->dist || ENG_META_T(w) || ((bias && bias->dist) || ENG_META_T(bias))))
    return eng_op_dispatch(ENG_OP_LINEAR, &(eng_op_call){.n_in = 3, .in = {x, w, bias}});
  if (!eng_dtype_is_floating(x->dtype))
    return eng_errp("linear: %s x %s: floating point tensors expected", eng_desc(x), eng_desc(w));
  int64_t in_f = x->shape[x->ndim - 1], out_f = w->shape[0];
  if (w->shape[1] != in_f)
    return eng_errp("linear: input %s and weight %s: in_features %lld and %lld differ", eng_desc(x),
                    eng_desc(w), (long long)in_f, (long long)w->shape[1]);
  if (bias) {
    if (bias->dtype != x->dtype || bias->device != x->device)
      return eng_errp("linear: bias %s does not match input %s in dtype/device", eng_desc(bias), eng_desc(x));
    if (bias->ndim != 1 || bias->shape[0] != out_f)
      return eng_errp("linear: bias %s must be [%lld] for weight %s", eng_desc(bias), (long long)out_f,
                      eng_desc(w));
  }
  lin_plan p;
  lin_plan_make(x, &p);
  int rdt = x->dtype, cdt = mm_cdt(x);
  int64_t oshape[ENG_MAX_DIMS];
  for (int d = 0; d < x->ndim - 1; d++) oshape[d] = x->shape[d];
  oshape[x->ndim - 1] = out_f;
  eng_tensor *X = in_dtype(x, cdt), *W = X ? in_dtype(w, cdt) : NULL, *Bi = NULL, *hx = NULL, *hw = NULL;
  eng_tensor* out = NULL;
  eng_mview vx, vw, vc;
  if (!X || !W || eng_mview_prep(X, p.vec, 0, p.nb, p.bshape, &vx, &hx) ||
      eng_mview_prep(W, 0, 1, p.nb, p.bshape, &vw, &hw))
    goto fail;
  if (!(out = eng_new(x->ndim, oshape, cdt, x->device))) goto fail;
  if (bias && !(Bi = eng_as_contig(bias, cdt))) goto fail;
  if (bias && x->device != ENG_CUDA) {
    int64_t rows = out_f ? out->numel / out_f : 0;
    kc_fill_rows(cdt, rows, out_f, (void*)eng_ptr(Bi), (void*)eng_ptr(out), out_f);
  }
  eng_mview_of(out, p.vec, p.nb, p.bshape, &vc);
  if (x->device == ENG_CUDA) { /* the bias rides in cuBLASLt's epilogue */
    if (eng_cu_bmm_run(cdt, cdt, p.nb, p.bshape, &vx, &vw, &vc, 1.0, 0.0, Bi ? eng_ptr(Bi) : NULL, "linear")) goto fail;
  } else if (eng_bmm_run(cdt, p.nb, p.bshape, &vx, &vw, &vc, 1.0, bias ? 1.0 : 0.0, "linear")) goto fail;
  eng_tensor_release(X); eng_tensor_release(W); eng_tensor_release(Bi);
  eng_tensor_release(hx); eng_tensor_release(hw);
  X = W = Bi = hx = hw = NULL;
  if (rdt != cdt) {
    eng_tensor* r = eng_as_contig(out, rdt);
    eng_tensor_release(out);
    if (!(out = r)) return NULL;
  }
  eng_tensor* in[3] = {x, w, bias};
  int nin = bias ? 3 : 2;
  if (eng_any_requires_grad(nin, in)) {
    eng_node* nd = eng_record("LinearBackward", linear_bw, nin, in, out);
    if (!nd || eng_node_save(nd, x) || eng_node_save(nd, w)) { eng_tensor_release(out); return NULL; }
    nd->edges_last_first = 1; /* the bias's gradient before the weight's, as PyTorch's addmm and t() give them */
  }
  return out;
fail:
  eng_tensor_release(X); eng_tensor_release(W); eng_tensor_release(Bi);
  eng_tensor_release(hx); eng_tensor_release(hw); eng_tensor_release(out);
  return NULL;
}

/* ------------------------------------------------------------------ linear + gelu */
/* gelu(x @ w^T + bias) as one op on the CPU (f32, f64): the gelu runs as the
 * GEMM's epilogue on each block of rows the thread just computed, and its
 * backward computes gelu's gradient and the bias gradient in one pass before
 * linear's two products.  Saved: x, w, the pre-activation h.  Values and
 * gradients equal eng_gelu(eng_linear(x, w, bias)) bit for bit; DTensors
 * dispatch (sharding/matmul.c: the op on the local shards); tanh GELU on CUDA
 * runs in cuBLASLt's epilogue (linear_gelu_cuda); every other case (meta,
 * exact GELU on CUDA, other dtypes) runs that composition. */
typedef struct { int dt, op; int64_t n; char *h, *y; } lg_epi;

static void lg_epi_rows(void* vc, int64_t r0, int64_t r1) {
  const lg_epi* c = vc;
  size_t rb = (size_t)c->n * (c->dt == ENG_F32 ? 4 : 8);
  for (int64_t i = r0; i < r1; i++) {
    int64_t es = c->dt == ENG_F32 ? 4 : 8;
    kc_unary_row(c->op, c->dt, c->n, c->y + (size_t)i * rb, es, c->h + (size_t)i * rb, es, NAN, NAN);
  }
}

/* saved: 0 x, 1 w, 2 h.  ints: 0 the gelu kernel op. */
static int linear_gelu_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor* h = eng_node_saved(n, 2);
  if (!h) return -1;
  int dt = h->dtype;
  int64_t of = h->shape[h->ndim - 1], rows = of ? h->numel / of : 0;
  int need_b = n->n_inputs > 2 && eng_node_needs_grad(n, 2);
  eng_tensor* G = eng_as_contig(go[0], dt);
  eng_tensor* gh = G ? eng_new(h->ndim, h->shape, dt, h->device) : NULL;
  eng_tensor* gb = need_b && h->device != ENG_CUDA ? eng_new(1, &of, dt, h->device) : NULL;
  int rc = -1;
  if (G && gh && h->device == ENG_CUDA) { /* gelu's gradient on the device; linear's backward sums the bias's */
    if (!eng_cu_unary_grad((int)n->ints[0], dt, h->ndim, h->shape, eng_ptr(gh), gh->stride, eng_ptr(G), G->stride,
                           eng_ptr(h), h->stride, eng_ptr(G), G->stride, NAN, NAN, n->name))
      rc = linear_bw_g(n, gh, NULL, gi);
  } else if (G && gh && (!need_b || gb)) {
    kc_gelu_bias_grad(dt, (int)n->ints[0], rows, of, eng_ptr(G), eng_ptr(h), (void*)eng_ptr(gh),
                      gb ? (void*)eng_ptr(gb) : NULL);
    rc = linear_bw_g(n, gh, gb, gi);
  }
  eng_tensor_release(G); eng_tensor_release(gh); eng_tensor_release(gb);
  return rc;
}

/* On CUDA, tanh GELU (GPT-2's) rides in cuBLASLt's epilogue: one product writes y and the pre-activation h
 * (BIAS_GELU_AUX), instead of linear's product then a GELU kernel reading h back; backward is GELU's gradient
 * kernel then linear's.  Values differ from the composition by rounding only (the GELU sees the f32 accumulator,
 * not h rounded to the dtype).  ENGINE_GELU_EPILOGUE=0 runs the composition instead. */
static int cuda_gelu_epilogue(const eng_tensor* x, const eng_tensor* w, const eng_tensor* bias, int approximate) {
  static int on = -1;
  if (on < 0) {
    const char* e = getenv("ENGINE_GELU_EPILOGUE");
    on = !(e && !strcmp(e, "0"));
  }
  int dt = x->dtype;
  return on && approximate == 1 && x->device == ENG_CUDA && w->device == ENG_CUDA &&
         (!bias || bias->device == ENG_CUDA) && (dt == ENG_BF16 || dt == ENG_F16 || dt == ENG_F32) &&
         w->dtype == dt && (!bias || bias->dtype == dt) && x->ndim >= 2 && w->ndim == 2 &&
         w->shape[1] == x->shape[x->ndim - 1] && w->shape[1] > 0 && w->shape[0] % 8 == 0 &&
         (!bias || (bias->ndim == 1 && bias->shape[0] == w->shape[0]));
}

#define LG_NOT_FUSED ((eng_tensor*)1)

/* The fused op on x's device: the CPU GEMM's epilogue (f32, f64) or cuBLASLt's (linear_gelu_cuda's conditions);
 * LG_NOT_FUSED when cuBLASLt has no algorithm for it (nothing recorded: the caller runs the composition). */
static eng_tensor* linear_gelu_fused(eng_tensor* x, eng_tensor* w, eng_tensor* bias, int approximate) {
  int dt = x->dtype, op = approximate ? KU_GELU_TANH : KU_GELU;
  int64_t in_f = w->shape[1], out_f = w->shape[0], rows = in_f ? x->numel / in_f : 0;
  if (!in_f) rows = eng_shape_numel(x->ndim - 1, x->shape);
  int64_t oshape[ENG_MAX_DIMS];
  for (int d = 0; d < x->ndim - 1; d++) oshape[d] = x->shape[d];
  oshape[x->ndim - 1] = out_f;
  eng_tensor *X = eng_as_contig(x, dt), *W = X ? eng_as_contig(w, dt) : NULL, *Bi = NULL;
  eng_tensor *h = NULL, *y = NULL;
  if (!X || !W || (bias && !(Bi = eng_as_contig(bias, dt)))) goto fail;
  if (!(h = eng_new(x->ndim, oshape, dt, x->device)) || !(y = eng_new(x->ndim, oshape, dt, x->device))) goto fail;
  if (x->device == ENG_CUDA) {
    int st = eng_cu_linear_gelu(dt, rows, out_f, in_f, eng_ptr(X), eng_ptr(W), Bi ? eng_ptr(Bi) : NULL,
                                (void*)eng_ptr(y), (void*)eng_ptr(h), "linear_gelu");
    if (st > 0) { /* no cuBLASLt algorithm with this epilogue */
      eng_tensor_release(X); eng_tensor_release(W); eng_tensor_release(Bi);
      eng_tensor_release(h); eng_tensor_release(y);
      return LG_NOT_FUSED;
    }
    if (st < 0) goto fail;
  } else {
    lg_epi e = {dt, op, out_f, (char*)eng_ptr(h), (char*)eng_ptr(y)};
    kc_gemm_epi(dt, 0, 1, rows, out_f, in_f, eng_ptr(X), in_f, eng_ptr(W), in_f, Bi ? eng_ptr(Bi) : NULL,
                (void*)eng_ptr(h), lg_epi_rows, &e);
  }
  eng_tensor_release(X); eng_tensor_release(W); eng_tensor_release(Bi);
  X = W = Bi = NULL;
  eng_tensor* in[3] = {x, w, bias};
  int nin = bias ? 3 : 2;
  if (eng_any_requires_grad(nin, in)) {
    eng_node* nd = eng_record("LinearGeluBackward", linear_gelu_bw, nin, in, y);
    if (!nd || eng_node_save(nd, x) || eng_node_save(nd, w) || eng_node_save(nd, h)) goto fail;
    nd->ints[0] = op;
    nd->edges_last_first = 1; /* as LinearBackward */
  }
  eng_tensor_release(h);
  return y;
fail:
  eng_tensor_release(X); eng_tensor_release(W); eng_tensor_release(Bi);
  eng_tensor_release(h); eng_tensor_release(y);
  return NULL;
}

eng_tensor* eng_linear_gelu(eng_tensor* x, eng_tensor* w, eng_tensor* bias, int approximate) {
  ENG_CHECK(x, "linear_gelu"); ENG_CHECK(w, "linear_gelu");
  if (approximate != 0 && approximate != 1)
    return eng_errp("linear_gelu: approximate must be 0 (exact, erf) or 1 (tanh), got %d", approximate);
  if (ENG_DT_ACTIVE(x->dist || w->dist || (bias && bias->dist))) { /* DTensors: the fused op on the shards */
    if (w->ndim != 2)
      return eng_errp("linear_gelu: weight %s must be 2-D [out_features, in_features]", eng_desc(w));
    if (check_pair("linear_gelu", x, w)) return NULL;
    return eng_op_dispatch(ENG_OP_LINEAR_GELU, &(eng_op_call){.n_in = 3, .in = {x, w, bias}, .ints = {approximate}});
  }
  /* (DTensors reach here only in local mode, on their local shards) */
  int fused = x->device == ENG_CPU && w->device == ENG_CPU && (!bias || bias->device == ENG_CPU) &&
              (x->dtype == ENG_F32 || x->dtype == ENG_F64) &&
              w->dtype == x->dtype && (!bias || bias->dtype == x->dtype) && x->ndim >= 2 && w->ndim == 2 &&
              w->shape[1] == x->shape[x->ndim - 1] && (!bias || (bias->ndim == 1 && bias->shape[0] == w->shape[0]));
  if (fused || cuda_gelu_epilogue(x, w, bias, approximate)) {
    eng_tensor* y = linear_gelu_fused(x, w, bias, approximate);
    if (y != LG_NOT_FUSED) return y;
  }
  /* the composition: its ops check, dispatch DTensors and run other devices */
  eng_tensor* h = eng_linear(x, w, bias);
  if (!h) return NULL;
  eng_tensor* y = eng_gelu(h, approximate);
  eng_tensor_release(h);
  return y;
}
