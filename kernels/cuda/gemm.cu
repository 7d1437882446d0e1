/* gemm.cu: row-major GEMM through cuBLASLt with bias / GELU epilogues.
 *
 * Row-major C[M, N] = op(A) op(B) is the column-major product
 * C^T[N, M] = op(B)^T op(A)^T, so cuBLASLt's "A" is our B and its "B" our A,
 * with m = N, n = M, and every row-major matrix read as its column-major
 * transpose with the same leading dimension.  The epilogue bias (one value
 * per row of the column-major D) is then one value per column N of our C:
 * a Linear layer's bias.
 *
 * Descriptors, layouts and the heuristic's algorithm are cached per
 * configuration (shape, dtypes, transposes, leading dims, batch, epilogue
 * and pointer alignment): a training step asks for the same few GEMMs every
 * iteration, and the heuristic costs tens of microseconds.
 *
 * ENGINE_GEMM_AUTOTUNE=1 (opt-in until a GPU run has timed it): a new plan
 * takes the fastest of the heuristic's first kTuneAlgos algorithms instead
 * of its first, each timed on the plan's own shape (one warm-up, then
 * kTuneReps runs between CUDA events on the caller's stream) with the output
 * (and a GELU epilogue's aux output) in scratch memory, so the caller's C is
 * untouched (with beta != 0 the scratch's contents are read, which does not
 * change the timing).  Once per distinct GEMM; a failure to get scratch
 * memory or events keeps the heuristic's first.  On the H200 the backward
 * GEMMs of GPT-2 ran at about 80% of the forward's rate (the kernel trace of
 * docs/gpu-runs/2026-11-28-b.md); this asks whether another algorithm closes
 * it. */
#include "common.cuh"
#include <cublasLt.h>
#include <stdlib.h>
#include <string.h>

namespace {

const int kCacheSize = 128;
const int kTuneAlgos = 8;
const int kTuneReps = 3;

struct GemmKey {
  int ta, tb, abdt, cdt, tf32, epi, bias_dt, align;
  int64_t M, N, K, lda, ldb, ldc, ldaux, batch, sa, sb, sc;
};

struct GemmPlan {
  GemmKey key;
  int used;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulAlgo_t algo;
};

int lt_err(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS ? KCU_OK : KCU_ECUBLAS - (int)s; }

cudaDataType_t data_type(int dt) {
  switch (dt) {
    case KCU_F64: return CUDA_R_64F;
    case KCU_BF16: return CUDA_R_16BF;
    case KCU_F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

cublasLtEpilogue_t lt_epilogue(int e) {
  switch (e) {
    case KCU_EPI_BIAS: return CUBLASLT_EPILOGUE_BIAS;
    case KCU_EPI_GELU: return CUBLASLT_EPILOGUE_GELU;
    case KCU_EPI_BIAS_GELU: return CUBLASLT_EPILOGUE_GELU_BIAS;
    case KCU_EPI_GELU_AUX: return CUBLASLT_EPILOGUE_GELU_AUX;
    case KCU_EPI_BIAS_GELU_AUX: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case KCU_EPI_DGELU: return CUBLASLT_EPILOGUE_DGELU;
    default: return CUBLASLT_EPILOGUE_DEFAULT;
  }
}
int epi_bias(int e) { return e == KCU_EPI_BIAS || e == KCU_EPI_BIAS_GELU || e == KCU_EPI_BIAS_GELU_AUX; }
int epi_aux(int e) { return e == KCU_EPI_GELU_AUX || e == KCU_EPI_BIAS_GELU_AUX || e == KCU_EPI_DGELU; }

/* 0: 16-byte aligned everywhere, else a bit per misaligned pointer. */
int align_class(const kcu_gemm_args* a) {
  const void* ps[5] = {a->A, a->B, a->C, a->bias, a->aux};
  int r = 0;
  for (int i = 0; i < 5; i++)
    if (ps[i] && ((uintptr_t)ps[i] & 15)) r |= 1 << i;
  return r;
}

void plan_free(GemmPlan* p) {
  if (!p->used) return;
  cublasLtMatrixLayoutDestroy(p->la);
  cublasLtMatrixLayoutDestroy(p->lb);
  cublasLtMatrixLayoutDestroy(p->lc);
  cublasLtMatmulDescDestroy(p->desc);
  p->used = 0;
}

int set_layout(cublasLtMatrixLayout_t* l, cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
               int64_t stride) {
  cublasStatus_t s = cublasLtMatrixLayoutCreate(l, t, (uint64_t)rows, (uint64_t)cols, ld);
  if (s != CUBLAS_STATUS_SUCCESS) return lt_err(s);
  if (batch > 1) {
    int32_t bc = (int32_t)batch;
    s = cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride);
  }
  return lt_err(s);
}

}  // namespace

struct kcu_gemm_ctx {
  cublasLtHandle_t lt;
  void* ws;
  size_t ws_bytes;
  GemmPlan plans[kCacheSize];
  int next;  /* round-robin victim */
};

namespace {

int set_pointers(cublasLtMatmulDesc_t d, const kcu_gemm_args* a) {
  cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
  if (epi_bias(a->epilogue))
    s = cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &a->bias, sizeof a->bias);
  if (s == CUBLAS_STATUS_SUCCESS && epi_aux(a->epilogue))
    s = cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &a->aux, sizeof a->aux);
  return lt_err(s);
}

int gemm_autotune() {
  static int on = -1;
  if (on < 0) {
    const char* e = getenv("ENGINE_GEMM_AUTOTUNE");
    on = e && strcmp(e, "1") == 0;
  }
  return on;
}

/* Elements a matrix of rows x cols with leading dim ld spans, batch matrices stride apart (row-major). */
size_t span(int64_t rows, int64_t cols, int64_t ld, int64_t batch, int64_t stride) {
  if (rows <= 0 || cols <= 0) return 0;
  int64_t last = (rows - 1) * ld + cols;
  if (batch > 1) last += (batch - 1) * stride;
  return (size_t)last;
}

size_t dt_size(int dt) { return dt == KCU_F64 ? 8 : (dt == KCU_F32 ? 4 : 2); }

/* The fastest of res[0..n) on p's shape (see the top of the file); p->algo is res[0]'s on entry. */
void autotune(kcu_gemm_ctx* c, GemmPlan* p, const GemmKey& k, const kcu_gemm_args* a,
              const cublasLtMatmulHeuristicResult_t* res, int n, cudaStream_t stream) {
  const int aux_out = k.epi == KCU_EPI_GELU_AUX || k.epi == KCU_EPI_BIAS_GELU_AUX;
  void *cs = NULL, *xs = NULL;
  cudaEvent_t e0 = NULL, e1 = NULL;
  size_t cb = span(k.M, k.N, k.ldc, k.batch, k.sc) * dt_size(k.cdt);
  size_t xb = aux_out ? span(k.M, k.N, k.ldaux, k.batch, k.sc) * dt_size(k.cdt) : 0;
  int ok = cudaMalloc(&cs, cb) == cudaSuccess && (!aux_out || cudaMalloc(&xs, xb) == cudaSuccess) &&
           cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess;
  if (ok && aux_out)
    ok = cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &xs, sizeof xs) ==
         CUBLAS_STATUS_SUCCESS;
  float best = 0.0f;
  int bi = -1;
  double ald = a->alpha, bed = a->beta;
  float alf = (float)a->alpha, bef = (float)a->beta;
  const void* al = k.abdt == KCU_F64 ? (const void*)&ald : (const void*)&alf;
  const void* be = k.abdt == KCU_F64 ? (const void*)&bed : (const void*)&bef;
  for (int i = 0; ok && i < n; i++) {
    if (res[i].state != CUBLAS_STATUS_SUCCESS || res[i].workspaceSize > c->ws_bytes) continue;
    if (cublasLtMatmul(c->lt, p->desc, al, a->B, p->la, a->A, p->lb, be, cs, p->lc, cs, p->lc, &res[i].algo, c->ws,
                       c->ws_bytes, stream) != CUBLAS_STATUS_SUCCESS)
      continue;
    cudaEventRecord(e0, stream);
    int bad = 0;
    for (int r = 0; r < kTuneReps && !bad; r++)
      bad = cublasLtMatmul(c->lt, p->desc, al, a->B, p->la, a->A, p->lb, be, cs, p->lc, cs, p->lc, &res[i].algo,
                           c->ws, c->ws_bytes, stream) != CUBLAS_STATUS_SUCCESS;
    cudaEventRecord(e1, stream);
    float ms = 0.0f;
    if (bad || cudaEventSynchronize(e1) != cudaSuccess || cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess) continue;
    if (bi < 0 || ms < best) { best = ms; bi = i; }
  }
  if (bi >= 0) p->algo = res[bi].algo;
  if (aux_out) set_pointers(p->desc, a); /* the caller's aux again */
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  if (cs) cudaFree(cs);
  if (xs) cudaFree(xs);
  cudaGetLastError(); /* a failed allocation above is not the caller's error */
}

int build_plan(kcu_gemm_ctx* c, GemmPlan* p, const GemmKey& k, const kcu_gemm_args* a, cudaStream_t stream) {
  memset(p, 0, sizeof *p);
  p->key = k;
  cublasComputeType_t ct = k.abdt == KCU_F64 ? CUBLAS_COMPUTE_64F
                           : (k.abdt == KCU_F32 && k.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F);
  cudaDataType_t st = k.abdt == KCU_F64 ? CUDA_R_64F : CUDA_R_32F;
  cublasStatus_t s = cublasLtMatmulDescCreate(&p->desc, ct, st);
  if (s != CUBLAS_STATUS_SUCCESS) return lt_err(s);
  cublasOperation_t opa = k.tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = k.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasLtEpilogue_t epi = lt_epilogue(k.epi);
  s = cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi);
  if (s == CUBLAS_STATUS_SUCCESS && epi_bias(k.epi)) {
    cudaDataType_t bt = data_type(k.bias_dt);
    s = cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt);
  }
  if (s == CUBLAS_STATUS_SUCCESS && epi_aux(k.epi)) {
    s = cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &k.ldaux, sizeof k.ldaux);
    if (s == CUBLAS_STATUS_SUCCESS && k.batch > 1)
      s = cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, &k.sc, sizeof k.sc);
  }
  int e = lt_err(s);
  if (!e) e = set_pointers(p->desc, a);
  if (e) { cublasLtMatmulDescDestroy(p->desc); return e; }
  cudaDataType_t abt = data_type(k.abdt), ctp = data_type(k.cdt);
  e = set_layout(&p->la, abt, k.tb ? k.K : k.N, k.tb ? k.N : k.K, k.ldb, k.batch, k.sb);
  if (e) { cublasLtMatmulDescDestroy(p->desc); return e; }
  e = set_layout(&p->lb, abt, k.ta ? k.M : k.K, k.ta ? k.K : k.M, k.lda, k.batch, k.sa);
  if (e) { cublasLtMatrixLayoutDestroy(p->la); cublasLtMatmulDescDestroy(p->desc); return e; }
  e = set_layout(&p->lc, ctp, k.N, k.M, k.ldc, k.batch, k.sc);
  if (e) {
    cublasLtMatrixLayoutDestroy(p->lb); cublasLtMatrixLayoutDestroy(p->la); cublasLtMatmulDescDestroy(p->desc);
    return e;
  }
  p->used = 1;
  cublasLtMatmulPreference_t pref;
  s = cublasLtMatmulPreferenceCreate(&pref);
  if (s != CUBLAS_STATUS_SUCCESS) { plan_free(p); return lt_err(s); }
  uint64_t wsb = c->ws ? (uint64_t)c->ws_bytes : 0;
  s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb);
  cublasLtMatmulHeuristicResult_t res[kTuneAlgos];
  int nres = 0;
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulAlgoGetHeuristic(c->lt, p->desc, p->la, p->lb, p->lc, p->lc, pref,
                                       gemm_autotune() ? kTuneAlgos : 1, res, &nres);
  cublasLtMatmulPreferenceDestroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS) { plan_free(p); return lt_err(s); }
  if (nres < 1) { plan_free(p); return KCU_ENOALGO; }
  p->algo = res[0].algo;
  if (nres > 1) autotune(c, p, k, a, res, nres, stream);
  return KCU_OK;
}

int valid_types(int abdt, int cdt) {
  switch (abdt) {
    case KCU_BF16: return cdt == KCU_BF16 || cdt == KCU_F32;
    case KCU_F16: return cdt == KCU_F16 || cdt == KCU_F32;
    case KCU_F32: return cdt == KCU_F32;
    case KCU_F64: return cdt == KCU_F64;
    default: return 0;
  }
}

}  // namespace

extern "C" int kcu_gemm_create(kcu_gemm_ctx** out, void* ws, size_t ws_bytes) {
  if (!out) return KCU_EARG;
  *out = NULL;
  kcu_gemm_ctx* c = (kcu_gemm_ctx*)calloc(1, sizeof(kcu_gemm_ctx));
  if (!c) return (int)cudaErrorMemoryAllocation;
  cublasStatus_t s = cublasLtCreate(&c->lt);
  if (s != CUBLAS_STATUS_SUCCESS) { free(c); return lt_err(s); }
  c->ws = ws;
  c->ws_bytes = ws ? ws_bytes : 0;
  *out = c;
  return KCU_OK;
}

extern "C" void kcu_gemm_destroy(kcu_gemm_ctx* c) {
  if (!c) return;
  for (int i = 0; i < kCacheSize; i++) plan_free(&c->plans[i]);
  cublasLtDestroy(c->lt);
  free(c);
}

extern "C" int kcu_gemm(kcu_gemm_ctx* c, const kcu_gemm_args* a, cudaStream_t stream) {
  if (!c || !a) return KCU_EARG;
  if (a->M < 0 || a->N < 0 || a->K < 0 || !valid_types(a->abdt, a->cdt)) return KCU_EARG;
  if (a->epilogue < KCU_EPI_NONE || a->epilogue > KCU_EPI_DGELU) return KCU_EARG;
  int64_t batch = a->batch > 1 ? a->batch : 1;
  if (a->M == 0 || a->N == 0 || batch == 0) return KCU_OK;
  if (a->K == 0) return KCU_EARG; /* an empty inner dim: the caller fills C */
  if (!a->A || !a->B || !a->C) return KCU_EARG;
  if (a->lda < (a->ta ? a->M : a->K) || a->ldb < (a->tb ? a->K : a->N) || a->ldc < a->N) return KCU_EARG;
  if (epi_bias(a->epilogue) && (!a->bias || !valid_types(a->abdt, a->bias_dt))) return KCU_EARG;
  if (epi_aux(a->epilogue) && (!a->aux || a->ldaux < a->N || a->ldaux % 8)) return KCU_EARG;
  if (a->abdt == KCU_F64 && a->epilogue != KCU_EPI_NONE && a->epilogue != KCU_EPI_BIAS) return KCU_EARG;
  GemmKey k;
  memset(&k, 0, sizeof k);
  k.ta = !!a->ta; k.tb = !!a->tb; k.abdt = a->abdt; k.cdt = a->cdt; k.tf32 = a->abdt == KCU_F32 && a->tf32;
  k.epi = a->epilogue; k.bias_dt = epi_bias(a->epilogue) ? a->bias_dt : 0; k.align = align_class(a);
  k.M = a->M; k.N = a->N; k.K = a->K; k.lda = a->lda; k.ldb = a->ldb; k.ldc = a->ldc;
  k.ldaux = epi_aux(a->epilogue) ? a->ldaux : 0;
  k.batch = batch;
  if (batch > 1) { k.sa = a->sa; k.sb = a->sb; k.sc = a->sc; }
  GemmPlan* p = NULL;
  for (int i = 0; i < kCacheSize; i++)
    if (c->plans[i].used && memcmp(&c->plans[i].key, &k, sizeof k) == 0) { p = &c->plans[i]; break; }
  if (!p) {
    p = &c->plans[c->next];
    c->next = (c->next + 1) % kCacheSize;
    plan_free(p);
    int e = build_plan(c, p, k, a, stream);
    if (e) return e;
  } else {
    int e = set_pointers(p->desc, a);
    if (e) return e;
  }
  cublasStatus_t s;
  if (a->abdt == KCU_F64) {
    double al = a->alpha, be = a->beta;
    s = cublasLtMatmul(c->lt, p->desc, &al, a->B, p->la, a->A, p->lb, &be, a->C, p->lc, a->C, p->lc, &p->algo, c->ws,
                       c->ws_bytes, stream);
  } else {
    float al = (float)a->alpha, be = (float)a->beta;
    s = cublasLtMatmul(c->lt, p->desc, &al, a->B, p->la, a->A, p->lb, &be, a->C, p->lc, a->C, p->lc, &p->algo, c->ws,
                       c->ws_bytes, stream);
  }
  return lt_err(s);
}
