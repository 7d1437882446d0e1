/* dtype.c: dtype names, sizes and promotion. */
#include "core/internal.h"
#include <strings.h>

static const struct { const char* name; int size; int floating; } g_dt[ENG_NUM_DTYPES] = {
  {"f32", 4, 1}, {"f64", 8, 1}, {"bf16", 2, 1}, {"f16", 2, 1},
  {"i32", 4, 0}, {"i64", 8, 0}, {"u8", 1, 0}, {"bool", 1, 0},
};

static int valid(int d) { return d >= 0 && d < ENG_NUM_DTYPES; }
const char* eng_dtype_name(int d) { return valid(d) ? g_dt[d].name : "?"; }
int eng_dtype_size(int d) { return valid(d) ? g_dt[d].size : -1; }
int eng_dtype_is_floating(int d) { return valid(d) && g_dt[d].floating; }

int eng_dtype_from_name(const char* s) {
  static const struct { const char* n; int d; } alias[] = {
    {"f32", ENG_F32}, {"float32", ENG_F32}, {"float", ENG_F32},
    {"f64", ENG_F64}, {"float64", ENG_F64}, {"double", ENG_F64},
    {"bf16", ENG_BF16}, {"bfloat16", ENG_BF16},
    {"f16", ENG_F16}, {"float16", ENG_F16}, {"half", ENG_F16},
    {"i32", ENG_I32}, {"int32", ENG_I32}, {"int", ENG_I32},
    {"i64", ENG_I64}, {"int64", ENG_I64}, {"long", ENG_I64},
    {"u8", ENG_U8}, {"uint8", ENG_U8}, {"bool", ENG_BOOL},
  };
  if (!s) return eng_err("dtype: name is nil");
  for (size_t i = 0; i < sizeof alias / sizeof alias[0]; i++)
    if (!strcasecmp(s, alias[i].n)) return alias[i].d;
  return eng_err("dtype: unknown dtype '%s' (expected f32, f64, bf16, f16, i32, i64, u8 or bool)", s);
}

/* Category: bool < integer < floating; within floating the wider wins,
 * bf16 with f16 gives f32 (as PyTorch). */
int eng_promote_types(int a, int b) {
  if (a == b) return a;
  int fa = eng_dtype_is_floating(a), fb = eng_dtype_is_floating(b);
  if (fa && fb) {
    if (a == ENG_F64 || b == ENG_F64) return ENG_F64;
    return ENG_F32; /* f32 with anything half, or bf16 with f16 */
  }
  if (fa) return a;
  if (fb) return b;
  if (a == ENG_BOOL) return b;
  if (b == ENG_BOOL) return a;
  if (a == ENG_I64 || b == ENG_I64) return ENG_I64;
  if (a == ENG_I32 || b == ENG_I32) return ENG_I32;
  return ENG_U8;
}
