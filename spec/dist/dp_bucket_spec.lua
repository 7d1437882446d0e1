-- DTensor data parallelism with gradient buckets (replicate_parameters(model, mesh, {bucket_cap_mb = ...})): the
-- DistributedDataParallel reducer (engine/src/ddp/ddp.c) buckets the Replicate parameters' partial gradients, one
-- all_reduce (sum) per bucket during backward, instead of one Partial -> Replicate all_reduce per parameter at
-- AccumulateGrad.  Checked against the unbucketed DTensor path on the same model and batches: the same losses and
-- gradients over 4 AdamW steps, gradients Replicate DTensors, collectives per backward = the number of buckets
-- (1 for a large cap, <= ceil(bytes / cap) + 1 for a small one, no all_reduce per parameter), no_sync-free use with
-- zero_grad, a parameter without a gradient, bad options.  The #gpu case runs the same on a CUDA mesh (NCCL).
local engine = require("engine")
local dist = engine.distributed
local nn, optim = engine.nn, engine.optim
local F = nn.functional
local util = require("spec.dist.helpers.util")

local W = dist.world_size()
local S = dist.Shard
local V, T, STEPS = 32, 8, 4

local meshes = {}
local function mesh(dev)
  if not meshes[dev] then meshes[dev] = dist.init_device_mesh(dev, { W }) end
  return meshes[dev]
end

-- no dropout on CUDA (its attention kernels have none: a clear error); the CPU keeps the model's default, except
-- when it is compared with the CUDA run
local cpu_dropout = nil
local function build(dev)
  engine.manual_seed(7)
  local m = nn.Transformer{ n_layers = 2, dim = 16, n_heads = 4, vocab_size = V, max_seq_len = T,
    dropout_p = dev == "cuda" and 0 or cpu_dropout }
  for _, p in ipairs(m:parameters()) do
    if p:dim() >= 2 then engine.no_grad(function() p:normal_(0, 0.1) end) end
  end
  if dev == "cuda" then m:to("cuda") end
  return m
end

local function batch(s, dev)
  engine.manual_seed(100 + s)
  local x = (engine.rand(2 * W, T) * V):floor():to("i64")
  local y = (engine.rand(2 * W, T) * V):floor():to("i64")
  return x:to(dev), y:to(dev)
end

-- trains STEPS steps; returns losses, per-step backward collective counts, final gradients (full, host)
local function run(dev, opts)
  local model = build(dev)
  local m = mesh(dev)
  dist.replicate_parameters(model, m, opts)
  local opt = optim.AdamW(model:parameters(), { lr = 1e-2, weight_decay = 0.1 })
  local losses, counts, grads = {}, {}, {}
  for s = 1, STEPS do
    opt:zero_grad()
    local x, y = batch(s, dev)
    local dx, dy = dist.distribute_tensor(x, m, { S(1) }), dist.distribute_tensor(y, m, { S(1) })
    local logits = dist.implicit_replication(function() return model(dx) end)
    local loss = F.cross_entropy(logits, dy)
    counts[s] = util.counted(function() loss:backward() end)
    losses[s] = loss:full_tensor():to("cpu"):item()
    if s == STEPS then
      for name, p in model:named_parameters() do
        assert(dist.is_dtensor(p.grad), name .. ": gradient is a DTensor")
        assert(p.grad.placements[1]:is_replicate(), name .. ": gradient is Replicate")
        grads[name] = p.grad:to_local():to("cpu"):double()
      end
    end
    opt:step()
  end
  return losses, counts, grads, model
end

local function nparams(model) local n = 0 for _ in pairs(model:parameters()) do n = n + 1 end return n end

local function check(dev)
  local l0, c0, g0, m0 = run(dev)
  local l1, c1, g1, m1 = run(dev, { bucket_cap_mb = 25 })
  local l2, c2, g2, m2 = run(dev, { bucket_cap_mb = 0.004 })   -- about 4 KiB: several buckets
  -- The model's position embedding takes plain (implicitly replicated) positions: its gradient is reduced inside the
  -- graph (K = 1 all_reduce, in every path) and reaches AccumulateGrad Replicate; every other gradient is Partial.
  local n = nparams(m0)
  for s = 1, STEPS do
    assert(math.abs(l0[s] - l1[s]) < 1e-6 and math.abs(l0[s] - l2[s]) < 1e-6,
      string.format("step %d losses %.9g %.9g %.9g", s, l0[s], l1[s], l2[s]))
    if W > 1 then -- (a group of one rank issues nothing)
      local k = tonumber(c1[s]:match("^all_reduce=(%d+)$")) - 1
      assert(k == 0 or k == 1, c1[s])
      assert.are.equal("all_reduce=" .. (n - k + k), c0[s])          -- one per Partial gradient without buckets, + K
      assert.are.equal("all_reduce=" .. (1 + k), c1[s])               -- one bucket holds every gradient
      local st = dist.dp_comm_stats(m2) -- the buckets after the first backward (which has one, as PyTorch's)
      assert.are.equal("all_reduce=" .. ((s == 1 and 1 or st.buckets) + k), c2[s])
    end
  end
  for name, g in pairs(g0) do
    assert(util.diff(g, g1[name]) < 1e-6, name .. ": " .. util.diff(g, g1[name]))
    assert(util.diff(g, g2[name]) < 1e-6, name .. ": " .. util.diff(g, g2[name]))
  end
  local st1, st2 = dist.dp_comm_stats(m1), dist.dp_comm_stats(m2)
  assert.are.equal(W > 1 and 1 or 0, st1.collectives)
  assert.are.equal(1, st1.buckets)
  local bytes = 0
  for _, b in ipairs(st2.bucket_bytes) do bytes = bytes + b end
  assert.are.equal(W > 1 and bytes or 0, st2.bytes)
  assert(st2.buckets > 1 and st2.buckets <= math.ceil(bytes / (0.004 * 1048576)) + nparams(m2),
    "buckets " .. st2.buckets)
  assert(st2.buckets < nparams(m2), "fewer buckets than parameters")
  assert.is_nil(dist.dp_comm_stats(m0))
end

describe("DTensor data parallelism with buckets", function()
  it("same losses and gradients as the per-parameter path; one all_reduce per bucket", function()
    check("cpu")
  end)

  it("a parameter without a gradient gets none, and the others are reduced", function()
    local m = mesh("cpu")
    engine.manual_seed(3)
    local a, b, unused = nn.Linear(4, 3), nn.Linear(3, 2), nn.Linear(2, 2)
    local model = nn.Sequential(a, b, unused)
    dist.replicate_parameters(model, m, { bucket_cap_mb = 1 })
    local x = dist.distribute_tensor(engine.randn(2 * W, 4), m, { S(1) })
    local out = dist.implicit_replication(function() return b(a(x)) end)
    local c = util.counted(function() out:sum():backward() end)
    assert.are.equal(W > 1 and "all_reduce=1" or "", c)
    assert.is_nil(unused.weight.grad)
    -- the reference: the full batch on one process
    engine.manual_seed(3)
    local ra, rb = nn.Linear(4, 3), nn.Linear(3, 2)
    rb(ra(x:full_tensor())):sum():backward()
    assert(util.diff(a.weight.grad:to_local(), ra.weight.grad) < 1e-5)
    assert(util.diff(b.bias.grad:to_local(), rb.bias.grad) < 1e-5)
  end)

  it("bad options fail before anything changes", function()
    local model = nn.Linear(2, 2)
    local ok, e = pcall(dist.replicate_parameters, model, mesh("cpu"), { bucket_mb = 1 })
    assert.is_false(ok)
    assert.truthy(tostring(e):find("unknown option 'bucket_mb'", 1, true), tostring(e))
    ok, e = pcall(dist.replicate_parameters, model, mesh("cpu"), { bucket_cap_mb = -1 })
    assert.is_false(ok)
    assert.truthy(tostring(e):find("bucket_cap_mb must be a positive number", 1, true), tostring(e))
  end)

  it("on a CUDA mesh (NCCL) #gpu", function()
    util.need_cuda_ranks(pending)
    check("cuda")
    -- and the CUDA run equals the CPU run
    cpu_dropout = 0
    local lc, _, gc = run("cpu", { bucket_cap_mb = 0.004 })
    cpu_dropout = nil
    local lg, _, gg = run("cuda", { bucket_cap_mb = 0.004 })
    for s = 1, STEPS do assert(math.abs(lc[s] - lg[s]) < 1e-5, s .. ": " .. lc[s] .. " vs " .. lg[s]) end
    for name, g in pairs(gc) do assert(util.diff(g, gg[name]) < 1e-5, name .. ": " .. util.diff(g, gg[name])) end
  end)
end)
