-- Pointwise ops: unary math, clamp, comparisons, where, masked_fill and the
-- fused in-place updates.  Reference values come from PyTorch 1.13 (f64).
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local gc = require("spec.helpers.gradcheck")

local function flat(t) return (t:tolist_flat()) end

local function assert_close(t, expected, tol, msg)
  local v = flat(t)
  assert.are.equal(#expected, #v, (msg or "") .. ": element count")
  for i = 1, #expected do
    local e, a = expected[i], v[i]
    if e ~= e then
      assert(a ~= a, string.format("%s: element %d: expected nan, got %s", msg or "", i, tostring(a)))
    elseif e == math.huge or e == -math.huge then
      assert.are.equal(e, a, (msg or "") .. ": element " .. i)
    else
      local err = math.abs(a - e) / math.max(1, math.abs(e))
      assert(err <= (tol or 1e-6), string.format("%s: element %d: expected %.12g, got %.12g", msg or "", i, e, a))
    end
  end
end

local X = { -3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0 }
local REF = {
  gelu = { -0.00404969409489031, -0.15865525393145702, -0.15426876936299344, 0.0, 0.34573123063700656,
    0.841344746068543, 1.9544997361036416, 2.99595030590511 },
  gelu_tanh = { -0.0036373920817729943, -0.1588080093917233, -0.15428599017485606, 0.0, 0.34571400982514394,
    0.8411919906082768, 1.954597694087775, 2.996362607918227 },
  silu = { -0.14227761953270035, -0.2689414213699951, -0.1887703343990727, 0.0, 0.3112296656009273,
    0.7310585786300049, 1.7615941559557646, 2.8577223804672998 },
  sigmoid = { 0.04742587317756678, 0.2689414213699951, 0.3775406687981454, 0.5, 0.6224593312018546,
    0.7310585786300049, 0.8807970779778823, 0.9525741268224334 },
  tanh = { -0.9950547536867305, -0.7615941559557649, -0.46211715726000974, 0.0, 0.46211715726000974,
    0.7615941559557649, 0.9640275800758169, 0.9950547536867305 },
}
local DREF = {
  gelu = { -0.01194564720418392, -0.08331547058768635, 0.13250487534383712, 0.5, 0.8674951246561629,
    1.0833154705876864, 1.085231801078197, 1.011945647204184 },
  gelu_tanh = { -0.011584166630969648, -0.08296408384578258, 0.13263009646535764, 0.5, 0.8673699035346424,
    1.0829640838457826, 1.0860992566236183, 1.0115841666309695 },
  silu = { -0.08810410601516962, 0.07232948812851325, 0.2600388126973482, 0.5, 0.7399611873026519,
    0.9276705118714869, 1.0907842487848955, 1.0881041060151693 },
}

local function map(xs, f) local r = {} for i, x in ipairs(xs) do r[i] = f(x) end return r end

describe("unary ops", function()
  it("match known values in f64 and f32", function()
    for _, dt in ipairs({ "f64", "f32" }) do
      local tol = dt == "f64" and 1e-12 or 3e-7
      local x = engine.tensor(X, dt)
      assert_close(x:gelu(), REF.gelu, tol, "gelu " .. dt)
      assert_close(x:gelu("tanh"), REF.gelu_tanh, tol, "gelu tanh " .. dt)
      assert_close(x:gelu({ approximate = "tanh" }), REF.gelu_tanh, tol, "gelu {approximate} " .. dt)
      assert_close(x:gelu({ approximate = "none" }), REF.gelu, tol, "gelu none " .. dt)
      assert_close(x:silu(), REF.silu, tol, "silu " .. dt)
      assert_close(x:sigmoid(), REF.sigmoid, tol, "sigmoid " .. dt)
      assert_close(x:tanh(), REF.tanh, tol, "tanh " .. dt)
      assert_close(x:exp(), map(X, math.exp), tol, "exp " .. dt)
      assert_close(x:neg(), map(X, function(v) return -v end), 0, "neg " .. dt)
      assert_close(-x, map(X, function(v) return -v end), 0, "unary minus " .. dt)
      assert_close(x:abs(), map(X, math.abs), 0, "abs " .. dt)
      assert_close(x:relu(), map(X, function(v) return math.max(v, 0) end), 0, "relu " .. dt)
      local p = engine.tensor({ 0.25, 1, 2, 9, 1e-3, 100 }, dt)
      local P = { 0.25, 1, 2, 9, 1e-3, 100 }
      assert_close(p:log(), map(P, math.log), tol, "log " .. dt)
      assert_close(p:sqrt(), map(P, math.sqrt), tol, "sqrt " .. dt)
      assert_close(p:rsqrt(), map(P, function(v) return 1 / math.sqrt(v) end), tol, "rsqrt " .. dt)
    end
  end)

  it("f32 kernels stay within a few ulp of f64 over a wide range", function()
    local xd = engine.arange(-30, 30, 0.00731, { dtype = "f64" }):float():double()
    local xf = xd:float()
    for _, op in ipairs({ "exp", "tanh", "sigmoid", "silu" }) do
      local a, b = xf[op](xf):double(), xd[op](xd)
      local err = ((a - b):abs() / (b:abs() + 1e-30)):max():item()
      assert(err < 5e-7, op .. " relative error " .. err)
    end
    for _, mode in ipairs({ "none", "tanh" }) do
      local a, b = xf:gelu(mode):double(), xd:gelu(mode)
      local abs = (a - b):abs():max():item()
      assert(abs < 1e-6 * 30, "gelu " .. mode .. " absolute error " .. abs)
      -- relative accuracy also in the negative tail (down to -6, where the
      -- f32 argument x^2 itself limits it)
      local rel = ((a - b):abs() / (b:abs() + 1e-30)):masked_fill(xd:lt(-6), 0):max():item()
      assert(rel < 5e-6, "gelu " .. mode .. " relative error " .. rel)
    end
    local p = engine.arange(1e-5, 50, 0.00931, { dtype = "f64" }):float():double()
    for _, op in ipairs({ "log", "sqrt", "rsqrt" }) do
      local a, b = p:float()[op](p:float()):double(), p[op](p)
      local err = ((a - b):abs() / (b:abs() + 1e-30)):max():item()
      assert(err < 2e-7, op .. " relative error " .. err)
    end
  end)

  it("handle special values like PyTorch", function()
    local inf, nan = math.huge, 0 / 0
    local s = engine.tensor({ inf, -inf, nan, 0 }, "f32")
    assert_close(s:exp(), { inf, 0, nan, 1 }, 0, "exp")
    assert_close(s:tanh(), { 1, -1, nan, 0 }, 0, "tanh")
    assert_close(s:sigmoid(), { 1, 0, nan, 0.5 }, 0, "sigmoid")
    assert_close(s:relu(), { inf, 0, nan, 0 }, 0, "relu")
    assert_close(engine.tensor({ 0, -1, inf, 1e-45 }, "f32"):log(), { -inf, nan, inf, math.log(1.401298464324817e-45) }, 1e-6, "log")
    assert_close(engine.tensor({ -1000, 1000, -100 }, "f32"):exp(), { 0, inf, math.exp(-100) }, 1e-6, "exp range")
    -- clamp with min > max gives max everywhere (PyTorch: min(max(x, lo), hi))
    assert.are.same({ 1, 1, 1 }, engine.tensor({ 0, 1.5, 5 }, "f32"):clamp(2, 1):totable())
    assert.are.same({ 1, 1 }, engine.tensor({ 0, 5 }):clamp(2, 1):totable())
    local c = engine.tensor({ nan, 3 }, "f64"):clamp(0, 1):totable()
    assert(c[1] ~= c[1], "clamp keeps NaN")
    assert.are.equal(1, c[2])
  end)

  it("keep the dtype of floating inputs and compute bf16/f16 in f32", function()
    for _, dt in ipairs({ "bf16", "f16" }) do
      local x = engine.tensor({ -1, 0.5, 2 }, dt)
      local y = x:exp()
      assert.are.equal(dt, y.dtype)
      assert_close(y, { math.exp(-1), math.exp(0.5), math.exp(2) }, dt == "bf16" and 8e-3 or 1e-3, "exp " .. dt)
      assert.are.equal(dt, x:gelu().dtype)
      assert.are.equal(dt, x:clamp(0, 1).dtype)
    end
  end)

  it("promote integer inputs of float functions to f32 and keep ints for neg/abs/relu/clamp", function()
    local i = engine.tensor({ -2, 0, 3 })
    assert.are.equal("i64", i.dtype)
    local e = i:exp()
    assert.are.equal("f32", e.dtype)
    assert_close(e, { math.exp(-2), 1, math.exp(3) }, 1e-6, "exp(int)")
    assert.are.equal("f32", i:sigmoid().dtype)
    assert.are.equal("f32", i:log().dtype)
    local n = i:neg()
    assert.are.equal("i64", n.dtype)
    assert.are.same({ 2, 0, -3 }, n:totable())
    assert.are.same({ 2, 0, 3 }, i:abs():totable())
    assert.are.same({ 0, 0, 3 }, i:relu():totable())
    assert.are.same({ -1, 0, 2 }, i:clamp(-1, 2):totable())
    assert.are.equal("i64", i:clamp(-1, 2).dtype)
    local f = engine.tensor({ 1, 5, 9 }):clamp(2.5, 7)
    assert.are.equal("f32", f.dtype)
    assert.are.same({ 2.5, 5, 7 }, f:totable())
    assert.are.same({ 5, 0, 255 }, engine.tensor({ 5, 0, 255 }, "u8"):relu():totable())
    assert.are.same({ -5, 7 }, engine.tensor({ 5, -7 }, "i32"):neg():totable())
  end)

  it("work on non-contiguous inputs", function()
    local x = engine.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, "f64"):t()
    assert.is_false(x:is_contiguous())
    assert.are.same({ { math.exp(1), math.exp(4) }, { math.exp(2), math.exp(5) }, { math.exp(3), math.exp(6) } }, x:exp():totable())
    local y = engine.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, "f32"):t():neg()
    assert.are.same({ { -1, -4 }, { -2, -5 }, { -3, -6 } }, y:totable())
  end)

  -- contiguous f32 rows take the vector GELU (8 or 16 lanes), strided ones the scalar formula: the same bits
  it("f32 GELU and its gradient: a strided tensor's bits equal a contiguous one's", function()
    engine.manual_seed(3)
    local x = engine.randn(333, 257) * 4 -- 257: every row ends in a vector tail
    x:view(-1):narrow(1, 1, 6):copy_(engine.tensor({ 0 / 0, 1 / 0, -1 / 0, -13.5, 13.5, -0.0 }))
    local g = engine.randn(333, 257)
    local xa, xb = x:clone(), x:t():clone():t() -- the same values, column-major
    assert.is_false(xb:is_contiguous())
    xa.requires_grad = true; xb.requires_grad = true
    local ya, yb = xa:gelu(), xb:gelu()
    ya:backward(g); yb:backward(g)
    local function bits(t) -- element-wise bit patterns in row-major order
      local c = t:contiguous()
      local p = engine.ffi.cast("uint32_t*", c:data_ptr())
      local out = {}
      for i = 0, c:numel() - 1 do
        local b = p[i]
        -- every NaN counts as one value: its sign and payload depend on the instructions that made it
        if b % 2 ^ 31 > 0x7f800000 then b = -1 end
        out[i + 1] = b
      end
      return out
    end
    for what, pair in pairs({ value = { ya, yb }, gradient = { xa.grad, xb.grad } }) do
      local a, b = bits(pair[1]), bits(pair[2])
      local bad, first = 0, nil
      for i = 1, #a do if a[i] ~= b[i] then bad = bad + 1; first = first or i end end
      assert.are.equal(0, bad, string.format("gelu %s: %d of %d elements differ (first at %s)", what, bad, #a,
        tostring(first)))
    end
  end)

  it("handle empty and 0-d tensors", function()
    assert.are.same({ 0 }, engine.zeros(0):exp():shape())
    local s = engine.tensor(2.0, "f64"):exp()
    assert.are.equal(0, s:dim())
    assert.are.near(math.exp(2), s:item(), 1e-12)
  end)

  it("are also functions of engine", function()
    local x = engine.tensor({ 1, 2 }, "f64")
    assert.are.same(x:exp():totable(), engine.exp(x):totable())
    assert.are.same(x:gelu("tanh"):totable(), engine.gelu(x, "tanh"):totable())
    assert.are.same(x:clamp(1.5, nil):totable(), engine.clamp(x, 1.5):totable())
  end)

  it("have correct gradients (gradcheck, f64)", function()
    local function x(vals) return engine.tensor(vals, { dtype = "f64", requires_grad = true }) end
    local xs = { -2.1, -0.7, -0.3, 0.2, 0.9, 1.7 }
    for _, op in ipairs({ "neg", "exp", "tanh", "sigmoid", "relu", "silu", "abs" }) do
      assert.is_true(gc.check(function(t) return t[op](t) end, { x(xs) }), op)
    end
    assert.is_true(gc.check(function(t) return t:gelu() end, { x(xs) }))
    assert.is_true(gc.check(function(t) return t:gelu("tanh") end, { x(xs) }))
    local pos = { 0.3, 0.9, 1.7, 4.2 }
    for _, op in ipairs({ "log", "sqrt", "rsqrt" }) do
      assert.is_true(gc.check(function(t) return t[op](t) end, { x(pos) }), op)
    end
    assert.is_true(gc.check(function(t) return t:clamp(-1, 1) end, { x(xs) }))
    assert.is_true(gc.check(function(t) return t:clamp(nil, 0.5) end, { x(xs) }))
    assert.is_true(gc.check(function(t) return t:clamp(-0.5) end, { x(xs) }))
    -- a 2-d non-contiguous input
    local m = engine.tensor({ { 0.1, -0.4, 0.8 }, { 1.2, -1.5, 0.3 } }, { dtype = "f64", requires_grad = true })
    assert.is_true(gc.check(function(t) return t:t():tanh() end, { m }))
    assert.is_true(gc.check(function(t) return t:t():gelu() end, { m }))
  end)

  it("match PyTorch's derivatives at known points", function()
    for _, mode in ipairs({ "gelu", "gelu_tanh", "silu" }) do
      for _, dt in ipairs({ "f64", "f32" }) do
        local x = engine.tensor(X, { dtype = dt, requires_grad = true })
        local y
        if mode == "gelu" then y = x:gelu() elseif mode == "gelu_tanh" then y = x:gelu("tanh") else y = x:silu() end
        y:sum():backward()
        assert_close(x.grad, DREF[mode], dt == "f64" and 1e-12 or 1e-6, mode .. " grad " .. dt)
      end
    end
    local x = engine.tensor(X, { dtype = "f64", requires_grad = true })
    x:clamp(-1, 1):sum():backward()
    assert.are.same({ 0, 1, 1, 1, 1, 1, 0, 0 }, x.grad:totable())
    x.grad = nil
    x:relu():sum():backward()
    assert.are.same({ 0, 0, 0, 0, 1, 1, 1, 1 }, x.grad:totable())
    x.grad = nil
    x:abs():sum():backward()
    assert.are.same({ -1, -1, -1, 0, 1, 1, 1, 1 }, x.grad:totable())
  end)

  it("give bf16 gradients for bf16 inputs", function()
    local x = engine.tensor({ 0.5, -1 }, { dtype = "bf16", requires_grad = true })
    x:gelu():sum():backward()
    assert.are.equal("bf16", x.grad.dtype)
    assert_close(x.grad, { 0.8674951246561629, -0.08331547058768635 }, 1e-2, "bf16 gelu grad")
  end)

  it("record grad_fn names", function()
    local x = engine.tensor({ 1, 2 }, { dtype = "f32", requires_grad = true })
    assert.are.equal("ExpBackward", x:exp().grad_fn)
    assert.are.equal("GeluBackward", x:gelu().grad_fn)
    assert.are.equal("ClampBackward", x:clamp(0, 1).grad_fn)
    assert.is_nil(engine.no_grad(function() return x:exp() end).grad_fn)
  end)

  it("raise clear errors", function()
    local b = engine.tensor({ true, false })
    assert.has_error(function() b:neg() end, "neg: not supported for bool tensors (bool[2]); convert with :long() or :float() first")
    assert.has_error(function() b:abs() end)
    assert.has_error(function() engine.tensor({ 1.0 }):gelu("fast") end, 'gelu: approximate must be "none" or "tanh", got fast')
    assert.has_error(function() engine.tensor({ 1.0 }):clamp() end, "clamp: at least one of min and max must be given")
    assert.has_error(function() engine.tensor({ 1.0 }):clamp("a") end, "clamp: min must be a number or nil, got string")
    assert.has_error(function() engine.exp(5) end, "exp: argument 1 must be a tensor, got number")
    local ok, err = pcall(function() engine.C.eng_gelu(engine.tensor({ 1.0 })._c, 7) end)
    assert.is_true(ok)
    assert.matches("gelu: approximate must be 0", engine.ffi.string(engine.C.eng_last_error()))
    assert.is_nil(err)
    -- C API: both bounds NaN
    assert.is_true(engine.C.eng_clamp(engine.tensor({ 1.0 })._c, 0 / 0, 0 / 0) == nil)
    assert.matches("at least one of min and max", engine.ffi.string(engine.C.eng_last_error()))
  end)
end)

describe("comparisons", function()
  it("compare tensors with broadcasting", function()
    local a = engine.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, "f32")
    local b = engine.tensor({ 2, 5, 3 }, "f32")
    assert.are.same({ { false, false, true }, { false, true, false } }, a:eq(b):totable())
    assert.are.same({ { true, true, false }, { true, false, true } }, a:ne(b):totable())
    assert.are.same({ { true, true, false }, { false, false, false } }, a:lt(b):totable())
    assert.are.same({ { true, true, true }, { false, true, false } }, a:le(b):totable())
    assert.are.same({ { false, false, false }, { true, false, true } }, a:gt(b):totable())
    assert.are.same({ { false, false, true }, { true, true, true } }, a:ge(b):totable())
    assert.are.equal("bool", a:eq(b).dtype)
    assert.are.same({ 2, 3 }, a:lt(b):shape())
    local col = engine.tensor({ { 2 }, { 5 } }, "f32")
    assert.are.same({ { false, false, true }, { false, false, true } }, a:gt(col):totable())
  end)

  it("compare with numbers", function()
    local a = engine.tensor({ 1, 2, 3 }, "f64")
    assert.are.same({ false, true, false }, a:eq(2):totable())
    assert.are.same({ true, false, true }, a:ne(2):totable())
    assert.are.same({ true, false, false }, a:lt(2):totable())
    assert.are.same({ true, true, false }, a:le(2):totable())
    assert.are.same({ false, false, true }, a:gt(2):totable())
    assert.are.same({ false, true, true }, a:ge(2):totable())
    assert.are.same({ false, true, true }, engine.ge(a, 2):totable())
    -- integer tensors with fractional numbers compare exactly
    local i = engine.tensor({ 1, 2, 3 })
    assert.are.same({ false, true, true }, i:gt(1.5):totable())
    assert.are.same({ false, false, false }, i:eq(1.5):totable())
    -- the scalar takes a floating tensor's dtype (as PyTorch): bf16(0.1) == 0.1
    assert.is_true(engine.tensor({ 0.1 }, "bf16"):eq(0.1):item())
    assert.is_true(engine.tensor({ 0.1 }, "f32"):eq(0.1):item())
    -- NaN compares false except ne
    local n = engine.tensor({ 0 / 0, 1 }, "f32")
    assert.are.same({ false, true }, n:eq(n):totable())
    assert.are.same({ true, false }, n:ne(n):totable())
    assert.are.same({ false, false }, n:gt(0 / 0):totable())
    -- booleans as numbers
    assert.are.same({ true, false }, engine.tensor({ true, false }):eq(true):totable())
  end)

  it("promote mixed dtypes", function()
    local i = engine.tensor({ 1, 2, 3 })
    local f = engine.tensor({ 1.5, 2, 2.5 }, "f32")
    assert.are.same({ false, true, false }, i:eq(f):totable())
    assert.are.same({ true, false, false }, i:lt(f):totable())
    local big = engine.tensor({ 2 ^ 53 }, "i64") + 1  -- 2^53 + 1 is exact in i64 (not in f64)
    assert.are.same({ false }, big:eq(engine.tensor({ 2 ^ 53 }, "i64")):totable())
    assert.are.same({ true }, big:gt(engine.tensor({ 2 ^ 53 }, "i64")):totable())
    local bf = engine.tensor({ 1, 2 }, "bf16")
    assert.are.same({ true, false }, bf:eq(engine.tensor({ 1, 3 }, "f16")):totable())
  end)

  it("have no gradient", function()
    local x = engine.tensor({ 1, 2 }, { dtype = "f32", requires_grad = true })
    local c = x:gt(1)
    assert.is_false(c.requires_grad)
    assert.is_nil(c.grad_fn)
  end)

  it("raise clear errors", function()
    local a = engine.tensor({ 1, 2, 3 }, "f32")
    assert.has_error(function() a:eq(engine.tensor({ 1, 2 }, "f32")) end,
      "eq: f32[3] and f32[2] do not broadcast: size 3 vs 2 at dim 1 of the result (aligned from the right)")
    assert.has_error(function() a:lt("x") end, "lt: argument 2 must be a tensor, got string")
    assert.is_true(engine.C.eng_compare(a._c, a._c, 9) == nil)
    assert.matches("invalid comparison code 9", engine.ffi.string(engine.C.eng_last_error()))
  end)
end)

describe("where", function()
  it("selects with broadcasting", function()
    local c = engine.tensor({ { true, false, true } })
    local a = engine.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, "f32")
    local b = engine.tensor({ { -1 }, { -2 } }, "f32")
    local r = engine.where(c, a, b)
    assert.are.same({ { 1, -1, 3 }, { 4, -2, 6 } }, r:totable())
    assert.are.equal("f32", r.dtype)
  end)

  it("accepts numbers and promotes dtypes", function()
    local c = engine.tensor({ true, false })
    local a = engine.tensor({ 1.5, 2.5 }, "f64")
    local r = engine.where(c, a, 0)
    assert.are.equal("f64", r.dtype)
    assert.are.same({ 1.5, 0 }, r:totable())
    assert.are.same({ 7, 2.5 }, engine.where(c, 7, a):totable())
    local ints = engine.where(c, 1, 0)
    assert.are.equal("i64", ints.dtype)
    assert.are.same({ 1, 0 }, ints:totable())
    assert.are.equal("f32", engine.where(c, 1.5, 0).dtype)
    local mixed = engine.where(c, engine.tensor({ 1, 2 }), engine.tensor({ 0.5, 0.5 }, "f32"))
    assert.are.equal("f32", mixed.dtype)
    assert.are.same({ 1, 0.5 }, mixed:totable())
    -- bf16 stays bf16 (bit copies)
    local h = engine.where(c, engine.tensor({ 1, 2 }, "bf16"), engine.tensor({ 3, 4 }, "bf16"))
    assert.are.equal("bf16", h.dtype)
    assert.are.same({ 1, 4 }, h:totable())
    -- u8 condition works like bool
    assert.are.same({ 1.5, 0 }, engine.where(engine.tensor({ 3, 0 }, "u8"), a, 0):totable())
    -- method form: t:where(cond, other)
    assert.are.same({ 1.5, -1 }, a:where(c, -1):totable())
  end)

  it("sends gradients to both branches (gradcheck)", function()
    local c = engine.tensor({ { true, false, true }, { false, false, true } })
    local a = engine.tensor({ { 0.1, 0.2, 0.3 }, { 0.4, 0.5, 0.6 } }, { dtype = "f64", requires_grad = true })
    local b = engine.tensor({ 1.1, 1.2, 1.3 }, { dtype = "f64", requires_grad = true })
    assert.is_true(gc.check(function(x, y) return engine.where(c, x, y) end, { a, b }))
    a.grad, b.grad = nil, nil
    engine.where(c, a, b):sum():backward()
    assert.are.same({ { 1, 0, 1 }, { 0, 0, 1 } }, a.grad:totable())
    assert.are.same({ 1, 2, 0 }, b.grad:totable())
    assert.are.equal("WhereBackward", engine.where(c, a, b).grad_fn)
  end)

  it("raises clear errors", function()
    local a = engine.tensor({ 1, 2 }, "f32")
    assert.has_error(function() engine.where(a, a, a) end, "where: condition must be a bool tensor, got f32[2]")
    assert.has_error(function() engine.where(engine.tensor({ true, false, true }), a, a) end,
      "where: condition bool[3], f32[2] and f32[2] do not broadcast together")
    assert.has_error(function() engine.where(engine.tensor({ true }), a, engine.tensor({ 1, 2, 3 }, "f32")) end,
      "where: f32[2] and f32[3] do not broadcast: size 2 vs 3 at dim 1 of the result (aligned from the right)")
    assert.has_error(function() engine.where(nil, a, a) end, "where: argument 1 must be a tensor, got nil")
    assert.has_error(function() engine.where(engine.tensor({ true }), a, "x") end, "where: argument 3 must be a tensor, got string")
  end)
end)

describe("masked_fill", function()
  it("fills where the mask is true, broadcasting the mask", function()
    local t = engine.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, "f32")
    local m = engine.tensor({ true, false, true })
    assert.are.same({ { 0, 2, 0 }, { 0, 5, 0 } }, t:masked_fill(m, 0):totable())
    assert.are.same({ { 1, 2, 3 }, { 4, 5, 6 } }, t:totable(), "out of place")
    local inf = t:masked_fill(t:gt(4), -math.huge)
    assert.are.same({ { 1, 2, 3 }, { 4, -math.huge, -math.huge } }, inf:totable())
    assert.are.equal("i64", engine.tensor({ 1, 2 }):masked_fill(engine.tensor({ false, true }), 7).dtype)
    assert.are.same({ 1, 7 }, engine.tensor({ 1, 2 }):masked_fill(engine.tensor({ false, true }), 7):totable())
    assert.are.same({ 1, 9 }, engine.tensor({ 1, 2 }, "bf16"):masked_fill(engine.tensor({ false, true }), 9):totable())
    -- out-of-place masked_fill broadcasts the tensor too (as PyTorch)
    assert.are.same({ 2, 3 }, engine.zeros(3):masked_fill(engine.ones(2, 3):gt(0), 1):shape())
  end)

  it("has zero gradient where masked (gradcheck)", function()
    local x = engine.tensor({ { 0.5, -1.0, 2.0 }, { 1.5, 0.1, -0.3 } }, { dtype = "f64", requires_grad = true })
    local m = engine.tensor({ { true, false, false }, { false, false, true } })
    assert.is_true(gc.check(function(t) return t:masked_fill(m, 3.0) end, { x }))
    x.grad = nil
    x:masked_fill(m, 3.0):sum():backward()
    assert.are.same({ { 0, 1, 1 }, { 1, 1, 0 } }, x.grad:totable())
    local v = engine.tensor({ 1.0, 2.0, 3.0 }, { dtype = "f64", requires_grad = true })
    assert.is_true(gc.check(function(t) return t:masked_fill(m, 0) end, { v }))
  end)

  it("raises clear errors", function()
    local t = engine.tensor({ 1, 2, 3 }, "f32")
    assert.has_error(function() t:masked_fill(t, 0) end, "masked_fill: mask must be a bool tensor, got f32[3]")
    assert.has_error(function() t:masked_fill(engine.tensor({ true, false }), 0) end,
      "masked_fill: f32[3] and bool[2] do not broadcast: size 3 vs 2 at dim 1 of the result (aligned from the right)")
    assert.has_error(function() t:masked_fill(engine.tensor({ true, false, true }), "x") end,
      "masked_fill: value must be a number, got string")
    assert.has_error(function() engine.tensor({ 1, 2 }):masked_fill(engine.tensor({ true, false }), 0 / 0) end,
      "masked_fill: cannot convert nan to i64")
  end)
end)

describe("in-place updates", function()
  it("addcmul_, addcdiv_ and lerp_ compute the right values", function()
    local a = engine.tensor({ 1, 2, 3 }, "f32")
    a:addcmul_(engine.tensor({ 1, 2, 3 }, "f32"), engine.tensor({ 2, 2, 2 }, "f32"), 0.5)
    assert.are.same({ 2, 4, 6 }, a:totable())
    a:addcdiv_(engine.tensor({ 4, 4, 4 }, "f32"), engine.tensor({ 2, 4, 8 }, "f32"), 2)
    assert.are.same({ 6, 6, 7 }, a:totable())
    a:lerp_(engine.tensor({ 10, 10, 10 }, "f32"), 0.25)
    assert.are.same({ 7, 7, 7.75 }, a:totable())
    a:addcmul_(a, a)  -- default value 1, operands aliasing the target
    assert.are.same({ 56, 56, 7.75 + 7.75 * 7.75 }, a:totable())
  end)

  it("broadcast operands, convert dtypes and support f64/bf16 targets", function()
    local a = engine.zeros(2, 3, { dtype = "f64" })
    a:addcmul_(engine.tensor({ 1, 2, 3 }, "f32"), engine.tensor({ { 1 }, { 2 } }, "f64"), 1)
    assert.are.same({ { 1, 2, 3 }, { 2, 4, 6 } }, a:totable())
    local h = engine.tensor({ 1, 2 }, "bf16")
    h:addcdiv_(engine.tensor({ 1, 1 }, "f32"), engine.tensor({ 2, 4 }, "f32"), 1)
    assert.are.same({ 1.5, 2.25 }, h:totable())
    h:lerp_(engine.tensor({ 3.5, 2.25 }, "bf16"), 1)
    assert.are.same({ 3.5, 2.25 }, h:totable())
  end)

  it("work on non-contiguous targets and with overlapping operands", function()
    local base = engine.tensor({ { 1, 2 }, { 3, 4 } }, "f32")
    local tt = base:t()
    tt:addcmul_(engine.tensor({ 1, 10 }, "f32"), engine.tensor({ 1, 1 }, "f32"))
    assert.are.same({ { 2, 3 }, { 13, 14 } }, base:totable())
    local x = engine.tensor({ 1, 2, 3, 4 }, "f32")
    local lo, hi = x:narrow(1, 1, 2), x:narrow(1, 3, 2)
    lo:lerp_(hi, 0.5)
    assert.are.same({ 2, 3, 3, 4 }, x:totable())
  end)

  it("clamp_ clamps in place with optional bounds", function()
    local a = engine.tensor({ -2, 0.5, 3, 0 / 0 }, "f32")
    a:clamp_(-1, 1)
    local v = a:totable()
    assert.are.same({ -1, 0.5, 1 }, { v[1], v[2], v[3] })
    assert(v[4] ~= v[4], "NaN stays NaN")
    local b = engine.tensor({ -5, 5 })
    b:clamp_(nil, 2)
    assert.are.same({ -5, 2 }, b:totable())
    local h = engine.tensor({ -5, 5 }, "bf16")
    h:clamp_(0)
    assert.are.same({ 0, 5 }, h:totable())
    local t = engine.tensor({ { 1, 9 }, { 5, -3 } }, "f64"):t()
    t:clamp_(0, 4)
    assert.are.same({ { 1, 4 }, { 4, 0 } }, t:totable())
  end)

  it("bump the version counter", function()
    local a = engine.ones(3)
    local v0 = engine.C.eng_tensor_version(a._c)
    a:addcmul_(a, a)
    a:clamp_(0, 1)
    a:lerp_(a, 0.5)
    a:addcdiv_(a, a)
    assert.are.equal(v0 + 4, engine.C.eng_tensor_version(a._c))
  end)

  it("refuse leaves that require grad and bad shapes", function()
    local p = engine.ones(3, { requires_grad = true })
    local o = engine.ones(3)
    assert.has_error(function() p:addcmul_(o, o) end,
      "addcmul_: a leaf tensor that requires grad (f32[3]) cannot be modified in place while grad mode is on (use no_grad)")
    assert.has_error(function() p:clamp_(0, 1) end)
    engine.no_grad(function() p:addcmul_(o, o, 2) end)
    assert.are.same({ 3, 3, 3 }, p:totable())
    assert.has_error(function() o:addcdiv_(engine.ones(2, 3), o) end,
      "addcdiv_: f32[2,3] cannot be broadcast to the in-place target f32[3]")
    assert.has_error(function() o:lerp_(engine.ones(4), 0.5) end,
      "lerp_: f32[3] and f32[4] do not broadcast: size 3 vs 4 at dim 1 of the result (aligned from the right)")
    assert.has_error(function() o:lerp_(o) end, "lerp_: weight must be a number, got nil")
    assert.has_error(function() engine.tensor({ 1, 2 }):addcmul_(engine.tensor({ 1, 2 }), engine.tensor({ 1, 2 })) end,
      "addcmul_: the in-place target must be floating point, got i64[2]")
    assert.has_error(function() engine.tensor({ 1, 2 }):clamp_(0.5, 1) end)
    assert.has_error(function() engine.tensor({ true }):clamp_(0, 1) end, "clamp_: not supported for bool tensors (bool[1])")
    assert.has_error(function() o:clamp_() end, "clamp_: at least one of min and max must be given")
    assert.has_error(function() o:addcmul_(o, 3) end, "addcmul_: argument 3 must be a tensor, got number")
  end)
end)
