-- engine.nn.linear: Linear (y = x W^T + b).
local engine = require("engine")
local core = require("engine.core")
local mod = require("engine.nn.module")
local init = require("engine.nn.initializers")
local F = require("engine.nn.functional")
local Module, Parameter = mod.Module, mod.Parameter

local M = {}

local Linear = Module:extend("Linear")
M.Linear = Linear

local function check_size(v, what)
  if type(v) ~= "number" or v % 1 ~= 0 or v < 0 then
    error(string.format("Linear: %s must be a non-negative integer, got %s", what, tostring(v)), 4)
  end
end

-- Linear(in_features, out_features [, {bias = true, dtype = "f32"}])
-- weight [out, in], bias [out]; initialised like PyTorch: kaiming_uniform
-- with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)), and the bias from the same range.
function Linear:__init(in_features, out_features, opts)
  if type(opts) == "boolean" then opts = { bias = opts } end
  opts = core.check_opts(opts, { "bias", "dtype" }, "Linear")
  check_size(in_features, "in_features")
  check_size(out_features, "out_features")
  self.in_features, self.out_features = in_features, out_features
  local dtype = opts.dtype or "f32"
  self.weight = Parameter(engine.empty(out_features, in_features, { dtype = dtype }))
  if opts.bias == false then
    self:register_parameter("bias", nil)
  else
    self.bias = Parameter(engine.empty(out_features, { dtype = dtype }))
  end
  self:reset_parameters()
end

function Linear:reset_parameters()
  init.kaiming_uniform_(self.weight, { a = math.sqrt(5) })
  if self.bias ~= nil then
    local fan_in = self.in_features
    local bound = fan_in > 0 and 1 / math.sqrt(fan_in) or 0
    init.uniform_(self.bias, -bound, bound)
  end
end

function Linear:forward(x)
  return F.linear(x, self.weight, self.bias)
end

function Linear:extra_repr()
  return string.format("in_features=%d, out_features=%d, bias=%s", self.in_features, self.out_features,
    tostring(self.bias ~= nil))
end

return M
