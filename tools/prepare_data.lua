-- tools/prepare_data.lua: text -> llm.c token shards for training (a train and a validation split).
--
--   build/engine tools/prepare_data.lua                    # the KJV Bible, bytes: data/kjv_{train,val}.bin
--   build/engine tools/prepare_data.lua --tokenizer=data/tokenizers/kjv-bpe-4k
--                                                          # the KJV, BPE: data/kjv_kjv-bpe-4k_{train,val}.bin
--   build/engine tools/prepare_data.lua --input=my.txt --tokenizer=data/tokenizers/kjv-bpe-4k --out=data/my
--                                                          # your own text: data/my_{train,val}.bin
--   options: --out_dir=data --val_frac=0.05 --force=true --shard_tokens=0 (--help lists them)
--
-- The default (no --input, --tokenizer=byte) is what `make data` / `make run` use, and its bytes never change:
--
-- Source: `bible gen1:1-rev22:21` (Debian packages bible-kjv + bible-kjv-text, installed by
-- tools/install-deps.sh).  Its output is, per chapter, a blank line, a heading ("Genesis 1",
-- "1 Samuel 3", "Song of Solomon 2"), a blank line, then verses that start with an indented verse
-- number and wrap at about 80 columns:
--     "  2 And the earth was without form, and void; and darkness was upon the face of"
--     "the deep. And the Spirit of God moved upon the face of the waters."
-- Cleaning: verse numbers are stripped and wrapped lines joined, so every verse is one line of
-- prose; each chapter keeps its heading and is separated by a blank line:
--     "Genesis 1\n\nIn the beginning God created the heaven and the earth.\nAnd the earth ...\n\nGenesis 2\n..."
-- (the heading tells the model where chapters start; verse numbers would only add digits to learn).
-- The cleaned text is written to <out_dir>/kjv.txt (tools/train_tokenizer.py trains on it).
--
-- Tokens are bytes (vocab 256; the text is pure ASCII).  The split is at the first chapter heading
-- after (1 - val_frac) of the text: everything before it is train, the rest (the last ~5%,
-- the end of the New Testament) is validation.
--
-- Files use the llm.c token-shard format (engine.data.write_shard): a header of 256 little-endian int32
-- (magic 20240520, version 1, number of tokens, vocab size or 0, zeros), then the tokens as uint16 (uint32,
-- magic 20240801 version 7, when the vocabulary has more than 65536 ids):
--     <out_dir>/kjv_train.bin, <out_dir>/kjv_val.bin       (header slot 3 = 0, as before)
-- If the outputs exist and are valid (header and size, and the tokenizer's vocab size), nothing is done
-- unless --force is given.
--
-- --tokenizer=SPEC (engine.data.load_tokenizer: a tokenizer.json, a folder with one or with vocab.json +
-- merges.txt): BPE shards whose header slot 3 holds the tokenizer's vocab size; when the tokenizer has an
-- end-of-text token, each split starts with it (as llm.c's shards start every document with
-- <|endoftext|>); the tokenizer's special tokens written in the text (e.g. <|endoftext|> between documents)
-- become their ids.  The default output prefix is <out_dir>/<kjv or the input's name>_<tokenizer folder name>.
-- --input=FILE: any text file instead of the Bible; it is split at the first paragraph break (a blank line),
-- else line break, at or after (1 - val_frac) of it.  --out=PREFIX: <PREFIX>_train.bin and <PREFIX>_val.bin.
-- --shard_tokens=N (N > 0): the train split in files of at most N tokens, <PREFIX>_train_000000.bin, ...
-- (read them back with a glob: --train='<PREFIX>_train_*.bin').
local ffi = require("ffi")
local engine = require("engine")
local cli = require("engine.cli")
local data = engine.data
local NAME = "prepare_data"

local function default_out_dir()
  return (ENGINE_HOME and ENGINE_HOME ~= "") and (ENGINE_HOME .. "/data") or "data"
end

local o = cli.parse(arg or {}, { name = NAME,
  description = "Writes llm.c token shards (a train and a validation split) from the King James Bible or any "
    .. "text file, with the byte-level tokenizer or a BPE tokenizer.",
  options = {
    { "out_dir", default_out_dir(), "the folder of the outputs (and of kjv.txt)" },
    { "val_frac", 0.05, "the fraction of the text that is validation (split at a chapter or paragraph)",
      min = 1e-9 },
    { "force", false, "rewrite the outputs even when they exist and are valid" },
    { "tokenizer", "byte", "\"byte\", or a BPE tokenizer: a tokenizer.json or a folder (vocab.json + merges.txt)" },
    { "input", "", "a UTF-8 text file to tokenize instead of the KJV Bible" },
    { "out", "", "the output prefix: <out>_train.bin, <out>_val.bin (default <out_dir>/kjv, or from the "
      .. "input's and the tokenizer's names)" },
    { "shard_tokens", 0, "split the train tokens into files of at most this many (0: one file)", int = true,
      min = 0 },
  } })
if o.val_frac >= 1 then cli.usage_error(NAME, "--val_frac must be in (0, 1), got %g", o.val_frac) end

local function base_name(path)
  local b = path:gsub("/+$", ""):match("([^/]+)$") or path
  return b
end


-- Number of tokens in a valid shard (engine.data.shard_info checks magic, version and size) and its
-- header's vocab size, or nil.
local function shard_ok(path, vocab)
  local f = io.open(path, "rb")
  if not f then return nil end
  f:close()
  local ok, info = pcall(data.shard_info, path)
  if not ok or info.vocab_size ~= vocab then return nil end
  return info.tokens
end

-- Reads the whole Bible and returns the cleaned text and the byte offsets of chapter starts.
local function kjv_text()
  local p = io.popen("bible gen1:1-rev22:21 2>&1", "r")
  local raw = p and p:read("*a") or ""
  local ok = p and p:close()
  if not raw:find("In the beginning God created the heaven and the earth.", 1, true) then
    error("prepare_data: `bible gen1:1-rev22:21` failed (install the Debian packages bible-kjv and " ..
      "bible-kjv-text, e.g. with tools/install-deps.sh); it printed: " .. raw:sub(1, 200), 0)
  end
  local out, chapters = {}, {}
  local pos = 0            -- bytes emitted so far
  local verse = nil        -- parts of the verse being joined
  local prev_blank = true
  local function emit(s) out[#out + 1] = s; pos = pos + #s end
  local function flush()
    if verse then emit(table.concat(verse, " ") .. "\n"); verse = nil end
  end
  for line in raw:gmatch("([^\n]*)\n?") do
    line = line:gsub("%s+$", "")
    if line == "" then
      prev_blank = true
    else
      local num, rest = line:match("^%s+(%d+)%s+(.*)$")
      if num then
        flush()
        verse = { rest }
      elseif prev_blank and not line:match("^%s") then
        flush()                                    -- a chapter heading
        if #chapters > 0 then emit("\n") end
        chapters[#chapters + 1] = pos
        emit(line .. "\n\n")
      elseif verse then
        verse[#verse + 1] = (line:gsub("^%s+", ""))  -- continuation of a wrapped verse
      else
        error("prepare_data: unexpected line in the bible output: " .. line, 0)
      end
      prev_blank = false
    end
  end
  flush()
  return table.concat(out), chapters
end

-- A growing uint32 buffer of ids.
local function id_buffer()
  local b = { n = 0, cap = 1048576 }
  b.data = ffi.new("uint32_t[?]", b.cap)
  function b.push_list(ids)
    local k = #ids
    if b.n + k > b.cap then
      local cap = b.cap
      while b.n + k > cap do cap = cap * 2 end
      local d = ffi.new("uint32_t[?]", cap)
      ffi.copy(d, b.data, 4 * b.n)
      b.data, b.cap = d, cap
    end
    local d, n = b.data, b.n
    for i = 1, k do d[n + i - 1] = ids[i] end
    b.n = n + k
  end
  return b
end

-- Tokens of text[first..last] (1-based, inclusive) into a fresh buffer.  The text is encoded in pieces of
-- about 4 MB cut after a newline between two ASCII letters, digits or punctuation: GPT-2's split regex
-- makes such a newline a piece of its own, so the ids are those of encoding the whole range at once.
-- (A tokenizer that adds a prefix space to each text is given the whole range.)
local CHUNK = 4 * 1048576
local function encode_range(tok, text, first, last)
  local buf = id_buffer()
  if tok.eot then buf.push_list({ tok.eot }) end
  local pos = first
  while pos <= last do
    local stop = last
    if last - pos + 1 > CHUNK and not tok.add_prefix_space then
      local a = text:find("[%w%p]\n[%w%p]", pos + CHUNK)
      if a and a + 1 < last then stop = a + 1 end
    end
    buf.push_list(tok:encode(text:sub(pos, stop)))
    pos = stop + 1
  end
  return buf
end

-- Writes ids[first, first + n) (0-based) of a buffer through engine.data.write_shard, under a temporary
-- name renamed at the end, so an interrupted run never leaves a half-written shard.
local function write_shard(path, ptr, n, vocab)
  data.write_shard(path .. ".tmp", { data = ptr, n = n }, vocab and { vocab_size = vocab } or nil)
  local ok, err = os.rename(path .. ".tmp", path)
  if not ok then error("prepare_data: cannot rename " .. path .. ".tmp: " .. tostring(err), 0) end
end

local function main()
  local okt, tok = pcall(data.load_tokenizer, o.tokenizer)
  if not okt then cli.usage_error(NAME, "--tokenizer: %s", (tostring(tok):gsub("^[^:]*:%d+: ", ""))) end
  local bpe = o.tokenizer ~= "byte"
  local vocab = bpe and tok.vocab_size or nil
  if o.shard_tokens > 0 and not bpe then
    cli.usage_error(NAME, "--shard_tokens needs a BPE --tokenizer (the byte-level shards are one file each)")
  end
  local stem = o.input ~= "" and base_name(o.input):gsub("%.[^.]*$", "") or "kjv"
  local prefix = o.out ~= "" and o.out or (o.out_dir .. "/" .. stem .. (bpe and "_" .. data.tokenizer_name(o.tokenizer)
    or ""))
  local val = prefix .. "_val.bin"
  local trains = { prefix .. "_train.bin" }
  if o.shard_tokens > 0 then trains = { prefix .. string.format("_train_%06d.bin", 0) } end
  if not o.force then
    local nt, nv = shard_ok(trains[1], vocab), shard_ok(val, vocab)
    if nt and nv then
      print(string.format("prepare_data: %s (%d tokens) and %s (%d tokens) are present and valid%s; skipping "
        .. "(--force rewrites them)", trains[1], nt, val, nv, o.shard_tokens > 0 and " (first train shard)" or ""))
      return
    end
  end
  local dir = prefix:match("^(.*)/[^/]*$")
  if dir and dir ~= "" then os.execute("mkdir -p '" .. dir:gsub("'", "'\\''") .. "'") end
  local t0 = os.clock()
  local text, split, what
  if o.input == "" then
    os.execute("mkdir -p '" .. o.out_dir:gsub("'", "'\\''") .. "'")
    local chapters
    text, chapters = kjv_text()
    for i = 1, #text do
      if text:byte(i) > 127 then error("prepare_data: non-ASCII byte in the text at " .. i, 0) end
    end
    local f = assert(io.open(o.out_dir .. "/kjv.txt", "wb"))
    f:write(text)
    f:close()
    -- Split at the first chapter start at or after (1 - val_frac) of the text.
    local target = math.floor(#text * (1 - o.val_frac))
    split = #text
    for _, c in ipairs(chapters) do
      if c >= target then split = c; break end
    end
    what = string.format("%d chapters", #chapters)
  else
    local f, err = io.open(o.input, "rb")
    if not f then cli.usage_error(NAME, "--input: cannot open %s: %s", o.input, tostring(err)) end
    text = f:read("*a")
    f:close()
    if #text < 2 then cli.usage_error(NAME, "--input: %s has %d bytes: nothing to split", o.input, #text) end
    -- Split after the first blank line (else line break) at or after (1 - val_frac) of the text.
    local target = math.max(1, math.floor(#text * (1 - o.val_frac)))
    local a = text:find("\n\n", target, true)
    split = a and a + 1 or nil
    if not split or split >= #text then
      a = text:find("\n", target, true)
      split = (a and a < #text) and a or target
    end
    what = o.input
  end
  -- train = text[1..split], val = text[split + 1..]
  local nt, nv, ntrain_files
  if not bpe then
    local bytes = ffi.cast("const uint8_t*", text)
    write_shard(trains[1], bytes, split, nil)
    write_shard(val, bytes + split, #text - split, nil)
    nt, nv, ntrain_files = split, #text - split, 1
  else
    local tb = encode_range(tok, text, 1, split)
    local vb = encode_range(tok, text, split + 1, #text)
    write_shard(val, vb.data, vb.n, vocab)
    nt, nv = tb.n, vb.n
    if o.shard_tokens > 0 then
      trains = {}
      local first = 0
      while first < tb.n do
        local n = math.min(o.shard_tokens, tb.n - first)
        trains[#trains + 1] = prefix .. string.format("_train_%06d.bin", #trains)
        write_shard(trains[#trains], tb.data + first, n, vocab)
        first = first + n
      end
    else
      write_shard(trains[1], tb.data, tb.n, vocab)
    end
    ntrain_files = #trains
  end
  local secs = os.clock() - t0
  print(string.format("prepare_data: %s, %d bytes of text, tokenizer %s (vocab %d): wrote %s (%d tokens%s) and "
    .. "%s (%d tokens, %.1f%%), %.2f bytes/token, in %.2f s", what, #text, tok.name, tok.vocab_size,
    ntrain_files > 1 and (prefix .. "_train_*.bin") or trains[1], nt,
    ntrain_files > 1 and (" in " .. ntrain_files .. " files") or "", val, nv, 100 * nv / (nt + nv),
    #text / (nt + nv), secs))
  print("prepare_data: validation starts at: " .. (text:sub(split + 1, split + 40):gsub("\n", " | ")))
end

main()
