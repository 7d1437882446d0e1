/* index.c: CPU kernels of the indexing ops: gather/scatter along a dim
 * (torch.gather / Tensor.scatter(_add)), row puts of index_add/index_copy,
 * nonzero.  Copies move bytes (exact for every dtype); additions work in the
 * element's own type (integers exactly, bf16/f16 through f32). */
#include "kindex.h"
#include "kcpu.h"
#include <string.h>

static void contig_strides(int ndim, const int64_t* shape, int64_t* st) {
  int64_t s = 1;
  for (int k = ndim - 1; k >= 0; k--) { st[k] = s; s *= shape[k]; }
}

static int64_t numel(int ndim, const int64_t* shape) {
  int64_t n = 1;
  for (int k = 0; k < ndim; k++) n *= shape[k];
  return n;
}

/* *d (+)= alpha * *s for one element of dtype dt */
static inline void put1(int dt, int accumulate, double alpha, char* d, const char* s) {
  if (!accumulate) {
    if (alpha == 1.0) {
      static const int sz[8] = {4, 8, 2, 2, 4, 8, 1, 1};
      memcpy(d, s, (size_t)sz[dt]);
    } else {
      kc_store(d, dt, alpha * kc_load(s, dt));
    }
    return;
  }
  switch (dt) {
    case KC_F32: *(float*)d += (float)(alpha * *(const float*)s); break;
    case KC_F64: *(double*)d += alpha * *(const double*)s; break;
    case KC_I32: *(int32_t*)d += (int32_t)((int64_t)alpha * *(const int32_t*)s); break;
    case KC_I64: *(int64_t*)d += (int64_t)alpha * *(const int64_t*)s; break;
    case KC_U8: *(uint8_t*)d = (uint8_t)(*(uint8_t*)d + (int64_t)alpha * *(const uint8_t*)s); break;
    case KC_BOOL: *(uint8_t*)d = (*(uint8_t*)d || (alpha != 0 && *(const uint8_t*)s)) ? 1 : 0; break;
    default: kc_store(d, dt, kc_load(d, dt) + alpha * kc_load(s, dt)); break;
  }
}

void kc_gather(int es, int ndim, const int64_t* ishape, const int64_t* xshape, int d, char* out, const char* x,
               const int64_t* idx) {
  int64_t n = numel(ndim, ishape), xs[8], c[8] = {0}, base = 0;
  if (n == 0) return;
  contig_strides(ndim, xshape, xs);
  for (int64_t p = 0; p < n; p++) {
    memcpy(out + p * es, x + (base + idx[p] * xs[d]) * es, (size_t)es);
    for (int k = ndim - 1; k >= 0; k--) {
      c[k]++;
      if (k != d) base += xs[k];
      if (c[k] < ishape[k]) break;
      if (k != d) base -= c[k] * xs[k];
      c[k] = 0;
    }
  }
}

void kc_scatter(int dt, int accumulate, int ndim, const int64_t* ishape, const int64_t* dshape, int d, char* dst,
                const char* src, const int64_t* idx) {
  static const int sz[8] = {4, 8, 2, 2, 4, 8, 1, 1};
  int es = sz[dt];
  int64_t n = numel(ndim, ishape), ds[8], c[8] = {0}, base = 0;
  if (n == 0) return;
  contig_strides(ndim, dshape, ds);
  for (int64_t p = 0; p < n; p++) {
    put1(dt, accumulate, 1.0, dst + (base + idx[p] * ds[d]) * es, src + p * es);
    for (int k = ndim - 1; k >= 0; k--) {
      c[k]++;
      if (k != d) base += ds[k];
      if (c[k] < ishape[k]) break;
      if (k != d) base -= c[k] * ds[k];
      c[k] = 0;
    }
  }
}

void kc_index_put(int dt, int accumulate, double alpha, int64_t outer, int64_t dst_n, int64_t n_idx, int64_t inner,
                  char* dst, const char* src, const int64_t* idx) {
  static const int sz[8] = {4, 8, 2, 2, 4, 8, 1, 1};
  int es = sz[dt];
  for (int64_t o = 0; o < outer; o++)
    for (int64_t j = 0; j < n_idx; j++) {
      char* d = dst + (o * dst_n + idx[j]) * inner * es;
      const char* s = src + (o * n_idx + j) * inner * es;
      if (!accumulate && alpha == 1.0) { memcpy(d, s, (size_t)(inner * es)); continue; }
      if (accumulate && dt == KC_F32 && alpha == 1.0) {
        float* restrict df = (float*)d;
        const float* restrict sf = (const float*)s;
        for (int64_t k = 0; k < inner; k++) df[k] += sf[k];
        continue;
      }
      for (int64_t k = 0; k < inner; k++) put1(dt, accumulate, alpha, d + k * es, s + k * es);
    }
}

static inline int nz(int dt, const char* p) {
  switch (dt) {
    case KC_F32: return *(const float*)p != 0.0f;
    case KC_F64: return *(const double*)p != 0.0;
    case KC_I32: return *(const int32_t*)p != 0;
    case KC_I64: return *(const int64_t*)p != 0;
    case KC_U8: case KC_BOOL: return *(const uint8_t*)p != 0;
    default: return kc_load(p, dt) != 0.0; /* NaN counts as nonzero, as in PyTorch */
  }
}

int64_t kc_count_nonzero(int dt, int64_t n, const char* x) {
  static const int sz[8] = {4, 8, 2, 2, 4, 8, 1, 1};
  int64_t c = 0;
  for (int64_t i = 0; i < n; i++) c += nz(dt, x + i * sz[dt]);
  return c;
}

void kc_nonzero(int dt, int ndim, const int64_t* shape, const char* x, int64_t* out) {
  static const int sz[8] = {4, 8, 2, 2, 4, 8, 1, 1};
  int64_t n = numel(ndim, shape), c[8] = {0};
  for (int64_t i = 0; i < n; i++) {
    if (nz(dt, x + i * sz[dt])) {
      for (int k = 0; k < ndim; k++) out[k] = c[k];
      out += ndim;
    }
    for (int k = ndim - 1; k >= 0; k--) {
      if (++c[k] < shape[k]) break;
      c[k] = 0;
    }
  }
}
