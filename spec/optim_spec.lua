-- optim: SGD and AdamW against PyTorch's update formulas (computed here by
-- hand in float64), param groups, state dicts for exact resume, gradient
-- clipping and learning-rate schedules.
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local nn, optim = engine.nn, engine.optim
local sched = optim.lr_scheduler

local err = require("spec.helpers.errors").err -- err(fn, ...): fn raises, naming each string

local function close(a, b, tol, what)
  local av = engine.is_tensor(a) and a:tolist_flat() or a
  local bv = engine.is_tensor(b) and b:tolist_flat() or b
  assert.are.equal(#bv, #av, (what or "") .. ": sizes differ")
  for i = 1, #av do
    if math.abs(av[i] - bv[i]) > (tol or 1e-12) * math.max(1, math.abs(bv[i])) then
      error(string.format("%s: element %d: %.15g vs %.15g", what or "values", i, av[i], bv[i]), 2)
    end
  end
end

local function param(vals) return nn.Parameter(engine.tensor(vals, "f64")) end
local function set_grad(p, vals) p.grad = engine.tensor(vals, "f64") end

-- PyTorch's SGD on plain Lua numbers.
local function sgd_ref(p, grads, o)
  p = { unpack(p) }
  local buf
  for t, g in ipairs(grads) do
    buf = buf or {}
    for i = 1, #p do
      local d = g[i] + (o.weight_decay or 0) * p[i]
      if (o.momentum or 0) ~= 0 then
        if t == 1 then buf[i] = d else buf[i] = o.momentum * buf[i] + (1 - (o.dampening or 0)) * d end
        if o.nesterov then d = d + o.momentum * buf[i] else d = buf[i] end
      end
      p[i] = p[i] - o.lr * d
    end
  end
  return p
end

-- PyTorch's AdamW on plain Lua numbers.
local function adamw_ref(p, grads, o)
  p = { unpack(p) }
  local m, v = {}, {}
  for i = 1, #p do m[i], v[i] = 0, 0 end
  local b1, b2 = o.betas[1], o.betas[2]
  for t, g in ipairs(grads) do
    for i = 1, #p do
      p[i] = p[i] * (1 - o.lr * o.weight_decay)
      m[i] = b1 * m[i] + (1 - b1) * g[i]
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i]
      local bc1, bc2 = 1 - b1 ^ t, 1 - b2 ^ t
      local denom = math.sqrt(v[i]) / math.sqrt(bc2) + o.eps
      p[i] = p[i] - o.lr / bc1 * m[i] / denom
    end
  end
  return p, m, v
end

local P0 = { 0.5, -1.25, 2.0, 0.0 }
local G = { { 0.1, -0.2, 0.3, -0.4 }, { -0.5, 0.25, 0.05, 1.0 } }

describe("optim.SGD", function()
  local cases = {
    { lr = 0.1 },
    { lr = 0.1, weight_decay = 0.01 },
    { lr = 0.05, momentum = 0.9 },
    { lr = 0.05, momentum = 0.9, dampening = 0.3, weight_decay = 0.1 },
    { lr = 0.05, momentum = 0.8, nesterov = true, weight_decay = 0.02 },
  }
  for _, o in ipairs(cases) do
    local desc = {}
    for k, v in pairs(o) do desc[#desc + 1] = k .. "=" .. tostring(v) end
    table.sort(desc)
    it("matches PyTorch's update for 2 steps (" .. table.concat(desc, ", ") .. ")", function()
      local p = param(P0)
      local opt = optim.SGD({ p }, o)
      for t = 1, 2 do
        set_grad(p, G[t])
        opt:step()
      end
      close(p, sgd_ref(P0, G, o), 1e-14, "SGD")
      if (o.momentum or 0) ~= 0 then assert.is_truthy(opt.state[p].momentum_buffer) end
    end)
  end

  it("validates its options", function()
    local p = param(P0)
    err(function() optim.SGD({ p }, { lr = -1 }) end, "Invalid learning rate: -1")
    err(function() optim.SGD({ p }, { lr = 0.1, nesterov = true }) end, "Nesterov momentum requires a momentum")
    err(function() optim.SGD({ p }, { lr = 0.1, momentum = -1 }) end, "Invalid momentum value")
    err(function() optim.SGD({ p }, { lr = 0.1, moment = 0.9 }) end, "unknown option 'moment'")
    err(function() optim.SGD({}, { lr = 0.1 }) end, "empty parameter list")
  end)
end)

describe("optim.AdamW", function()
  it("matches PyTorch's update for 2 steps", function()
    local o = { lr = 0.01, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0.1 }
    local p = param(P0)
    local opt = optim.AdamW({ p }, o)
    for t = 1, 2 do
      set_grad(p, G[t])
      opt:step()
    end
    local ref, m, v = adamw_ref(P0, G, o)
    close(p, ref, 1e-13, "param")
    close(opt.state[p].exp_avg, m, 1e-14, "exp_avg")
    close(opt.state[p].exp_avg_sq, v, 1e-14, "exp_avg_sq")
    -- the step count as PyTorch keeps it: a 0-dim f32 tensor on the CPU
    local step = opt.state[p].step
    assert.are.same({ 0, "f32", "cpu", 2 }, { step:dim(), step.dtype, step.device, step:item() })
  end)

  it("uses PyTorch's defaults (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight_decay 1e-2)", function()
    local p = param(P0)
    local opt = optim.AdamW({ p })
    local g = opt.param_groups[1]
    assert.are.same({ 1e-3, 0.9, 0.999, 1e-8, 1e-2 }, { g.lr, g.betas[1], g.betas[2], g.eps, g.weight_decay })
    set_grad(p, G[1])
    opt:step()
    close(p, adamw_ref(P0, { G[1] }, { lr = 1e-3, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 1e-2 }),
      1e-13, "default step")
  end)

  it("supports param groups with their own options and skips parameters without gradients", function()
    local a, b, c = param(P0), param(P0), param(P0)
    local opt = optim.AdamW({ { params = { a }, lr = 0.1 }, { params = { b, c }, weight_decay = 0 } },
      { lr = 0.01, weight_decay = 0.5 })
    assert.are.equal(2, #opt.param_groups)
    assert.are.equal(0.1, opt.param_groups[1].lr)
    assert.are.equal(0.5, opt.param_groups[1].weight_decay)
    assert.are.equal(0.01, opt.param_groups[2].lr)
    set_grad(a, G[1]); set_grad(b, G[1])
    opt:step()
    close(a, adamw_ref(P0, { G[1] }, { lr = 0.1, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0.5 }), 1e-13, "a")
    close(b, adamw_ref(P0, { G[1] }, { lr = 0.01, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0 }), 1e-13, "b")
    close(c, P0, 0, "c has no gradient: untouched")
    assert.is_nil(opt.state[c])
    -- c gets a gradient later: its own step count starts at 1
    set_grad(c, G[1])
    opt:step()
    assert.are.equal(1, opt.state[c].step:item())
    assert.are.equal(2, opt.state[b].step:item())
    close(c, adamw_ref(P0, { G[1] }, { lr = 0.01, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0 }), 1e-13, "c")
  end)

  it("accepts an iterator of named parameters and a closure", function()
    local m = nn.Linear(2, 1, { dtype = "f64" })
    local opt = optim.AdamW(m:named_parameters(), { lr = 0.1 })
    assert.are.equal(2, #opt.param_groups[1].params)
    local x = engine.ones(3, 2, { dtype = "f64" })
    local loss = opt:step(function()
      opt:zero_grad()
      local l = m(x):pow(2):mean()
      l:backward()
      return l
    end)
    assert.is_truthy(loss)
    assert.are.equal(1, opt.state[m.weight].step:item())
  end)

  it("validates its options and parameters", function()
    local p = param(P0)
    err(function() optim.AdamW({ p }, { betas = { 1.0, 0.9 } }) end, "Invalid beta parameter at index 0: 1")
    err(function() optim.AdamW({ p }, { eps = -1 }) end, "Invalid epsilon value")
    err(function() optim.AdamW({ p }, { weight_decay = -0.1 }) end, "Invalid weight_decay value")
    err(function() optim.AdamW({ p }, { amsgrad = true }) end, "amsgrad is not supported")
    err(function() optim.AdamW({ p }, { lr = 0.1, beta = 0.9 }) end, "unknown option 'beta'")
    err(function() optim.AdamW({ p, p }) end, "more than one parameter group")
    err(function() optim.AdamW({ p * 2 }) end, "can't optimize a non-leaf tensor")
    err(function() optim.AdamW({ engine.ones(2, { dtype = "i64" }) }) end, "only floating-point tensors")
    err(function() optim.AdamW(5) end, "params must be")
    err(function() optim.AdamW({ 5 }) end, "parameter 1 is a number")
  end)
end)

describe("optim.Optimizer", function()
  it("zero_grad sets gradients to none, or to zero", function()
    local p = param(P0)
    local opt = optim.SGD({ p }, { lr = 0.1 })
    set_grad(p, G[1])
    opt:zero_grad(false)
    close(p.grad, { 0, 0, 0, 0 }, 0, "zeroed")
    opt:zero_grad()
    assert.is_nil(p.grad)
  end)

  local function train(opt_ctor, steps, resume_at)
    local p1, p2 = param(P0), param({ 1, 2 })
    local opt = opt_ctor({ p1, p2 })
    local grads = {}
    for t = 1, steps do grads[t] = { { t * 0.1, -0.2, 0.3 / t, 0.05 }, { 0.7 - t * 0.1, t * 0.01 } } end
    for t = 1, steps do
      if t == resume_at then
        -- save everything, rebuild from scratch, load, continue
        local sd = opt:state_dict()
        for _, s in pairs(sd.state) do for k, v in pairs(s) do if engine.is_tensor(v) then s[k] = v:clone() end end end
        local v1, v2 = p1:clone(), p2:clone()
        p1, p2 = nn.Parameter(v1), nn.Parameter(v2)
        opt = opt_ctor({ p1, p2 })
        opt:load_state_dict(sd)
      end
      set_grad(p1, grads[t][1]); set_grad(p2, grads[t][2])
      opt:step()
    end
    return p1, p2, opt
  end

  for _, c in ipairs({
    { "AdamW", function(ps) return optim.AdamW(ps, { lr = 0.05, weight_decay = 0.1 }) end },
    { "SGD with momentum", function(ps) return optim.SGD(ps, { lr = 0.05, momentum = 0.9, nesterov = true }) end },
  }) do
    it("resumes " .. c[1] .. " exactly from its state dict", function()
      local a1, a2 = train(c[2], 5)
      local b1, b2 = train(c[2], 5, 3)
      close(b1, a1, 0, "param 1")
      close(b2, a2, 0, "param 2")
    end)
  end

  it("state_dict numbers parameters 0, 1, ... and keeps hyperparameters", function()
    local _, _, opt = train(function(ps) return optim.AdamW(ps, { lr = 0.05 }) end, 2)
    local sd = opt:state_dict()
    assert.are.same({ 0, 1 }, sd.param_groups[1].params)
    assert.are.equal(0.05, sd.param_groups[1].lr)
    assert.are.equal(2, sd.state[0].step:item())
    assert.is_true(engine.is_tensor(sd.state[1].exp_avg_sq))
    local other = optim.AdamW({ param(P0) })
    err(function() other:load_state_dict(sd) end, "doesn't match the size of the optimizer's group")
    err(function() other:load_state_dict({}) end, "load_state_dict expects")
  end)

  -- PyTorch keeps state["step"] as a tensor, so state_dict() holds the live count and a checkpoint loaded into
  -- that table in place (dist.checkpoint.load) restores it along with the moments (PyTorch's resume order)
  it("keeps the step count as a live 0-dim tensor: an in-place load into state_dict() restores it", function()
    local _, _, opt = train(function(ps) return optim.AdamW(ps, { lr = 0.05 }) end, 2)
    local snap = {}
    for i, s in pairs(opt:state_dict().state) do
      snap[i] = {}
      for k, v in pairs(s) do snap[i][k] = v:clone() end
    end
    local p1 = opt.param_groups[1].params[1]
    set_grad(p1, { 1, 1, 1, 1 }); opt:step(); opt:step()
    assert.are.equal(4, opt.state[p1].step:item())
    engine.no_grad(function()
      for i, s in pairs(opt:state_dict().state) do for k, v in pairs(s) do v:copy_(snap[i][k]) end end
    end)
    assert.are.equal(2, opt.state[p1].step:item())
    close(opt.state[p1].exp_avg, snap[0].exp_avg, 0, "exp_avg back")
    -- load_state_dict takes a number or a one-element tensor, and makes its own tensor
    local sd = opt:state_dict()
    sd.state[0].step = 7
    sd.state[1].step = engine.tensor({ 5 }, "f64")
    local fresh = optim.AdamW({ param(P0), param({ 1, 2 }) })
    fresh:load_state_dict(sd)
    local ps = fresh.param_groups[1].params
    assert.are.same({ 7, 5 }, { fresh.state[ps[1]].step:item(), fresh.state[ps[2]].step:item() })
    assert.are.same({ 0, "f32", "cpu" }, { fresh.state[ps[2]].step:dim(), fresh.state[ps[2]].step.dtype,
      fresh.state[ps[2]].step.device })
    assert.are_not.equal(sd.state[1].step, fresh.state[ps[2]].step)
    sd.state[0].step = engine.ones(2)
    err(function() fresh:load_state_dict(sd) end, "optimizer state 'step' must be a number or a one-element tensor")
  end)

  it("round-trips through a flat state dict (safetensors-friendly)", function()
    local _, _, opt = train(function(ps) return optim.AdamW(ps, { lr = 0.05, betas = { 0.8, 0.9 } }) end, 2)
    local tensors, meta = opt:flatten_state_dict("optim.")
    assert.is_truthy(tensors["optim.state.0.exp_avg"])
    assert.are.equal("2", meta["optim.state.1.step"])
    assert.are.equal("list:0.80000000000000004,0.90000000000000002", meta["optim.param_groups.1.betas"])
    local path = os.tmpname()
    engine.save(path, tensors, meta)
    local t2, m2 = engine.load(path)
    os.remove(path)
    local fresh = optim.AdamW({ param(P0), param({ 1, 2 }) })
    fresh:load_flat_state_dict(t2, m2, "optim.")
    local g = fresh.param_groups[1]
    assert.are.same({ 0.05, 0.8, 0.9 }, { g.lr, g.betas[1], g.betas[2] })
    local p = fresh.param_groups[1].params[1]
    assert.are.equal(2, fresh.state[p].step:item())
    close(fresh.state[p].exp_avg, opt.state[opt.param_groups[1].params[1]].exp_avg, 0, "exp_avg")
  end)

  it("prints its groups", function()
    local s = tostring(optim.AdamW({ param(P0) }, { lr = 0.5 }))
    assert.is_truthy(s:find("AdamW (", 1, true))
    assert.is_truthy(s:find("lr: 0.5", 1, true))
  end)
end)

describe("gradient clipping", function()
  it("scales the gradients to max_norm and returns the total norm", function()
    local a, b = param({ 0, 0 }), param({ 0 })
    set_grad(a, { 3, 0 }); set_grad(b, { 4 })
    local total = optim.clip_grad_norm({ a, b }, 1.0)
    assert.are.equal(5, total:item())
    local s = 1 / (5 + 1e-6)
    close(a.grad, { 3 * s, 0 }, 1e-12, "a")
    close(b.grad, { 4 * s }, 1e-12, "b")
    -- already below: unchanged
    local t2 = nn.utils.clip_grad_norm_({ a, b }, 10)
    assert.is_true(math.abs(t2:item() - 1) < 1e-5)
    close(a.grad, { 3 * s, 0 }, 1e-12, "unchanged")
  end)

  -- PyTorch's test_clip_grad_norm (test/test_nn.py): a Linear(10, 10) with gradients 1..100 and 1/1000,
  -- norm types 0.5, 1.5, 2, 4, inf: the returned norm is the norm before, the norm after is max_norm, one
  -- scale for all; small gradients are left as they are; a single tensor is accepted as a list of one.
  it("follows PyTorch's test_clip_grad_norm: a 0-dim tensor, the norm before, one scale, small grads untouched", function()
    local l = nn.Linear(10, 10)
    local max_norm = 2
    local function compute_norm(pt)
      local ps = l:parameters()
      if pt == "inf" then
        local m = 0
        for _, p in ipairs(ps) do m = math.max(m, p.grad:abs():max():item()) end
        return m
      end
      local tot = 0
      for _, p in ipairs(ps) do tot = tot + p.grad:to("f64"):abs():pow(pt):sum():item() end
      return tot ^ (1 / pt)
    end
    local function compare_scaling(grads)
      local ps, scales = l:parameters(), {}
      for i, p in ipairs(ps) do
        for _, v in ipairs((p.grad:to("f64") / grads[i]:to("f64")):tolist_flat()) do scales[#scales + 1] = v end
      end
      for i = 2, #scales do assert.is_true(math.abs(scales[i] - scales[1]) <= 1e-6 * scales[1], "one scale") end
      return scales[1]
    end
    local big = { engine.arange(1, 101):to("f32"):view(10, 10), engine.ones(10) / 1000 }
    for _, pt in ipairs({ 0.5, 1.5, 2, 4, "inf" }) do
      for i, p in ipairs(l:parameters()) do p.grad = big[i]:clone() end
      local before = compute_norm(pt)
      local norm = nn.utils.clip_grad_norm_(l:parameters(), max_norm, pt)
      assert.is_true(engine.is_tensor(norm) and norm:dim() == 0 and norm.dtype == "f32" and norm.device == "cpu",
        tostring(norm))
      assert.is_false(engine.distributed.is_dtensor(norm))
      assert.is_true(math.abs(norm:item() - before) <= 1e-5 * before, pt .. ": " .. norm:item() .. " vs " .. before)
      local after = compute_norm(pt)
      assert.is_true(math.abs(after - max_norm) <= 1e-4 * max_norm, pt .. ": after " .. after)
      assert.is_true(after <= before)
      compare_scaling(big)
    end
    engine.manual_seed(3)
    local small = { engine.rand(10, 10) / 10000, engine.ones(10) / 500 }
    for _, pt in ipairs({ 0.5, 1.5, 2, 4, "inf" }) do
      for i, p in ipairs(l:parameters()) do p.grad:copy_(small[i]) end
      local before = compute_norm(pt)
      local norm = nn.utils.clip_grad_norm_(l:parameters(), max_norm, pt)
      assert.is_true(math.abs(norm:item() - before) <= 1e-5 * before, pt .. ": small")
      assert.are.equal(before, compute_norm(pt))
      assert.is_true(before <= max_norm)
      assert.are.equal(1, compare_scaling(small))
    end
    -- a single tensor is the list of one
    local p1, p2 = nn.Parameter(engine.randn(10, 10)), nn.Parameter(engine.randn(10, 10))
    p1.grad = engine.arange(1, 101):to("f32"):view(10, 10); p2.grad = p1.grad:clone()
    for _, pt in ipairs({ 0.5, 1.5, 2, 4, "inf" }) do
      nn.utils.clip_grad_norm_(p1, max_norm, pt)
      nn.utils.clip_grad_norm_({ p2 }, max_norm, pt)
      close(p1.grad, p2.grad, 0, "single tensor " .. pt)
    end
  end)

  it("returns f64 for f64 gradients, f32 0 without gradients, and takes PyTorch's positional arguments", function()
    local a = param({ 3, 4 })
    set_grad(a, { 3, 4 })
    local n = optim.clip_grad_norm_({ a }, 100, 2, false, nil)
    assert.are.equal("f64", n.dtype)
    assert.are.equal(5, n:item())
    local none = optim.clip_grad_norm_({ param({ 1 }) }, 1)
    assert.are.same({ "f32", 0, 0 }, { none.dtype, none:dim(), none:item() })
    local empty = optim.clip_grad_norm_({}, 1)
    assert.are.same({ "f32", 0, "cpu" }, { empty.dtype, empty:item(), empty.device })
    assert.are.equal(5, optim.grad_norm({ a }):item())
    err(function() optim.clip_grad_norm_({ a }, 1, 2, { error_if_nonfinte = true }) end,
      "clip_grad_norm_: unknown option 'error_if_nonfinte' (known: error_if_nonfinite, foreach)")
    err(function() optim.clip_grad_norm_({ a }, 1, 2, "yes") end, "error_if_nonfinite (a boolean) or an options table")
  end)

  it("supports the inf norm, skips parameters without gradients and reports norms", function()
    local a, b, c = param({ 0, 0 }), param({ 0 }), param({ 1 })
    set_grad(a, { -3, 1 }); set_grad(b, { 2 })
    assert.are.equal(3, optim.grad_norm({ a, b, c }, "inf"):item())
    assert.is_true(math.abs(optim.grad_norm({ a, b, c }):item() - math.sqrt(14)) < 1e-12)
    assert.is_true(math.abs(optim.global_norm({ engine.tensor({ 3.0, 4.0 }, "f64") }) - 5) < 1e-12)
    local total = optim.clip_grad_norm({ a, b, c }, 1.5, math.huge)
    assert.are.equal(3, total:item())
    close(a.grad, { -3 * 1.5 / (3 + 1e-6), 1.5 / (3 + 1e-6) }, 1e-12, "inf-norm clip")
    assert.are.equal(0, optim.clip_grad_norm({ c }, 1.0):item())
    optim.clip_grad_value_({ a, b }, 0.5)
    close(b.grad, { 0.5 }, 0, "clip by value")
    err(function() optim.clip_grad_norm({ a }, 1, -1) end, "norm_type must be a positive number")
    err(function() optim.clip_grad_norm({ a }, "x") end, "max_norm must be a number")
    err(function() optim.clip_grad_norm(5, 1) end, "expected a tensor, a list of tensors")
  end)

  it("can error on a non-finite total norm, leaving the gradients as they are (PyTorch checks before scaling)", function()
    local a, b = param({ 0 }), param({ 0, 0 })
    set_grad(a, { math.huge }); set_grad(b, { 1, 2 })
    err(function() optim.clip_grad_norm({ a, b }, 1, 2, { error_if_nonfinite = true }) end, "non-finite")
    err(function() optim.clip_grad_norm({ a, b }, 1, 2, true) end, "non-finite")
    err(function() optim.grad_norm({ a, b }, 2, true) end, "grad_norm: the total norm of order 2")
    close(b.grad, { 1, 2 }, 0, "not scaled")
    -- without the flag the gradients are scaled by the non-finite norm, as in PyTorch
    assert.are.equal(math.huge, optim.clip_grad_norm({ a, b }, 1):item())
    close(b.grad, { 0, 0 }, 0, "scaled by 1/inf")
  end)
end)

describe("optim.lr_scheduler", function()
  local function opt_with(lr)
    return optim.SGD({ param({ 0 }), param({ 0 }) }, { lr = lr })
  end

  it("LambdaLR sets lr = base * lambda(step) from step 0 on", function()
    local opt = opt_with(0.1)
    local s = sched.LambdaLR(opt, function(e) return 1 / (e + 1) end)
    assert.are.same({ 0.1 }, s:get_last_lr())
    assert.are.equal(0.1, opt.param_groups[1].lr)
    s:step()
    assert.is_true(math.abs(opt.param_groups[1].lr - 0.05) < 1e-15)
    s:step()
    assert.is_true(math.abs(s:get_last_lr()[1] - 0.1 / 3) < 1e-15)
    assert.are.equal(0.1, opt.param_groups[1].initial_lr)
    err(function() sched.LambdaLR(opt, { function() return 1 end, function() return 1 end }) end,
      "expected 1 lr_lambdas, but got 2")
  end)

  it("CosineAnnealingLR and StepLR follow their closed forms", function()
    local opt = opt_with(1.0)
    local s = sched.CosineAnnealingLR(opt, 10, 0.1)
    local lrs = { s:get_last_lr()[1] }
    for _ = 1, 10 do s:step(); lrs[#lrs + 1] = s:get_last_lr()[1] end
    for e = 0, 10 do
      local expect = 0.1 + 0.9 * (1 + math.cos(math.pi * e / 10)) / 2
      assert.is_true(math.abs(lrs[e + 1] - expect) < 1e-12, "cosine at " .. e)
    end
    local o2 = opt_with(1.0)
    local st = sched.StepLR(o2, 3, 0.5)
    local got = { st:get_last_lr()[1] }
    for _ = 1, 6 do st:step(); got[#got + 1] = st:get_last_lr()[1] end
    assert.are.same({ 1, 1, 1, 0.5, 0.5, 0.5, 0.25 }, got)
  end)

  it("warmup_cosine warms up linearly, then decays to min_lr_ratio", function()
    local opt = opt_with(1e-3)
    local s = sched.warmup_cosine(opt, { warmup_steps = 4, max_steps = 14, min_lr_ratio = 0.1 })
    local lrs = { s:get_last_lr()[1] }
    for _ = 1, 15 do s:step(); lrs[#lrs + 1] = opt.param_groups[1].lr end
    local function near(a, b) return math.abs(a - b) < 1e-15 end
    assert.is_true(near(lrs[1], 0.25e-3) and near(lrs[2], 0.5e-3) and near(lrs[4], 1e-3))
    assert.is_true(near(lrs[5], 1e-3))                                   -- step 4: start of decay
    assert.is_true(near(lrs[10], 1e-3 * (0.1 + 0.9 * 0.5)))               -- step 9: half way
    assert.is_true(near(lrs[15], 1e-4) and near(lrs[16], 1e-4))         -- steps 14, 15: the floor
    err(function() sched.warmup_cosine(opt, { warmup_steps = 20, max_steps = 10 }) end,
      "warmup_steps must be between 0 and max_steps")
    err(function() sched.warmup_cosine(opt, {}) end, "max_steps must be a positive integer")
  end)

  it("resumes from its state dict", function()
    local o1 = opt_with(0.2)
    local s1 = sched.warmup_cosine(o1, { warmup_steps = 2, max_steps = 10 })
    for _ = 1, 4 do s1:step() end
    local sd = s1:state_dict()
    local o2 = opt_with(0.2)
    local s2 = sched.warmup_cosine(o2, { warmup_steps = 2, max_steps = 10 })
    s2:load_state_dict(sd)
    assert.are.same(s1:get_last_lr(), s2:get_last_lr())
    assert.are.equal(o1.param_groups[1].lr, o2.param_groups[1].lr)
    s1:step(); s2:step()
    assert.are.same(s1:get_last_lr(), s2:get_last_lr())
    err(function() s2:load_state_dict({}) end, "load_state_dict expects")
  end)
end)
