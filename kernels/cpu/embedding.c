/* embedding.c: row gather (forward) and row scatter-add (backward) of an
 * embedding table.  Indices are already validated by the engine. */
#include "kcpu.h"
#include <string.h>

static inline int64_t idx_at(const void* idx, int idt, int64_t i) {
  return idt == KC_I32 ? (int64_t)((const int32_t*)idx)[i] : ((const int64_t*)idx)[i];
}

void kc_embedding_gather(int64_t n_idx, const void* idx, int idt, const char* w, int64_t row_bytes,
                         char* out) {
  for (int64_t i = 0; i < n_idx; i++)
    memcpy(out + i * row_bytes, w + idx_at(idx, idt, i) * row_bytes, (size_t)row_bytes);
}

void kc_embedding_scatter_add(int dt, int64_t n_idx, const void* idx, int idt, const char* go,
                              int64_t dim, int64_t pad, char* gw) {
  for (int64_t i = 0; i < n_idx; i++) {
    int64_t k = idx_at(idx, idt, i);
    if (k == pad) continue;
    if (dt == KC_F64) {
      double* restrict d = (double*)gw + k * dim;
      const double* restrict s = (const double*)go + i * dim;
      for (int64_t j = 0; j < dim; j++) d[j] += s[j];
    } else {
      float* restrict d = (float*)gw + k * dim;
      const float* restrict s = (const float*)go + i * dim;
      for (int64_t j = 0; j < dim; j++) d[j] += s[j];
    }
  }
}
