-- ShardedTensor costs (PyTorch's torch.distributed._shard): creating (dist.shard_tensor: one scatter from src_rank
-- straight into each rank's chunk), gathering (gather(0): one gather straight from each rank's chunk
-- into the full tensor on rank 0, beside a bare MPI_Gather) and resharding (dim 1 -> dim 2) a `MiB` f32
-- ShardedTensor over the ranks, each beside the bare MPI collective of the same bytes in the same run
-- (eng_pg_raw_collective: no staging, counters or checks), and the per-op overhead of a DTensor-backed
-- ShardedTensor over the same op on its DTensor (alternating rounds of 2000 ops, median of 11, and the
-- fastest round of each, which a loaded machine disturbs least).  Wall
-- time, median of `iters`, rank 0's figures; a full collection before each timed iteration returns
-- the earlier results' memory to the allocator's cache.
--
--   mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader --mca pml ob1 \
--     -np 4 build/engine recipes/bench/sharded_tensor.lua [MiB=64] [iters=10]
local engine = require("engine")
local dist = engine.distributed
local C = engine.C

local mib = tonumber(arg and arg[1]) or 64
local iters = tonumber(arg and arg[2]) or 10
local W, R = dist.world_size(), dist.rank()
local cols = 4096
local rows = math.floor(mib * 1024 * 1024 / 4 / cols)
rows = rows - rows % W
local pls = {}
for r = 0, W - 1 do pls[#pls + 1] = "rank:" .. r .. "/cpu" end
local spec1 = dist.ChunkShardingSpec{ dim = 1, placements = pls }
local spec2 = dist.ChunkShardingSpec{ dim = 2, placements = pls }
local pg = dist.world_group()
local F32, ALL_TO_ALL, SCATTER, GATHER = 0, 3, 5, 7

local U = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/util.lua")
local median = U.median

-- median wall ms of fn over iters (a barrier before each)
local function timed(fn)
  local t = {}
  for i = 1, iters do
    collectgarbage()   -- earlier results back to the allocator's cache (fresh pages cost a fault each)
    dist.barrier()
    local t0 = engine.time()
    fn()
    t[i] = (engine.time() - t0) * 1e3
  end
  return median(t), math.min(unpack(t))
end

local function raw(kind, send, recv, count, root, op)
  if C.eng_pg_raw_collective(pg._c, kind, send and send:data_ptr() or nil, recv:data_ptr(), count, F32, op or 0,
    root or 0) ~= 0 then
    error(engine.ffi.string(C.eng_last_error()))
  end
end

local full = engine.ones(rows, cols)
local n_local = rows * cols / W
local lines = {}
local function report(what, mine, bare)
  lines[#lines + 1] = string.format("%-44s %9.2f ms   bare MPI %9.2f ms   ratio %.2f", what, mine, bare, mine / bare)
end

-- create: shard_tensor = agreement + one scatter from src_rank straight into each rank's chunk
local scat_buf = engine.empty(n_local)
local t_bare = timed(function() raw(SCATTER, full, scat_buf, n_local, 0) end)
local st
local t_create = timed(function() st = dist.shard_tensor(full, spec1) end)
report(string.format("create (shard_tensor, %d MiB)", mib), t_create, t_bare)
local t_zeros = timed(function() dist.sharded_tensor.zeros(spec1, { rows, cols }) end)
lines[#lines + 1] = string.format("%-44s %9.2f ms   (no communication)", "create (sharded_tensor.zeros)", t_zeros)

-- gather to rank 0: one gather (MPI_Gatherv) from each rank's chunk straight into out on rank 0;
-- bare: MPI_Gather and MPI_Gatherv of the same bytes into a buffer on rank 0 only (Open MPI picks
-- different algorithms for the two: a tree for large MPI_Gather, linear for MPI_Gatherv)
-- (the four alternate within each iteration, so that a change in the machine's load hits them alike)
local gsend, grecv = engine.ones(n_local), R == 0 and engine.empty(rows * cols) or engine.empty(1)
local out = R == 0 and engine.empty(rows, cols) or nil
local gt = { {}, {}, {}, {} }
local gfn = {
  function() raw(GATHER, gsend, grecv, n_local) end,
  function() raw(GATHER, gsend, grecv, n_local, 0, 1) end,
  function() st:gather(0, out) end,
  function() st:gather(0) end,
}
for i = 1, iters do
  for k, fn in ipairs(gfn) do
    collectgarbage()
    dist.barrier()
    local t0 = engine.time()
    fn()
    gt[k][i] = (engine.time() - t0) * 1e3
  end
end
local t_bare_g, t_bare_v, t_gather, t_gather_new = median(gt[1]), median(gt[2]), median(gt[3]), median(gt[4])
report("gather(0) into out vs MPI_Gather", t_gather, t_bare_g)
report("gather(0) into out vs MPI_Gatherv", t_gather, t_bare_v)
report("gather(0), new tensor vs MPI_Gatherv", t_gather_new, t_bare_v)

-- reshard dim 1 -> dim 2: one all_to_all (the DTensor's S(1)->S(2) for one chunk per rank).
-- Bare: the contiguous all_to_all of the local bytes, and MPI's own layout change (a vector datatype
-- sends each peer its column block).
local asend, arecv = engine.ones(n_local), engine.empty(n_local)
local m_bare
t_bare, m_bare = timed(function() raw(ALL_TO_ALL, asend, arecv, n_local / W) end)
local t_strided = timed(function()
  if C.eng_pg_raw_all_to_all_strided(pg._c, asend:data_ptr(), arecv:data_ptr(), rows / W, cols / W, cols, F32) ~= 0 then
    error(engine.ffi.string(C.eng_last_error()))
  end
end)
local t_dt, m_dt = timed(function() st:reshard(spec2) end)
report("reshard dim 1 -> 2 (through the DTensor)", t_dt, t_bare)
report("reshard dim 1 -> 2 (through the DTensor) vs strided", t_dt, t_strided)
-- two shards per rank (no DTensor layout): the overlap blocks, each moved once between the ranks
-- (single copy; packed into one all_to_all where the ranks do not share a node or ENGINE_CMA=0)
local pls2 = {}
for i = 1, 2 * W do pls2[i] = pls[(i - 1) % W + 1] end
local st2 = dist.shard_tensor(full, dist.ChunkShardingSpec{ dim = 1, placements = pls2 })
local spec2b = dist.ChunkShardingSpec{ dim = 2, placements = pls2 }
local t_generic, m_generic = timed(function() st2:reshard(spec2b) end)
report("reshard dim 1 -> 2 (2 shards per rank)", t_generic, t_bare)
lines[#lines + 1] = string.format("%-44s %9.2f ms   DTensor  %9.2f ms   ratio %.2f", "reshard (2 shards per rank) vs DTensor",
  t_generic, t_dt, t_generic / t_dt)
lines[#lines + 1] = string.format("%-44s %9.2f ms   bare MPI %9.2f ms   ratio %.2f   (DTensor %.2f ms, ratio %.2f)",
  "  fastest rounds: 2 shards per rank", m_generic, m_bare, m_generic / m_bare, m_dt, m_dt / m_bare)

-- per-op overhead: a small DTensor-backed ShardedTensor against its DTensor.  The ops are local (no
-- communication), so the ranks time them one at a time while the others wait without spinning (U.idle_barrier:
-- an async barrier polled every 2 ms): with more ranks than cores (4 on the 2-core VM) the figures would
-- otherwise be the scheduler's time slices, not the ops' cost.  Rank 0 prints each rank's figures.
local small = dist.sharded_tensor.ones(spec1, { 4 * W, 4 })
local sd = small:to_dtensor()
local n_ops = 2000
local function per_op(fn)
  local t0 = engine.time()
  for _ = 1, n_ops do fn() end
  return (engine.time() - t0) * 1e6 / n_ops
end
local op_cases = {
  { "add", function() return small + small end, function() return sd + sd end },
  { "mul by a number", function() return small * 2 end, function() return sd * 2 end },
  { "relu", function() return small:relu() end, function() return sd:relu() end },
}
local mine = {}   -- this rank's {u_st, u_dt, m_st, m_dt} per case
U.idle_barrier()
for turn = 0, W - 1 do
  if turn == R then
    for c, case in ipairs(op_cases) do
      per_op(case[2]); per_op(case[3])   -- warm up
      local a, b = {}, {}
      for k = 1, 11 do a[k] = per_op(case[2]); b[k] = per_op(case[3]) end   -- alternating
      mine[c] = { median(a), median(b), math.min(unpack(a)), math.min(unpack(b)) }
    end
  end
  U.idle_barrier()
end
local flat = {}
for c = 1, #op_cases do for j = 1, 4 do flat[#flat + 1] = mine[c][j] end end
local gathered = dist.all_gather(engine.tensor(flat, "f64"))   -- [W * #flat]: every rank's figures
local all = {}
for r = 0, W - 1 do
  all[r + 1] = {}
  for j = 1, #flat do all[r + 1][j] = gathered[r * #flat + j] end
end
for c, case in ipairs(op_cases) do
  local per_rank, worst = {}, -math.huge   -- (worst: the largest rank's median overhead)
  for r = 0, W - 1 do
    local f = all[r + 1]
    local u_st, u_dt = f[(c - 1) * 4 + 1], f[(c - 1) * 4 + 2]
    per_rank[#per_rank + 1] = string.format("%+.2f", u_st - u_dt)
    worst = math.max(worst, u_st - u_dt)
  end
  local m = mine[c]
  lines[#lines + 1] = string.format("op %-16s ShardedTensor %8.2f us   DTensor %8.2f us   overhead %+6.2f us   "
    .. "(fastest rounds: %.2f / %.2f us, %+.2f; median overhead per rank: %s us, largest %+.2f; target <= 1)", case[1],
    m[1], m[2], m[1] - m[2], m[3], m[4], m[3] - m[4], table.concat(per_rank, " "), worst)
end

if R == 0 then
  print(string.format("ShardedTensor bench: %d ranks, f32 [%d, %d] (%d MiB), median of %d", W, rows, cols, mib, iters))
  for _, l in ipairs(lines) do print(l) end
end
