-- recipes/fsdp_gpt.lua: the KJV GPT of recipes/gpt.lua (seed 003's Transformer, byte tokens) trained with
-- fully sharded data parallelism (dist.fully_shard, PyTorch's FSDP2): each transformer block and then the
-- root are fully sharded, so every rank holds 1/N of each parameter, gradient and AdamW state and
-- all-gathers one block at a time for its forward and backward.
--
--   build/engine tools/prepare_data.lua                             # data/kjv_{train,val}.bin (make data)
--   mpirun -np 2 build/engine recipes/fsdp_gpt.lua                  # FSDP over 2 ranks
--   mpirun -np 4 build/engine recipes/fsdp_gpt.lua --hsdp=2         # HSDP: mesh (2 replicas, 2 shards)
--   make run RECIPE=fsdp NP=2 ARGS="--steps=100"
--
-- Options: those of recipes/gpt.lua for the model, training, data, logging and sampling (--n_layers --dim
-- --n_heads --seq --dropout --batch --steps --lr --warmup --min_lr_ratio --weight_decay --beta1 --beta2
-- --grad_clip --seed --threads --train --val --log_every --eval_every --eval_batches --sample_len
-- --temperature --prompt --log_exact), and
--   --reshard_after_forward  true (default: free each block's unsharded parameters after its forward and
--                            all-gather them again in backward), false (keep them until backward), or N
--                            (keep an N-rank sharding after forward: the backward all-gather runs on N ranks)
--   --param_dtype --reduce_dtype  mixed precision (dist.MixedPrecisionPolicy): compute in param_dtype (e.g.
--                            bf16), reduce-scatter gradients in reduce_dtype; parameters, gradients and AdamW
--                            states stay f32 (empty: off)
--   --hsdp=R                 a 2-D mesh (R replicas, W/R shards): parameters sharded over W/R ranks and
--                            replicated over R (gradients reduce-scattered, then all-reduced); 1: 1-D mesh
--   --grad_accum=N           N microbatches of --batch rows per step; set_requires_gradient_sync(false) on
--                            all but the last, so gradients are reduce-scattered once per step
-- --batch is the rows per rank per microbatch: the global batch is batch x grad_accum x W, and the run
-- equals recipes/gpt.lua on one process with --batch=batch*grad_accum*W (same initial weights, the same
-- global batches: BatchSampler's rows of rank r are rows r*b..(r+1)*b-1 of one process's batch;
-- spec/dist/fsdp_recipe_spec.lua checks the losses to 1e-5).  Each rank feeds its own rows; the loss is
-- the local mean and FSDP divides the reduced gradients by the data-parallel size.
-- Logging (rank 0): step, loss, lr, grad norm, ms/step, tokens/s, peak memory; after the first step each
-- rank's bytes of local shards of parameters, gradients and optimizer state; validation loss (the val
-- batches split over ranks) and a sample (every rank runs the forward: it all-gathers).
-- Checkpoints (as recipes/gpt.lua's --ckpt_format=dcp): --ckpt_dir --ckpt_every (0: only at the end; -1:
-- never) --resume (a checkpoint directory, or "latest" in ckpt_dir) --ckpt_keep (the newest K; 0: all)
-- --ckpt_async (1: save in a background thread).  dist.checkpoint: every rank writes its own shards of the
-- model and AdamW state (keyed by parameter names: FSDP keeps them), plus the step, RNG state and data position;
-- a load fills the current layout whatever it was at save time (another world size, --hsdp, or recipes/gpt.lua
-- and recipes/tp_gpt.lua's dcp checkpoints), and resuming is exact (bit for bit at the same world size and layout;
-- spec/checkpoint_recipe_spec.lua).  A NaN or infinite loss stops the run naming the step and the last good
-- checkpoint (the newest saved or resumed from), as recipes/gpt.lua.
local engine = require("engine")
local nn, optim, data, dist = engine.nn, engine.optim, engine.data, engine.distributed
local F = nn.functional

local HOME = (ENGINE_HOME and ENGINE_HOME ~= "") and ENGINE_HOME or "."
-- recipes/gpt_2d.lua runs this file with FSDP_GPT = {name = "gpt_2d", defaults = {tp = 2, sp = 0}, two_d = true}:
-- the extra options --tp (ranks per tensor-parallel group) and --sp (sequence parallelism), always on a (dp, tp)
-- mesh ((replicate, shard, tp) with --hsdp): TP (models.Transformer.parallelize on mesh["tp"]) under FSDP on the
-- data-parallel dims.  Without FSDP_GPT this recipe has neither option and its 1-D / HSDP mesh.
local CFG = rawget(_G, "FSDP_GPT")
local NAME = CFG and CFG.name or "fsdp_gpt"

local defaults = {
  n_layers = 4, dim = 256, n_heads = 4, seq = 128, dropout = 0.0,
  batch = 8, steps = 600, lr = 2e-3, warmup = 30, min_lr_ratio = 0.1, weight_decay = 0.1,
  beta1 = 0.9, beta2 = 0.95, grad_clip = 1.0, seed = 1337, threads = 0,
  train = HOME .. "/data/kjv_train.bin", val = HOME .. "/data/kjv_val.bin",
  log_every = 10, eval_every = 100, eval_batches = 20,
  ckpt_dir = HOME .. "/checkpoints", ckpt_every = 0, resume = "", ckpt_keep = 0, ckpt_async = 0,
  sample_len = 300, temperature = 0.8, prompt = "And God said",
  reshard_after_forward = "true", param_dtype = "", reduce_dtype = "", hsdp = 1, grad_accum = 1, log_exact = 0,
}
for k, v in pairs(CFG and CFG.defaults or {}) do defaults[k] = v end

local function parse_args(argv)
  local o = {}
  for k, v in pairs(defaults) do o[k] = v end
  for _, a in ipairs(argv) do
    local k, v = a:match("^%-%-([%w_]+)=(.*)$")
    if not k then error(NAME .. ": bad argument '" .. a .. "' (expected --key=value)", 0) end
    local d = defaults[k]
    if d == nil then
      local names = {}
      for n in pairs(defaults) do names[#names + 1] = n end
      table.sort(names)
      error(NAME .. ": unknown option --" .. k .. " (options: " .. table.concat(names, ", ") .. ")", 0)
    end
    if type(d) == "number" then
      o[k] = tonumber(v) or error(NAME .. ": --" .. k .. " must be a number, got '" .. v .. "'", 0)
    else
      o[k] = v
    end
  end
  for _, k in ipairs({ "n_layers", "dim", "n_heads", "seq", "batch", "steps", "log_every", "eval_batches", "hsdp",
    "grad_accum", "tp" }) do
    if o[k] ~= nil and (o[k] < 1 or o[k] % 1 ~= 0) then error(NAME .. ": --" .. k .. " must be a positive integer", 0) end
  end
  o.tp, o.sp = o.tp or 1, o.sp or 0
  if o.sp ~= 0 and o.sp ~= 1 then error(NAME .. ": --sp must be 0 or 1", 0) end
  if o.warmup < 0 then error(NAME .. ": --warmup must be >= 0", 0) end
  if o.ckpt_keep < 0 or o.ckpt_keep % 1 ~= 0 then error(NAME .. ": --ckpt_keep must be a non-negative integer", 0) end
  if o.ckpt_async ~= 0 and o.ckpt_async ~= 1 then error(NAME .. ": --ckpt_async must be 0 or 1", 0) end
  if o.log_exact ~= 0 and o.log_exact ~= 1 then error(NAME .. ": --log_exact must be 0 or 1", 0) end
  local raf = o.reshard_after_forward
  if raf == "true" then o.raf = true
  elseif raf == "false" then o.raf = false
  elseif tonumber(raf) and tonumber(raf) >= 1 and tonumber(raf) % 1 == 0 then o.raf = tonumber(raf)
  else error(NAME .. ": --reshard_after_forward must be true, false or a rank count N, got '" .. raf .. "'", 0) end
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

-- recipes/gpt.lua's GPT-2 style initialisation (the same weights as that recipe for the same seed)
local function init_weights(model, n_layers)
  for name, p in model:named_parameters() do
    if name:match("norm%.weight$") then nn.init.ones_(p)
    elseif name:match("bias$") then nn.init.zeros_(p)
    elseif name:match("attention%.wo%.weight$") or name:match("feed_forward%.w2%.weight$") then
      nn.init.normal_(p, 0, 0.02 / math.sqrt(2 * n_layers))
    else nn.init.normal_(p, 0, 0.02) end
  end
end

-- bytes of this rank's part of a tensor (the local shard of a DTensor)
local function local_bytes(t)
  if t == nil or not engine.is_tensor(t) then return 0 end
  if dist.is_dtensor(t) then t = t:to_local() end
  return t:numel() * t:element_size()
end

-- recipes/gpt.lua's digest of the parameters (each full tensor's checksum in name order, FNV-1a): the same
-- bits give the same digest whatever the layout.  Collective (full_tensor).
local function parameter_digest(model)
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

  -- the mesh: 1-D over the world, or HSDP (replicate, shard); with FSDP_GPT.two_d (recipes/gpt_2d.lua) a
  -- (dp, tp) mesh, or (replicate, shard, tp) with --hsdp: FSDP on the data-parallel dims, TP on "tp"
  local tp = o.tp
  local two_d = (CFG and CFG.two_d) or tp > 1
  if world % tp ~= 0 then error(string.format(NAME .. ": --tp=%d does not divide the %d ranks", tp, world), 0) end
  local dpw = world / tp     -- data-parallel ranks: the size of the FSDP mesh
  if dpw % o.hsdp ~= 0 then
    if tp == 1 then error(string.format(NAME .. ": --hsdp=%d does not divide the %d ranks", o.hsdp, world), 0) end
    error(string.format(NAME .. ": --hsdp=%d does not divide the %d data-parallel ranks (%d ranks / --tp=%d)", o.hsdp,
      dpw, world, tp), 0)
  end
  if o.sp == 1 and tp == 1 then error(NAME .. ": --sp=1 needs tensor parallelism (--tp=N > 1)", 0) end
  if o.sp == 1 and o.seq % tp ~= 0 then
    error(string.format(NAME .. ": --sp=1 shards the sequence: --seq=%d must be divisible by --tp=%d", o.seq, tp), 0)
  end
  local mesh, root_mesh, tp_mesh
  local dp_rank = rank           -- this rank's place among the data-parallel ranks (which rows it reads)
  if two_d and o.hsdp > 1 then
    root_mesh = dist.init_device_mesh("cpu", { o.hsdp, dpw / o.hsdp, tp }, { "replicate", "shard", "tp" })
    mesh, tp_mesh = root_mesh{ "replicate", "shard" }, root_mesh["tp"]
    dp_rank = root_mesh:get_local_rank("replicate") * (dpw / o.hsdp) + root_mesh:get_local_rank("shard")
  elseif two_d then
    root_mesh = dist.init_device_mesh("cpu", { dpw, tp }, { "dp", "tp" })
    mesh, tp_mesh = root_mesh["dp"], root_mesh["tp"]
    dp_rank = root_mesh:get_local_rank("dp")
  elseif o.hsdp > 1 then
    mesh = dist.init_device_mesh("cpu", { o.hsdp, world / o.hsdp }, { "replicate", "shard" })
  else
    mesh = dist.init_device_mesh("cpu", { world }, { "shard" })
  end
  local mp
  if o.param_dtype ~= "" or o.reduce_dtype ~= "" then
    mp = dist.MixedPrecisionPolicy{ param_dtype = o.param_dtype ~= "" and o.param_dtype or nil,
      reduce_dtype = o.reduce_dtype ~= "" and o.reduce_dtype or nil }
  end

  -- the model: recipes/gpt.lua's (same seed, same weights on every rank), then each block and the root sharded
  engine.manual_seed(o.seed)
  local model
  if CFG and CFG.build then   -- another model (recipes/llama.lua --fsdp=1): its own build and TP plan
    model = CFG.build(o)
  else
    model = nn.Transformer{ n_layers = o.n_layers, dim = o.dim, n_heads = o.n_heads, vocab_size = 256,
      max_seq_len = o.seq, dropout_p = o.dropout }
    init_weights(model, o.n_layers)
  end
  local n_params = model:num_parameters()
  -- 2-D: tensor parallelism first (each rank keeps its tp shard), then FSDP shards those over the dp dims
  if two_d then
    if CFG and CFG.parallelize then CFG.parallelize(model, tp_mesh, o)
    else nn.Transformer.parallelize(model, tp_mesh, { use_seq_parallel = o.sp == 1 }) end
  end
  local fsdp_opts = { mesh = mesh, reshard_after_forward = o.raf, mp_policy = mp }
  for _, block in ipairs(model.layers:children()) do dist.fully_shard(block, fsdp_opts) end
  dist.fully_shard(model, fsdp_opts)
  model:train()
  local params = model:parameters()
  local opt = optim.AdamW(params, { lr = o.lr, betas = { o.beta1, o.beta2 }, eps = 1e-8,
    weight_decay = o.weight_decay })
  local lr_at = optim.lr_scheduler.warmup_cosine_lambda({ warmup_steps = o.warmup, max_steps = o.steps,
    min_lr_ratio = o.min_lr_ratio })

  -- data: each rank draws batch x grad_accum rows per step (its rows of the global batch)
  local rows = o.batch * o.grad_accum
  -- (with TP: per data-parallel rank; the tp ranks of one dp row read the same rows)
  local train = data.BatchSampler(data.read_shard(o.train), { batch_size = rows, seq_len = o.seq,
    seed = o.seed, rank = dp_rank, world_size = dpw })
  local val_shard = data.read_shard(o.val)
  local val = data.ValLoader(val_shard, { batch_size = o.batch, seq_len = o.seq, rank = dp_rank,
    world_size = dpw, max_batches = o.eval_batches })
  local tokens_per_step = dpw * rows * o.seq

  log(NAME .. ": %d params (%d layers, dim %d, %d heads, seq %d, vocab 256), %d " .. (two_d and "dp " or "")
    .. "rank(s) x %d microbatch(es) x "
    .. "batch %d = %d tokens/step, %d steps, lr %g (warmup %d, cosine to %g), wd %g, clip %g, seed %d, threads %d, "
    .. "BLAS %s", n_params, o.n_layers, o.dim, o.n_heads, o.seq, dpw, o.grad_accum, o.batch, tokens_per_step,
    o.steps, o.lr, o.warmup, o.min_lr_ratio * o.lr, o.weight_decay, o.grad_clip, o.seed, engine.get_num_threads(),
    engine.blas_corename())
  if two_d then
    log(NAME .. ": mesh %s: tensor parallel over %d rank(s)%s on mesh[\"tp\"] %s, data parallel over %d",
      tostring(root_mesh), tp, o.sp == 1 and " with sequence parallelism" or "", tostring(tp_mesh), dpw)
  end
  log(NAME .. ": fully_shard of %d blocks + the root on mesh %s (%s), reshard_after_forward=%s, mixed precision %s",
    #model.layers:children(), tostring(mesh), o.hsdp > 1 and "HSDP: replicate x shard" or "FSDP",
    tostring(o.raf), mp and tostring(mp) or "off")
  log(NAME .. ": train %s (%d tokens), val %s (%d tokens, %d batches per evaluation)", o.train, train.total + o.seq,
    o.val, val_shard.n, val:num_batches())

  local function all_reduce_num(x, op)
    if world == 1 then return x end
    local t = engine.tensor({ x }, "f64")
    dist.all_reduce(t, op or "avg")
    return t:item()
  end

  -- every rank evaluates its own validation batches (the forward all-gathers: the same count everywhere; the
  -- tp ranks of one dp row evaluate the same batches, so the average over all ranks is the dp average)
  local n_val = math.floor(all_reduce_num(val:num_batches(), "min"))
  local function evaluate()
    model:eval()
    local sum, n = 0, 0
    engine.no_grad(function()
      for x, y in val:batches() do
        if n >= n_val then break end
        sum = sum + F.cross_entropy(model(x), y):item()
        n = n + 1
      end
    end)
    model:train()
    return all_reduce_num(sum / math.max(n, 1))
  end

  -- each rank's bytes of local shards (parameters, gradients, AdamW states), printed by rank 0
  local function log_shard_memory()
    local pb, gb, ob = 0, 0, 0
    for _, p in ipairs(params) do
      pb = pb + local_bytes(p)
      gb = gb + local_bytes(p.grad)
      for _, v in pairs(opt.state[p] or {}) do ob = ob + local_bytes(v) end
    end
    local rows_ = {}
    for r = 1, world do rows_[r] = { 0, 0, 0, 0 } end
    rows_[rank + 1] = { pb, gb, ob, engine.memory_stats().peak_allocated }
    local t = engine.tensor(rows_, "f64")
    if world > 1 then dist.all_reduce(t, "sum") end
    local v = t:totable()
    for r = 1, world do
      log(NAME .. ": rank %d local shards: parameters %.2f MiB, gradients %.2f MiB, optimizer state %.2f MiB "
        .. "(%.2f MiB; unsharded f32 model + grads + AdamW: %.2f MiB); peak %.1f MiB", r - 1, v[r][1] / 2 ^ 20,
        v[r][2] / 2 ^ 20, v[r][3] / 2 ^ 20, (v[r][1] + v[r][2] + v[r][3]) / 2 ^ 20, 16 * n_params / 2 ^ 20,
        v[r][4] / 2 ^ 20)
    end
  end

  -- distributed checkpoints: each rank its shards (recipes/gpt.lua's --ckpt_format=dcp)
  local dcp = dist.checkpoint
  local function dcp_state(at_step)
    return { model = model:state_dict(), optim = dcp.get_optimizer_state_dict(model, opt), step = at_step,
      rng = engine.get_rng_state(), data = train:state() }
  end
  local step = 0
  local last_ckpt = nil    -- the newest checkpoint saved or resumed from (named when training diverges)
  if o.resume ~= "" then
    local path = o.resume
    if path == "latest" then
      path = dcp.latest(o.ckpt_dir)
      if not path then error(NAME .. ": --resume=latest: no checkpoint in " .. o.ckpt_dir, 0) end
    end
    local st = dcp_state(0)
    dcp.load(st, path)
    dcp.set_optimizer_state_dict(model, opt, st.optim)
    engine.set_rng_state(st.rng)
    train:set_state(st.data)
    step = st.step
    last_ckpt = path
    log(NAME .. ": resumed from %s at step %d", path, step)
  end
  local pending_save = nil   -- an async save in flight: finished (collectively) before the next one
  local function finish_save()
    if pending_save then
      pending_save.h:wait()
      pending_save.done()
      pending_save = nil
    end
  end
  local function save(at_step)
    if o.ckpt_every < 0 then return end
    finish_save()
    local path = dcp.path(o.ckpt_dir, at_step)
    local h = dcp.save(dcp_state(at_step), path, { async = o.ckpt_async == 1 })
    local function done()
      last_ckpt = path
      log(NAME .. ": saved %s", path)
      if o.ckpt_keep > 0 and rank == 0 then dcp.prune(o.ckpt_dir, o.ckpt_keep) end
    end
    if o.ckpt_async == 1 then pending_save = { h = h, done = done } else done() end
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
    local l = 0
    for k = 1, o.grad_accum do
      -- gradients reduce-scattered only on the last microbatch (accumulated unsharded before that)
      if o.grad_accum > 1 then model:set_requires_gradient_sync(k == o.grad_accum) end
      local xk, yk = x, y
      if o.grad_accum > 1 then
        xk, yk = x:narrow(1, (k - 1) * o.batch + 1, o.batch), y:narrow(1, (k - 1) * o.batch + 1, o.batch)
      end
      local loss = F.cross_entropy(model(xk), yk)
      if o.grad_accum > 1 then loss = loss * (1 / o.grad_accum) end
      loss:backward()
      l = l + loss:item()
    end
    local gnorm = o.grad_clip > 0 and optim.clip_grad_norm_(params, o.grad_clip) or optim.grad_norm(params)
    opt:step()
    if #times == 0 then log_shard_memory() end
    opt:zero_grad()
    l = all_reduce_num(l)   -- (the tp ranks of one dp row hold the same loss)
    if l ~= l or l == math.huge or l == -math.huge then -- the same on every rank (averaged): all stop together
      finish_save()
      error(string.format(NAME .. ": the loss is %s at step %d (lr %.3e): training diverged; lower --lr, raise "
        .. "--warmup or --grad_clip, or resume from an earlier checkpoint (last good checkpoint: %s)", tostring(l),
        step + 1, lr, last_ckpt or "none"), 0)
    end
    step = step + 1
    times[#times + 1] = engine.time() - t0
    n_log = n_log + 1
    if step % o.log_every == 0 or step == o.steps then
      local dt = (engine.time() - t_log) / n_log
      log("step %5d | loss " .. (o.log_exact == 1 and "%.17g" or "%.6f") .. " | lr %.3e | grad norm %.4f | %.1f ms/step "
        .. "| %.0f tok/s | peak %.1f MiB", step, l, lr, gnorm, dt * 1e3, tokens_per_step / dt, engine.memory_stats().peak_allocated / 2 ^ 20)
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
    log(NAME .. ": median %.1f ms/step over %d steps (%.0f tok/s)", median(times) * 1e3, #times,
      tokens_per_step / median(times))
    save(step)
  end
  finish_save()
  if o.log_exact == 1 then log(NAME .. ": parameter digest %s", parameter_digest(model)) end

  -- a sample (seeded: the same run prints the same text); every rank runs the forward (it all-gathers) and
  -- draws the same tokens, rank 0 prints them; with --sp the context is padded on the right to a multiple of
  -- tp (causal attention: the padding does not change the logits read)
  if o.sample_len > 0 then
    model:eval()
    engine.manual_seed(o.seed + 1)
    local ids = data.encode(o.prompt)
    if #ids == 0 then ids = { 10 } end
    engine.no_grad(function()
      for _ = 1, o.sample_len do
        local ctx = {}
        for i = math.max(1, #ids - o.seq + 1), #ids do ctx[#ctx + 1] = ids[i] end
        local n = #ctx
        if o.sp == 1 then while #ctx % tp ~= 0 do ctx[#ctx + 1] = 10 end end
        local logits = model(engine.tensor({ ctx })) -- [1, t, 256]
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
    log(NAME .. ": sample (temperature %g):\n%s\n", o.temperature, data.decode(ids))
  end
end

main(arg and { unpack(arg, 1, #arg) } or {})
