-- User generators and DTensors; dist.manual_seed(seed, mesh) (PyTorch's _random.manual_seed).
-- nn.init on a DTensor with a generator fills each shard with its box of the global random tensor
-- that one process draws from a generator with the same seed, and advances the user generator by the
-- global count on every rank (pytorch-semantics 1.5, test_init_with_user_generator).
local engine = require("engine")
local nn = engine.nn
local dist = engine.distributed
local util = require("spec.dist.helpers.util")

local W, R = dist.world_size(), dist.rank()
local S, Rep = dist.Shard, dist.Replicate
local mesh = dist.init_device_mesh("cpu", { W })

describe("generators and DTensors", function()
  it("nn.init.uniform_/normal_ of a sharded DTensor with a generator: the one-process tensor, generator advanced", function()
    for _, pl in ipairs({ { S(1) }, { S(2) }, { Rep() } }) do
      local d = dist.distribute_tensor(engine.zeros(2 * W + 1, 6), mesh, pl)
      local g = engine.Generator():manual_seed(1234)
      engine.manual_seed(5)
      nn.init.uniform_(d, -1, 1, g)
      nn.init.normal_(d, 0, 2, { generator = g })
      assert.are.same({ seed = 5, offset = 0 }, engine.get_rng_state())
      local ref_g = engine.Generator():manual_seed(1234)
      local ref = engine.empty(2 * W + 1, 6)
      nn.init.uniform_(ref, -1, 1, ref_g)
      nn.init.normal_(ref, 0, 2, ref_g)
      assert.are.equal(0, util.diff(d:full_tensor(), ref), tostring(pl[1]))
      assert.are.same(ref_g:get_state(), g:get_state())
    end
  end)

  it("dist.manual_seed(seed, mesh) seeds the DTensor random ops: every layout gives the same tensor", function()
    dist.manual_seed(77, mesh)
    local a = dist.rand({ 4, W * 2 }, { mesh = mesh, placements = { S(2) } })
    dist.manual_seed(77, mesh)
    local b = dist.rand({ 4, W * 2 }, { mesh = mesh, placements = { Rep() } })
    engine.manual_seed(77)
    local c = engine.rand(4, W * 2)
    assert.are.equal(0, util.diff(a:full_tensor(), c))
    assert.are.equal(0, util.diff(b:full_tensor(), c))
  end)

  it("dist.rand / randn / rand_like / randn_like / dropout with a generator: the one-process tensor for every layout", function()
    local meshes = { mesh }
    if W == 4 then meshes[2] = dist.init_device_mesh("cpu", { 2, 2 }) end
    local shape = { 2 * W + 1, 3 }
    for _, m in ipairs(meshes) do
      for _, pl in ipairs(require("spec.dist.helpers.converter").placement_lists(2, m:ndim())) do
        local what = tostring(m) .. " " .. tostring(pl[1]) .. (pl[2] and (", " .. tostring(pl[2])) or "")
        engine.manual_seed(5)
        local g = engine.Generator():manual_seed(99)
        local a = dist.rand(shape, { mesh = m, placements = pl, generator = g })
        local b = dist.randn(shape, { mesh = m, placements = pl, generator = g, dtype = "f64" })
        local c = engine.rand_like(a, { generator = g })
        local d = engine.randn_like(b, { generator = g })
        local x = dist.distribute_tensor(engine.ones(shape[1], shape[2], { dtype = "f64" }), m, pl)
        local e = engine.dropout(x, 0.5, true, { generator = g })
        local f = nn.Dropout(0.3, { generator = g })(x)
        assert.are.same({ seed = 5, offset = 0 }, engine.get_rng_state(), what)
        for _, t in ipairs({ a, b, c, d, e, f }) do
          assert.is_true(dist.is_dtensor(t), what)
          assert.are.equal(tostring(pl[1]), tostring(t.placements[1]), what)
        end
        local rg = engine.Generator():manual_seed(99)
        local ra = engine.rand(shape, { generator = rg })
        local rb = engine.randn(shape, { generator = rg, dtype = "f64" })
        local rc = engine.rand(shape, { generator = rg })
        local rd = engine.randn(shape, { generator = rg, dtype = "f64" })
        local ones = engine.ones(shape[1], shape[2], { dtype = "f64" })
        local re = engine.dropout(ones, 0.5, true, { generator = rg })
        local rf = engine.dropout(ones, 0.3, true, { generator = rg })
        for i, p in ipairs({ { a, ra }, { b, rb }, { c, rc }, { d, rd }, { e, re }, { f, rf } }) do
          assert.are.equal(0, util.diff(p[1]:full_tensor(), p[2]), what .. " draw " .. i)
        end
        assert.are.same(rg:get_state(), g:get_state(), what)
      end
    end
  end)

  it("dist.sharded_tensor.rand / randn / *_like with a generator: the one-process tensor, generator advanced", function()
    local ranks = {}
    for r = 0, W - 1 do ranks[#ranks + 1] = "rank:" .. r .. "/cpu" end
    for _, spec in ipairs({ dist.ChunkShardingSpec{ dim = 1, placements = ranks },
                            dist.ChunkShardingSpec{ dim = 2, placements = { ranks[W] } } }) do
      engine.manual_seed(5)
      local g = engine.Generator():manual_seed(41)
      local a = dist.sharded_tensor.rand(spec, { 7, 5 }, { generator = g })
      local b = dist.sharded_tensor.randn(spec, { 7, 5 }, { generator = g, dtype = "f64" })
      local c = dist.sharded_tensor.rand_like(a, { generator = g })
      assert.are.same({ seed = 5, offset = 0 }, engine.get_rng_state())
      local rg = engine.Generator():manual_seed(41)
      local ra, rb, rc = engine.rand(7, 5, { generator = rg }), engine.randn(7, 5, { generator = rg, dtype = "f64" }),
        engine.rand(7, 5, { generator = rg })
      local fa, fb, fc = a:gather(0), b:gather(0), c:gather(0)
      if R == 0 then
        assert.are.equal(0, util.diff(fa, ra))
        assert.are.equal(0, util.diff(fb, rb))
        assert.are.equal(0, util.diff(fc, rc))
      end
      assert.are.same(rg:get_state(), g:get_state())
    end
    assert.matches("generator must be an engine.Generator", util.errmsg(dist.sharded_tensor.rand,
      dist.ChunkShardingSpec{ dim = 1, placements = ranks }, { 4, 4 }, { generator = 7 }))
  end)

  it("dist.manual_seed: bad seed, not a mesh, and a rank outside the mesh fail naming the problem", function()
    assert.matches("seed must be an integer", util.errmsg(dist.manual_seed, -1, mesh))
    assert.matches("expected a DeviceMesh", util.errmsg(dist.manual_seed, 1, "mesh"))
    if W > 1 then
      local sub = dist.DeviceMesh("cpu", { 0 })
      if R ~= 0 then
        assert.matches("requires the current rank %(" .. R .. "%) to be a part of the device mesh",
          util.errmsg(dist.manual_seed, 1, sub))
      else
        dist.manual_seed(3, sub)
        assert.are.same({ seed = 3, offset = 0 }, engine.get_rng_state())
      end
    end
  end)
end)
