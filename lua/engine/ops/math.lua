-- engine.ops.math: more pointwise math, reductions, scans and sorting
-- (torch's pointwise math, reductions, scans and sorts).  Each op is a Tensor method and an engine function.
--
--   t:sin() cos floor ceil trunc sign erf log1p expm1 reciprocal square
--   t:round() / t:round(decimals) / t:round{decimals = 2}      half to even
--   t:isnan() isinf isfinite logical_not                        bool results
--   t:nan_to_num([nan [, posinf [, neginf]]]) or {nan =, posinf =, neginf =}
--   t:fmod(x) remainder(x) floor_divide(x)   x a tensor or a number (broadcasting)
--   t:logical_and(x) logical_or(x)
--   t:clamp(lo, hi) with tensor bounds (numbers and nil as before)
--   t:lerp(b, w)  w a number or a tensor;  t:addcmul(b, c [, v]) / t:addcdiv(b, c [, v])
--                 (also {value = v}) out of place
--   t:prod([dim [, keepdim]])  amax/amin/logsumexp([dims [, keepdim]])  all/any([dims [, keepdim]])
--   t:var([dims] [, {correction = 1, keepdim = false}]) or var(dims, unbiased, keepdim); std likewise
--   t:norm([p [, dims [, keepdim]]]) (p a number, math.huge, -math.huge or "fro")
--   engine.linalg.vector_norm(t [, ord = 2 [, dims [, keepdim]]]) or (t, {ord =, dim =, keepdim =})
--   t:cumsum(dim) cumprod(dim)
--   t:sort([dim = -1 [, descending]]) -> values, indices (also {dim =, descending =, stable =})
--   t:argsort([dim = -1 [, descending]])
--   t:topk(k [, dim = -1 [, largest = true [, sorted = true]]]) -> values, indices (sorted = false: PyTorch's order)
--   t:kthvalue(k [, dim = -1 [, keepdim]]) -> values, indices
--
-- Dims are 1-based (negative from the end); indices returned are i64 holding
-- 0-BASED positions as PyTorch returns them (see engine.ops.reduce).
local core = require("engine.core")
local Tensor = require("engine.tensor")
local ffi, C = core.ffi, core.C
local wrap, ct, check, fail = core.wrap, core.ct, core.check, core.fail
local methods = Tensor.methods

local M = {}
local NAN = 0 / 0

-- ---------------------------------------------------------------- unary
local function unary(name, cfun)
  local f = function(t) return wrap(cfun(ct(t, name, 1))) end
  methods[name] = f
  M[name] = f
end
for _, n in ipairs({ "sin", "cos", "floor", "ceil", "trunc", "sign", "erf", "log1p", "expm1", "reciprocal",
  "square", "isnan", "isinf", "isfinite", "logical_not" }) do
  unary(n, C["eng_" .. n])
end
methods.fix = methods.trunc
methods.special_erf = methods.erf

function methods.round(t, decimals)
  if type(decimals) == "table" then decimals = decimals.decimals end
  decimals = decimals or 0
  if type(decimals) ~= "number" or decimals % 1 ~= 0 then
    fail("round: decimals must be an integer, got " .. tostring(decimals))
  end
  return wrap(C.eng_round(ct(t, "round", 1), decimals))
end
M.round = methods.round

local function opt_num(v, what)
  if v == nil then return NAN end
  if type(v) ~= "number" then fail(string.format("nan_to_num: %s must be a number or nil, got %s", what, type(v))) end
  return v
end
function methods.nan_to_num(t, nan, posinf, neginf)
  if type(nan) == "table" then nan, posinf, neginf = nan.nan, nan.posinf, nan.neginf end
  local n = nan == nil and 0 or opt_num(nan, "nan")
  return wrap(C.eng_nan_to_num(ct(t, "nan_to_num", 1), n, opt_num(posinf, "posinf"), opt_num(neginf, "neginf")))
end
M.nan_to_num = methods.nan_to_num

-- ---------------------------------------------------------------- binary
-- A number next to a tensor becomes a 0-d tensor: the tensor's dtype when it
-- is floating or the number is integral (bool -> i64), else f32 (PyTorch's
-- promotion of Python scalars).
local function scalar_tensor(v, other, op)
  if type(v) == "boolean" then v = v and 1 or 0 end
  if type(v) ~= "number" then fail(string.format("%s: expected a tensor or a number, got %s", op, type(v))) end
  local od = other._c.dtype
  local dt = 0
  if C.eng_dtype_is_floating(od) ~= 0 then dt = od
  elseif v % 1 == 0 and v == v then dt = (od == 7) and 5 or od end
  local r = C.eng_tensor_full(0, nil, v, dt, other._c.device)
  return wrap(r)
end
M._scalar_tensor = scalar_tensor

local function operands(a, b, op)
  local ta, tb = core.is_tensor(a), core.is_tensor(b)
  if not ta and not tb then fail(op .. ": at least one argument must be a tensor") end
  if not ta then a = scalar_tensor(a, b, op) end
  if not tb then b = scalar_tensor(b, a, op) end
  return a._c, b._c
end
local function logical_scalar(v, other, op)
  if core.is_tensor(v) then return v end
  if type(v) == "boolean" then v = v and 1 or 0 end
  if type(v) ~= "number" then fail(string.format("%s: expected a tensor, number or boolean, got %s", op, type(v))) end
  return wrap(C.eng_tensor_full(0, nil, v, 7, other._c.device))
end
local function binary(name, cfun, logical)
  local f = function(a, b)
    if logical then
      if core.is_tensor(a) then b = logical_scalar(b, a, name)
      elseif core.is_tensor(b) then a = logical_scalar(a, b, name)
      else fail(string.format("%s: at least one argument must be a tensor, got %s and %s", name, type(a), type(b))) end
    end
    local ca, cb = operands(a, b, name)
    return wrap(cfun(ca, cb))
  end
  methods[name] = f
  M[name] = f
end
binary("fmod", C.eng_fmod)
binary("remainder", C.eng_remainder)
binary("floor_divide", C.eng_floor_divide)
binary("logical_and", C.eng_logical_and, true)
binary("logical_or", C.eng_logical_or, true)

-- ---------------------------------------------------------------- clamp with tensor bounds
local clamp_number = methods.clamp
function methods.clamp(t, lo, hi)
  if type(lo) == "table" and not core.is_tensor(lo) then
    core.check_opts(lo, { "min", "max" }, "clamp")
    lo, hi = lo.min, lo.max
  end
  if not core.is_tensor(lo) and not core.is_tensor(hi) then return clamp_number(t, lo, hi) end
  local c = ct(t, "clamp", 1)
  if lo ~= nil and not core.is_tensor(lo) then lo = scalar_tensor(lo, t, "clamp") end
  if hi ~= nil and not core.is_tensor(hi) then hi = scalar_tensor(hi, t, "clamp") end
  return wrap(C.eng_clamp_tensor(c, lo and lo._c or nil, hi and hi._c or nil))
end
methods.clip = methods.clamp
M.clamp, M.clip = methods.clamp, methods.clamp

function methods.lerp(a, b, w)
  local ca, cb = ct(a, "lerp", 1), ct(b, "lerp", 2)
  if not core.is_tensor(w) then
    if type(w) ~= "number" then fail("lerp: weight must be a number or a tensor, got " .. type(w)) end
    if ca.dtype == 2 or ca.dtype == 3 then
      -- a number weight of a bf16/f16 lerp keeps f32 precision (the op computes in f32, PyTorch's opmath)
      w = wrap(C.eng_tensor_full(0, nil, w, 0, ca.device))
    else
      w = scalar_tensor(w, a, "lerp")
    end
  end
  return wrap(C.eng_lerp(ca, cb, w._c))
end
M.lerp = methods.lerp

local function value_arg(v, op)
  if type(v) == "table" and not core.is_tensor(v) then v = v.value end
  if v == nil then return 1 end
  if type(v) ~= "number" then fail(op .. ": value must be a number, got " .. type(v)) end
  return v
end
function methods.addcmul(a, b, c, v)
  return wrap(C.eng_addcmul(ct(a, "addcmul", 1), ct(b, "addcmul", 2), ct(c, "addcmul", 3), value_arg(v, "addcmul")))
end
function methods.addcdiv(a, b, c, v)
  return wrap(C.eng_addcdiv(ct(a, "addcdiv", 1), ct(b, "addcdiv", 2), ct(c, "addcdiv", 3), value_arg(v, "addcdiv")))
end
M.addcmul, M.addcdiv = methods.addcmul, methods.addcdiv

-- ---------------------------------------------------------------- reductions
local dims_buf = ffi.new("int[8]")

local function keepdim_arg(k, op)
  if k == nil then return 0 end
  if type(k) == "boolean" then return k and 1 or 0 end
  if type(k) == "table" and not core.is_tensor(k) then return k.keepdim and 1 or 0 end
  fail(string.format("%s: keepdim must be a boolean or {keepdim = bool}, got %s", op, type(k)))
end

-- dims: nil (all), a number or a list of numbers (1-based) -> count in dims_buf.
local function dims_arg(t, d, op)
  local nd = t._c.ndim
  if d == nil then return 0 end
  if type(d) == "number" then
    dims_buf[0] = core.dim(d, nd, op, 0)
    return 1
  end
  if type(d) == "table" and not core.is_tensor(d) then
    local n = #d
    if n == 0 then fail(op .. ": empty dims list (omit it to reduce over all dims)") end
    if n > 8 then fail(string.format("%s: %d dims given; at most 8", op, n)) end
    local seen = {}
    for i = 1, n do
      local cd = core.dim(d[i], nd, op, 0)
      if seen[cd] then fail(string.format("%s: dim %d appears more than once in the dims list (dims are 1-based)", op, cd + 1)) end
      seen[cd] = true
      dims_buf[i - 1] = cd
    end
    return n
  end
  fail(string.format("%s: dim must be a number or a list of numbers, got %s", op, type(d)))
end

-- t:op([dims [, keepdim]]) or t:op{dim =, keepdim =}
local function reducer(name, cfun)
  local f = function(t, d, keepdim)
    local c = ct(t, name, 1)
    if type(d) == "table" and not core.is_tensor(d) and d[1] == nil and keepdim == nil then keepdim, d = d, d.dim end
    local n = dims_arg(t, d, name)
    return wrap(cfun(c, n, dims_buf, keepdim_arg(keepdim, name)))
  end
  methods[name] = f
  M[name] = f
end
reducer("amax", C.eng_amax)
reducer("amin", C.eng_amin)
reducer("logsumexp", C.eng_logsumexp)
reducer("all", C.eng_all)
reducer("any", C.eng_any)

-- prod over all elements or one dim (as torch.prod).
function methods.prod(t, d, keepdim)
  local c = ct(t, "prod", 1)
  if type(d) == "table" and not core.is_tensor(d) then keepdim, d = d, d.dim end
  if d ~= nil and type(d) ~= "number" then fail("prod: dim must be a number (one dim, as torch.prod), got " .. type(d)) end
  local n = dims_arg(t, d, "prod")
  return wrap(C.eng_prod(c, n, dims_buf, keepdim_arg(keepdim, "prod")))
end
M.prod = methods.prod

-- var/std(dims, {correction =, unbiased =, keepdim =}) or (dims, unbiased, keepdim) or {dim =, ...}.
local function var_like(name, cfun)
  local f = function(t, d, o, keepdim)
    local c = ct(t, name, 1)
    if type(d) == "table" and not core.is_tensor(d) and d[1] == nil then o, d = d, d.dim end
    local correction, kd = 1, 0
    if type(o) == "table" then
      if o.correction ~= nil and o.unbiased ~= nil then fail(name .. ": give correction or unbiased, not both") end
      if o.correction ~= nil then
        if type(o.correction) ~= "number" then fail(name .. ": correction must be a number, got " .. type(o.correction)) end
        correction = o.correction
      elseif o.unbiased ~= nil then correction = o.unbiased and 1 or 0 end
      kd = keepdim_arg(o.keepdim, name)
    elseif type(o) == "boolean" then
      correction = o and 1 or 0
      kd = keepdim_arg(keepdim, name)
    elseif o ~= nil then
      fail(string.format("%s: options must be a table {correction =, keepdim =} or unbiased (boolean), got %s", name, type(o)))
    end
    local n = dims_arg(t, d, name)
    return wrap(cfun(c, n, dims_buf, correction, kd))
  end
  methods[name] = f
  M[name] = f
end
var_like("var", C.eng_var)
var_like("std", C.eng_std)

local function ord_arg(p, op)
  if p == nil or p == "fro" then return 2 end
  if p == "inf" then return math.huge end
  if p == "-inf" then return -math.huge end
  if type(p) ~= "number" or p ~= p then fail(op .. ": ord must be a number (math.huge for inf) or \"fro\", got " .. tostring(p)) end
  return p
end
function methods.norm(t, p, d, keepdim)
  local c = ct(t, "norm", 1)
  if type(p) == "table" then p, d, keepdim = p.p, p.dim, p.keepdim end
  local n = dims_arg(t, d, "norm")
  return wrap(C.eng_vector_norm(c, ord_arg(p, "norm"), n, dims_buf, keepdim_arg(keepdim, "norm")))
end
M.norm = methods.norm
M.linalg = {}
function M.linalg.vector_norm(t, ord, d, keepdim)
  local c = ct(t, "linalg.vector_norm", 1)
  if type(ord) == "table" then ord, d, keepdim = ord.ord, ord.dim, ord.keepdim end
  local n = dims_arg(t, d, "linalg.vector_norm")
  return wrap(C.eng_vector_norm(c, ord_arg(ord, "linalg.vector_norm"), n, dims_buf,
    keepdim_arg(keepdim, "linalg.vector_norm")))
end

-- ---------------------------------------------------------------- along a dim
local function one_dim(t, d, op, default)
  if d == nil then
    if default then d = default else fail(op .. ": dim is required (dims are 1-based; -1 = last)") end
  end
  return core.dim(d, t._c.ndim, op, 0)
end
function methods.cumsum(t, d) local c = ct(t, "cumsum", 1); return wrap(C.eng_cumsum(c, one_dim(t, d, "cumsum"))) end
function methods.cumprod(t, d) local c = ct(t, "cumprod", 1); return wrap(C.eng_cumprod(c, one_dim(t, d, "cumprod"))) end
M.cumsum, M.cumprod = methods.cumsum, methods.cumprod

local idx_out = ffi.new("eng_tensor*[1]")
local function pair(v)
  if v == nil then core.raise() end
  local values = wrap(v)
  local indices = wrap(idx_out[0])
  idx_out[0] = nil
  return values, indices
end
local function flag(v, op, what, default)
  if v == nil then return default end
  if type(v) ~= "boolean" then fail(string.format("%s: %s must be a boolean, got %s", op, what, type(v))) end
  return v and 1 or 0
end

function methods.sort(t, d, descending)
  local c = ct(t, "sort", 1)
  if type(d) == "table" then d, descending = d.dim, d.descending end -- stable: always stable
  idx_out[0] = nil
  return pair(C.eng_sort(c, one_dim(t, d, "sort", -1), flag(descending, "sort", "descending", 0), idx_out))
end
function methods.argsort(t, d, descending)
  local c = ct(t, "argsort", 1)
  if type(d) == "table" then d, descending = d.dim, d.descending end
  return wrap(C.eng_argsort(c, one_dim(t, d, "argsort", -1), flag(descending, "argsort", "descending", 0)))
end
function methods.topk(t, k, d, largest, sorted)
  local c = ct(t, "topk", 1)
  if type(d) == "table" then d, largest, sorted = d.dim, d.largest, d.sorted end
  k = core.int64(k, "topk", "k")
  idx_out[0] = nil
  return pair(C.eng_topk(c, k, one_dim(t, d, "topk", -1), flag(largest, "topk", "largest", 1),
    flag(sorted, "topk", "sorted", 1), idx_out))
end
function methods.kthvalue(t, k, d, keepdim)
  local c = ct(t, "kthvalue", 1)
  if type(d) == "table" then d, keepdim = d.dim, d.keepdim end
  k = core.int64(k, "kthvalue", "k")
  idx_out[0] = nil
  return pair(C.eng_kthvalue(c, k, one_dim(t, d, "kthvalue", -1), keepdim_arg(keepdim, "kthvalue"), idx_out))
end
M.sort, M.argsort, M.topk, M.kthvalue = methods.sort, methods.argsort, methods.topk, methods.kthvalue

return M
