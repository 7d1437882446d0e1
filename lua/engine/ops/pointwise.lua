-- engine.ops.pointwise: unary math (exp, log, tanh, gelu, ...), clamp,
-- comparisons (eq, ne, lt, le, gt, ge), where, masked_fill and the fused
-- in-place updates (addcmul_, addcdiv_, lerp_, clamp_).
-- Each op is a Tensor method (t:exp()) and a function (engine.exp(t)).
-- Binary arithmetic (+ - * / ^, maximum, minimum) lives in engine.tensor.
local core = require("engine.core")
local Tensor = require("engine.tensor")
local C = core.C
local wrap, ct, check = core.wrap, core.ct, core.check
local methods = Tensor.methods

local M = {}

-- ---------------------------------------------------------------- unary
local function unary(name, cfun)
  local f = function(t) return wrap(cfun(ct(t, name, 1))) end
  methods[name] = f
  M[name] = f
end
unary("neg", C.eng_neg)
unary("exp", C.eng_exp)
unary("log", C.eng_log)
unary("sqrt", C.eng_sqrt)
unary("rsqrt", C.eng_rsqrt)
unary("abs", C.eng_abs)
unary("tanh", C.eng_tanh)
unary("sigmoid", C.eng_sigmoid)
unary("relu", C.eng_relu)
unary("silu", C.eng_silu)
methods.negative = methods.neg

-- gelu(t) exact (erf); gelu(t, "tanh") or gelu(t, {approximate = "tanh"}).
local function gelu_mode(a, level)
  local mode = a
  if type(a) == "table" and not core.is_tensor(a) then mode = a.approximate end
  if mode == nil or mode == "none" or mode == false then return 0 end
  if mode == "tanh" or mode == true then return 1 end
  error("gelu: approximate must be \"none\" or \"tanh\", got " .. tostring(mode), level)
end
function methods.gelu(t, approximate)
  return wrap(C.eng_gelu(ct(t, "gelu", 1), gelu_mode(approximate, 3)))
end
M.gelu = methods.gelu

-- clamp(lo, hi): nil for no bound (also clamp{min = lo, max = hi}).  A NaN bound is a bound, not
-- "none": every element of the result is NaN (PyTorch fills the result with NaN; an integer tensor
-- gives f32, the result type of an integer tensor and a float number).
local NAN = 0 / 0
local function bound(v, what, op)
  if v == nil then return NAN end
  if type(v) ~= "number" then core.fail(string.format("%s: %s must be a number or nil, got %s", op, what, type(v))) end
  return v
end
-- -> lo, hi (NaN: none), whether a given bound is NaN
local function clamp_args(lo, hi, op)
  if type(lo) == "table" then
    core.check_opts(lo, { "min", "max" }, op)
    lo, hi = lo.min, lo.max
  end
  if lo == nil and hi == nil then core.fail(op .. ": at least one of min and max must be given") end
  local l, h = bound(lo, "min", op), bound(hi, "max", op)
  return l, h, (lo ~= nil and l ~= l) or (hi ~= nil and h ~= h)
end
function methods.clamp(t, lo, hi)
  local l, h, nan = clamp_args(lo, hi, "clamp")
  local c = ct(t, "clamp", 1)
  if nan then  -- t * 0 + NaN: all NaN, on t's device and layout; the gradient is zero, as PyTorch's
    return wrap(C.eng_add_scalar(wrap(C.eng_mul_scalar(c, 0))._c, NAN))
  end
  return wrap(C.eng_clamp(c, l, h))
end
methods.clip = methods.clamp
M.clamp = methods.clamp
function methods.clamp_(t, lo, hi)
  local l, h, nan = clamp_args(lo, hi, "clamp_")
  local c = ct(t, "clamp_", 1)
  if nan then
    if C.eng_dtype_is_floating(c.dtype) == 0 then
      core.fail(string.format("clamp_: result type f32 can't be cast to the desired output type %s (a NaN bound)",
        core.dtype_names[c.dtype]))
    end
    check(C.eng_tensor_fill_(c, NAN))
    return t
  end
  check(C.eng_clamp_(c, l, h))
  return t
end

-- ---------------------------------------------------------------- comparisons
-- t:eq(x) ... t:ge(x), x a tensor or a number; bool results.
local cmp_codes = { eq = 0, ne = 1, lt = 2, le = 3, gt = 4, ge = 5 }
for name, code in pairs(cmp_codes) do
  local f = function(a, b)
    if type(b) == "number" or type(b) == "boolean" then
      if type(b) == "boolean" then b = b and 1 or 0 end
      return wrap(C.eng_compare_scalar(ct(a, name, 1), b, code))
    end
    if type(a) == "number" then
      error(name .. ": the first argument must be a tensor (use the mirrored comparison for number-tensor)", 2)
    end
    return wrap(C.eng_compare(ct(a, name, 1), ct(b, name, 2), code))
  end
  methods[name] = f
  M[name] = f
end
methods.greater, methods.less = methods.gt, methods.lt
methods.greater_equal, methods.less_equal = methods.ge, methods.le
methods.not_equal = methods.ne

-- ---------------------------------------------------------------- where / masked_fill
-- where(cond, a, b): a and b tensors or numbers.  A number takes the other
-- operand's dtype when that is floating (as PyTorch's scalars do); two
-- numbers give i64 when integral, else f32.
local function scalar_for(v, other)
  if type(v) == "boolean" then v = v and 1 or 0 end
  local dt = 0
  if other then
    local od = other._c.dtype
    if C.eng_dtype_is_floating(od) ~= 0 then dt = od
    elseif v % 1 == 0 then dt = (od == 7) and 5 or od
    end
  elseif v % 1 == 0 then
    dt = 5
  end
  -- on the other operand's device when that is CUDA (where() needs its operands on one device)
  return wrap(C.eng_tensor_full(0, nil, v, dt, (other and other._c.device == 1) and 1 or 0), 4)
end
function M.where(cond, a, b)
  local c = ct(cond, "where", 1)
  local ta = (type(a) == "number" or type(a) == "boolean")
  local tb = (type(b) == "number" or type(b) == "boolean")
  if ta and tb then a = scalar_for(a, nil); b = scalar_for(b, nil)
  elseif ta then a = scalar_for(a, core.is_tensor(b) and b or nil)
  elseif tb then b = scalar_for(b, core.is_tensor(a) and a or nil) end
  return wrap(C.eng_where(c, ct(a, "where", 2), ct(b, "where", 3)))
end
-- t:where(cond, other) = where(cond, t, other) (PyTorch's Tensor.where).
function methods.where(t, cond, other) return M.where(cond, t, other) end

function methods.masked_fill(t, mask, value)
  if type(value) == "boolean" then value = value and 1 or 0 end
  if type(value) ~= "number" then
    error("masked_fill: value must be a number, got " .. type(value), 2)
  end
  return wrap(C.eng_masked_fill(ct(t, "masked_fill", 1), ct(mask, "masked_fill", 2), value))
end
M.masked_fill = methods.masked_fill

-- ---------------------------------------------------------------- fused in-place updates
-- t:addcmul_(b, c [, v = 1]): t += v*b*c;  t:addcdiv_(b, c [, v = 1]): t += v*b/c.
local function num(v, default, op, what)
  if v == nil then return default end
  if type(v) ~= "number" then error(string.format("%s: %s must be a number, got %s", op, what, type(v)), 3) end
  return v
end
function methods.addcmul_(t, b, c, v)
  check(C.eng_addcmul_(ct(t, "addcmul_", 1), ct(b, "addcmul_", 2), ct(c, "addcmul_", 3), num(v, 1, "addcmul_", "value")))
  return t
end
function methods.addcdiv_(t, b, c, v)
  check(C.eng_addcdiv_(ct(t, "addcdiv_", 1), ct(b, "addcdiv_", 2), ct(c, "addcdiv_", 3), num(v, 1, "addcdiv_", "value")))
  return t
end
-- t:lerp_(b, w): t += w*(b - t).
function methods.lerp_(t, b, w)
  if type(w) ~= "number" then error("lerp_: weight must be a number, got " .. type(w), 2) end
  check(C.eng_lerp_(ct(t, "lerp_", 1), ct(b, "lerp_", 2), w))
  return t
end

return M
