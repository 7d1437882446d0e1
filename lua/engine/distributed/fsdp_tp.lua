-- engine.distributed.fsdp_tp: FSDP over tensor parallelism, PyTorch's torch/distributed/tensor/parallel/fsdp.py
-- (DTensorExtensions: the glue between data-parallel sharding and tensor-parallel DTensors) as engine API.
--
--   local offsets, sizes = dist.get_local_box(dt)            -- 0-based offsets, sizes (1-D meshes)
--   local md = dist.create_sharded_tensor_md_from_dt(dt)      -- ShardedTensorMetadata
--   local st = dist.chunk_tensor(t_or_tp_dt, dp_rank, dp_size, nil, dp_group)   -- nested when t is a DTensor
--   local d2 = dist.chunk_dtensor(t_or_tp_dt, rank, mesh["dp"])                 -- [Shard(1), tp] on the parent
--   local inner, shards = dist.pre_load_state_dict(st)
--   local tp_local = dist.all_gather_dtensor(d2, mesh)       -- gathers the dp dims, keeps the tp placement
--   local loc, ext = dist.pre_flatten_transform(dt); dt = dist.post_unflatten_transform(loc, ext)
--   local ext = dist.DTensorExtensions()                     -- the same, under PyTorch's method names
--
-- Conventions: dims are 1-based (Shard(1) is PyTorch's Shard(0)); box offsets and sizes are lists in
-- tensor-dim order whose values are 0-based element offsets (the ShardMetadata convention); ranks and
-- shard indices are 0-based.  Where PyTorch asserts a 1-D mesh, these give an error naming the layout.
local core = require("engine.core")
local engine = require("engine")
local P = require("engine.distributed.placements")
local dtensor = require("engine.distributed.dtensor")
local meshmod = require("engine.distributed.mesh")
local comm = require("engine.distributed.comm")
local specs = require("engine.distributed.sharding_spec")
local stmod = require("engine.distributed.sharded_tensor")
local convert = require("engine.distributed.sharded_tensor_convert")

local M = {}
local fail = core.fail
local is_st = stmod.is_sharded_tensor
local is_dt = dtensor.is_dtensor
local layout, device_str, chunk_box = convert._layout_of, convert._device_str, convert._chunk_box
local st_from_global, plain_chunk = convert._st_from_global, convert._plain_chunk

local function need_dt(t, op)
  if not is_dt(t) then
    fail(string.format("%s: expected a DTensor, got %s", op, core.is_tensor(t) and ("a plain tensor " .. layout(t)) or type(t)))
  end
end

local function need_1d(t, op)
  need_dt(t, op)
  if t.device_mesh:ndim() ~= 1 then
    fail(string.format("%s: %s: only DTensors on a 1-D DeviceMesh are handled (PyTorch's _get_box asserts a 1-D mesh)",
      op, layout(t)))
  end
end

-- ---------------------------------------------------------------- boxes (PyTorch: _get_box, _get_box_for, _get_local_box)
-- get_box(dt) -> offsets, sizes: the offsets step per shard index (torch.chunk's ceil(n/k) on the shard dim,
-- 0 elsewhere) and this rank's local sizes, as PyTorch's _get_box.
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

-- get_box_for(dt, idx) -> offsets, sizes of shard idx (0-based mesh coordinate): the torch.chunk box (PyTorch
-- multiplies the step by idx and keeps the local sizes, which is the same for even sizes; for uneven
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

-- ---------------------------------------------------------------- metadata (PyTorch: _create_shard_md_from_dt, ...)
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
-- ShardedTensor placements are; a Replicate DTensor is one box placed on this rank.  Deviation: PyTorch
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
    fail(string.format("%s: %s: only DTensors on a 1-D (tensor-parallel) DeviceMesh are handled (PyTorch asserts a "
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
  return engine.no_grad(function()
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

-- dist.DTensorExtensions([device_handle]): PyTorch's FSDPExtensions object over the functions above.
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

return M
