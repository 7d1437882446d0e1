/* copy.c: strided copies, conversions, fills and the N-d row iterator. */
#include "kcpu.h"
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#define KMAX 8

/* Drops size-1 dims and coalesces adjacent dims (outer d-1, inner d) where
 * stride[d-1] == stride[d] * shape[d] for every operand; byte strides.
 * Returns the dim count (0: a single element), -1 if the space is empty. */
static int coalesce(int ndim, const int64_t* shape, int k, const int64_t* const* strides, const int* esz,
                    int64_t* sh, int64_t (*st)[KMAX]) {
  /* an empty space first: the strides of an empty tensor's other dims may be huge (max(size, 1) products),
   * so scaling them to bytes before seeing the zero could overflow (found by fuzz_safetensors) */
  for (int d = 0; d < ndim; d++) if (shape[d] == 0) return -1;
  int nd = 0;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] == 1) continue;
    sh[nd] = shape[d];
    for (int j = 0; j < k; j++) st[j][nd] = strides[j][d] * esz[j];
    nd++;
  }
  int m = 0;
  for (int d = 0; d < nd; d++) {
    if (m > 0) {
      int ok = 1;
      for (int j = 0; j < k; j++) if (st[j][m - 1] != st[j][d] * sh[d]) { ok = 0; break; }
      if (ok) { sh[m - 1] *= sh[d]; for (int j = 0; j < k; j++) st[j][m - 1] = st[j][d]; continue; }
    }
    sh[m] = sh[d];
    for (int j = 0; j < k; j++) st[j][m] = st[j][d];
    m++;
  }
  return m;
}

/* Calls fn on the rows r0 <= r < r1 of the coalesced space (m >= 1 dims; a
 * row is the innermost dim). */
static void rows_run(int m, const int64_t* sh, int k, char* const* base, int64_t (*st)[KMAX], int64_t r0,
                     int64_t r1, kc_row_fn fn, void* ctx) {
  int64_t inner = sh[m - 1], istr[4];
  for (int j = 0; j < k; j++) istr[j] = st[j][m - 1];
  int64_t idx[KMAX] = {0}, rem = r0;
  for (int d = m - 2; d >= 0; d--) { idx[d] = rem % sh[d]; rem /= sh[d]; }
  char* p[4];
  for (int64_t r = r0; r < r1; r++) {
    for (int j = 0; j < k; j++) {
      p[j] = base[j];
      for (int d = 0; d < m - 1; d++) p[j] += idx[d] * st[j][d];
    }
    fn(inner, p, istr, ctx);
    for (int d = m - 2; d >= 0; d--) { if (++idx[d] < sh[d]) break; idx[d] = 0; }
  }
}

void kc_foreach(int ndim, const int64_t* shape, int k, char** base, const int64_t* const* strides,
                const int* esz, kc_row_fn fn, void* ctx) {
  int64_t sh[KMAX], st[4][KMAX]; /* byte strides, up to 4 operands */
  int m = coalesce(ndim, shape, k, strides, esz, sh, st);
  if (m < 0) return;
  if (m == 0) { /* a single element */
    int64_t z[4] = {0, 0, 0, 0};
    fn(1, base, z, ctx);
    return;
  }
  int64_t rows = 1;
  for (int d = 0; d < m - 1; d++) rows *= sh[d];
  rows_run(m, sh, k, base, st, 0, rows, fn, ctx);
}

/* ------------------------------------------------------------ parallel */
/* Elements per chunk of a parallel elementwise loop. */
#define PAR_GRAIN 16384

typedef struct {
  int m, k;
  const int64_t* sh;
  int64_t (*st)[KMAX];
  char* const* base;
  int64_t inner; /* > 0: split one row by elements */
  kc_row_fn fn;
  void* ctx;
} par_ctx;

static void par_part(void* vc, int64_t lo, int64_t hi) {
  par_ctx* c = vc;
  if (c->inner > 0) {
    char* p[4];
    int64_t istr[4];
    for (int j = 0; j < c->k; j++) { istr[j] = c->st[j][0]; p[j] = c->base[j] + lo * istr[j]; }
    c->fn(hi - lo, p, istr, c->ctx);
  } else {
    rows_run(c->m, c->sh, c->k, c->base, c->st, lo, hi, c->fn, c->ctx);
  }
}

void kc_foreach_par(int ndim, const int64_t* shape, int k, char** base, const int64_t* const* strides,
                    const int* esz, kc_row_fn fn, void* ctx) {
  int64_t sh[KMAX], st[4][KMAX];
  int m = coalesce(ndim, shape, k, strides, esz, sh, st);
  if (m < 0) return;
  int64_t total = 1;
  for (int d = 0; d < m; d++) total *= sh[d];
  if (m == 0 || total < 2 * PAR_GRAIN || kc_get_threads() < 2) {
    kc_foreach(ndim, shape, k, base, strides, esz, fn, ctx);
    return;
  }
  par_ctx c = {m, k, sh, st, base, 0, fn, ctx};
  if (m == 1) { c.inner = sh[0]; kc_parallel_for(sh[0], PAR_GRAIN, par_part, &c); return; }
  int64_t rows = total / sh[m - 1], per = PAR_GRAIN / sh[m - 1];
  kc_parallel_for(rows, per > 1 ? per : 1, par_part, &c);
}

static const int kc_size[8] = {4, 8, 2, 2, 4, 8, 1, 1};

typedef struct { int ddt, sdt; } cpy_ctx;

static void copy_row(int64_t n, char** p, const int64_t* s, void* vctx) {
  cpy_ctx* c = vctx;
  char *d = p[0]; const char* x = p[1];
  int64_t sd = s[0], sx = s[1];
  if (c->ddt == c->sdt) {
    int es = kc_size[c->ddt];
    if (sd == es && sx == es) { memcpy(d, x, (size_t)(n * es)); return; }
    switch (es) {
      case 4: for (int64_t i = 0; i < n; i++) *(uint32_t*)(d + i * sd) = *(const uint32_t*)(x + i * sx); return;
      case 8: for (int64_t i = 0; i < n; i++) *(uint64_t*)(d + i * sd) = *(const uint64_t*)(x + i * sx); return;
      case 2: for (int64_t i = 0; i < n; i++) *(uint16_t*)(d + i * sd) = *(const uint16_t*)(x + i * sx); return;
      default: for (int64_t i = 0; i < n; i++) d[i * sd] = x[i * sx]; return;
    }
  }
  if (c->ddt == KC_F32 && c->sdt == KC_BF16) {
    for (int64_t i = 0; i < n; i++) *(float*)(d + i * sd) = kc_bf16_to_f32(*(const uint16_t*)(x + i * sx));
    return;
  }
  if (c->ddt == KC_BF16 && c->sdt == KC_F32) {
    for (int64_t i = 0; i < n; i++) *(uint16_t*)(d + i * sd) = kc_f32_to_bf16(*(const float*)(x + i * sx));
    return;
  }
  if (c->ddt == KC_F64 && c->sdt == KC_F32) {
    for (int64_t i = 0; i < n; i++) *(double*)(d + i * sd) = *(const float*)(x + i * sx);
    return;
  }
  if (c->ddt == KC_F32 && c->sdt == KC_F64) {
    for (int64_t i = 0; i < n; i++) *(float*)(d + i * sd) = (float)*(const double*)(x + i * sx);
    return;
  }
  if (c->ddt == KC_BOOL) {
    for (int64_t i = 0; i < n; i++) *(uint8_t*)(d + i * sd) = kc_load(x + i * sx, c->sdt) != 0.0;
    return;
  }
  for (int64_t i = 0; i < n; i++) kc_store(d + i * sd, c->ddt, kc_load(x + i * sx, c->sdt));
}

void kc_copy(int ndim, const int64_t* shape, void* dst, int ddt, const int64_t* dstride,
             const void* src, int sdt, const int64_t* sstride) {
  cpy_ctx c = {ddt, sdt};
  char* base[2] = {(char*)dst, (char*)src};
  const int64_t* strides[2] = {dstride, sstride};
  int esz[2] = {kc_size[ddt], kc_size[sdt]};
  kc_foreach_par(ndim, shape, 2, base, strides, esz, copy_row, &c);
}

void kc_convert(int64_t n, void* dst, int ddt, const void* src, int sdt) {
  int64_t one = 1;
  kc_copy(1, &n, dst, ddt, &one, src, sdt, &one);
}

void kc_fill(int64_t n, void* dst, int dt, double v) {
  if (v == 0.0 && dt != KC_BF16 && dt != KC_F16) { memset(dst, 0, (size_t)(n * kc_size[dt])); return; }
  char tmp[8];
  kc_store(tmp, dt, v);
  int es = kc_size[dt];
  char* d = dst;
  switch (es) {
    case 4: { uint32_t x; memcpy(&x, tmp, 4); for (int64_t i = 0; i < n; i++) ((uint32_t*)d)[i] = x; break; }
    case 8: { uint64_t x; memcpy(&x, tmp, 8); for (int64_t i = 0; i < n; i++) ((uint64_t*)d)[i] = x; break; }
    case 2: { uint16_t x; memcpy(&x, tmp, 2); for (int64_t i = 0; i < n; i++) ((uint16_t*)d)[i] = x; break; }
    default: memset(d, tmp[0], (size_t)n); break;
  }
}

void kc_copy_stream(void* dst, const void* src, size_t n) {
  char* d = dst;
  const char* s = src;
#if defined(__SSE2__)
  if (n >= ((size_t)256 << 10)) {
    size_t head = (size_t)(-(uintptr_t)d & 31); /* the stores need an aligned destination */
    memcpy(d, s, head);
    d += head; s += head; n -= head;
    size_t body = n & ~(size_t)127;
#if defined(__AVX__)
    for (size_t i = 0; i < body; i += 128) {
      __m256i a = _mm256_loadu_si256((const __m256i*)(s + i));
      __m256i b = _mm256_loadu_si256((const __m256i*)(s + i + 32));
      __m256i c = _mm256_loadu_si256((const __m256i*)(s + i + 64));
      __m256i e = _mm256_loadu_si256((const __m256i*)(s + i + 96));
      _mm256_stream_si256((__m256i*)(d + i), a);
      _mm256_stream_si256((__m256i*)(d + i + 32), b);
      _mm256_stream_si256((__m256i*)(d + i + 64), c);
      _mm256_stream_si256((__m256i*)(d + i + 96), e);
    }
#else
    for (size_t i = 0; i < body; i += 64) {
      __m128i a = _mm_loadu_si128((const __m128i*)(s + i));
      __m128i b = _mm_loadu_si128((const __m128i*)(s + i + 16));
      __m128i c = _mm_loadu_si128((const __m128i*)(s + i + 32));
      __m128i e = _mm_loadu_si128((const __m128i*)(s + i + 48));
      _mm_stream_si128((__m128i*)(d + i), a);
      _mm_stream_si128((__m128i*)(d + i + 16), b);
      _mm_stream_si128((__m128i*)(d + i + 32), c);
      _mm_stream_si128((__m128i*)(d + i + 48), e);
    }
#endif
    _mm_sfence(); /* the streamed stores are visible before anything that follows (the writer thread's reads) */
    d += body; s += body; n -= body;
  }
#endif
  memcpy(d, s, n);
}
