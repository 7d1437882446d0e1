-- recipes/sharded_embedding.lua: a recommender (click prediction) with its embedding tables sharded by
-- a Sharder (torch.distributed._shard's shard_module, torchrec-style): the user and item tables row-wise (each rank
-- holds a slice of the vocabulary), the category and hour tables column-wise (each rank holds a slice
-- of the embedding dim).  Trained on synthetic click data (a hidden user x item affinity decides the
-- clicks); every rank reads the same batches, so the losses equal one process's (--shard=0: the same
-- model unsharded).
--
--   mpirun -np 4 build/engine recipes/sharded_embedding.lua
--   build/engine recipes/sharded_embedding.lua --shard=0          # one process, the same losses
--
-- Options (--help lists them): --steps 200, --batch 64, --users 200, --items 120, --dim 16, --lr 0.02 (AdamW),
-- --seed 1, --log 50 (steps between loss lines), --shard 1.
-- Prints "step N | loss X" lines, then "final loss X | accuracy Y".
local engine = require("engine")
local nn = engine.nn
local F = nn.functional
local dist = engine.distributed

local opts = require("engine.cli").parse(arg or {}, { name = "sharded_embedding",
  description = "A click-prediction model with its embedding tables sharded by a Sharder (row-wise user and item "
    .. "tables, column-wise category and hour tables), trained on synthetic clicks; every rank reads the same "
    .. "batches, so the losses equal one process's (--shard=0).",
  options = {
    { "steps", 200, "optimizer steps", int = true, min = 1 },
    { "batch", 64, "rows per step", int = true, min = 1 },
    { "users", 200, "rows of the user table", int = true, min = 1 },
    { "items", 120, "rows of the item table", int = true, min = 1 },
    { "dim", 16, "embedding dim of the user, item and category tables", int = true, min = 1 },
    { "lr", 0.02, "AdamW learning rate", min = 0 },
    { "seed", 1, "seed of the data and the model", int = true },
    { "log", 50, "steps between loss lines", int = true, min = 1 },
    { "shard", 1, "1: tables sharded over the ranks; 0: the same model unsharded", int = true, choices = { 0, 1 } },
  } })
local R = dist.rank()
local CATS, HOURS, BAG = 40, 24, 3

-- ---------------------------------------------------------------- the model
local Model = nn.Module:extend("ClickModel")
function Model:__init(o)
  self.emb = dist.EmbeddingCollection{
    { name = "user", num_embeddings = o.users, embedding_dim = o.dim },
    { name = "item", num_embeddings = o.items, embedding_dim = o.dim },
    { name = "category", num_embeddings = CATS, embedding_dim = o.dim },
    { name = "hour", num_embeddings = HOURS, embedding_dim = 8 },
  }
  self.over = nn.Sequential(nn.Linear(3 * o.dim + 8, 32), nn.ReLU(), nn.Linear(32, 2))
end
function Model:forward(features) return self.over(self.emb(features)) end

engine.manual_seed(opts.seed)
local model = Model(opts)
if opts.shard ~= 0 then
  dist.shard_module(model, dist.ShardingPlan{ plan = {
    emb = dist.EmbeddingCollectionSharder{ plan = { user = "row", item = "row", category = "column", hour = "column" } },
  } })
end
local optimizer = engine.optim.AdamW(model:parameters(), { lr = opts.lr, weight_decay = 0 })

-- ---------------------------------------------------------------- synthetic clicks
-- Hidden preferences (the same on every rank: the generator is seeded alike): a click when a user's
-- and an item's appeal plus the hour's, the first category's and a small user x item affinity is positive.
engine.manual_seed(opts.seed + 1000)
local hidden_u = engine.randn(opts.users, 4)
local hidden_i = engine.randn(opts.items, 4)
local user_bias, item_bias = engine.randn(opts.users), engine.randn(opts.items)
local hour_bias, cat_bias = engine.randn(HOURS) * 0.5, engine.randn(CATS) * 0.5

local function batch()
  local B = opts.batch
  local u = (engine.rand(B, 1) * opts.users):floor():long()
  local it = (engine.rand(B, 1) * opts.items):floor():long()
  local cat = (engine.rand(B, BAG) * CATS):floor():long()
  local h = (engine.rand(B, 1) * HOURS):floor():long()
  local ur, ir = u:reshape(B), it:reshape(B)
  local score = (hidden_u:index_select(1, ur) * hidden_i:index_select(1, ir)):sum(2) * 0.3
    + user_bias:index_select(1, ur) + item_bias:index_select(1, ir) + hour_bias:index_select(1, h:reshape(B))
    + cat_bias:index_select(1, cat:narrow(2, 1, 1):reshape(B))
  local label = score:gt(0):long()
  return { user = u, item = it, category = cat, hour = h }, label
end

-- ---------------------------------------------------------------- training
engine.manual_seed(opts.seed + 2000)
local loss_v
for step = 1, opts.steps do
  local features, label = batch()
  local logits = model(features)
  local loss = F.cross_entropy(logits, label)
  optimizer:zero_grad()
  loss:backward()
  optimizer:step()
  loss_v = loss:item()
  if R == 0 and (step % opts.log == 0 or step == 1) then print(string.format("step %d | loss %.6f", step, loss_v)) end
end
local features, label = batch()
local pred = engine.no_grad(function() return model(features) end):argmax(2)
local acc = pred:eq(label):float():mean():item()
if R == 0 then print(string.format("final loss %.6f | accuracy %.4f", loss_v, acc)) end
