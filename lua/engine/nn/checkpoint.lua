-- engine.nn.checkpoint: activation checkpointing.
--
--   h = nn.checkpoint(layer, h)            -- a module (its hooks run too)
--   y = nn.checkpoint(function(a, b) ... end, a, b)
--
-- The forward runs without recording a graph, so none of its activations are
-- kept; only the inputs and the random-number state are saved.  In backward
-- the RNG state is restored (so dropout draws the same masks), the forward is
-- recomputed with gradients on, and the gradients of the inputs and of the
-- parameters the region uses are computed from the recomputed graph.
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

local function checkpoint(fn, ...)
  local callable, module
  if mod.is_module(fn) then
    module = fn
    callable = function(...) return module(...) end
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
      local rok, rres = pcall(function() return { autograd.enable_grad(callable, unpack(inputs, 1, nargs)) } end)
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

return { checkpoint = checkpoint }
