-- dist.checkpoint faults: a truncated data file, a flipped byte, a missing metadata file, a
-- save interrupted on one rank (the previous checkpoint still loads), metadata of another checkpoint or
-- another model, a missing rank file, a metadata file that is not one, a data file cut short between the
-- load's passes; a save into the folder of the previous checkpoint interrupted (a full disk) or left behind by a
-- killed rank: the previous checkpoint still loads there; prune's arguments.  Every rank fails with a message
-- naming the file, nothing is loaded half (the state keeps its values), no hang.  1, 2 and 4 ranks.
local engine = require("engine")
local ffi = require("ffi")
local dist = engine.distributed
local ckpt = dist.checkpoint
local util = require("spec.dist.helpers.util")
local diff, errmsg = util.diff, util.errmsg
local W, R = dist.world_size(), dist.rank()
local Shard = dist.Shard

pcall(ffi.cdef, "int setenv(const char*, const char*, int); int unsetenv(const char*);")

local root, newdir = require("spec.dist.helpers.util").dirs("ckpt_faults")
local mesh = dist.init_device_mesh("cpu", { W })

local function full() engine.manual_seed(4); return engine.randn(8, 3) end
local function saved(dir)
  ckpt.save({ w = dist.distribute_tensor(full(), mesh, { Shard(1) }), b = engine.ones(5), step = 7 }, dir)
end
local function target()
  return { w = dist.zeros({ 8, 3 }, { mesh = mesh, placements = { Shard(2) } }), b = engine.zeros(5), step = 0 }
end
-- the state is untouched after a failed load
local function untouched(st)
  assert.equal(0, st.w:to_local():abs():sum():item())
  assert.equal(0, st.b:abs():sum():item())
  assert.equal(0, st.step)
end
-- rank 0 changes a file; everyone waits for it
local function on_rank0(fn)
  if R == 0 then fn() end
  dist.barrier()
end
local function file_size(path)
  local f = assert(io.open(path, "rb"))
  local n = f:seek("end")
  f:close()
  return n
end
local function truncate(path, n)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  f = assert(io.open(path, "wb"))
  f:write(s:sub(1, n))
  f:close()
end

-- Loads dir into st while rank 0 applies change(dir) to its data file between the load's two passes (after every
-- rank verified every chunk): every rank fails (agreed), saying the state is partly loaded, with the values unset;
-- rank 0's message names its file and says why (`why`); the next collective is in step on every rank.
local function changed_between_passes(st, dir, change, why)
  if R == 0 then ckpt._test.after_verify = change end
  local e = errmsg(ckpt.load, st, dir)
  ckpt._test.after_verify = nil
  assert.is_truthy(e:find(dir .. "' changed during the load", 1, true) and e:find("partly loaded", 1, true), e)
  if R == 0 then assert.is_truthy(e:find("__0_0.distcp", 1, true) and e:find(why, 1, true), e) end
  assert.equal(0, st.step)
  dist.barrier()
end

describe("dist.checkpoint faults (" .. W .. " ranks)", function()
  teardown(function()
    dist.barrier()
    if R == 0 then os.execute("rm -rf '" .. root .. "'") end
  end)

  it("a good checkpoint loads (the baseline of the cases below)", function()
    local dir = newdir()
    saved(dir)
    local st = target()
    ckpt.load(st, dir)
    assert.equal(0, diff(st.w:full_tensor(), full()))
    assert.equal(7, st.step)
  end)

  it("a truncated data file: an error naming it on every rank, nothing loaded", function()
    local dir = newdir()
    saved(dir)
    local path = dir .. "/__0_0.distcp"
    on_rank0(function() truncate(path, file_size(path) - 4) end)
    local st = target()
    local e = errmsg(ckpt.load, st, dir)
    assert.is_truthy(e:find("__0_0.distcp", 1, true) and e:find("truncated", 1, true), e)
    untouched(st)
  end)

  it("a flipped byte fails the chunk's checksum, naming the file", function()
    local dir = newdir()
    saved(dir)
    local path = dir .. "/__0_0.distcp"
    on_rank0(function()
      local f = assert(io.open(path, "r+b"))
      f:seek("set", 64 + 5)
      local c = f:read(1)
      f:seek("set", 64 + 5)
      f:write(string.char(bit.bxor(c:byte(), 0x10)))
      f:close()
    end)
    local st = target()
    local e = errmsg(ckpt.load, st, dir)
    assert.is_truthy(e:find("__0_0.distcp", 1, true) and e:find("checksum", 1, true), e)
    untouched(st)
  end)

  it("a data file changed between the passes on one rank: every rank fails (agreed), the values are not set", function()
    local dir = newdir()
    saved(dir)
    -- rank 0 flips a byte of its chunk after every rank verified every chunk, before the chunks are read again
    changed_between_passes(target(), dir, function(d)
      local f = assert(io.open(d .. "/__0_0.distcp", "r+b"))
      f:seek("set", 64 + 5)
      local c = f:read(1)
      f:seek("set", 64 + 5)
      f:write(string.char(bit.bxor(c:byte(), 0x10)))
      f:close()
    end, "checksum")
  end)

  it("a data file truncated after the checksum pass: a read error on every rank, no crash", function()
    local dir = newdir()
    -- chunks of several pages (64 KiB per rank): read through a mapping, the pages past the new end
    -- would fault with SIGBUS; the second pass reads with pread and fails with the file's name
    local function big(fill) return dist.full({ 128, 128 * W }, fill, { mesh = mesh, placements = { Shard(2) } }) end
    ckpt.save({ w = big(1), step = 7 }, dir)
    changed_between_passes({ w = big(0), step = 0 }, dir, function(d)
      assert(os.execute("truncate -s 64 '" .. d .. "/__0_0.distcp'") == 0)
    end, "ends early")
  end)

  it("a missing metadata file: not a checkpoint", function()
    local dir = newdir()
    saved(dir)
    on_rank0(function() os.remove(dir .. "/.metadata") end)
    local st = target()
    local e = errmsg(ckpt.load, st, dir)
    assert.is_truthy(e:find(".metadata", 1, true) and e:find("no metadata file", 1, true), e)
    untouched(st)
  end)

  it("a metadata file that is not one, or of another format, names it", function()
    local dir = newdir()
    saved(dir)
    on_rank0(function()
      local f = assert(io.open(dir .. "/.metadata", "wb"))
      f:write("garbage")
      f:close()
    end)
    local e = errmsg(ckpt.load, target(), dir)
    assert.is_truthy(e:find(".metadata", 1, true) and e:find("unreadable", 1, true), e)
    on_rank0(function() engine.save(dir .. "/.metadata", { x = engine.ones(1) }) end)
    local e2 = errmsg(ckpt.load, target(), dir)
    assert.is_truthy(e2:find("not a distributed checkpoint", 1, true), e2)
  end)

  it("a save interrupted on one rank fails on every rank; the previous checkpoint still loads", function()
    local good, bad = newdir(), newdir()
    saved(good)
    local victim = string.format("/__%d_0.distcp", W - 1)
    if R == W - 1 then ffi.C.setenv("ENGINE_CKPT_TEST_FAIL", victim, 1) end
    local e = errmsg(saved, bad)
    if R == W - 1 then ffi.C.unsetenv("ENGINE_CKPT_TEST_FAIL") end
    assert.is_truthy(e:find(victim, 1, true) and e:find("interrupted", 1, true), e)
    -- no metadata was committed; the partial file is left under its temporary name only
    assert.is_nil(io.open(bad .. "/.metadata", "rb"))
    assert.is_nil(io.open(bad .. victim, "rb"))
    local e2 = errmsg(ckpt.load, target(), bad)
    assert.is_truthy(e2:find("no metadata file", 1, true), e2)
    -- the message names the partial file the interrupted rank left
    assert.is_truthy(e2:find("partial data file(s) " .. bad .. victim .. ".tmp", 1, true), e2)
    local st = target()
    ckpt.load(st, good)
    assert.equal(0, diff(st.w:full_tensor(), full()))
  end)

  -- a save into the folder of the previous checkpoint writes the new one beside it
  -- ("<dir>.saving") and swaps the two in one step, so the previous one survives any interruption
  local function exists(path) return os.rename(path, path) ~= nil end
  local function saved2(dir, opts)
    local h = ckpt.save({ w = dist.distribute_tensor(full() * 2, mesh, { Shard(1) }), b = engine.ones(5) * 3, step = 8 },
      dir, opts)
    if opts and opts.async then h:wait() end
  end
  local function loads_previous(dir)
    local st = target()
    ckpt.load(st, dir)
    assert.equal(0, diff(st.w:full_tensor(), full()))
    assert.equal(0, diff(st.b, engine.ones(5)))
    assert.equal(7, st.step)
  end

  it("a save into the folder of the previous checkpoint replaces it in one step; nothing is left beside it", function()
    local dir = newdir()
    saved(dir)
    local id0 = ckpt.read_metadata(dir).id
    saved2(dir)
    local st = target()
    ckpt.load(st, dir)
    assert.equal(0, diff(st.w:full_tensor(), full() * 2))
    assert.equal(0, diff(st.b, engine.ones(5) * 3))
    assert.equal(8, st.step)
    assert.are_not.equal(id0, ckpt.read_metadata(dir).id)
    dist.barrier()
    assert.is_false(exists(dir .. ".saving"))
    -- async too, and a third save into it
    saved(dir)
    saved2(dir, { async = true })
    ckpt.load(st, dir)
    assert.equal(8, st.step)
    assert.equal(0, diff(st.w:full_tensor(), full() * 2))
    dist.barrier()
    assert.is_false(exists(dir .. ".saving"))
  end)

  for _, async in ipairs({ false, true }) do
    it("a save into the folder of the previous checkpoint interrupted on one rank (a full disk" ..
      (async and ", async" or "") .. "): every rank fails, the previous checkpoint still loads there", function()
      local dir = newdir()
      saved(dir)
      local victim = string.format("/__%d_0.distcp", W - 1)
      if R == W - 1 then ffi.C.setenv("ENGINE_CKPT_TEST_FAIL", victim, 1) end
      local e = errmsg(saved2, dir, { async = async })
      if R == W - 1 then ffi.C.unsetenv("ENGINE_CKPT_TEST_FAIL") end
      assert.is_truthy(e:find(victim, 1, true) and e:find("interrupted", 1, true), e)
      loads_previous(dir)
      if R == W - 1 then assert.is_truthy(e:find(".saving" .. victim, 1, true), e) end
      -- the failed save's staging directory is gone; the next save into dir goes through
      dist.barrier()
      assert.is_false(exists(dir .. ".saving"))
      saved2(dir)
      local st = target()
      ckpt.load(st, dir)
      assert.equal(8, st.step)
    end)
  end

  it("what a killed save into the folder left beside it is removed by the next save into it", function()
    local dir = newdir()
    saved(dir)
    -- as a rank killed while writing leaves it: a staging directory with a partial data file, no metadata
    on_rank0(function()
      assert(os.execute("mkdir -p '" .. dir .. ".saving'") == 0)
      local f = assert(io.open(dir .. ".saving/__0_0.distcp.tmp123", "wb"))
      f:write("partial")
      f:close()
    end)
    loads_previous(dir)
    saved2(dir)
    dist.barrier()
    assert.is_false(exists(dir .. ".saving"))
    local st = target()
    ckpt.load(st, dir)
    assert.equal(8, st.step)
  end)

  it("prune checks its arguments before deleting anything", function()
    local proot = root .. "/prune"
    for s = 1, 3 do
      local d = ckpt.path(proot, s)
      ckpt.save({ x = engine.ones(2), step = s }, d)
    end
    if R == 0 then
      for _, bad in ipairs({ -1, 0, 1.5, 0 / 0, math.huge, "2" }) do
        local e = errmsg(ckpt.prune, proot, bad)
        assert.is_truthy(e:find("checkpoint.prune: keep must be an integer >= 1", 1, true), e)
      end
      local e = errmsg(ckpt.prune, nil, 1)
      assert.is_truthy(e:find("checkpoint.prune: root must be a non-empty string", 1, true), e)
      for s = 1, 3 do assert.equal(s, ckpt.read_metadata(ckpt.path(proot, s)).values.step) end
      ckpt.prune(proot, 2)
      assert.is_false(exists(ckpt.path(proot, 1)))
      assert.equal(ckpt.path(proot, 3), (ckpt.latest(proot)))
      assert.equal(2, ckpt.read_metadata(ckpt.path(proot, 2)).values.step)
    end
    dist.barrier()
  end)

  -- these were nil-index errors from inside checkpoint.lua
  it("latest, path and the optimizer state functions name a bad argument", function()
    local e = errmsg(ckpt.latest, nil)
    assert.is_truthy(e:find("checkpoint.latest: root must be a non-empty string", 1, true), e)
    assert.is_falsy(e:find("nil value", 1, true), e)
    e = errmsg(ckpt.path, nil, 3)
    assert.is_truthy(e:find("checkpoint.path: root must be a non-empty string", 1, true), e)
    e = errmsg(ckpt.path, root, "x")
    assert.is_truthy(e:find("checkpoint.path: step must be an integer >= 0, got x", 1, true), e)
    local m = engine.nn.Linear(2, 2)
    local opt = engine.optim.SGD(m:parameters(), { lr = 0.1 })
    e = errmsg(ckpt.get_optimizer_state_dict, nil, opt)
    assert.is_truthy(e:find("get_optimizer_state_dict: expected the model (an nn.Module) first, got nil", 1, true), e)
    e = errmsg(ckpt.get_optimizer_state_dict, m, nil)
    assert.is_truthy(e:find("get_optimizer_state_dict: expected an optimizer (engine.optim) second, got nil", 1, true), e)
    e = errmsg(ckpt.set_optimizer_state_dict, opt, m, {})
    assert.is_truthy(e:find("set_optimizer_state_dict: expected the model (an nn.Module) first, got table", 1, true), e)
  end)

  it("metadata of another save (same model) is rejected by the data files' ids", function()
    local a, b = newdir(), newdir()
    saved(a)
    saved(b)
    on_rank0(function()
      local f = assert(io.open(a .. "/.metadata", "rb"))
      local s = f:read("*a")
      f:close()
      f = assert(io.open(b .. "/.metadata", "wb"))
      f:write(s)
      f:close()
    end)
    local st = target()
    local e = errmsg(ckpt.load, st, b)
    assert.is_truthy(e:find("__0_0.distcp", 1, true) and e:find("belongs to another checkpoint", 1, true), e)
    untouched(st)
  end)

  it("a checkpoint of another model: the keys that differ are named", function()
    local dir = newdir()
    ckpt.save({ layer = { weight = engine.ones(2, 2) }, step = 1 }, dir)
    local st = target()
    local e = errmsg(ckpt.load, st, dir)
    assert.is_truthy(e:find("missing in the checkpoint: b, w", 1, true), e)
    assert.is_truthy(e:find("not in the state: layer.weight", 1, true), e)
    untouched(st)
  end)

  it("a missing rank file (a directory from another world size, copied in part) names the file", function()
    local dir = newdir()
    saved(dir)
    local last = string.format("%s/__%d_0.distcp", dir, W - 1)
    on_rank0(function() os.remove(last) end)
    local st = target()
    local e = errmsg(ckpt.load, st, dir)
    assert.is_truthy(e:find(last, 1, true) and e:find("cannot open", 1, true), e)
    untouched(st)
  end)

  it("a corrupt metadata entry (a chunk missing from the cover) is an error naming the tensor", function()
    local dir = newdir()
    saved(dir)
    on_rank0(function()
      local _, meta = engine.load(dir .. "/.metadata")
      meta["t:b"] = "f32|5|0:64:8:0000000000000000:0:2"
      meta.meta_xxh64 = engine.metadata_checksum(meta, "meta_xxh64")  -- as a faulty writer would seal it
      engine.save(dir .. "/.metadata", {}, meta)
    end)
    local st = target()
    local e = errmsg(ckpt.load, st, dir)
    assert.is_truthy(e:find("'b'", 1, true) and e:find("2 of the tensor's 5 elements", 1, true), e)
    untouched(st)
  end)
end)
