/* test_core.c: C-level tests of the tensor core, allocator, autograd engine,
 * C hooks and module hooks.  Prints "N passed, N failed" last. */
#include <stdio.h>
#include <string.h>
#include <math.h>
#include "engine.h"

static int g_pass, g_fail;
#define CHECK(cond, ...)                                                        \
  do {                                                                          \
    if (cond) g_pass++;                                                         \
    else { g_fail++; printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); } \
  } while (0)

static double at(eng_tensor* t, int64_t i) {
  double v = 0; int64_t idx[8] = {0};
  int64_t r = i;
  for (int d = t->ndim - 1; d >= 0; d--) { idx[d] = r % t->shape[d]; r /= t->shape[d]; }
  eng_tensor_get(t, idx, &v);
  return v;
}

static void test_allocator(void) {
  int64_t shape[2] = {256, 1024};
  eng_alloc_stats s0, s1;
  eng_tensor* t = eng_tensor_zeros(2, shape, ENG_F32, ENG_CPU);
  eng_tensor_release(t);
  eng_alloc_get_stats(&s0);
  for (int i = 0; i < 100; i++) { t = eng_tensor_zeros(2, shape, ENG_F32, ENG_CPU); eng_tensor_release(t); }
  eng_alloc_get_stats(&s1);
  CHECK(s1.n_system_allocs == s0.n_system_allocs, "same-size allocations reuse cached blocks (%lld new)",
        (long long)(s1.n_system_allocs - s0.n_system_allocs));
  CHECK(s1.allocated == s0.allocated, "allocated bytes return to the same level");
  CHECK(s1.n_allocs - s0.n_allocs == 100, "100 allocation requests counted");
}

static void test_errors(void) {
  int64_t bad[2] = {2, -3};
  eng_tensor* t = eng_tensor_zeros(2, bad, ENG_F32, ENG_CPU);
  CHECK(t == NULL, "negative size rejected");
  CHECK(strstr(eng_last_error(), "negative size") != NULL, "message names the problem: %s", eng_last_error());
  int64_t a_s[2] = {2, 3}, b_s[1] = {4};
  eng_tensor* a = eng_tensor_zeros(2, a_s, ENG_F32, ENG_CPU);
  eng_tensor* b = eng_tensor_zeros(1, b_s, ENG_F32, ENG_CPU);
  eng_tensor* c = eng_add(a, b);
  CHECK(c == NULL, "non-broadcastable add rejected");
  CHECK(strstr(eng_last_error(), "f32[2,3]") && strstr(eng_last_error(), "f32[4]"), "layouts named: %s",
        eng_last_error());
  CHECK(eng_dtype_from_name("f33") < 0, "unknown dtype name rejected");
  CHECK(eng_add(NULL, a) == NULL, "NULL tensor rejected");
  eng_tensor_release(a); eng_tensor_release(b);
}

/* A custom C autograd function: y = 3x, backward multiplies by 3. */
static int triple_backward(eng_node* n, eng_tensor** go, eng_tensor** gi) {
  gi[0] = eng_mul_scalar(go[0], 3.0);
  return gi[0] ? 0 : -1;
}

static int g_hook_calls;
static int double_hook(eng_tensor* t, eng_tensor* grad, eng_tensor** out, void* ud) {
  g_hook_calls++;
  *out = eng_mul_scalar(grad, 2.0);
  return *out ? 0 : -1;
}
static int g_post_calls;
static int post_hook(eng_tensor* t, eng_tensor* grad, eng_tensor** out, void* ud) {
  g_post_calls++;
  return 0;
}

static void test_autograd(void) {
  int64_t s[1] = {3};
  double vals[3] = {1, 2, 3};
  eng_tensor* x = eng_tensor_from_data(1, s, ENG_F64, vals, ENG_F64, 3);
  eng_tensor_set_requires_grad(x, 1);
  eng_tensor* y = eng_tensor_empty(1, s, ENG_F64, ENG_CPU);
  memcpy(eng_tensor_data(y), (double[]){3, 6, 9}, sizeof(double) * 3);
  eng_node* n = eng_node_new("TripleBackward", triple_backward, 1, &x, 1);
  CHECK(n != NULL, "custom node created");
  eng_node_set_output(n, y, 0);
  eng_node_release(n);
  CHECK(strcmp(eng_tensor_grad_fn_name(y), "TripleBackward") == 0, "grad_fn name");
  int64_t h = eng_tensor_register_hook(x, double_hook, NULL);
  int64_t ph = eng_tensor_register_post_accumulate_hook(x, post_hook, NULL);
  CHECK(h > 0 && ph > 0, "hooks registered");
  eng_tensor* z = eng_mul(y, y); /* z = 9x^2, dz/dx = 18x, hook doubles: 36x */
  eng_tensor* g = eng_tensor_full(1, s, 1.0, ENG_F64, ENG_CPU);
  int rc = eng_backward(1, &z, &g, 0, 0, NULL, NULL);
  CHECK(rc == 0, "backward ok: %s", eng_last_error());
  eng_tensor* gx = eng_tensor_grad(x);
  CHECK(gx && fabs(at(gx, 0) - 36) < 1e-12 && fabs(at(gx, 2) - 108) < 1e-12, "custom node + hook gradient");
  CHECK(g_hook_calls == 1 && g_post_calls == 1, "hooks called once each (%d, %d)", g_hook_calls, g_post_calls);
  rc = eng_backward(1, &z, &g, 0, 0, NULL, NULL);
  CHECK(rc != 0 && strstr(eng_last_error(), "second time"), "second backward through freed graph errors: %s",
        eng_last_error());
  CHECK(eng_tensor_remove_hook(x, h) == 0, "hook removed");
  CHECK(eng_tensor_remove_hook(x, h) != 0, "removing twice errors");
  eng_tensor_release(z); eng_tensor_release(g); eng_tensor_release(y);
  /* non-leaf hooks and retain_grad */
  eng_tensor* a = eng_mul_scalar(x, 2.0);
  eng_tensor_retain_grad(a);
  eng_tensor* b = eng_mul(a, a);
  eng_tensor* g2 = eng_tensor_full(1, s, 1.0, ENG_F64, ENG_CPU);
  eng_tensor_set_grad(x, NULL);
  rc = eng_backward(1, &b, &g2, 0, 0, NULL, NULL);
  CHECK(rc == 0, "backward 2 ok: %s", eng_last_error());
  CHECK(eng_tensor_grad(a) && fabs(at(eng_tensor_grad(a), 1) - 8) < 1e-12, "retain_grad on a non-leaf");
  CHECK(eng_tensor_grad(x) && fabs(at(eng_tensor_grad(x), 1) - 16) < 1e-12, "leaf grad through non-leaf");
  eng_tensor_release(a); eng_tensor_release(b); eng_tensor_release(g2);
  /* no_grad */
  int prev = eng_set_grad_enabled(0);
  eng_tensor* c = eng_mul(x, x);
  CHECK(c && !c->requires_grad && !c->grad_fn, "no_grad records nothing");
  eng_set_grad_enabled(prev);
  eng_tensor_release(c);
  eng_tensor_release(x);
}

static int g_pre;
static int pre_hook(eng_module* m, int kind, eng_tensor** ts, int n, void* ud) {
  g_pre++;
  eng_tensor* r = eng_add_scalar(ts[0], 1.0);
  if (!r) return -1;
  eng_tensor_release(ts[0]);
  ts[0] = r;
  return 0;
}
static int failing_hook(eng_module* m, int kind, eng_tensor** ts, int n, void* ud) {
  return eng_set_error_message("boom");
}

static void test_module_hooks(void) {
  eng_module* m = eng_module_new("Block");
  int64_t h = eng_module_register_hook(m, ENG_HOOK_FORWARD_PRE, pre_hook, NULL, 0);
  CHECK(h > 0 && eng_module_hook_count(m, ENG_HOOK_FORWARD_PRE) == 1, "pre hook registered");
  int64_t s[1] = {2};
  eng_tensor* ts[1] = {eng_tensor_zeros(1, s, ENG_F32, ENG_CPU)};
  CHECK(eng_module_run_hooks(m, ENG_HOOK_FORWARD_PRE, ts, 1) == 0, "hooks ran");
  CHECK(g_pre == 1 && at(ts[0], 0) == 1.0, "pre hook replaced the input");
  eng_module_register_hook(m, ENG_HOOK_FORWARD_PRE, failing_hook, NULL, 0);
  CHECK(eng_module_run_hooks(m, ENG_HOOK_FORWARD_PRE, ts, 1) != 0, "failing hook reported");
  CHECK(strstr(eng_last_error(), "Block") && strstr(eng_last_error(), "boom"), "error names module: %s",
        eng_last_error());
  CHECK(eng_module_remove_hook(m, h) == 0 && eng_module_hook_count(m, ENG_HOOK_FORWARD_PRE) == 1, "hook removed");
  eng_tensor_release(ts[0]);
  eng_module_release(m);
}

static void test_views_and_copy(void) {
  int64_t s[2] = {2, 3};
  float v[6] = {1, 2, 3, 4, 5, 6};
  eng_tensor* t = eng_tensor_from_data(2, s, ENG_F32, v, ENG_F32, 6);
  eng_tensor* b = eng_tensor_to_dtype(t, ENG_BF16);
  eng_tensor* f = eng_tensor_to_dtype(b, ENG_F32);
  CHECK(at(f, 5) == 6.0 && at(f, 0) == 1.0, "bf16 round trip of small integers");
  eng_tensor* h = eng_tensor_to_dtype(t, ENG_F16);
  CHECK(at(h, 4) == 5.0, "f16 conversion");
  double x = 0;
  eng_tensor* one = eng_tensor_full(0, NULL, 0.1, ENG_BF16, ENG_CPU);
  eng_tensor_item(one, &x);
  CHECK(fabs(x - 0.10009765625) < 1e-12, "bf16 rounds to nearest even (0.1 -> %.12g)", x);
  eng_tensor_release(t); eng_tensor_release(b); eng_tensor_release(f); eng_tensor_release(h); eng_tensor_release(one);
}

int main(void) {
  eng_runtime_init();
  int64_t live0 = eng_tensor_live_count();
  test_allocator();
  test_errors();
  test_autograd();
  test_module_hooks();
  test_views_and_copy();
  CHECK(eng_tensor_live_count() == live0, "no tensor leaked (%lld live)", (long long)(eng_tensor_live_count() - live0));
  printf("%d passed, %d failed\n", g_pass, g_fail);
  return g_fail ? 1 : 0;
}
