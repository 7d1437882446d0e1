-- 2-D parallelism (issue 15; seed 000): FSDP over tensor-parallel models on a (dp, tp) mesh (2x2 at 4 ranks,
-- (W, 1) below): placements as PyTorch gives them, parity with one process over AdamW steps (MLPs of dims 3,
-- 16, 17; seed 003's Transformer with and without sequence parallelism and activation checkpointing), dp
-- collectives as FSDP alone and tp collectives as TP alone, and the errors.
local engine = require("engine")
local nn = engine.nn
local F = nn.functional
local dist = engine.distributed
local models = require("engine.models")
local util = require("spec.dist.helpers.util")
local errmsg = util.errmsg

local W, rank = dist.world_size(), dist.rank()
local TPN = W == 4 and 2 or 1
local DPN = W / TPN
local mesh = dist.init_device_mesh("cpu", { DPN, TPN }, { "dp", "tp" })
local dp, tp = mesh["dp"], mesh["tp"]
local dr = dp:get_local_rank()

local function full(t) if dist.is_dtensor(t) then return t:full_tensor() end return t end
local function rel(a, b)
  a, b = full(a):to("f64"), full(b):to("f64")
  return (a - b):abs():max():item() / math.max(1e-6, b:abs():max():item())
end
local function cnt(c, k) return c[k] or 0 end
local function rows(t) local b = t:shape()[1] / DPN; return t:narrow(1, dr * b + 1, b) end
local function global_loss(l)
  -- tp ranks of one dp row hold the same loss: average over the world, divide by nothing else
  local t = full(l):detach():reshape({ 1 }):clone()
  dist.all_reduce(t, "sum")
  return t:item() / W
end

local function train(o)
  local ref, m = o.build(), o.build()
  o.shard(m)
  local opt_r = engine.optim.AdamW(ref:parameters(), { lr = 1e-2, weight_decay = 0.01 })
  local opt_m = engine.optim.AdamW(m:parameters(), { lr = 1e-2, weight_decay = 0.01 })
  for step = 1, o.steps or 10 do
    local x, y = o.batch(step)
    local lr = o.loss(ref, x, y)
    lr:backward()
    local c, l = dist.count_collectives(function()
      local l = o.loss(m, rows(x), rows(y))
      l:backward()
      return l
    end)
    if o.counts then o.counts(c) end
    assert.is_true(math.abs(global_loss(l) - lr:item()) <= 1e-5 * math.max(1, math.abs(lr:item())),
      string.format("step %d: loss %.9g vs %.9g", step, global_loss(l), lr:item()))
    for name, p in m:named_parameters() do
      local g = ref:get_parameter(name).grad
      assert.is_true(rel(p.grad, g) < 1e-5, string.format("step %d grad %s: %g", step, name, rel(p.grad, g)))
      assert.are.equal(tostring(p.placements[1]) .. tostring(p.placements[2]),
        tostring(p.grad.placements[1]) .. tostring(p.grad.placements[2]), name)
    end
    opt_r:step(); opt_m:step()
    opt_r:zero_grad(step % 2 == 0); opt_m:zero_grad(step % 2 == 0)
  end
  for name, p in m:named_parameters() do
    assert.is_true(rel(p, ref:get_parameter(name)) < 1e-5, "param " .. name)
  end
  return m
end

local function mlp(d)
  return function()
    engine.manual_seed(9)
    local m = nn.Module:extend("MLP" .. d)()
    m.net1 = nn.Linear(d, 4 * d)
    m.net2 = nn.Linear(4 * d, d)
    function m:forward(x) return self.net2(F.relu(self.net1(x))) end
    return m
  end
end

describe("FSDP over tensor parallelism", function()
  for _, d in ipairs({ 3, 16, 17 }) do
    it(string.format("MLP dim %d: placements, 10 AdamW steps equal to one process, dp and tp collectives", d), function()
      local m = train({
        build = mlp(d),
        shard = function(m)
          dist.parallelize_module(m, tp, { net1 = dist.ColwiseParallel(), net2 = dist.RowwiseParallel() })
          dist.fully_shard(m.net1, { mesh = dp }); dist.fully_shard(m.net2, { mesh = dp }); dist.fully_shard(m, { mesh = dp })
        end,
        batch = function(step) engine.manual_seed(40 + step); return engine.randn(2 * DPN, d), engine.randn(2 * DPN, d) end,
        loss = function(m, x, y) return F.mse_loss(m(x), y) end,
        counts = function(c)
          assert.are.equal(4, cnt(c, "all_gather"))       -- FSDP alone: 2 groups, forward + backward
          assert.are.equal(2, cnt(c, "reduce_scatter"))
          if TPN > 1 then assert.are.equal(1, cnt(c, "all_reduce")) end  -- RowwiseParallel's forward all_reduce
        end,
      })
      local sf = string.format("_StridedShard(dim=1, sf=%d)", TPN)
      assert.are.equal(sf .. "Shard(1)", tostring(m.net1.weight.placements[1]) .. tostring(m.net1.weight.placements[2]))
      assert.are.equal(sf .. "Shard(1)", tostring(m.net1.bias.placements[1]) .. tostring(m.net1.bias.placements[2]))
      assert.are.equal("Shard(1)Shard(2)", tostring(m.net2.weight.placements[1]) .. tostring(m.net2.weight.placements[2]))
      assert.are.equal("Shard(1)Replicate()", tostring(m.net2.bias.placements[1]) .. tostring(m.net2.bias.placements[2]))
      assert.are.same({ 4 * d, d }, m.net1.weight:shape())
    end)
  end

  local V, T = 16, 8
  local tp_alone
  local function tokens(b, seed) engine.manual_seed(seed); return (engine.rand(b, T) * V):to("i64") end
  for _, cfg in ipairs({ { sp = false }, { sp = true }, { sp = true, ckpt = true } }) do
    it(string.format("seed 003's Transformer (3 layers) sp=%s ckpt=%s: equal to one process", tostring(cfg.sp),
      tostring(cfg.ckpt or false)), function()
      local args = { n_layers = 3, vocab_size = V, max_seq_len = T, dim = 16, n_heads = 4, dropout_p = 0,
        checkpoint_activations = cfg.ckpt or false }
      -- the collectives of one step of TP alone on the same tp mesh
      engine.manual_seed(3)
      local t = models.Transformer(args)
      models.Transformer.parallelize(t, tp, { use_seq_parallel = cfg.sp })
      local x0, y0 = tokens(2, 1), tokens(2, 2)
      tp_alone = dist.count_collectives(function() F.cross_entropy(t(x0):reshape(-1, V), y0:reshape(-1)):backward() end)
      train({
        build = function() engine.manual_seed(3); return models.Transformer(args) end,
        shard = function(m)
          models.Transformer.parallelize(m, tp, { use_seq_parallel = cfg.sp })
          for _, b in ipairs(m.layers:children()) do dist.fully_shard(b, { mesh = dp }) end
          dist.fully_shard(m, { mesh = dp })
        end,
        batch = function(step) return tokens(2 * DPN, 200 + step), tokens(2 * DPN, 300 + step) end,
        loss = function(m, x, y) return F.cross_entropy(m(x):reshape(-1, V), y:reshape(-1)) end,
        steps = 4,
        counts = function(c)
          -- dp collectives as FSDP alone (4 groups: 4 + 3 all-gathers, 4 reduce-scatters), tp ones as TP alone
          assert.are.equal(7 + cnt(tp_alone, "all_gather"), cnt(c, "all_gather"))
          assert.are.equal(4 + cnt(tp_alone, "reduce_scatter"), cnt(c, "reduce_scatter"))
          assert.are.equal(cnt(tp_alone, "all_reduce"), cnt(c, "all_reduce"))
        end,
      })
    end)
  end
end)

describe("FSDP over tensor parallelism: clip_grad_norm", function()
  it("over 2-D gradients (norm types 1, 2, 3, inf) equals one process", function()
    local ref, m = mlp(17)(), mlp(17)()
    dist.parallelize_module(m, tp, { net1 = dist.ColwiseParallel(), net2 = dist.RowwiseParallel() })
    dist.fully_shard(m.net1, { mesh = dp }); dist.fully_shard(m.net2, { mesh = dp }); dist.fully_shard(m, { mesh = dp })
    engine.manual_seed(77)
    local x, y = engine.randn(2 * DPN, 17), engine.randn(2 * DPN, 17)
    F.mse_loss(ref(x), y):backward()
    F.mse_loss(m(rows(x)), rows(y)):backward()
    for _, p in ipairs({ 1, 2, 3, math.huge }) do
      local a = nn.utils.clip_grad_norm_(ref:parameters(), 1e9, p)
      local b = nn.utils.clip_grad_norm_(m:parameters(), 1e9, p)
      local function num(v) return type(v) == "number" and v or full(v):item() end
      assert.is_true(math.abs(num(a) - num(b)) <= 1e-5 * math.max(1, num(a)), string.format("norm %s: %g vs %g", tostring(p), num(b), num(a)))
    end
  end)
end)

describe("FSDP over tensor parallelism: bad input", function()
  it("FSDP applied before TP is an error", function()
    local m = mlp(4)()
    dist.fully_shard(m, { mesh = dp })
    assert.is_truthy(errmsg(dist.parallelize_module, m, tp, { net1 = dist.ColwiseParallel() })
      :find("FSDP applied before TP", 1, true))
  end)
  it("a TP mesh that is not a slice of the FSDP mesh's parent is an error on every rank", function()
    local other = dist.init_device_mesh("cpu", { W }, { "tp" })
    local m = mlp(4)()
    dist.parallelize_module(m, other, { net1 = dist.ColwiseParallel() })
    assert.is_truthy(errmsg(dist.fully_shard, m, { mesh = dp }):find("is not a slice of the FSDP mesh's parent", 1, true))
  end)
  it("uneven sizes that _StridedShard cannot describe are refused (dim 34 over 2x2)", function()
    if W ~= 4 then return end
    local m = nn.Linear(5, 34)
    dist.parallelize_module(m, tp, dist.ColwiseParallel())
    assert.is_truthy(errmsg(dist.fully_shard, m, { mesh = dp }):find("make the size divisible by dp x tp = 4", 1, true))
  end)
end)
