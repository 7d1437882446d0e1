-- engine.distributed.parallelize: parallelize_module (PyTorch's tensor-parallel entry point).
--
--   dist.parallelize_module(model, mesh["tp"], {
--     ["layers.*.attention.wq"] = dist.ColwiseParallel(),
--     ["layers.*.attention.wo"] = dist.RowwiseParallel(),
--     ["norm"] = dist.SequenceParallel(),
--   }, {src_data_rank = 0})
--
-- plan: one style (applied to the module itself) or a table from module paths to styles.  A path
-- is dotted, relative to the module, each segment an fnmatch pattern over child names ("*", "?",
-- "[1-2]", "[!0]"; ModuleList children are named 0, 1, ...); "" is the module itself.  Keys are
-- applied in sorted order (Lua tables have none); give a list of {path, style} pairs to choose the
-- order.  A key that matches nothing, and an empty plan, warn once (dist.set_warning_handler).
-- The mesh must be 1-D: slice a named dim out of a larger mesh (mesh["tp"]).
-- src_data_rank (default 0): parameters are taken from that rank of the mesh (scatter or
-- broadcast); false (PyTorch's None): no communication, every rank keeps its own values (they
-- must agree, e.g. after the same manual_seed).
-- Parameters become DTensor Parameters with the same names and requires_grad; a parameter shared
-- by several modules (weight tying) becomes ONE DTensor everywhere it is used, also where no style
-- touched it.  Returns the module.
local core = require("engine.core")
local meshmod = require("engine.distributed.mesh")
local dtensor = require("engine.distributed.dtensor")
local styles = require("engine.distributed.parallel_style")
local dm = require("engine.distributed.distribute_module")
local C = core.C

local M = {}

local function fail(msg) core.fail(msg) end

-- fnmatch pattern -> anchored Lua pattern.
local function fnmatch_pattern(pat)
  local out, i, n = { "^" }, 1, #pat
  while i <= n do
    local c = pat:sub(i, i)
    if c == "*" then out[#out + 1] = ".*"
    elseif c == "?" then out[#out + 1] = "."
    elseif c == "[" then
      local j = pat:find("]", i + 1 + ((pat:sub(i + 1, i + 1) == "!" or pat:sub(i + 1, i + 1) == "]") and 1 or 0), true)
      if not j then out[#out + 1] = "%["
      else
        local body = pat:sub(i + 1, j - 1)
        local neg = body:sub(1, 1) == "!"
        if neg then body = body:sub(2) end
        body = body:gsub("[%%%]%^]", "%%%0")
        out[#out + 1] = "[" .. (neg and "^" or "") .. body .. "]"
        i = j
      end
    else out[#out + 1] = c:gsub("%W", "%%%0") end
    i = i + 1
  end
  out[#out + 1] = "$"
  return table.concat(out)
end
M._fnmatch_pattern = fnmatch_pattern

local function fnmatch(name, pat) return name:match(fnmatch_pattern(pat)) ~= nil end
M.fnmatch = fnmatch

-- Modules under `module` matched by the dotted pattern path, with their paths.
local function match_path(module, path)
  if path == "" then return { { module, "" } } end
  local found = { { module, "" } }
  for seg in (path .. "."):gmatch("([^.]*)%.") do
    if seg == "" then fail(string.format("parallelize_module: plan key '%s' has an empty segment", path)) end
    local nxt = {}
    for _, e in ipairs(found) do
      local names, mods = e[1]:_children_list()
      for i = 1, #names do
        if fnmatch(names[i], seg) then
          nxt[#nxt + 1] = { mods[i], e[2] == "" and names[i] or (e[2] .. "." .. names[i]) }
        end
      end
    end
    found = nxt
  end
  return found
end

local function placements_equal(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

local function pl_str(pls)
  local s = {}
  for i, p in ipairs(pls) do s[i] = tostring(p) end
  return "[" .. table.concat(s, ", ") .. "]"
end

-- Converted parameters, by the original tensor object: a tie seen again (in this call or a later
-- one) gets the same DTensor.  Weak keys: nothing is kept alive.
local converted = setmetatable({}, { __mode = "k" })

-- The styles applied to a module (weak keys), by role: a module takes one style that lays out its parameters
-- (ColwiseParallel, RowwiseParallel, SequenceParallel), and each of the other built-in styles once: a second one
-- would distribute, or hook the inputs and outputs, again (PyTorch runs both and fails later in forward)
local applied = setmetatable({}, { __mode = "k" })
local PARAM_STYLES = { ColwiseParallel = true, RowwiseParallel = true, SequenceParallel = true }
local function style_role(style)
  local name = rawget(getmetatable(style), "__name")
  if PARAM_STYLES[name] then return "parameters" end
  if name == "PrepareModuleInput" or name == "PrepareModuleOutput" or name == "PrepareModuleInputOutput" then
    return name
  end
  return nil
end

local function make_ctx(mesh, src)
  local ctx = {}
  -- Replaces module.<name> by a DTensor Parameter laid out as placements; local_only: from_local
  -- (every rank's own values, no communication), as SequenceParallel's replicated parameters.
  function ctx.distribute(module, name, placements, local_only)
    local params = rawget(module, "_parameters")
    local p = params[name]
    if p == nil then return end
    local prev = converted[p]
    if prev then
      if prev.mesh ~= mesh or not placements_equal(prev.placements, placements) then
        fail(string.format("parallelize_module: parameter '%s' of '%s' is shared with a module already laid out as "
          .. "%s; this plan asks for %s (tied parameters need one layout)", name, ctx.path == "" and "<root>" or ctx.path,
          pl_str(prev.placements), pl_str(placements)))
      end
      params[name] = prev.dt
      return
    end
    if dtensor.is_dtensor(p) then
      local have = p.placements
      if p.device_mesh == mesh and placements_equal(have, placements) then return end
      fail(string.format("parallelize_module: parameter '%s' of '%s' is already a DTensor laid out as %s (plan asks "
        .. "for %s)", name, ctx.path == "" and "<root>" or ctx.path, pl_str(have), pl_str(placements)))
    end
    local rg = p._c.requires_grad ~= 0
    local d
    if local_only then d = dtensor.from_local(p:detach(), mesh, placements)
    else d = dtensor.distribute_tensor(p:detach(), mesh, placements, { src_data_rank = src }) end
    d._c.is_param = 1
    if rg then core.check(C.eng_tensor_set_requires_grad(d._c, 1), 3) end
    params[name] = d
    converted[p] = { dt = d, mesh = mesh, placements = placements }
  end
  return ctx
end

-- Replace every parameter still referring to a converted tensor (the other half of a tie).
local function retie(module)
  for _, m in ipairs(module:modules()) do
    local params = rawget(m, "_parameters")
    for _, name in ipairs(rawget(m, "_param_names")) do
      local p = params[name]
      if p ~= nil and converted[p] then params[name] = converted[p].dt end
    end
  end
end

-- The plan as a list of {path, style}: the list form's pairs in their order, then the keyed entries
-- sorted by path (Lua tables have no order).
local function plan_entries(plan)
  if styles.is_parallel_style(plan) then return { { "", plan } } end
  if type(plan) ~= "table" then
    fail("parallelize_module: parallelize_plan must be a ParallelStyle or a table {path = style}, got " .. type(plan))
  end
  local list, keyed = {}, {}
  for i, e in ipairs(plan) do
    if type(e) ~= "table" or type(e[1]) ~= "string" or not styles.is_parallel_style(e[2]) then
      fail(string.format("parallelize_module: plan entry %d must be {path, style}", i))
    end
    list[i] = { e[1], e[2] }
  end
  for k, v in pairs(plan) do
    if type(k) ~= "number" then
      if type(k) ~= "string" then fail("parallelize_module: plan keys must be module paths (strings), got " .. type(k)) end
      if not styles.is_parallel_style(v) then
        fail(string.format("parallelize_module: plan['%s'] must be a ParallelStyle (ColwiseParallel(), ...), got %s", k,
          type(v) == "table" and "a table" or type(v)))
      end
      keyed[#keyed + 1] = { k, v }
    elseif k > #plan or k < 1 or k % 1 ~= 0 then
      fail("parallelize_module: plan has a stray numeric key " .. tostring(k))
    end
  end
  table.sort(keyed, function(a, b) return a[1] < b[1] end)
  for _, e in ipairs(keyed) do list[#list + 1] = e end
  return list
end

function M.parallelize_module(module, mesh, plan, opts)
  local op = "parallelize_module"
  local nn = require("engine.nn")
  if not nn.is_module(module) then fail(op .. ": expected an nn.Module, got " .. type(module)) end
  if mesh == nil then mesh = meshmod.init_device_mesh("cpu", { require("engine.distributed").world_size() }) end
  if not meshmod.is_mesh(mesh) then fail(op .. ": device_mesh must be a DeviceMesh, got " .. type(mesh)) end
  if mesh:ndim() ~= 1 then
    fail(string.format("%s: Tensor Parallel expects a 1-D device mesh, got a %d-D mesh %s: pass a named 1-D slice "
      .. "such as mesh[\"tp\"]", op, mesh:ndim(), tostring(mesh)))
  end
  opts = opts or {}
  if type(opts) ~= "table" then fail(op .. ": options must be a table") end
  for k in pairs(opts) do
    if k ~= "src_data_rank" then fail(string.format("%s: unknown option '%s' (options: src_data_rank)", op, tostring(k))) end
  end
  local src = opts.src_data_rank
  if src == nil then src = 0 end
  if src ~= false and (type(src) ~= "number" or src % 1 ~= 0 or src < 0 or src >= mesh:size()) then
    fail(string.format("%s: src_data_rank must be a rank of the mesh (0..%d) or false (no communication), got %s", op,
      mesh:size() - 1, tostring(src)))
  end
  if plan == nil or (type(plan) == "table" and not styles.is_parallel_style(plan) and next(plan) == nil) then
    dm._warn("UserWarning", "No parallelize_plan is provided and auto-parallel is not supported at the moment, "
      .. "so this parallelize_module call will do nothing.")
    return module
  end
  for name, sub in module:named_modules() do
    if rawget(sub, "_fsdp") ~= nil then
      fail(string.format("%s: %s is already fully sharded (FSDP applied before TP): apply parallelize_module on "
        .. "mesh[\"tp\"] first, then fully_shard on mesh[\"dp\"]", op, name == "" and "the module" or ("'" .. name .. "'")))
    end
  end
  local entries = plan_entries(plan)
  -- Match everything first: an error names the key before any parameter moves.
  local work = {}
  for _, e in ipairs(entries) do
    local found = match_path(module, e[1])
    if #found == 0 then
      dm._warn("UserWarning", string.format("Parallelize plan key '%s' could not be resolved: no submodule matching "
        .. "token '%s' in module %s, skipping this plan entry.", e[1], e[1], module.__name))
    end
    for _, f in ipairs(found) do work[#work + 1] = { f[1], f[2], e[2], e[1] } end
  end
  local ctx = make_ctx(mesh, src)
  local planned = {}
  for _, w in ipairs(work) do
    ctx.path = w[2]
    local role = style_role(w[3])
    if role then
      local shown = w[2] == "" and "<root>" or w[2]
      local prev = (applied[w[1]] or {})[role]
      local here = planned[w[1]] and planned[w[1]][role]
      if prev or here then
        local other = here and string.format("plan key '%s' of this plan", here.key)
          or "an earlier parallelize_module call"
        fail(string.format("%s: %s on '%s': the module already has %s (from %s): a style applied twice would "
          .. "lay out %s again; give each module one %s", op, w[3].__name, shown, (here or prev).name, other,
          role == "parameters" and "its parameters and inputs" or "its inputs or outputs",
          role == "parameters" and "of ColwiseParallel, RowwiseParallel, SequenceParallel" or role))
      end
      planned[w[1]] = planned[w[1]] or {}
      planned[w[1]][role] = { name = w[3].__name, key = w[4] }
    end
    w[3]:_check(w[1], ctx)
  end
  for _, w in ipairs(work) do
    ctx.path = w[2]
    w[3]:_apply(w[1], mesh, ctx)
    local role = style_role(w[3])
    if role then
      applied[w[1]] = applied[w[1]] or {}
      applied[w[1]][role] = { name = w[3].__name }
    end
  end
  retie(module)
  return module
end

return M
