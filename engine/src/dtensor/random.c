/* random.c: in-place random fills of a DTensor (uniform_, normal_,
 * bernoulli_ on a DTensor reach here from core/rng.c through the op table,
 * ENG_OP_RANDOM_FILL). */
#include "dtensor/dtensor_impl.h"
#include "dtensor/dispatch.h"

/* A DTensor gets its shard's slice of the global random tensor, and every
 * rank advances the generator by the global numel (as the factories do), so
 * full_tensor() equals a single-process fill with the same seed, whatever
 * the layout (PyTorch's offset-based RNG tracker). */
static int fill_dtensor(const char* op, int kind, eng_tensor* t, double a, double b) {
  const eng_dist_spec* s = t->dist;
  if (s->has_partial) {
    char buf[600];
    return eng_err("%s: %s has a Partial placement; fill a Replicate or Shard layout (redistribute first)", op,
                   eng_dist_spec_describe(s, t->dtype, buf, sizeof buf));
  }
  uint64_t seed;
  uint64_t off = eng_rng_reserve_seeded((uint64_t)s->numel, &seed);
  if (s->member && t->numel > 0) {
    eng_tensor* r = dt_random_local(kind, s, a, b, t->dtype, seed, off); /* also _StridedShard (several runs) */
    if (r && t->device != ENG_CPU) { /* drawn on the host: the CUDA stream gives the same numbers */
      eng_tensor* d = eng_tensor_to_device(r, t->device);
      eng_tensor_release(r);
      r = d;
    }
    if (!r) { eng_err_prefix("%s", op); return -1; }
    int rc = eng_copy_raw(t, r, r->stride);
    eng_tensor_release(r);
    if (rc) return -1;
  }
  eng_bump_version(t);
  return 0;
}

static eng_tensor* random_fill(eng_op_call* c) {
  eng_tensor* t = c->in[0];
  if (fill_dtensor(c->name, (int)c->ints[0], t, c->scalars[0], c->scalars[1])) return NULL;
  return eng_tensor_retain(t);
}

__attribute__((constructor)) static void register_random_fill(void) {
  eng_dt_register_handler(ENG_OP_RANDOM_FILL, random_fill, NULL);
}
