/* kvocab_cuda.h: the local parts of the vocab-parallel ops (Megatron's parallel cross entropy and masked
 * embedding, PyTorch's loss_parallel / _MaskPartial), C-callable, on contiguous device buffers.  The
 * collectives between the phases are the caller's (all_reduces over the group on the same device buffers).
 * Logits x are [M, V] (the local vocab slice [off, off + V) of vocab_total classes), dtype dt f32 or f64;
 * targets i64 [M]; the per-row buffers mx/se/tl/rw are f64.  Reductions run in a fixed order (bit-identical
 * from run to run).  Statuses as kcuda.h. */
#ifndef KVOCAB_CUDA_H
#define KVOCAB_CUDA_H
#include <stdint.h>
#include <cuda_runtime_api.h>
#ifdef __cplusplus
extern "C" {
#endif

/* One block: rw[i] = weight[t_i] (w f64 [total], or NULL: rw may be NULL), 0 for ignored rows;
 * *wsum = sum of rw over the rows not ignored (their count without w); *err = max(slice_err, 2 if a target is
 * neither ignore nor in [0, total)). */
int kcu_vp_ce_prep(int64_t M, const int64_t* tgt, int64_t total, int64_t ignore, const double* w, double* rw,
                   double slice_err, double* err, double* wsum, cudaStream_t s);
/* mx[i] = max_c x[i, c] (-inf for V == 0). */
int kcu_vp_ce_max(int dt, int64_t M, int64_t V, const void* x, double* mx, cudaStream_t s);
/* After the max all_reduce: se[i] = sum_c exp(x[i, c] - mx[i]) (0 when mx[i] is not finite), se[M] = V;
 * tl[i] = x[i, t_i - off] when the target is in this slice and not ignored, else 0. */
int kcu_vp_ce_sumexp(int dt, int64_t M, int64_t V, const void* x, const double* mx, const int64_t* tgt, int64_t off,
                     int64_t ignore, double* se, double* tl, cudaStream_t s);
/* After the sum all_reduces: lse[i] = mx[i] + log(se[i]) (dtype dt); loss_i = (lse_i - tl_i) * (rw ? rw[i] : 1),
 * 0 for ignored rows; reduction 0: out[i] = loss_i, 1: out[0] = sum / *wsum, 2: out[0] = sum (dtype dt). */
int kcu_vp_ce_loss(int dt, int64_t M, const double* mx, const double* se, const double* tl, const int64_t* tgt,
                   int64_t ignore, const double* rw, const double* wsum, int reduction, void* lse, void* out,
                   cudaStream_t s);
/* Backward, no communication: gx[i, c] = s_i exp(x[i, c] - lse_i) - (c == t_i - off ? s_i : 0) with
 * s_i = 0 for ignored rows, else (g / (div ? *div : 1)) * (rw ? rw[i] : 1), g = per_row ? g[i] : g[0]
 * (g of dtype gdt: f32 or f64). */
int kcu_vp_ce_bwd(int dt, int64_t M, int64_t V, const void* x, const void* lse, const int64_t* tgt, int64_t off,
                  int64_t ignore, const void* g, int gdt, int per_row, const double* rw, const double* div, void* gx,
                  cudaStream_t s);

/* Masked embedding (kernels/cuda/embedding.cu): rows of an index outside [off, off + rows) are zero;
 * *bad (may be NULL) set to 1 when an index is negative or (total >= 0) not below total.  Backward: gw (f32 for f32/bf16/f16 go, f64 for f64)
 * overwritten with the scatter-add of go's rows into the owned rows only, atomic-free (fixed order). */
int kcu_embedding_masked_fwd(int64_t n_idx, const void* idx, int idt, const void* w, int64_t rows, int64_t row_bytes,
                             int64_t off, int64_t total, void* out, int* bad, cudaStream_t s);
int kcu_embedding_masked_bwd(int gdt, int64_t n_idx, const void* idx, int idt, const void* go, int64_t dim,
                             int64_t rows, int64_t off, void* gw, cudaStream_t s);

#ifdef __cplusplus
}
#endif
#endif
