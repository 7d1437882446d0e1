/* rng.c: the counter-based generators (seed, offset: the global one and
 * user generators, eng_rng_use) and random tensors.  Element i of a tensor drawn with (seed, offset) is a function of
 * (seed, offset + i) only (i = row-major index in the global tensor); the
 * transforms and the Philox addressing are in kernels/cpu/philox.h. */
#include "core/dispatch.h"
#include "core/device.h"
#include "kernels/cpu/kcpu.h"
#include "eng/rng.h"
#include <math.h>
#include <pthread.h>

/* PyTorch's default CPU seed, so an unseeded run is still deterministic. */
#define ENG_DEFAULT_SEED 67280421310721ULL

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static eng_generator g_default = {ENG_DEFAULT_SEED, 0};
/* The generator this thread's draws use (PyTorch's generator= argument: the Lua layer routes one call
 * to a user generator with eng_rng_use and restores the previous one); NULL: the global one. */
static __thread eng_generator* t_current = NULL;

static inline eng_generator* cur(void) { return t_current ? t_current : &g_default; }

eng_generator* eng_rng_use(eng_generator* g) {
  eng_generator* prev = t_current;
  t_current = g;
  return prev;
}

void eng_manual_seed(uint64_t seed) {
  pthread_mutex_lock(&g_lock);
  eng_generator* g = cur();
  g->seed = seed; g->offset = 0;
  pthread_mutex_unlock(&g_lock);
}

void eng_rng_get_state(uint64_t* seed, uint64_t* offset) {
  pthread_mutex_lock(&g_lock);
  eng_generator* g = cur();
  if (seed) *seed = g->seed;
  if (offset) *offset = g->offset;
  pthread_mutex_unlock(&g_lock);
}

void eng_rng_set_state(uint64_t seed, uint64_t offset) {
  pthread_mutex_lock(&g_lock);
  eng_generator* g = cur();
  g->seed = seed; g->offset = offset;
  pthread_mutex_unlock(&g_lock);
}

uint64_t eng_rng_reserve(uint64_t n) {
  pthread_mutex_lock(&g_lock);
  eng_generator* g = cur();
  uint64_t off = g->offset;
  g->offset += (n + 3) & ~(uint64_t)3;
  pthread_mutex_unlock(&g_lock);
  return off;
}

/* Seed and first offset of a draw of n elements from the current generator. */
uint64_t eng_rng_reserve_seeded(uint64_t n, uint64_t* seed) {
  pthread_mutex_lock(&g_lock);
  eng_generator* g = cur();
  uint64_t off = g->offset;
  *seed = g->seed;
  g->offset += (n + 3) & ~(uint64_t)3;
  pthread_mutex_unlock(&g_lock);
  return off;
}

static const char* const kind_names[] = {"uniform", "normal", "bernoulli"};

/* Checks the distribution parameters for op. */
static int check_params(const char* op, int kind, double a, double b) {
  switch (kind) {
    case ENG_RNG_UNIFORM:
      if (!isfinite(a) || !isfinite(b)) return eng_err("%s: bounds must be finite, got [%g, %g)", op, a, b);
      if (a > b) return eng_err("%s: expects from <= to, got from=%g > to=%g", op, a, b);
      if (!isfinite(b - a)) return eng_err("%s: range [%g, %g) is too large", op, a, b);
      return 0;
    case ENG_RNG_NORMAL:
      if (!isfinite(a)) return eng_err("%s: mean must be finite, got %g", op, a);
      if (!isfinite(b) || b < 0) return eng_err("%s: std must be finite and >= 0, got %g", op, b);
      return 0;
    case ENG_RNG_BERNOULLI:
      if (!(a >= 0 && a <= 1)) return eng_err("%s: probability must be in [0, 1], got %g", op, a);
      return 0;
    default:
      return eng_err("%s: unknown distribution kind %d (0 uniform, 1 normal, 2 bernoulli)", op, kind);
  }
}

static int check_out_dtype(const char* op, int kind, int dtype) {
  if (dtype < 0 || dtype >= ENG_NUM_DTYPES) return eng_err("%s: invalid dtype code %d", op, dtype);
  if (kind != ENG_RNG_BERNOULLI && !eng_dtype_is_floating(dtype))
    return eng_err("%s: %s numbers need a floating point dtype, got %s", op, kind_names[kind],
                   eng_dtype_name(dtype));
  return 0;
}

eng_tensor* eng_random_slice(int kind, int ndim, const int64_t* global_shape, const int64_t* start,
                             const int64_t* size, double a, double b, int dtype, uint64_t seed,
                             uint64_t offset) {
  const char* op = "random_slice";
  if (kind < 0 || kind > 2) return eng_errp("%s: unknown distribution kind %d (0 uniform, 1 normal, 2 bernoulli)", op, kind);
  if (ndim < 0 || ndim > ENG_MAX_DIMS)
    return eng_errp("%s: %d dims requested; tensors have 0 to %d dims", op, ndim, ENG_MAX_DIMS);
  if (ndim > 0 && !global_shape) return eng_errp("%s: global shape is NULL", op);
  if (check_params(op, kind, a, b) || check_out_dtype(op, kind, dtype)) return NULL;
  int64_t st[ENG_MAX_DIMS], sz[ENG_MAX_DIMS], gstride[ENG_MAX_DIMS];
  for (int d = 0; d < ndim; d++) {
    if (global_shape[d] < 0)
      return eng_errp("%s: negative size in global shape %s", op, eng_shape_str(ndim, global_shape));
    st[d] = start ? start[d] : 0;
    sz[d] = size ? size[d] : global_shape[d] - st[d];
    if (st[d] < 0 || sz[d] < 0 || st[d] > global_shape[d] || sz[d] > global_shape[d] - st[d])
      return eng_errp("%s: slice start %s size %s is outside the global shape %s (dim %d)", op,
                      eng_shape_str(ndim, st), eng_shape_str(ndim, sz), eng_shape_str(ndim, global_shape), d);
  }
  eng_contiguous_strides(ndim, global_shape, gstride);
  eng_tensor* out = eng_new(ndim, sz, dtype, ENG_CPU);
  if (!out || out->numel == 0) return out;
  int es = eng_dtype_size(dtype);
  int64_t inner = ndim > 0 ? sz[ndim - 1] : 1;
  int64_t rows = out->numel / inner;
  int64_t idx[ENG_MAX_DIMS] = {0};
  char* dst = eng_ptr(out);
  for (int64_t r = 0; r < rows; r++) {
    uint64_t j = 0;
    for (int d = 0; d < ndim; d++) j += (uint64_t)((st[d] + (d == ndim - 1 ? 0 : idx[d])) * gstride[d]);
    kc_random_run(kind, seed, offset + j, inner, dst + r * inner * es, es, dtype, a, b);
    for (int d = ndim - 2; d >= 0; d--) { if (++idx[d] < sz[d]) break; idx[d] = 0; }
  }
  return out;
}

static eng_tensor* draw(const char* op, int kind, int ndim, const int64_t* shape, int dtype, double a, double b) {
  if (ndim < 0 || ndim > ENG_MAX_DIMS)
    return eng_errp("%s: %d dims requested; tensors have 0 to %d dims", op, ndim, ENG_MAX_DIMS);
  if (ndim > 0 && !shape) return eng_errp("%s: shape is NULL", op);
  for (int d = 0; d < ndim; d++)
    if (shape[d] < 0) return eng_errp("%s: negative size in shape %s", op, eng_shape_str(ndim, shape));
  if (check_out_dtype(op, kind, dtype) || eng_numel_checked(ndim, shape, dtype, NULL, op)) return NULL;
  uint64_t seed;
  uint64_t off = eng_rng_reserve_seeded((uint64_t)eng_shape_numel(ndim, shape), &seed);
  eng_tensor* r = eng_random_slice(kind, ndim, shape, NULL, NULL, a, b, dtype, seed, off);
  if (!r) eng_err_prefix("%s", op);
  return r;
}

eng_tensor* eng_rand(int ndim, const int64_t* shape, int dtype) {
  return draw("rand", ENG_RNG_UNIFORM, ndim, shape, dtype, 0.0, 1.0);
}

eng_tensor* eng_randn(int ndim, const int64_t* shape, int dtype) {
  return draw("randn", ENG_RNG_NORMAL, ndim, shape, dtype, 0.0, 1.0);
}

typedef struct { int kind, dt; uint64_t seed, j; double a, b; } fill_ctx;

static void fill_row(int64_t n, char** p, const int64_t* s, void* vc) {
  fill_ctx* c = vc;
  kc_random_run(c->kind, c->seed, c->j, n, p[0], s[0], c->dt, c->a, c->b);
  c->j += (uint64_t)n;
}

static int fill_(const char* op, int kind, eng_tensor* t, double a, double b) {
  ENG_CHECK_I(t, op);
  if (check_params(op, kind, a, b)) return -1;
  if (!eng_dtype_is_floating(t->dtype))
    return eng_err("%s: expects a floating point tensor, got %s", op, eng_desc(t));
  if (eng_check_inplace(t, op)) return -1;
  if (eng_check_internal_overlap(t, op)) return -1; /* one draw per element: an expanded view has fewer */
  if (t->device == ENG_META) return 0; /* shapes only: nothing drawn, the generator does not advance */
  if (ENG_DT_ACTIVE(t->dist)) { /* the shard's slice of the global random tensor (dtensor/random.c) */
    eng_tensor* r = eng_op_dispatch(ENG_OP_RANDOM_FILL, &(eng_op_call){.name = op, .n_in = 1, .in = {t}, .ints = {kind},
                                                                         .scalars = {a, b}});
    eng_tensor_release(r);
    return r ? 0 : -1;
  }
  uint64_t seed;
  uint64_t off = eng_rng_reserve_seeded((uint64_t)t->numel, &seed);
  if (t->numel > 0 && eng_is_device(t->device)) { /* same numbers as below: element i (row-major) <- off + i */
    int contig = eng_tensor_is_contiguous(t);
    eng_tensor* d = contig ? eng_tensor_retain(t) : eng_new(t->ndim, t->shape, t->dtype, t->device);
    int rc = d ? eng_device_ops_of(t->device)->random(kind, t->dtype, t->numel, seed, off, a, b, eng_ptr(d), op) : -1;
    if (rc == 0 && !contig) rc = eng_copy_raw(t, d, d->stride);
    eng_tensor_release(d);
    if (rc) return -1;
  } else if (t->numel > 0) {
    /* kc_foreach visits rows in row-major order, so a running counter gives
     * element i the stream position off + i. */
    fill_ctx c = {kind, t->dtype, seed, off, a, b};
    char* base[1] = {eng_ptr(t)};
    const int64_t* st[1] = {t->stride};
    int esz[1] = {eng_dtype_size(t->dtype)};
    kc_foreach(t->ndim, t->shape, 1, base, st, esz, fill_row, &c);
  }
  eng_bump_version(t);
  return 0;
}

int eng_uniform_(eng_tensor* t, double a, double b) { return fill_("uniform_", ENG_RNG_UNIFORM, t, a, b); }
int eng_normal_(eng_tensor* t, double mean, double std) { return fill_("normal_", ENG_RNG_NORMAL, t, mean, std); }
