/* cuda_math.c: device side of the extra pointwise math (ops/math.c) over the
 * kernels of kernels/cuda/math.cu (ops/cuda_math.h). */
#include "ops/cuda_math.h"

#ifdef ENG_HAVE_CUDA
#include "kernels/cuda/kmath_cuda.h"
#include "eng/cuda.h"

int eng_cu_math_unary(int kop, int idt, int odt, int nd, const int64_t* shape, void* out, const int64_t* so,
                      const void* x, const int64_t* sx, const double* p, const char* op) {
  if (eng_shape_numel(nd, shape) == 0) return 0;
  cudaStream_t s = (cudaStream_t)eng_cuda_stream(ENG_CUDA_STREAM_COMPUTE);
  if (!s) { eng_err_prefix("%s", op); return -1; }
  int st = kcu_math_unary(kop, idt, odt, nd, shape, out, so, x, sx, p, s);
  return st ? eng_cuda_check(st, op) : 0;
}

int eng_cu_math_binary(int kop, int dt, int odt, int nd, const int64_t* shape, void* out, const int64_t* so,
                       const void* a, const int64_t* sa, const void* b, const int64_t* sb, const char* op) {
  if (eng_shape_numel(nd, shape) == 0) return 0;
  cudaStream_t s = (cudaStream_t)eng_cuda_stream(ENG_CUDA_STREAM_COMPUTE);
  if (!s) { eng_err_prefix("%s", op); return -1; }
  int st = kcu_math_binary(kop, dt, odt, nd, shape, out, so, a, sa, b, sb, s);
  return st ? eng_cuda_check(st, op) : 0;
}

#else

int eng_cu_math_unary(int kop, int idt, int odt, int nd, const int64_t* shape, void* out, const int64_t* so,
                      const void* x, const int64_t* sx, const double* p, const char* op) {
  return eng_err("%s: this build has no CUDA backend", op);
}
int eng_cu_math_binary(int kop, int dt, int odt, int nd, const int64_t* shape, void* out, const int64_t* so,
                       const void* a, const int64_t* sa, const void* b, const int64_t* sb, const char* op) {
  return eng_err("%s: this build has no CUDA backend", op);
}

#endif
