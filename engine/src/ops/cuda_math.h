/* cuda_math.h: the device side of ops/math.c (ops/cuda_math.c), not public.
 * Thin wrappers over kernels/cuda/math.cu taking the compute stream; 0 or
 * -1 with "<op>: ..." (in a build without the CUDA backend: the error). */
#ifndef ENG_CUDA_MATH_H
#define ENG_CUDA_MATH_H
#include "core/internal.h"

int eng_cu_math_unary(int kop, int idt, int odt, int nd, const int64_t* shape, void* out, const int64_t* so,
                      const void* x, const int64_t* sx, const double* p, const char* op);
int eng_cu_math_binary(int kop, int dt, int odt, int nd, const int64_t* shape, void* out, const int64_t* so,
                       const void* a, const int64_t* sa, const void* b, const int64_t* sb, const char* op);

#endif
