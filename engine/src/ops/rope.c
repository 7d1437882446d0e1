/* rope.c: the fused rotary position embedding (eng_rotary_emb, ops_nn.h): one pass over x instead of the
 * composite x * cos + swap(x) * sin (an index_select, two products and a sum, each a pass over x, and the
 * index_select's scatter in backward).  Backward is the same rotation by -angle of the incoming gradient.
 * DTensors and meta tensors dispatch (sharding/rope.c: batch, sequence or head sharded x runs on its shards). */
#include "core/internal.h"
#include "core/dispatch.h"
#include "kernels/cpu/kcpu.h"
#include "ops/cuda_ops.h"
#include "ops/ops.h"
#include "autograd/autograd.h"

/* out (contiguous) = rotation of X ([B, T, H, D], its last dim contiguous) by the tables (contiguous [T, D / 2]);
 * inverse: by -angle. */
static eng_tensor* rotate(eng_tensor* X, eng_tensor* C, eng_tensor* S, int inverse, const char* op) {
  eng_tensor* out = eng_new(X->ndim, X->shape, X->dtype, X->device);
  if (!out || out->numel == 0) return out;
  int64_t B = X->shape[0], T = X->shape[1], H = X->shape[2], D = X->shape[3];
  const int64_t xs[3] = {X->stride[0], X->stride[1], X->stride[2]};
  int rc;
  if (X->device == ENG_CUDA)
    rc = eng_cu_rope(X->dtype, C->dtype, B, T, H, D, eng_ptr(X), xs, eng_ptr(C), eng_ptr(S), inverse, eng_ptr(out), op);
  else
    rc = kc_rope(X->dtype, C->dtype, B, T, H, D, eng_ptr(X), xs, eng_ptr(C), eng_ptr(S), inverse, eng_ptr(out)) ?
      eng_err("%s: the kernel refused its arguments (%s)", op, eng_desc(X)) : 0;
  if (rc) { eng_tensor_release(out); return NULL; }
  return out;
}


/* saved: the tables (contiguous) */
static int rope_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor *C = eng_node_saved(n, 0), *S = eng_node_saved(n, 1);
  if (!C || !S) return -1;
  eng_tensor* G = eng_as_contig(go[0], eng_node_in_dtype(n, 0));
  if (!G) return -1;
  eng_tensor* r = rotate(G, C, S, 1, n->name);
  eng_tensor_release(G);
  if (!r) return -1;
  gi[0] = eng_grad_to_input(n, 0, r);
  eng_tensor_release(r);
  return gi[0] ? 0 : -1;
}

eng_tensor* eng_rotary_emb(eng_tensor* x, eng_tensor* cos, eng_tensor* sin) {
  const char* op = "rotary_emb";
  ENG_CHECK(x, op);
  ENG_CHECK(cos, op);
  ENG_CHECK(sin, op);
  /* DTensors and meta tensors: the dispatcher (sharding/rope.c: the op on the local shards, or meta shapes) */
  if (ENG_DT_ACTIVE(x->dist || ENG_META_T(x) || cos->dist || ENG_META_T(cos) || sin->dist || ENG_META_T(sin))) {
    char bx[1024], bc[1024], bs[1024]; /* the dtypes here, the global shapes in the op def's shape function */
    if (!eng_dtype_is_floating(x->dtype) || !eng_dtype_is_floating(cos->dtype) || !eng_dtype_is_floating(sin->dtype))
      return eng_errp("%s: expected floating point tensors, got x %s, cos %s, sin %s", op,
                      eng_dist_desc(x, bx, sizeof bx), eng_dist_desc(cos, bc, sizeof bc),
                      eng_dist_desc(sin, bs, sizeof bs));
    if (cos->dtype != sin->dtype)
      return eng_errp("%s: expected cos and sin of one dtype, got cos %s, sin %s", op,
                      eng_dist_desc(cos, bc, sizeof bc), eng_dist_desc(sin, bs, sizeof bs));
    return eng_op_dispatch(ENG_OP_ROTARY_EMB, &(eng_op_call){.name = op, .n_in = 3, .in = {x, cos, sin}});
  }
  /* (DTensors reach here only in local mode, on their local shards) */
  if (eng_meta_check_local(x, op) || eng_meta_check_local(cos, op) || eng_meta_check_local(sin, op)) return NULL;
  if (x->ndim != 4 || x->shape[3] % 2 != 0)
    return eng_errp("%s: expected x of shape [B, T, H, D] with an even D, got %s", op, eng_desc(x));
  if (!eng_dtype_is_floating(x->dtype) || !eng_dtype_is_floating(cos->dtype) || !eng_dtype_is_floating(sin->dtype))
    return eng_errp("%s: expected floating point tensors, got x %s, cos %s, sin %s", op, eng_desc(x), eng_desc(cos),
                    eng_desc(sin));
  int64_t T = x->shape[1], half = x->shape[3] / 2;
  if (cos->ndim != 2 || sin->ndim != 2 || cos->shape[0] != T || cos->shape[1] != half || sin->shape[0] != T ||
      sin->shape[1] != half || cos->dtype != sin->dtype)
    return eng_errp("%s: expected cos and sin of shape [T, D / 2] = [%lld, %lld] and one dtype for x %s, got cos %s, "
                    "sin %s", op, (long long)T, (long long)half, eng_desc(x), eng_desc(cos), eng_desc(sin));
  if (cos->device != x->device || sin->device != x->device)
    return eng_errp("%s: expected every tensor on one device, got x %s, cos %s, sin %s", op, eng_desc(x),
                    eng_desc(cos), eng_desc(sin));
  /* the q / k views of a fused QKV projection have a unit last stride: no copy */
  eng_tensor *X = eng_unit_last_stride(x), *C = eng_as_contig(cos, cos->dtype), *S = eng_as_contig(sin, sin->dtype);
  eng_tensor* out = X && C && S ? rotate(X, C, S, 0, op) : NULL;
  eng_tensor_release(X);
  if (out && eng_any_requires_grad(1, &x)) {
    eng_node* nd = eng_record("RotaryEmbBackward", rope_bw, 1, &x, out);
    if (!nd || eng_node_save(nd, C) || eng_node_save(nd, S)) { eng_tensor_release(out); out = NULL; }
  }
  eng_tensor_release(C);
  eng_tensor_release(S);
  return out;
}
