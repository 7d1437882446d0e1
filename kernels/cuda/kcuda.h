/* kcuda.h: the CUDA kernels (the .cu files of kernels/cuda), C-callable.
 *
 * Pure compute on raw device pointers, sizes and a cudaStream_t: no engine
 * types, no allocation policy (callers pass workspaces, sized by the
 * *_workspace functions), no autograd.  Every launch is asynchronous on the
 * given stream.
 *
 * dtype codes match eng_dtype: 0 f32, 1 f64, 2 bf16, 3 f16, 4 i32, 5 i64,
 * 6 u8, 7 bool.  bf16/f16 data is computed in f32 (converted in, converted
 * out; bit-identical conversions to kernels/cpu/half.h), f64 in f64.
 * Strides are in ELEMENTS.  Shapes have at most KCU_MAX_DIMS dims.
 *
 * Status: every function returns 0 on success, a cudaError_t (> 0) when the
 * launch failed, or one of the negative KCU_E* codes; kcu_status_string()
 * names any of them.  Invalid arguments (unsupported dtype, head dim, ...)
 * return KCU_EARG before anything is launched.
 *
 * Per-element formulas shared with the CPU live in kcuda_math.cuh. */
#ifndef KCUDA_H
#define KCUDA_H
#include <stdint.h>
#include <stddef.h>
#include <cuda_runtime_api.h>
#ifdef __cplusplus
extern "C" {
#endif

#define KCU_MAX_DIMS 8
enum { KCU_F32 = 0, KCU_F64, KCU_BF16, KCU_F16, KCU_I32, KCU_I64, KCU_U8, KCU_BOOL };
enum {
  KCU_OK = 0,
  KCU_EARG = -1,       /* invalid argument (dtype, size, unsupported configuration) */
  KCU_ENOALGO = -2,    /* cuBLASLt found no algorithm for this GEMM */
  KCU_ECUBLAS = -1000  /* -1000 - cublasStatus_t: a cuBLASLt call failed */
};
/* Message for a status code (static string). */
const char* kcu_status_string(int status);
/* Element size of a dtype code (0 for an invalid one). */
int kcu_dtype_size(int dt);

/* ================================================================ elementwise.cu
 * N-d strided elementwise ops with broadcasting through 0 strides.  `out`
 * strides may be NULL (contiguous); input strides NULL = contiguous too.
 * Dims are coalesced on the host and contiguous operands take 16-byte
 * vector loads/stores.  out may alias an input with the same strides. */

/* out = f(x), op = kcpu.h's KU_* (neg exp log sqrt rsqrt abs tanh sigmoid
 * relu gelu gelu_tanh silu clamp); p0/p1: clamp bounds (NaN = none).
 * dt: f32 f64 bf16 f16 (all ops); i32 i64 u8 (neg abs relu clamp). */
int kcu_unary(int op, int dt, int ndim, const int64_t* shape, void* out, const int64_t* so,
              const void* x, const int64_t* sx, double p0, double p1, cudaStream_t stream);
/* gi = g * f'(x) (y = f(x) saved output; x or y may be NULL when op does not
 * read it).  dt: f32 f64 bf16 f16. */
int kcu_unary_grad(int op, int dt, int ndim, const int64_t* shape, void* gi, const int64_t* sgi,
                   const void* g, const int64_t* sg, const void* x, const int64_t* sx, const void* y,
                   const int64_t* sy, double p0, double p1, cudaStream_t stream);
/* out = a op b, op = kcpu.h's KB_* (add sub mul div pow max min); all
 * operands of dtype dt (any dtype; bool/u8 computed as u8). */
int kcu_binary(int op, int dt, int ndim, const int64_t* shape, void* out, const int64_t* so,
               const void* a, const int64_t* sa, const void* b, const int64_t* sb, cudaStream_t stream);
/* dst = (ddt) src: strided copy with conversion between any two dtypes
 * (floats go through f32, or f64 when either side is f64 or i64). */
int kcu_copy(int ndim, const int64_t* shape, void* dst, int ddt, const int64_t* sd, const void* src, int sdt,
             const int64_t* ss, cudaStream_t stream);
/* Contiguous conversion of n elements (any pair of dtypes). */
int kcu_cast(int64_t n, void* dst, int ddt, const void* src, int sdt, cudaStream_t stream);
/* dst[0..n) = value (converted to dt). */
int kcu_fill(int dt, int64_t n, void* dst, double value, cudaStream_t stream);

/* ================================================================ select.cu
 * Strided N-d selection ops with broadcasting (0 strides; NULL strides =
 * contiguous).  compare: out (bool, 1 byte) = a op b, op 0..5 = eq ne lt le
 * gt ge (eng_cmp_op), both operands of dtype dt (i64 compared exactly, the
 * others through f64).  where: out = cond ? a : b on elements of es bytes
 * (cond bool).  masked_fill: out = mask ? *value : x (value: es bytes). */
int kcu_compare(int op, int dt, int ndim, const int64_t* shape, void* out, const int64_t* so, const void* a,
                const int64_t* sa, const void* b, const int64_t* sb, cudaStream_t stream);
int kcu_where(int es, int ndim, const int64_t* shape, void* out, const int64_t* so, const void* cond,
              const int64_t* sc, const void* a, const int64_t* sa, const void* b, const int64_t* sb,
              cudaStream_t stream);
int kcu_masked_fill(int es, int ndim, const int64_t* shape, void* out, const int64_t* so, const void* x,
                    const int64_t* sx, const void* mask, const int64_t* sm, const void* value, cudaStream_t stream);
/* Over contiguous x [outer, D, inner] (D >= 1): idx[o, i] (i64) = index of
 * the first max (is_max) / min along D, a NaN winning (the first one), as
 * the CPU; vals (may be NULL; x's dtype) gets the value.  Deterministic. */
int kcu_argext_dim(int dt, int is_max, int64_t outer, int64_t D, int64_t inner, const void* x, void* vals,
                   int64_t* idx, cudaStream_t stream);
/* out[o, idx[o, i], i] = g[o, i] for contiguous out [outer, D, inner]
 * (zeroed by the caller) and g, idx [outer, inner]; elements of es bytes. */
int kcu_scatter_dim(int es, int64_t outer, int64_t D, int64_t inner, const int64_t* idx, const void* g, void* out,
                    cudaStream_t stream);

/* ================================================================ reduce.cu
 * Over contiguous x viewed as [outer, D, inner]: out[o, i] = red_d x[o, d, i]
 * times scale (scale applies to SUM only: 1/D gives the mean).  Accumulation
 * in f32 for f32/bf16/f16 data and in f64 for f64 and integer data (exact
 * integer sums below 2^53).  out has any dtype odt (converted like kcu_copy).
 * MAX/MIN propagate NaN.  D == 0: SUM gives 0, MAX/MIN give KCU_EARG. */
enum { KCU_RED_SUM = 0, KCU_RED_MAX = 1, KCU_RED_MIN = 2 };
int kcu_reduce_dim(int kind, int dt, int64_t outer, int64_t D, int64_t inner, const void* x, void* out, int odt,
                   double scale, cudaStream_t stream);
/* out[0] = red over all n elements times scale; deterministic two-pass
 * through ws (kcu_reduce_all_workspace(n) bytes). */
size_t kcu_reduce_all_workspace(int64_t n);
int kcu_reduce_all(int kind, int dt, int64_t n, const void* x, void* out, int odt, double scale, void* ws,
                   cudaStream_t stream);

/* ================================================================ softmax.cu
 * (log_)softmax over D of contiguous [outer, D, inner]; dt f32 f64 bf16 f16. */
int kcu_softmax(int dt, int64_t outer, int64_t D, int64_t inner, const void* x, void* y, int log_,
                cudaStream_t stream);
/* From the saved output y and the output gradient gy (gx may alias gy):
 * softmax: gx = y (gy - sum(gy y));  log_softmax: gx = gy - exp(y) sum(gy). */
int kcu_softmax_bwd(int dt, int64_t outer, int64_t D, int64_t inner, const void* y, const void* gy, void* gx,
                    int log_, cudaStream_t stream);

/* ================================================================ norm.cu
 * layer_norm (rms = 0) / rms_norm (rms = 1) over m rows of n contiguous
 * elements; x, w, b, y (and gy, dx, dw, db) all of dtype dt (f32 f64 bf16
 * f16); w, b may be NULL.  mean (layer only; may be NULL) and rstd are f32
 * (f64 for f64 data) per row, saved for backward. */
int kcu_norm_fwd(int dt, int rms, int64_t m, int64_t n, const void* x, const void* w, const void* b, double eps,
                 void* y, void* mean, void* rstd, cudaStream_t stream);
/* dx (may be NULL); dw = sum_rows gy * xhat, db = sum_rows gy (each may be
 * NULL; OVERWRITTEN, not accumulated), deterministic through ws
 * (kcu_norm_bwd_workspace(m, n, dt) bytes). */
size_t kcu_norm_bwd_workspace(int64_t m, int64_t n, int dt);
int kcu_norm_bwd(int dt, int rms, int64_t m, int64_t n, const void* gy, const void* x, const void* w,
                 const void* mean, const void* rstd, void* dx, void* dw, void* db, void* ws, cudaStream_t stream);
/* The residual add fused in: h = x + r (rounded to dt, written to h) is
 * normalised (r NULL: kcu_norm_fwd).  Backward: gres (NULL or the gradient
 * of h from its other uses; needs dx) is added to dx after dx is rounded to
 * dt, as autograd adds two gradients.  f32/bf16/f16 rows of a multiple of 16
 * bytes (n <= 256 vectors, aligned) take the warp-per-row vector kernels;
 * partition and rounding in kcuda_norm.cuh. */
int kcu_add_norm_fwd(int dt, int rms, int64_t m, int64_t n, const void* x, const void* r, void* h, const void* w,
                     const void* b, double eps, void* y, void* mean, void* rstd, cudaStream_t stream);
int kcu_norm_bwd_res(int dt, int rms, int64_t m, int64_t n, const void* gy, const void* x, const void* w,
                     const void* mean, const void* rstd, const void* gres, void* dx, void* dw, void* db, void* ws,
                     cudaStream_t stream);

/* ================================================================ colsum.cu
 * dst[j] = scale * sum over rows of x[row, j], x a contiguous [rows, n]
 * matrix of dt (f32 bf16 f16), f32 accumulation, dst of odt (f32 f64 bf16
 * f16): a 2-D reduction (row tiles x column tiles, then a pass over the
 * partial rows in ws, kcu_colsum_workspace bytes, may be 0); deterministic.
 * The bias gradient of linear. */
size_t kcu_colsum_workspace(int64_t rows, int64_t n, int dt);
int kcu_colsum(int dt, int64_t rows, int64_t n, const void* x, void* dst, int odt, double scale, void* ws,
               cudaStream_t stream);

/* ================================================================ embedding.cu
 * out[i, :] = w[idx[i], :] (rows of row_bytes bytes, any dtype); idx i32
 * (idt 4) or i64 (5).  An index outside [0, V) writes a zero row and sets
 * *bad = 1 when bad != NULL (the caller checks it when it syncs). */
int kcu_embedding_fwd(int64_t n_idx, const void* idx, int idt, const void* w, int64_t V, int64_t row_bytes,
                      void* out, int* bad, cudaStream_t stream);
/* gw[v, :] = sum of go[i, :] over i with idx[i] == v (v != pad), for all
 * v < V: gw is OVERWRITTEN (rows nobody uses become 0).  go dtype gdt (f32
 * bf16 f16, or f64 with an f64 gw), gw f32 (f64 for f64 go), dim columns.
 * Atomic-free and sort-free: one block per band of vocabulary rows scans the
 * indices in order, so each sum runs in index order (deterministic). */
int kcu_embedding_bwd(int gdt, int64_t n_idx, const void* idx, int idt, const void* go, int64_t dim, int64_t V,
                      int64_t pad, void* gw, cudaStream_t stream);

/* ================================================================ cross_entropy.cu
 * Fused log-softmax + NLL over rows of C logits (x contiguous [N, C], dt f32
 * f64 bf16 f16), targets tgt [N] (i32 or i64), label smoothing eps:
 *   loss[i] = lse_i - (1 - eps) x[i, t_i] - eps/C sum_c x[i, c]
 * loss and lse are f32 (f64 for f64 logits); both 0 where t_i == ignore.  One
 * pass over each row (online logsumexp).  A target outside [0, C) (other
 * than ignore) gives a NaN loss and sets *bad = 1 when bad != NULL. */
int kcu_cross_entropy_fwd(int dt, int64_t N, int64_t C, const void* x, const void* tgt, int tdt, int64_t ignore,
                          double eps, void* loss, void* lse, int* bad, cudaStream_t stream);
/* gx[i, c] = s_i (softmax(x_i)_c - (1 - eps) [c == t_i] - eps/C), 0 on
 * ignored rows; s_i = gconst * (gs ? gs[i] : 1) * (gscale ? *gscale : 1)
 * (gs and gscale are device pointers of loss's dtype: per-row upstream
 * gradient for reduction 'none', a scalar upstream gradient for 'mean'/'sum').
 * gx has x's dtype and may alias x. */
int kcu_cross_entropy_bwd(int dt, int64_t N, int64_t C, const void* x, const void* tgt, int tdt, int64_t ignore,
                          double eps, const void* lse, const void* gs, const void* gscale, double gconst, void* gx,
                          cudaStream_t stream);
/* out[0] = sum of vals[i] over rows with tgt[i] != ignore, divided by their
 * count (mean; NaN when the count is 0, as PyTorch); out[1] = the count.
 * vals/out f32 (f64 when dt is f64).  One block, fixed order: deterministic. */
int kcu_masked_mean(int dt, int64_t N, const void* vals, const void* tgt, int tdt, int64_t ignore, void* out,
                    cudaStream_t stream);

/* ================================================================ attention.cu
 * Scaled dot-product attention, flash style: tiles of K and V in shared
 * memory, online softmax, the row logsumexp saved for backward; no L x L
 * matrix is ever stored.  q [B, H, Lq, D], k/v [B, H, Lk, D], o like q, with
 * any batch/head/row strides (elements) and a contiguous last dim.  dt f32,
 * bf16 or f16; any head dim D <= 128.  causal: key j is masked for query i
 * when j > i (top-left aligned, as the CPU kernels).  Rows with nothing to
 * attend get o = 0 and lse = -inf.
 * Two implementations: bf16/f16 data with D in {32, 64, 128}, strides that
 * are multiples of 8 and 16-byte aligned pointers run on the tensor cores
 * (mma.sync m16n8k16, f32 accumulation; the probabilities P and dS are
 * rounded to the data type before their products, as FlashAttention-2 does;
 * sm_80 or newer); everything else, or force_simt = 1, runs the SIMT
 * kernels (f32 math throughout). */
typedef struct kcu_attn_args {
  int dt, B, H, Lq, Lk, D, causal, force_simt;
  float scale;
  const void *q, *k, *v;
  void* o;
  float* lse;             /* [B, H, Lq] contiguous */
  /* backward only */
  const void* dout;       /* like o */
  void *dq, *dk, *dv;     /* like q, k, v */
  float* delta;           /* workspace [B, H, Lq]: rowsum(dout * o) */
  void* ws;               /* workspace of kcu_attention_bwd_workspace bytes (NULL when that is 0) */
  /* strides (elements) of the batch, head and row dims */
  int64_t sq[3], sk[3], sv[3], so[3], sdo[3], sdq[3], sdk[3], sdv[3];
} kcu_attn_args;
int kcu_attention_fwd(const kcu_attn_args* a, cudaStream_t stream);
/* dq, dk, dv (overwritten) from q, k, v, o, lse, dout.  On the tensor cores
 * with head dims up to 64 (and a->ws given) the one-pass backward runs: one
 * kernel per 64 keys computes S and dP once, accumulates dk/dv and adds its
 * keys' share of dq into ws (f32 [B, H, Lq, D], atomics: dq's rounding then
 * depends on their order), and a small kernel converts ws into dq.  Else,
 * and everywhere with ENGINE_ATTN_BWD=split (read once), atomic-free: one
 * kernel for dk/dv by key tiles, one for dq by query tiles.
 * ENGINE_ATTN_BWD=fused takes the one-pass form at head dim 128 too. */
int kcu_attention_bwd(const kcu_attn_args* a, cudaStream_t stream);
/* Bytes of a->ws that kcu_attention_bwd needs for these args (pointers and
 * strides filled in): 0 unless the fused path will run (then B*H*Lq*D
 * floats; with a->ws NULL the two-kernel path runs instead). */
size_t kcu_attention_bwd_workspace(const kcu_attn_args* a);

/* ================================================================ random.cu
 * The engine's counter-based RNG (kernels/cpu/philox.h): element i of the
 * output uses stream position offset + i of seed, exactly as the CPU
 * (kc_random_run / kc_dropout_run), so the same (seed, offset) gives the same
 * numbers and the same dropout mask on both devices.  Contiguous data. */
enum { KCU_RNG_UNIFORM = 0, KCU_RNG_NORMAL = 1, KCU_RNG_BERNOULLI = 2 };
/* uniform: U[a, b); normal: a + b N(0, 1); bernoulli: 1 with probability a. */
int kcu_random(int kind, int dt, int64_t n, uint64_t seed, uint64_t offset, double a, double b, void* out,
               cudaStream_t stream);
/* y = x * (u < keep ? scale : 0) (dt f32 f64 bf16 f16; y may alias x). */
int kcu_dropout(int dt, int64_t n, uint64_t seed, uint64_t offset, double keep, double scale, const void* x,
                void* y, cudaStream_t stream);

/* ================================================================ rope.cu
 * Rotary embedding on interleaved pairs of x [B, T, H, D] (dt f32 f64 bf16 f16; xs: element strides of b, t, h,
 * the last dim contiguous) with tables cos, sin contiguous [T, D / 2] (cdt, any float dtype); inverse = 1 rotates by
 * -angle.  out contiguous, x's dtype. */
int kcu_rope(int dt, int cdt, int64_t B, int64_t T, int64_t H, int64_t D, const void* x, const int64_t* xs,
             const void* cos, const void* sin, int inverse, void* out, cudaStream_t stream);

/* ================================================================ silu_mul.cu
 * silu(a) * b over n contiguous elements (dt f32 f64 bf16 f16), and its gradients ga = silu'(a) (g b), gb = g silu(a)
 * (either may be NULL): the silu and mul kernels' values, roundings included, in one pass each. */
int kcu_silu_mul(int dt, int64_t n, const void* a, const void* b, void* out, cudaStream_t stream);
int kcu_silu_mul_grad(int dt, int64_t n, const void* g, const void* a, const void* b, void* ga, void* gb,
                      cudaStream_t stream);

/* ================================================================ optim.cu
 * Multi-tensor kernels: one launch covers many tensors (chunked, the tensor
 * table travels in the kernel parameters).  Tensors are contiguous. */
typedef struct kcu_adamw_hparams {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;  /* the step count after increment (>= 1) */
} kcu_adamw_hparams;
/* AdamW on n tensors (torch.optim.AdamW's formula, kcuda_math.cuh): params
 * p (dtype pdt: f32 f64 bf16 f16), grads g (gdt), states m and v (sdt; f32
 * for half params).  grad_scale (device f32, may be NULL): g is multiplied by
 * *grad_scale first (a clip coefficient, without a host sync).  pcopy (may be
 * NULL, else n pointers of dtype cdt): also writes the updated params
 * converted to cdt (fp32 master weights -> bf16 compute copies). */
int kcu_adamw(int n, void* const* p, const void* const* g, void* const* m, void* const* v, const int64_t* numel,
              int pdt, int gdt, int sdt, void* const* pcopy, int cdt, const kcu_adamw_hparams* hp,
              const float* grad_scale, cudaStream_t stream);
/* Global norm over n tensors of dtype dt: kind 1 = L2 (sqrt of the sum of
 * squares), 3 = max |x| (kcpu.h's KN_L2, KN_MAX); *out (device f64) gets the
 * norm; deterministic through ws (kcu_global_norm_workspace bytes). */
size_t kcu_global_norm_workspace(int n, const int64_t* numel);
int kcu_global_norm(int kind, int n, const void* const* x, const int64_t* numel, int dt, double* out, void* ws,
                    cudaStream_t stream);
/* *coef = min(1, max_norm / (*norm + 1e-6)) on the device (f32). */
int kcu_clip_coef(const double* norm, double max_norm, float* coef, cudaStream_t stream);
/* x_t *= s for every tensor, s = (scale ? *scale : 1) * scale_host. */
int kcu_scale(int n, void* const* x, const int64_t* numel, int dt, const float* scale, double scale_host,
              cudaStream_t stream);

/* ================================================================ gemm.cu
 * GEMM through cuBLASLt, row-major:
 *   C[M, N] = alpha op(A)[M, K] op(B)[K, N] + beta C  (+ epilogue)
 * op(A) = A ([M, K], lda) or A^T when ta (A stored [K, M]); same for B.
 * Batched when batch > 1 (element strides sa, sb, sc between matrices).
 * Types: A, B of dtype abdt with C of cdt:
 *   bf16 x bf16 -> bf16 or f32;  f16 x f16 -> f16 or f32   (f32 accumulate)
 *   f32 x f32 -> f32  (tf32 = 1 allows TF32 tensor cores)
 *   f64 x f64 -> f64
 * Epilogues (bias is a vector of N elements added to every row of C, of
 * dtype bias_dt: the output dtype cdt is always accepted; GELU is cuBLASLt's
 * tanh approximation, gelu_tanh):
 *   NONE, BIAS, GELU, BIAS_GELU: C = gelu(AB + bias)
 *   GELU_AUX, BIAS_GELU_AUX: also stores the pre-GELU values in aux
 *     ([M, N], row stride ldaux, multiple of 8; dtype cdt) for backward
 *   DGELU: C = (AB) * gelu_tanh'(aux)  (the backward of a fused GELU)
 * The context holds the cuBLASLt handle, the caller's workspace (32 MiB
 * suggested on Hopper) and a cache of descriptors and algorithms per shape. */
typedef struct kcu_gemm_ctx kcu_gemm_ctx;
enum { KCU_EPI_NONE = 0, KCU_EPI_BIAS, KCU_EPI_GELU, KCU_EPI_BIAS_GELU, KCU_EPI_GELU_AUX,
       KCU_EPI_BIAS_GELU_AUX, KCU_EPI_DGELU };
typedef struct kcu_gemm_args {
  int ta, tb;
  int64_t M, N, K;
  int abdt, cdt, tf32;
  double alpha, beta;
  const void* A; int64_t lda;
  const void* B; int64_t ldb;
  void* C; int64_t ldc;
  int64_t batch, sa, sb, sc;   /* batch <= 1: one product */
  int epilogue;
  const void* bias; int bias_dt;
  void* aux; int64_t ldaux;
} kcu_gemm_args;
/* A context on the current device; ws may be NULL (ws_bytes 0). */
int kcu_gemm_create(kcu_gemm_ctx** out, void* ws, size_t ws_bytes);
void kcu_gemm_destroy(kcu_gemm_ctx* ctx);
int kcu_gemm(kcu_gemm_ctx* ctx, const kcu_gemm_args* a, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
