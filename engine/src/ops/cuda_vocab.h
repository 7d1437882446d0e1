/* cuda_vocab.h: the device side of the vocab-parallel local ops (ops/vocab_parallel.c, ops/embedding_masked.c)
 * over kernels/cuda/kvocab_cuda.h.  Internal.  Device pointers, contiguous buffers, the compute stream; no host
 * sync (the callers read the agreed error flags once).  0, or -1 with "<op>: ..." set. */
#ifndef ENG_CUDA_VOCAB_H
#define ENG_CUDA_VOCAB_H
#include "core/internal.h"

int eng_cu_vp_ce_prep(int64_t M, const int64_t* tgt, int64_t total, int64_t ignore, const double* w, double* rw,
                      double slice_err, double* err, double* wsum, const char* op);
int eng_cu_vp_ce_max(int dt, int64_t M, int64_t V, const void* x, double* mx, const char* op);
int eng_cu_vp_ce_sumexp(int dt, int64_t M, int64_t V, const void* x, const double* mx, const int64_t* tgt,
                        int64_t off, int64_t ignore, double* se, double* tl, const char* op);
int eng_cu_vp_ce_loss(int dt, int64_t M, const double* mx, const double* se, const double* tl, const int64_t* tgt,
                      int64_t ignore, const double* rw, const double* wsum, int reduction, void* lse, void* out,
                      const char* op);
int eng_cu_vp_ce_bwd(int dt, int64_t M, int64_t V, const void* x, const void* lse, const int64_t* tgt, int64_t off,
                     int64_t ignore, const void* g, int gdt, int per_row, const double* rw, const double* div, void* gx,
                     const char* op);
/* Masked embedding; fwd syncs once to read the index flag: 1 when an index is negative or (total >= 0) not below
 * total (no error set: the caller names the index), 0 done, -1 error. */
int eng_cu_embedding_masked_fwd(int64_t n_idx, const void* idx, int idt, const void* w, int64_t rows,
                                int64_t row_bytes, int64_t off, int64_t total, void* out, const char* op);
int eng_cu_embedding_masked_bwd(int gdt, int64_t n_idx, const void* idx, int idt, const void* go, int64_t dim,
                                int64_t rows, int64_t off, void* gw, const char* op);
/* Copies n doubles from device memory to the host (one sync). */
int eng_cu_read_f64(const double* src, double* dst, int n, const char* op);

#endif
