/* attention.cu: flash-style scaled dot-product attention, forward and
 * backward (f32 math; f32, bf16 or f16 data), optionally causal.
 *
 * Layout: each query (or key) row is owned by TPR = DM / 32 consecutive
 * threads of a warp; thread `part` of a row holds the 32 head dims
 * d = i * TPR + part (i < 32) in registers, so the TPR threads reading a
 * shared-memory row touch consecutive words (no bank conflicts) and a dot
 * product is 32 FMAs plus log2(TPR) shuffles.  DM (32, 64, 128) is the
 * compiled maximum head dim; smaller D are zero-padded.
 *
 * Forward (per block: BR = 64 query rows of one (batch, head)): K and V
 * tiles of BC = 32 rows are staged in shared memory (converted to f32);
 * each row keeps a running max m and sum l (online softmax in base 2, q
 * pre-scaled by scale * log2 e) and its output accumulator; the natural
 * logsumexp m ln 2 + ln l is saved.  Causal blocks stop at their last row.
 * Backward (FlashAttention-2 scheme, no atomics):
 *   delta_i = sum_d dout_id o_id                         (attn_delta)
 *   p_ij = exp(q_i.k_j scale - lse_i), ds_ij = p_ij (dout_i.v_j - delta_i)
 *   dv_j = sum_i p_ij dout_i, dk_j = scale sum_i ds_ij q_i  (attn_dkv: key rows in registers,
 *                                                            query tiles in shared memory)
 *   dq_i = scale sum_j ds_ij k_j                           (attn_dq: the mirror image)
 * Each output element is accumulated by one thread in a fixed order:
 * deterministic.  On the tensor cores with head dims up to 64 the default is
 * FlashAttention-2's one-pass form instead (ENGINE_ATTN_BWD=split: the two
 * kernels; =fused: the one-pass form at D = 128 too): attn_bwd_fused_tc per
 * key block adds its dq share into an f32 workspace with atomics,
 * attn_dq_convert rounds it into dq (see the kernel).
 *
 * Tensor-core path (bf16/f16, D in {32, 64, 128}, sm_80+): the same three
 * kernels written with mma.sync.m16n8k16 (f32 accumulators).  A warp owns
 * 16 rows; fragments follow the PTX ISA layouts (g = lane / 4, t = lane % 4):
 *   A 16x16: {a0 a1} (row g, cols 2t, 2t+1), {a2 a3} (row g+8, same cols),
 *            {a4 a5} (row g, cols 2t+8, 2t+9), {a6 a7} (row g+8, same cols)
 *   B 16x8:  {b0 b1} (k = 2t, 2t+1; col g), {b2 b3} (k = 2t+8, 2t+9; col g)
 *   C 16x8:  c0 c1 (row g, cols 2t, 2t+1), c2 c3 (row g+8, same cols)
 * so the C fragments of two adjacent 8-column blocks of S are, once packed
 * to 16 bits, exactly the A fragment of that 16-wide slice: P and dS go from
 * one product into the next without leaving registers.  B operands come
 * from shared memory through ldmatrix (.x4: two mma operands per
 * instruction; .trans for V and dO, Q and K along the row index), the A
 * operands (Q, dO, K, V rows a warp owns) from global memory once.  Row
 * statistics (max, sum) are combined over the 4 threads of a group with two
 * shuffles; the causal / length mask is applied only in the tiles that need
 * it. */
#include "common.cuh"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdlib.h>
#include <string.h>

namespace {

const int BR = 64;   /* query rows per block (forward, dq) */
const int BC = 32;   /* key rows per shared-memory tile (forward, dq) */
const int BK = 64;   /* key rows per block (dkv) */
const int BQ = 32;   /* query rows per shared-memory tile (dkv) */
const int DPT = 32;  /* head dims per thread */
const float kLog2e = 1.4426950408889634f;
const float kLn2 = 0.6931471805599453f;

template <int TPR> __device__ __forceinline__ float row_sum(float v) {
#pragma unroll
  for (int o = TPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/* Query tile of this block: causal blocks run the longest (last) tiles
 * first, which balances the tail of the grid. */
__device__ __forceinline__ int tile_index(int causal) {
  return causal ? (int)(gridDim.y - 1 - blockIdx.y) : (int)blockIdx.y;
}

/* Loads row r (< rows, else zeros) of a [rows, D] slice into registers:
 * x[i] = row[i * TPR + part] * mul for i * TPR + part < D. */
template <typename T, int TPR>
__device__ __forceinline__ void load_row(const T* base, int64_t sl, int r, int rows, int D, int part, float mul,
                                         float (&x)[DPT]) {
#pragma unroll
  for (int i = 0; i < DPT; i++) {
    int d = i * TPR + part;
    x[i] = (r < rows && d < D) ? kload(base[(int64_t)r * sl + d]) * mul : 0.0f;
  }
}

template <typename T, int TPR>
__device__ __forceinline__ void store_row(T* base, int64_t sl, int r, int rows, int D, int part, float mul,
                                          const float (&x)[DPT]) {
  if (r >= rows) return;
#pragma unroll
  for (int i = 0; i < DPT; i++) {
    int d = i * TPR + part;
    if (d < D) base[(int64_t)r * sl + d] = kstore<T>(x[i] * mul);
  }
}

/* Stages rows [r0, r0 + NR) of a [rows, D] slice into sh[NR][DM] as f32
 * (zeros outside). */
template <typename T, int NR, int DM>
__device__ __forceinline__ void stage(float (*sh)[DM], const T* base, int64_t sl, int r0, int rows, int D) {
  for (int e = threadIdx.x; e < NR * DM; e += blockDim.x) {
    int r = e / DM, d = e - r * DM;
    int gr = r0 + r;
    sh[r][d] = (gr < rows && d < D) ? kload(base[(int64_t)gr * sl + d]) : 0.0f;
  }
}

template <typename T, int DM>
__global__ void __launch_bounds__(BR * (DM / 32)) attn_fwd(kcu_attn_args a) {
  constexpr int TPR = DM / 32;
  __shared__ float Ks[BC][DM], Vs[BC][DM];
  const int row = threadIdx.x / TPR, part = threadIdx.x % TPR;
  const int b = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int q0 = tile_index(a.causal) * BR, qi = q0 + row;
  const T* qb = (const T*)a.q + b * a.sq[0] + h * a.sq[1];
  const T* kb = (const T*)a.k + b * a.sk[0] + h * a.sk[1];
  const T* vb = (const T*)a.v + b * a.sv[0] + h * a.sv[1];
  float q[DPT], acc[DPT];
  load_row<T, TPR>(qb, a.sq[2], qi, a.Lq, a.D, part, a.scale * kLog2e, q);
#pragma unroll
  for (int i = 0; i < DPT; i++) acc[i] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  int kend = a.causal ? min(a.Lk, q0 + BR) : a.Lk;
  for (int k0 = 0; k0 < kend; k0 += BC) {
    __syncthreads();
    stage<T, BC, DM>(Ks, kb, a.sk[2], k0, a.Lk, a.D);
    stage<T, BC, DM>(Vs, vb, a.sv[2], k0, a.Lk, a.D);
    __syncthreads();
    float sc[BC];
    float mt = -INFINITY;
#pragma unroll
    for (int j = 0; j < BC; j++) {
      float p = 0.0f;
#pragma unroll
      for (int i = 0; i < DPT; i++) p += q[i] * Ks[j][i * TPR + part];
      p = row_sum<TPR>(p);
      int kj = k0 + j;
      sc[j] = (kj >= a.Lk || (a.causal && kj > qi)) ? -INFINITY : p;
      mt = fmaxf(mt, sc[j]);
    }
    float mn = fmaxf(m, mt);
    if (mn != -INFINITY) {
      float corr = exp2f(m - mn);
      l *= corr;
#pragma unroll
      for (int i = 0; i < DPT; i++) acc[i] *= corr;
#pragma unroll
      for (int j = 0; j < BC; j++) {
        float p = exp2f(sc[j] - mn);
        l += p;
#pragma unroll
        for (int i = 0; i < DPT; i++) acc[i] += p * Vs[j][i * TPR + part];
      }
      m = mn;
    }
  }
  T* ob = (T*)a.o + b * a.so[0] + h * a.so[1];
  store_row<T, TPR>(ob, a.so[2], qi, a.Lq, a.D, part, l > 0.0f ? 1.0f / l : 0.0f, acc);
  if (qi < a.Lq && part == 0)
    a.lse[((int64_t)b * a.H + h) * a.Lq + qi] = l > 0.0f ? m * kLn2 + logf(l) : -INFINITY;
}

/* delta[b, h, i] = sum_d dout[b, h, i, d] o[b, h, i, d]: one warp per row. */
template <typename T>
__global__ void attn_delta(kcu_attn_args a) {
  int64_t rows = (int64_t)a.B * a.H * a.Lq;
  int lane = threadIdx.x & 31;
  int64_t wstep = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += wstep) {
    int64_t i = r % a.Lq, bh = r / a.Lq;
    int64_t b = bh / a.H, h = bh % a.H;
    const T* o = (const T*)a.o + b * a.so[0] + h * a.so[1] + i * a.so[2];
    const T* g = (const T*)a.dout + b * a.sdo[0] + h * a.sdo[1] + i * a.sdo[2];
    float s = 0.0f;
    for (int d = lane; d < a.D; d += 32) s += kload(o[d]) * kload(g[d]);
    s = warp_sum(s);
    if (lane == 0) a.delta[r] = s;
  }
}

template <typename T, int DM>
__global__ void __launch_bounds__(BK * (DM / 32)) attn_dkv(kcu_attn_args a) {
  constexpr int TPR = DM / 32;
  __shared__ float Qs[BQ][DM], Gs[BQ][DM];
  __shared__ float Ls[BQ], Ds[BQ];
  const int row = threadIdx.x / TPR, part = threadIdx.x % TPR;
  const int b = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int k0 = blockIdx.y * BK, kj = k0 + row;
  const int64_t bh = (int64_t)b * a.H + h;
  const T* qb = (const T*)a.q + b * a.sq[0] + h * a.sq[1];
  const T* gb = (const T*)a.dout + b * a.sdo[0] + h * a.sdo[1];
  float k[DPT], v[DPT], dk[DPT], dv[DPT];
  load_row<T, TPR>((const T*)a.k + b * a.sk[0] + h * a.sk[1], a.sk[2], kj, a.Lk, a.D, part, 1.0f, k);
  load_row<T, TPR>((const T*)a.v + b * a.sv[0] + h * a.sv[1], a.sv[2], kj, a.Lk, a.D, part, 1.0f, v);
#pragma unroll
  for (int i = 0; i < DPT; i++) { dk[i] = 0.0f; dv[i] = 0.0f; }
  const float sl2 = a.scale * kLog2e;
  /* causal: query rows below k0 see none of this block's keys */
  int qstart = a.causal ? (k0 / BQ) * BQ : 0;
  for (int q0 = qstart; q0 < a.Lq; q0 += BQ) {
    __syncthreads();
    stage<T, BQ, DM>(Qs, qb, a.sq[2], q0, a.Lq, a.D);
    stage<T, BQ, DM>(Gs, gb, a.sdo[2], q0, a.Lq, a.D);
    if (threadIdx.x < BQ) {
      int qi = q0 + threadIdx.x;
      Ls[threadIdx.x] = qi < a.Lq ? a.lse[bh * a.Lq + qi] * kLog2e : -INFINITY;
      Ds[threadIdx.x] = qi < a.Lq ? a.delta[bh * a.Lq + qi] : 0.0f;
    }
    __syncthreads();
#pragma unroll 4
    for (int ii = 0; ii < BQ; ii++) {
      int qi = q0 + ii;
      float s = 0.0f, dp = 0.0f;
#pragma unroll
      for (int i = 0; i < DPT; i++) {
        s += k[i] * Qs[ii][i * TPR + part];
        dp += v[i] * Gs[ii][i * TPR + part];
      }
      s = row_sum<TPR>(s);
      dp = row_sum<TPR>(dp);
      float lse2 = Ls[ii];
      bool masked = qi >= a.Lq || kj >= a.Lk || (a.causal && kj > qi) || lse2 == -INFINITY;
      float p = masked ? 0.0f : exp2f(s * sl2 - lse2);
      float ds = p * (dp - Ds[ii]);
#pragma unroll
      for (int i = 0; i < DPT; i++) {
        dv[i] += p * Gs[ii][i * TPR + part];
        dk[i] += ds * Qs[ii][i * TPR + part];
      }
    }
  }
  store_row<T, TPR>((T*)a.dk + b * a.sdk[0] + h * a.sdk[1], a.sdk[2], kj, a.Lk, a.D, part, a.scale, dk);
  store_row<T, TPR>((T*)a.dv + b * a.sdv[0] + h * a.sdv[1], a.sdv[2], kj, a.Lk, a.D, part, 1.0f, dv);
}

template <typename T, int DM>
__global__ void __launch_bounds__(BR * (DM / 32)) attn_dq(kcu_attn_args a) {
  constexpr int TPR = DM / 32;
  __shared__ float Ks[BC][DM], Vs[BC][DM];
  const int row = threadIdx.x / TPR, part = threadIdx.x % TPR;
  const int b = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int q0 = tile_index(a.causal) * BR, qi = q0 + row;
  const int64_t bh = (int64_t)b * a.H + h;
  const T* kb = (const T*)a.k + b * a.sk[0] + h * a.sk[1];
  const T* vb = (const T*)a.v + b * a.sv[0] + h * a.sv[1];
  float q[DPT], g[DPT], dq[DPT];
  load_row<T, TPR>((const T*)a.q + b * a.sq[0] + h * a.sq[1], a.sq[2], qi, a.Lq, a.D, part, 1.0f, q);
  load_row<T, TPR>((const T*)a.dout + b * a.sdo[0] + h * a.sdo[1], a.sdo[2], qi, a.Lq, a.D, part, 1.0f, g);
#pragma unroll
  for (int i = 0; i < DPT; i++) dq[i] = 0.0f;
  const float sl2 = a.scale * kLog2e;
  const float lse2 = qi < a.Lq ? a.lse[bh * a.Lq + qi] * kLog2e : -INFINITY;
  const float dl = qi < a.Lq ? a.delta[bh * a.Lq + qi] : 0.0f;
  int kend = a.causal ? min(a.Lk, q0 + BR) : a.Lk;
  for (int k0 = 0; k0 < kend; k0 += BC) {
    __syncthreads();
    stage<T, BC, DM>(Ks, kb, a.sk[2], k0, a.Lk, a.D);
    stage<T, BC, DM>(Vs, vb, a.sv[2], k0, a.Lk, a.D);
    __syncthreads();
#pragma unroll 4
    for (int j = 0; j < BC; j++) {
      int kj = k0 + j;
      float s = 0.0f, dp = 0.0f;
#pragma unroll
      for (int i = 0; i < DPT; i++) {
        s += q[i] * Ks[j][i * TPR + part];
        dp += g[i] * Vs[j][i * TPR + part];
      }
      s = row_sum<TPR>(s);
      dp = row_sum<TPR>(dp);
      bool masked = qi >= a.Lq || kj >= a.Lk || (a.causal && kj > qi) || lse2 == -INFINITY;
      float p = masked ? 0.0f : exp2f(s * sl2 - lse2);
      float ds = p * (dp - dl);
#pragma unroll
      for (int i = 0; i < DPT; i++) dq[i] += ds * Ks[j][i * TPR + part];
    }
  }
  store_row<T, TPR>((T*)a.dq + b * a.sdq[0] + h * a.sdq[1], a.sdq[2], qi, a.Lq, a.D, part, a.scale, dq);
}

/* ================================================================ tensor-core path */
template <typename T> struct mma_t;
template <> struct mma_t<kbf16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
  }
};
template <> struct mma_t<kf16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
  }
};

const int TC_ROWS = 64;   /* rows per block: 4 warps x 16 */
const int TC_KT = 64;     /* key rows per shared tile (forward, dq) */
const int TC_QT = 32;     /* query rows per shared tile (dkv) */

/* 32-bit word (2 elements) at (row, col) of a [rows, *] slice; 0 past the end. */
__device__ __forceinline__ uint32_t ld32(const uint16_t* base, int64_t sl, int row, int rows, int col) {
  return row < rows ? *reinterpret_cast<const uint32_t*>(base + (int64_t)row * sl + col) : 0u;
}

/* A fragments of rows r0..r0+15 (all D/16 k-chunks) straight from global memory. */
template <int D>
__device__ __forceinline__ void load_afrag(uint32_t (&f)[D / 16][4], const uint16_t* base, int64_t sl, int r0, int rows,
                                           int g, int t) {
#pragma unroll
  for (int kc = 0; kc < D / 16; kc++) {
    int c = kc * 16 + 2 * t;
    f[kc][0] = ld32(base, sl, r0 + g, rows, c);
    f[kc][1] = ld32(base, sl, r0 + g + 8, rows, c);
    f[kc][2] = ld32(base, sl, r0 + g, rows, c + 8);
    f[kc][3] = ld32(base, sl, r0 + g + 8, rows, c + 8);
  }
}

/* Rows [r0, r0 + NR) of a [rows, D] slice into sh (row stride D + 8), 16 bytes
 * at a time; zeros past the end. */
template <int D, int NR>
__device__ __forceinline__ void stage_tc(uint16_t* sh, const uint16_t* base, int64_t sl, int r0, int rows) {
  constexpr int CH = D / 8;
  for (int e = threadIdx.x; e < NR * CH; e += blockDim.x) {
    int r = e / CH, c = e - r * CH;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r0 + r < rows) v = *reinterpret_cast<const uint4*>(base + (int64_t)(r0 + r) * sl + c * 8);
    *reinterpret_cast<uint4*>(sh + r * (D + 8) + c * 8) = v;
  }
}

/* The same with cp.async (sm_80+): the copies run while the block computes on the other buffer; zeros past the
 * end are stored directly.  cp_commit closes a group of copies, cp_wait<N> waits until at most N groups are in
 * flight (then a __syncthreads makes every thread's copies visible). */
__device__ __forceinline__ void cp_async16(uint16_t* dst, const uint16_t* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
#else
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}
__device__ __forceinline__ void cp_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N> __device__ __forceinline__ void cp_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}
template <int D, int NR>
__device__ __forceinline__ void stage_async(uint16_t* sh, const uint16_t* base, int64_t sl, int r0, int rows) {
  constexpr int CH = D / 8;
  for (int e = threadIdx.x; e < NR * CH; e += blockDim.x) {
    int r = e / CH, c = e - r * CH;
    uint16_t* dst = sh + r * (D + 8) + c * 8;
    if (r0 + r < rows) cp_async16(dst, base + (int64_t)(r0 + r) * sl + c * 8);
    else *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
  }
}

/* Tiles staged in shared memory: PIPE (head dims up to 64, where two buffers of each operand fit the 48 KiB of
 * static shared memory) double-buffers them with cp.async, so the next tile's copies overlap this tile's
 * products; otherwise one buffer, filled between two barriers.  Each kernel's loop:
 *   tiles.begin(first)                       (PIPE: the first tile's copies)
 *   for each tile: tiles.ready(this, next)   (the tile in shared memory; PIPE: the next one's copies issued)
 *                  ...products on tiles.cur...
 *                  tiles.done()              (PIPE: every warp is past this buffer before it is refilled) */

/* B operands from a shared tile sh (row stride D + 8):
 *   bfrag_cols: k along the columns of sh: row n, columns k0 + 2t, +1 (b0) and k0 + 2t + 8, +9 (b1);
 *   bfrag_rows: k along the row index of sh: rows k0 + 2t, +1 (b0) and k0 + 2t + 8, +9 (b1), column n.
 * Both come two mma operands at a time from ldmatrix (bfrag_rows through its transposing form). */
/* ldmatrix: four 8x8 16-bit matrices from shared memory in one instruction; lane l gives the address of row
 * l % 8 of matrix l / 8 and receives, of each matrix, row l / 4, columns 2 (l % 4) and + 1 (.trans: that row and
 * column swapped), which is an mma B fragment half.  Rows are 16-byte aligned (row stride (D + 8) * 2 bytes, a
 * multiple of 16, and 8 rows at that stride fall in distinct bank groups: no conflicts). */
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const uint16_t* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
#else
  (void)p; r[0] = r[1] = r[2] = r[3] = 0u;
  __trap();
#endif
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const uint16_t* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
#else
  (void)p; r[0] = r[1] = r[2] = r[3] = 0u;
  __trap();
#endif
}
/* bfrag_cols for two k-chunks at once: r[0], r[1] = (b0, b1) of row n0 + g, columns k0..k0+15; r[2], r[3] the
 * same for columns k0+16..k0+31. */
template <int D>
__device__ __forceinline__ void bfrag_cols_x4(const uint16_t* sh, int n0, int k0, int lane, uint32_t (&r)[4]) {
  ldsm_x4(r, sh + (n0 + (lane & 7)) * (D + 8) + k0 + (lane >> 3) * 8);
}
/* bfrag_rows for two 8-column blocks at once: r[0], r[1] = (b0, b1) of rows k0..k0+15, column n0 + g; r[2], r[3]
 * the same for column n0 + 8 + g. */
template <int D>
__device__ __forceinline__ void bfrag_rows_x4(const uint16_t* sh, int k0, int n0, int lane, uint32_t (&r)[4]) {
  ldsm_x4_trans(r, sh + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * (D + 8) + n0 + (lane >> 4) * 8);
}

/* C fragments (rows r0 + g, r0 + g + 8) times mul0 / mul1 into a [rows, D] slice. */
template <typename T, int D>
__device__ __forceinline__ void store_cfrag(const float (&acc)[D / 8][4], uint16_t* base, int64_t sl, int r0, int rows,
                                            float mul0, float mul1, int g, int t) {
#pragma unroll
  for (int nd = 0; nd < D / 8; nd++) {
    int c = nd * 8 + 2 * t;
    if (r0 + g < rows)
      *reinterpret_cast<uint32_t*>(base + (int64_t)(r0 + g) * sl + c) = mma_t<T>::pack(acc[nd][0] * mul0, acc[nd][1] * mul0);
    if (r0 + g + 8 < rows)
      *reinterpret_cast<uint32_t*>(base + (int64_t)(r0 + g + 8) * sl + c) =
          mma_t<T>::pack(acc[nd][2] * mul1, acc[nd][3] * mul1);
  }
}

template <typename T, int D, bool PIPE>
__global__ void __launch_bounds__(128) attn_fwd_tc(kcu_attn_args a) {
  constexpr int L = D + 8, NBUF = PIPE ? 2 : 1;
  __shared__ __align__(16) uint16_t Kb[NBUF][TC_KT * L];
  __shared__ __align__(16) uint16_t Vb[NBUF][TC_KT * L];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int b = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int q0 = tile_index(a.causal) * TC_ROWS, qw = q0 + warp * 16;
  const uint16_t* qb = (const uint16_t*)a.q + b * a.sq[0] + h * a.sq[1];
  const uint16_t* kb = (const uint16_t*)a.k + b * a.sk[0] + h * a.sk[1];
  const uint16_t* vb = (const uint16_t*)a.v + b * a.sv[0] + h * a.sv[1];
  uint32_t qf[D / 16][4];
  load_afrag<D>(qf, qb, a.sq[2], qw, a.Lq, g, t);
  float o[D / 8][4];
#pragma unroll
  for (int nd = 0; nd < D / 8; nd++) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const float sl2 = a.scale * kLog2e;
  const int kend = a.causal ? min(a.Lk, q0 + TC_ROWS) : a.Lk;
  if (PIPE && kend > 0) {
    stage_async<D, TC_KT>(Kb[0], kb, a.sk[2], 0, a.Lk);
    stage_async<D, TC_KT>(Vb[0], vb, a.sv[2], 0, a.Lk);
    cp_commit();
  }
  for (int k0 = 0, it = 0; k0 < kend; k0 += TC_KT, it++) {
    const int cur = PIPE ? (it & 1) : 0;
    if (PIPE) {
      if (k0 + TC_KT < kend) {
        stage_async<D, TC_KT>(Kb[cur ^ 1], kb, a.sk[2], k0 + TC_KT, a.Lk);
        stage_async<D, TC_KT>(Vb[cur ^ 1], vb, a.sv[2], k0 + TC_KT, a.Lk);
        cp_commit();
        cp_wait<1>();
      } else {
        cp_wait<0>();
      }
      __syncthreads();
    } else {
      __syncthreads();
      stage_tc<D, TC_KT>(Kb[0], kb, a.sk[2], k0, a.Lk);
      stage_tc<D, TC_KT>(Vb[0], vb, a.sv[2], k0, a.Lk);
      __syncthreads();
    }
    const uint16_t* Ks = Kb[cur];
    const uint16_t* Vs = Vb[cur];
    float s[TC_KT / 8][4];
#pragma unroll
    for (int nb = 0; nb < TC_KT / 8; nb++) {
      s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
#pragma unroll
      for (int kc = 0; kc < D / 16; kc += 2) {
        uint32_t b[4];
        bfrag_cols_x4<D>(Ks, nb * 8, kc * 16, lane, b);
        mma_t<T>::mma(s[nb], qf[kc], b[0], b[1]);
        mma_t<T>::mma(s[nb], qf[kc + 1], b[2], b[3]);
      }
    }
    /* only the tiles at the end of the keys or on the causal diagonal need the mask (warp-uniform) */
    const bool need_mask = k0 + TC_KT > a.Lk || (a.causal && k0 + TC_KT - 1 > qw);
    float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nb = 0; nb < TC_KT / 8; nb++)
#pragma unroll
      for (int i = 0; i < 4; i++) {
        float v = s[nb][i] * sl2;
        if (need_mask) {
          int key = k0 + nb * 8 + 2 * t + (i & 1), row = qw + g + (i >> 1) * 8;
          if (key >= a.Lk || (a.causal && key > row)) v = -INFINITY;
        }
        s[nb][i] = v;
        mt[i >> 1] = fmaxf(mt[i >> 1], v);
      }
    float corr[2], mn[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
      mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 1));
      mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 2));
      mn[r] = fmaxf(m[r], mt[r]);
      corr[r] = mn[r] == -INFINITY ? 1.0f : exp2f(m[r] - mn[r]);
      m[r] = mn[r];
      l[r] *= corr[r];
    }
#pragma unroll
    for (int nb = 0; nb < TC_KT / 8; nb++)
#pragma unroll
      for (int i = 0; i < 4; i++) {
        int r = i >> 1;
        float p = mn[r] == -INFINITY ? 0.0f : exp2f(s[nb][i] - mn[r]);
        s[nb][i] = p;
        l[r] += p;
      }
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++) {
      o[nd][0] *= corr[0]; o[nd][1] *= corr[0];
      o[nd][2] *= corr[1]; o[nd][3] *= corr[1];
    }
#pragma unroll
    for (int kc = 0; kc < TC_KT / 16; kc++) {
      uint32_t pa[4] = {mma_t<T>::pack(s[2 * kc][0], s[2 * kc][1]), mma_t<T>::pack(s[2 * kc][2], s[2 * kc][3]),
                        mma_t<T>::pack(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                        mma_t<T>::pack(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
      for (int nd = 0; nd < D / 8; nd += 2) {
        uint32_t b[4];
        bfrag_rows_x4<D>(Vs, kc * 16, nd * 8, lane, b);
        mma_t<T>::mma(o[nd], pa, b[0], b[1]);
        mma_t<T>::mma(o[nd + 1], pa, b[2], b[3]);
      }
    }
    if (PIPE) __syncthreads();
  }
  float lt[2];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    lt[r] = l[r] + __shfl_xor_sync(0xffffffffu, l[r], 1);
    lt[r] += __shfl_xor_sync(0xffffffffu, lt[r], 2);
  }
  uint16_t* ob = (uint16_t*)a.o + b * a.so[0] + h * a.so[1];
  store_cfrag<T, D>(o, ob, a.so[2], qw, a.Lq, lt[0] > 0.0f ? 1.0f / lt[0] : 0.0f, lt[1] > 0.0f ? 1.0f / lt[1] : 0.0f,
                    g, t);
  if (t == 0) {
    float* lse = a.lse + ((int64_t)b * a.H + h) * a.Lq;
#pragma unroll
    for (int r = 0; r < 2; r++) {
      int row = qw + g + 8 * r;
      if (row < a.Lq) lse[row] = lt[r] > 0.0f ? m[r] * kLn2 + logf(lt[r]) : -INFINITY;
    }
  }
}

/* attn_fwd_tc with MT 16-row M-tiles per warp (block rows 64 MT), chosen by ENGINE_ATTN_FWD_ROWS=128 (MT = 2) until
 * a GPU run has measured it against attn_fwd_tc (docs/gpu-runs/PENDING.md); MT = 1 is attn_fwd_tc's algorithm.
 * MT = 2 shares every K and V fragment a warp loads from shared
 * memory between two M-tiles, halving the shared-memory reads per product (head dims up to 64, where the doubled
 * accumulators fit the registers); a warp whose rows all precede a causal tile's keys skips that tile. */
template <typename T, int D, bool PIPE, int MT>
__global__ void __launch_bounds__(128) attn_fwd_tc_mt(kcu_attn_args a) {
  constexpr int L = D + 8, NBUF = PIPE ? 2 : 1, ROWS = 64 * MT;
  __shared__ __align__(16) uint16_t Kb[NBUF][TC_KT * L];
  __shared__ __align__(16) uint16_t Vb[NBUF][TC_KT * L];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int b = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int q0 = tile_index(a.causal) * ROWS, qw0 = q0 + warp * 16 * MT;
  const uint16_t* qb = (const uint16_t*)a.q + b * a.sq[0] + h * a.sq[1];
  const uint16_t* kb = (const uint16_t*)a.k + b * a.sk[0] + h * a.sk[1];
  const uint16_t* vb = (const uint16_t*)a.v + b * a.sv[0] + h * a.sv[1];
  uint32_t qf[MT][D / 16][4];
  float o[MT][D / 8][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    load_afrag<D>(qf[mt], qb, a.sq[2], qw0 + 16 * mt, a.Lq, g, t);
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++) o[mt][nd][0] = o[mt][nd][1] = o[mt][nd][2] = o[mt][nd][3] = 0.0f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.0f;
  }
  const float sl2 = a.scale * kLog2e;
  const int kend = a.causal ? min(a.Lk, q0 + ROWS) : a.Lk;
  if (PIPE && kend > 0) {
    stage_async<D, TC_KT>(Kb[0], kb, a.sk[2], 0, a.Lk);
    stage_async<D, TC_KT>(Vb[0], vb, a.sv[2], 0, a.Lk);
    cp_commit();
  }
  for (int k0 = 0, it = 0; k0 < kend; k0 += TC_KT, it++) {
    const int cur = PIPE ? (it & 1) : 0;
    if (PIPE) {
      if (k0 + TC_KT < kend) {
        stage_async<D, TC_KT>(Kb[cur ^ 1], kb, a.sk[2], k0 + TC_KT, a.Lk);
        stage_async<D, TC_KT>(Vb[cur ^ 1], vb, a.sv[2], k0 + TC_KT, a.Lk);
        cp_commit();
        cp_wait<1>();
      } else {
        cp_wait<0>();
      }
      __syncthreads();
    } else {
      __syncthreads();
      stage_tc<D, TC_KT>(Kb[0], kb, a.sk[2], k0, a.Lk);
      stage_tc<D, TC_KT>(Vb[0], vb, a.sv[2], k0, a.Lk);
      __syncthreads();
    }
    const uint16_t* Ks = Kb[cur];
    const uint16_t* Vs = Vb[cur];
    /* causal: every key of this tile follows every row of this warp (warp-uniform; never with MT = 1) */
    if (!(a.causal && k0 > qw0 + 16 * MT - 1)) {
      float s[MT][TC_KT / 8][4];
#pragma unroll
      for (int nb = 0; nb < TC_KT / 8; nb++) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++) s[mt][nb][0] = s[mt][nb][1] = s[mt][nb][2] = s[mt][nb][3] = 0.0f;
#pragma unroll
        for (int kc = 0; kc < D / 16; kc += 2) {
          uint32_t bb[4];
          bfrag_cols_x4<D>(Ks, nb * 8, kc * 16, lane, bb);
#pragma unroll
          for (int mt = 0; mt < MT; mt++) {
            mma_t<T>::mma(s[mt][nb], qf[mt][kc], bb[0], bb[1]);
            mma_t<T>::mma(s[mt][nb], qf[mt][kc + 1], bb[2], bb[3]);
          }
        }
      }
      /* only the tiles at the end of the keys or on the causal diagonal need the mask (warp-uniform) */
      const bool need_mask = k0 + TC_KT > a.Lk || (a.causal && k0 + TC_KT - 1 > qw0);
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nb = 0; nb < TC_KT / 8; nb++)
#pragma unroll
          for (int i = 0; i < 4; i++) {
            float v = s[mt][nb][i] * sl2;
            if (need_mask) {
              int key = k0 + nb * 8 + 2 * t + (i & 1), row = qw0 + 16 * mt + g + (i >> 1) * 8;
              if (key >= a.Lk || (a.causal && key > row)) v = -INFINITY;
            }
            s[mt][nb][i] = v;
            mx[i >> 1] = fmaxf(mx[i >> 1], v);
          }
        float corr[2], mn[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
          mn[r] = fmaxf(m[mt][r], mx[r]);
          corr[r] = mn[r] == -INFINITY ? 1.0f : exp2f(m[mt][r] - mn[r]);
          m[mt][r] = mn[r];
          l[mt][r] *= corr[r];
        }
#pragma unroll
        for (int nb = 0; nb < TC_KT / 8; nb++)
#pragma unroll
          for (int i = 0; i < 4; i++) {
            int r = i >> 1;
            float p = mn[r] == -INFINITY ? 0.0f : exp2f(s[mt][nb][i] - mn[r]);
            s[mt][nb][i] = p;
            l[mt][r] += p;
          }
#pragma unroll
        for (int nd = 0; nd < D / 8; nd++) {
          o[mt][nd][0] *= corr[0]; o[mt][nd][1] *= corr[0];
          o[mt][nd][2] *= corr[1]; o[mt][nd][3] *= corr[1];
        }
      }
#pragma unroll
      for (int kc = 0; kc < TC_KT / 16; kc++) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          pa[mt][0] = mma_t<T>::pack(s[mt][2 * kc][0], s[mt][2 * kc][1]);
          pa[mt][1] = mma_t<T>::pack(s[mt][2 * kc][2], s[mt][2 * kc][3]);
          pa[mt][2] = mma_t<T>::pack(s[mt][2 * kc + 1][0], s[mt][2 * kc + 1][1]);
          pa[mt][3] = mma_t<T>::pack(s[mt][2 * kc + 1][2], s[mt][2 * kc + 1][3]);
        }
#pragma unroll
        for (int nd = 0; nd < D / 8; nd += 2) {
          uint32_t bb[4];
          bfrag_rows_x4<D>(Vs, kc * 16, nd * 8, lane, bb);
#pragma unroll
          for (int mt = 0; mt < MT; mt++) {
            mma_t<T>::mma(o[mt][nd], pa[mt], bb[0], bb[1]);
            mma_t<T>::mma(o[mt][nd + 1], pa[mt], bb[2], bb[3]);
          }
        }
      }
    }
    if (PIPE) __syncthreads();
  }
  uint16_t* ob = (uint16_t*)a.o + b * a.so[0] + h * a.so[1];
  float* lse = a.lse + ((int64_t)b * a.H + h) * a.Lq;
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    float lt[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
      lt[r] = l[mt][r] + __shfl_xor_sync(0xffffffffu, l[mt][r], 1);
      lt[r] += __shfl_xor_sync(0xffffffffu, lt[r], 2);
    }
    const int qw = qw0 + 16 * mt;
    store_cfrag<T, D>(o[mt], ob, a.so[2], qw, a.Lq, lt[0] > 0.0f ? 1.0f / lt[0] : 0.0f,
                      lt[1] > 0.0f ? 1.0f / lt[1] : 0.0f, g, t);
    if (t == 0) {
#pragma unroll
      for (int r = 0; r < 2; r++) {
        int row = qw + g + 8 * r;
        if (row < a.Lq) lse[row] = lt[r] > 0.0f ? m[mt][r] * kLn2 + logf(lt[r]) : -INFINITY;
      }
    }
  }
}

/* dK, dV for 64 keys per block (16 per warp), query tiles of TC_QT rows. */
template <typename T, int D, bool PIPE>
__global__ void __launch_bounds__(128) attn_dkv_tc(kcu_attn_args a) {
  constexpr int L = D + 8, NBUF = PIPE ? 2 : 1;
  constexpr int NQ = TC_QT / 8;  /* 8-query blocks per tile */
  __shared__ __align__(16) uint16_t Qb[NBUF][TC_QT * L];
  __shared__ __align__(16) uint16_t Gb[NBUF][TC_QT * L];
  __shared__ float Lb[NBUF][TC_QT], Db[NBUF][TC_QT];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int b = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int k0 = blockIdx.y * TC_ROWS, kw = k0 + warp * 16;
  const int64_t bh = (int64_t)b * a.H + h;
  const uint16_t* qb = (const uint16_t*)a.q + b * a.sq[0] + h * a.sq[1];
  const uint16_t* gb = (const uint16_t*)a.dout + b * a.sdo[0] + h * a.sdo[1];
  uint32_t kf[D / 16][4], vf[D / 16][4];
  load_afrag<D>(kf, (const uint16_t*)a.k + b * a.sk[0] + h * a.sk[1], a.sk[2], kw, a.Lk, g, t);
  load_afrag<D>(vf, (const uint16_t*)a.v + b * a.sv[0] + h * a.sv[1], a.sv[2], kw, a.Lk, g, t);
  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int nd = 0; nd < D / 8; nd++)
#pragma unroll
    for (int i = 0; i < 4; i++) { dk[nd][i] = 0.0f; dv[nd][i] = 0.0f; }
  const float sl2 = a.scale * kLog2e;
  const int qstart = a.causal ? (k0 / TC_QT) * TC_QT : 0;
  auto stats = [&](int buf, int q0) {
    if (threadIdx.x < TC_QT) {
      int qi = q0 + threadIdx.x;
      Lb[buf][threadIdx.x] = qi < a.Lq ? a.lse[bh * a.Lq + qi] * kLog2e : -INFINITY;
      Db[buf][threadIdx.x] = qi < a.Lq ? a.delta[bh * a.Lq + qi] : 0.0f;
    }
  };
  if (PIPE && qstart < a.Lq) {
    stage_async<D, TC_QT>(Qb[0], qb, a.sq[2], qstart, a.Lq);
    stage_async<D, TC_QT>(Gb[0], gb, a.sdo[2], qstart, a.Lq);
    cp_commit();
    stats(0, qstart);
  }
  for (int q0 = qstart, it = 0; q0 < a.Lq; q0 += TC_QT, it++) {
    const int cur = PIPE ? (it & 1) : 0;
    if (PIPE) {
      if (q0 + TC_QT < a.Lq) {
        stage_async<D, TC_QT>(Qb[cur ^ 1], qb, a.sq[2], q0 + TC_QT, a.Lq);
        stage_async<D, TC_QT>(Gb[cur ^ 1], gb, a.sdo[2], q0 + TC_QT, a.Lq);
        cp_commit();
        stats(cur ^ 1, q0 + TC_QT);
        cp_wait<1>();
      } else {
        cp_wait<0>();
      }
      __syncthreads();
    } else {
      __syncthreads();
      stage_tc<D, TC_QT>(Qb[0], qb, a.sq[2], q0, a.Lq);
      stage_tc<D, TC_QT>(Gb[0], gb, a.sdo[2], q0, a.Lq);
      stats(0, q0);
      __syncthreads();
    }
    const uint16_t* Qs = Qb[cur];
    const uint16_t* Gs = Gb[cur];
    const float* Ls = Lb[cur];
    const float* Ds = Db[cur];
    /* S^T = K Q^T and dP^T = V dO^T: 16 keys x TC_QT queries */
    float st[NQ][4], dpt[NQ][4];
#pragma unroll
    for (int nb = 0; nb < NQ; nb++) {
#pragma unroll
      for (int i = 0; i < 4; i++) { st[nb][i] = 0.0f; dpt[nb][i] = 0.0f; }
#pragma unroll
      for (int kc = 0; kc < D / 16; kc += 2) {
        uint32_t b[4];
        bfrag_cols_x4<D>(Qs, nb * 8, kc * 16, lane, b);
        mma_t<T>::mma(st[nb], kf[kc], b[0], b[1]);
        mma_t<T>::mma(st[nb], kf[kc + 1], b[2], b[3]);
        bfrag_cols_x4<D>(Gs, nb * 8, kc * 16, lane, b);
        mma_t<T>::mma(dpt[nb], vf[kc], b[0], b[1]);
        mma_t<T>::mma(dpt[nb], vf[kc + 1], b[2], b[3]);
      }
    }
    /* P^T and dS^T = P^T (dP^T - delta); the mask only where the tile reaches past the queries or keys or
     * crosses the causal diagonal (warp-uniform; elsewhere every lse is finite) */
    const bool need_mask = q0 + TC_QT > a.Lq || kw + 16 > a.Lk || (a.causal && kw + 15 > q0);
#pragma unroll
    for (int nb = 0; nb < NQ; nb++)
#pragma unroll
      for (int i = 0; i < 4; i++) {
        int qc = nb * 8 + 2 * t + (i & 1), qi = q0 + qc, key = kw + g + (i >> 1) * 8;
        float l2 = Ls[qc];
        bool masked = need_mask && (qi >= a.Lq || key >= a.Lk || (a.causal && key > qi) || l2 == -INFINITY);
        float p = masked ? 0.0f : exp2f(st[nb][i] * sl2 - l2);
        st[nb][i] = p;
        dpt[nb][i] = p * (dpt[nb][i] - Ds[qc]);
      }
    /* dV += P^T dO, dK += dS^T Q (k along the tile's query rows) */
#pragma unroll
    for (int kc = 0; kc < TC_QT / 16; kc++) {
      uint32_t pa[4] = {mma_t<T>::pack(st[2 * kc][0], st[2 * kc][1]), mma_t<T>::pack(st[2 * kc][2], st[2 * kc][3]),
                        mma_t<T>::pack(st[2 * kc + 1][0], st[2 * kc + 1][1]),
                        mma_t<T>::pack(st[2 * kc + 1][2], st[2 * kc + 1][3])};
      uint32_t sa[4] = {mma_t<T>::pack(dpt[2 * kc][0], dpt[2 * kc][1]), mma_t<T>::pack(dpt[2 * kc][2], dpt[2 * kc][3]),
                        mma_t<T>::pack(dpt[2 * kc + 1][0], dpt[2 * kc + 1][1]),
                        mma_t<T>::pack(dpt[2 * kc + 1][2], dpt[2 * kc + 1][3])};
#pragma unroll
      for (int nd = 0; nd < D / 8; nd += 2) {
        uint32_t b[4];
        bfrag_rows_x4<D>(Gs, kc * 16, nd * 8, lane, b);
        mma_t<T>::mma(dv[nd], pa, b[0], b[1]);
        mma_t<T>::mma(dv[nd + 1], pa, b[2], b[3]);
        bfrag_rows_x4<D>(Qs, kc * 16, nd * 8, lane, b);
        mma_t<T>::mma(dk[nd], sa, b[0], b[1]);
        mma_t<T>::mma(dk[nd + 1], sa, b[2], b[3]);
      }
    }
    if (PIPE) __syncthreads();
  }
  store_cfrag<T, D>(dk, (uint16_t*)a.dk + b * a.sdk[0] + h * a.sdk[1], a.sdk[2], kw, a.Lk, a.scale, a.scale, g, t);
  store_cfrag<T, D>(dv, (uint16_t*)a.dv + b * a.sdv[0] + h * a.sdv[1], a.sdv[2], kw, a.Lk, 1.0f, 1.0f, g, t);
}

/* dQ for 64 queries per block (16 per warp), key tiles of TC_KT rows. */
template <typename T, int D, bool PIPE>
__global__ void __launch_bounds__(128) attn_dq_tc(kcu_attn_args a) {
  constexpr int L = D + 8, NBUF = PIPE ? 2 : 1;
  __shared__ __align__(16) uint16_t Kb[NBUF][TC_KT * L];
  __shared__ __align__(16) uint16_t Vb[NBUF][TC_KT * L];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int b = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int q0 = tile_index(a.causal) * TC_ROWS, qw = q0 + warp * 16;
  const int64_t bh = (int64_t)b * a.H + h;
  const uint16_t* kb = (const uint16_t*)a.k + b * a.sk[0] + h * a.sk[1];
  const uint16_t* vb = (const uint16_t*)a.v + b * a.sv[0] + h * a.sv[1];
  uint32_t qf[D / 16][4], gf[D / 16][4];
  load_afrag<D>(qf, (const uint16_t*)a.q + b * a.sq[0] + h * a.sq[1], a.sq[2], qw, a.Lq, g, t);
  load_afrag<D>(gf, (const uint16_t*)a.dout + b * a.sdo[0] + h * a.sdo[1], a.sdo[2], qw, a.Lq, g, t);
  float l2[2], dl[2];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    int row = qw + g + 8 * r;
    l2[r] = row < a.Lq ? a.lse[bh * a.Lq + row] * kLog2e : -INFINITY;
    dl[r] = row < a.Lq ? a.delta[bh * a.Lq + row] : 0.0f;
  }
  float dq[D / 8][4];
#pragma unroll
  for (int nd = 0; nd < D / 8; nd++) dq[nd][0] = dq[nd][1] = dq[nd][2] = dq[nd][3] = 0.0f;
  const float sl2 = a.scale * kLog2e;
  const int kend = a.causal ? min(a.Lk, q0 + TC_ROWS) : a.Lk;
  if (PIPE && kend > 0) {
    stage_async<D, TC_KT>(Kb[0], kb, a.sk[2], 0, a.Lk);
    stage_async<D, TC_KT>(Vb[0], vb, a.sv[2], 0, a.Lk);
    cp_commit();
  }
  for (int k0 = 0, it = 0; k0 < kend; k0 += TC_KT, it++) {
    const int cur = PIPE ? (it & 1) : 0;
    if (PIPE) {
      if (k0 + TC_KT < kend) {
        stage_async<D, TC_KT>(Kb[cur ^ 1], kb, a.sk[2], k0 + TC_KT, a.Lk);
        stage_async<D, TC_KT>(Vb[cur ^ 1], vb, a.sv[2], k0 + TC_KT, a.Lk);
        cp_commit();
        cp_wait<1>();
      } else {
        cp_wait<0>();
      }
      __syncthreads();
    } else {
      __syncthreads();
      stage_tc<D, TC_KT>(Kb[0], kb, a.sk[2], k0, a.Lk);
      stage_tc<D, TC_KT>(Vb[0], vb, a.sv[2], k0, a.Lk);
      __syncthreads();
    }
    const uint16_t* Ks = Kb[cur];
    const uint16_t* Vs = Vb[cur];
    float s[TC_KT / 8][4], dp[TC_KT / 8][4];
#pragma unroll
    for (int nb = 0; nb < TC_KT / 8; nb++) {
#pragma unroll
      for (int i = 0; i < 4; i++) { s[nb][i] = 0.0f; dp[nb][i] = 0.0f; }
#pragma unroll
      for (int kc = 0; kc < D / 16; kc += 2) {
        uint32_t b[4];
        bfrag_cols_x4<D>(Ks, nb * 8, kc * 16, lane, b);
        mma_t<T>::mma(s[nb], qf[kc], b[0], b[1]);
        mma_t<T>::mma(s[nb], qf[kc + 1], b[2], b[3]);
        bfrag_cols_x4<D>(Vs, nb * 8, kc * 16, lane, b);
        mma_t<T>::mma(dp[nb], gf[kc], b[0], b[1]);
        mma_t<T>::mma(dp[nb], gf[kc + 1], b[2], b[3]);
      }
    }
    const bool need_mask = qw + 16 > a.Lq || k0 + TC_KT > a.Lk || (a.causal && k0 + TC_KT - 1 > qw);
#pragma unroll
    for (int nb = 0; nb < TC_KT / 8; nb++)
#pragma unroll
      for (int i = 0; i < 4; i++) {
        int r = i >> 1, key = k0 + nb * 8 + 2 * t + (i & 1), row = qw + g + 8 * r;
        bool masked = need_mask && (row >= a.Lq || key >= a.Lk || (a.causal && key > row) || l2[r] == -INFINITY);
        float p = masked ? 0.0f : exp2f(s[nb][i] * sl2 - l2[r]);
        s[nb][i] = p * (dp[nb][i] - dl[r]);  /* dS */
      }
#pragma unroll
    for (int kc = 0; kc < TC_KT / 16; kc++) {
      uint32_t sa[4] = {mma_t<T>::pack(s[2 * kc][0], s[2 * kc][1]), mma_t<T>::pack(s[2 * kc][2], s[2 * kc][3]),
                        mma_t<T>::pack(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                        mma_t<T>::pack(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
      for (int nd = 0; nd < D / 8; nd += 2) {
        uint32_t b[4];
        bfrag_rows_x4<D>(Ks, kc * 16, nd * 8, lane, b);
        mma_t<T>::mma(dq[nd], sa, b[0], b[1]);
        mma_t<T>::mma(dq[nd + 1], sa, b[2], b[3]);
      }
    }
    if (PIPE) __syncthreads();
  }
  store_cfrag<T, D>(dq, (uint16_t*)a.dq + b * a.sdq[0] + h * a.sdq[1], a.sdq[2], qw, a.Lq, a.scale, a.scale, g, t);
}

/* attn_dq_tc with MT 16-row M-tiles per warp and key tiles of KT rows: ENGINE_ATTN_DQ_ROWS=128 runs MT = 2 with
 * KT = 32 (the accumulators of two M-tiles fit the registers with half-size key tiles; every K and V fragment a warp
 * loads serves both M-tiles) until a GPU run has measured it against attn_dq_tc (docs/gpu-runs/PENDING.md).  Causal
 * tiles past all of a warp's rows are skipped. */
template <typename T, int D, bool PIPE, int MT, int KT>
__global__ void __launch_bounds__(128) attn_dq_tc_mt(kcu_attn_args a) {
  constexpr int L = D + 8, NBUF = PIPE ? 2 : 1, ROWS = 64 * MT;
  __shared__ __align__(16) uint16_t Kb[NBUF][KT * L];
  __shared__ __align__(16) uint16_t Vb[NBUF][KT * L];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int b = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int q0 = tile_index(a.causal) * ROWS, qw0 = q0 + warp * 16 * MT;
  const int64_t bh = (int64_t)b * a.H + h;
  const uint16_t* kb = (const uint16_t*)a.k + b * a.sk[0] + h * a.sk[1];
  const uint16_t* vb = (const uint16_t*)a.v + b * a.sv[0] + h * a.sv[1];
  uint32_t qf[MT][D / 16][4], gf[MT][D / 16][4];
  float l2[MT][2], dl[MT][2], dq[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    load_afrag<D>(qf[mt], (const uint16_t*)a.q + b * a.sq[0] + h * a.sq[1], a.sq[2], qw0 + 16 * mt, a.Lq, g, t);
    load_afrag<D>(gf[mt], (const uint16_t*)a.dout + b * a.sdo[0] + h * a.sdo[1], a.sdo[2], qw0 + 16 * mt, a.Lq, g, t);
#pragma unroll
    for (int r = 0; r < 2; r++) {
      int row = qw0 + 16 * mt + g + 8 * r;
      l2[mt][r] = row < a.Lq ? a.lse[bh * a.Lq + row] * kLog2e : -INFINITY;
      dl[mt][r] = row < a.Lq ? a.delta[bh * a.Lq + row] : 0.0f;
    }
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++) dq[mt][nd][0] = dq[mt][nd][1] = dq[mt][nd][2] = dq[mt][nd][3] = 0.0f;
  }
  const float sl2 = a.scale * kLog2e;
  const int kend = a.causal ? min(a.Lk, q0 + ROWS) : a.Lk;
  if (PIPE && kend > 0) {
    stage_async<D, KT>(Kb[0], kb, a.sk[2], 0, a.Lk);
    stage_async<D, KT>(Vb[0], vb, a.sv[2], 0, a.Lk);
    cp_commit();
  }
  for (int k0 = 0, it = 0; k0 < kend; k0 += KT, it++) {
    const int cur = PIPE ? (it & 1) : 0;
    if (PIPE) {
      if (k0 + KT < kend) {
        stage_async<D, KT>(Kb[cur ^ 1], kb, a.sk[2], k0 + KT, a.Lk);
        stage_async<D, KT>(Vb[cur ^ 1], vb, a.sv[2], k0 + KT, a.Lk);
        cp_commit();
        cp_wait<1>();
      } else {
        cp_wait<0>();
      }
      __syncthreads();
    } else {
      __syncthreads();
      stage_tc<D, KT>(Kb[0], kb, a.sk[2], k0, a.Lk);
      stage_tc<D, KT>(Vb[0], vb, a.sv[2], k0, a.Lk);
      __syncthreads();
    }
    const uint16_t* Ks = Kb[cur];
    const uint16_t* Vs = Vb[cur];
    if (!(a.causal && k0 > qw0 + 16 * MT - 1)) {
      float s[MT][KT / 8][4], dp[MT][KT / 8][4];
#pragma unroll
      for (int nb = 0; nb < KT / 8; nb++) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
          for (int i = 0; i < 4; i++) { s[mt][nb][i] = 0.0f; dp[mt][nb][i] = 0.0f; }
#pragma unroll
        for (int kc = 0; kc < D / 16; kc += 2) {
          uint32_t bb[4];
          bfrag_cols_x4<D>(Ks, nb * 8, kc * 16, lane, bb);
#pragma unroll
          for (int mt = 0; mt < MT; mt++) {
            mma_t<T>::mma(s[mt][nb], qf[mt][kc], bb[0], bb[1]);
            mma_t<T>::mma(s[mt][nb], qf[mt][kc + 1], bb[2], bb[3]);
          }
          bfrag_cols_x4<D>(Vs, nb * 8, kc * 16, lane, bb);
#pragma unroll
          for (int mt = 0; mt < MT; mt++) {
            mma_t<T>::mma(dp[mt][nb], gf[mt][kc], bb[0], bb[1]);
            mma_t<T>::mma(dp[mt][nb], gf[mt][kc + 1], bb[2], bb[3]);
          }
        }
      }
      const bool need_mask = qw0 + 16 * MT > a.Lq || k0 + KT > a.Lk || (a.causal && k0 + KT - 1 > qw0);
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nb = 0; nb < KT / 8; nb++)
#pragma unroll
          for (int i = 0; i < 4; i++) {
            int r = i >> 1, key = k0 + nb * 8 + 2 * t + (i & 1), row = qw0 + 16 * mt + g + 8 * r;
            bool masked = need_mask && (row >= a.Lq || key >= a.Lk || (a.causal && key > row) ||
                                        l2[mt][r] == -INFINITY);
            float p = masked ? 0.0f : exp2f(s[mt][nb][i] * sl2 - l2[mt][r]);
            s[mt][nb][i] = p * (dp[mt][nb][i] - dl[mt][r]);  /* dS */
          }
#pragma unroll
      for (int kc = 0; kc < KT / 16; kc++) {
        uint32_t sa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          sa[mt][0] = mma_t<T>::pack(s[mt][2 * kc][0], s[mt][2 * kc][1]);
          sa[mt][1] = mma_t<T>::pack(s[mt][2 * kc][2], s[mt][2 * kc][3]);
          sa[mt][2] = mma_t<T>::pack(s[mt][2 * kc + 1][0], s[mt][2 * kc + 1][1]);
          sa[mt][3] = mma_t<T>::pack(s[mt][2 * kc + 1][2], s[mt][2 * kc + 1][3]);
        }
#pragma unroll
        for (int nd = 0; nd < D / 8; nd += 2) {
          uint32_t bb[4];
          bfrag_rows_x4<D>(Ks, kc * 16, nd * 8, lane, bb);
#pragma unroll
          for (int mt = 0; mt < MT; mt++) {
            mma_t<T>::mma(dq[mt][nd], sa[mt], bb[0], bb[1]);
            mma_t<T>::mma(dq[mt][nd + 1], sa[mt], bb[2], bb[3]);
          }
        }
      }
    }
    if (PIPE) __syncthreads();
  }
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
    store_cfrag<T, D>(dq[mt], (uint16_t*)a.dq + b * a.sdq[0] + h * a.sdq[1], a.sdq[2], qw0 + 16 * mt, a.Lq, a.scale,
                      a.scale, g, t);
}

/* A fragments of rows r0..r0+15, columns k0..k0+15 of a shared tile sh (row stride D + 8), for the kernels that
 * keep the operand in shared memory rather than in registers: ldmatrix (no .trans) with matrix i at rows
 * r0 + 8 (i & 1), columns k0 + 8 (i >> 1), which gives a0..a7 in the order of the A layout above. */
template <int D>
__device__ __forceinline__ void afrag_x4(const uint16_t* sh, int r0, int k0, int lane, uint32_t (&r)[4]) {
  ldsm_x4(r, sh + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * (D + 8) + k0 + (lane >> 4) * 8);
}

/* p[0] += x, p[1] += y in global memory with reductions (no value returned): one red.global.add.v2.f32 on sm_90+
 * (p 8-byte aligned), two scalar ones before. */
__device__ __forceinline__ void red_add2(float* p, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(x), "f"(y) : "memory");
#else
  atomicAdd(p, x);
  atomicAdd(p + 1, y);
#endif
}

/* The one-pass backward (the default up to head dim 64, see bwd_fused_on): FlashAttention-2's backward in one
 * kernel per 64 keys (16 per warp), query tiles of TC_QT rows.  As attn_dkv_tc it forms S^T, dP^T, P^T and dS^T of the tile and accumulates dV and dK in
 * registers; then the tile's dS^T (rounded to T, as for dK) goes to shared memory as a [64 keys][TC_QT queries]
 * array, and after a barrier each warp computes one quarter of the tile's dQ contribution, dS (16 queries x
 * 64 keys, A operand through ldmatrix.trans of that array) times K (64 keys x D/2 head dims, the block's keys
 * staged in shared memory once), and adds it to the f32 workspace a.ws [B, H, Lq, D] with red.global.add;
 * attn_dq_convert then writes dq = scale * ws.  S and dP are computed once (5 GEMM-equivalents instead of the
 * two-kernel path's 7); dQ's sums then depend on the order of the atomics (not deterministic to the last bit).
 * KREG: K's A fragments stay in registers (D <= 64); at D = 128 they are read from the shared K tile for each
 * query tile, which keeps the accumulators (dK, dV, dQ) in registers.  One barrier per tile besides the
 * staging: the one before the dQ products also tells every warp that the tile's Q, dO and statistics buffers are
 * no longer read, and the next tile's dS^T is stored only after the next staging barrier. */
template <typename T, int D, bool PIPE>
__global__ void __launch_bounds__(128) attn_bwd_fused_tc(kcu_attn_args a) {
  constexpr int L = D + 8, NBUF = PIPE ? 2 : 1;
  constexpr int NQ = TC_QT / 8;    /* 8-query blocks per tile */
  constexpr int SL = TC_QT + 8;    /* row stride of the dS^T array (80 bytes: ldmatrix rows in distinct banks) */
  constexpr int DH = D / 2;        /* head dims of the dQ contribution per warp */
  constexpr bool KREG = D <= 64;
  __shared__ __align__(16) uint16_t Qb[NBUF][TC_QT * L];
  __shared__ __align__(16) uint16_t Gb[NBUF][TC_QT * L];
  __shared__ __align__(16) uint16_t Ks[TC_ROWS * L];
  __shared__ __align__(16) uint16_t Sb[TC_ROWS * SL];
  __shared__ float Lb[NBUF][TC_QT], Db[NBUF][TC_QT];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int b = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int k0 = blockIdx.y * TC_ROWS, kw = k0 + warp * 16;
  const int64_t bh = (int64_t)b * a.H + h;
  const uint16_t* qb = (const uint16_t*)a.q + b * a.sq[0] + h * a.sq[1];
  const uint16_t* gb = (const uint16_t*)a.dout + b * a.sdo[0] + h * a.sdo[1];
  const uint16_t* kb = (const uint16_t*)a.k + b * a.sk[0] + h * a.sk[1];
  uint32_t kf[KREG ? D / 16 : 1][4], vf[D / 16][4];
  if constexpr (KREG) load_afrag<D>(kf, kb, a.sk[2], kw, a.Lk, g, t);
  load_afrag<D>(vf, (const uint16_t*)a.v + b * a.sv[0] + h * a.sv[1], a.sv[2], kw, a.Lk, g, t);
  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int nd = 0; nd < D / 8; nd++)
#pragma unroll
    for (int i = 0; i < 4; i++) { dk[nd][i] = 0.0f; dv[nd][i] = 0.0f; }
  const float sl2 = a.scale * kLog2e;
  const int qstart = a.causal ? (k0 / TC_QT) * TC_QT : 0;
  /* this warp's quarter of a tile's dQ: queries mq..mq+15 of the tile, head dims d0..d0+DH-1 */
  const int mq = (warp & 1) * 16, d0 = (warp >> 1) * DH;
  float* wsb = (float*)a.ws + bh * a.Lq * D;
  auto stats = [&](int buf, int q0) {
    if (threadIdx.x < TC_QT) {
      int qi = q0 + threadIdx.x;
      Lb[buf][threadIdx.x] = qi < a.Lq ? a.lse[bh * a.Lq + qi] * kLog2e : -INFINITY;
      Db[buf][threadIdx.x] = qi < a.Lq ? a.delta[bh * a.Lq + qi] : 0.0f;
    }
  };
  if (qstart < a.Lq) {
    if (PIPE) {
      stage_async<D, TC_ROWS>(Ks, kb, a.sk[2], k0, a.Lk);
      stage_async<D, TC_QT>(Qb[0], qb, a.sq[2], qstart, a.Lq);
      stage_async<D, TC_QT>(Gb[0], gb, a.sdo[2], qstart, a.Lq);
      cp_commit();
      stats(0, qstart);
    } else {
      stage_tc<D, TC_ROWS>(Ks, kb, a.sk[2], k0, a.Lk);  /* visible after the first tile's barriers */
    }
  }
  for (int q0 = qstart, it = 0; q0 < a.Lq; q0 += TC_QT, it++) {
    const int cur = PIPE ? (it & 1) : 0;
    if (PIPE) {
      if (q0 + TC_QT < a.Lq) {
        stage_async<D, TC_QT>(Qb[cur ^ 1], qb, a.sq[2], q0 + TC_QT, a.Lq);
        stage_async<D, TC_QT>(Gb[cur ^ 1], gb, a.sdo[2], q0 + TC_QT, a.Lq);
        cp_commit();
        stats(cur ^ 1, q0 + TC_QT);
        cp_wait<1>();
      } else {
        cp_wait<0>();
      }
      __syncthreads();
    } else {
      __syncthreads();
      stage_tc<D, TC_QT>(Qb[0], qb, a.sq[2], q0, a.Lq);
      stage_tc<D, TC_QT>(Gb[0], gb, a.sdo[2], q0, a.Lq);
      stats(0, q0);
      __syncthreads();
    }
    const uint16_t* Qs = Qb[cur];
    const uint16_t* Gs = Gb[cur];
    const float* Ls = Lb[cur];
    const float* Ds = Db[cur];
    /* S^T = K Q^T and dP^T = V dO^T: 16 keys x TC_QT queries */
    float st[NQ][4], dpt[NQ][4];
#pragma unroll
    for (int nb = 0; nb < NQ; nb++)
#pragma unroll
      for (int i = 0; i < 4; i++) { st[nb][i] = 0.0f; dpt[nb][i] = 0.0f; }
#pragma unroll
    for (int kc = 0; kc < D / 16; kc += 2) {
      uint32_t k_lo[4], k_hi[4];
      if constexpr (KREG) {
#pragma unroll
        for (int i = 0; i < 4; i++) { k_lo[i] = kf[kc][i]; k_hi[i] = kf[kc + 1][i]; }
      } else {
        afrag_x4<D>(Ks, warp * 16, kc * 16, lane, k_lo);
        afrag_x4<D>(Ks, warp * 16, kc * 16 + 16, lane, k_hi);
      }
#pragma unroll
      for (int nb = 0; nb < NQ; nb++) {
        uint32_t bq[4];
        bfrag_cols_x4<D>(Qs, nb * 8, kc * 16, lane, bq);
        mma_t<T>::mma(st[nb], k_lo, bq[0], bq[1]);
        mma_t<T>::mma(st[nb], k_hi, bq[2], bq[3]);
        bfrag_cols_x4<D>(Gs, nb * 8, kc * 16, lane, bq);
        mma_t<T>::mma(dpt[nb], vf[kc], bq[0], bq[1]);
        mma_t<T>::mma(dpt[nb], vf[kc + 1], bq[2], bq[3]);
      }
    }
    /* P^T and dS^T = P^T (dP^T - delta), masked as in attn_dkv_tc */
    const bool need_mask = q0 + TC_QT > a.Lq || kw + 16 > a.Lk || (a.causal && kw + 15 > q0);
#pragma unroll
    for (int nb = 0; nb < NQ; nb++)
#pragma unroll
      for (int i = 0; i < 4; i++) {
        int qc = nb * 8 + 2 * t + (i & 1), qi = q0 + qc, key = kw + g + (i >> 1) * 8;
        float l2 = Ls[qc];
        bool masked = need_mask && (qi >= a.Lq || key >= a.Lk || (a.causal && key > qi) || l2 == -INFINITY);
        float p = masked ? 0.0f : exp2f(st[nb][i] * sl2 - l2);
        st[nb][i] = p;
        dpt[nb][i] = p * (dpt[nb][i] - Ds[qc]);
      }
    /* dS^T to shared memory (rows: the warp's keys; the packed words are the A fragments of dK's product),
     * dV += P^T dO, dK += dS^T Q */
#pragma unroll
    for (int kc = 0; kc < TC_QT / 16; kc++) {
      uint32_t pa[4] = {mma_t<T>::pack(st[2 * kc][0], st[2 * kc][1]), mma_t<T>::pack(st[2 * kc][2], st[2 * kc][3]),
                        mma_t<T>::pack(st[2 * kc + 1][0], st[2 * kc + 1][1]),
                        mma_t<T>::pack(st[2 * kc + 1][2], st[2 * kc + 1][3])};
      uint32_t sa[4] = {mma_t<T>::pack(dpt[2 * kc][0], dpt[2 * kc][1]), mma_t<T>::pack(dpt[2 * kc][2], dpt[2 * kc][3]),
                        mma_t<T>::pack(dpt[2 * kc + 1][0], dpt[2 * kc + 1][1]),
                        mma_t<T>::pack(dpt[2 * kc + 1][2], dpt[2 * kc + 1][3])};
      uint16_t* srow = Sb + (warp * 16 + g) * SL + kc * 16 + 2 * t;
      *reinterpret_cast<uint32_t*>(srow) = sa[0];
      *reinterpret_cast<uint32_t*>(srow + 8 * SL) = sa[1];
      *reinterpret_cast<uint32_t*>(srow + 8) = sa[2];
      *reinterpret_cast<uint32_t*>(srow + 8 * SL + 8) = sa[3];
#pragma unroll
      for (int nd = 0; nd < D / 8; nd += 2) {
        uint32_t bq[4];
        bfrag_rows_x4<D>(Gs, kc * 16, nd * 8, lane, bq);
        mma_t<T>::mma(dv[nd], pa, bq[0], bq[1]);
        mma_t<T>::mma(dv[nd + 1], pa, bq[2], bq[3]);
        bfrag_rows_x4<D>(Qs, kc * 16, nd * 8, lane, bq);
        mma_t<T>::mma(dk[nd], sa, bq[0], bq[1]);
        mma_t<T>::mma(dk[nd + 1], sa, bq[2], bq[3]);
      }
    }
    __syncthreads();
    /* dQ[mq.., d0..] += dS K over the block's 64 keys: A = dS (queries x keys) from the dS^T array through
     * ldmatrix.trans (matrix i: keys + 8 (i >> 1), queries + 8 (i & 1)), B = K rows (k along the keys) */
    float dqa[DH / 8][4];
#pragma unroll
    for (int nd = 0; nd < DH / 8; nd++) dqa[nd][0] = dqa[nd][1] = dqa[nd][2] = dqa[nd][3] = 0.0f;
#pragma unroll
    for (int kc = 0; kc < TC_ROWS / 16; kc++) {
      uint32_t da[4];
      ldsm_x4_trans(da, Sb + (kc * 16 + (lane & 7) + ((lane >> 4) & 1) * 8) * SL + mq + ((lane >> 3) & 1) * 8);
#pragma unroll
      for (int nd = 0; nd < DH / 8; nd += 2) {
        uint32_t bk[4];
        bfrag_rows_x4<D>(Ks, kc * 16, d0 + nd * 8, lane, bk);
        mma_t<T>::mma(dqa[nd], da, bk[0], bk[1]);
        mma_t<T>::mma(dqa[nd + 1], da, bk[2], bk[3]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const int row = q0 + mq + g + 8 * r;
      if (row < a.Lq) {
        float* wr = wsb + (int64_t)row * D + d0 + 2 * t;
#pragma unroll
        for (int nd = 0; nd < DH / 8; nd++) red_add2(wr + nd * 8, dqa[nd][2 * r], dqa[nd][2 * r + 1]);
      }
    }
  }
  store_cfrag<T, D>(dk, (uint16_t*)a.dk + b * a.sdk[0] + h * a.sdk[1], a.sdk[2], kw, a.Lk, a.scale, a.scale, g, t);
  store_cfrag<T, D>(dv, (uint16_t*)a.dv + b * a.sdv[0] + h * a.sdv[1], a.sdv[2], kw, a.Lk, 1.0f, 1.0f, g, t);
}

/* dq = scale * ws (the fused backward's f32 dQ accumulator [B, H, Lq, D], D a multiple of 8), 8 elements per
 * thread, in dq's strides and data type. */
template <typename T>
__global__ void attn_dq_convert(kcu_attn_args a) {
  const int c8 = a.D / 8;
  const int64_t n = (int64_t)a.B * a.H * a.Lq * c8;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
    int64_t row = e / c8;
    int c = (int)(e - row * c8) * 8;
    int64_t i = row % a.Lq, bh = row / a.Lq, b = bh / a.H, h = bh % a.H;
    const float4* src = reinterpret_cast<const float4*>((const float*)a.ws + row * a.D + c);
    float4 x = src[0], y = src[1];
    const float s = a.scale;
    uint4 o = make_uint4(mma_t<T>::pack(x.x * s, x.y * s), mma_t<T>::pack(x.z * s, x.w * s),
                         mma_t<T>::pack(y.x * s, y.y * s), mma_t<T>::pack(y.z * s, y.w * s));
    *reinterpret_cast<uint4*>((uint16_t*)a.dq + b * a.sdq[0] + h * a.sdq[1] + i * a.sdq[2] + c) = o;
  }
}

int strides8(const int64_t* s) { return s[0] % 8 == 0 && s[1] % 8 == 0 && s[2] % 8 == 0; }
int al16(const void* p) { return ((uintptr_t)p & 15) == 0; }

/* The tensor-core kernels apply: data type, head dim, layout, and a binary
 * for sm_80+ (checked once per instantiation). */
template <typename T, int D> int tc_binary_ok() {
  static int v = -1;
  if (v < 0) {
    cudaFuncAttributes at;
    v = cudaFuncGetAttributes(&at, attn_fwd_tc<T, D, false>) == cudaSuccess && at.binaryVersion >= 80;
    cudaGetLastError();
  }
  return v;
}

int tc_layout_ok(const kcu_attn_args* a, int bwd) {
  if (a->force_simt || (a->dt != KCU_BF16 && a->dt != KCU_F16)) return 0;
  if (a->D != 32 && a->D != 64 && a->D != 128) return 0;
  if (!strides8(a->sq) || !strides8(a->sk) || !strides8(a->sv) || !strides8(a->so)) return 0;
  if (!al16(a->q) || !al16(a->k) || !al16(a->v) || !al16(a->o)) return 0;
  if (bwd && (!strides8(a->sdo) || !strides8(a->sdq) || !strides8(a->sdk) || !strides8(a->sdv) || !al16(a->dout) ||
              !al16(a->dq) || !al16(a->dk) || !al16(a->dv)))
    return 0;
  return 1;
}

/* The double-buffered kernels: head dims up to 64 (two buffers of each operand fit static shared memory), unless
 * ENGINE_ATTN_PIPELINE=0 asks for the single-buffer ones (a comparison, read once). */
int pipelined(int D) {
  static int on = -1;
  if (on < 0) {
    const char* e = getenv("ENGINE_ATTN_PIPELINE");
    on = !(e && e[0] == '0');
  }
  return on && D <= 64;
}

template <typename T, int D, bool PIPE> int tc_fwd_launch(const kcu_attn_args* a, cudaStream_t s) {
  dim3 grid((unsigned)(a->B * a->H), (unsigned)kcu_cdiv(a->Lq, TC_ROWS));
  attn_fwd_tc<T, D, PIPE><<<grid, 128, 0, s>>>(*a);
  return kcu_launch_status();
}

/* ENGINE_ATTN_FWD_ROWS=128: the forward with two M-tiles per warp (head dims up to 64; read once). */
int fwd_two_mtiles(int D) {
  static int on = -1;
  if (on < 0) {
    const char* e = getenv("ENGINE_ATTN_FWD_ROWS");
    on = e && atoi(e) == 128;
  }
  return on && D <= 64;
}

template <typename T, int D, bool PIPE> struct fwd_mt2 {
  static int launch(const kcu_attn_args* a, cudaStream_t s) {
    dim3 grid((unsigned)(a->B * a->H), (unsigned)kcu_cdiv(a->Lq, 128));
    attn_fwd_tc_mt<T, D, PIPE, 2><<<grid, 128, 0, s>>>(*a);
    return kcu_launch_status();
  }
};
/* head dim 128: the accumulators of two M-tiles do not fit the registers (never instantiated) */
template <typename T, bool PIPE> struct fwd_mt2<T, 128, PIPE> {
  static int launch(const kcu_attn_args* a, cudaStream_t s) { return tc_fwd_launch<T, 128, PIPE>(a, s); }
};

/* ENGINE_ATTN_DQ_ROWS=128: dQ with two M-tiles per warp and 32-key tiles (head dims up to 64; read once). */
int dq_two_mtiles(int D) {
  static int on = -1;
  if (on < 0) {
    const char* e = getenv("ENGINE_ATTN_DQ_ROWS");
    on = e && atoi(e) == 128;
  }
  return on && D <= 64;
}
template <typename T, int D, bool PIPE> struct dq_mt2 {
  static int launch(const kcu_attn_args* a, cudaStream_t s) {
    dim3 gq((unsigned)(a->B * a->H), (unsigned)kcu_cdiv(a->Lq, 128));
    attn_dq_tc_mt<T, D, PIPE, 2, 32><<<gq, 128, 0, s>>>(*a);
    return kcu_launch_status();
  }
};
/* head dim 128: never instantiated (dq_two_mtiles is false there) */
template <typename T, bool PIPE> struct dq_mt2<T, 128, PIPE> {
  static int launch(const kcu_attn_args*, cudaStream_t) { return KCU_EARG; }
};

template <typename T, int D, bool PIPE> int tc_bwd_launch(const kcu_attn_args* a, cudaStream_t s) {
  int64_t rows = (int64_t)a->B * a->H * a->Lq;
  if (rows > 0) attn_delta<T><<<kcu_grid(rows, 8, 1 << 16), 256, 0, s>>>(*a);
  if (a->Lk > 0) {
    dim3 gk((unsigned)(a->B * a->H), (unsigned)kcu_cdiv(a->Lk, TC_ROWS));
    attn_dkv_tc<T, D, PIPE><<<gk, 128, 0, s>>>(*a);
  }
  if (a->Lq > 0) {
    if (dq_two_mtiles(D)) return dq_mt2<T, D, PIPE>::launch(a, s);
    dim3 gq((unsigned)(a->B * a->H), (unsigned)kcu_cdiv(a->Lq, TC_ROWS));
    attn_dq_tc<T, D, PIPE><<<gq, 128, 0, s>>>(*a);
  }
  return kcu_launch_status();
}

/* The one-pass backward (attn_bwd_fused_tc, dQ through the caller's f32 workspace a->ws) or the two-kernel one
 * (attn_dkv_tc + attn_dq_tc, deterministic).  Default: the one-pass form for head dims up to 64, measured faster on
 * an H200 (GPT-2 124M bf16 B=8 T=1024: the backward 682 -> 603 us, the step 23.1 -> 22.2 ms; docs/gpu-runs/
 * 2026-11-28-b.md); ENGINE_ATTN_BWD=split keeps the deterministic kernels everywhere, ENGINE_ATTN_BWD=fused asks
 * for the one-pass form at D = 128 too (not yet timed there).  Read once. */
int bwd_fused_on(int D) {
  static int mode = -1; /* 0 default, 1 fused, 2 split */
  if (mode < 0) {
    const char* e = getenv("ENGINE_ATTN_BWD");
    mode = e && strcmp(e, "fused") == 0 ? 1 : (e && strcmp(e, "split") == 0 ? 2 : 0);
  }
  return mode == 1 || (mode == 0 && D <= 64);
}

template <typename T, int D, bool PIPE> int tc_bwd_fused_launch(const kcu_attn_args* a, cudaStream_t s) {
  int64_t rows = (int64_t)a->B * a->H * a->Lq;
  attn_delta<T><<<kcu_grid(rows, 8, 1 << 16), 256, 0, s>>>(*a);
  cudaError_t e = cudaMemsetAsync(a->ws, 0, (size_t)rows * D * sizeof(float), s);
  if (e != cudaSuccess) { cudaGetLastError(); return (int)e; }
  if (a->Lk > 0) {
    dim3 gk((unsigned)(a->B * a->H), (unsigned)kcu_cdiv(a->Lk, TC_ROWS));
    attn_bwd_fused_tc<T, D, PIPE><<<gk, 128, 0, s>>>(*a);
  }
  attn_dq_convert<T><<<kcu_grid(rows * (D / 8), 256, 1 << 16), 256, 0, s>>>(*a);
  return kcu_launch_status();
}

template <typename T, int D> int tc_fwd_run(const kcu_attn_args* a, cudaStream_t s) {
  if (fwd_two_mtiles(D))
    return pipelined(D) ? fwd_mt2<T, D, D <= 64>::launch(a, s) : fwd_mt2<T, D, false>::launch(a, s);
  return pipelined(D) ? tc_fwd_launch<T, D, D <= 64>(a, s) : tc_fwd_launch<T, D, false>(a, s);
}
template <typename T, int D> int tc_bwd_run(const kcu_attn_args* a, cudaStream_t s) {
  if (a->ws && al16(a->ws) && a->Lq > 0 && bwd_fused_on(D))
    return pipelined(D) ? tc_bwd_fused_launch<T, D, D <= 64>(a, s) : tc_bwd_fused_launch<T, D, false>(a, s);
  return pipelined(D) ? tc_bwd_launch<T, D, D <= 64>(a, s) : tc_bwd_launch<T, D, false>(a, s);
}

/* Runs the tensor-core path when it applies; 1 when it does not. */
template <typename T> int tc_try(const kcu_attn_args* a, int bwd, cudaStream_t s) {
  if (!tc_layout_ok(a, bwd)) return 1;
  switch (a->D) {
    case 32: if (!tc_binary_ok<T, 32>()) return 1; return bwd ? tc_bwd_run<T, 32>(a, s) : tc_fwd_run<T, 32>(a, s);
    case 64: if (!tc_binary_ok<T, 64>()) return 1; return bwd ? tc_bwd_run<T, 64>(a, s) : tc_fwd_run<T, 64>(a, s);
    default: if (!tc_binary_ok<T, 128>()) return 1; return bwd ? tc_bwd_run<T, 128>(a, s) : tc_fwd_run<T, 128>(a, s);
  }
}

/* KCU_OK: run; 1: nothing to do; < 0: error. */
int check_args(const kcu_attn_args* a, int bwd) {
  if (!a || a->B < 0 || a->H < 0 || a->Lq < 0 || a->Lk < 0 || a->D < 1 || a->D > 128) return KCU_EARG;
  if (a->dt != KCU_F32 && a->dt != KCU_BF16 && a->dt != KCU_F16) return KCU_EARG;
  if (!(a->scale == a->scale)) return KCU_EARG;
  if ((int64_t)a->B * a->H == 0) return 1;
  if ((int64_t)a->B * a->H > 2147483647 || a->Lq > 65535 * BR || a->Lk > 65535 * BK) return KCU_EARG;
  if (a->Lq > 0 && (!a->q || !a->o || !a->lse)) return KCU_EARG;
  if (a->Lk > 0 && (!a->k || !a->v)) return KCU_EARG;
  if (bwd && a->Lq > 0 && (!a->dout || !a->dq || !a->delta)) return KCU_EARG;
  if (bwd && a->Lk > 0 && (!a->dk || !a->dv || !a->q || !a->dout)) return KCU_EARG;
  if (!bwd && a->Lq == 0) return 1;
  return KCU_OK;
}

template <typename T, int DM> int fwd_run(const kcu_attn_args* a, cudaStream_t s) {
  dim3 grid((unsigned)(a->B * a->H), (unsigned)kcu_cdiv(a->Lq, BR));
  attn_fwd<T, DM><<<grid, BR * (DM / 32), 0, s>>>(*a);
  return kcu_launch_status();
}

template <typename T, int DM> int bwd_run(const kcu_attn_args* a, cudaStream_t s) {
  int64_t rows = (int64_t)a->B * a->H * a->Lq;
  if (rows > 0) attn_delta<T><<<kcu_grid(rows, 8, 1 << 16), 256, 0, s>>>(*a);
  if (a->Lk > 0) {
    dim3 gk((unsigned)(a->B * a->H), (unsigned)kcu_cdiv(a->Lk, BK));
    attn_dkv<T, DM><<<gk, BK * (DM / 32), 0, s>>>(*a);
  }
  if (a->Lq > 0) {
    dim3 gq((unsigned)(a->B * a->H), (unsigned)kcu_cdiv(a->Lq, BR));
    attn_dq<T, DM><<<gq, BR * (DM / 32), 0, s>>>(*a);
  }
  return kcu_launch_status();
}

template <typename T> int fwd_dm(const kcu_attn_args* a, cudaStream_t s) {
  if (a->D <= 32) return fwd_run<T, 32>(a, s);
  if (a->D <= 64) return fwd_run<T, 64>(a, s);
  return fwd_run<T, 128>(a, s);
}
template <typename T> int bwd_dm(const kcu_attn_args* a, cudaStream_t s) {
  if (a->D <= 32) return bwd_run<T, 32>(a, s);
  if (a->D <= 64) return bwd_run<T, 64>(a, s);
  return bwd_run<T, 128>(a, s);
}

}  // namespace

extern "C" int kcu_attention_fwd(const kcu_attn_args* a, cudaStream_t s) {
  int e = check_args(a, 0);
  if (e) return e > 0 ? KCU_OK : e;
  if (a->dt == KCU_BF16) { int r = tc_try<kbf16>(a, 0, s); if (r != 1) return r; }
  if (a->dt == KCU_F16) { int r = tc_try<kf16>(a, 0, s); if (r != 1) return r; }
  switch (a->dt) {
    case KCU_F32: return fwd_dm<float>(a, s);
    case KCU_BF16: return fwd_dm<kbf16>(a, s);
    default: return fwd_dm<kf16>(a, s);
  }
}

extern "C" size_t kcu_attention_bwd_workspace(const kcu_attn_args* a) {
  if (check_args(a, 1) != KCU_OK || a->Lq == 0 || !bwd_fused_on(a->D) || !tc_layout_ok(a, 1)) return 0;
  int ok;
  switch (a->D) {
    case 32: ok = a->dt == KCU_BF16 ? tc_binary_ok<kbf16, 32>() : tc_binary_ok<kf16, 32>(); break;
    case 64: ok = a->dt == KCU_BF16 ? tc_binary_ok<kbf16, 64>() : tc_binary_ok<kf16, 64>(); break;
    default: ok = a->dt == KCU_BF16 ? tc_binary_ok<kbf16, 128>() : tc_binary_ok<kf16, 128>(); break;
  }
  return ok ? (size_t)a->B * a->H * a->Lq * a->D * sizeof(float) : 0;
}

extern "C" int kcu_attention_bwd(const kcu_attn_args* a, cudaStream_t s) {
  int e = check_args(a, 1);
  if (e) return e > 0 ? KCU_OK : e;
  if (a->dt == KCU_BF16) { int r = tc_try<kbf16>(a, 1, s); if (r != 1) return r; }
  if (a->dt == KCU_F16) { int r = tc_try<kf16>(a, 1, s); if (r != 1) return r; }
  switch (a->dt) {
    case KCU_F32: return bwd_dm<float>(a, s);
    case KCU_BF16: return bwd_dm<kbf16>(a, s);
    default: return bwd_dm<kf16>(a, s);
  }
}
