-- Sharding of torch's pointwise math, reductions, scans and sorts (engine/src/sharding/math.c):
-- pointwise math, fmod/remainder/floor_divide/logical ops, the composites
-- (clamp with tensor bounds, lerp, addcmul, addcdiv), the reductions (prod,
-- amax, amin, logsumexp, var, std, norm, all, any), scans and selections
-- (cumsum, cumprod, sort, argsort, topk, kthvalue).  Every input layout on a
-- 1-D mesh of the world and (4 ranks) a 2x2 mesh equals one process, forward
-- and backward (spec/dist/helpers/converter.lua); even and uneven sizes;
-- Partial inputs and the layouts the rules give, explicitly.
local engine = require("engine")
local dist = engine.distributed
local conv = require("spec.dist.helpers.converter")

local W = dist.world_size()
local S, Rep, Part = dist.Shard, dist.Replicate, dist.Partial
local mesh1 = conv.meshes("1d")[1]

local function randn(...) return engine.randn({ ... }, { dtype = "f64" }) end

local SIZES = { { 4, 6 }, { 5, 3 } }

describe("sharding: pointwise math", function()
  for _, sz in ipairs(SIZES) do
    local tag = string.format("[%d,%d]", sz[1], sz[2])
    it("unary math and predicates " .. tag, function()
      engine.manual_seed(11)
      local x = randn(sz[1], sz[2]) * 2
      -- one def (math_unary) for all: several ops per check
      conv.check("sin/cos/erf/expm1/square", function(a)
        return a:sin() + a:cos() * 2 + a:erf() * 3 + a:expm1() * 4 + a:square() * 5
      end, { x })
      conv.check("floor/ceil/round/trunc/sign", function(a)
        return a:floor() + a:ceil() * 2 + a:round() * 3 + a:trunc() * 4 + a:sign() * 5 + a:round(1) * 6
      end, { x })
      local xp = x:abs() + 0.5
      conv.check("log1p/reciprocal", function(a) return a:log1p() + a:reciprocal() end, { xp })
      conv.check("isnan/isinf/isfinite/logical_not", function(a)
        return a:isnan():logical_or(a:isinf()):logical_or(a:isfinite():logical_not())
      end, { x })
      local y = x:clone()
      y[1][1] = 0 / 0
      y[sz[1]][sz[2]] = 1 / 0
      conv.check("nan_to_num", function(a) return a:nan_to_num(0.5, 7, -7) end, { y })
    end)
    it("binary math with broadcasting " .. tag, function()
      engine.manual_seed(12)
      local a = randn(sz[1], sz[2]) * 4
      local b = randn(sz[2]):abs() + 0.5
      conv.check("fmod/remainder", function(u, v) return u:fmod(v) + u:remainder(v) * 2 end, { a, b })
      conv.check("floor_divide", function(u, v) return u:floor_divide(v) end, { a, b }, { grad = false, cover = true, partial = true })
      conv.check("remainder scalar", function(u) return u:remainder(1.5) end, { a })
      conv.check("logical_and", function(u, v) return u:gt(0):logical_and(v:gt(1)) end, { a, b })
    end)
    it("clamp with tensor bounds, lerp, addcmul, addcdiv " .. tag, function()
      engine.manual_seed(13)
      local x, lo, hi = randn(sz[1], sz[2]), randn(sz[1], 1) - 0.5, randn(sz[2]) + 0.5
      local one_d = { meshes = "1d" }
      local few = { cover = true, partial = true }
      conv.check("clamp tensors", function(u, l, h) return u:clamp(l, h) end, { x, lo, hi }, few)
      local b, w = randn(sz[1], sz[2]), randn(sz[2])
      conv.check("lerp tensor", function(u, v, ww) return u:lerp(v, ww) end, { x, b, w }, few)
      conv.check("lerp number", function(u, v) return u:lerp(v, 0.3) end, { x, b }, one_d)
      local c = randn(sz[1], sz[2]):abs() + 0.5
      conv.check("addcmul", function(u, v, cc) return u:addcmul(v, cc, 0.5) end, { x, b, c }, few)
      conv.check("addcdiv", function(u, v, cc) return u:addcdiv(v, cc, 2) end, { x, b, c }, few)
    end)
  end
end)

describe("sharding: reductions", function()
  for _, sz in ipairs(SIZES) do
    local tag = string.format("[%d,%d]", sz[1], sz[2])
    it("prod/amax/amin/logsumexp/var/std/norm over dims " .. tag, function()
      engine.manual_seed(14)
      local x = randn(sz[1], sz[2])
      conv.check("prod/amax/logsumexp/var over dim 2", function(a)
        return a:prod(2) + a:amax(2) * 2 + a:logsumexp(2) * 3 + a:var(2, { correction = 0 }) * 4
      end, { x })
      conv.check("prod/amin/std keepdim over dim 1", function(a)
        return a:prod(1, true) + a:amin(1, true) * 2 + a:std(1, { keepdim = true }) * 3
      end, { x })
      conv.check("over all dims", function(a)
        return a:prod() + a:amax() * 2 + a:logsumexp({ 1, 2 }) * 3 + a:std() * 4 + a:norm() * 5
      end, { x })
      conv.check("norms", function(a)
        local n = engine.linalg.vector_norm
        return n(a, 1, 2) + n(a, 2, 2) * 2 + n(a, 3, 2) * 3 + n(a, math.huge, 2) * 4
      end, { x })
    end)
    it("all/any " .. tag, function()
      engine.manual_seed(15)
      local x = randn(sz[1], sz[2]):gt(-1)
      conv.check("all/any", function(a) return a:all(2, true):logical_or(a:any(1, true)) end, { x })
      conv.check("all all", function(a) return a:all() end, { x })
    end)
  end
  it("a sharded kept dim stays sharded, a sharded reduced dim is replicated first", function()
    engine.manual_seed(16)
    local x = randn(8, 6)
    local d = dist.distribute_tensor(x, mesh1, { S(1) })
    local r = d:amax(2)
    assert.are.equal("Shard(1)", tostring(r.placements[1]))
    local v = d:var(1)
    assert.are.equal("Replicate()", tostring(v.placements[1]))
    assert((v:full_tensor() - x:var(1)):abs():max():item() < 1e-12)
    local k = d:prod(2, true)
    assert.are.equal("Shard(1)", tostring(k.placements[1]))
    local d2 = dist.distribute_tensor(x, mesh1, { S(2) })
    local r2 = d2:logsumexp(1)
    assert.are.equal("Shard(1)", tostring(r2.placements[1]))
  end)
  it("amax/amin over a sharded dim without gradient give Partial(max/min), no communication", function()
    engine.manual_seed(20)
    local x = randn(4 * W, 3)
    local d = dist.distribute_tensor(x, mesh1, { S(1) })
    engine.no_grad(function()
      local m = d:amax(1)
      assert.is_true(m.placements[1]:is_partial())
      assert((m:full_tensor() - x:amax(1)):abs():max():item() == 0)
      local n = d:amin({ 1, 2 }, true)
      assert.is_true(n.placements[1]:is_partial())
      assert((n:full_tensor() - x:amin({ 1, 2 }, true)):abs():max():item() == 0)
    end)
    -- with a gradient the sharded dim is replicated first
    local dg = dist.distribute_tensor(x, mesh1, { S(1) })
    dg.requires_grad = true
    local g = dg:amax(1)
    assert.is_false(g.placements[1]:is_partial())
  end)
  it("Partial inputs are reduced first", function()
    engine.manual_seed(17)
    local x = randn(4, 3)
    local part = dist.DTensor.from_local(x / W, mesh1, { Part() })
    assert((part:amax(2):full_tensor() - x:amax(2)):abs():max():item() < 1e-12)
    assert((part:sin():full_tensor() - x:sin()):abs():max():item() < 1e-12)
    assert((part:cumsum(1):full_tensor() - x:cumsum(1)):abs():max():item() < 1e-12)
  end)
end)

describe("sharding: scans and selections", function()
  for _, sz in ipairs(SIZES) do
    local tag = string.format("[%d,%d]", sz[1], sz[2])
    it("cumsum/cumprod/sort/argsort/topk/kthvalue " .. tag, function()
      engine.manual_seed(18)
      local x = randn(sz[1], sz[2])
      conv.check("cumsum/cumprod", function(a) return a:cumsum(2) + a:cumsum(1) * 2 + a:cumprod(1) * 3 end, { x })
      conv.check("sort", function(a) return a:sort(2) end, { x }, { outputs = 2 })
      conv.check("sort descending", function(a) return a:sort(1, true) end, { x }, { outputs = 2 })
      conv.check("argsort", function(a) return a:argsort(2) end, { x })
      conv.check("topk", function(a) return a:topk(2, 2) end, { x }, { outputs = 2 })
      conv.check("topk smallest", function(a) return a:topk(2, 1, false) end, { x }, { outputs = 2 })
      conv.check("kthvalue", function(a) return a:kthvalue(2, 2) end, { x }, { outputs = 2 })
      conv.check("kthvalue keepdim", function(a) return a:kthvalue(3, 1, true) end, { x }, { outputs = 2 })
    end)
  end
  it("keeps the other sharded dims: no communication for a sort along an unsharded dim", function()
    engine.manual_seed(19)
    local x = randn(8, 5)
    local d = dist.distribute_tensor(x, mesh1, { S(1) })
    local v, i = d:sort(2)
    assert.are.equal("Shard(1)", tostring(v.placements[1]))
    assert.are.equal("Shard(1)", tostring(i.placements[1]))
    local kv = d:kthvalue(2, 2)
    assert.are.equal("Shard(1)", tostring(kv.placements[1]))
    local c = dist.distribute_tensor(x, mesh1, { S(2) }):cumsum(1)
    assert.are.equal("Shard(2)", tostring(c.placements[1]))
  end)
  it("an integer division by zero on one rank's shard fails every rank", function()
    local n = 2 * W
    local a = engine.arange(1, n + 1):long()
    local bv = {}
    for j = 1, n do bv[j] = 1 end
    bv[n] = 0 -- only the last rank's shard holds the zero
    local b = engine.tensor(bv, "i64")
    local da, db = dist.distribute_tensor(a, mesh1, { S(1) }), dist.distribute_tensor(b, mesh1, { S(1) })
    local ok, e = pcall(function() return da:fmod(db) end)
    assert(not ok, "expected an error on every rank")
    assert(tostring(e):find("ZeroDivisionError", 1, true) or tostring(e):find("fmod", 1, true), tostring(e))
    -- the ranks are still in step: a collective afterwards works
    assert.are.same(a:tolist(), (da:fmod(da + 1)):full_tensor():tolist())
  end)
  it("errors on some ranks fail every rank with the op's message", function()
    local d = dist.distribute_tensor(randn(4, 3), mesh1, { S(1) })
    local ok, e = pcall(function() return d:topk(4, 2) end)
    assert(not ok and tostring(e):find("topk: k = 4 is out of range", 1, true), tostring(e))
  end)
end)
