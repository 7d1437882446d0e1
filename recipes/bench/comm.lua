-- Collective benchmark: engine.distributed collectives against the bare MPI
-- collective on the same buffers, in the same run (median of N timed runs
-- after warm-up; bare and engine calls alternate, each after a barrier; the
-- slowest rank's median is reported).
--
--   mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader --mca pml ob1 \
--     -np 4 build/engine recipes/bench/comm.lua [MiB=64] [reps=10]
local engine = require("engine")
local dist = engine.distributed
local C = engine.C

local mib = tonumber(arg and arg[1]) or 64
local reps = tonumber(arg and arg[2]) or 10
local R, W = dist.rank(), dist.world_size()
local world = dist.world_group()
local n = math.floor(mib * 1024 * 1024 / 4) -- f32 elements of the 64 MiB buffer
n = n - n % W

local function median(xs)
  table.sort(xs)
  local k = #xs
  return k % 2 == 1 and xs[(k + 1) / 2] or 0.5 * (xs[k / 2] + xs[k / 2 + 1])
end

-- Times a and b alternately (so that load changes hit both alike); returns
-- the medians over ranks' slowest (max over ranks of each rank's median).
local function time_pair(a, b)
  for _ = 1, 3 do a(); b() end
  local ta, tb = {}, {}
  for i = 1, reps do
    for k, fn in ipairs({ a, b }) do
      dist.barrier()
      local t0 = engine.time()
      fn()
      local dt = (engine.time() - t0) * 1e3
      if k == 1 then ta[i] = dt else tb[i] = dt end
    end
  end
  local m = engine.tensor({ median(ta), median(tb) }, "f64")
  dist.all_reduce(m, "max")
  return m:get(1), m:get(2)
end

local function raw(kind, send, recv, count, op)
  local rc = C.eng_pg_raw_collective(world._c, kind, send, recv, count, 0, op or 0, 0)
  if rc ~= 0 then error(engine.ffi.string(C.eng_last_error())) end
end

local big = engine.ones(n)
local chunk = engine.ones(n / W)
local out_big = engine.zeros(n)
local results = {}
local function row(name, a, b)
  local bare, ours = time_pair(a, b)
  results[#results + 1] = string.format("%-16s bare MPI %8.2f ms   engine %8.2f ms   ratio %.3f", name, bare, ours,
    ours / bare)
end

row("all_reduce", function() raw(0, nil, big:data_ptr(), n) end, function() dist.all_reduce(big, "sum") end)
row("all_reduce avg", function() raw(0, nil, big:data_ptr(), n) end,
  function() dist.all_reduce(big, "avg") end)
-- nonblocking: the call DistributedDataParallel's buckets make (Open MPI's coll/libnbc, in place), then its wait
row("all_reduce async", function() raw(0, nil, big:data_ptr(), n) end,
  function() dist.all_reduce(big, "sum", { async = true }):wait() end)
row("all_gather", function() raw(1, chunk:data_ptr(), out_big:data_ptr(), n / W) end,
  function() dist.all_gather_into(out_big, chunk) end)
row("reduce_scatter", function() raw(2, big:data_ptr(), chunk:data_ptr(), n / W) end,
  function() dist.reduce_scatter_into(chunk, big, "sum") end)
row("all_to_all", function() raw(3, big:data_ptr(), out_big:data_ptr(), n / W) end,
  function() dist.all_to_all_into(out_big, big) end)
row("broadcast", function() raw(4, nil, big:data_ptr(), n) end,
  function() dist.broadcast(big, 0) end)
local bfb = engine.ones(n, { dtype = "bf16" })
row("all_reduce bf16", function() raw(0, nil, big:data_ptr(), n) end,
  function() dist.all_reduce(bfb, "sum") end)

if R == 0 then
  print(string.format("collectives, %d ranks, %g MiB f32 (%d elements), median of %d runs", W, mib, n, reps))
  for _, l in ipairs(results) do print(l) end
  print("(all_reduce async: the engine's nonblocking all_reduce and its wait; bare is the blocking call)")
  print("(all_reduce bf16: a bf16 tensor of the same element count, summed with the 2-byte custom MPI op on 2 " ..
    "ranks and widened to f32 on more; bare is the f32 call)")
end
