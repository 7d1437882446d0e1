-- engine.distributed.shard_embedding: a recommender-style use of the Sharder interface (torch.distributed._shard), in
-- the manner of torchrec: a collection of pooled embedding tables, and a Sharder that shards each table
-- row-wise (the vocabulary: ChunkShardingSpec dim 1) or column-wise (the embedding dim: dim 2).
--
--   local ec = dist.EmbeddingCollection{ {name = "user", num_embeddings = 1000, embedding_dim = 16},
--                                        {name = "item", num_embeddings = 500, embedding_dim = 16} }
--   local y = ec{user = user_ids, item = item_ids}   -- ids [B, L] (i64, 0-based) -> [B, 32] (sum-pooled, cat)
--   dist.shard_module(model, dist.ShardingPlan{plan = {
--     emb = dist.EmbeddingCollectionSharder{plan = {user = "row", item = "column"}}}})
--
-- The Sharder returns a ShardedEmbeddingCollection over the same tables whose weights are
-- shard_parameter'd (DTensor Parameters on the group's 1-D mesh): a row-wise lookup is the masked
-- lookup of the local rows (a Partial result, one all_reduce after pooling), a column-wise one looks
-- up the local columns (one all_gather after pooling).  The pooled embeddings come back as plain
-- replicated tensors, so the dense part of the model runs unchanged on every rank; every rank reads
-- the same batch (model parallelism of the tables; no data parallelism here).  Gradients flow back
-- through the DTensor ops (no backward collective: the adjoints are local).
local core = require("engine.core")
local engine = require("engine")
local specs = require("engine.distributed.sharding_spec")

local M = {}

local function fail(msg) core.fail(msg) end
local function nn() return require("engine.nn") end
local function dist() return require("engine.distributed") end

local classes
local function make_classes()
  if classes then return classes end
  local Module = nn().Module
  local EC = Module:extend("EmbeddingCollection")
  function EC:__init(tables, opts)
    local op = "EmbeddingCollection"
    if type(tables) ~= "table" or #tables == 0 then
      fail(op .. ": expected a list of tables {name = ..., num_embeddings = n, embedding_dim = d}")
    end
    self.tables = nn().ModuleDict()
    local order, seen = {}, {}
    for i, t in ipairs(tables) do
      if type(t) ~= "table" or type(t.name) ~= "string" then fail(string.format("%s: table %d needs a name", op, i)) end
      if seen[t.name] then fail(string.format("%s: table name '%s' is used twice", op, t.name)) end
      seen[t.name] = true
      self.tables:add(t.name, nn().Embedding(t.num_embeddings, t.embedding_dim))
      order[i] = t.name
    end
    rawset(self, "_order", order)
    rawset(self, "_pooling", (opts and opts.pooling) or "sum")
  end
  function EC:feature_names() return { unpack(rawget(self, "_order")) } end
  -- One table's pooled [B, D] output (sum over the bag dim of the [B, L, D] lookup).
  function EC:_pooled(name, ids)
    local e = self.tables[name](ids)
    if rawget(self, "_pooling") == "mean" then return e:mean(2) end
    return e:sum(2)
  end
  function EC:forward(features)
    if type(features) ~= "table" or core.is_tensor(features) then
      fail(self.__name .. ": expected a table feature name -> ids [B, L]")
    end
    local outs = {}
    for i, name in ipairs(rawget(self, "_order")) do
      local ids = features[name]
      if not core.is_tensor(ids) then fail(string.format("%s: feature '%s' is missing", self.__name, name)) end
      local p = self:_pooled(name, ids)
      if dist().is_dtensor(p) then p = p:full_tensor() end
      outs[i] = p
    end
    return engine.cat(outs, 2)
  end

  local SEC = EC:extend("ShardedEmbeddingCollection")
  -- Takes over the tables of an EmbeddingCollection (already sharded by the Sharder).
  function SEC:__init(src, layout)
    self.tables = src.tables
    rawset(self, "_order", rawget(src, "_order"))
    rawset(self, "_pooling", rawget(src, "_pooling"))
    rawset(self, "_layout", layout)
  end
  function SEC:extra_repr()
    local l = {}
    for i, name in ipairs(rawget(self, "_order")) do l[i] = name .. "=" .. rawget(self, "_layout")[name] end
    return table.concat(l, ", ")
  end
  classes = { EC = EC, SEC = SEC }
  return classes
end

function M.EmbeddingCollection(tables, opts) return make_classes().EC(tables, opts) end
function M.is_embedding_collection(m)
  return type(m) == "table" and rawget(m, "_cmod") ~= nil and m:is_a(make_classes().EC)
end

-- EmbeddingCollectionSharder{plan = {table = "row" | "column"}, process_group = pg}: tables not in
-- the plan are sharded row-wise.
local function sharder_class()
  if M._Sharder then return M._Sharder end
  local S = require("engine.distributed.shard_api").Sharder:extend("EmbeddingCollectionSharder")
  function S:shard(mod)
    local op = "EmbeddingCollectionSharder"
    if not M.is_embedding_collection(mod) then
      fail(string.format("%s: expected an EmbeddingCollection, got %s", op, type(mod) == "table" and tostring(mod.__name) or type(mod)))
    end
    local pg = self.process_group
    local world = pg and pg:size() or dist().world_size()
    local pls = {}
    for r = 0, world - 1 do pls[#pls + 1] = "rank:" .. r .. "/cpu" end
    local layout = {}
    for _, name in ipairs(rawget(mod, "_order")) do
      local how = (self.plan or {})[name] or "row"
      if how ~= "row" and how ~= "column" then
        fail(string.format("%s: table '%s': sharding must be \"row\" or \"column\", got %s", op, name, tostring(how)))
      end
      layout[name] = how
      dist().shard_parameter(mod.tables[name], "weight", specs.ChunkShardingSpec{ dim = how == "row" and 1 or 2,
        placements = pls }, { src_rank = self.src_rank or 0, process_group = pg })
    end
    for name in pairs(self.plan or {}) do
      if layout[name] == nil then fail(string.format("%s: the plan names table '%s', which the collection does not have", op, name)) end
    end
    return make_classes().SEC(mod, layout)
  end
  M._Sharder = S
  return S
end

function M.EmbeddingCollectionSharder(fields)
  if fields ~= nil and type(fields) ~= "table" then fail("EmbeddingCollectionSharder: expected {plan = {...}, process_group = pg}") end
  return sharder_class()(fields or {})
end

return { EmbeddingCollection = M.EmbeddingCollection, EmbeddingCollectionSharder = M.EmbeddingCollectionSharder,
  is_embedding_collection = M.is_embedding_collection }
