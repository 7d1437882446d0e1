-- The Llama model distributed (lua/engine/models.lua): torchtitan's tensor-parallel plan
-- (Llama.parallelize: wq/wk/wv/w1/w3 Colwise, wo/w2 Rowwise, embeddings Rowwise, output Colwise; with
-- use_seq_parallel SequenceParallel norms and sequence-sharded activations between the blocks) and
-- DTensor data parallelism (Replicate parameters, batch-sharded tokens) give the single-process losses,
-- gradients and parameters over AdamW steps, at 1, 2 and 4 ranks; grouped-query attention and rotary
-- embeddings run on each rank's local q and k/v heads (and, under data parallelism, as the fused op on the
-- batch-sharded DTensors).
local engine = require("engine")
local nn = engine.nn
local F = nn.functional
local dist = engine.distributed
local models = require("engine.models")
local util = require("spec.dist.helpers.util")
local errmsg = util.errmsg

local W = dist.world_size()
local S, Rep = dist.Shard, dist.Replicate
local mesh = dist.init_device_mesh("cpu", { W }, { "tp" })

local function full(t)
  if dist.is_dtensor(t) then return t:full_tensor() end
  return t
end
local function diff(a, b) return util.diff(full(a), full(b)) end
local function rel(a, b) return math.abs(a - b) / math.max(1, math.abs(b)) end

local V, T = 32, 8
local ARGS = { dim = 32, n_layers = 2, n_heads = 8, n_kv_heads = 4, vocab_size = V, max_seq_len = T, multiple_of = 16 }

local function tokens(b, t, seed)
  engine.manual_seed(seed)
  return (engine.rand(b, t) * V):to("i64")
end

local function make() engine.manual_seed(7); return models.Llama(ARGS) end

local function compare(label, m, ref, step, lv, lr)
  assert.is_true(rel(lv, lr) <= 1e-5, string.format("%s step %d: loss %.9g vs %.9g", label, step, lv, lr))
  for name, p in m:named_parameters() do
    local d = diff(p.grad, ref:get_parameter(name).grad)
    assert.is_true(d <= 1e-5, string.format("%s step %d: grad of %s differs by %g", label, step, name, d))
  end
end

-- every parameter of m equal to ref's (Adam divides by sqrt(v): a rounding difference in a small gradient
-- moves a weight by up to ~lr times its relative size, so parameters are held to 1e-4 = 1% of one step of
-- lr 1e-2)
local function same_parameters(m, ref)
  for name, p in m:named_parameters() do
    local d = diff(p, ref:get_parameter(name))
    assert.is_true(d <= 1e-4, "parameter " .. name .. " differs by " .. d)
  end
end

-- 5 AdamW steps of m and ref on the same batches (tokens seeded x_seed + step, y_seed + step): every step's
-- loss and gradients (compare), then the parameters; after_step(step) (optional) runs after each step
local function train_equal(label, m, ref, x_seed, y_seed, after_step)
  local opt_r = engine.optim.AdamW(ref:parameters(), { lr = 1e-2, weight_decay = 0.1 })
  local opt_m = engine.optim.AdamW(m:parameters(), { lr = 1e-2, weight_decay = 0.1 })
  for step = 1, 5 do
    local x, y = tokens(4, T, x_seed + step), tokens(4, T, y_seed + step)
    local lm = F.cross_entropy(m(x):reshape(-1, V), y:reshape(-1)); lm:backward()
    local lr = F.cross_entropy(ref(x):reshape(-1, V), y:reshape(-1)); lr:backward()
    compare(label, m, ref, step, full(lm):item(), lr:item())
    opt_m:step(); opt_m:zero_grad(); opt_r:step(); opt_r:zero_grad()
    if after_step then after_step(step) end
  end
  same_parameters(m, ref)
end

describe("Llama tensor parallel (torchtitan's plan)", function()
  -- m's vocab-sharded logits (Shard(3)) through loss_parallel: the loss and gradients of ref on one process
  local function check_loss_parallel(label, m, ref, x, y)
    local logits = m(x)
    assert.is_true(dist.is_dtensor(logits))
    assert.are.equal("Shard(3)", tostring(logits.placements[1]))
    local lm = dist.loss_parallel(function()
      return F.cross_entropy(logits:reshape(-1, V), dist.DTensor.from_local(y:reshape(-1), mesh, { Rep() }))
    end)
    lm:backward()
    local lr = F.cross_entropy(ref(x):reshape(-1, V), y:reshape(-1)); lr:backward()
    compare(label, m, ref, 1, full(lm):item(), lr:item())
  end

  it("lays out the weights as torchtitan: Colwise Shard(1), Rowwise Shard(2), local heads", function()
    local m = make()
    models.Llama.parallelize(m, mesh)
    local at, ff = m.layers[1].attention, m.layers[1].feed_forward
    for _, w in ipairs({ at.wq.weight, at.wk.weight, at.wv.weight, ff.w1.weight, ff.w3.weight, m.output.weight }) do
      assert.is_true(dist.is_dtensor(w))
      assert.are.equal("Shard(1)", tostring(w.placements[1]))
    end
    for _, w in ipairs({ at.wo.weight, ff.w2.weight }) do assert.are.equal("Shard(2)", tostring(w.placements[1])) end
    assert.are.equal("Shard(1)", tostring(m.tok_embeddings.weight.placements[1]))   -- Rowwise embedding: rows
    assert.is_false(dist.is_dtensor(m.norm.weight))
    assert.are.same({ 4 * 4 / W, 32 }, at.wk.weight:to_local():shape())              -- n_kv_heads / W heads of 4
    -- the projections hand local tensors to attention: n_heads / W q heads, n_kv_heads / W k/v heads
    local seen
    local orig = models.apply_rotary_emb
    models.apply_rotary_emb = function(x, c, s)
      seen = seen or {}
      seen[#seen + 1] = x:size(3)
      assert.is_false(dist.is_dtensor(x))
      return orig(x, c, s)
    end
    local ok, e = pcall(m, tokens(2, T, 1))
    models.apply_rotary_emb = orig
    assert(ok, e)
    assert.are.same({ 8 / W, 4 / W }, { seen[1], seen[2] })
  end)

  it("equals one process over 5 AdamW steps (losses, every gradient, parameters)", function()
    local ref, m = make(), make()
    models.Llama.parallelize(m, mesh)
    train_equal("TP", m, ref, 200, 300)
  end)

  it("loss_parallel: vocab-sharded logits, the same loss and gradients", function()
    local ref, m = make(), make()
    models.Llama.parallelize(m, mesh, { loss_parallel = true })
    local x, y = tokens(2, T, 11), tokens(2, T, 12)
    check_loss_parallel("loss_parallel", m, ref, x, y)
  end)

  it("sequence parallelism (use_seq_parallel): torchtitan's layouts, and one process over 5 AdamW steps", function()
    local ref, m = make(), make()
    models.Llama.parallelize(m, mesh, { use_seq_parallel = true })
    for _, w in ipairs({ m.norm.weight, m.layers[1].attention_norm.weight, m.layers[2].ffn_norm.weight }) do
      assert.is_true(dist.is_dtensor(w))
      assert.are.equal("Replicate()", tostring(w.placements[1]))
    end
    -- between the blocks each rank holds its T / W positions; attention and the feed-forward see all T
    local seen = {}
    local hooks = {
      m.layers[1]:register_forward_hook(function(_, _, out) seen.block = out end),
      m.layers[1].attention.wq:register_forward_pre_hook(function(_, args) seen.attn_in = args[1] end),
      m.layers[1].feed_forward.w1:register_forward_pre_hook(function(_, args) seen.ffn_in = args[1] end),
    }
    train_equal("SP", m, ref, 600, 700, function(step)
      if step ~= 1 then return end
      for _, h in ipairs(hooks) do h:remove() end
      local b = seen.block
      if dist.is_dtensor(b) then
        assert.are.equal("Shard(2)", tostring(b.placements[1]))
        b = b:to_local()
      end
      assert.are.same({ 4, T / W, ARGS.dim }, b:shape())
      for _, k in ipairs({ "attn_in", "ffn_in" }) do
        assert.is_true(dist.is_dtensor(seen[k]), k)
        assert.are.equal("Replicate()", tostring(seen[k].placements[1]), k)
        assert.are.same({ 4, T, ARGS.dim }, seen[k]:shape(), k)
      end
    end)
  end)

  it("sequence parallelism with loss_parallel: vocab-sharded logits, the same loss and gradients", function()
    local ref, m = make(), make()
    models.Llama.parallelize(m, mesh, { use_seq_parallel = true, loss_parallel = true })
    local x, y = tokens(2, T, 13), tokens(2, T, 14)
    check_loss_parallel("SP loss_parallel", m, ref, x, y)
  end)

  it("bad input: heads not divisible by the tp size, unknown options, wrong module", function()
    local m = make()
    assert.matches("unknown option 'sp'", errmsg(models.Llama.parallelize, m, mesh, { sp = true }))
    assert.matches("requires a Llama", errmsg(models.Llama.parallelize, models.MLPModule(), mesh))
    if W > 1 then
      engine.manual_seed(1)
      local m1 = models.Llama{ dim = 16, n_layers = 1, n_heads = 4, n_kv_heads = 1, vocab_size = 8, max_seq_len = 4,
        multiple_of = 8 }
      assert.matches("n_kv_heads %(1%) must be divisible by the tensor%-parallel size %(" .. W .. "%)",
        errmsg(models.Llama.parallelize, m1, mesh))
      assert.is_false(dist.is_dtensor(m1.layers[1].attention.wq.weight))   -- checked before anything moved
    end
  end)
end)

describe("Llama DTensor data parallelism", function()
  it("Replicate parameters, Shard(1) tokens: the single-process losses and parameters over 3 steps", function()
    local dmesh = dist.init_device_mesh("cpu", { W }, { "dp" })
    local ref, m = make(), make()
    dist.replicate_parameters(m, dmesh)
    local opt_r = engine.optim.AdamW(ref:parameters(), { lr = 1e-2 })
    local opt_m = engine.optim.AdamW(m:parameters(), { lr = 1e-2 })
    local r = dist.rank()
    for step = 1, 3 do
      local x, y = tokens(2 * W, T, 400 + step), tokens(2 * W, T, 500 + step)
      local dx = dist.from_local(x:narrow(1, 1 + 2 * r, 2):contiguous(), dmesh, { S(1) })
      local dy = dist.from_local(y:narrow(1, 1 + 2 * r, 2):contiguous(), dmesh, { S(1) })
      -- the rotary embedding is the fused op on the batch-sharded q and k (sharding/rope.c), the plain tables
      -- replicated implicitly: 2 calls per block, each on a Shard(1) DTensor
      local fused, orig = {}, engine.rotary_emb
      engine.rotary_emb = function(q, c, s)
        fused[#fused + 1] = dist.is_dtensor(q) and tostring(q.placements[1]) or "plain"
        return orig(q, c, s)
      end
      local ok, logits = pcall(dist.implicit_replication, function() return m(dx) end)
      engine.rotary_emb = orig
      assert(ok, logits)
      assert.are.same({ "Shard(1)", "Shard(1)", "Shard(1)", "Shard(1)" }, fused)
      local lm = F.cross_entropy(logits, dy); lm:backward()
      local lr = F.cross_entropy(ref(x):reshape(-1, V), y:reshape(-1)); lr:backward()
      compare("DP", m, ref, step, lm:full_tensor():item(), lr:item())
      opt_m:step(); opt_m:zero_grad(); opt_r:step(); opt_r:zero_grad()
    end
    same_parameters(m, ref)
  end)
end)
