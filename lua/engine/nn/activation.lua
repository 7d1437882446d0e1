-- engine.nn.activation: ReLU, GELU, SiLU, Tanh, Sigmoid, Softmax, LogSoftmax.
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
function Softmax:__init(dim) self.dim = dim or -1 end
function Softmax:forward(x) return F.softmax(x, self.dim) end
function Softmax:extra_repr() return "dim=" .. tostring(self.dim) end

local LogSoftmax = Module:extend("LogSoftmax")
M.LogSoftmax = LogSoftmax
function LogSoftmax:__init(dim) self.dim = dim or -1 end
function LogSoftmax:forward(x) return F.log_softmax(x, self.dim) end
function LogSoftmax:extra_repr() return "dim=" .. tostring(self.dim) end

return M
