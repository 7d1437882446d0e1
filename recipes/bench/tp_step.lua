-- recipes/bench/tp_step.lua: tensor-parallel training step of the reference GPT on 2 ranks, against the
-- engine's single-process step and PyTorch's tensor parallelism (parallelize_module with PyTorch's styles).
--
--   mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader --mca pml ob1 \
--     -x MALLOC_MMAP_MAX_=0 -x MALLOC_TRIM_THRESHOLD_=1073741824 -np 2 build/engine recipes/bench/tp_step.lua \
--     [--steps=20] [--warmup=3] [--torch=1] [--python=tools/.venv/bin/python] [--single_threads=2]
--     [--local_attn=1] [--parts=single,tp,tpsp] [--n_layers=4] [--dim=256] [--n_heads=4] [--seq=128] [--batch=8] [--vocab=256]
--   make bench   (tools/bench.sh runs it on 2 ranks)
--
-- The model is common_dtensor.py's Transformer (models.Transformer: 4 layers, dim 256, 4 heads, seq 128, batch 8,
-- vocab 256, fp32, dropout 0, tied output weights), AdamW, one fixed random batch.  A step is forward + cross
-- entropy + backward + AdamW step + zero_grad.  Prints, in one run, median ms/step after `warmup` steps of:
--   (a) single: the unparallelized model on rank 0 alone with --single_threads threads (rank 1 sleeps in an
--       asynchronous barrier that it polls every 2 ms, so it leaves the cores to rank 0);
--   (b) TP: Transformer.parallelize(model, mesh, {local_output_for_attn = true}) on the 2 ranks, 1 thread per
--       rank (attention on the local heads, as PyTorch must run it on CPU: its DTensor has no sharding strategy
--       for the CPU SDPA op; --local_attn=0 times the engine's DTensor attention instead, without PyTorch);
--   (c) TP+SP: the same with use_seq_parallel = true;
-- each with its collectives per step (dist.count_collectives over the timed steps), the ratios TP/single and
-- TP+SP/single, and
--   (d) when `python` imports torch: tools/bench_tp_torch.py (PyTorch's single-process step with the same
--       thread count, then its TP and TP+SP steps on 2 processes over gloo with the plan of its own test
--       Transformer, common_dtensor.Transformer.parallelize), launched from rank 0 while rank 1 sleeps as in
--       (a); the engine/PyTorch ratios.
-- --parts picks which of (a), (b), (c) run (e.g. --parts=tpsp --torch=0 to profile one of them under perf).
-- Timings are rank 0's.  The machine has 2 cores: anything else running shows up in the figures, so the
-- ratios within one run are the figures to compare.  PyTorch: tools/install-torch.sh.
local ffi = require("ffi")
local engine = require("engine")
local nn, optim = engine.nn, engine.optim
local F = nn.functional
local dist = engine.distributed
local models = require("engine.models")
local U = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/util.lua")

local o = { parts = "single,tp,tpsp", steps = 20, warmup = 3, torch = 1, python = "tools/.venv/bin/python", single_threads = 2,
  local_attn = 1, n_layers = 4, dim = 256, n_heads = 4, seq = 128, batch = 8, vocab = 256 }
U.parse_args("bench/tp_step", o, arg)

local rank, W = dist.rank(), dist.world_size()
if W ~= 2 then
  error(string.format("bench/tp_step: run it on 2 ranks (mpirun -np 2 ...), got %d", W), 0)
end
local part = {}
for w in o.parts:gmatch("[^,]+") do part[w] = true end
local function say(...) if rank == 0 then print(string.format(...)) end end

local median, idle_barrier = U.median, U.idle_barrier
local function build_model() return U.build_model(o) end

-- the same fixed batch on every rank
local x, y = U.batch(o)
local tokens = o.batch * o.seq

-- Times warmup + steps training steps; returns median ms, min, max, collectives per timed step
-- ("kind=n ..." and the total), first and last loss.
local function time_steps(model, sync)
  local opt = optim.AdamW(model:parameters(), { lr = 3e-4, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0.1 })
  local times, losses = {}, {}
  local counts = {}
  for i = 1, o.warmup + o.steps do
    if sync then dist.barrier() end
    local t0 = engine.time()
    local c, loss = dist.count_collectives(function()
      local l = F.cross_entropy(model(x), y)
      l:backward()
      opt:step()
      opt:zero_grad()
      return l
    end)
    losses[#losses + 1] = loss:item()
    local dt = engine.time() - t0
    if i > o.warmup then
      times[#times + 1] = dt * 1e3
      for k, v in pairs(c) do counts[k] = (counts[k] or 0) + v end
    end
  end
  local total, kinds = U.count_summary(counts, o.steps)
  local med = median(times)
  table.sort(times)
  return { ms = med, min = times[1], max = times[#times], coll = total, coll_kinds = kinds, loss0 = losses[1],
    lossN = losses[#losses] }
end

local function report(label, r, threads)
  say("%-7s median %7.1f ms/step (min %.1f, max %.1f), %2d threads/rank, collectives/step %g (%s), loss %.4f -> %.4f",
    label, r.ms, r.min, r.max, threads, r.coll, r.coll_kinds, r.loss0, r.lossN)
end

say("bench/tp_step: engine %s, BLAS core %s, %d ranks, %d steps after %d warm-up, %d layers, dim %d, %d heads, "
  .. "seq %d, batch %d, vocab %d, %d tokens/step", engine.version, engine.blas_corename(), W, o.steps, o.warmup,
  o.n_layers, o.dim, o.n_heads, o.seq, o.batch, o.vocab, tokens)
say("load average at start: %s", U.loadavg())

-- ---------------------------------------------------------------- (a) single process on rank 0
local single
if rank == 0 and part.single then
  engine.set_num_threads(o.single_threads)
  local model = build_model()
  single = time_steps(model, false)
  report("single", single, engine.get_num_threads())
  say("        %d params", model:num_parameters())
  model = nil
  collectgarbage(); collectgarbage()
end
idle_barrier()
engine.set_num_threads(1)

-- ---------------------------------------------------------------- (b), (c) TP and TP+SP on 2 ranks
local mesh = dist.init_device_mesh("cpu", { W }, { "tp" })
local function tp_run(sp)
  local model = build_model()
  models.Transformer.parallelize(model, mesh, { use_seq_parallel = sp, local_output_for_attn = o.local_attn ~= 0 })
  local r = time_steps(model, false)
  model = nil
  collectgarbage(); collectgarbage()
  dist.barrier()
  return r
end
local none = { ms = 0 / 0, coll = 0 / 0 }
local tp, tpsp = none, none
if part.tp then tp = tp_run(false); report("TP", tp, engine.get_num_threads()) end
if part.tpsp then tpsp = tp_run(true); report("TP+SP", tpsp, engine.get_num_threads()) end
single = single or none
say("engine: TP/single %.2f (target <= 1.2), TP+SP/single %.2f", tp.ms / single.ms, tpsp.ms / single.ms)

-- ---------------------------------------------------------------- (d) PyTorch
local th = {}
if o.torch ~= 0 then
  if rank == 0 and o.local_attn == 0 then
    print("bench/tp_step: PyTorch skipped: --local_attn=0 does not run in PyTorch on CPU (no DTensor SDPA strategy)")
  elseif rank == 0 then
    local home = (ENGINE_HOME and ENGINE_HOME ~= "") and ENGINE_HOME or "."
    local found, py = U.python_with(o.python, "import torch")
    local has = found ~= nil
    if has then
      -- the MPI launcher's environment (OMPI_*, PMIX_*) must not leak into torch's processes
      local cmd = string.format(U.no_mpi_env .. " '%s' '%s/tools/bench_tp_torch.py' --steps=%d --warmup=%d --single_threads=%d --local_attn=%d "
        .. "--n_layers=%d --dim=%d --n_heads=%d --seq=%d --batch=%d --vocab=%d 2>&1",
        py, home, o.steps, o.warmup, o.single_threads, o.local_attn, o.n_layers, o.dim, o.n_heads, o.seq, o.batch,
        o.vocab)
      local p = io.popen(cmd)
      local out = p:read("*a")
      p:close()
      for line in out:gmatch("[^\n]+") do
        if not line:find("No CUDA runtime is found", 1, true) then print("  torch> " .. line) end
      end
      for _, k in ipairs({ "single", "tp", "tpsp" }) do
        local ms, c = out:match("torch_" .. k .. "_ms median=([%d%.]+)[^\n]- collectives=([%d%.]+)")
        th[k] = tonumber(ms)
        th[k .. "_coll"] = tonumber(c)
      end
      if not (th.single and th.tp and th.tpsp) then print("bench/tp_step: the PyTorch benchmark failed (output above)") end
    else
      print("bench/tp_step: " .. py .. " does not import torch (tools/install-torch.sh): PyTorch skipped")
    end
  end
  idle_barrier()
end

if rank == 0 then
  local function fmt(v, f2) return v and string.format(f2 or "%.1f", v) or "n/a" end
  local function ratio(a, b) return (a and b) and string.format("%.2f", a / b) or "n/a" end
  if th.tp then
    say("PyTorch: TP/single %s, TP+SP/single %s; engine/PyTorch: single %s, TP %s (target <= 0.6), "
      .. "TP+SP %s (target <= 0.5)", ratio(th.tp, th.single), ratio(th.tpsp, th.single), ratio(single.ms, th.single),
      ratio(tp.ms, th.tp), ratio(tpsp.ms, th.tpsp))
  end
  say("load average at end: %s", U.loadavg())
  say("summary: engine single %.1f | TP %.1f (%g coll) | TP+SP %.1f (%g coll) ms/step; TP/single %.2f "
    .. "TP+SP/single %.2f | PyTorch single %s | TP %s (%s coll) | TP+SP %s (%s coll) ms/step; "
    .. "engine/PyTorch TP %s TP+SP %s", single.ms, tp.ms, tp.coll, tpsp.ms, tpsp.coll, tp.ms / single.ms,
    tpsp.ms / single.ms, fmt(th.single), fmt(th.tp), fmt(th.tp_coll, "%g"), fmt(th.tpsp), fmt(th.tpsp_coll, "%g"),
    ratio(tp.ms, th.tp), ratio(tpsp.ms, th.tpsp))
end
