-- ShardedTensor with CUDA placements ("rank:r/cuda:(r % device_count)", PyTorch's layout) on real devices: the
-- scenario of spec/dist/helpers/st_cases.lua (factories, gather to rank 0 and to the last rank with and without
-- out, reshard between chunk / several-shards-per-rank / enumerable specs, to_dtensor on a CUDA mesh and
-- from_dtensor back, elementwise ops and equal/allclose, shard_tensor from host and device tensors,
-- init_from_local_shards, dist.sharded_tensor.save/load and dist.checkpoint save/load with resharding) run with CPU
-- placements and with CUDA placements: every copy equal exactly, arithmetic to 1e-6, the same collective counts,
-- every local shard (and rank 0's gathered tensor, the loaded shards) on cuda, the DTensors on a CUDA mesh.
-- Tagged "#gpu" (pending without a GPU; several ranks on one GPU need NCCL_HOSTID: tools/gpu-check.sh).
--   mpirun -np 2 ... build/engine /usr/bin/busted --ignore-lua -o tools/passfail_dist.lua --tags=gpu spec/dist/cuda_sharded_tensor_spec.lua
local engine = require("engine")
local dist = engine.distributed
local ST = dist.sharded_tensor
local util = require("spec.dist.helpers.util")
local cases = require("spec.dist.helpers.st_cases")

local R, W = dist.rank(), dist.world_size()

describe("ShardedTensor with CUDA placements #gpu", function()
  it("creation, gather, reshard, DTensor bridge, ops and checkpoints equal the CPU placements' results", function()
    util.need_cuda_ranks(pending)
    local cpu, ccpu = cases.run("cpu")
    local dev, cdev, devices = cases.run("cuda")
    assert.are.same({}, cases.compare(cpu, dev, 1e-6))
    local cb = {}
    for k, v in pairs(ccpu) do if cdev[k] ~= v then cb[#cb + 1] = k .. ": " .. v .. " vs " .. tostring(cdev[k]) end end
    table.sort(cb)
    assert.are.same({}, cb)
    local off = {}
    for _, d in ipairs(devices) do if not d:match(":cuda$") then off[#off + 1] = d end end
    assert.are.same({}, off)
    assert.are.equal("cuda", dev["row.dt.mesh"])
    assert.are.equal("true", dev["row.dt.local_is_shard"])
    assert.matches("rank:0/cuda:0", dev["row.dt.back.spec"], 1, true)
  end)

  it("placements name this rank's GPU: another index is refused on every rank; a CPU tensor for a CUDA placement too", function()
    util.need_cuda_ranks(pending)
    local me = engine.cuda.current_device()
    local own = {}
    for r = 0, W - 1 do own[r + 1] = ST._cuda_placement(r) end
    -- rank 0's shard on a GPU index it does not use
    local pls = { unpack(own) }
    pls[1] = "rank:0/cuda:" .. ((R == 0 and me or 0) + 1)
    local e = util.errmsg(ST.zeros, dist.ChunkShardingSpec{ dim = 1, placements = pls }, { 2 * W, 3 })
    if R == 0 then assert.matches("but rank 0 uses GPU " .. me, e, 1, true)
    else assert.matches("another rank cannot hold its shards", e, 1, true) end
    -- a host tensor for a CUDA placement: PyTorch's device mismatch, on every rank
    local m = dist.ChunkShardingSpec{ dim = 1, placements = own }:build_metadata({ 2 * W, 2 }, dist.TensorProperties())
    local e3 = util.errmsg(dist.ShardedTensor.init_from_local_shards,
      { { tensor = engine.zeros({ 2, 2 }), metadata = m.shards_metadata[R + 1] } }, { 2 * W, 2 })
    assert.matches("rank 0's local shard 1 has a tensor on another device than its placement", e3, 1, true)
    -- the same shards on the device are accepted
    local ok = dist.ShardedTensor.init_from_local_shards(
      { { tensor = engine.zeros({ 2, 2 }):to("cuda"), metadata = m.shards_metadata[R + 1] } }, { 2 * W, 2 })
    assert.are.equal("cuda", ok:local_tensor().device)
  end)
end)
