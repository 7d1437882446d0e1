-- recipes/bench/dtensor_dispatch.lua: per-op cost of a small DTensor add through
-- the sharding dispatcher (the cached case: same op, same input specs) beside
-- the plain-tensor add in the same run (issue target: DTensor eager op overhead
-- under 10 us).
--
--   build/engine recipes/bench/dtensor_dispatch.lua [--n=20000] [--runs=7] [--device=cpu|cuda]
--   mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader --mca pml ob1 \
--     -np 2 build/engine recipes/bench/dtensor_dispatch.lua
--
-- Cases (4x4 f32 global tensors; a DTensor is sharded Shard(1) over a 1-d mesh
-- of the world, so the local shard is tiny and the arithmetic negligible):
--   plain        c = a + b on plain tensors
--   dtensor      c = da + db (same specs every call: strategy cache hit, no redistribution)
--   dtensor_grad c = dw + db with dw requiring grad (a marked autograd node too)
--   plain_grad   c = w + b with w requiring grad (the plain counterpart)
-- The cases alternate within each run; each figure is the median over runs of
-- ns/op (rank 0 prints; the overhead is dtensor - plain).  --device=cuda: the tensors on the GPU and the mesh a
-- CUDA mesh (target: the DTensor host overhead on a CUDA mesh <= 1 us); each case ends with a device sync.
local engine = require("engine")
local dist = engine.distributed

local opts = require("engine.cli").parse(arg or {}, { name = "bench/dtensor_dispatch",
  description = "The host overhead of an op on DTensors against the same op on plain tensors.",
  options = {
    { "n", 20000, "ops per case and run", int = true, min = 1 },
    { "runs", 7, "runs (the median is printed)", int = true, min = 1 },
    { "device", "cpu", "where the tensors and the mesh are", choices = { "cpu", "cuda" } },
  } })
if opts.device == "cuda" and not engine.cuda.is_available() then
  print("dtensor_dispatch: --device=cuda: " .. engine.cuda.unavailable_reason())
  os.exit(0)
end
local dev = opts.device

local function median(t)
  table.sort(t)
  local n = #t
  return n % 2 == 1 and t[(n + 1) / 2] or 0.5 * (t[n / 2] + t[n / 2 + 1])
end

local W = dist.world_size()
local mesh = dist.init_device_mesh(dev, { W })
local S = dist.Shard
local a, b = engine.randn(4, 4):to(dev), engine.randn(4, 4):to(dev)
local w = engine.randn(4, 4):to(dev):requires_grad_()
local da = dist.distribute_tensor(a, mesh, { S(2) }, { src_data_rank = false })
local db = dist.distribute_tensor(b, mesh, { S(2) }, { src_data_rank = false })
local dw = dist.distribute_tensor(a, mesh, { S(2) }, { src_data_rank = false })
dw.requires_grad = true

local probe = da + db
assert(dist.is_dtensor(probe) and probe.placements[1] == S(2), "the DTensor add did not go through the dispatcher")

local cases = {
  { "plain", function() return a + b end },
  { "dtensor", function() return da + db end },
  { "plain_grad", function() return w + b end },
  { "dtensor_grad", function() return dw + db end },
}

local n = opts.n
local times = {}
for _, c in ipairs(cases) do times[c[1]] = {} end
for run = 0, opts.runs do
  for _, c in ipairs(cases) do
    local fn = c[2]
    collectgarbage("collect")
    local t0 = engine.time()
    for _ = 1, n do fn() end
    if dev == "cuda" then engine.cuda.synchronize() end
    local dt = (engine.time() - t0) / n * 1e9
    if run > 0 then table.insert(times[c[1]], dt) end -- run 0 warms up (JIT, caches)
  end
end

if dist.rank() == 0 then
  print(string.format("DTensor dispatch cost, %d ranks, 4x4 f32 on %s, Shard(1); median of %d runs x %d ops", W, dev,
    opts.runs, n))
  local m = {}
  for _, c in ipairs(cases) do
    m[c[1]] = median(times[c[1]])
    print(string.format("  %-13s %9.0f ns/op", c[1], m[c[1]]))
  end
  print(string.format("  overhead: add %.2f us/op, add with grad %.2f us/op (target < 10 us)",
    (m.dtensor - m.plain) / 1e3, (m.dtensor_grad - m.plain_grad) / 1e3))
end
