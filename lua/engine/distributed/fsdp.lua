-- engine.distributed.fsdp: fully sharded data parallelism (PyTorch's FSDP2 `fully_shard`).
--
--   for _, block in ipairs(model.layers:children()) do dist.fully_shard(block, {mesh = mesh}) end
--   dist.fully_shard(model, {mesh = mesh})            -- bottom-up: blocks first, then the root
--   local loss = F.cross_entropy(model(x_local), y_local); loss:backward(); opt:step()
--
-- Each call makes one parameter group of the module's parameters not already owned by a nested call.
-- Parameters become Shard(1) DTensor Parameters on the mesh (PyTorch's Shard(0); [Replicate, Shard(1)] on a
-- 2-D (replicate, shard) mesh: HSDP), or the Shard dim shard_placement_fn(param) returns.  The group's
-- all-gather, reshard and reduce-scatter run from C hooks on the module object (engine/src/fsdp/fsdp.c,
-- engine/include/eng/fsdp.h); Lua takes part only at module boundaries: the root's lazy init on its first
-- forward, and the parameter lookup (a module of a group gives `self.weight` as the unsharded tensor while
-- the group is unsharded, the sharded DTensor otherwise).
local core = require("engine.core")
local ffi, C = core.ffi, core.C
local meshmod = require("engine.distributed.mesh")
local dtensor = require("engine.distributed.dtensor")
local P = require("engine.distributed.placements")
local nnmod = require("engine.nn.module")

local M = {}
local fail = core.fail
local tp_layout

-- ---------------------------------------------------------------- policies
local MixedPrecisionPolicy = { __name = "MixedPrecisionPolicy" }
MixedPrecisionPolicy.__index = MixedPrecisionPolicy
MixedPrecisionPolicy.__tostring = function(p)
  return string.format("MixedPrecisionPolicy(param_dtype=%s, reduce_dtype=%s, output_dtype=%s, cast_forward_inputs=%s)",
    tostring(p.param_dtype), tostring(p.reduce_dtype), tostring(p.output_dtype), tostring(p.cast_forward_inputs))
end

-- dist.MixedPrecisionPolicy{param_dtype, reduce_dtype, output_dtype, cast_forward_inputs = true}
function M.MixedPrecisionPolicy(o)
  o = o or {}
  if type(o) ~= "table" then fail("MixedPrecisionPolicy: expected an options table") end
  local p = setmetatable({ cast_forward_inputs = o.cast_forward_inputs ~= false }, MixedPrecisionPolicy)
  for _, k in ipairs({ "param_dtype", "reduce_dtype", "output_dtype" }) do
    if o[k] ~= nil then
      local code = core.dtype(o[k], "MixedPrecisionPolicy", 3)
      if C.eng_dtype_is_floating(code) == 0 then
        fail(string.format("MixedPrecisionPolicy: %s must be a floating dtype, got %s", k, tostring(o[k])))
      end
      p[k] = o[k]
    end
  end
  for k in pairs(o) do
    if k ~= "param_dtype" and k ~= "reduce_dtype" and k ~= "output_dtype" and k ~= "cast_forward_inputs" then
      fail("MixedPrecisionPolicy: unknown option '" .. tostring(k) .. "'")
    end
  end
  return p
end

local OffloadPolicy = { __name = "OffloadPolicy" }
OffloadPolicy.__index = OffloadPolicy
OffloadPolicy.__tostring = function(p) return p.cpu and ("CPUOffloadPolicy(pin_memory=" .. tostring(p.pin_memory) .. ")") or "OffloadPolicy()" end
function M.OffloadPolicy() return setmetatable({ cpu = false }, OffloadPolicy) end
-- dist.CPUOffloadPolicy{pin_memory = true}: sharded parameters, gradients and the optimizer step on the CPU.
function M.CPUOffloadPolicy(o)
  o = o or {}
  return setmetatable({ cpu = true, pin_memory = o.pin_memory ~= false }, OffloadPolicy)
end

-- ---------------------------------------------------------------- helpers
local function class_chain_has(m, name)
  local c = getmetatable(m)
  while c do
    if rawget(c, "__name") == name then return true end
    c = rawget(c, "__parent")
  end
  return false
end

local function ptr_key(c) return tonumber(ffi.cast("intptr_t", c)) end

local default_mesh
local function get_default_mesh()
  if not default_mesh then
    default_mesh = meshmod.init_device_mesh("cpu", { C.eng_dist_world_size() })
  end
  return default_mesh
end

local function is_fsdp(m) return type(m) == "table" and rawget(m, "_fsdp") ~= nil end
M.is_fsdp_module = is_fsdp

-- parameters converted by some fully_shard call (the original Parameter objects, weak: a module still holding
-- one is a tie across two groups) -> the FSDP module
local converted = setmetatable({}, { __mode = "k" })
-- the sharded DTensor parameters a fully_shard call registered -> its FSDP module (weak): a later fully_shard
-- that meets one was called on a submodule after its ancestor (FSDP2 shards bottom-up)
local sharded_by = setmetatable({}, { __mode = "k" })

-- FNV-1a of a string, as a number below 2^52 (exact in a double)
local function hash_str(s)
  local h = 2166136261
  for i = 1, #s do h = bit.bxor(h, s:byte(i)); h = (h * 16777619) % 4294967296 end
  return h
end

-- ---------------------------------------------------------------- the FSDP class of a module class
local FSDPModule = {}
M.FSDPModule = FSDPModule
local fsdp_classes = setmetatable({}, { __mode = "k" })

local function group_of(self, op)
  local st = rawget(self, "_fsdp")
  if not st then fail((op or "FSDPModule") .. ": not an FSDP module (call dist.fully_shard on it first)") end
  return st
end

local function each_fsdp(self, recurse, fn)
  if recurse == false then fn(self, rawget(self, "_fsdp")); return end
  for _, m in ipairs(self:modules()) do
    local st = rawget(m, "_fsdp")
    if st then fn(m, st) end
  end
end

local function recurse_opt(o)
  if type(o) == "table" then return o.recurse end
  return o
end

function FSDPModule.reshard(self)
  core.check(C.eng_fsdp_group_reshard(group_of(self, "reshard").group), 2)
end

local UnshardHandle = {}
UnshardHandle.__index = UnshardHandle
function UnshardHandle:wait()
  if self._g then core.check(C.eng_fsdp_group_wait_unshard(self._g), 2) end
end

-- unshard{async_op = false}: all-gathers now; with async_op a handle whose :wait() finishes it (the
-- module's next forward waits for it by itself).  It does not make the module a root (the seed's
-- unshard initializes only the parameter group): a block unsharded before the first forward stays a block.
function FSDPModule.unshard(self, opts)
  local st = group_of(self, "unshard")
  local async = type(opts) == "table" and opts.async_op or false
  core.check(C.eng_fsdp_group_unshard(st.group, async and 1 or 0), 2)
  local h = setmetatable({ _g = st.group }, UnshardHandle)
  if async then return h end
  h:wait()
  return nil
end

-- set_is_last_backward(false): the root's end of backward does not wait for the reductions still in flight
-- (reduce-scatters left async: set_overlap{async_reduce = true}, the CUDA default; on a CPU mesh each
-- reduce-scatter is finished in its own post-backward, so nothing is left to skip) nor for prefetched
-- all-gathers: their gradients reach .grad in the next backward or at wait_for_reductions().  The flag is
-- the tree's (the seed keeps it in the shared state context): set on the root, or on any module of the tree.
function FSDPModule.set_is_last_backward(self, flag)
  local v = flag and 1 or 0
  each_fsdp(self, true, function(_, st) C.eng_fsdp_group_set_is_last_backward(st.group, v) end)
  local root = group_of(self, "set_is_last_backward").root
  if root then C.eng_fsdp_group_set_is_last_backward(root.group, v) end
end

-- wait_for_reductions() (engine extension): finishes the reductions a non-last backward left in flight in
-- this module's FSDP tree, so that .grad holds them (before an optimizer step or a gradient read).
function FSDPModule.wait_for_reductions(self)
  core.check(C.eng_fsdp_group_wait_reductions(group_of(self, "wait_for_reductions").group), 2)
end

function FSDPModule.set_requires_gradient_sync(self, flag, opts)
  each_fsdp(self, recurse_opt(opts), function(_, st)
    C.eng_fsdp_group_set_requires_gradient_sync(st.group, flag and 1 or 0)
    C.eng_fsdp_group_set_requires_all_reduce(st.group, flag and 1 or 0)
  end)
end

function FSDPModule.set_requires_all_reduce(self, flag, opts)
  each_fsdp(self, recurse_opt(opts), function(_, st)
    C.eng_fsdp_group_set_requires_all_reduce(st.group, flag and 1 or 0)
  end)
end

function FSDPModule.set_reshard_after_backward(self, flag, opts)
  each_fsdp(self, recurse_opt(opts), function(_, st)
    C.eng_fsdp_group_set_reshard_after_backward(st.group, flag and 1 or 0)
  end)
end

-- The C value of reshard_after_forward over a shard group of W ranks: 1 reshard (true), 0 keep (false), N > 1
-- reshard to N ranks.  An integer is the world size to reshard to, as the seed reads it
-- (_get_post_forward_mesh_info): a factor of W; 1 means false (said once) and W means true.
local function raf_value(v, op, W)
  if v == nil or v == true then return 1 end
  if v == false then return 0 end
  if type(v) ~= "number" or v % 1 ~= 0 or v < 1 then
    fail(string.format("%s: reshard_after_forward must be true, false or an integer world size, got %s", op, tostring(v)))
  end
  if not W then return v end
  if v > W or W % v ~= 0 then
    fail(string.format("%s: if passing reshard_after_forward as an int, it should be a factor of %d, not %d (the world "
      .. "size to reshard to after forward: a non-trivial divisor of the shard dim size %d)", op, W, v, W))
  end
  if v == 1 then
    if not M._said_raf1 then
      M._said_raf1 = true
      io.stderr:write("fully_shard: reshard_after_forward=1 (int) means resharding parameters to world size 1, "
        .. "instead of reshard_after_forward=True (bool): treated as False\n")
    end
    return 0
  end
  if v == W then return 1 end
  return v
end

-- The (dp/N, N) post-forward mesh of reshard_after_forward = N over mesh's ranks (collective: made once per
-- mesh and N, on every rank); its dim 2 groups are runs of N consecutive ranks of each shard group.
local post_meshes = setmetatable({}, { __mode = "k" })
local function post_mesh(mesh, N)
  if N <= 1 then return nil end
  local W = mesh:size(mesh:ndim())
  if N >= W or W % N ~= 0 then return nil end  -- the C check names the error
  local per = post_meshes[mesh]
  if not per then per = {}; post_meshes[mesh] = per end
  if per[N] then return per[N] end
  local flat = mesh:flat_ranks()
  local rows = {}
  for i = 1, #flat, N do
    local r = {}
    for j = 0, N - 1 do r[j + 1] = flat[i + j] end
    rows[#rows + 1] = r
  end
  local dev = C.eng_mesh_device(mesh._c) == 1 and "cuda" or "cpu"
  per[N] = meshmod.DeviceMesh(dev, rows)
  return per[N]
end

local function set_raf(st, v, level)
  local pm = post_mesh(st.mesh, v)
  core.check(C.eng_fsdp_group_set_reshard_after_forward(st.group, v, pm and pm._c or nil), level + 1)
  st.post_mesh = pm
end

-- set_reshard_after_forward(value [, {recurse = true}]): on the root too (an explicit value is honoured there,
-- as FSDP2 does since 2.7: only the default leaves the root unsharded after forward)
function FSDPModule.set_reshard_after_forward(self, value, opts)
  raf_value(value, "set_reshard_after_forward")
  each_fsdp(self, recurse_opt(opts), function(m, st)
    set_raf(st, raf_value(value, "set_reshard_after_forward", st.mesh:size(st.mesh:ndim())), 4)
    st.reshard_after_forward = value
    st.raf_auto = false
  end)
end

local function group_list(list, op)
  if type(list) ~= "table" then fail(op .. ": expected a list of FSDP modules") end
  local arr = ffi.new("eng_fsdp_group*[?]", math.max(#list, 1))
  for i, m in ipairs(list) do
    if not is_fsdp(m) then
      fail(string.format("%s: entry %d is not an FSDP module (got %s)", op, i, type(m) == "table" and (m.__name or "a table") or type(m)))
    end
    arr[i - 1] = rawget(m, "_fsdp").group
  end
  return arr, #list
end

function FSDPModule.set_modules_to_forward_prefetch(self, list)
  local arr, n = group_list(list, "set_modules_to_forward_prefetch")
  core.check(C.eng_fsdp_group_set_forward_prefetch(group_of(self).group, n, arr), 2)
  group_of(self).fwd_prefetch = list  -- keep the groups alive
end

function FSDPModule.set_modules_to_backward_prefetch(self, list)
  local arr, n = group_list(list, "set_modules_to_backward_prefetch")
  core.check(C.eng_fsdp_group_set_backward_prefetch(group_of(self).group, n, arr), 2)
  group_of(self).bwd_prefetch = list
end

-- set_post_optim_event(event): the seed's root waits its all-gather streams on this event (recorded after the
-- optimizer step) instead of on the whole current stream, then drops it.  Here it is accepted and dropped at
-- the root's next forward, with nothing to wait for: on a CPU mesh collectives run in program order; on a CUDA
-- mesh the runtime has no event objects (engine/include/eng/cuda.h) and every NCCL collective's stream already
-- waits for all the work queued on the compute stream (comm/nccl.c, eng_cuda_stream_wait), the optimizer
-- step included, so the next forward's all-gathers are ordered after the step either way (the false
-- dependency the event avoids in PyTorch stays).
function FSDPModule.set_post_optim_event(self, event)
  local st = group_of(self, "set_post_optim_event")
  local root = st.root or st
  root.post_optim_event = event
end

-- set_overlap{implicit_prefetch = bool, async_reduce = bool, recurse = true} (engine extension): implicit
-- prefetch of the next group's all-gather and reduce-scatters left in flight until the end of backward; on by
-- default on CUDA meshes, off on CPU meshes, where MPI has no progress thread and both only hold memory
-- (docs/design.md, "FSDP").
function FSDPModule.set_overlap(self, o)
  if type(o) ~= "table" then fail("set_overlap: expected {implicit_prefetch = bool, async_reduce = bool}") end
  local function v(x) if x == nil then return -1 end return x and 1 or 0 end
  each_fsdp(self, o.recurse, function(_, st)
    core.check(C.eng_fsdp_group_set_overlap(st.group, v(o.implicit_prefetch), v(o.async_reduce)), 4)
  end)
end

function FSDPModule.set_gradient_divide_factor(self, factor)
  if type(factor) ~= "number" or factor <= 0 then
    fail("set_gradient_divide_factor: expected a positive number, got " .. tostring(factor))
  end
  each_fsdp(self, true, function(_, st) C.eng_fsdp_group_set_gradient_divide_factor(st.group, factor) end)
end

function FSDPModule.__deepcopy()
  error("FSDP does not support deepcopy. Please use state dict for serialization.", 2)
end
FSDPModule.deepcopy = FSDPModule.__deepcopy
FSDPModule.clone = FSDPModule.__deepcopy

-- Root lazy init: the first FSDP module whose forward runs (outermost) becomes the root of every FSDP
-- module under it that has no root yet.  The root keeps its parameters after forward (its backward would
-- all-gather them at once) only when its reshard_after_forward is the default (nil, never set): an explicit
-- true / integer, given to fully_shard or set by set_reshard_after_forward, is honoured (FSDP2's
-- _auto_reshard_after_forward).
function M._lazy_init(self)
  local st = rawget(self, "_fsdp")
  if st.root then return end
  for _, m in ipairs(self:modules()) do
    local s = rawget(m, "_fsdp")
    if s and not s.root then
      s.root = st
      core.check(C.eng_fsdp_group_set_root(s.group, st.group), 3)
    end
  end
  st.is_root = true
  if st.raf_auto then set_raf(st, 0, 2) end
end

local function fsdp_call(self, ...)
  local st = rawget(self, "_fsdp")
  if not st.root then M._lazy_init(self) end
  if st.is_root then st.post_optim_event = nil end  -- used once (see set_post_optim_event)
  return st.module_call(self, ...)
end

local function fsdp_class(cls)
  local fc = fsdp_classes[cls]
  if fc then return fc end
  fc = cls:extend("FSDP" .. tostring(rawget(cls, "__name") or cls.__name))
  for k, v in pairs(FSDPModule) do fc[k] = v end
  fc.__call = fsdp_call
  fsdp_classes[cls] = fc
  return fc
end

-- Runs a group's forward-pre (post) hook over the tensors of list[1..n] (C: eng_fsdp_group_pre_forward /
-- post_forward), putting back the tensors it replaced (inputs moved or cast; outputs armed for backward).
local function run_group_hook(fn, group, list, n)
  local pos = {}
  for i = 1, n do if core.is_tensor(list[i]) then pos[#pos + 1] = i end end
  local k = #pos
  local arr = ffi.new("eng_tensor*[?]", math.max(k, 1))
  for j = 1, k do arr[j - 1] = C.eng_tensor_retain(list[pos[j]]._c) end
  local rc = fn(group, arr, k)
  local msg = rc ~= 0 and core.last_error() or nil
  for j = 1, k do
    local c, orig = arr[j - 1], list[pos[j]]
    if c == orig._c then C.eng_tensor_release(c) else list[pos[j]] = core.wrap(c) end
  end
  if msg then fail(msg, 3) end
end
jit.off(run_group_hook)

-- dist.register_fsdp_forward_method(module, "generate"): the FSDP hooks wrap module:generate(...) too: the
-- forward-pre hook gets the method's arguments, the forward-post hook its outputs (a list of tensors is
-- hooked element-wise, as in nn.Module's __call), so a backward through them all-gathers again.  On a module
-- that is not an FSDP module it does nothing (the seed's no-op).
function M.register_fsdp_forward_method(module, name)
  if not is_fsdp(module) then return end
  local st = rawget(module, "_fsdp")
  local orig = module[name]
  if type(orig) ~= "function" then
    fail(string.format("register_fsdp_forward_method: %s has no method '%s'", module.__name, tostring(name)))
  end
  rawset(module, name, function(self, ...)
    if not st.root then M._lazy_init(self) end
    local n = select("#", ...)
    local args = { ... }
    run_group_hook(C.eng_fsdp_group_pre_forward, st.group, args, n)
    local res = { pcall(orig, self, unpack(args, 1, n)) }
    if not res[1] then error(res[2], 0) end
    table.remove(res, 1)
    local nr = table.maxn(res)
    if nr == 1 and type(res[1]) == "table" and not core.is_tensor(res[1]) then
      local list = {}
      for i, v in pairs(res[1]) do list[i] = v end
      run_group_hook(C.eng_fsdp_group_post_forward, st.group, list, table.maxn(list))
      res[1] = list
    else
      run_group_hook(C.eng_fsdp_group_post_forward, st.group, res, nr)
    end
    return unpack(res, 1, nr)
  end)
end

-- ---------------------------------------------------------------- fully_shard
local function managed_modules(root)
  local out, seen = {}, {}
  local function walk(m)
    if seen[m] then return end
    seen[m] = true
    out[#out + 1] = m
    for _, c in ipairs(m:children()) do
      if not is_fsdp(c) then walk(c) end
    end
  end
  walk(root)
  return out
end

local function placements_for(mesh, dim)
  if mesh:ndim() == 2 then return { P.Replicate(), P.Shard(dim) } end
  return { P.Shard(dim) }
end

-- FSDP over tensor parallelism (FSDP2 over parallelize_module): a DTensor parameter must live on a 1-D TP mesh that is the
-- last dim of the parent the FSDP mesh was sliced from (mesh["dp"] and mesh["tp"] of one (dp, tp) mesh, or
-- mesh{"replicate", "shard"} and mesh["tp"] of a 3-D one).  Returns the parent and the TP placement.
function tp_layout(p, name, m, mesh)
  local op = "fully_shard"
  local tpm = p.device_mesh
  local where = string.format("parameter '%s' of %s (%s)", name, m.__name, p:_layout_str())
  if tpm:ndim() ~= 1 then
    fail(string.format("%s: %s: FSDP over tensor parallelism needs parameters on a 1-D TP mesh", op, where))
  end
  local root = rawget(mesh, "_parent")
  local ok = root ~= nil and rawget(tpm, "_parent") == root and root:ndim() == mesh:ndim() + 1
  if ok then
    local md, td = rawget(mesh, "_parent_dims"), rawget(tpm, "_parent_dims")
    for i = 1, #md do if md[i] ~= i - 1 then ok = false end end
    if td[1] ~= root:ndim() - 1 then ok = false end
  end
  if not ok then
    fail(string.format("%s: %s: the TP mesh %s is not a slice of the FSDP mesh's parent (use one mesh of dims "
      .. "(dp, tp), fully_shard on mesh[\"dp\"] and parallelize_module on mesh[\"tp\"], FSDP dims first)",
      op, where, tostring(tpm)))
  end
  local pl = p.placements[1]
  if pl.kind == "partial" then fail(string.format("%s: %s: a Partial parameter cannot be sharded", op, where)) end
  return root, pl
end

-- dist.fully_shard(module, {mesh, reshard_after_forward = true, mp_policy, offload_policy, shard_placement_fn})
function M.fully_shard(module, opts)
  local op = "fully_shard"
  if not nnmod.is_module(module) then fail(op .. ": expected an nn.Module, got " .. type(module)) end
  opts = opts or {}
  if type(opts) ~= "table" then fail(op .. ": options must be a table") end
  for k in pairs(opts) do
    if k ~= "mesh" and k ~= "reshard_after_forward" and k ~= "mp_policy" and k ~= "offload_policy"
      and k ~= "shard_placement_fn" then
      fail(op .. ": unknown option '" .. tostring(k) .. "'")
    end
  end
  if class_chain_has(module, "ModuleList") or class_chain_has(module, "ModuleDict") then
    fail("fully_shard does not support containers that do not implement forward: " .. tostring(module.__name))
  end
  local mesh = opts.mesh or get_default_mesh()
  if not meshmod.is_mesh(mesh) then fail(op .. ": mesh must be a DeviceMesh (dist.init_device_mesh), got " .. type(mesh)) end
  if mesh:ndim() ~= 1 and mesh:ndim() ~= 2 then
    fail("fully_shard expects a 1D or 2D DeviceMesh but got " .. tostring(mesh))
  end
  if is_fsdp(module) then
    fail(string.format("%s: %s is already an FSDP module (fully_shard was called on it before)", op, module.__name))
  end
  raf_value(opts.reshard_after_forward, op)  -- its type (the factor check is agreed below)
  local raf
  local mp = opts.mp_policy or M.MixedPrecisionPolicy()
  if getmetatable(mp) ~= MixedPrecisionPolicy then fail(op .. ": mp_policy must be a dist.MixedPrecisionPolicy{...}") end
  local offload = opts.offload_policy or M.OffloadPolicy()
  if getmetatable(offload) ~= OffloadPolicy then fail(op .. ": offload_policy must be dist.OffloadPolicy() or dist.CPUOffloadPolicy{...}") end
  if offload.cpu and C.eng_mesh_device(mesh._c) ~= 1 and not M._said_offload then
    M._said_offload = true
    io.stderr:write("fully_shard: CPUOffloadPolicy on a CPU mesh: parameters already live on the CPU (nothing to offload)\n")
  end
  local spf = opts.shard_placement_fn
  if spf ~= nil and type(spf) ~= "function" then fail(op .. ": shard_placement_fn must be a function(param) -> dist.Shard(dim) or nil") end

  -- the parameters this call owns, in named_parameters order, each once (ties kept); checked before
  -- anything changes, and a failure on any rank is agreed so that every rank raises it
  local mods = managed_modules(module)
  local order, by_ptr = {}, {}
  local pdims = rawget(mesh, "_parent_dims")
  local sig = { tostring(mesh:get_root_mesh()), pdims and table.concat(pdims, ",") or "" }
  local rgrad = {}  -- requires_grad of each parameter, in order: agreed apart, to name it in the error
  local scan_ok, scan_err = pcall(function()
  -- a rank outside the mesh has no shard of it (the agreement below makes every rank raise this)
  if not mesh:is_member() then
    fail(string.format("%s: rank %d is not in the mesh %s: every rank that calls fully_shard must belong to its "
      .. "mesh (build the mesh over all of them)", op, mesh:get_rank(), tostring(mesh)))
  end
  raf = raf_value(opts.reshard_after_forward, op, mesh:size(mesh:ndim()))
  sig[#sig + 1] = tostring(raf)
  for mi, m in ipairs(mods) do
    local params = rawget(m, "_parameters")
    for _, name in ipairs(rawget(m, "_param_names")) do
      local p = params[name]
      if p ~= nil then
        local key = ptr_key(p._c)
        local prior = converted[p]
        local owner = sharded_by[p]
        if owner then
          local below = false
          for _, d in ipairs(owner:modules()) do if rawequal(d, module) then below = true end end
          if below then
            fail(string.format("%s: parameter '%s' of %s is already sharded by fully_shard on %s, which contains "
              .. "%s: call fully_shard bottom-up (on the submodules first, then on their parent)", op, name, m.__name,
              owner.__name, module.__name))
          end
          prior = owner
        end
        if prior then
          fail(string.format("%s: parameter '%s' of %s is already owned by the FSDP module %s: a parameter shared "
            .. "across two FSDP groups is not supported (shard the module that contains both uses)",
            op, name, m.__name, prior.__name))
        end
        if p._c.dist ~= nil then tp_layout(p, name, m, mesh) end
        local e = by_ptr[key]
        if not e then
          e = { p = p, uses = {} }
          by_ptr[key] = e
          order[#order + 1] = e
        end
        e.uses[#e.uses + 1] = { m = m, name = name }
      end
    end
    _ = mi
  end
  -- shard dims
  -- (a slice such as mesh["dp"] holds other ranks on each dp row: its root mesh and dims are what all share)
  for i, e in ipairs(order) do
    local dim = 1
    if spf then
      local pl = spf(e.p)
      if pl ~= nil then
        if not P.is_placement(pl) or pl.kind ~= "shard" then
          fail(string.format("%s: shard_placement_fn must return dist.Shard(dim) or nil, got %s for parameter '%s'",
            op, tostring(pl), e.uses[1].name))
        end
        dim = pl.dim
      end
    end
    local nd = e.p._c.ndim
    if nd == 0 then fail(string.format("%s: parameter '%s' is 0-d and cannot be sharded", op, e.uses[1].name)) end
    local cdim = dim < 0 and nd + dim or dim - 1
    if cdim < 0 or cdim >= nd then
      fail(string.format("%s: Shard(%d) is out of range for parameter '%s' of %d dims", op, dim, e.uses[1].name, nd))
    end
    e.cdim = cdim
    sig[#sig + 1] = e.uses[1].name .. ":" .. table.concat(e.p:shape(), "x") .. ":" .. e.p._c.dtype .. ":" .. cdim
    rgrad[#rgrad + 1] = e.p._c.requires_grad ~= 0 and "1" or "0"
    _ = i
  end
  -- the mixed-precision policy decides the gathers' dtype and path: ranks that differ would wait in different
  -- collectives in the first forward
  sig[#sig + 1] = string.format("mp_policy:%s:%s:%s:%s", tostring(mp.param_dtype), tostring(mp.reduce_dtype),
    tostring(mp.output_dtype), tostring(mp.cast_forward_inputs))
  end)
  if not scan_ok then C.eng_set_error_message(tostring(scan_err)) end
  -- every rank must pass the same mesh: equal shape and ranks are not enough, two init_device_mesh calls make
  -- two meshes over different process groups (the collectives would never match: a hang until the comm
  -- timeout), so the mesh's identity is its groups' ids (group creation is collective over the world: the
  -- n-th group made has the same id on every rank)
  local mkey = { tostring(mesh:get_root_mesh()), pdims and table.concat(pdims, ",") or "" }
  for d = 1, mesh:ndim() do mkey[#mkey + 1] = tostring(mesh:get_group(d):id()) end
  local world = C.eng_pg_world()
  local rc = C.eng_pg_agree(world, 0, hash_str(table.concat(mkey, ";")), "fully_shard")
  if rc ~= 0 then
    local msg = core.last_error()
    C.eng_pg_release(world)
    fail("fully_shard: the ranks passed different meshes (" .. tostring(mesh) .. ", process groups "
      .. table.concat(mkey, ",", 3) .. " here): every rank must pass the same DeviceMesh object (one "
      .. "init_device_mesh call, or the same slice of it); equal shapes over the same ranks are distinct meshes "
      .. "with distinct process groups (" .. msg .. ")")
  end
  -- every rank must shard the same parameters the same way on the same mesh, and freeze the same ones: a
  -- parameter that requires grad on some ranks only gets no gradient there, and the group's reduce-scatter
  -- would sum the others' gradients with nothing (the values carry the hash of the requires_grad flags and its
  -- negation: their maxima agree only when every rank has the same flags)
  local rg = ffi.new("int64_t[2]")
  rg[0] = hash_str(table.concat(rgrad))
  rg[1] = -rg[0]
  rc = C.eng_pg_agree_max(world, scan_ok and 0 or 1, scan_ok and hash_str(table.concat(sig, ";")) or 0, "fully_shard",
    rg, 2)
  C.eng_pg_release(world)
  if rc ~= 0 then
    if not scan_ok then error(scan_err, 0) end
    local msg = core.last_error()
    if msg:find("failed its checks", 1, true) then fail(msg) end
    fail("fully_shard: the ranks disagree on the module's parameters, their shard dims, the mesh, "
      .. "reshard_after_forward or mp_policy (" .. msg .. ")")
  end
  if rg[0] ~= -rg[1] then
    local frozen = {}
    for i, e in ipairs(order) do if rgrad[i] == "0" then frozen[#frozen + 1] = "'" .. e.uses[1].name .. "'" end end
    fail(string.format("fully_shard: requires_grad of %s's parameters differs across ranks (frozen on this rank: %s): "
      .. "every rank must freeze the same parameters before fully_shard, else the group's gradient reduce-scatter "
      .. "sums gradients some ranks do not compute", module.__name, #frozen > 0 and table.concat(frozen, ", ") or "none"))
  end
  -- sharded DTensor parameters: each rank's chunk of its own full parameter (no communication)
  local n = #order
  local arr = ffi.new("eng_tensor*[?]", math.max(n, 1))
  local fdims = ffi.new("int[?]", math.max(n, 1))
  local uspecs = ffi.new("eng_dist_spec*[?]", math.max(n, 1))
  local any_tp = false
  for _, e in ipairs(order) do if e.p._c.dist ~= nil then any_tp = true end end
  if any_tp and raf > 1 then
    fail(op .. ": reshard_after_forward = " .. raf .. " is not supported with tensor-parallel parameters (use true or false)")
  end
  local Wd = mesh:size(mesh:ndim())
  local drank = mesh:get_local_rank(mesh:ndim())
  -- FSDP over TP on the same dim: each rank keeps the dp-chunk of its TP shard (FSDP2's layout, padded to the
  -- largest chunk in the all-gather as on one dim), labelled [_StridedShard(d, sf = tp), Shard(d)]. That label
  -- applies the placements left to right: the dp-chunks of every TP shard, concatenated, then torch.chunk over
  -- tp; for uneven sizes with dp >= 3 the second chunking can cut across TP shards (dp 3, tp 2, size 7), so
  -- every coordinate's rows are checked (pure arithmetic, the same on every rank; with dp = 2 always the same)
  for _, e in ipairs(order) do
    local c = e.p._c
    if c.dist ~= nil then
      local root, tpl = tp_layout(e.p, e.uses[1].name, e.uses[1].m, mesh)
      if tpl.kind == "shard" and tpl.dim - 1 == e.cdim then
        local shape = e.p:shape()
        local n, T = shape[e.cdim + 1], e.p.device_mesh:size()
        local pl = {}
        if mesh:ndim() == 2 then pl[1] = P.Replicate() end
        pl[#pl + 1] = P._StridedShard(e.cdim + 1, { split_factor = T })
        pl[#pl + 1] = tpl
        local ct = math.ceil(n / T)
        for j = 0, T - 1 do
          local sj = math.max(0, math.min(ct, n - j * ct))
          local cd = math.ceil(sj / Wd)
          for i = 0, Wd - 1 do
            local rows = math.max(0, math.min(cd, sj - i * cd))
            local coord = {}
            if mesh:ndim() == 2 then coord[1] = 0 end
            coord[#coord + 1] = i; coord[#coord + 1] = j
            local runs = dtensor.local_shard_runs(shape, root, pl, coord)[e.cdim + 1]
            local got = 0
            for _, r in ipairs(runs) do got = got + r[2] end
            local same = got == rows and (rows == 0 or (#runs == 1 and runs[1][1] == j * ct + i * cd))
            if not same then
              fail(string.format("%s: parameter '%s' (%s): FSDP and tensor parallelism both shard dim %d, and for "
                .. "its size %d the dp-chunks of the TP shards over dp = %d are not a [_StridedShard(%d, sf=%d), "
                .. "Shard(%d)] layout (torch.chunk of the concatenated dp-chunks over tp cuts across TP shards: its "
                .. "state dict could not name the rows; make the size divisible by dp x tp = %d, or use dp = 2)",
                op, e.uses[1].name, e.p:_layout_str(), e.cdim + 1, n, Wd, e.cdim + 1, T, e.cdim + 1, Wd * T))
            end
          end
        end
      end
    end
  end
  -- the sharded parameters and the buffers live on the mesh's device (PyTorch's _move_states_to_device);
  -- with CPUOffloadPolicy on a CUDA mesh the sharded parameters' local shards stay on the CPU, in pinned host
  -- memory with pin_memory (the C group copies them to the device for each all-gather and its gradients back)
  local mdev = C.eng_mesh_device(mesh._c)
  local offload_cpu = offload.cpu and mdev == 1
  local function to_mesh_device(c)
    if c.device == mdev then return c end
    local d = C.eng_tensor_to_device(c, mdev)
    C.eng_tensor_release(c)
    if d == nil then core.raise() end
    return d
  end
  local function to_shard_home(c)
    if not offload_cpu then return to_mesh_device(c) end
    if c.device ~= 0 then
      local h = C.eng_tensor_to_device(c, 0)
      C.eng_tensor_release(c)
      if h == nil then core.raise() end
      c = h
    end
    if offload.pin_memory then
      local p = C.eng_tensor_pin_memory(c)
      C.eng_tensor_release(c)
      if p == nil then core.raise() end
      c = p
    end
    return c
  end
  local prev = C.eng_set_grad_enabled(0)
  local ok, err = pcall(function()
    for _, m in ipairs(mods) do
      local bufs = rawget(m, "_buffers")
      for _, name in ipairs(rawget(m, "_buffer_names")) do
        local b = bufs[name]
        if b ~= nil and b._c.device ~= mdev then bufs[name] = core.wrap(to_mesh_device(C.eng_tensor_retain(b._c))) end
      end
    end
    for i, e in ipairs(order) do
      local c = e.p._c
      local cd = e.cdim
      fdims[i - 1] = mesh:ndim() - 1
      if c.dist ~= nil then
        -- [Shard(d), tp] on the (dp, tp) parent ([Replicate, Shard(d), tp] for HSDP); _StridedShard(d, sf = tp)
        -- when TP shards the same dim (PyTorch's right-to-left rule): each rank keeps the dp-chunk of its TP shard
        local root, tpl = tp_layout(e.p, e.uses[1].name, e.uses[1].m, mesh)
        e.tpm = e.p.device_mesh
        local tp_size = e.p.device_mesh:size()
        local fpl
        if tpl.kind == "shard" and tpl.dim - 1 == cd then fpl = P._StridedShard(cd + 1, { split_factor = tp_size })
        else fpl = P.Shard(cd + 1) end
        local pl = {}
        if mesh:ndim() == 2 then pl[1] = P.Replicate() end
        pl[#pl + 1] = fpl
        pl[#pl + 1] = tpl
        local L = tonumber(c.shape[cd])
        local ceil = math.ceil(L / Wd)
        local rows = math.max(0, math.min(ceil, L - drank * ceil))
        local tl = C.eng_dtensor_local_view(c)
        if tl == nil then core.raise() end
        local nar = C.eng_narrow(tl, cd, drank * ceil, rows)
        C.eng_tensor_release(tl)
        if nar == nil then core.raise() end
        local cl = C.eng_tensor_clone(nar)
        C.eng_tensor_release(nar)
        if cl == nil then core.raise() end
        local loc = C.eng_tensor_contiguous(cl)
        C.eng_tensor_release(cl)
        if loc == nil then core.raise() end
        loc = to_shard_home(loc)
        local shape = e.p:shape()
        local st = {}
        local acc = 1
        for d = #shape, 1, -1 do st[d] = acc; acc = acc * shape[d] end
        local d = dtensor._from_local_as_is(core.wrap(loc), root, pl, { shape = shape, stride = st })
        d._c.is_param = 1
        if c.requires_grad ~= 0 then core.check(C.eng_tensor_set_requires_grad(d._c, 1), 3) end
        e.d = d
        arr[i - 1] = d._c
        uspecs[i - 1] = c.dist
      else
      uspecs[i - 1] = nil
      local pl = placements_for(mesh, e.cdim + 1)
      local shape = e.p:shape()
      local lshape, goff = dtensor.compute_local_shape_and_global_offset(shape, mesh, pl)
      local nar = C.eng_narrow(c, cd, goff[cd + 1], lshape[cd + 1])
      if nar == nil then core.raise() end
      local cl = C.eng_tensor_clone(nar)
      C.eng_tensor_release(nar)
      if cl == nil then core.raise() end
      local loc = C.eng_tensor_contiguous(cl)  -- a clone keeps the narrowed strides
      C.eng_tensor_release(cl)
      if loc == nil then core.raise() end
      loc = to_shard_home(loc)
      local st = {}
      local acc = 1
      for d = #shape, 1, -1 do st[d] = acc; acc = acc * shape[d] end
      local d = dtensor._from_local_as_is(core.wrap(loc), mesh, pl, { shape = shape, stride = st })
      d._c.is_param = 1
      if c.requires_grad ~= 0 then core.check(C.eng_tensor_set_requires_grad(d._c, 1), 3) end
      e.d = d
      arr[i - 1] = d._c
      end
    end
  end)
  C.eng_set_grad_enabled(prev)
  local function dt(x) return x and core.dtype(x, op, 3) or -1 end
  local g = nil
  if ok then
    g = C.eng_fsdp_group_new(mesh._c, n, arr, fdims, uspecs, dt(mp.param_dtype), dt(mp.reduce_dtype),
      dt(mp.output_dtype), mp.cast_forward_inputs and 1 or 0)
    if g ~= nil and C.eng_fsdp_group_set_offload(g, offload.cpu and 1 or 0, offload.pin_memory and 1 or 0) ~= 0 then
      C.eng_fsdp_group_release(g)
      g = nil
    end
  else
    C.eng_set_error_message(tostring(err))
  end
  -- a local failure (out of memory) must not leave the other ranks waiting in their next collective
  world = C.eng_pg_world()
  rc = C.eng_pg_agree(world, g == nil and 1 or 0, 0, "fully_shard")
  C.eng_pg_release(world)
  if rc ~= 0 then
    if g ~= nil then C.eng_fsdp_group_release(g) end
    core.raise()
  end
  g = ffi.gc(g, C.eng_fsdp_group_release)
  local pm = post_mesh(mesh, raf)
  core.check(C.eng_fsdp_group_set_reshard_after_forward(g, raf, pm and pm._c or nil), 2)
  core.check(C.eng_fsdp_group_attach(g, rawget(module, "_cmod")), 2)
  -- mixed precision over tensor parallelism: the TP group's backward gradient reductions (Partial -> Replicate /
  -- Shard) run in reduce_dtype too, not only the dp reduce-scatter (a known PyTorch gap); the TP mesh's setting
  -- is the last fully_shard's over it (the root's, called last), none without a reduce_dtype
  for _, e in ipairs(order) do
    if e.tpm then dtensor.set_backward_reduce_dtype(e.tpm, mp.reduce_dtype) end
  end
  -- register the sharded parameters under every name; the modules look the unsharded ones up
  for i, e in ipairs(order) do
    converted[e.p] = module
    sharded_by[e.d] = module
    for _, u in ipairs(e.uses) do
      rawget(u.m, "_parameters")[u.name] = e.d
      local view = rawget(u.m, "_param_view")
      if not view then view = {}; rawset(u.m, "_param_view", view) end
      view[u.name] = { g = g, i = i - 1 }
    end
  end
  -- the original full parameters go (each rank keeps only its shards, as ZeRO-3 promises)
  for _, e in ipairs(order) do e.p = nil end
  local cls = getmetatable(module)
  local state = {
    group = g, mesh = mesh, module_call = cls.__call, reshard_after_forward = opts.reshard_after_forward,
    raf_auto = opts.reshard_after_forward == nil,
    mp_policy = mp, offload_policy = offload, params = order, post_mesh = pm,
  }
  rawset(module, "_fsdp", state)
  setmetatable(module, fsdp_class(cls))
  -- state_dict and load_state_dict see the sharded parameters: the group is resharded first (FSDP2's
  -- to_sharded hooks), so values loaded into them are what the next forward all-gathers (an unsharded group,
  -- e.g. the root after forward, would go on computing with its stale all-gathered copy)
  local function to_sharded()
    if C.eng_fsdp_group_state(g) ~= 0 then core.check(C.eng_fsdp_group_reshard(g), 3) end
  end
  module:_register_state_dict_hook(to_sharded)
  module:_register_load_state_dict_pre_hook(to_sharded)
  return module
end

-- The tensor a module of a group registers under name: the unsharded parameter while the group is
-- unsharded, else nil (the sharded DTensor).  Called by nn.Module's __index for modules with FSDP views.
function M._current(view, name)
  local e = view[name]
  if not e then return nil end
  local c = C.eng_fsdp_group_param(e.g, e.i)
  if c == nil then return nil end
  if e.uc ~= c then
    e.uc = c
    e.u = core.wrap(C.eng_tensor_retain(c))
  end
  return e.u
end

-- The unsharded parameter (leaf) registered under name, whatever the group's state: what the module computes
-- with between the group's unshard and reshard, and what gets the gradient (nn.checkpoint passes it to its
-- autograd node).  nil when name is not in a group.
function M._leaf(view, name)
  local e = view[name]
  if not e then return nil end
  local c = C.eng_fsdp_group_leaf(e.g, e.i)
  if c == nil then return nil end
  if e.lc ~= c then
    e.lc = c
    e.l = core.wrap(C.eng_tensor_retain(c))
  end
  return e.l
end

-- Counters for tests: all-gathers and reduce-scatters issued by module's group so far.
function M.fsdp_counts(module)
  local st = group_of(module, "fsdp_counts")
  return { all_gather = tonumber(C.eng_fsdp_group_count(st.group, 0)),
           reduce_scatter = tonumber(C.eng_fsdp_group_count(st.group, 1)),
           state = ({ [0] = "sharded", "unsharded", "post_forward" })[C.eng_fsdp_group_state(st.group)],
           reduce_pending = C.eng_fsdp_group_reduce_pending(st.group) ~= 0,
           -- CPUOffloadPolicy on a CUDA mesh: the sharded parameters and gradients on the CPU (pinned: pin_memory)
           offload = C.eng_fsdp_group_offload(st.group) > 0, pinned = C.eng_fsdp_group_offload(st.group) == 2 }
end

-- FSDP's groups own the parameter slots of the modules they shard: nn.Module reads them through these (its
-- parameter-view registration point), so nn never names FSDP.
nnmod._register_param_views({
  current = M._current,
  leaf = M._leaf,
  owner = "fully_shard (its FSDP group all-gathers the sharded parameter registered there for forward, so a new "
    .. "Parameter would be ignored)",
})

return M
