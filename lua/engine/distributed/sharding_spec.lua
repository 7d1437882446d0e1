-- engine.distributed.sharding_spec: ShardedTensor metadata (PyTorch's torch.distributed._shard):
-- shard placements, ShardMetadata, ChunkShardingSpec, EnumerableShardingSpec, TensorProperties and
-- ShardedTensorMetadata (the ShardedTensor is engine.distributed.sharded_tensor).
--
--   local spec = dist.ChunkShardingSpec{dim = 1, placements = {"rank:0/cpu", "rank:1/cpu"}}
--   local md = spec:build_metadata({10, 20}, dist.TensorProperties{dtype = "f32"})
--   md.shards_metadata[2].shard_offsets   --> {5, 0}
--   dist.EnumerableShardingSpec{ dist.ShardMetadata{shard_offsets = {0, 0}, shard_sizes = {5, 5}, placement = "rank:0/cpu"}, ... }
--
-- Conventions: a ChunkShardingSpec's `dim` is 1-based (negative counts from the end), as every dim in
-- Lua; shard_offsets / shard_sizes are lists in tensor-dim order whose VALUES are 0-based element
-- offsets and sizes (the metadata convention, so they match PyTorch's files); ranks in placements are
-- 0-based ("rank:R/cpu", "rank:R/cuda:D").  Chunks follow torch.chunk: ceil(n / #placements) per
-- placement, trailing ones smaller or empty; a placement list may name a subset of ranks or a rank
-- several times (several local shards).  Errors name the spec and the shards (1-based list positions).
local core = require("engine.core")
local ffi, C = core.ffi, core.C

local M = {}

local function fail(msg) core.fail(msg) end

local function int_list(v, what, op)
  if type(v) ~= "table" then fail(string.format("%s: %s must be a list of integers, got %s", op, what, type(v))) end
  local n = #v
  for k in pairs(v) do
    if type(k) ~= "number" or k < 1 or k > n or k % 1 ~= 0 then
      fail(string.format("%s: %s must be a list of integers (a table without holes)", op, what))
    end
  end
  local r = {}
  for i = 1, n do
    local x = v[i]
    if type(x) ~= "number" or x % 1 ~= 0 or x < 0 or x >= 2 ^ 62 then
      fail(string.format("%s: %s[%d] must be a non-negative integer, got %s", op, what, i, tostring(x)))
    end
    r[i] = x
  end
  return r
end

-- ---------------------------------------------------------------- placements
local Placement = { __name = "ShardPlacement" }
Placement.__index = Placement
Placement.__tostring = function(p) return string.format("rank:%d/%s", p.rank, p.device) end
Placement.__eq = function(a, b) return a.rank == b.rank and a.device == b.device end

-- "rank:R/cpu" | "rank:R/cuda:D" | {rank = R, device = "cpu"} -> placement
local function placement(v, op)
  if getmetatable(v) == Placement then return v end
  local rank, device
  if type(v) == "string" then
    rank, device = v:match("^rank:(%d+)/(.+)$")
    rank = tonumber(rank)
  elseif type(v) == "table" then
    rank, device = v.rank, v.device or "cpu"
  end
  if type(rank) ~= "number" or rank % 1 ~= 0 or type(device) ~= "string"
    or not (device == "cpu" or device:match("^cuda:%d+$") or device == "cuda") then
    fail(string.format("%s: placement %s must be \"rank:R/cpu\" or \"rank:R/cuda:D\" (R a 0-based rank)", op,
      type(v) == "string" and ("'" .. v .. "'") or type(v)))
  end
  return setmetatable({ rank = rank, device = device }, Placement)
end
M._parse_placement = placement

-- ---------------------------------------------------------------- ShardMetadata
local ShardMetadata = { __name = "ShardMetadata" }
ShardMetadata.__index = ShardMetadata
M.ShardMetadataClass = ShardMetadata

function M.ShardMetadata(opts)
  local op = "ShardMetadata"
  if type(opts) ~= "table" then fail(op .. ": expected {shard_offsets = {...}, shard_sizes = {...}, placement = ...}") end
  for k in pairs(opts) do
    if k ~= "shard_offsets" and k ~= "shard_sizes" and k ~= "placement" then
      fail(string.format("%s: unknown field '%s' (shard_offsets, shard_sizes, placement)", op, tostring(k)))
    end
  end
  local off = int_list(opts.shard_offsets, "shard_offsets", op)
  local sz = int_list(opts.shard_sizes, "shard_sizes", op)
  if #off ~= #sz then
    fail(string.format("%s: shard_offsets and shard_sizes should have the same number of elements, found %d and %d",
      op, #off, #sz))
  end
  return setmetatable({ shard_offsets = off, shard_sizes = sz,
    placement = opts.placement ~= nil and placement(opts.placement, op) or nil }, ShardMetadata)
end

-- Element-wise == of two lists (numbers, or objects with __eq).
local function list_eq(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

ShardMetadata.__eq = function(a, b)
  return list_eq(a.shard_offsets, b.shard_offsets) and list_eq(a.shard_sizes, b.shard_sizes)
    and ((a.placement == nil and b.placement == nil)
      or (a.placement ~= nil and b.placement ~= nil and a.placement == b.placement))
end
ShardMetadata.__tostring = function(s)
  return string.format("ShardMetadata(shard_offsets=[%s], shard_sizes=[%s], placement=%s)",
    table.concat(s.shard_offsets, ", "), table.concat(s.shard_sizes, ", "), tostring(s.placement))
end
function ShardMetadata:numel()
  local n = 1
  for _, x in ipairs(self.shard_sizes) do n = n * x end
  return n
end

-- C check of shard boxes against a tensor size (bounds, overlaps, optionally the exact cover).
local function validate(op, shards, size, cover)
  local n, nd = #shards, #size
  local offs = ffi.new("int64_t[?]", math.max(1, n * nd))
  local szs = ffi.new("int64_t[?]", math.max(1, n * nd))
  local shape = ffi.new("int64_t[?]", math.max(1, nd))
  for d = 1, nd do shape[d - 1] = size[d] end
  for i, s in ipairs(shards) do
    if #s.shard_offsets ~= nd then
      fail(string.format("%s: shard %d has %d dims, the tensor has %d", op, i, #s.shard_offsets, nd))
    end
    for d = 1, nd do
      offs[(i - 1) * nd + d - 1] = s.shard_offsets[d]
      szs[(i - 1) * nd + d - 1] = s.shard_sizes[d]
    end
  end
  if C.eng_shards_validate(op, n, nd, offs, szs, shape, cover and 1 or 0) ~= 0 then fail(core.last_error()) end
end

M._validate = validate

-- ---------------------------------------------------------------- TensorProperties, ShardedTensorMetadata
local TensorProperties = { __name = "TensorProperties" }
TensorProperties.__index = TensorProperties
function M.TensorProperties(opts)
  opts = opts or {}
  local dt = core.dtype(opts.dtype or "f32", "TensorProperties")
  return setmetatable({ dtype = ffi.string(C.eng_dtype_name(dt)), layout = opts.layout or "strided",
    requires_grad = opts.requires_grad == true, memory_format = opts.memory_format or "contiguous_format",
    pin_memory = opts.pin_memory == true }, TensorProperties)
end
TensorProperties.__eq = function(a, b)
  return a.dtype == b.dtype and a.layout == b.layout and a.requires_grad == b.requires_grad
    and a.memory_format == b.memory_format and a.pin_memory == b.pin_memory
end
TensorProperties.__tostring = function(p)
  return string.format("TensorProperties(dtype=%s, requires_grad=%s)", p.dtype, tostring(p.requires_grad))
end

local STMeta = { __name = "ShardedTensorMetadata" }
STMeta.__index = STMeta
function M.ShardedTensorMetadata(opts)
  local op = "ShardedTensorMetadata"
  if type(opts) ~= "table" then fail(op .. ": expected {shards_metadata = {...}, size = {...}, tensor_properties = ...}") end
  local size = int_list(opts.size, "size", op)
  local shards = opts.shards_metadata or {}
  for i, s in ipairs(shards) do
    if getmetatable(s) ~= ShardMetadata then fail(string.format("%s: shards_metadata[%d] is not a ShardMetadata", op, i)) end
  end
  validate(op, shards, size, false)
  return setmetatable({ shards_metadata = shards, size = size,
    tensor_properties = opts.tensor_properties or M.TensorProperties() }, STMeta)
end
STMeta.__eq = function(a, b)
  return list_eq(a.size, b.size) and list_eq(a.shards_metadata, b.shards_metadata)
    and a.tensor_properties == b.tensor_properties
end
STMeta.__tostring = function(m)
  local s = {}
  for i, x in ipairs(m.shards_metadata) do s[i] = "  " .. tostring(x) end
  return string.format("ShardedTensorMetadata(size=[%s], %s,\n%s)", table.concat(m.size, ", "),
    tostring(m.tensor_properties), table.concat(s, ",\n"))
end

-- ---------------------------------------------------------------- ChunkShardingSpec
local Chunk = { __name = "ChunkShardingSpec" }
Chunk.__index = Chunk
M.ChunkShardingSpecClass = Chunk

function M.ChunkShardingSpec(opts)
  local op = "ChunkShardingSpec"
  if type(opts) ~= "table" then fail(op .. ": expected {dim = d, placements = {\"rank:0/cpu\", ...}}") end
  for k in pairs(opts) do
    if k ~= "dim" and k ~= "placements" then fail(string.format("%s: unknown field '%s' (dim, placements)", op, tostring(k))) end
  end
  local d = opts.dim
  if type(d) ~= "number" or d % 1 ~= 0 then fail(op .. ": dim must be an integer (1-based), got " .. tostring(d)) end
  if d == 0 then fail(op .. ": dim 0 is invalid: dims are 1-based (1 is the first dim, -1 the last)") end
  if type(opts.placements) ~= "table" or #opts.placements == 0 then fail(op .. ": placements must be a non-empty list") end
  local pls = {}
  for i, p in ipairs(opts.placements) do pls[i] = placement(p, op) end
  return setmetatable({ dim = d, placements = pls }, Chunk)
end

-- The 1-based dim this spec shards on a tensor of nd dims (error when out of range).
function Chunk:shard_dim(nd)
  local d = self.dim < 0 and nd + 1 + self.dim or self.dim
  if d < 1 or d > nd then
    fail(string.format("ChunkShardingSpec: dim %d is out of range for a %d-d tensor (valid: 1..%d or -%d..-1)", self.dim,
      nd, nd, nd))
  end
  return d
end

-- build_metadata(size, tensor_properties) -> ShardedTensorMetadata: torch.chunk boxes, one per placement.
function Chunk:build_metadata(size, props)
  local op = "ChunkShardingSpec.build_metadata"
  size = int_list(size, "size", op)
  local d = self:shard_dim(#size)
  local shards = {}
  local off, len = ffi.new("int64_t[1]"), ffi.new("int64_t[1]")
  for i, p in ipairs(self.placements) do
    C.eng_chunk_box(size[d], #self.placements, i - 1, off, len)
    local o, s = {}, {}
    for k = 1, #size do o[k], s[k] = 0, size[k] end
    o[d], s[d] = tonumber(off[0]), tonumber(len[0])
    shards[i] = setmetatable({ shard_offsets = o, shard_sizes = s, placement = p }, ShardMetadata)
  end
  return M.ShardedTensorMetadata{ shards_metadata = shards, size = size, tensor_properties = props }
end

Chunk.__eq = function(a, b) return a.dim == b.dim and list_eq(a.placements, b.placements) end
Chunk.__tostring = function(s)
  local p = {}
  for i, x in ipairs(s.placements) do p[i] = tostring(x) end
  return string.format("ChunkShardingSpec(dim=%d, placements=[%s])", s.dim, table.concat(p, ", "))
end

-- ---------------------------------------------------------------- EnumerableShardingSpec
local Enum = { __name = "EnumerableShardingSpec" }
Enum.__index = Enum
M.EnumerableShardingSpecClass = Enum

-- EnumerableShardingSpec{shard, shard, ...} or {shards = {...}}: explicit shards, checked for
-- overlaps at construction (and for bounds and the exact cover by build_metadata).
function M.EnumerableShardingSpec(opts)
  local op = "EnumerableShardingSpec"
  if type(opts) ~= "table" then fail(op .. ": expected a list of ShardMetadata (or {shards = {...}})") end
  local shards = opts.shards or opts
  if #shards == 0 then fail(op .. ": needs at least one shard") end
  local nd = #shards[1].shard_offsets
  local size = {}
  for i, s in ipairs(shards) do
    if getmetatable(s) ~= ShardMetadata then fail(string.format("%s: shard %d is not a ShardMetadata", op, i)) end
    if #s.shard_offsets ~= nd then fail(string.format("%s: shard %d has %d dims, shard 1 has %d", op, i, #s.shard_offsets, nd)) end
    for d = 1, nd do size[d] = math.max(size[d] or 0, s.shard_offsets[d] + s.shard_sizes[d]) end
  end
  validate(op, shards, size, false)   -- overlaps (bounds are the shards' own extent here)
  local list = {}
  for i, s in ipairs(shards) do list[i] = s end
  return setmetatable({ shards = list }, Enum)
end

function Enum:build_metadata(size, props)
  local op = "EnumerableShardingSpec.build_metadata"
  size = int_list(size, "size", op)
  validate(op, self.shards, size, true)
  return M.ShardedTensorMetadata{ shards_metadata = self.shards, size = size, tensor_properties = props }
end

Enum.__eq = function(a, b) return list_eq(a.shards, b.shards) end
Enum.__tostring = function(s)
  local p = {}
  for i, x in ipairs(s.shards) do p[i] = "  " .. tostring(x) end
  return "EnumerableShardingSpec(shards=[\n" .. table.concat(p, ",\n") .. "])"
end

function M.is_sharding_spec(x)
  local mt = getmetatable(x)
  return mt == Chunk or mt == Enum
end

return M
