-- engine.ops.reduce: sum, mean, max, min, argmax, argmin, sum_to_size.
--
--   t:sum()                     all elements -> 0-d tensor
--   t:sum(2)                    over dim 2 (dims are 1-based; -1 = last)
--   t:sum({1, 3}, true)         over dims 1 and 3, keeping them as size 1
--   t:sum(2, {keepdim = true})  same keepdim flag as an options table
--   t:mean(...)                 same forms; floating tensors only
--   t:max()                     max over all elements (0-d tensor)
--   t:max(dim [, keepdim])      values, indices along dim
--   t:max(other_tensor)         elementwise maximum (as torch.max(a, b))
--   t:argmax() / t:argmax(dim [, keepdim]), argmin likewise
--   t:sum_to_size(2, 1) / t:sum_to_size({2, 1})   reverse of broadcasting
--
-- Indices (max/min/argmax/argmin) are i64 tensors holding 0-BASED positions,
-- exactly as PyTorch returns them: they are data (to feed gather, compare
-- with targets, save), not Lua dims.  Add 1 to use one as a Lua index.
-- Sums of integer or bool tensors give i64; mean of them is an error.
local core = require("engine.core")
local Tensor = require("engine.tensor")
local ffi, C = core.ffi, core.C
local wrap, ct = core.wrap, core.ct
local methods = Tensor.methods

local M = {}

local dims_buf = ffi.new("int[8]")

-- keepdim from a boolean or {keepdim = bool}.
local function keepdim_arg(k, op)
  if k == nil then return 0 end
  if type(k) == "boolean" then return k and 1 or 0 end
  if type(k) == "table" and not core.is_tensor(k) then return k.keepdim and 1 or 0 end
  error(string.format("%s: keepdim must be a boolean or {keepdim = bool}, got %s", op, type(k)), 4)
end

-- dims from nil (all), a number or a list of numbers (1-based).
local function dims_arg(t, d, op)
  local nd = t._c.ndim
  if d == nil then return 0 end
  if type(d) == "number" then
    dims_buf[0] = core.dim(d, nd, op, 0, 5)
    return 1
  end
  if type(d) == "table" and not core.is_tensor(d) then
    local n = #d
    if n == 0 then error(op .. ": empty dims list (omit it to reduce over all dims)", 4) end
    if n > 8 then error(string.format("%s: %d dims given; at most 8", op, n), 4) end
    local seen = {}
    for i = 1, n do
      local cd = core.dim(d[i], nd, op, 0, 5)
      if seen[cd] then
        error(string.format("%s: dim %d appears more than once in the dims list (dims are 1-based)", op, cd + 1), 4)
      end
      seen[cd] = true
      dims_buf[i - 1] = cd
    end
    return n
  end
  error(string.format("%s: dim must be a number or a list of numbers, got %s", op, type(d)), 4)
end

local function reducer(name, cfun)
  return function(t, d, keepdim)
    local c = ct(t, name, 1)
    if type(d) == "table" and not core.is_tensor(d) and d[1] == nil and keepdim == nil then
      -- t:sum{keepdim = true} style: options only
      keepdim, d = d, d.dim
    end
    local n = dims_arg(t, d, name)
    return wrap(cfun(c, n, dims_buf, keepdim_arg(keepdim, name)))
  end
end
methods.sum = reducer("sum", C.eng_sum)
methods.mean = reducer("mean", C.eng_mean)
M.sum, M.mean = methods.sum, methods.mean

local idx_out = ffi.new("eng_tensor*[1]")

local function extreme(name, all_fun, dim_fun, elementwise)
  return function(t, d, keepdim)
    local c = ct(t, name, 1)
    if d == nil then return wrap(all_fun(c)) end
    if core.is_tensor(d) then return elementwise(t, d) end
    if type(d) ~= "number" then error(string.format("%s: dim must be a number, got %s", name, type(d)), 2) end
    local cd = core.dim(d, t._c.ndim, name, 0, 3)
    idx_out[0] = nil
    local v = dim_fun(c, cd, keepdim_arg(keepdim, name), idx_out)
    if v == nil then error(core.last_error(), 2) end
    local values = wrap(v)
    local indices = wrap(idx_out[0])
    idx_out[0] = nil
    return values, indices
  end
end
methods.max = extreme("max", C.eng_max_all, C.eng_max_dim, function(a, b) return methods.maximum(a, b) end)
methods.min = extreme("min", C.eng_min_all, C.eng_min_dim, function(a, b) return methods.minimum(a, b) end)
M.max, M.min = methods.max, methods.min

-- argmax(t) over all elements (row-major position, 0-based) or along dim.
function methods.argmax(t, d, keepdim)
  local c = ct(t, "argmax", 1)
  if d == nil then return wrap(C.eng_argmax_all(c)) end
  return wrap(C.eng_argmax(c, core.dim(d, c.ndim, "argmax", 0, 3), keepdim_arg(keepdim, "argmax")))
end
function methods.argmin(t, d, keepdim)
  local c = ct(t, "argmin", 1)
  if d == nil then
    if c.numel == 0 then
      error(string.format("argmin: %s[%s] is empty; argmin over all elements needs at least one element",
        core.dtype_names[c.dtype], table.concat(t:shape(), ",")), 2)
    end
    local flat = t:contiguous():reshape(tonumber(c.numel))
    return wrap(C.eng_argmin(flat._c, 0, 0))
  end
  return wrap(C.eng_argmin(c, core.dim(d, c.ndim, "argmin", 0, 3), keepdim_arg(keepdim, "argmin")))
end
M.argmax, M.argmin = methods.argmax, methods.argmin

-- sum_to_size(2, 1) or sum_to_size({2, 1}): sums broadcast dims away.
function methods.sum_to_size(t, ...)
  local c = ct(t, "sum_to_size", 1)
  local n, arr = core.shape_arg("sum_to_size", ...)
  local r = C.eng_sum_to_shape(c, n, arr)
  if r == nil then error((core.last_error():gsub("^sum_to_shape:", "sum_to_size:")), 2) end
  return wrap(r)
end
M.sum_to_size = methods.sum_to_size

return M
