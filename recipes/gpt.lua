-- recipes/gpt.lua: a byte-level GPT (the Transformer of PyTorch's common_dtensor.py) trained on the King James Bible.
--
--   build/engine tools/prepare_data.lua                       # data/kjv_{train,val}.bin (make data)
--   build/engine recipes/gpt.lua [--key=value ...]            # one process
--   mpirun -np 2 build/engine recipes/gpt.lua --threads=1     # data parallel over 2 ranks
--   make run ARGS="--steps=100"                               # the same through the Makefile
--
-- Options: `build/engine recipes/gpt.lua --help` lists every one with its default and meaning, in groups
-- (model, training, data, parallel, run, logging, checkpoint, sampling; the specs are `options` below and
-- C.options in recipes/common.lua); --key=value or --key value, or a --config file (.lua, .json, .toml).
-- Each run writes a run folder (--out, default runs/gpt-<date>-<time>): config.json (the resolved options),
-- log.txt, metrics.jsonl (a JSON line per logged step: loss, lr, grad norm, tokens/s, MFU, memory, ETA; and the
-- validation losses), checkpoints/ and samples.txt; --resume=<run folder> continues it with its saved options.
-- (recipes/tp_gpt.lua runs this recipe with --tp=0 as its default, recipes/dp_gpt.lua with --dtensor_dp=1;
-- recipes/llama.lua runs it with the Llama model)
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
-- averaged before clipping and the optimizer step: the global batch is batch x N.  Without TP or
-- --dtensor_dp the model is wrapped in dist.DistributedDataParallel: the gradients are averaged in buckets
-- of --bucket_cap_mb MiB (default PyTorch's: 25 after a first of 1), each bucket's all_reduce starting during backward as soon as its
-- gradients exist; the first and last log lines give the buckets, collectives and bytes per step.
-- Rank 0 logs and evaluates with the others (the validation batches are split over ranks); every rank
-- writes its part of a checkpoint (dist.checkpoint; replicated tensors once).  Resuming is exact:
-- model, AdamW state, RNG, sampler position and step are restored, so a resumed run prints the same
-- losses as an uninterrupted one (spec/recipe_spec.lua); at another world size (keep ranks x batch) or
-- --tp within 1e-6 (spec/checkpoint_recipe_spec.lua).
local engine = require("engine")
local nn, optim, data, dist = engine.nn, engine.optim, engine.data, engine.distributed
local checkpoint = require("engine.checkpoint")
local F = nn.functional
-- the options, logging, validation, checkpoints, loop and sample shared with recipes/fsdp_gpt.lua
local C = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/common.lua")

-- Another model through this recipe (recipes/llama.lua): GPT_MODEL = {name = "llama", defaults = {extra
-- options}, build = function(o) -> model (initialised), parallelize = function(model, tp_mesh, o),
-- describe = function(o) -> the model part of the first log line}.
local MODEL = rawget(_G, "GPT_MODEL")
local NAME = MODEL and MODEL.name or "gpt"

local options = {
  { "tp", 1, "tensor-parallel size: 1 none, 0 all ranks, N: N ranks per group, the rest data parallel on a "
    .. "{dp, tp} mesh", group = "parallel", int = true, min = 0 },
  { "sp", 0, "1: sequence parallelism with TP", group = "parallel", int = true, choices = { 0, 1 } },
  { "dtensor_dp", 0, "1: without TP, data parallelism through DTensors (Replicate parameters on a dp mesh, "
    .. "Shard(1) batches, gradients reduced by autograd)", group = "parallel", int = true, choices = { 0, 1 } },
  { "bucket_cap_mb", 0, "plain data parallelism: DistributedDataParallel's gradient bucket size in MiB (0: "
    .. "PyTorch's default, 25 MiB after a first bucket of 1 MiB)", group = "parallel", min = 0 },
  { "ckpt_format", "dcp", "dcp: distributed checkpoints (every rank its shards, step_%08d/, loadable at any "
    .. "world size or --tp); full: one safetensors file of full tensors (step_%08d.safetensors)",
    group = "checkpoint", choices = { "dcp", "full" } },
}
for _, opt in ipairs(MODEL and MODEL.options or {}) do options[#options + 1] = opt end
-- recipes/tp_gpt.lua sets GPT_DEFAULTS (e.g. {tp = 0}) before running this file: new defaults
for k, v in pairs(rawget(_G, "GPT_DEFAULTS") or {}) do options[#options + 1] = { k, v } end
options = C.options(options)

local DESCRIPTION = MODEL and MODEL.description or "A byte-level GPT (the Transformer of PyTorch's common_dtensor.py) "
  .. "trained on the King James Bible, on one process, data parallel (mpirun -np N), tensor parallel (--tp) or "
  .. "DTensor data parallel (--dtensor_dp=1)."

local function main(argv)
  local o, given = C.parse(NAME, options, argv, DESCRIPTION)
  C.check_device(NAME, o)
  dist.init()
  local rank, world = dist.rank(), dist.world_size()
  C.set_threads(o.threads, world)

  -- layout: tp ranks per tensor-parallel group, dp = world / tp groups of data parallelism
  local tp = o.tp == 0 and world or o.tp
  if world % tp ~= 0 then C.usage_error(NAME, "--tp=%d does not divide the %d ranks", tp, world) end
  local dp = math.floor(world / tp)
  if o.sp == 1 and tp == 1 then C.usage_error(NAME, "--sp=1 needs tensor parallelism (--tp=0 or --tp=N > 1)") end
  if o.sp == 1 and o.seq % tp ~= 0 then
    C.usage_error(NAME, "--sp=1 shards the sequence: --seq=%d must be divisible by the tp size %d", o.seq, tp)
  end
  local R = C.start(NAME, o, given)   -- the run folder (--out), --resume's config, config.json
  local log = function(...) R:log(...) end
  local mesh, dp_rank = nil, rank
  if tp > 1 then
    mesh = dist.init_device_mesh(o.device, { dp, tp }, { "dp", "tp" })
    dp_rank = mesh:get_local_rank("dp")
  end
  -- --dtensor_dp=1 without TP: Replicate DTensor parameters on a 1-D "dp" mesh, each rank's batch its
  -- Shard(1) rows of the global batch, gradients all-reduced by the DTensor autograd (recipes/dp_gpt.lua)
  local ddp = o.dtensor_dp == 1 and tp == 1 and world > 1
  if ddp then mesh = dist.init_device_mesh(o.device, { world }, { "dp" }) end

  -- model
  local function build()
    if MODEL then return MODEL.build(o) end
    local m = nn.Transformer{ n_layers = o.n_layers, dim = o.dim, n_heads = o.n_heads, vocab_size = o.vocab_size,
      max_seq_len = o.seq, dropout_p = o.dropout }
    C.init_weights(m, o.n_layers)
    return m
  end
  engine.manual_seed(o.seed)
  local model = build()
  -- --act_ckpt: the blocks marked for activation checkpointing (in place), before parallelizing (as torchtitan)
  local n_ac = C.apply_act_ckpt(model, o)
  if o.device ~= "cpu" then model:to(o.device) end -- before parallelizing: every parameter and buffer there
  if tp > 1 then
    if MODEL then MODEL.parallelize(model, mesh["tp"], o)
    else nn.Transformer.parallelize(model, mesh["tp"], { use_seq_parallel = o.sp == 1 }) end
  end
  if ddp then dist.replicate_parameters(model, mesh) end
  -- plain data parallelism: DistributedDataParallel's bucketed all_reduce during backward (the wrapper runs the
  -- forward; `model` stays the network for checkpoints, evaluation and sampling)
  local ddp_net = nil
  if tp == 1 and not ddp and world > 1 then
    -- the gradients are the buckets' slices: the all_reduce averages them in place (no copy out of the buckets)
    ddp_net = dist.DistributedDataParallel(model, { bucket_cap_mb = o.bucket_cap_mb > 0 and o.bucket_cap_mb or nil,
      gradient_as_bucket_view = true })
    local s = ddp_net:comm_stats()
    local total = 0
    for _, b in ipairs(s.bucket_bytes) do total = total + b end
    log(NAME .. ": DistributedDataParallel: %.2f MiB of gradients in one bucket for the first step, then in buckets "
      .. "of %s in the order backward produces them (PyTorch's rebuild)", total / 1048576,
      o.bucket_cap_mb > 0 and (o.bucket_cap_mb .. " MiB") or "25 MiB after a first of 1 MiB")
  end
  model:train()
  local params = model:parameters()
  local opt = optim.AdamW(params, { lr = o.lr, betas = { o.beta1, o.beta2 }, eps = 1e-8,
    weight_decay = o.weight_decay })
  local lr_at = optim.lr_scheduler.warmup_cosine_lambda({ warmup_steps = o.warmup, max_steps = o.steps,
    min_lr_ratio = o.min_lr_ratio })

  -- data
  -- (the ranks of one tp group read the same batches)
  local train = data.BatchSampler(C.read_shards(NAME, o.train), { batch_size = o.batch, seq_len = o.seq,
    seed = o.seed, rank = dp_rank, world_size = dp })
  local val_shard = C.read_shards(NAME, o.val, "val")
  local val = data.ValLoader(val_shard, { batch_size = o.batch, seq_len = o.seq, rank = dp_rank,
    world_size = dp, max_batches = o.eval_batches })

  log(NAME .. ": %d params (%s), %d rank(s) x batch %d = %d tokens/step, "
    .. "%d steps, lr %g (warmup %d, cosine to %g), wd %g, clip %g, seed %d, threads %d, BLAS %s",
    model:num_parameters(), MODEL and MODEL.describe(o) or string.format("%d layers, dim %d, %d heads, seq %d, vocab %d",
    o.n_layers, o.dim, o.n_heads, o.seq, o.vocab_size), dp, o.batch, dp * o.batch * o.seq,
    o.steps, o.lr, o.warmup, o.min_lr_ratio * o.lr, o.weight_decay, o.grad_clip, o.seed,
    engine.get_num_threads(), engine.blas_core() .. ", GEMM " .. engine.gemm_library())
  if n_ac > 0 then
    log(NAME .. ": activation checkpointing (--act_ckpt=%s) of %d of %d blocks", o.act_ckpt, n_ac,
      #model.layers:children())
  end
  if tp > 1 then
    log(NAME .. ": tensor parallel over %d ranks%s, data parallel over %d (mesh %s)", tp,
      o.sp == 1 and " with sequence parallelism" or "", dp, tostring(mesh))
  elseif ddp then
    log(NAME .. ": DTensor data parallel over %d rank(s) (Replicate parameters, Shard(1) batches, mesh %s)", world,
      tostring(mesh))
  end
  log(NAME .. ": train %s (%d tokens), val %s (%d tokens, %d batches per evaluation)", o.train, train.total + o.seq,
    o.val, val_shard.n, val:num_batches())

  -- Checkpoints hold full tensors.  With TP they pass through a plain copy of the model and its
  -- optimizer: full_tensor() of every parameter and state on save (rank 0 writes), and on resume each
  -- rank reads the file and keeps its shards.
  local ck_model, ck_opt = model, opt
  local to_full, from_full = function() end, function() end
  if mesh then
    local rng = engine.get_rng_state()
    ck_model = build()
    engine.set_rng_state(rng)
    ck_opt = optim.AdamW(ck_model:parameters(), { lr = o.lr, betas = { o.beta1, o.beta2 }, eps = 1e-8,
      weight_decay = o.weight_decay })
    local function map_state(sd, fn)
      local out = { param_groups = sd.param_groups, state = {} }
      local plist = {}
      for _, g in ipairs(opt.param_groups) do for _, p in ipairs(g.params) do plist[#plist + 1] = p end end
      for i = 0, #plist - 1 do               -- a fixed order: full_tensor is a collective
        local st = sd.state[i]
        if st then
          local keys, r = {}, {}
          for k in pairs(st) do keys[#keys + 1] = k end
          table.sort(keys)
          for _, k in ipairs(keys) do
            local v = st[k]
            r[k] = engine.is_tensor(v) and fn(v, plist[i + 1], k) or v
          end
          out.state[i] = r
        end
      end
      return out
    end
    to_full = function()
      engine.no_grad(function()
        for name, p in model:named_parameters() do
          ck_model:get_parameter(name):copy_(dist.is_dtensor(p) and p:full_tensor() or p)
        end
      end)
      ck_opt:load_state_dict(map_state(opt:state_dict(), function(v)
        return dist.is_dtensor(v) and v:full_tensor() or v
      end))
    end
    from_full = function()
      local function shard_like(full, p)
        if not dist.is_dtensor(p) then return full end
        return dist.distribute_tensor(full:detach(), p.device_mesh, p.placements, { src_data_rank = false })
      end
      engine.no_grad(function()
        for name, p in model:named_parameters() do
          local f = shard_like(ck_model:get_parameter(name), p)
          if dist.is_dtensor(p) then p:to_local():copy_(f:to_local()) else p:copy_(f) end
        end
      end)
      opt:load_state_dict(map_state(ck_opt:state_dict(), function(v, p, k)
        if k == "step" then return v end
        return shard_like(v, p)
      end))
    end
  end

  -- Distributed checkpoints (--ckpt_format=dcp): every rank saves its own shards of the model and the
  -- optimizer state (keyed by parameter names), plus the step, the RNG state and the data position; a
  -- load fills the current layout whatever the layout at save time (world size, --tp, --dtensor_dp).
  local ck = C.checkpointer{ name = NAME, log = log, rank = rank, model = model, opt = opt, sampler = train,
    dir = o.ckpt_dir, keep = o.ckpt_keep, async = o.ckpt_async == 1, config = C.config_json(o) }

  local step = 0
  if o.resume ~= "" then
    step = ck:resume(o.resume, function(dir)   -- the newest checkpoint of either format
      local p_dcp, s_dcp = dist.checkpoint.latest(dir)
      local p_full, s_full = checkpoint.latest(dir)
      if p_full and (not s_dcp or s_full > s_dcp) then return p_full end
      return p_dcp
    end, function(path)
      local info = checkpoint.load(path, { model = ck_model, optimizer = ck_opt, sampler = train })
      from_full()
      return info.step
    end)
  end

  -- the model on this rank's batch: with --dtensor_dp a plain batch is this rank's Shard(1) rows of the
  -- global one (shard = true) or the same on every rank (evaluation and sampling: Replicate, no
  -- collective); the model's own plain tensors (positions, rotary tables) count as Replicate
  local function forward(x, shard)
    if not ddp then return model(x) end
    if shard then x = dist.from_local(x, mesh, { dist.Shard(1) }) end
    return dist.implicit_replication(function() return model(x) end)
  end
  local function eval_loss(x, y)
    if not ddp then return F.cross_entropy(model(x), y):item() end
    return dist.implicit_replication(function() return F.cross_entropy(model(x), y) end):to_local():item()
  end

  local function save(at_step)
    if o.ckpt_format == "dcp" then return ck:save(at_step) end
    ck:finish()
    to_full()
    if rank == 0 then
      os.execute("mkdir -p '" .. o.ckpt_dir:gsub("'", "'\\''") .. "'")
      local path = checkpoint.save(checkpoint.path(o.ckpt_dir, at_step),
        { model = ck_model, optimizer = ck_opt, sampler = train, step = at_step, extra = { config = ck.config } })
      log(NAME .. ": saved %s", path)
    end
    ck.last = checkpoint.path(o.ckpt_dir, at_step)
    if world > 1 then dist.barrier() end
  end

  C.train{ name = NAME, o = o, log = log, run = R, flops_per_token = C.flops_per_token(model, o), model = model, opt = opt, params = params, train = train, step = step,
    lr_at = lr_at, tokens = dp * o.batch * o.seq, ck = ck, save = save,
    evaluate = function() return C.evaluate(model, val, eval_loss, nil, o) end,
    backward = function(x, y)
      local loss
      if ddp then
        loss = F.cross_entropy(forward(x, true), dist.from_local(y, mesh, { dist.Shard(1) }))  -- Partial: global mean
      else
        loss = F.cross_entropy((ddp_net or model)(x), y)
      end
      loss:backward() -- with ddp_net the gradients are averaged during backward
      if ddp then -- the gradients are already all-reduced (AccumulateGrad of Replicate parameters)
      elseif tp > 1 then
        if dp > 1 then dist.all_reduce_gradients(model, mesh["dp"]) end
      end
      return loss
    end,
    -- (the ranks of one tp group hold the same value)
    loss_value = function(loss) return ddp and loss:full_tensor():item() or C.all_reduce_num(loss:item()) end }

  if ddp_net then
    local s = ddp_net:comm_stats()
    log(NAME .. ": DistributedDataParallel: the last step all-reduced %.2f MiB of gradients in %d collective(s) "
      .. "(%d bucket(s))", s.bytes / 1048576, s.collectives, s.buckets)
  end

  -- a sample from rank 0 (seeded: the same run prints the same text); with TP every rank runs the
  -- forward (it is collective), with SP on a context padded on the right to a multiple of tp
  if o.sample_len > 0 and (rank == 0 or tp > 1) then
    local text = C.sample(o, model)
    log(NAME .. ": sample (temperature %g):\n%s\n", o.temperature, text)
    R:write("samples.txt", string.format("step %d, temperature %g, prompt %q:\n%s\n\n", o.steps, o.temperature,
      o.prompt, text), "a")
  end
  R:close()
end

main(arg and { unpack(arg, 1, #arg) } or {})
