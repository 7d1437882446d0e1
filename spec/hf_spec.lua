-- engine.hf (lua/engine/hf.lua): Hugging Face import and export (issue 29, item 5).  The fixtures are tiny
-- random models made by transformers itself (tools/gen_hf_fixtures.py, offline): spec/fixtures/hf/gpt2-tiny
-- (GPT2LMHeadModel, tied, gelu_new) and llama-tiny (LlamaForCausalLM, GQA 4/2 heads, intermediate_size 80,
-- rope_theta 500000, sharded files), each with its eval-mode logits for fixed token ids.  The other direction
-- (an engine export loaded by transformers) needs Python: tools/check_hf_export.py, recorded in docs/hf.md.
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local nn, models = engine.nn, engine.models
local hf = require("engine.hf")
local json = require("engine.json")
local err = require("spec.helpers.errors").err

local FIX = "spec/fixtures/hf/"

local function maxdiff(a, b) return (a:double() - b:double()):abs():max():item() end
local function logits_of(model, tokens) return engine.no_grad(function() return model(tokens) end) end
local function sh(cmd) local r = os.execute(cmd); return r == 0 or r == true end
local function q(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local tmp_root
local function tmpdir(name)
  if not tmp_root then
    tmp_root = os.tmpname()
    os.remove(tmp_root)
    assert(sh("mkdir -p " .. q(tmp_root)))
  end
  local d = tmp_root .. "/" .. name
  sh("rm -rf " .. q(d))
  return d
end

-- a copy of a fixture folder whose tensors / config are edited by fn(tensors, cfg)
local function edited_copy(fixture, name, fn)
  local d = tmpdir(name)
  assert(sh("mkdir -p " .. q(d)))
  local tensors = engine.load(FIX .. fixture .. "/model.safetensors")
  local cfg = json.read_file(FIX .. fixture .. "/config.json")
  fn(tensors, cfg)
  engine.save(d .. "/model.safetensors", tensors, { format = "pt" })
  json.write_file(d .. "/config.json", cfg)
  return d
end

-- every tensor of an HF folder (single file or shards), by name
local function folder_tensors(dir)
  local f = io.open(dir .. "/model.safetensors", "rb")
  if f then f:close(); return (engine.load(dir .. "/model.safetensors")) end
  local idx = json.read_file(dir .. "/model.safetensors.index.json")
  local out, seen = {}, {}
  for _, file in pairs(idx.weight_map) do
    if not seen[file] then
      seen[file] = true
      for k, v in pairs(engine.load(dir .. "/" .. file)) do out[k] = v end
    end
  end
  return out
end

teardown(function() if tmp_root then sh("rm -rf " .. q(tmp_root)) end end)

describe("hf.load: logits equal transformers' (f32)", function()
  for _, case in ipairs({
    { name = "gpt2-tiny", class = "Transformer", kind = "gpt2" },
    { name = "llama-tiny", class = "Llama", kind = "llama" },
  }) do
    it(case.name, function()
      local model, info = hf.load(FIX .. case.name)
      local ref = engine.load(FIX .. case.name .. ".logits.safetensors")
      assert.is_true(model:is_a(models[case.class]))
      assert.are.equal(case.kind, info.model_type)
      assert.are.equal("f32", info.dtype)
      assert.is_false(model.training)           -- eval mode, as from_pretrained
      local logits = logits_of(model, ref.tokens)
      assert.are.same(ref.logits:shape(), logits:shape())
      local d = maxdiff(logits, ref.logits)
      assert.is_true(d < 1e-5, case.name .. ": max |engine - transformers| = " .. d)
      assert.is_true(ref.logits:abs():max():item() > 1)   -- not trivially small logits
    end)
  end

  it("maps GPT-2's config onto ModelArgs (biases, tanh GELU, tied output, fused QKV with biases)", function()
    local model, info = hf.load(FIX .. "gpt2-tiny")
    local a = info.args
    assert.are.same({ 2, 32, 4, 96, 32, true, "tanh", true, 1e-5 }, { a.n_layers, a.dim, a.n_heads, a.vocab_size,
      a.max_seq_len, a.attn_bias, a.gelu, a.weight_tying, a.norm_eps })
    assert.are.equal(model.tok_embeddings.weight, model.output.weight)
    local at = model.layers[1].attention
    assert.is_true(engine.tensors_adjacent({ at.wq.weight, at.wk.weight, at.wv.weight }, 1))
    assert.is_true(engine.tensors_adjacent({ at.wq.bias, at.wk.bias, at.wv.bias }, 1))
    assert.is_not_nil(at.wo.bias)
    -- the split of c_attn: wk's rows are columns D+1..2D of c_attn (Conv1D stores [in, out])
    local t = engine.load(FIX .. "gpt2-tiny/model.safetensors")
    local c = t["transformer.h.0.attn.c_attn.weight"]
    assert.are.equal(0, maxdiff(at.wk.weight, c:narrow(2, 33, 32):transpose(1, 2)))
    assert.are.equal(0, maxdiff(at.wv.bias, t["transformer.h.0.attn.c_attn.bias"]:narrow(1, 65, 32)))
  end)

  it("maps Llama's config onto LlamaArgs (GQA, intermediate_size, rope_theta, rms_norm_eps; sharded files)", function()
    local model, info = hf.load(FIX .. "llama-tiny")
    local a = info.args
    assert.are.same({ 32, 2, 4, 2, 96, 80, 500000, 1e-6, false, 64 }, { a.dim, a.n_layers, a.n_heads, a.n_kv_heads,
      a.vocab_size, a.ffn_hidden_dim, a.rope_theta, a.norm_eps, a.weight_tying, a.max_seq_len })
    assert.are.equal(2, #info.files)
    assert.are.same({ 16, 32 }, model.layers[1].attention.wk.weight:shape())
    assert.are.same({ 80, 32 }, model.layers[1].feed_forward.w1.weight:shape())
    assert.are_not.equal(model.tok_embeddings.weight, model.output.weight)
    local at = model.layers[2].attention
    assert.is_true(engine.tensors_adjacent({ at.wq.weight, at.wk.weight, at.wv.weight }, 1))
  end)

  it("options: dtype (bf16, auto), max_seq_len, unknown keys", function()
    local m = hf.load(FIX .. "llama-tiny", { dtype = "bf16", max_seq_len = 16 })
    assert.are.equal("bf16", m.layers[1].attention.wq.weight.dtype)
    assert.are.equal(16, m.max_seq_len)
    local ref = engine.load(FIX .. "llama-tiny.logits.safetensors")
    local l = logits_of(m, ref.tokens)
    assert.is_true(maxdiff(l, ref.logits) < 0.25)                         -- bf16 weights: close, not equal
    assert.are.equal("f32", hf.load(FIX .. "gpt2-tiny", { dtype = "auto" }).output.weight.dtype)
    err(function() hf.load(FIX .. "gpt2-tiny", { dtypes = "f32" }) end, "hf.load: unknown option 'dtypes'")
    err(function() hf.load(FIX .. "gpt2-tiny", { dtype = "i32" }) end, "dtype must be f32, bf16, f16, f64")
    err(function() hf.load(FIX .. "gpt2-tiny", { max_seq_len = 8 }) end, "max_seq_len is for Llama models")
  end)
end)

describe("the rotary permutation of q/k rows", function()
  it("HF's halves become interleaved pairs within each head, and back", function()
    -- 2 heads of head_dim 4, one column: HF rows (h, a, i) = h*4 + a*2 + i
    local w = engine.tensor({ { 0 }, { 1 }, { 2 }, { 3 }, { 4 }, { 5 }, { 6 }, { 7 } })
    local e = hf._perm_from_hf(w, 2)
    -- engine row h*4 + 2i + a = HF row h*4 + a*2 + i: [0, 2, 1, 3, 4, 6, 5, 7]
    assert.are.same({ 0, 2, 1, 3, 4, 6, 5, 7 }, e:view(8):tolist_flat())
    assert.are.equal(0, maxdiff(hf._perm_to_hf(e, 2), w))
    local r = engine.randn(24, 5)
    assert.are.equal(0, maxdiff(hf._perm_to_hf(hf._perm_from_hf(r, 3), 3), r))
  end)
end)

local REQUIRED = {
  ["gpt2-tiny"] = { "architectures", "model_type", "vocab_size", "n_positions", "n_embd", "n_layer", "n_head",
    "n_inner", "activation_function", "layer_norm_epsilon", "tie_word_embeddings", "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx", "bos_token_id", "eos_token_id", "dtype" },
  ["llama-tiny"] = { "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_parameters", "attention_bias", "mlp_bias",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "dtype" },
}

describe("hf.save", function()
  for _, name in ipairs({ "gpt2-tiny", "llama-tiny" }) do
    it(name .. ": config.json, tensor names, shapes and values equal the fixture's; load gives identical logits",
      function()
        local model = hf.load(FIX .. name)
        local d = tmpdir("save-" .. name)
        local cfg = hf.save(model, d)
        local fix_cfg = json.read_file(FIX .. name .. "/config.json")
        local out_cfg = json.read_file(d .. "/config.json")
        assert.are.same(cfg.architectures, out_cfg.architectures)
        -- every field the export writes has the fixture's value (torch_dtype: transformers 5 writes "dtype";
        -- rope_theta: older transformers read it at the top level) ...
        for k, w in pairs(out_cfg) do
          if k ~= "torch_dtype" and k ~= "rope_theta" then
            local v = fix_cfg[k]
            assert.is_not_nil(v, "the export writes a field the fixture lacks: " .. k)
            if type(v) == "number" and type(w) == "number" then
              assert.is_true(math.abs(v - w) <= 1e-12 * math.abs(v), k)
            else
              assert.are.same(v, w, "config.json field " .. k)
            end
          end
        end
        -- ... and it writes every field that shapes the model
        for _, k in ipairs(REQUIRED[name]) do assert.is_not_nil(out_cfg[k], "the export lacks " .. k) end
        local a, b = folder_tensors(FIX .. name), folder_tensors(d)
        local n = 0
        for k, t in pairs(a) do
          n = n + 1
          assert.is_not_nil(b[k], "export lacks " .. k)
          assert.are.same(t:shape(), b[k]:shape(), k)
          assert.are.equal(0, maxdiff(t, b[k]), k)
        end
        for k in pairs(b) do assert.is_not_nil(a[k], "export has an extra tensor " .. k) end
        assert.is_true(n > 20)
        local _, meta = engine.load(d .. "/model.safetensors")
        assert.are.equal("pt", meta.format)
        local ref = engine.load(FIX .. name .. ".logits.safetensors")
        assert.are.equal(0, maxdiff(logits_of(hf.load(d), ref.tokens), logits_of(model, ref.tokens)))
      end)
  end

  it("round-trips engine-built models (GPT with and without attention biases, untied; Llama with GQA and tying)",
    function()
      engine.manual_seed(7)
      local tokens = engine.tensor({ { 1, 5, 9, 2, 7, 3 }, { 0, 4, 8, 6, 2, 1 } }, "i64")
      local cases = {
        nn.Transformer{ n_layers = 2, dim = 32, n_heads = 4, vocab_size = 40, max_seq_len = 16, attn_bias = true,
          gelu = "tanh", weight_tying = false },
        nn.Transformer{ n_layers = 1, dim = 16, n_heads = 2, vocab_size = 24, max_seq_len = 8 },
        nn.Llama{ dim = 32, n_layers = 2, n_heads = 4, n_kv_heads = 2, vocab_size = 40, multiple_of = 16,
          max_seq_len = 16, weight_tying = true },
        nn.Llama{ dim = 32, n_layers = 1, n_heads = 4, n_kv_heads = 1, vocab_size = 40, ffn_hidden_dim = 50,
          max_seq_len = 16, rope_theta = 1000, norm_eps = 1e-6 },
      }
      for i, m in ipairs(cases) do
        m:eval()
        local d = tmpdir("engine-" .. i)
        hf.save(m, d)
        local back, info = hf.load(d)
        assert.are.equal(0, maxdiff(logits_of(back, tokens), logits_of(m, tokens)), "case " .. i)
        if i == 2 then
          -- no attention biases in the engine model: zero biases in the export, the same function
          assert.is_true(info.args.attn_bias)
          assert.are.equal(0, back.layers[1].attention.wq.bias:abs():max():item())
          assert.are.equal("gelu", info.config.activation_function)
        end
        if i == 3 then assert.are.equal(back.tok_embeddings.weight, back.output.weight) end
        if i == 4 then assert.are.equal(50, info.config.intermediate_size) end
      end
    end)

  it("writes bf16 on request; refuses a non-empty folder unless overwrite (keeping other files)", function()
    local model = hf.load(FIX .. "gpt2-tiny")
    local d = tmpdir("overwrite")
    hf.save(model, d, { dtype = "bf16", config = { eos_token_id = 5 } })
    local t = engine.load(d .. "/model.safetensors")
    assert.are.equal("bf16", t["transformer.wte.weight"].dtype)
    local cfg = json.read_file(d .. "/config.json")
    assert.are.equal("bfloat16", cfg.torch_dtype)
    assert.are.equal(5, cfg.eos_token_id)
    assert.are.equal(0, cfg.bos_token_id)                 -- carried over from the loaded config
    err(function() hf.save(model, d) end, "hf.save: " .. d .. " exists and is not empty", "overwrite = true")
    local f = assert(io.open(d .. "/tokenizer.json", "w")); f:write("{}"); f:close()
    hf.save(model, d, { overwrite = true })
    assert.are.equal("f32", engine.load(d .. "/model.safetensors")["transformer.wte.weight"].dtype)
    assert.is_not_nil(io.open(d .. "/tokenizer.json"))
    err(function() hf.save(model, d, { overwrite = true, dtype = "i64" }) end, "dtype must be f32, bf16")
    err(function() hf.save(model, d, { over = true }) end, "hf.save: unknown option 'over'")
    err(function() hf.save(nn.Linear(2, 2), d) end, "expected an nn.Transformer (GPT-2) or nn.Llama")
    err(function() hf.save(nn.Transformer{ use_attn_mask = false }, tmpdir("nomask")) end, "use_attn_mask = false")
  end)
end)

describe("hf.load_state_dict_into", function()
  it("fills a model a recipe built (fused QKV stays fused); a folder or one .safetensors file", function()
    local ref = engine.load(FIX .. "llama-tiny.logits.safetensors")
    local m = nn.Llama{ dim = 32, n_layers = 2, n_heads = 4, n_kv_heads = 2, vocab_size = 96, ffn_hidden_dim = 80,
      rope_theta = 500000, norm_eps = 1e-6, max_seq_len = 32 }
    local info = hf.load_state_dict_into(m, FIX .. "llama-tiny")
    assert.are.equal("llama", info.model_type)
    assert.is_true(maxdiff(logits_of(m, ref.tokens), ref.logits) < 1e-5)
    local at = m.layers[1].attention
    assert.is_true(engine.tensors_adjacent({ at.wq.weight, at.wk.weight, at.wv.weight }, 1))

    local g = nn.Transformer{ n_layers = 2, dim = 32, n_heads = 4, vocab_size = 96, max_seq_len = 32,
      attn_bias = true, gelu = "tanh" }
    g:eval()
    hf.load_state_dict_into(g, FIX .. "gpt2-tiny/model.safetensors")
    local gref = engine.load(FIX .. "gpt2-tiny.logits.safetensors")
    assert.is_true(maxdiff(logits_of(g, gref.tokens), gref.logits) < 1e-5)
  end)

  it("names the field where config.json and the model differ", function()
    local base = { dim = 32, n_layers = 2, n_heads = 4, n_kv_heads = 2, vocab_size = 96, ffn_hidden_dim = 80,
      rope_theta = 500000, norm_eps = 1e-6, max_seq_len = 32 }
    local function llama(over)
      local t = {}
      for k, v in pairs(base) do t[k] = v end
      for k, v in pairs(over) do t[k] = v end
      return nn.Llama(t)
    end
    err(function() hf.load_state_dict_into(llama{ norm_eps = 1e-5 }, FIX .. "llama-tiny") end,
      "config.json gives norm_eps = 1e-06, the model has 1e-05")
    err(function() hf.load_state_dict_into(llama{ rope_theta = 10000 }, FIX .. "llama-tiny") end, "rope_theta")
    err(function() hf.load_state_dict_into(llama{ n_kv_heads = 4 }, FIX .. "llama-tiny") end,
      "n_kv_heads = 2, the model has 4")
    err(function() hf.load_state_dict_into(llama{ ffn_hidden_dim = 64 }, FIX .. "llama-tiny") end,
      "the feed-forward size = 80, the model has 64")
    local g = nn.Transformer{ n_layers = 2, dim = 32, n_heads = 4, vocab_size = 96, max_seq_len = 32, gelu = "tanh" }
    err(function() hf.load_state_dict_into(g, FIX .. "gpt2-tiny") end, "attn_bias = true, the model has false",
      "build nn.Transformer with attn_bias = true")
    err(function() hf.load_state_dict_into(g, FIX .. "llama-tiny") end, "holds a llama model")
    err(function() hf.load_state_dict_into(nn.Linear(2, 2), FIX .. "llama-tiny") end, "expected an nn.Transformer")
  end)
end)

describe("hf.load errors", function()
  it("an unknown or unsupported model_type / config field names it", function()
    local d = edited_copy("gpt2-tiny", "bert", function(_, cfg) cfg.model_type = "bert" end)
    err(function() hf.load(d) end, "hf.load: config.json: model_type 'bert' is not supported (gpt2 or llama)")
    d = edited_copy("gpt2-tiny", "inner", function(_, cfg) cfg.n_inner = 100 end)
    err(function() hf.load(d) end, "n_inner = 100 is not supported")
    d = edited_copy("gpt2-tiny", "relu", function(_, cfg) cfg.activation_function = "relu" end)
    err(function() hf.load(d) end, "activation_function = relu is not supported")
  end)

  it("Llama rope scaling, biases, a head_dim of its own", function()
    local idx = json.read_file(FIX .. "llama-tiny/model.safetensors.index.json")
    local function llama_copy(name, edit)
      local d = tmpdir(name)
      assert(sh("cp -r " .. q(FIX .. "llama-tiny") .. " " .. q(d)))
      local cfg = json.read_file(d .. "/config.json")
      edit(cfg)
      json.write_file(d .. "/config.json", cfg)
      return d
    end
    assert.is_not_nil(idx.weight_map)
    local d = llama_copy("rope3", function(c) c.rope_parameters = { rope_type = "llama3", rope_theta = 500000, factor = 8 } end)
    err(function() hf.load(d) end, "rope_parameters.rope_type = llama3 is not supported")
    d = llama_copy("abias", function(c) c.attention_bias = true end)
    err(function() hf.load(d) end, "attention_bias = true is not supported")
    d = llama_copy("hdim", function(c) c.head_dim = 16 end)
    err(function() hf.load(d) end, "head_dim = 16 is not supported")
    -- an older config: rope_theta at the top level, no rope_parameters
    d = llama_copy("old", function(c) c.rope_parameters = nil; c.rope_theta = 500000 end)
    local ref = engine.load(FIX .. "llama-tiny.logits.safetensors")
    assert.is_true(maxdiff(logits_of(hf.load(d), ref.tokens), ref.logits) < 1e-5)
    -- a shard the index names but that lacks the tensor
    d = llama_copy("badindex", function() end)
    local ix = json.read_file(d .. "/model.safetensors.index.json")
    ix.weight_map["model.norm.weight"] = ix.weight_map["lm_head.weight"] == "model-00001-of-00002.safetensors"
      and "model-00002-of-00002.safetensors" or "model-00001-of-00002.safetensors"
    json.write_file(d .. "/model.safetensors.index.json", ix)
    err(function() hf.load(d) end, "lists tensor 'model.norm.weight'", "which does not hold it")
  end)

  it("missing, mis-shaped and unexpected tensors are named", function()
    local d = edited_copy("gpt2-tiny", "missing", function(t) t["transformer.h.1.ln_2.weight"] = nil end)
    err(function() hf.load(d) end, "missing tensor 'transformer.h.1.ln_2.weight'")
    d = edited_copy("gpt2-tiny", "shape", function(t)
      t["transformer.h.0.attn.c_attn.weight"] = engine.zeros(32, 64)
    end)
    err(function() hf.load(d) end, "tensor 'transformer.h.0.attn.c_attn.weight' has shape [32,64], expected [32,96]")
    d = edited_copy("gpt2-tiny", "extra", function(t)
      t["transformer.h.0.attn.extra"] = engine.zeros(3)
      t["transformer.h.0.attn.bias"] = engine.zeros(1, 1, 32, 32)      -- the old causal-mask buffer: ignored
    end)
    err(function() hf.load(d) end, "unexpected tensor 'transformer.h.0.attn.extra'", "{strict = false}")
    local ref = engine.load(FIX .. "gpt2-tiny.logits.safetensors")
    assert.is_true(maxdiff(logits_of(hf.load(d, { strict = false }), ref.tokens), ref.logits) < 1e-5)
    -- GPT2Model's names (no "transformer." prefix, as the hub's gpt2) load too
    d = edited_copy("gpt2-tiny", "noprefix", function(t)
      local names = {}
      for k in pairs(t) do names[#names + 1] = k end
      for _, k in ipairs(names) do
        local s = k:match("^transformer%.(.*)$")
        if s then t[s] = t[k]; t[k] = nil end
      end
      t["h.1.mlp.c_fc.bias"] = nil
    end)
    err(function() hf.load(d) end, "missing tensor 'h.1.mlp.c_fc.bias'")
  end)

  it("paths: not a folder, no config.json, no safetensors", function()
    err(function() hf.load(FIX .. "nope") end, "is not a folder")
    local d = tmpdir("empty")
    assert(sh("mkdir -p " .. q(d)))
    err(function() hf.load(d) end, "has no model.safetensors or model.safetensors.index.json")
    local f = assert(io.open(d .. "/pytorch_model.bin", "w")); f:write("x"); f:close()
    err(function() hf.load(d) end, "only PyTorch pickle weights")
    d = tmpdir("nocfg")
    assert(sh("mkdir -p " .. q(d) .. " && cp " .. q(FIX .. "gpt2-tiny/model.safetensors") .. " " .. q(d)))
    err(function() hf.load(d) end, "has no config.json")
    err(function() hf.load(42) end, "path must be a string")
  end)
end)
