-- engine.distributed.mesh: DeviceMesh.
--
--   local mesh = dist.init_device_mesh("cpu", {2, 2}, {"dp", "tp"})
--   mesh["tp"]                 -- 1-d sub-mesh (this rank's row along "tp")
--   mesh{"dp", "tp"}           -- in-order sub-mesh; also mesh:slice("dp", "tp")
--   mesh:size(), mesh:size("tp"), mesh:ndim(), mesh:shape()
--   mesh:get_coordinate()      -- {c1, c2} with 0-based values, nil outside the mesh
--   mesh:get_local_rank("tp")  -- 0-based
--   mesh:get_group("tp")       -- ProcessGroup of this rank's row along "tp"
--
-- Mesh dims are given by name or by 1-based index (negative from the end), as
-- tensor dims are in Lua; coordinates, local ranks and ranks stay 0-based.
-- Creating a mesh (and flatten) is collective over the world: every rank calls
-- it, also ranks outside the mesh.  Slicing communicates nothing and reuses
-- the parent's groups.  The C object is in mesh._c (eng_mesh*).
local core = require("engine.core")
local comm = require("engine.distributed.comm")
local ffi, C = core.ffi, core.C

local M = {}

local DeviceMesh = { __name = "DeviceMesh" }
local methods, props = {}, {}
DeviceMesh.methods = methods
DeviceMesh.props = props

local function cerr(level) error(core.last_error(), level + 1) end

local function wrap(p, level)
  if p == nil then cerr((level or 2) + 1) end
  return setmetatable({ _c = ffi.gc(p, C.eng_mesh_release), _slices = {}, _groups = {} }, DeviceMesh)
end
M._wrap_mesh = wrap

function M.is_mesh(x) return type(x) == "table" and getmetatable(x) == DeviceMesh end

-- Lua mesh dim (name, or 1-based index, negative from the end) -> 0-based.
local function mesh_dim(self, d, op, level)
  local nd = C.eng_mesh_ndim(self._c)
  if type(d) == "string" then
    local i = C.eng_mesh_dim_index(self._c, d)
    if i < 0 then error(op .. ": " .. core.last_error():gsub("^DeviceMesh: ", ""), level + 1) end
    return i
  end
  if type(d) ~= "number" or d % 1 ~= 0 then
    error(string.format("%s: mesh dim must be a name or an integer index, got %s", op, tostring(d)), level + 1)
  end
  if d == 0 then
    error(op .. ": mesh dim 0 is invalid: mesh dims are 1-based in Lua (1 is the first, -1 the last)", level + 1)
  end
  local i = d < 0 and nd + d or d - 1
  if i < 0 or i >= nd then
    error(string.format("%s: mesh dim %d out of range for a %d-d mesh (valid: 1..%d or -%d..-1)", op, d, nd, nd, nd),
      level + 1)
  end
  return i
end
M._mesh_dim = mesh_dim

-- A dim argument that may be omitted on a 1-d mesh (PyTorch's mesh_dim kwarg).
local function opt_dim(self, d, op, level)
  if d == nil then
    if C.eng_mesh_ndim(self._c) > 1 then
      error(op .. ": Optional kwarg `mesh_dim` needs to be specified when device_mesh.ndim > 1.", level + 1)
    end
    return 0
  end
  return mesh_dim(self, d, op, level + 1)
end

DeviceMesh.__index = function(self, k)
  local m = methods[k]
  if m ~= nil then return m end
  local p = props[k]
  if p ~= nil then return p(self) end
  if type(k) == "string" then
    if k:sub(1, 1) == "_" then return nil end
    return methods.slice(self, k)
  end
  return nil
end

DeviceMesh.__newindex = function(self, k, v)
  if props[k] or methods[k] then error("DeviceMesh: '" .. tostring(k) .. "' is read-only", 2) end
  rawset(self, k, v)
end

-- mesh{"dp", "tp"} or mesh("dp", "tp")
DeviceMesh.__call = function(self, ...) return methods.slice(self, ...) end
DeviceMesh.__eq = function(a, b) return C.eng_mesh_equal(a._c, b._c) ~= 0 end

local desc_buf = ffi.new("char[?]", 4096)
DeviceMesh.__tostring = function(self) return ffi.string(C.eng_mesh_describe(self._c, desc_buf, 4096)) end

-- ---------------------------------------------------------------- queries
function methods.ndim(self) return C.eng_mesh_ndim(self._c) end

-- size() -> number of ranks in the mesh; size(dim) -> size of that dim.
function methods.size(self, d)
  if d == nil then return C.eng_mesh_size(self._c, -1) end
  return C.eng_mesh_size(self._c, mesh_dim(self, d, "DeviceMesh.size", 2))
end

function methods.shape(self)
  local s = {}
  for i = 0, C.eng_mesh_ndim(self._c) - 1 do s[i + 1] = C.eng_mesh_size(self._c, i) end
  return s
end

-- This process's global rank.
function methods.get_rank(self) return C.eng_dist_rank() end

function methods.is_member(self)
  local buf = ffi.new("int[8]")
  return C.eng_mesh_get_coordinate(self._c, buf) ~= 0
end

-- {c1, ..., cn} (0-based values) or nil when this rank is not in the mesh.
function methods.get_coordinate(self)
  local buf = ffi.new("int[8]")
  if C.eng_mesh_get_coordinate(self._c, buf) == 0 then return nil end
  local r = {}
  for i = 0, C.eng_mesh_ndim(self._c) - 1 do r[i + 1] = buf[i] end
  return r
end

-- 0-based coordinate along dim (dim optional on a 1-d mesh); nil outside the mesh.
function methods.get_local_rank(self, d)
  local i = opt_dim(self, d, "DeviceMesh.get_local_rank", 2)
  if not methods.is_member(self) then return nil end
  local r = C.eng_mesh_get_local_rank(self._c, i)
  if r < 0 then cerr(2) end
  return r
end

-- ProcessGroup of this rank's row along dim (dim optional on a 1-d mesh).
function methods.get_group(self, d)
  local i = opt_dim(self, d, "DeviceMesh.get_group", 2)
  local g = self._groups[i]
  if not g then
    g = comm._wrap_pg(C.eng_mesh_get_group(self._c, i), 2)
    self._groups[i] = g
  end
  return g
end

function methods.get_all_groups(self)
  local r = {}
  for i = 1, C.eng_mesh_ndim(self._c) do r[i] = methods.get_group(self, i) end
  return r
end

-- Ranks as a nested Lua table (mesh shape).
function methods.ranks(self)
  local n = C.eng_mesh_size(self._c, -1)
  local buf = ffi.new("int[?]", n)
  C.eng_mesh_ranks(self._c, buf, n)
  local shape = methods.shape(self)
  local pos = 0
  local function build(d)
    local t = {}
    for i = 1, shape[d] do
      if d == #shape then t[i] = buf[pos]; pos = pos + 1 else t[i] = build(d + 1) end
    end
    return t
  end
  return build(1)
end
methods.tolist = methods.ranks

-- Flat list of the ranks in row-major order.
function methods.flat_ranks(self)
  local n = C.eng_mesh_size(self._c, -1)
  local buf = ffi.new("int[?]", n)
  C.eng_mesh_ranks(self._c, buf, n)
  local r = {}
  for i = 1, n do r[i] = buf[i - 1] end
  return r
end

-- mesh.mesh: the ranks as an i64 tensor of the mesh's shape (as PyTorch's mesh.mesh).
props.mesh = function(self)
  local flat = methods.flat_ranks(self)
  local shape = methods.shape(self)
  local n, arr = core.shape_arg("DeviceMesh.mesh", shape)
  local data = ffi.new("double[?]", #flat)
  for i = 1, #flat do data[i - 1] = flat[i] end
  return core.wrap(C.eng_tensor_from_data(n, arr, 5, data, 1, #flat), 3)
end

props.mesh_dim_names = function(self)
  if C.eng_mesh_has_names(self._c) == 0 then return nil end
  local r = {}
  for i = 0, C.eng_mesh_ndim(self._c) - 1 do r[i + 1] = ffi.string(C.eng_mesh_dim_name(self._c, i)) end
  return r
end

props.device_type = function(self) return C.eng_mesh_device(self._c) == 1 and "cuda" or "cpu" end

-- ---------------------------------------------------------------- slicing
-- slice("dp", "tp") / slice({"dp", "tp"}) / slice(1, 2): an in-order
-- sub-mesh containing this rank (cached; no new groups).
function methods.slice(self, ...)
  local args = { ... }
  if #args == 1 and type(args[1]) == "table" then args = args[1] end
  local n = #args
  if n == 0 then error("DeviceMesh slice: no mesh dims given", 2) end
  local key = {}
  local all_names = true
  for i = 1, n do
    local a = args[i]
    if type(a) ~= "string" then all_names = false end
    if type(a) ~= "string" and type(a) ~= "number" then
      error(string.format("DeviceMesh slice: mesh dims must be names or 1-based indices, got %s", type(a)), 2)
    end
    key[i] = tostring(a)
  end
  local k = table.concat(key, "\0")
  local cached = self._slices[k]
  if cached then return cached end
  local p
  if all_names then
    local names = ffi.new("const char*[?]", n)
    for i = 1, n do names[i - 1] = args[i] end
    p = C.eng_mesh_slice_names(self._c, n, names)
    if p == nil then error(core.last_error(), 2) end
  else
    local dims = ffi.new("int[?]", n)
    for i = 1, n do dims[i - 1] = mesh_dim(self, args[i], "DeviceMesh slice", 2) end
    p = C.eng_mesh_slice(self._c, n, dims)
    if p == nil then error(core.last_error(), 2) end
  end
  local s = wrap(p, 2)
  -- the mesh it was sliced from and which of its dims (0-based), as PyTorch's _mesh_resources root mesh:
  -- FSDP over tensor parallelism finds the 2-D parent of mesh["dp"] and mesh["tp"]
  local dims = {}
  for i = 1, n do
    dims[i] = all_names and C.eng_mesh_dim_index(self._c, args[i]) or mesh_dim(self, args[i], "DeviceMesh slice", 2)
  end
  s._parent, s._parent_dims = self, dims
  self._slices[k] = s
  return s
end

-- The mesh this one was sliced from (transitively), or the mesh itself.
function methods.get_root_mesh(self)
  local m = self
  while rawget(m, "_parent") do m = rawget(m, "_parent") end
  return m
end

-- flatten([name]): a 1-d mesh over this mesh's ranks (row-major) with a new
-- group; collective over the world.
function methods.flatten(self, name)
  if name ~= nil and type(name) ~= "string" then
    C.eng_mesh_flatten(self._c, "") -- an invalid call that still takes part in the split
    error("DeviceMesh.flatten: name must be a string", 2)
  end
  local k = "\1flat\0" .. (name or "")
  local cached = self._slices[k]
  if cached then return cached end
  local f = wrap(C.eng_mesh_flatten(self._c, name), 2)
  self._slices[k] = f
  return f
end
methods._flatten = methods.flatten

-- ---------------------------------------------------------------- creation
local method_names = {}
for k in pairs(methods) do method_names[k] = true end
for k in pairs(props) do method_names[k] = true end

-- Argument checks return (value) or (nil, message).
local function device_code(device, op)
  if device == "cpu" then return 0 end
  if device == "cuda" then return 1 end
  return nil, string.format("%s: device_type must be \"cpu\" or \"cuda\", got %s", op, tostring(device))
end

local function names_arg(names, ndim, op)
  if names == nil then return false end
  if type(names) ~= "table" then return nil, op .. ": mesh_dim_names must be a list of strings" end
  if #names ~= ndim then
    return nil, string.format("%s: mesh_shape and mesh_dim_names should have same length! (%d dims, %d names)", op,
      ndim, #names)
  end
  local arr = ffi.new("const char*[?]", ndim)
  for i = 1, ndim do
    local s = names[i]
    if type(s) ~= "string" then
      return nil, string.format("%s: mesh_dim_names[%d] must be a string, got %s", op, i, type(s))
    end
    if s == "" then return nil, string.format("%s: mesh_dim_names[%d] is empty", op, i) end
    if method_names[s] or s:sub(1, 1) == "_" then
      return nil, string.format("%s: mesh_dim_name '%s' clashes with a DeviceMesh method or field; choose another name",
        op, s)
    end
    arr[i - 1] = s
  end
  return arr
end

local function shape_arg(shape, op)
  if type(shape) == "number" then shape = { shape } end
  if type(shape) ~= "table" or #shape == 0 then return nil, op .. ": mesh_shape must be a non-empty list of sizes" end
  local nd = #shape
  if nd > 8 then return nil, string.format("%s: a mesh has at most 8 dims, got %d", op, nd) end
  local sh = ffi.new("int64_t[8]")
  for i = 1, nd do
    local v = shape[i]
    if type(v) ~= "number" or v % 1 ~= 0 then
      return nil, string.format("%s: mesh_shape entry %d must be an integer, got %s", op, i, tostring(v))
    end
    sh[i - 1] = v
  end
  return sh, shape
end

local function ranks_arg(ranks, shape, op)
  if ranks == nil then return false end
  if type(ranks) ~= "table" then return nil, op .. ": the rank list must be a table of integers" end
  local n = #ranks
  local buf = ffi.new("int[?]", n > 0 and n or 1)
  for i = 1, n do
    local v = ranks[i]
    if type(v) ~= "number" or v % 1 ~= 0 then
      return nil, string.format("%s: rank list entry %d must be an integer, got %s", op, i, tostring(v))
    end
    buf[i - 1] = v
  end
  local want = 1
  for i = 1, #shape do want = want * shape[i] end
  if n ~= want then
    return nil, string.format("%s: the rank list has %d entries but the mesh shape {%s} holds %d", op, n,
      table.concat(shape, ", "), want)
  end
  return buf
end

-- Creates the mesh (collective).  A rank whose arguments fail the checks here
-- still takes part in the C-side agreement (with an invalid call), so the
-- other ranks fail too instead of waiting for it.
local function make(op, device, shape, ranks, names, level)
  local dev, sh, shp, narr, rbuf, e
  dev, e = device_code(device, op)
  if dev then sh, e = shape_arg(shape, op) end
  if sh then shp = e; e = nil; narr, e = names_arg(names, #shp, op) end
  if narr ~= nil and e == nil then rbuf, e = ranks_arg(ranks, shp, op) end
  if e then
    C.eng_mesh_new(0, 0, nil, nil, nil)
    error(e, level + 1)
  end
  local p = C.eng_mesh_new(dev, #shp, sh, rbuf or nil, narr or nil)
  if p == nil then error(core.last_error(), level + 1) end
  local _ = names -- keeps the name strings alive during the call
  local m = wrap(p, level + 1)
  return m
end

-- init_device_mesh(device_type, mesh_shape, mesh_dim_names [, {ranks = {...}}]):
-- ranks 0..world-1 laid out row-major (or the given flat rank list).
function M.init_device_mesh(device, shape, names, opts)
  if type(names) == "table" and names.ranks ~= nil and opts == nil and #names == 0 then names, opts = nil, names end
  if opts ~= nil and type(opts) ~= "table" then error("init_device_mesh: options must be a table", 2) end
  local m = make("init_device_mesh", device, shape, opts and opts.ranks, names, 2)
  return m
end

-- DeviceMesh(device_type, mesh, mesh_dim_names): mesh is a nested Lua table of
-- global ranks ({{0, 1}, {2, 3}}), a flat list ({0, 2}) or an integer tensor.
function M.DeviceMesh(device, mesh, names)
  local shape, flat = {}, {}
  if core.is_tensor(mesh) then
    shape = mesh:shape()
    if #shape == 0 then shape = { 1 } end
    flat = mesh:contiguous():tolist_flat()
  elseif type(mesh) == "table" then
    local t = mesh
    while type(t) == "table" do shape[#shape + 1] = #t; t = t[1] end
    local function walk(x, d)
      if d > #shape then flat[#flat + 1] = x; return end
      if type(x) ~= "table" or #x ~= shape[d] then
        error(string.format("DeviceMesh: the rank table is ragged at depth %d", d), 4)
      end
      for i = 1, #x do walk(x[i], d + 1) end
    end
    walk(mesh, 1)
  else
    error("DeviceMesh: mesh must be a nested table of ranks or an integer tensor, got " .. type(mesh), 2)
  end
  local m = make("DeviceMesh", device, shape, flat, names, 2)
  return m
end

M.DeviceMeshClass = DeviceMesh
return M
