-- The fused classifier (engine.fused_classifier / F.fused_classifier, eng_fused_classifier): cross entropy
-- of bf16/f16 logits without f32 logits, f32 loss, gradient in the logits' dtype.  Its CPU path (the
-- reference for the CUDA one, spec/cuda_fused_spec.lua #gpu) against cross_entropy on :float() logits:
-- the same f32 formulas per row, so the loss agrees to f32 rounding (1e-6 relative) and the gradient is
-- cross_entropy's f32 gradient rounded to the logits' dtype (equal; documented tolerance 1 ulp).
local engine = require("engine")
local nn = engine.nn
local F = nn.functional
local dist = engine.distributed

local err = require("spec.helpers.errors").err -- err(fn, ...): fn raises, naming each string

local function maxabs(t) return t:numel() == 0 and 0 or t:double():abs():max():item() end

-- logits [N, C] in dt with targets (some ignored), and the two results: fused and reference
local function both(dt, N, C, opts, seed)
  engine.manual_seed(seed or 1)
  local x = (engine.randn(N, C) * 3):to(dt)
  local t = (engine.rand(N) * C):floor():to("i64")
  if N > 2 then t:set(-100, 2) end
  local a = x:detach():clone(); a.requires_grad = true
  local b = x:detach():clone(); b.requires_grad = true
  local la = F.fused_classifier(a, t, opts)
  local lb = F.cross_entropy(b:float(), t, opts)
  local red = opts and opts.reduction or "mean"
  if red == "none" then
    local w = engine.randn(N)
    local sa, sb = (la * w):sum(), (lb * w):sum()
    sa:backward(); sb:backward()
  else
    la:backward(); lb:backward()
  end
  return la, lb, a.grad, b.grad
end

describe("fused_classifier", function()
  for _, dt in ipairs({ "bf16", "f16" }) do
    for _, red in ipairs({ "mean", "sum", "none" }) do
      for _, ls in ipairs({ 0, 0.1 }) do
        it(string.format("%s logits, reduction %s, label_smoothing %g: cross_entropy of :float() logits", dt, red, ls),
          function()
            local la, lb, ga, gb = both(dt, 37, 1000, { reduction = red, label_smoothing = ls })
            assert.are.equal("f32", la.dtype) -- not rounded to the logits' dtype
            assert.are.same(lb:shape(), la:shape())
            assert.is_true(maxabs(la - lb) <= 1e-6 * math.max(1, maxabs(lb)), "loss")
            assert.are.equal(dt, ga.dtype)
            assert.are.equal(0, maxabs(ga:float() - gb:float()))
          end)
      end
    end
  end

  it("a GPT-2 sized vocabulary (50304) over the worker threads", function()
    local la, lb, ga, gb = both("bf16", 40, 50304, nil, 3)
    assert.is_true(maxabs(la - lb) <= 1e-6 * maxabs(lb))
    assert.are.equal(0, maxabs(ga:float() - gb:float()))
  end)

  it("is more exact than cross_entropy on bf16 logits, whose loss is bf16", function()
    engine.manual_seed(4)
    local x = engine.randn(16, 300):to("bf16")
    local t = (engine.rand(16) * 300):floor():to("i64")
    local ref = F.cross_entropy(x:double(), t):item()
    local fused = F.fused_classifier(x, t)
    local plain = F.cross_entropy(x, t)
    assert.are.equal("bf16", plain.dtype)
    assert.is_true(math.abs(fused:item() - ref) <= 1e-6 * ref)
    assert.is_true(math.abs(fused:item() - ref) <= math.abs(plain:item() - ref))
  end)

  it("f32 and f64 logits, [B, T, C] logits: cross_entropy itself", function()
    engine.manual_seed(5)
    local x = engine.randn(2, 3, 7)
    local t = (engine.rand(2, 3) * 7):floor():to("i64")
    assert.are.equal(F.cross_entropy(x, t):item(), F.fused_classifier(x, t):item())
    local xd = x:double()
    assert.are.equal("f64", F.fused_classifier(xd, t).dtype)
    local xb = x:to("bf16")
    assert.is_true(math.abs(F.fused_classifier(xb, t):item() - F.cross_entropy(xb:float(), t):item()) < 1e-6)
  end)

  it("refuses bad arguments with the op's name", function()
    local x = engine.randn(4, 5):to("bf16")
    local t = engine.tensor({ 0, 1, 2, 3 }, "i64")
    err(function() engine.fused_classifier(x, engine.tensor({ 0, 1 }, "i64")) end, "fused_classifier", "target")
    err(function() engine.fused_classifier(x, engine.tensor({ 0, 1, 2, 5 }, "i64")) end,
      "fused_classifier: target 5 at position 4 is out of range for 5 classes")
    err(function() engine.fused_classifier(x, t, { reduction = "avg" }) end, "fused_classifier: reduction")
    err(function() engine.fused_classifier(x, t, { reduce = "sum" }) end, "fused_classifier", "reduce")
    err(function() engine.fused_classifier(x, t:float()) end, "fused_classifier", "class indices")
    err(function() engine.fused_classifier(x, t, { label_smoothing = 2 }) end, "label_smoothing")
  end)

  it("DTensors take cross_entropy on f32 logits (its sharding rules): batch-sharded on a 1-rank mesh", function()
    if dist.world_size() ~= 1 then pending("single-process spec") end
    local mesh = dist.init_device_mesh("cpu", { 1 })
    engine.manual_seed(6)
    local x = (engine.randn(6, 9) * 2):to("bf16")
    local t = (engine.rand(6) * 9):floor():to("i64")
    local dx = dist.distribute_tensor(x, mesh, { dist.Shard(1) })
    local dtg = dist.distribute_tensor(t, mesh, { dist.Shard(1) })
    local l = engine.fused_classifier(dx, dtg)
    assert.is_not_nil(l._c.dist ~= nil and l or nil)
    assert.is_true(math.abs(l:full_tensor():item() - F.cross_entropy(x:float(), t):item()) < 1e-6)
  end)

  it("the GPT model returns logits and the fused loss given targets (nanoGPT's model(idx, targets))", function()
    engine.manual_seed(7)
    local m = nn.Transformer({ n_layers = 1, dim = 16, n_heads = 2, vocab_size = 23, max_seq_len = 8, dropout_p = 0 })
    local tok = (engine.rand(2, 8) * 23):floor():to("i64")
    local tgt = (engine.rand(2, 8) * 23):floor():to("i64")
    local logits, loss = m(tok, tgt)
    assert.are.equal("f32", logits.dtype)
    assert.is_true(math.abs(loss:item() - F.cross_entropy(m(tok), tgt):item()) < 1e-6)
    m:to("bf16")
    local lb, lossb = m(tok, tgt)
    assert.are.equal("bf16", lb.dtype) -- the logits as computed: no f32 copy
    assert.are.equal("f32", lossb.dtype)
    assert.is_true(math.abs(lossb:item() - F.cross_entropy(lb:float(), tgt):item()) < 1e-5)
    lossb:backward()
    assert.are.equal("bf16", m.output.weight.grad.dtype)
    assert.is_true(math.abs(m(tok):float():sub(lb:float()):abs():max():item()) == 0)
  end)
end)
