-- softmax and log_softmax: values, stability, any dim, dtypes, autograd, errors.
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local gc = require("spec.helpers.gradcheck")

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

local function vals(n, seed)
  local v = {}
  for i = 1, n do v[i] = math.sin(i * 0.7 + (seed or 0)) * 3 end
  return v
end

local function mk(shape, dtype, seed, rg)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  local t = engine.tensor(vals(n, seed), dtype or "f32"):view(shape)
  if rg then t = t:clone():detach(); t.requires_grad = true end
  return t
end

-- Reference softmax over a 1-based dim on flat tables, in double precision.
local function ref_softmax(t, dim, log)
  local shape, x = t:shape(), t:double():tolist_flat()
  local outer, D, inner = 1, shape[dim], 1
  for d = 1, dim - 1 do outer = outer * shape[d] end
  for d = dim + 1, #shape do inner = inner * shape[d] end
  local y = {}
  for o = 0, outer - 1 do
    for j = 0, inner - 1 do
      local m = -math.huge
      for d = 0, D - 1 do m = math.max(m, x[o * D * inner + d * inner + j + 1]) end
      local s = 0
      for d = 0, D - 1 do s = s + math.exp(x[o * D * inner + d * inner + j + 1] - m) end
      for d = 0, D - 1 do
        local i = o * D * inner + d * inner + j + 1
        y[i] = log and (x[i] - m - math.log(s)) or math.exp(x[i] - m) / s
      end
    end
  end
  return y
end

describe("softmax", function()
  it("gives known values", function()
    local t = engine.tensor({ 1, 2, 3 }, "f32")
    close(t:softmax(1), { 0.09003057, 0.24472847, 0.66524096 })
    close(t:log_softmax(-1), { -2.40760596, -1.40760596, -0.40760596 })
    close(engine.softmax(engine.tensor({ { 0, 0 }, { 0, math.log(3) } }, "f64"), 2), { 0.5, 0.5, 0.25, 0.75 }, 1e-14)
  end)

  it("is stable for large and -inf inputs", function()
    close(engine.tensor({ 1000, 1001 }, "f32"):softmax(1), { 0.26894142, 0.73105858 })
    close(engine.tensor({ -1000, 0 }, "f32"):log_softmax(1), { -1000, 0 })
    close(engine.tensor({ -math.huge, 0, -math.huge }, "f32"):softmax(1), { 0, 1, 0 })
    close(engine.tensor({ -math.huge, 0 }, "f32"):log_softmax(1), { -math.huge, 0 })
    local nan = engine.tensor({ 0 / 0, 1 }, "f32"):softmax(1):tolist_flat()
    assert.is_true(nan[1] ~= nan[1] and nan[2] ~= nan[2])
  end)

  it("finds each row's max wherever it is (vector blocks, their remainder, the tail) and skips NaN", function()
    -- a value of 200 at one place and small values elsewhere: exp(200) overflows f32 (the exp saturates), so a row
    -- max that missed it would make log_softmax far from 0 there
    for _, n in ipairs({ 1, 7, 8, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 70 }) do
      for pos = 1, n do
        local v = {}
        for i = 1, n do v[i] = math.sin(i) end
        v[pos] = 200
        local y = engine.log_softmax(engine.tensor(v, "f32"), 1):tolist_flat()
        for i = 1, n do
          local want = v[i] - 200
          assert(math.abs(y[i] - want) <= 1e-5 * math.max(1, math.abs(want)), string.format(
            "n=%d max at %d: element %d is %.8g, want %.8g", n, pos, i, y[i], want))
        end
      end
    end
    -- -inf everywhere but one place; a NaN makes its row NaN (the max skips it, exp(NaN) does not)
    local r = {}
    for i = 1, 40 do r[i] = -math.huge end
    r[37] = -5
    assert.are.same(1, engine.softmax(engine.tensor(r, "f32"), 1):tolist_flat()[37])
    r[3] = 0 / 0
    for _, x in ipairs(engine.softmax(engine.tensor(r, "f32"), 1):tolist_flat()) do assert.is_true(x ~= x) end
  end)

  it("works over every dim (last-dim fast path and strided dims)", function()
    local t = mk({ 2, 3, 4 }, "f32", 1)
    for d = 1, 3 do
      close(t:softmax(d), ref_softmax(t, d), 1e-6)
      close(t:log_softmax(d), ref_softmax(t, d, true), 1e-6)
      close(t:softmax(d - 4), ref_softmax(t, d), 1e-6)
    end
    local long = mk({ 3, 100 }, "f32", 2)  -- longer than one vector block
    close(long:softmax(-1), ref_softmax(long, 2), 1e-6)
    close(long:log_softmax(-1), ref_softmax(long, 2, true), 1e-6)
  end)

  it("reads non-contiguous input", function()
    local t = mk({ 4, 3 }, "f32", 3):t()
    close(t:softmax(2), ref_softmax(t:contiguous(), 2), 1e-6)
    close(t:log_softmax(1), ref_softmax(t:contiguous(), 1, true), 1e-6)
  end)

  it("rows sum to one; f64, bf16 and f16 keep their dtype", function()
    local t = mk({ 5, 7 }, "f64", 4)
    local s = t:softmax(2):sum(2):tolist_flat()
    for i = 1, 5 do assert.is_true(math.abs(s[i] - 1) < 1e-14) end
    close(t:softmax(2), ref_softmax(t, 2), 1e-14)
    for _, dt in ipairs({ "bf16", "f16" }) do
      local h = mk({ 3, 4 }, dt, 5)
      local y = h:softmax(2)
      assert.are.equal(dt, y.dtype)
      close(y, ref_softmax(h, 2), dt == "bf16" and 1e-2 or 1e-3)
      assert.are.equal(dt, h:log_softmax(1).dtype)
    end
  end)

  it("splits big inputs across threads with the same results", function()
    local x = engine.randn(300, 512)
    local g = engine.randn(300, 512)
    local function run()
      local out = {}
      for _, d in ipairs({ 1, 2 }) do
        for _, name in ipairs({ "softmax", "log_softmax" }) do
          local xi = x:clone(); xi.requires_grad = true
          local y = xi[name](xi, d)
          y:backward(g)
          out[#out + 1] = y:tolist_flat()
          out[#out + 1] = xi.grad:tolist_flat()
        end
      end
      return out
    end
    local prev = engine.get_num_threads()
    engine.set_num_threads(1)
    local one = run()
    engine.set_num_threads(2)
    local two = run()
    engine.set_num_threads(prev)
    for i = 1, #one do assert.are.same(one[i], two[i]) end
    close(x:softmax(2), x:double():softmax(2):tolist_flat(), 1e-5)
  end)

  it("handles 0-d and empty tensors", function()
    assert.are.equal(1, engine.tensor(3.5):softmax(1):item())
    assert.are.equal(0, engine.tensor(3.5):log_softmax(-1):item())
    assert.are.same({ 0, 3 }, engine.zeros(0, 3):softmax(2):shape())
    assert.are.same({ 2, 0 }, engine.zeros(2, 0):log_softmax(2):shape())
  end)

  describe("gradients (f64 finite differences)", function()
    for _, log in ipairs({ false, true }) do
      local name = log and "log_softmax" or "softmax"
      for d = -1, 3 do
        if d ~= 0 then
          it(string.format("%s over dim %d", name, d), function()
            local x = mk({ 2, 3, 4 }, "f64", 7, true)
            assert.is_true(gc.check(function(t) return t[name](t, d) end, { x }))
          end)
        end
      end
    end

    it("through a transposed input", function()
      local x = mk({ 3, 4 }, "f64", 8, true)
      assert.is_true(gc.check(function(t) return t:t():softmax(2) end, { x }))
      assert.is_true(gc.check(function(t) return t:t():log_softmax(1) end, { x }))
    end)

    it("softmax gradient of the sum is zero; log_softmax's is 1 - D*softmax", function()
      local x = mk({ 2, 3 }, "f64", 9, true)
      x:softmax(2):sum():backward()
      for _, g in ipairs(x.grad:tolist_flat()) do assert.is_true(math.abs(g) < 1e-15) end
      x.grad = nil
      x:log_softmax(2):sum():backward()
      local p = x:detach():softmax(2):tolist_flat()
      close(x.grad, (function() local r = {} for i = 1, 6 do r[i] = 1 - 3 * p[i] end return r end)(), 1e-12)
    end)
  end)

  describe("errors", function()
    it("rejects dim 0 with the 1-based explanation", function()
      local ok, err = pcall(function() return engine.zeros(2, 3):softmax(0) end)
      assert.is_false(ok)
      assert.matches("softmax: dim 0 is invalid: dims are 1%-based", err)
      assert.matches("softmax_spec.lua", err)
      assert.has_error(function() engine.zeros(2, 3):log_softmax(0) end)
    end)

    it("rejects out-of-range dims, missing dims, integer tensors and non-tensors", function()
      assert.has_error(function() engine.zeros(2, 3):softmax(3) end)
      assert.has_error(function() engine.zeros(2, 3):softmax(-3) end)
      assert.has_error(function() engine.zeros(2, 3):softmax() end, "softmax: dim is required (1-based; -1 for the last dim)")
      local ok, err = pcall(function() return engine.tensor({ 1, 2 }):softmax(1) end)
      assert.is_false(ok)
      assert.matches("softmax: i64%[2%]: floating point input expected", err)
      assert.has_error(function() engine.softmax({ 1, 2 }, 1) end, "softmax: argument 1 must be a tensor, got table")
    end)
  end)
end)
