-- engine.distributed.placements: Shard, Replicate, Partial.
--
--   dist.Shard(1)          -- split tensor dim 1 (dims are 1-based in Lua; -1 is the last)
--   dist.Replicate()       -- full copy on each rank of the mesh dim
--   dist.Partial("sum")    -- pending reduction: "sum" (default), "avg", "max", "min", "prod"
--   dist._StridedShard(1, {split_factor = 2})   -- or dist._StridedShard(1, 2)
--
-- Shards follow torch.chunk: chunk = ceil(n/k) entries per rank, trailing
-- ranks may get fewer or none.  Placements compare with ==; p:is_shard([dim]),
-- p:is_replicate(), p:is_partial(); tostring gives "Shard(1)", "Replicate()",
-- "Partial(sum)".  Messages from the C core print Shard dims 1-based too.
--
-- _StridedShard(dim, split_factor) (PyTorch's private `_StridedShard`, the
-- layout of FSDP2 + TP sharding one tensor dim twice): on a mesh dim of size
-- k the dim is cut into split_factor torch.chunk pieces, each piece into k
-- torch.chunk sub-pieces, and mesh coordinate i holds sub-piece i of every
-- piece (right-to-left nested sharding; pieces i, i+k, ... of k*sf when the
-- size divides evenly).  As in PyTorch, where
-- _StridedShard subclasses Shard, p:is_shard() is true (p:is_strided_shard()
-- tells them apart) and p.dim, p.split_factor are fields; unlike PyTorch 2.5
-- (whose __eq__ ignores split_factor against a Shard), == compares the kind
-- too: _StridedShard(1, 2) ~= Shard(1) and ~= _StridedShard(1, 4).  tostring
-- gives "_StridedShard(dim=1, sf=2)".
local core = require("engine.core")
local ffi, C = core.ffi, core.C

local M = {}

C.eng_dtensor_set_display_base(1)

local Placement = { __name = "Placement" }
Placement.__index = Placement
M.Placement = Placement

local KIND = { replicate = 0, shard = 1, partial = 2, strided_shard = 3 }
local OPS = { sum = 0, avg = 1, max = 2, min = 3, prod = 4, product = 4, mean = 1 }
local OP_NAMES = { [0] = "sum", "avg", "max", "min", "prod" }
M.reduce_op_names = OP_NAMES

local function is_placement(x) return type(x) == "table" and getmetatable(x) == Placement end
M.is_placement = is_placement

function M.Shard(dim)
  if type(dim) ~= "number" or dim % 1 ~= 0 then
    core.fail(string.format("Shard: dim must be an integer, got %s", tostring(dim)))
  end
  if dim == 0 then
    core.fail("Shard: dim 0 is invalid: dims are 1-based (Torch7 convention); use Shard(1) for the first dim or "
      .. "Shard(-1) for the last")
  end
  return setmetatable({ kind = "shard", dim = dim }, Placement)
end

-- _StridedShard(dim, {split_factor = sf}) or _StridedShard(dim, sf); dims 1-based like Shard.
function M._StridedShard(dim, opts)
  local op = "_StridedShard"
  if type(dim) ~= "number" or dim % 1 ~= 0 then
    core.fail(string.format("%s: dim must be an integer, got %s", op, tostring(dim)))
  end
  if dim == 0 then
    core.fail(op .. ": dim 0 is invalid: dims are 1-based (Torch7 convention); use _StridedShard(1, ...) for the "
      .. "first dim or _StridedShard(-1, ...) for the last")
  end
  local sf
  if type(opts) == "table" and getmetatable(opts) == nil then
    for k in pairs(opts) do
      if k ~= "split_factor" then core.fail(string.format("%s: unknown option '%s' (split_factor)", op, tostring(k))) end
    end
    sf = opts.split_factor
  else
    sf = opts
  end
  if sf == nil then core.fail(op .. ": split_factor is required: _StridedShard(dim, {split_factor = sf})") end
  if type(sf) ~= "number" or sf % 1 ~= 0 then
    core.fail(string.format("%s: split_factor must be an integer >= 1, got %s", op, tostring(sf)))
  end
  if sf < 1 or sf > 0x7fffffff then
    core.fail(string.format("%s: split_factor must be an integer >= 1, got %d", op, sf))
  end
  return setmetatable({ kind = "strided_shard", dim = dim, split_factor = sf }, Placement)
end

function M.Replicate() return setmetatable({ kind = "replicate" }, Placement) end

function M.Partial(op)
  op = op or "sum"
  local code = OPS[op]
  if type(op) ~= "string" or not code then
    core.fail(string.format("Partial: reduce op must be \"sum\", \"avg\", \"max\", \"min\" or \"prod\", got %s",
      tostring(op)))
  end
  return setmetatable({ kind = "partial", reduce_op = OP_NAMES[code] }, Placement)
end

-- True for Shard and _StridedShard (PyTorch: _StridedShard is a Shard subclass).
function Placement:is_shard(dim)
  if self.kind ~= "shard" and self.kind ~= "strided_shard" then return false end
  return dim == nil or dim == self.dim
end
function Placement:is_strided_shard(dim)
  if self.kind ~= "strided_shard" then return false end
  return dim == nil or dim == self.dim
end
function Placement:is_replicate() return self.kind == "replicate" end
function Placement:is_partial(op)
  if self.kind ~= "partial" then return false end
  return op == nil or op == self.reduce_op
end

Placement.__eq = function(a, b)
  if a.kind ~= b.kind then return false end
  if a.kind == "shard" then return a.dim == b.dim end
  if a.kind == "strided_shard" then return a.dim == b.dim and a.split_factor == b.split_factor end
  if a.kind == "partial" then return a.reduce_op == b.reduce_op end
  return true
end

Placement.__tostring = function(p)
  if p.kind == "shard" then return string.format("Shard(%d)", p.dim) end
  if p.kind == "strided_shard" then return string.format("_StridedShard(dim=%d, sf=%d)", p.dim, p.split_factor) end
  if p.kind == "partial" then return string.format("Partial(%s)", p.reduce_op) end
  return "Replicate()"
end

-- "[Shard(1), Replicate()]"
function M.placements_describe(list)
  local parts = {}
  for i, p in ipairs(list) do parts[i] = tostring(p) end
  return "[" .. table.concat(parts, ", ") .. "]"
end

-- ---------------------------------------------------------------- conversions (internal)
-- Lua list of placements -> eng_placement[n] (cdata), n.  Lua Shard dims are
-- 1-based; negative dims go to C unchanged (normalized there).
function M._to_c(list, op)
  if type(list) ~= "table" or is_placement(list) then
    core.fail(string.format("%s: placements must be a list such as {dist.Shard(1), dist.Replicate()}, got %s", op,
      is_placement(list) and ("a single " .. tostring(list)) or type(list)))
  end
  local n = #list
  local arr = ffi.new("eng_placement[?]", n > 0 and n or 1)
  for i = 1, n do
    local p = list[i]
    if not is_placement(p) then
      core.fail(string.format("%s: placements[%d] must be dist.Shard(d), dist.Replicate(), dist.Partial(op) or "
        .. "dist._StridedShard(d, sf), got %s", op, i, type(p) == "table" and "a table" or tostring(p)))
    end
    local e = arr[i - 1]
    e.kind = KIND[p.kind]
    if p.kind == "shard" or p.kind == "strided_shard" then e.dim = p.dim > 0 and p.dim - 1 or p.dim end
    if p.kind == "strided_shard" then e.split_factor = p.split_factor end
    if p.kind == "partial" then e.op = OPS[p.reduce_op] end
  end
  return arr, n
end

-- One eng_placement (cdata struct) -> Placement (Shard dims 1-based).
function M._one_from_c(e)
  if e.kind == 1 then return M.Shard(e.dim >= 0 and e.dim + 1 or e.dim) end
  if e.kind == 3 then return M._StridedShard(e.dim >= 0 and e.dim + 1 or e.dim, e.split_factor) end
  if e.kind == 2 then return M.Partial(OP_NAMES[e.op]) end
  return M.Replicate()
end

-- eng_placement* (n entries) -> Lua list.
function M._from_c(arr, n)
  local r = {}
  for i = 0, n - 1 do r[i + 1] = M._one_from_c(arr[i]) end
  return r
end

return M
