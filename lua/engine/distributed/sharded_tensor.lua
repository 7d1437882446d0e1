-- engine.distributed.sharded_tensor: PyTorch's ShardedTensor (torch.distributed._shard).
--
--   local spec = dist.ChunkShardingSpec{dim = 1, placements = {"rank:0/cpu", "rank:1/cpu"}}
--   local st = dist.sharded_tensor.zeros(spec, {10, 20}, {dtype = "f32"})
--   for _, s in ipairs(st:local_shards()) do print(s.tensor:shape(), s.metadata) end
--   local full = st:gather(0)            -- the full tensor on rank 0, nil elsewhere (collective)
--   local st2 = st:reshard(dist.ChunkShardingSpec{dim = 2, placements = ...})   -- one all_to_all
--   local dt = st:to_dtensor()           -- Shard(1) on a 1-D mesh, sharing the local shard's storage
--   local y = (st * 2 + st):relu()       -- elementwise ops: a ShardedTensor of the same spec
--
-- Each rank holds one local tensor per shard whose placement names its rank.  Placements name GLOBAL
-- ranks, as PyTorch's, also with a process group (which must contain them: "Global rank 5 does not exist
-- in input process group: [1, 2, 3]", raised on every rank, also outside the group when it was made by
-- new_group); src_rank and gather's dst are group ranks (PyTorch's too).  Sizes are a list or varargs:
-- zeros(spec, {10, 20}, opts) or zeros(spec, 10, 20[, opts]).  Factories empty/zeros/ones/full/rand/randn and their *_like
-- (rand/randn: each shard is its box of the global random tensor, equal to engine.rand(size) for
-- every spec); dist.ShardedTensor.init_from_local_shards (checked across ranks); dist.shard_tensor.
--
-- DTensor bridge: a ChunkShardingSpec whose placements name distinct ranks is the DTensor Shard(dim)
-- on the 1-D mesh of those ranks in placement order (each rank once in order: the whole group).
-- st:to_dtensor() and dist.ShardedTensor.from_dtensor(dt) convert without copying (the DTensor's
-- local tensor is the shard's tensor).  A DTensor-backed ShardedTensor (made by to_dtensor /
-- from_dtensor / shard_parameter, or once its mesh exists) runs its ops through the DTensor
-- dispatcher; otherwise ops run shard by shard on the local shards.  The mesh of a group is made
-- once (collective over the world: to_dtensor on a ShardedTensor of the world group; a subgroup's
-- mesh must be passed in or come from from_dtensor).
--
-- Devices: placements "rank:R/cuda:D" (or "rank:R/cuda") put the shards on rank R's GPU (see "devices" below);
-- their collectives run on device buffers (NCCL), their DTensors live on a CUDA mesh.
local core = require("engine.core")
local specs = require("engine.distributed.sharding_spec")
local comm = require("engine.distributed.comm")

local M = {}

local function fail(msg) core.fail(msg) end

local ShardedTensor = { __name = "ShardedTensor" }
ShardedTensor.__index = ShardedTensor
M.ShardedTensor = ShardedTensor

local function is_sharded_tensor(x) return getmetatable(x) == ShardedTensor end
M.is_sharded_tensor = is_sharded_tensor

local known = { dtype = true, requires_grad = true, process_group = true }

local function group_rank(pg)
  if pg == nil then return require("engine.distributed").rank() end
  return pg:rank()
end

local function world_of(pg) return pg and pg:size() or require("engine.distributed").world_size() end

-- Placements name GLOBAL ranks, as PyTorch's ("rank:2/cpu" is world rank 2 whatever the process group;
-- the group must contain it).  gmap(pg)[global rank] -> the group rank (nil outside the group): the
-- identity for the world.  Collectives, src_rank and gather's dst use group ranks (PyTorch's too).
local IDENT = setmetatable({}, { __index = function(_, r) return r end })
local gmaps = setmetatable({}, { __mode = "k" })
local function gmap(pg)
  if pg == nil then return IDENT end
  local m = gmaps[pg]
  if m == nil then
    m = {}
    for i, r in ipairs(pg:members() or {}) do m[r] = i - 1 end
    gmaps[pg] = m
  end
  return m
end

-- The group's global ranks (the world's without a group); nil on a non-member that cannot know them.
local function members_of(pg)
  if pg == nil then
    local l = {}
    for r = 0, require("engine.distributed").world_size() - 1 do l[r + 1] = r end
    return l
  end
  return pg:members()
end

-- PyTorch's _parse_and_validate_remote_device: every placement's rank is in the group.  Raised on every
-- rank (the spec is the same everywhere), also outside the group when the group's members are known there.
local function check_placements(op, shards_md, pg)
  local mem = members_of(pg)
  if mem == nil then return end
  local set = {}
  for _, r in ipairs(mem) do set[r] = true end
  for i, sm in ipairs(shards_md) do
    local r = sm.placement and sm.placement.rank
    if r ~= nil and not set[r] then
      fail(string.format("%s: shard %d: Global rank %d does not exist in input process group: [%s]", op, i, r,
        table.concat(mem, ", ")))
    end
  end
end

-- ---------------------------------------------------------------- devices
-- A spec's placements are all on the CPU ("rank:R/cpu") or all on CUDA devices ("rank:R/cuda:D" or
-- "rank:R/cuda"); mixing them is refused (the collectives of one ShardedTensor run on one backend: MPI for
-- CPU shards, NCCL for CUDA ones, chosen per tensor by the process group).  The engine keeps one GPU per
-- process (the node-local rank's, engine/include/eng/cuda.h), so a placement "rank:R/cuda:D" must name
-- rank R's own GPU (PyTorch allocates on cuda:D, which is that GPU in the usual "rank:i/cuda:i" layouts);
-- another index is refused on every rank, naming the rank, both GPUs and the fix; "cuda" alone is the
-- rank's GPU.  Tests swap the probe (M._set_device_probe) to run the CUDA paths' logic on CPU tensors.
local cuda_probe = {
  available = function() return require("engine.cuda").is_available() end,
  reason = function() return require("engine.cuda").unavailable_reason() end,
  current = function() return require("engine.cuda").current_device() end,
  count = function() return require("engine.cuda").device_count() end,
  tensor_device = "cuda", -- the engine device of CUDA shards
  mesh_device = "cuda",   -- the DeviceMesh device type of their DTensors
}
local probe = cuda_probe

-- spec -> "cpu" | "cuda" (the placements' device type; cached), or an error naming the mixed placements.
local spec_kind = setmetatable({}, { __mode = "k" })
local function placements_of(spec)
  if getmetatable(spec) == specs.ChunkShardingSpecClass then return spec.placements end
  local l = {}
  for i, s in ipairs(spec.shards) do l[i] = s.placement end
  return l
end
local function kind_of(spec, op)
  local k = spec_kind[spec]
  if k then return k end
  local first
  for i, p in ipairs(placements_of(spec)) do
    if p ~= nil then
      local pk = p.device == "cpu" and "cpu" or "cuda"
      if first == nil then first = { pk, i, p }
      elseif first[1] ~= pk then
        fail(string.format("%s: the placements mix devices (%d: %s, %d: %s): a ShardedTensor's shards are all on the "
          .. "CPU or all on CUDA devices (mixed placements are not supported)", op or "ShardedTensor", first[2],
          tostring(first[3]), i, tostring(p)))
      end
    end
  end
  k = first and first[1] or "cpu"
  spec_kind[spec] = k
  return k
end
M._kind_of = kind_of

-- The engine device of shards of placement kind k ("cpu" / "cuda").
function M._device_of_kind(k)
  if k == "cpu" then return "cpu" end
  return probe.tensor_device
end

-- The engine device of a spec's shards ("cpu", or the probe's CUDA device).
local function spec_device(spec, op)
  if kind_of(spec, op) == "cpu" then return "cpu" end
  return probe.tensor_device
end

-- Why this rank cannot hold a shard placed on placement p (a CUDA one), or nil.
local function cuda_placement_error(op, i, p)
  local me = require("engine.distributed").rank()
  if not probe.available() then
    return string.format("%s: shard %d is placed on %s, but rank %d has no usable GPU (%s)", op, i, tostring(p), me,
      probe.reason())
  end
  local want = tonumber(p.device:match("^cuda:(%d+)$"))
  local cur = probe.current()
  if want ~= nil and want ~= cur then
    return string.format("%s: shard %d is placed on %s, but rank %d uses GPU %d: the engine keeps one GPU per process "
      .. "(the node-local rank's, modulo the GPU count); place each rank's shards on its own GPU (\"rank:%d/cuda:%d\", "
      .. "as \"rank:i/cuda:i %% device_count\" on one node) or on \"rank:%d/cuda\"", op, i, tostring(p), me, cur, me,
      cur, me)
  end
  return nil
end
M._cuda_placement_error = cuda_placement_error

-- The placement string of global rank r's CUDA shards in specs the engine makes (from_dtensor, the
-- ShardedTensor form of DTensors): PyTorch's "rank:r/cuda:(r % device_count)" (torch/distributed/tensor/
-- parallel/fsdp.py), the GPU the engine picks for r when ranks fill the nodes in order.
local function cuda_placement(r)
  local n = probe.count()
  return string.format("rank:%d/cuda:%d", r, n > 0 and r % n or 0)
end
M._cuda_placement = cuda_placement

-- M._set_device_probe(p): tests replace the CUDA probe ({available, reason, current, count, tensor_device,
-- mesh_device}); nil restores it.  Clears the cached meshes of CUDA placements.
local meshes
function M._set_device_probe(p)
  probe = p or cuda_probe
  for k in pairs(meshes) do if k:match("^cuda|") then meshes[k] = nil end end
end

-- Every rank of the group agrees on the CUDA placements of spec: this rank's local error (a placement on
-- another GPU, no GPU) fails every rank, with its message where it occurred and naming the rank elsewhere.
-- One small all_reduce over the host (MPI), only for CUDA specs.  Collective.
local function agree_cuda(op, spec, pg, err)
  local gpg = pg or comm.world_group()
  if err then core.C.eng_set_error_message(err) end
  if core.C.eng_pg_agree(gpg._c, err and 1 or 0, 0, op) ~= 0 then
    if err then fail(err) end
    fail(string.format("%s: %s: another rank cannot hold its shards (%s)", op, tostring(spec), core.last_error()))
  end
end

local function topts(dt, dev)
  if dev == "cpu" then return { dtype = dt } end
  return { dtype = dt, device = dev }
end

-- Builds a ShardedTensor of `size` laid out by `spec`, each local shard made by make(shape, dtype, box,
-- device).  Collective for CUDA placements (agree_cuda); not for CPU ones.
local function build(op, spec, size, opts, make)
  if not specs.is_sharding_spec(spec) then
    fail(op .. ": the first argument must be a ChunkShardingSpec or an EnumerableShardingSpec")
  end
  opts = opts or {}
  if type(opts) ~= "table" then fail(op .. ": options must be a table") end
  for k in pairs(opts) do
    if not known[k] then fail(string.format("%s: unknown option '%s' (dtype, requires_grad, process_group)", op, tostring(k))) end
  end
  local dtype = opts.dtype or "f32"
  local props = specs.TensorProperties{ dtype = dtype, requires_grad = opts.requires_grad }
  local md = spec:build_metadata(size, props)
  local pg = opts.process_group
  local me = group_rank(pg)
  local gm = gmap(pg)
  check_placements(op, md.shards_metadata, pg)
  local dev = spec_device(spec, op)
  if kind_of(spec, op) ~= "cpu" then
    local err
    for i, s in ipairs(md.shards_metadata) do
      if not err and me ~= nil and gm[s.placement.rank] == me then err = cuda_placement_error(op, i, s.placement) end
    end
    if me ~= nil then agree_cuda(op, spec, pg, err) end
  end
  local shards = {}
  for _, s in ipairs(md.shards_metadata) do
    if me ~= nil and gm[s.placement.rank] == me then
      local t = make(s.shard_sizes, dtype, s, dev)
      if opts.requires_grad then t.requires_grad = true end
      shards[#shards + 1] = { tensor = t, metadata = s }
    end
  end
  return setmetatable({ _spec = spec, _metadata = md, _size = md.size, _shards = shards, _pg = pg, dtype = props.dtype },
    ShardedTensor)
end

-- (size, opts) from a factory's arguments after the spec: a list {10, 20} then the options, or the sizes as
-- varargs (PyTorch's sharded_tensor.empty(spec, 10, 20)) then the options.
local function size_args(...)
  local first = ...
  if type(first) ~= "number" then return first, select(2, ...) end
  local n, size = select("#", ...), {}
  local i = 1
  while i <= n and type((select(i, ...))) == "number" do size[i] = (select(i, ...)); i = i + 1 end
  return size, (select(i, ...))
end

local function factory(op, make)
  return function(spec, ...)
    local size, opts = size_args(...)
    return build(op, spec, size, opts, make)
  end
end

local engine_mod = require("engine")

M.empty = factory("sharded_tensor.empty", function(shape, dt, _, dev) return engine_mod.empty(shape, topts(dt, dev)) end)
M.zeros = factory("sharded_tensor.zeros", function(shape, dt, _, dev) return engine_mod.zeros(shape, topts(dt, dev)) end)
M.ones = factory("sharded_tensor.ones", function(shape, dt, _, dev) return engine_mod.ones(shape, topts(dt, dev)) end)
function M.full(spec, size, value, opts)
  if type(value) ~= "number" then fail("sharded_tensor.full: fill value must be a number, got " .. type(value)) end
  return build("sharded_tensor.full", spec, size, opts, function(shape, dt, _, dev)
    return engine_mod.full(shape, value, topts(dt, dev))
  end)
end

-- rand / randn(spec, size, opts): every shard is its box of the global random tensor that
-- engine.rand / engine.randn(size) would draw from the global generator (the engine's offset RNG), and
-- the generator advances by the global numel on every rank, so the full tensor is the same for every
-- spec and equal to engine.rand(size) after the same seed.
-- opts.generator = g: drawn from the engine.Generator g instead (advanced alike on every rank).
local function random_factory(op, kind)
  local gen = require("engine.ops.random")._generator
  local draw
  local function factory_fn(spec, ...)
    local size, opts = size_args(...)
    if type(opts) == "table" and opts.generator ~= nil then
      local g = gen.check(opts.generator, op)
      local rest = {}
      for k, v in pairs(opts) do if k ~= "generator" then rest[k] = v end end
      return gen.with(g, draw, spec, size, rest)
    end
    return draw(spec, size, opts)
  end
  draw = function(spec, size, opts)
    local C = core.C
    local ffi = core.ffi
    local numel = 1
    if type(size) == "table" then for _, x in ipairs(size) do numel = numel * (tonumber(x) or 0) end end
    local st = ffi.new("uint64_t[2]")
    C.eng_rng_get_state(st, st + 1)
    local seed = st[0]
    local first = true
    local offset
    local t = build(op, spec, size, opts, function(shape, dt, box, dev)
      if first then offset = C.eng_rng_reserve(numel); first = false end
      local start = {}
      for d = 1, #shape do start[d] = box.shard_offsets[d] + 1 end
      local r = engine_mod.random_slice(kind, size, start, shape, { dtype = dt, seed = seed, offset = offset })
      -- CUDA shards: drawn on the host and copied (the CPU and CUDA Philox streams are bit-identical)
      if dev ~= "cpu" and r.device ~= dev then r = r:to(dev) end
      return r
    end)
    if first then C.eng_rng_reserve(numel) end   -- no local shard: advance the generator all the same
    return t
  end
  return factory_fn
end
M.rand = random_factory("sharded_tensor.rand", "uniform")
M.randn = random_factory("sharded_tensor.randn", "normal")

-- Every rank's Lua list of integers (any length), indexed by group rank: one all_reduce of the
-- lengths, one all_gather of the lists padded to the longest.  Collective.
local function all_gather_lists(list, dtype, pg, world, me)
  local opts = pg and { group = pg } or nil
  local lens = engine_mod.zeros({ world }, { dtype = "i64" })
  lens:narrow(1, me + 1, 1):fill_(#list)
  comm.all_reduce(lens, "sum", opts)
  local l, maxl = lens:totable(), 1
  for r = 1, world do maxl = math.max(maxl, l[r]) end
  local buf = engine_mod.zeros({ maxl }, { dtype = dtype })
  if #list > 0 then buf:narrow(1, 1, #list):copy_(engine_mod.tensor(list, dtype)) end
  local all = engine_mod.empty({ world * maxl }, { dtype = dtype })
  comm.all_gather_into(all, buf, opts)
  local a, out = all:totable(), {}
  for r = 0, world - 1 do
    local t = {}
    for i = 1, l[r + 1] do t[i] = a[r * maxl + i] end
    out[r] = t
  end
  return out
end

-- init_from_local_shards(local_shards, size, {process_group}): a ShardedTensor from each rank's own
-- shards ({tensor = t, metadata = ShardMetadata}, or the list dist.Shard-like pairs {t, md}).  Collective:
-- every rank's shard boxes, dtypes and local checks are all-gathered first and the same checks run on
-- every rank (a shard placed on another rank, a tensor whose shape is not its shard_sizes, dtypes that
-- disagree, overlaps, gaps, boxes out of bounds), so all ranks raise the same error, naming the rank.
local FIELDS = 5 -- per shard: rank, dtype code, local error code, ndim, device (-1 CPU, D >= 0 GPU D); then offsets, sizes
function M.init_from_local_shards(shards, size, opts)
  local op = "init_from_local_shards"
  local C, ffi = core.C, core.ffi
  local dist = require("engine.distributed")
  opts = opts or {}
  local pg = opts.process_group
  local world = pg and pg:size() or dist.world_size()
  local me = group_rank(pg)
  local gme = dist.rank()   -- placements name global ranks
  if type(shards) ~= "table" then fail(op .. ": local_shards must be a list of {tensor = t, metadata = ShardMetadata}") end
  if type(size) ~= "table" then fail(op .. ": size must be a list of sizes") end
  local nd = #size
  -- local rows: rank, dtype, err (0 ok, 1 wrong placement, 2 shape mismatch, 3 bad entry, 4 the tensor is not on
  -- its placement's device, 5 a CUDA placement this rank cannot hold), ndim, device, offsets, sizes
  local rows, list, cerr = {}, {}, nil
  for i, e in ipairs(shards) do
    local t = type(e) == "table" and (e.tensor or e[1]) or nil
    local md = type(e) == "table" and (e.metadata or e[2]) or nil
    local err, dt, dv = 0, -1, -1
    if not core.is_tensor(t) or getmetatable(md) ~= specs.ShardMetadataClass then err = 3
    else
      dt = core.dtype(t.dtype, op)
      if md.placement == nil or md.placement.rank ~= gme then err = 1 end
      local sh = t:shape()
      if err == 0 and (#sh ~= #md.shard_sizes) then err = 2 end
      for d = 1, #sh do if err == 0 and sh[d] ~= md.shard_sizes[d] then err = 2 end end
      if #md.shard_offsets ~= nd then err = 2 end
      if err == 0 and md.placement.device ~= "cpu" then
        -- PyTorch: "Local shard tensor device does not match with local Shard's placement!"
        if t.device ~= probe.tensor_device then err = 4
        else
          cerr = cuda_placement_error(op, i, md.placement)
          if cerr then err = 5 else dv = probe.current() end
        end
      elseif err == 0 and t.device ~= "cpu" then err = 4 end
    end
    local row = { gme, dt, err, nd, dv }
    for d = 1, nd do row[FIELDS + d] = md and md.shard_offsets[d] or 0; row[FIELDS + nd + d] = md and md.shard_sizes[d] or 0 end
    rows[i] = row
    list[i] = { tensor = t, metadata = md }
  end
  local width = FIELDS + 2 * nd
  local flat = {}
  for _, row in ipairs(rows) do for k = 1, width do flat[#flat + 1] = row[k] end end
  local per_rank = all_gather_lists(flat, "i64", pg, world, me)
  -- the same checks on every rank
  local metas, dtype = {}, nil
  local why = { "is placed on another rank", "has a tensor whose shape differs from its shard_sizes (or dims from the size)",
    "is not a {tensor = t, metadata = ShardMetadata} pair",
    "has a tensor on another device than its placement (Local shard tensor device does not match with local Shard's "
      .. "placement)", "is placed on a GPU that rank cannot use" }
  local kind
  for r = 0, world - 1 do
    local A = per_rank[r]
    for j = 1, #A / width do
      local base = (j - 1) * width
      local rr, dt, err = A[base + 1], A[base + 2], A[base + 3]
      if err == 5 and rr == gme and cerr then fail(cerr) end
      if err ~= 0 then fail(string.format("%s: rank %d's local shard %d %s", op, rr, j, why[err])) end
      local k = A[base + 5] < 0 and "cpu" or "cuda"
      if kind == nil then kind = { k, rr, j }
      elseif kind[1] ~= k then
        fail(string.format("%s: the local shards mix devices (rank %d's shard %d on %s, rank %d's shard %d on %s): a "
          .. "ShardedTensor's shards are all on the CPU or all on CUDA devices", op, kind[2], kind[3], kind[1], rr, j, k))
      end
      if dtype == nil then dtype = dt
      elseif dt ~= dtype then
        fail(string.format("%s: the local shards disagree on the dtype (rank %d's shard %d is %s, an earlier one %s)", op, rr,
          j, core.ffi.string(C.eng_dtype_name(dt)), core.ffi.string(C.eng_dtype_name(dtype))))
      end
      local o, z = {}, {}
      for d = 1, nd do o[d] = A[base + FIELDS + d]; z[d] = A[base + FIELDS + nd + d] end
      local dv = A[base + 5]
      metas[#metas + 1] = specs.ShardMetadata{ shard_offsets = o, shard_sizes = z,
        placement = "rank:" .. rr .. (dv < 0 and "/cpu" or ("/cuda:" .. dv)) }
    end
  end
  check_placements(op, metas, pg)
  specs._validate(op, metas, size, true)   -- bounds, overlaps, the exact cover: the same on every rank
  if #metas == 0 then fail(op .. ": no rank holds a shard") end
  local md = specs.ShardedTensorMetadata{ shards_metadata = metas, size = size,
    tensor_properties = specs.TensorProperties{ dtype = core.ffi.string(C.eng_dtype_name(dtype)) } }
  local spec = specs.EnumerableShardingSpec(metas)
  return setmetatable({ _spec = spec, _metadata = md, _size = md.size, _shards = list, _pg = pg,
    dtype = md.tensor_properties.dtype },
    ShardedTensor)
end

-- shard_tensor(tensor, spec, {src_rank = 0, process_group}): torch.distributed._shard's _shard_tensor.  Every rank
-- checks that all ranks passed the same src_rank and spec (the seed's messages), then the data of
-- src_rank's tensor is scattered, each rank receiving its shards.  Collective.
local function agree_strings(mine, pg, world, me)
  local bytes = {}
  for i = 1, #mine do bytes[i] = mine:byte(i) end
  local per_rank, out = all_gather_lists(bytes, "u8", pg, world, me), {}
  for r = 0, world - 1 do
    local chars = {}
    for i, b in ipairs(per_rank[r]) do chars[i] = string.char(b) end
    out[r] = table.concat(chars)
  end
  return out
end

M._agree_strings = agree_strings

local function hash_str(str)   -- FNV-1a, 32 bits
  local h = 2166136261
  for i = 1, #str do h = bit.bxor(h, str:byte(i)); h = (h * 16777619) % 4294967296 end
  return h
end
M._hash_str = hash_str

-- Box moves (comm.box_exchange) name each rank's tensors by number: the shards of rank r, in metadata
-- order, are r's tensors 1, 2, ...  Returns each entry's number and this rank's tensors in that order
-- (tensor_of(entry) gives the local tensor of an entry placed on this rank).
local function box_numbering(list, me, tensor_of, gm)
  local idx, mine, cnt = {}, {}, {}
  for i, s in ipairs(list) do
    local r = gm[s.placement.rank]
    cnt[r] = (cnt[r] or 0) + 1
    idx[i] = cnt[r]
    if r == me then mine[cnt[r]] = tensor_of(s) end
  end
  return idx, mine
end

-- The local tensors of st by box: a shard's metadata object may be the caller's (init_from_local_shards)
-- rather than an entry of st:metadata(), so entries are matched by offsets and sizes (empty shards
-- that share them are interchangeable).
local function box_key(s) return table.concat(s.shard_offsets, ",") .. "|" .. table.concat(s.shard_sizes, ",") end
local function local_by_box(list)
  local m = {}
  for _, s in ipairs(list) do m[box_key(s.metadata)] = s.tensor:detach() end
  return function(entry) return m[box_key(entry)] end
end

local function zeros_list(n) local z = {} for d = 1, n do z[d] = 0 end return z end

-- src's tensor scattered into the shards of spec (PyTorch's ChunkShardingSpec.shard: src_rank is a
-- group rank): one scatter.  When the shards are the tensor's memory in rank order (one chunk per rank
-- on the leading dim, placements the group's ranks in order, even sizes) the tensor itself is sent and every rank
-- receives straight into its shard; otherwise each shard is moved once out of src's tensor when the
-- group shares a node (comm.box_exchange, counted as the scatter), else src packs each rank's shards
-- into a block padded to the largest, and the receivers view or copy them out.
local function scatter_shards(op, tensor, spec, src, pg, world, me)
  local shape, dtype = tensor:shape(), tensor.dtype
  local md = spec:build_metadata(shape, specs.TensorProperties{ dtype = dtype })
  local shards = md.shards_metadata
  check_placements(op, shards, pg)
  local gm = gmap(pg)
  local copts = { group = pg or comm.world_group(), group_src = src }
  local d = spec:shard_dim(#shape)
  local dev = spec_device(spec, op)   -- CUDA placements: the scatter runs on device buffers (NCCL)
  local direct = #shards == world
  for dd = 1, d - 1 do direct = direct and shape[dd] == 1 end
  for i, s in ipairs(shards) do
    direct = direct and gm[s.placement.rank] == i - 1 and s.shard_sizes[d] * world == shape[d]
  end
  local src_t = me == src and tensor:detach() or nil
  if src_t and src_t.device ~= dev then src_t = src_t:to(dev) end   -- to the placements' device first
  if direct then
    return build(op, spec, shape, { dtype = dtype, process_group = pg }, function(shp, dt)
      local out = engine_mod.empty(shp, topts(dt, dev))
      comm.scatter(out, src_t, nil, copts)
      return out
    end)
  end
  if world > 1 and kind_of(spec, op) == "cpu" then
    -- single copy: each shard moves once, straight out of src's tensor (comm.box_exchange)
    local built = build(op, spec, shape, { dtype = dtype, process_group = pg }, function(shp, dt)
      return engine_mod.empty(shp, { dtype = dt })
    end)
    local mine = {}
    for _, s in ipairs(built._shards) do mine[s.metadata] = s.tensor end
    local list = built._metadata.shards_metadata
    local idx, dsts = box_numbering(list, me, function(s) return mine[s] end, gm)
    local moves = {}
    for i, s in ipairs(list) do
      if s:numel() > 0 then
        moves[#moves + 1] = { from = src, src = 1, src_off = s.shard_offsets, to = gm[s.placement.rank], dst = idx[i],
          dst_off = zeros_list(#shape), shape = s.shard_sizes }
      end
    end
    if comm.box_exchange(moves, src_t and { src_t } or {}, dsts,
      { group = pg, dtype = dtype, ndim = #shape, op = op, kind = "scatter" }) then
      return built
    end
  end
  local per_rank = {}
  for r = 0, world - 1 do per_rank[r] = 0 end
  for _, s in ipairs(shards) do per_rank[gm[s.placement.rank]] = per_rank[gm[s.placement.rank]] + s:numel() end
  local maxn = 1
  for r = 0, world - 1 do maxn = math.max(maxn, per_rank[r]) end
  local send
  if src_t then
    send = engine_mod.empty({ world * maxn }, topts(dtype, dev))
    local cursor = {}
    for r = 0, world - 1 do cursor[r] = r * maxn end
    for _, s in ipairs(shards) do
      local n, r = s:numel(), gm[s.placement.rank]
      if n > 0 then
        local box = src_t
        for k = 1, #shape do box = box:narrow(k, s.shard_offsets[k] + 1, s.shard_sizes[k]) end
        send:narrow(1, cursor[r] + 1, n):view(unpack(s.shard_sizes)):copy_(box)
      end
      cursor[r] = cursor[r] + n
    end
  end
  local recv = engine_mod.empty({ maxn }, topts(dtype, dev))
  comm.scatter(recv, send, nil, copts)
  local pos = 0
  local single = per_rank[me] == maxn
  return build(op, spec, shape, { dtype = dtype, process_group = pg }, function(shp, dt, box)
    local n = box:numel()
    local piece = recv:narrow(1, pos + 1, n)
    pos = pos + n
    if single then return piece:view(unpack(shp)) end   -- the whole buffer is this shard: no copy
    return piece:view(unpack(shp)):clone()
  end)
end

-- Local checks (which may fail on one rank only) are agreed with the (src_rank, spec, shape) of every
-- rank in one all_gather, so a bad argument on any rank fails every rank (naming that rank) before
-- the scatter.  local_err: a message from the caller's own local checks (shard_parameter).
function M.shard_tensor(tensor, spec, opts, local_err, op)
  op = op or "shard_tensor"
  local dist = require("engine.distributed")
  local err = local_err
  if type(opts) ~= "table" and opts ~= nil then err = err or (op .. ": options must be a table"); opts = {} end
  opts = opts or {}
  for k in pairs(opts) do
    if k ~= "src_rank" and k ~= "process_group" then
      err = err or string.format("%s: unknown option '%s' (src_rank, process_group)", op, tostring(k))
    end
  end
  local pg = opts.process_group
  local world = world_of(pg)
  local me = group_rank(pg)
  local src = opts.src_rank or 0
  if not err then
    if not core.is_tensor(tensor) then err = op .. ": expected a tensor, got " .. type(tensor)
    elseif dist.is_dtensor(tensor) then err = op .. ": expected a plain tensor, got a DTensor (use redistribute)"
    elseif not tensor:is_contiguous() then err = op .. ": input tensor is not a contiguous Tensor"
    elseif not specs.is_sharding_spec(spec) then
      err = op .. ": sharding_spec must be a ChunkShardingSpec or an EnumerableShardingSpec"
    end
  end
  local shape = (not err) and table.concat(tensor:shape(), ",") or ""
  local mine = err and ("E" .. err) or string.format("O%s\n%s\n%s", tostring(src), tostring(spec), shape)
  -- one small uncounted all_reduce when every rank is fine and agrees (a hash of src_rank, spec and shape);
  -- otherwise every rank exchanges the details for the seed's messages
  if err then core.C.eng_set_error_message(err) end
  local gpg = pg or comm.world_group()
  local function finish()   -- (the same on every rank once src_rank, spec and shape agree)
    if type(src) ~= "number" or src % 1 ~= 0 or src < 0 or src >= world then
      fail(string.format("%s: src_rank must be a rank of the process group (0..%d), got %s", op, world - 1, tostring(src)))
    end
    if getmetatable(spec) ~= specs.ChunkShardingSpecClass then
      fail(op .. ": EnumerableShardingSpec.shard not implemented yet!")
    end
    return scatter_shards(op, tensor, spec, src, pg, world, me)
  end
  if core.C.eng_pg_agree(gpg._c, err and 1 or 0, hash_str(mine), op) == 0 then return finish() end
  local all = agree_strings(mine, pg, world, me)
  if err then fail(err) end
  for idx = 0, world - 1 do
    if all[idx]:sub(1, 1) == "E" then fail(string.format("%s: rank %d: %s", op, idx, all[idx]:sub(2))) end
  end
  for idx = 0, world - 1 do
    local osrc, ospec, oshape = all[idx]:sub(2):match("^(.-)\n(.*)\n(.-)$")
    if osrc ~= tostring(src) then
      fail(string.format("src_rank=%s on rank: %d does not match with src_rank=%s on rank: %d", tostring(src), me,
        tostring(osrc), idx))
    end
    if ospec ~= tostring(spec) then
      fail(string.format("sharding_spec=%s on rank: %d does not match with sharding_spec=%s on rank: %d", tostring(spec),
        me, tostring(ospec), idx))
    end
    if oshape ~= shape then
      fail(string.format("%s: the tensor on rank %d has shape [%s], on rank %d [%s]", op, me, shape, idx, tostring(oshape)))
    end
  end
  return finish()
end

-- ---------------------------------------------------------------- accessors
-- A ShardedTensor: _spec, _size, dtype, _pg (nil: the world), and its local shards (_shards, a list
-- of {tensor, metadata}) and/or its DTensor (_dt, on its 1-D mesh; _mesh is set only where to_dtensor
-- made it).  _metadata and _shards of a DTensor-backed one are made on first use (an op's result carries
-- neither: it is a 4-field table, whose hash part is half a 6-field one's; the allocation is most of what
-- a ShardedTensor op costs over the DTensor op, through the garbage collector).
function ShardedTensor:metadata()
  local md = self._metadata
  if md == nil then
    md = self._spec:build_metadata(self._size, specs.TensorProperties{ dtype = self.dtype })
    self._metadata = md
  end
  return md
end

local function shards_of(self)
  local l = self._shards
  if l == nil then
    local me = group_rank(self._pg)
    local gm = gmap(self._pg)
    l = {}
    local loc
    for _, s in ipairs(self:metadata().shards_metadata) do
      if me ~= nil and gm[s.placement.rank] == me then
        loc = loc or self._dt:to_local()
        l[#l + 1] = { tensor = loc, metadata = s }
      end
    end
    self._shards = l
  end
  return l
end

function ShardedTensor:local_shards()
  local r = {}
  for i, s in ipairs(shards_of(self)) do r[i] = { tensor = s.tensor, metadata = s.metadata } end
  return r
end

function ShardedTensor:local_tensor()
  local l = shards_of(self)
  if #l ~= 1 then
    fail("local_tensor: Only single local shard is supported (this rank holds " .. #l .. " shards)")
  end
  return l[1].tensor
end

function ShardedTensor:sharding_spec() return self._spec end
function ShardedTensor:process_group() return self._pg end
function ShardedTensor:size(d)
  local s = self._size
  if d == nil then return { unpack(s) } end
  local i = d < 0 and #s + 1 + d or d
  if i < 1 or i > #s then fail(string.format("size: dim %d out of range for a %d-d ShardedTensor", d, #s)) end
  return s[i]
end
ShardedTensor.shape = ShardedTensor.size
function ShardedTensor:dim() return #self._size end
function ShardedTensor:numel()
  local n = 1
  for _, x in ipairs(self._size) do n = n * x end
  return n
end
function ShardedTensor:is_dtensor_backed() return self._dt ~= nil end

ShardedTensor.__tostring = function(st)
  local n = st._shards and #st._shards or nil
  return string.format("ShardedTensor(%s[%s], %s, %s%s)", st.dtype, table.concat(st._size, ","), tostring(st._spec),
    n and (n .. " local shard(s)") or "local shards in its DTensor", st._dt and ", DTensor-backed" or "")
end

local function contiguous_stride(size)
  local st, acc = {}, 1
  for d = #size, 1, -1 do st[d] = acc; acc = acc * math.max(size[d], 1) end
  return st
end

local function same_list(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- ---------------------------------------------------------------- the DTensor bridge
-- 1-D meshes by their global ranks ("0,1,2,3"; "cuda|0,1,2,3" for CUDA ones): made once, collective over
-- the world.
meshes = {}

-- The ChunkShardingSpec an EnumerableShardingSpec is equal to (its shards sorted along one dim,
-- full on the others, sized as torch.chunk), or nil.
local function as_chunk(spec, size)
  if getmetatable(spec) == specs.ChunkShardingSpecClass then return spec end
  local shards = spec.shards
  for d = 1, #size do
    local full = true
    for _, s in ipairs(shards) do
      for k = 1, #size do
        if k ~= d and (s.shard_offsets[k] ~= 0 or s.shard_sizes[k] ~= size[k]) then full = false end
      end
    end
    if full then
      local sorted = {}
      for i, s in ipairs(shards) do sorted[i] = s end
      table.sort(sorted, function(a, b)
        if a.shard_offsets[d] ~= b.shard_offsets[d] then return a.shard_offsets[d] < b.shard_offsets[d] end
        return a.shard_sizes[d] < b.shard_sizes[d]
      end)
      local pls = {}
      for i, s in ipairs(sorted) do pls[i] = s.placement end
      local ok, c = pcall(specs.ChunkShardingSpec, { dim = d, placements = pls })
      if ok then
        local md = c:build_metadata(size, specs.TensorProperties())
        local same = true
        for i, s in ipairs(md.shards_metadata) do if s ~= sorted[i] then same = false end end
        if same then return c end
      end
    end
  end
  return nil
end

-- (global ranks of the mesh, 1-based shard dim) for st's spec, or nil and why not.
local function dt_layout(st)
  local c = as_chunk(st._spec, st._size)
  if c == nil then
    return nil, "its shards are not the torch.chunk pieces of one dim (a DTensor on a 1-D mesh holds Shard(d) chunks)"
  end
  local gm = gmap(st._pg)
  local seen, ranks = {}, {}
  for i, p in ipairs(c.placements) do
    if seen[p.rank] then
      return nil, string.format("rank %d holds several shards (placements %d and %d), a DTensor one shard per rank",
        p.rank, seen[p.rank], i)
    end
    if gm[p.rank] == nil then return nil, "placement " .. tostring(p) .. " names a rank outside the process group" end
    seen[p.rank] = i
    ranks[i] = p.rank   -- placements are global ranks
  end
  return ranks, c:shard_dim(#st._size)
end

-- The meshes' cache key: the ranks, prefixed by "cuda|" for CUDA placements (a CUDA mesh).
local function mesh_key(ranks, kind)
  local key = table.concat(ranks, ",")
  if kind ~= "cpu" then key = "cuda|" .. key end
  return key
end

-- The 1-D mesh of the placements' ranks, of the placements' device type (a CUDA mesh for CUDA placements:
-- its DTensors' collectives run through NCCL).
local function mesh_for(ranks, pg, given, op, kind)
  kind = kind or "cpu"
  local key = mesh_key(ranks, kind)
  local rk = table.concat(ranks, ",")
  local mdev = kind == "cpu" and "cpu" or probe.mesh_device
  local dist = require("engine.distributed")
  if given ~= nil then
    if not require("engine.distributed.mesh").is_mesh(given) or given:ndim() ~= 1 or not same_list(given:flat_ranks(), ranks) then
      fail(string.format("%s: mesh must be a 1-D DeviceMesh over the ranks [%s] (the placements' ranks in order)", op, rk))
    end
    if given.device_type ~= mdev then
      fail(string.format("%s: mesh is a %s DeviceMesh, the placements are on %s: pass a DeviceMesh(\"%s\", {%s})", op,
        given.device_type, kind == "cpu" and "the CPU" or "CUDA devices", mdev, rk))
    end
    meshes[key] = meshes[key] or given
    return given
  end
  local m = meshes[key]
  if m then return m end
  if pg ~= nil and pg:size() ~= dist.world_size() then
    fail(string.format("%s: no DeviceMesh over the ranks [%s] yet; making one is collective over the world, so for a "
      .. "ShardedTensor of a subgroup pass {mesh = dist.DeviceMesh(\"%s\", {%s})} made on every rank", op, rk, mdev, rk))
  end
  m = dist.DeviceMesh(mdev, ranks)   -- collective over the world: every rank of the world group is here
  meshes[key] = m
  return m
end

-- st:to_dtensor([{mesh = m}]) -> the DTensor Shard(dim) on the 1-D mesh of the placements' ranks,
-- whose local tensor IS this rank's shard tensor (no copy).  Errors naming the spec when it has no
-- DTensor equivalent (several shards on one rank, shards that are not chunks of one dim).
function ShardedTensor:to_dtensor(opts)
  if self._dt then return self._dt end
  local op = "to_dtensor"
  local ranks, d = dt_layout(self)
  if ranks == nil then fail(string.format("%s: %s has no DTensor equivalent: %s", op, tostring(self._spec), d)) end
  local mesh = mesh_for(ranks, self._pg, opts and opts.mesh, op, kind_of(self._spec, op))
  local l = shards_of(self)
  local t = l[1] and l[1].tensor
  if t == nil then
    local z = { unpack(self._size) }
    z[d] = 0
    t = engine_mod.empty(z, topts(self.dtype, spec_device(self._spec, op)))
  end
  local dt = require("engine.distributed.dtensor").DTensor.from_local(t, mesh, { require("engine.distributed.placements").Shard(d) },
    { shape = self._size, stride = contiguous_stride(self._size) })
  self._dt, self._mesh = dt, mesh
  return dt
end

local SHARD = 1   -- ENG_PLACEMENT_SHARD

-- ShardedTensor.from_dtensor(dt) -> the ShardedTensor of a Shard(d) DTensor on a 1-D mesh: a
-- ChunkShardingSpec{dim = d, placements = the mesh's ranks in order} over the world group, whose
-- local shard IS dt's local tensor (no copy).
function M.from_dtensor(dt)
  local op = "ShardedTensor.from_dtensor"
  local dist = require("engine.distributed")
  if not dist.is_dtensor(dt) then fail(op .. ": expected a DTensor, got " .. (core.is_tensor(dt) and "a plain tensor" or type(dt))) end
  local s = dt._c.dist
  if s.mesh_ndim ~= 1 or s.placements[0].kind ~= SHARD then
    fail(string.format("%s: DTensor %s has no ShardedTensor equivalent: a ChunkShardingSpec is Shard(d) on a 1-D mesh",
      op, dt:_layout_str()))
  end
  local mesh = dt.device_mesh
  local ranks = mesh:flat_ranks()
  local cuda = mesh.device_type ~= "cpu"
  local key = mesh_key(ranks, cuda and "cuda" or "cpu")
  meshes[key] = meshes[key] or mesh
  local pls = {}
  -- a CUDA mesh: PyTorch's placements of its chunk-sharded tensors, "rank:r/cuda:(r % device_count)"
  for i, r in ipairs(ranks) do pls[i] = cuda and cuda_placement(r) or ("rank:" .. r .. "/cpu") end
  local size = {}
  for i = 0, s.ndim - 1 do size[i + 1] = tonumber(s.shape[i]) end
  local spec = specs.ChunkShardingSpec{ dim = s.placements[0].dim + 1, placements = pls }
  return setmetatable({ _spec = spec, _size = size, dtype = dt.dtype, _dt = dt }, ShardedTensor)
end
ShardedTensor.from_dtensor = M.from_dtensor

-- The DTensor of st when it has one or its mesh exists already (no communication), else nil.
local function dt_ready(st)
  local dt = st._dt
  if dt then return dt end
  if st._nodt then return nil end
  local ranks = dt_layout(st)
  if ranks and meshes[mesh_key(ranks, kind_of(st._spec))] then return st:to_dtensor() end
  return nil
end

-- A DTensor result r of an op on src's DTensor -> a ShardedTensor of src's spec when r is laid out
-- as src (same mesh, Shard dim and shape), else r itself.
-- The fast path's result: r is an elementwise op's result on src's DTensor with src's layout and the
-- given dtype (no C call, no cdata field read: LuaJIT often interprets these paths).
-- (no nil value in the table constructor: it makes LuaJIT build the table the slow way, ~1 us; the ops'
-- fast paths below inline this)
local function fast_wrap(src, r, dtype)
  local pg = src._pg
  if pg then
    return setmetatable({ _spec = src._spec, _size = src._size, dtype = dtype, _dt = r, _pg = pg },
      ShardedTensor)
  end
  return setmetatable({ _spec = src._spec, _size = src._size, dtype = dtype, _dt = r }, ShardedTensor)
end
-- same: the caller knows r is laid out as src's DTensor (a pointwise op of same-layout operands keeps
-- the layout), so only the dtype is read (the check costs ~1 us where LuaJIT interprets).
local spec_equal = core.C.eng_dist_spec_equal
local function wrap_like(src, r, same)
  local rc = r._c
  local dc = src._dt._c
  if not same then
    local s = rc.dist
    if s == nil or spec_equal(s, dc.dist) == 0 then return r end   -- mesh, placements, global shape and stride
  end
  return fast_wrap(src, r, rc.dtype == dc.dtype and src.dtype or r.dtype)
end

local FLOAT = { f32 = true, f64 = true, bf16 = true, f16 = true }

-- A ShardedTensor of st's layout with the given local shard tensors (one per local shard).
local function with_locals(st, list, dtype)
  local shards = {}
  local ls = shards_of(st)
  for i, s in ipairs(ls) do shards[i] = { tensor = list[i], metadata = s.metadata } end
  dtype = list[1] and list[1].dtype or dtype or st.dtype
  return setmetatable({ _spec = st._spec, _size = st._size, dtype = dtype, _pg = st._pg, _shards = shards }, ShardedTensor)
end

-- ---------------------------------------------------------------- elementwise ops
local methods = require("engine.tensor").methods

-- Fails (the same on every rank: layouts are global) unless a and b are laid out alike.
local function check_layout(op, a, b)
  if same_list(a._size, b._size) then
    if rawequal(a._spec, b._spec) or a._spec == b._spec then return end
    local x, y = a:metadata().shards_metadata, b:metadata().shards_metadata
    local ok = #x == #y
    for i = 1, #x do ok = ok and x[i] == y[i] end
    if ok then return end
  end
  fail(string.format("%s: ShardedTensors of different layouts: [%s] %s and [%s] %s (reshard one first)", op,
    table.concat(a._size, ","), tostring(a._spec), table.concat(b._size, ","), tostring(b._spec)))
end

local function unary(name, to)
  local m = methods[name]
  return function(self, x, y)   -- (no varargs: they keep LuaJIT from compiling the DTensor path)
    local dt = self._dt
    if dt then
      local dtype = self.dtype
      if FLOAT[dtype] then   -- fast_wrap, inlined (a Lua frame costs ~0.1 us where LuaJIT interprets)
        local r, pg = m(dt, x, y), self._pg
        if pg then
          return setmetatable({ _spec = self._spec, _size = self._size, dtype = to or dtype, _dt = r,
            _pg = pg }, ShardedTensor)
        end
        return setmetatable({ _spec = self._spec, _size = self._size, dtype = to or dtype, _dt = r },
          ShardedTensor)
      end
    end
    dt = dt or dt_ready(self)
    if dt then return wrap_like(self, m(dt, x, y), true) end
    local out = {}
    for i, s in ipairs(shards_of(self)) do out[i] = m(s.tensor, x, y) end
    local dtype = #out == 0 and m(engine_mod.empty({ 0 }, { dtype = self.dtype }), x, y).dtype or nil
    return with_locals(self, out, dtype)
  end
end

local arith = {
  add = function(x, y) return x + y end, sub = function(x, y) return x - y end,
  mul = function(x, y) return x * y end, div = function(x, y) return x / y end,
  pow = function(x, y) return x ^ y end,
}

local CMP = { eq = true, ne = true, lt = true, le = true, gt = true, ge = true }
local Tensor = require("engine.tensor")
local META = { add = Tensor.__add, sub = Tensor.__sub, mul = Tensor.__mul, div = Tensor.__div }

local function binary(name)
  local f = arith[name] or methods[name]
  local ff = META[name] or methods[name]
  local cmp = CMP[name]
  return function(a, b)
    -- the fast path: a DTensor-backed floating ShardedTensor with a number or a ShardedTensor of the same
    -- spec, size (objects) and dtype; fast_wrap inlined (one Lua frame less where LuaJIT interprets)
    if getmetatable(a) == ShardedTensor then
      local da, dtype = a._dt, a.dtype
      if da and FLOAT[dtype] then
        local r
        if type(b) == "number" then r = ff(da, b)
        elseif getmetatable(b) == ShardedTensor and rawequal(a._spec, b._spec) and rawequal(a._size, b._size)
          and b.dtype == dtype and b._dt then
          r = ff(da, b._dt)
        end
        if r then
          local pg = a._pg
          if pg then
            return setmetatable({ _spec = a._spec, _size = a._size, dtype = cmp and "bool" or dtype, _dt = r,
              _pg = pg }, ShardedTensor)
          end
          return setmetatable({ _spec = a._spec, _size = a._size, dtype = cmp and "bool" or dtype, _dt = r },
            ShardedTensor)
        end
      end
    end
    local st, other, swap = a, b, false
    if not is_sharded_tensor(a) then st, other, swap = b, a, true end
    local ost = is_sharded_tensor(other)
    if ost then check_layout(name, st, other)
    elseif core.is_tensor(other) and other._c.dist == nil and other._c.ndim > 0 then
      fail(string.format("%s: a ShardedTensor and a plain tensor of shape [%s]: use a number, a ShardedTensor of the same "
        .. "layout, or a DTensor", name, table.concat(other:shape(), ",")))
    end
    local dt = dt_ready(st)
    local odt = ost and dt and dt_ready(other) or nil
    if dt and (not ost or odt) then
      local y = odt or other
      return wrap_like(st, swap and f(y, dt) or f(dt, y))
    end
    if core.is_tensor(other) and other._c.dist ~= nil then
      fail(string.format("%s: a ShardedTensor without a DTensor (%s) and DTensor %s: call to_dtensor() first", name,
        tostring(st._spec), other:_layout_str()))
    end
    local ol = ost and shards_of(other) or nil
    local out = {}
    for i, s in ipairs(shards_of(st)) do
      local y = ol and ol[i].tensor or other
      out[i] = swap and f(y, s.tensor) or f(s.tensor, y)
    end
    local dtype = nil
    if #out == 0 then
      local z = engine_mod.empty({ 0 }, { dtype = st.dtype })
      local y = ost and engine_mod.empty({ 0 }, { dtype = other.dtype }) or other
      dtype = (swap and f(y, z) or f(z, y)).dtype
    end
    return with_locals(st, out, dtype)
  end
end

for _, n in ipairs({ "neg", "abs", "relu", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "gelu", "silu", "detach",
  "clone", "contiguous", "clamp" }) do
  ShardedTensor[n] = unary(n)
end
ShardedTensor.float, ShardedTensor.double = unary("float", "f32"), unary("double", "f64")
for _, n in ipairs({ "add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge" }) do
  ShardedTensor[n] = binary(n)
end
ShardedTensor.__add, ShardedTensor.__sub, ShardedTensor.__mul = ShardedTensor.add, ShardedTensor.sub, ShardedTensor.mul
ShardedTensor.__div, ShardedTensor.__pow = ShardedTensor.div, ShardedTensor.pow
ShardedTensor.__unm = function(a) return a:neg() end

-- In-place fills keep the shards (and a DTensor's local tensor) in place.
function ShardedTensor:fill_(v)
  for _, s in ipairs(shards_of(self)) do s.tensor:fill_(v) end
  if self._dt and #shards_of(self) == 0 then self._dt:to_local():fill_(v) end
  return self
end
function ShardedTensor:zero_() return self:fill_(0) end

-- ---------------------------------------------------------------- comparisons (collective)
-- equal(other) / allclose(other [, rtol = 1e-5 [, atol = 1e-8 [, equal_nan = false]]]): true on every rank
-- when both are laid out alike and every shard agrees (one all_reduce over the group; PyTorch's
-- torch.equal / torch.allclose on ShardedTensors).  Different layouts: false on every rank, no
-- communication.  allclose is torch.isclose's rule: a and b are close when equal (infinities of one sign
-- included) or when |a - b| is finite and <= atol + rtol * |b|; a NaN is close to nothing (to a NaN with
-- equal_nan), +inf is not close to -inf nor to a finite value.
local function compare(op, a, b, close)
  if not is_sharded_tensor(b) then fail(op .. ": expected a ShardedTensor, got " .. (core.is_tensor(b) and "a tensor" or type(b))) end
  if not same_list(a._size, b._size) or a.dtype ~= b.dtype then return false end
  local ok = pcall(check_layout, op, a, b)
  if not ok then return false end
  local good = 1
  local la, lb = shards_of(a), shards_of(b)
  for i, s in ipairs(la) do
    local x, y = s.tensor:detach(), lb[i].tensor:detach()
    if x:numel() > 0 then
      local bad
      if close then
        local err = (x - y):abs()
        local ok = x:eq(y):logical_or(err:isfinite():logical_and(err:le(y:abs() * close[1] + close[2])))
        if close[3] then ok = ok:logical_or(x:isnan():logical_and(y:isnan())) end
        bad = x:numel() - ok:sum():item()
      else bad = x:ne(y):sum():item() end
      if bad ~= 0 then good = 0 end
    end
  end
  -- (on the shards' device: a CUDA ShardedTensor's group reduces through NCCL)
  local flag = engine_mod.full({ 1 }, good, topts("i64", spec_device(a._spec, op)))
  comm.all_reduce(flag, "min", a._pg and { group = a._pg } or nil)
  return flag:item() == 1
end
function ShardedTensor:equal(other) return compare("equal", self, other, nil) end
function ShardedTensor:allclose(other, rtol, atol, equal_nan)
  for i, v in ipairs({ { rtol, "rtol" }, { atol, "atol" } }) do
    if v[1] ~= nil and (type(v[1]) ~= "number" or v[1] ~= v[1]) then
      fail(string.format("allclose: %s must be a number, got %s", v[2], tostring(v[1])))
    end
  end
  if equal_nan ~= nil and type(equal_nan) ~= "boolean" then
    fail("allclose: equal_nan must be a boolean, got " .. tostring(equal_nan))
  end
  return compare("allclose", self, other, { rtol or 1e-5, atol or 1e-8, equal_nan == true })
end

-- ---------------------------------------------------------------- *_like
local function like_opts(st, opts, op)
  opts = opts or {}
  if type(opts) ~= "table" then fail(op .. ": options must be a table") end
  return { dtype = opts.dtype or st.dtype, requires_grad = opts.requires_grad, process_group = st._pg,
    generator = opts.generator }
end
local function need_st(x, op)
  if not is_sharded_tensor(x) then fail(op .. ": expected a ShardedTensor, got " .. type(x)) end
end
for _, n in ipairs({ "empty", "zeros", "ones", "rand", "randn" }) do
  M[n .. "_like"] = function(st, opts)
    need_st(st, "sharded_tensor." .. n .. "_like")
    return M[n](st._spec, st._size, like_opts(st, opts, "sharded_tensor." .. n .. "_like"))
  end
end
function M.full_like(st, value, opts)
  need_st(st, "sharded_tensor.full_like")
  return M.full(st._spec, st._size, value, like_opts(st, opts, "sharded_tensor.full_like"))
end

-- The shards are slabs of the row-major memory of the tensor in group-rank order: chunks on the
-- leading non-unit dim d (torch.chunk sizes, even or not), shard i on group rank i - 1, at most one per
-- rank (ranks past the last chunk hold none).  Returns d and each group rank's length along d, or nil.
local function slab_layout(shards, size, world, gm)
  local n, nd = #shards, #size
  if n == 0 or n > world then return nil end
  local d = 1
  while d < nd and size[d] == 1 do d = d + 1 end
  local rows, pos = {}, 0
  for r = 1, world do rows[r] = 0 end
  for i, sh in ipairs(shards) do
    if gm[sh.placement.rank] ~= i - 1 then return nil end
    for k = 1, nd do
      if k ~= d and (sh.shard_offsets[k] ~= 0 or sh.shard_sizes[k] ~= size[k]) then return nil end
    end
    local z = sh.shard_sizes[d]
    if z > 0 and sh.shard_offsets[d] ~= pos then return nil end
    rows[i], pos = z, pos + z
  end
  if pos ~= size[d] then return nil end
  return d, rows
end

-- ---------------------------------------------------------------- gather
-- gather(dst [, out]): the full tensor on group rank dst (written into out when given), nil on the
-- other ranks, which allocate nothing the size of the full tensor.  Collective over the process
-- group, one "gather" (torch.distributed.gather): when the shards are slabs of the full tensor in rank
-- order (chunk specs on the leading dim over the ranks in order, even or uneven), each rank's shard
-- goes straight into the full tensor on dst (MPI_Gatherv); else each shard moves once into it on dst
-- when the group shares a node (comm.box_exchange, counted as the gather); else every rank packs its
-- shards into one buffer of its own size and one gatherv brings them to dst.  A bad out on dst fails
-- the gather on every rank.
function ShardedTensor:gather(dst, out)
  dst = dst or 0
  local op = "gather"
  local pg = self._pg
  local world = world_of(pg)
  local me = group_rank(pg)
  if type(dst) ~= "number" or dst % 1 ~= 0 or dst < 0 or dst >= world then
    fail(string.format("%s: dst must be a rank of the process group (0..%d), got %s", op, world - 1, tostring(dst)))
  end
  local md = self:metadata()
  local gpg = pg or comm.world_group()
  local copts = { group = gpg, group_dst = dst }
  local gm = gmap(pg)
  local d, rows = slab_layout(md.shards_metadata, md.size, world, gm)
  -- CUDA shards: every buffer on the device (the collective runs through NCCL), the full tensor on dst's GPU
  -- (PyTorch's _get_preferred_device for an NCCL group); no single-copy path (host memory only)
  local dev = spec_device(self._spec, op)
  -- the way taken (the same on every rank: the metadata and the group's single-copy probe agree)
  local boxes = not d and world > 1 and kind_of(self._spec, op) == "cpu" and gpg:single_copy_usable()
  local full
  if me == dst then
    if out ~= nil and not (core.is_tensor(out) and same_list(out:shape(), md.size)) then
      local msg = core.is_tensor(out) and string.format("%s: out has shape [%s], the ShardedTensor [%s]", op,
        table.concat(out:shape(), ","), table.concat(md.size, ",")) or
        string.format("%s: out must be a tensor, got %s", op, type(out))
      core.C.eng_pg_report_error(gpg._c, 7, msg) -- the others' gather fails with it
      fail(msg)
    end
    local fits = out ~= nil and out.dtype == self.dtype and out.device == dev
    if fits and d and d > 1 then fits = out:is_contiguous() end
    full = fits and out or engine_mod.empty(md.size, topts(self.dtype, dev))
  end
  local function done()
    if me ~= dst then return nil end
    if out ~= nil and out ~= full then out:copy_(full); return out end
    return full
  end
  if d then
    -- straight from each rank's shard into the full tensor on dst (dims before d have size 1)
    local rest = {}
    for k = d + 1, #md.size do rest[#rest + 1] = md.size[k] end
    local mine = shards_of(self)[1]
    local send
    if mine == nil then send = engine_mod.empty({ 0, unpack(rest) }, topts(self.dtype, dev))
    elseif d == 1 then send = mine.tensor:detach()
    else send = mine.tensor:detach():reshape({ rows[me + 1], unpack(rest) }) end
    local recv = full
    if full and d > 1 then recv = full:view({ md.size[d], unpack(rest) }) end
    copts.sizes = rows
    comm.gather(send, recv, nil, copts)
    return done()
  end
  if boxes then
    -- single copy: each shard moves once, straight into the full tensor on dst (comm.box_exchange)
    local idx, srcs = box_numbering(md.shards_metadata, me, local_by_box(shards_of(self)), gm)
    local moves = {}
    for i, s in ipairs(md.shards_metadata) do
      if s:numel() > 0 then
        moves[#moves + 1] = { from = gm[s.placement.rank], src = idx[i], src_off = zeros_list(#md.size), to = dst, dst = 1,
          dst_off = s.shard_offsets, shape = s.shard_sizes }
      end
    end
    if comm.box_exchange(moves, srcs, full and { full } or {},
      { group = pg, dtype = self.dtype, ndim = #md.size, op = op, kind = "gather" }) then
      return done()
    end
  end
  -- packed: each rank's shards in one buffer of its own size, one gatherv to dst
  local per_rank = {}
  for r = 1, world do per_rank[r] = 0 end
  for _, s in ipairs(md.shards_metadata) do per_rank[gm[s.placement.rank] + 1] = per_rank[gm[s.placement.rank] + 1] + s:numel() end
  local send = engine_mod.empty({ per_rank[me + 1] }, topts(self.dtype, dev))
  local pos = 0
  for _, s in ipairs(shards_of(self)) do
    local n = s.metadata:numel()
    if n > 0 then send:narrow(1, pos + 1, n):view(unpack(s.metadata.shard_sizes)):copy_(s.tensor:detach()); pos = pos + n end
  end
  local recv
  if me == dst then
    local total = 0
    for r = 1, world do total = total + per_rank[r] end
    recv = engine_mod.empty({ total }, topts(self.dtype, dev))
  end
  copts.sizes = per_rank
  comm.gather(send, recv, nil, copts)
  if me ~= dst then return nil end
  local cursor, at = {}, 0
  for r = 0, world - 1 do cursor[r] = at; at = at + per_rank[r + 1] end
  for _, s in ipairs(md.shards_metadata) do
    local n = s:numel()
    local r = gm[s.placement.rank]
    if n > 0 then
      local piece = recv:narrow(1, cursor[r] + 1, n):view(unpack(s.shard_sizes))
      local box = full
      for k = 1, #md.size do box = box:narrow(k, s.shard_offsets[k] + 1, s.shard_sizes[k]) end
      box:copy_(piece)
    end
    cursor[r] = cursor[r] + n
  end
  return done()
end

-- ---------------------------------------------------------------- reshard
-- st:reshard(spec) -> st, laid out by spec (same values, same process group), in place as PyTorch's:
-- st's local shards, metadata (the object metadata() returned is updated) and sharding spec change,
-- and st itself is returned.  Collective, one all_to_all: through the DTensor (Shard(a) -> Shard(b) on
-- the same mesh) when both layouts are DTensor layouts on one mesh, else every rank sends each rank
-- the overlaps of its shards with that rank's new shards (any specs: chunk specs on other dims or
-- placements, several shards per rank, enumerable specs): moved once each between the processes'
-- memories when the group shares a node (comm.box_exchange), else packed in blocks padded to the
-- largest.  A module parameter's ShardedTensor (shard_parameter) takes the module along (_on_reshard).
local resharded
function ShardedTensor:reshard(spec)
  local r = resharded(self, spec)
  if r == self then return self end
  local md, hook = self._metadata, rawget(self, "_on_reshard")
  for k in pairs(self) do self[k] = nil end
  for k, v in pairs(r) do self[k] = v end
  if md then   -- the caller's metadata object follows, as PyTorch's (which assigns its shards_metadata)
    md.shards_metadata = self:metadata().shards_metadata
    self._metadata = md
  end
  self._on_reshard = hook
  if hook then hook(self) end
  return self
end

resharded = function(self, spec)
  local op = "reshard"
  if not specs.is_sharding_spec(spec) then
    fail(op .. ": resharding_spec must be a ChunkShardingSpec or an EnumerableShardingSpec, got " .. type(spec))
  end
  -- collective: the ranks agree on the target first (a rank whose spec equals its current one would return at
  -- once while the others wait in the exchange: an error on every rank instead)
  local gpg = self._pg or comm.world_group()
  if core.C.eng_pg_agree(gpg._c, 0, hash_str(tostring(spec)), op) ~= 0 then
    fail(string.format("%s: the ranks passed different resharding specs (this rank: %s): it is collective, every "
      .. "rank must pass the same spec (%s)", op, tostring(spec), core.last_error()))
  end
  if rawequal(spec, self._spec) or spec == self._spec then return self end
  local pg = self._pg
  local world, me = world_of(pg), group_rank(pg)
  local gm = gmap(pg)
  local dev = spec_device(self._spec, op)
  if kind_of(spec, op) ~= kind_of(self._spec, op) then
    fail(string.format("%s: %s is on %s, the resharding spec %s on %s: moving a ShardedTensor between the CPU and "
      .. "CUDA devices by reshard is not supported (gather it, or build one on the other device)", op, tostring(self._spec),
      kind_of(self._spec), tostring(spec), kind_of(spec)))
  end
  local target = build(op, spec, self._size, { dtype = self.dtype, process_group = pg }, function(shape, dt, _, tdev)
    return engine_mod.empty(shape, topts(dt, tdev))
  end)
  -- the DTensor path (making the mesh when the group is the world: reshard is collective over it)
  local dt = dt_ready(self)
  if not dt and (pg == nil or pg:size() == require("engine.distributed").world_size()) then
    local ranks = dt_layout(self)
    local tranks = ranks and dt_layout(target)
    if tranks and same_list(ranks, tranks) then dt = self:to_dtensor() end
  end
  if dt then
    local ranks, d = dt_layout(target)
    if ranks and same_list(ranks, (self._mesh or dt.device_mesh):flat_ranks()) then
      local r = dt:redistribute({ require("engine.distributed.placements").Shard(d) })
      return setmetatable({ _spec = spec, _size = self._size, dtype = self.dtype, _pg = pg, _dt = r },
        ShardedTensor)
    end
  end
  local src, dst = self:metadata().shards_metadata, target._metadata.shards_metadata
  local nd = #self._size
  -- overlap boxes and block sizes (the same on every rank)
  local pairs_, block = {}, {}
  for r = 0, world - 1 do block[r] = {} for q = 0, world - 1 do block[r][q] = 0 end end
  for i, s in ipairs(src) do
    for j, t in ipairs(dst) do
      local off, len, n = {}, {}, 1
      for d = 1, nd do
        local lo = math.max(s.shard_offsets[d], t.shard_offsets[d])
        local hi = math.min(s.shard_offsets[d] + s.shard_sizes[d], t.shard_offsets[d] + t.shard_sizes[d])
        off[d], len[d] = lo, math.max(0, hi - lo)
        n = n * len[d]
      end
      if n > 0 then
        local a, b = gm[s.placement.rank], gm[t.placement.rank]
        pairs_[#pairs_ + 1] = { i = i, j = j, off = off, len = len, n = n, from = a, to = b, pos = block[a][b] }
        block[a][b] = block[a][b] + n
      end
    end
  end
  local maxb = 1
  for r = 0, world - 1 do for q = 0, world - 1 do maxb = math.max(maxb, block[r][q]) end end
  local function box(t, md, p)
    for d = 1, nd do t = t:narrow(d, p.off[d] - md.shard_offsets[d] + 1, p.len[d]) end
    return t
  end
  local src_of, mine_dst = local_by_box(shards_of(self)), {}
  for _, s in ipairs(target._shards) do mine_dst[s.metadata] = s.tensor end
  -- single copy: every box moves once, straight from the old shard into the new one across the
  -- processes (comm.box_exchange), when the ranks share a node; else packed into one all_to_all
  local idx_src, srcs = box_numbering(src, me, src_of, gm)
  local idx_dst, dsts = box_numbering(dst, me, function(s) return mine_dst[s] end, gm)
  local moves = {}
  for k, p in ipairs(pairs_) do
    local so, tof = {}, {}
    for d = 1, nd do so[d], tof[d] = p.off[d] - src[p.i].shard_offsets[d], p.off[d] - dst[p.j].shard_offsets[d] end
    moves[k] = { from = p.from, src = idx_src[p.i], src_off = so, to = p.to, dst = idx_dst[p.j], dst_off = tof,
      shape = p.len }
  end
  if kind_of(self._spec, op) == "cpu" and comm.box_exchange(moves, srcs, dsts, { group = pg, dtype = self.dtype, ndim = nd, op = op }) then
    return target
  end
  local send = engine_mod.empty({ world * maxb }, topts(self.dtype, dev))
  for _, p in ipairs(pairs_) do
    if p.from == me then
      send:narrow(1, p.to * maxb + p.pos + 1, p.n):view(unpack(p.len)):copy_(box(src_of(src[p.i]), src[p.i], p))
    end
  end
  local recv = comm.all_to_all(send, pg and { group = pg } or nil)
  for _, p in ipairs(pairs_) do
    if p.to == me then
      box(mine_dst[dst[p.j]], dst[p.j], p):copy_(recv:narrow(1, p.from * maxb + p.pos + 1, p.n):view(unpack(p.len)))
    end
  end
  return target
end

M._dt_layout, M._mesh_for, M._dt_ready = dt_layout, mesh_for, dt_ready
M._world_of, M._group_rank, M._gmap = world_of, group_rank, gmap

-- engine.distributed merges this table: the factories live under dist.sharded_tensor (PyTorch's
-- torch.distributed._shard.sharded_tensor), next to dist.ShardedTensor.
ShardedTensor.init_from_local_shards = M.init_from_local_shards
return { sharded_tensor = M, ShardedTensor = ShardedTensor, is_sharded_tensor = is_sharded_tensor,
  shard_tensor = M.shard_tensor }
