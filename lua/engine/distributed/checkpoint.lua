-- dist.checkpoint: distributed checkpoints (PyTorch's torch.distributed.checkpoint, DCP).
--
--   local h = dist.checkpoint.save(state, dir, {async = false})   -- collective; h:wait()
--   dist.checkpoint.load(state, dir, {strict = true})              -- collective; fills state in place
--
-- `state` is a nested table of DTensors, ShardedTensors, plain tensors and plain Lua values (numbers,
-- strings, booleans, int64/uint64 cdata and tables of them), e.g.
--   {model = model:state_dict(), optim = dist.checkpoint.get_optimizer_state_dict(model, opt),
--    step = 100, rng = engine.get_rng_state(), data = sampler:state()}
-- Keys are the dotted paths of the leaves ("model.layers.0.attention.wq.weight"); a table that holds
-- no tensor is one value.
--
-- Layout of dir: "__<rank>_0.distcp" per rank (only the chunks that rank owns, written by the C
-- writer, engine/src/checkpoint/files.c) and ".metadata" (a safetensors file without tensors whose
-- __metadata__ has "format", "id" (random, also in every data file's header), "world_size", per tensor
-- "t:<key>" = "<dtype>|<global shape>|<chunks: file, offset, bytes, checksum, box>", and per value
-- "v:<key>" = the value serialized, and "meta_xxh64" = the checksum of all the others).  Who writes what:
-- every rank's boxes (a DTensor's local shard, a ShardedTensor's local shards, a plain tensor whole: taken
-- as replicated) are gathered and each
-- distinct box is written once, by the holder with the fewest bytes so far (replicas once, spread over
-- the ranks); the values come from rank 0, unchecked: PyTorch's DCP also writes one rank's bytes of a non-tensor
-- entry (dedup_save_plans keeps it on one plan) without comparing ranks, so a per-rank value (e.g. an RNG
-- state that differs per rank) needs a per-rank key.  Partial DTensors are an error.
--
-- Crash safety: every rank writes to a temporary name, fsyncs and renames; the ranks then agree that
-- all succeeded, the chunk records are gathered and rank 0 writes the metadata (temporary name, fsync,
-- rename, fsync of the directory) last: a directory without ".metadata" is not a checkpoint.  A save into
-- a directory that holds a complete checkpoint never touches it: the new one is written beside it, in
-- "<dir>.saving" (the real path of dir, symlinks resolved, plus ".saving"), and once its metadata is
-- committed rank 0 swaps the two directories in one step (renameat2 RENAME_EXCHANGE) and removes the old
-- one.  So a save interrupted anywhere (a full disk, a rank killed) leaves the previous checkpoint
-- loadable wherever the new save goes; a failed save's staging directory is removed, a killed one's by
-- the next save into dir.  (Disk space: both checkpoints exist until the swap.)
--
-- Loading reads the metadata on every rank, checks it (entries parse and cover each tensor exactly,
-- every data file is present, carries the checkpoint's id and is long enough), matches the keys of
-- `state` (missing keys on either side name them; strict = false skips them), then for each local
-- shard reads the saved chunks that overlap it (resharding math of engine/src/dtensor/resharding.c)
-- and verifies each chunk's checksum (XXH64, read with pread in 4 MiB blocks); only when every rank
-- succeeded (agreed) are the chunks read into the state (the whole chunk or its overlapping region) and
-- the values set: a bad directory fails on every rank naming the file and loads nothing (a
-- file written in place between the passes fails pass 2 on every rank too, agreed, saying the state is
-- partly loaded).  So a checkpoint saved at any world size, mesh or placements loads into any other.
--
-- Async save: the tensors are copied into staging buffers (one memory copy) and a C thread writes
-- them; save returns a handle whose :wait() (collective) finishes the save (agreement, metadata).  A
-- second save, and a load, first wait for a pending one.
local core = require("engine.core")
local ffi, C = core.ffi, core.C

local M = {}

-- engine-dcp/2: chunk checksums are XXH64 ("checksum" = "xxh64" in the metadata); engine-dcp/1 (FNV,
-- engine.tensor_checksum's function) is still read.  engine-dcp/3: /2 plus "meta_xxh64", the checksum of
-- every other metadata entry (engine.metadata_checksum), so a changed value (the step, a serialized table)
-- or entry fails the load instead of loading; /1 and /2 files (without it) are still read.
local FORMAT = "engine-dcp/3"
M.FORMAT = FORMAT
local META_SUM = "meta_xxh64"
-- test hooks (specs only): _test.after_verify(dir) runs on this rank between a load's two passes
M._test = {}
local CHECKSUMS = { ["engine-dcp/1"] = { fnv = C.ENG_CHECKSUM_FNV, default = "fnv" },
  ["engine-dcp/2"] = { xxh64 = C.ENG_CHECKSUM_XXH64 }, ["engine-dcp/3"] = { xxh64 = C.ENG_CHECKSUM_XXH64 } }
local META = ".metadata"

local engine = require("engine")
local function D() return require("engine.distributed") end

local function data_file(dir, r) return string.format("%s/__%d_0.distcp", dir, r) end
M.data_file = data_file
M.metadata_file = function(dir) return dir .. "/" .. META end

-- ---------------------------------------------------------------- values
-- A canonical text for plain values and a small parser for it (no load(): metadata may be foreign).
local function ser(v, out, key)
  local t = type(v)
  if t == "number" then
    if v ~= v then out[#out + 1] = "nan"
    elseif v == math.huge then out[#out + 1] = "inf"
    elseif v == -math.huge then out[#out + 1] = "-inf"
    else out[#out + 1] = string.format("%.17g", v) end
  elseif t == "string" then out[#out + 1] = string.format("%q", v):gsub("\\\n", "\\n")
  elseif t == "boolean" then out[#out + 1] = v and "true" or "false"
  elseif t == "cdata" and ffi.istype("uint64_t", v) then out[#out + 1] = (tostring(v):gsub("ULL$", "")) .. "U"
  elseif t == "cdata" and ffi.istype("int64_t", v) then out[#out + 1] = (tostring(v):gsub("LL$", "")) .. "L"
  elseif t == "table" then
    local keys = {}
    for k in pairs(v) do
      if type(k) ~= "string" and type(k) ~= "number" then
        error(string.format("checkpoint.save: '%s' has a %s key; values may have string and number keys", key, type(k)), 0)
      end
      keys[#keys + 1] = k
    end
    table.sort(keys, function(a, b)
      if type(a) == type(b) then return a < b end
      return type(a) == "number"
    end)
    out[#out + 1] = "{"
    for i, k in ipairs(keys) do
      if i > 1 then out[#out + 1] = "," end
      out[#out + 1] = "["
      ser(k, out, key)
      out[#out + 1] = "]="
      ser(v[k], out, key .. "." .. tostring(k))
    end
    out[#out + 1] = "}"
  else
    error(string.format("checkpoint.save: '%s' is a %s; a state holds tensors, DTensors, ShardedTensors, numbers, " ..
      "strings, booleans, int64 cdata and tables of them", key, t), 0)
  end
end

local function serialize(v, key)
  local out = {}
  ser(v, out, key)
  return table.concat(out)
end
M._serialize = serialize

local function deserialize(s, key)
  local pos = 1
  local function fail(what)
    error(string.format("checkpoint.load: the value of '%s' in the metadata is malformed (%s at byte %d)", key, what, pos), 0)
  end
  local parse
  local function str()
    local i, buf = pos + 1, {}
    while true do
      local c = s:sub(i, i)
      if c == "" then fail("unterminated string") end
      if c == '"' then pos = i + 1; return table.concat(buf) end
      if c == "\\" then
        local n = s:sub(i + 1, i + 1)
        local map = { n = "\n", t = "\t", r = "\r", ['"'] = '"', ["\\"] = "\\", a = "\a", b = "\b", f = "\f", v = "\v" }
        if map[n] then buf[#buf + 1] = map[n]; i = i + 2
        elseif n:match("%d") then
          local d = s:match("^%d%d?%d?", i + 1)
          local code = tonumber(d)
          if code > 255 then fail("bad escape") end
          buf[#buf + 1] = string.char(code)
          i = i + 1 + #d
        else fail("bad escape") end
      else
        buf[#buf + 1] = c
        i = i + 1
      end
    end
  end
  parse = function(depth)
    if depth > 64 then fail("nesting too deep") end
    local c = s:sub(pos, pos)
    if c == '"' then return str() end
    if c == "{" then
      pos = pos + 1
      local t = {}
      if s:sub(pos, pos) == "}" then pos = pos + 1; return t end
      while true do
        if s:sub(pos, pos) ~= "[" then fail("expected '['") end
        pos = pos + 1
        local kpos = pos
        local k = parse(depth + 1)
        if (type(k) ~= "string" and type(k) ~= "number") or k ~= k then pos = kpos; fail("bad key") end
        if t[k] ~= nil then pos = kpos; fail("duplicate key " .. (type(k) == "string" and string.format("%q", k) or tostring(k))) end
        if s:sub(pos, pos + 1) ~= "]=" then fail("expected ']='") end
        pos = pos + 2
        t[k] = parse(depth + 1)
        local d = s:sub(pos, pos)
        pos = pos + 1
        if d == "}" then return t end
        if d ~= "," then fail("expected ',' or '}'") end
      end
    end
    for _, lit in ipairs({ { "true", true }, { "false", false }, { "nan", 0 / 0 }, { "-inf", -math.huge }, { "inf", math.huge } }) do
      if s:sub(pos, pos + #lit[1] - 1) == lit[1] then pos = pos + #lit[1]; return lit[2] end
    end
    -- uint64 (digits then U) and int64 (optional '-', digits, L): out of range is an error, never a wrapped value
    local n = s:match("^%-?%d+U", pos)
    if n then
      if n:sub(1, 1) == "-" then fail("negative uint64") end
      local v = 0ULL
      for i = 1, #n - 1 do
        local d = n:byte(i) - 48
        if v > (0xFFFFFFFFFFFFFFFFULL - d) / 10 then fail("uint64 out of range") end
        v = v * 10 + d
      end
      pos = pos + #n
      return v
    end
    n = s:match("^%-?%d+L", pos)
    if n then
      local neg = n:sub(1, 1) == "-"
      local v, lim = 0ULL, neg and 0x8000000000000000ULL or 0x7FFFFFFFFFFFFFFFULL
      for i = neg and 2 or 1, #n - 1 do
        local d = n:byte(i) - 48
        if v > (lim - d) / 10 then fail("int64 out of range") end
        v = v * 10 + d
      end
      pos = pos + #n
      local r = ffi.cast("int64_t", v)
      return neg and -r or r
    end
    n = s:match("^%-?[%d%.]+[eE]?[%+%-]?%d*", pos)
    if n and tonumber(n) then pos = pos + #n; return tonumber(n) end
    fail("unexpected input")
  end
  local v = parse(0)
  if pos ~= #s + 1 then fail("trailing bytes") end
  return v
end
M._deserialize = deserialize

-- ---------------------------------------------------------------- state flattening
local function is_sharded(x)
  return type(x) == "table" and type(x.local_shards) == "function" and type(x.metadata) == "function"
end
local function is_leaf_tensor(x) return core.is_tensor(x) or is_sharded(x) end

local function has_tensor(v, depth)
  if depth > 64 then return false end
  if is_leaf_tensor(v) then return true end
  if type(v) ~= "table" then return false end
  for _, x in pairs(v) do if has_tensor(x, depth + 1) then return true end end
  return false
end

-- a key as text a message can show: control bytes as \<decimal> (a NUL, a newline)
local function shown_key(k) return (k:gsub("[%z\1-\31\127]", function(c) return "\\" .. c:byte() end)) end
M._shown_key = shown_key

-- flatten(state) -> items keyed by dotted path: {key, kind = "tensor" | "value", value, parent, pkey}
local function flatten(state, op)
  if type(state) ~= "table" or is_leaf_tensor(state) then
    error(op .. ": state must be a table (e.g. {model = model:state_dict(), step = 10})", 0)
  end
  local items, keys = {}, {}
  local function walk(t, prefix, depth)
    if depth > 64 then error(op .. ": the state is nested more than 64 levels (a cycle?)", 0) end
    for k, v in pairs(t) do
      if type(k) ~= "string" and type(k) ~= "number" then
        error(string.format("%s: key under '%s' is a %s; state keys are strings or numbers", op, prefix, type(k)), 0)
      end
      local key = prefix .. tostring(k)
      if op == "checkpoint.save" and key:find("[%z\n]") then
        -- the metadata's keys and the chunk records are text: such a key would save and never load
        error(string.format("%s: the key '%s' holds a %s byte; checkpoint keys cannot hold NUL or newline bytes " ..
          "(rename the entry)", op, shown_key(key), key:find("%z") and "NUL" or "newline"), 0)
      end
      if is_leaf_tensor(v) then
        items[key] = { key = key, kind = "tensor", value = v, parent = t, pkey = k }
        keys[#keys + 1] = key
      elseif type(v) == "table" and has_tensor(v, depth + 1) then
        walk(v, key .. ".", depth + 1)
      else
        items[key] = { key = key, kind = "value", value = v, parent = t, pkey = k }
        keys[#keys + 1] = key
      end
    end
  end
  walk(state, "", 0)
  table.sort(keys)
  for i = 2, #keys do
    if keys[i] == keys[i - 1] then error(string.format("%s: two entries have the key '%s'", op, keys[i]), 0) end
  end
  return items, keys
end

-- ---------------------------------------------------------------- layouts
-- Shape/dtype of a tensor leaf and the list of its local boxes on this rank:
-- {tensor = local tensor (plain), offsets = {...} (0-based), sizes = {...}}
local function dtype_of(t)
  if is_sharded(t) then
    local md = t:metadata()
    return md.tensor_properties and md.tensor_properties.dtype or t.dtype
  end
  return t.dtype
end

local function describe_layout(t)
  if D().is_dtensor(t) then return t:_layout_str() end
  if is_sharded(t) then return "ShardedTensor " .. tostring(t.dtype) .. "[" .. table.concat(t:size(), ",") .. "]" end
  return string.format("%s[%s]", t.dtype, table.concat(t:shape(), ","))
end

local function local_boxes(t, key, op, rank)
  local dist = D()
  if dist.is_dtensor(t) then
    local pl, mesh = t.placements, t.device_mesh
    local shape = t:shape()
    for i, p in ipairs(pl) do
      if p:is_partial() then
        -- PyTorch's message (DTensor.__raise_if_contains_partial_placements), then the key and the layout
        error(string.format("%s: Any checkpointing related operations are not supported for DTensor with partial " ..
          "placements! ('%s': %s, Partial on mesh dim %d; redistribute it to Replicate() or Shard() first)",
          op, key, describe_layout(t), i), 0)
      end
    end
    local coord = mesh:get_coordinate()
    if coord == nil then return shape, {} end
    -- the shard as runs of each global dim (one per dim unless a _StridedShard splits it): one box per
    -- combination of runs, each a view of the local tensor
    local runs = dist.local_shard_runs(shape, mesh, pl)
    local loc = t:to_local()
    local boxes = { { tensor = loc, offsets = {}, sizes = {} } }
    for d = 1, #shape do
      local next_boxes, lpos = {}, 0
      for _, run in ipairs(runs[d]) do
        for _, b in ipairs(boxes) do
          local o, z = { unpack(b.offsets) }, { unpack(b.sizes) }
          o[d], z[d] = run[1], run[2]
          next_boxes[#next_boxes + 1] = { tensor = #runs[d] == 1 and b.tensor or b.tensor:narrow(d, lpos + 1, run[2]),
            offsets = o, sizes = z }
        end
        lpos = lpos + run[2]
      end
      if #runs[d] == 0 then   -- an empty shard on this dim
        for _, b in ipairs(boxes) do
          local o, z = { unpack(b.offsets) }, { unpack(b.sizes) }
          o[d], z[d] = 0, 0
          next_boxes[#next_boxes + 1] = { tensor = b.tensor, offsets = o, sizes = z }
        end
      end
      boxes = next_boxes
    end
    return shape, boxes
  elseif is_sharded(t) then
    local md = t:metadata()
    local boxes = {}
    for _, s in ipairs(t:local_shards()) do
      boxes[#boxes + 1] = { tensor = s.tensor, offsets = { unpack(s.metadata.shard_offsets) },
        sizes = { unpack(s.metadata.shard_sizes) } }
    end
    return { unpack(md.size) }, boxes
  end
  local shape = t:shape()
  local off = {}
  for d = 1, #shape do off[d] = 0 end
  return shape, { { tensor = t, offsets = off, sizes = shape } }
end

local function numel_of(sizes)
  local n = 1
  for _, s in ipairs(sizes) do n = n * s end
  return n
end

-- ---------------------------------------------------------------- collectives
local function world() return D().world_group() end
local function nranks() return D().world_size() end
local function myrank() return D().rank() end

-- agree(err_msg_or_nil, op, key, vals, n): every rank learns whether any failed; error on all ranks if so.
-- vals (optional int64_t[n]) become their maximum over the ranks, in the same all_reduce.
local function agree(err, op, key, vals, n)
  if nranks() > 1 then
    if err then C.eng_set_error_message(err) end
    local rc = C.eng_pg_agree_max(world()._c, err and 1 or 0, key or 0, op, vals, n or 0)
    if rc ~= 0 then error(core.last_error(), 0) end
  elseif err then
    error(err, 0)
  end
end

local function str_hash(s)
  local h = 1469598103934665603ULL
  for i = 1, #s do h = bit.bxor(h, s:byte(i)) * 1099511628211ULL end
  return h
end

-- all_gather of one string per rank -> list (0-based) of strings
local function gather_strings(s)
  local n = nranks()
  if n == 1 then return { [0] = s } end
  local dist = D()
  local lens = engine.zeros({ n }, { dtype = "i64" })
  lens:narrow(1, myrank() + 1, 1):fill_(#s)
  dist.all_reduce(lens, "sum")
  local l = lens:totable()
  local maxl = 1
  for i = 1, n do maxl = math.max(maxl, l[i]) end
  local buf = engine.zeros({ maxl }, { dtype = "u8" })
  if #s > 0 then ffi.copy(buf:data_ptr(), s, #s) end
  local all = engine.empty({ n * maxl }, { dtype = "u8" })
  dist.all_gather_into(all, buf)
  local p = ffi.cast("const char*", all:data_ptr())
  local out = {}
  for r = 0, n - 1 do out[r] = ffi.string(p + r * maxl, l[r + 1]) end
  return out
end

-- rank 0's part of a new checkpoint's id: two 40-bit numbers (random, time), carried by save's agreement
local function id_parts()
  local f = io.open("/dev/urandom", "rb")
  local bytes = f and f:read(8) or ""
  if f then f:close() end
  local a = 0
  for i = 1, #bytes do a = (a * 256 + bytes:byte(i)) % 2 ^ 40 end
  return a, os.time() % 2 ^ 40
end

-- ---------------------------------------------------------------- save
local Handle = {}
Handle.__index = Handle
local pending = nil
local plan_cache = nil -- the last save's choice of writers: { input = boxes and signature, keep = {bool}, tag }

-- rank 0 removes a staging directory (a failed save's, or one a killed save left)
local function remove_tree(path)
  if path and os.rename(path, path) then os.execute("rm -rf '" .. path:gsub("'", "'\\''") .. "'") end
end

-- agree(), and on an error rank 0 removes the save's staging directory first (every rank's writer has
-- finished: each finishes before it enters the agreement)
local function agree_save(h, err, op)
  local ok, e = pcall(agree, err, op)
  if not ok then
    if h.staging and myrank() == 0 then remove_tree(h.staging) end
    error(e, 0)
  end
end

local function finish_save(h)
  h._done = true
  if pending == h then pending = nil end
  local op = "checkpoint.save"
  local err
  if h.writer ~= nil then
    if C.eng_ckpt_writer_finish(h.writer) ~= 0 then err = core.last_error() end
  end
  if h.err then err = h.err end
  agree_save(h, err, op)
  -- chunk records: "key \t offset \t nbytes \t checksum \t offsets \t sizes" per line
  local lines = {}
  for i, r in ipairs(h.records) do
    local sum = C.eng_ckpt_writer_checksum(h.writer, i - 1)
    lines[#lines + 1] = table.concat({ r.key, string.format("%.0f", r.offset), string.format("%.0f", r.nbytes),
      bit.tohex(sum, 16), table.concat(r.offsets, ","), table.concat(r.sizes, ",") }, "\t")
  end
  if h.writer ~= nil then C.eng_ckpt_writer_free(ffi.gc(h.writer, nil)); h.writer = nil end
  local all = gather_strings(table.concat(lines, "\n"))
  local ok, werr = true, nil
  if myrank() == 0 then
    ok, werr = pcall(function()
      local chunks = {}
      for r = 0, nranks() - 1 do
        for line in all[r]:gmatch("[^\n]+") do
          local key, off, nb, sum, offs, sizes = line:match("^(.*)\t(%d+)\t(%d+)\t(%x+)\t([%d,]*)\t([%d,]*)$")
          if not key then error(op .. ": internal: bad chunk record from rank " .. r, 0) end
          chunks[key] = chunks[key] or {}
          local c = chunks[key]
          c[#c + 1] = { file = r, offset = tonumber(off), nbytes = tonumber(nb), sum = sum, offs = offs, sizes = sizes }
        end
      end
      local meta = { format = FORMAT, checksum = "xxh64", id = h.id, world_size = tostring(nranks()) }
      for key, info in pairs(h.tensors) do
        local parts = {}
        for i, c in ipairs(chunks[key] or {}) do
          parts[i] = string.format("%d:%.0f:%.0f:%s:%s:%s", c.file, c.offset, c.nbytes, c.sum, c.offs, c.sizes)
        end
        local entry = string.format("%s|%s|%s", info.dtype, table.concat(info.shape, ","), table.concat(parts, ";"))
        -- validated as a loader will (cover, bounds), so a bad plan fails the save, not a later load
        local dt, nd = ffi.new("int[1]"), ffi.new("int[1]")
        local shp = ffi.new("int64_t[8]")
        if C.eng_ckpt_entry_parse(op .. ": '" .. key .. "'", entry, nranks(), dt, nd, shp, nil, 0) < 0 then
          error(core.last_error(), 0)
        end
        meta["t:" .. key] = entry
      end
      for key, s in pairs(h.values) do meta["v:" .. key] = s end
      meta[META_SUM] = engine.metadata_checksum(meta, META_SUM)
      local wdir = h.staging or h.dir
      local tmp = string.format("%s/%s.tmp%d", wdir, META, myrank())
      engine.save(tmp, {}, meta)
      if C.eng_ckpt_commit_file(tmp, wdir .. "/" .. META) ~= 0 then error(core.last_error(), 0) end
      if h.staging then
        -- the switch: one rename-exchange; then the staging name holds the previous checkpoint
        if C.eng_ckpt_exchange_dirs(h.staging, h.real_dir) ~= 0 then error(core.last_error(), 0) end
        remove_tree(h.staging)
      end
    end)
  end
  agree_save(h, not ok and tostring(werr) or nil, op)
  return true
end

-- for specs: forget the cached choice of writers on this rank only (as after a save that failed here)
function M._drop_plan_cache() plan_cache = nil end

function Handle:wait()
  if not self._done then finish_save(self) end
  return self
end
function Handle:is_completed() return self._done == true end
M.SaveHandle = Handle

local function wait_pending()
  if pending then pending:wait() end
end
M.wait_pending = wait_pending
-- an async save nobody waited for is finished when the script ends (as PyTorch's async_save, whose
-- thread completes at exit): its checkpoint is complete, or the run fails with the save's error
core.at_exit(wait_pending)

local function check_opts(opts, allowed, op)
  if opts == nil then return {} end
  if type(opts) ~= "table" then error(op .. ": options must be a table", 3) end
  for k in pairs(opts) do
    if not allowed[k] then
      local names = {}
      for n in pairs(allowed) do names[#names + 1] = n end
      table.sort(names)
      error(string.format("%s: unknown option '%s' (%s)", op, tostring(k), table.concat(names, ", ")), 3)
    end
  end
  return opts
end

-- save(state, dir, {async = false}) -> handle (collective over the world).
function M.save(state, dir, opts)
  local op = "checkpoint.save"
  opts = check_opts(opts, { async = true }, op)
  if type(dir) ~= "string" or dir == "" then error(op .. ": dir must be a non-empty string", 2) end
  wait_pending()
  local rank = myrank()
  local h = setmetatable({ dir = dir, records = {}, tensors = {}, values = {}, _done = false }, Handle)
  -- local planning: every check that can fail on one rank runs before the agreement
  local err
  local lok, lerr = pcall(function()
    local items, keys = flatten(state, op)
    h.keys = keys
    h.plan = {}
    for _, key in ipairs(keys) do
      local it = items[key]
      if it.kind == "tensor" then
        local shape, boxes = local_boxes(it.value, key, op, rank)
        local dt = dtype_of(it.value)
        h.tensors[key] = { dtype = dt, shape = shape }
        for _, b in ipairs(boxes) do
          if numel_of(b.sizes) > 0 then h.plan[#h.plan + 1] = { key = key, box = b } end
        end
      else
        h.values[key] = serialize(it.value, key)
      end
    end
  end)
  if not lok then err = tostring(lerr) end
  -- the key set and shapes must be the same on every rank (rank 0 writes the metadata)
  local sig = {}
  for _, key in ipairs(h.keys or {}) do
    local t = h.tensors[key]
    sig[#sig + 1] = key .. (t and (":" .. t.dtype .. "[" .. table.concat(t.shape, ",") .. "]") or "")
  end
  local sig_s = table.concat(sig, "\n")
  -- this rank's boxes, one line each (the input of the choice of writers below)
  local mine = {}
  for i, p in ipairs(h.plan or {}) do
    mine[i] = p.key .. "\t" .. table.concat(p.box.offsets, ",") .. "\t" .. table.concat(p.box.sizes, ",")
  end
  local mine_s = table.concat(mine, "\n") .. "\0" .. sig_s
  local cached = plan_cache and plan_cache.input == mine_s and plan_cache or nil
  -- one agreement (a single small all_reduce) carries: any rank's error, the signature, rank 0's id for the
  -- new checkpoint, and whether every rank can reuse the last save's choice of writers (its boxes unchanged
  -- and the cached choice made by the same save everywhere)
  local v = ffi.new("int64_t[8]")
  -- the directory, the same on every rank (each writes its file there, rank 0 the metadata): its hash
  -- and the negated hash, whose maxima agree only when every rank passed the same string
  v[6] = bit.rshift(str_hash(dir), 2)
  v[7] = -v[6]
  if rank == 0 then
    v[0], v[1] = id_parts()
    -- dir holds a complete checkpoint: the new one is written beside it (see "Crash safety" above); rank 0
    -- removes what an interrupted save into dir left there before any rank writes (after the agreement)
    local f = io.open(dir .. "/" .. META, "rb")
    if f then
      f:close()
      local real = C.eng_ckpt_realpath(dir)
      if real == nil then err = err or core.last_error()
      elseif ffi.string(real) ~= "/" then
        v[5] = 1
        remove_tree(ffi.string(real) .. ".saving")
      end
    end
  end
  v[2] = cached and 0 or 1
  local tag = cached and cached.tag or 0
  v[3], v[4] = tag, -tag
  agree(err, op, str_hash(sig_s), v, 8)
  if v[6] ~= -v[7] then
    error(string.format("%s: the ranks passed different directories (this rank: '%s'); every rank must save into " ..
      "the same dir (each writes its data file there and rank 0 the metadata): nothing was written", op, dir), 0)
  end
  if v[5] ~= 0 then
    -- every rank resolves dir itself (its own view of the shared directory); a failure is this rank's
    -- writer error, agreed when the save finishes
    local real = C.eng_ckpt_realpath(dir)
    if real == nil then h.err = core.last_error()
    else h.real_dir = ffi.string(real); h.staging = h.real_dir .. ".saving" end
  elseif rank == 0 then
    -- no complete checkpoint in dir (a new directory, or what an interrupted save left): written in place;
    -- a stray metadata file (a checkpoint that appeared since the check above) stops being one first
    os.remove(dir .. "/" .. META)
  end
  h.id = string.format("%010x-%010x", tonumber(v[0]), tonumber(v[1]))
  -- who writes what: every rank's boxes are gathered; a box held by several ranks (replicas, plain
  -- tensors) is written by one of them, the one with the fewest bytes assigned so far (PyTorch's
  -- dedup_save_plans), the same choice on every rank.  While no rank's boxes change, the choice of the
  -- last save is reused and nothing is gathered (PyTorch's plan caching).
  local keep
  if v[2] == 0 and v[3] == -v[4] and tag ~= 0 then
    keep = cached.keep
  else
    plan_cache = nil
    local all = gather_strings(table.concat(mine, "\n"))
    local holders, order = {}, {}
    for r = 0, nranks() - 1 do
      for line in all[r]:gmatch("[^\n]+") do
        if not holders[line] then holders[line] = {}; order[#order + 1] = line end
        local hl = holders[line]
        hl[#hl + 1] = r
      end
    end
    table.sort(order)
    local load, writer = {}, {}
    for r = 0, nranks() - 1 do load[r] = 0 end
    for _, line in ipairs(order) do
      local key, sizes = line:match("^(.*)\t[%d,]*\t([%d,]*)$")
      local bytes = 1
      for n in sizes:gmatch("%d+") do bytes = bytes * tonumber(n) end
      bytes = bytes * tonumber(C.eng_dtype_size(C.eng_dtype_from_name(h.tensors[key].dtype)))
      local best
      for _, r in ipairs(holders[line]) do if best == nil or load[r] < load[best] then best = r end end
      writer[line] = best
      load[best] = load[best] + bytes
    end
    keep = {}
    for i = 1, #h.plan do keep[i] = writer[mine[i]] == rank end
    -- the tag: the same on every rank (rank 0's random id part), never 0
    plan_cache = { input = mine_s, keep = keep, tag = tonumber(v[0]) + 1 }
  end
  local kept = {}
  for i, p in ipairs(h.plan) do
    if keep[i] then kept[#kept + 1] = p end
  end
  h.plan = kept
  local w = not h.err and C.eng_ckpt_writer_open(data_file(h.staging or dir, rank), h.id) or nil
  if w == nil then
    h.err = h.err or core.last_error()
  else
    h.writer = ffi.gc(w, C.eng_ckpt_writer_free)
    local ok2, e2 = pcall(function()
      engine.no_grad(function()
        for _, p in ipairs(h.plan) do
          local off = C.eng_ckpt_writer_add(h.writer, p.box.tensor._c, opts.async and 1 or 0)
          if off < 0 then error(core.last_error(), 0) end
          local t = p.box.tensor
          h.records[#h.records + 1] = { key = p.key, offset = tonumber(off),
            nbytes = numel_of(p.box.sizes) * tonumber(C.eng_dtype_size(C.eng_dtype_from_name(t.dtype))),
            offsets = p.box.offsets, sizes = p.box.sizes }
        end
      end)
      if C.eng_ckpt_writer_start(h.writer, opts.async and 1 or 0) ~= 0 then error(core.last_error(), 0) end
    end)
    if not ok2 then h.err = tostring(e2) end
  end
  h.plan = nil
  if opts.async and not h.err then
    pending = h
    return h
  end
  finish_save(h)
  return h
end

-- ---------------------------------------------------------------- load
local function read_metadata(dir, op)
  local path = dir .. "/" .. META
  local f = io.open(path, "rb")
  if not f then
    -- a save that did not finish (a rank killed or failed while writing) leaves its data files' temporary names
    local partial = {}
    local p = io.popen("ls -1A '" .. dir:gsub("'", "'\\''") .. "' 2>/dev/null")
    if p then
      for name in p:lines() do
        if name:match("%.tmp%d+$") then partial[#partial + 1] = dir .. "/" .. name end
      end
      p:close()
    end
    table.sort(partial)
    error(string.format("%s: '%s' has no metadata file '%s' (not a checkpoint, or its save did not finish%s)", op, dir,
      path, #partial > 0 and ": partial data file(s) " .. table.concat(partial, ", ") .. " left by an interrupted save"
      or ""), 0)
  end
  f:close()
  local ok, _, meta = pcall(engine.load, path)
  if not ok then error(string.format("%s: the metadata file '%s' is unreadable: %s", op, path, tostring(_)), 0) end
  local algos = CHECKSUMS[meta.format]
  if not algos then
    error(string.format("%s: '%s' is not a distributed checkpoint's metadata this engine reads (format %s, " ..
      "expected %s, engine-dcp/2 or engine-dcp/1)", op, path, tostring(meta.format), FORMAT), 0)
  end
  local algo = algos[meta.checksum or algos.default or ""]
  if not algo then
    error(string.format("%s: the metadata file '%s' (format %s) names an unknown checksum '%s'", op, path, meta.format,
      tostring(meta.checksum)), 0)
  end
  if meta.format == FORMAT then
    local got = engine.metadata_checksum(meta, META_SUM)
    if meta[META_SUM] ~= got then
      error(string.format("%s: the metadata file '%s' fails its checksum (stored %s, computed %s): an entry or value "
        .. "(e.g. the step) changed since it was saved; the checkpoint is corrupt", op, path, tostring(meta[META_SUM]),
        got), 0)
    end
  end
  local n = tonumber(meta.world_size)
  if not n or n < 1 or n % 1 ~= 0 or type(meta.id) ~= "string" or #meta.id > 55 then
    error(string.format("%s: the metadata file '%s' has a bad world_size or id", op, path), 0)
  end
  return meta, n, algo
end

-- Readers of the data files (engine/src/checkpoint/files.c: opened, checked, closed at the end of a load)
local Readers = {}
Readers.__index = Readers
local function new_readers(dir, id, algo, need) return setmetatable({ dir = dir, id = id, algo = algo, need = need, open = {} }, Readers) end
function Readers:get(file)
  local r = self.open[file]
  if r == nil then
    r = C.eng_ckpt_reader_open(data_file(self.dir, file), self.id, self.need and self.need[file] or 0, self.algo)
    if r == nil then error(core.last_error(), 0) end
    r = ffi.gc(r, C.eng_ckpt_reader_close)
    self.open[file] = r
  end
  return r
end
function Readers:verify(c)
  if C.eng_ckpt_reader_verify(self:get(c.file), c.offset, c.nbytes, c.checksum) ~= 0 then error(core.last_error(), 0) end
end
-- copy from chunk c of entry e into dst: the region starting at src_off (0-based per dim; nil: the whole chunk)
local i64s = ffi.typeof("int64_t[8]")
function Readers:copy(e, c, src_off, dst)
  local nd = #c.sizes
  local sz, so = i64s(), nil
  for d = 1, nd do sz[d - 1] = c.sizes[d] end
  if src_off then
    so = i64s()
    for d = 1, nd do so[d - 1] = src_off[d] end
  end
  if C.eng_ckpt_reader_copy(self:get(c.file), c.offset, C.eng_dtype_from_name(e.dtype), nd, sz, so, dst._c) ~= 0 then
    error(core.last_error(), 0)
  end
end
-- after pass 2: every file unchanged since it was opened (else the error names the file and, when one
-- fails it now, the chunk's checksum)
function Readers:check_unchanged(verified)
  for f, r in pairs(self.open) do
    if C.eng_ckpt_reader_unchanged(r) ~= 0 then
      local msg = core.last_error()
      for _, c in pairs(verified) do
        if c.file == f then self:verify(c) end
      end
      error(msg, 0)
    end
  end
end
function Readers:close()
  for f, r in pairs(self.open) do C.eng_ckpt_reader_close(ffi.gc(r, nil)); self.open[f] = nil end
end

-- The parsed entry of key: {dtype, shape, chunks = {{file, offset, nbytes, checksum, offsets, sizes}}}
local function parse_entry(text, n_files, key, op)
  local dt, nd = ffi.new("int[1]"), ffi.new("int[1]")
  local shp = ffi.new("int64_t[8]")
  local name = string.format("%s: the metadata entry of '%s'", op, key)
  local n = C.eng_ckpt_entry_parse(name, text, n_files, dt, nd, shp, nil, 0)
  if n < 0 then error(core.last_error(), 0) end
  local arr = ffi.new("eng_ckpt_chunk[?]", math.max(n, 1))
  if C.eng_ckpt_entry_parse(name, text, n_files, dt, nd, shp, arr, n) ~= n then error(core.last_error(), 0) end
  local e = { dtype = ffi.string(C.eng_dtype_name(dt[0])), shape = {}, chunks = {} }
  for d = 0, nd[0] - 1 do e.shape[d + 1] = tonumber(shp[d]) end
  for i = 0, n - 1 do
    local c = arr[i]
    local offs, sizes = {}, {}
    for d = 0, nd[0] - 1 do offs[d + 1] = tonumber(c.offsets[d]); sizes[d + 1] = tonumber(c.sizes[d]) end
    e.chunks[i + 1] = { file = c.file, offset = c.offset, nbytes = c.nbytes, checksum = c.checksum, offsets = offs, sizes = sizes }
  end
  return e
end
M._parse_entry = parse_entry

local function same_list(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- The loader, so that nothing is written into the state before every rank has checked every chunk it
-- needs, without a second copy of the state in memory and reading every byte once from the files:
-- the data files are opened (engine/src/checkpoint/files.c); (1) the checksum of each saved chunk that
-- overlaps a local box is computed as it is read (pread, 4 MiB blocks); (2) after the ranks agreed, each
-- overlap is read into the destination (the whole chunk, or the overlapping region of it: straight into
-- it when contiguous, else through the read buffer with strided copies, dtypes converted).  The reader
-- holds the inode checked in (1), so (2) reads the bytes that were verified.
local function overlaps(e, box)
  local nd = #box.sizes
  local out = {}
  if numel_of(box.sizes) == 0 then return out end
  local bo, bs = ffi.new("int64_t[8]"), ffi.new("int64_t[8]")
  for d = 1, nd do bo[d - 1] = box.offsets[d]; bs[d - 1] = box.sizes[d] end
  local co, cs = ffi.new("int64_t[8]"), ffi.new("int64_t[8]")
  for _, c in ipairs(e.chunks) do
    for d = 1, nd do co[d - 1] = c.offsets[d]; cs[d - 1] = c.sizes[d] end
    local hit = nd == 0 and 1 or C.eng_shard_boxes_overlap(nd, co, cs, bo, bs)
    if hit < 0 then error(core.last_error(), 0) end
    if hit == 1 then
      local o = { chunk = c, whole = nd == 0 or (same_list(c.offsets, box.offsets) and same_list(c.sizes, box.sizes)) }
      if not o.whole then
        local region = ffi.new("int64_t[32]")
        if C.eng_shard_overlap_region(nd, co, cs, bo, bs, region) ~= 0 then error(core.last_error(), 0) end
        o.region = {}
        for d = 0, nd - 1 do
          o.region[d + 1] = { tonumber(region[4 * d + 1]), tonumber(region[4 * d + 2]), tonumber(region[4 * d + 3]) }
        end
      end
      out[#out + 1] = o
    end
  end
  return out
end

-- copy the overlap ov of a saved chunk (entry e) into the local box tensor dst
local function fill(readers, e, dst, ov)
  local c = ov.chunk
  if ov.whole then readers:copy(e, c, nil, dst); return end
  local src_off, d2 = {}, dst
  for d, r in ipairs(ov.region) do
    src_off[d] = r[1]
    d2 = d2:narrow(d, r[2] + 1, r[3])
  end
  readers:copy(e, c, src_off, d2)
end

-- a new tensor of box (offsets, sizes) of entry e from its chunks (each overlapping chunk verified)
local function read_box(dir, id, algo, e, box)
  local staging = engine.empty(box.sizes, { dtype = e.dtype })
  if numel_of(box.sizes) == 0 then return staging end
  local readers = new_readers(dir, id, algo, nil)
  local ok, err = pcall(function()
    local ovs = overlaps(e, box)
    for _, ov in ipairs(ovs) do readers:verify(ov.chunk) end
    engine.no_grad(function()
      for _, ov in ipairs(ovs) do fill(readers, e, staging, ov) end
    end)
  end)
  readers:close()
  if not ok then error(err, 0) end
  return staging
end

-- load(state, dir, {strict = true}) -> state (filled in place; values replaced).  Collective.
function M.load(state, dir, opts)
  local op = "checkpoint.load"
  opts = check_opts(opts, { strict = true }, op)
  if type(dir) ~= "string" or dir == "" then error(op .. ": dir must be a non-empty string", 2) end
  local strict = opts.strict ~= false
  wait_pending()
  local rank = myrank()
  local meta, n_files, id, algo
  local stage = {}   -- {dst = local tensor, e = entry, ov = overlap}: pass 2
  local readers, verified
  local sets = {}    -- {item, value}
  local ok, err = pcall(function()
    meta, n_files, algo = read_metadata(dir, op)
    id = meta.id
    -- every data file present, of this checkpoint, long enough for its chunks
    local items, keys = flatten(state, op)
    local entries, need = {}, {}
    for k, text in pairs(meta) do
      local key = k:match("^t:(.*)$")
      if key then
        local e = parse_entry(text, n_files, key, op)
        entries[key] = e
        for _, c in ipairs(e.chunks) do need[c.file] = math.max(need[c.file] or 0, tonumber(c.offset + c.nbytes)) end
      end
    end
    for r = 0, n_files - 1 do
      if C.eng_ckpt_file_check(data_file(dir, r), id, need[r] or 0) ~= 0 then error(core.last_error(), 0) end
    end
    readers, verified = new_readers(dir, id, algo, need), {}
    -- keys on both sides.  A number saved where the state now has a one-element plain tensor fills it: an
    -- optimizer's step count, which checkpoints saved before steps became tensors (as PyTorch's) hold as a value.
    local missing, unexpected, as_number = {}, {}, {}
    for _, key in ipairs(keys) do
      local it = items[key]
      if it.kind == "tensor" and not entries[key] and meta["v:" .. key] and core.is_tensor(it.value)
          and it.value._c.dist == nil and it.value:numel() == 1 then
        local v = deserialize(meta["v:" .. key], key)
        if type(v) == "number" then as_number[key] = v end
      end
      if it.kind == "tensor" and not entries[key] and as_number[key] == nil
          or it.kind == "value" and meta["v:" .. key] == nil then
        missing[#missing + 1] = key .. (meta[(it.kind == "tensor" and "v:" or "t:") .. key] and
          (it.kind == "tensor" and " (saved as a value, not a tensor)" or " (saved as a tensor, not a value)") or "")
      end
    end
    for k in pairs(meta) do
      local key = k:match("^[tv]:(.*)$")
      if key and not items[key] then unexpected[#unexpected + 1] = key end
    end
    table.sort(missing); table.sort(unexpected)
    if strict and (#missing > 0 or #unexpected > 0) then
      local parts = {}
      if #missing > 0 then parts[#parts + 1] = "missing in the checkpoint: " .. table.concat(missing, ", ") end
      if #unexpected > 0 then parts[#parts + 1] = "in the checkpoint but not in the state: " .. table.concat(unexpected, ", ") end
      error(string.format("%s: '%s' does not match the state (%s); pass {strict = false} to load the common keys", op,
        dir, table.concat(parts, "; ")), 0)
    end
    for _, key in ipairs(keys) do
      local it = items[key]
      if it.kind == "tensor" and entries[key] then
        local e = entries[key]
        local shape, boxes = local_boxes(it.value, key, op, rank)
        if not same_list(shape, e.shape) then
          error(string.format("%s: '%s' has shape [%s] in the checkpoint and [%s] in the state (%s)", op, key,
            table.concat(e.shape, ","), table.concat(shape, ","), describe_layout(it.value)), 0)
        end
        for _, b in ipairs(boxes) do
          -- PyTorch's in-place check: an expanded destination would take several chunks' bytes in one place
          if C.eng_tensor_check_overlap(b.tensor._c, nil, op) ~= 0 then
            error(string.format("%s ('%s')", core.last_error(), key), 0)
          end
          for _, ov in ipairs(overlaps(e, b)) do
            local c = ov.chunk
            local ck = c.file .. ":" .. tostring(c.offset)
            if not verified[ck] then            -- pass 1: every needed chunk checksummed once
              readers:verify(c)
              verified[ck] = c
            end
            stage[#stage + 1] = { dst = b.tensor, e = e, ov = ov }
          end
        end
      elseif it.kind == "value" and meta["v:" .. key] then
        sets[#sets + 1] = { it = it, value = deserialize(meta["v:" .. key], key) }
      elseif as_number[key] ~= nil then
        sets[#sets + 1] = { it = it, fill = as_number[key] }
      end
    end
  end)
  -- nothing is changed unless every rank read everything
  if not ok and readers then readers:close() end
  agree(not ok and tostring(err) or nil, op, str_hash(meta and meta.id or ""))
  if M._test.after_verify then M._test.after_verify(dir) end
  -- pass 2 copies without checksumming again; a data file written in place since pass 1 (its mtime
  -- or size changed; a replaced file is no concern: the reader holds the verified inode) fails
  -- the load, naming the chunk whose checksum no longer holds.  The ranks agree on the outcome, so
  -- every rank raises (saying the state is partly loaded; the values are not set) instead of one rank
  -- stopping half-filled while the others go on to their next collective.
  local ok2, err2 = pcall(function()
    engine.no_grad(function()
      for _, s in ipairs(stage) do fill(readers, s.e, s.dst, s.ov) end
    end)
    readers:check_unchanged(verified)
  end)
  if readers then readers:close() end
  agree(not ok2 and string.format("%s: '%s' changed during the load, after its chunks were verified (the tensors of "
    .. "the state are partly loaded): %s", op, dir, tostring(err2)) or nil, op, str_hash(id))
  for _, s in ipairs(sets) do
    if s.fill ~= nil then engine.no_grad(function() s.it.value:fill_(s.fill) end)
    else s.it.parent[s.it.pkey] = s.value end
  end
  return state
end

-- ---------------------------------------------------------------- reading outside a load
-- read_metadata(dir) -> {id =, world_size =, tensors = {[key] = {dtype =, shape = {...}}}, values = {[key] = v}}
-- read_tensor(dir, key) -> the full plain tensor of key (every chunk read and checksummed); local, no
-- collective (tools/ckpt_safetensors.lua converts a checkpoint to one safetensors file with these).
function M.read_metadata(dir)
  local op = "checkpoint.read_metadata"
  local meta, n = read_metadata(dir, op)
  local r = { id = meta.id, world_size = n, tensors = {}, values = {} }
  for k, v in pairs(meta) do
    local tk = k:match("^t:(.*)$")
    if tk then
      local e = parse_entry(v, n, tk, op)
      r.tensors[tk] = { dtype = e.dtype, shape = e.shape }
    end
    local vk = k:match("^v:(.*)$")
    if vk then r.values[vk] = deserialize(v, vk) end
  end
  return r
end

function M.read_tensor(dir, key)
  local op = "checkpoint.read_tensor"
  local meta, n, algo = read_metadata(dir, op)
  local text = meta["t:" .. key]
  if not text then error(string.format("%s: '%s' has no tensor '%s'", op, dir, tostring(key)), 2) end
  local e = parse_entry(text, n, key, op)
  local off = {}
  for d = 1, #e.shape do off[d] = 0 end
  return read_box(dir, meta.id, algo, e, { offsets = off, sizes = e.shape })
end

-- load_safetensors(path, state, {strict = true}) (engine.load_safetensors): fills the tensors of
-- `state` (a nested table as for load: DTensors of any layout, ShardedTensors, plain tensors; the
-- dotted keys are the file's tensor names) from a safetensors file of full tensors, each rank copying
-- its own boxes; dtypes are converted.  Missing names on either side are errors naming them (strict =
-- false: only the common names).  Nothing is copied unless every name checked.  Local: every rank
-- reads the file (no collective).
function M.load_safetensors(path, state, opts)
  local op = "load_safetensors"
  opts = check_opts(opts, { strict = true }, op)
  if type(path) ~= "string" then error(op .. ": path must be a string", 2) end
  local ok, tensors = pcall(engine.load, path)
  if not ok then error(op .. ": " .. tostring(tensors), 2) end
  local items, keys = flatten(state, op)
  local missing, unexpected, plan = {}, {}, {}
  for _, key in ipairs(keys) do
    local it = items[key]
    if it.kind == "tensor" then
      local t = tensors[key]
      if not t then missing[#missing + 1] = key
      else
        local shape, boxes = local_boxes(it.value, key, op, myrank())
        if not same_list(shape, t:shape()) then
          error(string.format("%s: %s: '%s' has shape [%s] in the file and [%s] in the state (%s)", op, path, key,
            table.concat(t:shape(), ","), table.concat(shape, ","), describe_layout(it.value)), 2)
        end
        for _, b in ipairs(boxes) do plan[#plan + 1] = { src = t, box = b } end
      end
    end
  end
  for name in pairs(tensors) do
    if not items[name] or items[name].kind ~= "tensor" then unexpected[#unexpected + 1] = name end
  end
  table.sort(missing); table.sort(unexpected)
  if opts.strict ~= false and (#missing > 0 or #unexpected > 0) then
    error(string.format("%s: %s does not match the state (missing in the file: %s; in the file but not in the state: %s)",
      op, path, table.concat(missing, ", "), table.concat(unexpected, ", ")), 2)
  end
  engine.no_grad(function()
    for _, p in ipairs(plan) do
      local src = p.src
      for d = 1, #p.box.sizes do src = src:narrow(d, p.box.offsets[d] + 1, p.box.sizes[d]) end
      if numel_of(p.box.sizes) > 0 then p.box.tensor:copy_(src) end
    end
  end)
  return state
end

-- ---------------------------------------------------------------- state dict helpers
-- get_optimizer_state_dict(model, opt) -> {state = {[param name] = {step =, exp_avg =, ...}},
-- param_groups = {{lr =, ..., params = {names}}}} (PyTorch's get_optimizer_state_dict: keyed by
-- parameter names, every parameter's state initialised (opt:_init_state), so a fresh optimizer can be
-- loaded into).  The tensors are the optimizer's live ones, the step counts included (0-dim tensors, as
-- PyTorch's): dist.checkpoint.load fills them in place, so the state is restored by the load itself (an
-- optimizer that already stepped too); set_optimizer_state_dict(model, opt, sd) (or opt:load_state_dict(sd))
-- puts back the hyperparameters, which the table holds as copies.
-- model and optimizer arguments of the optimizer state functions, checked (a nil-index error otherwise)
local function check_model_opt(op, model, opt)
  if not require("engine.nn.module").is_module(model) then
    error(string.format("%s: expected the model (an nn.Module) first, got %s", op, type(model)), 3)
  end
  if type(opt) ~= "table" or type(opt.param_groups) ~= "table" or type(opt.state) ~= "table" then
    error(string.format("%s: expected an optimizer (engine.optim) second, got %s", op, type(opt)), 3)
  end
end

function M.get_optimizer_state_dict(model, opt)
  local op = "get_optimizer_state_dict"
  check_model_opt(op, model, opt)
  local name_of = {}
  for name, p in model:named_parameters() do if name_of[p] == nil then name_of[p] = name end end
  local state, groups = {}, {}
  for gi, g in ipairs(opt.param_groups) do
    local sg = { params = {} }
    for k, v in pairs(g) do
      if k ~= "params" then sg[k] = type(v) == "table" and { unpack(v) } or v end
    end
    for _, p in ipairs(g.params) do
      local name = name_of[p]
      if not name then error(string.format("%s: a parameter of group %d is not in the model", op, gi), 2) end
      sg.params[#sg.params + 1] = name
      if opt.state[p] == nil and type(opt._init_state) == "function" then opt:_init_state(p) end
      local st = opt.state[p]
      if st then
        local s = {}
        for k, v in pairs(st) do s[k] = v end
        state[name] = s
      end
    end
    groups[gi] = sg
  end
  return { state = state, param_groups = groups }
end

function M.set_optimizer_state_dict(model, opt, sd)
  local op = "set_optimizer_state_dict"
  check_model_opt(op, model, opt)
  if type(sd) ~= "table" or type(sd.state) ~= "table" or type(sd.param_groups) ~= "table" then
    error(op .. ": expected {state = ..., param_groups = ...}", 2)
  end
  local params = {}
  for name, p in model:named_parameters() do params[name] = p end
  for gi, g in ipairs(opt.param_groups) do
    local sg = sd.param_groups[gi]
    if not sg then error(string.format("%s: parameter group %d is missing", op, gi), 2) end
    for k, v in pairs(sg) do
      if k ~= "params" then g[k] = type(v) == "table" and { unpack(v) } or v end
    end
    for _, name in ipairs(sg.params or {}) do
      local p = params[name]
      if not p then error(string.format("%s: parameter '%s' is not in the model", op, tostring(name)), 2) end
      local s = sd.state[name]
      if s then
        local st = opt.state[p] or {}
        for k, v in pairs(s) do
          -- a step count: the optimizer's own tensor stays (the table holds it live), any other value is
          -- copied into a new 0-dim f32 CPU tensor (never shared with another optimizer's count)
          if k == "step" and not rawequal(v, st.step) then v = require("engine.optim.optimizer")._step_tensor(v, 2) end
          st[k] = v
        end
        opt.state[p] = st
      end
    end
  end
end

-- ---------------------------------------------------------------- directories of checkpoints
-- path(root, step) -> root .. "/step_00000500"; latest(root) -> newest complete one (with metadata) and
-- its step, or nil; prune(root, keep) removes all but the newest `keep` (>= 1) complete ones (call on one rank).
function M.path(root, step)
  if type(root) ~= "string" or root == "" then
    error("checkpoint.path: root must be a non-empty string (the directory of the step_* checkpoints), got "
      .. (type(root) == "string" and "\"\"" or type(root)), 2)
  end
  if type(step) ~= "number" or step % 1 ~= 0 or step < 0 then
    error("checkpoint.path: step must be an integer >= 0, got " .. tostring(step), 2)
  end
  return string.format("%s/step_%08d", root, step)
end

local function list_steps(root)
  local p = io.popen("ls -1 '" .. root:gsub("'", "'\\''") .. "' 2>/dev/null")
  local steps = {}
  if not p then return steps end
  for name in p:lines() do
    local s = name:match("^step_(%d+)$")
    if s then
      local f = io.open(root .. "/" .. name .. "/" .. META, "rb")
      if f then f:close(); steps[#steps + 1] = tonumber(s) end
    end
  end
  p:close()
  table.sort(steps)
  return steps
end

function M.latest(root)
  if type(root) ~= "string" or root == "" then
    error("checkpoint.latest: root must be a non-empty string (the directory of the step_* checkpoints), got "
      .. (type(root) == "string" and "\"\"" or type(root)), 2)
  end
  local steps = list_steps(root)
  local s = steps[#steps]
  if not s then return nil end
  return M.path(root, s), s
end

function M.prune(root, keep)
  -- every argument is checked before anything is deleted
  if type(root) ~= "string" or root == "" then
    error("checkpoint.prune: root must be a non-empty string (the directory of the step_* checkpoints), got "
      .. (type(root) == "string" and "\"\"" or type(root)), 2)
  end
  if type(keep) ~= "number" or keep % 1 ~= 0 or keep < 1 or keep == math.huge then
    error("checkpoint.prune: keep must be an integer >= 1 (the number of newest complete checkpoints kept; "
      .. "prune never removes the newest), got " .. tostring(keep), 2)
  end
  local steps = list_steps(root)
  for i = 1, #steps - keep do
    local dir = M.path(root, steps[i])
    os.remove(dir .. "/" .. META)   -- first: the directory stops being a checkpoint
    os.execute("rm -rf '" .. dir:gsub("'", "'\\''") .. "'")
  end
end

return { checkpoint = M }
