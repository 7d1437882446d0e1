-- engine.optim.clip: gradient clipping and norms (one fused C pass over all
-- tensors).  Also exported as nn.utils.clip_grad_norm_.  clip_grad_norm_ and grad_norm return the
-- norm as PyTorch does, a 0-dim tensor; global_norm (the engine's own) returns a number.
local core = require("engine.core")
local ffi, C = core.ffi, core.C
local is_tensor = core.is_tensor

local M = {}

local function tensors_of(params, op)
  local list = {}
  if is_tensor(params) then list[1] = params
  elseif type(params) == "function" then for a, b in params do list[#list + 1] = b ~= nil and b or a end
  elseif type(params) == "table" then for i = 1, #params do list[i] = params[i] end
  else error(op .. ": expected a tensor, a list of tensors or an iterator, got " .. type(params), 3) end
  for i, t in ipairs(list) do
    if not is_tensor(t) then error(string.format("%s: element %d is a %s, not a tensor", op, i, type(t)), 3) end
  end
  return list
end

local function norm_type(p, op)
  if p == nil then return 2 end
  if p == "inf" or p == math.huge then return math.huge end
  if type(p) ~= "number" or p <= 0 then
    error(op .. ": norm_type must be a positive number or \"inf\", got " .. tostring(p), 3)
  end
  return p
end

local out = ffi.new("double[1]")

local CLIP_OPTS = { error_if_nonfinite = true, foreach = true }

-- The 4th argument: PyTorch's positional error_if_nonfinite (a boolean) or an options table
-- {error_if_nonfinite = false, foreach = nil} (foreach is accepted and ignored: one fused pass either way).
local function nonfinite_arg(o, op)
  if o == nil then return false end
  if type(o) == "boolean" then return o end
  if type(o) ~= "table" or is_tensor(o) then
    error(op .. ": the 4th argument is error_if_nonfinite (a boolean) or an options table, got " .. type(o), 3)
  end
  for k in pairs(o) do
    if not CLIP_OPTS[k] then
      error(string.format("%s: unknown option '%s' (known: error_if_nonfinite, foreach)", op, tostring(k)), 3)
    end
  end
  return o.error_if_nonfinite == true
end

local function param_array(list)
  local arr = ffi.new("eng_tensor*[?]", #list > 0 and #list or 1)
  for i, t in ipairs(list) do arr[i - 1] = t._c end
  return arr
end

-- The norm tensor C made (a new plain 0-dim tensor): a Replicate DTensor on the mesh of the first
-- parameter whose gradient is a DTensor, as PyTorch's norm of DTensor gradients is one.
local function norm_result(c, list, level)
  if c == nil then error(core.last_error(), level + 1) end
  local t = core.wrap(c, level + 1)
  for _, p in ipairs(list) do
    local pc = p._c
    local spec = pc.dist ~= nil and pc.dist or (pc.grad ~= nil and pc.grad.dist or nil)
    if spec ~= nil then
      return core.wrap(C.eng_dtensor_from_local(t._c, spec.mesh, spec.mesh_ndim, nil, 0, nil, nil), level + 1)
    end
  end
  return t
end

-- clip_grad_norm_(params, max_norm [, norm_type = 2 [, error_if_nonfinite = false | {error_if_nonfinite, foreach}]])
-- torch.nn.utils.clip_grad_norm_: scales the gradients in place so that their total norm is at most
-- max_norm (scale max_norm / (total + 1e-6), applied only when below 1) and returns the total norm before
-- clipping as a 0-dim tensor (f32, f64 for f64 gradients, on the gradients' device; a Replicate DTensor
-- when the gradients are DTensors: total:item() reads it on every rank).  Parameters without a gradient
-- are skipped.  error_if_nonfinite: a NaN or infinite norm is an error and nothing is scaled.
function M.clip_grad_norm_(params, max_norm, p, o)
  local op = "clip_grad_norm_"
  local list = tensors_of(params, op)
  if type(max_norm) ~= "number" then error(op .. ": max_norm must be a number, got " .. type(max_norm), 2) end
  p = norm_type(p, op)
  local nonfinite = nonfinite_arg(o, op)
  -- every parameter goes to C, with or without a gradient: the all_reduces over DTensor shards follow
  -- the parameters' layouts, the same on every rank even where one rank has no gradient
  local arr = param_array(list)
  local prev = C.eng_set_grad_enabled(0)
  local c = C.eng_clip_grad_norm_tensor(#list, arr, max_norm, p, nonfinite and 1 or 0)
  C.eng_set_grad_enabled(prev)
  return norm_result(c, list, 2)
end
M.clip_grad_norm = M.clip_grad_norm_

-- global_norm(tensors [, norm_type = 2]): the norm of all tensors' values as if concatenated.
function M.global_norm(tensors, p)
  local list = tensors_of(tensors, "global_norm")
  p = norm_type(p, "global_norm")
  local n = #list
  if n == 0 then return 0 end
  local arr = ffi.new("eng_tensor*[?]", n)
  for i = 1, n do arr[i - 1] = list[i]._c end
  if C.eng_global_norm(n, arr, p, out) ~= 0 then error(core.last_error(), 2) end
  return out[0]
end

-- grad_norm(params [, norm_type = 2 [, error_if_nonfinite = false]]): the total norm of the gradients
-- as clip_grad_norm_ returns it (a 0-dim tensor, a Replicate DTensor for DTensor gradients; the same
-- reductions), without clipping: torch.nn.utils.get_total_norm of the parameters' gradients.
function M.grad_norm(params, p, o)
  local op = "grad_norm"
  local list = tensors_of(params, op)
  p = norm_type(p, op)
  local nonfinite = nonfinite_arg(o, op)
  local arr = param_array(list)
  local prev = C.eng_set_grad_enabled(0)
  local c = C.eng_grad_norm_tensor(#list, arr, p, nonfinite and 1 or 0)
  C.eng_set_grad_enabled(prev)
  return norm_result(c, list, 2)
end

-- clip_grad_value_(params, clip_value): clamps every gradient to [-v, v] in place.
function M.clip_grad_value_(params, clip_value)
  local list = tensors_of(params, "clip_grad_value_")
  if type(clip_value) ~= "number" then error("clip_grad_value_: clip_value must be a number", 2) end
  local prev = C.eng_set_grad_enabled(0)
  for _, t in ipairs(list) do
    if t._c.grad ~= nil then
      local rc = C.eng_clamp_(t._c.grad, -clip_value, clip_value)
      if rc ~= 0 then C.eng_set_grad_enabled(prev); error(core.last_error(), 2) end
    end
  end
  C.eng_set_grad_enabled(prev)
end

return M
