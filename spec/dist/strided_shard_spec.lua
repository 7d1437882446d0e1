-- _StridedShard (PyTorch's placement_types._StridedShard, pytorch-semantics A6): the placement object, the layout
-- math (checked against a reference that applies torch.chunk pieces left to right), distribute_tensor, from_local,
-- full_tensor, redistribute to and from it with exact collective counts, backward through redistribute, factories,
-- global norms, ops on such DTensors (pointwise, sum, matmul: same values as one process) and errors.
-- Runs with 1, 2 and 4 ranks (2x2 cases need 4); every rank issues the same collectives in the same order and
-- asserts afterwards.
local engine = require("engine")
local dist = engine.distributed
local optim = engine.optim
local util = require("spec.dist.helpers.util")
local diff, errmsg = util.diff, util.errmsg

local W = dist.world_size()
local S, Rep, Part, SS = dist.Shard, dist.Replicate, dist.Partial, dist._StridedShard

local function counts(fn, ...) return dist.count_collectives(fn, ...) end
-- expected counts: none on 1 rank (mesh dims of size 1 move nothing)
local function c(t) if W > 1 then return t end return {} end

local mesh1 = dist.init_device_mesh("cpu", { W })
local mesh2 = W == 4 and dist.init_device_mesh("cpu", { 2, 2 }, { "dp", "tp" }) or nil
local function need4() if not mesh2 then pending("needs 4 ranks (2x2 mesh)") end end

-- ------------------------------------------------------------------ reference layout
-- Rows (0-based) of a dim held at coordinate i when `rows` go through one placement on a mesh dim of size k:
-- torch.chunk into sf pieces, each piece torch.chunk'ed into k sub-pieces, sub-piece i of every piece (PyTorch's
-- right-to-left nested sharding; sf = 1: Shard).
local function chunk_of(n, k, i)
  local full = math.ceil(n / k)
  local off = math.min(i * full, n)
  return off, math.min(full, n - off)
end
local function split_rows(rows, k, i, sf)
  local out = {}
  for j = 0, sf - 1 do
    local poff, psz = chunk_of(#rows, sf, j)
    local off, sz = chunk_of(psz, k, i)
    for q = poff + off + 1, poff + off + sz do out[#out + 1] = rows[q] end
  end
  return out
end

-- Rows of tensor dim d (1-based, positive) of size n at 0-based coord, placements applied left to right.
local function ref_rows(n, mesh_shape, placements, coord, d)
  local rows = {}
  for q = 1, n do rows[q] = q - 1 end
  for m, p in ipairs(placements) do
    if p:is_shard(d) then rows = split_rows(rows, mesh_shape[m], coord[m], p.split_factor or 1) end
  end
  return rows
end

local function runs_to_rows(runs)
  local rows = {}
  for _, r in ipairs(runs) do for q = r[1], r[1] + r[2] - 1 do rows[#rows + 1] = q end end
  return rows
end

-- x restricted to the given 0-based rows of dim d (a copy).
local function take(x, d, rows)
  if #rows == 0 then return x:narrow(d, 1, 0):contiguous() end
  return x:index_select(d, engine.tensor(rows, "i64"))
end

-- This rank's shard of x under placements on mesh, from the reference (all dims).
local function ref_local(x, mesh, placements)
  local coord = mesh:get_coordinate()
  local ms = mesh:shape()
  local r = x
  for d = 1, x:dim() do r = take(r, d, ref_rows(x:size(d), ms, placements, coord, d)) end
  return r
end

local function values(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  return engine.arange(n):float():view(unpack(shape))
end

-- ------------------------------------------------------------------ placement objects
describe("_StridedShard placement object", function()
  it("constructors, fields, tostring, is_shard", function()
    local a, b = SS(1, { split_factor = 2 }), SS(1, 2)
    assert.equal("strided_shard", a.kind)
    assert.equal(1, a.dim)
    assert.equal(2, a.split_factor)
    assert.equal("_StridedShard(dim=1, sf=2)", tostring(a))
    assert.equal("_StridedShard(dim=-1, sf=4)", tostring(SS(-1, 4)))
    assert.is_true(a == b)
    -- PyTorch: a subclass of Shard, so is_shard() holds
    assert.is_true(a:is_shard())
    assert.is_true(a:is_shard(1))
    assert.is_false(a:is_shard(2))
    assert.is_true(a:is_strided_shard())
    assert.is_false(S(1):is_strided_shard())
    assert.is_false(a:is_replicate())
    assert.is_false(a:is_partial())
    assert.equal("[_StridedShard(dim=1, sf=2), Shard(1)]", dist.placements_describe({ a, S(1) }))
  end)

  it("== compares kind, dim and split_factor (PyTorch 2.5 ignored split_factor against Shard; not here)", function()
    assert.is_false(SS(1, 2) == S(1))
    assert.is_false(S(1) == SS(1, 2))
    assert.is_false(SS(1, 1) == S(1))
    assert.is_false(SS(1, 2) == SS(1, 4))
    assert.is_false(SS(1, 2) == SS(2, 2))
    assert.is_false(SS(1, 2) == Rep())
  end)

  it("errors: dim 0 (1-based dims), split_factor < 1, non-integers, missing split_factor, unknown option", function()
    assert.matches("_StridedShard: dim 0 is invalid: dims are 1%-based", errmsg(SS, 0, 2))
    assert.matches("_StridedShard: split_factor must be an integer >= 1, got 0", errmsg(SS, 1, 0))
    assert.matches("_StridedShard: split_factor must be an integer >= 1, got %-2", errmsg(SS, 1, { split_factor = -2 }))
    assert.matches("_StridedShard: split_factor must be an integer >= 1, got 1.5", errmsg(SS, 1, 1.5))
    assert.matches("_StridedShard: split_factor must be an integer >= 1, got two", errmsg(SS, 1, "two"))
    assert.matches("_StridedShard: split_factor is required", errmsg(SS, 1))
    assert.matches("_StridedShard: dim must be an integer, got x", errmsg(SS, "x", 2))
    assert.matches("_StridedShard: unknown option 'sf'", errmsg(SS, 1, { sf = 2 }))
  end)

  it("placement lists reject other types and C checks the dim against the tensor", function()
    assert.matches("placements%[1%] must be dist.Shard%(d%), dist.Replicate%(%), dist.Partial%(op%) or dist._StridedShard",
      errmsg(dist.distribute_tensor, engine.ones(4, 4), mesh1, { { kind = "strided_shard", dim = 1, split_factor = 2 } }))
    local e = errmsg(dist.distribute_tensor, engine.ones(4, 4), mesh1, { SS(3, 2) })
    assert.truthy(e:find("distribute_tensor: f32[4,4]: _StridedShard(dim=3, sf=2) (placement 1) is out of range for a 2-d tensor", 1, true), e)
    local e2 = errmsg(dist.DTensor.from_local, engine.ones(4), mesh1, { SS(-2, 2) })
    assert.truthy(e2:find("from_local: f32[4]: _StridedShard(dim=-2, sf=2) (placement 1) is out of range for a 1-d tensor", 1, true), e2)
    local e3 = errmsg(dist.DTensor.from_local, engine.ones(4):sum(), mesh1, { SS(1, 2) })
    assert.truthy(e3:find("cannot shard a 0-d tensor", 1, true), e3)
  end)
end)

-- ------------------------------------------------------------------ A6: pure layout math
describe("A6: _StridedShard layout (pure)", function()
  local function rows_at(shape, ms, pl, coord, d)
    return runs_to_rows(dist.local_shard_runs(shape, ms, pl, coord)[d])
  end

  it("8x8 rows on a 2x2 mesh: [S(1), S(1)] and [_StridedShard(1, sf=2), S(1)] (0-based rows)", function()
    local want_s = { { 0, 1 }, { 2, 3 }, { 4, 5 }, { 6, 7 } }
    local want_ss = { { 0, 1 }, { 4, 5 }, { 2, 3 }, { 6, 7 } }
    for r = 0, 3 do
      local coord = { math.floor(r / 2), r % 2 }
      assert.same(want_s[r + 1], rows_at({ 8, 8 }, { 2, 2 }, { S(1), S(1) }, coord, 1))
      assert.same(want_ss[r + 1], rows_at({ 8, 8 }, { 2, 2 }, { SS(1, { split_factor = 2 }), S(1) }, coord, 1))
      -- the other dim is whole
      assert.same({ { 0, 8 } }, dist.local_shard_runs({ 8, 8 }, { 2, 2 }, { SS(1, 2), S(1) }, coord)[2])
    end
  end)

  it("mesh (4,2), x (8,4): [_StridedShard(-2, sf=2), Shard(-2)] holds row 4j+i on (i,j), = dim 1 sharded on mesh dim 2 then 1", function()
    for i = 0, 3 do
      for j = 0, 1 do
        local runs = dist.local_shard_runs({ 8, 4 }, { 4, 2 }, { SS(-2, 2), S(-2) }, { i, j })
        assert.same({ { { 4 * j + i, 1 } }, { { 0, 4 } } }, runs)
        -- shard order (tensor dim 1 on mesh dims (2, 1)): [S(1), S(1)] on the mesh (2, 4) at (j, i)
        assert.same(dist.local_shard_runs({ 8, 4 }, { 2, 4 }, { S(1), S(1) }, { j, i }), runs)
        local ls, off = dist.compute_local_shape_and_global_offset({ 8, 4 }, { 4, 2 }, { SS(-2, 2), S(-2) }, { i, j })
        assert.same({ 1, 4 }, ls)
        assert.same({ 4 * j + i, 0 }, off)
      end
    end
  end)

  it("FSDP+TP layout: [_StridedShard(1, sf=k2), Shard(1)] with even sizes is one run per rank", function()
    for _, ms in ipairs({ { 2, 2 }, { 2, 3 }, { 3, 2 }, { 4, 2 } }) do
      local n = 2 * ms[1] * ms[2]
      for i = 0, ms[1] - 1 do
        for j = 0, ms[2] - 1 do
          local runs = dist.local_shard_runs({ n }, ms, { SS(1, ms[2]), S(1) }, { i, j })[1]
          assert.same({ { 2 * (j * ms[1] + i), 2 } }, runs)
        end
      end
    end
  end)

  it("uneven sizes: sf torch.chunk pieces, each over k (7 and 10 rows on 4, sf 2; PyTorch's uneven fix)", function()
    local function at(n, r) return rows_at({ n }, { 4 }, { SS(1, 2) }, { r }, 1) end
    -- 7 rows: pieces 0-3 and 4-6, each over 4 ranks: rank r holds r and 4+r (rank 3: 3 alone)
    assert.same({ 0, 4 }, at(7, 0))
    assert.same({ 2, 6 }, at(7, 2))
    assert.same({ 3 }, at(7, 3))
    -- 10 rows: pieces 0-4 and 5-9, each over 4 ranks as 2, 2, 1, 0 rows (the 2.5-era rule gave rank 0 0-1, 8-9)
    assert.same({ 0, 1, 5, 6 }, at(10, 0))
    assert.same({ 2, 3, 7, 8 }, at(10, 1))
    assert.same({ 4, 9 }, at(10, 2))
    assert.same({}, at(10, 3))
    assert.same({ { 0, 2 }, { 5, 2 } }, dist.local_shard_runs({ 10 }, { 4 }, { SS(1, 2) }, { 0 })[1])
    local ls, off = dist.compute_local_shape_and_global_offset({ 10 }, { 4 }, { SS(1, 2) }, { 0 })
    assert.same({ 4 }, ls)
    assert.same({ 0 }, off) -- the start of the first run
    -- a sub-piece empty in a piece and not in a later, shorter one: 7 rows, sf 2 (4 and 3 rows) over 3
    assert.same({ 6 }, rows_at({ 7 }, { 3 }, { SS(1, 2) }, { 2 }, 1))
    -- empty shards: 0 rows, 2 rows on 4 ranks with sf 3
    assert.same({}, dist.local_shard_runs({ 0 }, { 4 }, { SS(1, 2) }, { 1 })[1])
    assert.same({}, at(2, 2))
    -- 2 rows, sf 3: pieces of 1, 1 and 0 rows, each held by coordinate 0
    assert.same({ 0, 1 }, rows_at({ 2 }, { 4 }, { SS(1, 3) }, { 0 }, 1))
    assert.same({}, rows_at({ 2 }, { 4 }, { SS(1, 3) }, { 1 }, 1))
  end)

  it("FSDP+TP layout, uneven: [_StridedShard(1, sf=tp), Shard(1)] on (dp=2, tp) is dp-chunk i of TP shard j", function()
    for _, tpn in ipairs({ 2, 3, 4 }) do
      for n = 0, 23 do
        local ct = math.ceil(n / tpn)
        for j = 0, tpn - 1 do
          local sj = math.max(0, math.min(ct, n - j * ct))
          local cd = math.ceil(sj / 2)
          for i = 0, 1 do
            local want = {}
            local rows = math.max(0, math.min(cd, sj - i * cd))
            for q = 0, rows - 1 do want[#want + 1] = j * ct + i * cd + q end
            assert.same(want, rows_at({ n }, { 2, tpn }, { SS(1, tpn), S(1) }, { i, j }, 1),
              string.format("n %d tp %d (%d, %d)", n, tpn, i, j))
          end
        end
      end
    end
  end)

  it("every size 0..17, mesh dims of 1..4, sf 1..3, nested with Shard and _StridedShard: runs == reference", function()
    local layouts = {
      function(a, b) return { SS(1, a) } end,
      function(a, b) return { SS(1, a), S(1) } end,
      function(a, b) return { S(1), SS(1, a) } end,
      function(a, b) return { SS(1, a), SS(1, b) } end,
      function(a, b) return { SS(1, a), Rep() } end,
      function(a, b) return { Rep(), SS(1, b) } end,
    }
    local bad = {}
    for n = 0, 17 do
      for k1 = 1, 4 do
        for k2 = 1, 3 do
          for a = 1, 3 do
            for b = 1, 3 do
              for li, mk in ipairs(layouts) do
                local pl = mk(a, b)
                local ms = #pl == 1 and { k1 } or { k1, k2 }
                for i = 0, k1 - 1 do
                  for j = 0, (#pl == 1 and 0 or k2 - 1) do
                    local coord = #pl == 1 and { i } or { i, j }
                    local got = runs_to_rows(dist.local_shard_runs({ n }, ms, pl, coord)[1])
                    local want = ref_rows(n, ms, pl, coord, 1)
                    local ls = dist.compute_local_shape_and_global_offset({ n }, ms, pl, coord)
                    if not (#got == #want and ls[1] == #want) then bad[#bad + 1] = { n, li, a, b, i, j } end
                    for q = 1, #want do if got[q] ~= want[q] then bad[#bad + 1] = { n, li, a, b, i, j }; break end end
                  end
                end
              end
            end
          end
        end
      end
    end
    assert.same({}, bad)
  end)

  it("redistribute plans: changes involving _StridedShard go through Replicate on that mesh dim", function()
    local function plan_str(src, dst, shape, ms, coord)
      local steps = dist.redistribute_plan(src, dst, shape, ms, coord)
      local parts = {}
      for i, s in ipairs(steps) do parts[i] = string.format("(%d,%s->%s)", s.mesh_dim, tostring(s.src), tostring(s.dst)) end
      return table.concat(parts, " ")
    end
    assert.equal("(1,_StridedShard(dim=1, sf=2)->Replicate())", plan_str({ SS(1, 2) }, { Rep() }, { 8 }, { 4 }, { 1 }))
    assert.equal("(1,Replicate()->_StridedShard(dim=1, sf=2))", plan_str({ Rep() }, { SS(1, 2) }, { 8 }, { 4 }, { 1 }))
    assert.equal("(1,Shard(1)->Replicate()) (1,Replicate()->_StridedShard(dim=1, sf=2))",
      plan_str({ S(1) }, { SS(1, 2) }, { 8 }, { 4 }, { 1 }))
    assert.equal("(1,_StridedShard(dim=1, sf=2)->Replicate()) (1,Replicate()->_StridedShard(dim=2, sf=3))",
      plan_str({ SS(1, 2) }, { SS(2, 3) }, { 8, 6 }, { 4 }, { 1 }))
    assert.equal("(1,Partial(sum)->Replicate()) (1,Replicate()->_StridedShard(dim=1, sf=2))",
      plan_str({ Part() }, { SS(1, 2) }, { 8 }, { 4 }, { 1 }))
    -- 2x2: gathers inner to outer, re-shards outer to inner
    assert.equal("(2,Shard(1)->Replicate()) (1,_StridedShard(dim=1, sf=2)->Replicate()) (1,Replicate()->Shard(1)) "
      .. "(2,Replicate()->Shard(1))", plan_str({ SS(1, 2), S(1) }, { S(1), S(1) }, { 8, 8 }, { 2, 2 }, { 0, 1 }))
    assert.equal("(2,Shard(1)->Replicate()) (1,_StridedShard(dim=1, sf=2)->Replicate())",
      plan_str({ SS(1, 2), S(1) }, { Rep(), Rep() }, { 8, 8 }, { 2, 2 }, { 1, 1 }))
    -- an outer _StridedShard kept: the inner Shard of another dim changes alone
    assert.equal("(2,Shard(2)->Replicate())", plan_str({ SS(1, 2), S(2) }, { SS(1, 2), Rep() }, { 8, 8 }, { 2, 2 }, { 0, 0 }))
    -- split factors differ: misaligned, through Replicate
    assert.equal("(2,Shard(1)->Replicate()) (1,_StridedShard(dim=1, sf=2)->Replicate()) "
      .. "(1,Replicate()->_StridedShard(dim=1, sf=4)) (2,Replicate()->Shard(1))",
      plan_str({ SS(1, 2), S(1) }, { SS(1, 4), S(1) }, { 8, 8 }, { 2, 2 }, { 0, 0 }))
    -- logical shapes: the inner mesh dim gathers the outer _StridedShard's local size (10 rows, sf 2: 6 or 4)
    local st = dist.redistribute_plan({ SS(1, 2), S(1) }, { Rep(), Rep() }, { 10, 3 }, { 2, 2 }, { 0, 0 })
    assert.same({ 6, 3 }, st[1].logical_shape)
    local st1 = dist.redistribute_plan({ SS(1, 2), S(1) }, { Rep(), Rep() }, { 10, 3 }, { 2, 2 }, { 1, 0 })
    assert.same({ 4, 3 }, st1[1].logical_shape)
  end)
end)

-- ------------------------------------------------------------------ creation
local SHAPES1 = { { { 8, 8 }, 1, 2 }, { { 7, 3 }, 1, 2 }, { { 10, 3 }, 1, 2 }, { { 13, 2 }, 1, 3 }, { { 3, 10 }, 2, 2 },
  { { 3, 5 }, 2, 3 }, { { 2, 3 }, 1, 2 }, { { 0, 3 }, 1, 2 } }

describe("distribute_tensor / from_local / full_tensor", function()
  it("1-d mesh: scatter (1 scatter), local == reference, full_tensor == x (1 all_gather); src_data_rank=false: 0 comm", function()
    local res = {}
    for i, case in ipairs(SHAPES1) do
      local shape, d, sf = case[1], case[2], case[3]
      local x = values(shape)
      local pl = { SS(d, sf) }
      local c1, dt = counts(dist.distribute_tensor, x, mesh1, pl)
      local c2, loc = counts(dist.distribute_tensor, x, mesh1, pl, { src_data_rank = false })
      local c3, full = counts(dt.full_tensor, dt)
      res[i] = { c1, c2, c3, dt, loc, full, x, pl, shape }
    end
    for _, r in ipairs(res) do
      local moves = r[9][1] * r[9][2] > 0
      assert.same(c(moves and { scatter = 1 } or {}), r[1])
      assert.same({}, r[2])
      assert.same(c(moves and { all_gather = 1 } or {}), r[3])
      assert.same(r[9], r[4]:shape())
      assert.same(r[8], r[4].placements)
      assert.equal(0, diff(r[4]:to_local(), ref_local(r[7], mesh1, r[8])))
      assert.equal(0, diff(r[5]:to_local(), r[4]:to_local()))
      assert.equal(0, diff(r[6], r[7]))
    end
  end)

  it("src_data_rank = 1 scatters rank 1's data", function()
    if W < 2 then pending("needs 2 ranks") return end
    local x = values({ 9, 2 }) + dist.rank() * 100
    local dt = dist.distribute_tensor(x, mesh1, { SS(1, 2) }, { src_data_rank = 1 })
    local full = dt:full_tensor()
    assert.equal(0, diff(full, values({ 9, 2 }) + 100))
  end)

  it("2x2 mesh: A6 rows per rank, nested layouts, full_tensor == x with 2 all_gathers", function()
    need4()
    local layouts = { { SS(1, 2), S(1) }, { S(1), SS(1, 2) }, { SS(1, 2), SS(2, 3) }, { SS(2, 2), S(1) },
      { Rep(), SS(1, 3) }, { SS(1, 3), SS(1, 2) } }
    local shapes = { { 8, 8 }, { 10, 7 }, { 7, 13 } }
    local res = {}
    for _, pl in ipairs(layouts) do
      for _, sh in ipairs(shapes) do
        local x = values(sh)
        local c1, dt = counts(dist.distribute_tensor, x, mesh2, pl)
        local c2, full = counts(dt.full_tensor, dt)
        local loc = dist.distribute_tensor(x, mesh2, pl, { src_data_rank = false })
        res[#res + 1] = { c1, c2, dt, full, x, pl, loc }
      end
    end
    -- A6 exactly: rank -> rows r0 0-1, r1 4-5, r2 2-3, r3 6-7 (0-based)
    local a6 = dist.distribute_tensor(values({ 8, 8 }), mesh2, { SS(1, { split_factor = 2 }), S(1) })
    local s6 = dist.distribute_tensor(values({ 8, 8 }), mesh2, { S(1), S(1) })
    local want = { [0] = { 0, 1 }, { 4, 5 }, { 2, 3 }, { 6, 7 } }
    local want_s = { [0] = { 0, 1 }, { 2, 3 }, { 4, 5 }, { 6, 7 } }
    for _, r in ipairs(res) do
      local n_sh, n_rep = 0, 0
      for _, p in ipairs(r[6]) do if p:is_shard() then n_sh = n_sh + 1 else n_rep = n_rep + 1 end end
      assert.same({ scatter = n_sh, broadcast = n_rep > 0 and n_rep or nil }, r[1])
      assert.same({ all_gather = n_sh }, r[2])
      assert.equal(0, diff(r[3]:to_local(), ref_local(r[5], mesh2, r[6])))
      assert.equal(0, diff(r[7]:to_local(), r[3]:to_local()))
      assert.equal(0, diff(r[4], r[5]))
    end
    assert.equal(0, diff(a6:to_local(), take(values({ 8, 8 }), 1, want[dist.rank()])))
    assert.equal(0, diff(s6:to_local(), take(values({ 8, 8 }), 1, want_s[dist.rank()])))
  end)

  it("from_local: global size = local size * k on the _StridedShard dim; shape/stride for uneven; full_tensor", function()
    local x = values({ 4 * W, 3 })
    local loc = ref_local(x, mesh1, { SS(1, 2) })
    local d = dist.DTensor.from_local(loc, mesh1, { SS(1, 2) })
    assert.same({ 4 * W, 3 }, d:shape())
    assert.same({ SS(1, 2) }, d.placements)
    local y = values({ 2 * W + 1, 3 })
    local yl = ref_local(y, mesh1, { SS(1, 2) })
    local e = dist.DTensor.from_local(yl, mesh1, { SS(1, 2) }, { shape = { 2 * W + 1, 3 }, stride = { 3, 1 } })
    local cf, fx = counts(d.full_tensor, d)
    local fy = e:full_tensor()
    -- a local that does not match this rank's shard of the given global shape names the layout
    local msg = errmsg(dist.DTensor.from_local, engine.ones(W + 5, 3), mesh1, { SS(1, 2) }, { shape = { 2, 3 }, stride = { 3, 1 } })
    assert.same(c({ all_gather = 1 }), cf)
    assert.equal(0, diff(fx, x))
    assert.equal(0, diff(fy, y))
    assert.truthy(msg:find("[_StridedShard(dim=1, sf=2)]", 1, true), msg)
    assert.truthy(msg:find("from_local", 1, true), msg)
  end)

  it("tostring of a DTensor shows the placement", function()
    local d = dist.distribute_tensor(values({ 4, 2 }), mesh1, { SS(1, 2) })
    assert.truthy(tostring(d):find("on mesh(" .. W .. ") [_StridedShard(dim=1, sf=2)]", 1, true), tostring(d))
  end)
end)

-- ------------------------------------------------------------------ redistribute
describe("redistribute to and from _StridedShard", function()
  it("1-d mesh round trips S <-> SS <-> R <-> SS': exact counts, locals == reference, full == x", function()
    local chains = {
      { S(1), SS(1, 2), S(1) },
      { SS(1, 2), Rep(), SS(1, 2) },
      { Rep(), SS(1, 3), SS(1, 2), Rep() },
      { SS(1, 2), SS(2, 2), S(2), SS(1, 3) },
    }
    local res = {}
    for ci, chain in ipairs(chains) do
      for si, sh in ipairs({ { 8, 8 }, { 10, 7 }, { 13, 5 } }) do
        local x = values(sh)
        local d = dist.distribute_tensor(x, mesh1, { chain[1] })
        for k = 2, #chain do
          local cnt, r = counts(d.redistribute, d, nil, { chain[k] })
          res[#res + 1] = { cnt, r, x, chain[k - 1], chain[k] }
          d = r
        end
      end
    end
    for _, r in ipairs(res) do
      local want = {}
      if r[4] ~= r[5] and not r[4]:is_replicate() then want = { all_gather = 1 } end
      assert.same(c(want), r[1], tostring(r[4]) .. " -> " .. tostring(r[5]))
      assert.same({ r[5] }, r[2].placements)
      assert.equal(0, diff(r[2]:to_local(), ref_local(r[3], mesh1, { r[5] })))
    end
  end)

  it("Partial -> _StridedShard: 1 all_reduce then local chunks; _StridedShard -> Partial is an error", function()
    local p = dist.DTensor.from_local(values({ 9, 2 }), mesh1, { Part() })
    local cnt, r = counts(p.redistribute, p, nil, { SS(1, 2) })
    local ss = dist.distribute_tensor(values({ 9, 2 }), mesh1, { SS(1, 2) })
    local e1 = errmsg(ss.redistribute, ss, nil, { Part() })
    local e2 = errmsg(dist._redistribute_internal, ss, { Part() })
    assert.same(c({ all_reduce = 1 }), cnt)
    assert.equal(0, diff(r:to_local(), ref_local(values({ 9, 2 }) * W, mesh1, { SS(1, 2) })))
    assert.truthy(e1:find("Can not redistribute from _StridedShard(dim=1, sf=2) to Partial(sum)", 1, true), e1)
    assert.truthy(e2:find("redistribute from _StridedShard(dim=1, sf=2) to Partial is not supported", 1, true), e2)
    assert.truthy(e2:find("f32[9,2] on mesh(" .. W .. ") [_StridedShard(dim=1, sf=2)]", 1, true), e2)
  end)

  it("2x2 round trips: [S,S] <-> [SS,S] <-> [R,R], [SS,S] -> [S,SS], counts == planned collectives", function()
    need4()
    local chains = {
      { { S(1), S(1) }, { SS(1, 2), S(1) }, { S(1), S(1) } },
      { { SS(1, 2), S(1) }, { Rep(), Rep() }, { SS(1, 2), S(1) } },
      { { SS(1, 2), S(1) }, { S(1), SS(1, 2) }, { SS(2, 2), S(1) }, { Rep(), SS(1, 3) } },
      { { SS(1, 2), S(2) }, { SS(1, 2), Rep() }, { SS(1, 2), S(1) }, { S(2), SS(1, 2) } },
    }
    local res, total_of = {}, {}
    for _, chain in ipairs(chains) do
      for _, sh in ipairs({ { 8, 8 }, { 10, 7 } }) do
        local x = values(sh)
        local d = dist.distribute_tensor(x, mesh2, chain[1])
        for k = 2, #chain do
          local steps = dist.redistribute_plan(chain[k - 1], chain[k], sh, mesh2)
          local n = 0
          for _, s in ipairs(steps) do
            if s.src ~= s.dst and not s.src:is_replicate() and not (s.src:is_partial() and s.dst:is_partial()) then n = n + 1 end
          end
          local cnt, r = counts(d.redistribute, d, nil, chain[k])
          local total = 0
          for _, v in pairs(cnt) do total = total + v end
          res[#res + 1] = { total, n, r, x, chain[k], cnt }
          total_of[dist.placements_describe(chain[k - 1]) .. " -> " .. dist.placements_describe(chain[k])] = total
          d = r
        end
      end
    end
    local f = res[#res][3]:full_tensor()
    for _, r in ipairs(res) do
      assert.equal(r[2], r[1])
      assert.is_nil(r[6].all_to_all) -- a _StridedShard change is an all_gather (then local), never an all_to_all
      assert.equal(0, diff(r[3]:to_local(), ref_local(r[4], mesh2, r[5])))
    end
    assert.equal(0, diff(f, res[#res][4]))
    -- the exact counts of a few
    local function n_of(a, b) return total_of[dist.placements_describe(a) .. " -> " .. dist.placements_describe(b)] end
    assert.equal(2, n_of({ S(1), S(1) }, { SS(1, 2), S(1) })) -- gather both mesh dims, re-shard locally
    assert.equal(2, n_of({ SS(1, 2), S(1) }, { S(1), S(1) }))
    assert.equal(2, n_of({ SS(1, 2), S(1) }, { Rep(), Rep() }))
    assert.equal(0, n_of({ Rep(), Rep() }, { SS(1, 2), S(1) }))
    assert.equal(1, n_of({ SS(1, 2), S(2) }, { SS(1, 2), Rep() })) -- the outer _StridedShard stays
    assert.equal(0, n_of({ SS(1, 2), Rep() }, { SS(1, 2), S(1) }))
  end)

  it("backward: SS->R 0 comm (grad SS), R->SS 1 all_gather, S->SS 1 all_gather; gradient values in place", function()
    local x = values({ 10, 3 })
    local w = values({ 10, 3 }) * 0.5 + 1
    local res = {}
    for _, case in ipairs({ { SS(1, 2), Rep(), {} }, { Rep(), SS(1, 2), { all_gather = 1 } },
      { S(1), SS(1, 3), { all_gather = 1 } }, { SS(1, 2), S(1), { all_gather = 1 } } }) do
      local st = dist.distribute_tensor(x, mesh1, { case[1] })
      st.requires_grad = true
      local r = st:redistribute(nil, { case[2] })
      local g = dist.distribute_tensor(w, mesh1, { case[2] })
      local cb = counts(function() r:backward(g) end)
      local gfull = st.grad:full_tensor()
      res[#res + 1] = { cb, st, gfull, case }
    end
    for _, r in ipairs(res) do
      assert.same(c(r[4][3]), r[1], tostring(r[4][1]) .. " -> " .. tostring(r[4][2]))
      assert.same({ r[4][1] }, r[2].grad.placements)
      assert.equal(0, diff(r[3], w))
      assert.equal(0, diff(r[2].grad:to_local(), ref_local(w, mesh1, { r[4][1] })))
    end
  end)

  it("backward on a 2x2 mesh through [SS,S] -> [R,R] and through an op", function()
    need4()
    local x = values({ 8, 6 }) * 0.1
    local st = dist.distribute_tensor(x, mesh2, { SS(1, 2), S(1) })
    st.requires_grad = true
    local loss = (st:redistribute(nil, { Rep(), Rep() }) * 3):sum()
    local cb = counts(function() loss:backward() end)
    local g = st.grad:full_tensor()
    local st2 = dist.distribute_tensor(x, mesh2, { SS(1, 2), S(2) })
    st2.requires_grad = true
    local y = (st2 * st2):sum()
    y:backward()
    local g2 = st2.grad:full_tensor()
    local y_full = y:full_tensor()
    assert.same({}, cb) -- R -> SS local
    assert.same({ SS(1, 2), S(1) }, st.grad.placements)
    assert.equal(0, diff(g, engine.full({ 8, 6 }, 3)))
    assert.same({ SS(1, 2), S(2) }, st2.grad.placements)
    assert.is_true(diff(g2, x * 2) < 1e-6)
    assert.is_true(math.abs(y_full:item() - (x * x):sum():item()) < 1e-3)
  end)
end)

-- ------------------------------------------------------------------ factories, norms
describe("factories and norms with _StridedShard", function()
  it("zeros/ones/full allocate the local shard; rand/randn full_tensor == one process and == the Shard layout", function()
    local pl = { SS(1, 2) }
    local z = dist.zeros({ 10, 3 }, { mesh = mesh1, placements = pl })
    local o = dist.full({ 10, 3 }, 2.5, { mesh = mesh1, placements = pl })
    engine.manual_seed(11)
    local a = dist.rand({ 10, 6 }, { mesh = mesh1, placements = { SS(1, 2) } })
    engine.manual_seed(11)
    local b = dist.rand({ 10, 6 }, { mesh = mesh1, placements = { S(1) } })
    engine.manual_seed(11)
    local want = engine.rand(10, 6)
    engine.manual_seed(12)
    local an = dist.randn({ 5, 11 }, { mesh = mesh1, placements = { SS(2, 3) } })
    local next_a = engine.rand(3)
    engine.manual_seed(12)
    local wantn = engine.randn(5, 11)
    local next_b = engine.rand(3)
    local fa, fb, fn = a:full_tensor(), b:full_tensor(), an:full_tensor()
    local rows = ref_rows(10, { W }, pl, mesh1:get_coordinate(), 1)
    assert.same({ #rows, 3 }, z:to_local():shape())
    assert.equal(0, diff(o:to_local(), engine.full({ #rows, 3 }, 2.5)))
    assert.equal(0, diff(fa, want))
    assert.equal(0, diff(fb, want))
    assert.equal(0, diff(fn, wantn))
    assert.equal(0, diff(next_a, next_b)) -- the generator advanced by the global numel
  end)

  it("2x2 mesh: rand over nested _StridedShard layouts == one process; uniform_ on a _StridedShard DTensor too", function()
    need4()
    local res = {}
    for i, pl in ipairs({ { SS(1, 2), S(1) }, { SS(1, 3), SS(2, 2) }, { S(2), SS(1, 2) } }) do
      engine.manual_seed(30 + i)
      local a = dist.randn({ 9, 7 }, { mesh = mesh2, placements = pl })
      engine.manual_seed(30 + i)
      local want = engine.randn(9, 7)
      local e = dist.zeros({ 9, 7 }, { mesh = mesh2, placements = pl })
      engine.manual_seed(40 + i)
      e:uniform_(-1, 1)
      engine.manual_seed(40 + i)
      local want_u = engine.empty(9, 7):uniform_(-1, 1)
      res[i] = { a:full_tensor(), want, e:full_tensor(), want_u }
    end
    for _, r in ipairs(res) do
      assert.equal(0, diff(r[1], r[2]))
      assert.equal(0, diff(r[3], r[4]))
    end
  end)

  it("global_norm / clip_grad_norm_ combine _StridedShard locals over their mesh dim", function()
    local x = values({ 10, 3 }) * 0.01
    local d = dist.distribute_tensor(x, mesh1, { SS(1, 2) })
    local n1 = optim.global_norm({ d })
    local n2 = optim.global_norm({ x })
    local ninf = optim.global_norm({ d }, math.huge)
    assert.is_true(math.abs(n1 - n2) < 1e-5 * n2)
    assert.is_true(math.abs(ninf - x:abs():max():item()) < 1e-6)
  end)
end)

-- ------------------------------------------------------------------ ops
describe("ops on _StridedShard DTensors (replicated first; same values as one process)", function()
  it("pointwise, sum and matmul on a 1-d mesh; results never keep a _StridedShard", function()
    local xa = values({ 10, 4 }) * 0.1
    local xb = values({ 10, 4 }) * -0.05 + 1
    local wm = values({ 4, 3 }) * 0.2
    local a = dist.distribute_tensor(xa, mesh1, { SS(1, 2) })
    local b = dist.distribute_tensor(xb, mesh1, { S(1) })
    local m = dist.distribute_tensor(wm, mesh1, { SS(2, 2) })
    local c1, add = counts(function() return a + b end)
    local c2, sc = counts(function() return (a * 2):exp() end)
    local c3, s_all = counts(function() return a:sum() end)
    local s_dim = a:sum(1)
    local mm = engine.matmul(a, m)
    local same = a + a
    local res = { add:full_tensor(), sc:full_tensor(), s_all:full_tensor(), s_dim:full_tensor(), mm:full_tensor(),
      same:full_tensor() }
    assert.same(c({ all_gather = 1 }), c1)
    assert.same(c({ all_gather = 1 }), c2)
    assert.same(c({ all_gather = 1 }), c3)
    for _, t in ipairs({ add, sc, s_all, s_dim, mm, same }) do
      for _, p in ipairs(t.placements) do assert.is_false(p:is_strided_shard()) end
    end
    assert.is_true(diff(res[1], xa + xb) < 1e-6)
    assert.is_true(diff(res[2], (xa * 2):exp()) < 1e-4)
    assert.is_true(diff(res[3], xa:sum()) < 1e-3)
    assert.is_true(diff(res[4], xa:sum(1)) < 1e-4)
    assert.is_true(diff(res[5], engine.matmul(xa, wm)) < 1e-4)
    assert.is_true(diff(res[6], xa * 2) < 1e-6)
  end)

  it("gradients of an op on a _StridedShard leaf come back _StridedShard, equal to one process", function()
    local x = values({ 9, 4 }) * 0.1
    local w = values({ 4, 2 }) * 0.3 - 0.5
    local a = dist.distribute_tensor(x, mesh1, { SS(1, 2) })
    a.requires_grad = true
    local wd = dist.distribute_tensor(w, mesh1, { Rep() })
    wd.requires_grad = true
    local loss = (engine.matmul(a, wd):tanh() * 2):sum()
    loss:backward()
    local ga, gw = a.grad:full_tensor(), wd.grad:full_tensor()
    local xr, wr = x:clone():requires_grad_(), w:clone():requires_grad_()
    local lr = (engine.matmul(xr, wr):tanh() * 2):sum()
    lr:backward()
    assert.same({ SS(1, 2) }, a.grad.placements)
    assert.is_true(diff(ga, xr.grad) < 1e-5)
    assert.is_true(diff(gw, wr.grad) < 1e-4)
    assert.is_true(math.abs(loss:full_tensor():item() - lr:item()) < 1e-4)
  end)

  it("2x2 mesh: pointwise, sum over dims, matmul, view and split on [SS, S] layouts == one process", function()
    need4()
    local xa = values({ 8, 6 }) * 0.1
    local xw = values({ 6, 4 }) * 0.05
    local a = dist.distribute_tensor(xa, mesh2, { SS(1, 2), S(1) })
    local a2 = dist.distribute_tensor(xa, mesh2, { S(2), SS(1, 3) })
    local w = dist.distribute_tensor(xw, mesh2, { SS(2, 2), Rep() })
    local r = {
      (a + a2):full_tensor(), (a * a2):sum(2):full_tensor(), a:sum():full_tensor(),
      engine.matmul(a, w):full_tensor(), a:view(4, 12):full_tensor(), a2:sum(1):full_tensor(),
    }
    local parts = a:split(3, 2)
    local p1, p2 = parts[1]:full_tensor(), parts[2]:full_tensor()
    assert.is_true(diff(r[1], xa * 2) < 1e-6)
    assert.is_true(diff(r[2], (xa * xa):sum(2)) < 1e-4)
    assert.is_true(diff(r[3], xa:sum()) < 1e-3)
    assert.is_true(diff(r[4], engine.matmul(xa, xw)) < 1e-4)
    assert.is_true(diff(r[5], xa:view(4, 12)) < 1e-6)
    assert.is_true(diff(r[6], xa:sum(1)) < 1e-4)
    assert.equal(0, diff(p1, xa:narrow(2, 1, 3)))
    assert.equal(0, diff(p2, xa:narrow(2, 4, 3)))
  end)

  it("op errors name the op and the layouts, before any communication", function()
    local a = dist.distribute_tensor(engine.ones(10, 4), mesh1, { SS(1, 2) })
    local b = dist.distribute_tensor(engine.ones(3), mesh1, { Rep() })
    local cnt, e1, e2 = counts(function()
      return errmsg(function() return a + b end), errmsg(function() return engine.matmul(a, a) end)
    end)
    local lay = "DTensor(f32[10,4] on mesh(" .. W .. ") [_StridedShard(dim=1, sf=2)])"
    assert.same({}, cnt)
    assert.truthy(e1:find("add: (" .. lay .. ", DTensor(f32[3] on mesh(" .. W .. ") [Replicate()])): shapes [10,4] and [3] "
      .. "cannot be broadcast together", 1, true), e1)
    assert.truthy(e2:find("matmul: (" .. lay .. ", " .. lay .. "): shapes [10,4] and [10,4] cannot be multiplied", 1, true), e2)
    local e3 = errmsg(function() return a + engine.ones(4) end)
    assert.truthy(e3:find("add: mixed DTensor and Tensor arguments: " .. lay, 1, true), e3)
  end)

  it("redistribute_cost: from a _StridedShard costs an all_gather; to Partial is impossible", function()
    local a = dist.distribute_tensor(engine.ones(8, 4), mesh1, { SS(1, 2) })
    local s = dist.distribute_tensor(engine.ones(8, 4), mesh1, { S(1) })
    local r = dist.distribute_tensor(engine.ones(8, 4), mesh1, { Rep() })
    assert.equal(0, a:redistribute_cost({ SS(1, 2) }))
    assert.equal(s:redistribute_cost({ Rep() }), a:redistribute_cost({ Rep() }))
    assert.equal(s:redistribute_cost({ Rep() }), a:redistribute_cost({ S(1) }))
    assert.equal(s:redistribute_cost({ Rep() }), s:redistribute_cost({ SS(1, 2) }))
    assert.equal(r:redistribute_cost({ S(1) }), r:redistribute_cost({ SS(1, 2) }))
    assert.equal(math.huge, a:redistribute_cost({ Part() }))
  end)

  it("async_op: a _StridedShard -> Replicate result is complete when returned", function()
    local x = values({ 10, 3 })
    local a = dist.distribute_tensor(x, mesh1, { SS(1, 2) })
    local cnt, r = counts(a.redistribute, a, nil, { Rep() }, { async_op = true })
    local pending_now = r:is_pending()
    assert.same(c({ all_gather = 1 }), cnt)
    assert.is_false(pending_now)
    assert.equal(0, diff(r:to_local(), x))
  end)

  it("in-place ops on a _StridedShard target keep its layout", function()
    local x = values({ 10, 3 })
    local a = dist.distribute_tensor(x, mesh1, { SS(1, 2) })
    local b = dist.distribute_tensor(x * 2, mesh1, { S(1) })
    local cnt = counts(function() a:add_(b) end)
    local f = a:full_tensor()
    assert.same(c({ all_gather = 1 }), cnt)
    assert.same({ SS(1, 2) }, a.placements)
    assert.equal(0, diff(f, x * 3))
  end)
end)
