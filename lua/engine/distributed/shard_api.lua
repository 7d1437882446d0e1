-- engine.distributed.shard_api: PyTorch's module API of torch.distributed._shard.api:
-- shard_parameter, load_with_process_group, shard_module with ShardingPlan and Sharder,
-- _reshard_output, _collect_local_shard, and the state-dict hooks of sharded parameters.
--
--   dist.shard_parameter(model.fc1, "weight", dist.ChunkShardingSpec{dim = 1, placements = ...})
--   dist.shard_module(model, dist.ShardingPlan{
--     plan = {["fc1.weight"] = colwise, ["fc2.weight"] = rowwise, ["emb"] = MySharder{...}},
--     output_plan = {fc2 = dist.ChunkShardingSpec{dim = 1, placements = ...}},
--     return_local_tensor = {"fc2"}}, {src_rank = 0, process_group = nil})
--
-- A sharded parameter whose spec is a DTensor layout (a ChunkShardingSpec naming distinct ranks:
-- Shard(dim) on the 1-D mesh of those ranks) becomes a DTensor Parameter (module.weight is the
-- DTensor, dist.ShardedTensor.from_dtensor(module.weight) its ShardedTensor, sharing storage), and
-- the module's forward runs under dist.implicit_replication (plain inputs and parameters count as
-- Replicate, as PyTorch's sharded ops take a plain input as replicated), so ops go through the
-- DTensor dispatcher and autograd/optimizers work unchanged.  Other specs (several shards on one
-- rank) leave the ShardedTensor itself in module.<name> (the parameter slot is emptied).  Either way
-- module:state_dict() holds the ShardedTensor under the parameter's name and load_state_dict takes
-- one back (same layout, else an error naming both).  output_plan reshards a ShardedTensor output
-- (st:reshard) or a DTensor output (Partial, Shard, Replicate) into the spec's layout, and
-- return_local_tensor returns either's local tensor (module hooks take an object output as one value).
local core = require("engine.core")
local engine = require("engine")
local ffi, C = core.ffi, core.C
local specs = require("engine.distributed.sharding_spec")
local stmod = require("engine.distributed.sharded_tensor")
local ST = stmod.sharded_tensor

local M = {}

local function fail(msg) core.fail(msg) end

local function nn() return require("engine.nn") end
local function dist() return require("engine.distributed") end

-- The name of v's type as the seed's type(tensor).__name__ would give it: a module's class, and Python's
-- names of the Lua types it has (bool, int / float, str).
local PY_TYPE = { boolean = "bool", string = "str", ["nil"] = "NoneType" }
local function tname(v)
  if type(v) == "table" and rawget(v, "_cmod") ~= nil then return v.__name end
  if stmod.is_sharded_tensor(v) then return "ShardedTensor" end
  if type(v) == "number" then return v % 1 == 0 and "int" or "float" end
  return PY_TYPE[type(v)] or type(v)
end

-- ---------------------------------------------------------------- state-dict hooks
-- The ShardedTensor of a module's sharded parameter `name` (from its DTensor, or the stored one).
local function sharded_value(module, name, info)
  local v = module[name]
  if stmod.is_sharded_tensor(v) then return v end
  if v == nil or not dist().is_dtensor(v) then return nil end
  local d = v:detach()
  return setmetatable({ _spec = info.spec, _size = d:shape(), dtype = d.dtype, _pg = info.pg, _dt = d, _mesh = d.device_mesh },
    stmod.ShardedTensor)
end

local function same_layout(a, b)
  local x, y = a:metadata().shards_metadata, b:metadata().shards_metadata
  if #x ~= #y or #a._size ~= #b._size then return false end
  for i = 1, #a._size do if a._size[i] ~= b._size[i] then return false end end
  for i = 1, #x do if x[i] ~= y[i] then return false end end
  return true
end

local function state_dict_hook(module, sd, prefix)
  for name, info in pairs(rawget(module, "_sharded_params")) do
    local st = sharded_value(module, name, info)
    if st then sd[prefix .. name] = st end
  end
end

local function load_pre_hook(module, sd, prefix)
  for name, info in pairs(rawget(module, "_sharded_params")) do
    local key = prefix .. name
    local src = sd[key]
    if stmod.is_sharded_tensor(src) then
      local cur = sharded_value(module, name, info)
      if not same_layout(src, cur) then
        fail(string.format("load_state_dict: %s: the ShardedTensor in the state dict is [%s] %s, the parameter [%s] %s "
          .. "(reshard it first)", key, table.concat(src._size, ","), tostring(src._spec), table.concat(cur._size, ","),
          tostring(cur._spec)))
      end
      local target = module[name]
      if dist().is_dtensor(target) then
        -- the saved local shard as a DTensor of the parameter's layout (no copy here)
        local l = src:local_shards()
        local t = l[1] and l[1].tensor or target:to_local():detach()
        sd[key] = require("engine.distributed.dtensor").DTensor.from_local(t:detach(), target.device_mesh,
          target.placements, { shape = target:shape(), stride = target:stride() })
      else
        local prev = core.C.eng_set_grad_enabled(0)
        local ls, ld = src:local_shards(), target:local_shards()
        for i = 1, #ld do ld[i].tensor:copy_(ls[i].tensor) end
        core.C.eng_set_grad_enabled(prev)
        sd[key] = nil   -- consumed: not a registered parameter, so neither missing nor unexpected
      end
    end
  end
end

-- Records module.<name> as sharded by spec (once per module: the hooks and the forward wrapper).
local function remember(module, name, spec, pg, on_dtensor)
  local reg = rawget(module, "_sharded_params")
  if not reg then
    reg = {}
    rawset(module, "_sharded_params", reg)
    module:_register_state_dict_hook(state_dict_hook)
    module:_register_load_state_dict_pre_hook(load_pre_hook)
  end
  reg[name] = { spec = spec, pg = pg }
  if on_dtensor and not rawget(module, "_sharded_forward") then
    local forward = module.forward
    rawset(module, "_sharded_forward", forward)
    rawset(module, "forward", function(self, ...) return dist().implicit_replication(forward, self, ...) end)
  end
end

-- The ShardedTensor methods that code written for PyTorch calls on module.<name> after shard_parameter
-- (there module.<name> IS the ShardedTensor), set on the DTensor Parameter itself: local_tensor(),
-- local_shards(), metadata(), sharding_spec() and gather(dst [, out]) answer for a ShardedTensor of spec
-- over pg viewing the parameter's current local tensor.  gather(dim, index) with an integer index tensor
-- stays torch.gather.
local tensor_methods = require("engine.tensor").methods
local INDEX_DTYPES = { i64 = true, i32 = true, u8 = true, bool = true }
local function attach_sharded_methods(p, spec, pg)
  local function view(self)
    local d = self:detach()
    return setmetatable({ _spec = spec, _size = d:shape(), dtype = d.dtype, _pg = pg, _dt = d, _mesh = d.device_mesh },
      stmod.ShardedTensor)
  end
  for _, k in ipairs({ "local_tensor", "local_shards", "metadata", "sharding_spec" }) do
    local m = stmod.ShardedTensor[k]
    rawset(p, k, function(self, ...) return m(view(self), ...) end)
  end
  rawset(p, "gather", function(self, a, b)
    if core.is_tensor(b) and INDEX_DTYPES[b.dtype] then return tensor_methods.gather(self, a, b) end
    return view(self):gather(a, b)
  end)
end

-- module.<name> := st's parameter: its DTensor (a leaf Parameter sharing the local shard, answering the
-- ShardedTensor methods) when st's spec is a DTensor layout, else st itself in the slot (the parameter
-- emptied).
local function install(module, name, st, rg)
  local pg = st._pg
  local ranks = ST._dt_layout(st)
  local dt_ok = ranks ~= nil and (pg == nil or pg:size() == dist().world_size() or ST._dt_ready(st) ~= nil)
  module[name] = nil
  rawset(module, name, nil)
  if dt_ok then
    local dt = st:to_dtensor()
    if dt._c.grad_fn ~= nil then dt = dt:detach() end   -- (a reshard's result)
    dt._c.is_param = 1
    if rg then core.check(core.C.eng_tensor_set_requires_grad(dt._c, 1)) end
    attach_sharded_methods(dt, st._spec, pg)
    module[name] = dt
    st._dt = dt
  else
    for _, s in ipairs(st:local_shards()) do s.tensor.requires_grad = rg end
    rawset(module, name, st)
  end
  remember(module, name, st._spec, pg, dt_ok)
end

-- ---------------------------------------------------------------- shard_parameter
-- shard_parameter(module, param_name, spec, {src_rank = 0, process_group}): torch.distributed._shard's.  Collective
-- over the group: the local checks (no such attribute, not a tensor, not contiguous) are agreed with
-- shard_tensor's src_rank/spec checks, so they fail every rank.  Returns the ShardedTensor.
function M.shard_parameter(module, param_name, spec, opts)
  local op = "shard_parameter"
  if not nn().is_module(module) then fail(op .. ": expected a module, got " .. type(module)) end
  if type(param_name) ~= "string" then fail(op .. ": param_name must be a string, got " .. type(param_name)) end
  local err
  local tensor = module[param_name]
  if tensor == nil then err = string.format("%s has no attribute `%s`", module.__name, param_name)
  elseif not core.is_tensor(tensor) then
    err = string.format("Expected %s.%s to be a Tensor, but found %s", module.__name, param_name, tname(tensor))
  elseif not dist().is_dtensor(tensor) and not tensor:is_contiguous() then
    err = string.format("param: %s is not a contiguous Tensor", param_name)
  end
  local st = ST.shard_tensor(tensor, spec, opts, err, op)
  local rg = tensor.requires_grad
  install(module, param_name, st, rg)
  -- st:reshard(spec) is in place (PyTorch's): the module's parameter follows it
  st._on_reshard = function(s) install(module, param_name, s, rg) end
  return st
end

-- ---------------------------------------------------------------- load_with_process_group
local current_active, current_pg = false, nil

-- load_with_process_group(pg, fn, ...): runs fn(pg, ...) with pg as the group ShardedTensors are
-- loaded into (dist.sharded_tensor.load); nesting is an error.  Returns fn's results.
function M.load_with_process_group(pg, fn, ...)
  if type(fn) ~= "function" then fail("load_with_process_group: expected a function to run, got " .. type(fn)) end
  if current_active then
    fail('ProcessGroup already set by previous "load_with_process_group" context manager')
  end
  current_active, current_pg = true, pg
  local res = { pcall(fn, pg, ...) }
  current_active, current_pg = false, nil
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

-- The group set by load_with_process_group, nil for the default (world) group.
function M._get_current_process_group() return current_pg end

-- ---------------------------------------------------------------- save / load
-- dist.sharded_tensor.save(path, sd): every rank writes ITS file (path; "{rank}" in it is replaced by
-- the global rank) holding its plain tensors as they are and, for each ShardedTensor, its local shards
-- ("<key>/shard<i>") plus the global metadata and the group state at save time in the file's metadata
-- ("sharded:<key>": dtype, size, spec, every shard's box and rank, this rank's shard indices, and the
-- local rank, global rank, local world size, global world size).  Not collective.
-- Checksums (format engine-sharded-state/2, "checksum" = "xxh64", as dist.checkpoint's chunks): per
-- tensor "xxh64:t:<name>", XXH64 (16 hex digits) of "<dtype>[<shape>]\0" then its bytes, and per
-- ShardedTensor record "xxh64:m:sharded:<key>", of the record's text; load verifies every one (a
-- flipped byte is an error naming the tensor or record and the file).  Files of format /1 (no
-- checksums) still load.  Device tensors (CUDA shards, plain CUDA tensors) are written as host copies;
-- load puts a ShardedTensor's shards back on the device its placements name (this rank's GPU) and a plain
-- tensor saved from a GPU back on the GPU (record "device:<key>" = "cuda", checksummed like the others).
local function enc_list(l) return table.concat(l, ",") end
local function dec_list(s)
  local r = {}
  if s == "" then return r end
  for x in (s .. ","):gmatch("([^,]*),") do r[#r + 1] = tonumber(x) end
  return r
end

local function rank_path(path, op)
  if type(path) ~= "string" then fail(op .. ": path must be a string, got " .. type(path)) end
  return (path:gsub("{rank}", tostring(dist().rank())))
end

local function encode(st)
  local md = st:metadata()
  local shards, mine = {}, {}
  local me = ST._group_rank(st._pg) or -1
  local gm = ST._gmap(st._pg)
  for i, s in ipairs(md.shards_metadata) do
    shards[i] = enc_list(s.shard_offsets) .. ":" .. enc_list(s.shard_sizes) .. ":" .. tostring(s.placement)
    if gm[s.placement.rank] == me then mine[#mine + 1] = i end
  end
  local spec = st._spec
  local sp
  if getmetatable(spec) == specs.ChunkShardingSpecClass then
    local p = {}
    for i, x in ipairs(spec.placements) do p[i] = tostring(x) end
    sp = "chunk:" .. spec.dim .. ":" .. table.concat(p, ",")
  else
    sp = "enum"
  end
  local pg = st._pg
  return table.concat({ "v1", st.dtype, enc_list(st._size), sp, table.concat(shards, ";"), enc_list(mine),
    enc_list({ me, dist().rank(), ST._world_of(pg), dist().world_size() }) }, "|"), mine
end

local FORMAT_V1, FORMAT = "engine-sharded-state/1", "engine-sharded-state/2"

-- XXH64 of the strings in parts, then of t's bytes (row-major, as the file stores them): 16 hex digits
local function xxh64_hex(parts, t)
  local st = ffi.new("eng_xxh64_state")
  C.eng_xxh64_reset(st)
  for _, p in ipairs(parts) do C.eng_xxh64_update(st, p, #p) end
  if t ~= nil and t:numel() > 0 then
    local c = t:detach()
    if c.device ~= "cpu" then c = c:cpu() end
    c = c:contiguous()
    C.eng_xxh64_update(st, c:data_ptr(), c:numel() * C.eng_dtype_size(c._c.dtype))
  end
  return bit.tohex(C.eng_xxh64_digest(st), 16)
end
local function tensor_sum(t) return xxh64_hex({ t.dtype .. "[" .. table.concat(t:shape(), ",") .. "]\0" }, t) end

-- the host copy a file holds (a CPU tensor as it is)
local function host(t)
  t = t:detach()
  if t.device ~= "cpu" then t = t:to("cpu") end
  return t
end

function ST.save(path, sd)
  local op = "sharded_tensor.save"
  path = rank_path(path, op)
  if type(sd) ~= "table" then fail(op .. ": expected a state dict (a table name -> tensor or ShardedTensor)") end
  local tensors, meta = {}, { format = FORMAT, checksum = "xxh64" }
  for k, v in pairs(sd) do
    if type(k) ~= "string" then fail(op .. ": state dict keys must be strings") end
    if stmod.is_sharded_tensor(v) then
      local enc = encode(v)
      meta["sharded:" .. k] = enc
      for i, s in ipairs(v:local_shards()) do tensors[k .. "/shard" .. i] = host(s.tensor) end
    elseif core.is_tensor(v) then
      if dist().is_dtensor(v) then
        fail(string.format("%s: '%s' is a DTensor: save ShardedTensors and plain tensors here (dist.checkpoint saves "
          .. "DTensors)", op, k))
      end
      if v.device == "cuda" then meta["device:" .. k] = "cuda" end
      tensors[k] = host(v)
    else
      fail(string.format("%s: '%s' is a %s, not a tensor or a ShardedTensor", op, k, type(v)))
    end
  end
  local sums = {}
  for name, t in pairs(tensors) do sums["xxh64:t:" .. name] = tensor_sum(t) end
  for k, v in pairs(meta) do
    if k:match("^sharded:") or k:match("^device:") then sums["xxh64:m:" .. k] = xxh64_hex({ v }) end
  end
  for k, v in pairs(sums) do meta[k] = v end
  engine.save(path, tensors, meta)
end

-- the checksums of a file of format /2 (see save): every tensor and record has one and matches it
local function verify(path, tensors, meta)
  if meta.format == nil or meta.format == FORMAT_V1 then return end -- a plain safetensors file, or an older one
  if meta.format ~= FORMAT or meta.checksum ~= "xxh64" then
    error(string.format("'%s' is not a ShardedTensor state file this engine reads (format %s, checksum %s; expected "
      .. "%s with xxh64, or %s)", path, tostring(meta.format), tostring(meta.checksum), FORMAT, FORMAT_V1), 0)
  end
  local function check(what, want, got)
    if want == nil then
      error(string.format("'%s': %s has no checksum (\"xxh64:\" entry): the file is corrupt", path, what), 0)
    end
    if want ~= got then
      error(string.format("'%s': %s fails its checksum (stored %s, computed %s): the file is corrupt", path, what,
        tostring(want), got), 0)
    end
  end
  local names = {}
  for name in pairs(tensors) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do
    check("tensor '" .. name .. "'", meta["xxh64:t:" .. name], tensor_sum(tensors[name]))
  end
  local keys = {}
  for k in pairs(meta) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do
    if k:match("^sharded:") or k:match("^device:") then
      check("the record '" .. k .. "'", meta["xxh64:m:" .. k], xxh64_hex({ meta[k] }))
    end
    local t = k:match("^xxh64:t:(.*)$")
    if t and tensors[t] == nil then error(string.format("'%s': tensor '%s' is missing from the file", path, t), 0) end
    local m = k:match("^xxh64:m:(.*)$")
    if m and meta[m] == nil then error(string.format("'%s': the record '%s' is missing from the file", path, m), 0) end
  end
end

-- One ShardedTensor from its record (the checks of PyTorch's ShardedTensor.__setstate__, then the
-- shards of this rank).
local function decode(key, enc, tensors, pg)
  local f = {}
  for x in (enc .. "|"):gmatch("([^|]*)|") do f[#f + 1] = x end
  if #f ~= 7 or f[1] ~= "v1" then error(string.format("'%s': unknown ShardedTensor record", key), 0) end
  local st_ = dec_list(f[7])
  -- (outside the group: rank -1, PyTorch's dist.get_rank(pg))
  local lr, gr, lw, gw = ST._group_rank(pg) or -1, dist().rank(), ST._world_of(pg), dist().world_size()
  if st_[1] ~= lr then error(string.format("Local rank at save time was %d, but at load time was %d", st_[1], lr), 0) end
  if st_[2] ~= gr then error(string.format("Global rank at save time was %d, but at load time was %d", st_[2], gr), 0) end
  if st_[3] ~= lw then error(string.format("Local world size at save time was %d, but at load time was %d", st_[3], lw), 0) end
  if st_[4] ~= gw then error(string.format("Global world size at save time was %d, but at load time was %d", st_[4], gw), 0) end
  local size = dec_list(f[3])
  local metas = {}
  for rec in (f[5] .. ";"):gmatch("([^;]*);") do
    local o, z, p = rec:match("^([^:]*):([^:]*):(.*)$")
    metas[#metas + 1] = specs.ShardMetadata{ shard_offsets = dec_list(o), shard_sizes = dec_list(z), placement = p }
  end
  local spec
  local dim, pls = f[4]:match("^chunk:(-?%d+):(.*)$")
  if dim then
    local p = {}
    for x in (pls .. ","):gmatch("([^,]*),") do p[#p + 1] = x end
    spec = specs.ChunkShardingSpec{ dim = tonumber(dim), placements = p }
  else
    spec = specs.EnumerableShardingSpec(metas)
  end
  local md = specs.ShardedTensorMetadata{ shards_metadata = metas, size = size,
    tensor_properties = specs.TensorProperties{ dtype = f[2] } }
  local list = {}
  for i, idx in ipairs(dec_list(f[6])) do
    local t = tensors[key .. "/shard" .. i]
    if t == nil then error(string.format("'%s': local shard %d is missing from the file", key, i), 0) end
    local pl = metas[idx] and metas[idx].placement
    if pl and pl.device ~= "cpu" then
      -- back on this rank's GPU (the placement must name it: the same check as creation)
      local why = ST._cuda_placement_error("sharded_tensor.load: '" .. key .. "'", idx, pl)
      if why then error(why, 0) end
      t = t:to(ST._device_of_kind("cuda"))
    end
    list[i] = { tensor = t, metadata = metas[idx] }
  end
  return setmetatable({ _spec = spec, _metadata = md, _size = size, _shards = list, _pg = pg, dtype = f[2] },
    stmod.ShardedTensor)
end

-- dist.sharded_tensor.load(path) -> the state dict: collective over the group that
-- load_with_process_group set (the world otherwise).  Every rank reads its file and checks that each
-- ShardedTensor was saved by this rank of a group of this size (PyTorch's "Local rank at save time
-- was ..." errors); the outcome is agreed, so a problem on any rank fails every rank of the group (its
-- own message, or naming the rank that failed).  A rank outside the group loads alone (no agreement: it
-- shares no collective with the group), and its ShardedTensors fail as PyTorch's do there: "Local rank
-- at save time was 1, but at load time was -1".
function ST.load(path)
  local op = "sharded_tensor.load"
  path = rank_path(path, op)
  local pg = current_pg
  local member = pg == nil or pg:is_member()
  local sd = {}
  local ok, err = pcall(function()
    local tensors, meta = engine.load(path)
    verify(path, tensors, meta)
    local sharded = {}
    for k, v in pairs(meta) do
      local key = k:match("^sharded:(.*)$")
      if key then sharded[#sharded + 1] = key; sd[key] = decode(key, v, tensors, pg) end
    end
    for k, t in pairs(tensors) do
      local owner = k:match("^(.*)/shard%d+$")
      if not (owner and sd[owner]) then
        if meta["device:" .. k] == "cuda" then t = t:to(ST._device_of_kind("cuda")) end
        sd[k] = t
      end
    end
  end)
  local mine = ok and "" or tostring(err)
  if not member then
    if not ok then fail(op .. ": " .. mine) end
    return sd
  end
  local all = ST._agree_strings(mine, pg, ST._world_of(pg), ST._group_rank(pg))
  if not ok then fail(op .. ": " .. mine) end
  for r = 0, ST._world_of(pg) - 1 do
    if all[r] ~= "" then fail(string.format("%s: rank %d: %s", op, r, all[r])) end
  end
  return sd
end

-- ---------------------------------------------------------------- output hooks
-- The DTensor layout of a spec on a DTensor's mesh: the Shard dim, or an error naming the spec.
local function shard_dim_on(op, spec, t)
  local probe = setmetatable({ _spec = spec, _size = t:shape(), dtype = t.dtype }, stmod.ShardedTensor)
  local ranks, d = ST._dt_layout(probe)
  local mesh = t.device_mesh
  local mr = mesh:ndim() == 1 and mesh:flat_ranks() or nil
  local same = ranks ~= nil and mr ~= nil and #ranks == #mr
  if same then for i = 1, #ranks do same = same and ranks[i] == mr[i] end end
  if not same then
    fail(string.format("%s: %s is not a layout of the output DTensor %s's mesh (a ChunkShardingSpec over its ranks in order)",
      op, tostring(spec), t:_layout_str()))
  end
  return d
end

-- _reshard_output(module, spec): a forward hook that reshards a ShardedTensor output to spec
-- (st:reshard(spec), the seed's), and lays a DTensor output out as spec (Shard(dim) on its 1-D mesh:
-- a Partial output is reduce-scattered, a Shard one all-to-all'd).  Other outputs pass unchanged.
function M._reshard_output(module, spec)
  if not specs.is_sharding_spec(spec) then fail("_reshard_output: resharding_spec must be a ShardingSpec, got " .. type(spec)) end
  module:register_forward_hook(function(_, _, out)
    if stmod.is_sharded_tensor(out) then return out:reshard(spec) end
    if core.is_tensor(out) and dist().is_dtensor(out) then
      local d = shard_dim_on("_reshard_output", spec, out)
      return out:redistribute({ dist().Shard(d) })
    end
    return nil
  end)
  return module
end

-- _collect_local_shard(module): a forward hook returning a sharded output's local tensor (a
-- ShardedTensor's local_tensor(), which errors when this rank holds other than one shard, as the
-- seed's; a DTensor's to_local()), squeezed on the chunk dim when that dim has size 1 there (a [4, 16]
-- output over 4 ranks gives [16] each; a ShardedTensor's only for a ChunkShardingSpec, as the seed's).
function M._collect_local_shard(module)
  module:register_forward_hook(function(_, _, out)
    if stmod.is_sharded_tensor(out) then
      local loc = out:local_tensor()
      local spec = out:sharding_spec()
      if getmetatable(spec) == specs.ChunkShardingSpecClass then
        local d = spec:shard_dim(loc:dim())
        if loc:size(d) == 1 then loc = loc:squeeze(d) end
      end
      return loc
    end
    if core.is_tensor(out) and dist().is_dtensor(out) then
      local s = out._c.dist
      local loc = out:to_local()
      if s.mesh_ndim == 1 and s.placements[0].kind == 1 then
        local d = s.placements[0].dim + 1
        if loc:size(d) == 1 then loc = loc:squeeze(d) end
      end
      return loc
    end
    return nil
  end)
  return module
end

-- ---------------------------------------------------------------- Sharder, ShardingPlan
local Sharder = { __name = "Sharder" }
Sharder.__index = Sharder
M.Sharder = Sharder
local function instantiate(cls, fields) return setmetatable(fields or {}, cls) end
setmetatable(Sharder, { __call = instantiate })

-- Sharder:extend(name) -> a subclass; instances MySharder{...} implement :shard(module) returning
-- the module that replaces `module` in its parent.
function Sharder.extend(parent, name)
  local cls = { __name = name or "Sharder", __parent = parent }
  cls.__index = cls
  return setmetatable(cls, { __index = parent, __call = instantiate })
end
function Sharder:shard(module)
  fail(string.format("%s:shard(module) is not implemented (a Sharder subclass must define it)", self.__name))
end

local function is_sharder(x)
  if type(x) ~= "table" then return false end
  local mt = getmetatable(x)
  while type(mt) == "table" do
    if mt == Sharder then return true end
    mt = rawget(mt, "__parent")
  end
  return false
end
M.is_sharder = is_sharder

local Plan = { __name = "ShardingPlan" }
Plan.__index = Plan
M.ShardingPlanClass = Plan

-- Ordered entries of a plan table: a list of {path, value} pairs in its order, keyed entries sorted
-- by path (Lua tables have no order; every rank must shard in the same order).
local function entries(t, what)
  local list, keyed = {}, {}
  for k, v in pairs(t) do
    if type(k) == "number" then
      if type(v) ~= "table" or type(v[1]) ~= "string" then
        fail(string.format("ShardingPlan: %s entry %d must be a {path, value} pair", what, k))
      end
    elseif type(k) == "string" then keyed[#keyed + 1] = k
    else fail(string.format("ShardingPlan: %s keys must be module paths (strings), got %s", what, type(k))) end
  end
  for i = 1, #t do list[#list + 1] = { t[i][1], t[i][2] } end
  table.sort(keyed)
  for _, k in ipairs(keyed) do list[#list + 1] = { k, t[k] } end
  return list
end

-- ShardingPlan{plan = {path = spec or Sharder}, output_plan = {path = spec}, return_local_tensor = {paths}}
function M.ShardingPlan(opts)
  if type(opts) ~= "table" then fail("ShardingPlan: expected {plan = {...}, output_plan = {...}, return_local_tensor = {...}}") end
  for k in pairs(opts) do
    if k ~= "plan" and k ~= "output_plan" and k ~= "return_local_tensor" then
      fail(string.format("ShardingPlan: unknown field '%s' (plan, output_plan, return_local_tensor)", tostring(k)))
    end
  end
  if type(opts.plan) ~= "table" then fail("ShardingPlan: plan must be a table of module paths to ShardingSpecs or Sharders") end
  if opts.output_plan ~= nil and type(opts.output_plan) ~= "table" then fail("ShardingPlan: output_plan must be a table") end
  local rlt = opts.return_local_tensor
  if rlt ~= nil then
    if type(rlt) ~= "table" then fail("ShardingPlan: return_local_tensor must be a list of module paths") end
    for i, p in ipairs(rlt) do
      if type(p) ~= "string" then fail(string.format("ShardingPlan: return_local_tensor[%d] must be a string", i)) end
    end
  end
  return setmetatable({ plan = entries(opts.plan, "plan"),
    output_plan = opts.output_plan and entries(opts.output_plan, "output_plan") or nil,
    return_local_tensor = rlt }, Plan)
end

local function rpartition(name)
  local a, b = name:match("^(.*)%.([^.]*)$")
  if a then return a, b end
  return "", name
end

-- The local checks of shard_module's plan (no communication): the seed's errors in its order (non-spec
-- plan values, an empty Sharder path, a parameter inside a Sharder's subtree, non-spec output plans) and
-- every module path resolving.  Returns the first error's message or nil, and the plan as text (the
-- same on every rank that was given the same plan).
local function check_plan(module, plan, src_rank)
  local desc = { "src_rank=" .. tostring(src_rank) }
  local sharder_paths = {}
  for _, e in ipairs(plan.plan) do
    if is_sharder(e[2]) then sharder_paths[#sharder_paths + 1] = e[1] end
  end
  local function resolve(path)
    local ok, err = pcall(module.get_submodule, module, path)
    if not ok then error(err, 0) end
  end
  local ok, err = pcall(function()
    for _, e in ipairs(plan.plan) do
      local name, spec = e[1], e[2]
      if specs.is_sharding_spec(spec) then
        desc[#desc + 1] = "plan " .. name .. "=" .. tostring(spec)
        local module_path = rpartition(name)
        for _, sp in ipairs(sharder_paths) do
          -- the seed compares with startswith; a path prefix is what it means ("fc" is not "fc1"'s parent)
          if module_path == sp or module_path:sub(1, #sp + 1) == sp .. "." then
            error(string.format("ShardingPlan is in-valid, trying to shard a parameter: %s, but there's already a "
              .. "Sharder entry for module %s, parameter sharding should not conflict with the submodule tree that a "
              .. "Sharder is working with!", name, sp), 0)
          end
        end
        resolve(module_path)
      elseif is_sharder(spec) then
        desc[#desc + 1] = "plan " .. name .. "=" .. (spec.__name or "Sharder")
        if name == "" then error("Module path must not be empty for custom sharder!", 0) end
        resolve(name)
      else
        error(string.format("Only `ShardingSpec` and `Sharder` are supported to shard '%s'", name), 0)
      end
    end
    for _, e in ipairs(plan.output_plan or {}) do
      if not specs.is_sharding_spec(e[2]) then
        error(string.format("Only `ShardingSpec` is supported as output_plan for '%s'", e[1]), 0)
      end
      desc[#desc + 1] = "output_plan " .. e[1] .. "=" .. tostring(e[2])
      resolve(e[1])
    end
    for _, path in ipairs(plan.return_local_tensor or {}) do
      desc[#desc + 1] = "return_local_tensor " .. path
      resolve(path)
    end
  end)
  return (not ok) and tostring(err) or nil, table.concat(desc, "\n")
end

-- shard_module(module, plan, {src_rank = 0, process_group}): torch.distributed._shard's.  Parameters named by a
-- ShardingSpec are shard_parameter'd, modules named by a Sharder replaced by sharder:shard(mod) in
-- their parent, output_plan and return_local_tensor hooks installed.  Collective over the group.
-- Before any collective, every rank checks its plan locally (check_plan) and one agreement compares the
-- outcome and a hash of the plan and src_rank: a plan error on any rank, or plans that differ, fail
-- every rank (its own message; naming the rank that failed, or the first rank whose plan differs).
-- After each Sharder (user code) one agreement compares the outcome: a Sharder failing on some ranks
-- fails every rank.  (A Sharder whose own checks can fail on one rank before its collectives must
-- agree them itself, as shard_parameter does; else its peers wait in its collective.)
function M.shard_module(module, plan, opts)
  local op = "shard_module"
  if not nn().is_module(module) then fail(op .. ": expected a module, got " .. type(module)) end
  if getmetatable(plan) ~= Plan then fail(op .. ": plan must be a ShardingPlan (dist.ShardingPlan{plan = ...})") end
  opts = opts or {}
  if type(opts) ~= "table" then fail(op .. ": options must be a table") end
  for k in pairs(opts) do
    if k ~= "src_rank" and k ~= "process_group" then
      fail(string.format("%s: unknown option '%s' (src_rank, process_group)", op, tostring(k)))
    end
  end
  local sopts = { src_rank = opts.src_rank or 0, process_group = opts.process_group }
  local pg = sopts.process_group
  local gpg = pg or dist().world_group()
  local C = core.C
  local err, desc = check_plan(module, plan, sopts.src_rank)
  if err then C.eng_set_error_message(err) end
  if C.eng_pg_agree(gpg._c, err and 1 or 0, ST._hash_str(desc), op) ~= 0 then
    -- someone failed or the plans differ: every rank is here; exchange the details for the messages
    local world, me = ST._world_of(pg), ST._group_rank(pg)
    local all = ST._agree_strings(err and ("E" .. err) or ("O" .. desc), pg, world, me)
    if err then fail(err) end
    for r = 0, world - 1 do
      if all[r]:sub(1, 1) == "E" then fail(string.format("%s: rank %d: %s", op, r, all[r]:sub(2))) end
    end
    for r = 0, world - 1 do
      if all[r]:sub(2) ~= desc then
        fail(string.format("%s: the ShardingPlan (or src_rank) on rank %d differs from rank %d's:\n%s\nvs\n%s", op, me, r,
          desc, all[r]:sub(2)))
      end
    end
    fail(op .. ": " .. core.last_error())
  end
  -- a local failure from here on: fail the group's next agreement or collective, then raise
  local function guarded(fn, ...)
    local res = { pcall(fn, ...) }
    if not res[1] then
      C.eng_set_error_message(tostring(res[2]))
      C.eng_pg_agree(gpg._c, 1, 0, op)
      error(res[2], 0)
    end
    return unpack(res, 2, table.maxn(res))
  end
  for _, e in ipairs(plan.plan) do
    local name, spec = e[1], e[2]
    if specs.is_sharding_spec(spec) then
      local module_path, param_name = rpartition(name)
      local mod = module:get_submodule(module_path)
      M.shard_parameter(mod, param_name, spec, { src_rank = sopts.src_rank, process_group = pg })
    else
      local parent_path, mod_name = rpartition(name)
      local mod = module:get_submodule(name)
      local parent = module:get_submodule(parent_path)
      guarded(function()
        local sharded = spec:shard(mod)
        if not nn().is_module(sharded) then
          fail(string.format("%s: %s:shard('%s') must return a module, got %s", op, spec.__name or "Sharder", name, type(sharded)))
        end
        -- the seed's `parent_mod.mod_name = ...` means the child named mod_name (Sequential / ModuleList
        -- children "0", "1", ... live in the array part)
        local k = tonumber(mod_name)
        if k and rawget(parent, k + 1) == mod then parent[k + 1] = sharded else parent[mod_name] = sharded end
      end)
      -- the outcome of the Sharder (user code) before the next entry's collectives
      if C.eng_pg_agree(gpg._c, 0, 0, op) ~= 0 then fail(core.last_error()) end
    end
  end
  for _, e in ipairs(plan.output_plan or {}) do
    M._reshard_output(module:get_submodule(e[1]), e[2])
  end
  for _, module_path in ipairs(plan.return_local_tensor or {}) do
    M._collect_local_shard(module:get_submodule(module_path))
  end
  return module
end

return M
