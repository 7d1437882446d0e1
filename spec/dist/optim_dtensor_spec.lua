-- Optimizers and gradient clipping over DTensor parameters: the fused AdamW /
-- SGD kernels step the local shards when param, grad and state share one
-- layout (the state is created in the param's layout), and must equal the
-- single-process steps on the full tensors (Shard on either dim, Replicate,
-- uneven shards, a 2x2 mesh); a gradient in another layout is an error naming
-- both layouts.  clip_grad_norm_ / global_norm over DTensors (mixed with plain
-- tensors) give the single-process norm on every rank and clip the shards.
local engine = require("engine")
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local diff, errmsg = util.diff, util.errmsg
local optim = engine.optim

local R, W = dist.rank(), dist.world_size()
local S, Rep, Part = dist.Shard, dist.Replicate, dist.Partial


local mesh1 = dist.init_device_mesh("cpu", { W })
local mesh2 = W == 4 and dist.init_device_mesh("cpu", { 2, 2 }, { "dp", "tp" }) or nil

-- layouts: {name, mesh, placements}; shapes chosen uneven for 2 and 4 ranks
local layouts = {
  { "Shard(1)", mesh1, { S(1) } },
  { "Shard(2)", mesh1, { S(2) } },
  { "Replicate", mesh1, { Rep() } },
}
if mesh2 then
  layouts[#layouts + 1] = { "2x2 [Shard(1), Shard(2)]", mesh2, { S(1), S(2) } }
  layouts[#layouts + 1] = { "2x2 [Replicate, Shard(2)]", mesh2, { Rep(), S(2) } }
  layouts[#layouts + 1] = { "2x2 [Shard(2), Shard(2)]", mesh2, { S(2), S(2) } }
end

local SHAPES = { { 5, 7 }, { 3, 9 } }

-- Full-tensor data, the same on every rank.
local function full_data(seed, shape, dtype)
  engine.manual_seed(seed)
  return engine.randn(shape, { dtype = dtype or "f64" })
end

local function dparam(full, mesh, pl)
  local d = dist.distribute_tensor(full:clone(), mesh, pl)
  d.requires_grad = true
  return d
end

local function run_steps(make_opt, layout, dtype, nsteps)
  local mesh, pl = layout[2], layout[3]
  local refs, ds = {}, {}
  for i, shape in ipairs(SHAPES) do
    local f = full_data(10 + i, shape, dtype)
    refs[i] = f:clone(); refs[i].requires_grad = true
    ds[i] = dparam(f, mesh, pl)
  end
  local oref, od = make_opt(refs), make_opt(ds)
  for step = 1, nsteps do
    for i, shape in ipairs(SHAPES) do
      local g = full_data(100 * step + i, shape, dtype)
      refs[i].grad = g
      ds[i].grad = dist.distribute_tensor(g:clone(), mesh, pl)
    end
    oref:step(); od:step()
  end
  return refs, ds, od
end

describe("optimizers over DTensor parameters", function()
  for _, layout in ipairs(layouts) do
    it("AdamW steps on " .. layout[1] .. " params equal the single-process steps (f64)", function()
      local refs, ds, od = run_steps(function(ps)
        return optim.AdamW(ps, { lr = 0.1, betas = { 0.9, 0.95 }, weight_decay = 0.1 })
      end, layout, "f64", 3)
      for i = 1, #refs do
        assert.is_true(diff(ds[i]:full_tensor(), refs[i]) < 1e-12, layout[1] .. " param " .. i)
        local st = od.state[ds[i]]
        assert.is_true(dist.is_dtensor(st.exp_avg) and dist.is_dtensor(st.exp_avg_sq))
        assert.are.equal(tostring(ds[i].placements[1]), tostring(st.exp_avg.placements[1]))
        assert.are.same(ds[i]:shape(), st.exp_avg_sq:shape())
      end
    end)

    it("AdamW on " .. layout[1] .. " f32 params", function()
      local refs, ds = run_steps(function(ps) return optim.AdamW(ps, { lr = 0.01 }) end, layout, "f32", 2)
      for i = 1, #refs do assert.is_true(diff(ds[i]:full_tensor(), refs[i]) < 1e-6) end
    end)

    it("SGD with momentum and nesterov on " .. layout[1] .. " params", function()
      local refs, ds, od = run_steps(function(ps)
        return optim.SGD(ps, { lr = 0.1, momentum = 0.9, nesterov = true, weight_decay = 0.01 })
      end, layout, "f64", 3)
      for i = 1, #refs do
        assert.is_true(diff(ds[i]:full_tensor(), refs[i]) < 1e-12)
        assert.is_true(dist.is_dtensor(od.state[ds[i]].momentum_buffer))
      end
    end)
  end

  it("a gradient in another layout is an error naming both layouts", function()
    local p = dparam(full_data(1, { 3, 4 }), mesh1, { Rep() })
    p.grad = dist.DTensor.from_local(engine.ones({ 3, 4 }, { dtype = "f64" }), mesh1, { Part() })
    local opt = optim.AdamW({ p }, { lr = 0.1 })
    local e = errmsg(function() opt:step() end)
    assert.is_truthy(e:find("grad 1 has layout DTensor(f64[3,4] on mesh(" .. W .. ") [Partial(sum)]", 1, true), e)
    assert.is_truthy(e:find("but its param has layout DTensor(f64[3,4] on mesh(" .. W .. ") [Replicate()]", 1, true), e)
    -- a plain gradient for a DTensor param, and a DTensor gradient for a plain param
    local q = dparam(full_data(2, { 2 * W, 3 }), mesh1, { S(1) })
    q.grad = engine.ones({ 2, 3 }, { dtype = "f64" })
    e = errmsg(function() optim.SGD({ q }, { lr = 0.1 }):step() end)
    assert.is_truthy(e:find("grad 1 has layout f64[2,3] but its param has layout DTensor(f64[" .. 2 * W
      .. ",3] on mesh(" .. W .. ") [Shard(1)]", 1, true), e)
    local r = engine.zeros({ 2, 3 }, { dtype = "f64" })
    r.requires_grad = true
    r.grad = dist.distribute_tensor(engine.ones({ 2 * W, 3 }, { dtype = "f64" }), mesh1, { S(1) })
    e = errmsg(function() optim.SGD({ r }, { lr = 0.1 }):step() end)
    assert.is_truthy(e:find("but its param has layout f64[2,3]", 1, true), e)
  end)
end)

describe("clip_grad_norm_ and global_norm over DTensors", function()
  -- params in several layouts plus a plain one; grads set from fixed full tensors
  local function setup()
    local specs = {}
    for _, l in ipairs(layouts) do specs[#specs + 1] = l end
    local refs, ds = {}, {}
    for i, l in ipairs(specs) do
      local shape = i % 2 == 1 and { 5, 7 } or { 3, 9 }
      local f = full_data(i, shape)
      local g = full_data(50 + i, shape) * (i / 2)
      refs[i] = f:clone(); refs[i].requires_grad = true; refs[i].grad = g
      ds[i] = dparam(f, l[2], l[3]); ds[i].grad = dist.distribute_tensor(g:clone(), l[2], l[3])
    end
    local n = #refs + 1
    local f, g = full_data(77, { 4 }), full_data(78, { 4 })
    refs[n] = f:clone(); refs[n].requires_grad = true; refs[n].grad = g
    ds[n] = f:clone(); ds[n].requires_grad = true; ds[n].grad = g:clone()
    return refs, ds
  end

  for _, p in ipairs({ 2, 1, 3, "inf" }) do
    it("the total norm (p = " .. tostring(p) .. ") equals the single-process norm on every rank", function()
      local refs, ds = setup()
      local want = optim.clip_grad_norm_(refs, 1e30, p)
      local got = optim.clip_grad_norm_(ds, 1e30, p)
      -- PyTorch's return type: a 0-dim tensor of the gradients' dtype, a DTensor for DTensor gradients (here
      -- Replicate on the first DTensor gradient's mesh: already reduced, read with item() or full_tensor())
      assert.is_false(dist.is_dtensor(want))
      assert.are.same({ 0, "f64" }, { want:dim(), want.dtype })
      assert.is_true(dist.is_dtensor(got), tostring(got))
      assert.are.same({ 0, "f64" }, { got:dim(), got.dtype })
      for _, pl in ipairs(got.placements) do assert.is_true(pl:is_replicate(), tostring(got)) end
      assert.are.equal(1, #got.placements) -- the first gradient's mesh: mesh1
      assert.are.equal(got:item(), got:full_tensor():item())
      want, got = want:item(), got:item()
      assert.is_true(math.abs(got - want) <= 1e-12 * math.max(1, want), got .. " vs " .. want)
      local all = dist.allreduce_counts({ math.floor(got * 1e6) })[1]
      assert.are.equal(W * math.floor(got * 1e6), all)
      local gn = {}
      for i = 1, #ds do gn[i] = ds[i].grad end
      assert.is_true(math.abs(optim.global_norm(gn, p) - want) <= 1e-12 * math.max(1, want))
      assert.is_true(math.abs(optim.grad_norm(ds, p):item() - want) <= 1e-12 * math.max(1, want))
    end)
  end

  it("clipping scales the local shards like the single-process clip", function()
    local refs, ds = setup()
    local want = optim.clip_grad_norm_(refs, 0.5):item()
    local got = optim.clip_grad_norm_(ds, 0.5):item()
    assert.is_true(math.abs(got - want) <= 1e-12 * want)
    for i = 1, #ds do
      local g = ds[i].grad
      local full = dist.is_dtensor(g) and g:full_tensor() or g
      assert.is_true(diff(full, refs[i].grad) < 1e-12, "grad " .. i)
    end
    local after = optim.clip_grad_norm_(ds, 1e30):item()
    assert.is_true(math.abs(after - 0.5) < 1e-6)
  end)

  -- PyTorch's count (test_fully_shard_clip_grad_norm_): one all_reduce per placement of the norm, i.e. per
  -- mesh dim where some gradient is sharded, whatever mix of layouts the gradients have
  it("uses one all_reduce per sharded mesh dim and none for replicated tensors", function()
    local d = dparam(full_data(3, { 5, 7 }), mesh1, { Rep() })
    d.grad = dist.distribute_tensor(full_data(4, { 5, 7 }), mesh1, { Rep() })
    local c = dist.count_collectives(optim.clip_grad_norm_, { d }, 1.0)
    assert.are.same({}, c)
    local s = dparam(full_data(3, { 5, 7 }), mesh1, { S(2) })
    s.grad = dist.distribute_tensor(full_data(4, { 5, 7 }), mesh1, { S(2) })
    c = dist.count_collectives(optim.clip_grad_norm_, { d, s }, 1.0)
    assert.are.same(W > 1 and { all_reduce = 1 } or {}, c)
    c = dist.count_collectives(optim.grad_norm, { d, s })
    assert.are.same(W > 1 and { all_reduce = 1 } or {}, c)
  end)

  if mesh2 then
    it("on a 2x2 mesh: one all_reduce per mesh dim for any mix of layouts (was one per layout and dim)", function()
      -- [Shard, Replicate], [Replicate, Shard], [Shard, Shard] and [Replicate, Replicate] gradients: 2 all_reduces
      local pls = { { S(1), Rep() }, { Rep(), S(2) }, { S(1), S(2) }, { Rep(), Rep() }, { S(2), S(2) } }
      local refs, ds = {}, {}
      for i, pl in ipairs(pls) do
        local f, g = full_data(200 + i, { 5, 7 }), full_data(300 + i, { 5, 7 }) * i
        refs[i] = f:clone(); refs[i].requires_grad = true; refs[i].grad = g
        ds[i] = dparam(f, mesh2, pl); ds[i].grad = dist.distribute_tensor(g:clone(), mesh2, pl)
      end
      for _, p in ipairs({ 2, 1, "inf" }) do
        local want = optim.clip_grad_norm_(refs, 1e30, p):item()
        local got
        local c = dist.count_collectives(function() got = optim.clip_grad_norm_(ds, 1e30, p) end)
        assert.are.same({ all_reduce = #got.placements }, c)
        assert.are.equal(2, #got.placements)
        assert.is_true(math.abs(got:item() - want) <= 1e-12 * math.max(1, want), p .. ": " .. got:item() .. " vs " .. want)
      end
      -- only dp-sharded gradients: one
      local c = dist.count_collectives(optim.clip_grad_norm_, { ds[1], ds[4] }, 1e30)
      assert.are.same({ all_reduce = 1 }, c)
    end)
  end

  it("a Partial gradient is an error", function()
    local p = dparam(full_data(1, { 3, 4 }), mesh1, { Rep() })
    p.grad = dist.DTensor.from_local(engine.ones({ 3, 4 }, { dtype = "f64" }), mesh1, { Part() })
    local e = errmsg(optim.clip_grad_norm_, { p }, 1.0)
    assert.is_truthy(e:find("a Partial placement has no norm", 1, true), e)
  end)
end)
