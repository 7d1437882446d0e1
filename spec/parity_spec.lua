-- PyTorch parity: common_dtensor.py's Transformer against the reference computed by PyTorch
-- (tools/gen_fixtures.py writes spec/fixtures/transformer_{f32,f64}.safetensors).
-- Logits, loss and every parameter gradient, then the losses of 10 AdamW steps.
-- Errors are relative to the largest absolute value of the reference tensor.
local engine = require("engine")
local nn, optim = engine.nn, engine.optim
local F = nn.functional

local FIX = "spec/fixtures/"

local function config(meta)
  return {
    n_layers = tonumber(meta.n_layers), vocab_size = tonumber(meta.vocab_size),
    max_seq_len = tonumber(meta.max_seq_len), dim = tonumber(meta.dim), n_heads = tonumber(meta.n_heads),
    dropout_p = tonumber(meta.dropout_p), use_attn_mask = meta.use_attn_mask == "True",
    weight_tying = meta.weight_tying == "True",
  }
end

-- max |a - ref| / max |ref|
local function rel_err(a, ref)
  local diff = (a:double() - ref:double()):abs():max():item()
  local scale = ref:double():abs():max():item()
  if scale == 0 then return diff end
  return diff / scale
end

local function build(ref, dtype)
  local model = nn.Transformer(config(ref.meta))
  if dtype == "f64" then model:double() end
  local sd = {}
  for _, name in ipairs(model:state_dict_keys()) do sd[name] = ref.t[name] end
  model:load_state_dict(sd)
  model:train()
  return model
end

local function loss_of(model, tokens, targets)
  local logits = model(tokens)
  local V = logits:size(-1)
  return F.cross_entropy(logits:view(-1, V), targets:view(-1)), logits
end

-- Transformer:forward ends with the seed's `.float()`, which would round f64 logits to f32: the f64
-- check runs the same layers without that cast (as tools/gen_fixtures.py does for its f64 reference).
local function loss_of_f64(model, tokens, targets)
  local T = tokens:size(2)
  local h = model.tok_embeddings(tokens) + model.pos_embeddings(engine.arange(0, T))
  h = model.dropout(h)
  for _, layer in ipairs(model.layers) do h = layer(h) end
  local logits = model.output(model.norm(h))
  local V = logits:size(-1)
  return F.cross_entropy(logits:view(-1, V), targets:view(-1)), logits
end

describe("PyTorch parity (common_dtensor.py's Transformer)", function()
  local ref, ref64

  setup(function()
    local t, meta = engine.load(FIX .. "transformer_f32.safetensors")
    ref = { t = t, meta = meta }
    local t64 = engine.load(FIX .. "transformer_f64.safetensors")
    ref64 = { t = t64, meta = meta }
  end)

  it("fixture has the expected configuration and entries", function()
    assert.are.equal("2", ref.meta.n_layers)
    assert.are.equal("64", ref.meta.vocab_size)
    assert.are.same({ 2, 16 }, ref.t.tokens:shape())
    assert.are.equal("i64", ref.t.tokens.dtype)
    assert.are.same({ 2, 16, 64 }, ref.t.logits:shape())
    assert.are.same({ 10 }, ref.t.adamw_losses:shape())
    assert.are.equal("f64", ref64.t.logits.dtype)
    -- tied weights: the PyTorch state dict stores both names with equal values
    assert.are.equal(0, (ref.t["output.weight"] - ref.t["tok_embeddings.weight"]):abs():max():item())
  end)

  it("parameter names match PyTorch's (state dict and named parameters)", function()
    local model = nn.Transformer(config(ref.meta))
    local keys = model:state_dict_keys()
    local n_ref = 0
    for name, v in pairs(ref.t) do
      if not name:match("^grad%.") and name ~= "tokens" and name ~= "targets" and name ~= "logits"
          and name ~= "loss" and name ~= "adamw_losses" then
        n_ref = n_ref + 1
        local found = false
        for _, k in ipairs(keys) do if k == name then found = true end end
        assert.is_true(found, "engine state dict lacks " .. name)
        assert.are.same(v:shape(), model:state_dict()[name]:shape())
      end
    end
    assert.are.equal(n_ref, #keys)
    local n_grads = 0
    for name in pairs(ref.t) do if name:match("^grad%.") then n_grads = n_grads + 1 end end
    local n_params = 0
    for name in model:named_parameters() do
      n_params = n_params + 1
      assert.is_not_nil(ref.t["grad." .. name], "fixture has no gradient for " .. name)
    end
    assert.are.equal(n_grads, n_params)
  end)

  it("f32 forward: logits and loss", function()
    local model = build(ref, "f32")
    local loss, logits = loss_of(model, ref.t.tokens, ref.t.targets)
    assert.are.equal("f32", logits.dtype)
    local e = rel_err(logits, ref.t.logits)
    assert.is_true(e <= 1e-4, "logits relative error " .. e)
    assert.is_true(math.abs(loss:item() - ref.t.loss:item()) <= 1e-5,
      string.format("loss %.8f vs %.8f", loss:item(), ref.t.loss:item()))
  end)

  it("f32 backward: every parameter gradient", function()
    local model = build(ref, "f32")
    local loss = loss_of(model, ref.t.tokens, ref.t.targets)
    loss:backward()
    local n = 0
    for name, p in model:named_parameters() do
      local g = p.grad
      assert.is_not_nil(g, "no gradient for " .. name)
      local r = ref.t["grad." .. name]
      assert.are.same(r:shape(), g:shape())
      local e = rel_err(g, r)
      assert.is_true(e <= 1e-4, string.format("gradient of %s: relative error %.3g", name, e))
      if os.getenv("PARITY_VERBOSE") then print(string.format("  grad %-40s rel err %.3g", name, e)) end
      n = n + 1
    end
    assert.are.equal(28, n)
  end)

  it("f32: 10 AdamW steps give PyTorch's losses", function()
    local model = build(ref, "f32")
    local m = ref.meta
    local opt = optim.AdamW(model:parameters(), { lr = tonumber(m.adamw_lr),
      betas = { tonumber(m.adamw_beta1), tonumber(m.adamw_beta2) }, eps = tonumber(m.adamw_eps),
      weight_decay = tonumber(m.adamw_weight_decay) })
    local want = ref.t.adamw_losses:tolist_flat()
    for i = 1, #want do
      opt:zero_grad()
      local loss = loss_of(model, ref.t.tokens, ref.t.targets)
      loss:backward()
      opt:step()
      local l = loss:item()
      if os.getenv("PARITY_VERBOSE") then print(string.format("  step %d loss %.8f torch %.8f", i, l, want[i])) end
      assert.is_true(math.abs(l - want[i]) <= 1e-5,
        string.format("step %d: loss %.8f, PyTorch %.8f (diff %.3g)", i, l, want[i], math.abs(l - want[i])))
    end
  end)

  it("f64 forward and backward match PyTorch's float64 run", function()
    local model = build(ref, "f64")
    local loss, logits = loss_of_f64(model, ref.t.tokens, ref.t.targets)
    assert.are.equal("f64", logits.dtype)
    local e = rel_err(logits, ref64.t.logits)
    assert.is_true(e <= 1e-12, "f64 logits relative error " .. e)
    assert.is_true(math.abs(loss:item() - ref64.t.loss:item()) <= 1e-12,
      string.format("f64 loss %.15f vs %.15f", loss:item(), ref64.t.loss:item()))
    loss:backward()
    for name, p in model:named_parameters() do
      local g = p.grad
      assert.are.equal("f64", g.dtype)
      local eg = rel_err(g, ref64.t["grad." .. name])
      if os.getenv("PARITY_VERBOSE") then print(string.format("  f64 grad %-36s rel err %.3g", name, eg)) end
      assert.is_true(eg <= 1e-10, string.format("f64 gradient of %s: relative error %.3g", name, eg))
    end
  end)
end)
