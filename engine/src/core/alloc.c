/* alloc.c: the caching CPU allocator behind tensor storage.
 *
 * Blocks are rounded to size classes and kept on per-class free lists when
 * released, so a training loop that asks for the same sizes every step is
 * served from memory that was already touched (first-touch page faults cost
 * ~11 us per 4 KiB page on these machines).  Big blocks (>= 2 MiB) are mapped
 * on their own, 2 MiB aligned and advised as huge pages before anything
 * touches them: taken from the malloc heap they could reuse memory already
 * faulted in as 4 KiB pages (freed by MPI or an earlier malloc), and a buffer
 * in 4 KiB pages is copied ~1.3x slower (TLB misses).  Nothing is returned to
 * the system unless eng_alloc_empty_cache() is called.
 *
 * Collector pressure: Lua owns tensors through small wrappers whose storage
 * it does not see, so nothing would make it collect while a loop drops
 * megabytes of activations per iteration.  So the bytes in use (this
 * allocator's live blocks: tensor storages and communication buffers; plus
 * live CUDA storages) are compared with g_gc_threshold on every allocation,
 * and one that takes them past it raises g_gc_flag.  Nothing here calls Lua
 * (a C->Lua call from a JIT trace panics LuaJIT): the Lua layer reads the
 * flag (one load through the FFI) each time it wraps a new tensor, runs a
 * collection and sets the next threshold from the bytes still in use
 * (lua/engine/core.lua, docs/design.md "Allocator"). */
#include "core/internal.h"
#include "core/device.h"
#include <pthread.h>
#include <sys/mman.h>

typedef struct blk { struct blk* next; int64_t size; } blk;

#define NCLASS 4096
static blk* g_free[NCLASS];          /* hashed by class size */
static int64_t g_class_size[NCLASS];
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static eng_alloc_stats g_st;

/* Collector pressure: the CPU allocator's live bytes (g_st.allocated, under
 * g_mu) plus the bytes of live CUDA storages. */
static int64_t g_gc_dev;
static int64_t g_gc_threshold = (int64_t)64 << 20;
static volatile int32_t g_gc_flag;

static void gc_check(int64_t bytes) {
  int64_t th = __atomic_load_n(&g_gc_threshold, __ATOMIC_RELAXED);
  if (th >= 0 && bytes > th && !g_gc_flag) g_gc_flag = 1;
}

volatile int32_t* eng_alloc_gc_flag(void) { return &g_gc_flag; }

int64_t eng_alloc_gc_bytes(void) {
  return __atomic_load_n(&g_st.allocated, __ATOMIC_RELAXED) + __atomic_load_n(&g_gc_dev, __ATOMIC_RELAXED);
}

void eng_alloc_set_gc_threshold(int64_t bytes) {
  __atomic_store_n(&g_gc_threshold, bytes, __ATOMIC_RELAXED);
  g_gc_flag = bytes >= 0 && eng_alloc_gc_bytes() > bytes;
}

int64_t eng_alloc_get_gc_threshold(void) { return __atomic_load_n(&g_gc_threshold, __ATOMIC_RELAXED); }

/* Size classes: 64-byte granules up to 4 KiB, then 1/8-octave steps
 * (at most 12.5% waste), page-rounded. */
static int64_t round_size(int64_t n) {
  if (n <= 0) n = 1;
  if (n <= 4096) return (n + 63) & ~(int64_t)63;
  int64_t p = 1; while (p * 2 <= n) p *= 2;
  int64_t step = p / 8;
  int64_t r = ((n + step - 1) / step) * step;
  return (r + 4095) & ~(int64_t)4095;
}

#define BIG_BLOCK ((int64_t)2 << 20)

static void* sys_alloc(int64_t size) {
  void* p = NULL;
  if (size < BIG_BLOCK) return posix_memalign(&p, 64, (size_t)size) ? NULL : p;
  size_t len = (size_t)(size + BIG_BLOCK);
  char* m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return NULL;
  char* a = (char*)(((uintptr_t)m + (uintptr_t)BIG_BLOCK - 1) & ~(uintptr_t)(BIG_BLOCK - 1));
  size_t head = (size_t)(a - m), tail = len - head - (size_t)size;
  if (head) munmap(m, head);
  if (tail) munmap(a + size, tail);
  madvise(a, (size_t)size, MADV_HUGEPAGE);
  return a;
}

static void sys_free(void* p, int64_t size) {
  if (size < BIG_BLOCK) free(p);
  else munmap(p, (size_t)size);
}

static unsigned slot_of(int64_t size) {
  uint64_t h = (uint64_t)size * 0x9E3779B97F4A7C15ull;
  unsigned s = (unsigned)(h >> 52) & (NCLASS - 1);
  while (g_class_size[s] != 0 && g_class_size[s] != size) s = (s + 1) & (NCLASS - 1);
  return s;
}

void* eng_alloc_raw(int64_t nbytes, int64_t* got) {
  int64_t size = round_size(nbytes);
  void* p = NULL;
  pthread_mutex_lock(&g_mu);
  unsigned s = slot_of(size);
  if (g_free[s]) { blk* b = g_free[s]; g_free[s] = b->next; p = b; }
  g_st.n_allocs++;
  if (p) {
    g_st.allocated += size;
    if (g_st.allocated > g_st.peak_allocated) g_st.peak_allocated = g_st.allocated;
    gc_check(g_st.allocated + __atomic_load_n(&g_gc_dev, __ATOMIC_RELAXED));
  }
  pthread_mutex_unlock(&g_mu);
  if (!p) {
    p = sys_alloc(size);
    if (!p) return NULL;
    pthread_mutex_lock(&g_mu);
    g_st.n_system_allocs++;
    g_st.reserved += size;
    g_st.allocated += size;
    if (g_st.allocated > g_st.peak_allocated) g_st.peak_allocated = g_st.allocated;
    gc_check(g_st.allocated + __atomic_load_n(&g_gc_dev, __ATOMIC_RELAXED));
    pthread_mutex_unlock(&g_mu);
  }
  *got = size;
  return p;
}

void eng_free_raw(void* p, int64_t size) {
  if (!p) return;
  pthread_mutex_lock(&g_mu);
  unsigned s = slot_of(size);
  g_class_size[s] = size;
  blk* b = (blk*)p; b->size = size; b->next = g_free[s]; g_free[s] = b;
  g_st.allocated -= size;
  pthread_mutex_unlock(&g_mu);
}

void eng_alloc_get_stats(eng_alloc_stats* out) {
  pthread_mutex_lock(&g_mu); *out = g_st; pthread_mutex_unlock(&g_mu);
}

void eng_alloc_reset_peak(void) {
  pthread_mutex_lock(&g_mu); g_st.peak_allocated = g_st.allocated; pthread_mutex_unlock(&g_mu);
}

void eng_alloc_empty_cache(void) {
  pthread_mutex_lock(&g_mu);
  for (int s = 0; s < NCLASS; s++) {
    while (g_free[s]) { blk* b = g_free[s]; g_free[s] = b->next; g_st.reserved -= b->size; sys_free(b, b->size); }
  }
  pthread_mutex_unlock(&g_mu);
}

eng_storage* eng_storage_new(int64_t nbytes, int device) {
  const eng_device_ops* dv = eng_device_ops_of(device);
  if (device != ENG_CPU && device != ENG_META && !dv) return eng_errp("storage: invalid device code %d", device);
  eng_storage* s = calloc(1, sizeof *s);
  if (!s) return eng_errp("storage: out of memory");
  if (device == ENG_META) { /* no data; nbytes is what it would hold */
    s->nbytes = nbytes;
    s->refcount = 1;
    s->device = device;
    s->external = 1;
    return s;
  }
  if (dv) { /* the device runtime's allocator (for CUDA its caching stream-ordered one) */
    s->data = dv->alloc(nbytes);
    if (!s->data) { free(s); eng_err_prefix("storage"); return NULL; }
    s->nbytes = nbytes;
    s->refcount = 1;
    s->device = device;
    int64_t dev = __atomic_add_fetch(&g_gc_dev, nbytes, __ATOMIC_RELAXED);
    gc_check(__atomic_load_n(&g_st.allocated, __ATOMIC_RELAXED) + dev);
    return s;
  }
  int64_t got = 0;
  s->data = eng_alloc_raw(nbytes, &got);
  if (!s->data) { free(s); return eng_errp("storage: out of memory allocating %lld bytes", (long long)nbytes); }
  s->nbytes = got;
  s->refcount = 1;
  s->device = device;
  return s;
}

/* The device whose runtime gives pinned host memory (the first registered one). */
static const eng_device_ops* pinning_device(void) {
  for (int d = 0; d < ENG_MAX_DEVICES; d++) {
    const eng_device_ops* dv = eng_device_ops_of(d);
    if (dv && dv->host_alloc) return dv;
  }
  return NULL;
}

/* Pinned host memory (the device runtime's host_alloc): a CPU storage whose data the
 * device runtime copies to and from the device by DMA without staging
 * (external = 2: not the CPU allocator's; freed with the runtime's host_free). */
eng_storage* eng_storage_new_pinned(int64_t nbytes) {
  const eng_device_ops* dv = pinning_device();
  if (!dv) return eng_errp("pin_memory: no device runtime is registered to pin host memory");
  eng_storage* s = calloc(1, sizeof *s);
  if (!s) return eng_errp("storage: out of memory");
  s->data = dv->host_alloc(nbytes > 0 ? nbytes : 1);
  if (!s->data) { free(s); eng_err_prefix("pin_memory"); return NULL; }
  s->nbytes = nbytes > 0 ? nbytes : 1;
  s->refcount = 1;
  s->device = ENG_CPU;
  s->external = 2;
  return s;
}

/* FSDP frees the unsharded parameters between uses while their tensors (and
 * the aliases autograd saved) stay alive: the storage object keeps its
 * identity, its data goes (data NULL, nbytes 0) and comes back, refilled by
 * the next all-gather. */
void eng_storage_free_data(eng_storage* s) {
  if (!s || !s->data || s->external) return;
  const eng_device_ops* dv = eng_device_ops_of(s->device);
  if (dv) {
    __atomic_sub_fetch(&g_gc_dev, s->nbytes, __ATOMIC_RELAXED);
    dv->free(s->data);
  } else {
    eng_free_raw(s->data, s->nbytes);
  }
  s->data = NULL;
  s->nbytes = 0;
}

int eng_storage_alloc_data(eng_storage* s, int64_t nbytes) {
  if (!s || s->external) return eng_err("storage: cannot reallocate this storage");
  if (s->data) {
    if (s->nbytes >= nbytes) return 0;
    eng_storage_free_data(s);
  }
  if (nbytes <= 0) nbytes = 1;
  const eng_device_ops* dv = eng_device_ops_of(s->device);
  if (dv) {
    s->data = dv->alloc(nbytes);
    if (!s->data) { eng_err_prefix("storage"); return -1; }
    s->nbytes = nbytes;
    __atomic_add_fetch(&g_gc_dev, nbytes, __ATOMIC_RELAXED);
    return 0;
  }
  int64_t got = 0;
  s->data = eng_alloc_raw(nbytes, &got);
  if (!s->data) return eng_err("storage: out of memory allocating %lld bytes", (long long)nbytes);
  s->nbytes = got;
  return 0;
}

void eng_storage_retain(eng_storage* s) { __atomic_add_fetch(&s->refcount, 1, __ATOMIC_RELAXED); }

void eng_storage_release(eng_storage* s) {
  if (!s) return;
  if (__atomic_sub_fetch(&s->refcount, 1, __ATOMIC_ACQ_REL) != 0) return;
  if (s->external == 2) {
    const eng_device_ops* pin = pinning_device();
    if (pin) pin->host_free(s->data);
  } else if (!s->external) {
    const eng_device_ops* dv = eng_device_ops_of(s->device);
    if (dv) {
      __atomic_sub_fetch(&g_gc_dev, s->nbytes, __ATOMIC_RELAXED);
      dv->free(s->data);
    } else {
      eng_free_raw(s->data, s->nbytes);
    }
  }
  free(s);
}
