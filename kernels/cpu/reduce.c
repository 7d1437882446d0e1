/* reduce.c: sum and arg-extreme kernels over strided rows (strides in bytes).
 * Floating sums accumulate in double (f32/bf16/f16 inputs) and pairwise
 * within a row, so an f32 sum of millions of elements keeps full f32
 * accuracy; integer sums accumulate in int64. */
#include "kcpu.h"
#include <math.h>

/* Pairwise sum of a contiguous double row. */
static double psum_f64(const double* x, int64_t n) {
  if (n <= 256) {
    double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      for (int k = 0; k < 8; k++) s[k] += x[i + k];
    double r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; i < n; i++) r += x[i];
    return r;
  }
  int64_t h = (n / 2 + 7) & ~(int64_t)7;
  return psum_f64(x, h) + psum_f64(x + h, n - h);
}

/* f32 row into double: 16 double accumulators per block, pairwise across
 * blocks (relative error ~1e-16 * log n, far below f32 rounding). */
static double psum_f32(const float* x, int64_t n) {
  if (n <= 1024) {
    double s[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      for (int k = 0; k < 16; k++) s[k] += (double)x[i + k];
    double r = 0;
    for (int k = 0; k < 16; k++) r += s[k];
    for (; i < n; i++) r += x[i];
    return r;
  }
  int64_t h = (n / 2 + 15) & ~(int64_t)15;
  return psum_f32(x, h) + psum_f32(x + h, n - h);
}

static double psum_strided(const char* x, int64_t sx, int dt, int64_t n) {
  if (n <= 64) {
    double r = 0;
    for (int64_t i = 0; i < n; i++) r += kc_load(x + i * sx, dt);
    return r;
  }
  int64_t h = n / 2;
  return psum_strided(x, sx, dt, h) + psum_strided(x + h * sx, sx, dt, n - h);
}

/* Integer sums wrap modulo 2^64 (PyTorch's int64 accumulation): unsigned arithmetic. */
static int64_t isum(const char* x, int64_t sx, int dt, int64_t n) {
  uint64_t r = 0;
  switch (dt) {
    case KC_I32: for (int64_t i = 0; i < n; i++) r += (uint64_t)(int64_t)*(const int32_t*)(x + i * sx); break;
    case KC_I64: for (int64_t i = 0; i < n; i++) r += (uint64_t)*(const int64_t*)(x + i * sx); break;
    case KC_U8: for (int64_t i = 0; i < n; i++) r += *(const uint8_t*)(x + i * sx); break;
    default: for (int64_t i = 0; i < n; i++) r += *(const uint8_t*)(x + i * sx) != 0; break;
  }
  return (int64_t)r;
}
static void iadd(int64_t* acc, int64_t v) { *acc = (int64_t)((uint64_t)*acc + (uint64_t)v); }

void kc_sum_row(int dt, int64_t n, char* acc, int64_t sacc, const char* x, int64_t sx) {
  int floating = dt == KC_F32 || dt == KC_F64 || dt == KC_BF16 || dt == KC_F16;
  if (sacc == 0) {
    if (!floating) { iadd((int64_t*)acc, isum(x, sx, dt, n)); return; }
    double s;
    if (dt == KC_F32 && sx == 4) s = psum_f32((const float*)x, n);
    else if (dt == KC_F64 && sx == 8) s = psum_f64((const double*)x, n);
    else s = psum_strided(x, sx, dt, n);
    *(double*)acc += s;
    return;
  }
  if (!floating) {
    for (int64_t i = 0; i < n; i++) {
      int64_t* A = (int64_t*)(acc + i * sacc);
      switch (dt) {
        case KC_I32: iadd(A, *(const int32_t*)(x + i * sx)); break;
        case KC_I64: iadd(A, *(const int64_t*)(x + i * sx)); break;
        case KC_U8: iadd(A, *(const uint8_t*)(x + i * sx)); break;
        default: iadd(A, *(const uint8_t*)(x + i * sx) != 0); break;
      }
    }
    return;
  }
  if (sacc == 8 && dt == KC_F32 && sx == 4) {
    double* restrict A = (double*)acc; const float* restrict X = (const float*)x;
    for (int64_t i = 0; i < n; i++) A[i] += (double)X[i];
    return;
  }
  if (sacc == 8 && dt == KC_F64 && sx == 8) {
    double* restrict A = (double*)acc; const double* restrict X = (const double*)x;
    for (int64_t i = 0; i < n; i++) A[i] += X[i];
    return;
  }
  for (int64_t i = 0; i < n; i++) *(double*)(acc + i * sacc) += kc_load(x + i * sx, dt);
}

/* ---------------------------------------------------------------- arg-extremes */
#define SCAN_F(T, LOAD)                                                        \
  do {                                                                         \
    T best = LOAD(x);                                                          \
    if (best != best) return 0;                                                \
    for (int64_t i = 1; i < n; i++) {                                          \
      T v = LOAD(x + i * sx);                                                  \
      if (v != v) return i;                                                    \
      if (is_max ? v > best : v < best) { best = v; bi = i; }                  \
    }                                                                          \
  } while (0)

#define SCAN_I(T)                                                              \
  do {                                                                         \
    T best = *(const T*)x;                                                     \
    if (is_max) {                                                              \
      for (int64_t i = 1; i < n; i++) {                                        \
        T v = *(const T*)(x + i * sx);                                         \
        if (v > best) { best = v; bi = i; }                                    \
      }                                                                        \
    } else {                                                                   \
      for (int64_t i = 1; i < n; i++) {                                        \
        T v = *(const T*)(x + i * sx);                                         \
        if (v < best) { best = v; bi = i; }                                    \
      }                                                                        \
    }                                                                          \
  } while (0)

#define LD_F32(p) (*(const float*)(p))
#define LD_F64(p) (*(const double*)(p))
#define LD_BF16(p) kc_bf16_to_f32(*(const uint16_t*)(p))
#define LD_F16(p) kc_f16_to_f32(*(const uint16_t*)(p))

int64_t kc_argext_row(int dt, int is_max, int64_t n, const char* x, int64_t sx) {
  int64_t bi = 0;
  if (n <= 0) return 0;
  switch (dt) {
    case KC_F32: SCAN_F(float, LD_F32); break;
    case KC_F64: SCAN_F(double, LD_F64); break;
    case KC_BF16: SCAN_F(float, LD_BF16); break;
    case KC_F16: SCAN_F(float, LD_F16); break;
    case KC_I32: SCAN_I(int32_t); break;
    case KC_I64: SCAN_I(int64_t); break;
    case KC_U8: SCAN_I(uint8_t); break;
    default: { /* bool: any nonzero byte is true */
      int best = *(const uint8_t*)x != 0;
      for (int64_t i = 1; i < n; i++) {
        int v = *(const uint8_t*)(x + i * sx) != 0;
        if (is_max ? v > best : v < best) { best = v; bi = i; }
      }
      break;
    }
  }
  return bi;
}

/* Column-wise arg-extremes of a contiguous [len, inner] block: vals (dt,
 * contiguous [inner]) and idx (int64 [inner]) get the first extreme of each
 * column (a NaN wins, the first one).  Row by row, so memory is read in order. */
#define COLS(T, ES, LOAD, STORE, ISNAN)                                              \
  do {                                                                           \
    for (int64_t j = 0; j < inner; j++) { STORE(vals, j, LOAD(x, j)); idx[j] = 0; } \
    for (int64_t k = 1; k < len; k++) {                                          \
      const char* row = x + k * inner * (int64_t)(ES);                           \
      for (int64_t j = 0; j < inner; j++) {                                      \
        T v = LOAD(row, j), b = LOAD(vals, j);                                   \
        int take = (is_max ? v > b : v < b) || (ISNAN(v) && !ISNAN(b));         \
        STORE(vals, j, take ? v : b);                                            \
        idx[j] = take ? k : idx[j];                                              \
      }                                                                          \
    }                                                                            \
  } while (0)

#define L_F32(p, j) (((const float*)(p))[j])
#define S_F32(p, j, v) (((float*)(p))[j] = (v))
#define L_F64(p, j) (((const double*)(p))[j])
#define S_F64(p, j, v) (((double*)(p))[j] = (v))
#define L_I32(p, j) (((const int32_t*)(p))[j])
#define S_I32(p, j, v) (((int32_t*)(p))[j] = (v))
#define L_I64(p, j) (((const int64_t*)(p))[j])
#define S_I64(p, j, v) (((int64_t*)(p))[j] = (v))
#define L_U8(p, j) (((const uint8_t*)(p))[j])
#define S_U8(p, j, v) (((uint8_t*)(p))[j] = (v))
#define L_B(p, j) ((uint8_t)(((const uint8_t*)(p))[j] != 0))
#define L_BF(p, j) kc_bf16_to_f32(((const uint16_t*)(p))[j])
#define S_BF(p, j, v) (((uint16_t*)(p))[j] = kc_f32_to_bf16(v))
#define L_HF(p, j) kc_f16_to_f32(((const uint16_t*)(p))[j])
#define S_HF(p, j, v) (((uint16_t*)(p))[j] = kc_f32_to_f16(v))
#define FNAN(v) ((v) != (v))
#define NONAN(v) 0

void kc_argext_cols(int dt, int is_max, int64_t len, int64_t inner, const char* x, char* vals, int64_t* idx) {
  if (len <= 0 || inner <= 0) return;
  switch (dt) {
    case KC_F32: COLS(float, 4, L_F32, S_F32, FNAN); break;
    case KC_F64: COLS(double, 8, L_F64, S_F64, FNAN); break;
    case KC_I32: COLS(int32_t, 4, L_I32, S_I32, NONAN); break;
    case KC_I64: COLS(int64_t, 8, L_I64, S_I64, NONAN); break;
    case KC_U8: COLS(uint8_t, 1, L_U8, S_U8, NONAN); break;
    case KC_BOOL: COLS(uint8_t, 1, L_B, S_U8, NONAN); break;
    case KC_BF16: COLS(float, 2, L_BF, S_BF, FNAN); break;
    default: COLS(float, 2, L_HF, S_HF, FNAN); break;
  }
}
