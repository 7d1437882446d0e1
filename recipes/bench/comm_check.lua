-- recipes/bench/comm_check.lua: cost of the always-on collective signature check on the training step.
--
--   mpirun -np 2 build/engine recipes/bench/comm_check.lua [--steps=8] [--rounds=3] [--warmup=2]
--       [--n_layers=4] [--dim=256] [--n_heads=4] [--seq=128] [--batch=8] [--threads=0]
--
-- Trains the reference GPT data-parallel with DTensors as recipes/dp_gpt.lua does (Replicate
-- parameters, batch Shard(1), cross_entropy mean over the sharded batch, gradients all_reduced by
-- AccumulateGrad, clip_grad_norm_, AdamW), on a fixed random batch, and times the step with the
-- signature check off and on in the same run: `rounds` rounds, each running `steps` steps with the
-- check off then `steps` with it on (interleaved, so drift of the machine hits both alike), after
-- `warmup` steps.  Prints the median ms/step of each mode, the overhead in percent, and the
-- collectives (and agreements) per step.  Rank 0 prints; every rank runs the same steps.
local engine = require("engine")
local nn, optim, dist = engine.nn, engine.optim, engine.distributed
local F = nn.functional

local o = { steps = 8, rounds = 3, warmup = 2, n_layers = 4, dim = 256, n_heads = 4, seq = 128, batch = 8,
  threads = 0 }
for _, a in ipairs(arg or {}) do
  local k, v = a:match("^%-%-([%w_]+)=(.*)$")
  if not k or o[k] == nil then error("bench/comm_check: bad argument '" .. a .. "'", 0) end
  o[k] = tonumber(v) or error("bench/comm_check: --" .. k .. " must be a number", 0)
end

local function median(t)
  local s = { unpack(t) }
  table.sort(s)
  local n = #s
  return n % 2 == 1 and s[(n + 1) / 2] or 0.5 * (s[n / 2] + s[n / 2 + 1])
end

dist.init()
local rank, world = dist.rank(), dist.world_size()
local function log(...) if rank == 0 then print(string.format(...)); io.stdout:flush() end end
if o.threads > 0 then engine.set_num_threads(o.threads) end
local mesh = dist.init_device_mesh("cpu", { world }, { "dp" })

engine.manual_seed(1337)
local model = nn.Transformer{ n_layers = o.n_layers, dim = o.dim, n_heads = o.n_heads, vocab_size = 256,
  max_seq_len = o.seq, dropout_p = 0 }
dist.replicate_parameters(model, mesh)
model:train()
local params = model:parameters()
local opt = optim.AdamW(params, { lr = 1e-4, betas = { 0.9, 0.95 }, weight_decay = 0.1 })

engine.manual_seed(100 + rank) -- this rank's rows of the global batch
local ids = (engine.rand(o.batch, o.seq + 1) * 256):floor():clamp(0, 255):long()
local x, y = ids:narrow(2, 1, o.seq):contiguous(), ids:narrow(2, 2, o.seq):contiguous()
local S = dist.Shard

local function step()
  local dx = dist.from_local(x, mesh, { S(1) })
  local dy = dist.from_local(y, mesh, { S(1) })
  local logits = dist.implicit_replication(function() return model(dx) end)
  local loss = F.cross_entropy(logits, dy)
  loss:backward()
  optim.clip_grad_norm_(params, 1.0)
  opt:step()
  opt:zero_grad()
  local l = loss:full_tensor():item()
  collectgarbage()
  return l
end

local function timed(check, n, out)
  dist.set_comm_check(check)
  for _ = 1, n do
    dist.barrier()
    local t0 = engine.time()
    step()
    out[#out + 1] = (engine.time() - t0) * 1e3
  end
end

log("bench/comm_check: %d rank(s), %d threads each, GPT %d layers dim %d seq %d, batch %d per rank",
  world, engine.get_num_threads(), o.n_layers, o.dim, o.seq, o.batch)
for _ = 1, o.warmup do step() end
local counts = dist.count_collectives(step)
local ncoll = 0
for _, v in pairs(counts) do ncoll = ncoll + v end
local off, on = {}, {}
for _ = 1, o.rounds do
  timed(false, o.steps, off)
  timed(true, o.steps, on)
end
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
log("overhead:  %+.2f%%", 100 * (m_on - m_off) / m_off)
