-- engine.nn.activation: ReLU, GELU, SiLU, Tanh, Sigmoid, Softmax, LogSoftmax.
local core = require("engine.core")
local mod = require("engine.nn.module")
local F = require("engine.nn.functional")
local Module = mod.Module

local M = {}

local function simple(name, fn)
  local cls = Module:extend(name)
  cls.forward = function(_, x) return fn(x) end
  M[name] = cls
  return cls
end

simple("ReLU", F.relu)
simple("SiLU", F.silu)
simple("Tanh", F.tanh)
simple("Sigmoid", F.sigmoid)

-- GELU([{approximate = "none" | "tanh"}]) (also GELU("tanh"))
local GELU = Module:extend("GELU")
M.GELU = GELU
function GELU:__init(opts)
  if type(opts) == "table" then core.check_opts(opts, { "approximate" }, "GELU") end
  local a = type(opts) == "table" and opts.approximate or opts
  if a == nil then a = "none" end
  if a ~= "none" and a ~= "tanh" then
    error("GELU: approximate must be \"none\" or \"tanh\", got " .. tostring(a), 3)
  end
  self.approximate = a
end
function GELU:forward(x) return F.gelu(x, self.approximate) end
function GELU:extra_repr() return self.approximate == "none" and "" or "approximate='tanh'" end

-- Softmax(dim) / LogSoftmax(dim): dim is 1-based (negative from the end).
local Softmax = Module:extend("Softmax")
M.Softmax = Softmax
-- Softmax(dim) or Softmax{dim = d}
local function dim_arg(dim, op)
  if type(dim) == "table" then dim = core.check_opts(dim, { "dim" }, op).dim end
  if dim ~= nil and type(dim) ~= "number" then core.fail(op .. ": dim must be a number, got " .. type(dim)) end
  return dim or -1
end
function Softmax:__init(dim) self.dim = dim_arg(dim, "Softmax") end
function Softmax:forward(x) return F.softmax(x, self.dim) end
function Softmax:extra_repr() return "dim=" .. tostring(self.dim) end

local LogSoftmax = Module:extend("LogSoftmax")
M.LogSoftmax = LogSoftmax
function LogSoftmax:__init(dim) self.dim = dim_arg(dim, "LogSoftmax") end
function LogSoftmax:forward(x) return F.log_softmax(x, self.dim) end
function LogSoftmax:extra_repr() return "dim=" .. tostring(self.dim) end

-- Softplus{beta = 1, threshold = 20}, LeakyReLU(negative_slope = 0.01), ELU(alpha = 1),
-- Hardtanh(min_val = -1, max_val = 1), ReLU6(), GLU(dim = -1) (numbers or an options table).
local function with_opts(name, fn, keys, defaults)
  local cls = Module:extend(name)
  M[name] = cls
  function cls:__init(a, b)
    if type(a) == "table" then
      core.check_opts(a, keys, name)
      a, b = a[keys[1]], keys[2] and a[keys[2]] or nil
    end
    self[keys[1]] = a == nil and defaults[1] or a
    if keys[2] then self[keys[2]] = b == nil and defaults[2] or b end
    for i, k in ipairs(keys) do
      if type(self[k]) ~= "number" then error(string.format("%s: %s must be a number, got %s", name, k, type(self[k])), 3) end
      local _ = i
    end
  end
  function cls:forward(x)
    if keys[2] then return fn(x, self[keys[1]], self[keys[2]]) end
    return fn(x, self[keys[1]])
  end
  function cls:extra_repr()
    local p = {}
    for _, k in ipairs(keys) do p[#p + 1] = k .. "=" .. tostring(self[k]) end
    return table.concat(p, ", ")
  end
  return cls
end
with_opts("Softplus", F.softplus, { "beta", "threshold" }, { 1, 20 })
with_opts("LeakyReLU", F.leaky_relu, { "negative_slope" }, { 0.01 })
with_opts("ELU", F.elu, { "alpha" }, { 1 })
with_opts("Hardtanh", F.hardtanh, { "min_val", "max_val" }, { -1, 1 })
with_opts("GLU", F.glu, { "dim" }, { -1 })
simple("ReLU6", F.relu6)

return M
