-- Activation checkpointing applied to a model in place: nn.apply_activation_checkpointing (PyTorch's
-- apply_activation_checkpointing with the composable checkpoint(module): marks, no wrapper) and models.apply_ac
-- (torchtitan's --activation_checkpoint.mode none | full | every Nth block).  Training with full AC, every-2nd-block
-- AC and none gives the same losses, gradients and parameters, bit for bit (the recompute runs the same kernels
-- on the same inputs, with the forward's random-number state restored: on CPU it is deterministic), with dropout
-- too; the checkpointed forward keeps fewer activations and the step peaks lower; marks keep the names of
-- parameters and state dicts; no_grad runs the module plainly; options are checked.  (FSDP and TP with marks:
-- spec/dist/activation_checkpointing_spec.lua; the recipes' --act_ckpt: spec/recipe_spec.lua.)
local engine = require("engine")
local nn = engine.nn
local F = nn.functional
local models = require("engine.models")
local errors = require("spec.helpers.errors")

local MiB = 2 ^ 20

-- max |a - b| (0: the same bits, for finite values)
local function maxdiff(a, b) return (a:double() - b:double()):abs():max():item() end

local function tiny_gpt(dropout)
  return nn.Transformer{ n_layers = 4, dim = 16, n_heads = 2, vocab_size = 32, max_seq_len = 8, dropout_p = dropout }
end
local function tiny_llama()
  return nn.Llama{ dim = 16, n_layers = 3, n_heads = 4, n_kv_heads = 2, vocab_size = 32, multiple_of = 16,
    max_seq_len = 8 }
end

-- 3 AdamW steps of build() with apply(model) -> losses, {name -> grad of each step}, final parameters
local function train(build, apply)
  engine.manual_seed(3)
  local m = build()
  if apply then apply(m) end
  local opt = engine.optim.AdamW(m:parameters(), { lr = 1e-2, weight_decay = 0.1 })
  local losses, grads = {}, {}
  for step = 1, 3 do
    engine.manual_seed(100 + step)
    local ids = (engine.rand(3, 9) * 31.99):to("i64")
    local x, y = ids:narrow(2, 1, 8), ids:narrow(2, 2, 8)
    local loss = F.cross_entropy(m(x), y)
    loss:backward()
    losses[step] = loss:item()
    grads[step] = {}
    for name, p in m:named_parameters() do grads[step][name] = p.grad:clone() end
    opt:step()
    opt:zero_grad()
  end
  local params = {}
  for name, p in m:named_parameters() do params[name] = p:clone() end
  return losses, grads, params, engine.get_rng_state()
end

local function same_training(build, modes)
  local l0, g0, p0, rng0 = train(build)
  for _, mode in ipairs(modes) do
    local l, g, p, rng = train(build, function(m) assert.is_true(models.apply_ac(m, mode) > 0) end)
    for s = 1, 3 do
      assert.are.equal(l0[s], l[s], string.format("mode %s: loss of step %d", tostring(mode), s))
      local n = 0
      for name, want in pairs(g0[s]) do
        assert.are.equal(0, maxdiff(g[s][name], want), string.format("mode %s step %d grad %s", tostring(mode), s, name))
        n = n + 1
      end
      assert.is_true(n > 10)
    end
    for name, want in pairs(p0) do
      assert.are.equal(0, maxdiff(p[name], want), string.format("mode %s: parameter %s", tostring(mode), name))
    end
    assert.are.same(rng0, rng, "the recompute leaves the generator where the forward left it")
  end
end

describe("activation checkpointing of a model's blocks (models.apply_ac)", function()
  it("Transformer: full, every 2nd block and none train alike over 3 AdamW steps (bitwise)", function()
    same_training(function() return tiny_gpt(0) end, { "full", 2 })
  end)

  it("with dropout: the recompute draws the same masks (bitwise)", function()
    same_training(function() return tiny_gpt(0.3) end, { "full", 3 })
  end)

  it("Llama: full AC trains as without (bitwise)", function()
    same_training(tiny_llama, { "full" })
  end)

  it("marks the blocks: full all, N every Nth (layers N-1, 2N-1, ...), none removes them", function()
    local m = tiny_gpt(0)
    local function marked()
      local r = {}
      for i, b in ipairs(m.layers:children()) do if tostring(b):match("^TransformerBlock%( %[checkpointed%]") then
        r[#r + 1] = i - 1 end end
      return table.concat(r, ",")
    end
    assert.are.equal(4, models.apply_ac(m, "full"))
    assert.are.equal("0,1,2,3", marked())
    assert.are.equal(2, m:apply_ac(2))   -- (Transformer.apply_ac) the previous marks go first
    assert.are.equal("1,3", marked())
    assert.are.equal(1, nn.Transformer.apply_ac(m, 3))
    assert.are.equal("2", marked())
    assert.are.equal(0, models.apply_ac(m, "none"))
    assert.are.equal("", marked())
    assert.is_nil(tostring(m):find("checkpointed", 1, true))
    errors.err(function() models.apply_ac(m, "selective") end, "apply_ac: mode must be \"none\", \"full\" or an integer N >= 1")
    errors.err(function() models.apply_ac(m, 0) end, "mode must be")
    errors.err(function() models.apply_ac(nn.Linear(2, 2), "full") end, "apply_ac: expected a model with its blocks in model.layers")
  end)
end)

describe("activation checkpointing keeps fewer activations", function()
  -- big enough that the activations dwarf the parameters: 4 blocks of [8, 64, 64]
  local function build()
    engine.manual_seed(1)
    return nn.Transformer{ n_layers = 4, dim = 64, n_heads = 4, vocab_size = 64, max_seq_len = 64, dropout_p = 0 }
  end
  local function batch()
    engine.manual_seed(2)
    local ids = (engine.rand(8, 65) * 63.99):to("i64")
    return ids:narrow(2, 1, 64), ids:narrow(2, 2, 64)
  end
  -- bytes held after the forward (the graph's saved tensors: the model's, the batch's and the gradients'
  -- bytes taken off), and the peak of forward + backward, with Lua's collector run at every MiB of tensors (so
  -- the peak counts what is referenced, not the garbage the collector has not reached yet)
  local function measure(mode)
    local m = build()
    models.apply_ac(m, mode)
    local x, y = batch()
    F.cross_entropy(m(x), y):backward()     -- the gradients exist: their bytes are in the base below
    collectgarbage(); collectgarbage()
    local prev = engine.set_gc_threshold{ ratio = 1, min_bytes = MiB, max_fraction = 0 }   -- (0: no pacing)
    local base = engine.memory_stats().allocated
    local loss = F.cross_entropy(m(x), y)
    collectgarbage(); collectgarbage()
    local saved = engine.memory_stats().allocated - base
    loss = nil
    collectgarbage(); collectgarbage()
    engine.reset_peak_memory()
    base = engine.memory_stats().allocated
    F.cross_entropy(m(x), y):backward()
    local peak = engine.memory_stats().peak_allocated - base
    engine.set_gc_threshold(prev)
    collectgarbage(); collectgarbage()
    return saved, peak
  end

  it("full AC: the forward keeps a fraction of the activations, and forward + backward peaks lower", function()
    local s_none, p_none = measure("none")
    local s_two, p_two = measure(2)
    local s_full, p_full = measure("full")
    local msg = string.format("saved after forward: none %.2f MiB, every 2nd %.2f MiB, full %.2f MiB; peak of "
      .. "forward + backward: none %.2f MiB, every 2nd %.2f MiB, full %.2f MiB", s_none / MiB, s_two / MiB,
      s_full / MiB, p_none / MiB, p_two / MiB, p_full / MiB)
    assert.is_true(s_none > 4 * MiB, msg)
    -- full AC keeps each block's input (and the root's own activations): under a fifth
    assert.is_true(s_full < 0.2 * s_none, msg)
    assert.is_true(s_two < 0.75 * s_none and s_two > s_full, msg)
    -- the peak: one block's activations are recomputed at a time
    assert.is_true(p_full < 0.75 * p_none, msg)
    assert.is_true(p_two < p_none, msg)
  end)
end)

describe("nn.apply_activation_checkpointing", function()
  local Block = nn.Module:extend("ACBlock")
  function Block:__init(d) self.lin = nn.Linear(d, d); self.drop = nn.Dropout(0.5) end
  function Block:forward(x) return self.drop(self.lin(x):tanh()) + x end
  local Net = nn.Module:extend("ACNet")
  function Net:__init(d, n)
    local list = {}
    for i = 1, n do list[i] = Block(d) end
    self.blocks = nn.ModuleList(list)
    self.head = nn.Linear(d, 1)
  end
  function Net:forward(x)
    for _, b in ipairs(self.blocks) do x = b(x) end
    return self.head(x)
  end
  local function net() engine.manual_seed(9); return Net(6, 4) end
  local function is_block(m) return m:is_a(Block) end

  it("marks in place: parameter and state-dict names unchanged; returns the count", function()
    local m = net()
    local keys = table.concat(m:state_dict_keys(), ",")
    local pnames = {}
    for name in m:named_parameters() do pnames[#pnames + 1] = name end
    assert.are.equal(4, nn.apply_activation_checkpointing(m, { check_fn = is_block }))
    assert.are.equal(keys, table.concat(m:state_dict_keys(), ","))
    local after = {}
    for name in m:named_parameters() do after[#after + 1] = name end
    assert.are.same(pnames, after)
    local sd = m:state_dict()
    assert.is_not_nil(sd["blocks.0.lin.weight"])
    m:load_state_dict(sd)
    assert.is_truthy(m.blocks[1]:is_a(Block), "no wrapper module")
    assert.is_truthy(tostring(m):find("(0): ACBlock( [checkpointed]", 1, true), tostring(m))
  end)

  it("check_fn gets each module and its name; every = N takes the Nth, 2Nth, ... selected; modules = a list", function()
    local m = net()
    local seen = {}
    local n = nn.apply_activation_checkpointing(m, { check_fn = function(mod, name)
      seen[#seen + 1] = name
      return mod:is_a(Block)
    end, every = 2 })
    assert.are.equal(2, n)
    assert.are.equal("", seen[1])
    assert.are.equal("blocks.0", seen[3])
    local function marks()
      local r = {}
      for i, b in ipairs(m.blocks:children()) do r[i] = tostring(b):find("[checkpointed]", 1, true) and 1 or 0 end
      return table.concat(r)
    end
    assert.are.equal("0101", marks())
    -- enabled = false removes the marks of the selected modules (of all modules without a selection)
    assert.are.equal(1, nn.apply_activation_checkpointing(m, { modules = { m.blocks[2], m.blocks[3] }, enabled = false }))
    assert.are.equal("0001", marks())
    assert.are.equal(3, nn.apply_activation_checkpointing(m, { modules = { m.blocks[1], m.blocks[3], m.blocks[4] } }))
    assert.are.equal("1011", marks())
    assert.are.equal(3, nn.apply_activation_checkpointing(m, { enabled = false }))
    assert.are.equal("0000", marks())
  end)

  it("a marked module's call is nn.checkpoint(module, ...): its hooks run in the forward and the recompute", function()
    local m = net()
    local calls = 0
    m.blocks[2]:register_forward_hook(function() calls = calls + 1 end)
    nn.apply_activation_checkpointing(m, { check_fn = is_block })
    local x = engine.randn(5, 6)
    local out = m(x)
    assert.are.equal(1, calls)
    out:sum():backward()
    assert.are.equal(2, calls, "the backward recomputes the block (its hooks once more)")
    -- nn.checkpoint of a marked module checkpoints it once (the inner call runs the module itself)
    calls = 0
    local y = nn.checkpoint(m.blocks[2], x:clone():requires_grad_())
    y:sum():backward()
    assert.are.equal(2, calls)
    -- under no_grad the module just runs (no node, no recompute)
    calls = 0
    local z = engine.no_grad(function() return m(x) end)
    assert.is_nil(z.grad_fn)
    assert.are.equal(1, calls)
  end)

  it("with dropout, nested marks and a marked root: the gradients of the unmarked model, bitwise", function()
    local function grads(mark)
      local m = net()
      if mark then mark(m) end
      engine.manual_seed(77)
      local x = engine.randn(5, 6):requires_grad_()
      local out = m(x)
      out:sum():backward()
      local g = { x = x.grad:clone(), out = out:detach():clone() }
      for name, p in m:named_parameters() do g[name] = p.grad:clone() end
      return g
    end
    local want = grads()
    for what, mark in pairs({
      blocks = function(m) nn.apply_activation_checkpointing(m, { check_fn = is_block }) end,
      nested = function(m)
        nn.apply_activation_checkpointing(m, { check_fn = function(mod) return mod:is_a(Block) or mod:is_a(nn.Linear) end })
      end,
      root = function(m) nn.apply_activation_checkpointing(m, { modules = { m } }) end,
    }) do
      local got = grads(mark)
      for k, v in pairs(want) do assert.are.equal(0, maxdiff(got[k], v), what .. ": " .. k) end
    end
  end)

  it("eval and generation run the marked model under no_grad", function()
    engine.manual_seed(4)
    local m = tiny_gpt(0)
    local ids = engine.tensor({ { 1, 2, 3, 4 } })
    local want = engine.no_grad(function() return m(ids) end)
    local gen = m:generate({ 1, 2, 3 }, { max_new_tokens = 4, temperature = 0 })
    models.apply_ac(m, "full")
    local got = engine.no_grad(function() return m(ids) end)
    assert.is_nil(got.grad_fn)
    assert.are.equal(0, maxdiff(got, want))
    assert.are.same(gen, m:generate({ 1, 2, 3 }, { max_new_tokens = 4, temperature = 0 }))
  end)

  it("checks its options: unknown keys named, types, a selection required", function()
    local m = net()
    errors.err(function() nn.apply_activation_checkpointing(m, { check_fn = is_block, evry = 2 }) end,
      "apply_activation_checkpointing: unknown option 'evry' (known: check_fn, enabled, every, modules)")
    errors.err(function() nn.apply_activation_checkpointing(m, {}) end, "give check_fn")
    errors.err(function() nn.apply_activation_checkpointing(m) end, "apply_activation_checkpointing: expected options")
    errors.err(function() nn.apply_activation_checkpointing(m, { check_fn = is_block, every = 0 }) end,
      "every must be an integer >= 1, got 0")
    errors.err(function() nn.apply_activation_checkpointing(m, { check_fn = is_block, every = 1.5 }) end,
      "every must be an integer >= 1")
    errors.err(function() nn.apply_activation_checkpointing(m, { check_fn = true }) end, "check_fn must be a function")
    errors.err(function() nn.apply_activation_checkpointing(m, { check_fn = is_block, enabled = "no" }) end,
      "enabled must be a boolean")
    errors.err(function() nn.apply_activation_checkpointing(m, { check_fn = is_block, modules = { m.head } }) end,
      "give check_fn or modules, not both")
    errors.err(function() nn.apply_activation_checkpointing(m, { modules = m.head }) end,
      "modules must be a list of modules, got a Module")
    errors.err(function() nn.apply_activation_checkpointing(m, { modules = { nn.Linear(2, 2) } }) end,
      "modules[1] (Linear) is not a submodule of the model")
    errors.err(function() nn.apply_activation_checkpointing(m, { modules = { 5 } }) end, "modules[1] is a number")
    errors.err(function() nn.apply_activation_checkpointing({}, { check_fn = is_block }) end, "expected a Module")
    assert.is_nil(tostring(m):find("checkpointed", 1, true), "a failed call marks nothing")
  end)
end)
