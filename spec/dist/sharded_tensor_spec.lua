-- ShardedTensor (torch.distributed._shard), first part: factories over chunk and enumerable specs, local shards exactly as
-- torch.chunk places them (uneven, subsets of ranks, several shards per rank), local_tensor, gather.
local engine = require("engine")
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local W, R = dist.world_size(), dist.rank()

local sharded = require("spec.dist.helpers.sharded")
local ranks, all_ranks = sharded.ranks, sharded.all_ranks

describe("ShardedTensor", function()
  it("chunk spec on dim 1, 10x20 over the ranks: local shards as torch.chunk, gather to the last rank", function()
    local spec = dist.ChunkShardingSpec{ dim = 1, placements = ranks(all_ranks()) }
    local st = dist.sharded_tensor.zeros(spec, { 10, 20 })
    local md = st:metadata()
    local split = math.ceil(10 / W)
    local mine = st:local_shards()
    local want_rows = math.max(0, math.min(split, 10 - split * R))
    assert.are.equal(1, #mine)
    assert.are.same({ want_rows, 20 }, mine[1].tensor:shape())
    assert.are.same({ math.min(split * R, 10), 0 }, mine[1].metadata.shard_offsets)
    assert.are.equal(R, mine[1].metadata.placement.rank)
    assert.are.equal(W, #md.shards_metadata)
    -- fill each shard with its global values, gather to the last rank
    engine.manual_seed(1)
    local full = engine.randn(10, 20)
    local s = mine[1]
    if want_rows > 0 then s.tensor:copy_(full:narrow(1, s.metadata.shard_offsets[1] + 1, want_rows)) end
    local g = st:gather(W - 1)
    if R == W - 1 then assert.are.equal(0, util.diff(g, full)) else assert.is_nil(g) end
    assert.are.same({ 10, 20 }, st:size())
    assert.are.equal(20, st:size(-1))
    assert.are.equal(s.tensor, st:local_tensor())
  end)

  it("gather(dst) is one gather collective: the full tensor on dst, nothing the size of it allocated elsewhere", function()
    local sm = function(o, z, r) return dist.ShardMetadata{ shard_offsets = o, shard_sizes = z, placement = "rank:" .. r .. "/cpu" } end
    local cases = {
      { "chunks on dim 1 in rank order", dist.ChunkShardingSpec{ dim = 1, placements = ranks(all_ranks()) }, { 64 * W, 96 } },
      { "uneven chunks (10 rows)", dist.ChunkShardingSpec{ dim = 1, placements = ranks(all_ranks()) }, { 10, 300 } },
      { "leading unit dim, chunks on dim 2", dist.ChunkShardingSpec{ dim = 2, placements = ranks(all_ranks()) }, { 1, 7 * W + 3, 50 } },
      { "chunks on dim 2 (columns)", dist.ChunkShardingSpec{ dim = 2, placements = ranks(all_ranks()) }, { 40, 32 * W } },
      { "two shards per rank", dist.ChunkShardingSpec{ dim = 1, placements = ranks(all_ranks(2)) }, { 30 * W, 70 } },
      { "all on rank 0", dist.ChunkShardingSpec{ dim = 1, placements = ranks({ 0 }) }, { 50, 60 } },
      { "enumerable, reversed", dist.EnumerableShardingSpec{ sm({ 0, 0 }, { 20, 64 }, W - 1), sm({ 20, 0 }, { 20, 64 }, 0) }, { 40, 64 } },
    }
    local dst = 1 % W
    for _, case in ipairs(cases) do
      for _, single in ipairs({ true, false }) do
        local what = case[1] .. (single and "" or ", single copy off")
        engine.manual_seed(9)
        local full = engine.randn(case[3], { dtype = "f64" })
        local st = dist.sharded_tensor.zeros(case[2], case[3], { dtype = "f64" })
        for _, sh in ipairs(st:local_shards()) do
          local box = full
          for k = 1, #case[3] do box = box:narrow(k, sh.metadata.shard_offsets[k] + 1, sh.metadata.shard_sizes[k]) end
          sh.tensor:copy_(box)
        end
        dist.set_single_copy(single)
        local mine = 0
        for _, sh in ipairs(st:local_shards()) do mine = mine + sh.tensor:numel() * 8 end
        collectgarbage(); collectgarbage()
        engine.reset_peak_memory()
        local before = engine.memory_stats().allocated
        local ok, counts, g = pcall(dist.count_collectives, st.gather, st, dst)
        local peak = engine.memory_stats().peak_allocated - before
        dist.set_single_copy(true)
        assert(ok, counts)
        if W > 1 then assert.are.same({ gather = 1 }, counts, what) end
        if R == dst then
          assert.are.equal(0, util.diff(g, full), what)
        else
          assert.is_nil(g, what)
          -- at most a buffer of this rank's own shards (packed, or a copy of a strided shard), in the
          -- allocator's size classes (at most 1/8 more, page-rounded)
          assert.is_true(peak <= mine + mine / 8 + 4096, string.format("%s: rank %d allocated %d bytes (its shards: %d, the tensor: %d)",
            what, R, peak, mine, full:numel() * 8))
        end
      end
    end
  end)

  it("chunk spec on dim -2 over a subset of ranks: ranks outside hold no shards", function()
    local spec = dist.ChunkShardingSpec{ dim = -2, placements = ranks({ 0 }) }
    local st = dist.sharded_tensor.ones(spec, { 3, 4 }, { dtype = "f64" })
    if R == 0 then
      assert.are.same({ 3, 4 }, st:local_tensor():shape())
      assert.are.equal("f64", st:local_tensor().dtype)
    else
      assert.are.equal(0, #st:local_shards())
      local e = util.errmsg(st.local_tensor, st)
      assert.is_truthy(e:find("Only single local shard is supported", 1, true), e)
    end
    local g = st:gather(0)
    if R == 0 then assert.are.equal(0, util.diff(g, engine.ones(3, 4, { dtype = "f64" }))) end
  end)

  it("several shards per rank (2 placements per rank on dim 2) and an enumerable spec gather back", function()
    local spec = dist.ChunkShardingSpec{ dim = 2, placements = ranks(all_ranks(2)) }
    local st = dist.sharded_tensor.full(spec, { 2, 4 * W + 1 }, 7)
    assert.are.equal(2, #st:local_shards())
    local e = util.errmsg(st.local_tensor, st)
    assert.is_truthy(e:find("Only single local shard is supported (this rank holds 2 shards)", 1, true), e)
    for _, s in ipairs(st:local_shards()) do s.tensor:fill_(s.metadata.shard_offsets[2]) end
    local g = st:gather(0)
    if R == 0 then
      local flat = g:totable()
      for j = 1, 4 * W + 1 do
        local split = math.ceil((4 * W + 1) / (2 * W))
        assert.are.equal(math.floor((j - 1) / split) * split, flat[1][j])
      end
    end
    -- a 2x2 grid of enumerable shards, round-robin over the ranks
    local sm = function(o, s, r) return dist.ShardMetadata{ shard_offsets = o, shard_sizes = s, placement = "rank:" .. r .. "/cpu" } end
    local es = dist.EnumerableShardingSpec{ sm({ 0, 0 }, { 2, 3 }, 0), sm({ 0, 3 }, { 2, 2 }, 1 % W),
      sm({ 2, 0 }, { 1, 3 }, 2 % W), sm({ 2, 3 }, { 1, 2 }, 3 % W) }
    local est = dist.sharded_tensor.zeros(es, { 3, 5 })
    for _, s in ipairs(est:local_shards()) do s.tensor:fill_(10 * s.metadata.shard_offsets[1] + s.metadata.shard_offsets[2]) end
    local out = engine.empty(3, 5)
    local eg = est:gather(0, out)
    if R == 0 then
      assert.are.equal(out, eg)
      assert.are.same({ { 0, 0, 0, 3, 3 }, { 0, 0, 0, 3, 3 }, { 20, 20, 20, 23, 23 } }, out:totable())
    end
  end)

  it("rand / randn give engine.rand / randn of the full size for every spec, and advance the generator alike", function()
    engine.manual_seed(42)
    local want = engine.rand(7, 5)
    local after = engine.rand(3)
    engine.manual_seed(42)
    local wantn = engine.randn(7, 5)
    for _, spec in ipairs({ dist.ChunkShardingSpec{ dim = 1, placements = ranks(all_ranks()) },
                            dist.ChunkShardingSpec{ dim = -1, placements = ranks(all_ranks(2)) },
                            dist.ChunkShardingSpec{ dim = 1, placements = ranks({ W - 1 }) } }) do
      engine.manual_seed(42)
      local st = dist.sharded_tensor.rand(spec, { 7, 5 })
      local nxt = engine.rand(3)                       -- the generator moved on by 35 on every rank
      assert.are.equal(0, util.diff(nxt, after), tostring(spec))
      local g = st:gather(0)
      if R == 0 then assert.are.equal(0, util.diff(g, want), tostring(spec)) end
      engine.manual_seed(42)
      local gn = dist.sharded_tensor.randn(spec, { 7, 5 }):gather(0)
      if R == 0 then assert.are.equal(0, util.diff(gn, wantn), tostring(spec)) end
    end
  end)

  it("init_from_local_shards builds from each rank's shards and fails on every rank for bad ones", function()
    local function md(o, z, r) return dist.ShardMetadata{ shard_offsets = o, shard_sizes = z, placement = "rank:" .. r .. "/cpu" } end
    -- rows of a [2W, 3] tensor: rank r holds rows 2r, 2r+1
    local t = engine.full({ 2, 3 }, R)
    local st = dist.ShardedTensor.init_from_local_shards({ { tensor = t, metadata = md({ 2 * R, 0 }, { 2, 3 }, R) } }, { 2 * W, 3 })
    assert.are.equal(W, #st:metadata().shards_metadata)
    local g = st:gather(0)
    if R == 0 then for r = 0, W - 1 do assert.are.same({ { r, r, r }, { r, r, r } }, g:narrow(1, 2 * r + 1, 2):totable()) end end
    local function bad(list, size, pat)
      local e = util.errmsg(dist.ShardedTensor.init_from_local_shards, list, size)
      assert.is_truthy(e:find(pat, 1, true), e)
    end
    -- a gap (the last rank holds nothing)
    bad(R == W - 1 and {} or { { tensor = t, metadata = md({ 2 * R, 0 }, { 2, 3 }, R) } }, { 2 * W, 3 },
      "the shards cover " .. (6 * (W - 1)) .. " of the " .. (6 * W) .. " elements")
    -- an overlap (every rank claims rows 0..1 at W > 1)
    if W > 1 then bad({ { tensor = t, metadata = md({ 0, 0 }, { 2, 3 }, R) } }, { 2 * W, 3 }, "overlap") end
    -- the last rank's tensor does not match its shard_sizes: every rank names it
    local tl = R == W - 1 and engine.zeros(1, 3) or t
    bad({ { tensor = tl, metadata = md({ 2 * R, 0 }, { 2, 3 }, R) } }, { 2 * W, 3 },
      "rank " .. (W - 1) .. "'s local shard 1 has a tensor whose shape differs from its shard_sizes")
    -- a shard placed on another rank
    bad({ { tensor = t, metadata = md({ 2 * R, 0 }, { 2, 3 }, (R + 1) % (W + 1)) } }, { 2 * W, 3 }, "is placed on another rank")
    -- dtypes that disagree
    if W > 1 then
      local td = R == W - 1 and t:double() or t
      bad({ { tensor = td, metadata = md({ 2 * R, 0 }, { 2, 3 }, R) } }, { 2 * W, 3 }, "disagree on the dtype")
    end
  end)

  it("shard_tensor takes src_rank's data, checks src_rank and spec across ranks with the seed's messages", function()
    engine.manual_seed(100 + R)                       -- every rank has different values
    local t = engine.randn(12, 12)
    local src = W - 1
    local want = t:clone()
    dist.broadcast(want, src)
    local spec = dist.ChunkShardingSpec{ dim = 1, placements = ranks(all_ranks()) }
    local st = dist.shard_tensor(t, spec, { src_rank = src })
    local s = st:local_shards()[1]
    if s.metadata.shard_sizes[1] > 0 then
      assert.are.equal(0, util.diff(s.tensor, want:narrow(1, s.metadata.shard_offsets[1] + 1, s.metadata.shard_sizes[1])))
    end
    local g = st:gather(0)
    if R == 0 then assert.are.equal(0, util.diff(g, want)) end
    if W > 1 then
      local e = util.errmsg(dist.shard_tensor, t, spec, { src_rank = R == 0 and 1 or 0 })
      assert.is_truthy(e:find("does not match with src_rank=", 1, true), e)
      local other = dist.ChunkShardingSpec{ dim = R == 0 and 2 or 1, placements = ranks(all_ranks()) }
      e = util.errmsg(dist.shard_tensor, t, other)
      assert.is_truthy(e:find("does not match with sharding_spec=ChunkShardingSpec(dim=", 1, true), e)
    end
    local e = util.errmsg(dist.shard_tensor, t:t(), spec)
    assert.is_truthy(e:find("input tensor is not a contiguous Tensor", 1, true), e)
    e = util.errmsg(dist.shard_tensor, t, dist.EnumerableShardingSpec{ dist.ShardMetadata{ shard_offsets = { 0, 0 },
      shard_sizes = { 12, 12 }, placement = "rank:0/cpu" } })
    assert.is_truthy(e:find("not implemented yet!", 1, true), e)
  end)

  it("bad input: placements outside the group, bad dst, out of the wrong shape: the same error on every rank", function()
    local e = util.errmsg(dist.sharded_tensor.zeros, dist.ChunkShardingSpec{ dim = 1, placements = ranks({ 0, W }) }, { 4, 4 })
    assert.is_truthy(e:find("shard 2: Global rank " .. W .. " does not exist in input process group: [", 1, true), e)
    e = util.errmsg(dist.sharded_tensor.zeros, "spec", { 4 })
    assert.is_truthy(e:find("must be a ChunkShardingSpec or an EnumerableShardingSpec", 1, true), e)
    local st = dist.sharded_tensor.zeros(dist.ChunkShardingSpec{ dim = 1, placements = ranks(all_ranks()) }, { 4, 2 })
    e = util.errmsg(st.gather, st, W)
    assert.is_truthy(e:find("dst must be a rank of the process group", 1, true), e)
    -- a bad out on dst fails the gather on every rank
    e = util.errmsg(st.gather, st, 0, R == 0 and engine.empty(2, 2) or nil)
    assert.is_truthy(e:find("out has shape [2,2], the ShardedTensor [4,2]", 1, true), e)
    -- so does a dst that differs between the ranks (the gather's signature check)
    if W > 1 then
      e = util.errmsg(st.gather, st, R == 0 and 0 or 1)
      assert.is_truthy(e:find("gather: collective mismatch on group world", 1, true), e)
    end
    local g = st:gather(0)   -- still usable
    if R == 0 then assert.are.same({ 4, 2 }, g:shape()) end
    assert.is_truthy(tostring(st):find("ShardedTensor(f32[4,2], ChunkShardingSpec(dim=1", 1, true))
  end)
end)
