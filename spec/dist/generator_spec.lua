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
