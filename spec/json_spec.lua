-- engine.json: decode/encode round trips, escapes, errors
local json = require("engine.json")

describe("engine.json", function()
  it("decodes objects, arrays, numbers, strings, literals", function()
    local v = json.decode(' {"a": [1, -2.5e3, 0, null, true, false], "b": {"c": "x"}, "e": [], "o": {}} ')
    assert.are.equal(1, v.a[1]); assert.are.equal(-2500, v.a[2]); assert.are.equal(0, v.a[3])
    assert.are.equal(json.null, v.a[4]); assert.is_true(v.a[5]); assert.is_false(v.a[6])
    assert.are.equal("x", v.b.c)
    assert.is_true(json.is_array(v.e)); assert.is_false(json.is_array(v.o))
    assert.are.equal("[]", json.encode(v.e)); assert.are.equal("{}", json.encode(v.o))
  end)

  it("decodes escapes and surrogate pairs to UTF-8", function()
    local s = json.decode('"a\\"b\\\\c\\/d\\n\\t\\u00e9\\u4e2d\\ud83d\\ude00"')
    assert.are.equal('a"b\\c/d\n\té中😀', s)
  end)

  it("round-trips values, keeping floats exact", function()
    local v = { step = 10, loss = 2.123456789012345, lr = 3e-4, name = "run \"x\"\n", list = { 1, 2, 3 },
      nested = { t = true, f = false, z = json.null }, tiny = 1e-300, neg = -0.1 }
    local back = json.decode(json.encode(v))
    assert.are.same(v.list, { back.list[1], back.list[2], back.list[3] })
    for _, k in ipairs({ "step", "loss", "lr", "name", "tiny", "neg" }) do assert.are.equal(v[k], back[k]) end
    assert.are.equal(json.null, back.nested.z)
    assert.are.equal(json.encode(v), json.encode(back))
    assert.are.equal(json.encode(v, { indent = true }), json.encode(json.decode(json.encode(v, { indent = true })),
      { indent = true }))
    assert.are.equal('{"a":1,"b":[true,"x"]}', json.encode({ b = { true, "x" }, a = 1 }))
    assert.are.equal("0.1", json.encode(0.1))
  end)

  it("names the place of a syntax error", function()
    for _, bad in ipairs({ '{"a": }', '[1, 2', '{"a" 1}', '"abc', '01', '[1,]', 'tru', '{} x', '"\\q"', '' }) do
      local ok, err = pcall(json.decode, bad)
      assert.is_false(ok, bad)
      assert.matches("json.decode: .* at byte %d+ %(line %d+%)", err)
    end
    local ok, err = pcall(json.decode, '{\n"a": [1,\n x]}')
    assert.is_false(ok); assert.matches("line 3", err)
  end)

  it("refuses what JSON cannot hold", function()
    assert.has_error(function() json.encode(0 / 0) end)
    assert.has_error(function() json.encode(math.huge) end)
    assert.has_error(function() json.encode({ [true] = 1 }) end)
    local t = {}; t.self = t
    assert.has_error(function() json.encode(t) end)
    assert.has_error(function() json.encode({}, { pretty = true }) end, "json.encode: unknown option 'pretty' (options: indent)")
  end)

  it("decodes a large document quickly enough to be used for tokenizer.json", function()
    local parts = {}
    for i = 1, 50000 do parts[i] = string.format('"tok%d\\u0120x": %d', i, i) end
    local s = "{" .. table.concat(parts, ",") .. "}"
    local v = json.decode(s)
    assert.are.equal(50000, v["tok50000Ġx"])
  end)

  it("writes and reads files", function()
    local p = os.tmpname()
    json.write_file(p, { a = { 1, 2 }, b = "c" })
    assert.are.same({ 1, 2 }, { unpack(json.read_file(p).a) })
    os.remove(p)
    assert.has_error(function() json.read_file("/nonexistent/x.json") end)
  end)
end)
