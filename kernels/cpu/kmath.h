/* kmath.h: CPU kernels of the extra pointwise math (kernels/cpu/math.c) and
 * of the along-dim ops (cumsum, cumprod, sort, prod rows) on raw pointers.
 * dtype codes as in kcpu.h; strides in BYTES for the row functions. */
#ifndef KMATH_H
#define KMATH_H
#include <stdint.h>

/* Unary.  Input dtype idt, output dtype odt (the engine picks it: bool for
 * the predicates, the input's for floor/ceil/round/trunc/sign/square on
 * integers, floating otherwise).  p: round's decimals (p[0]); nan_to_num's
 * nan, posinf, neginf replacements (p[0..2]). */
enum { KM_SIN = 0, KM_COS, KM_FLOOR, KM_CEIL, KM_ROUND, KM_TRUNC, KM_SIGN, KM_ERF, KM_LOG1P, KM_EXPM1, KM_RECIP,
       KM_SQUARE, KM_ISNAN, KM_ISINF, KM_ISFINITE, KM_LNOT, KM_NAN_TO_NUM, KM_UCOUNT };
void km_unary_row(int op, int idt, int odt, int64_t n, char* o, int64_t so, const char* a, int64_t sa,
                  const double* p);

/* Binary (both inputs of dtype idt, already promoted).  Returns the number of
 * integer divisions by zero met (fmod, remainder, floor_divide, trunc_divide on
 * integers: the engine turns them into an error); 0 otherwise.  KM_TRUNCDIV:
 * division rounded toward zero (div's rounding_mode "trunc"). */
enum { KM_FMOD = 0, KM_REMAINDER, KM_FLOORDIV, KM_LAND, KM_LOR, KM_TRUNCDIV, KM_BCOUNT };
int64_t km_binary_row(int op, int idt, int odt, int64_t n, char* o, int64_t so, const char* a, int64_t sa,
                      const char* b, int64_t sb);

/* Row reductions over m contiguous rows of r elements of dtype dt into out
 * (odt, m elements): product (i64 for integer/bool input, exact), max or min
 * (NaN propagates). */
enum { KM_RPROD = 0, KM_RMAX, KM_RMIN };
void km_reduce_rows(int op, int dt, int odt, int64_t m, int64_t r, const void* x, void* out);
/* Gradient of prod over rows (f32/f64): gi[i] = g * prod_{j != i} x[j]
 * (exact with zeros: prefix and suffix products). */
void km_prod_grad_rows(int dt, int64_t m, int64_t r, const void* x, const void* g, void* gi);

/* Scans over m contiguous rows of r elements (dt f32/f64/i64; bf16/f16 are
 * upcast by the engine): cumsum (reverse = 1 sums from the end), cumprod. */
void km_cumsum_rows(int dt, int reverse, int64_t m, int64_t r, const void* x, void* y);
void km_cumprod_rows(int dt, int64_t m, int64_t r, const void* x, void* y);
/* Gradient of cumprod (f32/f64): gi[i] = sum_{j>=i} g[j] * prod_{k<=j, k!=i} x[k]
 * (exact with zeros). */
void km_cumprod_grad_rows(int dt, int64_t m, int64_t r, const void* x, const void* g, void* gi);

/* Sorting m contiguous rows of r elements of any dtype: idx (m x r) gets the
 * permutation that sorts each row, stable; NaN is larger than every number
 * (last ascending, first descending), as PyTorch orders it. */
void km_sort_rows(int dt, int descending, int64_t m, int64_t r, const void* x, int64_t* idx);
/* topk: idx (m x k) the positions of the k largest (or smallest) of each
 * row in PyTorch's CPU order (its selection algorithms reproduced: ties and
 * NaN come out as PyTorch gives them; sorted = 0: in the order PyTorch leaves
 * them unsorted).  kthvalue: idx (m) the position of
 * the k0-th smallest (0-based) of each row, by PyTorch's quickselect. */
void km_topk_rows(int dt, int largest, int sorted, int64_t m, int64_t r, int64_t k, const void* x, int64_t* idx);
void km_kth_rows(int dt, int64_t m, int64_t r, int64_t k0, const void* x, int64_t* idx);
/* gi (m x r, zero-filled by the caller) [idx[j]] += g[j] for each row's k
 * entries (dt f32/f64). */
void km_scatter_rows(int dt, int64_t m, int64_t r, int64_t k, const int64_t* idx, const void* g, void* gi);
/* Gather: out (m x k, dtype of es bytes) = x[row, idx[row, j]]. */
void km_gather_rows(int es, int64_t m, int64_t r, int64_t k, const int64_t* idx, const void* x, void* out);

#endif
