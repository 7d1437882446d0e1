-- recipes/bench/fsdp_memory.lua: per-rank peak tensor memory of FSDP training of the reference GPT (4 layers,
-- dim 256, 4 heads, seq 128, vocab 256, fp32, AdamW; each block and the root fully sharded) at 1, 2 and 4 ranks
-- with the global batch fixed (8 rows: 8/N per rank), against the ZeRO-3 figure at each N: 16 bytes x params / N
-- (sharded f32 parameters, gradients and AdamW states) + one unsharded group (the largest group's f32
-- parameters) + activations (the peak of one forward of the unsharded model on the rank's rows, over what was
-- allocated before it).  The peak is the caching allocator's (engine.memory_stats().peak_allocated, as
-- recipes/bench/gc_memory.lua): the live peak, with a full collection of the Lua collector before each of --steps
-- steps (after --warmup steps), and beside it the peak of the steps with the engine's own collections alone
-- (allocator-paced, and one before each backward: docs/design.md "Allocator").
--
--   build/engine recipes/bench/fsdp_memory.lua [--ranks=1,2,4] [--steps=5] [--warmup=2] [--batch=8] ...
--       starts `mpirun -np N` of itself for each N and prints the table
--   mpirun ... -np N build/engine recipes/bench/fsdp_memory.lua --worker=1     # one N only
local engine = require("engine")
local nn, optim = engine.nn, engine.optim
local F = nn.functional
local models = require("engine.models")
local U = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/util.lua")

local o = { ranks = "1,2,4", steps = 5, warmup = 2, worker = 0, reshard_after_forward = 1, n_layers = 4, dim = 256,
  n_heads = 4, seq = 128, batch = 8, vocab = 256 }
local argv = {}
U.parse_args("bench/fsdp_memory", o, arg, function(k, _, a) if k ~= "worker" then argv[#argv + 1] = a end end)
local MiB = 2 ^ 20

if o.worker == 0 then
  -- the driver: one mpirun job per rank count, each printing "fsdp_memory N=..." lines
  if os.getenv("OMPI_COMM_WORLD_SIZE") then
    error("bench/fsdp_memory: run the driver without mpirun (it starts mpirun itself), or pass --worker=1", 0)
  end
  local f = assert(io.open("/proc/self/stat", "r"))
  local pid = f:read("*l"):match("^(%d+)")
  f:close()
  local q = assert(io.popen("readlink /proc/" .. pid .. "/exe"))
  local exe = q:read("*l")
  q:close()
  local script = arg and arg[0] or "recipes/bench/fsdp_memory.lua"
  print(string.format("bench/fsdp_memory: %d layers, dim %d, %d heads, seq %d, vocab %d, global batch %d, AdamW, "
    .. "blocks + root fully sharded, reshard_after_forward=%s; peak over %d steps after %d", o.n_layers, o.dim,
    o.n_heads, o.seq, o.vocab, o.batch, tostring(o.reshard_after_forward ~= 0), o.steps, o.warmup))
  local rows = {}
  for n in o.ranks:gmatch("%d+") do
    -- (the engine started MPI as a singleton: its OMPI_*/PMIX_* environment must not reach mpirun)
    local cmd = string.format(U.no_mpi_env .. " mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader "
      .. "--mca pml ob1 -x MALLOC_MMAP_MAX_=0 -x MALLOC_TRIM_THRESHOLD_=1073741824 -np %s '%s' '%s' --worker=1 %s 2>&1",
      n, exe, script, table.concat(argv, " "))
    local p = io.popen(cmd)
    local out = p:read("*a")
    p:close()
    local got = false
    for line in out:gmatch("[^\n]+") do
      if line:match("^fsdp_memory N=") then
        print("  " .. line)
        got = true
        local peak, z = line:match("max peak ([%d.]+) MiB, ZeRO%-3 figure ([%d.]+) MiB")
        if peak then rows[#rows + 1] = { n = tonumber(n), peak = tonumber(peak), zero3 = tonumber(z) } end
      end
    end
    if not got then print("bench/fsdp_memory: the " .. n .. "-rank run failed:\n" .. out) end
  end
  local falls = true
  for i = 2, #rows do if rows[i].peak >= rows[i - 1].peak then falls = false end end
  local parts = {}
  for _, r in ipairs(rows) do
    parts[#parts + 1] = string.format("N=%d %.1f MiB (%.2fx ZeRO-3)", r.n, r.peak, r.peak / r.zero3)
  end
  print(string.format("summary: per-rank peak %s; falls with N: %s", table.concat(parts, " | "),
    falls and "yes" or "no"))
  return
end

-- ---------------------------------------------------------------- a worker (under mpirun -np N)
local dist = engine.distributed
local rank, W = dist.rank(), dist.world_size()
if o.batch % W ~= 0 then error(string.format("bench/fsdp_memory: --batch=%d is not divisible by %d ranks", o.batch, W), 0) end
engine.set_num_threads(1)
local lb = o.batch / W
local x, y = U.batch(o, rank, W)

engine.manual_seed(0)
local model = models.Transformer{ n_layers = o.n_layers, dim = o.dim, n_heads = o.n_heads, vocab_size = o.vocab,
  max_seq_len = o.seq, dropout_p = 0 }
model:train()
local n_params = model:num_parameters()
local gmax, root = 0, n_params
for _, b in ipairs(model.layers:children()) do
  gmax = math.max(gmax, b:num_parameters())
  root = root - b:num_parameters()
end
gmax = math.max(gmax, root)
-- activations of this rank's rows on the unsharded model
collectgarbage(); collectgarbage()
local before = engine.memory_stats().allocated
engine.reset_peak_memory()
do
  local l = F.cross_entropy(model(x), y)
  l = nil
end
local acts = engine.memory_stats().peak_allocated - before
collectgarbage(); collectgarbage()

local mesh = dist.init_device_mesh("cpu", { W })
local raf = o.reshard_after_forward ~= 0
for _, b in ipairs(model.layers:children()) do dist.fully_shard(b, { mesh = mesh, reshard_after_forward = raf }) end
dist.fully_shard(model, { mesh = mesh, reshard_after_forward = raf })
collectgarbage(); collectgarbage()   -- the unsharded originals go
local opt = optim.AdamW(model:parameters(), { lr = 3e-4, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0.1 })
-- the live peak: a full collection before each step and between its forward and backward (tensors the Lua
-- collector has not freed yet count otherwise: the forward's intermediate tensors stay referenced by their
-- garbage Lua wrappers through the whole backward, where PyTorch's reference counting frees each saved tensor
-- as its node runs; the paced peak, with the allocator-driven collector alone, is printed beside)
local peak, paced = 0, 0
for i = 1, o.warmup + o.steps do
  if i == o.warmup + 1 then engine.reset_peak_memory() end
  local l = F.cross_entropy(model(x), y)
  l:backward()
  opt:step()
  opt:zero_grad()
  l = nil
end
paced = engine.memory_stats().peak_allocated
for _ = 1, o.steps do
  collectgarbage(); collectgarbage()
  engine.reset_peak_memory()
  local l = F.cross_entropy(model(x), y)
  collectgarbage()
  l:backward()
  opt:step()
  opt:zero_grad()
  l = nil
  peak = math.max(peak, engine.memory_stats().peak_allocated)
end
collectgarbage(); collectgarbage()
local between = engine.memory_stats().allocated
local vals = {}
for r = 1, 4 * W do vals[r] = 0 end
vals[rank + 1], vals[W + rank + 1], vals[2 * W + rank + 1], vals[3 * W + rank + 1] = peak, acts, paced, between
local t = engine.tensor(vals, "f64")
dist.all_reduce(t, "sum")
local v = t:totable()
if rank == 0 then
  local maxp, maxa, maxpaced, maxb, list = 0, 0, 0, 0, {}
  for r = 1, W do
    maxp, maxa = math.max(maxp, v[r]), math.max(maxa, v[W + r])
    maxpaced, maxb = math.max(maxpaced, v[2 * W + r]), math.max(maxb, v[3 * W + r])
    list[#list + 1] = string.format("%.1f", v[r] / MiB)
  end
  local zero3 = 16 * n_params / W + 4 * gmax + maxa
  print(string.format("fsdp_memory N=%d: max peak %.2f MiB, ZeRO-3 figure %.2f MiB (16 B x %d / %d = %.2f + group %.2f + "
    .. "activations %.2f), ratio %.2f (target <= 1.1); per-rank live peaks %s MiB; peak without the collections %.2f "
    .. "MiB; allocated between steps %.2f MiB (sharded params + AdamW: %.2f)", W, maxp / MiB, zero3 / MiB, n_params, W,
    16 * n_params / W / MiB, 4 * gmax / MiB, maxa / MiB, maxp / zero3, table.concat(list, " "), maxpaced / MiB,
    maxb / MiB, 12 * n_params / W / MiB))
end
