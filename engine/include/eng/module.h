/* module.h: module objects that own forward hooks.
 *
 * The Lua nn.Module holds one of these.  Forward-pre hooks run on the inputs
 * before forward, forward-post hooks on the outputs after it; a hook may
 * replace tensors in place in the array (release the old reference, store a
 * new one).  FSDP registers C hooks here; user Lua hooks go through the Lua
 * dispatcher (kind 3) so that C and Lua hooks run in one registration order.
 */
#ifndef ENG_MODULE_H
#define ENG_MODULE_H
#include <stdint.h>
#include <stddef.h>
#include "tensor.h"

typedef struct eng_module eng_module;
typedef int (*eng_module_hook_fn)(eng_module* m, int kind, eng_tensor** tensors, int n, void* ud);

enum { ENG_HOOK_FORWARD_PRE = 0, ENG_HOOK_FORWARD_POST = 1 };

eng_module* eng_module_new(const char* name);
void eng_module_retain(eng_module* m);
void eng_module_release(eng_module* m);
const char* eng_module_name(const eng_module* m);
/* Returns a handle > 0, or -1. prepend puts the hook first. */
int64_t eng_module_register_hook(eng_module* m, int kind, eng_module_hook_fn fn, void* ud, int prepend);
int64_t eng_module_register_lua_hook(eng_module* m, int kind, int64_t id, int prepend);
int eng_module_remove_hook(eng_module* m, int64_t handle);
int eng_module_hook_count(const eng_module* m, int kind);
/* Runs the hooks of one kind over tensors[0..n). */
int eng_module_run_hooks(eng_module* m, int kind, eng_tensor** tensors, int n);

#endif
