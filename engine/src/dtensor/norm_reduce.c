/* norm_reduce.c: the collective part of global norms over DTensor shards
 * (clip_grad_norm_, global_norm; ops/optim.c computes the local accumulators
 * and reaches here through core/dispatch.h).
 *
 * The caller groups its tensors by layout: one group per mesh and set of
 * Shard mesh dims (mask), with the group's local accumulator.  Here the groups
 * of equal meshes are combined into one accumulator per mesh over the union of
 * their masks; a group replicated along a mesh dim that another group shards
 * contributes from coordinate 0 of that dim only, so every shard counts once.
 * Then one all_reduce per sharded mesh dim of each mesh (PyTorch's count: one
 * per Partial placement of the norm). */
#include "dtensor/dtensor_impl.h"
#include "dtensor/dispatch.h"
#include <math.h>

typedef struct { eng_mesh* mesh; uint32_t mask; double acc; } norm_mesh;

static double combine(int kind, double a, double b) {
  if (kind == ENG_NORM_MAX) return (a > b || isnan(a)) ? a : b;
  if (kind == ENG_NORM_MIN) return (a < b || isnan(a)) ? a : b;
  return a + b;
}

static int reduce_op_of(int kind) {
  return kind == ENG_NORM_MAX ? ENG_REDUCE_MAX : kind == ENG_NORM_MIN ? ENG_REDUCE_MIN : ENG_REDUCE_SUM;
}

int eng_dt_norm_reduce(const char* op, int n, const eng_dist_spec* const* layouts, const uint32_t* masks,
                       const double* acc, int kind, int err, double* out) {
  double init = kind == ENG_NORM_MIN ? INFINITY : 0.0;
  norm_mesh* ms = calloc((size_t)n + 1, sizeof *ms);
  int* mesh_of = calloc((size_t)n + 1, sizeof *mesh_of);
  if (!ms || !mesh_of) { free(ms); free(mesh_of); return eng_err("%s: out of memory", op); }
  int nm = 0;
  for (int g = 0; g < n; g++) {
    int m = 0;
    while (m < nm && !(ms[m].mesh == layouts[g]->mesh || eng_mesh_equal(ms[m].mesh, layouts[g]->mesh))) m++;
    if (m == nm) { ms[m].mesh = layouts[g]->mesh; ms[m].acc = init; nm++; }
    ms[m].mask |= masks[g];
    mesh_of[g] = m;
  }
  for (int g = 0; g < n; g++) {
    norm_mesh* M = &ms[mesh_of[g]];
    uint32_t rep = M->mask & ~masks[g]; /* sharded by other groups, replicated in this one */
    int mine = 1;
    for (int d = 0; d < layouts[g]->mesh_ndim; d++)
      if ((rep & (1u << d)) && layouts[g]->coord[d] != 0) mine = 0;
    if (mine) M->acc = combine(kind, M->acc, acc[g]);
  }
  /* The caller's checks may fail on some ranks only (their own gradients): the ranks of every mesh the
   * all_reduces below run on agree first. */
  for (int m = 0; m < nm; m++)
    for (int d = 0; d < eng_mesh_ndim(ms[m].mesh); d++) {
      if (!(ms[m].mask & (1u << d))) continue;
      eng_pg* pg = eng_mesh_get_group(ms[m].mesh, d);
      if (pg && eng_pg_agree(pg, err, 0, op) && !err) err = 2;
      eng_pg_release(pg);
    }
  if (err) { free(ms); free(mesh_of); return -1; }
  double r = init;
  int rc = 0;
  for (int m = 0; m < nm && rc == 0; m++) {
    int64_t one = 1;
    eng_tensor* v = eng_tensor_full(1, &one, ms[m].acc, ENG_F64, ENG_CPU);
    if (!v) { rc = -1; break; }
    for (int d = 0; d < eng_mesh_ndim(ms[m].mesh) && rc == 0; d++) {
      if (!(ms[m].mask & (1u << d))) continue;
      eng_pg* pg = eng_mesh_get_group(ms[m].mesh, d);
      if (!pg || eng_pg_all_reduce(pg, v, reduce_op_of(kind), NULL)) rc = -1;
      eng_pg_release(pg);
    }
    if (rc == 0) r = combine(kind, r, *(double*)eng_ptr(v));
    eng_tensor_release(v);
  }
  free(ms);
  free(mesh_of);
  if (rc) { eng_err_prefix("%s: norm over DTensor shards", op); return -1; }
  *out = r;
  return 0;
}
