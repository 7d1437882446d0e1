-- Regressions found by the fuzz targets of spec/fuzz (docs/design.md "Fuzzing"), at the
-- level a user reaches them, plus the C entry points the targets call (the in-memory safetensors reader, the
-- token shard header check).  Each input is also in the target's committed corpus (spec/fuzz/corpus/<target>),
-- which make test runs.
local engine = require("engine")
local core = require("engine.core")
local ffi, C = core.ffi, core.C

local function errmatch(fn, pat)
  local ok, err = pcall(fn)
  assert.is_false(ok, "expected an error matching '" .. pat .. "'")
  assert.truthy(tostring(err):find(pat, 1, true), "error '" .. tostring(err) .. "' does not contain '" .. pat .. "'")
  return tostring(err)
end

local function le64(n)
  local b = {}
  for i = 1, 8 do b[i] = string.char(n % 256); n = math.floor(n / 256) end
  return table.concat(b)
end

local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

describe("fuzz regressions: safetensors and checkpoint metadata", function()
  local path
  before_each(function() path = os.tmpname() end)
  after_each(function() os.remove(path) end)

  it("refuses a __metadata__ key given twice (a reader keeping either value would be misled)", function()
    local h = '{"__metadata__":{"checksum.model.w":"0000000000000000","step":"1","checksum.model.w":"ffffffffffffffff"}}'
    write(path, le64(#h) .. h)
    local err = errmatch(function() engine.load(path) end, "duplicate __metadata__ key 'checksum.model.w'")
    assert.truthy(err:find(path, 1, true))
  end)

  it("refuses an empty tensor whose strides overflow ([0, 2^62, 2^62]: UBSan in the strides before)", function()
    local h = '{"a":{"dtype":"F32","shape":[0,4611686018427387904,4611686018427387904],"data_offsets":[0,0]}}'
    write(path, le64(#h) .. h)
    errmatch(function() engine.load(path) end, "tensor 'a' shape [0,4611686018427387904,4611686018427387904] is too large")
    errmatch(function() engine.zeros(0, 2 ^ 62, 2 ^ 62) end, "strides overflow")
    assert.equal(0, engine.zeros(0, 2 ^ 62):numel())
  end)

  it("copies an empty tensor whose leading dims have byte strides past int64 ([5, 0, 1, 2^62]: UBSan in the copy)", function()
    local h = '{"a":{"dtype":"F32","shape":[5,0,1,4611686018427387904],"data_offsets":[0,0]}}'
    write(path, le64(#h) .. h)
    local t = engine.load(path).a
    assert.equal(0, t:numel())
    assert.same({ 5, 0, 1, 4611686018427387904 }, t:shape())
    assert.equal(0, t:clone():numel())                      -- a strided copy of the empty space
    assert.equal(0, t:transpose(1, 4):contiguous():numel())
    assert.equal(0, engine.zeros(5, 0, 1, 2 ^ 62):add(1):numel())
  end)

  it("finds duplicate tensor names among many in n log n", function()
    local parts = {}
    for i = 1, 20000 do parts[i] = string.format('"t%05d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}', i) end
    parts[#parts + 1] = '"t00007":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}'
    local h = "{" .. table.concat(parts, ",") .. "}"
    write(path, le64(#h) .. h)
    errmatch(function() engine.load(path) end, "duplicate tensor name 't00007'")
  end)

  it("reads a file image from memory exactly as from the file (eng_safetensors_load_memory)", function()
    engine.save(path, { a = engine.tensor({ 1, 2, 3 }), b = engine.ones(2, 2, { dtype = "i64" }) }, { k = "v\n" })
    local f = assert(io.open(path, "rb"))
    local bytes = f:read("*a")
    f:close()
    local st = C.eng_safetensors_load_memory(bytes, #bytes, "image")
    assert.is_true(st ~= nil, core.last_error and core.last_error() or "load_memory failed")
    assert.equal(2, C.eng_safetensors_count(st))
    assert.equal("k", ffi.string(C.eng_safetensors_meta_key(st, 0)))
    assert.equal("v\n", ffi.string(C.eng_safetensors_meta_value(st, 0)))
    local t = core.wrap(C.eng_safetensors_get(st, "a"))
    assert.same({ 1, 2, 3 }, t:totable())
    C.eng_safetensors_free(st)
    -- a truncated image is an error naming it, as a truncated file is
    assert.is_true(C.eng_safetensors_load_memory(bytes, #bytes - 3, "image") == nil)
    assert.truthy(ffi.string(C.eng_last_error()):find("safetensors_load: image: tensor", 1, true))
    assert.is_true(C.eng_safetensors_load_memory(nil, 0, nil) == nil)
    assert.truthy(ffi.string(C.eng_last_error()):find("(memory): file too short (0 bytes)", 1, true))
  end)
end)

describe("fuzz regressions: token shard header (eng_token_shard_parse_header)", function()
  local function header(magic, version, n, vocab)
    local h = ffi.new("int32_t[256]")
    h[0], h[1], h[2], h[3] = magic, version, n, vocab or 0
    return ffi.string(h, 1024)
  end
  local n, width, vocab = ffi.new("int64_t[1]"), ffi.new("int32_t[1]"), ffi.new("int32_t[1]")

  it("accepts exactly the header plus 2 bytes per token", function()
    assert.equal(0, C.eng_token_shard_parse_header("x.bin", header(20240520, 1, 3), 1024, 1030, n, width, vocab))
    assert.equal(3, tonumber(n[0]))
    assert.equal(2, width[0])
    assert.equal(0, vocab[0])
    assert.equal(-1, C.eng_token_shard_parse_header("x.bin", header(20240520, 1, 3), 1024, 1031, n, nil, nil))
  end)

  it("reads llm.c's uint32 shards (magic 20240801, version 7) and the vocabulary size in slot 3", function()
    assert.equal(0, C.eng_token_shard_parse_header("x.bin", header(20240801, 7, 3, 128256), 1024, 1036, n, width,
      vocab))
    assert.equal(3, tonumber(n[0]))
    assert.equal(4, width[0])
    assert.equal(128256, vocab[0])
    assert.equal(-1, C.eng_token_shard_parse_header("x.bin", header(20240801, 7, 3), 1024, 1030, n, nil, nil))
    assert.equal(-1, C.eng_token_shard_parse_header("x.bin", header(20240801, 1, 3), 1024, 1036, n, nil, nil))
    assert.truthy(ffi.string(C.eng_last_error()):find("unsupported version 1 for magic 20240801", 1, true))
    assert.equal(-1, C.eng_token_shard_parse_header("x.bin", header(20240520, 2, 3), 1024, 1036, n, nil, nil))
    assert.equal(-1, C.eng_token_shard_parse_header("x.bin", header(20240520, 1, 3, -5), 1024, 1030, n, nil, nil))
    assert.truthy(ffi.string(C.eng_last_error()):find("vocabulary size (slot 3) is -5", 1, true))
  end)

  it("refuses negative counts, short headers and a count past int32 bytes", function()
    assert.equal(-1, C.eng_token_shard_parse_header("x.bin", header(20240520, 1, -1), 1024, 1024, n, nil, nil))
    assert.truthy(ffi.string(C.eng_last_error()):find("the header says -1 tokens", 1, true))
    assert.equal(-1, C.eng_token_shard_parse_header(nil, header(20240520, 1, 0), 1000, 1024, n, nil, nil))
    assert.truthy(ffi.string(C.eng_last_error()):find("read_shard: (memory): file has 1000 bytes", 1, true))
    -- 2^31 - 1 tokens: the expected size (4 GiB + 1022, or 8 GiB + 1020) is computed in 64 bits
    assert.equal(0, C.eng_token_shard_parse_header("x.bin", header(20240520, 1, 2147483647), 1024,
      1024 + 2 * 2147483647, n, nil, nil))
    assert.equal(2147483647, tonumber(n[0]))
    assert.equal(0, C.eng_token_shard_parse_header("x.bin", header(20240801, 7, 2147483647), 1024,
      1024 + 4 * 2147483647, n, nil, nil))
  end)
end)

describe("fuzz regressions: layout math with huge _StridedShard split factors", function()
  -- _StridedShard(dim 0, sf = 2^31 - 1) on a mesh of 2: an int overflow in the run count (UBSan) and 2^31
  -- pieces allocated and walked; now O(min(sf, n)): only the non-empty pieces are visited.
  local function pl(kind, dim, sf)
    local p = ffi.new("eng_placement[1]")
    p[0].kind, p[0].dim, p[0].split_factor = kind, dim, sf
    return p
  end

  it("computes local shapes, runs and plans without walking every piece", function()
    local shape, mesh = ffi.new("int64_t[1]", 5), ffi.new("int64_t[1]", 2)
    local coord = ffi.new("int[1]", 1)
    local src, dst = pl(3, 0, 2147483647), pl(0, 0, 0)
    local ls, off = ffi.new("int64_t[1]"), ffi.new("int64_t[1]")
    -- the nested rule (PyTorch's uneven _StridedShard): sf torch.chunk pieces of 5 rows (pieces 0..4 hold one row
    -- each), each piece chunked over the 2 coordinates: coordinate 0 holds every row, coordinate 1 none
    assert.equal(0, C.eng_local_shape_and_offset(1, shape, 1, mesh, coord, src, ls, off))
    assert.equal(0, tonumber(ls[0]))
    local st, len = ffi.new("int64_t[4]"), ffi.new("int64_t[4]")
    assert.equal(0, C.eng_local_shard_runs(1, shape, 1, mesh, coord, src, 0, st, len, 4))
    coord[0] = 0
    assert.equal(0, C.eng_local_shape_and_offset(1, shape, 1, mesh, coord, src, ls, off))
    assert.equal(5, tonumber(ls[0]))
    assert.equal(1, C.eng_local_shard_runs(1, shape, 1, mesh, coord, src, 0, st, len, 4))
    assert.same({ 0, 5 }, { tonumber(st[0]), tonumber(len[0]) })
    local steps = ffi.new("eng_transform_info[4]")
    assert.equal(1, C.eng_redistribute_plan(1, mesh, coord, src, dst, 1, shape, steps, 4))
  end)
end)

-- Found by the API sweep (spec/fuzz/api_sweep.lua, spec/api_sweep_spec.lua) and the Lua metadata target
-- (spec/fuzz/fuzz_dcp_metadata.lua); the call that found each is in the comment.
describe("fuzz regressions: the API sweep", function()
  local dist = engine.distributed
  it("Shard(2^31) on a 1-rank mesh is an error, not a signed overflow in the message (UBSan; seed 5 call 6334)", function()
    local mesh = dist.init_device_mesh("cpu", { 1 })
    errmatch(function() dist.distribute_tensor(engine.ones(2, 3), mesh, { dist.Shard(2 ^ 31) }) end, "Shard(2147483648)")
  end)
  it("raises errors naming the operation for non-tensor and non-table arguments", function()
    errmatch(function() engine.metadata_checksum(nil) end, "metadata_checksum: meta must be a table")
    errmatch(function() engine.zeros(2):set(nil, 1) end, "set: the value must be a number")
    assert.equal(1, engine.zeros(2):set(true, 1):get(1))
    local x = engine.ones(2):requires_grad_()
    errmatch(function() x:sum():backward(nil, 5) end, "backward: options must be a table")
    errmatch(function() x:sum():backward(false) end, "backward: gradient must be a tensor or nil")
    errmatch(function() x:sum():backward({ retian_graph = true }) end, "backward: unknown option 'retian_graph'")
    errmatch(function() engine.logical_or(2.5) end, "logical_or: at least one argument must be a tensor")
    errmatch(function() engine.logical_and(1, { 2 }) end, "logical_and: at least one argument must be a tensor")
    errmatch(function() engine.tensor(3):unflatten(-1, { 1 }) end, "unflatten: a 0-d tensor")
    errmatch(function() dist.shard_tensor(engine.ones(2, 3):t(), dist.ChunkShardingSpec{ dim = 1, placements = { "rank:0/cpu" } }) end,
      "shard_tensor: input tensor is not a contiguous Tensor")
  end)
  it("binary_cross_entropy of bool tensors checks the range instead of comparing booleans", function()
    local ok, e = pcall(engine.nn.functional.binary_cross_entropy, engine.ones(2):gt(0), engine.ones(2):gt(0))
    assert.is_true(ok or not tostring(e):find("attempt to", 1, true), tostring(e))
  end)
end)

describe("fuzz regressions: the dist.checkpoint value parser", function()
  local de = engine.distributed.checkpoint._deserialize
  it("refuses out-of-range int64/uint64 literals instead of wrapping them", function()
    assert.equal(18446744073709551615ULL, de("18446744073709551615U", "k"))
    assert.equal(-9223372036854775807LL - 1, de("-9223372036854775808L", "k"))
    errmatch(function() de("18446744073709551616U", "k") end, "uint64 out of range")
    errmatch(function() de("-1U", "k") end, "negative uint64")
    errmatch(function() de("9223372036854775808L", "k") end, "int64 out of range")
    errmatch(function() de("-9223372036854775809L", "k") end, "int64 out of range")
  end)
  it("refuses a NaN key and a duplicate key (found: 'table index is NaN')", function()
    errmatch(function() de("{[nan]=1}", "k") end, "checkpoint.load: the value of 'k' in the metadata is malformed (bad key")
    errmatch(function() de('{["a"]=1,["a"]=2}', "k") end, 'duplicate key "a"')
    errmatch(function() de("{[1]=1,[1.0]=2}", "k") end, "duplicate key 1")
  end)
end)
