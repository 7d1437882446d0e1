-- engine.core: shared plumbing for the Lua layer: the C library handle,
-- error conversion, dims (1-based in Lua, 0-based in C), dtypes, shapes.
local F = require("engine.ffi")
local ffi, C = F.ffi, F.C

local M = { ffi = ffi, C = C }

-- The Tensor class table is installed by engine.tensor.
M.Tensor = nil

local tensor_release = C.eng_tensor_release

function M.last_error()
  return ffi.string(C.eng_last_error())
end

-- Raises msg at the first stack frame outside the engine's Lua library, so
-- errors point at the user's line whatever the call depth (tail calls
-- included).  The `level` arguments of the helpers below are accepted for
-- compatibility and ignored.
local lib_marker = "/lua/engine/"
local function user_level()
  local lvl = 3
  while true do
    local info = debug.getinfo(lvl, "S")
    if not info then return 2 end
    if info.what ~= "C" and not info.source:find(lib_marker, 1, true) then return lvl - 1 end
    lvl = lvl + 1
  end
end

function M.fail(msg)
  error(msg, user_level())
end
local fail = M.fail

-- "op: msg" with one op name: msg from C may already start with "op: " or
-- with the name of a lower-level helper that the caller names better
-- ("dtype: unknown dtype 'x'" under "to" reads "to: unknown dtype 'x'").
function M.prefixed(op, msg, inner)
  if not op then return msg end
  local head = msg:match("^([%w_%.:]-): ")
  if head == op or (inner and head == inner) then msg = msg:sub(#head + 3) end
  return op .. ": " .. msg
end

-- A Lua number that becomes a C int64 (sizes, indices, offsets): an integer
-- in [-2^63, 2^63), else an error naming op and what (no silent wrap).
local TWO63 = 2 ^ 63
function M.int64(v, op, what)
  if type(v) ~= "number" or v % 1 ~= 0 then
    fail(string.format("%s: %s must be an integer, got %s", op, what, tostring(v)))
  end
  if v < -TWO63 or v >= TWO63 then
    fail(string.format("%s: %s %.17g is out of range (a 64-bit signed integer: -2^63..2^63-1)", op, what, v))
  end
  return v
end

-- at_exit(fn): fn() runs once when the script ends normally: after the recipe returns (the engine host)
-- or at os.exit(0 / true) (engine.distributed's os.exit), before MPI is finalized, in the order
-- registered.  An error in one is the script's error (printed, exit status 1; a multi-rank job is
-- aborted).  dist.checkpoint finishes an async save nobody waited for here.
local exit_hooks, exited = {}, false
function M.at_exit(fn) exit_hooks[#exit_hooks + 1] = fn end
rawset(_G, "__engine_at_exit", function()
  if exited then return end
  exited = true
  for _, fn in ipairs(exit_hooks) do fn() end
end)

function M.raise()
  error(M.last_error(), user_level())
end

-- An options table: nil gives {}; anything but a plain table, or a key that
-- is not in `known` (a list of names), is an error naming op and the known
-- keys (a typo such as {dtpye = "i64"} must not be ignored).
function M.check_opts(opts, known, op)
  if opts == nil then return {} end
  if type(opts) ~= "table" or getmetatable(opts) ~= nil then
    fail(string.format("%s: options must be a table, got %s", op, getmetatable(opts) == M.Tensor and "a tensor" or type(opts)))
  end
  for k in pairs(opts) do
    local ok = false
    for i = 1, #known do if known[i] == k then ok = true; break end end
    if not ok then
      local names = { unpack(known) }
      table.sort(names)
      fail(string.format("%s: unknown option '%s' (known: %s)", op, tostring(k), table.concat(names, ", ")))
    end
  end
  return opts
end

-- Collector pressure (docs/design.md "Allocator").  A Tensor is a small
-- table whose storage Lua's collector does not see, so a loop that drops
-- megabytes of activations per iteration would grow until the Lua heap alone
-- triggered a collection.  The allocator counts the bytes of live storages
-- (CPU and CUDA) and raises a flag when they pass a threshold; wrap() reads
-- it (one load) and runs a full collection, then the next threshold is
--   max(ratio * live, live + floor)     (live: bytes still held after it)
-- where floor starts at min_bytes and is paced: doubled (up to 16 x
-- min_bytes) while collections take more than max_fraction of the time
-- between them, halved back while they take under a quarter of it.
-- engine.set_gc_threshold{ratio =, min_bytes =, max_fraction =} or
-- ENGINE_GC_RATIO / ENGINE_GC_MIN_MB / ENGINE_GC_MAX_FRACTION set it;
-- ratio 0 turns it off.
-- Backward: the forward's intermediate tensors stay referenced by Lua
-- wrappers that are already garbage, so the autograd graph's releasing its
-- saved tensors as backward runs would free nothing until the next
-- collection (backward itself is C and wraps no tensors).  backward() and
-- autograd.grad() therefore call gc_backward() first: a full collection when
-- tensors hold more than `backward` MiB, unless the last such collection took
-- more than backward_fraction of the process's CPU time since it (so their cost
-- stays under that fraction: one collection per training step of a real
-- model, few in a loop of tiny backward passes).  backward = 0 turns it off
-- (ENGINE_GC_BACKWARD in MiB, ENGINE_GC_BACKWARD_FRACTION).
local gc_flag = C.eng_alloc_gc_flag()
local gc = { ratio = 2, min_bytes = 64 * 2 ^ 20, max_fraction = 0.01, backward = 4, backward_fraction = 0.05, floor = 64 * 2 ^ 20,
  live = 0, last = 0, cpu_last = 0, cpu_took = 0, bw_last = 0, bw_took = 0, collections = 0, seconds = 0 }
M.gc = gc

local function gc_arm()
  if gc.ratio <= 0 then C.eng_alloc_set_gc_threshold(-1); return end
  local live = tonumber(C.eng_alloc_gc_bytes())
  gc.live = live
  C.eng_alloc_set_gc_threshold(math.max(gc.ratio * live, live + gc.floor))
end

-- Runs the collection the allocator asked for and re-arms the threshold.
function M.gc_collect()
  local t0, c0 = C.eng_time(), os.clock()
  collectgarbage("collect")
  local t1, c1 = C.eng_time(), os.clock()
  gc.cpu_last, gc.cpu_took = c1, c1 - c0
  local took = t1 - t0
  if gc.max_fraction > 0 and gc.last > 0 then   -- moving averages of the cost and of the period
    gc.avg_took = gc.avg_took and 0.75 * gc.avg_took + 0.25 * took or took
    gc.avg_period = gc.avg_period and 0.75 * gc.avg_period + 0.25 * (t1 - gc.last) or t1 - gc.last
    local frac = gc.avg_took / math.max(gc.avg_period, 1e-9)
    if frac > gc.max_fraction and gc.floor < 16 * gc.min_bytes then
      gc.floor = math.min(gc.floor * 2, 16 * gc.min_bytes); gc.avg_period = nil
    elseif frac < 0.25 * gc.max_fraction and gc.floor > gc.min_bytes then
      gc.floor = math.max(gc.floor / 2, gc.min_bytes); gc.avg_period = nil
    end
  end
  gc.last = t1
  gc.collections = gc.collections + 1
  gc.seconds = gc.seconds + took
  gc_arm()
end
local gc_collect = M.gc_collect

-- The collection before a backward pass (see above).
function M.gc_backward()
  if gc.ratio <= 0 or gc.backward <= 0 then return end
  if tonumber(C.eng_alloc_gc_bytes()) <= gc.backward * 2 ^ 20 then return end
  -- its own budget: a pressure collection earlier in the forward must not make this one look too recent
  if gc.bw_took > gc.backward_fraction * (os.clock() - gc.bw_last) then return end
  gc.backward_collections = (gc.backward_collections or 0) + 1
  gc_collect()
  gc.bw_last, gc.bw_took = gc.cpu_last, gc.cpu_took
end

-- Sets the policy above (fields left out keep their values); returns the
-- previous settings.
function M.set_gc_threshold(o)
  local prev = { ratio = gc.ratio, min_bytes = gc.min_bytes, max_fraction = gc.max_fraction, backward = gc.backward,
    backward_fraction = gc.backward_fraction }
  if type(o) ~= "table" then
    fail("set_gc_threshold: expected a table {ratio =, min_bytes =, max_fraction =, backward =, backward_fraction =}, got " .. type(o))
  end
  for k, v in pairs(o) do
    if prev[k] == nil then
      fail("set_gc_threshold: unknown field '" .. tostring(k) .. "' (known: ratio, min_bytes, max_fraction, backward, backward_fraction)")
    end
    if type(v) ~= "number" or v ~= v or v < 0 or v == math.huge or (k == "ratio" and v > 0 and v < 1) then
      fail(string.format("set_gc_threshold: %s must be a finite number >= 0%s, got %s", k,
        k == "ratio" and " (0: off, else >= 1)" or "", tostring(v)))
    end
  end
  for k, v in pairs(o) do gc[k] = v end
  gc.floor, gc.avg_took, gc.avg_period = gc.min_bytes, nil, nil
  gc_arm()
  return prev
end

do
  local env = { ratio = "ENGINE_GC_RATIO", min_bytes = "ENGINE_GC_MIN_MB", max_fraction = "ENGINE_GC_MAX_FRACTION",
    backward = "ENGINE_GC_BACKWARD", backward_fraction = "ENGINE_GC_BACKWARD_FRACTION" }
  local o = {}
  for k, name in pairs(env) do
    local v = os.getenv(name)
    if v and v ~= "" then
      local n = tonumber(v)
      if not n then error(string.format("%s=%s: expected a number", name, v), 0) end
      o[k] = k == "min_bytes" and n * 2 ^ 20 or n
    end
  end
  local ok, err = pcall(M.set_gc_threshold, o)
  if not ok then error("engine: ENGINE_GC_*: " .. tostring(err), 0) end
end

-- Wraps a new eng_tensor* reference in a Tensor, or raises the C error.
-- level: stack level of the user's call (3 = caller of the API function).
function M.wrap(p, level)
  if p == nil then fail(M.last_error()) end
  if gc_flag[0] ~= 0 then gc_collect() end
  return setmetatable({ _c = ffi.gc(p, tensor_release) }, M.Tensor)
end

-- Same for a pointer that is borrowed: takes a new reference.
function M.wrap_borrowed(p)
  if p == nil then return nil end
  C.eng_tensor_retain(p)
  return setmetatable({ _c = ffi.gc(p, tensor_release) }, M.Tensor)
end

function M.check(rc, level)
  if rc ~= 0 then fail(M.last_error()) end
end

function M.is_tensor(x)
  return type(x) == "table" and getmetatable(x) == M.Tensor
end

-- The eng_tensor* of a Tensor argument, or an error naming op and position.
function M.ct(x, op, pos, level)
  if type(x) == "table" and x._c then return x._c end
  fail(string.format("%s: argument %s must be a tensor, got %s", op, tostring(pos or 1), type(x)))
end

-- Optional tensor argument (nil allowed).
function M.ct_opt(x, op, pos, level)
  if x == nil then return nil end
  return M.ct(x, op, pos, (level or 3) + 1)
end

local dtype_cache = {}
-- dtype name or code -> code.
function M.dtype(d, op, level)
  if d == nil then return 0 end
  if type(d) == "number" then
    if d >= 0 and d < 8 and d % 1 == 0 then return d end
    fail(string.format("%s: invalid dtype code %s", op or "dtype", tostring(d)))
  end
  local c = dtype_cache[d]
  if c then return c end
  if type(d) ~= "string" then
    fail(string.format("%s: dtype must be a name such as \"f32\", got %s", op or "dtype", type(d)))
  end
  c = C.eng_dtype_from_name(d)
  if c < 0 then fail(M.prefixed(op, M.last_error(), "dtype")) end
  dtype_cache[d] = c
  return c
end

M.dtype_names = { [0] = "f32", "f64", "bf16", "f16", "i32", "i64", "u8", "bool" }

-- Lua dim (1-based, negative from the end) -> C dim (0-based).
-- ndim: number of dims of the tensor; extra: 1 when the op allows one past
-- the end (unsqueeze, stack).
function M.dim(d, ndim, op, extra, level)
  if type(d) ~= "number" or d % 1 ~= 0 then
    fail(string.format("%s: dim must be an integer, got %s", op, tostring(d)))
  end
  local n = ndim + (extra or 0)
  if d == 0 then
    fail(string.format("%s: dim 0 is invalid: dims are 1-based (Torch7 convention); use 1 for the first dim or -1 for the last", op))
  end
  local nn = n > 0 and n or 1
  if d < 0 then d = nn + d + 1 end
  if d < 1 or d > nn then
    fail(string.format("%s: dim %d out of range for a %d-d tensor (dims are 1-based; valid: 1..%d or -%d..-1)",
      op, d <= 0 and d - nn - 1 or d, ndim, nn, nn))
  end
  return d - 1
end

-- Shape from varargs or a table: shape(2, 3) / shape({2, 3}).
-- Returns n, int64_t[8].
function M.shape_arg(op, a, ...)
  local t = a
  if type(a) ~= "table" then t = { a, ... } end
  if type(a) == "table" and getmetatable(a) == M.Tensor then
    fail(op .. ": expected a shape (numbers or a table of numbers), got a tensor")
  end
  local n = #t
  if n > 8 then fail(string.format("%s: %d dims given; at most 8 are supported", op, n)) end
  local arr = ffi.new("int64_t[8]")
  for i = 1, n do arr[i - 1] = M.int64(t[i], op, "size " .. i .. " of the shape") end
  return n, arr
end

-- Array of eng_tensor* from a Lua list of Tensors.
function M.tensor_array(list, op)
  if type(list) ~= "table" then fail(op .. ": expected a list of tensors") end
  local n = #list
  local arr = ffi.new("eng_tensor*[?]", n > 0 and n or 1)
  for i = 1, n do arr[i - 1] = M.ct(list[i], op, i, 5) end
  return n, arr
end

return M
