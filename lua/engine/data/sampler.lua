-- engine.data.sampler: batches of token windows.
--
-- BatchSampler: random windows of T + 1 tokens -> x [B, T], y [B, T] (i64,
-- y is x shifted by one).  Batch number k of a sampler is a pure function of
-- (seed, k, rank, world_size): window b of batch k starts at
-- hash(seed, (k * world_size + rank) * B + b) mod (number of valid starts),
-- so runs are reproducible and a resumed run (set_state) continues exactly;
-- ranks draw disjoint streams.  Windows never cross a shard boundary.
--
--   local s = data.BatchSampler(shards, {batch_size = 8, seq_len = 128, seed = 0})
--   local x, y = s:next()
--   local st = s:state()  ...  s:set_state(st)
--
-- ValLoader: sequential, non-overlapping windows (llm.c's loader): each batch
-- takes B*T + 1 consecutive tokens, rank r of W uses the r-th of W adjacent
-- chunks; iteration ends when a shard has no room for another batch (then the
-- next shard is used), so it covers the data once.
--
-- A source is a Shard (data.read_shard), a list of Shards (data.read_shards), a
-- path or glob pattern of shard files ('data/x_train_*.bin': sorted, read in
-- that order), a list of paths, a 1-D integer tensor, or a Lua list of token ids.
-- Several shards are concatenated in order (windows stay inside one shard).
local bit = require("bit")
local core = require("engine.core")
local ffi, C = core.ffi, core.C
local shards = require("engine.data.shards")

local M = {}

-- Normalised source: list of {ptr = cdata pointer (0-based), n = count, keep = owner}.
local function segments(source, op)
  local segs = {}
  local function add(x)
    if getmetatable(x) == shards.Shard then
      segs[#segs + 1] = { ptr = x.tokens, n = x.n, keep = x }
    elseif core.is_tensor(x) then
      if not (x.dtype == "i64" or x.dtype == "i32" or x.dtype == "u8" or x.dtype == "i16") then
        error(string.format("%s: a token tensor must have an integer dtype, got %s", op, x.dtype), 4)
      end
      local n = x:numel()
      local buf = ffi.new("int64_t[?]", n > 0 and n or 1)
      core.check(C.eng_tensor_read(x._c, buf, 5, n), 4)
      segs[#segs + 1] = { ptr = buf, n = n, keep = buf }
    elseif type(x) == "table" and (#x == 0 or type(x[1]) == "number") then
      local n = #x
      local buf = ffi.new("int64_t[?]", n > 0 and n or 1)
      for i = 1, n do buf[i - 1] = x[i] end
      segs[#segs + 1] = { ptr = buf, n = n, keep = buf }
    else
      error(op .. ": a source must be a Shard, a list of Shards, a path or glob of shard files, a list of paths, "
        .. "an integer tensor or a list of token ids", 4)
    end
  end
  if type(source) == "string" or (type(source) == "table" and type(source[1]) == "string") then
    local ok, list = pcall(shards.read_shards, source)
    if not ok then
      local msg = tostring(list)
      error(msg:find("^read_shards:") and (msg:gsub("^read_shards:", op .. ":")) or op .. ": " .. msg, 4)
    end
    source = list
  end
  if type(source) == "table" and getmetatable(source) ~= shards.Shard and not core.is_tensor(source)
      and type(source[1]) == "table" then
    for _, s in ipairs(source) do add(s) end
  else
    add(source)
  end
  return segs
end

local function check_int(v, name, op, min)
  if type(v) ~= "number" or v % 1 ~= 0 or v < min then
    error(string.format("%s: %s must be an integer >= %d, got %s", op, name, min, tostring(v)), 4)
  end
end

local function new_batch(B, T)
  local shape = ffi.new("int64_t[2]", B, T)
  local x = core.wrap(C.eng_tensor_empty(2, shape, 5, 0))
  local y = core.wrap(C.eng_tensor_empty(2, shape, 5, 0))
  return x, y, ffi.cast("int64_t*", C.eng_tensor_data(x._c)), ffi.cast("int64_t*", C.eng_tensor_data(y._c))
end

-- splitmix64 finaliser on uint64 cdata.
local function mix64(z)
  z = z + 0x9E3779B97F4A7C15ULL
  z = bit.bxor(z, bit.rshift(z, 30)) * 0xBF58476D1CE4E5B9ULL
  z = bit.bxor(z, bit.rshift(z, 27)) * 0x94D049BB133111EBULL
  return bit.bxor(z, bit.rshift(z, 31))
end

-- ---------------------------------------------------------------- BatchSampler
local BatchSampler = {}
BatchSampler.__index = BatchSampler
M.BatchSampler = setmetatable(BatchSampler, { __call = function(cls, ...) return cls.new(...) end })

-- BatchSampler(source, {batch_size =, seq_len =, seed = 0, rank = 0, world_size = 1})
function BatchSampler.new(source, opts)
  local op = "BatchSampler"
  opts = opts or {}
  local B, T = opts.batch_size, opts.seq_len
  check_int(B, "batch_size", op, 1)
  check_int(T, "seq_len", op, 1)
  local seed, rank, world = opts.seed or 0, opts.rank or 0, opts.world_size or 1
  check_int(seed, "seed", op, 0)
  check_int(world, "world_size", op, 1)
  check_int(rank, "rank", op, 0)
  if rank >= world then error(string.format("%s: rank %d must be < world_size %d", op, rank, world), 3) end
  local segs = segments(source, op)
  local usable, total = {}, 0
  for _, s in ipairs(segs) do
    if s.n >= T + 1 then
      usable[#usable + 1] = s
      s.starts = s.n - T   -- valid starts 0 .. n - T - 1
      total = total + s.starts
    end
  end
  if total == 0 then
    error(string.format("%s: no shard has at least seq_len + 1 = %d tokens", op, T + 1), 3)
  end
  return setmetatable({ B = B, T = T, seed = seed, rank = rank, world_size = world, position = 0,
    segs = usable, total = total, _seed_mix = mix64(0ULL + seed) }, BatchSampler)
end

-- batch(k) -> x, y of batch number k (0-based), without changing the position.
function BatchSampler:batch(k)
  local B, T = self.B, self.T
  local x, y, xd, yd = new_batch(B, T)
  local total = 0ULL + self.total
  local base = (0ULL + k) * self.world_size + self.rank
  for b = 0, B - 1 do
    local r = tonumber(mix64(bit.bxor(self._seed_mix, base * B + b)) % total)
    local seg
    for _, s in ipairs(self.segs) do
      if r < s.starts then seg = s; break end
      r = r - s.starts
    end
    local src, o = seg.ptr, b * T
    for t = 0, T - 1 do
      xd[o + t] = src[r + t]
      yd[o + t] = src[r + t + 1]
    end
  end
  return x, y
end

-- next() -> x, y; advances the position.
function BatchSampler:next()
  local x, y = self:batch(self.position)
  self.position = self.position + 1
  return x, y
end

function BatchSampler:state() return { seed = self.seed, position = self.position } end

function BatchSampler:set_state(st)
  if type(st) ~= "table" or type(st.position) ~= "number" or st.position < 0 or st.position % 1 ~= 0 then
    error("BatchSampler:set_state: expected {position = n (a non-negative integer), seed = s}", 2)
  end
  if st.seed ~= nil and st.seed ~= self.seed then
    error(string.format("BatchSampler:set_state: the state is for seed %s, this sampler has seed %s",
      tostring(st.seed), tostring(self.seed)), 2)
  end
  self.position = st.position
end

-- ---------------------------------------------------------------- ValLoader
local ValLoader = {}
ValLoader.__index = ValLoader
M.ValLoader = setmetatable(ValLoader, { __call = function(cls, ...) return cls.new(...) end })

-- ValLoader(source, {batch_size =, seq_len =, rank = 0, world_size = 1, max_batches = nil})
function ValLoader.new(source, opts)
  local op = "ValLoader"
  opts = opts or {}
  local B, T = opts.batch_size, opts.seq_len
  check_int(B, "batch_size", op, 1)
  check_int(T, "seq_len", op, 1)
  local rank, world = opts.rank or 0, opts.world_size or 1
  check_int(world, "world_size", op, 1)
  check_int(rank, "rank", op, 0)
  if rank >= world then error(string.format("%s: rank %d must be < world_size %d", op, rank, world), 3) end
  if opts.max_batches ~= nil then check_int(opts.max_batches, "max_batches", op, 0) end
  local self = setmetatable({ B = B, T = T, rank = rank, world_size = world, max_batches = opts.max_batches,
    segs = segments(source, op) }, ValLoader)
  local need = B * T * world + 1
  local ok = false
  for _, s in ipairs(self.segs) do if s.n >= need then ok = true end end
  if not ok then
    error(string.format("%s: no shard has the %d tokens one batch needs (batch_size * seq_len * world_size + 1)",
      op, need), 3)
  end
  self:reset()
  return self
end

function ValLoader:reset()
  self.seg_i, self.pos, self.count = 1, 0, 0
end

-- Number of batches one pass yields.
function ValLoader:num_batches()
  local step = self.B * self.T * self.world_size
  local n = 0
  for _, s in ipairs(self.segs) do
    if s.n >= step + 1 then n = n + math.floor((s.n - 1) / step) end
  end
  if self.max_batches then n = math.min(n, self.max_batches) end
  return n
end

-- next() -> x, y, or nil at the end of the pass.
function ValLoader:next()
  if self.max_batches and self.count >= self.max_batches then return nil end
  local B, T = self.B, self.T
  local step = B * T * self.world_size
  while self.seg_i <= #self.segs do
    local s = self.segs[self.seg_i]
    if self.pos + step + 1 <= s.n then
      local x, y, xd, yd = new_batch(B, T)
      local src, start = s.ptr, self.pos + self.rank * B * T
      for i = 0, B * T - 1 do
        xd[i] = src[start + i]
        yd[i] = src[start + i + 1]
      end
      self.pos = self.pos + step
      self.count = self.count + 1
      return x, y
    end
    self.seg_i, self.pos = self.seg_i + 1, 0
  end
  return nil
end

-- batches() -> iterator for `for x, y in loader:batches() do` (resets first).
function ValLoader:batches()
  self:reset()
  return function() return self:next() end
end

return M
