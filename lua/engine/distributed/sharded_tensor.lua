-- engine.distributed.sharded_tensor: the ShardedTensor of seed 002 (PyTorch's torch.distributed._shard),
-- first part: construction from a sharding spec, local shards, metadata and gather.
--
--   local spec = dist.ChunkShardingSpec{dim = 1, placements = {"rank:0/cpu", "rank:1/cpu"}}
--   local st = dist.sharded_tensor.zeros(spec, {10, 20}, {dtype = "f32"})
--   for _, s in ipairs(st:local_shards()) do print(s.tensor:shape(), s.metadata) end
--   local full = st:gather(0)            -- the full tensor on rank 0, nil elsewhere (collective)
--
-- Each rank holds one local tensor per shard whose placement names its rank (in the process group:
-- placements use group ranks).  Not built yet (issue 14): random factories, init_from_local_shards,
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
      local t = make(s.shard_sizes, dtype)
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
return { sharded_tensor = M, ShardedTensor = ShardedTensor, is_sharded_tensor = is_sharded_tensor }
