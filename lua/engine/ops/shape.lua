-- engine.ops.shape: views and shape ops (view, reshape, transpose, permute,
-- narrow, select, expand, squeeze, unsqueeze, flatten, cat, stack, split,
-- chunk, index_select).  Dims, start positions and select indices are
-- 1-based (Torch7); index_select's index values are 0-based data (token ids).
local core = require("engine.core")
local Tensor = require("engine.tensor")
local ffi, C = core.ffi, core.C
local wrap, ct, check = core.wrap, core.ct, core.check
local methods = Tensor.methods

local M = {}

-- C dim of Lua dim d for a tensor of ndim dims (errors point at the user's call).
-- (Calls that may raise are never tail calls here: a tail call drops the
-- method's frame and the error level would miss the user's line.)
local function cdim(d, ndim, op, extra)
  local r = core.dim(d, ndim, op, extra, 4)
  return r
end

local function isint(v) return type(v) == "number" and v % 1 == 0 end

-- Global geometry (ndim, shape array) of a tensor: a DTensor's own shape is its
-- local shard; its spec holds the global shape that :shape() reports.
local function gdims(c)
  if c.dist ~= nil then return c.dist.ndim, c.dist.shape end
  return c.ndim, c.shape
end

-- Shape from varargs or one table: f(2, 3) / f({2, 3}).
local shape_buf = ffi.new("int64_t[8]")
local function shape_of(op, ...)
  local a = ...
  local t = a
  if type(a) == "table" then
    if core.is_tensor(a) then error(op .. ": expected sizes (numbers or a table of numbers), got a tensor", 3) end
    if select("#", ...) > 1 then error(op .. ": give the sizes either as numbers or as one table, not both", 3) end
  else
    t = { ... }
  end
  local n = #t
  if n > 8 then error(string.format("%s: %d sizes given; at most 8 dims are supported", op, n), 3) end
  for i = 1, n do shape_buf[i - 1] = core.int64(t[i], op, "size " .. i) end
  return n, shape_buf
end

-- ---------------------------------------------------------------- views
function methods.view(t, ...)
  local n, arr = shape_of("view", ...)
  local r = wrap(C.eng_view(ct(t, "view"), n, arr))
  return r
end

function methods.view_as(t, o)
  local ond, osh = gdims(ct(o, "view_as", 2))
  local r = wrap(C.eng_view(ct(t, "view_as"), ond, osh))
  return r
end

function methods.reshape(t, ...)
  local n, arr = shape_of("reshape", ...)
  local r = wrap(C.eng_reshape(ct(t, "reshape"), n, arr))
  return r
end

function methods.reshape_as(t, o)
  local ond, osh = gdims(ct(o, "reshape_as", 2))
  local r = wrap(C.eng_reshape(ct(t, "reshape_as"), ond, osh))
  return r
end

function methods.transpose(t, d1, d2)
  local c = ct(t, "transpose")
  local r = wrap(C.eng_transpose(c, cdim(d1, c.ndim, "transpose"), cdim(d2, c.ndim, "transpose")))
  return r
end

-- t(): transpose of a 2-D tensor (0-d and 1-d tensors come back as views).
function methods.t(t)
  local c = ct(t, "t")
  if c.ndim > 2 then
    error(string.format("t: expects a tensor with at most 2 dims, got %d dims (use transpose(d1, d2))", c.ndim), 2)
  end
  if c.ndim < 2 then local r = wrap(C.eng_transpose(c, 0, 0)); return r end
  local r = wrap(C.eng_transpose(c, 0, 1))
  return r
end

local perm_buf = ffi.new("int[8]")
function methods.permute(t, ...)
  local c = ct(t, "permute")
  local dims = ...
  if type(dims) ~= "table" then dims = { ... } end
  local n = #dims
  if n ~= c.ndim then
    error(string.format("permute: %d dims given for a %d-d tensor", n, c.ndim), 2)
  end
  for i = 1, n do perm_buf[i - 1] = cdim(dims[i], n, "permute") end
  local r = wrap(C.eng_permute(c, n, perm_buf))
  return r
end

-- narrow(dim, start, length): start is 1-based (negative counts from the end).
function methods.narrow(t, d, start, length)
  local c = ct(t, "narrow")
  local cd = cdim(d, c.ndim, "narrow")
  core.int64(start, "narrow", "start")
  core.int64(length, "narrow", "length")
  if start == 0 then error("narrow: start 0 is invalid: positions are 1-based (use 1 for the first element)", 2) end
  local s = start > 0 and start - 1 or start
  local r = wrap(C.eng_narrow(c, cd, s, length))
  return r
end

-- select(dim, i): i is 1-based (negative counts from the end); removes dim.
function methods.select(t, d, i)
  local c = ct(t, "select")
  local cd = cdim(d, c.ndim, "select")
  core.int64(i, "select", "index")
  if i == 0 then error("select: index 0 is invalid: indices are 1-based (use 1 for the first element)", 2) end
  local r = wrap(C.eng_select(c, cd, i > 0 and i - 1 or i))
  return r
end

function methods.expand(t, ...)
  local n, arr = shape_of("expand", ...)
  local r = wrap(C.eng_expand(ct(t, "expand"), n, arr))
  return r
end

function methods.expand_as(t, o)
  local ond, osh = gdims(ct(o, "expand_as", 2))
  local r = wrap(C.eng_expand(ct(t, "expand_as"), ond, osh))
  return r
end

function methods.squeeze(t, d)
  local c = ct(t, "squeeze")
  if d == nil then local r = wrap(C.eng_squeeze_all(c)); return r end
  local r = wrap(C.eng_squeeze(c, cdim(d, c.ndim, "squeeze")))
  return r
end

-- unsqueeze(dim): dim may be ndim + 1 (append a trailing dim); -1 is that too.
function methods.unsqueeze(t, d)
  local c = ct(t, "unsqueeze")
  local r = wrap(C.eng_unsqueeze(c, cdim(d, c.ndim, "unsqueeze", 1)))
  return r
end

function methods.flatten(t, s, e)
  local c = ct(t, "flatten")
  local cs = cdim(s == nil and 1 or s, c.ndim, "flatten")
  local ce = cdim(e == nil and -1 or e, c.ndim, "flatten")
  local r = wrap(C.eng_flatten(c, cs, ce))
  return r
end

-- ---------------------------------------------------------------- join
local function tensor_list(list, op)
  if core.is_tensor(list) or type(list) ~= "table" then
    error(op .. ": expected a list (table) of tensors, got " .. (core.is_tensor(list) and "a tensor" or type(list)), 3)
  end
  local n = #list
  if n == 0 then error(op .. ": expected a non-empty list of tensors", 3) end
  local arr = ffi.new("eng_tensor*[?]", n)
  for i = 1, n do arr[i - 1] = ct(list[i], op, i, 4) end
  return n, arr
end

-- cat(list, dim = 1).  1-d empty tensors are skipped in the shape checks.
function M.cat(list, d)
  local n, arr = tensor_list(list, "cat")
  local nd = 1
  for i = 0, n - 1 do
    local cnd, csh = gdims(arr[i])
    if not (cnd == 1 and csh[0] == 0) then nd = cnd; break end
  end
  local r = wrap(C.eng_cat(n, arr, cdim(d == nil and 1 or d, nd, "cat")))
  return r
end
M.concat = M.cat

-- cat_adjacent(list, dim = 1): cat of tensors that already lie side by side along dim in one storage (the views
-- of one fused parameter): a view of it, no copy, with cat's gradient; other lists are copied as by cat.
-- tensors_adjacent(list, dim = 1) says whether they lie so.
function M.cat_adjacent(list, d)
  local n, arr = tensor_list(list, "cat_adjacent")
  return wrap(C.eng_cat_adjacent(n, arr, cdim(d == nil and 1 or d, arr[0].ndim, "cat_adjacent")))
end
function M.tensors_adjacent(list, d)
  local n, arr = tensor_list(list, "tensors_adjacent")
  return C.eng_tensors_adjacent(n, arr, cdim(d == nil and 1 or d, arr[0].ndim, "tensors_adjacent")) == 1
end

-- stack(list, dim = 1): dim may be ndim + 1.
function M.stack(list, d)
  local n, arr = tensor_list(list, "stack")
  local r = wrap(C.eng_stack(n, arr, cdim(d == nil and 1 or d, arr[0].ndim, "stack", 1)))
  return r
end

local function piece_list(out, n)
  local res = {}
  for i = 1, n do res[i] = setmetatable({ _c = ffi.gc(out[i - 1], C.eng_tensor_release) }, Tensor) end
  return res
end

-- split(size, dim = 1) -> list of pieces of `size` (the last may be smaller);
-- split({s1, s2, ...}, dim) -> pieces of those sizes.
function methods.split(t, size, d)
  local c = ct(t, "split")
  local cd = cdim(d == nil and 1 or d, c.ndim, "split")
  if type(size) == "table" then
    local n = #size
    local sizes = ffi.new("int64_t[?]", n > 0 and n or 1)
    for i = 1, n do
      sizes[i - 1] = core.int64(size[i], "split", "size " .. i)
    end
    local out = ffi.new("eng_tensor*[?]", n > 0 and n or 1)
    local k = C.eng_split_sizes(c, n, sizes, cd, out)
    if k < 0 then core.raise() end
    return piece_list(out, k)
  end
  if not isint(size) then error("split: split size must be an integer or a table of sizes, got " .. tostring(size), 2) end
  core.int64(size, "split", "split size")
  local gnd, gsh = gdims(c)
  local dsz = gnd > 0 and tonumber(gsh[cd]) or 0
  local cnt = size > 0 and math.max(math.ceil(dsz / size), 1) or 1
  local out = ffi.new("eng_tensor*[?]", cnt)
  local k = C.eng_split(c, size, cd, cnt, out)
  if k < 0 then core.raise() end
  return piece_list(out, k)
end

-- chunk(n, dim = 1) -> list (torch.chunk: pieces of ceil(size / n), maybe fewer than n).
function methods.chunk(t, chunks, d)
  local c = ct(t, "chunk")
  local cd = cdim(d == nil and 1 or d, c.ndim, "chunk")
  if not isint(chunks) then error("chunk: number of chunks must be an integer, got " .. tostring(chunks), 2) end
  if chunks > 2147483647 then error("chunk: number of chunks " .. tostring(chunks) .. " is too large", 2) end
  local gnd, gsh = gdims(c)
  local dsz = gnd > 0 and tonumber(gsh[cd]) or 0
  local room = chunks < 1 and 1 or (dsz > 0 and math.min(chunks, dsz) or chunks)
  local out = ffi.new("eng_tensor*[?]", room)
  local k = C.eng_chunk(c, chunks, cd, room, out)
  if k < 0 then core.raise() end
  return piece_list(out, k)
end

-- index_select(dim, index): index is a 1-D i32/i64 tensor of 0-based indices.
function methods.index_select(t, d, index)
  local c = ct(t, "index_select")
  local ic = ct(index, "index_select", 2)
  local r = wrap(C.eng_index_select(c, cdim(d, c.ndim, "index_select"), ic))
  return r
end

-- Function forms: engine.reshape(t, ...), engine.transpose(t, 1, 2), ...
for _, name in ipairs({ "view", "view_as", "reshape", "reshape_as", "transpose", "t", "permute", "narrow",
  "select", "expand", "expand_as", "squeeze", "unsqueeze", "flatten", "split", "chunk", "index_select" }) do
  M[name] = methods[name]
end

return M
