/* tools/copy_stream_bench.c: the copy comparison behind an async checkpoint's staging copy (docs/design.md,
 * "Distributed checkpoints"): glibc memcpy against kc_copy_stream (kernels/cpu/copy.c: non-temporal stores)
 * over 8 buffers of MIB MiB (default 32, as the bench's 8 tensors per rank at 4 ranks), five rounds:
 *   gcc -O2 -march=native -Ikernels/cpu -o /tmp/copy_stream_bench tools/copy_stream_bench.c -Lbuild -lengine \
 *     -Wl,-rpath,$PWD/build
 *   /tmp/copy_stream_bench 32
 *   for i in 1 2 3 4; do /tmp/copy_stream_bench 32 | tail -2 & done; wait     # four processes at once
 * Each line: one round's milliseconds for the 8 copies with each. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void kc_copy_stream(void* dst, const void* src, size_t n);

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  size_t n = (size_t)(argc > 1 ? atol(argv[1]) : 32) << 20;
  int k = 8;
  char* s = aligned_alloc(4096, n * k);
  char* d = aligned_alloc(4096, n * k);
  if (!s || !d) { fprintf(stderr, "out of memory\n"); return 1; }
  memset(s, 1, n * k);
  memset(d, 2, n * k);
  for (int r = 0; r < 5; r++) {
    double t0 = now();
    for (int j = 0; j < k; j++) memcpy(d + j * n, s + j * n, n);
    double t1 = now();
    for (int j = 0; j < k; j++) kc_copy_stream(d + j * n, s + j * n, n);
    double t2 = now();
    if (memcmp(d, s, n * k) != 0) { fprintf(stderr, "copies differ\n"); return 1; }
    printf("%zu MiB x %d: memcpy %.1f ms  kc_copy_stream %.1f ms\n", n >> 20, k, (t1 - t0) * 1e3, (t2 - t1) * 1e3);
  }
  return 0;
}
