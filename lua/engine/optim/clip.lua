-- engine.optim.clip: gradient clipping and norms (one fused C pass over all
-- tensors).  Also exported as nn.utils.clip_grad_norm_.
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

-- clip_grad_norm_(params, max_norm [, norm_type = 2 [, {error_if_nonfinite = false}]])
-- Scales the gradients in place so that their total norm is at most max_norm
-- (scale max_norm / (total + 1e-6), applied only when below 1) and returns the
-- total norm before clipping (a number).  Parameters without a gradient are skipped.
function M.clip_grad_norm_(params, max_norm, p, opts)
  local op = "clip_grad_norm_"
  local list = tensors_of(params, op)
  if type(max_norm) ~= "number" then error(op .. ": max_norm must be a number, got " .. type(max_norm), 2) end
  p = norm_type(p, op)
  local arr = ffi.new("eng_tensor*[?]", #list > 0 and #list or 1)
  local n = 0
  -- every parameter goes to C, with or without a gradient: the all_reduces over DTensor shards follow
  -- the parameters' layouts, the same on every rank even where one rank has no gradient
  for _, t in ipairs(list) do arr[n] = t._c; n = n + 1 end
  if n == 0 then return 0 end
  local prev = C.eng_set_grad_enabled(0)
  local rc = C.eng_clip_grad_norm_(n, arr, max_norm, p, out)
  C.eng_set_grad_enabled(prev)
  if rc ~= 0 then error(core.last_error(), 2) end
  local total = out[0]
  if opts and opts.error_if_nonfinite and (total ~= total or total == math.huge) then
    error(string.format("%s: the total norm of order %g of the gradients is non-finite, so it cannot be clipped",
      op, p), 2)
  end
  return total
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

-- grad_norm(params [, norm_type = 2]): the total norm of the gradients (no clipping).
function M.grad_norm(params, p)
  local list = tensors_of(params, "grad_norm")
  p = norm_type(p, "grad_norm")
  local arr = ffi.new("eng_tensor*[?]", #list > 0 and #list or 1)
  local n = 0
  for _, t in ipairs(list) do
    if t._c.grad ~= nil then arr[n] = t._c.grad; n = n + 1 end
  end
  if n == 0 then return 0 end
  if C.eng_global_norm(n, arr, p, out) ~= 0 then error(core.last_error(), 2) end
  return out[0]
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
