-- Sharding propagation of reductions (sum/mean/max/min/argmax over dims and
-- over all, keepdim) and matmul / linear / batched matmul: every input layout
-- on a 1-D mesh of the world and (4 ranks) a 2x2 mesh, even and uneven sizes,
-- forward and backward against the single-process result
-- (spec/dist/helpers/converter.lua), plus the collective counts the sharding
-- design implies.
local engine = require("engine")
local dist = engine.distributed
local conv = require("spec.dist.helpers.converter")

local R, W = dist.rank(), dist.world_size()
local S, Rep, Part = dist.Shard, dist.Replicate, dist.Partial
local mesh1 = conv.meshes("1d")[1]

local function randn(...) return engine.randn({ ... }, { dtype = "f64" }) end
local function diff(a, b) return (a:double() - b:double()):abs():max():item() end
local function c(t) if W > 1 then return t end return {} end

describe("sharding: reductions", function()
  for _, sz in ipairs({ { 4, 6 }, { 5, 3 } }) do
    local tag = string.format("[%d,%d]", sz[1], sz[2])
    it("sum/mean over dims, keepdim, over all " .. tag, function()
      engine.manual_seed(11)
      local x = randn(sz[1], sz[2])
      conv.check("sum all", function(a) return a:sum() end, { x })
      conv.check("sum dim 1", function(a) return a:sum(1) end, { x })
      conv.check("sum dim 2 keepdim", function(a) return a:sum(2, true) end, { x })
      conv.check("mean all", function(a) return a:mean() end, { x })
      conv.check("mean dim 1", function(a) return a:mean(1) end, { x })
      conv.check("mean dim -1 keepdim", function(a) return a:mean(-1, true) end, { x })
    end)
    it("max/min/argmax " .. tag, function()
      engine.manual_seed(12)
      local x = randn(sz[1], sz[2])
      conv.check("max all", function(a) return a:max() end, { x })
      conv.check("min all", function(a) return a:min() end, { x })
      conv.check("max dim 1 (values, indices)", function(a) return a:max(1) end, { x }, { outputs = 2 })
      conv.check("min dim 2 keepdim", function(a) return a:min(2, true) end, { x }, { outputs = 2 })
      conv.check("argmax dim 1", function(a) return a:argmax(1) end, { x })
      conv.check("argmin dim 2 keepdim", function(a) return a:argmin(2, true) end, { x })
      conv.check("argmax all", function(a) return a:argmax() end, { x })
      -- without grad: max/min values over a sharded dim go through Partial(max/min)
      engine.no_grad(function()
        conv.check("max all (no grad)", function(a) return a:max() end, { x }, { grad = false })
        conv.check("min dim 1 values (no grad)", function(a) return (a:min(1)) end, { x }, { grad = false })
      end)
    end)
  end
  it("3-d sum over two dims", function()
    engine.manual_seed(13)
    local x = randn(2, 5, 3)
    conv.check("sum {1,3}", function(a) return a:sum({ 1, 3 }) end, { x }, { max_cases = 30 })
    conv.check("mean {2,3} keepdim", function(a) return a:mean({ 2, 3 }, true) end, { x }, { max_cases = 30 })
  end)
  it("sum over a sharded dim is Partial(sum), 1 all_reduce at full_tensor; mean is exact for uneven shards", function()
    local x = randn(5, 3)
    local d = dist.distribute_tensor(x, mesh1, { S(1) })
    local c1, s = dist.count_collectives(function() return d:sum(1) end)
    assert.same({}, c1)
    assert.same(W > 1 and { Part() } or { Part() }, s.placements)
    local c2, m = dist.count_collectives(function() return d:mean() end)
    assert.same({}, c2)
    local c3, full = dist.count_collectives(function() return m:full_tensor() end)
    assert.same(c({ all_reduce = 1 }), c3)
    assert.is_true(math.abs(full:item() - x:mean():item()) < 1e-12)
    engine.no_grad(function()
      -- every shard non-empty: Partial(max), no collective
      local x8 = randn(8, 3)
      local d8 = dist.distribute_tensor(x8, mesh1, { S(1) })
      local c4, mx = dist.count_collectives(function() return d8:max() end)
      assert.same({}, c4)
      assert.same({ Part("max") }, mx.placements)
      assert.is_true(math.abs(mx:full_tensor():item() - x8:max():item()) < 1e-12)
      -- an empty shard (5 rows over 4 ranks): replicate first
      local c5, mx5 = dist.count_collectives(function() return d:max() end)
      if W == 4 then assert.same({ all_gather = 1 }, c5); assert.same({ Rep() }, mx5.placements) end
      assert.is_true(math.abs(mx5:full_tensor():item() - x:max():item()) < 1e-12)
    end)
  end)
end)

describe("sharding: matmul / linear / bmm", function()
  for _, n in ipairs({ 4, 5 }) do
    it(string.format("matmul 2-d, 1-d, batched with broadcast (size %d)", n), function()
      engine.manual_seed(21)
      conv.check("mm", function(a, b) return engine.matmul(a, b) end, { randn(n, 3), randn(3, n) })
      conv.check("mv", function(a, b) return engine.matmul(a, b) end, { randn(n, 3), randn(3) })
      conv.check("vm", function(a, b) return engine.matmul(a, b) end, { randn(n), randn(n, 2) })
      conv.check("dot", function(a, b) return engine.matmul(a, b) end, { randn(n), randn(n) })
      conv.check("bmm", function(a, b) return engine.matmul(a, b) end, { randn(2, n, 3), randn(2, 3, 2) }, { max_cases = 40 })
      conv.check("bmm broadcast", function(a, b) return engine.matmul(a, b) end, { randn(2, n, 3), randn(3, 2) }, { max_cases = 40 })
    end)
    it(string.format("linear with and without bias (size %d)", n), function()
      engine.manual_seed(22)
      local F = engine.nn.functional
      conv.check("linear", function(x, w, b) return F.linear(x, w, b) end, { randn(n, 3), randn(n + 1, 3), randn(n + 1) },
        { max_cases = 60 })
      conv.check("linear no bias", function(x, w) return F.linear(x, w) end, { randn(2, n, 3), randn(n, 3) }, { max_cases = 60 })
    end)
  end

  it("Replicate weight x Shard(1) input linear: forward 0 collectives; the weight grad is all-reduced once into .grad", function()
    engine.manual_seed(23)
    local x, w, b = randn(8, 4), randn(3, 4), randn(3)
    local dx = dist.distribute_tensor(x, mesh1, { S(1) })
    local dw = dist.distribute_tensor(w, mesh1, { Rep() }); dw.requires_grad = true
    local db = dist.distribute_tensor(b, mesh1, { Rep() }); db.requires_grad = true
    local cf, y = dist.count_collectives(function() return engine.nn.functional.linear(dx, dw, db) end)
    assert.same({}, cf)
    assert.same({ S(1) }, y.placements)
    local cb = dist.count_collectives(function() y:sum():backward() end)
    assert.same(c({ all_reduce = 2 }), cb) -- one for the weight, one for the bias
    assert.same({ Rep() }, dw.grad.placements)
    local gw = dw.grad:to_local()  -- Replicate: every rank has the full gradient already
    assert.is_true(diff(gw, engine.ones(8, 3):double():t():matmul(x)) < 1e-10)
    assert.is_true(diff(db.grad:to_local(), engine.full({ 3 }, 8, "f64")) < 1e-12)
    -- without bias: exactly one all_reduce
    dw.grad = nil
    local y2 = engine.nn.functional.linear(dx, dw)
    local cb2 = dist.count_collectives(function() y2:sum():backward() end)
    assert.same(c({ all_reduce = 1 }), cb2)
  end)

  it("S(k)·S(k) matmul is Partial(sum) with 0 collectives; full_tensor is 1 all_reduce", function()
    engine.manual_seed(24)
    local a, b = randn(3, 5), randn(5, 2)
    local da = dist.distribute_tensor(a, mesh1, { S(2) })
    local dbb = dist.distribute_tensor(b, mesh1, { S(1) })
    local cf, out = dist.count_collectives(function() return engine.matmul(da, dbb) end)
    assert.same({}, cf)
    assert.same({ Part() }, out.placements)
    local cr, full = dist.count_collectives(function() return out:full_tensor() end)
    assert.same(c({ all_reduce = 1 }), cr)
    assert.is_true(diff(full, a:matmul(b)) < 1e-12)
  end)

  it("column then row parallel (Megatron MLP): 0 collectives until the Partial output", function()
    engine.manual_seed(25)
    local x, w1, w2 = randn(4, 6), randn(8, 6), randn(6, 8)
    local dx = dist.distribute_tensor(x, mesh1, { Rep() })
    local dw1 = dist.distribute_tensor(w1, mesh1, { S(1) })
    local dw2 = dist.distribute_tensor(w2, mesh1, { S(2) })
    local cnt, out = dist.count_collectives(function()
      local F = engine.nn.functional
      return F.linear(F.linear(dx, dw1):relu(), dw2)
    end)
    assert.same({}, cnt)
    assert.same({ Part() }, out.placements)
    local F = engine.nn.functional
    assert.is_true(diff(out:full_tensor(), F.linear(F.linear(x, w1):relu(), w2)) < 1e-10)
  end)
end)
