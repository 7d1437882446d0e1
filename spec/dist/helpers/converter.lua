-- spec/dist/helpers/converter.lua: DTensor converter harness (port of common_dtensor.py's
-- DTensorConverter).  For an op and plain inputs it enumerates every placement
-- choice of every input (Replicate and Shard on each dim, per mesh dim) on a 1-D
-- mesh of the world and, with 4 ranks, on a 2x2 mesh; runs the op on DTensors;
-- compares out:full_tensor() with the op on the plain tensors (forward) and,
-- after (out * g):sum():backward() with a fixed random g laid out like the
-- output (Partial taken as Replicate), every input's grad:full_tensor() with the
-- single-process gradient (backward).
--
--   local conv = require("spec.dist.helpers.converter")
--   local n = conv.check("add", function(a, b) return a + b end, { a, b }, opts)
--   -- returns the number of cases run; raises (with the case) on the first mismatch
-- opts: grad (default true: floating inputs require grad), tol (1e-9, relative to
-- max |ref| + 1), meshes ("1d", "2d" or "all", default "all"), max_cases (per mesh),
-- choices = function(i, t, mesh_ndim) -> list of placement lists for input i
-- (default: every combination), outputs: how many results of fn to compare (1),
-- cover = true: instead of every combination (which grows as the product of the
-- inputs' choices, and which max_cases cuts off before the later inputs vary),
-- the bounded set of M.cover_cases, which shards every input; partial = true
-- (with cover): the floating inputs also come Partial(sum) (M.cover_cases).
-- Every rank runs the same cases in the same order (inputs must be equal on all
-- ranks: make them after engine.manual_seed with the same seed).
local engine = require("engine")
local dist = engine.distributed
local S, Rep = dist.Shard, dist.Replicate

local M = {}
local W = dist.world_size()

local meshes = {}
function M.meshes(which)
  which = which or "all"
  if not meshes["1d"] then
    meshes["1d"] = dist.init_device_mesh("cpu", { W })
    if W == 4 then meshes["2d"] = dist.init_device_mesh("cpu", { 2, 2 }, { "dp", "tp" }) end
  end
  local r = {}
  if which == "all" or which == "1d" then r[#r + 1] = meshes["1d"] end
  if (which == "all" or which == "2d") and meshes["2d"] then r[#r + 1] = meshes["2d"] end
  return r
end

-- every placement list for a tensor of nd dims on a mesh of mnd dims
function M.placement_lists(nd, mnd)
  local one = { Rep() }
  for d = 1, nd do one[#one + 1] = S(d) end
  local out = { {} }
  for _ = 1, mnd do
    local nxt = {}
    for _, pre in ipairs(out) do
      for _, p in ipairs(one) do
        local l = { table.unpack(pre) }
        l[#l + 1] = p
        nxt[#nxt + 1] = l
      end
    end
    out = nxt
  end
  return out
end

local function is_float(t) return t:is_floating_point() end

local function all_rep(mnd)
  local l = {}
  for m = 1, mnd do l[m] = Rep() end
  return l
end

local function pl_str(pl)
  local t = {}
  for i, p in ipairs(pl) do t[i] = tostring(p) end
  return "[" .. table.concat(t, ", ") .. "]"
end

local function maxdiff(a, b)
  local sa, sb = a:shape(), b:shape()
  if #sa ~= #sb then return math.huge end
  for i = 1, #sa do if sa[i] ~= sb[i] then return math.huge end end
  if a:numel() == 0 then return 0 end
  return (a:double() - b:double()):abs():max():item()
end

local function scale(t)
  if t:numel() == 0 then return 1 end
  return t:double():abs():max():item() + 1
end


-- adjoint placements of an output (Partial -> Replicate)
local function adjoint(pl)
  local r = {}
  for i, p in ipairs(pl) do r[i] = p:is_partial() and Rep() or p end
  return r
end

-- A bounded choice of cases (each a list of one placement list per input) that
-- shards every input, for ops of several inputs:
--   * all Replicate;
--   * each input through all its placement lists, the others Replicate;
--   * "all sharded alike": every placement list of the widest input, applied to
--     every input with its dims aligned to the widest one's from the left and
--     from the right (broadcasting), Replicate where an input lacks the dim;
--   * the diagonals: every pair of inputs, every dim of each, both Shard on the
--     same mesh dim (each mesh dim in turn, the others Replicate) and, on a mesh
--     of several dims, on all of them (a contracted dim sharded on both
--     operands: the Partial case).
--   * partial = true: each floating input Partial(sum) on each mesh dim (and,
--     on a mesh of several dims, on all, and Partial on one beside each Shard
--     on another), the others Replicate; every floating input Partial alike on
--     each mesh dim; each with every other input through its Shard placements
--     on that mesh dim.  A Partial input is made of its value split unevenly
--     over the mesh dim's ranks (weights 1 : 2 : ... : n).
-- Duplicates are dropped.  About sum_i (nd_i+1)^mnd + 2 (nd+1)^mnd +
-- pairs * nd_i * nd_j * (mnd + 1) cases (more with partial).
function M.cover_cases(inputs, mnd, partial)
  local cases, seen = {}, {}
  local function add(c)
    local key = {}
    for i, pl in ipairs(c) do key[i] = pl_str(pl) end
    key = table.concat(key, ";")
    if not seen[key] then seen[key] = true; cases[#cases + 1] = c end
  end
  local function base()
    local c = {}
    for i = 1, #inputs do c[i] = all_rep(mnd) end
    return c
  end
  add(base())
  for i, t in ipairs(inputs) do
    for _, pl in ipairs(M.placement_lists(t:dim(), mnd)) do
      local c = base()
      c[i] = pl
      add(c)
    end
  end
  local wide = 0
  for _, t in ipairs(inputs) do wide = math.max(wide, t:dim()) end
  for _, right in ipairs({ false, true }) do
    for _, pl in ipairs(M.placement_lists(wide, mnd)) do
      local c = {}
      for i, t in ipairs(inputs) do
        local l = {}
        for m, p in ipairs(pl) do
          local d = p:is_shard() and (right and p.dim - (wide - t:dim()) or p.dim) or nil
          l[m] = (d and d >= 1 and d <= t:dim()) and S(d) or Rep()
        end
        c[i] = l
      end
      add(c)
    end
  end
  for i = 1, #inputs do
    for j = i + 1, #inputs do
      for a = 1, inputs[i]:dim() do
        for b = 1, inputs[j]:dim() do
          local spots = {}
          for m = 1, mnd do spots[#spots + 1] = { m } end
          if mnd > 1 then
            local every = {}
            for m = 1, mnd do every[m] = m end
            spots[#spots + 1] = every
          end
          for _, ms in ipairs(spots) do
            local c = base()
            for _, m in ipairs(ms) do c[i][m] = S(a); c[j][m] = S(b) end
            add(c)
          end
        end
      end
    end
  end
  if partial then
    local P = dist.Partial
    for i, t in ipairs(inputs) do
      if is_float(t) then
        for m = 1, mnd do
          local c = base()
          c[i][m] = P()
          add(c)
          -- with every other input sharded on that mesh dim
          for j, u in ipairs(inputs) do
            if j ~= i then
              for b = 1, u:dim() do
                local cj = base()
                cj[i][m] = P()
                cj[j][m] = S(b)
                add(cj)
              end
            end
          end
          -- on a mesh of several dims: beside its own Shard on the others
          for a = 1, t:dim() do
            if mnd > 1 then
              local ca = base()
              for mm = 1, mnd do ca[i][mm] = mm == m and P() or S(a) end
              add(ca)
            end
          end
        end
        if mnd > 1 then
          local c = base()
          for m = 1, mnd do c[i][m] = P() end
          add(c)
        end
      end
    end
    for m = 1, mnd do
      local c = base()
      for i, t in ipairs(inputs) do if is_float(t) then c[i][m] = P() end end
      add(c)
    end
  end
  return cases
end

-- distribute t with placements pl that may hold Partial(sum): the value split
-- over each Partial mesh dim's ranks with weights 1 : 2 : ... : n
local function distribute_any(t, mesh, pl)
  local rep, w = {}, 1
  local coord = mesh:get_coordinate()
  for m, p in ipairs(pl) do
    if p:is_partial() then
      local n = mesh:size(m)
      rep[m] = Rep()
      w = w * (coord[m] + 1) * 2 / (n * (n + 1))
    else
      rep[m] = p
    end
  end
  local d = dist.distribute_tensor(t, mesh, rep, { src_data_rank = false })
  if w == 1 then return d end
  local shape, stride, acc = t:shape(), {}, 1
  for k = #shape, 1, -1 do stride[k] = acc; acc = acc * shape[k] end
  return dist.DTensor.from_local(d:to_local() * w, mesh, pl, { shape = shape, stride = stride })
end

function M.check(name, fn, inputs, opts)
  opts = opts or {}
  local want_grad = opts.grad ~= false
  local tol = opts.tol or 1e-9
  local nout = opts.outputs or 1
  -- reference
  local ref_in = {}
  for i, t in ipairs(inputs) do
    local c = t:clone()
    if want_grad and is_float(c) then c.requires_grad = true end
    ref_in[i] = c
  end
  local ref = table.pack(fn(table.unpack(ref_in)))
  local out0 = ref[1]
  local do_grad = want_grad and is_float(out0) and out0.requires_grad
  local g
  if do_grad then
    engine.manual_seed(12345)
    g = engine.randn(out0:shape(), { dtype = out0.dtype })
    ;(out0 * g):sum():backward()
  end
  local n = 0
  for _, mesh in ipairs(M.meshes(opts.meshes)) do
    local mnd = mesh:ndim()
    local cover = opts.cover and M.cover_cases(inputs, mnd, opts.partial)
    local choices = {}
    for i, t in ipairs(inputs) do
      choices[i] = opts.choices and opts.choices(i, t, mnd) or M.placement_lists(t:dim(), mnd)
    end
    -- odometer over the inputs' choices
    local idx = {}
    for i = 1, #inputs do idx[i] = 1 end
    local count = 0
    while true do
      count = count + 1
      if opts.max_cases and count > opts.max_cases then break end
      local pls, dins, desc = {}, {}, {}
      for i, t in ipairs(inputs) do
        pls[i] = cover and cover[count][i] or choices[i][idx[i]]
        local d = distribute_any(t, mesh, pls[i])
        if want_grad and is_float(t) then d.requires_grad = true end
        dins[i] = d
        desc[i] = pl_str(pls[i])
      end
      local case = string.format("%s on mesh %s with inputs %s", name, table.concat(mesh:shape(), "x"), table.concat(desc, ", "))
      local outs = table.pack(fn(table.unpack(dins)))
      for j = 1, nout do
        local o, r = outs[j], ref[j]
        if not dist.is_dtensor(o) then error(case .. ": output " .. j .. " is not a DTensor", 0) end
        local full = o:full_tensor()
        local e = maxdiff(full, r)
        if not (e <= tol * scale(r)) then
          error(string.format("%s: forward output %d differs by %g (layout %s)", case, j, e, pl_str(o.placements)), 0)
        end
      end
      if do_grad then
        local o = outs[1]
        local dg = dist.distribute_tensor(g, mesh, adjoint(o.placements), { src_data_rank = false })
        ;(o * dg):sum():backward()
        for i, t in ipairs(ref_in) do
          if t.grad then
            local gi = dins[i].grad
            if gi == nil then error(string.format("%s: input %d got no gradient", case, i), 0) end
            if not dist.is_dtensor(gi) then error(string.format("%s: gradient of input %d is not a DTensor", case, i), 0) end
            local e = maxdiff(gi:full_tensor(), t.grad)
            if not (e <= tol * scale(t.grad)) then
              error(string.format("%s: gradient of input %d differs by %g (grad layout %s)", case, i, e, pl_str(gi.placements)), 0)
            end
            for k, p in ipairs(gi.placements) do
              if p:is_partial() then error(string.format("%s: .grad of input %d is Partial on mesh dim %d", case, i, k), 0) end
            end
          end
        end
      end
      n = n + 1
      if cover then
        if count >= #cover then break end
      else
        -- next combination
        local k = 1
        while k <= #inputs do
          idx[k] = idx[k] + 1
          if idx[k] <= #choices[k] then break end
          idx[k] = 1
          k = k + 1
        end
        if k > #inputs then break end
      end
    end
  end
  return n
end

return M
