-- engine.optim.sgd: SGD with momentum, dampening, weight decay and Nesterov
-- (torch.optim.SGD).  For each p with gradient g:
--   g += wd * p;  buf = momentum * buf + (1 - dampening) * g  (buf = g on the first step)
--   g = nesterov and g + momentum * buf or buf;  p -= lr * g
local core = require("engine.core")
local Optimizer = require("engine.optim.optimizer")
local C = core.C

local SGD = Optimizer:extend("SGD")

local known = { lr = true, momentum = true, dampening = true, weight_decay = true, nesterov = true,
  maximize = true, foreach = true, differentiable = true, fused = true }

-- SGD(params, {lr = 1e-3, momentum = 0, dampening = 0, weight_decay = 0, nesterov = false})
function SGD.new(params, opts)
  opts = opts or {}
  if type(opts) ~= "table" then error("SGD: options must be a table", 3) end
  local defaults = { lr = 1e-3, momentum = 0, dampening = 0, weight_decay = 0, nesterov = false, maximize = false }
  for k, v in pairs(opts) do
    if not known[k] then error("SGD: unknown option '" .. tostring(k) .. "' (known: " .. Optimizer._names(known) .. ")", 3) end
    defaults[k] = v
  end
  local self = setmetatable({}, SGD)
  Optimizer.init(self, params, defaults, "SGD")
  return self
end

function SGD:validate_group(g, level)
  local function bad(msg) error("SGD: " .. msg, level + 1) end
  -- written as PyTorch's `not 0.0 <= lr`, so that NaN is refused too
  if type(g.lr) ~= "number" or not (g.lr >= 0) then bad("Invalid learning rate: " .. tostring(g.lr)) end
  if type(g.momentum) ~= "number" or not (g.momentum >= 0) then bad("Invalid momentum value: " .. tostring(g.momentum)) end
  if type(g.dampening) ~= "number" or g.dampening ~= g.dampening then bad("Invalid dampening value: " .. tostring(g.dampening)) end
  if type(g.weight_decay) ~= "number" or not (g.weight_decay >= 0) then
    bad("Invalid weight_decay value: " .. tostring(g.weight_decay))
  end
  if g.nesterov and (g.momentum <= 0 or g.dampening ~= 0) then
    bad("Nesterov momentum requires a momentum and zero dampening")
  end
  if g.maximize then bad("maximize is not supported") end
end

function SGD:step(closure)
  local loss = self:_closure(closure)
  for _, g in ipairs(self.param_groups) do
    local use_mom = g.momentum ~= 0
    local lists = { {}, {} }  -- [1]: buffers exist, [2]: first step (buffer := grad)
    for _, p in ipairs(g.params) do
      if p._c.grad ~= nil then
        local first = false
        if use_mom then
          local st = self.state[p]
          if not st or st.momentum_buffer == nil then
            st = st or {}
            st.momentum_buffer = Optimizer._zeros_like(p, 3)
            self.state[p] = st
            first = true
          end
        end
        local l = lists[first and 2 or 1]
        l[#l + 1] = p
      end
    end
    for li = 1, 2 do
      local list = lists[li]
      local k = #list
      if k > 0 then
        local ps, gs, bs = Optimizer._arrays(k)
        for i = 1, k do
          local p = list[i]
          ps[i - 1], gs[i - 1] = p._c, p._c.grad
          bs[i - 1] = use_mom and self.state[p].momentum_buffer._c or nil
        end
        local prev = C.eng_set_grad_enabled(0)
        local rc = C.eng_sgd_step(k, ps, gs, bs, g.lr, g.momentum, g.dampening, g.weight_decay,
          g.nesterov and 1 or 0, li == 2 and 1 or 0)
        C.eng_set_grad_enabled(prev)
        if rc ~= 0 then error("SGD.step: " .. core.last_error(), 2) end
      end
    end
  end
  self:_after_step()
  return loss
end

return SGD
