-- engine.rotary_emb (engine/src/ops/rope.c, kernels/cpu/rope.c, kernels/cuda/rope.cu): the fused rotary embedding
-- equals the composite x * c2 + swap_pairs(x) * s2 (models.apply_rotary_emb's other path) forward and backward in
-- f64 / f32 / bf16, gives f64 finite-difference gradients, refuses bad shapes with the op's name, takes DTensors
-- (sharding/rope.c) and meta tensors, and on a GPU ("#gpu") equals the CPU.
local engine = require("engine")
local models = require("engine.models")

local function maxdiff(a, b) return (a:double() - b:double()):abs():max():item() end

-- the composite, as apply_rotary_emb computed it before the fused op
local function composite(x, cos, sin)
  local c2, s2 = models.rope_interleave(cos, sin)
  local D = x:size(4)
  local perm = {}
  for i = 0, D / 2 - 1 do perm[2 * i + 1], perm[2 * i + 2] = 2 * i + 1, 2 * i end
  local idx = engine.tensor(perm, { dtype = "i64", device = x.device })
  return x * c2 + x:index_select(4, idx) * s2
end

local function tables(T, half, dtype)
  local ang = engine.randn(T, half):double()
  return ang:cos():to(dtype), ang:sin():to(dtype)
end

describe("engine.rotary_emb", function()
  it("equals the composite, forward and backward (f64, f32, bf16; strided x)", function()
    for _, dt in ipairs({ "f64", "f32", "bf16" }) do
      engine.manual_seed(5)
      local base = engine.randn(2, 7, 3, 16):to(dt)
      local x1 = base:transpose(2, 3):contiguous():transpose(2, 3)   -- a strided [B, T, H, D] view
      x1 = x1:detach():requires_grad_()
      local x2 = base:clone():detach():requires_grad_()
      local cos, sin = tables(7, 8, dt)
      local a, b = engine.rotary_emb(x1, cos, sin), composite(x2, cos, sin)
      assert.are.equal(dt, a.dtype)
      local tol = dt == "f64" and 1e-14 or (dt == "f32" and 1e-6 or 3e-2)
      assert.is_true(maxdiff(a, b) <= tol, dt .. " forward " .. maxdiff(a, b))
      local g = engine.randn(2, 7, 3, 16):to(dt)
      ;(a:double() * g:double()):sum():backward()
      ;(b:double() * g:double()):sum():backward()
      assert.is_true(maxdiff(x1.grad, x2.grad) <= tol, dt .. " backward " .. maxdiff(x1.grad, x2.grad))
    end
  end)

  it("matches float64 finite differences", function()
    engine.manual_seed(6)
    local x = engine.randn({ 1, 3, 2, 4 }, { dtype = "f64" }):requires_grad_()
    local cos, sin = tables(3, 2, "f64")
    local w = engine.randn({ 1, 3, 2, 4 }, { dtype = "f64" })
    local function f(t) return (engine.rotary_emb(t, cos, sin) * w):sum():item() end
    ;(engine.rotary_emb(x, cos, sin) * w):sum():backward()
    local xd = x:detach()
    for i = 1, 24 do
      local flat = xd:view(-1)
      local v = flat:get(i)
      flat:set(v + 1e-6, i); local up = f(xd)
      flat:set(v - 1e-6, i); local dn = f(xd)
      flat:set(v, i)
      assert.is_true(math.abs((up - dn) / 2e-6 - x.grad:view(-1):get(i)) < 1e-8, "element " .. i)
    end
  end)

  it("refuses bad shapes and dtypes, naming the op and the layouts", function()
    local cos, sin = tables(3, 2, "f32")
    local cases = {
      { engine.randn(3, 2, 4), "rotary_emb: expected x of shape [B, T, H, D] with an even D, got f32[3,2,4]" },
      { engine.randn(1, 3, 2, 5), "with an even D, got f32[1,3,2,5]" },
      { engine.randn(1, 4, 2, 4), "rotary_emb: expected cos and sin of shape [T, D / 2] = [4, 2]" },
      { engine.tensor({ { { { 1, 2 } } } }, "i64"), "rotary_emb: expected floating point tensors" },
    }
    for _, c in ipairs(cases) do
      local ok, e = pcall(engine.rotary_emb, c[1], cos, sin)
      assert.is_false(ok)
      assert.is_truthy(tostring(e):find(c[2], 1, true), tostring(e))
    end
    local ok, e = pcall(engine.rotary_emb, engine.randn(1, 3, 2, 4), cos, sin:double())
    assert.is_false(ok)
    assert.is_truthy(tostring(e):find("one dtype", 1, true), tostring(e))
    -- meta tensors: the same checks
    local meta = { device = "meta" }
    ok, e = pcall(engine.rotary_emb, engine.empty({ 1, 3, 2, 5 }, meta), engine.empty({ 3, 2 }, meta),
      engine.empty({ 3, 2 }, meta))
    assert.is_false(ok)
    assert.is_truthy(tostring(e):find("with an even D, got f32[1,3,2,5]@meta", 1, true), tostring(e))
  end)

  it("DTensors (a one-rank mesh; spec/dist/rotary_emb_spec.lua for the layouts) and meta tensors", function()
    engine.manual_seed(9)
    local dist = engine.distributed
    local mesh = dist.init_device_mesh("cpu", { 1 })
    local x, cos, sin = engine.randn(2, 3, 2, 4), tables(3, 2, "f32")
    local d = dist.distribute_tensor(x, mesh, { dist.Shard(2) })
    local y = dist.implicit_replication(function() return engine.rotary_emb(d, cos, sin) end)
    assert.are.equal("Shard(2)", tostring(y.placements[1]))
    assert.are.equal(0, maxdiff(y:full_tensor(), engine.rotary_emb(x, cos, sin)))
    local m = engine.rotary_emb(engine.empty({ 2, 3, 2, 4 }, { device = "meta", dtype = "bf16" }),
      engine.empty({ 3, 2 }, { device = "meta" }), engine.empty({ 3, 2 }, { device = "meta" }))
    assert.is_true(m.is_meta)
    assert.are.equal("bf16", m.dtype)
    assert.are.same({ 2, 3, 2, 4 }, m:shape())
  end)

  it("Llama's apply_rotary_emb takes the fused path with [T, D/2] tables and equals the interleaved form", function()
    engine.manual_seed(7)
    local x = engine.randn(2, 5, 4, 8)
    local cos, sin = tables(5, 4, "f32")
    local c2, s2 = models.rope_interleave(cos, sin)
    assert.is_true(maxdiff(models.apply_rotary_emb(x, cos, sin), models.apply_rotary_emb(x, c2, s2)) <= 1e-6)
  end)
end)

describe("engine.rotary_emb on the GPU #gpu", function()
  it("equals the CPU forward and backward (f32, bf16)", function()
    if not engine.cuda.is_available() then pending("no GPU: " .. engine.cuda.unavailable_reason()) end
    for _, dt in ipairs({ "f32", "bf16" }) do
      engine.manual_seed(8)
      local x = engine.randn(2, 33, 4, 64):to(dt)
      local cos, sin = tables(33, 32, dt)
      local xc, xg = x:clone():requires_grad_(), x:cuda():requires_grad_()
      local a, b = engine.rotary_emb(xc, cos, sin), engine.rotary_emb(xg, cos:cuda(), sin:cuda())
      assert.are.equal("cuda", b.device)
      local tol = dt == "f32" and 1e-6 or 8e-3
      assert.is_true(maxdiff(a, b:cpu()) <= tol, dt .. " forward " .. maxdiff(a, b:cpu()))
      local g = engine.randn(2, 33, 4, 64):to(dt)
      ;(a * g):sum():backward()
      ;(b * g:cuda()):sum():backward()
      assert.is_true(maxdiff(xc.grad, xg.grad:cpu()) <= tol, dt .. " backward")
    end
  end)
end)
