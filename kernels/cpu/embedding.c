/* embedding.c: row gather (forward) and row scatter-add (backward) of an
 * embedding table.  Indices are already validated by the engine. */
#include "kcpu.h"
#include <string.h>

static inline int64_t idx_at(const void* idx, int idt, int64_t i) {
  return idt == KC_I32 ? (int64_t)((const int32_t*)idx)[i] : ((const int64_t*)idx)[i];
}

/* Split over the pool once the rows moved reach EMB_PAR_BYTES: GPT-2's 8192 x 768 f32 rows (24 MiB) gathered in 2.0-2.2
 * ms instead of 3.0-3.6 and scattered back in 4.9-5.1 instead of 5.6-7.2 (two threads); at the reference GPT's 1 MiB
 * the split scatter ran slower and less steadily (32-220 against 27-38 us), so smaller ones stay serial. */
#define EMB_PAR_BYTES ((int64_t)1 << 21)

typedef struct { const void* idx; int idt; const char* w; int64_t row_bytes; char* out; } gather_job;

static void gather_part(void* vj, int64_t lo, int64_t hi) {
  const gather_job* j = vj;
  for (int64_t i = lo; i < hi; i++)
    memcpy(j->out + i * j->row_bytes, j->w + idx_at(j->idx, j->idt, i) * j->row_bytes, (size_t)j->row_bytes);
}

void kc_embedding_gather(int64_t n_idx, const void* idx, int idt, const char* w, int64_t row_bytes,
                         char* out) {
  gather_job j = {idx, idt, w, row_bytes, out};
  if (n_idx * row_bytes < EMB_PAR_BYTES || row_bytes <= 0) { gather_part(&j, 0, n_idx); return; }
  int64_t grain = 16384 / row_bytes;
  kc_parallel_for(n_idx, grain > 1 ? grain : 1, gather_part, &j);
}

/* Backward: gw[idx[i], :] += go[i, :] in the order of i.  Split over the pool by ranges of columns (every part
 * walks all the rows in order over its own columns), so repeated indices never race and each element's sum keeps
 * the serial order: the same bits whatever the thread count. */
typedef struct { int dt; int64_t n_idx; const void* idx; int idt; const char* go; int64_t dim, pad; char* gw; } scatter_job;

#define SCATTER_COLS 64 /* columns per unit of work */

static void scatter_part(void* vj, int64_t lo, int64_t hi) {
  const scatter_job* j = vj;
  int64_t c0 = lo * SCATTER_COLS, c1 = hi * SCATTER_COLS < j->dim ? hi * SCATTER_COLS : j->dim;
  for (int64_t i = 0; i < j->n_idx; i++) {
    int64_t k = idx_at(j->idx, j->idt, i);
    if (k == j->pad) continue;
    if (j->dt == KC_F64) {
      double* restrict d = (double*)j->gw + k * j->dim;
      const double* restrict s = (const double*)j->go + i * j->dim;
      for (int64_t c = c0; c < c1; c++) d[c] += s[c];
    } else {
      float* restrict d = (float*)j->gw + k * j->dim;
      const float* restrict s = (const float*)j->go + i * j->dim;
      for (int64_t c = c0; c < c1; c++) d[c] += s[c];
    }
  }
}

void kc_embedding_scatter_add(int dt, int64_t n_idx, const void* idx, int idt, const char* go,
                              int64_t dim, int64_t pad, char* gw) {
  scatter_job j = {dt, n_idx, idx, idt, go, dim, pad, gw};
  int64_t units = (dim + SCATTER_COLS - 1) / SCATTER_COLS;
  int64_t es = dt == KC_F64 ? 8 : 4, t = kc_get_threads();
  if (units < 2 || t < 2 || n_idx * dim * es < EMB_PAR_BYTES) { scatter_part(&j, 0, units); return; }
  kc_parallel_for(units, (units + t - 1) / t, scatter_part, &j); /* one contiguous range of columns a thread */
}
