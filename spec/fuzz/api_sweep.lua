-- A random sweep of the public Lua API (issue 26): engine.*, Tensor methods, nn modules, optim, F.* and the
-- single-process parts of engine.distributed (DTensor on a 1-rank mesh, redistribute, ShardedTensor,
-- dist.checkpoint save/load into a temporary folder), called with random but type-plausible arguments drawn
-- from a seeded PRNG: shapes with 0 and huge sizes, negative dims, every dtype, nil, NaN/inf, strings,
-- option tables with unknown keys, aliasing views, expanded tensors.
--
-- Every call must return or raise a Lua error whose message is a non-empty string that names the operation
-- (never a crash, a C assert, a sanitizer report, a hang, a non-string error or an internal Lua error such as
-- "attempt to index a nil value" from inside the library).  Each call draws from its own PRNG, seeded from
-- (seed, call number), so one call replays alone:
--
--   build/engine spec/fuzz/api_sweep.lua SEED CALLS [FIRST]      (a run; FIRST: start at that call number)
--   ENGINE_SWEEP_VERBOSE=1 ...                                    (print each call before making it:
--                                                                  the last line before a crash is the culprit)
--
-- spec/api_sweep_spec.lua runs a small fixed budget in make test (both builds); tools/fuzz.sh runs it longer.
local engine = require("engine")
local bit = require("bit")
local ffi = require("ffi")

local M = {}

-- ---------------------------------------------------------------- PRNG (xorshift32 on a per-call seed)
local R = {}
R.__index = R
local function mix(a, b)
  local h = bit.tobit(0x9E3779B9)
  h = bit.bxor(h, a); h = bit.tobit(h * 0x85EBCA6B % 2 ^ 32)
  h = bit.bxor(h, bit.rshift(h, 13)); h = bit.bxor(h, b)
  h = bit.tobit(h * 0xC2B2AE35 % 2 ^ 32); h = bit.bxor(h, bit.rshift(h, 16))
  if h == 0 then h = 1 end
  return h
end
function M.rng(seed, n) return setmetatable({ s = mix(seed, n or 0) }, R) end
function R:u32()
  local x = self.s
  x = bit.bxor(x, bit.lshift(x, 13)); x = bit.bxor(x, bit.rshift(x, 17)); x = bit.bxor(x, bit.lshift(x, 5))
  self.s = x
  return x % 2 ^ 32
end
function R:int(a, b) return a + self:u32() % (b - a + 1) end        -- a..b inclusive
function R:chance(p) return self:u32() / 2 ^ 32 < p end
function R:pick(list) return list[self:int(1, #list)] end

-- ---------------------------------------------------------------- values
local DTYPES = { "f32", "f32", "f32", "f64", "bf16", "f16", "i32", "i64", "u8", "bool" }
local FLOATS = { f32 = true, f64 = true, bf16 = true, f16 = true }
-- huge sizes are past any memory (a tensor of one must be refused before anything is allocated); sizes that
-- fit memory stay small enough that no call of the sweep takes seconds or gigabytes
local HUGE = { 2 ^ 40, 2 ^ 53, 2 ^ 62, 2 ^ 63, -2 ^ 62, 1e300, 2 ^ 31 - 1 + 2 ^ 40 }
local STRINGS = { "", "f32", "i64", "bf16", "cpu", "meta", "sum", "mean", "none", "floor", "trunc", "max",
  "xyz", "dp", "\0", "a\nb", "1", "nan", "S(0)", "R", "P" }

-- a size for one dim: mostly small, sometimes 0, rarely huge or negative
local function size(r)
  local k = r:int(1, 40)
  if k <= 30 then return r:int(1, 5) elseif k <= 36 then return 0
  elseif k <= 38 then return r:pick(HUGE) else return -r:int(1, 3) end
end

local function int(r)
  local k = r:int(1, 20)
  if k <= 14 then return r:int(-3, 5) elseif k <= 16 then return r:int(6, 64)
  elseif k <= 18 then return r:pick(HUGE) elseif k == 19 then return r:int(65, 1024) else return -r:int(4, 4096) end
end

local function number(r)
  local k = r:int(1, 12)
  if k <= 6 then return (r:u32() / 2 ^ 31 - 1) * 4 elseif k <= 8 then return int(r)
  elseif k == 9 then return 0 / 0 elseif k == 10 then return math.huge elseif k == 11 then return -math.huge
  else return 1e-310 end
end

local function shape(r, small)
  local nd = r:int(0, 4)
  local s = {}
  for i = 1, nd do s[i] = small and r:int(0, 4) or size(r) end
  return s
end

local function numel(s)
  local n = 1
  for _, v in ipairs(s) do n = n * v end
  return n
end

-- a tensor of a random dtype and small shape, sometimes with NaN/inf, sometimes a view (transposed, narrowed,
-- expanded, an alias of another tensor) or requiring grad
local function tensor(r, pool)
  if pool and #pool > 0 and r:chance(0.25) then return r:pick(pool) end        -- aliasing: the same tensor again
  local s = shape(r, true)
  local dt = r:pick(DTYPES)
  local ok, t = pcall(function()
    local x
    if FLOATS[dt] then x = engine.randn(s, { dtype = dt })
    elseif dt == "bool" then x = engine.rand(s):gt(0.5)
    else x = engine.randn(s):mul(4):to(dt) end
    if FLOATS[dt] and numel(s) > 0 and r:chance(0.2) then
      x:view(-1):narrow(1, 1, 1):fill_(r:pick({ 0 / 0, math.huge, -math.huge }))
    end
    local v = r:int(1, 10)
    if v == 1 and #s >= 2 then x = x:transpose(1, 2)
    elseif v == 2 and #s >= 1 and s[1] >= 2 then x = x:narrow(1, 2, s[1] - 1)
    elseif v == 3 and #s >= 1 then
      local e = {}
      for i = 1, #s do e[i] = s[i] end
      x = x:narrow(1, 1, math.min(1, s[1])):expand(e)                          -- an expanded tensor (stride 0)
    elseif v == 4 then x = x:unsqueeze(1):expand(2, unpack(s))
    elseif v == 5 and FLOATS[dt] then x = x:detach():requires_grad_()
    end
    return x
  end)
  if not ok then error("api sweep: making a tensor of " .. dt .. " failed: " .. tostring(t)) end
  if pool then pool[#pool + 1] = t end
  return t
end
M.tensor = tensor

local OPT_KEYS = { "dtype", "device", "dim", "keepdim", "bias", "eps", "lr", "weight_decay", "reduction", "alpha",
  "rounding_mode", "out", "requires_grad", "momentum", "betas", "src_rank", "strict", "async", "mesh", "placements",
  "dtpye", "bais", "unknown_key", "ignore_index", "label_smoothing", "inplace", "p", "training" }

local value
local function opts(r, pool, depth)
  local t = {}
  for _ = 1, r:int(0, 3) do t[r:pick(OPT_KEYS)] = value(r, pool, depth + 1) end
  return t
end

-- one argument of any plausible kind
value = function(r, pool, depth)
  depth = depth or 0
  local k = r:int(1, depth > 1 and 14 or 24)
  if k <= 5 then return tensor(r, pool)
  elseif k <= 9 then return int(r)
  elseif k <= 11 then return number(r)
  elseif k == 12 then return nil
  elseif k == 13 then return r:pick(STRINGS)
  elseif k == 14 then return r:chance(0.5)
  elseif k <= 17 then return shape(r)
  elseif k <= 19 then return opts(r, pool, depth)
  elseif k == 20 then return { tensor(r, pool), tensor(r, pool) }
  elseif k == 21 then return function() end
  elseif k == 22 then return ffi.new("int64_t", int(r))
  elseif k == 23 then return {}
  else return { value(r, pool, depth + 1) } end
end
M.value = value

local function args(r, pool, n)
  local a = {}
  n = n or r:int(0, 4)
  for i = 1, n do a[i] = value(r, pool) end
  return a, n
end

-- ---------------------------------------------------------------- describing a call (for the log)
local function describe(v, depth)
  depth = depth or 0
  local t = type(v)
  if t == "nil" or t == "boolean" then return tostring(v) end
  if t == "number" then
    if v ~= v then return "0/0" elseif v == math.huge then return "math.huge" elseif v == -math.huge then return "-math.huge" end
    return string.format("%.17g", v)
  end
  if t == "string" then return string.format("%q", v):gsub("\\\n", "\\n") end
  if engine.is_tensor(v) then
    local ok, s = pcall(function()
      local sh = {}
      for i, x in ipairs(v:shape()) do sh[i] = string.format("%.17g", x) end
      return string.format("%s[%s]%s%s", tostring(v.dtype), table.concat(sh, ","), v:is_contiguous() and "" or "(view)",
        v.requires_grad and "(grad)" or "")
    end)
    return ok and s or "tensor(?)"
  end
  if t == "table" then
    if depth > 2 then return "{...}" end
    local parts = {}
    for k, x in pairs(v) do
      parts[#parts + 1] = (type(k) == "string" and k .. "=" or "") .. describe(x, depth + 1)
      if #parts > 8 then parts[#parts + 1] = "..."; break end
    end
    return "{" .. table.concat(parts, ", ") .. "}"
  end
  if t == "cdata" then return tostring(v) end
  return t
end
M.describe = describe

local function describe_args(a, n)
  local s = {}
  for i = 1, n do s[i] = describe(a[i]) end
  return table.concat(s, ", ")
end

-- ---------------------------------------------------------------- the error check
-- Internal Lua errors: a library bug, not a message for the user.
local INTERNAL = { "attempt to ", "bad argument #", "table index is ", "stack overflow", "invalid key to 'next'",
  "number has no integer representation", "C stack overflow", "bad callback", "invalid value %(at index",
  "wrong number of arguments", "cannot convert '", "not enough memory", "assertion", "Assertion", "<no message>" }

-- nil: acceptable; else why the error is not
function M.bad_error(e, names)
  if type(e) ~= "string" then return "a non-string error (" .. type(e) .. ": " .. tostring(e) .. ")" end
  if e == "" then return "an empty error message" end
  for _, p in ipairs(INTERNAL) do
    if e:find(p) then return "an internal error" end
  end
  -- the message names the operation: the swept name, or the op that ran (an alias or a composite's part:
  -- ger -> "outer: ...", relu6 -> "hardtanh: ..."), as the engine's messages start, after the call site
  local body = e:gsub("^[^\n]-%.lua:%d+: ", "")
  if body:match("^[%a_][%w_%.]*[%w_%)%]]*: ") or body:match("^[%a_][%w_%.:]*%([^%)]*%): ") then return nil end
  local low = e:lower()
  for _, n in ipairs(names) do
    if low:find(n:lower(), 1, true) then return nil end
  end
  return "the message does not name the operation (" .. table.concat(names, " or ") .. ")"
end

-- ---------------------------------------------------------------- the targets
-- Not swept: functions that change process-wide settings, touch files at paths from their arguments,
-- print, block, or only exist to measure (each has its own specs).
local SKIP = { save = true, load = true, load_safetensors = true, set_num_threads = true, set_default_device = true,
  set_gc_threshold = true, set_grad_enabled = true, empty_cache = true, with_device = true, time = true,
  manual_seed = true, set_rng_state = true, Generator = true, C = true, ffi = true, version = true,
  memory_stats = true, reset_peak_memory = true, live_tensors = true, blas_core = true, blas_corename = true,
  blas_core_reason = true, get_num_threads = true, get_default_device = true, is_grad_enabled = true,
  no_grad = true, enable_grad = true, -- call their argument
  -- Tensor methods
  data_ptr = true, save = true, cuda = true, pin_memory = true, register_hook = true, print = true,
  register_post_accumulate_grad_hook = true, set_ = true }

local M_TARGETS
local function targets()
  if M_TARGETS then return M_TARGETS end
  local list = {}
  local function add(kind, name, names, fn) list[#list + 1] = { kind = kind, name = name, names = names, fn = fn } end
  -- engine.*
  local keys = {}
  for k, v in pairs(engine) do if type(v) == "function" and not SKIP[k] and k:sub(1, 1) ~= "_" then keys[#keys + 1] = k end end
  table.sort(keys)
  for _, k in ipairs(keys) do
    add("engine", "engine." .. k, { k }, function(r, pool)
      local a, n = args(r, pool)
      if n > 0 and r:chance(0.7) then a[1] = tensor(r, pool) end
      return engine[k], a, n
    end)
  end
  -- Tensor methods
  local methods = engine.Tensor.methods
  keys = {}
  for k, v in pairs(methods) do if type(v) == "function" and not SKIP[k] and k:sub(1, 1) ~= "_" then keys[#keys + 1] = k end end
  table.sort(keys)
  for _, k in ipairs(keys) do
    add("method", "Tensor:" .. k, { (k:gsub("_$", "")) }, function(r, pool)
      local a, n = args(r, pool)
      table.insert(a, 1, tensor(r, pool))
      return methods[k], a, n + 1
    end)
  end
  -- F.*
  local F = engine.nn.functional
  keys = {}
  for k, v in pairs(F) do if type(v) == "function" and k:sub(1, 1) ~= "_" then keys[#keys + 1] = k end end
  table.sort(keys)
  for _, k in ipairs(keys) do
    add("F", "F." .. k, { k }, function(r, pool)
      local a, n = args(r, pool)
      if n > 0 and r:chance(0.8) then a[1] = tensor(r, pool) end
      return F[k], a, n
    end)
  end
  -- nn modules: construct, then call forward on a random input
  local nn = engine.nn
  keys = {}
  for k, v in pairs(nn) do
    if type(v) == "table" and k:match("^%u") and k ~= "Module" and k ~= "ModuleDict" and k ~= "ModuleList" then keys[#keys + 1] = k end
  end
  table.sort(keys)
  for _, k in ipairs(keys) do
    add("nn", "nn." .. k, { k }, function(r, pool)
      local a, n = args(r, pool)
      for i = 1, n do if type(a[i]) == "number" and r:chance(0.6) then a[i] = r:int(0, 6) end end
      local x = r:chance(0.8) and tensor(r, pool) or value(r, pool)
      local y = r:chance(0.3) and tensor(r, pool) or nil
      return function(...)
        local m = nn[k](...)
        local out = m(x, y)
        if engine.is_tensor(out) and out.requires_grad and out:numel() > 0 and r:chance(0.5) then out:sum():backward() end
        return out
      end, a, n
    end)
  end
  -- optim: a small model's parameters, random options, a step
  for _, k in ipairs({ "AdamW", "SGD" }) do
    add("optim", "optim." .. k, { k }, function(r, pool)
      local o = opts(r, pool, 0)
      if r:chance(0.5) then o.lr = number(r) end
      local params = r:chance(0.8) and nn.Linear(3, 2):parameters() or value(r, pool)
      return function(p, oo)
        local opt = engine.optim[k](p, oo)
        if type(p) == "table" then
          for _, q in ipairs(p) do if engine.is_tensor(q) then q.grad = engine.randn(q:shape()) end end
        end
        opt:step()
        opt:zero_grad()
        return opt
      end, { params, o }, 2
    end)
  end
  for _, k in ipairs({ "clip_grad_norm_", "clip_grad_value_", "global_norm" }) do
    add("optim", "optim." .. k, { k:gsub("_$", ""), "clip", "norm" }, function(r, pool)
      local a, n = args(r, pool)
      if r:chance(0.6) then a[1] = { tensor(r, pool) }; n = math.max(n, 1) end
      return engine.optim[k], a, n
    end)
  end
  -- distributed, single process: a 1-rank mesh
  local dist = engine.distributed
  -- placements and meshes are drawn here and built inside the call (building one may be the error)
  local function placements(r, pool)
    if r:chance(0.1) then local v = value(r, pool); return function() return v end end
    local p = {}
    for i = 1, r:chance(0.85) and 1 or r:int(0, 2) do
      local k = r:int(1, 10)
      if k <= 4 then p[i] = function() return dist.Replicate() end
      elseif k <= 8 then local d = r:chance(0.8) and r:int(-2, 3) or int(r); p[i] = function() return dist.Shard(d) end
      elseif k == 9 then local op = r:chance(0.5) and r:pick(STRINGS) or nil; p[i] = function() return dist.Partial(op) end
      else local v = value(r, pool); p[i] = function() return v end end
    end
    return function()
      local out = {}
      for i = 1, #p do out[i] = p[i]() end
      return out
    end
  end
  local function mesh(r)
    if r:chance(0.9) then return function() return dist.init_device_mesh("cpu", { 1 }) end end
    local dev, sh = r:pick({ "cpu", "cpu", "meta", "xyz" }), r:pick({ { 1 }, { 1, 1 }, { 2 }, { 0 }, {} })
    return function() return dist.init_device_mesh(dev, sh) end
  end
  add("dist", "dist.distribute_tensor", { "distribute_tensor" }, function(r, pool)
    local t, m, p = tensor(r, pool), mesh(r), placements(r, pool)
    return function() return dist.distribute_tensor(t, m(), p()) end, {}, 0
  end)
  add("dist", "DTensor:redistribute", { "redistribute" }, function(r, pool)
    local m = mesh(r)
    local t = tensor(r, pool)
    local p = placements(r, pool)
    local q = placements(r, pool)
    return function()
      local mm = m()
      local d = dist.distribute_tensor(t, mm, p())
      local e = d:redistribute(mm, q())
      local f = e:full_tensor()
      if f:numel() > 0 and r:chance(0.5) then local _ = (d + e):to_local() end
      return f
    end, {}, 0
  end)
  add("dist", "DTensor op", { "dtensor", "add", "mul", "matmul", "sum", "copy", "redistribute", "distribute_tensor" }, function(r, pool)
    local m = dist.init_device_mesh("cpu", { 1 })
    local t = tensor(r, pool)
    local p = placements(r, pool)
    local op = r:pick({ "add", "mul", "matmul", "sum", "copy_", "view", "transpose", "narrow", "softmax", "mean" })
    local a = args(r, pool, r:int(0, 2))
    return function()
      local d = dist.distribute_tensor(t, m, p())
      return d[op](d, unpack(a, 1, 2))
    end, {}, 0
  end)
  add("dist", "dist.from_local", { "from_local" }, function(r, pool)
    local t, m, p, o = tensor(r, pool), mesh(r), placements(r, pool), r:chance(0.5) and opts(r, pool, 0) or nil
    return function() return dist.from_local(t, m(), p(), o) end, {}, 0
  end)
  add("dist", "dist.ShardedTensor", { "shard", "sharded", "ShardingSpec", "ShardedTensor", "chunk", "placement" }, function(r, pool)
    local dim = r:chance(0.8) and r:int(-2, 2) or value(r, pool)
    local pl = r:chance(0.8) and { "rank:0/cpu" } or value(r, pool)
    local t = tensor(r, pool)
    local extra = value(r, pool)
    return function()
      local spec = dist.ChunkShardingSpec{ dim = dim, placements = pl }
      local st = dist.shard_tensor(t, spec, extra)
      local b = st:local_tensor()
      if r:chance(0.5) then st = st:reshard(spec) end
      return b
    end, {}, 0
  end)
  add("dist", "dist.checkpoint", { "checkpoint" }, function(r, pool)
    local dir = os.tmpname()
    os.remove(dir)
    local state = {}
    for _ = 1, r:int(0, 3) do
      local key = r:pick({ "w", "b", "model.x", "step", "a\nb", "", "v" })
      local k = r:int(1, 4)
      if k == 1 then state[key] = tensor(r, pool)
      elseif k == 2 then local t, p = tensor(r, pool), placements(r, pool); state[key] = function() return dist.distribute_tensor(t, dist.init_device_mesh("cpu", { 1 }), p()) end
      else state[key] = value(r, pool) end
    end
    local so, lo = r:chance(0.3) and opts(r, pool, 0) or nil, r:chance(0.3) and opts(r, pool, 0) or nil
    return function()
      local ok, e = pcall(function()
        for k, v in pairs(state) do if type(v) == "function" then state[k] = v() end end
        local h = dist.checkpoint.save(state, dir, so)
        if h and h.wait then h:wait() end
        local into = {}
        for k, v in pairs(state) do into[k] = engine.is_tensor(v) and v:clone() or v end
        dist.checkpoint.load(into, dir, lo)
        dist.checkpoint.read_metadata(dir)
      end)
      os.execute("rm -rf '" .. dir .. "'")
      if not ok then error(e, 0) end
    end, {}, 0
  end)
  M_TARGETS = list
  return list
end
M.targets = targets

-- ---------------------------------------------------------------- running
-- run{seed =, calls =, first =, seconds =, verbose =, log = fn(line)} -> {calls =, ok =, errors =, failures = {...}}
-- Stops after `calls` calls, or after `seconds` (when given) whichever comes first.
function M.run(o)
  local seed = o.seed or 1
  local list = targets()
  local log = o.log or function(s) io.stderr:write(s, "\n") end
  local res = { calls = 0, ok = 0, errors = 0, failures = {} }
  local t0 = os.clock()
  local wall0 = engine.time()
  local first = o.first or 1
  for i = first, first + (o.calls or 1000) - 1 do
    if o.seconds and engine.time() - wall0 > o.seconds then break end
    local r = M.rng(seed, i)
    local tg = list[r:int(1, #list)]
    local pool = {}
    local desc
    local okb, fn, a, n = pcall(tg.fn, r, pool)
    if not okb then
      res.failures[#res.failures + 1] = string.format("seed %d call %d: %s: building the arguments failed: %s", seed, i, tg.name, tostring(fn))
    else
      desc = string.format("%s(%s)", tg.name, describe_args(a, n))
      if o.verbose then log(string.format("call %d: %s", i, desc)) end
      local c0 = engine.time()
      local ok, e = pcall(fn, unpack(a, 1, n))
      local dt = engine.time() - c0
      res.calls = res.calls + 1
      if ok then res.ok = res.ok + 1 else res.errors = res.errors + 1 end
      local why = not ok and M.bad_error(e, tg.names) or nil
      if not why and dt > (o.slow or 5) then why = string.format("slow: %.1f s", dt) end
      if why then
        local shown = ok and ("returned " .. describe(e)) or tostring(e)
        res.failures[#res.failures + 1] = string.format("seed %d call %d: %s: %s: %s", seed, i, desc, why, shown)
        log("api sweep FAILURE " .. res.failures[#res.failures])
        if #res.failures >= (o.max_failures or 50) then break end
      end
      if o.count then o.count[tg.name] = (o.count[tg.name] or 0) + 1 end
    end
    if i % 64 == 0 then collectgarbage() end
  end
  res.cpu = os.clock() - t0
  res.wall = engine.time() - wall0
  return res
end

-- As a script: build/engine spec/fuzz/api_sweep.lua [SEED] [CALLS] [FIRST] [SECONDS]
if arg and arg[0] and arg[0]:match("api_sweep%.lua$") then
  local seed = tonumber(arg[1] or os.getenv("ENGINE_SWEEP_SEED") or "1")
  local calls = tonumber(arg[2] or os.getenv("ENGINE_SWEEP_CALLS") or "2000")
  local first = tonumber(arg[3] or "1")
  local secs = tonumber(arg[4] or os.getenv("ENGINE_SWEEP_SECONDS") or "")
  local res = M.run{ seed = seed, calls = calls, first = first, seconds = secs, verbose = os.getenv("ENGINE_SWEEP_VERBOSE") ~= nil }
  print(string.format("api sweep: seed %d, %d calls from %d (%d returned, %d raised), %d failures, %.1f s",
    seed, res.calls, first, res.ok, res.errors, #res.failures, res.wall))
  for _, f in ipairs(res.failures) do print("  " .. f) end
  os.exit(#res.failures == 0 and 0 or 1)
end

return M
