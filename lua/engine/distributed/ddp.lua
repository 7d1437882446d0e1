-- engine.distributed.ddp: DistributedDataParallel (PyTorch's torch.nn.parallel.DistributedDataParallel).
--
--   local model = dist.DistributedDataParallel(net, {bucket_cap_mb = 25})   -- or {process_group = pg}, {device_mesh = m}
--                                                                           -- {gradient_as_bucket_view = true}
--                                                                           -- {find_unused_parameters = true}
--                                                                           -- {static_graph = true}
--                                                                           -- {device_ids = {engine.cuda.current_device()}}
--   local loss = F.cross_entropy(model(x), y)   -- each rank its own rows of the global batch
--   loss:backward()                             -- gradients averaged over the ranks, in buckets, during backward
--   model:no_sync(function() ... end)           -- gradient accumulation: no communication inside
--   print(model:comm_stats().collectives)       -- all_reduces and bytes of the last synced backward
--   model:register_comm_hook(nil, dist.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook)
--
-- The wrapper is an nn.Module whose child `module` is the network (state_dict keys start with "module.", as in
-- PyTorch); forward calls the network, after broadcasting rank 0's buffers as PyTorch does (broadcast_buffers =
-- false: never).  At construction the parameters and buffers are broadcast from rank 0 of the group (coalesced by
-- dtype into flat buffers of up to 250 MiB, as PyTorch: one broadcast for a model of one dtype; init_sync = false
-- skips it), and the C reducer (engine/include/eng/ddp.h) buckets every parameter that
-- requires grad as PyTorch does: one bucket for the first synced backward, then buckets in the order that backward
-- produced the gradients, each closed once it holds bucket_cap_mb MiB (the first at 1 MiB when bucket_cap_mb is not
-- given); each bucket is ONE asynchronous all_reduce (avg) started as soon as backward has produced all of its
-- gradients (in bucket order, the same on every rank), and the end of backward waits for them and writes the
-- averages into .grad.  Parameters must be plain tensors on the group's device (DTensors: replicate_parameters or
-- fully_shard).
-- gradient_as_bucket_view = true (PyTorch's option): each .grad is a view of its slice of a bucket, so backward
-- accumulates into the buckets and the all_reduce averages in place: no copy out of the buckets, and none into them
-- while the gradients are kept (optimizer:zero_grad(false); with zero_grad() setting them to none, each new gradient
-- is copied in once and replaced by its view).  find_unused_parameters and static_graph (PyTorch's options) change
-- only the buckets, as in PyTorch (find_unused_parameters: by size in registration order from the start, never
-- rebuilt; static_graph: rebuilt after the second backward): parameters that get no gradient on a rank are reduced
-- as zeros whatever the options, and keep no .grad when no rank gave them one.  device_ids = {i} (or "cuda:i") and
-- output_device: for a module on this rank's GPU i (checked: a CPU module takes neither, as PyTorch), the forward
-- moves tensor inputs to the GPU first.  Options are checked: an unknown key is an error.
local core = require("engine.core")
local engine = require("engine")
local ffi, C = core.ffi, core.C
local meshmod = require("engine.distributed.mesh")

local M = {}

-- The last synced backward of a reducer (eng_ddp): collectives and bytes; and the buckets the next synced backward
-- launches (rebuilt after the first, as PyTorch's): per bucket its number of parameters, bytes and the parameters
-- (bucket_indices: 1-based positions in module:parameters() order, in their order in the bucket).  Also
-- dist.dp_comm_stats of DTensor data parallelism, which runs on the same reducer.
function M._reducer_stats(r)
  local c, b = ffi.new("int64_t[1]"), ffi.new("int64_t[1]")
  core.check(C.eng_ddp_last_stats(r, c, b))
  local s = { collectives = tonumber(c[0]), bytes = tonumber(b[0]), buckets = tonumber(C.eng_ddp_num_buckets(r)),
    bucket_bytes = {}, bucket_params = {} }
  s.bucket_indices = {}
  local np, nb = ffi.new("int[1]"), ffi.new("int64_t[1]")
  for k = 0, s.buckets - 1 do
    core.check(C.eng_ddp_bucket_info(r, k, np, nb))
    s.bucket_params[k + 1], s.bucket_bytes[k + 1] = np[0], tonumber(nb[0])
    local idx = ffi.new("int[?]", math.max(np[0], 1))
    core.check(C.eng_ddp_bucket_params(r, k, idx, np[0]) < 0 and -1 or 0)
    local l = {}
    for j = 0, np[0] - 1 do l[j + 1] = idx[j] + 1 end
    s.bucket_indices[k + 1] = l
  end
  return s
end
-- PyTorch's _broadcast_coalesced (DDP's _sync_module_states and buffer sync): the tensors, grouped by dtype and device
-- in order, go as flat buffers of about 250 MiB (a group is sent once it reaches that; the rest at the end, in the
-- order their kinds first appeared), ONE broadcast from the group's rank 0 each, copied back into the tensors.
local BROADCAST_BUCKET = 250 * 1048576
local function pack(...) return { n = select("#", ...), ... } end
local function broadcast_coalesced(tensors, group)
  local comm = require("engine.distributed.comm")
  local groups, open, kinds = {}, {}, {}
  for _, t in ipairs(tensors) do
    local key = t.dtype .. "@" .. t.device
    local g = open[key]
    if not g then
      g = { list = {}, bytes = 0 }
      open[key] = g
      kinds[#kinds + 1] = key
    end
    g.list[#g.list + 1] = t
    g.bytes = g.bytes + t:numel() * t:element_size()
    if g.bytes >= BROADCAST_BUCKET then groups[#groups + 1] = g; open[key] = { list = {}, bytes = 0 } end
  end
  for _, key in ipairs(kinds) do if #open[key].list > 0 then groups[#groups + 1] = open[key] end end
  engine.no_grad(function()
    for _, g in ipairs(groups) do
      if #g.list == 1 and g.list[1]:is_contiguous() then
        comm.broadcast(g.list[1], { group = group, group_src = 0 })
      else
        local flat = {}
        for i, t in ipairs(g.list) do flat[i] = t:reshape(-1) end
        local buf = engine.cat(flat, 1)
        comm.broadcast(buf, { group = group, group_src = 0 })
        local off = 0
        for _, t in ipairs(g.list) do
          local n = t:numel()
          t:copy_(buf:narrow(1, off + 1, n):view(t:shape()))
          off = off + n
        end
      end
    end
  end)
end
M._broadcast_coalesced = broadcast_coalesced

-- dist.algorithms.ddp_comm_hooks.default_hooks (PyTorch's): the built-in communication hooks, passed to
-- DistributedDataParallel:register_comm_hook(state, hook).  The C reducer runs them inside backward (no Lua there),
-- so these are the hooks there are; called directly, they say so.
local BUILTIN = {}
local default_hooks = {}
for code, name in ipairs({ "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook" }) do
  local f = function()
    core.fail(name .. ": pass it to DistributedDataParallel:register_comm_hook(state, hook); it runs in the reducer")
  end
  default_hooks[name] = f
  BUILTIN[f] = code
end
M.algorithms = { ddp_comm_hooks = { default_hooks = default_hooks } }

local OPTS = { process_group = true, device_mesh = true, bucket_cap_mb = true, init_sync = true,
  broadcast_buffers = true, gradient_as_bucket_view = true, find_unused_parameters = true, static_graph = true,
  device_ids = true, output_device = true }

-- PyTorch's device_ids / output_device: nil, or (one element / one device) this rank's GPU, for a module whose
-- parameters are all on it; returns the device index or nil.
local function device_of(v, what, module_dev, op)
  local idx = v
  if type(v) == "string" then idx = v == "cuda" and -1 or tonumber(v:match("^cuda:(%d+)$")) end
  if type(idx) ~= "number" or idx ~= math.floor(idx) then
    core.fail(string.format("%s: %s must be a CUDA device index or \"cuda:N\", got %s", op, what, tostring(v)))
  end
  if module_dev ~= "cuda" then
    core.fail(string.format("%s: device_ids and output_device only work with a module on one GPU, got %s %s and "
      .. "module parameters on %s", op, what, tostring(v), module_dev))
  end
  local cur = require("engine.cuda").current_device()
  if idx ~= -1 and idx ~= cur then
    core.fail(string.format("%s: %s %s is not this rank's GPU cuda:%d, where the module's parameters are", op, what,
      tostring(v), cur))
  end
  return cur
end

-- the tensors in x (tables walked) on the GPU, as PyTorch's forward moves the inputs to device_ids[0]
local function to_cuda(x)
  if core.is_tensor(x) then return x.device == "cuda" and x or x:to("cuda") end
  if type(x) == "table" and getmetatable(x) == nil then
    local y = {}
    for k, v in pairs(x) do y[k] = to_cuda(v) end
    return y
  end
  return x
end

local DDP

local function new_class()
  local nn = require("engine.nn")
  local cls = nn.Module:extend("DistributedDataParallel")

  function cls:__init(module, opts)
    local op = "DistributedDataParallel"
    if not nn.is_module(module) then core.fail(op .. ": expected an nn.Module, got " .. type(module)) end
    opts = opts or {}
    if type(opts) ~= "table" then core.fail(op .. ": options must be a table, got " .. type(opts)) end
    for k in pairs(opts) do
      if not OPTS[k] then
        local names = {}
        for n in pairs(OPTS) do names[#names + 1] = n end
        table.sort(names)
        core.fail(string.format("%s: unknown option '%s' (%s)", op, tostring(k), table.concat(names, ", ")))
      end
    end
    local comm = require("engine.distributed.comm")
    local group = opts.process_group
    if opts.device_mesh ~= nil then
      if group ~= nil then core.fail(op .. ": pass process_group or device_mesh, not both") end
      local m = opts.device_mesh
      if not meshmod.is_mesh(m) or m:ndim() ~= 1 then
        core.fail(op .. ": device_mesh must be a 1-D DeviceMesh, got " .. tostring(m))
      end
      group = m:get_group()
    end
    group = group or comm.world_group()
    if not comm.is_group(group) then core.fail(op .. ": process_group must be a ProcessGroup, got " .. type(group)) end
    for _, k in ipairs({ "gradient_as_bucket_view", "find_unused_parameters", "static_graph", "broadcast_buffers" }) do
      if opts[k] ~= nil and type(opts[k]) ~= "boolean" then
        core.fail(op .. ": " .. k .. " must be a boolean, got " .. tostring(opts[k]))
      end
    end
    if opts.device_ids ~= nil or opts.output_device ~= nil then
      local devs = {}
      for _, p in module:named_parameters() do devs[p.device] = true end
      local module_dev = next(devs) == nil and "nowhere (no parameters)" or (next(devs, next(devs)) and "several devices"
        or next(devs))
      if opts.device_ids ~= nil then
        local ids = opts.device_ids
        if type(ids) ~= "table" or #ids ~= 1 then
          core.fail(op .. ": device_ids can only be nil or contain a single element, got " .. (type(ids) == "table"
            and (#ids .. " elements") or tostring(ids)))
        end
        device_of(ids[1], "device_ids", module_dev, op)
        rawset(self, "_inputs_to_cuda", true)
      end
      if opts.output_device ~= nil then device_of(opts.output_device, "output_device", module_dev, op) end
    end
    local as_view = opts.gradient_as_bucket_view
    -- when the buckets are rebuilt in gradient order (PyTorch's reducer): after the first synced backward, the
    -- second with static_graph, never with find_unused_parameters (buckets by size in registration order)
    local rebuild_after = opts.static_graph and 2 or (opts.find_unused_parameters and 0 or 1)
    local cap = opts.bucket_cap_mb == nil and 25 or opts.bucket_cap_mb
    if type(cap) ~= "number" or cap <= 0 then core.fail(op .. ": bucket_cap_mb must be a positive number, got " .. tostring(cap)) end
    self.module = module
    rawset(self, "_group", group)
    local buffers = {}
    if opts.broadcast_buffers ~= false then
      for _, b in module:named_buffers() do buffers[#buffers + 1] = b end
    end
    -- as PyTorch's will_sync_module_buffers: only a module that has buffers at construction syncs them (so a model
    -- without any walks no module tree in its forwards)
    rawset(self, "_broadcast_buffers", #buffers > 0)
    rawset(self, "_sync_buffers", #buffers > 0) -- PyTorch's require_forward_param_sync: at first on
    -- PyTorch's _sync_module_states: every rank starts from rank 0's parameters and buffers (coalesced broadcasts)
    if opts.init_sync ~= false then
      local states = {}
      for _, p in module:named_parameters() do states[#states + 1] = p end
      for _, b in ipairs(buffers) do states[#states + 1] = b end
      broadcast_coalesced(states, group)
    end
    local list = {}
    for _, p in module:named_parameters() do list[#list + 1] = p end
    local arr = ffi.new("eng_tensor*[?]", math.max(#list, 1))
    for i, p in ipairs(list) do arr[i - 1] = p._c end
    -- PyTorch: with the default cap the first bucket (the last layers' gradients) closes at 1 MiB
    -- (dist._DEFAULT_FIRST_BUCKET_BYTES); a cap that is given applies to every bucket
    local first = opts.bucket_cap_mb == nil and 1048576 or math.floor(cap * 1048576)
    local r = C.eng_ddp_new(group._c, #list, arr, math.floor(cap * 1048576), first, rebuild_after)
    if r == nil then core.raise() end
    rawset(self, "_reducer", ffi.gc(r, C.eng_ddp_release))
    if as_view then core.check(C.eng_ddp_set_gradient_as_bucket_view(r, 1)) end
    rawset(self, "_params", list) -- keeps the parameter objects the reducer hooks alive with the wrapper
  end

  -- broadcast_buffers (PyTorch's default): before a forward, rank 0's buffers go to every rank (coalesced), when
  -- the previous forward ran with gradients on and synchronization (not under no_grad or no_sync; the first forward
  -- always), as PyTorch's _pre_forward decides it.
  function cls:forward(...)
    if rawget(self, "_sync_buffers") then
      local bufs = {} -- now: a buffer may have been reassigned (PyTorch's _assign_modules_buffers)
      for _, b in self.module:named_buffers() do bufs[#bufs + 1] = b end
      if #bufs > 0 then broadcast_coalesced(bufs, rawget(self, "_group")) end
    end
    local out
    if rawget(self, "_inputs_to_cuda") then
      local args = pack(...)
      for i = 1, args.n do args[i] = to_cuda(args[i]) end
      out = pack(self.module(unpack(args, 1, args.n)))
    else
      out = pack(self.module(...))
    end
    rawset(self, "_sync_buffers", rawget(self, "_broadcast_buffers") and engine.is_grad_enabled() and
      not rawget(self, "_in_no_sync"))
    return unpack(out, 1, out.n)
  end

  -- no_sync(fn, ...): runs fn with gradient synchronization off (accumulation), then turns it back on; returns
  -- fn's results.  The next backward outside no_sync reduces the accumulated gradients.
  function cls:no_sync(fn, ...)
    if type(fn) ~= "function" then core.fail("no_sync: expected a function") end
    local r = rawget(self, "_reducer")
    core.check(C.eng_ddp_set_require_sync(r, 0))
    rawset(self, "_in_no_sync", true)
    local res = { pcall(fn, ...) }
    rawset(self, "_in_no_sync", nil)
    core.check(C.eng_ddp_set_require_sync(r, 1))
    if not res[1] then error(res[2], 0) end
    return unpack(res, 2, table.maxn(res))
  end

  -- register_comm_hook(state, hook): PyTorch's, with a built-in hook of dist.algorithms.ddp_comm_hooks.default_hooks
  -- (allreduce_hook: the default; fp16_compress_hook / bf16_compress_hook: each bucket averaged in f16 / bf16, half
  -- the bytes for f32 gradients).  state: nil or the DDP's process group.  Once, as in PyTorch.
  function cls:register_comm_hook(state, hook)
    local op = "register_comm_hook"
    if state ~= nil and state ~= rawget(self, "_group") then
      core.fail(op .. ": state must be nil or the DistributedDataParallel's process group (the built-in hooks "
        .. "reduce over it), got " .. tostring(state))
    end
    local code = BUILTIN[hook]
    if code == nil then
      core.fail(op .. ": hook must be one of dist.algorithms.ddp_comm_hooks.default_hooks (allreduce_hook, "
        .. "fp16_compress_hook, bf16_compress_hook): a Lua function cannot run inside the C reducer, got "
        .. tostring(hook))
    end
    core.check(C.eng_ddp_set_comm_hook(rawget(self, "_reducer"), code))
  end

  -- comm_stats() -> {collectives = n, bytes = n, buckets = n, bucket_bytes = {...}, bucket_params = {...},
  --                  bucket_indices = {{...}, ...}}
  function cls:comm_stats() return M._reducer_stats(rawget(self, "_reducer")) end
  return cls
end

function M.DistributedDataParallel(module, opts)
  DDP = DDP or new_class()
  return DDP(module, opts)
end

return M
