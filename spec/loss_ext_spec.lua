-- torch.nn.functional's other losses and activations (engine.ops.loss): PyTorch reference values
-- (spec/fixtures/losses.lua from tools/gen_loss_fixture.py), float64 finite differences,
-- f32/bf16 runs, nn modules and errors.
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local nn = engine.nn
local F = nn.functional
local gc = require("spec.helpers.gradcheck")
local fixture = dofile("spec/fixtures/losses.lua")

local function T(vals, shape, dtype)
  if #shape == 0 then return engine.tensor(vals[1], dtype) end
  return engine.tensor(vals, dtype):view(shape)
end
local function maxdiff(a, flat)
  local v = a:double():reshape(-1):tolist_flat()
  local m = 0
  for i = 1, #flat do
    local d = math.abs(v[i] - flat[i])
    if d ~= d then d = math.huge end
    if d > m then m = d end
  end
  return m, #v
end

local fns = {
  nll_loss = engine.nll_loss, cross_entropy = engine.cross_entropy,
  binary_cross_entropy = engine.binary_cross_entropy, bce_with_logits = engine.binary_cross_entropy_with_logits,
  kl_div = engine.kl_div, smooth_l1_loss = engine.smooth_l1_loss, huber_loss = engine.huber_loss,
}
local acts = { softplus = true, leaky_relu = true, elu = true, hardtanh = true }

-- a function of x alone for a fixture case (others built in dtype)
local function case_fn(c, dtype)
  local op = c.name:match("^(%S+)")
  local others = {}
  for i, o in ipairs(c.others) do others[i] = T(o.values, o.shape, o.dtype == "i64" and "i64" or dtype) end
  local opts, pre = {}, nil
  for k, v in pairs(c.opts) do
    if k == "weight" or k == "pos_weight" then opts[k] = others[v]
    elseif k == "log_softmax" then pre = v
    else opts[k] = v end
  end
  if fns[op] then
    return function(x)
      if pre then x = x:log_softmax(pre) end
      return fns[op](x, others[1], opts)
    end
  elseif acts[op] then
    return function(x) return engine[op](x, next(opts) and opts or nil) end
  elseif op == "glu" then
    return function(x) return engine.glu(x, opts.dim) end
  end
  error("no function for fixture case " .. c.name)
end

describe("losses and activations against PyTorch", function()
  it("reads the fixture", function() assert.is_true(#fixture >= 30) end)
  for _, c in ipairs(fixture) do
    it(c.name .. " (f64 values and gradient)", function()
      local x = T(c.x, c.x_shape, "f64")
      x.requires_grad = true
      local out = case_fn(c, "f64")(x)
      assert.are.same(c.out_shape, out:shape())
      local e = maxdiff(out, c.out)
      assert.is_true(e < 1e-12, c.name .. ": output differs by " .. e)
      local n = out:numel()
      local r = {}
      for k = 1, n do r[k] = 0.1 * (1 + (k - 1) % 7) end
      local rt = #c.out_shape == 0 and engine.tensor(r[1], "f64") or engine.tensor(r, "f64"):view(c.out_shape)
      ;(out * rt):sum():backward()
      local eg = maxdiff(x.grad, c.grad)
      assert.is_true(eg < 1e-12, c.name .. ": gradient differs by " .. eg)
    end)
    it(c.name .. " (f32 and bf16 values)", function()
      for _, dt in ipairs({ "f32", "bf16" }) do
        local x = T(c.x, c.x_shape, dt)
        local out = case_fn(c, dt)(x)
        assert.are.equal(dt, out.dtype)
        local scale = 0
        for _, v in ipairs(c.out) do scale = math.max(scale, math.abs(v)) end
        local e = maxdiff(out, c.out)
        local tol = dt == "f32" and 1e-5 or 5e-2
        assert.is_true(e <= tol * (scale + 1), c.name .. " " .. dt .. ": output differs by " .. e)
      end
    end)
  end
end)


-- The float64 finite-difference check of case {name, fn, takes_target}: fn's gradients to clones of x (and of y
-- when the case takes a target) that require grad; returns those inputs.
local function fd_check(cse, x, y)
  local a = x:clone(); a.requires_grad = true
  local ins = { a }
  if cse[3] then local b = y:clone(); b.requires_grad = true; ins[2] = b end
  assert.is_true(gc.check(cse[2], ins, { eps = 1e-6, tol = 1e-6 }))
  return ins
end
describe("losses and activations: float64 finite differences", function()
  engine.manual_seed(3)
  local x = engine.randn(4, 5, { dtype = "f64" }) * 2
  local y = engine.randn(4, 5, { dtype = "f64" })
  local tgt = engine.tensor({ 1, 0, 4, -100 })
  local w = engine.tensor({ 0.3, 1, 2, 0.5, 1.5 }, "f64")
  local cases = {
    { "nll_loss", function(a) return engine.nll_loss(a:log_softmax(2), tgt, { weight = w }) end },
    { "cross_entropy weight + smoothing", function(a) return engine.cross_entropy(a, tgt, { weight = w, label_smoothing = 0.15 }) end },
    { "cross_entropy probabilities", function(a) return engine.cross_entropy(a, y:softmax(2)) end },
    { "binary_cross_entropy", function(a) return engine.binary_cross_entropy(a:sigmoid(), y:sigmoid()) end },
    { "bce_with_logits", function(a, b) return engine.binary_cross_entropy_with_logits(a, b:sigmoid(), { pos_weight = w }) end, true },
    { "kl_div", function(a, b) return engine.kl_div(a:log_softmax(2), b:softmax(2), { reduction = "batchmean" }) end, true },
    { "kl_div log_target", function(a, b) return engine.kl_div(a, b, { log_target = true }) end, true },
    { "smooth_l1_loss", function(a, b) return engine.smooth_l1_loss(a, b, { beta = 0.7 }) end, true },
    { "huber_loss", function(a, b) return engine.huber_loss(a, b, { delta = 0.6, reduction = "none" }) end, true },
    { "softplus", function(a) return engine.softplus(a, 1.5, 2) end },
    { "leaky_relu", function(a) return engine.leaky_relu(a, 0.2) end },
    { "elu", function(a) return engine.elu(a, 0.7) end },
    { "hardtanh", function(a) return engine.hardtanh(a, -1.3, 1.1) end },
    { "glu", function(a) return engine.glu(a:narrow(2, 1, 4), 2) end },
  }
  for _, cse in ipairs(cases) do
    it(cse[1], function() fd_check(cse, x, y) end)
  end
end)

-- The fused C losses (engine/src/ops/loss_ext.c): every option and reduction of their backward
-- kernels, gradients to the input and (elementwise losses) to the target.
describe("fused losses: float64 finite differences of every option", function()
  engine.manual_seed(4)
  local x = engine.randn(3, 4, { dtype = "f64" })
  local y = engine.randn(3, 4, { dtype = "f64" })
  local x3 = engine.randn(2, 3, 2, { dtype = "f64" })
  local t = engine.tensor({ 1, -100, 3 })
  local t3 = engine.tensor({ { 0, 2 }, { 7, 1 } })
  local w = engine.tensor({ 0.3, 1, 2, 0.5 }, "f64")
  local w3 = engine.tensor({ 2, 0.5, 1.5 }, "f64")
  local u = engine.rand(3, 4, { dtype = "f64" }) * 0.8 + 0.1
  local cases = {
    { "nll_loss mean", function(a) return engine.nll_loss(a, t) end },
    { "nll_loss weight mean", function(a) return engine.nll_loss(a, t, { weight = w }) end },
    { "nll_loss weight sum", function(a) return engine.nll_loss(a, t, { weight = w, reduction = "sum" }) end },
    { "nll_loss weight none", function(a) return engine.nll_loss(a, t, { weight = w, reduction = "none" }) end },
    { "nll_loss 1-d none", function(a) return engine.nll_loss(a:select(1, 1), engine.tensor(2), { reduction = "none" }) end },
    { "nll_loss 3-d weight ignore 7", function(a) return engine.nll_loss(x3 * a:sum(), t3, { weight = w3, ignore_index = 7 }) end },
    { "cross_entropy weight mean", function(a) return engine.cross_entropy(a, t, { weight = w }) end },
    { "cross_entropy weight smoothing sum", function(a) return engine.cross_entropy(a, t, { weight = w, label_smoothing = 0.2, reduction = "sum" }) end },
    { "cross_entropy weight smoothing none", function(a) return engine.cross_entropy(a, t, { weight = w, label_smoothing = 0.3, reduction = "none" }) end },
    { "cross_entropy 3-d weight smoothing ignore 7", function(a) return engine.cross_entropy(x3 * a:sum(), t3, { weight = w3, ignore_index = 7, label_smoothing = 0.1 }) end },
    { "bce mean (input and target)", function(a, b) return engine.binary_cross_entropy(a:sigmoid(), b:sigmoid()) end, true },
    { "bce weight sum", function(a, b) return engine.binary_cross_entropy(a:sigmoid(), b:sigmoid(), { weight = w, reduction = "sum" }) end, true },
    { "bce none", function(a, b) return engine.binary_cross_entropy(a:sigmoid(), b:sigmoid(), { reduction = "none" }) end, true },
    { "bce_with_logits weight none", function(a, b) return engine.binary_cross_entropy_with_logits(a, b:sigmoid(), { weight = w, reduction = "none" }) end, true },
    { "bce_with_logits weight pos_weight mean", function(a, b) return engine.binary_cross_entropy_with_logits(a, b:sigmoid(), { weight = u, pos_weight = w }) end, true },
    { "kl_div sum", function(a, b) return engine.kl_div(a, b:softmax(2), { reduction = "sum" }) end, true },
    { "kl_div none log_target", function(a, b) return engine.kl_div(a, b, { reduction = "none", log_target = true }) end, true },
    { "kl_div batchmean log_target", function(a, b) return engine.kl_div(a, b, { reduction = "batchmean", log_target = true }) end, true },
    { "smooth_l1_loss beta 0 sum", function(a, b) return engine.smooth_l1_loss(a, b, { beta = 0, reduction = "sum" }) end, true },
    { "smooth_l1_loss beta 2 none", function(a, b) return engine.smooth_l1_loss(a, b, { beta = 2, reduction = "none" }) end, true },
    { "huber_loss delta 0.5 mean", function(a, b) return engine.huber_loss(a, b, { delta = 0.5 }) end, true },
  }
  for _, cse in ipairs(cases) do
    it(cse[1], function()
      local ins = fd_check(cse, x, y)
      local out = cse[2](table.unpack(ins))
      assert.is_truthy(out.grad_fn:find("NllLoss") or out.grad_fn:find("PointwiseLoss") or out.grad_fn:find("CrossEntropy")
        or out.grad_fn:find("Mul"), out.grad_fn)
    end)
  end
  it("the fused ops: one node; f32 / bf16 agree with f64; integer or mixed inputs keep the composite", function()
    local a = x:clone(); a.requires_grad = true
    assert.are.equal("NllLossBackward", engine.nll_loss(a, t, { weight = w }).grad_fn)
    assert.are.equal("PointwiseLossBackward", engine.huber_loss(a, y).grad_fn)
    assert.are.equal("CrossEntropyBackward", engine.cross_entropy(a, t, { weight = w, label_smoothing = 0.1 }).grad_fn)
    assert.are.equal("PointwiseLossBackward", engine.binary_cross_entropy_with_logits(a, u, { pos_weight = w }).grad_fn)
    for _, dt in ipairs({ "f32", "bf16" }) do
      local tol = dt == "f32" and 1e-5 or 3e-2
      local pairs_ = {
        { engine.nll_loss(x, t, { weight = w }), engine.nll_loss(x:to(dt), t, { weight = w }) },
        { engine.kl_div(x, u), engine.kl_div(x:to(dt), u:to(dt)) },
        { engine.cross_entropy(x, t, { weight = w, label_smoothing = 0.1 }), engine.cross_entropy(x:to(dt), t, { weight = w, label_smoothing = 0.1 }) },
        { engine.binary_cross_entropy(u, u), engine.binary_cross_entropy(u:to(dt), u:to(dt)) },
      }
      for i, pr in ipairs(pairs_) do
        assert.are.equal(dt, pr[2].dtype)
        assert.is_true(math.abs(pr[1]:item() - pr[2]:double():item()) < tol * (1 + math.abs(pr[1]:item())), dt .. " case " .. i)
      end
    end
    -- a weight that requires grad gets its gradient through the composite
    local wg = w:clone(); wg.requires_grad = true
    engine.nll_loss(x, t, { weight = wg }):backward()
    assert.is_not_nil(wg.grad)
    -- broadcast targets (kl_div / smooth_l1 / huber) keep the composite's broadcasting
    assert.are.same({ 3, 4 }, engine.smooth_l1_loss(x, y:select(1, 1), { reduction = "none" }):shape())
    -- a range error in binary_cross_entropy names the extremes
    local ok, e = pcall(engine.binary_cross_entropy, engine.tensor({ 0.5, 1.5, -0.25 }), engine.tensor({ 0, 1, 0 }))
    assert.is_false(ok)
    assert.is_truthy(tostring(e):find("binary_cross_entropy: all elements of input should be between 0 and 1 (got min -0.25, max 1.5)", 1, true), tostring(e))
  end)
end)

-- At a kink PyTorch's gradient is one of the one-sided derivatives: leaky_relu and elu take the x <= 0
-- branch at 0 (negative_slope, alpha exp(0)), hardtanh is 0 at both bounds (the constant side),
-- softplus takes sigmoid(beta x) at x beta == threshold (1 only above).  Each point is checked against
-- that value and a float64 one-sided finite difference from the named side, in f64 and f32.
describe("activations at their kinks: PyTorch's one-sided gradients", function()
  local sig3 = 1 / (1 + math.exp(-3))
  local cases = {
    -- name, fn, kink points, expected gradients, side of the finite difference (-1 left, 1 right)
    { "leaky_relu", function(a) return engine.leaky_relu(a, 0.2) end, { 0, -0.0 }, { 0.2, 0.2 }, { -1, -1 } },
    { "leaky_relu default", function(a) return engine.leaky_relu(a) end, { 0 }, { 0.01 }, { -1 } },
    { "elu", function(a) return engine.elu(a, 0.7) end, { 0, -0.0 }, { 0.7, 0.7 }, { -1, -1 } },
    { "hardtanh", function(a) return engine.hardtanh(a, -1.25, 1.5) end, { -1.25, 1.5 }, { 0, 0 }, { -1, 1 } },
    { "relu6", function(a) return engine.relu6(a) end, { 0, 6 }, { 0, 0 }, { -1, 1 } },
    { "softplus", function(a) return engine.softplus(a, 2, 3) end, { 1.5 }, { sig3 }, { -1 } },
  }
  for _, cse in ipairs(cases) do
    it(cse[1], function()
      local name, fn, pts, want, side = cse[1], cse[2], cse[3], cse[4], cse[5]
      for _, dt in ipairs({ "f64", "f32" }) do
        local x = engine.tensor(pts, dt):requires_grad_()
        fn(x):sum():backward()
        local g = x.grad:tolist_flat()
        for i = 1, #pts do
          local tol = dt == "f64" and 1e-12 or 1e-6
          assert.is_true(math.abs(g[i] - want[i]) <= tol,
            string.format("%s %s: gradient at %g is %.17g, PyTorch's is %.17g", name, dt, pts[i], g[i], want[i]))
        end
      end
      local h = 1e-7
      for i = 1, #pts do
        local function f(v) return fn(engine.tensor({ v }, "f64")):item() end
        local fd = side[i] < 0 and (f(pts[i]) - f(pts[i] - h)) / h or (f(pts[i] + h) - f(pts[i])) / h
        assert.is_true(math.abs(fd - want[i]) <= 1e-6,
          string.format("%s: one-sided finite difference at %g is %.10g, want %.10g", name, pts[i], fd, want[i]))
      end
    end)
  end
  it("bce_with_logits at x = 0 has PyTorch's gradient sigmoid(0) - target", function()
    local x = engine.tensor({ 0, 0, 0 }, "f64"):requires_grad_()
    engine.binary_cross_entropy_with_logits(x, engine.tensor({ 0, 1, 0.25 }, "f64"), { reduction = "sum" }):backward()
    assert.are.same({ 0.5, -0.5, 0.25 }, x.grad:totable())
    -- smooth_l1 / huber at |x - y| = beta / delta: PyTorch's gradient (beta: 1, delta: delta)
    local a = engine.tensor({ 0.7, -0.7, 0.6 }, "f64"):requires_grad_()
    engine.smooth_l1_loss(a, engine.zeros(3, { dtype = "f64" }), { beta = 0.7, reduction = "sum" }):backward()
    assert.is_true(math.abs(a.grad[1] - 1) < 1e-15 and math.abs(a.grad[2] + 1) < 1e-15 and math.abs(a.grad[3] - 0.6 / 0.7) < 1e-15)
    a.grad = nil
    engine.huber_loss(a, engine.zeros(3, { dtype = "f64" }), { delta = 0.7, reduction = "sum" }):backward()
    assert.is_true(math.abs(a.grad[1] - 0.7) < 1e-15 and math.abs(a.grad[2] + 0.7) < 1e-15 and math.abs(a.grad[3] - 0.6) < 1e-15)
  end)
  it("bf16 is computed in f32 and rounded once; integer hardtanh clamps to truncated bounds", function()
    local x = engine.tensor({ -7.5, -1.3, -0.25, 0, 0.3, 1.7, 5.9, 30 })
    local xb = x:to("bf16")
    local xf = xb:float()
    for _, f in ipairs({
      function(t) return engine.leaky_relu(t, 0.3) end, function(t) return engine.elu(t, 0.7) end,
      function(t) return engine.hardtanh(t, -1.1, 2.2) end, function(t) return engine.softplus(t, 1.5, 4) end,
    }) do
      local r = f(xb)
      assert.are.equal("bf16", r.dtype)
      assert.are.same(f(xf):to("bf16"):float():totable(), r:float():totable())
    end
    -- PyTorch: integer bounds (toLong), the integer dtype kept
    local i = engine.tensor({ -3, 0, 3 })
    local r = engine.hardtanh(i, -1.5, 2.7)
    assert.are.equal("i64", r.dtype)
    assert.are.same({ -1, 0, 2 }, r:totable())
  end)
  it("just off the kinks the gradient is the other side's (central finite differences)", function()
    local a = engine.tensor({ -1e-3, 1e-3, -1.25 - 1e-3, -1.25 + 1e-3, 1.5 - 1e-3, 1.5 + 1e-3, 1.499, 1.501 }, "f64")
    local fs = {
      function(t) return engine.leaky_relu(t:narrow(1, 1, 2), 0.2) end,
      function(t) return engine.elu(t:narrow(1, 1, 2), 0.7) end,
      function(t) return engine.hardtanh(t:narrow(1, 3, 4), -1.25, 1.5) end,
      function(t) return engine.softplus(t:narrow(1, 7, 2), 2, 3) end,
    }
    for _, f in ipairs(fs) do
      local x = a:clone(); x.requires_grad = true
      assert.is_true(gc.check(f, { x }, { eps = 1e-7, tol = 1e-6 }))
    end
  end)
end)

describe("losses: behaviour", function()
  it("nll_loss mean with every target ignored is nan, sum is 0 (as PyTorch)", function()
    local lp = engine.zeros(2, 3, { dtype = "f64" })
    local t = engine.tensor({ -100, -100 })
    local m = engine.nll_loss(lp, t):item()
    assert.is_true(m ~= m)
    assert.are.equal(0, engine.nll_loss(lp, t, { reduction = "sum" }):item())
  end)
  it("cross_entropy without weight keeps the fused op; with weight it equals nll_loss of log_softmax", function()
    engine.manual_seed(1)
    local x = engine.randn(6, 4, { dtype = "f64" })
    local t = engine.tensor({ 0, 1, 2, 3, 1, -100 })
    local w = engine.tensor({ 1, 2, 3, 4 }, "f64")
    local xr = x:clone(); xr.requires_grad = true
    local fused = engine.cross_entropy(xr, t, { label_smoothing = 0.1 }).grad_fn
    assert.is_truthy(fused:find("CrossEntropy"), fused)
    local a = engine.cross_entropy(x, t, { weight = w }):item()
    local b = engine.nll_loss(x:log_softmax(2), t, { weight = w }):item()
    assert.is_true(math.abs(a - b) < 1e-12)
  end)
  it("nn loss modules and activation modules", function()
    engine.manual_seed(2)
    local x = engine.randn(4, 3, { dtype = "f64" })
    local t = engine.tensor({ 0, 2, 1, 1 })
    local w = engine.tensor({ 1, 0.5, 2 }, "f64")
    local m = nn.CrossEntropyLoss{ weight = w, label_smoothing = 0.1 }
    assert.is_true(math.abs(m(x, t):item() - engine.cross_entropy(x, t, { weight = w, label_smoothing = 0.1 }):item()) < 1e-14)
    assert.is_true(math.abs(nn.NLLLoss{ reduction = "sum" }(x, t):item() - engine.nll_loss(x, t, { reduction = "sum" }):item()) < 1e-14)
    local p = x:sigmoid()
    local y = engine.tensor({ { 1, 0, 1 }, { 0, 0, 1 }, { 1, 1, 1 }, { 0, 1, 0 } }, "f64")
    assert.is_true(math.abs(nn.BCELoss()(p, y):item() - nn.BCEWithLogitsLoss()(x, y):item()) < 1e-12)
    assert.is_true(math.abs(nn.KLDivLoss{ reduction = "batchmean" }(x:log_softmax(2), p:softmax(2)):item()
      - engine.kl_div(x:log_softmax(2), p:softmax(2), { reduction = "batchmean" }):item()) < 1e-14)
    assert.is_true(math.abs(nn.HuberLoss{ delta = 1 }(x, p):item() - nn.SmoothL1Loss{ beta = 1 }(x, p):item()) < 1e-14)
    assert.is_true(math.abs(nn.MSELoss()(x, p):item() - F.mse_loss(x, p):item()) < 1e-14)
    assert.are.same(engine.leaky_relu(x, 0.2):totable(), nn.LeakyReLU(0.2)(x):totable())
    assert.are.same(engine.elu(x, 0.3):totable(), nn.ELU{ alpha = 0.3 }(x):totable())
    assert.are.same(engine.softplus(x, 2, 5):totable(), nn.Softplus{ beta = 2, threshold = 5 }(x):totable())
    assert.are.same(engine.hardtanh(x, -0.5, 0.5):totable(), nn.Hardtanh(-0.5, 0.5)(x):totable())
    assert.are.same(engine.relu6(x * 10):totable(), nn.ReLU6()(x * 10):totable())
    assert.are.same({ 4, 1 }, nn.GLU()(engine.randn(4, 2)):shape())
    assert.are.equal(F.glu, engine.glu)
    local sd = nn.CrossEntropyLoss{ weight = w }:state_dict()
    assert.is_not_nil(sd.weight)
  end)
  it("errors name the op and the shapes", function()
    local x = engine.randn(4, 3)
    local function err(f, pat)
      local ok, e = pcall(f)
      assert.is_false(ok)
      assert.is_truthy(tostring(e):find(pat, 1, true), tostring(e))
    end
    err(function() engine.nll_loss(x, engine.tensor({ 0, 1, 2 })) end, "nll_loss: input f32[4,3] (classes in dim 2) expects target of shape [4]")
    err(function() engine.nll_loss(x, engine.tensor({ 0, 1, 2, 3 })) end, "nll_loss: target 3 is out of bounds for 3 classes")
    err(function() engine.nll_loss(x, engine.tensor({ 0, 1, 2, 1 }), { weight = engine.ones(4) }) end, "nll_loss: weight must be a 1-D tensor of 3 entries")
    err(function() engine.cross_entropy(x, engine.tensor({ 0, 1, 2, 1 }), { weight = engine.ones(3), reduce = "sum" }) end, "cross_entropy: unknown option 'reduce'")
    err(function() engine.binary_cross_entropy(x, x) end, "binary_cross_entropy: all elements of input should be between 0 and 1")
    err(function() engine.binary_cross_entropy(x:sigmoid(), engine.rand(3, 4)) end, "binary_cross_entropy: target f32[3,4] must have the input's shape f32[4,3]")
    err(function() engine.kl_div(x, x, { reduction = "avg" }) end, "kl_div: reduction must be \"none\", \"mean\", \"batchmean\" or \"sum\"")
    err(function() engine.glu(x) end, "glu: Halving dimension must be even, but dimension 2 is size 3")
    err(function() engine.hardtanh(x, 1, -1) end, "hardtanh: min_val (1) cannot be greater than max_val (-1)")
    -- PyTorch's gradient at the bounds is 0 (torch 2.15: hardtanh(x, -1, 1) of [-2, -1, -0.5, 0, 1, 1.5])
    local b = engine.tensor({ -2, -1, -0.5, 0, 1, 1.5 }, "f64"):requires_grad_()
    engine.hardtanh(b, -1, 1):sum():backward()
    assert.are.same({ 0, 0, 1, 1, 0, 0 }, b.grad:totable())
    err(function() engine.smooth_l1_loss(x, x, { beta = -1 }) end, "smooth_l1_loss: beta must be non-negative")
  end)
end)
