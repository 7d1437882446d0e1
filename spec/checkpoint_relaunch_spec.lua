-- dist.checkpoint across a real relaunch: a 6x4 tensor saved as Shard(1) by a 4-process job (chunks of
-- 2, 2, 2 and 0 rows: the metadata holds three chunks, from files 0, 1 and 2) loads in 2- and 1-process jobs into
-- Shard(1), Shard(2), Replicate and a plain tensor, and the reverse (saved by 1- and 2-process jobs, loaded by a
-- 4-process job).  spec/dist/checkpoint_spec.lua covers the same layouts with sub-meshes inside one world; here
-- every job is a fresh `mpirun -np N` of this engine binary, so the world size really changes between save and
-- load, as it does for a user.
local engine = require("engine")
local ckpt = engine.distributed.checkpoint
local proc = require("spec.helpers.proc")

local TMP = os.tmpname()
os.remove(TMP)
os.execute("mkdir -p " .. TMP)

-- the child: `job.lua save DIR LAYOUT` or `job.lua load DIR...` (every layout, from each DIR in turn); each rank
-- prints one line per step it checked
local JOB = [==[
local engine = require("engine")
local dist = engine.distributed
local ckpt = dist.checkpoint
dist.init()
local W, R = dist.world_size(), dist.rank()
local mesh = dist.init_device_mesh("cpu", { W })
local PL = { S1 = { dist.Shard(1) }, S2 = { dist.Shard(2) }, R = { dist.Replicate() } }
local full = engine.arange(24, { dtype = "f32" }):view({ 6, 4 })
local function same(a, b) return (a - b):abs():sum():item() == 0 end
if arg[1] == "save" then
  local w = dist.distribute_tensor(full, mesh, PL[arg[3]])
  ckpt.save({ w = w, step = 10 + W }, arg[2])
  print(string.format("saved rank %d of %d: %dx%d", R, W, w:to_local():shape()[1], w:to_local():shape()[2]))
else
  for i = 2, #arg do
    for _, name in ipairs({ "S1", "S2", "R", "plain" }) do
      local w = name == "plain" and engine.zeros(6, 4) or dist.zeros({ 6, 4 }, { mesh = mesh, placements = PL[name] })
      local st = { w = w, step = 0 }
      ckpt.load(st, arg[i])
      local ok
      if name == "plain" then ok = same(w, full)
      else
        -- the local shard is exactly its box of the full tensor, and the whole is the full tensor
        local ls, off = dist.compute_local_shape_and_global_offset({ 6, 4 }, mesh, PL[name])
        local want = full
        for d = 1, 2 do want = want:narrow(d, off[d] + 1, ls[d]) end
        ok = same(w:to_local(), want) and same(w:full_tensor(), full)
      end
      print(string.format("loaded %s rank %d of %d into %s: %s (step %d)", arg[i], R, W, name, ok and "ok" or "WRONG",
        st.step))
    end
  end
end
]==]

local function count(out, pat)
  local n = 0
  for _ in out:gmatch(pat) do n = n + 1 end
  return n
end

describe("dist.checkpoint across relaunched jobs", function()
  local job = TMP .. "/job.lua"
  setup(function()
    local f = assert(io.open(job, "w"))
    f:write(JOB)
    f:close()
  end)
  teardown(function() os.execute("rm -rf '" .. TMP .. "'") end)

  local function save(np, dir, layout)
    local out, rc = proc.job(np, job, { "save", dir, layout })
    assert.equal(0, rc, out)
    assert.equal(np, count(out, "saved rank %d+ of " .. np), out)
    return out
  end
  -- every rank of an np-process job loads each dir into Shard(1), Shard(2), Replicate and a plain tensor
  local function load(np, dirs, step)
    local args = { "load" }
    for _, d in ipairs(dirs) do args[#args + 1] = d end
    local out, rc = proc.job(np, job, args)
    assert.equal(0, rc, out)
    assert.equal(0, count(out, "WRONG"), out)
    for _, d in ipairs(dirs) do
      for _, name in ipairs({ "S1", "S2", "R", "plain" }) do
        local n = count(out, "loaded " .. d:gsub("%p", "%%%0") .. " rank %d+ of " .. np .. " into " .. name .. ": ok %(step "
          .. step[d] .. "%)")
        assert.equal(np, n, string.format("%s into %s at %d processes:\n%s", d, name, np, out))
      end
    end
  end
  -- the saved chunks of "w" as {file, first row, rows}
  local function chunks(dir)
    local _, meta = engine.load(dir .. "/.metadata")
    local e = ckpt._parse_entry(meta["t:w"], tonumber(meta.world_size), "w", "spec")
    local r = {}
    for _, c in ipairs(e.chunks) do r[#r + 1] = { c.file, c.offsets[1], c.sizes[1] } end
    table.sort(r, function(a, b) return a[2] < b[2] end)
    return r
  end

  it("a 6x4 tensor saved as Shard(1) by 4 processes (rows 2, 2, 2, 0) loads in 2- and 1-process jobs", function()
    if not proc.have_mpirun() then pending("needs mpirun"); return end
    local dir = TMP .. "/s4"
    local out = save(4, dir, "S1")
    for r, rows in ipairs({ 2, 2, 2, 0 }) do
      assert.is_truthy(out:find(string.format("saved rank %d of 4: %dx4", r - 1, rows), 1, true), out)
    end
    assert.same({ { 0, 0, 2 }, { 1, 2, 2 }, { 2, 4, 2 } }, chunks(dir))
    assert.equal(4, ckpt.read_metadata(dir).world_size)
    load(2, { dir }, { [dir] = 14 })
    load(1, { dir }, { [dir] = 14 })
  end)

  -- a job killed while saving into the folder of its previous checkpoint (rank 3 writes half
  -- of its data file, then kill -9 of itself) leaves that checkpoint loadable: the new one was being written
  -- beside it (<dir>.saving) and would have replaced it in one rename-exchange.
  it("a save into the folder of the previous checkpoint, killed (kill -9 of a rank while writing): the previous "
    .. "one still loads; the next save replaces it and removes what the killed one left", function()
    if not proc.have_mpirun() then pending("needs mpirun"); return end
    local dir = TMP .. "/killed"
    local function exists(path) return os.rename(path, path) ~= nil end
    save(2, dir, "S1")
    local t0 = engine.time()
    local out, rc = proc.job(4, job, { "save", dir, "S2" }, { env = { ENGINE_CKPT_TEST_KILL = "/__3_0.distcp" },
      timeout = 60 })
    assert.is_true(rc ~= 0 and rc ~= 124, out)
    assert.is_true(engine.time() - t0 < 55, "the killed job hung until the timeout")
    assert.is_truthy(out:find("signal 9", 1, true), out)   -- mpirun: "exited on signal 9 (Killed)"
    assert.equal(0, count(out, "saved rank"), out)
    -- the previous checkpoint (saved by 2 processes: step 12), in every layout, at 2 and 1 processes
    assert.equal(2, ckpt.read_metadata(dir).world_size)
    load(2, { dir }, { [dir] = 12 })
    load(1, { dir }, { [dir] = 12 })
    assert.is_true(exists(dir .. ".saving"), "the killed save wrote beside the checkpoint")
    -- the next save into dir (1 process: step 11) replaces it and removes the killed save's directory
    save(1, dir, "R")
    assert.is_false(exists(dir .. ".saving"))
    assert.equal(1, ckpt.read_metadata(dir).world_size)
    load(2, { dir }, { [dir] = 11 })
  end)

  it("the reverse: saved by 1- and 2-process jobs, loaded by a 4-process job", function()
    if not proc.have_mpirun() then pending("needs mpirun"); return end
    local d1, d2 = TMP .. "/s1", TMP .. "/s2"
    save(1, d1, "S1")
    save(2, d2, "S1")
    assert.same({ { 0, 0, 6 } }, chunks(d1))
    assert.same({ { 0, 0, 3 }, { 1, 3, 3 } }, chunks(d2))
    load(4, { d1, d2 }, { [d1] = 11, [d2] = 12 })
  end)
end)
