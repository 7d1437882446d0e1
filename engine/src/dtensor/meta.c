/* meta.c: ops on meta tensors (the meta device lives with the dispatcher: its ops run through the op defs) (ENG_META: shape, dtype and strides, no
 * data).  An op with a DTensor op def reaches here through its dispatcher
 * guard when an operand is meta:
 *   - output SHAPES come from the op def's shape function, the one the
 *     DTensor dispatcher uses for global shapes (its argument checks included);
 *     for a meta DTensor the dispatcher picks the strategy as usual and the
 *     outputs get the chosen output specs' local shapes;
 *   - output DTYPES (and the op's dtype checks: softmax of an integer tensor,
 *     ...) come from running the op itself on tiny CPU stand-ins: zeros of the
 *     operands' dtypes with every dim clamped to at most 1, under no_grad and
 *     with the generator state restored (a meta dropout draws nothing); shape
 *     ops (def->keeps_dtype: view/reshape, permute, expand, narrow, select,
 *     whose ints name sizes the stand-ins lack; rotary_emb, whose even last dim the stand-ins lack: its shape
 *     function checks the dtypes) keep their input's dtype.
 * Meta results record no autograd history. */
#include "dtensor/dispatch.h"
#include "eng/ops_nn.h"
#include "eng/ops_reduce.h"
#include "eng/rng.h"

static int meta_t(const eng_tensor* t) { return t && t->device == ENG_META; }

int eng_meta_any(const eng_op_call* c) {
  for (int i = 0; i < c->n_in; i++) if (meta_t(c->in[i])) return 1;
  return 0;
}

/* Every tensor operand must be meta (a 0-d CPU tensor passes as a scalar). */
static int check_devices(const char* name, const eng_op_call* c) {
  for (int i = 0; i < c->n_in; i++) {
    const eng_tensor* t = c->in[i];
    if (!t || t->device == ENG_META || (t->device == ENG_CPU && t->ndim == 0)) continue;
    for (int j = 0; j < c->n_in; j++)
      if (meta_t(c->in[j]))
        return eng_err("%s: tensors on different devices: %s and %s", name, eng_desc(c->in[j]), eng_desc(t));
  }
  return 0;
}

/* The op itself on stand-ins (plain CPU tensors): its outputs' dtypes. */
static int probe_dtypes(const eng_op_def* def, const eng_op_call* c, int* dts) {
  eng_op_call pc = *c;
  eng_tensor* stand[ENG_OP_MAX_IN] = {0};
  int rc = -1;
  for (int i = 0; i < c->n_in; i++) {
    const eng_tensor* t = c->in[i];
    if (!t) continue;
    int64_t sh[ENG_MAX_DIMS];
    for (int d = 0; d < t->ndim; d++) sh[d] = t->shape[d] < 1 ? t->shape[d] : 1;
    stand[i] = eng_tensor_zeros(t->ndim, sh, t->dtype, ENG_CPU);
    if (!stand[i]) goto done;
    pc.in[i] = stand[i];
  }
  uint64_t seed, off;
  eng_rng_get_state(&seed, &off);
  int prev_grad = eng_set_grad_enabled(0);
  int prev_mode = eng_dispatch_set_local_mode(1);
  eng_tensor* outs[ENG_OP_MAX_OUT] = {0};
  int n_out = def->n_out, prc = 0;
  if (def->keeps_dtype) {
    for (int j = 0; j < n_out; j++) outs[j] = eng_tensor_retain(pc.in[0]);
  } else if (def == eng_dt_op_def(ENG_OP_SDPA)) {
    outs[0] = eng_scaled_dot_product_attention(pc.in[0], pc.in[1], pc.in[2], pc.in[3], pc.scalars[0], (int)pc.ints[0],
                                               pc.scalars[1]);
  } else if (def == eng_dt_op_def(ENG_OP_DROPOUT)) {
    outs[0] = eng_dropout(pc.in[0], pc.scalars[0], 1);
  } else if (def == eng_dt_op_def(ENG_OP_EMBEDDING)) {
    outs[0] = eng_embedding(pc.in[0], pc.in[1], -1); /* the padding index may not exist in the stand-in */
  } else if (def == eng_dt_op_def(ENG_OP_CROSS_ENTROPY)) {
    outs[0] = eng_cross_entropy(pc.in[0], pc.in[1], pc.ints[0], (int)pc.ints[1], pc.scalars[0]);
  } else if (def == eng_dt_op_def(ENG_OP_MEAN)) {
    int dims[ENG_MAX_DIMS], n = 0;
    for (int d = 0; d < pc.in[0]->ndim; d++) if (pc.ints[0] >> d & 1) dims[n++] = d;
    outs[0] = n ? eng_mean(pc.in[0], n, dims, (int)pc.ints[1]) : eng_tensor_retain(pc.in[0]);
  } else if (def == eng_dt_op_def(ENG_OP_MAX_DIM)) {
    eng_tensor* idx = NULL;
    outs[0] = pc.ints[2] ? eng_max_dim(pc.in[0], (int)pc.ints[0], (int)pc.ints[1], &idx)
                         : eng_min_dim(pc.in[0], (int)pc.ints[0], (int)pc.ints[1], &idx);
    outs[1] = idx;
  } else if (def->fn) {
    outs[0] = def->fn(&pc);
  } else {
    prc = eng_err("no dtype rule for meta tensors");
  }
  eng_dispatch_set_local_mode(prev_mode);
  eng_set_grad_enabled(prev_grad);
  eng_rng_set_state(seed, off);
  if (!prc) {
    for (int j = 0; j < n_out; j++) {
      if (!outs[j]) { prc = -1; break; }
      dts[j] = outs[j]->dtype;
    }
  }
  for (int j = 0; j < n_out; j++) eng_tensor_release(outs[j]);
  rc = prc;
done:
  for (int i = 0; i < ENG_OP_MAX_IN; i++) eng_tensor_release(stand[i]);
  return rc;
}

int eng_meta_outputs(const eng_op_def* def, eng_op_call* c, eng_dist_spec* const* out_specs, eng_tensor** outs) {
  const char* name = c->name ? c->name : def->name;
  int n_out = def->n_out;
  for (int j = 0; j < n_out; j++) outs[j] = NULL;
  if (check_devices(name, c)) return -1;
  int nd[ENG_OP_MAX_OUT] = {0};
  int64_t shapes[ENG_OP_MAX_OUT][8];
  if (out_specs) {
    for (int j = 0; j < n_out; j++) {
      nd[j] = out_specs[j]->ndim;
      for (int d = 0; d < nd[j]; d++) shapes[j][d] = out_specs[j]->local_shape[d];
    }
  } else {
    /* plain meta operands: the shape function on specs that carry shapes only */
    eng_dist_spec fake[ENG_OP_MAX_IN];
    const eng_dist_spec* s[ENG_OP_MAX_IN] = {0};
    for (int i = 0; i < c->n_in; i++) {
      const eng_tensor* t = c->in[i];
      if (!t) continue;
      memset(&fake[i], 0, sizeof fake[i]);
      fake[i].ndim = t->ndim;
      fake[i].member = 1;
      for (int d = 0; d < t->ndim; d++) {
        fake[i].shape[d] = fake[i].local_shape[d] = t->shape[d];
        fake[i].stride[d] = t->stride[d];
      }
      fake[i].numel = t->numel;
      s[i] = &fake[i];
    }
    if (def->shape(c, s, nd, shapes)) { eng_err_prefix("%s", name); return -1; }
  }
  int dts[ENG_OP_MAX_OUT];
  if (probe_dtypes(def, c, dts)) { eng_err_prefix("%s (meta)", name); return -1; }
  for (int j = 0; j < n_out; j++) {
    outs[j] = eng_new(nd[j], shapes[j], dts[j], ENG_META);
    if (!outs[j]) {
      for (int k = 0; k < j; k++) { eng_tensor_release(outs[k]); outs[k] = NULL; }
      return -1;
    }
  }
  return 0;
}

int eng_meta_inplace(const char* name, eng_op_call* c) {
  eng_tensor* a = c->in[0];
  if (check_devices(name, c)) return -1;
  if (!meta_t(a)) return eng_err("%s: cannot write into %s from a meta tensor: it has no data", name, eng_desc(a));
  if (eng_check_inplace(a, name) || eng_check_internal_overlap(a, name)) return -1;
  for (int i = 1; i < c->n_in; i++) {
    const eng_tensor* t = c->in[i];
    if (t && eng_check_broadcast_to(a, t, name)) return -1;
  }
  return 0; /* nothing to write */
}
