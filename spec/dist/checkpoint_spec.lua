-- dist.checkpoint (PyTorch's DCP): save at one layout, load into another.  Runs at 1, 2 and 4 ranks:
-- 1-D meshes over {Replicate, Shard(1), Shard(2)} both ways, on a 2x2 mesh (4 ranks) all 12 ordered
-- pairs of {[R,R], [R,S1], [S1,R], [S1,S1]} and 1-D saves into every 2-D layout and back, saves from the
-- whole world loaded on a sub-mesh (half the ranks, one rank) and the reverse, uneven sizes, plain
-- tensors, ShardedTensors to DTensors and back, values, missing keys, Partial DTensors, async = sync.
-- (spec/checkpoint_relaunch_spec.lua does the 4 -> 2, 1 and 1, 2 -> 4 cases with real relaunched jobs.)
local engine = require("engine")
local dist = engine.distributed
local ckpt = dist.checkpoint
local util = require("spec.dist.helpers.util")
local diff, errmsg = util.diff, util.errmsg
local W, R = dist.world_size(), dist.rank()
local Shard, Replicate = dist.Shard, dist.Replicate

local root, newdir = require("spec.dist.helpers.util").dirs("ckpt_spec")

local world_mesh = dist.init_device_mesh("cpu", { W })
-- a mesh over the first k ranks (the others are outside it and hold nothing)
local function sub_mesh(k)
  local ranks = {}
  for i = 0, k - 1 do ranks[#ranks + 1] = i end
  return dist.DeviceMesh("cpu", ranks)
end

local function full_of(t)
  if dist.is_dtensor(t) then return t:full_tensor() end
  return t
end

local function reference(shape, seed)
  engine.manual_seed(seed)
  return engine.randn(shape)
end

-- save `full` laid out (mesh, pl) under key "w", load into (mesh2, pl2) and compare on every rank
local function roundtrip(shape, mesh, pl, mesh2, pl2, label)
  local full = reference(shape, 7)
  local src = mesh and dist.distribute_tensor(full, mesh, pl) or full:clone()
  local dir = newdir()
  ckpt.save({ w = src }, dir)
  local dst = mesh2 and dist.zeros(shape, { mesh = mesh2, placements = pl2 }) or engine.zeros(shape)
  ckpt.load({ w = dst }, dir)
  local ok = true
  if not mesh2 or mesh2:get_coordinate() ~= nil then
    local got = full_of(dst)
    ok = diff(got, full) == 0
    local strided = false
    for _, p in ipairs(pl2 or {}) do if p:is_strided_shard() then strided = true end end
    if dst.to_local and mesh2 and not strided then
      -- the local shard is exactly its box of the global tensor
      local ls, off = dist.compute_local_shape_and_global_offset(shape, mesh2, pl2)
      local want = full
      for d = 1, #shape do want = want:narrow(d, off[d] + 1, ls[d]) end
      ok = ok and diff(dst:to_local(), want) == 0
    end
  end
  assert(ok, label)
end

local ONE_D = { { "R", { Replicate() } }, { "S1", { Shard(1) } }, { "S2", { Shard(2) } } }

describe("dist.checkpoint resharding (" .. W .. " ranks)", function()
  it("1-D: every ordered pair of Replicate, Shard(1), Shard(2), uneven 6x5", function()
    for _, a in ipairs(ONE_D) do
      for _, b in ipairs(ONE_D) do
        roundtrip({ 6, 5 }, world_mesh, a[2], world_mesh, b[2], a[1] .. " -> " .. b[1])
      end
    end
  end)

  it("a _StridedShard shard of several runs (split_factor 2 on a 1-D mesh) saves and loads both ways", function()
    local st = { dist._StridedShard(1, { split_factor = 2 }) }
    roundtrip({ 9, 2 }, world_mesh, st, world_mesh, { Shard(2) }, "strided -> S2")
    roundtrip({ 9, 2 }, world_mesh, { Replicate() }, world_mesh, st, "R -> strided")
  end)

  it("plain tensors load into DTensors and DTensors into plain tensors; 0-d and 3-d tensors", function()
    roundtrip({ 6, 4 }, nil, nil, world_mesh, { Shard(1) }, "plain -> S1")
    roundtrip({ 6, 4 }, world_mesh, { Shard(2) }, nil, nil, "S2 -> plain")
    roundtrip({ 3, 5, 2 }, world_mesh, { Shard(3) }, world_mesh, { Shard(2) }, "3-d S3 -> S2")
    roundtrip({}, nil, nil, nil, nil, "0-d")
  end)

  it("a save from all ranks loads on a sub-mesh (half the ranks, one rank) and the reverse", function()
    local half = sub_mesh(math.max(1, math.floor(W / 2)))
    local one = sub_mesh(1)
    -- a 6x4 tensor saved as Shard(1) at 4 ranks: chunks of 2, 2, 2, 0 rows
    roundtrip({ 6, 4 }, world_mesh, { Shard(1) }, half, { Shard(1) }, "world S1 -> half S1")
    roundtrip({ 6, 4 }, world_mesh, { Shard(1) }, one, { Shard(1) }, "world S1 -> one rank")
    roundtrip({ 6, 4 }, half, { Shard(2) }, world_mesh, { Shard(1) }, "half S2 -> world S1")
    roundtrip({ 6, 4 }, one, { Replicate() }, world_mesh, { Shard(2) }, "one rank -> world S2")
    roundtrip({ 7, 3 }, half, { Shard(1) }, world_mesh, { Shard(1) }, "uneven 7 rows half -> world")
  end)

  if W == 4 then
    local mesh2d = dist.init_device_mesh("cpu", { 2, 2 })
    local TWO_D = {
      { "[R,R]", { Replicate(), Replicate() } }, { "[R,S1]", { Replicate(), Shard(1) } },
      { "[S1,R]", { Shard(1), Replicate() } }, { "[S1,S1]", { Shard(1), Shard(1) } },
    }
    it("2x2 mesh: all 12 ordered pairs of [R,R], [R,S1], [S1,R], [S1,S1] (uneven 5x3)", function()
      local n = 0
      for _, a in ipairs(TWO_D) do
        for _, b in ipairs(TWO_D) do
          if a ~= b then
            roundtrip({ 5, 3 }, mesh2d, a[2], mesh2d, b[2], a[1] .. " -> " .. b[1])
            n = n + 1
          end
        end
      end
      assert.equal(12, n)
    end)

    it("_StridedShard layouts (FSDP + TP's [_StridedShard(1, sf = 2), Shard(1)]) save and load both ways", function()
      local strided = { dist._StridedShard(1, { split_factor = 2 }), Shard(1) }
      roundtrip({ 8, 3 }, mesh2d, strided, world_mesh, { Shard(2) }, "strided -> S2")
      roundtrip({ 8, 3 }, world_mesh, { Shard(1) }, mesh2d, strided, "S1 -> strided")
      roundtrip({ 7, 3 }, mesh2d, strided, mesh2d, { Shard(1), Shard(1) }, "uneven strided -> [S1,S1]")
    end)

    it("1-D saves load into every 2-D layout and back", function()
      local more = { { "[S1,S2]", { Shard(1), Shard(2) } }, { "[S2,S1]", { Shard(2), Shard(1) } } }
      for _, a in ipairs(ONE_D) do
        for _, list in ipairs({ TWO_D, more }) do
          for _, b in ipairs(list) do
            roundtrip({ 6, 5 }, world_mesh, a[2], mesh2d, b[2], a[1] .. " -> " .. b[1])
            roundtrip({ 6, 5 }, mesh2d, b[2], world_mesh, a[2], b[1] .. " -> " .. a[1])
          end
        end
      end
    end)
  end

  it("ShardedTensors load into DTensor layouts and back", function()
    if not dist.sharded_tensor or not dist.ChunkShardingSpec then pending("ShardedTensor not available"); return end
    local places = {}
    for r = 0, W - 1 do places[#places + 1] = "rank:" .. r .. "/cpu" end
    local spec = dist.ChunkShardingSpec{ dim = 2, placements = places }
    local full = reference({ 4, 7 }, 3)
    -- a ShardedTensor with the values of full
    local st = dist.sharded_tensor.zeros(spec, { 4, 7 })
    engine.no_grad(function()
      for _, s in ipairs(st:local_shards()) do
        local o, z = s.metadata.shard_offsets, s.metadata.shard_sizes
        s.tensor:copy_(full:narrow(1, o[1] + 1, z[1]):narrow(2, o[2] + 1, z[2]))
      end
    end)
    local dir = newdir()
    ckpt.save({ st = st }, dir)
    local d = dist.zeros({ 4, 7 }, { mesh = world_mesh, placements = { Shard(1) } })
    ckpt.load({ st = d }, dir)
    assert.equal(0, diff(d:full_tensor(), full))
    -- and back: a DTensor save into a ShardedTensor
    local dir2 = newdir()
    ckpt.save({ st = dist.distribute_tensor(full, world_mesh, { Shard(1) }) }, dir2)
    local st2 = dist.sharded_tensor.zeros(spec, { 4, 7 })
    ckpt.load({ st = st2 }, dir2)
    for _, s in ipairs(st2:local_shards()) do
      local o, z = s.metadata.shard_offsets, s.metadata.shard_sizes
      assert.equal(0, diff(s.tensor, full:narrow(1, o[1] + 1, z[1]):narrow(2, o[2] + 1, z[2])))
    end
  end)
end)

describe("engine.load_safetensors and checkpoint reads (" .. W .. " ranks)", function()
  it("a safetensors file of full tensors loads into any layout; missing names are errors", function()
    local dir = newdir()
    local path = dir .. ".safetensors"
    local a, b = reference({ 5, 6 }, 21), reference({ 3 }, 22)
    if R == 0 then engine.save(path, { ["layer.w"] = a, ["layer.b"] = b }) end
    dist.barrier()
    local layouts = { { Shard(1) }, { Shard(2) }, { Replicate() } }
    for _, pl in ipairs(layouts) do
      local st = { layer = { w = dist.zeros({ 5, 6 }, { mesh = world_mesh, placements = pl }),
        b = engine.zeros({ 3 }, { dtype = "f64" }) } }
      engine.load_safetensors(path, st)
      assert.equal(0, diff(st.layer.w:full_tensor(), a))
      assert.is_true(diff(st.layer.b, b) < 1e-7)
    end
    local e = errmsg(engine.load_safetensors, path, { layer = { w = engine.zeros(5, 6), c = engine.zeros(1) } })
    assert.is_truthy(e:find("missing in the file: layer.c", 1, true) and e:find("not in the state: layer.b", 1, true), e)
    local st = { layer = { w = engine.zeros(5, 6) } }
    engine.load_safetensors(path, st, { strict = false })
    assert.equal(0, diff(st.layer.w, a))
    local e2 = errmsg(engine.load_safetensors, path, { layer = { w = engine.zeros(6, 5), b = engine.zeros(3) } })
    assert.is_truthy(e2:find("'layer.w' has shape [5,6] in the file and [6,5]", 1, true), e2)
  end)

  it("read_tensor / read_metadata give a checkpoint's full tensors and values on one rank", function()
    local dir = newdir()
    local full = reference({ 7, 2 }, 23)
    ckpt.save({ model = { w = dist.distribute_tensor(full, world_mesh, { Shard(1) }) }, step = 4 }, dir)
    local md = ckpt.read_metadata(dir)
    assert.equal(W, md.world_size)
    assert.same({ 7, 2 }, md.tensors["model.w"].shape)
    assert.equal("f32", md.tensors["model.w"].dtype)
    assert.equal(4, md.values.step)
    assert.equal(0, diff(ckpt.read_tensor(dir, "model.w"), full))
  end)

  it("chunk checksums are XXH64 of the bytes (format engine-dcp/3); engine-dcp/1 (FNV) still loads, others are refused", function()
    local ffi = require("ffi")
    local C = require("engine.core").C
    local dir = newdir()
    local full = reference({ 6, 5 }, 29)
    ckpt.save({ w = full:clone() }, dir)   -- a plain tensor: one chunk, the whole tensor, written once
    local _, meta = engine.load(dir .. "/.metadata")
    assert.equal("engine-dcp/3", meta.format)
    assert.equal("xxh64", meta.checksum)
    local head, file, off, nb, sum, tail = meta["t:w"]:match("^(f32|6,5|)(%d+):(%d+):(%d+):(%x+):(0,0:6,5)$")
    assert.is_truthy(head, meta["t:w"])
    assert.equal(bit.tohex(C.eng_xxh64(ffi.cast("const void*", full:data_ptr()), 120), 16), sum)
    -- the same checkpoint as engine-dcp/1 wrote it: FNV checksums (engine.tensor_checksum), no "checksum" key
    local function rewrite(m)
      dist.barrier()
      if R == 0 then engine.save(dir .. "/.metadata", {}, m) end
      dist.barrier()
    end
    local v1 = { format = "engine-dcp/1", id = meta.id, world_size = meta.world_size,
      ["t:w"] = table.concat({ head .. file, off, nb, engine.tensor_checksum(full), tail }, ":") }
    rewrite(v1)
    local back = { w = engine.zeros({ 6, 5 }) }
    ckpt.load(back, dir)
    assert.equal(0, diff(back.w, full))
    -- an engine-dcp/1 entry carrying the XXH64 value fails its (FNV) checksum
    v1["t:w"] = table.concat({ head .. file, off, nb, sum, tail }, ":")
    rewrite(v1)
    back = { w = engine.zeros({ 6, 5 }) }
    local e = errmsg(ckpt.load, back, dir)
    assert.is_truthy(e:find("fails its checksum", 1, true) and e:find(string.format("__%s_0.distcp", file), 1, true), e)
    assert.equal(0, back.w:abs():sum():item())
    -- an unknown checksum name, an unknown format: refused, naming them
    meta.checksum = "crc32"
    rewrite(meta)
    e = errmsg(ckpt.load, { w = engine.zeros({ 6, 5 }) }, dir)
    assert.is_truthy(e:find("unknown checksum 'crc32'", 1, true), e)
    meta.checksum, meta.format = "xxh64", "engine-dcp/9"
    rewrite(meta)
    e = errmsg(ckpt.load, { w = engine.zeros({ 6, 5 }) }, dir)
    assert.is_truthy(e:find("format engine-dcp/9", 1, true) and e:find(".metadata", 1, true), e)
  end)

  -- a value of the metadata (the step) changed on disk used to load silently
  it("the metadata is checksummed (meta_xxh64): a changed step fails every rank; engine-dcp/2 files still load", function()
    local dir = newdir()
    local full = reference({ 4, 3 }, 31)
    ckpt.save({ w = full:clone(), step = 15, opts = { lr = 0.5 } }, dir)
    local _, meta = engine.load(dir .. "/.metadata")
    assert.equal(engine.metadata_checksum(meta, "meta_xxh64"), meta.meta_xxh64)
    local function rewrite(m)
      dist.barrier()
      if R == 0 then engine.save(dir .. "/.metadata", {}, m) end
      dist.barrier()
    end
    local changed = {}
    for k, v in pairs(meta) do changed[k] = v end
    changed["v:step"] = changed["v:step"]:gsub("15", "16")
    assert.are_not.equal(meta["v:step"], changed["v:step"])
    rewrite(changed)
    local back = { w = engine.zeros({ 4, 3 }), step = 0, opts = { lr = 0 } }
    local e = errmsg(ckpt.load, back, dir)
    assert.is_truthy(e:find(".metadata' fails its checksum", 1, true), e)
    assert.equal(0, back.step)
    assert.equal(0, back.w:abs():sum():item())
    e = errmsg(ckpt.read_metadata, dir)
    assert.is_truthy(e:find("checkpoint.read_metadata", 1, true) and e:find("fails its checksum", 1, true), e)
    -- the same checkpoint as engine-dcp/2 wrote it (no meta_xxh64) loads, its step included
    changed.meta_xxh64, changed.format = nil, "engine-dcp/2"
    rewrite(changed)
    ckpt.load(back, dir)
    assert.equal(16, back.step)
    assert.equal(0, diff(back.w, full))
  end)

  it("the reader copies regions larger than its 4 MiB read buffer: strided, index by index, converted, direct", function()
    local ffi = require("ffi")
    local C = require("engine.core").C
    local dir = newdir()
    local a, b = reference({ 2048, 1024 }, 41), reference({ 3, 1100000 }, 43)   -- rows of 4 KiB; rows of 4.4 MB
    ckpt.save({ a = a, b = b }, dir)   -- plain tensors: each written once, by one rank
    local _, meta = engine.load(dir .. "/.metadata")
    local cases = {
      { "a", a, { 2048, 300 }, { 0, 500 } },            -- strided, a byte span of 8 MiB: parts of 1024 rows
      { "a", a, { 2048, 300 }, { 0, 500 }, "f64" },     -- the same, converted to f64
      { "a", a, { 1000, 1024 }, { 100, 0 } },           -- contiguous: read straight into out
      { "b", b, { 3, 1000000 }, { 0, 50000 } },         -- one row spans more than the buffer: row by row
      { "b", b, { 2, 7 }, { 1, 1099993 } },             -- a small region at the end of the chunk
    }
    for _, case in ipairs(cases) do
      local key, full, shape, offs, dtype = unpack(case)
      local c = ckpt._parse_entry(meta["t:" .. key], W, key, "spec").chunks[1]
      if c.file == R then
        local r = ffi.gc(C.eng_ckpt_reader_open(ckpt.data_file(dir, R), meta.id, 0, C.ENG_CHECKSUM_XXH64),
          C.eng_ckpt_reader_close)
        assert.equal(0, C.eng_ckpt_reader_verify(r, c.offset, c.nbytes, c.checksum))
        local out = engine.zeros(shape, { dtype = dtype or "f32" })
        local sz, so = ffi.new("int64_t[8]"), ffi.new("int64_t[8]")
        for d = 1, 2 do sz[d - 1], so[d - 1] = full:shape()[d], offs[d] end
        assert.equal(0, C.eng_ckpt_reader_copy(r, c.offset, C.eng_dtype_from_name("f32"), 2, sz, so, out._c))
        local want = full:narrow(1, offs[1] + 1, shape[1]):narrow(2, offs[2] + 1, shape[2])
        assert.equal(0, diff(out:float(), want), key .. " " .. table.concat(shape, "x"))
      end
    end
  end)

  it("reads of a checkpoint before the next save into its directory: the metadata stays until every rank saves", function()
    local dir = newdir()
    local a = reference({ 6, 4 }, 53)
    local t = dist.distribute_tensor(a, world_mesh, { Shard(1) })
    ckpt.save({ w = t }, dir)
    for i = 1, 3 do
      -- a load, then a local read (read_metadata, as latest() does) that the ranks other than 0 do late;
      -- rank 0 goes straight on to the next save
      local back = { w = dist.zeros({ 6, 4 }, { mesh = world_mesh, placements = { Replicate() } }) }
      ckpt.load(back, dir)
      assert.equal(0, diff(back.w:full_tensor(), a))
      if R ~= 0 then
        os.execute("sleep 0.05")
        assert.same({ 6, 4 }, ckpt.read_metadata(dir).tensors.w.shape)
      end
      ckpt.save({ w = t }, dir, { async = i == 2 }):wait()
    end
  end)

  it("a second save into the same directory replaces the first; a reader of the old files keeps them", function()
    local ffi = require("ffi")
    local C = require("engine.core").C
    local dir = newdir()
    local a, b = reference({ 8, 4 }, 31), reference({ 8, 4 }, 37)
    ckpt.save({ w = dist.distribute_tensor(a, world_mesh, { Shard(2) }) }, dir)
    local _, meta = engine.load(dir .. "/.metadata")
    local mine
    for _, c in ipairs(ckpt._parse_entry(meta["t:w"], W, "w", "spec").chunks) do
      if c.file == R then mine = c end
    end
    assert.is_truthy(mine)
    local r = ffi.gc(C.eng_ckpt_reader_open(ckpt.data_file(dir, R), meta.id, 0, C.ENG_CHECKSUM_XXH64),
      C.eng_ckpt_reader_close)
    assert.is_truthy(r ~= nil)
    ckpt.save({ w = dist.distribute_tensor(b, world_mesh, { Shard(2) }) }, dir)
    -- the old file, deleted and replaced, is intact and unchanged for its reader
    assert.equal(0, C.eng_ckpt_reader_verify(r, mine.offset, mine.nbytes, mine.checksum))
    assert.equal(0, C.eng_ckpt_reader_unchanged(r))
    C.eng_ckpt_reader_close(ffi.gc(r, nil))
    local back = { w = dist.zeros({ 8, 4 }, { mesh = world_mesh, placements = { Replicate() } }) }
    ckpt.load(back, dir)
    assert.equal(0, diff(back.w:full_tensor(), b))
  end)
end)

describe("dist.checkpoint state (" .. W .. " ranks)", function()
  teardown(function()
    dist.barrier()
    if R == 0 then os.execute("rm -rf '" .. root .. "'") end
  end)

  it("nested tables, values (numbers, strings, booleans, uint64, lists) come back; replicas are written once", function()
    local dir = newdir()
    local w = dist.distribute_tensor(reference({ 4, 4 }, 1), world_mesh, { Replicate() })
    local state = { model = { w = w, b = engine.ones(3) }, step = 12, name = "run \"a\"\n", ok = true,
      rng = { seed = 0xFFFFFFFFFFFFFFFFULL, offset = 5 }, lr = 1 / 3, list = { 1, 2, { x = -0.5 } } }
    ckpt.save(state, dir)
    -- one copy of w and b in all the files together (replicated: written by one rank each)
    local data_bytes = 0
    for r = 0, W - 1 do
      local f = io.open(string.format("%s/__%d_0.distcp", dir, r), "rb")
      data_bytes = data_bytes + f:seek("end") - 64
      f:close()
    end
    assert.equal(16 * 4 + 3 * 4, data_bytes)
    local back = { model = { w = dist.zeros({ 4, 4 }, { mesh = world_mesh, placements = { Shard(1) } }),
      b = engine.zeros(3) }, step = 0, name = "", ok = false, rng = {}, lr = 0, list = {} }
    ckpt.load(back, dir)
    assert.equal(12, back.step)
    assert.equal("run \"a\"\n", back.name)
    assert.is_true(back.ok)
    assert.equal(1 / 3, back.lr)
    assert.is_true(back.rng.seed == 0xFFFFFFFFFFFFFFFFULL)
    assert.equal(5, back.rng.offset)
    assert.same({ 1, 2, { x = -0.5 } }, back.list)
    assert.equal(0, diff(back.model.w:full_tensor(), reference({ 4, 4 }, 1)))
    assert.equal(0, diff(back.model.b, engine.ones(3)))
  end)

  it("values that differ across ranks: rank 0's are saved, unchecked (PyTorch's DCP writes one rank's bytes)", function()
    local dir = newdir()
    ckpt.save({ x = engine.ones(2), rank = R, tag = { "r" .. R } }, dir)
    local back = { x = engine.zeros(2), rank = -1, tag = {} }
    ckpt.load(back, dir)
    assert.equal(0, back.rank)
    assert.same({ "r0" }, back.tag)
  end)

  it("keys missing on either side are errors naming them; strict = false loads the common keys", function()
    local dir = newdir()
    ckpt.save({ a = engine.ones(2), n = 1, sub = { c = engine.ones(1) } }, dir)
    local st = { a = engine.zeros(2), m = 2, sub = { c = engine.zeros(1), d = engine.zeros(1) } }
    local e = errmsg(ckpt.load, st, dir)
    assert.is_truthy(e:find("missing in the checkpoint: m, sub.d", 1, true), e)
    assert.is_truthy(e:find("in the checkpoint but not in the state: n", 1, true), e)
    assert.equal(0, st.a:sum():item())   -- nothing loaded
    ckpt.load(st, dir, { strict = false })
    assert.equal(2, st.a:sum():item())
    assert.equal(1, st.sub.c:item())
    assert.equal(2, st.m)
    local e2 = errmsg(ckpt.load, { a = engine.zeros(3), n = 0, sub = { c = engine.zeros(1) } }, dir)
    assert.is_truthy(e2:find("'a' has shape [2] in the checkpoint and [3] in the state", 1, true), e2)
  end)

  it("Partial DTensors are an error on every rank, before anything is written", function()
    local p = dist.DTensor.from_local(engine.ones(2, 2), world_mesh, { dist.Partial() })
    local dir = newdir()
    local e = errmsg(ckpt.save, { p = p, q = engine.ones(1) }, dir)
    assert.is_truthy(e:find("not supported for DTensor with partial placements!", 1, true) and e:find("'p'", 1, true), e)
    local f = io.open(dir .. "/.metadata", "rb")
    assert.is_nil(f)
    -- into a directory that holds a checkpoint: the failed save leaves it whole, and a bad value on one rank
    -- only fails every rank the same way
    local good = reference({ 4, 6 }, 5)
    ckpt.save({ q = dist.distribute_tensor(good, world_mesh, { Shard(2) }) }, dir)
    e = errmsg(ckpt.save, { q = R == W - 1 and p or engine.ones(4, 6) }, dir)
    assert.is_truthy(e:find("checkpoint.save", 1, true), e)
    local back = { q = dist.zeros({ 4, 6 }, { mesh = world_mesh, placements = { Replicate() } }) }
    ckpt.load(back, dir)
    assert.equal(0, diff(back.q:full_tensor(), good))
  end)

  it("an async save equals a sync save; training may change the tensors after save returns", function()
    local full = reference({ 8, 6 }, 11)
    local t = dist.distribute_tensor(full, world_mesh, { Shard(1) })
    local d1, d2 = newdir(), newdir()
    ckpt.save({ t = t, step = 3 }, d1)
    local h = ckpt.save({ t = t, step = 3 }, d2, { async = true })
    engine.no_grad(function() t:to_local():fill_(-1) end)   -- after the staging copy
    h:wait()
    assert.is_true(h:is_completed())
    for _, d in ipairs({ d1, d2 }) do
      local back = { t = dist.zeros({ 8, 6 }, { mesh = world_mesh, placements = { Shard(2) } }), step = 0 }
      ckpt.load(back, d)
      assert.equal(0, diff(back.t:full_tensor(), full))
      assert.equal(3, back.step)
    end
    -- staging copies of large chunks stream past the cache: odd sizes, sources at unaligned offsets
    engine.manual_seed(12)
    local base = engine.randn(300007)
    local big = { a = base:narrow(1, 2, 300005), b = dist.distribute_tensor(engine.randn(7, 40003), world_mesh, { Shard(1) }) }
    local want_a, want_b = big.a:clone(), big.b:full_tensor():clone()
    local d3 = newdir()
    local hb = ckpt.save(big, d3, { async = true })
    engine.no_grad(function() base:fill_(0); big.b:to_local():fill_(0) end)
    hb:wait()
    local back = { a = engine.zeros(300005), b = dist.zeros({ 7, 40003 }, { mesh = world_mesh, placements = { Replicate() } }) }
    ckpt.load(back, d3)
    assert.equal(0, diff(back.a, want_a))
    assert.equal(0, diff(back.b:full_tensor(), want_b))
    -- a second async save waits for the first; wait is idempotent
    local h1 = ckpt.save({ t = t }, newdir(), { async = true })
    local h2 = ckpt.save({ t = t }, newdir(), { async = true })
    assert.is_true(h1:is_completed())
    h2:wait(); h2:wait()
  end)

  it("a repeated save reuses the choice of writers (nothing gathered); a changed layout or a rank without it chooses again", function()
    local a, b = reference({ 6, 4 }, 41), reference({ 5, 3 }, 43)
    local function state(pl_a)
      return { a = dist.distribute_tensor(a, world_mesh, pl_a), b = b:clone(), n = 1 }
    end
    -- bytes in all the data files together: each box once (replicas deduplicated)
    local function data_bytes(dir)
      local n = 0
      for r = 0, W - 1 do
        local f = assert(io.open(ckpt.data_file(dir, r), "rb"))
        n = n + f:seek("end") - 64
        f:close()
      end
      return n
    end
    local function check(dir, want_bytes)
      assert.equal(want_bytes, data_bytes(dir))
      local back = { a = dist.zeros({ 6, 4 }, { mesh = world_mesh, placements = { Shard(1) } }), b = engine.zeros({ 5, 3 }), n = 0 }
      ckpt.load(back, dir)
      assert.equal(0, diff(back.a:full_tensor(), a))
      assert.equal(0, diff(back.b, b))
    end
    local function gathers(pl_a, dir)
      local counts = dist.count_collectives(function() ckpt.save(state(pl_a), dir) end)
      return (counts.all_gather or 0)
    end
    local rep, sh = { Replicate() }, { Shard(1) }
    local full = (6 * 4 + 5 * 3) * 4
    local d = { newdir(), newdir(), newdir(), newdir(), newdir() }
    ckpt._drop_plan_cache()
    -- the first save gathers the plans (W > 1) and the metadata records; the same layout again: the records only
    local first = gathers(rep, d[1])
    assert.equal(W > 1 and 2 or 0, first)
    assert.equal(W > 1 and 1 or 0, gathers(rep, d[2]))
    check(d[1], full)
    check(d[2], full)
    -- a tensor's placements change: its boxes change, the writers are chosen again
    assert.equal(W > 1 and 2 or 0, gathers(sh, d[3]))
    check(d[3], full)
    -- one rank has no cached choice: every rank chooses again, no hang
    if R == W - 1 then ckpt._drop_plan_cache() end
    assert.equal(W > 1 and 2 or 0, gathers(sh, d[4]))
    check(d[4], full)
    -- and async saves use it too
    local h = ckpt.save(state(sh), d[5], { async = true })
    h:wait()
    check(d[5], full)
  end)

  it("optimizer state keyed by parameter names round-trips into a fresh optimizer", function()
    local nn, optim = engine.nn, engine.optim
    engine.manual_seed(2)
    local m = nn.Linear(4, 3)
    local opt = optim.AdamW(m:parameters(), { lr = 0.01 })
    local x = engine.randn(5, 4)
    m(x):sum():backward(); opt:step(); opt:zero_grad()
    local dir = newdir()
    ckpt.save({ model = m:state_dict(), optim = ckpt.get_optimizer_state_dict(m, opt) }, dir)
    engine.manual_seed(9)
    local m2 = nn.Linear(4, 3)
    local opt2 = optim.AdamW(m2:parameters(), { lr = 0.5 })
    local sd = { model = m2:state_dict(), optim = ckpt.get_optimizer_state_dict(m2, opt2) }
    assert.is_truthy(sd.optim.state["weight"].exp_avg)
    ckpt.load(sd, dir)
    ckpt.set_optimizer_state_dict(m2, opt2, sd.optim)
    assert.equal(0.01, opt2.param_groups[1].lr)
    assert.equal(1, opt2.state[m2.weight].step:item())
    m(x):sum():backward(); opt:step()
    m2(x):sum():backward(); opt2:step()
    assert.equal(0, diff(m.weight, m2.weight))
    assert.equal(0, diff(opt.state[m.bias].exp_avg_sq, opt2.state[m2.bias].exp_avg_sq))
  end)
end)

