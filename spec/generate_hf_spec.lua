-- model:generate against transformers (spec/fixtures/generate/hf.lua, made by tools/gen_generate_fixtures.py
-- offline): the greedy tokens of the tiny GPT-2 and Llama of spec/fixtures/hf (loaded with engine.hf) equal
-- transformers' model.generate(do_sample = False) with its KV cache, and the sampler keeps the tokens that
-- Hugging Face's temperature -> top-k -> top-p warpers keep.
local engine = require("engine")
local hf = require("engine.hf")
local generation = require("engine.generation")

local FIX = dofile("spec/fixtures/generate/hf.lua")

describe("generate against transformers", function()
  for _, name in ipairs({ "gpt2-tiny", "llama-tiny" }) do
    it(name .. ": the greedy tokens of transformers' generate (batch of 2, with and without the cache)", function()
      local want = FIX.greedy[name]
      assert.is_true(want.gap > 1e-3, "the fixture's logits have a near tie")
      local model = hf.load("spec/fixtures/hf/" .. name)
      local o = { max_new_tokens = FIX.new_tokens, temperature = 0 }
      assert.are.same(want.sequences, model:generate(FIX.prompts, o))
      o.kv_cache = false
      assert.are.same(want.sequences, model:generate(FIX.prompts, o))
      -- one row alone, as a tensor
      local t = model:generate(engine.tensor(FIX.prompts[2]), { max_new_tokens = FIX.new_tokens, temperature = 0 })
      assert.are.same(want.sequences[2], t:totable())
    end)
  end

  it("keeps the tokens Hugging Face's TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper keep", function()
    local logits = engine.tensor(FIX.logits)
    assert.is_true(#FIX.filters >= 5)
    for i, c in ipairs(FIX.filters) do
      local got = generation.kept(logits, { temperature = c.temperature, top_k = c.top_k, top_p = c.top_p })
      for b, want in ipairs(c.kept) do
        if want then assert.are.same(want, got[b], "case " .. i .. " row " .. b) end
      end
    end
    -- and the draws stay among them
    local c = FIX.filters[3]
    for s = 1, 20 do
      local ids = generation.sample(logits, { temperature = c.temperature, top_k = c.top_k, top_p = c.top_p, seed = s })
      for b, id in ipairs(ids) do
        local ok = false
        for _, k in ipairs(c.kept[b] or { id }) do ok = ok or k == id end
        assert.is_true(ok, "row " .. b .. " drew " .. id)
      end
    end
  end)
end)
