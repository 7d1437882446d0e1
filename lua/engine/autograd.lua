-- engine.autograd: backward, grad mode, tensor hooks and Lua autograd
-- functions.  All Lua callbacks from C go through one FFI callback (the
-- dispatcher); the Lua functions that call into C code which may call back
-- are excluded from JIT compilation (jit.off), since a C->Lua callback from
-- a compiled trace is a fatal "bad callback" in LuaJIT.
local core = require("engine.core")
local Tensor = require("engine.tensor")
local ffi, C = core.ffi, core.C
local wrap, ct, check = core.wrap, core.ct, core.check
local methods = Tensor.methods

local M = {}

-- ---------------------------------------------------------------- closures
local closures = {}
local next_id = 0
local released = ffi.new("int64_t[256]")

local function collect_released()
  while true do
    local n = C.eng_lua_released(released, 256)
    for i = 0, n - 1 do closures[tonumber(released[i])] = nil end
    if n < 256 then break end
  end
end

local function register(fn)
  collect_released()
  next_id = next_id + 1
  closures[next_id] = fn
  return next_id
end
M._register = register
M._closures = closures

local function borrow(p) return core.wrap_borrowed(p) end

-- kind 0: tensor hook (grad -> new grad or nil); 1: post-accumulate (tensor);
-- 2: Function backward (grads of outputs -> grads of inputs); 3: module hook.
local function dispatch(kind, id, n_in, inp, n_out, out)
  local fn = closures[tonumber(id)]
  if not fn then
    C.eng_set_error_message("engine: Lua closure " .. tostring(id) .. " was released")
    return -1
  end
  local ok, err = pcall(function()
    local args = {}
    for i = 0, n_in - 1 do args[i + 1] = borrow(inp[i]) end
    local res = { fn(unpack(args, 1, n_in)) }
    if kind == 3 and type(res[1]) == "table" and not core.is_tensor(res[1]) then res = res[1] end
    for i = 0, n_out - 1 do
      local r = res[i + 1]
      if r ~= nil then
        if not core.is_tensor(r) then
          core.fail(string.format("hook returned a %s where a tensor or nil was expected", type(r)))
        end
        out[i] = C.eng_tensor_retain(r._c)
      end
    end
  end)
  if not ok then
    C.eng_set_error_message(tostring(err))
    for i = 0, n_out - 1 do
      if out[i] ~= nil then C.eng_tensor_release(out[i]); out[i] = nil end
    end
    return -1
  end
  return 0
end

local dispatcher = ffi.cast("eng_lua_dispatch_fn", dispatch)
C.eng_set_lua_dispatcher(dispatcher)

-- ---------------------------------------------------------------- grad mode
function M.is_grad_enabled() return C.eng_grad_enabled() ~= 0 end
function M.set_grad_enabled(flag) return C.eng_set_grad_enabled(flag and 1 or 0) ~= 0 end

local function with_mode(flag, fn, ...)
  local prev = C.eng_set_grad_enabled(flag)
  local res = { pcall(fn, ...) }
  C.eng_set_grad_enabled(prev)
  if not res[1] then core.fail(res[2]) end
  return unpack(res, 2, table.maxn(res))
end

-- no_grad(fn, ...) runs fn with gradient recording off and returns its results.
function M.no_grad(fn, ...) return with_mode(0, fn, ...) end
function M.enable_grad(fn, ...) return with_mode(1, fn, ...) end

-- ---------------------------------------------------------------- backward
local function tensor_list(x, op)
  if core.is_tensor(x) then return { x } end
  if type(x) ~= "table" then core.fail(op .. ": expected a tensor or a list of tensors") end
  return x
end

-- backward(tensors, grad_tensors, {retain_graph = false})
function M.backward(tensors, grads, opts)
  tensors = tensor_list(tensors, "backward")
  local n = #tensors
  local ts = ffi.new("eng_tensor*[?]", n)
  local gs = ffi.new("eng_tensor*[?]", n)
  for i = 1, n do
    ts[i - 1] = ct(tensors[i], "backward", i)
    local g = grads and (core.is_tensor(grads) and (i == 1 and grads or nil) or grads[i])
    gs[i - 1] = g and ct(g, "backward", i) or nil
  end
  local retain = opts and opts.retain_graph and 1 or 0
  core.gc_backward()
  local rc = C.eng_backward(n, ts, gs, retain, 0, nil, nil)
  collect_released()
  if rc ~= 0 then core.fail(core.last_error()) end
end
jit.off(M.backward)

local grad_opts = { grad_outputs = true, retain_graph = true, create_graph = true, allow_unused = true,
  materialize_grads = true }

-- grad(outputs, inputs [, {grad_outputs =, retain_graph = false, create_graph = false, allow_unused = false,
-- materialize_grads = false}]) -> list of the gradients of outputs w.r.t. inputs (PyTorch's
-- torch.autograd.grad; first order: create_graph = true is refused, the backward formulas run without
-- recording).  An input the outputs do not depend on is an error unless allow_unused (its entry is
-- then nil, or zeros with materialize_grads).  The older form grad(outputs, inputs, grad_outputs
-- [, opts]) passes grad_outputs positionally.  .grad fields are left untouched.
function M.grad(outputs, inputs, grad_outputs, opts)
  if type(grad_outputs) == "table" and not core.is_tensor(grad_outputs) and grad_outputs[1] == nil
      and getmetatable(grad_outputs) == nil then
    opts, grad_outputs = grad_outputs, grad_outputs.grad_outputs
  end
  opts = opts or {}
  if type(opts) ~= "table" then core.fail("grad: options must be a table, got " .. type(opts)) end
  for k in pairs(opts) do
    if not grad_opts[k] then
      core.fail("grad: unknown option '" .. tostring(k) ..
        "' (grad_outputs, retain_graph, create_graph, allow_unused, materialize_grads)")
    end
  end
  if opts.create_graph then
    core.fail("grad: create_graph = true is not supported: the engine computes first-order gradients (backward " ..
      "formulas run without recording a graph of their own)")
  end
  local allow_unused = opts.allow_unused or opts.materialize_grads
  outputs = tensor_list(outputs, "grad")
  inputs = tensor_list(inputs, "grad")
  local n, m = #outputs, #inputs
  local ts = ffi.new("eng_tensor*[?]", n)
  local gs = ffi.new("eng_tensor*[?]", n)
  for i = 1, n do
    ts[i - 1] = ct(outputs[i], "grad", i)
    local g = grad_outputs and (core.is_tensor(grad_outputs) and (i == 1 and grad_outputs or nil) or grad_outputs[i])
    gs[i - 1] = g and ct(g, "grad", i) or nil
  end
  local ins = ffi.new("eng_tensor*[?]", m)
  local outs = ffi.new("eng_tensor*[?]", m)
  for i = 1, m do ins[i - 1] = ct(inputs[i], "grad", i) end
  local retain = opts and opts.retain_graph and 1 or 0
  core.gc_backward()
  local rc = C.eng_backward(n, ts, gs, retain, m, ins, outs)
  collect_released()
  if rc ~= 0 then core.fail(core.last_error()) end
  local res = {}
  for i = 1, m do res[i] = outs[i - 1] ~= nil and wrap(outs[i - 1]) or nil end
  for i = 1, m do
    if res[i] == nil then
      if not allow_unused then
        core.fail(string.format("grad: input %d (%s[%s]) was not used in the graph of the outputs; pass " ..
          "allow_unused = true if that is intended", i, inputs[i].dtype, table.concat(inputs[i]:shape(), ",")))
      elseif opts.materialize_grads then
        res[i] = Tensor.functions.zeros_like(inputs[i])
      end
    end
  end
  return res
end
jit.off(M.grad)

function methods.backward(t, grad, opts)
  if core.is_tensor(opts) or (type(grad) == "table" and not core.is_tensor(grad)) then
    opts, grad = grad, nil
  end
  if opts ~= nil and type(opts) ~= "table" then
    core.fail(string.format("backward: options must be a table ({retain_graph = true}), got %s", type(opts)))
  end
  opts = core.check_opts(opts, { "retain_graph" }, "backward")
  if grad ~= nil and not core.is_tensor(grad) then
    core.fail(string.format("backward: gradient must be a tensor or nil, got %s", type(grad)))
  end
  local ts = ffi.new("eng_tensor*[1]", ct(t, "backward", 1))
  local gs = ffi.new("eng_tensor*[1]", grad and ct(grad, "backward", 1) or nil)
  core.gc_backward()
  local rc = C.eng_backward(1, ts, gs, opts and opts.retain_graph and 1 or 0, 0, nil, nil)
  collect_released()
  if rc ~= 0 then core.fail(core.last_error()) end
end
jit.off(methods.backward)

function methods.requires_grad_(t, flag)
  if flag == nil then flag = true end
  check(C.eng_tensor_set_requires_grad(t._c, flag and 1 or 0))
  return t
end

function methods.retain_grad(t) check(C.eng_tensor_retain_grad(t._c)); return t end

-- Hook handles: h:remove().
local Handle = {}
Handle.__index = Handle
function Handle:remove()
  if self.removed then return end
  self.removed = true
  self._remove()
end

-- register_hook(fn): fn(grad) -> new grad or nil.
function methods.register_hook(t, fn)
  if type(fn) ~= "function" then core.fail("register_hook: expected a function") end
  local id = register(fn)
  local h = C.eng_tensor_register_lua_hook(t._c, id, 0)
  if h < 0 then closures[id] = nil; core.fail(core.last_error()) end
  local c = t._c
  return setmetatable({ _remove = function() C.eng_tensor_remove_hook(c, h) end }, Handle)
end

-- register_post_accumulate_grad_hook(fn): fn(tensor) after .grad was updated.
function methods.register_post_accumulate_grad_hook(t, fn)
  if type(fn) ~= "function" then core.fail("register_post_accumulate_grad_hook: expected a function") end
  local id = register(fn)
  local h = C.eng_tensor_register_lua_hook(t._c, id, 1)
  if h < 0 then closures[id] = nil; core.fail(core.last_error()) end
  local c = t._c
  return setmetatable({ _remove = function() C.eng_tensor_remove_hook(c, h) end }, Handle)
end
M.Handle = Handle

-- ---------------------------------------------------------------- Lua autograd functions
-- local Square = autograd.Function{
--   forward = function(ctx, x) ctx:save_for_backward(x); return x * x end,
--   backward = function(ctx, g) local x = ctx.saved_tensors[1]; return g * 2 * x end }
-- ctx.saved_tensors is PyTorch's name for what save_for_backward stored (ctx.saved is the same list).
-- y = Square(x)   -- or Square.apply(x)
-- forward runs without recording; tensors among its arguments are the inputs
-- whose gradients backward returns (in order).
local Function = {}
Function.__index = Function

local function fn_apply(def, ...)
  local args = { ... }
  local nargs = select("#", ...)
  local inputs = {}
  for i = 1, nargs do if core.is_tensor(args[i]) then inputs[#inputs + 1] = args[i] end end
  local ctx = { saved = {}, needs_input_grad = {} }
  ctx.saved_tensors = ctx.saved
  function ctx:save_for_backward(...)
    local list = { ... }
    self.saved, self.saved_tensors = list, list
  end
  for i, x in ipairs(inputs) do ctx.needs_input_grad[i] = x.requires_grad end
  local prev = C.eng_set_grad_enabled(0)
  local res = { pcall(def.forward, ctx, unpack(args, 1, nargs)) }
  C.eng_set_grad_enabled(prev)
  if not res[1] then core.fail(res[2]) end
  table.remove(res, 1)
  local outs = {}
  for i, r in ipairs(res) do if core.is_tensor(r) then outs[#outs + 1] = r end end
  if #outs == 0 then return unpack(res) end
  -- outputs must not alias inputs' autograd identity: give each a fresh view
  for i, r in ipairs(res) do
    if core.is_tensor(r) then
      for _, x in ipairs(inputs) do if rawequal(r, x) then res[i] = r:detach() end end
    end
  end
  outs = {}
  for i, r in ipairs(res) do if core.is_tensor(r) then outs[#outs + 1] = r end end
  local nin, nout = #inputs, #outs
  local id = register(function(...)
    local grads = { ... }
    local gi = { def.backward(ctx, unpack(grads, 1, nout)) }
    return unpack(gi, 1, nin)
  end)
  local ins = ffi.new("eng_tensor*[?]", nin > 0 and nin or 1)
  for i = 1, nin do ins[i - 1] = inputs[i]._c end
  local os = ffi.new("eng_tensor*[?]", nout)
  for i = 1, nout do os[i - 1] = outs[i]._c end
  if C.eng_lua_function_attach(id, nin, ins, nout, os) ~= 0 then core.fail(core.last_error()) end
  return unpack(res)
end

function M.Function(def)
  if type(def) ~= "table" or type(def.forward) ~= "function" or type(def.backward) ~= "function" then
    core.fail("autograd.Function: expected a table with forward(ctx, ...) and backward(ctx, ...)")
  end
  local f = setmetatable({ forward = def.forward, backward = def.backward }, Function)
  f.apply = function(...) return fn_apply(f, ...) end
  return f
end
Function.__call = function(f, ...) return fn_apply(f, ...) end

-- ---------------------------------------------------------------- full backward hooks on modules
-- register_full_backward_hook(module, fn [, {prepend}]) (Module:register_full_backward_hook):
-- fn(module, grad_input, grad_output) runs when the gradients w.r.t. the module's tensor inputs have
-- been computed; grad_input / grad_output are lists with one entry per tensor input / output (nil where
-- there is none, e.g. an input that does not require grad).  It may return a list replacing grad_input
-- (nil entries keep).  When no input requires grad it runs once the output gradients are known, and its
-- result is ignored (PyTorch's BackwardHook).  Built from a forward pre-hook that routes the inputs
-- through an identity Function and a forward hook that routes the outputs through another one.
-- identity on its tensor arguments; its backward hands the output gradients to cb and returns what cb returns
local HookIdentity = M.Function({
  forward = function(ctx, cb, ...) ctx.cb = cb; return ... end,
  backward = function(ctx, ...) return ctx.cb(...) end,
})
local function identity_apply(list, cb) return { HookIdentity(cb, unpack(list, 1, #list)) } end

function M.register_full_backward_hook(module, fn, opts)
  if type(fn) ~= "function" then core.fail("register_full_backward_hook: expected a function") end
  local ref = setmetatable({ m = module }, { __mode = "v" })
  local pending = {}   -- per call in flight: forward pre-hook pushes, forward hook pops
  local h1 = module:register_forward_pre_hook(function(_, inputs)
    local st = { n_in = #inputs }
    pending[#pending + 1] = st
    local idx, grad_in = {}, {}
    for i = 1, #inputs do
      if inputs[i].requires_grad and M.is_grad_enabled() then idx[#idx + 1] = i end
    end
    if #idx == 0 then return nil end
    st.wrapped_inputs = true
    local sub = {}
    for j, i in ipairs(idx) do sub[j] = inputs[i] end
    local wrapped = identity_apply(sub, function(...)
      local gs = { ... }
      for i = 1, st.n_in do grad_in[i] = nil end
      for j, i in ipairs(idx) do grad_in[i] = gs[j] end
      local r = fn(ref.m, grad_in, st.grad_output or {})
      if r ~= nil then
        if core.is_tensor(r) then r = { r } end
        if type(r) ~= "table" then
          core.fail("full backward hook: must return nil or a list of gradients, got " .. type(r))
        end
        for j, i in ipairs(idx) do if r[i] ~= nil then gs[j] = r[i] end end
      end
      return unpack(gs, 1, #idx)
    end)
    local out = {}
    for j, i in ipairs(idx) do out[i] = wrapped[j] end
    return out
  end, opts)
  local h2 = module:register_forward_hook(function(_, _, ...)
    local st = table.remove(pending)
    if not st then return nil end
    local outs = { ... }
    if #outs == 1 and type(outs[1]) == "table" and not core.is_tensor(outs[1]) then outs = outs[1] end
    local idx = {}
    for i = 1, table.maxn(outs) do
      if core.is_tensor(outs[i]) and outs[i].requires_grad then idx[#idx + 1] = i end
    end
    if #idx == 0 then return nil end
    local sub = {}
    for j, i in ipairs(idx) do sub[j] = outs[i] end
    local wrapped = identity_apply(sub, function(...)
      local gs = { ... }
      local go = {}
      for j, i in ipairs(idx) do go[i] = gs[j] end
      st.grad_output = go
      if not st.wrapped_inputs then fn(ref.m, {}, go) end
      return unpack(gs, 1, #idx)
    end)
    local rep = {}
    for j, i in ipairs(idx) do rep[i] = wrapped[j] end
    return rep
  end, opts)
  return setmetatable({ _remove = function() h1:remove(); h2:remove() end }, Handle)
end

return M
