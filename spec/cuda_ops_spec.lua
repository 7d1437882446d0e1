-- Engine tensors on CUDA: the device integration (x:cuda(), model:to("cuda"), per-op dispatch to
-- kernels/cuda) checked op by op against the CPU.
--
-- "without a GPU": runs on every machine (reported pending where a GPU is present): the clear
-- "CUDA is not available: <reason>" errors, that nothing is lost when they happen, and the CPU side
-- of the same API (x:cpu(), dtype casts, module:to keeping parameter identity).
-- "#gpu": the conformance sweep.  Every op forward and backward, on the GPU and on the CPU from the
-- same inputs, several shapes and dtypes, compared with per-dtype tolerances (max |gpu - cpu| <=
-- atol + rtol * max |cpu|), then the parity fixture of parity_spec.lua on the GPU in f32.  Without a
-- GPU each #gpu test is pending with the runtime's reason, so the runner counts them as skipped.
--   only these: build/engine /usr/bin/busted --ignore-lua --tags=gpu spec/cuda_ops_spec.lua
local engine = require("engine")
local nn, optim = engine.nn, engine.optim
local F = nn.functional

local available = engine.cuda.is_available()
local reason = engine.cuda.unavailable_reason()

local function need_gpu() if not available then pending("no GPU: " .. reason) end end
local function need_no_gpu() if available then pending("a GPU is present: covered by the #gpu tests") end end

local function fails_with(fn, text)
  local ok, err = pcall(fn)
  assert.is_false(ok, "expected an error containing: " .. text)
  assert.is_truthy(tostring(err):find(text, 1, true), "error was: " .. tostring(err))
end

describe("CUDA tensors without a GPU", function()
  it("engine.cuda reports no device and the reason", function()
    need_no_gpu()
    assert.is_false(engine.cuda.is_available())
    assert.are.equal(0, engine.cuda.device_count())
    assert.is_truthy(reason:find("^CUDA is not available: "))
    fails_with(function() engine.cuda.synchronize() end, "engine.cuda.synchronize: " .. reason)
    assert.are.equal(0, engine.cuda.memory_stats().allocated)
  end)

  it("x:cuda() and x:to('cuda') fail clearly and leave x as it was", function()
    need_no_gpu()
    local x = engine.tensor({ 1.5, 2, 3 })
    x.requires_grad = true
    fails_with(function() return x:cuda() end, "x:cuda(): " .. reason)
    fails_with(function() return x:to("cuda") end, 'x:to("cuda"): ' .. reason)
    fails_with(function() return x:to({ device = "cuda", dtype = "bf16" }) end, reason)
    assert.are.equal("cpu", x.device)
    assert.are.same({ 1.5, 2, 3 }, x:tolist())
    assert.is_true(x.requires_grad)
  end)

  it("creation on cuda fails clearly", function()
    need_no_gpu()
    fails_with(function() return engine.zeros(2, 3, { device = "cuda" }) end, "zeros: " .. reason)
    fails_with(function() return engine.ones({ 2 }, { device = "cuda" }) end, "ones: " .. reason)
    fails_with(function() return engine.randn(4, { device = "cuda" }) end, "randn: " .. reason)
    fails_with(function() return engine.tensor({ 1, 2 }, { device = "cuda" }) end, "tensor: " .. reason)
    fails_with(function() return engine.arange(5, { device = "cuda" }) end, "arange: " .. reason)
    fails_with(function() return engine.zeros(2, { device = "tpu" }) end, "unknown device 'tpu'")
    -- the C API says the same
    assert.is_true(engine.C.eng_tensor_to_device(engine.ones(2)._c, 1) == nil)
    assert.is_truthy(engine.ffi.string(engine.C.eng_last_error()):find(reason, 1, true))
  end)

  it("model:to('cuda') fails before changing anything", function()
    need_no_gpu()
    engine.manual_seed(1)
    local m = nn.Linear(4, 3)
    local w, before = m.weight, m.weight:tolist()
    fails_with(function() m:to("cuda") end, reason)
    assert.are.equal(w, m.weight)
    assert.are.equal("cpu", m.weight.device)
    assert.are.same(before, m.weight:tolist())
  end)

  it("x:cpu() / x:to('cpu') give x itself; dtype casts", function()
    local x = engine.tensor({ 1.25, -2 })
    assert.are.equal(x._c, x:cpu()._c)
    assert.are.equal(x._c, x:to("cpu")._c)
    assert.is_false(x.is_cuda)
    local b = x:to("bf16")
    assert.are.equal("bf16", b.dtype)
    assert.are.same({ 1.25, -2 }, b:tolist())
    assert.are.equal("f64", x:to({ device = "cpu", dtype = "f64" }).dtype)
    fails_with(function() return x:to("cuda:x") end, "unknown")
  end)

  it("module:to(dtype) converts in place: same Parameter objects and C tensors, grads converted, ties kept", function()
    engine.manual_seed(2)
    local m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    local p1, c1 = m[1].weight, m[1].weight._c
    local opt = optim.AdamW(m:parameters(), { lr = 0.1 })
    local loss = m(engine.randn(2, 4)):sum()
    loss:backward()
    local g = p1.grad:tolist()
    m:to("f64")
    assert.are.equal(p1, m[1].weight)
    assert.are.equal(c1, m[1].weight._c)
    assert.are.equal("f64", p1.dtype)
    assert.are.equal("f64", p1.grad.dtype)
    assert.is_true(p1.requires_grad and p1.is_leaf)
    local g2 = p1.grad:tolist()
    for i = 1, #g do for j = 1, #g[i] do assert.is_true(math.abs(g[i][j] - g2[i][j]) < 1e-6) end end
    -- the optimizer built before the move updates the converted parameters
    opt:step()
    assert.are.equal("f64", p1.dtype)
    -- tied weights stay tied
    local a = nn.Linear(3, 3)
    local b = nn.Linear(3, 3)
    b.weight = a.weight
    local both = nn.Sequential(a, b)
    both:to("bf16")
    assert.are.equal(a.weight, b.weight)
    assert.are.equal("bf16", b.weight.dtype)
  end)

  it("the GPU benchmark exits cleanly and says why", function()
    need_no_gpu()
    local exe = require("spec.helpers.proc").self_exe()
    local p = io.popen("'" .. exe .. "' recipes/bench/gpu_step.lua --torch=0 2>&1; echo rc=$?")
    local out = p:read("*a")
    p:close()
    assert.is_truthy(out:find("CUDA is not available", 1, true), out)
    assert.is_truthy(out:find("rc=0", 1, true), out)
  end)
end)

-- ============================================================================ GPU conformance
-- Tolerances: { rtol, atol } on max |gpu - cpu| <= atol + rtol * max |cpu|.  Half precision results
-- are rounded once on both sides but reductions sum in other orders (and cuBLASLt vs BLAS).
local TOL = { f64 = { 1e-10, 1e-12 }, f32 = { 2e-5, 2e-6 }, bf16 = { 2e-2, 2e-2 }, f16 = { 4e-3, 4e-3 } }
local GTOL = { f64 = { 1e-9, 1e-11 }, f32 = { 1e-4, 1e-5 }, bf16 = { 4e-2, 4e-2 }, f16 = { 8e-3, 8e-3 } }

local function maxabs(t) return t:numel() == 0 and 0 or t:double():abs():max():item() end

local function compare(got, want, tol, what)
  assert.are.equal("cuda", got.device, what .. ": result not on the GPU")
  assert.are.equal(want.dtype, got.dtype, what .. ": dtype")
  assert.are.same(want:shape(), got:shape(), what .. ": shape")
  if want:numel() == 0 then return end
  local g, w = got:cpu():double(), want:double()
  local nan_w, nan_g = (w:ne(w)):sum():item(), (g:ne(g)):sum():item()
  assert.are.equal(nan_w, nan_g, what .. ": NaN count")
  if nan_w > 0 then
    g = g:masked_fill(w:ne(w), 0); w = w:masked_fill(w:ne(w), 0)
  end
  local err, scale = maxabs(g - w), maxabs(w)
  assert.is_true(err <= tol[2] + tol[1] * scale,
    string.format("%s: max |gpu - cpu| = %.3g (max |cpu| %.3g, rtol %g, atol %g)", what, err, scale, tol[1], tol[2]))
end

local function leaf(t, grad)
  local r = t:detach():clone()
  if grad and r:is_floating_point() then r.requires_grad = true end
  return r
end

-- Runs fn on CPU copies and GPU copies of inputs; compares outputs and (when `backward`) the input
-- gradients of sum(out * w) for a fixed random w.  fn may return several tensors (all compared; the
-- first one is differentiated).
local function conform(name, dt, inputs, fn, backward)
  local cin, gin = {}, {}
  for i, t in ipairs(inputs) do
    cin[i] = leaf(t, backward)
    gin[i] = leaf(t:cuda(), backward)
  end
  local yc = { fn(unpack(cin)) }
  local yg = { fn(unpack(gin)) }
  for k = 1, #yc do compare(yg[k], yc[k], TOL[dt] or TOL.f32, name .. " " .. dt .. " output " .. k) end
  if backward and yc[1].requires_grad then
    local w = engine.randn(yc[1]:shape(), { dtype = "f64" }):to(yc[1].dtype)
    local lc, lg = (yc[1] * w):sum(), (yg[1] * w:cuda()):sum()
    lc:backward()
    lg:backward()
    for i = 1, #cin do
      if cin[i].grad then
        assert.is_not_nil(gin[i].grad, name .. ": no GPU gradient for input " .. i)
        compare(gin[i].grad, cin[i].grad, GTOL[dt] or GTOL.f32, name .. " " .. dt .. " grad of input " .. i)
      end
    end
  end
end

local function rnd(shape, dt, lo, hi)
  local t = engine.rand(shape, { dtype = "f64" })
  if lo then t = t * (hi - lo) + lo else t = engine.randn(shape, { dtype = "f64" }) end
  return t:to(dt)
end

local FLOAT = { "f32", "bf16", "f16", "f64" }

describe("CUDA op conformance #gpu", function()
  before_each(function() engine.manual_seed(1234) end)

  it("host <-> device copies, views, contiguous, casts, fill, item", function()
    need_gpu()
    for _, dt in ipairs({ "f32", "f64", "bf16", "f16", "i32", "i64", "u8", "bool" }) do
      local x = rnd({ 3, 5, 4 }, "f64", -3, 3):to(dt)
      local g = x:cuda()
      assert.are.equal("cuda", g.device)
      assert.are.same(x:tolist(), g:tolist())
      assert.are.same(x:tolist(), g:cpu():tolist())
      assert.are.same(x:transpose(1, 3):contiguous():tolist(), g:transpose(1, 3):contiguous():tolist())
      assert.are.same(x:narrow(2, 2, 3):clone():tolist(), g:narrow(2, 2, 3):clone():tolist())
      for _, dt2 in ipairs({ "f32", "f64", "bf16", "i64", "bool" }) do
        assert.are.same(x:to(dt2):tolist(), g:to(dt2):tolist(), dt .. " -> " .. dt2)
      end
    end
    local big = engine.randn(3, 1000, 1000) -- more than the two 8 MiB staging buffers
    assert.are.equal(0, (big:cuda():cpu() - big):abs():max():item())
    local z = engine.zeros(4, 6, { device = "cuda" })
    z:narrow(2, 2, 3):fill_(2.5)
    local zc = engine.zeros(4, 6); zc:narrow(2, 2, 3):fill_(2.5)
    assert.are.same(zc:tolist(), z:tolist())
    assert.are.equal(2.5, z:get(1, 2))
    z:set(7, 1, 1)
    assert.are.equal(7, z:get(1, 1))
    assert.are.equal(7, z:max():item())
    -- copy_ across devices, with broadcasting and conversion
    local d = engine.zeros(2, 3, { device = "cuda", dtype = "bf16" })
    d:copy_(engine.tensor({ 1, 2, 3 }))
    assert.are.same({ { 1, 2, 3 }, { 1, 2, 3 } }, d:tolist())
    local h = engine.zeros(3)
    h:copy_(d:select(1, 2))
    assert.are.same({ 1, 2, 3 }, h:tolist())
    -- gradients flow back across :cuda() / :cpu()
    local x = engine.randn(4)
    x.requires_grad = true
    local s = (x:cuda() * 3):cpu():sum()
    s:backward()
    assert.are.same({ 3, 3, 3, 3 }, x.grad:tolist())
    assert.are.equal("cpu", x.grad.device)
  end)

  it("mixed devices give a clear error naming both tensors", function()
    need_gpu()
    local a, b = engine.ones(2, 3), engine.ones(2, 3):cuda()
    fails_with(function() return a + b end, "f32[2,3]@cuda")
    fails_with(function() return a:matmul(b:t()) end, "different devices")
    fails_with(function() return F.layer_norm(b, { 3 }, a:select(1, 1)) end, "different devices")
  end)

  it("unary ops and their gradients", function()
    need_gpu()
    local ops = {
      { "neg", function(x) return -x end }, { "exp", function(x) return x:exp() end },
      { "log", function(x) return (x:abs() + 0.1):log() end }, { "sqrt", function(x) return (x:abs() + 0.1):sqrt() end },
      { "rsqrt", function(x) return (x:abs() + 0.1):rsqrt() end }, { "abs", function(x) return x:abs() end },
      { "tanh", function(x) return x:tanh() end }, { "sigmoid", function(x) return x:sigmoid() end },
      { "relu", function(x) return x:relu() end }, { "gelu", function(x) return F.gelu(x) end },
      { "gelu_tanh", function(x) return F.gelu(x, "tanh") end }, { "silu", function(x) return F.silu(x) end },
      { "clamp", function(x) return x:clamp(-0.5, 0.7) end },
    }
    for _, dt in ipairs(FLOAT) do
      for _, shape in ipairs({ { 37 }, { 4, 33, 5 } }) do
        for _, op in ipairs(ops) do
          conform(op[1], dt, { rnd(shape, dt) }, op[2], true)
          -- a strided (transposed) input
          if #shape == 3 then conform(op[1] .. " (view)", dt, { rnd(shape, dt) }, function(x) return op[2](x:transpose(1, 3)) end, true) end
        end
      end
    end
    for _, dt in ipairs({ "i32", "i64" }) do
      conform("int abs/neg/relu/clamp", dt, { rnd({ 50 }, "f64", -9, 9):to(dt) }, function(x) return x:abs() + (-x):relu() + x:clamp(-2, 3) end)
    end
  end)

  it("binary ops with broadcasting, scalars, in-place arithmetic", function()
    need_gpu()
    local shapes = { { { 4, 5 }, { 4, 5 } }, { { 4, 5 }, { 5 } }, { { 3, 1, 4 }, { 2, 4 } }, { { 6 }, {} } }
    local ops = {
      { "add", function(a, b) return a + b end }, { "sub", function(a, b) return a - b end },
      { "mul", function(a, b) return a * b end }, { "div", function(a, b) return a / (b:abs() + 0.5) end },
      { "pow", function(a, b) return (a:abs() + 0.5) ^ b end }, { "maximum", function(a, b) return a:maximum(b) end },
      { "minimum", function(a, b) return a:minimum(b) end },
      { "scalars", function(a, b) return (a + 2) * 3 - (1 - b) / 4 + 2 ^ b + (a:abs() + 1) ^ 1.5 + 2 / (b:abs() + 1) end },
    }
    for _, dt in ipairs(FLOAT) do
      for _, sh in ipairs(shapes) do
        for _, op in ipairs(ops) do conform(op[1], dt, { rnd(sh[1], dt), rnd(sh[2], dt) }, op[2], true) end
      end
    end
    conform("int add/mul/div", "i64", { rnd({ 7 }, "f64", 1, 9):to("i64"), rnd({ 7 }, "f64", 1, 9):to("i64") },
      function(a, b) return a + b * 2, a / b end)
    conform("mixed dtypes promote", "f32", { rnd({ 5 }, "bf16"), rnd({ 5 }, "f32") }, function(a, b) return a + b end, true)
    for _, dt in ipairs(FLOAT) do
      local a, b = rnd({ 4, 6 }, dt), rnd({ 6 }, "f32")
      local ag = a:cuda()
      a:add_(b, 0.5):mul_(b):div_(b:abs() + 1):sub_(b)
      ag:add_(b:cuda(), 0.5):mul_(b:cuda()):div_(b:abs():cuda() + 1):sub_(b:cuda())
      compare(ag, a, TOL[dt], "in-place " .. dt)
      a:addcmul_(b, b, 0.3):addcdiv_(b, b:abs() + 1, 0.2):lerp_(b, 0.25):clamp_(-1, 1)
      ag:addcmul_(b:cuda(), b:cuda(), 0.3):addcdiv_(b:cuda(), b:abs():cuda() + 1, 0.2):lerp_(b:cuda(), 0.25):clamp_(-1, 1)
      compare(ag, a, GTOL[dt], "fused in-place " .. dt)
    end
  end)

  it("broadcast gradients when a size-1 dim is all there is to sum: each input gets its own shape", function()
    need_gpu()
    -- sum_to_shape of [1, 8, 16] to [8, 16] reduces nothing: the CUDA path handed back the gradient tensor
    -- itself and reshaped it, so the [1, 8, 16] input got an [8, 16] gradient (found by a DTensor data-parallel
    -- run at one sample per rank)
    for _, shapes in ipairs({ { { 1, 8, 16 }, { 8, 16 } }, { { 8, 16 }, { 1, 8, 16 } }, { { 1, 1, 4 }, { 4 } } }) do
      local a = engine.randn(shapes[1]):cuda():requires_grad_()
      local b = engine.randn(shapes[2]):cuda():requires_grad_()
      local ac, bc = a:detach():cpu():requires_grad_(), b:detach():cpu():requires_grad_()
      local lg = ((a + b) * (a - b)):sum()
      lg:backward()
      local lc = ((ac + bc) * (ac - bc)):sum()
      lc:backward()
      assert.are.same(shapes[1], a.grad:shape())
      assert.are.same(shapes[2], b.grad:shape())
      assert((a.grad:cpu() - ac.grad):abs():max():item() < 1e-5)
      assert((b.grad:cpu() - bc.grad):abs():max():item() < 1e-5)
    end
  end)

  it("comparisons, where, masked_fill", function()
    need_gpu()
    for _, dt in ipairs({ "f32", "bf16", "i64" }) do
      local a, b = rnd({ 4, 5 }, "f64", -2, 2):to(dt), rnd({ 5 }, "f64", -2, 2):to(dt)
      conform("compare", dt, { a, b }, function(x, y) return x:eq(y), x:ne(y), x:lt(y), x:le(y), x:gt(y), x:ge(y), x:gt(1) end)
    end
    for _, dt in ipairs({ "f32", "bf16", "f64" }) do
      local c = rnd({ 3, 4 }, "f64"):gt(0)
      conform("where", dt, { c, rnd({ 3, 4 }, dt), rnd({ 4 }, dt) }, function(m, x, y) return engine.where(m, x, y) end, true)
      conform("masked_fill", dt, { rnd({ 3, 4 }, dt), c }, function(x, m) return x:masked_fill(m, -1.5) end, true)
    end
  end)

  it("reductions: sum, mean, max/min (dim and all), argmax", function()
    need_gpu()
    for _, dt in ipairs(FLOAT) do
      for _, shape in ipairs({ { 2, 3, 50 }, { 7, 129 }, { 1000 } }) do
        local x = rnd(shape, dt)
        conform("sum all", dt, { x }, function(t) return t:sum() end, true)
        conform("mean all", dt, { x }, function(t) return t:mean() end, true)
        conform("max all", dt, { x }, function(t) return t:max() end, true)
        conform("min all", dt, { x }, function(t) return t:min() end, true)
        conform("argmax all", dt, { x }, function(t) return t:argmax() end)
        for d = 1, #shape do
          conform("sum dim " .. d, dt, { x }, function(t) return t:sum(d) end, true)
          conform("mean dim keepdim " .. d, dt, { x }, function(t) return t:mean(d, true) end, true)
          conform("max dim " .. d, dt, { x }, function(t) return t:max(d) end, true)
          conform("min dim " .. d, dt, { x }, function(t) return t:min(d, true) end, true)
          conform("argmax dim " .. d, dt, { x }, function(t) return t:argmax(d) end)
        end
        if #shape == 3 then
          conform("sum dims {1,3}", dt, { x }, function(t) return t:sum({ 1, 3 }) end, true)
          conform("sum of a view", dt, { x }, function(t) return t:transpose(1, 3):sum(2) end, true)
        end
      end
    end
    conform("int sum", "i64", { rnd({ 4, 9 }, "f64", -50, 50):to("i64") }, function(t) return t:sum(), t:sum(2) end)
  end)

  it("softmax, log_softmax, layer_norm, rms_norm", function()
    need_gpu()
    for _, dt in ipairs(FLOAT) do
      for _, shape in ipairs({ { 4, 37 }, { 2, 3, 1024 }, { 3, 5, 7 } }) do
        local x = rnd(shape, dt)
        for d = 1, #shape do
          conform("softmax dim " .. d, dt, { x }, function(t) return t:softmax(d) end, true)
          conform("log_softmax dim " .. d, dt, { x }, function(t) return t:log_softmax(d) end, true)
        end
        local n = shape[#shape]
        conform("layer_norm", dt, { x, rnd({ n }, dt), rnd({ n }, dt) },
          function(t, w, b) return F.layer_norm(t, { n }, w, b, 1e-5) end, true)
        conform("layer_norm (no affine)", dt, { x }, function(t) return F.layer_norm(t, { n }, nil, nil, 1e-5) end, true)
        conform("rms_norm", dt, { x, rnd({ n }, dt) }, function(t, w) return F.rms_norm(t, { n }, w, 1e-6) end, true)
      end
    end
  end)

  it("embedding, cross_entropy (all reductions, ignore_index, label smoothing), dropout", function()
    need_gpu()
    for _, dt in ipairs(FLOAT) do
      local w = rnd({ 50, 16 }, dt)
      local idx = rnd({ 3, 7 }, "f64", 0, 49.99):to("i64")
      conform("embedding", dt, { w, idx }, function(W, I) return F.embedding(I, W) end, true)
      conform("embedding padding_idx", dt, { w, idx }, function(W, I) return F.embedding(I, W, 3) end, true)
      for _, C in ipairs({ 10, 50304 }) do
        local N = C > 1000 and 8 or 13
        local x = rnd({ N, C }, dt)
        local t = rnd({ N }, "f64", 0, C - 0.01):to("i64")
        t:set(-100, 2)
        for _, red in ipairs({ "mean", "sum", "none" }) do
          for _, ls in ipairs({ 0, 0.1 }) do
            conform("cross_entropy " .. red .. " C=" .. C .. " ls=" .. ls, dt, { x, t },
              function(X, T) return F.cross_entropy(X, T, { reduction = red, label_smoothing = ls }) end, true)
          end
        end
      end
    end
    -- dropout: the same (seed, offset) gives the same mask on both devices, forward and backward
    for _, dt in ipairs(FLOAT) do
      local x = rnd({ 8, 33 }, dt)
      local xc, xg = leaf(x, true), leaf(x:cuda(), true)
      engine.manual_seed(77)
      local yc = F.dropout(xc, 0.3, true)
      engine.manual_seed(77)
      local yg = F.dropout(xg, 0.3, true)
      compare(yg, yc, { 0, 0 }, "dropout " .. dt)
      yc:sum():backward(); yg:sum():backward()
      compare(xg.grad, xc.grad, { 0, 0 }, "dropout grad " .. dt)
    end
    -- random fills are the same numbers too
    engine.manual_seed(5); local a = engine.empty(1000):uniform_(-1, 2)
    engine.manual_seed(5); local b = engine.empty(1000, { device = "cuda" }):uniform_(-1, 2)
    compare(b, a, { 0, 0 }, "uniform_")
  end)

  it("scaled_dot_product_attention (flash kernels), causal or not, several head dims", function()
    need_gpu()
    for _, dt in ipairs({ "f32", "bf16", "f16" }) do
      for _, cfg in ipairs({ { 2, 3, 17, 17, 32 }, { 1, 2, 64, 64, 64 }, { 2, 2, 33, 50, 128 }, { 1, 1, 5, 9, 24 } }) do
        local B, H, L, S, D = unpack(cfg)
        for _, causal in ipairs({ false, true }) do
          conform(string.format("sdpa B%d H%d L%d S%d D%d causal=%s", B, H, L, S, D, tostring(causal)), dt,
            { rnd({ B, H, L, D }, dt), rnd({ B, H, S, D }, dt), rnd({ B, H, S, D }, dt) },
            function(q, k, v) return F.scaled_dot_product_attention(q, k, v, { is_causal = causal }) end, true)
        end
      end
      -- [B, L, H, D] projections seen as [B, H, L, D] (strided views)
      conform("sdpa on transposed views", dt, { rnd({ 2, 16, 4, 32 }, dt), rnd({ 2, 16, 4, 32 }, dt), rnd({ 2, 16, 4, 32 }, dt) },
        function(q, k, v)
          return F.scaled_dot_product_attention(q:transpose(2, 3), k:transpose(2, 3), v:transpose(2, 3), { is_causal = true })
        end, true)
    end
    -- dropout (and masks, f64, other shapes) take the math path on the device: spec/sdpa_math_spec.lua
    local q = engine.randn(1, 1, 4, 8):cuda()
    local o = F.scaled_dot_product_attention(q, q, q, { dropout_p = 0.1 })
    assert.are.equal("cuda", o.device)
  end)

  it("matmul (all ranks, broadcast batches, transposed views), linear with and without bias", function()
    need_gpu()
    local cases = {
      { { 5, 7 }, { 7, 3 } }, { { 7 }, { 7, 3 } }, { { 5, 7 }, { 7 } }, { { 7 }, { 7 } }, { { 4, 5, 7 }, { 4, 7, 3 } },
      { { 4, 5, 7 }, { 7, 3 } }, { { 2, 1, 5, 7 }, { 3, 7, 6 } }, { { 64, 96 }, { 96, 128 } },
    }
    for _, dt in ipairs(FLOAT) do
      for _, c in ipairs(cases) do
        conform("matmul " .. table.concat(c[1], "x") .. " @ " .. table.concat(c[2], "x"), dt, { rnd(c[1], dt), rnd(c[2], dt) },
          function(a, b) return a:matmul(b) end, true)
      end
      conform("matmul of transposed views", dt, { rnd({ 7, 5 }, dt), rnd({ 3, 7 }, dt) },
        function(a, b) return a:t():matmul(b:t()) end, true)
      for _, xs in ipairs({ { 6, 16 }, { 2, 9, 16 }, { 16 } }) do
        conform("linear+bias " .. table.concat(xs, "x"), dt, { rnd(xs, dt), rnd({ 24, 16 }, dt), rnd({ 24 }, dt) },
          function(x, w, b) return F.linear(x, w, b) end, true)
        conform("linear " .. table.concat(xs, "x"), dt, { rnd(xs, dt), rnd({ 24, 16 }, dt) },
          function(x, w) return F.linear(x, w) end, true)
      end
    end
  end)

  -- tanh GELU rides in cuBLASLt's epilogue (BIAS_GELU_AUX; out_features a multiple of 8): against the CPU's
  -- fused op and against the GPU's own composition; exact GELU, other widths and ENGINE_GELU_EPILOGUE=0 run the
  -- composition
  it("linear_gelu: tanh GELU in cuBLASLt's epilogue, values and gradients; the composition elsewhere", function()
    need_gpu()
    for _, dt in ipairs({ "f32", "bf16", "f16" }) do
      for _, xs in ipairs({ { 6, 16 }, { 2, 9, 16 }, { 4, 33, 16 } }) do
        for _, of in ipairs({ 24, 40, 20 }) do
          for _, approx in ipairs({ "tanh", "none" }) do
            for _, with_bias in ipairs({ true, false }) do
              local what = string.format("linear_gelu %s -> %d %s bias=%s", table.concat(xs, "x"), of, approx,
                tostring(with_bias))
              local ins = { rnd(xs, dt), rnd({ of, 16 }, dt) * 0.25 }
              if with_bias then ins[3] = rnd({ of }, dt) end
              conform(what, dt, ins, function(x, w, b) return F.linear_gelu(x, w, b, approx) end, true)
              local x, w = ins[1]:cuda():requires_grad_(true), ins[2]:cuda():requires_grad_(true)
              local b = with_bias and ins[3]:cuda():requires_grad_(true) or nil
              local y = F.linear_gelu(x, w, b, approx)
              local fused = approx == "tanh" and of % 8 == 0 and os.getenv("ENGINE_GELU_EPILOGUE") ~= "0"
              assert.are.equal(fused and "LinearGeluBackward" or "GeluBackward", y.grad_fn, what)
              local y2 = F.gelu(F.linear(x:detach(), w:detach(), b and b:detach() or nil), approx)
              compare(y, y2:cpu(), TOL[dt], what .. " against the GPU composition")
            end
          end
        end
      end
    end
    -- no rows: an empty result, gradients of zeros
    local x = engine.randn(0, 16):cuda():requires_grad_(true)
    local w = engine.randn(24, 16):cuda():requires_grad_(true)
    local y = F.linear_gelu(x, w, nil, "tanh")
    assert.are.same({ 0, 24 }, y:shape())
    y:sum():backward()
    assert.are.equal(0, w.grad:abs():sum():item())
  end)

  it("cat, stack, index_select", function()
    need_gpu()
    for _, dt in ipairs({ "f32", "bf16" }) do
      conform("cat", dt, { rnd({ 2, 3 }, dt), rnd({ 2, 5 }, dt) }, function(a, b) return engine.cat({ a, b }, 2) end, true)
      conform("stack", dt, { rnd({ 2, 3 }, dt), rnd({ 2, 3 }, dt) }, function(a, b) return engine.stack({ a, b:t():t() }, 1) end, true)
      conform("index_select", dt, { rnd({ 6, 4, 3 }, dt), engine.tensor({ 5, 0, 2, 2 }) },
        function(x, i) return x:index_select(1, i), x:index_select(2, i:narrow(1, 2, 3)) end, true)
    end
  end)

  it("AdamW, global norm and clip_grad_norm_ match the CPU over several steps", function()
    need_gpu()
    for _, dt in ipairs({ "f32", "bf16" }) do
      engine.manual_seed(9)
      local mc = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
      mc:to(dt)
      engine.manual_seed(9)
      local mg = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
      mg:to(dt)
      mg:to("cuda")
      local oc = optim.AdamW(mc:parameters(), { lr = 1e-2, weight_decay = 0.1 })
      local og = optim.AdamW(mg:parameters(), { lr = 1e-2, weight_decay = 0.1 })
      local x = engine.randn(5, 8):to(dt)
      for _ = 1, 3 do
        oc:zero_grad(); og:zero_grad()
        mc(x):pow(2):mean():backward()
        mg(x:cuda()):pow(2):mean():backward()
        local nc = optim.clip_grad_norm_(mc:parameters(), 0.05)
        local ng = optim.clip_grad_norm_(mg:parameters(), 0.05)
        -- PyTorch's total norm: a 0-dim tensor on the gradients' device
        assert.are.same({ "cpu", "cuda", 0 }, { nc.device, ng.device, ng:dim() })
        nc, ng = nc:item(), ng:item()
        assert.is_true(math.abs(nc - ng) <= 1e-3 * math.abs(nc) + 1e-6, string.format("grad norm %g vs %g", nc, ng))
        oc:step(); og:step()
      end
      local pc, pg = mc:parameters(), mg:parameters()
      for i = 1, #pc do compare(pg[i], pc[i], GTOL[dt], "AdamW param " .. i .. " " .. dt) end
    end
  end)

  it("SGD (momentum, dampening, Nesterov, weight decay) matches the CPU over several steps", function()
    need_gpu()
    for _, o in ipairs({ { lr = 0.1 }, { lr = 0.05, momentum = 0.9, dampening = 0.3, weight_decay = 0.1 },
                         { lr = 0.05, momentum = 0.8, nesterov = true, weight_decay = 0.02 } }) do
      for _, dt in ipairs({ "f32", "bf16" }) do
        engine.manual_seed(10)
        local mc = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        mc:to(dt)
        engine.manual_seed(10)
        local mg = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        mg:to(dt)
        mg:to("cuda")
        local oc, og = optim.SGD(mc:parameters(), o), optim.SGD(mg:parameters(), o)
        local x = engine.randn(5, 8):to(dt)
        for _ = 1, 3 do
          oc:zero_grad(); og:zero_grad()
          mc(x):pow(2):mean():backward()
          mg(x:cuda()):pow(2):mean():backward()
          oc:step(); og:step()
        end
        local pc, pg = mc:parameters(), mg:parameters()
        for i = 1, #pc do compare(pg[i], pc[i], GTOL[dt], "SGD param " .. i .. " " .. dt) end
      end
    end
  end)

  it("clip_grad_norm_ and global norms of other orders (1, 0, 3, -inf) on device gradients match the CPU", function()
    need_gpu()
    for _, dt in ipairs({ "f32", "bf16" }) do
      for _, p in ipairs({ 1, 0, 3, -math.huge }) do
        engine.manual_seed(12)
        local a, b = engine.randn(7, 5):to(dt), engine.randn(11):to(dt)
        local pc = { a:clone():requires_grad_(true), b:clone():requires_grad_(true) }
        local pg = { a:cuda():requires_grad_(true), b:cuda():requires_grad_(true) }
        local ga, gb = engine.randn(7, 5):to(dt), engine.randn(11):to(dt)
        pc[1].grad, pc[2].grad = ga:clone(), gb:clone()
        pg[1].grad, pg[2].grad = ga:cuda(), gb:cuda()
        local nc = optim.clip_grad_norm_(pc, 0.5, p)
        local ng = optim.clip_grad_norm_(pg, 0.5, p)
        assert.are.equal("cuda", ng.device)
        nc, ng = nc:item(), ng:item()
        assert.is_true(math.abs(nc - ng) <= 1e-5 * math.abs(nc) + 1e-6, string.format("p=%g %s: %g vs %g", p, dt, nc, ng))
        for i = 1, 2 do compare(pg[i].grad, pc[i].grad, GTOL[dt], string.format("clipped grad %d p=%g %s", i, p, dt)) end
      end
    end
  end)

  it("engine.save writes device tensors from a host copy; load gives them back", function()
    need_gpu()
    local a, b = engine.randn(3, 4):cuda(), engine.randn(5):to("bf16"):cuda()
    local path = os.tmpname()
    engine.save(path, { a = a, b = b })
    local r = engine.load(path)
    os.remove(path)
    assert.are.equal(0, (r.a - a:cpu()):abs():max():item())
    assert.are.equal(0, (r.b:float() - b:cpu():float()):abs():max():item())
  end)

  it("cross_entropy over [N, C, d1, ...] logits (every reduction, ignore_index)", function()
    need_gpu()
    for _, dt in ipairs({ "f32", "bf16" }) do
      local x = rnd({ 2, 5, 3, 4 }, dt)
      local t = rnd({ 2, 3, 4 }, "f64", 0, 4.99):to("i64")
      t:view(-1):set(-100, 7)
      for _, red in ipairs({ "mean", "sum", "none" }) do
        conform("cross_entropy [N, C, d1, d2] " .. red, dt, { x, t },
          function(X, T) return F.cross_entropy(X, T, { reduction = red }) end, true)
      end
    end
  end)

  it("the parity fixture's Transformer on the GPU in f32 (logits, loss, gradients, AdamW losses)", function()
    need_gpu()
    local t, meta = engine.load("spec/fixtures/transformer_f32.safetensors")
    local function build()
      local m = nn.Transformer({ n_layers = tonumber(meta.n_layers), vocab_size = tonumber(meta.vocab_size),
        max_seq_len = tonumber(meta.max_seq_len), dim = tonumber(meta.dim), n_heads = tonumber(meta.n_heads),
        dropout_p = tonumber(meta.dropout_p), use_attn_mask = meta.use_attn_mask == "True",
        weight_tying = meta.weight_tying == "True" })
      local sd = {}
      for _, name in ipairs(m:state_dict_keys()) do sd[name] = t[name] end
      m:load_state_dict(sd)
      m:to("cuda")
      m:train()
      return m
    end
    local model = build()
    local tokens, targets = t.tokens:cuda(), t.targets:cuda()
    local function rel(a, ref) return maxabs(a:cpu():double() - ref:double()) / math.max(maxabs(ref), 1e-30) end
    local logits = model(tokens)
    local V = logits:size(-1)
    local loss = F.cross_entropy(logits:view(-1, V), targets:view(-1))
    assert.is_true(rel(logits, t.logits) <= 1e-4, "logits relative error " .. rel(logits, t.logits))
    assert.is_true(math.abs(loss:item() - t.loss:item()) <= 1e-5)
    loss:backward()
    for name, p in model:named_parameters() do
      local e = rel(p.grad, t["grad." .. name])
      assert.is_true(e <= 1e-3, string.format("gradient of %s: relative error %.3g", name, e))
    end
    model = build()
    local opt = optim.AdamW(model:parameters(), { lr = tonumber(meta.adamw_lr),
      betas = { tonumber(meta.adamw_beta1), tonumber(meta.adamw_beta2) }, eps = tonumber(meta.adamw_eps),
      weight_decay = tonumber(meta.adamw_weight_decay) })
    local want = t.adamw_losses:tolist_flat()
    for i = 1, #want do
      opt:zero_grad()
      local l = F.cross_entropy(model(tokens):view(-1, V), targets:view(-1))
      assert.is_true(math.abs(l:item() - want[i]) <= 1e-4 * math.max(1, math.abs(want[i])),
        string.format("step %d: loss %.6f vs PyTorch %.6f", i, l:item(), want[i]))
      l:backward()
      opt:step()
    end
  end)
end)
