/* embedding.cu: embedding row gather (forward) and its atomic-free,
 * sort-free backward.
 *
 * Backward: the vocabulary is cut into bands of R consecutive rows, one
 * block per band (about 1024 blocks).  A block zeroes its rows of gw, then
 * scans all indices in order, a block-width chunk at a time: the positions
 * whose index falls in the band are compacted in order (warp ballots and a
 * prefix over the warps) into shared memory, and the block adds their
 * go rows to gw, one position after the other, each thread owning the
 * same columns every time.  So every gw element is written by one thread
 * only, in position order: no atomics, no sort, bit-identical results from
 * run to run.  Cost: every block reads the index list once (from L2). */
#include "common.cuh"
#include "kvocab_cuda.h"

namespace {

const int kThreads = 256;
const int kTargetBlocks = 1024;

template <typename U>
__global__ void emb_fwd(int64_t n_idx, const void* idx, int idt, const U* w, int64_t V, int64_t row_u, U* out,
                        int* bad, int64_t off, int* neg, int64_t vtotal) {
  int64_t total = n_idx * row_u;
  int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += step) {
    int64_t i = e / row_u, c = e - i * row_u;
    int64_t k0 = kidx(idx, idt, i), k = k0 - off;
    if (k < 0 || k >= V) {
      out[e] = U();
      if (bad && c == 0) *bad = 1;
      if (neg && c == 0 && (k0 < 0 || (vtotal >= 0 && k0 >= vtotal))) *neg = 1;
    } else {
      out[e] = w[k * row_u + c];
    }
  }
}

template <typename G, typename A>
__global__ void __launch_bounds__(kThreads) emb_bwd(int64_t n_idx, const void* idx, int idt, const G* go,
                                                    int64_t dim, int64_t V, int64_t pad, int64_t R, A* gw,
                                                    int64_t off) {
  __shared__ int64_t pos[kThreads];
  __shared__ int wcount[kThreads / 32];
  const int t = threadIdx.x, lane = t & 31, wid = t >> 5;
  const int64_t v0 = (int64_t)blockIdx.x * R;
  const int64_t v1 = v0 + R < V ? v0 + R : V;
  if (v0 >= V) return;
  for (int64_t e = t; e < (v1 - v0) * dim; e += kThreads) gw[v0 * dim + e] = (A)0;
  __syncthreads();
  for (int64_t base = 0; base < n_idx; base += kThreads) {
    int64_t i = base + t;
    int64_t k = i < n_idx ? kidx(idx, idt, i) - off : -1;
    int match = i < n_idx && k >= v0 && k < v1 && k != pad;
    unsigned ballot = __ballot_sync(0xffffffffu, match);
    if (lane == 0) wcount[wid] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0; /* not `off`: that is the shard's first row */
    for (int w = 0; w < kThreads / 32; w++) {
      if (w < wid) before += wcount[w];
      total += wcount[w];
    }
    if (match) pos[before + __popc(ballot & ((1u << lane) - 1u))] = i;
    __syncthreads();
    for (int q = 0; q < total; q++) {
      int64_t p = pos[q];
      int64_t row = kidx(idx, idt, p) - off;
      const G* src = go + p * dim;
      A* dst = gw + row * dim;
      for (int64_t c = t; c < dim; c += kThreads) dst[c] += (A)kload(src[c]);
    }
    __syncthreads();
  }
}

template <typename U>
int emb_fwd_run(int64_t n_idx, const void* idx, int idt, const void* w, int64_t V, int64_t row_bytes, void* out,
                int* bad, cudaStream_t s, int64_t off = 0, int* neg = NULL,
                int64_t total = -1) {
  int64_t row_u = row_bytes / (int64_t)sizeof(U);
  emb_fwd<U><<<kcu_grid(n_idx * row_u, kThreads, 1 << 16), kThreads, 0, s>>>(n_idx, idx, idt, (const U*)w, V, row_u,
                                                                              (U*)out, bad, off, neg, total);
  return kcu_launch_status();
}

template <typename G, typename A>
int emb_bwd_run(int64_t n_idx, const void* idx, int idt, const void* go, int64_t dim, int64_t V, int64_t pad,
                void* gw, cudaStream_t s, int64_t off = 0) {
  int64_t R = kcu_cdiv(V, kTargetBlocks);
  if (R < 1) R = 1;
  int64_t nb = kcu_cdiv(V, R);
  emb_bwd<G, A><<<(unsigned)nb, kThreads, 0, s>>>(n_idx, idx, idt, (const G*)go, dim, V, pad, R, (A*)gw, off);
  return kcu_launch_status();
}

int aligned(const void* p, int a) { return ((uintptr_t)p % (uintptr_t)a) == 0; }

}  // namespace

extern "C" int kcu_embedding_fwd(int64_t n_idx, const void* idx, int idt, const void* w, int64_t V, int64_t row_bytes,
                                 void* out, int* bad, cudaStream_t s) {
  if (n_idx < 0 || V < 0 || row_bytes < 0 || (idt != KCU_I32 && idt != KCU_I64)) return KCU_EARG;
  if (n_idx == 0 || row_bytes == 0) return KCU_OK;
  if (!idx || !out || (V > 0 && !w)) return KCU_EARG;
  if (row_bytes % 16 == 0 && aligned(w, 16) && aligned(out, 16))
    return emb_fwd_run<uint4>(n_idx, idx, idt, w, V, row_bytes, out, bad, s);
  if (row_bytes % 4 == 0 && aligned(w, 4) && aligned(out, 4))
    return emb_fwd_run<uint32_t>(n_idx, idx, idt, w, V, row_bytes, out, bad, s);
  return emb_fwd_run<uint8_t>(n_idx, idx, idt, w, V, row_bytes, out, bad, s);
}

extern "C" int kcu_embedding_bwd(int gdt, int64_t n_idx, const void* idx, int idt, const void* go, int64_t dim,
                                 int64_t V, int64_t pad, void* gw, cudaStream_t s) {
  if (n_idx < 0 || V < 0 || dim < 0 || (idt != KCU_I32 && idt != KCU_I64)) return KCU_EARG;
  if (V == 0 || dim == 0) return KCU_OK;
  if (!gw || (n_idx > 0 && (!idx || !go))) return KCU_EARG;
  switch (gdt) {
    case KCU_F32: return emb_bwd_run<float, float>(n_idx, idx, idt, go, dim, V, pad, gw, s);
    case KCU_BF16: return emb_bwd_run<kbf16, float>(n_idx, idx, idt, go, dim, V, pad, gw, s);
    case KCU_F16: return emb_bwd_run<kf16, float>(n_idx, idx, idt, go, dim, V, pad, gw, s);
    case KCU_F64: return emb_bwd_run<double, double>(n_idx, idx, idt, go, dim, V, pad, gw, s);
    default: return KCU_EARG;
  }
}

/* Masked (row-sharded) embedding: the shard owns rows [off, off + rows); other indices give zero rows. */
extern "C" int kcu_embedding_masked_fwd(int64_t n_idx, const void* idx, int idt, const void* w, int64_t rows,
                                        int64_t row_bytes, int64_t off, int64_t total, void* out, int* bad,
                                        cudaStream_t s) {
  if (n_idx < 0 || rows < 0 || row_bytes < 0 || (idt != KCU_I32 && idt != KCU_I64)) return KCU_EARG;
  if (n_idx == 0 || row_bytes == 0) return KCU_OK;
  if (!idx || !out || (rows > 0 && !w)) return KCU_EARG;
  if (row_bytes % 16 == 0 && aligned(w, 16) && aligned(out, 16))
    return emb_fwd_run<uint4>(n_idx, idx, idt, w, rows, row_bytes, out, NULL, s, off, bad, total);
  if (row_bytes % 4 == 0 && aligned(w, 4) && aligned(out, 4))
    return emb_fwd_run<uint32_t>(n_idx, idx, idt, w, rows, row_bytes, out, NULL, s, off, bad, total);
  return emb_fwd_run<uint8_t>(n_idx, idx, idt, w, rows, row_bytes, out, NULL, s, off, bad, total);
}

extern "C" int kcu_embedding_masked_bwd(int gdt, int64_t n_idx, const void* idx, int idt, const void* go, int64_t dim,
                                        int64_t rows, int64_t off, void* gw, cudaStream_t s) {
  if (n_idx < 0 || rows < 0 || dim < 0 || (idt != KCU_I32 && idt != KCU_I64)) return KCU_EARG;
  if (rows == 0 || dim == 0) return KCU_OK;
  if (!gw || (n_idx > 0 && (!idx || !go))) return KCU_EARG;
  switch (gdt) {
    case KCU_F32: return emb_bwd_run<float, float>(n_idx, idx, idt, go, dim, rows, -1, gw, s, off);
    case KCU_BF16: return emb_bwd_run<kbf16, float>(n_idx, idx, idt, go, dim, rows, -1, gw, s, off);
    case KCU_F16: return emb_bwd_run<kf16, float>(n_idx, idx, idt, go, dim, rows, -1, gw, s, off);
    case KCU_F64: return emb_bwd_run<double, double>(n_idx, idx, idt, go, dim, rows, -1, gw, s, off);
    default: return KCU_EARG;
  }
}
