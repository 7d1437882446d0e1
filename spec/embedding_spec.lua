-- embedding: row gather forward, scatter-add backward, padding_idx,
-- index dtypes and shapes, layouts and errors.  Ids are 0-based data.
local engine = require("engine")
local gc = require("spec.helpers.gradcheck")

local function errmatch(fn, pat)
  local ok, err = pcall(fn)
  assert.is_false(ok, "expected an error matching '" .. pat .. "'")
  assert.truthy(tostring(err):find(pat, 1, true), "error '" .. tostring(err) .. "' does not contain '" .. pat .. "'")
  return err
end

local function table5x3(dtype)
  return engine.tensor({ { 0, 1, 2 }, { 10, 11, 12 }, { 20, 21, 22 }, { 30, 31, 32 }, { 40, 41, 42 } }, dtype or "f32")
end

describe("embedding", function()
  it("gathers rows by 0-based id for i64 and i32 indices", function()
    local w = table5x3()
    for _, dt in ipairs({ "i64", "i32" }) do
      local y = engine.embedding(w, engine.tensor({ 4, 0, 2, 2 }, dt))
      assert.are.same({ 4, 3 }, y:shape())
      assert.are.same({ { 40, 41, 42 }, { 0, 1, 2 }, { 20, 21, 22 }, { 20, 21, 22 } }, y:totable())
    end
  end)

  it("keeps the index shape and appends the embedding dim", function()
    local w = table5x3("f64")
    local y = engine.embedding(w, engine.tensor({ { 1, 2, 3 }, { 0, 0, 4 } }))
    assert.are.same({ 2, 3, 3 }, y:shape())
    assert.are.same({ 30, 31, 32 }, y:select(1, 1):select(1, 3):tolist_flat())
    assert.are.equal("f64", y.dtype)
    local s = engine.embedding(w, engine.tensor(3))
    assert.are.same({ 3 }, s:shape())
    assert.are.same({ 30, 31, 32 }, s:tolist_flat())
    local e = engine.embedding(w, engine.zeros(0, 2, { dtype = "i64" }))
    assert.are.same({ 0, 2, 3 }, e:shape())
  end)

  it("scatter-adds output gradients into the rows (repeated ids accumulate)", function()
    local w = table5x3()
    w.requires_grad = true
    local y = engine.embedding(w, engine.tensor({ { 1, 3 }, { 1, 1 } }))
    assert.are.equal("EmbeddingBackward", y.grad_fn)
    local go = engine.tensor({ { { 1, 2, 3 }, { 4, 5, 6 } }, { { 0.5, 0.5, 0.5 }, { -1, 0, 1 } } })
    y:backward(go)
    assert.are.same({ { 0, 0, 0 }, { 0.5, 2.5, 4.5 }, { 0, 0, 0 }, { 4, 5, 6 }, { 0, 0, 0 } }, w.grad:totable())
  end)

  it("gives padding_idx rows no gradient (negative padding_idx counts from the end)", function()
    for _, pad in ipairs({ 1, -4 }) do
      local w = table5x3()
      w.requires_grad = true
      local y = engine.embedding(w, engine.tensor({ 1, 2, 1, 0 }), pad)
      assert.are.same({ 10, 11, 12 }, y:select(1, 1):tolist_flat()) -- the forward still reads the row
      y:sum():backward()
      assert.are.same({ { 1, 1, 1 }, { 0, 0, 0 }, { 1, 1, 1 }, { 0, 0, 0 }, { 0, 0, 0 } }, w.grad:totable())
    end
  end)

  it("big gathers and scatter-adds split over threads give the serial values, bit for bit", function()
    -- 2700 ids (many repeated) into a [50, 200] table: 2.1 MiB of f32 rows (the kernels split from 2 MiB), columns
    -- split in two ranges; padding_idx 7
    local N = 2700
    local ids = {}
    for i = 1, N do ids[i] = (i * 7 + (i % 13) * 3) % 50 end
    local idx = engine.tensor(ids, "i64")
    local prev = engine.get_num_threads()
    for _, dt in ipairs({ "f32", "f64" }) do
      engine.manual_seed(3)
      local w0 = engine.randn(50, 200):to(dt)
      local go = engine.randn(N, 200):to(dt)
      local runs = {}
      for _, nt in ipairs({ 1, 2 }) do
        engine.set_num_threads(nt)
        local w = w0:clone()
        w.requires_grad = true
        local y = engine.embedding(w, idx, 7)
        y:backward(go)
        runs[nt] = { y = y:tolist_flat(), g = w.grad:tolist_flat() }
      end
      engine.set_num_threads(prev)
      assert.are.same(runs[1].y, runs[2].y)
      assert.are.same(runs[1].g, runs[2].g)
      -- against sums written out in Lua (row k: the go rows of its ids, in order), to the dtype's rounding
      local W, G = w0:tolist_flat(), go:tolist_flat()
      for i = 1, N, 37 do
        for c = 1, 200, 13 do assert.are.equal(W[ids[i] * 200 + c], runs[2].y[(i - 1) * 200 + c]) end
      end
      local want = {}
      for k = 0, 49 do for c = 1, 200 do want[k * 200 + c] = 0 end end
      for i = 1, N do
        if ids[i] ~= 7 then
          for c = 1, 200 do want[ids[i] * 200 + c] = want[ids[i] * 200 + c] + G[(i - 1) * 200 + c] end
        end
      end
      local tol = dt == "f32" and 1e-4 or 1e-12
      for e = 1, #want do
        assert(math.abs(want[e] - runs[2].g[e]) <= tol * math.max(1, math.abs(want[e])),
          string.format("%s gradient element %d: want %.10g, got %.10g", dt, e, want[e], runs[2].g[e]))
      end
    end
  end)

  it("passes a float64 gradient check", function()
    engine.manual_seed(21)
    local w = engine.randn(6, 4, { dtype = "f64", requires_grad = true })
    local idx = engine.tensor({ { 5, 0, 2 }, { 2, 2, 3 } })
    assert.is_true(gc.check(function(w) return engine.embedding(w, idx) end, { w }))
    -- (padding_idx rows get a zero gradient by definition, so they are not
    -- finite-difference checked; see the padding_idx test)
    assert.is_true(gc.check(function(w) return engine.embedding(w, idx, 4) end, { w }))
  end)

  it("reads strided weights and keeps half-precision dtypes", function()
    local base = engine.randn(3, 5)
    local w = base:t() -- [5, 3], not contiguous
    local idx = engine.tensor({ 4, 1 })
    assert.are.same(engine.embedding(w:contiguous(), idx):tolist_flat(), engine.embedding(w, idx):tolist_flat())
    local wb = engine.randn(5, 3):bfloat16()
    wb.requires_grad = true
    local y = engine.embedding(wb, idx)
    assert.are.equal("bf16", y.dtype)
    y:sum():backward()
    assert.are.equal("bf16", wb.grad.dtype)
    assert.are.same({ 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1 }, wb.grad:tolist_flat())
  end)

  it("reports bad indices, shapes and dtypes", function()
    local w = table5x3()
    errmatch(function() engine.embedding(w, engine.tensor({ 0, 7, 1 })) end,
      "embedding: index 7 out of range for weight f32[5,3] (valid 0..4), at flat position 2 of indices i64[3]")
    errmatch(function() engine.embedding(w, engine.tensor({ -1 })) end, "index -1 out of range")
    errmatch(function() engine.embedding(w, engine.tensor({ 5 }, "i32")) end, "index 5 out of range")
    errmatch(function() engine.embedding(w, engine.tensor({ 1.0, 2.0 }, "f32")) end, "indices must be i32 or i64, got f32[2]")
    errmatch(function() engine.embedding(engine.zeros(5), engine.tensor({ 1 })) end, "weight must be 2-D")
    errmatch(function() engine.embedding(w, engine.tensor({ 1 }), 5) end, "padding_idx 5 out of range")
    errmatch(function() engine.embedding(w, engine.tensor({ 1 }), -6) end, "padding_idx -6 out of range")
    errmatch(function() engine.embedding(w, engine.tensor({ 1 }), 1.5) end, "padding_idx must be an integer")
    errmatch(function() engine.embedding(w, { 1, 2 }) end, "argument 2 must be a tensor")
  end)
end)
