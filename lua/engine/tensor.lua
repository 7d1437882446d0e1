-- engine.tensor: the Tensor type (a Lua table holding an eng_tensor* in _c),
-- creation functions, core methods, arithmetic operators and autograd.
-- Op families add their methods from engine/ops/*.lua through Tensor.methods.
local core = require("engine.core")
local ffi, C = core.ffi, core.C
local wrap, ct, check, dim = core.wrap, core.ct, core.check, core.dim

local Tensor = {}
local methods = {}
local props = {}
Tensor.methods = methods
Tensor.props = props
Tensor.__name = "Tensor"
core.Tensor = Tensor

-- t[i] / t[i] = v (Torch7 indexing, 1-based, negative from the end): engine.ops.index installs
-- Tensor.index_number / Tensor.newindex_number (a number key never names a field).
Tensor.__index = function(t, k)
  local m = methods[k]
  if m ~= nil then return m end
  if type(k) == "number" then return Tensor.index_number(t, k) end
  local p = props[k]
  if p ~= nil then return p(t) end
  return nil
end

Tensor.__newindex = function(t, k, v)
  if type(k) == "number" then
    Tensor.newindex_number(t, k, v)
  elseif k == "grad" then
    check(C.eng_tensor_set_grad(t._c, v and ct(v, "grad", 1) or nil))
  elseif k == "requires_grad" then
    check(C.eng_tensor_set_requires_grad(t._c, v and 1 or 0))
  elseif props[k] then
    core.fail("tensor: property '" .. k .. "' is read-only")
  else
    rawset(t, k, v)
  end
end

local M = {}  -- functions exported as engine.*
Tensor.functions = M

-- ---------------------------------------------------------------- creation
local function opts_dtype(opts, default, op)
  if type(opts) == "string" or type(opts) == "number" then return core.dtype(opts, op, 4) end
  if type(opts) == "table" and opts.dtype ~= nil then return core.dtype(opts.dtype, op, 4) end
  return default
end

-- ---------------------------------------------------------------- devices
-- "cpu" -> 0, "cuda" / "cuda:N" -> 1, "meta" -> 2; nil for anything else.
-- A meta tensor has a shape, dtype and strides but no data (PyTorch's meta
-- device): build a large model or its parallel layout first, then
-- materialise with module:to_empty{device = "cpu"} and initialise.
local function device_code(dev)
  if dev == "cpu" then return 0 end
  if dev == "cuda" or (type(dev) == "string" and dev:match("^cuda:%d+$")) then return 1 end
  if dev == "meta" then return 2 end
  return nil
end
Tensor.device_code = device_code
local DEVICE_NAMES = { [0] = "cpu", "cuda", "meta" }
Tensor.device_names = DEVICE_NAMES
local BAD_DEVICE = "' (expected \"cpu\", \"cuda\" or \"meta\")"
Tensor.bad_device = BAD_DEVICE

-- The device of factories called without one (PyTorch's
-- torch.set_default_device); engine.with_device(dev, fn) scopes it.
local default_device = 0
function M.set_default_device(dev)
  local code = device_code(dev)
  if not code then core.fail("set_default_device: unknown device '" .. tostring(dev) .. BAD_DEVICE) end
  Tensor.require_device(code, "set_default_device", 3)
  default_device = code
end
function M.get_default_device() return DEVICE_NAMES[default_device] end
-- Runs fn(...) with dev as the default device (restored afterwards, also on
-- error); returns fn's results.  with_device("meta", function() return nn.Linear(4096, 4096) end)
function M.with_device(dev, fn, ...)
  if type(fn) ~= "function" then core.fail("with_device: expected a function as the second argument, got " .. type(fn)) end
  local prev = default_device
  M.set_default_device(dev)
  local function finish(ok, ...)
    default_device = prev
    if not ok then error((...), 0) end
    return ...
  end
  return finish(pcall(fn, ...))
end

-- Fails with "<op>: CUDA is not available: <reason>" when CUDA is asked for
-- and there is none (nothing is allocated or changed).
local function require_device(code, op, level)
  if code == 1 and C.eng_cuda_is_available() == 0 then
    core.fail(op .. ": " .. ffi.string(C.eng_cuda_unavailable_reason()), level)
  end
end
Tensor.require_device = require_device

local function opts_device(opts, op)
  if type(opts) ~= "table" or opts.device == nil then return default_device end
  local code = device_code(opts.device)
  if not code then core.fail(op .. ": unknown device '" .. tostring(opts.device) .. BAD_DEVICE, 4) end
  require_device(code, op, 5)
  return code
end

-- t moved to the device of opts (creation functions that build on the host).
local function placed(t, opts, op)
  local code = opts_device(opts, op)
  if code ~= 0 then return wrap(C.eng_tensor_to_device(t._c, code)) end
  return t
end

local function requires(t, opts)
  if type(opts) == "table" and opts.requires_grad then check(C.eng_tensor_set_requires_grad(t._c, 1), 4) end
  return t
end

-- The options of the factories (zeros, ones, full, empty, arange, tensor, rand, randn and the *_like forms):
-- any other key is an error naming these.
local FACTORY_OPTS = { "dtype", "device", "requires_grad" }
local RANDOM_OPTS = { "dtype", "device", "requires_grad", "generator" }
Tensor.factory_opts = FACTORY_OPTS
local function check_opts(opts, op, known)
  if type(opts) == "table" and getmetatable(opts) == nil then core.check_opts(opts, known or FACTORY_OPTS, op) end
  return opts
end

-- Splits trailing options table from shape varargs: f(2, 3, {dtype="f64"}).  A nil among the sizes
-- (zeros(2, nil, 3)) is an error, not a shorter shape; trailing nils (f(2, 3, opts) with opts nil) are
-- dropped.
local function shape_and_opts(op, ...)
  local n = select("#", ...)
  local args = { ... }
  while n > 0 and args[n] == nil do n = n - 1 end
  local last = args[n]
  local opts
  if n >= 1 and (type(last) == "table" and getmetatable(last) == nil and last[1] == nil) then
    args[n] = nil
    n, opts = n - 1, last
  end
  if n == 1 and type(args[1]) == "table" then return args[1], opts end
  for i = 1, n do
    if args[i] == nil then
      core.fail(string.format("%s: size %d of the shape is nil (sizes must be integers; options go last, in a table)", op, i))
    end
  end
  return args, opts
end

function M.empty(...)
  local shape, opts = shape_and_opts("empty", ...)
  check_opts(opts, "empty")
  local n, arr = core.shape_arg("empty", shape)
  return requires(wrap(C.eng_tensor_empty(n, arr, opts_dtype(opts, 0, "empty"), opts_device(opts, "empty"))), opts)
end

function M.zeros(...)
  local shape, opts = shape_and_opts("zeros", ...)
  check_opts(opts, "zeros")
  local n, arr = core.shape_arg("zeros", shape)
  return requires(wrap(C.eng_tensor_zeros(n, arr, opts_dtype(opts, 0, "zeros"), opts_device(opts, "zeros"))), opts)
end

function M.ones(...)
  local shape, opts = shape_and_opts("ones", ...)
  check_opts(opts, "ones")
  local n, arr = core.shape_arg("ones", shape)
  return requires(wrap(C.eng_tensor_full(n, arr, 1, opts_dtype(opts, 0, "ones"), opts_device(opts, "ones"))), opts)
end

-- full(shape_table, value, opts)
function M.full(shape, value, opts)
  check_opts(opts, "full")
  local n, arr = core.shape_arg("full", shape)
  if type(value) ~= "number" and type(value) ~= "boolean" then
    core.fail("full: fill value must be a number, got " .. type(value))
  end
  if type(value) == "boolean" then value = value and 1 or 0 end
  return requires(wrap(C.eng_tensor_full(n, arr, value, opts_dtype(opts, 0, "full"), opts_device(opts, "full"))), opts)
end

local function all_int(...)
  for i = 1, select("#", ...) do
    local v = select(i, ...)
    if type(v) == "number" and v % 1 ~= 0 then return false end
  end
  return true
end

-- arange(end) / arange(start, end[, step]) [, opts]; integer args give i64.
function M.arange(a, b, c, d)
  local opts
  if type(b) == "table" then opts, b = b, nil elseif type(c) == "table" then opts, c = c, nil
  elseif type(d) == "table" then opts = d end
  check_opts(opts, "arange")
  local start, stop, step
  if b == nil then start, stop, step = 0, a, 1 else start, stop, step = a, b, c or 1 end
  if type(start) ~= "number" or type(stop) ~= "number" or type(step) ~= "number" then
    core.fail("arange: start, end and step must be numbers")
  end
  local dt = opts_dtype(opts, all_int(start, stop, step) and 5 or 0, "arange")
  return requires(wrap(C.eng_tensor_arange(start, stop, step, dt, opts_device(opts, "arange"))), opts)
end

-- tensor(nested_table [, dtype or opts]): integers -> i64, booleans -> bool, else f32.
function M.tensor(data, opts)
  check_opts(opts, "tensor")
  if core.is_tensor(data) then return data:clone() end
  local shape, flat = {}, {}
  local kind = "int"
  if type(data) == "number" or type(data) == "boolean" then
    flat[1] = data
  elseif type(data) == "table" then
    local t = data
    while type(t) == "table" do
      shape[#shape + 1] = #t
      t = t[1]
    end
    local function walk(x, d)
      if d > #shape then
        if type(x) == "boolean" then kind = (kind == "int" and #flat == 0) and "bool" or kind; flat[#flat + 1] = x and 1 or 0; return end
        if type(x) ~= "number" then core.fail("tensor: elements must be numbers or booleans, got " .. type(x)) end
        if kind == "bool" then kind = "int" end
        if x % 1 ~= 0 then kind = "float" end
        flat[#flat + 1] = x
        return
      end
      if type(x) ~= "table" or #x ~= shape[d] then
        core.fail(string.format("tensor: ragged nested table: expected %d elements at depth %d", shape[d], d))
      end
      for i = 1, #x do walk(x[i], d + 1) end
    end
    walk(data, 1)
  else
    core.fail("tensor: expected a number or a nested table of numbers, got " .. type(data))
  end
  if type(data) == "number" and data % 1 ~= 0 then kind = "float" end
  if type(data) == "boolean" then kind = "bool"; flat[1] = data and 1 or 0 end
  local default = kind == "float" and 0 or (kind == "bool" and 7 or 5)
  local dt = opts_dtype(opts, default, "tensor")
  local n = #flat
  local buf = ffi.new("double[?]", n > 0 and n or 1)
  for i = 1, n do buf[i - 1] = flat[i] end
  local nd, arr = core.shape_arg("tensor", shape)
  local p = C.eng_tensor_from_data(nd, arr, dt, buf, 1, n)
  if p == nil then core.fail(core.prefixed("tensor", core.last_error(), "from_data")) end
  return requires(placed(wrap(p), opts, "tensor"), opts)
end

-- On the meta device nothing is drawn and the generator does not advance.
local function random_factory(name, cfun)
  return function(...)
    local shape, opts = shape_and_opts(name, ...)
    check_opts(opts, name, RANDOM_OPTS)
    local n, arr = core.shape_arg(name, shape)
    local dt = opts_dtype(opts, 0, name)
    if opts_device(opts, name) == 2 then
      if C.eng_dtype_is_floating(dt) == 0 then core.fail(name .. ": random numbers need a floating point dtype, got " .. core.dtype_names[dt]) end
      return requires(wrap(C.eng_tensor_empty(n, arr, dt, 2)), opts)
    end
    return requires(placed(wrap(cfun(n, arr, dt)), opts, name), opts)
  end
end
M.rand = random_factory("rand", C.eng_rand)
M.randn = random_factory("randn", C.eng_randn)

-- *_like keep t's device (and dtype unless given).
local function like_opts(t, opts, op)
  check_opts(opts, op, (op == "rand_like" or op == "randn_like") and RANDOM_OPTS or FACTORY_OPTS)
  local dev = type(opts) == "table" and opts.device or DEVICE_NAMES[t._c.device]
  return { dtype = opts_dtype(opts, t._c.dtype, op), device = dev,
    requires_grad = type(opts) == "table" and opts.requires_grad or nil }
end
-- For a DTensor t they give a DTensor with t's layout (engine.distributed
-- installs Tensor.dtensor_like): e.g. empty_like(meta_dtensor, {device = "cpu"})
-- materialises its local shard.
local function like(name, make)
  return function(t, a, b)
    core.ct(t, name, 1)
    if t._c.dist ~= nil and Tensor.dtensor_like then return Tensor.dtensor_like(name, t, a, b) end
    return make(t, a, b)
  end
end
M.zeros_like = like("zeros_like", function(t, opts) return M.zeros(t:shape(), like_opts(t, opts, "zeros_like")) end)
M.ones_like = like("ones_like", function(t, opts) return M.ones(t:shape(), like_opts(t, opts, "ones_like")) end)
M.full_like = like("full_like", function(t, v, opts) return M.full(t:shape(), v, like_opts(t, opts, "full_like")) end)
M.empty_like = like("empty_like", function(t, opts) return M.empty(t:shape(), like_opts(t, opts, "empty_like")) end)
M.rand_like = like("rand_like", function(t, opts) return M.rand(t:shape(), like_opts(t, opts, "rand_like")) end)
M.randn_like = like("randn_like", function(t, opts) return M.randn(t:shape(), like_opts(t, opts, "randn_like")) end)
Tensor.like_opts = like_opts

function M.manual_seed(seed)
  if type(seed) ~= "number" or not (seed >= 0 and seed < 2 ^ 64) or seed % 1 ~= 0 then
    core.fail("manual_seed: seed must be an integer in [0, 2^64), got " .. tostring(seed))
  end
  C.eng_manual_seed(seed)
end

M.is_tensor = core.is_tensor

-- ---------------------------------------------------------------- properties
props.dtype = function(t) return core.dtype_names[t._c.dtype] end
props.device = function(t) return DEVICE_NAMES[t._c.device] end
props.is_meta = function(t) return t._c.device == 2 end
props.ndim = function(t) return t._c.ndim end
props.requires_grad = function(t) return t._c.requires_grad ~= 0 end
props.is_leaf = function(t) return t._c.grad_fn == nil end
props.grad = function(t) return core.wrap_borrowed(t._c.grad) end
props.grad_fn = function(t)
  if t._c.grad_fn == nil then return nil end
  return ffi.string(t._c.grad_fn.name)
end

-- ---------------------------------------------------------------- core methods
function methods.dim(t) return t._c.ndim end
methods.nDimension = methods.dim
-- DTensors (t._c.dist ~= nil) report GLOBAL numel, size, shape and stride.
function methods.numel(t) local c = t._c; if c.dist ~= nil then c = c.dist end return tonumber(c.numel) end
methods.nElement = methods.numel

-- size() -> table; size(d) -> number (d 1-based, negative from the end)
function methods.size(t, d)
  local c = t._c
  if c.dist ~= nil then c = c.dist end
  if d == nil then
    local s = {}
    for i = 0, c.ndim - 1 do s[i + 1] = tonumber(c.shape[i]) end
    return s
  end
  return tonumber(c.shape[dim(d, c.ndim, "size", 0, 3)])
end

function methods.shape(t)
  local c, s = t._c, {}
  if c.dist ~= nil then c = c.dist end
  for i = 0, c.ndim - 1 do s[i + 1] = tonumber(c.shape[i]) end
  return s
end

function methods.stride(t, d)
  local c = t._c
  if c.dist ~= nil then c = c.dist end
  if d == nil then
    local s = {}
    for i = 0, c.ndim - 1 do s[i + 1] = tonumber(c.stride[i]) end
    return s
  end
  return tonumber(c.stride[dim(d, c.ndim, "stride", 0, 3)])
end

function methods.is_contiguous(t) return C.eng_tensor_is_contiguous(t._c) ~= 0 end
function methods.element_size(t) return C.eng_dtype_size(t._c.dtype) end
function methods.is_floating_point(t) return C.eng_dtype_is_floating(t._c.dtype) ~= 0 end
function methods.data_ptr(t) return C.eng_tensor_data(t._c) end

-- Element reads and writes of a DTensor follow the global tensor: engine.distributed installs
-- Tensor.dtensor_values, an error unless the local tensor is the global one (all Replicate).
local function global_values(t, op) if t._c.dist ~= nil and Tensor.dtensor_values then Tensor.dtensor_values(t, op) end end

local item_buf = ffi.new("double[1]")
function methods.item(t)
  global_values(t, "item")
  check(C.eng_tensor_item(t._c, item_buf))
  local v = item_buf[0]
  if t._c.dtype == 7 then return v ~= 0 end
  return v
end

-- Values as a flat Lua array (row-major).
function methods.tolist_flat(t)
  global_values(t, "totable")
  local n = tonumber(t._c.numel)
  local buf = ffi.new("double[?]", n > 0 and n or 1)
  check(C.eng_tensor_read(t._c, buf, 1, n))
  local out = {}
  for i = 1, n do out[i] = buf[i - 1] end
  return out, buf
end

-- Nested Lua tables (a number for a 0-d tensor).
function methods.totable(t)
  global_values(t, "totable")
  local flat = t:tolist_flat()
  local shape = t:shape()
  local isbool = t._c.dtype == 7
  if #shape == 0 then
    if isbool then return flat[1] ~= 0 end
    return flat[1]
  end
  local pos = 0
  local function build(d)
    local r = {}
    for i = 1, shape[d] do
      if d == #shape then
        pos = pos + 1
        local v = flat[pos]
        if isbool then v = v ~= 0 end
        r[i] = v
      else
        r[i] = build(d + 1)
      end
    end
    return r
  end
  return build(1)
end
methods.tolist = methods.totable

function methods.clone(t) return wrap(C.eng_tensor_clone(ct(t, "clone"))) end
function methods.contiguous(t) return wrap(C.eng_tensor_contiguous(ct(t, "contiguous"))) end
function methods.detach(t) return wrap(C.eng_tensor_detach(ct(t, "detach"))) end

-- Moves t to a device ("cpu", "cuda", "cuda:0"); t itself when already there.
-- Differentiable (the gradient goes back to t's device).
function methods._to_device(t, dev, op)
  op = op or "to"
  local code = device_code(dev)
  if not code then core.fail(op .. ": unknown device '" .. tostring(dev) .. BAD_DEVICE, 3) end
  if t._c.device == code then return t end
  require_device(code, op, 4)
  return wrap(C.eng_tensor_to_device(t._c, code))
end
function methods.cuda(t) return methods._to_device(t, "cuda", "x:cuda()") end
function methods.cpu(t) return methods._to_device(t, "cpu", "x:cpu()") end
props.is_cuda = function(t) return t._c.device == 1 end
-- pin_memory(): a contiguous copy of a CPU tensor in pinned (page-locked) host memory, copied to and from the
-- GPU by DMA (t itself when already pinned and contiguous); needs a GPU.  is_pinned(): whether t's data is.
function methods.pin_memory(t) return wrap(C.eng_tensor_pin_memory(ct(t, "pin_memory"))) end
function methods.is_pinned(t) return C.eng_tensor_is_pinned(ct(t, "is_pinned")) == 1 end

-- to(dtype) / to("cpu") / to("cuda") / to{dtype=..., device=...}
function methods.to(t, what)
  local dt, dev
  if type(what) == "table" then dt, dev = what.dtype, what.device
  elseif device_code(what) then dev = what
  elseif type(what) == "string" and C.eng_dtype_from_name(what) < 0 then
    core.fail("to: unknown device or dtype '" .. what .. "' (devices: \"cpu\", \"cuda\", \"meta\"; dtypes: f32, f64, "
      .. "bf16, f16, i32, i64, u8, bool)")
  else dt = what end
  local r = t
  if dev ~= nil then r = methods._to_device(r, dev, "x:to(\"" .. tostring(dev) .. "\")") end
  if dt ~= nil then r = wrap(C.eng_tensor_to_dtype(r._c, core.dtype(dt, "to", 3))) end
  return r
end
function methods.float(t) return wrap(C.eng_tensor_to_dtype(t._c, 0)) end
function methods.double(t) return wrap(C.eng_tensor_to_dtype(t._c, 1)) end
function methods.bfloat16(t) return wrap(C.eng_tensor_to_dtype(t._c, 2)) end
function methods.half(t) return wrap(C.eng_tensor_to_dtype(t._c, 3)) end
function methods.int(t) return wrap(C.eng_tensor_to_dtype(t._c, 4)) end
function methods.long(t) return wrap(C.eng_tensor_to_dtype(t._c, 5)) end
function methods.byte(t) return wrap(C.eng_tensor_to_dtype(t._c, 6)) end
function methods.bool(t) return wrap(C.eng_tensor_to_dtype(t._c, 7)) end

function methods.zero_(t) check(C.eng_tensor_zero_(t._c)); return t end
function methods.fill_(t, v)
  if type(v) == "boolean" then v = v and 1 or 0 end
  if type(v) ~= "number" then core.fail("fill_: value must be a number") end
  check(C.eng_tensor_fill_(t._c, v)); return t
end
function methods.copy_(t, src)
  if (t._c.dist ~= nil or (core.is_tensor(src) and src._c.dist ~= nil)) and Tensor.dtensor_copy_check then
    Tensor.dtensor_copy_check(t, src)
  end
  check(C.eng_tensor_copy_(t._c, ct(src, "copy_", 1)))
  return t
end

-- Element access with 1-based indices (Torch7 style): t:get(i, j), t:set(v, i, j).
local idx_buf = ffi.new("int64_t[8]")
local function fill_index(t, op, ...)
  local c = t._c
  local n = select("#", ...)
  if n ~= c.ndim then core.fail(string.format("%s: %d indices for a %d-d tensor", op, n, c.ndim)) end
  for i = 1, n do
    local v = select(i, ...)
    if type(v) ~= "number" or v % 1 ~= 0 then core.fail(op .. ": indices must be integers") end
    if v < 0 then v = tonumber(c.shape[i - 1]) + v + 1 end
    if v < 1 or v > c.shape[i - 1] then
      core.fail(string.format("%s: index %d out of range for dim %d of size %d (indices are 1-based)", op,
        select(i, ...), i, tonumber(c.shape[i - 1])))
    end
    idx_buf[i - 1] = v - 1
  end
end
function methods.get(t, ...)
  global_values(t, "get")
  fill_index(t, "get", ...)
  check(C.eng_tensor_get(t._c, idx_buf, item_buf))
  return item_buf[0]
end
function methods.set(t, v, ...)
  if type(v) == "boolean" then v = v and 1 or 0 end
  if type(v) ~= "number" then core.fail(string.format("set: the value must be a number or boolean, got %s", type(v))) end
  global_values(t, "set")
  fill_index(t, "set", ...)
  check(C.eng_tensor_set(t._c, idx_buf, v))
  return t
end

-- ---------------------------------------------------------------- printing
local function fmt_num(v, isfloat)
  if not isfloat then return string.format("%d", v) end
  if v ~= v then return "nan" end
  if v == math.huge then return "inf" elseif v == -math.huge then return "-inf" end
  return string.format("%.4f", v)
end

local function shape_str(shape)
  local p = {}
  for i, n in ipairs(shape) do p[i] = string.format("%d", n) end
  return table.concat(p, ",")
end

function Tensor.__tostring(t)
  local c = t._c
  if c.dist ~= nil and Tensor.dtensor_tostring then return Tensor.dtensor_tostring(t) end
  local shape = t:shape()
  if c.device == 2 then -- no data to print (PyTorch: tensor(..., device='meta', size=(2, 3)))
    local extra = c.requires_grad ~= 0 and ", requires_grad=true" or ""
    return string.format("tensor(..., %s[%s], device=meta%s)", core.dtype_names[c.dtype], shape_str(shape), extra)
  end
  local isfloat = C.eng_dtype_is_floating(c.dtype) ~= 0
  local isbool = c.dtype == 7
  local flat = t:tolist_flat()
  local strides = {}
  local s = 1
  for d = #shape, 1, -1 do strides[d] = s; s = s * shape[d] end
  local function fmt(v) if isbool then return v ~= 0 and "true" or "false" end return fmt_num(v, isfloat) end
  local function rec(d, base, indent)
    if d > #shape then return fmt(flat[base + 1]) end
    local n, parts = shape[d], {}
    local edge = 3
    local sep = d == #shape and ", " or (",\n" .. indent .. " ")
    -- only the elements shown are visited (a dim of 2^62 in an empty tensor is not walked)
    local long = n > 2 * edge + 1
    for i = 1, long and 2 * edge or n do
      local j = (long and i > edge) and n - 2 * edge + i or i
      if long and i == edge + 1 then parts[#parts + 1] = "..." end
      parts[#parts + 1] = rec(d + 1, base + (j - 1) * strides[d], indent .. " ")
    end
    return "[" .. table.concat(parts, sep) .. "]"
  end
  local body = #shape == 0 and fmt(flat[1]) or rec(1, 0, "       ")
  local extra = ""
  if c.grad_fn ~= nil then extra = ", grad_fn=" .. ffi.string(c.grad_fn.name)
  elseif c.requires_grad ~= 0 then extra = ", requires_grad=true" end
  local dev = c.device == 0 and "" or (", device=" .. DEVICE_NAMES[c.device])
  return string.format("tensor(%s, %s%s%s%s)", body, core.dtype_names[c.dtype],
    "[" .. shape_str(shape) .. "]", dev, extra)
end

-- ---------------------------------------------------------------- arithmetic operators
local function binop(name, cfun, cscalar, crscalar)
  return function(a, b)
    local ta, tb = type(a), type(b)
    if ta == "table" and tb == "table" then
      return wrap(cfun(ct(a, name, 1), ct(b, name, 2)))
    elseif ta == "table" and tb == "number" then
      return wrap(cscalar(ct(a, name, 1), b))
    elseif ta == "number" and tb == "table" then
      return wrap(crscalar(a, ct(b, name, 2)))
    end
    core.fail(string.format("%s: unsupported operand types %s and %s", name, ta, tb))
  end
end

local add = binop("add", C.eng_add, C.eng_add_scalar, function(s, t) return C.eng_add_scalar(t, s) end)
local sub = binop("sub", C.eng_sub, C.eng_sub_scalar, C.eng_rsub_scalar)
local mul = binop("mul", C.eng_mul, C.eng_mul_scalar, function(s, t) return C.eng_mul_scalar(t, s) end)
local div = binop("div", C.eng_div, C.eng_div_scalar, C.eng_rdiv_scalar)
local pow = binop("pow", C.eng_pow, C.eng_pow_scalar, C.eng_rpow_scalar)
Tensor.__add, Tensor.__sub, Tensor.__mul, Tensor.__div, Tensor.__pow = add, sub, mul, div, pow

-- add(a, b [, alpha]) / sub(a, b [, alpha]): a + alpha b / a - alpha b (PyTorch's alpha), alpha a number
-- or {alpha = n}.  With integer operands alpha must be integral (PyTorch's check).
local function alpha_arg(alpha, op, a, b)
  if type(alpha) == "table" and getmetatable(alpha) == nil then
    core.check_opts(alpha, { "alpha" }, op)
    alpha = alpha.alpha
  end
  if alpha == nil then return 1 end
  if type(alpha) ~= "number" then core.fail(string.format("%s: alpha must be a number, got %s", op, type(alpha))) end
  if alpha % 1 ~= 0 or alpha ~= alpha then
    local function integral(x)
      if core.is_tensor(x) then return C.eng_dtype_is_floating(x._c.dtype) == 0 end
      return type(x) == "number" and x % 1 == 0
    end
    if integral(a) and integral(b) then
      core.fail(string.format("%s: For integral input tensors, argument alpha must not be a floating point number (alpha %s)",
        op, tostring(alpha)))
    end
  end
  return alpha
end
local function scaled(b, alpha) -- alpha * b for a tensor or a number b
  if type(b) == "number" then return b * alpha end
  return wrap(C.eng_mul_scalar(ct(b, "mul", 2), alpha))
end
function methods.add(a, b, alpha)
  alpha = alpha_arg(alpha, "add", a, b)
  if alpha ~= 1 then b = scaled(b, alpha) end
  return add(a, b)
end
function methods.sub(a, b, alpha)
  alpha = alpha_arg(alpha, "sub", a, b)
  if alpha ~= 1 then b = scaled(b, alpha) end
  return sub(a, b)
end

-- div(a, b [, {rounding_mode = nil | "trunc" | "floor"}]): true division (integers give floats), or the
-- quotient rounded toward zero or down (integers stay integers), as torch.div.
local ROUNDING = { trunc = 1, floor = 2 }
local function rounding_arg(opts, op)
  if opts == nil then return 0 end
  core.check_opts(opts, { "rounding_mode" }, op)
  local m = opts.rounding_mode
  if m == nil then return 0 end
  local code = ROUNDING[m]
  if not code then
    core.fail(string.format("%s: rounding_mode must be nil, \"trunc\" or \"floor\", got %s", op, tostring(m)))
  end
  return code
end
function methods.div(a, b, opts)
  local mode = rounding_arg(opts, "div")
  if mode == 0 then return div(a, b) end
  if not core.is_tensor(a) and not core.is_tensor(b) then core.fail("div: at least one argument must be a tensor") end
  local scalar_tensor = require("engine.ops.math")._scalar_tensor  -- a number next to a tensor: PyTorch's promotion
  if not core.is_tensor(a) then a = scalar_tensor(a, b, "div") end
  if not core.is_tensor(b) then b = scalar_tensor(b, a, "div") end
  local p = C.eng_div_rounding(ct(a, "div", 1), ct(b, "div", 2), mode)
  if p == nil then core.fail(core.prefixed("div", core.last_error(), "floor_divide")) end
  return wrap(p)
end
methods.mul, methods.pow = mul, pow
M.add, M.sub, M.mul, M.div, M.pow = methods.add, methods.sub, mul, methods.div, pow
Tensor.__unm = function(a) return wrap(C.eng_neg(ct(a, "neg", 1))) end

function methods.maximum(a, b) return wrap(C.eng_maximum(ct(a, "maximum", 1), ct(b, "maximum", 2))) end
function methods.minimum(a, b) return wrap(C.eng_minimum(ct(a, "minimum", 1), ct(b, "minimum", 2))) end
M.maximum, M.minimum = methods.maximum, methods.minimum

-- In-place arithmetic (optimizers, init).  The result must keep a's dtype kind (PyTorch's casting rule):
-- an integer tensor refuses a floating operand, and true division (div_ without a rounding mode).
function methods.add_(a, b, alpha)
  alpha = alpha_arg(alpha, "add_", a, b)
  if type(b) == "number" then check(C.eng_add_scalar_(ct(a, "add_", "self"), b * alpha))
  else check(C.eng_add_(ct(a, "add_", "self"), ct(b, "add_", 1), alpha)) end
  return a
end
function methods.sub_(a, b, alpha)
  alpha = alpha_arg(alpha, "sub_", a, b)
  if type(b) == "number" then
    if a._c.dtype == 7 then -- bool: sub_ refuses it whatever the operand (a scalar 0-d tensor names the rule)
      check(C.eng_sub_(a._c, wrap(C.eng_tensor_full(0, nil, b, 5, a._c.device))._c))
    end
    check(C.eng_add_scalar_(ct(a, "sub_", "self"), -b * alpha))
  elseif alpha == 1 then check(C.eng_sub_(ct(a, "sub_", "self"), ct(b, "sub_", 1)))
  else
    if a._c.dtype == 7 then check(C.eng_sub_(a._c, ct(b, "sub_", 1))) end
    check(C.eng_add_(ct(a, "sub_", "self"), ct(b, "sub_", 1), -alpha))
  end
  return a
end
function methods.mul_(a, b)
  if type(b) == "number" then check(C.eng_mul_scalar_(a._c, b)) else check(C.eng_mul_(a._c, ct(b, "mul_", 1))) end
  return a
end
function methods.div_(a, b, opts)
  local mode = rounding_arg(opts, "div_")
  ct(a, "div_", "self")
  if mode ~= 0 then
    local r = methods.div(a, b, opts)
    if C.eng_dtype_is_floating(r._c.dtype) ~= 0 and C.eng_dtype_is_floating(a._c.dtype) == 0 then
      core.fail(string.format("div_: result type %s can't be cast to the desired output type %s", r.dtype, a.dtype))
    end
    return methods.copy_(a, r)
  end
  if type(b) == "number" then
    if C.eng_dtype_is_floating(a._c.dtype) ~= 0 then check(C.eng_mul_scalar_(a._c, 1 / b))
    else check(C.eng_div_(a._c, wrap(C.eng_tensor_full(0, nil, b, 0, a._c.device))._c)) end -- refused (integer target)
  else check(C.eng_div_(a._c, ct(b, "div_", 1))) end
  return a
end

return Tensor
