-- DTensor: placements, layout math, creation and conversion (pytorch-semantics
-- groups A and C).  Runs under mpirun with 1, 2 and 4 ranks (tools/run-tests.sh)
-- and in the single-process run; 2x2-mesh cases need 4 ranks.  Every rank
-- issues the same collectives in the same order and asserts afterwards, so a
-- failing rank cannot leave the others waiting.
local engine = require("engine")
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local diff, errmsg = util.diff, util.errmsg

local R, W = dist.rank(), dist.world_size()
local S, Rep, Part = dist.Shard, dist.Replicate, dist.Partial

local function range(n) local r = {} for i = 1, n do r[i] = i - 1 end return r end
local function flat(t) return (t:contiguous():tolist_flat()) end
-- max |a - b| (0 for two empty tensors; huge when the shapes differ)
-- comm counts of fn (kinds with zero omitted), then fn's results
local function counts(fn, ...) return dist.count_collectives(fn, ...) end
local function c(n) if W > 1 then return n end return nil end  -- expected count: none on a 1-rank mesh
local function chunk_of(t, d, k, r)
  local size, off = dist.local_shard_size_and_offset(t:size(d), k, r)
  return t:narrow(d, off + 1, size)
end

local mesh1 = dist.init_device_mesh("cpu", { W })
local mesh2 = W == 4 and dist.init_device_mesh("cpu", { 2, 2 }, { "dp", "tp" }) or nil
local function need4() if not mesh2 then pending("needs 4 ranks (2x2 mesh)") end end

-- ------------------------------------------------------------------ A: layout math
describe("A: layout math", function()
  it("A1 local_shard_size_and_offset follows torch.chunk, empty trailing shards included", function()
    local sizes, offs = {}, {}
    for r = 0, 3 do sizes[r + 1], offs[r + 1] = dist.local_shard_size_and_offset(10, 4, r) end
    assert.same({ 3, 3, 3, 1 }, sizes)
    assert.same({ 0, 3, 6, 9 }, offs)
    for r = 0, 3 do sizes[r + 1], offs[r + 1] = dist.local_shard_size_and_offset(5, 4, r) end
    assert.same({ 2, 2, 1, 0 }, sizes)
    assert.same({ 0, 2, 4, 5 }, offs)
    for r = 0, 3 do
      local s, o = dist.local_shard_size_and_offset(12, 4, r)
      assert.equal(3, s); assert.equal(3 * r, o)
    end
    assert.same({ 0, 0 }, { dist.local_shard_size_and_offset(0, 4, 3) })
  end)

  it("A1 errors: bad chunk count and index", function()
    assert.has_error(function() dist.local_shard_size_and_offset(10, 0, 0) end,
      "shard_size_and_offset: 0 chunks requested (need >= 1)")
    assert.has_error(function() dist.local_shard_size_and_offset(10, 4, 4) end,
      "shard_size_and_offset: chunk index 4 out of range for 4 chunks")
  end)

  it("A2 padding over 8 chunks: pad = ceil(s/8) - size, shard empty iff idx >= s", function()
    for s = 0, 7 do
      local full = math.ceil(s / 8)
      for idx = 0, 7 do
        local size = dist.local_shard_size_and_offset(s, 8, idx)
        local pad = full - size
        if s == 0 then assert.equal(0, pad) else assert.equal(idx < s and 0 or 1, pad) end
        assert.equal(idx >= s, size == 0)
      end
    end
  end)

  it("A3 from_local global size on a 1-d mesh", function()
    local x = engine.ones(3, 3)
    assert.same({ 3 * W, 3 }, dist.DTensor.from_local(x, mesh1, { S(1) }):shape())
    assert.same({ 3, 3 }, dist.DTensor.from_local(x, mesh1, { Rep() }):shape())
    assert.same({ 3, 3 }, dist.DTensor.from_local(x, mesh1, { Part() }):shape())
    assert.same({ 3, 3 * W }, dist.DTensor.from_local(x, mesh1, { S(-1) }):size())
    assert.same({ S(2) }, dist.DTensor.from_local(x, mesh1, { S(-1) }).placements)
    assert.equal(9 * W, dist.DTensor.from_local(x, mesh1, { S(2) }):numel())
    assert.same({ 3, 3 }, dist.DTensor.from_local(x, mesh1):shape())   -- default: Replicate
    assert.same({ Rep() }, dist.DTensor.from_local(x, mesh1).placements)
  end)

  it("A3 from_local global size on a 2x2 mesh", function()
    need4()
    local x = engine.ones(3, 3)
    assert.same({ 6, 6 }, dist.DTensor.from_local(x, mesh2, { S(1), S(2) }):shape())
    assert.same({ 12, 3 }, dist.DTensor.from_local(x, mesh2, { S(1), S(1) }):shape())
    assert.same({ 6, 3 }, dist.DTensor.from_local(x, mesh2, { S(1), Part() }):shape())
  end)

  it("A3 from_local global size on 2-d meshes 1xW and Wx1 (the 2x4 cases with a mesh dim of 1)", function()
    local row = dist.init_device_mesh("cpu", { 1, W })
    local col = dist.init_device_mesh("cpu", { W, 1 })
    local x = engine.ones(3, 3)
    assert.same({ 3, 3 * W }, dist.DTensor.from_local(x, row, { S(1), S(2) }):shape())
    assert.same({ 3 * W, 3 }, dist.DTensor.from_local(x, row, { S(1), S(1) }):shape())
    assert.same({ 3 * W, 3 }, dist.DTensor.from_local(x, col, { S(1), S(2) }):shape())
    assert.same({ 3 * W, 3 }, dist.DTensor.from_local(x, col, { S(1), S(1) }):shape())
    assert.same({ 3 * W, 3 }, dist.DTensor.from_local(x, row, { Part(), S(1) }):shape())
    assert.same({ 3, 3 }, dist.DTensor.from_local(x, col, { Rep(), Part() }):shape())
    local neg = dist.DTensor.from_local(x, col, { S(-1), Rep() })
    assert.same({ 3, 3 * W }, neg:shape())
    assert.same({ S(2), Rep() }, neg.placements)
    assert.same({ 3 * W, 1 }, neg:stride())
  end)

  it("A3 from_local global size on a 2x2 mesh: Replicate, Partial and negative Shard dims", function()
    need4()
    local x = engine.ones(3, 3)
    assert.same({ 3, 6 }, dist.DTensor.from_local(x, mesh2, { Rep(), S(2) }):shape())
    assert.same({ 3, 3 }, dist.DTensor.from_local(x, mesh2, { Rep(), Rep() }):shape())
    assert.same({ 3, 3 }, dist.DTensor.from_local(x, mesh2, { Part(), Part("max") }):shape())
    local neg = dist.DTensor.from_local(x, mesh2, { S(-1), S(-2) })
    assert.same({ 6, 6 }, neg:shape())
    assert.same({ S(2), S(1) }, neg.placements)
    local x3 = engine.ones(3, 3, 3)
    assert.same({ 6, 3, 6 }, dist.DTensor.from_local(x3, mesh2, { S(1), S(3) }):shape())
    assert.same({ 3, 12, 3 }, dist.DTensor.from_local(x3, mesh2, { S(2), S(2) }):shape())
  end)

  it("A3 from_local global size on 3-d meshes 2x2x1 and 1x2x2 (the 2x2x2 cases at 4 ranks)", function()
    need4()
    local m221 = dist.init_device_mesh("cpu", { 2, 2, 1 })
    local m122 = dist.init_device_mesh("cpu", { 1, 2, 2 })
    local x = engine.ones(3, 3, 3)
    assert.same({ 6, 6, 3 }, dist.DTensor.from_local(x, m221, { S(1), S(2), S(3) }):shape())
    assert.same({ 12, 3, 3 }, dist.DTensor.from_local(x, m221, { S(1), S(1), S(3) }):shape())
    assert.same({ 3, 6, 6 }, dist.DTensor.from_local(x, m122, { S(1), S(2), S(3) }):shape())
    assert.same({ 6, 3, 6 }, dist.DTensor.from_local(x, m122, { S(1), S(1), S(3) }):shape())
    local neg = dist.DTensor.from_local(x, m221, { S(-3), Rep(), S(-1) })
    assert.same({ 6, 3, 3 }, neg:shape())
    assert.same({ S(1), Rep(), S(3) }, neg.placements)
  end)

  it("A4 from_local global stride rescales the strides above the shard dim's", function()
    assert.same({ 8, 1 }, dist.DTensor.from_local(engine.ones(4, 8), mesh1, { S(1) }):stride())
    assert.same({ 4 * W, 1 }, dist.DTensor.from_local(engine.ones(8, 4), mesh1, { S(2) }):stride())
    local p = engine.randn(8, 4, 8):permute(2, 3, 1)  -- shape (4,8,8), stride (8,1,32)
    assert.same({ 8, 1, 32 }, p:stride())
    local d = dist.DTensor.from_local(p, mesh1, { S(2) })
    assert.same({ 8 * W, 1, 32 * W }, d:stride())
    assert.same({ 4, 8 * W, 8 }, d:shape())
  end)

  it("A5 global offsets on a 2x4 mesh of a (24,24) tensor", function()
    for r = 0, 7 do
      local coord = { math.floor(r / 4), r % 4 }
      local function off(pl) local _, o = dist.compute_local_shape_and_global_offset({ 24, 24 }, { 2, 4 }, pl, coord); return o end
      assert.same({ 12 * (math.floor(r / 4)), 0 }, off({ S(1), Rep() }))
      assert.same({ 0, 12 * (math.floor(r / 4)) }, off({ S(2), Rep() }))
      assert.same({ 6 * (r % 4), 0 }, off({ Rep(), S(1) }))
      assert.same({ 0, 6 * (r % 4) }, off({ Rep(), S(2) }))
    end
  end)

  it("local shape and offset apply placements left to right on the sharded size (uneven, nested)", function()
    -- 13 rows over mesh (2, 4) [S1, S1]: 7/6 rows on mesh dim 1, then chunks of those over 4
    local want = { [0] = { 2, 0 }, { 2, 2 }, { 2, 4 }, { 1, 6 }, { 2, 7 }, { 2, 9 }, { 2, 11 }, { 0, 13 } }
    for r = 0, 7 do
      local ls, off = dist.compute_local_shape_and_global_offset({ 13, 5 }, { 2, 4 }, { S(1), S(1) }, { math.floor(r / 4), r % 4 })
      assert.same({ want[r][1], 5 }, ls)
      assert.equal(want[r][2], off[1])
    end
    local ls = dist.compute_local_shape_and_global_offset({ 5, 3 }, mesh1, { S(1) })
    local size = dist.local_shard_size_and_offset(5, W, R)
    assert.same({ size, 3 }, ls)
  end)
end)

-- ------------------------------------------------------------------ placements
describe("placements", function()
  it("construct, compare and print (dims 1-based)", function()
    assert.equal("Shard(1)", tostring(S(1)))
    assert.equal("Shard(-1)", tostring(S(-1)))
    assert.equal("Replicate()", tostring(Rep()))
    assert.equal("Partial(sum)", tostring(Part()))
    assert.equal("Partial(max)", tostring(Part("max")))
    assert.equal("Partial(prod)", tostring(Part("product")))
    assert.is_true(S(2) == S(2))
    assert.is_false(S(1) == S(2))
    assert.is_false(Part("sum") == Part("avg"))
    assert.is_true(S(2):is_shard() and S(2):is_shard(2) and not S(2):is_shard(1))
    assert.is_true(Rep():is_replicate() and Part():is_partial() and Part("min"):is_partial("min"))
    assert.equal("[Shard(1), Replicate()]", dist.placements_describe({ S(1), Rep() }))
  end)

  it("Shard(0) is an error saying dims are 1-based; bad Partial ops are errors", function()
    assert.has_error(function() S(0) end,
      "Shard: dim 0 is invalid: dims are 1-based (Torch7 convention); use Shard(1) for the first dim or Shard(-1) for the last")
    assert.has_error(function() S(1.5) end, "Shard: dim must be an integer, got 1.5")
    assert.has_error(function() Part("mul") end,
      "Partial: reduce op must be \"sum\", \"avg\", \"max\", \"min\" or \"prod\", got mul")
  end)

  it("placements lists are checked against the mesh and tensor", function()
    local x = engine.ones(3, 3)
    assert.has_error(function() dist.DTensor.from_local(x, mesh1, { S(1), Rep() }) end,
      "from_local: f32[3,3]: `placements` must have the same length as `device_mesh.ndim`! Found placements length: 2, and device_mesh.ndim: 1.")
    assert.matches("Shard%(3%) %(placement 1%) is out of range for a 2%-d tensor %(valid: 1%.%.2 or %-2%.%.%-1%)",
      errmsg(dist.DTensor.from_local, x, mesh1, { S(3) }))
    assert.matches("placements must be a list", errmsg(dist.DTensor.from_local, x, mesh1, S(1)))
    assert.matches("placements%[1%] must be dist.Shard", errmsg(dist.DTensor.from_local, x, mesh1, { 1 }))
    assert.matches("device_mesh must be a DeviceMesh", errmsg(dist.DTensor.from_local, x, nil, { S(1) }))
  end)
end)

-- ------------------------------------------------------------------ C: creation / conversion
describe("C: distribute_tensor", function()
  it("C1 Shard(1): exactly one scatter; global size; local chunk; requires_grad and leaf kept", function()
    engine.manual_seed(3)
    local x = engine.randn(12, 3):requires_grad_()
    local cnt, d = counts(dist.distribute_tensor, x, mesh1, { S(1) })
    assert.same(c({ scatter = 1 }) or {}, cnt)
    assert.same({ 12, 3 }, d:shape())
    assert.same({ 12 / W, 3 }, d:to_local():shape())
    assert.is_true(d.requires_grad)
    assert.is_true(d.is_leaf)
    assert.equal(0, diff(d:to_local(), chunk_of(x:detach(), 1, W, R)))
    assert.is_true(dist.is_dtensor(d))
    assert.is_false(dist.is_dtensor(x))
  end)

  it("C2 uneven shards: local == chunk(t, W, dim)[r], size == global", function()
    local shapes = { { 13, 3, 3 }, { 14, 3, 3 }, { 3, 13, 3 }, { 3, 14, 3 }, { 3, 3, 13 }, { 3, 3, 14 } }
    local dims = { 1, 1, 2, 2, 3, 3 }
    local res = {}
    for i, sh in ipairs(shapes) do
      engine.manual_seed(i)
      local x = engine.randn(sh)
      local d = dist.distribute_tensor(x, mesh1, { S(dims[i]) })
      res[i] = { x, d }
    end
    for i, sh in ipairs(shapes) do
      local x, d = res[i][1], res[i][2]
      assert.same(sh, d:shape())
      assert.equal(0, diff(d:to_local(), chunk_of(x, dims[i], W, R)))
    end
    if W == 4 then
      assert.same(({ 4, 4, 4, 1 })[R + 1], res[1][2]:to_local():size(1))
      assert.same(({ 4, 4, 4, 2 })[R + 1], res[2][2]:to_local():size(1))
    end
  end)

  it("C2 uneven on a 2x2 mesh: nested chunks, [S1, S2] and [S1, S1]", function()
    need4()
    local x = engine.arange(13 * 7):view(13, 7):float()
    local d1 = dist.distribute_tensor(x, mesh2, { S(1), S(2) })
    local d2 = dist.distribute_tensor(x, mesh2, { S(1), S(1) })
    local co = mesh2:get_coordinate()
    local e1 = chunk_of(chunk_of(x, 1, 2, co[1]), 2, 2, co[2])
    local e2 = chunk_of(chunk_of(x, 1, 2, co[1]), 1, 2, co[2])
    assert.equal(0, diff(d1:to_local(), e1))
    assert.equal(0, diff(d2:to_local(), e2))
    assert.equal(0, diff(d1:full_tensor(), x))
    assert.equal(0, diff(d2:full_tensor(), x))
  end)

  it("C3 src_data_rank: every rank gets the source rank's data; false means no communication", function()
    local src = W > 1 and 1 or 0
    local x = engine.arange(12):view(4, 3):float() + 100 * R
    local want = engine.arange(12):view(4, 3):float() + 100 * src
    local fulls = {}
    for i, pl in ipairs({ { S(1) }, { S(2) }, { Rep() } }) do
      fulls[i] = dist.distribute_tensor(x, mesh1, pl, { src_data_rank = src }):full_tensor()
    end
    local cnt, d = counts(dist.distribute_tensor, x, mesh1, { S(1) }, { src_data_rank = false })
    local cnt2, d2 = counts(dist.distribute_tensor, x, mesh1, { Rep() }, { src_data_rank = -1 })
    for i = 1, 3 do assert.equal(0, diff(fulls[i], want)) end
    assert.same({}, cnt)
    assert.same({}, cnt2)
    assert.equal(0, diff(d:to_local(), chunk_of(x, 1, W, R)))
    assert.equal(0, diff(d2:to_local(), x))
  end)

  it("C4 errors: placements length, non-leaf, other mesh, other placements, Partial, src rank", function()
    local x = engine.randn(4, 4)
    if mesh2 then
      assert.matches("must have the same length as `device_mesh.ndim`",
        errmsg(dist.distribute_tensor, x, mesh2, { S(1) }))
    end
    local y = engine.randn(4, 4):requires_grad_() * 2
    assert.matches("should be used to distribute leaf tensors! but found non%-leaf tensor",
      errmsg(dist.distribute_tensor, y, mesh1, { S(1) }))
    local d = dist.distribute_tensor(x, mesh1, { S(1) })
    local other = dist.init_device_mesh("cpu", { W }, { "other" })
    assert.matches("to a different device mesh", errmsg(dist.distribute_tensor, d, other, { S(1) }))
    assert.matches("to a different placements", errmsg(dist.distribute_tensor, d, mesh1, { Rep() }))
    assert.equal(d, dist.distribute_tensor(d, mesh1, { S(1) }))
    assert.matches("Trying to distribute tensor with unsupported placements Partial%(sum%)",
      errmsg(dist.distribute_tensor, x, mesh1, { Part() }))
    assert.matches("src_data_rank " .. W .. " is out of range for mesh dim 1 of size " .. W,
      errmsg(dist.distribute_tensor, x, mesh1, { S(1) }, { src_data_rank = W }))
  end)

  it("C16 factories: local shards filled; rand/randn layout-independent and equal to engine.rand", function()
    local z = dist.zeros({ 10, 20 }, { mesh = mesh1, placements = { S(1) } })
    local o = dist.ones({ 10, 20 }, { mesh = mesh1, placements = { S(1) }, dtype = "f64", requires_grad = true })
    local f = dist.full({ 10, 20 }, 2.5, { mesh = mesh1, placements = { S(2) } })
    local e = dist.empty({ 10, 20 }, { mesh = mesh1, placements = { Rep() } })
    local rows = dist.local_shard_size_and_offset(10, W, R)
    local cols = dist.local_shard_size_and_offset(20, W, R)
    assert.same({ 10, 20 }, z:shape())
    assert.same({ rows, 20 }, z:to_local():shape())
    assert.equal(0, diff(z:to_local(), engine.zeros(rows, 20)))
    assert.equal(0, diff(o:to_local(), engine.ones(rows, 20, { dtype = "f64" })))
    assert.equal("f64", o.dtype)
    assert.is_true(o.requires_grad and o.is_leaf)
    assert.equal(0, diff(f:to_local(), engine.full({ 10, cols }, 2.5)))
    assert.same({ 10, 20 }, e:to_local():shape())
    assert.same({ 20, 1 }, z:stride())
    if W == 4 then assert.same(({ 3, 3, 3, 1 })[R + 1], rows) end
  end)

  it("C16 rand/randn: full_tensor() equals engine.rand/randn with the same seed, for every layout", function()
    local layouts = { { Rep() }, { S(1) }, { S(2) } }
    local res = {}
    for i, pl in ipairs(layouts) do
      engine.manual_seed(11)
      local r1 = dist.rand({ 7, 4 * W + 1 }, { mesh = mesh1, placements = pl })
      local r2 = dist.randn({ 7, 4 * W + 1 }, { mesh = mesh1, placements = pl, dtype = "f64" })
      local after = engine.rand(3)
      res[i] = { r1:full_tensor(), r2:full_tensor(), after, r1:to_local() }
    end
    engine.manual_seed(11)
    local e1 = engine.rand(7, 4 * W + 1)
    local e2 = engine.randn({ 7, 4 * W + 1 }, { dtype = "f64" })
    local e3 = engine.rand(3)
    local locals = dist.allreduce_counts({ math.floor(res[3][4]:sum():item() * 1e6) })
    for i = 1, #layouts do
      assert.equal(0, diff(res[i][1], e1))
      assert.equal(0, diff(res[i][2], e2))
      assert.equal(0, diff(res[i][3], e3))  -- the generator advanced by the global numel
    end
    assert.is_true(locals[1] ~= 0)
  end)

  it("C16 rand shards differ between ranks", function()
    engine.manual_seed(5)
    local d = dist.rand({ 4, 4 * W }, { mesh = mesh1, placements = { S(2) } })
    local mine = d:to_local():sum():item()
    local full = d:full_tensor()
    local other = full:narrow(2, ((R + 1) % W) * 4 + 1, 4):sum():item()
    if W > 1 then assert.not_equal(mine, other) end
    assert.equal(0, diff(d:to_local(), full:narrow(2, R * 4 + 1, 4)))
  end)

  it("factory errors", function()
    assert.matches("opts.mesh %(a DeviceMesh%) is required", errmsg(dist.zeros, { 2, 3 }, {}))
    assert.matches("random DTensors cannot have Partial placements",
      errmsg(dist.rand, { 2, 3 }, { mesh = mesh1, placements = { Part() } }))
    assert.matches("random numbers need a floating point dtype",
      errmsg(dist.randn, { 2, 3 }, { mesh = mesh1, dtype = "i64" }))
    assert.matches("negative size", errmsg(dist.ones, { 2, -3 }, { mesh = mesh1 }))
  end)
end)

describe("C: from_local / to_local / full_tensor", function()
  it("C5 uneven from_local with explicit shape and stride; only one of them is an error", function()
    local x = engine.arange(2 * (W + 1)):view(W + 1, 2):float()
    local loc = chunk_of(x, 1, W, R)
    local d = dist.DTensor.from_local(loc, mesh1, { S(1) }, { shape = { W + 1, 2 }, stride = { 2, 1 } })
    local full = d:full_tensor()
    assert.same({ W + 1, 2 }, d:shape())
    assert.same({ 2, 1 }, d:stride())
    assert.equal(0, diff(full, x))
    assert.matches("Please pass both shape and stride at the same time%.",
      errmsg(dist.DTensor.from_local, loc, mesh1, { S(1) }, { shape = { W + 1, 2 } }))
    assert.matches("Please pass both shape and stride at the same time%.",
      errmsg(dist.DTensor.from_local, loc, mesh1, { S(1) }, { stride = { 2, 1 } }))
    if W > 1 then
      assert.matches("does not match this rank's shard",
        errmsg(dist.DTensor.from_local, x, mesh1, { S(1) }, { shape = { W + 1, 2 }, stride = { 2, 1 } }))
    end
    assert.matches("the local tensor must be a plain tensor", errmsg(dist.DTensor.from_local, d, mesh1, { S(1) }))
  end)

  it("C6 run_check: dtype, requires_grad and stride mismatches are errors on every rank", function()
    local function try(t, check) return pcall(dist.DTensor.from_local, t, mesh1, { S(1) }, { run_check = check }) end
    local ok1, e1 = try(R == 0 and engine.ones(3, 4, { dtype = "f64" }) or engine.ones(3, 4), true)
    local ok2 = try(R == 0 and engine.ones(3, 4, { dtype = "f64" }) or engine.ones(3, 4), false)
    local ok3, e3 = try(R == 0 and engine.ones(3, 4):requires_grad_() or engine.ones(3, 4), true)
    local ok4, e4 = try(R == 0 and engine.ones(4, 3):t() or engine.ones(3, 4), true)
    local ok5 = try(engine.ones(3, 4), true)
    assert.is_true(ok2)
    assert.is_true(ok5)
    if W > 1 then
      assert.is_false(ok1); assert.is_false(ok3); assert.is_false(ok4)
      assert.matches("Inconsistent tensor metadata %(including shape and stride%) across ranks %(dtypes f32 and f64%)", e1)
      assert.matches("Inconsistent tensor metadata.*requires_grad differs", e3)
      assert.matches("Inconsistent tensor metadata.*local shapes or strides differ", e4)
    else
      assert.is_true(ok1 and ok3 and ok4)
    end
  end)

  it("C6 run_check broadcasts rank 0's data over Replicate mesh dims", function()
    local d = dist.DTensor.from_local(engine.full({ 2, 2 }, R + 1), mesh1, { Rep() }, { run_check = true })
    local s = dist.DTensor.from_local(engine.full({ 2, 2 }, R + 1), mesh1, { S(1) }, { run_check = true })
    assert.equal(0, diff(d:to_local(), engine.ones(2, 2)))
    assert.equal(0, diff(s:to_local(), engine.full({ 2, 2 }, R + 1)))
  end)

  it("C7 from_local is differentiable: gradient of the local through to_local", function()
    local x = engine.randn(3, 3):requires_grad_()
    local d = dist.DTensor.from_local(x * 3, mesh1, { S(1) })
    assert.is_false(d.is_leaf)
    assert.equal("FromLocalBackward", d.grad_fn)
    local y = d:to_local() * 3
    y:backward(engine.ones(3, 3))
    assert.equal(0, diff(x.grad, engine.full({ 3, 3 }, 9)))
    -- backward from the DTensor with a DTensor gradient
    local x2 = engine.randn(3, 3):requires_grad_()
    local d2 = dist.DTensor.from_local(x2 * 3, mesh1, { S(1) })
    d2:backward(dist.DTensor.from_local(engine.ones(3, 3), mesh1, { S(1) }))
    assert.equal(0, diff(x2.grad, engine.full({ 3, 3 }, 3)))
  end)

  it("C7 (reference form) the multiply on the DTensor: (d * 3):backward(DTensor ones) gives x.grad == 9 * ones, no communication", function()
    engine.manual_seed(7)
    local x = engine.randn(3, 3):requires_grad_()
    local d = dist.DTensor.from_local(x * 3, mesh1, { S(1) })
    local leaf = d.is_leaf
    local cf, y = counts(function() return d * 3 end)
    local cb = counts(function() y:backward(dist.DTensor.from_local(engine.ones(3, 3), mesh1, { S(1) })) end)
    assert.is_false(leaf)
    assert.is_true(dist.is_dtensor(y))
    assert.same({ S(1) }, y.placements)
    assert.same({ 3 * W, 3 }, y:shape())
    assert.is_false(y.is_leaf)
    assert.same({}, cf)
    assert.same({}, cb)
    assert.is_false(dist.is_dtensor(x.grad))
    assert.equal(0, diff(x.grad, engine.full({ 3, 3 }, 9)))
  end)

  it("C8 from_local then to_local: gradient flows to the plain input", function()
    local x = engine.randn(3, 3):requires_grad_()
    local y = engine.randn(3, 3)
    local out = dist.DTensor.from_local(x + 8, mesh1, { S(1) }):to_local() * 6 + y
    out:sum():backward()
    assert.equal(0, diff(x.grad, engine.full({ 3, 3 }, 6)))
  end)

  it("C8 (reference form) the * 6 on the DTensor: ((from_local(x + 8) * 6):to_local() + y):sum():backward() -> 6 * ones", function()
    engine.manual_seed(8)
    local x = engine.randn(3, 3):requires_grad_()
    local y = engine.randn(3, 3)
    local cnt, out = counts(function()
      local d6 = dist.DTensor.from_local(x + 8, mesh1, { S(1) }) * 6
      local o = d6:to_local() + y
      o:sum():backward()
      return o
    end)
    assert.same({}, cnt)
    assert.is_false(dist.is_dtensor(out))
    assert.equal(0, diff(out, (x:detach() + 8) * 6 + y))
    assert.equal(0, diff(x.grad, engine.full({ 3, 3 }, 6)))
  end)

  it("C9 to_local of a leaf DTensor: its grad is a DTensor with the leaf's placements", function()
    local st = dist.DTensor.from_local(engine.randn(3, 3), mesh1, { S(1) }):detach()
    st.requires_grad = true
    assert.is_true(st.is_leaf and dist.is_dtensor(st))
    local y = engine.randn(3, 3)
    local l = st:to_local()
    assert.is_false(dist.is_dtensor(l))
    assert.equal("ToLocalBackward", l.grad_fn)
    ;(l * 3 + y):sum():backward()
    assert.is_true(dist.is_dtensor(st.grad))
    assert.same({ S(1) }, st.grad.placements)
    assert.same({ 3 * W, 3 }, st.grad:shape())
    assert.equal(0, diff(st.grad:to_local(), engine.full({ 3, 3 }, 3)))
    -- a second backward accumulates into the DTensor grad
    ;(st:to_local() * 2):sum():backward()
    assert.equal(0, diff(st.grad:to_local(), engine.full({ 3, 3 }, 5)))
    assert.is_true(dist.is_dtensor(st.grad))
    -- under no_grad to_local is a view sharing the local storage
    local v = engine.no_grad(function() return st:to_local() end)
    assert.equal(st:data_ptr(), v:data_ptr())
    assert.is_nil(v.grad_fn)
  end)

  it("C9 (reference form) ((st * 3):to_local() + y):sum():backward() -> st.grad:to_local() == 3 * ones; no_grad to_local is the local itself", function()
    engine.manual_seed(9)
    local st = dist.DTensor.from_local(engine.randn(3, 3), mesh1, { S(1) }):detach()
    st.requires_grad = true
    local y = engine.randn(3, 3)
    local cnt = counts(function() ((st * 3):to_local() + y):sum():backward() end)
    assert.same({}, cnt)
    assert.is_true(dist.is_dtensor(st.grad))
    assert.same({ S(1) }, st.grad.placements)
    assert.same({ 3 * W, 3 }, st.grad:shape())
    assert.equal(0, diff(st.grad:to_local(), engine.full({ 3, 3 }, 3)))
    -- A DTensor here is the tensor itself (st._c.dist ~= nil), so to_local() cannot return a stored
    -- Lua object: every call is a new plain view.  The strongest identity the engine offers is the
    -- same storage object at the same offset, shape and stride: writes through it are writes to st.
    local v1, v2 = engine.no_grad(function() return st:to_local(), st:to_local() end)
    assert.is_false(dist.is_dtensor(v1))
    assert.is_nil(v1.grad_fn)
    assert.is_false(v1.requires_grad)
    assert.is_true(v1._c.storage == st._c.storage)
    assert.is_true(v2._c.storage == v1._c.storage)
    assert.equal(st._c.offset, v1._c.offset)
    assert.same({ 3, 3 }, v1:shape())
    assert.same({ 3, 1 }, v1:stride())
    assert.equal(st:data_ptr(), v1:data_ptr())
    engine.no_grad(function() v1:fill_(7) end)
    assert.equal(0, diff(v2, engine.full({ 3, 3 }, 7)))
    assert.equal(0, diff(st:to_local(), engine.full({ 3, 3 }, 7)))
  end)

  it("C10 grad_placements Partial: 1 all_gather forward, 1 reduce_scatter backward; grad = W * ones", function()
    local st = dist.distribute_tensor(engine.ones(8, 3), mesh1, { S(1) }, { src_data_rank = false })
    st.requires_grad = true
    local cf, l = counts(function()
      return st:redistribute(nil, { Rep() }):to_local({ grad_placements = { Part() } })
    end)
    local cb = counts(function() l:backward(engine.ones(8, 3)) end)
    local g = st.grad
    local gfull = g:full_tensor()
    assert.same(c({ all_gather = 1 }) or {}, cf)
    assert.same(c({ reduce_scatter = 1 }) or {}, cb)
    assert.same({ S(1) }, g.placements)
    assert.equal(0, diff(gfull, engine.full({ 8, 3 }, W)))
    -- the same through full_tensor(grad_placements)
    local st2 = dist.distribute_tensor(engine.ones(8, 3), mesh1, { S(1) }, { src_data_rank = false })
    st2.requires_grad = true
    local cnt = counts(function() st2:full_tensor({ grad_placements = { Part() } }):sum():backward() end)
    local g2 = st2.grad:full_tensor()
    assert.same(c({ all_gather = 1, reduce_scatter = 1 }) or {}, cnt)
    assert.equal(0, diff(g2, engine.full({ 8, 3 }, W)))
  end)

  it("to_local grad_placements with another local shape is an error", function()
    local d = dist.DTensor.from_local(engine.ones(2, 3), mesh1, { S(1) })
    if W > 1 then
      assert.matches("grad_placements %[Replicate%(%)%] give local shards of shape %[" .. 2 * W .. ",3%], not the local shape %[2,3%]",
        errmsg(d.to_local, d, { grad_placements = { Rep() } }))
    end
    assert.matches("to_local: f32%[2,3%] is not a DTensor", errmsg(engine.ones(2, 3).to_local, engine.ones(2, 3)))
  end)

  it("C11 full_tensor of a Shard(1) DTensor is a plain tensor with the whole value", function()
    local d = dist.DTensor.from_local(engine.ones(2, 3), mesh1, { S(1) })
    local cnt, f = counts(d.full_tensor, d)
    assert.same(c({ all_gather = 1 }) or {}, cnt)
    assert.is_false(dist.is_dtensor(f))
    assert.equal(0, diff(f, engine.ones(2 * W, 3)))
  end)

  it("C12 async redistribute: pending until first use, then the right values", function()
    local d = dist.DTensor.from_local(engine.ones(4, 2), mesh1, { S(1) })
    local r = d:redistribute(nil, { Rep() }, { async_op = true })
    local pending_before = r:is_pending()
    local l = r:to_local()
    local pending_after = r:is_pending()
    local v = l:view(-1) + 1
    -- async Partial -> Replicate (in-place all_reduce) and Shard(2) -> Replicate (strided finish)
    local p = dist.DTensor.from_local(engine.full({ 3, 2 }, R + 1), mesh1, { Part() }):redistribute(nil, { Rep() }, { async_op = true })
    local s2 = dist.DTensor.from_local(engine.arange(6):view(3, 2):float() + 10 * R, mesh1, { S(2) })
      :redistribute(nil, { Rep() }, { async_op = true })
    local pl = p:to_local()
    local sl = s2:full_tensor()
    assert.equal(W > 1, pending_before)
    assert.is_false(pending_after)
    assert.same({ 8 * W }, v:shape())
    assert.equal(0, diff(v, engine.full({ 8 * W }, 2)))
    assert.equal(0, diff(pl, engine.full({ 3, 2 }, W * (W + 1) / 2)))
    for q = 0, W - 1 do
      assert.equal(0, diff(sl:narrow(2, 2 * q + 1, 2), engine.arange(6):view(3, 2):float() + 10 * q))
    end
  end)

  it("C12 (reference form) distribute ones(4,2) S(1), async redistribute, view(shape), to_local, view(-1) + 1", function()
    -- global (4, 2): the result has 8 elements on every rank count.  In this engine the async
    -- result is pending until its first use, and view() is a use: it completes the all_gather
    -- (PyTorch keeps view(shape) and to_local() asynchronous).
    local d = dist.distribute_tensor(engine.ones(4, 2), mesh1, { S(1) })
    local rows = dist.local_shard_size_and_offset(4, W, R)
    local lshape = d:to_local():shape()
    local cr, r = counts(d.redistribute, d, nil, { Rep() }, { async_op = true })
    local pending_before = r:is_pending()
    local cv, v = counts(r.view, r, r:shape())
    local pending_after_view, view_pending = r:is_pending(), v:is_pending()
    local out = v:to_local()
    local data = out:view(-1) + 1
    assert.same({ rows, 2 }, lshape)
    assert.same(c({ all_gather = 1 }) or {}, cr)
    assert.same({}, cv)
    assert.equal(W > 1, pending_before)
    assert.is_false(pending_after_view)
    assert.is_false(view_pending)
    assert.is_true(dist.is_dtensor(v))
    assert.same({ Rep() }, v.placements)
    assert.same({ 4, 2 }, v:shape())
    assert.is_false(dist.is_dtensor(out))
    assert.is_false(out:is_pending())
    assert.same({ 4, 2 }, out:shape())
    assert.is_false(dist.is_dtensor(data))
    assert.same({ 8 }, data:shape())
    assert.equal(0, diff(data, engine.full({ 8 }, 2)))
  end)

  it("C13 sub-mesh over ranks {0, 2}: members hold shards, others empty locals and no communication", function()
    need4()
    local sub = dist.init_device_mesh("cpu", { 2 }, nil, { ranks = { 0, 2 } })
    local member = R == 0 or R == 2
    local d = dist.DTensor.from_local(engine.ones(3, 4), sub, { S(1) })
    local cnt, r = counts(d.redistribute, d, nil, { Rep() })
    local z = dist.zeros({ 6, 4 }, { mesh = sub, placements = { S(1) } })
    local di = dist.distribute_tensor(engine.ones(6, 4), sub, { S(1) })
    assert.same({ 6, 4 }, d:shape())
    assert.same({ 6, 4 }, r:shape())
    if member then
      assert.equal(0, diff(d:to_local(), engine.ones(3, 4)))
      assert.equal(0, diff(r:to_local(), engine.ones(6, 4)))
      assert.same({ all_gather = 1 }, cnt)
      assert.same({ 3, 4 }, z:to_local():shape())
      assert.equal(0, diff(di:to_local(), engine.ones(3, 4)))
    else
      assert.equal(0, d:to_local():numel())
      assert.equal(0, r:to_local():numel())
      assert.same({}, cnt)
      assert.same({ 0, 0 }, z:to_local():shape())
      assert.equal(0, di:to_local():numel())
    end
  end)

  it("C13 (reference form) sub-mesh {0, 2}: + 2, sum(), redistribute of ones(4,3), split({2, 2}, 2)", function()
    need4()
    local sub = dist.init_device_mesh("cpu", { 2 }, nil, { ranks = { 0, 2 } })
    local member = R == 0 or R == 2
    local d = dist.DTensor.from_local(engine.ones(3, 4), sub, { S(1) })
    local ca, a = counts(function() return d + 2 end)
    local cs, s = counts(function() return d:sum() end)
    local e = dist.DTensor.from_local(engine.ones(4, 3), sub, { S(1) })
    local cr, r = counts(e.redistribute, e, nil, { Rep() })
    local cp, parts = counts(function() return d:split({ 2, 2 }, 2) end)
    assert.same({ 6, 4 }, d:shape())
    assert.same({}, ca)
    assert.same({ S(1) }, a.placements)
    assert.same({ 6, 4 }, a:shape())
    assert.same({}, cs)
    assert.same({ Part() }, s.placements)
    assert.same({}, s:shape())
    assert.equal(member and 12 or 0, s:to_local():item())
    assert.same({ 8, 3 }, e:shape())
    assert.same({ 8, 3 }, r:shape())
    assert.same({ Rep() }, r.placements)
    assert.same({}, cp)
    assert.equal(2, #parts)
    for i = 1, 2 do
      assert.is_true(dist.is_dtensor(parts[i]))
      assert.same({ S(1) }, parts[i].placements)
      assert.same({ 6, 2 }, parts[i]:shape())
    end
    if member then
      assert.equal(0, diff(d:to_local(), engine.ones(3, 4)))  -- + 2 did not change d
      assert.equal(0, diff(a:to_local(), engine.full({ 3, 4 }, 3)))
      assert.same({ all_gather = 1 }, cr)
      assert.equal(0, diff(r:to_local(), engine.ones(8, 3)))
      for i = 1, 2 do assert.equal(0, diff(parts[i]:to_local(), engine.ones(3, 2))) end
    else
      assert.equal(0, d:to_local():numel())
      assert.equal(0, a:to_local():numel())
      assert.same({}, cr)
      assert.equal(0, r:to_local():numel())
      for i = 1, 2 do assert.equal(0, parts[i]:to_local():numel()) end
    end
  end)

  it("DTensor properties, tostring and detach", function()
    local d = dist.DTensor.from_local(engine.ones(2, 3), mesh1, { S(2) })
    assert.equal(mesh1, d.device_mesh)
    assert.same({ S(2) }, d.placements)
    assert.is_nil(engine.ones(2).placements)
    assert.is_nil(engine.ones(2).device_mesh)
    assert.matches("^DTensor%(f32%[2," .. 3 * W .. "%] on mesh%(" .. W .. "%) %[Shard%(2%)%], local=tensor%(", tostring(d))
    assert.same({ 2, 3 * W }, d:size())
    assert.equal(3 * W, d:size(2))
    assert.equal(2, d:dim())
    local dd = d:detach()
    assert.is_true(dist.is_dtensor(dd))
    assert.same({ S(2) }, dd.placements)
    if mesh2 then
      local d2 = dist.DTensor.from_local(engine.ones(2, 3), mesh2, { S(1), Part("max") })
      assert.matches("^DTensor%(f32%[4,3%] on mesh%(2x2: dp,tp%) %[Shard%(1%), Partial%(max%)%]", tostring(d2))
      assert.equal(mesh2, d2.device_mesh)
    end
  end)

  it("backward of a Partial scalar DTensor uses a Replicate ones gradient", function()
    local x = engine.full({ 1 }, 2.0):requires_grad_()
    local d = dist.DTensor.from_local(x, mesh1, { Part() })
    d:backward()
    assert.equal(0, diff(x.grad, engine.ones(1)))
    local y = engine.ones(2, 2):requires_grad_()
    assert.matches("grad can be implicitly created only for one%-element outputs",
      errmsg(function() dist.DTensor.from_local(y, mesh1, { S(1) }):backward() end))
  end)
end)
