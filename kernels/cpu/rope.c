/* rope.c: rotary position embedding on interleaved pairs (torchtitan's Llama, Meta's reference), fused:
 *   out[.., 2i]     = x[2i] cos(t, i) - x[2i + 1] sin(t, i)
 *   out[.., 2i + 1] = x[2i] sin(t, i) + x[2i + 1] cos(t, i)
 * for x [B, T, H, D] (strides xs[0..2] of b, t, h in elements, the last dim contiguous: the q / k views of a fused
 * QKV projection need no copy) and tables cos, sin contiguous [T, D / 2]; out contiguous; inverse = 1 rotates by -angle (the
 * backward: the transpose of a rotation).  f32 math for f32 / bf16 / f16 (one rounding per output), f64 for f64;
 * tables in any float dtype.  Rows (b, t) run in parallel. */
#include "kcpu.h"
#include <stddef.h>

typedef struct {
  int dt, cdt, inverse;
  int64_t T, H, D, sb, st, sh;
  const char* x;
  const char* c;
  const char* s;
  char* out;
} rope_ctx;

static void rope_rows(void* vc, int64_t lo, int64_t hi) {
  const rope_ctx* k = vc;
  const int64_t half = k->D / 2, row = k->H * k->D;
  const int es = k->dt == KC_F64 ? 8 : (k->dt == KC_F32 ? 4 : 2), ces = k->cdt == KC_F64 ? 8 : (k->cdt == KC_F32 ? 4 : 2);
  const double sg = k->inverse ? -1.0 : 1.0;
  for (int64_t r = lo; r < hi; r++) {
    const int64_t t = r % k->T, b = r / k->T;
    const char* cr = k->c + (size_t)(t * half) * ces;
    const char* sr = k->s + (size_t)(t * half) * ces;
    const char* xr = k->x + (size_t)(b * k->sb + t * k->st) * es;   /* head h at xr + h sh */
    char* orow = k->out + (size_t)(r * row) * es;
    if (k->dt == KC_F32 && k->cdt == KC_F32) {
      const float *cf = (const float*)cr, *sf = (const float*)sr;
      float* of = (float*)orow;
      const float sgf = (float)sg;
      for (int64_t h = 0; h < k->H; h++) {
        const float* xf = (const float*)xr + h * k->sh;
        for (int64_t i = 0; i < half; i++) {
          const float c = cf[i], s = sgf * sf[i], x0 = xf[2 * i], x1 = xf[2 * i + 1];
          of[h * k->D + 2 * i] = x0 * c - x1 * s;
          of[h * k->D + 2 * i + 1] = x0 * s + x1 * c;
        }
      }
      continue;
    }
    for (int64_t h = 0; h < k->H; h++)
      for (int64_t i = 0; i < half; i++) {
        const int64_t e = h * k->D + 2 * i, xe = h * k->sh + 2 * i;
        if (k->dt == KC_F64) {
          const double c = kc_load(cr + i * ces, k->cdt), s = sg * kc_load(sr + i * ces, k->cdt);
          const double x0 = ((const double*)xr)[xe], x1 = ((const double*)xr)[xe + 1];
          ((double*)orow)[e] = x0 * c - x1 * s;
          ((double*)orow)[e + 1] = x0 * s + x1 * c;
        } else {
          const float c = (float)kc_load(cr + i * ces, k->cdt), s = (float)(sg * kc_load(sr + i * ces, k->cdt));
          const float x0 = (float)kc_load(xr + xe * es, k->dt), x1 = (float)kc_load(xr + (xe + 1) * es, k->dt);
          kc_store(orow + e * es, k->dt, x0 * c - x1 * s);
          kc_store(orow + (e + 1) * es, k->dt, x0 * s + x1 * c);
        }
      }
  }
}

int kc_rope(int dt, int cdt, int64_t B, int64_t T, int64_t H, int64_t D, const void* x, const int64_t* xs,
            const void* cos, const void* sin, int inverse, void* out) {
  if (B < 0 || T < 0 || H < 0 || D < 0 || D % 2 || (dt != KC_F32 && dt != KC_F64 && dt != KC_BF16 && dt != KC_F16) ||
      (cdt != KC_F32 && cdt != KC_F64 && cdt != KC_BF16 && cdt != KC_F16))
    return -1;
  if (B == 0 || T == 0 || H == 0 || D == 0) return 0;
  rope_ctx c = {dt, cdt, inverse, T, H, D, xs[0], xs[1], xs[2], x, cos, sin, out};
  kc_parallel_for(B * T, 1 + 8192 / (H * D > 0 ? H * D : 1), rope_rows, &c);
  return 0;
}
