-- 2-D parallelism (PyTorch's fully_shard over parallelize_module): FSDP over tensor-parallel models on a
-- (dp, tp) mesh (2x2 at 4 ranks,
-- (W, 1) below): placements as PyTorch gives them, parity with one process over AdamW steps (MLPs of dims 3,
-- 16, 17, and uneven hidden sizes 5, 6, 7, 10; common_dtensor.py's Transformer with and without sequence
-- parallelism and activation checkpointing), dp
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

-- fn's collectives from the flight recorder, {[kind .. " " .. mesh dim name] = count}, then fn's results (fn's
-- collectives must fit in the recorder's 64 records: checked)
local function by_group(fn)
  local l0 = dist.dump_collectives()
  local before = #l0 > 0 and l0[#l0].id or -1
  local total, r = dist.count_collectives(fn)
  local list = dist.dump_collectives()
  local agg, n = {}, 0
  for _, e in ipairs(list) do
    if e.id > before then
      local k = e.kind .. " " .. (e.group:match("^(%a+):") or e.group)
      agg[k], n = (agg[k] or 0) + 1, n + 1
    end
  end
  local want = 0
  for _, v in pairs(total) do want = want + v end
  assert.are.equal(want, n, "every collective of the call is in the recorder")
  return agg, r
end

-- the 2-D log is the dp part of FSDP alone's plus the tp part of TP alone's (each measured on the same meshes)
local function assert_split(two_d, fsdp_alone, tp_alone, what)
  local want = {}
  for k, v in pairs(fsdp_alone) do
    assert.is_truthy(k:find(" dp$"), what .. ": FSDP alone issued " .. k)
    want[k] = v
  end
  for k, v in pairs(tp_alone) do
    assert.is_truthy(k:find(" tp$"), what .. ": TP alone issued " .. k)
    want[k] = v
  end
  assert.are.same(want, two_d, what)
end

-- one step's forward and backward collectives by group: {forward = ..., backward = ...}
local function step_groups(m, loss, x, y)
  local f, l = by_group(function() return loss(m, rows(x), rows(y)) end)
  local b = by_group(function() l:backward() end)
  return { forward = f, backward = b }
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
    local my_rows = o.rows or rows
    local l
    if o.groups then
      -- dp collectives as FSDP alone, tp collectives as TP alone, forward and backward, every step
      local fsdp_alone, tp_alone = o.groups()
      local f
      f, l = by_group(function() return o.loss(m, my_rows(x), my_rows(y)) end)
      local b = by_group(function() l:backward() end)
      assert_split(f, fsdp_alone.forward, tp_alone.forward, "step " .. step .. " forward")
      assert_split(b, fsdp_alone.backward, tp_alone.backward, "step " .. step .. " backward")
    else
      l = o.loss(m, my_rows(x), my_rows(y))
      l:backward()
    end
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
  return m, ref
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

-- o.groups for train(): one step of FSDP alone (fsdp_shard on the dp mesh) and of TP alone (tp_shard on the tp
-- mesh) of the same model, measured once by group (kept in alone_cache for the caller's own checks)
local alone_cache = {}
local function alone(build, fsdp_shard, tp_shard, batch, loss)
  return function()
    if alone_cache.build ~= build then
      local x, y = batch(1)
      local f = build(); fsdp_shard(f)
      local t = build(); tp_shard(t)
      alone_cache = { build = build, fsdp = step_groups(f, loss, x, y), tp = step_groups(t, loss, x, y) }
    end
    return alone_cache.fsdp, alone_cache.tp
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
        groups = alone(mlp(d), function(m)
          dist.fully_shard(m.net1, { mesh = dp }); dist.fully_shard(m.net2, { mesh = dp }); dist.fully_shard(m, { mesh = dp })
        end, function(m)
          dist.parallelize_module(m, tp, { net1 = dist.ColwiseParallel(), net2 = dist.RowwiseParallel() })
        end, function(step) engine.manual_seed(40 + step); return engine.randn(2 * DPN, d), engine.randn(2 * DPN, d) end,
        function(m, x, y) return F.mse_loss(m(x), y) end),
      })
      if TPN > 1 then
        -- FSDP alone: 2 groups, forward + backward; TP alone: RowwiseParallel's forward all_reduce
        local f, t = alone_cache.fsdp, alone_cache.tp
        assert.are.same({ ["all_gather dp"] = 2 }, f.forward)
        assert.are.same({ ["all_gather dp"] = 2, ["reduce_scatter dp"] = 2 }, f.backward)
        assert.are.same({ ["all_reduce tp"] = 1 }, t.forward)
        assert.are.same({}, t.backward)
      end
      local sf = string.format("_StridedShard(dim=1, sf=%d)", TPN)
      assert.are.equal(sf .. "Shard(1)", tostring(m.net1.weight.placements[1]) .. tostring(m.net1.weight.placements[2]))
      assert.are.equal(sf .. "Shard(1)", tostring(m.net1.bias.placements[1]) .. tostring(m.net1.bias.placements[2]))
      assert.are.equal("Shard(1)Shard(2)", tostring(m.net2.weight.placements[1]) .. tostring(m.net2.weight.placements[2]))
      assert.are.equal("Shard(1)Replicate()", tostring(m.net2.bias.placements[1]) .. tostring(m.net2.bias.placements[2]))
      assert.are.same({ 4 * d, d }, m.net1.weight:shape())
    end)
  end

  local V, T = 16, 8
  local function tokens(b, seed) engine.manual_seed(seed); return (engine.rand(b, T) * V):to("i64") end
  -- the placements PyTorch gives common_dtensor.py's Transformer under FSDP over TP (1-based dims): a colwise weight (and
  -- bias) and the rowwise embeddings are sharded on dim 1 by both, so FSDP's dp dim is a _StridedShard(1, sf=tp)
  -- of the TP shards (right-to-left rule); rowwise weights [Shard(1), Shard(2)]; a rowwise bias [Shard(1),
  -- Replicate()]; the norms are Replicate DTensors under sequence parallelism, plain parameters (FSDP's Shard(1)
  -- on the 1-D dp mesh) without
  local function transformer_placement(name, sp)
    local ss = string.format("_StridedShard(dim=1, sf=%d)Shard(1)", TPN)
    if name:find("norm%.") then return sp and "Shard(1)Replicate()" or "Shard(1)" end
    if name:find("%.w[qkv]%.weight$") or name:find("%.w1%.weight$") or name:find("%.w1%.bias$")
      or name:find("^tok_embeddings%.") or name:find("^pos_embeddings%.") then return ss end
    if name:find("%.wo%.weight$") or name:find("%.w2%.weight$") then return "Shard(1)Shard(2)" end
    if name:find("%.w2%.bias$") then return "Shard(1)Replicate()" end
    error("no expected placement for " .. name)
  end
  local function pls(t) local r = {} for i, q in ipairs(t.placements) do r[i] = tostring(q) end return table.concat(r) end

  for _, cfg in ipairs({ { sp = false }, { sp = false, ckpt = true }, { sp = true }, { sp = true, ckpt = true } }) do
    it(string.format("common_dtensor.py's Transformer (3 layers) sp=%s ckpt=%s: placements, 10 AdamW steps equal to one "
      .. "process", tostring(cfg.sp), tostring(cfg.ckpt or false)), function()
      local args = { n_layers = 3, vocab_size = V, max_seq_len = T, dim = 16, n_heads = 4, dropout_p = 0,
        checkpoint_activations = cfg.ckpt or false }
      local build = function() engine.manual_seed(3); return models.Transformer(args) end
      local batch = function(step) return tokens(2 * DPN, 200 + step), tokens(2 * DPN, 300 + step) end
      local loss = function(m, x, y) return F.cross_entropy(m(x):reshape(-1, V), y:reshape(-1)) end
      local m = train({
        build = build,
        shard = function(m)
          models.Transformer.parallelize(m, tp, { use_seq_parallel = cfg.sp })
          for _, b in ipairs(m.layers:children()) do dist.fully_shard(b, { mesh = dp }) end
          dist.fully_shard(m, { mesh = dp })
        end,
        batch = batch,
        loss = loss,
        groups = alone(build, function(f)
          for _, b in ipairs(f.layers:children()) do dist.fully_shard(b, { mesh = dp }) end
          dist.fully_shard(f, { mesh = dp })
        end, function(t) models.Transformer.parallelize(t, tp, { use_seq_parallel = cfg.sp }) end, batch, loss),
      })
      -- FSDP alone: 4 groups, 4 + 3 all-gathers (the root stays unsharded) and 4 reduce-scatters; none over a dp
      -- group of one rank (nothing to move)
      local f = alone_cache.fsdp
      local function dp_n(k) return DPN > 1 and k or nil end
      assert.are.equal(dp_n(4), f.forward["all_gather dp"])
      assert.are.equal(dp_n(3), f.backward["all_gather dp"])  -- (with ckpt, the recompute runs while the block is unsharded)
      assert.are.equal(dp_n(4), f.backward["reduce_scatter dp"])
      local n = 0
      for name, p in m:named_parameters() do
        n = n + 1
        assert.are.equal(transformer_placement(name, cfg.sp), pls(p), name)  -- train() checks the gradients' every step
      end
      assert.are.equal(2 + 3 * 12 + 2, n)
    end)
  end
end)

-- Uneven FSDP over TP (PyTorch pads and trains, FSDP2's test_fully_shard_training with uneven dims): hidden sizes
-- not divisible by dp x tp, so the TP shards are chunked unevenly over dp (hidden 10 on 2x2: TP shards of 5, dp
-- chunks of 3 and 2; hidden 7: TP shards of 4 and 3) and the model dim 5 is uneven over dp for the rowwise weight.
-- Each rank keeps its dp-chunk of its TP shard, padded to the largest chunk in the group's one all-gather as on one
-- dim; the label [_StridedShard(1, sf=tp), Shard(1)] names those rows (PyTorch's nested _StridedShard), so the state
-- dict's full tensors equal one process's.
local function mlp_h(d, h)
  return function()
    engine.manual_seed(11)
    local m = nn.Module:extend("MLP" .. d .. "x" .. h)()
    m.net1 = nn.Linear(d, h)
    m.net2 = nn.Linear(h, d)
    function m:forward(x) return self.net2(F.relu(self.net1(x))) end
    return m
  end
end

local function chunk_rows(n, k, i)
  local c = math.ceil(n / k)
  return math.max(0, math.min(c, n - i * c)), c
end

describe("Uneven FSDP over tensor parallelism", function()
  local function uneven(meshes_name, dpm, tpm, d, h, rows_fn)
    local DP, TP = dpm:size(), tpm:size()
    local function fsdp_(m)
      dist.fully_shard(m.net1, { mesh = dpm }); dist.fully_shard(m.net2, { mesh = dpm }); dist.fully_shard(m, { mesh = dpm })
    end
    -- a hidden size uneven over tp keeps net1's output a DTensor (ColwiseParallel refuses uneven local outputs)
    local function tp_(m)
      dist.parallelize_module(m, tpm, { net1 = dist.ColwiseParallel({ use_local_output = h % TP == 0 }),
        net2 = dist.RowwiseParallel() })
    end
    local batch = function(step) engine.manual_seed(70 + step); return engine.randn(2 * DP, d), engine.randn(2 * DP, d) end
    local loss = function(m, x, y) return F.mse_loss(m(x), y) end
    local build = mlp_h(d, h)
    local m, ref = train({
      build = build, rows = rows_fn, batch = batch, loss = loss,
      shard = function(m) tp_(m); fsdp_(m) end,
      groups = alone(build, fsdp_, tp_, batch, loss),
    })
    -- placements and each rank's rows: dp-chunk i of TP shard j
    local i, j = dpm:get_local_rank(), tpm:get_local_rank()
    local sf = string.format("_StridedShard(dim=1, sf=%d)Shard(1)", TP)
    assert.are.equal(sf, tostring(m.net1.weight.placements[1]) .. tostring(m.net1.weight.placements[2]))
    assert.are.equal(sf, tostring(m.net1.bias.placements[1]) .. tostring(m.net1.bias.placements[2]))
    local tl = chunk_rows(h, TP, j)
    local mine = chunk_rows(tl, DP, i)
    assert.are.same({ mine, d }, m.net1.weight:to_local():shape())
    assert.are.same({ chunk_rows(d, DP, i), (chunk_rows(h, TP, j)) }, m.net2.weight:to_local():shape())
    -- the state dict: every entry's full tensor is one process's, exactly before training, to 1e-5 after
    local function same_state(sd, rsd, tol, what)
      local keys = {}
      for k in pairs(rsd) do keys[#keys + 1] = k end
      table.sort(keys)  -- the same order on every rank (full_tensor is collective)
      for _, k in ipairs(keys) do
        assert.is_true(dist.is_dtensor(sd[k]), k)
        local e = rel(sd[k], rsd[k])
        assert.is_true(e <= tol, string.format("%s state dict %s: %g", what, k, e))
      end
      assert.are.equal(4, #keys)
    end
    same_state(m:state_dict(), ref:state_dict(), 1e-5, "trained")
    local fresh = build()
    tp_(fresh); fsdp_(fresh)
    same_state(fresh:state_dict(), build():state_dict(), 0, "fresh")
    -- one all-gather per group: net1's moves DP padded chunks of its TP shard (never the full parameter)
    local before = dist.dump_collectives()
    local last = #before > 0 and before[#before].id or -1
    local x = batch(1)
    local c0 = dist.fsdp_counts(m.net1).all_gather
    local _ = m(rows_fn(x))
    assert.are.equal(DP > 1 and c0 + 1 or c0, dist.fsdp_counts(m.net1).all_gather)
    if DP > 1 then
      local _, cd = chunk_rows(chunk_rows(h, TP, 0), DP, 0)
      local want = { (cd * d + cd) * DP, cd * d + cd }
      local seen = {}
      for _, e in ipairs(dist.dump_collectives()) do
        if e.id > last and e.kind == "all_gather" then
          local numel = 1
          for _, q in ipairs(e.shape or {}) do numel = numel * q end
          seen[#seen + 1] = numel
        end
      end
      -- net1's and net2's (the root holds no parameter of its own)
      assert.is_true(#seen >= 2, meshes_name .. ": all-gathers seen " .. #seen)
      local ok = false
      for _, v in ipairs(seen) do if v == want[1] or v == want[2] then ok = true end end
      assert.is_true(ok, string.format("%s: net1's all-gather moves %d (or %d per rank) elements; seen %s", meshes_name,
        want[1], want[2], table.concat(seen, ",")))
    end
    return m
  end

  for _, h in ipairs({ 6, 10, 7 }) do
    it(string.format("hidden %d, dim 5 on the (%d, %d) mesh: 10 AdamW steps, losses, gradients, parameters and state "
      .. "dict equal to one process, one all-gather per group", h, DPN, TPN), function()
      uneven("(dp, tp)", dp, tp, 5, h, rows)
    end)
  end
  it(string.format("hidden 7, dim 3 on the (1, %d) mesh (uneven TP, a dp group of one): equal to one process", W),
    function()
      local m1 = dist.init_device_mesh("cpu", { 1, W }, { "dp", "tp" })
      uneven("(1, W)", m1["dp"], m1["tp"], 3, 7, function(t) return t end)
    end)
end)

-- A size-1 FSDP group: the dp dim of a (1, W) mesh (PyTorch's TestFullyShardNDTraining at 2
-- GPUs: dp size 1, tp 2) issues no all-gather or reduce-scatter; the tp collectives are TP alone's
describe("FSDP over tensor parallelism on a (1, W) mesh", function()
  for _, d in ipairs({ 3, 16 }) do
    it(string.format("MLP dim %d: no dp collective, tp collectives as TP alone, 10 AdamW steps equal to one process",
      d), function()
      local m1 = dist.init_device_mesh("cpu", { 1, W }, { "dp", "tp" })
      local dp1, tp1 = m1["dp"], m1["tp"]
      local function fsdp_(m)
        dist.fully_shard(m.net1, { mesh = dp1 }); dist.fully_shard(m.net2, { mesh = dp1 }); dist.fully_shard(m, { mesh = dp1 })
      end
      local function tp_(m) dist.parallelize_module(m, tp1, { net1 = dist.ColwiseParallel(), net2 = dist.RowwiseParallel() }) end
      local batch = function(step) engine.manual_seed(60 + step); return engine.randn(4, d), engine.randn(4, d) end
      local loss = function(m, x, y) return F.mse_loss(m(x), y) end
      local m = train({
        build = mlp(d), rows = function(t) return t end, batch = batch, loss = loss,
        shard = function(m) tp_(m); fsdp_(m) end,
        groups = alone(mlp(d), fsdp_, tp_, batch, loss),
      })
      -- FSDP alone on the size-1 dp mesh moves nothing, forward or backward
      assert.are.same({}, alone_cache.fsdp.forward)
      assert.are.same({}, alone_cache.fsdp.backward)
      for _, g in ipairs({ m, m.net1, m.net2 }) do
        local k = dist.fsdp_counts(g)
        assert.are.equal(0, k.all_gather); assert.are.equal(0, k.reduce_scatter)
      end
      assert.are.same({ 4 * d / W, d }, m.net1.weight:to_local():shape())
    end)
  end
end)

describe("HSDP over tensor parallelism: the (replicate, shard, tp) mesh", function()
  -- fully_shard on mesh{"replicate", "shard"}, parallelize_module on mesh["tp"]: parameters
  -- [Replicate(), Shard(1) or _StridedShard(1, sf=tp), tp placement] on the 3-D mesh, sharded for real along
  -- "shard" in (1, 2, 2) and replicated along "replicate" in (2, 1, 2)
  local shapes = ({ [4] = { { 1, 2, 2 }, { 2, 1, 2 } }, [2] = { { 1, 1, 2 }, { 2, 1, 1 }, { 1, 2, 1 } } })[W]
    or { { 1, 1, W } }
  local V, T = 16, 8
  for _, sh in ipairs(shapes) do
    for _, model in ipairs({ "MLP dim 16", "Transformer sp=true" }) do
      it(string.format("(%d, %d, %d), %s: placements, 10 AdamW steps equal to one process", sh[1], sh[2], sh[3], model),
        function()
        local m3 = dist.init_device_mesh("cpu", sh, { "replicate", "shard", "tp" })
        local fm, tm = m3({ "replicate", "shard" }), m3["tp"]
        local ndp = sh[1] * sh[2]
        local di = m3:get_local_rank("replicate") * sh[2] + m3:get_local_rank("shard")
        local function my_rows(t) local b = t:shape()[1] / ndp; return t:narrow(1, di * b + 1, b) end
        local o = { rows = my_rows }
        if model == "MLP dim 16" then
          o.build = mlp(16)
          o.shard = function(m)
            dist.parallelize_module(m, tm, { net1 = dist.ColwiseParallel(), net2 = dist.RowwiseParallel() })
            dist.fully_shard(m.net1, { mesh = fm }); dist.fully_shard(m.net2, { mesh = fm }); dist.fully_shard(m, { mesh = fm })
          end
          o.batch = function(step) engine.manual_seed(40 + step); return engine.randn(2 * ndp, 16), engine.randn(2 * ndp, 16) end
          o.loss = function(m, x, y) return F.mse_loss(m(x), y) end
        else
          local args = { n_layers = 3, vocab_size = V, max_seq_len = T, dim = 16, n_heads = 4, dropout_p = 0 }
          local function tokens(b, seed) engine.manual_seed(seed); return (engine.rand(b, T) * V):to("i64") end
          o.build = function() engine.manual_seed(3); return models.Transformer(args) end
          o.shard = function(m)
            models.Transformer.parallelize(m, tm, { use_seq_parallel = true })
            for _, b in ipairs(m.layers:children()) do dist.fully_shard(b, { mesh = fm }) end
            dist.fully_shard(m, { mesh = fm })
          end
          o.batch = function(step) return tokens(2 * ndp, 200 + step), tokens(2 * ndp, 300 + step) end
          o.loss = function(m, x, y) return F.cross_entropy(m(x):reshape(-1, V), y:reshape(-1)) end
        end
        local m = train(o)
        local ss = string.format("Replicate()_StridedShard(dim=1, sf=%d)Shard(1)", sh[3])
        local function pls(t) local r = {} for i, q in ipairs(t.placements) do r[i] = tostring(q) end return table.concat(r) end
        if model == "MLP dim 16" then
          assert.are.equal(ss, pls(m.net1.weight))
          assert.are.equal(ss, pls(m.net1.bias))
          assert.are.equal("Replicate()Shard(1)Shard(2)", pls(m.net2.weight))
          assert.are.equal("Replicate()Shard(1)Replicate()", pls(m.net2.bias))
          -- the local shard: rows of the TP shard split over "shard"
          assert.are.same({ 64 / sh[3] / sh[2], 16 }, m.net1.weight:to_local():shape())
        else
          assert.are.equal(ss, pls(m:get_parameter("layers.0.attention.wq.weight")))
          assert.are.equal("Replicate()Shard(1)Shard(2)", pls(m:get_parameter("layers.2.feed_forward.w2.weight")))
          assert.are.equal("Replicate()Shard(1)Replicate()", pls(m:get_parameter("norm.weight")))
        end
      end)
    end
  end
end)

describe("FSDP over tensor parallelism: mixed precision", function()
  local V, T = 16, 8
  local args = { n_layers = 2, vocab_size = V, max_seq_len = T, dim = 16, n_heads = 4, dropout_p = 0 }
  local function tokens(b, seed) engine.manual_seed(seed); return (engine.rand(b, T) * V):to("i64") end
  local function sharded(mp)
    engine.manual_seed(3)
    local m = models.Transformer(args)
    models.Transformer.parallelize(m, tp, { use_seq_parallel = true })
    for _, b in ipairs(m.layers:children()) do dist.fully_shard(b, { mesh = dp, mp_policy = mp }) end
    dist.fully_shard(m, { mesh = dp, mp_policy = mp })
    return m
  end
  local function loss_of(out, y) return F.cross_entropy(out:reshape(-1, V):float(), y:reshape(-1)) end
  -- the backward's collectives: {kind .. " " .. dim name .. " " .. dtype = count} (the whole backward must fit
  -- in the flight recorder's 64 records)
  local function backward_log(l)
    local l0 = dist.dump_collectives()
    local before = #l0 > 0 and l0[#l0].id or -1
    l:backward()
    local list = dist.dump_collectives()
    assert.is_true(list[1].id <= before + 1, "the backward's collectives fit in the recorder")
    local agg = {}
    for _, e in ipairs(list) do
      if e.id > before then
        local k = string.format("%s %s %s", e.kind, e.group:match("^(%a+)") or e.group, tostring(e.dtype))
        agg[k] = (agg[k] or 0) + 1
      end
    end
    return agg
  end

  it("reduce_dtype f32: the tp group's backward reductions run in f32; losses equal one process computing in "
    .. "bf16 with f32 master weights", function()
    local m = sharded(dist.MixedPrecisionPolicy({ param_dtype = "bf16", reduce_dtype = "f32" }))
    assert.are.equal("f32", dist.get_backward_reduce_dtype(tp))
    assert.are.equal("f32", dist.get_backward_reduce_dtype(mesh, 2))  -- the parent's tp dim shares the group
    assert.is_nil(dist.get_backward_reduce_dtype(dp))
    engine.manual_seed(3)
    local master = models.Transformer(args)
    engine.manual_seed(3)
    local ref = models.Transformer(args):bfloat16()
    local opt_r = engine.optim.AdamW(master:parameters(), { lr = 1e-2 })
    local opt_m = engine.optim.AdamW(m:parameters(), { lr = 1e-2 })
    for step = 1, 10 do
      local x, y = tokens(2 * DPN, 500 + step), tokens(2 * DPN, 600 + step)
      for name, p in master:named_parameters() do ref:get_parameter(name):detach():copy_(p:detach()) end
      local lr = loss_of(ref(x), y)
      lr:backward()
      for name, p in master:named_parameters() do p.grad = ref:get_parameter(name).grad:float() end
      ref:zero_grad()
      local l = loss_of(m(rows(x)), rows(y))
      local log = backward_log(l)
      if TPN > 1 then
        assert.is_true(cnt(log, "all_reduce tp f32") > 0 and cnt(log, "reduce_scatter tp f32") > 0)
        assert.are.equal(0, cnt(log, "all_reduce tp bf16") + cnt(log, "reduce_scatter tp bf16"))
      end
      if DPN > 1 then
        assert.is_true(cnt(log, "reduce_scatter dp f32") > 0)
        assert.are.equal(0, cnt(log, "reduce_scatter dp bf16"))
      end
      local a, b = global_loss(l), lr:item()
      local d = math.abs(a - b) / math.abs(b)
      -- step 1 (equal weights): the 2-D run rounds each rank's partial TP contraction to bf16 before the sum,
      -- one rounding more than the reference's, so the losses agree within bf16's unit roundoff 2^-8 (measured
      -- 5.2e-4 at 4 ranks); later steps add the drift of AdamW updates from gradients rounded differently:
      -- 4 units (measured at most 4.1e-3 over 10 steps)
      assert.is_true(d <= (step == 1 and 2 ^ -8 or 2 ^ -6), string.format("step %d: loss differs by %.3g (relative)", step, d))
      opt_r:step(); opt_m:step(); opt_r:zero_grad(); opt_m:zero_grad()
    end
  end)

  it("without a reduce_dtype (param_dtype alone, or no mp_policy) the tp reductions keep the gradient's dtype",
    function()
    for _, case in ipairs({ { mp = dist.MixedPrecisionPolicy({ param_dtype = "bf16" }), dt = "bf16" },
                            { dt = "f32" } }) do
      dist.set_backward_reduce_dtype(tp, "f16")  -- whatever was there: fully_shard over TP sets it
      local m = sharded(case.mp)
      assert.is_nil(dist.get_backward_reduce_dtype(tp))
      local x, y = tokens(2 * DPN, 700), tokens(2 * DPN, 701)
      local log = backward_log(loss_of(m(rows(x)), rows(y)))
      if TPN > 1 then
        assert.is_true(cnt(log, "all_reduce tp " .. case.dt) > 0 and cnt(log, "reduce_scatter tp " .. case.dt) > 0)
        for k in pairs(log) do
          if k:find(" tp ", 1, true) and (k:find("^all_reduce") or k:find("^reduce_scatter")) then
            assert.are.equal("tp " .. case.dt, k:match("(tp %w+)$"), k)
          end
        end
      end
    end
  end)
end)

describe("FSDP over tensor parallelism: clip_grad_norm", function()
  -- adapted from PyTorch's test_clip_grad_norm_2d (test_fully_shard_clip_grad_norm_.py): the total norm is a
  -- DTensor on the (dp, tp) mesh whose full value equals one process's, one all_reduce per placement of the norm
  -- (per mesh dim: 2 on the 2x2 mesh, whatever mix of [Shard(dp), Shard(tp)] and [Shard(dp), Replicate] the
  -- gradients have), and the clipped gradients equal one process's
  it("over 2-D gradients (norm types 1, 2, 3, inf) equals one process, one all_reduce per mesh dim", function()
    for _, p in ipairs({ 1, 2, 3, math.huge }) do
      local ref, m = mlp(17)(), mlp(17)()
      dist.parallelize_module(m, tp, { net1 = dist.ColwiseParallel(), net2 = dist.RowwiseParallel() })
      dist.fully_shard(m.net1, { mesh = dp }); dist.fully_shard(m.net2, { mesh = dp }); dist.fully_shard(m, { mesh = dp })
      engine.manual_seed(77)
      local x, y = engine.randn(2 * DPN, 17), engine.randn(2 * DPN, 17)
      F.mse_loss(ref(x), y):backward()
      F.mse_loss(m(rows(x)), rows(y)):backward()
      local total = nn.utils.clip_grad_norm_(ref:parameters(), 1e9, p):item()
      local max_norm = total / 3  -- every gradient is clipped
      local a = nn.utils.clip_grad_norm_(ref:parameters(), max_norm, p)
      local b
      local c = dist.count_collectives(function() b = nn.utils.clip_grad_norm_(m:parameters(), max_norm, p) end)
      assert.is_true(dist.is_dtensor(b), tostring(b))
      assert.are.same({ 2, 0, "f32" }, { #b.placements, b:dim(), b.dtype })
      local sharded = 0
      for d = 1, 2 do if mesh:size(d) > 1 then sharded = sharded + 1 end end
      assert.are.same(sharded > 0 and { all_reduce = sharded } or {}, c, "norm " .. tostring(p))
      assert.is_true(math.abs(a:item() - b:full_tensor():item()) <= 1e-5 * math.max(1, a:item()),
        string.format("norm %s: %g vs %g", tostring(p), b:full_tensor():item(), a:item()))
      for name, q in m:named_parameters() do
        local e = rel(q.grad, ref:get_parameter(name).grad)
        assert.is_true(e < 1e-5, string.format("norm %s: clipped grad of %s differs by %g", tostring(p), name, e))
      end
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
  -- each error is raised on every rank (every rank runs these), and the world is still usable after it
  local function still_usable()
    local t = engine.ones(1)
    dist.all_reduce(t, "sum")
    assert.are.equal(W, t:item())
  end
  local NOT_SLICE = "is not a slice of the FSDP mesh's parent"
  it("a swapped (tp, dp) mesh is an error on every rank", function()
    local sw = dist.init_device_mesh("cpu", { TPN, DPN }, { "tp", "dp" })
    local m = mlp(4)()
    dist.parallelize_module(m, sw["tp"], { net1 = dist.ColwiseParallel(), net2 = dist.RowwiseParallel() })
    local e = errmsg(dist.fully_shard, m, { mesh = sw["dp"] })
    assert.is_truthy(e:find(NOT_SLICE, 1, true) and e:find("FSDP dims first", 1, true), e)
    -- TP on the dp dim and FSDP on the tp dim of the right mesh: the same error
    local m2 = mlp(4)()
    dist.parallelize_module(m2, dp, { net1 = dist.ColwiseParallel() })
    assert.is_truthy(errmsg(dist.fully_shard, m2, { mesh = tp }):find(NOT_SLICE, 1, true))
    still_usable()
  end)
  it("fully_shard on mesh[\"s\"] alone of a 3-D (r, s, tp) mesh is an error on every rank", function()
    local m3 = dist.init_device_mesh("cpu", { 1, DPN, TPN }, { "r", "s", "tp" })
    local m = mlp(4)()
    dist.parallelize_module(m, m3["tp"], { net1 = dist.ColwiseParallel(), net2 = dist.RowwiseParallel() })
    local e = errmsg(dist.fully_shard, m, { mesh = m3["s"] })
    assert.is_truthy(e:find(NOT_SLICE, 1, true), e)
    still_usable()
  end)
  it("mismatched dims: a 3-D FSDP mesh, a 2-D TP mesh, a shard dim past the parameter's", function()
    local m3 = dist.init_device_mesh("cpu", { 1, DPN, TPN }, { "r", "s", "tp" })
    local e = errmsg(dist.fully_shard, mlp(4)(), { mesh = m3 })
    assert.is_truthy(e:find("fully_shard expects a 1D or 2D DeviceMesh", 1, true), e)
    e = errmsg(dist.parallelize_module, mlp(4)(), mesh, { net1 = dist.ColwiseParallel() })
    assert.is_truthy(e:find("Tensor Parallel expects a 1-D device mesh, got a 2-D mesh", 1, true), e)
    local m = mlp(4)()
    dist.parallelize_module(m, tp, { net1 = dist.ColwiseParallel(), net2 = dist.RowwiseParallel() })
    e = errmsg(dist.fully_shard, m, { mesh = dp, shard_placement_fn = function() return dist.Shard(3) end })
    assert.is_truthy(e:find("Shard(3) is out of range for parameter 'weight' of 2 dims", 1, true), e)
    still_usable()
  end)
  it("uneven sizes over 2x2 are sharded (dim 34: TP shards of 17, dp chunks of 9 and 8), full_tensor exact", function()
    if W ~= 4 then return end
    engine.manual_seed(5)
    local m = nn.Linear(5, 34)
    local w = m.weight:detach():clone()
    dist.parallelize_module(m, tp, dist.ColwiseParallel())
    dist.fully_shard(m, { mesh = dp })
    assert.are.same({ dr == 0 and 9 or 8, 5 }, m.weight:to_local():shape())
    assert.are.equal(0, (m.weight:full_tensor() - w):abs():max():item())
  end)
end)
