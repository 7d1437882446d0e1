-- data: byte tokenizer, llm.c token shards (format, validation), the seeded
-- batch sampler (determinism, resume, ranks) and the sequential val loader.
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local ffi = require("ffi")
local data = engine.data

local err = require("spec.helpers.errors").err -- err(fn, ...): fn raises, naming each string

local tmpfiles = {}
local function tmp()
  local p = os.tmpname()
  tmpfiles[#tmpfiles + 1] = p
  return p
end
local function write_raw(path, bytes)
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
end
local function read_raw(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end
local function header(magic, version, n, vocab)
  local h = ffi.new("int32_t[256]")
  h[0], h[1], h[2], h[3] = magic, version, n, vocab or 0
  return ffi.string(h, 1024)
end

teardown(function() for _, p in ipairs(tmpfiles) do os.remove(p) end end)

describe("data.ByteTokenizer", function()
  it("round-trips every byte value", function()
    local chars = {}
    for b = 0, 255 do chars[#chars + 1] = string.char(b) end
    local s = table.concat(chars) .. "Hello, world!\n"
    local tok = data.ByteTokenizer()
    local ids = tok:encode(s)
    assert.are.equal(#s, #ids)
    assert.are.equal(0, ids[1])
    assert.are.equal(255, ids[256])
    assert.are.equal(72, ids[257])
    assert.are.equal(s, tok:decode(ids))
    assert.are.equal(256, tok.vocab_size)
    local t = data.encode(s, { tensor = true })
    assert.are.equal("i64", t.dtype)
    assert.are.same({ #s }, t:shape())
    assert.are.equal(s, data.decode(t))
    assert.are.equal("", data.decode({}))
    assert.are.same({}, data.encode(""))
  end)

  it("rejects ids that are not bytes", function()
    err(function() data.decode({ 104, 300 }) end, "token 300 at position 2 is not a byte value (0..255)")
    err(function() data.decode({ -1 }) end, "token -1 at position 1")
    err(function() data.decode(engine.tensor({ 1, 256 })) end, "token 256 at position 2")
    err(function() data.encode(5) end, "encode: expected a string")
    err(function() data.decode("abc") end, "decode: expected a list of token ids or a tensor")
  end)
end)

describe("data shards", function()
  it("write and read round-trip in llm.c's format", function()
    local path = tmp()
    local toks = { 0, 1, 255, 256, 1000, 65535, 42 }
    assert.are.equal(7, data.write_shard(path, toks))
    local raw = read_raw(path)
    assert.are.equal(1024 + 14, #raw)
    local h = ffi.new("int32_t[3]")
    ffi.copy(h, raw, 12)
    assert.are.same({ 20240520, 1, 7 }, { h[0], h[1], h[2] })
    local u = ffi.new("uint16_t[1]")
    ffi.copy(u, raw:sub(1024 + 11, 1024 + 12), 2)
    assert.are.equal(65535, u[0])
    local s = data.read_shard(path)
    assert.are.equal(7, s.n)
    assert.are.equal(7, s:size())
    assert.are.equal(65535, s:get(5))
    local t = s:tensor()
    assert.are.same(toks, t:tolist())
    assert.are.same({ 256, 1000 }, s:tensor(3, 2):tolist())
    assert.is_truthy(tostring(s):find("7 tokens", 1, true))
    err(function() s:get(7) end, "index 7 out of range [0, 7)")
    err(function() s:tensor(5, 3) end, "range [5, 8) out of [0, 7)")
  end)

  it("writes from tensors and reads several shards", function()
    local p1, p2 = tmp(), tmp()
    data.write_shard(p1, engine.tensor({ { 1, 2 }, { 3, 4 } }))
    data.write_shard(p2, data.encode("xyz", { tensor = true }))
    local ss = data.read_shards({ p1, p2 })
    assert.are.same({ 1, 2, 3, 4 }, ss[1]:tensor():tolist())
    assert.are.equal("xyz", data.decode(ss[2]:tensor()))
    local empty = tmp()
    data.write_shard(empty, {})
    assert.are.equal(0, data.read_shard(empty).n)
  end)

  it("writes uint32 shards (llm.c's Llama 3 format) when an id exceeds 65535", function()
    local path = tmp()
    assert.are.equal(3, data.write_shard(path, { 1, 70000, 128255 }))
    local raw = read_raw(path)
    assert.are.equal(1024 + 12, #raw)
    local h = ffi.new("int32_t[4]")
    ffi.copy(h, raw, 16)
    assert.are.same({ 20240801, 7, 3, 0 }, { h[0], h[1], h[2], h[3] })
    local s = data.read_shard(path)
    assert.are.same({ 1, 70000, 128255 }, s:tensor():tolist())
    assert.are.same({ 4, 7, 128255 }, { s.token_bytes, s.version, s.max_id })
    assert.is_nil(s.vocab_size)
    -- a vocab_size over 65536 makes every shard of a data set uint32, whatever its ids
    data.write_shard(path, { 5, 6 }, { vocab_size = 100000 })
    assert.are.same({ 4, 100000 }, { data.read_shard(path).token_bytes, data.read_shard(path).vocab_size })
  end)

  it("records the vocabulary size in header slot 3 and checks ids against it", function()
    local path = tmp()
    data.write_shard(path, { 0, 4095, 7 }, { vocab_size = 4096 })
    local raw = read_raw(path)
    local h = ffi.new("int32_t[4]")
    ffi.copy(h, raw, 16)
    assert.are.same({ 20240520, 1, 3, 4096 }, { h[0], h[1], h[2], h[3] })
    assert.are.equal(1024 + 6, #raw)
    local info = data.shard_info(path)
    assert.are.same({ path = path, tokens = 3, magic = 20240520, version = 1, token_bytes = 2, vocab_size = 4096 },
      info)
    assert.are.equal(4095, data.shard_info(path, { scan = true }).max_id)
    assert.are.equal(4096, data.read_shard(path).vocab_size)
    assert.is_truthy(tostring(data.read_shard(path)):find("vocab 4096", 1, true))
    err(function() data.write_shard(tmp(), { 1, 4096 }, { vocab_size = 4096 }) end,
      "token 4096 at index 1 is not an id in 0..4095 (vocab_size 4096)")
    err(function() data.write_shard(tmp(), { 1 }, { vocab = 4096 }) end, "write_shard: unknown option 'vocab'")
    err(function() data.write_shard(tmp(), { 1 }, { vocab_size = 0 }) end, "vocab_size must be an integer")
    err(function() data.shard_info(path, { scna = true }) end, "shard_info: unknown option 'scna'")
    -- an id at or past the header's vocabulary size is a corrupt shard
    write_raw(path, header(20240520, 1, 2, 10) .. "\3\0\12\0")
    err(function() data.read_shard(path) end, path, "token 12 at index 1 is not below the vocabulary size 10")
    err(function() data.shard_info(path, { scan = true }) end, "shard_info: " .. path, "token 12")
    assert.are.equal(10, data.shard_info(path).vocab_size)
    write_raw(path, header(20240520, 1, 0, -1))
    err(function() data.shard_info(path) end, "shard_info: " .. path, "vocabulary size (slot 3) is -1")
    -- the byte-level shards keep slot 3 at 0 (unknown): the files stay as before
    data.write_shard(path, data.encode("abc"))
    assert.is_nil(data.shard_info(path).vocab_size)
  end)

  it("refuses ids that are not non-negative integers", function()
    err(function() data.write_shard(tmp(), { 1, 2 ^ 31 }) end, "token 2147483648 at index 1 is not an id")
    err(function() data.write_shard(tmp(), { -3 }) end, "token -3 at index 0")
    err(function() data.write_shard(tmp(), { 1.5 }) end, "token 1.5")
    err(function() data.write_shard("/nonexistent-dir/x.bin", { 1 }) end, "cannot open /nonexistent-dir/x.bin")
  end)

  it("reads several shards from a glob or a list, in sorted order", function()
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir -p '" .. dir .. "'"))
    finally(function() os.execute("rm -rf '" .. dir .. "'") end)
    data.write_shard(dir .. "/x_train_000002.bin", { 5, 6, 7 }, { vocab_size = 50 })
    data.write_shard(dir .. "/x_train_000001.bin", { 1, 2 }, { vocab_size = 50 })
    data.write_shard(dir .. "/x_train_000010.bin", { 9 }, { vocab_size = 50 })
    data.write_shard(dir .. "/x_val_000000.bin", { 0 })
    local ss = data.read_shards(dir .. "/x_train_*.bin")
    assert.are.equal(3, #ss)
    assert.are.same({ dir .. "/x_train_000001.bin", dir .. "/x_train_000002.bin", dir .. "/x_train_000010.bin" },
      ss.paths)
    assert.are.same({ 6, 50 }, { ss.n, ss.vocab_size })
    assert.are.same({ 5, 6, 7 }, ss[2]:tensor():tolist())
    assert.are.same(ss.paths, data.read_shards(dir .. "/x_train_0000[01][0-9].bin").paths)
    assert.are.same({ ss.paths[3] }, data.read_shards(dir .. "/x_train_0000?0.bin").paths)
    -- a list keeps its order; its globs are expanded in place
    local l = data.read_shards({ dir .. "/x_val_000000.bin", dir .. "/x_train_*.bin" })
    assert.are.same({ 0, 1, 5, 9 }, { l[1]:get(0), l[2]:get(0), l[3]:get(0), l[4]:get(0) })
    assert.are.equal(50, l.vocab_size)
    err(function() data.read_shards(dir .. "/y_*.bin") end, "read_shards: the pattern " .. dir .. "/y_*.bin matches no file")
    err(function() data.read_shards({}) end, "read_shards: expected a path, a glob pattern or a non-empty list")
    err(function() data.read_shards(dir .. "/*/x.bin") end, "wildcards are supported in the file name only")
    data.write_shard(dir .. "/x_train_000003.bin", { 1 }, { vocab_size = 60 })
    err(function() data.read_shards(dir .. "/x_train_*.bin") end, "x_train_000002.bin has vocabulary size 50 but",
      "x_train_000003.bin has 60")
  end)

  it("names the file and the problem for corrupt shards", function()
    local p = tmp()
    write_raw(p, header(12345, 1, 2) .. "\0\0\0\0")
    err(function() data.read_shard(p) end, p, "bad magic number 12345 (expected 20240520 for uint16 tokens or 20240801")
    write_raw(p, header(20240520, 2, 2) .. "\0\0\0\0")
    err(function() data.read_shard(p) end, p, "unsupported version 2 for magic 20240520 (expected 1")
    write_raw(p, header(20240801, 1, 1) .. "\0\0\0\0")
    err(function() data.read_shard(p) end, p, "unsupported version 1 for magic 20240801 (expected 7")
    write_raw(p, header(20240801, 7, 2) .. "\0\0\0\0")
    err(function() data.read_shard(p) end, p, "the header says 2 tokens (1032 bytes expected) but the file has 1028")
    write_raw(p, header(20240520, 1, 5) .. "\0\0\0\0")
    err(function() data.read_shard(p) end, p, "the header says 5 tokens (1034 bytes expected) but the file has 1028 bytes",
      "truncated or corrupt")
    write_raw(p, header(20240520, 1, 1) .. "\0\0\0\0")
    err(function() data.read_shard(p) end, "the file has 1028 bytes")
    write_raw(p, "short")
    err(function() data.read_shard(p) end, p, "file has 5 bytes, less than the 1024-byte header")
    err(function() data.read_shard("/nonexistent/file.bin") end, "cannot open /nonexistent/file.bin")
  end)
end)

describe("data.BatchSampler", function()
  local function toks(n, base)
    local t = {}
    for i = 1, n do t[i] = base + i - 1 end
    return t
  end

  it("draws windows of seq_len + 1 tokens: y is x shifted by one", function()
    local s = data.BatchSampler(toks(100, 0), { batch_size = 4, seq_len = 8, seed = 1 })
    local x, y = s:next()
    assert.are.same({ 4, 8 }, x:shape())
    assert.are.equal("i64", x.dtype)
    local xv, yv = x:tolist(), y:tolist()
    for b = 1, 4 do
      for t = 1, 8 do
        assert.are.equal(xv[b][1] + t - 1, xv[b][t])   -- consecutive tokens
        assert.are.equal(xv[b][t] + 1, yv[b][t])
      end
      assert.is_true(xv[b][1] >= 0 and yv[b][8] <= 99)
    end
  end)

  it("is reproducible from (seed, position) and resumes exactly", function()
    local src = toks(1000, 0)
    local a = data.BatchSampler(src, { batch_size = 3, seq_len = 5, seed = 7 })
    local b = data.BatchSampler(src, { batch_size = 3, seq_len = 5, seed = 7 })
    local c = data.BatchSampler(src, { batch_size = 3, seq_len = 5, seed = 8 })
    local xs = {}
    for k = 1, 6 do
      local xa = a:next()
      local xb = b:next()
      xs[k] = xa:tolist()
      assert.are.same(xs[k], xb:tolist())
    end
    local differs = false
    for k = 1, 6 do
      local xc = c:next():tolist()
      if xc[1][1] ~= xs[k][1][1] then differs = true end
    end
    assert.is_true(differs, "another seed gives other batches")
    assert.are.same(xs[4], a:batch(3):tolist())
    assert.are.same({ seed = 7, position = 6 }, a:state())
    local r = data.BatchSampler(src, { batch_size = 3, seq_len = 5, seed = 7 })
    r:set_state({ seed = 7, position = 2 })
    for k = 3, 6 do assert.are.same(xs[k], r:next():tolist()) end
    err(function() r:set_state({ seed = 9, position = 1 }) end, "the state is for seed 9, this sampler has seed 7")
    err(function() r:set_state({ position = -1 }) end, "expected {position = n")
  end)

  it("gives each rank its own stream", function()
    local src = toks(5000, 0)
    local r0 = data.BatchSampler(src, { batch_size = 4, seq_len = 4, seed = 3, rank = 0, world_size = 2 })
    local r1 = data.BatchSampler(src, { batch_size = 4, seq_len = 4, seed = 3, rank = 1, world_size = 2 })
    local one = data.BatchSampler(src, { batch_size = 4, seq_len = 4, seed = 3 })
    assert.are_not.same(r0:next():tolist(), r1:next():tolist())
    -- world_size 2: rank r's batch k is the single-rank stream's batch 2k + r
    assert.are.same(one:batch(4):tolist(), r0:batch(2):tolist())
    assert.are.same(one:batch(5):tolist(), r1:batch(2):tolist())
  end)

  it("never crosses a shard boundary and covers every shard", function()
    local p1, p2, p3 = tmp(), tmp(), tmp()
    data.write_shard(p1, toks(50, 0))
    data.write_shard(p2, toks(3, 1000))     -- too short for a window: never used
    data.write_shard(p3, toks(50, 2000))
    local s = data.BatchSampler(data.read_shards({ p1, p2, p3 }), { batch_size = 16, seq_len = 6, seed = 0 })
    local seen = { [0] = 0, [2000] = 0 }
    for _ = 1, 10 do
      local x, y = s:next()
      local xv, yv = x:tolist(), y:tolist()
      for b = 1, 16 do
        local base = xv[b][1] >= 2000 and 2000 or 0
        seen[base] = seen[base] + 1
        assert.is_true(yv[b][6] < base + 50, "window leaves its shard")
        assert.are.equal(xv[b][1] + 6, yv[b][6])
      end
    end
    assert.is_true(seen[0] > 30 and seen[2000] > 30)
  end)

  it("reads a glob of shards (uint16 and uint32 mixed) and resumes exactly across them", function()
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir -p '" .. dir .. "'"))
    finally(function() os.execute("rm -rf '" .. dir .. "'") end)
    data.write_shard(dir .. "/d_train_2.bin", toks(300, 100000))      -- ids past 65535: a uint32 shard
    data.write_shard(dir .. "/d_train_1.bin", toks(200, 0))
    data.write_shard(dir .. "/d_train_3.bin", toks(100, 5000))
    local opts = { batch_size = 4, seq_len = 6, seed = 3 }
    local g = data.BatchSampler(dir .. "/d_train_*.bin", opts)
    local l = data.BatchSampler(data.read_shards({ dir .. "/d_train_1.bin", dir .. "/d_train_2.bin",
      dir .. "/d_train_3.bin" }), opts)
    assert.are.equal(200 - 6 + 300 - 6 + 100 - 6, g.total)
    local xs, seen = {}, {}
    for k = 1, 12 do
      local x, y = g:next()
      xs[k] = x:tolist()
      assert.are.same(xs[k], l:next():tolist())
      for _, row in ipairs(xs[k]) do
        local base = row[1] >= 100000 and 100000 or row[1] >= 5000 and 5000 or 0
        seen[base] = true
        assert.are.equal(row[1] + 5, row[6], "a window stays in its shard")
      end
      assert.are.equal(xs[k][1][2], y:tolist()[1][1])
    end
    assert.is_true(seen[0] and seen[5000] and seen[100000])
    local r = data.BatchSampler(dir .. "/d_train_*.bin", opts)
    r:set_state({ seed = 3, position = 7 })
    for k = 8, 12 do assert.are.same(xs[k], r:next():tolist()) end
    local v = data.ValLoader(dir .. "/d_train_*.bin", { batch_size = 2, seq_len = 4 })
    assert.are.same({ { 0, 1, 2, 3 }, { 4, 5, 6, 7 } }, v:next():tolist())
    err(function() data.ValLoader(dir .. "/e_*.bin", { batch_size = 2, seq_len = 4 }) end,
      "ValLoader: the pattern " .. dir .. "/e_*.bin matches no file")
  end)

  it("accepts tensors and validates its options", function()
    local s = data.BatchSampler(engine.arange(0, 20), { batch_size = 2, seq_len = 19 })
    local x, y = s:next()
    assert.are.same({ { 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18 },
      { 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18 } }, x:tolist())
    assert.are.equal(19, y:tolist()[1][19])
    err(function() data.BatchSampler(toks(10, 0), { batch_size = 2, seq_len = 10 }) end,
      "no shard has at least seq_len + 1 = 11 tokens")
    err(function() data.BatchSampler(toks(10, 0), { batch_size = 0, seq_len = 2 }) end, "batch_size must be an integer >= 1")
    err(function() data.BatchSampler(toks(10, 0), { batch_size = 1 }) end, "seq_len must be an integer >= 1")
    err(function() data.BatchSampler(toks(10, 0), { batch_size = 1, seq_len = 2, rank = 2, world_size = 2 }) end,
      "rank 2 must be < world_size 2")
    err(function() data.BatchSampler(engine.ones(10), { batch_size = 1, seq_len = 2 }) end,
      "a token tensor must have an integer dtype, got f32")
    err(function() data.BatchSampler(true, { batch_size = 1, seq_len = 2 }) end, "a source must be")
    err(function() data.BatchSampler("no-such-shard.bin", { batch_size = 1, seq_len = 2 }) end, "BatchSampler",
      "cannot open no-such-shard.bin")
  end)
end)

describe("data.ValLoader", function()
  local function toks(n)
    local t = {}
    for i = 1, n do t[i] = i - 1 end
    return t
  end

  it("walks the data once in consecutive, non-overlapping windows", function()
    local v = data.ValLoader(toks(50), { batch_size = 2, seq_len = 4 })
    assert.are.equal(6, v:num_batches())  -- floor(49 / 8)
    local starts, n = {}, 0
    for x, y in v:batches() do
      n = n + 1
      local xv, yv = x:tolist(), y:tolist()
      starts[#starts + 1] = xv[1][1]
      assert.are.same({ xv[1][1] + 4, xv[1][1] + 5, xv[1][1] + 6, xv[1][1] + 7 }, xv[2])
      assert.are.equal(xv[2][4] + 1, yv[2][4])
    end
    assert.are.equal(6, n)
    assert.are.same({ 0, 8, 16, 24, 32, 40 }, starts)
    assert.is_nil(v:next())
    v:reset()
    assert.are.equal(0, v:next():tolist()[1][1])
  end)

  it("splits each step between ranks, continues across shards and honours max_batches", function()
    local p1, p2 = tmp(), tmp()
    data.write_shard(p1, toks(20))
    data.write_shard(p2, toks(20))
    local shards = data.read_shards({ p1, p2 })
    local r0 = data.ValLoader(shards, { batch_size = 1, seq_len = 4, rank = 0, world_size = 2 })
    local r1 = data.ValLoader(shards, { batch_size = 1, seq_len = 4, rank = 1, world_size = 2 })
    local a, b = {}, {}
    for x in r0:batches() do a[#a + 1] = x:tolist()[1][1] end
    for x in r1:batches() do b[#b + 1] = x:tolist()[1][1] end
    assert.are.same({ 0, 8, 0, 8 }, a)
    assert.are.same({ 4, 12, 4, 12 }, b)
    assert.are.equal(4, r0:num_batches())
    local lim = data.ValLoader(shards, { batch_size = 1, seq_len = 4, max_batches = 3 })
    local n = 0
    for _ in lim:batches() do n = n + 1 end
    assert.are.equal(3, n)
    assert.are.equal(3, lim:num_batches())
    err(function() data.ValLoader(toks(8), { batch_size = 2, seq_len = 4 }) end,
      "no shard has the 9 tokens one batch needs")
  end)
end)
