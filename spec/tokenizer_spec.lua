-- Tokenizers: data.load_tokenizer and the byte-level BPE of engine.data.bpe against the ids of the Hugging Face
-- `tokenizers` package (spec/fixtures/tokenizer/cases.lua, made by tools/gen_tokenizer_fixtures.py) for the
-- committed KJV tokenizer (data/tokenizers/kjv-bpe-4k, tools/train_tokenizer.py) and a small multilingual one
-- (spec/fixtures/tokenizer/multi-1k), in both file forms; round trips (fixture texts, random byte strings that
-- need not be UTF-8, tensors); the error cases.
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local json = require("engine.json")
local data = engine.data

local err = require("spec.helpers.errors").err -- err(fn, ...): fn raises, naming each string

local KJV = "data/tokenizers/kjv-bpe-4k"
local MULTI = "spec/fixtures/tokenizer/multi-1k"
local cases = dofile("spec/fixtures/tokenizer/cases.lua")

local tmpdirs = {}
local function tmpdir()
  local d = os.tmpname()
  os.remove(d)
  assert(os.execute("mkdir -p '" .. d .. "'"))
  tmpdirs[#tmpdirs + 1] = d
  return d
end
local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end
local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end
teardown(function() for _, d in ipairs(tmpdirs) do os.execute("rm -rf '" .. d .. "'") end end)

-- the first index where two id lists differ, or nil
local function first_diff(a, b)
  for i = 1, math.max(#a, #b) do if a[i] ~= b[i] then return i end end
  return nil
end

local function check_cases(tok, field)
  for ci, c in ipairs(cases) do
    local ids = tok:encode(c.text)
    local d = first_diff(ids, c[field])
    assert(d == nil, string.format("%s, case %d %q: id %d is %s, the package gives %s", tok.name, ci,
      c.text:sub(1, 60), d or 0, tostring(ids[d]), tostring(c[field][d])))
    assert.are.equal(c.text, tok:decode(ids))
  end
end

describe("data.load_tokenizer: byte-level BPE", function()
  it("gives the package's ids for every fixture text (KJV tokenizer, tokenizer.json)", function()
    local tok = data.load_tokenizer(KJV .. "/tokenizer.json")
    assert.are.same({ 4096, 0, KJV .. "/tokenizer.json" }, { tok.vocab_size, tok.eot, tok.name })
    assert.are.same({ ["<|endoftext|>"] = 0 }, tok.special)
    check_cases(tok, "kjv")
    -- the hand-written case: ASCII, punctuation, digits, whitespace runs, newlines, é ß Greek CJK emoji
    local hand = cases[1].text
    assert.is_truthy(hand:find("Café", 1, true) and hand:find("straße", 1, true) and hand:find("λόγος", 1, true)
      and hand:find("你好", 1, true) and hand:find("\240\159\152\128", 1, true) and hand:find("   ", 1, true))
    local n_eot = 0
    for _, id in ipairs(cases[1].kjv) do if id == 0 then n_eot = n_eot + 1 end end
    assert.are.equal(1, n_eot)
  end)

  it("gives the same ids from vocab.json + merges.txt, a folder, or two paths", function()
    check_cases(data.load_tokenizer(KJV .. "/vocab.json"), "kjv")
    check_cases(data.load_tokenizer(KJV .. "/vocab.json", KJV .. "/merges.txt"), "kjv")
    local folder = data.load_tokenizer(KJV)
    assert.are.equal(KJV, folder.name)
    check_cases(folder, "kjv")
    local two = data.load_tokenizer(KJV .. "/vocab.json")
    assert.are.same({ 4096, 0 }, { two.vocab_size, two.eot })
    -- a folder with only the two-file form
    local d = tmpdir()
    write(d .. "/vocab.json", read(MULTI .. "/vocab.json"))
    write(d .. "/merges.txt", read(MULTI .. "/merges.txt"))
    local m = data.load_tokenizer(d)
    assert.are.same({ 1024, 0 }, { m.vocab_size, m.eot })
    assert.are.same({ ["<|endoftext|>"] = 0, ["<|pad|>"] = 1 }, m.special)
    check_cases(m, "multi")
  end)

  it("splits non-ASCII text as the package does (multilingual merges)", function()
    local tok = data.load_tokenizer(MULTI .. "/tokenizer.json")
    check_cases(tok, "multi")
    -- letters of several scripts and numbers of several scripts are their own classes
    assert.are.same({ "L", "L", "L", "L", "N", "N", "N", "O", "O", "S", "S", "O" },
      { require("engine.data.bpe").class_of(0xE9), require("engine.data.bpe").class_of(0x3B1),
        require("engine.data.bpe").class_of(0x4F60), require("engine.data.bpe").class_of(0x416),
        require("engine.data.bpe").class_of(0x661), require("engine.data.bpe").class_of(0xBD),
        require("engine.data.bpe").class_of(0x216B), require("engine.data.bpe").class_of(0x301),
        require("engine.data.bpe").class_of(0x1F600), require("engine.data.bpe").class_of(0xA0),
        require("engine.data.bpe").class_of(0x3000), require("engine.data.bpe").class_of(0x1C) })
  end)

  it("honours the ByteLevel pre-tokenizer's add_prefix_space (a space before each text between added tokens)", function()
    local j = json.decode(read(KJV .. "/tokenizer.json"))
    assert.is_false(j.pre_tokenizer.add_prefix_space)
    j.pre_tokenizer.add_prefix_space = true
    local p = tmpdir() .. "/tokenizer.json"
    write(p, json.encode(j))
    local tok = data.load_tokenizer(p)
    local n = 0
    for ci, c in ipairs(cases) do
      if c.kjv_prefix then
        n = n + 1
        local ids = tok:encode(c.text)
        local d = first_diff(ids, c.kjv_prefix)
        assert(d == nil, string.format("case %d %q: id %d is %s, the package gives %s", ci, c.text:sub(1, 60), d or 0,
          tostring(ids[d]), tostring(c.kjv_prefix[d])))
      end
    end
    assert.is_true(n > 40)
  end)

  it("round-trips random byte strings, valid UTF-8 or not", function()
    local toks = { data.load_tokenizer(KJV), data.load_tokenizer(MULTI) }
    local seed = 12345
    local function rand(n) seed = (seed * 1103515245 + 12345) % 2147483648; return seed % n end
    local alphabet = { " ", "  ", "\n", "\t", "'s", "'", "a", "Z", "7", ".", "é", "ß", "\206\187", "\228\189\160",
      "\240\159\152\128", "<|endoftext|>", "<|endo" }
    for _ = 1, 300 do
      local parts = {}
      for i = 1, rand(40) do
        if rand(2) == 0 then parts[i] = string.char(rand(256)) else parts[i] = alphabet[rand(#alphabet) + 1] end
      end
      local s = table.concat(parts)
      for _, tok in ipairs(toks) do
        local ids = tok:encode(s)
        for _, id in ipairs(ids) do assert(id >= 0 and id < tok.vocab_size) end
        assert.are.equal(s, tok:decode(ids))
      end
    end
    -- every single byte, and all 256 in a row
    local all = {}
    for b = 0, 255 do
      all[#all + 1] = string.char(b)
      assert.are.equal(string.char(b), toks[1]:decode(toks[1]:encode(string.char(b))))
    end
    assert.are.equal(table.concat(all), toks[1]:decode(toks[1]:encode(table.concat(all))))
  end)

  it("encodes to and decodes from i64 tensors", function()
    local tok = data.load_tokenizer(KJV)
    local t = tok:encode(cases[1].text, { tensor = true })
    assert.are.equal("i64", t.dtype)
    assert.are.same({ #cases[1].kjv }, t:shape())
    assert.are.same(cases[1].kjv, t:tolist())
    assert.are.equal(cases[1].text, tok:decode(t))
    assert.are.equal(cases[1].text, tok:decode(t:reshape({ 1, #cases[1].kjv })))
    assert.are.same({}, tok:encode(""))
    assert.are.same({ 0 }, tok:encode("", { tensor = true }):shape())
    assert.are.equal("", tok:decode({}))
    assert.are.equal("<|endoftext|>", tok:decode({ tok.eot }))
    assert.are.same({ tok.eot, tok.eot }, tok:encode("<|endoftext|><|endoftext|>"))
  end)

  it("load_tokenizer(\"byte\") is the byte-level tokenizer; a tokenizer passes through", function()
    local b = data.load_tokenizer("byte")
    assert.are.same({ "byte", 256 }, { b.name, b.vocab_size })
    assert.is_nil(b.eot)
    assert.are.same({ 104, 105 }, b:encode("hi"))
    assert.are.equal("hi", b:decode(b:encode("hi", { tensor = true })))
    local k = data.load_tokenizer(KJV)
    assert.are.equal(k, data.load_tokenizer(k))
    assert.is_truthy(tostring(k):find("vocab 4096, eot 0", 1, true))
  end)

  it("names the file and the problem", function()
    err(function() data.load_tokenizer("no/such/tokenizer.json") end,
      "load_tokenizer: no/such/tokenizer.json: no such file or folder")
    err(function() data.load_tokenizer(5) end, "load_tokenizer: expected \"byte\" or a path, got number")
    local d = tmpdir()
    err(function() data.load_tokenizer(d) end, d, "neither tokenizer.json nor vocab.json + merges.txt")
    local base = json.decode(read(MULTI .. "/tokenizer.json"))
    local function variant(edit)
      local j = json.decode(read(MULTI .. "/tokenizer.json"))
      edit(j)
      local p = d .. "/tokenizer.json"
      write(p, json.encode(j))
      return p
    end
    assert.are.equal("BPE", base.model.type)
    local p = variant(function(j) j.model.type = "WordPiece" end)
    err(function() data.load_tokenizer(p) end, p, "model type WordPiece is not supported (only BPE)")
    p = variant(function(j) j.pre_tokenizer = { type = "Metaspace", replacement = "_" } end)
    err(function() data.load_tokenizer(p) end, "pre_tokenizer Metaspace is not supported")
    p = variant(function(j)
      j.pre_tokenizer = { type = "Sequence", pretokenizers = { { type = "Split" }, { type = "ByteLevel", use_regex = false } } }
    end)
    err(function() data.load_tokenizer(p) end, "pre_tokenizer Sequence(Split, ByteLevel) is not supported")
    p = variant(function(j) j.normalizer = { type = "NFC" } end)
    err(function() data.load_tokenizer(p) end, "normalizer NFC is not supported (only null)")
    p = variant(function(j) j.model.merges[3] = { "a", "b", "c" } end)
    err(function() data.load_tokenizer(p) end, p, "bad merge 3")
    p = variant(function(j) j.model.merges[2] = "Ġ zzzq" end)
    err(function() data.load_tokenizer(p) end, "merge 2 (Ġ zzzq): \"zzzq\" is not in the vocabulary")
    write(p, "{\"model\": ")
    err(function() data.load_tokenizer(p) end, p, "json.decode")
    -- merges.txt: a bad line is named with its number
    write(d .. "/vocab.json", read(MULTI .. "/vocab.json"))
    local merges = read(MULTI .. "/merges.txt")
    write(d .. "/merges.txt", merges:gsub("\n", "\nthree tokens here\n", 1))
    os.remove(d .. "/tokenizer.json")
    err(function() data.load_tokenizer(d) end, d .. "/merges.txt", "bad merges line 2: \"three tokens here\"")
    err(function() data.load_tokenizer(d .. "/vocab.json", d .. "/nothing.txt") end, d .. "/nothing.txt: no such file")
    os.remove(d .. "/merges.txt")
    err(function() data.load_tokenizer(d .. "/vocab.json") end, "a vocab.json needs its merges.txt")
  end)

  it("refuses ids out of range in decode, and bad arguments to encode", function()
    local tok = data.load_tokenizer(KJV)
    err(function() tok:decode({ 5, 4096 }) end, "decode: token 4096 at position 2 is out of range [0, 4096)")
    err(function() tok:decode({ -1 }) end, "token -1 at position 1 is out of range")
    err(function() tok:decode({ 1.5 }) end, "token 1.5 at position 1")
    err(function() tok:decode(engine.tensor({ 1, 9999 })) end, "token 9999 at position 2")
    err(function() tok:decode("abc") end, "decode: expected a list of token ids or a tensor")
    err(function() tok:encode(7) end, "encode: expected a string, got number")
    err(function() tok:encode("x", { tensr = true }) end, "encode: unknown option 'tensr'")
    err(function() data.load_tokenizer("byte"):encode("x", { tensr = true }) end, "encode: unknown option 'tensr'")
  end)
end)
