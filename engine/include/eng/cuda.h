/* cuda.h: the CUDA device runtime (engine/src/cuda/runtime.c).
 *
 * Availability never fails: eng_cuda_is_available() is 0 on a machine
 * without a GPU or a driver, and in a build without the CUDA backend; then
 * eng_cuda_unavailable_reason() says why ("CUDA is not available: ...") and
 * every function that needs a device returns -1 / NULL with that reason in
 * eng_last_error(), prefixed by the operation.  Only the runtime API is used
 * (cudart linked statically, never libcuda), so the library loads anywhere.
 *
 * Device: each process uses one GPU, chosen at first use as the node-local
 * rank (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID,
 * MV2_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID or LOCAL_RANK; else the world
 * rank, 0 before MPI starts) modulo the device count, unless
 * eng_cuda_set_device() chose one before.
 *
 * Streams: a compute stream (kernels, copies, allocation order), a
 * communication stream (collectives) and a reduce-scatter stream (so that an
 * all-gather never queues behind a reduce-scatter, as FSDP2's separate
 * streams); eng_cuda_stream_wait() orders one after
 * the other through an event, without a host sync.  Both are non-blocking
 * streams: nothing is ever queued on the legacy default stream.
 *
 * Allocator: a caching allocator, stream-ordered on the compute stream:
 * sizes are rounded to 512-byte granules (1/8-octave classes above 1 MiB),
 * a freed block goes back to its size class at once (later work on the
 * compute stream runs after earlier work, so reuse needs no sync), and
 * cudaMalloc is called only when no cached block fits; cudaFree only by
 * eng_cuda_empty_cache() or when an allocation would otherwise fail.  A
 * block also used on the communication stream is marked with
 * eng_cuda_record_stream(); on free it waits (an event) until that stream's
 * work queued so far is done before another allocation may take it.
 *
 * Copies: eng_cuda_memcpy_h2d / d2h stage pageable host memory through two
 * pinned buffers (double-buffered: the memcpy into one overlaps the DMA of
 * the other); pinned memory (eng_cuda_host_alloc) is copied directly. */
#ifndef ENG_CUDA_H
#define ENG_CUDA_H
#include <stdint.h>
#include <stddef.h>
#include "tensor.h"

typedef enum eng_cuda_stream_id {
  ENG_CUDA_STREAM_COMPUTE = 0,
  ENG_CUDA_STREAM_COMM = 1,   /* collectives, all-gathers included */
  ENG_CUDA_STREAM_REDUCE = 2, /* reduce-scatters (FSDP's gradients), beside the all-gathers */
  ENG_CUDA_NUM_STREAMS = 3
} eng_cuda_stream_id;

/* 1: this build has the CUDA backend (whether or not a GPU is present). */
int eng_cuda_built(void);
/* 1: a GPU is usable; 0 otherwise (never an error). */
int eng_cuda_is_available(void);
/* Number of usable GPUs; 0 when none or without the backend. */
int eng_cuda_device_count(void);
/* "" when available, else "CUDA is not available: <reason>".  Borrowed. */
const char* eng_cuda_unavailable_reason(void);
/* CUDA runtime / driver versions (e.g. 13000), 0 when unknown. */
int eng_cuda_runtime_version(void);
int eng_cuda_driver_version(void);
/* The node-local rank used to pick the default device (see above). */
int eng_cuda_local_rank(void);

/* Device selection (before or after first use; 0-based). */
int eng_cuda_set_device(int device);
/* The device this process uses (initializes it), or -1. */
int eng_cuda_current_device(void);
/* Name of a device into buf (NUL-terminated, truncated to buflen). */
int eng_cuda_device_name(int device, char* buf, int buflen);
/* PCI bus id of a device ("0000:1a:00.0") into buf (NUL-terminated, truncated to buflen). */
int eng_cuda_device_bus_id(int device, char* buf, int buflen);
typedef struct eng_cuda_device_props {
  char name[256];
  int major, minor;        /* compute capability */
  int sm_count;
  int clock_khz;           /* peak SM clock */
  int64_t total_memory;    /* bytes */
  int64_t l2_bytes;
} eng_cuda_device_props;
int eng_cuda_get_device_properties(int device, eng_cuda_device_props* out);

/* Waits for all work on both streams (and the device). */
int eng_cuda_synchronize(void);
/* cudaStream_t of a stream id (opaque here), NULL with an error. */
void* eng_cuda_stream(int which);
/* Timing events on the compute stream (the profiler): create (NULL without CUDA), record on the compute stream,
 * query (1 complete, 0 not yet, -1 error), the milliseconds between two recorded events (waits for the second;
 * negative on error), destroy. */
void* eng_cuda_event_create(void);
int eng_cuda_event_record(void* ev);
int eng_cuda_event_query(void* ev);
double eng_cuda_event_elapsed_ms(void* start, void* end);
void eng_cuda_event_destroy(void* ev);
/* The kernel trace (cuda/kernel_trace.c): every kernel, memcpy and memset the GPU runs, timed by CUPTI (libcupti
 * loaded at run time), summed by name.  start: 0, or -1 with the reason (no GPU, no libcupti); ENGINE_PROFILE_KERNELS=1
 * at launch starts it with the device and prints the report on stderr at exit (rank 0; =all: every rank).  report:
 * the table (kernel, calls, GPU ms, avg/min/max us, share) into buf (cap bytes with the NUL; NULL: only the length),
 * the length it needs; reset empties it. */
int eng_cuda_kernel_trace_start(void);
int eng_cuda_kernel_trace_active(void);
void eng_cuda_kernel_trace_reset(void);
int64_t eng_cuda_kernel_trace_report(char* buf, int64_t cap);
/* Later work on `waiter` runs after everything queued so far on
 * `signaller` (an event between the streams; no host sync). */
int eng_cuda_stream_wait(int waiter, int signaller);
int eng_cuda_stream_synchronize(int which);

/* Caching device allocator (see above).  eng_cuda_malloc never returns
 * NULL without an error; nbytes 0 gives a valid minimal block. */
void* eng_cuda_malloc(int64_t nbytes);
/* ptr must come from eng_cuda_malloc (NULL is a no-op). */
int eng_cuda_free(void* ptr);
/* Marks ptr as used by work queued on stream `which`. */
int eng_cuda_record_stream(void* ptr, int which);
/* Usable size of an allocated block (its size class), -1 if unknown. */
int64_t eng_cuda_block_size(void* ptr);
typedef struct eng_cuda_memory_stats {
  int64_t allocated;        /* bytes in live blocks */
  int64_t peak_allocated;   /* high-water mark of allocated */
  int64_t reserved;         /* bytes obtained with cudaMalloc (live + cached) */
  int64_t n_device_allocs;  /* cudaMalloc calls */
  int64_t n_device_frees;   /* cudaFree calls */
  int64_t n_allocs;         /* eng_cuda_malloc calls served */
  int64_t n_cache_hits;     /* of those, served from the cache */
  int64_t n_ooms;           /* allocations that failed */
  int64_t pinned_reserved;  /* pinned host bytes (staging + eng_cuda_host_alloc) */
} eng_cuda_memory_stats;
/* Zeros without the backend or before first use (not an error). */
int eng_cuda_get_memory_stats(eng_cuda_memory_stats* out);
int eng_cuda_reset_peak(void);
/* Returns every cached block to the driver (syncs the device). */
int eng_cuda_empty_cache(void);
/* cudaMemGetInfo of the current device. */
int eng_cuda_mem_get_info(int64_t* free_bytes, int64_t* total_bytes);

/* Pinned (page-locked) host memory. */
void* eng_cuda_host_alloc(int64_t nbytes);
int eng_cuda_host_free(void* ptr);

/* Copies, ordered on the compute stream.  h2d returns when src may be
 * reused (its bytes are staged or copied); d2h returns when dst holds the
 * data (after all earlier compute-stream work); d2d and memset are
 * asynchronous. */
int eng_cuda_memcpy_h2d(void* dst, const void* src, int64_t nbytes);
int eng_cuda_memcpy_d2h(void* dst, const void* src, int64_t nbytes);
int eng_cuda_memcpy_d2d(void* dst, const void* src, int64_t nbytes);
int eng_cuda_memset(void* dst, int value, int64_t nbytes);

/* For op implementations: 0 when status (a kernels/cuda kcu_* status) is 0,
 * else -1 with "<op>: CUDA kernel failed: <message>". */
int eng_cuda_check(int status, const char* op);

/* Deferred device error checks (engine/src/cuda/deferred.c): ops such as embedding and cross entropy do not
 * read their error flags back (no host sync per op); a bad index is raised, with the op's message, at the next
 * host synchronisation of the runtime (a device-to-host copy such as loss:item(), eng_cuda_synchronize), at
 * eng_cuda_poll_errors (no wait: the checks whose kernels are done; the optimizers call it at each step) or at
 * eng_cuda_check_errors (waits for the pending checks).  Both return 0, or -1 with the message.
 * eng_cuda_pending_checks: how many checks are pending.  eng_cuda_sync_count: host synchronisations the
 * runtime has performed (stream/device/event syncs, blocking copies) since start-up, for the specs ("a training
 * step performs none").  eng_deferred_test_flag: a check in plain host memory, complete at once, whose int the
 * caller sets (the specs check the bookkeeping and messages without a GPU); its message is
 * "<op>: test check failed (a = <a>, b = <b>)". */
int eng_cuda_poll_errors(void);
int eng_cuda_check_errors(void);
int eng_cuda_pending_checks(void);
int64_t eng_cuda_sync_count(void);
int* eng_deferred_test_flag(const char* op, int64_t a, int64_t b);
/* The process's cuBLASLt context (kernels/cuda/kcuda.h kcu_gemm_ctx*, with
 * a 32 MiB workspace from the allocator), created at first use. */
void* eng_cuda_gemm_context(void);

#endif
