/* colsum.cu: column sums of a contiguous [rows, n] matrix (the bias gradient
 * of linear: the sum of the output gradient over every row) as a 2-D
 * reduction: row tiles x column tiles of 16-byte vector loads, f32 partial
 * rows, then a second small pass over the partials (colsum.cuh,
 * kcuda_norm.cuh).  Fixed partition and order: deterministic. */
#include "colsum.cuh"

namespace {

template <typename T, int V>
int colsum_t(int64_t rows, int64_t n, const void* x, void* dst, int odt, float scale, float* ws, cudaStream_t s) {
  int64_t rt = kcm_colsum_tile_rows(rows, n, V), gy = kcm_colsum_row_tiles(rows, n, V);
  dim3 grid((unsigned)kcm_colsum_col_tiles(n, V), (unsigned)gy);
  colsum_tile<T, V, KCM_COLSUM_TY><<<grid, dim3(32, KCM_COLSUM_TY), 0, s>>>(rows, n, rt, (const T*)x,
                                                                          gy > 1 ? ws : NULL, dst, odt, scale);
  if (gy > 1) colsum_partials_launch(gy, n, ws, dst, odt, scale, s);
  return kcu_launch_status();
}

int vec_ok(const void* p, int64_t n, int V) { return ((uintptr_t)p & 15) == 0 && n % V == 0; }

}  // namespace

extern "C" size_t kcu_colsum_workspace(int64_t rows, int64_t n, int dt) {
  if (rows < 1 || n < 1) return 0;
  int V = dt == KCU_F32 ? 4 : 8;
  int64_t gy = kcm_colsum_row_tiles(rows, n, V);
  int64_t gy1 = kcm_colsum_row_tiles(rows, n, 1); /* the scalar fallback's tiles */
  if (gy1 > gy) gy = gy1;
  return gy > 1 ? (size_t)(gy * n) * sizeof(float) : 0;
}

extern "C" int kcu_colsum(int dt, int64_t rows, int64_t n, const void* x, void* dst, int odt, double scale, void* ws,
                          cudaStream_t s) {
  if (rows < 0 || n < 0 || odt < KCU_F32 || odt > KCU_F16 || !(scale == scale)) return KCU_EARG;
  if (n == 0) return KCU_OK;
  if (!dst) return KCU_EARG;
  if (rows == 0) return kcu_fill(odt, n, dst, 0.0, s);
  if (!x || (kcu_colsum_workspace(rows, n, dt) > 0 && !ws)) return KCU_EARG;
  float sc = (float)scale;
  switch (dt) {
    case KCU_F32:
      return vec_ok(x, n, 4) ? colsum_t<float, 4>(rows, n, x, dst, odt, sc, (float*)ws, s)
                             : colsum_t<float, 1>(rows, n, x, dst, odt, sc, (float*)ws, s);
    case KCU_BF16:
      return vec_ok(x, n, 8) ? colsum_t<kbf16, 8>(rows, n, x, dst, odt, sc, (float*)ws, s)
                             : colsum_t<kbf16, 1>(rows, n, x, dst, odt, sc, (float*)ws, s);
    case KCU_F16:
      return vec_ok(x, n, 8) ? colsum_t<kf16, 8>(rows, n, x, dst, odt, sc, (float*)ws, s)
                             : colsum_t<kf16, 1>(rows, n, x, dst, odt, sc, (float*)ws, s);
    default: return KCU_EARG;
  }
}
