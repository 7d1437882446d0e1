-- The recommender-style Sharder (lua/engine/distributed/shard_embedding.lua): embedding tables sharded
-- row-wise and column-wise by shard_module, lookups equal to the unsharded collection (forward and
-- gradients) with one collective per table forward and none backward, and recipes/sharded_embedding.lua
-- (small) training to the losses of one process.
local engine = require("engine")
local nn = engine.nn
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local W, R = dist.world_size(), dist.rank()

local TABLES = {
  { name = "user", num_embeddings = 4 * W + 1, embedding_dim = 6 },
  { name = "item", num_embeddings = 7, embedding_dim = 2 * W },
  { name = "cat", num_embeddings = 5, embedding_dim = 3 * W + 1 },
}

local function features(B)
  local f = {
    user = (engine.rand(B, 1) * (4 * W + 1)):floor():long(),
    item = (engine.rand(B, 2) * 7):floor():long(),
    cat = (engine.rand(B, 3) * 5):floor():long(),
  }
  for _, k in ipairs({ "user", "item", "cat" }) do dist.broadcast(f[k], 0) end
  return f
end

local counted = util.counted

describe("EmbeddingCollectionSharder", function()
  it("shards tables row-wise and column-wise; lookups and gradients equal the unsharded collection", function()
    engine.manual_seed(4)
    local ref = dist.EmbeddingCollection(TABLES)
    engine.manual_seed(4)
    local root = nn.Sequential(dist.EmbeddingCollection(TABLES))
    dist.shard_module(root, dist.ShardingPlan{ plan = {
      ["0"] = dist.EmbeddingCollectionSharder{ plan = { user = "row", item = "column", cat = "column" } } } })
    local ec = root[1]
    assert.are.equal("ShardedEmbeddingCollection", ec.__name)
    assert.are.equal("Shard(1)", tostring(ec.tables.user.weight.placements[1]))
    assert.are.equal("Shard(2)", tostring(ec.tables.item.weight.placements[1]))
    assert.are.equal("Shard(2)", tostring(ec.tables.cat.weight.placements[1]))
    assert.is_true(dist.is_sharded_tensor(root:state_dict()["0.tables.user.weight"]))
    local f = features(5)
    local c, y = counted(function() return root(f) end)
    if W > 1 then assert.are.equal("all_gather=2 all_reduce=1", c) end
    assert.is_false(dist.is_dtensor(y))
    local ry = ref(f)
    assert.are.same({ 5, 6 + 2 * W + 3 * W + 1 }, y:shape())
    assert.is_true(util.diff(y, ry) < 1e-5)
    local g = engine.randn(y:shape())
    dist.broadcast(g, 0)
    local cb = counted(function() (y * g):sum():backward() end)
    assert.are.equal("", cb)
    ;(ry * g):sum():backward()
    for _, t in ipairs(TABLES) do
      assert.is_true(util.diff(ec.tables[t.name].weight.grad:full_tensor(), ref.tables[t.name].weight.grad) < 1e-5, t.name)
    end
  end)

  it("bad plans fail naming the table", function()
    local root = nn.Sequential(dist.EmbeddingCollection(TABLES))
    local e = util.errmsg(dist.shard_module, root, dist.ShardingPlan{ plan = {
      ["0"] = dist.EmbeddingCollectionSharder{ plan = { user = "diagonal" } } } })
    assert.is_truthy(e:find("table 'user': sharding must be \"row\" or \"column\", got diagonal", 1, true), e)
    root = nn.Sequential(dist.EmbeddingCollection(TABLES))
    e = util.errmsg(dist.shard_module, root, dist.ShardingPlan{ plan = {
      ["0"] = dist.EmbeddingCollectionSharder{ plan = { users = "row" } } } })
    assert.is_truthy(e:find("the plan names table 'users', which the collection does not have", 1, true), e)
    e = util.errmsg(dist.shard_module, nn.Sequential(nn.Linear(2, 2)), dist.ShardingPlan{ plan = {
      ["0"] = dist.EmbeddingCollectionSharder{} } })
    assert.is_truthy(e:find("EmbeddingCollectionSharder: expected an EmbeddingCollection, got Linear", 1, true), e)
  end)

  it("recipes/sharded_embedding.lua trains to the losses of one process", function()
    local function run(argv)
      local lines = {}
      local G = _G
      local real_print, saved_arg = G.print, G.arg
      G.print = function(...)
        local t = {}
        for i = 1, select("#", ...) do t[i] = tostring(select(i, ...)) end
        lines[#lines + 1] = table.concat(t, "\t")
      end
      G.arg = argv
      local ok, err = pcall(dofile, "recipes/sharded_embedding.lua")
      G.print, G.arg = real_print, saved_arg
      assert(ok, tostring(err))
      return lines
    end
    local args = { "--steps=12", "--log=4", "--users=40", "--items=30", "--batch=16" }
    local sharded = run(args)
    local one = {}
    for i, a in ipairs(args) do one[i] = a end
    one[#one + 1] = "--shard=0"
    local plain = run(one)
    if R == 0 then
      assert.are.equal(5, #sharded)
      assert.is_truthy(sharded[#sharded]:find("^final loss"))
      for i = 1, #plain do
        local a = tonumber(sharded[i]:match("loss ([%d.]+)"))
        local b = tonumber(plain[i]:match("loss ([%d.]+)"))
        assert.is_true(math.abs(a - b) < 2e-6, sharded[i] .. " vs " .. plain[i])
      end
    end
  end)
end)
