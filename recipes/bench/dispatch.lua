-- recipes/bench/dispatch.lua: per-op dispatch overhead seen from Lua.
--
--   build/engine recipes/bench/dispatch.lua [--n=100000] [--runs=7] [--case=name]
--
-- Times loops of n small ops on 4-element f32 tensors (so the arithmetic is negligible and what is
-- measured is the Lua -> FFI -> C dispatch, the result tensor's allocation from the caching allocator,
-- its Lua wrapper and its garbage collection) and prints ns/op, the median over `runs` runs:
--   add        c = a + b          (new tensor, grad mode on, no input requires grad)
--   add_grad   c = a + w          (w requires grad: an autograd node is recorded too)
--   add_       a:add_(b)          (in place, no allocation)
--   no_grad    c = a + b          inside engine.no_grad
-- Each case runs in a fresh engine process (the script re-runs itself with --case=name): in one
-- process, a case's figure depends on which cases ran before it (JIT traces and heap state), by up
-- to 1.5x.
local engine = require("engine")

local opts = require("engine.cli").parse(arg or {}, { name = "bench/dispatch",
  description = "The host cost of one op from Lua (dispatch overhead), case by case in fresh processes.",
  options = {
    { "n", 100000, "ops per case and run", int = true, min = 1 },
    { "runs", 7, "runs (the median is printed)", int = true, min = 1 },
    { "case", "", "run one case in this process (the script runs itself so)" },
  } })

local function median(t)
  table.sort(t)
  local n = #t
  return n % 2 == 1 and t[(n + 1) / 2] or 0.5 * (t[n / 2] + t[n / 2 + 1])
end

local a, b = engine.ones(4), engine.full({ 4 }, 2)
local w = engine.ones(4, { requires_grad = true })
local i4, m2 = engine.tensor({ 0, 1, 1, 0 }), engine.ones(2, 2)
local t2, w2 = engine.tensor({ 0, 1 }), engine.tensor({ 0.5, 2 })
local p2, q2 = engine.full({ 2, 2 }, 0.25), engine.full({ 2, 2 }, 0.5)
local mk = engine.tensor({ 1, 0, 1, 0 }):eq(1)

local cases = {
  { "add", "c = a + b (new tensor)", function(n) local c; for _ = 1, n do c = a + b end; return c end },
  { "add_grad", "c = a + w (w requires grad: node recorded)", function(n) local c; for _ = 1, n do c = a + w end; return c end },
  { "add_", "a:add_(b) (in place)", function(n) for _ = 1, n do a:add_(b) end; return a end },
  { "no_grad", "c = a + b under no_grad", function(n) local c; engine.no_grad(function() for _ = 1, n do c = a + b end end); return c end },
  -- torch's pointwise math, reductions, scans and sorts (engine/src/ops/math.c, reduce2.c, sort.c)
  { "sin", "c = a:sin()", function(n) local c; for _ = 1, n do c = a:sin() end; return c end },
  { "fmod", "c = a:fmod(b)", function(n) local c; for _ = 1, n do c = a:fmod(b) end; return c end },
  { "isnan", "c = a:isnan()", function(n) local c; for _ = 1, n do c = a:isnan() end; return c end },
  { "amax", "c = a:amax()", function(n) local c; for _ = 1, n do c = a:amax() end; return c end },
  { "cumsum", "c = a:cumsum(1)", function(n) local c; for _ = 1, n do c = a:cumsum(1) end; return c end },
  { "sort", "c, i = a:sort()", function(n) local c; for _ = 1, n do c = a:sort() end; return c end },
  -- the matmul family, indexing ops and losses: C ops (gather, index_add; engine/src/ops/index.c) and Lua composites (mm over
  -- matmul, einsum: parse + permute + matmul, triu: mask + masked_fill, leaky_relu: gt + mul + where)
  { "gather", "c = a:gather(1, i4)", function(n) local c; for _ = 1, n do c = a:gather(1, i4) end; return c end },
  { "index_add", "c = a:index_add(1, i4, b)", function(n) local c; for _ = 1, n do c = a:index_add(1, i4, b) end; return c end },
  { "mm", "c = engine.mm(m2, m2)", function(n) local c; for _ = 1, n do c = engine.mm(m2, m2) end; return c end },
  { "einsum", "c = engine.einsum(\"ij,jk->ik\", m2, m2)", function(n) local c; for _ = 1, n do c = engine.einsum("ij,jk->ik", m2, m2) end; return c end },
  { "triu", "c = m2:triu()", function(n) local c; for _ = 1, n do c = m2:triu() end; return c end },
  { "leaky", "c = a:leaky_relu(0.1)", function(n) local c; for _ = 1, n do c = a:leaky_relu(0.1) end; return c end },
  { "index", "c = m2[1] (Torch7 indexing: a select view)", function(n) local c; for _ = 1, n do c = m2[1] end; return c end },
  -- torch.nn.functional's other activations (engine/src/ops/unary.c) and glu (narrow x2 + sigmoid + mul)
  { "elu", "c = a:elu()", function(n) local c; for _ = 1, n do c = a:elu() end; return c end },
  { "hardtanh", "c = a:hardtanh()", function(n) local c; for _ = 1, n do c = a:hardtanh() end; return c end },
  { "relu6", "c = a:relu6()", function(n) local c; for _ = 1, n do c = a:relu6() end; return c end },
  { "softplus", "c = a:softplus()", function(n) local c; for _ = 1, n do c = a:softplus() end; return c end },
  { "glu", "c = a:glu()", function(n) local c; for _ = 1, n do c = a:glu() end; return c end },
  -- torch.nn.functional's other losses (lua/engine/ops/loss.lua: composites of k dispatches) on [2, 2] inputs, 0-based
  -- class ids t2; probabilities p2 in (0, 1)
  { "nll_loss", "c = engine.nll_loss(m2, t2)", function(n) local c; for _ = 1, n do c = engine.nll_loss(m2, t2) end; return c end },
  { "ce", "c = engine.cross_entropy(m2, t2) (fused op)", function(n) local c; for _ = 1, n do c = engine.cross_entropy(m2, t2) end; return c end },
  { "ce_ls", "c = engine.cross_entropy(m2, t2, {label_smoothing = 0.1})", function(n) local c; local o = { label_smoothing = 0.1 }; for _ = 1, n do c = engine.cross_entropy(m2, t2, o) end; return c end },
  { "ce_w", "c = engine.cross_entropy(m2, t2, {weight = w2})", function(n) local c; local o = { weight = w2 }; for _ = 1, n do c = engine.cross_entropy(m2, t2, o) end; return c end },
  { "bce", "c = engine.binary_cross_entropy(p2, q2)", function(n) local c; for _ = 1, n do c = engine.binary_cross_entropy(p2, q2) end; return c end },
  { "bce_logits", "c = engine.binary_cross_entropy_with_logits(m2, q2)", function(n) local c; for _ = 1, n do c = engine.binary_cross_entropy_with_logits(m2, q2) end; return c end },
  { "kl_div", "c = engine.kl_div(m2, q2)", function(n) local c; for _ = 1, n do c = engine.kl_div(m2, q2) end; return c end },
  { "smooth_l1", "c = engine.smooth_l1_loss(m2, q2)", function(n) local c; for _ = 1, n do c = engine.smooth_l1_loss(m2, q2) end; return c end },
  { "huber", "c = engine.huber_loss(m2, q2)", function(n) local c; for _ = 1, n do c = engine.huber_loss(m2, q2) end; return c end },
  -- indexing and shape ops (lua/engine/ops/index.lua)
  { "scatter", "c = a:scatter(1, i4, b)", function(n) local c; for _ = 1, n do c = a:scatter(1, i4, b) end; return c end },
  { "repeat", "c = a:repeat_tensor(2)", function(n) local c; for _ = 1, n do c = a:repeat_tensor(2) end; return c end },
  { "roll", "c = a:roll(1, 1)", function(n) local c; for _ = 1, n do c = a:roll(1, 1) end; return c end },
  { "flip", "c = a:flip(1)", function(n) local c; for _ = 1, n do c = a:flip(1) end; return c end },
  { "one_hot", "c = i4:one_hot(2)", function(n) local c; for _ = 1, n do c = i4:one_hot(2) end; return c end },
  { "masked_sel", "c = a:masked_select(mk)", function(n) local c; for _ = 1, n do c = a:masked_select(mk) end; return c end },
  { "unbind", "l = m2:unbind(1) (2 select views)", function(n) local c; for _ = 1, n do c = m2:unbind(1) end; return c end },
}

local function engine_binary()
  local f = assert(io.open("/proc/self/stat", "r"))
  local pid = f:read("*l"):match("^(%d+)")
  f:close()
  local q = io.popen("readlink /proc/" .. pid .. "/exe")
  local exe = q:read("*l")
  q:close()
  return exe
end

if opts.case == "" then
  print(string.format("dispatch: %d ops per run, median of %d runs, each case in its own process, engine %s, JIT %s",
    opts.n, opts.runs, engine.version, tostring(jit and jit.status())))
  local exe, script = engine_binary(), arg[0]
  for _, case in ipairs(cases) do
    local p = io.popen(string.format("'%s' '%s' --n=%d --runs=%d --case=%s 2>&1", exe, script, opts.n, opts.runs,
      case[1]))
    io.write(p:read("*a"))
    p:close()
  end
  return
end

local known = {}
for _, case in ipairs(cases) do known[#known + 1] = case[1] end
if not (" " .. table.concat(known, " ") .. " "):find(" " .. opts.case .. " ", 1, true) then
  error("dispatch: unknown --case=" .. opts.case .. " (cases: " .. table.concat(known, ", ") .. ")", 0)
end
for _, case in ipairs(cases) do
  local name, desc, fn = case[1], case[2], case[3]
  if name ~= opts.case then goto continue end
  fn(opts.n)  -- warm-up: JIT traces, allocator cache
  collectgarbage()
  local ts = {}
  for r = 1, opts.runs do
    local t0 = engine.time()
    fn(opts.n)
    ts[r] = (engine.time() - t0) * 1e9 / opts.n
  end
  local med = median(ts)
  print(string.format("  %-10s %8.1f ns/op   (min %.1f, max %.1f)   %s", name, med, ts[1], ts[#ts], desc))
  ::continue::
end
