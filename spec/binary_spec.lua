-- Binary arithmetic (add, sub, mul, div, pow, maximum, minimum), the scalar
-- forms and the Lua operators: values, broadcasting, dtype promotion,
-- gradients (gradcheck in f64) and errors.  Values follow PyTorch 1.13.
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local gc = require("spec.helpers.gradcheck")

local function f64(v, rg) return engine.tensor(v, { dtype = "f64", requires_grad = rg or false }) end

local function assert_close(t, expected, tol)
  local got = t:tolist_flat()
  local exp = {}
  local function walk(x) if type(x) == "table" then for _, y in ipairs(x) do walk(y) end else exp[#exp + 1] = x end end
  walk(expected)
  assert.are.equal(#exp, #got)
  for i = 1, #exp do
    assert(math.abs(got[i] - exp[i]) <= (tol or 1e-12) * math.max(1, math.abs(exp[i])),
      string.format("element %d: expected %.12g, got %.12g", i, exp[i], got[i]))
  end
end

describe("binary ops", function()
  it("compute known values with broadcasting", function()
    local a = engine.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, "f32")
    local b = engine.tensor({ 10, 20, 30 }, "f32")
    local c = engine.tensor({ { 2 }, { 4 } }, "f32")
    assert.are.same({ { 11, 22, 33 }, { 14, 25, 36 } }, (a + b):totable())
    assert.are.same({ { -9, -18, -27 }, { -6, -15, -24 } }, (a - b):totable())
    assert.are.same({ { 2, 4, 6 }, { 16, 20, 24 } }, (a * c):totable())
    assert.are.same({ { 0.5, 1, 1.5 }, { 1, 1.25, 1.5 } }, (a / c):totable())
    assert.are.same({ { 1, 4, 9 }, { 256, 625, 1296 } }, (a ^ c):totable())
    assert.are.same({ { 10, 20, 30 }, { 10, 20, 30 } }, a:maximum(b):totable())
    assert.are.same({ { 1, 2, 2 }, { 4, 4, 4 } }, a:minimum(c):totable())
    assert.are.same({ 2, 3 }, (c + b):shape())
    assert.are.same({ { 12, 22, 32 }, { 14, 24, 34 } }, (c + b):totable())
    assert.are.same({ { 11, 22, 33 }, { 14, 25, 36 } }, engine.add(a, b):totable())
    local s = engine.tensor(5, "f32")
    assert.are.same({ { 6, 7, 8 }, { 9, 10, 11 } }, (a + s):totable())
  end)

  it("scalar forms and Lua operators", function()
    local a = engine.tensor({ 1, 2, 4 }, "f64")
    assert.are.same({ 3, 4, 6 }, (a + 2):totable())
    assert.are.same({ 3, 4, 6 }, (2 + a):totable())
    assert.are.same({ -1, 0, 2 }, (a - 2):totable())
    assert.are.same({ 1, 0, -2 }, (2 - a):totable())
    assert.are.same({ 3, 6, 12 }, (a * 3):totable())
    assert.are.same({ 3, 6, 12 }, (3 * a):totable())
    assert.are.same({ 0.5, 1, 2 }, (a / 2):totable())
    assert.are.same({ 4, 2, 1 }, (4 / a):totable())
    assert.are.same({ 1, 4, 16 }, (a ^ 2):totable())
    assert.are.same({ 2, 4, 16 }, (2 ^ a):totable())
    assert.are.same({ -1, -2, -4 }, (-a):totable())
    assert.are.same({ 3, 4, 6 }, a:add(2):totable())
    assert.are.same({ 1, 0, -2 }, engine.sub(2, a):totable())
  end)

  it("promote dtypes like PyTorch", function()
    local i = engine.tensor({ 1, 2, 3 })
    local f = engine.tensor({ 0.5, 0.5, 0.5 }, "f32")
    assert.are.equal("f32", (i + f).dtype)
    assert.are.equal("i64", (i + i).dtype)
    assert.are.equal("i64", (i * 2).dtype)
    assert.are.equal("f32", (i * 2.5).dtype)
    assert.are.same({ 2.5, 5, 7.5 }, (i * 2.5):totable())
    assert.are.equal("f32", (i / 2).dtype, "true division of integers gives f32")
    assert.are.same({ 0.5, 1, 1.5 }, (i / 2):totable())
    assert.are.same({ 2.5, -3.5 }, (engine.tensor({ 5, -7 }) / engine.tensor({ 2, 2 })):totable())
    assert.are.equal("f64", (f + engine.tensor({ 1 }, "f64")).dtype)
    assert.are.equal("f32", (engine.tensor({ 1 }, "bf16") + engine.tensor({ 1 }, "f16")).dtype)
    assert.are.equal("bf16", (engine.tensor({ 1 }, "bf16") * 3.5).dtype)
    assert.are.equal("bf16", (engine.tensor({ 1 }, "bf16") + engine.tensor({ 1 })).dtype)
    assert.are.equal("i32", (engine.tensor({ 1 }, "i32") + engine.tensor({ 1 }, "u8")).dtype)
    assert.are.equal("i64", (i ^ 2).dtype)
    assert.are.same({ 1, 4, 9 }, (i ^ 2):totable())
    assert.are.equal("f32", (i ^ 0.5).dtype)
    assert.are.equal("i64", (engine.tensor({ true }) + 1).dtype)
    assert.are.same({ 2 }, (engine.tensor({ true }) + 1):totable())
  end)

  it("work on non-contiguous operands", function()
    local a = engine.tensor({ { 1, 2 }, { 3, 4 } }, "f32")
    assert.are.same({ { 2, 5 }, { 5, 8 } }, (a + a:t()):totable())
    assert.are.same({ { 1, 6 }, { 6, 16 } }, (a * a:t()):totable())
  end)

  it("bf16 and f16 round the f32 result", function()
    local h = engine.tensor({ 1, 2 }, "bf16")
    local r = h / 3
    assert.are.equal("bf16", r.dtype)
    assert_close(r, { 0.333984375, 0.66796875 }, 1e-9)
  end)

  it("have correct gradients with broadcasting (gradcheck, f64)", function()
    local a = f64({ { 0.5, -1.2, 2.0 }, { 1.5, 0.3, -0.7 } }, true)
    local b = f64({ 0.8, 1.9, -0.4 }, true)
    local c = f64({ { 1.3 }, { -2.1 } }, true)
    for _, op in ipairs({ "add", "sub", "mul", "div", "maximum", "minimum" }) do
      assert.is_true(gc.check(function(x, y) return x[op](x, y) end, { a, b }), op .. " a b")
      assert.is_true(gc.check(function(x, y) return x[op](x, y) end, { b, c }), op .. " b c")
      assert.is_true(gc.check(function(x, y) return x[op](x, y) end, { c, a }), op .. " c a")
    end
    local pa = f64({ { 0.5, 1.2, 2.0 }, { 1.5, 0.3, 0.7 } }, true)
    assert.is_true(gc.check(function(x, y) return x ^ y end, { pa, b }), "pow")
    assert.is_true(gc.check(function(x, y) return x ^ y end, { pa, c }), "pow col")
    assert.is_true(gc.check(function(x) return x:t() * x:t() end, { a }), "non-contiguous")
    assert.is_true(gc.check(function(x) return x * x end, { a }), "same tensor twice")
  end)

  it("scalar forms have correct gradients (gradcheck, f64)", function()
    local a = f64({ { 0.5, 1.2, 2.0 }, { 1.5, 0.3, 0.7 } }, true)
    local fs = {
      function(x) return x + 2.5 end, function(x) return 2.5 + x end,
      function(x) return x - 2.5 end, function(x) return 2.5 - x end,
      function(x) return x * -1.5 end, function(x) return -1.5 * x end,
      function(x) return x / 4 end, function(x) return 4 / x end,
      function(x) return x ^ 3 end, function(x) return x ^ 0.5 end, function(x) return x ^ -1.5 end,
      function(x) return 2.5 ^ x end, function(x) return x ^ 0 end,
    }
    for k, f in ipairs(fs) do assert.is_true(gc.check(f, { a }), "scalar form " .. k) end
  end)

  it("match PyTorch's gradients at special points", function()
    -- pow at a = 0: d/da is 0 for b = 0, and d/db is 0 where a = 0 and b >= 0
    local x = f64({ 0, 0, 2 }, true)
    local y = f64({ 0, 2, -1 }, true)
    local r = x ^ y
    r:sum():backward()
    assert_close(x.grad, { 0, 0, -0.25 })
    assert_close(y.grad, { 0, 0, math.log(2) / 2 })
    -- maximum/minimum split ties evenly
    local p = engine.tensor({ 1, 3 }, { dtype = "f32", requires_grad = true })
    local q = engine.tensor({ 1, 2 }, { dtype = "f32", requires_grad = true })
    p:maximum(q):sum():backward()
    assert.are.same({ 0.5, 1 }, p.grad:totable())
    assert.are.same({ 0.5, 0 }, q.grad:totable())
    local z = engine.tensor({ 0, 2 }, { dtype = "f32", requires_grad = true });
    (z ^ 0):sum():backward()
    assert.are.same({ 0, 0 }, z.grad:totable())
    local w = engine.tensor({ 0, 2 }, { dtype = "f64", requires_grad = true });
    (2 ^ w):sum():backward()
    assert_close(w.grad, { math.log(2), 4 * math.log(2) })
  end)

  it("reduce gradients to each input's shape and dtype", function()
    local a = engine.ones(2, 3, { requires_grad = true })
    local b = engine.ones(3, { dtype = "f64", requires_grad = true })
    local y = a * b
    assert.are.equal("f64", y.dtype)
    y:sum():backward()
    assert.are.same({ 2, 3 }, a.grad:shape())
    assert.are.equal("f32", a.grad.dtype)
    assert.are.same({ 2, 2, 2 }, b.grad:totable())
    assert.are.equal("f64", b.grad.dtype)
    assert.are.equal("MulBackward", y.grad_fn)
    assert.are.equal("AddBackward", (a + 1).grad_fn)
    assert.are.equal("RdivBackward", (1 / a).grad_fn)
  end)

  it("record no graph for integer results or in no_grad mode", function()
    local a = engine.ones(2, { requires_grad = true })
    assert.is_nil(engine.no_grad(function() return a * 2 end).grad_fn)
    local i = engine.tensor({ 1, 2 }) + engine.tensor({ 3, 4 })
    assert.is_false(i.requires_grad)
  end)

  it("raise clear errors", function()
    local a = engine.ones(2, 3)
    assert.has_error(function() return a + engine.ones(4) end,
      "add: f32[2,3] and f32[4] do not broadcast: size 3 vs 4 at dim 2 of the result (aligned from the right)")
    assert.has_error(function() return a * engine.ones(3, 3) end,
      "mul: f32[2,3] and f32[3,3] do not broadcast: size 2 vs 3 at dim 1 of the result (aligned from the right)")
    assert.has_error(function() return a - "x" end, "sub: unsupported operand types table and string")
    assert.has_error(function() return a:maximum(3) end, "maximum: argument 2 must be a tensor, got number")
    assert.has_error(function() return a:div(engine.ones(5)) end)
    assert.has_error(function() return a ^ engine.ones(2) end)
  end)
end)

describe("in-place arithmetic", function()
  it("add_, sub_, mul_, div_ with tensors and numbers", function()
    local a = engine.tensor({ 1, 2, 3 }, "f32")
    a:add_(engine.tensor({ 1, 1, 1 }, "f32"), 2)
    assert.are.same({ 3, 4, 5 }, a:totable())
    a:sub_(engine.tensor({ 1, 2, 3 }, "f32"))
    assert.are.same({ 2, 2, 2 }, a:totable())
    a:mul_(engine.tensor({ 1, 2, 3 }, "f64"))
    assert.are.same({ 2, 4, 6 }, a:totable())
    a:div_(2)
    assert.are.same({ 1, 2, 3 }, a:totable())
    a:add_(1):mul_(3):sub_(1)
    assert.are.same({ 5, 8, 11 }, a:totable())
    local m = engine.zeros(2, 3)
    m:add_(engine.tensor({ 1, 2, 3 }, "f32"))
    assert.are.same({ { 1, 2, 3 }, { 1, 2, 3 } }, m:totable())
  end)

  it("refuse leaves requiring grad and shape changes", function()
    local p = engine.ones(3, { requires_grad = true })
    assert.has_error(function() p:add_(1) end,
      "add_: a leaf tensor that requires grad (f32[3]) cannot be modified in place while grad mode is on (use no_grad)")
    assert.has_error(function() engine.ones(3):mul_(engine.ones(2, 3)) end,
      "mul_: f32[2,3] cannot be broadcast to the in-place target f32[3]")
  end)
end)
