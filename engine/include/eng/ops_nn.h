/* ops_nn.h: matmul, linear and the fused neural-network ops. */
#ifndef ENG_OPS_NN_H
#define ENG_OPS_NN_H
#include <stdint.h>
#include <stddef.h>
#include "tensor.h"

struct eng_pg; /* comm.h */

/* torch.matmul semantics: 1-D/2-D, batched with broadcast batch dims. */
eng_tensor* eng_matmul(eng_tensor* a, eng_tensor* b);
/* x [..., in] @ w[out, in]^T + bias[out] (bias may be NULL). */
eng_tensor* eng_linear(eng_tensor* x, eng_tensor* w, eng_tensor* bias);
/* gelu(linear(x, w, bias)) (approximate: 0 exact (erf), 1 tanh) as one op on
 * the CPU for f32/f64 (x at least 2-D): the gelu is the GEMM's epilogue, and
 * backward fuses gelu's gradient with the bias gradient.  Equal to the
 * composition bit for bit; DTensors, CUDA and other dtypes run the composition. */
eng_tensor* eng_linear_gelu(eng_tensor* x, eng_tensor* w, eng_tensor* bias, int approximate);

eng_tensor* eng_softmax(eng_tensor* t, int dim);
eng_tensor* eng_log_softmax(eng_tensor* t, int dim);
/* Normalises over the last n_norm dims; weight/bias (shape of those dims)
 * may be NULL. */
eng_tensor* eng_layer_norm(eng_tensor* x, int n_norm, eng_tensor* weight, eng_tensor* bias, double eps);
eng_tensor* eng_rms_norm(eng_tensor* x, int n_norm, eng_tensor* weight, double eps);
/* h = x + r and y = layer_norm(h, ...) as one op (a pre-norm block's residual add and the norm after it):
 * returns y (new reference) and sets *sum to h (new reference).  On the CPU for f32/f64 with x and r of one
 * shape and dtype, one pass forward and one backward (h's gradient from its other uses is added in the
 * norm's backward pass); everything else (DTensors, CUDA, broadcasting, other dtypes) runs eng_add then
 * eng_layer_norm.  Values and gradients equal that composition. */
eng_tensor* eng_add_layer_norm(eng_tensor* x, eng_tensor* r, int n_norm, eng_tensor* weight, eng_tensor* bias,
                               double eps, eng_tensor** sum);
/* weight [num, dim], indices i32/i64 of any shape -> [..., dim].
 * padding_idx < 0: none. */
eng_tensor* eng_embedding(eng_tensor* weight, eng_tensor* indices, int64_t padding_idx);
/* Row-sharded embedding: weight_shard holds rows [row_offset, row_offset +
 * rows) of the full table.  Indices outside that range give zero rows (a
 * negative index is an error); backward scatter-adds only into owned rows.
 * Summing the results over the shards gives eng_embedding of the full table. */
eng_tensor* eng_embedding_masked(eng_tensor* weight_shard, eng_tensor* indices, int64_t row_offset);
/* logits [N, C] (or [C], or [N, C, d1...] with classes in dim 1), target
 * i32/i64 class indices.  reduction: 0 none, 1 mean, 2 sum.  Targets equal to
 * ignore_index contribute nothing (mean divides by the non-ignored count). */
eng_tensor* eng_cross_entropy(eng_tensor* logits, eng_tensor* target, int64_t ignore_index,
                              int reduction, double label_smoothing);
/* The fused classifier (llm.c's fused_classifier): cross entropy of bf16/f16
 * logits [N, C] with f32 accumulation and no f32 copy of the logits; the loss
 * is f32 (not rounded to the logits' dtype), the logits' gradient has their
 * dtype.  Arguments as eng_cross_entropy.  Other logits (f32, f64, [C],
 * [N, C, d1, ...]) and DTensors give eng_cross_entropy of the logits in f32
 * (f64 kept), which the fused path equals up to the gradient's rounding. */
eng_tensor* eng_fused_classifier(eng_tensor* logits, eng_tensor* target, int64_t ignore_index, int reduction,
                                 double label_smoothing);
/* nll_loss (PyTorch's): logp [C] / [N, C] / [N, C, d1, ...] (classes in dim
 * 1), target i32/i64 class ids of logp's shape without the class dim,
 * weight NULL or [C] (a constant: no gradient).  reduction 0 none, 1 mean
 * (sum(w_i l_i) / sum(w_i) over the non-ignored targets), 2 sum. */
eng_tensor* eng_nll_loss(eng_tensor* logp, eng_tensor* target, eng_tensor* weight, int64_t ignore_index,
                         int reduction);
/* cross_entropy with class weights [C] (weight NULL: eng_cross_entropy):
 * PyTorch's weighted loss with label smoothing, mean = sum / sum of the
 * non-ignored targets' weights (weight a constant: no gradient). */
eng_tensor* eng_cross_entropy_weighted(eng_tensor* logits, eng_tensor* target, eng_tensor* weight,
                                       int64_t ignore_index, int reduction, double label_smoothing);
/* Elementwise losses (PyTorch's formulas), input and target of one shape and
 * floating dtype, gradients to both; weight / pos_weight NULL or broadcastable
 * to the input (constants: no gradient).  reduction 0 none, 1 mean, 2 sum
 * (kl_div also 3 batchmean: the sum / the size of dim 1).  binary_cross_entropy
 * fails unless every input element is in [0, 1]. */
eng_tensor* eng_binary_cross_entropy(eng_tensor* p, eng_tensor* target, eng_tensor* weight, int reduction);
eng_tensor* eng_binary_cross_entropy_with_logits(eng_tensor* x, eng_tensor* target, eng_tensor* weight,
                                                 eng_tensor* pos_weight, int reduction);
eng_tensor* eng_kl_div(eng_tensor* input, eng_tensor* target, int reduction, int log_target);
eng_tensor* eng_smooth_l1_loss(eng_tensor* x, eng_tensor* y, int reduction, double beta);
eng_tensor* eng_huber_loss(eng_tensor* x, eng_tensor* y, int reduction, double delta);
/* Vocab-parallel cross entropy (Megatron's): logits_local [..., V_local]
 * holds classes [vocab_offset, vocab_offset + V_local) of vocab_total (class
 * dim LAST); targets [...] (the same on every rank of group) hold global
 * class ids.  Three all_reduces over group (row max, sum of exp, target
 * logit), no all_gather; returns the loss (same on every rank; reduction and
 * ignore_index as eng_cross_entropy, no label smoothing); backward (no
 * communication) gives the local logits' gradient.  group NULL: one process
 * holds the whole vocabulary.  CPU tensors. */
eng_tensor* eng_cross_entropy_vocab_parallel(eng_tensor* logits_local, eng_tensor* target, int64_t vocab_offset,
                                             int64_t vocab_total, struct eng_pg* group, int64_t ignore_index,
                                             int reduction);
/* Inverted dropout with the global counter-based RNG (consumes offsets). */
eng_tensor* eng_dropout(eng_tensor* x, double p, int training);
/* q [..., L, E], k [..., S, E], v [..., S, Ev].  mask: NULL, bool (true =
 * attend) or float (added).  scale <= 0 means 1/sqrt(E). */
eng_tensor* eng_scaled_dot_product_attention(eng_tensor* q, eng_tensor* k, eng_tensor* v,
                                             eng_tensor* mask, double dropout_p,
                                             int is_causal, double scale);
/* Which implementation scaled_dot_product_attention runs (PyTorch's torch.nn.attention.sdpa_kernel): ENG_SDPA_AUTO
 * the fused kernels where they apply (the math path on CUDA for an attn_mask, dropout, f64 or shapes the kernels
 * do not take), ENG_SDPA_MATH the math path (the engine's matmul, softmax, dropout ops) everywhere.  Process-wide;
 * engine.nn.attention.sdpa_kernel sets and restores it.  -1 on an unknown value. */
enum { ENG_SDPA_AUTO = 0, ENG_SDPA_MATH = 1 };
int eng_sdpa_set_backend(int backend);
/* Decoding's attention over a bf16 KV cache (generation's cache_dtype = "bf16"): f32 q [B, H, R, E] (R query rows
 * per cached head: grouped-query attention's heads of one kv head) against bf16 k [B, H, S, E] and v [B, H, S, Ev]
 * with contiguous rows (views of the cache), no mask; the keys and values widened to f32 as they are read, the
 * arithmetic in f32.  scale <= 0: 1 / sqrt(E).  CPU, no autograd.  A new f32 [B, H, R, Ev]. */
eng_tensor* eng_decode_attention(eng_tensor* q, eng_tensor* k, eng_tensor* v, double scale);
int eng_sdpa_get_backend(void);
/* Rotary position embedding on interleaved pairs (torchtitan's apply_rotary_emb, fused): x [B, T, H, D] (D even),
 * cos and sin [T, D / 2] (any float dtype, x's device):
 *   out[.., 2i] = x[2i] cos[t, i] - x[2i + 1] sin[t, i],  out[.., 2i + 1] = x[2i] sin[t, i] + x[2i + 1] cos[t, i]
 * in one pass (f32 math for half data), differentiable in x (the tables are constants).  Plain tensors only. */
eng_tensor* eng_rotary_emb(eng_tensor* x, eng_tensor* cos, eng_tensor* sin);
/* silu(a) * b, a SwiGLU feed-forward's product (a = w1 x, b = w3 x), as one op: a and b of one shape, dtype and
 * device.  The same values and gradients as eng_mul(eng_silu(a), b), bit for bit; fused on the CPU in f32 and f64
 * and on CUDA in every float dtype (one pass each way), the composition for CPU bf16 / f16.  DTensors: a and b sharded alike (or replicated) run on their
 * shards; a Partial operand is reduced first. */
eng_tensor* eng_silu_mul(eng_tensor* a, eng_tensor* b);

#endif
