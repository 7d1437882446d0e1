-- The CPU fast paths of the training step: the worker pool and the kernels it
-- runs (split GEMMs, parallel elementwise ops, layer norm, bias sums, AdamW,
-- copies), block-causal attention, attention layouts that keep transposes
-- free, and in-place gradient accumulation.  Every result must equal the
-- straightforward path (one thread; explicit masks; out-of-place sums).
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local F = engine.nn.functional

local function maxdiff(a, b) return (a:double() - b:double()):abs():max():item() end

local function same(a, b, what)
  local x, y = a:tolist_flat(), b:tolist_flat()
  assert.are.equal(#x, #y)
  for i = 1, #x do
    if x[i] ~= y[i] and not (x[i] ~= x[i] and y[i] ~= y[i]) then
      error(string.format("%s: element %d differs: %.9g vs %.9g", what, i, x[i], y[i]), 2)
    end
  end
end

-- Runs fn once with one thread and once with two; returns both result lists.
local function on_threads(fn)
  local prev = engine.get_num_threads()
  engine.set_num_threads(1)
  local one = fn()
  engine.set_num_threads(2)
  local two = fn()
  engine.set_num_threads(prev)
  return one, two
end

describe("worker pool", function()
  it("gives bit-identical results on one and two threads for the step's big kernels", function()
    engine.manual_seed(7)
    local x0, w10, b10 = engine.randn(4, 100, 96), engine.randn(384, 96), engine.randn(384)
    local w20, b20 = engine.randn(96, 384), engine.randn(96)
    local lw0, lb0 = engine.randn(96), engine.randn(96)
    local g0 = engine.randn(4, 100, 96)
    local b0 = engine.randn(100, 96)
    local function run()
      local x, w1, b1, w2, b2 = x0:clone(), w10:clone(), b10:clone(), w20:clone(), b20:clone()
      local lw, lb = lw0:clone(), lb0:clone()
      for _, t in ipairs({ x, w1, b1, w2, b2, lw, lb }) do t.requires_grad = true end
      local h = F.layer_norm(x, { 96 }, lw, lb)
      local y = F.linear(F.gelu(F.linear(h, w1, b1)), w2, b2) + x
      y:backward(g0)
      local out = { y }
      for _, t in ipairs({ x, w1, b1, w2, b2, lw, lb }) do out[#out + 1] = t.grad end
      -- AdamW on the big weight, and a strided copy
      local p, m, v = w1:detach():clone(), engine.zeros(384, 96), engine.zeros(384, 96)
      engine.C.eng_adamw_step(1, engine.ffi.new("eng_tensor*[1]", { p._c }),
        engine.ffi.new("eng_tensor*[1]", { w1.grad._c }), engine.ffi.new("eng_tensor*[1]", { m._c }),
        engine.ffi.new("eng_tensor*[1]", { v._c }), 1e-3, 0.9, 0.999, 1e-8, 0.1, 1)
      out[#out + 1] = p
      out[#out + 1] = w1.grad:t():contiguous()
      out[#out + 1] = x0 + b0                          -- broadcast rows
      out[#out + 1] = w10:t():gelu()                   -- strided rows
      out[#out + 1] = x0:narrow(3, 2, 90) * x0:narrow(3, 1, 90)
      return out
    end
    local one, two = on_threads(run)
    for i = 1, #one do same(one[i], two[i], "result " .. i) end
  end)

  it("splits big GEMMs without changing them", function()
    engine.manual_seed(8)
    local a, b = engine.randn(300, 200), engine.randn(200, 260)
    local one, two = on_threads(function()
      return { a:matmul(b), a:t():contiguous():t():matmul(b), a:matmul(b:t():contiguous():t()),
        b:t():matmul(a:t()) }
    end)
    for i = 1, #one do same(one[i], two[i], "product " .. i) end
    assert.is_true(maxdiff(one[1], a:double():matmul(b:double())) < 1e-3)
  end)

  it("accepts more threads than cores and returns to one", function()
    local prev = engine.get_num_threads()
    engine.set_num_threads(3)
    assert.are.equal(3, engine.get_num_threads())
    local x = engine.randn(300, 300)
    local y = (x + 1):gelu():sum():item()
    engine.set_num_threads(1)
    assert.are.equal(y, (x + 1):gelu():sum():item())
    engine.set_num_threads(prev)
    assert.has_error(function() engine.set_num_threads(0) end)
  end)
end)

describe("block-causal attention", function()
  -- is_causal computes only the unmasked blocks; it must match an explicit
  -- lower-triangular mask (the full path) for any L, S and block boundary
  local function check(dt, B, H, L, S, E, Ev, tol, dropout)
    local function mk(...) return engine.randn(...):to(dt) end
    local q, k, v, g = mk(B, H, L, E), mk(B, H, S, E), mk(B, H, S, Ev), mk(B, H, L, Ev)
    local mask = engine.arange(0, S):view(1, S):le(engine.arange(0, L):view(L, 1))
    local function run(causal)
      local a, b, c = q:clone(), k:clone(), v:clone()
      a.requires_grad = true; b.requires_grad = true; c.requires_grad = true
      engine.manual_seed(99)
      local o = causal and F.scaled_dot_product_attention(a, b, c, nil, dropout or 0, true)
        or F.scaled_dot_product_attention(a, b, c, mask, dropout or 0, false)
      o:backward(g)
      return { o, a.grad, b.grad, c.grad }
    end
    local r1, r2 = run(true), run(false)
    for i = 1, 4 do
      local scale = r2[i]:double():abs():max():item()
      local d = maxdiff(r1[i], r2[i])
      assert(d <= tol * (scale + 1e-30), string.format("%s L%d S%d result %d: diff %g (scale %g)", dt, L, S, i, d, scale))
    end
  end

  it("matches the explicit mask in f64 over several blocks", function()
    engine.manual_seed(1)
    check("f64", 2, 3, 100, 77, 16, 8, 1e-12)
    check("f64", 2, 1, 70, 150, 16, 24, 1e-12)
    check("f64", 1, 2, 128, 128, 32, 32, 1e-12)
    check("f64", 1, 1, 1, 5, 4, 4, 1e-12)
  end)

  it("matches the explicit mask in f32 and with dropout", function()
    engine.manual_seed(2)
    check("f32", 1, 2, 128, 128, 64, 64, 1e-5)
    check("f64", 2, 2, 65, 65, 8, 8, 1e-12, 0.3)
  end)

  it("keeps the [B, L, H, E] layout of transposed q so the transposes back need no copy", function()
    engine.manual_seed(3)
    local B, L, H, E = 2, 40, 3, 8
    local x = engine.randn(B, L, H * E)
    x.requires_grad = true
    local q = x:view(B, L, H, E):transpose(2, 3)
    local o = F.scaled_dot_product_attention(q, q, q, nil, 0, true)
    assert.is_false(o:is_contiguous())
    assert.is_true(o:transpose(2, 3):is_contiguous())
    local qc = q:contiguous()
    local oc = F.scaled_dot_product_attention(qc, qc, qc, nil, 0, true)
    assert.is_true(oc:is_contiguous())
    same(o:contiguous(), oc, "output")
    local g = engine.randn(B, H, L, E)
    o:backward(g)
    local x2 = x:detach():clone()
    x2.requires_grad = true
    local q2 = x2:view(B, L, H, E):transpose(2, 3):contiguous()
    F.scaled_dot_product_attention(q2, q2, q2, nil, 0, true):backward(g)
    assert.is_true(maxdiff(x.grad, x2.grad) < 1e-5)
  end)
end)

describe("gradient accumulation", function()
  it("sums the gradients of several linears sharing an input in place", function()
    engine.manual_seed(4)
    local x = engine.randn(4, 5, 8)
    x.requires_grad = true
    local ws = { engine.randn(6, 8), engine.randn(6, 8), engine.randn(6, 8) }
    local h = x * 1.0
    local out = F.linear(h, ws[1]):sum() + F.linear(h, ws[2]):sum() * 2 + F.linear(h, ws[3]):sum() * 3
    out:backward()
    local e = ws[1]:sum(1) + ws[2]:sum(1) * 2 + ws[3]:sum(1) * 3
    assert.is_true(maxdiff(x.grad, e:expand(4, 5, 8)) < 1e-5)
  end)

  it("never lets .grad alias a gradient someone else holds", function()
    local x = engine.ones(3)
    x.requires_grad = true
    local g = engine.full({ 3 }, 2.0)
    x:backward(g)             -- the root gradient is the caller's tensor
    x.grad:add_(engine.ones(3))
    assert.are.same({ 2, 2, 2 }, g:totable())
    local kept
    local y = engine.ones(3)
    y.requires_grad = true
    y:register_hook(function(gr) kept = gr end)
    local z = (y * 3):sum()
    z:backward()
    y.grad:add_(engine.ones(3))
    assert.are.same({ 3, 3, 3 }, kept:totable())
    assert.are.same({ 4, 4, 4 }, y.grad:totable())
  end)

  it("adds fan-in gradients without touching tensors held elsewhere", function()
    local x = engine.ones(4)
    x.requires_grad = true
    local held
    local a = x * 2
    a:register_hook(function(gr) held = gr end)
    local s = (a + a * 3):sum()   -- a's gradient: 1 (direct) + 3 (through the product)
    s:backward()
    assert.are.same({ 4, 4, 4, 4 }, held:totable())
    assert.are.same({ 8, 8, 8, 8 }, x.grad:totable())
  end)
end)
