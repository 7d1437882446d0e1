-- FSDP's offload_policy = dist.CPUOffloadPolicy{pin_memory} (FSDP2's
-- CPUOffloadPolicy).  On a CPU mesh it is accepted and changes nothing: the runs below are compared bit for
-- bit with runs without it.  On a CUDA mesh ("#gpu", pending without a GPU, or with fewer GPUs than ranks:
-- NCCL wants one per rank) the sharded parameters, their gradients and the AdamW states live on the CPU
-- (pinned host memory with pin_memory), the unsharded parameters and the compute on the GPU, and training
-- equals one process on the CPU.
--   only these: build/engine /usr/bin/busted --ignore-lua -o tools/passfail.lua --tags=gpu spec/dist/fsdp_offload_spec.lua
local engine = require("engine")
local nn = engine.nn
local F = nn.functional
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local errmsg = util.errmsg

local W, rank = dist.world_size(), dist.rank()
local cpu_mesh = dist.init_device_mesh("cpu", { W })

local available = engine.cuda.is_available()
local function need_gpu() util.need_cuda_ranks(pending) end
local function need_no_gpu() if available then pending("a GPU is present: covered by the #gpu tests") end end

local function full(t) if dist.is_dtensor(t) then return t:full_tensor() end return t end
local function rel(a, b)
  a, b = full(a):to("cpu"):to("f64"), full(b):to("cpu"):to("f64")
  return (a - b):abs():max():item() / math.max(1e-6, b:abs():max():item())
end
local function local_rows(t, r)
  local b = t:shape()[1] / W
  return t:narrow(1, r * b + 1, b)
end
local function global_loss(l)
  local t = l:detach():to("cpu"):reshape({ 1 }):clone()
  dist.all_reduce(t, "sum")
  return t:item() / W
end

-- an uneven Linear-ReLU-Linear (7x15x3: padded shards at 2 and 4 ranks)
local function build()
  engine.manual_seed(7)
  return nn.Sequential(nn.Linear(7, 15), nn.ReLU(), nn.Linear(15, 3))
end
local function shard(m, opts)
  dist.fully_shard(m[1], opts); dist.fully_shard(m[3], opts); dist.fully_shard(m, opts)
  return m
end
local function batch(step)
  engine.manual_seed(100 + step)
  return engine.randn(4 * W, 7), engine.randn(4 * W, 3)
end

-- Trains m (sharded, local rows of the global batch) beside ref (one process on the CPU, global batch), AdamW,
-- zero_grad alternating set-to-none, clip_grad_norm_ each step; check(m, opt, step) after each backward.
local function train(m, ref, o)
  local opt_m = engine.optim.AdamW(m:parameters(), { lr = 1e-2, weight_decay = 0.01 })
  local opt_r = ref and engine.optim.AdamW(ref:parameters(), { lr = 1e-2, weight_decay = 0.01 })
  local losses = {}
  for step = 1, o.steps or 5 do
    local x, y = batch(step)
    local l = F.mse_loss(m(local_rows(x, rank)), local_rows(y, rank):to(o.device or "cpu"))
    l:backward()
    losses[step] = global_loss(l)
    local nm = nn.utils.clip_grad_norm_(m:parameters(), 0.5):item()
    if ref then
      local lr = F.mse_loss(ref(x), y)
      lr:backward()
      local nr = nn.utils.clip_grad_norm_(ref:parameters(), 0.5):item()
      assert.is_true(math.abs(losses[step] - lr:item()) <= 1e-5 * math.max(1, math.abs(lr:item())),
        string.format("step %d loss %.9g vs %.9g", step, losses[step], lr:item()))
      assert.is_true(math.abs(nm - nr) <= 1e-5 * math.max(1, nr), string.format("step %d norm %.9g vs %.9g", step, nm, nr))
      local rp = {}
      for name, p in ref:named_parameters() do rp[name] = p end
      for name, p in m:named_parameters() do
        assert.is_true(rel(p.grad, rp[name].grad) < 1e-5, string.format("step %d grad %s: %g", step, name, rel(p.grad, rp[name].grad)))
      end
    end
    if o.check then o.check(m, opt_m, step) end
    opt_m:step()
    if opt_r then opt_r:step() end
    local none = step % 2 == 0
    opt_m:zero_grad(none)
    if opt_r then opt_r:zero_grad(none) end
  end
  if ref then
    local rp = {}
    for name, p in ref:named_parameters() do rp[name] = p end
    for name, p in m:named_parameters() do
      assert.is_true(rel(p, rp[name]) < 1e-5, "param " .. name .. ": " .. rel(p, rp[name]))
    end
  end
  return losses, opt_m
end

describe("CPUOffloadPolicy on a CPU mesh (nothing to offload)", function()
  it("is a no-op: the same losses, gradients, parameters and AdamW states bit for bit as without it", function()
    local plain = shard(build(), { mesh = cpu_mesh })
    local off = shard(build(), { mesh = cpu_mesh, offload_policy = dist.CPUOffloadPolicy({ pin_memory = true }) })
    for _, m in ipairs({ off, off[1], off[3] }) do
      local c = dist.fsdp_counts(m)
      assert.is_false(c.offload); assert.is_false(c.pinned)
    end
    local grads = {}
    local lp, op = train(plain, nil, { check = function(m, _, step)
      grads[step] = {}
      for name, p in m:named_parameters() do grads[step][name] = p.grad:to_local():clone() end
    end })
    local lo, oo = train(off, nil, { check = function(m, _, step)
      for name, p in m:named_parameters() do
        local g = p.grad:to_local()
        assert.are.equal("cpu", g.device)
        assert.is_false(g:is_pinned())
        assert.are.equal(0, util.diff(g, grads[step][name]), name)
      end
    end })
    for step = 1, #lp do assert.are.equal(lp[step], lo[step], "step " .. step) end
    local pp = {}
    for name, p in plain:named_parameters() do pp[name] = p end
    for name, p in off:named_parameters() do
      assert.are.equal(0, util.diff(p:to_local(), pp[name]:to_local()), name)
      assert.are.equal(0, util.diff(oo.state[p].exp_avg_sq:to_local(), op.state[pp[name]].exp_avg_sq:to_local()), name)
    end
  end)

  it("pin_memory without a GPU: 'CUDA is not available'; a DTensor is refused; is_pinned is false", function()
    need_no_gpu()
    local t = engine.randn(3, 4)
    assert.is_false(t:is_pinned())
    assert.is_truthy(errmsg(function() return t:pin_memory() end):find("CUDA is not available", 1, true))
    local d = dist.distribute_tensor(engine.randn(4, 2), cpu_mesh, { dist.Shard(1) })
    assert.is_truthy(errmsg(function() return d:pin_memory() end):find("is a DTensor", 1, true))
    assert.is_truthy(errmsg(dist.fully_shard, nn.Linear(2, 2), { mesh = cpu_mesh, offload_policy = { cpu = true } })
      :find("offload_policy must be dist.OffloadPolicy() or dist.CPUOffloadPolicy", 1, true))
  end)
end)

describe("CPUOffloadPolicy on a CUDA mesh #gpu", function()
  local function on_cpu(t, pinned, what)
    local l = dist.is_dtensor(t) and t:to_local() or t
    assert.are.equal("cpu", l.device, what)
    if pinned ~= nil then assert.are.equal(pinned, l:is_pinned(), what) end
  end

  for _, pin in ipairs({ true, false }) do
    it(string.format("pin_memory = %s: sharded parameters, gradients and AdamW states on the CPU, unsharded on "
      .. "cuda; trains equal to one process on the CPU (5 steps, clip_grad_norm_)", tostring(pin)), function()
      need_gpu()
      local mesh = dist.init_device_mesh("cuda", { W })
      local ref = build()
      local m = shard(build(), { mesh = mesh, offload_policy = dist.CPUOffloadPolicy({ pin_memory = pin }) })
      for _, mm in ipairs({ m, m[1], m[3] }) do
        local c = dist.fsdp_counts(mm)
        assert.is_true(c.offload); assert.are.equal(pin, c.pinned)
      end
      for name, p in m:named_parameters() do on_cpu(p, pin, name) end
      -- the unsharded parameters (between unshard and reshard) are on the GPU
      m[1]:unshard()
      assert.is_false(dist.is_dtensor(m[1].weight))
      assert.are.equal("cuda", m[1].weight.device)
      m[1]:reshard()
      assert.is_true(dist.is_dtensor(m[1].weight))
      train(m, ref, { device = "cuda", check = function(mm, opt, step)
        for name, p in mm:named_parameters() do
          on_cpu(p, pin, name)
          -- a new gradient is pinned with pin_memory (step 1, and after each set-to-none); an existing one
          -- (after zero_grad(false)) takes the next reduce-scatter added into it in place
          on_cpu(p.grad, pin, "grad " .. name)
          if step > 1 then
            on_cpu(opt.state[p].exp_avg, nil, "exp_avg " .. name)
            on_cpu(opt.state[p].exp_avg_sq, nil, "exp_avg_sq " .. name)
          end
        end
      end })
      -- the forward's outputs are on cuda
      local y = m(engine.randn(2, 7))
      assert.are.equal("cuda", y.device)
    end)
  end

  it("reshard_after_forward = false: equal to one process; state_dict gives CPU DTensors, a round trip restores "
    .. "them; bf16 mixed precision: bf16 unsharded on cuda, f32 gradients on the CPU", function()
    need_gpu()
    local mesh = dist.init_device_mesh("cuda", { W })
    local m = shard(build(), { mesh = mesh, reshard_after_forward = false,
      offload_policy = dist.CPUOffloadPolicy({}) })
    local ref = build()
    train(m, ref, { device = "cuda", steps = 3 })
    local sd = m:state_dict()
    local keys = {}
    for k, v in pairs(sd) do
      assert.is_true(dist.is_dtensor(v), k)
      assert.are.equal("cpu", v:to_local().device, k)
      keys[#keys + 1] = k
    end
    table.sort(keys)   -- the same collectives in the same order on every rank
    local saved = {}
    for _, k in ipairs(keys) do saved[k] = sd[k]:full_tensor():clone() end
    for _, p in ipairs(m:parameters()) do engine.no_grad(function() p:fill_(0.25) end) end
    m:load_state_dict(saved)
    local sd2 = m:state_dict()
    for _, k in ipairs(keys) do
      assert.are.equal("cpu", sd2[k]:to_local().device, k)
      assert.is_true(rel(sd2[k], saved[k]) == 0, k)
    end
    -- mixed precision: bf16 unsharded parameters on cuda, f32 sharded ones on the CPU
    local mp = shard(build(), { mesh = mesh, mp_policy = dist.MixedPrecisionPolicy({ param_dtype = "bf16", reduce_dtype = "f32" }),
      offload_policy = dist.CPUOffloadPolicy({ pin_memory = true }) })
    mp[1]:unshard()
    assert.are.equal("bf16", mp[1].weight.dtype); assert.are.equal("cuda", mp[1].weight.device)
    mp[1]:reshard()
    local l = F.mse_loss(mp(engine.randn(4, 7)), engine.randn(4, 3):to("cuda"))
    l:backward()
    for name, p in mp:named_parameters() do
      assert.are.equal("f32", p.grad.dtype, name)
      on_cpu(p.grad, true, name)
    end
  end)
end)
