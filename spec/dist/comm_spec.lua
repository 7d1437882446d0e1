-- Process groups and collectives, run under mpirun with 1, 2 and 4 ranks
-- (tools/run-tests.sh) and in the single-process run (world size 1).
-- Every rank issues the same collectives in the same order; assertions come
-- after the collectives, so a failing rank cannot leave the others waiting.
local engine = require("engine")
local dist = engine.distributed
local ffi, C = engine.ffi, engine.C

local R, W = dist.rank(), dist.world_size()

local DTYPES = { "f32", "f64", "bf16", "f16", "i32", "i64", "u8", "bool" }
local FLOAT = { f32 = true, f64 = true, bf16 = true, f16 = true }
local OPS = { "sum", "avg", "max", "min", "prod" }

local function flat(t) return (t:tolist_flat()) end
local function mk(list, dt, shape)
  local t = engine.tensor(list, dt)
  if shape then t = t:view(shape) end
  return t
end
local function range(n) local r = {} for i = 1, n do r[i] = i - 1 end return r end

-- Values rank r contributes (exact in every dtype, results too).
local function vals(dt, r)
  if dt == "bool" then return { 1, r == 0 and 1 or 0, 0, r >= 1 and 1 or 0 } end
  if dt == "u8" then return { (r + 1), (r + 1) * 2, (r + 1), (r + 1) * 3 } end
  if FLOAT[dt] then return { (r + 1), (r + 1) * -2, (r + 1) * 3, (r + 1) * 0.5 } end
  return { (r + 1), (r + 1) * -2, (r + 1) * 3, (r + 1) * 5 }
end

local function fold(op, xs, dt)
  local acc
  if op == "sum" or op == "avg" then
    acc = 0
    for _, x in ipairs(xs) do acc = acc + x end
    if op == "avg" then acc = acc / #xs end
  elseif op == "max" then acc = math.max(unpack(xs))
  elseif op == "min" then acc = math.min(unpack(xs))
  else
    acc = 1
    for _, x in ipairs(xs) do acc = acc * x end
  end
  if dt == "u8" then acc = acc % 256 end
  if dt == "bool" then acc = acc ~= 0 and 1 or 0 end
  return acc
end

-- expected[i] = fold over ranks of f(r)[i]
local function expect(op, dt, f, ranks)
  ranks = ranks or range(W)
  local n = #f(ranks[1])
  local out = {}
  for i = 1, n do
    local xs = {}
    for _, r in ipairs(ranks) do xs[#xs + 1] = f(r)[i] end
    out[i] = fold(op, xs, dt)
  end
  return out
end

-- bf16/f16 values whose sum goes wrong when added pairwise in the 16-bit type
-- (any order), but is exact when summed in f32 and rounded once.
local TRICKY = {
  bf16 = { [1] = { 1.0078125 }, [2] = { 1.0078125, 5.0 }, [3] = { 0.01171875, 1.0078125, 5.0 },
    [4] = { -1.0078125, 0.10009765625, 5.0, 5.0 } },
  f16 = { [1] = { 1.0009765625 }, [2] = { 1.0009765625, 5.0 }, [3] = { -1.0009765625, -1.0, 0.0999755859375 },
    [4] = { -1.0009765625, 3.30078125, 3.30078125, 3.30078125 } },
}
local TRICKY_SUM = {
  bf16 = { [1] = 1.0078125, [2] = 6.0, [3] = 6.03125, [4] = 9.0625 },
  f16 = { [1] = 1.0009765625, [2] = 6.0, [3] = -1.9013671875, [4] = 8.8984375 },
}
-- what the pairwise 16-bit sum in rank order gives (to show the values matter)
local PAIRWISE = { bf16 = { [3] = 6.0, [4] = 9.125 }, f16 = { [3] = -1.900390625, [4] = 8.90625 } }

describe("dist runtime", function()
  it("init is idempotent; rank and world size match the world group", function()
    assert.equal(dist, dist.init())
    dist.init()
    assert.is_true(dist.is_initialized())
    local g = dist.world_group()
    assert.equal(W, g:size())
    assert.equal(R, g:rank())
    assert.same(range(W), g:ranks())
    assert.is_true(g:is_member())
    assert.equal("world", g:name())
    assert.equal(0, g:id())
    assert.equal(R, dist.get_rank())
    assert.equal(W, dist.get_world_size(g))
    assert.matches("ProcessGroup%(world, size=" .. W, tostring(g))
  end)

  it("merges integer counts over all ranks", function()
    local r = dist.allreduce_counts({ 1, R, 0 })
    assert.same({ W, W * (W - 1) / 2, 0 }, r)
  end)
end)

describe("all_reduce", function()
  for _, dt in ipairs(DTYPES) do
    for _, op in ipairs(OPS) do
      if op == "avg" and not FLOAT[dt] then
        it(string.format("%s avg is an error naming the dtype", dt), function()
          local t = mk(vals(dt, R), dt)
          assert.has_error(function() dist.all_reduce(t, "avg") end,
            "all_reduce: op avg needs a floating dtype, got " .. dt .. "[4]")
        end)
      else
        it(string.format("%s %s", dt, op), function()
          local t = mk(vals(dt, R), dt)
          local r = dist.all_reduce(t, op)
          assert.equal(t, r)
          assert.same(expect(op, dt, function(q) return vals(dt, q) end), flat(t))
        end)
      end
    end
  end

  for _, dt in ipairs({ "bf16", "f16" }) do
    it(dt .. " sums are computed in f32 and rounded once (values that go wrong when added in " .. dt .. ")", function()
      local v = TRICKY[dt][W]
      if not v then pending("no tricky values for world size " .. W) end
      local t = mk({ v[R + 1], v[R + 1] }, dt)
      dist.all_reduce(t, "sum")
      assert.same({ TRICKY_SUM[dt][W], TRICKY_SUM[dt][W] }, flat(t))
      if PAIRWISE[dt][W] then
        -- the same values added pairwise in the 16-bit type give another answer
        local acc = mk({ v[1] }, dt)
        for i = 2, W do acc = acc + mk({ v[i] }, dt) end
        assert.equal(PAIRWISE[dt][W], flat(acc)[1])
        assert.not_equal(TRICKY_SUM[dt][W], PAIRWISE[dt][W])
      end
    end)
  end

  it("bf16 avg divides in f32 before rounding", function()
    local t = mk({ 1 + R, 3 * (R + 1) }, "bf16")
    dist.all_reduce(t, "avg")
    local s = W * (W + 1) / 2
    assert.same({ s / W, 3 * s / W }, flat(t))
  end)

  it("reduces non-contiguous tensors in place (f32 and bf16)", function()
    for _, dt in ipairs({ "f32", "bf16", "i64" }) do
      local base = mk({ 1, 2, 3, 4, 5, 6 }, dt, { 2, 3 }) * (R + 1)
      local v = base:transpose(1, 2)
      assert.is_false(v:is_contiguous())
      dist.all_reduce(v, "sum")
      local s = W * (W + 1) / 2
      assert.same({ s, 2 * s, 3 * s, 4 * s, 5 * s, 6 * s }, flat(base))
      assert.same({ s, 4 * s, 2 * s, 5 * s, 3 * s, 6 * s }, flat(v))
    end
  end)

  it("out of place (eng_pg_all_reduce_into): the input stays, contiguous or not, sync or async", function()
    local pg = dist.world_group()._c
    local s = W * (W + 1) / 2
    for _, dt in ipairs({ "f32", "bf16", "i64" }) do
      local x = mk({ 1, 2, 3, 4, 5, 6 }, dt, { 2, 3 }) * (R + 1)
      local out = engine.zeros({ 2, 3 }, { dtype = dt })
      assert.equal(0, C.eng_pg_all_reduce_into(pg, out._c, x._c, 0, nil))
      assert.same({ s, 2 * s, 3 * s, 4 * s, 5 * s, 6 * s }, flat(out))
      assert.same({ R + 1, 2 * (R + 1), 3 * (R + 1), 4 * (R + 1), 5 * (R + 1), 6 * (R + 1) }, flat(x))
      -- non-contiguous input and output, avg
      local xt, o2 = x:t(), engine.zeros({ 2, 3 }, { dtype = dt }):t()
      if dt ~= "i64" then
        assert.equal(0, C.eng_pg_all_reduce_into(pg, o2._c, xt._c, 1, nil))
        assert.same({ s / W, 4 * s / W, 2 * s / W, 5 * s / W, 3 * s / W, 6 * s / W }, flat(o2))
      end
      -- async: the result is there after the wait
      local w = ffi.new("eng_work*[1]")
      local o3 = engine.zeros({ 2, 3 }, { dtype = dt })
      assert.equal(0, C.eng_pg_all_reduce_into(pg, o3._c, x._c, 2, w))
      assert.equal(0, C.eng_work_wait(w[0]))
      C.eng_work_release(w[0])
      assert.same({ W, 2 * W, 3 * W, 4 * W, 5 * W, 6 * W }, flat(o3))
    end
    -- out == in is the in-place call; a mismatched or overlapping output is an error on every rank
    local y = engine.ones(4)
    assert.equal(0, C.eng_pg_all_reduce_into(pg, y._c, y._c, 0, nil))
    assert.same({ W, W, W, W }, flat(y))
    assert.equal(-1, C.eng_pg_all_reduce_into(pg, engine.zeros(3)._c, y._c, 0, nil))
    assert.truthy(ffi.string(C.eng_last_error()):match("all_reduce_into: output f32%[3%] does not match input f32%[4%]"))
    local z = engine.ones(6)
    assert.equal(-1, C.eng_pg_all_reduce_into(pg, z:narrow(1, 1, 4)._c, z:narrow(1, 3, 4)._c, 0, nil))
    assert.truthy(ffi.string(C.eng_last_error()):match("share memory"))
  end)

  it("handles 0-d and empty tensors", function()
    local s = engine.tensor(R + 1.0)
    dist.all_reduce(s, "max")
    assert.equal(W, s:item())
    local e = engine.zeros(0, 3)
    dist.all_reduce(e)
    assert.same({ 0, 3 }, e:shape())
  end)

  it("defaults to sum and accepts the options table in place of the op", function()
    local t = engine.ones(3)
    dist.all_reduce(t, { group = dist.world_group() })
    assert.same({ W, W, W }, flat(t))
    dist.all_reduce(t, dist.ReduceOp.MAX)
    assert.same({ W, W, W }, flat(t))
  end)

  it("async: returns a handle; wait gives the tensor; several in flight", function()
    local a, b, c = engine.ones(4) * (R + 1), mk({ R, R }, "bf16"), mk({ R + 1 }, "i64", nil)
    local wa = dist.all_reduce(a, "sum", { async = true })
    local wb = dist.all_reduce(b, "max", { async = true })
    local wc = dist.all_reduce(c, "prod", { async = true })
    assert.equal(dist.Work, getmetatable(wa))
    assert.equal(c, wc:wait())
    assert.equal(b, wb:wait())
    assert.equal(a, wa:wait())
    assert.is_true(wa:is_completed())
    assert.equal(a, wa:wait()) -- idempotent
    local s, fact = W * (W + 1) / 2, 1
    for i = 1, W do fact = fact * i end
    assert.same({ s, s, s, s }, flat(a))
    assert.same({ W - 1, W - 1 }, flat(b))
    assert.same({ fact }, flat(c))
  end)

  -- avg multiplies by the reciprocal of a power-of-two group size (exact) and divides otherwise; large buffers take
  -- other MPI algorithms than small ones (Open MPI's nonblocking all_reduce is set to reduce-scatter + all-gather)
  it("avg is the sum divided by the group size, bit for bit, blocking and async, f32 and f64, large buffers", function()
    local groups = { dist.world_group() }
    if W >= 4 then groups[2] = dist.new_group({ 0, 1, 2 }) end -- 3 ranks: a divisor that is no power of two
    for gi, g in ipairs(groups) do
      local gw = gi == 1 and W or 3
      local member = gi == 1 or R <= 2
      for _, dt in ipairs({ "f32", "f64" }) do
        for _, n in ipairs({ 5, 100003 }) do
          engine.manual_seed(1000 + R)
          local x = engine.randn(n, { dtype = dt })
          local s, a, b = x:clone(), x:clone(), x:clone()
          if member then
            dist.all_reduce(s, "sum", { group = g })
            dist.all_reduce(a, "avg", { group = g })
            dist.all_reduce(b, "avg", { group = g, async = true }):wait()
          end
          if member then
            -- the quotient of each f32/f64 sum, rounded once to the dtype (a double quotient rounded to f32 is the
            -- correctly rounded f32 quotient: 53 >= 2 * 24 + 2 bits)
            local sl = flat(s)
            for i = 1, #sl do sl[i] = sl[i] / gw end
            local want = flat(mk(sl, dt))
            local al, bl = flat(a), flat(b)
            local bad, worst = 0, 0
            for i = 1, #want do
              if al[i] ~= want[i] then bad = bad + 1 end
              worst = math.max(worst, math.abs(bl[i] - want[i])) -- inputs are N(0, 1): an absolute bound
            end
            assert.equal(0, bad, string.format("%s n=%d group of %d: blocking avg differs in %d elements", dt, n, gw,
              bad))
            -- the nonblocking algorithm may add in another order on more than 2 ranks: equal within rounding there
            if gw <= 2 then assert.same(want, bl) end
            assert.is_true(worst < 1e-5, string.format("%s n=%d group of %d: async avg off by %g", dt, n, gw, worst))
          end
        end
      end
    end
  end)

  -- the nonblocking algorithm the engine sets (reduce-scatter + all-gather) falls back to a ring for fewer elements
  -- than ranks: every count from 1 up gives the blocking call's values
  it("async equals blocking for 1 to 40 elements, every dtype family and op", function()
    local bad = {}
    for _, dt in ipairs({ "f32", "f64", "i64", "bf16" }) do
      for n = 1, 40 do
        for _, op in ipairs({ "sum", "max", "prod" }) do
          local l = {}
          for i = 1, n do l[i] = (R + 1) * ((i % 3) + 1) end
          local a, b = mk(l, dt), mk(l, dt)
          dist.all_reduce(a, op)
          dist.all_reduce(b, op, { async = true }):wait()
          local la, lb = flat(a), flat(b)
          for i = 1, n do
            if la[i] ~= lb[i] then bad[#bad + 1] = string.format("%s n=%d %s [%d]: %s vs %s", dt, n, op, i, la[i], lb[i]) end
          end
        end
      end
    end
    assert.are.same({}, bad)
  end)

  it("async on a non-contiguous bf16 tensor finishes the copy-back on wait", function()
    local base = mk({ 1, 2, 3, 4 }, "bf16", { 2, 2 })
    local w = dist.all_reduce(base:t(), "sum", { async = true })
    local v = w:wait()
    assert.same({ W, 3 * W, 2 * W, 4 * W }, flat(v))
    assert.same({ W, 2 * W, 3 * W, 4 * W }, flat(base))
  end)

  it("an unfinished handle that is dropped is waited for", function()
    local t = engine.ones(8)
    do dist.all_reduce(t, "sum", { async = true }) end
    collectgarbage(); collectgarbage()
    dist.barrier()
    assert.same({ W, W, W, W, W, W, W, W }, flat(t))
  end)

  it("argument errors are clear", function()
    assert.has_error(function() dist.all_reduce(engine.ones(2), "mean2") end,
      "all_reduce: reduce op: unknown op 'mean2' (expected sum, avg, max, min or prod)")
    assert.has_error(function() dist.all_reduce(engine.ones(2), 3) end)
    assert.has_error(function() dist.all_reduce({}, "sum") end, "all_reduce: argument 1 must be a tensor, got table")
    assert.has_error(function() dist.all_reduce(engine.ones(2), "sum", 5) end)
    assert.has_error(function() dist.all_reduce(engine.ones(2), "sum", { group = 3 }) end,
      "all_reduce: opts.group must be a ProcessGroup or a DeviceMesh, got number")
    local ok, err = pcall(function() dist.all_reduce(engine.ones(2), "bogus") end)
    assert.is_false(ok)
    assert.matches("comm_spec.lua:%d+: all_reduce", err) -- points at the caller's line
  end)
end)

describe("all_gather", function()
  for _, dt in ipairs(DTYPES) do
    it(dt .. ": concatenates along dim 1 in rank order", function()
      local v = dt == "bool" and (R % 2 == 0 and 1 or 0) or (R + 1)
      local t = engine.full({ 2, 3 }, v, { dtype = dt })
      local g = dist.all_gather(t)
      assert.same({ 2 * W, 3 }, g:shape())
      assert.equal(dt, g.dtype)
      local want = {}
      for r = 0, W - 1 do
        local x = dt == "bool" and (r % 2 == 0 and 1 or 0) or (r + 1)
        for _ = 1, 6 do want[#want + 1] = x end
      end
      assert.same(want, flat(g))
    end)
  end

  it("gathers 0-d tensors into a 1-d tensor", function()
    local g = dist.all_gather(engine.tensor(R * 1.5, "f32"))
    assert.same({ W }, g:shape())
    local want = {}
    for r = 0, W - 1 do want[r + 1] = r * 1.5 end
    assert.same(want, flat(g))
  end)

  it("stages non-contiguous inputs and outputs", function()
    local base = mk({ 1, 2, 3, 4, 5, 6 }, "f64", { 2, 3 }) + 10 * R
    local g = dist.all_gather(base:t()) -- [3*W, 2]
    local want = {}
    for r = 0, W - 1 do
      for _, x in ipairs({ 1, 4, 2, 5, 3, 6 }) do want[#want + 1] = x + 10 * r end
    end
    assert.same(want, flat(g))
    -- non-contiguous output
    local out_base = engine.zeros(2, 3 * W, { dtype = "f64" })
    local out = out_base:t()
    dist.all_gather_into(out, base:t())
    assert.same(want, flat(out))
  end)

  it("gathers in place when the input is this rank's chunk of the output", function()
    local out = engine.zeros(2 * W, 3)
    local mine = out:narrow(1, 2 * R + 1, 2)
    mine:fill_(R + 1)
    dist.all_gather_into(out, mine)
    local want = {}
    for r = 0, W - 1 do for _ = 1, 6 do want[#want + 1] = r + 1 end end
    assert.same(want, flat(out))
  end)

  it("async returns the gathered tensor from wait", function()
    local w = dist.all_gather(mk({ R, -R }, "i32"), { async = true })
    local g = w:wait()
    local want = {}
    for r = 0, W - 1 do want[#want + 1] = r; want[#want + 1] = -r end
    assert.same(want, flat(g))
    assert.equal(g, w:result())
  end)

  it("shape and dtype errors name both tensors", function()
    assert.has_error(function() dist.all_gather_into(engine.zeros(2 * W + 1, 3), engine.zeros(2, 3)) end,
      string.format("all_gather_into: output f32[%d,3] does not match input f32[2,3] gathered over group world of " ..
        "size %d (expected f32[%d,...] with the input's trailing dims)", 2 * W + 1, W, 2 * W))
    assert.has_error(function() dist.all_gather_into(engine.zeros(2 * W, 3, { dtype = "f64" }), engine.zeros(2, 3)) end)
    assert.has_error(function() dist.all_gather_into(engine.zeros(2 * W, 4), engine.zeros(2, 3)) end)
  end)
end)

describe("reduce_scatter", function()
  -- rank r's input row j (0-based), column k
  local function input(dt, r, rows, cols)
    local l = {}
    for j = 0, rows - 1 do
      for k = 0, cols - 1 do
        local v
        if dt == "bool" then v = ((r + j + k) % 3 == 0) and 1 or 0
        elseif dt == "u8" then v = (r + 1) * (j + 1) + k
        else v = (r + 1) * ((j % 4) + 1) * (k % 2 == 0 and 1 or -1) end -- exact products in bf16
        l[#l + 1] = v
      end
    end
    return l
  end
  for _, dt in ipairs(DTYPES) do
    for _, op in ipairs(OPS) do
      if not (op == "avg" and not FLOAT[dt]) then
        it(string.format("%s %s: each rank gets the reduction of its chunk", dt, op), function()
          local rows, cols = 2 * W, 3
          local t = mk(input(dt, R, rows, cols), dt, { rows, cols })
          local out = dist.reduce_scatter(t, op)
          assert.same({ 2, cols }, out:shape())
          local all = expect(op, dt, function(q) return input(dt, q, rows, cols) end)
          local want = {}
          for i = 2 * R * cols + 1, (2 * R + 2) * cols do want[#want + 1] = all[i] end
          assert.same(want, flat(out))
        end)
      end
    end
  end

  it("bf16 and f16 sums are rounded once", function()
    for _, dt in ipairs({ "bf16", "f16" }) do
      local v = TRICKY[dt][W]
      if not v then pending("no tricky values for world size " .. W) end
      local l = {}
      for _ = 1, W do l[#l + 1] = v[R + 1] end
      local t = mk(l, dt)
      local out = dist.reduce_scatter(t, "sum")
      assert.same({ TRICKY_SUM[dt][W] }, flat(out))
    end
  end)

  it("stages non-contiguous input and output", function()
    local base = mk(input("f32", R, 3, 2 * W), "f32", { 3, 2 * W }) -- transposed: [2W, 3]
    local out_base = engine.zeros(3, 2)
    dist.reduce_scatter_into(out_base:t(), base:t(), "sum")
    local all = {}
    for r = 0, W - 1 do all[r + 1] = mk(input("f32", r, 3, 2 * W), "f32", { 3, 2 * W }):t():contiguous() end
    local sum = all[1]
    for i = 2, W do sum = sum + all[i] end
    local want = flat(sum:narrow(1, 2 * R + 1, 2))
    assert.same(want, flat(out_base:t()))
  end)

  it("uneven dim 1 is an error on every rank", function()
    if W == 1 then pending("every size divides by a world of 1") end
    local t = engine.zeros(2 * W + 1, 3)
    assert.has_error(function() dist.reduce_scatter(t, "sum") end,
      string.format("reduce_scatter: input f32[%d,3]: dim 0 (%d) is not divisible by the size %d of group world " ..
        "(uneven chunks are not supported; pad first)", 2 * W + 1, 2 * W + 1, W))
  end)

  it("0-d input and bad outputs are errors", function()
    assert.has_error(function() dist.reduce_scatter(engine.tensor(1, "f32")) end,
      "reduce_scatter: input f32[] is 0-d; it needs a dim 0 to split")
    assert.has_error(function() dist.reduce_scatter_into(engine.zeros(3, 3), engine.zeros(2 * W, 3)) end)
    assert.has_error(function() dist.reduce_scatter(engine.zeros(W, 2, { dtype = "i32" }), "avg") end,
      "reduce_scatter: op avg needs a floating dtype, got i32[" .. W .. ",2]")
  end)

  it("async", function()
    local w = dist.reduce_scatter(engine.ones(W, 2), "sum", { async = true })
    assert.same({ W, W }, flat(w:wait()))
  end)
end)

describe("all_to_all", function()
  -- chunk j (2 rows) of rank r holds 100 r + 10 j + row*2 + col (u8: small)
  local function chunked(dt, r)
    local l = {}
    for j = 0, W - 1 do
      for row = 0, 1 do
        for col = 0, 1 do
          if dt == "bool" then l[#l + 1] = (r + j + row + col) % 2
          elseif dt == "u8" or dt == "bf16" then l[#l + 1] = 16 * r + 4 * j + 2 * row + col
          else l[#l + 1] = 100 * r + 10 * j + 2 * row + col end
        end
      end
    end
    return l
  end
  for _, dt in ipairs(DTYPES) do
    it(dt .. ": chunk j goes to rank j; chunk i came from rank i", function()
      local t = mk(chunked(dt, R), dt, { 2 * W, 2 })
      local out = dist.all_to_all(t)
      assert.same({ 2 * W, 2 }, out:shape())
      local want = {}
      for i = 0, W - 1 do
        local src = chunked(dt, i)
        for k = 1, 4 do want[#want + 1] = src[4 * R + k] end
      end
      assert.same(want, flat(out))
    end)
  end

  it("async, non-contiguous input", function()
    local base = mk(chunked("f32", R), "f32", { 2 * W, 2 })
    local tb = base:t():contiguous():t() -- same values, column-major
    assert.is_false(tb:is_contiguous())
    local out = dist.all_to_all(tb, { async = true }):wait()
    local want = {}
    for i = 0, W - 1 do
      local src = chunked("f32", i)
      for k = 1, 4 do want[#want + 1] = src[4 * R + k] end
    end
    assert.same(want, flat(out))
  end)

  it("errors: uneven, overlapping output", function()
    if W > 1 then
      assert.has_error(function() dist.all_to_all(engine.zeros(W + 1, 2)) end)
    end
    local t = engine.zeros(2 * W, 2)
    assert.has_error(function() dist.all_to_all_into(t, t) end,
      string.format("all_to_all_into: output f32[%d,2] and input f32[%d,2] share memory", 2 * W, 2 * W))
  end)
end)

describe("broadcast", function()
  for _, dt in ipairs(DTYPES) do
    it(dt .. " from the last rank", function()
      local v = dt == "bool" and (R == W - 1 and 1 or 0) or (R + 1)
      local t = engine.full({ 3 }, v, { dtype = dt })
      dist.broadcast(t, W - 1)
      local x = dt == "bool" and 1 or W
      assert.same({ x, x, x }, flat(t))
    end)
  end

  it("non-contiguous, async, group_src", function()
    local base = mk({ 1, 2, 3, 4 }, "f32", { 2, 2 }) * (R + 1)
    dist.broadcast(base:t(), 0)
    assert.same({ 1, 2, 3, 4 }, flat(base))
    local t = engine.full({ 2 }, R)
    local w = dist.broadcast(t, { group_src = W - 1, async = true })
    assert.equal(t, w:wait())
    assert.same({ W - 1, W - 1 }, flat(t))
  end)

  it("src errors", function()
    assert.has_error(function() dist.broadcast(engine.zeros(2), W) end,
      "broadcast: src: global rank " .. W .. " is not part of group world")
    assert.has_error(function() dist.broadcast(engine.zeros(2)) end,
      "broadcast: src must be an integer global rank (0-based), got nil")
    assert.has_error(function() dist.broadcast(engine.zeros(2), 0, { group_src = 0 }) end)
    assert.has_error(function() dist.broadcast(engine.zeros(2), nil, { group_src = W }) end,
      string.format("broadcast: root %d is out of range for group world of size %d (roots are group ranks)", W, W))
  end)
end)

describe("scatter", function()
  for _, dt in ipairs(DTYPES) do
    it(dt .. ": rank i gets chunk i of the root's input", function()
      local src = W - 1
      local input
      if R == src then
        local l = {}
        for i = 0, 2 * W * 3 - 1 do l[#l + 1] = dt == "bool" and (i % 2) or (i % 100) end
        input = mk(l, dt, { 2 * W, 3 })
      end
      local out = engine.zeros(2, 3, { dtype = dt })
      dist.scatter(out, input, src)
      local want = {}
      for i = 6 * R, 6 * R + 5 do want[#want + 1] = dt == "bool" and (i % 2) or (i % 100) end
      assert.same(want, flat(out))
    end)
  end

  it("async and non-contiguous output", function()
    local input = R == 0 and engine.arange(2 * W, { dtype = "f32" }):view(W, 2) or nil
    local out_base = engine.zeros(2, 1)
    local w = dist.scatter(out_base:t(), input, 0, { async = true })
    w:wait()
    assert.same({ 2 * R, 2 * R + 1 }, flat(out_base))
  end)

  it("the root's input must match the output", function()
    -- a root-side error fails the scatter on every rank (the signature check carries it)
    local ok, err = pcall(dist.scatter, engine.zeros(2), R == 0 and engine.zeros(3) or nil, 0)
    assert.is_false(ok)
    assert.matches("scatter: .*input f32%[3%] on the root does not match output f32%[2%]", err)
    ok, err = pcall(dist.scatter, engine.zeros(2), nil, 0)
    assert.is_false(ok)
    assert.matches("scatter: .*the root %(group rank 0%) must pass the input tensor", err)
  end)
end)

describe("gather", function()
  for _, dt in ipairs(DTYPES) do
    it(dt .. ": the last rank gets every rank's input in rank order, the others nil", function()
      local dst = W - 1
      local function row(r) local l = {} for i = 0, 5 do l[#l + 1] = dt == "bool" and ((r + i) % 2) or (10 * r + i) % 100 end return l end
      local c0 = dist.comm_count("gather")
      local g = dist.gather(mk(row(R), dt, { 2, 3 }), nil, dst)
      assert.equal(c0 + 1, dist.comm_count("gather"))
      if R == dst then
        local want = {}
        for r = 0, W - 1 do for _, v in ipairs(row(r)) do want[#want + 1] = v end end
        assert.same({ 2 * W, 3 }, g:shape())
        assert.equal(dt, g.dtype)
        assert.same(want, flat(g))
      else
        assert.is_nil(g)
      end
    end)
  end

  it("uneven sizes (opts.sizes, gatherv): rank r sends r rows into dst's out; non-dst ranks allocate nothing", function()
    local sizes, total = {}, 0
    for r = 0, W - 1 do sizes[r + 1] = r; total = total + r end
    local t = engine.full({ R, 3 }, R + 0.5, { dtype = "f64" })
    local out = R == 0 and engine.zeros(total, 3, { dtype = "f64" }) or nil
    engine.reset_peak_memory()
    local before = engine.memory_stats()
    local g = dist.gather(t, out, 0, { sizes = sizes })
    local after = engine.memory_stats()
    if R == 0 then
      assert.equal(out, g)
      local want = {}
      for r = 0, W - 1 do for _ = 1, 3 * r do want[#want + 1] = r + 0.5 end end
      assert.same(want, flat(g))
    else
      assert.is_nil(g)
      assert.equal(before.allocated, after.peak_allocated)
    end
    -- a new output on dst when none is given; empty inputs everywhere
    g = dist.gather(engine.zeros(0, 2), nil, 0, { sizes = (function() local z = {} for i = 1, W do z[i] = 0 end return z end)() })
    if R == 0 then assert.same({ 0, 2 }, g:shape()) end
  end)

  it("gather_list (as torch.distributed.gather), group_dst, 0-d inputs", function()
    local list
    if R == 0 then list = {} for i = 1, W do list[i] = engine.zeros(2, { dtype = "i64" }) end end
    local r = dist.gather(engine.tensor({ R, -R }, "i64"), list, 0)
    if R == 0 then
      assert.equal(list, r)
      for i = 1, W do assert.same({ i - 1, 1 - i }, flat(list[i])) end
    else assert.is_nil(r) end
    local g = dist.gather(engine.tensor(R + 1, "f32"), nil, nil, { group_dst = W - 1 })
    if R == W - 1 then assert.same(range(W + 1), { 0, unpack(flat(g)) }) end
  end)

  it("async and non-contiguous input and output", function()
    local base = engine.arange(2 * 3, { dtype = "f32" }):view(2, 3) + 100 * R
    local outb = R == 0 and engine.zeros(2, 3 * W) or nil
    local w = dist.gather(base:t(), outb and outb:t() or nil, 0, { async = true })
    local g = w:wait()
    if R == 0 then
      assert.equal(0, (g - outb:t()):abs():sum():item())
      for r = 0, W - 1 do
        local want = (engine.arange(6, { dtype = "f32" }):view(2, 3) + 100 * r):t()
        assert.equal(0, (outb:narrow(2, 3 * r + 1, 3):t() - want):abs():sum():item())
      end
    else
      assert.is_nil(g)
    end
  end)

  it("errors on every rank: dst's output, sizes that disagree or do not match the input", function()
    local ok, err = pcall(dist.gather, engine.zeros(2), R == 0 and engine.zeros(3) or nil, 0)
    assert.is_false(ok)
    assert.matches("gather: .*output f32%[3%] on the destination does not match input f32%[2%]", err)
    ok, err = pcall(dist.gather, engine.zeros(2), nil, W)
    assert.is_false(ok)
    assert.matches("gather: dst: global rank " .. W .. " is not part of group world", err)
    if W > 1 then
      local sizes = {}
      for i = 1, W do sizes[i] = 1 end
      sizes[1] = R == W - 1 and 2 or 1
      ok, err = pcall(dist.gather, engine.zeros(sizes[R + 1], 2), nil, 0, { sizes = sizes })
      assert.is_false(ok)
      assert.matches("gather: collective mismatch on group world", err)
      sizes[1] = 1
      ok, err = pcall(dist.gather, engine.zeros(R == W - 1 and 2 or 1, 2), nil, 0, { sizes = sizes })
      assert.is_false(ok)
      assert.matches("input f32%[2,2%] has 2 rows, but sizes%[" .. W .. "%] %(this rank's%) says 1", err)
    end
    -- the group is still usable
    local g = dist.gather(engine.ones(1), nil, 0)
    if R == 0 then assert.same({ W }, g:shape()) end
  end)
end)

describe("barrier", function()
  it("sync and async", function()
    dist.barrier()
    local w = dist.barrier({ async = true })
    assert.is_nil(w:wait())
    assert.is_true(w:is_completed())
  end)
end)

describe("process groups", function()
  it("a group of rank 0 only: the others are not members and skip collectives", function()
    local g = dist.new_group({ 0 })
    local t = engine.full({ 2 }, R + 1)
    dist.reset_comm_counts()
    local r = dist.all_reduce(t, "sum", { group = g })
    local gathered = dist.all_gather(t, { group = g })
    local w = dist.all_reduce(t, "sum", { group = g, async = true })
    w:wait()
    local counts = dist.comm_counts()
    if R == 0 then
      assert.is_true(g:is_member())
      assert.equal(0, g:rank())
      assert.equal(1, g:size())
      assert.same({ 0 }, g:ranks())
      assert.same({ 1, 1 }, flat(t))
      assert.same({ all_reduce = 2, all_gather = 1 }, counts)
      assert.matches("ProcessGroup%(group%[0%], size=1, rank=0", tostring(g))
    else
      assert.is_false(g:is_member())
      assert.is_nil(g:rank())
      assert.is_nil(g:size())
      assert.same({}, g:ranks())
      assert.same({ R + 1, R + 1 }, flat(t))
      assert.equal(t, gathered) -- the input comes back
      assert.same({}, counts)
      assert.is_true(w:is_completed())
      assert.matches("not a member", tostring(g))
    end
    assert.equal(t, r)
  end)

  it("even ranks reduce among themselves; group ranks follow the list order", function()
    local evens = {}
    for r = W - 1, 0, -1 do if r % 2 == 0 then evens[#evens + 1] = r end end -- descending
    local g = dist.new_group(evens)
    local t = engine.full({ 1 }, R)
    dist.all_reduce(t, "sum", { group = g })
    local gathered = dist.all_gather(engine.full({ 1 }, R), { group = g })
    local s = 0
    for _, r in ipairs(evens) do s = s + r end
    if R % 2 == 0 then
      assert.same({ s }, flat(t))
      assert.same(evens, flat(gathered))
      assert.same(evens, g:ranks())
      for i, r in ipairs(evens) do
        assert.equal(i - 1, g:group_rank(r))
        assert.equal(r, g:global_rank(i - 1))
      end
    else
      assert.same({ R }, flat(t))
    end
  end)

  it("broadcast src is a global rank; group_src a group rank", function()
    local last = W - 1
    local g = dist.new_group(W > 1 and { last, 0 } or { 0 })
    local a, b = engine.full({ 1 }, R), engine.full({ 1 }, R)
    dist.broadcast(a, last, { group = g })
    dist.broadcast(b, { group = g, group_src = W > 1 and 1 or 0 })
    if R == 0 or R == last then
      assert.same({ last }, flat(a))
      assert.same({ 0 }, flat(b))
    else
      assert.same({ R }, flat(a))
    end
  end)

  it("rank list errors are raised on every rank", function()
    assert.has_error(function() dist.new_group({ W }) end,
      "new_group: rank " .. W .. " is out of range for world size " .. W .. " (ranks are 0-based)")
    assert.has_error(function() dist.new_group({ 0, 0 }) end, "new_group: rank 0 is listed twice")
    assert.has_error(function() dist.new_group({}) end, "new_group: the rank list is empty")
    assert.has_error(function() dist.new_group({ "a" }) end,
      "new_group: rank 1 of the list must be an integer, got a")
    assert.has_error(function() dist.new_group(3) end, "new_group: expected a list of 0-based global ranks")
    -- a group still works after the failed attempts
    local g = dist.new_group(range(W))
    local t = engine.ones(1)
    dist.all_reduce(t, "sum", { group = g })
    assert.same({ W }, flat(t))
  end)

  it("ranks passing different lists all fail instead of hanging", function()
    if W == 1 then pending("needs 2+ ranks") end
    local list = R == 0 and { 0 } or { 0, 1 }
    local ok, err
    assert.has_error(function() dist.new_group(list) end,
      "new_group: the ranks called it with different rank lists (it is collective: every rank must pass the same " ..
      "arguments)")
    -- a rank whose list is not even integers
    ok, err = pcall(dist.new_group, R == 1 and { "a" } or { 0 })
    assert.is_false(ok)
    if R == 1 then assert.matches("must be an integer", err) else assert.matches("different rank lists", err) end
    -- and a rank with a bad list while the others are fine
    local bad = R == 1 and { 0, 0 } or { 0 }
    ok, err = pcall(dist.new_group, bad)
    assert.is_false(ok)
    if R == 1 then assert.matches("listed twice", err) else assert.matches("different rank lists", err) end
  end)

  it("groups count their collectives (sequence numbers)", function()
    local g = dist.new_group(range(W))
    assert.equal(0, g:seq())
    dist.barrier({ group = g })
    dist.all_reduce(engine.ones(1), "sum", { group = g })
    assert.equal(2, g:seq())
  end)
end)

describe("collective counters", function()
  it("count per kind since the last reset (CommDebugMode-like)", function()
    dist.reset_comm_counts()
    assert.same({}, dist.comm_counts())
    local t = engine.ones(4)
    dist.all_reduce(t)
    dist.all_reduce(t, "max")
    dist.all_gather(t)
    dist.barrier()
    assert.same({ all_reduce = 2, all_gather = 1, barrier = 1 }, dist.comm_counts())
    assert.equal(2, dist.comm_count("all_reduce"))
    assert.equal(0, dist.comm_count("scatter"))
    assert.equal(4, dist.comm_count())
    assert.same({ all_reduce = 32, all_gather = 16 }, dist.comm_bytes())
    assert.has_error(function() dist.comm_count("allreduce") end, "comm_count: unknown collective kind 'allreduce'")
    -- failed calls are not counted
    pcall(dist.reduce_scatter, engine.tensor(1, "f32"))
    assert.equal(4, dist.comm_count())
    dist.reset_comm_counts()
    assert.equal(0, dist.comm_count())
  end)

  it("count_collectives and CommDebugMode count what a function issues", function()
    local counts, a, b = dist.count_collectives(function(x)
      dist.all_reduce(x)
      dist.reduce_scatter(engine.ones(W, 2))
      dist.all_to_all(engine.ones(W, 2))
      dist.broadcast(x, 0)
      dist.scatter(engine.zeros(1), R == 0 and engine.zeros(W) or nil, 0)
      return 1, 2
    end, engine.ones(2))
    assert.same({ all_reduce = 1, reduce_scatter = 1, all_to_all = 1, broadcast = 1, scatter = 1 }, counts)
    assert.equal(1, a)
    assert.equal(2, b)
    local mode = dist.CommDebugMode():enter()
    dist.all_gather(engine.ones(1))
    assert.same({ all_gather = 1 }, mode:get_comm_counts())
    mode:exit()
    dist.all_gather(engine.ones(1))
    assert.same({ all_gather = 1 }, mode:get_comm_counts())
    assert.equal(1, mode:get_total_counts())
  end)
end)

describe("flight recorder", function()
  it("keeps the last 64 collectives with sequence numbers, kinds, shapes and groups", function()
    local g = dist.new_group(range(W))
    dist.all_reduce(engine.ones(2, 3), "max", { group = g })
    dist.broadcast(engine.ones(5, { dtype = "bf16" }), 0, { group = g, async = true }):wait()
    local list, text = dist.dump_collectives()
    local a, b = list[#list - 1], list[#list]
    assert.same({ kind = "all_reduce", dtype = "f32", shape = { 2, 3 }, op = "max", seq = 0, state = "completed",
      async = false, group = g:name(), group_id = g:id(), group_size = W },
      { kind = a.kind, dtype = a.dtype, shape = a.shape, op = a.op, seq = a.seq, state = a.state, async = a.async,
        group = a.group, group_id = a.group_id, group_size = a.group_size })
    assert.equal("broadcast", b.kind)
    assert.equal(0, b.root)
    assert.equal(1, b.seq)
    assert.is_true(b.async)
    assert.equal(a.id + 1, b.id)
    assert.matches("all_reduce f32%[2,3%] op=max completed", text)
    assert.matches("broadcast bf16%[5%] root=0 async completed", text)
    assert.matches("collective flight recorder, rank " .. R, text)
    for _ = 1, 70 do dist.barrier({ group = g }) end
    list = dist.dump_collectives()
    assert.equal(64, #list)
    for i = 2, 64 do assert.equal(list[i - 1].id + 1, list[i].id) end
    assert.equal("barrier", list[64].kind)
    assert.equal(71, list[64].seq)
  end)
end)

describe("debug mode", function()
  local function with_debug(fn)
    dist.set_debug(true)
    local ok, err = pcall(fn)
    dist.set_debug(false)
    if not ok then error(err, 0) end
  end

  it("matching collectives pass the check", function()
    with_debug(function()
      assert.is_true(dist.get_debug())
      local t = engine.ones(3)
      dist.all_reduce(t)
      dist.all_gather(t)
      dist.reduce_scatter(engine.ones(W, 1), "avg")
      dist.broadcast(t, 0, { async = true }):wait()
      dist.barrier()
      assert.same({ W, W, W }, flat(t))
    end)
    assert.is_false(dist.get_debug())
  end)

  it("different shapes fail on every rank with each rank's call, instead of hanging", function()
    if W == 1 then pending("needs 2+ ranks") end
    with_debug(function()
      local g = dist.new_group(range(W))
      local n = R == 0 and 4 or 5
      local ok, err = pcall(dist.all_reduce, engine.ones(n), "sum", { group = g })
      assert.is_false(ok)
      assert.matches("all_reduce: collective mismatch on group " .. g:name():gsub("[%[%]]", "%%%0") ..
        ": rank 0: #0 all_reduce f32%[4%] op=sum; ranks? 1[%d,]*: #0 all_reduce f32%[5%] op=sum", err)
      assert.matches("last collectives of rank " .. R, err)
      -- the group is usable afterwards
      local t = engine.ones(2)
      dist.all_reduce(t, "sum", { group = g })
      assert.same({ W, W }, flat(t))
      assert.equal(2, g:seq())
    end)
  end)

  it("different kinds, dtypes, ops and roots are reported", function()
    if W == 1 then pending("needs 2+ ranks") end
    with_debug(function()
      local ok, err = pcall(function()
        if R == 0 then dist.all_reduce(engine.ones(2)) else dist.broadcast(engine.ones(2), 0) end
      end)
      assert.is_false(ok)
      assert.matches("rank 0: #%d+ all_reduce f32%[2%] op=sum; ranks? 1[%d,]*: #%d+ broadcast f32%[2%] root=0", err)
      ok, err = pcall(dist.all_gather, engine.ones(2, { dtype = R == 0 and "f32" or "bf16" }))
      assert.is_false(ok)
      assert.matches("rank 0: #%d+ all_gather f32%[2%]; ranks? 1[%d,]*: #%d+ all_gather bf16%[2%]", err)
      ok, err = pcall(dist.all_reduce, engine.ones(2), R == 0 and "sum" or "max")
      assert.is_false(ok)
      assert.matches("op=sum; ranks? 1[%d,]*: #%d+ all_reduce f32%[2%] op=max", err)
      ok, err = pcall(dist.broadcast, engine.ones(2), R == 0 and 0 or 1)
      assert.is_false(ok)
      assert.matches("root=0; ranks? 1[%d,]*: #%d+ broadcast f32%[2%] root=1", err)
    end)
  end)

  it("a check that fails on one rank fails the collective on every rank", function()
    if W == 1 then pending("needs 2+ ranks") end
    with_debug(function()
      local out = engine.zeros(R == 1 and 2 * W + 1 or 2 * W, 3)
      local ok, err = pcall(dist.all_gather_into, out, engine.ones(2, 3))
      assert.is_false(ok)
      if R == 1 then
        assert.matches("^.-all_gather_into: output f32%[" .. (2 * W + 1) .. ",3%] does not match", err)
      else
        assert.matches("all_gather_into: rank 1 %(group rank 1 of world%) failed its checks: all_gather_into: output", err)
      end
      -- the scatter root forgetting its input
      ok, err = pcall(dist.scatter, engine.zeros(2), nil, 0)
      assert.is_false(ok)
      assert.matches("the root %(group rank 0%) must pass the input tensor", err)
      local t = engine.ones(1)
      dist.all_reduce(t)
      assert.same({ W }, flat(t))
    end)
  end)

  it("a Lua-side argument error on one rank fails the collective on every rank", function()
    if W == 1 then pending("needs 2+ ranks") end
    with_debug(function()
      local ok, err = pcall(function() dist.all_reduce(R == 1 and "x" or engine.ones(2)) end)
      assert.is_false(ok)
      if R == 1 then
        assert.matches("comm_spec.lua:%d+: all_reduce: argument 1 must be a tensor, got string$", err)
      else
        assert.matches("all_reduce: rank 1 %(group rank 1 of world%) failed its checks: all_reduce: argument 1 must " ..
          "be a tensor, got string", err)
      end
      ok, err = pcall(function() dist.reduce_scatter(engine.ones(W), R == 0 and "bogus" or "sum") end)
      assert.is_false(ok)
      assert.matches("unknown op 'bogus'", err)
      local t = engine.ones(1)
      dist.all_reduce(t)
      assert.same({ W }, flat(t))
    end)
  end)
end)

describe("bare MPI collective (benchmark baseline)", function()
  it("all_reduce and all_gather on raw buffers", function()
    local g = dist.world_group()
    local buf = ffi.new("float[4]", { 1, 2, 3, R })
    assert.equal(0, C.eng_pg_raw_collective(g._c, 0, nil, buf, 4, 0, 0, 0))
    assert.same({ W, 2 * W, 3 * W, W * (W - 1) / 2 }, { buf[0], buf[1], buf[2], buf[3] })
    local src = ffi.new("int64_t[1]", R)
    local dst = ffi.new("int64_t[?]", W)
    assert.equal(0, C.eng_pg_raw_collective(g._c, 1, src, dst, 1, 5, 0, 0))
    for i = 0, W - 1 do assert.equal(i, tonumber(dst[i])) end
    assert.equal(-1, C.eng_pg_raw_collective(g._c, 0, nil, buf, 4, 2, 0, 0))
    assert.matches("dtype bf16 is not supported", ffi.string(C.eng_last_error()))
    -- gather to the last rank: MPI_Gather (op 0) and MPI_Gatherv (op 1)
    for op = 0, 1 do
      local gdst = ffi.new("int64_t[?]", W)
      assert.equal(0, C.eng_pg_raw_collective(g._c, 7, src, gdst, 1, 5, op, W - 1))
      if R == W - 1 then for i = 0, W - 1 do assert.equal(i, tonumber(gdst[i])) end end
    end
  end)

  it("all_to_all of strided column blocks on raw buffers (vector datatype)", function()
    -- local [2, 3W] holding 100*R + 10*row + col; peer j gets columns 3j..3j+2 of both rows
    local g = dist.world_group()
    local rows, block = 2, 3
    local src = ffi.new("double[?]", rows * block * W)
    for i = 0, rows - 1 do
      for c = 0, block * W - 1 do src[i * block * W + c] = 100 * R + 10 * i + c end
    end
    local dst = ffi.new("double[?]", rows * block * W)
    assert.equal(0, C.eng_pg_raw_all_to_all_strided(g._c, src, dst, rows, block, block * W, 1))
    for s = 0, W - 1 do
      for i = 0, rows - 1 do
        for k = 0, block - 1 do
          assert.equal(100 * s + 10 * i + block * R + k, dst[s * rows * block + i * block + k])
        end
      end
    end
    assert.equal(-1, C.eng_pg_raw_all_to_all_strided(g._c, src, dst, rows, block, block - 1, 1))
    assert.matches("bad layout", ffi.string(C.eng_last_error()))
  end)
end)
