-- The GPT (models.Transformer) under Transformer.parallelize keeps the plain model's fused ops on its local shards:
-- one GEMM for q, k and v (each rank's shards of wq, wk, wv side by side, fuse_linear_shards), w1 with its gelu as
-- one op (linear_gelu's DTensor rule), the plain embedding lookup on a 1-rank mesh.  Each plan (default, sequence
-- parallel, local_output_for_attn, attention biases) gives the single-process losses, gradients and parameters
-- over AdamW steps, at 1, 2 and 4 ranks, with the plain model's count of linear / linear_gelu calls.
local engine = require("engine")
local dist = engine.distributed
local models = require("engine.models")
-- the functional table engine.models calls (count_calls replaces its functions): busted loads each spec file with
-- a fresh package.loaded, so after another file engine.nn (a field the host's engine table keeps) can be an older
-- copy of the module than the one require gives engine.models
local nn = require("engine.nn")
local F = nn.functional
local util = require("spec.dist.helpers.util")

local W = dist.world_size()
local mesh = dist.init_device_mesh("cpu", { W }, { "tp" })

local function full(t)
  if dist.is_dtensor(t) then return t:full_tensor() end
  return t
end
local function diff(a, b) return util.diff(full(a), full(b)) end
local function rel(a, b) return math.abs(a - b) / math.max(1, math.abs(b)) end

local V, T = 32, 8
local function args(extra)
  local a = { n_layers = 2, dim = 32, n_heads = 4, vocab_size = V, max_seq_len = T, dropout_p = 0, gelu = "tanh" }
  for k, v in pairs(extra or {}) do a[k] = v end
  return a
end
local function tokens(b, t, seed)
  engine.manual_seed(seed)
  return (engine.rand(b, t) * V):to("i64")
end
local function make(a) engine.manual_seed(7); return models.Transformer(a) end

-- the calls of F.linear and F.linear_gelu while fn runs
local function count_calls(fn)
  local lin, lg = F.linear, F.linear_gelu
  local n = { linear = 0, linear_gelu = 0 }
  F.linear = function(...) n.linear = n.linear + 1; return lin(...) end
  F.linear_gelu = function(...) n.linear_gelu = n.linear_gelu + 1; return lg(...) end
  local ok, r = pcall(fn)
  F.linear, F.linear_gelu = lin, lg
  assert(ok, r)
  return n, r
end

-- 4 AdamW steps of m and ref on the same batches: every step's loss and gradients, then the parameters
local function train_equal(label, m, ref)
  local opt_r = engine.optim.AdamW(ref:parameters(), { lr = 1e-2, weight_decay = 0.1 })
  local opt_m = engine.optim.AdamW(m:parameters(), { lr = 1e-2, weight_decay = 0.1 })
  for step = 1, 4 do
    local x, y = tokens(4, T, 100 + step), tokens(4, T, 200 + step)
    local nm, lm = count_calls(function() local _, l = m(x, y); return l end)
    local nr, lr = count_calls(function() local _, l = ref(x, y); return l end)
    assert.are.same(nr, nm, label .. ": linear / linear_gelu calls")
    lm:backward(); lr:backward()
    local a, b = full(lm):item(), lr:item()
    assert.is_true(rel(a, b) <= 1e-5, string.format("%s step %d: loss %.9g vs %.9g", label, step, a, b))
    for name, p in m:named_parameters() do
      local d = diff(p.grad, ref:get_parameter(name).grad)
      assert.is_true(d <= 1e-5, string.format("%s step %d: grad of %s differs by %g", label, step, name, d))
    end
    opt_m:step(); opt_m:zero_grad(); opt_r:step(); opt_r:zero_grad()
  end
  for name, p in m:named_parameters() do
    -- (not the key biases: their gradient is zero in exact arithmetic, softmax ignoring a constant added to a row
    -- of scores, so AdamW moves them by about lr on rounding noise, in any layout; their gradients are compared)
    if not name:match("attention%.wk%.bias$") then
      local d = diff(p, ref:get_parameter(name))
      assert.is_true(d <= 1e-4, label .. ": parameter " .. name .. " differs by " .. d)
    end
  end
end

describe("Transformer.parallelize keeps the fused ops", function()
  for _, case in ipairs({
    { name = "default plan" },
    { name = "sequence parallel", opts = { use_seq_parallel = true } },
    { name = "local_output_for_attn", opts = { local_output_for_attn = true } },
    { name = "attention biases", model = { attn_bias = true } },
    { name = "biases, sequence parallel, local attention", model = { attn_bias = true },
      opts = { use_seq_parallel = true, local_output_for_attn = true } },
  }) do
    it(case.name .. ": the single-process losses, gradients and parameters", function()
      local ref, m = make(args(case.model)), make(args(case.model))
      models.Transformer.parallelize(m, mesh, case.opts)
      -- each rank's q, k, v shards lie side by side (the one GEMM reads them without a copy)
      local at = m.layers[1].attention
      assert.is_true(engine.tensors_adjacent({ at.wq.weight:to_local(), at.wk.weight:to_local(),
        at.wv.weight:to_local() }, 1))
      train_equal(case.name, m, ref)
    end)
  end

  it("runs the three modules when another hook sits on a projection", function()
    local ref, m = make(args()), make(args())
    models.Transformer.parallelize(m, mesh)
    local seen = 0
    m.layers[1].attention.wk:register_forward_hook(function() seen = seen + 1 end)
    m.layers[1].feed_forward.w1:register_forward_hook(function() seen = seen + 1 end)
    local x, y = tokens(2, T, 1), tokens(2, T, 2)
    local n = count_calls(function() return select(2, m(x, y)) end)
    assert.are.equal(2, seen)
    -- layer 1: three q/k/v GEMMs, w1 then gelu; layer 2 fused
    assert.are.same({ linear = 3 + 1 + 1 + 3 + 1 + 1, linear_gelu = 1 }, n)
    local _, lm = m(x, y)
    local _, lr = ref(x, y)
    assert.is_true(rel(full(lm):item(), lr:item()) <= 1e-5)
  end)

  it("fuses the shards again after module:to", function()
    local m = make(args())
    models.Transformer.parallelize(m, mesh)
    m:to("f64")
    local at = m.layers[2].attention
    assert.are.equal("f64", at.wq.weight.dtype)
    assert.is_true(engine.tensors_adjacent({ at.wq.weight:to_local(), at.wk.weight:to_local(),
      at.wv.weight:to_local() }, 1))
  end)
end)
