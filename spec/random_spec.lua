-- The counter-based generator: Philox known answers, addressability (a slice
-- equals the same block of the whole), the global (seed, offset) state,
-- in-place fills, dtypes, statistics and errors.
local engine = require("engine")
local gc = require("spec.helpers.gradcheck")

local function errmatch(fn, pat)
  local ok, err = pcall(fn)
  assert.is_false(ok, "expected an error matching '" .. pat .. "'")
  assert.truthy(tostring(err):find(pat, 1, true), "error '" .. tostring(err) .. "' does not contain '" .. pat .. "'")
  return err
end

-- Row-major flat index of a (0-based) multi-index.
local function flat_index(idx, shape)
  local j = 0
  for d = 1, #shape do j = j * shape[d] + idx[d] end
  return j
end

-- Every element of slice (start 1-based, size) equals the whole's element.
local function check_slice(whole_flat, gshape, start, size, slice)
  local sflat = slice:tolist_flat()
  local n = #sflat
  local idx = {}
  for d = 1, #size do idx[d] = 0 end
  for k = 1, n do
    local g = {}
    for d = 1, #size do g[d] = start[d] - 1 + idx[d] end
    local j = flat_index(g, gshape)
    assert.are.equal(whole_flat[j + 1], sflat[k])
    for d = #size, 1, -1 do
      idx[d] = idx[d] + 1
      if idx[d] < size[d] then break end
      idx[d] = 0
    end
  end
end

local function mean_var(flat)
  local m, v = 0, 0
  for i = 1, #flat do m = m + flat[i] end
  m = m / #flat
  for i = 1, #flat do v = v + (flat[i] - m) ^ 2 end
  return m, v / #flat
end

describe("Philox generator", function()
  it("matches the Random123 known answer (counter 0, key 0)", function()
    local u = engine.random_slice("uniform", { 4 }, nil, nil, { dtype = "f64", seed = 0, offset = 0 }):tolist_flat()
    local words = { 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8 }
    for i = 1, 4 do assert.are.equal(words[i] / 2 ^ 32, u[i]) end
  end)

  it("draws normals by Box-Muller on the word pairs of a block", function()
    local z = engine.random_slice("normal", { 4 }, nil, nil, { dtype = "f64", seed = 0, offset = 0 }):tolist_flat()
    local w = { 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8 }
    local function bm(e, o, sin)
      local r = math.sqrt(-2 * math.log((e + 1) / 2 ^ 32))
      local th = 2 * math.pi * o / 2 ^ 32
      return sin and r * math.sin(th) or r * math.cos(th)
    end
    local want = { bm(w[1], w[2], false), bm(w[1], w[2], true), bm(w[3], w[4], false), bm(w[3], w[4], true) }
    for i = 1, 4 do assert.is_true(math.abs(want[i] - z[i]) < 1e-12, i .. ": " .. z[i] .. " vs " .. want[i]) end
  end)

  it("bernoulli(p) is 1 exactly where the uniform is below p", function()
    local opts = { dtype = "f64", seed = 77, offset = 8 }
    local u = engine.random_slice("uniform", { 500 }, nil, nil, opts):tolist_flat()
    opts.a = 0.3
    local b = engine.random_slice("bernoulli", { 500 }, nil, nil, opts):tolist_flat()
    for i = 1, 500 do assert.are.equal(u[i] < 0.3 and 1 or 0, b[i]) end
    local bb = engine.random_slice("bernoulli", { 7 }, nil, nil, { a = 0.5, dtype = "bool", seed = 1, offset = 0 })
    assert.are.equal("bool", bb.dtype)
  end)
end)

describe("random_slice", function()
  local shapes = { { 10 }, { 6, 7 }, { 3, 4, 5 }, { 2, 3, 2, 5 }, { 1, 9, 1 } }
  local offsets = { 0, 4, 13, 2 ^ 40 + 3 }
  local kinds = { "uniform", "normal", "bernoulli" }

  it("gives the same block as the whole tensor for many shapes, offsets and blocks", function()
    local lcg = 7
    local function rnd(n) lcg = (lcg * 1103515245 + 12345) % 2147483648; return lcg % n end
    for _, shape in ipairs(shapes) do
      for _, off in ipairs(offsets) do
        for _, kind in ipairs(kinds) do
          local opts = { seed = 1234567, offset = off, dtype = "f64", a = kind == "bernoulli" and 0.4 or 0.5,
            b = kind == "bernoulli" and 0 or 2 }
          local whole = engine.random_slice(kind, shape, nil, nil, opts)
          assert.are.same(shape, whole:shape())
          local wf = whole:tolist_flat()
          for _ = 1, 4 do
            local start, size = {}, {}
            for d = 1, #shape do
              start[d] = 1 + rnd(shape[d])
              size[d] = 1 + rnd(shape[d] - start[d] + 1)
            end
            local s = engine.random_slice(kind, shape, start, size, opts)
            assert.are.same(size, s:shape())
            check_slice(wf, shape, start, size, s)
          end
        end
      end
    end
  end)

  it("gives every element the same value whatever run or alignment it is drawn in", function()
    for _, kind in ipairs(kinds) do
      local whole = engine.random_slice(kind, { 400 }, nil, nil, { dtype = "f64", seed = 5, offset = 0, a = 0.5 }):tolist_flat()
      for off = 0, 11 do
        for len = 1, 70, 3 do
          local s = engine.random_slice(kind, { len }, nil, nil, { dtype = "f64", seed = 5, offset = off, a = 0.5 }):tolist_flat()
          for i = 1, len do assert.are.equal(whole[off + i], s[i]) end
        end
      end
    end
  end)

  it("draws normals within a few ulp of the libm Box-Muller formula", function()
    local n = 20000
    local opts = { dtype = "f64", seed = 123, offset = 0 }
    local z = engine.random_slice("normal", { n }, nil, nil, opts):tolist_flat()
    local u = engine.random_slice("uniform", { n }, nil, nil, opts):tolist_flat()
    local maxe = 0
    for i = 1, n, 2 do
      local r = math.sqrt(-2 * math.log((u[i] * 2 ^ 32 + 1) / 2 ^ 32))
      local th = 2 * math.pi * u[i + 1]
      maxe = math.max(maxe, math.abs(r * math.cos(th) - z[i]), math.abs(r * math.sin(th) - z[i + 1]))
    end
    assert.is_true(maxe < 1e-13, "max error " .. maxe)
  end)

  it("handles 0-d and empty slices", function()
    local s = engine.random_slice("uniform", {}, nil, nil, { seed = 3, offset = 0, dtype = "f64" })
    assert.are.equal(0, s:dim())
    assert.are.equal(engine.random_slice("uniform", { 1 }, nil, nil, { seed = 3, offset = 0, dtype = "f64" }):item(), s:item())
    local e = engine.random_slice("normal", { 4, 5 }, { 2, 5 }, { 0, 1 }, { seed = 3, offset = 0 })
    assert.are.same({ 0, 1 }, e:shape())
  end)

  it("a slice drawn with the offset of element k equals the whole shifted by k", function()
    local whole = engine.random_slice("normal", { 40 }, nil, nil, { seed = 9, offset = 0, dtype = "f64" }):tolist_flat()
    local shifted = engine.random_slice("normal", { 30 }, nil, nil, { seed = 9, offset = 10, dtype = "f64" }):tolist_flat()
    for i = 1, 30 do assert.are.equal(whole[i + 10], shifted[i]) end
  end)

  it("does not advance the global generator and defaults to its state", function()
    engine.manual_seed(5)
    local st = engine.get_rng_state()
    local a = engine.random_slice("uniform", { 3, 3 })
    assert.are.same(st, engine.get_rng_state())
    local b = engine.rand(3, 3)
    assert.are.same(a:tolist_flat(), b:tolist_flat())
  end)

  it("rounds f32/bf16/f16 from the same f64 values", function()
    local opts = { seed = 11, offset = 4, a = -3, b = 5 }
    for _, kind in ipairs({ "uniform", "normal" }) do
      opts.dtype = "f64"
      local d = engine.random_slice(kind, { 257 }, nil, nil, opts)
      for _, dt in ipairs({ "f32", "bf16", "f16" }) do
        opts.dtype = dt
        local t = engine.random_slice(kind, { 257 }, nil, nil, opts)
        assert.are.equal(dt, t.dtype)
        local want, got = d:to(dt):tolist_flat(), t:tolist_flat()
        for i = 1, #got do
          if kind == "uniform" then
            assert.is_true(got[i] >= -3 and got[i] < 5)
            if want[i] < 5 then assert.are.equal(want[i], got[i]) end
          else
            assert.are.equal(want[i], got[i])
          end
        end
      end
    end
  end)

  it("keeps uniform values below the open bound after rounding", function()
    -- bf16 has 8 bits of mantissa: many draws of U[1, 2) would round to 2
    local t = engine.random_slice("uniform", { 20000 }, nil, nil, { seed = 1, offset = 0, a = 1, b = 2, dtype = "bf16" })
    for _, v in ipairs(t:tolist_flat()) do assert.is_true(v >= 1 and v < 2) end
  end)

  it("rejects bad arguments with clear errors", function()
    errmatch(function() engine.random_slice("poisson", { 3 }) end, "kind must be")
    errmatch(function() engine.random_slice("uniform", { 3 }, { 0 }, { 1 }) end, "1-based")
    errmatch(function() engine.random_slice("uniform", { 3 }, { 3 }, { 2 }) end, "outside the global shape")
    errmatch(function() engine.random_slice("uniform", { 3, 4 }, { 1 }, { 1 }) end, "start must be a table of 2")
    errmatch(function() engine.random_slice("uniform", { 3, -1 }) end, "negative size")
    errmatch(function() engine.random_slice("uniform", { 3 }, nil, nil, { a = 2, b = 1 }) end, "from <= to")
    errmatch(function() engine.random_slice("normal", { 3 }, nil, nil, { b = -1 }) end, "std must be")
    errmatch(function() engine.random_slice("bernoulli", { 3 }, nil, nil, { a = 1.5 }) end, "probability must be in [0, 1]")
    errmatch(function() engine.random_slice("uniform", { 3 }, nil, nil, { dtype = "i64" }) end, "floating point dtype")
    errmatch(function() engine.random_slice("uniform", { 3 }, nil, nil, { seed = -1, offset = 0 }) end, "seed must be a non-negative integer")
    errmatch(function() engine.random_slice("uniform", { 3 }, nil, nil, { dtype = "f17" }) end, "f17")
  end)
end)

describe("global generator", function()
  it("advances the offset by numel rounded up to a multiple of 4", function()
    engine.manual_seed(42)
    assert.are.same({ seed = 42, offset = 0 }, engine.get_rng_state())
    engine.rand(3, 5)
    assert.are.equal(16, engine.get_rng_state().offset)
    engine.randn(4)
    assert.are.equal(20, engine.get_rng_state().offset)
    engine.rand(0)
    assert.are.equal(20, engine.get_rng_state().offset)
    engine.empty(1):uniform_()
    assert.are.equal(24, engine.get_rng_state().offset)
  end)

  it("gives the same stream for the same seed and a different one for another seed", function()
    engine.manual_seed(123)
    local a1, b1 = engine.rand(5):tolist_flat(), engine.randn(2, 3):tolist_flat()
    engine.manual_seed(123)
    local a2, b2 = engine.rand(5):tolist_flat(), engine.randn(2, 3):tolist_flat()
    assert.are.same(a1, a2)
    assert.are.same(b1, b2)
    engine.manual_seed(124)
    assert.are_not.same(a1, engine.rand(5):tolist_flat())
  end)

  it("successive draws continue the stream (rand of 8 = two rand of 4)", function()
    engine.manual_seed(7)
    local whole = engine.rand(8):tolist_flat()
    engine.manual_seed(7)
    local a, b = engine.rand(4):tolist_flat(), engine.rand(4):tolist_flat()
    for i = 1, 4 do
      assert.are.equal(whole[i], a[i])
      assert.are.equal(whole[i + 4], b[i])
    end
  end)

  it("restores a saved state", function()
    engine.manual_seed(99)
    engine.rand(10)
    local s = engine.get_rng_state()
    local x = engine.randn(6):tolist_flat()
    engine.rand(3)
    engine.set_rng_state(s)
    assert.are.same(x, engine.randn(6):tolist_flat())
    local big = { seed = 2 ^ 60, offset = 2 ^ 54 }
    engine.set_rng_state(big)
    local got = engine.get_rng_state()
    assert.are.equal("cdata", type(got.seed))
    assert.is_true(got.seed == 2ULL ^ 60)
    errmatch(function() engine.set_rng_state({ seed = 1 }) end, "expected a table {seed")
    errmatch(function() engine.set_rng_state({ seed = 1.5, offset = 0 }) end, "seed must be a non-negative integer")
    engine.manual_seed(0)
  end)

  it("is deterministic across processes", function()
    local bin = arg and arg[-1] or ""
    if not bin:match("engine$") then return pending("not running under the engine host") end
    local code = "local e=require('engine'); e.manual_seed(2024); local t=e.randn(5,{dtype='f64'}):tolist_flat(); "
      .. "for i=1,5 do io.write(string.format('%.17g ', t[i])) end"
    local p = io.popen(bin .. " -e \"" .. code .. "\" 2>&1")
    local out = p:read("*a")
    p:close()
    engine.manual_seed(2024)
    local t = engine.randn(5, { dtype = "f64" }):tolist_flat()
    local want = {}
    for i = 1, 5 do want[i] = string.format("%.17g", t[i]) end
    assert.are.equal(table.concat(want, " ") .. " ", out)
  end)
end)

describe("in-place fills", function()
  it("uniform_ and normal_ fill from the global stream in row-major order", function()
    engine.manual_seed(31)
    local s = engine.get_rng_state()
    local t = engine.empty(3, 4)
    assert.are.equal(t, t:uniform_(-1, 1))
    local want = engine.random_slice("uniform", { 3, 4 }, nil, nil, { a = -1, b = 1, seed = s.seed, offset = s.offset })
    assert.are.same(want:tolist_flat(), t:tolist_flat())
    s = engine.get_rng_state()
    t:normal_(2, 0.5)
    want = engine.random_slice("normal", { 3, 4 }, nil, nil, { a = 2, b = 0.5, seed = s.seed, offset = s.offset })
    assert.are.same(want:tolist_flat(), t:tolist_flat())
  end)

  it("fills strided views by their logical row-major index", function()
    local base = engine.zeros(4, 6, { dtype = "f64" })
    local v = base:t():narrow(2, 2, 3) -- [6, 3] view with strides (1, 6)
    assert.is_false(v:is_contiguous())
    local s = engine.get_rng_state()
    v:uniform_()
    local want = engine.random_slice("uniform", { 6, 3 }, nil, nil, { dtype = "f64", seed = s.seed, offset = s.offset })
    assert.are.same(want:tolist_flat(), v:tolist_flat())
    -- the rest of base is untouched
    assert.are.same({ 0, 0, 0, 0, 0, 0 }, base:select(1, 1):tolist_flat())
  end)

  it("works for every float dtype and bumps the version", function()
    for _, dt in ipairs({ "f32", "f64", "bf16", "f16" }) do
      local t = engine.zeros(100, { dtype = dt })
      t:uniform_(2, 3)
      for _, v in ipairs(t:tolist_flat()) do assert.is_true(v >= 2 and v < 3) end
      t:normal_()
      assert.are.equal(dt, t.dtype)
    end
  end)

  it("refuses leaves that require grad under grad mode, and works under no_grad", function()
    local w = engine.zeros(3, { requires_grad = true })
    errmatch(function() w:uniform_() end, "leaf tensor that requires grad")
    errmatch(function() w:normal_() end, "leaf tensor that requires grad")
    engine.no_grad(function() w:normal_(0, 0.02) end)
    assert.is_true(w.requires_grad)
    assert.is_nil(w.grad_fn)
  end)

  it("rejects bad arguments", function()
    errmatch(function() engine.zeros(3, { dtype = "i64" }):uniform_() end, "floating point tensor")
    errmatch(function() engine.zeros(3):uniform_(1, 0) end, "from <= to")
    errmatch(function() engine.zeros(3):uniform_(0, math.huge) end, "finite")
    errmatch(function() engine.zeros(3):normal_(0, -1) end, "std must be")
    errmatch(function() engine.zeros(3):normal_(0 / 0, 1) end, "mean must be finite")
    errmatch(function() engine.zeros(3):uniform_("a") end, "bounds must be numbers")
    errmatch(function() engine.rand(2, { dtype = "i32" }) end, "floating point dtype")
    errmatch(function() engine.randn(-1) end, "negative size")
  end)
end)

describe("statistics", function()
  it("uniform over 100k samples has the right mean, variance and range", function()
    engine.manual_seed(2)
    local f = engine.rand(100000, { dtype = "f64" }):tolist_flat()
    local m, v = mean_var(f)
    assert.is_true(math.abs(m - 0.5) < 0.005, "mean " .. m)
    assert.is_true(math.abs(v - 1 / 12) < 0.002, "var " .. v)
    local t = engine.empty(100000):uniform_(-2, 6):tolist_flat()
    local lo, hi = math.huge, -math.huge
    for i = 1, #t do lo = math.min(lo, t[i]); hi = math.max(hi, t[i]) end
    assert.is_true(lo >= -2 and lo < -1.99 and hi < 6 and hi > 5.99)
    m = mean_var(t)
    assert.is_true(math.abs(m - 2) < 0.04, "mean " .. m)
  end)

  it("normal over 100k samples has the right mean, std and uncorrelated pairs", function()
    engine.manual_seed(3)
    local f = engine.randn(100000, { dtype = "f64" }):tolist_flat()
    local m, v = mean_var(f)
    assert.is_true(math.abs(m) < 0.015, "mean " .. m)
    assert.is_true(math.abs(math.sqrt(v) - 1) < 0.015, "std " .. math.sqrt(v))
    local c = 0
    for i = 1, #f, 2 do c = c + f[i] * f[i + 1] end
    assert.is_true(math.abs(c / (#f / 2)) < 0.02, "pair correlation " .. c / (#f / 2))
    local within = 0
    for i = 1, #f do if math.abs(f[i]) < 1 then within = within + 1 end end
    assert.is_true(math.abs(within / #f - 0.6827) < 0.01)
    local g = engine.empty(100000, { dtype = "f64" }):normal_(3, 0.5):tolist_flat()
    m, v = mean_var(g)
    assert.is_true(math.abs(m - 3) < 0.01 and math.abs(math.sqrt(v) - 0.5) < 0.01)
  end)

  it("bernoulli over 100k samples has mean p", function()
    local b = engine.random_slice("bernoulli", { 100000 }, nil, nil, { a = 0.3, seed = 5, offset = 0, dtype = "f64" })
    local m = mean_var(b:tolist_flat())
    assert.is_true(math.abs(m - 0.3) < 0.006, "mean " .. m)
  end)
end)

describe("dropout", function()
  it("zeroes exactly the bernoulli(p) draws of the stream and scales the rest by 1/(1-p)", function()
    engine.manual_seed(8)
    local x = engine.randn(5, 7, { dtype = "f64" })
    local s = engine.get_rng_state()
    local y = engine.dropout(x, 0.3, true)
    local keep = engine.random_slice("bernoulli", { 5, 7 }, nil, nil, { a = 0.7, dtype = "f64", seed = s.seed, offset = s.offset })
    local xf, yf, kf = x:tolist_flat(), y:tolist_flat(), keep:tolist_flat()
    for i = 1, #xf do assert.are.equal(kf[i] == 1 and xf[i] * (1 / 0.7) or 0, yf[i]) end
    assert.are.equal(s.offset + 36, engine.get_rng_state().offset)
  end)

  it("is the identity (same tensor, no RNG use) for p = 0 or when not training", function()
    local x = engine.randn(3, 3)
    local s = engine.get_rng_state()
    assert.is_true(engine.dropout(x, 0, true)._c == x._c)
    assert.is_true(engine.dropout(x, 0.5, false)._c == x._c)
    assert.are.same(s, engine.get_rng_state())
  end)

  it("gives zeros for p = 1 and keeps about 1 - p of 100k elements", function()
    local x = engine.ones(10, { requires_grad = true })
    local y = engine.dropout(x, 1, true)
    assert.are.same({ 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }, y:tolist_flat())
    y:sum():backward()
    assert.are.same({ 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }, x.grad:tolist_flat())
    engine.manual_seed(1)
    local z = engine.dropout(engine.ones(100000, { dtype = "f64" }), 0.25, true):tolist_flat()
    local kept = 0
    for i = 1, #z do
      if z[i] ~= 0 then kept = kept + 1; assert.are.equal(1 / 0.75, z[i]) end
    end
    assert.is_true(math.abs(kept / #z - 0.75) < 0.006, "kept " .. kept / #z)
  end)

  it("backward applies the same mask and passes a float64 gradient check (fixed seed)", function()
    local x = engine.randn(4, 6, { dtype = "f64", requires_grad = true })
    local s = engine.get_rng_state()
    local y = engine.dropout(x, 0.4, true)
    assert.are.equal("DropoutBackward", y.grad_fn)
    local go = engine.randn(4, 6, { dtype = "f64" })
    y:backward(go)
    local gf, yf, xf, of = x.grad:tolist_flat(), y:tolist_flat(), x:tolist_flat(), go:tolist_flat()
    for i = 1, #gf do
      if yf[i] == 0 and xf[i] ~= 0 then assert.are.equal(0, gf[i]) else assert.is_true(math.abs(gf[i] - of[i] / 0.6) < 1e-15) end
    end
    x.grad = nil
    assert.is_true(gc.check(function(x)
      engine.set_rng_state(s)
      return engine.dropout(x, 0.4, true)
    end, { x }))
  end)

  it("indexes strided inputs by their logical row-major position", function()
    local base = engine.randn(6, 4, { dtype = "f64" })
    local x = base:t()
    local s = engine.get_rng_state()
    local a = engine.dropout(x, 0.5, true)
    engine.set_rng_state(s)
    local b = engine.dropout(x:contiguous(), 0.5, true)
    assert.are.same(b:tolist_flat(), a:tolist_flat())
  end)

  it("keeps half-precision inputs in their dtype", function()
    local x = engine.ones(64, { dtype = "bf16" })
    local y = engine.dropout(x, 0.5, true)
    assert.are.equal("bf16", y.dtype)
    for _, v in ipairs(y:tolist_flat()) do assert.is_true(v == 0 or v == 2) end
  end)

  it("rejects bad probabilities and integer inputs", function()
    local x = engine.ones(3)
    errmatch(function() engine.dropout(x, -0.1, true) end, "probability has to be between 0 and 1, but got -0.1")
    errmatch(function() engine.dropout(x, 1.5, false) end, "between 0 and 1")
    errmatch(function() engine.dropout(x, 0 / 0, true) end, "between 0 and 1")
    errmatch(function() engine.dropout(x, "a") end, "p must be a number")
    errmatch(function() engine.dropout(engine.ones(3, { dtype = "i64" }), 0.5, true) end, "floating point input, got i64[3]")
  end)
end)
