-- C14 and meta-init (pytorch-semantics 1.x "meta device", C14; test_dtensor.py::test_meta_dtensor):
-- distribute_tensor of a meta tensor stays meta without communicating, empty_like(dt,
-- {device = "cpu"}) materialises the local shard, init.constant_ fills it; a module built on
-- meta, sharded, materialised with to_empty and re-initialised equals the single-process
-- initialisation with the same seed (in-place random fills of a DTensor draw its shard's
-- slice of the global random tensor).
local engine = require("engine")
local dist = engine.distributed
local nn = engine.nn
local S, R = dist.Shard, dist.Replicate

local W = dist.world_size()

local function errmsg(fn, ...)
  local ok, e = pcall(fn, ...)
  if ok then return nil end
  return tostring(e)
end

local function total(counts)
  local n = 0
  for _, v in pairs(counts) do n = n + v end
  return n
end

describe("C14: meta DTensors", function()
  local mesh = dist.init_device_mesh("cpu", { W })

  it("distribute_tensor(meta(1024, 2048), [Shard(1)]) is meta and communicates nothing", function()
    local m = engine.empty({ 1024, 2048 }, { device = "meta" })
    local counts, d = dist.count_collectives(dist.distribute_tensor, m, mesh, { S(1) })
    assert.equal(0, total(counts))
    assert.is_true(d.is_meta)
    assert.is_true(d:to_local().is_meta)
    assert.same({ 1024, 2048 }, d:shape())
    local sz = dist.local_shard_size_and_offset(1024, W, dist.rank())
    assert.same({ sz, 2048 }, d:to_local():shape())
    -- every layout change and full_tensor stay meta, without collectives
    local c2, r = dist.count_collectives(function() return d:redistribute(mesh, { S(2) }) end)
    assert.equal(0, total(c2))
    assert.is_true(r.is_meta)
    assert.same({ 1024, (dist.local_shard_size_and_offset(2048, W, dist.rank())) }, r:to_local():shape())
    local c3, f = dist.count_collectives(function() return d:full_tensor() end)
    assert.equal(0, total(c3))
    assert.is_true(f.is_meta)
    assert.same({ 1024, 2048 }, f:shape())
  end)

  it("empty_like(dt, {device = 'cpu'}) materialises the shard; init.constant_(1.2) fills it", function()
    local d = dist.distribute_tensor(engine.empty({ 1024, 2048 }, { device = "meta" }), mesh, { S(1) })
    local e = engine.empty_like(d, { device = "cpu" })
    assert.is_false(e.is_meta)
    assert.is_true(dist.DTensor.is_dtensor(e))
    assert.same(d.placements, e.placements)
    assert.same({ 1024, 2048 }, e:shape())
    assert.same(d:to_local():shape(), e:to_local():shape())
    nn.init.constant_(e, 1.2)
    local l = e:to_local()
    assert.near(1.2, l:min():item(), 1e-6)
    assert.near(1.2, l:max():item(), 1e-6)
    -- the other *_like keep the layout too
    local z = engine.zeros_like(d, { device = "cpu" })
    assert.equal(0, z:to_local():abs():sum():item())
    local f = engine.full_like(d, 3, { device = "cpu", dtype = "f64" })
    assert.equal("f64", f.dtype)
    assert.equal(3, f:to_local():max():item())
  end)

  it("from_local of a meta shard (run_check) makes a meta DTensor and broadcasts no data", function()
    local loc = engine.empty({ 4, 3 }, { device = "meta" })
    local counts, d = dist.count_collectives(dist.DTensor.from_local, loc, mesh, { R() }, { run_check = true })
    assert.is_nil(counts.broadcast)
    assert.is_true(d.is_meta)
    assert.same({ 4, 3 }, d:shape())
  end)

  it("ops on meta DTensors propagate the layout and give meta local shards, without collectives", function()
    local d = dist.distribute_tensor(engine.empty({ 8, 4 }, { device = "meta" }), mesh, { S(1) })
    local w = dist.distribute_tensor(engine.empty({ 4, 6 }, { device = "meta" }), mesh, { R() })
    local counts, y, s, p = dist.count_collectives(function()
      local y = (d * 2 + 1):matmul(w):relu()
      return y, y:sum(), y:sum():redistribute(mesh, { R() })
    end)
    assert.equal(0, total(counts))
    assert.is_true(y.is_meta)
    assert.same({ 8, 6 }, y:shape())
    assert.same({ S(1) }, y.placements)
    assert.same({ (dist.local_shard_size_and_offset(8, W, dist.rank())), 6 }, y:to_local():shape())
    assert.is_true(s.is_meta)
    assert.same({ dist.Partial() }, s.placements)
    assert.same({}, p:shape())
    assert.is_true(p.is_meta)
    -- a 2-d mesh: linear, views, reshape, softmax (a Replicate redistribution, shape only), layer_norm,
    -- embedding with a column-sharded weight, split, cat, sum: all meta, no collectives
    if W == 4 then
      local m2 = dist.init_device_mesh("cpu", { 2, 2 }, { "dp", "tp" })
      local function M(...) return engine.empty({ ... }, { device = "meta" }) end
      local x = dist.distribute_tensor(M(8, 6, 16), m2, { S(1), R() })
      local w2 = dist.distribute_tensor(M(32, 16), m2, { R(), S(1) })
      local c2, outs = dist.count_collectives(function()
        local h = nn.functional.linear(x, w2)
        local ids = dist.distribute_tensor(engine.empty({ 8, 6 }, { device = "meta", dtype = "i64" }), m2, { S(1), R() })
        return { h, h:view(8, 6, 4, 8):transpose(2, 3), h:reshape(48, 32), h:softmax(-1),
          nn.functional.layer_norm(h, { 32 }), nn.functional.embedding(ids, dist.distribute_tensor(M(100, 16), m2, { R(), S(2) })),
          h:split(8, 3)[1], engine.cat({ h, h }, 3), h:sum() }
      end)
      assert.equal(0, total(c2))
      local want = { { 8, 6, 32 }, { 8, 4, 6, 8 }, { 48, 32 }, { 8, 6, 32 }, { 8, 6, 32 }, { 8, 6, 16 }, { 8, 6, 8 },
        { 8, 6, 64 }, {} }
      for i, t in ipairs(outs) do
        assert.is_true(t.is_meta, i)
        assert.same(want[i], t:shape(), i)
        assert.equal("f32", t.dtype)
      end
      assert.same({ S(1), S(3) }, outs[1].placements)
      assert.same({ S(1), R() }, outs[4].placements)
      assert.same({ 4, 6, 16 }, outs[1]:to_local():shape())
    end
    -- a meta DTensor and a materialised one: a device error
    local real = dist.distribute_tensor(engine.ones(8, 4), mesh, { S(1) })
    local e = errmsg(function() return d + real end)
    assert.is_truthy(e and e:find("different devices", 1, true), e)
  end)
end)

describe("in-place random fills of DTensors", function()
  local mesh = dist.init_device_mesh("cpu", { W })

  for _, case in ipairs({ { "Shard(1)", { S(1) } }, { "Shard(2)", { S(2) } }, { "Replicate", { R() } } }) do
    it("uniform_ / normal_ on " .. case[1] .. " equal the single-process fill (uneven 7x5)", function()
      engine.manual_seed(21)
      local u = engine.rand(7, 5)
      local n = engine.randn(7, 5)
      local after = engine.rand(2)
      engine.manual_seed(21)
      local d = dist.zeros({ 7, 5 }, { mesh = mesh, placements = case[2] })
      nn.init.uniform_(d)
      assert.equal(0, (d:full_tensor() - u):abs():max():item())
      nn.init.normal_(d)
      assert.equal(0, (d:full_tensor() - n):abs():max():item())
      -- every rank advanced the generator by the global numel
      assert.equal(0, (engine.rand(2) - after):abs():max():item())
    end)
  end

  it("a Partial DTensor cannot be filled", function()
    local d = dist.DTensor.from_local(engine.zeros(2, 2), mesh, { dist.Partial() })
    local e = errmsg(nn.init.uniform_, d)
    assert.is_truthy(e and e:find("uniform_:", 1, true) and e:find("Partial", 1, true), e)
  end)
end)

describe("meta-init of a sharded module", function()
  it("build on meta, shard the weights, to_empty, reset_parameters == single-process init", function()
    local mesh = dist.init_device_mesh("cpu", { W })
    local function build() return nn.Sequential(nn.Linear(12, 10), nn.Linear(10, 6)) end
    engine.manual_seed(7)
    local ref = build()
    engine.manual_seed(7)
    local m = engine.with_device("meta", build)
    local counts = dist.count_collectives(function()
      dist.distribute_module(m, mesh, function(name, sub)
        if name == "0" then
          sub.weight = nn.Parameter(dist.distribute_tensor(sub.weight:detach(), mesh, { S(1) }))
          sub.bias = nn.Parameter(dist.distribute_tensor(sub.bias:detach(), mesh, { S(1) }))
        elseif name == "1" then
          sub.weight = nn.Parameter(dist.distribute_tensor(sub.weight:detach(), mesh, { S(2) }))
        end
      end)
    end)
    assert.equal(0, total(counts)) -- meta: nothing to scatter or broadcast
    assert.is_true(m[1].weight.is_meta)
    m:to_empty({ device = "cpu" })
    assert.is_false(m[1].weight.is_meta)
    assert.same(m[1].weight.placements, { S(1) })
    for _, sub in ipairs(m:modules()) do
      if sub.reset_parameters then sub:reset_parameters() end
    end
    local rp = ref:parameters()
    for i, p in ipairs(m:parameters()) do
      assert.is_true(dist.DTensor.is_dtensor(p))
      assert.equal(0, (p:full_tensor() - rp[i]):abs():max():item())
    end
    -- and it trains: forward, backward on the materialised DTensor parameters
    local x = dist.distribute_tensor(engine.ones(3, 12), mesh, { R() })
    local y = m(x)
    y:full_tensor():sum():backward()
    assert.same({ 10, 12 }, m[1].weight.grad:shape())
  end)
end)
