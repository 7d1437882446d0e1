/* internal.h: helpers shared by the engine's sources (not public). */
#ifndef ENG_INTERNAL_H
#define ENG_INTERNAL_H
/* core's own public headers (what core defines); a file includes the public headers of whatever else it calls
 * (eng/dtensor.h, eng/comm.h, ...) and the private header of the folder it calls into */
#include "eng/base.h"
#include "eng/tensor.h"
#include "eng/autograd.h"   /* eng_node (a tensor's grad_fn), grad mode, the Lua dispatcher's type */
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#define ENG_MAX_DIMS 8

/* Errors: set the thread-local message; return -1 / NULL. */
int eng_err(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void* eng_errp(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
/* Prefix the current error message with "prefix: ". */
void eng_err_prefix(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
/* Every double handed to Lua (out-parameters, buffers Lua reads through the
 * FFI) goes through eng_lua_double / eng_lua_doubles.  LuaJIT tags values in
 * the NaN space: a NaN with some payloads (e.g. the f32 0xFFD00000 widened to
 * 0xFFFA000000000000) is read as a GC object and crashes it, so every NaN
 * becomes the one canonical quiet NaN. */
static inline double eng_lua_double(double v) {
  uint64_t u;
  memcpy(&u, &v, sizeof u);
  if ((u & 0x7fffffffffffffffULL) > 0x7ff0000000000000ULL) { u = 0x7ff8000000000000ULL; memcpy(&v, &u, sizeof v); }
  return v;
}
/* In place over n elements of a host buffer of dtype (f32 and f64; other
 * dtypes hold no NaN that LuaJIT sees as a number). */
void eng_lua_doubles(void* buf, int dtype, int64_t n);
/* "f32[2,3]" in a thread-local ring of 8 buffers (valid until 8 more calls). */
const char* eng_desc(const eng_tensor* t);
/* "[2,3]" in the same ring. */
const char* eng_shape_str(int ndim, const int64_t* shape);

/* Numbers in error messages follow the Lua convention (dims, indices and
 * positions in lists are 1-based; negative ones count from the end as in
 * Lua): a 0-based C position d is printed as ENG_U(d). */
#define ENG_U(d) ((d) >= 0 ? (long long)(d) + 1 : (long long)(d))

/* Normalizes dim (negative counts from the end) for a tensor of ndim dims;
 * returns -1 with an error naming op otherwise. */
int eng_norm_dim(int dim, int ndim, const char* op);

#define ENG_CHECK(t, op)                                                    \
  do { if (!(t)) return eng_errp("%s: tensor argument is nil/NULL", op); } while (0)
#define ENG_CHECK_I(t, op)                                                  \
  do { if (!(t)) return eng_err("%s: tensor argument is nil/NULL", op); } while (0)

/* Storage and allocator. */
eng_storage* eng_storage_new(int64_t nbytes, int device);
/* CPU storage over pinned host memory (eng_cuda_host_alloc; external = 2):
 * NULL with "pin_memory: CUDA is not available: ..." without a GPU. */
eng_storage* eng_storage_new_pinned(int64_t nbytes);
void eng_storage_retain(eng_storage* s);
void eng_storage_release(eng_storage* s);
void* eng_alloc_raw(int64_t nbytes, int64_t* got);
void eng_free_raw(void* p, int64_t nbytes);
/* Frees the data of s, keeping the object (data NULL, nbytes 0); alloc gives
 * it nbytes again (uninitialised; a no-op when it already has as much). */
void eng_storage_free_data(eng_storage* s);
int eng_storage_alloc_data(eng_storage* s, int64_t nbytes);

/* A contiguous tensor with fresh storage (no autograd). */
eng_tensor* eng_new(int ndim, const int64_t* shape, int dtype, int device);
/* The same in pinned host memory (a CPU tensor; see eng_storage_new_pinned). */
eng_tensor* eng_new_pinned(int ndim, const int64_t* shape, int dtype);
/* A view of base's storage with the given geometry (no autograd). */
eng_tensor* eng_view_of(const eng_tensor* base, int ndim, const int64_t* shape,
                        const int64_t* stride, int64_t offset);
/* A CPU tensor over memory the engine does not own (e.g. a mapped file); the
 * caller keeps data alive while the tensor lives and never writes through a
 * read-only mapping. */
eng_tensor* eng_wrap_external(void* data, int64_t nbytes, int ndim, const int64_t* shape, const int64_t* stride,
                              int64_t offset, int dtype);
void eng_contiguous_strides(int ndim, const int64_t* shape, int64_t* stride);
int64_t eng_shape_numel(int ndim, const int64_t* shape);
/* Checked shape arithmetic: every product of sizes, strides and element
 * sizes that makes a tensor goes through eng_mul_ok.  eng_numel_checked
 * computes the number of elements of a shape whose sizes are >= 0 and
 * verifies that it, and its size in bytes for dtype (dtype < 0: no byte
 * check), fit in an int64; else -1 with "<op>: shape [..] is too large". */
static inline int eng_mul_ok(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }
int eng_numel_checked(int ndim, const int64_t* shape, int dtype, int64_t* numel, const char* op);
/* A Lua number v stored into an element of dtype: an integer dtype takes
 * values in its range (truncated toward zero); NaN and out-of-range values
 * are an error naming op (PyTorch: "value cannot be converted to type
 * uint8_t without overflow").  Floating and bool dtypes take any value. */
int eng_check_value(double v, int dtype, const char* op);
int eng_same_shape(const eng_tensor* a, const eng_tensor* b);
/* Broadcast shapes; returns ndim of the result or -1 with an error naming op. */
int eng_broadcast_shapes(int na, const int64_t* sa, int nb, const int64_t* sb,
                         int64_t* out, const char* op, const eng_tensor* a, const eng_tensor* b);
/* 0 when x broadcasts to a's shape exactly (an in-place operand), else -1
 * with "<op>: x cannot be broadcast to the in-place target a". */
int eng_check_broadcast_to(const eng_tensor* a, const eng_tensor* x, const char* op);
/* Strides of t seen as shape (ndim >= t->ndim, broadcast dims get 0). */
void eng_broadcast_strides(const eng_tensor* t, int ndim, const int64_t* shape, int64_t* stride);
/* Element pointer helper. */
static inline char* eng_ptr(const eng_tensor* t) {
  return (char*)t->storage->data + t->offset * (int64_t)eng_dtype_size(t->dtype);
}
/* Raw strided copy with dtype conversion: dst geometry (shape) <- src with
 * the given (possibly broadcast) strides in elements. */
int eng_copy_raw(eng_tensor* dst, const eng_tensor* src, const int64_t* src_stride);  /* 0 / -1 (device errors) */
/* Zero n elements of t's storage from t's first element + first, on t's device (memset on the CPU, an
 * asynchronous device memset on the compute stream for CUDA; nothing on meta).  0 / -1. */
int eng_zero_elems(eng_tensor* t, int64_t first, int64_t n);
/* The node-local rank (the shared-memory communicator's) and the number of ranks on this node, set by comm/ when
 * the distributed runtime starts (-1 and 0 before). */
void eng_set_node_local_rank(int rank, int size);
int eng_node_local_rank(void);
int eng_node_local_size(void);
/* This process's world rank, set by comm/ when the distributed runtime starts (0 before): for messages and reports
 * of core/ (core does not call comm/). */
void eng_set_process_rank(int rank);
int eng_process_rank(void);
/* Appends printf(fmt, ...) (one line, at most 511 characters) to a report being built in buf[0, cap) at *len;
 * *len grows by the full length even past cap (buf NULL: only the length), as the report functions return it. */
void eng_text_append(char* buf, int64_t cap, int64_t* len, const char* fmt, ...) __attribute__((format(printf, 4, 5)));
/* A contiguous tensor of the given dtype with t's values (t itself retained
 * when already so).  No autograd. */
eng_tensor* eng_as_contig(eng_tensor* t, int dtype);
/* t itself (retained) when its last dim has stride 1 (or size <= 1), else a contiguous copy: for kernels that take
 * the outer strides (attention, the rotary embedding).  No autograd. */
eng_tensor* eng_unit_last_stride(eng_tensor* t);
/* Bump the version counter of t's storage (in-place writes). */
static inline void eng_bump_version(eng_tensor* t) { t->storage->version++; }
/* -1 with "<op>: <t> is a meta tensor (...)" when t is on the meta device. */
int eng_meta_check(const eng_tensor* t, const char* op);
/* The same, only in DTensor local mode: for checks placed before an op's
 * dispatcher guard, which sends meta operands to the dispatcher otherwise. */
int eng_meta_check_local(const eng_tensor* t, const char* op);
/* Error if t may not be written in place (leaf requiring grad in grad mode). */
int eng_check_inplace(eng_tensor* t, const char* op);
/* Memory overlap, PyTorch's MemOverlap / MemOverlapStatus.  Internal: ENG_OVERLAP_YES when some
 * elements of t share an address (a stride of 0 over a dim of size > 1: expand), NO when t is dense
 * without overlap, TOO_HARD otherwise.  Between a and b: NO (no shared byte), FULL (the same elements,
 * element for element), PARTIAL (both dense without overlap, sharing some bytes otherwise), TOO_HARD
 * (sharing bytes, one of them not dense). */
enum { ENG_OVERLAP_NO = 0, ENG_OVERLAP_YES, ENG_OVERLAP_FULL, ENG_OVERLAP_PARTIAL, ENG_OVERLAP_TOO_HARD };
int eng_internal_overlap(const eng_tensor* t);
int eng_overlap_status(const eng_tensor* a, const eng_tensor* b);
/* The checks of every in-place write (PyTorch's assert_no_internal_overlap and assert_no_partial_overlap):
 * -1 with "<op>: unsupported operation: ..." (PyTorch's messages, then the layouts), else 0. */
int eng_check_internal_overlap(const eng_tensor* t, const char* op);
int eng_check_partial_overlap(const eng_tensor* dst, const eng_tensor* src, const char* op);
/* src itself (retained) when an element-wise write of dst reading src is safe (no shared memory, or FULL),
 * else a fresh contiguous copy of src (NULL on failure). */
eng_tensor* eng_unaliased(eng_tensor* dst, eng_tensor* src);

/* A contiguous copy of t on device (same dtype and shape), no autograd: host <-> device through the device
 * runtime's copies (core/device.h); to_device (ops/copy.c) records the node. */
eng_tensor* eng_device_copy(eng_tensor* t, int device);
/* Registration point: autograd frees what it keeps on a dying tensor (grad_fn, hooks). */
void eng_tensor_set_autograd_free(void (*fn)(eng_tensor* t));

/* Lua closures behind hooks (core/lua_callback.c): the registered dispatcher (NULL before the host sets it), a
 * closure to release at Lua's next safe point, a module hook's call. */
eng_lua_dispatch_fn eng_lua_dispatcher(void);
void eng_lua_queue_release(int64_t id);
int eng_lua_dispatch_module(int64_t id, eng_tensor** ts, int n, eng_tensor** unused);

/* Threads. */
int eng_threads(void);

/* RNG (core/rng.c): reserve n stream positions of the global generator atomically;
 * returns the first offset and stores the generator's seed in *seed. */
uint64_t eng_rng_reserve_seeded(uint64_t n, uint64_t* seed);

#endif
