-- engine.hf with distributed models (lua/engine/hf.lua): Hugging Face weights loaded into a model under
-- tensor parallelism (Llama.parallelize, Transformer.parallelize with GPT-2's attention biases: Colwise
-- shards wq/wk/wv's biases, Rowwise replicates wo's) or FSDP (fully_shard) give transformers' logits, and
-- hf.save of a distributed model (every rank calls it; full_tensor is collective, rank 0 writes) writes the
-- fixture's tensors.  The fixtures are spec/fixtures/hf (tools/gen_hf_fixtures.py).
local engine = require("engine")
local nn = engine.nn
local dist = engine.distributed
local models = require("engine.models")
local hf = require("engine.hf")

local W, R = dist.world_size(), dist.rank()
-- tensor parallelism over at most 2 ranks (the fixture's Llama has 2 k/v heads), rows of a 2-D mesh beyond
-- that; FSDP over the whole world
local TP = math.min(W, 2)
local mesh = dist.init_device_mesh("cpu", { W }, { "dp" })
local tp_mesh = dist.init_device_mesh("cpu", { W / TP, TP }, { "dp", "tp" })["tp"]
local FIX = "spec/fixtures/hf/"

local function maxdiff(a, b) return (a:double() - b:double()):abs():max():item() end
local function logits_of(model, tokens) return engine.no_grad(function() return model(tokens) end) end

-- one folder name for every rank (rank 0's random number)
local tmp
local function tmpdir(name)
  if not tmp then
    local t = engine.tensor({ R == 0 and math.random(1, 2 ^ 30) + os.time() % 100000 or 0 }, "f64")
    dist.broadcast(t, 0)
    tmp = string.format("/tmp/hf_dist_spec_%d", t:item())
  end
  return tmp .. "/" .. name
end
teardown(function()
  dist.barrier()
  if tmp and R == 0 then os.execute("rm -rf '" .. tmp .. "'") end
end)

local LLAMA = { dim = 32, n_layers = 2, n_heads = 4, n_kv_heads = 2, vocab_size = 96, ffn_hidden_dim = 80,
  rope_theta = 500000, norm_eps = 1e-6, max_seq_len = 32 }
local GPT2 = { n_layers = 2, dim = 32, n_heads = 4, vocab_size = 96, max_seq_len = 32, attn_bias = true, gelu = "tanh" }

local function same_tensors(dir, fixture)
  local a = engine.load(dir .. "/model.safetensors")
  local b = {}
  if fixture == "gpt2-tiny" then b = engine.load(FIX .. fixture .. "/model.safetensors")
  else
    for _, f in ipairs({ "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors" }) do
      for k, v in pairs(engine.load(FIX .. fixture .. "/" .. f)) do b[k] = v end
    end
  end
  local n = 0
  for k, v in pairs(b) do
    n = n + 1
    assert.is_not_nil(a[k], "the export lacks " .. k)
    assert.are.equal(0, maxdiff(a[k], v), k)
  end
  for k in pairs(a) do assert.is_not_nil(b[k], "the export has an extra " .. k) end
  assert.is_true(n > 20)
end

describe("hf with tensor parallelism (" .. W .. " ranks)", function()
  it("Llama.parallelize, then load_state_dict_into: transformers' logits; save writes the fixture's tensors", function()
    local m = models.Llama(LLAMA)
    models.Llama.parallelize(m, tp_mesh)
    assert.is_true(dist.is_dtensor(m.layers[1].attention.wk.weight))
    hf.load_state_dict_into(m, FIX .. "llama-tiny")
    local ref = engine.load(FIX .. "llama-tiny.logits.safetensors")
    assert.is_true(maxdiff(logits_of(m, ref.tokens), ref.logits) < 1e-5)
    local d = tmpdir("llama-tp")
    hf.save(m, d)
    same_tensors(d, "llama-tiny")
  end)

  it("GPT-2 (attention biases) under Transformer.parallelize: transformers' logits; save", function()
    local m = models.Transformer(GPT2)
    m:eval()
    models.Transformer.parallelize(m, tp_mesh)
    local bq, bo = m.layers[1].attention.wq.bias, m.layers[1].attention.wo.bias
    assert.is_true(dist.is_dtensor(bq) and bq.placements[1]:is_shard())
    assert.is_true(dist.is_dtensor(bo) and bo.placements[1]:is_replicate())
    hf.load_state_dict_into(m, FIX .. "gpt2-tiny")
    local ref = engine.load(FIX .. "gpt2-tiny.logits.safetensors")
    assert.is_true(maxdiff(logits_of(m, ref.tokens), ref.logits) < 1e-5)
    local d = tmpdir("gpt2-tp")
    hf.save(m, d)
    same_tensors(d, "gpt2-tiny")
  end)

  it("a GPT with attention biases trains the same under TP as on one process", function()
    engine.manual_seed(3)
    local ref = models.Transformer{ n_layers = 2, dim = 32, n_heads = 4, vocab_size = 40, max_seq_len = 8,
      attn_bias = true, dropout_p = 0 }
    local m = models.Transformer{ n_layers = 2, dim = 32, n_heads = 4, vocab_size = 40, max_seq_len = 8,
      attn_bias = true, dropout_p = 0 }
    m:load_state_dict(ref:state_dict())
    models.Transformer.parallelize(m, tp_mesh)
    engine.manual_seed(11)
    local x = (engine.rand(2, 8) * 40):to("i64")
    local y = (engine.rand(2, 8) * 40):to("i64")
    local F = nn.functional
    local lr = F.cross_entropy(ref(x):view(-1, 40), y:view(-1))
    local lm = F.cross_entropy(m(x):view(-1, 40), y:view(-1))
    lr:backward(); lm:backward()
    assert.is_true(math.abs(lr:item() - lm:item()) < 1e-5)
    for _, name in ipairs({ "layers.0.attention.wq.bias", "layers.1.attention.wv.bias", "layers.0.attention.wo.bias" }) do
      local g = m:get_parameter(name).grad
      if dist.is_dtensor(g) then g = g:full_tensor() end
      assert.is_true(maxdiff(g, ref:get_parameter(name).grad) < 1e-5, name)
    end
  end)
end)

describe("hf with FSDP (" .. W .. " ranks)", function()
  it("fully_shard per block and root, then load_state_dict_into and save", function()
    local m = models.Llama(LLAMA)
    for _, block in ipairs(m.layers:children()) do dist.fully_shard(block, { mesh = mesh }) end
    dist.fully_shard(m, { mesh = mesh })
    hf.load_state_dict_into(m, FIX .. "llama-tiny")
    local ref = engine.load(FIX .. "llama-tiny.logits.safetensors")
    assert.is_true(maxdiff(logits_of(m, ref.tokens), ref.logits) < 1e-5)
    local d = tmpdir("llama-fsdp")
    hf.save(m, d)
    same_tensors(d, "llama-tiny")
  end)
end)
