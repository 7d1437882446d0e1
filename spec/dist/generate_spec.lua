-- model:generate under tensor parallelism: Transformer.parallelize (heads as DTensors or local heads) and
-- Llama.parallelize (grouped-query heads, vocab-sharded logits with loss_parallel) on a 1-D mesh of every
-- rank (1, 2 or 4 ranks); each rank caches its local heads, and every rank gives the single-process tokens and
-- logits.
local engine = require("engine")
local nn = engine.nn
local dist = engine.distributed
local models = require("engine.models")

local W = dist.world_size()
local mesh = dist.init_device_mesh("cpu", { W }, { "tp" })
local V = 40
local PROMPT = { { 3, 14, 15, 9, 2 }, { 7, 1, 30, 22, 5 } }

local function sharpen(m)
  engine.no_grad(function()
    for _, p in ipairs(m:parameters()) do if p:dim() >= 2 then p:normal_(0, 0.3) end end
  end)
  return m
end

local function gpt()
  engine.manual_seed(11)
  return sharpen(models.Transformer{ n_layers = 2, dim = 32, n_heads = 4, vocab_size = V, max_seq_len = 24,
    dropout_p = 0 })
end

local function llama()
  engine.manual_seed(12)
  return sharpen(models.Llama{ dim = 64, n_layers = 2, n_heads = 8, n_kv_heads = 4, vocab_size = V,
    max_seq_len = 24, multiple_of = 16 })
end

-- every rank's rows equal rank 0's
local function agreed(rows)
  local flat = {}
  for _, r in ipairs(rows) do for _, v in ipairs(r) do flat[#flat + 1] = v end end
  local t = engine.tensor(flat, { dtype = "f64" })
  local mx, mn = t:clone(), t:clone()
  dist.all_reduce(mx, "max")
  dist.all_reduce(mn, "min")
  return (mx - mn):abs():max():item() == 0
end

local cases = {
  { "Transformer (DTensor heads)", gpt, function(m) models.Transformer.parallelize(m, mesh) end },
  { "Transformer (local heads)", gpt,
    function(m) models.Transformer.parallelize(m, mesh, { local_output_for_attn = true }) end },
  { "Llama", llama, function(m) models.Llama.parallelize(m, mesh) end },
  { "Llama (loss_parallel logits)", llama, function(m) models.Llama.parallelize(m, mesh, { loss_parallel = true }) end },
}

describe("generate under tensor parallelism", function()
  for _, case in ipairs(cases) do
    local name, make, parallelize = case[1], case[2], case[3]
    it(name .. ": the single-process tokens on every rank, greedy and seeded, past max_seq_len", function()
      local ref = make()
      local m = make()
      parallelize(m)
      assert.is_true(dist.is_dtensor(m.layers[1].attention.wq.weight))
      local greedy = { max_new_tokens = 30, temperature = 0 }
      local want = ref:generate(PROMPT, greedy)
      local got = m:generate(PROMPT, greedy)
      assert.are.same(want, got)
      assert.is_true(agreed(got))
      local sampled = { max_new_tokens = 12, temperature = 1.2, top_k = 15, top_p = 0.9, seed = 5 }
      local ws, gs = ref:generate(PROMPT, sampled), m:generate(PROMPT, sampled)
      assert.are.same(ws, gs)
      assert.is_true(agreed(gs))
      sampled.kv_cache = false
      assert.are.same(ws, m:generate(PROMPT, sampled))
    end)

    it(name .. ": cached logits equal the single-process full forward (1e-5); each rank caches its local heads",
      function()
        local ref = make()
        local m = make()
        parallelize(m)
        m:eval(); ref:eval()
        engine.no_grad(function()
          local x = engine.tensor(PROMPT)
          local full = ref(x)
          local layers = {}
          for i = 1, #m.layers do layers[i] = { pos = 0, max_len = 5 } end
          local cache = { pos = 0, max_len = 5, layers = layers }
          local got = { m:forward_cached(x:narrow(2, 1, 2), cache) }
          for t = 3, 5 do got[#got + 1] = m:forward_cached(x:narrow(2, t, 1), cache) end
          local all = engine.cat(got, 2)
          local d = (all - full):abs():max():item()
          assert.is_true(d <= 1e-5, "logits differ by " .. d)
          local heads = 4 / W   -- the local k/v heads (GPT: 4 heads; Llama: 4 k/v heads of 8)
          assert.are.same({ 2, heads, 5, 8 }, layers[1].k:shape())
          assert.is_false(dist.is_dtensor(layers[1].k))
        end)
      end)
  end

  -- sequence parallelism shards the positions: generate recomputes the (padded) context per token
  for _, case in ipairs({
    { "Transformer", gpt, function(m) models.Transformer.parallelize(m, mesh, { use_seq_parallel = true }) end },
    { "Llama", llama, function(m) models.Llama.parallelize(m, mesh, { use_seq_parallel = true }) end },
  }) do
    it(case[1] .. " with sequence parallelism: the single-process tokens (recomputed, padded context)", function()
      local ref, m = case[2](), case[2]()
      case[3](m)
      local o = { max_new_tokens = 28, temperature = 0 }
      local got = m:generate(PROMPT, o)
      assert.are.same(ref:generate(PROMPT, o), got)
      assert.is_true(agreed(got))
      local ok, e = pcall(m.generate, m, PROMPT, { max_new_tokens = 2, kv_cache = true })
      assert.is_false(ok)
      assert.matches("parallelize without use_seq_parallel", tostring(e), 1, true)
    end)
  end

  it("FSDP (fully_shard per block and root): the single-process tokens through the cache", function()
    for _, make in ipairs({ gpt, llama }) do
      local ref, m = make(), make()
      for _, block in ipairs(m.layers:children()) do dist.fully_shard(block, { mesh = mesh }) end
      dist.fully_shard(m, { mesh = mesh })
      local o = { max_new_tokens = 30, temperature = 0.9, top_k = 10, seed = 2 }
      local got = m:generate(PROMPT, o)
      assert.are.same(ref:generate(PROMPT, o), got)
      assert.is_true(agreed(got))
    end
  end)

  it("DTensor data parallelism (Replicate parameters): each rank generates alone", function()
    local ref, m = gpt(), gpt()
    dist.replicate_parameters(m, mesh)
    assert.is_true(dist.is_dtensor(m.output.weight))
    local o = { max_new_tokens = 10, temperature = 0 }
    local want = ref:generate(PROMPT, o)
    -- rank 0 alone: no collective (a broadcast here would hang)
    if dist.rank() == 0 then assert.are.same(want, m:generate(PROMPT, o)) end
    dist.barrier()
  end)
end)
