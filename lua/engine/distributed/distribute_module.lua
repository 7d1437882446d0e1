-- engine.distributed.distribute_module: PyTorch's distribute_module.
--
--   dist.distribute_module(model, mesh, partition_fn, input_fn, output_fn)
--
-- partition_fn(name, submodule, mesh) runs on every submodule (model first,
-- named as by named_modules: "" for the model, then "seq.0", ...); it may
-- replace parameters with DTensors, e.g.
--   m:register_parameter(pname, nn.Parameter(dist.distribute_tensor(p, mesh, {dist.Shard(1)})))
-- After it, every remaining plain parameter and buffer of that submodule is
-- replicated over the mesh (Replicate() on each mesh dim); without
-- partition_fn every parameter and buffer is replicated.  Parameters stay
-- registered parameters with their requires_grad.
-- input_fn(module, inputs, mesh) becomes a forward pre-hook (inputs: the list of
-- tensor arguments; return nil, a tensor or a list to replace them) and
-- output_fn(module, outputs, mesh) a forward hook (outputs: the output tensor, or
-- the list of outputs).  Two-argument functions (inputs, mesh) / (outputs, mesh)
-- are deprecated (a FutureWarning, see set_warning_handler); other arities are errors.  A
-- second call on the same module is an error.  Returns the module.
local core = require("engine.core")
local meshmod = require("engine.distributed.mesh")
local dtensor = require("engine.distributed.dtensor")
local P = require("engine.distributed.placements")
local C = core.C

local M = {}

local function nparams(fn)
  local info = debug.getinfo(fn, "u")
  return info.nparams, info.isvararg
end

-- Warnings go through a replaceable handler(category, message).  The default
-- writes "category: message" to stderr, once per message (as Python's default
-- warnings filter does); dist.set_warning_handler(fn) installs fn (nil: the
-- default again), which then sees every warning, and returns the previous one.
local warned = {}
local function default_warning_handler(category, message)
  local line = category .. ": " .. message
  if warned[line] then return end
  warned[line] = true
  io.stderr:write(line .. "\n")
end
local warning_handler = default_warning_handler

function M.set_warning_handler(fn)
  if fn ~= nil and type(fn) ~= "function" then
    core.fail("set_warning_handler: expected a function(category, message) or nil, got " .. type(fn))
  end
  local prev = warning_handler
  warning_handler = fn or default_warning_handler
  return prev
end

-- Issues a warning through the handler (used by parallelize_module too).
function M._warn(category, message) warning_handler(category, message) end

local function deprecate(what)
  warning_handler("FutureWarning", string.format("Deprecating %s that takes two arguments (inputs/outputs, device_mesh), "
    .. "please use %s that takes in (module, inputs/outputs, device_mesh) instead!", what, what))
end

local function replicate_params_buffers(m, mesh)
  local ndim = mesh:ndim()
  local full = {}
  for i = 1, ndim do full[i] = P.Replicate() end
  local params = rawget(m, "_parameters")
  for _, name in ipairs(rawget(m, "_param_names")) do
    local p = params[name]
    if p ~= nil and p._c.dist == nil then
      local rg = p._c.requires_grad ~= 0
      local d = dtensor.distribute_tensor(p:detach(), mesh, full)
      d._c.is_param = 1
      if rg then core.check(C.eng_tensor_set_requires_grad(d._c, 1), 3) end
      params[name] = d
    end
  end
  local bufs = rawget(m, "_buffers")
  for _, name in ipairs(rawget(m, "_buffer_names")) do
    local b = bufs[name]
    if b ~= nil and b._c.dist == nil then bufs[name] = dtensor.distribute_tensor(b:detach(), mesh, full) end
  end
end

local function hook_fn(fn, what, mesh)
  if fn == nil then return nil end
  if type(fn) ~= "function" then core.fail(string.format("distribute_module: %s must be a function, got %s", what, type(fn))) end
  local n, vararg = nparams(fn)
  if n == 3 or (vararg and n < 3) then
    return function(mod, xs) return fn(mod, xs, mesh) end
  elseif n == 2 then
    deprecate(what)
    return function(_, xs) return fn(xs, mesh) end
  end
  core.fail(string.format("distribute_module: %s should take in 3 arguments, but got %d arguments!", what, n))
end

function M.distribute_module(module, mesh, partition_fn, input_fn, output_fn)
  local op = "distribute_module"
  local nn = require("engine.nn")
  if not nn.is_module(module) then core.fail(op .. ": expected an nn.Module, got " .. type(module)) end
  if rawget(module, "_distribute_module_applied") then
    core.fail(op .. ": distribute_module should only be called once on a module, but it has already been called on "
      .. "this module!")
  end
  if not meshmod.is_mesh(mesh) then
    core.fail(op .. ": device_mesh must be a DeviceMesh (dist.init_device_mesh), got " .. type(mesh))
  end
  if partition_fn ~= nil and type(partition_fn) ~= "function" then
    core.fail(op .. ": partition_fn must be a function(name, module, mesh), got " .. type(partition_fn))
  end
  local pre = hook_fn(input_fn, "input_fn", mesh)
  local post = hook_fn(output_fn, "output_fn", mesh)
  for name, sub in module:named_modules() do
    if partition_fn ~= nil then partition_fn(name, sub, mesh) end
    replicate_params_buffers(sub, mesh)
  end
  if pre then module:register_forward_pre_hook(pre) end
  if post then
    module:register_forward_hook(function(mod, _, ...)
      local outs = { ... }
      if select("#", ...) == 1 then return post(mod, outs[1]) end
      return post(mod, outs)
    end)
  end
  rawset(module, "_distribute_module_applied", true)
  return module
end

return M
