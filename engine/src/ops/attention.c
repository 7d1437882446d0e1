/* attention.c: scaled_dot_product_attention as one op with its own
 * backward: batched GEMM (q k^T * scale) -> fused masked softmax (bool,
 * additive or causal mask) -> optional inverted dropout -> batched GEMM (@ v).
 * The attention probabilities are saved for backward; the dropout mask is
 * not: backward regenerates it from the counter-based RNG (seed, offset),
 * with the same Bernoulli draws as eng_dropout on the probabilities.
 * Rows with nothing to attend to give zeros (PyTorch's math path uses the
 * same "safe softmax" since 2.5).  Batches (all dims but the last two) run in
 * parallel on the engine's threads, each doing its small GEMMs on one BLAS
 * thread; backward runs serially when an input is broadcast over the batch
 * (its gradient is a sum over batches). */
#include "ops/bmm.h"
#include "core/dispatch.h"
#include "kernels/cpu/kcpu.h"
#include "ops/cuda_ops.h"
#include "ops/ops.h"
#include "autograd/autograd.h"
#include "eng/rng.h"
#include "eng/ops_math.h"
#include "eng/ops_nn.h"
#include "eng/ops_pointwise.h"
#include "eng/ops_reduce.h"
#include "eng/ops_shape.h"
#include <math.h>

static int compute_dtype(int dt) { return dt == ENG_F64 ? ENG_F64 : ENG_F32; }

static eng_tensor* in_dtype(eng_tensor* t, int cdt) {
  return t->dtype == cdt ? eng_tensor_retain(t) : eng_as_contig(t, cdt);
}

typedef struct {
  int nb;
  int64_t L, S, E, Ev;
  int64_t bshape[ENG_MAX_DIMS];
  int64_t pshape[ENG_MAX_DIMS]; /* [bshape..., L, S] */
} at_plan;

static int at_plan_make(const eng_tensor* q, const eng_tensor* k, const eng_tensor* v, at_plan* p) {
  const char* op = "scaled_dot_product_attention";
  if (q->ndim < 2 || k->ndim < 2 || v->ndim < 2)
    return eng_err("%s: q %s, k %s, v %s: each needs at least 2 dims ([..., L, E], [..., S, E], [..., S, Ev])",
                   op, eng_desc(q), eng_desc(k), eng_desc(v));
  p->L = q->shape[q->ndim - 2]; p->E = q->shape[q->ndim - 1];
  p->S = k->shape[k->ndim - 2]; p->Ev = v->shape[v->ndim - 1];
  if (k->shape[k->ndim - 1] != p->E)
    return eng_err("%s: q %s and k %s: embedding dims (last) %lld and %lld differ", op, eng_desc(q), eng_desc(k),
                   (long long)p->E, (long long)k->shape[k->ndim - 1]);
  if (v->shape[v->ndim - 2] != p->S)
    return eng_err("%s: k %s and v %s: sequence dims (second to last) %lld and %lld differ", op, eng_desc(k),
                   eng_desc(v), (long long)p->S, (long long)v->shape[v->ndim - 2]);
  int nq = q->ndim - 2, nk = k->ndim - 2, nv = v->ndim - 2;
  p->nb = nq > nk ? nq : nk;
  if (nv > p->nb) p->nb = nv;
  for (int i = 0; i < p->nb; i++) {
    int iq = nq - p->nb + i, ik = nk - p->nb + i, iv = nv - p->nb + i;
    int64_t a = iq >= 0 ? q->shape[iq] : 1, b = ik >= 0 ? k->shape[ik] : 1, c = iv >= 0 ? v->shape[iv] : 1;
    int64_t r = a;
    if (r == 1) r = b; else if (b != 1 && b != r) r = -1;
    if (r == 1) r = c; else if (r != -1 && c != 1 && c != r) r = -1;
    if (r < 0)
      return eng_err("%s: batch dims of q %s, k %s and v %s do not broadcast", op, eng_desc(q), eng_desc(k),
                     eng_desc(v));
    p->bshape[i] = r;
    p->pshape[i] = r;
  }
  p->pshape[p->nb] = p->L;
  p->pshape[p->nb + 1] = p->S;
  return 0;
}

/* The dropout keep mask (u8, shape pshape) drawn with (seed, offset): the
 * same Bernoulli(1 - p) draws eng_dropout makes for that offset. */
static eng_tensor* dropout_keep(const at_plan* p, double dp, uint64_t seed, uint64_t offset) {
  return eng_random_slice(ENG_RNG_BERNOULLI, p->nb + 2, p->pshape, NULL, NULL, 1.0 - dp, 0.0, ENG_U8, seed,
                          offset);
}

/* A shard's attention weights (eng_sdpa_shard): the box pstart + pshape of
 * the global weights gshape; the mask is that slice of the global mask. */
typedef struct { int nd; int64_t gshape[ENG_MAX_DIMS], start[ENG_MAX_DIMS]; } at_box;

static eng_tensor* dropout_keep_box(const at_plan* p, const at_box* b, double dp, uint64_t seed, uint64_t offset) {
  if (!b) return dropout_keep(p, dp, seed, offset);
  if (b->nd != p->nb + 2)
    return eng_errp("scaled_dot_product_attention: internal error: shard box of %d dims for %d-d weights", b->nd,
                    p->nb + 2);
  return eng_random_slice(ENG_RNG_BERNOULLI, b->nd, b->gshape, b->start, p->pshape, 1.0 - dp, 0.0, ENG_U8, seed,
                          offset);
}

static void box_free(eng_node* n) { free(n->ctx); n->ctx = NULL; }

/* A new tensor of the given shape (ref's dim count) laid out in memory in
 * the dim order of ref's strides, as torch.empty_like keeps a dense layout:
 * q, k, v are usually [B, H, L, E] views of [B, L, H, E] projections, and
 * an output and gradients in that layout make the transposes around the
 * attention free (no copies).  Contiguous when ref's last dim is not its
 * innermost one. */
static eng_tensor* new_like_layout(const eng_tensor* ref, const int64_t* shape, int dt, int zero) {
  int nd = ref->ndim, perm[ENG_MAX_DIMS];
  for (int d = 0; d < nd; d++) perm[d] = d;
  for (int i = 1; i < nd; i++) /* stable insertion sort by stride, outermost first */
    for (int j = i; j > 0 && ref->stride[perm[j]] > ref->stride[perm[j - 1]]; j--) {
      int t = perm[j]; perm[j] = perm[j - 1]; perm[j - 1] = t;
    }
  int ident = 1;
  for (int d = 0; d < nd; d++) ident &= perm[d] == d;
  if (ident || nd == 0 || perm[nd - 1] != nd - 1)
    return zero ? eng_tensor_zeros(nd, shape, dt, ref->device) : eng_new(nd, shape, dt, ref->device);
  int64_t pshape[ENG_MAX_DIMS], pst[ENG_MAX_DIMS], st[ENG_MAX_DIMS];
  for (int d = 0; d < nd; d++) pshape[d] = shape[perm[d]];
  eng_tensor* base = zero ? eng_tensor_zeros(nd, pshape, dt, ref->device) : eng_new(nd, pshape, dt, ref->device);
  if (!base) return NULL;
  eng_contiguous_strides(nd, pshape, pst);
  for (int d = 0; d < nd; d++) st[perm[d]] = pst[d];
  eng_tensor* t = eng_view_of(base, nd, shape, st, 0);
  eng_tensor_release(base);
  return t;
}

static eng_tensor* grad_buffer(const eng_tensor* like, int cdt, int zero) {
  return new_like_layout(like, like->shape, cdt, zero);
}

int eng_sdpa_fused_qkv(const eng_tensor* q, const eng_tensor* k, const eng_tensor* v) {
  if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4 || !q->storage || q->storage != k->storage ||
      q->storage != v->storage || q->dtype != k->dtype || q->dtype != v->dtype)
    return 0;
  for (int d = 0; d < 4; d++)
    if (k->shape[d] != q->shape[d] || v->shape[d] != q->shape[d] || k->stride[d] != q->stride[d] ||
        v->stride[d] != q->stride[d])
      return 0;
  int64_t H = q->shape[1], L = q->shape[2], D = q->shape[3];
  return q->stride[3] == 1 && q->stride[1] == D && q->stride[2] == 3 * H * D && q->stride[0] == L * 3 * H * D &&
         k->offset == q->offset + H * D && v->offset == q->offset + 2 * H * D;
}

/* The gradients of a fused QKV projection's q, k, v (eng_sdpa_fused_qkv): views of one new [B, L, 3 H D] tensor at
 * q, k and v's places, so the split's backward takes it whole instead of a cat of three buffers. */
static int fused_grad_buffers(const eng_tensor* q, int cdt, eng_tensor** gq, eng_tensor** gk, eng_tensor** gv) {
  int64_t n = q->shape[0] * q->shape[2] * 3 * q->shape[1] * q->shape[3], hd = q->shape[1] * q->shape[3];
  eng_tensor* buf = eng_new(1, &n, cdt, q->device);
  if (!buf) return -1;
  *gq = eng_view_of(buf, 4, q->shape, q->stride, 0);
  *gk = eng_view_of(buf, 4, q->shape, q->stride, hd);
  *gv = eng_view_of(buf, 4, q->shape, q->stride, 2 * hd);
  eng_tensor_release(buf);
  return *gq && *gk && *gv ? 0 : -1;
}

/* One operand of the per-batch products: base pointer, BLAS layout and the
 * byte offset of every batch (row-major over the batch shape). */
typedef struct { char* p; int t; int64_t ld; int64_t* off; } opnd;

static int opnd_make(const eng_mview* m, int nb, const int64_t* bs, int es, int output, opnd* o) {
  o->off = NULL;
  if (!eng_mview_layout(m, &o->t, &o->ld) || (output && o->t))
    return eng_err("scaled_dot_product_attention: internal error: operand layout not usable by BLAS");
  int64_t tot = eng_shape_numel(nb, bs), idx[ENG_MAX_DIMS] = {0};
  o->p = m->p;
  if (!(o->off = malloc((size_t)(tot > 0 ? tot : 1) * sizeof *o->off)))
    return eng_err("scaled_dot_product_attention: out of memory");
  for (int64_t b = 0; b < tot; b++) {
    int64_t off = 0;
    for (int d = 0; d < nb; d++) off += idx[d] * m->bs[d];
    o->off[b] = off * es;
    for (int d = nb - 1; d >= 0; d--) { if (++idx[d] < bs[d]) break; idx[d] = 0; }
  }
  return 0;
}

/* Row i of operand o's matrix for batch b (o.t: stored transposed). */
static inline char* opnd_row(const opnd* o, int64_t b, int64_t i, int64_t es) {
  return o->p + o->off[b] + (o->t ? i : i * o->ld) * es;
}

/* Causal attention works in blocks of CAUSAL_BLK query rows: block
 * [i0, i1) attends to keys [0, min(i1, S)) only, so the products skip the
 * masked upper triangle (whose probabilities are exactly 0) instead of
 * computing and discarding it. */
#define CAUSAL_BLK 32

static void dropout_block(int dt, int64_t n, const char* x, const uint8_t* keep, double sc, char* out) {
  if (dt == ENG_F32) kc_dropout_apply_f32(n, (const float*)x, keep, (float)sc, (float*)out);
  else kc_dropout_apply_f64(n, (const double*)x, keep, sc, (double*)out);
}

/* Forward of batches [lo, hi): scores, masked softmax, dropout, @ v. */
typedef struct {
  int dt, mkind, causal;
  int64_t L, S, E, Ev, es;
  double scale, dsc;
  opnd q, kt, v, out;
  char *P, *Pd;            /* contiguous [batch, L, S] */
  const uint8_t* keep;     /* contiguous [batch, L, S] or NULL */
  const char* mask;
  int64_t mrs, mcs;
  const int64_t* moff;     /* bytes per batch */
} fwd_ctx;

static void fwd_range(void* vc, int64_t lo, int64_t hi) {
  fwd_ctx* c = vc;
  int64_t blk = c->L * c->S, lds = c->S > 0 ? c->S : 1;
  /* one f32 query row, no mask or dropout, rows of K, V and the output contiguous: decoding with a KV cache */
  int decode = c->L == 1 && c->dt == ENG_F32 && !c->causal && !c->mask && !c->keep && !c->q.t && c->kt.t && !c->v.t &&
               !c->out.t;
  for (int64_t b = lo; b < hi; b++) {
    char* P = c->P + b * blk * c->es;
    if (decode) {
      kc_attn_decode_f32(c->S, c->E, c->Ev, (float)c->scale, (const float*)(c->q.p + c->q.off[b]),
                         (const float*)(c->kt.p + c->kt.off[b]), c->kt.ld, (const float*)(c->v.p + c->v.off[b]),
                         c->v.ld, (float*)P, (float*)(c->out.p + c->out.off[b]));
      continue;
    }
    if (c->causal) {
      for (int64_t i0 = 0; i0 < c->L; i0 += CAUSAL_BLK) {
        int64_t i1 = i0 + CAUSAL_BLK < c->L ? i0 + CAUSAL_BLK : c->L, nc = i1 < c->S ? i1 : c->S;
        kc_gemm(c->dt, c->q.t, c->kt.t, i1 - i0, nc, c->E, c->scale, opnd_row(&c->q, b, i0, c->es), c->q.ld,
                c->kt.p + c->kt.off[b], c->kt.ld, 0.0, P + i0 * lds * c->es, lds);
      }
    } else {
      kc_gemm(c->dt, c->q.t, c->kt.t, c->L, c->S, c->E, c->scale, c->q.p + c->q.off[b], c->q.ld,
              c->kt.p + c->kt.off[b], c->kt.ld, 0.0, P, lds);
    }
    const void* m = c->mask ? (const void*)(c->mask + c->moff[b]) : NULL;
    if (c->dt == ENG_F32) kc_attn_softmax_f32(c->L, c->S, (float*)P, lds, m, c->mkind, c->mrs, c->mcs, c->causal);
    else kc_attn_softmax_f64(c->L, c->S, (double*)P, lds, m, c->mkind, c->mrs, c->mcs, c->causal);
    char* A = P;
    if (c->keep) {
      A = c->Pd + b * blk * c->es;
      dropout_block(c->dt, blk, P, c->keep + b * blk, c->dsc, A);
    }
    if (c->causal) {
      for (int64_t i0 = 0; i0 < c->L; i0 += CAUSAL_BLK) {
        int64_t i1 = i0 + CAUSAL_BLK < c->L ? i0 + CAUSAL_BLK : c->L, nc = i1 < c->S ? i1 : c->S;
        kc_gemm(c->dt, 0, c->v.t, i1 - i0, c->Ev, nc, 1.0, A + i0 * lds * c->es, lds, c->v.p + c->v.off[b],
                c->v.ld, 0.0, opnd_row(&c->out, b, i0, c->es), c->out.ld);
      }
    } else {
      kc_gemm(c->dt, 0, c->v.t, c->L, c->Ev, c->S, 1.0, A, lds, c->v.p + c->v.off[b], c->v.ld, 0.0,
              c->out.p + c->out.off[b], c->out.ld);
    }
  }
}

/* Backward of batches [lo, hi). */
typedef struct {
  int dt, need_q, need_k, need_v, need_s, causal;
  int64_t L, S, E, Ev, es;
  double scale, dsc, beta;
  opnd g, vt, k, q, gq, gk, gv;
  const char* P;
  char *Pd, *dP;
  const uint8_t* keep;
} bwd_ctx;

/* Causal backward of one batch: the same products restricted to the
 * unmasked part.  Query-row blocks [i0, i1) give dP and dq from keys
 * [0, min(i1, S)); key-column blocks [j0, j1) give dv and dk from query rows
 * [j0, L) (the rows that attend to them). */
static void bwd_causal(bwd_ctx* c, int64_t b, const char* P, const char* A, char* D) {
  int64_t L = c->L, S = c->S, es = c->es, lds = S > 0 ? S : 1;
  if (c->need_v) /* dv = Pd^T @ dO */
    for (int64_t j0 = 0; j0 < S; j0 += CAUSAL_BLK) {
      int64_t j1 = j0 + CAUSAL_BLK < S ? j0 + CAUSAL_BLK : S, r0 = j0 < L ? j0 : L;
      kc_gemm(c->dt, 1, c->g.t, j1 - j0, c->Ev, L - r0, 1.0, A + (r0 * lds + j0) * es, lds, opnd_row(&c->g, b, r0, es),
              c->g.ld, c->beta, opnd_row(&c->gv, b, j0, es), c->gv.ld);
    }
  if (!c->need_s) return;
  for (int64_t i0 = 0; i0 < L; i0 += CAUSAL_BLK) { /* dP = dO @ v^T on the unmasked columns, 0 beyond */
    int64_t i1 = i0 + CAUSAL_BLK < L ? i0 + CAUSAL_BLK : L, nc = i1 < S ? i1 : S;
    kc_gemm(c->dt, c->g.t, c->vt.t, i1 - i0, nc, c->Ev, 1.0, opnd_row(&c->g, b, i0, es), c->g.ld,
            c->vt.p + c->vt.off[b], c->vt.ld, 0.0, D + i0 * lds * es, lds);
    if (nc < S)
      for (int64_t i = i0; i < i1; i++) memset(D + (i * lds + nc) * es, 0, (size_t)((S - nc) * es));
  }
  int64_t blk = L * S;
  if (c->keep) dropout_block(c->dt, blk, D, c->keep + b * blk, c->dsc, D);
  /* softmax backward over each row's unmasked part, in whole 16-lane groups
   * (P is 0 past the diagonal, so dS is too); the rest of the row is 0 */
  for (int64_t i = 0; i < L; i++) {
    int64_t nv = ((i + 1 < S ? i + 1 : S) + 15) & ~(int64_t)15;
    if (nv > S) nv = S;
    char* Di = D + i * lds * es;
    const char* Pi = P + i * lds * es;
    if (c->dt == ENG_F32) kc_softmax_bw_f32(1, nv, 1, (const float*)Pi, (const float*)Di, (float*)Di, 0);
    else kc_softmax_bw_f64(1, nv, 1, (const double*)Pi, (const double*)Di, (double*)Di, 0);
    if (nv < S) memset(Di + nv * es, 0, (size_t)((S - nv) * es));
  }
  if (c->need_q) /* dq = scale * dS @ k */
    for (int64_t i0 = 0; i0 < L; i0 += CAUSAL_BLK) {
      int64_t i1 = i0 + CAUSAL_BLK < L ? i0 + CAUSAL_BLK : L, nc = i1 < S ? i1 : S;
      kc_gemm(c->dt, 0, c->k.t, i1 - i0, c->E, nc, c->scale, D + i0 * lds * es, lds, c->k.p + c->k.off[b], c->k.ld,
              c->beta, opnd_row(&c->gq, b, i0, es), c->gq.ld);
    }
  if (c->need_k) /* dk = scale * dS^T @ q */
    for (int64_t j0 = 0; j0 < S; j0 += CAUSAL_BLK) {
      int64_t j1 = j0 + CAUSAL_BLK < S ? j0 + CAUSAL_BLK : S, r0 = j0 < L ? j0 : L;
      kc_gemm(c->dt, 1, c->q.t, j1 - j0, c->E, L - r0, c->scale, D + (r0 * lds + j0) * es, lds,
              opnd_row(&c->q, b, r0, es), c->q.ld, c->beta, opnd_row(&c->gk, b, j0, es), c->gk.ld);
    }
}

static void bwd_range(void* vc, int64_t lo, int64_t hi) {
  bwd_ctx* c = vc;
  int64_t blk = c->L * c->S, lds = c->S > 0 ? c->S : 1;
  for (int64_t b = lo; b < hi; b++) {
    const char* P = c->P + b * blk * c->es;
    const char* A = P;
    if (c->keep) {
      char* pd = c->Pd + b * blk * c->es;
      dropout_block(c->dt, blk, P, c->keep + b * blk, c->dsc, pd);
      A = pd;
    }
    if (c->causal) { bwd_causal(c, b, P, A, c->need_s ? c->dP + b * blk * c->es : NULL); continue; }
    if (c->need_v) /* dv = Pd^T @ dO */
      kc_gemm(c->dt, 1, c->g.t, c->S, c->Ev, c->L, 1.0, A, lds, c->g.p + c->g.off[b], c->g.ld, c->beta,
              c->gv.p + c->gv.off[b], c->gv.ld);
    if (!c->need_s) continue;
    char* D = c->dP + b * blk * c->es;
    /* dP = dO @ v^T, back through dropout and the softmax: dS (in place) */
    kc_gemm(c->dt, c->g.t, c->vt.t, c->L, c->S, c->Ev, 1.0, c->g.p + c->g.off[b], c->g.ld,
            c->vt.p + c->vt.off[b], c->vt.ld, 0.0, D, lds);
    if (c->keep) dropout_block(c->dt, blk, D, c->keep + b * blk, c->dsc, D);
    if (c->dt == ENG_F32) kc_softmax_bw_f32(c->L, c->S, 1, (const float*)P, (const float*)D, (float*)D, 0);
    else kc_softmax_bw_f64(c->L, c->S, 1, (const double*)P, (const double*)D, (double*)D, 0);
    if (c->need_q) /* dq = scale * dS @ k */
      kc_gemm(c->dt, 0, c->k.t, c->L, c->E, c->S, c->scale, D, lds, c->k.p + c->k.off[b], c->k.ld, c->beta,
              c->gq.p + c->gq.off[b], c->gq.ld);
    if (c->need_k) /* dk = scale * dS^T @ q */
      kc_gemm(c->dt, 1, c->q.t, c->S, c->E, c->L, c->scale, D, lds, c->q.p + c->q.off[b], c->q.ld, c->beta,
              c->gk.p + c->gk.off[b], c->gk.ld);
  }
}

static int broadcast_in(const eng_mview* m, int nb, const int64_t* bs) {
  for (int d = 0; d < nb; d++) if (bs[d] > 1 && m->bs[d] == 0) return 1;
  return 0;
}

/* A backward whose gradient buffers are shared by several batches (a k / v broadcast over a batch dim: grouped-
 * query attention's kv heads) accumulates into them.  When the batches sharing a buffer slice come in runs of g
 * consecutive batches (the shared dim is the innermost broadcast one, as q [B, Hkv, g, L, E] against k
 * [B, Hkv, 1, S, E]), each run goes to one thread in order, runs in parallel; returns g, or 0 when the sharing
 * is not such runs (the whole backward then runs in order on one thread). */
static int64_t shared_runs(const opnd* const* outs, int n_outs, int64_t tot) {
  int64_t g = 0;
  for (int k = 0; k < n_outs; k++) { /* the run length of the first shared slice */
    int64_t r = 1;
    while (r < tot && outs[k]->off[r] == outs[k]->off[0]) r++;
    if (r > 1 && (g == 0 || r == g)) g = r;
    else if (r > 1) return 0;
  }
  if (g <= 1 || tot % g) return 0;
  for (int k = 0; k < n_outs; k++) {
    const int64_t* off = outs[k]->off;
    int shared = off[1] == off[0];
    for (int64_t b = 0; b < tot; b++) {
      int64_t lead = b - b % g;
      if (shared ? off[b] != off[lead] : (b > lead && off[b] == off[lead])) return 0;
      /* runs own distinct slices: offsets of run leaders strictly increasing (row-major batch order) */
      if (b == lead && b > 0 && off[b] <= off[b - g]) return 0;
    }
  }
  return g;
}

typedef struct { bwd_ctx* c; int64_t g; } bwd_runs;
static void bwd_runs_range(void* vr, int64_t lo, int64_t hi) {
  const bwd_runs* r = vr;
  bwd_range(r->c, lo * r->g, hi * r->g);
}

/* saved: 0 q, 1 k, 2 v, 3 P (probabilities before dropout, compute dtype).
 * scalars: 0 scale, 1 dropout_p.  ints: 0 seed, 1 offset, 2 is_causal. */
static int sdpa_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor *q = eng_node_saved(n, 0), *k = eng_node_saved(n, 1), *v = eng_node_saved(n, 2);
  eng_tensor* P = eng_node_saved(n, 3);
  if (!q || !k || !v || !P) return -1;
  at_plan p;
  if (at_plan_make(q, k, v, &p)) return -1;
  double dp = n->scalars[1];
  int cdt = P->dtype, nb = p.nb, es = eng_dtype_size(cdt);
  const int64_t* bs = p.bshape;
  int64_t tot = eng_shape_numel(nb, bs);
  bwd_ctx c = {0};
  c.dt = cdt; c.L = p.L; c.S = p.S; c.E = p.E; c.Ev = p.Ev; c.es = es;
  c.scale = n->scalars[0]; c.dsc = dp < 1.0 ? 1.0 / (1.0 - dp) : 0.0;
  c.causal = (int)n->ints[2];
  c.need_q = eng_node_needs_grad(n, 0); c.need_k = eng_node_needs_grad(n, 1); c.need_v = eng_node_needs_grad(n, 2);
  int need_m = eng_node_needs_grad(n, 3);
  c.need_s = c.need_q || c.need_k || need_m;
  eng_tensor *G = NULL, *Q = NULL, *K = NULL, *V = NULL, *U = NULL, *Pd = NULL, *dP = NULL;
  eng_tensor *hg = NULL, *hq = NULL, *hk = NULL, *hv = NULL, *gq = NULL, *gk = NULL, *gv = NULL;
  int rc = -1;
  eng_mview vg, vq, vk, vv, vc;
  /* grads of inputs broadcast over the batch are sums: accumulate serially */
  eng_mview_of(q, 0, nb, bs, &vq); eng_mview_of(k, 0, nb, bs, &vk); eng_mview_of(v, 0, nb, bs, &vv);
  int acc = (c.need_q && broadcast_in(&vq, nb, bs)) || (c.need_k && broadcast_in(&vk, nb, bs)) ||
            (c.need_v && broadcast_in(&vv, nb, bs));
  int zero = acc || tot == 0;
  c.beta = acc ? 1.0 : 0.0;
  if (!(G = in_dtype(go[0], cdt)) || eng_mview_prep(G, 0, 0, nb, bs, &vg, &hg) || opnd_make(&vg, nb, bs, es, 0, &c.g))
    goto done;
  c.P = eng_ptr(P);
  if (c.need_q && c.need_k && c.need_v && !zero && q->dtype == cdt && eng_sdpa_fused_qkv(q, k, v) &&
      fused_grad_buffers(q, cdt, &gq, &gk, &gv))
    goto done;
  if (dp > 0.0) {
    if (!(U = dropout_keep_box(&p, n->ctx, dp, (uint64_t)n->ints[0], (uint64_t)n->ints[1]))) goto done;
    if (!(Pd = eng_new(P->ndim, P->shape, cdt, P->device))) goto done;
    c.keep = (const uint8_t*)eng_ptr(U);
    c.Pd = eng_ptr(Pd);
  }
  if (c.need_v) {
    if (!gv && !(gv = grad_buffer(v, cdt, zero))) goto done;
    eng_mview_of(gv, 0, nb, bs, &vc);
    if (opnd_make(&vc, nb, bs, es, 1, &c.gv)) goto done;
  }
  if (c.need_s) {
    if (!(V = in_dtype(v, cdt)) || eng_mview_prep(V, 0, 1, nb, bs, &vv, &hv) || opnd_make(&vv, nb, bs, es, 0, &c.vt))
      goto done;
    if (!(dP = eng_new(P->ndim, P->shape, cdt, P->device))) goto done;
    c.dP = eng_ptr(dP);
  }
  if (c.need_q) {
    if (!(K = in_dtype(k, cdt)) || eng_mview_prep(K, 0, 0, nb, bs, &vk, &hk) || opnd_make(&vk, nb, bs, es, 0, &c.k))
      goto done;
    if (!gq && !(gq = grad_buffer(q, cdt, zero))) goto done;
    eng_mview_of(gq, 0, nb, bs, &vc);
    if (opnd_make(&vc, nb, bs, es, 1, &c.gq)) goto done;
  }
  if (c.need_k) {
    if (!(Q = in_dtype(q, cdt)) || eng_mview_prep(Q, 0, 0, nb, bs, &vq, &hq) || opnd_make(&vq, nb, bs, es, 0, &c.q))
      goto done;
    if (!gk && !(gk = grad_buffer(k, cdt, zero))) goto done;
    eng_mview_of(gk, 0, nb, bs, &vc);
    if (opnd_make(&vc, nb, bs, es, 1, &c.gk)) goto done;
  }
  int64_t g = 0;
  if (acc) {
    const opnd* outs[3];
    int no = 0;
    if (c.need_q) outs[no++] = &c.gq;
    if (c.need_k) outs[no++] = &c.gk;
    if (c.need_v) outs[no++] = &c.gv;
    g = shared_runs(outs, no, tot);
  }
  if (!acc) kc_parallel_blas(eng_threads(), tot, bwd_range, &c);
  else if (g) { bwd_runs r = {&c, g}; kc_parallel_blas(eng_threads(), tot / g, bwd_runs_range, &r); }
  else kc_parallel_blas(1, tot, bwd_range, &c);
  if (c.need_q && !(gi[0] = eng_grad_to_input(n, 0, gq))) goto done;
  if (c.need_k && !(gi[1] = eng_grad_to_input(n, 1, gk))) goto done;
  if (c.need_v && !(gi[2] = eng_grad_to_input(n, 2, gv))) goto done;
  if (need_m && !(gi[3] = eng_grad_to_input(n, 3, dP))) goto done;
  rc = 0;
done:
  free(c.g.off); free(c.vt.off); free(c.k.off); free(c.q.off); free(c.gq.off); free(c.gk.off); free(c.gv.off);
  eng_tensor_release(G); eng_tensor_release(Q); eng_tensor_release(K); eng_tensor_release(V);
  eng_tensor_release(U); eng_tensor_release(Pd); eng_tensor_release(dP);
  eng_tensor_release(hg); eng_tensor_release(hq); eng_tensor_release(hk); eng_tensor_release(hv);
  eng_tensor_release(gq); eng_tensor_release(gk); eng_tensor_release(gv);
  return rc;
}

/* CUDA: the flash kernels (no L x S matrix); saved q, k, v, out, lse.
 * scalars: 0 scale.  ints: 0 is_causal. */
static int sdpa_bw_cuda(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor *q = eng_node_saved(n, 0), *k = eng_node_saved(n, 1), *v = eng_node_saved(n, 2);
  eng_tensor *o = eng_node_saved(n, 3), *lse = eng_node_saved(n, 4);
  if (!q || !k || !v || !o || !lse) return -1;
  if (eng_cu_same_device(n->name, q, go[0])) return -1;
  eng_tensor* g[3] = {NULL, NULL, NULL};
  if (eng_cu_sdpa_bwd(q, k, v, o, lse, go[0], (int)n->ints[0], n->scalars[0], &g[0], &g[1], &g[2], n->name))
    return -1;
  int rc = 0;
  for (int i = 0; i < 3; i++) {
    if (rc == 0 && eng_node_needs_grad(n, i) && !(gi[i] = eng_grad_to_input(n, i, g[i]))) rc = -1;
    eng_tensor_release(g[i]);
  }
  return rc;
}

static eng_tensor* sdpa_cuda(eng_tensor* q, eng_tensor* k, eng_tensor* v, int causal, double scale) {
  const char* op = "scaled_dot_product_attention";
  eng_tensor* lse = NULL;
  eng_tensor* out = eng_cu_sdpa_fwd(q, k, v, causal, scale, &lse, op);
  if (!out) return NULL;
  eng_tensor* in[3] = {q, k, v};
  if (eng_any_requires_grad(3, in)) {
    eng_node* nd = eng_record("ScaledDotProductAttentionBackward", sdpa_bw_cuda, 3, in, out);
    if (!nd || eng_node_save(nd, q) || eng_node_save(nd, k) || eng_node_save(nd, v) || eng_node_save(nd, out) ||
        eng_node_save(nd, lse)) {
      eng_tensor_release(out); eng_tensor_release(lse);
      return NULL;
    }
    nd->scalars[0] = scale;
    nd->ints[0] = causal;
  }
  eng_tensor_release(lse);
  return out;
}

/* The backend engine.nn.attention.sdpa_kernel chose (eng_sdpa_set_backend): 0 the fused kernels where they apply,
 * 1 the math path everywhere. */
static int g_sdpa_backend;

int eng_sdpa_set_backend(int backend) {
  if (backend != ENG_SDPA_AUTO && backend != ENG_SDPA_MATH)
    return eng_err("sdpa_kernel: unknown backend %d (0 auto, 1 math)", backend);
  g_sdpa_backend = backend;
  return 0;
}

int eng_sdpa_get_backend(void) { return g_sdpa_backend; }

/* The math path, PyTorch's _scaled_dot_product_attention_math, composed of the engine's ops (autograd through
 * them): scores = q k^T * scale, the mask (bool: -inf where false; float: added; is_causal: keys j <= i), a row with
 * nothing to attend to gives zeros (as the kernels: its scores are set to 0 before the softmax and its
 * probabilities to 0 after, so no NaN reaches the gradients), inverted dropout with the kernels' keep mask for the
 * same generator state (dropout_keep_box: the same draws, a shard's slice of them), then @ v.  What the CUDA
 * kernels do not take (an attn_mask, dropout, f64, other ranks or head dims) runs here on the device; on the CPU
 * under sdpa_kernel("math").  Probabilities round to the input dtype (bf16 stays bf16), as PyTorch's math path. */
static eng_tensor* sdpa_math(eng_tensor* q, eng_tensor* k, eng_tensor* v, eng_tensor* mask, double dp, int causal,
                             double scale, const at_plan* p, const at_box* box) {
  const char* op = "scaled_dot_product_attention";
  int nd = p->nb + 2, last = nd - 1;
  eng_tensor *kt = NULL, *s0 = NULL, *sc = NULL, *cm = NULL, *nm = NULL, *sm = NULL, *mx = NULL, *dead = NULL;
  eng_tensor *s2 = NULL, *pr = NULL, *pz = NULL, *keep = NULL, *kd = NULL, *pd = NULL, *out = NULL;
  eng_tensor *ri = NULL, *ci = NULL, *rv = NULL, *cv = NULL;
  if (!(kt = eng_transpose(k, k->ndim - 2, k->ndim - 1)) || !(s0 = eng_matmul(q, kt)) ||
      !(sc = eng_mul_scalar(s0, scale)))
    goto done;
  eng_tensor* bmask = mask && mask->dtype == ENG_BOOL ? mask : NULL;
  if (causal) { /* keys j <= i, top-left aligned as the kernels */
    int64_t rs[2] = {p->L, 1}, cs[2] = {1, p->S};
    if (!(ri = eng_tensor_arange(0, (double)p->L, 1, ENG_I64, q->device)) ||
        !(ci = eng_tensor_arange(0, (double)p->S, 1, ENG_I64, q->device)) || !(rv = eng_reshape(ri, 2, rs)) ||
        !(cv = eng_reshape(ci, 2, cs)) || !(cm = eng_compare(cv, rv, ENG_LE)))
      goto done;
    bmask = cm;
  }
  if (bmask) {
    if (!(nm = eng_logical_not(bmask)) || !(sm = eng_masked_fill(sc, nm, -INFINITY))) goto done;
  } else if (mask) {
    eng_tensor* mf = mask->dtype == sc->dtype ? eng_tensor_retain(mask) : eng_as_contig(mask, sc->dtype);
    if (!mf) goto done;
    sm = eng_add(sc, mf);
    eng_tensor_release(mf);
    if (!sm) goto done;
  } else {
    sm = eng_tensor_retain(sc);
  }
  { /* rows with nothing to attend to: every score -inf */
    eng_tensor* ix = NULL;
    mx = eng_max_dim(sm, last, 1, &ix);
    eng_tensor_release(ix);
    if (!mx || !(dead = eng_compare_scalar(mx, -INFINITY, ENG_EQ))) goto done;
  }
  if (!(s2 = eng_masked_fill(sm, dead, 0.0)) || !(pr = eng_softmax(s2, last)) || !(pz = eng_masked_fill(pr, dead, 0.0)))
    goto done;
  if (dp > 0.0) {
    uint64_t seed, cur;
    eng_rng_get_state(&seed, &cur);
    uint64_t offset = eng_rng_reserve((uint64_t)(box ? eng_shape_numel(box->nd, box->gshape) : pz->numel));
    eng_tensor* u = dropout_keep_box(p, box, dp, seed, offset);
    if (!u) goto done;
    eng_tensor* ud = u->device == pz->device ? eng_tensor_retain(u) : eng_tensor_to_device(u, pz->device);
    eng_tensor_release(u);
    if (!ud) goto done;
    keep = eng_as_contig(ud, pz->dtype);
    eng_tensor_release(ud);
    if (!keep || !(kd = eng_mul(pz, keep)) || !(pd = eng_mul_scalar(kd, dp < 1.0 ? 1.0 / (1.0 - dp) : 0.0))) goto done;
  } else {
    pd = eng_tensor_retain(pz);
  }
  out = eng_matmul(pd, v);
done:
  eng_tensor_release(kt); eng_tensor_release(s0); eng_tensor_release(sc); eng_tensor_release(cm);
  eng_tensor_release(nm); eng_tensor_release(sm); eng_tensor_release(mx); eng_tensor_release(dead);
  eng_tensor_release(s2); eng_tensor_release(pr); eng_tensor_release(pz); eng_tensor_release(keep);
  eng_tensor_release(kd); eng_tensor_release(pd);
  eng_tensor_release(ri); eng_tensor_release(ci); eng_tensor_release(rv); eng_tensor_release(cv);
  if (!out) eng_err_prefix("%s (math path)", op);
  return out;
}

static eng_tensor* sdpa_op(eng_tensor* q, eng_tensor* k, eng_tensor* v, eng_tensor* mask, double dropout_p,
                           int is_causal, double scale, const at_box* box) {
  const char* op = "scaled_dot_product_attention";
  ENG_CHECK(q, op); ENG_CHECK(k, op); ENG_CHECK(v, op);
  if (eng_meta_check_local(q, op) || eng_meta_check_local(k, op) || eng_meta_check_local(v, op) || eng_meta_check_local(mask, op)) return NULL;
  if (ENG_DT_ACTIVE(q->dist || ENG_META_T(q) || k->dist || ENG_META_T(k) || v->dist || ENG_META_T(v) || ((mask && mask->dist) || ENG_META_T(mask)))) return eng_op_dispatch(ENG_OP_SDPA, &(eng_op_call){.name = op, .n_in = 4, .in = {q, k, v, mask}, .ints = {is_causal ? 1 : 0}, .scalars = {dropout_p, scale}});
  if (q->dtype != k->dtype || q->dtype != v->dtype)
    return eng_errp("%s: q %s, k %s and v %s must have the same dtype", op, eng_desc(q), eng_desc(k), eng_desc(v));
  if (!eng_dtype_is_floating(q->dtype))
    return eng_errp("%s: q %s: floating point tensors expected", op, eng_desc(q));
  if (q->device != k->device || q->device != v->device || (mask && mask->device != q->device))
    return eng_errp("%s: q %s, k %s, v %s: tensors on different devices", op, eng_desc(q), eng_desc(k), eng_desc(v));
  if (!(dropout_p >= 0.0 && dropout_p <= 1.0))
    return eng_errp("%s: dropout_p must be in [0, 1], got %g", op, dropout_p);
  at_plan p;
  if (at_plan_make(q, k, v, &p)) return NULL;
  if (mask && is_causal)
    return eng_errp("%s: an explicit attn_mask %s cannot be combined with is_causal = true", op, eng_desc(mask));
  int nb = p.nb, pnd = nb + 2;
  const int64_t* bs = p.bshape;
  if (mask) {
    if (mask->dtype != ENG_BOOL && !eng_dtype_is_floating(mask->dtype))
      return eng_errp("%s: attn_mask %s must be bool (true = attend) or floating (added to the scores)", op,
                      eng_desc(mask));
    int64_t tmp[ENG_MAX_DIMS];
    int r = eng_broadcast_shapes(mask->ndim, mask->shape, pnd, p.pshape, tmp, op, NULL, NULL);
    int ok = r == pnd;
    for (int d = 0; ok && d < pnd; d++) ok = tmp[d] == p.pshape[d];
    if (!ok) {
      eng_clear_error();
      return eng_errp("%s: attn_mask %s does not broadcast to the attention weights %s (q %s, k %s)", op,
                      eng_desc(mask), eng_shape_str(pnd, p.pshape), eng_desc(q), eng_desc(k));
    }
  }
  if (!(scale > 0.0)) scale = p.E > 0 ? 1.0 / sqrt((double)p.E) : 1.0;
  if (g_sdpa_backend == ENG_SDPA_MATH ||
      (q->device == ENG_CUDA && (mask || dropout_p > 0.0 || !eng_cu_sdpa_supported(q, k, v))))
    return sdpa_math(q, k, v, mask, dropout_p, is_causal, scale, &p, box);
  if (q->device == ENG_CUDA) return sdpa_cuda(q, k, v, is_causal ? 1 : 0, scale);
  int rdt = q->dtype, cdt = compute_dtype(rdt);
  int64_t oshape[ENG_MAX_DIMS];
  for (int d = 0; d < nb; d++) oshape[d] = bs[d];
  oshape[nb] = p.L; oshape[nb + 1] = p.Ev;
  eng_tensor *Q = NULL, *K = NULL, *V = NULL, *Mk = NULL, *hq = NULL, *hk = NULL, *hv = NULL;
  eng_tensor *P = NULL, *U = NULL, *Pd = NULL, *out = NULL;
  uint64_t seed = 0, offset = 0;
  int es = eng_dtype_size(cdt);
  int64_t tot = eng_shape_numel(nb, bs);
  int64_t* moff = NULL;
  fwd_ctx c = {0};
  c.dt = cdt; c.causal = is_causal ? 1 : 0; c.L = p.L; c.S = p.S; c.E = p.E; c.Ev = p.Ev; c.es = es;
  c.scale = scale; c.dsc = dropout_p < 1.0 ? 1.0 / (1.0 - dropout_p) : 0.0;
  eng_mview vq, vk, vv, vo;
  if (!(Q = in_dtype(q, cdt)) || !(K = in_dtype(k, cdt)) || !(V = in_dtype(v, cdt))) goto fail;
  if (eng_mview_prep(Q, 0, 0, nb, bs, &vq, &hq) || eng_mview_prep(K, 0, 1, nb, bs, &vk, &hk) ||
      eng_mview_prep(V, 0, 0, nb, bs, &vv, &hv))
    goto fail;
  if (!(P = eng_new(pnd, p.pshape, cdt, q->device))) goto fail;
  out = q->ndim == pnd ? new_like_layout(q, oshape, cdt, 0) : eng_new(pnd, oshape, cdt, q->device);
  if (!out) goto fail;
  eng_mview_of(out, 0, nb, bs, &vo);
  if (opnd_make(&vq, nb, bs, es, 0, &c.q) || opnd_make(&vk, nb, bs, es, 0, &c.kt) ||
      opnd_make(&vv, nb, bs, es, 0, &c.v) || opnd_make(&vo, nb, bs, es, 1, &c.out))
    goto fail;
  c.P = eng_ptr(P);
  if (mask) {
    int64_t mst[ENG_MAX_DIMS] = {0}, idx[ENG_MAX_DIMS] = {0};
    if (mask->dtype == ENG_BOOL) { Mk = eng_tensor_retain(mask); c.mkind = 1; }
    else { if (!(Mk = in_dtype(mask, cdt))) goto fail; c.mkind = 2; }
    eng_broadcast_strides(Mk, pnd, p.pshape, mst);
    int mes = eng_dtype_size(Mk->dtype);
    if (!(moff = malloc((size_t)(tot > 0 ? tot : 1) * sizeof *moff))) { eng_err("%s: out of memory", op); goto fail; }
    for (int64_t b = 0; b < tot; b++) {
      int64_t o = 0;
      for (int d = 0; d < nb; d++) o += idx[d] * mst[d];
      moff[b] = o * mes;
      for (int d = nb - 1; d >= 0; d--) { if (++idx[d] < bs[d]) break; idx[d] = 0; }
    }
    c.mask = eng_ptr(Mk); c.moff = moff; c.mrs = mst[nb]; c.mcs = mst[nb + 1];
  }
  if (dropout_p > 0.0) {
    uint64_t cur;
    eng_rng_get_state(&seed, &cur);
    offset = eng_rng_reserve((uint64_t)(box ? eng_shape_numel(box->nd, box->gshape) : P->numel));
    if (!(U = dropout_keep_box(&p, box, dropout_p, seed, offset))) goto fail;
    if (!(Pd = eng_new(pnd, p.pshape, cdt, q->device))) goto fail;
    c.keep = (const uint8_t*)eng_ptr(U);
    c.Pd = eng_ptr(Pd);
  }
  kc_parallel_blas(eng_threads(), tot, fwd_range, &c);
  free(c.q.off); free(c.kt.off); free(c.v.off); free(c.out.off); free(moff);
  c.q.off = c.kt.off = c.v.off = c.out.off = moff = NULL;
  eng_tensor_release(Q); eng_tensor_release(K); eng_tensor_release(V); eng_tensor_release(Mk);
  eng_tensor_release(hq); eng_tensor_release(hk); eng_tensor_release(hv);
  eng_tensor_release(U); eng_tensor_release(Pd);
  Q = K = V = Mk = hq = hk = hv = U = Pd = NULL;
  if (rdt != cdt) {
    eng_tensor* r = eng_as_contig(out, rdt);
    eng_tensor_release(out);
    if (!(out = r)) goto fail;
  }
  eng_tensor* in[4] = {q, k, v, mask && mask->dtype != ENG_BOOL ? mask : NULL};
  if (eng_any_requires_grad(4, in)) {
    eng_node* nd = eng_record("ScaledDotProductAttentionBackward", sdpa_bw, 4, in, out);
    if (!nd || eng_node_save(nd, q) || eng_node_save(nd, k) || eng_node_save(nd, v) || eng_node_save(nd, P))
      goto fail;
    nd->scalars[0] = scale; nd->scalars[1] = dropout_p;
    nd->ints[0] = (int64_t)seed; nd->ints[1] = (int64_t)offset; nd->ints[2] = is_causal ? 1 : 0;
    if (box && dropout_p > 0.0) {
      at_box* b = malloc(sizeof *b);
      if (!b) { eng_err("%s: out of memory", op); goto fail; }
      *b = *box;
      nd->ctx = b;
      nd->free_ctx = box_free;
    }
  }
  eng_tensor_release(P);
  return out;
fail:
  free(c.q.off); free(c.kt.off); free(c.v.off); free(c.out.off); free(moff);
  eng_tensor_release(Q); eng_tensor_release(K); eng_tensor_release(V); eng_tensor_release(Mk);
  eng_tensor_release(hq); eng_tensor_release(hk); eng_tensor_release(hv);
  eng_tensor_release(P); eng_tensor_release(U); eng_tensor_release(Pd); eng_tensor_release(out);
  return NULL;
}

eng_tensor* eng_scaled_dot_product_attention(eng_tensor* q, eng_tensor* k, eng_tensor* v, eng_tensor* mask,
                                             double dropout_p, int is_causal, double scale) {
  return sdpa_op(q, k, v, mask, dropout_p, is_causal, scale, NULL);
}

/* Attention on local shards (sharding/attention.c, local mode): the dropout
 * mask is the slice pstart + (local weights' shape) of the mask of the global
 * weights pshape ([batch..., L, S]) and the generator advances by the global
 * count, so every layout draws what one process draws. */
eng_tensor* eng_sdpa_shard(eng_tensor* q, eng_tensor* k, eng_tensor* v, eng_tensor* mask, double dropout_p,
                           int is_causal, double scale, const int64_t* pshape, const int64_t* pstart) {
  at_box b;
  int nd = q->ndim;
  if (k->ndim > nd) nd = k->ndim;
  if (v->ndim > nd) nd = v->ndim;
  b.nd = nd;
  for (int d = 0; d < nd; d++) { b.gshape[d] = pshape[d]; b.start[d] = pstart[d]; }
  return sdpa_op(q, k, v, mask, dropout_p, is_causal, scale, &b);
}

/* ---------------------------------------------------------------- decoding over a 16-bit KV cache */
typedef struct {
  int64_t R, S, E, Ev, H;
  float scale;
  const float* q;
  const uint16_t *k, *v;
  int64_t kb, kh, ks, vb, vh, vs; /* element strides of k and v: batch, head, position */
  float* out;
  float* p;                        /* each row's probabilities, [rows, S] */
} dec_ctx;

static void dec_range(void* vc, int64_t lo, int64_t hi) {
  const dec_ctx* c = vc;
  for (int64_t row = lo; row < hi; row++) {
    int64_t bh = row / c->R, b = bh / c->H, h = bh % c->H;
    kc_attn_decode_bf16kv(c->S, c->E, c->Ev, c->scale, c->q + row * c->E, c->k + b * c->kb + h * c->kh, c->ks,
                          c->v + b * c->vb + h * c->vh, c->vs, c->p + row * c->S, c->out + row * c->Ev);
  }
}

eng_tensor* eng_decode_attention(eng_tensor* q, eng_tensor* k, eng_tensor* v, double scale) {
  const char* op = "decode_attention";
  if (!q || !k || !v) return eng_errp("%s: NULL tensor", op);
  if (q->dist || k->dist || v->dist) return eng_errp("%s: takes local tensors, got %s, %s, %s", op, eng_desc(q),
                                                      eng_desc(k), eng_desc(v));
  if (q->device != ENG_CPU || k->device != ENG_CPU || v->device != ENG_CPU)
    return eng_errp("%s: CPU tensors only, got q %s, k %s, v %s", op, eng_desc(q), eng_desc(k), eng_desc(v));
  if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4 || q->dtype != ENG_F32 || k->dtype != ENG_BF16 ||
      v->dtype != ENG_BF16)
    return eng_errp("%s: expected f32 q [B, H, R, E] and bf16 k [B, H, S, E], v [B, H, S, Ev], got q %s, k %s, v %s",
                    op, eng_desc(q), eng_desc(k), eng_desc(v));
  int64_t B = q->shape[0], H = q->shape[1], R = q->shape[2], E = q->shape[3], S = k->shape[2], Ev = v->shape[3];
  if (k->shape[0] != B || v->shape[0] != B || k->shape[1] != H || v->shape[1] != H || v->shape[2] != S ||
      k->shape[3] != E)
    return eng_errp("%s: shapes do not match: q %s, k %s, v %s (batch and heads equal, k's head dim q's, v's "
                    "positions k's)", op, eng_desc(q), eng_desc(k), eng_desc(v));
  if (k->stride[3] != 1 || v->stride[3] != 1)
    return eng_errp("%s: k and v need contiguous rows (the cache's [B, H, max_len, head_dim] narrowed), got k %s, v %s",
                    op, eng_desc(k), eng_desc(v));
  if (eng_grad_enabled() && q->requires_grad)
    return eng_errp("%s: has no gradient (generation runs without autograd), got q %s requiring grad", op,
                    eng_desc(q));
  eng_tensor* Q = eng_as_contig(q, ENG_F32);
  if (!Q) return NULL;
  int64_t oshape[4] = {B, H, R, Ev};
  eng_tensor* out = eng_new(4, oshape, ENG_F32, ENG_CPU);
  float* pb = malloc((size_t)(B * H * R * S > 0 ? B * H * R * S : 1) * sizeof *pb);
  if (!out || !pb) {
    free(pb); eng_tensor_release(Q); eng_tensor_release(out);
    return out ? eng_errp("%s: out of memory", op) : NULL;
  }
  dec_ctx c = {R, S, E, Ev, H, (float)(scale > 0 ? scale : 1.0 / sqrt((double)E)), (const float*)eng_ptr(Q),
               (const uint16_t*)eng_ptr(k), (const uint16_t*)eng_ptr(v), k->stride[0], k->stride[1], k->stride[2],
               v->stride[0], v->stride[1], v->stride[2], (float*)eng_ptr(out), pb};
  kc_parallel_for(B * H * R, 1, dec_range, &c);
  free(pb);
  eng_tensor_release(Q);
  return out;
}
