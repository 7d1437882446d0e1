/* base.h: dtypes, devices, errors, runtime and allocator statistics. */
#ifndef ENG_BASE_H
#define ENG_BASE_H
#include <stdint.h>
#include <stddef.h>

typedef enum eng_dtype {
  ENG_F32 = 0, ENG_F64 = 1, ENG_BF16 = 2, ENG_F16 = 3,
  ENG_I32 = 4, ENG_I64 = 5, ENG_U8 = 6, ENG_BOOL = 7,
  ENG_NUM_DTYPES = 8
} eng_dtype;

/* ENG_META: shape, dtype and strides only, no data (PyTorch's meta device):
 * for building large models and their parallel layouts before allocating
 * (module:to_empty materialises).  Ops that read or write values fail on it
 * with an error naming the op; views, dtype casts, fills and random
 * initialisers (no-ops), redistribute and distribute_tensor keep it meta. */
typedef enum eng_device { ENG_CPU = 0, ENG_CUDA = 1, ENG_META = 2 } eng_device;

/* Version string of the library, e.g. "engine 0.1.0". Borrowed. */
const char* eng_version(void);

/* The message of the last error on this thread (borrowed; "" if none). */
const char* eng_last_error(void);
void eng_clear_error(void);
/* Set the error message from outside C (Lua hooks use it); returns -1. */
int eng_set_error_message(const char* msg);

/* Name and size of a dtype; -1 / NULL for an invalid one. */
const char* eng_dtype_name(int dtype);
int eng_dtype_size(int dtype);
/* Parse "f32", "float32", "bf16", ... ; -1 and an error for unknown names. */
int eng_dtype_from_name(const char* name);
int eng_dtype_is_floating(int dtype);
/* Result dtype of a binary op between a and b (PyTorch-like promotion). */
int eng_promote_types(int a, int b);

/* Runtime: tunes malloc (no mmap for big blocks, no trimming), sets up
 * the allocator; idempotent.  eng_dist_* (distributed issue) handles MPI. */
int eng_runtime_init(void);

/* Caching allocator statistics in bytes. */
typedef struct eng_alloc_stats {
  int64_t allocated;       /* bytes in live tensors */
  int64_t peak_allocated;  /* high-water mark of allocated */
  int64_t reserved;        /* bytes obtained from the system (live + cached) */
  int64_t n_system_allocs; /* calls to the system allocator so far */
  int64_t n_allocs;        /* allocation requests served so far */
} eng_alloc_stats;
void eng_alloc_get_stats(eng_alloc_stats* out);
void eng_alloc_reset_peak(void);
/* Return every cached (free) block to the system. */
void eng_alloc_empty_cache(void);

/* Collector pressure (docs/design.md "Allocator"): the bytes in use (the CPU allocator's live blocks: tensor
 * storages and communication buffers; plus live CUDA storages), and a flag raised when an allocation takes
 * them past the threshold (default 64 MiB).  The
 * Lua layer reads the flag each time it wraps a new tensor, runs a collection and sets the next threshold.
 * eng_alloc_set_gc_threshold clears the flag, or raises it at once if the bytes are already past; a negative
 * threshold never raises it. */
volatile int32_t* eng_alloc_gc_flag(void);
int64_t eng_alloc_gc_bytes(void);
void eng_alloc_set_gc_threshold(int64_t bytes);
int64_t eng_alloc_get_gc_threshold(void);

/* Threads used by the CPU kernels and BLAS. */
int eng_set_num_threads(int n);
int eng_get_num_threads(void);
/* Name of the BLAS core in use (e.g. "Haswell"); borrowed. */
const char* eng_blas_corename(void);
/* Why that core runs, e.g. "CPU has AVX-512; OpenBLAS picked Prescott" (engine/src/core/blas_core.c); borrowed. */
const char* eng_blas_core_reason(void);
/* The GEMM library of f32 products and why, e.g. "oneDNN 2.6.3 for f32, OpenBLAS for f64" or "OpenBLAS
 * (ENGINE_GEMM=openblas)" (kernels/cpu/gemm.c); borrowed. */
const char* eng_gemm_library(void);
/* The engine host's start-up choice of OpenBLAS kernels from the CPU's features and ENGINE_BLAS_CORETYPE: returns
 * the OPENBLAS_CORETYPE to re-execute the process with (the environment already set for it), or NULL to go on.
 * eng_blas_core_exec_failed(errno) restores the environment when that exec fails. */
const char* eng_blas_core_select(void);
void eng_blas_core_exec_failed(int err);

/* Monotonic wall clock in seconds. */
double eng_time(void);

#endif
