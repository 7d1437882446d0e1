-- DTensor and everything above it on a CUDA mesh: the same operations on a CPU mesh
-- and on a CUDA mesh of the same ranks give the same local shards, full tensors, gradients and collective counts;
-- tensor parallelism (with and without sequence parallelism, loss_parallel), DTensor data parallelism, FSDP (also
-- without resharding after forward), HSDP and FSDP over TP on a CUDA mesh train like one process on the GPU (5 AdamW
-- steps, f32, losses and gradients to 1e-5); FSDP mixed precision trains as on a CPU mesh; checkpoints of CUDA state
-- load into other layouts and devices, also when saved asynchronously.
-- Tagged "#gpu": pending without a GPU, or with fewer GPUs than ranks unless each rank has its own NCCL_HOSTID
-- (several ranks on one GPU: tools/gpu-check.sh).
--   mpirun -np 2 ... build/engine /usr/bin/busted --ignore-lua -o tools/passfail_dist.lua --tags=gpu spec/dist/cuda_dtensor_spec.lua
local engine = require("engine")
local nn = engine.nn
local F = nn.functional
local dist = engine.distributed
local models = require("engine.models")
local util = require("spec.dist.helpers.util")

local R, W = dist.rank(), dist.world_size()
local S, Rep, Part = dist.Shard, dist.Replicate, dist.Partial

local meshes = {}
local function mesh(dev, shape, names)
  local key = dev .. table.concat(shape, "x") .. table.concat(names or {}, ",")
  if not meshes[key] then meshes[key] = dist.init_device_mesh(dev, shape, names) end
  return meshes[key]
end

local function full(t) if dist.is_dtensor(t) then return t:full_tensor() end return t end
local function host(t) return full(t):to("cpu") end
local function diff(a, b) return util.diff(host(a):double(), host(b):double()) end

-- integer-valued floats: sums are exact in any order (NCCL and MPI reduce in different orders)
local function ints(shape, seed)
  engine.manual_seed(seed)
  return (engine.rand(shape) * 16):floor() - 8
end

local function same_local(c, g, what)
  assert.are.equal("cuda", g:to_local().device, what .. ": local shard device")
  local d = diff(c:to_local(), g:to_local())
  assert(d == 0, string.format("%s: local shards differ by %g", what, d))
end

describe("DTensor on a CUDA mesh #gpu", function()
  it("distribute_tensor, from_local, to_local and full_tensor keep the data on the GPU", function()
    util.need_cuda_ranks(pending)
    local cm, gm = mesh("cpu", { W }), mesh("cuda", { W })
    assert.are.equal("cuda", gm.device_type)
    local x = ints({ 7, 5 }, 1)
    for _, pl in ipairs({ { S(1) }, { S(2) }, { Rep() } }) do
      local dc = dist.distribute_tensor(x, cm, pl)
      local dg = dist.distribute_tensor(x:cuda(), gm, pl)
      local dh = dist.distribute_tensor(x, gm, pl) -- a CPU tensor goes to the mesh's device, as in PyTorch
      same_local(dc, dg, "distribute_tensor " .. tostring(pl[1]))
      same_local(dc, dh, "distribute_tensor of a CPU tensor " .. tostring(pl[1]))
      assert.are.equal("cuda", dg:full_tensor().device)
      assert.are.equal(0, diff(dg:full_tensor(), x))
    end
    -- from_local of a CPU local on a CUDA mesh: moved, and the gradient comes back to the CPU tensor
    local loc = ints({ 3, 4 }, 2 + R):requires_grad_()
    local d = dist.DTensor.from_local(loc, gm, { S(1) })
    assert.are.equal("cuda", d:to_local().device)
    local s = (d * d):sum()
    s:backward()
    assert.are.equal("cpu", loc.grad.device)
    assert.are.equal(0, diff(loc.grad, loc:detach() * 2))
    -- factories make their shards on the mesh's device
    for _, f in ipairs({ "zeros", "ones", "empty" }) do
      local z = dist[f]({ 6, 3 }, { mesh = gm, placements = { S(1) } })
      assert.are.equal("cuda", z:to_local().device, f)
    end
  end)

  it("redistribute: every transition gives the CPU mesh's shards (uneven sizes, async)", function()
    util.need_cuda_ranks(pending)
    local cm, gm = mesh("cpu", { W }), mesh("cuda", { W })
    local srcs = { { S(1) }, { S(2) }, { Rep() }, { Part() } }
    local dsts = { { S(1) }, { S(2) }, { Rep() } }
    for _, shape in ipairs({ { 5, 7 }, { 8, 4 }, { 2 * W, 3 } }) do
      for _, a in ipairs(srcs) do
        for _, b in ipairs(dsts) do
          for _, async in ipairs({ false, true }) do
            local what = string.format("%s -> %s %s%s", tostring(a[1]), tostring(b[1]), table.concat(shape, "x"),
              async and " async" or "")
            local dc, dg
            if a[1]:is_partial() then
              local loc = ints(shape, 10 + R)
              dc = dist.DTensor.from_local(loc, cm, a)
              dg = dist.DTensor.from_local(loc:cuda(), gm, a)
            else
              local x = ints(shape, 10)
              dc = dist.distribute_tensor(x, cm, a)
              dg = dist.distribute_tensor(x:cuda(), gm, a)
            end
            local rc = dc:redistribute(cm, b, { async_op = async })
            local rg = dg:redistribute(gm, b, { async_op = async })
            same_local(rc, rg, what)
          end
        end
      end
    end
  end)

  it("redistribute on a 2-D CUDA mesh and _StridedShard", function()
    util.need_cuda_ranks(pending)
    if W ~= 4 then pending("needs 4 ranks for a 2 x 2 mesh") end
    local cm, gm = mesh("cpu", { 2, 2 }, { "a", "b" }), mesh("cuda", { 2, 2 }, { "a", "b" })
    local x = ints({ 6, 10 }, 20)
    local layouts = { { S(1), S(2) }, { S(1), S(1) }, { Rep(), S(1) }, { S(2), Rep() }, { Rep(), Rep() },
      { dist._StridedShard(1, 2), S(1) } }
    for _, a in ipairs(layouts) do
      for _, b in ipairs(layouts) do
        local dc = dist.distribute_tensor(x, cm, a):redistribute(cm, b)
        local dg = dist.distribute_tensor(x:cuda(), gm, a):redistribute(gm, b)
        same_local(dc, dg, tostring(a[1]) .. tostring(a[2]) .. " -> " .. tostring(b[1]) .. tostring(b[2]))
        assert.are.equal(0, diff(dg, x))
      end
    end
  end)

  it("DTensor ops run with CUDA locals: forward and backward equal the CPU mesh", function()
    util.need_cuda_ranks(pending)
    local cm, gm = mesh("cpu", { W }), mesh("cuda", { W })
    local function run(m, dev)
      engine.manual_seed(31)
      local a = engine.randn(8, 6)
      local b = engine.randn(6, 4 * W)
      if dev == "cuda" then a, b = a:cuda(), b:cuda() end
      local da = dist.distribute_tensor(a, m, { S(1) }):requires_grad_()
      local db = dist.distribute_tensor(b, m, { S(2) }):requires_grad_()
      local y = F.softmax(da:matmul(db), -1)
      local z = (F.gelu(y) * y):sum(1):mean()
      z:backward()
      return z, da.grad, db.grad, y
    end
    local c = { run(cm, "cpu") }
    local g = { run(gm, "cuda") }
    for i = 1, 4 do
      local d = diff(c[i], g[i])
      assert(d <= 1e-5, string.format("result %d differs by %g", i, d))
    end
  end)

  it("random DTensors on a CUDA mesh equal one process with the same seed, whatever the layout", function()
    util.need_cuda_ranks(pending)
    local gm = mesh("cuda", { W })
    engine.manual_seed(77)
    local want = engine.randn(9, 6)
    for _, pl in ipairs({ { S(1) }, { S(2) }, { Rep() } }) do
      engine.manual_seed(77)
      local d = dist.randn({ 9, 6 }, { mesh = gm, placements = pl })
      assert.are.equal("cuda", d:to_local().device)
      assert.are.equal(0, diff(d, want), tostring(pl[1]))
      engine.manual_seed(77)
      local e = dist.distribute_tensor(engine.zeros(9, 6):cuda(), gm, pl)
      e:normal_()
      assert.are.equal(0, diff(e, want), "normal_ " .. tostring(pl[1]))
    end
  end)
end)

-- ------------------------------------------------------------------------------------------- training
local V, T = 32, 8
local function tokens(b, t, seed)
  engine.manual_seed(seed)
  return (engine.rand(b, t) * V):to("i64"):cuda()
end
local function rel(a, b) return math.abs(a - b) / math.max(1, math.abs(b)) end
-- clip_grad_norm_'s total norm (a 0-dim f32 tensor on the gradients' device, as PyTorch's) as a number
local function host_num(v)
  assert(engine.is_tensor(v) and v:dim() == 0 and v.dtype == "f32", "the norm is a 0-dim f32 tensor: " .. tostring(v))
  assert.are.equal("cuda", (dist.is_dtensor(v) and v:to_local() or v).device)
  return host(v):item()
end

-- 5 AdamW steps of m (distributed) and ref (one process on the GPU) on the same batches: losses and gradients
-- every step, parameters at the end.  loss_fn(model, x, y) -> loss (a DTensor or a tensor).
local function train_equal(label, m, ref, loss_fn, batch)
  local opt_r = engine.optim.AdamW(ref:parameters(), { lr = 1e-2, weight_decay = 0.1 })
  local opt_m = engine.optim.AdamW(m:parameters(), { lr = 1e-2, weight_decay = 0.1 })
  for step = 1, 5 do
    local x, y = tokens(4, T, 100 + step), tokens(4, T, 200 + step)
    local xm, ym = x, y
    if batch then xm, ym = batch(x, y) end
    local lm = loss_fn(m, xm, ym); lm:backward()
    local lr = F.cross_entropy(ref(x):reshape(-1, V), y:reshape(-1)); lr:backward()
    -- gradient clipping over the DTensor gradients (norms of the local shards on the device, reduced over the mesh)
    local nm = engine.optim.clip_grad_norm_(m:parameters(), 0.5)
    local nr = engine.optim.clip_grad_norm_(ref:parameters(), 0.5)
    assert(rel(tonumber(host_num(nm)), tonumber(host_num(nr))) <= 1e-5, string.format("%s step %d: grad norm %s vs %s",
      label, step, tostring(nm), tostring(nr)))
    local a, b = host(lm):item(), lr:item()
    assert(rel(a, b) <= 1e-5, string.format("%s step %d: loss %.9g vs %.9g", label, step, a, b))
    for name, p in m:named_parameters() do
      assert.are.equal("cuda", (dist.is_dtensor(p) and p:to_local() or p).device, name)
      local d = diff(p.grad, ref:get_parameter(name).grad)
      assert(d <= 1e-5, string.format("%s step %d: grad of %s differs by %g", label, step, name, d))
    end
    opt_m:step(); opt_m:zero_grad(); opt_r:step(); opt_r:zero_grad()
  end
  for name, p in m:named_parameters() do
    local d = diff(p, ref:get_parameter(name))
    assert(d <= 1e-4, string.format("%s: parameter %s differs by %g", label, name, d))
  end
end

local function ce(m, x, y) return F.cross_entropy(m(x):reshape(-1, V), y:reshape(-1)) end
-- fully_shard on every block, then on the root, with the same options (FSDP2's usual wrapping)
local function shard_blocks(m, opts)
  for _, b in ipairs(m.layers:children()) do dist.fully_shard(b, opts) end
  dist.fully_shard(m, opts)
end

describe("parallelism on a CUDA mesh trains like one process on the GPU #gpu", function()
  local args = { n_layers = 2, vocab_size = V, max_seq_len = T, dim = 16, n_heads = 4, dropout_p = 0 }
  local function build() engine.manual_seed(3); return models.Transformer(args) end

  for _, sp in ipairs({ false, true }) do
    it("tensor parallelism (Transformer.parallelize, use_seq_parallel=" .. tostring(sp) .. ")", function()
      util.need_cuda_ranks(pending)
      local gm = mesh("cuda", { W }, { "tp" })
      local ref = build():to("cuda")
      local m = build():to("cuda")
      models.Transformer.parallelize(m, gm, { use_seq_parallel = sp })
      train_equal("tp sp=" .. tostring(sp), m, ref, ce)
    end)
  end

  it("loss_parallel on vocab-sharded logits", function()
    util.need_cuda_ranks(pending)
    local gm = mesh("cuda", { W }, { "tp" })
    local a2 = { n_layers = 1, vocab_size = V, max_seq_len = T, dim = 16, n_heads = 4, dropout_p = 0, weight_tying = false }
    local function b2() engine.manual_seed(5); return models.Transformer(a2) end
    local ref = b2():to("cuda")
    local m = b2():to("cuda")
    dist.parallelize_module(m, gm, {
      ["layers.*.attention.wq"] = dist.ColwiseParallel(), ["layers.*.attention.wk"] = dist.ColwiseParallel(),
      ["layers.*.attention.wv"] = dist.ColwiseParallel(), ["layers.*.attention.wo"] = dist.RowwiseParallel(),
      output = dist.ColwiseParallel{ use_local_output = false },
    })
    train_equal("loss_parallel", m, ref, function(mm, x, y)
      local logits = mm(x)
      return dist.loss_parallel(function()
        return F.cross_entropy(logits:reshape(-1, V), dist.DTensor.from_local(y:reshape(-1), gm, { Rep() }))
      end)
    end)
  end)

  it("the same collectives on a CUDA mesh as on a CPU mesh (TP+SP forward and backward)", function()
    util.need_cuda_ranks(pending)
    local function count(dev)
      local m = build()
      if dev == "cuda" then m:to("cuda") end
      models.Transformer.parallelize(m, mesh(dev, { W }, { "tp" }), { use_seq_parallel = true })
      local x, y = tokens(2, T, 1), tokens(2, T, 2)
      if dev == "cpu" then x, y = x:cpu(), y:cpu() end
      return (util.counted(function() ce(m, x, y):backward() end))
    end
    assert.are.equal(count("cpu"), count("cuda"))
  end)

  it("DTensor data parallelism (Replicate parameters, batch-sharded tokens)", function()
    util.need_cuda_ranks(pending)
    local gm = mesh("cuda", { W }, { "dp" })
    if 4 % W ~= 0 then pending("batch 4 over " .. W .. " ranks") end
    local ref = build():to("cuda")
    local m = build():to("cuda")
    dist.replicate_parameters(m, gm)
    local function shard(x, y)
      local b = x:size(1) / W
      return dist.from_local(x:narrow(1, R * b + 1, b):contiguous(), gm, { S(1) }),
        dist.from_local(y:narrow(1, R * b + 1, b):contiguous(), gm, { S(1) })
    end
    local function dp_loss(mm, dx, dy)
      local logits = dist.implicit_replication(function() return mm(dx) end)
      return F.cross_entropy(logits:reshape(-1, V), dy:reshape(-1))
    end
    train_equal("dtensor dp", m, ref, dp_loss, shard)
  end)

  it("FSDP (fully_shard per block and root) with several ranks", function()
    util.need_cuda_ranks(pending)
    local gm = mesh("cuda", { W }, { "dp" })
    local ref = build():to("cuda")
    local m = build():to("cuda")
    shard_blocks(m, { mesh = gm })
    -- every rank sees the whole batch: FSDP averages equal gradients, so one process on the batch is the reference
    train_equal("fsdp", m, ref, ce)
  end)

  it("DistributedDataParallel over NCCL (buckets during backward)", function()
    util.need_cuda_ranks(pending)
    if 4 % W ~= 0 then pending("batch 4 over " .. W .. " ranks") end
    local ref = build():to("cuda")
    local net = build():to("cuda")
    local m = dist.DistributedDataParallel(net, { bucket_cap_mb = 0.01 })
    local function rows(x, y)
      local b = x:size(1) / W
      return x:narrow(1, R * b + 1, b):contiguous(), y:narrow(1, R * b + 1, b):contiguous()
    end
    local opt_r = engine.optim.AdamW(ref:parameters(), { lr = 1e-2, weight_decay = 0.1 })
    local opt_m = engine.optim.AdamW(m:parameters(), { lr = 1e-2, weight_decay = 0.1 })
    for step = 1, 5 do
      local x, y = tokens(4, T, 100 + step), tokens(4, T, 200 + step)
      local xm, ym = rows(x, y)
      local lm = ce(m, xm, ym); lm:backward()
      local lr = ce(ref, x, y); lr:backward()
      local avg = engine.tensor({ lm:item() }, "f64")
      dist.all_reduce(avg, "avg") -- each rank's mean over its rows; their average is the global mean
      assert(rel(avg:item(), lr:item()) <= 1e-5, string.format("ddp step %d: loss %.9g vs %.9g", step, avg:item(), lr:item()))
      for name, p in net:named_parameters() do
        local d = diff(p.grad, ref:get_parameter(name).grad)
        assert(d <= 1e-5, string.format("ddp step %d: grad of %s differs by %g", step, name, d))
      end
      opt_m:step(); opt_m:zero_grad(); opt_r:step(); opt_r:zero_grad()
    end
    assert(m:comm_stats().collectives >= 2)
  end)

  it("DistributedDataParallel with device_ids: CPU inputs go to the GPU; another GPU's index is refused", function()
    util.need_cuda_ranks(pending)
    local dev = engine.cuda.current_device()
    local net = build():to("cuda")
    local m = dist.DistributedDataParallel(net, { device_ids = { dev }, output_device = "cuda:" .. dev })
    local x, y = tokens(2, T, 300):to("cpu"), tokens(2, T, 301) -- the inputs on the CPU
    local logits = m(x)
    assert.are.equal("cuda", logits.device)
    F.cross_entropy(logits:reshape(-1, V), y:reshape(-1)):backward()
    assert.are.equal(1, m:comm_stats().collectives)
    local ok, e = pcall(dist.DistributedDataParallel, build():to("cuda"), { device_ids = { dev + 1 } })
    assert.is_false(ok)
    assert.truthy(tostring(e):find("is not this rank's GPU cuda:" .. dev, 1, true), tostring(e))
  end)

  it("dist.checkpoint saves CUDA DTensor state and loads it into another layout and device", function()
    util.need_cuda_ranks(pending)
    local gm = mesh("cuda", { W }, { "tp" })
    local m = build():to("cuda")
    models.Transformer.parallelize(m, gm, { use_seq_parallel = true })
    local dir = util.dirs("cuda_ckpt")
    dist.checkpoint.save(m:state_dict(), dir)
    -- into a plain CPU model on every rank, and into a CUDA model laid out for DTensor data parallelism
    local plain = models.Transformer(args)
    local sd = plain:state_dict()
    dist.checkpoint.load(sd, dir)
    plain:load_state_dict(sd)
    local dp = build():to("cuda")
    dist.replicate_parameters(dp, mesh("cuda", { W }, { "dp" }))
    local sd2 = dp:state_dict()
    dist.checkpoint.load(sd2, dir)
    dp:load_state_dict(sd2)
    for name, p in m:named_parameters() do
      assert.are.equal(0, diff(p, plain:get_parameter(name)), "cpu " .. name)
      assert.are.equal(0, diff(p, dp:get_parameter(name)), "dp " .. name)
    end
    if R == 0 then os.execute("rm -rf '" .. dir .. "'") end
  end)

  it("FSDP over TP on a 2-D CUDA mesh", function()
    util.need_cuda_ranks(pending)
    if W ~= 4 then pending("needs 4 ranks for a 2 x 2 mesh") end
    local m2 = mesh("cuda", { 2, 2 }, { "dp", "tp" })
    local ref = build():to("cuda")
    local m = build():to("cuda")
    models.Transformer.parallelize(m, m2.tp, { use_seq_parallel = true })
    shard_blocks(m, { mesh = m2.dp })
    train_equal("fsdp x tp", m, ref, ce)
  end)

  it("HSDP on a (replicate, shard) CUDA mesh", function()
    util.need_cuda_ranks(pending)
    if W ~= 4 then pending("needs 4 ranks for a 2 x 2 mesh") end
    local m2 = mesh("cuda", { 2, 2 }, { "replicate", "shard" })
    local ref = build():to("cuda")
    local m = build():to("cuda")
    shard_blocks(m, { mesh = m2 })
    local w = m.layers:children()[1].attention.wo.weight
    assert.are.equal("Replicate()", tostring(w.placements[1]))
    assert.are.equal("Shard(1)", tostring(w.placements[2]))
    train_equal("hsdp", m, ref, ce)
  end)

  it("FSDP with reshard_after_forward = false (parameters stay unsharded until the backward)", function()
    util.need_cuda_ranks(pending)
    local gm = mesh("cuda", { W }, { "dp" })
    local ref = build():to("cuda")
    local m = build():to("cuda")
    shard_blocks(m, { mesh = gm, reshard_after_forward = false })
    train_equal("fsdp raf=false", m, ref, ce)
  end)

  it("FSDP mixed precision (bf16 compute, f32 reduce) on a CUDA mesh trains as on a CPU mesh", function()
    util.need_cuda_ranks(pending)
    local mp = dist.MixedPrecisionPolicy({ param_dtype = "bf16", reduce_dtype = "f32" })
    local function run(dev)
      local m = build()
      if dev == "cuda" then m:to("cuda") end
      local gm = mesh(dev, { W }, { "dp" })
      shard_blocks(m, { mesh = gm, mp_policy = mp })
      local opt = engine.optim.AdamW(m:parameters(), { lr = 1e-2, weight_decay = 0.1 })
      local losses, counts, grads = {}, {}, {}
      for step = 1, 3 do
        local x, y = tokens(4, T, 100 + step), tokens(4, T, 200 + step)
        if dev == "cpu" then x, y = x:cpu(), y:cpu() end
        local l = F.cross_entropy(m(x):reshape(-1, V):to("f32"), y:reshape(-1))
        counts[step] = util.counted(function() l:backward() end)
        losses[step] = host(l):item()
        for name, p in m:named_parameters() do
          assert.are.equal("f32", p.dtype, name); assert.are.equal("f32", p.grad.dtype, name)
          assert.are.equal(dev, p:to_local().device, name)
          if step == 1 then grads[name] = host(p.grad):double() end
        end
        opt:step(); opt:zero_grad()
      end
      return losses, counts, grads
    end
    local lc, cc, gc = run("cpu")
    local lg, cg, gg = run("cuda")
    for step = 1, 3 do
      -- bf16 products round differently on the two devices (accumulation order): a bf16-sized tolerance
      assert(rel(lg[step], lc[step]) <= 2e-2, string.format("mp step %d: loss cuda %.6g cpu %.6g", step, lg[step], lc[step]))
      assert.are.equal(cc[step], cg[step])
    end
    -- the first step's gradients (bf16 compute, reduced in f32) by relative norm: after AdamW the parameters are no
    -- measure (its first updates are lr * sign(g), so an element whose bf16 gradient is near zero moves by up to
    -- 2 lr on one device and not the other: a 7% max difference on the GPU with losses equal to 2e-2)
    for name, a in pairs(gg) do
      local b = gc[name]
      local d = (a - b):norm():item() / math.max(1e-6, b:norm():item())
      assert(d <= 5e-2, string.format("mp: gradient of %s differs by %g (relative norm)", name, d))
    end
  end)

  it("dist.checkpoint.save with async = true stages CUDA state and writes it while training goes on", function()
    util.need_cuda_ranks(pending)
    local gm = mesh("cuda", { W }, { "tp" })
    local m = build():to("cuda")
    models.Transformer.parallelize(m, gm, { use_seq_parallel = true })
    local dir = util.dirs("cuda_ckpt_async")
    local want = {}
    for name, p in m:named_parameters() do want[name] = host(p):clone() end
    local h = dist.checkpoint.save(m:state_dict(), dir, { async = true })
    -- the saved values are the ones at save time: change the parameters before waiting
    engine.no_grad(function()
      for _, p in ipairs(m:parameters()) do (dist.is_dtensor(p) and p:to_local() or p):fill_(-1) end
    end)
    h:wait()
    assert.is_true(h:is_completed())
    local plain = models.Transformer(args)
    local sd = plain:state_dict()
    dist.checkpoint.load(sd, dir)
    plain:load_state_dict(sd)
    for name, w in pairs(want) do
      assert.are.equal(0, diff(plain:get_parameter(name), w), name)
    end
    if R == 0 then os.execute("rm -rf '" .. dir .. "'") end
  end)
end)
