-- Where S(1)->S(2) time goes: wall and CPU time per rank of the bare MPI all_to_all of the
-- contiguous local (no layout change) against DTensor's S(1)->S(2) (the layout change, single-copy
-- path when the group allows it).  CPU time (os.clock, process time) shows the work a rank does,
-- free of the waiting that oversubscribed ranks add to wall time.  Median of `iters`, every rank.
--
--   mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader --mca pml ob1 \
--     -np 4 build/engine recipes/bench/redistribute_cpu.lua [MiB=64] [iters=50]
-- For the kernel's share: prefix rank 0's command with `perf record -g` (see docs/design.md).
local engine = require("engine")
local dist = engine.distributed
local C = engine.C

local mib = tonumber(arg and arg[1]) or 64
local iters = tonumber(arg and arg[2]) or 50
local W = dist.world_size()
local mesh = dist.init_device_mesh("cpu", { W })
local pg = mesh:get_group(1)
local cols = 4096
local rows = math.floor(mib * 1024 * 1024 / 4 / cols)
rows = rows - rows % W

local sharded = dist.ones({ rows, cols }, { mesh = mesh, placements = { dist.Shard(1) } })
local l_sh = sharded:to_local()
local out = engine.zeros(rows / W, cols)

local function median(xs)
  table.sort(xs)
  local k = #xs
  return k % 2 == 1 and xs[(k + 1) / 2] or 0.5 * (xs[k / 2] + xs[k / 2 + 1])
end

local tw, tc, dw, dc = {}, {}, {}, {}
for i = 1, iters do
  dist.barrier()
  local t0, c0 = engine.time(), os.clock()
  if C.eng_pg_raw_collective(pg._c, 3, l_sh:data_ptr(), out:data_ptr(), l_sh:numel() / W, 0, 0, 0) ~= 0 then
    error(engine.ffi.string(C.eng_last_error()))
  end
  tw[i], tc[i] = (engine.time() - t0) * 1e3, (os.clock() - c0) * 1e3
  dist.barrier()
  t0, c0 = engine.time(), os.clock()
  local r = sharded:redistribute(nil, { dist.Shard(2) })
  dw[i], dc[i] = (engine.time() - t0) * 1e3, (os.clock() - c0) * 1e3
  C.eng_tensor_release(engine.ffi.gc(r._c, nil)); r._c = nil
end
local line = string.format("rank %d: bare all_to_all wall %.2f ms cpu %.2f ms   DTensor S(1)->S(2) wall %.2f ms cpu %.2f ms",
  dist.rank(), median(tw), median(tc), median(dw), median(dc))
-- print in rank order
for r = 0, W - 1 do
  if r == dist.rank() then print(line); io.stdout:flush() end
  dist.barrier()
end
