/* kcpu.h: CPU compute kernels on raw pointers (no engine types).
 * dtype codes match eng_dtype: 0 f32, 1 f64, 2 bf16, 3 f16, 4 i32, 5 i64,
 * 6 u8, 7 bool.  Strides are in elements. */
#ifndef KCPU_H
#define KCPU_H
#include <stdint.h>
#include "half.h"

enum { KC_F32 = 0, KC_F64, KC_BF16, KC_F16, KC_I32, KC_I64, KC_U8, KC_BOOL };

static inline double kc_load(const void* p, int dt) {
  switch (dt) {
    case KC_F32: return *(const float*)p;
    case KC_F64: return *(const double*)p;
    case KC_BF16: return kc_bf16_to_f32(*(const uint16_t*)p);
    case KC_F16: return kc_f16_to_f32(*(const uint16_t*)p);
    case KC_I32: return *(const int32_t*)p;
    case KC_I64: return (double)*(const int64_t*)p;
    case KC_U8: return *(const uint8_t*)p;
    default: return *(const uint8_t*)p ? 1.0 : 0.0;
  }
}
static inline void kc_store(void* p, int dt, double v) {
  switch (dt) {
    case KC_F32: *(float*)p = (float)v; break;
    case KC_F64: *(double*)p = v; break;
    case KC_BF16: *(uint16_t*)p = kc_f32_to_bf16((float)v); break;
    case KC_F16: *(uint16_t*)p = kc_f32_to_f16((float)v); break;
    case KC_I32: *(int32_t*)p = (int32_t)v; break;
    case KC_I64: *(int64_t*)p = (int64_t)v; break;
    case KC_U8: *(uint8_t*)p = (uint8_t)(int64_t)v; break;
    default: *(uint8_t*)p = v != 0.0; break;
  }
}

/* Strided N-d copy with conversion: dst[idx] = (dst_dt) src[idx]. */
void kc_copy(int ndim, const int64_t* shape, void* dst, int ddt, const int64_t* dstride,
             const void* src, int sdt, const int64_t* sstride);
/* Contiguous conversions. */
void kc_convert(int64_t n, void* dst, int ddt, const void* src, int sdt);
/* n bytes from src to dst (not overlapping) with streaming (non-temporal) stores where the CPU has them: the
 * destination bypasses the cache.  For staging copies that are read back much later (an async checkpoint's
 * buffers): no read-for-ownership of the destination and no eviction of the caller's working set.  Small
 * copies (< 256 KiB) are a memcpy. */
void kc_copy_stream(void* dst, const void* src, size_t n);
void kc_fill(int64_t n, void* dst, int dt, double v);

/* Iterate an N-d index space over k operands; calls fn once per innermost
 * row with the row's base pointers and inner strides (bytes).  Dims are
 * coalesced where all operands allow.  esz: element size of each operand. */
typedef void (*kc_row_fn)(int64_t n, char** ptrs, const int64_t* inner_strides, void* ctx);
void kc_foreach(int ndim, const int64_t* shape, int k, char** base, const int64_t* const* strides,
                const int* esz, kc_row_fn fn, void* ctx);
/* kc_foreach with the rows (or a single long row's elements) split over the
 * worker pool (parallel.c) when the space is big: for row functions that
 * only write their own rows' elements and keep no state across calls. */
void kc_foreach_par(int ndim, const int64_t* shape, int k, char** base, const int64_t* const* strides,
                    const int* esz, kc_row_fn fn, void* ctx);


/* binary.c */
enum { KB_ADD = 0, KB_SUB, KB_MUL, KB_DIV, KB_POW, KB_MAX, KB_MIN };
/* o[i] = a[i] op b[i] over a row of n elements; strides in BYTES. */
void kc_binary_row(int op, int dt, int64_t n, char* o, int64_t so, const char* a, int64_t sa,
                   const char* b, int64_t sb);

/* shape.c */
/* For each of outer rows: the blk[i] bytes of row o of each srcs[i], in order. */
void kc_cat_blocks(int n, int64_t outer, char* dst, char* const* srcs, const int64_t* blk);
/* dst[o, j, :] = src[o, idx[j], :] over rows of row_bytes bytes (contiguous). */
void kc_index_select(int64_t outer, int64_t src_n, int64_t n_idx, int64_t row_bytes, char* dst,
                     const char* src, const int64_t* idx);
/* dst[o, idx[j], :] += src[o, j, :] (dst_n rows per o, inner elements per row). */
void kc_index_add(int dt, int64_t outer, int64_t dst_n, int64_t n_idx, int64_t inner, char* dst,
                  const char* src, const int64_t* idx);


/* unary.c: elementwise unary functions (f32, f64; neg/abs/relu/clamp also
 * i32, i64, u8).  Strides in BYTES.  p0/p1: clamp bounds (NaN = none);
 * leaky_relu p0 = negative_slope; elu p0 = alpha; hardtanh p0/p1 =
 * min_val/max_val; softplus p0 = beta, p1 = threshold. */
enum { KU_NEG = 0, KU_EXP, KU_LOG, KU_SQRT, KU_RSQRT, KU_ABS, KU_TANH, KU_SIGMOID, KU_RELU,
       KU_GELU, KU_GELU_TANH, KU_SILU, KU_CLAMP, KU_LEAKY_RELU, KU_ELU, KU_HARDTANH, KU_SOFTPLUS,
       KU_COUNT };
void kc_unary_row(int op, int dt, int64_t n, char* o, int64_t so, const char* a, int64_t sa,
                  double p0, double p1);
/* gi = g * f'(x) where y = f(x) (f32, f64).  x or y may be unused by op
 * (pass any valid pointer). */
void kc_unary_grad_row(int op, int dt, int64_t n, char* gi, int64_t sgi, const char* g, int64_t sg,
                       const char* x, int64_t sx, const char* y, int64_t sy, double p0, double p1);

/* compare.c: comparisons, select and masked fill over strided rows (bytes). */
enum { KCMP_EQ = 0, KCMP_NE, KCMP_LT, KCMP_LE, KCMP_GT, KCMP_GE };
/* o (bool bytes) = a cmp b; dt in f32, f64, i32, i64, u8. */
void kc_compare_row(int op, int dt, int64_t n, char* o, int64_t so, const char* a, int64_t sa,
                    const char* b, int64_t sb);
/* o = c ? a : b, elements of esz bytes (1, 2, 4, 8); c is bool/u8 bytes. */
void kc_where_row(int esz, int64_t n, char* o, int64_t so, const char* c, int64_t sc, const char* a,
                  int64_t sa, const char* b, int64_t sb);
/* o = m ? *val : x, elements of esz bytes. */
void kc_masked_fill_row(int esz, int64_t n, char* o, int64_t so, const char* x, int64_t sx,
                        const char* m, int64_t sm, const void* val);

/* inplace.c: fused in-place updates (strides in bytes); dt f32 or f64 for
 * a, b, c alike (the engine converts other operands). */
enum { KI_ADDCMUL = 0, KI_ADDCDIV, KI_LERP };
void kc_inplace3_row(int op, int dt, int64_t n, char* a, int64_t sa, const char* b, int64_t sb,
                     const char* c, int64_t sc, double v);

/* reduce.c: sums and arg-extremes over strided rows (bytes). */
/* acc += x over a row: acc is double for floating dt, int64 otherwise.
 * sacc == 0 reduces the whole row into *acc (pairwise for floats). */
void kc_sum_row(int dt, int64_t n, char* acc, int64_t sacc, const char* x, int64_t sx);
/* Index of the first maximum (is_max) or minimum of a row; a NaN wins (the
 * first one).  Any dtype. */
int64_t kc_argext_row(int dt, int is_max, int64_t n, const char* x, int64_t sx);
/* Column-wise: first extreme of each column of a contiguous [len, inner]
 * block into vals (dt, [inner]) and idx ([inner]). */
void kc_argext_cols(int dt, int is_max, int64_t len, int64_t inner, const char* x, char* vals, int64_t* idx);

/* random.c: counter-based random runs (addressing in philox.h); strides in
 * bytes.  Element k of a run is element j0 + k of the stream of seed. */
enum { KC_RNG_UNIFORM = 0, KC_RNG_NORMAL = 1, KC_RNG_BERNOULLI = 2 };
/* uniform: U[a, b); normal: a + b * N(0, 1); bernoulli: 1 with probability a. */
void kc_random_run(int kind, uint64_t seed, uint64_t j0, int64_t n, char* dst, int64_t stride, int dt,
                   double a, double b);
/* y = x * (u < keep ? scale : 0), u the uniform of the stream (any float dt). */
void kc_dropout_run(uint64_t seed, uint64_t j0, int64_t n, double keep, double scale, const char* x,
                    int64_t sx, char* y, int64_t sy, int dt);

/* norm.c: fused layer_norm (rms = 0) and rms_norm (rms = 1) over m rows of
 * n contiguous elements; dt f32 or f64 for x, w, b, y; w, b may be NULL;
 * the per-row mean (unused, may be NULL, for rms) and rstd are double. */
void kc_norm_fwd(int dt, int rms, int64_t m, int64_t n, const void* x, const void* w, const void* b,
                 double eps, void* y, double* mean, double* rstd);
/* dx (may be NULL) and the column sums dw += go * xhat, db += go (double[n]
 * accumulators, each may be NULL). */
void kc_norm_bwd(int dt, int rms, int64_t m, int64_t n, const void* go, const void* x, const void* w,
                 const double* mean, const double* rstd, void* dx, double* dw, double* db);
/* kc_norm_fwd of h = x + r (written to h, row by row just before its norm). */
void kc_add_norm_fwd(int dt, int rms, int64_t m, int64_t n, const void* x, const void* r, void* h, const void* w,
                     const void* b, double eps, void* y, double* mean, double* rstd);
/* kc_norm_bwd with gres (may be NULL; needs dx) added to dx after it is computed. */
void kc_norm_bwd_res(int dt, int rms, int64_t m, int64_t n, const void* go, const void* x, const void* w,
                     const double* mean, const double* rstd, const void* gres, void* dx, double* dw, double* db);

/* embedding.c: row gather / scatter-add; idx is i32 (idt 4) or i64 (5). */
void kc_embedding_gather(int64_t n_idx, const void* idx, int idt, const char* w, int64_t row_bytes,
                         char* out);
/* gw[idx[i], :] += go[i, :] (dim elements, dt f32 or f64), skipping pad. */
void kc_embedding_scatter_add(int dt, int64_t n_idx, const void* idx, int idt, const char* go,
                              int64_t dim, int64_t pad, char* gw);

/* optim.c: fused optimizer updates and norm accumulation over strided rows
 * (strides in bytes).  Params f32/f64/bf16/f16; math in f32 for f32/bf16/f16
 * params and in f64 for f64 params, in PyTorch's operation order. */
typedef struct {
  double lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt;
  int pdt, gdt, sdt;
} kc_adamw_args;
void kc_adamw_row(const kc_adamw_args* a, int64_t n, char* p, int64_t sp, const char* g, int64_t sg,
                  char* m, int64_t sm, char* v, int64_t sv);
/* AdamW with f32 master weights: the update runs on master (f32; a->sdt must
 * be f32) and p (a->pdt bf16/f16) gets the result rounded to nearest even. */
void kc_adamw_master_row(const kc_adamw_args* a, int64_t n, char* master, int64_t sw, const char* g, int64_t sg,
                         char* m, int64_t sm, char* v, int64_t sv, char* p, int64_t sp);
typedef struct {
  double lr, momentum, dampening, weight_decay;
  int nesterov, first, pdt, gdt, bdt;
} kc_sgd_args;
/* buf may be NULL when momentum == 0. */
void kc_sgd_row(const kc_sgd_args* a, int64_t n, char* p, int64_t sp, const char* g, int64_t sg,
                char* buf, int64_t sb);
enum { KN_POW = 0, KN_L2, KN_L1, KN_MAX, KN_MIN, KN_COUNT };
/* acc <- combine(acc, row): KN_POW sum |x|^p, KN_L2 sum x^2, KN_L1 sum |x|,
 * KN_MAX max |x|, KN_MIN min |x| (NaN propagates), KN_COUNT nonzeros. */
void kc_pnorm_row(int kind, double p, int dt, int64_t n, const char* x, int64_t sx, double* acc);
/* x *= s in x's dtype (f32 math for f32/bf16/f16). */
void kc_scale_row(int dt, int64_t n, char* x, int64_t sx, double s);

/* unary.c: silu(a) * b over n contiguous elements of f32 or f64 (SwiGLU's product; split over the pool), and its
 * gradients ga = g * b * silu'(a), gb = g * silu(a) (either may be NULL), the composition's values bit for bit.
 * 0, or -1 for another dtype. */
int kc_silu_mul(int dt, int64_t n, const void* a, const void* b, void* out);
int kc_silu_mul_grad(int dt, int64_t n, const void* g, const void* a, const void* b, void* ga, void* gb);

/* parallel.c: the worker pool behind the kernels' parallel loops.
 * kc_parallel_for runs fn(ctx, lo, hi) over [0, n) in contiguous chunks of
 * at least `grain` items (boundaries fixed by n, grain and the thread count)
 * on the calling thread and the pool's workers; inline when the pool has one
 * thread, n < 2 grain, or when called from inside a chunk or while another
 * thread uses the pool.  fn must not fail and must be safe to run on
 * disjoint ranges at once.  kc_set_threads: pool size including the caller. */
typedef void (*kc_range_fn)(void* ctx, int64_t lo, int64_t hi);
void kc_parallel_for(int64_t n, int64_t grain, kc_range_fn fn, void* ctx);

/* rope.c: rotary embedding on interleaved pairs of x [B, T, H, D] (xs: the element strides of b, t, h; the last
 * dim contiguous) with tables cos, sin contiguous [T, D / 2] (dtype cdt); inverse = 1 rotates by -angle.  out
 * contiguous [B, T, H, D] in x's dtype.  0, or -1 on bad arguments. */
int kc_rope(int dt, int cdt, int64_t B, int64_t T, int64_t H, int64_t D, const void* x, const int64_t* xs,
            const void* cos, const void* sin, int inverse, void* out);
void kc_set_threads(int n);
int kc_get_threads(void);
/* 1 while running a chunk on any thread (nested work then runs serially). */
int kc_in_parallel(void);

/* gemm.c (row-major; dt KC_F32 or KC_F64; ta/tb: 1 = use the transpose).
 * Products of 2^21 multiply-adds or more are split over the worker pool by
 * blocks of rows (or columns) of C, unless called from inside a pool job. */
void kc_gemm(int dt, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha,
             const void* A, int64_t lda, const void* B, int64_t ldb, double beta, void* C,
             int64_t ldc);
/* The library f32 products run on, and why (oneDNN when libdnnl.so.2 loads, unless ENGINE_GEMM=openblas). */
const char* kc_gemm_library(void);
/* out[i, :] = bias (rows of n elements, row stride ld). */
void kc_fill_rows(int dt, int64_t rows, int64_t n, const void* bias, void* out, int64_t ld);
/* out[j] = sum_i g[i, j] (row stride ld). */
void kc_sum_rows(int dt, int64_t rows, int64_t n, const void* g, int64_t ld, void* out);
/* C [M, N] (row-major, ldc = N) = bias rows (bias NULL: 0) + op(A) @ op(B), then
 * epi(ctx, r0, r1) over every row of C in blocks, each run where its rows were
 * computed (an epilogue while they are in cache).  C equals kc_fill_rows +
 * kc_gemm(alpha 1, beta 1) (no bias: kc_gemm with beta 0) bit for bit. */
void kc_gemm_epi(int dt, int ta, int tb, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda,
                 const void* B, int64_t ldb, const void* bias, void* C, kc_range_fn epi, void* ectx);
/* gh = gy * gelu'(h) (op KU_GELU or KU_GELU_TANH; rows x n, contiguous) and,
 * unless gb is NULL, gb = kc_sum_rows(gh), in one pass over the rows; both
 * equal kc_unary_grad_row + kc_sum_rows bit for bit. */
void kc_gelu_bias_grad(int dt, int op, int64_t rows, int64_t n, const void* gy, const void* h, void* gh, void* gb);
/* Runs fn(ctx, lo, hi) over [0, n) in contiguous parts on the worker pool
 * (parallel.c) when threads > 1, each part's kc_gemm calls single-threaded:
 * for batches of small products, where splitting each product does not pay.
 * threads <= 1 or n < 2: one call on the calling thread.  fn must not fail. */
void kc_parallel_blas(int threads, int64_t n, kc_range_fn fn, void* ctx);

/* softmax.c: exp for f32 rows: vectorizable (~1 ulp); exp(x) = 0 for
 * x < -87, saturates at exp(88) above 88 (callers pass x - max <= 0), NaN
 * propagates. */
static inline float kc_expf(float x) {
  float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  float t = xc * 1.44269504088896341f + 12582912.0f;  /* round(x / ln 2) + 1.5 * 2^23 */
  float n = t - 12582912.0f;
  uint32_t ti; memcpy(&ti, &t, 4);
  uint32_t eb = (ti - 0x4B400000u + 127u) << 23;
  float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.0f;
  float sc; memcpy(&sc, &eb, 4);
  float res = x < -87.0f ? 0.0f : p * sc;
  return x != x ? x : res;
}
/* Row primitives: max (NaN ignored), sum of exp(x - m) (stores the exps in y
 * if y != NULL; y may alias x), dot, sum. */
float kc_row_max_f32(int64_t n, const float* x);
double kc_row_max_f64(int64_t n, const double* x);
float kc_row_expsum_f32(int64_t n, const float* x, float m, float* y);
double kc_row_expsum_f64(int64_t n, const double* x, double m, double* y);
float kc_row_dot_f32(int64_t n, const float* a, const float* b);
double kc_row_dot_f64(int64_t n, const double* a, const double* b);
float kc_row_sum_f32(int64_t n, const float* a);
double kc_row_sum_f64(int64_t n, const double* a);
/* (log_)softmax over D of contiguous [outer, D, inner]; -1 if out of memory. */
int kc_softmax_f32(int64_t outer, int64_t D, int64_t inner, const float* x, float* y, int log_);
int kc_softmax_f64(int64_t outer, int64_t D, int64_t inner, const double* x, double* y, int log_);
/* Backward from the saved output y and the output gradient g (gx may alias g). */
int kc_softmax_bw_f32(int64_t outer, int64_t D, int64_t inner, const float* y, const float* g,
                      float* gx, int log_);
int kc_softmax_bw_f64(int64_t outer, int64_t D, int64_t inner, const double* y, const double* g,
                      double* gx, int log_);

/* loss.c: fused log-softmax + NLL over the class dim of contiguous
 * [N, C, inner] logits; tgt: N*inner class ids (i64).  Per position i:
 * loss[i] = lse_i - (1 - eps) x[t_i] - eps/C sum_c x_c, lse[i] = logsumexp;
 * both 0 where tgt == ignore.  Targets must be validated by the caller. */
int kc_cross_entropy_f32(int64_t N, int64_t C, int64_t inner, const float* x, const int64_t* tgt,
                         int64_t ignore, double eps, float* loss, float* lse);
int kc_cross_entropy_f64(int64_t N, int64_t C, int64_t inner, const double* x, const int64_t* tgt,
                         int64_t ignore, double eps, double* loss, double* lse);
/* gx = s_i * (softmax(x) - (1 - eps) onehot(t_i) - eps/C), s_i = gs[i] (or
 * gconst when gs is NULL), 0 where tgt == ignore. */
int kc_cross_entropy_bw_f32(int64_t N, int64_t C, int64_t inner, const float* x, const int64_t* tgt,
                            int64_t ignore, double eps, const float* lse, const float* gs,
                            double gconst, float* gx);
int kc_cross_entropy_bw_f64(int64_t N, int64_t C, int64_t inner, const double* x, const int64_t* tgt,
                            int64_t ignore, double eps, const double* lse, const double* gs,
                            double gconst, double* gx);

/* loss.c: the fused classifier: cross entropy over contiguous [N, C] bf16
 * (dt KC_BF16) or f16 (KC_F16) logits with f32 accumulation; loss and lse f32
 * as kc_cross_entropy_f32 of the converted logits, the gradient gx in the
 * logits' dtype (kc_cross_entropy_bw_f32's, rounded).  -1 if out of memory. */
int kc_cross_entropy_half(int dt, int64_t N, int64_t C, const uint16_t* x, const int64_t* tgt, int64_t ignore,
                          double eps, float* loss, float* lse);
int kc_cross_entropy_half_bw(int dt, int64_t N, int64_t C, const uint16_t* x, const int64_t* tgt, int64_t ignore,
                             double eps, const float* lse, const float* gs, double gconst, uint16_t* gx);

/* loss.c: nll_loss over contiguous [N, C, inner] log-probabilities (tgt
 * validated by the caller): loss[i] = -w[t_i] x[n, t_i, j] (w NULL: 1), 0 where
 * t_i == ignore, into out (per position) or summed into *sum; *wsum = the sum
 * of w[t_i] over the non-ignored positions.  Backward writes all of gx. */
void kc_nll_f32(int64_t N, int64_t C, int64_t inner, const float* x, const int64_t* tgt, int64_t ignore,
                const float* w, float* out, double* sum, double* wsum);
void kc_nll_f64(int64_t N, int64_t C, int64_t inner, const double* x, const int64_t* tgt, int64_t ignore,
                const double* w, double* out, double* sum, double* wsum);
void kc_nll_bw_f32(int64_t N, int64_t C, int64_t inner, const int64_t* tgt, int64_t ignore, const float* w,
                   const float* gs, double gconst, float* gx);
void kc_nll_bw_f64(int64_t N, int64_t C, int64_t inner, const int64_t* tgt, int64_t ignore, const double* w,
                   const double* gs, double gconst, double* gx);
/* loss.c: elementwise losses of n contiguous x, y (w, pw: NULL or n entries;
 * pw for KC_PL_BCE_LOGITS only; param: beta / delta).  Per-element losses into
 * out, or (out NULL) their sum into *sum.  Returns 1 when KC_PL_BCE met an x
 * outside [0, 1].  Backward: gx / gy (either NULL) for upstream gs[i] or gconst. */
enum { KC_PL_BCE = 0, KC_PL_BCE_LOGITS = 1, KC_PL_KL_DIV = 2, KC_PL_KL_DIV_LOG = 3, KC_PL_SMOOTH_L1 = 4,
       KC_PL_HUBER = 5 };
int kc_ploss_f32(int kind, int64_t n, const float* x, const float* y, const float* w, const float* pw,
                 double param, float* out, double* sum);
int kc_ploss_f64(int kind, int64_t n, const double* x, const double* y, const double* w, const double* pw,
                 double param, double* out, double* sum);
void kc_ploss_bw_f32(int kind, int64_t n, const float* x, const float* y, const float* w, const float* pw,
                     double param, const float* gs, double gconst, float* gx, float* gy);
void kc_ploss_bw_f64(int kind, int64_t n, const double* x, const double* y, const double* w, const double* pw,
                     double param, const double* gs, double gconst, double* gx, double* gy);

/* loss.c: cross entropy with class weights w [C] (PyTorch's formula with label
 * smoothing eps; see loss.c); lse per position; out / *sum / *wsum as kc_nll_*. */
void kc_cross_entropy_w_f32(int64_t N, int64_t C, int64_t inner, const float* x, const int64_t* tgt, int64_t ignore,
                            double eps, const float* w, float* out, float* lse, double* sum, double* wsum);
void kc_cross_entropy_w_f64(int64_t N, int64_t C, int64_t inner, const double* x, const int64_t* tgt, int64_t ignore,
                            double eps, const double* w, double* out, double* lse, double* sum, double* wsum);
void kc_cross_entropy_w_bw_f32(int64_t N, int64_t C, int64_t inner, const float* x, const int64_t* tgt,
                               int64_t ignore, double eps, const float* w, const float* lse, const float* gs,
                               double gconst, float* gx);
void kc_cross_entropy_w_bw_f64(int64_t N, int64_t C, int64_t inner, const double* x, const int64_t* tgt,
                               int64_t ignore, double eps, const double* w, const double* lse, const double* gs,
                               double gconst, double* gx);

/* attention.c: in-place masked softmax of an L x S score block (row stride
 * lds).  mkind 0: no mask; 1: bool/u8 mask (nonzero = attend); 2: additive
 * mask of the block's dtype.  Mask element (i, j) at mask + i*mrs + j*mcs
 * (elements).  causal: j > i is masked (top-left aligned).  Rows with
 * nothing to attend become 0. */
void kc_attn_softmax_f32(int64_t L, int64_t S, float* s, int64_t lds, const void* mask, int mkind,
                         int64_t mrs, int64_t mcs, int causal);
void kc_attn_softmax_f64(int64_t L, int64_t S, double* s, int64_t lds, const void* mask, int mkind,
                         int64_t mrs, int64_t mcs, int causal);
/* One query row against S keys (decoding with a KV cache): p[S] = softmax(scale * K q), out[Ev] = p @ V; key row j
 * at k + j*ldk (E values), value row j at v + j*ldv (Ev values). */
void kc_attn_decode_f32(int64_t S, int64_t E, int64_t Ev, float scale, const float* q, const float* k, int64_t ldk,
                        const float* v, int64_t ldv, float* p, float* out);
/* kc_attn_decode_f32 over bf16 keys and values (a 16-bit KV cache), widened as they are read. */
void kc_attn_decode_bf16kv(int64_t S, int64_t E, int64_t Ev, float scale, const float* q, const uint16_t* k,
                           int64_t ldk, const uint16_t* v, int64_t ldv, float* p, float* out);
/* out[i] = keep[i] ? x[i] * scale : 0 (out may alias x). */
void kc_dropout_apply_f32(int64_t n, const float* x, const uint8_t* keep, float scale, float* out);
void kc_dropout_apply_f64(int64_t n, const double* x, const uint8_t* keep, double scale, double* out);
#endif
