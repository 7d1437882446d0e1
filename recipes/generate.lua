-- recipes/generate.lua: text from a trained model through model:generate (the KV cache; engine.generation).
--
--   build/engine recipes/generate.lua --checkpoint runs/gpt-20261128-014530           # a run folder (newest checkpoint)
--   build/engine recipes/generate.lua --checkpoint runs/x/checkpoints/step_00000600 --prompt "In the beginning"
--   build/engine recipes/generate.lua --checkpoint path/to/hf-folder --tokenizer path/to/tokenizer.json
--   mpirun -np 2 build/engine recipes/generate.lua --checkpoint runs/x      # tensor parallel over the ranks
--   build/engine recipes/generate.lua --help
--
-- --checkpoint is one of:
--   * a run folder of recipes/gpt.lua or recipes/llama.lua (its config.json and the newest checkpoint of its
--     checkpoint folder, either format);
--   * one checkpoint of those recipes: a distributed checkpoint folder (step_%08d/) or a full one
--     (step_%08d.safetensors); the options saved inside it (or the run folder's config.json above it) give the
--     model's shape (a Llama when they have n_kv_heads, else the GPT);
--   * a Hugging Face folder (config.json with a model_type, gpt2 or llama, and model.safetensors; engine.hf).
-- --tokenizer: "byte", a tokenizer.json, or a folder with one (or vocab.json + merges.txt); by default the run's
-- own (its --tokenizer), or the Hugging Face folder's tokenizer.json when it has one, else byte-level.
-- --prompt_ids (comma-separated token ids) replaces --prompt; --print_ids=1 prints the ids instead of text (with
-- both, no tokenizer is needed).
-- With several ranks (mpirun -np N) the model is tensor parallel over all of them (Transformer.parallelize /
-- Llama.parallelize: n_heads, and a Llama's n_kv_heads, divisible by N); rank 0 prints.
local engine = require("engine")
local nn, data, dist = engine.nn, engine.data, engine.distributed
local cli = require("engine.cli")
local json = require("engine.json")
local run = require("engine.run")
local checkpoint = require("engine.checkpoint")

local NAME = "generate"

local o = cli.parse(arg, {
  name = NAME,
  description = "Samples text from a checkpoint of recipes/gpt.lua or recipes/llama.lua (a run folder or one "
    .. "checkpoint) or from a Hugging Face folder, with the KV cache.",
  options = {
    { "checkpoint", "", "a run folder, a checkpoint (step_N/ or step_N.safetensors), or a Hugging Face folder" },
    { "tokenizer", "", "byte, a tokenizer.json or a folder with one; default: the run's, or the HF folder's, else byte" },
    { "prompt", "And God said", "the text the samples continue" },
    { "prompt_ids", "", "comma-separated token ids to continue instead of --prompt (e.g. 5,17,42)" },
    { "max_new_tokens", 200, "tokens generated per sample", int = true, min = 0 },
    { "temperature", 0.8, "sampling temperature; 0: greedy", min = 0 },
    { "top_k", 0, "sample among the k most likely tokens; 0: all", int = true, min = 0 },
    { "top_p", 1.0, "nucleus sampling: the most likely tokens holding this probability; 1: all", min = 0, max = 1 },
    { "seed", 1337, "seed of the sampling (the same seed gives the same text)", int = true, min = 0 },
    { "num_samples", 1, "samples, one after the other (seeds seed, seed + 1, ...)", int = true, min = 1 },
    { "stop_at_eot", 1, "1: end a sample at the tokenizer's end-of-text token (when it has one)", int = true,
      choices = { 0, 1 } },
    { "kv_cache", 1, "0: recompute the whole context for every token (the old way; for comparisons)", int = true,
      choices = { 0, 1 } },
    { "cache_dtype", "", "the KV cache's dtype: empty, the model's; bf16 halves what each token reads of an f32 "
      .. "model's cache", choices = { "", "bf16", "f32" } },
    { "print_ids", 0, "1: print the token ids (prompt included) instead of the text", int = true, choices = { 0, 1 } },
    { "stream", 1, "1: print each token as it comes (rank 0)", int = true, choices = { 0, 1 } },
    { "device", "cpu", "where the model runs", choices = { "cpu", "cuda" } },
    { "dtype", "f32", "the model's dtype", choices = { "f32", "bf16" } },
    { "threads", 0, "BLAS/kernel threads per rank; 0: the default", int = true, min = 0 },
  },
})

if o.checkpoint == "" then cli.usage_error(NAME, "--checkpoint is required (a run folder, a checkpoint or an HF folder)") end
if o.top_p <= 0 then cli.usage_error(NAME, "--top_p must be in (0, 1], got %g", o.top_p) end
if o.device == "cuda" and not engine.cuda.is_available() then
  cli.usage_error(NAME, "--device=cuda: %s", engine.cuda.unavailable_reason())
end

dist.init()
local rank, world = dist.rank(), dist.world_size()
if o.threads > 0 then engine.set_num_threads(o.threads) end
local function say(fmt, ...) if rank == 0 then io.stderr:write(string.format(fmt, ...) .. "\n") end end

-- ---------------------------------------------------------------- what --checkpoint is
local path = o.checkpoint:gsub("/+$", "")
local function is_dir(p) return run.is_dir(p) end
local function read_json(p) return json.read_file(p) end

-- the options saved with a checkpoint (a table), or nil
local function saved_config(ck)
  if is_dir(ck) then
    local ok, md = pcall(dist.checkpoint.read_metadata, ck)
    local s = ok and md.values.config
    if type(s) == "string" and s ~= "" then return json.decode(s) end
  else
    local ok, _, meta = pcall(engine.load, ck)
    if ok and meta and meta["extra.config"] then return json.decode(meta["extra.config"]) end
  end
  -- a checkpoint inside <run>/checkpoints: the run folder's config.json
  local above = ck:match("^(.*)/[^/]+/[^/]+$")
  if above and run.exists(above .. "/config.json") then
    local cfg = read_json(above .. "/config.json")
    if cfg.model_type == nil then return cfg end
  end
  return nil
end

local kind, cfg, ck_path, hf_dir
if not run.exists(path) then
  cli.usage_error(NAME, "--checkpoint=%s: no such file or folder", o.checkpoint)
elseif is_dir(path) and run.exists(path .. "/config.json") then
  cfg = read_json(path .. "/config.json")
  if cfg.model_type ~= nil then
    kind, hf_dir = "hf", path
  else
    -- a run folder: the newest checkpoint of its checkpoint folder, either format
    local dir = (cfg.ckpt_dir and cfg.ckpt_dir ~= "" and is_dir(cfg.ckpt_dir)) and cfg.ckpt_dir or path .. "/checkpoints"
    local p_dcp, s_dcp = dist.checkpoint.latest(dir)
    local p_full, s_full = checkpoint.latest(dir)
    ck_path = p_dcp
    if p_full and (not s_dcp or s_full > s_dcp) then ck_path = p_full end
    if not ck_path then cli.usage_error(NAME, "--checkpoint=%s: the run folder has no checkpoint in %s", o.checkpoint, dir) end
    kind = "recipe"
  end
elseif (is_dir(path) and run.exists(path .. "/.metadata")) or path:match("%.safetensors$") then
  kind, ck_path = "recipe", path
  cfg = saved_config(path)
  if not cfg then
    cli.usage_error(NAME, "--checkpoint=%s: no options saved with it (nor a run folder's config.json above it): "
      .. "the model's shape is unknown", o.checkpoint)
  end
else
  cli.usage_error(NAME, "--checkpoint=%s: not a run folder (config.json), a checkpoint (step_N/ with .metadata, or "
    .. "step_N.safetensors) or a Hugging Face folder (config.json with model_type)", o.checkpoint)
end

-- ---------------------------------------------------------------- the model
local model
if kind == "hf" then
  local ok, m = pcall(require("engine.hf").load, hf_dir, { dtype = o.dtype })
  if not ok then cli.usage_error(NAME, "--checkpoint=%s: %s", o.checkpoint, tostring(m)) end
  model = m
else
  local function need(k)
    if cfg[k] == nil then cli.usage_error(NAME, "--checkpoint=%s: its options have no %s", o.checkpoint, k) end
    return cfg[k]
  end
  if cfg.n_kv_heads ~= nil then
    model = nn.Llama{ dim = need("dim"), n_layers = need("n_layers"), n_heads = need("n_heads"),
      n_kv_heads = cfg.n_kv_heads, vocab_size = need("vocab_size"), multiple_of = cfg.multiple_of,
      ffn_dim_multiplier = (cfg.ffn_dim_multiplier or 0) > 0 and cfg.ffn_dim_multiplier or nil,
      norm_eps = cfg.norm_eps, rope_theta = cfg.rope_theta, max_seq_len = need("seq") }
  else
    model = nn.Transformer{ n_layers = need("n_layers"), dim = need("dim"), n_heads = need("n_heads"),
      vocab_size = need("vocab_size"), max_seq_len = need("seq"), dropout_p = 0 }
  end
  if o.dtype ~= "f32" then model:to(o.dtype) end
  local ok, err
  if is_dir(ck_path) then
    -- the model's entries only (the checkpoint also holds the optimizer state, step, RNG, data position); each
    -- must be there
    local md = dist.checkpoint.read_metadata(ck_path)
    local sd, missing = model:state_dict(), {}
    for k in pairs(sd) do if not md.tensors["model." .. k] then missing[#missing + 1] = k end end
    table.sort(missing)
    if #missing > 0 then
      cli.usage_error(NAME, "--checkpoint=%s: the checkpoint has no model.%s (%d of the model's tensors are missing): "
        .. "not a checkpoint of this model", ck_path, missing[1], #missing)
    end
    ok, err = pcall(dist.checkpoint.load, { model = sd }, ck_path, { strict = false })
  else
    ok, err = pcall(checkpoint.load, ck_path, { model = model, rng = false })
  end
  if not ok then cli.usage_error(NAME, "--checkpoint=%s: %s", ck_path, tostring(err)) end
end
if o.device ~= "cpu" then model:to(o.device) end
model:eval()
local a = model.model_args
local is_llama = a.n_kv_heads ~= nil
if world > 1 then
  for _, k in ipairs({ "n_heads", is_llama and "n_kv_heads" or nil }) do
    if a[k] % world ~= 0 then
      cli.usage_error(NAME, "%d ranks: the model's %s (%d) must be divisible by the ranks (tensor parallelism)", world,
        k, a[k])
    end
  end
  local mesh = dist.init_device_mesh(o.device, { world }, { "tp" })
  if is_llama then nn.Llama.parallelize(model, mesh) else nn.Transformer.parallelize(model, mesh) end
end

-- ---------------------------------------------------------------- the tokenizer
local tok_spec = o.tokenizer
if tok_spec == "" then
  if kind == "hf" then
    tok_spec = (run.exists(hf_dir .. "/tokenizer.json") or run.exists(hf_dir .. "/vocab.json")) and hf_dir or "byte"
  else
    tok_spec = cfg.tokenizer or "byte"
  end
end
local tok_ok, tok = pcall(data.load_tokenizer, tok_spec)
if not tok_ok then cli.usage_error(NAME, "--tokenizer=%s: %s", tok_spec, tostring(tok)) end
local text = o.prompt_ids == "" or o.print_ids == 0
if text and tok.vocab_size > a.vocab_size then
  cli.usage_error(NAME, "the tokenizer %s has %d tokens, more than the model's vocabulary of %d (give --tokenizer, "
    .. "or --prompt_ids with --print_ids=1)", tok.name or tok_spec, tok.vocab_size, a.vocab_size)
end

local ids
if o.prompt_ids ~= "" then
  ids = {}
  for s in o.prompt_ids:gmatch("[^,%s]+") do
    local v = tonumber(s)
    if not v or v % 1 ~= 0 or v < 0 or v >= a.vocab_size then
      cli.usage_error(NAME, "--prompt_ids: '%s' is not a token id in [0, %d)", s, a.vocab_size)
    end
    ids[#ids + 1] = v
  end
else
  ids = tok:encode(o.prompt)
end
if #ids == 0 then ids = { tok.eot or 10 } end

say("%s: %s (%s), %d params, max_seq_len %d, vocab %d, tokenizer %s, %d rank(s)%s", NAME,
  kind == "hf" and "Hugging Face " .. tostring(cfg.model_type) or (is_llama and "llama" or "gpt"), ck_path or hf_dir,
  model:num_parameters(), a.max_seq_len, a.vocab_size, tok.name or tok_spec, world,
  world > 1 and " (tensor parallel)" or "")

-- ---------------------------------------------------------------- the samples
local decode_ok = tok.vocab_size >= a.vocab_size
for n = 1, o.num_samples do
  local streamed = o.stream == 1 and rank == 0 and o.print_ids == 0
  if rank == 0 and o.num_samples > 1 then io.write(string.format("--- sample %d\n", n)) end
  if streamed then io.write(tok:decode(ids)); io.flush() end
  local t0 = engine.time()
  local count = 0
  local out = model:generate(ids, {
    max_new_tokens = o.max_new_tokens, temperature = o.temperature, top_k = o.top_k > 0 and o.top_k or nil,
    top_p = o.top_p, seed = o.seed + n - 1, kv_cache = o.kv_cache == 1,
    cache_dtype = o.cache_dtype ~= "" and o.cache_dtype or nil,
    eos = (o.stop_at_eot == 1 and tok.eot) or nil,
    stream = function(id)
      count = count + 1
      if streamed then
        if decode_ok or id < tok.vocab_size then io.write(tok:decode({ id })) else io.write("<" .. id .. ">") end
        io.flush()
      end
    end })
  local dt = engine.time() - t0
  if rank == 0 then
    if o.print_ids == 1 then
      io.write(table.concat(out, ",") .. "\n")
    elseif not streamed then
      io.write(tok:decode(out) .. "\n")
    else
      io.write("\n")
    end
    io.flush()
  end
  say("%s: %d tokens in %.2f s (%.1f tokens/s%s)", NAME, count, dt, count / math.max(dt, 1e-9),
    o.kv_cache == 1 and ", KV cache" or ", no cache")
end
