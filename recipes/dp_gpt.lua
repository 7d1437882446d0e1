-- recipes/dp_gpt.lua: data-parallel training of the byte-level GPT (common_dtensor.py's Transformer) with
-- DTensors: Replicate parameters, the batch dim of the tokens sharded (Shard(1)), the loss a
-- Partial(sum) DTensor (local sum / global token count), gradients all-reduced by the DTensor
-- autograd (AccumulateGrad redistributes each Partial gradient to its Replicate parameter).
-- Compare recipes/gpt.lua, which does the same with plain tensors and explicit all_reduce calls.
--
--   mpirun -np 2 build/engine recipes/dp_gpt.lua [--key=value ...]     # rank 0 prints the loss
--   build/engine recipes/dp_gpt.lua --steps=20                          # one process (mesh of 1)
--
-- Options: --n_layers --dim --n_heads --seq --batch (per rank) --steps --lr --weight_decay
-- --grad_clip --seed --log_every --threads --train (llm.c token shard, byte tokens; default
-- data/kjv_train.bin from tools/prepare_data.lua) --ckpt_dir (distributed checkpoints in step_%08d/
-- there; empty: none) --ckpt_every (0: at the end only) --ckpt_keep (newest K; 0: all) --resume (a
-- checkpoint directory or "latest").  Each rank draws its own batches (BatchSampler
-- with rank/world_size) and contributes them as its shard of the global batch (DTensor.from_local),
-- so the global batch is batch x ranks.  The model makes its positions with engine.arange (a plain
-- tensor): the forward runs inside dist.implicit_replication, where plain tensors count as Replicate.
local engine = require("engine")
local nn, optim, data, dist = engine.nn, engine.optim, engine.data, engine.distributed
local F = nn.functional
-- distributed checkpoints as recipes/gpt.lua's (recipes/common.lua)
local C = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/common.lua")

local HOME = (ENGINE_HOME and ENGINE_HOME ~= "") and ENGINE_HOME or "."

local defaults = {
  n_layers = 2, dim = 64, n_heads = 4, seq = 64, batch = 4, steps = 50, lr = 2e-3, weight_decay = 0.1,
  grad_clip = 1.0, seed = 1337, log_every = 10, threads = 0, train = HOME .. "/data/kjv_train.bin",
  ckpt_dir = "", ckpt_every = 0, ckpt_keep = 0, resume = "",
}

local function parse_args(argv)
  local o = {}
  for k, v in pairs(defaults) do o[k] = v end
  for _, a in ipairs(argv) do
    local k, v = a:match("^%-%-([%w_]+)=(.*)$")
    if not k or defaults[k] == nil then
      local names = {}
      for n in pairs(defaults) do names[#names + 1] = n end
      table.sort(names)
      error("dp_gpt: bad argument '" .. a .. "' (options: --" .. table.concat(names, ", --") .. ")", 0)
    end
    if type(defaults[k]) == "number" then
      o[k] = tonumber(v) or error("dp_gpt: --" .. k .. " must be a number, got '" .. v .. "'", 0)
    else
      o[k] = v
    end
  end
  for _, k in ipairs({ "n_layers", "dim", "n_heads", "seq", "batch", "steps", "log_every" }) do
    if o[k] < 1 or o[k] % 1 ~= 0 then error("dp_gpt: --" .. k .. " must be a positive integer", 0) end
  end
  return o
end

local function main(argv)
  local o = parse_args(argv)
  dist.init()
  local rank, world = dist.rank(), dist.world_size()
  local function log(...) if rank == 0 then print(string.format(...)); io.stdout:flush() end end
  if o.threads > 0 then engine.set_num_threads(o.threads) end
  local mesh = dist.init_device_mesh("cpu", { world }, { "dp" })

  -- the same initial weights on every rank (same seed), then Replicate DTensors (ties kept)
  engine.manual_seed(o.seed)
  local model = nn.Transformer{ n_layers = o.n_layers, dim = o.dim, n_heads = o.n_heads, vocab_size = 256,
    max_seq_len = o.seq, dropout_p = 0 }
  for name, p in model:named_parameters() do
    if name:match("norm%.weight$") then nn.init.ones_(p)
    elseif name:match("bias$") then nn.init.zeros_(p)
    else nn.init.normal_(p, 0, 0.02) end
  end
  dist.replicate_parameters(model, mesh)
  model:train()
  local params = model:parameters()
  local opt = optim.AdamW(params, { lr = o.lr, betas = { 0.9, 0.95 }, weight_decay = o.weight_decay })

  local train = data.BatchSampler(data.read_shard(o.train), { batch_size = o.batch, seq_len = o.seq,
    seed = o.seed, rank = rank, world_size = world })
  log("dp_gpt: %d params, %d rank(s) x batch %d x seq %d (DTensor data parallel, mesh %s)", model:num_parameters(),
    world, o.batch, o.seq, tostring(mesh))

  -- distributed checkpoints (dist.checkpoint): {model, optim (keyed by parameter names), step, rng,
  -- data}; a checkpoint resumes at any world size (keep ranks x batch)
  local ck = C.checkpointer{ name = "dp_gpt", log = log, rank = rank, model = model, opt = opt, sampler = train,
    dir = o.ckpt_dir, keep = o.ckpt_keep, async = false }
  local first = 1
  if o.resume ~= "" then first = ck:resume(o.resume) + 1 end
  local function save(at)
    if o.ckpt_dir ~= "" then ck:save(at) end
  end

  local S = dist.Shard
  for step = first, o.steps do
    local t0 = engine.time()
    local x, y = train:next()
    local dx = dist.from_local(x, mesh, { S(1) })   -- this rank's rows of the global batch
    local dy = dist.from_local(y, mesh, { S(1) })
    local logits = dist.implicit_replication(function() return model(dx) end)
    local loss = F.cross_entropy(logits, dy)        -- Partial(sum): the global mean over ranks
    loss:backward()
    local gnorm = optim.clip_grad_norm_(params, o.grad_clip)
    opt:step()
    opt:zero_grad()
    local l = loss:full_tensor():item()             -- collective: every rank calls it
    if l ~= l or l == math.huge then                -- the same on every rank: all stop together
      error(string.format("dp_gpt: the loss is %s at step %d: training diverged (lower --lr; last good checkpoint: %s)",
        tostring(l), step, ck.last or "none"), 0)
    end
    if step % o.log_every == 0 or step == 1 or step == o.steps then
      log("step %5d | loss %.6f | grad norm %.4f | %.1f ms/step", step, l, gnorm:item(), (engine.time() - t0) * 1e3)
    end
    if (o.ckpt_every > 0 and step % o.ckpt_every == 0) or (step == o.steps and o.ckpt_every >= 0) then save(step) end
  end
end

main(arg and { unpack(arg, 1, #arg) } or {})
