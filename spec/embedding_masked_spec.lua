-- embedding_masked (the local op of a row-sharded embedding): a shard owning
-- rows [off, off + rows) of the table gives the full embedding's rows for
-- owned indices and zero rows elsewhere; the outputs of the shards add up to
-- the full embedding; the gradient reaches only owned rows and equals the
-- matching rows (narrow) of the full embedding's weight gradient; float64
-- finite differences.
local engine = require("engine")
local gc = require("spec.helpers.gradcheck")

local function errmatch(fn, pat)
  local ok, err = pcall(fn)
  assert.is_false(ok, "expected an error matching '" .. pat .. "'")
  assert.truthy(tostring(err):find(pat, 1, true), "error '" .. tostring(err) .. "' does not contain '" .. pat .. "'")
  return err
end
local function diff(a, b)
  local sa, sb = a:shape(), b:shape()
  if #sa ~= #sb then return math.huge end
  for i = 1, #sa do if sa[i] ~= sb[i] then return math.huge end end
  if a:numel() == 0 then return 0 end
  return (a:double() - b:double()):abs():max():item()
end

local IDX = { { 0, 3, 9, 4 }, { 5, 5, 2, 8 } }

-- The full embedding with rows outside [off, off + rows) zeroed (built in Lua).
local function expected(full_out, off, rows)
  local t = full_out:double():totable()
  for i, row in ipairs(IDX) do
    for j, k in ipairs(row) do
      if k < off or k >= off + rows then
        for c = 1, #t[i][j] do t[i][j][c] = 0 end
      end
    end
  end
  return engine.tensor(t, "f64")
end

local function splits(n, k)
  local r, chunk, off = {}, math.ceil(n / k), 0
  for _ = 1, k do
    local rows = math.max(0, math.min(chunk, n - off))
    r[#r + 1] = { off, rows }
    off = off + rows
  end
  return r
end

describe("embedding_masked", function()
  for _, dt in ipairs({ "i64", "i32" }) do
    it("equals the full embedding on owned rows and zero elsewhere (" .. dt .. " indices)", function()
      engine.manual_seed(7)
      local W = engine.randn({ 10, 3 }, { dtype = "f64" })
      local idx = engine.tensor(IDX, dt)
      local full = engine.embedding(W, idx)
      for _, k in ipairs({ 1, 2, 3, 4, 11 }) do
        local sum = engine.zeros({ 2, 4, 3 }, { dtype = "f64" })
        for _, s in ipairs(splits(10, k)) do
          local off, rows = s[1], s[2]
          local y = engine.embedding_masked(W:narrow(1, off + 1, rows):clone(), idx, off)
          assert.are.same({ 2, 4, 3 }, y:shape())
          assert.are.equal(0, diff(y, expected(full, off, rows)))
          sum = sum + y
        end
        assert.are.equal(0, diff(sum, full))
      end
    end)
  end

  it("the shard's gradient is the matching rows of the full weight gradient", function()
    engine.manual_seed(8)
    local W = engine.randn({ 10, 3 }, { dtype = "f64" })
    local g = engine.randn({ 2, 4, 3 }, { dtype = "f64" })
    local idx = engine.tensor(IDX)
    local Wf = W:clone(); Wf.requires_grad = true
    ;(engine.embedding(Wf, idx) * g):sum():backward()
    for _, s in ipairs(splits(10, 3)) do
      local off, rows = s[1], s[2]
      local shard = W:narrow(1, off + 1, rows):clone()
      shard.requires_grad = true
      ;(engine.embedding_masked(shard, idx, off) * g):sum():backward()
      assert.are.equal(0, diff(shard.grad, Wf.grad:narrow(1, off + 1, rows)))
    end
    -- a shard that owns none of the indices gets a zero gradient
    local far = W:narrow(1, 1, 2):clone()
    far.requires_grad = true
    ;(engine.embedding_masked(far, idx, 20) * g):sum():backward()
    assert.are.equal(0, far.grad:abs():max():item())
  end)

  it("passes float64 finite differences (repeated indices accumulate)", function()
    engine.manual_seed(9)
    local shard = engine.randn({ 4, 3 }, { dtype = "f64" })
    shard.requires_grad = true
    local idx = engine.tensor(IDX)
    assert.is_true(gc.check(function(w) return engine.embedding_masked(w, idx, 3) end, { shard }))
  end)

  it("works for bf16 and f32 weights", function()
    local W = engine.randn({ 6, 2 })
    for _, dt in ipairs({ "f32", "bf16" }) do
      local w = W:to(dt)
      local y = engine.embedding_masked(w:narrow(1, 3, 2):clone(), engine.tensor({ 1, 2, 3, 5 }), 2)
      assert.are.equal(dt, y.dtype)
      local full = engine.embedding(w, engine.tensor({ 1, 2, 3, 5 }))
      local want = full:double():totable()
      want[1] = { 0, 0 }; want[4] = { 0, 0 }
      assert.are.equal(0, diff(y, engine.tensor(want, "f64")))
    end
  end)

  it("rejects bad arguments with clear errors", function()
    local w = engine.randn({ 4, 3 })
    errmatch(function() engine.embedding_masked(w, engine.tensor({ 1, -1 }), 0) end,
      "embedding_masked: index -1 at flat position 2")
    errmatch(function() engine.embedding_masked(engine.randn({ 4 }), engine.tensor({ 1 }), 0) end,
      "embedding_masked: weight shard must be 2-D")
    errmatch(function() engine.embedding_masked(w, engine.tensor({ 1.5 }), 0) end,
      "embedding_masked: indices must be i32 or i64")
    errmatch(function() engine.embedding_masked(w, engine.tensor({ 1 }), -2) end,
      "embedding_masked: row_offset -2 must be >= 0")
    errmatch(function() engine.embedding_masked(w, engine.tensor({ 1 }), 0.5) end,
      "embedding_masked: row_offset must be an integer")
  end)
end)
