-- engine.nn.container: Sequential, ModuleList, ModuleDict, Identity.
--
-- Sequential and ModuleList keep their children in the Lua array part
-- (m[1], m[2], ...; #m; ipairs(m)); their names are "0", "1", ... (0-based,
-- PyTorch's state-dict names): list[1] is the child named "0".
local mod = require("engine.nn.module")
local Module, is_module = mod.Module, mod.is_module

local M = {}

local function array_children(self)
  local names, mods = {}, {}
  for i = 1, #self do names[i] = tostring(i - 1); mods[i] = self[i] end
  -- named submodules registered by assignment come after the list
  local n2, m2 = Module._children_list(self)
  for i = 1, #n2 do names[#names + 1] = n2[i]; mods[#mods + 1] = m2[i] end
  return names, mods
end

local function check_module(v, op, i)
  if not is_module(v) then
    error(string.format("%s: element %s is a %s, not a Module", op, tostring(i), type(v)), 4)
  end
  return v
end

-- ---------------------------------------------------------------- ModuleList
local ModuleList = Module:extend("ModuleList")
M.ModuleList = ModuleList

-- ModuleList([{m1, m2, ...}])
function ModuleList:__init(list)
  if list ~= nil then
    if type(list) ~= "table" or is_module(list) then
      error("ModuleList: expected a list of modules", 3)
    end
    for i = 1, #list do self[i] = check_module(list[i], "ModuleList", i) end
  end
end

ModuleList._children_list = array_children

function ModuleList:append(m)
  self[#self + 1] = check_module(m, "ModuleList:append", #self + 1)
  return self
end

function ModuleList:extend(list)
  for i = 1, #list do self:append(list[i]) end
  return self
end

-- insert(i, m): inserts before position i (1-based).
function ModuleList:insert(i, m)
  check_module(m, "ModuleList:insert", i)
  table.insert(self, i, m)
  return self
end

function ModuleList:len() return #self end
function ModuleList:ipairs() return ipairs(self) end

function ModuleList:forward()
  error("ModuleList: a ModuleList has no forward (iterate over it: for i, layer in ipairs(list) do ... end)", 2)
end

-- ---------------------------------------------------------------- Sequential
local Sequential = Module:extend("Sequential")
M.Sequential = Sequential

-- Sequential(m1, m2, ...) or Sequential({m1, m2, ...})
function Sequential:__init(...)
  local list = { ... }
  if select("#", ...) == 1 and type(list[1]) == "table" and not is_module(list[1]) then list = list[1] end
  for i = 1, #list do self[i] = check_module(list[i], "Sequential", i) end
end

Sequential._children_list = array_children
Sequential.append = ModuleList.append
Sequential.len = ModuleList.len
Sequential.ipairs = ModuleList.ipairs

function Sequential:forward(x, ...)
  for i = 1, #self do
    if i == 1 then x = self[i](x, ...) else x = self[i](x) end
  end
  return x
end

-- ---------------------------------------------------------------- ModuleDict
local ModuleDict = Module:extend("ModuleDict")
M.ModuleDict = ModuleDict

-- ModuleDict({name = module, ...}): registered in sorted name order (Lua
-- tables have no order); use :add(name, m) to control the order.
function ModuleDict:__init(dict)
  if dict ~= nil then
    local keys = {}
    for k in pairs(dict) do keys[#keys + 1] = k end
    table.sort(keys)
    for _, k in ipairs(keys) do self:register_module(k, check_module(dict[k], "ModuleDict", k)) end
  end
end

function ModuleDict:add(name, m) self:register_module(name, m); return self end

function ModuleDict:keys()
  local names = self:_children_list()
  return names
end

function ModuleDict:forward()
  error("ModuleDict: a ModuleDict has no forward", 2)
end

-- ---------------------------------------------------------------- Identity
local Identity = Module:extend("Identity")
M.Identity = Identity
function Identity:forward(x) return x end

return M
