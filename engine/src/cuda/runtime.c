/* Subsystem cuda/: the CUDA device runtime (availability, streams, memory,
 * events, copies), its device table for core (cuda/device.c), its own kernels
 * (cuda/primitives.c) and the deferred device error checks (cuda/deferred.c).
 * The device side of the ops lives with the ops (ops/cuda_*.c).
 * May call: core/, kernels/cuda/.  Built without nvcc too (every function
 * then reports that there is no CUDA backend). */
/* runtime.c: the CUDA device runtime of the engine (public API in
 * eng/cuda.h): availability, device selection, the compute and
 * communication streams, the caching stream-ordered device allocator,
 * pinned staging buffers and host <-> device copies.
 *
 * Only the CUDA runtime API is used (cudart is linked statically and loads
 * the driver itself), so the library starts on machines without a GPU or a
 * driver: cudaGetDeviceCount then fails (error 35 without a driver) and
 * every device function reports "CUDA is not available: <reason>".  A build
 * without the CUDA backend (no ENG_HAVE_CUDA) has the same functions, which
 * report that this build has no CUDA backend. */
#include "core/internal.h"
#include "eng/cuda.h"
#include "cuda/cuda_runtime.h"
#include <stdio.h>
#include <pthread.h>

#define NOCUDA_REASON \
  "CUDA is not available: this build has no CUDA backend (nvcc was not found at configure time, or -DENABLE_CUDA=OFF)"

int eng_cuda_local_rank(void) {
  /* once the distributed runtime runs: the shared-memory communicator's rank (right on any node, with any
   * launcher); before it, the launcher's variables */
  if (eng_node_local_rank() >= 0) return eng_node_local_rank();
  static const char* const vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                                     "SLURM_LOCALID", "LOCAL_RANK"};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
    const char* v = getenv(vars[i]);
    if (v && *v) {
      char* end;
      long r = strtol(v, &end, 10);
      if (*end == '\0' && r >= 0 && r < 1 << 20) return (int)r;
    }
  }
  return 0; /* no launcher variable and no MPI yet: device 0 (MPI starts with the engine host, before any CUDA use) */
}

#ifdef ENG_HAVE_CUDA
#include <cuda_runtime_api.h>
#include "kernels/cuda/kcuda.h"

/* ---------------------------------------------------------------- probe */
static pthread_once_t g_probe_once = PTHREAD_ONCE_INIT;
static int g_count;
static char g_reason[512];
static int g_runtime_version, g_driver_version;

static void probe(void) {
  cudaRuntimeGetVersion(&g_runtime_version);
  cudaDriverGetVersion(&g_driver_version);
  const char* off = getenv("ENGINE_DISABLE_CUDA");
  if (off && *off && strcmp(off, "0") != 0) {
    snprintf(g_reason, sizeof g_reason, "CUDA is not available: disabled by ENGINE_DISABLE_CUDA=%s", off);
    return;
  }
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    const char* what = e == cudaErrorInsufficientDriver && g_driver_version == 0
                           ? "no NVIDIA driver is installed or loaded on this machine"
                           : (e == cudaErrorNoDevice ? "no CUDA GPU found" : "the CUDA runtime could not start");
    snprintf(g_reason, sizeof g_reason,
             "CUDA is not available: %s (cudaGetDeviceCount returned %d %s: %s; runtime %d, driver %d)", what, (int)e,
             cudaGetErrorName(e), cudaGetErrorString(e), g_runtime_version, g_driver_version);
    return;
  }
  if (n <= 0) {
    snprintf(g_reason, sizeof g_reason, "CUDA is not available: no CUDA GPU found (cudaGetDeviceCount returned 0)");
    return;
  }
  g_count = n;
}

int eng_cuda_built(void) { return 1; }
int eng_cuda_device_count(void) { pthread_once(&g_probe_once, probe); return g_count; }
int eng_cuda_is_available(void) { return eng_cuda_device_count() > 0; }
const char* eng_cuda_unavailable_reason(void) { pthread_once(&g_probe_once, probe); return g_count > 0 ? "" : g_reason; }
int eng_cuda_runtime_version(void) { pthread_once(&g_probe_once, probe); return g_runtime_version; }
int eng_cuda_driver_version(void) { pthread_once(&g_probe_once, probe); return g_driver_version; }

static int cuerr(cudaError_t e, const char* op, const char* what) {
  cudaGetLastError();
  return eng_err("%s: %s failed: CUDA error %d %s: %s", op, what, (int)e, cudaGetErrorName(e), cudaGetErrorString(e));
}

/* Host synchronisations go through these two, which count them (eng_cuda_sync_count); an event that has
 * completed already costs no wait and is not counted. */
static cudaError_t stream_sync(cudaStream_t s) {
  eng_cuda_count_sync();
  return cudaStreamSynchronize(s);
}
static cudaError_t event_sync(cudaEvent_t ev) {
  cudaError_t e = cudaEventQuery(ev);
  if (e != cudaErrorNotReady) return e;
  eng_cuda_count_sync();
  return cudaEventSynchronize(ev);
}


/* ---------------------------------------------------------------- device and streams */
static pthread_mutex_t g_init_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_ready;
static int g_dev = -1;
static cudaStream_t g_stream[ENG_CUDA_NUM_STREAMS];
static cudaEvent_t g_stream_ev[ENG_CUDA_NUM_STREAMS];

/* Initializes the device on first use; sets it current on this thread. */
static int ensure(const char* op) {
  if (!eng_cuda_is_available()) return eng_err("%s: %s", op, g_reason);
  pthread_mutex_lock(&g_init_mu);
  if (!g_ready) {
    if (g_dev < 0) g_dev = eng_cuda_local_rank() % g_count;
    cudaError_t e = cudaSetDevice(g_dev);
    for (int i = 0; i < ENG_CUDA_NUM_STREAMS && e == cudaSuccess; i++) {
      e = cudaStreamCreateWithFlags(&g_stream[i], cudaStreamNonBlocking);
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(&g_stream_ev[i], cudaEventDisableTiming);
    }
    if (e != cudaSuccess) {
      pthread_mutex_unlock(&g_init_mu);
      return cuerr(e, op, "initializing the CUDA device");
    }
    g_ready = 1;
    pthread_mutex_unlock(&g_init_mu);
    eng_cuda_kernel_trace_autostart(); /* ENGINE_PROFILE_KERNELS */
  } else {
    pthread_mutex_unlock(&g_init_mu);
  }
  cudaError_t e = cudaSetDevice(g_dev);
  if (e != cudaSuccess) return cuerr(e, op, "cudaSetDevice");
  return 0;
}

static int check_stream_id(int which, const char* op) {
  if (which < 0 || which >= ENG_CUDA_NUM_STREAMS)
    return eng_err("%s: invalid stream id %d (0 = compute, 1 = communication, 2 = reduce-scatter)", op, which);
  return 0;
}

int eng_cuda_set_device(int device) {
  const char* op = "cuda set_device";
  if (!eng_cuda_is_available()) return eng_err("%s: %s", op, g_reason);
  if (device < 0 || device >= g_count)
    return eng_err("%s: device %d does not exist (%d device%s: 0..%d)", op, device, g_count, g_count == 1 ? "" : "s",
                   g_count - 1);
  pthread_mutex_lock(&g_init_mu);
  int ready = g_ready, cur = g_dev;
  if (!ready) g_dev = device;
  pthread_mutex_unlock(&g_init_mu);
  if (ready && cur != device)
    return eng_err("%s: this process already uses device %d; choose the device before the first CUDA use", op, cur);
  return 0;
}

int eng_cuda_current_device(void) {
  if (ensure("cuda current_device")) return -1;
  return g_dev;
}

void* eng_cuda_event_create(void) {
  if (!eng_cuda_is_available()) return NULL;
  cudaEvent_t e;
  if (cudaEventCreate(&e) != cudaSuccess) { cudaGetLastError(); return NULL; }
  return (void*)e;
}
int eng_cuda_event_record(void* ev) {
  void* s = ev ? eng_cuda_stream(ENG_CUDA_STREAM_COMPUTE) : NULL;
  if (!s) return -1;
  if (cudaEventRecord((cudaEvent_t)ev, (cudaStream_t)s) != cudaSuccess) { cudaGetLastError(); return -1; }
  return 0;
}
int eng_cuda_event_query(void* ev) {
  if (!ev) return -1;
  cudaError_t e = cudaEventQuery((cudaEvent_t)ev);
  if (e == cudaSuccess) return 1;
  if (e == cudaErrorNotReady) return 0;
  cudaGetLastError();
  return -1;
}
double eng_cuda_event_elapsed_ms(void* start, void* end) {
  if (!start || !end || event_sync((cudaEvent_t)end) != cudaSuccess) { cudaGetLastError(); return -1; }
  float ms = 0;
  if (cudaEventElapsedTime(&ms, (cudaEvent_t)start, (cudaEvent_t)end) != cudaSuccess) { cudaGetLastError(); return -1; }
  return ms;
}
void eng_cuda_event_destroy(void* ev) { if (ev) cudaEventDestroy((cudaEvent_t)ev); }

int eng_cuda_device_bus_id(int device, char* buf, int buflen) {
  const char* op = "cuda device_bus_id";
  if (!buf || buflen < 1) return eng_err("%s: no buffer", op);
  if (!eng_cuda_is_available()) return eng_err("%s: %s", op, g_reason);
  if (device < 0 || device >= g_count) return eng_err("%s: device %d does not exist (%d devices)", op, device, g_count);
  cudaError_t e = cudaDeviceGetPCIBusId(buf, buflen, device);
  if (e != cudaSuccess) return cuerr(e, op, "cudaDeviceGetPCIBusId");
  return 0;
}

int eng_cuda_get_device_properties(int device, eng_cuda_device_props* out) {
  const char* op = "cuda get_device_properties";
  if (!out) return eng_err("%s: output pointer is NULL", op);
  if (!eng_cuda_is_available()) return eng_err("%s: %s", op, g_reason);
  if (device < 0 || device >= g_count) return eng_err("%s: device %d does not exist (%d devices)", op, device, g_count);
  struct cudaDeviceProp p;
  cudaError_t e = cudaGetDeviceProperties(&p, device);
  if (e != cudaSuccess) return cuerr(e, op, "cudaGetDeviceProperties");
  memset(out, 0, sizeof *out);
  snprintf(out->name, sizeof out->name, "%s", p.name);
  out->major = p.major;
  out->minor = p.minor;
  out->sm_count = p.multiProcessorCount;
  out->total_memory = (int64_t)p.totalGlobalMem;
  out->l2_bytes = p.l2CacheSize;
  int clk = 0;
  if (cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, device) != cudaSuccess) { cudaGetLastError(); clk = 0; }
  out->clock_khz = clk;
  return 0;
}

int eng_cuda_device_name(int device, char* buf, int buflen) {
  const char* op = "cuda device_name";
  if (!buf || buflen < 1) return eng_err("%s: output buffer is NULL or empty", op);
  if (!eng_cuda_is_available()) return eng_err("%s: %s", op, g_reason);
  if (device < 0 || device >= g_count) return eng_err("%s: device %d does not exist (%d devices)", op, device, g_count);
  struct cudaDeviceProp p;
  cudaError_t e = cudaGetDeviceProperties(&p, device);
  if (e != cudaSuccess) return cuerr(e, op, "cudaGetDeviceProperties");
  snprintf(buf, (size_t)buflen, "%s", p.name);
  return 0;
}

void* eng_cuda_stream(int which) {
  if (check_stream_id(which, "cuda stream") || ensure("cuda stream")) return NULL;
  return (void*)g_stream[which];
}

int eng_cuda_stream_wait(int waiter, int signaller) {
  const char* op = "cuda stream_wait";
  if (check_stream_id(waiter, op) || check_stream_id(signaller, op) || ensure(op)) return -1;
  if (waiter == signaller) return 0;
  cudaError_t e = cudaEventRecord(g_stream_ev[signaller], g_stream[signaller]);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(g_stream[waiter], g_stream_ev[signaller], 0);
  return e == cudaSuccess ? 0 : cuerr(e, op, "cudaStreamWaitEvent");
}

int eng_cuda_stream_synchronize(int which) {
  const char* op = "cuda stream_synchronize";
  if (check_stream_id(which, op) || ensure(op)) return -1;
  cudaError_t e = stream_sync(g_stream[which]);
  if (e != cudaSuccess) return cuerr(e, op, "cudaStreamSynchronize");
  return which == ENG_CUDA_STREAM_COMPUTE ? eng_cuda_after_sync() : 0;
}

int eng_cuda_synchronize(void) {
  const char* op = "cuda synchronize";
  if (ensure(op)) return -1;
  eng_cuda_count_sync();
  cudaError_t e = cudaDeviceSynchronize();
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) return cuerr(e, op, "cudaDeviceSynchronize");
  return eng_cuda_after_sync();
}

int eng_cuda_check(int status, const char* op) {
  if (status == 0) return 0;
  return eng_err("%s: CUDA kernel failed: %s", op ? op : "cuda", kcu_status_string(status));
}

/* ---------------------------------------------------------------- caching allocator */
typedef struct cblock {
  void* ptr;
  int64_t size;
  int in_use, pending;
  unsigned streams;       /* bit s: used on stream s (other than compute) */
  cudaEvent_t ev;         /* recorded on those streams at free (created lazily) */
  struct cblock* hnext;   /* pointer hash chain (every block) */
  struct cblock* fnext;   /* free list of its size class, or the pending list */
} cblock;

#define NBUCKET 4096
#define NCLASS 4096
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static cblock* g_by_ptr[NBUCKET];
static cblock* g_free[NCLASS];
static int64_t g_class_size[NCLASS];
static cblock* g_pending;
static eng_cuda_memory_stats g_st;

/* 512-byte granules up to 1 MiB, then 1/8-octave steps (<= 12.5% waste). */
static int64_t round_size(int64_t n) {
  if (n <= 0) n = 1;
  if (n <= (1 << 20)) return (n + 511) & ~(int64_t)511;
  int64_t p = 1;
  while (p * 2 <= n) p *= 2;
  int64_t step = p / 8;
  return ((n + step - 1) / step) * step;
}

static unsigned bucket_of(const void* p) {
  uint64_t h = (uint64_t)(uintptr_t)p * 0x9E3779B97F4A7C15ull;
  return (unsigned)(h >> 52) & (NBUCKET - 1);
}

static unsigned class_slot(int64_t size) {
  uint64_t h = (uint64_t)size * 0x9E3779B97F4A7C15ull;
  unsigned s = (unsigned)(h >> 52) & (NCLASS - 1);
  while (g_class_size[s] != 0 && g_class_size[s] != size) s = (s + 1) & (NCLASS - 1);
  return s;
}

static cblock* find_block(const void* p) {
  for (cblock* b = g_by_ptr[bucket_of(p)]; b; b = b->hnext)
    if (b->ptr == p) return b;
  return NULL;
}

static void push_free(cblock* b) {
  unsigned s = class_slot(b->size);
  g_class_size[s] = b->size;
  b->fnext = g_free[s];
  g_free[s] = b;
}

/* Pending blocks whose other-stream work has finished become free. */
static void reap_pending(void) {
  cblock** pp = &g_pending;
  while (*pp) {
    cblock* b = *pp;
    cudaError_t e = cudaEventQuery(b->ev);
    if (e == cudaErrorNotReady) { pp = &b->fnext; continue; }
    if (e != cudaSuccess) cudaGetLastError();
    *pp = b->fnext;
    b->pending = 0;
    push_free(b);
  }
}

static void destroy_block(cblock* b) {
  cblock** pp = &g_by_ptr[bucket_of(b->ptr)];
  while (*pp != b) pp = &(*pp)->hnext;
  *pp = b->hnext;
  cudaFree(b->ptr);
  if (b->ev) cudaEventDestroy(b->ev);
  g_st.reserved -= b->size;
  g_st.n_device_frees++;
  free(b);
}

/* Frees every cached and pending block (after a device sync). */
static void release_cached_locked(void) {
  eng_cuda_count_sync();
  cudaDeviceSynchronize();
  cudaGetLastError();
  reap_pending();
  for (int s = 0; s < NCLASS; s++) {
    while (g_free[s]) {
      cblock* b = g_free[s];
      g_free[s] = b->fnext;
      destroy_block(b);
    }
  }
}

void* eng_cuda_malloc(int64_t nbytes) {
  const char* op = "cuda malloc";
  if (nbytes < 0) return eng_errp("%s: negative size %lld", op, (long long)nbytes);
  if (ensure(op)) return NULL;
  int64_t size = round_size(nbytes);
  pthread_mutex_lock(&g_mu);
  if (g_pending) reap_pending();
  unsigned s = class_slot(size);
  cblock* b = g_free[s];
  if (b) {
    g_free[s] = b->fnext;
    g_st.n_cache_hits++;
  } else {
    void* p = NULL;
    cudaError_t e = cudaMalloc(&p, (size_t)size);
    if (e != cudaSuccess) {
      cudaGetLastError();
      release_cached_locked();
      e = cudaMalloc(&p, (size_t)size);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      g_st.n_ooms++;
      int64_t alloc = g_st.allocated, res = g_st.reserved;
      pthread_mutex_unlock(&g_mu);
      size_t fr = 0, tot = 0;
      if (cudaMemGetInfo(&fr, &tot) != cudaSuccess) cudaGetLastError();
      return eng_errp("%s: CUDA out of memory allocating %lld bytes on device %d (%lld bytes in use by tensors, "
                      "%lld reserved by the allocator; device free %lld of %lld): %s",
                      op, (long long)nbytes, g_dev, (long long)alloc, (long long)res, (long long)fr, (long long)tot,
                      cudaGetErrorString(e));
    }
    b = calloc(1, sizeof *b);
    if (!b) {
      cudaFree(p);
      pthread_mutex_unlock(&g_mu);
      return eng_errp("%s: out of host memory", op);
    }
    b->ptr = p;
    b->size = size;
    unsigned h = bucket_of(p);
    b->hnext = g_by_ptr[h];
    g_by_ptr[h] = b;
    g_st.reserved += size;
    g_st.n_device_allocs++;
  }
  b->in_use = 1;
  b->streams = 0;
  b->fnext = NULL;
  g_st.n_allocs++;
  g_st.allocated += size;
  if (g_st.allocated > g_st.peak_allocated) g_st.peak_allocated = g_st.allocated;
  void* p = b->ptr;
  pthread_mutex_unlock(&g_mu);
  return p;
}

int eng_cuda_free(void* ptr) {
  const char* op = "cuda free";
  if (!ptr) return 0;
  if (ensure(op)) return -1;
  pthread_mutex_lock(&g_mu);
  cblock* b = find_block(ptr);
  if (!b || !b->in_use) {
    pthread_mutex_unlock(&g_mu);
    return eng_err("%s: %p was not allocated by eng_cuda_malloc (or was freed already)", op, ptr);
  }
  b->in_use = 0;
  g_st.allocated -= b->size;
  if (b->streams) {
    /* one event after the work queued so far on every stream that used the block: the last of them waits
     * for the others (rare: a block used on both communication streams), then records it */
    int last = -1;
    cudaError_t e = b->ev ? cudaSuccess : cudaEventCreateWithFlags(&b->ev, cudaEventDisableTiming);
    for (int i = 1; i < ENG_CUDA_NUM_STREAMS && e == cudaSuccess; i++) {
      if (!(b->streams & (1u << i))) continue;
      if (last >= 0) {
        e = cudaEventRecord(g_stream_ev[last], g_stream[last]);
        if (e == cudaSuccess) e = cudaStreamWaitEvent(g_stream[i], g_stream_ev[last], 0);
      }
      last = i;
    }
    if (e == cudaSuccess) e = cudaEventRecord(b->ev, g_stream[last]);
    if (e == cudaSuccess) {
      b->pending = 1;
      b->fnext = g_pending;
      g_pending = b;
    } else {
      /* no event: wait for the stream instead, then cache the block */
      cudaGetLastError();
      for (int i = 1; i < ENG_CUDA_NUM_STREAMS; i++)
        if (b->streams & (1u << i)) stream_sync(g_stream[i]);
      cudaGetLastError();
      push_free(b);
    }
  } else {
    push_free(b);
  }
  pthread_mutex_unlock(&g_mu);
  return 0;
}

int eng_cuda_record_stream(void* ptr, int which) {
  const char* op = "cuda record_stream";
  if (check_stream_id(which, op) || ensure(op)) return -1;
  pthread_mutex_lock(&g_mu);
  cblock* b = find_block(ptr);
  int ok = b && b->in_use;
  if (ok && which != ENG_CUDA_STREAM_COMPUTE) b->streams |= 1u << which;
  pthread_mutex_unlock(&g_mu);
  if (!ok) return eng_err("%s: %p is not a live block of eng_cuda_malloc", op, ptr);
  return 0;
}

int64_t eng_cuda_block_size(void* ptr) {
  if (!eng_cuda_is_available()) return -1;
  pthread_mutex_lock(&g_mu);
  cblock* b = find_block(ptr);
  int64_t r = b && b->in_use ? b->size : -1;
  pthread_mutex_unlock(&g_mu);
  return r;
}

int eng_cuda_get_memory_stats(eng_cuda_memory_stats* out) {
  if (!out) return eng_err("cuda get_memory_stats: output pointer is NULL");
  pthread_mutex_lock(&g_mu);
  *out = g_st;
  pthread_mutex_unlock(&g_mu);
  return 0;
}

int eng_cuda_reset_peak(void) {
  pthread_mutex_lock(&g_mu);
  g_st.peak_allocated = g_st.allocated;
  pthread_mutex_unlock(&g_mu);
  return 0;
}

int eng_cuda_empty_cache(void) {
  if (ensure("cuda empty_cache")) return -1;
  pthread_mutex_lock(&g_mu);
  release_cached_locked();
  pthread_mutex_unlock(&g_mu);
  return 0;
}

int eng_cuda_mem_get_info(int64_t* free_bytes, int64_t* total_bytes) {
  const char* op = "cuda mem_get_info";
  if (!free_bytes || !total_bytes) return eng_err("%s: output pointer is NULL", op);
  if (ensure(op)) return -1;
  size_t f = 0, t = 0;
  cudaError_t e = cudaMemGetInfo(&f, &t);
  if (e != cudaSuccess) return cuerr(e, op, "cudaMemGetInfo");
  *free_bytes = (int64_t)f;
  *total_bytes = (int64_t)t;
  return 0;
}

/* ---------------------------------------------------------------- pinned memory */
typedef struct pinned { void* p; int64_t size; struct pinned* next; } pinned;
static pinned* g_pinned;

void* eng_cuda_host_alloc(int64_t nbytes) {
  const char* op = "cuda host_alloc";
  if (nbytes < 0) return eng_errp("%s: negative size %lld", op, (long long)nbytes);
  if (ensure(op)) return NULL;
  pinned* rec = malloc(sizeof *rec);
  if (!rec) return eng_errp("%s: out of host memory", op);
  void* p = NULL;
  cudaError_t e = cudaHostAlloc(&p, (size_t)(nbytes > 0 ? nbytes : 1), cudaHostAllocDefault);
  if (e != cudaSuccess) {
    free(rec);
    cuerr(e, op, "cudaHostAlloc");
    return NULL;
  }
  rec->p = p;
  rec->size = nbytes > 0 ? nbytes : 1;
  pthread_mutex_lock(&g_mu);
  rec->next = g_pinned;
  g_pinned = rec;
  g_st.pinned_reserved += rec->size;
  pthread_mutex_unlock(&g_mu);
  return p;
}

int eng_cuda_host_free(void* ptr) {
  const char* op = "cuda host_free";
  if (!ptr) return 0;
  pthread_mutex_lock(&g_mu);
  pinned** pp = &g_pinned;
  while (*pp && (*pp)->p != ptr) pp = &(*pp)->next;
  pinned* rec = *pp;
  if (rec) {
    *pp = rec->next;
    g_st.pinned_reserved -= rec->size;
  }
  pthread_mutex_unlock(&g_mu);
  if (!rec) return eng_err("%s: %p was not allocated by eng_cuda_host_alloc", op, ptr);
  free(rec);
  cudaError_t e = cudaFreeHost(ptr);
  return e == cudaSuccess ? 0 : cuerr(e, op, "cudaFreeHost");
}

/* ---------------------------------------------------------------- copies */
#define STAGE_BYTES (8 << 20)
static pthread_mutex_t g_copy_mu = PTHREAD_MUTEX_INITIALIZER;
static void* g_stage[2];
static cudaEvent_t g_stage_ev[2];

static int stage_init(const char* op) {
  if (g_stage[0]) return 0;
  for (int i = 0; i < 2; i++) {
    cudaError_t e = cudaHostAlloc(&g_stage[i], STAGE_BYTES, cudaHostAllocDefault);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&g_stage_ev[i], cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(g_stage_ev[i], g_stream[ENG_CUDA_STREAM_COMPUTE]);
    if (e != cudaSuccess) {
      for (int j = 0; j <= i; j++) {
        if (g_stage[j]) cudaFreeHost(g_stage[j]);
        g_stage[j] = NULL;
      }
      return cuerr(e, op, "allocating pinned staging buffers");
    }
  }
  pthread_mutex_lock(&g_mu);
  g_st.pinned_reserved += 2 * (int64_t)STAGE_BYTES;
  pthread_mutex_unlock(&g_mu);
  return 0;
}

static int is_pinned(const void* p) {
  struct cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) { cudaGetLastError(); return 0; }
  return a.type == cudaMemoryTypeHost;
}

static int copy_args(const char* op, const void* dst, const void* src, int64_t n) {
  if (n < 0) return eng_err("%s: negative byte count %lld", op, (long long)n);
  if (n > 0 && (!dst || !src)) return eng_err("%s: NULL pointer (dst %p, src %p)", op, dst, src);
  return ensure(op);
}

int eng_cuda_memcpy_h2d(void* dst, const void* src, int64_t n) {
  const char* op = "cuda memcpy_h2d";
  if (copy_args(op, dst, src, n)) return -1;
  if (n == 0) return 0;
  cudaStream_t s = g_stream[ENG_CUDA_STREAM_COMPUTE];
  cudaError_t e;
  if (is_pinned(src)) {
    e = cudaMemcpyAsync(dst, src, (size_t)n, cudaMemcpyHostToDevice, s);
    if (e == cudaSuccess) e = stream_sync(s);
    return e == cudaSuccess ? 0 : cuerr(e, op, "cudaMemcpyAsync");
  }
  pthread_mutex_lock(&g_copy_mu);
  if (stage_init(op)) { pthread_mutex_unlock(&g_copy_mu); return -1; }
  e = cudaSuccess;
  int k = 0;
  for (int64_t off = 0; off < n && e == cudaSuccess; off += STAGE_BYTES, k ^= 1) {
    size_t len = (size_t)(n - off < STAGE_BYTES ? n - off : STAGE_BYTES);
    e = event_sync(g_stage_ev[k]); /* the previous DMA out of this buffer is done */
    if (e != cudaSuccess) break;
    memcpy(g_stage[k], (const char*)src + off, len);
    e = cudaMemcpyAsync((char*)dst + off, g_stage[k], len, cudaMemcpyHostToDevice, s);
    if (e == cudaSuccess) e = cudaEventRecord(g_stage_ev[k], s);
  }
  pthread_mutex_unlock(&g_copy_mu);
  return e == cudaSuccess ? 0 : cuerr(e, op, "staged host-to-device copy");
}

int eng_cuda_memcpy_d2h(void* dst, const void* src, int64_t n) {
  const char* op = "cuda memcpy_d2h";
  if (copy_args(op, dst, src, n)) return -1;
  if (n == 0) return 0;
  cudaStream_t s = g_stream[ENG_CUDA_STREAM_COMPUTE];
  cudaError_t e;
  if (is_pinned(dst)) {
    e = cudaMemcpyAsync(dst, src, (size_t)n, cudaMemcpyDeviceToHost, s);
    if (e == cudaSuccess) e = stream_sync(s);
    if (e != cudaSuccess) return cuerr(e, op, "cudaMemcpyAsync");
    return eng_cuda_after_sync(); /* the work before the copy is done: its deferred checks raise here */
  }
  pthread_mutex_lock(&g_copy_mu);
  if (stage_init(op)) { pthread_mutex_unlock(&g_copy_mu); return -1; }
  e = cudaSuccess;
  int64_t prev_off = -1;
  size_t prev_len = 0;
  int k = 0;
  /* chunk i goes into buffer i % 2; chunk i - 1 is copied out meanwhile */
  for (int64_t off = 0; off < n && e == cudaSuccess; off += STAGE_BYTES, k ^= 1) {
    size_t len = (size_t)(n - off < STAGE_BYTES ? n - off : STAGE_BYTES);
    e = event_sync(g_stage_ev[k]);
    if (e == cudaSuccess) e = cudaMemcpyAsync(g_stage[k], (const char*)src + off, len, cudaMemcpyDeviceToHost, s);
    if (e == cudaSuccess) e = cudaEventRecord(g_stage_ev[k], s);
    if (e == cudaSuccess && prev_off >= 0) {
      e = event_sync(g_stage_ev[k ^ 1]);
      if (e == cudaSuccess) memcpy((char*)dst + prev_off, g_stage[k ^ 1], prev_len);
    }
    prev_off = off;
    prev_len = len;
  }
  if (e == cudaSuccess && prev_off >= 0) {
    e = event_sync(g_stage_ev[k ^ 1]);
    if (e == cudaSuccess) memcpy((char*)dst + prev_off, g_stage[k ^ 1], prev_len);
  }
  pthread_mutex_unlock(&g_copy_mu);
  if (e != cudaSuccess) return cuerr(e, op, "staged device-to-host copy");
  return eng_cuda_after_sync(); /* the work before the copy is done: its deferred checks raise here */
}

int eng_cuda_memcpy_d2d(void* dst, const void* src, int64_t n) {
  const char* op = "cuda memcpy_d2d";
  if (copy_args(op, dst, src, n)) return -1;
  if (n == 0) return 0;
  cudaError_t e = cudaMemcpyAsync(dst, src, (size_t)n, cudaMemcpyDeviceToDevice, g_stream[ENG_CUDA_STREAM_COMPUTE]);
  return e == cudaSuccess ? 0 : cuerr(e, op, "cudaMemcpyAsync");
}

int eng_cuda_memset(void* dst, int value, int64_t n) {
  const char* op = "cuda memset";
  if (n < 0) return eng_err("%s: negative byte count %lld", op, (long long)n);
  if (n > 0 && !dst) return eng_err("%s: NULL pointer", op);
  if (ensure(op)) return -1;
  if (n == 0) return 0;
  cudaError_t e = cudaMemsetAsync(dst, value, (size_t)n, g_stream[ENG_CUDA_STREAM_COMPUTE]);
  return e == cudaSuccess ? 0 : cuerr(e, op, "cudaMemsetAsync");
}

/* ---------------------------------------------------------------- cuBLASLt */
#define GEMM_WS_BYTES (32 << 20)
static void* g_gemm;
static pthread_mutex_t g_gemm_mu = PTHREAD_MUTEX_INITIALIZER;

void* eng_cuda_gemm_context(void) {
  const char* op = "cuda gemm_context";
  if (ensure(op)) return NULL;
  pthread_mutex_lock(&g_gemm_mu);
  if (!g_gemm) {
    void* ws = eng_cuda_malloc(GEMM_WS_BYTES);
    if (!ws) {
      pthread_mutex_unlock(&g_gemm_mu);
      eng_err_prefix("%s", op);
      return NULL;
    }
    kcu_gemm_ctx* c = NULL;
    int st = kcu_gemm_create(&c, ws, GEMM_WS_BYTES);
    if (st) {
      eng_cuda_free(ws);
      pthread_mutex_unlock(&g_gemm_mu);
      return eng_errp("%s: creating the cuBLASLt handle failed: %s", op, kcu_status_string(st));
    }
    g_gemm = c;
  }
  void* r = g_gemm;
  pthread_mutex_unlock(&g_gemm_mu);
  return r;
}

#else /* ---------------------------------------------------------------- no CUDA backend */

#define NOCUDA(op) eng_err("%s: " NOCUDA_REASON, op)
#define NOCUDAP(op) eng_errp("%s: " NOCUDA_REASON, op)

int eng_cuda_built(void) { return 0; }
int eng_cuda_is_available(void) { return 0; }
int eng_cuda_device_count(void) { return 0; }
const char* eng_cuda_unavailable_reason(void) { return NOCUDA_REASON; }
int eng_cuda_runtime_version(void) { return 0; }
int eng_cuda_driver_version(void) { return 0; }
int eng_cuda_set_device(int device) { (void)device; return NOCUDA("cuda set_device"); }
int eng_cuda_current_device(void) { return NOCUDA("cuda current_device"); }
int eng_cuda_device_name(int device, char* buf, int buflen) {
  (void)device; (void)buf; (void)buflen;
  return NOCUDA("cuda device_name");
}
int eng_cuda_get_device_properties(int device, eng_cuda_device_props* out) {
  (void)device; (void)out;
  return NOCUDA("cuda get_device_properties");
}
int eng_cuda_device_bus_id(int device, char* buf, int buflen) {
  (void)device; (void)buf; (void)buflen;
  return NOCUDA("cuda device_bus_id");
}
void* eng_cuda_event_create(void) { return NULL; }
int eng_cuda_event_record(void* ev) { (void)ev; return -1; }
int eng_cuda_event_query(void* ev) { (void)ev; return -1; }
double eng_cuda_event_elapsed_ms(void* start, void* end) { (void)start; (void)end; return -1; }
void eng_cuda_event_destroy(void* ev) { (void)ev; }
int eng_cuda_synchronize(void) { return NOCUDA("cuda synchronize"); }
void* eng_cuda_stream(int which) { (void)which; return NOCUDAP("cuda stream"); }
int eng_cuda_stream_wait(int waiter, int signaller) { (void)waiter; (void)signaller; return NOCUDA("cuda stream_wait"); }
int eng_cuda_stream_synchronize(int which) { (void)which; return NOCUDA("cuda stream_synchronize"); }
void* eng_cuda_malloc(int64_t nbytes) { (void)nbytes; return NOCUDAP("cuda malloc"); }
int eng_cuda_free(void* ptr) { return ptr ? NOCUDA("cuda free") : 0; }
int eng_cuda_record_stream(void* ptr, int which) { (void)ptr; (void)which; return NOCUDA("cuda record_stream"); }
int64_t eng_cuda_block_size(void* ptr) { (void)ptr; return -1; }
int eng_cuda_get_memory_stats(eng_cuda_memory_stats* out) {
  if (!out) return eng_err("cuda get_memory_stats: output pointer is NULL");
  memset(out, 0, sizeof *out);
  return 0;
}
int eng_cuda_reset_peak(void) { return 0; }
int eng_cuda_empty_cache(void) { return NOCUDA("cuda empty_cache"); }
int eng_cuda_mem_get_info(int64_t* free_bytes, int64_t* total_bytes) {
  (void)free_bytes; (void)total_bytes;
  return NOCUDA("cuda mem_get_info");
}
void* eng_cuda_host_alloc(int64_t nbytes) { (void)nbytes; return NOCUDAP("cuda host_alloc"); }
int eng_cuda_host_free(void* ptr) { return ptr ? NOCUDA("cuda host_free") : 0; }
int eng_cuda_memcpy_h2d(void* dst, const void* src, int64_t n) {
  (void)dst; (void)src; (void)n;
  return NOCUDA("cuda memcpy_h2d");
}
int eng_cuda_memcpy_d2h(void* dst, const void* src, int64_t n) {
  (void)dst; (void)src; (void)n;
  return NOCUDA("cuda memcpy_d2h");
}
int eng_cuda_memcpy_d2d(void* dst, const void* src, int64_t n) {
  (void)dst; (void)src; (void)n;
  return NOCUDA("cuda memcpy_d2d");
}
int eng_cuda_memset(void* dst, int value, int64_t n) {
  (void)dst; (void)value; (void)n;
  return NOCUDA("cuda memset");
}
int eng_cuda_check(int status, const char* op) {
  if (status == 0) return 0;
  return eng_err("%s: CUDA kernel failed (status %d); " NOCUDA_REASON, op ? op : "cuda", status);
}
void* eng_cuda_gemm_context(void) { return NOCUDAP("cuda gemm_context"); }
#endif
