-- engine.distributed.parallel_style: PyTorch's tensor-parallel styles.
--
--   dist.ColwiseParallel{input_layouts = Replicate(), output_layouts = Shard(-1), use_local_output = true}
--   dist.RowwiseParallel{input_layouts = Shard(-1), output_layouts = Replicate(), use_local_output = true}
--   dist.SequenceParallel{sequence_dim = 2, use_local_output = false}
--   dist.PrepareModuleInput{input_layouts, desired_input_layouts, input_kwarg_layouts,
--                           desired_input_kwarg_layouts, use_local_output = false}
--   dist.PrepareModuleOutput{output_layouts, desired_output_layouts, use_local_output = true}
--   dist.PrepareModuleInputOutput{input_layouts, desired_input_layouts, input_kwarg_layouts,
--                                 desired_input_kwarg_layouts, use_input_local_output = false,
--                                 output_layouts, desired_output_layouts, use_output_local_output = true}
--
-- A style is applied by dist.parallelize_module (parallelize.lua): style:_apply(module, mesh, ctx)
-- replaces the module's parameters with DTensor Parameters on the 1-D mesh and registers forward
-- hooks that lay the inputs out (a plain tensor is taken as this rank's shard in `input_layouts`,
-- from_local, then redistributed to what the module needs) and the outputs (redistributed to
-- `output_layouts`, then to_local when use_local_output).  Dims are 1-based (Shard(-1): the last
-- dim).  Layouts are one placement (a 1-D mesh), or a list for PrepareModule*, where nil entries
-- (write dist.NONE, or leave a hole and give n = count) pass an input through untouched.
--
-- Linear:    Colwise = weight Shard(1) (the output dim of [out, in]) and bias Shard(1);
--            Rowwise = weight Shard(2) (the input dim), bias Replicate; output Partial -> all_reduce
--            (Replicate) or reduce_scatter (Shard).
-- Embedding: Colwise = weight Shard(2) (the embedding dim); Rowwise = weight Shard(1) (rows; the
--            masked lookup gives a Partial output), input Replicate.
-- SequenceParallel: LayerNorm, RMSNorm, Dropout (and the seed's RMSNormPython): parameters
--            Replicate without communication (from_local: every rank holds the same init),
--            activations Shard(sequence_dim).
local core = require("engine.core")
local implicit = require("engine.distributed.implicit_replication")
local P = require("engine.distributed.placements")
local dtensor = require("engine.distributed.dtensor")

local M = {}

local is_dtensor = dtensor.is_dtensor

-- A placeholder for "no layout for this input" inside layout lists (Python's None).
M.NONE = setmetatable({}, { __tostring = function() return "None" end, __name = "dist.NONE" })

local Style = {}
Style.__index = Style
function Style:_check(module, ctx) end
M.ParallelStyle = Style
local function is_style(x) return type(x) == "table" and getmetatable(x) and getmetatable(x).__style == true end
M.is_parallel_style = is_style

local function new_style(name)
  local cls = { __name = name, __style = true }
  cls.__index = cls
  setmetatable(cls, { __index = Style })
  cls.__tostring = function(s) return s:_repr() end
  return cls
end

local function fail(msg) core.fail(msg) end

local function check_opts(name, opts, known)
  if opts == nil then return {} end
  if type(opts) ~= "table" or getmetatable(opts) ~= nil then
    fail(string.format("%s: options must be a table, got %s", name, P.is_placement(opts) and "a placement" or type(opts)))
  end
  for k in pairs(opts) do
    if not known[k] then
      local names = {}
      for n in pairs(known) do names[#names + 1] = n end
      table.sort(names)
      fail(string.format("%s: unknown option '%s' (options: %s)", name, tostring(k), table.concat(names, ", ")))
    end
  end
  return opts
end

local function one_layout(name, what, v, default)
  if v == nil then return default end
  if type(v) == "table" and not P.is_placement(v) and #v == 1 then v = v[1] end
  if not P.is_placement(v) then
    fail(string.format("%s: %s must be a placement (Shard(d), Replicate(), Partial()), got %s", name, what,
      type(v) == "table" and "a table" or type(v)))
  end
  if v:is_shard() and v.dim == 0 then
    fail(string.format("%s: %s Shard(0): dims are 1-based in Lua (Shard(1) is the first dim)", name, what))
  end
  return v
end

local function bool_opt(name, what, v, default)
  if v == nil then return default end
  if type(v) ~= "boolean" then fail(string.format("%s: %s must be a boolean, got %s", name, what, type(v))) end
  return v
end

-- Placement p normalized for an ndim-d tensor (Shard(-1) -> Shard(ndim)).
local function norm(p, ndim)
  if p:is_shard() and not p:is_strided_shard() and p.dim < 0 then return P.Shard(ndim + 1 + p.dim) end
  return p
end

local function pl_str(p) return p == M.NONE and "None" or tostring(p) end
-- t laid out as `from` (plain: this rank's shard, from_local) then redistributed to `to`.
-- what: names the input in errors.
local function prepare(t, mesh, from, to, ctxname, role)
  role = role or "input"
  if not core.is_tensor(t) then return t end
  local nd = #t:shape()
  if not is_dtensor(t) then
    if from == nil then return t end
    from = norm(from, nd)
    if from:is_shard() and from.dim > nd then
      fail(string.format("%s: %s layout %s does not fit a %d-d %s", ctxname, role, tostring(from), nd, role))
    end
    t = dtensor.from_local(t, mesh, { from })
  elseif from ~= nil then
    local have = t.placements[1]
    if #t.placements ~= 1 or have ~= norm(from, nd) then
      local have_s = {}
      for i, q in ipairs(t.placements) do have_s[i] = tostring(q) end
      fail(string.format("%s: expected a DTensor %s laid out as %s, got [%s] (a DTensor %s must match %s_layouts)",
        ctxname, role, tostring(norm(from, nd)), table.concat(have_s, ", "), role, role))
    end
  end
  if to ~= nil then
    to = norm(to, nd)
    if to:is_shard() and to.dim > nd then
      fail(string.format("%s: layout %s does not fit a %d-d tensor", ctxname, tostring(to), nd))
    end
    if t.placements[1] ~= to then t = t:redistribute(mesh, { to }) end
  end
  return t
end

-- t:to_local() for a style's use_local_output / use_local_input.  A local tensor carries no global shape: the
-- next style takes it back with from_local, which assumes every rank holds an equal shard, so an uneven shard
-- (a size not divisible by the mesh) would come back with another size on each rank and fail later as a shape or
-- collective mismatch far from its cause; it is refused here, naming the size (the same on every rank: no agreement)
local function to_local_even(t, mesh, ctxname, role)
  local pl = t.placements[1]
  if #t.placements == 1 and pl.kind == "shard" then
    local shape = t:shape()
    local nd = #shape
    local d = pl.dim < 0 and nd + pl.dim + 1 or pl.dim
    local n, W = shape[d], mesh:size()
    if n % W ~= 0 then
      local what = d == nd and "hidden size" or "sequence length"
      fail(string.format("%s: the %s %d (dim %d of the %s %s) is not divisible by the TP size %d: the ranks' "
        .. "local shards would be uneven, and the next style would lay them out again as equal ones (a shape or "
        .. "collective mismatch later); make the %s divisible by %d, or keep a DTensor (use_local_output = false)",
        ctxname, what, n, d, role or "output", t:_layout_str(), W, what, W))
    end
  end
  return t:to_local()
end

local function finish_output(t, mesh, to, use_local, ctxname)
  if not core.is_tensor(t) then return t end
  if is_dtensor(t) then
    if to ~= nil then
      local nd = #t:shape()
      to = norm(to, nd)
      if t.placements[1] ~= to then t = t:redistribute(mesh, { to }) end
    end
    if use_local then t = to_local_even(t, mesh, ctxname) end
  elseif to ~= nil then
    fail(string.format("%s: expected a DTensor output to lay out as %s, got a plain tensor", ctxname, tostring(to)))
  end
  return t
end

-- ---------------------------------------------------------------- parameters
-- ctx (from parallelize_module): ctx.distribute(module, name, placements) replaces a parameter by
-- a DTensor Parameter (keeping requires_grad and ties), ctx.path (the module's dotted path).

local function type_name(m) return "nn." .. tostring(rawget(getmetatable(m), "__name") or m.__name) end

-- The module's class or one of its ancestors is named `name` (by name, not identity: busted's
-- insulation and package reloading can make two copies of one class).
local function has_class(m, name)
  local c = getmetatable(m)
  while c do
    if rawget(c, "__name") == name then return true end
    c = rawget(c, "__parent")
  end
  return false
end
M._has_class = has_class

local function module_kind(m)
  for _, k in ipairs({ "Linear", "Embedding", "LayerNorm", "RMSNorm", "Dropout" }) do
    if has_class(m, k) then return k end
  end
  if has_class(m, "RMSNormPython") then return "RMSNorm" end
  return nil
end

local function where(style, ctx) return string.format("%s on '%s'", style.__name, ctx.path == "" and "<root>" or ctx.path) end

-- ---------------------------------------------------------------- ColwiseParallel / RowwiseParallel
local linear_known = { input_layouts = true, output_layouts = true, use_local_output = true }

local Colwise = new_style("ColwiseParallel")
M.ColwiseParallel = function(opts)
  opts = check_opts("ColwiseParallel", opts, linear_known)
  return setmetatable({
    input_layouts = one_layout("ColwiseParallel", "input_layouts", opts.input_layouts, P.Replicate()),
    output_layouts = one_layout("ColwiseParallel", "output_layouts", opts.output_layouts, P.Shard(-1)),
    use_local_output = bool_opt("ColwiseParallel", "use_local_output", opts.use_local_output, true),
    desired_input_layouts = P.Replicate(),
  }, Colwise)
end

local Rowwise = new_style("RowwiseParallel")
M.RowwiseParallel = function(opts)
  opts = check_opts("RowwiseParallel", opts, linear_known)
  return setmetatable({
    input_layouts = one_layout("RowwiseParallel", "input_layouts", opts.input_layouts, P.Shard(-1)),
    output_layouts = one_layout("RowwiseParallel", "output_layouts", opts.output_layouts, P.Replicate()),
    use_local_output = bool_opt("RowwiseParallel", "use_local_output", opts.use_local_output, true),
  }, Rowwise)
end

local function linear_repr(s)
  return string.format("%s(input_layouts=%s, output_layouts=%s, use_local_output=%s)", s.__name,
    tostring(s.input_layouts), tostring(s.output_layouts), tostring(s.use_local_output))
end
Colwise._repr, Rowwise._repr = linear_repr, linear_repr

-- Registers the input pre-hook and output hook shared by the linear styles, and records them on the module
-- (module._tp_linear, see linear_style_of).
local function linear_hooks(style, module, mesh, ctx, desired_in)
  local name = where(style, ctx)
  local function input(x) return prepare(x, mesh, style.input_layouts, desired_in, name) end
  local function output(y) return finish_output(y, mesh, style.output_layouts, style.use_local_output, name) end
  module:register_forward_pre_hook(function(_, inputs)
    if #inputs == 0 then return nil end
    local out = { input(inputs[1]) }
    for i = 2, #inputs do out[i] = inputs[i] end
    return out
  end)
  module:register_forward_hook(function(_, _, out) return output(out) end)
  rawset(module, "_tp_linear", { style = style, mesh = mesh, input = input, output = output,
    cmod = rawget(module, "_cmod") })
end

-- linear_style_of(module) -> the record of the linear style (ColwiseParallel / RowwiseParallel) whose two hooks
-- are the only hooks on module, else nil: {style =, mesh =, input = fn(x) -> x laid out as the module's forward
-- gets it (the pre-hook's step), output = fn(y) -> y as the module returns it (the forward hook's step)}.
-- Fused callers (engine.models: one GEMM for q, k and v, linear + gelu as one op) run these two steps around
-- their own op instead of the module's forward; any other hook on the module (a user's, FSDP's, a second style)
-- and they call the module.
local hook_count = core.C.eng_module_hook_count
function M.linear_style_of(module)
  local r = rawget(module, "_tp_linear")
  if r == nil then return nil end
  local cm = rawget(module, "_cmod")
  if cm ~= r.cmod or hook_count(cm, 0) ~= 1 or hook_count(cm, 1) ~= 1 then return nil end
  return r
end

-- _check(module, ctx): the module fits the style (called for every planned module before any
-- parameter moves, so a bad plan changes nothing).
function Colwise:_check(module, ctx)
  local kind = module_kind(module)
  if kind ~= "Linear" and kind ~= "Embedding" then
    fail(string.format("%s: ColwiseParallel only supports nn.Linear and nn.Embedding, got %s",
      where(self, ctx), type_name(module)))
  end
end

function Colwise:_apply(module, mesh, ctx)
  local kind = module_kind(module)
  if kind == "Linear" then
    ctx.distribute(module, "weight", { P.Shard(1) })
    if module.bias ~= nil then ctx.distribute(module, "bias", { P.Shard(1) }) end
  elseif kind == "Embedding" then
    ctx.distribute(module, "weight", { P.Shard(2) })
  else
    fail(string.format("%s: ColwiseParallel only supports nn.Linear and nn.Embedding, got %s",
      where(self, ctx), type_name(module)))
  end
  linear_hooks(self, module, mesh, ctx, self.desired_input_layouts)
end

function Rowwise:_check(module, ctx)
  local kind = module_kind(module)
  if kind ~= "Linear" and kind ~= "Embedding" then
    fail(string.format("%s: RowwiseParallel only supports nn.Linear and nn.Embedding, got %s",
      where(self, ctx), type_name(module)))
  end
end

function Rowwise:_apply(module, mesh, ctx)
  local kind = module_kind(module)
  local desired
  if kind == "Linear" then
    ctx.distribute(module, "weight", { P.Shard(2) })
    if module.bias ~= nil then ctx.distribute(module, "bias", { P.Replicate() }) end
    desired = P.Shard(-1)
  elseif kind == "Embedding" then
    ctx.distribute(module, "weight", { P.Shard(1) })
    desired = P.Replicate()
  else
    fail(string.format("%s: RowwiseParallel only supports nn.Linear and nn.Embedding, got %s",
      where(self, ctx), type_name(module)))
  end
  linear_hooks(self, module, mesh, ctx, desired)
end

-- ---------------------------------------------------------------- SequenceParallel
local SP = new_style("SequenceParallel")
M.SequenceParallel = function(opts)
  opts = check_opts("SequenceParallel", opts, { sequence_dim = true, use_local_output = true })
  local d = opts.sequence_dim or 2
  if type(d) ~= "number" or d % 1 ~= 0 or d == 0 then
    fail(string.format("SequenceParallel: sequence_dim must be a non-zero integer (1-based; -1 is the last dim), "
      .. "got %s", tostring(d)))
  end
  return setmetatable({ sequence_dim = d,
    use_local_output = bool_opt("SequenceParallel", "use_local_output", opts.use_local_output, false) }, SP)
end
function SP:_repr()
  return string.format("SequenceParallel(sequence_dim=%d, use_local_output=%s)", self.sequence_dim,
    tostring(self.use_local_output))
end

function SP:_check(module, ctx)
  local kind = module_kind(module)
  if kind ~= "LayerNorm" and kind ~= "RMSNorm" and kind ~= "Dropout" then
    fail(string.format("%s: SequenceParallel supports nn.LayerNorm, nn.RMSNorm and nn.Dropout, got %s",
      where(self, ctx), type_name(module)))
  end
end

function SP:_apply(module, mesh, ctx)
  for _, pname in ipairs(rawget(module, "_param_names")) do
    if rawget(module, "_parameters")[pname] ~= nil then ctx.distribute(module, pname, { P.Replicate() }, true) end
  end
  local name = where(self, ctx)
  local shard = P.Shard(self.sequence_dim)
  module:register_forward_pre_hook(function(_, inputs)
    if #inputs == 0 then return nil end
    local x = inputs[1]
    local out = { x }
    for i = 2, #inputs do out[i] = inputs[i] end
    if is_dtensor(x) then out[1] = prepare(x, mesh, nil, shard, name)
    else out[1] = prepare(x, mesh, shard, nil, name) end
    return out
  end)
  module:register_forward_hook(function(_, _, out)
    return finish_output(out, mesh, nil, self.use_local_output, name)
  end)
end

-- ---------------------------------------------------------------- PrepareModuleInput / Output
-- A layout list: one placement, or a list whose entries are placements or dist.NONE (n: its length).
local function layout_list(name, what, v)
  if v == nil then return nil end
  if P.is_placement(v) or v == M.NONE then return { n = 1, v == M.NONE and M.NONE or v } end
  if type(v) ~= "table" then fail(string.format("%s: %s must be a placement or a list of placements, got %s", name, what, type(v))) end
  local n = v.n or table.maxn(v)
  local r = { n = n }
  for i = 1, n do
    local p = v[i]
    if p == nil or p == M.NONE then r[i] = M.NONE
    elseif P.is_placement(p) then
      if p:is_shard() and p.dim == 0 then
        fail(string.format("%s: %s[%d] Shard(0): dims are 1-based in Lua (Shard(1) is the first dim)", name, what, i))
      end
      r[i] = p
    else fail(string.format("%s: %s[%d] must be a placement or dist.NONE, got %s", name, what, i, type(p))) end
  end
  return r
end

local function kwarg_layouts(name, what, v)
  if v == nil then return nil end
  if type(v) ~= "table" or P.is_placement(v) then fail(string.format("%s: %s must be a table {field = placement}", name, what)) end
  for k, p in pairs(v) do
    if type(k) ~= "string" or not (P.is_placement(p) or p == M.NONE) then
      fail(string.format("%s: %s must map field names to placements (bad entry '%s')", name, what, tostring(k)))
    end
  end
  return v
end

local function list_str(l)
  if l == nil then return "None" end
  local s = {}
  for i = 1, l.n do s[i] = pl_str(l[i]) end
  return "(" .. table.concat(s, ", ") .. ")"
end

local function make_input_spec(name, opts, use_local_key)
  local s = {
    input_layouts = layout_list(name, "input_layouts", opts.input_layouts),
    desired_input_layouts = layout_list(name, "desired_input_layouts", opts.desired_input_layouts),
    input_kwarg_layouts = kwarg_layouts(name, "input_kwarg_layouts", opts.input_kwarg_layouts),
    desired_input_kwarg_layouts = kwarg_layouts(name, "desired_input_kwarg_layouts", opts.desired_input_kwarg_layouts),
    use_local_input = bool_opt(name, use_local_key, opts[use_local_key], false),
  }
  if s.input_layouts ~= nil and s.desired_input_layouts ~= nil and s.input_layouts.n ~= s.desired_input_layouts.n then
    fail(string.format("%s: input_layouts and desired_input_layouts should have same length! (%d and %d)", name,
      s.input_layouts.n, s.desired_input_layouts.n))
  end
  if (s.input_layouts == nil) ~= (s.desired_input_layouts == nil) and s.input_layouts ~= nil then
    -- PyTorch requires desired_input_layouts whenever input_layouts is given
    fail(name .. ": desired_input_layouts is required with input_layouts")
  end
  local ik, dk = s.input_kwarg_layouts or {}, s.desired_input_kwarg_layouts or {}
  for k in pairs(ik) do
    if dk[k] == nil then fail(string.format("%s: input_kwarg_layouts['%s'] has no desired_input_kwarg_layouts entry", name, k)) end
  end
  for k in pairs(dk) do
    if ik[k] == nil then fail(string.format("%s: desired_input_kwarg_layouts['%s'] has no input_kwarg_layouts entry", name, k)) end
  end
  return s
end

local function make_output_spec(name, opts, use_local_key)
  local s = {
    output_layouts = layout_list(name, "output_layouts", opts.output_layouts),
    desired_output_layouts = layout_list(name, "desired_output_layouts", opts.desired_output_layouts),
    use_local_output = bool_opt(name, use_local_key, opts[use_local_key], true),
  }
  if s.output_layouts == nil or s.desired_output_layouts == nil then
    fail(name .. ": output_layouts and desired_output_layouts are required")
  end
  if s.output_layouts.n ~= s.desired_output_layouts.n then
    fail(string.format("%s: output_layouts and desired_output_layouts should have same length! (%d and %d)", name,
      s.output_layouts.n, s.desired_output_layouts.n))
  end
  return s
end

local function prep_one(t, mesh, from, to, use_local, name, role)
  if from == M.NONE or from == nil then return t end
  t = prepare(t, mesh, from, to ~= M.NONE and to or nil, name, role)
  if use_local and is_dtensor(t) then t = to_local_even(t, mesh, name, role or "input") end
  return t
end

-- Input side: a pre-hook for positional tensor inputs; a wrapped forward for an options table
-- (Lua's kwargs) when kwarg layouts are given.
local function install_inputs(spec, module, mesh, name)
  if spec.input_layouts ~= nil then
    module:register_forward_pre_hook(function(_, inputs)
      local n = spec.input_layouts.n
      if #inputs ~= n then
        fail(string.format("%s: module inputs and input_layouts should have same length! (%d tensor inputs, %d layouts)",
          name, #inputs, n))
      end
      local out = {}
      for i = 1, n do
        out[i] = prep_one(inputs[i], mesh, spec.input_layouts[i], spec.desired_input_layouts[i], spec.use_local_input, name)
      end
      return out
    end)
  end
  if spec.input_kwarg_layouts ~= nil and next(spec.input_kwarg_layouts) ~= nil then
    local fwd = module.forward
    rawset(module, "forward", function(self, ...)
      local args = { ... }
      local n = select("#", ...)
      local last = args[n]
      if type(last) == "table" and not core.is_tensor(last) then
        local kw = {}
        for k, v in pairs(last) do kw[k] = v end
        for k, from in pairs(spec.input_kwarg_layouts) do
          if kw[k] ~= nil then
            kw[k] = prep_one(kw[k], mesh, from, spec.desired_input_kwarg_layouts[k], spec.use_local_input,
              name .. " (field '" .. k .. "')")
          end
        end
        args[n] = kw
      end
      return fwd(self, unpack(args, 1, n))
    end)
  end
end

local function install_outputs(spec, module, mesh, name)
  module:register_forward_hook(function(_, _, ...)
    local outs = { ... }
    local n = select("#", ...)
    if n == 1 and type(outs[1]) == "table" and not core.is_tensor(outs[1]) then
      outs = outs[1]; n = table.maxn(outs)
    end
    if n ~= spec.output_layouts.n then
      fail(string.format("%s: module outputs and output_layouts should have same length! (%d tensor outputs, %d layouts)",
        name, n, spec.output_layouts.n))
    end
    local r = {}
    for i = 1, n do
      r[i] = prep_one(outs[i], mesh, spec.output_layouts[i], spec.desired_output_layouts[i], spec.use_local_output,
        name .. " (output " .. i .. ")", "output")
    end
    if n == 1 then return r[1] end
    return r
  end)
end

local PMI = new_style("PrepareModuleInput")
M.PrepareModuleInput = function(opts)
  opts = check_opts("PrepareModuleInput", opts, { input_layouts = true, desired_input_layouts = true,
    input_kwarg_layouts = true, desired_input_kwarg_layouts = true, use_local_output = true })
  return setmetatable({ input = make_input_spec("PrepareModuleInput", opts, "use_local_output") }, PMI)
end
function PMI:_repr()
  return string.format("PrepareModuleInput(input_layouts=%s, desired_input_layouts=%s)", list_str(self.input.input_layouts),
    list_str(self.input.desired_input_layouts))
end
function PMI:_apply(module, mesh, ctx) install_inputs(self.input, module, mesh, where(self, ctx)) end

local PMO = new_style("PrepareModuleOutput")
M.PrepareModuleOutput = function(opts)
  opts = check_opts("PrepareModuleOutput", opts, { output_layouts = true, desired_output_layouts = true,
    use_local_output = true })
  return setmetatable({ output = make_output_spec("PrepareModuleOutput", opts, "use_local_output") }, PMO)
end
function PMO:_repr()
  return string.format("PrepareModuleOutput(output_layouts=%s, desired_output_layouts=%s)",
    list_str(self.output.output_layouts), list_str(self.output.desired_output_layouts))
end
function PMO:_apply(module, mesh, ctx) install_outputs(self.output, module, mesh, where(self, ctx)) end

local PMIO = new_style("PrepareModuleInputOutput")
M.PrepareModuleInputOutput = function(opts)
  opts = check_opts("PrepareModuleInputOutput", opts, { input_layouts = true, desired_input_layouts = true,
    input_kwarg_layouts = true, desired_input_kwarg_layouts = true, use_input_local_output = true,
    output_layouts = true, desired_output_layouts = true, use_output_local_output = true })
  return setmetatable({ input = make_input_spec("PrepareModuleInputOutput", opts, "use_input_local_output"),
    output = make_output_spec("PrepareModuleInputOutput", opts, "use_output_local_output") }, PMIO)
end
function PMIO:_repr() return "PrepareModuleInputOutput(" .. PMI._repr(self) .. ", " .. PMO._repr(self) .. ")" end
function PMIO:_apply(module, mesh, ctx)
  install_inputs(self.input, module, mesh, where(self, ctx))
  install_outputs(self.output, module, mesh, where(self, ctx))
end

-- ---------------------------------------------------------------- loss_parallel
-- loss_parallel(fn, ...): PyTorch's loss_parallel() context.  cross_entropy on logits sharded on
-- the class dim (the output of ColwiseParallel{output_layouts = Shard(-1), use_local_output =
-- false}) already runs vocab-parallel here (3 all_reduces forward, none backward, logits never
-- gathered), inside or outside this call; it exists so that PyTorch code ports as it is.  So do a class
-- weight and logits [N, C, d1, ...] sharded on the class dim (not the last: a permute of the local shard);
-- inside, [Partial, Shard(class)] logits are an error (Shard or Replicate only beside the class dim, as PyTorch);
-- outside, such logits take the general path (the Partial reduced first).  Inside, plain tensors count as
-- Replicate (PyTorch's documented usage passes a plain target, and a plain class weight): fn runs under
-- implicit_replication.
local function lp_finish(prev, ok, ...)
  core.C.eng_dtensor_set_loss_parallel(prev)
  if not ok then error((...), 0) end
  return ...
end

function M.loss_parallel(fn, ...)
  if type(fn) ~= "function" then fail("loss_parallel: expected a function to run, got " .. type(fn)) end
  local prev = core.C.eng_dtensor_set_loss_parallel(1)
  return lp_finish(prev, pcall(implicit.implicit_replication, fn, ...))
end

return M
