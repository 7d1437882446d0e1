-- recipes/bench/fsdp_step.lua: fully sharded data parallel training step of the reference GPT on 2 ranks,
-- against the engine's single-process step, DTensor data parallelism and PyTorch's FSDP2 (
-- "Performance and memory").
--
--   mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader --mca pml ob1 \
--     -x MALLOC_MMAP_MAX_=0 -x MALLOC_TRIM_THRESHOLD_=1073741824 -np 2 build/engine recipes/bench/fsdp_step.lua \
--     [--steps=20] [--warmup=3] [--torch=1] [--python=tools/.venv/bin/python] [--single_threads=2]
--     [--parts=single,local,fsdp,dp] [--reshard_after_forward=1] [--n_layers=4] [--dim=256] [--n_heads=4] [--seq=128]
--     [--batch=8] [--vocab=256]
--
-- The model is common_dtensor.py's Transformer (models.Transformer: 4 layers, dim 256, 4 heads, seq 128, vocab 256, fp32,
-- dropout 0, tied output weights), AdamW, one fixed random global batch of --batch rows.  A step is forward +
-- cross entropy + backward + AdamW step + zero_grad.  Prints, in one run, median ms/step after `warmup` steps of:
--   (a) single: the unsharded model on the whole batch on rank 0 alone with --single_threads threads (rank 1
--       sleeps in an asynchronous barrier that it polls every 2 ms, so it leaves the cores to rank 0);
--   (a') local: the same unsharded model on one rank's rows (batch / 2) with 1 thread, rank 1 asleep: the compute
--       each FSDP or DP rank does, so FSDP - local is the time FSDP adds (communication, copies, waits);
--   (b) FSDP: dist.fully_shard on each block, then the root, 1 thread per rank, each rank on its batch / 2 rows
--       (loss the local mean; FSDP divides the gradients by 2);
--   (c) DP: DTensor data parallelism as recipes/dp_gpt.lua (dist.replicate_parameters, the batch from_local
--       Shard(1), forward under dist.implicit_replication, gradients all-reduced by autograd), 1 thread per rank;
-- each with its collectives per step; the ratios FSDP/single and DP/single; for FSDP each rank's peak tensor
-- memory over the timed steps against the ZeRO-3 figure (16 bytes x params / N for the sharded f32 parameters,
-- gradients and AdamW states + one unsharded group (the largest group's f32 parameters) + activations (the peak
-- of one forward of the unsharded model on the local rows, over what was allocated before it)); where the FSDP
-- step's time goes (from the collectives' flight recorder: the time from issue to completion of the
-- all-gathers and reduce-scatters of one step, summed per kind, and the time a rank spends blocked in their
-- waits); and
--   (d) when `python` imports torch: tools/bench_fsdp_torch.py (PyTorch's single-process step with the same
--       thread count, then its FSDP2 and DDP steps on 2 processes over gloo), launched from rank 0 while rank 1
--       sleeps as in (a); the engine/PyTorch ratios.
-- Timings are rank 0's.  The machine has 2 cores: anything else running shows up in the figures, so the
-- ratios within one run are the figures to compare.  PyTorch: tools/install-torch.sh.
local ffi = require("ffi")
local engine = require("engine")
local nn, optim = engine.nn, engine.optim
local F = nn.functional
local dist = engine.distributed
local models = require("engine.models")
local C = require("engine.core").C
local U = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/util.lua")

local o = { parts = "single,local,fsdp,dp", steps = 20, warmup = 3, torch = 1, python = "tools/.venv/bin/python",
  single_threads = 2, reshard_after_forward = 1, n_layers = 4, dim = 256, n_heads = 4, seq = 128, batch = 8, vocab = 256 }
U.parse_args("bench/fsdp_step", o, arg)

local rank, W = dist.rank(), dist.world_size()
if W ~= 2 then
  error(string.format("bench/fsdp_step: run it on 2 ranks (mpirun -np 2 ...), got %d", W), 0)
end
if o.batch % W ~= 0 then error("bench/fsdp_step: --batch must be divisible by 2", 0) end
local part = {}
for w in o.parts:gmatch("[^,]+") do part[w] = true end
local function say(...) if rank == 0 then print(string.format(...)); io.stdout:flush() end end
local MiB = 2 ^ 20

local median, idle_barrier = U.median, U.idle_barrier
local function build_model() return U.build_model(o) end

-- the same fixed global batch on every rank; each rank's rows for FSDP and DP
local x, y, seq = U.batch(o)   -- (seq: the tokens, kept as before: the memory figures count them)
local lb = o.batch / W
local xl = x:narrow(1, rank * lb + 1, lb):contiguous()
local yl = y:narrow(1, rank * lb + 1, lb):contiguous()

-- Times warmup + steps training steps of step_fn(opt) -> loss (a number); returns median ms, min, max,
-- collectives per timed step ("kind=n ..." and the total), first and last loss, peak tensor memory over the
-- timed steps.
local function time_steps(model, step_fn)
  local opt = optim.AdamW(model:parameters(), { lr = 3e-4, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0.1 })
  local times, losses = {}, {}
  local counts = {}
  for i = 1, o.warmup + o.steps do
    if i == o.warmup + 1 then engine.reset_peak_memory() end
    local t0 = engine.time()
    local c, loss = dist.count_collectives(function() return step_fn(opt) end)
    losses[#losses + 1] = loss
    local dt = engine.time() - t0
    if i > o.warmup then
      times[#times + 1] = dt * 1e3
      for k, v in pairs(c) do counts[k] = (counts[k] or 0) + v end
    end
  end
  local peak = engine.memory_stats().peak_allocated
  collectgarbage(); collectgarbage()
  local between = engine.memory_stats().allocated   -- what stays allocated between steps
  local total, kinds = U.count_summary(counts, o.steps)
  local med = median(times)
  table.sort(times)
  return { ms = med, min = times[1], max = times[#times], coll = total, opt = opt, peak = peak, between = between,
    coll_kinds = kinds, loss0 = losses[1], lossN = losses[#losses] }
end

local function report(label, r, threads)
  say("%-7s median %7.1f ms/step (min %.1f, max %.1f), %2d threads/rank, collectives/step %g (%s), loss %.4f -> %.4f",
    label, r.ms, r.min, r.max, threads, r.coll, r.coll_kinds, r.loss0, r.lossN)
end

-- this rank's value of x on every rank
local function per_rank(v)
  local t = {}
  for r = 1, W do t[r] = 0 end
  t[rank + 1] = v
  local tt = engine.tensor(t, "f64")
  dist.all_reduce(tt, "sum")
  return tt:totable()
end

say("bench/fsdp_step: engine %s, BLAS core %s, %d ranks, %d steps after %d warm-up, %d layers, dim %d, %d heads, "
  .. "seq %d, global batch %d (%d per rank), vocab %d, reshard_after_forward=%s", engine.version, engine.blas_corename(),
  W, o.steps, o.warmup, o.n_layers, o.dim, o.n_heads, o.seq, o.batch, lb, o.vocab, tostring(o.reshard_after_forward ~= 0))
say("load average at start: %s", U.loadavg())

local n_params, act_bytes, group_max, local_ms = 0, 0, 0, 0 / 0
-- ---------------------------------------------------------------- (a) single process on rank 0
local single
if rank == 0 then
  engine.set_num_threads(o.single_threads)
  local model = build_model()
  n_params = model:num_parameters()
  if part.single then
    single = time_steps(model, function(opt)
      local l = F.cross_entropy(model(x), y)
      l:backward()
      opt:step()
      opt:zero_grad()
      return l:item()
    end)
    report("single", single, engine.get_num_threads())
    single.opt = nil
  end
  if part["local"] then
    engine.set_num_threads(1)
    local r = time_steps(model, function(opt)
      local l = F.cross_entropy(model(xl), yl)
      l:backward()
      opt:step()
      opt:zero_grad()
      return l:item()
    end)
    r.opt = nil
    report("local", r, engine.get_num_threads())
    say("        (one rank's compute: the unsharded model on its %d rows, 1 thread)", lb)
    local_ms = r.ms
    engine.set_num_threads(o.single_threads)
  end
  -- activations of the local rows: one forward of the unsharded model (what backward keeps), peak over before
  for _, p in ipairs(model:parameters()) do p.grad = nil end
  collectgarbage(); collectgarbage()
  local before = engine.memory_stats().allocated
  engine.reset_peak_memory()
  local l = F.cross_entropy(model(xl), yl)
  act_bytes = engine.memory_stats().peak_allocated - before
  l = nil
  -- the largest FSDP group: a block (the root group holds the embeddings, tied output and final norm)
  for _, b in ipairs(model.layers:children()) do group_max = math.max(group_max, b:num_parameters()) end
  local root = n_params
  for _, b in ipairs(model.layers:children()) do root = root - b:num_parameters() end
  group_max = math.max(group_max, root)
  model = nil
  collectgarbage(); collectgarbage()
end
idle_barrier()
engine.set_num_threads(1)
local shared = per_rank(rank == 0 and n_params or 0)
n_params = shared[1]

-- ---------------------------------------------------------------- (b) FSDP on 2 ranks
local mesh = dist.init_device_mesh("cpu", { W }, { "dp" })
local none = { ms = 0 / 0, coll = 0 / 0, coll_kinds = "none" }
local fsdp, dp = none, none

-- where the time of one FSDP step goes: the flight recorder's collectives of that step (issue -> completion)
local function breakdown(model, opt)
  local t0 = engine.time()
  local l = F.cross_entropy(model(xl), yl)
  l:backward()
  local t_bwd = engine.time()
  opt:step()
  local t_opt = engine.time()
  opt:zero_grad()
  local t1 = engine.time()
  local tw = t1 - t0
  local sums, n = {}, {}
  local len = C.eng_comm_history_len()
  local rec = ffi.new("eng_coll_record")
  for i = 0, len - 1 do
    C.eng_comm_history_get(i, rec)
    if rec.t_start >= t0 and rec.t_end <= t1 and rec.t_end > 0 then
      local k = tonumber(rec.kind)
      sums[k] = (sums[k] or 0) + (rec.t_end - rec.t_start)
      n[k] = (n[k] or 0) + 1
    end
  end
  return { total = tw, fwd_bwd = t_bwd - t0, opt = t_opt - t_bwd, zero = t1 - t_opt, sums = sums, n = n }
end

if part.fsdp then
  local model = build_model()
  local raf = o.reshard_after_forward ~= 0
  local blocks = model.layers:children()
  for _, b in ipairs(blocks) do dist.fully_shard(b, { mesh = mesh, reshard_after_forward = raf }) end
  dist.fully_shard(model, { mesh = mesh, reshard_after_forward = raf })
  dist.barrier()
  fsdp = time_steps(model, function(opt)
    local l = F.cross_entropy(model(xl), yl)
    l:backward()
    opt:step()
    opt:zero_grad()
    return l:item()   -- rank 0's local mean
  end)
  report("FSDP", fsdp, engine.get_num_threads())
  -- memory: each rank's peak against the ZeRO-3 figure.  Tensors freed by the Lua collector count until it
  -- runs (paced by the allocator: engine.set_gc_threshold), so the timed steps' peak includes the previous
  -- steps' garbage; the live peak is over 3 more steps with a full collection before each.
  local live = 0
  for _ = 1, 3 do
    collectgarbage(); collectgarbage()
    engine.reset_peak_memory()
    local l = F.cross_entropy(model(xl), yl)
    l:backward()
    fsdp.opt:step()
    fsdp.opt:zero_grad()
    l = nil
    live = math.max(live, engine.memory_stats().peak_allocated)
  end
  local peaks = per_rank(live)
  local paced = per_rank(fsdp.peak)
  local sh = { 0, 0, 0 }
  for _, p in ipairs(model:parameters()) do
    local lp = p:to_local()
    sh[1] = sh[1] + lp:numel() * 4
    local st = fsdp.opt.state[p]
    if st then sh[3] = sh[3] + st.exp_avg:to_local():numel() * 4 + st.exp_avg_sq:to_local():numel() * 4 end
  end
  local acts = per_rank(rank == 0 and act_bytes or 0)[1]
  local gmax = per_rank(rank == 0 and group_max or 0)[1]
  local zero3 = 16 * n_params / W + 4 * gmax + acts
  local shards = per_rank(2 * sh[1] + sh[3])
  for r = 1, W do
    say("FSDP    rank %d live peak %.2f MiB (timed steps, garbage included: %.2f) vs ZeRO-3 figure %.2f MiB = 16 B x %d params / %d (%.2f) + one unsharded group "
      .. "(%.2f: %d params f32) + activations (%.2f): %.2fx (target <= 1.1); local shards now (params + grads + "
      .. "AdamW) %.2f MiB", r - 1, peaks[r] / MiB, paced[r] / MiB, zero3 / MiB, n_params, W, 16 * n_params / W / MiB, 4 * gmax / MiB,
      gmax, acts / MiB, peaks[r] / zero3, shards[r] / MiB)
  end
  fsdp.mem_ratio = math.max(peaks[1], peaks[2]) / zero3
  local between = per_rank(fsdp.between)
  say("FSDP    allocated between steps (after zero_grad and a collection): rank 0 %.2f MiB, rank 1 %.2f MiB; the "
    .. "sharded parameters and AdamW states are %.2f MiB (12 B x params / %d); the rest stays from elsewhere",
    between[1] / MiB, between[2] / MiB, 12 * n_params / W / MiB, W)
  -- time breakdown over 3 more steps (the median one's)
  local bks = {}
  for i = 1, 3 do bks[i] = breakdown(model, fsdp.opt) end
  table.sort(bks, function(a, b) return a.total < b.total end)
  local b = bks[2]
  local kind_names = dist.collective_kinds
  local parts_ = {}
  for k, s in pairs(b.sums) do
    parts_[#parts_ + 1] = string.format("%s: %d in %.1f ms", kind_names[k + 1] or ("kind " .. k), b.n[k], s * 1e3)
  end
  table.sort(parts_)
  say("FSDP    one step %.1f ms: forward+backward %.1f, AdamW %.1f, zero_grad %.1f; collectives issue->completion "
    .. "(async ones overlap compute): %s", b.total * 1e3, b.fwd_bwd * 1e3, b.opt * 1e3, b.zero * 1e3,
    #parts_ > 0 and table.concat(parts_, ", ") or "none recorded")
  model = nil
  collectgarbage(); collectgarbage()
  dist.barrier()
end

-- ---------------------------------------------------------------- (c) DTensor data parallelism
if part.dp then
  local model = build_model()
  dist.replicate_parameters(model, mesh)
  local S = dist.Shard
  local dx = dist.from_local(xl, mesh, { S(1) })
  local dy = dist.from_local(yl, mesh, { S(1) })
  dist.barrier()
  dp = time_steps(model, function(opt)
    local logits = dist.implicit_replication(function() return model(dx) end)
    local l = F.cross_entropy(logits, dy)
    l:backward()
    opt:step()
    opt:zero_grad()
    return l:to_local():item() * W   -- (Partial: local sum / global count) rank 0's local mean, as FSDP's
  end)
  report("DP", dp, engine.get_num_threads())
  model = nil
  collectgarbage(); collectgarbage()
  dist.barrier()
end
single = single or none
say("engine: FSDP/single %.2f (target <= 1.1), DP/single %.2f, FSDP/DP %.2f; FSDP - local compute %.1f ms, DP - local "
  .. "compute %.1f ms", fsdp.ms / single.ms, dp.ms / single.ms, fsdp.ms / dp.ms, fsdp.ms - local_ms, dp.ms - local_ms)

-- ---------------------------------------------------------------- (d) PyTorch
local th = {}
if o.torch ~= 0 then
  if rank == 0 then
    local home = (ENGINE_HOME and ENGINE_HOME ~= "") and ENGINE_HOME or "."
    local found, py = U.python_with(o.python, "from torch.distributed.fsdp import fully_shard")
    local has = found ~= nil
    if has then
      -- the MPI launcher's environment (OMPI_*, PMIX_*) must not leak into torch's processes
      local cmd = string.format(U.no_mpi_env .. " '%s' '%s/tools/bench_fsdp_torch.py' --steps=%d --warmup=%d "
        .. "--single_threads=%d --reshard_after_forward=%d "
        .. "--n_layers=%d --dim=%d --n_heads=%d --seq=%d --batch=%d --vocab=%d 2>&1",
        py, home, o.steps, o.warmup, o.single_threads, o.reshard_after_forward, o.n_layers, o.dim, o.n_heads, o.seq,
        o.batch, o.vocab)
      local p = io.popen(cmd)
      local out = p:read("*a")
      p:close()
      for line in out:gmatch("[^\n]+") do
        if line:match("^torch") then print("  torch> " .. line) end
      end
      for _, k in ipairs({ "single", "fsdp", "ddp" }) do
        local ms, c = out:match("torch_" .. k .. "_ms median=([%d%.]+)[^\n]- collectives=([%d%.]+)")
        th[k] = tonumber(ms)
        th[k .. "_coll"] = tonumber(c)
      end
      if not (th.single and th.fsdp) then print("bench/fsdp_step: the PyTorch benchmark failed:\n" .. out) end
    else
      print("bench/fsdp_step: " .. py .. " does not import torch.distributed.fsdp.fully_shard (tools/install-torch.sh "
        .. "puts PyTorch 2.x in tools/.venv; then run tools/.venv/bin/python tools/bench_fsdp_torch.py): PyTorch skipped")
    end
  end
  idle_barrier()
end

if rank == 0 then
  local function fmt(v, f2) return v and string.format(f2 or "%.1f", v) or "n/a" end
  local function ratio(a, b) return (a and b) and string.format("%.2f", a / b) or "n/a" end
  if th.fsdp then
    say("PyTorch: FSDP2/single %s, DDP/single %s; engine/PyTorch: single %s, FSDP %s (target <= 0.5, issue 24)",
      ratio(th.fsdp, th.single), ratio(th.ddp, th.single), ratio(single.ms, th.single), ratio(fsdp.ms, th.fsdp))
  end
  say("load average at end: %s", U.loadavg())
  say("summary: engine single %.1f | FSDP %.1f (%g coll) | DP %.1f (%g coll) ms/step; FSDP/single %.2f DP/single %.2f "
    .. "| FSDP peak/ZeRO-3 %.2f | PyTorch single %s | FSDP2 %s (%s coll) | DDP %s ms/step; engine/PyTorch FSDP %s",
    single.ms, fsdp.ms, fsdp.coll, dp.ms, dp.coll, fsdp.ms / single.ms, dp.ms / single.ms, fsdp.mem_ratio or 0 / 0,
    fmt(th.single), fmt(th.fsdp), fmt(th.fsdp_coll, "%g"), fmt(th.ddp), ratio(fsdp.ms, th.fsdp))
end
