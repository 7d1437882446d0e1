-- recipes/bench/ddp_step.lua: data-parallel training step of the reference GPT with DistributedDataParallel's
-- bucketed all_reduce during backward, against the one-process step at the same per-rank batch and against one
-- blocking all_reduce per parameter after backward (the engine's data parallelism before DDP).
--
--   mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader --mca pml ob1 \
--     -x MALLOC_MMAP_MAX_=0 -x MALLOC_TRIM_THRESHOLD_=1073741824 -np 2 build/engine recipes/bench/ddp_step.lua \
--     [--steps=20] [--warmup=3] [--rounds=3] [--bucket_cap_mb=0] [--n_layers=4] [--dim=256] [--n_heads=4] [--seq=128]
--     [--batch=4] [--vocab=256] [--device=cpu|cuda] [--grad_view=1] [--comm_hook=none|fp16|bf16]
--
-- Model: common_dtensor.py's Transformer (4 layers, dim 256, 4 heads, seq 128, vocab 256, fp32, dropout 0, tied output),
-- AdamW; --batch rows per rank.  A step is forward + cross entropy + backward + AdamW step + zero_grad, 1 thread
-- per rank.  In one run, --rounds times alternating (medians of each round's median, ms/step, rank 0's clock):
--   (a) local: one process (rank 0) on its --batch rows while the other ranks sleep in an asynchronous barrier;
--   (b) ddp: every rank on its --batch rows, dist.DistributedDataParallel with --bucket_cap_mb (0: not given, PyTorch's
--       default: 25 MiB buckets after a first one of 1 MiB; the buckets are rebuilt after the first step) (and, with
--       --grad_view=1, gradient_as_bucket_view: the gradients are the buckets' slices, no copy out of them; with
--       --comm_hook=fp16|bf16, PyTorch's compress hook: each bucket averaged in half precision);
--   (c) per_param: every rank on its rows, one blocking all_reduce (avg) per parameter after backward;
--   (d) both_local: every rank on its rows at the same time, no communication at all (each rank's own model): the
--       compute of a DDP rank under the same load as (b), so ddp/both_local is what communication adds.
-- Then the collectives and bytes per step of (b) and (c) and the ratios ddp/local and per_param/local (target of
-- target: ddp <= 1.05x local at 2 ranks on the CPU), and the bound collectives <= ceil(bytes / bucket) + 1.
-- The machine has 2 cores: the ratios within one run are the figures to compare.
local engine = require("engine")
local optim = engine.optim
local F = engine.nn.functional
local dist = engine.distributed
local U = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/util.lua")

local o = { steps = 20, warmup = 3, rounds = 3, bucket_cap_mb = 0, n_layers = 4, dim = 256, n_heads = 4, seq = 128,
  batch = 4, vocab = 256, device = "cpu", grad_view = 1, comm_hook = "none" }
U.parse_args("bench/ddp_step", o, arg)
local HOOKS = { fp16 = "fp16_compress_hook", bf16 = "bf16_compress_hook" }
if o.comm_hook ~= "none" and not HOOKS[o.comm_hook] then error("bench/ddp_step: --comm_hook must be none, fp16 or bf16", 0) end
if o.device ~= "cpu" and o.device ~= "cuda" then error("bench/ddp_step: --device must be cpu or cuda", 0) end

local rank, W = dist.rank(), dist.world_size()
local function say(...) if rank == 0 then print(string.format(...)); io.stdout:flush() end end
engine.set_num_threads(1)

-- every rank's rows: the global batch is batch x W
local gopt = {}
for k, v in pairs(o) do gopt[k] = v end
gopt.batch = o.batch * W
local x, y = U.batch(gopt, rank, W)
if o.device == "cuda" then x, y = x:cuda(), y:cuda() end
local function sync() if o.device == "cuda" then engine.cuda.synchronize() end end

local function run(model, fwd, after_backward, steps)
  local opt = optim.AdamW(model:parameters(), { lr = 3e-4, weight_decay = 0.1 })
  local times, counts = {}, {}
  for i = 1, o.warmup + steps do
    sync()
    local t0 = engine.time()
    local c = dist.count_collectives(function()
      local l = F.cross_entropy(fwd(x):reshape(-1, o.vocab), y:reshape(-1))
      l:backward()
      if after_backward then after_backward() end
      opt:step()
      opt:zero_grad()
    end)
    sync()
    if i > o.warmup then
      times[#times + 1] = (engine.time() - t0) * 1e3
      for k, v in pairs(c) do counts[k] = (counts[k] or 0) + v end
    end
  end
  return U.median(times), counts
end

local function build()
  local m = U.build_model(o)
  if o.device == "cuda" then m:to("cuda") end
  return m
end

say("bench/ddp_step: engine %s, BLAS core %s, %d ranks, device %s, %d steps after %d warm-up x %d rounds, %d layers, "
  .. "dim %d, %d heads, seq %d, batch %d per rank, vocab %d, bucket %s, gradient_as_bucket_view %s, comm hook %s", engine.version,
  engine.blas_corename(), W, o.device, o.steps, o.warmup, o.rounds, o.n_layers, o.dim, o.n_heads, o.seq, o.batch, o.vocab,
  o.bucket_cap_mb > 0 and (o.bucket_cap_mb .. " MiB") or "PyTorch's default (1 MiB first, 25 MiB)", tostring(o.grad_view == 1),
  o.comm_hook)
say("load average at start: %s", U.loadavg())

local res = { ["local"] = {}, ddp = {}, per_param = {}, both_local = {} }
local counts = {}
local stats
for round = 1, o.rounds do
  -- (a) one process on its rows
  if rank == 0 then
    local m = build()
    res["local"][round] = run(m, function(t) return m(t) end, nil, o.steps)
  end
  U.idle_barrier()
  -- (b) DistributedDataParallel
  do
    local net = build()
    local ddp = dist.DistributedDataParallel(net, { bucket_cap_mb = o.bucket_cap_mb > 0 and o.bucket_cap_mb or nil,
      gradient_as_bucket_view = o.grad_view == 1 })
    if HOOKS[o.comm_hook] then ddp:register_comm_hook(nil, dist.algorithms.ddp_comm_hooks.default_hooks[HOOKS[o.comm_hook]]) end
    res.ddp[round], counts.ddp = run(ddp, function(t) return ddp(t) end, nil, o.steps)
    stats = ddp:comm_stats()
  end
  -- (c) one blocking all_reduce per parameter after backward
  do
    local m = build()
    local params = m:parameters()
    res.per_param[round], counts.per_param = run(m, function(t) return m(t) end, function()
      for _, p in ipairs(params) do dist.all_reduce(p.grad, "avg") end
    end, o.steps)
  end
  -- (d) every rank alone at the same time
  do
    local m = build()
    res.both_local[round] = run(m, function(t) return m(t) end, nil, o.steps)
  end
  say("round %d: local %.1f ms, ddp %.1f ms, per_param %.1f ms, both_local %.1f ms", round,
    res["local"][round] or 0 / 0, res.ddp[round], res.per_param[round], res.both_local[round])
end

if rank == 0 then
  local l, d, p, b = U.median(res["local"]), U.median(res.ddp), U.median(res.per_param), U.median(res.both_local)
  local _, dk = U.count_summary(counts.ddp, o.steps)
  local _, pk = U.count_summary(counts.per_param, o.steps)
  local bound = math.ceil(stats.bytes / ((o.bucket_cap_mb > 0 and o.bucket_cap_mb or 25) * 1048576)) + 1
  say("local     median %7.1f ms/step (one process, batch %d, 1 thread)", l, o.batch)
  say("ddp       median %7.1f ms/step, collectives/step %s, %.2f MiB all-reduced/step in %d bucket(s) (bound %d)", d, dk,
    stats.bytes / 1048576, stats.buckets, bound)
  say("per_param median %7.1f ms/step, collectives/step %s", p, pk)
  say("both_local median %6.1f ms/step (every rank alone at once: the compute under the same load)", b)
  say("ddp_step: ddp/local %.3f (target <= 1.05), ddp/both_local %.3f, per_param/local %.3f, ddp/per_param %.3f, "
    .. "collectives %d <= %d: %s", d / l, d / b, p / l, d / p, stats.collectives, bound,
    stats.collectives <= bound and "yes" or "no")
end
