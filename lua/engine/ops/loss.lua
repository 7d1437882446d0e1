-- engine.ops.loss: torch.nn.functional's other losses and activations.  The losses are
-- fused C ops (engine/src/ops/loss_ext.c: one dispatch, their own DTensor rules);
-- weights that require grad, mixed dtypes, broadcast targets and probability
-- targets take the composites below (ops with DTensor rules, autograd, every
-- floating dtype and CUDA kernels).  Class targets are 0-BASED ids (data, like token ids);
-- dims are 1-based.  Options are tables; reductions "mean" (default), "sum",
-- "none" (kl_div also "batchmean").
--
--   engine.nll_loss(logp, target, {weight, ignore_index = -100, reduction})
--       logp [C] / [N, C] / [N, C, d1, ...]; mean = sum(w_i * loss_i) / sum(w_i)
--   engine.cross_entropy(logits, target, {weight, ignore_index, reduction, label_smoothing})
--       class weights (and class-probability targets) as PyTorch; without weight and with
--       integer targets it is the fused op of engine.ops.nn
--   engine.binary_cross_entropy(p, target, {weight, reduction})      log terms clamped at -100
--   engine.binary_cross_entropy_with_logits(x, target, {weight, pos_weight, reduction})
--   engine.kl_div(input, target, {reduction = "mean", log_target = false})
--   engine.smooth_l1_loss(x, y, {reduction, beta = 1})  engine.huber_loss(x, y, {reduction, delta = 1})
--   engine.softplus(x [, beta = 1 [, threshold = 20]])  engine.leaky_relu(x [, negative_slope = 0.01])
--   engine.elu(x [, alpha = 1])  engine.hardtanh(x [, min_val = -1 [, max_val = 1]])  engine.glu(x [, dim = -1])
--   (numbers may also come as an options table: softplus(x, {beta =, threshold =}))
local core = require("engine.core")
local Tensor = require("engine.tensor")
local C = core.C
local methods = Tensor.methods
local wrap, ct = core.wrap, core.ct

local M = {}
local fail = core.fail

local function is_dt(t) return core.is_tensor(t) and t._c.dist ~= nil end
local function lift(t, like) return Tensor.lift_replicate(t, like) end
local function number_of(t)
  local v
  if is_dt(t) then v = t:full_tensor():item() else v = t:item() end
  if type(v) == "boolean" then v = v and 1 or 0 end
  return v
end
local function need(t, op, pos, what)
  if not core.is_tensor(t) then
    if what == nil then fail(string.format("%s: argument %d must be a tensor, got %s", op, pos, type(t))) end
    fail(string.format("%s: %s (argument %d) must be a tensor, got %s", op, what, pos, type(t)))
  end
end
local function shp(t) return "[" .. table.concat(t:shape(), ",") .. "]" end
local function same_shape(a, b)
  local sa, sb = a:shape(), b:shape()
  if #sa ~= #sb then return false end
  for i = 1, #sa do if sa[i] ~= sb[i] then return false end end
  return true
end

-- the fused C ops (engine/src/ops/loss_ext.c) take tensors of one floating dtype and shape, and
-- weights that need no gradient; anything else takes the composite path below
local red_code = { none = 0, mean = 1, sum = 2, batchmean = 3 }
local function float_alike(a, b)
  local ca, cb = a._c, b._c
  if ca.ndim ~= cb.ndim or ca.dtype ~= cb.dtype or C.eng_dtype_is_floating(ca.dtype) == 0 then return false end
  local sa, sb = ca.shape, cb.shape  -- a DTensor's global shape is in its spec
  if ca.dist ~= nil then sa = ca.dist.shape end
  if cb.dist ~= nil then sb = cb.dist.shape end
  for i = 0, ca.ndim - 1 do if sa[i] ~= sb[i] then return false end end
  return true
end
local function const_weight(w) return w == nil or (core.is_tensor(w) and w._c.requires_grad == 0) end
local function weight_c(w, like)
  if w == nil then return nil end
  if like._c.dist ~= nil and w._c.dist == nil then w = lift(w, like) end
  return w._c
end

local function opts_of(opts, op, allowed)
  if opts == nil then return {} end
  if type(opts) ~= "table" or core.is_tensor(opts) then
    fail(string.format("%s: options must be a table, got %s", op, core.is_tensor(opts) and "a tensor" or type(opts)))
  end
  for k in pairs(opts) do
    if not allowed[k] then
      local names = {}
      for n in pairs(allowed) do names[#names + 1] = n end
      table.sort(names)
      fail(string.format("%s: unknown option '%s' (valid: %s)", op, tostring(k), table.concat(names, ", ")))
    end
  end
  return opts
end

local function reduction_of(opts, op, extra)
  local r = opts.reduction or "mean"
  if r ~= "mean" and r ~= "sum" and r ~= "none" and r ~= extra then
    fail(string.format("%s: reduction must be \"none\", \"mean\"%s or \"sum\", got %s", op,
      extra and (", \"" .. extra .. "\"") or "", tostring(r)))
  end
  return r
end

local function reduce(l, r)
  if r == "mean" then return l:mean() elseif r == "sum" then return l:sum() end
  return l
end

local function num_opt(v, default, op, name)
  if v == nil then return default end
  if type(v) ~= "number" then fail(string.format("%s: %s must be a number, got %s", op, name, type(v))) end
  return v
end

local function check_weight(w, C_, op, like)
  if w == nil then return nil end
  need(w, op, 3, "weight")
  if w:dim() ~= 1 or w:size(1) ~= C_ then
    fail(string.format("%s: weight must be a 1-D tensor of %d entries (one per class), got %s%s", op, C_, w.dtype, shp(w)))
  end
  if is_dt(like) and not is_dt(w) then w = lift(w, like) end
  return w
end

-- ============================================================ nll_loss
-- logp with classes in dim 2 (or the only dim), target 0-based ids.  Returns the
-- per-element losses [N, d...] (weights applied, ignored ones 0), the weights
-- per element and the ignore mask; weights and mask are nil when there is no
-- weight and no target equals ignore_index (the common case: fewer dispatches).
local function nll_parts(logp, target, weight, ignore, op)
  need(logp, op, 1); need(target, op, 2, "target")
  if target:is_floating_point() then
    fail(string.format("%s: target must hold class ids (i64/i32), got %s%s", op, target.dtype, shp(target)))
  end
  local nd = logp:dim()
  if nd == 0 then fail(op .. ": input must have at least 1 dim ([C], [N, C] or [N, C, d1, ...])") end
  local cdim = nd == 1 and 1 or 2
  local C_ = logp:size(cdim)
  local want = {}
  for i, s in ipairs(logp:shape()) do if i ~= cdim then want[#want + 1] = s end end
  local ts = target:shape()
  local ok = #ts == #want
  for i = 1, #want do if ts[i] ~= want[i] then ok = false end end
  if not ok then
    fail(string.format("%s: input %s%s (classes in dim %d) expects target of shape [%s], got %s%s", op, logp.dtype,
      shp(logp), cdim, table.concat(want, ","), target.dtype, shp(target)))
  end
  weight = check_weight(weight, C_, op, logp)
  if weight and weight.dtype ~= logp.dtype then weight = weight:to(logp.dtype) end
  local x = logp
  if nd == 1 then x = x:unsqueeze(1); target = target:view(1)
  elseif nd > 2 then x = x:movedim(2, -1) end
  -- the ids' range; only when ignore_index lies inside it can some target be ignored
  local ign, safe = nil, target
  if target:numel() > 0 then
    local lo, hi = number_of(target:min()), number_of(target:max())
    if ignore >= lo and ignore <= hi then
      ign = target:eq(ignore)
      safe = target:masked_fill(ign, 0)
      lo, hi = number_of(safe:min()), number_of(safe:max())
    end
    if lo < 0 or hi >= C_ then
      fail(string.format("%s: target %d is out of bounds for %d classes (class ids are 0-based; ignore_index %d)", op,
        lo < 0 and lo or hi, C_, ignore))
    end
  end
  local picked = x:gather(-1, safe:unsqueeze(-1)):squeeze(-1)
  if not weight and not ign then return -picked, nil, nil, nd end
  local w
  if weight then
    w = weight:index_select(1, safe:reshape(-1)):view(safe:shape())
  else
    w = Tensor.functions.ones_like(picked):detach()
  end
  if ign then w = w:masked_fill(ign, 0) end
  local loss = -(picked * w)
  return loss, w, ign, nd
end

local nll_opts = { weight = true, ignore_index = true, reduction = true }
function M.nll_loss(logp, target, opts)
  local op = "nll_loss"
  opts = opts_of(opts, op, nll_opts)
  local red = reduction_of(opts, op)
  local ignore = num_opt(opts.ignore_index, -100, op, "ignore_index")
  local weight = opts.weight
  if core.is_tensor(logp) and core.is_tensor(target) and logp:is_floating_point() and const_weight(weight) then
    -- one fused op (engine/src/ops/loss_ext.c) with the same checks and messages
    return wrap(C.eng_nll_loss(logp._c, target._c, weight_c(weight, logp), ignore, red_code[red]))
  end
  local loss, w, _, nd = nll_parts(logp, target, weight, ignore, op)
  if red == "none" then
    if nd == 1 then return loss:view({}) end
    return loss
  end
  if red == "sum" then return loss:sum() end
  if w == nil then return loss:mean() end  -- every weight 1
  local r = loss:sum() / w:sum()
  return r
end

-- ============================================================ cross_entropy (weights, label smoothing, probabilities)
local base_ce = require("engine.ops.nn").cross_entropy
local ce_opts = { weight = true, ignore_index = true, reduction = true, label_smoothing = true }
function M.cross_entropy(logits, target, opts)
  local op = "cross_entropy"
  opts = opts_of(opts, op, ce_opts)
  need(logits, op, 1); need(target, op, 2)
  local prob = target:is_floating_point()
  if opts.weight == nil and not prob then
    local o = { ignore_index = opts.ignore_index, reduction = opts.reduction, label_smoothing = opts.label_smoothing }
    return base_ce(logits, target, o)
  end
  local red = reduction_of(opts, op)
  local ignore = num_opt(opts.ignore_index, -100, op, "ignore_index")
  local ls = num_opt(opts.label_smoothing, 0, op, "label_smoothing")
  if ls < 0 or ls > 1 then fail(op .. ": label_smoothing must be between 0.0 and 1.0, got " .. ls) end
  local cw = opts.weight
  if not prob and logits:is_floating_point() and core.is_tensor(cw) and cw._c.requires_grad == 0 then
    -- one fused op (engine/src/ops/loss_ext.c): PyTorch's weighted formula with label smoothing
    return wrap(C.eng_cross_entropy_weighted(logits._c, target._c, weight_c(cw, logits), ignore, red_code[red], ls))
  end
  local nd = logits:dim()
  if nd == 0 then fail(op .. ": input must have at least 1 dim ([C], [N, C] or [N, C, d1, ...])") end
  local cdim = nd == 1 and 1 or 2
  local C_ = logits:size(cdim)
  local logp = logits:log_softmax(cdim)
  local weight = check_weight(opts.weight, C_, op, logits)
  if weight and weight.dtype ~= logits.dtype then weight = weight:to(logits.dtype) end
  local wshape = {}
  for i = 1, nd do wshape[i] = i == cdim and C_ or 1 end
  if prob then
    if not same_shape(logits, target) then
      fail(string.format("%s: class-probability target %s%s must have the input's shape %s", op, target.dtype,
        shp(target), shp(logits)))
    end
    local t = target
    if ls > 0 then t = t * (1 - ls) + ls / C_ end
    local lw = logp * t
    if weight then lw = lw * weight:view(wshape) end
    local l = -lw:sum(cdim)
    if red == "none" then return l end
    if red == "sum" then return l:sum() end
    local n = logits:numel() / C_
    local r = l:sum() / n
    return r
  end
  local loss, w, ign = nll_parts(logp, target, weight, ignore, op)
  if ls == 0 then
    if red == "none" then return nd == 1 and loss:view({}) or loss end
    if red == "sum" then return loss:sum() end
    local r = loss:sum() / w:sum()
    return r
  end
  local lw = weight and logp * weight:view(wshape) or logp
  local smooth = -lw:sum(cdim)
  if nd == 1 then smooth = smooth:view(1) end
  if ign then smooth = smooth:masked_fill(ign, 0) end
  local nll, sm
  if red == "none" then
    nll, sm = loss, smooth
    if nd == 1 then nll, sm = nll:view({}), sm:view({}) end
  elseif red == "sum" then nll, sm = loss:sum(), smooth:sum()
  else
    local wsum = w:sum()
    nll, sm = loss:sum() / wsum, smooth:sum() / wsum
  end
  local r = nll * (1 - ls) + sm * (ls / C_)
  return r
end

-- ============================================================ binary cross entropy
local bce_opts = { weight = true, reduction = true }
function M.binary_cross_entropy(p, target, opts)
  local op = "binary_cross_entropy"
  opts = opts_of(opts, op, bce_opts)
  need(p, op, 1); need(target, op, 2, "target")
  local red = reduction_of(opts, op)
  local weight = opts.weight
  if weight ~= nil then need(weight, op, 3, "weight") end
  if float_alike(p, target) and const_weight(weight) then
    -- one fused op: the 0..1 check in its kernel (agreed across ranks on DTensors)
    return wrap(C.eng_binary_cross_entropy(p._c, target._c, weight_c(weight, p), red_code[red]))
  end
  if not same_shape(p, target) then
    fail(string.format("%s: target %s%s must have the input's shape %s%s", op, target.dtype, shp(target), p.dtype, shp(p)))
  end
  if p:numel() > 0 then
    local pd = p:detach()
    local lo, hi = number_of(pd:min()), number_of(pd:max())
    if not (lo >= 0 and hi <= 1) then
      fail(string.format("%s: all elements of input should be between 0 and 1 (got min %g, max %g)", op, lo, hi))
    end
  end
  -- = -(target log p + (1 - target) log(1 - p)), one negation fewer (bitwise the same)
  local l = (target - 1) * (1 - p):log():clamp(-100, nil) - target * p:log():clamp(-100, nil)
  if opts.weight ~= nil then
    need(opts.weight, op, 3, "weight")
    local w = opts.weight
    if is_dt(p) and not is_dt(w) then w = lift(w, p) end
    l = l * w
  end
  return reduce(l, red)
end

local bcel_opts = { weight = true, pos_weight = true, reduction = true }
function M.binary_cross_entropy_with_logits(x, target, opts)
  local op = "binary_cross_entropy_with_logits"
  opts = opts_of(opts, op, bcel_opts)
  need(x, op, 1); need(target, op, 2, "target")
  local red = reduction_of(opts, op)
  local weight, pw = opts.weight, opts.pos_weight
  if weight ~= nil then need(weight, op, 3, "weight") end
  if pw ~= nil then need(pw, op, 3, "pos_weight") end
  if float_alike(x, target) and const_weight(weight) and const_weight(pw) then
    return wrap(C.eng_binary_cross_entropy_with_logits(x._c, target._c, weight_c(weight, x), weight_c(pw, x),
      red_code[red]))
  end
  if not same_shape(x, target) then
    fail(string.format("%s: target %s%s must have the input's shape %s%s", op, target.dtype, shp(target), x.dtype, shp(x)))
  end
  -- -log_sigmoid(x) = softplus(-x) = log1p(exp(-x)), one C op; its threshold (x returned above it)
  -- where exp(-threshold) is below the dtype's rounding (f64 37, else 20): the value of PyTorch's
  -- relu(-x) + log1p(exp(-|x|)) to rounding, and the gradient sigmoid(x) - target also at x = 0
  local sp = wrap(C.eng_softplus((-x)._c, 1, x.dtype == "f64" and 37 or 20))
  local l
  if opts.pos_weight ~= nil then
    need(opts.pos_weight, op, 3, "pos_weight")
    local pw = opts.pos_weight
    if is_dt(x) and not is_dt(pw) then pw = lift(pw, x) end
    local lw = (pw - 1) * target + 1
    l = (1 - target) * x + lw * sp
  else
    l = (1 - target) * x + sp
  end
  if opts.weight ~= nil then
    need(opts.weight, op, 3, "weight")
    local w = opts.weight
    if is_dt(x) and not is_dt(w) then w = lift(w, x) end
    l = l * w
  end
  return reduce(l, red)
end

-- ============================================================ kl_div
local kl_opts = { reduction = true, log_target = true }
function M.kl_div(input, target, opts)
  local op = "kl_div"
  opts = opts_of(opts, op, kl_opts)
  need(input, op, 1); need(target, op, 2, "target")
  local red = reduction_of(opts, op, "batchmean")
  if float_alike(input, target) then
    return wrap(C.eng_kl_div(input._c, target._c, red_code[red], opts.log_target and 1 or 0))
  end
  local l
  if opts.log_target then
    l = target:exp() * (target - input)
  else
    local safe = target:masked_fill(target:le(0), 1)  -- log(1) = 0 where target <= 0: xlogy(0, 0) = 0, no NaN in backward
    l = target * safe:log() - target * input
  end
  if red == "batchmean" then
    local n = input:dim() > 0 and input:size(1) or 1
    local r = l:sum() / n
    return r
  end
  return reduce(l, red)
end

-- ============================================================ smooth_l1 / huber
local sl1_opts = { reduction = true, beta = true }
function M.smooth_l1_loss(x, y, opts)
  local op = "smooth_l1_loss"
  opts = opts_of(opts, op, sl1_opts)
  need(x, op, 1); need(y, op, 2, "target")
  local red = reduction_of(opts, op)
  local beta = num_opt(opts.beta, 1, op, "beta")
  if beta < 0 then fail(op .. ": beta must be non-negative, got " .. beta) end
  if float_alike(x, y) then return wrap(C.eng_smooth_l1_loss(x._c, y._c, red_code[red], beta)) end
  local d = (x - y):abs()
  local l
  if beta == 0 then l = d
  else
    -- with u = min(d, beta): u (d - u / 2) / beta is 0.5 d^2 / beta below beta and d - beta / 2 above
    -- (PyTorch's two branches; gradient d / beta, 1), 2 dispatches fewer than a where of both
    local u = d:clamp(nil, beta)
    l = u * (d - u * 0.5)
    if beta ~= 1 then l = l * (1 / beta) end
  end
  return reduce(l, red)
end

local huber_opts = { reduction = true, delta = true }
function M.huber_loss(x, y, opts)
  local op = "huber_loss"
  opts = opts_of(opts, op, huber_opts)
  need(x, op, 1); need(y, op, 2, "target")
  local red = reduction_of(opts, op)
  local delta = num_opt(opts.delta, 1, op, "delta")
  if not (delta > 0) then fail(op .. ": delta must be positive, got " .. tostring(delta)) end
  if float_alike(x, y) then return wrap(C.eng_huber_loss(x._c, y._c, red_code[red], delta)) end
  local d = (x - y):abs()
  -- with u = min(d, delta): u (d - u / 2) is 0.5 d^2 below delta and delta (d - delta / 2) above
  -- (bitwise PyTorch's two branches; gradient d, delta), 2 dispatches fewer than a where of both
  local u = d:clamp(nil, delta)
  local l = u * (d - u * 0.5)
  return reduce(l, red)
end

-- ============================================================ activations
local function args2(a, b, names, defaults, op)
  if type(a) == "table" then
    local o = opts_of(a, op, { [names[1]] = true, [names[2] or "_"] = true })
    a, b = o[names[1]], names[2] and o[names[2]] or nil
  end
  return num_opt(a, defaults[1], op, names[1]), num_opt(b, defaults[2], op, names[2] or "_")
end

-- softplus, leaky_relu, elu and hardtanh are single C ops (engine/src/ops/unary.c: one dispatch,
-- PyTorch's gradients, the pointwise DTensor rule); the Lua side checks the arguments.
function M.softplus(x, beta, threshold)
  local op = "softplus"
  need(x, op, 1)
  beta, threshold = args2(beta, threshold, { "beta", "threshold" }, { 1, 20 }, op)
  return wrap(C.eng_softplus(ct(x, op, 1), beta, threshold))
end

function M.leaky_relu(x, slope)
  local op = "leaky_relu"
  need(x, op, 1)
  slope = args2(slope, nil, { "negative_slope" }, { 0.01 }, op)
  return wrap(C.eng_leaky_relu(ct(x, op, 1), slope))
end

function M.elu(x, alpha)
  local op = "elu"
  need(x, op, 1)
  alpha = args2(alpha, nil, { "alpha" }, { 1 }, op)
  return wrap(C.eng_elu(ct(x, op, 1), alpha))
end

function M.hardtanh(x, lo, hi)
  local op = "hardtanh"
  need(x, op, 1)
  lo, hi = args2(lo, hi, { "min_val", "max_val" }, { -1, 1 }, op)
  if lo > hi then fail(string.format("%s: min_val (%g) cannot be greater than max_val (%g)", op, lo, hi)) end
  -- PyTorch's gradient: 1 strictly inside (min_val, max_val), 0 outside AND at the bounds (clamp's is 1 there)
  return wrap(C.eng_hardtanh(ct(x, op, 1), lo, hi))
end
function M.relu6(x) return M.hardtanh(x, 0, 6) end

function M.glu(x, d)
  local op = "glu"
  need(x, op, 1)
  d = d or -1
  if type(d) == "table" then d = d.dim or -1 end
  if x:dim() == 0 then fail(op .. ": glu does not support 0-d tensors") end
  local cd = core.dim(d, x:dim(), op)
  local n = x:size(cd + 1)
  if n % 2 ~= 0 then
    fail(string.format("%s: Halving dimension must be even, but dimension %d is size %d", op, cd + 1, n))
  end
  local a, b = x:narrow(cd + 1, 1, n / 2), x:narrow(cd + 1, n / 2 + 1, n / 2)
  local r = a * b:sigmoid()
  return r
end

for _, name in ipairs({ "softplus", "leaky_relu", "elu", "hardtanh", "relu6", "glu" }) do methods[name] = M[name] end

return M
