-- engine.data.shards: llm.c token shards.
-- Format (llm.c's dev/data/data_common.py): a header of 256 little-endian int32, then the tokens:
--   header[0] = 20240520 magic, header[1] = 1 version: tokens are little-endian uint16 (GPT-2 vocabularies);
--   header[0] = 20240801 magic, header[1] = 7 version: tokens are little-endian uint32 (llm.c's Llama 3 shards);
--   header[2] = number of tokens;
--   header[3] = the vocabulary size the ids index, or 0 when unknown (this engine's convention: llm.c writes 0
--               there and its readers ignore the slot, so these files stay readable by llm.c);
--   the rest 0.
-- write_shard writes uint16 unless an id exceeds 65535 or vocab_size is over 65536, then uint32.
--   data.write_shard("train.bin", tokens [, {vocab_size = 4096}])  -- a list of ids, or an integer tensor
--   local s = data.read_shard("train.bin")    -- s.n tokens, s.tokens (uint16_t* or uint32_t*, 0-based), s:tensor()
--   data.shard_info("train.bin")              -- {tokens =, version =, vocab_size =, ...} from the header alone
--   data.read_shards("data/x_train_*.bin")    -- a glob or a list of paths -> list of Shards in sorted order
local core = require("engine.core")
local ffi, C = core.ffi, core.C

local M = {}
M.MAGIC, M.VERSION = 20240520, 1            -- uint16 tokens
M.MAGIC_U32, M.VERSION_U32 = 20240801, 7    -- uint32 tokens
M.HEADER_INTS = 256
local HEADER_BYTES = M.HEADER_INTS * 4
local CHUNK = 1048576  -- bytes per read/write
local MAX_ID = 2147483647

local Shard = {}
Shard.__index = Shard
M.Shard = Shard

local function check_opts(opts, known, op)
  if opts == nil then return {} end
  if type(opts) ~= "table" then error(op .. ": options must be a table, got " .. type(opts), 3) end
  for k in pairs(opts) do
    if not known[k] then error(op .. ": unknown option '" .. tostring(k) .. "'", 3) end
  end
  return opts
end

-- write_shard(path, tokens [, {vocab_size = n}]): tokens is a Lua list of ids, an integer tensor
-- (flattened) or {data = cdata pointer, n = count}.  Each id must be an integer in 0 .. vocab_size - 1
-- (0 .. 2^31 - 1 without vocab_size).  Returns the number of tokens.
function M.write_shard(path, tokens, opts)
  local op = "write_shard"
  if type(path) ~= "string" then error(op .. ": path must be a string", 2) end
  opts = check_opts(opts, { vocab_size = true }, op)
  local vocab = opts.vocab_size
  if vocab ~= nil and (type(vocab) ~= "number" or vocab % 1 ~= 0 or vocab < 1 or vocab > MAX_ID) then
    error(op .. ": vocab_size must be an integer in 1 .. 2^31 - 1, got " .. tostring(vocab), 2)
  end
  local n, get
  if core.is_tensor(tokens) then
    n = tokens:numel()
    local buf = ffi.new("int64_t[?]", n > 0 and n or 1)
    core.check(C.eng_tensor_read(tokens._c, buf, 5, n), 2)
    get = function(i) return buf[i] end
  elseif type(tokens) == "table" and tokens.data ~= nil and tokens.n ~= nil then
    n = tokens.n
    get = function(i) return tokens.data[i] end
  elseif type(tokens) == "table" then
    n = #tokens
    get = function(i) return tokens[i + 1] end
  else
    error(op .. ": tokens must be a list of ids or an integer tensor, got " .. type(tokens), 2)
  end
  if n > MAX_ID then error(string.format("%s: %s: %d tokens do not fit one shard (at most 2^31 - 1)", op, path, n), 2) end
  local limit = vocab and vocab - 1 or MAX_ID
  local vals = ffi.new("uint32_t[?]", n > 0 and n or 1)
  local max_id = -1
  for i = 0, n - 1 do
    local v = tonumber(get(i))
    if v == nil or v % 1 ~= 0 or v < 0 or v > limit then
      error(string.format("%s: %s: token %s at index %d is not an id in 0..%d%s", op, path, tostring(v), i, limit,
        vocab and " (vocab_size " .. vocab .. ")" or ""), 2)
    end
    vals[i] = v
    if v > max_id then max_id = v end
  end
  local wide = max_id > 65535 or (vocab ~= nil and vocab > 65536)
  local out, width = vals, 4
  if not wide then
    width = 2
    out = ffi.new("uint16_t[?]", n > 0 and n or 1)
    for i = 0, n - 1 do out[i] = vals[i] end
  end
  local header = ffi.new("int32_t[?]", M.HEADER_INTS)
  header[0] = wide and M.MAGIC_U32 or M.MAGIC
  header[1] = wide and M.VERSION_U32 or M.VERSION
  header[2], header[3] = n, vocab or 0
  local f, err = io.open(path, "wb")
  if not f then error(op .. ": cannot open " .. path .. " for writing: " .. tostring(err), 2) end
  local ok, werr = f:write(ffi.string(header, HEADER_BYTES))
  local bytes = ffi.cast("const char*", out)
  local total, pos = width * n, 0
  while ok and pos < total do
    local len = math.min(CHUNK, total - pos)
    ok, werr = f:write(ffi.string(bytes + pos, len))
    pos = pos + len
  end
  local cok, cerr = f:close()
  if not ok or not cok then error(op .. ": writing " .. path .. " failed: " .. tostring(werr or cerr), 2) end
  return n
end

-- Opens path and checks its header in C (engine/src/io/token_shard.c, fuzzed by
-- spec/fuzz/fuzz_token_shard.c).  Returns the open file, count, bytes per token, vocab (0: unknown), header.
local function open_checked(path, op, level)
  if type(path) ~= "string" then error(op .. ": path must be a string, got " .. type(path), level + 1) end
  local f, err = io.open(path, "rb")
  if not f then error(op .. ": cannot open " .. path .. ": " .. tostring(err), level + 1) end
  local size = f:seek("end")
  f:seek("set", 0)
  local head = f:read(HEADER_BYTES) or ""
  local nt, width, vocab = ffi.new("int64_t[1]"), ffi.new("int32_t[1]"), ffi.new("int32_t[1]")
  if C.eng_token_shard_parse_header(path, head, #head, size, nt, width, vocab) ~= 0 then
    f:close()
    local msg = ffi.string(C.eng_last_error())
    if op ~= "read_shard" then msg = msg:gsub("^read_shard:", op .. ":") end
    error(msg, level + 1)
  end
  return f, tonumber(nt[0]), width[0], vocab[0]
end

local function describe_format(width)
  if width == 4 then return M.MAGIC_U32, M.VERSION_U32 end
  return M.MAGIC, M.VERSION
end

-- read_shard(path) -> Shard {path, n, tokens (uint16_t[n] or uint32_t[n]), token_bytes (2 or 4), magic,
-- version, vocab_size (nil when the header has none), max_id (-1 for an empty shard)}.  Validates the header
-- (magic, version, token count against the file size) and, when the header has a vocabulary size, that every
-- id is below it.
function M.read_shard(path)
  local op = "read_shard"
  local f, n, width, vocab = open_checked(path, op, 2)
  local tokens = ffi.new(width == 4 and "uint32_t[?]" or "uint16_t[?]", n > 0 and n or 1)
  local dst = ffi.cast("char*", tokens)
  local pos, total = 0, width * n
  while pos < total do
    local s = f:read(math.min(CHUNK, total - pos))
    if not s or #s == 0 then
      f:close()
      error(string.format("%s: %s: unexpected end of file after %d token bytes", op, path, pos), 2)
    end
    ffi.copy(dst + pos, s, #s)
    pos = pos + #s
  end
  f:close()
  local max_id, at = -1, -1
  for i = 0, n - 1 do
    local v = tokens[i]
    if v > max_id then max_id, at = v, i end
  end
  max_id = tonumber(max_id)
  if vocab > 0 and max_id >= vocab then
    error(string.format("%s: %s: token %d at index %d is not below the vocabulary size %d in the header", op,
      path, max_id, at, vocab), 2)
  end
  local magic, version = describe_format(width)
  return setmetatable({ path = path, n = n, tokens = tokens, token_bytes = width, magic = magic, version = version,
    vocab_size = vocab > 0 and vocab or nil, max_id = max_id }, Shard)
end

-- shard_info(path [, {scan = false}]) -> {path, tokens (count), magic, version, token_bytes, vocab_size (nil
-- when the header has none)}, from the header alone; with scan = true the tokens are read too and max_id
-- (the largest id, -1 when empty) is added.
function M.shard_info(path, opts)
  local op = "shard_info"
  opts = check_opts(opts, { scan = true }, op)
  local f, n, width, vocab = open_checked(path, op, 2)
  f:close()
  local magic, version = describe_format(width)
  local info = { path = path, tokens = n, magic = magic, version = version, token_bytes = width,
    vocab_size = vocab > 0 and vocab or nil }
  if opts.scan then
    local ok, s = pcall(M.read_shard, path)
    if not ok then error((tostring(s):gsub("^read_shard:", op .. ":")), 2) end
    info.max_id = s.max_id
  end
  return info
end

-- ------------------------------------------------------------------ globs
-- A Lua pattern for one glob file name (*, ?, [abc], [a-z], [!a]); nil, why for a bad one.
local function glob_pattern(g)
  local out, i, n = { "^" }, 1, #g
  while i <= n do
    local c = g:sub(i, i)
    if c == "*" then out[#out + 1] = ".*"
    elseif c == "?" then out[#out + 1] = "."
    elseif c == "[" then
      local j = i + 1
      local neg = g:sub(j, j) == "!" or g:sub(j, j) == "^"
      if neg then j = j + 1 end
      local close = g:find("]", g:sub(j, j) == "]" and j + 1 or j, true)
      if not close then return nil, "unclosed '['" end
      local body = g:sub(j, close - 1)
      local set = { neg and "[^" or "[" }
      local k = 1
      while k <= #body do
        local a = body:sub(k, k)
        if body:sub(k + 1, k + 1) == "-" and k + 2 <= #body then
          for c = a:byte(), body:byte(k + 2) do   -- Lua sets take no escaped range ends: list the range
            local ch = string.char(c)
            set[#set + 1] = ch:match("%w") and ch or "%" .. ch
          end
          k = k + 3
        else
          set[#set + 1] = a:match("%w") and a or "%" .. a
          k = k + 1
        end
      end
      set[#set + 1] = "]"
      out[#out + 1] = table.concat(set)
      i = close
    else
      out[#out + 1] = c:match("%w") and c or "%" .. c
    end
    i = i + 1
  end
  out[#out + 1] = "$"
  return table.concat(out)
end

local function is_glob(s) return s:find("[%*%?%[]") ~= nil end

-- expand(spec, op) -> list of paths: spec is a path, a glob (wildcards in the file name only; matches are
-- sorted bytewise) or a list of those (kept in the given order, each glob's matches sorted).
function M.expand(spec, op, level)
  op, level = op or "expand", (level or 1) + 1
  local list = spec
  if type(spec) == "string" then list = { spec }
  elseif type(spec) ~= "table" or #spec == 0 then
    error(op .. ": expected a path, a glob pattern or a non-empty list of paths, got " ..
      (type(spec) == "table" and "an empty list" or type(spec)), level)
  end
  local out = {}
  for i, p in ipairs(list) do
    if type(p) ~= "string" then error(string.format("%s: path %d is a %s, not a string", op, i, type(p)), level) end
    if not is_glob(p) then
      out[#out + 1] = p
    else
      local dir, name = p:match("^(.*)/([^/]*)$")
      if not dir then dir, name = ".", p end
      if is_glob(dir) then
        error(op .. ": " .. p .. ": wildcards are supported in the file name only, not in the folder", level)
      end
      local pat, why = glob_pattern(name)
      if not pat then error(op .. ": " .. p .. ": bad glob pattern (" .. why .. ")", level) end
      local ls = io.popen("ls -1A '" .. (dir == "" and "/" or dir):gsub("'", "'\\''") .. "' 2>/dev/null")
      local found = {}
      for entry in ls:lines() do
        if entry:match(pat) and (entry:sub(1, 1) ~= "." or name:sub(1, 1) == ".") then
          found[#found + 1] = (p:find("/", 1, true) and dir .. "/" or "") .. entry
        end
      end
      ls:close()
      if #found == 0 then error(op .. ": the pattern " .. p .. " matches no file", level) end
      table.sort(found)
      for _, q in ipairs(found) do out[#out + 1] = q end
    end
  end
  return out
end

-- read_shards(spec) -> list of Shards (spec: a path, a glob or a list of them, see expand) with the fields
-- n (total tokens), paths, and vocab_size (the shards' common header value, nil when none has one; shards
-- that name different sizes are an error).
function M.read_shards(spec)
  local paths = M.expand(spec, "read_shards", 2)
  local out, total, vocab, vocab_from = {}, 0, nil, nil
  for i, p in ipairs(paths) do
    local ok, s = pcall(M.read_shard, p)
    if not ok then error(s, 2) end
    out[i] = s
    total = total + s.n
    if s.vocab_size then
      if vocab and vocab ~= s.vocab_size then
        error(string.format("read_shards: %s has vocabulary size %d but %s has %d", vocab_from, vocab, p,
          s.vocab_size), 2)
      end
      vocab, vocab_from = s.vocab_size, p
    end
  end
  out.n, out.paths, out.vocab_size = total, paths, vocab
  return out
end

-- Number of tokens.
function Shard:size() return self.n end

-- Token at 0-based position i.
function Shard:get(i)
  if i < 0 or i >= self.n then error(string.format("Shard:get: index %d out of range [0, %d)", i, self.n), 2) end
  return tonumber(self.tokens[i])
end

-- tensor([start = 0 [, len = n - start]]) -> i64 tensor of tokens[start, start + len) (0-based start).
function Shard:tensor(start, len)
  start = start or 0
  len = len or (self.n - start)
  if start < 0 or len < 0 or start + len > self.n then
    error(string.format("Shard:tensor: range [%d, %d) out of [0, %d)", start, start + len, self.n), 2)
  end
  local shape = ffi.new("int64_t[1]", len)
  local t = core.wrap(C.eng_tensor_empty(1, shape, 5, 0))
  local p = ffi.cast("int64_t*", C.eng_tensor_data(t._c))
  local src = self.tokens
  for i = 0, len - 1 do p[i] = src[start + i] end
  return t
end

function Shard:__tostring()
  return string.format("Shard(%s, %d tokens%s)", self.path, self.n,
    self.vocab_size and ", vocab " .. self.vocab_size or "")
end

return M
