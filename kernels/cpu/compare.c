/* compare.c: comparison, select (where) and masked-fill kernels over
 * strided rows.  Strides in BYTES. */
#include "kcpu.h"
#include <string.h>

#define CROW(T, EXPR)                                                                  \
  do {                                                                                 \
    if (so == 1 && sa == (int64_t)sizeof(T) && sb == (int64_t)sizeof(T)) {            \
      uint8_t* restrict O = (uint8_t*)o; const T* restrict A = (const T*)a;            \
      const T* restrict B = (const T*)b;                                               \
      for (int64_t i = 0; i < n; i++) { T x = A[i], y = B[i]; O[i] = (EXPR); }        \
    } else if (so == 1 && sa == (int64_t)sizeof(T) && sb == 0) {                       \
      uint8_t* restrict O = (uint8_t*)o; const T* restrict A = (const T*)a;            \
      const T y = *(const T*)b;                                                        \
      for (int64_t i = 0; i < n; i++) { T x = A[i]; O[i] = (EXPR); }                   \
    } else {                                                                           \
      for (int64_t i = 0; i < n; i++) {                                                \
        T x = *(const T*)(a + i * sa), y = *(const T*)(b + i * sb);                   \
        *(uint8_t*)(o + i * so) = (EXPR);                                              \
      }                                                                                \
    }                                                                                  \
  } while (0)

#define CMP_OPS(T)                                   \
  switch (op) {                                      \
    case KCMP_EQ: CROW(T, x == y); break;            \
    case KCMP_NE: CROW(T, x != y); break;            \
    case KCMP_LT: CROW(T, x < y); break;             \
    case KCMP_LE: CROW(T, x <= y); break;            \
    case KCMP_GT: CROW(T, x > y); break;             \
    default: CROW(T, x >= y); break;                 \
  }

void kc_compare_row(int op, int dt, int64_t n, char* o, int64_t so, const char* a, int64_t sa,
                    const char* b, int64_t sb) {
  switch (dt) {
    case KC_F32: CMP_OPS(float); break;
    case KC_F64: CMP_OPS(double); break;
    case KC_I32: CMP_OPS(int32_t); break;
    case KC_I64: CMP_OPS(int64_t); break;
    default: CMP_OPS(uint8_t); break;
  }
}

#define WROW(T)                                                                        \
  do {                                                                                 \
    if (so == (int64_t)sizeof(T) && sc == 1 && sa == (int64_t)sizeof(T) && sb == (int64_t)sizeof(T)) { \
      T* restrict O = (T*)o; const uint8_t* restrict Cc = (const uint8_t*)c;           \
      const T* restrict A = (const T*)a; const T* restrict B = (const T*)b;            \
      for (int64_t i = 0; i < n; i++) O[i] = Cc[i] ? A[i] : B[i];                      \
    } else if (so == (int64_t)sizeof(T) && sc == 1 && sa == (int64_t)sizeof(T) && sb == 0) { \
      T* restrict O = (T*)o; const uint8_t* restrict Cc = (const uint8_t*)c;           \
      const T* restrict A = (const T*)a; const T B = *(const T*)b;                     \
      for (int64_t i = 0; i < n; i++) O[i] = Cc[i] ? A[i] : B;                         \
    } else if (so == (int64_t)sizeof(T) && sc == 1 && sa == 0 && sb == (int64_t)sizeof(T)) { \
      T* restrict O = (T*)o; const uint8_t* restrict Cc = (const uint8_t*)c;           \
      const T A = *(const T*)a; const T* restrict B = (const T*)b;                     \
      for (int64_t i = 0; i < n; i++) O[i] = Cc[i] ? A : B[i];                         \
    } else {                                                                           \
      for (int64_t i = 0; i < n; i++)                                                  \
        *(T*)(o + i * so) = *(const uint8_t*)(c + i * sc) ? *(const T*)(a + i * sa)    \
                                                          : *(const T*)(b + i * sb);   \
    }                                                                                  \
  } while (0)

void kc_where_row(int esz, int64_t n, char* o, int64_t so, const char* c, int64_t sc, const char* a,
                  int64_t sa, const char* b, int64_t sb) {
  switch (esz) {
    case 8: WROW(uint64_t); break;
    case 4: WROW(uint32_t); break;
    case 2: WROW(uint16_t); break;
    default: WROW(uint8_t); break;
  }
}

#define MROW(T)                                                                        \
  do {                                                                                 \
    T v; memcpy(&v, val, sizeof v);                                                    \
    if (so == (int64_t)sizeof(T) && sx == (int64_t)sizeof(T) && sm == 1) {             \
      T* restrict O = (T*)o; const T* restrict X = (const T*)x;                        \
      const uint8_t* restrict M = (const uint8_t*)m;                                   \
      for (int64_t i = 0; i < n; i++) O[i] = M[i] ? v : X[i];                          \
    } else {                                                                           \
      for (int64_t i = 0; i < n; i++)                                                  \
        *(T*)(o + i * so) = *(const uint8_t*)(m + i * sm) ? v : *(const T*)(x + i * sx); \
    }                                                                                  \
  } while (0)

void kc_masked_fill_row(int esz, int64_t n, char* o, int64_t so, const char* x, int64_t sx,
                        const char* m, int64_t sm, const void* val) {
  switch (esz) {
    case 8: MROW(uint64_t); break;
    case 4: MROW(uint32_t); break;
    case 2: MROW(uint16_t); break;
    default: MROW(uint8_t); break;
  }
}
