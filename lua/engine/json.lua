-- engine.json: JSON (RFC 8259) to and from Lua values, for config files, Hugging Face config.json and
-- tokenizer.json, and metrics.jsonl.
--
--   local json = require("engine.json")
--   local v = json.decode('{"a": [1, 2.5, null, true], "b": "x\\u00e9"}')
--   v.a[3] == json.null                      -- null is a sentinel (a table key cannot hold nil)
--   json.encode({step = 10, loss = 2.5})     -- '{"loss":2.5,"step":10}' (object keys sorted)
--   json.encode(v, {indent = true})          -- two-space indented, one key per line
--
-- decode: objects -> tables, arrays -> lists (json.is_array(t) tells an empty array from an empty object),
-- strings -> Lua strings (UTF-8; \u escapes including surrogate pairs), numbers -> Lua numbers; a syntax error
-- names the byte offset, line and what was expected.  encode: tables with keys 1..n (or marked by json.array)
-- -> arrays, other tables -> objects (string keys; number keys written as strings), NaN/inf -> an error
-- (JSON has none), json.null -> null; integers print as integers, other numbers with 17 significant digits.
local M = {}

local byte, sub, find, char, format = string.byte, string.sub, string.find, string.char, string.format
local concat = table.concat

M.null = setmetatable({}, { __tostring = function() return "null" end, __name = "json.null" })
local array_mt = { __jsontype = "array" }
local object_mt = { __jsontype = "object" }

-- json.array(t): marks t as an array (so that an empty table encodes as [])
function M.array(t) return setmetatable(t or {}, array_mt) end
function M.object(t) return setmetatable(t or {}, object_mt) end
function M.is_array(t) return getmetatable(t) == array_mt end

-- ------------------------------------------------------------------ decode
local function line_of(s, pos)
  local line = 1
  for _ in sub(s, 1, pos - 1):gmatch("\n") do line = line + 1 end
  return line
end

local function fail(s, pos, what)
  local near = sub(s, pos, pos + 15):gsub("%c", " ")
  error(format("json.decode: %s at byte %d (line %d) near '%s'", what, pos, line_of(s, pos), near), 0)
end

local escapes = { [34] = '"', [92] = "\\", [47] = "/", [98] = "\b", [102] = "\f", [110] = "\n", [114] = "\r",
  [116] = "\t" }

local function utf8_char(c)
  if c < 0x80 then return char(c) end
  if c < 0x800 then return char(0xC0 + math.floor(c / 64), 0x80 + c % 64) end
  if c < 0x10000 then
    return char(0xE0 + math.floor(c / 4096), 0x80 + math.floor(c / 64) % 64, 0x80 + c % 64)
  end
  return char(0xF0 + math.floor(c / 262144), 0x80 + math.floor(c / 4096) % 64, 0x80 + math.floor(c / 64) % 64,
    0x80 + c % 64)
end

local decode_value

local function skip_ws(s, pos)
  local _, e = find(s, "^[ \t\r\n]+", pos)
  return e and e + 1 or pos
end

local function decode_string(s, pos) -- pos at the opening quote
  local i = pos + 1
  -- fast path: no escapes
  local e = find(s, '["\\%c]', i)
  if not e then fail(s, pos, "unterminated string") end
  if byte(s, e) == 34 then return sub(s, i, e - 1), e + 1 end
  local parts, n = {}, 0
  while true do
    e = find(s, '["\\%c]', i)
    if not e then fail(s, pos, "unterminated string") end
    local c = byte(s, e)
    if e > i then n = n + 1; parts[n] = sub(s, i, e - 1) end
    if c == 34 then return concat(parts), e + 1 end
    if c ~= 92 then fail(s, e, "control character in string") end
    local x = byte(s, e + 1)
    if x == 117 then -- \uXXXX
      local hex = sub(s, e + 2, e + 5)
      if not find(hex, "^%x%x%x%x$") then fail(s, e, "bad \\u escape") end
      local cp = tonumber(hex, 16)
      i = e + 6
      if cp >= 0xD800 and cp <= 0xDBFF then
        local lo = sub(s, i, i + 5)
        if find(lo, "^\\u[dD][c-fC-F]%x%x$") then
          cp = 0x10000 + (cp - 0xD800) * 1024 + (tonumber(sub(lo, 3), 16) - 0xDC00)
          i = i + 6
        end
      end
      n = n + 1; parts[n] = utf8_char(cp)
    else
      local r = escapes[x]
      if not r then fail(s, e, "bad escape") end
      n = n + 1; parts[n] = r
      i = e + 2
    end
  end
end

local function decode_array(s, pos)
  local t, n = setmetatable({}, array_mt), 0
  pos = skip_ws(s, pos + 1)
  if byte(s, pos) == 93 then return t, pos + 1 end
  while true do
    local v
    v, pos = decode_value(s, pos)
    n = n + 1; t[n] = v
    pos = skip_ws(s, pos)
    local c = byte(s, pos)
    if c == 93 then return t, pos + 1 end
    if c ~= 44 then fail(s, pos, "expected ',' or ']' in array") end
    pos = skip_ws(s, pos + 1)
  end
end

local function decode_object(s, pos)
  local t = setmetatable({}, object_mt)
  pos = skip_ws(s, pos + 1)
  if byte(s, pos) == 125 then return t, pos + 1 end
  while true do
    if byte(s, pos) ~= 34 then fail(s, pos, "expected a string key in object") end
    local k
    k, pos = decode_string(s, pos)
    pos = skip_ws(s, pos)
    if byte(s, pos) ~= 58 then fail(s, pos, "expected ':' after object key") end
    local v
    v, pos = decode_value(s, skip_ws(s, pos + 1))
    t[k] = v
    pos = skip_ws(s, pos)
    local c = byte(s, pos)
    if c == 125 then return t, pos + 1 end
    if c ~= 44 then fail(s, pos, "expected ',' or '}' in object") end
    pos = skip_ws(s, pos + 1)
  end
end

decode_value = function(s, pos)
  local c = byte(s, pos)
  if c == 34 then return decode_string(s, pos) end
  if c == 123 then return decode_object(s, pos) end
  if c == 91 then return decode_array(s, pos) end
  if c == 116 and sub(s, pos, pos + 3) == "true" then return true, pos + 4 end
  if c == 102 and sub(s, pos, pos + 4) == "false" then return false, pos + 5 end
  if c == 110 and sub(s, pos, pos + 3) == "null" then return M.null, pos + 4 end
  local b, e = find(s, "^-?%d+%.?%d*[eE]?[-+]?%d*", pos)
  if b then
    local str = sub(s, b, e)
    local v = tonumber(str)
    if v == nil or not find(str, "^-?0[.eE]") and find(str, "^-?0%d") then fail(s, pos, "bad number") end
    return v, e + 1
  end
  if c == nil then fail(s, pos, "unexpected end of input") end
  fail(s, pos, "unexpected character")
end

-- decode(s) -> the value of the JSON text s (one value, surrounding whitespace allowed)
function M.decode(s)
  if type(s) ~= "string" then error("json.decode: expected a string, got " .. type(s), 2) end
  local v, pos = decode_value(s, skip_ws(s, 1))
  pos = skip_ws(s, pos)
  if pos <= #s then fail(s, pos, "trailing characters after the value") end
  return v
end

-- read_file(path) -> the decoded contents of a JSON file (errors name the path)
function M.read_file(path)
  local f, err = io.open(path, "rb")
  if not f then error("json.read_file: cannot open " .. tostring(err), 2) end
  local s = f:read("*a")
  f:close()
  local ok, v = pcall(M.decode, s)
  if not ok then error(path .. ": " .. tostring(v), 2) end
  return v
end

-- ------------------------------------------------------------------ encode
local str_escape = { ['"'] = '\\"', ["\\"] = "\\\\", ["\b"] = "\\b", ["\f"] = "\\f", ["\n"] = "\\n",
  ["\r"] = "\\r", ["\t"] = "\\t" }
local function encode_string(s)
  return '"' .. s:gsub('[%c"\\]', function(c) return str_escape[c] or format("\\u%04x", byte(c)) end) .. '"'
end

local function encode_number(x)
  if x ~= x or x == math.huge or x == -math.huge then
    error("json.encode: " .. tostring(x) .. " has no JSON form", 0)
  end
  if x % 1 == 0 and math.abs(x) < 2 ^ 53 then return format("%d", x) end
  local s = format("%.17g", x)
  -- the shortest of %.15g / %.16g / %.17g that reads back the same
  for _, f in ipairs({ "%.15g", "%.16g" }) do
    local t = format(f, x)
    if tonumber(t) == x then s = t; break end
  end
  return s
end

local function is_list(t)
  local mt = getmetatable(t)
  if mt == array_mt then return true end
  if mt == object_mt then return false end
  local n = #t
  if n == 0 then return next(t) == nil and false end
  local count = 0
  for _ in pairs(t) do count = count + 1 end
  return count == n
end

local function encode_value(v, out, indent, depth, seen)
  local tv = type(v)
  if v == M.null or v == nil then out[#out + 1] = "null"
  elseif tv == "boolean" then out[#out + 1] = v and "true" or "false"
  elseif tv == "number" then out[#out + 1] = encode_number(v)
  elseif tv == "string" then out[#out + 1] = encode_string(v)
  elseif tv == "cdata" and tonumber(v) then out[#out + 1] = encode_number(tonumber(v))
  elseif tv == "table" then
    if seen[v] then error("json.encode: a table contains itself", 0) end
    seen[v] = true
    local nl = indent and ("\n" .. string.rep("  ", depth + 1)) or ""
    local close_nl = indent and ("\n" .. string.rep("  ", depth)) or ""
    if is_list(v) then
      if #v == 0 then out[#out + 1] = "[]"
      else
        out[#out + 1] = "["
        for i = 1, #v do
          if i > 1 then out[#out + 1] = "," end
          out[#out + 1] = nl
          encode_value(v[i], out, indent, depth + 1, seen)
        end
        out[#out + 1] = close_nl .. "]"
      end
    else
      local keys = {}
      for k in pairs(v) do
        local tk = type(k)
        if tk ~= "string" and tk ~= "number" then
          error("json.encode: an object key must be a string or a number, got " .. tk, 0)
        end
        keys[#keys + 1] = tostring(k)
      end
      table.sort(keys)
      if #keys == 0 then out[#out + 1] = "{}"
      else
        out[#out + 1] = "{"
        for i, k in ipairs(keys) do
          if i > 1 then out[#out + 1] = "," end
          out[#out + 1] = nl
          out[#out + 1] = encode_string(k)
          out[#out + 1] = indent and ": " or ":"
          local val = v[k]
          if val == nil then val = v[tonumber(k)] end
          encode_value(val, out, indent, depth + 1, seen)
        end
        out[#out + 1] = close_nl .. "}"
      end
    end
    seen[v] = nil
  else
    error("json.encode: cannot encode a " .. tv, 0)
  end
end

-- encode(v [, {indent = false}]) -> the JSON text of v
function M.encode(v, opts)
  if opts ~= nil then
    if type(opts) ~= "table" then error("json.encode: options must be a table", 2) end
    for k in pairs(opts) do
      if k ~= "indent" then error("json.encode: unknown option '" .. tostring(k) .. "' (options: indent)", 2) end
    end
  end
  local out = {}
  local ok, err = pcall(encode_value, v, out, opts and opts.indent, 0, {})
  if not ok then error(err, 2) end
  return concat(out)
end

-- write_file(path, v [, opts]): the JSON text of v (indented by default) and a newline, written atomically
-- (a temporary file renamed over path)
function M.write_file(path, v, opts)
  local text = M.encode(v, opts or { indent = true }) .. "\n"
  local tmp = path .. ".tmp"
  local f, err = io.open(tmp, "wb")
  if not f then error("json.write_file: cannot open " .. tostring(err), 2) end
  f:write(text)
  f:close()
  local ok, rerr = os.rename(tmp, path)
  if not ok then error("json.write_file: " .. tostring(rerr), 2) end
end

return M
