-- engine.nn.loss: loss modules (PyTorch's nn.*Loss) over nn.functional.
--   nn.CrossEntropyLoss{weight =, ignore_index = -100, reduction = "mean", label_smoothing = 0}
--   nn.NLLLoss{weight =, ignore_index =, reduction =}   nn.BCELoss{weight =, reduction =}
--   nn.BCEWithLogitsLoss{weight =, pos_weight =, reduction =}   nn.KLDivLoss{reduction =, log_target =}
--   nn.SmoothL1Loss{reduction =, beta = 1}   nn.HuberLoss{reduction =, delta = 1}   nn.MSELoss{reduction =}
-- loss(input, target) calls the functional form with the module's options.  Weight tensors
-- are buffers (they follow module:to(...) and state_dict()).
local mod = require("engine.nn.module")
local F = require("engine.nn.functional")
local Module = mod.Module

local M = {}

local function loss_module(name, fn, keys, tensors)
  local cls = Module:extend(name)
  M[name] = cls
  local allowed = {}
  for _, k in ipairs(keys) do allowed[k] = true end
  function cls:__init(opts)
    opts = opts or {}
    if type(opts) ~= "table" then error(name .. ": options must be a table", 3) end
    for k in pairs(opts) do
      if not allowed[k] then
        error(string.format("%s: unknown option '%s' (valid: %s)", name, tostring(k), table.concat(keys, ", ")), 3)
      end
    end
    self._loss_opts = {}
    for _, k in ipairs(keys) do
      if tensors and tensors[k] and opts[k] ~= nil then self:register_buffer(k, opts[k])
      else self._loss_opts[k] = opts[k] end
    end
    self.reduction = opts.reduction or "mean"
  end
  function cls:forward(input, target)
    local o = {}
    for _, k in ipairs(keys) do
      local v = self._loss_opts[k]
      if tensors and tensors[k] then v = self[k] end
      o[k] = v
    end
    return fn(input, target, o)
  end
  function cls:extra_repr() return "reduction=" .. tostring(self.reduction) end
  return cls
end

loss_module("CrossEntropyLoss", F.cross_entropy, { "weight", "ignore_index", "reduction", "label_smoothing" }, { weight = true })
loss_module("NLLLoss", F.nll_loss, { "weight", "ignore_index", "reduction" }, { weight = true })
loss_module("BCELoss", F.binary_cross_entropy, { "weight", "reduction" }, { weight = true })
loss_module("BCEWithLogitsLoss", F.binary_cross_entropy_with_logits, { "weight", "pos_weight", "reduction" },
  { weight = true, pos_weight = true })
loss_module("KLDivLoss", F.kl_div, { "reduction", "log_target" })
loss_module("SmoothL1Loss", F.smooth_l1_loss, { "reduction", "beta" })
loss_module("HuberLoss", F.huber_loss, { "reduction", "delta" })
loss_module("MSELoss", F.mse_loss, { "reduction" })

return M
