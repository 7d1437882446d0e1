-- Helpers for the ShardedTensor specs (torch.distributed._shard: spec/dist/sharded_tensor*_spec.lua, shard_module_spec.lua):
-- placement lists over this world's ranks and chunk specs.
local dist = require("engine").distributed

local M = {}

-- ranks({0, 2}) -> {"rank:0/cpu", "rank:2/cpu"}
function M.ranks(list)
  local r = {}
  for i, k in ipairs(list) do r[i] = "rank:" .. k .. "/cpu" end
  return r
end

-- all_ranks(times) -> 0 .. W-1, `times` times over (default once)
function M.all_ranks(times)
  local l = {}
  for _ = 1, times or 1 do for k = 0, dist.world_size() - 1 do l[#l + 1] = k end end
  return l
end

-- chunk(dim, list) -> a ChunkShardingSpec on dim over the ranks of list (default all_ranks())
function M.chunk(dim, list)
  return dist.ChunkShardingSpec{ dim = dim, placements = M.ranks(list or M.all_ranks()) }
end

return M
