-- Fused optimizer kernels (AdamW, SGD), global norms and clip_grad_norm_:
-- values by hand and from torch.optim (torch 1.13), dtypes, layouts, errors.
local engine = require("engine")

local function errmatch(fn, pat)
  local ok, err = pcall(fn)
  assert.is_false(ok, "expected an error matching '" .. pat .. "'")
  assert.truthy(tostring(err):find(pat, 1, true), "error '" .. tostring(err) .. "' does not contain '" .. pat .. "'")
  return err
end

local function close(want, got, tol, what)
  local g = engine.is_tensor(got) and got:tolist_flat() or got
  assert.are.equal(#want, #g, what)
  for i = 1, #want do
    local err = math.abs(want[i] - g[i]) / math.max(1, math.abs(want[i]))
    assert.is_true(err <= tol, string.format("%s[%d]: want %.17g got %.17g", what or "value", i, want[i], g[i]))
  end
end

local P0 = { { 0.5, -1.25, 2.0 }, { 0.125, 3.0, -0.75 } }
local function grad_at(s, dt)
  return engine.tensor({ { 0.1 * s, -0.2, 0.3 }, { 0.05, -0.4 * s, 1.5 } }, "f64"):to(dt)
end

-- Five steps of an optimizer on P0 with the gradients above.
local function run(dt, step_fn, state_dt)
  local p = engine.tensor(P0, "f64"):to(dt)
  local st = { engine.zeros(2, 3, { dtype = state_dt or dt }), engine.zeros(2, 3, { dtype = state_dt or dt }) }
  for s = 1, 5 do step_fn(p, grad_at(s, dt), st, s) end
  return p
end

local function adamw(opts)
  return function(p, g, st, s)
    local o = {}
    for k, v in pairs(opts) do o[k] = v end
    o.step = s
    engine.adamw_step({ p }, { g }, { st[1] }, { st[2] }, o)
  end
end

local function sgd(opts)
  return function(p, g, st, s)
    local o = {}
    for k, v in pairs(opts) do o[k] = v end
    o.first_step = s == 1
    engine.sgd_step({ p }, { g }, { st[1] }, o)
  end
end

-- torch.optim results after 5 steps (f32 to 9 digits, f64 to 17).
local REF = {
  adamw = { f32 = { 0.449094355, -1.19386244, 1.9401201, 0.074476175, 3.03344083, -0.796157539 },
    f64 = { 0.44909430927115829, -1.1938623900512439, 1.9401198817233247, 0.074476158780633017, 3.0334406577628217,
      -0.79615759212109183 } },
  adamw2 = { f32 = { 0.24933438, -1.00000143, 1.75000083, -0.12499503, 3.25066662, -0.999999762 },
    f64 = { 0.24933437962724972, -1.0000012499937503, 1.7500008333305554, -0.124995000099998, 3.2506666530767174,
      -0.99999983333344455 } },
  sgd_mom = { f32 = { 0.204896063, -0.990483046, 1.60919809, 0.0624106377, 4.11935282, -2.5727241 },
    f64 = { 0.20489607174866731, -0.99048310986628663, 1.6091980948574669, 0.06241063237951619, 4.11935291532681,
      -2.5727245107038454 } },
  sgd_nest = { f32 = { 0.0574934483, -0.89382273, 1.4636389, 0.0390984192, 4.68622017, -3.25162125 },
    f64 = { 0.057493468707169315, -0.8938227114580265, 1.4636389066662046, 0.039098418645759365, 4.6862197043379172,
      -3.2516216618771545 } },
  sgd_plain = { f32 = { 0.349999994, -1.1500001, 1.85000014, 0.0999999866, 3.60000014, -1.49999988 },
    f64 = { 0.34999999999999998, -1.1499999999999999, 1.8499999999999999, 0.099999999999999978, 3.6000000000000005,
      -1.4999999999999998 } },
}

local CASES = {
  adamw = adamw({ lr = 0.01, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0.1 }),
  adamw2 = adamw({ lr = 0.05, beta1 = 0.8, beta2 = 0.99, eps = 1e-6, weight_decay = 0 }),
  sgd_mom = sgd({ lr = 0.1, momentum = 0.9, dampening = 0.1, weight_decay = 0.01 }),
  sgd_nest = sgd({ lr = 0.1, momentum = 0.9, nesterov = true, weight_decay = 0.01 }),
}

describe("adamw_step", function()
  it("does one step as computed by hand", function()
    local p, g = engine.tensor({ 1.0 }, "f64"), engine.tensor({ 0.5 }, "f64")
    local m, v = engine.zeros(1, { dtype = "f64" }), engine.zeros(1, { dtype = "f64" })
    engine.adamw_step({ p }, { g }, { m }, { v }, { lr = 0.1, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0.01, step = 1 })
    -- p = 1 * (1 - 0.1 * 0.01) = 0.999; m = 0.05; v = 0.00025
    -- p -= 0.1 / (1 - 0.9) * m / (sqrt(v) / sqrt(1 - 0.999) + 1e-8) = 0.05 / (0.5 + 1e-8)
    close({ 0.05 }, m, 1e-15, "m")
    close({ 0.00025 }, v, 1e-15, "v")
    close({ 0.999 - 0.05 / (0.5 + 1e-8) }, p, 1e-15, "p")
  end)

  for _, name in ipairs({ "adamw", "adamw2", "sgd_mom", "sgd_nest" }) do
    it("matches torch.optim over 5 steps in f32 and f64 (" .. name .. ")", function()
      close(REF[name].f32, run("f32", CASES[name]), 2e-7, name .. " f32")
      close(REF[name].f64, run("f64", CASES[name]), 1e-14, name .. " f64")
    end)
  end

  it("updates bf16/f16 parameters with f32 state in f32 math", function()
    for _, dt in ipairs({ "bf16", "f16" }) do
      local p = run(dt, CASES.adamw, "f32")
      assert.are.equal(dt, p.dtype)
      -- bf16 keeps 8 bits: each of the 5 updates rounds to 2^-7 near 1
      close(REF.adamw.f32, p, dt == "bf16" and 3e-2 or 2e-3, dt)
      local q = run(dt, CASES.adamw, dt) -- state in the parameter dtype is allowed too
      close(REF.adamw.f32, q, dt == "bf16" and 3e-2 or 2e-3, dt .. " state")
    end
  end)

  it("updates strided parameters, gradients and states in place", function()
    local base = engine.tensor(P0, "f64"):t():contiguous() -- [3, 2]
    local p = base:t() -- [2, 3] view with strides (1, 2)
    local st = { engine.zeros(3, 2, { dtype = "f64" }):t(), engine.zeros(3, 2, { dtype = "f64" }):t() }
    for s = 1, 5 do CASES.adamw(p, grad_at(s, "f64"):t():contiguous():t(), st, s) end
    close(REF.adamw.f64, p:contiguous(), 1e-14, "strided")
    close(REF.adamw.f64, base:t():contiguous(), 1e-14, "base storage")
  end)

  it("skips parameters without a gradient and handles several tensors at once", function()
    local a, b = engine.ones(2), engine.ones(3)
    local m = { engine.zeros(2), engine.zeros(3) }
    local v = { engine.zeros(2), engine.zeros(3) }
    engine.adamw_step({ a, b }, { nil, engine.ones(3) }, m, v, { lr = 0.1, step = 1 })
    assert.are.same({ 1, 1 }, a:tolist_flat())
    assert.is_true(b:tolist_flat()[1] < 1)
    engine.adamw_step({ a, b }, { engine.ones(2), false }, { m[1] }, { v[1] }, { lr = 0.1, step = 1 })
    assert.is_true(a:tolist_flat()[1] < 1)
  end)

  it("works on leaves that require grad and bumps their version", function()
    local p = engine.ones(3, { requires_grad = true })
    local m, v = engine.zeros(3), engine.zeros(3)
    local y = p * p
    engine.adamw_step({ p }, { engine.ones(3) }, { m }, { v }, { step = 1 })
    errmatch(function() y:sum():backward() end, "modified by an in-place operation")
  end)

  it("validates everything before touching any tensor", function()
    local p1, p2 = engine.ones(2), engine.ones(3)
    local g1, m1, v1 = engine.ones(2), engine.zeros(2), engine.zeros(2)
    local before = p1:tolist_flat()
    errmatch(function()
      engine.adamw_step({ p1, p2 }, { g1, engine.ones(2) }, { m1, engine.zeros(3) }, { v1, engine.zeros(3) }, { step = 1 })
    end, "adamw_step: grad 2 f32[2] does not match the shape of param f32[3]")
    assert.are.same(before, p1:tolist_flat())
    assert.are.same({ 0, 0 }, m1:tolist_flat())
  end)

  it("reports mismatches and bad hyper-parameters", function()
    local p, g, m, v = engine.ones(2), engine.ones(2), engine.zeros(2), engine.zeros(2)
    local function step(opts, pp, gg, mm, vv)
      engine.adamw_step({ pp or p }, { gg or g }, { mm or m }, { vv or v }, opts)
    end
    errmatch(function() step({ step = 1 }, nil, engine.ones(2, { dtype = "f64" })) end, "grad 1 f64[2] has the wrong dtype for param f32[2] (expected f32)")
    errmatch(function() step({ step = 1 }, nil, nil, engine.zeros(2, { dtype = "bf16" })) end, "exp_avg 1 bf16[2] has the wrong dtype")
    errmatch(function() step({ step = 1 }, nil, nil, nil, engine.zeros(3)) end, "exp_avg_sq 1 f32[3] does not match the shape")
    errmatch(function() engine.adamw_step({ p }, { g }, {}, { v }, { step = 1 }) end, "exp_avg 1 is NULL")
    errmatch(function() step({ step = 1 }, engine.ones(2, { dtype = "i64" }), engine.ones(2, { dtype = "i64" })) end, "param 1 i64[2] is not floating point")
    errmatch(function() step({ step = 0 }) end, "step must be >= 1")
    errmatch(function() step({}) end, "option step is required")
    errmatch(function() step({ step = 1.5 }) end, "step must be an integer")
    errmatch(function() step({ step = 1, betas = { 1.0, 0.9 } }) end, "invalid beta1 1")
    errmatch(function() step({ step = 1, beta2 = -0.1 }) end, "invalid beta2 -0.1")
    errmatch(function() step({ step = 1, lr = -1 }) end, "invalid learning rate -1")
    errmatch(function() step({ step = 1, eps = -1 }) end, "invalid eps")
    errmatch(function() step({ step = 1, weight_decay = -1 }) end, "invalid weight_decay")
    errmatch(function() step({ step = 1, lrr = 1 }) end, "unknown option 'lrr'")
    errmatch(function() step({ step = 1, lr = "x" }) end, "lr must be a number")
    errmatch(function() engine.adamw_step({ p }, { "g" }, { m }, { v }, { step = 1 }) end, "grads[1] must be a tensor")
  end)
end)

describe("sgd_step", function()
  it("matches torch.optim.SGD without momentum (no buffers needed)", function()
    for _, dt in ipairs({ "f32", "f64" }) do
      local p = engine.tensor(P0, "f64"):to(dt)
      for s = 1, 5 do engine.sgd_step({ p }, { grad_at(s, dt) }, nil, { lr = 0.1 }) end
      close(REF.sgd_plain[dt], p, dt == "f32" and 2e-7 or 1e-15, "plain " .. dt)
    end
  end)

  it("sets the momentum buffer to the gradient on the first step", function()
    local p, g, b = engine.ones(2, { dtype = "f64" }), engine.tensor({ 0.5, -2 }, "f64"), engine.full({ 2 }, 99, { dtype = "f64" })
    engine.sgd_step({ p }, { g }, { b }, { lr = 0.1, momentum = 0.9, dampening = 0.5, first_step = true })
    assert.are.same({ 0.5, -2 }, b:tolist_flat())
    close({ 0.95, 1.2 }, p, 1e-15, "p")
    engine.sgd_step({ p }, { g }, { b }, { lr = 0.1, momentum = 0.9, dampening = 0.5 })
    close({ 0.5 * 0.9 + 0.25, -2 * 0.9 - 1 }, b, 1e-15, "buf")
  end)

  it("handles bf16 parameters and strided tensors", function()
    local p = run("bf16", CASES.sgd_mom, "f32")
    close(REF.sgd_mom.f32, p, 2e-2, "bf16")
    local base = engine.tensor(P0, "f64"):t():contiguous()
    local q = base:t()
    local st = { engine.zeros(3, 2, { dtype = "f64" }):t() }
    for s = 1, 5 do CASES.sgd_mom(q, grad_at(s, "f64"), st, s) end
    close(REF.sgd_mom.f64, q:contiguous(), 1e-14, "strided")
  end)

  it("reports errors", function()
    local p, g = engine.ones(2), engine.ones(2)
    errmatch(function() engine.sgd_step({ p }, { g }, nil, {}) end, "option lr is required")
    errmatch(function() engine.sgd_step({ p }, { g }, nil, { lr = 0.1, momentum = 0.9 }) end, "momentum 0.9 needs momentum buffers")
    errmatch(function() engine.sgd_step({ p }, { g }, {}, { lr = 0.1, momentum = 0.9 }) end, "momentum buffer 1 is NULL")
    errmatch(function() engine.sgd_step({ p }, { g }, { engine.zeros(3) }, { lr = 0.1, momentum = 0.9 }) end, "momentum buffer 1 f32[3] does not match")
    errmatch(function() engine.sgd_step({ p }, { g }, nil, { lr = 0.1, nesterov = true }) end, "nesterov momentum requires a momentum > 0 and zero dampening")
    errmatch(function() engine.sgd_step({ p }, { g }, { engine.zeros(2) }, { lr = 0.1, momentum = 0.9, dampening = 0.1, nesterov = true }) end, "zero dampening")
    errmatch(function() engine.sgd_step({ p }, { engine.ones(2, 1) }, nil, { lr = 0.1 }) end, "grad 1 f32[2,1] does not match the shape of param f32[2]")
    errmatch(function() engine.sgd_step({ p }, { g }, nil, { lr = -0.1 }) end, "invalid learning rate")
    errmatch(function() engine.sgd_step({ p }, { g }, nil, { lr = 0.1, momentum = -1 }) end, "invalid momentum")
  end)
end)

describe("global_norm", function()
  local function grads()
    return { engine.tensor({ { 3, -4 }, { 1, 2 } }, "f32"), engine.tensor({ -2, 0.5, 6 }, "f32") }
  end

  it("computes the total p-norm of several tensors as if concatenated", function()
    local ts = grads()
    close({ math.sqrt(9 + 16 + 1 + 4 + 4 + 0.25 + 36) }, { engine.global_norm(ts) }, 1e-15, "p=2")
    close({ 18.5 }, { engine.global_norm(ts, 1) }, 1e-15, "p=1")
    close({ 6 }, { engine.global_norm(ts, math.huge) }, 0, "p=inf")
    close({ 6 }, { engine.global_norm(ts, "inf") }, 0, "p='inf'")
    close({ 0.5 }, { engine.global_norm(ts, -math.huge) }, 0, "p=-inf")
    close({ 7 }, { engine.global_norm(ts, 0) }, 0, "p=0 counts nonzeros")
    close({ 324.125 ^ (1 / 3) }, { engine.global_norm(ts, 3) }, 1e-14, "p=3")
    local s = math.sqrt(3) + 2 + 1 + math.sqrt(2) + math.sqrt(2) + math.sqrt(0.5) + math.sqrt(6)
    close({ s * s }, { engine.global_norm(ts, 0.5) }, 1e-14, "p=0.5")
    assert.are.equal(0, engine.global_norm({}))
  end)

  it("accumulates in double for every dtype and layout", function()
    local big = engine.full({ 1000 }, 0.1, { dtype = "f32" })
    local want = math.sqrt(1000 * (0.1 * 0.1 + 1e-9)) -- f32(0.1) = 0.100000001490116...
    local f32_01 = engine.tensor({ 0.1 }):double():item()
    close({ math.sqrt(1000) * f32_01 }, { engine.global_norm({ big }) }, 1e-14, "f32")
    assert.is_true(math.abs(engine.global_norm({ big }) - want) < 1e-3)
    local t = engine.tensor({ { 1, 2 }, { 3, 4 } }, "bf16"):t()
    close({ math.sqrt(30) }, { engine.global_norm({ t }) }, 1e-15, "bf16 strided")
  end)

  it("propagates NaN and rejects bad orders and dtypes", function()
    local n = engine.global_norm({ engine.tensor({ 1, 0 / 0 }) }, math.huge)
    assert.is_true(n ~= n)
    errmatch(function() engine.global_norm({ engine.ones(2) }, -1) end, "unsupported norm order p = -1")
    errmatch(function() engine.global_norm({ engine.ones(2) }, "two") end, "norm order p must be a number")
    errmatch(function() engine.global_norm({ engine.ones(2, { dtype = "i64" }) }) end, "tensor 1 i64[2] is not floating point")
    errmatch(function() engine.global_norm({ engine.ones(2), 3 }) end, "tensors[2] must be a tensor")
  end)
end)

describe("clip_grad_norm_", function()
  local function params()
    local a, b = engine.zeros(2, 2, { requires_grad = true }), engine.zeros(3, { requires_grad = true })
    a.grad = engine.tensor({ { 3, -4 }, { 1, 2 } }, "f32")
    b.grad = engine.tensor({ -2, 0.5, 6 })
    return a, b
  end

  it("scales the gradients by max_norm / (total + 1e-6) when above max_norm (torch values)", function()
    local a, b = params()
    local c = engine.zeros(4, { requires_grad = true }) -- no grad: skipped
    local total = engine.clip_grad_norm_({ a, c, b }, 2.0)
    close({ 8.381526947021484 }, { total }, 1e-7, "total")
    close({ 0.715859949588776, -0.954479932785034, 0.238619983196259, 0.477239966392517 }, a.grad, 1e-6, "a")
    close({ -0.477239966392517, 0.119309991598129, 1.43171989917755 }, b.grad, 1e-6, "b")
    assert.is_nil(c.grad)
    assert.is_true(math.abs(engine.global_norm({ a.grad, b.grad }) - 2) < 1e-5)
  end)

  it("leaves gradients alone below max_norm and supports other orders", function()
    local a, b = params()
    local total = engine.clip_grad_norm_({ a, b }, 100)
    assert.are.same({ 3, -4, 1, 2 }, a.grad:tolist_flat())
    close({ math.sqrt(70.25) }, { total }, 1e-15, "total")
    local t = engine.clip_grad_norm_({ a, b }, 3, "inf")
    assert.are.equal(6, t)
    close({ -2 * 3 / (6 + 1e-6), 0.5 * 3 / (6 + 1e-6), 6 * 3 / (6 + 1e-6) }, b.grad, 1e-6, "inf clip")
  end)

  it("turns gradients into NaN when the norm is NaN (as PyTorch without error_if_nonfinite)", function()
    local a = engine.zeros(2, { requires_grad = true })
    a.grad = engine.tensor({ 1, 0 / 0 })
    local t = engine.clip_grad_norm_({ a }, 1)
    assert.is_true(t ~= t)
    local g = a.grad:tolist_flat()
    assert.is_true(g[1] ~= g[1])
  end)

  it("reports errors", function()
    local a = params()
    errmatch(function() engine.clip_grad_norm_({ a }, -1) end, "max_norm must be >= 0")
    errmatch(function() engine.clip_grad_norm_({ a }, "1") end, "max_norm must be a number")
    errmatch(function() engine.clip_grad_norm_({ a }, 1, -2) end, "unsupported norm order")
    errmatch(function() engine.clip_grad_norm_(a, 1) end, "expected a list of parameters")
  end)
end)
