-- ShardedTensor (torch.distributed._shard), second part: *_like factories, reshard (one all_to_all), elementwise ops and
-- comparisons, and the DTensor bridge (to_dtensor / from_dtensor without copies; ops through the
-- DTensor dispatcher; specs without a DTensor equivalent fail naming the spec).
local engine = require("engine")
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local W, R = dist.world_size(), dist.rank()

local sharded = require("spec.dist.helpers.sharded")
local ranks, all_ranks, chunk = sharded.ranks, sharded.all_ranks, sharded.chunk

-- The full tensor of st on every rank (gather to 0, then broadcast).
local function full_of(st)
  local g = st:gather(0) or engine.empty(st:size(), { dtype = st.dtype })
  dist.broadcast(g, 0)
  return g
end

describe("ShardedTensor ops", function()
  it("*_like factories keep spec, size, dtype and group; rand_like is engine.rand of the full size", function()
    local spec = chunk(1)
    local st = dist.sharded_tensor.zeros(spec, { 10, 6 }, { dtype = "f64" })
    local o = dist.sharded_tensor.ones_like(st)
    assert.are.equal(spec, o:sharding_spec())
    assert.are.equal("f64", o.dtype)
    assert.are.same({ 10, 6 }, o:size())
    assert.are.equal(0, util.diff(full_of(o), engine.ones(10, 6, { dtype = "f64" })))
    local f = dist.sharded_tensor.full_like(st, 3.5, { dtype = "f32" })
    assert.are.equal("f32", f.dtype)
    assert.are.equal(0, util.diff(full_of(f), engine.full({ 10, 6 }, 3.5)))
    assert.are.equal(0, util.diff(full_of(dist.sharded_tensor.zeros_like(o)), engine.zeros(10, 6, { dtype = "f64" })))
    assert.are.same({ 10, 6 }, dist.sharded_tensor.empty_like(st):size())
    engine.manual_seed(7)
    local want = engine.randn(10, 6, { dtype = "f64" })
    engine.manual_seed(7)
    assert.are.equal(0, util.diff(full_of(dist.sharded_tensor.randn_like(st)), want))
    local e = util.errmsg(dist.sharded_tensor.zeros_like, engine.zeros(2))
    assert.is_truthy(e:find("zeros_like: expected a ShardedTensor", 1, true), e)
  end)

  it("reshard dim 1 -> dim 2 equals a direct shard, with one all_to_all (even, uneven, subset, 2 per rank)", function()
    engine.manual_seed(3)
    for _, case in ipairs({
      { size = { 12, 12 }, from = chunk(1), to = chunk(2) },
      { size = { 10, 7 }, from = chunk(1), to = chunk(-1) },
      { size = { 9, 5 }, from = chunk(2, all_ranks(2)), to = chunk(1, { W - 1 }) },
      { size = { 6, 4, 5 }, from = chunk(3, { 0 }), to = chunk(1, all_ranks(2)) },
    }) do
      local full = engine.randn(case.size)
      dist.broadcast(full, 0)
      local st = dist.shard_tensor(full, case.from)
      local counts, r = dist.count_collectives(st.reshard, st, case.to)
      if W > 1 then assert.are.same({ all_to_all = 1 }, counts, tostring(case.to))
      else assert.is_true((counts.all_to_all or 0) <= 1 and next(counts, next(counts)) == nil) end   -- 1 rank: may be a no-op
      assert.are.equal(case.to, r:sharding_spec())
      local direct = dist.shard_tensor(full, case.to)
      local a, b = r:local_shards(), direct:local_shards()
      assert.are.equal(#b, #a)
      for i = 1, #a do
        assert.are.same(b[i].metadata, a[i].metadata)
        assert.are.equal(0, util.diff(a[i].tensor, b[i].tensor))
      end
      assert.is_true(r:equal(direct))
    end
    local st = dist.sharded_tensor.zeros(chunk(1), { 4, 4 })
    assert.are.equal(st, st:reshard(chunk(1)))
    local e = util.errmsg(st.reshard, st, "dim 2")
    assert.is_truthy(e:find("reshard: resharding_spec must be a ChunkShardingSpec", 1, true), e)
  end)

  it("overlap-block reshard moves each box once between the ranks (single copy) or packed: equal values", function()
    -- layouts no DTensor expresses (several shards per rank, uneven, placements out of rank order,
    -- ranks without shards, 3-d), large enough runs (>= 256 bytes) for the single-copy path; each
    -- with single copy on (one exchange when the group allows it) and forced off (the packed
    -- all_to_all): one all_to_all either way, values equal a direct shard
    local usable = dist.world_group():single_copy_usable()
    local rev = {}
    for i = 2 * W, 1, -1 do rev[#rev + 1] = (i - 1) % W end
    local ends = W > 1 and { 0, W - 1 } or { 0 }
    for i, case in ipairs({
      { size = { 99, 410 }, dtype = "f64", from = chunk(1, all_ranks(2)), to = chunk(2, all_ranks(2)) },
      { size = { 130, 1030 }, dtype = "f32", from = chunk(2, rev), to = chunk(1, all_ranks(2)) },
      { size = { 6, 40, 280 }, dtype = "f64", from = chunk(2, all_ranks(2)), to = chunk(3, rev) },
      { size = { 64, 600 }, dtype = "f32", from = chunk(1, ends), to = chunk(2, all_ranks(2)) },
    }) do
      engine.manual_seed(40 + i)
      local full = engine.randn(case.size, { dtype = case.dtype })
      dist.broadcast(full, 0)
      local direct = dist.shard_tensor(full, case.to)
      for _, on in ipairs({ true, false }) do
        local st = dist.shard_tensor(full, case.from)   -- (reshard is in place)
        dist.set_single_copy(on)
        local n0 = dist.single_copy_count()
        local ok, counts, r = pcall(dist.count_collectives, st.reshard, st, case.to)
        local n = dist.single_copy_count() - n0
        dist.set_single_copy(true)
        assert(ok, counts)
        local what = string.format("case %d, single copy %s", i, tostring(on))
        if W > 1 then assert.are.same({ all_to_all = 1 }, counts, what) end
        assert.are.equal((on and usable and W > 1) and 1 or 0, n, what)
        local a, b = r:local_shards(), direct:local_shards()
        assert.are.equal(#b, #a, what)
        for k = 1, #a do
          assert.are.same(b[k].metadata, a[k].metadata, what)
          assert.are.equal(0, util.diff(a[k].tensor, b[k].tensor), what)
        end
        assert.is_true(r:equal(direct), what)
      end
    end
  end)

  it("shard_tensor and gather of other layouts move each shard once (single copy) or packed: equal values", function()
    local usable = dist.world_group():single_copy_usable()
    local rev = {}
    for i = 2 * W, 1, -1 do rev[#rev + 1] = (i - 1) % W end
    for i, case in ipairs({
      { size = { 99, 410 }, dtype = "f64", spec = chunk(2, rev) },
      { size = { 6, 40, 560 }, dtype = "f32", spec = chunk(3, all_ranks(2)) },
    }) do
      engine.manual_seed(60 + i)
      local full = engine.randn(case.size, { dtype = case.dtype })
      dist.broadcast(full, 0)
      for _, on in ipairs({ true, false }) do
        local what = string.format("case %d, single copy %s", i, tostring(on))
        dist.set_single_copy(on)
        local n0 = dist.single_copy_count()
        local ok, c1, st = pcall(dist.count_collectives, dist.shard_tensor, full, case.spec, { src_rank = W - 1 })
        local n1 = dist.single_copy_count() - n0
        local padded = {}   -- a strided out (rows padded by 3)
        for d, v in ipairs(case.size) do padded[d] = v end
        padded[#padded] = padded[#padded] + 3
        local out = R == 0 and engine.zeros(padded, { dtype = case.dtype }):narrow(#padded, 2, case.size[#padded]) or nil
        local ok2, c2, g = true, nil, nil
        if ok then ok2, c2, g = pcall(dist.count_collectives, st.gather, st, 0, out) end
        local n2 = dist.single_copy_count() - n0 - n1
        dist.set_single_copy(true)
        assert(ok, c1)
        assert(ok2, c2)
        if W > 1 then
          assert.are.same({ scatter = 1 }, c1, what)
          assert.are.same({ gather = 1 }, c2, what)
        end
        local want = (on and usable and W > 1) and 1 or 0
        assert.are.equal(want, n1, what)
        assert.are.equal(want, n2, what)
        for _, sh in ipairs(st:local_shards()) do
          local box = full
          for d = 1, #case.size do box = box:narrow(d, sh.metadata.shard_offsets[d] + 1, sh.metadata.shard_sizes[d]) end
          assert.are.equal(0, util.diff(sh.tensor, box), what)
        end
        if R == 0 then
          assert.are.equal(out, g, what)
          assert.are.equal(0, util.diff(g, full), what)
        else
          assert.is_nil(g, what)
        end
      end
    end
  end)

  it("elementwise ops and comparisons shard by shard; layouts must agree (the same error on every rank)", function()
    engine.manual_seed(11)
    local full = engine.randn(7, 6)
    local spec = chunk(2, all_ranks(2))           -- 2 shards per rank: no DTensor, ops on the local shards
    local a = dist.shard_tensor(full, spec)
    local b = dist.shard_tensor(full * 3, spec)
    assert.is_false(a:is_dtensor_backed())
    local y = ((a * 2 + b) / 5 - 1):relu()
    assert.are.equal(spec, y:sharding_spec())
    assert.is_true(util.diff(full_of(y), ((full * 2 + full * 3) / 5 - 1):relu()) < 1e-6)
    assert.is_true(util.diff(full_of(1 - a), 1 - full) < 1e-6)
    assert.is_true(util.diff(full_of(-a:abs()), -full:abs()) < 1e-6)
    local c = a:gt(0)
    assert.are.equal(full:gt(0).dtype, c.dtype)
    assert.are.equal(0, util.diff(full_of(c), full:gt(0)))
    assert.are.equal(0, util.diff(full_of(a:le(b)), full:le(full * 3)))
    assert.is_true(a:equal(a:clone()))
    assert.is_false(a:equal(b))
    assert.is_true((a * 3):allclose(b))
    assert.is_false(a:equal(dist.shard_tensor(full, chunk(1))))          -- another layout: false everywhere
    local e = util.errmsg(function() return a + dist.shard_tensor(full, chunk(1)) end)
    assert.is_truthy(e:find("add: ShardedTensors of different layouts: [7,6] ChunkShardingSpec(dim=2", 1, true), e)
    e = util.errmsg(function() return a * engine.ones(7, 6) end)
    assert.is_truthy(e:find("mul: a ShardedTensor and a plain tensor of shape [7,6]", 1, true), e)
    assert.is_truthy(tostring(y):find("ShardedTensor(f32[7,6], ChunkShardingSpec(dim=2", 1, true))
  end)

  it("to_dtensor / from_dtensor share storage both ways and round-trip values (even and uneven)", function()
    for _, size in ipairs({ { 4 * W, 3 }, { 10, 3 } }) do
      engine.manual_seed(5)
      local full = engine.randn(size)
      local st = dist.shard_tensor(full, chunk(1))
      local dt = st:to_dtensor()
      assert.is_true(dist.is_dtensor(dt))
      assert.are.same({ dist.Shard(1) }, dt.placements)
      assert.are.same(size, dt:shape())
      assert.are.equal(0, util.diff(dt:full_tensor(), full))
      local loc = st:local_tensor()
      assert.are.equal(loc:data_ptr(), dt:to_local():data_ptr())
      local back = dist.ShardedTensor.from_dtensor(dt)
      assert.are.equal(st:sharding_spec(), back:sharding_spec())
      assert.are.same(st:metadata(), back:metadata())
      assert.are.equal(loc:data_ptr(), back:local_tensor():data_ptr())
      -- writes through one are seen by the other
      if loc:numel() > 0 then
        back:local_tensor():fill_(R + 1)
        assert.are.equal(R + 1, loc:max():item())
      end
      -- from a DTensor made by the DTensor API
      local mesh = dt.device_mesh
      local d2 = dist.distribute_tensor(full, mesh, { dist.Shard(2) })
      local s2 = dist.ShardedTensor.from_dtensor(d2)
      assert.are.equal(chunk(2), s2:sharding_spec())
      assert.are.equal(d2:to_local():data_ptr(), s2:local_tensor():data_ptr())
      assert.are.equal(0, util.diff(full_of(s2), full))
    end
  end)

  it("ops on a DTensor-backed ShardedTensor run through the DTensor dispatcher", function()
    engine.manual_seed(9)
    local full = engine.randn(10, 5)
    local st = dist.shard_tensor(full, chunk(1))
    st:to_dtensor()
    local y = (st * 2 + st):relu()
    assert.is_true(y:is_dtensor_backed())
    assert.is_true(dist.is_dtensor(y:to_dtensor()))
    assert.are.equal(chunk(1), y:sharding_spec())
    assert.is_true(util.diff(full_of(y), (full * 3):relu()) < 1e-6)
    -- a later ShardedTensor of the same ranks finds the mesh: its ops use the DTensor too
    local z = dist.shard_tensor(full, chunk(2)) + 1
    assert.is_true(z:is_dtensor_backed())
    -- a result that is not laid out as the input (a reduction): the DTensor itself
    local s = st:to_dtensor():sum()
    assert.is_true(util.diff(s:full_tensor(), full:sum()) < 1e-4)
    -- reshard through the DTensor: one all_to_all
    local counts, r = dist.count_collectives(st.reshard, st, chunk(2))
    assert.are.same(W > 1 and { all_to_all = 1 } or {}, counts)
    assert.is_true(r:is_dtensor_backed())
    assert.is_true(r:equal(dist.shard_tensor(full, chunk(2))))
  end)

  it("other specs convert when they can (subsets, permutations, chunk-like enumerables), else name the spec", function()
    engine.manual_seed(13)
    local full = engine.randn(6, 4)
    local rev = {}
    for k = W - 1, 0, -1 do rev[#rev + 1] = k end
    for _, spec in ipairs({ chunk(1, rev), chunk(2, { W - 1 }) }) do
      local st = dist.shard_tensor(full, spec)
      local dt = st:to_dtensor()
      local ft = dt:full_tensor()                  -- ranks outside the mesh hold nothing
      if #st:local_shards() > 0 then assert.are.equal(0, util.diff(ft, full), tostring(spec)) end
      local back = dist.ShardedTensor.from_dtensor(dt)
      assert.are.equal(spec, back:sharding_spec())
    end
    local sm = function(o, z, r) return dist.ShardMetadata{ shard_offsets = o, shard_sizes = z, placement = "rank:" .. r .. "/cpu" } end
    local es = dist.EnumerableShardingSpec{ sm({ 3, 0 }, { 3, 4 }, 0), sm({ 0, 0 }, { 3, 4 }, W - 1) }
    local est = dist.sharded_tensor.zeros(es, { 6, 4 })
    if W > 1 then                                  -- rows 3..5 on rank 0, rows 0..2 on the last rank
      local eft = est:to_dtensor():full_tensor()
      if #est:local_shards() > 0 then assert.are.equal(0, util.diff(eft, engine.zeros(6, 4))) end
    end
    local twice = dist.sharded_tensor.zeros(chunk(1, all_ranks(2)), { 8, 2 })
    local e = util.errmsg(twice.to_dtensor, twice)
    assert.is_truthy(e:find("to_dtensor: ChunkShardingSpec(dim=1, placements=[rank:0/cpu", 1, true), e)
    assert.is_truthy(e:find("has no DTensor equivalent: rank 0 holds several shards", 1, true), e)
    local grid = dist.EnumerableShardingSpec{ sm({ 0, 0 }, { 2, 2 }, 0), sm({ 0, 2 }, { 2, 2 }, 0) }
    local g = dist.sharded_tensor.zeros(grid, { 2, 4 })
    e = util.errmsg(g.to_dtensor, g)
    assert.is_truthy(e:find("EnumerableShardingSpec(shards=[", 1, true) and e:find("no DTensor equivalent", 1, true), e)
    local mesh = dist.init_device_mesh("cpu", { W })
    local rep = dist.distribute_tensor(full, mesh, { dist.Replicate() })
    e = util.errmsg(dist.ShardedTensor.from_dtensor, rep)
    assert.is_truthy(e:find("from_dtensor: DTensor", 1, true) and e:find("has no ShardedTensor equivalent", 1, true), e)
    e = util.errmsg(dist.ShardedTensor.from_dtensor, full)
    assert.is_truthy(e:find("expected a DTensor, got a plain tensor", 1, true), e)
  end)
end)
