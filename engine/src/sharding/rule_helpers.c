/* rule_helpers.c: the building blocks every sharding rule uses
 * (sharding/sharding.h: placements, the strategy list, the common shape
 * functions). */
#include "sharding/sharding.h"
#include <string.h>

int sh_is_linear_P(const eng_placement* p) {
  return p->kind == ENG_PLACEMENT_PARTIAL && (p->op == ENG_REDUCE_SUM || p->op == ENG_REDUCE_AVG);
}

int sh_push(eng_strategy* out, int cap, int n, const eng_strategy* s) {
  if (n < 0) return n;
  if (n >= cap) return n; /* silently drop: the dispatcher's buffer is large enough for every rule here */
  out[n] = *s;
  return n + 1;
}

int sh_push3(eng_strategy* out, int cap, int n, eng_placement a, eng_placement b, eng_placement c, eng_placement o) {
  eng_strategy st;
  memset(&st, 0, sizeof st);
  st.in[0] = a; st.in[1] = b; st.in[2] = c; st.out[0] = o;
  return sh_push(out, cap, n, &st);
}

int sh_all_replicate(eng_strategy* out, int cap, int n, int n_in, int n_out) {
  eng_strategy s;
  memset(&s, 0, sizeof s);
  for (int i = 0; i < n_in && i < ENG_OP_MAX_IN; i++) s.in[i] = sh_R();
  for (int j = 0; j < n_out && j < ENG_OP_MAX_OUT; j++) s.out[j] = sh_R();
  return sh_push(out, cap, n, &s);
}

int sh_shape_same0(const eng_op_call* c, const eng_dist_spec* const* s, int* ndims, int64_t (*shapes)[8]) {
  (void)c;
  ndims[0] = s[0]->ndim;
  for (int d = 0; d < s[0]->ndim; d++) shapes[0][d] = s[0]->shape[d];
  return 0;
}

int sh_shape_broadcast(const eng_op_call* c, const eng_dist_spec* const* s, int* ndims, int64_t (*shapes)[8]) {
  int nd = 0;
  int64_t out[ENG_MAX_DIMS];
  for (int i = 0; i < c->n_in; i++) {
    if (!s[i]) continue;
    if (s[i]->ndim > nd) {
      for (int d = ENG_MAX_DIMS - 1; d >= 0; d--) out[d] = 0;
      int64_t prev[ENG_MAX_DIMS];
      for (int d = 0; d < nd; d++) prev[d] = shapes[0][d];
      int shift = s[i]->ndim - nd;
      for (int d = 0; d < s[i]->ndim; d++) out[d] = d < shift ? 1 : prev[d - shift];
      nd = s[i]->ndim;
    } else for (int d = 0; d < nd; d++) out[d] = shapes[0][d];
    int off = nd - s[i]->ndim;
    for (int d = 0; d < s[i]->ndim; d++) {
      int64_t a = out[d + off], b = s[i]->shape[d];
      if (a == b || b == 1) continue;
      if (a == 1) out[d + off] = b;
      else return eng_err("shapes %s and %s cannot be broadcast together", eng_shape_str(nd, out),
                          eng_shape_str(s[i]->ndim, s[i]->shape));
    }
    for (int d = 0; d < nd; d++) shapes[0][d] = out[d];
  }
  ndims[0] = nd;
  for (int j = 1; j < ENG_OP_MAX_OUT; j++) { ndims[j] = nd; for (int d = 0; d < nd; d++) shapes[j][d] = shapes[0][d]; }
  return 0;
}

