/* test_parallel.c: the kernels' worker pool (kernels/cpu/parallel.c) under
 * stress: every index of every loop runs exactly once, for many sizes and
 * grains, with nested loops, with two outside threads
 * using the pool at once (one of them runs inline), and across thread-count
 * changes.  Prints "N passed, N failed" last. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include "engine.h"
#include "../../kernels/cpu/kcpu.h"

static int g_pass, g_fail;
#define CHECK(cond, ...)                                                        \
  do {                                                                          \
    if (cond) g_pass++;                                                         \
    else { g_fail++; printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); } \
  } while (0)

typedef struct { _Atomic int* hits; int nested; _Atomic int bad_range; } cover_ctx;

static void inner(void* vc, int64_t lo, int64_t hi) {
  _Atomic int* h = vc;
  for (int64_t i = lo; i < hi; i++) atomic_fetch_add(&h[i], 1);
}

static void cover(void* vc, int64_t lo, int64_t hi) {
  cover_ctx* c = vc;
  if (lo >= hi) atomic_store(&c->bad_range, 1);
  if (c->nested) {
    /* a loop inside a chunk of a pool job runs inline on that thread */
    kc_parallel_for(hi - lo, 1, inner, (void*)(c->hits + lo));
    return;
  }
  for (int64_t i = lo; i < hi; i++) atomic_fetch_add(&c->hits[i], 1);
}

/* Runs one loop of n items; 1 if every index ran exactly once. */
static int run_once(int64_t n, int64_t grain, int nested) {
  _Atomic int* hits = calloc((size_t)(n > 0 ? n : 1), sizeof *hits);
  cover_ctx c = {hits, nested, 0};
  kc_parallel_for(n, grain, cover, &c);
  int ok = !atomic_load(&c.bad_range);
  for (int64_t i = 0; i < n; i++) ok &= atomic_load(&hits[i]) == 1;
  free(hits);
  return ok;
}

static void test_coverage(void) {
  int bad = 0, loops = 0;
  for (int threads = 1; threads <= 3; threads++) {
    eng_set_num_threads(threads);
    for (int64_t n = 0; n < 300; n += 7)
      for (int64_t grain = 1; grain < 64; grain *= 3) { bad += !run_once(n, grain, 0); loops++; }
    for (int r = 0; r < 2000; r++) { bad += !run_once(1000 + r % 37, 16, r & 1); loops++; }
  }
  CHECK(bad == 0, "%d of %d loops ran some index other than once", bad, loops);
  CHECK(!kc_in_parallel(), "the caller is outside the pool after the loops");
}

static void* outside(void* arg) {
  (void)arg;
  intptr_t bad = 0;
  for (int r = 0; r < 3000; r++) bad += !run_once(500 + r % 53, 8, 0);
  return (void*)bad;
}

static void test_two_callers(void) {
  eng_set_num_threads(2);
  pthread_t t[2];
  for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, outside, NULL);
  intptr_t bad = 0;
  for (int i = 0; i < 2; i++) { void* r; pthread_join(t[i], &r); bad += (intptr_t)r; }
  CHECK(bad == 0, "%ld loops from two outside threads ran some index other than once", (long)bad);
}

static void test_threads_setting(void) {
  CHECK(eng_set_num_threads(0) != 0, "0 threads rejected");
  CHECK(eng_set_num_threads(2) == 0 && eng_get_num_threads() == 2, "2 threads");
  CHECK(kc_get_threads() == 2, "the pool follows set_num_threads");
}

int main(void) {
  eng_runtime_init();
  test_coverage();
  test_two_callers();
  test_threads_setting();
  printf("%d passed, %d failed\n", g_pass, g_fail);
  return g_fail ? 1 : 0;
}
