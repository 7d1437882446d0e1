-- recipes/bench/watchdog.lua: cost of the comm watchdog (ENGINE_COMM_WATCHDOG, comm/peer_health.c) on the DP
-- training step, and how fast it finds ranks waiting on different groups.
--
--   mpirun -np 4 build/engine recipes/bench/watchdog.lua [--steps=8] [--rounds=3] [--warmup=2]
--       [--n_layers=4] [--dim=256] [--n_heads=4] [--seq=128] [--batch=8] [--threads=0]
--
-- Trains the reference GPT data-parallel with DTensors as recipes/bench/comm_check.lua does, and times the
-- step with the watchdog off (dist.set_comm_watchdog(0)) and on (1 s, the default) in the same run:
-- rounds x steps steps in each mode, alternating step by step (drift and other load hit both alike), after
-- `warmup` steps.  Prints the median ms/step of each mode and the overhead in percent, the cost per tiny
-- all_reduce (500, off and on), then makes a deadlock across groups (rank 0 in an all_reduce on one group,
-- the others on another) and prints how long the verdict took on each rank (the goal: <= 10 s).
-- Rank 0 prints; every rank runs the same steps.
local engine = require("engine")
local dist = engine.distributed
local U = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/util.lua")
local median = U.median

-- the data-parallel GPT step, timed with the feature off and on step by step after the warmup
local b = U.dp_ab_bench("bench/watchdog", arg, function(on) dist.set_comm_watchdog(on and 1 or 0) end)
local o, rank, world, log, step = b.o, b.rank, b.world, b.log, b.step
local counts, ncoll, off, on = b.counts, b.ncoll, b.off, b.on
local function tiny(wd)
  dist.set_comm_watchdog(wd)
  local t = engine.ones(1)
  dist.barrier()
  local t0 = engine.time()
  for _ = 1, 500 do dist.all_reduce(t) end
  return (engine.time() - t0) / 500 * 1e6
end
local us_off, us_on = {}, {}
for _ = 1, 3 do us_off[#us_off + 1] = tiny(0); us_on[#us_on + 1] = tiny(1) end
dist.set_comm_watchdog(1)
local m_off, m_on = median(off), median(on)
log("collectives per step: %d", ncoll)
log("watchdog off: %.1f ms/step (median of %d)", m_off, #off)
log("watchdog on:  %.1f ms/step (median of %d)", m_on, #on)
log("overhead:     %+.2f%% (step medians, on vs off)", 100 * (m_on - m_off) / m_off)
local diffs = {}
for i = 1, #on do diffs[i] = on[i] - off[i] end
log("paired:       %+.2f%% (median of the step-by-step differences, on - off, over the off median)",
  100 * median(diffs) / m_off)
log("all_reduce f32[1]: %.1f us off, %.1f us on", median(us_off), median(us_on))

-- detection: rank 0 waits on g1, the others on g2 (with the default watchdog, 1 s)
if world > 1 then
  local all = {}
  for i = 1, world do all[i] = i - 1 end
  local g1, g2 = dist.new_group(all), dist.new_group(all)
  dist.barrier()
  local t0 = engine.time()
  local ok, err = pcall(function()
    if rank == 0 then dist.all_reduce(engine.ones(2), "sum", { group = g1 })
    else dist.all_reduce(engine.ones(2), "sum", { group = g2 }) end
  end)
  local secs = engine.time() - t0
  local found = not ok and tostring(err):find("deadlock across groups", 1, true) ~= nil
  local t = engine.tensor({ secs, found and 1 or 0 }, "f64")
  local mx = t:clone()
  dist.all_reduce(mx, "max")
  dist.all_reduce(t, "min")
  log("cross-group wait found on %s rank(s) in %.2f s (slowest rank; goal <= 10 s)",
    t:tolist_flat()[2] == 1 and "every" or "NOT every", mx:tolist_flat()[1])
end
