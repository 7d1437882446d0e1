-- Sharding propagation of pointwise ops (unary, scalar forms, casts,
-- broadcasting binary ops, pow, comparisons, where, masked_fill): every input
-- layout on a 1-D mesh of the world and (4 ranks) a 2x2 mesh, even and uneven
-- sizes, forward and backward against the single-process result
-- (spec/dist/helpers/converter.lua).  Partial inputs: explicit cases.
local engine = require("engine")
local dist = engine.distributed
local conv = require("spec.dist.helpers.converter")

local R, W = dist.rank(), dist.world_size()
local S, Rep, Part = dist.Shard, dist.Replicate, dist.Partial
local mesh1 = conv.meshes("1d")[1]

local function randn(...) return engine.randn({ ... }, { dtype = "f64" }) end
local function diff(a, b) return (a:double() - b:double()):abs():max():item() end

-- even (multiple of 4 and 2) and uneven sizes
local SIZES = { { 4, 6 }, { 5, 3 } }

describe("sharding: unary and scalar ops", function()
  for _, sz in ipairs(SIZES) do
    local tag = string.format("[%d,%d]", sz[1], sz[2])
    it("neg/exp/tanh/sigmoid/relu/gelu/silu/abs/clamp " .. tag, function()
      engine.manual_seed(1)
      local x = randn(sz[1], sz[2])
      local xp = x:abs() + 0.5
      conv.check("neg", function(a) return a:neg() end, { x })
      conv.check("exp", function(a) return a:exp() end, { x })
      conv.check("tanh", function(a) return a:tanh() end, { x })
      conv.check("sigmoid", function(a) return a:sigmoid() end, { x })
      conv.check("relu", function(a) return a:relu() end, { x })
      conv.check("gelu", function(a) return a:gelu("tanh") end, { x })
      conv.check("silu", function(a) return a:silu() end, { x })
      conv.check("abs", function(a) return a:abs() end, { x })
      conv.check("clamp", function(a) return a:clamp(-0.5, 0.5) end, { x })
      conv.check("log/sqrt/rsqrt", function(a) return a:log() + a:sqrt() + a:rsqrt() end, { xp })
    end)
    it("scalar forms and casts " .. tag, function()
      engine.manual_seed(2)
      local x = randn(sz[1], sz[2]):abs() + 0.5
      conv.check("scalar forms", function(a) return ((a * 3 + 1) / 2 - 0.25) ^ 2 end, { x })
      conv.check("reverse scalar forms", function(a) return (1 - a) + 2 / a + engine.pow(2, a) end, { x })
      conv.check("cast", function(a) return a:float():double() * 2 end, { x }, { tol = 1e-6 })
      conv.check("compare scalar", function(a) return a:gt(1) end, { x })
    end)
  end
end)

describe("sharding: broadcasting binary ops", function()
  local shapes = {
    { { 4, 6 }, { 4, 6 } }, { { 5, 3 }, { 5, 3 } },   -- same shape, even / uneven
    { { 4, 6 }, { 6 } }, { { 5, 3 }, { 1, 3 } },       -- broadcast a row
    { { 5, 1 }, { 1, 3 } },                            -- outer broadcast
    { { 2, 5, 3 }, { 5, 1 } },
  }
  for _, pair in ipairs(shapes) do
    local sa, sb = pair[1], pair[2]
    local tag = string.format("[%s] with [%s]", table.concat(sa, ","), table.concat(sb, ","))
    it("add/sub/mul/div " .. tag, function()
      engine.manual_seed(3)
      local a = engine.randn(sa, { dtype = "f64" })
      local b = engine.randn(sb, { dtype = "f64" }):abs() + 0.5
      conv.check("add", function(x, y) return x + y end, { a, b })
      conv.check("sub", function(x, y) return x - y end, { a, b })
      conv.check("mul", function(x, y) return x * y end, { a, b })
      conv.check("div", function(x, y) return x / y end, { a, b })
    end)
    it("pow/maximum/minimum/comparisons/where/masked_fill " .. tag, function()
      engine.manual_seed(4)
      local a = engine.randn(sa, { dtype = "f64" }):abs() + 0.5
      local b = engine.randn(sb, { dtype = "f64" })
      conv.check("pow", function(x, y) return x ^ y end, { a, b })
      conv.check("maximum", function(x, y) return engine.maximum(x, y) end, { a - 1, b })
      conv.check("minimum", function(x, y) return engine.minimum(x, y) end, { a - 1, b })
      conv.check("lt", function(x, y) return x:lt(y) end, { a - 1, b })
      local cond = (a - 1):gt(0)
      conv.check("where", function(c, x, y) return engine.where(c, x, y) end, { cond, a, b }, { max_cases = 40 })
      if not (sa[1] == 5 and sa[2] == 1) then -- the mask must broadcast to the tensor
        conv.check("masked_fill", function(x, m) return x:masked_fill(m, 7) end, { a, b:gt(0) })
      end
    end)
  end
  it("a 0-d plain tensor next to a DTensor is Replicate; its gradient is summed over the mesh", function()
    engine.manual_seed(5)
    local x = randn(5, 3)
    local s = engine.tensor(2.5, "f64")
    s.requires_grad = true
    local d = dist.distribute_tensor(x, mesh1, { S(1) })
    d.requires_grad = true
    local out = d * s
    assert.same({ S(1) }, out.placements)
    out:sum():backward()
    assert.is_true(diff(d.grad:full_tensor(), engine.full({ 5, 3 }, 2.5, "f64")) < 1e-12)
    assert.is_true(math.abs(s.grad:item() - x:sum():item()) < 1e-9)
  end)
end)

describe("sharding: Partial inputs", function()
  -- a Partial(sum) DTensor whose full value is x: rank r holds x * w_r with sum w_r = 1
  local function partial_of(x, mesh)
    local k = mesh:size()
    local loc = x * ((R + 1) / (k * (k + 1) / 2))
    return dist.DTensor.from_local(loc, mesh, { Part() })
  end
  it("linear ops keep Partial (0 collectives); nonlinear ones reduce first", function()
    engine.manual_seed(6)
    local x, y = randn(5, 3), randn(5, 3)
    local p, q = partial_of(x, mesh1), partial_of(y, mesh1)
    local cnt, out = dist.count_collectives(function() return (p + q) * 2 - p:neg() / 4 end)
    assert.same({}, cnt)
    assert.same({ Part() }, out.placements)
    assert.is_true(diff(out:full_tensor(), (x + y) * 2 + x / 4) < 1e-12)
    local r = dist.distribute_tensor(y, mesh1, { Rep() })
    local c2, o2 = dist.count_collectives(function() return p * r + r end)
    assert.same({}, c2)
    assert.same({ Part() }, o2.placements)
    assert.is_true(diff(o2:full_tensor(), x * y + y) < 1e-12)
    local c3, o3 = dist.count_collectives(function() return p:exp() end)
    assert.same(W > 1 and { all_reduce = 1 } or {}, c3)
    assert.same({ Rep() }, o3.placements)
    assert.is_true(diff(o3:full_tensor(), x:exp()) < 1e-12)
  end)
  it("mul of two Partials replicates one; backward through Partial matches", function()
    engine.manual_seed(7)
    local x, y = randn(4, 3), randn(4, 3)
    local lx = x * ((R + 1) / (W * (W + 1) / 2))
    lx.requires_grad = true
    local p = dist.DTensor.from_local(lx, mesh1, { Part() })
    local q = partial_of(y, mesh1)
    local out = p * q
    assert.is_true(diff(out:full_tensor(), x * y) < 1e-12)
    out:sum():backward()
    -- d/d lx of sum(sum_r lx_r * y) = y on every rank
    assert.is_true(diff(lx.grad, y) < 1e-12)
  end)
  it("Partial(max) inputs: maximum keeps Partial(max) without grad", function()
    engine.manual_seed(8)
    local x = randn(3, 3)
    local loc = R == 0 and x or (x - 10)
    local p = dist.DTensor.from_local(loc, mesh1, { Part("max") })
    local r = dist.distribute_tensor(x * 0.5, mesh1, { Rep() })
    local cnt, out = dist.count_collectives(function() return engine.maximum(p, r) end)
    assert.same({}, cnt)
    assert.same({ Part("max") }, out.placements)
    assert.is_true(diff(out:full_tensor(), engine.maximum(x, x * 0.5)) < 1e-12)
  end)
end)

describe("sharding: silu_mul (SwiGLU's product)", function()
  for _, sz in ipairs(SIZES) do
    local tag = string.format("[%d,%d]", sz[1], sz[2])
    it("every layout of a and b, forward and backward " .. tag, function()
      engine.manual_seed(9)
      local a, b = randn(sz[1], sz[2]), randn(sz[1], sz[2])
      conv.check("silu_mul", function(x, y) return engine.silu_mul(x, y) end, { a, b })
    end)
  end
  it("a and b sharded alike run on their shards; a Partial b stays Partial; a Partial a is reduced", function()
    engine.manual_seed(10)
    local x, y = randn(4, 6), randn(4, 6)
    local want = x:silu() * y
    for _, d in ipairs({ 1, 2 }) do
      local a = dist.distribute_tensor(x, mesh1, { S(d) })
      local b = dist.distribute_tensor(y, mesh1, { S(d) })
      local cnt, out = dist.count_collectives(function() return engine.silu_mul(a, b) end)
      assert.same({}, cnt)
      assert.same({ S(d) }, out.placements)
      assert.is_true(diff(out:full_tensor(), want) < 1e-12)
    end
    local k = mesh1:size()
    local ra = dist.distribute_tensor(x, mesh1, { Rep() })
    local pb = dist.DTensor.from_local(y * ((R + 1) / (k * (k + 1) / 2)), mesh1, { Part() })
    local c1, o1 = dist.count_collectives(function() return engine.silu_mul(ra, pb) end)
    assert.same({}, c1)
    assert.same({ Part() }, o1.placements)
    assert.is_true(diff(o1:full_tensor(), want) < 1e-12)
    local pa = dist.DTensor.from_local(x * ((R + 1) / (k * (k + 1) / 2)), mesh1, { Part() })
    local rb = dist.distribute_tensor(y, mesh1, { Rep() })
    local c2, o2 = dist.count_collectives(function() return engine.silu_mul(pa, rb) end)
    assert.same(W > 1 and { all_reduce = 1 } or {}, c2)
    assert.same({ Rep() }, o2.placements)
    assert.is_true(diff(o2:full_tensor(), want) < 1e-12)
  end)
  it("shapes that differ are one error on every rank, naming both layouts", function()
    local a = dist.distribute_tensor(randn(4, 6), mesh1, { S(1) })
    local b = dist.distribute_tensor(randn(4, 5), mesh1, { Rep() })
    local ok, err = pcall(engine.silu_mul, a, b)
    assert.is_false(ok)
    assert.matches("silu_mul: expected a and b of one shape, got a DTensor%(f64%[4,6%]", err)
    assert.matches("b DTensor%(f64%[4,5%]", err)
  end)
end)
