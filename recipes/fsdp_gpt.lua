-- recipes/fsdp_gpt.lua: the KJV GPT of recipes/gpt.lua (common_dtensor.py's Transformer, byte tokens) trained with
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
-- --temperature --prompt --log_exact --device (cpu or cuda: one GPU per rank, NCCL)), and
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
-- the options, logging, validation, checkpoints, loop and sample shared with recipes/gpt.lua
local C = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/common.lua")

-- recipes/gpt_2d.lua runs this file with FSDP_GPT = {name = "gpt_2d", defaults = {tp = 2, sp = 0}, two_d = true}:
-- the extra options --tp (ranks per tensor-parallel group) and --sp (sequence parallelism), always on a (dp, tp)
-- mesh ((replicate, shard, tp) with --hsdp): TP (models.Transformer.parallelize on mesh["tp"]) under FSDP on the
-- data-parallel dims.  Without FSDP_GPT this recipe has neither option and its 1-D / HSDP mesh.
local CFG = rawget(_G, "FSDP_GPT")
local NAME = CFG and CFG.name or "fsdp_gpt"

local options = {
  { "reshard_after_forward", "true", "true: free each block's unsharded parameters after its forward and "
    .. "all-gather them again in backward; false: keep them until backward; N: keep an N-rank sharding after forward",
    group = "parallel" },
  { "param_dtype", "", "mixed precision: compute in this dtype (e.g. bf16); empty: off", group = "parallel",
    choices = { "", "f32", "bf16", "f16", "f64" } },
  { "reduce_dtype", "", "mixed precision: reduce-scatter gradients in this dtype; empty: off", group = "parallel",
    choices = { "", "f32", "bf16", "f16", "f64" } },
  { "hsdp", 1, "R > 1: a 2-D mesh of R replicas x W/R shards (HSDP); 1: a 1-D mesh", group = "parallel", int = true,
    min = 1 },
  { "grad_accum", 1, "microbatches of --batch rows per step (gradients reduce-scattered once per step)",
    group = "parallel", int = true, min = 1 },
}
if CFG and (CFG.two_d or CFG.tp_option) then
  options[#options + 1] = { "tp", 2, "ranks per tensor-parallel group", group = "parallel", int = true, min = 1 }
  options[#options + 1] = { "sp", 0, "1: sequence parallelism with TP", group = "parallel", int = true,
    choices = { 0, 1 } }
end
for _, opt in ipairs(CFG and CFG.options or {}) do options[#options + 1] = opt end
for k, v in pairs(CFG and CFG.defaults or {}) do options[#options + 1] = { k, v } end
options = C.options(options)

local DESCRIPTION = CFG and CFG.description or "The KJV GPT of recipes/gpt.lua trained with fully sharded data "
  .. "parallelism (dist.fully_shard, PyTorch's FSDP2): mpirun -np N build/engine recipes/fsdp_gpt.lua."

local function parse_args(argv)
  local o, given = C.parse(NAME, options, argv, DESCRIPTION)
  o.tp, o.sp = o.tp or 1, o.sp or 0
  local raf = o.reshard_after_forward
  if raf == "true" then o.raf = true
  elseif raf == "false" then o.raf = false
  elseif tonumber(raf) and tonumber(raf) >= 1 and tonumber(raf) % 1 == 0 then o.raf = tonumber(raf)
  else C.usage_error(NAME, "--reshard_after_forward must be true, false or a rank count N, got '%s'", raf) end
  return o, given
end

-- bytes of this rank's part of a tensor (the local shard of a DTensor)
local function local_bytes(t)
  if t == nil or not engine.is_tensor(t) then return 0 end
  if dist.is_dtensor(t) then t = t:to_local() end
  return t:numel() * t:element_size()
end

local function main(argv)
  local o, given = parse_args(argv)
  C.check_device(NAME, o)
  dist.init()
  local rank, world = dist.rank(), dist.world_size()
  C.set_threads(o.threads, world)

  -- the mesh: 1-D over the world, or HSDP (replicate, shard); with FSDP_GPT.two_d (recipes/gpt_2d.lua) a
  -- (dp, tp) mesh, or (replicate, shard, tp) with --hsdp: FSDP on the data-parallel dims, TP on "tp"
  local tp = o.tp
  local two_d = (CFG and CFG.two_d) or tp > 1
  if world % tp ~= 0 then C.usage_error(NAME, "--tp=%d does not divide the %d ranks", tp, world) end
  local dpw = world / tp     -- data-parallel ranks: the size of the FSDP mesh
  if dpw % o.hsdp ~= 0 then
    if tp == 1 then C.usage_error(NAME, "--hsdp=%d does not divide the %d ranks", o.hsdp, world) end
    C.usage_error(NAME, "--hsdp=%d does not divide the %d data-parallel ranks (%d ranks / --tp=%d)", o.hsdp, dpw, world,
      tp)
  end
  if o.sp == 1 and tp == 1 then C.usage_error(NAME, "--sp=1 needs tensor parallelism (--tp=N > 1)") end
  if o.sp == 1 and o.seq % tp ~= 0 then
    C.usage_error(NAME, "--sp=1 shards the sequence: --seq=%d must be divisible by --tp=%d", o.seq, tp)
  end
  local R = C.start(NAME, o, given)   -- the run folder (--out), --resume's config, config.json
  local log = function(...) R:log(...) end
  local mesh, root_mesh, tp_mesh
  local dp_rank = rank           -- this rank's place among the data-parallel ranks (which rows it reads)
  if two_d and o.hsdp > 1 then
    root_mesh = dist.init_device_mesh(o.device, { o.hsdp, dpw / o.hsdp, tp }, { "replicate", "shard", "tp" })
    mesh, tp_mesh = root_mesh{ "replicate", "shard" }, root_mesh["tp"]
    dp_rank = root_mesh:get_local_rank("replicate") * (dpw / o.hsdp) + root_mesh:get_local_rank("shard")
  elseif two_d then
    root_mesh = dist.init_device_mesh(o.device, { dpw, tp }, { "dp", "tp" })
    mesh, tp_mesh = root_mesh["dp"], root_mesh["tp"]
    dp_rank = root_mesh:get_local_rank("dp")
  elseif o.hsdp > 1 then
    mesh = dist.init_device_mesh(o.device, { o.hsdp, world / o.hsdp }, { "replicate", "shard" })
  else
    mesh = dist.init_device_mesh(o.device, { world }, { "shard" })
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
    model = nn.Transformer{ n_layers = o.n_layers, dim = o.dim, n_heads = o.n_heads, vocab_size = o.vocab_size,
      max_seq_len = o.seq, dropout_p = o.dropout }
    C.init_weights(model, o.n_layers)
  end
  local n_params = model:num_parameters()
  -- --act_ckpt: the blocks marked for activation checkpointing (in place), before TP and FSDP (as torchtitan)
  local n_ac = C.apply_act_ckpt(model, o)
  if o.device ~= "cpu" then model:to(o.device) end -- every parameter and buffer on the GPU before sharding
  -- 2-D: tensor parallelism first (each rank keeps its tp shard), then FSDP shards those over the dp dims
  if two_d then
    if CFG and CFG.parallelize then CFG.parallelize(model, tp_mesh, o)
    else nn.Transformer.parallelize(model, tp_mesh, { use_seq_parallel = o.sp == 1 }) end
  end
  local fsdp_opts = { mesh = mesh, reshard_after_forward = o.raf, mp_policy = mp }
  for _, block in ipairs(model.layers:children()) do dist.fully_shard(block, fsdp_opts) end
  -- the root takes the default reshard_after_forward: it keeps its parameters after forward (its backward
  -- would all-gather them at once; an explicit value would reshard it too, as FSDP2 does)
  dist.fully_shard(model, { mesh = mesh, mp_policy = mp })
  model:train()
  local params = model:parameters()
  local opt = optim.AdamW(params, { lr = o.lr, betas = { o.beta1, o.beta2 }, eps = 1e-8,
    weight_decay = o.weight_decay })
  local lr_at = optim.lr_scheduler.warmup_cosine_lambda({ warmup_steps = o.warmup, max_steps = o.steps,
    min_lr_ratio = o.min_lr_ratio })

  -- data: each rank draws batch x grad_accum rows per step (its rows of the global batch)
  local rows = o.batch * o.grad_accum
  -- (with TP: per data-parallel rank; the tp ranks of one dp row read the same rows)
  local train = data.BatchSampler(C.read_shards(NAME, o.train), { batch_size = rows, seq_len = o.seq,
    seed = o.seed, rank = dp_rank, world_size = dpw })
  local val_shard = C.read_shards(NAME, o.val, "val")
  local val = data.ValLoader(val_shard, { batch_size = o.batch, seq_len = o.seq, rank = dp_rank,
    world_size = dpw, max_batches = o.eval_batches })
  local tokens_per_step = dpw * rows * o.seq

  log(NAME .. ": %d params (%d layers, dim %d, %d heads, seq %d, vocab %d), %d " .. (two_d and "dp " or "")
    .. "rank(s) x %d microbatch(es) x "
    .. "batch %d = %d tokens/step, %d steps, lr %g (warmup %d, cosine to %g), wd %g, clip %g, seed %d, threads %d, "
    .. "BLAS %s", n_params, o.n_layers, o.dim, o.n_heads, o.seq, o.vocab_size, dpw, o.grad_accum, o.batch, tokens_per_step,
    o.steps, o.lr, o.warmup, o.min_lr_ratio * o.lr, o.weight_decay, o.grad_clip, o.seed, engine.get_num_threads(),
    engine.blas_core() .. ", GEMM " .. engine.gemm_library())
  if two_d then
    log(NAME .. ": mesh %s: tensor parallel over %d rank(s)%s on mesh[\"tp\"] %s, data parallel over %d",
      tostring(root_mesh), tp, o.sp == 1 and " with sequence parallelism" or "", tostring(tp_mesh), dpw)
  end
  if n_ac > 0 then
    log(NAME .. ": activation checkpointing (--act_ckpt=%s) of %d of %d blocks (the recompute all-gathers them "
      .. "again)", o.act_ckpt, n_ac, #model.layers:children())
  end
  log(NAME .. ": fully_shard of %d blocks + the root on mesh %s (%s), reshard_after_forward=%s, mixed precision %s",
    #model.layers:children(), tostring(mesh), o.hsdp > 1 and "HSDP: replicate x shard" or "FSDP",
    tostring(o.raf), mp and tostring(mp) or "off")
  log(NAME .. ": train %s (%d tokens), val %s (%d tokens, %d batches per evaluation)", o.train, train.total + o.seq,
    o.val, val_shard.n, val:num_batches())

  -- every rank evaluates its own validation batches (the forward all-gathers: the same count everywhere; the
  -- tp ranks of one dp row evaluate the same batches, so the average over all ranks is the dp average)
  local n_val = math.floor(C.all_reduce_num(val:num_batches(), "min"))

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
    rows_[rank + 1] = { pb, gb, ob, o.device == "cuda" and engine.cuda.memory_stats().peak_allocated
      or engine.memory_stats().peak_allocated }
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
  local ck = C.checkpointer{ name = NAME, log = log, rank = rank, model = model, opt = opt, sampler = train,
    dir = o.ckpt_dir, keep = o.ckpt_keep, async = o.ckpt_async == 1, config = C.config_json(o) }
  local step = 0
  if o.resume ~= "" then step = ck:resume(o.resume) end

  C.train{ name = NAME, o = o, log = log, run = R, flops_per_token = C.flops_per_token(model, o), model = model, opt = opt, params = params, train = train, step = step,
    lr_at = lr_at, tokens = tokens_per_step, ck = ck, save = function(at_step) ck:save(at_step) end,
    evaluate = function()
      return C.evaluate(model, val, function(x, y) return F.cross_entropy(model(x), y):item() end, n_val, o)
    end,
    backward = function(x, y)
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
      return l
    end,
    after_step = function(first) if first then log_shard_memory() end end,
    loss_value = C.all_reduce_num }   -- (the tp ranks of one dp row hold the same loss)

  -- a sample (seeded: the same run prints the same text); every rank runs the forward (it all-gathers) and
  -- draws the same tokens, rank 0 prints them; with --sp the context is padded on the right to a multiple of
  -- tp (causal attention: the padding does not change the logits read)
  if o.sample_len > 0 then
    local text = C.sample(o, model)
    log(NAME .. ": sample (temperature %g):\n%s\n", o.temperature, text)
    R:write("samples.txt", string.format("step %d, temperature %g, prompt %q:\n%s\n\n", o.steps, o.temperature,
      o.prompt, text), "a")
  end
  R:close()
end

main(arg and { unpack(arg, 1, #arg) } or {})
