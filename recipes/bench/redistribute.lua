-- Redistribute benchmark: DTensor redistribute against the bare MPI collective
-- (eng_pg_raw_collective: no staging, counters or checks) on the same buffers,
-- in the same run.  Global tensor: MiB of f32 as a square-ish [rows, cols]
-- matrix on a 1-d mesh of all ranks.  Median of `reps` timed runs after
-- warm-up; bare and DTensor calls alternate, each after a barrier; the slowest
-- rank's median is reported.
--
--   mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader --mca pml ob1 \
--     -np 4 build/engine recipes/bench/redistribute.lua [MiB=64] [reps=10] [only]
--
-- only: run just the rows whose case name contains this text (e.g. "P->S"), to
-- time a case without the memory the earlier rows leave behind.
--
-- Cases (Lua dims are 1-based: Shard(1) is PyTorch's Shard(0)):
--   S(1)->R      all_gather of the local shard into the full matrix
--   P->R         all_reduce; the bare call out of place, as DTensor's (it keeps its input: MPI reads
--                the local and writes the result), and once more against the bare in-place call
--   P->S(1)      reduce_scatter
--   S(1)->S(2)   all_to_all.  The bare call exchanges the contiguous local as is, which is
--                not the layout change: each peer needs a column block, strided in the
--                local, so a correct S->S reads strided memory.  DTensor moves each
--                block once between the ranks' memories (single-copy path, comm/cma.c);
--                the rows after it compare it with what the layout change costs
--                through MPI: a hand-written pack + the bare all_to_all, the bare
--                MPI_Alltoall with a vector send datatype (MPI reads the strided
--                blocks itself), and DTensor's own MPI path (dist.set_single_copy(false)).
--   S(2)->R      all_gather along the column dim, against a bare all_gather of the
--                local + the unpack into [rows, cols] (the MPI way to get that layout)
local engine = require("engine")
local dist = engine.distributed
local C = engine.C
local S, Rep, Part = dist.Shard, dist.Replicate, dist.Partial

local mib = tonumber(arg and arg[1]) or 64
local reps = tonumber(arg and arg[2]) or 10
local only = arg and arg[3]
local R, W = dist.rank(), dist.world_size()
local mesh = dist.init_device_mesh("cpu", { W })
local pg = mesh:get_group(1)
local single_copy = pg:single_copy_usable() -- collective (every rank asks)

local n = math.floor(mib * 1024 * 1024 / 4)
local cols = 4096
local rows = math.floor(n / cols)
rows = rows - rows % W
n = rows * cols

local function median(xs)
  table.sort(xs)
  local k = #xs
  return k % 2 == 1 and xs[(k + 1) / 2] or 0.5 * (xs[k / 2] + xs[k / 2 + 1])
end

local function time_pair(a, b)
  for _ = 1, 2 do a(); b() end
  local ta, tb = {}, {}
  for i = 1, reps do
    for k, fn in ipairs({ a, b }) do
      dist.barrier()
      local t0 = engine.time()
      fn()
      local dt = (engine.time() - t0) * 1e3
      if k == 1 then ta[i] = dt else tb[i] = dt end
    end
  end
  local m = engine.tensor({ median(ta), median(tb) }, "f64")
  dist.all_reduce(m, "max")
  return m:get(1), m:get(2)
end

local function raw(kind, send, recv, count, op)
  local rc = C.eng_pg_raw_collective(pg._c, kind, send, recv, count, 0, op or 0, 0)
  if rc ~= 0 then error(engine.ffi.string(C.eng_last_error())) end
end
local K = { all_reduce = 0, all_gather = 1, reduce_scatter = 2, all_to_all = 3 }

-- the DTensors and the bare buffers
local sharded = dist.ones({ rows, cols }, { mesh = mesh, placements = { S(1) } })
local partial = dist.DTensor.from_local(engine.ones(rows, cols), mesh, { Part() })
local l_sh, l_p = sharded:to_local(), partial:to_local()
local full_out = engine.zeros(rows, cols)
local shard_out = engine.zeros(rows / W, cols)

local results = {}
local function row(name, bare, ours, check, base_name)
  if only and not name:find(only, 1, true) then return end
  local tb, to = time_pair(bare, ours)
  results[#results + 1] = string.format("%-23s %-15s %8.2f ms   DTensor %8.2f ms   ratio %.3f", name, base_name or "bare MPI", tb,
    to, to / tb)
  if check then check() end
end

-- The previous DTensor result is released at once (not left to the Lua GC),
-- so its storage goes back to the caching allocator and is reused, as in a
-- training loop; otherwise every call would page-fault a fresh buffer in.
local last
local function drop()
  if last then C.eng_tensor_release(engine.ffi.gc(last._c, nil)); last._c = nil; last = nil end
end
row("S(1)->R", function() raw(K.all_gather, l_sh:data_ptr(), full_out:data_ptr(), l_sh:numel()) end,
  function() drop(); last = sharded:redistribute(nil, { Rep() }) end,
  function() assert(last:to_local():sum():item() == n, "S->R result") end)
row("P->R", function() raw(K.all_reduce, l_p:data_ptr(), full_out:data_ptr(), n) end,
  function() drop(); last = partial:redistribute(nil, { Rep() }) end,
  function() assert(last:to_local():max():item() == W, "P->R result") end)
local scratch = engine.ones(rows, cols)
row("P->R (bare in place)", function() raw(K.all_reduce, nil, scratch:data_ptr(), n) end,
  function() drop(); last = partial:redistribute(nil, { Rep() }) end)
row("P->S(1)", function() raw(K.reduce_scatter, l_p:data_ptr(), shard_out:data_ptr(), n / W) end,
  function() drop(); last = partial:redistribute(nil, { S(1) }) end,
  function() assert(last:to_local():min():item() == W, "P->S result") end)
row("S(1)->S(2)", function() raw(K.all_to_all, l_sh:data_ptr(), shard_out:data_ptr(), l_sh:numel() / W) end,
  function() drop(); last = sharded:redistribute(nil, { S(2) }) end,
  function() assert(last:to_local():numel() == rows * cols / W, "S->S result") end)

-- what S(1)->S(2) costs the MPI way: pack the column blocks, then the bare all_to_all
local cw = cols / W
local packed = engine.zeros(W, rows / W, cw)
local function pack_a2a()
  for j = 1, W do packed:select(1, j):copy_(l_sh:narrow(2, (j - 1) * cw + 1, cw)) end
  raw(K.all_to_all, packed:data_ptr(), shard_out:data_ptr(), l_sh:numel() / W)
end
row("S(1)->S(2)", pack_a2a,
  function() drop(); last = sharded:redistribute(nil, { S(2) }) end,
  function() assert(last:to_local():numel() == rows * cols / W, "S->S result") end, "pack+all_to_all")
-- the same layout change done by MPI itself: MPI_Alltoall with a vector send datatype
-- (peer j's column block read straight out of the strided local, no pack)
row("S(1)->S(2)", function()
    local rc = C.eng_pg_raw_all_to_all_strided(pg._c, l_sh:data_ptr(), shard_out:data_ptr(), rows / W, cw, cols, 0)
    if rc ~= 0 then error(engine.ffi.string(C.eng_last_error())) end
  end,
  function() drop(); last = sharded:redistribute(nil, { S(2) }) end, nil, "MPI vector a2a")
row("S(1)->S(2)", function()
    drop(); dist.set_single_copy(false); last = sharded:redistribute(nil, { S(2) }); dist.set_single_copy(true)
  end,
  function() drop(); last = sharded:redistribute(nil, { S(2) }) end, nil, "DTensor via MPI")
-- S(2)->R: the bare all_gather of the column-sharded local, then the unpack
local col_sharded = dist.ones({ rows, cols }, { mesh = mesh, placements = { S(2) } })
local l_col = col_sharded:to_local()
local gathered = engine.zeros(W, rows, cw)
local full_cols = engine.zeros(rows, cols)
local function gather_unpack()
  raw(K.all_gather, l_col:data_ptr(), gathered:data_ptr(), l_col:numel())
  for j = 1, W do full_cols:narrow(2, (j - 1) * cw + 1, cw):copy_(gathered:select(1, j)) end
end
row("S(2)->R", gather_unpack,
  function() drop(); last = col_sharded:redistribute(nil, { Rep() }) end,
  function() assert(last:to_local():sum():item() == n, "S(2)->R result") end, "ag+unpack")

if R == 0 then
  print(string.format("redistribute benchmark: %d ranks, global f32[%d,%d] (%.0f MiB), median of %d runs, slowest rank",
    W, rows, cols, n * 4 / 1048576, reps))
  for _, l in ipairs(results) do print(l) end
  print(string.format("single-copy path (cross-memory attach) %s on this group", single_copy and "used" or "NOT usable"))
end
