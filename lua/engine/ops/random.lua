-- engine.ops.random: the counter-based generator (Philox 4x32-10).
--
--   engine.manual_seed(seed)                  (engine.tensor) seed, offset = 0
--   engine.get_rng_state() -> {seed =, offset =}
--   engine.set_rng_state(state)
--   engine.rand(2, 3) / engine.randn(2, 3, {dtype = "f64"})   (engine.tensor)
--   t:uniform_(a, b)   U[a, b) in place (default 0, 1)
--   t:normal_(mean, std) in place (default 0, 1)
--   engine.random_slice(kind, global_shape, start, size, opts)
--   local g = engine.Generator():manual_seed(42)           a user generator (PyTorch's torch.Generator)
--   engine.rand(2, 3, {generator = g}); t:normal_(0, 1, {generator = g}); nn.init.normal_(w, 0, 0.02, g)
--   engine.rand_like(t, {generator = g}); engine.dropout(x, 0.1, true, {generator = g}); nn.Dropout(0.1, {generator = g})
--   engine.scaled_dot_product_attention(q, k, v, {dropout_p = 0.1, generator = g})
--   dist.rand / dist.randn(shape, {mesh =, placements =, generator = g}); dist.sharded_tensor.rand(spec, size, {generator = g})
--
-- A generator is a (seed, offset) pair like the global one: its draws are the numbers the global
-- generator gives after manual_seed with the same seed, and it advances by the same counts.  The
-- random ops take it as `generator =` in their option table (or, where PyTorch passes it
-- positionally, as the trailing argument); the C layer draws from it through eng_rng_use for the
-- duration of the call (the global generator is untouched).
--
-- Element i (row-major index in the GLOBAL tensor) of a tensor drawn with
-- (seed, offset) depends only on (seed, offset + i).  random_slice(kind,
-- global_shape, start, size) therefore returns exactly the block
-- [start, start + size) of the whole tensor (start is 1-based per dim, as all
-- Lua positions): a shard can generate its part without the rest.
-- Every draw from the global generator advances offset by numel rounded up
-- to a multiple of 4.
-- Seeds and offsets above 2^53 come back as uint64 cdata (Lua numbers are
-- doubles); both forms are accepted.
local core = require("engine.core")
local Tensor = require("engine.tensor")
local ffi, C = core.ffi, core.C
local wrap, ct, check = core.wrap, core.ct, core.check
local methods = Tensor.methods

local M = {}

local TWO53 = 2 ^ 53
local u64 = ffi.typeof("uint64_t")
local state_buf = ffi.new("uint64_t[2]")

local function to_lua(v)
  if v < TWO53 then return tonumber(v) end
  return v
end

local function to_u64(v, what, op)
  if type(v) == "number" then
    if v < 0 or v % 1 ~= 0 or v >= 2 ^ 64 then
      error(string.format("%s: %s must be a non-negative integer, got %s", op, what, tostring(v)), 3)
    end
    return u64(v)
  end
  if type(v) == "cdata" then
    local ok, r = pcall(u64, v)
    if ok then return r end
  end
  error(string.format("%s: %s must be a non-negative integer, got %s", op, what, type(v)), 3)
end

function M.get_rng_state()
  C.eng_rng_get_state(state_buf, state_buf + 1)
  return { seed = to_lua(state_buf[0]), offset = to_lua(state_buf[1]) }
end

function M.set_rng_state(s)
  if type(s) ~= "table" or s.seed == nil or s.offset == nil then
    error("set_rng_state: expected a table {seed = ..., offset = ...} as returned by get_rng_state", 2)
  end
  C.eng_rng_set_state(to_u64(s.seed, "seed", "set_rng_state"), to_u64(s.offset, "offset", "set_rng_state"))
end

-- ---------------------------------------------------------------- Generator
local DEFAULT_SEED = 67280421310721   -- PyTorch's default CPU seed (rng.c)
local Generator = {}
Generator.__index = Generator
Generator.__name = "Generator"

local function is_generator(g) return type(g) == "table" and getmetatable(g) == Generator end
M.is_generator = is_generator

-- engine.Generator([device]): a new generator seeded with the default seed (device "cpu" or "cuda":
-- the numbers are the same on both, element i of a draw depends on (seed, offset + i) only).
function M.Generator(device)
  if device ~= nil and device ~= "cpu" and device ~= "cuda" and not (type(device) == "string" and device:match("^cuda:%d+$")) then
    error("Generator: unknown device '" .. tostring(device) .. "' (expected \"cpu\" or \"cuda\")", 2)
  end
  local c = ffi.new("eng_generator")
  c.seed, c.offset = DEFAULT_SEED, 0
  return setmetatable({ _c = c, device = device or "cpu" }, Generator)
end

-- g:manual_seed(seed) -> g (offset back to 0)
function Generator:manual_seed(seed)
  self._c.seed = to_u64(seed, "seed", "Generator:manual_seed")
  self._c.offset = 0
  return self
end
-- g:seed(): a non-deterministic seed (wall time, CPU time and a counter); returns it
local n_seeded = 0
function Generator:seed()
  n_seeded = n_seeded + 1
  local s = math.floor(os.time() * 1000003 + os.clock() * 1e6 + n_seeded * 7919 + C.eng_time() * 1e6) % 2 ^ 53
  self:manual_seed(s)
  return s
end
function Generator:initial_seed() return to_lua(self._c.seed) end
function Generator:get_offset() return to_lua(self._c.offset) end
function Generator:set_offset(off) self._c.offset = to_u64(off, "offset", "Generator:set_offset"); return self end
-- get_state() -> {seed =, offset =} (a copy); set_state(state) -> g
function Generator:get_state() return { seed = to_lua(self._c.seed), offset = to_lua(self._c.offset) } end
function Generator:set_state(s)
  if type(s) ~= "table" or s.seed == nil or s.offset == nil then
    error("Generator:set_state: expected a table {seed = ..., offset = ...} as returned by get_state", 2)
  end
  self._c.seed = to_u64(s.seed, "seed", "Generator:set_state")
  self._c.offset = to_u64(s.offset, "offset", "Generator:set_state")
  return self
end
function Generator.__tostring(g)
  return string.format("Generator(device=%s, seed=%s, offset=%s)", g.device, tostring(to_lua(g._c.seed)),
    tostring(to_lua(g._c.offset)))
end

-- The generator passed to op (a Generator, or nil), or an error naming op.
local function check_generator(g, op)
  if g == nil or is_generator(g) then return g end
  error(string.format("%s: generator must be an engine.Generator, got %s", op, type(g)), 3)
end

-- The generator of a trailing argument: a Generator or an option table {generator = g}.
local function trailing_generator(x, op)
  if x == nil or is_generator(x) then return x end
  if type(x) == "table" and getmetatable(x) == nil then return check_generator(x.generator, op) end
  error(string.format("%s: expected a generator or an option table {generator = g}, got %s", op, type(x)), 3)
end

-- with_generator(g, fn, ...): fn(...) with this thread's draws taken from g (nil: the global
-- generator, fn is called directly); the previous generator is restored, also on error.
local function with_generator(g, fn, ...)
  if g == nil then return fn(...) end
  local prev = C.eng_rng_use(g._c)
  local res = { pcall(fn, ...) }
  C.eng_rng_use(prev)
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

-- engine.rand / engine.randn(..., {generator = g, dtype =, device =, requires_grad =})
for _, name in ipairs({ "rand", "randn" }) do
  local base = Tensor.functions[name]
  M[name] = function(...)
    local n = select("#", ...)
    local last = n > 0 and select(n, ...) or nil
    if type(last) == "table" and getmetatable(last) == nil and last[1] == nil and last.generator ~= nil then
      return with_generator(check_generator(last.generator, name), base, ...)
    end
    return base(...)
  end
end

-- engine.rand_like / randn_like(t, {generator = g, dtype =, device =, requires_grad =}); of a
-- DTensor: a DTensor of t's layout whose full tensor is engine.rand(t:shape(), {generator = g})
for _, name in ipairs({ "rand_like", "randn_like" }) do
  local base = Tensor.functions[name]
  M[name] = function(t, opts, ...)
    if type(opts) == "table" and getmetatable(opts) == nil and opts.generator ~= nil then
      return with_generator(check_generator(opts.generator, name), base, t, opts, ...)
    end
    return base(t, opts, ...)
  end
end

-- engine.dropout(x, p = 0.5, training = true [, g | {generator = g}]): the mask drawn from g (nil: the
-- global generator); the backward reuses the forward's (seed, offset), it draws nothing.
do
  local nnops = require("engine.ops.nn")
  local base = nnops.dropout
  M.dropout = function(x, p, training, gen)
    local g = trailing_generator(gen, "dropout")
    if g == nil then return base(x, p, training) end
    return with_generator(g, base, x, p, training)
  end
end

-- engine.scaled_dot_product_attention(q, k, v, {..., dropout_p =, generator = g}): the attention-weight
-- dropout drawn from g (an extension, as dropout's: PyTorch's SDPA takes no generator); F.scaled_dot_product_attention
-- passes the option table through.
do
  local nnops = require("engine.ops.nn")
  local base = nnops.scaled_dot_product_attention
  M.scaled_dot_product_attention = function(q, k, v, opts)
    if type(opts) == "table" and getmetatable(opts) == nil and opts.generator ~= nil then
      local g = check_generator(opts.generator, "scaled_dot_product_attention")
      local o = {}
      for key, val in pairs(opts) do if key ~= "generator" then o[key] = val end end
      return with_generator(g, base, q, k, v, o)
    end
    return base(q, k, v, opts)
  end
end

local kinds = { uniform = 0, normal = 1, bernoulli = 2 }

-- int64_t[8] from a Lua list of nd integers; base 1: 1-based positions
-- (converted to 0-based).  Errors point at the caller of the API function.
local function int_array(list, nd, what, op, base)
  if type(list) ~= "table" or #list ~= nd then
    error(string.format("%s: %s must be a table of %d integers", op, what, nd), 3)
  end
  local arr = ffi.new("int64_t[8]")
  for i = 1, nd do
    local v = list[i]
    if type(v) ~= "number" or v % 1 ~= 0 or v < -2 ^ 63 or v >= 2 ^ 63 then
      error(string.format("%s: %s[%d] must be an integer in -2^63..2^63-1, got %s", op, what, i, tostring(v)), 3)
    end
    if base == 1 and v < 1 then
      error(string.format("%s: %s[%d] = %d is invalid: positions are 1-based", op, what, i, v), 3)
    end
    arr[i - 1] = v - base
  end
  return arr
end

-- random_slice(kind, global_shape, start, size, opts)
--   kind: "uniform" (opts.a, opts.b: U[a, b), default 0, 1), "normal" (a mean,
--   b std, default 0, 1) or "bernoulli" (a = probability of 1, default 0.5).
--   start: 1-based first position per dim (nil: all 1); size: sizes (nil: to
--   the end).  opts.dtype (default f32); opts.seed / opts.offset default to
--   the state of opts.generator or of the global generator, which is NOT advanced.
function M.random_slice(kind, global_shape, start, size, opts)
  local op = "random_slice"
  local k = kinds[kind]
  if k == nil then
    error(op .. ": kind must be \"uniform\", \"normal\" or \"bernoulli\", got " .. tostring(kind), 2)
  end
  if type(global_shape) ~= "table" then error(op .. ": global_shape must be a table of sizes", 2) end
  opts = opts or {}
  if type(opts) ~= "table" then error(op .. ": options must be a table", 2) end
  local nd = #global_shape
  if nd > 8 then error(string.format("%s: %d dims given; at most 8 are supported", op, nd), 2) end
  local gshape = int_array(global_shape, nd, "global_shape", op, 0)
  local st = start ~= nil and int_array(start, nd, "start", op, 1) or nil
  local sz = size ~= nil and int_array(size, nd, "size", op, 0) or nil
  local a, b
  if k == 0 then a, b = opts.a or 0, opts.b or 1
  elseif k == 1 then a, b = opts.a or 0, opts.b or 1
  else a, b = opts.a or 0.5, 0 end
  if type(a) ~= "number" or type(b) ~= "number" then error(op .. ": opts.a and opts.b must be numbers", 2) end
  local seed, offset = opts.seed, opts.offset
  local g = check_generator(opts.generator, op)
  if g ~= nil and (seed ~= nil or offset ~= nil) then
    error(op .. ": pass either a generator or seed/offset, not both", 2)
  end
  if g ~= nil then
    seed, offset = g._c.seed, g._c.offset
  elseif seed == nil or offset == nil then
    C.eng_rng_get_state(state_buf, state_buf + 1)
    seed = seed == nil and state_buf[0] or to_u64(seed, "seed", op)
    offset = offset == nil and state_buf[1] or to_u64(offset, "offset", op)
  else
    seed, offset = to_u64(seed, "seed", op), to_u64(offset, "offset", op)
  end
  local dt = core.dtype(opts.dtype or 0, op, 3)
  return wrap(C.eng_random_slice(k, nd, gshape, st, sz, a, b, dt, seed, offset))
end

-- In-place fills (no autograd) from the global generator, or from g:
-- t:uniform_(a, b [, g | {generator = g}]), t:normal_(mean, std [, g | {generator = g}]).
local function fill(cfun, t, a, b, g)
  if g == nil then return cfun(t, a, b) end
  local prev = C.eng_rng_use(g._c)
  local rc = cfun(t, a, b)          -- returns a status: nothing to unwind
  C.eng_rng_use(prev)
  return rc
end

function methods.uniform_(t, a, b, gen)
  a, b = a or 0, b or 1
  if type(a) ~= "number" or type(b) ~= "number" then error("uniform_: bounds must be numbers", 2) end
  local g = trailing_generator(gen, "uniform_")
  check(fill(C.eng_uniform_, ct(t, "uniform_", 1), a, b, g))
  return t
end

function methods.normal_(t, mean, std, gen)
  mean, std = mean or 0, std or 1
  if type(mean) ~= "number" or type(std) ~= "number" then error("normal_: mean and std must be numbers", 2) end
  local g = trailing_generator(gen, "normal_")
  check(fill(C.eng_normal_, ct(t, "normal_", 1), mean, std, g))
  return t
end

M.uniform_ = methods.uniform_
M.normal_ = methods.normal_
-- for nn.init and other random ops: (generator checks, scoped draws)
M._generator = { check = check_generator, trailing = trailing_generator, with = with_generator, fill = fill }

return M
