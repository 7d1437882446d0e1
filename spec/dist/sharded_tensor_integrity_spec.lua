-- ShardedTensor results that were silently wrong: allclose was true for NaN against anything
-- and for +inf against -inf (now torch.allclose's rule, equal_nan included), and dist.sharded_tensor.save files
-- carried no checksum, so a flipped byte loaded (now XXH64 per tensor and per ShardedTensor record, as
-- dist.checkpoint's chunks; load fails on every rank of the group, naming the file and what is corrupt).
-- 1, 2 and 4 ranks.
local engine = require("engine")
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local W, R = dist.world_size(), dist.rank()
local sharded = require("spec.dist.helpers.sharded")
local chunk, all_ranks = sharded.chunk, sharded.all_ranks

local INF, NAN = math.huge, 0 / 0

-- the same full tensor on every rank, sharded as chunk(1) over the world
local function st_of(values)
  return dist.shard_tensor(engine.tensor(values, "f32"):view(#values, 1):expand(#values, 2):contiguous(), chunk(1))
end

describe("ShardedTensor:allclose follows torch.allclose", function()
  -- {a, b, torch.allclose(a, b), torch.allclose(a, b, equal_nan=True)}: every rank holds element i of the rows
  local cases = {
    { { 1, 2 }, { 1, 2 }, true, true },
    { { 1, NAN }, { 1, 5 }, false, false },            -- NaN against a number
    { { 1, 5 }, { 1, NAN }, false, false },
    { { 1, NAN }, { 1, NAN }, false, true },           -- NaN against NaN: only with equal_nan
    { { 1, INF }, { 1, -INF }, false, false },         -- +inf against -inf
    { { 1, INF }, { 1, INF }, true, true },            -- equal infinities
    { { -INF, 1 }, { -INF, 1 }, true, true },
    { { 1, INF }, { 1, 1e30 }, false, false },         -- inf against a finite value
    { { 1, 1e30 }, { 1, INF }, false, false },         -- (atol + rtol * inf is inf: still not close)
    { { 1, 1 + 1e-7 }, { 1, 1 }, true, true },         -- within rtol
    { { 1, 1.01 }, { 1, 1 }, false, false },
  }
  it("NaN is close to nothing (to NaN with equal_nan), +inf not to -inf nor to a finite value", function()
    for i, c in ipairs(cases) do
      local rows_a, rows_b = {}, {}
      -- 2 * W rows so that every rank holds one of the interesting elements
      for r = 1, 2 * W do rows_a[r] = c[1][(r - 1) % 2 + 1]; rows_b[r] = c[2][(r - 1) % 2 + 1] end
      local a, b = st_of(rows_a), st_of(rows_b)
      assert.are.equal(c[3], a:allclose(b), "case " .. i)
      assert.are.equal(c[4], a:allclose(b, 1e-5, 1e-8, true), "case " .. i .. " with equal_nan")
    end
  end)

  it("a NaN on one rank only makes allclose false on every rank", function()
    local rows = {}
    for r = 1, 2 * W do rows[r] = r end
    local a = st_of(rows)
    local b = st_of(rows)
    if R == W - 1 then b:local_shards()[1].tensor:fill_(NAN) end
    assert.is_false(a:allclose(b))
    assert.is_false(a:equal(b))
    assert.is_true(a:allclose(a))
  end)

  it("rtol, atol and equal_nan are checked", function()
    local a = st_of({ 1, 2 })
    local e = util.errmsg(function() return a:allclose(a, NAN) end)
    assert.is_truthy(e:find("allclose: rtol must be a number", 1, true), e)
    e = util.errmsg(function() return a:allclose(a, 1e-5, "x") end)
    assert.is_truthy(e:find("allclose: atol must be a number", 1, true), e)
    e = util.errmsg(function() return a:allclose(a, 1e-5, 1e-8, 1) end)
    assert.is_truthy(e:find("allclose: equal_nan must be a boolean", 1, true), e)
  end)
end)

-- a directory name shared by the ranks of this run
local function shared_base()
  local t = engine.tensor({ os.time() % 100000, math.floor(os.clock() * 1e6) % 100000 }, "i64")
  dist.broadcast(t, 0)
  local v = t:totable()
  return string.format("/tmp/engine_st_integrity_%d_%d_w%d", v[1], v[2], W)
end

local function read_all(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end
local function write_all(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end
-- the file with byte at (1-based) pos changed
local function flip(path, pos)
  local s = read_all(path)
  write_all(path, s:sub(1, pos - 1) .. string.char(bit.bxor(s:byte(pos), 0x10)) .. s:sub(pos + 1))
end

describe("dist.sharded_tensor.save checksums", function()
  local base = shared_base()
  local path = base .. "_rank{rank}.safetensors"
  local mine = base .. "_rank" .. R .. ".safetensors"
  local last = base .. "_rank" .. (W - 1) .. ".safetensors"
  teardown(function()
    dist.barrier()
    os.remove(mine)
  end)

  local function state()
    engine.manual_seed(5)
    local full = engine.randn(4 * W, 3)
    dist.broadcast(full, 0)
    return { w = dist.shard_tensor(full, chunk(1)), two = dist.shard_tensor(full, chunk(1, all_ranks(2))),
      plain = engine.arange(6, { dtype = "f64" }) }, full
  end

  it("the file has XXH64 checksums for every tensor and record; it loads back", function()
    local sd, full = state()
    dist.sharded_tensor.save(path, sd)
    local t, meta = engine.load(mine)
    assert.are.equal("engine-sharded-state/2", meta.format)
    assert.are.equal("xxh64", meta.checksum)
    for name in pairs(t) do assert.is_truthy(meta["xxh64:t:" .. name]:match("^%x+$"), name) end
    assert.is_truthy(meta["xxh64:m:sharded:w"])
    assert.is_truthy(meta["xxh64:m:sharded:two"])
    local back = dist.sharded_tensor.load(path)
    assert.is_true(back.w:equal(sd.w))
    assert.is_true(back.two:equal(sd.two))
    assert.are.equal(0, util.diff(back.plain, sd.plain))
    assert.are.equal(0, util.diff(back.w:gather(0) or full, full))
  end)

  it("a flipped byte of a tensor fails the load on every rank, naming the file and the tensor", function()
    local sd = state()
    dist.sharded_tensor.save(path, sd)
    dist.barrier()
    if R == W - 1 then
      local s = read_all(last)
      flip(last, #s - 3)     -- inside the last tensor's bytes
    end
    dist.barrier()
    local e = util.errmsg(dist.sharded_tensor.load, path)
    assert.is_truthy(e:find("sharded_tensor.load", 1, true), e)
    assert.is_truthy(e:find("fails its checksum", 1, true), e)
    assert.is_truthy(e:find(last, 1, true), e)
    assert.is_truthy(e:find("the file is corrupt", 1, true), e)
  end)

  it("a changed ShardedTensor record fails the load, naming the record", function()
    local sd = state()
    dist.sharded_tensor.save(path, sd)
    dist.barrier()
    if R == W - 1 then
      -- the record's text as the file holds it: change one digit of the global size ("|4W,3|" -> "|4W,2|")
      local s = read_all(last)
      local i = s:find("|" .. (4 * W) .. ",3|", 1, true)
      assert(i, "record not found")
      local j = i + #tostring(4 * W) + 2
      write_all(last, s:sub(1, j - 1) .. "2" .. s:sub(j + 1))
    end
    dist.barrier()
    local e = util.errmsg(dist.sharded_tensor.load, path)
    assert.is_truthy(e:find("fails its checksum", 1, true), e)
    assert.is_truthy(e:find("sharded:", 1, true), e)
  end)

  it("a removed checksum entry is an error; a file of the older format (no checksums) still loads", function()
    local sd = state()
    dist.sharded_tensor.save(path, sd)
    local t, meta = engine.load(mine)
    meta["xxh64:t:plain"] = nil
    engine.save(mine, t, meta)
    local e = util.errmsg(dist.sharded_tensor.load, path)
    assert.is_truthy(e:find("tensor 'plain' has no checksum", 1, true), e)
    -- format /1: what earlier engines wrote
    local old = {}
    for k, v in pairs(meta) do if not k:match("^xxh64:") and k ~= "checksum" then old[k] = v end end
    old.format = "engine-sharded-state/1"
    engine.save(mine, t, old)
    local back = dist.sharded_tensor.load(path)
    assert.is_true(back.w:equal(sd.w))
  end)
end)
