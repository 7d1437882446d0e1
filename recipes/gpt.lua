-- recipes/gpt.lua: a byte-level GPT (seed 003's Transformer) trained on the King James Bible.
--
--   build/engine tools/prepare_data.lua                       # data/kjv_{train,val}.bin (make data)
--   build/engine recipes/gpt.lua [--key=value ...]            # one process
--   mpirun -np 2 build/engine recipes/gpt.lua --threads=1     # data parallel over 2 ranks
--   make run ARGS="--steps=100"                               # the same through the Makefile
--
-- Options (defaults in `defaults` below):
--   model      --n_layers --dim --n_heads --seq (context length) --dropout
--   training   --batch (per rank) --steps --lr (peak) --warmup (steps of linear warmup, then cosine
--              decay to --min_lr_ratio x lr at --steps) --weight_decay --beta1 --beta2 --grad_clip
--              --seed (model init, data order, dropout) --threads (BLAS/kernel threads per rank)
--   data       --train --val (llm.c token shards, byte tokens)
--   logging    --log_every (rank 0 prints step, loss, lr, grad norm, ms/step, tokens/s, peak memory)
--              --eval_every --eval_batches (validation loss on the first eval_batches batches of val;
--              also before the first step and after the last)
--   checkpoint --ckpt_dir --ckpt_every (0: only at the end; -1: never) --resume (a checkpoint path, or
--              "latest" for the newest one in ckpt_dir)
--   sampling   --sample_len (bytes generated at the end; 0: none) --temperature (0: greedy)
--              --prompt
--
-- Defaults: `make run` trains the reference model (3.25M parameters) for 600 steps of 1024 tokens at a
-- peak lr of 2e-3; measured on the 2-core project VM: validation loss 5.63 -> 1.87 in about 3 minutes
-- (~185 ms/step).  The lr: at 3e-4 the validation loss was still 2.30 after 400 steps (it sits on the
-- ~2.35 bigram plateau until attention starts to help), at 1e-3 it reached 1.96 after 600 steps, at 2e-3
-- 1.87 (2.00 at step 400).
--
-- Threads: --threads=0 (default) keeps the BLAS default with one rank and gives each of N ranks
-- max(1, cores / N) threads (mpirun runs them on one machine).
--
-- With several ranks (mpirun -np N) every rank holds the whole model (same seed, same initial
-- weights), draws its own batches (data.BatchSampler with rank/world_size) and the gradients are
-- averaged with all_reduce before clipping and the optimizer step: the global batch is batch x N.
-- Rank 0 logs, evaluates with the others (the validation batches are split over ranks) and saves
-- checkpoints.  Resuming is exact: model, AdamW state, RNG, sampler position and step are restored,
-- so a resumed run prints the same losses as an uninterrupted one (spec/recipe_spec.lua).
local engine = require("engine")
local nn, optim, data, dist = engine.nn, engine.optim, engine.data, engine.distributed
local checkpoint = require("engine.checkpoint")
local F = nn.functional

local HOME = (ENGINE_HOME and ENGINE_HOME ~= "") and ENGINE_HOME or "."

local defaults = {
  n_layers = 4, dim = 256, n_heads = 4, seq = 128, dropout = 0.0,
  batch = 8, steps = 600, lr = 2e-3, warmup = 30, min_lr_ratio = 0.1, weight_decay = 0.1,
  beta1 = 0.9, beta2 = 0.95, grad_clip = 1.0, seed = 1337, threads = 0,
  train = HOME .. "/data/kjv_train.bin", val = HOME .. "/data/kjv_val.bin",
  log_every = 10, eval_every = 100, eval_batches = 20,
  ckpt_dir = HOME .. "/checkpoints", ckpt_every = 0, resume = "",
  sample_len = 300, temperature = 0.8, prompt = "And God said",
}

local function parse_args(argv)
  local o = {}
  for k, v in pairs(defaults) do o[k] = v end
  for _, a in ipairs(argv) do
    local k, v = a:match("^%-%-([%w_]+)=(.*)$")
    if not k then error("gpt: bad argument '" .. a .. "' (expected --key=value)", 0) end
    local d = defaults[k]
    if d == nil then
      local names = {}
      for n in pairs(defaults) do names[#names + 1] = n end
      table.sort(names)
      error("gpt: unknown option --" .. k .. " (options: " .. table.concat(names, ", ") .. ")", 0)
    end
    if type(d) == "number" then
      o[k] = tonumber(v) or error("gpt: --" .. k .. " must be a number, got '" .. v .. "'", 0)
    else
      o[k] = v
    end
  end
  for _, k in ipairs({ "n_layers", "dim", "n_heads", "seq", "batch", "steps", "log_every", "eval_batches" }) do
    if o[k] < 1 or o[k] % 1 ~= 0 then error("gpt: --" .. k .. " must be a positive integer", 0) end
  end
  if o.warmup < 0 then error("gpt: --warmup must be >= 0", 0) end
  o.warmup = math.min(o.warmup, o.steps)
  return o
end

local function median(t)
  local s = { unpack(t) }
  table.sort(s)
  local n = #s
  if n == 0 then return 0 end
  return n % 2 == 1 and s[(n + 1) / 2] or 0.5 * (s[n / 2] + s[n / 2 + 1])
end

-- GPT-2 style initialisation: N(0, 0.02) for embeddings and linear weights, N(0, 0.02/sqrt(2 L)) for
-- the projections into the residual stream (attention.wo, feed_forward.w2), zero biases, LayerNorm 1/0.
-- (PyTorch's defaults give N(0, 1) embeddings, which with tied output weights start at a loss of ~170.)
local function init_weights(model, n_layers)
  for name, p in model:named_parameters() do
    if name:match("norm%.weight$") then nn.init.ones_(p)
    elseif name:match("bias$") then nn.init.zeros_(p)
    elseif name:match("attention%.wo%.weight$") or name:match("feed_forward%.w2%.weight$") then
      nn.init.normal_(p, 0, 0.02 / math.sqrt(2 * n_layers))
    else nn.init.normal_(p, 0, 0.02) end
  end
end

local function main(argv)
  local o = parse_args(argv)
  dist.init()
  local rank, world = dist.rank(), dist.world_size()
  local function log(...) if rank == 0 then print(string.format(...)); io.stdout:flush() end end
  if o.threads > 0 then
    engine.set_num_threads(o.threads)
  elseif world > 1 then
    local p = io.popen("nproc 2>/dev/null")
    local cores = tonumber(p and p:read("*l") or "") or 1
    if p then p:close() end
    engine.set_num_threads(math.max(1, math.floor(cores / world)))
  end

  -- model
  engine.manual_seed(o.seed)
  local model = nn.Transformer{ n_layers = o.n_layers, dim = o.dim, n_heads = o.n_heads, vocab_size = 256,
    max_seq_len = o.seq, dropout_p = o.dropout }
  init_weights(model, o.n_layers)
  model:train()
  local params = model:parameters()
  local opt = optim.AdamW(params, { lr = o.lr, betas = { o.beta1, o.beta2 }, eps = 1e-8,
    weight_decay = o.weight_decay })
  local lr_at = optim.lr_scheduler.warmup_cosine_lambda({ warmup_steps = o.warmup, max_steps = o.steps,
    min_lr_ratio = o.min_lr_ratio })

  -- data
  local train = data.BatchSampler(data.read_shard(o.train), { batch_size = o.batch, seq_len = o.seq,
    seed = o.seed, rank = rank, world_size = world })
  local val_shard = data.read_shard(o.val)
  local val = data.ValLoader(val_shard, { batch_size = o.batch, seq_len = o.seq, rank = rank,
    world_size = world, max_batches = o.eval_batches })

  log("gpt: %d params (%d layers, dim %d, %d heads, seq %d, vocab 256), %d rank(s) x batch %d = %d tokens/step, "
    .. "%d steps, lr %g (warmup %d, cosine to %g), wd %g, clip %g, seed %d, threads %d, BLAS %s",
    model:num_parameters(), o.n_layers, o.dim, o.n_heads, o.seq, world, o.batch, world * o.batch * o.seq,
    o.steps, o.lr, o.warmup, o.min_lr_ratio * o.lr, o.weight_decay, o.grad_clip, o.seed,
    engine.get_num_threads(), engine.blas_corename())
  log("gpt: train %s (%d tokens), val %s (%d tokens, %d batches per evaluation)", o.train, train.total + o.seq,
    o.val, val_shard.n, val:num_batches())

  local step = 0
  if o.resume ~= "" then
    local path = o.resume
    if path == "latest" then
      path = checkpoint.latest(o.ckpt_dir)
      if not path then error("gpt: --resume=latest: no checkpoint in " .. o.ckpt_dir, 0) end
    end
    local info = checkpoint.load(path, { model = model, optimizer = opt, sampler = train })
    step = info.step
    log("gpt: resumed from %s at step %d", path, step)
  end

  local function all_avg(x)
    if world == 1 then return x end
    local t = engine.tensor({ x }, "f64")
    dist.all_reduce(t, "avg")
    return t:item()
  end

  local function evaluate()
    model:eval()
    local sum, n = 0, 0
    engine.no_grad(function()
      for x, y in val:batches() do
        sum = sum + F.cross_entropy(model(x), y):item()
        n = n + 1
        collectgarbage()  -- frees this batch's activations now (Lua does not see their C memory)
      end
    end)
    model:train()
    return all_avg(sum / math.max(n, 1))
  end

  local function save(at_step)
    if o.ckpt_every < 0 then return end
    if rank == 0 then
      os.execute("mkdir -p '" .. o.ckpt_dir:gsub("'", "'\\''") .. "'")
      local path = checkpoint.save(checkpoint.path(o.ckpt_dir, at_step),
        { model = model, optimizer = opt, sampler = train, step = at_step })
      log("gpt: saved %s", path)
    end
    if world > 1 then dist.barrier() end
  end

  if step == 0 or step >= o.steps then log("step %5d | val loss %.4f", step, evaluate()) end

  engine.reset_peak_memory()
  local t_log, n_log = engine.time(), 0
  local times = {}
  while step < o.steps do
    local t0 = engine.time()
    local lr = o.lr * lr_at(step)
    for _, g in ipairs(opt.param_groups) do g.lr = lr end
    local x, y = train:next()
    local loss = F.cross_entropy(model(x), y)
    loss:backward()
    if world > 1 then
      for _, p in ipairs(params) do dist.all_reduce(p.grad, "avg") end
    end
    local gnorm = o.grad_clip > 0 and optim.clip_grad_norm_(params, o.grad_clip) or optim.grad_norm(params)
    opt:step()
    opt:zero_grad()
    local l = all_avg(loss:item())
    if l ~= l or l == math.huge then -- the same on every rank (averaged): all stop together
      error(string.format("gpt: the loss is %s at step %d (lr %.3e): training diverged; lower --lr, raise " ..
        "--warmup or --grad_clip, or resume from an earlier checkpoint", tostring(l), step + 1, lr), 0)
    end
    loss = nil
    step = step + 1
    times[#times + 1] = engine.time() - t0
    n_log = n_log + 1
    if step % o.log_every == 0 or step == o.steps then
      local dt = (engine.time() - t_log) / n_log
      log("step %5d | loss %.6f | lr %.3e | grad norm %.4f | %.1f ms/step | %.0f tok/s | peak %.1f MiB",
        step, l, lr, gnorm, dt * 1e3, world * o.batch * o.seq / dt,
        engine.memory_stats().peak_allocated / 2 ^ 20)
      t_log, n_log = engine.time(), 0
    end
    if o.eval_every > 0 and step % o.eval_every == 0 and step ~= o.steps then
      local te = engine.time()
      log("step %5d | val loss %.4f | (eval %.1f s)", step, evaluate(), engine.time() - te)
      t_log = t_log + (engine.time() - te)
    end
    if o.ckpt_every > 0 and step % o.ckpt_every == 0 and step ~= o.steps then save(step) end
  end
  if #times > 0 then
    log("step %5d | val loss %.4f", step, evaluate())
    log("gpt: median %.1f ms/step over %d steps (%.0f tok/s)", median(times) * 1e3, #times,
      world * o.batch * o.seq / median(times))
    if o.ckpt_every >= 0 then save(step) end
  end

  -- a sample from rank 0 (seeded: the same run prints the same text)
  if o.sample_len > 0 and rank == 0 then
    model:eval()
    engine.manual_seed(o.seed + 1)
    local ids = data.encode(o.prompt)
    if #ids == 0 then ids = { 10 } end
    engine.no_grad(function()
      for _ = 1, o.sample_len do
        local ctx = {}
        for i = math.max(1, #ids - o.seq + 1), #ids do ctx[#ctx + 1] = ids[i] end
        local logits = model(engine.tensor({ ctx })) -- [1, t, 256]
        local last = logits:narrow(2, #ctx, 1):tolist_flat()
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
    log("gpt: sample (temperature %g):\n%s\n", o.temperature, data.decode(ids))
  end
end

main(arg and { unpack(arg, 1, #arg) } or {})
