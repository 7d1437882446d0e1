/* grad_mode.c: the grad mode flag (per thread; torch.no_grad / enable_grad).
 * It lives with the core: ops read it before recording a node, core's
 * in-place checks read it, autograd turns it off while backward functions
 * run. */
#include "core/internal.h"

static __thread int g_grad_disabled;
int eng_grad_enabled(void) { return !g_grad_disabled; }
int eng_set_grad_enabled(int enabled) {
  int prev = !g_grad_disabled;
  g_grad_disabled = !enabled;
  return prev;
}
