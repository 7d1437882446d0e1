-- engine.distributed (engine.distributed / `dist`): the distributed runtime.
--
--   local dist = require("engine").distributed
--   dist.init()                                    -- idempotent; the host starts MPI already
--   dist.rank(), dist.world_size()
--   dist.all_reduce(t, "sum", {group = g, async = false})
--   local mesh = dist.init_device_mesh("cpu", {2, 2}, {"dp", "tp"})
--
-- The sub-modules each return a table of functions merged into this one
-- (a name defined twice is an error).  `modules` lists exactly the ones that
-- exist; a new subsystem adds its line when it lands, and a missing or broken
-- module fails loudly here.
local core = require("engine.core")
local C = core.C

local dist = {}

local modules = {
  "comm",                 -- process groups and collectives
  "mesh",                 -- DeviceMesh
  "placements",           -- Shard / Replicate / Partial / _StridedShard
  "dtensor",              -- DTensor, distribute_tensor, redistribute, factories
  "loss_parallel",        -- vocab-parallel cross entropy
  "distribute_module",    -- distribute_module
  "implicit_replication", -- implicit_replication
  "data_parallel",        -- DTensor data parallelism helpers
  "ddp",                  -- DistributedDataParallel (bucketed gradient all-reduce during backward)
  "random",               -- manual_seed(seed, mesh): DTensor random numbers
  "parallel_style",       -- tensor parallel styles (ColwiseParallel, ...), loss_parallel
  "parallelize",          -- parallelize_module
  "fsdp",                 -- fully_shard (FSDP2), MixedPrecisionPolicy, OffloadPolicy
  "sharding_spec",        -- ShardMetadata, ChunkShardingSpec, EnumerableShardingSpec (ShardedTensor metadata)
  "sharded_tensor",       -- ShardedTensor, dist.sharded_tensor.empty/zeros/ones/full
  "checkpoint",           -- dist.checkpoint.save / load (distributed checkpoints)
  "shard_api",            -- shard_parameter, shard_module, ShardingPlan, Sharder, load_with_process_group
  "shard_embedding",      -- EmbeddingCollection, EmbeddingCollectionSharder (the recommender example)
  "sharded_tensor_convert", -- as_sharded_tensor: the ShardedTensor form of any tensor, and back to full
  "fsdp_tp",              -- FSDP over TP (DTensorExtensions: boxes, chunk_tensor/chunk_dtensor, flatten/unflatten)
  "state_dict",           -- get_state_dict / set_state_dict: state dicts in three forms
}
for _, name in ipairs(modules) do
  local m = require("engine.distributed." .. name)
  assert(type(m) == "table", "engine.distributed." .. name .. " must return a table")
  for k, v in pairs(m) do
    if dist[k] ~= nil and dist[k] ~= v then
      error("engine.distributed: '" .. k .. "' is defined by two sub-modules (second: " .. name .. ")", 0)
    end
    dist[k] = v
  end
end

-- init(): starts MPI when the host has not (a singleton run is a world of
-- size 1); idempotent.  Returns dist.
function dist.init()
  if C.eng_dist_init() ~= 0 then error(core.last_error(), 2) end
  return dist
end

function dist.is_initialized() return C.eng_dist_is_initialized() ~= 0 end

-- rank() / world_size(): this process in the world; with a group, in the group
-- (nil / nil on a rank outside it).
function dist.rank(group)
  if group ~= nil then return group:rank() end
  return C.eng_dist_rank()
end
function dist.world_size(group)
  if group ~= nil then return group:size() end
  return C.eng_dist_world_size()
end
dist.get_rank, dist.get_world_size = dist.rank, dist.world_size

-- Ends MPI (collective: every rank calls it); later collectives fail.
function dist.finalize() C.eng_dist_finalize() end

-- Ends every rank at once (after an unrecoverable error on one rank).
function dist.abort(code)
  io.stdout:flush(); io.stderr:flush()
  C.eng_dist_abort(code or 1)
end

-- Sums a list of integer counts over all ranks (collective over the world).
function dist.allreduce_counts(list)
  local n = #list
  local buf = core.ffi.new("int64_t[?]", n > 0 and n or 1)
  for i = 1, n do buf[i - 1] = list[i] end
  if C.eng_dist_allreduce_counts(buf, n) ~= 0 then error(core.last_error(), 2) end
  local r = {}
  for i = 1, n do r[i] = tonumber(buf[i - 1]) end
  return r
end

-- Watchdog for multi-process tests: ends this rank (and so the job) unless
-- disarmed within `seconds`.
function dist.watchdog(seconds, label)
  if C.eng_dist_watchdog_arm(seconds, label or "watchdog") ~= 0 then error(core.last_error(), 2) end
end
function dist.watchdog_disarm() C.eng_dist_watchdog_disarm() end

-- os.exit from a recipe: with code 0 every rank finalizes MPI first (as the
-- host does after a normal end); a failing rank of a multi-rank job aborts
-- the whole job, so the others do not wait for it in a collective.
if not rawget(_G, "__engine_exit_wrapped") then
  rawset(_G, "__engine_exit_wrapped", true)
  local real_exit = os.exit
  os.exit = function(code, close)
    local ok = code == nil or code == true or code == 0
    local at_exit = rawget(_G, "__engine_at_exit")
    if ok and at_exit then -- engine.core's exit hooks, as the host runs them after a script's end
      local hok, herr = pcall(at_exit)
      if not hok then
        io.stderr:write("engine: ", tostring(herr), "\n")
        ok, code = false, 1
      end
    end
    io.stdout:flush(); io.stderr:flush()
    if C.eng_dist_is_initialized() ~= 0 then
      if ok or C.eng_dist_world_size() == 1 then C.eng_dist_finalize()
      else C.eng_dist_abort(type(code) == "number" and code or 1) end
    end
    return real_exit(code, close)
  end
end

return dist
