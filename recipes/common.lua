-- recipes/common.lua: the parts the KJV GPT recipes share (recipes/gpt.lua, recipes/fsdp_gpt.lua, and through
-- them recipes/tp_gpt.lua, recipes/gpt_2d.lua and recipes/llama.lua; recipes/dp_gpt.lua's checkpoints): the
-- common options and their parsing, threads, rank-0 logging, the GPT-2 style initialisation, the parameter
-- digest, validation, distributed checkpoints (save, async save, prune, resume), the training loop with its
-- log lines, and the sample.  Not a recipe: a recipe loads it with
--   local C = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/common.lua")
local engine = require("engine")
local nn, optim, data, dist = engine.nn, engine.optim, engine.data, engine.distributed
local cli = require("engine.cli")
local run = require("engine.run")

local M = {}

local HOME = (ENGINE_HOME and ENGINE_HOME ~= "") and ENGINE_HOME or "."

-- The options of recipes/gpt.lua and recipes/fsdp_gpt.lua alike: engine.cli option specs ({name, default, help,
-- group, int, min, max, choices}), in --help's order.  options(extra) appends a recipe's own (a later spec of the
-- same name replaces an earlier one: a recipe changes a default).
local GROUPS = { "model", "training", "data", "parallel", "run", "logging", "checkpoint", "sampling" }
M.GROUPS = GROUPS

-- --act_ckpt: "none", "full" or an integer N >= 1 (torchtitan's --activation_checkpoint.mode none | full |
-- selective with every Nth layer).  act_ckpt_mode(v) -> "none" | "full" | N, or nil for a bad value.
function M.act_ckpt_mode(v)
  if v == "none" or v == "full" then return v end
  local n = type(v) == "string" and v:match("^%d+$") and tonumber(v) or nil
  if n and n >= 1 then return n end
  return nil
end
function M.check_act_ckpt(v)
  if M.act_ckpt_mode(v) == nil then return "must be none, full or an integer N >= 1 (every Nth block)" end
end

-- apply_act_ckpt(model, o) -> the number of blocks marked: --act_ckpt on the model's blocks (models.apply_ac:
-- marks in place, so checkpoints and parameter names are the same with any --act_ckpt); before parallelize and
-- fully_shard, as torchtitan applies AC before FSDP.
function M.apply_act_ckpt(model, o)
  return require("engine.models").apply_ac(model, M.act_ckpt_mode(o.act_ckpt))
end

function M.options(extra)
  local I = true
  local list = {
    { "n_layers", 4, "transformer blocks", group = "model", int = I, min = 1 },
    { "dim", 256, "model width", group = "model", int = I, min = 1 },
    { "n_heads", 4, "attention heads", group = "model", int = I, min = 1 },
    { "seq", 128, "context length in tokens", group = "model", int = I, min = 1 },
    { "dropout", 0.0, "dropout probability", group = "model", min = 0, max = 1 },
    { "vocab_size", 0, "vocabulary size; 0: the tokenizer's, else the training data's", group = "model", int = I,
      min = 0 },
    { "batch", 8, "sequences per rank per step", group = "training", int = I, min = 1 },
    { "steps", 600, "optimizer steps", group = "training", int = I, min = 1 },
    { "lr", 2e-3, "peak learning rate", group = "training", min = 0 },
    { "warmup", 30, "steps of linear warmup, then cosine decay to min_lr_ratio x lr at --steps", group = "training",
      int = I, min = 0 },
    { "min_lr_ratio", 0.1, "the final learning rate as a fraction of --lr", group = "training", min = 0 },
    { "weight_decay", 0.1, "AdamW weight decay", group = "training", min = 0 },
    { "beta1", 0.9, "AdamW beta1", group = "training", min = 0, max = 1 },
    { "beta2", 0.95, "AdamW beta2", group = "training", min = 0, max = 1 },
    { "grad_clip", 1.0, "clip the global gradient norm to this; 0: no clipping", group = "training", min = 0 },
    { "seed", 1337, "seed of the model init, data order, dropout and sample", group = "training", int = I },
    { "act_ckpt", "none", "activation checkpointing of the transformer blocks (recomputed in backward instead of "
      .. "kept): none, full (every block), or N (every Nth block)", group = "training", check = M.check_act_ckpt },
    { "threads", 0, "BLAS/kernel threads per rank; 0: the BLAS default with one rank, cores / ranks with several",
      group = "training", int = I, min = 0 },
    { "device", "cpu", "cpu, or cuda: the model, batches and meshes on each rank's GPU, NCCL between ranks",
      group = "training", choices = { "cpu", "cuda" } },
    { "train", "", "training tokens: an llm.c shard, or a glob of shards in quotes ('data/x_train_*.bin'); default "
      .. "data/kjv_train.bin, or with --tokenizer=.../<name>/tokenizer.json data/kjv_<name>_train.bin (make data, "
      .. "tools/prepare_data.lua)", group = "data" },
    { "val", "", "validation tokens (a shard or a glob); default as --train", group = "data" },
    { "tokenizer", "byte", "byte (one token per byte), a Hugging Face tokenizer.json, or a folder with GPT-2's "
      .. "vocab.json + merges.txt: decodes samples, sets the vocabulary", group = "data" },
    { "out", "", "the run folder: config, checkpoints, metrics.jsonl, log.txt, samples; default "
      .. "runs/<recipe>-<date>-<time> in the current directory", group = "run" },
    { "resume", "", "continue a run: its run folder (its config and newest checkpoint), a checkpoint, or latest "
      .. "(the newest checkpoint of --out / --ckpt_dir)", group = "run" },
    { "tensorboard", 0, "1: also a TensorBoard events file in the run folder (tensorboard --logdir runs)",
      group = "logging", int = I, choices = { 0, 1 } },
    { "log_every", 10, "steps between progress lines (rank 0: loss, lr, grad norm, ms/step, tokens/s, MFU, "
      .. "memory, ETA) and metrics.jsonl rows", group = "logging", int = I, min = 1 },
    { "log_exact", 0, "1: losses with 17 digits and a digest of the final parameters, to compare runs bit for bit",
      group = "logging", int = I, choices = { 0, 1 } },
    { "eval_every", 100, "steps between validation losses (also before the first and after the last); 0: only "
      .. "those", group = "logging", int = I, min = 0 },
    { "eval_batches", 20, "validation batches per evaluation and data-parallel rank (the ranks split the "
      .. "validation data: N ranks evaluate N x this many)", group = "logging", int = I, min = 1 },
    { "ckpt_dir", "", "checkpoints; default <out>/checkpoints", group = "checkpoint" },
    { "ckpt_every", 0, "steps between checkpoints; 0: only at the end, -1: never", group = "checkpoint", int = I,
      min = -1 },
    { "ckpt_keep", 0, "keep the newest K distributed checkpoints; 0: all", group = "checkpoint", int = I, min = 0 },
    { "ckpt_async", 0, "1: save distributed checkpoints in a background thread while training goes on",
      group = "checkpoint", int = I, choices = { 0, 1 } },
    { "sample_len", 300, "tokens sampled at the end (saved in <out>/samples.txt); 0: none", group = "sampling",
      int = I, min = 0 },
    { "temperature", 0.8, "sampling temperature; 0: greedy", group = "sampling", min = 0 },
    { "prompt", "And God said", "the sample's prompt", group = "sampling" },
    { "top_k", 0, "sample among the k most likely tokens; 0: all", group = "sampling", int = I, min = 0 },
    { "top_p", 1.0, "nucleus sampling: the smallest set of tokens of total probability >= top_p", group = "sampling",
      min = 0, max = 1 },
  }
  for _, opt in ipairs(extra or {}) do
    local replaced = false
    for i, o in ipairs(list) do
      if o[1] == opt[1] then
        -- a default only ({name, value}): keep the help and checks
        if opt[3] == nil then
          local c = {}
          for k, v in pairs(o) do c[k] = v end
          c[2] = opt[2]
          list[i] = c
        else list[i] = opt end
        replaced = true
      end
    end
    if not replaced then list[#list + 1] = opt end
  end
  -- in group order
  local rank_of = {}
  for i, g in ipairs(GROUPS) do rank_of[g] = i end
  local order = {}
  for i, o in ipairs(list) do order[o] = i end
  table.sort(list, function(a, b)
    local ga, gb = rank_of[a.group or ""] or 99, rank_of[b.group or ""] or 99
    if ga ~= gb then return ga < gb end
    return order[a] < order[b]
  end)
  return list
end

-- parse(name, options, argv, description) -> o, given (engine.cli.parse with --config)
function M.parse(name, options, argv, description)
  local o, given = cli.parse(argv, { name = name, description = description, options = options, config = true,
    epilog = "Values: --key=value or --key value; a --config file (.lua, .json, .toml) of option values, which the "
      .. "command line overrides.  A resumed run folder (--resume=runs/x) takes its saved options; options set on "
      .. "the command line override them, except the model's shape." })
  o.warmup = math.min(o.warmup, o.steps)
  return o, given
end

-- read_shards(name, path) -> the shards of --train / --val (a path, or a glob of llm.c shards; read once per run: the
-- vocabulary check reads them first), a usage error naming the option when they cannot be read
local shard_cache = {}
function M.read_shards(name, path, what)
  if shard_cache[path] then return shard_cache[path] end
  local ok, sh = pcall(data.read_shards, path)
  if not ok then M.usage_error(name, "--%s=%s: %s", what or "train", path, tostring(sh)) end
  shard_cache[path] = sh
  return sh
end

-- default_data(tokenizer, "train" | "val") -> the KJV shards tools/prepare_data.lua writes for the tokenizer:
-- data/kjv_train.bin (byte), data/kjv_<name>_train.bin (<name>: data.tokenizer_name)
function M.default_data(tokenizer, split)
  if tokenizer == "byte" then return HOME .. "/data/kjv_" .. split .. ".bin" end
  return HOME .. "/data/kjv_" .. data.tokenizer_name(tokenizer) .. "_" .. split .. ".bin"
end

-- resolve_vocab(name, o): o.tok (the tokenizer of --tokenizer) and o.vocab_size when 0: the tokenizer's, or with the
-- byte tokenizer the training data's (the shard header's vocabulary size, else the largest id in the train and
-- val shards + 1, at least 256).  A shard header whose vocabulary differs from the tokenizer's is an error.
function M.resolve_vocab(name, o)
  if o.tokenizer == "byte" then o.tok = data.ByteTokenizer()
  else
    local ok, tok = pcall(data.load_tokenizer, o.tokenizer)
    if not ok then M.usage_error(name, "--tokenizer=%s: %s", o.tokenizer, tostring(tok)) end
    o.tok = tok
  end
  for _, k in ipairs({ "train", "val" }) do
    if o[k] == "" then
      o[k] = M.default_data(o.tokenizer, k)
      if not run.exists(o[k]) then
        M.usage_error(name, "no --%s given and no %s: prepare it with build/engine tools/prepare_data.lua%s", k, o[k],
          o.tokenizer ~= "byte" and (" --tokenizer=" .. o.tokenizer) or "")
      end
    end
  end
  local train, val = M.read_shards(name, o.train, "train"), M.read_shards(name, o.val, "val")
  local recorded, max_id = nil, -1
  for _, list in ipairs({ train, val }) do
    for _, sh in ipairs(list) do
      if sh.vocab_size then recorded = math.max(recorded or 0, sh.vocab_size) end
      max_id = math.max(max_id, sh.max_id or -1)
    end
  end
  if o.tokenizer ~= "byte" and recorded and recorded ~= o.tok.vocab_size then
    M.usage_error(name, "--tokenizer=%s has %d tokens but the data (%s) was made with a vocabulary of %d", o.tokenizer,
      o.tok.vocab_size, o.train, recorded)
  end
  if o.vocab_size == 0 then
    if o.tokenizer ~= "byte" then o.vocab_size = o.tok.vocab_size
    else o.vocab_size = recorded or math.max(256, max_id + 1) end
  end
  if o.vocab_size <= max_id then
    M.usage_error(name, "--vocab_size=%d: the data holds token id %d", o.vocab_size, max_id)
  end
  if o.tokenizer ~= "byte" and o.vocab_size < o.tok.vocab_size then
    M.usage_error(name, "--vocab_size=%d is smaller than the tokenizer's %d tokens", o.vocab_size, o.tok.vocab_size)
  end
end

-- config_json(o) -> the resolved options as JSON (saved in every checkpoint)
function M.config_json(o) return require("engine.json").encode(cli.config_table(o)) end

-- flops_per_token(model, o) -> the training FLOPs per token (6 N + 12 L d T; engine.run.flops_per_token)
function M.flops_per_token(model, o)
  return run.flops_per_token(model:num_parameters(), o.n_layers, o.dim, o.seq)
end

-- usage_error(name, fmt, ...): a bad combination of options (printed once, without a traceback)
function M.usage_error(name, fmt, ...) return cli.usage_error(name, fmt, ...) end

-- The options that give the model's shape: a resumed run keeps them (a different value on the command line is an
-- error naming the option), and the per-run options a resumed run does not take from its saved config.
M.SHAPE_OPTIONS = { "n_layers", "dim", "n_heads", "seq", "vocab_size", "n_kv_heads", "multiple_of",
  "ffn_dim_multiplier", "tokenizer" }
local PER_RUN = { out = true, resume = true, config = true, threads = true }

local function is_dcp_dir(path)
  local f = io.open(path .. "/.metadata", "rb")
  if f then f:close() end
  return f ~= nil
end

-- the config saved in a checkpoint (a JSON string), or nil
local function checkpoint_config(path)
  if is_dcp_dir(path) then
    local st = { config = "" }
    local ok = pcall(dist.checkpoint.load, st, path, { strict = false })
    return ok and st.config ~= "" and st.config or nil
  end
  local ok, info = pcall(require("engine.checkpoint").load, path, {})
  return ok and info and info.extra and info.extra.config or nil
end

-- start(name, o, given) -> the run (engine.run; collective): resolves --resume (a run folder, a checkpoint or
-- latest) and the options it brings, checks the model's shape against it, reads the data and the tokenizer
-- (resolve_vocab: o.tok, o.vocab_size), creates or reopens the run folder
-- (--out), sets o.ckpt_dir (default <out>/checkpoints) and o.resume (a checkpoint path, "latest" or ""), and saves
-- the resolved options in <out>/config.json.
function M.start(name, o, given)
  local json = require("engine.json")
  local saved, resuming_folder = nil, false
  if o.resume ~= "" and o.resume ~= "latest" then
    if run.exists(o.resume .. "/config.json") then     -- a run folder
      resuming_folder = true
      saved = json.read_file(o.resume .. "/config.json")
      if o.out == "" then o.out = o.resume end
      o.resume = "latest"
      if not given.ckpt_dir then o.ckpt_dir = saved.ckpt_dir or "" end
    elseif not run.exists(o.resume) then
      M.usage_error(name, "--resume=%s: no such run folder or checkpoint", o.resume)
    else
      local s = checkpoint_config(o.resume)
      if s then saved = json.decode(s) end
    end
  elseif o.resume == "latest" and o.out ~= "" and run.exists(o.out .. "/config.json") then
    resuming_folder = true
    saved = json.read_file(o.out .. "/config.json")
    if not given.ckpt_dir then o.ckpt_dir = saved.ckpt_dir or "" end
  end
  if saved then
    for _, k in ipairs(M.SHAPE_OPTIONS) do
      local sv = saved[k]
      if sv ~= nil and o[k] ~= nil then
        if given[k] and o[k] ~= sv then
          M.usage_error(name, "--%s=%s differs from the resumed run's %s=%s (the model's shape must match: resume "
            .. "without --%s)", k, tostring(o[k]), k, tostring(sv), k)
        end
        o[k] = sv
      end
    end
    if resuming_folder then
      for k, v in pairs(saved) do
        if o[k] ~= nil and not given[k] and not PER_RUN[k] and k ~= "ckpt_dir" then o[k] = v end
      end
    end
  end
  if o.resume == "latest" and o.out == "" and o.ckpt_dir == "" then
    M.usage_error(name, "--resume=latest continues the run of --out (or the checkpoints of --ckpt_dir): give one")
  end
  M.resolve_vocab(name, o)   -- (after the resumed run's options: its data and tokenizer)
  -- the saved paths are absolute: a resumed run or recipes/generate.lua started from another directory finds them
  local cwd = os.getenv("PWD")
  if cwd and cwd:sub(1, 1) == "/" then
    for _, k in ipairs({ "train", "val", "tokenizer", "out", "ckpt_dir" }) do
      local v = o[k]
      if type(v) == "string" and v ~= "" and v:sub(1, 1) ~= "/" and not (k == "tokenizer" and v == "byte") then
        o[k] = cwd .. "/" .. v:gsub("^%./", "")
      end
    end
  end
  local r = run.start{ name = name, out = o.out, resume = resuming_folder or o.resume == "latest",
    tensorboard = o.tensorboard == 1 }
  o.out = r.dir
  if cwd and cwd:sub(1, 1) == "/" and o.out:sub(1, 1) ~= "/" then o.out = cwd .. "/" .. o.out end
  if o.ckpt_dir == "" then o.ckpt_dir = o.out .. "/checkpoints" end
  r:save_config(o)
  r:log("%s: run folder %s (config.json, log.txt, metrics.jsonl%s)", name, r.dir,
    o.ckpt_dir == o.out .. "/checkpoints" and ", checkpoints/" or ("; checkpoints in " .. o.ckpt_dir))
  return r
end

-- --threads: N > 0 per rank; 0 keeps the BLAS default with one rank and gives each of `world` ranks
-- max(1, cores / world)
-- --device: "cpu" or "cuda" (the model, the batches and the meshes on the GPU of this rank's node-local rank;
-- NCCL between ranks); cuda without a usable GPU is an error naming the reason.
function M.check_device(name, o)
  if o.device == "cuda" and not engine.cuda.is_available() then
    M.usage_error(name, "--device=cuda: %s", engine.cuda.unavailable_reason())
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

-- (config: the run's resolved options as JSON, saved in every checkpoint; a load reads it when there is one)
function Ck:state(at_step, with_config)
  local dcp = dist.checkpoint
  local st = { model = self.model:state_dict(), optim = dcp.get_optimizer_state_dict(self.model, self.opt),
    step = at_step, rng = engine.get_rng_state(), data = self.sampler:state() }
  if with_config then st.config = self.config or "" end
  return st
end

function Ck:load(path)
  local dcp = dist.checkpoint
  local st = self:state(0, checkpoint_config(path) ~= nil)
  dcp.load(st, path)
  dcp.set_optimizer_state_dict(self.model, self.opt, st.optim)
  engine.set_rng_state(st.rng)
  self.sampler:set_state(st.data)
  return st.step
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
  local h = dcp.save(self:state(at_step, self.config ~= nil), path, { async = self.async })
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
  if step == 0 or step >= o.steps then
    local vl = t.evaluate()
    log("step %5d | val loss %.4f", step, vl)
    if t.run then t.run:metrics{ step = step, val_loss = vl } end
  end

  local R = t.run
  local peak_flops = t.flops_per_token and run.peak_flops(o.device)
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
      cli.fail(string.format(name .. ": the loss is %s at step %d (lr %.3e): training diverged; lower --lr, raise "
        .. "--warmup or --grad_clip, or resume from an earlier checkpoint (last good checkpoint: %s)", tostring(l),
        step + 1, lr, ck.last or "none"))
    end
    r = nil
    step = step + 1
    times[#times + 1] = engine.time() - t0
    n_log = n_log + 1
    if step % o.log_every == 0 or step == o.steps then
      local dt = (engine.time() - t_log) / n_log
      local gn, tps, mem = gnorm:item(), t.tokens / dt, peak_bytes(o) / 2 ^ 20
      local mfu = peak_flops and t.flops_per_token * tps / peak_flops or nil
      local eta = dt * (o.steps - step)
      log("step %5d | loss " .. (o.log_exact == 1 and "%.17g" or "%.6f") .. " | lr %.3e | grad norm %.4f | %.1f ms/step "
        .. "| %.0f tok/s | MFU %s | peak %.1f MiB | ETA %s", step, l, lr, gn, dt * 1e3, tps,
        mfu and string.format("%.1f%%", 100 * mfu) or "n/a", mem, run.eta(eta))
      if R then
        R:metrics{ step = step, loss = l, lr = lr, grad_norm = gn, ms_per_step = dt * 1e3, tokens_per_s = tps,
          mfu = mfu, peak_mem_mib = mem, eta_s = eta }
      end
      t_log, n_log = engine.time(), 0
    end
    if o.eval_every > 0 and step % o.eval_every == 0 and step ~= o.steps then
      local te = engine.time()
      local vl = t.evaluate()
      log("step %5d | val loss %.4f | (eval %.1f s)", step, vl, engine.time() - te)
      if R then R:metrics{ step = step, val_loss = vl } end
      t_log = t_log + (engine.time() - te)
    end
    if o.ckpt_every > 0 and step % o.ckpt_every == 0 and step ~= o.steps then t.save(step) end
  end
  if #times > 0 then
    local vl = t.evaluate()
    log("step %5d | val loss %.4f", step, vl)
    if R then R:metrics{ step = step, val_loss = vl } end
    log(name .. ": median %.1f ms/step over %d steps (%.0f tok/s)", M.median(times) * 1e3, #times,
      t.tokens / M.median(times))
    if o.ckpt_every >= 0 then t.save(step) end
  end
  ck:finish()
  if o.log_exact == 1 then log(name .. ": parameter digest %s", M.parameter_digest(t.model)) end
  return step
end

-- sample(o, model) -> the text: --sample_len tokens after --prompt through model:generate (the KV cache; seeded
-- with --seed + 1: the same run gives the same text; greedy at --temperature 0; --top_k, --top_p), decoded with
-- the run's tokenizer (o.tok).  With a sharded model (TP, FSDP) every rank of its mesh calls it.
function M.sample(o, model)
  local tok = o.tok or data.ByteTokenizer()
  local ids = tok:encode(o.prompt)
  if #ids == 0 then ids = { tok.eot or 10 } end
  local out = model:generate(ids, { max_new_tokens = o.sample_len, temperature = o.temperature,
    top_k = o.top_k > 0 and o.top_k or nil, top_p = o.top_p, seed = o.seed + 1 })
  -- (a vocabulary beyond the tokenizer's, e.g. GPT-2 token shards trained without --tokenizer: the ids)
  local ok, text = pcall(tok.decode, tok, out)
  if ok then return text end
  local t = {}
  for i, id in ipairs(out) do t[i] = tostring(id) end
  return "(token ids; give --tokenizer to decode them) " .. table.concat(t, " ")
end

return M
