-- redistribute: the greedy plan (A7, pytorch-semantics 2.2), every transition
-- with exact collective counts (group D), backward rules (2.5), uneven sizes
-- (13 and 14 on 4 ranks) and the layout-equivalence property on a 1-d mesh of
-- all ranks and on a 2x2 mesh.  Runs with 1, 2 and 4 ranks; every rank issues
-- the same collectives in the same order and asserts afterwards.
local engine = require("engine")
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local diff, errmsg = util.diff, util.errmsg

local R, W = dist.rank(), dist.world_size()
local S, Rep, Part = dist.Shard, dist.Replicate, dist.Partial
local describe_pl = dist.placements_describe

local function counts(fn, ...) return dist.count_collectives(fn, ...) end
local function c(t) if W > 1 then return t end return {} end
local function chunk_of(t, d, k, r)
  local size, off = dist.local_shard_size_and_offset(t:size(d), k, r)
  return t:narrow(d, off + 1, size)
end
local function leaf(x, mesh, pl)
  local d = dist.distribute_tensor(x, mesh, pl, { src_data_rank = false })
  d.requires_grad = true
  return d
end

local mesh1 = dist.init_device_mesh("cpu", { W })
local mesh2 = W == 4 and dist.init_device_mesh("cpu", { 2, 2 }, { "dp", "tp" }) or nil
local function need4() if not mesh2 then pending("needs 4 ranks (2x2 mesh)") end end

-- ------------------------------------------------------------------ A7: the plan
local function plan_str(steps)
  local parts = {}
  for i, s in ipairs(steps) do
    parts[i] = string.format("(%d,%s->%s)", s.mesh_dim, tostring(s.src), tostring(s.dst))
  end
  return table.concat(parts, " ")
end
local function n_collectives(steps)
  local n = 0
  for _, s in ipairs(steps) do
    if not (s.src:is_replicate() and (s.dst:is_shard() or s.dst:is_partial())) and s.src ~= s.dst then n = n + 1 end
  end
  return n
end

describe("A7: greedy redistribute plan (pure)", function()
  local function plan(src, dst, shape, ms, coord)
    return dist.redistribute_plan(src, dst, shape or { 8, 8, 8 }, ms or { 2, 2 }, coord or { 0, 0 })
  end

  it("2x2 examples of pytorch-semantics 2.2 (mesh dims 1-based)", function()
    assert.equal("(2,Shard(1)->Replicate()) (1,Shard(1)->Replicate()) (2,Replicate()->Shard(1))",
      plan_str(plan({ S(1), S(1) }, { Rep(), S(1) })))
    assert.equal("(2,Shard(2)->Replicate()) (1,Shard(1)->Shard(2)) (2,Replicate()->Shard(1))",
      plan_str(plan({ S(1), S(2) }, { S(2), S(1) })))
    assert.equal("(2,Shard(2)->Shard(1))", plan_str(plan({ S(1), S(2) }, { S(1), S(1) })))
    assert.equal(2, n_collectives(plan({ S(1), S(1) }, { S(2), S(2) })))
    assert.equal(2, n_collectives(plan({ S(1), S(3) }, { S(2), S(1) })))
    assert.equal(1, n_collectives(plan({ S(2), S(2) }, { S(2), S(3) })))
    assert.same({}, plan({ S(1), Rep() }, { S(1), Rep() }))
  end)

  it("2x2x2 examples (collective counts of test_redistribute_shard_dim_multi_dim_mesh)", function()
    local m = { 2, 2, 2 }
    local function n(src, dst) return n_collectives(plan(src, dst, { 8, 8, 8 }, m, { 0, 1, 1 })) end
    assert.equal(3, n({ S(1), S(1), S(1) }, { S(2), S(2), S(2) }))
    assert.equal(3, n({ S(1), S(2), S(1) }, { S(2), S(1), S(1) }))
    assert.equal(2, n({ S(1), S(2), S(3) }, { S(3), S(2), S(1) }))
    assert.equal(1, n({ S(2), S(1), S(1) }, { Rep(), S(1), S(1) }))
    assert.equal(2, n({ S(2), Rep(), S(1) }, { Rep(), S(1), S(1) }))
    assert.equal(2, n({ S(1), S(1), S(2) }, { S(1), S(2), S(3) }))
    assert.equal("(3,Shard(1)->Replicate()) (2,Shard(1)->Replicate()) (1,Shard(1)->Shard(2)) "
      .. "(2,Replicate()->Shard(2)) (3,Replicate()->Shard(2))",
      plan_str(plan({ S(1), S(1), S(1) }, { S(2), S(2), S(2) }, { 8, 8, 8 }, m, { 0, 0, 0 })))
  end)

  it("1-d mesh: one step, even when equal", function()
    assert.equal("(1,Shard(1)->Replicate())", plan_str(plan({ S(1) }, { Rep() }, { 13, 3 }, { 4 }, { 3 })))
    assert.equal("(1,Replicate()->Replicate())", plan_str(plan({ Rep() }, { Rep() }, { 13, 3 }, { 4 }, { 3 })))
  end)

  it("logical shapes come from the source layout and the coordinate (uneven)", function()
    -- (13, 5) on a 2x2 mesh [S1, S1] -> [R, R]: mesh dim 2 gathers 7 or 6 rows
    local s0 = plan({ S(1), S(1) }, { Rep(), Rep() }, { 13, 5 }, { 2, 2 }, { 0, 1 })
    local s1 = plan({ S(1), S(1) }, { Rep(), Rep() }, { 13, 5 }, { 2, 2 }, { 1, 0 })
    assert.same({ 7, 5 }, s0[1].logical_shape)
    assert.same({ 13, 5 }, s0[2].logical_shape)
    assert.same({ 6, 5 }, s1[1].logical_shape)
    assert.equal(2, s0[1].mesh_dim)
  end)

  it("plan argument errors", function()
    assert.matches("coord %(a 0%-based list%) is required", errmsg(dist.redistribute_plan, { S(1) }, { Rep() }, { 4 }, { 4 }))
    assert.matches("1 source and 2 target placements for a 1%-d mesh",
      errmsg(dist.redistribute_plan, { S(1) }, { Rep(), Rep() }, { 4 }, { 4 }, { 0 }))
    assert.matches("Shard dim out of range", errmsg(dist.redistribute_plan, { S(3) }, { Rep() }, { 4, 4 }, { 4 }, { 0 }))
  end)
end)

-- ------------------------------------------------------------------ D: 1-d mesh transitions
local SIZES = { { { 12, 3 }, 1 }, { { 13, 3 }, 1 }, { { 14, 3 }, 1 }, { { 3, 12 }, 2 }, { { 3, 13 }, 2 }, { { 3, 14 }, 2 } }

describe("D: redistribute on a 1-d mesh", function()
  for _, case in ipairs(SIZES) do
    local shape, d = case[1], case[2]
    local name = table.concat(shape, "x")

    it(string.format("D1 Shard(%d) -> Replicate %s: 1 all_gather; backward 0 comm, grad Shard(%d) of ones", d, name, d), function()
      engine.manual_seed(1)
      local x = engine.randn(shape)
      local st = leaf(x, mesh1, { S(d) })
      local cf, r = counts(st.redistribute, st, nil, { Rep() })
      local g = dist.DTensor.from_local(engine.ones(shape), mesh1, { Rep() })
      local cb = counts(function() r:backward(g) end)
      assert.same(c({ all_gather = 1 }), cf)
      assert.same({}, cb)
      assert.same(shape, r:shape())
      assert.equal(0, diff(r:to_local(), x))
      assert.same({ S(d) }, st.grad.placements)
      assert.equal(0, diff(st.grad:to_local(), engine.ones(st:to_local():shape())))
      assert.equal("RedistributeBackward", r.grad_fn)
    end)

    it(string.format("D2 Replicate -> Shard(%d) %s: 0 comm, local chunk; backward 1 all_gather", d, name), function()
      engine.manual_seed(2)
      local x = engine.randn(shape)
      local st = leaf(x, mesh1, { Rep() })
      local cf, r = counts(st.redistribute, st, nil, { S(d) })
      local g = dist.DTensor.from_local(chunk_of(engine.ones(shape), d, W, R):contiguous(), mesh1, { S(d) },
        { shape = shape, stride = engine.ones(shape):stride() })
      local cb = counts(function() r:backward(g) end)
      assert.same({}, cf)
      assert.same(c({ all_gather = 1 }), cb)
      assert.equal(0, diff(r:to_local(), chunk_of(x, d, W, R)))
      assert.same({ Rep() }, st.grad.placements)
      assert.equal(0, diff(st.grad:to_local(), engine.ones(shape)))
    end)

    it(string.format("D4 Partial -> Shard(%d) %s: 1 reduce_scatter, local W * ones(chunk)", d, name), function()
      local p = dist.DTensor.from_local(engine.ones(shape), mesh1, { Part() })
      local cf, r = counts(p.redistribute, p, nil, { S(d) })
      assert.same(c({ reduce_scatter = 1 }), cf)
      assert.same({ S(d) }, r.placements)
      assert.equal(0, diff(r:to_local(), chunk_of(engine.full(shape, W), d, W, R)))
      if W == 4 and shape[d] ~= 12 then
        local want = shape[d] == 13 and { 4, 4, 4, 1 } or { 4, 4, 4, 2 }
        assert.equal(want[R + 1], r:to_local():size(d))
      end
    end)
  end

  it("D3 Partial -> Replicate: 1 all_reduce, local W * ones; backward 0 comm, grad of the Partial local = ones", function()
    local x = engine.ones(12, 3):requires_grad_()
    local p = dist.DTensor.from_local(x, mesh1, { Part() })
    local cf, r = counts(p.redistribute, p, nil, { Rep() })
    local cb = counts(function() r:to_local():sum():backward() end)
    assert.same(c({ all_reduce = 1 }), cf)
    assert.same({}, cb)
    assert.equal(0, diff(r:to_local(), engine.full({ 12, 3 }, W)))
    assert.equal(0, diff(x.grad, engine.ones(12, 3)))
  end)

  it("D3 other reduce ops: avg, max, min, prod", function()
    local v = engine.tensor({ { R + 1, -(R + 1) } }, "f64")
    local res = {}
    for i, op in ipairs({ "avg", "max", "min", "prod" }) do
      res[i] = dist.DTensor.from_local(v, mesh1, { Part(op) }):redistribute(nil, { Rep() }):to_local()
    end
    local sum, prod = 0, 1
    for q = 1, W do sum = sum + q; prod = prod * q end
    assert.same({ sum / W, -sum / W }, res[1]:tolist_flat())
    assert.same({ W, -1 }, res[2]:tolist_flat())
    assert.same({ 1, -W }, res[3]:tolist_flat())
    assert.same({ prod, prod * (W % 2 == 0 and 1 or -1) }, res[4]:tolist_flat())
  end)

  it("D5 Replicate -> Replicate and Partial -> Partial: 0 comm both ways, grads keep placements", function()
    local rr = leaf(engine.ones(4, 3), mesh1, { Rep() })
    local x = engine.ones(4, 3):requires_grad_()
    local pp = dist.DTensor.from_local(x, mesh1, { Part() })
    local cf, a, b = counts(function() return rr:redistribute(nil, { Rep() }), pp:redistribute(nil, { Part() }) end)
    local cb = counts(function()
      a:backward(dist.DTensor.from_local(engine.ones(4, 3), mesh1, { Rep() }))
      b:backward(dist.DTensor.from_local(engine.ones(4, 3), mesh1, { Part() }))
    end)
    assert.same({}, cf)
    assert.same({}, cb)
    assert.same({ Part() }, b.placements)
    assert.same({ Rep() }, rr.grad.placements)
    assert.equal(0, diff(x.grad, engine.ones(4, 3)))
  end)

  it("D6 Replicate -> Partial: public API error; internal divides by W with 0 comm", function()
    local d = dist.DTensor.from_local(engine.full({ 4, 3 }, 8), mesh1, { Rep() })
    assert.matches("redistribute: f32%[4,3%] on mesh%(" .. W .. "%) %[Replicate%(%)%] %-> %[Partial%(sum%)%]: Can not "
      .. "redistribute from Replicate%(%) to Partial%(sum%) %(mesh dim 1%), redistributing to Partial is for internal use only!",
      errmsg(d.redistribute, d, nil, { Part() }))
    local cnt, p = counts(dist._redistribute_internal, d, { Part() })
    local pm = dist._redistribute_internal(d, { Part("max") })
    local back = p:redistribute(nil, { Rep() }):to_local()
    assert.same({}, cnt)
    assert.same({ Part() }, p.placements)
    assert.equal(0, diff(p:to_local(), engine.full({ 4, 3 }, 8 / W)))
    assert.equal(0, diff(pm:to_local(), engine.full({ 4, 3 }, 8)))
    assert.equal(0, diff(back, engine.full({ 4, 3 }, 8)))
  end)

  it("D6 on a 2x2 mesh: [R, R] -> [P, P] divides by 4", function()
    need4()
    local d = dist.DTensor.from_local(engine.full({ 2, 2 }, 8), mesh2, { Rep(), Rep() })
    local p = dist._redistribute_internal(d, { Part(), Part() })
    local f = p:full_tensor()
    assert.equal(0, diff(p:to_local(), engine.full({ 2, 2 }, 2)))
    assert.equal(0, diff(f, engine.full({ 2, 2 }, 8)))
  end)

  it("D7 Shard(1) <-> Shard(2): 1 all_to_all, local == distribute_tensor(x, dst) local", function()
    local shapes = { { 8, 8 }, { 8, 8, 8 }, { 8, 5 }, { 5, 8 }, { 5, 5 }, { 13, 14 }, { 3, 2 } }
    local res = {}
    for i, sh in ipairs(shapes) do
      engine.manual_seed(20 + i)
      local x = engine.randn(sh)
      local a = dist.distribute_tensor(x, mesh1, { S(1) })
      local b = dist.distribute_tensor(x, mesh1, { S(2) })
      local c1, ab = counts(a.redistribute, a, nil, { S(2) })
      local c2, ba = counts(b.redistribute, b, nil, { S(1) })
      res[i] = { c1, c2, ab:to_local(), ba:to_local(), b:to_local(), a:to_local() }
    end
    for i = 1, #shapes do
      assert.same(c({ all_to_all = 1 }), res[i][1])
      assert.same(c({ all_to_all = 1 }), res[i][2])
      assert.equal(0, diff(res[i][3], res[i][5]))
      assert.equal(0, diff(res[i][4], res[i][6]))
    end
  end)

  it("D7 all_to_all backward is one all_to_all back", function()
    engine.manual_seed(4)
    local x = engine.randn(6, 7)
    local st = leaf(x, mesh1, { S(1) })
    local r = st:redistribute(nil, { S(2) })
    local g = dist.distribute_tensor(engine.ones(6, 7), mesh1, { S(2) })
    local cb = counts(function() r:backward(g) end)
    assert.same(c({ all_to_all = 1 }), cb)
    assert.same({ S(1) }, st.grad.placements)
    assert.equal(0, diff(st.grad:to_local(), engine.ones(st:to_local():shape())))
  end)

  it("D8 Shard(2) -> redistribute(Shard(-1)) keeps dim 2", function()
    local d = dist.DTensor.from_local(engine.ones(2, 2), mesh1, { S(2) })
    local cnt, r = counts(d.redistribute, d, nil, { S(-1) })
    assert.same({ S(2) }, r.placements)
    assert.same({}, cnt)
  end)

  it("D9 mesh (W, 1): changes on the size-1 mesh dim move nothing", function()
    local m = dist.init_device_mesh("cpu", { W, 1 })
    engine.manual_seed(9)
    local x = engine.randn(16, 8)
    local res = {}
    for _, src in ipairs({ S(2), Rep(), Part() }) do
      for _, dst in ipairs({ S(1), S(2), Rep() }) do
        local d = dist.DTensor.from_local(x, m, { S(1), src })
        local cnt, r = counts(d.redistribute, d, nil, { S(1), dst })
        res[#res + 1] = { cnt, r, dst }
      end
    end
    for _, e in ipairs(res) do
      assert.same({}, e[1])
      assert.same({ S(1), e[3] }, e[2].placements)
      assert.equal(0, diff(e[2]:to_local(), x))
    end
  end)

  it("D11 Partial targets on a 2x2 mesh: legal only where the source has the identical Partial", function()
    need4()
    engine.manual_seed(11)
    local x = engine.randn(12, 8)
    local ok = {}
    for i, case in ipairs({ { { Part(), S(1) }, { Part(), S(1) } }, { { Part(), S(1) }, { Part(), S(2) } },
      { { S(1), Part() }, { Rep(), Part() } }, { { S(1), Part("prod") }, { Rep(), Part("prod") } } }) do
      local d = dist.DTensor.from_local(x, mesh2, case[1])
      ok[i] = d:redistribute(nil, case[2]).placements
    end
    assert.same({ Part(), S(1) }, ok[1])
    assert.same({ Part(), S(2) }, ok[2])
    assert.same({ Rep(), Part() }, ok[3])
    assert.same({ Rep(), Part("prod") }, ok[4])
    for _, case in ipairs({ { { S(1), Rep() }, { S(1), Part() } }, { { S(1), Rep() }, { Rep(), Part() } },
      { { S(1), S(2) }, { Rep(), Part() } }, { { S(1), Part("prod") }, { Rep(), Part("sum") } } }) do
      local d = dist.DTensor.from_local(x, mesh2, case[1])
      assert.matches("Can not redistribute from .* redistributing to Partial is for internal use only!",
        errmsg(d.redistribute, d, nil, case[2]))
    end
  end)

  it("D12 internal Partial(sum) -> Partial(avg) is unsupported", function()
    local d = dist.DTensor.from_local(engine.ones(2, 2), mesh1, { Part("sum") })
    assert.matches("Redistribution from one partial type %(sum%) to another %(avg%) is unsupported",
      errmsg(dist._redistribute_internal, d, { Part("avg") }))
  end)

  it("errors: not a DTensor, missing placements, other mesh, bad placements", function()
    local d = dist.DTensor.from_local(engine.ones(2, 2), mesh1, { S(1) })
    assert.matches("redistribute: f32%[2,2%] is not a DTensor", errmsg(function() engine.ones(2, 2):redistribute(nil, { Rep() }) end))
    assert.matches("redistribute: placements is needed for redistribute!", errmsg(d.redistribute, d, nil, nil))
    local other = dist.init_device_mesh("cpu", { W }, { "x" })
    assert.matches("Cross device mesh comm not supported yet!", errmsg(d.redistribute, d, other, { Rep() }))
    assert.matches("redistribute: `placements` must have the same length as `device_mesh.ndim`! Found placements length: 2",
      errmsg(d.redistribute, d, nil, { Rep(), Rep() }))
    assert.matches("Shard%(3%) %(placement 1%) is out of range for a 2%-d tensor", errmsg(d.redistribute, d, nil, { S(3) }))
    assert.matches("Shard: dim 0 is invalid", errmsg(function() return d:redistribute(nil, { S(0) }) end))
    -- the mesh argument may be left out
    assert.same({ Rep() }, d:redistribute({ Rep() }).placements)
  end)

  it("dtypes: f64, bf16, i64 go through every collective kind", function()
    local res = {}
    for i, dt in ipairs({ "f64", "bf16", "i64" }) do
      local x = engine.arange(4 * W * 3):view(4 * W, 3):to(dt)
      local d = dist.distribute_tensor(x, mesh1, { S(1) })
      local a = d:redistribute(nil, { S(2) }):redistribute(nil, { Rep() }):to_local()
      local p = dist.DTensor.from_local(x, mesh1, { Part() }):redistribute(nil, { S(1) }):full_tensor()
      res[i] = { x, a, p }
    end
    for i = 1, #res do
      local x, a, p = res[i][1], res[i][2], res[i][3]
      assert.equal(x.dtype, a.dtype)
      assert.equal(0, diff(a, x))
      assert.equal(0, diff(p, x * W))
    end
  end)
end)

-- ------------------------------------------------------------------ 2x2 mesh
-- a DTensor with layout pl and global value x (Partial: sum parts / max parts)
local function make(x, mesh, pl)
  local plain = {}
  local scale = 1
  for i, p in ipairs(pl) do
    if p:is_partial() then
      plain[i] = Rep()
      if p:is_partial("sum") then scale = scale * mesh:size(i) end
    else plain[i] = p end
  end
  local base = dist.distribute_tensor(x, mesh, plain):to_local()
  return dist.DTensor.from_local(base / scale, mesh, pl, { shape = x:shape(), stride = x:stride() })
end

describe("2x2 mesh: exact collective counts (test_redistribute_shard_dim_change)", function()
  local cases = {
    { { S(1), S(1) }, { Rep(), S(1) }, { all_gather = 2 }, { 8, 8 } },
    { { S(1), S(2) }, { S(1), S(1) }, { all_to_all = 1 }, { 8, 8 } },
    { { S(1), S(2) }, { S(2), S(1) }, { all_gather = 1, all_to_all = 1 }, { 8, 8 } },
    { { S(1), S(1) }, { S(2), S(2) }, { all_gather = 1, all_to_all = 1 }, { 8, 8 } },
    { { S(1), S(3) }, { S(2), S(1) }, { all_gather = 1, all_to_all = 1 }, { 8, 8, 8 } },
    { { S(2), S(2) }, { S(2), S(3) }, { all_to_all = 1 }, { 8, 8, 8 } },
    { { Part(), S(1) }, { Rep(), Rep() }, { all_gather = 1, all_reduce = 1 }, { 8, 8 } },
    { { Part(), Part() }, { S(1), S(2) }, { reduce_scatter = 2 }, { 8, 8 } },
  }
  for _, case in ipairs(cases) do
    it(describe_pl(case[1]) .. " -> " .. describe_pl(case[2]), function()
      need4()
      engine.manual_seed(3)
      local x = engine.randn(case[4])
      local d = make(x, mesh2, case[1])
      local cnt, r = counts(d.redistribute, d, nil, case[2])
      local want = dist.distribute_tensor(x, mesh2, case[2]):to_local()
      local full = r:full_tensor()
      assert.same(case[3], cnt)
      assert.same(case[2], r.placements)
      assert.is_true(diff(r:to_local(), want) < 1e-5)
      assert.is_true(diff(full, x) < 1e-5)
    end)
  end
end)

-- ------------------------------------------------------------------ layout equivalence
-- every source layout (Replicate, Shard on each dim, Partial sum/max) to every
-- target (Replicate, Shard on each dim): full_tensor() == the original, the
-- local shard == distribute_tensor(x, target)'s, and the gradient of a random
-- target-layout cotangent comes back with global value equal to it.
local function layouts(ndim, mesh_ndim, with_partial)
  local one = { Rep() }
  for d = 1, ndim do one[#one + 1] = S(d) end
  if with_partial then one[#one + 1] = Part(); one[#one + 1] = Part("max") end
  local out = {}
  if mesh_ndim == 1 then
    for _, p in ipairs(one) do out[#out + 1] = { p } end
  else
    for _, p in ipairs(one) do for _, q in ipairs(one) do out[#out + 1] = { p, q } end end
  end
  return out
end

local function equivalence(mesh, shapes)
  local bad = {}
  local n = 0
  for si, shape in ipairs(shapes) do
    engine.manual_seed(100 + si)
    local x = engine.randn(shape, { dtype = "f64" })
    local srcs = layouts(#shape, mesh:ndim(), true)
    local dsts = layouts(#shape, mesh:ndim(), false)
    for _, src in ipairs(srcs) do
      for _, dst in ipairs(dsts) do
        n = n + 1
        local base = make(x, mesh, src):to_local():detach():requires_grad_()
        local d = dist.DTensor.from_local(base, mesh, src, { shape = x:shape(), stride = x:stride() })
        local r = d:redistribute(nil, dst)
        local g = engine.randn(shape, { dtype = "f64" })
        local gd = dist.distribute_tensor(g, mesh, dst)
        r:backward(gd)
        local full = r:full_tensor()
        local want = dist.distribute_tensor(x, mesh, dst):to_local()
        -- the gradient of the plain local, as a DTensor in the source layout (Partial -> Replicate)
        local gpl = {}
        for i, p in ipairs(src) do gpl[i] = p:is_partial() and Rep() or p end
        local gfull = dist.DTensor.from_local(base.grad, mesh, gpl, { shape = x:shape(), stride = x:stride() }):full_tensor()
        local e = math.max(diff(full, x), diff(r:to_local(), want), diff(gfull, g))
        if e > 1e-12 then
          bad[#bad + 1] = string.format("%s %s -> %s: error %g", table.concat(shape, "x"), describe_pl(src),
            describe_pl(dst), e)
        end
      end
    end
  end
  return n, bad
end

describe("layout equivalence (forward, local shards and gradients)", function()
  it("non-contiguous (transposed) local shards give the same results", function()
    local bad = {}
    for si, shape in ipairs({ { 12, 6 }, { 13, 5 }, { 6, 14 } }) do
      engine.manual_seed(50 + si)
      local x = engine.randn(shape)
      for _, src in ipairs(layouts(2, 1, true)) do
        for _, dst in ipairs(layouts(2, 1, false)) do
          local l = make(x, mesh1, src):to_local()
          local nc = l:t():contiguous():t()  -- same values, column-major strides
          local d = dist.DTensor.from_local(nc, mesh1, src, { shape = shape, stride = x:stride() })
          local r = d:redistribute(nil, dst)
          local e = math.max(diff(r:full_tensor(), x), diff(r:to_local(), dist.distribute_tensor(x, mesh1, dst):to_local()))
          if e > 1e-5 or (nc:numel() > 1 and nc:is_contiguous() and nc:size(1) > 1 and nc:size(2) > 1) then
            bad[#bad + 1] = string.format("%s %s -> %s: %g", table.concat(shape, "x"), describe_pl(src), describe_pl(dst), e)
          end
        end
      end
    end
    assert.same({}, bad)
  end)

  it("1-d mesh of all ranks: every source -> target pair, even and uneven sizes", function()
    local n, bad = equivalence(mesh1, { { 12, 3 }, { 13, 5 }, { 14, 3 }, { 3, 13 }, { 5, 7, 6 }, { 2, 9 }, { 1, 3 } })
    assert.is_true(n > 100)
    assert.same({}, bad)
  end)

  it("2x2 mesh: every source -> target pair, even and uneven sizes", function()
    need4()
    local n, bad = equivalence(mesh2, { { 8, 4 }, { 13, 6 }, { 14, 3 }, { 3, 5, 2 } })
    assert.is_true(n > 500)
    assert.same({}, bad)
  end)
end)

-- ------------------------------------------------------------------ C building blocks for op dispatch
describe("C building blocks: specs, cached plans, wrap_output, local mode, redistribute_spec", function()
  local ffi, C = engine.ffi, engine.C
  local function spec(mesh, pl, shape)
    local arr, n = require("engine.distributed.placements")._to_c(pl, "spec")
    local sh = ffi.new("int64_t[8]", shape)
    return ffi.gc(C.eng_dist_spec_new(mesh._c, n, arr, #shape, sh, nil), C.eng_dist_spec_release)
  end

  it("specs: equality and hash by value; normalized dims; local shape and offset of this rank", function()
    local a = spec(mesh1, { S(-1) }, { 6, 4 * W + 1 })
    local b = spec(mesh1, { S(2) }, { 6, 4 * W + 1 })
    local c2 = spec(mesh1, { S(1) }, { 6, 4 * W + 1 })
    assert.equal(1, C.eng_dist_spec_equal(a, b))
    assert.equal(C.eng_dist_spec_hash(a), C.eng_dist_spec_hash(b))
    assert.equal(0, C.eng_dist_spec_equal(a, c2))
    assert.equal(1, a.placements[0].dim)
    local size, off = dist.local_shard_size_and_offset(4 * W + 1, W, R)
    assert.equal(size, tonumber(a.local_shape[1]))
    assert.equal(off, tonumber(a.offset[1]))
    assert.equal(6 * (4 * W + 1), tonumber(a.numel))
    assert.equal(1, a.member)
    local buf = ffi.new("char[256]")
    assert.equal("f32[6," .. (4 * W + 1) .. "] on mesh(" .. W .. ") [Shard(2)]", ffi.string(C.eng_dist_spec_describe(a, 0, buf, 256)))
    local other = dist.init_device_mesh("cpu", { W }, { "other" })
    assert.equal(0, C.eng_dist_spec_equal(a, spec(other, { S(2) }, { 6, 4 * W + 1 })))
    assert.is_true(C.eng_dist_spec_new(mesh1._c, 1, nil, 2, ffi.new("int64_t[2]", { 2, 2 }), nil) == nil)
    assert.matches("placements are NULL", engine.ffi.string(C.eng_last_error()))
  end)

  it("eng_dtensor_transform_infos is the cached greedy plan for this rank", function()
    need4()
    local out = ffi.new("eng_transform_info[16]")
    local s1 = spec(mesh2, { S(1), S(2) }, { 8, 8 })
    local s2 = spec(mesh2, { S(2), S(1) }, { 8, 8 })
    for _ = 1, 2 do  -- second call served from the cache
      local n = C.eng_dtensor_transform_infos(s1, s2, out, 16)
      assert.equal(3, n)
      assert.same({ 1, 0, 1 }, { out[0].mesh_dim, out[1].mesh_dim, out[2].mesh_dim })
      assert.same({ 1, 1, 0, 1, 0 }, { out[0].src.kind, out[1].dst.kind, out[0].dst.kind, out[1].dst.dim, out[2].dst.dim })
    end
  end)

  it("wrap_output attaches a spec after checking the local shape; local mode is a thread-local flag", function()
    local s = spec(mesh1, { S(1) }, { 4 * W, 3 })
    local t = engine.ones(4, 3)
    assert.equal(0, C.eng_dtensor_wrap_output(t._c, s))
    assert.is_true(dist.is_dtensor(t))
    assert.same({ 4 * W, 3 }, t:shape())
    assert.same({ S(1) }, t.placements)
    if W > 1 then
      local bad = engine.ones(5, 3)
      assert.equal(-1, C.eng_dtensor_wrap_output(bad._c, s))
      assert.matches("wrap_output: local tensor f32%[5,3%] does not match this rank's shard %[4,3%]",
        ffi.string(C.eng_last_error()))
    end
    assert.is_false(dist.set_local_mode(true))
    assert.equal(1, C.eng_dtensor_local_mode())
    assert.is_true(dist.set_local_mode(false))
    assert.equal(0, C.eng_dtensor_local_mode())
  end)

  it("eng_dtensor_redistribute_spec: autograd-recorded; Partial targets only with the internal flag", function()
    local x = engine.full({ 2, 3 }, 4):requires_grad_()
    local d = dist.DTensor.from_local(x, mesh1, { Rep() })
    local p = spec(mesh1, { Part() }, { 2, 3 })
    assert.is_true(C.eng_dtensor_redistribute_spec(d._c, p, 0) == nil)
    assert.matches("redistributing to Partial is for internal use only", ffi.string(C.eng_last_error()))
    local r = require("engine.core").wrap(C.eng_dtensor_redistribute_spec(d._c, p, 2))
    assert.equal("RedistributeBackward", r.grad_fn)
    assert.equal(0, diff(r:to_local(), engine.full({ 2, 3 }, 4 / W)))
    r:backward(dist.DTensor.from_local(engine.ones(2, 3), mesh1, { Rep() }))
    assert.equal(0, diff(x.grad, engine.ones(2, 3)))  -- gradients are never turned into Partial
  end)

  it("async Shard(1) -> Shard(2) (unpacked on wait) and eng_dtensor_wait_all", function()
    engine.manual_seed(8)
    local x = engine.randn(9, 10)
    local d = dist.distribute_tensor(x, mesh1, { S(1) })
    local a = d:redistribute(nil, { S(2) }, { async_op = true })
    local b = d:redistribute(nil, { Rep() }, { async_op = true })
    local pend = { a:is_pending(), b:is_pending() }
    dist.wait_all()
    local want = dist.distribute_tensor(x, mesh1, { S(2) }):to_local()
    assert.same({ W > 1, W > 1 }, pend)
    assert.is_false(a:is_pending())
    assert.equal(0, diff(a:to_local(), want))
    assert.equal(0, diff(b:to_local(), x))
  end)

  it("a plain gradient of a DTensor leaf is taken in the leaf's layout", function()
    local st = dist.DTensor.from_local(engine.ones(2, 3), mesh1, { S(1) }):detach()
    st.requires_grad = true
    st:backward(engine.full({ 2, 3 }, 5))
    assert.is_true(dist.is_dtensor(st.grad))
    assert.same({ S(1) }, st.grad.placements)
    assert.equal(0, diff(st.grad:to_local(), engine.full({ 2, 3 }, 5)))
  end)
end)
