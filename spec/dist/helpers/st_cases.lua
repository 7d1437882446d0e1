-- The ShardedTensor scenario run once with CPU placements and once with CUDA placements ("rank:r/cuda:D"), whose
-- host copies the specs compare: spec/dist/cuda_sharded_tensor_spec.lua (#gpu: real CUDA shards through NCCL) and
-- spec/dist/sharded_tensor_device_spec.lua (CPU: the CUDA paths' logic with a stubbed device probe, tensors on
-- the CPU).  M.run(kind) -> {name = host tensor or value}, the collective counts of the data moves, and the
-- devices every local shard had.  Covers factories, gather (dst 0 and the last rank, with and without out), reshard
-- between every pair of specs, to_dtensor / from_dtensor, elementwise ops and comparisons, shard_tensor (from a
-- host and from a device tensor), init_from_local_shards, dist.sharded_tensor.save/load and dist.checkpoint
-- save/load with resharding.
local engine = require("engine")
local dist = engine.distributed
local ST = dist.sharded_tensor
local util = require("spec.dist.helpers.util")

local M = {}
local R, W = dist.rank(), dist.world_size()
local SIZE = { 7, 8 }

function M.pl(r, kind)
  if kind == "cpu" then return "rank:" .. r .. "/cpu" end
  return ST._cuda_placement(r)
end

-- row: dim 1 over the ranks (uneven); col: dim 2 over the ranks in reverse; twice: 2W chunks of dim 1, two
-- per rank (the last empty); enum: two row bands x W column bands, bands placed round-robin from rank 1.
function M.specs(kind)
  local all, rev, twice, shards = {}, {}, {}, {}
  for r = 0, W - 1 do all[#all + 1] = M.pl(r, kind); rev[#rev + 1] = M.pl(W - 1 - r, kind) end
  for i = 0, 2 * W - 1 do twice[#twice + 1] = M.pl(i % W, kind) end
  local cw = SIZE[2] / W
  for b = 0, 1 do
    for c = 0, W - 1 do
      shards[#shards + 1] = dist.ShardMetadata{ shard_offsets = { b * 4, c * cw }, shard_sizes = { b == 0 and 4 or 3, cw },
        placement = M.pl((c + b + 1) % W, kind) }
    end
  end
  return {
    row = dist.ChunkShardingSpec{ dim = 1, placements = all },
    col = dist.ChunkShardingSpec{ dim = 2, placements = rev },
    twice = dist.ChunkShardingSpec{ dim = 1, placements = twice },
    enum = dist.EnumerableShardingSpec(shards),
  }
end
M.NAMES = { "row", "col", "twice", "enum" }

local function host(t)
  if dist.is_dtensor(t) then t = t:full_tensor() end
  return t:detach():to("cpu"):clone()
end

function M.run(kind)
  local dev = ST._device_of_kind(kind)
  local out, counts, devices = {}, {}, {}
  local sp = M.specs(kind)
  local function locals(name, st)
    for i, s in ipairs(st:local_shards()) do
      out[name .. "/" .. i] = host(s.tensor)
      devices[#devices + 1] = name .. ":" .. s.tensor.device
    end
    out[name .. "/n"] = #st:local_shards()
  end
  for _, n in ipairs(M.NAMES) do
    local s = sp[n]
    locals(n .. ".zeros", ST.zeros(s, SIZE))
    locals(n .. ".ones", ST.ones(s, 7, 8, { dtype = "f64" }))
    locals(n .. ".full", ST.full(s, SIZE, 2.5))
    engine.manual_seed(11)
    local x = ST.rand(s, SIZE)
    locals(n .. ".rand", x)
    engine.manual_seed(12)
    locals(n .. ".randn", ST.randn(s, SIZE, { dtype = "f64" }))
    -- gather
    local c, g = util.counted(function() return x:gather(0) end)
    counts[n .. ".gather"] = c
    if R == 0 then out[n .. ".gather"] = host(g); devices[#devices + 1] = n .. ".gather:" .. g.device end
    local o = R == W - 1 and engine.zeros(SIZE) or nil
    local g2 = x:gather(W - 1, o)
    if R == W - 1 then assert(rawequal(g2, o)); out[n .. ".gather_out"] = host(o) end
    -- ops (the local shards on their device) and comparisons
    locals(n .. ".ops", ((x * 2 + x):relu() - x:exp() / 3 + x:sigmoid()):maximum(x * 0.5))
    locals(n .. ".cmp", x:gt(0.5))
    local y = x:clone()
    out[n .. ".equal"] = tostring(x:equal(y)) .. "," .. tostring(x:equal(x + 1)) .. ","
      .. tostring(x:allclose(x + 1e-9)) .. "," .. tostring(x:allclose(x + 1e-3))
    y:fill_(3)
    locals(n .. ".fill", y)
    -- reshard to every other spec
    for _, m in ipairs(M.NAMES) do
      if m ~= n then
        engine.manual_seed(13)
        local z = ST.rand(s, SIZE)
        local cc = util.counted(function() z:reshard(sp[m]) end)
        counts[n .. ">" .. m] = cc
        locals(n .. ">" .. m, z)
        local gz = z:gather(0)
        if R == 0 then out[n .. ">" .. m .. ".gather"] = host(gz) end
      end
    end
  end
  -- to_dtensor / from_dtensor (distinct ranks: row and col)
  for _, n in ipairs({ "row", "col" }) do
    engine.manual_seed(14)
    local x = ST.rand(sp[n], SIZE)
    local d = x:to_dtensor()
    out[n .. ".dt.mesh"] = d.device_mesh.device_type
    -- no copy: the DTensor's local tensor is the shard's storage
    out[n .. ".dt.local_is_shard"] = tostring(#x:local_shards() == 0
      or d:to_local():data_ptr() == x:local_shards()[1].tensor:data_ptr())
    out[n .. ".dt.full"] = host(d)
    local back = ST.from_dtensor(d * 2)
    out[n .. ".dt.back.spec"] = tostring(back:sharding_spec())
    locals(n .. ".dt.back", back)
    local fb = back:gather(0)
    if R == 0 then out[n .. ".dt.back.gather"] = host(fb) end
    -- ops of a DTensor-backed ShardedTensor
    locals(n .. ".dt.ops", (back + back) * 3)
  end
  -- shard_tensor from a host tensor and from a device tensor, several shards per rank too
  engine.manual_seed(15)
  local full = engine.rand(SIZE)
  for _, n in ipairs({ "row", "twice" }) do
    local c, st = util.counted(function() return dist.shard_tensor(full, sp[n], { src_rank = 0 }) end)
    counts[n .. ".shard_tensor"] = c
    locals(n .. ".shard_tensor", st)
    locals(n .. ".shard_tensor_dev", dist.shard_tensor(full:to(dev), sp[n], { src_rank = W - 1 }))
  end
  -- init_from_local_shards: this rank's boxes of full on the device
  local md = sp.enum:build_metadata(SIZE, dist.TensorProperties{ dtype = "f32" })
  local mine = {}
  for _, s in ipairs(md.shards_metadata) do
    if s.placement.rank == R then
      local b = full
      for d = 1, 2 do b = b:narrow(d, s.shard_offsets[d] + 1, s.shard_sizes[d]) end
      mine[#mine + 1] = { tensor = b:clone():to(dev), metadata = s }
    end
  end
  local ifl = dist.ShardedTensor.init_from_local_shards(mine, SIZE)
  out["init.spec"] = tostring(ifl:sharding_spec())
  locals("init", ifl)
  local gi = ifl:gather(0)
  if R == 0 then out["init.gather"] = host(gi) end
  -- dist.sharded_tensor.save / load: host copies in the files, the shards back on the device
  local root = util.dirs("st_cases_" .. kind)
  local path = root .. "_{rank}.safetensors"
  engine.manual_seed(16)
  local a = ST.rand(sp.twice, SIZE)
  local plain = engine.rand({ 3 }):to(dev)
  ST.save(path, { a = a, p = plain })
  local sd = ST.load(path)
  locals("saved", sd.a)
  out["saved.spec"] = tostring(sd.a:sharding_spec())
  out["saved.p"] = host(sd.p)
  devices[#devices + 1] = "saved.p:" .. sd.p.device
  out["saved.equal"] = tostring(sd.a:equal(a))
  os.remove((path:gsub("{rank}", tostring(R))))
  -- dist.checkpoint: save one layout, load into another (resharding), on the device
  local ck = root .. "_ckpt"
  engine.manual_seed(17)
  local src = ST.rand(sp.enum, SIZE)
  dist.checkpoint.save({ m = { w = src, n = 5 } }, ck)
  for _, n in ipairs({ "row", "twice" }) do
    local dst = ST.zeros(sp[n], SIZE)
    local state = { m = { w = dst, n = 0 } }
    dist.checkpoint.load(state, ck)
    locals("ckpt." .. n, state.m.w)
    local gd = state.m.w:gather(0)
    if R == 0 then out["ckpt." .. n .. ".gather"] = host(gd) end
  end
  dist.barrier()
  if R == 0 then os.execute("rm -rf '" .. ck .. "'") end
  return out, counts, devices
end

-- Compares the results of two runs: exact for copies, tol for arithmetic ("ops" entries); returns a list of
-- mismatches (empty when they agree).
function M.compare(a, b, tol)
  local bad = {}
  local keys = {}
  for k in pairs(a) do keys[#keys + 1] = k end
  for k in pairs(b) do if a[k] == nil then keys[#keys + 1] = k end end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local x, y = a[k], b[k]
    if type(x) ~= type(y) then bad[#bad + 1] = k .. ": only in one run"
    elseif type(x) == "table" then
      local t = k:find("ops", 1, true) and tol or 0
      local d = util.diff(x, y)
      if x.dtype ~= y.dtype or d > t then bad[#bad + 1] = string.format("%s: differs by %g (%s vs %s)", k, d, x.dtype, y.dtype) end
    elseif k:match("spec$") or k:match("mesh$") then
      -- placements differ by device: compare with the device names masked
      local mx = tostring(x):gsub("/cuda:%d+", "/DEV"):gsub("/cuda", "/DEV"):gsub("/cpu", "/DEV")
      local my = tostring(y):gsub("/cuda:%d+", "/DEV"):gsub("/cuda", "/DEV"):gsub("/cpu", "/DEV")
      if mx ~= my and not k:match("mesh$") then bad[#bad + 1] = k .. ": " .. tostring(x) .. " vs " .. tostring(y) end
    elseif x ~= y then bad[#bad + 1] = k .. ": " .. tostring(x) .. " vs " .. tostring(y) end
  end
  return bad
end

return M
