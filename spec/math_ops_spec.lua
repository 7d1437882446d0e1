-- Pointwise math, reductions, scans and sorting (torch's ops of those names)
-- (engine/src/ops/math.c, reduce2.c, sort.c): PyTorch reference values for
-- the tricky cases (spec/fixtures/math_ops.lua from tools/gen_math_fixtures.py:
-- round half to even, fmod/remainder/floor_divide signs, var correction,
-- sort/topk/kthvalue ties and NaN, ...), float64 finite-difference gradients,
-- dtypes and errors.
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local gc = require("spec.helpers.gradcheck")
local FIX = dofile("spec/fixtures/math_ops.lua")

local function flatten(v, out)
  out = out or {}
  if type(v) == "table" then for _, x in ipairs(v) do flatten(x, out) end else out[#out + 1] = v end
  return out
end

local function same(a, e, tol, msg)
  if e ~= e then assert(a ~= a, string.format("%s: expected nan, got %s", msg, tostring(a))); return end
  if e == math.huge or e == -math.huge then assert(a == e, string.format("%s: expected %s, got %s", msg, e, a)); return end
  local err = math.abs(a - e) / math.max(1, math.abs(e))
  assert(err <= tol, string.format("%s: expected %.17g, got %.17g", msg, e, a))
end

local function assert_vals(t, expected, tol, msg)
  local v, e = t:tolist_flat(), flatten(expected)
  assert(#v == #e, string.format("%s: %d elements, expected %d", msg, #v, #e))
  for i = 1, #e do same(v[i], e[i], tol or 1e-12, msg .. " element " .. i) end
end

local function T(v, dt) return engine.tensor(v, dt or "f64") end

local function by_op(name)
  local r = {}
  for _, c in ipairs(FIX) do if c.op == name then r[#r + 1] = c end end
  assert(#r > 0, "no fixture case " .. name)
  return r
end

describe("pointwise math vs PyTorch", function()
  it("round (half to even, decimals), sign, floor/ceil/trunc and the float functions", function()
    for _, c in ipairs(by_op("round")) do
      assert_vals(T(c.x):round(c.decimals), c.out, 1e-15, "round decimals=" .. tostring(c.decimals))
    end
    assert_vals(T(by_op("sign")[1].x):sign(), by_op("sign")[1].out, 0, "sign")
    for _, f in ipairs({ "sin", "cos", "floor", "ceil", "trunc", "erf", "log1p", "expm1", "reciprocal", "square" }) do
      local c = by_op(f)[1]
      assert_vals(T(c.x)[f](T(c.x)), c.out, 1e-15, f)
      assert_vals(engine[f](T(c.x, "f32")), c.out, 3e-7, f .. " f32")
    end
  end)
  it("round keeps half to even in f32 and bf16, and integer tensors unchanged", function()
    assert_vals(T({ -2.5, -1.5, -0.5, 0.5, 1.5, 2.5 }, "f32"):round(), { -2, -2, -0, 0, 2, 2 }, 0, "round f32")
    assert_vals(T({ -2.5, 0.5, 1.5, 2.5 }, "bf16"):round(), { -2, 0, 2, 2 }, 0, "round bf16")
    local i = T({ -3, 4, 7 }, "i64")
    for _, f in ipairs({ "round", "floor", "ceil", "trunc", "sign", "square" }) do
      local r = i[f](i)
      assert.are.equal("i64", r.dtype, f)
    end
    assert_vals(i:sign(), { -1, 1, 1 }, 0, "sign i64")
    assert_vals(i:square(), { 9, 16, 49 }, 0, "square i64")
    assert.are.equal("f32", i:sin().dtype)
    assert.are.equal("bf16", T({ 1 }, "bf16"):sin().dtype)
  end)
  it("nan_to_num defaults and explicit values (f64 and f32 limits)", function()
    local c = by_op("nan_to_num")
    assert_vals(T(c[1].x):nan_to_num(), c[1].out, 0, "nan_to_num f64")
    assert_vals(T(c[2].x):nan_to_num(c[2].nan, c[2].posinf, c[2].neginf), c[2].out, 0, "nan_to_num values")
    assert_vals(T(c[2].x):nan_to_num{ nan = c[2].nan, posinf = c[2].posinf, neginf = c[2].neginf }, c[2].out, 0, "nan_to_num table")
    local f = by_op("nan_to_num_f32")[1]
    assert_vals(T(f.x, "f32"):nan_to_num(), f.out, 0, "nan_to_num f32")
  end)
  it("fmod, remainder, floor_divide: signs, zero divisors, infinities (float and integer)", function()
    for _, f in ipairs({ "fmod", "remainder", "floor_divide" }) do
      local c = by_op(f)[1]
      assert_vals(T(c.a)[f](T(c.a), T(c.b)), c.out, 0, f)
      local ci = by_op(f .. "_int")[1]
      local r = engine[f](T(ci.a, "i64"), T(ci.b, "i64"))
      assert.are.equal("i64", r.dtype)
      assert_vals(r, ci.out, 0, f .. " int")
      assert_vals(engine[f](T(ci.a, "i32"), T(ci.b, "i32")), ci.out, 0, f .. " i32")
    end
  end)
  it("binary ops broadcast, take numbers, and promote like PyTorch", function()
    local a = T({ { 5, -5 }, { 7, -7 } })
    assert_vals(a:fmod(3), { 2, -2, 1, -1 }, 0, "fmod scalar")
    assert_vals(a:remainder(T({ 3, -3 })), { 2, -2, 1, -1 }, 0, "remainder broadcast")
    assert_vals(engine.remainder(-5, T({ 3 })), { 1 }, 0, "remainder number first")
    local i = T({ 5, -5 }, "i64")
    assert.are.equal("i64", i:fmod(3).dtype)
    assert.are.equal("f32", i:fmod(2.5).dtype)
    assert_vals(i:fmod(2.5), { 0, -0 }, 0, "int fmod float")
  end)
  it("logical ops, predicates", function()
    local a, b = T({ 0, 1, 2, 0 / 0 }), T({ 0, 0, -1, 1 })
    assert_vals(a:logical_and(b), { 0, 0, 1, 1 }, 0, "and")
    assert_vals(a:logical_or(b), { 0, 1, 1, 1 }, 0, "or")
    assert_vals(a:logical_not(), { 1, 0, 0, 0 }, 0, "not")
    assert.are.equal("bool", a:logical_and(true).dtype)
    local x = T({ 1, 0 / 0, 1 / 0, -1 / 0 })
    assert_vals(x:isnan(), { 0, 1, 0, 0 }, 0, "isnan")
    assert_vals(x:isinf(), { 0, 0, 1, 1 }, 0, "isinf")
    assert_vals(x:isfinite(), { 1, 0, 0, 0 }, 0, "isfinite")
    assert_vals(T({ 1, 2 }, "i64"):isnan(), { 0, 0 }, 0, "isnan int")
    assert_vals(T({ 1, 2 }, "i64"):isfinite(), { 1, 1 }, 0, "isfinite int")
  end)
  it("clamp with tensor bounds, lerp, addcmul, addcdiv", function()
    local x = T({ -2, 0.5, 3, 0 / 0 })
    assert_vals(x:clamp(T({ -1, 1, -1, 0 }), T({ 1 })), { -1, 1, 1, 0 / 0 }, 0, "clamp tensors")
    assert_vals(x:clamp(nil, T({ 0 })), { -2, 0, 0, 0 / 0 }, 0, "clamp max only")
    assert_vals(x:clamp({ min = T({ 0 }) }), { 0, 0.5, 3, 0 / 0 }, 0, "clamp{min}")
    assert_vals(x:clamp(0, 1), { 0, 0.5, 1, 0 / 0 }, 0, "clamp numbers still")
    local a, b = T({ 1, 2 }), T({ 3, 6 })
    assert_vals(a:lerp(b, 0.25), { 1.5, 3 }, 1e-15, "lerp number")
    assert_vals(a:lerp(b, T({ 0, 1 })), { 1, 6 }, 1e-15, "lerp tensor")
    for _, c in ipairs(by_op("lerp_f32")) do -- PyTorch's two formulas; its CPU kernel fuses them (fma): 1 ulp
      assert_vals(T(c.a, "f32"):lerp(T(c.b, "f32"), c.w), c.out, 1.2e-7, "lerp f32 w=" .. c.w)
    end
    assert_vals(a:addcmul(b, T({ 2, 2 }), 0.5), { 4, 8 }, 1e-15, "addcmul")
    assert_vals(a:addcdiv(b, T({ 2, 3 }), { value = 2 }), { 4, 6 }, 1e-15, "addcdiv")
    assert_vals(engine.addcmul(a, b, b), { 10, 38 }, 1e-15, "addcmul default value")
  end)
end)

describe("reductions vs PyTorch", function()
  it("var/std with correction 0, 1, 2 and a divisor <= 0", function()
    for _, op in ipairs({ "var", "std" }) do
      for _, c in ipairs(by_op(op)) do
        local x = T(c.x)
        local r = c.dim and x[op](x, c.dim, { correction = c.correction }) or x[op](x, nil, { correction = c.correction })
        assert_vals(r, c.out, 1e-14, op .. " correction " .. c.correction)
      end
    end
    local x = T({ { 1, 2, 4 }, { 0, 3, 3 } })
    assert_vals(x:var(2, false), x:var(2, { correction = 0 }):tolist_flat(), 0, "var unbiased=false")
    assert.are.same({ 2, 1 }, x:std(2, { keepdim = true }):shape())
    assert.are.same({ 1, 1 }, x:var({ 1, 2 }, { keepdim = true }):shape())
  end)
  it("logsumexp with infinities, norms of every ord, prod, cumsum, cumprod, amax/amin with NaN", function()
    local c = by_op("logsumexp")[1]
    assert_vals(T(c.x):logsumexp(c.dim), c.out, 1e-14, "logsumexp")
    for _, n in ipairs(by_op("norm")) do
      assert_vals(engine.linalg.vector_norm(T(n.x), n.ord, n.dim), n.out, 1e-14, "vector_norm ord " .. tostring(n.ord))
      assert_vals(T(n.x):norm(n.ord, n.dim), n.out, 1e-14, "norm p " .. tostring(n.ord))
    end
    for _, op in ipairs({ "prod", "cumsum", "cumprod", "amax", "amin" }) do
      local k = by_op(op)[1]
      assert_vals(T(k.x)[op](T(k.x), k.dim), k.out, 1e-15, op)
    end
  end)
  it("dims lists, keepdim, dtypes", function()
    local x = T({ { { 1, 2 }, { 3, 4 } }, { { 5, 6 }, { 7, 8 } } })
    assert_vals(x:amax({ 1, 3 }), { 6, 8 }, 0, "amax dims")
    assert.are.same({ 1, 2, 1 }, x:amin({ 1, -1 }, true):shape())
    assert_vals(x:prod(), { 40320 }, 0, "prod all")
    assert_vals(x:prod(2, true), { 3, 8, 35, 48 }, 0, "prod dim keepdim")
    assert.are.same({ 2, 1, 2 }, x:prod(2, true):shape())
    local i = T({ { 1, 2, 3 }, { 4, 5, 6 } }, "i32")
    assert.are.equal("i64", i:prod(2).dtype)
    assert_vals(i:prod(2), { 6, 120 }, 0, "prod int")
    assert.are.equal("i64", i:cumsum(2).dtype)
    assert_vals(i:cumprod(2), { 1, 2, 6, 4, 20, 120 }, 0, "cumprod int")
    assert.are.equal("i32", i:amax(2).dtype)
    assert_vals(T({ { 0, 1 }, { 1, 1 } }):all(2), { 0, 1 }, 0, "all")
    assert_vals(T({ { 0, 0 }, { 0, 2 } }):any(1), { 0, 1 }, 0, "any")
    assert.are.equal("bool", i:all().dtype)
    assert_vals(T({ 1.5, 2.5, 3.5 }, "bf16"):logsumexp(1), { 3.9076059644443806 }, 0.01, "logsumexp bf16")
    assert.are.equal("bf16", T({ 1, 2 }, "bf16"):var().dtype)
    assert_vals(T({ 1, 2, 3, 4 }, "f32"):std(), { 1.2909944487358056 }, 1e-6, "std f32")
    assert_vals(i:logsumexp(2), { 3.4076059644443806, 6.4076059644443806 }, 1e-6, "logsumexp int -> f32")
  end)
  it("gradients match PyTorch (prod and cumprod with zeros, amax ties, norm at zero, sort/topk/kthvalue, fmod)", function()
    for _, c in ipairs(FIX) do
      local op = c.op:match("^(.-)_grad$")
      if op then
        local x = T(c.x):requires_grad_()
        local y
        if op == "norm" then y = engine.linalg.vector_norm(x, c.ord, c.dim)
        elseif op == "topk" then y = x:topk(c.k, c.dim)
        elseif op == "kthvalue" then y = x:kthvalue(c.k, c.dim)
        elseif op == "fmod" or op == "remainder" then y = T({ 9, 9, -9 })[op](T({ 9, 9, -9 }), x)
        else y = x[op](x, c.dim) end
        if op == "sort" then y = x:sort(c.dim) end
        local w = engine.arange(1, y:numel() + 1):double():view(y:shape())
        ;(y * w):sum():backward()
        assert_vals(x.grad, c.grad, 1e-13, "grad of " .. op .. (c.ord and (" ord " .. tostring(c.ord)) or ""))
      end
    end
  end)
end)

describe("sorting vs PyTorch (ties and NaN)", function()
  it("sort and argsort are stable, NaN last ascending and first descending", function()
    for _, name in ipairs({ "sort", "sort_default", "sort_int" }) do
      for _, c in ipairs(by_op(name)) do
        local x = T(c.x, name == "sort_int" and "i64" or "f64")
        local v, i = x:sort(2, c.descending)
        assert_vals(v, c.out, 0, name .. " values desc=" .. tostring(c.descending))
        assert_vals(i, c.idx, 0, name .. " indices desc=" .. tostring(c.descending))
      end
    end
    for _, c in ipairs(by_op("argsort")) do
      assert_vals(T(c.x):argsort(2, c.descending), c.idx, 0, "argsort desc=" .. tostring(c.descending))
    end
  end)
  it("topk and kthvalue pick the same elements, in the same order, as PyTorch", function()
    for _, name in ipairs({ "topk", "topk_int" }) do
      for _, c in ipairs(by_op(name)) do
        local x = T(c.x, name == "topk_int" and "i64" or "f64")
        local v, i = x:topk(c.k, 2, c.largest)
        local m = string.format("%s k=%d largest=%s", name, c.k, tostring(c.largest))
        assert_vals(v, c.out, 0, m .. " values")
        assert_vals(i, c.idx, 0, m .. " indices")
      end
    end
    for _, c in ipairs(by_op("topk_unsorted")) do
      local v, i = T(c.x):topk(c.k, 2, c.largest, false)
      local m = string.format("topk sorted=false k=%d largest=%s", c.k, tostring(c.largest))
      assert_vals(v, c.out, 0, m .. " values")
      assert_vals(i, c.idx, 0, m .. " indices")
    end
    for _, name in ipairs({ "kthvalue", "kthvalue_int" }) do
      for _, c in ipairs(by_op(name)) do
        local x = T(c.x, name == "kthvalue_int" and "i64" or "f64")
        local v, i = x:kthvalue(c.k, 2)
        assert_vals(v, c.out, 0, name .. " k=" .. c.k .. " values")
        assert_vals(i, c.idx, 0, name .. " k=" .. c.k .. " indices")
      end
    end
  end)
  it("topk on long rows (partial sort path), kthvalue keepdim, other dims, f32/bf16", function()
    local n = 200
    local vals = {}
    for j = 1, n do vals[j] = (j * 37) % 23 end
    local x = T({ vals })
    local v, i = x:topk(3)
    assert_vals(v, { 22, 22, 22 }, 0, "topk long values")
    local idx = i:tolist_flat()
    for _, p in ipairs(idx) do assert.are.equal(22, vals[p + 1]) end
    local y = T({ { 3, 1 }, { 1, 2 }, { 2, 0 } }, "f32")
    local kv, ki = y:kthvalue(2, 1, true)
    assert.are.same({ 1, 2 }, kv:shape())
    assert_vals(kv, { 2, 1 }, 0, "kthvalue dim 1")
    assert_vals(ki, { 2, 0 }, 0, "kthvalue dim 1 indices")
    local sv = T({ 3, 1, 2 }, "bf16"):sort(1, true)
    assert.are.equal("bf16", sv.dtype)
    assert_vals(sv, { 3, 2, 1 }, 0, "sort bf16")
    local cs = T({ { 1, 2 }, { 3, 4 } }, "f32"):cumsum(1)
    assert_vals(cs, { 1, 2, 4, 6 }, 0, "cumsum dim 1")
  end)
end)

-- bf16 values: each op on bf16 inputs equals the op computed in f64 on the same (bf16-exact) values and
-- then rounded to bf16, within one bf16 ulp (PyTorch computes bf16 in f32 and rounds once; f32 and f64
-- can round a tie differently).  Rows of 40 so the reductions and scans accumulate.
describe("bf16 values vs f64 rounded", function()
  local ULP = 2 ^ -8   -- bf16 has 8 significant bits: one ulp is at most |x| * 2^-7, half that to nearest
  local function close(r, inputs, f, name)
    local d = {}
    for i, t in ipairs(inputs) do d[i] = t:double() end
    local ref = f(unpack(d))
    local want = ref.dtype == "f64" and ref:bfloat16():double() or ref:double()
    if ref.dtype == "f64" then assert.are.equal("bf16", r.dtype, name) end
    assert.are.same(want:shape(), r:shape(), name)
    local got = r:double()
    local nan_ok = got:isnan():eq(want:isnan()):all():item()
    assert(nan_ok, name .. ": NaN positions differ")
    local ok = want:isnan():logical_not()
    local err = (got - want):abs():masked_select(ok)
    local bound = (want:abs() * (2 * ULP) + 1e-30):masked_select(ok)
    local worst = (err - bound):max():item()
    assert(err:numel() == 0 or worst <= 0, string.format("%s: off by more than one bf16 ulp (max error %g)", name, err:max():item()))
  end
  local function bf(t) return t:bfloat16() end
  engine.manual_seed(21)
  local x = bf(engine.randn(6, 40, { dtype = "f64" }) * 2)
  local y = bf(engine.randn(6, 40, { dtype = "f64" }) * 2)
  local pos = bf(engine.randn(6, 40, { dtype = "f64" }):abs() + 0.5)
  local near1 = bf(engine.rand(6, 40, { dtype = "f64" }) * 0.2 + 0.9)   -- prod / cumprod stay in range
  local lo, hi = bf(engine.randn(6, 1, { dtype = "f64" }) - 0.5), bf(engine.randn(40, { dtype = "f64" }) + 0.5)
  local w = bf(engine.rand(40, { dtype = "f64" }))
  local special = x:clone()
  special[1][1], special[2][3], special[3][5] = 0 / 0, 1 / 0, -1 / 0

  it("pointwise math", function()
    local unary = {
      sin = function(a) return a:sin() end, cos = function(a) return a:cos() end,
      erf = function(a) return a:erf() end, expm1 = function(a) return a:expm1() end,
      square = function(a) return a:square() end, floor = function(a) return a:floor() end,
      ceil = function(a) return a:ceil() end, round = function(a) return a:round() end,
      round1 = function(a) return a:round(1) end, trunc = function(a) return a:trunc() end,
      sign = function(a) return a:sign() end,
    }
    for name, f in pairs(unary) do close(f(x), { x }, f, name) end
    close(pos:log1p(), { pos }, function(a) return a:log1p() end, "log1p")
    close(pos:reciprocal(), { pos }, function(a) return a:reciprocal() end, "reciprocal")
    local nn = function(a) return a:nan_to_num(0.5, 7, -7) end
    close(nn(special), { special }, nn, "nan_to_num")
    local pred = function(a) return a:isnan():logical_or(a:isinf()):logical_and(a:isfinite():logical_not()) end
    close(pred(special), { special }, pred, "isnan/isinf/isfinite/logical ops")
    for name, f in pairs({ fmod = function(a, b) return a:fmod(b) end, remainder = function(a, b) return a:remainder(b) end,
                           floor_divide = function(a, b) return a:floor_divide(b) end }) do
      close(f(x, pos), { x, pos }, f, name)
    end
    local cl = function(a, l, h) return a:clamp(l, h) end
    close(cl(x, lo, hi), { x, lo, hi }, cl, "clamp tensors")
    local lt = function(a, b, ww) return a:lerp(b, ww) end
    close(lt(x, y, w), { x, y, w }, lt, "lerp tensor")
    for _, wn in ipairs({ 0.3, 0.7 }) do
      local ln = function(a, b) return a:lerp(b, wn) end
      close(ln(x, y), { x, y }, ln, "lerp " .. wn)
    end
    local am = function(a, b, c) return a:addcmul(b, c, 0.5) end
    close(am(x, y, pos), { x, y, pos }, am, "addcmul")
    local ad = function(a, b, c) return a:addcdiv(b, c, 2) end
    close(ad(x, y, pos), { x, y, pos }, ad, "addcdiv")
  end)

  it("reductions, scans and selections", function()
    local vn = engine.linalg.vector_norm
    local red = {
      amax = function(a) return a:amax(2) end, amin = function(a) return a:amin({ 1, 2 }) end,
      logsumexp = function(a) return a:logsumexp(2) end, var = function(a) return a:var(2) end,
      std = function(a) return a:std(1, { correction = 0, keepdim = true }) end,
      norm1 = function(a) return vn(a, 1, 2) end, norm2 = function(a) return vn(a, 2, 2) end,
      norminf = function(a) return vn(a, math.huge, 2) end, norm3 = function(a) return vn(a, 3, 2) end,
      norm_all = function(a) return a:norm() end, cumsum = function(a) return a:cumsum(2) end,
      sort = function(a) return (a:sort(2)) end, sort_desc = function(a) return (a:sort(1, true)) end,
      topk = function(a) return (a:topk(5, 2)) end, kthvalue = function(a) return (a:kthvalue(7, 2)) end,
      argsort = function(a) return a:argsort(2) end, all = function(a) return a:gt(-3):all(2) end,
      any = function(a) return a:gt(3):any(1) end,
    }
    for name, f in pairs(red) do close(f(x), { x }, f, name) end
    for name, f in pairs({ prod = function(a) return a:prod(2) end, cumprod = function(a) return a:cumprod(2) end }) do
      close(f(near1), { near1 }, f, name)
    end
  end)
end)

describe("float64 finite-difference gradients", function()
  local function r(...) engine.manual_seed(7); return engine.randn(...):double() end
  it("unary and binary pointwise ops", function()
    local x = r(3, 4):requires_grad_()
    for _, f in ipairs({ "sin", "cos", "erf", "expm1", "square", "nan_to_num" }) do
      gc.check(function(a) return a[f](a) end, { x })
    end
    local p = (r(3, 4):abs() + 0.5):requires_grad_()
    gc.check(function(a) return a:log1p() end, { p })
    gc.check(function(a) return a:reciprocal() end, { p })
    local a = (r(3, 4) * 3):requires_grad_()
    local b = (r(4):abs() + 0.7):requires_grad_()
    gc.check(function(u, v) return u:fmod(v) end, { a, b })
    gc.check(function(u, v) return u:remainder(v) end, { a, b })
    local lo, hi = (r(3, 1) - 0.5):requires_grad_(), (r(4) + 0.5):requires_grad_()
    gc.check(function(u, l, h) return u:clamp(l, h) end, { x, lo, hi })
    local w = r(3, 4):requires_grad_()
    gc.check(function(u, v, ww) return u:lerp(v, ww) end, { x, a, w })
    gc.check(function(u, v) return u:lerp(v, 0.3) end, { x, a })
    gc.check(function(u, v) return u:lerp(v, 0.75) end, { x, a })
    gc.check(function(u, v, c) return u:addcmul(v, c, 0.5) end, { x, a, w })
    gc.check(function(u, v, c) return u:addcdiv(v, c, -2) end, { x, a, p })
  end)
  it("floor, ceil, round, trunc, sign have zero gradients", function()
    local x = r(5):requires_grad_()
    for _, f in ipairs({ "floor", "ceil", "round", "trunc", "sign" }) do
      x.grad = nil
      x[f](x):sum():backward()
      assert_vals(x.grad, { 0, 0, 0, 0, 0 }, 0, f .. " grad")
    end
  end)
  it("reductions over dims with keepdim", function()
    local x = r(3, 4, 2):requires_grad_()
    gc.check(function(a) return a:prod(2) end, { x })
    gc.check(function(a) return a:prod() end, { x })
    gc.check(function(a) return a:amax({ 1, 3 }) end, { x })
    gc.check(function(a) return a:amin(2, true) end, { x })
    gc.check(function(a) return a:logsumexp({ 2, 3 }) end, { x })
    gc.check(function(a) return a:var(2, { correction = 0 }) end, { x })
    gc.check(function(a) return a:var({ 1, 3 }, { keepdim = true }) end, { x })
    gc.check(function(a) return a:std(3) end, { x })
    gc.check(function(a) return a:std() end, { x })
    for _, o in ipairs({ 1, 2, 3, 0.5, math.huge, -math.huge }) do
      gc.check(function(a) return engine.linalg.vector_norm(a, o, { 2, 3 }) end, { x })
    end
    gc.check(function(a) return a:norm() end, { x })
  end)
  it("scans and selections", function()
    local x = r(3, 5):requires_grad_()
    gc.check(function(a) return a:cumsum(2) end, { x })
    gc.check(function(a) return a:cumsum(1) end, { x })
    gc.check(function(a) return a:cumprod(2) end, { x })
    gc.check(function(a) return (a:sort(2, true)) end, { x })
    gc.check(function(a) return (a:topk(2, 1)) end, { x })
    gc.check(function(a) return (a:topk(3, 2, false)) end, { x })
    gc.check(function(a) return (a:kthvalue(2, 2)) end, { x })
    gc.check(function(a) return (a:kthvalue(3, 1, true)) end, { x })
    local c = T({ { 2, 2, 2 }, { 1, 2, 4 } }):requires_grad_()
    c:std(2):sum():backward()
    local g = c.grad:tolist_flat()
    for j = 1, 3 do assert.are.equal(0, g[j]) end -- PyTorch: 0 (not NaN) where the std is 0
    assert(g[4] == g[4] and g[4] ~= 0)
    local z = T({ { 1, 0, 2, 3 }, { 0, 0, 1, 2 } }):requires_grad_()
    gc.check(function(a) return a:cumprod(2) end, { z })
    gc.check(function(a) return a:prod(2) end, { z })
  end)
end)

describe("meta tensors", function()
  it("give shapes and dtypes without data", function()
    local m = engine.empty({ 3, 4 }, { device = "meta" })
    local function sd(t) return table.concat(t:shape(), "x") .. " " .. t.dtype .. " " .. t.device end
    assert.are.equal("3x4 bool meta", sd(m:isnan()))
    assert.are.equal("3x4 f32 meta", sd(m:fmod(m)))
    assert.are.equal("1x4 f32 meta", sd(m:var(1, { keepdim = true })))
    assert.are.equal("3 f32 meta", sd(m:logsumexp(2)))
    local v, i = m:topk(2, 2)
    assert.are.equal("3x2 f32 meta", sd(v))
    assert.are.equal("3x2 i64 meta", sd(i))
    v, i = m:kthvalue(2, 1)
    assert.are.equal("4 f32 meta", sd(v))
    assert.are.equal("4 i64 meta", sd(i))
    assert.are.equal("3x4 i64 meta", sd(m:argsort(2)))
    assert.are.equal("3x4 i64 meta", sd(engine.empty({ 3, 4 }, { device = "meta", dtype = "i32" }):cumsum(2)))
    assert.has_error(function() return m:topk(5, 2) end)
  end)
end)

describe("errors", function()
  local function err(f, pat)
    local ok, e = pcall(f)
    assert(not ok, "expected an error matching " .. pat)
    assert(tostring(e):find(pat, 1, true), "error '" .. tostring(e) .. "' does not contain '" .. pat .. "'")
  end
  it("name the op, the tensors and the problem", function()
    local x = T({ { 1, 2 }, { 3, 4 } })
    err(function() return x:topk(3) end, "topk: k = 3 is out of range for dim 2 of f64[2,2]")
    err(function() return x:kthvalue(0) end, "kthvalue: k = 0 is out of range")
    err(function() return x:cumsum() end, "cumsum: dim is required")
    err(function() return x:cumsum(0) end, "dims are 1-based")
    err(function() return x:amax(3) end, "amax: dim 3 out of range")
    err(function() return x:var({ 1, 1 }) end, "var: dim 1 appears more than once")
    err(function() return T({ 1, 2 }, "i64"):var() end, "var: only floating point tensors are supported, got i64[2]")
    err(function() return T({ 1, 2 }, "i64"):norm() end, "norm: expected a floating point tensor, got i64[2]")
    err(function() return T({ 1, 2 }, "i64"):fmod(T({ 1, 0 }, "i64")) end, "fmod: ZeroDivisionError")
    err(function() return T({ 1, 2 }, "i64"):floor_divide(0) end, "floor_divide: ZeroDivisionError")
    err(function() return x:fmod(T({ 1, 2, 3 })) end, "fmod")
    err(function() return T({ 1, 2 }, "bool"):remainder(T({ 1, 1 }, "bool")) end, "remainder: not supported for bool")
    err(function() return engine.zeros(2, 0):amax(2) end, "amax: f32[2,0]: the reduction over dim 2 is empty")
    err(function() return x:clamp(nil, nil) end, "clamp: at least one of min and max")
    err(function() return x:lerp(x, "a") end, "lerp: weight must be a number or a tensor")
    err(function() return x:round(0.5) end, "round: decimals must be an integer")
    err(function() return x:var(1, { correction = 1, unbiased = true }) end, "var: give correction or unbiased")
    err(function() return engine.linalg.vector_norm(x, "nuc") end, "linalg.vector_norm: ord must be a number")
  end)
end)

describe("CUDA tensors #gpu", function()
  -- The pointwise ops run on kernels/cuda/math.cu for floating inputs, the others through the host fallback
  -- (or the device ops the composites are made of): results and gradients equal the CPU ones, on the device.
  local available = engine.cuda.is_available()
  it("every op forward and backward equals the CPU", function()
    if not available then pending("no GPU: " .. engine.cuda.unavailable_reason()) return end
    engine.manual_seed(3)
    local x0 = engine.randn(3, 5):double()
    local b0 = engine.randn(5):double():abs() + 0.5
    local cases = {
      function(a) return a:sin() + a:cos() + a:erf() + a:expm1() + a:square() + a:floor() + a:round(1) end,
      function(a) return (a:abs() + 1):log1p() + (a:abs() + 1):reciprocal() + a:sign() + a:trunc() + a:ceil() end,
      function(a, b) return a:fmod(b) + a:remainder(b) + a:floor_divide(b) end,
      function(a, b) return a:clamp(b - 1, b) + a:lerp(b, 0.3) + a:addcmul(a, b, 0.5) + a:addcdiv(a, b) end,
      function(a) return a:prod(2) + a:amax(2) + a:amin(2) + a:logsumexp(2) + a:var(2) + a:std(2) end,
      function(a) return engine.linalg.vector_norm(a, 3, 2) + a:norm(2, 2) + a:norm(math.huge, 2) end,
      function(a) return a:cumsum(2) + a:cumprod(2) + (a:sort(2, true)) end,
      function(a) return (a:topk(2, 2)):sum(2) + (a:kthvalue(2, 2)) end,
    }
    for k, f in ipairs(cases) do
      for _, dt in ipairs({ "f64", "f32" }) do
        local xc, bc = x0:to(dt):detach():clone():requires_grad_(), b0:to(dt)
        local xg = x0:to(dt):detach():cuda():requires_grad_()
        local rc, rg = f(xc, bc), f(xg, bc:cuda())
        assert.are.equal("cuda", rg.device)
        local tol = dt == "f64" and 1e-10 or 1e-4
        assert((rg:cpu():double() - rc:double()):abs():max():item() <= tol, "case " .. k .. " " .. dt .. " forward")
        rc:sum():backward(); rg:sum():backward()
        assert.are.equal("cuda", xg.grad.device)
        assert((xg.grad:cpu():double() - xc.grad:double()):abs():max():item() <= tol, "case " .. k .. " " .. dt .. " grad")
      end
    end
    -- device kernels on strided and broadcast operands; integers through the host fallback
    local a = engine.randn(6, 5):double()
    local bb = engine.tensor({ 0.7, 1.1, -0.9, 2.0, 3.0 }):double()
    assert((a:t():cuda():sin():cpu() - a:t():sin()):abs():max():item() < 1e-14)
    assert((a:cuda():fmod(bb:cuda()):cpu() - a:fmod(bb)):abs():max():item() == 0)
    local ii = engine.tensor({ 7, -7, 5 }, "i64"):cuda()
    assert.are.same({ 1, 2, 2 }, ii:remainder(engine.tensor({ 3 }, "i64"):cuda()):cpu():tolist())
    assert.has_error(function() return ii:fmod(engine.tensor({ 0 }, "i64"):cuda()) end)
    assert.are.same({ false, true, false },
      engine.tensor({ 0, 1, 2 }, "i64"):cuda():logical_and(engine.tensor({ 1, 1, 0 }, "i32"):cuda()):cpu():tolist())
    local p = engine.tensor({ 1, 0 / 0 }):cuda()
    assert.are.same({ false, true }, p:isnan():cpu():tolist())
    -- 0-based indices, as the CPU and torch.argsort(descending=True) give
    assert.are.same({ 0, 2, 1 }, (engine.tensor({ 3, 1, 2 }):cuda():argsort(1, true)):cpu():tolist_flat())
  end)
end)
