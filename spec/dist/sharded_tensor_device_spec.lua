-- ShardedTensor placements on CUDA devices, what the CPU can prove: the validation of "rank:R/cuda:D" placements
-- (mixed devices, no GPU, a GPU index other than the rank's, a shard tensor on another device than its placement),
-- each refused on every rank, and -- with the device probe stubbed (the shards stay CPU tensors, the CUDA paths'
-- control flow runs: the agreement at creation, no single-copy moves, buffers on the shards' device, a CUDA-kind
-- mesh) -- the whole scenario of spec/dist/helpers/st_cases.lua giving exactly the CPU placements' results with the
-- same collective counts.  The #gpu twin on real devices is spec/dist/cuda_sharded_tensor_spec.lua.
--   mpirun -np 2 ... build/engine /usr/bin/busted --ignore-lua -o tools/passfail_dist.lua spec/dist/sharded_tensor_device_spec.lua
local engine = require("engine")
local dist = engine.distributed
local ST = dist.sharded_tensor
local util = require("spec.dist.helpers.util")
local cases = require("spec.dist.helpers.st_cases")

local R, W = dist.rank(), dist.world_size()

-- a machine with `ngpu` GPUs per node, rank r on GPU r % ngpu (the shards stay on the CPU)
local function stub(ngpu, mesh_device)
  return { available = function() return true end, reason = function() return "" end,
    current = function() return R % ngpu end, count = function() return ngpu end,
    tensor_device = "cpu", mesh_device = mesh_device or "cpu" }
end

local function with_stub(p, fn)
  ST._set_device_probe(p)
  local ok, e = pcall(fn)
  ST._set_device_probe(nil)
  if not ok then error(e, 0) end
end

local function pls(fmt)
  local l = {}
  for r = 0, W - 1 do l[r + 1] = string.format(fmt, r, r) end
  return l
end

describe("ShardedTensor CUDA placements: validation", function()
  it("mixed CPU and CUDA placements are refused on every rank, naming both", function()
    local l = pls("rank:%d/cpu")
    l[#l + 1] = "rank:0/cuda:0"
    local e = util.errmsg(ST.zeros, dist.ChunkShardingSpec{ dim = 1, placements = l }, { 8, 2 })
    assert.matches("placements mix devices", e, 1, true)
    assert.matches("rank:0/cpu", e, 1, true)
    assert.matches("rank:0/cuda:0", e, 1, true)
    assert.matches("not supported", e, 1, true)
  end)

  it("without a GPU every rank refuses CUDA placements, the holder naming the reason", function()
    if engine.cuda.is_available() then return pending("this machine has a GPU") end
    local e = util.errmsg(ST.zeros, dist.ChunkShardingSpec{ dim = 1, placements = pls("rank:%d/cuda:0") }, { 8, 2 })
    assert.matches("sharded_tensor.zeros: shard " .. (R + 1) .. " is placed on rank:" .. R .. "/cuda:0, but rank " .. R
      .. " has no usable GPU", e, 1, true)
    -- a rank holding no shard fails too, naming the spec
    if W > 1 then
      local e2 = util.errmsg(ST.zeros, dist.ChunkShardingSpec{ dim = 1, placements = { "rank:0/cuda:0" } }, { 8, 2 })
      if R == 0 then assert.matches("has no usable GPU", e2, 1, true)
      else assert.matches("another rank cannot hold its shards", e2, 1, true) end
    end
    -- a CPU tensor for a CUDA placement: PyTorch's device mismatch, on every rank
    local md = dist.ChunkShardingSpec{ dim = 1, placements = pls("rank:%d/cuda:0") }
      :build_metadata({ 2 * W, 2 }, dist.TensorProperties())
    local e3 = util.errmsg(dist.ShardedTensor.init_from_local_shards,
      { { tensor = engine.zeros({ 2, 2 }), metadata = md.shards_metadata[R + 1] } }, { 2 * W, 2 })
    assert.matches("rank 0's local shard 1 has a tensor on another device than its placement", e3, 1, true)
  end)

  it("a GPU index other than the rank's GPU is refused on every rank; cuda:(r % n) and bare cuda are accepted", function()
    with_stub(stub(2), function()
      -- every rank on its own GPU (r % 2): fine
      local own = {}
      for r = 0, W - 1 do own[r + 1] = ST._cuda_placement(r) end   -- "rank:r/cuda:(r % 2)"
      local st = ST.zeros(dist.ChunkShardingSpec{ dim = 1, placements = own }, { 2 * W, 3 })
      local ok = true
      for r = 0, W - 1 do ok = ok and st:metadata().shards_metadata[r + 1].placement.device == "cuda:" .. r % 2 end
      assert.is_true(ok)
      if W >= 2 then
        -- every placement on GPU 0: the odd ranks (on GPU 1) cannot hold theirs
        local l = pls("rank:%d/cuda:0")
        local e = util.errmsg(ST.ones, dist.ChunkShardingSpec{ dim = 1, placements = l }, { 2 * W, 3 })
        if R % 2 == 1 then
          assert.matches("shard " .. (R + 1) .. " is placed on rank:" .. R .. "/cuda:0, but rank " .. R
            .. " uses GPU 1: the engine keeps one GPU per process", e, 1, true)
          assert.matches("\"rank:" .. R .. "/cuda:1\"", e, 1, true)
        else
          assert.matches("another rank cannot hold its shards", e, 1, true)
        end
      end
      -- "rank:R/cuda": the rank's own GPU
      local st2 = ST.full(dist.ChunkShardingSpec{ dim = 2, placements = pls("rank:%d/cuda") }, { 3, W }, 1)
      assert.are.equal(1, #st2:local_shards())
      -- the placements the engine writes for rank r: r % device_count (PyTorch's)
      assert.are.equal("rank:5/cuda:1", ST._cuda_placement(5))
      assert.are.equal("rank:4/cuda:0", ST._cuda_placement(4))
    end)
  end)

  it("to_dtensor of CUDA placements needs a CUDA mesh; reshard between CPU and CUDA is refused", function()
    with_stub(stub(1, "cuda"), function()
      local st = ST.zeros(dist.ChunkShardingSpec{ dim = 1, placements = pls("rank:%d/cuda:0") }, { 2 * W, 3 })
      local cpu_mesh = dist.init_device_mesh("cpu", { W })
      local e = util.errmsg(function() return st:to_dtensor({ mesh = cpu_mesh }) end)
      assert.matches("mesh is a cpu DeviceMesh, the placements are on CUDA devices: pass a DeviceMesh(\"cuda\"", e, 1, true)
      local e2 = util.errmsg(function() return st:reshard(dist.ChunkShardingSpec{ dim = 2, placements = pls("rank:%d/cpu") }) end)
      assert.matches("moving a ShardedTensor between the CPU and CUDA devices by reshard is not supported", e2, 1, true)
    end)
  end)
end)

describe("ShardedTensor CUDA placements: the CUDA paths with a stubbed device (CPU tensors)", function()
  it("every case equals the CPU placements' result, with the same collective counts and no single-copy moves", function()
    local cpu, ccpu = cases.run("cpu")
    local sc0 = dist.single_copy_count and dist.single_copy_count() or require("engine.distributed.comm").single_copy_count()
    local dev, cdev, devices
    with_stub(stub(1), function() dev, cdev, devices = cases.run("cuda") end)
    local sc1 = require("engine.distributed.comm").single_copy_count()
    assert.are.equal(sc0, sc1, "the CUDA paths moved boxes through the single-copy path")
    local bad = cases.compare(cpu, dev, 1e-6)
    assert.are.same({}, bad)
    -- collective counts: the same kinds and numbers (the CPU path's single-copy moves count as the collective
    -- they replace)
    local cb = {}
    for k, v in pairs(ccpu) do if cdev[k] ~= v then cb[#cb + 1] = k .. ": " .. v .. " vs " .. tostring(cdev[k]) end end
    table.sort(cb)
    assert.are.same({}, cb)
    assert(#devices > 0)
  end)

  it("large moves: the CPU placements' single-copy path is not taken for CUDA placements (device memory)", function()
    local comm = require("engine.distributed.comm")
    local function enum(kind)
      local sh = {}
      for r = 0, W - 1 do
        sh[#sh + 1] = dist.ShardMetadata{ shard_offsets = { 0, r * 64 }, shard_sizes = { 64, 64 }, placement = cases.pl(r, kind) }
      end
      return dist.EnumerableShardingSpec(sh)
    end
    local function moves(kind)
      engine.manual_seed(3)
      local st = ST.rand(enum(kind), { 64, 64 * W })
      local before = comm.single_copy_count()
      local c1, g = util.counted(function() return st:gather(0) end)
      local c2 = util.counted(function() st:reshard(dist.ChunkShardingSpec{ dim = 1, placements = cases.specs(kind).row.placements }) end)
      return comm.single_copy_count() - before, c1, c2, g, st:gather(0)
    end
    local n_cpu, g_cpu, r_cpu, full_cpu, re_cpu = moves("cpu")
    local n_dev, g_dev, r_dev, full_dev, re_dev
    with_stub(stub(1), function() n_dev, g_dev, r_dev, full_dev, re_dev = moves("cuda") end)
    assert.are.equal(0, n_dev)
    if W > 1 and comm.world_group():single_copy_usable() then assert(n_cpu > 0, "the CPU path moved no box once") end
    assert.are.equal(g_cpu, g_dev)
    assert.are.equal(r_cpu, r_dev)
    if R == 0 then
      assert.are.equal(0, util.diff(full_cpu, full_dev))
      assert.are.equal(0, util.diff(re_cpu, re_dev))
    end
  end)
end)
