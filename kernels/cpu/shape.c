/* shape.c: data movement kernels of the shape ops: block copies for cat and
 * stack, row gathers for index_select and the scatter-add of its backward. */
#include "kcpu.h"
#include <string.h>

void kc_cat_blocks(int n, int64_t outer, char* dst, char* const* srcs, const int64_t* blk) {
  for (int64_t o = 0; o < outer; o++) {
    for (int i = 0; i < n; i++) {
      int64_t b = blk[i];
      if (b == 0) continue;
      memcpy(dst, srcs[i] + o * b, (size_t)b);
      dst += b;
    }
  }
}

void kc_index_select(int64_t outer, int64_t src_n, int64_t n_idx, int64_t row_bytes, char* dst,
                     const char* src, const int64_t* idx) {
  if (row_bytes == 0) return;
  for (int64_t o = 0; o < outer; o++) {
    const char* s = src + o * src_n * row_bytes;
    switch (row_bytes) {
      case 4:
        for (int64_t j = 0; j < n_idx; j++) ((uint32_t*)dst)[j] = ((const uint32_t*)s)[idx[j]];
        break;
      case 8:
        for (int64_t j = 0; j < n_idx; j++) ((uint64_t*)dst)[j] = ((const uint64_t*)s)[idx[j]];
        break;
      case 2:
        for (int64_t j = 0; j < n_idx; j++) ((uint16_t*)dst)[j] = ((const uint16_t*)s)[idx[j]];
        break;
      default:
        for (int64_t j = 0; j < n_idx; j++) memcpy(dst + j * row_bytes, s + idx[j] * row_bytes, (size_t)row_bytes);
        break;
    }
    dst += n_idx * row_bytes;
  }
}

void kc_index_add(int dt, int64_t outer, int64_t dst_n, int64_t n_idx, int64_t inner, char* dst,
                  const char* src, const int64_t* idx) {
  for (int64_t o = 0; o < outer; o++) {
    for (int64_t j = 0; j < n_idx; j++) {
      int64_t di = (o * dst_n + idx[j]) * inner, si = (o * n_idx + j) * inner;
      if (dt == KC_F32) {
        float* restrict d = (float*)dst + di;
        const float* restrict s = (const float*)src + si;
        for (int64_t k = 0; k < inner; k++) d[k] += s[k];
      } else if (dt == KC_F64) {
        double* restrict d = (double*)dst + di;
        const double* restrict s = (const double*)src + si;
        for (int64_t k = 0; k < inner; k++) d[k] += s[k];
      } else {
        static const int sz[8] = {4, 8, 2, 2, 4, 8, 1, 1};
        int es = sz[dt];
        for (int64_t k = 0; k < inner; k++) {
          char* d = dst + (di + k) * es;
          kc_store(d, dt, kc_load(d, dt) + kc_load(src + (si + k) * es, dt));
        }
      }
    }
  }
}
