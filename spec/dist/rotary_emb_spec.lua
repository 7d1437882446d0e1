-- engine.rotary_emb on DTensors (engine/src/sharding/rope.c): x [B, T, H, D] sharded on the batch, the sequence
-- (the [T, D/2] tables then row-sharded alike, T divisible by the world size or not) or the heads rotates its shards
-- without a collective and keeps its layout; x sharded on D is redistributed first; a Partial x stays Partial; on a
-- 2x2 mesh (4 ranks) two sharded dims at once.  The full result and the gradient of x equal the plain op's on the
-- full tensors bit for bit (the same kernel on the same elements).  Plain tables pass under dist.implicit_replication
-- (as DTensor data parallelism runs the Llama) and are refused without it; bad shapes and dtypes name the op and the
-- layouts; meta DTensors give the local meta shapes.  Run at 1, 2 and 4 ranks.
local engine = require("engine")
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local errmsg = util.errmsg

local W = dist.world_size()
local S, Rep, Part = dist.Shard, dist.Replicate, dist.Partial   -- Shard dims are 1-based: S(1) = B, S(2) = T
local mesh = dist.init_device_mesh("cpu", { W })
local mesh2 = W == 4 and dist.init_device_mesh("cpu", { 2, 2 }, { "dp", "tp" }) or nil

local function full(t) if dist.is_dtensor(t) then return t:full_tensor() end return t end
-- 0 when a and b are equal bit for bit (same shape, every element equal; -0 == 0)
local function diff(a, b) return util.diff(full(a), full(b)) end
local function nothing(counts) return next(counts) == nil end
local function pl_str(pl)
  local t = {}
  for i, p in ipairs(pl) do t[i] = tostring(p) end
  return "[" .. table.concat(t, ", ") .. "]"
end

-- x [B, T, H, D], the f32 tables [T, D/2] and an upstream gradient g, the same on every rank (seeded)
local function inputs(B, T, H, D, seed)
  engine.manual_seed(seed)
  local x, g = engine.randn(B, T, H, D), engine.randn(B, T, H, D)
  local ang = engine.randn(T, D / 2):double()
  return x, ang:cos():float(), ang:sin():float(), g
end

-- The plain op on the full tensors: the result and the gradient of x from (out * g):sum():backward().
local function reference(x, cos, sin, g)
  local xr = x:clone():requires_grad_()
  local out = engine.rotary_emb(xr, cos, sin)
  ;(out * g):sum():backward()
  return out:detach(), xr.grad
end

-- x laid out as xpl and the tables as tpl on m: the forward's collectives, the output (equal to the reference),
-- and the gradient of x (through (out * g):sum() with g in the output's layout, equal to the reference's).
local function check(label, m, x, cos, sin, g, xpl, tpl, want_out)
  local ref, ref_grad = reference(x, cos, sin, g)
  local dx = dist.distribute_tensor(x, m, xpl):detach():requires_grad_()
  local dc, ds = dist.distribute_tensor(cos, m, tpl), dist.distribute_tensor(sin, m, tpl)
  local counts, out = dist.count_collectives(function() return engine.rotary_emb(dx, dc, ds) end)
  assert.is_true(dist.is_dtensor(out), label)
  if want_out then assert.are.equal(pl_str(want_out), pl_str(out.placements), label .. ": output layout") end
  assert.are.equal(0, diff(out, ref), label .. ": forward")
  local dg = dist.distribute_tensor(g, m, out.placements)
  local bcounts = dist.count_collectives(function() out:backward(dg) end)
  assert.is_true(dist.is_dtensor(dx.grad), label)
  assert.are.equal(pl_str(xpl), pl_str(dx.grad.placements), label .. ": gradient layout")
  assert.are.equal(0, diff(dx.grad, ref_grad), label .. ": gradient of x")
  -- the same through (out * g):sum(), as a loss would reach it
  local dx2 = dist.distribute_tensor(x, m, xpl):detach():requires_grad_()
  local out2 = engine.rotary_emb(dx2, dc, ds)
  ;(out2 * dist.distribute_tensor(g, m, out2.placements)):sum():backward()
  assert.are.equal(0, diff(dx2.grad, ref_grad), label .. ": gradient of x through (out * g):sum()")
  return counts, out, bcounts
end

describe("engine.rotary_emb on DTensors", function()
  it("batch, sequence (T divisible or not) and head sharded x, replicated tables: no collectives, layout kept",
    function()
    for _, sz in ipairs({ { 4, 8, 4, 8 }, { 3, 5, 3, 6 } }) do
      local x, cos, sin, g = inputs(sz[1], sz[2], sz[3], sz[4], 11)
      local tag = string.format("[%d,%d,%d,%d]", sz[1], sz[2], sz[3], sz[4])
      for _, d in ipairs({ 1, 2, 3 }) do
        local label = tag .. " x Shard(" .. d .. ")"
        local counts, _, bcounts = check(label, mesh, x, cos, sin, g, { S(d) }, { Rep() }, { S(d) })
        assert.is_true(nothing(counts), label .. ": forward collectives")
        assert.is_true(nothing(bcounts), label .. ": backward collectives")
      end
    end
  end)

  it("sequence sharded x, the tables row-sharded alike (uneven rows: T = 5, 7): Shard(2), no collectives", function()
    for _, T in ipairs({ 8, 5, 7 }) do
      local x, cos, sin, g = inputs(2, T, 2, 4, 12)
      local label = "T " .. T .. " x Shard(2), tables Shard(1)"
      local counts, out = check(label, mesh, x, cos, sin, g, { S(2) }, { S(1) }, { S(2) })
      assert.is_true(nothing(counts), label .. ": forward collectives")
      local sz = dist.local_shard_size_and_offset(T, W, dist.rank())
      assert.same({ 2, sz, 2, 4 }, out:to_local():shape(), label)
    end
  end)

  it("x sharded on D (the pairs) is redistributed first; replicated x stays replicated", function()
    local x, cos, sin, g = inputs(2, 4, 2, 8, 13)
    local _, out = check("x Shard(4)", mesh, x, cos, sin, g, { S(4) }, { Rep() })
    if W > 1 then assert.are_not.equal("Shard(4)", tostring(out.placements[1])) end
    local counts = check("x Replicate", mesh, x, cos, sin, g, { Rep() }, { Rep() }, { Rep() })
    assert.is_true(nothing(counts))
  end)

  it("a Partial(sum) x (the rotation is linear) stays Partial without a collective", function()
    local x, cos, sin = inputs(2, 3, 2, 4, 14)
    local ref = engine.rotary_emb(x, cos, sin)
    -- rank 0 holds x, the others zeros: the sum is x exactly
    local loc = dist.rank() == 0 and x:clone() or engine.zeros(2, 3, 2, 4)
    local p = dist.DTensor.from_local(loc, mesh, { Part() })
    local rc, rs = dist.distribute_tensor(cos, mesh, { Rep() }), dist.distribute_tensor(sin, mesh, { Rep() })
    local counts, out = dist.count_collectives(function() return engine.rotary_emb(p, rc, rs) end)
    assert.is_true(nothing(counts))
    assert.are.equal("[Partial(sum)]", pl_str(out.placements))
    assert.are.equal(0, diff(out, ref))
  end)

  it("on a 2x2 mesh (4 ranks): batch x heads, sequence on both mesh dims, sequence x heads", function()
    if not mesh2 then pending("a 2x2 mesh needs 4 ranks") end
    for _, sz in ipairs({ { 4, 8, 4, 8 }, { 3, 5, 3, 4 } }) do
      local x, cos, sin, g = inputs(sz[1], sz[2], sz[3], sz[4], 15)
      local cases = {
        { { S(1), S(3) }, { Rep(), Rep() } },
        { { S(2), S(2) }, { Rep(), Rep() } },
        { { S(2), S(2) }, { S(1), S(1) } },
        { { S(2), S(3) }, { Rep(), Rep() } },
      }
      for _, c in ipairs(cases) do
        local label = string.format("[%d,%d,%d,%d] x %s, tables %s", sz[1], sz[2], sz[3], sz[4], pl_str(c[1]),
          pl_str(c[2]))
        local counts = check(label, mesh2, x, cos, sin, g, c[1], c[2], c[1])
        assert.is_true(nothing(counts), label .. ": forward collectives")
      end
    end
  end)

  it("plain tables count as replicated under implicit_replication, and are refused without it", function()
    local x, cos, sin, g = inputs(2, 6, 2, 4, 16)
    local ref, ref_grad = reference(x, cos, sin, g)
    local dx = dist.distribute_tensor(x, mesh, { S(2) }):detach():requires_grad_()
    local counts, out = dist.count_collectives(function()
      return dist.implicit_replication(function() return engine.rotary_emb(dx, cos, sin) end)
    end)
    assert.is_true(nothing(counts))
    assert.are.equal("[Shard(2)]", pl_str(out.placements))
    assert.are.equal(0, diff(out, ref))
    out:backward(dist.distribute_tensor(g, mesh, { S(2) }))
    assert.are.equal(0, diff(dx.grad, ref_grad))
    assert.matches("rotary_emb: mixed DTensor and Tensor arguments", errmsg(engine.rotary_emb, dx, cos, sin), 1, true)
  end)

  it("bad shapes and dtypes name the op and the layouts; meta DTensors give the local meta shapes", function()
    local R = { Rep() }
    local function rep(t) return dist.distribute_tensor(t, mesh, R) end
    local cos, sin = rep(engine.randn(3, 2)), rep(engine.randn(3, 2))
    local e = errmsg(engine.rotary_emb, dist.distribute_tensor(engine.randn(2, 3, 2, 5), mesh, { S(1) }), cos, sin)
    assert.matches("rotary_emb: expected x of shape [B, T, H, D] with an even D, got DTensor(f32[2,3,2,5] on mesh("
      .. W .. ") [Shard(1)])", e, 1, true)
    local dx = dist.distribute_tensor(engine.randn(2, 3, 2, 4), mesh, { S(1) })
    e = errmsg(engine.rotary_emb, dx, rep(engine.randn(4, 2)), sin)
    assert.matches("rotary_emb: expected cos and sin of shape [T, D / 2] = [3, 2] and one dtype for x DTensor("
      .. "f32[2,3,2,4]", e, 1, true)
    assert.matches("got cos DTensor(f32[4,2] on mesh(" .. W .. ") [Replicate()])", e, 1, true)
    e = errmsg(engine.rotary_emb, dx, rep(engine.randn(3, 2):double()), sin)
    assert.matches("rotary_emb: expected cos and sin of one dtype, got cos DTensor(f64[3,2]", e, 1, true)
    e = errmsg(engine.rotary_emb, dx, rep(engine.zeros({ 3, 2 }, { dtype = "i64" })), sin)
    assert.matches("rotary_emb: expected floating point tensors, got x DTensor(f32[2,3,2,4]", e, 1, true)
    -- meta: x sequence sharded, T = 5 (uneven), the tables meta too
    local mx = dist.distribute_tensor(engine.empty({ 2, 5, 2, 4 }, { device = "meta" }), mesh, { S(2) })
    local mc = dist.distribute_tensor(engine.empty({ 5, 2 }, { device = "meta" }), mesh, R)
    local counts, out = dist.count_collectives(function() return engine.rotary_emb(mx, mc, mc) end)
    assert.is_true(nothing(counts))
    assert.is_true(out.is_meta)
    assert.are.equal("[Shard(2)]", pl_str(out.placements))
    assert.same({ 2, 5, 2, 4 }, out:shape())
    assert.same({ 2, dist.local_shard_size_and_offset(5, W, dist.rank()), 2, 4 }, out:to_local():shape())
  end)
end)
