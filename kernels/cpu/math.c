/* math.c: CPU kernels of the extra pointwise math (sin, cos, floor, ceil,
 * round, trunc, sign, erf, log1p, expm1, reciprocal, square, isnan, isinf,
 * isfinite, logical_not, nan_to_num; fmod, remainder, floor_divide,
 * logical_and/or), row reductions (prod, max, min), scans (cumsum, cumprod)
 * and stable row sorting.  Floating values are computed in double and
 * rounded to the output dtype; integer values in int64 (exact).  Semantics
 * follow PyTorch: round is half to even (with decimals: x*10^d rounded,
 * divided back), fmod has the dividend's sign, remainder the divisor's,
 * floor_divide rounds toward -inf (its float formula), sign(NaN) = 0. */
#include "kcpu.h"
#include "kmath.h"
#include <math.h>
#include <float.h>
#include <stdlib.h>
#include <string.h>

static inline int kc_dtype_size_km(int dt) {
  static const int sz[8] = {4, 8, 2, 2, 4, 8, 1, 1};
  return dt >= 0 && dt < 8 ? sz[dt] : 1;
}

static inline int is_int_dt(int dt) { return dt == KC_I32 || dt == KC_I64 || dt == KC_U8 || dt == KC_BOOL; }

static inline int64_t load_i(const void* p, int dt) {
  switch (dt) {
    case KC_I32: return *(const int32_t*)p;
    case KC_I64: return *(const int64_t*)p;
    case KC_U8: return *(const uint8_t*)p;
    case KC_BOOL: return *(const uint8_t*)p != 0;
    default: return (int64_t)kc_load(p, dt);
  }
}
static inline void store_i(void* p, int dt, int64_t v) {
  switch (dt) {
    case KC_I32: *(int32_t*)p = (int32_t)v; break;
    case KC_I64: *(int64_t*)p = v; break;
    case KC_U8: *(uint8_t*)p = (uint8_t)v; break;
    case KC_BOOL: *(uint8_t*)p = v != 0; break;
    default: kc_store(p, dt, (double)v); break;
  }
}

static double round_dec(double x, double d) {
  if (d == 0) return rint(x);
  if (d > 0) { double t = pow(10.0, d); return rint(x * t) / t; }
  double t = pow(10.0, -d);
  return rint(x / t) * t;
}

static double fmax_of(int dt) {
  switch (dt) {
    case KC_F32: return FLT_MAX;
    case KC_BF16: return 3.3895313892515355e38;
    case KC_F16: return 65504.0;
    default: return DBL_MAX;
  }
}

static double unary_f(int op, double x, const double* p, int odt) {
  switch (op) {
    case KM_SIN: return sin(x);
    case KM_COS: return cos(x);
    case KM_FLOOR: return floor(x);
    case KM_CEIL: return ceil(x);
    case KM_ROUND: return round_dec(x, p ? p[0] : 0);
    case KM_TRUNC: return trunc(x);
    case KM_SIGN: return (double)((x > 0) - (x < 0));
    case KM_ERF: return erf(x);
    case KM_LOG1P: return log1p(x);
    case KM_EXPM1: return expm1(x);
    case KM_RECIP: return 1.0 / x;
    case KM_SQUARE: return x * x;
    case KM_ISNAN: return isnan(x) ? 1 : 0;
    case KM_ISINF: return isinf(x) ? 1 : 0;
    case KM_ISFINITE: return isfinite(x) ? 1 : 0;
    case KM_LNOT: return x == 0 ? 1 : 0;
    case KM_NAN_TO_NUM: {
      if (isnan(x)) return p[0];
      if (isinf(x)) {
        double r = x > 0 ? p[1] : p[2];
        if (isnan(r)) r = x > 0 ? fmax_of(odt) : -fmax_of(odt);
        return r;
      }
      return x;
    }
  }
  return x;
}

static int64_t unary_i(int op, int64_t x) {
  switch (op) {
    case KM_FLOOR: case KM_CEIL: case KM_ROUND: case KM_TRUNC: case KM_NAN_TO_NUM: return x;
    case KM_SIGN: return (x > 0) - (x < 0);
    case KM_SQUARE: return (int64_t)((uint64_t)x * (uint64_t)x);
    case KM_ISNAN: case KM_ISINF: return 0;
    case KM_ISFINITE: return 1;
    case KM_LNOT: return x == 0;
  }
  return x;
}

void km_unary_row(int op, int idt, int odt, int64_t n, char* o, int64_t so, const char* a, int64_t sa,
                  const double* p) {
  int int_path = is_int_dt(idt) && (is_int_dt(odt) || op == KM_ISNAN || op == KM_ISINF || op == KM_ISFINITE ||
                                    op == KM_LNOT);
  if (int_path) {
    for (int64_t i = 0; i < n; i++) store_i(o + i * so, odt, unary_i(op, load_i(a + i * sa, idt)));
    return;
  }
  if (idt == KC_F32 && odt == KC_F32) {
    for (int64_t i = 0; i < n; i++) {
      float x = *(const float*)(a + i * sa);
      *(float*)(o + i * so) = (float)unary_f(op, x, p, odt);
    }
    return;
  }
  for (int64_t i = 0; i < n; i++) kc_store(o + i * so, odt, unary_f(op, kc_load(a + i * sa, idt), p, odt));
}

/* PyTorch's floor division of floats (c10 div_floor_floating). */
static double floordiv_f(double a, double b) {
  if (b == 0) return a / b;
  double mod = fmod(a, b);
  double div = (a - mod) / b;
  if (mod != 0 && ((b < 0) != (mod < 0))) div -= 1;
  double fd;
  if (div != 0) {
    fd = floor(div);
    if (div - fd > 0.5) fd += 1.0;
  } else {
    fd = copysign(0.0, a / b);
  }
  return fd;
}

static double binary_f(int op, double a, double b) {
  switch (op) {
    case KM_FMOD: return fmod(a, b);
    case KM_REMAINDER: {
      double m = fmod(a, b);
      if (m != 0 && ((b < 0) != (m < 0))) m += b;
      return m;
    }
    case KM_FLOORDIV: return floordiv_f(a, b);
    case KM_TRUNCDIV: return trunc(a / b);
    case KM_LAND: return (a != 0) && (b != 0);
    case KM_LOR: return (a != 0) || (b != 0);
  }
  return 0;
}

int64_t km_binary_row(int op, int idt, int odt, int64_t n, char* o, int64_t so, const char* a, int64_t sa,
                      const char* b, int64_t sb) {
  int64_t zeros = 0;
  if (is_int_dt(idt)) {
    for (int64_t i = 0; i < n; i++) {
      int64_t x = load_i(a + i * sa, idt), y = load_i(b + i * sb, idt), r = 0;
      switch (op) {
        case KM_LAND: r = x && y; break;
        case KM_LOR: r = x || y; break;
        default:
          if (y == 0) { zeros++; r = 0; break; }
          if (y == -1) { r = op == KM_FLOORDIV || op == KM_TRUNCDIV ? (int64_t)(0 - (uint64_t)x) : 0; break; }
          if (op == KM_TRUNCDIV) { r = x / y; break; }
          r = x % y;
          if (op == KM_REMAINDER && r != 0 && ((r < 0) != (y < 0))) r += y;
          if (op == KM_FLOORDIV) {
            int64_t q = x / y;
            if (x % y != 0 && ((x < 0) != (y < 0))) q -= 1;
            r = q;
          }
      }
      store_i(o + i * so, odt, r);
    }
    return zeros;
  }
  for (int64_t i = 0; i < n; i++)
    kc_store(o + i * so, odt, binary_f(op, kc_load(a + i * sa, idt), kc_load(b + i * sb, idt)));
  return 0;
}

/* ------------------------------------------------------------------ row reductions */
void km_reduce_rows(int op, int dt, int odt, int64_t m, int64_t r, const void* x, void* out) {
  int es = kc_dtype_size_km(dt), eo = kc_dtype_size_km(odt);
  const char* X = x;
  char* O = out;
  for (int64_t i = 0; i < m; i++) {
    const char* row = X + i * r * es;
    if (is_int_dt(dt)) {
      int64_t acc = op == KM_RPROD ? 1 : load_i(row, dt);
      for (int64_t j = op == KM_RPROD ? 0 : 1; j < r; j++) {
        int64_t v = load_i(row + j * es, dt);
        if (op == KM_RPROD) acc = (int64_t)((uint64_t)acc * (uint64_t)v);
        else if (op == KM_RMAX) acc = v > acc ? v : acc;
        else acc = v < acc ? v : acc;
      }
      store_i(O + i * eo, odt, acc);
    } else {
      double acc = op == KM_RPROD ? 1.0 : kc_load(row, dt);
      for (int64_t j = op == KM_RPROD ? 0 : 1; j < r; j++) {
        double v = kc_load(row + j * es, dt);
        if (op == KM_RPROD) acc *= v;
        else if (isnan(v) || isnan(acc)) acc = NAN;
        else if (op == KM_RMAX) acc = v > acc ? v : acc;
        else acc = v < acc ? v : acc;
      }
      kc_store(O + i * eo, odt, acc);
    }
  }
}

void km_prod_grad_rows(int dt, int64_t m, int64_t r, const void* x, const void* g, void* gi) {
  int es = kc_dtype_size_km(dt);
  double* pre = malloc(sizeof(double) * (size_t)(r + 1));
  if (!pre) return;
  for (int64_t i = 0; i < m; i++) {
    const char* X = (const char*)x + i * r * es;
    char* GI = (char*)gi + i * r * es;
    double gv = kc_load((const char*)g + i * es, dt);
    pre[0] = 1.0;
    for (int64_t j = 0; j < r; j++) pre[j + 1] = pre[j] * kc_load(X + j * es, dt);
    double suf = 1.0;
    for (int64_t j = r - 1; j >= 0; j--) {
      kc_store(GI + j * es, dt, gv * pre[j] * suf);
      suf *= kc_load(X + j * es, dt);
    }
  }
  free(pre);
}

/* ------------------------------------------------------------------ scans */
void km_cumsum_rows(int dt, int reverse, int64_t m, int64_t r, const void* x, void* y) {
  int es = kc_dtype_size_km(dt);
  for (int64_t i = 0; i < m; i++) {
    const char* X = (const char*)x + i * r * es;
    char* Y = (char*)y + i * r * es;
    if (is_int_dt(dt)) {
      int64_t acc = 0;
      for (int64_t k = 0; k < r; k++) {
        int64_t j = reverse ? r - 1 - k : k;
        acc = (int64_t)((uint64_t)acc + (uint64_t)load_i(X + j * es, dt));
        store_i(Y + j * es, dt, acc);
      }
    } else {
      double acc = 0;
      for (int64_t k = 0; k < r; k++) {
        int64_t j = reverse ? r - 1 - k : k;
        acc += kc_load(X + j * es, dt);
        kc_store(Y + j * es, dt, acc);
      }
    }
  }
}

void km_cumprod_rows(int dt, int64_t m, int64_t r, const void* x, void* y) {
  int es = kc_dtype_size_km(dt);
  for (int64_t i = 0; i < m; i++) {
    const char* X = (const char*)x + i * r * es;
    char* Y = (char*)y + i * r * es;
    if (is_int_dt(dt)) {
      int64_t acc = 1;
      for (int64_t j = 0; j < r; j++) {
        acc = (int64_t)((uint64_t)acc * (uint64_t)load_i(X + j * es, dt));
        store_i(Y + j * es, dt, acc);
      }
    } else {
      double acc = 1;
      for (int64_t j = 0; j < r; j++) {
        acc *= kc_load(X + j * es, dt);
        kc_store(Y + j * es, dt, acc);
      }
    }
  }
}

void km_cumprod_grad_rows(int dt, int64_t m, int64_t r, const void* x, const void* g, void* gi) {
  int es = kc_dtype_size_km(dt);
  double* xs = malloc(sizeof(double) * (size_t)(2 * r + 1));
  if (!xs) return;
  double* gs = xs + r;
  for (int64_t i = 0; i < m; i++) {
    const char* X = (const char*)x + i * r * es;
    const char* G = (const char*)g + i * r * es;
    char* GI = (char*)gi + i * r * es;
    int64_t first_zero = r;
    for (int64_t j = 0; j < r; j++) {
      xs[j] = kc_load(X + j * es, dt);
      gs[j] = kc_load(G + j * es, dt);
      if (xs[j] == 0 && first_zero == r) first_zero = j;
    }
    /* gi[k] = sum_{j>=k} g[j] * P(j, k), P(j, k) = prod_{l<=j, l!=k} x[l]:
     * O(r) per row: walk k up, prefix = prod_{l<k} x[l]; the inner sum
     * sum_{j>=k} g[j] prod_{k<l<=j} x[l] is computed backwards once per k
     * only for k <= first zero (beyond it every P is 0). */
    double prefix = 1.0;
    for (int64_t k = 0; k < r; k++) {
      double v = 0;
      if (k <= first_zero) {
        double s = 0, run = 1.0;
        for (int64_t j = k; j < r; j++) {
          if (j > k) run *= xs[j];
          s += gs[j] * run;
          if (run == 0) break;
        }
        v = prefix * s;
      }
      kc_store(GI + k * es, dt, v);
      prefix *= xs[k];
    }
  }
  free(xs);
}

/* ------------------------------------------------------------------ sorting */
typedef struct { double v; int64_t iv; int64_t i; } skey;

static __thread int g_desc, g_int; /* the comparator's mode (qsort has no context) */
static inline int key_less(const skey* a, const skey* b) {
  /* a strictly before b in the sorted order (ties: index order) */
  if (g_int) {
    if (a->iv != b->iv) return g_desc ? a->iv > b->iv : a->iv < b->iv;
    return a->i < b->i;
  }
  int an = isnan(a->v), bn = isnan(b->v);
  if (an || bn) {
    if (an && bn) return a->i < b->i;
    return g_desc ? an : bn; /* NaN largest */
  }
  if (a->v != b->v) return g_desc ? a->v > b->v : a->v < b->v;
  return a->i < b->i;
}
static int key_cmp(const void* x, const void* y) { return key_less(x, y) ? -1 : (key_less(y, x) ? 1 : 0); }

void km_sort_rows(int dt, int descending, int64_t m, int64_t r, const void* x, int64_t* idx) {
  int es = kc_dtype_size_km(dt);
  skey* k = malloc(sizeof(skey) * (size_t)(r > 0 ? r : 1));
  if (!k) return;
  g_desc = descending;
  g_int = is_int_dt(dt);
  for (int64_t i = 0; i < m; i++) {
    const char* X = (const char*)x + i * r * es;
    for (int64_t j = 0; j < r; j++) {
      k[j].i = j;
      if (g_int) k[j].iv = load_i(X + j * es, dt); else k[j].v = kc_load(X + j * es, dt);
    }
    /* the index tie-break makes the order total, so qsort is stable here */
    qsort(k, (size_t)r, sizeof(skey), key_cmp);
    for (int64_t j = 0; j < r; j++) idx[i * r + j] = k[j].i;
  }
  free(k);
}

void km_scatter_rows(int dt, int64_t m, int64_t r, int64_t k, const int64_t* idx, const void* g, void* gi) {
  int es = kc_dtype_size_km(dt);
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < k; j++) {
      char* d = (char*)gi + (i * r + idx[i * k + j]) * es;
      kc_store(d, dt, kc_load(d, dt) + kc_load((const char*)g + (i * k + j) * es, dt));
    }
}

void km_gather_rows(int es, int64_t m, int64_t r, int64_t k, const int64_t* idx, const void* x, void* out) {
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < k; j++)
      memcpy((char*)out + (i * k + j) * es, (const char*)x + (i * r + idx[i * k + j]) * es, (size_t)es);
}

/* ------------------------------------------------------------------ selection (topk, kthvalue)
 * PyTorch's CPU topk runs the C++ standard library's nth_element (then sort
 * of the first k-1) or, when k * 64 <= n, partial_sort, over (value, index)
 * pairs with a comparator putting NaN first (largest) or last (smallest);
 * kthvalue runs a median-of-three quickselect.  Which of several equal
 * values comes out (and where) is decided by those algorithms, so they are
 * reproduced here step for step (GNU libstdc++'s introselect / introsort /
 * heap select, the quickselect of PyTorch's kthvalue): ties and NaN come out
 * exactly as PyTorch orders them on CPU. */
typedef struct { double v; int64_t i; } kpair;

static __thread int k_largest;
static inline int kcomp(const kpair* x, const kpair* y) {
  int xn = isnan(x->v), yn = isnan(y->v);
  if (k_largest) return (xn && !yn) || x->v > y->v;
  return (!xn && yn) || x->v < y->v;
}
static inline void kswap(kpair* a, kpair* b) { kpair t = *a; *a = *b; *b = t; }
static int64_t k_lg(int64_t n) { int64_t r = 0; while (n > 1) { n >>= 1; r++; } return r; }

static void k_move_median_to_first(kpair* result, kpair* a, kpair* b, kpair* c) {
  if (kcomp(a, b)) {
    if (kcomp(b, c)) kswap(result, b);
    else if (kcomp(a, c)) kswap(result, c);
    else kswap(result, a);
  } else if (kcomp(a, c)) kswap(result, a);
  else if (kcomp(b, c)) kswap(result, c);
  else kswap(result, b);
}
static kpair* k_unguarded_partition(kpair* first, kpair* last, kpair* pivot) {
  for (;;) {
    while (kcomp(first, pivot)) ++first;
    --last;
    while (kcomp(pivot, last)) --last;
    if (!(first < last)) return first;
    kswap(first, last);
    ++first;
  }
}
static kpair* k_partition_pivot(kpair* first, kpair* last) {
  kpair* mid = first + (last - first) / 2;
  k_move_median_to_first(first, first + 1, mid, last - 1);
  return k_unguarded_partition(first + 1, last, first);
}
static void k_unguarded_linear_insert(kpair* last) {
  kpair val = *last;
  kpair* next = last - 1;
  while (kcomp(&val, next)) { *last = *next; last = next; --next; }
  *last = val;
}
static void k_insertion_sort(kpair* first, kpair* last) {
  if (first == last) return;
  for (kpair* i = first + 1; i != last; ++i) {
    if (kcomp(i, first)) {
      kpair val = *i;
      memmove(first + 1, first, sizeof(kpair) * (size_t)(i - first));
      *first = val;
    } else {
      k_unguarded_linear_insert(i);
    }
  }
}
static void k_push_heap(kpair* first, int64_t hole, int64_t top, kpair value) {
  int64_t parent = (hole - 1) / 2;
  while (hole > top && kcomp(first + parent, &value)) {
    first[hole] = first[parent];
    hole = parent;
    parent = (hole - 1) / 2;
  }
  first[hole] = value;
}
static void k_adjust_heap(kpair* first, int64_t hole, int64_t len, kpair value) {
  int64_t top = hole, child = hole;
  while (child < (len - 1) / 2) {
    child = 2 * (child + 1);
    if (kcomp(first + child, first + (child - 1))) child--;
    first[hole] = first[child];
    hole = child;
  }
  if ((len & 1) == 0 && child == (len - 2) / 2) {
    child = 2 * (child + 1);
    first[hole] = first[child - 1];
    hole = child - 1;
  }
  k_push_heap(first, hole, top, value);
}
static void k_make_heap(kpair* first, kpair* last) {
  int64_t len = last - first;
  if (len < 2) return;
  for (int64_t parent = (len - 2) / 2;; parent--) {
    k_adjust_heap(first, parent, len, first[parent]);
    if (parent == 0) return;
  }
}
static void k_pop_heap(kpair* first, kpair* last, kpair* result) {
  kpair value = *result;
  *result = *first;
  k_adjust_heap(first, 0, last - first, value);
}
static void k_heap_select(kpair* first, kpair* middle, kpair* last) {
  k_make_heap(first, middle);
  for (kpair* i = middle; i < last; ++i)
    if (kcomp(i, first)) k_pop_heap(first, middle, i);
}
static void k_sort_heap(kpair* first, kpair* last) {
  while (last - first > 1) { --last; k_pop_heap(first, last, last); }
}
static void k_partial_sort(kpair* first, kpair* middle, kpair* last) {
  k_heap_select(first, middle, last);
  k_sort_heap(first, middle);
}
static void k_introsort_loop(kpair* first, kpair* last, int64_t depth) {
  while (last - first > 16) {
    if (depth == 0) { k_partial_sort(first, last, last); return; }
    --depth;
    kpair* cut = k_partition_pivot(first, last);
    k_introsort_loop(cut, last, depth);
    last = cut;
  }
}
static void k_sort(kpair* first, kpair* last) {
  if (first == last) return;
  k_introsort_loop(first, last, k_lg(last - first) * 2);
  if (last - first > 16) {
    k_insertion_sort(first, first + 16);
    for (kpair* i = first + 16; i != last; ++i) k_unguarded_linear_insert(i);
  } else {
    k_insertion_sort(first, last);
  }
}
static void k_nth_element(kpair* first, kpair* nth, kpair* last) {
  if (first == last || nth == last) return;
  int64_t depth = k_lg(last - first) * 2;
  while (last - first > 3) {
    if (depth == 0) {
      k_heap_select(first, nth + 1, last);
      kswap(first, nth);
      return;
    }
    --depth;
    kpair* cut = k_partition_pivot(first, last);
    if (cut <= nth) first = cut; else last = cut;
  }
  k_insertion_sort(first, last);
}

void km_topk_rows(int dt, int largest, int sorted, int64_t m, int64_t r, int64_t k, const void* x, int64_t* idx) {
  int es = kc_dtype_size_km(dt);
  if (k == 0) return;
  kpair* q = malloc(sizeof(kpair) * (size_t)(r > 0 ? r : 1));
  if (!q) return;
  k_largest = largest;
  for (int64_t i = 0; i < m; i++) {
    const char* X = (const char*)x + i * r * es;
    for (int64_t j = 0; j < r; j++) { q[j].v = kc_load(X + j * es, dt); q[j].i = j; }
    if (k * 64 <= r) {
      k_partial_sort(q, q + k, q + r);
    } else {
      k_nth_element(q, q + k - 1, q + r);
      if (sorted) k_sort(q, q + k - 1);
    }
    for (int64_t j = 0; j < k; j++) idx[i * k + j] = q[j].i;
  }
  free(q);
}

/* gt_or_nan quickselect of the (k0)-th smallest (0-based), median of three. */
static int k_gt_or_nan(double x, double y) { return (isnan(x) && !isnan(y)) || x > y; }
void km_kth_rows(int dt, int64_t m, int64_t r, int64_t k0, const void* x, int64_t* idx) {
  int es = kc_dtype_size_km(dt);
  kpair* a = malloc(sizeof(kpair) * (size_t)(r > 0 ? r : 1));
  if (!a) return;
  for (int64_t row = 0; row < m; row++) {
    const char* X = (const char*)x + row * r * es;
    for (int64_t j = 0; j < r; j++) { a[j].v = kc_load(X + j * es, dt); a[j].i = j; }
    int64_t L = 0, R = r - 1;
    for (;;) {
      if (R <= L) break;
      if (R == L + 1) {
        if (k_gt_or_nan(a[L].v, a[R].v)) kswap(&a[L], &a[R]);
        break;
      }
      int64_t P = L + (R - L) / 2;
      kswap(&a[P], &a[L + 1]);
      if (k_gt_or_nan(a[L + 1].v, a[R].v)) kswap(&a[L + 1], &a[R]);
      if (k_gt_or_nan(a[L].v, a[R].v)) kswap(&a[L], &a[R]);
      if (k_gt_or_nan(a[L + 1].v, a[L].v)) kswap(&a[L + 1], &a[L]);
      int64_t i = L + 1, j = R;
      double piv = a[L].v;
      for (;;) {
        do i++; while (k_gt_or_nan(piv, a[i].v));
        do j--; while (k_gt_or_nan(a[j].v, piv));
        if (j < i) break;
        kswap(&a[i], &a[j]);
      }
      kswap(&a[L], &a[j]);
      if (j <= k0) L = i;
      if (j >= k0) R = j - 1;
    }
    idx[row] = a[k0].i;
  }
  free(a);
}
