-- engine.nn.initializers (exported as nn.init): in-place parameter
-- initialisation, PyTorch's torch.nn.init.  All run without autograd and draw
-- from the global counter-based generator (engine.manual_seed), or from a
-- user generator (engine.Generator) passed as PyTorch's `generator` argument:
--   init.uniform_(t, a, b, g)   init.normal_(t, mean, std, g)   init.xavier_uniform_(t, gain, g)
--   init.kaiming_uniform_(t, {a =, mode =, nonlinearity =, generator = g})
-- (a trailing {generator = g} table is accepted wherever g is).
local core = require("engine.core")
local C = core.C
local gen = require("engine.ops.random")._generator

local M = {}

local function ct(t, op)
  if not core.is_tensor(t) then error(op .. ": expected a tensor, got " .. type(t), 3) end
  return t._c
end

-- Runs an in-place C fill with grad mode off (parameters are leaves that
-- require grad: in-place writes to them are only allowed without recording).
local function run(rc_fn, ...)
  local prev = C.eng_set_grad_enabled(0)
  local rc = rc_fn(...)
  C.eng_set_grad_enabled(prev)
  core.check(rc, 4)
end

-- A random fill from g (nil: the global generator).
local function run_random(cfun, t, a, b, g)
  run(gen.fill, cfun, t, a, b, g)
end

-- fan_in, fan_out of a weight (PyTorch's _calculate_fan_in_and_fan_out):
-- dim 2 is the input, dim 1 the output, the rest is the receptive field.
function M.calculate_fan_in_and_fan_out(t)
  local s = t:shape()
  if #s < 2 then
    error("calculate_fan_in_and_fan_out: fan in and fan out cannot be computed for a tensor with fewer than 2 dims ("
      .. t.dtype .. "[" .. table.concat(s, ",") .. "])", 2)
  end
  local rf = 1
  for d = 3, #s do rf = rf * s[d] end
  return s[2] * rf, s[1] * rf
end

function M.calculate_gain(nonlinearity, param)
  if nonlinearity == "linear" or nonlinearity == "sigmoid" or nonlinearity == "identity" then return 1 end
  if nonlinearity == "tanh" then return 5 / 3 end
  if nonlinearity == "relu" then return math.sqrt(2) end
  if nonlinearity == "leaky_relu" then
    local slope = param or 0.01
    return math.sqrt(2 / (1 + slope * slope))
  end
  if nonlinearity == "selu" then return 3 / 4 end
  error("calculate_gain: unsupported nonlinearity '" .. tostring(nonlinearity) .. "'", 2)
end

function M.uniform_(t, a, b, generator)
  local g = gen.trailing(generator, "uniform_")
  run_random(C.eng_uniform_, ct(t, "uniform_"), a or 0, b or 1, g)
  return t
end

function M.normal_(t, mean, std, generator)
  local g = gen.trailing(generator, "normal_")
  run_random(C.eng_normal_, ct(t, "normal_"), mean or 0, std or 1, g)
  return t
end

function M.constant_(t, v)
  run(C.eng_tensor_fill_, ct(t, "constant_"), v)
  return t
end

function M.zeros_(t) run(C.eng_tensor_zero_, ct(t, "zeros_")); return t end
function M.ones_(t) run(C.eng_tensor_fill_, ct(t, "ones_"), 1); return t end

-- The options of kaiming_*: unknown keys and modes are errors.
local function kaiming_opts(opts, op)
  opts = core.check_opts(opts, { "a", "mode", "nonlinearity", "generator" }, op)
  if opts.mode ~= nil and opts.mode ~= "fan_in" and opts.mode ~= "fan_out" then
    core.fail(string.format("%s: mode must be \"fan_in\" or \"fan_out\", got %s", op, tostring(opts.mode)))
  end
  return opts
end

-- kaiming_uniform_(t, {a = 0, mode = "fan_in", nonlinearity = "leaky_relu", generator = nil})
function M.kaiming_uniform_(t, opts)
  opts = kaiming_opts(opts, "kaiming_uniform_")
  local g = gen.check(opts.generator, "kaiming_uniform_")
  local fan_in, fan_out = M.calculate_fan_in_and_fan_out(t)
  local fan = (opts.mode == "fan_out") and fan_out or fan_in
  local gain = M.calculate_gain(opts.nonlinearity or "leaky_relu", opts.a or 0)
  local bound = fan > 0 and math.sqrt(3) * gain / math.sqrt(fan) or 0
  return M.uniform_(t, -bound, bound, g)
end

function M.kaiming_normal_(t, opts)
  opts = kaiming_opts(opts, "kaiming_normal_")
  local g = gen.check(opts.generator, "kaiming_normal_")
  local fan_in, fan_out = M.calculate_fan_in_and_fan_out(t)
  local fan = (opts.mode == "fan_out") and fan_out or fan_in
  local gain = M.calculate_gain(opts.nonlinearity or "leaky_relu", opts.a or 0)
  return M.normal_(t, 0, fan > 0 and gain / math.sqrt(fan) or 0, g)
end

-- xavier_uniform_(t [, gain = 1 [, generator]]); gain may also be {gain =, generator =}
local function xavier_opts(gain, generator, op)
  if type(gain) == "table" then
    core.check_opts(gain, { "gain", "generator" }, op)
    return gain.gain, gain.generator
  end
  return gain, generator
end
function M.xavier_uniform_(t, gain, generator)
  gain, generator = xavier_opts(gain, generator, "xavier_uniform_")
  local g = gen.trailing(generator, "xavier_uniform_")
  local fan_in, fan_out = M.calculate_fan_in_and_fan_out(t)
  local a = (gain or 1) * math.sqrt(6 / (fan_in + fan_out))
  return M.uniform_(t, -a, a, g)
end

function M.xavier_normal_(t, gain, generator)
  gain, generator = xavier_opts(gain, generator, "xavier_normal_")
  local g = gen.trailing(generator, "xavier_normal_")
  local fan_in, fan_out = M.calculate_fan_in_and_fan_out(t)
  return M.normal_(t, 0, (gain or 1) * math.sqrt(2 / (fan_in + fan_out)), g)
end

return M
