-- engine.ops.linalg: PyTorch's matmul family (mm, bmm, addmm, ...), all on the existing
-- GEMM path (engine.matmul), so each inherits matmul's DTensor rules, autograd,
-- dtypes and CUDA kernels (cuBLAS).
--
--   engine.mm(a, b)                      2-D x 2-D
--   engine.bmm(a, b)                     [B, n, k] x [B, k, m]
--   engine.addmm(bias, a, b [, {beta = 1, alpha = 1}])      beta * bias + alpha * a @ b
--   engine.baddbmm(bias, a, b [, {beta = 1, alpha = 1}])    the same, batched
--   engine.outer(u, v)                   u [n] x v [m] -> [n, m]
--   engine.einsum(equation, a [, b])     one or two operands, explicit "->" output or the
--                                        implicit one; each letter a dim; a letter in both
--                                        operands and not in the output is contracted, one only
--                                        in one operand and not in the output is summed.  Not
--                                        supported (an error naming the equation): "...",
--                                        a letter repeated in one operand (diagonals), more
--                                        than two operands.
-- Transformer contractions ("bld,hd->blh", "bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd") are one
-- permute/unsqueeze each plus one batched matmul.
local core = require("engine.core")
local Tensor = require("engine.tensor")
local methods = Tensor.methods

local M = {}
local fail = core.fail

local function need(t, op, pos)
  if not core.is_tensor(t) then fail(string.format("%s: argument %d must be a tensor, got %s", op, pos, type(t))) end
end
local function shp(t) return "[" .. table.concat(t:shape(), ",") .. "]" end

function M.mm(a, b)
  need(a, "mm", 1); need(b, "mm", 2)
  if a:dim() ~= 2 or b:dim() ~= 2 then
    fail(string.format("mm: expects two 2-D tensors, got %s%s and %s%s", a.dtype, shp(a), b.dtype, shp(b)))
  end
  if a:size(2) ~= b:size(1) then
    fail(string.format("mm: %s%s x %s%s: inner dims %d and %d differ", a.dtype, shp(a), b.dtype, shp(b), a:size(2), b:size(1)))
  end
  local r = a:matmul(b)
  return r
end

function M.bmm(a, b)
  need(a, "bmm", 1); need(b, "bmm", 2)
  if a:dim() ~= 3 or b:dim() ~= 3 then
    fail(string.format("bmm: expects two 3-D tensors, got %s%s and %s%s", a.dtype, shp(a), b.dtype, shp(b)))
  end
  if a:size(1) ~= b:size(1) then
    fail(string.format("bmm: %s%s x %s%s: batch sizes %d and %d differ", a.dtype, shp(a), b.dtype, shp(b), a:size(1), b:size(1)))
  end
  if a:size(3) ~= b:size(2) then
    fail(string.format("bmm: %s%s x %s%s: inner dims %d and %d differ", a.dtype, shp(a), b.dtype, shp(b), a:size(3), b:size(2)))
  end
  local r = a:matmul(b)
  return r
end

local function beta_alpha(opts, op)
  local beta, alpha = 1, 1
  if opts ~= nil then
    if type(opts) ~= "table" or core.is_tensor(opts) then fail(op .. ": options must be a table {beta =, alpha =}") end
    for k in pairs(opts) do
      if k ~= "beta" and k ~= "alpha" then fail(op .. ": unknown option '" .. tostring(k) .. "' (valid: alpha, beta)") end
    end
    beta, alpha = opts.beta or 1, opts.alpha or 1
    if type(beta) ~= "number" or type(alpha) ~= "number" then fail(op .. ": beta and alpha must be numbers") end
  end
  return beta, alpha
end

local function affine(bias, prod, beta, alpha)
  local p = alpha == 1 and prod or prod * alpha
  if beta == 0 then return p end -- PyTorch ignores the bias values (nan/inf too) when beta = 0
  local b = beta == 1 and bias or bias * beta
  return b + p
end

function M.addmm(bias, a, b, opts)
  need(bias, "addmm", 1)
  local beta, alpha = beta_alpha(opts, "addmm")
  local r = affine(bias, M.mm(a, b), beta, alpha)
  return r
end

function M.baddbmm(bias, a, b, opts)
  need(bias, "baddbmm", 1)
  local beta, alpha = beta_alpha(opts, "baddbmm")
  local r = affine(bias, M.bmm(a, b), beta, alpha)
  return r
end

function M.outer(u, v)
  need(u, "outer", 1); need(v, "outer", 2)
  if u:dim() ~= 1 or v:dim() ~= 1 then
    fail(string.format("outer: expects two 1-D tensors, got %s%s and %s%s", u.dtype, shp(u), v.dtype, shp(v)))
  end
  local r = u:unsqueeze(2):matmul(v:unsqueeze(1))
  return r
end
M.ger = M.outer

-- ------------------------------------------------------------ einsum
local function letters(s, eq)
  local l, seen = {}, {}
  for ch in s:gmatch(".") do
    if ch == "." then fail("einsum: '" .. eq .. "': ellipsis (...) is not supported") end
    if not ch:match("%a") then fail("einsum: '" .. eq .. "': invalid subscript '" .. ch .. "' (letters only)") end
    if seen[ch] then
      fail("einsum: '" .. eq .. "': subscript '" .. ch .. "' repeated in one operand (diagonals are not supported)")
    end
    seen[ch] = true
    l[#l + 1] = ch
  end
  return l, seen
end

-- Plans: the shape ops einsum applies depend only on the equation and the operand shapes, so the
-- first call records them (plan.A / plan.B before the matmul, plan.R after it) and later calls with
-- the same key replay them without parsing (a bounded cache).
local plan
local function op(which, t, name, arg)
  local steps = plan[which]
  steps[#steps + 1] = { name, arg }
  return t[name](t, arg)
end
local function replay(steps, t)
  for i = 1, #steps do local s = steps[i]; t = t[s[1]](t, s[2]) end
  return t
end
local cache, cache_n = {}, 0

local function perm_to(which, t, from, to)
  -- permute t (dims labelled by `from`) so its dims are labelled `to` (same set)
  local pos = {}
  for i, ch in ipairs(from) do pos[ch] = i end
  local perm, ident = {}, true
  for i, ch in ipairs(to) do perm[i] = pos[ch]; if perm[i] ~= i then ident = false end end
  if ident or #to == 0 then return t end
  return op(which, t, "permute", perm)
end

local function sum_out(which, t, labels, keep)
  -- sums away labels not in keep; returns t and the remaining labels
  local dims, rest = {}, {}
  for i, ch in ipairs(labels) do
    if keep[ch] then rest[#rest + 1] = ch else dims[#dims + 1] = i end
  end
  if #dims == 0 then return t, rest end
  return op(which, t, "sum", dims), rest
end

local function plan_einsum(eq, a, b, ...)
  if type(eq) ~= "string" then fail("einsum: the first argument must be the equation string") end
  if select("#", ...) > 0 then fail("einsum: '" .. eq .. "': at most two operands are supported") end
  local e = eq:gsub("%s", "")
  local lhs, out = e:match("^([^%-]*)%->(.*)$")
  if not lhs then lhs = e end
  local ins = {}
  for part in (lhs .. ","):gmatch("([^,]*),") do ins[#ins + 1] = part end
  local ops = { a, b }
  local nops = b == nil and 1 or 2
  if #ins ~= nops then
    fail(string.format("einsum: '%s': %d operands in the equation, %d given", eq, #ins, nops))
  end
  local L, S = {}, {}
  local count = {}
  for i = 1, nops do
    need(ops[i], "einsum", i + 1)
    L[i], S[i] = letters(ins[i], eq)
    if #L[i] ~= ops[i]:dim() then
      fail(string.format("einsum: '%s': operand %d has %d dims but its subscripts '%s' name %d", eq, i,
        ops[i]:dim(), ins[i], #L[i]))
    end
    for _, ch in ipairs(L[i]) do count[ch] = (count[ch] or 0) + 1 end
  end
  local O, OS
  if out then
    O, OS = letters(out, eq)
    for _, ch in ipairs(O) do
      if not count[ch] then fail("einsum: '" .. eq .. "': output subscript '" .. ch .. "' appears in no operand") end
    end
  else -- implicit output: letters seen once, in alphabetical order
    O, OS = {}, {}
    for ch, n in pairs(count) do if n == 1 then O[#O + 1] = ch; OS[ch] = true end end
    table.sort(O)
  end
  -- sizes agree
  local size = {}
  for i = 1, nops do
    for d, ch in ipairs(L[i]) do
      local n = ops[i]:size(d)
      if size[ch] and size[ch] ~= n then
        fail(string.format("einsum: '%s': subscript '%s' has size %d in one operand and %d in another", eq, ch, size[ch], n))
      end
      size[ch] = n
    end
  end
  if nops == 1 then
    local t, rest = sum_out("A", a, L[1], OS)
    local r = perm_to("A", t, rest, O)
    if r == a then r = op("A", a, "view", a:shape()) end
    return r
  end
  -- two operands: letters only in one operand and not in the output are summed first
  local keepA, keepB = {}, {}
  for ch in pairs(OS) do keepA[ch] = true; keepB[ch] = true end
  for _, ch in ipairs(L[2]) do keepA[ch] = true end
  for _, ch in ipairs(L[1]) do keepB[ch] = true end
  local A, la = sum_out("A", a, L[1], keepA)
  local B, lb = sum_out("B", b, L[2], keepB)
  local inA, inB = {}, {}
  for _, ch in ipairs(la) do inA[ch] = true end
  for _, ch in ipairs(lb) do inB[ch] = true end
  local batch, left, right, contr = {}, {}, {}, {}
  for _, ch in ipairs(O) do
    if inA[ch] and inB[ch] then batch[#batch + 1] = ch
    elseif inA[ch] then left[#left + 1] = ch
    else right[#right + 1] = ch end
  end
  for _, ch in ipairs(la) do if inB[ch] and not OS[ch] then contr[#contr + 1] = ch end end
  -- A as [batch..., left..., (1 per right but the last)..., lastleft, K]; B as
  -- [batch..., (1 per left but the last)..., right..., K, lastright]: one broadcast matmul.
  local la2 = {}
  for _, ch in ipairs(batch) do la2[#la2 + 1] = ch end
  for _, ch in ipairs(left) do la2[#la2 + 1] = ch end
  for _, ch in ipairs(contr) do la2[#la2 + 1] = ch end
  local lb2 = {}
  for _, ch in ipairs(batch) do lb2[#lb2 + 1] = ch end
  for _, ch in ipairs(contr) do lb2[#lb2 + 1] = ch end
  for _, ch in ipairs(right) do lb2[#lb2 + 1] = ch end
  A = perm_to("A", A, la, la2)
  B = perm_to("B", B, lb, lb2)
  local nb, nl, nr, nc = #batch, #left, #right, #contr
  -- flatten the contracted dims into one K (a reshape; 0 contracted dims: K = 1)
  local function shape_of(t) return t:shape() end
  local sa, sb = shape_of(A), shape_of(B)
  local K = 1
  for _, ch in ipairs(contr) do K = K * size[ch] end
  if nc ~= 1 then
    local na = {}
    for i = 1, nb + nl do na[i] = sa[i] end
    na[#na + 1] = K
    A = op("A", A, "reshape", na)
    local nbs = {}
    for i = 1, nb do nbs[i] = sb[i] end
    nbs[#nbs + 1] = K
    for i = 1, nr do nbs[#nbs + 1] = sb[nb + nc + i] end
    B = op("B", B, "reshape", nbs)
  end
  -- A: [batch, left..., K]; B: [batch, K, right...]
  if nl == 0 then A = op("A", A, "unsqueeze", nb + 1) end       -- a size-1 left dim
  if nr == 0 then B = op("B", B, "unsqueeze", nb + 2) end       -- a size-1 right dim
  local nl2, nr2 = math.max(nl, 1), math.max(nr, 1)
  -- move B's K before its last right dim: [batch, right[1..nr2-1], K, right[nr2]]
  if nr2 > 1 then
    local p = {}
    for i = 1, nb do p[#p + 1] = i end
    for i = 1, nr2 - 1 do p[#p + 1] = nb + 1 + i end
    p[#p + 1] = nb + 1
    p[#p + 1] = nb + 1 + nr2
    B = op("B", B, "permute", p)
  end
  -- broadcast dims: A gets nr2-1 ones before its last left dim; B gets nl2-1 ones after batch
  for _ = 1, nr2 - 1 do A = op("A", A, "unsqueeze", nb + nl2) end
  for _ = 1, nl2 - 1 do B = op("B", B, "unsqueeze", nb + 1) end
  local R = A:matmul(B)   -- [batch, left[1..nl2-1], right[1..nr2-1], left[nl2], right[nr2]]
  local rl = {}
  for _, ch in ipairs(batch) do rl[#rl + 1] = ch end
  for i = 1, nl2 - 1 do rl[#rl + 1] = left[i] end
  for i = 1, nr2 - 1 do rl[#rl + 1] = right[i] end
  rl[#rl + 1] = nl > 0 and left[nl] or "#l"
  rl[#rl + 1] = nr > 0 and right[nr] or "#r"
  -- drop the size-1 placeholders
  if nr == 0 then R = op("R", R, "squeeze", #rl); rl[#rl] = nil end
  if nl == 0 then
    local pos = nr == 0 and #rl or #rl - 1
    R = op("R", R, "squeeze", pos)
    table.remove(rl, pos)
  end
  local r = perm_to("R", R, rl, O)
  return r
end

local function shape_key(t) return core.is_tensor(t) and table.concat(t:shape(), ",") or "?" end

function M.einsum(eq, a, b, ...)
  local key = type(eq) == "string" and select("#", ...) == 0 and (eq .. "|" .. shape_key(a) .. "|" .. (b == nil and "-" or shape_key(b)))
  local p = key and cache[key]
  if p and core.is_tensor(a) and (b == nil or core.is_tensor(b)) then
    local A = replay(p.A, a)
    if b == nil then return A end
    local r = replay(p.R, A:matmul(replay(p.B, b)))
    return r
  end
  plan = { A = {}, B = {}, R = {} }
  local r = plan_einsum(eq, a, b, ...)
  if key then
    if cache_n >= 256 then cache, cache_n = {}, 0 end
    cache[key] = plan
    cache_n = cache_n + 1
  end
  return r
end

for _, name in ipairs({ "mm", "bmm", "outer", "ger" }) do methods[name] = M[name] end
function methods.addmm(bias, a, b, opts) return M.addmm(bias, a, b, opts) end
function methods.baddbmm(bias, a, b, opts) return M.baddbmm(bias, a, b, opts) end

return M
