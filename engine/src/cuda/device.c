/* device.c: the CUDA runtime's device table (core/device.h), registered when
 * the library loads.  core/ reaches CUDA memory, copies, fills and events
 * only through it.  In a build without the CUDA backend the same functions
 * exist as stubs (available() is 0 and every call fails with "CUDA is not
 * available: this build has no CUDA backend ..."), so messages stay the
 * same in both builds. */
#include "core/device.h"
#include "cuda/cuda_runtime.h"
#include "eng/cuda.h"

static int cu_available(void) { return eng_cuda_is_available(); }
static const char* cu_reason(void) { return eng_cuda_unavailable_reason(); }
static int cu_copy_strided(int ndim, const int64_t* shape, void* dst, int ddt, const int64_t* dst_stride,
                           const void* src, int sdt, const int64_t* src_stride, const char* op) {
  return eng_cu_copy(ndim, shape, dst, ddt, dst_stride, src, sdt, src_stride, op);
}

static const eng_device_ops g_cuda_ops = {
    .name = "cuda",
    .available = cu_available,
    .unavailable_reason = cu_reason,
    .alloc = eng_cuda_malloc,
    .free = eng_cuda_free,
    .host_alloc = eng_cuda_host_alloc,
    .host_free = eng_cuda_host_free,
    .copy_h2d = eng_cuda_memcpy_h2d,
    .copy_d2h = eng_cuda_memcpy_d2h,
    .copy_d2d = eng_cuda_memcpy_d2d,
    .memset = eng_cuda_memset,
    .copy_strided = cu_copy_strided,
    .fill = eng_cu_fill,
    .random = eng_cu_random,
    .synchronize = eng_cuda_synchronize,
    .event_create = eng_cuda_event_create,
    .event_destroy = eng_cuda_event_destroy,
    .event_record = eng_cuda_event_record,
    .event_query = eng_cuda_event_query,
    .event_elapsed_ms = eng_cuda_event_elapsed_ms,
};

__attribute__((constructor)) static void register_cuda_device(void) { eng_device_register(ENG_CUDA, &g_cuda_ops); }
