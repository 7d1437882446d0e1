-- engine.distributed.sharded_tensor: the ShardedTensor of seed 002 (PyTorch's torch.distributed._shard),
-- first part: construction from a sharding spec, local shards, metadata and gather.
--
--   local spec = dist.ChunkShardingSpec{dim = 1, placements = {"rank:0/cpu", "rank:1/cpu"}}
--   local st = dist.sharded_tensor.zeros(spec, {10, 20}, {dtype = "f32"})
--   for _, s in ipairs(st:local_shards()) do print(s.tensor:shape(), s.metadata) end
--   local full = st:gather(0)            -- the full tensor on rank 0, nil elsewhere (collective)
--
-- Each rank holds one local tensor per shard whose placement names its rank (in the process group:
-- placements use group ranks).  Also: dist.sharded_tensor.rand/randn (each shard is its box of the
-- global random tensor: equal to engine.rand(size) for every spec) and
-- dist.ShardedTensor.init_from_local_shards (checked across ranks).  Not built yet (issue 14): *_like,
-- reshard, elementwise ops, the DTensor bridge, shard_tensor / shard_parameter / shard_module, state
-- dicts.
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

-- Builds a ShardedTensor of `size` laid out by `spec`, each local shard made by make(shape, dtype).
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
  local world = pg and pg:size() or require("engine.distributed").world_size()
  local me = group_rank(pg)
  local shards = {}
  for i, s in ipairs(md.shards_metadata) do
    if s.placement.rank >= world then
      fail(string.format("%s: shard %d is placed on rank %d, but the process group has %d ranks", op, i,
        s.placement.rank, world))
    end
    if s.placement.device ~= "cpu" then
      fail(string.format("%s: shard %d is placed on %s; this build keeps ShardedTensor shards on the CPU", op, i,
        s.placement.device))
    end
    if s.placement.rank == me then
      local t = make(s.shard_sizes, dtype, s)
      if opts.requires_grad then t.requires_grad = true end
      shards[#shards + 1] = { tensor = t, metadata = s }
    end
  end
  return setmetatable({ _spec = spec, _metadata = md, _shards = shards, _pg = pg, dtype = props.dtype }, ShardedTensor)
end

local function factory(op, make)
  return function(spec, size, opts) return build(op, spec, size, opts, make) end
end

local engine_mod
local function E()
  engine_mod = engine_mod or require("engine")
  return engine_mod
end

M.empty = factory("sharded_tensor.empty", function(shape, dt) return E().empty(shape, { dtype = dt }) end)
M.zeros = factory("sharded_tensor.zeros", function(shape, dt) return E().zeros(shape, { dtype = dt }) end)
M.ones = factory("sharded_tensor.ones", function(shape, dt) return E().ones(shape, { dtype = dt }) end)
function M.full(spec, size, value, opts)
  if type(value) ~= "number" then fail("sharded_tensor.full: fill value must be a number, got " .. type(value)) end
  return build("sharded_tensor.full", spec, size, opts, function(shape, dt) return E().full(shape, value, { dtype = dt }) end)
end

-- rand / randn(spec, size, opts): every shard is its box of the global random tensor that
-- engine.rand / engine.randn(size) would draw from the global generator (the engine's offset RNG), and
-- the generator advances by the global numel on every rank, so the full tensor is the same for every
-- spec and equal to engine.rand(size) after the same seed.
local function random_factory(op, kind)
  return function(spec, size, opts)
    local C = core.C
    local ffi = core.ffi
    local numel = 1
    if type(size) == "table" then for _, x in ipairs(size) do numel = numel * (tonumber(x) or 0) end end
    local st = ffi.new("uint64_t[2]")
    C.eng_rng_get_state(st, st + 1)
    local seed = st[0]
    local first = true
    local offset
    local t = build(op, spec, size, opts, function(shape, dt, box)
      if first then offset = C.eng_rng_reserve(numel); first = false end
      local start = {}
      for d = 1, #shape do start[d] = box.shard_offsets[d] + 1 end
      return E().random_slice(kind, size, start, shape, { dtype = dt, seed = seed, offset = offset })
    end)
    if first then C.eng_rng_reserve(numel) end   -- no local shard: advance the generator all the same
    return t
  end
end
M.rand = random_factory("sharded_tensor.rand", "uniform")
M.randn = random_factory("sharded_tensor.randn", "normal")

-- Every rank's Lua list of integers (any length), indexed by group rank: one all_reduce of the
-- lengths, one all_gather of the lists padded to the longest.  Collective.
local function all_gather_lists(list, dtype, pg, world, me)
  local opts = pg and { group = pg } or nil
  local lens = E().zeros({ world }, { dtype = "i64" })
  lens:narrow(1, me + 1, 1):fill_(#list)
  comm.all_reduce(lens, "sum", opts)
  local l, maxl = lens:totable(), 1
  for r = 1, world do maxl = math.max(maxl, l[r]) end
  local buf = E().zeros({ maxl }, { dtype = dtype })
  if #list > 0 then buf:narrow(1, 1, #list):copy_(E().tensor(list, dtype)) end
  local all = E().empty({ world * maxl }, { dtype = dtype })
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
local FIELDS = 4 -- per shard: rank, dtype code, local error code, ndim; then offsets, sizes
function M.init_from_local_shards(shards, size, opts)
  local op = "init_from_local_shards"
  local C, ffi = core.C, core.ffi
  local dist = require("engine.distributed")
  opts = opts or {}
  local pg = opts.process_group
  local world = pg and pg:size() or dist.world_size()
  local me = group_rank(pg)
  if type(shards) ~= "table" then fail(op .. ": local_shards must be a list of {tensor = t, metadata = ShardMetadata}") end
  if type(size) ~= "table" then fail(op .. ": size must be a list of sizes") end
  local nd = #size
  -- local rows: rank, dtype, err (0 ok, 1 wrong placement, 2 shape mismatch, 3 bad entry), ndim, offsets, sizes
  local rows, list = {}, {}
  for i, e in ipairs(shards) do
    local t = type(e) == "table" and (e.tensor or e[1]) or nil
    local md = type(e) == "table" and (e.metadata or e[2]) or nil
    local err, dt = 0, -1
    if not core.is_tensor(t) or getmetatable(md) ~= specs.ShardMetadataClass then err = 3
    else
      dt = core.dtype(t.dtype, op)
      if md.placement == nil or md.placement.rank ~= me then err = 1 end
      local sh = t:shape()
      if err == 0 and (#sh ~= #md.shard_sizes) then err = 2 end
      for d = 1, #sh do if err == 0 and sh[d] ~= md.shard_sizes[d] then err = 2 end end
      if #md.shard_offsets ~= nd then err = 2 end
    end
    local row = { me, dt, err, nd }
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
    "is not a {tensor = t, metadata = ShardMetadata} pair" }
  for r = 0, world - 1 do
    local A = per_rank[r]
    for j = 1, #A / width do
      local base = (j - 1) * width
      local rr, dt, err = A[base + 1], A[base + 2], A[base + 3]
      if err ~= 0 then fail(string.format("%s: rank %d's local shard %d %s", op, rr, j, why[err])) end
      if dtype == nil then dtype = dt
      elseif dt ~= dtype then
        fail(string.format("%s: the local shards disagree on the dtype (rank %d's shard %d is %s, an earlier one %s)", op, rr,
          j, core.ffi.string(C.eng_dtype_name(dt)), core.ffi.string(C.eng_dtype_name(dtype))))
      end
      local o, z = {}, {}
      for d = 1, nd do o[d] = A[base + FIELDS + d]; z[d] = A[base + FIELDS + nd + d] end
      metas[#metas + 1] = specs.ShardMetadata{ shard_offsets = o, shard_sizes = z, placement = "rank:" .. rr .. "/cpu" }
    end
  end
  specs._validate(op, metas, size, true)   -- bounds, overlaps, the exact cover: the same on every rank
  if #metas == 0 then fail(op .. ": no rank holds a shard") end
  local md = specs.ShardedTensorMetadata{ shards_metadata = metas, size = size,
    tensor_properties = specs.TensorProperties{ dtype = core.ffi.string(C.eng_dtype_name(dtype)) } }
  local spec = specs.EnumerableShardingSpec(metas)
  return setmetatable({ _spec = spec, _metadata = md, _shards = list, _pg = pg, dtype = md.tensor_properties.dtype },
    ShardedTensor)
end

-- shard_tensor(tensor, spec, {src_rank = 0, process_group}): seed 002's _shard_tensor.  Every rank
-- checks that all ranks passed the same src_rank and spec (the seed's messages), then the data of
-- src_rank's tensor is broadcast and every rank keeps its shards.  Collective.
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

function M.shard_tensor(tensor, spec, opts)
  local op = "shard_tensor"
  local dist = require("engine.distributed")
  opts = opts or {}
  if type(opts) ~= "table" then fail(op .. ": options must be a table") end
  for k in pairs(opts) do
    if k ~= "src_rank" and k ~= "process_group" then
      fail(string.format("%s: unknown option '%s' (src_rank, process_group)", op, tostring(k)))
    end
  end
  local pg = opts.process_group
  local world = pg and pg:size() or dist.world_size()
  local me = group_rank(pg)
  local src = opts.src_rank or 0
  if not core.is_tensor(tensor) then fail(op .. ": expected a tensor, got " .. type(tensor)) end
  if dist.is_dtensor(tensor) then fail(op .. ": expected a plain tensor, got a DTensor (use redistribute)") end
  if not tensor:is_contiguous() then fail("input tensor is not a contiguous Tensor") end
  if not specs.is_sharding_spec(spec) then fail(op .. ": sharding_spec must be a ChunkShardingSpec or an EnumerableShardingSpec") end
  -- (src_rank, spec, shape) of every rank
  local mine = string.format("%s\n%s\n%s", tostring(src), tostring(spec), table.concat(tensor:shape(), ","))
  local all = agree_strings(mine, pg, world, me)
  for idx = 0, world - 1 do
    local osrc, ospec, oshape = all[idx]:match("^(.-)\n(.*)\n(.-)$")
    if osrc ~= tostring(src) then
      fail(string.format("src_rank=%s on rank: %d does not match with src_rank=%s on rank: %d", tostring(src), me,
        tostring(osrc), idx))
    end
    if ospec ~= tostring(spec) then
      fail(string.format("sharding_spec=%s on rank: %d does not match with sharding_spec=%s on rank: %d", tostring(spec),
        me, tostring(ospec), idx))
    end
    if oshape ~= table.concat(tensor:shape(), ",") then
      fail(string.format("%s: the tensor on rank %d has shape [%s], on rank %d [%s]", op, me,
        table.concat(tensor:shape(), ","), idx, tostring(oshape)))
    end
  end
  if type(src) ~= "number" or src % 1 ~= 0 or src < 0 or src >= world then
    fail(string.format("%s: src_rank must be a rank of the process group (0..%d), got %s", op, world - 1, tostring(src)))
  end
  if getmetatable(spec) ~= specs.ChunkShardingSpecClass then
    fail(op .. ": EnumerableShardingSpec.shard not implemented yet!")
  end
  local full = tensor:detach():clone()
  comm.broadcast(full, src, pg and { group = pg } or nil)
  return build(op, spec, tensor:shape(), { dtype = tensor.dtype, process_group = pg }, function(shape, dt, box)
    local t = full
    for d = 1, #shape do t = t:narrow(d, box.shard_offsets[d] + 1, shape[d]) end
    return t:contiguous():clone()
  end)
end

-- ---------------------------------------------------------------- accessors
function ShardedTensor:local_shards()
  local r = {}
  for i, s in ipairs(self._shards) do r[i] = { tensor = s.tensor, metadata = s.metadata } end
  return r
end

function ShardedTensor:local_tensor()
  if #self._shards ~= 1 then
    fail("local_tensor: Only single local shard is supported (this rank holds " .. #self._shards .. " shards)")
  end
  return self._shards[1].tensor
end

function ShardedTensor:metadata() return self._metadata end
function ShardedTensor:sharding_spec() return self._spec end
function ShardedTensor:size(d)
  local s = self._metadata.size
  if d == nil then return { unpack(s) } end
  local i = d < 0 and #s + 1 + d or d
  if i < 1 or i > #s then fail(string.format("size: dim %d out of range for a %d-d ShardedTensor", d, #s)) end
  return s[i]
end
ShardedTensor.shape = ShardedTensor.size

ShardedTensor.__tostring = function(st)
  return string.format("ShardedTensor(%s[%s], %s, %d local shard(s))", st.dtype, table.concat(st._metadata.size, ","),
    tostring(st._spec), #st._shards)
end

-- gather(dst [, out]): the full tensor on group rank dst (written into out when given), nil on the
-- other ranks.  Collective over the process group: every rank packs its shards into one buffer,
-- padded to the largest rank's, and one all_gather brings them together.
function ShardedTensor:gather(dst, out)
  dst = dst or 0
  local op = "gather"
  local pg = self._pg
  local dist = require("engine.distributed")
  local world = pg and pg:size() or dist.world_size()
  local me = group_rank(pg)
  if type(dst) ~= "number" or dst % 1 ~= 0 or dst < 0 or dst >= world then
    fail(string.format("%s: dst must be a rank of the process group (0..%d), got %s", op, world - 1, tostring(dst)))
  end
  local md = self._metadata
  -- elements each rank holds, from the metadata (the same on every rank)
  local per_rank = {}
  for r = 0, world - 1 do per_rank[r] = 0 end
  for _, s in ipairs(md.shards_metadata) do per_rank[s.placement.rank] = per_rank[s.placement.rank] + s:numel() end
  local maxn = 1
  for r = 0, world - 1 do maxn = math.max(maxn, per_rank[r]) end
  local send = E().zeros({ maxn }, { dtype = self.dtype })
  local pos = 0
  for _, s in ipairs(self._shards) do
    local n = s.metadata:numel()
    if n > 0 then send:narrow(1, pos + 1, n):copy_(s.tensor:detach():reshape(-1)); pos = pos + n end
  end
  local recv = E().empty({ world * maxn }, { dtype = self.dtype })
  comm.all_gather_into(recv, send, pg and { group = pg } or nil)
  if me ~= dst then return nil end
  if out == nil then out = E().empty(md.size, { dtype = self.dtype })
  else
    local os_ = out:shape()
    local same = #os_ == #md.size
    for i = 1, #os_ do same = same and os_[i] == md.size[i] end
    if not same then
      fail(string.format("%s: out has shape [%s], the ShardedTensor [%s]", op, table.concat(os_, ","),
        table.concat(md.size, ",")))
    end
  end
  local cursor = {}
  for r = 0, world - 1 do cursor[r] = r * maxn end
  for _, s in ipairs(md.shards_metadata) do
    local n = s:numel()
    local r = s.placement.rank
    if n > 0 then
      local piece = recv:narrow(1, cursor[r] + 1, n):view(unpack(s.shard_sizes))
      local box = out
      for d = 1, #md.size do box = box:narrow(d, s.shard_offsets[d] + 1, s.shard_sizes[d]) end
      box:copy_(piece)
    end
    cursor[r] = cursor[r] + n
  end
  return out
end

-- engine.distributed merges this table: the factories live under dist.sharded_tensor (PyTorch's
-- torch.distributed._shard.sharded_tensor), next to dist.ShardedTensor.
ShardedTensor.init_from_local_shards = M.init_from_local_shards
return { sharded_tensor = M, ShardedTensor = ShardedTensor, is_sharded_tensor = is_sharded_tensor,
  shard_tensor = M.shard_tensor }
