/* cuda_ops.h: the device side of the engine's ops (ops/cuda_ops.c), not public.
 *
 * Each op's compute part calls these when its tensors live on ENG_CUDA
 * (t->device == ENG_CUDA) instead of the CPU kernels; everything else about
 * the op (argument checks, dtype rules, autograd) stays in the op's file.
 * Pointers are DEVICE pointers (eng_ptr of a CUDA tensor); strides are in
 * elements; every launch goes to the runtime's compute stream, so results
 * are ordered without host syncs (only the functions that must read a
 * device flag or value sync, and say so).  All return 0 / non-NULL, or -1 /
 * NULL with "<op>: ..." in eng_last_error().
 *
 * In a build without the CUDA backend they exist and fail ("this build has
 * no CUDA backend"); they cannot be reached there, since no tensor can be
 * allocated on ENG_CUDA. */
#ifndef ENG_CUDA_OPS_H
#define ENG_CUDA_OPS_H
#include "core/internal.h"
#include "cuda/cuda_runtime.h"
#include "ops/bmm.h"

/* Error when a and b are on different devices, naming both: -1, else 0. */
int eng_cu_same_device(const char* op, const eng_tensor* a, const eng_tensor* b);

/* Raw strided kernels (kernels/cuda/elementwise.cu, select.cu); the copy and the fill are the runtime's
 * (cuda/cuda_runtime.h). */
int eng_cu_unary(int uop, int dt, int nd, const int64_t* shape, void* out, const int64_t* so, const void* x,
                 const int64_t* sx, double p0, double p1, const char* op);
int eng_cu_unary_grad(int uop, int dt, int nd, const int64_t* shape, void* gi, const int64_t* sgi, const void* g,
                      const int64_t* sg, const void* x, const int64_t* sx, const void* y, const int64_t* sy,
                      double p0, double p1, const char* op);
int eng_cu_binary(int bop, int dt, int nd, const int64_t* shape, void* out, const int64_t* so, const void* a,
                  const int64_t* sa, const void* b, const int64_t* sb, const char* op);
int eng_cu_compare(int cop, int dt, int nd, const int64_t* shape, void* out, const int64_t* so, const void* a,
                   const int64_t* sa, const void* b, const int64_t* sb, const char* op);
int eng_cu_where(int es, int nd, const int64_t* shape, void* out, const int64_t* so, const void* c,
                 const int64_t* sc, const void* a, const int64_t* sa, const void* b, const int64_t* sb,
                 const char* op);
int eng_cu_masked_fill(int es, int nd, const int64_t* shape, void* out, const int64_t* so, const void* x,
                       const int64_t* sx, const void* m, const int64_t* sm, const void* value, const char* op);

/* Reductions over contiguous [outer, D, inner] (kind 0 sum, 1 max, 2 min). */
int eng_cu_reduce_dim(int kind, int dt, int64_t outer, int64_t D, int64_t inner, const void* x, void* out, int odt,
                      double scale, const char* op);
int eng_cu_reduce_all(int kind, int dt, int64_t n, const void* x, void* out, int odt, double scale, const char* op);
int eng_cu_argext_dim(int dt, int is_max, int64_t outer, int64_t D, int64_t inner, const void* x, void* vals,
                      int64_t* idx, const char* op);
int eng_cu_scatter_dim(int es, int64_t outer, int64_t D, int64_t inner, const int64_t* idx, const void* g,
                       void* out, const char* op);

/* softmax / log_softmax (bw: gradient from the saved output x and g). */
int eng_cu_softmax(int dt, int log_, int bw, int64_t outer, int64_t D, int64_t inner, const void* x, const void* g,
                   void* y, const char* op);
/* layer/rms norm in dt (f32 bf16 f16 f64); mean/rstd f32 (f64 for f64 data); dw/db overwritten.
 * r (may be NULL): the residual, h = x + r is written and normalised; gres (may be NULL): h's
 * gradient from its other uses, added to dx. */
int eng_cu_norm_fwd(int dt, int rms, int64_t m, int64_t n, const void* x, const void* r, void* h, const void* w,
                    const void* b, double eps, void* y, void* mean, void* rstd, const char* op);
int eng_cu_norm_bwd(int dt, int rms, int64_t m, int64_t n, const void* gy, const void* x, const void* w,
                    const void* mean, const void* rstd, const void* gres, void* dx, void* dw, void* db,
                    const char* op);
/* out[j] = scale * sum over rows of x[row, j] (contiguous [rows, n], dt f32 bf16 f16; out of odt):
 * the 2-D column sum (bias gradients). */
int eng_cu_colsum(int dt, int64_t rows, int64_t n, const void* x, void* out, int odt, double scale, const char* op);
/* Embedding gather; syncs to check the indices (error naming the range). */
int eng_cu_embedding_fwd(int64_t n_idx, const void* idx, int idt, const void* w, int64_t V, int64_t row_bytes,
                         void* out, const char* op);
int eng_cu_embedding_bwd(int gdt, int64_t n_idx, const void* idx, int idt, const void* go, int64_t dim, int64_t V,
                         int64_t pad, void* gw, const char* op);
/* Cross entropy over x [N, C]; loss/lse of dtype odt (f32, f64 for f64 x);
 * syncs to check the targets. */
int eng_cu_cross_entropy_fwd(int dt, int64_t N, int64_t C, const void* x, const void* tgt, int tdt, int64_t ignore,
                             double eps, void* loss, void* lse, const char* op);
int eng_cu_cross_entropy_bwd(int dt, int64_t N, int64_t C, const void* x, const void* tgt, int tdt, int64_t ignore,
                             double eps, const void* lse, const void* gs, const void* gscale, double gconst, void* gx,
                             const char* op);
int eng_cu_masked_mean(int dt, int64_t N, const void* vals, const void* tgt, int tdt, int64_t ignore, void* out,
                       const char* op);

/* Flash attention on 4-D q [B, H, Lq, D], k/v [B, H, Lk, D] (f32/bf16/f16,
 * D <= 128, same B and H, v's head dim = D): a new output (q's dtype,
 * contiguous) and lse (f32 [B, H, Lq]); NULL with an error when the shapes
 * are outside what the kernels take. */
eng_tensor* eng_cu_sdpa_fwd(eng_tensor* q, eng_tensor* k, eng_tensor* v, int causal, double scale,
                            eng_tensor** lse, const char* op);
/* dq, dk, dv (new, contiguous; each may be skipped with a NULL slot). */
int eng_cu_sdpa_bwd(eng_tensor* q, eng_tensor* k, eng_tensor* v, eng_tensor* o, eng_tensor* lse, eng_tensor* dout,
                    int causal, double scale, eng_tensor** dq, eng_tensor** dk, eng_tensor** dv, const char* op);

/* Counter-based RNG on contiguous data (same numbers as the CPU). */
int eng_cu_dropout(int dt, int64_t n, uint64_t seed, uint64_t offset, double keep, double scale, const void* x,
                   void* y, const char* op);
/* silu(a) * b and its gradients (kcu_silu_mul): contiguous device buffers of n elements of dt; ga or gb may be
 * NULL. */
int eng_cu_silu_mul(int dt, int64_t n, const void* a, const void* b, void* out, const char* op);
int eng_cu_silu_mul_grad(int dt, int64_t n, const void* g, const void* a, const void* b, void* ga, void* gb,
                         const char* op);
/* Rotary embedding (kcu_rope): x, cos, sin contiguous device buffers; out [B, T, H, D] in dt. */
int eng_cu_rope(int dt, int cdt, int64_t B, int64_t T, int64_t H, int64_t D, const void* x, const int64_t* xs,
                const void* cos, const void* sin, int inverse, void* out, const char* op);

/* Optimizers over lists of contiguous CUDA tensors (validated by the caller;
 * NULL grads skipped): one multi-tensor launch per dtype combination. */
/* w (may be NULL, entries may be NULL): f32 master weights of half params;
 * their update runs on w and p gets the rounded copy. */
int eng_cu_adamw(int n, eng_tensor** p, eng_tensor** g, eng_tensor** m, eng_tensor** v, eng_tensor** w, double lr,
                 double beta1, double beta2, double eps, double wd, int64_t step, const char* op);
/* Global norm (p = 2 or inf) of the tensors (or of their .grad); syncs. */
int eng_cu_global_norm(int n, eng_tensor** ts, int from_grads, double p, double* out, const char* op);
/* x *= s for every tensor (or .grad). */
int eng_cu_scale(int n, eng_tensor** ts, int from_grads, double s, const char* op);

/* C[b] = alpha A[b] @ B[b] + beta C[b] (+ bias [N] on every row when bias is
 * not NULL) through cuBLASLt, as eng_bmm_run; A, B of dtype abdt, C of cdt. */
int eng_cu_bmm_run(int abdt, int cdt, int nb, const int64_t* bshape, const eng_mview* A, const eng_mview* B,
                   const eng_mview* C, double alpha, double beta, const void* bias, const char* op);
/* 1 when the flash kernels take q, k, v (4-D [B, H, L, D] with the same B and H, f32/bf16/f16, head dim <= 128
 * shared by q and v, dims within int32): else scaled_dot_product_attention runs its math path.  No error set. */
int eng_cu_sdpa_supported(const eng_tensor* q, const eng_tensor* k, const eng_tensor* v);
/* linear + tanh GELU in one cuBLASLt product (the BIAS_GELU_AUX epilogue):
 * y [rows, N] = gelu_tanh(X [rows, K] @ W^T + bias) with W [N, K], all
 * contiguous, dtype dt (f32, bf16, f16; bias NULL or [N]), and the pre-GELU
 * values in h [rows, N] for backward.  1 when cuBLASLt has no algorithm for
 * it (nothing written: the caller runs linear then gelu), -1 on error. */
int eng_cu_linear_gelu(int dt, int64_t rows, int64_t N, int64_t K, const void* X, const void* W, const void* bias,
                       void* y, void* h, const char* op);

#endif
