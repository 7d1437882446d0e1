/* gemm.c: matrix products on raw pointers (row-major, OpenBLAS), the small
 * row helpers that go with them (bias rows, column sums), and a parallel
 * loop for batches of small products.  Big products, bias rows and column
 * sums are split over the worker pool (parallel.c); OpenBLAS runs
 * single-threaded inside each part. */
#include "kcpu.h"
#include <cblas.h>
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* f32 products through oneDNN's sgemm when its library is present (Debian's libdnnl2, loaded at run time: no build
 * dependency).  On the reference step's 25 GEMM shapes, at one library thread per part of a split product (the
 * engine's path), oneDNN ran 1.10-1.13x OpenBLAS's AVX-512 kernels, and the step 0.94x (docs/benchmarks.md, "GEMM
 * library"); small products stay with OpenBLAS (DNNL_MIN_MACS).  ENGINE_GEMM=openblas keeps OpenBLAS; unset, auto or
 * onednn: oneDNN when it loads, else OpenBLAS (the
 * library in use and why: kc_gemm_library()).  Each thread that calls it keeps oneDNN's OpenMP team at one thread
 * (the engine splits big products over its own pool, as with OpenBLAS).  f64 stays with OpenBLAS. */
typedef int (*dnnl_sgemm_fn)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*,
                             int64_t, float, float*, int64_t);
typedef struct { int major, minor, patch; const char* hash; unsigned cpu_runtime, gpu_runtime; } dnnl_version_rec;
static dnnl_sgemm_fn g_dnnl_sgemm;
static void (*g_omp_set_num_threads)(int);
static pthread_once_t g_gemm_once = PTHREAD_ONCE_INIT;
static char g_gemm_desc[256] = "OpenBLAS";
static __thread int t_omp_one;

static void gemm_lib_load(void) {
  const char* want = getenv("ENGINE_GEMM");
  if (want && *want && strcmp(want, "auto") && strcmp(want, "onednn") && strcmp(want, "openblas")) {
    snprintf(g_gemm_desc, sizeof g_gemm_desc, "OpenBLAS (ENGINE_GEMM=%.64s is not openblas, onednn or auto)", want);
    return;
  }
  if (want && !strcmp(want, "openblas")) {
    snprintf(g_gemm_desc, sizeof g_gemm_desc, "OpenBLAS (ENGINE_GEMM=openblas)");
    return;
  }
  void* h = dlopen("libdnnl.so.2", RTLD_NOW | RTLD_LOCAL);
  void* g = h ? dlopen("libgomp.so.1", RTLD_NOW | RTLD_LOCAL) : NULL; /* the OpenMP runtime libdnnl loaded */
  dnnl_sgemm_fn f = h ? (dnnl_sgemm_fn)dlsym(h, "dnnl_sgemm") : NULL;
  void (*set)(int) = g ? (void (*)(int))dlsym(g, "omp_set_num_threads") : NULL;
  if (!f || !set) {
    snprintf(g_gemm_desc, sizeof g_gemm_desc, "OpenBLAS (oneDNN's libdnnl.so.2 %s: apt-get install libdnnl2)",
             h ? "has no dnnl_sgemm or OpenMP" : "not found");
    return;
  }
  const dnnl_version_rec* (*ver)(void) = (const dnnl_version_rec* (*)(void))dlsym(h, "dnnl_version");
  const dnnl_version_rec* v = ver ? ver() : NULL;
  g_omp_set_num_threads = set;
  g_dnnl_sgemm = f;
  if (v) snprintf(g_gemm_desc, sizeof g_gemm_desc, "oneDNN %d.%d.%d for f32, OpenBLAS for f64", v->major, v->minor,
                  v->patch);
  else snprintf(g_gemm_desc, sizeof g_gemm_desc, "oneDNN for f32, OpenBLAS for f64");
}

const char* kc_gemm_library(void) {
  pthread_once(&g_gemm_once, gemm_lib_load);
  return g_gemm_desc;
}

/* Products smaller than this (or with fewer than DNNL_MIN_DIM rows or columns) stay with OpenBLAS: oneDNN's sgemm
 * costs more per call, so a decoding step's one-row products ran 2.3x slower through it (recipes/bench/generate.lua:
 * 0.86 -> 1.97 ms a token), while the step's products of 2^21 multiply-adds and more gain. */
#define DNNL_MIN_MACS ((int64_t)1 << 21)
#define DNNL_MIN_DIM 16

/* C = alpha op(A) op(B) + beta C through oneDNN (beta 0: C is not read); 0 when done, -1 to use OpenBLAS. */
static int gemm_dnnl(int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha, const float* A, int64_t lda,
                     const float* B, int64_t ldb, double beta, float* C, int64_t ldc) {
  if (M < DNNL_MIN_DIM || N < DNNL_MIN_DIM || M * N * K < DNNL_MIN_MACS) return -1;
  pthread_once(&g_gemm_once, gemm_lib_load);
  if (!g_dnnl_sgemm) return -1;
  if (!t_omp_one) { g_omp_set_num_threads(1); t_omp_one = 1; }
  return g_dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, (float)alpha, A, lda, B, ldb, (float)beta, C, ldc)
             ? -1 : 0;
}

/* One BLAS call; OpenBLAS itself always runs single-threaded (engine/src/core/runtime.c):
 * the engine splits big products over its own pool instead (kc_gemm), so
 * BLAS threads never spin against the engine's threads. */
static void gemm_blas(int dt, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha, const void* A,
                      int64_t lda, const void* B, int64_t ldb, double beta, void* C, int64_t ldc) {
  if (dt == KC_F32 && !gemm_dnnl(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) return;
  enum CBLAS_TRANSPOSE TA = ta ? CblasTrans : CblasNoTrans, TB = tb ? CblasTrans : CblasNoTrans;
  if (beta == 0.0) {
    /* OpenBLAS clears C with a slow pass of its own for beta = 0: clearing
     * it here and accumulating with beta = 1 computes the same and is 3-15%
     * faster on these shapes */
    size_t es = dt == KC_F32 ? 4 : 8;
    if (ldc == N) memset(C, 0, (size_t)(M * N) * es);
    else for (int64_t i = 0; i < M; i++) memset((char*)C + (size_t)(i * ldc) * es, 0, (size_t)N * es);
    beta = 1.0;
  }
  if (dt == KC_F32)
    cblas_sgemm(CblasRowMajor, TA, TB, (blasint)M, (blasint)N, (blasint)K, (float)alpha, (const float*)A,
                (blasint)lda, (const float*)B, (blasint)ldb, (float)beta, (float*)C, (blasint)ldc);
  else
    cblas_dgemm(CblasRowMajor, TA, TB, (blasint)M, (blasint)N, (blasint)K, alpha, (const double*)A,
                (blasint)lda, (const double*)B, (blasint)ldb, beta, (double*)C, (blasint)ldc);
}

/* Products with at least this many multiply-adds are split over the pool:
 * one block of rows (or columns) of C per thread, each its own BLAS call.
 * Splitting the larger of M and N repacks the smaller operand once per
 * thread, a small price next to the product. */
#define GEMM_SPLIT_MIN ((int64_t)1 << 21)
#define GEMM_UNIT 16
/* A product with few rows (M < 2 GEMM_UNIT: decoding's x @ W^T, one row per sequence) reads all of op(B) for
 * little arithmetic, so it is bound by reading B and is split by columns from a much smaller size: op(B) of 2^16
 * elements.  On decoding's 12 products of the reference GPT (4 layers, dim 256; 12.6 MiB of weights a token),
 * three alternating pairs ran at 182-252 us split against 297-387 us on one thread; OpenBLAS's sgemv instead of
 * sgemm was slower on one thread (288-376 against 449-528 us) and no faster split. */
#define GEMM_FEW_ROWS_SPLIT_MIN ((int64_t)1 << 16)

typedef struct {
  int dt, ta, tb, by_rows;
  int64_t M, N, K;
  double alpha;
  const void* A; int64_t lda;
  const void* B; int64_t ldb;
  double beta;
  void* C; int64_t ldc;
} gemm_job;

static void gemm_part(void* vj, int64_t lo, int64_t hi) {
  const gemm_job* j = vj;
  size_t es = j->dt == KC_F32 ? 4 : 8;
  int64_t dim = j->by_rows ? j->M : j->N;
  int64_t a = lo * GEMM_UNIT, b = hi * GEMM_UNIT < dim ? hi * GEMM_UNIT : dim;
  if (a >= b) return;
  if (j->by_rows) { /* rows a..b of op(A) and C */
    const char* A = (const char*)j->A + (size_t)(j->ta ? a : a * j->lda) * es;
    char* C = (char*)j->C + (size_t)(a * j->ldc) * es;
    gemm_blas(j->dt, j->ta, j->tb, b - a, j->N, j->K, j->alpha, A, j->lda, j->B, j->ldb, j->beta, C, j->ldc);
  } else {          /* columns a..b of op(B) and C */
    const char* B = (const char*)j->B + (size_t)(j->tb ? a * j->ldb : a) * es;
    char* C = (char*)j->C + (size_t)a * es;
    gemm_blas(j->dt, j->ta, j->tb, j->M, b - a, j->K, j->alpha, j->A, j->lda, B, j->ldb, j->beta, C, j->ldc);
  }
}

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
  int few_rows = M < 2 * GEMM_UNIT && N >= 2 * GEMM_UNIT && N * K >= GEMM_FEW_ROWS_SPLIT_MIN;
  if ((few_rows || (M * N * K >= GEMM_SPLIT_MIN && (M >= 2 * GEMM_UNIT || N >= 2 * GEMM_UNIT))) &&
      !kc_in_parallel() && kc_get_threads() > 1) {
    gemm_job j = {dt, ta, tb, M >= N, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc};
    int64_t units = ((j.by_rows ? M : N) + GEMM_UNIT - 1) / GEMM_UNIT;
    int64_t t = kc_get_threads();
    kc_parallel_for(units, (units + t - 1) / t, gemm_part, &j);
    return;
  }
  gemm_blas(dt, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

/* C = bias rows (or 0) + A @ op(B) for row-major C [M, N] (ldc = N), then
 * epi(ctx, r0, r1) on each finished block of rows of C, on the thread that
 * computed it while the block is still in its cache.  The products are the
 * ones kc_fill_rows + kc_gemm(beta = 1) (or kc_gemm(beta = 0)) would run, so C
 * matches that pair bit for bit; a product split by columns (N > M) runs the
 * epilogue afterwards, by blocks of rows over the pool. */
typedef struct {
  gemm_job g;
  const void* bias;
  kc_range_fn epi;
  void* ectx;
} gemm_epi_job;

static void gemm_epi_part(void* vj, int64_t lo, int64_t hi) {
  const gemm_epi_job* j = vj;
  int64_t a = lo * GEMM_UNIT, b = hi * GEMM_UNIT < j->g.M ? hi * GEMM_UNIT : j->g.M;
  if (a >= b) return;
  if (j->bias) {
    size_t es = j->g.dt == KC_F32 ? 4 : 8;
    for (int64_t i = a; i < b; i++)
      memcpy((char*)j->g.C + (size_t)(i * j->g.ldc) * es, j->bias, (size_t)j->g.N * es);
  }
  gemm_part((void*)&j->g, lo, hi);
  j->epi(j->ectx, a, b);
}

typedef struct { kc_range_fn epi; void* ectx; } epi_rows_job;
static void epi_rows_part(void* vj, int64_t lo, int64_t hi) {
  const epi_rows_job* j = vj;
  j->epi(j->ectx, lo, hi);
}

void kc_gemm_epi(int dt, int ta, int tb, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda,
                 const void* B, int64_t ldb, const void* bias, void* C, kc_range_fn epi, void* ectx) {
  if (M <= 0 || N <= 0) return;
  double beta = bias ? 1.0 : 0.0;
  if (K > 0 && M * N * K >= GEMM_SPLIT_MIN && M >= 2 * GEMM_UNIT && M >= N && !kc_in_parallel() &&
      kc_get_threads() > 1) {
    gemm_epi_job j = {{dt, ta, tb, 1, M, N, K, 1.0, A, lda, B, ldb, beta, C, N}, bias, epi, ectx};
    int64_t units = (M + GEMM_UNIT - 1) / GEMM_UNIT;
    int64_t t = kc_get_threads();
    kc_parallel_for(units, (units + t - 1) / t, gemm_epi_part, &j);
    return;
  }
  if (bias) kc_fill_rows(dt, M, N, bias, C, N);
  kc_gemm(dt, ta, tb, M, N, K, 1.0, A, lda, B, ldb, beta, C, N);
  epi_rows_job r = {epi, ectx};
  int64_t grain = 16384 / N;
  kc_parallel_for(M, grain > 1 ? grain : 1, epi_rows_part, &r);
}

/* out[i, :] = bias for rows i < rows (row stride ld), rows split over the pool. */
typedef struct { size_t es; int64_t n, ld; const void* bias; void* out; } fill_job;

static void fill_part(void* vj, int64_t lo, int64_t hi) {
  const fill_job* j = vj;
  for (int64_t i = lo; i < hi; i++) memcpy((char*)j->out + (size_t)(i * j->ld) * j->es, j->bias, (size_t)j->n * j->es);
}

void kc_fill_rows(int dt, int64_t rows, int64_t n, const void* bias, void* out, int64_t ld) {
  fill_job j = {dt == KC_F32 ? 4 : 8, n, ld, bias, out};
  int64_t grain = n > 0 ? 32768 / n : rows;
  kc_parallel_for(rows, grain > 1 ? grain : 1, fill_part, &j);
}

/* out[j] = sum_i g[i, j] over rows (row stride ld); f32 sums in blocks of
 * 64 rows, each block total added to the result in block order (the block
 * totals are computed in parallel, so the result does not depend on the
 * thread count). */
#define SUM_BLK 64
typedef struct { int64_t rows, n, ld; const float* g; float* part; } sumrows_job;

static void sum_block(const float* G, int64_t ld, int64_t ni, int64_t n, float* out) {
  for (int64_t j0 = 0; j0 < n; j0 += 256) {
    int64_t nj = n - j0 < 256 ? n - j0 : 256;
    float blk[256] = {0};
    for (int64_t i = 0; i < ni; i++) {
      const float* restrict r = G + i * ld + j0;
      for (int64_t j = 0; j < nj; j++) blk[j] += r[j];
    }
    for (int64_t j = 0; j < nj; j++) out[j0 + j] = blk[j];
  }
}

static void sumrows_part(void* vj, int64_t lo, int64_t hi) {
  const sumrows_job* j = vj;
  for (int64_t b = lo; b < hi; b++) {
    int64_t i0 = b * SUM_BLK, ni = j->rows - i0 < SUM_BLK ? j->rows - i0 : SUM_BLK;
    sum_block(j->g + i0 * j->ld, j->ld, ni, j->n, j->part + b * j->n);
  }
}

void kc_sum_rows(int dt, int64_t rows, int64_t n, const void* g, int64_t ld, void* out) {
  if (dt == KC_F32) {
    float* restrict o = out;
    const float* G = g;
    memset(o, 0, (size_t)n * sizeof *o);
    int64_t nb = (rows + SUM_BLK - 1) / SUM_BLK;
    float* part = nb > 1 && n > 0 ? malloc((size_t)(nb * n) * sizeof *part) : NULL;
    if (part) {
      sumrows_job j = {rows, n, ld, G, part};
      int64_t grain = (1 << 16) / (SUM_BLK * n);
      kc_parallel_for(nb, grain > 1 ? grain : 1, sumrows_part, &j);
      for (int64_t b = 0; b < nb; b++)
        for (int64_t c = 0; c < n; c++) o[c] += part[b * n + c];
      free(part);
      return;
    }
    float tmp[256];
    for (int64_t j0 = 0; j0 < n; j0 += 256) {
      int64_t nj = n - j0 < 256 ? n - j0 : 256;
      for (int64_t i0 = 0; i0 < rows; i0 += SUM_BLK) {
        int64_t ni = rows - i0 < SUM_BLK ? rows - i0 : SUM_BLK;
        sum_block(G + i0 * ld + j0, ld, ni, nj, tmp);
        for (int64_t j = 0; j < nj; j++) o[j0 + j] += tmp[j];
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

/* gelu backward fused with the bias gradient: gh = gy * gelu'(h) (op KU_GELU
 * or KU_GELU_TANH) over rows x n contiguous, and gb[j] = sum_i gh[i, j] (gb
 * NULL: none) in kc_sum_rows's order (blocks of SUM_BLK rows, their totals
 * added in block order), so both equal the unfused pair bit for bit. */
typedef struct { int dt, op; int64_t rows, n; const char *gy, *h; char* gh; float* part; } gelu_grad_job;

static void gelu_grad_part(void* vj, int64_t lo, int64_t hi) {
  const gelu_grad_job* j = vj;
  size_t es = j->dt == KC_F32 ? 4 : 8, rb = (size_t)j->n * es;
  for (int64_t b = lo; b < hi; b++) {
    int64_t i0 = b * SUM_BLK, ni = j->rows - i0 < SUM_BLK ? j->rows - i0 : SUM_BLK;
    for (int64_t i = i0; i < i0 + ni; i++)
      kc_unary_grad_row(j->op, j->dt, j->n, j->gh + (size_t)i * rb, (int64_t)es, j->gy + (size_t)i * rb, (int64_t)es,
                        j->h + (size_t)i * rb, (int64_t)es, j->h + (size_t)i * rb, (int64_t)es, NAN, NAN);
    if (j->part) sum_block((const float*)(j->gh + (size_t)i0 * rb), j->n, ni, j->n, j->part + b * j->n);
  }
}

void kc_gelu_bias_grad(int dt, int op, int64_t rows, int64_t n, const void* gy, const void* h, void* gh, void* gb) {
  if (rows <= 0 || n <= 0) {
    if (gb) memset(gb, 0, (size_t)(n > 0 ? n : 0) * (dt == KC_F32 ? 4 : 8));
    return;
  }
  int64_t nb = (rows + SUM_BLK - 1) / SUM_BLK;
  float* part = gb && dt == KC_F32 ? malloc((size_t)(nb * n) * sizeof *part) : NULL;
  gelu_grad_job j = {dt, op, rows, n, gy, h, gh, part};
  int64_t grain = (1 << 16) / (SUM_BLK * n);
  kc_parallel_for(nb, grain > 1 ? grain : 1, gelu_grad_part, &j);
  if (!gb) return;
  if (!part) { kc_sum_rows(dt, rows, n, gh, n, gb); return; } /* f64, or no memory for the partials */
  if (nb == 1) { /* kc_sum_rows's serial path: the same block sum into a zeroed total */
    float* o = gb;
    for (int64_t c = 0; c < n; c++) o[c] = 0.0f + part[c];
  } else {
    float* o = gb;
    memset(o, 0, (size_t)n * sizeof *o);
    for (int64_t b = 0; b < nb; b++)
      for (int64_t c = 0; c < n; c++) o[c] += part[b * n + c];
  }
  free(part);
}

/* ------------------------------------------------------------ parallel batches */
void kc_parallel_blas(int threads, int64_t n, kc_range_fn fn, void* ctx) {
  if (threads <= 1 || n < 2) { fn(ctx, 0, n); return; }
  kc_parallel_for(n, 1, fn, ctx);
}
