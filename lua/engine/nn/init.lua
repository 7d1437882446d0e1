-- engine.nn: modules, layers, nn.functional, nn.init, activation checkpointing.
--   local nn = require("engine").nn
--   local MyMod = nn.Module:extend("MyMod")
-- The test models of PyTorch's DTensor tests (common_dtensor.py: Transformer, ModelArgs, MLPModule, ...) live in
-- engine.models and are also reachable here (nn.Transformer{...}).
local module = require("engine.nn.module")

local nn = {}

nn.Module = module.Module
nn.Parameter = module.Parameter
nn.is_parameter = module.is_parameter
nn.is_module = module.is_module

nn.functional = require("engine.nn.functional")
nn.attention = require("engine.nn.attention")
nn.init = require("engine.nn.initializers")

for _, name in ipairs({ "linear", "embedding", "norm", "dropout", "activation", "container", "loss" }) do
  for k, v in pairs(require("engine.nn." .. name)) do nn[k] = v end
end

nn.checkpoint = require("engine.nn.checkpoint").checkpoint
nn.apply_activation_checkpointing = require("engine.nn.checkpoint").apply_activation_checkpointing

nn.utils = {
  clip_grad_norm_ = function(...) return require("engine.optim.clip").clip_grad_norm_(...) end,
  clip_grad_value_ = function(...) return require("engine.optim.clip").clip_grad_value_(...) end,
  checkpoint = nn.checkpoint,
}

-- common_dtensor.py's models, loaded on first use (engine.models requires engine.nn)
local model_names = { ModelArgs = true, MLPModule = true, MLPStacked = true, Attention = true,
  FeedForward = true, TransformerBlock = true, Transformer = true, RMSNormPython = true, Llama = true, LlamaArgs = true }
setmetatable(nn, { __index = function(t, k)
  if model_names[k] then
    local v = require("engine.models")[k]
    rawset(t, k, v)
    return v
  end
end })

return nn
