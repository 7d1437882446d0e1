-- recipes/bench/checkpoint.lua: distributed checkpoint throughput (PyTorch DCP's save and load).
--
--   mpirun -np 4 build/engine recipes/bench/checkpoint.lua [--mib=1024] [--dir=/tmp/ckpt_bench] [--reps=3] [--cold=0]
--     [--pairs=3] [--tensors=8]
--
-- State: --mib MiB of f32 in --tensors DTensors (8) sharded Shard(1) over all ranks (each rank holds mib/ranks).
-- Medians of --reps, rank 0 prints:
--   save     dist.checkpoint.save (sync: write, fsync, rename, metadata) in GB/s of the state, beside
--            `dd bs=1M conv=fsync` of the same bytes (every rank its share, at the same time) to the same
--            directory
--   load     dist.checkpoint.load into the same layout, beside `dd` reading the same files back (both
--            mostly from the page cache right after writing: the numbers compare the software paths);
--            --cold=1 first drops each rank's data file and dd file from the page cache
--            (posix_fadvise DONTNEED: clean pages of these files only), so both read the disk
--   read     each rank's data file read (pread, no checksum) into memory of the size of its shards:
--            the least a load into the state does (dd reads into one 1 MiB buffer that stays in the
--            cache; a load writes every byte to the state's memory)
--   checksum XXH64 (the chunks' checksum) and the FNV of engine.tensor_checksum (format engine-dcp/1)
--            over the local shards, every rank at once, in GB/s of the state
--   reshard  the 4-rank checkpoint loaded on a 2-rank sub-mesh (Shard(1) there), against a same-layout
--            load of the same bytes per rank (a checkpoint saved on that sub-mesh, loaded there; the ranks
--            outside the sub-mesh load nothing; the time is the slowest rank's)
--   async    the time save({async = true}) blocks the caller, beside one memcpy (clone) of the local
--            shards, and the time to completion (wait); --pairs alternations of the two per rep, so the
--            medians are over reps x pairs, and the median of each pair's ratio is printed too
local engine = require("engine")
local dist = engine.distributed
local ckpt = dist.checkpoint

local o = require("engine.cli").parse(arg or {}, { name = "bench/checkpoint",
  description = "dist.checkpoint save and load throughput against writing and reading the same bytes directly.",
  options = {
    { "mib", 1024, "MiB of model state saved (over all ranks)", min = 1 },
    { "dir", (os.getenv("TMPDIR") or "/tmp") .. "/ckpt_bench", "where the checkpoints are written" },
    { "reps", 3, "repetitions", int = true, min = 1 },
    { "cold", 0, "1: drop the page cache before loads (needs root)", int = true, choices = { 0, 1 } },
    { "pairs", 3, "alternations of the two cases per rep", int = true, min = 1 },
    { "tensors", 8, "tensors the state is split into", int = true, min = 1 },
  } })

dist.init()
local W, R = dist.world_size(), dist.rank()
local mesh = dist.init_device_mesh("cpu", { W })
local function log(...) if R == 0 then print(string.format(...)); io.stdout:flush() end end
local function median(t)
  local s = { unpack(t) }
  table.sort(s)
  return s[math.floor((#s + 1) / 2)]
end
-- wall time of fn on the slowest rank (barrier before, max after)
local function timed(fn)
  dist.barrier()
  local t0 = engine.time()
  fn()
  local dt = engine.tensor({ engine.time() - t0 }, "f64")
  dist.all_reduce(dt, "max")
  return dt:item()
end

local ffi = require("ffi")
pcall(ffi.cdef, [[
int open(const char* path, int flags, ...);
int close(int fd);
int posix_fadvise(int fd, int64_t offset, int64_t len, int advice);
int64_t pread(int fd, void* buf, size_t n, int64_t offset);
]])
-- drop a file's clean pages from the page cache (--cold=1)
local function evict(path)
  if o.cold == 0 then return end
  local fd = ffi.C.open(path, 0)
  if fd >= 0 then ffi.C.posix_fadvise(fd, 0, 0, 4); ffi.C.close(fd) end
end
-- pread the whole file into buf (a tensor of at least its size)
local function read_file(path, buf)
  local fd = ffi.C.open(path, 0)
  assert(fd >= 0, path)
  local p, cap, off = ffi.cast("char*", buf:data_ptr()), buf:numel() * 4, 0
  while off < cap do
    local k = ffi.C.pread(fd, p + off, math.min(cap - off, 2 ^ 30), off)
    if k <= 0 then break end
    off = off + tonumber(k)
  end
  ffi.C.close(fd)
end

local N_T = o.tensors
local cols = 1024
local rows = math.floor(o.mib * 2 ^ 20 / 4 / N_T / cols)
local bytes = N_T * rows * cols * 4
local function state(m, pl)
  local s = {}
  for i = 1, N_T do s["w" .. i] = dist.zeros({ rows, cols }, { mesh = m, placements = pl }) end
  return s
end
engine.manual_seed(0)
local st = {}
for i = 1, N_T do st["w" .. i] = dist.rand({ rows, cols }, { mesh = mesh, placements = { dist.Shard(1) } }) end
local local_bytes = 0
for i = 1, N_T do local_bytes = local_bytes + st["w" .. i]:to_local():numel() * 4 end

log("bench/checkpoint: %d ranks, state %.0f MiB (%d x f32[%d,%d] Shard(1)), %.0f MiB per rank, dir %s, medians of %d%s",
  W, bytes / 2 ^ 20, N_T, rows, cols, local_bytes / 2 ^ 20, o.dir, o.reps, o.cold ~= 0 and ", cold reads" or "")
if R == 0 then os.execute("rm -rf '" .. o.dir .. "' && mkdir -p '" .. o.dir .. "'") end
dist.barrier()

local dir = o.dir .. "/ck"
local ddfile = string.format("%s/dd_%d.bin", o.dir, R)
local mb = math.max(1, math.floor(local_bytes / 2 ^ 20 + 0.5))
local save_t, dd_w, load_t, dd_r, resh_t, same_t, async_block, async_total, memcpy_t = {}, {}, {}, {}, {}, {}, {}, {}, {}
local read_t, xxh_t, fnv_t, async_ratio = {}, {}, {}, {}
local C = require("engine.core").C
local my_file = ckpt.data_file(dir, R)
local read_buf = engine.zeros({ local_bytes / 4 + 16 })
for rep = 1, o.reps do
  save_t[rep] = timed(function() ckpt.save(st, dir) end)
  dd_w[rep] = timed(function()
    os.execute(string.format("dd if=/dev/zero of='%s' bs=1M count=%d conv=fsync status=none", ddfile, mb))
  end)
  local back = state(mesh, { dist.Shard(1) })
  evict(my_file)
  load_t[rep] = timed(function() ckpt.load(back, dir) end)
  evict(my_file)
  read_t[rep] = timed(function() read_file(my_file, read_buf) end)
  xxh_t[rep] = timed(function()
    for i = 1, N_T do
      local l = st["w" .. i]:to_local():contiguous()
      C.eng_xxh64(ffi.cast("const void*", l:data_ptr()), l:numel() * 4)
    end
  end)
  fnv_t[rep] = timed(function()
    for i = 1, N_T do
      local l = st["w" .. i]:to_local():contiguous()
      C.eng_checksum_fnv(ffi.cast("const void*", l:data_ptr()), l:numel() * 4)
    end
  end)
  evict(ddfile)
  dd_r[rep] = timed(function()
    os.execute(string.format("dd if='%s' of=/dev/null bs=1M status=none", ddfile))
  end)
  back = nil
  collectgarbage()
  -- resharding: the same checkpoint on a 2-rank sub-mesh
  local ranks = {}
  for r = 0, math.max(1, math.floor(W / 2)) - 1 do ranks[#ranks + 1] = r end
  local half = dist.DeviceMesh("cpu", ranks)
  local back2 = state(half, { dist.Shard(1) })
  resh_t[rep] = timed(function() ckpt.load(back2, dir) end)
  -- the same bytes per rank without resharding: a checkpoint saved on the sub-mesh, loaded there
  if rep == 1 then ckpt.save(back2, dir .. "_half") end
  local back3 = state(half, { dist.Shard(1) })
  same_t[rep] = timed(function() ckpt.load(back3, dir .. "_half") end)
  back2, back3 = nil, nil
  collectgarbage()
  -- async: blocking time vs one memcpy of the local shards, alternated --pairs times (each pair's ratio too)
  for _ = 1, o.pairs do
    local k = #memcpy_t + 1
    memcpy_t[k] = timed(function()
      local keep = {}
      for i = 1, N_T do keep[i] = st["w" .. i]:to_local():clone() end
    end)
    collectgarbage()
    local h
    async_block[k] = timed(function() h = ckpt.save(st, dir .. "_async", { async = true }) end)
    async_total[k] = async_block[k] + timed(function() h:wait() end)
    async_ratio[k] = async_block[k] / memcpy_t[k]
    collectgarbage()
  end
end
local function gbs(t) return bytes / t / 1e9 end
log("save     %.3f s  %.2f GB/s   | dd conv=fsync %.3f s  %.2f GB/s   | ratio %.2f", median(save_t), gbs(median(save_t)),
  median(dd_w), gbs(median(dd_w)), median(dd_w) / median(save_t))
log("load     %.3f s  %.2f GB/s   | dd read       %.3f s  %.2f GB/s   | ratio %.2f", median(load_t), gbs(median(load_t)),
  median(dd_r), gbs(median(dd_r)), median(dd_r) / median(load_t))
log("read     %.3f s  %.2f GB/s   | pread of each rank's data file into memory, no checksum | the load at %.2fx of it",
  median(read_t), gbs(median(read_t)), median(read_t) / median(load_t))
log("checksum XXH64 %.3f s  %.2f GB/s | FNV (engine-dcp/1) %.3f s  %.2f GB/s", median(xxh_t), gbs(median(xxh_t)),
  median(fnv_t), gbs(median(fnv_t)))
log("reshard  %d -> %d ranks %.3f s  %.2f GB/s | same-layout load on the %d ranks %.3f s | ratio %.2f", W,
  math.max(1, math.floor(W / 2)), median(resh_t), gbs(median(resh_t)), math.max(1, math.floor(W / 2)), median(same_t),
  median(resh_t) / median(same_t))
log("async    blocks %.3f s | one memcpy of the local shards %.3f s (ratio %.2f; median of the %d pairs' ratios %.2f) | to completion %.3f s",
  median(async_block), median(memcpy_t), median(async_block) / median(memcpy_t), #async_ratio, median(async_ratio),
  median(async_total))
dist.barrier()
if R == 0 then os.execute("rm -rf '" .. o.dir .. "'") end
