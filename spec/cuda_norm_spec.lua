-- The bf16-native norm kernels and the 2-D bias-gradient reduction on the GPU (issue 28, item 2), against the CPU.
--
-- layer_norm / rms_norm of bf16 / f16 CUDA tensors run in their dtype (kernels/cuda/norm.cu: f32 arithmetic,
-- f32 mean/rstd), add_layer_norm runs fused on CUDA (the residual add inside the norm kernel), and linear's bias
-- gradient is the 2-D column sum (kernels/cuda/colsum.cu).  Every case runs both kernel paths: the warp-per-row
-- vector path (widths a multiple of 16 bytes, n <= 256 vectors: 768, 1000 (bf16: no), 2048 ...) and the generic
-- block-per-row path (33, 5000, a misaligned view).  The CPU computes half-precision norms in f32 from the same
-- half values and rounds once, so the tolerances are per element:
--   f32: |gpu - cpu| <= 1e-5 (1 + |cpu|) (y, dx; dw/db and bias grads: 1e-5 of the column's scale);
--   bf16 / f16: y within 1 ulp (rtol 2^-7 / 2^-10) plus 1e-4 absolute (where xhat w + b cancels); dx within 2
--   ulps plus 2e-3 of the row's largest |dx| (dx = rstd (w g - a - xhat c) cancels); dw, db, bias gradients
--   within 1 ulp plus 1e-5 of the number of rows (f32 sums then one rounding on both sides).
-- spec/c/test_cuda_norm.c proves the kernels' partition and summation order on the CPU and, with a GPU, checks
-- the kernels bit for bit against that emulation.  Everything here is tagged #gpu (pending without a GPU).
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local F = engine.nn.functional

local available = engine.cuda.is_available()
local reason = engine.cuda.unavailable_reason()
local function need_gpu() if not available then pending("no GPU: " .. reason) end end

local ULP = { bf16 = 2 ^ -7, f16 = 2 ^ -10, f32 = 1e-5 }

-- max over elements of |got - want| - rtol |want|, must be <= atol
local function within(got, want, rtol, atol, what)
  assert.are.equal(want.dtype, got.dtype, what .. ": dtype")
  assert.are.same(want:shape(), got:shape(), what .. ": shape")
  if want:numel() == 0 then return end
  local g, w = got:cpu():double(), want:cpu():double()
  local excess = ((g - w):abs() - w:abs() * rtol):max():item()
  assert.is_true(excess <= atol, string.format("%s: max(|gpu - cpu| - %g |cpu|) = %.3g > %.3g (max |cpu| %.3g)",
    what, rtol, excess, atol, w:abs():max():item()))
end
local function maxabs(t) return t:numel() == 0 and 0 or t:double():abs():max():item() end

-- A CUDA leaf copy and a CPU leaf copy of the same values (dtype dt).
local function pair(t, dt, grad)
  local c = t:to(dt):detach():clone()
  local g = c:cuda()
  if grad then c.requires_grad = true; g.requires_grad = true end
  return c, g
end

describe("bf16-native norms on CUDA #gpu", function()
  before_each(function() engine.manual_seed(2028) end)

  local SHAPES = { { 1, 768 }, { 37, 768 }, { 4, 128, 768 }, { 600, 33 }, { 5, 1000 }, { 130, 2048 }, { 3, 5000 },
    { 4100, 64 }, { 9, 8 } }

  it("layer_norm and rms_norm forward and backward match the CPU (f32, bf16, f16; vector and generic paths)", function()
    need_gpu()
    for _, dt in ipairs({ "bf16", "f16", "f32" }) do
      for _, s in ipairs(SHAPES) do
        for _, rms in ipairs({ false, true }) do
          for _, affine in ipairs({ true, false }) do
            local N = s[#s]
            local x0 = engine.randn(unpack(s)) * 2 + 3
            local xc, xg = pair(x0, dt, true)
            local wc, wg, bc, bg
            if affine then
              wc, wg = pair(engine.randn(N) * 0.3 + 1, dt, true)
              if not rms then bc, bg = pair(engine.randn(N) * 0.3, dt, true) end
            end
            local yc = rms and F.rms_norm(xc, { N }, wc, 1e-5) or F.layer_norm(xc, { N }, wc, bc, 1e-5)
            local yg = rms and F.rms_norm(xg, { N }, wg, 1e-5) or F.layer_norm(xg, { N }, wg, bg, 1e-5)
            local what = string.format("%s %s %s affine=%s", rms and "rms_norm" or "layer_norm", dt,
              table.concat(s, "x"), tostring(affine))
            assert.are.equal(dt, yg.dtype, what .. ": output dtype")
            if dt == "f32" then within(yg, yc, 1e-5, 1e-5, what .. " y")
            else within(yg, yc, ULP[dt], 1e-4, what .. " y") end
            local go = engine.randn(unpack(s)):to(dt)
            ;(yc * go):sum():backward()
            ;(yg * go:cuda()):sum():backward()
            local rows = x0:numel() / N
            if dt == "f32" then
              within(xg.grad, xc.grad, 1e-5, 1e-5 * (1 + maxabs(xc.grad)), what .. " dx")
            else
              within(xg.grad, xc.grad, 2 * ULP[dt], 2e-3 * maxabs(xc.grad), what .. " dx")
            end
            local ptol = dt == "f32" and 1e-5 or ULP[dt]
            if wc then within(wg.grad, wc.grad, ptol, 1e-5 * rows, what .. " dw") end
            if bc then within(bg.grad, bc.grad, ptol, 1e-5 * rows, what .. " db") end
          end
        end
      end
    end
  end)

  it("a misaligned view takes the generic kernel and agrees with the vector kernel", function()
    need_gpu()
    local M, N = 64, 768
    local flat = (engine.randn(M * N + 1) * 2 + 1):to("bf16"):cuda()
    local xa = flat:narrow(1, 2, M * N):view(M, N) -- contiguous, 2 bytes past a 16-byte boundary
    local xv = xa:clone()                          -- aligned
    local w = (engine.randn(N) * 0.3 + 1):to("bf16"):cuda()
    local b = (engine.randn(N) * 0.3):to("bf16"):cuda()
    local ya, yv = F.layer_norm(xa, { N }, w, b, 1e-5), F.layer_norm(xv, { N }, w, b, 1e-5)
    within(ya, yv, ULP.bf16, 1e-4, "misaligned vs aligned layer_norm")
    local yc = F.layer_norm(xv:cpu(), { N }, w:cpu(), b:cpu(), 1e-5)
    within(ya, yc, ULP.bf16, 1e-4, "misaligned layer_norm vs the CPU")
  end)

  it("weight and bias gradients are deterministic (the same bits twice)", function()
    need_gpu()
    local x = (engine.randn(8, 1024, 768) + 1):to("bf16"):cuda()
    local w = (engine.randn(768) * 0.3 + 1):to("bf16"):cuda():requires_grad_(true)
    local b = engine.randn(768):to("bf16"):cuda():requires_grad_(true)
    local go = engine.randn(8, 1024, 768):to("bf16"):cuda()
    local got = {}
    for k = 1, 2 do
      w.grad = nil; b.grad = nil
      ;(F.layer_norm(x, { 768 }, w, b, 1e-5) * go):sum():backward()
      got[k] = { w.grad:cpu():tolist(), b.grad:cpu():tolist() }
    end
    assert.are.same(got[1], got[2])
  end)
end)

describe("add_layer_norm on CUDA #gpu", function()
  before_each(function() engine.manual_seed(77) end)

  it("is fused (AddLayerNormBackward) and equals add + layer_norm on the GPU and the CPU", function()
    need_gpu()
    for _, dt in ipairs({ "bf16", "f16", "f32" }) do
      for _, s in ipairs({ { 2, 64, 768 }, { 1, 1, 768 }, { 3, 33 }, { 4, 1000 }, { 2, 5000 } }) do
        for _, affine in ipairs({ true, false }) do
          local D = s[#s]
          local x0, r0, gy0, gh0 = engine.randn(unpack(s)), engine.randn(unpack(s)), engine.randn(unpack(s)),
              engine.randn(unpack(s))
          local w0, b0 = engine.randn(D) * 0.3 + 1, engine.randn(D) * 0.3
          local function run(device, fused)
            local function leaf(t) return t:to(dt):to(device):clone():requires_grad_(true) end
            local x, r = leaf(x0), leaf(r0)
            local w = affine and leaf(w0) or nil
            local b = affine and leaf(b0) or nil
            local y, h
            if fused then y, h = F.add_layer_norm(x, r, { D }, w, b)
            else h = x + r; y = F.layer_norm(h, { D }, w, b) end
            if fused and device == "cuda" then assert.are.equal("AddLayerNormBackward", h.grad_fn) end
            local loss = (y * gy0:to(dt):to(device)):sum() + (h * gh0:to(dt):to(device)):sum()
            loss:backward()
            return { y = y:detach(), h = h:detach(), x = x.grad, r = r.grad, w = w and w.grad, b = b and b.grad }
          end
          local fg, cg, cc = run("cuda", true), run("cuda", false), run("cpu", false)
          local what = string.format("add_layer_norm %s %s affine=%s", dt, table.concat(s, "x"), tostring(affine))
          -- on the GPU: the same kernel arithmetic as the composition, so y and h are the same bits
          assert.are.same(cg.h:cpu():tolist(), fg.h:cpu():tolist(), what .. ": h = the GPU's x + r")
          assert.are.same(cg.y:cpu():tolist(), fg.y:cpu():tolist(), what .. ": y = the GPU's layer_norm(h)")
          local rows = x0:numel() / D
          local u = dt == "f32" and 1e-5 or ULP[dt]
          within(fg.y, cc.y, u, 1e-4, what .. ": y vs the CPU")
          within(fg.x, cc.x, 2 * u, 2e-3 * maxabs(cc.x), what .. ": dx vs the CPU")
          within(fg.r, fg.x, 0, 0, what .. ": dr = dx")
          within(fg.x, cg.x, 2 * u, 2e-3 * maxabs(cg.x), what .. ": dx vs the GPU composition")
          if affine then
            within(fg.w, cc.w, u, 1e-5 * rows, what .. ": dw vs the CPU")
            within(fg.b, cc.b, u, 1e-5 * rows, what .. ": db vs the CPU")
          end
        end
      end
    end
  end)
end)

describe("linear's bias gradient on CUDA (2-D column sum) #gpu", function()
  before_each(function() engine.manual_seed(31) end)

  it("matches the CPU for bf16, f16 and f32, odd widths, one row and row counts off the tile", function()
    need_gpu()
    for _, dt in ipairs({ "bf16", "f16", "f32" }) do
      for _, s in ipairs({ { 8, 128, 64, 768 }, { 1, 1, 64, 768 }, { 1000, 32, 3072 }, { 7, 3, 16, 33 },
        { 4096, 16, 50 }, { 65, 8, 1 } }) do
        local of, inf = s[#s], s[#s - 1]
        local lead = {}
        for i = 1, #s - 2 do lead[i] = s[i] end
        local xs = { unpack(lead) }; xs[#xs + 1] = inf
        local gs = { unpack(lead) }; gs[#gs + 1] = of
        local x0, w0, b0, g0 = engine.randn(unpack(xs)), engine.randn(of, inf) * 0.1, engine.randn(of),
            engine.randn(unpack(gs))
        local function run(device)
          local x = x0:to(dt):to(device)
          local w = w0:to(dt):to(device):clone():requires_grad_(true)
          local b = b0:to(dt):to(device):clone():requires_grad_(true)
          ;(F.linear(x, w, b) * g0:to(dt):to(device)):sum():backward()
          return b.grad
        end
        local gg, gc = run("cuda"), run("cpu")
        local rows = x0:numel() / inf
        local what = string.format("linear bias grad %s %s", dt, table.concat(s, "x"))
        within(gg, gc, dt == "f32" and 1e-5 or ULP[dt], 1e-5 * rows, what)
        -- against float64 as well
        local want = g0:to(dt):double():reshape(rows, of):sum(1)
        within(gg:double(), want, dt == "f32" and 1e-5 or ULP[dt], 1e-5 * rows, what .. " vs float64")
      end
    end
  end)
end)
