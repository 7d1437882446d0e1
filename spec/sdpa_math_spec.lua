-- scaled_dot_product_attention's math path (engine/src/ops/attention.c, sdpa_math: PyTorch's
-- _scaled_dot_product_attention_math from the engine's ops) and the backend choice
-- (engine.nn.attention.sdpa_kernel, PyTorch's torch.nn.attention.sdpa_kernel).  On the CPU the math path equals
-- the fused kernel (values and gradients; the same dropout masks for the same seed; zeros for rows with nothing
-- to attend to, finite gradients); float64 finite differences through it.  "#gpu": on CUDA it runs what the
-- flash kernels do not take (an attn_mask, dropout, f64, head dims over 128) against the CPU.
local engine = require("engine")
local F = engine.nn.functional
local attention = engine.nn.attention
local gc = require("spec.helpers.gradcheck")

local available = engine.cuda.is_available()
local function need_gpu() if not available then pending("no GPU: " .. engine.cuda.unavailable_reason()) end end

local function maxdiff(a, b) return (a:double() - b:double()):abs():max():item() end
local function leafs(ts)
  local r = {}
  for i, t in ipairs(ts) do r[i] = t:detach():clone():requires_grad_(true) end
  return r
end

-- out, and the gradients of (out * g):sum(), of sdpa(q, k, v, opts) under the backend (seed before the call)
local function run(backend, ins, opts, g, seed)
  local q, k, v = unpack(leafs(ins))
  local o = attention.sdpa_kernel(backend, function()
    if seed then engine.manual_seed(seed) end
    return F.scaled_dot_product_attention(q, k, v, opts)
  end)
  if g then (o * g):sum():backward() end
  return o, { q.grad, k.grad, v.grad }
end

describe("scaled_dot_product_attention: the math path on the CPU", function()
  local cases = {
    { "plain", {} },
    { "causal", { is_causal = true } },
    { "bool mask", { mask = "bool" } },
    { "float mask", { mask = "float" } },
    { "dropout, causal", { dropout_p = 0.3, is_causal = true } },
    { "dropout, bool mask", { dropout_p = 0.5, mask = "bool" } },
    { "scale", { scale = 0.3 } },
  }
  for _, dt in ipairs({ "f32", "f64" }) do
    for _, cs in ipairs(cases) do
      it(string.format("equals the fused kernel (%s, %s): values and gradients", cs[1], dt), function()
        engine.manual_seed(11)
        local B, H, L, S, E = 2, 3, 5, 7, 4
        local ins = { engine.randn(B, H, L, E):to(dt), engine.randn(B, H, S, E):to(dt), engine.randn(B, H, S, E):to(dt) }
        local opts = { dropout_p = cs[2].dropout_p, is_causal = cs[2].is_causal, scale = cs[2].scale }
        if cs[2].mask == "bool" then opts.attn_mask = engine.rand(L, S):gt(0.3)
        elseif cs[2].mask == "float" then opts.attn_mask = engine.randn(B, 1, L, S):to(dt) end
        local g = engine.randn(B, H, L, E):to(dt)
        local o1, g1 = run("flash", ins, opts, g, 7)
        local o2, g2 = run("math", ins, opts, g, 7)
        assert.are.equal("ScaledDotProductAttentionBackward", o1.grad_fn)
        assert.are_not.equal("ScaledDotProductAttentionBackward", o2.grad_fn)
        local tol = dt == "f64" and 1e-12 or 2e-6
        assert.is_true(maxdiff(o1, o2) <= tol, cs[1] .. " values " .. maxdiff(o1, o2))
        for i = 1, 3 do
          assert.is_true(maxdiff(g1[i], g2[i]) <= tol * 10, string.format("%s grad %d: %g", cs[1], i, maxdiff(g1[i], g2[i])))
        end
      end)
    end
  end

  it("gives zeros for rows with nothing to attend to, and finite gradients", function()
    engine.manual_seed(12)
    local ins = { engine.randn(1, 2, 4, 3), engine.randn(1, 2, 5, 3), engine.randn(1, 2, 5, 3) }
    local m = engine.ones(4, 5):bool()
    m[3]:fill_(0)
    local fm = engine.zeros(4, 5)
    fm[2]:fill_(-math.huge)
    for _, mask in ipairs({ m, fm }) do
      local o, g = run("math", ins, { attn_mask = mask }, engine.randn(1, 2, 4, 3))
      local o1 = run("flash", ins, { attn_mask = mask })
      assert.are.equal(0, maxdiff(o, o1) > 1e-6 and 1 or 0)
      for i = 1, 3 do assert.are.equal(0, g[i]:ne(g[i]):sum():item(), "NaN in gradient " .. i) end
    end
  end)

  it("broadcasts batch dims and takes 3-D inputs", function()
    engine.manual_seed(13)
    local ins = { engine.randn(2, 3, 4, 5), engine.randn(3, 6, 5), engine.randn(3, 6, 2) }
    local o1 = run("flash", ins, {})
    local o2 = run("math", ins, {})
    assert.are.same({ 2, 3, 4, 2 }, o2:shape())
    assert.is_true(maxdiff(o1, o2) < 2e-6)
  end)

  it("has float64 gradients that match finite differences (mask, causal, scale)", function()
    engine.manual_seed(14)
    local q = engine.randn(1, 2, 3, 4, { dtype = "f64" }):requires_grad_(true)
    local k = engine.randn(1, 2, 4, 4, { dtype = "f64" }):requires_grad_(true)
    local v = engine.randn(1, 2, 4, 3, { dtype = "f64" }):requires_grad_(true)
    local fm = engine.randn(3, 4, { dtype = "f64" })
    attention.sdpa_kernel("math", function()
      assert.is_true(gc.check(function(a, b, c) return F.scaled_dot_product_attention(a, b, c, { attn_mask = fm }) end,
        { q, k, v }))
      assert.is_true(gc.check(function(a, b, c)
        return F.scaled_dot_product_attention(a, b, c, { is_causal = true, scale = 0.7 })
      end, { q, k, v }))
    end)
  end)

  it("sdpa_kernel: returns fn's results, restores the backend after an error, checks its arguments", function()
    assert.are.equal("flash", attention.current_backend())
    local a, b = attention.sdpa_kernel("math", function(x) return attention.current_backend(), x end, 5)
    assert.are.equal("math", a)
    assert.are.equal(5, b)
    assert.are.equal("flash", attention.current_backend())
    local ok, err = pcall(attention.sdpa_kernel, "math", function() error("boom") end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("boom", 1, true))
    assert.are.equal("flash", attention.current_backend())
    assert.are.equal("flash", attention.sdpa_kernel({ "math", "flash" }, attention.current_backend))
    assert.are.equal("math", attention.sdpa_kernel({ attention.SDPBackend.MATH }, attention.current_backend))
    ok, err = pcall(attention.sdpa_kernel, "cudnn", function() end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find('unknown backend "cudnn"', 1, true), tostring(err))
    ok, err = pcall(attention.sdpa_kernel, "math", 3)
    assert.truthy(tostring(err):find("expected a function", 1, true), tostring(err))
    ok, err = pcall(attention.sdpa_kernel, {}, function() end)
    assert.truthy(tostring(err):find("non-empty list", 1, true), tostring(err))
  end)
end)

describe("scaled_dot_product_attention on CUDA: the math path #gpu", function()
  -- CPU result (the fused kernel) against the GPU's math path, same seed: the dropout masks are the same draws
  local function gpu_vs_cpu(dt, ins, opts, seed, tol)
    local g = engine.randn(ins[1]:size(1), ins[1]:size(2), ins[1]:size(3), ins[3]:size(4)):to(dt)
    local oc, gcpu = run("flash", ins, opts, g, seed)
    local gins = {}
    for i, t in ipairs(ins) do gins[i] = t:cuda() end
    local gopts = {}
    for key, val in pairs(opts) do gopts[key] = (type(val) == "table" and val.cuda) and val:cuda() or val end
    local og, gg = run("flash", gins, gopts, g:cuda(), seed)
    assert.are.equal("cuda", og.device)
    assert.is_true(maxdiff(og:cpu(), oc) <= tol, "values " .. maxdiff(og:cpu(), oc))
    for i = 1, 3 do assert.is_true(maxdiff(gg[i]:cpu(), gcpu[i]) <= tol * 4, "grad " .. i .. " " .. maxdiff(gg[i]:cpu(), gcpu[i])) end
  end

  it("attn_mask (bool, float), dropout, f64 and head dim 160 run on the device and match the CPU", function()
    need_gpu()
    engine.manual_seed(21)
    local B, H, L, S, E = 2, 3, 17, 19, 16
    for _, dt in ipairs({ "f32", "f64" }) do
      local ins = { engine.randn(B, H, L, E):to(dt), engine.randn(B, H, S, E):to(dt), engine.randn(B, H, S, E):to(dt) }
      local tol = dt == "f64" and 1e-10 or 1e-4
      gpu_vs_cpu(dt, ins, { attn_mask = engine.rand(L, S):gt(0.2) }, 3, tol)
      gpu_vs_cpu(dt, ins, { attn_mask = engine.randn(B, 1, L, S):to(dt) }, 3, tol)
      gpu_vs_cpu(dt, ins, { dropout_p = 0.25, is_causal = true }, 4, tol)
    end
    local wide = { engine.randn(1, 2, 9, 160), engine.randn(1, 2, 9, 160), engine.randn(1, 2, 9, 160) }
    gpu_vs_cpu("f32", wide, { is_causal = true }, 5, 1e-4)
  end)
end)
