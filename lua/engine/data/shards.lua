-- engine.data.shards: llm.c token shards.
-- Format: a header of 256 little-endian int32 (header[0] = 20240520 magic,
-- header[1] = 1 version, header[2] = number of tokens, the rest 0), then the
-- tokens as little-endian uint16.
--   data.write_shard("train.bin", tokens)     -- a list of ids, or an integer tensor
--   local s = data.read_shard("train.bin")    -- s.n tokens, s.tokens (uint16_t*, 0-based), s:tensor()
local core = require("engine.core")
local ffi, C = core.ffi, core.C

local M = {}
M.MAGIC, M.VERSION, M.HEADER_INTS = 20240520, 1, 256
local HEADER_BYTES = M.HEADER_INTS * 4
local CHUNK = 1048576  -- bytes per read/write

local Shard = {}
Shard.__index = Shard
M.Shard = Shard

-- write_shard(path, tokens): tokens is a Lua list of ids, an integer tensor
-- (flattened) or {data = cdata pointer, n = count}; each id must be in 0..65535.
function M.write_shard(path, tokens)
  if type(path) ~= "string" then error("write_shard: path must be a string", 2) end
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
    error("write_shard: tokens must be a list of ids or an integer tensor, got " .. type(tokens), 2)
  end
  local out = ffi.new("uint16_t[?]", n > 0 and n or 1)
  for i = 0, n - 1 do
    local v = tonumber(get(i))
    if v == nil or v % 1 ~= 0 or v < 0 or v > 65535 then
      error(string.format("write_shard: %s: token %s at index %d does not fit in uint16 (0..65535)", path,
        tostring(v), i), 2)
    end
    out[i] = v
  end
  local header = ffi.new("int32_t[?]", M.HEADER_INTS)
  header[0], header[1], header[2] = M.MAGIC, M.VERSION, n
  local f, err = io.open(path, "wb")
  if not f then error("write_shard: cannot open " .. path .. " for writing: " .. tostring(err), 2) end
  local ok, werr = f:write(ffi.string(header, HEADER_BYTES))
  local bytes = ffi.cast("const char*", out)
  local total, pos = 2 * n, 0
  while ok and pos < total do
    local len = math.min(CHUNK, total - pos)
    ok, werr = f:write(ffi.string(bytes + pos, len))
    pos = pos + len
  end
  f:close()
  if not ok then error("write_shard: writing " .. path .. " failed: " .. tostring(werr), 2) end
  return n
end

-- read_shard(path) -> Shard {path, n, tokens (uint16_t[n])}; validates the
-- header (magic, version, token count against the file size).
function M.read_shard(path)
  if type(path) ~= "string" then error("read_shard: path must be a string", 2) end
  local f, err = io.open(path, "rb")
  if not f then error("read_shard: cannot open " .. path .. ": " .. tostring(err), 2) end
  local size = f:seek("end")
  f:seek("set", 0)
  local head = f:read(HEADER_BYTES) or ""
  -- the header check is C (engine/src/io/token_shard.c, fuzzed by spec/fuzz/fuzz_token_shard.c)
  local nt = ffi.new("int64_t[1]")
  if C.eng_token_shard_parse_header(path, head, #head, size, nt) ~= 0 then
    f:close()
    error(ffi.string(C.eng_last_error()), 2)
  end
  local n = tonumber(nt[0])
  local tokens = ffi.new("uint16_t[?]", n > 0 and n or 1)
  local dst = ffi.cast("char*", tokens)
  local pos = 0
  while pos < 2 * n do
    local s = f:read(math.min(CHUNK, 2 * n - pos))
    if not s or #s == 0 then
      f:close()
      error(string.format("read_shard: %s: unexpected end of file after %d token bytes", path, pos), 2)
    end
    ffi.copy(dst + pos, s, #s)
    pos = pos + #s
  end
  f:close()
  return setmetatable({ path = path, n = n, tokens = tokens }, Shard)
end

-- Number of tokens.
function Shard:size() return self.n end

-- Token at 0-based position i.
function Shard:get(i)
  if i < 0 or i >= self.n then error(string.format("Shard:get: index %d out of range [0, %d)", i, self.n), 2) end
  return self.tokens[i]
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
  return string.format("Shard(%s, %d tokens)", self.path, self.n)
end

return M
