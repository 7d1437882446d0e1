-- engine.nn.checkpoint: activation checkpointing.
--
--   h = nn.checkpoint(layer, h)            -- a module (its hooks run too)
--   y = nn.checkpoint(function(a, b) ... end, a, b)
--
-- The forward runs without recording a graph, so none of its activations are
-- kept; only the inputs and the random-number state are saved.  In backward
-- the RNG state is restored (so dropout draws the same masks), the forward is
-- recomputed with gradients on, and the gradients of the inputs and of the
-- module's parameters are computed from the recomputed graph and handed back
-- to the outer backward, which accumulates them into .grad as usual (so
-- gradient hooks on parameters run as without checkpointing).  For a plain
-- function, tensors it uses that are not among its arguments (closed-over
-- parameters) get their gradients accumulated by an inner backward instead.
local engine = require("engine")
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

local function checkpoint(fn, ...)
  local callable, params
  if mod.is_module(fn) then
    local m = fn
    callable = function(...) return m(...) end
    params = {}
    for _, p in ipairs(m:parameters()) do if p.requires_grad then params[#params + 1] = p end end
    -- FSDP modules compute with unsharded parameters their hooks gather: those leaves get .grad (and
    -- so the group's reduce-scatter) through the inner backward, as closed-over tensors do
    for _, sub in ipairs(m:modules()) do
      if rawget(sub, "_fsdp_view") or rawget(sub, "_fsdp") then params = nil; break end
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

  local ctx_state = {}
  local n_out
  local def = {
    forward = function(ctx)
      ctx_state.seed, ctx_state.offset = get_rng()
      -- detached aliases of the tensor arguments (the originals' graphs are not needed)
      local saved = {}
      for i = 1, nargs do saved[i] = args[i] end
      for _, i in ipairs(arg_pos) do
        local a = args[i]
        saved[i] = a:detach()
        ctx_state[i] = a.requires_grad
      end
      ctx_state.args = saved
      local res = { callable(unpack(args, 1, nargs)) }
      n_out = table.maxn(res)
      return unpack(res, 1, n_out)
    end,
    backward = function(ctx, ...)
      local grads = { ... }
      local saved = ctx_state.args
      -- recompute with the forward's RNG state and gradients on
      local cur_seed, cur_off = get_rng()
      set_rng(ctx_state.seed, ctx_state.offset)
      local inputs, want = {}, {}
      for i = 1, nargs do inputs[i] = saved[i] end
      for _, i in ipairs(arg_pos) do
        local d = saved[i]:detach()
        if ctx_state[i] and d:is_floating_point() then d:requires_grad_(true); want[#want + 1] = d end
        inputs[i] = d
      end
      local ok, res = pcall(function() return { autograd.enable_grad(callable, unpack(inputs, 1, nargs)) } end)
      set_rng(cur_seed, cur_off)
      if not ok then error(res, 0) end
      local outs, gouts = {}, {}
      local k = 0
      for i = 1, table.maxn(res) do
        local r = res[i]
        if is_tensor(r) then
          k = k + 1
          if r.requires_grad and grads[k] ~= nil then outs[#outs + 1] = r; gouts[#gouts + 1] = grads[k] end
        end
      end
      local n_want_args = #want
      if params then for _, p in ipairs(params) do want[#want + 1] = p end end
      local got = {}
      if #outs > 0 then
        if params then
          if #want > 0 then got = autograd.grad(outs, want, gouts, { allow_unused = true }) end
        else
          -- a plain function: closed-over leaves get .grad through an inner backward
          autograd.backward(outs, gouts)
          for j = 1, n_want_args do got[j] = want[j].grad end
        end
      end
      local result, j = {}, 0
      for t = 1, n_arg_t do
        local i = arg_pos[t]
        if ctx_state[i] and inputs[i].requires_grad then j = j + 1; result[t] = got[j] end
      end
      if params then
        for q = 1, #params do result[n_arg_t + q] = got[n_want_args + q] end
      end
      return unpack(result, 1, n_arg_t + (params and #params or 0))
    end,
  }
  local f = autograd.Function(def)
  -- the Function's inputs: the tensor arguments, then the module's parameters
  local fargs = {}
  for t = 1, n_arg_t do fargs[t] = args[arg_pos[t]] end
  if params then for q = 1, #params do fargs[n_arg_t + q] = params[q] end end
  local res = { f.apply(unpack(fargs, 1, n_arg_t + (params and #params or 0))) }
  return unpack(res, 1, n_out or table.maxn(res))
end

return { checkpoint = checkpoint }
