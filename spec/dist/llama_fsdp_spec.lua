-- The Llama model under FSDP (dist.fully_shard on each block, then the root; PyTorch's FSDP2 as torchtitan
-- applies it): each rank feeds its rows of the global batch, and the losses, gradients (full tensors) and
-- parameters over 3 AdamW steps equal one process on the whole batch, at 1, 2 and 4 ranks.
local engine = require("engine")
local nn = engine.nn
local F = nn.functional
local dist = engine.distributed
local models = require("engine.models")
local util = require("spec.dist.helpers.util")

local W, R = dist.world_size(), dist.rank()
local mesh = dist.init_device_mesh("cpu", { W }, { "dp" })

local function full(t)
  if dist.is_dtensor(t) then return t:full_tensor() end
  return t
end

local V, T = 32, 8
local ARGS = { dim = 32, n_layers = 2, n_heads = 4, n_kv_heads = 2, vocab_size = V, max_seq_len = T, multiple_of = 16 }

local function tokens(b, seed)
  engine.manual_seed(seed)
  return (engine.rand(b, T) * V):to("i64")
end

describe("Llama under FSDP", function()
  it("fully_shard per block + root: one process's losses, gradients and parameters over 3 AdamW steps", function()
    engine.manual_seed(9); local ref = models.Llama(ARGS)
    engine.manual_seed(9); local m = models.Llama(ARGS)
    for _, block in ipairs(m.layers:children()) do dist.fully_shard(block, { mesh = mesh }) end
    dist.fully_shard(m, { mesh = mesh })
    assert.is_true(dist.is_dtensor(m.layers[1].attention.wk.weight))
    local opt_r = engine.optim.AdamW(ref:parameters(), { lr = 1e-2, weight_decay = 0.1 })
    local opt_m = engine.optim.AdamW(m:parameters(), { lr = 1e-2, weight_decay = 0.1 })
    for step = 1, 3 do
      local x, y = tokens(2 * W, 600 + step), tokens(2 * W, 700 + step)
      local xl, yl = x:narrow(1, 1 + 2 * R, 2):contiguous(), y:narrow(1, 1 + 2 * R, 2):contiguous()
      local lm = F.cross_entropy(m(xl):reshape(-1, V), yl:reshape(-1)); lm:backward()
      local mean = engine.tensor({ lm:item() }, "f64")
      dist.all_reduce(mean, "avg")
      local lr = F.cross_entropy(ref(x):reshape(-1, V), y:reshape(-1)); lr:backward()
      assert.is_true(math.abs(mean:item() - lr:item()) <= 1e-5, string.format("step %d: loss %.9g vs %.9g", step,
        mean:item(), lr:item()))
      for name, p in m:named_parameters() do
        local d = util.diff(full(p.grad), ref:get_parameter(name).grad)
        assert.is_true(d <= 1e-5, string.format("step %d: grad of %s differs by %g", step, name, d))
      end
      opt_m:step(); opt_m:zero_grad(); opt_r:step(); opt_r:zero_grad()
    end
    for name, p in m:named_parameters() do
      local d = util.diff(full(p), ref:get_parameter(name))
      assert.is_true(d <= 1e-4, "parameter " .. name .. " differs by " .. d)   -- (Adam: see llama_tp_spec)
    end
  end)
end)
