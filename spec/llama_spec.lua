-- The Llama model (lua/engine/models.lua): PyTorch parity against torchtitan's Llama computed by PyTorch
-- (tools/gen_llama_fixture.py writes spec/fixtures/llama_{f32,f64}.safetensors): logits, loss, every
-- parameter gradient, the losses of 10 AdamW steps (the GPT fixture's tolerances, spec/parity_spec.lua);
-- then the pieces (rotary embeddings, repeat_kv, the SwiGLU size) and the argument checks.
local engine = require("engine")
local nn, optim = engine.nn, engine.optim
local F = nn.functional
local models = require("engine.models")

local FIX = "spec/fixtures/"

local function config(m)
  return { dim = tonumber(m.dim), n_layers = tonumber(m.n_layers), n_heads = tonumber(m.n_heads),
    n_kv_heads = tonumber(m.n_kv_heads), vocab_size = tonumber(m.vocab_size), multiple_of = tonumber(m.multiple_of),
    ffn_dim_multiplier = tonumber(m.ffn_dim_multiplier), norm_eps = tonumber(m.norm_eps),
    rope_theta = tonumber(m.rope_theta), max_seq_len = tonumber(m.max_seq_len) }
end

local function rel_err(a, ref)
  local diff = (a:double() - ref:double()):abs():max():item()
  local scale = ref:double():abs():max():item()
  if scale == 0 then return diff end
  return diff / scale
end

local function build(ref, dtype)
  local model = nn.Llama(config(ref.meta))
  if dtype == "f64" then model:double() end
  local sd = {}
  for _, name in ipairs(model:state_dict_keys()) do sd[name] = ref.t[name] end
  model:load_state_dict(sd)
  return model
end

local function loss_of(model, tokens, targets, opts)
  local logits = model(tokens, opts)
  local V = logits:size(-1)
  return F.cross_entropy(logits:view(-1, V), targets:view(-1)), logits
end

local NOT_PARAMS = { tokens = true, targets = true, logits = true, loss = true, adamw_losses = true }

describe("Llama: PyTorch parity (torchtitan's model)", function()
  local ref, ref64

  setup(function()
    local t, meta = engine.load(FIX .. "llama_f32.safetensors")
    ref = { t = t, meta = meta }
    ref64 = { t = engine.load(FIX .. "llama_f64.safetensors"), meta = meta }
  end)

  it("fixture has the expected configuration and entries", function()
    assert.are.equal("2", ref.meta.n_kv_heads)
    assert.are.equal("4", ref.meta.n_heads)
    assert.are.same({ 2, 16 }, ref.t.tokens:shape())
    assert.are.same({ 2, 16, 64 }, ref.t.logits:shape())
    assert.are.same({ 10 }, ref.t.adamw_losses:shape())
    assert.are.equal("f64", ref64.t.logits.dtype)
  end)

  it("parameter names and shapes match torchtitan's state dict", function()
    local model = nn.Llama(config(ref.meta))
    local keys, sd = model:state_dict_keys(), model:state_dict()
    local n_ref = 0
    for name, v in pairs(ref.t) do
      if not name:match("^grad%.") and not NOT_PARAMS[name] then
        n_ref = n_ref + 1
        assert.is_not_nil(sd[name], "engine state dict lacks " .. name)
        assert.are.same(v:shape(), sd[name]:shape())
      end
    end
    assert.are.equal(n_ref, #keys)          -- the rotary tables are not persistent
    assert.are.equal(21, n_ref)
    assert.are.same({ 16, 32 }, ref.t["layers.0.attention.wk.weight"]:shape())   -- 2 kv heads of 8
    assert.are.same({ 128, 32 }, ref.t["layers.0.feed_forward.w1.weight"]:shape())
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
    loss_of(model, ref.t.tokens, ref.t.targets):backward()
    local n = 0
    for name, p in model:named_parameters() do
      local r = ref.t["grad." .. name]
      assert.is_not_nil(r, "fixture has no gradient for " .. name)
      assert.are.same(r:shape(), p.grad:shape())
      local e = rel_err(p.grad, r)
      if os.getenv("PARITY_VERBOSE") then print(string.format("  grad %-40s rel err %.3g", name, e)) end
      assert.is_true(e <= 1e-4, string.format("gradient of %s: relative error %.3g", name, e))
      n = n + 1
    end
    assert.are.equal(21, n)
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
    local loss, logits = loss_of(model, ref.t.tokens, ref.t.targets, { float = false })
    assert.are.equal("f64", logits.dtype)
    local e = rel_err(logits, ref64.t.logits)
    assert.is_true(e <= 1e-12, "f64 logits relative error " .. e)
    assert.is_true(math.abs(loss:item() - ref64.t.loss:item()) <= 1e-12,
      string.format("f64 loss %.15f vs %.15f", loss:item(), ref64.t.loss:item()))
    loss:backward()
    for name, p in model:named_parameters() do
      assert.are.equal("f64", p.grad.dtype)
      local eg = rel_err(p.grad, ref64.t["grad." .. name])
      if os.getenv("PARITY_VERBOSE") then print(string.format("  f64 grad %-36s rel err %.3g", name, eg)) end
      assert.is_true(eg <= 1e-10, string.format("f64 gradient of %s: relative error %.3g", name, eg))
    end
  end)
end)

describe("Llama: pieces", function()
  it("rotary embedding rotates each pair (x[2i], x[2i+1]) by t * theta^(-2i/D)", function()
    engine.manual_seed(3)
    local x = engine.randn({ 1, 3, 2, 4 }, { dtype = "f64" })
    local c, s = models.rope_tables(4, 3, 100)
    local y = models.apply_rotary_emb(x, c, s)
    for t = 1, 3 do
      for h = 1, 2 do
        for i = 0, 1 do
          local ang = (t - 1) * 100 ^ (-(2 * i) / 4)
          local x0, x1 = x:get(1, t, h, 2 * i + 1), x:get(1, t, h, 2 * i + 2)
          assert.is_true(math.abs(y:get(1, t, h, 2 * i + 1) - (x0 * math.cos(ang) - x1 * math.sin(ang))) < 1e-14)
          assert.is_true(math.abs(y:get(1, t, h, 2 * i + 2) - (x0 * math.sin(ang) + x1 * math.cos(ang))) < 1e-14)
        end
      end
    end
  end)

  it("repeat_kv repeats each k/v head n_rep times in a row", function()
    local x = engine.arange(0, 2 * 3 * 4):view(1, 2, 3, 4)
    local r = models.repeat_kv(x, 2)
    assert.are.same({ 1, 2, 6, 4 }, r:shape())
    for h = 1, 6 do
      local src = math.floor((h - 1) / 2) + 1
      assert.are.same(x:select(3, src):tolist_flat(), r:select(3, h):tolist_flat())
    end
    assert.are.equal(x, models.repeat_kv(x, 1))
  end)

  it("SwiGLU hidden size as torchtitan (multiple_of, ffn_dim_multiplier)", function()
    assert.are.equal(768, models.llama_ffn_dim{ dim = 256, multiple_of = 256 })
    assert.are.equal(128, models.llama_ffn_dim{ dim = 32, multiple_of = 16, ffn_dim_multiplier = 1.5 })
    assert.are.equal(11008, models.llama_ffn_dim{ dim = 4096, multiple_of = 256 })   -- Llama 2 7B
  end)

  it("default initialisation: torchtitan's standard deviations, norms at 1", function()
    engine.manual_seed(0)
    local m = nn.Llama{ dim = 64, n_layers = 2, n_heads = 4, n_kv_heads = 2, vocab_size = 128, max_seq_len = 8,
      multiple_of = 32 }
    local function std(t) local d = t:double(); return math.sqrt((d * d):mean():item()) end
    assert.is_true(math.abs(std(m.tok_embeddings.weight) - 1) < 0.05)
    assert.is_true(math.abs(std(m.layers[1].attention.wq.weight) / 0.02 - 1) < 0.1)
    assert.is_true(math.abs(std(m.layers[2].attention.wo.weight) / (0.02 / 2) - 1) < 0.1)
    assert.is_true(math.abs(std(m.output.weight) / 64 ^ -0.5 - 1) < 0.1)
    assert.are.equal(1, m.norm.weight:min():item())
    -- a model built after the same seed is the same model
    engine.manual_seed(0)
    local m2 = nn.Llama{ dim = 64, n_layers = 2, n_heads = 4, n_kv_heads = 2, vocab_size = 128, max_seq_len = 8,
      multiple_of = 32 }
    assert.are.equal(0, (m.output.weight - m2.output.weight):abs():max():item())
  end)

  it("float64 finite differences through rotary + GQA attention", function()
    engine.manual_seed(5)
    local m = nn.Llama{ dim = 16, n_layers = 1, n_heads = 4, n_kv_heads = 2, vocab_size = 11, max_seq_len = 6,
      multiple_of = 8 }
    m:double()
    local tok = engine.tensor({ { 1, 4, 2, 9, 3 } })
    local w = m.layers[1].attention.wk.weight
    local function f() return (m(tok, { float = false }) ^ 2):sum() end
    f():backward()
    local g = w.grad:tolist_flat()
    local eps = 1e-6
    engine.no_grad(function()
      for _, i in ipairs({ 1, 7, 20, 33, 64 }) do
        local flat = w:view(-1)
        local v = flat:get(i)
        flat:set(v + eps, i)
        local up = f():item()
        flat:set(v - eps, i)
        local dn = f():item()
        flat:set(v, i)
        local fd = (up - dn) / (2 * eps)
        assert.is_true(math.abs(fd - g[i]) <= 1e-6 * math.max(1, math.abs(fd)),
          string.format("wk[%d]: analytic %.10g, finite difference %.10g", i, g[i], fd))
      end
    end)
  end)

  it("checks its arguments", function()
    local function err(t) local ok, e = pcall(nn.Llama, t); assert.is_false(ok); return tostring(e) end
    assert.matches("n_heads %(4%) must be divisible by n_kv_heads %(3%)", err{ dim = 16, n_heads = 4, n_kv_heads = 3 })
    assert.matches("dim %(10%) must be divisible by n_heads %(4%)", err{ dim = 10, n_heads = 4 })
    assert.matches("must be even", err{ dim = 12, n_heads = 4 })
    assert.matches("unknown field 'n_head'", err{ n_head = 4 })
    local m = nn.Llama{ dim = 16, n_layers = 1, n_heads = 2, vocab_size = 8, max_seq_len = 4, multiple_of = 8 }
    local ok, e = pcall(m, engine.tensor({ { 1, 2, 3, 4, 5 } }))
    assert.is_false(ok)
    assert.matches("sequence length 5 exceeds max_seq_len 4", e)
    ok, e = pcall(m, engine.tensor({ 1, 2 }))
    assert.is_false(ok)
    assert.matches("expected token ids of shape %[batch, seq_len%]", e)
  end)
end)
