-- AdamW with f32 master weights for bf16/f16 parameters (optim.AdamW{master_weights = true},
-- eng_adamw_step_master): the CPU path, which is the reference for the CUDA kernel
-- (spec/cuda_fused_spec.lua, #gpu).
--   * the step equals a float64 evaluation of torch.optim.AdamW's formula on the master, and the param is
--     the master rounded to bf16 (exactly);
--   * updates below half a bf16 ulp accumulate in the master, and are lost without it;
--   * 300 steps of a bf16 least-squares fit (weights in [1, 2), steps of about lr = 1e-3, below half a bf16
--     ulp) follow the f32 run: final loss within 2% of the f32 run's and weights within 0.02 of its
--     (measured: 0.4% and 0.006; docs/cuda.md "Mixed precision"), while without master weights the weights
--     do not move (loss stays at the initial one, weights 0.27 away);
--   * state_dict / load_state_dict carry the masters (an exact resume).
local engine = require("engine")
local nn, optim = engine.nn, engine.optim

local err = require("spec.helpers.errors").err -- err(fn, ...): fn raises, naming each string

local function maxdiff(a, b)
  local x, y = a:tolist_flat(), b:tolist_flat()
  assert.are.equal(#x, #y)
  local m = 0
  for i = 1, #x do m = math.max(m, math.abs(x[i] - y[i])) end
  return m
end

local function bf16_param(shape, seed, scale)
  engine.manual_seed(seed)
  return nn.Parameter((engine.randn(unpack(shape)) * (scale or 1)):to("bf16"))
end

describe("AdamW master_weights", function()
  it("is an option of AdamW; unknown options stay errors", function()
    local p = bf16_param({ 3 }, 1)
    err(function() optim.AdamW({ p }, { master_weight = true }) end, "unknown option 'master_weight'", "master_weights")
    err(function() optim.AdamW({ p }, { master_weights = 1 }) end, "master_weights must be true or false")
    local opt = optim.AdamW({ p }, { master_weights = true })
    assert.is_true(opt.param_groups[1].master_weights)
    assert.is_false(optim.AdamW({ p }).param_groups[1].master_weights)
    err(function() engine.adamw_step({ p }, { p:clone() }, { engine.zeros(3) }, { engine.zeros(3) },
      { step = 1, master_params = { engine.zeros(3, { dtype = "f64" }) } }) end, "master weight 1", "wrong dtype")
    local f = nn.Parameter(engine.zeros(3))
    err(function() engine.adamw_step({ f }, { f:clone() }, { engine.zeros(3) }, { engine.zeros(3) },
      { step = 1, master_params = { engine.zeros(3) } }) end, "master weights are for bf16/f16 params only")
    err(function() engine.adamw_step({ p }, { p:clone() }, { engine.zeros(3, { dtype = "bf16" }) },
      { engine.zeros(3, { dtype = "bf16" }) }, { step = 1, master_params = { engine.zeros(3) } }) end,
      "exp_avg 1", "must be f32")
    err(function() engine.adamw_step({ p }, { p:clone() }, { engine.zeros(3) }, { engine.zeros(3) },
      { step = 1, master_params = { engine.zeros(4) } }) end, "master weight 1", "does not match the shape")
  end)

  it("keeps an f32 master and f32 moments for bf16/f16 params, none for f32 params", function()
    local a, b = bf16_param({ 4, 3 }, 2), nn.Parameter(engine.randn(5))
    local h = nn.Parameter(engine.randn(2, 2):to("f16"))
    local opt = optim.AdamW({ a, b, h }, { lr = 1e-2, master_weights = true })
    for _, p in ipairs({ a, b, h }) do p.grad = engine.ones_like(p) end
    local a0 = a:float()
    opt:step()
    local sa, sb, sh = opt.state[a], opt.state[b], opt.state[h]
    assert.are.equal("f32", sa.master_param.dtype)
    assert.are.equal("f32", sa.exp_avg.dtype)
    assert.are.equal("f32", sa.exp_avg_sq.dtype)
    assert.are.equal("f32", sh.master_param.dtype)
    assert.is_nil(sb.master_param)
    assert.are.equal("bf16", a.dtype)
    assert.is_false(sa.master_param.requires_grad)
    -- the param is the master rounded to bf16
    assert.are.equal(0, maxdiff(a:float(), sa.master_param:to("bf16"):float()))
    assert.is_true(maxdiff(sa.master_param, a0) > 0)
  end)

  it("equals a float64 evaluation of the AdamW formula on the master", function()
    local p = bf16_param({ 7, 13 }, 3)
    local lr, b1, b2, eps, wd = 3e-3, 0.9, 0.95, 1e-8, 0.1
    local opt = optim.AdamW({ p }, { lr = lr, betas = { b1, b2 }, eps = eps, weight_decay = wd, master_weights = true })
    local w, m, v = p:float():tolist_flat(), {}, {}
    for i = 1, #w do m[i], v[i] = 0, 0 end
    for t = 1, 10 do
      engine.manual_seed(100 + t)
      local g = (engine.randn(7, 13) * 0.5):to("bf16")
      p.grad = g
      opt:step()
      local gv = g:float():tolist_flat()
      local bc1, bc2 = 1 - b1 ^ t, 1 - b2 ^ t
      for i = 1, #w do
        w[i] = w[i] * (1 - lr * wd)
        m[i] = b1 * m[i] + (1 - b1) * gv[i]
        v[i] = b2 * v[i] + (1 - b2) * gv[i] * gv[i]
        w[i] = w[i] - lr / bc1 * m[i] / (math.sqrt(v[i]) / math.sqrt(bc2) + eps)
      end
    end
    local st = opt.state[p]
    local got, gm, gv2 = st.master_param:tolist_flat(), st.exp_avg:tolist_flat(), st.exp_avg_sq:tolist_flat()
    for i = 1, #w do
      assert.is_true(math.abs(got[i] - w[i]) <= 2e-6 * math.max(1, math.abs(w[i])),
        string.format("master[%d]: %.10g vs float64 %.10g", i, got[i], w[i]))
      assert.is_true(math.abs(gm[i] - m[i]) <= 1e-6 * math.max(1, math.abs(m[i])), "exp_avg " .. i)
      assert.is_true(math.abs(gv2[i] - v[i]) <= 1e-6 * math.max(1, math.abs(v[i])), "exp_avg_sq " .. i)
    end
    assert.are.equal(0, maxdiff(p:float(), st.master_param:to("bf16"):float()))
  end)

  it("steps strided params (a transposed view) as contiguous ones", function()
    local a = bf16_param({ 6, 5 }, 4)
    local b = nn.Parameter(a:detach():t():contiguous():t()) -- same values, column-major strides
    assert.is_false(b:is_contiguous())
    local oa = optim.AdamW({ a }, { lr = 1e-3, master_weights = true })
    local ob = optim.AdamW({ b }, { lr = 1e-3, master_weights = true })
    for t = 1, 3 do
      engine.manual_seed(40 + t)
      local g = engine.randn(6, 5):to("bf16")
      a.grad = g; b.grad = g:t():contiguous():t()
      oa:step(); ob:step()
    end
    assert.are.equal(0, maxdiff(a:float(), b:float()))
    assert.are.equal(0, maxdiff(oa.state[a].master_param, ob.state[b].master_param))
  end)

  it("keeps updates below half a bf16 ulp that a bf16 step loses", function()
    local function run(master)
      local p = nn.Parameter(engine.ones(8):to("bf16"))
      local opt = optim.AdamW({ p }, { lr = 1e-4, weight_decay = 0, master_weights = master })
      for _ = 1, 100 do p.grad = engine.ones(8):to("bf16"); opt:step() end
      return p, opt
    end
    local plain = run(false)
    assert.are.equal(1, plain:float():max():item()) -- every step of 1e-4 rounds back to 1 (ulp 2^-7 below 1 is 2^-8)
    local p, opt = run(true)
    local w = opt.state[p].master_param
    -- 100 steps of lr * m_hat / sqrt(v_hat) = 1e-4 each (a constant gradient)
    assert.is_true(math.abs(w:max():item() - 0.99) < 1e-5, "master " .. w:max():item())
    assert.are.equal(0.98828125, p:float():max():item()) -- bf16(0.99)
  end)

  it("follows the f32 run over 300 steps of a bf16 least-squares fit", function()
    local n_in, n_out, batch = 16, 8, 64
    engine.manual_seed(7)
    -- weights in [1, 2) (bf16 ulp 2^-7) and steps of about lr = 1e-3: below half an ulp
    local W0 = (engine.rand(n_in, n_out) + 1):to("bf16"):float()
    local X = (engine.randn(batch, n_in) * 0.25):to("bf16"):float()
    local Y = X:double():matmul((W0 + engine.randn(n_in, n_out) * 0.3):double()):float()
    local function run(dt, master)
      local W = nn.Parameter(W0:clone():to(dt))
      local x = X:to(dt)
      local opt = optim.AdamW({ W }, { lr = 1e-3, weight_decay = 0, master_weights = master })
      local loss0, loss
      for step = 1, 300 do
        local d = x:matmul(W):float() - Y
        loss = (d * d):mean()
        if step == 1 then loss0 = loss:item() end
        opt:zero_grad()
        loss:backward()
        opt:step()
      end
      local d = x:matmul(W):float() - Y
      return W:float(), (d * d):mean():item(), loss0
    end
    local w32, l32, l0 = run("f32", false)
    local wm, lm = run("bf16", true)
    local wp, lp = run("bf16", false)
    assert.is_true(l32 < 0.5 * l0, string.format("the f32 run makes progress: %g -> %g", l0, l32))
    local dm, dp = maxdiff(wm, w32), maxdiff(wp, w32)
    assert.is_true(math.abs(lm - l32) <= 0.02 * l32,
      string.format("master weights: final loss %g vs f32 %g (initial %g)", lm, l32, l0))
    assert.is_true(dm <= 0.02, string.format("master weights: max |W - W_f32| = %g", dm))
    assert.is_true(dp >= 5 * dm, string.format("without master weights: max |W - W_f32| = %g (with: %g)", dp, dm))
    assert.is_true(lp - l32 > 0.05 * l0, string.format("without master weights: loss %g vs f32 %g", lp, l32))
  end)

  it("carries the masters through state_dict / load_state_dict (exact resume)", function()
    local function grads(p, t)
      engine.manual_seed(500 + t)
      p.grad = (engine.randn(5, 6) * 0.01):to("bf16")
    end
    local p1 = bf16_param({ 5, 6 }, 9)
    local o1 = optim.AdamW({ p1 }, { lr = 1e-4, master_weights = true })
    for t = 1, 3 do grads(p1, t); o1:step() end
    local sd = o1:state_dict()
    assert.are.equal("f32", sd.state[0].master_param.dtype)
    assert.is_true(maxdiff(sd.state[0].master_param, p1:float()) > 0) -- the master holds what bf16 cannot
    local p2 = nn.Parameter(p1:detach():clone())
    local o2 = optim.AdamW({ p2 }, { lr = 1, master_weights = true })
    o2:load_state_dict(sd)
    assert.are.equal("f32", o2.state[p2].master_param.dtype)
    assert.are.equal("f32", o2.state[p2].exp_avg.dtype)
    assert.are.equal(1e-4, o2.param_groups[1].lr)
    for t = 4, 6 do grads(p1, t); o1:step(); grads(p2, t); o2:step() end
    assert.are.equal(0, maxdiff(o1.state[p1].master_param, o2.state[p2].master_param))
    assert.are.equal(0, maxdiff(p1:float(), p2:float()))
    -- flat state dicts (safetensors files) too
    local tensors = o1:flatten_state_dict()
    assert.is_not_nil(tensors["state.0.master_param"])
    -- a state without masters (an older checkpoint) gets them at the next step
    local p3 = nn.Parameter(p1:detach():clone())
    local o3 = optim.AdamW({ p3 }, { lr = 1e-4 })
    grads(p3, 1); o3:step()
    o3.param_groups[1].master_weights = true
    grads(p3, 2); o3:step()
    assert.are.equal("f32", o3.state[p3].master_param.dtype)
    assert.are.equal("f32", o3.state[p3].exp_avg.dtype)
  end)
end)
