-- FSDP on a CUDA mesh (one process; NCCL needs one GPU per rank): a Linear-ReLU-Linear stack built on the CPU and
-- fully sharded (blocks + root) on "cuda" (fully_shard moves the shards there, the root moves the CPU inputs)
-- trains 5 AdamW steps equal to the same model on the CPU.
--   build/engine tools/gpu_fsdp_check.lua
local engine = require("engine")
local nn, F, dist = engine.nn, engine.nn.functional, engine.distributed
if not engine.cuda.is_available() then print("gpu_fsdp_check: no GPU: " .. tostring(engine.cuda.unavailable_reason and engine.cuda.unavailable_reason())); return end
local mesh = dist.init_device_mesh("cuda", { dist.world_size() })
local function mlp()
  engine.manual_seed(3)
  return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 32))
end
local ref, m = mlp(), mlp()
dist.fully_shard(m[1], { mesh = mesh }); dist.fully_shard(m[3], { mesh = mesh }); dist.fully_shard(m, { mesh = mesh })
local opt_r = engine.optim.AdamW(ref:parameters(), { lr = 1e-2 })
local opt_m = engine.optim.AdamW(m:parameters(), { lr = 1e-2 })
local worst = 0
for step = 1, 5 do
  engine.manual_seed(10 + step)
  local x, y = engine.randn(16, 64), engine.randn(16, 32)
  local lr = F.mse_loss(ref(x), y); lr:backward()
  local l = F.mse_loss(m(x), y:to("cuda")); l:backward()
  for name, p in m:named_parameters() do
    local d = (p.grad:full_tensor():to("cpu") - ref:get_parameter(name).grad):abs():max():item()
    worst = math.max(worst, d)
  end
  print(string.format("step %d loss cpu %.6f cuda %.6f", step, lr:item(), l:to("cpu"):item()))
  opt_r:step(); opt_m:step(); opt_r:zero_grad(); opt_m:zero_grad()
end
print(string.format("gpu_fsdp_check: max |grad cuda - grad cpu| over 5 steps = %.3g; device of a parameter: %s", worst,
  m[1].weight:to_local().device))
