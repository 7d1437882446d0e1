-- engine.distributed.sharded_tensor_convert: the ShardedTensor form of any tensor and back.
--
--   local st = dist.as_sharded_tensor(t)        -- a DTensor's shards as a ShardedTensor (nested for FSDP over TP)
--
-- A DTensor of a 1-D layout (one mesh dim that is not Replicate, or all Replicate) is a ShardedTensor over that
-- mesh dim's group; [Replicate..., Shard/_StridedShard, tp] (FSDP over TP, HSDP + TP) is nested: over the last
-- dim's group one shard per TP shard, holding the dp chunks of it over the second-last dim's group (PyTorch's
-- torch/distributed/tensor/parallel/fsdp.py layout).  Plain tensors are chunked along dim 1 over the world
-- (PyTorch's _create_chunk_sharded_tensor).  The other way: every local box of a ShardedTensor, nested ones
-- composed (_st_boxes), and its full tensor on every rank (_st_full).
--
-- The helpers the FSDP/TP glue (fsdp_tp.lua) and the state dicts (state_dict.lua) share with this file are
-- exported under underscore names.  Conventions: dims are 1-based; box offsets and sizes are lists in
-- tensor-dim order of 0-based element offsets (the ShardMetadata convention); ranks are 0-based.
local core = require("engine.core")
local C = core.C
local engine = require("engine")
local P = require("engine.distributed.placements")
local dtensor = require("engine.distributed.dtensor")
local comm = require("engine.distributed.comm")
local specs = require("engine.distributed.sharding_spec")
local stmod = require("engine.distributed.sharded_tensor")

local M = {}
local fail = core.fail
local ShardedTensor = stmod.ShardedTensor
local is_st = stmod.is_sharded_tensor
local is_dt = dtensor.is_dtensor

local function layout(t)
  if is_dt(t) then return t:_layout_str() end
  if is_st(t) then return tostring(t) end
  if core.is_tensor(t) then return string.format("%s[%s]", t.dtype, table.concat(t:shape(), ",")) end
  return type(t)
end
M._layout_of = layout

-- "cpu" or "cuda": the placements' device type of t's shards
local function device_str(t)
  if t.device == "cuda" then return "cuda" end
  return "cpu"
end

-- The placement of global rank r's shard on device type dev: "rank:r/cpu", or PyTorch's
-- "rank:r/cuda:(r % device_count)" (each rank names its own GPU, not this rank's)
local function placement_of(r, dev)
  if dev == "cuda" then return stmod.sharded_tensor._cuda_placement(r) end
  return string.format("rank:%d/cpu", r)
end
M._placement_of = placement_of

local function chunk_box(n, k, i)
  -- torch.chunk: ceil(n/k) per piece, trailing pieces short or empty
  local c = math.ceil(n / k)
  local off = math.min(i * c, n)
  return off, math.max(0, math.min(c, n - off))
end
M._device_str, M._chunk_box = device_str, chunk_box

-- A ShardedTensor from this rank's local shards and the global metadata, without communication (PyTorch's
-- ShardedTensor._init_from_local_shards_and_global_metadata): the metadata is trusted.
local function st_from_global(shards, md, pg, dtype)
  return setmetatable({ _spec = specs.EnumerableShardingSpec(md.shards_metadata), _metadata = md, _size = md.size,
    _shards = shards, _pg = pg, dtype = dtype }, ShardedTensor)
end
M._st_from_global = st_from_global

-- A plain tensor chunked along dim d over pg (PyTorch's _create_chunk_sharded_tensor): this rank keeps
-- chunk `rank` (local given: used as it is, else a clone of the chunk); the metadata has one torch.chunk box
-- per group rank (trailing ones empty).
local function chunk_sharded(size, dtype, d, rank, world_size, pg, loc, dev)
  local pls = {}
  for r = 0, world_size - 1 do pls[r + 1] = placement_of(pg and pg:global_rank(r) or r, dev or "cpu") end
  local spec = specs.ChunkShardingSpec{ dim = d, placements = pls }
  local md = spec:build_metadata(size, specs.TensorProperties{ dtype = dtype })
  local mine = md.shards_metadata[rank + 1]
  return setmetatable({ _spec = spec, _metadata = md, _size = md.size, _shards = { { tensor = loc, metadata = mine } },
    _pg = pg, dtype = dtype }, ShardedTensor)
end

local function plain_chunk(op, t, rank, world_size, pg)
  if t:dim() == 0 then fail(op .. ": a 0-d tensor cannot be chunked") end
  local n = t:shape()[1]
  local off, len = chunk_box(n, world_size, rank)
  local loc = t:detach():narrow(1, off + 1, len):clone()
  return chunk_sharded(t:shape(), t.dtype, 1, rank, world_size, pg, loc, device_str(t))
end
M._plain_chunk = plain_chunk

-- ---------------------------------------------------------------- the ShardedTensor form of any tensor
local function runs_box(runs)
  local off, sz = {}, {}
  for d, r in ipairs(runs) do
    if #r > 1 then return nil end
    off[d], sz[d] = r[1] and r[1][1] or 0, r[1] and r[1][2] or 0
  end
  return off, sz
end
M._runs_box = runs_box

local function mesh_coords(mesh)
  local shape, out = mesh:shape(), {}
  local function rec(d, c)
    if d > #shape then out[#out + 1] = { unpack(c) }; return end
    for i = 0, shape[d] - 1 do c[d] = i; rec(d + 1, c) end
  end
  rec(1, {})
  return out
end
M._mesh_coords = mesh_coords

local function sharded_of_dtensor(t, op)
  local mesh, pl, shape = t.device_mesh, t.placements, t:shape()
  local n = #pl
  for i, p in ipairs(pl) do
    if p:is_partial() then fail(string.format("%s: %s: a Partial DTensor has no ShardedTensor form (mesh dim %d)", op, layout(t), i)) end
  end
  local nonrep = {}
  for i, p in ipairs(pl) do if not p:is_replicate() then nonrep[#nonrep + 1] = i end end
  local coord = mesh:get_coordinate()
  if coord == nil then fail(string.format("%s: this rank is not in the mesh of %s", op, layout(t))) end
  local dev = device_str(t)
  local loc = t:to_local():detach()
  local props = specs.TensorProperties{ dtype = t.dtype }
  if #nonrep <= 1 then
    -- one sharded mesh dim (or none): over that dim's group
    local md_dim = nonrep[1] or n
    local g = mesh:get_group(md_dim)
    local shards = {}
    local p = pl[md_dim]
    if p:is_strided_shard() then fail(string.format("%s: %s: a _StridedShard alone has no ShardedTensor form", op, layout(t))) end
    if p:is_shard() then
      local c = { unpack(coord) }
      for i = 0, mesh:size(md_dim) - 1 do
        c[md_dim] = i
        local ls, off = dtensor.compute_local_shape_and_global_offset(shape, mesh, pl, c)
        shards[#shards + 1] = specs.ShardMetadata{ shard_offsets = off, shard_sizes = ls, placement = placement_of(g:global_rank(i), dev) }
      end
    else
      local off = {}
      for d = 1, #shape do off[d] = 0 end
      shards[1] = specs.ShardMetadata{ shard_offsets = off, shard_sizes = shape, placement = placement_of(g:global_rank(g:rank()), dev) }
    end
    local md = specs.ShardedTensorMetadata{ shards_metadata = shards, size = shape, tensor_properties = props }
    local mine = shards[p:is_shard() and (coord[md_dim] + 1) or 1]
    return st_from_global({ { tensor = loc, metadata = mine } }, md, g, t.dtype)
  end
  -- nested: [Replicate..., S/SS (dp), tp]
  local ok = n >= 2 and (pl[n - 1]:is_shard())
  for i = 1, n - 2 do ok = ok and pl[i]:is_replicate() end
  if not ok then
    fail(string.format("%s: %s has no ShardedTensor form (1-D layouts and [Replicate..., Shard, tp] are handled)", op,
      layout(t)))
  end
  local dpdim = pl[n - 1].dim < 0 and #shape + 1 + pl[n - 1].dim or pl[n - 1].dim
  local tpv = { unpack(pl) }
  tpv[n - 1] = P.Replicate()
  local Wdp, Wtp = mesh:size(n - 1), mesh:size(n)
  -- check (on every coordinate: the same answer on every rank) that each rank's shard is the torch.chunk
  -- piece of its TP shard along dpdim
  for _, c in ipairs(mesh_coords(mesh)) do
    local ob_off, ob_sz = runs_box(dtensor.local_shard_runs(shape, mesh, tpv, c))
    local ib_off, ib_sz = runs_box(dtensor.local_shard_runs(shape, mesh, pl, c))
    local good = ob_off ~= nil and ib_off ~= nil
    if good then
      local o, l = chunk_box(ob_sz[dpdim], Wdp, c[n - 1])
      for d = 1, #shape do
        local wo, wl = ob_off[d], ob_sz[d]
        if d == dpdim then wo, wl = ob_off[d] + o, l end
        if wl > 0 and (ib_sz[d] ~= wl or ib_off[d] ~= wo) then good = false end
        if wl == 0 and ib_sz[d] ~= 0 then good = false end
      end
    end
    if not good then
      fail(string.format("%s: %s has no nested ShardedTensor form: the shards are not torch.chunk pieces of the TP "
        .. "shards along dim %d", op, layout(t), dpdim))
    end
  end
  local tg, dg = mesh:get_group(n), mesh:get_group(n - 1)
  local outer, mine = {}, nil
  local c = { unpack(coord) }
  local tp_is_shard = pl[n]:is_shard()
  for j = 0, (tp_is_shard and Wtp or 1) - 1 do
    if tp_is_shard then c[n] = j end
    local ls, off = dtensor.compute_local_shape_and_global_offset(shape, mesh, tpv, c)
    local md = specs.ShardMetadata{ shard_offsets = off, shard_sizes = ls,
      placement = placement_of(tg:global_rank(tp_is_shard and j or tg:rank()), dev) }
    outer[#outer + 1] = md
    if not tp_is_shard or j == coord[n] then mine = md end
  end
  local inner = chunk_sharded(mine.shard_sizes, t.dtype, dpdim, dg:rank(), Wdp, dg, loc, dev)
  local md = specs.ShardedTensorMetadata{ shards_metadata = outer, size = shape, tensor_properties = props }
  return st_from_global({ { tensor = inner, metadata = mine } }, md, tg, t.dtype)
end

-- dist.as_sharded_tensor(t): the ShardedTensor form of a DTensor (see above) or of a plain tensor (chunked
-- along dim 1 over the world; a 0-d tensor is returned as it is).
function M.as_sharded_tensor(t)
  local op = "as_sharded_tensor"
  if is_st(t) then return t end
  if not core.is_tensor(t) then fail(op .. ": expected a tensor, got " .. type(t)) end
  if is_dt(t) then return sharded_of_dtensor(t, op) end
  if t:dim() == 0 then return t end
  local g = comm.world_group()
  return plain_chunk(op, t, g:rank(), g:size(), g)
end

-- Every local box of a ShardedTensor (nested ones composed): {tensor, offsets (0-based), sizes}.
local function st_boxes(st)
  local out = {}
  for _, s in ipairs(st:local_shards()) do
    local o = s.metadata.shard_offsets
    if is_st(s.tensor) then
      for _, b in ipairs(st_boxes(s.tensor)) do
        local off = {}
        for d = 1, #o do off[d] = o[d] + b.offsets[d] end
        out[#out + 1] = { tensor = b.tensor, offsets = off, sizes = b.sizes }
      end
    else
      out[#out + 1] = { tensor = s.tensor, offsets = { unpack(o) }, sizes = { unpack(s.metadata.shard_sizes) } }
    end
  end
  return out
end
M._st_boxes = st_boxes

local function numel(sz)
  local k = 1
  for _, x in ipairs(sz) do k = k * x end
  return k
end

-- The full tensor of a ShardedTensor on every rank (collective over the world): every rank's local boxes
-- (nested ones composed) are all-gathered and placed.  Boxes held by several ranks are written once each.
local function st_full(st, dtype)
  local g = comm.world_group()
  local W = g:size()
  local size = st:size()
  local nd = #size
  local boxes = st_boxes(st)
  dtype = dtype or st.dtype
  -- descriptors: count, then per box offsets and sizes
  local nb = engine.zeros({ W }, { dtype = "i64" })
  local mine_n, total = #boxes, 0
  for _, b in ipairs(boxes) do total = total + numel(b.sizes) end
  nb:narrow(1, g:rank() + 1, 1):fill_(mine_n)
  comm.all_reduce(nb, "max")
  local tot = engine.zeros({ W }, { dtype = "i64" })
  tot:narrow(1, g:rank() + 1, 1):fill_(total)
  comm.all_reduce(tot, "max")
  local counts, totals = nb:totable(), tot:totable()
  local maxb, maxn = 1, 1
  for r = 1, W do maxb = math.max(maxb, counts[r]); maxn = math.max(maxn, totals[r]) end
  local desc = engine.zeros({ maxb * 2 * math.max(nd, 1) }, { dtype = "i64" })
  local dl = {}
  for i, b in ipairs(boxes) do
    for d = 1, nd do dl[(i - 1) * 2 * nd + d] = b.offsets[d]; dl[(i - 1) * 2 * nd + nd + d] = b.sizes[d] end
  end
  if #dl > 0 then desc:narrow(1, 1, #dl):copy_(engine.tensor(dl, "i64")) end
  local alld = engine.empty({ W * desc:numel() }, { dtype = "i64" })
  comm.all_gather_into(alld, desc)
  local send = engine.zeros({ maxn }, { dtype = dtype })
  local pos = 0
  for _, b in ipairs(boxes) do
    local k = numel(b.sizes)
    if k > 0 then send:narrow(1, pos + 1, k):view(unpack(b.sizes)):copy_(b.tensor:detach()) end
    pos = pos + k
  end
  local recv = engine.empty({ W * maxn }, { dtype = dtype })
  comm.all_gather_into(recv, send)
  local full = engine.empty(size, { dtype = dtype })
  local A = alld:totable()
  local per = desc:numel()
  for r = 0, W - 1 do
    local p = 0
    for i = 1, counts[r + 1] do
      local base = r * per + (i - 1) * 2 * nd
      local off, sz = {}, {}
      for d = 1, nd do off[d] = A[base + d]; sz[d] = A[base + nd + d] end
      local k = numel(sz)
      if k > 0 then
        local box = full
        for d = 1, nd do box = box:narrow(d, off[d] + 1, sz[d]) end
        box:copy_(recv:narrow(1, r * maxn + p + 1, k):view(unpack(sz)))
      end
      p = p + k
    end
  end
  return full
end
M._st_full = st_full

return M
