/* cuda_vocab.c: device side of the vocab-parallel local ops (see ops/cuda_vocab.h): the kernels of
 * kernels/cuda/vocab_parallel.cu and the masked embedding of kernels/cuda/embedding.cu on the compute stream. */
#include "ops/cuda_vocab.h"

#ifdef ENG_HAVE_CUDA
#include "kernels/cuda/kcuda.h"
#include "kernels/cuda/kvocab_cuda.h"
#include "eng/cuda.h"

static int ck(int st, const char* op) { return st == 0 ? 0 : eng_cuda_check(st, op); }
#define STREAM_OR_FAIL(op)                                                      \
  cudaStream_t s = (cudaStream_t)eng_cuda_stream(ENG_CUDA_STREAM_COMPUTE);     \
  if (!s) { eng_err_prefix("%s", op); return -1; }

int eng_cu_vp_ce_prep(int64_t M, const int64_t* tgt, int64_t total, int64_t ignore, const double* w, double* rw,
                      double slice_err, double* err, double* wsum, const char* op) {
  STREAM_OR_FAIL(op);
  return ck(kcu_vp_ce_prep(M, tgt, total, ignore, w, rw, slice_err, err, wsum, s), op);
}
int eng_cu_vp_ce_max(int dt, int64_t M, int64_t V, const void* x, double* mx, const char* op) {
  STREAM_OR_FAIL(op);
  return ck(kcu_vp_ce_max(dt, M, V, x, mx, s), op);
}
int eng_cu_vp_ce_sumexp(int dt, int64_t M, int64_t V, const void* x, const double* mx, const int64_t* tgt,
                        int64_t off, int64_t ignore, double* se, double* tl, const char* op) {
  STREAM_OR_FAIL(op);
  return ck(kcu_vp_ce_sumexp(dt, M, V, x, mx, tgt, off, ignore, se, tl, s), op);
}
int eng_cu_vp_ce_loss(int dt, int64_t M, const double* mx, const double* se, const double* tl, const int64_t* tgt,
                      int64_t ignore, const double* rw, const double* wsum, int reduction, void* lse, void* out,
                      const char* op) {
  STREAM_OR_FAIL(op);
  return ck(kcu_vp_ce_loss(dt, M, mx, se, tl, tgt, ignore, rw, wsum, reduction, lse, out, s), op);
}
int eng_cu_vp_ce_bwd(int dt, int64_t M, int64_t V, const void* x, const void* lse, const int64_t* tgt, int64_t off,
                     int64_t ignore, const void* g, int gdt, int per_row, const double* rw, const double* div, void* gx,
                     const char* op) {
  STREAM_OR_FAIL(op);
  return ck(kcu_vp_ce_bwd(dt, M, V, x, lse, tgt, off, ignore, g, gdt, per_row, rw, div, gx, s), op);
}

int eng_cu_embedding_masked_fwd(int64_t n_idx, const void* idx, int idt, const void* w, int64_t rows,
                                int64_t row_bytes, int64_t off, int64_t total, void* out, const char* op) {
  if (n_idx == 0) return 0;
  STREAM_OR_FAIL(op);
  int* neg = eng_cuda_malloc(sizeof(int));
  if (!neg) { eng_err_prefix("%s", op); return -1; }
  int rc = eng_cuda_memset(neg, 0, sizeof(int));
  if (!rc) rc = ck(kcu_embedding_masked_fwd(n_idx, idx, idt, w, rows, row_bytes, off, total, out, neg, s), op);
  int b = 0;
  if (!rc && eng_cuda_memcpy_d2h(&b, neg, sizeof(int))) { eng_err_prefix("%s", op); rc = -1; }
  eng_cuda_free(neg);
  return rc ? rc : (b ? 1 : 0);
}
int eng_cu_embedding_masked_bwd(int gdt, int64_t n_idx, const void* idx, int idt, const void* go, int64_t dim,
                                int64_t rows, int64_t off, void* gw, const char* op) {
  STREAM_OR_FAIL(op);
  return ck(kcu_embedding_masked_bwd(gdt, n_idx, idx, idt, go, dim, rows, off, gw, s), op);
}
int eng_cu_read_f64(const double* src, double* dst, int n, const char* op) {
  if (n <= 0) return 0;
  if (eng_cuda_memcpy_d2h(dst, src, (int64_t)n * (int64_t)sizeof(double))) { eng_err_prefix("%s", op); return -1; }
  return 0;
}

#else /* no CUDA backend: never reached (no tensor lives on cuda) */
static int none(const char* op) { return eng_err("%s: this build has no CUDA backend", op); }
int eng_cu_vp_ce_prep(int64_t M, const int64_t* tgt, int64_t total, int64_t ignore, const double* w, double* rw,
                      double slice_err, double* err, double* wsum, const char* op) {
  (void)M; (void)tgt; (void)total; (void)ignore; (void)w; (void)rw; (void)slice_err; (void)err; (void)wsum;
  return none(op);
}
int eng_cu_vp_ce_max(int dt, int64_t M, int64_t V, const void* x, double* mx, const char* op) {
  (void)dt; (void)M; (void)V; (void)x; (void)mx;
  return none(op);
}
int eng_cu_vp_ce_sumexp(int dt, int64_t M, int64_t V, const void* x, const double* mx, const int64_t* tgt,
                        int64_t off, int64_t ignore, double* se, double* tl, const char* op) {
  (void)dt; (void)M; (void)V; (void)x; (void)mx; (void)tgt; (void)off; (void)ignore; (void)se; (void)tl;
  return none(op);
}
int eng_cu_vp_ce_loss(int dt, int64_t M, const double* mx, const double* se, const double* tl, const int64_t* tgt,
                      int64_t ignore, const double* rw, const double* wsum, int reduction, void* lse, void* out,
                      const char* op) {
  (void)dt; (void)M; (void)mx; (void)se; (void)tl; (void)tgt; (void)ignore; (void)rw; (void)wsum; (void)reduction;
  (void)lse; (void)out;
  return none(op);
}
int eng_cu_vp_ce_bwd(int dt, int64_t M, int64_t V, const void* x, const void* lse, const int64_t* tgt, int64_t off,
                     int64_t ignore, const void* g, int gdt, int per_row, const double* rw, const double* div, void* gx,
                     const char* op) {
  (void)dt; (void)M; (void)V; (void)x; (void)lse; (void)tgt; (void)off; (void)ignore; (void)g; (void)gdt;
  (void)per_row; (void)rw; (void)div; (void)gx;
  return none(op);
}
int eng_cu_embedding_masked_fwd(int64_t n_idx, const void* idx, int idt, const void* w, int64_t rows,
                                int64_t row_bytes, int64_t off, int64_t total, void* out, const char* op) {
  (void)n_idx; (void)idx; (void)idt; (void)w; (void)rows; (void)row_bytes; (void)off; (void)total; (void)out;
  return none(op);
}
int eng_cu_embedding_masked_bwd(int gdt, int64_t n_idx, const void* idx, int idt, const void* go, int64_t dim,
                                int64_t rows, int64_t off, void* gw, const char* op) {
  (void)gdt; (void)n_idx; (void)idx; (void)idt; (void)go; (void)dim; (void)rows; (void)off; (void)gw;
  return none(op);
}
int eng_cu_read_f64(const double* src, double* dst, int n, const char* op) {
  (void)src; (void)dst; (void)n;
  return none(op);
}
#endif
