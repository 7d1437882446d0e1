-- engine.run: a training run's folder, log, metrics and progress line, for recipes (recipes/common.lua) and
-- users' own scripts.
--
--   local run = require("engine.run")
--   local r = run.start{ name = "gpt", out = o.out, resume = false, config = o }   -- collective
--   r.dir                          -- "runs/gpt-20261128-014530" (or o.out)
--   r:log("step %d | loss %.4f", step, loss)      -- rank 0: printed and appended to <dir>/log.txt
--   r:metrics{ step = 10, loss = 2.5, lr = 1e-3 }  -- rank 0: one JSON line in <dir>/metrics.jsonl
--   r:write("samples.txt", text, "a")             -- rank 0: a file in the run folder
--   r:save_config(o)                               -- rank 0: <dir>/config.json (the resolved options)
--   run.start{..., tensorboard = true}             -- also a TensorBoard events file of the metrics (engine.tensorboard)
--
-- The run folder: --out, or by default runs/<name>-<YYYYmmdd>-<HHMMSS> under the current directory (the ranks
-- agree on the name: rank 0's clock; $ENGINE_RUNS_DIR replaces "runs", as the test suite does).  A folder that holds a run (config.json, metrics.jsonl, log.txt or
-- checkpoints/) is never reused silently: start raises a usage error unless resume is true (a resumed run appends
-- to its log and metrics).  Only rank 0 writes the folder's files; checkpoints (dist.checkpoint) are written by
-- every rank into <dir>/checkpoints unless the recipe's --ckpt_dir says otherwise.
--
-- Throughput figures:
--   run.flops_per_token(n_params, n_layers, dim, seq)  -- 6 N + 12 L d T (the PaLM / nanoGPT estimate)
--   run.peak_flops(device)                             -- collective: the sum over the ranks of the measured f32
--                                                      -- GEMM rate (CPU), or the devices' bf16 peak (CUDA)
--   run.eta(seconds)                                   -- "1h02m", "3m05s", "12s"
local engine = require("engine")
local json = require("engine.json")
local cli = require("engine.cli")
local dist = engine.distributed

local M = {}

local Run = {}
Run.__index = Run

local function shell_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close(); return true end
  -- a folder: io.open succeeds on Linux for folders too, but be sure
  return os.execute("test -e " .. shell_quote(path)) == 0
end
M.exists = exists

local function is_dir(path) return os.execute("test -d " .. shell_quote(path)) == 0 end
M.is_dir = is_dir

function M.mkdir_p(path)
  if os.execute("mkdir -p " .. shell_quote(path)) ~= 0 then error("run: cannot create the folder " .. path, 2) end
end

-- holds_run(dir) -> the first file that shows a run is there, or nil
function M.holds_run(dir)
  for _, f in ipairs({ "config.json", "metrics.jsonl", "log.txt", "checkpoints" }) do
    if exists(dir .. "/" .. f) then return f end
  end
  return nil
end

-- numbers rank 0 decides, the same on every rank
local function agree(values)
  if dist.world_size() == 1 then return values end
  local t = engine.tensor(values, "f64")
  dist.broadcast(t, 0)
  return t:totable()
end

-- start{name, out ("" or nil: the default), resume (bool), runs_dir = "runs"} -> a Run (collective)
function M.start(t)
  for k in pairs(t) do
    if k ~= "name" and k ~= "out" and k ~= "resume" and k ~= "runs_dir" and k ~= "tensorboard" then
      error("run.start: unknown option '" .. tostring(k) .. "' (options: name, out, resume, runs_dir, tensorboard)", 2)
    end
  end
  local name = t.name or "run"
  local runs_dir = t.runs_dir or os.getenv("ENGINE_RUNS_DIR") or "runs"
  if runs_dir == "" then runs_dir = "runs" end
  local rank = dist.world_size() > 1 and dist.rank() or 0
  local dir = t.out
  local code = 0 -- 0 ok, 1 exists
  local what
  if dir == nil or dir == "" then
    local stamp, suffix = os.time(), 1
    if rank == 0 then
      local base = runs_dir .. "/" .. name .. "-" .. os.date("%Y%m%d-%H%M%S", stamp)
      while exists(suffix == 1 and base or (base .. "-" .. suffix)) do suffix = suffix + 1 end
    end
    local v = agree({ stamp, suffix })
    local base = runs_dir .. "/" .. name .. "-" .. os.date("%Y%m%d-%H%M%S", v[1])
    dir = v[2] == 1 and base or (base .. "-" .. v[2])
  else
    dir = dir:gsub("/+$", "")
    if rank == 0 and not t.resume then
      what = M.holds_run(dir)
      if what then code = 1 end
    end
    code = agree({ code })[1]
  end
  if code == 1 then
    cli.usage_error(name, "the run folder %s already holds a run (%s); --resume=latest continues it, or choose "
      .. "another --out", dir, what or "config.json")
  end
  local ok = 1
  if rank == 0 then ok = os.execute("mkdir -p " .. shell_quote(dir)) == 0 and 1 or 0 end
  if agree({ ok })[1] ~= 1 then cli.usage_error(name, "cannot create the run folder %s", dir) end
  local r = setmetatable({ name = name, dir = dir, rank = rank, t0 = engine.time() }, Run)
  if rank == 0 then
    r.log_file = io.open(dir .. "/log.txt", "a")
    r.metrics_file = io.open(dir .. "/metrics.jsonl", "a")
    if t.tensorboard then r.tb = require("engine.tensorboard").writer(dir) end
  end
  return r
end

-- r:log(fmt, ...): rank 0 prints the line (flushed) and appends it to log.txt
function Run:log(fmt, ...)
  if self.rank ~= 0 then return end
  local s = select("#", ...) > 0 and string.format(fmt, ...) or fmt
  print(s)
  io.stdout:flush()
  if self.log_file then
    self.log_file:write(s, "\n")
    self.log_file:flush()
  end
end

-- r:metrics(t): rank 0 appends t as one JSON line (time_s, the seconds since start, added when absent)
function Run:metrics(t)
  if self.rank ~= 0 or not self.metrics_file then return end
  local row = {}
  for k, v in pairs(t) do
    if type(v) == "number" and (v ~= v or v == math.huge or v == -math.huge) then v = tostring(v) end
    row[k] = v
  end
  if row.time_s == nil then row.time_s = engine.time() - self.t0 end
  self.metrics_file:write(json.encode(row), "\n")
  self.metrics_file:flush()
  if self.tb and type(row.step) == "number" then  -- TensorBoard: train/<key> and val/loss
    local s = {}
    for k, v in pairs(row) do
      if type(v) == "number" and k ~= "step" and k ~= "time_s" and k ~= "eta_s" then
        s[k == "val_loss" and "val/loss" or ("train/" .. k)] = v
      end
    end
    self.tb:add_scalars(s, row.step)
    self.tb:flush()
  end
end

-- r:write(file, text [, mode "w"]): rank 0 writes a file of the run folder
function Run:write(file, text, mode)
  if self.rank ~= 0 then return end
  local f = io.open(self.dir .. "/" .. file, mode or "w")
  if not f then error("run: cannot write " .. self.dir .. "/" .. file, 2) end
  f:write(text)
  f:close()
end

-- r:save_config(o [, extra]): rank 0 writes <dir>/config.json
function Run:save_config(o, extra)
  if self.rank ~= 0 then return end
  cli.save_config(self.dir .. "/config.json", o, extra)
end

function Run:close()
  if self.tb then self.tb:close(); self.tb = nil end
  if self.log_file then self.log_file:close(); self.log_file = nil end
  if self.metrics_file then self.metrics_file:close(); self.metrics_file = nil end
end

-- read_metrics(dir_or_file) -> the list of rows of a metrics.jsonl
function M.read_metrics(path)
  local file = is_dir(path) and (path .. "/metrics.jsonl") or path
  local f = io.open(file, "rb")
  if not f then error("read_metrics: no metrics file " .. file, 2) end
  local rows = {}
  local n = 0
  for line in f:lines() do
    n = n + 1
    if line:match("%S") then
      local ok, v = pcall(json.decode, line)
      if not ok then f:close(); error(string.format("read_metrics: %s:%d: %s", file, n, v), 2) end
      rows[#rows + 1] = v
    end
  end
  f:close()
  return rows
end

-- ------------------------------------------------------------------ throughput
function M.flops_per_token(n_params, n_layers, dim, seq)
  return 6 * n_params + 12 * n_layers * dim * seq
end

-- bf16 dense peaks (FLOP/s) of known devices, by name
local device_peaks = {
  { "H200", 989e12 }, { "H100 PCIe", 756e12 }, { "H100", 989e12 }, { "GH200", 989e12 }, { "A100", 312e12 },
  { "L40S", 362e12 }, { "A10G", 70e12 }, { "L4", 121e12 }, { "RTX 4090", 165e12 }, { "V100", 125e12 },
}

-- gemm_rate(n, reps) -> f32 GEMM FLOP/s of this process (the best of a few timed n x n x n products)
function M.gemm_rate(n, reps)
  n, reps = n or 512, reps or 6
  -- (constant operands: the global RNG stream, which a resumed run restores, is not touched)
  local a, b = engine.ones(n, n) * 0.01, engine.ones(n, n) * 0.02
  local best = 0
  engine.no_grad(function()
    engine.matmul(a, b) -- warm-up
    for _ = 1, reps do
      local t0 = engine.time()
      engine.matmul(a, b)
      local dt = engine.time() - t0
      if dt > 0 then best = math.max(best, 2 * n ^ 3 / dt) end
    end
  end)
  return best
end

-- peak_flops(device) -> FLOP/s of the whole job and how it was found (collective on CPU: every rank measures at
-- the same time, so ranks sharing cores share the rate; the sum over ranks)
function M.peak_flops(device)
  local world = dist.world_size()
  if device == "cuda" then
    local name = engine.cuda.get_device_name()
    for _, p in ipairs(device_peaks) do
      if name:find(p[1], 1, true) then return p[2] * world, string.format("%s bf16 peak %.0f TFLOP/s", name, p[2] / 1e12) end
    end
    return nil, "unknown device " .. name
  end
  if world > 1 then dist.barrier() end
  local rate = M.gemm_rate()
  if world > 1 then
    local t = engine.tensor({ rate }, "f64")
    dist.all_reduce(t, "sum")
    rate = t:item()
  end
  return rate, string.format("measured f32 GEMM %.0f GFLOP/s", rate / 1e9)
end

-- eta(seconds) -> a short duration
function M.eta(s)
  if s ~= s or s == math.huge then return "?" end
  s = math.max(0, math.floor(s + 0.5))
  if s >= 3600 then return string.format("%dh%02dm", math.floor(s / 3600), math.floor(s % 3600 / 60)) end
  if s >= 60 then return string.format("%dm%02ds", math.floor(s / 60), s % 60) end
  return string.format("%ds", s)
end

return M
