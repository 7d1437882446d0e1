/* bmm.h: batched strided matrix products over BLAS (ops/matmul.c), shared by
 * the ops built on GEMM (matmul, linear, attention).  Not public. */
#ifndef ENG_BMM_H
#define ENG_BMM_H
#include "core/internal.h"

/* An operand seen as a batch of strided matrices: element (b..., i, j) lies at
 * p + sum_d bs[d] * b[d] + i * rs + j * cs (in elements), batch dims aligned
 * with the full batch shape (stride 0 where the operand is broadcast). */
typedef struct eng_mview {
  char* p;
  int64_t rows, cols, rs, cs;
  int64_t bs[ENG_MAX_DIMS];
} eng_mview;

/* t's view with batch dims = all but the last two (right-aligned to bshape).
 * vec: 0 = t is [..., rows, cols]; 1 = a vector seen as a row [1, K];
 * 2 = a vector seen as a column [K, 1]. */
void eng_mview_of(const eng_tensor* t, int vec, int nb, const int64_t* bshape, eng_mview* m);
eng_mview eng_mview_t(eng_mview m);
/* eng_mview_of (transposed if asked), copying t to a contiguous tensor
 * (a new reference in *hold, else NULL) when BLAS cannot read its strides. */
int eng_mview_prep(eng_tensor* t, int vec, int transpose, int nb, const int64_t* bshape, eng_mview* m,
                   eng_tensor** hold);
/* How BLAS reads m: trans 0 = row-major with leading dim ld, 1 = the
 * transpose of a row-major matrix.  0 if it cannot (copy it first). */
int eng_mview_layout(const eng_mview* m, int* trans, int64_t* ld);
/* Do the batch dims (strides bs over bshape) and one matrix dim (size n, stride s) of an operand coalesce into
 * one dim?  Sets its stride in *fs. */
int eng_mview_fold(int nb, const int64_t* bshape, const int64_t* bs, int64_t n, int64_t s, int64_t* fs);
/* 1 when every batch dim of size > 1 has stride 0 (one matrix broadcast over the batch). */
int eng_mview_zero_strides(int nb, const int64_t* bshape, const int64_t* bs);
/* C[b] = alpha * A[b] @ B[b] + beta * C[b] over the batch index space bshape
 * (dt ENG_F32 or ENG_F64); A: M x K, B: K x N (both from eng_mview_prep),
 * C: M x N with unit column stride.  Where C has stride 0 in a batch dim of
 * size > 1, the products are summed into C.  op names the caller in errors. */
int eng_bmm_run(int dt, int nb, const int64_t* bshape, const eng_mview* A, const eng_mview* B,
                const eng_mview* C, double alpha, double beta, const char* op);

#endif
