-- engine.nn.module: nn.Module (the base class of every layer and model) and
-- nn.Parameter.
--
--   local MyMod = nn.Module:extend("MyMod")
--   function MyMod:__init(dim) self.lin = nn.Linear(dim, dim); self.scale = nn.Parameter(engine.ones(dim)) end
--   function MyMod:forward(x) return self.lin(x) * self.scale end
--   local m = MyMod(16); local y = m(x)       -- runs forward-pre hooks, forward, forward hooks
--
-- Registration is by assignment, as in PyTorch: a Parameter assigned to a field
-- becomes a parameter, a Module a submodule; everything else is a plain field.
-- Lua tables are unordered, so each module keeps the names in registration
-- order (named_parameters, state_dict and printing follow it).
--
-- Naming: parameter names are dotted paths ("layers.0.attention.wq.weight").
-- Children of ModuleList/Sequential are named 0, 1, 2, ... (0-based, as in
-- PyTorch, so that state dicts and checkpoints use PyTorch's names), while
-- Lua indexing stays 1-based: model.layers[1] is the child named "0".
--
-- Hooks: each Module owns a C module object (eng_module, engine/include/eng/module.h)
-- holding its forward-pre and forward hooks, so C hooks (FSDP's all-gather /
-- reshard) and Lua hooks run in one registration order.  The C object is
-- m._cmod (an eng_module*; register C hooks on it directly).
local core = require("engine.core")
local Tensor = require("engine.tensor")
local autograd = require("engine.autograd")
local ffi, C = core.ffi, core.C
local is_tensor = core.is_tensor

local PRE, POST = 0, 1  -- ENG_HOOK_FORWARD_PRE, ENG_HOOK_FORWARD_POST
local hook_count = C.eng_module_hook_count

local M = {}

-- ---------------------------------------------------------------- Parameter
-- nn.Parameter(t [, requires_grad = true]): a leaf tensor sharing t's storage,
-- flagged as a parameter (t._c.is_param, informational) and requiring grad.
function M.Parameter(t, requires_grad)
  if not is_tensor(t) then
    error("nn.Parameter: expected a tensor, got " .. type(t), 2)
  end
  local p = core.wrap(C.eng_tensor_detach(t._c), 3)
  if requires_grad ~= false then core.check(C.eng_tensor_set_requires_grad(p._c, 1), 3) end
  -- There is no setter in the C API for this purely informational flag.
  p._c.is_param = 1
  return p
end

local function is_param(v) return is_tensor(v) and v._c.is_param ~= 0 end
M.is_parameter = is_param

local function is_module(v) return type(v) == "table" and rawget(v, "_cmod") ~= nil end
M.is_module = is_module

local function ptr_key(t) return tonumber(ffi.cast("intptr_t", t._c)) end

local function shape_str(t) return "[" .. table.concat(t:shape(), ", ") .. "]" end

-- ---------------------------------------------------------------- class machinery
local Module = {}
M.Module = Module

local function list_remove(list, name)
  for i = 1, #list do if list[i] == name then table.remove(list, i); return end end
end

local function check_name(self, name, what, level)
  if type(name) ~= "string" then
    error(string.format("%s: %s name must be a string, got %s", self.__name, what, type(name)), level + 1)
  end
  if name == "" or name:find(".", 1, true) then
    error(string.format("%s: %s name '%s' must be non-empty and must not contain '.'", self.__name, what, name),
      level + 1)
  end
end

-- Removes name from every registry (a name is a parameter, a buffer or a submodule).
local function unregister(self, name)
  local p, b, m = rawget(self, "_parameters"), rawget(self, "_buffers"), rawget(self, "_modules")
  if p[name] ~= nil or rawget(self, "_param_none")[name] then
    p[name] = nil; rawget(self, "_param_none")[name] = nil; list_remove(rawget(self, "_param_names"), name)
  end
  if b[name] ~= nil then b[name] = nil; list_remove(rawget(self, "_buffer_names"), name) end
  if m[name] ~= nil then m[name] = nil; list_remove(rawget(self, "_module_names"), name) end
end

local function add_name(list, name)
  for i = 1, #list do if list[i] == name then return end end
  list[#list + 1] = name
end

-- Parameter views (a registration point).  A system that takes over parameter slots of a module (FSDP's
-- groups: lua/engine/distributed/fsdp.lua) keeps a view table in the module's _param_view field (parameter name
-- -> its entry) and registers how to read it: current(view, name) the tensor forward computes with now (nil: the
-- registered parameter), leaf(view, name) the tensor that gets the gradient (nn.checkpoint), owner a phrase
-- for messages.  nn names no such system.
local param_views = nil
function M._register_param_views(kind) param_views = kind end
function M._param_views() return param_views end

-- A parameter slot owned by a view: forward computes with what the view gives for the parameter it
-- registered, so a Parameter assigned in its place would be ignored.
local function check_not_viewed(self, name, p)
  local view = rawget(self, "_param_view")
  if view and view[name] and not rawequal(p, rawget(self, "_parameters")[name]) then
    core.fail(string.format("%s: cannot assign to parameter '%s': it is managed by %s; "
      .. "write new values into it instead: load_state_dict, or copy_ under no_grad", self.__name, name,
      param_views and param_views.owner or "another system"))
  end
end

local function set_parameter(self, name, p)
  check_not_viewed(self, name, p)
  local params = rawget(self, "_parameters")
  if params[name] == nil and not rawget(self, "_param_none")[name] then
    unregister(self, name)
    rawset(self, name, nil)
  end
  add_name(rawget(self, "_param_names"), name)
  params[name] = p
  rawget(self, "_param_none")[name] = (p == nil) or nil
end

local function set_module(self, name, m)
  if rawget(self, "_modules")[name] == nil then unregister(self, name); rawset(self, name, nil) end
  add_name(rawget(self, "_module_names"), name)
  rawget(self, "_modules")[name] = m
end

local function module_newindex(self, k, v)
  if type(k) ~= "string" then rawset(self, k, v); return end
  local params = rawget(self, "_parameters")
  if is_param(v) then
    set_parameter(self, k, v)
  elseif is_module(v) then
    set_module(self, k, v)
  elseif params[k] ~= nil or rawget(self, "_param_none")[k] then
    if v == nil then
      check_not_viewed(self, k, v)
      params[k] = nil; rawget(self, "_param_none")[k] = true  -- like register_parameter(k, None)
    elseif is_tensor(v) then
      error(string.format("%s: cannot assign a plain tensor to parameter '%s': wrap it in nn.Parameter(t) "
        .. "(or use register_buffer for a non-trainable tensor)", self.__name, k), 2)
    else
      error(string.format("%s: cannot assign a %s to parameter '%s' (expected nn.Parameter or nil)",
        self.__name, type(v), k), 2)
    end
  elseif rawget(self, "_modules")[k] ~= nil then
    if v == nil then unregister(self, k)
    else error(string.format("%s: cannot assign a %s to submodule '%s' (expected a Module or nil)",
      self.__name, type(v), k), 2) end
  elseif rawget(self, "_buffers")[k] ~= nil then
    if v == nil then unregister(self, k)
    elseif is_tensor(v) then rawget(self, "_buffers")[k] = v
    else error(string.format("%s: cannot assign a %s to buffer '%s' (expected a tensor or nil)",
      self.__name, type(v), k), 2) end
  else
    rawset(self, k, v)
  end
end

-- A module with a parameter view gives what the view says is current (for FSDP: the unsharded parameter
-- while the group is unsharded).
local function viewed_param(self, k, v)
  local view = rawget(self, "_param_view")
  if view == nil then return v end
  return param_views.current(view, k) or v
end

-- nn.checkpoint's region: while set, every parameter lookup appends (module, name) to this list, so that the
-- checkpoint knows the parameters its function reads (M._set_param_reads)
local param_reads
function M._set_param_reads(list)
  local prev = param_reads
  param_reads = list
  return prev
end

local function make_index(cls)
  return function(self, k)
    local v = rawget(self, "_parameters")[k]
    if v ~= nil then
      local r = param_reads
      if r then r[#r + 1] = self; r[#r + 1] = k end
      return viewed_param(self, k, v)
    end
    v = rawget(self, "_modules")[k]
    if v ~= nil then return v end
    v = rawget(self, "_buffers")[k]
    if v ~= nil then return v end
    return cls[k]
  end
end

-- Forward with hooks.  Calls eng_module_run_hooks, which may call back into
-- Lua (user hooks): this function must never run inside a JIT trace.
local function take_back(arr, list, pos)
  -- arr holds new references: wrap replaced tensors, drop the extra reference of unchanged ones
  for j = 1, #pos do
    local p, orig = arr[j - 1], list[pos[j]]
    if p == orig._c then C.eng_tensor_release(p) else list[pos[j]] = core.wrap(p) end
  end
end

local function run_hooks(self, kind, list, n)
  local pos = {}
  for i = 1, n do if is_tensor(list[i]) then pos[#pos + 1] = i end end
  local k = #pos
  local arr = ffi.new("eng_tensor*[?]", k > 0 and k or 1)
  for j = 1, k do arr[j - 1] = C.eng_tensor_retain(list[pos[j]]._c) end
  local rc = C.eng_module_run_hooks(rawget(self, "_cmod"), kind, arr, k)
  local msg = rc ~= 0 and core.last_error() or nil
  take_back(arr, list, pos)
  if msg then error(msg, 0) end
end

-- The forward hooks of an object output res[1] (a table with a metatable that is not a tensor): the
-- object travels in the module's _hook_output box, the C hook list runs with no tensors, and each Lua
-- forward hook (register_forward_hook's wrapper) is called with the box's value as the output and
-- replaces it when it returns non-nil.
local function run_object_hooks(self, res)
  local prev = rawget(self, "_hook_output")
  local box = { res[1] }
  rawset(self, "_hook_output", box)
  local ok, err = pcall(run_hooks, self, POST, {}, 0)
  rawset(self, "_hook_output", prev)
  if not ok then error(err, 0) end
  res[1] = box[1]
end

local function call_with_hooks(self, ...)
  local cm = rawget(self, "_cmod")
  local n = select("#", ...)
  local args = { ... }
  if hook_count(cm, PRE) > 0 then run_hooks(self, PRE, args, n) end
  local prev = rawget(self, "_hook_inputs")
  rawset(self, "_hook_inputs", args)
  local res = { pcall(self.forward, self, unpack(args, 1, n)) }
  if not res[1] then rawset(self, "_hook_inputs", prev); error(res[2], 0) end
  local nr = table.maxn(res) - 1
  table.remove(res, 1)
  if hook_count(cm, POST) > 0 then
    local ok, err
    if nr == 1 and type(res[1]) == "table" and not is_tensor(res[1]) and getmetatable(res[1]) ~= nil then
      -- forward returned an object (a ShardedTensor, ...): one output value, which the Lua hooks get
      -- and may replace (C hooks see no tensors)
      ok, err = pcall(run_object_hooks, self, res)
    elseif nr == 1 and type(res[1]) == "table" and not is_tensor(res[1]) then
      -- forward returned a list of tensors (a table without a metatable): hook its elements, return a new list
      local list = {}
      for i, v in pairs(res[1]) do list[i] = v end
      ok, err = pcall(run_hooks, self, POST, list, table.maxn(list))
      res[1] = list
    else
      ok, err = pcall(run_hooks, self, POST, res, nr)
    end
    rawset(self, "_hook_inputs", prev)
    if not ok then error(err, 0) end
  else
    rawset(self, "_hook_inputs", prev)
  end
  return unpack(res, 1, nr)
end
jit.off(call_with_hooks)
jit.off(run_hooks)
jit.off(run_object_hooks)

-- Activation checkpointing marks (a registration point).  nn.apply_activation_checkpointing marks a module in
-- place (its _checkpoint field, set with rawset; PyTorch's composable checkpoint(module)): no wrapper module, so
-- parameter and state-dict names, hooks and FSDP's class swap stay as they are.  A marked module's call goes
-- to the function engine.nn.checkpoint registers here (it runs the call as nn.checkpoint(module, ...), which
-- calls the module again inside the region: that inner call runs unmarked, M._call_unmarked).  module.lua
-- names no checkpointing code (engine.nn.checkpoint requires this file, not the other way round).
local checkpoint_call = nil
function M._register_checkpoint_call(fn) checkpoint_call = fn end

-- The call without the mark: forward-pre hooks, forward, forward hooks.
local function call_unmarked(self, ...)
  local cm = rawget(self, "_cmod")
  if hook_count(cm, PRE) == 0 and hook_count(cm, POST) == 0 then
    return self:forward(...)
  end
  return call_with_hooks(self, ...)
end
M._call_unmarked = call_unmarked

local function module_call(self, ...)
  if rawget(self, "_checkpoint") then return checkpoint_call(self, ...) end  -- (one lookup when nothing is marked)
  return call_unmarked(self, ...)
end

local function module_tostring(self) return self:_repr("") end

local class_mt = {}

local function construct(cls, ...)
  local self = {
    _parameters = {}, _param_names = {}, _param_none = {},
    _buffers = {}, _buffer_names = {}, _non_persistent = {},
    _modules = {}, _module_names = {},
    _cmod = ffi.gc(C.eng_module_new(cls.__name), C.eng_module_release),
    training = true,
  }
  setmetatable(self, cls)
  local init = cls.__init
  if init then init(self, ...) end
  return self
end

local function make_class(name, parent)
  local cls = {
    __name = name, __parent = parent,
    __newindex = module_newindex, __call = module_call, __tostring = module_tostring,
  }
  cls.__index = make_index(cls)
  return setmetatable(cls, {
    __index = parent, __call = construct,
    __tostring = function(c) return "nn." .. c.__name .. " (Module class)" end,
  })
end

-- Module:extend(name) -> a new Module class deriving from this one.
function Module.extend(parent, name)
  if type(name) ~= "string" or name == "" then
    error("Module:extend: expected a class name (a non-empty string)", 2)
  end
  return make_class(name, parent)
end

Module.__name = "Module"
Module.__newindex = module_newindex
Module.__call = module_call
Module.__tostring = module_tostring
Module.__index = make_index(Module)
setmetatable(Module, { __call = construct, __tostring = function() return "nn.Module (Module class)" end })

-- isinstance: m:is_a(nn.Linear)
function Module:is_a(cls)
  local c = getmetatable(self)
  while c do
    if c == cls then return true end
    c = rawget(c, "__parent")
  end
  return false
end

function Module:forward()
  error(self.__name .. ": forward is not implemented (define " .. self.__name .. ":forward)", 2)
end

-- ---------------------------------------------------------------- registration
-- register_parameter(name, p): p is an nn.Parameter or nil (declares the slot empty).
function Module:register_parameter(name, p)
  check_name(self, name, "parameter", 2)
  if p ~= nil and not is_param(p) then
    error(string.format("%s: register_parameter('%s'): expected nn.Parameter or nil, got %s",
      self.__name, name, is_tensor(p) and "a plain tensor (wrap it in nn.Parameter)" or type(p)), 2)
  end
  set_parameter(self, name, p)
  return p
end

-- register_buffer(name, t [, persistent = true]): a tensor saved in state_dict
-- (if persistent) and converted by to(), but not trained.
function Module:register_buffer(name, t, persistent)
  check_name(self, name, "buffer", 2)
  if t ~= nil and not is_tensor(t) then
    error(string.format("%s: register_buffer('%s'): expected a tensor or nil, got %s", self.__name, name, type(t)), 2)
  end
  if rawget(self, "_buffers")[name] == nil then unregister(self, name); rawset(self, name, nil) end
  add_name(rawget(self, "_buffer_names"), name)
  rawget(self, "_buffers")[name] = t
  rawget(self, "_non_persistent")[name] = (persistent == false) or nil
  return t
end

function Module:register_module(name, m)
  check_name(self, name, "submodule", 2)
  if m ~= nil and not is_module(m) then
    error(string.format("%s: register_module('%s'): expected a Module, got %s", self.__name, name, type(m)), 2)
  end
  if m == nil then unregister(self, name) else set_module(self, name, m) end
  return m
end
Module.add_module = Module.register_module

-- ---------------------------------------------------------------- traversal
-- Ordered direct children: names, modules (containers override this).
function Module:_children_list()
  local names, mods = {}, {}
  local reg = rawget(self, "_modules")
  for _, name in ipairs(rawget(self, "_module_names")) do
    local m = reg[name]
    if m ~= nil then names[#names + 1] = name; mods[#mods + 1] = m end
  end
  return names, mods
end

-- Child by its name (for ModuleList, "0" is the first).
function Module:_child(name)
  local names, mods = self:_children_list()
  for i = 1, #names do if names[i] == name then return mods[i] end end
  return nil
end

-- The iterator drops its lists when exhausted: LuaJIT specialises a trace to the closure it runs (while its
-- prototype has made few closures), and the trace keeps that closure alive, so a loop over named_parameters()
-- before fully_shard (counting parameters, say) kept every original full parameter alive on every rank for as
-- long as the trace lived (12.4 MiB, the whole model, in about half of the runs of recipes/bench/fsdp_step.lua;
-- found with jit.util.tracek).  Assigning the upvalues also stops the trace from folding them into constants.
local function iter(names, vals)
  local i = 0
  return function()
    i = i + 1
    local n = names and names[i]
    if n ~= nil then return n, vals[i] end
    names, vals = nil, nil
  end
end

local function join(prefix, name) return prefix == "" and name or (prefix .. "." .. name) end

-- All modules (self first, depth first) as names, modules; deduplicated by identity.
local function collect_modules(self, prefix, names, mods, memo)
  if memo then
    if memo[self] then return end
    memo[self] = true
  end
  names[#names + 1] = prefix; mods[#mods + 1] = self
  local cn, cm = self:_children_list()
  for i = 1, #cn do collect_modules(cm[i], join(prefix, cn[i]), names, mods, memo) end
end

-- named_modules([prefix]) -> iterator of (name, module); self is named "" (or prefix).
function Module:named_modules(prefix, remove_duplicate)
  local names, mods = {}, {}
  collect_modules(self, prefix or "", names, mods, remove_duplicate ~= false and {} or nil)
  return iter(names, mods)
end

-- modules() -> list of every module (self first).
function Module:modules()
  local names, mods = {}, {}
  collect_modules(self, "", names, mods, {})
  return mods
end

-- named_children() -> iterator of (name, child); children() -> list.
function Module:named_children()
  local names, mods = self:_children_list()
  local seen, n2, m2 = {}, {}, {}
  for i = 1, #names do
    if not seen[mods[i]] then seen[mods[i]] = true; n2[#n2 + 1] = names[i]; m2[#m2 + 1] = mods[i] end
  end
  return iter(n2, m2)
end

function Module:children()
  local out = {}
  for _, m in self:named_children() do out[#out + 1] = m end
  return out
end

-- Collects (name, tensor) of parameters or buffers.
local function collect_tensors(self, kind, prefix, recurse, dedup)
  local names, vals = {}, {}
  local seen = {}
  local mnames, mods = {}, {}
  if recurse then collect_modules(self, prefix, mnames, mods, {}) else mnames[1], mods[1] = prefix, self end
  for i = 1, #mods do
    local m = mods[i]
    local reg = rawget(m, kind == "param" and "_parameters" or "_buffers")
    for _, name in ipairs(rawget(m, kind == "param" and "_param_names" or "_buffer_names")) do
      local t = reg[name]
      if t ~= nil then
        local key = ptr_key(t)
        if not (dedup and seen[key]) then
          seen[key] = true
          names[#names + 1] = join(mnames[i], name); vals[#vals + 1] = t
        end
      end
    end
  end
  return names, vals
end

-- named_parameters([prefix [, recurse = true [, remove_duplicate = true]]])
--   -> iterator of (name, parameter).  Tied parameters (one tensor under
--   several names) appear once, under the first name.
function Module:named_parameters(prefix, recurse, remove_duplicate)
  if type(prefix) == "table" then
    local o = prefix
    prefix, recurse, remove_duplicate = o.prefix, o.recurse, o.remove_duplicate
  end
  return iter(collect_tensors(self, "param", prefix or "", recurse ~= false, remove_duplicate ~= false))
end

-- parameters([recurse = true]) -> list of parameters (deduplicated).
function Module:parameters(recurse)
  local _, vals = collect_tensors(self, "param", "", recurse ~= false, true)
  return vals
end

function Module:named_buffers(prefix, recurse)
  return iter(collect_tensors(self, "buffer", prefix or "", recurse ~= false, true))
end

function Module:buffers(recurse)
  local _, vals = collect_tensors(self, "buffer", "", recurse ~= false, true)
  return vals
end

-- Number of (distinct) parameter elements.
function Module:num_parameters(only_trainable)
  local n = 0
  for _, p in ipairs(self:parameters()) do
    if not only_trainable or p.requires_grad then n = n + p:numel() end
  end
  return n
end

-- get_submodule("layers.0.attention") -> module (error naming the missing part with PyTorch's words:
-- "ModuleList has no attribute `2`", "`weight` is not an nn.Module", then where and the children).
function Module:get_submodule(target)
  if target == nil or target == "" then return self end
  if type(target) ~= "string" then error("get_submodule: target must be a string", 2) end
  local m, path = self, ""
  for atom in target:gmatch("[^.]+") do
    local c = m:_child(atom)
    if c == nil then
      local names = m:_children_list()
      local where = path == "" and "" or ("at '" .. path .. "'; ")
      local what = string.format("%s has no attribute `%s`", m.__name, atom)
      if m[atom] ~= nil then what = "`" .. atom .. "` is not an nn.Module" end
      error(string.format("get_submodule: %s (%schildren: %s)", what, where,
        #names > 0 and table.concat(names, ", ") or "none"), 2)
    end
    m = c
    path = join(path, atom)
  end
  return m
end

-- get_parameter("layers.0.attention.wq.weight") -> parameter.
function Module:get_parameter(target)
  if type(target) ~= "string" then error("get_parameter: target must be a string", 2) end
  local mod_path, name = target:match("^(.*)%.([^.]+)$")
  if not mod_path then mod_path, name = "", target end
  local ok, m = pcall(self.get_submodule, self, mod_path)
  if not ok then error(m, 2) end
  local p = rawget(m, "_parameters")[name]
  if p == nil then
    error(string.format("get_parameter: %s has no parameter '%s'", m.__name, name), 2)
  end
  return p
end

-- apply(fn): fn(m) on every submodule (children first, then self); returns self.
function Module:apply(fn)
  for _, c in ipairs(self:children()) do c:apply(fn) end
  fn(self)
  return self
end

-- ---------------------------------------------------------------- modes and gradients
function Module:train(mode)
  if mode == nil then mode = true end
  for _, m in ipairs(self:modules()) do rawset(m, "training", mode and true or false) end
  return self
end

function Module:eval() return self:train(false) end

-- zero_grad([set_to_none = true])
function Module:zero_grad(set_to_none)
  if type(set_to_none) == "table" then set_to_none = set_to_none.set_to_none end
  for _, p in ipairs(self:parameters()) do
    if p._c.grad ~= nil then
      if set_to_none == false then core.check(C.eng_tensor_zero_(p._c.grad), 3)
      else core.check(C.eng_tensor_set_grad(p._c, nil), 3) end
    end
  end
end

function Module:requires_grad_(flag)
  if flag == nil then flag = true end
  for _, p in ipairs(self:parameters()) do p:requires_grad_(flag) end
  return self
end

-- ---------------------------------------------------------------- conversion
-- fn(t, is_param) for every parameter, then every buffer, of every module,
-- each tensor once (tied ones too), under no_grad; errors propagate (level 3:
-- the caller of the Module method).
local function each_state_tensor(self, fn)
  local seen = {}
  local prev = C.eng_set_grad_enabled(0)
  local ok, err = pcall(function()
    for _, m in ipairs(self:modules()) do
      for _, kind in ipairs({ { "_parameters", "_param_names", true }, { "_buffers", "_buffer_names", false } }) do
        local tensors = rawget(m, kind[1])
        for _, name in ipairs(rawget(m, kind[2])) do
          local t = tensors[name]
          if t ~= nil and not seen[ptr_key(t)] then
            seen[ptr_key(t)] = true
            fn(t, kind[3])
          end
        end
      end
    end
  end)
  C.eng_set_grad_enabled(prev)
  if not ok then error(err, 3) end
end

-- After to / to_empty: modules whose parameters are views of one fused tensor (the models' QKV weights,
-- lua/engine/models.lua) make them views of one tensor again (each parameter was converted on its own).
local function refuse(self)
  for _, m in ipairs(self:modules()) do
    local f = m._refuse
    if f then f(m) end
  end
end

-- to(dtype) / to("cuda") / to("cpu") / to{dtype=, device=}: converts the
-- parameters (floating ones only for a dtype change) and buffers IN PLACE, as
-- PyTorch's module.to: every Parameter keeps its identity (the same Lua
-- object and C tensor, with its flags, hooks and gradient, which is converted
-- too) and takes the converted data, so tied parameters stay tied and
-- optimizers built before or after see the moved tensors.  Without a GPU,
-- to("cuda") fails before anything changes.  Returns self.
function Module:to(what)
  local dt, dev
  if type(what) == "table" then dt, dev = what.dtype, what.device
  elseif Tensor.device_code(what) then dev = what
  else dt = what end
  local op = "module:to(" .. (type(what) == "string" and ('"' .. what .. '"') or "...") .. ")"
  local code
  if dev ~= nil then
    code = Tensor.device_code(dev)
    if not code then core.fail(op .. ": unknown device '" .. tostring(dev) .. Tensor.bad_device) end
    Tensor.require_device(code, op)
  end
  local dcode = dt ~= nil and core.dtype(dt, "to", 3) or nil
  local function check_ptr(p) if p == nil then core.raise() end return p end
  -- the converted data of tensor c (a new reference), or nil when unchanged
  local function converted(c, floating_only)
    local r, owned = c, false
    if c.dist ~= nil then
      -- a DTensor (FSDP, TP parameters) converts its local shard and keeps its layout
      r = check_ptr(C.eng_dtensor_local_view(c)); owned = true
    end
    if code and c.device ~= code then
      local r2 = check_ptr(C.eng_tensor_to_device(r, code))
      if owned then C.eng_tensor_release(r) end
      r, owned = r2, true
    end
    if dcode and r.dtype ~= dcode and (not floating_only or C.eng_dtype_is_floating(r.dtype) ~= 0) then
      local r2 = check_ptr(C.eng_tensor_to_dtype(r, dcode))
      if owned then C.eng_tensor_release(r) end
      r, owned = r2, true
    elseif c.dist ~= nil and r.dtype == c.dtype and r.device == c.device then
      C.eng_tensor_release(r); return nil   -- the local view alone: nothing changes
    end
    return owned and r or nil
  end
  local function swap(c, floating_only)
    local r = converted(c, floating_only)
    if r == nil then return end
    local rc = C.eng_tensor_set_data(c, r)
    C.eng_tensor_release(r)
    core.check(rc)
  end
  each_state_tensor(self, function(t, is_param)
    if is_param and t._c.grad ~= nil then swap(t._c.grad, true) end
    swap(t._c, true)
  end)
  refuse(self)
  return self
end
-- to_empty{device = "cpu"} (or to_empty("cpu")): PyTorch's module.to_empty.
-- Every parameter and buffer gets new UNINITIALISED storage of its shape and
-- dtype on device, in place (identities, flags, hooks and tied parameters
-- kept; gradients are dropped); a DTensor parameter keeps its layout and gets
-- an empty local shard.  The way out of the meta device: build on "meta"
-- (engine.with_device), parallelise, to_empty, then initialise
-- (reset_parameters, nn.init; a DTensor draws its shard of the global random
-- tensor, so every layout gets the values a single process would).
function Module:to_empty(opts)
  local op = "module:to_empty"
  if type(opts) == "table" then core.check_opts(opts, { "device" }, op) end
  local dev = type(opts) == "table" and opts.device or opts
  local code = Tensor.device_code(dev)
  if not code then core.fail(op .. ": unknown device '" .. tostring(dev) .. Tensor.bad_device) end
  Tensor.require_device(code, op)
  local function swap(c)
    local r = C.eng_tensor_empty(c.ndim, c.shape, c.dtype, code) -- the local shape for a DTensor
    if r == nil then core.raise() end
    local rc = C.eng_tensor_set_data(c, r)
    C.eng_tensor_release(r)
    core.check(rc)
  end
  each_state_tensor(self, function(t)
    if t._c.grad ~= nil then core.check(C.eng_tensor_set_grad(t._c, nil)) end
    swap(t._c)
  end)
  refuse(self)
  return self
end

function Module:cuda() return self:to("cuda") end
function Module:cpu() return self:to("cpu") end

function Module:float() return self:to("f32") end
function Module:double() return self:to("f64") end
function Module:half() return self:to("f16") end
function Module:bfloat16() return self:to("bf16") end

-- ---------------------------------------------------------------- state dict
-- Walks every (name, tensor, kind) of the state dict in order, without
-- deduplication (tied weights appear under each of their names, as in PyTorch).
local function state_entries(self, prefix, names, vals, kinds)
  local params = rawget(self, "_parameters")
  for _, name in ipairs(rawget(self, "_param_names")) do
    local p = params[name]
    if p ~= nil then names[#names + 1] = prefix .. name; vals[#vals + 1] = p; kinds[#kinds + 1] = "param" end
  end
  local bufs, np = rawget(self, "_buffers"), rawget(self, "_non_persistent")
  for _, name in ipairs(rawget(self, "_buffer_names")) do
    local b = bufs[name]
    if b ~= nil and not np[name] then
      names[#names + 1] = prefix .. name; vals[#vals + 1] = b; kinds[#kinds + 1] = "buffer"
    end
  end
  local cn, cm = self:_children_list()
  for i = 1, #cn do state_entries(cm[i], prefix .. cn[i] .. ".", names, vals, kinds) end
end

-- _register_state_dict_hook(fn) / _register_load_state_dict_pre_hook(fn) (PyTorch's): fn(module, sd,
-- prefix) runs for this module (prefix: its dotted path and ".") after state_dict collected the
-- entries (it may replace or add values, e.g. ShardedTensors for sharded parameters), or before
-- load_state_dict checks the keys (on a shallow copy of sd: it may replace or consume values).
local function run_state_hooks(self, field, sd, prefix)
  for name, m in self:named_modules() do
    local hooks = rawget(m, field)
    if hooks then for _, fn in ipairs(hooks) do fn(m, sd, prefix .. (name == "" and "" or (name .. "."))) end end
  end
end
local function add_state_hook(self, field, fn, op)
  if type(fn) ~= "function" then error(op .. ": expected a function", 3) end
  local l = rawget(self, field)
  if not l then l = {}; rawset(self, field, l) end
  l[#l + 1] = fn
end
function Module:_register_state_dict_hook(fn) add_state_hook(self, "_state_dict_hooks", fn, "_register_state_dict_hook") end
function Module:_register_load_state_dict_pre_hook(fn)
  add_state_hook(self, "_load_state_dict_pre_hooks", fn, "_register_load_state_dict_pre_hook")
end

-- state_dict([{prefix = "", keep_vars = false}]) -> table name -> tensor (one
-- value, so engine.save(path, m:state_dict()) works; the ordered names are
-- state_dict_keys()).  Values share storage with the parameters (detached
-- unless keep_vars).
function Module:state_dict(opts)
  opts = core.check_opts(opts, { "prefix", "keep_vars" }, "state_dict")
  local names, vals, kinds = {}, {}, {}
  state_entries(self, opts.prefix or "", names, vals, kinds)
  local sd = {}
  for i = 1, #names do
    local v = vals[i]
    sd[names[i]] = opts.keep_vars and v or v:detach()
  end
  run_state_hooks(self, "_state_dict_hooks", sd, opts.prefix or "")
  return sd
end

-- Ordered state-dict names.
function Module:state_dict_keys()
  local names, vals, kinds = {}, {}, {}
  state_entries(self, "", names, vals, kinds)
  return names
end

-- FNV-1a of a string, as a number below 2^32
local function fnv32(str)
  local h = 2166136261
  for i = 1, #str do h = bit.bxor(h, str:byte(i)); h = (h * 16777619) % 4294967296 end
  return h
end

-- What would make copying src into dst fail or come out wrong, found before anything is written: a
-- DTensor into a plain tensor (its local shard would be taken for the whole), DTensors on different
-- meshes, an expanded destination (PyTorch's internal-overlap error).
local function copy_problem(name, dst, src)
  local dd, sd = dst._c.dist, src._c.dist
  if sd ~= nil and dd == nil then
    return string.format("%s: the value is a DTensor (%s) and the parameter a plain tensor %s: layouts differ "
      .. "(load value:full_tensor())", name, src:_layout_str(), shape_str(dst))
  end
  if sd ~= nil and dd ~= nil and sd.mesh ~= dd.mesh and C.eng_mesh_equal(sd.mesh, dd.mesh) == 0 then
    return string.format("%s: the value %s and the parameter %s are on different device meshes: layouts differ "
      .. "(redistribute is within one mesh: load value:full_tensor())", name, src:_layout_str(), dst:_layout_str())
  end
  if dd == nil and C.eng_tensor_check_overlap(dst._c, nil, "load_state_dict") ~= 0 then
    return name .. ": " .. core.last_error():gsub("^load_state_dict: ", "")
  end
  return nil
end

-- load_state_dict(sd [, {strict = true}]): copies the values into the
-- parameters and buffers (converting dtypes).  Every problem is reported in
-- one error: missing keys and unexpected keys (strict only) and shape
-- mismatches (always).  Nothing is copied when there is an error.  Returns
-- {missing_keys = {...}, unexpected_keys = {...}}.
function Module:load_state_dict(sd, opts)
  if type(sd) ~= "table" then error("load_state_dict: expected a table name -> tensor, got " .. type(sd), 2) end
  if opts ~= nil then core.check_opts(opts, { "strict" }, "load_state_dict") end
  local strict = not (opts and opts.strict == false)
  local copy = {}
  for k, v in pairs(sd) do copy[k] = v end
  sd = copy
  run_state_hooks(self, "_load_state_dict_pre_hooks", sd, "")
  local names, vals, kinds = {}, {}, {}
  state_entries(self, "", names, vals, kinds)
  local known, missing, unexpected, bad = {}, {}, {}, {}
  -- a distributed model: the same on every rank whatever sd holds (the agreement below is collective)
  local dist_state, sig = false, {}
  for i = 1, #vals do if vals[i]._c.dist ~= nil then dist_state = true end end
  for i = 1, #names do
    local name, dst = names[i], vals[i]
    known[name] = true
    local src = sd[name]
    if src == nil then
      missing[#missing + 1] = name
    elseif not is_tensor(src) then
      bad[#bad + 1] = string.format("value for %s is a %s, not a tensor", name, type(src))
    else
      local ss, ds = src:shape(), dst:shape()
      local same = #ss == #ds
      if same then for d = 1, #ss do if ss[d] ~= ds[d] then same = false end end end
      if not same then
        bad[#bad + 1] = string.format("size mismatch for %s: copying a param with shape %s from checkpoint, "
          .. "the shape in current model is %s", name, shape_str(src), shape_str(dst))
      else
        local b = copy_problem(name, dst, src)
        if b then bad[#bad + 1] = b end
      end
      -- a DTensor source of another layout is redistributed (collectives): the ranks must agree on them
      if src._c.dist ~= nil and not (dst._c.dist ~= nil and C.eng_dist_spec_equal(src._c.dist, dst._c.dist) ~= 0) then
        sig[#sig + 1] = name .. "=" .. src:_layout_str()
      end
    end
  end
  for k in pairs(sd) do
    if not known[k] then unexpected[#unexpected + 1] = tostring(k) end
  end
  table.sort(unexpected)
  local errs = {}
  if strict and #missing > 0 then
    errs[#errs + 1] = "Missing key(s) in state_dict: " .. table.concat(missing, ", ")
  end
  if strict and #unexpected > 0 then
    errs[#errs + 1] = "Unexpected key(s) in state_dict: " .. table.concat(unexpected, ", ")
  end
  for _, b in ipairs(bad) do errs[#errs + 1] = b end
  local err = #errs > 0 and string.format("load_state_dict: error(s) in loading state_dict for %s:\n\t%s",
    self.__name, table.concat(errs, "\n\t")) or nil
  -- a distributed model (DTensor parameters: fully_shard, parallelize_module) is loaded on every rank or on
  -- none: a failure here on one rank (a state dict that differs there) fails every rank before anything is
  -- written, instead of leaving this rank's model as it was while the others load theirs and go on
  if dist_state and C.eng_dist_world_size() > 1 then
    if err then C.eng_set_error_message(err) end
    local world = C.eng_pg_world()
    local rc = C.eng_pg_agree(world, err and 1 or 0, fnv32(table.concat(sig, "\n")), "load_state_dict")
    C.eng_pg_release(world)
    if rc ~= 0 then
      if err then error(err, 2) end
      local msg = core.last_error()
      if not msg:find("failed its checks", 1, true) then
        msg = "load_state_dict: the ranks passed state dicts whose DTensor entries differ in their layouts (so the "
          .. "redistributions would not match): nothing was loaded (" .. msg .. ")"
      end
      error(msg, 2)
    end
  end
  if err then error(err, 2) end
  local prev = C.eng_set_grad_enabled(0)
  for i = 1, #names do
    local src = sd[names[i]]
    if src ~= nil and not rawequal(src, vals[i]) and src._c ~= vals[i]._c then
      local dst = vals[i]
      if dst._c.dist ~= nil and src._c.dist == nil then
        -- a full tensor into a DTensor (FSDP / TP parameters): this rank's shard of it, no communication
        local okd, d = pcall(function()
          local dt = require("engine.distributed.dtensor")
          return dt.distribute_tensor(src, dst.device_mesh, dst.placements, { src_data_rank = false })
        end)
        if not okd then
          C.eng_set_grad_enabled(prev)
          error("load_state_dict: " .. names[i] .. ": " .. tostring(d), 2)
        end
        src = d
      end
      local rc = C.eng_tensor_copy_(vals[i]._c, src._c)
      if rc ~= 0 then
        C.eng_set_grad_enabled(prev)
        error("load_state_dict: " .. names[i] .. ": " .. core.last_error(), 2)
      end
    end
  end
  C.eng_set_grad_enabled(prev)
  return { missing_keys = missing, unexpected_keys = unexpected }
end

-- ---------------------------------------------------------------- hooks
local Handle = autograd.Handle

local function add_hook(self, kind, wrapper, opts, op)
  if opts ~= nil then core.check_opts(opts, { "prepend" }, op) end
  local id = autograd._register(wrapper)
  local cm = rawget(self, "_cmod")
  local h = C.eng_module_register_lua_hook(cm, kind, id, (opts and opts.prepend) and 1 or 0)
  if h < 0 then autograd._closures[id] = nil; error(op .. ": " .. core.last_error(), 3) end
  return setmetatable({ _remove = function() C.eng_module_remove_hook(cm, h) end }, Handle)
end

-- register_forward_pre_hook(fn [, {prepend = false}]): fn(module, inputs) runs
-- before forward; inputs is the list of tensor arguments.  It may return nil
-- (keep), a tensor (replaces the first) or a list of tensors (replace in
-- order; nil entries keep).  Returns a handle with :remove().
function Module:register_forward_pre_hook(fn, opts)
  if type(fn) ~= "function" then error("register_forward_pre_hook: expected a function", 2) end
  local ref = setmetatable({ m = self }, { __mode = "v" })  -- the hook must not keep the module alive
  return add_hook(self, PRE, function(...) return fn(ref.m, { ... }) end, opts, "register_forward_pre_hook")
end

-- register_forward_hook(fn [, {prepend = false}]): fn(module, inputs, output)
-- runs after forward (inputs: the tensor arguments after the pre hooks;
-- output: the output tensor; with several output tensors they follow as
-- further arguments).  It may return replacements like a pre hook.  An output
-- that is an object (a table with a metatable that is not a tensor, e.g. a
-- ShardedTensor) is one value: fn gets it as output and may return a
-- replacement of any kind (a table without a metatable is a list of tensors).
function Module:register_forward_hook(fn, opts)
  if type(fn) ~= "function" then error("register_forward_hook: expected a function", 2) end
  local ref = setmetatable({ m = self }, { __mode = "v" })
  return add_hook(self, POST, function(...)
    local m = ref.m
    local inputs = {}
    local hi = m and rawget(m, "_hook_inputs")
    if hi then for _, v in pairs(hi) do if is_tensor(v) then inputs[#inputs + 1] = v end end end
    local box = m and rawget(m, "_hook_output")
    if box and select("#", ...) == 0 then   -- an object output (call_with_hooks' run_object_hooks)
      local r = fn(m, inputs, box[1])
      if r ~= nil then box[1] = r end
      return nil
    end
    return fn(m, inputs, ...)
  end, opts, "register_forward_hook")
end

-- register_full_backward_hook(fn [, {prepend = false}]): fn(module, grad_input, grad_output) once the
-- gradients w.r.t. the module's tensor inputs are computed; may return a list replacing grad_input
-- (engine.autograd.register_full_backward_hook).  Returns a handle with :remove().
function Module:register_full_backward_hook(fn, opts)
  return autograd.register_full_backward_hook(self, fn, opts)
end

-- ---------------------------------------------------------------- printing
function Module:extra_repr() return "" end

-- (a module marked for activation checkpointing shows " [checkpointed]" after its opening line)
function Module:_repr(indent)
  local names, mods = self:_children_list()
  local extra = self:extra_repr() or ""
  local mark = rawget(self, "_checkpoint") and " [checkpointed]" or ""
  if #names == 0 then return self.__name .. "(" .. extra .. ")" .. mark end
  local lines = { self.__name .. "(" .. mark }
  local inner = indent .. "  "
  if extra ~= "" then lines[#lines + 1] = inner .. extra end
  for i = 1, #names do
    lines[#lines + 1] = inner .. "(" .. names[i] .. "): " .. mods[i]:_repr(inner)
  end
  lines[#lines + 1] = indent .. ")"
  return table.concat(lines, "\n")
end

return M
