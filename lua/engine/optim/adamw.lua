-- engine.optim.adamw: AdamW (torch.optim.AdamW: Adam with decoupled weight decay).
--   local opt = optim.AdamW(model:parameters(), {lr = 3e-4, betas = {0.9, 0.95}, weight_decay = 0.1})
-- State per parameter: step (a 0-dim f32 CPU tensor, as PyTorch's), exp_avg, exp_avg_sq.
-- One fused C call (eng_adamw_step) per parameter group and step: for each p,
--   p -= lr * wd * p;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
--   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
--
-- master_weights = true (the option of apex's and Transformer Engine's FusedAdam): mixed precision as users
-- expect it.  A bf16/f16 parameter gets an f32 master copy (state "master_param", TE's name) and f32
-- exp_avg/exp_avg_sq; the step updates the master in f32 and writes it back to the parameter rounded to
-- nearest (eng_adamw_step_master): updates smaller than half a bf16 ulp accumulate in the master instead of
-- being lost.  f32/f64 parameters are stepped as without the option.  state_dict/load_state_dict carry the
-- masters (a loaded master is the weight the next step starts from).
local core = require("engine.core")
local Optimizer = require("engine.optim.optimizer")
local C = core.C

local AdamW = Optimizer:extend("AdamW")

local known = { lr = true, betas = true, eps = true, weight_decay = true, amsgrad = true, maximize = true,
  foreach = true, fused = true, capturable = true, differentiable = true, master_weights = true }

function AdamW.new(params, opts)
  opts = opts or {}
  if type(opts) ~= "table" then error("AdamW: options must be a table", 3) end
  local defaults = { lr = 1e-3, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 1e-2, amsgrad = false,
    maximize = false, master_weights = false }
  for k, v in pairs(opts) do
    if not known[k] then error("AdamW: unknown option '" .. tostring(k) .. "' (known: " .. Optimizer._names(known) .. ")", 3) end
    defaults[k] = v
  end
  local self = setmetatable({}, AdamW)
  Optimizer.init(self, params, defaults, "AdamW")
  return self
end

function AdamW:validate_group(g, level)
  local function bad(msg) error("AdamW: " .. msg, level + 1) end
  -- written as PyTorch's `not 0.0 <= lr`, so that NaN is refused too
  if type(g.lr) ~= "number" or not (g.lr >= 0) then bad("Invalid learning rate: " .. tostring(g.lr)) end
  if type(g.eps) ~= "number" or not (g.eps >= 0) then bad("Invalid epsilon value: " .. tostring(g.eps)) end
  if type(g.betas) ~= "table" or #g.betas ~= 2 then bad("betas must be a table of two numbers") end
  for i = 1, 2 do
    local b = g.betas[i]
    if type(b) ~= "number" or not (b >= 0 and b < 1) then
      bad(string.format("Invalid beta parameter at index %d: %s", i - 1, tostring(b)))
    end
  end
  if type(g.weight_decay) ~= "number" or not (g.weight_decay >= 0) then
    bad("Invalid weight_decay value: " .. tostring(g.weight_decay))
  end
  if type(g.master_weights) ~= "boolean" then
    bad("master_weights must be true or false, got " .. tostring(g.master_weights))
  end
  if g.amsgrad then bad("amsgrad is not supported") end
  if g.maximize then bad("maximize is not supported") end
end

-- A parameter's state before its first step (PyTorch's lazy init): step 0 as a 0-dim f32 CPU tensor (a state
-- dict holds it live, so a checkpoint loaded in place restores it), zero moments in the param's layout.
-- dist.checkpoint.get_optimizer_state_dict calls it for parameters without state, so a fresh optimizer can be
-- loaded into.
function AdamW:_init_state(p)
  local st
  if self:_uses_master(p) then
    local w = Optimizer._f32_copy(p, 2)
    st = { step = Optimizer._step_tensor(0, 2), master_param = w, exp_avg = Optimizer._zeros_like(w, 2),
      exp_avg_sq = Optimizer._zeros_like(w, 2) }
  else
    st = { step = Optimizer._step_tensor(0, 2), exp_avg = Optimizer._zeros_like(p, 2),
      exp_avg_sq = Optimizer._zeros_like(p, 2) }
  end
  self.state[p] = st
  return st
end

local half = { bf16 = true, f16 = true }

-- true when p's group keeps master weights and p is bf16/f16.
function AdamW:_uses_master(p)
  if not half[p.dtype] then return false end
  for _, g in ipairs(self.param_groups) do
    for _, q in ipairs(g.params) do if q == p then return g.master_weights == true end end
  end
  return false
end

-- The dtype a loaded state tensor takes (Optimizer:load_state_dict): f32 for the master and the moments of a
-- parameter with master weights, the parameter's dtype otherwise.
function AdamW:_state_dtype(p, key)
  if self:_uses_master(p) and (key == "master_param" or key == "exp_avg" or key == "exp_avg_sq") then
    return "f32"
  end
  return p.dtype
end

-- A state made without master weights (an older checkpoint, the option turned on later) gets them at the
-- next step: the master from the parameter, f32 moments.
local function ensure_master(p, st)
  if st.master_param == nil then st.master_param = Optimizer._f32_copy(p, 4) end
  if st.exp_avg.dtype ~= "f32" then st.exp_avg = st.exp_avg:to("f32") end
  if st.exp_avg_sq.dtype ~= "f32" then st.exp_avg_sq = st.exp_avg_sq:to("f32") end
end

-- step([closure]): one update of every parameter that has a gradient.
function AdamW:step(closure)
  local loss = self:_closure(closure)
  for _, g in ipairs(self.param_groups) do
    -- parameters grouped by their step count (normally one group)
    local buckets, order = {}, {}
    for _, p in ipairs(g.params) do
      if p._c.grad ~= nil then
        local st = self.state[p] or self:_init_state(p)
        local step = Optimizer._bump_step(st, 2)
        local b = buckets[step]
        if not b then b = {}; buckets[step] = b; order[#order + 1] = step end
        b[#b + 1] = p
      end
    end
    local mw = g.master_weights == true
    for _, step in ipairs(order) do
      local list = buckets[step]
      local k = #list
      local ps, gs, ms, vs = Optimizer._arrays(k)
      local ws, any_master = nil, false
      if mw then ws = Optimizer._arrays(k) end
      for i = 1, k do
        local p = list[i]
        local st = self.state[p]
        if mw then
          if half[p.dtype] then
            ensure_master(p, st)
            ws[i - 1], any_master = st.master_param._c, true
          else
            ws[i - 1] = nil
          end
        end
        ps[i - 1], gs[i - 1] = p._c, p._c.grad
        ms[i - 1], vs[i - 1] = st.exp_avg._c, st.exp_avg_sq._c
      end
      local prev = C.eng_set_grad_enabled(0)
      local rc
      if any_master then
        rc = C.eng_adamw_step_master(k, ps, gs, ms, vs, ws, g.lr, g.betas[1], g.betas[2], g.eps, g.weight_decay, step)
      else
        rc = C.eng_adamw_step(k, ps, gs, ms, vs, g.lr, g.betas[1], g.betas[2], g.eps, g.weight_decay, step)
      end
      C.eng_set_grad_enabled(prev)
      if rc ~= 0 then error("AdamW.step: " .. core.last_error(), 2) end
    end
  end
  self:_after_step()
  return loss
end

return AdamW
