-- Sharding propagation of the shape ops (view/reshape/flatten/squeeze/unsqueeze,
-- transpose/permute/t, contiguous, expand, narrow/select, index_select,
-- cat/stack, split/split_sizes/chunk): every input layout on a 1-D mesh of the
-- world and (4 ranks) a 2x2 mesh, even and uneven sizes, forward and backward
-- against the single-process result (spec/dist/helpers/converter.lua), plus the
-- collective counts of the transformer's head split/merge and the logits
-- flatten (zero collectives when the shards are whole rows/heads).
local engine = require("engine")
local dist = engine.distributed
local conv = require("spec.dist.helpers.converter")

local W = dist.world_size()
local S, Rep, Part = dist.Shard, dist.Replicate, dist.Partial
local mesh1 = conv.meshes("1d")[1]

local function randn(...) return engine.randn({ ... }, { dtype = "f64" }) end
local function diff(a, b) return (a:double() - b:double()):abs():max():item() end
local function total(counts) local n = 0 for _, v in pairs(counts) do n = n + v end return n end

describe("sharding: view/reshape/flatten/squeeze/unsqueeze", function()
  it("view merges and splits dims (even sizes)", function()
    engine.manual_seed(1)
    local x = randn(4, 2, 3)
    conv.check("view [4,2,3]->[8,3]", function(a) return a:view(8, 3) end, { x })
    conv.check("view [4,2,3]->[4,6]", function(a) return a:view(4, 6) end, { x })
    conv.check("view [4,2,3]->[24]", function(a) return a:view(-1) end, { x })
    conv.check("view [4,2,3]->[2,2,2,3]", function(a) return a:view(2, 2, 2, 3) end, { x })
    conv.check("view [4,2,3]->[4,2,3,1]", function(a) return a:view(4, 2, 3, 1) end, { x })
    local y = randn(8, 6)
    conv.check("view [8,6]->[4,2,6]", function(a) return a:view(4, 2, 6) end, { y })
    conv.check("view [8,6]->[8,2,3]", function(a) return a:view(8, 2, 3) end, { y })
    conv.check("view [8,6]->[2,24]", function(a) return a:view(2, -1) end, { y })
  end)
  it("view / reshape with uneven sizes", function()
    engine.manual_seed(2)
    local x = randn(5, 3, 2)
    conv.check("view [5,3,2]->[15,2]", function(a) return a:view(15, 2) end, { x })
    conv.check("view [5,3,2]->[5,6]", function(a) return a:view(5, 6) end, { x })
    conv.check("reshape [5,3,2]->[30]", function(a) return a:reshape(-1) end, { x })
    conv.check("reshape [5,3,2]->[3,5,2]", function(a) return a:reshape(3, 5, 2) end, { x })
    conv.check("reshape [5,3,2]->[5,3,2,1]", function(a) return a:reshape(5, 3, 2, 1) end, { x })
    local y = randn(6, 5)
    conv.check("view [6,5]->[2,3,5]", function(a) return a:view(2, 3, 5) end, { y })
    conv.check("view [6,5]->[3,2,5]", function(a) return a:view(3, 2, 5) end, { y })
    conv.check("view_as", function(a) return a:view_as(engine.zeros(3, 10)) end, { y })
  end)
  it("reshape of a non-contiguous input (transpose) copies locally", function()
    engine.manual_seed(3)
    local x = randn(4, 6)
    conv.check("t():reshape(-1)", function(a) return a:t():reshape(-1) end, { x })
    conv.check("transpose:reshape [6,2,2]", function(a) return a:t():reshape(6, 2, 2) end, { x })
    conv.check("t():contiguous():view", function(a) return a:t():contiguous():view(3, 8) end, { x })
  end)
  it("flatten / squeeze / unsqueeze", function()
    engine.manual_seed(4)
    local x = randn(4, 1, 3)
    local z = randn(5, 2, 3)
    conv.check("flatten all", function(a) return a:flatten() end, { z })
    conv.check("flatten 2..3", function(a) return a:flatten(2, 3) end, { z })
    conv.check("flatten 1..2", function(a) return a:flatten(1, 2) end, { z })
    conv.check("squeeze 2", function(a) return a:squeeze(2) end, { x })
    conv.check("squeeze all", function(a) return a:squeeze() end, { x })
    conv.check("squeeze 1 (no-op)", function(a) return a:squeeze(1) end, { x })
    conv.check("unsqueeze 1", function(a) return a:unsqueeze(1) end, { z })
    conv.check("unsqueeze 3", function(a) return a:unsqueeze(3) end, { z })
    conv.check("unsqueeze -1", function(a) return a:unsqueeze(-1) end, { z })
  end)
  it("view errors use the global shape", function()
    local d = dist.distribute_tensor(randn(4, 6), mesh1, { S(1) })
    assert.same({ 24 }, d:view(-1):shape())
    local ok, err = pcall(function() return d:view(5, -1) end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("view: shape %[5,%-1%] is invalid for input of size 24"))
  end)
end)

describe("sharding: transpose/permute/expand/narrow/select", function()
  for _, sz in ipairs({ { 4, 2, 6 }, { 5, 3, 2 } }) do
    local tag = string.format("[%d,%d,%d]", sz[1], sz[2], sz[3])
    it("transpose/permute/contiguous " .. tag, function()
      engine.manual_seed(5)
      local x = randn(sz[1], sz[2], sz[3])
      conv.check("transpose 1,3", function(a) return a:transpose(1, 3) end, { x })
      conv.check("transpose 2,3 contiguous", function(a) return a:transpose(2, 3):contiguous() end, { x })
      conv.check("permute 3,1,2", function(a) return a:permute(3, 1, 2) end, { x })
      conv.check("t", function(a) return a:select(2, 1):t() end, { x })
    end)
    it("narrow/select " .. tag, function()
      engine.manual_seed(6)
      local x = randn(sz[1], sz[2], sz[3])
      conv.check("narrow 1", function(a) return a:narrow(1, 2, 3) end, { x })
      conv.check("narrow 3 negative start", function(a) return a:narrow(3, -2, 2) end, { x })
      conv.check("narrow 2 empty", function(a) return a:narrow(2, 2, 0) end, { x })
      conv.check("select 1", function(a) return a:select(1, 2) end, { x })
      conv.check("select 2", function(a) return a:select(2, -1) end, { x })
      conv.check("select 3", function(a) return a:select(3, 1) end, { x })
    end)
  end
  it("expand (expanded dims replicated, others keep Shard)", function()
    engine.manual_seed(7)
    local x = randn(1, 3)
    local y = randn(5, 1)
    local z = randn(4, 1, 3)
    conv.check("expand [1,3]->[4,3]", function(a) return a:expand(4, 3) end, { x })
    conv.check("expand [5,1]->[2,5,4]", function(a) return a:expand(2, 5, 4) end, { y })
    conv.check("expand [5,1]->[5,-1]", function(a) return a:expand(-1, 1) * 2 end, { y })
    conv.check("expand [4,1,3]->[4,5,3]", function(a) return a:expand(4, 5, 3) end, { z })
    conv.check("expand_as", function(a) return a:expand_as(engine.zeros(2, 4, 1, 3)) end, { z })
  end)
end)

describe("sharding: index_select", function()
  for _, sz in ipairs({ { 4, 6 }, { 5, 3 } }) do
    local tag = string.format("[%d,%d]", sz[1], sz[2])
    it("index_select dims 1 and 2 " .. tag, function()
      engine.manual_seed(8)
      local x = randn(sz[1], sz[2])
      local i1 = engine.tensor({ 3, 0, 1, 3, 2 }, { dtype = "i64" })
      local i2 = engine.tensor({ 2, 0, 2 }, { dtype = "i64" })
      conv.check("index_select 1", function(a, i) return a:index_select(1, i) end, { x, i1 })
      conv.check("index_select 2", function(a, i) return a:index_select(2, i) end, { x, i2 })
      local i0 = engine.tensor(1, { dtype = "i64" })
      conv.check("index_select 0-d index", function(a, i) return a:index_select(1, i) end, { x, i0 })
    end)
  end
  it("index_select with a Shard(0) index and a Replicate input: output Shard on the dim, no collective", function()
    local x = randn(5, 3)
    local idx = engine.tensor({ 4, 0, 1, 3, 2, 2, 1, 0 }, { dtype = "i64" })
    local dx = dist.distribute_tensor(x, mesh1, { Rep() })
    local di = dist.distribute_tensor(idx, mesh1, { S(1) })
    local cnt, out = dist.count_collectives(function() return dx:index_select(1, di) end)
    assert.same({}, cnt)
    assert.same({ S(1) }, out.placements)
    assert.is_true(diff(out:full_tensor(), x:index_select(1, idx)) == 0)
  end)
end)

describe("sharding: cat/stack", function()
  for _, sz in ipairs({ { 4, 6 }, { 5, 3 } }) do
    local tag = string.format("[%d,%d]", sz[1], sz[2])
    it("cat and stack of two/three " .. tag, function()
      engine.manual_seed(9)
      local a, b, c = randn(sz[1], sz[2]), randn(sz[1], sz[2]), randn(2, sz[2])
      conv.check("cat dim 1", function(x, y) return engine.cat({ x, y }, 1) end, { a, b })
      conv.check("cat dim 2", function(x, y) return engine.cat({ x, y }, 2) end, { a, b })
      conv.check("cat dim 1 uneven pieces", function(x, y) return engine.cat({ x, y }, 1) end, { a, c })
      conv.check("stack dim 1", function(x, y) return engine.stack({ x, y }, 1) end, { a, b })
      conv.check("stack dim 2", function(x, y) return engine.stack({ x, y }, 2) end, { a, b })
      conv.check("stack dim 3", function(x, y) return engine.stack({ x, y }, 3) end, { a, b })
      conv.check("cat of three", function(x, y, z) return engine.cat({ x, y, z }, 2) end, { a, b, a * 2 },
        { max_cases = 60 })
    end)
  end
  it("cat and stack of more than 8 DTensors", function()
    engine.manual_seed(10)
    local xs = {}
    for i = 1, 11 do xs[i] = randn(5, 3) end
    -- the same layout for every input
    for _, mesh in ipairs(conv.meshes("all")) do
      for _, pl in ipairs(conv.placement_lists(2, mesh:ndim())) do
        local ds = {}
        for i = 1, #xs do ds[i] = dist.distribute_tensor(xs[i], mesh, pl) end
        for _, dim in ipairs({ 1, 2 }) do
          local out = engine.cat(ds, dim)
          assert.is_true(diff(out:full_tensor(), engine.cat(xs, dim)) == 0)
          local st = engine.stack(ds, dim)
          assert.is_true(diff(st:full_tensor(), engine.stack(xs, dim)) == 0)
        end
      end
    end
  end)
  it("cat keeps Shard on the other dim with zero collectives; the cat dim is replicated", function()
    local a, b = randn(4, 8), randn(4, 8)
    local da = dist.distribute_tensor(a, mesh1, { S(2) })
    local db = dist.distribute_tensor(b, mesh1, { S(2) })
    local cnt, out = dist.count_collectives(function() return engine.cat({ da, db }, 1) end)
    assert.same({}, cnt)
    assert.same({ S(2) }, out.placements)
    local cnt2, out2 = dist.count_collectives(function() return engine.cat({ da, db }, 2) end)
    assert.same({ Rep() }, out2.placements)
    if W > 1 then assert.same(2, total(cnt2)) end
    assert.is_true(diff(out2:full_tensor(), engine.cat({ a, b }, 2)) == 0)
  end)
  it("mixed DTensor and plain tensor is an error naming both", function()
    local da = dist.distribute_tensor(randn(4, 6), mesh1, { S(1) })
    local ok, err = pcall(function() return engine.cat({ da, randn(4, 6) }, 1) end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("cat: mixed DTensor and Tensor arguments", 1, true))
    local ok2, err2 = pcall(function() return engine.cat({ da, dist.distribute_tensor(randn(4, 5), mesh1, { S(1) }) }, 1) end)
    assert.is_false(ok2)
    assert.truthy(tostring(err2):find("cat: sizes of tensors must match", 1, true))
  end)
end)

describe("sharding: split/split_sizes/chunk", function()
  for _, sz in ipairs({ { 4, 6 }, { 5, 3 } }) do
    local tag = string.format("[%d,%d]", sz[1], sz[2])
    it("split/chunk pieces " .. tag, function()
      engine.manual_seed(11)
      local x = randn(sz[1], sz[2])
      conv.check("split 2 dim 1", function(a) return table.unpack(a:split(2, 1)) end, { x },
        { outputs = #x:split(2, 1) })
      conv.check("split 2 dim 2", function(a) return table.unpack(a:split(2, 2)) end, { x },
        { outputs = #x:split(2, 2) })
      conv.check("chunk 3 dim 1", function(a) return table.unpack(a:chunk(3, 1)) end, { x },
        { outputs = #x:chunk(3, 1) })
      conv.check("chunk 2 dim 2", function(a) return table.unpack(a:chunk(2, 2)) end, { x },
        { outputs = #x:chunk(2, 2) })
      conv.check("split_sizes dim 1", function(a) return table.unpack(a:split({ 1, sz[1] - 1 }, 1)) end, { x },
        { outputs = 2 })
      -- gradients of every piece: reassemble in another order
      conv.check("split + cat reordered", function(a)
        local p = a:split(2, 1)
        local q = {}
        for i = #p, 1, -1 do q[#q + 1] = p[i] * i end
        return engine.cat(q, 1)
      end, { x })
      conv.check("chunk + cat reordered dim 2", function(a)
        local p = a:chunk(2, 2)
        return engine.cat({ p[2], p[1] * 3 }, 2)
      end, { x })
    end)
  end
  it("piece counts use the global size; one all_gather for a sharded split dim, none otherwise", function()
    local x = randn(8, 6)
    local d = dist.distribute_tensor(x, mesh1, { S(1) })
    local cnt, pieces = dist.count_collectives(function() return d:chunk(4, 1) end)
    assert.same(4, #pieces)
    if W > 1 then assert.same(1, total(cnt)) end
    for i = 1, 4 do assert.is_true(diff(pieces[i]:full_tensor(), x:chunk(4, 1)[i]) == 0) end
    local cnt2, pieces2 = dist.count_collectives(function() return d:split(2, 2) end)
    assert.same(3, #pieces2)
    assert.same({}, cnt2)
    assert.same({ S(1) }, pieces2[1].placements)
  end)
end)

describe("sharding: Partial passes through shape ops", function()
  it("view/transpose/narrow/cat of Partial(sum) stay Partial with no collective", function()
    local locals = randn(4, 6)
    local p = dist.DTensor.from_local(locals, mesh1, { Part() }, { run_check = false })
    local full = locals * W
    local cnt, v = dist.count_collectives(function() return p:view(2, 12):t():narrow(1, 3, 5) end)
    assert.same({}, cnt)
    assert.same({ Part() }, v.placements)
    assert.is_true(diff(v:full_tensor(), full:view(2, 12):t():narrow(1, 3, 5)) < 1e-12)
    local cnt2, c = dist.count_collectives(function() return engine.cat({ p, p * 2 }, 1):unsqueeze(1):expand(3, 8, 6) end)
    assert.same({}, cnt2)
    assert.same({ Part() }, c.placements)
    assert.is_true(diff(c:full_tensor(), engine.cat({ full, full * 2 }, 1):unsqueeze(1):expand(3, 8, 6)) < 1e-12)
  end)
end)

describe("sharding: transformer layouts keep the sharding with zero collectives", function()
  local B, T, H, D, V = 2, 3, 4, 2, 8
  local C = H * D
  it("heads sharded (tensor parallel): view/transpose and back, forward and backward", function()
    engine.manual_seed(12)
    local q = randn(B, T, C)
    local dq = dist.distribute_tensor(q, mesh1, { S(3) })
    dq.requires_grad = true
    local cf, heads = dist.count_collectives(function() return dq:view(B, T, H, D):transpose(2, 3) end)
    assert.same({}, cf)
    local W4 = H % W == 0
    if W4 then assert.same({ S(2) }, heads.placements) end
    local cb, merged = dist.count_collectives(function()
      return heads:transpose(2, 3):contiguous():view(B, T, -1)
    end)
    assert.same({}, cb)
    if W4 then assert.same({ S(3) }, merged.placements) end
    assert.is_true(diff(merged:full_tensor(), q) == 0)
    local g = dist.distribute_tensor(randn(B, T, C), mesh1, { S(3) })
    local cg = dist.count_collectives(function() (merged * g):sum():backward() end)
    -- only the scalar loss' Partial -> Replicate (no collective for the views)
    assert.is_true(total(cg) <= 1)
    assert.same({ S(3) }, dq.grad.placements)
    assert.is_true(diff(dq.grad:full_tensor(), g:full_tensor()) == 0)
  end)
  it("batch sharded (data parallel): head split/merge and the logits flatten [B,T,V] -> [B*T,V]", function()
    engine.manual_seed(13)
    local Bd = 2 * W
    local x = randn(Bd, T, C)
    local dx = dist.distribute_tensor(x, mesh1, { S(1) })
    local cf, y = dist.count_collectives(function()
      return dx:view(Bd, T, H, D):transpose(2, 3):transpose(2, 3):contiguous():view(Bd, T, -1)
    end)
    assert.same({}, cf)
    assert.same({ S(1) }, y.placements)
    local logits = dist.distribute_tensor(randn(Bd, T, V), mesh1, { S(1) })
    local cl, flat = dist.count_collectives(function() return logits:reshape(-1, V) end)
    assert.same({}, cl)
    assert.same({ S(1) }, flat.placements)
    assert.same({ Bd * T, V }, flat:shape())
    -- vocab sharded (loss parallel) also keeps Shard on the last dim
    local lv = dist.distribute_tensor(randn(Bd, T, V), mesh1, { S(3) })
    local cv, fv = dist.count_collectives(function() return lv:reshape(-1, V) end)
    assert.same({}, cv)
    assert.same({ S(2) }, fv.placements)
  end)
  it("uneven batch: the flatten replicates first (shards are not whole rows) and stays exact", function()
    if W == 1 then pending("needs more than one rank") return end
    local x = randn(W + 1, 3, 4)
    local d = dist.distribute_tensor(x, mesh1, { S(1) })
    local cnt, flat = dist.count_collectives(function() return d:reshape(-1, 4) end)
    assert.is_true(total(cnt) >= 1)
    assert.is_true(diff(flat:full_tensor(), x:reshape(-1, 4)) == 0)
  end)
  it("2x2 mesh (dp, tp): batch and heads sharded together", function()
    if W ~= 4 then pending("needs 4 ranks") return end
    local mesh2 = conv.meshes("2d")[1]
    engine.manual_seed(14)
    local x = randn(4, T, C)
    local d = dist.distribute_tensor(x, mesh2, { S(1), S(3) })
    local cnt, y = dist.count_collectives(function() return d:view(4, T, H, D):transpose(2, 3) end)
    assert.same({}, cnt)
    assert.same({ S(1), S(2) }, y.placements)
    local cnt2, z = dist.count_collectives(function() return y:transpose(2, 3):contiguous():view(4 * T, C) end)
    assert.same({}, cnt2)
    assert.same({ S(1), S(2) }, z.placements)
    assert.is_true(diff(z:full_tensor(), x:view(4 * T, C)) == 0)
  end)
end)

describe("sharding: shape ops on ranks outside the mesh", function()
  it("outputs are empty with the right ndim; members get the right values", function()
    if W < 4 then pending("needs 4 ranks") return end
    local R = dist.rank()
    local sub = dist.init_device_mesh("cpu", { 2 }, nil, { ranks = { 0, 1 } })
    engine.manual_seed(15)
    local x = randn(4, 3, 2)
    local d = dist.distribute_tensor(x, sub, { S(1) }, { src_data_rank = false })
    d.requires_grad = true
    local idx = dist.distribute_tensor(engine.tensor({ 2, 0 }, { dtype = "i64" }), sub, { Rep() }, { src_data_rank = false })
    local pieces = d:split(1, 2)
    local outs = {
      { d:view(12, 2), x:view(12, 2) },
      { d:transpose(1, 3), x:transpose(1, 3) },
      { d:narrow(1, 2, 2), x:narrow(1, 2, 2) },
      { d:select(3, 2), x:select(3, 2) },
      { d:unsqueeze(2):expand(4, 5, 3, 2), x:unsqueeze(2):expand(4, 5, 3, 2) },
      { engine.cat({ d, d }, 3), engine.cat({ x, x }, 3) },
      { engine.stack({ d, d }, 1), engine.stack({ x, x }, 1) },
      { d:index_select(2, idx), x:index_select(2, engine.tensor({ 2, 0 }, { dtype = "i64" })) },
      { pieces[3], x:split(1, 2)[3] },
    }
    assert.same(3, #pieces)
    local loss = nil
    for _, pair in ipairs(outs) do
      local o, want = pair[1], pair[2]
      assert.equal(want:dim(), o:to_local():dim())
      if R < 2 then assert.is_true(diff(o:full_tensor(), want) == 0)
      else assert.equal(0, o:to_local():numel()) end
      local s = o:sum()
      loss = loss and loss + s or s
    end
    loss:backward()
    assert.equal(3, d.grad:to_local():dim())
    if R < 2 then
      local xr = x:clone(); xr.requires_grad = true
      local l2 = xr:view(12, 2):sum() + xr:transpose(1, 3):sum() + xr:narrow(1, 2, 2):sum() + xr:select(3, 2):sum()
        + xr:unsqueeze(2):expand(4, 5, 3, 2):sum() + engine.cat({ xr, xr }, 3):sum() + engine.stack({ xr, xr }, 1):sum()
        + xr:index_select(2, engine.tensor({ 2, 0 }, { dtype = "i64" })):sum() + xr:split(1, 2)[3]:sum()
      l2:backward()
      assert.is_true(diff(d.grad:full_tensor(), xr.grad) == 0)
    end
  end)
end)
