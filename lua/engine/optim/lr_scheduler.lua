-- engine.optim.lr_scheduler: learning-rate schedules (torch.optim.lr_scheduler).
--   local sched = optim.lr_scheduler.warmup_cosine(opt, {warmup_steps = 100, max_steps = 5000, min_lr_ratio = 0.1})
--   for step = 1, n do ...; opt:step(); sched:step() end
-- As in PyTorch, constructing a scheduler sets the lr for step 0 (last_epoch = 0),
-- and each step() advances last_epoch by one and sets the group lrs.
-- get_last_lr() returns the lrs it set last (one per param group).
local M = {}

local Scheduler = {}
Scheduler.__index = Scheduler
M.LRScheduler = Scheduler

local function extend(name)
  local cls = setmetatable({ __name = name }, { __index = Scheduler, __call = function(c, ...) return c.new(...) end })
  cls.__index = cls
  return cls
end
M._extend = extend

-- Base initialisation: records each group's initial lr (group.initial_lr, as PyTorch).
function Scheduler.init(self, optimizer, last_epoch, op)
  if type(optimizer) ~= "table" or type(optimizer.param_groups) ~= "table" then
    error(op .. ": expected an optimizer as the first argument", 4)
  end
  self.optimizer = optimizer
  last_epoch = last_epoch or -1
  self.base_lrs = {}
  for i, g in ipairs(optimizer.param_groups) do
    if last_epoch == -1 then
      g.initial_lr = g.lr
    elseif g.initial_lr == nil then
      error(string.format("%s: param 'initial_lr' is not specified in param_groups[%d] when resuming an optimizer",
        op, i), 4)
    end
    self.base_lrs[i] = g.initial_lr
  end
  self.last_epoch = last_epoch
  self:step()
end

-- step([epoch]): advances (or sets) the step count and updates the lrs.
function Scheduler:step(epoch)
  if epoch == nil then self.last_epoch = self.last_epoch + 1 else self.last_epoch = epoch end
  local lrs = self:get_lr()
  self._last_lr = {}
  for i, g in ipairs(self.optimizer.param_groups) do
    g.lr = lrs[i]
    self._last_lr[i] = lrs[i]
  end
end

function Scheduler:get_last_lr()
  local out = {}
  for i, v in ipairs(self._last_lr) do out[i] = v end
  return out
end

function Scheduler:state_dict()
  return { last_epoch = self.last_epoch, base_lrs = { unpack(self.base_lrs) }, _last_lr = self:get_last_lr() }
end

function Scheduler:load_state_dict(sd)
  if type(sd) ~= "table" or type(sd.last_epoch) ~= "number" then
    error(self.__name .. ": load_state_dict expects a table with last_epoch", 2)
  end
  self.last_epoch = sd.last_epoch
  if sd.base_lrs then self.base_lrs = { unpack(sd.base_lrs) } end
  -- restore the lrs of the current step
  local lrs = self:get_lr()
  self._last_lr = {}
  for i, g in ipairs(self.optimizer.param_groups) do g.lr = lrs[i]; self._last_lr[i] = lrs[i] end
end

-- ---------------------------------------------------------------- LambdaLR
-- LambdaLR(optimizer, lr_lambda [, last_epoch = -1]): lr = base_lr * lr_lambda(step);
-- lr_lambda is a function or a list of functions (one per group).
local LambdaLR = extend("LambdaLR")
M.LambdaLR = LambdaLR

function LambdaLR.new(optimizer, lr_lambda, last_epoch)
  local self = setmetatable({}, LambdaLR)
  local n = type(optimizer) == "table" and type(optimizer.param_groups) == "table" and #optimizer.param_groups or 0
  if type(lr_lambda) == "function" then
    self.lr_lambdas = {}
    for i = 1, n do self.lr_lambdas[i] = lr_lambda end
  elseif type(lr_lambda) == "table" then
    if #lr_lambda ~= n then
      error(string.format("LambdaLR: expected %d lr_lambdas, but got %d", n, #lr_lambda), 3)
    end
    self.lr_lambdas = { unpack(lr_lambda) }
  else
    error("LambdaLR: lr_lambda must be a function or a list of functions", 3)
  end
  Scheduler.init(self, optimizer, last_epoch, "LambdaLR")
  return self
end

function LambdaLR:get_lr()
  local out = {}
  for i, base in ipairs(self.base_lrs) do out[i] = base * self.lr_lambdas[i](self.last_epoch) end
  return out
end

-- ---------------------------------------------------------------- CosineAnnealingLR
-- CosineAnnealingLR(optimizer, T_max [, eta_min = 0 [, last_epoch = -1]]) (closed form):
-- lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * step / T_max)) / 2
local CosineAnnealingLR = extend("CosineAnnealingLR")
M.CosineAnnealingLR = CosineAnnealingLR

function CosineAnnealingLR.new(optimizer, T_max, eta_min, last_epoch)
  if type(T_max) ~= "number" or T_max <= 0 then error("CosineAnnealingLR: T_max must be a positive number", 3) end
  local self = setmetatable({ T_max = T_max, eta_min = eta_min or 0 }, CosineAnnealingLR)
  Scheduler.init(self, optimizer, last_epoch, "CosineAnnealingLR")
  return self
end

function CosineAnnealingLR:get_lr()
  local out = {}
  for i, base in ipairs(self.base_lrs) do
    out[i] = self.eta_min + (base - self.eta_min) * (1 + math.cos(math.pi * self.last_epoch / self.T_max)) / 2
  end
  return out
end

-- ---------------------------------------------------------------- StepLR
-- StepLR(optimizer, step_size [, gamma = 0.1 [, last_epoch]]): lr = base_lr * gamma^floor(step / step_size)
local StepLR = extend("StepLR")
M.StepLR = StepLR

function StepLR.new(optimizer, step_size, gamma, last_epoch)
  if type(step_size) ~= "number" or step_size < 1 then error("StepLR: step_size must be a positive integer", 3) end
  local self = setmetatable({ step_size = step_size, gamma = gamma or 0.1 }, StepLR)
  Scheduler.init(self, optimizer, last_epoch, "StepLR")
  return self
end

function StepLR:get_lr()
  local out = {}
  for i, base in ipairs(self.base_lrs) do
    out[i] = base * self.gamma ^ math.floor(self.last_epoch / self.step_size)
  end
  return out
end

-- ---------------------------------------------------------------- warmup + cosine
-- The multiplier of a linear warmup followed by a cosine decay (llm.c / nanoGPT):
--   step < warmup:       (step + 1) / warmup
--   step >= max_steps:   min_lr_ratio
--   otherwise:           min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * r)) / 2,
--                        r = (step - warmup) / (max_steps - warmup)
function M.warmup_cosine_lambda(opts)
  opts = opts or {}
  local warmup, max_steps = opts.warmup_steps or 0, opts.max_steps
  local min_ratio = opts.min_lr_ratio or 0
  if type(max_steps) ~= "number" or max_steps < 1 then
    error("warmup_cosine: max_steps must be a positive integer", 3)
  end
  if type(warmup) ~= "number" or warmup < 0 or warmup > max_steps then
    error("warmup_cosine: warmup_steps must be between 0 and max_steps", 3)
  end
  if type(min_ratio) ~= "number" or min_ratio < 0 or min_ratio > 1 then
    error("warmup_cosine: min_lr_ratio must be in [0, 1]", 3)
  end
  return function(step)
    if step < warmup then return (step + 1) / warmup end
    if step >= max_steps then return min_ratio end
    local r = (step - warmup) / (max_steps - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * r))
  end
end

-- warmup_cosine(optimizer, {warmup_steps = 0, max_steps = N, min_lr_ratio = 0}) -> a LambdaLR
function M.warmup_cosine(optimizer, opts)
  return LambdaLR.new(optimizer, M.warmup_cosine_lambda(opts))
end
M.WarmupCosine = M.warmup_cosine

return M
