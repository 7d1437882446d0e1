-- engine.optim: optimizers, gradient clipping, learning-rate schedules.
--   local opt = optim.AdamW(model:parameters(), {lr = 3e-4, weight_decay = 0.1})
--   loss:backward(); optim.clip_grad_norm(model:parameters(), 1.0); opt:step(); opt:zero_grad()
local clip = require("engine.optim.clip")

local optim = {}
optim.Optimizer = require("engine.optim.optimizer")
optim.SGD = require("engine.optim.sgd")
optim.AdamW = require("engine.optim.adamw")
optim.lr_scheduler = require("engine.optim.lr_scheduler")
optim.clip_grad_norm = clip.clip_grad_norm_
optim.clip_grad_norm_ = clip.clip_grad_norm_
optim.clip_grad_value_ = clip.clip_grad_value_
optim.global_norm = clip.global_norm
optim.grad_norm = clip.grad_norm

return optim
