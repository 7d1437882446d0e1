/* binary.c: elementwise binary kernels over strided rows.
 * Computed types: f32, f64, i32, i64, u8 (bool/u8 share u8; bf16/f16 are
 * upcast to f32 by the engine before they get here). */
#include "kcpu.h"
#include <math.h>

#define ROW(T, EXPR)                                                                   \
  do {                                                                                 \
    if (so == (int64_t)sizeof(T) && sa == (int64_t)sizeof(T) && sb == (int64_t)sizeof(T)) { \
      T* restrict O = (T*)o; const T* restrict A = (const T*)a; const T* restrict B = (const T*)b; \
      for (int64_t i = 0; i < n; i++) { T x = A[i], y = B[i]; O[i] = (EXPR); }       \
    } else if (so == (int64_t)sizeof(T) && sa == (int64_t)sizeof(T) && sb == 0) {      \
      T* restrict O = (T*)o; const T* restrict A = (const T*)a; const T y = *(const T*)b; \
      for (int64_t i = 0; i < n; i++) { T x = A[i]; O[i] = (EXPR); }                   \
    } else if (so == (int64_t)sizeof(T) && sa == 0 && sb == (int64_t)sizeof(T)) {      \
      T* restrict O = (T*)o; const T x = *(const T*)a; const T* restrict B = (const T*)b; \
      for (int64_t i = 0; i < n; i++) { T y = B[i]; O[i] = (EXPR); }                   \
    } else {                                                                           \
      for (int64_t i = 0; i < n; i++) {                                                \
        T x = *(const T*)(a + i * sa), y = *(const T*)(b + i * sb);                   \
        *(T*)(o + i * so) = (EXPR);                                                    \
      }                                                                                \
    }                                                                                  \
  } while (0)

#define OPS_FLOAT(T, POWF)                                    \
  switch (op) {                                               \
    case KB_ADD: ROW(T, x + y); break;                        \
    case KB_SUB: ROW(T, x - y); break;                        \
    case KB_MUL: ROW(T, x * y); break;                        \
    case KB_DIV: ROW(T, x / y); break;                        \
    case KB_POW: ROW(T, POWF(x, y)); break;                   \
    case KB_MAX: ROW(T, (x != x || x > y) ? x : y); break;    \
    case KB_MIN: ROW(T, (x != x || x < y) ? x : y); break;    \
  }

/* Integers wrap on overflow, as PyTorch's kernels do: the arithmetic is done in the
 * unsigned type U (defined modulo 2^n), then converted back. */
#define OPS_INT(T, U)                                                    \
  switch (op) {                                                          \
    case KB_ADD: ROW(T, (T)((U)x + (U)y)); break;                        \
    case KB_SUB: ROW(T, (T)((U)x - (U)y)); break;                        \
    case KB_MUL: ROW(T, (T)((U)x * (U)y)); break;                        \
    case KB_DIV: ROW(T, (T)(y == 0 ? 0 : ((T)-1 < 0 && y == (T)-1) ? (T)(0 - (U)x) : x / y)); break; \
    case KB_POW: ROW(T, (T)pow((double)x, (double)y)); break; \
    case KB_MAX: ROW(T, x > y ? x : y); break;                \
    case KB_MIN: ROW(T, x < y ? x : y); break;                \
  }

void kc_binary_row(int op, int dt, int64_t n, char* o, int64_t so, const char* a, int64_t sa,
                   const char* b, int64_t sb) {
  switch (dt) {
    case KC_F32: OPS_FLOAT(float, powf); break;
    case KC_F64: OPS_FLOAT(double, pow); break;
    case KC_I32: OPS_INT(int32_t, uint32_t); break;
    case KC_I64: OPS_INT(int64_t, uint64_t); break;
    default: OPS_INT(uint8_t, uint8_t); break;
  }
}
