/* device.h: devices behind one table (a registration point; ggml's backend
 * buffer interface is the model).  Not public.
 *
 * Storage knows its device by a device code (ENG_CPU, ENG_CUDA, ENG_META of
 * the public header).  The CPU is core's own; the meta device has no data;
 * every other device registers a table of the few things core needs (memory,
 * copies, fills, random fills, events) when its runtime loads: cuda/device.c
 * for CUDA.  core/ never names a device runtime: it calls the table of the
 * storage's device.  A build without a device runtime registers no real
 * table for it (cuda/device.c registers one whose available() is 0 and whose
 * reason says the build has no CUDA backend). */
#ifndef ENG_CORE_DEVICE_H
#define ENG_CORE_DEVICE_H
#include "core/internal.h"

#define ENG_MAX_DEVICES 8

typedef struct eng_device_ops {
  const char* name;                    /* "cuda": messages ("f32[2]@cuda") */
  int (*available)(void);              /* a usable device is present */
  const char* (*unavailable_reason)(void); /* "CUDA is not available: ..." when not */
  /* device memory (the runtime's caching allocator) and pinned host memory; NULL with the error set */
  void* (*alloc)(int64_t nbytes);
  int (*free)(void* p);
  void* (*host_alloc)(int64_t nbytes);
  int (*host_free)(void* p);
  /* byte copies and fills (asynchronous on the runtime's compute stream where the runtime allows) */
  int (*copy_h2d)(void* dst, const void* src, int64_t nbytes);
  int (*copy_d2h)(void* dst, const void* src, int64_t nbytes);
  int (*copy_d2d)(void* dst, const void* src, int64_t nbytes);
  int (*memset)(void* dst, int value, int64_t nbytes);
  /* element copies with dtype conversion between strided layouts of one device; fills; random fills
   * (the same numbers as the CPU's counter-based generator: element i <- offset + i) */
  int (*copy_strided)(int ndim, const int64_t* shape, void* dst, int dst_dtype, const int64_t* dst_stride,
                      const void* src, int src_dtype, const int64_t* src_stride, const char* op);
  int (*fill)(void* dst, int dtype, int64_t n, double value, const char* op);
  int (*random)(int kind, int dtype, int64_t n, uint64_t seed, uint64_t offset, double a, double b, void* out,
                const char* op);
  int (*synchronize)(void);
  /* events for the profiler's device time (NULL: no device time) */
  void* (*event_create)(void);
  void (*event_destroy)(void* ev);
  int (*event_record)(void* ev);
  int (*event_query)(void* ev);        /* 1 done, 0 pending, -1 error */
  double (*event_elapsed_ms)(void* a, void* b);
} eng_device_ops;

/* Registers ops for device code dev (kept by pointer: a static table). */
void eng_device_register(int dev, const eng_device_ops* ops);
/* The table of dev, or NULL (the CPU, the meta device, an unknown code, a device no runtime registered). */
const eng_device_ops* eng_device_ops_of(int dev);
/* 1 for a device with its own memory (a registered table): not the CPU, not meta. */
static inline int eng_is_device(int dev) { return eng_device_ops_of(dev) != NULL; }
/* 0 when dev is the CPU, meta, or a registered device that is available; else -1 with "<op>: ..." (an invalid
 * code, or the device's unavailable reason). */
int eng_device_check(int dev, const char* op);
/* "cuda", "cpu", "meta" or "device<N>". */
const char* eng_device_name(int dev);

#endif
