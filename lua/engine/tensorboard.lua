-- engine.tensorboard: TensorBoard event files (scalars), readable by `tensorboard --logdir` and its
-- EventAccumulator, without TensorFlow or protobuf libraries.
--
--   local tb = require("engine.tensorboard")
--   local w = tb.writer("runs/gpt-20261128-014530")   -- events.out.tfevents.<time>.<host> in that folder
--   w:add_scalar("train/loss", 2.5, 10)                -- tag, value, step [, wall_time (s)]
--   w:add_scalars({ ["train/loss"] = 2.5, lr = 1e-3 }, 10)   -- one event, several values
--   w:flush(); w:close()
--   local events = tb.read(path)   -- {{wall_time, step, file_version = s | nil, scalars = {tag = value}}, ...}
--
-- The format: TFRecord framing (uint64 length, masked CRC-32C of the length, the bytes, masked CRC-32C of the
-- bytes; little-endian) around Event protos: wall_time (1, double), step (2, int64), file_version (3, string:
-- "brain.Event:2" in the first record), summary (5: repeated Summary.Value value (1): tag (1, string),
-- simple_value (2, float)).  read() checks both CRCs of every record.  Recipes write one when run with
-- --tensorboard=1 (engine.run: the rows of metrics.jsonl as scalars).
local ffi = require("ffi")
local bit = require("bit")

local M = {}

-- ------------------------------------------------------------------ CRC-32C (Castagnoli)
local crc_table = ffi.new("uint32_t[256]")
for i = 0, 255 do
  local c = i
  for _ = 1, 8 do
    if bit.band(c, 1) ~= 0 then c = bit.bxor(bit.rshift(c, 1), 0x82F63B78) else c = bit.rshift(c, 1) end
  end
  crc_table[i] = c
end

-- crc32c(s) -> the CRC-32C of the string s (a number in 0 .. 2^32 - 1)
function M.crc32c(s)
  local c = 0xFFFFFFFF
  local p = ffi.cast("const uint8_t*", s)
  for i = 0, #s - 1 do
    c = bit.bxor(crc_table[bit.band(bit.bxor(c, p[i]), 0xFF)], bit.rshift(c, 8))
  end
  c = bit.bxor(c, 0xFFFFFFFF)
  return c < 0 and c + 2 ^ 32 or c
end

local function masked_crc(s)
  local c = M.crc32c(s)
  local r = bit.bor(bit.rshift(c, 15), bit.lshift(c, 17))
  if r < 0 then r = r + 2 ^ 32 end
  return (r + 0xa282ead8) % 2 ^ 32
end
M.masked_crc = masked_crc

local function u32(x) local b = ffi.new("uint32_t[1]", x); return ffi.string(b, 4) end
local function u64(x) local b = ffi.new("uint64_t[1]", x); return ffi.string(b, 8) end
local function f64(x) local b = ffi.new("double[1]", x); return ffi.string(b, 8) end
local function f32(x) local b = ffi.new("float[1]", x); return ffi.string(b, 4) end

local function varint(n)
  local out = {}
  n = ffi.cast("uint64_t", n)
  repeat
    local b = tonumber(bit.band(n, 0x7F))
    n = bit.rshift(n, 7)
    if n ~= 0 then b = b + 0x80 end
    out[#out + 1] = string.char(b)
  until n == 0
  return table.concat(out)
end

local function field_bytes(num, s) return varint(num * 8 + 2) .. varint(#s) .. s end

-- event(wall_time, step, {file_version = s} or {scalars = {tag = value}}) -> the Event proto's bytes
local function event(wall_time, step, t)
  local parts = { string.char(0x09) .. f64(wall_time) }
  if step and step ~= 0 then parts[#parts + 1] = string.char(0x10) .. varint(step) end
  if t.file_version then parts[#parts + 1] = field_bytes(3, t.file_version) end
  if t.scalars then
    local tags = {}
    for tag in pairs(t.scalars) do tags[#tags + 1] = tag end
    table.sort(tags)
    local values = {}
    for _, tag in ipairs(tags) do
      values[#values + 1] = field_bytes(1, field_bytes(1, tag) .. string.char(0x15) .. f32(t.scalars[tag]))
    end
    parts[#parts + 1] = field_bytes(5, table.concat(values))
  end
  return table.concat(parts)
end

local function record(data)
  local len = u64(#data)
  return len .. u32(masked_crc(len)) .. data .. u32(masked_crc(data))
end

-- ------------------------------------------------------------------ writer
pcall(ffi.cdef, "typedef struct { long tv_sec; long tv_nsec; } eng_tb_timespec; int clock_gettime(int, eng_tb_timespec*);")
local ts = ffi.new("eng_tb_timespec")
-- seconds since the epoch, with the fraction (CLOCK_REALTIME)
local function wall()
  if ffi.C.clock_gettime(0, ts) ~= 0 then return os.time() end
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end
M.wall_time = wall

local Writer = {}
Writer.__index = Writer

local function hostname()
  local f = io.open("/proc/sys/kernel/hostname")
  local h = f and f:read("*l") or "localhost"
  if f then f:close() end
  return h
end

-- writer(dir [, {filename_suffix = ""}]) -> a Writer appending to a new events file in dir (which must exist)
function M.writer(dir, opts)
  opts = opts or {}
  for k in pairs(opts) do
    if k ~= "filename_suffix" then error("tensorboard.writer: unknown option '" .. tostring(k) .. "'", 2) end
  end
  local now = wall()
  local path = string.format("%s/events.out.tfevents.%d.%s%s", dir, math.floor(now), hostname(),
    opts.filename_suffix or "")
  local f, err = io.open(path, "wb")
  if not f then error("tensorboard.writer: cannot create " .. tostring(err), 2) end
  local w = setmetatable({ path = path, f = f }, Writer)
  f:write(record(event(now, 0, { file_version = "brain.Event:2" })))
  f:flush()
  return w
end


-- w:add_scalars({tag = value, ...}, step [, wall_time]): one event; values must be finite numbers (others skipped)
function Writer:add_scalars(values, step, wall_time)
  if not self.f then error("tensorboard: the writer is closed", 2) end
  local t, n = {}, 0
  for tag, v in pairs(values) do
    if type(tag) ~= "string" then error("tensorboard: a tag must be a string", 2) end
    if type(v) == "number" and v == v and v ~= math.huge and v ~= -math.huge then t[tag] = v; n = n + 1 end
  end
  if n == 0 then return end
  if type(step) ~= "number" or step < 0 or step % 1 ~= 0 then
    error("tensorboard: step must be a non-negative integer, got " .. tostring(step), 2)
  end
  self.f:write(record(event(wall_time or wall(), step, { scalars = t })))
end

function Writer:add_scalar(tag, value, step, wall_time)
  return self:add_scalars({ [tag] = value }, step, wall_time)
end

function Writer:flush() if self.f then self.f:flush() end end
function Writer:close() if self.f then self.f:close(); self.f = nil end end

-- ------------------------------------------------------------------ reader (for specs and tools)
local function read_varint(s, pos)
  local n, shift = 0, 0
  while true do
    local b = s:byte(pos)
    if not b then error("tensorboard.read: truncated varint", 0) end
    n = n + bit.band(b, 0x7F) * 2 ^ shift
    pos, shift = pos + 1, shift + 7
    if b < 0x80 then return n, pos end
  end
end

-- parse(bytes) -> a list of {field, wire type, value (number or string)} of a proto message
local function parse(s)
  local out, pos = {}, 1
  while pos <= #s do
    local key
    key, pos = read_varint(s, pos)
    local field, wt = math.floor(key / 8), key % 8
    local v
    if wt == 0 then v, pos = read_varint(s, pos)
    elseif wt == 1 then v = ffi.cast("const double*", ffi.cast("const char*", s:sub(pos, pos + 7)))[0]; pos = pos + 8
    elseif wt == 5 then v = ffi.cast("const float*", ffi.cast("const char*", s:sub(pos, pos + 3)))[0]; pos = pos + 4
    elseif wt == 2 then
      local len
      len, pos = read_varint(s, pos)
      v = s:sub(pos, pos + len - 1)
      pos = pos + len
    else error("tensorboard.read: unsupported wire type " .. wt, 0) end
    out[#out + 1] = { field, wt, v }
  end
  return out
end

-- read(path) -> the events of a file (CRCs checked; an error names the record)
function M.read(path)
  local f, err = io.open(path, "rb")
  if not f then error("tensorboard.read: cannot open " .. tostring(err), 2) end
  local s = f:read("*a")
  f:close()
  local events, pos, n = {}, 1, 0
  while pos <= #s do
    n = n + 1
    if pos + 11 > #s then error(string.format("tensorboard.read: %s: record %d is truncated", path, n), 2) end
    local lenb = s:sub(pos, pos + 7)
    local len = tonumber(ffi.cast("const uint64_t*", ffi.cast("const char*", lenb))[0])
    local lcrc = tonumber(ffi.cast("const uint32_t*", ffi.cast("const char*", s:sub(pos + 8, pos + 11)))[0])
    if lcrc ~= masked_crc(lenb) then error(string.format("tensorboard.read: %s: record %d: bad length CRC", path, n), 2) end
    local data = s:sub(pos + 12, pos + 11 + len)
    local dcrc = tonumber(ffi.cast("const uint32_t*", ffi.cast("const char*", s:sub(pos + 12 + len, pos + 15 + len)))[0])
    if #data ~= len or dcrc ~= masked_crc(data) then
      error(string.format("tensorboard.read: %s: record %d: bad data CRC", path, n), 2)
    end
    pos = pos + 16 + len
    local ev = { step = 0, scalars = {} }
    for _, fld in ipairs(parse(data)) do
      if fld[1] == 1 then ev.wall_time = tonumber(fld[3])
      elseif fld[1] == 2 then ev.step = fld[3]
      elseif fld[1] == 3 then ev.file_version = fld[3]
      elseif fld[1] == 5 then
        for _, val in ipairs(parse(fld[3])) do
          if val[1] == 1 then
            local tag, x
            for _, vf in ipairs(parse(val[3])) do
              if vf[1] == 1 then tag = vf[3] elseif vf[1] == 2 then x = tonumber(vf[3]) end
            end
            if tag then ev.scalars[tag] = x end
          end
        end
      end
    end
    events[#events + 1] = ev
  end
  return events
end

return M
