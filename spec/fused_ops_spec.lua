-- The fused ops of the GPT block: linear_gelu (gelu(linear(x, w, b)), the gelu as the GEMM's epilogue) and
-- add_layer_norm (h = x + r, y = layer_norm(h) in one pass each way).  Each against its composition (values and
-- gradients, bit for bit in f32 and f64, at 1 and 2 threads), float64 finite differences, the composition's
-- fallbacks and errors, and the Transformer built on them against the same model run through the composition.
local engine = require("engine")
local nn = engine.nn
local F = nn.functional
local gc = require("spec.helpers.gradcheck")

-- body(th) at 1 and then 2 threads; the thread count is restored afterwards, also when body fails
local function at_thread_counts(body)
  local prev = engine.get_num_threads()
  local ok, err = pcall(function()
    for _, th in ipairs({ 1, 2 }) do
      engine.set_num_threads(th)
      body(th)
    end
  end)
  engine.set_num_threads(prev)
  if not ok then error(err, 0) end
end

local function maxdiff(a, b) return (a - b):abs():max():item() end

local function grads(ts)
  local g = {}
  for i, t in ipairs(ts) do g[i] = t.grad and t.grad:clone() or false; t.grad = nil end
  return g
end

local function same_list(a, b, what)
  assert.are.equal(#a, #b, what)
  for i = 1, #a do
    if a[i] then assert.are.equal(0, maxdiff(a[i], b[i]), string.format("%s [%d]", what, i)) end
  end
end

describe("linear_gelu", function()
  it("equals gelu(linear(x, w, b)) bit for bit, values and gradients", function()
    at_thread_counts(function(th)
      for _, dt in ipairs({ "f32", "f64" }) do
        for _, approx in ipairs({ "none", "tanh" }) do
          -- [8, 128, 256] -> 1024 is the reference GPT's w1 (split over the threads by rows); 300 > 4 * 33 rows
          -- splits by columns; the small ones run on one thread
          for _, s in ipairs({ { 8, 128, 256, 1024 }, { 4, 33, 50, 300 }, { 3, 5, 7, 9 }, { 1, 1, 4, 4 } }) do
            for _, with_bias in ipairs({ true, false }) do
              engine.manual_seed(7)
              local x = engine.randn(s[1], s[2], s[3]):to(dt):requires_grad_(true)
              local w = (engine.randn(s[4], s[3]) * 0.1):to(dt):requires_grad_(true)
              local b = with_bias and engine.randn(s[4]):to(dt):requires_grad_(true) or nil
              local g = engine.randn(s[1], s[2], s[4]):to(dt)
              local ins = { x, w, b }
              local y1 = F.gelu(F.linear(x, w, b), approx)
              y1:backward(g)
              local g1 = grads(ins)
              local y2 = F.linear_gelu(x, w, b, approx)
              assert.are.equal("LinearGeluBackward", y2.grad_fn)
              y2:backward(g)
              local g2 = grads(ins)
              local what = string.format("%s %s %s bias=%s threads=%d", dt, approx, table.concat(s, "x"),
                tostring(with_bias), th)
              assert.are.equal(0, maxdiff(y1, y2), what .. " values")
              same_list(g1, g2, what .. " grads")
            end
          end
        end
      end
    end)
  end)

  it("has float64 gradients that match finite differences", function()
    engine.manual_seed(3)
    local x = engine.randn(2, 3, 5, { dtype = "f64" }):requires_grad_(true)
    local w = engine.randn(4, 5, { dtype = "f64" }):requires_grad_(true)
    local b = engine.randn(4, { dtype = "f64" }):requires_grad_(true)
    assert.is_true(gc.check(function(x_, w_, b_) return F.linear_gelu(x_, w_, b_) end, { x, w, b }))
    assert.is_true(gc.check(function(x_, w_, b_) return F.linear_gelu(x_, w_, b_, "tanh") end, { x, w, b }))
    assert.is_true(gc.check(function(x_, w_) return F.linear_gelu(x_, w_) end, { x, w }))
  end)

  it("runs the composition where it does not fuse (1-D input, mixed dtypes) and keeps its errors", function()
    local x = engine.randn(5)
    local w = engine.randn(3, 5)
    assert.are.equal(0, maxdiff(F.gelu(F.linear(x, w)), F.linear_gelu(x, w)))
    local ok, err = pcall(F.linear_gelu, engine.randn(2, 4), engine.randn(3, 5))
    assert.is_false(ok)
    assert.truthy(tostring(err):find("in_features", 1, true), tostring(err))
    ok, err = pcall(F.linear_gelu, engine.randn(2, 4), engine.randn(3, 4), nil, "sigmoid")
    assert.is_false(ok)
    assert.truthy(tostring(err):find("approximate", 1, true), tostring(err))
    ok, err = pcall(F.linear_gelu, engine.randn(2, 4), engine.randn(3, 4), engine.randn(4))
    assert.is_false(ok)
    assert.truthy(tostring(err):find("bias", 1, true), tostring(err))
  end)
end)

describe("add_layer_norm", function()
  it("equals h = x + r; y = layer_norm(h) bit for bit, with h used elsewhere or not", function()
    at_thread_counts(function(th)
      for _, dt in ipairs({ "f32", "f64" }) do
        for _, s in ipairs({ { 8, 128, 256 }, { 2, 70, 33 }, { 3, 5, 7 }, { 1, 1, 4 } }) do
          for _, affine in ipairs({ true, false }) do
            for _, uses in ipairs({ "both", "y", "h" }) do
              engine.manual_seed(11)
              local D = s[3]
              local x = engine.randn(s[1], s[2], D):to(dt):requires_grad_(true)
              local r = engine.randn(s[1], s[2], D):to(dt):requires_grad_(true)
              local w = affine and (engine.randn(D) + 1):to(dt):requires_grad_(true) or nil
              local b = affine and engine.randn(D):to(dt):requires_grad_(true) or nil
              local gy, gh = engine.randn(s[1], s[2], D):to(dt), engine.randn(s[1], s[2], D):to(dt)
              local ins = { x, r, w, b }
              local function run(fused)
                local y, h
                if fused then y, h = F.add_layer_norm(x, r, { D }, w, b)
                else h = x + r; y = F.layer_norm(h, { D }, w, b) end
                local loss
                if uses ~= "h" then loss = (y * gy):sum() end
                if uses ~= "y" then loss = loss and loss + (h * gh):sum() or (h * gh):sum() end
                loss:backward()
                return y:detach(), h:detach(), grads(ins)
              end
              local y1, h1, g1 = run(false)
              local y2, h2, g2 = run(true)
              assert.are.equal("AddLayerNormBackward", select(2, F.add_layer_norm(x, r, { D }, w, b)).grad_fn)
              local what = string.format("%s %s affine=%s uses=%s threads=%d", dt, table.concat(s, "x"),
                tostring(affine), uses, th)
              assert.are.equal(0, maxdiff(y1, y2), what .. " y")
              assert.are.equal(0, maxdiff(h1, h2), what .. " h")
              same_list(g1, g2, what .. " grads")
            end
          end
        end
      end
    end)
  end)

  it("has float64 gradients that match finite differences (both outputs)", function()
    engine.manual_seed(5)
    local x = engine.randn(2, 3, 6, { dtype = "f64" }):requires_grad_(true)
    local r = engine.randn(2, 3, 6, { dtype = "f64" }):requires_grad_(true)
    local w = (engine.randn(6, { dtype = "f64" }) + 1):requires_grad_(true)
    local b = engine.randn(6, { dtype = "f64" }):requires_grad_(true)
    assert.is_true(gc.check(function(x_, r_, w_, b_)
      local y, h = F.add_layer_norm(x_, r_, 6, w_, b_)
      return { y, h }
    end, { x, r, w, b }))
    assert.is_true(gc.check(function(x_, r_) return (F.add_layer_norm(x_, r_, { 3, 6 }, nil, nil, 1e-3)) end, { x, r }))
  end)

  it("runs the composition for broadcast operands and keeps the norm's errors", function()
    local x, p = engine.randn(2, 4, 8), engine.randn(4, 8)
    local w, b = engine.randn(8), engine.randn(8)
    local y, h = F.add_layer_norm(x, p, 8, w, b)
    local h0 = x + p
    assert.are.equal(0, maxdiff(h0, h))
    assert.are.equal(0, maxdiff(F.layer_norm(h0, { 8 }, w, b), y))
    local ok, err = pcall(F.add_layer_norm, x, x, 8, engine.randn(7))
    assert.is_false(ok)
    assert.truthy(tostring(err):find("weight", 1, true), tostring(err))
  end)
end)

describe("silu_mul", function()
  it("equals silu(a) * b bit for bit, values and gradients, contiguous or not, one or both needing grad", function()
    at_thread_counts(function(th)
      for _, dt in ipairs({ "f32", "f64" }) do
        -- [8, 128, 768]: the Llama step's w1 / w3 outputs (split over the threads); the others run on one
        for _, s in ipairs({ { 8, 128, 768 }, { 3, 33, 257 }, { 1, 1, 5 }, { 0, 4, 3 } }) do
          for _, mode in ipairs({ "both", "a", "b", "strided" }) do
            engine.manual_seed(13)
            local a = (engine.randn(s[1], s[2], s[3]) * 4):to(dt)
            local b = engine.randn(s[1], s[2], s[3]):to(dt)
            if mode == "strided" then a = a:transpose(1, 3):contiguous():transpose(1, 3) end
            a:requires_grad_(mode ~= "b")
            b:requires_grad_(mode ~= "a")
            local g = engine.randn(s[1], s[2], s[3]):to(dt)
            local y1 = F.silu(a) * b
            y1:backward(g)
            local g1 = grads({ a, b })
            local y2 = F.silu_mul(a, b)
            assert.are.equal("SiluMulBackward", y2.grad_fn)
            y2:backward(g)
            local g2 = grads({ a, b })
            local what = string.format("%s %s %s threads=%d", dt, table.concat(s, "x"), mode, th)
            if y1:numel() > 0 then assert.are.equal(0, maxdiff(y1, y2), what .. " values") end
            assert.are.same({ s[1], s[2], s[3] }, y2:shape())
            for i = 1, 2 do assert.are.equal(not g1[i], not g2[i], what .. " which inputs got gradients") end
            if y1:numel() > 0 then same_list(g1, g2, what .. " grads") end
          end
        end
      end
    end)
  end)

  it("has float64 gradients that match finite differences", function()
    engine.manual_seed(4)
    local a = (engine.randn(3, 7, { dtype = "f64" }) * 3):requires_grad_(true)
    local b = engine.randn(3, 7, { dtype = "f64" }):requires_grad_(true)
    assert.is_true(gc.check(function(a_, b_) return F.silu_mul(a_, b_) end, { a, b }))
  end)

  it("runs the composition for half dtypes and without grad; bad arguments are errors naming both", function()
    engine.manual_seed(5)
    local a, b = engine.randn(4, 6):to("bf16"), engine.randn(4, 6):to("bf16")
    local y = F.silu_mul(a, b)
    assert.are.equal("bf16", y.dtype)
    assert.are.equal(0, maxdiff(y, F.silu(a) * b))
    local a32, b32 = engine.randn(4, 6), engine.randn(4, 6)
    assert.is_nil(F.silu_mul(a32, b32).grad_fn)
    local ok, err = pcall(F.silu_mul, a32, engine.randn(4, 5))
    assert.is_false(ok)
    assert.truthy(tostring(err):find("silu_mul: expected a and b of one shape, got a f32[4,6], b f32[4,5]", 1, true),
      tostring(err))
    ok, err = pcall(F.silu_mul, a32, b32:double())
    assert.is_false(ok)
    assert.truthy(tostring(err):find("silu_mul: expected two floating point tensors of one dtype", 1, true),
      tostring(err))
    ok, err = pcall(F.silu_mul, engine.ones(2, { dtype = "i32" }), engine.ones(2, { dtype = "i32" }))
    assert.is_false(ok)
    assert.truthy(tostring(err):find("floating point", 1, true), tostring(err))
    ok, err = pcall(F.silu_mul, a32, "x")
    assert.is_false(ok)
    assert.truthy(tostring(err):find("silu_mul", 1, true), tostring(err))
    -- meta tensors: a meta result of the shape
    local m = F.silu_mul(engine.empty(2, 3, { device = "meta" }), engine.empty(2, 3, { device = "meta" }))
    assert.are.equal("meta", m.device)
    assert.are.same({ 2, 3 }, m:shape())
  end)
end)

describe("silu_mul on the GPU #gpu", function()
  it("equals the silu and mul kernels bit for bit on the device, and the CPU within rounding (f32, bf16, f16)", function()
    if not engine.cuda.is_available() then pending("no GPU: " .. engine.cuda.unavailable_reason()) end
    for _, dt in ipairs({ "f32", "bf16", "f16", "f64" }) do
      engine.manual_seed(14)
      local a0 = (engine.randn(3, 70, 257) * 3):to(dt)
      local b0 = engine.randn(3, 70, 257):to(dt)
      local g = engine.randn(3, 70, 257):to(dt):cuda()
      local a1, b1 = a0:cuda():requires_grad_(), b0:cuda():requires_grad_()
      local a2, b2 = a0:cuda():requires_grad_(), b0:cuda():requires_grad_()
      local y1 = F.silu_mul(a1, b1)
      assert.are.equal("cuda", y1.device)
      assert.are.equal("SiluMulBackward", y1.grad_fn)
      y1:backward(g)
      local y2 = F.silu(a2) * b2
      y2:backward(g)
      assert.are.equal(0, maxdiff(y1:cpu(), y2:cpu()), dt .. " values against the two kernels")
      assert.are.equal(0, maxdiff(a1.grad:cpu(), a2.grad:cpu()), dt .. " a's gradient against the two kernels")
      assert.are.equal(0, maxdiff(b1.grad:cpu(), b2.grad:cpu()), dt .. " b's gradient against the two kernels")
      local tol = (dt == "f32" or dt == "f64") and 1e-5 or 0.1
      local yc = F.silu_mul(a0:float(), b0:float())
      assert.is_true(maxdiff(y1:cpu():float(), yc) <= tol, dt .. " against the CPU " .. maxdiff(y1:cpu():float(), yc))
    end
  end)
end)

describe("the Transformer on the fused ops", function()
  it("gives the loss and gradients of the same model run through the unfused ops", function()
    local function run(unfused)
      engine.manual_seed(0)
      local model = nn.Transformer{ n_layers = 2, dim = 32, n_heads = 4, vocab_size = 16, max_seq_len = 8,
        dropout_p = 0 }
      if unfused then  -- a forward hook makes FeedForward and TransformerBlock call the modules one by one
        for _, layer in ipairs(model.layers) do
          layer.feed_forward.w1:register_forward_hook(function() end)
          layer.ffn_norm:register_forward_hook(function() end)
        end
      end
      local tok = (engine.rand(2, 9) * 16):long():clamp(0, 15)
      local x, y = tok:narrow(2, 1, 8):contiguous(), tok:narrow(2, 2, 8):contiguous()
      local loss = F.cross_entropy(model(x):view(-1, 16), y:view(-1))
      loss:backward()
      local g = {}
      for name, p in model:named_parameters() do g[name] = p.grad end
      return loss:item(), g
    end
    local l1, g1 = run(true)
    local l2, g2 = run(false)
    assert.are.equal(l1, l2)
    local n = 0
    for name, g in pairs(g1) do
      assert.are.equal(0, maxdiff(g, g2[name]), name)
      n = n + 1
    end
    assert.is_true(n > 0)
  end)
end)
