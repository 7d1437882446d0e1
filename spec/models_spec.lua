-- engine.models: common_dtensor.py's test models (defaults, structure, names, weight
-- tying), PyTorch parity on the committed fixtures, and training.
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local nn, optim, models = engine.nn, engine.optim, engine.models
local F = nn.functional

local err = require("spec.helpers.errors").err -- err(fn, ...): fn raises, naming each string

local function maxdiff(a, b) return (a:double() - b:double()):abs():max():item() end

local function names_of(iter)
  local out = {}
  for n in iter do out[#out + 1] = n end
  return out
end

describe("ModelArgs", function()
  it("has the seed's defaults", function()
    assert.are.same({ n_layers = 2, vocab_size = 8, max_seq_len = 16, dim = 16, n_heads = 4, dropout_p = 0.1,
      use_attn_mask = true, weight_tying = true, checkpoint_activations = false, gelu = "none", attn_bias = false,
      norm_eps = 1e-5 }, models.ModelArgs())
    local a = models.ModelArgs({ dim = 32, weight_tying = false })
    assert.are.equal(32, a.dim)
    assert.is_false(a.weight_tying)
    assert.are.equal(4, a.n_heads)
  end)

  it("rejects unknown fields and bad values", function()
    err(function() models.ModelArgs({ dims = 3 }) end, "unknown field 'dims'", "max_seq_len")
    err(function() models.ModelArgs({ dim = 10, n_heads = 4 }) end, "dim (10) must be divisible by n_heads (4)")
    err(function() models.ModelArgs({ dropout_p = 2 }) end, "dropout_p must be a number in [0, 1]")
    err(function() models.ModelArgs({ n_heads = 0 }) end, "n_heads must be a positive integer")
    err(function() models.ModelArgs({ use_attn_mask = 1 }) end, "use_attn_mask must be a boolean")
  end)
end)

describe("Transformer", function()
  it("has the seed's structure, PyTorch parameter names and tied output weights", function()
    local m = nn.Transformer()
    assert.are.equal(models.Transformer, getmetatable(m))
    local names = names_of(m:named_parameters())
    assert.are.equal(28, #names)
    assert.are.same({ "tok_embeddings.weight", "pos_embeddings.weight", "layers.0.attention_norm.weight",
      "layers.0.attention_norm.bias", "layers.0.attention.wq.weight", "layers.0.attention.wk.weight",
      "layers.0.attention.wv.weight", "layers.0.attention.wo.weight", "layers.0.ffn_norm.weight",
      "layers.0.ffn_norm.bias", "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w1.bias",
      "layers.0.feed_forward.w2.weight", "layers.0.feed_forward.w2.bias" }, { unpack(names, 1, 14) })
    assert.are.same({ "norm.weight", "norm.bias" }, { names[27], names[28] })
    assert.are.equal(m.tok_embeddings.weight, m.output.weight)
    assert.are.same({ 8, 16 }, m.output.weight:shape())
    assert.are.same({ 64, 16 }, m.layers[1].feed_forward.w1.weight:shape())
    assert.is_nil(m.layers[1].attention.wq.bias)
    assert.are.equal(2, #m.layers)
    -- 8*16 + 16*16 + 2 * (4*16 + 4*256 + 64*16+64 + 16*64+16) + 32
    assert.are.equal(128 + 256 + 2 * (64 + 1024 + 1088 + 1040) + 32, m:num_parameters())
    local untied = nn.Transformer({ weight_tying = false })
    assert.are_not.equal(untied.tok_embeddings.weight, untied.output.weight)
    assert.are.equal(29, #untied:parameters())
  end)

  it("maps [B, T] token ids to f32 logits [B, T, vocab]", function()
    local m = nn.Transformer({ vocab_size = 11, max_seq_len = 6 })
    local tokens = engine.tensor({ { 0, 1, 2, 3, 4, 5 }, { 10, 9, 8, 7, 6, 5 } })
    local out = m(tokens)
    assert.are.same({ 2, 6, 11 }, out:shape())
    assert.are.equal("f32", out.dtype)
    assert.are.same({ 2, 3, 11 }, m(engine.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })):shape())
    err(function() m(engine.tensor({ { 1, 2, 3, 4, 5, 6, 7 } })) end, "sequence length 7 exceeds max_seq_len 6")
    err(function() m(engine.tensor({ 1, 2 })) end, "expected token ids of shape [batch, seq_len]")
    err(function() m(3) end, "expected a tensor of token ids")
  end)

  it("is causal: a change of a later token leaves earlier logits unchanged", function()
    local m = nn.Transformer():eval()
    local a = m(engine.tensor({ { 1, 2, 3, 4 } }))
    local b = m(engine.tensor({ { 1, 2, 3, 7 } }))
    assert.is_true(maxdiff(a:narrow(2, 1, 3), b:narrow(2, 1, 3)) < 1e-6)
    assert.is_true(maxdiff(a:narrow(2, 4, 1), b:narrow(2, 4, 1)) > 1e-4)
  end)

  it("uses dropout only in training mode", function()
    local m = nn.Transformer({ dropout_p = 0.5 })
    local tokens = engine.tensor({ { 1, 2, 3, 4 } })
    assert.is_true(maxdiff(m(tokens), m(tokens)) > 1e-4)
    m:eval()
    assert.are.equal(0, maxdiff(m(tokens), m(tokens)))
  end)

  local function load_fixture(dtype)
    local fx = engine.load("spec/fixtures/transformer_f32.safetensors")
    local model = nn.Transformer({ n_layers = 2, vocab_size = 64, max_seq_len = 16, dim = 32, n_heads = 4,
      dropout_p = 0 })
    local sd = {}
    for _, k in ipairs(model:state_dict_keys()) do sd[k] = fx[k] end
    if dtype == "f64" then model:double() end
    model:load_state_dict(sd)
    return model, fx
  end

  it("matches PyTorch's logits, loss and gradients (f32 fixture)", function()
    local model, fx = load_fixture("f32")
    local logits = model(fx.tokens)
    assert.is_true(maxdiff(logits, fx.logits) < 1e-4, "logits differ by " .. maxdiff(logits, fx.logits))
    local loss = F.cross_entropy(logits, fx.targets)
    assert.is_true(math.abs(loss:item() - fx.loss:item()) < 1e-5)
    loss:backward()
    for name, p in model:named_parameters() do
      local ref = fx["grad." .. name]
      assert.is_truthy(ref, "fixture has no gradient for " .. name)
      local d = maxdiff(p.grad, ref)
      assert.is_true(d < 1e-5, name .. ": gradient differs by " .. d)
    end
  end)

  it("matches PyTorch in float64 to 1e-10", function()
    local model = load_fixture("f64")
    local fx64 = engine.load("spec/fixtures/transformer_f64.safetensors")
    local fx32 = engine.load("spec/fixtures/transformer_f32.safetensors")
    local logits = model(fx32.tokens)
    assert.is_true(maxdiff(logits, fx64.logits) < 1e-5)  -- the model's output is cast to f32 (.float())
    -- compare in f64 before the final cast: run the body by hand
    local h = model.tok_embeddings(fx32.tokens) + model.pos_embeddings(engine.arange(0, 16))
    for _, layer in ipairs(model.layers) do h = layer(h) end
    local full = model.output(model.norm(h))
    assert.are.equal("f64", full.dtype)
    assert.is_true(maxdiff(full, fx64.logits) < 1e-10, "f64 logits differ by " .. maxdiff(full, fx64.logits))
    local loss = F.cross_entropy(full, fx32.targets)
    assert.is_true(math.abs(loss:item() - fx64.loss:item()) < 1e-10)
    loss:backward()
    for name, p in model:named_parameters() do
      local d = maxdiff(p.grad, fx64["grad." .. name])
      assert.is_true(d < 1e-10, name .. ": f64 gradient differs by " .. d)
    end
  end)

  it("follows PyTorch's loss curve over 10 AdamW steps", function()
    local model, fx = load_fixture("f32")
    local opt = optim.AdamW(model:parameters(), { lr = 1e-2, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0.1 })
    local ref = fx.adamw_losses:tolist()
    for i = 1, 10 do
      local loss = F.cross_entropy(model(fx.tokens), fx.targets)
      assert.is_true(math.abs(loss:item() - ref[i]) < 1e-5 * math.max(1, ref[i]),
        string.format("step %d: loss %.7f, PyTorch %.7f", i, loss:item(), ref[i]))
      loss:backward()
      opt:step()
      opt:zero_grad()
    end
  end)

  it("trains: the loss falls over 20 AdamW steps on a tiny batch (dropout on)", function()
    engine.manual_seed(0)
    local model = nn.Transformer({ vocab_size = 16, dim = 32 })
    local opt = optim.AdamW(model:parameters(), { lr = 1e-2 })
    local x = engine.tensor({ { 1, 2, 3, 4, 5, 6, 7, 8 }, { 8, 7, 6, 5, 4, 3, 2, 1 } })
    local y = engine.tensor({ { 2, 3, 4, 5, 6, 7, 8, 9 }, { 7, 6, 5, 4, 3, 2, 1, 0 } })
    local first, last
    for step = 1, 20 do
      local loss = F.cross_entropy(model(x), y)
      if step == 1 then first = loss:item() end
      last = loss:item()
      loss:backward()
      opt:step()
      opt:zero_grad()
    end
    assert.is_true(last < 0.5 * first, string.format("loss %.4f -> %.4f", first, last))
  end)

  it("with checkpoint_activations gives the same gradients", function()
    local function grads(ckpt)
      engine.manual_seed(3)
      local m = nn.Transformer({ checkpoint_activations = ckpt })
      engine.manual_seed(4)
      local t = engine.tensor({ { 1, 2, 3, 4, 5 } })
      F.cross_entropy(m(t), t):backward()
      local g = {}
      for n, p in m:named_parameters() do g[n] = p.grad end
      return g
    end
    local a, b = grads(false), grads(true)
    for n, g in pairs(a) do assert.is_true(maxdiff(g, b[n]) < 1e-6, n) end
  end)
end)

describe("common_dtensor.py helper modules", function()
  it("MLPModule seeds the generator with 5 so every instance is identical", function()
    local a, b = models.MLPModule(), models.MLPModule("cpu")
    assert.are.same({ "net1.weight", "net1.bias", "net2.weight", "net2.bias" }, names_of(a:named_parameters()))
    assert.are.same({ 16, 10 }, a.net1.weight:shape())
    assert.are.same({ 10, 16 }, a.net2.weight:shape())
    assert.are.equal(0, maxdiff(a.net1.weight, b.net1.weight))
    assert.are.equal(0, maxdiff(a.net2.bias, b.net2.bias))
    local nb = models.MLPModule({ bias = false })
    assert.is_nil(nb.net1.bias)
    local x = engine.randn(3, 10)
    assert.are.same({ 3, 10 }, a(x):shape())
    local ref = a.net2(a.net1(x):relu())
    assert.are.equal(0, maxdiff(a(x), ref))
  end)

  it("MLPStacked stacks n MLPModules in a ModuleList", function()
    local m = models.MLPStacked({ n_layers = 3 })
    assert.are.equal(3, #m.layers)
    assert.are.equal(12, #m:parameters())
    local x = engine.randn(2, 10)
    assert.are.equal(0, maxdiff(m(x), m.layers[3](m.layers[2](m.layers[1](x)))))
  end)

  it("Attention, FeedForward and TransformerBlock keep [B, T, dim]", function()
    local args = models.ModelArgs({ dropout_p = 0 })
    local x = engine.randn(2, 5, 16)
    local attn = models.Attention(args)
    assert.are.same({ 2, 5, 16 }, attn(x):shape())
    assert.are.equal(4, attn.head_dim)
    local ff = models.FeedForward(16, 64, 0)
    assert.are.equal(0, maxdiff(ff(x), ff.w2(ff.w1(x):gelu())))
    local blk = models.TransformerBlock(args)
    local h = x + blk.attention(blk.attention_norm(x))
    assert.is_true(maxdiff(blk(x), h + blk.feed_forward(blk.ffn_norm(h))) < 1e-6)
    -- attention by hand: softmax(q k^T / sqrt(d) + causal) v
    local q = attn.wq(x):view(2, 5, 4, 4):transpose(2, 3)
    local k = attn.wk(x):view(2, 5, 4, 4):transpose(2, 3)
    local v = attn.wv(x):view(2, 5, 4, 4):transpose(2, 3)
    local scores = q:matmul(k:transpose(3, 4)) / 2
    local future = {}
    for i = 1, 5 do
      future[i] = {}
      for j = 1, 5 do future[i][j] = j > i end
    end
    scores = scores:masked_fill(engine.tensor(future), -math.huge)
    local o = scores:softmax(-1):matmul(v):transpose(2, 3):contiguous():view(2, 5, 16)
    assert.is_true(maxdiff(attn(x), attn.wo(o)) < 1e-5)
  end)

  it("TransformerBlock gradients pass a float64 gradcheck, with and without checkpointing", function()
    local gc = require("spec.helpers.gradcheck")
    engine.manual_seed(9)
    local blk = models.TransformerBlock(models.ModelArgs({ dim = 8, n_heads = 2, dropout_p = 0 })):double()
    local x = engine.randn(1, 3, 8, { dtype = "f64" }):requires_grad_()
    local inputs = { x, blk.attention.wq.weight, blk.feed_forward.w1.bias, blk.attention_norm.weight,
      blk.ffn_norm.bias }
    gc.check(function(a) return blk(a) end, inputs)
    for _, p in ipairs(blk:parameters()) do p.grad = nil end
    gc.check(function(a) return nn.checkpoint(blk, a) end, inputs)
  end)

  it("RMSNormPython normalises by the root mean square", function()
    local m = models.RMSNormPython(4)
    local x = engine.tensor({ { 1, 1, 1, 1 }, { 2, -2, 2, -2 } }, "f32")
    assert.is_true(maxdiff(m(x), engine.tensor({ { 1, 1, 1, 1 }, { 1, -1, 1, -1 } }, "f32")) < 1e-5)
    assert.are.same({ "weight" }, names_of(m:named_parameters()))
  end)

  it("are reachable as nn.Transformer etc.", function()
    assert.are.equal(models.Transformer, nn.Transformer)
    assert.are.equal(models.ModelArgs, nn.ModelArgs)
    assert.are.equal(models.MLPModule, nn.MLPModule)
    assert.is_nil(nn.NoSuchModel)
  end)
end)
