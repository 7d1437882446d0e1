-- recipes/common.lua: the parts the KJV GPT recipes share (recipes/gpt.lua, recipes/fsdp_gpt.lua, and through
-- them recipes/tp_gpt.lua, recipes/gpt_2d.lua and recipes/llama.lua; recipes/dp_gpt.lua's checkpoints): the
-- common options and their parsing, threads, rank-0 logging, the GPT-2 style initialisation, the parameter
-- digest, validation, distributed checkpoints (save, async save, prune, resume), the training loop with its
-- log lines, and the sample.  Not a recipe: a recipe loads it with
--   local C = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/common.lua")
local engine = require("engine")
local nn, optim, data, dist = engine.nn, engine.optim, engine.data, engine.distributed

local M = {}

local HOME = (ENGINE_HOME and ENGINE_HOME ~= "") and ENGINE_HOME or "."

-- the options of recipes/gpt.lua and recipes/fsdp_gpt.lua alike (each adds its own)
function M.defaults(extra)
  local d = {
    n_layers = 4, dim = 256, n_heads = 4, seq = 128, dropout = 0.0,
    batch = 8, steps = 600, lr = 2e-3, warmup = 30, min_lr_ratio = 0.1, weight_decay = 0.1,
    beta1 = 0.9, beta2 = 0.95, grad_clip = 1.0, seed = 1337, threads = 0,
    train = HOME .. "/data/kjv_train.bin", val = HOME .. "/data/kjv_val.bin",
    log_every = 10, eval_every = 100, eval_batches = 20,
    ckpt_dir = HOME .. "/checkpoints", ckpt_every = 0, resume = "", ckpt_keep = 0, ckpt_async = 0,
    sample_len = 300, temperature = 0.8, prompt = "And God said", log_exact = 0, device = "cpu",
  }
  for k, v in pairs(extra or {}) do d[k] = v end
  return d
end

-- parse_args(name, defaults, argv, positive) -> options: --key=value for the keys of defaults (numbers where the
-- default is one), then every key of `positive` that is set must be a positive integer
function M.parse_args(name, defaults, argv, positive)
  local o = {}
  for k, v in pairs(defaults) do o[k] = v end
  for _, a in ipairs(argv) do
    local k, v = a:match("^%-%-([%w_]+)=(.*)$")
    if not k then error(name .. ": bad argument '" .. a .. "' (expected --key=value)", 0) end
    local d = defaults[k]
    if d == nil then
      local names = {}
      for n in pairs(defaults) do names[#names + 1] = n end
      table.sort(names)
      error(name .. ": unknown option --" .. k .. " (options: " .. table.concat(names, ", ") .. ")", 0)
    end
    if type(d) == "number" then
      o[k] = tonumber(v) or error(name .. ": --" .. k .. " must be a number, got '" .. v .. "'", 0)
    else
      o[k] = v
    end
  end
  for _, k in ipairs(positive) do
    if o[k] ~= nil and (o[k] < 1 or o[k] % 1 ~= 0) then error(name .. ": --" .. k .. " must be a positive integer", 0) end
  end
  return o
end

-- --threads: N > 0 per rank; 0 keeps the BLAS default with one rank and gives each of `world` ranks
-- max(1, cores / world)
-- --device: "cpu" or "cuda" (the model, the batches and the meshes on the GPU of this rank's node-local rank;
-- NCCL between ranks); cuda without a usable GPU is an error naming the reason.
function M.check_device(name, o)
  if o.device ~= "cpu" and o.device ~= "cuda" then
    error(string.format("%s: --device must be cpu or cuda, got '%s'", name, tostring(o.device)), 0)
  end
  if o.device == "cuda" and not engine.cuda.is_available() then
    error(name .. ": --device=cuda: " .. engine.cuda.unavailable_reason(), 0)
  end
end

-- the batch on the run's device
function M.to_device(o, ...)
  if o.device == "cpu" then return ... end
  local r = { ... }
  for i = 1, select("#", ...) do r[i] = r[i]:to(o.device) end
  return unpack(r, 1, select("#", ...))
end

-- the peak memory of the run's device (tensor bytes), and its reset
local function peak_bytes(o)
  if o.device == "cuda" then return engine.cuda.memory_stats().peak_allocated end
  return engine.memory_stats().peak_allocated
end
local function reset_peak(o)
  if o.device == "cuda" then engine.cuda.reset_peak_memory_stats() else engine.reset_peak_memory() end
end

function M.set_threads(threads, world)
  if threads > 0 then
    engine.set_num_threads(threads)
  elseif world > 1 then
    local p = io.popen("nproc 2>/dev/null")
    local cores = tonumber(p and p:read("*l") or "") or 1
    if p then p:close() end
    engine.set_num_threads(math.max(1, math.floor(cores / world)))
  end
end

-- log(fmt, ...): rank 0 prints (flushed)
function M.logger(rank)
  return function(...) if rank == 0 then print(string.format(...)); io.stdout:flush() end end
end

-- all_reduce_num(x, op): a number reduced over the world (op default "avg"; f64)
function M.all_reduce_num(x, op)
  if dist.world_size() == 1 then return x end
  local t = engine.tensor({ x }, "f64")
  dist.all_reduce(t, op or "avg")
  return t:item()
end

function M.median(t)
  local s = { unpack(t) }
  table.sort(s)
  local n = #s
  if n == 0 then return 0 end
  return n % 2 == 1 and s[(n + 1) / 2] or 0.5 * (s[n / 2] + s[n / 2 + 1])
end

-- GPT-2 style initialisation: N(0, 0.02) for embeddings and linear weights, N(0, 0.02/sqrt(2 L)) for
-- the projections into the residual stream (attention.wo, feed_forward.w2), zero biases, LayerNorm 1/0.
-- (PyTorch's defaults give N(0, 1) embeddings, which with tied output weights start at a loss of ~170.)
function M.init_weights(model, n_layers)
  for name, p in model:named_parameters() do
    if name:match("norm%.weight$") then nn.init.ones_(p)
    elseif name:match("bias$") then nn.init.zeros_(p)
    elseif name:match("attention%.wo%.weight$") or name:match("feed_forward%.w2%.weight$") then
      nn.init.normal_(p, 0, 0.02 / math.sqrt(2 * n_layers))
    else nn.init.normal_(p, 0, 0.02) end
  end
end

-- a digest of the model's parameters: each full tensor's checksum (engine.tensor_checksum), in name order, hashed
-- (FNV-1a); the same bits give the same digest whatever the layout.  Collective (full_tensor of DTensors).
function M.parameter_digest(model)
  local by_name, names = {}, {}
  for name, p in model:named_parameters() do
    if not by_name[name] then by_name[name] = p; names[#names + 1] = name end
  end
  table.sort(names)
  local h = 1469598103934665603ULL
  for _, name in ipairs(names) do
    local p = by_name[name]
    local s = name .. "=" .. engine.tensor_checksum(dist.is_dtensor(p) and p:full_tensor() or p) .. ";"
    for i = 1, #s do h = bit.bxor(h, s:byte(i)) * 1099511628211ULL end
  end
  return bit.tohex(h, 16)
end

-- evaluate(model, val, loss_of, max_batches, o) -> the mean of loss_of(x, y) over val's batches (at most
-- max_batches; on o.device when o is given), averaged over the world; the model in eval mode meanwhile, no grad
function M.evaluate(model, val, loss_of, max_batches, o)
  model:eval()
  local sum, n = 0, 0
  engine.no_grad(function()
    for x, y in val:batches() do
      if max_batches and n >= max_batches then break end
      if o then x, y = M.to_device(o, x, y) end
      sum = sum + loss_of(x, y)
      n = n + 1
    end
  end)
  model:train()
  return M.all_reduce_num(sum / math.max(n, 1))
end

-- Distributed checkpoints (dist.checkpoint): every rank saves its own shards of the model and the optimizer
-- state (keyed by parameter names), plus the step, the RNG state and the data position; a load fills the
-- current layout whatever the layout at save time.
--   ck = C.checkpointer{ name, log, rank, model, opt, sampler, dir, keep (0: all), async (bool) }
--   ck:state(step), ck:load(path) -> step, ck:resume(path, latest, load_other) -> step, ck:save(step),
--   ck:finish() (waits for an async save), ck.last (the newest checkpoint saved or resumed from)
local Ck = {}
Ck.__index = Ck

function M.checkpointer(t)
  return setmetatable(t, Ck)
end

function Ck:state(at_step)
  local dcp = dist.checkpoint
  return { model = self.model:state_dict(), optim = dcp.get_optimizer_state_dict(self.model, self.opt),
    step = at_step, rng = engine.get_rng_state(), data = self.sampler:state() }
end

function Ck:load(path)
  local dcp = dist.checkpoint
  local st = self:state(0)
  dcp.load(st, path)
  dcp.set_optimizer_state_dict(self.model, self.opt, st.optim)
  engine.set_rng_state(st.rng)
  self.sampler:set_state(st.data)
  return st.step
end

local function is_dcp_dir(path)
  local f = io.open(path .. "/.metadata", "rb")
  if f then f:close() end
  return f ~= nil
end

-- resume(path, latest, load_other) -> the step: path, or for "latest" latest(dir) (default the newest
-- distributed checkpoint in dir); load_other(path) -> step loads a path that is not a distributed checkpoint
function Ck:resume(path, latest, load_other)
  if path == "latest" then
    path = (latest or dist.checkpoint.latest)(self.dir)
    if not path then error(self.name .. ": --resume=latest: no checkpoint in " .. self.dir, 0) end
  end
  local step
  if load_other and not is_dcp_dir(path) then step = load_other(path) else step = self:load(path) end
  self.last = path
  self.log(self.name .. ": resumed from %s at step %d", path, step)
  return step
end

function Ck:finish()
  local p = self.pending   -- an async save in flight: finished (collectively) before the next one
  if p then
    p.h:wait()
    p.done()
    self.pending = nil
  end
end

function Ck:save(at_step)
  self:finish()
  local dcp = dist.checkpoint
  local path = dcp.path(self.dir, at_step)
  local h = dcp.save(self:state(at_step), path, { async = self.async })
  local function done()
    self.last = path
    self.log(self.name .. ": saved %s", path)
    if self.keep > 0 and self.rank == 0 then dcp.prune(self.dir, self.keep) end
  end
  if self.async then self.pending = { h = h, done = done } else done() end
end

-- train(t): the training loop from t.step to o.steps with the recipes' log lines, then the final validation,
-- the median step time, the last checkpoint and the parameter digest (--log_exact).  t: name, o, log, model,
-- opt, params, train (the sampler), step, lr_at, tokens (per step), evaluate(), save(step) (at --ckpt_every and
-- at the end, when --ckpt_every >= 0), ck (its finish() and last), backward(x, y) -> r (forward, backward,
-- gradient reduction), loss_value(r) -> the loss averaged over the ranks (after zero_grad; collective),
-- after_step(first) (optional: after opt:step, before zero_grad).
function M.train(t)
  local o, log, name, opt, params, ck = t.o, t.log, t.name, t.opt, t.params, t.ck
  local step = t.step
  if step == 0 or step >= o.steps then log("step %5d | val loss %.4f", step, t.evaluate()) end

  reset_peak(o)
  local t_log, n_log = engine.time(), 0
  local times = {}
  while step < o.steps do
    local t0 = engine.time()
    local lr = o.lr * t.lr_at(step)
    for _, g in ipairs(opt.param_groups) do g.lr = lr end
    local x, y = M.to_device(o, t.train:next())
    local r = t.backward(x, y)
    local gnorm = o.grad_clip > 0 and optim.clip_grad_norm_(params, o.grad_clip) or optim.grad_norm(params)
    opt:step()
    if t.after_step then t.after_step(#times == 0) end
    opt:zero_grad()
    local l = t.loss_value(r)
    if l ~= l or l == math.huge or l == -math.huge then -- the same on every rank (averaged): all stop together
      ck:finish()
      error(string.format(name .. ": the loss is %s at step %d (lr %.3e): training diverged; lower --lr, raise "
        .. "--warmup or --grad_clip, or resume from an earlier checkpoint (last good checkpoint: %s)", tostring(l),
        step + 1, lr, ck.last or "none"), 0)
    end
    r = nil
    step = step + 1
    times[#times + 1] = engine.time() - t0
    n_log = n_log + 1
    if step % o.log_every == 0 or step == o.steps then
      local dt = (engine.time() - t_log) / n_log
      log("step %5d | loss " .. (o.log_exact == 1 and "%.17g" or "%.6f") .. " | lr %.3e | grad norm %.4f | %.1f ms/step "
        .. "| %.0f tok/s | peak %.1f MiB", step, l, lr, gnorm:item(), dt * 1e3, t.tokens / dt,
        peak_bytes(o) / 2 ^ 20)
      t_log, n_log = engine.time(), 0
    end
    if o.eval_every > 0 and step % o.eval_every == 0 and step ~= o.steps then
      local te = engine.time()
      log("step %5d | val loss %.4f | (eval %.1f s)", step, t.evaluate(), engine.time() - te)
      t_log = t_log + (engine.time() - te)
    end
    if o.ckpt_every > 0 and step % o.ckpt_every == 0 and step ~= o.steps then t.save(step) end
  end
  if #times > 0 then
    log("step %5d | val loss %.4f", step, t.evaluate())
    log(name .. ": median %.1f ms/step over %d steps (%.0f tok/s)", M.median(times) * 1e3, #times,
      t.tokens / M.median(times))
    if o.ckpt_every >= 0 then t.save(step) end
  end
  ck:finish()
  if o.log_exact == 1 then log(name .. ": parameter digest %s", M.parameter_digest(t.model)) end
  return step
end

-- sample(o, model, logits_of, pad) -> the text: --sample_len bytes after --prompt (seeded with --seed + 1:
-- the same run gives the same text), greedy at --temperature 0; logits_of(ids [1, t]) -> plain logits
-- [1, t, 256]; pad > 1 pads the context on the right to a multiple of pad (causal: later tokens do not matter)
function M.sample(o, model, logits_of, pad)
  model:eval()
  engine.manual_seed(o.seed + 1)
  local ids = data.encode(o.prompt)
  if #ids == 0 then ids = { 10 } end
  engine.no_grad(function()
    for _ = 1, o.sample_len do
      local ctx = {}
      for i = math.max(1, #ids - o.seq + 1), #ids do ctx[#ctx + 1] = ids[i] end
      local n = #ctx
      if pad and pad > 1 then while #ctx % pad ~= 0 do ctx[#ctx + 1] = 10 end end
      local logits = logits_of(M.to_device(o, engine.tensor({ ctx }))) -- [1, t, 256]
      local last = logits:narrow(2, n, 1):tolist_flat()
      local nxt
      if o.temperature <= 0 then
        nxt = 0
        for i = 2, #last do if last[i] > last[nxt + 1] then nxt = i - 1 end end
      else
        local mx = -math.huge
        for i = 1, #last do mx = math.max(mx, last[i]) end
        local w, total = {}, 0
        for i = 1, #last do w[i] = math.exp((last[i] - mx) / o.temperature); total = total + w[i] end
        local u = engine.rand(1):item() * total
        nxt = #last - 1
        for i = 1, #last do
          u = u - w[i]
          if u <= 0 then nxt = i - 1; break end
        end
      end
      ids[#ids + 1] = nxt
    end
  end)
  return data.decode(ids)
end

return M
