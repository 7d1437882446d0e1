-- layer_norm and rms_norm: values against PyTorch, float64 gradient checks
-- for x, weight and bias, dtypes, layouts and errors.
local engine = require("engine")
local gc = require("spec.helpers.gradcheck")

local function errmatch(fn, pat)
  local ok, err = pcall(fn)
  assert.is_false(ok, "expected an error matching '" .. pat .. "'")
  assert.truthy(tostring(err):find(pat, 1, true), "error '" .. tostring(err) .. "' does not contain '" .. pat .. "'")
  return err
end

local function close(want, got, tol, what)
  local g = engine.is_tensor(got) and got:tolist_flat() or got
  assert.are.equal(#want, #g, what)
  for i = 1, #want do
    local err = math.abs(want[i] - g[i]) / math.max(1, math.abs(want[i]))
    assert.is_true(err <= tol, string.format("%s[%d]: want %.15g got %.15g", what or "value", i, want[i], g[i]))
  end
end

local function f64(t, shape)
  local x = engine.tensor(t, "f64")
  if shape then x = x:view(shape) end
  return x
end

-- Reference values from torch 1.13 (F.layer_norm; rms_norm written out as
-- x * rsqrt(mean(x^2) + eps) * w).
local X = { { 1, 2, 3, 4 }, { -1, 0.5, 7, 2 } }
local W = { 0.5, -1, 2, 1.5 }
local B = { 0.1, 0.2, -0.3, 0 }
local GO = { { 1, -2, 0.5, 3 }, { 0.2, 0.1, -1, 2 } }

describe("layer_norm", function()
  it("matches PyTorch forward and backward (x, weight, bias)", function()
    local x, w, b = f64(X), f64(W), f64(B)
    x.requires_grad, w.requires_grad, b.requires_grad = true, true, true
    local y = engine.layer_norm(x, 4, w, b)
    assert.are.equal("LayerNormBackward", y.grad_fn)
    close({ -0.570817709984464, 0.647211806656309, 0.594423613312618, 2.01245312995339, -0.419481984721433,
      0.740261264110291, 2.94156758466174, -0.062337838166572 }, y, 1e-13, "y")
    y:backward(f64(GO))
    close({ 0.134151735699647, 0.491929051889525, -1.38635266520214, 0.76027187761297, -0.344871112978626,
      -0.269764402649193, -0.28785274378409, 0.902488259411908 }, x.grad, 1e-13, "dx")
    close({ -1.5494282138575, 0.840397486901589, -1.39717788900272, 3.94178914235135 }, w.grad, 1e-13, "dw")
    close({ 1.2, -1.9, -0.5, 5 }, b.grad, 1e-13, "db")
  end)

  it("normalizes over several trailing dims without affine parameters", function()
    local vals = {}
    for i = 0, 11 do vals[#vals + 1] = i ^ 1.5 end
    local x = f64(vals, { 2, 2, 3 })
    local y = engine.layer_norm(x, { 2, 3 })
    close({ -1.19779030313317, -0.942985752622982, -0.477094200961388, 0.126212979317031, 0.840646100948355,
      1.65101117645216, -1.40354292747846, -0.890592956967219, -0.339562416556675, 0.247078486931979,
      0.867286231640008, 1.51933358243036 }, y, 1e-12, "y")
    assert.are.same({ 2, 2, 3 }, y:shape())
  end)

  it("passes float64 gradient checks for x, weight and bias", function()
    engine.manual_seed(10)
    local x = engine.randn(3, 2, 5, { dtype = "f64", requires_grad = true })
    local w = engine.randn(5, { dtype = "f64", requires_grad = true })
    local b = engine.randn(5, { dtype = "f64", requires_grad = true })
    assert.is_true(gc.check(function(x, w, b) return engine.layer_norm(x, 5, w, b) end, { x, w, b }))
    local w2 = engine.randn(2, 5, { dtype = "f64", requires_grad = true })
    local b2 = engine.randn(2, 5, { dtype = "f64", requires_grad = true })
    assert.is_true(gc.check(function(x, w, b) return engine.layer_norm(x, { 2, 5 }, w, b, 1e-3) end, { x, w2, b2 }))
    assert.is_true(gc.check(function(x) return engine.layer_norm(x, { 3, 2, 5 }) end, { x }))
    assert.is_true(gc.check(function(x, w) return engine.layer_norm(x, 5, w) end, { x, w }))
    assert.is_true(gc.check(function(x, b) return engine.layer_norm(x, 5, nil, b) end, { x, b }))
  end)

  it("gives only the gradients that are needed", function()
    local x = engine.randn(2, 4, { dtype = "f64" })
    local w = engine.randn(4, { dtype = "f64", requires_grad = true })
    local b = engine.randn(4, { dtype = "f64" })
    engine.layer_norm(x, 4, w, b):sum():backward()
    assert.is_not_nil(w.grad)
    assert.is_nil(x.grad)
    assert.is_nil(b.grad)
    assert.is_nil(engine.layer_norm(x, 4, nil, b).grad_fn)
  end)

  it("computes f32 in double-accumulated statistics (large mean, small spread)", function()
    local vals = {}
    for i = 1, 64 do vals[i] = 10000 + (i % 7) * 0.01 end
    local x32 = f64(vals, { 2, 32 }):float()
    local y64 = engine.layer_norm(x32:double(), 32)
    local y32 = engine.layer_norm(x32, 32)
    assert.are.equal("f32", y32.dtype)
    close(y64:tolist_flat(), y32, 1e-5, "f32 vs f64")
  end)

  it("computes f32 forward and backward like f64 (row tails, several blocks of rows, wide rows)", function()
    engine.manual_seed(11)
    -- widths: a multiple of 16, a tail, one over the kernel's stack limit (4096); 70 rows: blocks of 32 and a part
    for _, n in ipairs({ 256, 300, 4100 }) do
      local rows = n > 1000 and 5 or 70
      for _, rms in ipairs({ false, true }) do
        local x = engine.randn(rows, n) * 3 + 5      -- a mean away from 0
        local w, b = engine.randn(n), engine.randn(n)
        local g = engine.randn(rows, n)
        local function run(dt)
          local xx, ww, bb = x:to(dt):clone(), w:to(dt):clone(), b:to(dt):clone()
          xx.requires_grad, ww.requires_grad, bb.requires_grad = true, true, true
          local y = rms and engine.rms_norm(xx, n, ww, 1e-5) or engine.layer_norm(xx, n, ww, bb, 1e-5)
          y:backward(g:to(dt))
          return y, xx.grad, ww.grad, (not rms) and bb.grad or nil
        end
        local y32, gx32, gw32, gb32 = run("f32")
        local y64, gx64, gw64, gb64 = run("f64")
        local what = string.format("%s n=%d", rms and "rms_norm" or "layer_norm", n)
        close(y64:tolist_flat(), y32, 1e-6, what .. " y")
        close(gx64:tolist_flat(), gx32, 1e-6, what .. " dx")
        close(gw64:tolist_flat(), gw32, 1e-5, what .. " dw")
        if gb32 then close(gb64:tolist_flat(), gb32, 1e-5, what .. " db") end
      end
    end
  end)

  it("keeps bf16/f16 inputs in their dtype and accepts mixed parameter dtypes", function()
    engine.manual_seed(4)
    local x = engine.randn(4, 8)
    local w, b = engine.randn(8), engine.randn(8)
    local ref = engine.layer_norm(x, 8, w, b):tolist_flat()
    for _, dt in ipairs({ "bf16", "f16" }) do
      local y = engine.layer_norm(x:to(dt), 8, w, b)
      assert.are.equal(dt, y.dtype)
      close(ref, y, dt == "bf16" and 5e-2 or 1e-2, dt)
    end
    local xb = x:bfloat16()
    xb.requires_grad = true
    local wb = w:clone()
    wb.requires_grad = true
    engine.layer_norm(xb, 8, wb, b):sum():backward()
    assert.are.equal("bf16", xb.grad.dtype)
    assert.are.equal("f32", wb.grad.dtype)
  end)

  it("handles strided inputs like their contiguous copies", function()
    engine.manual_seed(5)
    local base = engine.randn(6, 4, { dtype = "f64" })
    local x = base:t() -- [4, 6], not contiguous
    local w = engine.randn(6, { dtype = "f64" })
    assert.are.same(engine.layer_norm(x:contiguous(), 6, w):tolist_flat(), engine.layer_norm(x, 6, w):tolist_flat())
    local xr = base:t()
    xr.requires_grad = false
    local leaf = base:clone()
    leaf.requires_grad = true
    assert.is_true(gc.check(function(l) return engine.layer_norm(l:t(), 6) end, { leaf }))
  end)

  it("handles empty batches", function()
    local x = engine.zeros(0, 4, { requires_grad = true })
    local w = engine.ones(4, { requires_grad = true })
    local y = engine.layer_norm(x, 4, w)
    assert.are.same({ 0, 4 }, y:shape())
    y:sum():backward()
    assert.are.same({ 0, 0, 0, 0 }, w.grad:tolist_flat())
  end)

  it("uses eps = 1e-5 by default", function()
    local x = f64({ 0, 0.002 })
    close(engine.layer_norm(x, 2, nil, nil, 1e-5):tolist_flat(), engine.layer_norm(x, 2), 0, "default eps")
    local y = engine.layer_norm(x, 2):tolist_flat()
    close({ -0.001 / math.sqrt(1e-6 + 1e-5), 0.001 / math.sqrt(1e-6 + 1e-5) }, y, 1e-12, "eps value")
  end)

  it("detects a saved input modified in place", function()
    local x = engine.randn(2, 3, { dtype = "f64", requires_grad = true })
    local h = x * 1
    local y = engine.layer_norm(h, 3)
    engine.no_grad(function() h:add_(1) end)
    errmatch(function() y:sum():backward() end, "modified by an in-place operation")
  end)

  it("reports shape, dtype and argument errors", function()
    local x = engine.zeros(2, 3)
    errmatch(function() engine.layer_norm(x, 4) end, "normalized_shape {4} does not match the last dims of input f32[2,3]")
    errmatch(function() engine.layer_norm(x, { 2, 3, 1 }) end, "does not match the last dims")
    errmatch(function() engine.layer_norm(x, {}) end, "normalized_shape must be")
    errmatch(function() engine.layer_norm(x, 3, engine.ones(4)) end, "weight f32[4] does not match the normalized shape [3]")
    errmatch(function() engine.layer_norm(x, 3, nil, engine.ones(2, 3)) end, "bias f32[2,3] does not match")
    errmatch(function() engine.layer_norm(x, 3, engine.ones(3, { dtype = "i64" })) end, "weight must be floating point")
    errmatch(function() engine.layer_norm(engine.zeros(2, 3, { dtype = "i64" }), 3) end, "floating point input, got i64[2,3]")
    errmatch(function() engine.layer_norm(x, 3, nil, nil, -1) end, "eps must be finite and >= 0")
    errmatch(function() engine.layer_norm(x, 3, "w") end, "argument 3 must be a tensor")
    errmatch(function() engine.layer_norm(nil, 3) end, "argument 1 must be a tensor")
  end)
end)

describe("rms_norm", function()
  it("matches PyTorch forward and backward (x, weight)", function()
    local x, w = f64(X), f64(W)
    x.requires_grad, w.requires_grad = true, true
    local y = engine.rms_norm(x, 4, w, 1e-6)
    assert.are.equal("RmsNormBackward", y.grad_fn)
    close({ 0.182574173663444, -0.730296694653777, 2.19089008396133, 2.19089008396133, -0.135768841655123,
      -0.135768841655123, 3.80152756634345, 0.81461304993074 }, y, 1e-13, "y")
    y:backward(f64(GO))
    close({ -0.127801880180937, 0.109544586965014, -0.565979814206255, 0.401663347593473, -0.0136394474441946,
      -0.00675716044341501, -0.257522856193958, 0.896199481481179 }, x.grad, 1e-13, "dx")
    close({ 0.310840810664839, -1.44701650514204, -1.35304126218139, 5.46793090116365 }, w.grad, 1e-13, "dw")
  end)

  it("passes float64 gradient checks", function()
    engine.manual_seed(11)
    local x = engine.randn(4, 3, 2, { dtype = "f64", requires_grad = true })
    local w = engine.randn(2, { dtype = "f64", requires_grad = true })
    local w2 = engine.randn(3, 2, { dtype = "f64", requires_grad = true })
    assert.is_true(gc.check(function(x, w) return engine.rms_norm(x, 2, w, 1e-5) end, { x, w }))
    assert.is_true(gc.check(function(x, w) return engine.rms_norm(x, { 3, 2 }, w, 1e-5) end, { x, w2 }))
    assert.is_true(gc.check(function(x) return engine.rms_norm(x, 2) end, { x }))
  end)

  it("defaults eps to the machine epsilon of the input dtype", function()
    -- mean(x^2) = 1e-8: eps decides the result
    local y64 = engine.rms_norm(f64({ 1e-4, 1e-4 }), 2):tolist_flat()
    close({ 1e-4 / math.sqrt(1e-8 + 2.220446049250313e-16), 1e-4 / math.sqrt(1e-8 + 2.220446049250313e-16) }, y64, 1e-12, "f64")
    local y32 = engine.rms_norm(engine.tensor({ 1e-4, 1e-4 }), 2):tolist_flat()
    local want = 1e-4 / math.sqrt(1e-8 + 1.1920928955078125e-07)
    close({ want, want }, y32, 1e-5, "f32")
  end)

  it("reports errors", function()
    errmatch(function() engine.rms_norm(engine.zeros(2, 3), 2) end, "does not match the last dims")
    errmatch(function() engine.rms_norm(engine.zeros(2, 3), 3, engine.ones(2)) end, "rms_norm: weight f32[2] does not match")
    errmatch(function() engine.rms_norm(engine.zeros(2, 3), 3, nil, "x") end, "eps must be a number")
  end)
end)
