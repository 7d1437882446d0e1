-- engine.distributed.dtensor: DTensor (a Tensor sharded/replicated over a DeviceMesh).
--
--   local dist = engine.distributed
--   local mesh = dist.init_device_mesh("cpu", {2, 2}, {"dp", "tp"})
--   local d = dist.distribute_tensor(x, mesh, {dist.Shard(1), dist.Replicate()})
--   d:shape()                       -- GLOBAL shape; d:to_local():shape() is this rank's shard
--   d = d:redistribute(nil, {dist.Replicate(), dist.Shard(2)})   -- mesh nil: same mesh
--   local full = d:full_tensor()    -- plain Tensor with the whole value
--   local p = dist.DTensor.from_local(t, mesh, {dist.Partial(), dist.Replicate()})
--   dist.rand({8, 16}, {mesh = mesh, placements = {dist.Shard(1), dist.Replicate()}})
--
-- A DTensor IS a Tensor (same class; d._c.dist ~= nil): backward, .grad and
-- hooks work as usual and gradients of DTensors are DTensors.  d.placements is
-- a Lua list of placements (Shard dims 1-based), d.device_mesh the mesh.
-- Ranks outside the mesh hold empty local tensors and skip communication.
-- Collectives are counted by dist.comm_counts() / dist.count_collectives().
local core = require("engine.core")
local engine = require("engine")
local Tensor = require("engine.tensor")
local P = require("engine.distributed.placements")
local meshmod = require("engine.distributed.mesh")
local ffi, C = core.ffi, core.C
local wrap, ct, check = core.wrap, core.ct, core.check
local methods, props = Tensor.methods, Tensor.props

local M = {}
M.Shard, M.Replicate, M.Partial, M._StridedShard = P.Shard, P.Replicate, P.Partial, P._StridedShard
M.is_placement = P.is_placement

local function is_dtensor(t) return core.is_tensor(t) and t._c.dist ~= nil end
M.is_dtensor = is_dtensor

-- ---------------------------------------------------------------- meshes
-- The Lua mesh object for a C mesh pointer: the one the user passed in if it is
-- still alive (weak table), else a new wrapper holding a new reference.
local meshes = setmetatable({}, { __mode = "v" })
local function key_of(p) return tonumber(ffi.cast("uintptr_t", p)) end
local function remember(mesh) meshes[key_of(mesh._c)] = mesh; return mesh end
local function mesh_of(p)
  local k = key_of(p)
  local m = meshes[k]
  if m and m._c == p then return m end
  m = meshmod._wrap_mesh(C.eng_mesh_retain(p))
  meshes[k] = m
  return m
end

local function mesh_arg(mesh, op)
  if not meshmod.is_mesh(mesh) then
    core.fail(string.format("%s: device_mesh must be a DeviceMesh (dist.init_device_mesh), got %s", op, type(mesh)))
  end
  return remember(mesh)
end

local function placements_arg(pl, mesh, op)
  if pl == nil then return nil, C.eng_mesh_ndim(mesh._c) end
  return P._to_c(pl, op)
end

local function opts_arg(opts, op)
  if opts ~= nil and type(opts) ~= "table" then core.fail(op .. ": options must be a table") end
  return opts or {}
end

local function int64_list(list, op, what)
  if type(list) ~= "table" then core.fail(string.format("%s: %s must be a list of integers", op, what)) end
  local n = #list
  if n > 8 then core.fail(string.format("%s: %s has %d entries (at most 8)", op, what, n)) end
  local arr = ffi.new("int64_t[8]")
  for i = 1, n do
    local v = list[i]
    if type(v) ~= "number" or v % 1 ~= 0 then
      core.fail(string.format("%s: %s[%d] must be an integer, got %s", op, what, i, tostring(v)))
    end
    arr[i - 1] = v
  end
  return arr, n
end

local function list_of(arr, n)
  local r = {}
  for i = 0, n - 1 do r[i + 1] = tonumber(arr[i]) end
  return r
end

-- ---------------------------------------------------------------- creation
local DTensor = {}
M.DTensor = DTensor

-- DTensor.from_local(t, mesh, placements, {run_check = false, shape = {...}, stride = {...}})
-- No data movement: t becomes this rank's shard.  placements nil: all
-- Replicate.  Without shape/stride the global shape is t's shape times the
-- mesh size on each Shard dim; give both for uneven shards.
local function from_local(t, mesh, placements, opts, keep_device)
  local op = "from_local"
  local c = ct(t, op, 1)
  if not keep_device then
    -- PyTorch moves the local tensor to the mesh's device (differentiably: the gradient goes back)
    local m = mesh_arg(mesh, op)
    local want = m.device_type
    if c.device ~= 2 and t.device ~= want then t = t:to(want); c = t._c end
  end
  mesh = mesh_arg(mesh, op)
  opts = opts_arg(opts, op)
  local arr, n = placements_arg(placements, mesh, op)
  local sh, st = nil, nil
  if opts.shape ~= nil then
    local nn
    sh, nn = int64_list(opts.shape, op, "shape")
    if nn ~= c.ndim then core.fail(string.format("%s: shape has %d entries for a %d-d local tensor", op, nn, c.ndim)) end
  end
  if opts.stride ~= nil then
    local nn
    st, nn = int64_list(opts.stride, op, "stride")
    if nn ~= c.ndim then core.fail(string.format("%s: stride has %d entries for a %d-d local tensor", op, nn, c.ndim)) end
  end
  return wrap(C.eng_dtensor_from_local(c, mesh._c, n, arr, opts.run_check and 1 or 0, sh, st))
end
function DTensor.from_local(t, mesh, placements, opts) return from_local(t, mesh, placements, opts, false) end
M.from_local = DTensor.from_local
-- from_local without the move to the mesh's device (PyTorch's DTensor constructor, as FSDP2 uses it): FSDP's
-- CPU-offloaded shards are CPU locals of DTensors on a CUDA mesh
function M._from_local_as_is(t, mesh, placements, opts) return from_local(t, mesh, placements, opts, true) end
DTensor.is_dtensor = is_dtensor

-- distribute_tensor(t, mesh, placements, {src_data_rank = 0}): scatter (Shard)
-- or broadcast (Replicate) from group rank src_data_rank of each mesh dim;
-- src_data_rank = false (or -1): every rank uses its own t, no communication.
function M.distribute_tensor(t, mesh, placements, opts)
  local op = "distribute_tensor"
  local c = ct(t, op, 1)
  mesh = mesh_arg(mesh, op)
  opts = opts_arg(opts, op)
  local arr, n = placements_arg(placements, mesh, op)
  local src = opts.src_data_rank
  if src == nil then src = 0 elseif src == false then src = -1 end
  if type(src) ~= "number" or src % 1 ~= 0 then
    core.fail(op .. ": src_data_rank must be an integer group rank, or false for no communication")
  end
  local p = C.eng_dtensor_distribute_tensor(c, mesh._c, n, arr, src)
  if p ~= nil and p == c then C.eng_tensor_release(p); return t end  -- already laid out so: t itself
  return wrap(p)
end

-- Factories: only the local shard is allocated.
local function factory_args(op, shape, opts)
  opts = opts_arg(opts, op)
  if opts.mesh == nil then core.fail(op .. ": opts.mesh (a DeviceMesh) is required") end
  local mesh = mesh_arg(opts.mesh, op)
  local nd, sarr = core.shape_arg(op, shape)
  local arr, n = placements_arg(opts.placements, mesh, op)
  local dt = core.dtype(opts.dtype, op)
  return mesh, nd, sarr, arr, n, dt, opts
end

local function requires(t, opts)
  if opts.requires_grad then check(C.eng_tensor_set_requires_grad(t._c, 1)) end
  return t
end

function M.full(shape, value, opts)
  if type(value) == "boolean" then value = value and 1 or 0 end
  if type(value) ~= "number" then core.fail("full: fill value must be a number, got " .. type(value)) end
  local mesh, nd, sarr, arr, n, dt
  mesh, nd, sarr, arr, n, dt, opts = factory_args("full", shape, opts)
  return requires(wrap(C.eng_dtensor_full(nd, sarr, value, dt, mesh._c, n, arr)), opts)
end
function M.zeros(shape, opts)
  local mesh, nd, sarr, arr, n, dt
  mesh, nd, sarr, arr, n, dt, opts = factory_args("zeros", shape, opts)
  return requires(wrap(C.eng_dtensor_full(nd, sarr, 0, dt, mesh._c, n, arr)), opts)
end
function M.ones(shape, opts)
  local mesh, nd, sarr, arr, n, dt
  mesh, nd, sarr, arr, n, dt, opts = factory_args("ones", shape, opts)
  return requires(wrap(C.eng_dtensor_full(nd, sarr, 1, dt, mesh._c, n, arr)), opts)
end
function M.empty(shape, opts)
  local mesh, nd, sarr, arr, n, dt
  mesh, nd, sarr, arr, n, dt, opts = factory_args("empty", shape, opts)
  return requires(wrap(C.eng_dtensor_empty(nd, sarr, dt, mesh._c, n, arr)), opts)
end
-- rand/randn(shape, {mesh =, placements =, dtype =, requires_grad =, generator = g}): the shard's
-- slice of the global random tensor drawn from g (default: the global generator), which every rank
-- advances by the global count; full_tensor() is the same for every layout and equals
-- engine.rand/randn(shape, {generator = g}) with the same seed.
local function random_dtensor(op, kind)
  return function(shape, opts)
    local mesh, nd, sarr, arr, n, dt
    mesh, nd, sarr, arr, n, dt, opts = factory_args(op, shape, opts)
    local gen = require("engine.ops.random")._generator
    local g = gen.check(opts.generator, op)
    local p = gen.with(g, C.eng_dtensor_random, kind, nd, sarr, 0, 1, dt, mesh._c, n, arr)
    return requires(wrap(p), opts)
  end
end
M.rand = random_dtensor("rand", 0)
M.randn = random_dtensor("randn", 1)

-- engine.empty_like / zeros_like / ones_like / full_like / rand_like /
-- randn_like of a DTensor: a DTensor with the same mesh, placements and
-- global shape and stride; the local shard is made with the options (dtype,
-- device: empty_like(meta_dt, {device = "cpu"}) materialises a meta DTensor).
-- rand/randn draw the shard's slice of the global random tensor (CPU).
function Tensor.dtensor_like(name, t, a, b)
  local c = t._c
  local s = c.dist
  local opts = name == "full_like" and b or a
  local lo = Tensor.like_opts(t, opts, name)
  if type(opts) == "table" and opts.requires_grad ~= nil then lo.requires_grad = opts.requires_grad end
  local mesh = mesh_of(s.mesh)
  local pl = P._from_c(s.placements, s.mesh_ndim)
  local shape, stride = {}, {}
  for i = 0, s.ndim - 1 do shape[i + 1] = tonumber(s.shape[i]); stride[i + 1] = tonumber(s.stride[i]) end
  if name == "rand_like" or name == "randn_like" then
    if lo.device ~= mesh.device_type then
      core.fail(string.format("%s: random DTensors are made on their mesh's device (%s), got device %s", name,
        mesh.device_type, tostring(lo.device)))
    end
    return (name == "rand_like" and M.rand or M.randn)(shape, { mesh = mesh, placements = pl, dtype = lo.dtype,
      requires_grad = lo.requires_grad })
  end
  local lshape = {}
  for i = 0, c.ndim - 1 do lshape[i + 1] = tonumber(c.shape[i]) end
  local loc
  if name == "full_like" then loc = engine.full(lshape, a, lo)
  else loc = engine[name:gsub("_like$", "")](lshape, lo) end
  local r = DTensor.from_local(loc:detach(), mesh, pl, { shape = shape, stride = stride })
  if lo.requires_grad then check(C.eng_tensor_set_requires_grad(r._c, 1)) end
  return r
end

-- ---------------------------------------------------------------- methods
local function need_dtensor(t, op)
  local c = ct(t, op, "self")
  if c.dist == nil then core.fail(string.format("%s: %s is not a DTensor", op, ffi.string(C.eng_dtensor_describe(c, ffi.new("char[256]"), 256)))) end
  return c
end

local function grad_pl(opts, op)
  opts = opts_arg(opts, op)
  if opts.grad_placements == nil then return nil end
  return (P._to_c(opts.grad_placements, op .. ": grad_placements"))
end

-- d:to_local({grad_placements = {...}}): plain view of this rank's shard.
function methods.to_local(t, opts)
  local c = need_dtensor(t, "to_local")
  return wrap(C.eng_dtensor_to_local(c, grad_pl(opts, "to_local")))
end

-- d:full_tensor({grad_placements = {...}}): the whole value on every rank (plain Tensor).
function methods.full_tensor(t, opts)
  local c = need_dtensor(t, "full_tensor")
  return wrap(C.eng_dtensor_full_tensor(c, grad_pl(opts, "full_tensor")))
end

-- d:redistribute(mesh_or_nil, placements, {async_op = false, forward_dtype = nil, backward_dtype = nil});
-- also d:redistribute(placements [, opts]).  forward_dtype: the local shard is cast
-- before the communication (the result has that dtype); backward_dtype: the
-- gradient is cast before the communication (default: d's dtype) and d's
-- gradient comes back in d's dtype.
function methods.redistribute(t, mesh, placements, opts)
  local op = "redistribute"
  local c = need_dtensor(t, op)
  if type(mesh) == "table" and not meshmod.is_mesh(mesh) and (placements == nil or not P.is_placement(placements[1])) then
    mesh, placements, opts = nil, mesh, placements
  end
  if mesh ~= nil then mesh = mesh_arg(mesh, op) end
  if placements == nil then core.fail(op .. ": placements is needed for redistribute!") end
  opts = opts_arg(opts, op)
  local arr, n = P._to_c(placements, op)
  local fdt = opts.forward_dtype ~= nil and core.dtype(opts.forward_dtype, op .. ": forward_dtype") or -1
  local bdt = opts.backward_dtype ~= nil and core.dtype(opts.backward_dtype, op .. ": backward_dtype") or -1
  if fdt < 0 and bdt < 0 then
    return wrap(C.eng_dtensor_redistribute(c, mesh and mesh._c or nil, n, arr, opts.async_op and 1 or 0))
  end
  return wrap(C.eng_dtensor_redistribute_dtype(c, mesh and mesh._c or nil, n, arr, opts.async_op and 1 or 0, fdt, bdt))
end

-- d:redistribute_cost([mesh,] placements) -> the cost the op dispatcher gives redistributing d to
-- placements (PyTorch's redistribute_cost): bytes moved, summed over mesh dims; math.huge for
-- another mesh or an impossible change (Shard -> Partial, Partial(op1) -> Partial(op2)).
function methods.redistribute_cost(t, mesh, placements)
  local op = "redistribute_cost"
  local c = need_dtensor(t, op)
  if placements == nil then mesh, placements = nil, mesh end
  if mesh ~= nil then mesh = mesh_arg(mesh, op) end
  if placements == nil then core.fail(op .. ": placements is needed") end
  local arr, n = P._to_c(placements, op)
  local out = ffi.new("double[1]")
  check(C.eng_dtensor_redistribute_cost(c, mesh and mesh._c or nil, n, arr, out))
  return tonumber(out[0])
end

-- Async results: wait for / query a pending redistribute.
function methods.wait(t)
  check(C.eng_dtensor_wait(ct(t, "wait", "self")))
  return t
end
function methods.is_pending(t) return C.eng_dtensor_is_pending(ct(t, "is_pending", "self")) ~= 0 end
function methods.is_dtensor(t) return t._c.dist ~= nil end

props.placements = function(t)
  local s = t._c.dist
  if s == nil then return nil end
  return P._from_c(s.placements, s.mesh_ndim)
end
props.device_mesh = function(t)
  local s = t._c.dist
  if s == nil then return nil end
  return mesh_of(s.mesh)
end

local desc_buf = ffi.new("char[?]", 2048)
-- "f32[4,2] on mesh(2) [Shard(2)]": a DTensor's global layout, for messages.
function methods._layout_str(t)
  return ffi.string(C.eng_dist_spec_describe(t._c.dist, t._c.dtype, desc_buf, 2048))
end

-- get/set/item/totable on a DTensor (tensor.lua): the local tensor is the global one only when every
-- placement is Replicate (on a rank of the mesh); otherwise reading it would mix local and global views.
function Tensor.dtensor_values(t, op)
  local s = t._c.dist
  if s.member ~= 0 and s.has_shard == 0 and s.has_partial == 0 then return end
  local why = s.member == 0 and "this rank is not in its mesh and holds none of it"
    or "this rank holds only its part of the global tensor"
  error(string.format("%s: DTensor %s: %s; call full_tensor() for the global values or to_local() for this "
    .. "rank's local tensor", op, t:_layout_str(), why), 4)
end

-- copy_ between a DTensor and a plain tensor: the plain one would be taken as the local shard.
function Tensor.dtensor_copy_check(t, src)
  if not core.is_tensor(src) then return end
  local td, sd = t._c.dist ~= nil, src._c.dist ~= nil
  if td and sd then
    -- the source is redistributed to the destination's layout, but never to Partial (PyTorch's "for internal use
    -- only"): a Partial destination takes only a source Partial on the same mesh dims
    local tp, sp = t.placements, src.placements
    if #tp ~= #sp then return end  -- other meshes: the dispatcher names them
    for i = 1, #tp do
      if tp[i].kind == "partial" and tp[i] ~= sp[i] then
        error(string.format("copy_: the destination %s is %s on mesh dim %d and the source %s is %s there: layouts "
          .. "differ, and a source cannot be redistributed to Partial; redistribute the destination first "
          .. "(dst = dst:redistribute(mesh, {...}) off Partial), then copy", t:_layout_str(), tostring(tp[i]), i,
          src:_layout_str(), tostring(sp[i])), 3)
      end
    end
    return
  end
  if td then
    if src._c.ndim == 0 then return end -- a scalar fills every element
    error(string.format("copy_: the destination is DTensor %s and the source plain tensor %s: distribute the "
      .. "source first (dist.distribute_tensor(src, mesh, placements)), or copy into d:to_local()",
      t:_layout_str(), ffi.string(C.eng_tensor_describe(src._c, desc_buf, 2048))), 3)
  end
  error(string.format("copy_: the source is DTensor %s and the destination plain tensor %s: copy from "
    .. "src:full_tensor() (the global values) or src:to_local() (this rank's local tensor)", src:_layout_str(),
    ffi.string(C.eng_tensor_describe(t._c, desc_buf, 2048))), 3)
end
function Tensor.dtensor_tostring(t)
  local c = t._c
  C.eng_dtensor_wait(c)
  local s = c.dist
  local spec = ffi.string(C.eng_dist_spec_describe(s, c.dtype, desc_buf, 2048))
  local extra = ""
  if c.grad_fn ~= nil then extra = ", grad_fn=" .. ffi.string(c.grad_fn.name)
  elseif c.requires_grad ~= 0 then extra = ", requires_grad=true" end
  local localt = wrap(C.eng_dtensor_local_view(c))
  return string.format("DTensor(%s%s, local=%s)", spec, extra, tostring(localt))
end

-- ---------------------------------------------------------------- layout helpers
-- local_shard_size_and_offset(n, k, r): torch.chunk size and (0-based) offset of chunk r.
function M.local_shard_size_and_offset(n, k, r)
  local size, off = ffi.new("int64_t[1]"), ffi.new("int64_t[1]")
  check(C.eng_shard_size_and_offset(n, k, r, size, off))
  return tonumber(size[0]), tonumber(off[0])
end

-- Resharding math (a saved checkpoint chunk against the shard this rank holds now).  A box is
-- {offsets = {...}, sizes = {...}} with 0-based element offsets, one entry per dim.
local function box_arrays(box, op, what)
  if type(box) ~= "table" or type(box.offsets) ~= "table" or type(box.sizes) ~= "table" then
    core.fail(string.format("%s: the %s box must be a table {offsets = {...}, sizes = {...}}", op, what))
  end
  local o, n = int64_list(box.offsets, op, what .. " offsets")
  local s, m = int64_list(box.sizes, op, what .. " sizes")
  if n ~= m then core.fail(string.format("%s: the %s box has %d offsets and %d sizes", op, what, n, m)) end
  return o, s, n
end

-- both boxes as C arrays: offsets, sizes of a, offsets, sizes of b, ndim
local function box_pair(a, b, op, na, nb)
  local oa, sa, n = box_arrays(a, op, na)
  local ob, sb, m = box_arrays(b, op, nb)
  if n ~= m then core.fail(string.format("%s: boxes of %d and %d dims", op, n, m)) end
  return oa, sa, ob, sb, n
end

-- check_shard_metadata_pair_overlap(a, b) -> true when the boxes intersect.
function M.check_shard_metadata_pair_overlap(a, b)
  local oa, sa, ob, sb, n = box_pair(a, b, "check_shard_metadata_pair_overlap", "first", "second")
  local r = C.eng_shard_boxes_overlap(n, oa, sa, ob, sb)
  if r < 0 then core.fail(core.last_error()) end
  return r == 1
end

-- shards_get_overlap_region_wrt_saved_tensor(saved, current) -> list of
-- {dim (1-based), offset in the saved chunk, offset in the current shard, length}, one per dim:
-- copy saved:narrow(dim, saved_offset + 1, length) into current:narrow(dim, current_offset + 1, length).
function M.shards_get_overlap_region_wrt_saved_tensor(saved, current)
  local so, ss, co, cs, n = box_pair(saved, current, "shards_get_overlap_region_wrt_saved_tensor", "saved", "current")
  local out = ffi.new("int64_t[?]", 4 * math.max(n, 1))
  if C.eng_shard_overlap_region(n, so, ss, co, cs, out) ~= 0 then core.fail(core.last_error()) end
  local r = {}
  for i = 0, n - 1 do
    r[i + 1] = { tonumber(out[4 * i]) + 1, tonumber(out[4 * i + 1]), tonumber(out[4 * i + 2]), tonumber(out[4 * i + 3]) }
  end
  return r
end

-- Arguments of the layout helpers below, as C arrays; member false on a rank
-- outside the mesh (when coord is not given).
local function layout_args(op, shape, mesh, placements, coord)
  local sarr, nd = int64_list(shape, op, "global shape")
  local mshape = ffi.new("int64_t[8]")
  local cbuf = ffi.new("int[8]")
  local mnd
  if meshmod.is_mesh(mesh) then
    mnd = C.eng_mesh_ndim(mesh._c)
    for i = 0, mnd - 1 do mshape[i] = C.eng_mesh_size(mesh._c, i) end
  else
    local _
    _, mnd = int64_list(mesh, op, "mesh shape")
    for i = 1, mnd do mshape[i - 1] = mesh[i] end
    if coord == nil then core.fail(op .. ": coord (a 0-based list) is required with a mesh shape") end
  end
  if placements == nil then
    placements = {}
    for i = 1, mnd do placements[i] = P.Replicate() end
  end
  local arr, n = P._to_c(placements, op)
  if n ~= mnd then
    core.fail(string.format("%s: `placements` must have the same length as `device_mesh.ndim`! Found placements length: %d, and device_mesh.ndim: %d.", op, n, mnd))
  end
  local member = true
  if coord ~= nil then
    for i = 1, mnd do cbuf[i - 1] = coord[i] end
  elseif C.eng_mesh_get_coordinate(mesh._c, cbuf) == 0 then
    member = false
  end
  return sarr, nd, mnd, mshape, cbuf, arr, member
end

-- compute_local_shape_and_global_offset(global_shape, mesh, placements [, coord])
-- -> local shape, 0-based global offsets (lists).  coord (0-based list)
-- defaults to this rank's; a rank outside the mesh gets zeros and nil.
-- mesh may also be a list of mesh sizes (then coord is required).
--
-- On a dim split by a _StridedShard the shard may be several runs of the
-- global dim (see local_shard_runs); the offset is then the start of the
-- first run (exact when there is one run, as for [_StridedShard(d, sf = k2),
-- Shard(d)] with even sizes).
function M.compute_local_shape_and_global_offset(shape, mesh, placements, coord)
  local sarr, nd, mnd, mshape, cbuf, arr, member =
    layout_args("compute_local_shape_and_global_offset", shape, mesh, placements, coord)
  if not member then
    local z = {}
    for i = 1, nd do z[i] = 0 end
    return z, nil
  end
  local ls, off = ffi.new("int64_t[8]"), ffi.new("int64_t[8]")
  check(C.eng_local_shape_and_offset(nd, sarr, mnd, mshape, cbuf, arr, ls, off))
  return list_of(ls, nd), list_of(off, nd)
end

-- local_shard_runs(global_shape, mesh_or_shape, placements [, coord]) -> one
-- list per tensor dim of the runs {start (0-based), length} of the global dim
-- that the shard holds, in local order (adjacent runs merged; {} when empty).
-- One run per dim unless a _StridedShard with split_factor > 1 splits it.
-- nil on a rank outside the mesh.
function M.local_shard_runs(shape, mesh, placements, coord)
  local op = "local_shard_runs"
  local sarr, nd, mnd, mshape, cbuf, arr, member = layout_args(op, shape, mesh, placements, coord)
  if not member then return nil end
  local r = {}
  for d = 0, nd - 1 do
    local n = C.eng_local_shard_runs(nd, sarr, mnd, mshape, cbuf, arr, d, nil, nil, 0)
    if n < 0 then core.raise() end
    local st, len = ffi.new("int64_t[?]", n + 1), ffi.new("int64_t[?]", n + 1)
    if C.eng_local_shard_runs(nd, sarr, mnd, mshape, cbuf, arr, d, st, len, n) < 0 then core.raise() end
    local runs = {}
    for i = 0, n - 1 do runs[i + 1] = { tonumber(st[i]), tonumber(len[i]) } end
    r[d + 1] = runs
  end
  return r
end

-- redistribute_plan(src_placements, dst_placements, global_shape, mesh_or_shape [, coord])
-- -> list of steps {mesh_dim = (1-based), src = Placement, dst = Placement,
-- logical_shape = {...}} (PyTorch's greedy transform infos).  With a list of
-- mesh sizes instead of a mesh, coord (0-based list) is required.
function M.redistribute_plan(src, dst, shape, mesh, coord)
  local op = "redistribute_plan"
  local sarr, nd = int64_list(shape, op, "global shape")
  local mshape = ffi.new("int64_t[8]")
  local cbuf = ffi.new("int[8]")
  local mnd
  if meshmod.is_mesh(mesh) then
    mnd = C.eng_mesh_ndim(mesh._c)
    for i = 0, mnd - 1 do mshape[i] = C.eng_mesh_size(mesh._c, i) end
    if coord == nil and C.eng_mesh_get_coordinate(mesh._c, cbuf) == 0 then return {} end
  else
    local _
    _, mnd = int64_list(mesh, op, "mesh shape")
    for i = 1, mnd do mshape[i - 1] = mesh[i] end
    if coord == nil then core.fail(op .. ": coord (a 0-based list) is required with a mesh shape") end
  end
  if coord ~= nil then for i = 1, mnd do cbuf[i - 1] = coord[i] end end
  local sa, sn = P._to_c(src, op)
  local da, dn = P._to_c(dst, op)
  if sn ~= mnd or dn ~= mnd then
    core.fail(string.format("%s: %d source and %d target placements for a %d-d mesh", op, sn, dn, mnd))
  end
  local out = ffi.new("eng_transform_info[16]")
  local n = C.eng_redistribute_plan(mnd, mshape, cbuf, sa, da, nd, sarr, out, 16)
  if n < 0 then core.raise() end
  local r = {}
  for i = 0, n - 1 do
    local e = out[i]
    r[i + 1] = { mesh_dim = e.mesh_dim + 1, src = P._one_from_c(e.src), dst = P._one_from_c(e.dst),
      logical_shape = list_of(e.logical_shape, nd) }
  end
  return r
end

-- Internal redistribute (also to Partial: Replicate -> Partial(sum) divides
-- by the mesh dim size), as op dispatch uses it.  Autograd-recorded.
function M._redistribute_internal(t, placements)
  local op = "redistribute"
  local c = need_dtensor(t, op)
  local arr = P._to_c(placements, op)
  local spec = C.eng_dist_spec_with_placements(c.dist, arr)
  if spec == nil then core.raise() end
  local r = C.eng_dtensor_redistribute_spec(c, spec, 2)
  C.eng_dist_spec_release(spec)
  return wrap(r)
end

-- dist.set_backward_reduce_dtype(mesh, dtype_or_nil [, dim = 1]): the gradient reductions autograd issues in
-- backward on the group of mesh dim `dim` (a Partial gradient to Replicate or Shard: all_reduce,
-- reduce_scatter) run in dtype (cast before the collective, back after); nil: in the gradient's own dtype.
-- It belongs to the group, so the parent mesh and every slice sharing it follow.  fully_shard sets it on the
-- TP mesh to its MixedPrecisionPolicy's reduce_dtype (FSDP over tensor parallelism).
function M.set_backward_reduce_dtype(mesh, dtype, dim)
  local op = "set_backward_reduce_dtype"
  mesh = mesh_arg(mesh, op)
  local code = dtype ~= nil and core.dtype(dtype, op) or -1
  check(C.eng_dtensor_set_backward_reduce_dtype(mesh._c, (dim or 1) - 1, code))
end
function M.get_backward_reduce_dtype(mesh, dim)
  local op = "get_backward_reduce_dtype"
  mesh = mesh_arg(mesh, op)
  local code = C.eng_dtensor_get_backward_reduce_dtype(mesh._c, (dim or 1) - 1)
  if code == -2 then check(-1) end
  if code < 0 then return nil end
  return core.dtype_names[code]
end
-- Local mode (for op dispatch code): ops ignore DTensor specs while on.
function M.set_local_mode(on) return C.eng_dtensor_set_local_mode(on and 1 or 0) ~= 0 end
function M.wait_all() check(C.eng_dtensor_wait_all()) end

return M
