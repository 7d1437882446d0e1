-- engine.hf: Hugging Face checkpoints in and out of the engine's models (issue 29, item 5).
--
--   local hf = require("engine.hf")                 -- also engine.hf
--   local model, info = hf.load("path/to/gpt2")     -- an HF folder: config.json + model.safetensors
--                                                   -- (or model.safetensors.index.json and its shards)
--   hf.save(model, "out/my-gpt")                    -- config.json + model.safetensors that transformers loads
--   hf.load_state_dict_into(model, "path/to/llama") -- HF weights into a model a recipe built (TP/FSDP too)
--
-- model_type "gpt2" (GPT2LMHeadModel, GPT2Model) loads into nn.Transformer with attn_bias = true, gelu "tanh"
-- (activation_function gelu_new / gelu_pytorch_tanh / gelu_fast; "gelu" is the exact one), norm_eps =
-- layer_norm_epsilon, weight_tying = tie_word_embeddings, dropout_p = resid_pdrop; model_type "llama"
-- (LlamaForCausalLM) into nn.Llama with n_kv_heads = num_key_value_heads, ffn_hidden_dim = intermediate_size,
-- norm_eps = rms_norm_eps, rope_theta (rope_theta or rope_parameters.rope_theta), weight_tying =
-- tie_word_embeddings.  Anything these models cannot express is an error naming the config field (rope
-- scaling such as Llama 3.1's "llama3", attention or MLP biases in a Llama, a GPT-2 n_inner other than 4 x n_embd,
-- scale_attn_by_inverse_layer_idx, a head_dim other than hidden_size / num_attention_heads).
--
-- Names (HF -> engine; "transformer." is optional before GPT-2's names, as in GPT2Model and the hub's gpt2):
--   GPT-2  wte -> tok_embeddings, wpe -> pos_embeddings, h.N.ln_1 -> layers.N.attention_norm,
--          h.N.attn.c_attn [D, 3D] -> layers.N.attention.wq/wk/wv (transposed: Conv1D stores [in, out], then
--          split into 3 x D rows; the bias split the same way), h.N.attn.c_proj -> attention.wo (transposed),
--          h.N.ln_2 -> ffn_norm, h.N.mlp.c_fc -> feed_forward.w1, h.N.mlp.c_proj -> feed_forward.w2 (both
--          transposed), ln_f -> norm, lm_head -> output (only when untied).  h.N.attn.bias / masked_bias (the
--          causal-mask buffers of older files) are ignored.
--   Llama  model.embed_tokens -> tok_embeddings, model.layers.N.self_attn.{q,k,v,o}_proj -> layers.N.attention.
--          {wq,wk,wv,wo}, mlp.gate_proj -> feed_forward.w1, mlp.up_proj -> w3, mlp.down_proj -> w2,
--          input_layernorm -> attention_norm, post_attention_layernorm -> ffn_norm, model.norm -> norm, lm_head ->
--          output (only when untied).  The rows of q_proj and k_proj are permuted within each head: HF's
--          rotate_half pairs element i with i + head_dim/2, the engine (Meta, torchtitan) pairs 2i with 2i+1, so
--          engine row 2i+a of a head is HF row a * head_dim/2 + i (a = 0, 1).  *.rotary_emb.inv_freq is ignored.
--
-- load(path [, {dtype = "f32", device = nil, max_seq_len = nil, strict = true}]) -> model, info
--   dtype: the model's dtype ("auto": config.json's torch_dtype / dtype); device: "cuda" moves it there;
--   max_seq_len (Llama only): the rotary tables' length instead of max_position_embeddings (they are built
--   for 2 x max_seq_len positions); strict = false ignores tensors the model does not use.  The model comes back
--   in eval mode (as from_pretrained; model:train() to fine-tune).  info = {model_type =, config = (config.json
--   decoded), args = (the ModelArgs / LlamaArgs), files = {...}, dtype = (the files' first tensor dtype)}.
-- load_state_dict_into(model, path [, {strict = true}]) -> info: path an HF folder or one .safetensors file;
--   the model an nn.Transformer (gpt2 names) or nn.Llama (llama names) whose shape config.json must match
--   (when the folder has one: a differing field is an error naming it).  Values go through
--   model:load_state_dict, so each parameter is copied into (fused QKV views stay fused) and DTensor
--   parameters (tensor parallelism, FSDP) take their shard of the full tensor without communication.
--   Every rank reads the files.
-- save(model, dir [, {overwrite = false, dtype = nil, config = nil}]) -> config: writes config.json and
--   model.safetensors (metadata format "pt") in dir (created); an existing non-empty dir is refused unless
--   overwrite (which replaces config.json and the model*.safetensors files, keeping others such as a
--   tokenizer).  dtype converts the tensors (default: the parameters' own); config: extra or overriding
--   config.json fields (e.g. {bos_token_id = 0, eos_token_id = 0}).  A GPT-2 export of a model without
--   attention biases writes zero biases (the same function); a model without a causal mask is refused.  With
--   DTensor parameters every rank must call it (full_tensor is collective); in a multi-process job only rank 0
--   writes.
-- Also: hf.config_of(model) -> config.json table; hf.to_hf(model) -> {HF name -> tensor}, config;
-- hf.args_of(config [, opts]) -> model_type, args; hf.from_hf(tensors, model_type, args) -> engine state dict.
local engine = require("engine")
local json = require("engine.json")
local models = require("engine.models")

local M = {}

local function shape_str(s) return "[" .. table.concat(s, ",") .. "]" end
local function quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
local function fail(msg) error(msg, 0) end

-- Public functions raise at the caller's line: internal errors carry no position (error(msg, 0)).
local function api(fn)
  return function(...)
    local r = { pcall(fn, ...) }
    if not r[1] then error(r[2], 2) end
    return unpack(r, 2, table.maxn(r))
  end
end

local function has_class(m, name)
  local c = type(m) == "table" and getmetatable(m)
  while c do
    if rawget(c, "__name") == name then return true end
    c = rawget(c, "__parent")
  end
  return false
end

local function model_kind(model, op)
  if has_class(model, "Transformer") then return "gpt2" end
  if has_class(model, "Llama") then return "llama" end
  fail(string.format("%s: expected an nn.Transformer (GPT-2) or nn.Llama, got %s", op,
    type(model) == "table" and tostring(model.__name) or type(model)))
end

local function file_exists(p)
  local f = io.open(p, "rb")
  if f then f:close(); return true end
  return false
end

local function list_dir(dir)
  local p = io.popen("ls -1A " .. quote(dir) .. " 2>/dev/null")
  local names = {}
  if p then
    for n in p:lines() do names[#names + 1] = n end
    p:close()
  end
  return names
end

local function is_dir(p)
  local r = os.execute("test -d " .. quote(p))
  return r == 0 or r == true
end

-- config value, json.null read as nil
local function cget(cfg, k)
  local v = cfg[k]
  if v == json.null then return nil end
  return v
end

local DTYPE_OF_TORCH = { float32 = "f32", float = "f32", bfloat16 = "bf16", float16 = "f16", half = "f16",
  float64 = "f64", double = "f64" }
local TORCH_OF_DTYPE = { f32 = "float32", bf16 = "bfloat16", f16 = "float16", f64 = "float64" }

-- ---------------------------------------------------------------- reading a folder
-- read_weights(path, op) -> tensors (HF name -> tensor), config (or nil), files
local function read_weights(path, op, need_config)
  if type(path) ~= "string" then fail(op .. ": path must be a string, got " .. type(path)) end
  local dir, files = path, {}
  local tensors = {}
  local function load_file(f)
    local ok, t = pcall(engine.load, f)
    if not ok then fail(string.format("%s: %s: %s", op, f, tostring(t))) end
    files[#files + 1] = f
    return t
  end
  if path:match("%.safetensors$") and not is_dir(path) then
    if not file_exists(path) then fail(string.format("%s: %s does not exist", op, path)) end
    dir = path:match("^(.*)/[^/]*$") or "."
    tensors = load_file(path)
  else
    if not is_dir(path) then
      fail(string.format("%s: %s is not a folder (expected an HF folder with config.json and model.safetensors)",
        op, path))
    end
    local single, index = path .. "/model.safetensors", path .. "/model.safetensors.index.json"
    if file_exists(single) then
      tensors = load_file(single)
    elseif file_exists(index) then
      local ok, idx = pcall(json.read_file, index)
      if not ok then fail(op .. ": " .. tostring(idx)) end
      local map = type(idx) == "table" and idx.weight_map
      if type(map) ~= "table" then fail(string.format("%s: %s has no weight_map", op, index)) end
      local by_file, order = {}, {}
      for name, f in pairs(map) do
        if type(f) ~= "string" or f:find("/", 1, true) then
          fail(string.format("%s: %s: weight_map entry '%s' is not a file name", op, index, name))
        end
        if not by_file[f] then by_file[f] = {}; order[#order + 1] = f end
        by_file[f][#by_file[f] + 1] = name
      end
      table.sort(order)
      for _, f in ipairs(order) do
        local t = load_file(path .. "/" .. f)
        for _, name in ipairs(by_file[f]) do
          if t[name] == nil then
            fail(string.format("%s: %s lists tensor '%s' in %s, which does not hold it", op, index, name, f))
          end
          tensors[name] = t[name]
        end
      end
    elseif file_exists(path .. "/pytorch_model.bin") or file_exists(path .. "/model.bin") then
      fail(string.format("%s: %s has only PyTorch pickle weights (pytorch_model.bin); the engine reads safetensors "
        .. "(convert with transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir2))", op, path))
    else
      fail(string.format("%s: %s has no model.safetensors or model.safetensors.index.json", op, path))
    end
  end
  local cfg
  local cpath = dir .. "/config.json"
  if file_exists(cpath) then
    local ok, c = pcall(json.read_file, cpath)
    if not ok then fail(op .. ": " .. tostring(c)) end
    if type(c) ~= "table" then fail(string.format("%s: %s is not a JSON object", op, cpath)) end
    cfg = c
  elseif need_config then
    fail(string.format("%s: %s has no config.json", op, path))
  end
  return tensors, cfg, files
end

-- ---------------------------------------------------------------- config.json <-> model args
local function need_int(cfg, k, op, default)
  local v = cget(cfg, k)
  if v == nil then v = default end
  if type(v) ~= "number" or v % 1 ~= 0 or v < 0 then
    fail(string.format("%s: config.json: %s must be a non-negative integer, got %s", op, k, tostring(v)))
  end
  return v
end

local function need_num(cfg, k, op, default)
  local v = cget(cfg, k)
  if v == nil then v = default end
  if type(v) ~= "number" or not (v > 0) then
    fail(string.format("%s: config.json: %s must be a positive number, got %s", op, k, tostring(v)))
  end
  return v
end

local function refuse(op, field, value, why)
  fail(string.format("%s: config.json: %s = %s is not supported (%s)", op, field, tostring(value), why))
end

local GPT2_GELU = { gelu_new = "tanh", gelu_pytorch_tanh = "tanh", gelu_fast = "tanh", gelu = "none" }

local function gpt2_args(cfg, opts, op)
  local D = need_int(cfg, "n_embd", op)
  local inner = cget(cfg, "n_inner")
  if inner ~= nil and inner ~= 4 * D then
    refuse(op, "n_inner", inner, "nn.Transformer's feed-forward is 4 x n_embd = " .. 4 * D)
  end
  local act = cget(cfg, "activation_function") or "gelu_new"
  if not GPT2_GELU[act] then
    refuse(op, "activation_function", act, "gelu_new, gelu_pytorch_tanh, gelu_fast or gelu")
  end
  if cget(cfg, "scale_attn_by_inverse_layer_idx") == true then
    refuse(op, "scale_attn_by_inverse_layer_idx", true, "attention is scaled by 1/sqrt(head_dim) only")
  end
  if cget(cfg, "scale_attn_weights") == false then
    refuse(op, "scale_attn_weights", false, "attention is scaled by 1/sqrt(head_dim)")
  end
  if cget(cfg, "add_cross_attention") == true then refuse(op, "add_cross_attention", true, "a decoder only") end
  if opts.max_seq_len ~= nil and opts.max_seq_len ~= cget(cfg, "n_positions") then
    fail(op .. ": max_seq_len is for Llama models (GPT-2's learned position table has n_positions rows)")
  end
  local pd = cget(cfg, "resid_pdrop")
  return {
    n_layers = need_int(cfg, "n_layer", op), dim = D, n_heads = need_int(cfg, "n_head", op),
    vocab_size = need_int(cfg, "vocab_size", op), max_seq_len = need_int(cfg, "n_positions", op),
    dropout_p = type(pd) == "number" and pd or 0.1, use_attn_mask = true,
    weight_tying = cget(cfg, "tie_word_embeddings") ~= false, gelu = GPT2_GELU[act], attn_bias = true,
    norm_eps = need_num(cfg, "layer_norm_epsilon", op, 1e-5),
  }
end

local function llama_args(cfg, opts, op)
  local D, H = need_int(cfg, "hidden_size", op), need_int(cfg, "num_attention_heads", op)
  local act = cget(cfg, "hidden_act")
  if act ~= nil and act ~= "silu" then refuse(op, "hidden_act", act, "nn.Llama's feed-forward is SwiGLU (silu)") end
  if cget(cfg, "attention_bias") == true then refuse(op, "attention_bias", true, "nn.Llama has no biases") end
  if cget(cfg, "mlp_bias") == true then refuse(op, "mlp_bias", true, "nn.Llama has no biases") end
  local hd = cget(cfg, "head_dim")
  if hd ~= nil and H > 0 and hd ~= D / H then
    refuse(op, "head_dim", hd, "nn.Llama's head dim is hidden_size / num_attention_heads = " .. D / H)
  end
  local theta = cget(cfg, "rope_theta")
  for _, k in ipairs({ "rope_parameters", "rope_scaling" }) do
    local rp = cget(cfg, k)
    if type(rp) == "table" then
      local rt = cget(rp, "rope_type") or cget(rp, "type") or "default"
      if rt ~= "default" then
        refuse(op, k .. ".rope_type", rt, "only the default rotary embedding (no scaling) is implemented")
      end
      if theta == nil and type(cget(rp, "rope_theta")) == "number" then theta = rp.rope_theta end
    end
  end
  if theta == nil then theta = 10000 end
  if type(theta) ~= "number" or not (theta > 0) then
    fail(op .. ": config.json: rope_theta must be a positive number, got " .. tostring(theta))
  end
  local max_len = need_int(cfg, "max_position_embeddings", op, 2048)
  if opts.max_seq_len ~= nil then
    if type(opts.max_seq_len) ~= "number" or opts.max_seq_len % 1 ~= 0 or opts.max_seq_len < 1 then
      fail(op .. ": max_seq_len must be a positive integer, got " .. tostring(opts.max_seq_len))
    end
    max_len = opts.max_seq_len
  end
  return {
    dim = D, n_layers = need_int(cfg, "num_hidden_layers", op), n_heads = H,
    n_kv_heads = need_int(cfg, "num_key_value_heads", op, H), vocab_size = need_int(cfg, "vocab_size", op),
    ffn_hidden_dim = need_int(cfg, "intermediate_size", op), norm_eps = need_num(cfg, "rms_norm_eps", op, 1e-6),
    rope_theta = theta, max_seq_len = max_len, weight_tying = cget(cfg, "tie_word_embeddings") == true,
  }
end

-- args_of(config [, opts]) -> model_type, args (ModelArgs for gpt2, LlamaArgs for llama; validated)
local function args_of(cfg, opts, op)
  op = op or "hf.args_of"
  if type(cfg) ~= "table" then fail(op .. ": expected a config table (config.json decoded)") end
  local mt = cget(cfg, "model_type")
  local a
  if mt == "gpt2" then a = gpt2_args(cfg, opts or {}, op)
  elseif mt == "llama" then a = llama_args(cfg, opts or {}, op)
  else
    fail(string.format("%s: config.json: model_type %s is not supported (gpt2 or llama)",
      op, mt == nil and "(missing)" or ("'" .. tostring(mt) .. "'")))
  end
  local ok, v = pcall(mt == "gpt2" and models.ModelArgs or models.LlamaArgs, a)
  if not ok then fail(string.format("%s: config.json does not make a valid %s: %s", op, mt, tostring(v))) end
  return mt, v
end
M.args_of = api(args_of)

-- The token ids of the config.json a model was loaded from (model.hf_config, set by load and
-- load_state_dict_into) carry over to its export.
local TOKEN_IDS = { "bos_token_id", "eos_token_id", "pad_token_id" }
local function with_token_ids(model, cfg)
  local src = rawget(model, "hf_config")
  if type(src) == "table" then
    for _, k in ipairs(TOKEN_IDS) do if src[k] ~= nil then cfg[k] = src[k] end end
  end
  return cfg
end

-- The config.json of an engine model.
local function config_of(model, dtype, op)
  op = op or "hf.config_of"
  local kind = model_kind(model, op)
  local a = model.model_args
  local torch_dtype = TORCH_OF_DTYPE[dtype or model.tok_embeddings.weight.dtype] or "float32"
  if kind == "gpt2" then
    if not a.use_attn_mask then
      fail(op .. ": the model has use_attn_mask = false; GPT-2's attention is always causal")
    end
    -- GPT2Config's default token ids are 50256, outside a smaller vocabulary
    local eot = a.vocab_size > 50256 and 50256 or json.null
    return with_token_ids(model, {
      bos_token_id = eot, eos_token_id = eot,
      architectures = { "GPT2LMHeadModel" }, model_type = "gpt2", vocab_size = a.vocab_size,
      n_positions = a.max_seq_len, n_embd = a.dim, n_layer = a.n_layers, n_head = a.n_heads, n_inner = json.null,
      activation_function = a.gelu == "tanh" and "gelu_new" or "gelu", layer_norm_epsilon = a.norm_eps,
      resid_pdrop = a.dropout_p, embd_pdrop = a.dropout_p, attn_pdrop = a.dropout_p, initializer_range = 0.02,
      scale_attn_weights = true, scale_attn_by_inverse_layer_idx = false, reorder_and_upcast_attn = false,
      tie_word_embeddings = a.weight_tying, use_cache = true, torch_dtype = torch_dtype, dtype = torch_dtype,
    })
  end
  local hd = a.dim / a.n_heads
  return with_token_ids(model, {
    architectures = { "LlamaForCausalLM" }, model_type = "llama", vocab_size = a.vocab_size, hidden_size = a.dim,
    intermediate_size = models.llama_ffn_dim(a), num_hidden_layers = a.n_layers,
    num_attention_heads = a.n_heads, num_key_value_heads = a.n_kv_heads, head_dim = hd, hidden_act = "silu",
    max_position_embeddings = a.max_seq_len, rms_norm_eps = a.norm_eps, rope_theta = a.rope_theta,
    rope_parameters = { rope_type = "default", rope_theta = a.rope_theta }, attention_bias = false,
    attention_dropout = 0, mlp_bias = false, pretraining_tp = 1, initializer_range = 0.02,
    tie_word_embeddings = a.weight_tying, use_cache = true, torch_dtype = torch_dtype, dtype = torch_dtype,
  })
end
M.config_of = api(function(model) return config_of(model, nil) end)

-- ---------------------------------------------------------------- the name maps
-- entries(kind, args) -> list of {hf =, shape =, eng = name | {names}, conv = "copy" | "t" | "qkv_w" | "qkv_b" |
-- "perm", heads =}
local function entries(kind, a)
  local e = {}
  local function add(hf, shape, eng, conv, heads) e[#e + 1] = { hf = hf, shape = shape, eng = eng, conv = conv or "copy", heads = heads } end
  if kind == "gpt2" then
    local D, F = a.dim, 4 * a.dim
    add("wte.weight", { a.vocab_size, D }, "tok_embeddings.weight")
    add("wpe.weight", { a.max_seq_len, D }, "pos_embeddings.weight")
    for i = 0, a.n_layers - 1 do
      local h, l = "h." .. i .. ".", "layers." .. i .. "."
      add(h .. "ln_1.weight", { D }, l .. "attention_norm.weight")
      add(h .. "ln_1.bias", { D }, l .. "attention_norm.bias")
      add(h .. "attn.c_attn.weight", { D, 3 * D },
        { l .. "attention.wq.weight", l .. "attention.wk.weight", l .. "attention.wv.weight" }, "qkv_w")
      add(h .. "attn.c_attn.bias", { 3 * D },
        { l .. "attention.wq.bias", l .. "attention.wk.bias", l .. "attention.wv.bias" }, "qkv_b")
      add(h .. "attn.c_proj.weight", { D, D }, l .. "attention.wo.weight", "t")
      add(h .. "attn.c_proj.bias", { D }, l .. "attention.wo.bias", "bias")
      add(h .. "ln_2.weight", { D }, l .. "ffn_norm.weight")
      add(h .. "ln_2.bias", { D }, l .. "ffn_norm.bias")
      add(h .. "mlp.c_fc.weight", { D, F }, l .. "feed_forward.w1.weight", "t")
      add(h .. "mlp.c_fc.bias", { F }, l .. "feed_forward.w1.bias")
      add(h .. "mlp.c_proj.weight", { F, D }, l .. "feed_forward.w2.weight", "t")
      add(h .. "mlp.c_proj.bias", { D }, l .. "feed_forward.w2.bias")
    end
    add("ln_f.weight", { D }, "norm.weight")
    add("ln_f.bias", { D }, "norm.bias")
    if not a.weight_tying then add("lm_head.weight", { a.vocab_size, D }, "output.weight") end
  else
    local D, hd, F = a.dim, a.dim / a.n_heads, models.llama_ffn_dim(a)
    local Q, KV = a.n_heads * hd, a.n_kv_heads * hd
    add("model.embed_tokens.weight", { a.vocab_size, D }, "tok_embeddings.weight")
    for i = 0, a.n_layers - 1 do
      local h, l = "model.layers." .. i .. ".", "layers." .. i .. "."
      add(h .. "self_attn.q_proj.weight", { Q, D }, l .. "attention.wq.weight", "perm", a.n_heads)
      add(h .. "self_attn.k_proj.weight", { KV, D }, l .. "attention.wk.weight", "perm", a.n_kv_heads)
      add(h .. "self_attn.v_proj.weight", { KV, D }, l .. "attention.wv.weight")
      add(h .. "self_attn.o_proj.weight", { D, Q }, l .. "attention.wo.weight")
      add(h .. "mlp.gate_proj.weight", { F, D }, l .. "feed_forward.w1.weight")
      add(h .. "mlp.up_proj.weight", { F, D }, l .. "feed_forward.w3.weight")
      add(h .. "mlp.down_proj.weight", { D, F }, l .. "feed_forward.w2.weight")
      add(h .. "input_layernorm.weight", { D }, l .. "attention_norm.weight")
      add(h .. "post_attention_layernorm.weight", { D }, l .. "ffn_norm.weight")
    end
    add("model.norm.weight", { D }, "norm.weight")
    if not a.weight_tying then add("lm_head.weight", { a.vocab_size, D }, "output.weight") end
  end
  return e
end

-- names in HF files that carry no parameter
local function ignored(kind, name)
  if kind == "gpt2" then
    return name:match("^h%.%d+%.attn%.bias$") or name:match("^h%.%d+%.attn%.masked_bias$") or name == "lm_head.weight"
  end
  return name:match("rotary_emb%.inv_freq$") or name == "lm_head.weight"
end

-- HF [H * hd, C] (halves) <-> engine (interleaved pairs): engine row h*hd + 2i + a = HF row h*hd + a*hd/2 + i
local function perm_from_hf(w, H)
  local R, C = w:size(1), w:size(2)
  local hd = R / H
  return w:contiguous():view(H, 2, hd / 2, C):transpose(2, 3):reshape(R, C)
end
local function perm_to_hf(w, H)
  local R, C = w:size(1), w:size(2)
  local hd = R / H
  return w:contiguous():view(H, hd / 2, 2, C):transpose(2, 3):reshape(R, C)
end
M._perm_from_hf, M._perm_to_hf = perm_from_hf, perm_to_hf

local function same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- from_hf(tensors, kind, args, op, where, strict) -> engine state dict (full tensors), the HF names used
local function from_hf(tensors, kind, a, op, where, strict)
  local prefixed = {}
  if kind == "gpt2" then
    -- GPT2LMHeadModel's "transformer." prefix, or none (GPT2Model, the hub's gpt2)
    for name, t in pairs(tensors) do
      local n = name:match("^transformer%.(.*)$")
      if n then prefixed[n] = name end
    end
  end
  local pre = next(prefixed) ~= nil and "transformer." or ""
  local function find(hf)
    local full = prefixed[hf] or hf
    return tensors[full], full
  end
  local sd, used, missing = {}, {}, {}
  local es = entries(kind, a)
  for _, e in ipairs(es) do
    local t, full = find(e.hf)
    if t == nil then
      missing[#missing + 1] = (kind == "gpt2" and e.hf ~= "lm_head.weight") and (pre .. e.hf) or e.hf
    else
      used[full] = true
      if not same_shape(t:shape(), e.shape) then
        fail(string.format("%s: %s: tensor '%s' has shape %s, expected %s from config.json", op, where, full,
          shape_str(t:shape()), shape_str(e.shape)))
      end
      if not t:is_floating_point() then
        fail(string.format("%s: %s: tensor '%s' is %s, not a floating-point tensor", op, where, full, t.dtype))
      end
      local c = e.conv
      if c == "copy" or c == "bias" then sd[e.eng] = t
      elseif c == "t" then sd[e.eng] = t:transpose(1, 2):contiguous()
      elseif c == "perm" then sd[e.eng] = perm_from_hf(t, e.heads)
      elseif c == "qkv_w" then
        local w, D = t:transpose(1, 2):contiguous(), a.dim
        for j = 1, 3 do sd[e.eng[j]] = w:narrow(1, (j - 1) * D + 1, D) end
      elseif c == "qkv_b" then
        for j = 1, 3 do sd[e.eng[j]] = t:narrow(1, (j - 1) * a.dim + 1, a.dim) end
      end
    end
  end
  if #missing > 0 then
    local more = #missing > 8 and string.format(" and %d more", #missing - 8) or ""
    fail(string.format("%s: %s: missing tensor%s %s%s (a %s model with this config.json needs them)", op, where,
      #missing > 1 and "s" or "", "'" .. table.concat({ unpack(missing, 1, math.min(8, #missing)) }, "', '") .. "'",
      more, kind))
  end
  if strict ~= false then
    local extra = {}
    for name in pairs(tensors) do
      local short = kind == "gpt2" and (name:match("^transformer%.(.*)$") or name) or name
      if not used[name] and not ignored(kind, short) then extra[#extra + 1] = name end
    end
    table.sort(extra)
    if #extra > 0 then
      local more = #extra > 8 and string.format(" and %d more", #extra - 8) or ""
      fail(string.format("%s: %s: unexpected tensor%s '%s'%s (not part of a %s model with this config.json; "
        .. "{strict = false} ignores them)", op, where, #extra > 1 and "s" or "",
        table.concat({ unpack(extra, 1, math.min(8, #extra)) }, "', '"), more, kind))
    end
  end
  if a.weight_tying then sd["output.weight"] = sd["tok_embeddings.weight"] end
  return sd
end
M.from_hf = api(function(tensors, kind, a)
  if type(tensors) ~= "table" then fail("hf.from_hf: expected a table HF name -> tensor") end
  if kind ~= "gpt2" and kind ~= "llama" then fail("hf.from_hf: model_type must be gpt2 or llama, got " .. tostring(kind)) end
  a = (kind == "gpt2" and models.ModelArgs or models.LlamaArgs)(a)
  return from_hf(tensors, kind, a, "hf.from_hf", "tensors", true)
end)

-- to_hf(model, dtype, op) -> HF name -> tensor (full, plain, contiguous), config.  Collective for DTensor
-- parameters (full_tensor, in state-dict order on every rank).
local function to_hf(model, dtype, op)
  local kind = model_kind(model, op)
  local a = model.model_args
  local cfg = config_of(model, dtype, op)
  local sd = model:state_dict()
  local full = {}
  local function get(name)
    local t = full[name]
    if t == nil then
      t = sd[name]
      if t == nil then return nil end
      if t._c.dist ~= nil then t = t:full_tensor() end
      if dtype and t.dtype ~= dtype then t = t:to(dtype) end
      full[name] = t
    end
    return t
  end
  -- gather in the state dict's order (the same on every rank)
  for _, name in ipairs(model:state_dict_keys()) do get(name) end
  local out = {}
  for _, e in ipairs(entries(kind, a)) do
    local c = e.conv
    local t
    if c == "copy" then t = get(e.eng)
    elseif c == "t" then t = get(e.eng):transpose(1, 2):contiguous()
    elseif c == "perm" then t = perm_to_hf(get(e.eng), e.heads)
    elseif c == "bias" then
      t = get(e.eng) or engine.zeros(e.shape, { dtype = get(e.eng:gsub("bias$", "weight")).dtype })
    elseif c == "qkv_w" then
      t = engine.cat({ get(e.eng[1]), get(e.eng[2]), get(e.eng[3]) }, 1):transpose(1, 2):contiguous()
    elseif c == "qkv_b" then
      if get(e.eng[1]) then t = engine.cat({ get(e.eng[1]), get(e.eng[2]), get(e.eng[3]) }, 1)
      else t = engine.zeros(e.shape, { dtype = get(e.eng[1]:gsub("bias$", "weight")).dtype }) end
    end
    if t == nil then fail(string.format("%s: the model has no '%s'", op, tostring(e.eng))) end
    if not same_shape(t:shape(), e.shape) then
      fail(string.format("%s: '%s' has shape %s, expected %s", op, e.hf, shape_str(t:shape()), shape_str(e.shape)))
    end
    local name = e.hf
    if kind == "gpt2" and name ~= "lm_head.weight" then name = "transformer." .. name end
    out[name] = t
  end
  return out, cfg
end
M.to_hf = api(function(model) return to_hf(model, nil, "hf.to_hf") end)

-- ---------------------------------------------------------------- load
local function check_opts(opts, known, op)
  if opts == nil then return {} end
  if type(opts) ~= "table" then fail(op .. ": options must be a table, got " .. type(opts)) end
  for k in pairs(opts) do
    local ok = false
    for _, n in ipairs(known) do if n == k then ok = true end end
    if not ok then
      fail(string.format("%s: unknown option '%s' (known: %s)", op, tostring(k), table.concat(known, ", ")))
    end
  end
  return opts
end

local function load_into(model, kind, a, tensors, op, where, strict)
  local sd = from_hf(tensors, kind, a, op, where, strict)
  local ok, err = pcall(model.load_state_dict, model, sd)
  if not ok then fail(string.format("%s: %s: %s", op, where, tostring(err))) end
end

M.load = api(function(path, opts)
  local op = "hf.load"
  opts = check_opts(opts, { "dtype", "device", "max_seq_len", "strict" }, op)
  local tensors, cfg, files = read_weights(path, op, true)
  local kind, a = args_of(cfg, opts, op)
  local dtype = opts.dtype or "f32"
  if dtype == "auto" then
    local td = cget(cfg, "torch_dtype") or cget(cfg, "dtype") or "float32"
    dtype = DTYPE_OF_TORCH[td]
    if not dtype then fail(string.format("%s: config.json: torch_dtype '%s' is not supported", op, tostring(td))) end
  elseif not TORCH_OF_DTYPE[dtype] then
    fail(op .. ": dtype must be f32, bf16, f16, f64 or \"auto\", got " .. tostring(dtype))
  end
  local model = kind == "gpt2" and models.Transformer(a) or models.Llama(a)
  if dtype ~= "f32" then model:to(dtype) end
  load_into(model, kind, a, tensors, op, path, opts.strict)
  if opts.device ~= nil then model:to(opts.device) end
  model:eval()
  model.hf_config = cfg
  local first
  for _, t in pairs(tensors) do first = t.dtype; break end
  return model, { model_type = kind, config = cfg, args = a, files = files, dtype = first }
end)

-- the fields of the model's args that config.json must agree with
local COMPARE = {
  gpt2 = { "n_layers", "dim", "n_heads", "vocab_size", "max_seq_len", "weight_tying", "gelu", "norm_eps", "attn_bias" },
  llama = { "n_layers", "dim", "n_heads", "n_kv_heads", "vocab_size", "ffn", "norm_eps", "rope_theta", "weight_tying" },
}

M.load_state_dict_into = api(function(model, path, opts)
  local op = "hf.load_state_dict_into"
  opts = check_opts(opts, { "strict" }, op)
  local kind = model_kind(model, op)
  local tensors, cfg, files = read_weights(path, op, false)
  local ma = model.model_args
  if cfg then
    local fkind, fa = args_of(cfg, { max_seq_len = kind == "llama" and ma.max_seq_len or nil }, op)
    if fkind ~= kind then
      fail(string.format("%s: %s holds a %s model, the model is an %s", op, path, fkind,
        kind == "gpt2" and "nn.Transformer (gpt2)" or "nn.Llama (llama)"))
    end
    for _, k in ipairs(COMPARE[kind]) do
      local x, y = ma[k], fa[k]
      if k == "ffn" then x, y = models.llama_ffn_dim(ma), models.llama_ffn_dim(fa) end
      local same = x == y or (type(x) == "number" and type(y) == "number" and math.abs(x - y) <= 1e-9 * math.abs(y))
      if not same then
        fail(string.format("%s: %s: config.json gives %s = %s, the model has %s%s", op, path,
          k == "ffn" and "the feed-forward size" or k, tostring(y), tostring(x),
          k == "attn_bias" and " (build nn.Transformer with attn_bias = true for GPT-2 weights)" or ""))
      end
    end
  end
  load_into(model, kind, ma, tensors, op, path, opts.strict)
  if cfg then model.hf_config = cfg end
  return { model_type = kind, config = cfg, files = files }
end)

-- ---------------------------------------------------------------- save
local function dist_world()
  if not package.loaded["engine.distributed"] then return nil end
  local C = engine.C
  if C.eng_dist_is_initialized() == 0 or C.eng_dist_world_size() <= 1 then return nil end
  return C.eng_dist_rank()
end

-- every rank learns whether any rank failed (collective); the failing rank's message where it occurred
local function agree(err, op)
  local C = engine.C
  if err then C.eng_set_error_message(err) end
  local world = C.eng_pg_world()
  local rc = C.eng_pg_agree(world, err and 1 or 0, 0, op)
  C.eng_pg_release(world)
  if rc ~= 0 then
    if err then fail(err) end
    fail(op .. ": failed on another rank: " .. require("engine.core").last_error())
  end
end

local function prepare_dir(dir, overwrite, op)
  if is_dir(dir) then
    local names = list_dir(dir)
    if #names > 0 then
      if not overwrite then
        fail(string.format("%s: %s exists and is not empty (%d entries); {overwrite = true} replaces its config.json "
          .. "and model*.safetensors", op, dir, #names))
      end
      for _, n in ipairs(names) do
        if n == "config.json" or n:match("^model.*%.safetensors$") or n == "model.safetensors.index.json" then
          os.remove(dir .. "/" .. n)
        end
      end
    end
  elseif file_exists(dir) then
    fail(string.format("%s: %s exists and is not a folder", op, dir))
  else
    os.execute("mkdir -p " .. quote(dir))
    if not is_dir(dir) then fail(string.format("%s: cannot create the folder %s", op, dir)) end
  end
end

M.save = api(function(model, dir, opts)
  local op = "hf.save"
  opts = check_opts(opts, { "overwrite", "dtype", "config" }, op)
  model_kind(model, op)
  if type(dir) ~= "string" or dir == "" then fail(op .. ": dir must be a folder path (a string)") end
  if opts.dtype ~= nil and not TORCH_OF_DTYPE[opts.dtype] then
    fail(op .. ": dtype must be f32, bf16, f16 or f64, got " .. tostring(opts.dtype))
  end
  if opts.config ~= nil and type(opts.config) ~= "table" then fail(op .. ": config must be a table of fields") end
  local rank = dist_world()   -- nil: one process
  local distributed = false
  for _, p in ipairs(model:parameters()) do if p._c.dist ~= nil then distributed = true end end
  local err
  if rank == nil or rank == 0 then
    local ok, e = pcall(prepare_dir, dir, opts.overwrite, op)
    if not ok then err = tostring(e) end
  end
  if rank ~= nil and distributed then agree(err, op) elseif err then fail(err) end
  local tensors, cfg = to_hf(model, opts.dtype, op)
  for k, v in pairs(opts.config or {}) do cfg[k] = v end
  if rank == nil or rank == 0 then
    local ok, e = pcall(function()
      engine.save(dir .. "/model.safetensors", tensors, { format = "pt" })
      json.write_file(dir .. "/config.json", cfg)
    end)
    if not ok then err = string.format("%s: %s: %s", op, dir, tostring(e)) end
  end
  if rank ~= nil and distributed then agree(err, op) elseif err then fail(err) end
  return cfg
end)

return M
