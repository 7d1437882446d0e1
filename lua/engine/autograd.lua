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
  local rc = C.eng_backward(n, ts, gs, retain, 0, nil, nil)
  collect_released()
  if rc ~= 0 then core.fail(core.last_error()) end
end
jit.off(M.backward)

-- grad(outputs, inputs, grad_outputs, {retain_graph}) -> list of gradients
-- (nil where an input got none); .grad fields are left untouched.
function M.grad(outputs, inputs, grad_outputs, opts)
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
  local rc = C.eng_backward(n, ts, gs, retain, m, ins, outs)
  collect_released()
  if rc ~= 0 then core.fail(core.last_error()) end
  local res = {}
  for i = 1, m do res[i] = outs[i - 1] ~= nil and wrap(outs[i - 1]) or nil end
  return res
end
jit.off(M.grad)

function methods.backward(t, grad, opts)
  if core.is_tensor(opts) or (type(grad) == "table" and not core.is_tensor(grad)) then
    opts, grad = grad, nil
  end
  local ts = ffi.new("eng_tensor*[1]", ct(t, "backward", 1))
  local gs = ffi.new("eng_tensor*[1]", grad and ct(grad, "backward", 1) or nil)
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
--   backward = function(ctx, g) local x = ctx.saved[1]; return g * 2 * x end }
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
  function ctx:save_for_backward(...) self.saved = { ... } end
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

return M
