-- engine.data.tokenizer: the byte-level tokenizer (vocab 256: token = byte value; name "byte", no eot).
-- BPE tokenizers (the same encode/decode/vocab_size/eot/name) are engine.data.bpe, both through
-- data.load_tokenizer(spec).
--   local tok = data.ByteTokenizer()
--   local ids = tok:encode("hello")            -- {104, 101, 108, 108, 111} (0-based ids)
--   local t = tok:encode("hello", {tensor = true})   -- i64 [5]
--   tok:decode(ids) == "hello"
local core = require("engine.core")
local ffi, C = core.ffi, core.C

local M = {}

local ByteTokenizer = {}
ByteTokenizer.__index = ByteTokenizer
ByteTokenizer.vocab_size = 256
ByteTokenizer.name = "byte"
ByteTokenizer.eot = nil          -- no end-of-text token: every id is a byte
M.ByteTokenizer = setmetatable(ByteTokenizer, { __call = function(cls) return setmetatable({}, cls) end })

-- encode(s [, {tensor = false}]) -> list of byte values, or an i64 tensor
function ByteTokenizer:encode(s, opts)
  if type(s) ~= "string" then error("encode: expected a string, got " .. type(s), 2) end
  if opts ~= nil then
    if type(opts) ~= "table" then error("encode: options must be a table, got " .. type(opts), 2) end
    for k in pairs(opts) do
      if k ~= "tensor" then error("encode: unknown option '" .. tostring(k) .. "' (known: tensor)", 2) end
    end
  end
  local n = #s
  if opts and opts.tensor then
    local shape = ffi.new("int64_t[1]", n)
    local t = core.wrap(C.eng_tensor_empty(1, shape, 5, 0))
    local p = ffi.cast("int64_t*", C.eng_tensor_data(t._c))
    local bytes = ffi.cast("const uint8_t*", s)
    for i = 0, n - 1 do p[i] = bytes[i] end
    return t
  end
  local out = {}
  for i = 1, n do out[i] = s:byte(i) end
  return out
end


-- decode(tokens): tokens is a list of ids or an integer tensor (any shape,
-- read in row-major order); every id must be a byte value 0..255.
function ByteTokenizer:decode(tokens)
  local vals, n
  if core.is_tensor(tokens) then
    n = tokens:numel()
    local buf = ffi.new("int64_t[?]", n > 0 and n or 1)
    core.check(C.eng_tensor_read(tokens._c, buf, 5, n), 2)
    vals = function(i) return tonumber(buf[i - 1]) end
  elseif type(tokens) == "table" then
    n = #tokens
    vals = function(i) return tokens[i] end
  else
    error("decode: expected a list of token ids or a tensor, got " .. type(tokens), 2)
  end
  local out = ffi.new("uint8_t[?]", n > 0 and n or 1)
  for i = 1, n do
    local v = vals(i)
    if type(v) ~= "number" or v % 1 ~= 0 or v < 0 or v > 255 then
      error(string.format("decode: token %s at position %d is not a byte value (0..255)", tostring(v), i), 2)
    end
    out[i - 1] = v
  end
  return ffi.string(out, n)
end

-- Module-level shortcuts.
local default = ByteTokenizer()
function M.encode(s, opts) return default:encode(s, opts) end
function M.decode(t) return default:decode(t) end
M.vocab_size = 256

return M
