-- The DTensor op dispatcher: error messages (mixed DTensor/Tensor, different
-- meshes, ops without a sharding rule), ranks outside the mesh, in-place ops,
-- AccumulateGrad into DTensor leaves, local mode.
local engine = require("engine")
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local errmsg = util.errmsg

local R, W = dist.rank(), dist.world_size()
local S, Rep, Part = dist.Shard, dist.Replicate, dist.Partial
local mesh1 = dist.init_device_mesh("cpu", { W })
local mesh_sub = W >= 2 and dist.init_device_mesh("cpu", { 2 }, nil, { ranks = { 0, 1 } }) or nil

local function diff(a, b) return (a:double() - b:double()):abs():max():item() end

describe("dispatcher errors", function()
  it("mixed DTensor and Tensor arguments name the op and both layouts", function()
    local d = dist.distribute_tensor(engine.ones(8, 4), mesh1, { S(2) })
    local e = errmsg(function() return d + engine.ones(4) end)
    assert.truthy(e:find("add: mixed DTensor and Tensor arguments: DTensor(f32[8,4] on mesh(" .. W .. ") [Shard(2)]) and f32[4]", 1, true), e)
    local e2 = errmsg(function() return engine.matmul(engine.ones(3, 8), d) end)
    assert.truthy(e2:find("matmul: mixed DTensor and Tensor arguments", 1, true), e2)
  end)
  it("different meshes are an error naming both meshes", function()
    if W < 2 then pending("needs 2 ranks") return end
    local m2 = dist.init_device_mesh("cpu", { W }, { "other" })
    local a = dist.distribute_tensor(engine.ones(4), mesh1, { Rep() })
    local b = dist.distribute_tensor(engine.ones(4), m2, { Rep() })
    local e = errmsg(function() return a * b end)
    assert.truthy(e:find("mul: DTensor arguments on different device meshes: mesh(" .. W .. ") and mesh(" .. W .. ": other)", 1, true), e)
  end)
  it("ops without a rule of their own (sum_to_size) compose ruled ops and match the single-process result", function()
    local rows = {}
    for i = 1, 4 do rows[i] = {} for j = 1, 6 do rows[i][j] = (i * 7 + j * 3) % 5 - 2 end end
    local x = engine.tensor(rows)   -- small integers: sums are exact in any order
    for _, pl in ipairs({ { S(1) }, { S(2) }, { Rep() } }) do
      local d = dist.distribute_tensor(x, mesh1, pl)
      local r = d:sum_to_size(1, 6)
      assert.truthy(dist.is_dtensor(r))
      assert.are.same(x:sum_to_size(1, 6):totable(), r:full_tensor():totable())
    end
    local e = errmsg(function() return dist.distribute_tensor(x, mesh1, { S(1) }):sum_to_size(3, 6) end)
    assert.truthy(e:find("sum_to_size: DTensor(i64[4,6]", 1, true), e)
  end)
  it("in-place on a Partial target with an operand of another layout is refused", function()
    local p = dist.DTensor.from_local(engine.ones(3), mesh1, { Part() })
    local r = dist.distribute_tensor(engine.ones(3), mesh1, { Rep() })
    local e = errmsg(function() return engine.no_grad(function() p:add_(r) end) end)
    assert.truthy(e:find("add_: no sharding strategy for DTensor(f32[3] on mesh(" .. W .. ") [Partial(sum)]), DTensor(f32[3] on mesh(" .. W .. ") [Replicate()])", 1, true), e)
  end)
end)

describe("dispatcher behaviour", function()
  it("in-place ops lay the operand out like the target and run on the locals", function()
    engine.manual_seed(3)
    local x, y = engine.randn(5, 3), engine.randn(5, 3)
    local a = dist.distribute_tensor(x, mesh1, { S(1) })
    local b = dist.distribute_tensor(y, mesh1, { Rep() })
    a:add_(b, 2)
    a:mul_(b)
    a:clamp_(-1, 1)
    assert.same({ S(1) }, a.placements)
    assert.is_true(diff(a:full_tensor(), ((x + y * 2) * y):clamp(-1, 1)) < 1e-6)
  end)
  it("a DTensor leaf accumulates over two backwards, always in its own layout", function()
    engine.manual_seed(4)
    local x, w = engine.randn(6, 4), engine.randn(4, 4)
    local dw = dist.distribute_tensor(w, mesh1, { Rep() }); dw.requires_grad = true
    local dx = dist.distribute_tensor(x, mesh1, { S(1) })
    for _ = 1, 2 do engine.matmul(dx, dw):sum():backward() end
    assert.same({ Rep() }, dw.grad.placements)
    local wl = w:clone(); wl.requires_grad = true
    for _ = 1, 2 do engine.matmul(x, wl):sum():backward() end
    assert.is_true(diff(dw.grad:to_local(), wl.grad) < 1e-5)
  end)
  it("ranks outside the mesh get empty outputs with the right ndim and take part in nothing", function()
    if W < 4 then pending("needs 4 ranks") return end
    local x = engine.arange(12):view(4, 3):float()
    local d = dist.distribute_tensor(x, mesh_sub, { S(1) }, { src_data_rank = false })
    d.requires_grad = true
    local out = (d * 2 + 1):sum(2)
    assert.equal(1, out:to_local():dim())
    local y = engine.matmul(d, dist.distribute_tensor(engine.ones(3, 2), mesh_sub, { Rep() }, { src_data_rank = false }))
    assert.equal(2, y:to_local():dim())
    out:sum():backward()
    if R < 2 then
      assert.is_true(diff(out:full_tensor(), (x * 2 + 1):sum(2)) < 1e-5)
      assert.is_true(diff(d.grad:full_tensor(), engine.full({ 4, 3 }, 2)) < 1e-6)
    else
      assert.equal(0, out:to_local():numel())
    end
  end)
  it("local mode computes on the local shards", function()
    local d = dist.distribute_tensor(engine.ones(4, 2), mesh1, { S(1) })
    local prev = dist.set_local_mode(true)
    local r = d * 2
    dist.set_local_mode(prev)
    assert.is_false(dist.is_dtensor(r))
  end)
  it("a cached selection gives the same result as the first call", function()
    engine.manual_seed(5)
    local x = engine.randn(5, 3)
    local d = dist.distribute_tensor(x, mesh1, { S(2) })
    local first = (d + d):full_tensor()
    for _ = 1, 3 do assert.equal(0, diff((d + d):full_tensor(), first)) end
  end)
end)
