-- The mixed-precision training kernels on the GPU against their CPU paths (issue 28, item 2):
--   * AdamW with f32 master weights (kernels/cuda/optim.cu: the vectorised multi-tensor kernel, and the generic
--     one for views at odd offsets) against eng_adamw_step_master on the CPU (spec/optim_master_spec.lua
--     proves the CPU path against a float64 evaluation of the formula);
--   * the fused classifier (engine.fused_classifier: bf16 logits, f32 loss, bf16 gradient, no f32 logits)
--     against its CPU path and against cross_entropy on :float() logits (spec/fused_classifier_spec.lua).
-- Every test is #gpu: pending with the runtime's reason without a GPU.
--   build/engine /usr/bin/busted --ignore-lua -o tools/passfail.lua --tags=gpu spec/cuda_fused_spec.lua
local engine = require("engine")
local nn, optim = engine.nn, engine.optim
local F = nn.functional

local available = engine.cuda.is_available()
local reason = engine.cuda.unavailable_reason()
local function need_gpu() if not available then pending("no GPU: " .. reason) end end

local function maxabs(t) return t:numel() == 0 and 0 or t:double():abs():max():item() end
local function diff(a, b) return maxabs(a:cpu():double() - b:cpu():double()) end

-- One ulp of bf16 (f16) at the largest magnitude of t: the tolerance of a rounded copy.
local function ulp(t, dt)
  local m = math.max(maxabs(t), 1e-30)
  local e = math.floor(math.log(m) / math.log(2))
  return 2 ^ (e - (dt == "bf16" and 7 or 10))
end

describe("AdamW master weights on the GPU #gpu", function()
  before_each(function() engine.manual_seed(2811) end)

  -- sizes around the vector width (4), the chunk (65536) and the tensors per launch table (24)
  local SIZES = { 1, 3, 4, 5, 7, 1000, 4099, 65535, 65536, 65537, 131075 }

  local function make(dt, gdt, n_extra)
    local ps, gs, ms, vs, ws = {}, {}, {}, {}, {}
    local sizes = {}
    for _, n in ipairs(SIZES) do sizes[#sizes + 1] = n end
    for k = 1, n_extra or 0 do sizes[#sizes + 1] = 100 + 37 * k end
    for i, n in ipairs(sizes) do
      local p = engine.randn(n):to(dt)
      ps[i] = p
      gs[i] = (engine.randn(n) * 0.1):to(gdt)
      ms[i] = engine.randn(n) * 0.01
      vs[i] = (engine.randn(n) * 0.01):abs()
      ws[i] = p:float() + engine.randn(n) * 1e-3 -- a master that bf16 cannot hold
    end
    return ps, gs, ms, vs, ws
  end

  local function to_gpu(list) local r = {} for i, t in ipairs(list) do r[i] = t:cuda() end return r end
  local function clone(list) local r = {} for i, t in ipairs(list) do r[i] = t:clone() end return r end

  for _, case in ipairs({ { "bf16", "bf16" }, { "f16", "f16" }, { "bf16", "f32" } }) do
    local dt, gdt = case[1], case[2]
    it(string.format("%s params, %s grads: 5 steps over %d tensors equal the CPU path", dt, gdt, #SIZES + 30),
      function()
        need_gpu()
        local ps, gs, ms, vs, ws = make(dt, gdt, 30)
        local cp, cm, cv, cw = clone(ps), clone(ms), clone(vs), clone(ws)
        local gp, gg, gm, gv, gw = to_gpu(ps), to_gpu(gs), to_gpu(ms), to_gpu(vs), to_gpu(ws)
        for step = 1, 5 do
          local o = { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1, step = step }
          o.master_params = cw
          engine.adamw_step(cp, gs, cm, cv, o)
          o.master_params = gw
          engine.adamw_step(gp, gg, gm, gv, o)
        end
        for i = 1, #ps do
          local what = string.format("tensor %d (%d elements)", i, ps[i]:numel())
          assert.is_true(diff(gw[i], cw[i]) <= 2e-6 * math.max(1, maxabs(cw[i])), what .. ": master")
          assert.is_true(diff(gm[i], cm[i]) <= 1e-6 * math.max(1e-3, maxabs(cm[i])), what .. ": exp_avg")
          assert.is_true(diff(gv[i], cv[i]) <= 1e-6 * math.max(1e-4, maxabs(cv[i])), what .. ": exp_avg_sq")
          -- the param is the GPU master rounded (exactly), and within an ulp of the CPU param
          assert.are.equal(0, diff(gp[i], gw[i]:to(dt)))
          assert.is_true(diff(gp[i], cp[i]) <= ulp(cp[i], dt), what .. ": param")
        end
      end)
  end

  it("views at odd offsets take the generic kernel with the same result", function()
    need_gpu()
    local base = engine.randn(4099):to("bf16")
    local p = base:narrow(1, 2, 4097) -- 2 bytes past an aligned address
    local g = (engine.randn(4097) * 0.1):to("bf16")
    local m, v, w = engine.zeros(4097), engine.zeros(4097), p:float()
    local gb = base:cuda()
    local gp, gg, gm, gv, gw = gb:narrow(1, 2, 4097), g:cuda(), m:cuda(), v:cuda(), w:cuda()
    for step = 1, 3 do
      engine.adamw_step({ p }, { g }, { m }, { v }, { lr = 1e-3, step = step, master_params = { w } })
      engine.adamw_step({ gp }, { gg }, { gm }, { gv }, { lr = 1e-3, step = step, master_params = { gw } })
    end
    assert.is_true(diff(gw, w) <= 2e-6 * math.max(1, maxabs(w)))
    assert.are.equal(0, diff(gp, gw:to("bf16")))
    assert.are.equal(0, diff(gb:narrow(1, 1, 1), base:narrow(1, 1, 1))) -- the element before is untouched
  end)

  it("f32 params (no master) through the vectorised kernel equal the CPU path", function()
    need_gpu()
    local ps, gs, ms, vs = make("f32", "f32", 3)
    local cp, cm, cv = clone(ps), clone(ms), clone(vs)
    local gp, gg, gm, gv = to_gpu(ps), to_gpu(gs), to_gpu(ms), to_gpu(vs)
    for step = 1, 3 do
      engine.adamw_step(cp, gs, cm, cv, { lr = 1e-3, step = step })
      engine.adamw_step(gp, gg, gm, gv, { lr = 1e-3, step = step })
    end
    for i = 1, #ps do assert.is_true(diff(gp[i], cp[i]) <= 2e-6 * math.max(1, maxabs(cp[i])), "param " .. i) end
  end)

  it("optim.AdamW{master_weights = true} trains a bf16 model on the GPU as on the CPU", function()
    need_gpu()
    local function run(device)
      engine.manual_seed(5)
      local model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)):to("bf16")
      if device == "cuda" then model:to("cuda") end
      local opt = optim.AdamW(model:parameters(), { lr = 1e-3, master_weights = true })
      engine.manual_seed(6)
      local x, y = engine.randn(16, 32):to("bf16"), engine.randn(16, 8)
      if device == "cuda" then x, y = x:cuda(), y:cuda() end
      local loss
      for _ = 1, 20 do
        local d = model(x):float() - y
        loss = (d * d):mean()
        opt:zero_grad(); loss:backward(); opt:step()
      end
      return loss:item(), opt
    end
    local lc = run("cpu")
    local lg, opt = run("cuda")
    assert.is_true(math.abs(lg - lc) <= 2e-2 * math.abs(lc), string.format("loss gpu %g cpu %g", lg, lc))
    for _, st in pairs(opt.state) do
      assert.are.equal("f32", st.master_param.dtype)
      assert.are.equal("cuda", st.master_param.device)
    end
  end)
end)

describe("fused classifier on the GPU #gpu", function()
  for _, dt in ipairs({ "bf16", "f16" }) do
    for _, case in ipairs({ { "mean", 0 }, { "sum", 0 }, { "none", 0 }, { "mean", 0.1 } }) do
      local red, ls = case[1], case[2]
      it(string.format("%s logits [67, 50304], reduction %s, label_smoothing %g: equal to the CPU path", dt, red, ls),
        function()
          need_gpu()
          engine.manual_seed(99)
          local N, V = 67, 50304
          local x = (engine.randn(N, V) * 4):to(dt)
          local t = (engine.rand(N) * V):floor():to("i64")
          t:set(-100, 5)
          local w = engine.randn(N)
          local function run(device)
            local a = (device == "cuda" and x:cuda() or x:clone()):detach()
            a.requires_grad = true
            local tt = device == "cuda" and t:cuda() or t
            local l = F.fused_classifier(a, tt, { reduction = red, label_smoothing = ls })
            local s = red == "none" and (l * (device == "cuda" and w:cuda() or w)):sum() or l
            s:backward()
            return l, a.grad
          end
          local lc, gc = run("cpu")
          local lg, gg = run("cuda")
          assert.are.equal("f32", lg.dtype)
          assert.are.equal("cuda", gg.device)
          assert.are.equal(dt, gg.dtype)
          assert.is_true(diff(lg, lc) <= 2e-5 * math.max(1, maxabs(lc)), "loss")
          -- online logsumexp and the GPU's expf against the CPU's: a rounding of the gradient apart at most
          assert.is_true(diff(gg, gc) <= 2 * ulp(gc, dt), string.format("grad: %g (ulp %g)", diff(gg, gc), ulp(gc, dt)))
          -- and cross_entropy on f32 logits on the GPU agrees
          local ref = F.cross_entropy(x:cuda():float(), t:cuda(), { reduction = red, label_smoothing = ls })
          assert.is_true(diff(lg, ref) <= 2e-5 * math.max(1, maxabs(ref)), "loss vs cross_entropy(:float())")
        end)
    end
  end

  it("the bf16 GPT model's model(tokens, targets) on the GPU equals the CPU", function()
    need_gpu()
    local function run(device)
      engine.manual_seed(12)
      local m = nn.Transformer({ n_layers = 2, dim = 64, n_heads = 4, vocab_size = 515, max_seq_len = 32,
        dropout_p = 0 }):to("bf16")
      if device == "cuda" then m:to("cuda") end
      engine.manual_seed(13)
      local tok = (engine.rand(3, 32) * 515):floor():to("i64")
      local tgt = (engine.rand(3, 32) * 515):floor():to("i64")
      if device == "cuda" then tok, tgt = tok:cuda(), tgt:cuda() end
      local logits, loss = m(tok, tgt)
      loss:backward()
      return loss:item(), m.output.weight.grad, logits
    end
    local lc, gc = run("cpu")
    local lg, gg, logits = run("cuda")
    assert.are.equal("bf16", logits.dtype)
    assert.is_true(math.abs(lg - lc) <= 2e-2 * math.abs(lc), string.format("loss gpu %g cpu %g", lg, lc))
    assert.is_true(diff(gg, gc) <= 5e-2 * math.max(1e-3, maxabs(gc)), "output weight gradient")
  end)
end)
