/* tools/ckpt_read_modes.c: the cold-read comparison behind checkpoint.load's reader (docs/design.md,
 * "Distributed checkpoints": why pread).  Reads one file, after dropping it from the page cache, in one of four
 * ways and prints the seconds taken:
 *   0  pread in 4 MiB blocks into one buffer, XXH64 of each block (the reader's checksum pass)
 *   1  a read-only mapping, MADV_WILLNEED per 32 MiB chunk, XXH64 of each chunk (the reader before)
 *   2  the same, also asking for the next 64 MiB ahead
 *   3  dd-like: pread in 1 MiB blocks, no hash
 * Four ranks reading at once, as the bench's 4 ranks do (8 alternating rounds; medians by eye or sort):
 *   gcc -O2 -o /tmp/ckpt_read_modes tools/ckpt_read_modes.c -Lbuild -lengine -Wl,-rpath,$PWD/build
 *   for i in 0 1 2 3; do head -c 268435456 /dev/urandom > /tmp/f$i.bin; done
 *   for rep in 1 2 3 4 5 6 7 8; do for m in 2 1 0 3; do s=$(date +%s.%N)
 *     for i in 0 1 2 3; do /tmp/ckpt_read_modes /tmp/f$i.bin $m > /dev/null & done; wait
 *     echo "mode $m $(echo "$(date +%s.%N) - $s" | bc)"; done; done */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

uint64_t eng_xxh64(const void* data, int64_t n);

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  if (argc != 3) { fprintf(stderr, "usage: %s FILE MODE(0-3)\n", argv[0]); return 2; }
  int mode = atoi(argv[2]);
  int fd = open(argv[1], O_RDONLY);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) { perror(argv[1]); return 1; }
  size_t n = (size_t)st.st_size, chunk = (size_t)32 << 20;
  posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  double t0 = now();
  uint64_t h = 0;
  if (mode == 0 || mode == 3) {
    size_t b = mode == 0 ? (size_t)4 << 20 : (size_t)1 << 20;
    char* buf = malloc(b);
    for (size_t o = 0; buf && o < n;) {
      ssize_t k = pread(fd, buf, b, (off_t)o);
      if (k <= 0) break;
      if (mode == 0) h ^= eng_xxh64(buf, k);
      o += (size_t)k;
    }
    free(buf);
  } else {
    char* m = mmap(NULL, n, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) { perror("mmap"); return 1; }
    for (size_t o = 0; o < n; o += chunk) {
      size_t l = n - o < chunk ? n - o : chunk;
      madvise(m + o, l, MADV_WILLNEED);
      if (mode == 2 && o + l < n) madvise(m + o + l, n - o - l < 2 * chunk ? n - o - l : 2 * chunk, MADV_WILLNEED);
      h ^= eng_xxh64(m + o, (int64_t)l);
    }
    munmap(m, n);
  }
  printf("%.3f %016llx\n", now() - t0, (unsigned long long)h);
  close(fd);
  return 0;
}
