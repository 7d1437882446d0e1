/* embedding_masked.c: the local op of a row-sharded embedding (PyTorch's
 * _MaskPartial): the shard owns rows [row_offset, row_offset + rows) of the
 * full table; indices outside give zero rows, and the backward scatter-adds
 * only into owned rows.  The sum over the shards of the outputs is the full
 * embedding (a Partial(sum) output for the dispatcher). */
#include "core/dispatch.h"
#include "ops/cuda_vocab.h"
#include "ops/ops.h"
#include "ops/vocab_parallel.h"
#include "autograd/autograd.h"

/* saved: 0 indices (contiguous i64).  ints: 0 row_offset, 1 compute dtype. */
static int embm_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  if (!eng_node_needs_grad(n, 0)) return 0;
  eng_tensor* idx = eng_node_saved(n, 0);
  if (!idx) return -1;
  int cdt = (int)n->ints[1];
  int64_t off = n->ints[0];
  int64_t shape[2] = {eng_node_in_shape(n, 0)[0], eng_node_in_shape(n, 0)[1]};
  int64_t rows = shape[0], dim = shape[1];
  int rc = -1;
  if (go[0]->device == ENG_CUDA) { /* the kernel overwrites gw (f32 accumulation, f64 for f64), owned rows only */
    int adt = go[0]->dtype == ENG_F64 ? ENG_F64 : ENG_F32;
    eng_tensor* Gd = eng_as_contig(go[0], go[0]->dtype);
    eng_tensor* gwd = Gd ? eng_new(2, shape, adt, ENG_CUDA) : NULL;
    if (gwd && !eng_cu_embedding_masked_bwd(Gd->dtype, idx->numel, eng_ptr(idx), ENG_I64, eng_ptr(Gd), dim, rows, off,
                                            eng_ptr(gwd), "embedding_masked backward"))
      rc = (gi[0] = eng_grad_to_input(n, 0, gwd)) ? 0 : -1;
    eng_tensor_release(Gd); eng_tensor_release(gwd);
    return rc;
  }
  eng_tensor* G = eng_as_contig(go[0], cdt);
  eng_tensor* gw = G ? eng_tensor_zeros(2, shape, cdt, G->device) : NULL;
  if (gw) {
    const int64_t* ip = (const int64_t*)eng_ptr(idx);
    for (int64_t i = 0; i < idx->numel; i++) {
      int64_t r = ip[i] - off;
      if (r < 0 || r >= rows) continue;
      if (cdt == ENG_F32) {
        const float* g = (const float*)eng_ptr(G) + i * dim;
        float* w = (float*)eng_ptr(gw) + r * dim;
        for (int64_t c = 0; c < dim; c++) w[c] += g[c];
      } else {
        const double* g = (const double*)eng_ptr(G) + i * dim;
        double* w = (double*)eng_ptr(gw) + r * dim;
        for (int64_t c = 0; c < dim; c++) w[c] += g[c];
      }
    }
    gi[0] = eng_grad_to_input(n, 0, gw);
    rc = gi[0] ? 0 : -1;
  }
  eng_tensor_release(G); eng_tensor_release(gw);
  return rc;
}

/* The first index outside [0, total) (total < 0: the first negative one) of a device index tensor, read back on the
 * error path only: sets the error naming it. */
static void bad_index(const char* op, eng_tensor* I, eng_tensor* indices, int64_t total) {
  eng_tensor* h = eng_op_host(I, ENG_I64);
  if (!h) return;
  const int64_t* p = (const int64_t*)eng_ptr(h);
  int64_t i = 0;
  while (i < h->numel && p[i] >= 0 && (total < 0 || p[i] < total)) i++;
  if (i == h->numel) eng_err("%s: an index of %s is out of range", op, eng_desc(indices));
  else if (total < 0)
    eng_err("%s: index %lld at flat position %lld of indices %s is negative", op, (long long)p[i], (long long)i + 1,
            eng_desc(indices));
  else
    eng_err("index %lld out of range for weight of %lld rows (valid 0..%lld), at flat position %lld of the local "
            "indices %s", (long long)p[i], (long long)total, (long long)total - 1, (long long)i, eng_desc(indices));
  eng_tensor_release(h);
}

static eng_tensor* masked(eng_tensor* weight, eng_tensor* indices, int64_t row_offset, int64_t total);

eng_tensor* eng_embedding_masked(eng_tensor* weight, eng_tensor* indices, int64_t row_offset) {
  return masked(weight, indices, row_offset, -1);
}

eng_tensor* eng_embedding_masked_bounded(eng_tensor* weight, eng_tensor* indices, int64_t row_offset, int64_t total) {
  return masked(weight, indices, row_offset, total);
}

static eng_tensor* masked(eng_tensor* weight, eng_tensor* indices, int64_t row_offset, int64_t total) {
  const char* op = "embedding_masked";
  ENG_CHECK(weight, op); ENG_CHECK(indices, op);
  if (eng_meta_check(weight, op)) return NULL;
  if (eng_meta_check(indices, op)) return NULL;
  if (!eng_dispatch_local_mode() && (weight->dist || indices->dist))
    return eng_errp("%s: takes this rank's weight shard and the indices as plain tensors, got %s and %s (use "
                    "to_local(), or embedding on a DTensor weight sharded on dim 0)", op,
                    weight->dist ? "a DTensor" : eng_desc(weight), indices->dist ? "a DTensor" : eng_desc(indices));
  if (weight->ndim != 2)
    return eng_errp("%s: weight shard must be 2-D [rows, embedding_dim], got %s", op, eng_desc(weight));
  if (indices->dtype != ENG_I32 && indices->dtype != ENG_I64)
    return eng_errp("%s: indices must be i32 or i64, got %s", op, eng_desc(indices));
  if (indices->ndim + 1 > ENG_MAX_DIMS)
    return eng_errp("%s: indices %s have too many dims (at most %d)", op, eng_desc(indices), ENG_MAX_DIMS - 1);
  if (weight->device != indices->device)
    return eng_errp("%s: weight %s and indices %s are on different devices", op, eng_desc(weight), eng_desc(indices));
  if (row_offset < 0) return eng_errp("%s: row_offset %lld must be >= 0", op, (long long)row_offset);
  int64_t rows = weight->shape[0], dim = weight->shape[1];
  eng_tensor* I = eng_as_contig(indices, ENG_I64);
  if (!I) return NULL;
  int cuda = weight->device == ENG_CUDA;
  const int64_t* ip = (const int64_t*)eng_ptr(I);
  for (int64_t i = 0; !cuda && i < I->numel; i++)
    if (ip[i] < 0) {
      eng_tensor_release(I);
      return eng_errp("%s: index %lld at flat position %lld of indices %s is negative", op, (long long)ip[i],
                      (long long)i + 1, eng_desc(indices));
    }
  int64_t shape[ENG_MAX_DIMS];
  for (int d = 0; d < indices->ndim; d++) shape[d] = indices->shape[d];
  shape[indices->ndim] = dim;
  eng_tensor* W = eng_as_contig(weight, weight->dtype);
  eng_tensor* out = W ? eng_new(indices->ndim + 1, shape, weight->dtype, weight->device) : NULL;
  if (out && cuda) { /* one kernel: owned rows gathered, the others zero; one read of the index flag */
    int st = eng_cu_embedding_masked_fwd(I->numel, eng_ptr(I), ENG_I64, eng_ptr(W), rows,
                                         dim * eng_dtype_size(weight->dtype), row_offset, total, eng_ptr(out), op);
    if (st) {
      if (st == 1) bad_index(op, I, indices, total);
      eng_tensor_release(out);
      out = NULL;
    }
  } else if (out) {
    int64_t rb = dim * eng_dtype_size(weight->dtype);
    const char* wp = eng_ptr(W);
    char* op_ = eng_ptr(out);
    for (int64_t i = 0; i < I->numel; i++) {
      int64_t r = ip[i] - row_offset;
      if (r >= 0 && r < rows) memcpy(op_ + i * rb, wp + r * rb, (size_t)rb);
      else memset(op_ + i * rb, 0, (size_t)rb);
    }
  }
  eng_tensor_release(W);
  if (out && eng_any_requires_grad(1, &weight) && eng_dtype_is_floating(weight->dtype)) {
    eng_node* nd = eng_record("EmbeddingMaskedBackward", embm_bw, 1, &weight, out);
    if (!nd || eng_node_save(nd, I)) { eng_tensor_release(out); out = NULL; }
    else { nd->ints[0] = row_offset; nd->ints[1] = weight->dtype == ENG_F64 ? ENG_F64 : ENG_F32; }
  }
  eng_tensor_release(I);
  return out;
}
