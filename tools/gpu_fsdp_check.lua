-- FSDP on a CUDA mesh (one process; NCCL needs one GPU per rank): a Linear-ReLU-Linear stack built on the CPU and
-- fully sharded (blocks + root) on "cuda" (fully_shard moves the shards there, the root moves the CPU inputs)
-- trains 5 AdamW steps equal to the same model on the CPU.
--   build/engine tools/gpu_fsdp_check.lua [--offload=1 [--pin_memory=0]]
-- --offload=1: offload_policy = dist.CPUOffloadPolicy{pin_memory} (pin_memory 1 by default): the sharded
-- parameters, their gradients and the AdamW states must stay on the CPU (pinned host memory with pin_memory), the
-- unsharded parameters and the outputs on the GPU; every step checks where each lives and fails loudly otherwise.
local engine = require("engine")
local nn, F, dist = engine.nn, engine.nn.functional, engine.distributed
local opts = require("engine.cli").parse(arg or {}, { name = "gpu_fsdp_check",
  description = "FSDP on the GPU: a small MLP trains; with --offload=1 the sharded state stays on the CPU.",
  options = {
    { "offload", "0", "1: offload_policy = dist.CPUOffloadPolicy{pin_memory}", choices = { "0", "1" } },
    { "pin_memory", "1", "1: pinned host memory for the offloaded state", choices = { "0", "1" } },
  } })
local offload, pin = opts.offload == "1", opts.pin_memory == "1"
if not engine.cuda.is_available() then print("gpu_fsdp_check: no GPU: " .. tostring(engine.cuda.unavailable_reason and engine.cuda.unavailable_reason())); return end
local mesh = dist.init_device_mesh("cuda", { dist.world_size() })
local function mlp()
  engine.manual_seed(3)
  return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 32))
end
local ref, m = mlp(), mlp()
local fo = { mesh = mesh }
if offload then fo.offload_policy = dist.CPUOffloadPolicy({ pin_memory = pin }) end
dist.fully_shard(m[1], fo); dist.fully_shard(m[3], fo); dist.fully_shard(m, fo)
local opt_r = engine.optim.AdamW(ref:parameters(), { lr = 1e-2 })
local opt_m = engine.optim.AdamW(m:parameters(), { lr = 1e-2 })
local want = offload and "cpu" or "cuda"
local pin_want  -- nil: not checked (no offload); else whether the sharded parameters and gradients must be pinned
if offload then pin_want = pin end
local function where(t, what, pinned)
  local l = dist.is_dtensor(t) and t:to_local() or t
  assert(l.device == want, string.format("gpu_fsdp_check: %s is on %s, expected %s", what, l.device, want))
  if pinned ~= nil then
    assert(l:is_pinned() == pinned, string.format("gpu_fsdp_check: %s is_pinned %s, expected %s", what, tostring(l:is_pinned()), tostring(pinned)))
  end
end
if offload then
  local c = dist.fsdp_counts(m[1])
  assert(c.offload and c.pinned == pin, "gpu_fsdp_check: fsdp_counts says offload " .. tostring(c.offload) .. ", pinned " .. tostring(c.pinned))
  m[1]:unshard()
  assert(m[1].weight.device == "cuda", "gpu_fsdp_check: the unsharded weight is on " .. m[1].weight.device)
  m[1]:reshard()
end
local worst, pworst = 0, 0
for step = 1, 5 do
  engine.manual_seed(10 + step)
  local x, y = engine.randn(16, 64), engine.randn(16, 32)
  local lr = F.mse_loss(ref(x), y); lr:backward()
  local out = m(x)
  assert(out.device == "cuda", "gpu_fsdp_check: the output is on " .. out.device)
  local l = F.mse_loss(out, y:to("cuda")); l:backward()
  for name, p in m:named_parameters() do
    where(p, name, pin_want)
    where(p.grad, "grad of " .. name, pin_want)   -- zero_grad() sets to none: each step a new one
    local d = (p.grad:full_tensor():to("cpu") - ref:get_parameter(name).grad):abs():max():item()
    worst = math.max(worst, d)
  end
  print(string.format("step %d loss cpu %.6f cuda %.6f", step, lr:item(), l:to("cpu"):item()))
  opt_r:step(); opt_m:step(); opt_r:zero_grad(); opt_m:zero_grad()
  for _, p in ipairs(m:parameters()) do
    where(opt_m.state[p].exp_avg, "exp_avg", nil); where(opt_m.state[p].exp_avg_sq, "exp_avg_sq", nil)
  end
end
for name, p in m:named_parameters() do
  pworst = math.max(pworst, (p:full_tensor():to("cpu") - ref:get_parameter(name)):abs():max():item())
end
print(string.format("gpu_fsdp_check%s: max |grad cuda - grad cpu| over 5 steps = %.3g, params after = %.3g; device of a "
  .. "sharded parameter: %s%s", offload and (" --offload=1 --pin_memory=" .. opts.pin_memory) or "", worst, pworst,
  m[1].weight:to_local().device, offload and (", pinned " .. tostring(m[1].weight:to_local():is_pinned())) or ""))
