/* cuda_runtime.h: what the CUDA runtime (cuda/) gives the device side of the
 * ops (ops/cuda_*.c) beyond its public API (eng/cuda.h).  Not public.  In a
 * build without the CUDA backend these exist and fail. */
#ifndef ENG_CUDA_RUNTIME_H
#define ENG_CUDA_RUNTIME_H
#include "core/internal.h"

/* Deferred device error checks (cuda/deferred.c): a kernel that may find bad input writes the int at the
 * address eng_cuda_deferred_flag returns (non-zero: bad); after the launch eng_cuda_deferred_commit records
 * the event that completes the check.  The host raises fmt's message (op, a, b) at the next poll, host sync or
 * eng_cuda_check_errors (eng/cuda.h).  No host synchronisation. */
typedef void (*eng_deferred_fmt)(char* buf, size_t n, const char* op, int64_t a, int64_t b);
int* eng_cuda_deferred_flag(const char* op, eng_deferred_fmt fmt, int64_t a, int64_t b);
int eng_cuda_deferred_commit(int* flag);
/* ENGINE_PROFILE_KERNELS set: starts the kernel trace (cuda/kernel_trace.c); called once the device is initialised. */
void eng_cuda_kernel_trace_autostart(void);
/* The runtime counts its host synchronisations (eng_cuda_sync_count) and looks at the pending checks after each. */
void eng_cuda_count_sync(void);
int eng_cuda_after_sync(void);

/* The runtime's own kernels (cuda/primitives.c), also behind the device table (core/device.h): a strided copy
 * with dtype conversion, a fill, and the counter-based random fill (element i <- offset + i, the CPU's numbers). */
int eng_cu_copy(int nd, const int64_t* shape, void* dst, int ddt, const int64_t* sd, const void* src, int sdt,
                const int64_t* ss, const char* op);
int eng_cu_fill(void* dst, int dt, int64_t n, double v, const char* op);
int eng_cu_random(int kind, int dt, int64_t n, uint64_t seed, uint64_t offset, double a, double b, void* out,
                  const char* op);

#endif
