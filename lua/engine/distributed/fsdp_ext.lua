-- engine.distributed.fsdp_ext: seed 000's functions (PyTorch's torch/distributed/tensor/parallel/fsdp.py,
-- the glue between data-parallel sharding and tensor-parallel DTensors) as engine API, and state dicts of
-- FSDP, TP, 2-D and plain models in three forms (issue 15 items 2 and 3).
--
--   local offsets, sizes = dist.get_local_box(dt)            -- 0-based offsets, sizes (1-D meshes)
--   local md = dist.create_sharded_tensor_md_from_dt(dt)      -- ShardedTensorMetadata
--   local st = dist.chunk_tensor(t_or_tp_dt, dp_rank, dp_size, nil, dp_group)   -- nested when t is a DTensor
--   local d2 = dist.chunk_dtensor(t_or_tp_dt, rank, mesh["dp"])                 -- [Shard(1), tp] on the parent
--   local inner, shards = dist.pre_load_state_dict(st)
--   local tp_local = dist.all_gather_dtensor(d2, mesh)       -- gathers the dp dims, keeps the tp placement
--   local loc, ext = dist.pre_flatten_transform(dt); dt = dist.post_unflatten_transform(loc, ext)
--   local ext = dist.DTensorExtensions()                     -- the same, under the seed's method names
--
--   local msd, osd = dist.get_state_dict(model, opt)                        -- sharded DTensors (state_dict())
--   local msd, osd = dist.get_state_dict(model, opt, {full = true, cpu_offload = true, rank0_only = true})
--   local msd, osd = dist.get_state_dict(model, opt, {sharded = true})      -- ShardedTensors (seed 000's form)
--   dist.set_state_dict(model, opt, {model_state_dict = msd, optim_state_dict = osd}, {strict = true})
--
-- Conventions: dims are 1-based (Shard(1) is PyTorch's Shard(0)); box offsets and sizes are lists in
-- tensor-dim order whose values are 0-based element offsets (the ShardMetadata convention); ranks and
-- shard indices are 0-based.  Where the seed asserts a 1-D mesh, these give an error naming the layout.
-- Optimizer state dicts are keyed by parameter name (dist.checkpoint.get_optimizer_state_dict's format):
-- {state = {[name] = {step = t, exp_avg = t, ...}}, param_groups = {{lr = ..., params = {names}}}} (step: a 0-dim
-- f32 CPU tensor, as PyTorch's; a number is accepted when loading).
local core = require("engine.core")
local ffi, C = core.ffi, core.C
local P = require("engine.distributed.placements")
local dtensor = require("engine.distributed.dtensor")
local meshmod = require("engine.distributed.mesh")
local comm = require("engine.distributed.comm")
local specs = require("engine.distributed.sharding_spec")
local stmod = require("engine.distributed.sharded_tensor")

local M = {}
local fail = core.fail
local ShardedTensor = stmod.ShardedTensor
local is_st = stmod.is_sharded_tensor
local is_dt = dtensor.is_dtensor

local function E() return require("engine") end

local function layout(t)
  if is_dt(t) then return t:_layout_str() end
  if is_st(t) then return tostring(t) end
  if core.is_tensor(t) then return string.format("%s[%s]", t.dtype, table.concat(t:shape(), ",")) end
  return type(t)
end

local function need_dt(t, op)
  if not is_dt(t) then
    fail(string.format("%s: expected a DTensor, got %s", op, core.is_tensor(t) and ("a plain tensor " .. layout(t)) or type(t)))
  end
end

local function need_1d(t, op)
  need_dt(t, op)
  if t.device_mesh:ndim() ~= 1 then
    fail(string.format("%s: %s: only DTensors on a 1-D DeviceMesh are handled (seed 000's _get_box asserts a 1-D mesh)",
      op, layout(t)))
  end
end

local function device_str(t)
  local d = t.device
  if d == "cuda" then return "cuda:" .. tostring(C.eng_cuda_current_device and C.eng_cuda_current_device() or 0) end
  return "cpu"
end

local function chunk_box(n, k, i)
  -- torch.chunk: ceil(n/k) per piece, trailing pieces short or empty
  local c = math.ceil(n / k)
  local off = math.min(i * c, n)
  return off, math.max(0, math.min(c, n - off))
end

-- ---------------------------------------------------------------- boxes (seed: _get_box, _get_box_for, _get_local_box)
-- get_box(dt) -> offsets, sizes: the offsets step per shard index (torch.chunk's ceil(n/k) on the shard dim,
-- 0 elsewhere) and this rank's local sizes, as the seed's _get_box.
function M.get_box(dt)
  local op = "get_box"
  need_1d(dt, op)
  local shape = dt:shape()
  local pl = dt.placements[1]
  local off = {}
  for d = 1, #shape do off[d] = 0 end
  if pl:is_strided_shard() then
    fail(string.format("%s: %s: a _StridedShard shard is not one box", op, layout(dt)))
  end
  if pl:is_shard() then
    local d = pl.dim < 0 and #shape + 1 + pl.dim or pl.dim
    off[d] = math.ceil(shape[d] / dt.device_mesh:size())
  end
  return off, dt:to_local():shape()
end

-- get_box_for(dt, idx) -> offsets, sizes of shard idx (0-based mesh coordinate): the torch.chunk box (the
-- seed multiplies the step by idx and keeps the local sizes, which is the same for even sizes; for uneven
-- sizes this gives the real box of that shard, so boxes never overlap).
function M.get_box_for(dt, idx)
  local op = "get_box_for"
  need_1d(dt, op)
  local k = dt.device_mesh:size()
  if type(idx) ~= "number" or idx % 1 ~= 0 or idx < 0 or idx >= k then
    fail(string.format("%s: idx must be a 0-based shard index in 0..%d for %s, got %s", op, k - 1, layout(dt), tostring(idx)))
  end
  local shape = dt:shape()
  local pl = dt.placements[1]
  if pl:is_strided_shard() then fail(string.format("%s: %s: a _StridedShard shard is not one box", op, layout(dt))) end
  local off, sz = {}, {}
  for d = 1, #shape do off[d], sz[d] = 0, shape[d] end
  if pl:is_shard() then
    local d = pl.dim < 0 and #shape + 1 + pl.dim or pl.dim
    off[d], sz[d] = chunk_box(shape[d], k, idx)
  end
  return off, sz
end

-- get_local_box(dt) -> offsets, sizes of this rank's shard.
function M.get_local_box(dt)
  local op = "get_local_box"
  need_1d(dt, op)
  local coord = dt.device_mesh:get_coordinate()
  if coord == nil then fail(string.format("%s: this rank is not in the mesh of %s", op, layout(dt))) end
  return M.get_box_for(dt, coord[1])
end

-- ---------------------------------------------------------------- metadata (seed: _create_shard_md_from_dt, ...)
-- create_shard_md_from_dt(dt, current_rank) -> ShardMetadata of this rank's box placed on current_rank.
function M.create_shard_md_from_dt(dt, current_rank)
  local op = "create_shard_md_from_dt"
  need_1d(dt, op)
  if type(current_rank) ~= "number" or current_rank % 1 ~= 0 or current_rank < 0 then
    fail(op .. ": current_rank must be a 0-based rank, got " .. tostring(current_rank))
  end
  local off, sz = M.get_local_box(dt)
  return specs.ShardMetadata{ shard_offsets = off, shard_sizes = sz,
    placement = string.format("rank:%d/%s", current_rank, device_str(dt)) }
end

-- create_sharded_tensor_md_from_dt(dt [, pg]) -> ShardedTensorMetadata covering the whole tensor: one box
-- per shard index placed on that group rank of pg (default: the mesh's group), named by its global rank as
-- ShardedTensor placements are; a Replicate DTensor is one box placed on this rank.  Deviation: the seed
-- labels every box but the first with a "scapegoat" rank (metadata that differs per rank); here shard i is
-- on group rank i, the layout the DTensor really has.
function M.create_sharded_tensor_md_from_dt(dt, pg)
  local op = "create_sharded_tensor_md_from_dt"
  need_1d(dt, op)
  pg = pg or dt.device_mesh:get_group(1)
  if not comm.is_group(pg) then fail(op .. ": pg must be a ProcessGroup, got " .. type(pg)) end
  local k = dt.device_mesh:size()
  if pg:size() ~= k then
    fail(string.format("%s: the process group has %s ranks, the mesh of %s %d", op, tostring(pg:size()), layout(dt), k))
  end
  local shards = {}
  local dev = device_str(dt)
  if dt.placements[1]:is_shard() then
    for i = 0, k - 1 do
      local off, sz = M.get_box_for(dt, i)
      shards[#shards + 1] = specs.ShardMetadata{ shard_offsets = off, shard_sizes = sz,
        placement = string.format("rank:%d/%s", pg:global_rank(i), dev) }
    end
  else
    local off, sz = M.get_box_for(dt, 0)
    shards[1] = specs.ShardMetadata{ shard_offsets = off, shard_sizes = sz,
      placement = string.format("rank:%d/%s", pg:rank() and pg:global_rank(pg:rank()) or 0, dev) }
  end
  return specs.ShardedTensorMetadata{ shards_metadata = shards, size = dt:shape(),
    tensor_properties = specs.TensorProperties{ dtype = dt.dtype, requires_grad = dt.requires_grad == true } }
end

-- A ShardedTensor from this rank's local shards and the global metadata, without communication (PyTorch's
-- ShardedTensor._init_from_local_shards_and_global_metadata): the metadata is trusted.
local function st_from_global(shards, md, pg, dtype)
  return setmetatable({ _spec = specs.EnumerableShardingSpec(md.shards_metadata), _metadata = md, _size = md.size,
    _shards = shards, _pg = pg, dtype = dtype }, ShardedTensor)
end

-- ---------------------------------------------------------------- chunk_tensor / chunk_dtensor
local function group_args(op, rank, world_size, pg)
  if pg ~= nil and not comm.is_group(pg) then fail(op .. ": pg must be a ProcessGroup (or nil: the world)") end
  local g = pg or comm.world_group()
  local gr, gs = g:rank(), g:size()
  if type(world_size) ~= "number" or world_size ~= gs then
    fail(string.format("%s: world_size %s is not the size of the process group (%s)", op, tostring(world_size), tostring(gs)))
  end
  if type(rank) ~= "number" or rank ~= gr then
    fail(string.format("%s: rank %s is not this process's rank in the process group (%s)", op, tostring(rank), tostring(gr)))
  end
  return g
end

-- A plain tensor chunked along dim d over pg (seed: _create_chunk_sharded_tensor): this rank keeps
-- chunk `rank` (local given: used as it is, else a clone of the chunk); the metadata has one torch.chunk box
-- per group rank (trailing ones empty).
local function chunk_sharded(size, dtype, d, rank, world_size, pg, loc, dev)
  local pls = {}
  for r = 0, world_size - 1 do pls[r + 1] = string.format("rank:%d/%s", pg and pg:global_rank(r) or r, dev or "cpu") end
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

-- chunk_tensor(t, rank, world_size, num_devices_per_node, pg): a plain tensor chunked along dim 1 over pg
-- (this rank keeps a copy of its chunk), or a DTensor on a 1-D (TP) mesh as a nested ShardedTensor: over the
-- TP mesh's group one shard per TP shard (this rank's is a ShardedTensor of its TP local chunked along dim 1
-- over pg).  rank and world_size must be this rank's and pg's (pg nil: the world).
function M.chunk_tensor(t, rank, world_size, num_devices_per_node, pg)
  local op = "chunk_tensor"
  local _ = num_devices_per_node
  if not core.is_tensor(t) then fail(op .. ": expected a tensor or a DTensor, got " .. type(t)) end
  pg = group_args(op, rank, world_size, pg)
  if not is_dt(t) then return plain_chunk(op, t, rank, world_size, pg) end
  if t.device_mesh:ndim() ~= 1 then
    fail(string.format("%s: %s: only DTensors on a 1-D (tensor-parallel) DeviceMesh are handled (seed 000 asserts a "
      .. "1-D mesh)", op, layout(t)))
  end
  if t.placements[1]:is_partial() then fail(string.format("%s: %s: a Partial DTensor has no shards", op, layout(t))) end
  local inner = plain_chunk(op, t:to_local(), rank, world_size, pg)
  local dt_pg = t.device_mesh:get_group(1)
  local md = M.create_sharded_tensor_md_from_dt(t, dt_pg)
  md.tensor_properties.requires_grad = false
  local mine = M.create_shard_md_from_dt(t, dt_pg:rank())
  return st_from_global({ { tensor = inner, metadata = mine } }, md, dt_pg, t.dtype)
end

local function parent_of(op, mesh)
  if not meshmod.is_mesh(mesh) then fail(op .. ": device_mesh must be a DeviceMesh, got " .. type(mesh)) end
  local parent = rawget(mesh, "_parent")
  if parent == nil then fail(op .. ": No parent device_mesh is found for FSDP device_mesh (" .. tostring(mesh) .. ")") end
  parent = parent:get_root_mesh()
  if parent:ndim() < 2 then
    fail(string.format("%s: Found parent device_mesh of ndim=%d, but meshes must be at least 2D.", op, parent:ndim()))
  end
  return parent
end

local function contiguous_stride(shape)
  local st, acc = {}, 1
  for d = #shape, 1, -1 do st[d] = acc; acc = acc * math.max(shape[d], 1) end
  return st
end

-- chunk_dtensor(t, rank, device_mesh): t (a plain tensor, or a DTensor on the 1-D TP mesh) onto the parent
-- mesh of device_mesh (the FSDP mesh, a slice of a mesh of >= 2 dims) as [Shard(1), Replicate...] for a
-- tensor, [Replicate..., Shard(1), tp placement] for a DTensor (HSDP + TP: [Replicate, Shard(1), tp]).  Each
-- rank keeps its chunk (no communication); the result is detached from t.
function M.chunk_dtensor(t, rank, device_mesh)
  local op = "chunk_dtensor"
  local _ = rank
  if not core.is_tensor(t) then fail(op .. ": expected a tensor or a DTensor, got " .. type(t)) end
  local parent = parent_of(op, device_mesh)
  local n = parent:ndim()
  return E().no_grad(function()
    if not is_dt(t) then
      if t:dim() == 0 then fail(op .. ": a 0-d tensor cannot be chunked") end
      local pl = {}
      for i = 1, n do pl[i] = P.Replicate() end
      pl[1] = P.Shard(1)
      return dtensor.distribute_tensor(t:detach(), parent, pl, { src_data_rank = false })
    end
    if t.device_mesh:ndim() ~= 1 then
      fail(string.format("%s: %s: the tensor-parallel DTensor must be on a 1-D mesh", op, layout(t)))
    end
    local tp = t.placements[1]
    if tp:is_partial() then fail(string.format("%s: %s: a Partial DTensor cannot be chunked", op, layout(t))) end
    if t.device_mesh:size() ~= parent:size(n) then
      fail(string.format("%s: %s: the TP mesh has %d ranks, the last dim of the parent mesh %s %d", op, layout(t),
        t.device_mesh:size(), tostring(parent), parent:size(n)))
    end
    local rpl, spl = {}, {}
    for i = 1, n do rpl[i], spl[i] = P.Replicate(), P.Replicate() end
    rpl[n], spl[n], spl[n - 1] = tp, tp, P.Shard(1)
    local shape = t:shape()
    local d = dtensor.from_local(t:to_local():clone(), parent, rpl, { shape = shape, stride = contiguous_stride(shape) })
    return d:redistribute(parent, spl)
  end)
end

-- pre_load_state_dict(st) -> tensor, shards: st's local shards, or for a nested ShardedTensor (one local shard
-- holding a ShardedTensor) the inner one and its local shards.
function M.pre_load_state_dict(t)
  local op = "pre_load_state_dict"
  if not is_st(t) then fail(op .. ": expected a ShardedTensor, got " .. layout(t)) end
  local shards = t:local_shards()
  if #shards == 1 and is_st(shards[1].tensor) then
    t = shards[1].tensor
    shards = t:local_shards()
  end
  return t, shards
end

-- all_gather_dtensor(dt, parent_mesh) -> the local tensor of dt after gathering every mesh dim but the last
-- (FSDP + TP: [Shard(1), tp] -> [Replicate, tp]; HSDP + TP: [R, S, tp] -> [R, R, tp]).  parent_mesh must
-- be dt's mesh.
function M.all_gather_dtensor(dt, parent_mesh)
  local op = "all_gather_dtensor"
  need_dt(dt, op)
  if not meshmod.is_mesh(parent_mesh) or parent_mesh ~= dt.device_mesh then
    fail(string.format("%s: parent_mesh %s is not the mesh of %s", op, tostring(parent_mesh), layout(dt)))
  end
  local pl = dt.placements
  for i = 1, #pl - 1 do pl[i] = P.Replicate() end
  return dt:redistribute(dt.device_mesh, pl):to_local()
end

-- ---------------------------------------------------------------- flatten / unflatten
local Ext = { __name = "DTensorExtension" }
Ext.__index = Ext
Ext.__tostring = function(e)
  local p = {}
  for i, x in ipairs(e.placements) do p[i] = tostring(x) end
  return string.format("DTensorExtension(mesh=%s, placements=[%s], shape=[%s])", tostring(e.mesh), table.concat(p, ", "),
    table.concat(e.shape, ","))
end

-- pre_flatten_transform(t) -> local tensor, extension: a DTensor's local shard and what rebuilds it
-- ({mesh, placements, shape, stride, requires_grad}); a plain tensor and nil.
function M.pre_flatten_transform(t)
  local op = "pre_flatten_transform"
  if not core.is_tensor(t) then fail(op .. ": expected a tensor, got " .. type(t)) end
  if not is_dt(t) then return t, nil end
  local ext = setmetatable({ mesh = t.device_mesh, placements = t.placements, shape = t:shape(),
    stride = t:stride(),
    requires_grad = t.requires_grad == true }, Ext)
  return t:to_local(), ext
end

-- post_unflatten_transform(t, extension) -> the DTensor of that layout whose local shard is t (no copy);
-- t itself when extension is nil.
function M.post_unflatten_transform(t, ext)
  local op = "post_unflatten_transform"
  if not core.is_tensor(t) then fail(op .. ": expected a tensor, got " .. type(t)) end
  if ext == nil then return t end
  if getmetatable(ext) ~= Ext then fail(op .. ": the extension must be what pre_flatten_transform returned") end
  if is_dt(t) then fail(op .. ": expected the local (plain) tensor, got the DTensor " .. layout(t)) end
  local ls = dtensor.compute_local_shape_and_global_offset(ext.shape, ext.mesh, ext.placements)
  local sh = t:shape()
  local same = #sh == #ls
  for d = 1, #sh do same = same and sh[d] == ls[d] end
  if not same then
    fail(string.format("%s: the local tensor has shape [%s], the layout %s of [%s] needs [%s] on this rank", op,
      table.concat(sh, ","), tostring(ext), table.concat(ext.shape, ","), table.concat(ls, ",")))
  end
  local d = dtensor._from_local_as_is(t, ext.mesh, ext.placements, { shape = ext.shape, stride = ext.stride })
  return d
end

-- dist.DTensorExtensions([device_handle]): the seed's FSDPExtensions object over the functions above.
local DTensorExtensions = { __name = "DTensorExtensions" }
DTensorExtensions.__index = DTensorExtensions
function M.DTensorExtensions(device_handle)
  return setmetatable({ device_handle = device_handle, compute_stream = nil }, DTensorExtensions)
end
function DTensorExtensions:pre_flatten_transform(t) return M.pre_flatten_transform(t) end
function DTensorExtensions:post_unflatten_transform(t, ext) return M.post_unflatten_transform(t, ext) end
function DTensorExtensions:chunk_tensor(t, rank, world_size, ndev, pg) return M.chunk_tensor(t, rank, world_size, ndev, pg) end
function DTensorExtensions:chunk_dtensor(t, rank, mesh) return M.chunk_dtensor(t, rank, mesh) end
function DTensorExtensions:pre_load_state_dict_transform(t) return M.pre_load_state_dict(t) end
function DTensorExtensions:all_gather_dtensor(t, parent_mesh) return M.all_gather_dtensor(t, parent_mesh) end
DTensorExtensions.__tostring = function() return "DTensorExtensions()" end

-- ---------------------------------------------------------------- the ShardedTensor form of any tensor
-- 1-D layouts (one mesh dim that is not Replicate, or all Replicate) are a ShardedTensor over that mesh
-- dim's group; [Replicate..., Shard/_StridedShard, tp] (FSDP over TP, HSDP + TP) is nested: over the last
-- dim's group one shard per TP shard, holding the dp chunks of it over the second-last dim's group.  The
-- local shard tensors are the DTensor's local (no copy, no communication).  Plain tensors are chunked
-- along dim 1 over the world (a copy of this rank's chunk).
local function runs_box(runs)
  local off, sz = {}, {}
  for d, r in ipairs(runs) do
    if #r > 1 then return nil end
    off[d], sz[d] = r[1] and r[1][1] or 0, r[1] and r[1][2] or 0
  end
  return off, sz
end

local function mesh_coords(mesh)
  local shape, out = mesh:shape(), {}
  local function rec(d, c)
    if d > #shape then out[#out + 1] = { unpack(c) }; return end
    for i = 0, shape[d] - 1 do c[d] = i; rec(d + 1, c) end
  end
  rec(1, {})
  return out
end

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
        shards[#shards + 1] = specs.ShardMetadata{ shard_offsets = off, shard_sizes = ls, placement = string.format("rank:%d/%s", g:global_rank(i), dev) }
      end
    else
      local off = {}
      for d = 1, #shape do off[d] = 0 end
      shards[1] = specs.ShardMetadata{ shard_offsets = off, shard_sizes = shape, placement = string.format("rank:%d/%s", g:global_rank(g:rank()), dev) }
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
      placement = string.format("rank:%d/%s", tg:global_rank(tp_is_shard and j or tg:rank()), dev) }
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
  local nb = E().zeros({ W }, { dtype = "i64" })
  local mine_n, total = #boxes, 0
  for _, b in ipairs(boxes) do total = total + numel(b.sizes) end
  nb:narrow(1, g:rank() + 1, 1):fill_(mine_n)
  comm.all_reduce(nb, "max")
  local tot = E().zeros({ W }, { dtype = "i64" })
  tot:narrow(1, g:rank() + 1, 1):fill_(total)
  comm.all_reduce(tot, "max")
  local counts, totals = nb:totable(), tot:totable()
  local maxb, maxn = 1, 1
  for r = 1, W do maxb = math.max(maxb, counts[r]); maxn = math.max(maxn, totals[r]) end
  local desc = E().zeros({ maxb * 2 * math.max(nd, 1) }, { dtype = "i64" })
  local dl = {}
  for i, b in ipairs(boxes) do
    for d = 1, nd do dl[(i - 1) * 2 * nd + d] = b.offsets[d]; dl[(i - 1) * 2 * nd + nd + d] = b.sizes[d] end
  end
  if #dl > 0 then desc:narrow(1, 1, #dl):copy_(E().tensor(dl, "i64")) end
  local alld = E().empty({ W * desc:numel() }, { dtype = "i64" })
  comm.all_gather_into(alld, desc)
  local send = E().zeros({ maxn }, { dtype = dtype })
  local pos = 0
  for _, b in ipairs(boxes) do
    local k = numel(b.sizes)
    if k > 0 then send:narrow(1, pos + 1, k):view(unpack(b.sizes)):copy_(b.tensor:detach()) end
    pos = pos + k
  end
  local recv = E().empty({ W * maxn }, { dtype = dtype })
  comm.all_gather_into(recv, send)
  local full = E().empty(size, { dtype = dtype })
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

-- ---------------------------------------------------------------- state dicts
local function free_now(t)
  -- drops this wrapper's reference to the C tensor at once (the Lua collector would keep it until a cycle)
  if type(t) == "table" then
    local c = rawget(t, "_c")
    if c ~= nil then ffi.gc(c, nil); C.eng_tensor_release(c); rawset(t, "_c", nil) end
  end
end
M._free_now = free_now

local function check_opts(opts, known, op)
  if opts == nil then return {} end
  if type(opts) ~= "table" then fail(op .. ": options must be a table") end
  for k in pairs(opts) do
    if not known[k] then
      local names = {}
      for n in pairs(known) do names[#names + 1] = n end
      table.sort(names)
      fail(string.format("%s: unknown option '%s' (%s)", op, tostring(k), table.concat(names, ", ")))
    end
  end
  return opts
end

local GET_OPTS = { full = true, full_state_dict = true, cpu_offload = true, rank0_only = true, sharded = true }

-- The full value of DTensor t gathered straight into one buffer: the mesh members holding distinct shards
-- (coordinate 0 along Replicate dims) broadcast their local shard in turn over the mesh's group (its
-- flattening for 2 dims or more: group rank = row-major coordinate), and each receiver copies the shard's runs
-- into place.  A rank holds the full tensor and one shard at a time (full_tensor()'s redistribute steps hold
-- the gathered pieces and their reordered copies: up to 3x for FSDP over TP).  keep = false (rank0_only on
-- another rank): nothing is assembled and nil is returned, the shards only pass through.  Collective over the
-- mesh (flattening it is collective over the world the first time).
local function gather_full(t, keep)
  local mesh, pl, shape = t.device_mesh, t.placements, t:shape()
  local rep = true
  for _, p in ipairs(pl) do
    if p:is_partial() then return keep and t:full_tensor() or nil end
    if not p:is_replicate() then rep = false end
  end
  if rep then return keep and t:to_local():detach():clone() or nil end
  local group = mesh:ndim() == 1 and mesh:get_group(1) or mesh:flatten():get_group(1)
  local loc = t:to_local():detach()
  local coord = mesh:get_coordinate()
  local opts = { dtype = t.dtype, device = t.device }
  local out = keep and E().empty(shape, opts) or nil
  for i, c in ipairs(mesh_coords(mesh)) do
    local dup = false
    for d, p in ipairs(pl) do if p:is_replicate() and c[d] ~= 0 then dup = true end end
    if not dup then
      local runs = dtensor.local_shard_runs(shape, mesh, pl, c)
      local lshape, n = {}, 1
      for d, rs in ipairs(runs) do
        local k = 0
        for _, r in ipairs(rs) do k = k + r[2] end
        lshape[d], n = k, n * k
      end
      if n > 0 then
        local mine = true
        for d = 1, #c do if c[d] ~= coord[d] then mine = false end end
        local buf = mine and loc:contiguous() or E().empty(lshape, opts)
        comm.broadcast(buf, nil, { group = group, group_src = i - 1 })
        if keep then
          -- every combination of runs (one per dim unless a _StridedShard splits it): a box of out
          -- (the views are dropped at once: a view left to the collector keeps the shard's memory)
          local function rec(d, dst, src)
            if d > #runs then dst:copy_(src); return end
            local lo = 0
            for _, r in ipairs(runs[d]) do
              local dv, sv = dst:narrow(d, r[1] + 1, r[2]), src:narrow(d, lo + 1, r[2])
              rec(d + 1, dv, sv)
              free_now(dv); free_now(sv)
              lo = lo + r[2]
            end
          end
          rec(1, out, buf)
        end
        if not rawequal(buf, loc) then free_now(buf) end
      end
    end
  end
  return out
end

-- One tensor in the requested form.  keep = false: the caller drops the result (rank0_only on another rank).
local function form_of(t, o, keep)
  if o.full then
    local full = t
    if is_dt(t) then full = gather_full(t, keep)
    elseif is_st(t) then full = st_full(t) end
    if not keep then
      if not rawequal(full, t) then free_now(full) end
      return nil
    end
    if o.cpu_offload and full.device ~= "cpu" then
      local h = full:to("cpu")
      if not rawequal(full, t) then free_now(full) end
      full = h
    end
    if rawequal(full, t) then full = t:detach() end
    return full
  end
  if o.sharded then
    local r = M.as_sharded_tensor(t:detach())
    if o.cpu_offload and core.is_tensor(r) and r.device ~= "cpu" then r = r:to("cpu") end
    return r
  end
  if o.cpu_offload and t.device ~= "cpu" then return t:to("cpu") end
  return t:detach()
end

local function param_names(model)
  local name_of, list = {}, {}
  for name, p in model:named_parameters() do
    if name_of[p] == nil then name_of[p] = name end
    list[#list + 1] = { name = name, p = p }
  end
  return name_of, list
end

-- dist.get_state_dict(model, optimizer, {full, cpu_offload, rank0_only, sharded}) -> model_sd, optim_sd
-- (optim_sd nil without an optimizer).  Default: the sharded DTensors (model:state_dict(), the optimizer's
-- states as they are).  full: every DTensor gathered one at a time into a plain full tensor (never more than
-- one full parameter or state per rank at a time; with rank0_only the other ranks drop each at once and get
-- empty tables); cpu_offload: the results on the CPU.  sharded: ShardedTensors (as_sharded_tensor).
-- Collective over the world when full or sharded (every rank calls it).
function M.get_state_dict(model, optimizer, opts)
  local op = "get_state_dict"
  local nnmod = require("engine.nn.module")
  if not nnmod.is_module(model) then fail(op .. ": expected an nn.Module, got " .. type(model)) end
  opts = check_opts(opts, GET_OPTS, op)
  local o = { full = opts.full or opts.full_state_dict, cpu_offload = opts.cpu_offload, sharded = opts.sharded,
    rank0_only = opts.rank0_only }
  if o.full and o.sharded then fail(op .. ": full and sharded are two different forms; ask for one") end
  if o.rank0_only and not o.full then fail(op .. ": rank0_only needs full = true") end
  local keep = not o.rank0_only or comm.world_group():rank() == 0
  local msd = {}
  local sd = model:state_dict()
  E().no_grad(function()
    for _, name in ipairs(model:state_dict_keys()) do
      local t = sd[name]
      if t ~= nil then
        local r = form_of(t, o, keep)
        if keep then msd[name] = r end
      end
    end
  end)
  if optimizer == nil then return msd, nil end
  local ckpt = require("engine.distributed.checkpoint").checkpoint
  local live = ckpt.get_optimizer_state_dict(model, optimizer)
  local osd = { state = {}, param_groups = {} }
  if keep then
    for gi, g in ipairs(live.param_groups) do
      local sg = {}
      for k, v in pairs(g) do sg[k] = type(v) == "table" and { unpack(v) } or v end
      osd.param_groups[gi] = sg
    end
  end
  local _, list = param_names(model)
  local done = {}
  E().no_grad(function()
    for _, e in ipairs(list) do
      local s = live.state[e.name]
      if s and not done[e.name] then
        done[e.name] = true
        local out = {}
        local keys = {}
        for k in pairs(s) do keys[#keys + 1] = k end
        table.sort(keys)
        for _, k in ipairs(keys) do
          local v = s[k]
          if core.is_tensor(v) then out[k] = form_of(v, o, keep) else out[k] = v end
        end
        if keep then osd.state[e.name] = out end
      end
    end
  end)
  return msd, osd
end

function M.get_model_state_dict(model, opts) return (M.get_state_dict(model, nil, opts)) end
function M.get_optimizer_state_dict(model, optimizer, opts)
  local _, o = M.get_state_dict(model, optimizer, opts)
  return o
end

-- ---- loading
local function same_list(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- The local boxes a source value offers on this rank, or nil when it has none to copy from locally.
local function src_boxes(src)
  if is_st(src) then return st_boxes(src) end
  if is_dt(src) then
    for _, p in ipairs(src.placements) do if p:is_partial() then return nil end end
    local runs = dtensor.local_shard_runs(src:shape(), src.device_mesh, src.placements)
    if runs == nil then return {} end
    local off, sz = runs_box(runs)
    if off == nil then return nil end
    return { { tensor = src:to_local(), offsets = off, sizes = sz } }
  end
  local sh = src:shape()
  local off = {}
  for d = 1, #sh do off[d] = 0 end
  return { { tensor = src, offsets = off, sizes = sh } }
end

local function shape_of(v)
  if is_st(v) then return v:size() end
  return v:shape()
end

-- A plan entry per (destination, source): local = true when this rank can fill its destination shard from
-- its own source boxes.
local function plan_entry(dst, src)
  local e = { dst = dst, src = src }
  if is_dt(dst) and is_dt(src) and C.eng_dist_spec_equal(dst._c.dist, src._c.dist) ~= 0 then
    e.same = true
    e.local_ok = true
    return e
  end
  local druns
  if is_dt(dst) then
    druns = dtensor.local_shard_runs(dst:shape(), dst.device_mesh, dst.placements)
    if druns == nil then e.local_ok = true; e.nothing = true; return e end
  else
    druns = {}
    for d, n in ipairs(dst:shape()) do druns[d] = { { 0, n } } end
  end
  local boxes = src_boxes(src)
  if boxes == nil then e.local_ok = false; return e end
  -- every run product of the destination inside one source box
  local nd = #druns
  local ok = true
  local pieces = {}
  local function rec(d, off, sz)
    if not ok then return end
    if d > nd then
      local found
      for _, b in ipairs(boxes) do
        local inside = true
        for k = 1, nd do
          if sz[k] > 0 and (off[k] < b.offsets[k] or off[k] + sz[k] > b.offsets[k] + b.sizes[k]) then inside = false end
        end
        if inside then found = b; break end
      end
      if not found then
        if numel(sz) > 0 then ok = false end
        return
      end
      pieces[#pieces + 1] = { box = found, off = { unpack(off) }, sz = { unpack(sz) } }
      return
    end
    if #druns[d] == 0 then off[d], sz[d] = 0, 0; rec(d + 1, off, sz); return end
    for _, r in ipairs(druns[d]) do off[d], sz[d] = r[1], r[2]; rec(d + 1, off, sz) end
  end
  rec(1, {}, {})
  e.local_ok = ok
  e.pieces = pieces
  e.druns = druns
  return e
end

-- Copies the pieces of a local plan entry into dst's local shard.
local function copy_local(e)
  local dst = e.dst
  if e.nothing then return end
  if e.same then core.check(C.eng_tensor_copy_(dst._c, e.src._c)); return end
  local dl = is_dt(dst) and dst:to_local() or dst
  -- local position of each global run start per dim
  local lpos = {}
  for d, runs in ipairs(e.druns) do
    local m, acc = {}, 0
    for _, r in ipairs(runs) do m[r[1]] = acc; acc = acc + r[2] end
    lpos[d] = m
  end
  for _, pc in ipairs(e.pieces) do
    if numel(pc.sz) > 0 then
      local a, b = dl, pc.box.tensor
      for d = 1, #pc.sz do
        a = a:narrow(d, lpos[d][pc.off[d]] + 1, pc.sz[d])
        b = b:narrow(d, pc.off[d] - pc.box.offsets[d] + 1, pc.sz[d])
      end
      a:copy_(b)
    end
  end
end

-- Fills dst from the full tensor (this rank's part).
local function copy_from_full(dst, full)
  if is_dt(dst) then
    local d = dtensor.distribute_tensor(full, dst.device_mesh, dst.placements, { src_data_rank = false })
    core.check(C.eng_tensor_copy_(dst._c, d._c))
    if not rawequal(d, full) then free_now(d) end
  else
    dst:copy_(full)
  end
end

local function agree(err, op)
  local g = comm.world_group()
  if g:size() > 1 then
    if err then C.eng_set_error_message(err) end
    local rc = C.eng_pg_agree(g._c, err and 1 or 0, 0, op)
    if rc ~= 0 then error(core.last_error(), 0) end
  elseif err then
    error(err, 0)
  end
end

-- Loads the list of {dst, src, name} (checked already): local copies where every rank can make them (one
-- agreement of the flags), else the full tensor of the source, one at a time.
local function load_pairs(items, bcast)
  if bcast then
    -- rank 0 holds full tensors: each is broadcast in the destination's dtype, every rank keeps its part
    local me = comm.world_group():rank()
    E().no_grad(function()
      for _, it in ipairs(items) do
        local dst = it.dst
        local buf
        if me == 0 then buf = it.src:to(dst.dtype):contiguous()
        else buf = E().empty(dst:shape(), { dtype = dst.dtype }) end
        comm.broadcast(buf, 0)
        copy_from_full(dst, buf)
        if not rawequal(buf, it.src) then free_now(buf) end
      end
    end)
    return
  end
  -- a full (plain) source or one of the destination's own layout is local on every rank: no agreement needed;
  -- the others' flags are summed over the ranks (one all_reduce for all of them)
  local plans, flags, unsure, all = {}, {}, {}, {}
  for i, it in ipairs(items) do
    local e = plan_entry(it.dst, it.src)
    plans[i] = e
    if e.same or not (is_dt(it.src) or is_st(it.src)) then all[i] = 0
    else
      unsure[#unsure + 1] = i
      flags[#flags + 1] = e.local_ok and 0 or 1
    end
  end
  if #flags > 0 then
    local sums = require("engine.distributed").allreduce_counts(flags)
    for j, i in ipairs(unsure) do all[i] = sums[j] end
  end
  E().no_grad(function()
    for i, e in ipairs(plans) do
      if all[i] == 0 then copy_local(e)
      else
        local src = e.src
        local full
        if is_st(src) then full = st_full(src, e.dst.dtype)
        elseif is_dt(src) then full = src:full_tensor()
        else full = src end
        copy_from_full(e.dst, full)
        if not rawequal(full, src) then free_now(full) end
      end
    end
  end)
end

local SET_OPTS = { strict = true, broadcast_from_rank0 = true }

-- broadcast_from_rank0: rank 0's state dict reduced to names, shapes and plain values (a string all ranks
-- receive); the other ranks stand meta tensors of those shapes in for the tensors.  Collective.
local function skeleton_exchange(sds, op)
  local ckpt = require("engine.distributed.checkpoint").checkpoint
  local g = comm.world_group()
  local me = g:rank()
  local mine = ""
  if me == 0 then
    local ok, r = pcall(function()
      if type(sds) ~= "table" then error(op .. ": expected {model_state_dict = ..., optim_state_dict = ...}", 0) end
      local function sk(v, key)
        if key == "step" and core.is_tensor(v) and not is_dt(v) and v:numel() == 1 then return v:item() end
        if is_st(v) or core.is_tensor(v) then return { ["\1T"] = shape_of(v) } end
        if type(v) == "table" then
          local r = {}
          for k, x in pairs(v) do r[k] = sk(x, k) end
          return r
        end
        return v
      end
      return "O" .. ckpt._serialize({ m = sk(sds.model_state_dict), o = sk(sds.optim_state_dict) }, op)
    end)
    mine = ok and r or ("E" .. tostring(r))
  end
  local all = stmod.sharded_tensor._agree_strings(mine, g, g:size(), me)
  local s = all[0]
  if s:sub(1, 1) == "E" then return nil, s:sub(2) end
  if me == 0 then return sds end
  local skel = ckpt._deserialize(s:sub(2), "broadcast_from_rank0")
  local function un(v)
    if type(v) == "table" then
      if v["\1T"] then return E().empty(v["\1T"], { device = "meta" }) end
      local r = {}
      for k, x in pairs(v) do r[k] = un(x) end
      return r
    end
    return v
  end
  return { model_state_dict = un(skel.m), optim_state_dict = un(skel.o) }
end

local function describe(v)
  if v == nil then return "nothing" end
  if is_st(v) or core.is_tensor(v) then return layout(v) end
  return type(v)
end

-- dist.set_state_dict(model, optimizer, {model_state_dict = sd, optim_state_dict = osd}, {strict = true}):
-- loads a state dict of any of the three forms (DTensors of any layout, full tensors, ShardedTensors),
-- saved from a model of any layout, into model (and optimizer: states follow their parameter's layout,
-- keyed by parameter name).  Every rank checks names and shapes first and the ranks agree before anything
-- is copied; a full tensor into a DTensor takes this rank's part without communication, a source of another
-- layout is gathered one tensor at a time.  Collective over the world.
function M.set_state_dict(model, optimizer, sds, opts)
  local op = "set_state_dict"
  local nnmod = require("engine.nn.module")
  local err
  local items = {}
  local strict = true
  local bcast = type(opts) == "table" and opts.broadcast_from_rank0 == true
  local is0 = comm.world_group():rank() == 0
  if bcast then sds, err = skeleton_exchange(sds, op) end
  local ok, perr = pcall(function()
    if err then error(err, 0) end
    if not nnmod.is_module(model) then error(op .. ": expected an nn.Module, got " .. type(model), 0) end
    if type(sds) ~= "table" then error(op .. ": expected {model_state_dict = ..., optim_state_dict = ...}", 0) end
    for k in pairs(sds) do
      if k ~= "model_state_dict" and k ~= "optim_state_dict" then
        error(string.format("%s: unknown field '%s' (model_state_dict, optim_state_dict)", op, tostring(k)), 0)
      end
    end
    if opts ~= nil and type(opts) ~= "table" then error(op .. ": options must be a table", 0) end
    for k in pairs(opts or {}) do
      if not SET_OPTS[k] then
        error(string.format("%s: unknown option '%s' (strict, broadcast_from_rank0)", op, tostring(k)), 0)
      end
    end
    strict = not (opts and opts.strict == false)
    local problems = {}
    local msd = sds.model_state_dict
    if msd ~= nil then
      if type(msd) ~= "table" or is_st(msd) or core.is_tensor(msd) then
        error(op .. ": model_state_dict must be a table name -> tensor", 0)
      end
      local cur = model:state_dict({ keep_vars = true })
      local known = {}
      for _, name in ipairs(model:state_dict_keys()) do
        known[name] = true
        local dst, src = cur[name], msd[name]
        if src == nil then
          if strict then problems[#problems + 1] = "missing key " .. name end
        elseif not (is_st(src) or core.is_tensor(src)) then
          problems[#problems + 1] = string.format("%s is a %s, not a tensor", name, type(src))
        elseif bcast and is0 and (is_st(src) or is_dt(src)) then
          problems[#problems + 1] = string.format("%s is a %s: broadcast_from_rank0 loads full tensors (get_state_dict "
            .. "with full = true)", name, describe(src))
        elseif not same_list(shape_of(src), dst:shape()) then
          problems[#problems + 1] = string.format("%s: shape [%s] (%s) does not match the model's [%s] (%s)", name,
            table.concat(shape_of(src), ","), describe(src), table.concat(dst:shape(), ","), describe(dst))
        else
          items[#items + 1] = { dst = dst, src = src, name = name }
        end
      end
      if strict then
        local unexpected = {}
        for k in pairs(msd) do if not known[k] then unexpected[#unexpected + 1] = tostring(k) end end
        table.sort(unexpected)
        if #unexpected > 0 then problems[#problems + 1] = "unexpected key(s) " .. table.concat(unexpected, ", ") end
      end
    end
    local osd = sds.optim_state_dict
    if osd ~= nil then
      if optimizer == nil then error(op .. ": optim_state_dict given without an optimizer", 0) end
      if type(osd) ~= "table" or type(osd.state) ~= "table" or type(osd.param_groups) ~= "table" then
        error(op .. ": optim_state_dict must be {state = {[name] = {...}}, param_groups = {...}} (dist.get_state_dict)", 0)
      end
      for k in pairs(osd.state) do
        if type(k) ~= "string" then
          error(string.format("%s: optim_state_dict.state is keyed by %s %s; states are keyed by parameter name "
            .. "(dist.get_state_dict or dist.checkpoint.get_optimizer_state_dict)", op, type(k), tostring(k)), 0)
        end
      end
      local name_of = param_names(model)
      if #osd.param_groups ~= #optimizer.param_groups then
        problems[#problems + 1] = string.format("optim_state_dict has %d parameter groups, the optimizer %d",
          #osd.param_groups, #optimizer.param_groups)
      end
      local ostate = {}
      for gi, g in ipairs(optimizer.param_groups) do
        local sg = osd.param_groups[gi]
        local in_sd = {}
        for _, n in ipairs(sg and sg.params or {}) do in_sd[n] = true end
        for _, p in ipairs(g.params) do
          local name = name_of[p]
          if not name then error(string.format("%s: a parameter of optimizer group %d is not in the model", op, gi), 0) end
          if sg and not in_sd[name] then
            problems[#problems + 1] = string.format("parameter '%s' is in optimizer group %d but not in that group of "
              .. "optim_state_dict", name, gi)
          end
          local s = osd.state[name]
          if s ~= nil then
            local st = {}
            -- sorted: every rank must gather the states in the same order (pairs order may differ per rank)
            local keys = {}
            for k in pairs(s) do keys[#keys + 1] = k end
            table.sort(keys, function(x, y) return tostring(x) < tostring(y) end)
            for _, k in ipairs(keys) do
              local v = s[k]
              if (is_st(v) or core.is_tensor(v)) and k ~= "step" then
                if bcast and is0 and (is_st(v) or is_dt(v)) then
                  problems[#problems + 1] = string.format("optimizer state '%s' of %s is a %s: broadcast_from_rank0 "
                    .. "loads full tensors", k, name, describe(v))
                elseif not same_list(shape_of(v), p:shape()) then
                  problems[#problems + 1] = string.format("optimizer state '%s' of %s: shape [%s] does not match the "
                    .. "parameter's [%s]", k, name, table.concat(shape_of(v), ","), table.concat(p:shape(), ","))
                else
                  local cur = optimizer.state[p] and optimizer.state[p][k]
                  local dst = cur
                  local fits = core.is_tensor(cur) and cur.dtype == p.dtype and same_list(cur:shape(), p:shape())
                  if fits and is_dt(p) then fits = is_dt(cur) and C.eng_dist_spec_equal(cur._c.dist, p._c.dist) ~= 0
                  elseif fits then fits = not is_dt(cur) end
                  if not fits then
                    local Optimizer = require("engine.optim.optimizer")
                    dst = Optimizer._zeros_like(p)
                  end
                  st[k] = dst
                  items[#items + 1] = { dst = dst, src = v, name = name .. "." .. k }
                end
              elseif core.is_tensor(v) then
                if v:numel() ~= 1 then
                  problems[#problems + 1] = string.format("optimizer state '%s' of %s has %d elements, expected a number",
                    k, name, v:numel())
                else
                  -- the step count: the optimizer's own 0-dim f32 CPU tensor (PyTorch's), holding the value
                  st[k] = require("engine.optim.optimizer")._step_tensor(is_dt(v) and v:full_tensor() or v)
                end
              elseif is_st(v) then
                problems[#problems + 1] = string.format("optimizer state '%s' of %s: a ShardedTensor step", k, name)
              elseif k == "step" and type(v) == "number" then
                st[k] = require("engine.optim.optimizer")._step_tensor(v)
              else
                st[k] = v
              end
            end
            ostate[p] = st
          end
        end
      end
      items.ostate = ostate
    end
    if #problems > 0 then
      error(string.format("%s: error(s) loading the state dict into %s:\n\t%s", op, model.__name, table.concat(problems, "\n\t")), 0)
    end
  end)
  if not ok then err = tostring(perr) end
  agree(err, op)
  local ostate = items.ostate
  items.ostate = nil
  load_pairs(items, bcast)
  if ostate then
    local osd = sds.optim_state_dict
    for gi, g in ipairs(optimizer.param_groups) do
      for k, v in pairs(osd.param_groups[gi]) do
        if k ~= "params" then g[k] = type(v) == "table" and { unpack(v) } or v end
      end
    end
    for p, st in pairs(ostate) do
      local cur = optimizer.state[p] or {}
      for k, v in pairs(st) do cur[k] = v end
      optimizer.state[p] = cur
    end
  end
end

function M.set_model_state_dict(model, sd, opts) return M.set_state_dict(model, nil, { model_state_dict = sd }, opts) end
function M.set_optimizer_state_dict(model, optimizer, osd, opts)
  return M.set_state_dict(model, optimizer, { optim_state_dict = osd }, opts)
end

return M
