-- scaled_dot_product_attention: values (hand-computed and PyTorch), masks,
-- causal alignment, dropout through the global RNG, autograd, errors.
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local core = require("engine.core")
local gc = require("spec.helpers.gradcheck")

local sdpa = engine.scaled_dot_product_attention

local function close(t, expected, tol)
  if type(tol) ~= "number" then tol = nil end
  local got = t:tolist_flat()
  assert.are.equal(#expected, #got)
  for i = 1, #expected do
    local e, g = expected[i], got[i]
    local ok = (e == g) or math.abs(e - g) <= (tol or 1e-6) * math.max(1, math.abs(e))
    if not ok then error(string.format("element %d: expected %.8g, got %.8g", i, e, g), 2) end
  end
end

-- f(c * flat index) over a tensor of the given shape (PyTorch: (arange(n).view(shape) * c).f()).
local function gen(shape, c, f, dtype, rg)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  local v = {}
  for i = 0, n - 1 do v[i + 1] = f(i * c) end
  local t = engine.tensor(v, dtype or "f64"):view(shape):clone()
  if rg then t.requires_grad = true end
  return t
end

-- The math path written out with engine ops.
local function composed(q, k, v, mask, causal, scale)
  local E = q:size(-1)
  local s = q:matmul(k:transpose(-2, -1)) * (scale or 1 / math.sqrt(E))
  if causal then
    local L, S = s:size(-2), s:size(-1)
    local m = {}
    for i = 1, L do m[i] = {} for j = 1, S do m[i][j] = j > i end end
    s = s:masked_fill(engine.tensor(m), -math.huge)
  end
  if mask then
    if mask.dtype == "bool" then s = s:masked_fill(mask:eq(0), -math.huge) else s = s + mask end
  end
  return s:softmax(-1):matmul(v)
end

local q = gen({ 2, 3, 4 }, 0.37, math.sin)
local k = gen({ 2, 5, 4 }, 0.23, math.cos)
local v = gen({ 2, 5, 3 }, 0.11, math.sin)

describe("scaled_dot_product_attention", function()
  it("gives a hand-computed value", function()
    local out = sdpa(engine.tensor({ { 1, 0 } }, "f32"), engine.tensor({ { 1, 0 }, { 0, 1 } }, "f32"),
      engine.tensor({ { 1, 2 }, { 3, 4 } }, "f32"), { scale = 1 })
    local p = math.exp(1) / (1 + math.exp(1))
    close(out, { p + 3 * (1 - p), 2 * p + 4 * (1 - p) })
    assert.are.same({ 1, 2 }, out:shape())
  end)

  it("matches PyTorch's math path", function()
    close(sdpa(q, k, v), { 0.3268512, 0.4164811, 0.5010767, 0.1821548, 0.2828328, 0.380092, 0.6524421,
      0.7200218, 0.778898, 0.3894215, 0.2989532, 0.2048713, 0.7366218, 0.6739002, 0.6030326, 0.798148,
      0.7355304, 0.6640219 }, 1e-6)
    close(sdpa(q, k, v, { is_causal = true }), { 0, 0.1097783, 0.2182296, 0.0896148, 0.1972133, 0.302428,
      0.4166806, 0.5101638, 0.5974802, 0.996865, 0.9821543, 0.9555715, 0.9547626, 0.9217575, 0.8776104,
      0.8522342, 0.7951675, 0.728489 }, 1e-6)
    close(sdpa(q, k, v, { scale = 1.0 }), { 0.1487131, 0.2502046, 0.3486717, 0.05138664, 0.1594601, 0.265606,
      0.7122441, 0.776329, 0.8310297, 0.2291962, 0.125192, 0.01967441, 0.7946705, 0.7378039, 0.6720189,
      0.8262775, 0.763884, 0.6922567 }, 1e-6)
  end)

  it("aligns the causal mask top-left (row i sees keys 1..i)", function()
    -- L = 3 < S = 5: the first query only sees the first key
    local out = sdpa(q, k, v, { is_causal = true })
    for b = 1, 2 do for e = 1, 3 do
      assert.is_true(math.abs(out:get(b, 1, e) - v:get(b, 1, e)) < 1e-12)
    end end
    -- L = 5 > S = 3: rows past S see every key
    local q5, k3 = gen({ 5, 4 }, 0.3, math.cos), gen({ 3, 4 }, 0.2, math.sin)
    local v3 = gen({ 3, 2 }, 0.5, math.sin)
    close(sdpa(q5, k3, v3, { is_causal = true }), composed(q5, k3, v3, nil, true):tolist_flat(), 1e-12)
  end)

  it("applies bool and additive masks, broadcast over batch dims", function()
    local mb = engine.tensor({ { true, false, true, true, false }, { true, true, true, true, true },
      { false, false, false, false, true } })
    close(sdpa(q, k, v, { attn_mask = mb }), composed(q, k, v, mb):tolist_flat(), 1e-12)
    local mf = gen({ 2, 1, 5 }, 0.9, math.sin)
    close(sdpa(q, k, v, { attn_mask = mf }), composed(q, k, v, mf):tolist_flat(), 1e-12)
    -- an f32 mask with f64 inputs is converted
    close(sdpa(q, k, v, { attn_mask = mf:float() }), composed(q, k, v, mf:float():double()):tolist_flat(), 1e-12)
  end)

  it("gives zeros for rows with nothing to attend to", function()
    local mb = engine.tensor({ { true, true, true, true, true }, { false, false, false, false, false },
      { true, false, false, false, false } })
    local out = sdpa(q, k, v, { attn_mask = mb })
    for b = 1, 2 do for e = 1, 3 do
      assert.are.equal(0, out:get(b, 2, e))
      assert.is_true(math.abs(out:get(b, 3, e) - v:get(b, 1, e)) < 1e-12)
    end end
  end)

  it("broadcasts batch dims of q, k and v (shared keys/values)", function()
    local q4 = gen({ 2, 3, 4, 4 }, 0.13, math.sin)
    local k4 = gen({ 1, 3, 5, 4 }, 0.17, math.cos)
    local v4 = gen({ 3, 5, 2 }, 0.19, math.sin)
    local out = sdpa(q4, k4, v4)
    assert.are.same({ 2, 3, 4, 2 }, out:shape())
    close(out, composed(q4, k4, v4):tolist_flat(), 1e-12)
  end)

  it("works on transposed (head-split) views and in f32/bf16", function()
    -- [B, T, H, D] -> [B, H, T, D] as a transformer does
    local x = gen({ 2, 6, 2, 4 }, 0.21, math.sin)
    local qh, kh, vh = x:transpose(2, 3), (x * 0.5):transpose(2, 3), (x + 1):transpose(2, 3)
    close(sdpa(qh, kh, vh, { is_causal = true }), composed(qh, kh, vh, nil, true):tolist_flat(), 1e-12)
    local o32 = sdpa(qh:float(), kh:float(), vh:float(), { is_causal = true })
    assert.are.equal("f32", o32.dtype)
    close(o32, composed(qh, kh, vh, nil, true):tolist_flat(), 1e-5)
    local ob = sdpa(qh:bfloat16(), kh:bfloat16(), vh:bfloat16())
    assert.are.equal("bf16", ob.dtype)
    close(ob, composed(qh:bfloat16():double(), kh:bfloat16():double(), vh:bfloat16():double()):tolist_flat(), 2e-2)
  end)

  it("gives the same results on one thread and on two", function()
    local qb, kb, vb = engine.randn(3, 4, 16, 8), engine.randn(3, 4, 16, 8), engine.randn(3, 4, 16, 8)
    local g = engine.randn(3, 4, 16, 8)
    local function run()
      local a, b, c = qb:clone(), kb:clone(), vb:clone()
      a.requires_grad = true; b.requires_grad = true; c.requires_grad = true
      local o = sdpa(a, b, c, { is_causal = true })
      o:backward(g)
      return { (o:tolist_flat()), (a.grad:tolist_flat()), (b.grad:tolist_flat()), (c.grad:tolist_flat()) }
    end
    local prev = engine.get_num_threads()
    engine.set_num_threads(1)
    local one = run()
    engine.set_num_threads(2)
    local two = run()
    engine.set_num_threads(prev)
    for i = 1, #one do assert.are.same(one[i], two[i]) end
  end)

  describe("dropout", function()
    it("does not consume the RNG when dropout_p = 0", function()
      engine.manual_seed(11)
      local r1 = engine.rand(4):tolist_flat()
      engine.manual_seed(11)
      sdpa(q, k, v)
      sdpa(q, k, v, { dropout_p = 0 })
      assert.are.same(r1, engine.rand(4):tolist_flat())
    end)

    it("is reproducible under a seed and equals dropout on the probabilities", function()
      engine.manual_seed(5)
      local a = sdpa(q, k, v, { dropout_p = 0.4 })
      engine.manual_seed(5)
      local b = sdpa(q, k, v, { dropout_p = 0.4 })
      assert.are.same(a:tolist_flat(), b:tolist_flat())
      assert.are_not.same(sdpa(q, k, v):tolist_flat(), a:tolist_flat())
      -- the same draws as eng_dropout applied to softmax(q k^T * scale)
      engine.manual_seed(5)
      local p = q:matmul(k:transpose(-2, -1)) * 0.5
      local pd = core.wrap(engine.C.eng_dropout(p:softmax(-1)._c, 0.4, 1))
      close(a, pd:matmul(v):tolist_flat(), 1e-12)
      -- the RNG advanced by the number of attention weights
      engine.manual_seed(5)
      sdpa(q, k, v, { dropout_p = 0.4 })
      local after = engine.rand(3):tolist_flat()
      engine.manual_seed(5)
      engine.rand(2 * 3 * 5)
      assert.are.same(engine.rand(3):tolist_flat(), after)
    end)

    it("drops everything at dropout_p = 1", function()
      local out = sdpa(q, k, v, { dropout_p = 1 })
      for _, x in ipairs(out:tolist_flat()) do assert.are.equal(0, x) end
    end)

    it("backward replays the same mask (gradcheck with a fixed seed)", function()
      local qs, ks, vs = gen({ 2, 3, 4 }, 0.37, math.sin, "f64", true), gen({ 2, 5, 4 }, 0.23, math.cos, "f64", true),
        gen({ 2, 5, 3 }, 0.11, math.sin, "f64", true)
      assert.is_true(gc.check(function(a, b, c)
        engine.manual_seed(3)
        return sdpa(a, b, c, { dropout_p = 0.3, is_causal = true })
      end, { qs, ks, vs }))
    end)
  end)

  describe("gradients (f64 finite differences)", function()
    local function inputs()
      return gen({ 2, 3, 4 }, 0.37, math.sin, "f64", true), gen({ 2, 5, 4 }, 0.23, math.cos, "f64", true),
        gen({ 2, 5, 3 }, 0.11, math.sin, "f64", true)
    end
    it("without a mask", function()
      local a, b, c = inputs()
      assert.is_true(gc.check(function(x, y, z) return sdpa(x, y, z) end, { a, b, c }))
    end)
    it("with the causal mask", function()
      local a, b, c = inputs()
      assert.is_true(gc.check(function(x, y, z) return sdpa(x, y, z, { is_causal = true, scale = 0.8 }) end, { a, b, c }))
    end)
    it("with a bool mask including a fully masked row", function()
      local a, b, c = inputs()
      local mb = engine.tensor({ { true, false, true, true, false }, { false, false, false, false, false },
        { false, false, false, false, true } })
      assert.is_true(gc.check(function(x, y, z) return sdpa(x, y, z, { attn_mask = mb }) end, { a, b, c }))
    end)
    it("with an additive mask that requires grad (broadcast over the batch)", function()
      local a, b, c = inputs()
      local m = gen({ 3, 5 }, 0.7, math.cos, "f64", true)
      assert.is_true(gc.check(function(x, y, z, w) return sdpa(x, y, z, { attn_mask = w }) end, { a, b, c, m }))
    end)
    it("with broadcast keys/values and transposed inputs", function()
      local a = gen({ 2, 4, 2, 3 }, 0.31, math.sin, "f64", true)
      local b = gen({ 1, 2, 5, 3 }, 0.29, math.cos, "f64", true)
      local c = gen({ 2, 5, 2 }, 0.41, math.sin, "f64", true)
      assert.is_true(gc.check(function(x, y, z) return sdpa(x:transpose(2, 3), y, z, { is_causal = true }) end,
        { a, b, c }))
    end)
  end)

  describe("errors", function()
    it("names mismatched dims", function()
      local ok, err = pcall(function() return sdpa(q, gen({ 2, 5, 3 }, 1, math.sin), v) end)
      assert.is_false(ok)
      assert.matches("scaled_dot_product_attention: q f64%[2,3,4%] and k f64%[2,5,3%]: embedding dims", err)
      assert.matches("attention_spec.lua", err)
      assert.has_error(function() sdpa(q, k, gen({ 2, 4, 3 }, 1, math.sin)) end)
      assert.has_error(function() sdpa(q, gen({ 3, 5, 4 }, 1, math.sin), v) end)
      assert.has_error(function() sdpa(gen({ 4 }, 1, math.sin), k, v) end)
    end)

    it("rejects bad masks and options", function()
      assert.has_error(function() sdpa(q, k, v, { attn_mask = engine.ones(3, 5, { dtype = "bool" }), is_causal = true }) end)
      assert.has_error(function() sdpa(q, k, v, { attn_mask = engine.ones(3, 5, { dtype = "i64" }) }) end)
      local ok, err = pcall(function() return sdpa(q, k, v, { attn_mask = engine.zeros(3, 4) }) end)
      assert.is_false(ok)
      assert.matches("attn_mask f32%[3,4%] does not broadcast to the attention weights %[2,3,5%]", err)
      assert.has_error(function() sdpa(q, k, v, { dropout_p = 1.5 }) end)
      assert.has_error(function() sdpa(q, k, v, { dropout_p = -0.1 }) end)
      assert.has_error(function() sdpa(q, k, v, { scale = -1 }) end, "scaled_dot_product_attention: scale must be positive, got -1")
      assert.has_error(function() sdpa(q, k, v, { causal = true }) end)
      assert.has_error(function() sdpa(q, k, v, { attn_mask = { true } }) end)
      assert.has_error(function() sdpa(q, k:float(), v) end)
      assert.has_error(function() sdpa(q, k, "v") end, "scaled_dot_product_attention: argument 3 must be a tensor, got string")
    end)
  end)
end)

describe("scaled_dot_product_attention: enable_gqa (grouped-query attention)", function()
  -- the reference: k and v repeated to q's head count (k.repeat_interleave(Hq / Hkv, -3), PyTorch's definition)
  local function repeat_heads(t, rep)
    local s = t:shape()
    local n = #s
    local e, w = {}, {}
    for d = 1, n - 2 do e[d] = s[d] end
    e[n - 1], e[n], e[n + 1] = rep, s[n - 1], s[n]
    for d = 1, n do w[d] = s[d] end
    w[n - 2] = s[n - 2] * rep
    return t:unsqueeze(n - 1):expand(e):reshape(w)
  end
  local function run(dt, th, gqa, opts, B, Hq, Hk, L, S, E)
    engine.set_num_threads(th)
    engine.manual_seed(21)
    -- head-split views of [B, L, H, E] projections, as the models make them
    local q = engine.randn(B, L, Hq, E):to(dt):transpose(2, 3):requires_grad_()
    local k = engine.randn(B, S, Hk, E):to(dt):transpose(2, 3):requires_grad_()
    local v = engine.randn(B, S, Hk, E):to(dt):transpose(2, 3):requires_grad_()
    local g = engine.randn(B, Hq, L, E):to(dt)
    local o = {}
    for key, val in pairs(opts) do o[key] = val end
    local out
    if gqa then
      o.enable_gqa = true
      out = sdpa(q, k, v, o)
    else
      out = sdpa(q, repeat_heads(k, Hq / Hk), repeat_heads(v, Hq / Hk), o)
    end
    out:backward(g)
    return { out, q.grad, k.grad, v.grad }
  end
  local function maxdiff(a, b) return (a:double() - b:double()):abs():max():item() end

  it("equals attention over repeated k and v: values, gradients, causal, masks, dropout, 1 and 2 threads", function()
    local th0 = engine.get_num_threads()
    local cases = {
      { {}, 2, 6, 2, 33, 33, 16 },                       -- 3 query heads a kv head
      { { is_causal = true }, 2, 8, 2, 40, 40, 8 },       -- 4, causal (the Llama step's form)
      { { is_causal = true }, 1, 4, 1, 9, 9, 4 },         -- multi-query attention
      { { is_causal = true }, 3, 4, 4, 7, 7, 4 },         -- equal head counts: plain attention
      { { attn_mask = "heads" }, 2, 6, 3, 5, 7, 4 },     -- a mask per query head
      { { attn_mask = "shared" }, 2, 6, 3, 5, 7, 4 },    -- one mask broadcast over the heads
      { { dropout_p = 0.3 }, 2, 6, 2, 6, 6, 4 },          -- the same dropout masks as the repeated form
    }
    for _, c in ipairs(cases) do
      for _, dt in ipairs({ "f64", "f32" }) do
        local results = {}
        for _, th in ipairs({ 1, 2 }) do
          local B, Hq, Hk, L, S, E = c[2], c[3], c[4], c[5], c[6], c[7]
          local opts = {}
          for key, val in pairs(c[1]) do opts[key] = val end
          engine.manual_seed(22) -- the same mask at both thread counts
          if opts.attn_mask == "heads" then opts.attn_mask = engine.rand(B, Hq, L, S):gt(0.3)
          elseif opts.attn_mask == "shared" then opts.attn_mask = engine.randn(1, 1, L, S) end
          local want = run(dt, th, false, opts, B, Hq, Hk, L, S, E)
          local got = run(dt, th, true, opts, B, Hq, Hk, L, S, E)
          local what = string.format("%s Hq=%d Hkv=%d %s threads=%d", dt, Hq, Hk, next(c[1]) or "plain", th)
          assert.are.same(want[1]:shape(), got[1]:shape(), what)
          local tol = dt == "f64" and 1e-12 or 2e-6
          for i = 1, 4 do
            -- values and q's gradient: the same products; k's and v's gradients: the same terms summed over the
            -- query heads of a group in another order
            assert.is_true(maxdiff(want[i], got[i]) <= (i <= 2 and 0 or tol),
              string.format("%s: result %d off by %g", what, i, maxdiff(want[i], got[i])))
          end
          results[th] = got
        end
        for i = 1, 4 do -- runs of query heads in parallel: the same bits as in order on one thread
          assert.are.equal(0, maxdiff(results[1][i], results[2][i]), string.format("%s Hq=%d Hkv=%d %s, result %d: 1 "
            .. "and 2 threads", dt, c[3], c[4], next(c[1]) or "plain", i))
        end
      end
    end
    engine.set_num_threads(th0)
  end)

  it("refuses head counts that do not divide and options that are not booleans", function()
    local q, k, v = engine.randn(1, 6, 3, 4), engine.randn(1, 4, 3, 4), engine.randn(1, 4, 3, 4)
    assert.has_error(function() sdpa(q, k, v, { enable_gqa = true }) end,
      "scaled_dot_product_attention: enable_gqa: k and v need the same number of heads, dividing q's; got 6 q "
      .. "heads, 4 k heads, 4 v heads")
    assert.has_error(function() sdpa(q, engine.randn(1, 2, 3, 4), engine.randn(1, 3, 3, 4), { enable_gqa = true }) end,
      "scaled_dot_product_attention: enable_gqa: k and v need the same number of heads, dividing q's; got 6 q "
      .. "heads, 2 k heads, 3 v heads")
    assert.has_error(function() sdpa(q, k, v, { enable_gqa = 1 }) end,
      "scaled_dot_product_attention: enable_gqa must be a boolean, got number")
    local ok, err = pcall(sdpa, engine.randn(3, 4), engine.randn(3, 4), engine.randn(3, 4), { enable_gqa = true })
    assert.is_false(ok)
    assert.matches("enable_gqa needs q, k and v with a head dim", err)
    -- without enable_gqa the head counts must broadcast, as before
    assert.has_error(function() sdpa(q, engine.randn(1, 2, 3, 4), engine.randn(1, 2, 3, 4)) end)
  end)
end)

describe("scaled_dot_product_attention: enable_gqa on the GPU #gpu", function()
  it("expands k and v for the CUDA kernels: the CPU's values and gradients (f32, bf16)", function()
    if not engine.cuda.is_available() then pending("no GPU: " .. engine.cuda.unavailable_reason()) end
    for _, dt in ipairs({ "f32", "bf16" }) do
      engine.manual_seed(23)
      local q0 = engine.randn(2, 40, 8, 64):to(dt):transpose(2, 3)
      local k0 = engine.randn(2, 40, 2, 64):to(dt):transpose(2, 3)
      local v0 = engine.randn(2, 40, 2, 64):to(dt):transpose(2, 3)
      local g = engine.randn(2, 8, 40, 64):to(dt)
      local res = {}
      for _, dev in ipairs({ "cpu", "cuda" }) do
        local q, k, v = q0:to(dev):requires_grad_(), k0:to(dev):requires_grad_(), v0:to(dev):requires_grad_()
        local out = sdpa(q, k, v, { is_causal = true, enable_gqa = true })
        out:backward(g:to(dev))
        res[dev] = { out:cpu():float(), q.grad:cpu():float(), k.grad:cpu():float(), v.grad:cpu():float() }
      end
      local tol = dt == "f32" and 1e-4 or 5e-2
      for i = 1, 4 do
        local d = (res.cpu[i] - res.cuda[i]):abs():max():item()
        assert.is_true(d <= tol, string.format("%s result %d: %g", dt, i, d))
      end
    end
  end)
end)

describe("scaled_dot_product_attention: one f32 query row (decoding)", function()
  it("over a cache view equals the f64 computation, values and gradients", function()
    engine.manual_seed(7)
    -- head dims: any (20, 24), and multiples of 16 up to 256 (the vector kernel: keys 8 at a time, values 64
    -- lanes at a time), one over 256 (back to the any-size path); key counts below, at and past multiples of 8
    for _, d in ipairs({ { 20, 24 }, { 64, 64 }, { 32, 96 }, { 256, 16 }, { 16, 256 }, { 272, 80 } }) do
      local E, Ev = d[1], d[2]
      for _, S in ipairs({ 1, 5, 8, 17, 300 }) do
        local q = engine.randn(2, 3, 1, E)
        local kbuf, vbuf = engine.randn(2, 3, 320, E), engine.randn(2, 3, 320, Ev)
        local k, v = kbuf:narrow(3, 1, S), vbuf:narrow(3, 1, S)   -- strided views, as a KV cache's
        local q32 = q:clone(); q32.requires_grad = true
        local o = sdpa(q32, k, v, nil, 0, false)
        local q64 = q:double(); q64.requires_grad = true
        local o64 = sdpa(q64, k:double(), v:double(), nil, 0, false)
        close(o, o64:tolist_flat(), 1e-5)
        local w = engine.randn(2, 3, 1, Ev)
        local l32, l64 = (o * w):sum(), (o64 * w:double()):sum()
        l32:backward()
        l64:backward()
        close(q32.grad, q64.grad:tolist_flat(), 1e-4)
      end
    end
  end)
end)
