-- engine.ops.index: PyTorch's indexing and shape ops (gather, scatter, index_add, ...).  Dims are 1-based
-- (negative from the end); index VALUES are 0-based data (as index_select and
-- token ids; nonzero returns 0-based coordinates).
--
--   t:gather(dim, index)                      torch.gather (C: ops/index.c, rule sharding/index.c)
--   t:scatter(dim, index, src_or_number)      t:scatter_(...) in place
--   t:scatter_add(dim, index, src)            t:scatter_add_(...) in place
--   t:index_add(dim, index, src [, {alpha}])  t:index_add_(...) in place
--   t:index_copy(dim, index, src)             t:index_copy_(...) in place
--   t:masked_select(mask)  engine.nonzero(t [, {as_tuple = true}])
--   t:triu([k]) t:tril([k]) t["repeat"](...) (= t:repeat_tensor(...): `repeat` is a Lua keyword)
--   t:repeat_interleave(repeats [, dim]) t:roll(shifts [, dims]) t:flip(dims)
--   engine.one_hot(t [, num_classes]) t:unbind([dim]) t:movedim(src, dst) t:unflatten(dim, sizes)
--   t[i] (sub-tensor, or a number for a 1-D t) and t[i] = v (number or tensor)
--
-- Composite ops (triu/tril, repeat, repeat_interleave, roll, flip, one_hot,
-- unbind, movedim, unflatten, masked_select on plain tensors) are built from
-- ops that have DTensor rules and autograd, so they inherit both (helper index
-- tensors are laid out Replicate on the DTensor's mesh, no communication).
-- nonzero and masked_select have data-dependent output sizes: on DTensors they
-- run on full_tensor() and return a Replicate DTensor.
local core = require("engine.core")
local Tensor = require("engine.tensor")
local F = Tensor.functions        -- engine.zeros, arange, full_like, tensor (loaded before the op families)
local shape_ops = require("engine.ops.shape") -- engine.cat
local ffi, C = core.ffi, core.C
local wrap, ct, check = core.wrap, core.ct, core.check
local methods = Tensor.methods

local M = {}

local function fail(msg) core.fail(msg) end
local function is_dt(t) return core.is_tensor(t) and t._c.dist ~= nil end
local function dist() return require("engine.distributed") end
local function cdim(d, ndim, op, extra) local r = core.dim(d, ndim, op, extra, 4); return r end

-- A helper tensor (plain, made here) laid out Replicate on like's mesh when like is a DTensor.
local function lift(t, like)
  if not is_dt(like) then return t end
  local D = dist()
  local mesh = like.device_mesh
  local pl = {}
  for i = 1, mesh:ndim() do pl[i] = D.Replicate() end
  return D.distribute_tensor(t, mesh, pl, { src_data_rank = false })
end
Tensor.lift_replicate = lift  -- for the other composite op modules

local function replicate_like(t, like)
  local D = dist()
  local mesh = like.device_mesh
  local pl = {}
  for i = 1, mesh:ndim() do pl[i] = D.Replicate() end
  return D.from_local(t, mesh, pl)
end

local function number_of(t) if is_dt(t) then return t:full_tensor():item() end return t:item() end

local function dev_opts(t, dtype) return { dtype = dtype or "i64", device = t.device == "meta" and "cpu" or t.device } end

local function is_num(v) return type(v) == "number" end

-- in-place forms: r computed out of place without autograd, then copied into t
local function grad_off(fn, ...)
  local prev = C.eng_set_grad_enabled(0)
  local ok, r = pcall(fn, ...)
  C.eng_set_grad_enabled(prev)
  if not ok then error(r, 0) end
  return r
end
local function into(t, r)
  if is_dt(t) and is_dt(r) and r:_layout_str() ~= t:_layout_str() then
    r = grad_off(function() return r:redistribute(t.device_mesh, t.placements) end)
  end
  check(C.eng_tensor_copy_(t._c, r._c))
  return t
end

-- ============================================================ gather / scatter / index_add / index_copy
function methods.gather(t, d, index)
  local c = ct(t, "gather", 1)
  local r = wrap(C.eng_gather(c, cdim(d, c.ndim, "gather"), ct(index, "gather", 3)))
  return r
end

local function scatter_src(t, index, src, op)
  if type(src) == "boolean" then src = src and 1 or 0 end
  if is_num(src) then
    local ic = ct(index, op, 3)
    if is_dt(index) then return F.full_like(index, src, { dtype = t.dtype }) end
    return wrap(C.eng_tensor_full(ic.ndim, ic.shape, src, t._c.dtype, ic.device))
  end
  return src
end

-- scatter(dim, index, src) / scatter(dim, index, value); reduce: only via scatter_add.
function methods.scatter(t, d, index, src, opts)
  local c = ct(t, "scatter", 1)
  if opts ~= nil then
    local red = type(opts) == "table" and opts.reduce or opts
    if red == "add" then return methods.scatter_add(t, d, index, src) end
    fail("scatter: reduce must be \"add\" (or use scatter_add), got " .. tostring(red))
  end
  local s = scatter_src(t, index, src, "scatter")
  local r = wrap(C.eng_scatter(c, cdim(d, c.ndim, "scatter"), ct(index, "scatter", 3), ct(s, "scatter", 4), 0))
  return r
end
function methods.scatter_add(t, d, index, src)
  local c = ct(t, "scatter_add", 1)
  local r = wrap(C.eng_scatter(c, cdim(d, c.ndim, "scatter_add"), ct(index, "scatter_add", 3),
    ct(src, "scatter_add", 4), 1))
  return r
end

local function alpha_of(opts, op)
  if opts == nil then return 1 end
  local a = opts
  if type(opts) == "table" then a = opts.alpha end
  if a == nil then return 1 end
  if type(a) ~= "number" then fail(op .. ": alpha must be a number, got " .. type(a)) end
  return a
end
function methods.index_add(t, d, index, src, opts)
  local c = ct(t, "index_add", 1)
  local a = alpha_of(opts, "index_add")
  local r = wrap(C.eng_index_add(c, cdim(d, c.ndim, "index_add"), ct(index, "index_add", 3),
    ct(src, "index_add", 4), a))
  return r
end
function methods.index_copy(t, d, index, src)
  local c = ct(t, "index_copy", 1)
  local r = wrap(C.eng_index_copy(c, cdim(d, c.ndim, "index_copy"), ct(index, "index_copy", 3),
    ct(src, "index_copy", 4)))
  return r
end
for _, name in ipairs({ "scatter", "scatter_add", "index_add", "index_copy" }) do
  local f = methods[name]
  methods[name .. "_"] = function(t, ...)
    local r = grad_off(f, t, ...)
    return into(t, r)
  end
end

-- ============================================================ nonzero / masked_select
-- nonzero(t) -> i64 [n, ndim] of 0-based coordinates; {as_tuple = true}: ndim 1-D tensors.
function methods.nonzero(t, opts)
  local c = ct(t, "nonzero", 1)
  local r
  if is_dt(t) then
    local full = grad_off(function() return t:full_tensor() end)
    r = replicate_like(wrap(C.eng_nonzero(full._c)), t)
  else
    r = wrap(C.eng_nonzero(c))
  end
  if type(opts) == "table" and opts.as_tuple then
    if c.ndim == 0 then return { r:view(-1) } end
    return methods.unbind(r, 2)
  end
  return r
end
M.argwhere = methods.nonzero
methods.argwhere = methods.nonzero

-- masked_select(mask): the elements of t where mask (bool, broadcastable) is true, 1-D.
function methods.masked_select(t, mask)
  ct(t, "masked_select", 1)
  local m = ct(mask, "masked_select", 2)
  if m.dtype ~= 7 then fail("masked_select: mask must be a bool tensor, got " .. core.dtype_names[m.dtype]) end
  if is_dt(t) or is_dt(mask) then
    local like = is_dt(t) and t or mask
    local ft = is_dt(t) and t:full_tensor() or t
    local fm = is_dt(mask) and grad_off(function() return mask:full_tensor() end) or mask
    return replicate_like(methods.masked_select(ft, fm), like)
  end
  -- one C call (engine/src/ops/index.c): broadcast, nonzero of the mask, index_select
  return wrap(C.eng_masked_select(t._c, m))
end

-- ============================================================ triu / tril
local tri_masks, tri_n = {}, 0
local function tri(t, k, upper, op)
  local c = ct(t, op, 1)
  k = k or 0
  if not is_num(k) or k % 1 ~= 0 then fail(op .. ": diagonal must be an integer, got " .. tostring(k)) end
  if c.ndim < 2 then fail(string.format("%s: input tensor must have at least 2 dims, got %d", op, c.ndim)) end
  local sh = t:shape()
  local r, q = sh[#sh - 1], sh[#sh]
  local o = dev_opts(t)
  -- the mask of zeroed positions, cached per (rows, cols, k, kind, device): causal masks recur every step
  local key = string.format("%d,%d,%d,%s,%s", r, q, k, upper and "u" or "l", o.device)
  local zero = tri_masks[key]
  if not zero then
    local diff = F.arange(q, o):view(1, q) - F.arange(r, o):view(r, 1)
    zero = upper and diff:lt(k) or diff:gt(k)
    if tri_n >= 32 then tri_masks, tri_n = {}, 0 end
    tri_masks[key], tri_n = zero, tri_n + 1
  end
  local res = t:masked_fill(lift(zero, t), 0)
  return res
end
function methods.triu(t, k) return tri(t, k, true, "triu") end
function methods.tril(t, k) return tri(t, k, false, "tril") end

-- ============================================================ repeat / repeat_interleave
local function sizes_of(op, ...)
  local a = ...
  local l = (type(a) == "table" and not core.is_tensor(a)) and a or { ... }
  for i = 1, #l do
    if not is_num(l[i]) or l[i] % 1 ~= 0 or l[i] < 0 then
      fail(string.format("%s: repeats must be non-negative integers, got %s at position %d", op, tostring(l[i]), i))
    end
  end
  return l
end

-- t:repeat_tensor(r1, r2, ...) = torch.Tensor.repeat (also t["repeat"](t, ...)): tiles t.
function methods.repeat_tensor(t, ...)
  local op = "repeat"
  ct(t, op, 1)
  local reps = sizes_of(op, ...)
  local sh = t:shape()
  if #reps < #sh then
    fail(string.format("%s: number of repeat dims (%d) can not be smaller than the number of tensor dims (%d)", op,
      #reps, #sh))
  end
  local full = {}
  for i = 1, #reps - #sh do full[i] = 1 end
  for i = 1, #sh do full[#reps - #sh + i] = sh[i] end
  -- the result's shape is checked before anything is built: sizes past 2^63, or a number of elements or
  -- bytes that overflows, fail here at once; a result too large for memory fails at its one allocation
  local out, zero = {}, false
  for j = 1, #reps do out[j] = full[j] * reps[j]; zero = zero or out[j] == 0 end
  local n, arr = core.shape_arg(op, out)
  local probe = C.eng_tensor_empty(n, arr, C.eng_dtype_from_name(t.dtype), 2) -- a meta tensor: checked, no data
  if probe == nil then fail(core.prefixed(op, core.last_error(), "empty")) end
  C.eng_tensor_release(probe)
  if zero then return F.zeros(out, { dtype = t.dtype, device = t.device }) end
  local x = t
  if #reps > #sh then x = x:reshape(full) end
  for i = 1, #reps do
    local r = reps[i]
    if r > 1 then
      local cur = x:shape()
      if not is_dt(x) and #cur < 8 then
        -- r copies along dim i: a view [.., r, size_i, ..] (expand, no copy) copied once (contiguous: a new
        -- tensor, as PyTorch's repeat, even where a reshape could be a view of stride 0) as [.., r * size_i, ..]
        local big, merged = { unpack(cur) }, { unpack(cur) }
        table.insert(big, i, r)
        merged[i] = r * cur[i]
        x = x:unsqueeze(i):expand(big):contiguous():view(merged)
      else
        -- DTensors (and 8-d tensors, which have no room for the extra dim): concatenations, the copies
        -- doubled each time (log2 r of them, not a list of r tensors)
        local acc, pw, k = nil, x, r
        while k > 0 do
          if k % 2 == 1 then acc = acc and shape_ops.cat({ acc, pw }, i) or pw end
          k = math.floor(k / 2)
          if k > 0 then pw = shape_ops.cat({ pw, pw }, i) end
        end
        x = acc
      end
    end
  end
  if x == t then x = t:clone() end
  return x
end
methods["repeat"] = methods.repeat_tensor
methods.repeatTensor = methods.repeat_tensor

-- repeat_interleave(repeats [, dim]): repeats a number or an integer tensor (one entry per element of
-- dim, or one entry); without dim t is flattened first.  engine.repeat_interleave(counts) (an integer
-- 1-D tensor alone) gives 0-based positions repeated by counts.
function methods.repeat_interleave(t, repeats, d)
  local op = "repeat_interleave"
  ct(t, op, 1)
  if repeats == nil then
    if t:dim() ~= 1 or t:is_floating_point() then fail(op .. ": repeats alone must be a 1-D integer tensor") end
    local counts = (is_dt(t) and t:full_tensor() or t):tolist_flat()
    local idx = {}
    for i, n in ipairs(counts) do
      if n < 0 then fail(op .. ": repeats must be non-negative, got " .. n) end
      for _ = 1, n do idx[#idx + 1] = i - 1 end
    end
    local r = F.tensor(#idx > 0 and idx or {}, { dtype = "i64", device = t.device })
    if #idx == 0 then r = F.zeros({ 0 }, dev_opts(t)) end
    if is_dt(t) then return replicate_like(r, t) end
    return r
  end
  local x = t
  if d == nil then x = t:reshape(-1); d = 1 end
  local cd = cdim(d, x:dim(), op)
  local n = x:size(cd + 1)
  if is_num(repeats) then
    if repeats % 1 ~= 0 or repeats < 0 then fail(op .. ": repeats must be a non-negative integer, got " .. repeats) end
    if repeats == 0 then local s = x:shape(); s[cd + 1] = 0; return F.zeros(s, { dtype = t.dtype, device = t.device }) end
    local sh = x:shape()
    local esh = {}
    for i = 1, #sh do esh[#esh + 1] = sh[i]; if i == cd + 1 then esh[#esh + 1] = repeats end end
    local r = x:unsqueeze(cd + 2):expand(esh):flatten(cd + 1, cd + 2)
    return r
  end
  if not core.is_tensor(repeats) or repeats:is_floating_point() or repeats:dim() > 1 then
    fail(op .. ": repeats must be an integer or a 1-D integer tensor")
  end
  local counts = (is_dt(repeats) and repeats:full_tensor() or repeats):tolist_flat()
  if #counts == 1 then return methods.repeat_interleave(t, counts[1], d) end
  if #counts ~= n then
    fail(string.format("%s: repeats must have the same size as input along dim %d: %d vs %d", op, cd + 1, #counts, n))
  end
  local idx = {}
  for i, k in ipairs(counts) do
    if k < 0 then fail(op .. ": repeats must be non-negative, got " .. k) end
    for _ = 1, k do idx[#idx + 1] = i - 1 end
  end
  if #idx == 0 then local s = x:shape(); s[cd + 1] = 0; return F.zeros(s, { dtype = t.dtype, device = t.device }) end
  local r = x:index_select(cd + 1, lift(F.tensor(idx, dev_opts(t)), x))
  return r
end

-- ============================================================ roll / flip
local function list_of(v) if type(v) == "table" and not core.is_tensor(v) then return v end return { v } end

function methods.roll(t, shifts, dims)
  local op = "roll"
  ct(t, op, 1)
  if dims == nil then
    if type(shifts) == "table" and #shifts ~= 1 then fail(op .. ": without dims, shifts must be one number") end
    local r = methods.roll(t:reshape(-1), list_of(shifts)[1], 1):view(t:shape())
    return r
  end
  local sl, dl = list_of(shifts), list_of(dims)
  if #sl ~= #dl then fail(string.format("%s: shifts (%d entries) and dims (%d entries) must have the same length", op, #sl, #dl)) end
  local x = t
  for i = 1, #dl do
    local s = sl[i]
    if not is_num(s) or s % 1 ~= 0 then fail(op .. ": shifts must be integers, got " .. tostring(s)) end
    local cd = cdim(dl[i], x:dim(), op)
    local n = x:size(cd + 1)
    if n > 0 then
      s = s % n
      if s ~= 0 then
        x = shape_ops.cat({ x:narrow(cd + 1, n - s + 1, s), x:narrow(cd + 1, 1, n - s) }, cd + 1)
      end
    end
  end
  if x == t then x = t:clone() end
  return x
end

function methods.flip(t, ...)
  local op = "flip"
  ct(t, op, 1)
  local a = ...
  local dl = (type(a) == "table" and not core.is_tensor(a)) and a or { ... }
  local seen = {}
  local x = t
  for i = 1, #dl do
    local cd = cdim(dl[i], t:dim(), op)
    if seen[cd] then fail(string.format("%s: dim %d appears multiple times in the list of dims", op, cd + 1)) end
    seen[cd] = true
    local n = x:size(cd + 1)
    if n > 1 then x = x:index_select(cd + 1, lift(F.arange(n - 1, -1, -1, dev_opts(t)), x)) end
  end
  if x == t then x = t:clone() end
  return x
end

-- ============================================================ one_hot / unbind / movedim / unflatten
-- one_hot(t, num_classes = -1): i64 [..., num_classes]; t holds 0-based class ids.
function M.one_hot(t, num_classes)
  local op = "one_hot"
  local c = ct(t, op, 1)
  if C.eng_dtype_is_floating(c.dtype) ~= 0 or c.dtype == 7 then
    fail(op .. ": one_hot is only applicable to index tensors (i32/i64/u8), got " .. t.dtype)
  end
  num_classes = num_classes or -1
  if not is_num(num_classes) or num_classes % 1 ~= 0 or num_classes < -1 then
    fail(op .. ": num_classes must be a non-negative integer or -1, got " .. tostring(num_classes))
  end
  if not is_dt(t) then return wrap(C.eng_one_hot(c, num_classes)) end  -- one C op (engine/src/ops/index.c)
  if t:numel() > 0 then
    local mn, mx = number_of(t:min()), number_of(t:max())
    if mn < 0 then fail(op .. ": class values must be non-negative, got " .. mn) end
    if num_classes == -1 then num_classes = mx + 1
    elseif mx >= num_classes then
      fail(string.format("%s: class values must be smaller than num_classes %d, got %d", op, num_classes, mx))
    end
  elseif num_classes == -1 then
    fail(op .. ": can not infer total number of classes from an empty tensor")
  end
  local classes = lift(F.arange(num_classes, dev_opts(t, t.dtype)), t)
  local r = t:unsqueeze(-1):eq(classes):long()
  return r
end
methods.one_hot = M.one_hot

-- unbind(dim = 1) -> list of the slices along dim (views).
function methods.unbind(t, d)
  local c = ct(t, "unbind", 1)
  if c.ndim == 0 then
    fail(string.format("unbind: dimension specified as %s but the tensor has no dimensions (a 0-d tensor; "
      .. "PyTorch raises too)", tostring(d or 1)))
  end
  local cd = cdim(d or 1, c.ndim, "unbind")
  local out = {}
  for i = 1, t:size(cd + 1) do out[i] = t:select(cd + 1, i) end
  return out
end

-- movedim(source, destination): dims (or equal-length lists of dims) moved, others keep their order.
function methods.movedim(t, src, dst)
  local op = "movedim"
  local c = ct(t, op, 1)
  local sl, dl = list_of(src), list_of(dst)
  if #sl ~= #dl then
    fail(string.format("%s: Invalid source or destination dims: source (%d dims) should contain the same number of dims as destination (%d dims)", op, #sl, #dl))
  end
  local nd = c.ndim
  local perm, used_src, used_dst = {}, {}, {}
  for i = 1, #sl do
    local s, d = cdim(sl[i], nd, op) + 1, cdim(dl[i], nd, op) + 1
    if used_src[s] then fail(op .. ": repeated dim in source " .. s) end
    if used_dst[d] then fail(op .. ": repeated dim in destination " .. d) end
    used_src[s], used_dst[d] = true, true
    perm[d] = s
  end
  local rest = {}
  for s = 1, nd do if not used_src[s] then rest[#rest + 1] = s end end
  local k = 1
  for d = 1, nd do if not perm[d] then perm[d] = rest[k]; k = k + 1 end end
  if nd == 0 then return t:view({}) end
  local r = t:permute(perm)
  return r
end
methods.moveaxis = methods.movedim

-- unflatten(dim, sizes): dim split into sizes (one may be -1).
function methods.unflatten(t, d, sizes)
  local op = "unflatten"
  local c = ct(t, op, 1)
  if c.ndim == 0 then fail(string.format("%s: a 0-d tensor (%s[]) has no dim to unflatten", op, t.dtype)) end
  local cd = cdim(d, c.ndim, op)
  if type(sizes) ~= "table" or #sizes == 0 then fail(op .. ": sizes must be a non-empty table of sizes") end
  local sh = t:shape()
  local n, known, neg = sh[cd + 1], 1, nil
  for i, s in ipairs(sizes) do
    if not is_num(s) or s % 1 ~= 0 or s < -1 then fail(op .. ": sizes must be integers (one may be -1), got " .. tostring(s)) end
    if s == -1 then
      if neg then fail(op .. ": only one size may be -1") end
      neg = i
    else known = known * s end
  end
  local out = {}
  for i = 1, cd do out[#out + 1] = sh[i] end
  for i, s in ipairs(sizes) do
    if i == neg then s = known > 0 and n / known or 0 end
    out[#out + 1] = s
  end
  if (neg and (known == 0 or n % known ~= 0)) or (not neg and known ~= n) then
    fail(string.format("%s: provided sizes [%s] don't multiply up to the size of dim %d (%d) in the input tensor",
      op, table.concat(sizes, ","), cd + 1, n))
  end
  for i = cd + 2, #sh do out[#out + 1] = sh[i] end
  local r = t:reshape(out)
  return r
end

-- ============================================================ t[i] / t[i] = v
function Tensor.index_number(t, i)
  local nd = t._c.ndim
  if nd == 0 then fail("index: invalid index of a 0-d tensor (use t:item())") end
  if i % 1 ~= 0 then fail("index: index must be an integer, got " .. tostring(i)) end
  local n = t:size(1)
  if i == 0 or i > n or i < -n then
    fail(string.format("index: index %d is out of bounds for dim 1 with size %d (indices are 1-based)", i, n))
  end
  if nd == 1 then return t:get(i) end
  return t:select(1, i)
end

function Tensor.newindex_number(t, i, v)
  local nd = t._c.ndim
  if nd == 0 then fail("index: invalid index of a 0-d tensor (use t:fill_(v))") end
  if i % 1 ~= 0 then fail("index: index must be an integer, got " .. tostring(i)) end
  local n = t:size(1)
  if i == 0 or i > n or i < -n then
    fail(string.format("index: index %d is out of bounds for dim 1 with size %d (indices are 1-based)", i, n))
  end
  if type(v) == "boolean" then v = v and 1 or 0 end
  if nd == 1 and is_num(v) then t:set(v, i); return end
  local row = t:select(1, i)
  if is_num(v) then row:fill_(v)
  elseif core.is_tensor(v) then row:copy_(v)
  else fail("index: the assigned value must be a number or a tensor, got " .. type(v)) end
end

-- Function forms: engine.gather(t, ...), ...
for _, name in ipairs({ "gather", "scatter", "scatter_add", "index_add", "index_copy", "nonzero", "masked_select",
  "triu", "tril", "repeat_interleave", "roll", "flip", "unbind", "movedim", "moveaxis", "unflatten" }) do
  M[name] = methods[name]
end

return M
