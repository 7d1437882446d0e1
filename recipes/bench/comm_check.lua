-- recipes/bench/comm_check.lua: cost of the always-on collective signature check on the training step.
--
--   mpirun -np 2 build/engine recipes/bench/comm_check.lua [--steps=8] [--rounds=3] [--warmup=2]
--       [--n_layers=4] [--dim=256] [--n_heads=4] [--seq=128] [--batch=8] [--threads=0]
--
-- Trains the reference GPT data-parallel with DTensors as recipes/dp_gpt.lua does (Replicate
-- parameters, batch Shard(1), cross_entropy mean over the sharded batch, gradients all_reduced by
-- AccumulateGrad, clip_grad_norm_, AdamW), on a fixed random batch, and times the step with the
-- signature check off and on in the same run: rounds x steps steps in each mode, alternating step by
-- step (so drift of the machine and other load hit both alike), after `warmup` steps.  Prints the median ms/step of each mode, the overhead in percent, the collectives
-- per step, and the check's own cost per collective (500 tiny all_reduces with it off and on) times the
-- collectives of a step: the overhead without the step's run-to-run noise.  Rank 0 prints; every rank runs the same steps.
local engine = require("engine")
local dist = engine.distributed
local U = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/util.lua")
local median = U.median

-- the data-parallel GPT step, timed with the feature off and on step by step after the warmup
local b = U.dp_ab_bench("bench/comm_check", arg, function(on) dist.set_comm_check(on and true or false) end)
local o, rank, world, log, step = b.o, b.rank, b.world, b.log, b.step
local counts, ncoll, off, on = b.counts, b.ncoll, b.off, b.on
-- the check's own cost per collective: a tiny all_reduce with the check off and on
local function tiny(check)
  dist.set_comm_check(check)
  local t = engine.ones(1)
  dist.barrier()
  local t0 = engine.time()
  for _ = 1, 500 do dist.all_reduce(t) end
  return (engine.time() - t0) / 500 * 1e6
end
local us_off, us_on = {}, {}
for _ = 1, 3 do us_off[#us_off + 1] = tiny(false); us_on[#us_on + 1] = tiny(true) end
dist.set_comm_check(true)
local m_off, m_on = median(off), median(on)
log("collectives per step: %d (%s)", ncoll, (function()
  local r = {}
  for k, v in pairs(counts) do r[#r + 1] = k .. " " .. v end
  table.sort(r)
  return table.concat(r, ", ")
end)())
log("check off: %.1f ms/step (median of %d)", m_off, #off)
log("check on:  %.1f ms/step (median of %d)", m_on, #on)
log("overhead:  %+.2f%% (step medians, on vs off)", 100 * (m_on - m_off) / m_off)
local per = median(us_on) - median(us_off)
log("check cost per collective: %.1f us (all_reduce f32[1]: %.1f us off, %.1f us on); x %d collectives = %.2f ms " ..
  "= %.3f%% of the step", per, median(us_off), median(us_on), ncoll, per * ncoll / 1e3, 100 * per * ncoll / 1e3 / m_off)
