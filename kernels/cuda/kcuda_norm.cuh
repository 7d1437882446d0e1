/* kcuda_norm.cuh: the launch plans and the f32 arithmetic of the vectorised
 * norm kernels (norm.cu) and of the 2-D column sums (colsum.cuh: bias and
 * norm weight/bias gradients), written once for both compilers as
 * kcuda_math.cuh is: nvcc compiles them __host__ __device__, gcc as plain C.
 * spec/c/test_cuda_norm.c runs the kernels' exact partition and summation
 * order on the CPU with these functions (against float64 references, and
 * bit for bit against the kernels where a GPU is present).
 *
 * Every f32 operation that takes part in a sum goes through KCM_ADD / MUL /
 * SUB / DIV / FMA: on the device they are the _rn intrinsics, which nvcc
 * never contracts into other FMAs, so the kernels round exactly where these
 * functions say (the C side must be compiled without FP contraction; the
 * test checks that it is).
 *
 * Row kernels (layer_norm / rms_norm, optional residual add h = x + r):
 *   - a row of n elements of a 16-byte-vector type (V = 4 f32, 8 bf16/f16)
 *     takes the vector path when n % V == 0, every pointer is 16-byte
 *     aligned and nv = ceil(n / V / 32) <= KCM_NORM_MAXV: one warp per row,
 *     lane l holds vectors l, l + 32, ... (in registers);
 *   - a lane sums its vectors in order (vector i, then element k), the warp
 *     combines lanes with the xor butterfly (offsets 16, 8, 4, 2, 1);
 *   - backward: KCM_NORM_WARPS warps per block, block p owns the rows
 *     [p R, (p + 1) R) (R = kcm_norm_bwd_rows), warp w the rows p R + w +
 *     k W; each lane accumulates g xhat and g for its columns over its rows in
 *     order, the block adds its warps in order 0..W-1 (shared memory) and
 *     writes one f32 partial row; the partial rows are summed by the column
 *     sum's second stage.
 * Column sums of x[rows, n] (colsum.cuh):
 *   - stage 1: blocks of 32 x KCM_COLSUM_TY threads; block (bx, by) covers
 *     columns [bx 32 V, (bx + 1) 32 V) (thread tx the V columns from
 *     bx 32 V + tx V) and the rows [by RT, (by + 1) RT) (RT =
 *     kcm_colsum_tile_rows); thread ty sums the rows by RT + ty + k TY in
 *     order, thread ty = 0 adds the TY sums in order 0..TY-1;
 *   - stage 2 (when there is more than one row tile): the same kernel with
 *     V = 1 and TY = KCM_COLSUM2_TY over the f32 partial rows, one tile. */
#ifndef KCUDA_NORM_CUH
#define KCUDA_NORM_CUH
#include "kcuda_math.cuh"

#define KCM_NORM_WARPS 8        /* warps per block of the vectorised norm kernels */
#define KCM_NORM_MAXV 8         /* 16-byte vectors per lane at most: n <= 256 V */
#define KCM_NORM_BWD_BLOCKS 512 /* partial rows of the weight/bias gradients at most */
#define KCM_COLSUM_TY 8         /* row lanes of the column sum's first stage */
#define KCM_COLSUM2_TY 32       /* row lanes of its second stage */
#define KCM_COLSUM_BLOCKS 512   /* first-stage blocks aimed at */
#define KCM_COLSUM_MIN_ROWS 32  /* rows per tile at least */

#ifdef __CUDA_ARCH__
#define KCM_ADD(a, b) __fadd_rn((a), (b))
#define KCM_SUB(a, b) __fsub_rn((a), (b))
#define KCM_MUL(a, b) __fmul_rn((a), (b))
#define KCM_DIV(a, b) __fdiv_rn((a), (b))
#define KCM_FMA(a, b, c) __fmaf_rn((a), (b), (c))
#define KCM_SQRT(a) __fsqrt_rn(a)
#else
#define KCM_ADD(a, b) ((float)(a) + (float)(b))
#define KCM_SUB(a, b) ((float)(a) - (float)(b))
#define KCM_MUL(a, b) ((float)(a) * (float)(b))
#define KCM_DIV(a, b) ((float)(a) / (float)(b))
#define KCM_FMA(a, b, c) fmaf((a), (b), (c))
#define KCM_SQRT(a) sqrtf(a)
#endif

KCM_FN int64_t kcm_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* ---------------------------------------------------------------- row plans */
/* Vectors per lane of the warp-per-row path for rows of n elements of
 * V-element vectors, or 0 when the row does not fit it (alignment is the
 * caller's check). */
KCM_FN int kcm_norm_nv(int64_t n, int V) {
  if (n < 1 || n % V) return 0;
  int64_t nv = kcm_cdiv(n / V, 32);
  return nv <= KCM_NORM_MAXV ? (int)nv : 0;
}
/* Rows per block of the vectorised backward (each block one partial row). */
KCM_FN int64_t kcm_norm_bwd_rows(int64_t m) {
  int64_t P = kcm_cdiv(m, KCM_NORM_WARPS);
  if (P > KCM_NORM_BWD_BLOCKS) P = KCM_NORM_BWD_BLOCKS;
  if (P < 1) P = 1;
  int64_t R = kcm_cdiv(m, P);
  return R < 1 ? 1 : R;
}
KCM_FN int64_t kcm_norm_bwd_blocks(int64_t m) { return m < 1 ? 1 : kcm_cdiv(m, kcm_norm_bwd_rows(m)); }

/* ---------------------------------------------------------------- column-sum plan */
KCM_FN int64_t kcm_colsum_col_tiles(int64_t n, int V) { return kcm_cdiv(n, 32 * (int64_t)V); }
KCM_FN int64_t kcm_colsum_tile_rows(int64_t rows, int64_t n, int V) {
  int64_t gx = kcm_colsum_col_tiles(n, V);
  int64_t gy = KCM_COLSUM_BLOCKS / gx, cap = rows / KCM_COLSUM_MIN_ROWS;
  if (gy > cap) gy = cap;
  if (gy < 1) gy = 1;
  int64_t rt = kcm_cdiv(rows, gy);
  return rt < 1 ? 1 : rt;
}
KCM_FN int64_t kcm_colsum_row_tiles(int64_t rows, int64_t n, int V) {
  return rows < 1 ? 1 : kcm_cdiv(rows, kcm_colsum_tile_rows(rows, n, V));
}

/* ---------------------------------------------------------------- f32 formulas */
/* Row statistics from the two warp sums: mean = s1 / n (0 for rms); rstd =
 * 1 / sqrt(s2 / n + eps) where s2 sums (v - mean)^2 (kcm_norm_var_term). */
KCM_FN float kcm_norm_mean(float s1, int64_t n) { return KCM_DIV(s1, (float)n); }
KCM_FN float kcm_norm_var_term(float acc, float v, float mean) {
  float d = KCM_SUB(v, mean);
  return KCM_FMA(d, d, acc);
}
KCM_FN float kcm_norm_rstd(float s2, int64_t n, float eps) {
  return KCM_DIV(1.0f, KCM_SQRT(KCM_ADD(KCM_DIV(s2, (float)n), eps)));
}
/* y = ((v - mean) rstd) w + b (has_w / has_b: whether w / b apply). */
KCM_FN float kcm_norm_y(float v, float mean, float rstd, int has_w, float w, int has_b, float b) {
  float t = KCM_MUL(KCM_SUB(v, mean), rstd);
  if (has_w) t = KCM_MUL(t, w);
  if (has_b) t = KCM_ADD(t, b);
  return t;
}
KCM_FN float kcm_norm_xhat(float x, float mean, float rstd) { return KCM_MUL(KCM_SUB(x, mean), rstd); }
/* dx = rstd ((wdy - a) - xhat c), a = sum(wdy) / n (0 for rms), c = sum(wdy xhat) / n */
KCM_FN float kcm_norm_dx_rn(int rms, float wdy, float xhat, float rstd, float a, float c) {
  float t = rms ? wdy : KCM_SUB(wdy, a);
  return KCM_MUL(rstd, KCM_SUB(t, KCM_MUL(xhat, c)));
}

/* The xor butterfly of a warp sum over 32 lane values, in place (every lane
 * ends with the same sum): for o = 16, 8, 4, 2, 1: v[l] = v[l] + v[l ^ o]. */
KCM_FN void kcm_warp_butterfly(float* v) {
  for (int o = 16; o > 0; o >>= 1) {
    float t[32];
    for (int l = 0; l < 32; l++) t[l] = KCM_ADD(v[l], v[l ^ o]);
    for (int l = 0; l < 32; l++) v[l] = t[l];
  }
}
#endif
