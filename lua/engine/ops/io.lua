-- engine.ops.io: safetensors files.
--
--   engine.save(path, {name = tensor, ...} [, {key = "value", ...}])
--   local tensors, metadata, names = engine.load(path)
--
-- save writes every tensor contiguous (any dtype, any strides), names in
-- sorted order, and the optional string metadata as "__metadata__"; the file
-- is written under a temporary name and renamed, so a failed save never
-- leaves a half-written file at path.  load returns a table name -> tensor,
-- the metadata table ({} when absent) and the list of names in file order.
-- Files from other safetensors writers load as long as their dtypes are
-- among F32, F64, BF16, F16, I32, I64, U8 and BOOL.
local core = require("engine.core")
local ffi, C = core.ffi, core.C

local M = {}

local function meta_string(v, k)
  local tv = type(v)
  if tv == "string" then return v end
  if tv == "number" or tv == "boolean" then return tostring(v) end
  error(string.format("save: metadata value for key '%s' must be a string, got %s", tostring(k), tv), 4)
end

function M.save(path, tensors, metadata)
  if type(path) ~= "string" then error("save: path must be a string, got " .. type(path), 2) end
  if type(tensors) ~= "table" or core.is_tensor(tensors) then
    error("save: expected a table {name = tensor, ...}", 2)
  end
  local names = {}
  for k, v in pairs(tensors) do
    if type(k) ~= "string" then
      error(string.format("save: tensor names must be strings, got a %s key", type(k)), 2)
    end
    if not core.is_tensor(v) then
      error(string.format("save: entry '%s' is a %s, not a tensor", k, type(v)), 2)
    end
    names[#names + 1] = k
  end
  table.sort(names)
  local n = #names
  local cnames = ffi.new("const char*[?]", n > 0 and n or 1)
  local cts = ffi.new("eng_tensor*[?]", n > 0 and n or 1)
  local keep = {}
  for i, k in ipairs(names) do
    local t = tensors[k]
    if t.device == "cuda" then t = t:cpu() end -- a device tensor is written from a host copy (as safetensors.torch)
    keep[#keep + 1] = k
    keep[#keep + 1] = t
    cnames[i - 1] = k
    cts[i - 1] = t._c
  end
  local keys = {}
  if metadata ~= nil then
    if type(metadata) ~= "table" then error("save: metadata must be a table of strings", 2) end
    for k in pairs(metadata) do
      if type(k) ~= "string" then
        error("save: metadata keys must be strings, got " .. type(k) .. " (the third argument is the metadata, " ..
          "a table string -> string, e.g. {format = \"x\"})", 2)
      end
      keys[#keys + 1] = k
    end
    table.sort(keys)
  end
  local nm = #keys
  local mk = ffi.new("const char*[?]", nm > 0 and nm or 1)
  local mv = ffi.new("const char*[?]", nm > 0 and nm or 1)
  for i, k in ipairs(keys) do
    local v = meta_string(metadata[k], k)
    keep[#keep + 1] = v
    mk[i - 1] = k
    mv[i - 1] = v
  end
  core.check(C.eng_safetensors_save(path, n, cnames, cts, nm, mk, mv))
  -- keep (the Lua strings behind the const char* arrays) must stay alive
  -- until the call returns: reference it afterwards.
  return keep and nil
end

-- tensor_checksum(t) -> 16 hex digits: a checksum of t's values (row-major, the bytes of its
-- dtype; any strides or device give the same string for the same data).
local sum_buf = ffi.new("uint64_t[1]")
function M.tensor_checksum(t)
  core.check(C.eng_tensor_checksum(core.ct(t, "tensor_checksum", 1), sum_buf))
  local hi = tonumber(sum_buf[0] / 0x100000000ULL)
  local lo = tonumber(sum_buf[0] % 0x100000000ULL)
  return string.format("%08x%08x", hi, lo)
end

-- metadata_checksum(meta [, skip]) -> 16 hex digits: XXH64 of a metadata table's entries in sorted key order
-- ("key" NUL "value" NUL each), the entry named skip left out (where the checksum itself is stored).  The
-- checkpoint formats store it so that a changed value (a step, a serialized option) fails the load.
function M.metadata_checksum(meta, skip)
  if type(meta) ~= "table" then
    error(string.format("metadata_checksum: meta must be a table of metadata entries, got %s", type(meta)), 2)
  end
  local keys = {}
  for k in pairs(meta) do if k ~= skip then keys[#keys + 1] = k end end
  table.sort(keys)
  local st = ffi.new("eng_xxh64_state")
  C.eng_xxh64_reset(st)
  for _, k in ipairs(keys) do
    local e = tostring(k) .. "\0" .. tostring(meta[k]) .. "\0"
    C.eng_xxh64_update(st, e, #e)
  end
  return bit.tohex(C.eng_xxh64_digest(st), 16)
end

function M.load(path)
  if type(path) ~= "string" then error("load: path must be a string, got " .. type(path), 2) end
  local f = C.eng_safetensors_load(path)
  if f == nil then error(core.last_error(), 2) end
  f = ffi.gc(f, C.eng_safetensors_free)
  local tensors, names, meta = {}, {}, {}
  for i = 0, C.eng_safetensors_count(f) - 1 do
    local name = ffi.string(C.eng_safetensors_name(f, i))
    names[#names + 1] = name
    tensors[name] = core.wrap(C.eng_safetensors_get(f, name))
  end
  for i = 0, C.eng_safetensors_meta_count(f) - 1 do
    meta[ffi.string(C.eng_safetensors_meta_key(f, i))] = ffi.string(C.eng_safetensors_meta_value(f, i))
  end
  C.eng_safetensors_free(ffi.gc(f, nil))
  return tensors, meta, names
end

return M
