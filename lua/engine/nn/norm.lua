-- engine.nn.norm: LayerNorm and RMSNorm over the trailing dims.
local engine = require("engine")
local core = require("engine.core")
local mod = require("engine.nn.module")
local F = require("engine.nn.functional")
local Module, Parameter = mod.Module, mod.Parameter

local M = {}

local function norm_shape(shape, op)
  if type(shape) == "number" then shape = { shape } end
  if type(shape) ~= "table" or #shape == 0 then
    error(op .. ": normalized_shape must be a positive integer or a non-empty list of them", 4)
  end
  local s = {}
  for i, v in ipairs(shape) do
    if type(v) ~= "number" or v % 1 ~= 0 or v < 1 then
      error(string.format("%s: normalized_shape[%d] = %s is not a positive integer", op, i, tostring(v)), 4)
    end
    s[i] = v
  end
  return s
end

-- ---------------------------------------------------------------- LayerNorm
local LayerNorm = Module:extend("LayerNorm")
M.LayerNorm = LayerNorm

-- LayerNorm(normalized_shape [, {eps = 1e-5, elementwise_affine = true, bias = true, dtype = "f32"}])
function LayerNorm:__init(normalized_shape, opts)
  opts = core.check_opts(opts, { "eps", "elementwise_affine", "bias", "dtype" }, "LayerNorm")
  self.normalized_shape = norm_shape(normalized_shape, "LayerNorm")
  self.eps = opts.eps or 1e-5
  self.elementwise_affine = opts.elementwise_affine ~= false
  local dtype = opts.dtype or "f32"
  if self.elementwise_affine then
    self.weight = Parameter(engine.ones(self.normalized_shape, { dtype = dtype }))
    if opts.bias ~= false then
      self.bias = Parameter(engine.zeros(self.normalized_shape, { dtype = dtype }))
    else
      self:register_parameter("bias", nil)
    end
  else
    self:register_parameter("weight", nil)
    self:register_parameter("bias", nil)
  end
end

function LayerNorm:reset_parameters()
  local init = require("engine.nn.initializers")
  if self.weight ~= nil then init.ones_(self.weight) end
  if self.bias ~= nil then init.zeros_(self.bias) end
end

function LayerNorm:forward(x)
  return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
end

function LayerNorm:extra_repr()
  return string.format("{%s}, eps=%g, elementwise_affine=%s", table.concat(self.normalized_shape, ", "), self.eps,
    tostring(self.elementwise_affine))
end

-- ---------------------------------------------------------------- RMSNorm
local RMSNorm = Module:extend("RMSNorm")
M.RMSNorm = RMSNorm

-- RMSNorm(normalized_shape [, {eps = nil, elementwise_affine = true, dtype = "f32"}]);
-- eps nil means the machine epsilon of the input's dtype (as in PyTorch).
function RMSNorm:__init(normalized_shape, opts)
  opts = core.check_opts(opts, { "eps", "elementwise_affine", "dtype" }, "RMSNorm")
  self.normalized_shape = norm_shape(normalized_shape, "RMSNorm")
  self.eps = opts.eps
  self.elementwise_affine = opts.elementwise_affine ~= false
  if self.elementwise_affine then
    self.weight = Parameter(engine.ones(self.normalized_shape, { dtype = opts.dtype or "f32" }))
  else
    self:register_parameter("weight", nil)
  end
end

function RMSNorm:reset_parameters()
  if self.weight ~= nil then require("engine.nn.initializers").ones_(self.weight) end
end

function RMSNorm:forward(x)
  return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
end

function RMSNorm:extra_repr()
  return string.format("{%s}, eps=%s, elementwise_affine=%s", table.concat(self.normalized_shape, ", "),
    self.eps and string.format("%g", self.eps) or "nil", tostring(self.elementwise_affine))
end

return M
