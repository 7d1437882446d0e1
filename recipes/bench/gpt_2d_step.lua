-- recipes/bench/gpt_2d_step.lua: the 2-D (FSDP over tensor parallelism) training step of the reference GPT on
-- 4 ranks (a 2x2 (dp, tp) mesh) beside FSDP alone and TP alone on the same 4 ranks, and beside PyTorch 2.x's 2-D
-- (fully_shard over parallelize_module, gloo, 4 processes; tools/bench_2d_torch.py).
--
--   mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader --mca pml ob1 \
--     -x MALLOC_MMAP_MAX_=0 -x MALLOC_TRIM_THRESHOLD_=1073741824 -np 4 build/engine recipes/bench/gpt_2d_step.lua \
--     [--runs=3] [--steps=20] [--warmup=3] [--parts=2d,fsdp,tp] [--torch=1] [--torch_parts=2d,fsdp,tp]
--     [--python=tools/.venv/bin/python] [--local_attn=1] [--sp=0] [--reshard_after_forward=1] [--threads=1]
--     [--n_layers=4] [--dim=256] [--n_heads=4] [--seq=128] [--batch=8] [--vocab=256]
--
-- The model is common_dtensor.py's Transformer (models.Transformer: 4 layers, dim 256, 4 heads, seq 128, vocab 256, fp32,
-- dropout 0, tied output weights), AdamW, one fixed random global batch of --batch rows.  A step is forward +
-- cross entropy + backward + AdamW step + zero_grad.  --threads threads per rank (default 1).  Parts:
--   2d:   Transformer.parallelize on mesh["tp"] of a (2, 2) (dp, tp) mesh ({use_seq_parallel = --sp,
--         local_output_for_attn = --local_attn}), then dist.fully_shard on each block and the root on mesh["dp"];
--         each dp row feeds its batch / 2 rows (the tp ranks of one row the same rows);
--   fsdp: dist.fully_shard on each block and the root on a 1-D mesh of the 4 ranks, each on its batch / 4 rows;
--   tp:   Transformer.parallelize on a 1-D tp mesh of the 4 ranks, every rank on the whole batch.
-- --local_attn=1 (default) runs attention on the local heads as PyTorch must on CPU (its DTensor has no sharding
-- strategy for the CPU SDPA op), so both sides run the same plan; 0 times the engine's DTensor attention.
-- Each of --runs runs times every part (interleaved: 2d, fsdp, tp, 2d, ...) for warmup + steps steps; a part's
-- figure is the median over runs of its median ms/step; the ratios 2D/FSDP and 2D/TP are taken within each run,
-- and their medians printed; beside the wall time, the CPU time of a step summed over the 4 ranks (all threads;
-- what the step costs the machine, less sensitive to other load than the wall time).  Then, when `python` imports torch.distributed.fsdp.fully_shard, rank 0 runs
-- tools/bench_2d_torch.py (PyTorch's 2-D, FSDP2 and TP on 4 gloo processes, 1 thread each, --runs runs the
-- same way) while ranks 1-3 sleep in an asynchronous barrier they poll every 2 ms; the engine/PyTorch ratios.
-- Timings are rank 0's.  The load average is printed at the start and the end: on a loaded machine compare the
-- ratios (taken within one run) rather than the absolute figures.  PyTorch: tools/install-torch.sh.
local ffi = require("ffi")
local engine = require("engine")
local nn, optim = engine.nn, engine.optim
local F = nn.functional
local dist = engine.distributed
local models = require("engine.models")
local U = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/util.lua")

local NAME = "bench/gpt_2d_step"
local o = { runs = 3, steps = 20, warmup = 3, parts = "2d,fsdp,tp", torch = 1, torch_parts = "2d,fsdp,tp",
  python = "tools/.venv/bin/python", local_attn = 1, sp = 0, reshard_after_forward = 1, threads = 1, n_layers = 4,
  dim = 256, n_heads = 4, seq = 128, batch = 8, vocab = 256 }
U.parse_args(NAME, o, arg)

local rank, W = dist.rank(), dist.world_size()
if W ~= 4 then error(string.format(NAME .. ": run it on 4 ranks (mpirun -np 4 ...), got %d", W), 0) end
local DP, TP = 2, 2
if o.batch % W ~= 0 then error(NAME .. ": --batch must be divisible by 4", 0) end
if o.sp ~= 0 and o.seq % TP ~= 0 then error(NAME .. ": --sp=1 needs --seq divisible by 2", 0) end
local part, order = {}, {}
for w in o.parts:gmatch("[^,]+") do
  if w ~= "2d" and w ~= "fsdp" and w ~= "tp" then error(NAME .. ": --parts: unknown part '" .. w .. "' (2d, fsdp, tp)", 0) end
  part[w] = true
  order[#order + 1] = w
end
local function say(...) if rank == 0 then print(string.format(...)); io.stdout:flush() end end
local loadavg, median, idle_barrier = U.loadavg, U.median, U.idle_barrier

-- this process's CPU time (all its threads): clock_gettime(CLOCK_PROCESS_CPUTIME_ID)
pcall(ffi.cdef, "typedef struct { long tv_sec; long tv_nsec; } gpt2d_timespec; int clock_gettime(int clk, gpt2d_timespec* ts);")
local ts_buf = ffi.new("gpt2d_timespec")
local function cpu_time()
  ffi.C.clock_gettime(2, ts_buf)
  return tonumber(ts_buf.tv_sec) + tonumber(ts_buf.tv_nsec) * 1e-9
end
local function build_model() return U.build_model(o) end

-- the same fixed global batch on every rank; each part takes its rows
local x, y = U.batch(o)
local function rows(t, i, n)
  local b = o.batch / n
  return t:narrow(1, i * b + 1, b):contiguous()
end

engine.set_num_threads(o.threads)
local mesh2 = dist.init_device_mesh("cpu", { DP, TP }, { "dp", "tp" })
local mesh1 = dist.init_device_mesh("cpu", { W }, { "world" })
local raf = o.reshard_after_forward ~= 0

-- builds the model of a part and its rows: returns model, x, y
local setup = {
  ["2d"] = function()
    local m = build_model()
    models.Transformer.parallelize(m, mesh2["tp"], { use_seq_parallel = o.sp ~= 0,
      local_output_for_attn = o.local_attn ~= 0 })
    for _, b in ipairs(m.layers:children()) do dist.fully_shard(b, { mesh = mesh2["dp"], reshard_after_forward = raf }) end
    dist.fully_shard(m, { mesh = mesh2["dp"], reshard_after_forward = raf })
    local dr = mesh2:get_local_rank("dp")
    return m, rows(x, dr, DP), rows(y, dr, DP)
  end,
  fsdp = function()
    local m = build_model()
    for _, b in ipairs(m.layers:children()) do dist.fully_shard(b, { mesh = mesh1, reshard_after_forward = raf }) end
    dist.fully_shard(m, { mesh = mesh1, reshard_after_forward = raf })
    return m, rows(x, rank, W), rows(y, rank, W)
  end,
  tp = function()
    local m = build_model()
    models.Transformer.parallelize(m, mesh1, { use_seq_parallel = o.sp ~= 0, local_output_for_attn = o.local_attn ~= 0 })
    return m, x, y
  end,
}

-- Times warmup + steps steps of one part; returns median ms, min, max, collectives per timed step, first and last
-- loss (rank 0's local mean).
local function time_part(name)
  local model, xl, yl = setup[name]()
  local opt = optim.AdamW(model:parameters(), { lr = 3e-4, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0.1 })
  dist.barrier()
  local times, losses, counts = {}, {}, {}
  local cpu0
  for i = 1, o.warmup + o.steps do
    if i == o.warmup + 1 then cpu0 = cpu_time() end
    local t0 = engine.time()
    local c, loss = dist.count_collectives(function()
      local l = F.cross_entropy(model(xl), yl)
      l:backward()
      opt:step()
      opt:zero_grad()
      return l:item()
    end)
    local dt = engine.time() - t0
    losses[#losses + 1] = loss
    if i > o.warmup then
      times[#times + 1] = dt * 1e3
      for k, v in pairs(c) do counts[k] = (counts[k] or 0) + v end
    end
  end
  -- CPU time of the timed steps summed over the ranks, per step (what the step costs the machine: on a loaded
  -- machine the wall time also holds the time the ranks wait for a core)
  local cpu = engine.tensor({ cpu_time() - cpu0 }, "f64")
  dist.all_reduce(cpu, "sum")
  local total, kinds = U.count_summary(counts, o.steps)
  local med = median(times)
  table.sort(times)
  model, opt = nil, nil
  collectgarbage(); collectgarbage()
  dist.barrier()
  return { ms = med, min = times[1], max = times[#times], coll = total, cpu_ms = cpu:item() * 1e3 / o.steps,
    coll_kinds = kinds, loss0 = losses[1], lossN = losses[#losses] }
end

local labels = { ["2d"] = "FSDP+TP", fsdp = "FSDP", tp = "TP" }
say("%s: engine %s, BLAS core %s, %d ranks, %d run(s) of %d steps after %d warm-up, %d layers, dim %d, %d heads, "
  .. "seq %d, vocab %d, global batch %d (2d: %d per dp row; fsdp: %d per rank; tp: %d), %d thread(s)/rank, "
  .. "local_output_for_attn=%s, sp=%s, reshard_after_forward=%s", NAME, engine.version, engine.blas_corename(), W,
  o.runs, o.steps, o.warmup, o.n_layers, o.dim, o.n_heads, o.seq, o.vocab, o.batch, o.batch / DP, o.batch / W,
  o.batch, engine.get_num_threads(), tostring(o.local_attn ~= 0), tostring(o.sp ~= 0), tostring(raf))
say("load average at start: %s", loadavg())

local per, per_cpu = {}, {}   -- per[part] = {ms of each run}, per_cpu[part] = {CPU ms of each run}
local ratio_fsdp, ratio_tp = {}, {}
for _, p in ipairs(order) do per[p], per_cpu[p] = {}, {} end
for r = 1, o.runs do
  local got = {}
  for _, p in ipairs(order) do
    local res = time_part(p)
    got[p] = res
    per[p][r], per_cpu[p][r] = res.ms, res.cpu_ms
    say("run %d %-8s median %7.1f ms/step (min %.1f, max %.1f), CPU %.1f ms/step (4 ranks), collectives/step %g (%s), "
      .. "loss %.4f -> %.4f", r, labels[p], res.ms, res.min, res.max, res.cpu_ms, res.coll, res.coll_kinds, res.loss0,
      res.lossN)
  end
  if got["2d"] and got.fsdp then ratio_fsdp[#ratio_fsdp + 1] = got["2d"].ms / got.fsdp.ms end
  if got["2d"] and got.tp then ratio_tp[#ratio_tp + 1] = got["2d"].ms / got.tp.ms end
  say("run %d: FSDP+TP/FSDP %.2f, FSDP+TP/TP %.2f (load average %s)", r, ratio_fsdp[r] or 0 / 0, ratio_tp[r] or 0 / 0,
    loadavg())
end
local eng, eng_cpu = {}, {}
for _, p in ipairs(order) do eng[p], eng_cpu[p] = median(per[p]), median(per_cpu[p]) end
say("engine (median of %d runs): FSDP+TP %.1f, FSDP %.1f, TP %.1f ms/step; FSDP+TP/FSDP %.2f, FSDP+TP/TP %.2f "
  .. "(medians of the per-run ratios)", o.runs, eng["2d"] or 0 / 0, eng.fsdp or 0 / 0, eng.tp or 0 / 0,
  median(ratio_fsdp), median(ratio_tp))
say("engine CPU time per step summed over the 4 ranks (median of %d runs): FSDP+TP %.1f, FSDP %.1f, TP %.1f ms", o.runs,
  eng_cpu["2d"] or 0 / 0, eng_cpu.fsdp or 0 / 0, eng_cpu.tp or 0 / 0)

-- ---------------------------------------------------------------- PyTorch
local th = {}
if o.torch ~= 0 then
  if rank == 0 then
    local home = (ENGINE_HOME and ENGINE_HOME ~= "") and ENGINE_HOME or "."
    local found, py = U.python_with(o.python, "from torch.distributed.fsdp import fully_shard")
    local has = found ~= nil
    if has then
      -- the MPI launcher's environment (OMPI_*, PMIX_*) must not leak into torch's processes
      local cmd = string.format(U.no_mpi_env .. " '%s' '%s/tools/bench_2d_torch.py' --runs=%d --steps=%d --warmup=%d --parts=%s --local_attn=%d --sp=%d "
        .. "--reshard_after_forward=%d --threads=%d --n_layers=%d --dim=%d --n_heads=%d --seq=%d --batch=%d "
        .. "--vocab=%d 2>&1", py, home, o.runs, o.steps, o.warmup, o.torch_parts, o.local_attn, o.sp,
        o.reshard_after_forward, o.threads, o.n_layers, o.dim, o.n_heads, o.seq, o.batch, o.vocab)
      local p = io.popen(cmd)
      local out = p:read("*a")
      p:close()
      for line in out:gmatch("[^\n]+") do
        if not line:find("No CUDA runtime is found", 1, true) then print("  torch> " .. line) end
      end
      for _, k in ipairs({ "2d", "fsdp", "tp" }) do
        th[k] = tonumber(out:match("torch_" .. k .. "_ms runs_median=([%d%.]+)"))
        th[k .. "_cpu"] = tonumber(out:match("torch_" .. k .. "_ms runs_median=[%d%.]+ cpu_runs_median=([%d%.]+)"))
      end
      if not th["2d"] then print(NAME .. ": the PyTorch benchmark failed (output above)") end
    else
      print(NAME .. ": " .. py .. " does not import torch.distributed.fsdp.fully_shard (tools/install-torch.sh puts "
        .. "PyTorch 2.x in tools/.venv): PyTorch skipped")
    end
  end
  idle_barrier()
end

if rank == 0 then
  local function fmt(v) return v and v == v and string.format("%.1f", v) or "n/a" end
  local function ratio(a, b) return (a and b and a == a and b == b) and string.format("%.2f", a / b) or "n/a" end
  if th["2d"] then
    say("engine/PyTorch: FSDP+TP %s (target <= 0.5), FSDP %s, TP %s; CPU time per step: FSDP+TP %s, FSDP %s, TP %s",
      ratio(eng["2d"], th["2d"]), ratio(eng.fsdp, th.fsdp), ratio(eng.tp, th.tp), ratio(eng_cpu["2d"], th["2d_cpu"]),
      ratio(eng_cpu.fsdp, th.fsdp_cpu), ratio(eng_cpu.tp, th.tp_cpu))
  end
  say("load average at end: %s", loadavg())
  say("summary: engine FSDP+TP %s | FSDP %s | TP %s ms/step (FSDP+TP/FSDP %.2f, FSDP+TP/TP %.2f) | PyTorch 2-D %s | "
    .. "FSDP2 %s | TP %s ms/step | engine/PyTorch 2-D %s (CPU time %s)", fmt(eng["2d"]), fmt(eng.fsdp), fmt(eng.tp),
    median(ratio_fsdp), median(ratio_tp), fmt(th["2d"]), fmt(th.fsdp), fmt(th.tp), ratio(eng["2d"], th["2d"]),
    ratio(eng_cpu["2d"], th["2d_cpu"]))
end
