-- The two-node view (tools/multinode.sh: 2 nodes x 2 ranks in two network namespaces, one host name
-- each; ranks 0,1 on the first node, 2,3 on the second).  Checks what "one node" means to the engine:
-- the shared-memory communicator and node-local rank, the single-copy path (usable inside a node, not
-- across, with the reason), and collectives whose groups cross the link or stay inside a node.
-- Outside that run (ENGINE_MULTINODE unset) every test is pending.
local engine = require("engine")
local dist = engine.distributed
local C = engine.C
local util = require("spec.dist.helpers.util")
local diff = util.diff

local R, W = dist.rank(), dist.world_size()
local on = os.getenv("ENGINE_MULTINODE") == "2" and W == 4
local S, Rep = dist.Shard, dist.Replicate

local function host()
  local f = io.open("/proc/sys/kernel/hostname")
  local h = f and f:read("*l") or "?"
  if f then f:close() end
  return h
end

-- every rank's host name, gathered (32 bytes per rank)
local function hosts()
  local h, bytes = host():sub(1, 31), {}
  for i = 1, 32 do bytes[i] = h:byte(i) or 0 end
  local all = dist.all_gather(engine.tensor(bytes, "i32")):tolist_flat()
  local names = {}
  for r = 0, W - 1 do
    local s = {}
    for i = 1, 32 do
      local b = all[r * 32 + i]
      if b == 0 then break end
      s[#s + 1] = string.char(b)
    end
    names[r] = table.concat(s)
  end
  return names
end

describe("two nodes (2 x 2 ranks)", function()
  if not on then
    it("runs only under tools/multinode.sh", function()
      pending("run by tools/multinode.sh (ENGINE_MULTINODE=2, 4 ranks)")
    end)
    return
  end
  local node, lr = math.floor(R / 2), R % 2

  it("each node has its own host name: ranks 0,1 on one, 2,3 on the other", function()
    local names = hosts()
    assert.equal(names[0], names[1])
    assert.equal(names[2], names[3])
    assert.are_not.equal(names[0], names[2])
    assert.equal(host(), names[R])
  end)

  it("the node-local rank comes from the shared-memory communicator: 0,1 on each node", function()
    assert.equal(lr, C.eng_dist_local_rank())
  end)

  it("single copy: not usable on the world (the reason says why), usable inside a node", function()
    local world = dist.world_group()
    assert.is_false(world:single_copy_usable())
    assert.equal("the members are on different nodes", world:single_copy_reason())
    -- rows of a 2x2 mesh: dim 2 ("local") stays inside a node, dim 1 ("node") crosses the link
    local mesh = dist.init_device_mesh("cpu", { 2, 2 }, { "node", "local" })
    assert.is_true(mesh:get_group("local"):single_copy_usable(), mesh:get_group("local"):single_copy_reason())
    assert.equal("", mesh:get_group("local"):single_copy_reason())
    assert.is_false(mesh:get_group("node"):single_copy_usable())
    assert.equal("the members are on different nodes", mesh:get_group("node"):single_copy_reason())
    -- groups built by hand (new_group is collective: every rank creates each of them)
    local cross = { dist.new_group({ 0, 2 }), dist.new_group({ 1, 3 }) }
    local inner = { dist.new_group({ 0, 1 }), dist.new_group({ 2, 3 }) }
    assert.is_false(cross[lr + 1]:single_copy_usable())
    assert.equal("the members are on different nodes", cross[lr + 1]:single_copy_reason())
    assert.is_true(inner[node + 1]:single_copy_usable())
  end)

  it("S(1)->S(2) and S(2)->R inside a node take the single-copy path, across nodes MPI: same results", function()
    local mesh = dist.init_device_mesh("cpu", { 2, 2 }, { "node", "local" })
    engine.manual_seed(7)
    local x = engine.randn({ 256, 1024 })
    local full_want = x:clone()
    for _, case in ipairs({ { Rep(), S(1) }, { S(1), S(1) } }) do
      local d = dist.distribute_tensor(x, mesh, case)
      local n0 = dist.single_copy_count()
      local a = d:redistribute(mesh, { case[1], S(2) })
      local b = a:redistribute(mesh, { Rep(), Rep() })
      assert.is_true(dist.single_copy_count() - n0 >= 1)
      assert.equal(0, diff(b:to_local(), full_want))
      assert.equal(0, diff(a:full_tensor(), full_want))
    end
  end)

  it("collectives across the link: all_reduce of every size class, all_gather, all_to_all, broadcast", function()
    for _, n in ipairs({ 1, 1000, 262144 }) do
      local t = engine.full({ n }, R + 1)
      dist.all_reduce(t)
      local v = t:tolist_flat()
      assert.equal(10, v[1])
      assert.equal(10, v[n])
    end
    assert.same({ 0, 0, 1, 1, 2, 2, 3, 3 }, dist.all_gather(engine.full({ 2 }, R)):tolist_flat())
    local send = {}
    for j = 0, 3 do send[j + 1] = 10 * R + j end
    local want = {}
    for i = 0, 3 do want[i + 1] = 10 * i + R end
    assert.same(want, dist.all_to_all(engine.tensor(send, "f32")):tolist_flat())
    local b = engine.full({ 5 }, R)
    dist.broadcast(b, 3)
    assert.same({ 3, 3, 3, 3, 3 }, b:tolist_flat())
  end)
end)
