/* embedding.c: embedding lookup (row gather) with a dense scatter-add
 * backward; padding_idx rows get no gradient. */
#include "core/internal.h"
#include "core/dispatch.h"
#include "kernels/cpu/kcpu.h"
#include "ops/cuda_ops.h"
#include "autograd/autograd.h"

static int embedding_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor* idx = eng_node_saved(n, 0);
  if (!idx) return -1;
  int cdt = (int)n->ints[1];
  int64_t shape[2] = {eng_node_in_shape(n, 0)[0], eng_node_in_shape(n, 0)[1]};
  if (go[0]->device == ENG_CUDA) { /* gw overwritten by the kernel (f32, f64 for f64 data) */
    int gdt = go[0]->dtype == ENG_F64 || cdt == ENG_F64 ? cdt : go[0]->dtype;
    eng_tensor* G = eng_as_contig(go[0], gdt);
    eng_tensor* gw = G ? eng_new(2, shape, cdt, G->device) : NULL;
    int rc = -1;
    if (gw && eng_cu_embedding_bwd(gdt, idx->numel, eng_ptr(idx), idx->dtype, eng_ptr(G), shape[1], shape[0],
                                   n->ints[0], eng_ptr(gw), "EmbeddingBackward") == 0) {
      gi[0] = eng_grad_to_input(n, 0, gw);
      rc = gi[0] ? 0 : -1;
    }
    eng_tensor_release(G); eng_tensor_release(gw);
    return rc;
  }
  eng_tensor* G = eng_as_contig(go[0], cdt);
  eng_tensor* gw = G ? eng_tensor_zeros(2, shape, cdt, G->device) : NULL;
  int rc = -1;
  if (gw) {
    kc_embedding_scatter_add(cdt, idx->numel, eng_ptr(idx), idx->dtype, eng_ptr(G), shape[1], n->ints[0],
                             eng_ptr(gw));
    gi[0] = eng_grad_to_input(n, 0, gw);
    rc = gi[0] ? 0 : -1;
  }
  eng_tensor_release(G); eng_tensor_release(gw);
  return rc;
}

eng_tensor* eng_embedding(eng_tensor* weight, eng_tensor* indices, int64_t padding_idx) {
  const char* op = "embedding";
  ENG_CHECK(weight, op); ENG_CHECK(indices, op);
  if (eng_meta_check_local(weight, op)) return NULL;
  if (eng_meta_check_local(indices, op)) return NULL;
  if (ENG_DT_ACTIVE(weight->dist || ENG_META_T(weight) || indices->dist || ENG_META_T(indices)))
    return eng_op_dispatch(ENG_OP_EMBEDDING, &(eng_op_call){.name = op, .n_in = 2, .in = {weight, indices},
                                                             .ints = {padding_idx < 0 ? -1 : padding_idx}});
  if (weight->ndim != 2)
    return eng_errp("%s: weight must be 2-D [num_embeddings, embedding_dim], got %s", op, eng_desc(weight));
  if (indices->dtype != ENG_I32 && indices->dtype != ENG_I64)
    return eng_errp("%s: indices must be i32 or i64, got %s", op, eng_desc(indices));
  if (indices->ndim + 1 > ENG_MAX_DIMS)
    return eng_errp("%s: indices %s have too many dims (at most %d)", op, eng_desc(indices), ENG_MAX_DIMS - 1);
  if (weight->device != indices->device)
    return eng_errp("%s: weight %s and indices %s are on different devices", op, eng_desc(weight), eng_desc(indices));
  int64_t num = weight->shape[0], dim = weight->shape[1];
  if (padding_idx >= num)
    return eng_errp("%s: padding_idx %lld out of range for weight %s (valid 0..%lld)", op, (long long)padding_idx,
                    eng_desc(weight), (long long)num - 1);
  eng_tensor* I = eng_as_contig(indices, indices->dtype);
  if (!I) return NULL;
  const void* ip = eng_ptr(I);
  for (int64_t i = 0; I->device == ENG_CPU && i < I->numel; i++) { /* the CUDA kernel checks on the device */
    int64_t k = I->dtype == ENG_I32 ? (int64_t)((const int32_t*)ip)[i] : ((const int64_t*)ip)[i];
    if (k < 0 || k >= num) {
      eng_tensor_release(I);
      return eng_errp("%s: index %lld out of range for weight %s (valid 0..%lld), at flat position %lld of "
                      "indices %s", op, (long long)k, eng_desc(weight), (long long)num - 1, (long long)i + 1,
                      eng_desc(indices));
    }
  }
  int64_t shape[ENG_MAX_DIMS];
  for (int d = 0; d < indices->ndim; d++) shape[d] = indices->shape[d];
  shape[indices->ndim] = dim;
  eng_tensor* W = eng_as_contig(weight, weight->dtype);
  eng_tensor* out = W ? eng_new(indices->ndim + 1, shape, weight->dtype, weight->device) : NULL;
  if (out && out->numel > 0 && out->device == ENG_CUDA) {
    if (eng_cu_embedding_fwd(I->numel, ip, I->dtype, eng_ptr(W), num, dim * eng_dtype_size(weight->dtype),
                             eng_ptr(out), op)) {
      eng_tensor_release(out);
      out = NULL;
    }
  } else if (out && out->numel > 0)
    kc_embedding_gather(I->numel, ip, I->dtype, eng_ptr(W), dim * eng_dtype_size(weight->dtype), eng_ptr(out));
  eng_tensor_release(W);
  if (out && eng_any_requires_grad(1, &weight) && eng_dtype_is_floating(weight->dtype)) {
    eng_node* nd = eng_record("EmbeddingBackward", embedding_bw, 1, &weight, out);
    if (!nd || eng_node_save(nd, I)) { eng_tensor_release(out); out = NULL; }
    else { nd->ints[0] = padding_idx < 0 ? -1 : padding_idx; nd->ints[1] = weight->dtype == ENG_F64 ? ENG_F64 : ENG_F32; }
  }
  eng_tensor_release(I);
  return out;
}
