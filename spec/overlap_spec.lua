-- In-place writes whose destination overlaps itself or its source: PyTorch's checks
-- (has_internal_overlap / assert_no_internal_overlap, get_overlap_status / assert_no_partial_overlap).  An
-- expanded destination (a stride of 0 over a dim of size > 1) is refused by copy_, the in-place arithmetic,
-- clamp_, addcmul_/addcdiv_/lerp_ and the random fills; fill_/zero_ take it (one value: idempotent, PyTorch's
-- fill has no overlap check).  A dense source sharing some elements of a dense destination is refused; the same
-- elements are a no-op; a source over the destination's memory in another way (strided, broadcast) is read
-- from a copy, so the result is the one of a clone (memmove semantics), whatever the size and the threads.
-- The sanitizer stage runs this file (the overlapping copy_ was an ASan memcpy-param-overlap).
local engine = require("engine")

local INTERNAL = "unsupported operation: more than one element of the written-to tensor refers to a single " ..
  "memory location. Please clone() the tensor before performing the operation."
local PARTIAL = "unsupported operation: some elements of the input tensor and the written-to tensor refer to a " ..
  "single memory location. Please clone() the tensor before performing the operation."

local err_of, has = require("spec.helpers.errors").err_of, require("spec.helpers.errors").has
local function same(a, b) return a:shape()[1] == b:shape()[1] and (a:double() - b:double()):abs():max():item() == 0 end

describe("an expanded destination (internal overlap)", function()
  it("copy_, add_/sub_/mul_/div_ (tensor and number), clamp_, addcmul_, addcdiv_, lerp_ raise PyTorch's error", function()
    local cases = {
      copy_ = function(z) z:copy_(engine.ones(4)) end,
      add_ = function(z) z:add_(1) end,
      add_t = function(z) z:add_(engine.ones(4)) end,
      sub_ = function(z) z:sub_(engine.ones(4)) end,
      mul_ = function(z) z:mul_(2) end,
      div_ = function(z) z:div_(engine.full({ 4 }, 2)) end,
      clamp_ = function(z) z:clamp_(0, 1) end,
      addcmul_ = function(z) z:addcmul_(engine.ones(4), engine.ones(4), 1) end,
      addcdiv_ = function(z) z:addcdiv_(engine.ones(4), engine.ones(4), 1) end,
      lerp_ = function(z) z:lerp_(engine.ones(4), 0.5) end,
    }
    for name, f in pairs(cases) do
      local base = engine.zeros(1)
      local z = base:expand(4)
      local op = name == "add_t" and "add_" or name
      has(err_of(f, z), op .. ": " .. INTERNAL, "f32[4]")
      assert.equal(0, base:item(), name .. " wrote before raising")
    end
  end)

  it("the issue's case: zeros(1):expand(4):add_(1) (once 4 at one thread, 2 or 3 at several)", function()
    local z = engine.zeros(1)
    has(err_of(function() z:expand(4):add_(1) end), "add_: " .. INTERNAL)
    -- a 2-D expand over a large row, which took the threaded kernel
    local row = engine.zeros(1, 4096)
    has(err_of(function() row:expand(64, 4096):add_(1) end), INTERNAL)
    assert.equal(0, row:abs():sum():item())
  end)

  it("uniform_ and normal_ refuse it (one draw per element)", function()
    has(err_of(function() engine.zeros(1):expand(3):normal_() end), "normal_: " .. INTERNAL)
    has(err_of(function() engine.zeros(1):expand(3):uniform_() end), "uniform_: " .. INTERNAL)
  end)

  it("fill_ and zero_ take it, as PyTorch's fill (writing one value is idempotent)", function()
    local base = engine.zeros(1)
    base:expand(4):fill_(3)
    assert.equal(3, base:item())
    base:expand(2, 4):zero_()
    assert.equal(0, base:item())
  end)

  it("a size-1 dim of stride 0 is no overlap; nor is an expand of a one-element view into one element", function()
    local base = engine.zeros(3)
    base:view(3, 1):expand(3, 1):add_(1)       -- expand to the same shape: stride kept
    local v = base:narrow(1, 2, 1):expand(1)    -- one element
    v:add_(1)
    assert.same({ 1, 2, 1 }, base:totable())
  end)
end)

describe("a source overlapping the destination (partial overlap)", function()
  it("x:narrow(...):copy_(an overlapping narrow of x) raises; x is unchanged", function()
    local x = engine.arange(1, 11, { dtype = "f32" })
    has(err_of(function() x:narrow(1, 1, 6):copy_(x:narrow(1, 3, 6)) end), "copy_: " .. PARTIAL,
      "the input f32[6] from element 2 and the written-to f32[6] from element 0")
    has(err_of(function() x:narrow(1, 3, 6):copy_(x:narrow(1, 1, 6)) end), "copy_: " .. PARTIAL)
    assert.same({ 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 }, x:totable())
    -- large and threaded: the same refusal
    local big = engine.arange(2 ^ 20, { dtype = "f32" })
    has(err_of(function() big:narrow(1, 1, 1000000):copy_(big:narrow(1, 7, 1000000)) end), PARTIAL)
  end)

  it("the in-place arithmetic raises too (m:add_(m:t()), a row of m, addcmul_ with an overlapping operand)", function()
    local m = engine.arange(1, 10, { dtype = "f32" }):view(3, 3)
    has(err_of(function() m:add_(m:t()) end), "add_: " .. PARTIAL)
    has(err_of(function() m:mul_(m:narrow(1, 1, 1)) end), "mul_: " .. PARTIAL)
    has(err_of(function() m:copy_(m:t()) end), "copy_: " .. PARTIAL)
    local z = engine.arange(8, { dtype = "f32" })
    has(err_of(function() z:narrow(1, 1, 4):addcmul_(z:narrow(1, 2, 4), engine.ones(4), 1) end), "addcmul_: " .. PARTIAL)
    assert.same({ 1, 2, 3, 4, 5, 6, 7, 8, 9 }, m:view(9):totable())
  end)

  it("the same elements are no overlap: x:copy_(x), x:add_(x), a view with x's layout", function()
    local x = engine.arange(1, 5, { dtype = "f32" })
    x:copy_(x)
    x:copy_(x:view(2, 2):view(4))
    x:add_(x)
    x:mul_(x:view(4))
    assert.same({ 4, 16, 36, 64 }, x:totable())
  end)

  it("disjoint views of one storage copy directly", function()
    local x = engine.arange(1, 11, { dtype = "f32" })
    x:narrow(1, 1, 5):copy_(x:narrow(1, 6, 5))
    assert.same({ 6, 7, 8, 9, 10, 6, 7, 8, 9, 10 }, x:totable())
  end)

  it("a strided or broadcast source over the destination is read as a copy (memmove semantics)", function()
    -- x[1..5] <- x[1], x[3], x[5], x[7], x[9]: the source is not dense, so PyTorch lets it through
    local x = engine.arange(1, 11, { dtype = "f32" })
    x:narrow(1, 1, 5):copy_(x:view(5, 2):select(2, 1))
    assert.same({ 1, 3, 5, 7, 9, 6, 7, 8, 9, 10 }, x:totable())
    -- large, threaded: each result equals the one computed from a clone of the source
    for _, n in ipairs({ 64, 2 ^ 16, 2 ^ 20 }) do
      local a = engine.randn(2 * n)
      local want = a:clone()
      want:narrow(1, 1, n):copy_(a:clone():view(n, 2):select(2, 2))
      a:narrow(1, 1, n):copy_(a:view(n, 2):select(2, 2))
      assert.is_true(same(a, want), "copy_ at n = " .. n)
      local b = engine.randn(2 * n)
      local want_b = b:clone()
      want_b:narrow(1, 1, n):add_(b:clone():view(n, 2):select(2, 2), 2)
      b:narrow(1, 1, n):add_(b:view(n, 2):select(2, 2), 2)
      assert.is_true(same(b, want_b), "add_ at n = " .. n)
      local c = engine.randn(2 * n)
      local want_c = c:clone()
      want_c:narrow(1, 1, n):lerp_(c:clone():view(n, 2):select(2, 2), 0.25)
      c:narrow(1, 1, n):lerp_(c:view(n, 2):select(2, 2), 0.25)
      assert.is_true(same(c, want_c), "lerp_ at n = " .. n)
    end
    -- a broadcast row of m into m (not dense: stride 0): m[i] += m[1] for every row, the old m[1]
    local m = engine.arange(1, 7, { dtype = "f32" }):view(2, 3)
    m:add_(m:narrow(1, 1, 1):expand(2, 3))
    assert.same({ { 2, 4, 6 }, { 5, 7, 9 } }, m:totable())
  end)
end)
