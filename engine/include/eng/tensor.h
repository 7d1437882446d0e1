/* tensor.h: the tensor type, storage, creation, views and copies. */
#ifndef ENG_TENSOR_H
#define ENG_TENSOR_H
#include <stdint.h>
#include <stddef.h>

typedef struct eng_storage {
  int32_t refcount;
  int32_t device;
  void* data;
  int64_t nbytes;
  int32_t version;   /* bumped by in-place writes (autograd checks it) */
  int32_t external;  /* 1: data not owned by the allocator; 2: pinned host memory (eng_cuda_host_alloc) */
} eng_storage;

struct eng_node;
struct eng_hook_list;
struct eng_dist_spec;

/* A strided view over refcounted storage.  shape/stride/offset are in
 * elements.  Fields may be read from Lua; write them only through the API. */
typedef struct eng_tensor {
  int32_t refcount;
  int32_t dtype;
  int32_t device;
  int32_t ndim;
  int64_t shape[8];
  int64_t stride[8];
  int64_t offset;
  int64_t numel;
  eng_storage* storage;
  /* autograd */
  int32_t requires_grad;
  int32_t output_nr;          /* which output of grad_fn this is */
  int32_t retains_grad;
  int32_t is_param;           /* set by nn.Parameter; informational */
  struct eng_tensor* grad;    /* owned */
  struct eng_node* grad_fn;   /* owned; NULL for leaves */
  struct eng_node* grad_acc;  /* weak: the accumulator node of a leaf */
  struct eng_hook_list* hooks;      /* gradient hooks */
  struct eng_hook_list* post_hooks; /* post-accumulate-grad hooks (leaves) */
  struct eng_dist_spec* dist; /* DTensor spec; NULL for a plain tensor */
} eng_tensor;

/* Reference counting.  retain returns its argument. */
eng_tensor* eng_tensor_retain(eng_tensor* t);
void eng_tensor_release(eng_tensor* t);
int32_t eng_tensor_refcount(const eng_tensor* t);

/* Creation.  shape has ndim entries (ndim 0 is a scalar). */
eng_tensor* eng_tensor_empty(int ndim, const int64_t* shape, int dtype, int device);
eng_tensor* eng_tensor_zeros(int ndim, const int64_t* shape, int dtype, int device);
eng_tensor* eng_tensor_full(int ndim, const int64_t* shape, double value, int dtype, int device);
/* Copies n elements of src_dtype from data (converted to dtype). */
eng_tensor* eng_tensor_from_data(int ndim, const int64_t* shape, int dtype,
                                 const void* data, int src_dtype, int64_t n);
/* start, start+step, ... < end (or > end for negative step). */
eng_tensor* eng_tensor_arange(double start, double end, double step, int dtype, int device);
/* Same shape/dtype/device as t. */
eng_tensor* eng_tensor_empty_like(const eng_tensor* t);
eng_tensor* eng_tensor_zeros_like(const eng_tensor* t);

/* Pointer to the first element (storage data + offset). Borrowed. */
void* eng_tensor_data(const eng_tensor* t);
int eng_tensor_is_contiguous(const eng_tensor* t);
/* Element reads for Lua (item, get, read into f32/f64): every NaN comes back
 * as the canonical quiet NaN, since LuaJIT reads NaNs with some payloads as
 * tagged objects.  Values written from Lua numbers (full, fill_, set,
 * from_data with f32/f64 source, arange, masked_fill) into an integer dtype
 * must fit it: NaN or out of range is an error naming the op. */
/* Value of a one-element tensor as double. */
int eng_tensor_item(const eng_tensor* t, double* out);
/* Element at a 0-based multi-index (ndim entries) as double. */
int eng_tensor_get(const eng_tensor* t, const int64_t* index, double* out);
int eng_tensor_set(eng_tensor* t, const int64_t* index, double value);
/* Copies all elements, converted to dtype, into out (contiguous, row-major). */
int eng_tensor_read(const eng_tensor* t, void* out, int dtype, int64_t n);
/* "f32[2,3]" style description into buf; returns buf. */
const char* eng_tensor_describe(const eng_tensor* t, char* buf, int buflen);

/* In-place: dst <- src (broadcast to dst's shape, converted to dst's dtype).
 * Not recorded by autograd: an error if src requires grad under grad mode,
 * or if dst is a leaf that requires grad (use clone or no_grad). */
int eng_tensor_copy_(eng_tensor* dst, eng_tensor* src);
/* The memory-overlap checks of in-place writes (PyTorch's assert_no_internal_overlap, then
 * assert_no_partial_overlap when src is not NULL): 0, or -1 with "<op>: unsupported operation: more than
 * one element of the written-to tensor refers to a single memory location. ..." (dst has a stride of 0
 * over a dim of size > 1: an expanded view) or "... some elements of the input tensor and the written-to
 * tensor refer to a single memory location. ..." (src and dst are dense views sharing some elements, not
 * all).  copy_, the in-place arithmetic, clamp_, uniform_/normal_ and checkpoint loads run them; fill_
 * and zero_ do not (writing one value is idempotent, as in PyTorch). */
int eng_tensor_check_overlap(const eng_tensor* dst, const eng_tensor* src, const char* op);
int eng_tensor_fill_(eng_tensor* t, double value);
int eng_tensor_zero_(eng_tensor* t);

/* New tensors. */
eng_tensor* eng_tensor_clone(eng_tensor* t);
eng_tensor* eng_tensor_contiguous(eng_tensor* t);     /* t itself (retained) if contiguous */
eng_tensor* eng_tensor_to_dtype(eng_tensor* t, int dtype); /* t itself if same dtype */
/* A copy on device (ENG_CPU / ENG_CUDA), t itself (retained) when already
 * there; differentiable (the gradient goes back to t's device).  Host <->
 * device through the CUDA runtime's pinned staging buffers.  Without a GPU:
 * NULL with "to_device: CUDA is not available: <reason>". */
eng_tensor* eng_tensor_to_device(eng_tensor* t, int device);
/* A contiguous copy of CPU tensor t (same dtype and shape) in pinned
 * (page-locked) host memory, which the CUDA runtime copies to and from the
 * device by DMA without staging (PyTorch's pin_memory()); t itself (retained)
 * when already pinned and contiguous; no autograd.  Needs a GPU: without one, NULL with
 * "pin_memory: CUDA is not available: <reason>".  A DTensor is refused. */
eng_tensor* eng_tensor_pin_memory(eng_tensor* t);
/* 1 when t's data is pinned host memory (eng_tensor_pin_memory), else 0. */
int eng_tensor_is_pinned(const eng_tensor* t);
/* t takes src's data (storage, dtype, device, geometry) in place, keeping
 * its identity, flags, hooks and .grad (like PyTorch's `t.data = src`):
 * module.to() converts parameters with it.  t must be a leaf; a .grad must
 * already match src (dtype, device, shape).  A DTensor t keeps its layout and
 * takes src (a plain tensor of its local shape) as its local shard
 * (module:to_empty materialises meta DTensor parameters this way). */
int eng_tensor_set_data(eng_tensor* t, eng_tensor* src);
/* Shares storage, no autograd history, requires_grad = 0. */
eng_tensor* eng_tensor_detach(eng_tensor* t);

/* Autograd flags. */
int eng_tensor_set_requires_grad(eng_tensor* t, int flag);
/* Borrowed; NULL if none. */
eng_tensor* eng_tensor_grad(eng_tensor* t);
/* Replace .grad (g may be NULL); takes a new reference to g. */
int eng_tensor_set_grad(eng_tensor* t, eng_tensor* g);
int eng_tensor_retain_grad(eng_tensor* t);
/* Version counter of t's storage. */
int32_t eng_tensor_version(const eng_tensor* t);

/* Number of live eng_tensor objects (for leak checks). */
int64_t eng_tensor_live_count(void);

/* torch.chunk: size and offset of chunk idx when n elements go to k chunks (chunk = ceil(n/k); chunks past the end
 * are empty with offset n).  0, or -1 for k < 1, idx outside [0, k) or n < 0. */
int eng_shard_size_and_offset(int64_t n, int k, int idx, int64_t* size, int64_t* offset);

#endif
