/* inplace.c: fused in-place pointwise updates used by optimizers:
 * addcmul (a += v*b*c), addcdiv (a += v*b/c), lerp (a += v*(b-a)).
 * Strides in BYTES; a, b, c share the dtype (f32 or f64). */
#include "kcpu.h"

#define IROW(T, EXPR)                                                                  \
  do {                                                                                 \
    const T vv = (T)v;                                                                 \
    if (sa == (int64_t)sizeof(T) && sb == (int64_t)sizeof(T) && sc == (int64_t)sizeof(T)) { \
      T* restrict A = (T*)a; const T* restrict B = (const T*)b; const T* restrict Cc = (const T*)c; \
      for (int64_t i = 0; i < n; i++) { T x = A[i], y = B[i], z = Cc[i]; (void)z; A[i] = (EXPR); } \
    } else {                                                                           \
      for (int64_t i = 0; i < n; i++) {                                                \
        T* p = (T*)(a + i * sa);                                                       \
        T x = *p, y = *(const T*)(b + i * sb), z = *(const T*)(c + i * sc); (void)z;    \
        *p = (EXPR);                                                                   \
      }                                                                                \
    }                                                                                  \
  } while (0)

#define IOPS(T)                                                   \
  switch (op) {                                                   \
    case KI_ADDCMUL: IROW(T, x + vv * y * z); break;              \
    case KI_ADDCDIV: IROW(T, x + vv * y / z); break;              \
    default: IROW(T, x + vv * (y - x)); break;                    \
  }

void kc_inplace3_row(int op, int dt, int64_t n, char* a, int64_t sa, const char* b, int64_t sb,
                     const char* c, int64_t sc, double v) {
  if (dt == KC_F32) { IOPS(float); }
  else { IOPS(double); }
}
