-- engine.distributed.placements: Shard, Replicate, Partial.
--
--   dist.Shard(1)          -- split tensor dim 1 (dims are 1-based in Lua; -1 is the last)
--   dist.Replicate()       -- full copy on each rank of the mesh dim
--   dist.Partial("sum")    -- pending reduction: "sum" (default), "avg", "max", "min", "prod"
--
-- Shards follow torch.chunk: chunk = ceil(n/k) entries per rank, trailing
-- ranks may get fewer or none.  Placements compare with ==; p:is_shard([dim]),
-- p:is_replicate(), p:is_partial(); tostring gives "Shard(1)", "Replicate()",
-- "Partial(sum)".  Messages from the C core print Shard dims 1-based too.
local core = require("engine.core")
local ffi, C = core.ffi, core.C

local M = {}

C.eng_dtensor_set_display_base(1)

local Placement = { __name = "Placement" }
Placement.__index = Placement
M.Placement = Placement

local KIND = { replicate = 0, shard = 1, partial = 2 }
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

function Placement:is_shard(dim)
  if self.kind ~= "shard" then return false end
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
  if a.kind == "partial" then return a.reduce_op == b.reduce_op end
  return true
end

Placement.__tostring = function(p)
  if p.kind == "shard" then return string.format("Shard(%d)", p.dim) end
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
      core.fail(string.format("%s: placements[%d] must be dist.Shard(d), dist.Replicate() or dist.Partial(op), got %s",
        op, i, type(p) == "table" and "a table" or tostring(p)))
    end
    local e = arr[i - 1]
    e.kind = KIND[p.kind]
    if p.kind == "shard" then e.dim = p.dim > 0 and p.dim - 1 or p.dim end
    if p.kind == "partial" then e.op = OPS[p.reduce_op] end
  end
  return arr, n
end

-- One eng_placement (cdata struct) -> Placement (Shard dims 1-based).
function M._one_from_c(e)
  if e.kind == 1 then return M.Shard(e.dim >= 0 and e.dim + 1 or e.dim) end
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
