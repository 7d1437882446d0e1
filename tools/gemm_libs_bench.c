/* tools/gemm_libs_bench.c: OpenBLAS against BLIS and oneDNN's sgemm on the GEMMs of the reference training step
 * (results and the decision in docs/benchmarks.md).
 *
 *   gcc -O2 -I/usr/include/x86_64-linux-gnu/openblas-pthread -o /tmp/gemm_libs_bench tools/gemm_libs_bench.c -pthread -lopenblas -ldl -lm
 *   /tmp/gemm_libs_bench [--threads=1,2] [--rounds=9] [--pause_ms=200] [--keep-core]
 *                        [--n_layers=4] [--dim=256] [--seq=128] [--batch=8] [--vocab=256]
 *
 * The GEMMs are those of recipes/bench/step.lua's "sgemm" line: the reference GPT (4 layers, dim 256, seq 128,
 * batch 8, vocab 256) has 25 Linear shapes (in, out) per step (per block wq, wk, wv, wo (dim, dim), w1 (dim, 4 dim),
 * w2 (4 dim, dim); the output projection (dim, vocab)), and each gives three row-major GEMMs at M = batch x seq:
 *   forward      C[M, out] = X[M, in]  W[out, in]^T    (N, T)  M x out x in
 *   grad input   C[M, in]  = G[M, out] W[out, in]      (N, N)  M x in  x out
 *   grad weight  C[out, in] = G[M, out]^T X[M, in]     (T, N)  out x in x M
 * 75 GEMMs a step, run in the step's order with the operands of each (in, out) shared, as step.lua does.
 *
 * Libraries: OpenBLAS, linked (-lopenblas, as the engine), called as kernels/cpu/gemm.c calls it (C cleared, then
 * beta = 1: OpenBLAS's own beta = 0 pass is slower; "openblas-b0" is the plain beta = 0 call); BLIS (bli_sgemm,
 * its native typed API) and oneDNN (dnnl_sgemm, row-major) are loaded at run time from the Debian packages
 * (libblis4 and libdnnl2; the dev packages are not needed), so a missing one is skipped with the apt-get line that
 * installs it, and BLIS's own cblas_sgemm/sgemm_ cannot shadow OpenBLAS's (GEMM_LIBS_BENCH_BLIS and
 * GEMM_LIBS_BENCH_DNNL name other builds, e.g. /usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4).
 * Threads: each library's own threading (openblas_set_num_threads, bli_thread_set_num_threads, omp_set_num_threads:
 * Debian's oneDNN runs on OpenMP), and at more than one thread also "<library>-split": the library at one thread,
 * C split over our threads as the engine splits it (kernels/cpu/gemm.c runs OpenBLAS single-threaded inside its
 * own pool: openblas-split is the engine's GEMM path at 2 threads).
 *
 * OpenBLAS's core: printed (openblas_get_corename). As the engine host does (docs/design.md, "BLAS kernels"), when
 * OpenBLAS picked a weaker class of core than the CPU allows (an SSE-class core on an AVX2+FMA CPU, an AVX2-class
 * one on an AVX-512 CPU) the tool re-executes itself once with OPENBLAS_CORETYPE set to Cooperlake (AVX-512 BF16),
 * SkylakeX (AVX-512) or Haswell; --keep-core leaves OpenBLAS's choice.
 *
 * Timing, per thread count: every library runs the 75 GEMMs twice (warm-up), then `rounds` rounds; in each round
 * every library, in an order rotated each round (so the libraries share the machine's noise), waits pause_ms (the
 * previous library's idle threads stop spinning: OpenBLAS's after about 2^28 cycles), runs the step's 75 GEMMs once
 * untimed, then once timed call by call. Reported: the median over rounds of the 75 GEMMs' total (ms, GFLOP/s),
 * its ratio to OpenBLAS's median (OpenBLAS's time / the library's: > 1 is faster), the median of the per-round
 * ratios, and for each of the 9 distinct GEMMs the median time per call. Before timing, each library's result of
 * each distinct GEMM (at the largest thread count) is compared with OpenBLAS's (beta = 0, one thread):
 * max |C - C_openblas| / max |C_openblas|. */
#define _GNU_SOURCE
#include <cblas.h>
#include <ctype.h>
#include <dlfcn.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------- options */
static int o_layers = 4, o_dim = 256, o_seq = 128, o_batch = 8, o_vocab = 256, o_rounds = 9, o_pause_ms = 200;
static int o_keep_core = 0, o_threads[8] = {1, 2}, o_nthreads = 2;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp_d(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}
static double median(const double* v, int n) {
  double s[256];
  memcpy(s, v, sizeof(double) * (size_t)n);
  qsort(s, (size_t)n, sizeof(double), cmp_d);
  return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

/* ---------------------------------------------------------------- libraries */
typedef void (*gemm_fn)(int ta, int tb, int M, int N, int K, const float* A, int lda, const float* B, int ldb,
                        float* C, int ldc);
typedef struct {
  const char* name;
  int ok;
  gemm_fn gemm;
  void (*set_threads)(int);
  int split; /* 1: the engine's way at n > 1 threads: the library at 1 thread, C split in n parts over our threads */
  char info[256];
} lib_t;

/* OpenBLAS, linked */
static void ob_gemm(int ta, int tb, int M, int N, int K, const float* A, int lda, const float* B, int ldb, float* C,
                    int ldc) { /* as kernels/cpu/gemm.c: clear C, accumulate with beta = 1 */
  if (ldc == N) memset(C, 0, sizeof(float) * (size_t)M * (size_t)N);
  else for (int i = 0; i < M; i++) memset(C + (size_t)i * ldc, 0, sizeof(float) * (size_t)N);
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, 1.0f, A, lda,
              B, ldb, 1.0f, C, ldc);
}
static void ob0_gemm(int ta, int tb, int M, int N, int K, const float* A, int lda, const float* B, int ldb, float* C,
                     int ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, 1.0f, A, lda,
              B, ldb, 0.0f, C, ldc);
}
static void ob_threads(int n) { openblas_set_num_threads(n); }

/* BLIS 0.9 (blis.h): dim_t and inc_t are int64_t on 64-bit, trans_t an enum with BLIS_NO_TRANSPOSE = 0 and
 * BLIS_TRANSPOSE = 0x8; A and B are passed as stored (rows x cols before op) with their row/column strides. */
typedef void (*bli_sgemm_t)(int, int, int64_t, int64_t, int64_t, float*, float*, int64_t, int64_t, float*, int64_t,
                            int64_t, float*, float*, int64_t, int64_t);
static bli_sgemm_t p_bli_sgemm;
static void (*p_bli_set_threads)(int64_t);
static void blis_gemm(int ta, int tb, int M, int N, int K, const float* A, int lda, const float* B, int ldb, float* C,
                      int ldc) {
  float one = 1.0f, zero = 0.0f;
  p_bli_sgemm(ta ? 0x8 : 0, tb ? 0x8 : 0, M, N, K, &one, (float*)A, lda, 1, (float*)B, ldb, 1, &zero, C, ldc, 1);
}
static void blis_threads(int n) { p_bli_set_threads(n); }

/* oneDNN 2.x (dnnl.h): dnnl_sgemm is row-major, dims int64_t, returns dnnl_status_t (0 = success) */
typedef int (*dnnl_sgemm_t)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*,
                            int64_t, float, float*, int64_t);
typedef struct { int major, minor, patch; const char* hash; unsigned cpu_runtime, gpu_runtime; } dnnl_version_t;
static dnnl_sgemm_t p_dnnl_sgemm;
static void (*p_omp_set_num_threads)(int);
static void dnnl_gemm(int ta, int tb, int M, int N, int K, const float* A, int lda, const float* B, int ldb, float* C,
                      int ldc) {
  int st = p_dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc);
  if (st != 0) { fprintf(stderr, "dnnl_sgemm failed: status %d\n", st); exit(1); }
}
static void dnnl_threads(int n) { p_omp_set_num_threads(n); }

static const char* dnnl_isa_name(int isa) {
  switch (isa) {
    case 0x1: return "sse41";
    case 0x3: return "avx";
    case 0x7: return "avx2";
    case 0x27: return "avx512_core";
    case 0x67: return "avx512_core_vnni";
    case 0xe7: return "avx512_core_bf16";
    case 0x3e7: return "avx512_core_amx";
    case 0x407: return "avx2_vnni";
    default: return "?";
  }
}

static void load_blis(lib_t* l) {
  const char* so = getenv("GEMM_LIBS_BENCH_BLIS") ? getenv("GEMM_LIBS_BENCH_BLIS") : "libblis.so.4";
  void* h = dlopen(so, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    snprintf(l->info, sizeof l->info, "not found (%s): apt-get install libblis4 (or libblis-dev)", dlerror());
    return;
  }
  p_bli_sgemm = (bli_sgemm_t)dlsym(h, "bli_sgemm");
  p_bli_set_threads = (void (*)(int64_t))dlsym(h, "bli_thread_set_num_threads");
  char* (*ver)(void) = (char* (*)(void))dlsym(h, "bli_info_get_version_str");
  int (*arch)(void) = (int (*)(void))dlsym(h, "bli_arch_query_id");
  char* (*arch_s)(int) = (char* (*)(int))dlsym(h, "bli_arch_string");
  if (!p_bli_sgemm || !p_bli_set_threads) { snprintf(l->info, sizeof l->info, "bli_sgemm missing"); return; }
  Dl_info di;
  dladdr((void*)p_bli_sgemm, &di);
  snprintf(l->info, sizeof l->info, "BLIS %s, config %s (%s)", ver ? ver() : "?",
           arch && arch_s ? arch_s(arch()) : "?", di.dli_fname);
  l->ok = 1;
}

static void load_dnnl(lib_t* l) {
  const char* so = getenv("GEMM_LIBS_BENCH_DNNL") ? getenv("GEMM_LIBS_BENCH_DNNL") : "libdnnl.so.2";
  void* h = dlopen(so, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    snprintf(l->info, sizeof l->info, "not found (%s): apt-get install libdnnl2 (or libdnnl-dev)", dlerror());
    return;
  }
  p_dnnl_sgemm = (dnnl_sgemm_t)dlsym(h, "dnnl_sgemm");
  const dnnl_version_t* (*ver)(void) = (const dnnl_version_t* (*)(void))dlsym(h, "dnnl_version");
  int (*isa)(void) = (int (*)(void))dlsym(h, "dnnl_get_effective_cpu_isa");
  void* g = dlopen("libgomp.so.1", RTLD_NOW | RTLD_LOCAL); /* already loaded by libdnnl: the same copy */
  p_omp_set_num_threads = g ? (void (*)(int))dlsym(g, "omp_set_num_threads") : NULL;
  if (!p_dnnl_sgemm || !p_omp_set_num_threads) {
    snprintf(l->info, sizeof l->info, "dnnl_sgemm or OpenMP missing");
    return;
  }
  const dnnl_version_t* v = ver ? ver() : NULL;
  Dl_info di;
  dladdr((void*)p_dnnl_sgemm, &di);
  snprintf(l->info, sizeof l->info, "oneDNN %d.%d.%d, CPU runtime %s, ISA %s (%s)", v ? v->major : 0,
           v ? v->minor : 0, v ? v->patch : 0,
           !v ? "?" : v->cpu_runtime == 2 ? "OpenMP" : v->cpu_runtime == 1 ? "sequential" : "other",
           isa ? dnnl_isa_name(isa()) : "?", di.dli_fname);
  l->ok = 1;
}

/* ---------------------------------------------------------------- OpenBLAS's core */
static int core_class(const char* c) { /* 0 SSE-class or unknown, 1 AVX2-class, 2 AVX-512 */
  char s[64];
  size_t i = 0;
  for (; c[i] && i < sizeof s - 1; i++) s[i] = (char)tolower((unsigned char)c[i]);
  s[i] = 0;
  if (strstr(s, "skylakex") || strstr(s, "cooperlake") || strstr(s, "sapphirerapids")) return 2;
  if (strstr(s, "haswell") || strstr(s, "zen") || strstr(s, "excavator")) return 1;
  return 0;
}

static void best_core(char** argv) {
  __builtin_cpu_init();
  int cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl")
                ? 2
                : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
  const char* got = openblas_get_corename();
  if (o_keep_core || getenv("GEMM_LIBS_BENCH_REEXEC") || core_class(got) >= cpu) return;
  const char* want = cpu == 2 ? (__builtin_cpu_supports("avx512bf16") ? "Cooperlake" : "SkylakeX") : "Haswell";
  fprintf(stderr, "gemm_libs_bench: OpenBLAS picked %s on a CPU with %s: re-executing with OPENBLAS_CORETYPE=%s\n",
          got, cpu == 2 ? "AVX-512" : "AVX2+FMA", want);
  setenv("OPENBLAS_CORETYPE", want, 1);
  setenv("GEMM_LIBS_BENCH_REEXEC", got, 1);
  execv("/proc/self/exe", argv);
  perror("execv");
}

/* ---------------------------------------------------------------- the engine's split (kernels/cpu/gemm.c) */
/* At n threads the engine runs the library single-threaded and splits C over its own pool: the larger of M and N
 * in units of 16, ceil(units / n) units a part, each part one library call. Here the calling thread runs part 0
 * and n - 1 persistent workers the others; an idle worker polls (pause, then sched_yield) for 2 ms, then sleeps on
 * a futex, as kernels/cpu/parallel.c's workers do, so it does not compete with the next library's threads. */
#define SPLIT_UNIT 16
typedef struct {
  const lib_t* lib;
  int ta, tb, M, N, K, lda, ldb, ldc, by_rows, chunk;
  const float *A, *B;
  float* C;
} split_job;
static split_job g_job;
static _Atomic uint32_t g_post, g_done[8];
static int g_split_threads = 1, g_workers;

static void split_part(const split_job* j, int part) {
  int dim = j->by_rows ? j->M : j->N, a = part * j->chunk * SPLIT_UNIT, b = (part + 1) * j->chunk * SPLIT_UNIT;
  if (b > dim) b = dim;
  if (a >= b) return;
  if (j->by_rows)
    j->lib->gemm(j->ta, j->tb, b - a, j->N, j->K, j->A + (size_t)(j->ta ? a : a * j->lda), j->lda, j->B, j->ldb,
                 j->C + (size_t)a * j->ldc, j->ldc);
  else
    j->lib->gemm(j->ta, j->tb, j->M, b - a, j->K, j->A, j->lda, j->B + (size_t)(j->tb ? a * j->ldb : a), j->ldb,
                 j->C + a, j->ldc);
}

static void* split_worker(void* arg) {
  int part = (int)(intptr_t)arg;
  uint32_t seen = 0;
  const lib_t* last = NULL;
  for (;;) {
    double t0 = 0;
    for (int spins = 0; atomic_load(&g_post) == seen; spins++) {
      if (spins < 256) { __builtin_ia32_pause(); continue; }
      if (t0 == 0) t0 = now();
      if (now() - t0 < 2e-3) sched_yield();
      else syscall(SYS_futex, (uint32_t*)&g_post, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
    }
    seen = atomic_load(&g_post);
    if (g_job.lib != last) { last = g_job.lib; last->set_threads(1); } /* OpenMP's thread count is per thread */
    if (part < g_split_threads) split_part(&g_job, part);
    atomic_store(&g_done[part], seen);
  }
  return NULL;
}

static void split_gemm(const lib_t* l, int ta, int tb, int M, int N, int K, const float* A, int lda, const float* B,
                       int ldb, float* C, int ldc) {
  int n = g_split_threads;
  while (g_workers < n - 1) {
    pthread_t t;
    if (pthread_create(&t, NULL, split_worker, (void*)(intptr_t)(g_workers + 1))) { perror("pthread_create"); exit(1); }
    g_workers++;
  }
  int by_rows = M >= N, units = ((by_rows ? M : N) + SPLIT_UNIT - 1) / SPLIT_UNIT;
  g_job = (split_job){l, ta, tb, M, N, K, lda, ldb, ldc, by_rows, (units + n - 1) / n, A, B, C};
  uint32_t gen = atomic_fetch_add(&g_post, 1) + 1;
  syscall(SYS_futex, (uint32_t*)&g_post, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0);
  split_part(&g_job, 0);
  for (int w = 1; w < n; w++)
    for (int spins = 0; atomic_load(&g_done[w]) != gen; spins++)
      if (spins < 2048) __builtin_ia32_pause();
      else sched_yield();
}

/* ---------------------------------------------------------------- the step's GEMMs */
typedef struct { int ta, tb, M, N, K, in, out, kind, count; } prob_t; /* kind 0 fwd, 1 grad input, 2 grad weight */
typedef struct { int in, out; float *X, *W, *G, *C[3]; } shape_t;
static const char* kind_name[3] = {"fwd   X W^T", "dgrad G W  ", "wgrad G^T X"};

static prob_t probs[64];
static int nprobs;
static shape_t dshapes[16];
static int ndshapes;
static int step_shape[256], nstep; /* the step's shapes, as indices into dshapes */

static float* rnd(size_t n, unsigned* seed) {
  float* p = aligned_alloc(64, ((sizeof(float) * n + 63) / 64) * 64);
  if (!p) { fprintf(stderr, "out of memory\n"); exit(1); }
  for (size_t i = 0; i < n; i++) {
    *seed = *seed * 1664525u + 1013904223u;
    p[i] = (float)((*seed >> 8) * (1.0 / 16777216.0) * 2.0 - 1.0);
  }
  return p;
}

static void add_shape(int in, int out) {
  int i;
  for (i = 0; i < ndshapes; i++)
    if (dshapes[i].in == in && dshapes[i].out == out) break;
  if (i == ndshapes) {
    unsigned seed = 1234u + (unsigned)i * 77u;
    int M = o_batch * o_seq;
    shape_t* s = &dshapes[ndshapes++];
    s->in = in, s->out = out;
    s->X = rnd((size_t)M * in, &seed), s->W = rnd((size_t)out * in, &seed), s->G = rnd((size_t)M * out, &seed);
    s->C[0] = rnd((size_t)M * out, &seed), s->C[1] = rnd((size_t)M * in, &seed), s->C[2] = rnd((size_t)out * in, &seed);
    for (int k = 0; k < 3; k++) {
      prob_t* p = &probs[nprobs++];
      p->in = in, p->out = out, p->kind = k, p->count = 0;
      if (k == 0) p->ta = 0, p->tb = 1, p->M = M, p->N = out, p->K = in;
      if (k == 1) p->ta = 0, p->tb = 0, p->M = M, p->N = in, p->K = out;
      if (k == 2) p->ta = 1, p->tb = 0, p->M = out, p->N = in, p->K = M;
    }
  }
  for (int k = 0; k < 3; k++) probs[3 * i + k].count++;
  step_shape[nstep++] = i;
}

static void call(const lib_t* l, int ta, int tb, int M, int N, int K, const float* A, int lda, const float* B,
                 int ldb, float* C, int ldc) {
  if (l->split && g_split_threads > 1) split_gemm(l, ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
  else l->gemm(ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
}

static void run_prob(const lib_t* l, int pi, float* C) {
  const prob_t* p = &probs[pi];
  const shape_t* s = &dshapes[pi / 3];
  if (p->kind == 0) call(l, 0, 1, p->M, p->N, p->K, s->X, p->K, s->W, p->K, C, p->N);
  else if (p->kind == 1) call(l, 0, 0, p->M, p->N, p->K, s->G, p->K, s->W, p->N, C, p->N);
  else call(l, 1, 0, p->M, p->N, p->K, s->G, p->M, s->X, p->N, C, p->N);
}

/* the library at nt threads: its own threading, or (split) 1 thread each over nt of ours */
static void use_threads(const lib_t* l, int nt) {
  l->set_threads(l->split ? 1 : nt);
  g_split_threads = l->split ? nt : 1;
}

/* one pass over the step's GEMMs; t (per problem, summed) may be NULL; returns the total seconds */
static double pass(const lib_t* l, double* t) {
  double total = 0;
  for (int i = 0; i < nstep; i++)
    for (int k = 0; k < 3; k++) {
      int pi = 3 * step_shape[i] + k;
      double t0 = now();
      run_prob(l, pi, dshapes[step_shape[i]].C[k]);
      double dt = now() - t0;
      total += dt;
      if (t) t[pi] += dt;
    }
  return total;
}

static void loadavg(const char* when) {
  char b[128] = "?";
  FILE* f = fopen("/proc/loadavg", "r");
  if (f) { if (!fgets(b, sizeof b, f)) strcpy(b, "?"); fclose(f); }
  b[strcspn(b, "\n")] = 0;
  printf("loadavg (%s): %s\n", when, b);
}

/* the machine's busy CPU seconds (/proc/stat) and this process's (all its threads) */
static void cpu_seconds(double* machine, double* self) {
  unsigned long long v[8] = {0};
  FILE* f = fopen("/proc/stat", "r");
  if (f) {
    if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6],
               &v[7]) != 8)
      memset(v, 0, sizeof v);
    fclose(f);
  }
  *machine = (double)(v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / (double)sysconf(_SC_CLK_TCK);
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  *self = ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
}

static void cpu_model(char* out, size_t n) {
  snprintf(out, n, "?");
  FILE* f = fopen("/proc/cpuinfo", "r");
  if (!f) return;
  char line[512];
  int fam = -1, model = -1;
  char name[256] = "?";
  while (fgets(line, sizeof line, f)) {
    if (!strncmp(line, "model name", 10) && strchr(line, ':')) {
      snprintf(name, sizeof name, "%s", strchr(line, ':') + 2);
      name[strcspn(name, "\n")] = 0;
    } else if (!strncmp(line, "cpu family", 10) && strchr(line, ':')) fam = atoi(strchr(line, ':') + 1);
    else if (!strncmp(line, "model\t", 6) && strchr(line, ':')) model = atoi(strchr(line, ':') + 1);
    if (!strncmp(line, "flags", 5)) break;
  }
  fclose(f);
  snprintf(out, n, "%s (family %d, model %d), %ld CPUs online", name, fam, model, sysconf(_SC_NPROCESSORS_ONLN));
}

int main(int argc, char** argv) {
  for (int i = 1; i < argc; i++) {
    const char* a = argv[i];
    if (!strcmp(a, "--keep-core")) o_keep_core = 1;
    else if (!strncmp(a, "--threads=", 10)) {
      o_nthreads = 0;
      for (char* s = (char*)a + 10; *s && o_nthreads < 8; s++) {
        o_threads[o_nthreads++] = (int)strtol(s, &s, 10);
        if (*s != ',') break;
      }
    } else if (!strncmp(a, "--rounds=", 9)) o_rounds = atoi(a + 9);
    else if (!strncmp(a, "--pause_ms=", 11)) o_pause_ms = atoi(a + 11);
    else if (!strncmp(a, "--n_layers=", 11)) o_layers = atoi(a + 11);
    else if (!strncmp(a, "--dim=", 6)) o_dim = atoi(a + 6);
    else if (!strncmp(a, "--seq=", 6)) o_seq = atoi(a + 6);
    else if (!strncmp(a, "--batch=", 8)) o_batch = atoi(a + 8);
    else if (!strncmp(a, "--vocab=", 8)) o_vocab = atoi(a + 8);
    else {
      fprintf(stderr, "usage: %s [--threads=1,2] [--rounds=9] [--pause_ms=200] [--keep-core] [--n_layers=4] "
              "[--dim=256] [--seq=128] [--batch=8] [--vocab=256]\n", argv[0]);
      return 2;
    }
  }
  if (o_rounds < 1 || o_rounds > 256) o_rounds = 9;
  for (int i = 0; i < o_nthreads; i++)
    if (o_threads[i] < 1 || o_threads[i] > 8) { fprintf(stderr, "--threads: 1 to 8 each\n"); return 2; }
  if (o_layers < 1 || o_layers > 40 || o_dim < 1 || o_seq < 1 || o_batch < 1 || o_vocab < 1) {
    fprintf(stderr, "--n_layers: 1 to 40; --dim, --seq, --batch, --vocab: positive\n");
    return 2;
  }
  best_core(argv);

  lib_t libs[7] = {{"openblas", 1, ob_gemm, ob_threads, 0, ""},
                   {"openblas-b0", 1, ob0_gemm, ob_threads, 0, ""},
                   {"blis", 0, blis_gemm, blis_threads, 0, ""},
                   {"onednn", 0, dnnl_gemm, dnnl_threads, 0, ""},
                   {"openblas-split", 1, ob_gemm, ob_threads, 1, ""},
                   {"blis-split", 0, blis_gemm, blis_threads, 1, ""},
                   {"onednn-split", 0, dnnl_gemm, dnnl_threads, 1, ""}};
  int nlibs = 7;
  {
    Dl_info di;
    dladdr((void*)cblas_sgemm, &di);
    const char* pre = getenv("GEMM_LIBS_BENCH_REEXEC");
    snprintf(libs[0].info, sizeof libs[0].info, "OpenBLAS core %s%s%s%s (%s; %s)", openblas_get_corename(),
             pre ? " (re-executed: it had picked " : "", pre ? pre : "", pre ? ")" : "", openblas_get_config(),
             di.dli_fname);
    snprintf(libs[1].info, sizeof libs[1].info, "the same OpenBLAS, cblas_sgemm with beta = 0");
  }
  load_blis(&libs[2]);
  load_dnnl(&libs[3]);
  for (int l = 4; l < 7; l++) { /* openblas-split, blis-split, onednn-split from openblas, blis, onednn */
    int base = l == 4 ? 0 : l - 3;
    libs[l].ok = libs[base].ok;
    snprintf(libs[l].info, sizeof libs[l].info, "%s at 1 thread, C split over n > 1 threads as the engine splits it",
             libs[base].name);
  }

  char cpu[512];
  cpu_model(cpu, sizeof cpu);
  printf("gemm_libs_bench: %s\n", cpu);
  loadavg("start");
  const char *ct = getenv("OPENBLAS_CORETYPE"), *omp = getenv("OMP_NUM_THREADS");
  printf("OPENBLAS_CORETYPE=%s OMP_NUM_THREADS=%s\n", ct ? ct : "(unset)", omp ? omp : "(unset)");
  for (int l = 0; l < nlibs; l++) printf("  %-12s %s%s\n", libs[l].name, libs[l].ok ? "" : "SKIPPED: ", libs[l].info);

  /* the step's shapes, in step.lua's order */
  for (int b = 0; b < o_layers; b++) {
    for (int j = 0; j < 4; j++) add_shape(o_dim, o_dim);
    add_shape(o_dim, 4 * o_dim);
    add_shape(4 * o_dim, o_dim);
  }
  add_shape(o_dim, o_vocab);
  double flops = 0;
  for (int p = 0; p < nprobs; p++) flops += 2.0 * probs[p].M * probs[p].N * probs[p].K * probs[p].count;
  printf("GEMMs: %d shapes (in, out) of a step, %d GEMMs, %d distinct, %.2f GFLOP, M = batch x seq = %d\n", nstep,
         3 * nstep, nprobs, flops / 1e9, o_batch * o_seq);

  /* agreement with OpenBLAS (beta = 0, one thread); each library at the largest thread count asked */
  int maxt = 1;
  for (int ti = 0; ti < o_nthreads; ti++) maxt = o_threads[ti] > maxt ? o_threads[ti] : maxt;
  printf("agreement at %d thread%s, max |C - C_openblas| / max |C_openblas| over the %d distinct GEMMs:\n ", maxt,
         maxt > 1 ? "s" : "", nprobs);
  for (int l = 0; l < nlibs; l++) {
    if (!libs[l].ok || l == 1) continue;
    double worst = 0;
    for (int p = 0; p < nprobs; p++) {
      size_t n = (size_t)probs[p].M * probs[p].N;
      float* r = malloc(n * sizeof(float));
      float* c = malloc(n * sizeof(float));
      if (!r || !c) { fprintf(stderr, "out of memory\n"); return 1; }
      for (size_t i = 0; i < n; i++) c[i] = 7.0f; /* beta = 0 must not read it */
      use_threads(&libs[1], 1);
      run_prob(&libs[1], p, r);
      use_threads(&libs[l], maxt);
      run_prob(&libs[l], p, c);
      double md = 0, mr = 0;
      for (size_t i = 0; i < n; i++) {
        md = fmax(md, fabs((double)c[i] - r[i]));
        mr = fmax(mr, fabs((double)r[i]));
      }
      worst = fmax(worst, md / mr);
      free(r), free(c);
    }
    printf(" %s %.1e", libs[l].name, worst);
    if (worst > 1e-4) { printf("\nFAILED: %s disagrees with OpenBLAS\n", libs[l].name); return 1; }
  }
  printf("\n");

#define ACTIVE(l, nt) (libs[l].ok && (!libs[l].split || (nt) > 1))
#define INTERLEAVED(l, nt) ((nt) == 1 || libs[l].split)
  static double tot[8][7][256], per[8][7][256][64], others[8];
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  for (int ti = 0; ti < o_nthreads; ti++) {
    int nt = o_threads[ti];
    double m0, s0, m1, s1, w0 = now();
    cpu_seconds(&m0, &s0);
    for (int l = 0; l < nlibs; l++)
      if (ACTIVE(l, nt)) {
        use_threads(&libs[l], nt);
        pass(&libs[l], NULL), pass(&libs[l], NULL);
      }
    for (int r = 0; r < o_rounds; r++) {
      /* the libraries' own thread pools (n > 1): one library at a time, a pass each */
      for (int j = 0; j < nlibs; j++) {
        int l = (j + r) % nlibs;
        if (!ACTIVE(l, nt) || INTERLEAVED(l, nt)) continue;
        use_threads(&libs[l], nt);
        usleep((useconds_t)o_pause_ms * 1000);
        pass(&libs[l], NULL);
        memset(per[ti][l][r], 0, sizeof per[ti][l][r]);
        tot[ti][l][r] = pass(&libs[l], per[ti][l][r]);
      }
      /* single-threaded calls (1 thread, or -split): interleaved call by call, each GEMM of the step by every
       * library in turn (the order rotated each round), so they share the machine's noise at the scale of a call */
      int grp[8], ng = 0;
      for (int j = 0; j < nlibs; j++) {
        int l = (j + r) % nlibs;
        if (ACTIVE(l, nt) && INTERLEAVED(l, nt)) grp[ng++] = l, use_threads(&libs[l], nt);
      }
      if (!ng) continue;
      usleep((useconds_t)o_pause_ms * 1000);
      for (int g = 0; g < ng; g++) {
        memset(per[ti][grp[g]][r], 0, sizeof per[ti][grp[g]][r]);
        tot[ti][grp[g]][r] = 0;
        for (int k = 0; k < 3; k++) run_prob(&libs[grp[g]], k, dshapes[0].C[k]); /* wakes a sleeping worker */
      }
      for (int i = 0; i < nstep; i++)
        for (int k = 0; k < 3; k++) {
          int pi = 3 * step_shape[i] + k;
          for (int g = 0; g < ng; g++) {
            double t0 = now();
            run_prob(&libs[grp[g]], pi, dshapes[step_shape[i]].C[k]);
            double dt = now() - t0;
            tot[ti][grp[g]][r] += dt, per[ti][grp[g]][r][pi] += dt;
          }
        }
    }
    cpu_seconds(&m1, &s1); /* other processes' share of the machine while this thread count ran */
    others[ti] = fmax(0, (m1 - m0) - (s1 - s0)) / ((now() - w0) * (double)ncpu);
  }
  loadavg("end");

  for (int ti = 0; ti < o_nthreads; ti++) {
    int nt = o_threads[ti];
    double ob = median(tot[ti][0], o_rounds), obs = nt > 1 ? median(tot[ti][4], o_rounds) : ob;
    printf("\n%d thread%s: the step's %d GEMMs, median of %d rounds (x: OpenBLAS's time / the library's; round ratio: "
           "median of the rounds' ratios to the OpenBLAS timed alongside%s); other processes used %.0f%% of the "
           "machine's %ld CPUs meanwhile\n", nt, nt > 1 ? "s" : "", 3 * nstep, o_rounds,
           nt > 1 ? ", openblas-split for the -split rows, timed call by call interleaved; the others a pass each"
                  : ", all timed call by call interleaved",
           100 * others[ti], ncpu);
    printf("  %-14s %8s %8s %8s %8s %12s %12s", "library", "ms", "min ms", "max ms", "GFLOP/s", "vs openblas",
           "round ratio");
    if (nt > 1) printf(" %15s", "vs ob-split");
    printf("\n");
    for (int l = 0; l < nlibs; l++) {
      if (!ACTIVE(l, nt)) continue;
      double m = median(tot[ti][l], o_rounds), lo = 1e30, hi = 0, rr[256];
      for (int r = 0; r < o_rounds; r++) {
        lo = fmin(lo, tot[ti][l][r]), hi = fmax(hi, tot[ti][l][r]);
        rr[r] = tot[ti][nt > 1 && libs[l].split ? 4 : 0][r] / tot[ti][l][r];
      }
      printf("  %-14s %8.2f %8.2f %8.2f %8.1f %11.3fx %11.3fx", libs[l].name, m * 1e3, lo * 1e3, hi * 1e3,
             flops / m / 1e9, ob / m, median(rr, o_rounds));
      if (nt > 1) printf(" %14.3fx", obs / m);
      printf("\n");
    }
    printf("  per distinct GEMM (M x N x K, count per step): median ms per call / GFLOP/s\n");
    printf("  %-12s %-14s %5s", "GEMM", "M x N x K", "count");
    for (int l = 0; l < nlibs; l++)
      if (ACTIVE(l, nt)) printf(" %16s", libs[l].name);
    printf("\n");
    for (int p = 0; p < nprobs; p++) {
      char mnk[32];
      snprintf(mnk, sizeof mnk, "%dx%dx%d", probs[p].M, probs[p].N, probs[p].K);
      printf("  %-12s %-14s %5d", kind_name[probs[p].kind], mnk, probs[p].count);
      for (int l = 0; l < nlibs; l++) {
        if (!ACTIVE(l, nt)) continue;
        double v[256];
        for (int r = 0; r < o_rounds; r++) v[r] = per[ti][l][r][p] / probs[p].count;
        double m = median(v, o_rounds);
        printf(" %6.3f / %6.1f", m * 1e3, 2.0 * probs[p].M * probs[p].N * probs[p].K / m / 1e9);
      }
      printf("\n");
    }
  }
  printf("\nsummary (ms for the step's GEMMs, GFLOP/s, x OpenBLAS):\n");
  for (int ti = 0; ti < o_nthreads; ti++) {
    double ob = median(tot[ti][0], o_rounds);
    printf("  %dT (others %.0f%%)", o_threads[ti], 100 * others[ti]);
    for (int l = 0; l < nlibs; l++)
      if (ACTIVE(l, o_threads[ti])) {
        double m = median(tot[ti][l], o_rounds);
        printf(" | %s %.1f %.0f %.3fx", libs[l].name, m * 1e3, flops / m / 1e9, ob / m);
      }
    printf("\n");
  }
  return 0;
}
