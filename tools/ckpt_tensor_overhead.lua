-- tools/ckpt_tensor_overhead.lua: the per-tensor cost of dist.checkpoint save and load (docs/design.md,
-- "Distributed checkpoints"). The same 256 MiB of f32 (Shard(1) over all ranks) as NT tensors; five saves,
-- then twenty loads, into one directory; rank 0 prints the mean ms of each and the ms per tensor. Compare
-- NT=1024 against NT=8. PROF=l (or f) writes a jit.p profile of the loads to /tmp/ckpt_prof_<rank>.txt.
--   NT=1024 mpirun -x NT -np 1 build/engine tools/ckpt_tensor_overhead.lua
--   NT=8    mpirun -x NT -np 1 build/engine tools/ckpt_tensor_overhead.lua
--   NT=1024 PROF=l mpirun -x NT -x PROF -np 1 build/engine tools/ckpt_tensor_overhead.lua
local engine = require("engine")
local dist = engine.distributed
local ckpt = dist.checkpoint
dist.init()
local W = dist.world_size()
local mesh = dist.init_device_mesh("cpu", { W })
local N = tonumber(os.getenv("NT") or 1024)
local rows = math.floor(262144 / N)
local st, back = {}, {}
for i = 1, N do
  st["w" .. i] = dist.rand({ rows, 256 }, { mesh = mesh, placements = { dist.Shard(1) } })
  back["w" .. i] = dist.zeros({ rows, 256 }, { mesh = mesh, placements = { dist.Shard(1) } })
end
local dir = string.format("%s/ckpt_tensor_overhead", os.getenv("TMPDIR") or "/tmp")
ckpt.save(st, dir)
ckpt.load(back, dir)
local t0 = engine.time()
for _ = 1, 5 do ckpt.save(st, dir) end
local t1 = engine.time()
local prof = os.getenv("PROF")
if prof then require("jit.p").start(prof, "/tmp/ckpt_prof_" .. dist.rank() .. ".txt") end
for _ = 1, 20 do ckpt.load(back, dir) end
if prof then require("jit.p").stop() end
local t2 = engine.time()
if dist.rank() == 0 then
  local s, l = (t1 - t0) / 5, (t2 - t1) / 20
  print(string.format("%d ranks, %d tensors: save %.2f ms, load %.2f ms (per tensor: save %.1f us, load %.1f us)",
    W, N, s * 1e3, l * 1e3, s / N * 1e6, l / N * 1e6))
  os.execute("rm -rf '" .. dir .. "'")
end
