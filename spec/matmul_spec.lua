-- matmul and linear: torch.matmul semantics, layouts, dtypes, autograd, errors.
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local gc = require("spec.helpers.gradcheck")

-- Deterministic values, multiples of 1/4 in [-2, 2] (exact in bf16/f16).
local function vals(n, seed)
  local v = {}
  for i = 1, n do v[i] = (((i + (seed or 0)) * 37) % 17 - 8) / 4 end
  return v
end

local function numel(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  return n
end

local function mk(shape, dtype, seed, rg)
  local t = engine.tensor(vals(numel(shape), seed), dtype or "f32"):view(shape)
  if rg then t = t:clone():detach(); t.requires_grad = true end
  return t
end

local function close(t, expected, tol)
  if type(tol) ~= "number" then tol = nil end -- tolist_flat() passed last also returns its buffer
  local got = t:tolist_flat()
  assert.are.equal(#expected, #got)
  for i = 1, #expected do
    local e, g = expected[i], got[i]
    if math.abs(e - g) > (tol or 1e-5) * math.max(1, math.abs(e)) then
      error(string.format("element %d: expected %.8g, got %.8g", i, e, g), 2)
    end
  end
end

-- Reference torch.matmul on flat row-major tables.
local function ref_matmul(A, ash, B, bsh)
  local a1, b1 = #ash == 1, #bsh == 1
  local as = a1 and { 1, ash[1] } or ash
  local bs = b1 and { bsh[1], 1 } or bsh
  local M, K, N = as[#as - 1], as[#as], bs[#bs]
  assert(K == bs[#bs - 1])
  local nba, nbb = #as - 2, #bs - 2
  local nb = math.max(nba, nbb)
  local bshape = {}
  for i = 1, nb do
    local x = as[nba - nb + i] or 1
    local y = bs[nbb - nb + i] or 1
    if i + nba - nb < 1 then x = 1 end
    if i + nbb - nb < 1 then y = 1 end
    bshape[i] = x == 1 and y or x
  end
  local function boff(shape, nbx, idx)
    local off, stride = 0, 1
    for d = nbx, 1, -1 do
      local bi = idx[nb - nbx + d]
      if shape[d] == 1 then bi = 0 end
      off = off + bi * stride
      stride = stride * shape[d]
    end
    return off
  end
  local out, tot = {}, numel(bshape)
  for b = 0, tot - 1 do
    local idx, rem = {}, b
    for d = nb, 1, -1 do idx[d] = rem % bshape[d]; rem = math.floor(rem / bshape[d]) end
    local oa, ob = boff(as, nba, idx) * M * K, boff(bs, nbb, idx) * K * N
    for i = 0, M - 1 do
      for j = 0, N - 1 do
        local s = 0
        for k = 0, K - 1 do s = s + A[oa + i * K + k + 1] * B[ob + k * N + j + 1] end
        out[#out + 1] = s
      end
    end
  end
  local oshape = {}
  for i = 1, nb do oshape[i] = bshape[i] end
  if not a1 then oshape[#oshape + 1] = M end
  if not b1 then oshape[#oshape + 1] = N end
  return out, oshape
end

local function check_matmul(ash, bsh, dtype, tol)
  local a, b = mk(ash, dtype, 1), mk(bsh, dtype, 5)
  local c = a:matmul(b)
  local exp, eshape = ref_matmul(a:tolist_flat(), ash, b:tolist_flat(), bsh)
  assert.are.same(eshape, c:shape())
  assert.are.equal(dtype or "f32", c.dtype)
  close(c, exp, tol)
end

describe("matmul", function()
  it("multiplies 2-D matrices (hand-computed)", function()
    local a = engine.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, "f32")
    local b = engine.tensor({ { 7, 8 }, { 9, 10 }, { 11, 12 } }, "f32")
    local c = engine.matmul(a, b)
    assert.are.same({ 2, 2 }, c:shape())
    assert.are.same({ { 58, 64 }, { 139, 154 } }, c:totable())
  end)

  it("1-D x 1-D is a dot product (0-d result)", function()
    local d = engine.tensor({ 1, 2, 3 }, "f32"):matmul(engine.tensor({ 4, 5, 6 }, "f32"))
    assert.are.equal(0, d:dim())
    assert.are.equal(32, d:item())
  end)

  it("promotes 1-D operands and squeezes the added dim", function()
    local m = engine.tensor({ { 1, 2 }, { 3, 4 }, { 5, 6 } }, "f32")
    local v2 = engine.tensor({ 1, -1 }, "f32")
    local v3 = engine.tensor({ 1, 0, 2 }, "f32")
    local mv = m:matmul(v2)
    assert.are.same({ 3 }, mv:shape())
    assert.are.same({ -1, -1, -1 }, mv:totable())
    local vm = v3:matmul(m)
    assert.are.same({ 2 }, vm:shape())
    assert.are.same({ 11, 14 }, vm:totable())
  end)

  it("broadcasts batch dims like torch.matmul", function()
    check_matmul({ 2, 1, 3, 4 }, { 5, 4, 2 })
    check_matmul({ 3, 4 }, { 2, 4, 5 })
    check_matmul({ 2, 3, 4 }, { 4, 5 })
    check_matmul({ 2, 3, 4 }, { 4 })
    check_matmul({ 4 }, { 2, 3, 4, 5 })
    check_matmul({ 1, 3, 2, 4 }, { 2, 1, 4, 3 })
    check_matmul({ 2, 2, 3 }, { 2, 3, 1 })
  end)

  it("handles empty dims (K = 0 gives zeros)", function()
    local c = engine.zeros(2, 0):matmul(engine.zeros(0, 3))
    assert.are.same({ 2, 3 }, c:shape())
    assert.are.same({ 0, 0, 0, 0, 0, 0 }, c:tolist_flat())
    assert.are.same({ 0, 3 }, engine.zeros(0, 4):matmul(engine.zeros(4, 3)):shape())
    assert.are.same({ 0, 2, 3 }, engine.zeros(0, 2, 4):matmul(engine.zeros(4, 3)):shape())
  end)

  it("reads transposed, sliced and expanded operands correctly", function()
    local a = mk({ 4, 3 }, "f32", 2)        -- a:t() is [3, 4], column-major
    local b = mk({ 4, 6 }, "f32", 3)
    local bn = b:narrow(2, 2, 3)              -- [4, 3] with row stride 6
    local exp = ref_matmul(a:t():contiguous():tolist_flat(), { 3, 4 }, bn:contiguous():tolist_flat(), { 4, 3 })
    close(a:t():matmul(bn), exp)
    -- batched operand with transposed matrices
    local x = mk({ 2, 5, 3 }, "f32", 4)
    local xt = x:transpose(2, 3)              -- [2, 3, 5]
    local y = mk({ 5, 2 }, "f32", 6)
    exp = ref_matmul(xt:contiguous():tolist_flat(), { 2, 3, 5 }, y:tolist_flat(), { 5, 2 })
    close(xt:matmul(y), exp)
    -- stride-0 (expanded) operand
    local r = mk({ 1, 3 }, "f32", 7):expand(4, 3)
    local w = mk({ 3, 2 }, "f32", 8)
    exp = ref_matmul(r:contiguous():tolist_flat(), { 4, 3 }, w:tolist_flat(), { 3, 2 })
    close(r:matmul(w), exp)
  end)

  it("supports f64, bf16, f16 and integer dtypes", function()
    check_matmul({ 2, 3, 4 }, { 4, 5 }, "f64", 1e-12)
    check_matmul({ 3, 4 }, { 4, 2 }, "bf16", 1e-2)
    check_matmul({ 2, 3, 4 }, { 2, 4, 2 }, "f16", 1e-3)
    local a = engine.tensor({ { 1, 2 }, { 3, 4 } })
    local c = a:matmul(engine.tensor({ { -1, 0 }, { 2, 5 } }))
    assert.are.equal("i64", c.dtype)
    assert.are.same({ { 3, 10 }, { 5, 20 } }, c:totable())
  end)

  it("one-row and one-column products in every layout, split over threads (few-row path)", function()
    local nt = engine.get_num_threads()
    engine.set_num_threads(2)
    local ok, err = pcall(function()
      for _, dt in ipairs({ "f32", "f64" }) do
        local tol = dt == "f32" and 1e-5 or 1e-12
        -- sizes below and above the few-row split (n * k >= 2^16); k = 300 is not a multiple of the vector width
        for _, nk in ipairs({ { 20, 30 }, { 400, 300 } }) do
          local n, k = nk[1], nk[2]
          local x = mk({ 1, k }, dt, 1)
          local w = mk({ n, k }, dt, 2)                     -- x @ w^T (linear's layout)
          local wt = mk({ k, n }, dt, 3)                    -- x @ wt
          local xs = mk({ 3, k }, dt, 4):narrow(1, 2, 1)     -- a row of a bigger matrix
          local xc = mk({ k, 2 }, dt, 5):narrow(2, 2, 1):t() -- a column read as a row (stride 2)
          local wide = mk({ n, k + 7 }, dt, 6):narrow(2, 4, k) -- row stride k + 7
          for _, a in ipairs({ x, xs, xc }) do
            local af = a:contiguous():tolist_flat()
            close(a:matmul(w:t()), (ref_matmul(af, { 1, k }, w:t():contiguous():tolist_flat(), { k, n })), tol)
            close(a:matmul(wt), (ref_matmul(af, { 1, k }, wt:tolist_flat(), { k, n })), tol)
            close(a:matmul(wide:t()), (ref_matmul(af, { 1, k }, wide:t():contiguous():tolist_flat(), { k, n })), tol)
            -- one column: matrix @ vector, the matrix stored either way, the vector strided
            close(w:matmul(a:t()), (ref_matmul(w:tolist_flat(), { n, k }, af, { k, 1 })), tol)
            close(wt:t():matmul(a:t()), (ref_matmul(wt:t():contiguous():tolist_flat(), { n, k }, af, { k, 1 })), tol)
            close(wide:matmul(a:t()), (ref_matmul(wide:contiguous():tolist_flat(), { n, k }, af, { k, 1 })), tol)
          end
          -- linear adds its bias to the one row (accumulating product)
          local b = mk({ n }, dt, 9)
          local exp = ref_matmul(x:tolist_flat(), { 1, k }, w:t():contiguous():tolist_flat(), { k, n })
          for j = 1, n do exp[j] = exp[j] + b:tolist_flat()[j] end
          close(engine.nn.functional.linear(x, w, b), exp, tol)
        end
      end
    end)
    engine.set_num_threads(nt)
    assert(ok, err)
  end)

  it("agrees with a large f32 product (BLAS path, folded batch)", function()
    local a = engine.randn(4, 32, 48)
    local b = engine.randn(48, 40)
    local c = a:matmul(b)
    local ad, bd = a:double(), b:double()
    close(c, ad:matmul(bd):tolist_flat(), 1e-4)
  end)

  describe("gradients (f64 finite differences)", function()
    local cases = {
      { { 3, 4 }, { 4, 2 } }, { { 4 }, { 4, 3 } }, { { 3, 4 }, { 4 } }, { { 4 }, { 4 } },
      { { 2, 1, 3, 4 }, { 3, 4, 2 } }, { { 3, 4 }, { 2, 4, 5 } }, { { 2, 3, 4 }, { 4, 2 } },
      { { 2, 3, 4 }, { 4 } }, { { 4 }, { 2, 4, 3 } }, { { 1, 2, 3 }, { 2, 3, 2 } },
    }
    for _, cs in ipairs(cases) do
      it(string.format("matmul %s x %s", table.concat(cs[1], "x"), table.concat(cs[2], "x")), function()
        local a, b = mk(cs[1], "f64", 1, true), mk(cs[2], "f64", 9, true)
        assert.is_true(gc.check(function(x, y) return x:matmul(y) end, { a, b }))
      end)
    end

    it("through transposed inputs", function()
      local a, b = mk({ 4, 3 }, "f64", 1, true), mk({ 2, 4 }, "f64", 2, true)
      assert.is_true(gc.check(function(x, y) return x:t():matmul(y:t()) end, { a, b }))
    end)

    it("with only one input requiring grad", function()
      local a, b = mk({ 3, 4 }, "f64", 1, true), mk({ 4, 2 }, "f64", 2)
      assert.is_true(gc.check(function(x, y) return x:matmul(y) end, { a, b }))
      assert.is_nil(b.grad)
    end)

    it("gives bf16 gradients for bf16 inputs", function()
      local a, b = mk({ 2, 3 }, "bf16", 1, true), mk({ 3, 2 }, "bf16", 2, true)
      a:matmul(b):sum():backward()
      assert.are.equal("bf16", a.grad.dtype)
      assert.are.same({ 2, 3 }, a.grad:shape())
      local exp = ref_matmul({ 1, 1, 1, 1 }, { 2, 2 }, b:t():contiguous():tolist_flat(), { 2, 3 })
      close(a.grad, exp, 1e-2)
    end)
  end)

  describe("errors", function()
    it("names both layouts and the inner dims", function()
      local ok, err = pcall(function() return engine.zeros(8, 64):matmul(engine.zeros(32, 16)) end)
      assert.is_false(ok)
      assert.matches("matmul: f32%[8,64%] x f32%[32,16%]: inner dims 64 and 32 differ", err)
      assert.matches("matmul_spec.lua", err)
      assert.has_error(function() engine.zeros(3):matmul(engine.zeros(4)) end,
        "matmul: f32[3] x f32[4]: inner dims 3 and 4 differ")
    end)

    it("rejects batch dims that do not broadcast", function()
      assert.has_error(function() engine.zeros(2, 3, 4):matmul(engine.zeros(5, 4, 6)) end,
        "matmul: f32[2,3,4] x f32[5,4,6]: batch dims [2] and [5] do not broadcast")
    end)

    it("rejects 0-d operands, mixed dtypes, bool and non-tensors", function()
      assert.has_error(function() engine.tensor(2.0):matmul(engine.zeros(2)) end)
      local ok, err = pcall(engine.matmul, engine.zeros(2, 2), engine.zeros(2, 2, { dtype = "f64" }))
      assert.is_false(ok)
      assert.matches("dtypes differ", err)
      assert.has_error(function() engine.ones(2, 2, { dtype = "bool" }):matmul(engine.ones(2, 2, { dtype = "bool" })) end)
      assert.has_error(function() engine.matmul(engine.zeros(2, 2), 3) end,
        "matmul: argument 2 must be a tensor, got number")
    end)
  end)
end)

describe("linear", function()
  local x = engine.tensor({ { 1, 2, 3 }, { -1, 0, 1 } }, "f32")
  local w = engine.tensor({ { 1, 0, 0 }, { 0, 1, 1 }, { 1, 1, 1 }, { 0, 0, -2 } }, "f32")
  local b = engine.tensor({ 0.5, -1, 0, 2 }, "f32")

  it("computes x @ w^T + b (hand-computed)", function()
    assert.are.same({ { 1.5, 4, 6, -4 }, { -0.5, 0, 0, 0 } }, engine.linear(x, w, b):totable())
    assert.are.same({ { 1, 5, 6, -6 }, { -1, 1, 0, -2 } }, engine.linear(x, w):totable())
  end)

  it("takes any leading dims and 1-D input", function()
    local x3 = mk({ 2, 3, 5 }, "f32", 1)
    local w3, b3 = mk({ 4, 5 }, "f32", 2), mk({ 4 }, "f32", 3)
    local y = engine.linear(x3, w3, b3)
    assert.are.same({ 2, 3, 4 }, y:shape())
    close(y, (x3:matmul(w3:t()) + b3):tolist_flat())
    local y1 = engine.linear(mk({ 5 }, "f32", 4), w3, b3)
    assert.are.same({ 4 }, y1:shape())
    close(y1, (mk({ 5 }, "f32", 4):matmul(w3:t()) + b3):tolist_flat())
    -- non-contiguous input and weight
    local xt = mk({ 5, 3 }, "f32", 5):t()
    local wt = mk({ 5, 4 }, "f32", 6):t()
    close(engine.linear(xt, wt, b3), (xt:matmul(wt:t()) + b3):tolist_flat())
  end)

  it("works in f64 and bf16", function()
    local y = engine.linear(x:double(), w:double(), b:double())
    assert.are.equal("f64", y.dtype)
    assert.are.same({ { 1.5, 4, 6, -4 }, { -0.5, 0, 0, 0 } }, y:totable())
    local yb = engine.linear(x:bfloat16(), w:bfloat16(), b:bfloat16())
    assert.are.equal("bf16", yb.dtype)
    assert.are.same({ { 1.5, 4, 6, -4 }, { -0.5, 0, 0, 0 } }, yb:totable())
  end)

  it("gradients match finite differences", function()
    local xs, ws, bs = mk({ 2, 3, 5 }, "f64", 1, true), mk({ 4, 5 }, "f64", 2, true), mk({ 4 }, "f64", 3, true)
    assert.is_true(gc.check(function(a, c, d) return engine.linear(a, c, d) end, { xs, ws, bs }))
    assert.is_true(gc.check(function(a, c) return engine.linear(a, c) end, { mk({ 3, 5 }, "f64", 4, true), ws }))
    assert.is_true(gc.check(function(a, c, d) return engine.linear(a, c, d) end,
      { mk({ 5 }, "f64", 5, true), ws, bs }))
    local xt = mk({ 5, 3 }, "f64", 6, true)
    assert.is_true(gc.check(function(a, c, d) return engine.linear(a:t(), c, d) end, { xt, ws, bs }))
  end)

  it("accumulates the weight gradient over all rows in one pass", function()
    local xs = mk({ 2, 3, 5 }, "f64", 1)
    local ws = mk({ 4, 5 }, "f64", 2, true)
    local bs = mk({ 4 }, "f64", 3, true)
    engine.linear(xs, ws, bs):sum():backward()
    -- d/dw sum = sum over rows of x; d/db = number of rows
    local colsum = xs:view(6, 5):sum(1):tolist_flat()
    for o = 1, 4 do
      for i = 1, 5 do assert.is_true(math.abs(ws.grad:get(o, i) - colsum[i]) < 1e-12) end
      assert.are.equal(6, bs.grad:get(o))
    end
  end)

  it("reports bad shapes", function()
    assert.has_error(function() engine.linear(engine.zeros(2, 3), engine.zeros(4, 5)) end,
      "linear: input f32[2,3] and weight f32[4,5]: in_features 3 and 5 differ")
    assert.has_error(function() engine.linear(engine.zeros(2, 3), engine.zeros(4, 3), engine.zeros(3)) end,
      "linear: bias f32[3] must be [4] for weight f32[4,3]")
    assert.has_error(function() engine.linear(engine.zeros(2, 3), engine.zeros(3)) end,
      "linear: weight f32[3] must be 2-D [out_features, in_features]")
    assert.has_error(function() engine.linear(engine.zeros(2, 3), engine.zeros(4, 3, { dtype = "f64" })) end)
    assert.has_error(function() engine.linear(engine.zeros(2, 3), "w") end,
      "linear: argument 2 must be a tensor, got string")
  end)
end)
