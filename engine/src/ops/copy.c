/* copy.c: the copying ops with their autograd: clone, contiguous, to (dtype),
 * to_device.  The raw copies they use (eng_copy_raw, eng_device_copy) are
 * core's; these record the nodes (identity gradients, cast back to the
 * input's dtype and device). */
#include "core/dispatch.h"
#include "core/device.h"
#include "autograd/autograd.h"

/* Identity-gradient copies (clone, contiguous) and casts. */
static int copy_backward(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  if (!go[0]) return 0;
  gi[0] = eng_tensor_to_dtype(go[0], eng_node_in_dtype(n, 0));
  return gi[0] ? 0 : -1;
}

static eng_tensor* copy_as(eng_tensor* t, int dtype, const char* name) {
  eng_tensor* r = eng_new(t->ndim, t->shape, dtype, t->device);
  if (!r) return NULL;
  if (eng_copy_raw(r, t, t->stride)) { eng_tensor_release(r); return NULL; }
  if (eng_dtype_is_floating(dtype)) eng_record(name, copy_backward, 1, &t, r);
  return r;
}

eng_tensor* eng_tensor_clone(eng_tensor* t) {
  ENG_CHECK(t, "clone");
  if (ENG_DT_ACTIVE(t->dist)) return eng_op_dispatch(ENG_OP_CLONE, &(eng_op_call){.name = "clone", .n_in = 1, .in = {t}});
  return copy_as(t, t->dtype, "CloneBackward");
}

eng_tensor* eng_tensor_contiguous(eng_tensor* t) {
  ENG_CHECK(t, "contiguous");
  if (eng_tensor_is_contiguous(t)) return eng_tensor_retain(t);
  if (ENG_DT_ACTIVE(t->dist))
    return eng_op_dispatch(ENG_OP_CLONE, &(eng_op_call){.name = "contiguous", .n_in = 1, .in = {t}, .ints = {1}});
  return copy_as(t, t->dtype, "CloneBackward");
}

eng_tensor* eng_tensor_to_dtype(eng_tensor* t, int dtype) {
  ENG_CHECK(t, "to");
  if (dtype < 0 || dtype >= ENG_NUM_DTYPES) return eng_errp("to: invalid dtype code %d", dtype);
  if (t->dtype == dtype) return eng_tensor_retain(t);
  if (ENG_DT_ACTIVE(t->dist)) return eng_op_dispatch(ENG_OP_CAST, &(eng_op_call){.name = "to", .n_in = 1, .in = {t}, .ints = {dtype}});
  return copy_as(t, dtype, "ToCopyBackward");
}

/* The gradient goes back to the input's device (ints[0]) and dtype. */
static int to_device_backward(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  if (!go[0]) return 0;
  eng_tensor* g = go[0]->device == (int)n->ints[0] ? eng_tensor_retain(go[0]) : eng_device_copy(go[0], (int)n->ints[0]);
  if (!g) return -1;
  gi[0] = eng_tensor_to_dtype(g, eng_node_in_dtype(n, 0));
  eng_tensor_release(g);
  return gi[0] ? 0 : -1;
}

eng_tensor* eng_tensor_to_device(eng_tensor* t, int device) {
  ENG_CHECK(t, "to_device");
  if (device != ENG_CPU && device != ENG_META && !eng_is_device(device))
    return eng_errp("to_device: invalid device code %d (0 = cpu, 1 = cuda, 2 = meta)", device);
  if (t->device == device) return eng_tensor_retain(t);
  /* inside a DTensor op's local function (local mode) a DTensor input stands for its local tensor */
  if (t->dist && !eng_dispatch_local_mode())
    return eng_errp("to_device: %s is a DTensor; moving DTensors between devices is not supported", eng_desc(t));
  eng_tensor* r = eng_device_copy(t, device);
  if (!r) return NULL;
  if (eng_dtype_is_floating(t->dtype) && eng_any_requires_grad(1, &t)) {
    eng_node* nd = eng_record("ToCopyBackward", to_device_backward, 1, &t, r);
    if (!nd) { eng_tensor_release(r); return NULL; }
    nd->ints[0] = t->device;
  }
  return r;
}

