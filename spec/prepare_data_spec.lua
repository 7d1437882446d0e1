-- tools/prepare_data.lua on your own text (--input), with a BPE tokenizer (--tokenizer, the vocab size in the
-- shard header, <|endoftext|> first), an output prefix (--out), train shards of at most N tokens
-- (--shard_tokens), byte-level shards, skipping valid outputs, and its usage errors.  Runs the tool as a child
-- process; needs neither the bible package nor Python.
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local data = engine.data
local proc = require("spec.helpers.proc")

local TMP = os.tmpname()
os.remove(TMP)
os.execute("mkdir -p '" .. TMP .. "'")
teardown(function() os.execute("rm -rf '" .. TMP .. "'") end)

local KJV = "data/tokenizers/kjv-bpe-4k"

local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end
local function tool(...) return proc.job(0, "tools/prepare_data.lua", { ... }) end

-- the text: paragraphs, so the split falls after a blank line
local paras = {}
for i = 1, 40 do
  paras[i] = string.format("Paragraph %d. And it came to pass, that the word's %d-th line\nwent on; café, straße.", i, i * 7)
end
local TEXT = table.concat(paras, "\n\n") .. "\n"
local INPUT = TMP .. "/my text.txt"
write(INPUT, TEXT)

describe("tools/prepare_data.lua", function()
  it("writes BPE shards of your own text: vocab size in the header, <|endoftext|> first, the text split once", function()
    local out, rc = tool("--input='" .. INPUT .. "'", "--tokenizer=" .. KJV, "--out=" .. TMP .. "/mine",
      "--val_frac=0.2")
    assert.are.equal(0, rc, out)
    assert.is_truthy(out:find("wrote " .. TMP .. "/mine_train.bin", 1, true), out)
    local tok = data.load_tokenizer(KJV)
    local tr, va = data.read_shard(TMP .. "/mine_train.bin"), data.read_shard(TMP .. "/mine_val.bin")
    assert.are.same({ 4096, 4096, 2, 2 }, { tr.vocab_size, va.vocab_size, tr.token_bytes, va.token_bytes })
    assert.are.same({ tok.eot, tok.eot }, { tr:get(0), va:get(0) })
    local a, b = tok:decode(tr:tensor(1)), tok:decode(va:tensor(1))
    assert.are.equal(TEXT, a .. b)
    assert.is_truthy(b:match("^Paragraph %d+%. "), b:sub(1, 40))   -- after a blank line
    assert.is_true(#b <= 0.2 * #TEXT and #b > 0.2 * #TEXT - 200, #b .. " of " .. #TEXT)
    -- the ids are the tokenizer's for each split
    assert.are.same(tok:encode(a), tr:tensor(1):tolist())
    -- present and valid: skipped; --force=true rewrites
    out, rc = tool("--input='" .. INPUT .. "'", "--tokenizer=" .. KJV, "--out=" .. TMP .. "/mine", "--val_frac=0.2")
    assert.are.equal(0, rc, out)
    assert.is_truthy(out:find("present and valid; skipping", 1, true), out)
    out, rc = tool("--input='" .. INPUT .. "'", "--tokenizer=" .. KJV, "--out=" .. TMP .. "/mine", "--val_frac=0.2",
      "--force=true")
    assert.is_truthy(out:find("wrote", 1, true), out)
  end)

  it("splits the train tokens into numbered shards that a glob reads back in order", function()
    local out, rc = tool("--input='" .. INPUT .. "'", "--tokenizer=" .. KJV .. "/tokenizer.json",
      "--out=" .. TMP .. "/sh", "--shard_tokens=100", "--val_frac=0.1")
    assert.are.equal(0, rc, out)
    local ss = data.read_shards(TMP .. "/sh_train_*.bin")
    assert.is_true(#ss >= 3, out)
    for i = 1, #ss - 1 do assert.are.equal(100, ss[i].n) end
    assert.is_true(ss[#ss].n <= 100)
    assert.are.equal(string.format("%s/sh_train_%06d.bin", TMP, #ss - 1), ss.paths[#ss])
    local tok = data.load_tokenizer(KJV)
    local parts = {}
    for i, s in ipairs(ss) do parts[i] = tok:decode(s:tensor()) end
    local val = data.read_shard(TMP .. "/sh_val.bin")
    assert.are.equal("<|endoftext|>" .. TEXT, table.concat(parts) .. tok:decode(val:tensor(1)))
    assert.are.equal(4096, ss.vocab_size)
  end)

  it("writes byte-level shards of a text file (header slot 3 stays 0)", function()
    local out, rc = tool("--input='" .. INPUT .. "'", "--out=" .. TMP .. "/bytes")
    assert.are.equal(0, rc, out)
    local tr, va = data.read_shard(TMP .. "/bytes_train.bin"), data.read_shard(TMP .. "/bytes_val.bin")
    assert.is_nil(tr.vocab_size)
    assert.are.equal(TEXT, data.decode(tr:tensor()) .. data.decode(va:tensor()))
  end)

  it("names a bad option, input or tokenizer (exit status 2)", function()
    local out, rc = tool("--input=" .. TMP .. "/none.txt", "--out=" .. TMP .. "/x")
    assert.are.equal(2, rc, out)
    assert.is_truthy(out:find("--input: cannot open " .. TMP .. "/none.txt", 1, true), out)
    out, rc = tool("--input='" .. INPUT .. "'", "--tokenizer=" .. TMP .. "/nothing", "--out=" .. TMP .. "/x")
    assert.are.equal(2, rc, out)
    assert.is_truthy(out:find("--tokenizer: load_tokenizer: " .. TMP .. "/nothing: no such file or folder", 1, true), out)
    out, rc = tool("--input='" .. INPUT .. "'", "--shard_tokens=10", "--out=" .. TMP .. "/x")
    assert.are.equal(2, rc, out)
    assert.is_truthy(out:find("--shard_tokens needs a BPE --tokenizer", 1, true), out)
    out, rc = tool("--val_frac=1.5")
    assert.are.equal(2, rc, out)
    assert.is_truthy(out:find("--val_frac must be in (0, 1)", 1, true), out)
  end)
end)
