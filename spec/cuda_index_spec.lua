-- Issue 17 items 1, 4, 5 on CUDA tensors: the indexing ops (ops/index.c: CPU kernels behind a
-- host round trip, the documented CUDA fallback), the matmul family (cuBLAS through matmul) and
-- the losses/activations (composites of CUDA ops), forward and backward on the GPU equal to the
-- CPU from the same inputs.  Without a GPU each test is pending (counted as skipped).
--   only these: build/engine /usr/bin/busted --ignore-lua spec/cuda_index_spec.lua
local engine = require("engine")

local available = engine.cuda.is_available()
local reason = engine.cuda.unavailable_reason()
local function need_gpu() if not available then pending("no GPU: " .. reason) end end

local function close(g, c, tol, what)
  assert.are.equal("cuda", g.device, what)
  local e = (g:cpu():double() - c:double()):abs():max():item()
  local s = c:double():abs():max():item() + 1
  assert.is_true(e <= tol * s, string.format("%s: GPU and CPU differ by %g", what, e))
end

-- runs fn on CPU inputs and on their CUDA copies; compares outputs and input grads
local function both(what, fn, inputs, tol)
  local cpu, gpu = {}, {}
  for i, t in ipairs(inputs) do
    cpu[i] = t:clone(); gpu[i] = t:cuda()
    if t:is_floating_point() then cpu[i].requires_grad = true; gpu[i] = gpu[i]:detach(); gpu[i].requires_grad = true end
  end
  local oc, og = fn(unpack(cpu)), fn(unpack(gpu))
  close(og, oc, tol, what)
  if oc.requires_grad then
    oc:sum():backward(); og:sum():backward()
    for i = 1, #inputs do
      if cpu[i].grad then close(gpu[i].grad, cpu[i].grad, tol, what .. " grad " .. i) end
    end
  end
end

describe("matmul family, indexing and math ops on CUDA #gpu", function()
  it("gather / scatter / scatter_add / index_add / index_copy / nonzero / masked_select", function()
    need_gpu()
    engine.manual_seed(1)
    for _, dt in ipairs({ "f32", "f64", "bf16" }) do
      local x = engine.randn(4, 3, { dtype = dt })
      local idx = engine.tensor({ { 2, 0 }, { 1, 1 }, { 0, 2 }, { 2, 2 } })
      local tol = dt == "bf16" and 1e-2 or 1e-6
      both("gather " .. dt, function(a, i) return a:gather(2, i) end, { x, idx }, tol)
      both("scatter_add " .. dt, function(a, i, s) return a:scatter_add(2, i, s) end, { x, idx, engine.randn(4, 2, { dtype = dt }) }, tol)
      both("scatter " .. dt, function(a, i, s) return a:scatter(1, i, s) end, { x, engine.tensor({ { 3, 0, 1 } }), engine.randn(1, 3, { dtype = dt }) }, tol)
      both("index_add " .. dt, function(a, i, s) return a:index_add(1, i, s, { alpha = 2 }) end, { x, engine.tensor({ 3, 3 }), engine.randn(2, 3, { dtype = dt }) }, tol)
      both("index_copy " .. dt, function(a, i, s) return a:index_copy(2, i, s) end, { x, engine.tensor({ 1 }), engine.randn(4, 1, { dtype = dt }) }, tol)
      both("masked_select " .. dt, function(a) return a:masked_select(a:detach():gt(0)) end, { x }, tol)
    end
    -- integer atomics, duplicates accumulating, and u8 through the host fallback
    for _, dt in ipairs({ "i32", "i64", "u8" }) do
      local a = engine.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, dt)
      local i = engine.tensor({ { 0, 0, 2 }, { 1, 1, 1 } })
      assert.are.same(a:scatter_add(2, i, a):totable(), a:cuda():scatter_add(2, i:cuda(), a:cuda()):cpu():totable())
      assert.are.same(a:index_add(1, engine.tensor({ 1, 1 }), a, { alpha = 2 }):totable(),
        a:cuda():index_add(1, engine.tensor({ 1, 1 }):cuda(), a:cuda(), { alpha = 2 }):cpu():totable())
      assert.are.same(a:gather(2, i):totable(), a:cuda():gather(2, i:cuda()):cpu():totable())
    end
    local big = engine.randn(64, 130)
    local bi = engine.randint and engine.randint(0, 130, { 64, 300 }) or (engine.rand(64, 300) * 130):floor():long()
    close(big:cuda():gather(2, bi:cuda()), big:gather(2, bi), 0, "gather 64x300")
    close(engine.zeros(64, 130):cuda():scatter_add(2, bi:cuda(), engine.ones(64, 300):cuda()),
      engine.zeros(64, 130):scatter_add(2, bi, engine.ones(64, 300)), 1e-6, "scatter_add 64x300 duplicates")
    local z = engine.tensor({ { 0, 1 }, { 2, 0 } }):cuda()
    local nz = engine.nonzero(z)
    assert.are.equal("cuda", nz.device)
    assert.are.same({ { 0, 1 }, { 1, 0 } }, nz:cpu():totable())
    local y = engine.zeros(3, 2):cuda()
    y:index_add_(1, engine.tensor({ 1 }):cuda(), engine.ones(1, 2):cuda())
    assert.are.same({ { 0, 0 }, { 1, 1 }, { 0, 0 } }, y:cpu():totable())
  end)
  it("composite shape ops, the matmul family and einsum", function()
    need_gpu()
    engine.manual_seed(2)
    local x = engine.randn(4, 6)
    for _, c in ipairs({
      { "triu", function(a) return a:triu(1) end }, { "repeat", function(a) return a:repeat_tensor(2, 1) end },
      { "repeat_interleave", function(a) return a:repeat_interleave(engine.tensor({ 1, 0, 2, 1 }), 1) end },
      { "roll", function(a) return a:roll(2, 2) end }, { "flip", function(a) return a:flip(1) end },
      { "movedim", function(a) return a:movedim(1, 2) end }, { "unflatten", function(a) return a:unflatten(2, { 3, 2 }) end },
    }) do both(c[1], c[2], { x }, 1e-6) end
    assert.are.same(engine.one_hot(engine.tensor({ 0, 2 })):totable(), engine.one_hot(engine.tensor({ 0, 2 }):cuda()):cpu():totable())
    both("mm", engine.mm, { engine.randn(4, 8), engine.randn(8, 3) }, 1e-4)
    both("addmm", function(c, a, b) return engine.addmm(c, a, b, { beta = 0.5 }) end, { engine.randn(3), engine.randn(4, 8), engine.randn(8, 3) }, 1e-4)
    both("baddbmm", engine.baddbmm, { engine.randn(2, 4, 3), engine.randn(2, 4, 8), engine.randn(2, 8, 3) }, 1e-4)
    both("outer", engine.outer, { engine.randn(4), engine.randn(5) }, 1e-5)
    both("einsum bhqd,bhkd->bhqk", function(a, b) return engine.einsum("bhqd,bhkd->bhqk", a, b) end,
      { engine.randn(2, 2, 4, 8), engine.randn(2, 2, 5, 8) }, 1e-4)
  end)
  it("losses and activations", function()
    need_gpu()
    engine.manual_seed(3)
    local x, y = engine.randn(6, 5), engine.randn(6, 5)
    local t = engine.tensor({ 0, 4, -100, 2, 1, 3 })
    local w = engine.tensor({ 1, 2, 0.5, 1, 3 })
    both("nll_loss", function(a, tt, ww) return engine.nll_loss(a:log_softmax(2), tt, { weight = ww }) end, { x, t, w }, 1e-5)
    both("cross_entropy", function(a, tt, ww) return engine.cross_entropy(a, tt, { weight = ww, label_smoothing = 0.1 }) end, { x, t, w }, 1e-5)
    both("bce", function(a, b) return engine.binary_cross_entropy(a:sigmoid(), b:sigmoid()) end, { x, y }, 1e-5)
    both("bce_with_logits", function(a, b) return engine.binary_cross_entropy_with_logits(a, b:sigmoid()) end, { x, y }, 1e-5)
    both("kl_div", function(a, b) return engine.kl_div(a:log_softmax(2), b:softmax(2), { reduction = "batchmean" }) end, { x, y }, 1e-5)
    both("smooth_l1", function(a, b) return engine.smooth_l1_loss(a, b) end, { x, y }, 1e-5)
    both("huber", function(a, b) return engine.huber_loss(a, b, { delta = 0.5 }) end, { x, y }, 1e-5)
    for _, name in ipairs({ "softplus", "leaky_relu", "elu", "hardtanh", "glu" }) do
      both(name, function(a) return engine[name](a:narrow(2, 1, 4)) end, { x * 3 }, 1e-5)
    end
  end)
end)
