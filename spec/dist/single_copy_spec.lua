-- Single-copy exchanges (engine/src/comm/cma.c): DTensor's S(a)->S(b) all_to_all
-- and S(d)->R all_gather of 256 KiB or more move each strided block once between
-- the ranks' memories when the group is on one node.  Every case is checked
-- against the single-process truth (distribute_tensor of the full tensor) and
-- against the MPI path (set_single_copy(false)), with the exact collective count;
-- uneven sizes, non-contiguous locals, several dtypes, 3-d tensors, both mesh
-- dims of a 2x2 mesh, backward, and the errors that every rank must share.
-- Every rank issues the same collectives in the same order and asserts after.
local engine = require("engine")
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local diff, errmsg = util.diff, util.errmsg

local R, W = dist.rank(), dist.world_size()
local S, Rep = dist.Shard, dist.Replicate

local mesh1 = dist.init_device_mesh("cpu", { W })
local mesh2 = W == 4 and dist.init_device_mesh("cpu", { 2, 2 }, { "dp", "tp" }) or nil
local usable = mesh1:get_group(1):single_copy_usable()
local usable2 = mesh2 and mesh2:get_group(1):single_copy_usable() and mesh2:get_group(2):single_copy_usable()

local function c(t) if W > 1 then return t end return {} end

-- redistribute with the single-copy path on or off; returns the collectives,
-- the number of single-copy exchanges and the result
local function run(d, pl, on)
  dist.set_single_copy(on)
  local n0 = dist.single_copy_count()
  local cnt, r = dist.count_collectives(d.redistribute, d, nil, pl)
  local n = dist.single_copy_count() - n0
  dist.set_single_copy(true)
  return cnt, n, r
end

describe("single-copy redistribute", function()
  it("is on by default and usable on a group of this node (Linux cross-memory attach)", function()
    assert.is_true(dist.get_single_copy())
    if W == 1 then
      assert.is_false(usable) -- nothing to exchange on one rank
    elseif not usable then
      pending("single copy not usable (" .. mesh1:get_group(1):single_copy_reason() .. "): the MPI path is used")
    end
  end)

  local CASES = {
    -- name, global shape, dtype, source placement, target placement
    { "S(1)->S(2) f32[512,1024]", { 512, 1024 }, "f32", S(1), S(2) },
    { "S(2)->S(1) f32[512,1024]", { 512, 1024 }, "f32", S(2), S(1) },
    { "S(1)->S(2) uneven f32[515,1030]", { 515, 1030 }, "f32", S(1), S(2) },
    { "S(2)->S(1) uneven f64[259,1031]", { 259, 1031 }, "f64", S(2), S(1) },
    { "S(1)->S(3) f32[64,5,1030]", { 64, 5, 1030 }, "f32", S(1), S(3) },
    { "S(3)->S(2) bf16[16,130,600]", { 16, 130, 600 }, "bf16", S(3), S(2) },
    { "S(1)->R f32[513,517]", { 513, 517 }, "f32", S(1), Rep() },
    { "S(2)->R uneven f32[300,1027]", { 300, 1027 }, "f32", S(2), Rep() },
    { "S(2)->R i64[200,515]", { 200, 515 }, "i64", S(2), Rep() },
    { "S(3)->R f32[8,70,300]", { 8, 70, 300 }, "f32", S(3), Rep() },
  }
  for i, case in ipairs(CASES) do
    local name, shape, dtype, src, dst = case[1], case[2], case[3], case[4], case[5]
    it(name .. ": equals distribute_tensor and the MPI path, one collective", function()
      engine.manual_seed(100 + i)
      local x = engine.randn(shape):to(dtype)
      local a = dist.distribute_tensor(x, mesh1, { src })
      local want = dist.distribute_tensor(x, mesh1, { dst }):to_local()
      local c_on, n_on, r_on = run(a, { dst }, true)
      local c_off, n_off, r_off = run(a, { dst }, false)
      local kind = dst:is_replicate() and "all_gather" or "all_to_all"
      assert.same(c({ [kind] = 1 }), c_on)
      assert.same(c({ [kind] = 1 }), c_off)
      assert.equal(usable and 1 or 0, n_on)
      assert.equal(0, n_off)
      assert.same({ dst }, r_on.placements)
      assert.same(shape, r_on:shape())
      assert.equal(dtype, r_on.dtype)
      assert.equal(0, diff(r_on:to_local(), want))
      assert.equal(0, diff(r_off:to_local(), want))
    end)
  end

  it("non-contiguous local shards (views into wider rows) give the same result", function()
    engine.manual_seed(7)
    local x = engine.randn(600, 520)
    -- each rank's local shard of S(1) is a view of the first 520 columns of a [rows, 600] buffer
    local size, off = dist.local_shard_size_and_offset(600, W, R)
    local buf = engine.zeros(size, 600)
    buf:narrow(2, 1, 520):copy_(x:narrow(1, off + 1, size))
    local loc = buf:narrow(2, 1, 520)
    assert.is_false(W > 1 and size > 1 and loc:is_contiguous())
    local a = dist.DTensor.from_local(loc, mesh1, { S(1) }, { shape = { 600, 520 }, stride = { 520, 1 } })
    local c1, n1, r1 = run(a, { S(2) }, true)
    local c2, n2, r2 = run(a, { Rep() }, true)
    assert.same(c({ all_to_all = 1 }), c1)
    assert.same(c({ all_gather = 1 }), c2)
    assert.equal(usable and 1 or 0, n1)
    assert.equal(usable and 1 or 0, n2)
    assert.equal(0, diff(r1:to_local(), dist.distribute_tensor(x, mesh1, { S(2) }):to_local()))
    assert.equal(0, diff(r2:to_local(), x))
  end)

  it("runs shorter than 256 bytes (a transposed local, a narrow inner dim) take the MPI path", function()
    engine.manual_seed(9)
    local x = engine.randn(600, 520)
    local size, off = dist.local_shard_size_and_offset(600, W, R)
    local loc = x:narrow(1, off + 1, size):t():contiguous():t() -- column-major: runs of 1 element
    local a = dist.DTensor.from_local(loc, mesh1, { S(1) }, { shape = { 600, 520 }, stride = { 520, 1 } })
    local c1, n1, r1 = run(a, { S(2) }, true)
    local y = engine.randn(64, 33, 129) -- S(1)->S(3): blocks of [.., .., 33]: 132-byte runs
    local b = dist.distribute_tensor(y, mesh1, { S(1) })
    local c2, n2, r2 = run(b, { S(3) }, true)
    assert.same(c({ all_to_all = 1 }), c1)
    assert.same(c({ all_to_all = 1 }), c2)
    assert.equal(0, n1)
    if W ~= 2 then assert.equal(0, n2) end -- 2 ranks: runs of 65 floats, long enough
    assert.equal(0, diff(r1:to_local(), dist.distribute_tensor(x, mesh1, { S(2) }):to_local()))
    assert.equal(0, diff(r2:to_local(), dist.distribute_tensor(y, mesh1, { S(3) }):to_local()))
  end)

  it("backward of a large S(1)->S(2) is one all_to_all back, single-copy too", function()
    engine.manual_seed(8)
    local x = engine.randn(384, 512)
    local a = dist.distribute_tensor(x, mesh1, { S(1) }, { src_data_rank = false })
    a.requires_grad = true
    local r = a:redistribute(nil, { S(2) })
    local g = dist.distribute_tensor(x * 3, mesh1, { S(2) })
    local n0 = dist.single_copy_count()
    local cb = dist.count_collectives(function() r:backward(g) end)
    local n = dist.single_copy_count() - n0
    assert.same(c({ all_to_all = 1 }), cb)
    assert.equal(usable and 1 or 0, n)
    assert.same({ S(1) }, a.grad.placements)
    assert.equal(0, diff(a.grad:to_local(), dist.distribute_tensor(x * 3, mesh1, { S(1) }):to_local()))
  end)

  it("small exchanges keep the one MPI collective", function()
    local x = engine.randn(64, 64) -- 16 KiB
    local a = dist.distribute_tensor(x, mesh1, { S(1) })
    local cnt, n, r = run(a, { S(2) }, true)
    assert.same(c({ all_to_all = 1 }), cnt)
    assert.equal(0, n)
    assert.equal(0, diff(r:to_local(), dist.distribute_tensor(x, mesh1, { S(2) }):to_local()))
  end)

  it("async redistribute keeps the MPI path (its collective stays pending)", function()
    local x = engine.randn(512, 512)
    local a = dist.distribute_tensor(x, mesh1, { S(1) })
    local n0 = dist.single_copy_count()
    local r = a:redistribute(nil, { S(2) }, { async_op = true })
    local n = dist.single_copy_count() - n0
    assert.equal(0, n)
    assert.equal(0, diff(r:to_local(), dist.distribute_tensor(x, mesh1, { S(2) }):to_local()))
  end)

  it("local shards that disagree on the global shape fail on every rank (no hang, no garbage)", function()
    if not usable then pending("needs 2 or more ranks on one node with cross-memory attach") end
    -- from_local without shape/stride infers the global rows as local rows * W: rank 0's extra
    -- row makes its DTensor 1024 + W rows long while the others say 1024
    local rows = 1024 / W + (R == 0 and 1 or 0)
    local a = dist.DTensor.from_local(engine.zeros(rows, 512), mesh1, { S(1) })
    local e1 = errmsg(a.redistribute, a, nil, { S(2) })
    local e2 = errmsg(a.redistribute, a, nil, { Rep() })
    -- the group still works afterwards
    local ok = engine.ones(4)
    dist.all_reduce(ok)
    assert.is_truthy(e1)
    assert.is_truthy(e2)
    assert.is_truthy(e1:find("all_to_all on group", 1, true), e1)
    assert.is_truthy(e1:find("entries on the concat dim, the inputs add up to " .. (1024 + 1), 1, true), e1)
    assert.is_truthy(e2:find("all_gather on group", 1, true), e2)
    assert.equal(W, ok:get(1))
  end)
end)

describe("single-copy redistribute on a 2x2 mesh", function()
  local function need4() if not mesh2 then pending("needs 4 ranks (2x2 mesh)") end end
  local PAIRS = {
    { { S(1), S(2) }, { S(2), S(1) } },
    { { S(1), S(1) }, { S(2), S(2) } },
    { { S(2), S(1) }, { Rep(), Rep() } },
    { { Rep(), S(1) }, { Rep(), S(2) } },
  }
  for i, p in ipairs(PAIRS) do
    it(string.format("%s -> %s equals distribute_tensor and the MPI path", dist.placements_describe(p[1]),
      dist.placements_describe(p[2])), function()
      need4()
      engine.manual_seed(300 + i)
      local x = engine.randn(515, 1029)
      local a = dist.distribute_tensor(x, mesh2, p[1])
      local want = dist.distribute_tensor(x, mesh2, p[2]):to_local()
      local c_on, n_on, r_on = run(a, p[2], true)
      local c_off, n_off, r_off = run(a, p[2], false)
      assert.same(c_off, c_on)
      assert.equal(0, n_off)
      if usable2 then assert.is_true(n_on >= 1) end
      assert.equal(0, diff(r_on:to_local(), want))
      assert.equal(0, diff(r_off:to_local(), want))
    end)
  end
end)

describe("single-copy box exchange (dist.box_exchange)", function()
  local function need() if not usable then pending("needs 2 or more ranks on one node with cross-memory attach") end end
  -- every rank sends rank q the columns [q*64, q*64+64) of its [8, 64*W] source (strided runs of
  -- 512 bytes) into rows [r*8, r*8+8) of q's [8*W, 64] destination (here a strided view)
  local function moves_for()
    local m = {}
    for r = 0, W - 1 do
      for q = 0, W - 1 do
        m[#m + 1] = { from = r, src = 1, src_off = { 0, q * 64 }, to = q, dst = 1, dst_off = { r * 8, 0 },
          shape = { 8, 64 } }
      end
    end
    return m
  end
  local function source(r) return engine.arange(8 * 64 * W, { dtype = "f64" }):view(8, 64 * W) + 1000 * r end

  it("moves strided boxes between the ranks' tensors, one all_to_all", function()
    need()
    local big = engine.zeros(8 * W, 70, { dtype = "f64" })
    local dst = big:narrow(2, 3, 64)
    local n0 = dist.single_copy_count()
    local cnt, ok = dist.count_collectives(dist.box_exchange, moves_for(), { source(R) }, { dst }, { dtype = "f64" })
    assert.is_true(ok)
    assert.same({ all_to_all = 1 }, cnt)
    assert.equal(1, dist.single_copy_count() - n0)
    for r = 0, W - 1 do
      assert.equal(0, diff(dst:narrow(1, r * 8 + 1, 8), source(r):narrow(2, R * 64 + 1, 64)))
    end
    assert.equal(0, big:narrow(2, 1, 2):abs():sum():item() + big:narrow(2, 67, 4):abs():sum():item())
  end)

  it("move lists that differ, and boxes outside a tensor, fail on every rank (no hang)", function()
    need()
    local src, dst = engine.zeros(8, 64 * W), engine.zeros(8 * W, 64)
    local bad = moves_for()
    if R == 0 then bad[1].shape = { 8, 63 } end
    local e1 = errmsg(dist.box_exchange, bad, { src }, { dst }, { dtype = "f32" })
    local out = moves_for()
    out[#out].dst_off = { 8 * W - 7, 0 }   -- one row past the destination's end
    local e2 = errmsg(dist.box_exchange, out, { src }, { dst }, { dtype = "f32" })
    local none = moves_for()
    none[1].src = 2   -- rank 0 passed one source
    local e3 = errmsg(dist.box_exchange, none, { src }, { dst }, { dtype = "f32" })
    local ok = engine.ones(4)
    dist.all_reduce(ok)
    assert.equal(W, ok:get(1))
    assert.is_truthy(e1 and e1:find("every rank must pass the same list of moves", 1, true), e1)
    assert.is_truthy(e2 and e2:find("does not fit in its source [8," .. 64 * W .. "] or destination [" .. 8 * W
      .. ",64]", 1, true), e2)
    assert.is_truthy(e3 and e3:find("move 0 takes source 1 of group rank 0", 1, true), e3)
  end)

  it("declines the same way on every rank when single copy is off (the caller moves the boxes)", function()
    dist.set_single_copy(false)
    local ok, r = pcall(dist.box_exchange, moves_for(), { engine.zeros(8, 64 * W) }, { engine.zeros(8 * W, 64) },
      { dtype = "f32" })
    dist.set_single_copy(true)
    assert.is_true(ok, r)
    assert.is_false(r)
  end)
end)
