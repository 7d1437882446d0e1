/* primitives.c: the few device kernels the runtime itself offers through the
 * device table (cuda/device.c): strided copy with dtype conversion, fill,
 * and the counter-based random fill (the same numbers as the CPU's).  The
 * device side of the ops is in ops/cuda_ops.c. */
#include "cuda/cuda_runtime.h"

#ifdef ENG_HAVE_CUDA
#include <cuda_runtime_api.h>
#include "kernels/cuda/kcuda.h"
#include "eng/cuda.h"

static cudaStream_t S(void) { return (cudaStream_t)eng_cuda_stream(ENG_CUDA_STREAM_COMPUTE); }
static int ck(int st, const char* op) { return st == 0 ? 0 : eng_cuda_check(st, op); }
#define STREAM_OR_FAIL(op)                                   \
  cudaStream_t s = S();                                      \
  if (!s) { eng_err_prefix("%s", op); return -1; }

int eng_cu_copy(int nd, const int64_t* shape, void* dst, int ddt, const int64_t* sd, const void* src, int sdt,
                const int64_t* ss, const char* op) {
  if (eng_shape_numel(nd, shape) == 0) return 0;
  STREAM_OR_FAIL(op);
  return ck(kcu_copy(nd, shape, dst, ddt, sd, src, sdt, ss, s), op);
}

int eng_cu_fill(void* dst, int dt, int64_t n, double v, const char* op) {
  if (n == 0) return 0;
  STREAM_OR_FAIL(op);
  return ck(kcu_fill(dt, n, dst, v, s), op);
}

int eng_cu_random(int kind, int dt, int64_t n, uint64_t seed, uint64_t offset, double a, double b, void* out,
                  const char* op) {
  if (n == 0) return 0;
  STREAM_OR_FAIL(op);
  return ck(kcu_random(kind, dt, n, seed, offset, a, b, out, s), op);
}

#else /* ------------------------------------------------------------------ no CUDA backend */

#define NOCU(op) eng_err("%s: CUDA is not available: this build has no CUDA backend", op)

int eng_cu_copy(int nd, const int64_t* shape, void* dst, int ddt, const int64_t* sd, const void* src, int sdt,
                const int64_t* ss, const char* op) { return NOCU(op); }
int eng_cu_fill(void* dst, int dt, int64_t n, double v, const char* op) { return NOCU(op); }
int eng_cu_random(int kind, int dt, int64_t n, uint64_t seed, uint64_t offset, double a, double b, void* out,
                  const char* op) { return NOCU(op); }
#endif
