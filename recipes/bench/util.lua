-- recipes/bench/util.lua: what the training-step benches (fsdp_step, tp_step, gpt_2d_step, fsdp_memory, and the
-- comm benches comm_check and watchdog) share:
-- --key=value parsing, the median, a sleeping barrier, the reference GPT and its fixed random batch, collective
-- counts per step, the load average, and finding a Python that imports torch.  Not a bench: a bench loads it with
--   local U = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/util.lua")
local ffi = require("ffi")
local engine = require("engine")
local nn = engine.nn
local models = require("engine.models")

local M = {}

-- parse_args(name, o, argv, each [, help]): the options of the defaults table o (engine.cli: --key=value or --key
-- value, --help, typos; numbers where the default is one) into o; each(k, v, a) (optional) sees every option set,
-- with v its value and a "--k=v"; help (optional) gives an option's meaning by name
function M.parse_args(name, o, argv, each, help)
  local keys = {}
  for k in pairs(o) do keys[#keys + 1] = k end
  table.sort(keys)
  local options = {}
  for i, k in ipairs(keys) do options[i] = { k, o[k], help and help[k] or "" } end
  local v, given = require("engine.cli").parse(argv, { name = name, options = options,
    description = "A benchmark: it prints its figures beside their baselines measured in the same run." })
  for k in pairs(o) do o[k] = v[k] end
  if each then
    for _, a in ipairs(argv or {}) do
      local k = a:match("^%-%-([%w_]+)")
      if k and given[k] then each(k, tostring(o[k]), "--" .. k .. "=" .. tostring(o[k])); given[k] = nil end
    end
  end
  return o
end

-- the median of a list of numbers (NaN when empty)
function M.median(t)
  local s = { unpack(t) }
  table.sort(s)
  local n = #s
  if n == 0 then return 0 / 0 end
  return n % 2 == 1 and s[(n + 1) / 2] or 0.5 * (s[n / 2] + s[n / 2 + 1])
end

-- A barrier that sleeps instead of spinning (MPI_Barrier polls a core at 100% under ob1/vader): an asynchronous
-- barrier polled every 2 ms.
pcall(ffi.cdef, "int usleep(unsigned int usec);")
function M.idle_barrier()
  local w = engine.distributed.barrier{ async = true }
  while not w:is_completed() do ffi.C.usleep(2000) end
end

-- the reference GPT of the options (n_layers, dim, n_heads, vocab, seq): common_dtensor.py's Transformer, seed 0, dropout 0,
-- N(0, 0.02) embeddings (GPT-2 style, as recipes/bench/step.lua), in train mode
function M.build_model(o)
  engine.manual_seed(0)
  local model = models.Transformer{ n_layers = o.n_layers, dim = o.dim, n_heads = o.n_heads, vocab_size = o.vocab,
    max_seq_len = o.seq, dropout_p = 0, gelu = o.gelu or "none" }
  for name, p in model:named_parameters() do
    if name:match("embeddings%.weight$") then nn.init.normal_(p, 0, 0.02) end
  end
  model:train()
  return model
end

-- the fixed random global batch (seed 1) of o.batch rows of o.seq + 1 tokens < o.vocab: inputs x, targets y
-- [batch, seq], the same on every rank, and the tokens [batch, seq + 1] they were copied from; batch(o, r, n):
-- the rows of part r (0-based) of n equal parts only
function M.batch(o, r, n)
  engine.manual_seed(1)
  local seq = (engine.rand(o.batch, o.seq + 1) * o.vocab):long():clamp(0, o.vocab - 1)
  local x, y = seq:narrow(2, 1, o.seq), seq:narrow(2, 2, o.seq)
  if n then
    local b = o.batch / n
    x, y = x:narrow(1, r * b + 1, b), y:narrow(1, r * b + 1, b)
  end
  return x:contiguous(), y:contiguous(), seq
end

-- count_summary(counts, steps) -> collectives per step in all, and "kind=n ..." per step sorted by kind ("none")
function M.count_summary(counts, steps)
  local keys, total = {}, 0
  for k, v in pairs(counts) do
    keys[#keys + 1] = string.format("%s=%g", k, v / steps)
    total = total + v / steps
  end
  table.sort(keys)
  return total, #keys > 0 and table.concat(keys, " ") or "none"
end

-- the first line of /proc/loadavg ("?" without one)
function M.loadavg()
  local f = io.open("/proc/loadavg")
  if not f then return "?" end
  local s = f:read("*l") or "?"
  f:close()
  return s
end

-- a shell prefix that removes the MPI launcher's environment (OMPI_*, PMIX_*), so that a child (PyTorch's
-- processes, another mpirun) does not join this job
M.no_mpi_env = "env $(env | sed -n 's/^\\(OMPI_[^=]*\\|PMIX_[^=]*\\)=.*/-u \\1/p')"

-- python_with(python, import) -> the interpreter path twice (relative paths also under ENGINE_HOME) when it
-- runs `import` (a Python statement), else nil and the path tried
function M.python_with(python, import)
  local home = (ENGINE_HOME and ENGINE_HOME ~= "") and ENGINE_HOME or "."
  local function exists(path)
    local fh = io.open(path)
    if fh then fh:close() end
    return fh ~= nil
  end
  local py = python
  if not py:match("^/") and not exists(py) then py = home .. "/" .. py end
  if not exists(py) then return nil, py end
  local rc = os.execute("'" .. py .. "' -c '" .. import .. "' >/dev/null 2>&1")
  if rc == 0 or rc == true then return py, py end
  return nil, py
end

-- The data-parallel GPT step of the comm benches (comm_check, watchdog): recipes/dp_gpt.lua's step with DTensors
-- (Replicate parameters on a 1-D "dp" mesh of the world, batch Shard(1), cross_entropy mean over the sharded batch,
-- gradients all_reduced by AccumulateGrad, clip_grad_norm_, AdamW) on a fixed random batch of this rank's rows.
-- o: n_layers, dim, n_heads, seq, batch.  Returns step (one training step; returns the loss) and the mesh.
function M.dp_gpt_step(o)
  local dist, optim = engine.distributed, engine.optim
  local F = nn.functional
  local mesh = dist.init_device_mesh("cpu", { dist.world_size() }, { "dp" })
  engine.manual_seed(1337)
  local model = nn.Transformer{ n_layers = o.n_layers, dim = o.dim, n_heads = o.n_heads, vocab_size = 256,
    max_seq_len = o.seq, dropout_p = 0 }
  dist.replicate_parameters(model, mesh)
  model:train()
  local params = model:parameters()
  local opt = optim.AdamW(params, { lr = 1e-4, betas = { 0.9, 0.95 }, weight_decay = 0.1 })
  engine.manual_seed(100 + dist.rank()) -- this rank's rows of the global batch
  local ids = (engine.rand(o.batch, o.seq + 1) * 255.99):long() -- truncates: byte ids 0..255
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
  return step, mesh
end

-- timed_step(step, out): one step after a barrier, its ms appended to out
function M.timed_step(step, out)
  engine.distributed.barrier()
  local t0 = engine.time()
  step()
  out[#out + 1] = (engine.time() - t0) * 1e3
end

-- dp_ab_bench(name, argv, set): the frame of the comm benches (comm_check, watchdog): parses --steps, --rounds,
-- --warmup, --n_layers, --dim, --n_heads, --seq, --batch, --threads; starts the distributed runtime; builds the DP
-- GPT step; runs the warmup, counts one step's collectives, then rounds x steps steps with set(false) and set(true)
-- alternating step by step (drift and other load hit both alike).  Returns {o, rank, world, log, step, counts,
-- ncoll, off, on} (off / on: ms per step); leaves the feature on.
function M.dp_ab_bench(name, argv, set)
  local dist = engine.distributed
  local o = M.parse_args(name, { steps = 8, rounds = 3, warmup = 2, n_layers = 4, dim = 256, n_heads = 4, seq = 128,
    batch = 8, threads = 0 }, argv)
  dist.init()
  local rank, world = dist.rank(), dist.world_size()
  local function log(...) if rank == 0 then print(string.format(...)); io.stdout:flush() end end
  if o.threads > 0 then engine.set_num_threads(o.threads) end
  local step = M.dp_gpt_step(o)
  log("%s: %d rank(s), %d threads each, GPT %d layers dim %d seq %d, batch %d per rank", name, world,
    engine.get_num_threads(), o.n_layers, o.dim, o.seq, o.batch)
  for _ = 1, o.warmup do step() end
  local counts = dist.count_collectives(step)
  local ncoll = 0
  for _, v in pairs(counts) do ncoll = ncoll + v end
  local off, on = {}, {}
  for _ = 1, o.rounds * o.steps do
    set(false); M.timed_step(step, off)
    set(true); M.timed_step(step, on)
  end
  return { o = o, rank = rank, world = world, log = log, step = step, counts = counts, ncoll = ncoll, off = off,
    on = on }
end

return M
