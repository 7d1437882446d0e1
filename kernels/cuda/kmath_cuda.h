/* kmath_cuda.h: CUDA kernels of the extra pointwise math (kernels/cuda/math.cu),
 * C-callable.  Op codes are kernels/cpu/kmath.h's KM_* (the same formulas as
 * kernels/cpu/math.c, computed in double on the device and rounded to the
 * output dtype).  Strides in ELEMENTS (broadcast dims: 0).  Status as kcuda.h
 * (0, a cudaError_t, or KCU_EARG for a dtype these kernels do not take). */
#ifndef KMATH_CUDA_H
#define KMATH_CUDA_H
#include <stdint.h>
#include <cuda_runtime_api.h>
#ifdef __cplusplus
extern "C" {
#endif

/* Unary: input dtype idt f32/f64/bf16/f16; output odt = idt, or bool for the
 * predicates.  p: round's decimals, nan_to_num's replacements (3 doubles). */
int kcu_math_unary(int op, int idt, int odt, int ndim, const int64_t* shape, void* out, const int64_t* so,
                   const void* x, const int64_t* sx, const double* p, cudaStream_t stream);
/* Binary: fmod, remainder, floor_divide with a and b of floating dtype dt and
 * out of dt; logical_and/or with a, b of any dtype dt and out bool. */
int kcu_math_binary(int op, int dt, int odt, int ndim, const int64_t* shape, void* out, const int64_t* so,
                    const void* a, const int64_t* sa, const void* b, const int64_t* sb, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
