-- Fuzz target for the dist.checkpoint metadata reader written in Lua (lua/engine/distributed/checkpoint.lua:
-- read_metadata, the entry check, the `v:` value parser), run by the engine host, not libFuzzer:
--
--   build/engine spec/fuzz/fuzz_dcp_metadata.lua [SECONDS] [SEED] [--test]        (tools/fuzz.sh runs it)
--
-- It starts from the committed corpus spec/fuzz/corpus/dcp_metadata/*.metadata (the .metadata files of small
-- checkpoints: tensors, DTensors, nested values, int64/uint64, escaped strings) and mutates each document with a
-- seeded PRNG, at two levels: (1) the metadata table (values: byte flips, insertions, truncation, duplicated and
-- missing table keys, huge numbers, wrong types, deep nesting; keys: missing `format`, `id`, `world_size`,
-- wrong types), written back as a safetensors file with its metadata checksum recomputed (most of the time) so
-- the mutation reaches the parsers; (2) the file's bytes (flips, truncation).  Each mutant goes through
-- dist.checkpoint.read_metadata, which must return a well-formed result or raise a string error naming
-- checkpoint (never crash, hang or raise an internal Lua error); the value parser is also driven directly,
-- with a round trip check: a value it accepts serializes and parses back to the same text.
-- --test (make test's fuzz stage): one pass, each corpus document and a fixed number of mutants of it.
-- Output ends like a libFuzzer run for tools/fuzz.sh: "stat::number_of_executed_units: N"; exit 1 on a finding,
-- the seed and iteration in the report (rerun with that seed to reproduce).
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local bit = require("bit")
local ffi = require("ffi")
local sweep = require("spec.fuzz.api_sweep")
local dcp = engine.distributed.checkpoint

local secs, seed, test = 10, 1, false
do
  local nums = {}
  for _, a in ipairs(arg or {}) do
    if a == "--test" then test = true elseif tonumber(a) then nums[#nums + 1] = tonumber(a) end
  end
  secs, seed = nums[1] or secs, nums[2] or seed
end

local CORPUS = "spec/fuzz/corpus/dcp_metadata"
local files = {}
do
  local p = io.popen("ls -1 " .. CORPUS .. "/*.metadata 2>/dev/null")
  for l in p:lines() do files[#files + 1] = l end
  p:close()
end
assert(#files > 0, "fuzz_dcp_metadata: no corpus in " .. CORPUS)
local docs = {}
for i, f in ipairs(files) do
  local _, meta = engine.load(f)
  docs[i] = meta
end

local TMP = os.tmpname()
os.remove(TMP)
assert(os.execute("mkdir -p '" .. TMP .. "'"))
local PATH = TMP .. "/.metadata"

local INTERNAL = { "attempt to ", "bad argument #", "table index is ", "stack overflow", "invalid key to 'next'",
  "number has no integer representation", "cannot convert '", "not enough memory", "<no message>" }
local function bad_error(e, need)
  if type(e) ~= "string" then return "a non-string error (" .. type(e) .. ")" end
  for _, p in ipairs(INTERNAL) do if e:find(p, 1, true) then return "an internal error" end end
  if not e:find(need, 1, true) then return "the message does not name " .. need end
end

-- ---------------------------------------------------------------- mutations
local function copy(t) local c = {} for k, v in pairs(t) do c[k] = v end return c end
local function keys_of(t) local k = {} for x in pairs(t) do k[#k + 1] = x end table.sort(k) return k end

local NUMS = { "0", "-1", "1e308", "1e309", "-1e999", "18446744073709551615U", "18446744073709551616U",
  "99999999999999999999999U", "-1U", "9223372036854775807L", "9223372036854775808L", "-9223372036854775808L",
  "-99999999999999999999L", "nan", "inf", "-inf", "0x10", "1.5e", ".", "-", "1..2", "4.9e-324" }
local FRAGS = { "{", "}", "[", "]=", ",", '"', "\\", "\\999", "\\0", "\\x", "true", "false", "nan", '"a"', "[1]=2",
  "[nan]=1", '["k"]=1', "{}", "\0", "\n", "L", "U" }

local function mutate_text(r, s)
  local k = r:int(1, 12)
  if k == 1 and #s > 0 then            -- flip a byte
    local i = r:int(1, #s)
    return s:sub(1, i - 1) .. string.char(bit.bxor(s:byte(i), bit.lshift(1, r:int(0, 7)))) .. s:sub(i + 1)
  elseif k == 2 then                   -- truncate
    return s:sub(1, r:int(0, #s))
  elseif k == 3 then                   -- insert a fragment
    local i = r:int(0, #s)
    return s:sub(1, i) .. r:pick(FRAGS) .. s:sub(i + 1)
  elseif k == 4 then                   -- a number in place of another
    local n = r:pick(NUMS)
    local j = 0
    local target = r:int(1, 4)
    return (s:gsub("%-?%d+%.?%d*[eE]?%-?%d*[LU]?", function(x) j = j + 1; if j == target then return n end end))
  elseif k == 5 then                   -- duplicate a table entry
    local a, b = s:find("%[[^%]]*%]=[^,{}]*")
    if a then return s:sub(1, b) .. "," .. s:sub(a, b) .. s:sub(b + 1) end
    return '{["a"]=1,["a"]=2}'
  elseif k == 6 then                   -- drop a table entry
    return (s:gsub("%[[^%]]*%]=[^,{}]*,?", "", 1))
  elseif k == 7 then                   -- deep nesting
    local d = r:pick({ 10, 63, 64, 65, 200, 5000 })
    local kk = r:pick({ "[1]=", '["x"]=' })
    return string.rep("{" .. kk, d) .. r:pick({ "1", "", "{}" }) .. string.rep("}", d)
  elseif k == 8 then                   -- a wrong type altogether
    return r:pick(NUMS)
  elseif k == 9 then                   -- a long string
    return '"' .. string.rep(r:pick({ "a", "\\n", "\\255", "\\\\" }), r:int(1, 20000)) .. '"'
  elseif k == 10 then                  -- splice two documents' texts
    local i = r:int(0, #s)
    return s:sub(1, i) .. s:sub(r:int(1, math.max(1, #s)))
  elseif k == 11 then                  -- repeat a piece
    local i = r:int(1, math.max(1, #s))
    return s .. s:sub(i, i + r:int(0, 30))
  end
  return r:pick(FRAGS) .. s
end

local META_KEYS = { "format", "checksum", "id", "world_size", "meta_xxh64" }
local function mutate_meta(r, meta)
  local m = copy(meta)
  for _ = 1, r:int(1, 3) do
    local k = r:int(1, 8)
    local keys = keys_of(m)
    if k <= 4 and #keys > 0 then                   -- a value's text
      local key = r:pick(keys)
      m[key] = mutate_text(r, m[key])
    elseif k == 5 and #keys > 0 then               -- a key dropped
      m[r:pick(keys)] = nil
    elseif k == 6 then                             -- a top-level key's value replaced
      m[r:pick(META_KEYS)] = r:pick({ "", "0", "-3", "1e300", "2.5", "engine-dcp/1", "engine-dcp/2", "engine-dcp/9",
        "fnv", "xxh64", "md5", string.rep("i", 56), "1", "4" })
    elseif k == 7 then                             -- a new entry
      local kind = r:pick({ "t:", "v:", "v:", "x:" })
      m[kind .. r:pick({ "a", "", "b.c", "\n", "model.w" })] = mutate_text(r, r:pick({ "1", "f32|2,3|0:64:24:0000000000000000:0,0:2,3", "{}" }))
    else                                           -- a key renamed
      if #keys > 0 then
        local key = r:pick(keys)
        local v = m[key]
        m[key] = nil
        m[mutate_text(r, key)] = v
      end
    end
  end
  return m
end

-- ---------------------------------------------------------------- checks
local function valid_value(v, depth)
  local t = type(v)
  if t == "number" or t == "string" or t == "boolean" then return true end
  if t == "cdata" then return ffi.istype("int64_t", v) or ffi.istype("uint64_t", v) end
  if t == "table" and depth < 70 then
    for k, x in pairs(v) do
      if (type(k) ~= "string" and type(k) ~= "number") or not valid_value(x, depth + 1) then return false end
    end
    return true
  end
  return false
end

local function check_result(res)
  if type(res) ~= "table" then return "read_metadata returned a " .. type(res) end
  if type(res.id) ~= "string" then return "id is not a string" end
  local n = res.world_size
  if type(n) ~= "number" or n < 1 or n % 1 ~= 0 then return "bad world_size " .. tostring(n) end
  for k, e in pairs(res.tensors) do
    if type(e.dtype) ~= "string" or type(e.shape) ~= "table" then return "tensor '" .. k .. "' malformed" end
    for _, s in ipairs(e.shape) do
      if type(s) ~= "number" or s < 0 or s % 1 ~= 0 then return "tensor '" .. k .. "' has size " .. tostring(s) end
    end
  end
  for k, v in pairs(res.values) do
    if not valid_value(v, 0) then return "value '" .. k .. "' is not a plain value" end
  end
end

local execs, findings = 0, {}
local function finding(what, it, detail)
  findings[#findings + 1] = string.format("seed %d iteration %d: %s: %s", seed, it, what, detail)
  io.stderr:write("fuzz_dcp_metadata FINDING ", findings[#findings], "\n")
end

local function write(path, s) local f = assert(io.open(path, "wb")); f:write(s); f:close() end
local function read(path) local f = assert(io.open(path, "rb")); local s = f:read("*a"); f:close(); return s end

local function one(r, it)
  local doc = docs[r:int(1, #docs)]
  local how = r:int(1, 10)
  if how <= 7 then
    local m = mutate_meta(r, doc)
    if r:chance(0.85) and m.format == dcp.FORMAT then m.meta_xxh64 = nil; m.meta_xxh64 = engine.metadata_checksum(m, "meta_xxh64") end
    local ok, e = pcall(engine.save, PATH, {}, m)
    if not ok then
      local why = bad_error(e, "save")
      if why then finding("engine.save of a mutated metadata table", it, why .. ": " .. tostring(e)) end
      return
    end
  else
    engine.save(PATH, {}, doc)
    local s = read(PATH)
    for _ = 1, r:int(1, 4) do
      if r:chance(0.5) and #s > 0 then
        local i = r:int(1, #s)
        s = s:sub(1, i - 1) .. string.char(r:int(0, 255)) .. s:sub(i + 1)
      else s = s:sub(1, r:int(0, #s)) end
    end
    write(PATH, s)
  end
  local t0 = engine.time()
  local ok, res = pcall(dcp.read_metadata, TMP)
  local dt = engine.time() - t0
  execs = execs + 1
  if ok then
    local why = check_result(res)
    if why then finding("read_metadata accepted a bad document", it, why) end
  else
    local why = bad_error(res, "checkpoint")
    if why then finding("read_metadata", it, why .. ": " .. tostring(res)) end
  end
  if dt > 2 then finding("read_metadata", it, string.format("slow: %.1f s", dt)) end
end

-- the value parser alone, with a round trip
local function one_value(r, it)
  local doc = docs[r:int(1, #docs)]
  local vals = {}
  for k, v in pairs(doc) do if k:sub(1, 2) == "v:" then vals[#vals + 1] = v end end
  table.sort(vals)
  local s = #vals > 0 and r:pick(vals) or "1"
  for _ = 1, r:int(1, 3) do s = mutate_text(r, s) end
  execs = execs + 1
  local ok, v = pcall(dcp._deserialize, s, "k")
  if not ok then
    local why = bad_error(v, "checkpoint")
    if why then finding("the value parser", it, why .. ": " .. tostring(v) .. " (input " .. string.format("%q", s:sub(1, 200)) .. ")") end
    return
  end
  if not valid_value(v, 0) then finding("the value parser", it, "accepted a non-plain value for " .. string.format("%q", s:sub(1, 200))) return end
  local ok2, s2 = pcall(dcp._serialize, v, "k")
  if not ok2 then finding("the value parser", it, "an accepted value does not serialize: " .. tostring(s2)) return end
  local ok3, v3 = pcall(dcp._deserialize, s2, "k")
  local s3 = ok3 and dcp._serialize(v3, "k")
  if not ok3 or s3 ~= s2 then
    finding("the value parser", it, string.format("round trip differs: %q -> %q -> %s", s:sub(1, 200), s2:sub(1, 200),
      ok3 and string.format("%q", s3:sub(1, 200)) or tostring(v3)))
  end
end

local t0 = engine.time()
local it = 0
while true do
  it = it + 1
  local r = sweep.rng(seed, it)
  if r:chance(0.5) then one(r, it) else one_value(r, it) end
  if #findings >= 20 then break end
  if test then if it >= 2000 then break end
  elseif engine.time() - t0 > secs then break end
  if it % 64 == 0 then collectgarbage() end
end
os.execute("rm -rf '" .. TMP .. "'")
print(string.format("fuzz_dcp_metadata: seed %d, %d iterations, %d executions, %d findings, %.1f s", seed, it, execs,
  #findings, engine.time() - t0))
for _, f in ipairs(findings) do print("  " .. f) end
print("stat::number_of_executed_units: " .. execs)
os.exit(#findings == 0 and 0 or 1)
