-- A9: the redistribute cost model (PyTorch's redistribute_cost) as the op dispatcher uses it:
-- bytes moved per mesh dim, ~0 from a Replicate source (local re-sharding: a tiny cost, so that
-- a strategy needing no change wins ties), infinite for Shard -> Partial, Partial(op1) ->
-- Partial(op2) and another mesh, and the triangle inequality over every placement triple whose
-- direct redistribution is possible (Shard -> Partial is not, though Shard -> Replicate ->
-- Partial is: the engine, like PyTorch's greedy planner, does not route around it).
local engine = require("engine")
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local errmsg = util.errmsg

local W = dist.world_size()
local S, Rep, Part = dist.Shard, dist.Replicate, dist.Partial
local mesh1 = dist.init_device_mesh("cpu", { W })

local ROWS, COLS = 8 * W, 6
local BYTES = ROWS * COLS * 4
local function dt(pl, mesh)
  mesh = mesh or mesh1
  local shape, _ = dist.compute_local_shape_and_global_offset({ ROWS, COLS }, mesh, pl)
  return dist.DTensor.from_local(engine.zeros(shape), mesh, pl, { shape = { ROWS, COLS }, stride = { COLS, 1 } })
end

describe("A9: redistribute cost", function()
  local f = (W - 1) / W
  it("bytes moved on a 1-d mesh: S->R and S->S (k-1)/k, P->R twice, P->S once", function()
    local function near(want, got) return math.abs(got - want) <= 1e-5 * math.max(1, want) end
    assert.equal(0, dt({ S(1) }):redistribute_cost({ S(1) }))
    assert.equal(0, dt({ Rep() }):redistribute_cost({ Rep() }))
    if W > 1 then
      assert.is_true(near(f * BYTES, dt({ S(1) }):redistribute_cost({ Rep() })))
      assert.is_true(near(f * BYTES, dt({ S(1) }):redistribute_cost({ S(2) })))
      assert.is_true(near(2 * f * BYTES, dt({ Part() }):redistribute_cost({ Rep() })))
      assert.is_true(near(f * BYTES, dt({ Part() }):redistribute_cost({ S(2) })))
    end
  end)

  it("from a Replicate source it is ~0 (no communication), yet more than no change", function()
    local c = dt({ Rep() }):redistribute_cost({ S(1) })
    assert.is_true(c > 0)
    assert.is_true(c < 1e-2 * BYTES)
    assert.is_true(dt({ Rep() }):redistribute_cost({ Part() }) < 1e-2 * BYTES)
  end)

  it("is infinite for Shard -> Partial, Partial(sum) -> Partial(max) and another mesh", function()
    assert.equal(math.huge, dt({ S(1) }):redistribute_cost({ Part() }))
    assert.equal(math.huge, dt({ Part() }):redistribute_cost({ Part("max") }))
    local other = dist.init_device_mesh("cpu", { W, 1 })
    assert.equal(math.huge, dt({ S(1) }):redistribute_cost(other, { Rep(), Rep() }))
  end)

  it("satisfies cost(a, c) <= cost(a, b) + cost(b, c) for every triple with a possible a -> c", function()
    local pls = { Rep(), S(1), S(2), Part() }
    local bad = {}
    for _, a in ipairs(pls) do
      for _, b in ipairs(pls) do
        for _, c in ipairs(pls) do
          local direct = dt({ a }):redistribute_cost({ c })
          if direct == math.huge then assert.is_true(a:is_shard() and c:is_partial() or a:is_partial() and c:is_partial()) end
          if direct == math.huge then direct = 0 end
          local via = dt({ a }):redistribute_cost({ b }) + dt({ b }):redistribute_cost({ c })
          if direct > via * (1 + 1e-12) then bad[#bad + 1] = tostring(a) .. "->" .. tostring(b) .. "->" .. tostring(c) end
        end
      end
    end
    assert.same({}, bad)
  end)

  it("on a 2x2 mesh it sums the mesh dims with the logical bytes of each", function()
    if W ~= 4 then pending("needs 4 ranks (2x2 mesh)") end
    local m = dist.init_device_mesh("cpu", { 2, 2 })
    -- [S1, S1] -> [R, R]: mesh dim 2 gathers a quarter... the logical tensor on each mesh dim is
    -- the global one divided by the OTHER sharded mesh dims: half of it on each
    local c = dt({ S(1), S(1) }, m):redistribute_cost({ Rep(), Rep() })
    assert.is_true(math.abs(c - 2 * 0.5 * BYTES / 2) <= 1e-3)
    assert.equal(math.huge, dt({ S(1), S(2) }, m):redistribute_cost({ S(1), Part() }))
    assert.is_true(dt({ S(1), Rep() }, m):redistribute_cost({ S(1), Part() }) < 1)
  end)

  it("bad placements are errors naming the operation", function()
    local e = errmsg(function() return dt({ S(1) }):redistribute_cost({ S(3) }) end)
    assert.is_truthy(e:find("redistribute_cost", 1, true), e)
  end)
end)
