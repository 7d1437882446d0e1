-- engine.nn.checkpoint: activation checkpointing.
--
--   h = nn.checkpoint(layer, h)            -- a module (its hooks run too)
--   y = nn.checkpoint(function(a, b) ... end, a, b)
--   nn.apply_activation_checkpointing(model, {check_fn = function(m) return m:is_a(Block) end})
--                                          -- marks modules in place: each call of one is nn.checkpoint(m, ...)
--
-- The forward runs without recording a graph, so none of its activations are
-- kept; only the inputs and the random-number state are saved.  In backward
-- the RNG state is restored (so dropout draws the same masks), the forward is
-- recomputed with gradients on, and the gradients of the inputs and of the
-- parameters the region uses are computed from the recomputed graph.  The
-- recompute also runs under the forward's DTensor implicit replication
-- (dist.implicit_replication: a forward run inside it, with plain tensors among
-- DTensors, is recomputed by a backward that runs outside it).
--
-- The parameters the region uses are inputs of the checkpoint's autograd node
-- even when no argument requires grad (PyTorch's non-reentrant checkpoint
-- needs no differentiable input either: its saved-tensor hooks sit inside the
-- region's own graph): a module's parameters, and the parameters the forward
-- looked up on any module (`self.weight`), the ones of FSDP groups as their
-- unsharded parameters (what the forward computes with, and what the group's
-- gradient hooks watch).  For a module their gradients are handed back to the
-- outer backward, which accumulates them into .grad as usual (so gradient
-- hooks, and FSDP's reduce-scatter, run as without checkpointing).  For a
-- plain function an inner backward accumulates them instead, together with
-- any other tensor it closes over (a closed-over tensor that is no module's
-- parameter is not seen: if no argument requires grad either, pass it as an
-- argument).
local core = require("engine.core")
local autograd = require("engine.autograd")
local mod = require("engine.nn.module")
local ffi, C = core.ffi, core.C
local is_tensor = core.is_tensor

local rng_buf = ffi.new("uint64_t[2]")
local function get_rng()
  C.eng_rng_get_state(rng_buf, rng_buf + 1)
  return rng_buf[0], rng_buf[1]
end
local function set_rng(seed, offset) C.eng_rng_set_state(seed, offset) end

-- The tensor the forward computes with for parameter name of module m (registered as p): what m's parameter
-- view gives (an FSDP group's unsharded parameter; nn.Module._register_param_views), else p itself.
local function used_tensor(m, name, p)
  local view = rawget(m, "_param_view")
  if view and view[name] then return mod._param_views().leaf(view, name) or p end
  return p
end

-- The parameters a region used, each once, in a stable order: every parameter of module (when given), then
-- those of reads (module, name pairs the forward looked up) not listed yet; only those requiring grad.
local function region_params(module, reads)
  local list, seen = {}, {}
  local function add(m, name, p)
    if p == nil then return end
    local t = used_tensor(m, name, p)
    local key = tonumber(ffi.cast("intptr_t", t._c))
    if seen[key] then return end
    seen[key] = true
    if t.requires_grad and t:is_floating_point() then list[#list + 1] = t end
  end
  if module then
    for _, m in ipairs(module:modules()) do
      local params = rawget(m, "_parameters")
      for _, name in ipairs(rawget(m, "_param_names")) do add(m, name, params[name]) end
    end
  end
  for i = 1, #reads, 2 do
    local m, name = reads[i], reads[i + 1]
    add(m, name, rawget(m, "_parameters")[name])
  end
  return list
end

-- Modules whose checkpointed call is running now (module -> depth): the region calls the module again (in the
-- forward and in the recompute), and that call must run the module itself, not checkpoint it once more.
local running = setmetatable({}, { __mode = "k" })

local function pack(...) return { n = select("#", ...), ... } end

local function checkpoint(fn, ...)
  local callable, module
  if mod.is_module(fn) then
    module = fn
    callable = function(...)
      running[module] = (running[module] or 0) + 1
      local r = pack(pcall(module, ...))
      local depth = running[module] - 1
      running[module] = depth > 0 and depth or nil
      if not r[1] then error(r[2], 0) end
      return unpack(r, 2, r.n)
    end
  elseif type(fn) == "function" then
    callable = fn
  else
    error("checkpoint: expected a Module or a function as the first argument, got " .. type(fn), 2)
  end
  if not autograd.is_grad_enabled() then return callable(...) end

  local nargs = select("#", ...)
  local args = { ... }
  local arg_pos = {}    -- positions of tensor arguments, in order
  for i = 1, nargs do if is_tensor(args[i]) then arg_pos[#arg_pos + 1] = i end end
  local n_arg_t = #arg_pos

  -- the forward, without a graph, noting the parameters it looks up
  local st = {}
  st.seed, st.offset = get_rng()
  st.implicit = C.eng_dtensor_implicit_replication()   -- the recompute runs under the forward's setting
  local saved = {}      -- detached aliases of the tensor arguments (the originals' graphs are not needed)
  for i = 1, nargs do saved[i] = args[i] end
  for _, i in ipairs(arg_pos) do
    saved[i] = args[i]:detach()
    st[i] = args[i].requires_grad
  end
  local reads = {}
  local prev_reads = mod._set_param_reads(reads)
  local ok, res = pcall(function() return { autograd.no_grad(callable, unpack(args, 1, nargs)) } end)
  mod._set_param_reads(prev_reads)
  if not ok then error(res, 0) end
  local n_out = table.maxn(res)
  local params = region_params(module, reads)
  local n_par = #params

  local def = {
    -- the outputs computed above (not kept by the node afterwards)
    forward = function() local r = res; res = nil; return unpack(r, 1, n_out) end,
    backward = function(_, ...)
      local grads = { ... }
      -- recompute with the forward's RNG state and gradients on
      local cur_seed, cur_off = get_rng()
      set_rng(st.seed, st.offset)
      local inputs, want = {}, {}
      for i = 1, nargs do inputs[i] = saved[i] end
      for _, i in ipairs(arg_pos) do
        local d = saved[i]:detach()
        if st[i] and d:is_floating_point() then d:requires_grad_(true); want[#want + 1] = d end
        inputs[i] = d
      end
      local prev_implicit = C.eng_dtensor_set_implicit_replication(st.implicit)
      local rok, rres = pcall(function() return { autograd.enable_grad(callable, unpack(inputs, 1, nargs)) } end)
      C.eng_dtensor_set_implicit_replication(prev_implicit)
      set_rng(cur_seed, cur_off)
      if not rok then error(rres, 0) end
      local outs, gouts = {}, {}
      local k = 0
      for i = 1, table.maxn(rres) do
        local r = rres[i]
        if is_tensor(r) then
          k = k + 1
          if r.requires_grad and grads[k] ~= nil then outs[#outs + 1] = r; gouts[#gouts + 1] = grads[k] end
        end
      end
      local n_want_args = #want
      local got = {}
      if #outs > 0 then
        if module then
          -- the module's parameters' gradients go back to the outer backward with the arguments'
          for _, p in ipairs(params) do want[#want + 1] = p end
          if #want > 0 then got = autograd.grad(outs, want, gouts, { allow_unused = true }) end
        else
          -- a plain function: the leaves it used (its parameters, closed-over tensors) get .grad through an
          -- inner backward
          autograd.backward(outs, gouts)
          for j = 1, n_want_args do got[j] = want[j].grad end
        end
      end
      local result, j = {}, 0
      for t = 1, n_arg_t do
        local i = arg_pos[t]
        if st[i] and inputs[i].requires_grad then j = j + 1; result[t] = got[j] end
      end
      if module then
        for q = 1, n_par do result[n_arg_t + q] = got[n_want_args + q] end
      end
      return unpack(result, 1, n_arg_t + n_par)
    end,
  }
  -- the node's inputs: the tensor arguments, then the parameters the region used
  local fargs = {}
  for t = 1, n_arg_t do fargs[t] = args[arg_pos[t]] end
  for q = 1, n_par do fargs[n_arg_t + q] = params[q] end
  local out = { autograd.Function(def).apply(unpack(fargs, 1, n_arg_t + n_par)) }
  return unpack(out, 1, n_out)
end

-- The call of a module marked by apply_activation_checkpointing (nn.Module's __call comes here when the module's
-- _checkpoint field is set): under no_grad, or inside the module's own checkpointed call (nn.checkpoint calls the
-- module again in its forward and recompute), the module runs plainly (hooks and forward); else as
-- nn.checkpoint(module, ...).
local call_unmarked = mod._call_unmarked
local function marked_call(module, ...)
  if running[module] or not autograd.is_grad_enabled() then return call_unmarked(module, ...) end
  return checkpoint(module, ...)
end
mod._register_checkpoint_call(marked_call)

-- nn.apply_activation_checkpointing(model, opts) -> count: marks submodules of model (in place: no wrapper, the
-- names of parameters and state dicts unchanged) so that each call of a marked module runs as
-- nn.checkpoint(module, ...): its activations are recomputed in backward instead of kept.  PyTorch's
-- apply_activation_checkpointing(model, check_fn=...) with the composable checkpoint(module); torchtitan's
-- per-layer selective AC with `every`.  opts:
--   check_fn  function(module, name) -> true for the modules to mark (name: as model:named_modules() gives it,
--             "" for model itself); or
--   modules   a list of submodules of model to mark
--   every     N >= 1 (default 1): only every Nth module selected, in model:named_modules() order (the Nth, 2Nth, ...;
--             torchtitan's selective_ac_option = N)
--   enabled   false: remove the marks instead (of the modules selected; of every module when neither check_fn nor
--             modules is given)
-- Returns the number of modules marked (with enabled = false: the number of marks removed).  Order with
-- dist.fully_shard and parallelize_module does not matter (FSDP's hooks run inside the checkpointed region: the
-- recompute all-gathers again).  A marked module inside another marked module is checkpointed again during the
-- outer one's recompute (nested checkpoints: correct, but the inner forward then runs three times).
local function apply_activation_checkpointing(model, opts)
  local op = "apply_activation_checkpointing"
  if not mod.is_module(model) then
    core.fail(op .. ": expected a Module as the first argument, got " .. type(model))
  end
  if opts == nil then
    core.fail(op .. ": expected options {check_fn = function(module, name) -> bool} or {modules = {...}}")
  end
  opts = core.check_opts(opts, { "check_fn", "modules", "every", "enabled" }, op)
  local check_fn, modules, every, enabled = opts.check_fn, opts.modules, opts.every, opts.enabled
  if enabled == nil then enabled = true end
  if type(enabled) ~= "boolean" then core.fail(op .. ": enabled must be a boolean, got " .. tostring(enabled)) end
  if every == nil then every = 1 end
  if type(every) ~= "number" or every % 1 ~= 0 or every < 1 then
    core.fail(op .. ": every must be an integer >= 1, got " .. tostring(every))
  end
  if check_fn ~= nil and type(check_fn) ~= "function" then
    core.fail(op .. ": check_fn must be a function(module, name) -> boolean, got " .. type(check_fn))
  end
  if check_fn ~= nil and modules ~= nil then core.fail(op .. ": give check_fn or modules, not both") end
  local listed
  if modules ~= nil then
    if type(modules) ~= "table" or getmetatable(modules) ~= nil then
      core.fail(op .. ": modules must be a list of modules, got " .. (mod.is_module(modules) and "a Module (wrap it "
        .. "in a list)" or type(modules)))
    end
    local inside = {}
    for _, m in ipairs(model:modules()) do inside[m] = true end
    listed = {}
    for i, m in ipairs(modules) do
      if not mod.is_module(m) then core.fail(string.format("%s: modules[%d] is a %s, not a Module", op, i, type(m))) end
      if not inside[m] then
        core.fail(string.format("%s: modules[%d] (%s) is not a submodule of the model", op, i, m.__name))
      end
      listed[m] = true
    end
  end
  if check_fn == nil and listed == nil and enabled then
    core.fail(op .. ": give check_fn = function(module, name) -> bool or modules = {...}: which modules to checkpoint")
  end
  local selected = {}
  for name, m in model:named_modules() do
    local hit
    if check_fn then hit = check_fn(m, name) elseif listed then hit = listed[m] else hit = true end
    if hit then selected[#selected + 1] = m end
  end
  local count = 0
  for k, m in ipairs(selected) do
    if k % every == 0 then
      if enabled then rawset(m, "_checkpoint", true); count = count + 1
      elseif rawget(m, "_checkpoint") then rawset(m, "_checkpoint", nil); count = count + 1 end
    end
  end
  return count
end

return { checkpoint = checkpoint, apply_activation_checkpointing = apply_activation_checkpointing }
