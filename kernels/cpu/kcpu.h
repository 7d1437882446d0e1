/* kcpu.h: CPU compute kernels on raw pointers (no engine types).
 * dtype codes match eng_dtype: 0 f32, 1 f64, 2 bf16, 3 f16, 4 i32, 5 i64,
 * 6 u8, 7 bool.  Strides are in elements. */
#ifndef KCPU_H
#define KCPU_H
#include <stdint.h>
#include "half.h"

enum { KC_F32 = 0, KC_F64, KC_BF16, KC_F16, KC_I32, KC_I64, KC_U8, KC_BOOL };

static inline double kc_load(const void* p, int dt) {
  switch (dt) {
    case KC_F32: return *(const float*)p;
    case KC_F64: return *(const double*)p;
    case KC_BF16: return kc_bf16_to_f32(*(const uint16_t*)p);
    case KC_F16: return kc_f16_to_f32(*(const uint16_t*)p);
    case KC_I32: return *(const int32_t*)p;
    case KC_I64: return (double)*(const int64_t*)p;
    case KC_U8: return *(const uint8_t*)p;
    default: return *(const uint8_t*)p ? 1.0 : 0.0;
  }
}
static inline void kc_store(void* p, int dt, double v) {
  switch (dt) {
    case KC_F32: *(float*)p = (float)v; break;
    case KC_F64: *(double*)p = v; break;
    case KC_BF16: *(uint16_t*)p = kc_f32_to_bf16((float)v); break;
    case KC_F16: *(uint16_t*)p = kc_f32_to_f16((float)v); break;
    case KC_I32: *(int32_t*)p = (int32_t)v; break;
    case KC_I64: *(int64_t*)p = (int64_t)v; break;
    case KC_U8: *(uint8_t*)p = (uint8_t)(int64_t)v; break;
    default: *(uint8_t*)p = v != 0.0; break;
  }
}

/* Strided N-d copy with conversion: dst[idx] = (dst_dt) src[idx]. */
void kc_copy(int ndim, const int64_t* shape, void* dst, int ddt, const int64_t* dstride,
             const void* src, int sdt, const int64_t* sstride);
/* Contiguous conversions. */
void kc_convert(int64_t n, void* dst, int ddt, const void* src, int sdt);
void kc_fill(int64_t n, void* dst, int dt, double v);

/* Iterate an N-d index space over k operands; calls fn once per innermost
 * row with the row's base pointers and inner strides (bytes).  Dims are
 * coalesced where all operands allow.  esz: element size of each operand. */
typedef void (*kc_row_fn)(int64_t n, char** ptrs, const int64_t* inner_strides, void* ctx);
void kc_foreach(int ndim, const int64_t* shape, int k, char** base, const int64_t* const* strides,
                const int* esz, kc_row_fn fn, void* ctx);


/* binary.c */
enum { KB_ADD = 0, KB_SUB, KB_MUL, KB_DIV, KB_POW, KB_MAX, KB_MIN };
/* o[i] = a[i] op b[i] over a row of n elements; strides in BYTES. */
void kc_binary_row(int op, int dt, int64_t n, char* o, int64_t so, const char* a, int64_t sa,
                   const char* b, int64_t sb);
#endif
