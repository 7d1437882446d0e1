-- engine.distributed.state_dict: state dicts of FSDP, TP, 2-D and plain models in three forms (PyTorch's
-- torch.distributed.checkpoint.state_dict: get_state_dict / set_state_dict).
--
--   local msd, osd = dist.get_state_dict(model, opt)                        -- sharded DTensors (state_dict())
--   local msd, osd = dist.get_state_dict(model, opt, {full = true, cpu_offload = true, rank0_only = true})
--   local msd, osd = dist.get_state_dict(model, opt, {sharded = true})      -- ShardedTensors (as_sharded_tensor)
--   dist.set_state_dict(model, opt, {model_state_dict = msd, optim_state_dict = osd}, {strict = true})
--
-- Optimizer state dicts are keyed by parameter name (dist.checkpoint.get_optimizer_state_dict's format):
-- {state = {[name] = {step = t, exp_avg = t, ...}}, param_groups = {{lr = ..., params = {names}}}} (step: a 0-dim
-- f32 CPU tensor, as PyTorch's; a number is accepted when loading).
local core = require("engine.core")
local ffi, C = core.ffi, core.C
local engine = require("engine")
local nnmod = require("engine.nn.module")
local Optimizer = require("engine.optim.optimizer")
local dtensor = require("engine.distributed.dtensor")
local comm = require("engine.distributed.comm")
local stmod = require("engine.distributed.sharded_tensor")
local ckpt = require("engine.distributed.checkpoint").checkpoint
local convert = require("engine.distributed.sharded_tensor_convert")

local M = {}
local fail = core.fail
local is_st = stmod.is_sharded_tensor
local is_dt = dtensor.is_dtensor
local layout, runs_box, mesh_coords = convert._layout_of, convert._runs_box, convert._mesh_coords
local st_boxes, st_full = convert._st_boxes, convert._st_full

local function numel(sz)
  local k = 1
  for _, x in ipairs(sz) do k = k * x end
  return k
end

-- Sums a list of integer counts over all ranks (collective over the world; dist.allreduce_counts).
local function allreduce_counts(list)
  local n = #list
  local buf = ffi.new("int64_t[?]", n > 0 and n or 1)
  for i = 1, n do buf[i - 1] = list[i] end
  if C.eng_dist_allreduce_counts(buf, n) ~= 0 then error(core.last_error(), 2) end
  local r = {}
  for i = 1, n do r[i] = tonumber(buf[i - 1]) end
  return r
end

local function free_now(t)
  -- drops this wrapper's reference to the C tensor at once (the Lua collector would keep it until a cycle)
  if type(t) == "table" then
    local c = rawget(t, "_c")
    if c ~= nil then ffi.gc(c, nil); C.eng_tensor_release(c); rawset(t, "_c", nil) end
  end
end
M._free_now = free_now

local function check_opts(opts, known, op)
  if opts == nil then return {} end
  if type(opts) ~= "table" then fail(op .. ": options must be a table") end
  for k in pairs(opts) do
    if not known[k] then
      local names = {}
      for n in pairs(known) do names[#names + 1] = n end
      table.sort(names)
      fail(string.format("%s: unknown option '%s' (%s)", op, tostring(k), table.concat(names, ", ")))
    end
  end
  return opts
end

local GET_OPTS = { full = true, full_state_dict = true, cpu_offload = true, rank0_only = true, sharded = true }

-- The full value of DTensor t gathered straight into one buffer: the mesh members holding distinct shards
-- (coordinate 0 along Replicate dims) broadcast their local shard in turn over the mesh's group (its
-- flattening for 2 dims or more: group rank = row-major coordinate), and each receiver copies the shard's runs
-- into place.  A rank holds the full tensor and one shard at a time (full_tensor()'s redistribute steps hold
-- the gathered pieces and their reordered copies: up to 3x for FSDP over TP).  keep = false (rank0_only on
-- another rank): nothing is assembled and nil is returned, the shards only pass through.  Collective over the
-- mesh (flattening it is collective over the world the first time).
local function gather_full(t, keep)
  local mesh, pl, shape = t.device_mesh, t.placements, t:shape()
  local rep = true
  for _, p in ipairs(pl) do
    if p:is_partial() then return keep and t:full_tensor() or nil end
    if not p:is_replicate() then rep = false end
  end
  if rep then return keep and t:to_local():detach():clone() or nil end
  local group = mesh:ndim() == 1 and mesh:get_group(1) or mesh:flatten():get_group(1)
  local loc = t:to_local():detach()
  local coord = mesh:get_coordinate()
  local opts = { dtype = t.dtype, device = t.device }
  local out = keep and engine.empty(shape, opts) or nil
  for i, c in ipairs(mesh_coords(mesh)) do
    local dup = false
    for d, p in ipairs(pl) do if p:is_replicate() and c[d] ~= 0 then dup = true end end
    if not dup then
      local runs = dtensor.local_shard_runs(shape, mesh, pl, c)
      local lshape, n = {}, 1
      for d, rs in ipairs(runs) do
        local k = 0
        for _, r in ipairs(rs) do k = k + r[2] end
        lshape[d], n = k, n * k
      end
      if n > 0 then
        local mine = true
        for d = 1, #c do if c[d] ~= coord[d] then mine = false end end
        local buf = mine and loc:contiguous() or engine.empty(lshape, opts)
        comm.broadcast(buf, nil, { group = group, group_src = i - 1 })
        if keep then
          -- every combination of runs (one per dim unless a _StridedShard splits it): a box of out
          -- (the views are dropped at once: a view left to the collector keeps the shard's memory)
          local function rec(d, dst, src)
            if d > #runs then dst:copy_(src); return end
            local lo = 0
            for _, r in ipairs(runs[d]) do
              local dv, sv = dst:narrow(d, r[1] + 1, r[2]), src:narrow(d, lo + 1, r[2])
              rec(d + 1, dv, sv)
              free_now(dv); free_now(sv)
              lo = lo + r[2]
            end
          end
          rec(1, out, buf)
        end
        if not rawequal(buf, loc) then free_now(buf) end
      end
    end
  end
  return out
end

-- One tensor in the requested form.  keep = false: the caller drops the result (rank0_only on another rank).
local function form_of(t, o, keep)
  if o.full then
    local full = t
    if is_dt(t) then full = gather_full(t, keep)
    elseif is_st(t) then full = st_full(t) end
    if not keep then
      if not rawequal(full, t) then free_now(full) end
      return nil
    end
    if o.cpu_offload and full.device ~= "cpu" then
      local h = full:to("cpu")
      if not rawequal(full, t) then free_now(full) end
      full = h
    end
    if rawequal(full, t) then full = t:detach() end
    return full
  end
  if o.sharded then
    local r = convert.as_sharded_tensor(t:detach())
    if o.cpu_offload and core.is_tensor(r) and r.device ~= "cpu" then r = r:to("cpu") end
    return r
  end
  if o.cpu_offload and t.device ~= "cpu" then return t:to("cpu") end
  return t:detach()
end

local function param_names(model)
  local name_of, list = {}, {}
  for name, p in model:named_parameters() do
    if name_of[p] == nil then name_of[p] = name end
    list[#list + 1] = { name = name, p = p }
  end
  return name_of, list
end

-- dist.get_state_dict(model, optimizer, {full, cpu_offload, rank0_only, sharded}) -> model_sd, optim_sd
-- (optim_sd nil without an optimizer).  Default: the sharded DTensors (model:state_dict(), the optimizer's
-- states as they are).  full: every DTensor gathered one at a time into a plain full tensor (never more than
-- one full parameter or state per rank at a time; with rank0_only the other ranks drop each at once and get
-- empty tables); cpu_offload: the results on the CPU.  sharded: ShardedTensors (as_sharded_tensor).
-- Collective over the world when full or sharded (every rank calls it).
function M.get_state_dict(model, optimizer, opts)
  local op = "get_state_dict"
  if not nnmod.is_module(model) then fail(op .. ": expected an nn.Module, got " .. type(model)) end
  opts = check_opts(opts, GET_OPTS, op)
  local o = { full = opts.full or opts.full_state_dict, cpu_offload = opts.cpu_offload, sharded = opts.sharded,
    rank0_only = opts.rank0_only }
  if o.full and o.sharded then fail(op .. ": full and sharded are two different forms; ask for one") end
  if o.rank0_only and not o.full then fail(op .. ": rank0_only needs full = true") end
  local keep = not o.rank0_only or comm.world_group():rank() == 0
  local msd = {}
  local sd = model:state_dict()
  engine.no_grad(function()
    for _, name in ipairs(model:state_dict_keys()) do
      local t = sd[name]
      if t ~= nil then
        local r = form_of(t, o, keep)
        if keep then msd[name] = r end
      end
    end
  end)
  if optimizer == nil then return msd, nil end
  local live = ckpt.get_optimizer_state_dict(model, optimizer)
  local osd = { state = {}, param_groups = {} }
  if keep then
    for gi, g in ipairs(live.param_groups) do
      local sg = {}
      for k, v in pairs(g) do sg[k] = type(v) == "table" and { unpack(v) } or v end
      osd.param_groups[gi] = sg
    end
  end
  local _, list = param_names(model)
  local done = {}
  engine.no_grad(function()
    for _, e in ipairs(list) do
      local s = live.state[e.name]
      if s and not done[e.name] then
        done[e.name] = true
        local out = {}
        local keys = {}
        for k in pairs(s) do keys[#keys + 1] = k end
        table.sort(keys)
        for _, k in ipairs(keys) do
          local v = s[k]
          if core.is_tensor(v) then out[k] = form_of(v, o, keep) else out[k] = v end
        end
        if keep then osd.state[e.name] = out end
      end
    end
  end)
  return msd, osd
end

function M.get_model_state_dict(model, opts) return (M.get_state_dict(model, nil, opts)) end
function M.get_optimizer_state_dict(model, optimizer, opts)
  local _, o = M.get_state_dict(model, optimizer, opts)
  return o
end

-- ---- loading
local function same_list(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- The local boxes a source value offers on this rank, or nil when it has none to copy from locally.
local function src_boxes(src)
  if is_st(src) then return st_boxes(src) end
  if is_dt(src) then
    for _, p in ipairs(src.placements) do if p:is_partial() then return nil end end
    local runs = dtensor.local_shard_runs(src:shape(), src.device_mesh, src.placements)
    if runs == nil then return {} end
    local off, sz = runs_box(runs)
    if off == nil then return nil end
    return { { tensor = src:to_local(), offsets = off, sizes = sz } }
  end
  local sh = src:shape()
  local off = {}
  for d = 1, #sh do off[d] = 0 end
  return { { tensor = src, offsets = off, sizes = sh } }
end

local function shape_of(v)
  if is_st(v) then return v:size() end
  return v:shape()
end

-- A plan entry per (destination, source): local = true when this rank can fill its destination shard from
-- its own source boxes.
local function plan_entry(dst, src)
  local e = { dst = dst, src = src }
  if is_dt(dst) and is_dt(src) and C.eng_dist_spec_equal(dst._c.dist, src._c.dist) ~= 0 then
    e.same = true
    e.local_ok = true
    return e
  end
  local druns
  if is_dt(dst) then
    druns = dtensor.local_shard_runs(dst:shape(), dst.device_mesh, dst.placements)
    if druns == nil then e.local_ok = true; e.nothing = true; return e end
  else
    druns = {}
    for d, n in ipairs(dst:shape()) do druns[d] = { { 0, n } } end
  end
  local boxes = src_boxes(src)
  if boxes == nil then e.local_ok = false; return e end
  -- every run product of the destination inside one source box
  local nd = #druns
  local ok = true
  local pieces = {}
  local function rec(d, off, sz)
    if not ok then return end
    if d > nd then
      local found
      for _, b in ipairs(boxes) do
        local inside = true
        for k = 1, nd do
          if sz[k] > 0 and (off[k] < b.offsets[k] or off[k] + sz[k] > b.offsets[k] + b.sizes[k]) then inside = false end
        end
        if inside then found = b; break end
      end
      if not found then
        if numel(sz) > 0 then ok = false end
        return
      end
      pieces[#pieces + 1] = { box = found, off = { unpack(off) }, sz = { unpack(sz) } }
      return
    end
    if #druns[d] == 0 then off[d], sz[d] = 0, 0; rec(d + 1, off, sz); return end
    for _, r in ipairs(druns[d]) do off[d], sz[d] = r[1], r[2]; rec(d + 1, off, sz) end
  end
  rec(1, {}, {})
  e.local_ok = ok
  e.pieces = pieces
  e.druns = druns
  return e
end

-- Copies the pieces of a local plan entry into dst's local shard.
local function copy_local(e)
  local dst = e.dst
  if e.nothing then return end
  if e.same then core.check(C.eng_tensor_copy_(dst._c, e.src._c)); return end
  local dl = is_dt(dst) and dst:to_local() or dst
  -- local position of each global run start per dim
  local lpos = {}
  for d, runs in ipairs(e.druns) do
    local m, acc = {}, 0
    for _, r in ipairs(runs) do m[r[1]] = acc; acc = acc + r[2] end
    lpos[d] = m
  end
  for _, pc in ipairs(e.pieces) do
    if numel(pc.sz) > 0 then
      local a, b = dl, pc.box.tensor
      for d = 1, #pc.sz do
        a = a:narrow(d, lpos[d][pc.off[d]] + 1, pc.sz[d])
        b = b:narrow(d, pc.off[d] - pc.box.offsets[d] + 1, pc.sz[d])
      end
      a:copy_(b)
    end
  end
end

-- Fills dst from the full tensor (this rank's part).
local function copy_from_full(dst, full)
  if is_dt(dst) then
    local d = dtensor.distribute_tensor(full, dst.device_mesh, dst.placements, { src_data_rank = false })
    core.check(C.eng_tensor_copy_(dst._c, d._c))
    if not rawequal(d, full) then free_now(d) end
  else
    dst:copy_(full)
  end
end

local function agree(err, op)
  local g = comm.world_group()
  if g:size() > 1 then
    if err then C.eng_set_error_message(err) end
    local rc = C.eng_pg_agree(g._c, err and 1 or 0, 0, op)
    if rc ~= 0 then error(core.last_error(), 0) end
  elseif err then
    error(err, 0)
  end
end

-- Loads the list of {dst, src, name} (checked already): local copies where every rank can make them (one
-- agreement of the flags), else the full tensor of the source, one at a time.
local function load_pairs(items, bcast)
  if bcast then
    -- rank 0 holds full tensors: each is broadcast in the destination's dtype, every rank keeps its part
    local me = comm.world_group():rank()
    engine.no_grad(function()
      for _, it in ipairs(items) do
        local dst = it.dst
        local buf
        if me == 0 then buf = it.src:to(dst.dtype):contiguous()
        else buf = engine.empty(dst:shape(), { dtype = dst.dtype }) end
        comm.broadcast(buf, 0)
        copy_from_full(dst, buf)
        if not rawequal(buf, it.src) then free_now(buf) end
      end
    end)
    return
  end
  -- a full (plain) source or one of the destination's own layout is local on every rank: no agreement needed;
  -- the others' flags are summed over the ranks (one all_reduce for all of them)
  local plans, flags, unsure, all = {}, {}, {}, {}
  for i, it in ipairs(items) do
    local e = plan_entry(it.dst, it.src)
    plans[i] = e
    if e.same or not (is_dt(it.src) or is_st(it.src)) then all[i] = 0
    else
      unsure[#unsure + 1] = i
      flags[#flags + 1] = e.local_ok and 0 or 1
    end
  end
  if #flags > 0 then
    local sums = allreduce_counts(flags)
    for j, i in ipairs(unsure) do all[i] = sums[j] end
  end
  engine.no_grad(function()
    for i, e in ipairs(plans) do
      if all[i] == 0 then copy_local(e)
      else
        local src = e.src
        local full
        if is_st(src) then full = st_full(src, e.dst.dtype)
        elseif is_dt(src) then full = src:full_tensor()
        else full = src end
        copy_from_full(e.dst, full)
        if not rawequal(full, src) then free_now(full) end
      end
    end
  end)
end

local SET_OPTS = { strict = true, broadcast_from_rank0 = true }

-- broadcast_from_rank0: rank 0's state dict reduced to names, shapes and plain values (a string all ranks
-- receive); the other ranks stand meta tensors of those shapes in for the tensors.  Collective.
local function skeleton_exchange(sds, op)
  local g = comm.world_group()
  local me = g:rank()
  local mine = ""
  if me == 0 then
    local ok, r = pcall(function()
      if type(sds) ~= "table" then error(op .. ": expected {model_state_dict = ..., optim_state_dict = ...}", 0) end
      local function sk(v, key)
        if key == "step" and core.is_tensor(v) and not is_dt(v) and v:numel() == 1 then return v:item() end
        if is_st(v) or core.is_tensor(v) then return { ["\1T"] = shape_of(v) } end
        if type(v) == "table" then
          local r = {}
          for k, x in pairs(v) do r[k] = sk(x, k) end
          return r
        end
        return v
      end
      return "O" .. ckpt._serialize({ m = sk(sds.model_state_dict), o = sk(sds.optim_state_dict) }, op)
    end)
    mine = ok and r or ("E" .. tostring(r))
  end
  local all = stmod.sharded_tensor._agree_strings(mine, g, g:size(), me)
  local s = all[0]
  if s:sub(1, 1) == "E" then return nil, s:sub(2) end
  if me == 0 then return sds end
  local skel = ckpt._deserialize(s:sub(2), "broadcast_from_rank0")
  local function un(v)
    if type(v) == "table" then
      if v["\1T"] then return engine.empty(v["\1T"], { device = "meta" }) end
      local r = {}
      for k, x in pairs(v) do r[k] = un(x) end
      return r
    end
    return v
  end
  return { model_state_dict = un(skel.m), optim_state_dict = un(skel.o) }
end

local function describe(v)
  if v == nil then return "nothing" end
  if is_st(v) or core.is_tensor(v) then return layout(v) end
  return type(v)
end

-- dist.set_state_dict(model, optimizer, {model_state_dict = sd, optim_state_dict = osd}, {strict = true}):
-- loads a state dict of any of the three forms (DTensors of any layout, full tensors, ShardedTensors),
-- saved from a model of any layout, into model (and optimizer: states follow their parameter's layout,
-- keyed by parameter name).  Every rank checks names and shapes first and the ranks agree before anything
-- is copied; a full tensor into a DTensor takes this rank's part without communication, a source of another
-- layout is gathered one tensor at a time.  Collective over the world.
function M.set_state_dict(model, optimizer, sds, opts)
  local op = "set_state_dict"
  local err
  local items = {}
  local strict = true
  local bcast = type(opts) == "table" and opts.broadcast_from_rank0 == true
  local is0 = comm.world_group():rank() == 0
  if bcast then sds, err = skeleton_exchange(sds, op) end
  local ok, perr = pcall(function()
    if err then error(err, 0) end
    if not nnmod.is_module(model) then error(op .. ": expected an nn.Module, got " .. type(model), 0) end
    if type(sds) ~= "table" then error(op .. ": expected {model_state_dict = ..., optim_state_dict = ...}", 0) end
    for k in pairs(sds) do
      if k ~= "model_state_dict" and k ~= "optim_state_dict" then
        error(string.format("%s: unknown field '%s' (model_state_dict, optim_state_dict)", op, tostring(k)), 0)
      end
    end
    if opts ~= nil and type(opts) ~= "table" then error(op .. ": options must be a table", 0) end
    for k in pairs(opts or {}) do
      if not SET_OPTS[k] then
        error(string.format("%s: unknown option '%s' (strict, broadcast_from_rank0)", op, tostring(k)), 0)
      end
    end
    strict = not (opts and opts.strict == false)
    local problems = {}
    local msd = sds.model_state_dict
    if msd ~= nil then
      if type(msd) ~= "table" or is_st(msd) or core.is_tensor(msd) then
        error(op .. ": model_state_dict must be a table name -> tensor", 0)
      end
      local cur = model:state_dict({ keep_vars = true })
      local known = {}
      for _, name in ipairs(model:state_dict_keys()) do
        known[name] = true
        local dst, src = cur[name], msd[name]
        if src == nil then
          if strict then problems[#problems + 1] = "missing key " .. name end
        elseif not (is_st(src) or core.is_tensor(src)) then
          problems[#problems + 1] = string.format("%s is a %s, not a tensor", name, type(src))
        elseif bcast and is0 and (is_st(src) or is_dt(src)) then
          problems[#problems + 1] = string.format("%s is a %s: broadcast_from_rank0 loads full tensors (get_state_dict "
            .. "with full = true)", name, describe(src))
        elseif not same_list(shape_of(src), dst:shape()) then
          problems[#problems + 1] = string.format("%s: shape [%s] (%s) does not match the model's [%s] (%s)", name,
            table.concat(shape_of(src), ","), describe(src), table.concat(dst:shape(), ","), describe(dst))
        else
          items[#items + 1] = { dst = dst, src = src, name = name }
        end
      end
      if strict then
        local unexpected = {}
        for k in pairs(msd) do if not known[k] then unexpected[#unexpected + 1] = tostring(k) end end
        table.sort(unexpected)
        if #unexpected > 0 then problems[#problems + 1] = "unexpected key(s) " .. table.concat(unexpected, ", ") end
      end
    end
    local osd = sds.optim_state_dict
    if osd ~= nil then
      if optimizer == nil then error(op .. ": optim_state_dict given without an optimizer", 0) end
      if type(osd) ~= "table" or type(osd.state) ~= "table" or type(osd.param_groups) ~= "table" then
        error(op .. ": optim_state_dict must be {state = {[name] = {...}}, param_groups = {...}} (dist.get_state_dict)", 0)
      end
      for k in pairs(osd.state) do
        if type(k) ~= "string" then
          error(string.format("%s: optim_state_dict.state is keyed by %s %s; states are keyed by parameter name "
            .. "(dist.get_state_dict or dist.checkpoint.get_optimizer_state_dict)", op, type(k), tostring(k)), 0)
        end
      end
      local name_of = param_names(model)
      if #osd.param_groups ~= #optimizer.param_groups then
        problems[#problems + 1] = string.format("optim_state_dict has %d parameter groups, the optimizer %d",
          #osd.param_groups, #optimizer.param_groups)
      end
      local ostate = {}
      for gi, g in ipairs(optimizer.param_groups) do
        local sg = osd.param_groups[gi]
        local in_sd = {}
        for _, n in ipairs(sg and sg.params or {}) do in_sd[n] = true end
        for _, p in ipairs(g.params) do
          local name = name_of[p]
          if not name then error(string.format("%s: a parameter of optimizer group %d is not in the model", op, gi), 0) end
          if sg and not in_sd[name] then
            problems[#problems + 1] = string.format("parameter '%s' is in optimizer group %d but not in that group of "
              .. "optim_state_dict", name, gi)
          end
          local s = osd.state[name]
          if s ~= nil then
            local st = {}
            -- sorted: every rank must gather the states in the same order (pairs order may differ per rank)
            local keys = {}
            for k in pairs(s) do keys[#keys + 1] = k end
            table.sort(keys, function(x, y) return tostring(x) < tostring(y) end)
            for _, k in ipairs(keys) do
              local v = s[k]
              if (is_st(v) or core.is_tensor(v)) and k ~= "step" then
                if bcast and is0 and (is_st(v) or is_dt(v)) then
                  problems[#problems + 1] = string.format("optimizer state '%s' of %s is a %s: broadcast_from_rank0 "
                    .. "loads full tensors", k, name, describe(v))
                elseif not same_list(shape_of(v), p:shape()) then
                  problems[#problems + 1] = string.format("optimizer state '%s' of %s: shape [%s] does not match the "
                    .. "parameter's [%s]", k, name, table.concat(shape_of(v), ","), table.concat(p:shape(), ","))
                else
                  local cur = optimizer.state[p] and optimizer.state[p][k]
                  local dst = cur
                  local fits = core.is_tensor(cur) and cur.dtype == p.dtype and same_list(cur:shape(), p:shape())
                  if fits and is_dt(p) then fits = is_dt(cur) and C.eng_dist_spec_equal(cur._c.dist, p._c.dist) ~= 0
                  elseif fits then fits = not is_dt(cur) end
                  if not fits then
                    dst = Optimizer._zeros_like(p)
                  end
                  st[k] = dst
                  items[#items + 1] = { dst = dst, src = v, name = name .. "." .. k }
                end
              elseif core.is_tensor(v) then
                if v:numel() ~= 1 then
                  problems[#problems + 1] = string.format("optimizer state '%s' of %s has %d elements, expected a number",
                    k, name, v:numel())
                else
                  -- the step count: the optimizer's own 0-dim f32 CPU tensor (PyTorch's), holding the value
                  st[k] = Optimizer._step_tensor(is_dt(v) and v:full_tensor() or v)
                end
              elseif is_st(v) then
                problems[#problems + 1] = string.format("optimizer state '%s' of %s: a ShardedTensor step", k, name)
              elseif k == "step" and type(v) == "number" then
                st[k] = Optimizer._step_tensor(v)
              else
                st[k] = v
              end
            end
            ostate[p] = st
          end
        end
      end
      items.ostate = ostate
    end
    if #problems > 0 then
      error(string.format("%s: error(s) loading the state dict into %s:\n\t%s", op, model.__name, table.concat(problems, "\n\t")), 0)
    end
  end)
  if not ok then err = tostring(perr) end
  agree(err, op)
  local ostate = items.ostate
  items.ostate = nil
  load_pairs(items, bcast)
  if ostate then
    local osd = sds.optim_state_dict
    for gi, g in ipairs(optimizer.param_groups) do
      for k, v in pairs(osd.param_groups[gi]) do
        if k ~= "params" then g[k] = type(v) == "table" and { unpack(v) } or v end
      end
    end
    for p, st in pairs(ostate) do
      local cur = optimizer.state[p] or {}
      for k, v in pairs(st) do cur[k] = v end
      optimizer.state[p] = cur
    end
  end
end

function M.set_model_state_dict(model, sd, opts) return M.set_state_dict(model, nil, { model_state_dict = sd }, opts) end
function M.set_optimizer_state_dict(model, optimizer, osd, opts)
  return M.set_state_dict(model, optimizer, { optim_state_dict = osd }, opts)
end

return M