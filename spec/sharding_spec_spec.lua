-- ShardedTensor metadata (torch.distributed._shard, pytorch-semantics 1.8): ChunkShardingSpec boxes as torch.chunk
-- gives them, EnumerableShardingSpec checks (overlap, bounds, cover), ShardMetadata, placements,
-- equality and printing.  The ShardedTensor itself: spec/dist/sharded_tensor_spec.lua.
local engine = require("engine")
local dist = engine.distributed

local function errmsg(fn, ...)
  local ok, e = pcall(fn, ...)
  assert(not ok, "expected an error")
  return tostring(e)
end

local function boxes(md)
  local r = {}
  for i, s in ipairs(md.shards_metadata) do
    r[i] = { s.shard_offsets, s.shard_sizes, tostring(s.placement) }
  end
  return r
end

local function ranks(...)
  local r = {}
  for i, k in ipairs({ ... }) do r[i] = "rank:" .. k .. "/cpu" end
  return r
end

describe("ChunkShardingSpec", function()
  it("chunks dim 1 as torch.chunk: 10x20 over 4 ranks gives rows 3, 3, 3, 1", function()
    local md = dist.ChunkShardingSpec{ dim = 1, placements = ranks(0, 1, 2, 3) }:build_metadata({ 10, 20 })
    assert.are.same({
      { { 0, 0 }, { 3, 20 }, "rank:0/cpu" }, { { 3, 0 }, { 3, 20 }, "rank:1/cpu" },
      { { 6, 0 }, { 3, 20 }, "rank:2/cpu" }, { { 9, 0 }, { 1, 20 }, "rank:3/cpu" } }, boxes(md))
    assert.are.same({ 10, 20 }, md.size)
    assert.are.equal("f32", md.tensor_properties.dtype)
  end)

  it("dim -1 and -2 count from the end; even sizes; trailing empty chunks start at the end", function()
    local a = dist.ChunkShardingSpec{ dim = -2, placements = ranks(0, 1) }:build_metadata({ 4, 6 })
    local b = dist.ChunkShardingSpec{ dim = 1, placements = ranks(0, 1) }:build_metadata({ 4, 6 })
    assert.is_true(a == b)
    local c = dist.ChunkShardingSpec{ dim = -1, placements = ranks(0, 1, 2) }:build_metadata({ 4, 6 })
    assert.are.same({ { { 0, 0 }, { 4, 2 }, "rank:0/cpu" }, { { 0, 2 }, { 4, 2 }, "rank:1/cpu" },
      { { 0, 4 }, { 4, 2 }, "rank:2/cpu" } }, boxes(c))
    local e = dist.ChunkShardingSpec{ dim = 1, placements = ranks(0, 1, 2, 3) }:build_metadata({ 3, 2 })
    assert.are.same({ { { 0, 0 }, { 1, 2 }, "rank:0/cpu" }, { { 1, 0 }, { 1, 2 }, "rank:1/cpu" },
      { { 2, 0 }, { 1, 2 }, "rank:2/cpu" }, { { 3, 0 }, { 0, 2 }, "rank:3/cpu" } }, boxes(e))
  end)

  it("placements may name a subset of ranks, or a rank several times (8 placements over 4 ranks)", function()
    local sub = dist.ChunkShardingSpec{ dim = 1, placements = ranks(1, 3) }:build_metadata({ 5, 2 })
    assert.are.same({ { { 0, 0 }, { 3, 2 }, "rank:1/cpu" }, { { 3, 0 }, { 2, 2 }, "rank:3/cpu" } }, boxes(sub))
    local many = dist.ChunkShardingSpec{ dim = 2, placements = ranks(0, 1, 2, 3, 0, 1, 2, 3) }:build_metadata({ 2, 16 })
    assert.are.equal(8, #many.shards_metadata)
    for i, s in ipairs(many.shards_metadata) do
      assert.are.same({ 0, 2 * (i - 1) }, s.shard_offsets)
      assert.are.same({ 2, 2 }, s.shard_sizes)
      assert.are.equal((i - 1) % 4, s.placement.rank)
    end
    local gpu = dist.ChunkShardingSpec{ dim = 1, placements = { "rank:0/cuda:0", "rank:1/cuda:1" } }
    assert.are.equal("cuda:1", gpu.placements[2].device)
  end)

  it("compares, prints, and rejects bad dims and placements", function()
    local a = dist.ChunkShardingSpec{ dim = 1, placements = ranks(0, 1) }
    assert.is_true(a == dist.ChunkShardingSpec{ dim = 1, placements = { "rank:0/cpu", { rank = 1, device = "cpu" } } })
    assert.is_false(a == dist.ChunkShardingSpec{ dim = 2, placements = ranks(0, 1) })
    assert.is_false(a == dist.ChunkShardingSpec{ dim = 1, placements = ranks(1, 0) })
    assert.are.equal("ChunkShardingSpec(dim=1, placements=[rank:0/cpu, rank:1/cpu])", tostring(a))
    local e = errmsg(dist.ChunkShardingSpec, { dim = 0, placements = ranks(0) })
    assert.is_truthy(e:find("dim 0 is invalid: dims are 1-based", 1, true), e)
    e = errmsg(function() return a:build_metadata({ 4 }) == nil or dist.ChunkShardingSpec{ dim = 3, placements = ranks(0) }:build_metadata({ 4, 4 }) end)
    assert.is_truthy(e:find("dim 3 is out of range for a 2-d tensor", 1, true), e)
    e = errmsg(dist.ChunkShardingSpec, { dim = 1, placements = { "gpu0" } })
    assert.is_truthy(e:find("placement 'gpu0' must be \"rank:R/cpu\"", 1, true), e)
    e = errmsg(dist.ChunkShardingSpec, { dim = 1, placements = {} })
    assert.is_truthy(e:find("placements must be a non-empty list", 1, true), e)
    e = errmsg(dist.ChunkShardingSpec, { dim = 1, placement = ranks(0) })
    assert.is_truthy(e:find("unknown field 'placement'", 1, true), e)
  end)
end)

describe("EnumerableShardingSpec and ShardMetadata", function()
  local function sm(o, s, r) return dist.ShardMetadata{ shard_offsets = o, shard_sizes = s, placement = "rank:" .. r .. "/cpu" } end

  it("a 2x2 grid of shards covering the tensor builds its metadata", function()
    local spec = dist.EnumerableShardingSpec{ sm({ 0, 0 }, { 5, 5 }, 0), sm({ 0, 5 }, { 5, 5 }, 1),
      sm({ 5, 0 }, { 5, 5 }, 2), sm({ 5, 5 }, { 5, 5 }, 3) }
    local md = spec:build_metadata({ 10, 10 }, dist.TensorProperties{ dtype = "bf16", requires_grad = true })
    assert.are.equal(4, #md.shards_metadata)
    assert.are.equal("bf16", md.tensor_properties.dtype)
    assert.is_true(md.tensor_properties.requires_grad)
    assert.is_true(md == spec:build_metadata({ 10, 10 }, dist.TensorProperties{ dtype = "bf16", requires_grad = true }))
    assert.is_false(md == spec:build_metadata({ 10, 10 }))
    assert.is_truthy(tostring(spec):find("ShardMetadata(shard_offsets=[5, 5], shard_sizes=[5, 5], placement=rank:3/cpu)", 1, true))
  end)

  it("rejects overlapping shards at construction, naming both", function()
    local e = errmsg(dist.EnumerableShardingSpec, { sm({ 0, 0 }, { 5, 5 }, 0), sm({ 4, 4 }, { 5, 5 }, 1) })
    assert.is_truthy(e:find("shards 1 (offsets [0,0] sizes [5,5]) and 2 (offsets [4,4] sizes [5,5]) overlap", 1, true), e)
    -- touching is not overlapping; empty shards overlap nothing
    dist.EnumerableShardingSpec{ sm({ 0, 0 }, { 5, 5 }, 0), sm({ 5, 0 }, { 5, 5 }, 1), sm({ 2, 2 }, { 0, 3 }, 2) }
  end)

  it("build_metadata rejects shards out of bounds or that leave a gap", function()
    local spec = dist.EnumerableShardingSpec{ sm({ 0, 0 }, { 5, 5 }, 0), sm({ 5, 0 }, { 5, 5 }, 1) }
    local e = errmsg(spec.build_metadata, spec, { 10, 4 })
    assert.is_truthy(e:find("shard 1 (offsets [0,0] sizes [5,5]) is out of bounds of the tensor [10,4] on dim 2", 1, true), e)
    e = errmsg(spec.build_metadata, spec, { 10, 6 })
    assert.is_truthy(e:find("the shards cover 50 of the 60 elements of the tensor [10,6]", 1, true), e)
    e = errmsg(spec.build_metadata, spec, { 10, 5, 1 })
    assert.is_truthy(e:find("shard 1 has 2 dims, the tensor has 3", 1, true), e)
  end)

  it("ShardMetadata checks its fields with PyTorch's messages", function()
    local e = errmsg(dist.ShardMetadata, { shard_offsets = { 0, 0 }, shard_sizes = { 5 }, placement = "rank:0/cpu" })
    assert.is_truthy(e:find("shard_offsets and shard_sizes should have the same number of elements, found 2 and 1", 1, true), e)
    e = errmsg(dist.ShardMetadata, { shard_offsets = { -1 }, shard_sizes = { 5 } })
    assert.is_truthy(e:find("shard_offsets[1] must be a non-negative integer, got -1", 1, true), e)
    e = errmsg(dist.ShardMetadata, { shard_offsets = { 0 }, shard_sizes = { 1 }, placement = "rank:x/cpu" })
    assert.is_truthy(e:find("placement 'rank:x/cpu'", 1, true), e)
    local a = sm({ 1, 2 }, { 3, 4 }, 1)
    assert.is_true(a == sm({ 1, 2 }, { 3, 4 }, 1))
    assert.is_false(a == sm({ 1, 2 }, { 3, 4 }, 0))
    assert.are.equal(12, a:numel())
    local e2 = errmsg(dist.ShardedTensorMetadata, { shards_metadata = { a }, size = { 3, 4 } })
    assert.is_truthy(e2:find("out of bounds", 1, true), e2)
  end)
end)
