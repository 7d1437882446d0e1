/* silu_mul.c: silu(a) * b as one op (eng_silu_mul, ops_nn.h), the product of a SwiGLU feed-forward
 * (w2(silu(w1 x) * w3 x): Llama, torchtitan).  On the CPU in f32 and f64: one pass forward (no silu(a) tensor in
 * memory) and one backward for both gradients, the composition's values and gradients bit for bit
 * (kernels/cpu/unary.c); on CUDA the same in every float dtype, the silu and mul kernels' roundings included
 * (kernels/cuda/silu_mul.cu).  bf16 / f16 on the CPU run the composition eng_mul(eng_silu(a), b), which autograd
 * differentiates.  DTensors and meta tensors dispatch (sharding/pointwise.c: equal placements run on the shards). */
#include "core/internal.h"
#include "core/dispatch.h"
#include "kernels/cpu/kcpu.h"
#include "ops/cuda_ops.h"
#include "ops/ops.h"
#include "autograd/autograd.h"
#include "eng/ops_pointwise.h"

/* saved: 0 a, 1 b (contiguous, the op's dtype) */
static int silu_mul_bw(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  eng_tensor *A = eng_node_saved(n, 0), *B = eng_node_saved(n, 1);
  if (!A || !B) return -1;
  int dt = A->dtype;
  int need_a = eng_node_needs_grad(n, 0), need_b = eng_node_needs_grad(n, 1);
  eng_tensor* G = eng_as_contig(go[0], dt);
  eng_tensor* ga = G && need_a ? eng_new(A->ndim, A->shape, dt, A->device) : NULL;
  eng_tensor* gb = G && need_b ? eng_new(B->ndim, B->shape, dt, B->device) : NULL;
  int rc = -1;
  if (G && (!need_a || ga) && (!need_b || gb)) {
    void *pa = ga ? (void*)eng_ptr(ga) : NULL, *pb = gb ? (void*)eng_ptr(gb) : NULL;
    int st = A->device == ENG_CUDA
                 ? eng_cu_silu_mul_grad(dt, A->numel, eng_ptr(G), eng_ptr(A), eng_ptr(B), pa, pb, n->name)
                 : (kc_silu_mul_grad(dt == ENG_F32 ? KC_F32 : KC_F64, A->numel, eng_ptr(G), eng_ptr(A), eng_ptr(B), pa,
                                     pb) ? eng_err("%s: the kernel refused %s", n->name, eng_desc(A)) : 0);
    if (!st) {
      rc = 0;
      if (ga && !(gi[0] = eng_grad_to_input(n, 0, ga))) rc = -1;
      if (!rc && gb && !(gi[1] = eng_grad_to_input(n, 1, gb))) rc = -1;
    }
  }
  eng_tensor_release(G); eng_tensor_release(ga); eng_tensor_release(gb);
  return rc;
}

eng_tensor* eng_silu_mul(eng_tensor* a, eng_tensor* b) {
  const char* op = "silu_mul";
  ENG_CHECK(a, op);
  ENG_CHECK(b, op);
  char ba[1024], bb[1024];
  if (!eng_dtype_is_floating(a->dtype) || a->dtype != b->dtype)
    return eng_errp("%s: expected two floating point tensors of one dtype, got a %s, b %s", op,
                    eng_dist_desc(a, ba, sizeof ba), eng_dist_desc(b, bb, sizeof bb));
  /* DTensors and meta tensors: the dispatcher (the shapes are checked there on the global shapes) */
  if (ENG_DT_ACTIVE(a->dist || ENG_META_T(a) || b->dist || ENG_META_T(b)))
    return eng_op_dispatch(ENG_OP_SILU_MUL, &(eng_op_call){.name = op, .n_in = 2, .in = {a, b}});
  if (eng_meta_check_local(a, op) || eng_meta_check_local(b, op)) return NULL;
  if (a->ndim != b->ndim || memcmp(a->shape, b->shape, sizeof(int64_t) * (size_t)a->ndim))
    return eng_errp("%s: expected a and b of one shape, got a %s, b %s", op, eng_desc(a), eng_desc(b));
  if (a->device != b->device)
    return eng_errp("%s: expected a and b on one device, got a %s, b %s", op, eng_desc(a), eng_desc(b));
  if (a->device == ENG_CPU && a->dtype != ENG_F32 && a->dtype != ENG_F64) {
    eng_tensor* s = eng_silu(a);
    eng_tensor* out = s ? eng_mul(s, b) : NULL;
    eng_tensor_release(s);
    return out;
  }
  eng_tensor *A = eng_as_contig(a, a->dtype), *B = A ? eng_as_contig(b, b->dtype) : NULL;
  eng_tensor* out = B ? eng_new(a->ndim, a->shape, a->dtype, a->device) : NULL;
  int st = 0;
  if (out && a->device == ENG_CUDA)
    st = eng_cu_silu_mul(a->dtype, out->numel, eng_ptr(A), eng_ptr(B), (void*)eng_ptr(out), op);
  else if (out && kc_silu_mul(a->dtype == ENG_F32 ? KC_F32 : KC_F64, out->numel, eng_ptr(A), eng_ptr(B),
                              (void*)eng_ptr(out)))
    st = eng_err("%s: the kernel refused %s", op, eng_desc(a));
  if (st) { eng_tensor_release(out); out = NULL; }
  eng_tensor* in[2] = {a, b};
  if (out && eng_any_requires_grad(2, in)) {
    eng_node* nd = eng_record("SiluMulBackward", silu_mul_bw, 2, in, out);
    if (!nd || eng_node_save(nd, A) || eng_node_save(nd, B)) { eng_tensor_release(out); out = NULL; }
  }
  eng_tensor_release(A);
  eng_tensor_release(B);
  return out;
}
