-- The models' fused QKV projection (lua/engine/models.lua, "fused QKV projection"; engine.cat_adjacent) and
-- the GPT model's gelu = "tanh" option (issue 28, item 2): the fused model trains exactly as the three-GEMM
-- model (losses, gradients and parameters over AdamW steps, f64 and f32), keeps its parameter and state dict
-- names, round-trips state dicts and safetensors checkpoints, stays fused through module:to and load_state_dict,
-- and falls back to three GEMMs where it must.
local engine = require("engine")
local nn, optim = engine.nn, engine.optim
local F = nn.functional
local models = require("engine.models")

-- token ids [b, t] in 0..n-1 (a fixed Lua stream)
local function randint(n, shape)
  local rows = {}
  for i = 1, shape[1] do
    local r = {}
    for j = 1, shape[2] do r[j] = math.random(0, n - 1) end
    rows[i] = r
  end
  return engine.tensor(rows, "i64")
end
math.randomseed(7)

local function maxdiff(a, b) return (a:double() - b:double()):abs():max():item() end

local function set_fused(model, on)
  for _, m in ipairs(model:modules()) do
    if m.wq and m.wk and m.wv and m.fuse_qkv ~= nil then m.fuse_qkv = on end
  end
end

local function attentions(model)
  local r = {}
  for _, m in ipairs(model:modules()) do if m.fuse_qkv ~= nil then r[#r + 1] = m end end
  return r
end

local function adjacent(attn) return engine.tensors_adjacent({ attn.wq.weight, attn.wk.weight, attn.wv.weight }, 1) end

-- n AdamW steps of model on fixed tokens; returns the losses and, after the last backward, the gradients
local function train(model, n, tokens, targets, llama)
  local opt = optim.AdamW(model:parameters(), { lr = 1e-2, weight_decay = 0.1 })
  local losses, grads = {}, {}
  for step = 1, n do
    local logits = llama and model(tokens, { float = false }) or model(tokens)
    local V = logits:size(-1)
    local loss = F.cross_entropy(logits:reshape(-1, V), targets:reshape(-1))
    loss:backward()
    losses[step] = loss:item()
    if step == n then
      for name, p in model:named_parameters() do grads[name] = p.grad:clone() end
    end
    opt:step()
    opt:zero_grad()
  end
  return losses, grads
end

local function compare(build, dtype, tol, llama)
  local tokens = randint(32, { 2, 12 })
  local targets = randint(32, { 2, 12 })
  local a, b = build(), build()
  if dtype == "f64" then a:double(); b:double() end
  set_fused(b, false)
  for _, at in ipairs(attentions(a)) do assert.is_true(adjacent(at)) end
  local la, ga = train(a, 4, tokens, targets, llama)
  local lb, gb = train(b, 4, tokens, targets, llama)
  for i = 1, #la do assert.is_true(math.abs(la[i] - lb[i]) <= tol * (1 + math.abs(lb[i])), "loss " .. i) end
  local pa, pb = a:state_dict(), b:state_dict()
  for name, g in pairs(gb) do
    assert.is_true(maxdiff(ga[name], g) <= tol * (1 + g:abs():max():item()), "grad " .. name)
  end
  for name, p in pairs(pb) do assert.is_true(maxdiff(pa[name], p) <= tol, "param " .. name) end
  -- the optimizer's in-place updates kept the weights fused
  for _, at in ipairs(attentions(a)) do assert.is_true(adjacent(at)) end
end

local function gpt() engine.manual_seed(3); return models.Transformer{ n_layers = 2, dim = 32, n_heads = 4,
  vocab_size = 32, max_seq_len = 16, dropout_p = 0 } end
local function llama() engine.manual_seed(3); return models.Llama{ n_layers = 2, dim = 32, n_heads = 4,
  n_kv_heads = 2, vocab_size = 32, max_seq_len = 16, multiple_of = 16 } end

describe("engine.cat_adjacent", function()
  it("is a view of adjacent pieces with cat's gradient, and a copy otherwise", function()
    local base = engine.randn(6, 3, { dtype = "f64" })
    local p = { base:narrow(1, 1, 2), base:narrow(1, 3, 1), base:narrow(1, 4, 3) }
    assert.is_true(engine.tensors_adjacent(p, 1))
    local v = engine.cat_adjacent(p, 1)
    assert.are.equal(base:data_ptr(), v:data_ptr())
    assert.are.same({ 6, 3 }, v:shape())
    assert.are.equal(0, maxdiff(v, base))
    assert.is_false(engine.tensors_adjacent({ p[1], p[3] }, 1))
    assert.is_false(engine.tensors_adjacent(p, 2))
    local c = engine.cat_adjacent({ p[3], p[1] }, 1)   -- out of order: a copy, as cat
    assert.are_not.equal(base:data_ptr(), c:data_ptr())
    assert.are.equal(0, maxdiff(c, engine.cat({ p[3], p[1] }, 1)))
    -- gradients: leaves that are views of one tensor (the models' fused weights)
    local w = engine.randn(5, 4, { dtype = "f64" })
    local a, b = engine.zeros(2, 4, { dtype = "f64" }), engine.zeros(3, 4, { dtype = "f64" })
    engine.C.eng_tensor_set_data(a._c, w:narrow(1, 1, 2)._c)
    engine.C.eng_tensor_set_data(b._c, w:narrow(1, 3, 3)._c)
    a:requires_grad_(); b:requires_grad_()
    local x = engine.randn(7, 4, { dtype = "f64" })
    local y = F.linear(x, engine.cat_adjacent({ a, b }, 1))
    local g = engine.randn(7, 5, { dtype = "f64" })
    y:backward(g)
    assert.is_true(maxdiff(a.grad, g:narrow(2, 1, 2):t():matmul(x)) < 1e-12)
    assert.is_true(maxdiff(b.grad, g:narrow(2, 3, 3):t():matmul(x)) < 1e-12)
  end)

  it("split's backward (one cat when every piece has a gradient) matches narrow's", function()
    local x = engine.randn(3, 9, { dtype = "f64" }):requires_grad_()
    local parts = x:split({ 2, 3, 4 }, 2)
    local g = { engine.randn(3, 2, { dtype = "f64" }), engine.randn(3, 3, { dtype = "f64" }),
      engine.randn(3, 4, { dtype = "f64" }) }
    local loss = (parts[1] * g[1]):sum() + (parts[2] * g[2]):sum() + (parts[3]:t():contiguous() * g[3]:t()):sum()
    loss:backward()
    assert.are.equal(0, maxdiff(x.grad, engine.cat(g, 2)))
    local y = engine.randn(3, 9, { dtype = "f64" }):requires_grad_()
    local q = y:split({ 2, 3, 4 }, 2)
    local l1 = (q[1] * g[1]):sum(); l1:backward()    -- only one piece: zeros elsewhere
    assert.are.equal(0, maxdiff(y.grad, engine.cat({ g[1], engine.zeros(3, 7, { dtype = "f64" }) }, 2)))
  end)
end)

describe("fused QKV projection", function()
  it("GPT: the same losses, gradients and parameters as three GEMMs over 4 AdamW steps (f64, f32)", function()
    engine.manual_seed(11)
    compare(gpt, "f64", 1e-12)
    compare(gpt, "f32", 2e-5)
  end)

  it("Llama (grouped k/v heads): the same losses, gradients and parameters as three GEMMs (f64, f32)", function()
    engine.manual_seed(12)
    compare(llama, "f64", 1e-12, true)
    compare(llama, "f32", 2e-5, true)
  end)

  it("keeps the parameter and state dict names and values of the three projections", function()
    local m = gpt()
    local names = {}
    for name in m:named_parameters() do names[#names + 1] = name end
    local want = { "layers.0.attention.wq.weight", "layers.0.attention.wk.weight", "layers.0.attention.wv.weight",
      "layers.0.attention.wo.weight" }
    local at = 0
    for i, n in ipairs(names) do if n == want[1] then at = i end end
    assert.is_true(at > 0)
    for k = 1, 4 do assert.are.equal(want[k], names[at + k - 1]) end
    local sd = m:state_dict()
    assert.are.same({ 32, 32 }, sd["layers.1.attention.wk.weight"]:shape())
    -- the same values as an unfused model drawn from the same seed (fusion copies, the RNG order is unchanged)
    engine.manual_seed(3)
    local ref_wq = nn.Linear(32, 32, { bias = false })
    engine.manual_seed(3)
    local m2 = models.Transformer{ n_layers = 2, dim = 32, n_heads = 4, vocab_size = 32, max_seq_len = 16, dropout_p = 0 }
    assert.are.equal(0, maxdiff(m2.layers[1].attention.wq.weight, sd["layers.0.attention.wq.weight"]))
    assert.is_not_nil(ref_wq)
  end)

  it("round-trips state dicts and safetensors checkpoints, staying fused", function()
    local a = gpt()
    engine.manual_seed(99)
    local b = models.Transformer{ n_layers = 2, dim = 32, n_heads = 4, vocab_size = 32, max_seq_len = 16, dropout_p = 0 }
    b:load_state_dict(a:state_dict())
    for _, at in ipairs(attentions(b)) do assert.is_true(adjacent(at)) end
    local tokens = randint(32, { 2, 8 })
    assert.are.equal(0, maxdiff(a(tokens), b(tokens)))
    local path = os.tmpname()
    engine.save(path, a:state_dict())
    local loaded = engine.load(path)
    os.remove(path)
    for name, t in pairs(a:state_dict()) do assert.are.equal(0, maxdiff(loaded[name], t), name) end
    local c = llama()
    local d = llama()
    engine.no_grad(function() for _, p in ipairs(d:parameters()) do p:zero_() end end)
    d:load_state_dict(c:state_dict())
    assert.are.equal(0, maxdiff(c(tokens), d(tokens)))
    for _, at in ipairs(attentions(d)) do assert.is_true(adjacent(at)) end
  end)

  it("module:to re-fuses the converted weights; DTensor-free unfused weights still run one GEMM", function()
    local m = gpt()
    local tokens = randint(32, { 2, 8 })
    local ref = m(tokens):double()
    m:double()
    for _, at in ipairs(attentions(m)) do
      assert.is_true(adjacent(at))
      assert.are.equal("f64", at.wq.weight.dtype)
    end
    assert.is_true(maxdiff(m(tokens), ref) < 1e-5)
    -- weights that are not views of one tensor (replaced by hand): cat (a copy) for the one GEMM, same values
    local at = attentions(m)[1]
    engine.C.eng_tensor_set_data(at.wk.weight._c, at.wk.weight:clone()._c)
    assert.is_false(adjacent(at))
    assert.is_true(maxdiff(m(tokens), ref) < 1e-5)
  end)
end)

describe("GPT gelu = \"tanh\"", function()
  it("is a ModelArgs field used by the feed-forward block (checked values)", function()
    assert.are.equal("none", models.ModelArgs().gelu)
    assert.are.equal("tanh", models.ModelArgs{ gelu = "tanh" }.gelu)
    assert.has_error(function() models.ModelArgs{ gelu = "fast" } end,
      "ModelArgs: gelu must be \"none\" (exact) or \"tanh\" (GPT-2's approximation), got fast")
    engine.manual_seed(4)
    local m = models.Transformer{ n_layers = 1, dim = 16, n_heads = 2, vocab_size = 16, max_seq_len = 8,
      dropout_p = 0, gelu = "tanh" }
    assert.are.equal("tanh", m.layers[1].feed_forward.gelu.approximate)
    -- the block equals its pieces with PyTorch's tanh formula written out
    local ff = m.layers[1].feed_forward:double()
    local x = engine.randn(2, 3, 16, { dtype = "f64" })
    local h = F.linear(x, ff.w1.weight, ff.w1.bias)
    local c = math.sqrt(2 / math.pi)
    local g = h * 0.5 * ((h + h:pow(3) * 0.044715) * c):tanh():add(1)
    assert.is_true(maxdiff(ff(x), F.linear(g, ff.w2.weight, ff.w2.bias)) < 1e-12)
  end)

  it("F.gelu(x, \"tanh\") matches PyTorch's formula and float64 finite differences", function()
    local gc = require("spec.helpers.gradcheck")
    local x = engine.tensor({ -6, -3, -1.5, -0.7, -1e-3, 0, 2e-3, 0.5, 1.2, 2.5, 4, 7 }, "f64")
    local c = math.sqrt(2 / math.pi)
    local ref = x * 0.5 * ((x + x:pow(3) * 0.044715) * c):tanh():add(1)
    assert.is_true(maxdiff(F.gelu(x, "tanh"), ref) < 1e-15)
    -- derivative: PyTorch's GeluBackward (approximate='tanh') formula
    local inner = (x + x:pow(3) * 0.044715) * c
    local t = inner:tanh()
    local dref = (t:add(1)) * 0.5 + x * 0.5 * (t:pow(2) * -1 + 1) * ((x:pow(2) * (3 * 0.044715)):add(1) * c)
    local xr = x:clone():requires_grad_()
    F.gelu(xr, "tanh"):sum():backward()
    assert.is_true(maxdiff(xr.grad, dref) < 1e-14)
    assert.is_true(gc.check(function(a) return F.gelu(a, "tanh") end, { engine.randn(4, 5, { dtype = "f64" }):requires_grad_() }))
    local w = engine.randn(3, 5, { dtype = "f64" }):requires_grad_()
    assert.is_true(gc.check(function(a, b) return F.linear_gelu(a, b, nil, "tanh") end,
      { engine.randn(4, 5, { dtype = "f64" }):requires_grad_(), w }))
    -- f32 against the f64 formula
    assert.is_true(maxdiff(F.gelu(x:float(), "tanh"), ref) < 1e-6)
  end)
end)
