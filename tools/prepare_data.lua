-- tools/prepare_data.lua: the King James Bible as byte-level token shards.
--
--   build/engine tools/prepare_data.lua [--out_dir=data] [--val_frac=0.05] [--force]
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
-- The cleaned text is written to <out_dir>/kjv.txt.
--
-- Tokens are bytes (vocab 256; the text is pure ASCII).  The split is at the first chapter heading
-- after (1 - val_frac) of the text: everything before it is train, the rest (the last ~5%,
-- the end of the New Testament) is validation.
--
-- Files use the llm.c token-shard format: a header of 256 little-endian int32 (magic 20240520,
-- version 1, number of tokens, zeros), then the tokens as uint16:
--     <out_dir>/kjv_train.bin, <out_dir>/kjv_val.bin
-- If both exist and are valid (header and size), nothing is done unless --force is given.
local ffi = require("ffi")
local engine = require("engine")
local data = engine.data

local function parse_args(argv)
  local o = { out_dir = nil, val_frac = 0.05, force = false }
  for _, a in ipairs(argv or {}) do
    local k, v = a:match("^%-%-([%w_]+)=(.*)$")
    if not k then k = a:match("^%-%-([%w_]+)$"); v = "true" end
    if not k then error("prepare_data: bad argument '" .. a .. "' (expected --key=value)", 0) end
    if k == "out_dir" then o.out_dir = v
    elseif k == "val_frac" then
      o.val_frac = tonumber(v)
      if not o.val_frac or o.val_frac <= 0 or o.val_frac >= 1 then error("prepare_data: --val_frac must be in (0, 1)", 0) end
    elseif k == "force" then o.force = (v ~= "false" and v ~= "0")
    else error("prepare_data: unknown option --" .. k .. " (known: out_dir, val_frac, force)", 0) end
  end
  if not o.out_dir then
    o.out_dir = (ENGINE_HOME and ENGINE_HOME ~= "") and (ENGINE_HOME .. "/data") or "data"
  end
  return o
end

-- Number of tokens in a valid shard (engine.data.read_shard checks magic, version and size), or nil.
local function shard_ntokens(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  f:close()
  local ok, shard = pcall(data.read_shard, path)
  if not ok then return nil end
  return shard.n
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

-- Tokens text[first..last] (1-based, inclusive) as bytes, through engine.data.write_shard; written under
-- a temporary name and renamed, so an interrupted run never leaves a half-written shard.
local function write_shard(path, text, first, last)
  local bytes = ffi.cast("const uint8_t*", text) + (first - 1)
  data.write_shard(path .. ".tmp", { data = bytes, n = last - first + 1 })
  local ok, err = os.rename(path .. ".tmp", path)
  if not ok then error("prepare_data: cannot rename " .. path .. ".tmp: " .. tostring(err), 0) end
end

local function main(argv)
  local o = parse_args(argv)
  local train, val = o.out_dir .. "/kjv_train.bin", o.out_dir .. "/kjv_val.bin"
  if not o.force then
    local nt = shard_ntokens(train)
    local nv = shard_ntokens(val)
    if nt and nv then
      print(string.format("prepare_data: %s (%d tokens) and %s (%d tokens) are present and valid; skipping",
        train, nt, val, nv))
      return
    end
  end
  os.execute("mkdir -p '" .. o.out_dir:gsub("'", "'\\''") .. "'")
  local t0 = os.clock()
  local text, chapters = kjv_text()
  for i = 1, #text do
    if text:byte(i) > 127 then error("prepare_data: non-ASCII byte in the text at " .. i, 0) end
  end
  local f = assert(io.open(o.out_dir .. "/kjv.txt", "wb"))
  f:write(text)
  f:close()
  -- Split at the first chapter start at or after (1 - val_frac) of the text.
  local target = math.floor(#text * (1 - o.val_frac))
  local split = #text
  for _, c in ipairs(chapters) do
    if c >= target then split = c; break end
  end
  write_shard(train, text, 1, split)
  write_shard(val, text, split + 1, #text)
  local nt, nv = assert(shard_ntokens(train)), assert(shard_ntokens(val))
  print(string.format("prepare_data: %d chapters, %d bytes of text; wrote %s (%d tokens) and %s (%d tokens, %.1f%%) in %.2f s",
    #chapters, #text, train, nt, val, nv, 100 * nv / #text, os.clock() - t0))
  print("prepare_data: validation starts at: " .. text:sub(split + 1, split + 40):gsub("\n", " | "))
end

main(arg and { unpack(arg, 1, #arg) } or {})
