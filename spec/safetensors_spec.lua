-- safetensors save/load: round trips for every dtype and layout, metadata,
-- the byte layout, files from other writers, and every corruption error.
local engine = require("engine")

local function errmatch(fn, pat)
  local ok, err = pcall(fn)
  assert.is_false(ok, "expected an error matching '" .. pat .. "'")
  assert.truthy(tostring(err):find(pat, 1, true), "error '" .. tostring(err) .. "' does not contain '" .. pat .. "'")
  return err
end

local function le64(n)
  local b = {}
  for i = 1, 8 do b[i] = string.char(n % 256); n = math.floor(n / 256) end
  return table.concat(b)
end

local function read_le64(s)
  local n = 0
  for i = 8, 1, -1 do n = n * 256 + s:byte(i) end
  return n
end

local function write_raw(path, header, data)
  local f = assert(io.open(path, "wb"))
  f:write(le64(#header), header, data or "")
  f:close()
end

local function read_all(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

-- little-endian f32 bytes of a few exact values
local F32_ONE, F32_TWO = string.char(0, 0, 128, 63), string.char(0, 0, 0, 64)

describe("safetensors", function()
  local path
  before_each(function() path = os.tmpname() end)
  after_each(function() os.remove(path) end)

  it("round-trips every dtype bit for bit", function()
    engine.manual_seed(3)
    local ts = {
      f32 = engine.randn(3, 4),
      f64 = engine.randn(2, 5, { dtype = "f64" }),
      bf16 = engine.randn(7, { dtype = "bf16" }),
      f16 = engine.randn(2, 2, 2, { dtype = "f16" }),
      i32 = engine.tensor({ -2147483648, 0, 2147483647 }, "i32"),
      i64 = engine.tensor({ { -5, 2 ^ 53 }, { 7, -2 ^ 40 } }, "i64"),
      u8 = engine.tensor({ 0, 1, 255, 128 }, "u8"),
      bool = engine.tensor({ true, false, true }),
    }
    engine.save(path, ts)
    local back, meta, names = engine.load(path)
    assert.are.same({}, meta)
    assert.are.same({ "bf16", "bool", "f16", "f32", "f64", "i32", "i64", "u8" }, names)
    for k, t in pairs(ts) do
      local r = back[k]
      assert.are.equal(t.dtype, r.dtype, k)
      assert.are.same(t:shape(), r:shape(), k)
      assert.are.same(t:tolist_flat(), r:tolist_flat(), k)
    end
  end)

  it("round-trips 0-d, empty and 8-d tensors", function()
    local ts = { scalar = engine.tensor(2.5, "f64"), empty = engine.zeros(0, 3), empty2 = engine.zeros(4, 0, { dtype = "i64" }),
      deep = engine.ones(1, 2, 1, 2, 1, 2, 1, 2) }
    engine.save(path, ts)
    local back = engine.load(path)
    assert.are.equal(0, back.scalar:dim())
    assert.are.equal(2.5, back.scalar:item())
    assert.are.same({ 0, 3 }, back.empty:shape())
    assert.are.same({ 4, 0 }, back.empty2:shape())
    assert.are.same({ 1, 2, 1, 2, 1, 2, 1, 2 }, back.deep:shape())
    engine.save(path, {})
    local none, m, names = engine.load(path)
    assert.are.same({}, none)
    assert.are.same({}, names)
  end)

  it("writes strided inputs contiguous", function()
    local base = engine.arange(24, { dtype = "f32" }):view(4, 6)
    local ts = { t = base:t(), n = base:narrow(2, 2, 3), e = engine.tensor({ 1, 2, 3 }, "f64"):view(3, 1):expand(3, 4) }
    engine.save(path, ts)
    local back = engine.load(path)
    for k, t in pairs(ts) do
      assert.is_true(back[k]:is_contiguous())
      assert.are.same(t:shape(), back[k]:shape(), k)
      assert.are.same(t:tolist_flat(), back[k]:tolist_flat(), k)
    end
  end)

  it("round-trips metadata and names with special characters", function()
    local name = 'a "quoted"\\path/\n\ttab é'
    engine.save(path, { [name] = engine.ones(1), plain = engine.zeros(1) },
      { format = "pt", step = 12, note = 'line1\nline2 "q" \\ \1 ü' })
    local back, meta, names = engine.load(path)
    assert.are.same({ 1 }, back[name]:tolist_flat())
    assert.are.same({ format = "pt", step = "12", note = 'line1\nline2 "q" \\ \1 ü' }, meta)
    assert.are.same({ name, "plain" }, names)
  end)

  it("lays the file out as the format specifies", function()
    engine.save(path, { b = engine.tensor({ 1, 2 }, "f32"), a = engine.tensor({ 7 }, "i64") }, { k = "v" })
    local raw = read_all(path)
    local n = read_le64(raw)
    assert.are.equal(0, n % 8)
    local header = raw:sub(9, 8 + n)
    assert.are.equal("{", header:sub(1, 1))
    assert.truthy(header:find('"__metadata__":{"k":"v"}', 1, true))
    assert.truthy(header:find('"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}', 1, true))
    assert.truthy(header:find('"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}', 1, true))
    assert.truthy(header:match("}%s*$"))
    assert.are.equal(8 + n + 16, #raw)
    assert.are.equal(F32_ONE .. F32_TWO, raw:sub(8 + n + 9, 8 + n + 16))
  end)

  it("loads files from other writers (any key order, spacing, escapes, extra keys, gaps)", function()
    local header = '{ "w\\u00e9ight" : { "data_offsets" : [ 4 , 12 ], "extra": [1, {"x": null}], "shape" : [2],\n'
      .. '"dtype" : "F32" }, "__metadata__": {"\\u0041": "\\ud83d\\ude00"}, "z": {"dtype": "BOOL", "shape": [], "data_offsets": [12, 13]}}'
    write_raw(path, header, "PADD" .. F32_ONE .. F32_TWO .. string.char(1))
    local back, meta, names = engine.load(path)
    assert.are.same({ "wéight", "z" }, names)
    assert.are.same({ 1, 2 }, back["wéight"]:tolist_flat())
    assert.are.equal(true, back.z:item())
    assert.are.same({ A = "\240\159\152\128" }, meta)
  end)

  it("loads the committed PyTorch fixture", function()
    local f = io.open("spec/fixtures/transformer_f32.safetensors", "rb")
    if not f then return pending("fixture not present") end
    f:close()
    local back, meta = engine.load("spec/fixtures/transformer_f32.safetensors")
    assert.is_not_nil(back["tok_embeddings.weight"])
    assert.are.equal("f32", back["tok_embeddings.weight"].dtype)
    assert.are.equal("i64", back.tokens.dtype)
    assert.is_string(next(meta))
  end)

  it("returns independent tensors", function()
    engine.save(path, { a = engine.zeros(3) })
    local x = engine.load(path).a
    local y = engine.load(path).a
    x:fill_(5)
    assert.are.same({ 0, 0, 0 }, y:tolist_flat())
  end)

  describe("rejects corrupt files with errors naming the file", function()
    local function bad(header, data, pat)
      write_raw(path, header, data)
      local err = errmatch(function() engine.load(path) end, pat)
      assert.truthy(err:find(path, 1, true), "error should name the file: " .. err)
    end

    it("missing, short and truncated files", function()
      errmatch(function() engine.load("/nonexistent/dir/x.safetensors") end, "cannot open '/nonexistent/dir/x.safetensors'")
      local f = assert(io.open(path, "wb")); f:write("abc"); f:close()
      errmatch(function() engine.load(path) end, "file too short (3 bytes)")
      f = assert(io.open(path, "wb")); f:write(le64(1000), "{}"); f:close()
      errmatch(function() engine.load(path) end, "header length 1000 exceeds the file size 10")
      engine.save(path, { a = engine.ones(4) })
      local raw = read_all(path)
      f = assert(io.open(path, "wb")); f:write(raw:sub(1, #raw - 3)); f:close()
      errmatch(function() engine.load(path) end, "run past the end of the data")
    end)

    it("bad JSON", function()
      bad("[]", "", "the header must be a JSON object")
      bad('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}', F32_ONE, "unexpected end of header")
      bad('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}} x', F32_ONE, "trailing characters")
      bad('{"a" {"dtype": "F32"}}', "", "expected ':'")
      bad('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4],}}', F32_ONE, "expected a string")
      bad('{"a\\q": {}}', "", "invalid escape in string")
      bad('{"a\\u12": {}}', "", "bad hex digit")
      bad('{"\\ud800x": {}}', "", "unpaired UTF-16 surrogate")
      bad('{"a\\u0000": {}}', "", "NUL character")
      bad('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": tru}}', F32_ONE, "expected a JSON value")
      bad('{"__metadata__": {"k": 1}}', "", "__metadata__ values must be strings")
      bad('{"__metadata__": []}', "", "__metadata__ must be an object")
      bad('{"a": {"x": ' .. string.rep("[", 100) .. string.rep("]", 100) .. '}}', "", "nesting too deep")
      bad("{\"a\":\1}", "", "a tensor entry must be an object")
    end)

    it("bad tensor entries", function()
      bad('{"a": {"dtype": "I16", "shape": [1], "data_offsets": [0, 2]}}', "xx", "tensor 'a' has unsupported dtype \"I16\"")
      bad('{"a": {"dtype": 3, "shape": [1], "data_offsets": [0, 2]}}', "xx", "dtype must be a string")
      bad('{"a": {"shape": [1], "data_offsets": [0, 4]}}', F32_ONE, "tensor 'a' lacks \"dtype\"")
      bad('{"a": {"dtype": "F32", "data_offsets": [0, 4]}}', F32_ONE, "lacks \"shape\"")
      bad('{"a": {"dtype": "F32", "shape": [1]}}', F32_ONE, "lacks \"data_offsets\"")
      bad('{"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}', F32_ONE, "shape entries must be non-negative integers")
      bad('{"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}', F32_ONE, "got a fraction or exponent")
      bad('{"a": {"dtype": "F32", "shape": [1,1,1,1,1,1,1,1,1], "data_offsets": [0, 4]}}', F32_ONE, "more than 8 dims")
      bad('{"a": {"dtype": "F32", "shape": [99999999999999999999], "data_offsets": [0, 4]}}', F32_ONE, "integer too large")
      bad('{"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 4]}}', F32_ONE, "is too large")
      bad('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}', F32_ONE, "data_offsets must have two entries")
      bad('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}', F32_ONE, "with begin > end")
      bad('{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}', F32_ONE, "tensor 'a' (F32[2]) needs 8 bytes but data_offsets [0, 4] hold 4")
      bad('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', F32_ONE, "run past the end of the data (4 bytes; truncated file?)")
      bad('{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
        F32_ONE .. F32_TWO, "tensors 'a' [0, 8] and 'b' [4, 8] overlap")
      bad('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
        F32_ONE, "duplicate tensor name 'a'")
      bad('{"__metadata__": {}, "__metadata__": {}}', "", "duplicate __metadata__")
    end)
  end)

  describe("save errors", function()
    it("rejects bad names, values and metadata", function()
      errmatch(function() engine.save(path, { __metadata__ = engine.ones(1) }) end, "'__metadata__' is reserved")
      errmatch(function() engine.save(path, { engine.ones(1) }) end, "tensor names must be strings, got a number key")
      errmatch(function() engine.save(path, { a = 5 }) end, "entry 'a' is a number, not a tensor")
      errmatch(function() engine.save(path, { a = engine.ones(1) }, { k = {} }) end, "metadata value for key 'k' must be a string")
      errmatch(function() engine.save(path, { a = engine.ones(1) }, { [1] = "x" }) end, "metadata keys must be strings")
      errmatch(function() engine.save(path, engine.ones(1)) end, "expected a table {name = tensor, ...}")
      errmatch(function() engine.save(5, {}) end, "path must be a string")
      errmatch(function() engine.load(5) end, "path must be a string")
    end)

    it("reports unwritable paths and leaves an existing file intact", function()
      errmatch(function() engine.save("/nonexistent/dir/x.safetensors", { a = engine.ones(1) }) end,
        "cannot open '/nonexistent/dir/x.safetensors.tmp")
      engine.save(path, { a = engine.ones(2) })
      local before = read_all(path)
      pcall(engine.save, path, { a = engine.ones(2), __metadata__ = engine.ones(1) })
      assert.are.equal(before, read_all(path))
    end)
  end)
end)
