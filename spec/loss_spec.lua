-- cross_entropy: PyTorch values (reductions, ignore_index, label smoothing,
-- [N, C, d...] and [C] forms), autograd, errors.
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local gc = require("spec.helpers.gradcheck")

local function close(t, expected, tol)
  if type(tol) ~= "number" then tol = nil end
  local got = engine.is_tensor(t) and t:tolist_flat() or t
  assert.are.equal(#expected, #got)
  for i = 1, #expected do
    local e, g = expected[i], got[i]
    local ok = (e == g) or math.abs(e - g) <= (tol or 1e-6) * math.max(1, math.abs(e))
    if not ok then error(string.format("element %d: expected %.8g, got %.8g", i, e, g), 2) end
  end
end

local ce = engine.cross_entropy
-- PyTorch 1.13 reference values below come from F.cross_entropy on these inputs.
local X = { { 1, 2, 3 }, { 1, 1, 1 }, { 0.5, -1, 2 } }

describe("cross_entropy", function()
  it("gives known values for each reduction (hand-computed)", function()
    local x = engine.tensor({ { 1, 2, 3 }, { 1, 1, 1 } }, "f32")
    local t = engine.tensor({ 0, 2 })
    -- lse(1,2,3) - 1 = 2.40760596, lse(1,1,1) - 1 = log 3
    close(ce(x, t, { reduction = "none" }), { 2.40760596, 1.09861229 })
    close(ce(x, t), { (2.40760596 + 1.09861229) / 2 })
    close(ce(x, t, { reduction = "sum" }), { 2.40760596 + 1.09861229 })
    assert.are.equal(0, ce(x, t):dim())
    assert.are.equal("f32", ce(x, t).dtype)
  end)

  it("matches PyTorch with label smoothing", function()
    local x = engine.tensor(X, "f64")
    local t = engine.tensor({ 0, 2, 1 })
    close(ce(x, t, { label_smoothing = 0.1, reduction = "none" }), { 2.307606, 1.098612, 3.091311 }, 1e-6)
    close(ce(x, t, { label_smoothing = 0.1 }), { 2.165843 }, 1e-6)
    close(ce(x, t, { label_smoothing = 0.1, reduction = "sum" }), { 6.49753 }, 1e-6)
  end)

  it("matches PyTorch with ignore_index and label smoothing (mean over kept targets)", function()
    local x = engine.tensor(X, "f64")
    local t = engine.tensor({ 0, -100, 1 })
    close(ce(x, t, { label_smoothing = 0.2, reduction = "none" }), { 2.207606, 0, 2.941311 }, 1e-6)
    close(ce(x, t, { label_smoothing = 0.2 }), { 2.574459 }, 1e-6)
    close(ce(x, t, { label_smoothing = 0.2, reduction = "sum" }), { 5.148917 }, 1e-6)
    local xg = engine.tensor(X, { dtype = "f64", requires_grad = true })
    ce(xg, t, { label_smoothing = 0.2 }):backward()
    close(xg.grad, { -0.388318, 0.0890309, 0.2992871, 0, 0, 0, 0.05431186, -0.413777, 0.3594652 }, 1e-5)
    -- a custom ignore_index
    close(ce(engine.tensor(X), engine.tensor({ 0, 7, 7 }), { ignore_index = 7, reduction = "sum" }),
      { 2.40760596 }, 1e-6)
  end)

  it("gives NaN for a mean over all-ignored targets (as PyTorch)", function()
    local v = ce(engine.tensor(X), engine.tensor({ -100, -100, -100 })):item()
    assert.is_true(v ~= v)
    assert.are.equal(0, ce(engine.tensor(X), engine.tensor({ -100, -100, -100 }), { reduction = "sum" }):item())
  end)

  it("takes [N, C, d...] logits with classes in dim 2", function()
    local vals = {}
    for i = 0, 11 do vals[#vals + 1] = i * 0.3 - 1 end
    local x = engine.tensor(vals, "f64"):view(2, 3, 2)
    local t = engine.tensor({ { 0, 2 }, { 1, 0 } })
    local none = ce(x, t, { reduction = "none" })
    assert.are.same({ 2, 2 }, none:shape())
    close(none, { 1.815189, 0.6151888, 1.215189, 1.815189 }, 1e-6)
    close(ce(x, t), { 1.365189 }, 1e-6)
    -- same as the [N*d, C] form
    local flat = x:permute(1, 3, 2):reshape(4, 3)
    close(ce(flat, t:view(4), { reduction = "none", label_smoothing = 0.3 }),
      ce(x, t, { reduction = "none", label_smoothing = 0.3 }):tolist_flat(), 1e-12)
  end)

  it("takes [C] logits with a 0-d target, and i32 targets", function()
    local l = ce(engine.tensor({ 1, 2, 3 }, "f32"), engine.tensor(2), { reduction = "none" })
    assert.are.equal(0, l:dim())
    close(l, { 0.40760596 })
    close(ce(engine.tensor(X), engine.tensor({ 0, 2, 1 }, "i32")), ce(engine.tensor(X), engine.tensor({ 0, 2, 1 })):tolist_flat())
  end)

  it("is stable for large logits and keeps bf16", function()
    close(ce(engine.tensor({ { 1000, 0 } }, "f32"), engine.tensor({ 1 })), { 1000 })
    local l = ce(engine.tensor(X, "bf16"), engine.tensor({ 0, 2, 1 }))
    assert.are.equal("bf16", l.dtype)
    close(l, ce(engine.tensor(X, "f64"), engine.tensor({ 0, 2, 1 })):tolist_flat(), 1e-2)
  end)

  it("splits big inputs across threads with the same results", function()
    local x = engine.randn(700, 256)
    local tv = {}
    for i = 1, 700 do tv[i] = i % 5 == 0 and -100 or (i * 37) % 256 end
    local t = engine.tensor(tv)
    local function run()
      local out = {}
      for _, red in ipairs({ "none", "mean" }) do
        local xi = x:clone(); xi.requires_grad = true
        local l = ce(xi, t, { reduction = red, label_smoothing = 0.1 })
        if red == "none" then l:sum():backward() else l:backward() end
        out[#out + 1] = l:tolist_flat()
        out[#out + 1] = xi.grad:tolist_flat()
      end
      return out
    end
    local prev = engine.get_num_threads()
    engine.set_num_threads(1)
    local one = run()
    engine.set_num_threads(2)
    local two = run()
    engine.set_num_threads(prev)
    for i = 1, #one do assert.are.same(one[i], two[i]) end
    close(ce(x, t), ce(x:double(), t):tolist_flat(), 1e-5)
  end)

  it("has gradient (softmax - onehot) / N for the mean", function()
    local x = engine.tensor({ { 1, 2, 3 }, { 1, 1, 1 } }, { dtype = "f64", requires_grad = true })
    ce(x, engine.tensor({ 0, 2 })):backward()
    local p = x:detach():softmax(2):tolist_flat()
    close(x.grad, { (p[1] - 1) / 2, p[2] / 2, p[3] / 2, p[4] / 2, p[5] / 2, (p[6] - 1) / 2 }, 1e-12)
  end)

  describe("gradients (f64 finite differences)", function()
    local function mk(shape, seed)
      local n = 1
      for _, s in ipairs(shape) do n = n * s end
      local v = {}
      for i = 1, n do v[i] = math.sin(i * 1.3 + seed) * 2 end
      local t = engine.tensor(v, "f64"):view(shape):clone()
      t.requires_grad = true
      return t
    end
    local target = engine.tensor({ 1, 0, 3, 2, -100 })
    for _, red in ipairs({ "none", "mean", "sum" }) do
      for _, ls in ipairs({ 0, 0.25 }) do
        it(string.format("reduction %s, label_smoothing %g, with an ignored target", red, ls), function()
          assert.is_true(gc.check(function(x)
            return ce(x, target, { reduction = red, label_smoothing = ls })
          end, { mk({ 5, 4 }, 1) }))
        end)
      end
      it("[N, C, d1, d2] logits, reduction " .. red, function()
        local t = engine.tensor({ { { 0, 2 }, { 1, 1 } }, { { 2, -100 }, { 0, 1 } } })
        assert.is_true(gc.check(function(x)
          return ce(x, t, { reduction = red, label_smoothing = 0.1 })
        end, { mk({ 2, 3, 2, 2 }, 2) }))
      end)
    end
    it("[C] logits", function()
      assert.is_true(gc.check(function(x) return ce(x, engine.tensor(1), { label_smoothing = 0.5 }) end,
        { mk({ 4 }, 3) }))
    end)
    it("through a non-contiguous input", function()
      assert.is_true(gc.check(function(x) return ce(x:t(), engine.tensor({ 0, 3, 1 })) end, { mk({ 4, 3 }, 4) }))
    end)
  end)

  describe("errors", function()
    local x = engine.zeros(3, 4)
    it("rejects targets out of range that are not ignore_index", function()
      local ok, err = pcall(function() return ce(x, engine.tensor({ 0, 4, 1 })) end)
      assert.is_false(ok)
      assert.matches("cross_entropy: target 4 at flat position 2 is out of range for 4 classes", err)
      assert.matches("loss_spec.lua", err)
      assert.has_error(function() ce(x, engine.tensor({ 0, -1, 1 })) end)
      assert.has_error(function() ce(x, engine.tensor({ 0, -100, 1 }), { ignore_index = -1 }) end)
    end)

    it("rejects mismatched target shapes and non-index targets", function()
      local ok, err = pcall(function() return ce(x, engine.tensor({ 0, 1 })) end)
      assert.is_false(ok)
      assert.matches("cross_entropy: target i64%[2%] does not match logits f32%[3,4%] %(expected target shape %[3%]", err)
      assert.has_error(function() ce(x, engine.zeros(3)) end)
      assert.has_error(function() ce(engine.tensor({ { 1, 2 } }), engine.tensor({ 0 })) end)
      assert.has_error(function() ce(x, { 0, 1, 2 }) end, "cross_entropy: argument 2 must be a tensor, got table")
    end)

    it("rejects bad options", function()
      local t = engine.tensor({ 0, 1, 2 })
      assert.has_error(function() ce(x, t, { reduction = "avg" }) end,
        'cross_entropy: reduction must be "none", "mean" or "sum", got avg')
      assert.has_error(function() ce(x, t, { label_smoothing = 1.5 }) end,
        "cross_entropy: label_smoothing must be between 0.0 and 1.0, got 1.5")
      assert.has_error(function() ce(x, t, { reduce = "sum" }) end,
        "cross_entropy: unknown option 'reduce' (valid: ignore_index, label_smoothing, reduction, weight)")
      assert.has_error(function() ce(x, t, { ignore_index = 0.5 }) end)
      assert.has_error(function() ce(x, t, "mean") end)
    end)
  end)
end)
