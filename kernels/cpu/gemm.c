/* gemm.c: matrix products on raw pointers (row-major, OpenBLAS), the small
 * row helpers that go with them (bias rows, column sums), and a parallel
 * loop for batches of small products. */
#include "kcpu.h"
#include <cblas.h>
#include <pthread.h>
#include <string.h>

/* C = alpha * op(A) @ op(B) + beta * C with op(X) = X or X^T (ta/tb), all
 * row-major; M x K times K x N.  Handles K == 0 (C = beta * C) and empty
 * outputs.  beta == 0 overwrites C (NaNs in C are not propagated). */
void kc_gemm(int dt, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha,
             const void* A, int64_t lda, const void* B, int64_t ldb, double beta, void* C,
             int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int64_t i = 0; i < M; i++) {
      if (dt == KC_F32) {
        float* c = (float*)C + i * ldc;
        if (beta == 0.0) memset(c, 0, (size_t)N * sizeof *c);
        else for (int64_t j = 0; j < N; j++) c[j] *= (float)beta;
      } else {
        double* c = (double*)C + i * ldc;
        if (beta == 0.0) memset(c, 0, (size_t)N * sizeof *c);
        else for (int64_t j = 0; j < N; j++) c[j] *= beta;
      }
    }
    return;
  }
  enum CBLAS_TRANSPOSE TA = ta ? CblasTrans : CblasNoTrans, TB = tb ? CblasTrans : CblasNoTrans;
  if (dt == KC_F32)
    cblas_sgemm(CblasRowMajor, TA, TB, (blasint)M, (blasint)N, (blasint)K, (float)alpha, (const float*)A,
                (blasint)lda, (const float*)B, (blasint)ldb, (float)beta, (float*)C, (blasint)ldc);
  else
    cblas_dgemm(CblasRowMajor, TA, TB, (blasint)M, (blasint)N, (blasint)K, alpha, (const double*)A,
                (blasint)lda, (const double*)B, (blasint)ldb, beta, (double*)C, (blasint)ldc);
}

/* out[i, :] = bias for rows i < rows (row stride ld). */
void kc_fill_rows(int dt, int64_t rows, int64_t n, const void* bias, void* out, int64_t ld) {
  size_t es = dt == KC_F32 ? 4 : 8;
  for (int64_t i = 0; i < rows; i++) memcpy((char*)out + (size_t)(i * ld) * es, bias, (size_t)n * es);
}

/* out[j] = sum_i g[i, j] over rows (row stride ld); f32 sums in blocks of
 * 64 rows, each block total added to the result. */
void kc_sum_rows(int dt, int64_t rows, int64_t n, const void* g, int64_t ld, void* out) {
  if (dt == KC_F32) {
    float* restrict o = out;
    const float* G = g;
    memset(o, 0, (size_t)n * sizeof *o);
    float blk[256];
    for (int64_t j0 = 0; j0 < n; j0 += 256) {
      int64_t nj = n - j0 < 256 ? n - j0 : 256;
      for (int64_t i0 = 0; i0 < rows; i0 += 64) {
        int64_t ni = rows - i0 < 64 ? rows - i0 : 64;
        memset(blk, 0, sizeof blk);
        for (int64_t i = 0; i < ni; i++) {
          const float* restrict r = G + (i0 + i) * ld + j0;
          for (int64_t j = 0; j < nj; j++) blk[j] += r[j];
        }
        for (int64_t j = 0; j < nj; j++) o[j0 + j] += blk[j];
      }
    }
  } else {
    double* restrict o = out;
    const double* G = g;
    memset(o, 0, (size_t)n * sizeof *o);
    for (int64_t i = 0; i < rows; i++) {
      const double* restrict r = G + i * ld;
      for (int64_t j = 0; j < n; j++) o[j] += r[j];
    }
  }
}

/* ------------------------------------------------------------ parallel batches */
#define KC_MAX_THREADS 64

typedef struct { kc_range_fn fn; void* ctx; int64_t lo, hi; } kc_part;

static void* part_main(void* a) {
  kc_part* p = a;
  p->fn(p->ctx, p->lo, p->hi);
  return NULL;
}

void kc_parallel_blas(int threads, int64_t n, kc_range_fn fn, void* ctx) {
  if (threads > n) threads = (int)n;
  if (threads > KC_MAX_THREADS) threads = KC_MAX_THREADS;
  if (threads <= 1) { fn(ctx, 0, n); return; }
  int blas = openblas_get_num_threads();
  openblas_set_num_threads(1);
  kc_part parts[KC_MAX_THREADS];
  pthread_t tid[KC_MAX_THREADS];
  int started[KC_MAX_THREADS] = {0};
  for (int i = 0; i < threads; i++) {
    parts[i].fn = fn; parts[i].ctx = ctx;
    parts[i].lo = n * i / threads; parts[i].hi = n * (i + 1) / threads;
  }
  for (int i = 1; i < threads; i++) started[i] = pthread_create(&tid[i], NULL, part_main, &parts[i]) == 0;
  fn(ctx, parts[0].lo, parts[0].hi);
  for (int i = 1; i < threads; i++) {
    if (started[i]) pthread_join(tid[i], NULL);
    else fn(ctx, parts[i].lo, parts[i].hi);
  }
  openblas_set_num_threads(blas);
}
