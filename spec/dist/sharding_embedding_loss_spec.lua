-- Sharding propagation of embedding and cross_entropy: every input layout on a
-- 1-D mesh of the world and (4 ranks) a 2x2 mesh, even and uneven sizes,
-- forward and backward against the single-process result
-- (spec/dist/helpers/converter.lua), plus the collective counts of loss
-- parallel (class dim sharded: 3 all_reduces forward, none backward, no
-- all_gather of the logits) and of a mean over a sharded batch (one count
-- all_reduce).
local engine = require("engine")
local dist = engine.distributed
local conv = require("spec.dist.helpers.converter")

local W = dist.world_size()
local S, Rep, Part = dist.Shard, dist.Replicate, dist.Partial
local mesh1 = conv.meshes("1d")[1]

local function randn(...) return engine.randn({ ... }, { dtype = "f64" }) end
local function diff(a, b) return (a:double() - b:double()):abs():max():item() end
local function ints(t, n, dtype)
  local x = engine.tensor(t, { dtype = dtype or "i64" })
  return n and x:view(table.unpack(n)) or x
end

describe("sharding: embedding", function()
  for _, sz in ipairs({ { 8, 4 }, { 5, 3 } }) do
    local tag = string.format("weight [%d,%d]", sz[1], sz[2])
    it("every layout of weight and indices " .. tag, function()
      engine.manual_seed(21)
      local w = randn(sz[1], sz[2])
      local idx = ints({ 0, 3, 4, 1, 4, 2, 0, 0, 3, 1 }, { 5, 2 })
      local n = conv.check("embedding", function(a, i) return engine.embedding(a, i) end, { w, idx })
      assert.is_true(n > 0)
      -- 1-d indices, i32
      local i1 = ints({ 4, 0, 2, 2, 1, 3 }, nil, "i32")
      conv.check("embedding 1-d i32", function(a, i) return engine.embedding(a, i) end, { w, i1 })
      -- padding_idx: the row-sharded (masked) strategy is not used, results still exact
      conv.check("embedding padding_idx", function(a, i) return engine.embedding(a, i, 2) end, { w, idx })
    end)
  end

  it("layouts: S(2) weight -> Shard(last), S(1) weight -> Partial(sum) without comm, S(d) idx -> S(d)", function()
    engine.manual_seed(22)
    local w, idx = randn(8, 4), ints({ 0, 7, 5, 1, 6, 2, 3, 4 }, { 4, 2 })
    local ref = engine.embedding(w, idx)
    local dw1 = dist.distribute_tensor(w, mesh1, { S(2) })
    local dir = dist.distribute_tensor(idx, mesh1, { Rep() })
    local n1, o1 = dist.count_collectives(function() return engine.embedding(dw1, dir) end)
    assert.same({}, n1)
    assert.same({ S(3) }, o1.placements)
    local dw0 = dist.distribute_tensor(w, mesh1, { S(1) })
    dw0.requires_grad = true
    local n0, o0 = dist.count_collectives(function() return engine.embedding(dw0, dir) end)
    assert.same({}, n0)
    assert.same({ Part() }, o0.placements)
    assert.is_true(diff(o0:full_tensor(), ref) < 1e-12)
    -- backward: the masked lookup adds only into owned rows, no communication
    local nb = dist.count_collectives(function() o0:sum():backward() end)
    assert.same({}, nb)
    assert.same({ S(1) }, dw0.grad.placements)
    local wr = w:clone(); wr.requires_grad = true
    engine.embedding(wr, idx):sum():backward()
    assert.is_true(diff(dw0.grad:full_tensor(), wr.grad) < 1e-12)
    local di = dist.distribute_tensor(idx, mesh1, { S(1) })
    local dwr = dist.distribute_tensor(w, mesh1, { Rep() })
    local ns, os_ = dist.count_collectives(function() return engine.embedding(dwr, di) end)
    assert.same({}, ns)
    assert.same({ S(1) }, os_.placements)
    assert.is_true(diff(os_:full_tensor(), ref) < 1e-12)
  end)

  it("out-of-range index on a row-sharded weight is an error naming the op", function()
    local w = dist.distribute_tensor(randn(8, 4), mesh1, { S(1) })
    local idx = dist.distribute_tensor(ints({ 1, 9 }), mesh1, { Rep() })
    local ok, err = pcall(engine.embedding, w, idx)
    assert.is_false(ok)
    assert.matches("embedding", tostring(err))
    assert.matches("out of range", tostring(err))
  end)
end)

describe("sharding: cross_entropy", function()
  local function targets(n, C, ignore_at)
    local t = {}
    for i = 1, n do t[i] = (i * 3 + 1) % C end
    if ignore_at then t[ignore_at] = -100 end
    return t
  end
  for _, sz in ipairs({ { 4, 6 }, { 5, 3 } }) do
    local N, C = sz[1], sz[2]
    local tag = string.format("[%d,%d]", N, C)
    it("none/sum/mean, ignore_index, every layout " .. tag, function()
      engine.manual_seed(31)
      local x = randn(N, C)
      local t = ints(targets(N, C, 2))
      for _, red in ipairs({ "none", "sum", "mean" }) do
        conv.check("cross_entropy " .. red, function(a, b) return engine.cross_entropy(a, b, { reduction = red }) end,
          { x, t })
      end
      conv.check("cross_entropy label_smoothing", function(a, b)
        return engine.cross_entropy(a, b, { label_smoothing = 0.2 })
      end, { x, t })
      -- every target ignored on some shards (mean still over the global count)
      local tl = targets(N, C)
      for i = 1, N - 1 do tl[i] = -100 end
      local t2 = ints(tl)
      conv.check("cross_entropy mostly ignored", function(a, b) return engine.cross_entropy(a, b) end, { x, t2 })
    end)
  end
  it("[N, C, d] logits and [C] logits", function()
    engine.manual_seed(32)
    local x3 = randn(3, 4, 5)
    local t3 = ints({ 0, 1, 2, 3, 0, 3, 2, 1, -100, 0, 1, 1, 2, 3, 3 }, { 3, 5 })
    conv.check("cross_entropy [N,C,d] mean", function(a, b) return engine.cross_entropy(a, b) end, { x3, t3 },
      { max_cases = 40 })
    conv.check("cross_entropy [N,C,d] none", function(a, b) return engine.cross_entropy(a, b, { reduction = "none" }) end,
      { x3, t3 }, { max_cases = 40 })
    local x1 = randn(6)
    conv.check("cross_entropy [C]", function(a, b) return engine.cross_entropy(a, b) end, { x1, ints(4) })
  end)
  it("f32 logits", function()
    engine.manual_seed(33)
    local x = engine.randn({ 5, 7 })
    conv.check("cross_entropy f32", function(a, b) return engine.cross_entropy(a, b) end, { x, ints(targets(5, 7)) },
      { tol = 1e-5 })
  end)

  it("loss parallel: class dim sharded -> Replicate loss, 3 all_reduces, Shard(2) gradient, no all_gather", function()
    engine.manual_seed(34)
    local N, V = 6, 10
    local x, t = randn(N, V), ints(targets(N, V, 3))
    local xr = x:clone(); xr.requires_grad = true
    local ref = engine.cross_entropy(xr, t)
    ref:backward()
    for _, red in ipairs({ "mean", "sum", "none" }) do
      local dx = dist.distribute_tensor(x, mesh1, { S(2) })
      dx.requires_grad = true
      local dt = dist.distribute_tensor(t, mesh1, { Rep() })
      local nf, loss = dist.count_collectives(function() return engine.cross_entropy(dx, dt, { reduction = red }) end)
      assert.same({ all_reduce = 3 }, nf)
      assert.same({ Rep() }, loss.placements)
      local r = engine.cross_entropy(x, t, { reduction = red })
      assert.is_true(diff(loss:to_local(), r) < 1e-12)
      local nb = dist.count_collectives(function() loss:sum():backward() end)
      assert.same({}, nb)
      assert.same({ S(2) }, dx.grad.placements)
      if red == "mean" then assert.is_true(diff(dx.grad:full_tensor(), xr.grad) < 1e-12) end
    end
  end)

  it("mean over a sharded batch: one count all_reduce, Partial(sum) loss", function()
    engine.manual_seed(35)
    local x, t = randn(5, 4), ints(targets(5, 4, 1))
    local dx = dist.distribute_tensor(x, mesh1, { S(1) })
    local dt = dist.distribute_tensor(t, mesh1, { S(1) })
    local n, loss = dist.count_collectives(function() return engine.cross_entropy(dx, dt) end)
    assert.same({ all_reduce = 1 }, n)
    assert.same({ Part() }, loss.placements)
    assert.is_true(diff(loss:full_tensor(), engine.cross_entropy(x, t)) < 1e-12)
    local n2, l2 = dist.count_collectives(function() return engine.cross_entropy(dx, dt, { reduction = "sum" }) end)
    assert.same({}, n2)
    assert.same({ Part() }, l2.placements)
  end)

  it("2x2 mesh: batch on dp, classes on tp (loss parallel inside a data-parallel group)", function()
    if W ~= 4 then return pending("needs 4 ranks") end
    local mesh2 = conv.meshes("2d")[1]
    engine.manual_seed(36)
    local x, t = randn(6, 9), ints(targets(6, 9, 4))
    local xr = x:clone(); xr.requires_grad = true
    engine.cross_entropy(xr, t):backward()
    local dx = dist.distribute_tensor(x, mesh2, { S(1), S(2) })
    dx.requires_grad = true
    local dt = dist.distribute_tensor(t, mesh2, { S(1), Rep() })
    local n, loss = dist.count_collectives(function() return engine.cross_entropy(dx, dt) end)
    assert.same({ all_reduce = 4 }, n)
    assert.same({ Part(), Rep() }, loss.placements)
    assert.is_true(diff(loss:full_tensor(), engine.cross_entropy(x, t)) < 1e-12)
    loss:backward()
    assert.same({ S(1), S(2) }, dx.grad.placements)
    assert.is_true(diff(dx.grad:full_tensor(), xr.grad) < 1e-12)
  end)

  it("mismatched target shape is an error naming the op", function()
    local dx = dist.distribute_tensor(randn(4, 3), mesh1, { S(1) })
    local dt = dist.distribute_tensor(ints({ 0, 1, 2 }), mesh1, { Rep() })
    local ok, err = pcall(engine.cross_entropy, dx, dt)
    assert.is_false(ok)
    assert.matches("cross_entropy", tostring(err))
  end)
end)
