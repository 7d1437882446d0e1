-- engine.distributed.comm: process groups, collectives, async work handles,
-- collective counters, debug mode and the flight recorder.
--
-- Collectives work along the FIRST dim (dim 1 in Lua) and take an options
-- table: {group = ProcessGroup or DeviceMesh (with mesh_dim), async = true}.
-- Without a group they run on the world.  Ranks are 0-based (MPI convention):
-- `src` is a global rank as in PyTorch, `group_src` a rank within the group.
-- On a rank outside the group a collective is skipped (PyTorch semantics):
-- in-place ones leave the tensor alone, out-of-place ones return the input.
local core = require("engine.core")
local engine = require("engine")
require("engine.tensor")
local ffi, C = core.ffi, core.C
local ct, check = core.ct, core.check

local M = {}

local function cerr(level) error(core.last_error(), level + 1) end

-- ---------------------------------------------------------------- process groups
local ProcessGroup = { __name = "ProcessGroup" }
ProcessGroup.__index = ProcessGroup
M.ProcessGroup = ProcessGroup

local function wrap_pg(p, level)
  if p == nil then cerr((level or 2) + 1) end
  return setmetatable({ _c = ffi.gc(p, C.eng_pg_release) }, ProcessGroup)
end
M._wrap_pg = wrap_pg

function M.is_group(x) return type(x) == "table" and getmetatable(x) == ProcessGroup end

-- This process's rank in the group, nil when not a member.
function ProcessGroup:rank()
  local r = C.eng_pg_rank(self._c)
  if r < 0 then return nil end
  return r
end
-- Number of members (nil on a non-member, which does not know the members).
function ProcessGroup:size()
  local s = C.eng_pg_size(self._c)
  if s < 0 then return nil end
  return s
end
function ProcessGroup:is_member() return C.eng_pg_is_member(self._c) ~= 0 end
-- true when large DTensor S->S / S->R exchanges on this group move each block once between the
-- ranks' memories (see set_single_copy); collective the first time it is asked.
function ProcessGroup:single_copy_usable() return C.eng_pg_single_copy_usable(self._c) ~= 0 end
-- single_copy_reason(): why not ("" when usable; "the members are on different nodes", ...), after
-- single_copy_usable() was asked.
function ProcessGroup:single_copy_reason() return ffi.string(C.eng_pg_single_copy_reason(self._c)) end
function ProcessGroup:name() return ffi.string(C.eng_pg_name(self._c)) end
function ProcessGroup:id() return tonumber(C.eng_pg_id(self._c)) end
-- Collectives issued on the group so far (the next sequence number).
function ProcessGroup:seq() return tonumber(C.eng_pg_seq(self._c)) end
-- World ranks of the members in group-rank order ({} on a non-member).
function ProcessGroup:ranks()
  local n = C.eng_pg_size(self._c)
  if n <= 0 then return {} end
  local buf = ffi.new("int[?]", n)
  C.eng_pg_ranks(self._c, buf, n)
  local r = {}
  for i = 1, n do r[i] = buf[i - 1] end
  return r
end
-- Group rank of a global rank (error when it is not a member).
function ProcessGroup:group_rank(global_rank)
  local r = C.eng_pg_group_rank(self._c, global_rank)
  if r < 0 then cerr(2) end
  return r
end
-- Global rank of a group rank.
function ProcessGroup:global_rank(group_rank)
  local ranks = self:ranks()
  local g = ranks[(group_rank or -1) + 1]
  if g == nil then
    error(string.format("global_rank: group rank %s is out of range for %s", tostring(group_rank), self:name()), 2)
  end
  return g
end
ProcessGroup.__eq = function(a, b) return C.eng_pg_id(a._c) == C.eng_pg_id(b._c) end
ProcessGroup.__tostring = function(g)
  if not g:is_member() then
    local n = g:name()
    if n:find("not a member", 1, true) then return string.format("ProcessGroup(%s)", n) end
    return string.format("ProcessGroup(%s, not a member)", n)
  end
  return string.format("ProcessGroup(%s, size=%d, rank=%d, ranks={%s})", g:name(), g:size(), g:rank(),
    table.concat(g:ranks(), ", "))
end

local world
function M.world_group()
  if not world then world = wrap_pg(C.eng_pg_world(), 2) end
  return world
end

-- new_group({0, 2}): collective over the world (every rank calls it with the
-- same list); non-members get a group object on which collectives are skipped.
function M.new_group(ranks)
  if type(ranks) ~= "table" then
    C.eng_pg_new(nil, 0)
    error("new_group: expected a list of 0-based global ranks", 2)
  end
  local n = #ranks
  local buf = ffi.new("int[?]", n > 0 and n or 1)
  for i = 1, n do
    local r = ranks[i]
    if type(r) ~= "number" or r % 1 ~= 0 then
      C.eng_pg_new(nil, 0) -- still take part in the agreement, so the other ranks fail too
      error(string.format("new_group: rank %d of the list must be an integer, got %s", i, tostring(r)), 2)
    end
    buf[i - 1] = r
  end
  local g = wrap_pg(C.eng_pg_new(buf, n), 2)
  local members = {}
  for i = 1, n do members[i] = ranks[i] end
  g._members = members   -- every rank passed (and agreed on) the list: non-members know the members too
  return g
end

-- The group's global ranks in group-rank order, also on a non-member when the group was made by
-- new_group (every rank passed the list); nil on a non-member of another group.
function ProcessGroup:members()
  if self:is_member() then return self:ranks() end
  local m = rawget(self, "_members")
  return m and { unpack(m) } or nil
end

-- ---------------------------------------------------------------- options
local op_codes = {}
M.ReduceOp = { SUM = "sum", AVG = "avg", MAX = "max", MIN = "min", PRODUCT = "prod", PROD = "prod" }

local KIND = { all_reduce = 0, all_gather = 1, reduce_scatter = 2, all_to_all = 3, broadcast = 4, scatter = 5,
  barrier = 6, gather = 7 }

-- Argument checks return (value) or (nil, message); fail() raises the message
-- after telling the group (in debug mode the other ranks then fail too).
local function fail(pg, name, msg, level)
  local kind = KIND[name:gsub("_into$", "")] or 6
  C.eng_pg_report_error(pg._c, kind, msg)
  error(msg, level + 1)
end

local function reduce_op(op, name)
  if op == nil then return 0 end
  if type(op) ~= "string" then
    return nil, string.format("%s: reduce op must be a name (\"sum\", \"avg\", \"max\", \"min\", \"prod\"), got %s",
      name, type(op))
  end
  local c = op_codes[op]
  if c then return c end
  c = C.eng_reduce_op_from_name(op)
  if c < 0 then return nil, name .. ": " .. core.last_error() end
  op_codes[op] = c
  return c
end

local function tensor_arg(x, name, pos)
  if type(x) == "table" and x._c then
    if x._c.dist ~= nil then
      return nil, string.format("%s: argument %s is a DTensor (%s): collectives work on plain tensors; change a "
        .. "DTensor's layout with d:redistribute(mesh, placements) (e.g. {Replicate()} to sum a Partial), or pass "
        .. "d:to_local() / d:full_tensor()", name, tostring(pos), x:_layout_str())
    end
    return x._c
  end
  return nil, string.format("%s: argument %s must be a tensor, got %s", name, tostring(pos), type(x))
end

-- opts.group: nil (world), a ProcessGroup, or a DeviceMesh (opts.mesh_dim
-- picks the dim; optional for a 1-d mesh).
local function group_of(opts, name, level)
  local g = opts and opts.group
  if g == nil then return M.world_group() end
  if getmetatable(g) == ProcessGroup then return g end
  if type(g) == "table" and type(g.get_group) == "function" then
    local ok, pg = pcall(g.get_group, g, opts.mesh_dim)
    if not ok then error(name .. ": " .. tostring(pg):gsub("^[^:]*:%d+: ", ""), level + 1) end
    return pg
  end
  error(string.format("%s: opts.group must be a ProcessGroup or a DeviceMesh, got %s", name, type(g)), level + 1)
end

local function check_opts(opts, name, level)
  if opts ~= nil and type(opts) ~= "table" then
    error(string.format("%s: options must be a table such as {group = g, async = true}, got %s", name, type(opts)),
      level + 1)
  end
  return opts or {}
end

-- ---------------------------------------------------------------- work handles
local Work = { __name = "Work" }
Work.__index = Work
M.Work = Work

local function new_work(p, result)
  return setmetatable({ _c = ffi.gc(p, C.eng_work_release), _result = result }, Work)
end

-- Blocks until done; returns the result tensor (nil for a barrier).
function Work:wait()
  if C.eng_work_wait(self._c) ~= 0 then cerr(2) end
  return self._result
end
function Work:is_completed()
  local r = C.eng_work_is_completed(self._c)
  if r < 0 then cerr(2) end
  return r == 1
end
function Work:result() return self._result end
Work.__tostring = function(w) return "Work(" .. (C.eng_work_is_completed(w._c) == 1 and "completed" or "pending") .. ")" end

local work_box = ffi.new("eng_work*[1]")

-- Runs call(work_ptr_or_nil) and returns result_of(its return) or a Work.
-- Errors point at the caller of the API function (level 2 from it).
local function finish(opts, call, result_of)
  if opts.async then
    work_box[0] = nil
    local r = call(work_box)
    local p = work_box[0]
    work_box[0] = nil
    local res = result_of(r)
    if p == nil then cerr(3) end
    local wk = new_work(p, res)
    return wk
  end
  local res = result_of(call(nil))
  return res
end

-- ---------------------------------------------------------------- collectives
-- The new tensor, or the input's Lua object when the C call handed the input
-- back (a rank outside the group).  Level 4: finish -> API function -> caller.
local function out_of(input)
  return function(p)
    if p == nil then cerr(4) end
    if p == input._c then
      C.eng_tensor_release(p)
      return input
    end
    return core.wrap(p, 5)
  end
end

local function rc_check(rc) if rc ~= 0 then cerr(5) end end

-- all_reduce(t, op = "sum", opts): in place; returns t (or a Work).
function M.all_reduce(t, op, opts)
  if type(op) == "table" and opts == nil then op, opts = nil, op end
  opts = check_opts(opts, "all_reduce", 2)
  local pg = group_of(opts, "all_reduce", 2)
  local c, e = tensor_arg(t, "all_reduce", 1)
  if not c then fail(pg, "all_reduce", e, 2) end
  local opc
  opc, e = reduce_op(op, "all_reduce")
  if not opc then fail(pg, "all_reduce", e, 2) end
  local r = finish(opts, function(w) rc_check(C.eng_pg_all_reduce(pg._c, c, opc, w)) end, function() return t end)
  return r
end

-- all_gather(t, opts) -> new tensor [size*d1, ...] (inputs concatenated along
-- dim 1 in group-rank order).
function M.all_gather(t, opts)
  opts = check_opts(opts, "all_gather", 2)
  local pg = group_of(opts, "all_gather", 2)
  local c, e = tensor_arg(t, "all_gather", 1)
  if not c then fail(pg, "all_gather", e, 2) end
  local r = finish(opts, function(w) return C.eng_pg_all_gather(pg._c, c, w) end, out_of(t))
  return r
end

-- all_gather_into(out, t, opts): out is [size*d1, ...].
function M.all_gather_into(out, t, opts)
  opts = check_opts(opts, "all_gather_into", 2)
  local pg = group_of(opts, "all_gather_into", 2)
  local co, e = tensor_arg(out, "all_gather_into", 1)
  if not co then fail(pg, "all_gather_into", e, 2) end
  local c
  c, e = tensor_arg(t, "all_gather_into", 2)
  if not c then fail(pg, "all_gather_into", e, 2) end
  local r = finish(opts, function(w) rc_check(C.eng_pg_all_gather_into(pg._c, co, c, w)) end,
    function() return out end)
  return r
end

-- reduce_scatter(t, op = "sum", opts): t is [size*c, ...]; returns [c, ...]
-- holding the reduction of every rank's chunk number (group rank).
function M.reduce_scatter(t, op, opts)
  if type(op) == "table" and opts == nil then op, opts = nil, op end
  opts = check_opts(opts, "reduce_scatter", 2)
  local pg = group_of(opts, "reduce_scatter", 2)
  local c, e = tensor_arg(t, "reduce_scatter", 1)
  if not c then fail(pg, "reduce_scatter", e, 2) end
  local opc
  opc, e = reduce_op(op, "reduce_scatter")
  if not opc then fail(pg, "reduce_scatter", e, 2) end
  local r = finish(opts, function(w) return C.eng_pg_reduce_scatter(pg._c, c, opc, w) end, out_of(t))
  return r
end

function M.reduce_scatter_into(out, t, op, opts)
  if type(op) == "table" and opts == nil then op, opts = nil, op end
  opts = check_opts(opts, "reduce_scatter_into", 2)
  local pg = group_of(opts, "reduce_scatter_into", 2)
  local co, e = tensor_arg(out, "reduce_scatter_into", 1)
  if not co then fail(pg, "reduce_scatter_into", e, 2) end
  local c
  c, e = tensor_arg(t, "reduce_scatter_into", 2)
  if not c then fail(pg, "reduce_scatter_into", e, 2) end
  local opc
  opc, e = reduce_op(op, "reduce_scatter_into")
  if not opc then fail(pg, "reduce_scatter_into", e, 2) end
  local r = finish(opts, function(w) rc_check(C.eng_pg_reduce_scatter_into(pg._c, co, c, opc, w)) end,
    function() return out end)
  return r
end

-- all_to_all(t, opts): t is [size*c, ...]; chunk j goes to group rank j and
-- chunk i of the result came from group rank i.
function M.all_to_all(t, opts)
  opts = check_opts(opts, "all_to_all", 2)
  local pg = group_of(opts, "all_to_all", 2)
  local c, e = tensor_arg(t, "all_to_all", 1)
  if not c then fail(pg, "all_to_all", e, 2) end
  local r = finish(opts, function(w) return C.eng_pg_all_to_all(pg._c, c, w) end, out_of(t))
  return r
end

function M.all_to_all_into(out, t, opts)
  opts = check_opts(opts, "all_to_all_into", 2)
  local pg = group_of(opts, "all_to_all_into", 2)
  local co, e = tensor_arg(out, "all_to_all_into", 1)
  if not co then fail(pg, "all_to_all_into", e, 2) end
  local c
  c, e = tensor_arg(t, "all_to_all_into", 2)
  if not c then fail(pg, "all_to_all_into", e, 2) end
  local r = finish(opts, function(w) rc_check(C.eng_pg_all_to_all_into(pg._c, co, c, w)) end,
    function() return out end)
  return r
end

-- box_exchange(moves, srcs, dsts, opts) -> true, or false when declined: the single-copy box
-- exchange (eng_pg_box_exchange).  moves: the same list on every rank, each
-- {from = group rank, src = index into that rank's srcs (1-based), src_off = {0-based element offsets},
--  to = group rank, dst = index into that rank's dsts, dst_off = {...}, shape = {...}};
-- srcs / dsts: this rank's tensors (plain, one dtype, any strides).  Each box moves once between the
-- processes' memories, counted as one all_to_all.  false (the same on every rank): the path is not
-- usable here (other nodes, ptrace rules, set_single_copy(false), non-CPU tensors, runs under 256
-- bytes): move the boxes another way.  Errors (differing lists, boxes outside a tensor) on every rank.
-- opts: group, dtype and ndim of the boxes (pass them: a rank may hold no tensor), op (names errors),
-- kind (the collective it counts as: "all_to_all" by default, "all_gather", "gather", "scatter").
function M.box_exchange(moves, srcs, dsts, opts)
  local name = "box_exchange"
  opts = check_opts(opts, name, 2)
  local pg = group_of(opts, name, 2)
  local nd, dtype
  local function tensors(list, what)
    local arr = ffi.new("eng_tensor*[?]", math.max(#list, 1))
    for i, t in ipairs(list) do
      local c, e = tensor_arg(t, name, what .. " " .. i)
      if not c then error(e, 3) end
      arr[i - 1] = c
      nd, dtype = nd or c.ndim, dtype or c.dtype
    end
    return arr
  end
  local sa, da = tensors(srcs, "source"), tensors(dsts, "destination")
  local m = moves[1]
  nd = opts.ndim or m and #m.shape or nd or 1
  dtype = opts.dtype ~= nil and core.dtype(opts.dtype, name) or dtype or 0
  local cm = ffi.new("eng_box_move[?]", math.max(#moves, 1))
  for i, mv in ipairs(moves) do
    local c = cm[i - 1]
    c.src, c.src_idx, c.dst, c.dst_idx = mv.from, mv.src - 1, mv.to, mv.dst - 1
    for d = 1, nd do
      c.src_off[d - 1], c.dst_off[d - 1], c.shape[d - 1] = mv.src_off[d], mv.dst_off[d], mv.shape[d]
    end
  end
  local kind = KIND[opts.kind or "all_to_all"]
  if not kind or kind == KIND.barrier then error(name .. ": unknown collective kind " .. tostring(opts.kind), 2) end
  local rc = C.eng_pg_box_exchange(pg._c, opts.op or name, kind, nd, dtype, cm, #moves, sa, #srcs, da, #dsts)
  if rc < 0 then cerr(2) end
  return rc == 0
end

-- The root as a group rank: src is a global rank, opts.group_src a group rank (for gather: dst and
-- opts.group_dst).
local function root_of(pg, src, opts, name, word)
  word = word or "src"
  local gkey = "group_" .. word
  if opts[gkey] ~= nil then
    if src ~= nil then return nil, string.format("%s: give either %s (global rank) or opts.%s, not both", name, word, gkey) end
    if type(opts[gkey]) ~= "number" or opts[gkey] % 1 ~= 0 then
      return nil, string.format("%s: opts.%s must be an integer group rank", name, gkey)
    end
    return opts[gkey]
  end
  if type(src) ~= "number" or src % 1 ~= 0 then
    return nil, string.format("%s: %s must be an integer global rank (0-based), got %s", name, word, tostring(src))
  end
  if C.eng_pg_is_member(pg._c) == 0 then return 0 end -- skipped anyway
  local r = C.eng_pg_group_rank(pg._c, src)
  if r < 0 then return nil, name .. ": " .. word .. ": " .. core.last_error() end
  return r
end

-- broadcast(t, src, opts): in place; t becomes src's t.
function M.broadcast(t, src, opts)
  if type(src) == "table" and opts == nil then src, opts = nil, src end
  opts = check_opts(opts, "broadcast", 2)
  local pg = group_of(opts, "broadcast", 2)
  local c, e = tensor_arg(t, "broadcast", 1)
  if not c then fail(pg, "broadcast", e, 2) end
  local root
  root, e = root_of(pg, src, opts, "broadcast")
  if not root then fail(pg, "broadcast", e, 2) end
  local r = finish(opts, function(w) rc_check(C.eng_pg_broadcast(pg._c, c, root, w)) end, function() return t end)
  return r
end

-- scatter(out, input, src, opts): out [c, ...] on every rank receives chunk
-- (group rank) of src's input [size*c, ...]; input may be nil elsewhere.
function M.scatter(out, input, src, opts)
  if type(src) == "table" and opts == nil then src, opts = nil, src end
  opts = check_opts(opts, "scatter", 2)
  local pg = group_of(opts, "scatter", 2)
  local co, e = tensor_arg(out, "scatter", 1)
  if not co then fail(pg, "scatter", e, 2) end
  local ci = nil
  if input ~= nil then
    ci, e = tensor_arg(input, "scatter", 2)
    if not ci then fail(pg, "scatter", e, 2) end
  end
  local root
  root, e = root_of(pg, src, opts, "scatter")
  if not root then fail(pg, "scatter", e, 2) end
  local r = finish(opts, function(w) rc_check(C.eng_pg_scatter(pg._c, co, ci, root, w)) end,
    function() return out end)
  return r
end

-- gather(t, out, dst = 0, opts): the converse of scatter (torch.distributed.gather): every rank's t
-- (the same shape on every rank) is sent to dst (a global rank; opts.group_dst: a group rank), which
-- receives them concatenated along dim 1 in group-rank order.  out on dst: a tensor [size*d1, ...]
-- (filled and returned), a list of size tensors each of t's shape (PyTorch's gather_list: filled and
-- returned; not with async), or nil (a new tensor is returned).  The other ranks pass nil (out is
-- ignored there), allocate nothing and get nil.  opts.sizes: the inputs differ in dim 1 (gatherv):
-- the list of each group rank's dim-1 length, the same on every rank (out is [sum, ...]; no
-- gather_list).  One "gather" collective (MPI_Gather(v); NCCL sends and receives).
function M.gather(t, out, dst, opts)
  local name = "gather"
  if type(dst) == "table" and opts == nil then dst, opts = nil, dst end
  opts = check_opts(opts, name, 2)
  local pg = group_of(opts, name, 2)
  local ci, e = tensor_arg(t, name, 1)
  if not ci then fail(pg, name, e, 2) end
  if dst == nil and opts.group_dst == nil then dst = 0 end
  local root
  root, e = root_of(pg, dst, opts, name, "dst")
  if not root then fail(pg, name, e, 2) end
  local member = C.eng_pg_is_member(pg._c) ~= 0
  local W = member and C.eng_pg_size(pg._c) or 0
  local sizes, total = nil, nil
  if opts.sizes ~= nil and member then
    local sz = opts.sizes
    if type(sz) ~= "table" or #sz ~= W then
      fail(pg, name, string.format("%s: opts.sizes must list the dim-1 length of each of the group's %d ranks", name, W), 2)
    end
    sizes, total = ffi.new("int64_t[?]", W), 0
    for i = 1, W do
      local v = sz[i]
      if type(v) ~= "number" or v % 1 ~= 0 or v < 0 then
        fail(pg, name, string.format("%s: opts.sizes[%d] must be a non-negative integer, got %s", name, i, tostring(v)), 2)
      end
      sizes[i - 1], total = v, total + v
    end
  end
  local function call(co, w)
    if sizes then return C.eng_pg_gatherv(pg._c, co, ci, sizes, root, w) end
    return C.eng_pg_gather(pg._c, co, ci, root, w)
  end
  local here = member and C.eng_pg_rank(pg._c) == root
  if not here then
    local r = finish(opts, function(w) rc_check(call(nil, w)) end, function() return nil end)
    return r
  end
  local list, co = nil, nil
  if type(out) == "table" and out._c == nil and getmetatable(out) == nil then
    list = out
    if sizes then fail(pg, name, name .. ": a gather_list with opts.sizes is not supported (pass one out tensor)", 2) end
    local W = C.eng_pg_size(pg._c)
    if #list ~= W then
      fail(pg, name, string.format("%s: gather_list has %d tensors, the group %d ranks", name, #list, W), 2)
    end
    if opts.async then fail(pg, name, name .. ": async with a gather_list is not supported (pass one out tensor)", 2) end
    for i, x in ipairs(list) do
      local cx
      cx, e = tensor_arg(x, name, "gather_list[" .. i .. "]")
      if not cx then fail(pg, name, e, 2) end
      local xs, ts = x:shape(), t:shape()
      if table.concat(xs, ",") ~= table.concat(ts, ",") or x.dtype ~= t.dtype then
        fail(pg, name, string.format("%s: gather_list[%d] %s[%s] does not match the input %s[%s]", name, i, x.dtype,
          table.concat(xs, ","), t.dtype, table.concat(ts, ",")), 2)
      end
    end
  elseif out ~= nil then
    co, e = tensor_arg(out, name, 2)
    if not co then fail(pg, name, e, 2) end
  end
  local full = out
  if co == nil then
    local shape = t:shape()
    if #shape == 0 then shape = { 1 } end
    shape[1] = total or shape[1] * W
    full = engine.empty(shape, { dtype = t.dtype, device = t.device })
    co = full._c
  end
  local r = finish(opts, function(w) rc_check(call(co, w)) end, function() return list or full end)
  if list then
    local ts = t:shape()
    local rows = #ts == 0 and 1 or ts[1]
    for i, x in ipairs(list) do x:copy_(full:narrow(1, (i - 1) * rows + 1, rows):view_as(x)) end
  end
  return r
end

function M.barrier(opts)
  opts = check_opts(opts, "barrier", 2)
  local pg = group_of(opts, "barrier", 2)
  local r = finish(opts, function(w) rc_check(C.eng_pg_barrier(pg._c, w)) end, function() return nil end)
  return r
end

-- ---------------------------------------------------------------- counters
local kinds = { "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "scatter", "barrier",
  "gather" }
local kind_code = {}
for i, k in ipairs(kinds) do kind_code[k] = i - 1 end
M.collective_kinds = kinds

local function snapshot()
  local s = {}
  for i, k in ipairs(kinds) do s[k] = tonumber(C.eng_comm_count(i - 1)) end
  return s
end

-- {all_reduce = 2, all_gather = 1, ...}: collectives issued by this rank since
-- the last reset (kinds with a zero count are left out).
function M.comm_counts()
  local r = {}
  for k, v in pairs(snapshot()) do if v > 0 then r[k] = v end end
  return r
end

-- Count of one kind, or of all kinds when kind is nil.
function M.comm_count(kind)
  if kind == nil then
    local n = 0
    for _, v in pairs(snapshot()) do n = n + v end
    return n
  end
  local c = kind_code[kind]
  if not c then error("comm_count: unknown collective kind '" .. tostring(kind) .. "'", 2) end
  return tonumber(C.eng_comm_count(c))
end

-- Bytes of the inputs of the collectives counted, per kind.
function M.comm_bytes()
  local r = {}
  for i, k in ipairs(kinds) do
    local v = tonumber(C.eng_comm_bytes(i - 1))
    if v > 0 then r[k] = v end
  end
  return r
end

function M.reset_comm_counts() C.eng_comm_reset_counts() end

-- count_collectives(fn, ...) -> counts of the collectives fn issued, then fn's results.
function M.count_collectives(fn, ...)
  local before = snapshot()
  local out = { fn(...) }
  local after = snapshot()
  local d = {}
  for k, v in pairs(after) do if v - before[k] > 0 then d[k] = v - before[k] end end
  return d, unpack(out)
end

-- CommDebugMode-like object: mode:enter() ... mode:exit(); mode:get_comm_counts().
local CommDebugMode = {}
CommDebugMode.__index = CommDebugMode
function M.CommDebugMode() return setmetatable({ _counts = {} }, CommDebugMode) end
function CommDebugMode:enter() self._before = snapshot(); self._counts = {}; return self end
function CommDebugMode:exit()
  local after = snapshot()
  local d = {}
  for k, v in pairs(after) do if v - self._before[k] > 0 then d[k] = v - self._before[k] end end
  self._counts, self._before = d, nil
  return self
end
function CommDebugMode:get_comm_counts()
  if self._before then
    local after, d = snapshot(), {}
    for k, v in pairs(after) do if v - self._before[k] > 0 then d[k] = v - self._before[k] end end
    return d
  end
  return self._counts
end
function CommDebugMode:get_total_counts()
  local n = 0
  for _, v in pairs(self:get_comm_counts()) do n = n + v end
  return n
end

-- ---------------------------------------------------------------- debug mode, flight recorder
-- set_single_copy(false): DTensor's large S->S and S->R exchanges go through MPI (with a pack)
-- instead of moving each strided block once between the ranks of a node; set it the same way
-- on every rank.  single_copy_count(): exchanges done the single-copy way by this process.
function M.set_single_copy(on) C.eng_comm_set_single_copy(on and 1 or 0) end
function M.get_single_copy() return C.eng_comm_get_single_copy() ~= 0 end
function M.single_copy_count() return tonumber(C.eng_comm_single_copy_count()) end

-- Every collective's signature (seq, kind, op, root, dtype, shape) is checked across its group
-- first (always on; set_comm_check(false) or ENGINE_COMM_CHECK=0 turns it off, on every rank).
-- set_debug(true [, {timeout = seconds}]): also logs every collective to stderr (ENGINE_COMM_DEBUG=1);
-- set it the same way on every rank.  set_comm_timeout(s): how long a rank waits for its peers in
-- the check before it prints the flight recorder and aborts the job (ENGINE_COMM_TIMEOUT, default 300).
function M.set_debug(on, opts)
  C.eng_comm_set_debug(on and 1 or 0)
  if type(opts) == "table" and opts.timeout ~= nil then M.set_comm_timeout(opts.timeout) end
end
function M.get_debug() return C.eng_comm_get_debug() ~= 0 end
function M.set_comm_check(on) C.eng_comm_set_check(on and 1 or 0) end
function M.get_comm_check() return C.eng_comm_get_check() ~= 0 end
function M.set_comm_timeout(seconds)
  if type(seconds) ~= "number" then error("set_comm_timeout: seconds must be a number", 2) end
  if C.eng_comm_set_timeout(seconds) ~= 0 then cerr(2) end
end
function M.get_comm_timeout() return tonumber(C.eng_comm_get_timeout()) end
-- set_comm_watchdog(s): after s seconds of waiting in a collective's check a rank tells the others what it
-- waits for, and ranks waiting on different groups for each other fail within about s + 1 seconds with one
-- error naming what each waits for (ENGINE_COMM_WATCHDOG, default 1; 0 turns it off; the same on every rank).
function M.set_comm_watchdog(seconds)
  if type(seconds) ~= "number" then error("set_comm_watchdog: seconds must be a number", 2) end
  if C.eng_comm_set_watchdog(seconds) ~= 0 then cerr(2) end
end
function M.get_comm_watchdog() return tonumber(C.eng_comm_get_watchdog()) end
-- set_comm_straggler(s): a rank that has waited s seconds in a collective for members that are in no collective
-- (computing, or stuck outside the comm layer) prints once what each member does, and goes on waiting (the job ends
-- at the comm timeout unless they come); the lowest waiting rank of the group prints it (ENGINE_COMM_STRAGGLER,
-- default 30; 0 turns it off).
function M.set_comm_straggler(seconds)
  if type(seconds) ~= "number" then error("set_comm_straggler: seconds must be a number", 2) end
  if C.eng_comm_set_straggler(seconds) ~= 0 then cerr(2) end
end
function M.get_comm_straggler() return tonumber(C.eng_comm_get_straggler()) end

local state_names = { [0] = "issued", "completed", "failed" }

-- dump_collectives([{print = true}]) -> list of the last (up to 64)
-- collectives of this rank, oldest first, and the same as text.
function M.dump_collectives(opts)
  local n = C.eng_comm_history_len()
  local rec = ffi.new("eng_coll_record")
  local list = {}
  for i = 0, n - 1 do
    C.eng_comm_history_get(i, rec)
    local shape = {}
    for d = 0, rec.ndim - 1 do shape[d + 1] = tonumber(rec.shape[d]) end
    local e = {
      id = tonumber(rec.id), seq = tonumber(rec.seq), group = ffi.string(C.eng_comm_history_group_name(i)),
      group_id = tonumber(rec.group_id), group_size = rec.group_size, kind = kinds[rec.kind + 1],
      state = state_names[rec.state], async = rec.async ~= 0,
    }
    if rec.kind ~= 6 and rec.dtype >= 0 then e.dtype = core.dtype_names[rec.dtype]; e.shape = shape end
    if rec.kind == 0 or rec.kind == 2 then e.op = ffi.string(C.eng_reduce_op_name(rec.op)) end
    if rec.kind == 4 or rec.kind == 5 then e.root = rec.root end
    if rec.state ~= 0 then e.ms = 1e3 * (rec.t_end - rec.t_start) end
    list[#list + 1] = e
  end
  local text = ffi.string(C.eng_comm_history_format(0))
  if type(opts) == "table" and opts.print then io.stderr:write(text); io.stderr:flush() end
  return list, text
end

return M
