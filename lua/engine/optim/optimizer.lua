-- engine.optim.optimizer: the Optimizer base class (param groups, per-parameter
-- state, zero_grad, state_dict / load_state_dict for exact resume).
--
-- Subclasses (SGD, AdamW) call Optimizer.init(self, params, defaults) and
-- implement step(closure).  params is a list of tensors, an iterator of
-- (name, tensor) such as model:named_parameters(), or a list of groups
-- {{params = {...}, lr = ...}, ...}; a group's missing options take the defaults.
--
-- The hot paths pass raw eng_tensor* arrays (p._c, p._c.grad) to the fused C
-- kernels instead of going through Lua tensor wrappers: reading p.grad from
-- Lua creates a wrapper that keeps the gradient's memory alive until the Lua
-- GC collects it, which would delay freeing gradients set to none.
local core = require("engine.core")
local ffi, C = core.ffi, core.C
local is_tensor = core.is_tensor

local Optimizer = {}
Optimizer.__index = Optimizer
Optimizer.__name = "Optimizer"

-- "a, b, c": the sorted keys of a set (the known options, for error messages).
function Optimizer._names(set)
  local names = {}
  for k in pairs(set) do names[#names + 1] = tostring(k) end
  table.sort(names)
  return table.concat(names, ", ")
end

-- Optimizer:extend(name) -> subclass; Sub(params, opts) constructs via Sub.new.
function Optimizer:extend(name)
  local cls = setmetatable({ __name = name }, { __index = self, __call = function(c, ...) return c.new(...) end })
  cls.__index = cls
  cls.__tostring = Optimizer.__tostring
  return cls
end

local function collect_params(params, op)
  local list = {}
  if type(params) == "function" then
    for a, b in params do list[#list + 1] = b ~= nil and b or a end
  elseif is_tensor(params) then
    list[1] = params
  elseif type(params) == "table" then
    for i = 1, #params do list[i] = params[i] end
  else
    error(op .. ": params must be a list of tensors, an iterator of (name, tensor) or a list of param groups, got "
      .. type(params), 4)
  end
  return list
end

-- Optimizer.init(self, params, defaults, opts): fills param_groups and state.
function Optimizer.init(self, params, defaults, op)
  self.defaults = defaults
  self.param_groups = {}
  self.state = {}
  self._op = op
  local list = collect_params(params, op)
  if #list == 0 then error(op .. ": got an empty parameter list", 4) end
  if is_tensor(list[1]) or type(list[1]) ~= "table" then
    self:add_param_group({ params = list }, 5)
  else
    for _, g in ipairs(list) do self:add_param_group(g, 5) end
  end
end

-- add_param_group({params = {...}, lr = ..., ...})
function Optimizer:add_param_group(group, level)
  level = level or 2
  local op = self._op
  if type(group) ~= "table" or is_tensor(group) then error(op .. ": a param group must be a table", level) end
  local ps = collect_params(group.params, op)
  local g = {}
  for k, v in pairs(self.defaults) do g[k] = v end
  for k, v in pairs(group) do if k ~= "params" then g[k] = v end end
  if type(g.betas) == "table" then g.betas = { g.betas[1], g.betas[2] } end
  local seen = {}
  for _, og in ipairs(self.param_groups) do
    for _, p in ipairs(og.params) do seen[tonumber(ffi.cast("intptr_t", p._c))] = true end
  end
  for i, p in ipairs(ps) do
    if not is_tensor(p) then error(string.format("%s: parameter %d is a %s, not a tensor", op, i, type(p)), level) end
    if not p:is_floating_point() then
      error(string.format("%s: parameter %d has dtype %s; only floating-point tensors can be optimized", op, i, p.dtype), level)
    end
    if p._c.grad_fn ~= nil then error(string.format("%s: can't optimize a non-leaf tensor (parameter %d)", op, i), level) end
    local key = tonumber(ffi.cast("intptr_t", p._c))
    if seen[key] then
      error(string.format("%s: some parameters appear in more than one parameter group (parameter %d)", op, i), level)
    end
    seen[key] = true
  end
  g.params = ps
  if self.validate_group then self:validate_group(g, level + 1) end
  self.param_groups[#self.param_groups + 1] = g
end

-- zero_grad([set_to_none = true])
function Optimizer:zero_grad(set_to_none)
  if type(set_to_none) == "table" then set_to_none = set_to_none.set_to_none end
  for _, g in ipairs(self.param_groups) do
    for _, p in ipairs(g.params) do
      local c = p._c
      if c.grad ~= nil then
        if set_to_none == false then core.check(C.eng_tensor_zero_(c.grad))
        else core.check(C.eng_tensor_set_grad(c, nil)) end
      end
    end
  end
end

-- ---------------------------------------------------------------- state dict
-- state_dict() -> {state = {[i] = {...}}, param_groups = {{..., params = {i, ...}}}}
-- Parameters are numbered 0, 1, 2, ... over the groups in order (PyTorch's
-- numbering).  State tensors are the live ones (clone them to keep a snapshot),
-- step counts included (0-dim f32 CPU tensors, as PyTorch's): a checkpoint loaded
-- into the table in place restores them.  Hyperparameters are copies: load_state_dict
-- (or dist.checkpoint.set_optimizer_state_dict) puts them back.
function Optimizer:state_dict()
  local state, groups = {}, {}
  local idx = 0
  for _, g in ipairs(self.param_groups) do
    local sg = {}
    for k, v in pairs(g) do
      if k ~= "params" then sg[k] = type(v) == "table" and { unpack(v) } or v end
    end
    sg.params = {}
    for _, p in ipairs(g.params) do
      sg.params[#sg.params + 1] = idx
      local st = self.state[p]
      if st then
        local s = {}
        for k, v in pairs(st) do s[k] = v end
        state[idx] = s
      end
      idx = idx + 1
    end
    groups[#groups + 1] = sg
  end
  return { state = state, param_groups = groups }
end

-- load_state_dict(sd): restores hyperparameters and state (tensors are copied; a step count may be a
-- number or a one-element tensor, and becomes the optimizer's own step tensor).  sd.state is keyed by what
-- sd.param_groups[i].params lists: indices (state_dict) or names (get_optimizer_state_dict), as in PyTorch.
function Optimizer:load_state_dict(sd)
  local op = self._op
  if type(sd) ~= "table" or type(sd.param_groups) ~= "table" or type(sd.state) ~= "table" then
    error(op .. ": load_state_dict expects {state = ..., param_groups = ...}", 2)
  end
  if #sd.param_groups ~= #self.param_groups then
    error(string.format("%s: loaded state dict has %d parameter groups, the optimizer has %d", op,
      #sd.param_groups, #self.param_groups), 2)
  end
  for i, g in ipairs(self.param_groups) do
    local sg = sd.param_groups[i]
    if #sg.params ~= #g.params then
      error(string.format("%s: loaded state dict contains a parameter group (%d) with %d parameters, "
        .. "which doesn't match the size of the optimizer's group (%d)", op, i, #sg.params, #g.params), 2)
    end
  end
  local new_state = {}
  for i, g in ipairs(self.param_groups) do
    local sg = sd.param_groups[i]
    for j, p in ipairs(g.params) do
      local s = sd.state[sg.params[j]]
      if s then
        local st = {}
        for k, v in pairs(s) do
          if is_tensor(v) then
            if k ~= "step" then
              local ps, vs = p:shape(), v:shape()
              local same = #ps == #vs
              if same then for d = 1, #ps do if ps[d] ~= vs[d] then same = false end end end
              if not same then
                error(string.format("%s: state '%s' of parameter %d has shape [%s], the parameter has [%s]", op, k,
                  sg.params[j], table.concat(vs, ","), table.concat(ps, ",")), 2)
              end
              st[k] = v:to(self._state_dtype and self:_state_dtype(p, k) or p.dtype):clone()
            else
              st[k] = Optimizer._step_tensor(v, 3)
            end
          elseif k == "step" then
            st[k] = Optimizer._step_tensor(v, 3)
          else
            st[k] = v
          end
        end
        new_state[p] = st
      end
    end
  end
  for i, g in ipairs(self.param_groups) do
    for k, v in pairs(sd.param_groups[i]) do
      if k ~= "params" then g[k] = type(v) == "table" and { unpack(v) } or v end
    end
  end
  self.state = new_state
end

-- ---------------------------------------------------------------- flat state dicts
-- For files of named tensors (safetensors): flatten_state_dict() -> tensors
-- (name -> tensor, e.g. "state.0.exp_avg") and meta (name -> string, e.g.
-- "state.0.step" = "12", "param_groups.1.lr" = "0.0003", "param_groups.1.betas" =
-- "0.9,0.999", "param_groups.1.params" = "0,1,2").  load_flat_state_dict(tensors, meta)
-- is the inverse.
local function fmt(v)
  if type(v) == "number" then return string.format("%.17g", v) end
  if type(v) == "boolean" then return v and "true" or "false" end
  if type(v) == "table" then
    local parts = {}
    for i = 1, #v do parts[i] = fmt(v[i]) end
    return "list:" .. table.concat(parts, ",")
  end
  return "str:" .. tostring(v)
end

local function parse(s)
  if s == "true" then return true elseif s == "false" then return false end
  if s:sub(1, 5) == "list:" then
    local out = {}
    for item in s:sub(6):gmatch("[^,]+") do out[#out + 1] = parse(item) end
    return out
  end
  if s:sub(1, 4) == "str:" then return s:sub(5) end
  local n = tonumber(s)
  if n == nil then error("load_flat_state_dict: cannot parse value '" .. s .. "'", 3) end
  return n
end

function Optimizer:flatten_state_dict(prefix)
  prefix = prefix or ""
  local sd = self:state_dict()
  local tensors, meta = {}, {}
  for idx, s in pairs(sd.state) do
    for k, v in pairs(s) do
      local name = string.format("%sstate.%d.%s", prefix, idx, k)
      if k == "step" and is_tensor(v) then meta[name] = fmt(Optimizer._step_value(v, 2))
      elseif is_tensor(v) then tensors[name] = v else meta[name] = fmt(v) end
    end
  end
  for i, g in ipairs(sd.param_groups) do
    for k, v in pairs(g) do meta[string.format("%sparam_groups.%d.%s", prefix, i, k)] = fmt(v) end
  end
  return tensors, meta
end

function Optimizer:load_flat_state_dict(tensors, meta, prefix)
  prefix = prefix or ""
  local esc = prefix:gsub("%p", "%%%0")
  local sd = { state = {}, param_groups = {} }
  local function put(idx, k, v)
    sd.state[idx] = sd.state[idx] or {}
    sd.state[idx][k] = v
  end
  for name, t in pairs(tensors or {}) do
    local idx, k = name:match("^" .. esc .. "state%.(%d+)%.(.+)$")
    if idx then put(tonumber(idx), k, t) end
  end
  for name, s in pairs(meta or {}) do
    local idx, k = name:match("^" .. esc .. "state%.(%d+)%.(.+)$")
    if idx then put(tonumber(idx), k, parse(s))
    else
      local gi, gk = name:match("^" .. esc .. "param_groups%.(%d+)%.(.+)$")
      if gi then
        gi = tonumber(gi)
        sd.param_groups[gi] = sd.param_groups[gi] or {}
        local v = parse(s)
        if gk == "params" and type(v) == "number" then v = { v } end
        sd.param_groups[gi][gk] = v
      end
    end
  end
  for i = 1, #sd.param_groups do
    if sd.param_groups[i] == nil then error("load_flat_state_dict: parameter group " .. i .. " is missing", 2) end
  end
  self:load_state_dict(sd)
end

-- The allocator's live bytes drive Lua's collector (lua/engine/core.lua, docs/design.md "Allocator"), so
-- a training loop stays bounded without a collection per step; opt.collect_garbage = true (or
-- Optimizer.collect_garbage) still asks for a full collection at the end of every step.
Optimizer.collect_garbage = false

function Optimizer:_after_step()
  if self.collect_garbage then collectgarbage() end
end

-- Runs closure (if any) with gradients on and returns its result.
-- Every step starts here: first the device errors of the kernels that have completed (deferred checks of
-- embedding and cross entropy on CUDA, engine/src/cuda/deferred.c; no wait, no host sync) are raised, then the
-- closure (if any) runs.
function Optimizer:_closure(closure)
  if core.C.eng_cuda_pending_checks() > 0 and core.C.eng_cuda_poll_errors() ~= 0 then
    error(core.last_error(), 3)
  end
  if closure == nil then return nil end
  local autograd = require("engine.autograd")
  return autograd.enable_grad(closure)
end

-- A zero state tensor in p's layout: p's local shape, dtype and device, and
-- p's DTensor spec when p is a DTensor (the fused kernels then step the local
-- shards; they reject a state or gradient whose layout differs from p's).
function Optimizer._zeros_like(p, level)
  local z = C.eng_tensor_zeros_like(p._c)
  if z ~= nil and p._c.dist ~= nil and z.dist == nil and C.eng_dtensor_wrap_output(z, p._c.dist) ~= 0 then
    C.eng_tensor_release(z)
    z = nil
  end
  return core.wrap(z, (level or 1) + 1)
end

-- An f32 copy of p in p's layout (a master weight): p's local values converted, p's DTensor spec.
function Optimizer._f32_copy(p, level)
  local prev = C.eng_set_grad_enabled(0)
  local c = C.eng_tensor_to_dtype(p._c, C.ENG_F32)
  if c ~= nil and c == p._c then C.eng_tensor_release(c); c = C.eng_tensor_clone(p._c) end
  C.eng_set_grad_enabled(prev)
  if c ~= nil and p._c.dist ~= nil and c.dist == nil and C.eng_dtensor_wrap_output(c, p._c.dist) ~= 0 then
    C.eng_tensor_release(c)
    c = nil
  end
  return core.wrap(c, (level or 1) + 1)
end

-- ---------------------------------------------------------------- step counts
-- A step count lives in the state as PyTorch keeps it: a 0-dim f32 tensor on the CPU (state["step"]),
-- so that a state dict holds the live count and a checkpoint loaded into it in place (dist.checkpoint.load
-- into get_optimizer_state_dict's or state_dict()'s tables) restores it with the moments.
-- Optimizer._step_tensor(v) -> a new one holding v (a number, or a one-element tensor or DTensor).
function Optimizer._step_tensor(v, level)
  if is_tensor(v) then v = Optimizer._step_value(v, (level or 1) + 1) end
  if type(v) ~= "number" then
    error(string.format("optimizer state 'step' must be a number or a one-element tensor, got %s", type(v)), (level or 1) + 1)
  end
  return core.wrap(C.eng_tensor_full(0, nil, v, C.ENG_F32, C.ENG_CPU), (level or 1) + 1)
end

-- Optimizer._step_value(s) -> the count as a number (s: a step tensor, a number, a one-element DTensor).
function Optimizer._step_value(s, level)
  if type(s) == "number" then return s end
  if not is_tensor(s) or s:numel() ~= 1 then
    error(string.format("optimizer state 'step' must be a number or a one-element tensor, got %s",
      is_tensor(s) and ("a tensor of " .. s:numel() .. " elements") or type(s)), (level or 1) + 1)
  end
  local c = s._c
  if c.dist == nil and c.device == C.ENG_CPU and c.dtype == C.ENG_F32 then
    return tonumber(ffi.cast("float*", C.eng_tensor_data(c))[0])
  end
  if c.dist ~= nil and (c.dist.has_shard ~= 0 or c.dist.has_partial ~= 0) then s = s:full_tensor() end
  return s:item()
end

-- Optimizer._bump_step(st) -> the count after adding 1 to st.step in place (a number or another kind of
-- tensor there becomes the CPU f32 tensor first).
function Optimizer._bump_step(st, level)
  local s = st.step
  local c = is_tensor(s) and s._c or nil
  if not (c and c.dist == nil and c.device == C.ENG_CPU and c.dtype == C.ENG_F32 and c.ndim == 0) then
    s = Optimizer._step_tensor(s == nil and 0 or s, (level or 1) + 1)
    st.step, c = s, s._c
  end
  local ptr = ffi.cast("float*", C.eng_tensor_data(c))
  local v = tonumber(ptr[0]) + 1
  core.check(C.eng_tensor_fill_(c, v))
  return v
end

-- eng_tensor* arrays for the fused kernels.
function Optimizer._arrays(n)
  local k = n > 0 and n or 1
  return ffi.new("eng_tensor*[?]", k), ffi.new("eng_tensor*[?]", k), ffi.new("eng_tensor*[?]", k),
    ffi.new("eng_tensor*[?]", k)
end

function Optimizer:__tostring()
  local lines = { self.__name .. " (" }
  for i, g in ipairs(self.param_groups) do
    local keys = {}
    for k in pairs(g) do if k ~= "params" then keys[#keys + 1] = k end end
    table.sort(keys)
    lines[#lines + 1] = string.format("Parameter Group %d (%d tensors)", i - 1, #g.params)
    for _, k in ipairs(keys) do
      local v = g[k]
      if type(v) == "table" then v = "{" .. table.concat(v, ", ") .. "}" end
      lines[#lines + 1] = string.format("    %s: %s", k, tostring(v))
    end
  end
  lines[#lines + 1] = ")"
  return table.concat(lines, "\n")
end

return Optimizer
