-- ShardedTensor as PyTorch's own tests use it, adapted from
-- test_sharded_tensor_reshard.py, test_sharded_tensor.py (test_new_group, test_init_from_local_shards_new_group,
-- test_invalid_sharding, test_shard_parameter, test_load_state_dict_errors, test_complete_world_size) and
-- test_sharding_plan.py (test_sharding_plan_errors):
--   3  reshard is in place (shards, metadata, spec; the tensor itself returned), and so is _reshard_output's;
--   9  shard_parameter's DTensor Parameter answers local_tensor/local_shards/metadata/sharding_spec/gather;
--   12 placements name global ranks with a process group; an invalid spec raises on every rank, members or not;
--   13 "has no attribute", "Local rank at save time was R, but at load time was -1", sizes as varargs.
local engine = require("engine")
local nn = engine.nn
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local diff, errmsg = util.diff, util.errmsg
local W, R = dist.world_size(), dist.rank()

local sharded = require("spec.dist.helpers.sharded")
local ranks, all_ranks, chunk = sharded.ranks, sharded.all_ranks, sharded.chunk

local function md_rank_sorted(md)
  local l = {}
  for i, s in ipairs(md.shards_metadata) do l[i] = s end
  table.sort(l, function(a, b) return a.placement.rank < b.placement.rank end)
  return l
end

-- _chunk_sharding_specs_list_for_test: chunk specs over every rank in a shuffled order (a fixed permutation
-- here: rotated by `by`)
local function shuffled(dim, by)
  local l = {}
  for i = 0, W - 1 do l[i + 1] = (i + by) % W end
  return chunk(dim, l)
end

describe("item 3: reshard is in place (test_sharded_tensor_reshard)", function()
  it("st:reshard(spec) updates st's local shards, metadata and spec and returns st", function()
    for _, dims in ipairs({ { 1, 1 }, { 1, 2 }, { 2, 1 }, { 2, 2 } }) do
      for _, size in ipairs({ { 13, 21 }, { 14, 23 }, { 15, 26 }, { 12, 24 } }) do
        engine.manual_seed(0)
        local full = engine.rand(size)
        local spec, reshard_spec = shuffled(dims[1], 1), shuffled(dims[2], 2)
        local st = dist.shard_tensor(full, spec)
        local st_compare = dist.shard_tensor(full, reshard_spec)
        local md = st:metadata()
        local what = string.format("%s -> %s, [%d,%d]", tostring(spec), tostring(reshard_spec), size[1], size[2])
        local r = st:reshard(reshard_spec)
        assert.are.equal(st, r, what)
        assert.are.equal(reshard_spec, st:sharding_spec(), what)
        assert.are.equal(1, #st:local_shards(), what)
        assert.are.equal(1, #st_compare:local_shards(), what)
        assert.are.same(md_rank_sorted(st_compare:metadata()), md_rank_sorted(st:metadata()), what)
        -- the metadata object taken before the reshard is the tensor's metadata, updated
        assert.are.equal(md, st:metadata(), what)
        assert.are.equal(0, diff(st:local_tensor(), st_compare:local_tensor()), what)
        assert.are.same(st_compare:local_shards()[1].metadata.shard_offsets, st:local_shards()[1].metadata.shard_offsets)
        assert.is_true(st:equal(st_compare), what)
      end
    end
  end)

  it("layouts without a DTensor form (two shards per rank) are resharded in place too", function()
    engine.manual_seed(1)
    local full = engine.rand(9, 7)
    local st = dist.shard_tensor(full, chunk(1, all_ranks(2)))
    local r = st:reshard(chunk(2, all_ranks(2)))
    assert.are.equal(st, r)
    assert.are.equal(2, #st:local_shards())
    assert.is_true(st:equal(dist.shard_tensor(full, chunk(2, all_ranks(2)))))
  end)

  it("_reshard_output reshards the module's own ShardedTensor output in place (test_reshard_output)", function()
    local Holder = nn.Module:extend("STHolder")
    function Holder:__init(st) self.st = st end
    function Holder:forward() return self.st end
    engine.manual_seed(2)
    local full = engine.rand(2 * W, 6)
    local h = Holder(dist.shard_tensor(full, chunk(1)))
    local out = dist._reshard_output(h, chunk(2))(engine.zeros(1))
    assert.are.equal(h.st, out)
    assert.are.equal(chunk(2), h.st:sharding_spec())
    assert.is_true(h.st:equal(dist.shard_tensor(full, chunk(2))))
  end)

  it("shard_parameter's ShardedTensor resharded in place takes the module's parameter along", function()
    engine.manual_seed(3)
    local m = nn.Linear(8, 2 * W)
    local w = m.weight:detach():clone()
    dist.broadcast(w, 0)
    local st = dist.shard_parameter(m, "weight", chunk(1))
    st:reshard(chunk(2))
    assert.are.equal("Shard(2)", tostring(m.weight.placements[1]))
    assert.is_true(m.weight.requires_grad and m.weight.grad_fn == nil)
    assert.are.equal(chunk(2), m:state_dict().weight:sharding_spec())
    local x = engine.randn(3, 8)
    dist.broadcast(x, 0)
    local y = m(x)
    assert.is_true(diff(dist.is_dtensor(y) and y:full_tensor() or y, x:matmul(w:t()) + m.bias:detach()) < 1e-5)
  end)
end)

describe("item 9: shard_parameter's DTensor Parameter answers the ShardedTensor methods (test_shard_parameter)", function()
  it("local_shards, local_tensor, metadata, sharding_spec, gather(dst, out); torch.gather still works", function()
    local spec = chunk(1)
    engine.manual_seed(4)
    local fc = nn.Linear(12, 4 * W)
    local weight_og = fc.weight:detach():clone()
    dist.broadcast(weight_og, 0)
    dist.shard_parameter(fc, "weight", spec)
    assert.is_true(dist.is_dtensor(fc.weight) and nn.is_parameter(fc.weight))
    local local_shards = fc.weight:local_shards()
    assert.are.equal(1, #local_shards)
    assert.are.same({ 4, 12 }, local_shards[1].tensor:shape())
    assert.are.equal(0, diff(local_shards[1].tensor, weight_og:narrow(1, 4 * R + 1, 4)))
    assert.are.equal(string.format("rank:%d/cpu", R), tostring(local_shards[1].metadata.placement))
    assert.are.equal(fc.weight:to_local():data_ptr(), fc.weight:local_tensor():data_ptr())
    local md = fc.weight:metadata()
    assert.are.equal(W, #md.shards_metadata)
    for i, s in ipairs(md.shards_metadata) do
      assert.are.same({ 4 * (i - 1), 0 }, s.shard_offsets)
      assert.are.equal(string.format("rank:%d/cpu", i - 1), tostring(s.placement))
    end
    assert.are.equal(spec, fc.weight:sharding_spec())
    -- gather(dst, out): out only on dst, as PyTorch's
    local dst = W - 1
    local out = R == dst and engine.zeros(4 * W, 12) or nil
    local g = fc.weight:gather(dst, out)
    if R == dst then
      assert.are.equal(out, g)
      assert.are.equal(0, diff(out, weight_og))
    else
      assert.is_nil(g)
    end
    -- values follow the parameter: an in-place update shows in local_tensor()
    engine.no_grad(function() fc.weight:mul_(2) end)
    assert.are.equal(0, diff(fc.weight:local_tensor(), weight_og:narrow(1, 4 * R + 1, 4) * 2))
    -- torch.gather(dim, index) with an integer index is still the op
    local idx = dist.distribute_tensor(engine.zeros({ 4 * W, 1 }, { dtype = "i64" }), fc.weight.device_mesh, { dist.Shard(1) })
    local picked = fc.weight:gather(2, idx)
    assert.are.equal(0, diff(picked:full_tensor(), weight_og:narrow(2, 1, 1) * 2))
  end)
end)

describe("item 12: placements name global ranks with a process group (test_new_group)", function()
  it("chunk spec over a subgroup: the placements' global ranks hold the shards", function()
    if W < 2 then pending("a proper subgroup needs 2 ranks"); return end
    local members = W == 4 and { 1, 2, 3 } or { 1 }
    local holders = W == 4 and { 2, 3 } or { 1 }
    local pg = dist.new_group(members)
    local spec = dist.ChunkShardingSpec{ dim = 1, placements = ranks(holders) }
    local st = dist.sharded_tensor.ones(spec, 10, 20, { process_group = pg })
    local mine = st:local_shards()
    local rows = 10 / #holders
    if R >= holders[1] then
      assert.are.equal(1, #mine)
      assert.are.same({ rows, 20 }, mine[1].tensor:shape())
      assert.are.equal(string.format("rank:%d/cpu", R), tostring(mine[1].metadata.placement))
    else
      assert.are.equal(0, #mine)
    end
    local md = st:metadata()
    assert.are.equal(#holders, #md.shards_metadata)
    for i, s in ipairs(md.shards_metadata) do
      assert.are.same({ (i - 1) * rows, 0 }, s.shard_offsets)
      assert.are.equal(string.format("rank:%d/cpu", holders[i]), tostring(s.placement))
    end
    -- collectives of the group: gather to group rank 0 (global rank members[1]), reshard
    if pg:is_member() then
      for i, s in ipairs(st:local_shards()) do s.tensor:fill_(s.metadata.shard_offsets[1] + i) end
      local want = engine.ones(10, 20)
      for i, s in ipairs(md.shards_metadata) do want:narrow(1, s.shard_offsets[1] + 1, rows):fill_(s.shard_offsets[1] + 1) end
      local g = st:gather(0)
      if R == members[1] then assert.are.equal(0, diff(g, want)) else assert.is_nil(g) end
      local all = dist.ChunkShardingSpec{ dim = 2, placements = ranks(members) }
      st:reshard(all)
      assert.are.equal(all, st:sharding_spec())
      local s = st:local_shards()[1]
      assert.are.equal(0, diff(s.tensor, want:narrow(2, s.metadata.shard_offsets[2] + 1, s.metadata.shard_sizes[2])))
    end
  end)

  it("enumerable spec over a subgroup (ranks 1 and 3 of {1, 2, 3})", function()
    if W < 4 then pending("the group {1, 2, 3} needs 4 ranks"); return end
    local pg = dist.new_group({ 1, 2, 3 })
    local spec = dist.EnumerableShardingSpec{
      dist.ShardMetadata{ shard_offsets = { 0, 0 }, shard_sizes = { 5, 5 }, placement = "rank:1/cpu" },
      dist.ShardMetadata{ shard_offsets = { 5, 0 }, shard_sizes = { 5, 5 }, placement = "rank:3/cpu" },
    }
    local st = dist.sharded_tensor.empty(spec, 10, 5, { process_group = pg })
    assert.are.same({ 10, 5 }, st:size())
    if R == 1 or R == 3 then
      local s = st:local_shards()[1]
      assert.are.same({ 5, 5 }, s.tensor:shape())
      assert.are.same({ math.floor(R / 2) * 5, 0 }, s.metadata.shard_offsets)
      assert.are.equal(string.format("rank:%d/cpu", R), tostring(s.metadata.placement))
    else
      assert.are.equal(0, #st:local_shards())
    end
    assert.are.equal(2, #st:metadata().shards_metadata)
  end)

  it("init_from_local_shards over a subgroup names global ranks (test_init_from_local_shards_new_group)", function()
    if W < 2 then pending("a proper subgroup needs 2 ranks"); return end
    local members = W == 4 and { 1, 2, 3 } or { 1 }
    local pg = dist.new_group(members)
    if R == 0 then return end
    local md = dist.ShardMetadata{ shard_offsets = { 5 * (R - 1), 0 }, shard_sizes = { 5, 5 }, placement = "rank:" .. R .. "/cpu" }
    local st = dist.ShardedTensor.init_from_local_shards({ { tensor = engine.randn(5, 5), metadata = md } }, { 5 * #members, 5 },
      { process_group = pg })
    local s = st:local_shards()[1]
    assert.are.same({ (R - 1) * 5, 0 }, s.metadata.shard_offsets)
    assert.are.equal("rank:" .. R .. "/cpu", tostring(s.metadata.placement))
    local all = st:metadata().shards_metadata
    assert.are.equal(#members, #all)
    for i, x in ipairs(all) do
      assert.are.same({ (i - 1) * 5, 0 }, x.shard_offsets)
      assert.are.equal("rank:" .. i .. "/cpu", tostring(x.placement))
    end
    -- a placement outside the group: every member raises it
    local bad = dist.ShardMetadata{ shard_offsets = { 5 * (R - 1), 0 }, shard_sizes = { 5, 5 }, placement = "rank:0/cpu" }
    local e = errmsg(dist.ShardedTensor.init_from_local_shards, { { tensor = engine.randn(5, 5), metadata = bad } },
      { 5 * #members, 5 }, { process_group = pg })
    assert.is_truthy(e:find("is placed on another rank", 1, true), e)
  end)

  it("an invalid spec raises on every rank, also outside the group (test_invalid_sharding)", function()
    local e = errmsg(dist.sharded_tensor.empty, dist.ChunkShardingSpec{ dim = 1, placements = { "rank:" .. (W + 1) .. "/cpu" } }, 10, 20)
    assert.is_truthy(e:find("Global rank " .. (W + 1) .. " does not exist in input process group", 1, true), e)
    if W < 2 then return end
    local members = W == 4 and { 1, 2, 3 } or { 1 }
    local pg = dist.new_group(members)
    local spec = dist.ChunkShardingSpec{ dim = 1, placements = ranks({ 0, members[#members] }) }
    for _, f in ipairs({ "empty", "zeros", "ones", "rand", "randn" }) do
      e = errmsg(dist.sharded_tensor[f], spec, { 10, 20 }, { process_group = pg })
      assert.is_truthy(e:find("Global rank 0 does not exist in input process group: [" .. table.concat(members, ", ") .. "]", 1, true),
        f .. ": " .. e)
    end
    e = errmsg(dist.sharded_tensor.full, spec, { 10, 20 }, 1, { process_group = pg })
    assert.is_truthy(e:find("Global rank 0 does not exist", 1, true), e)
    -- the group's own ranks are fine on every rank, members or not
    local ok = dist.sharded_tensor.zeros(dist.ChunkShardingSpec{ dim = 1, placements = ranks(members) }, 10, 20,
      { process_group = pg })
    assert.are.equal(pg:is_member() and 1 or 0, #ok:local_shards())
  end)
end)

describe("item 13: PyTorch's messages and call forms", function()
  local MLP = nn.Module:extend("SimpleMegatronLM")
  function MLP:__init()
    self.fc1 = nn.Linear(4, 4 * W)
    self.fc2 = nn.Linear(4 * W, 4)
  end
  function MLP:forward(x) return self.fc2(self.fc1(x)) end

  it("a plan naming a missing submodule or parameter: has no attribute (test_sharding_plan_errors)", function()
    local m = MLP()
    local e = errmsg(dist.shard_module, m, dist.ShardingPlan{ plan = { ["fc3.weight"] = chunk(1) } })
    assert.is_truthy(e:find("SimpleMegatronLM has no attribute `fc3`", 1, true), e)
    e = errmsg(dist.shard_module, m, dist.ShardingPlan{ plan = { ["fc1.biass"] = chunk(1) } })
    assert.is_truthy(e:find("Linear has no attribute `biass`", 1, true), e)
    e = errmsg(dist.shard_module, m, dist.ShardingPlan{ plan = {}, output_plan = { fc3 = chunk(1) } })
    assert.is_truthy(e:find("has no attribute `fc3`", 1, true), e)
    e = errmsg(m.get_submodule, m, "fc1.weight.x")
    assert.is_truthy(e:find("`weight` is not an nn.Module", 1, true), e)
    -- nothing was sharded; the ranks still agree
    assert.is_false(dist.is_dtensor(m.fc1.weight))
    dist.shard_module(m, dist.ShardingPlan{ plan = { ["fc1.weight"] = chunk(1) } })
    assert.is_true(dist.is_dtensor(m.fc1.weight))
  end)

  it("a load on a rank outside the load group: Local rank at save time was R, but at load time was -1", function()
    if W < 2 then pending("a rank outside the group needs 2 ranks"); return end
    local t = engine.tensor({ os.time() % 100000, math.floor(os.clock() * 1e6) % 100000 }, "i64")
    dist.broadcast(t, 0)
    local v = t:totable()
    local base = string.format("/tmp/engine_st_fid_%d_%d", v[1], v[2])
    local path = base .. "_rank{rank}.safetensors"
    local m = MLP()
    dist.shard_parameter(m.fc1, "weight", chunk(1))
    dist.sharded_tensor.save(path, m:state_dict())
    -- test_load_state_dict_errors: the group {0, 2, 3} at 4 ranks, {0} at 2
    local members = W == 4 and { 0, 2, 3 } or { 0 }
    local pg = dist.new_group(members)
    local e = errmsg(dist.load_with_process_group, pg, function() return dist.sharded_tensor.load(path) end)
    if R == 0 then
      assert.is_truthy(e:find("Local world size at save time was " .. W .. ", but at load time was " .. #members, 1, true), e)
    elseif pg:is_member() then
      assert.is_truthy(e:find("Local rank at save time was " .. R .. ", but at load time was " .. pg:rank(), 1, true), e)
    else
      assert.is_truthy(e:find("Local rank at save time was " .. R .. ", but at load time was -1", 1, true), e)
    end
    dist.barrier()
    os.remove(base .. "_rank" .. R .. ".safetensors")
  end)

  it("factories take the sizes as varargs (test_complete_world_size: sharded_tensor.empty(spec, 10, 20))", function()
    local spec = chunk(1)
    local st = dist.sharded_tensor.empty(spec, 10, 20)
    assert.are.same({ 10, 20 }, st:size())
    local split = math.ceil(10 / W)
    local rows = math.max(0, math.min(split, 10 - split * R))
    assert.are.same({ rows, 20 }, st:local_shards()[1].tensor:shape())
    local z = dist.sharded_tensor.zeros(spec, 10, 20, { dtype = "f64" })
    assert.are.equal("f64", z.dtype)
    assert.are.same({ 10, 20 }, dist.sharded_tensor.ones(spec, 10, 20):size())
    engine.manual_seed(6)
    local want = engine.rand(10, 20)
    engine.manual_seed(6)
    local r = dist.sharded_tensor.rand(spec, 10, 20)
    local g = r:gather(0)
    if R == 0 then assert.are.equal(0, diff(g, want)) end
    -- the list form still works, and a bad size still names the problem
    assert.are.same({ 10, 20 }, dist.sharded_tensor.zeros(spec, { 10, 20 }):size())
    local e = errmsg(dist.sharded_tensor.empty, spec, 10, "x")
    assert.is_truthy(e:find("options must be a table", 1, true), e)
  end)
end)
