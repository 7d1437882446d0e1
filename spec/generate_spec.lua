-- model:generate (engine.generation): KV-cached sampling for nn.Transformer and nn.Llama.  The cache is
-- checked against the full forward (the logits of every position, and the greedy tokens with and without
-- the cache, past max_seq_len too); the sampler's options (temperature, top_k, top_p, seed, generator, eos,
-- stream) and errors.
local engine = require("engine")
local nn = engine.nn
local generation = require("engine.generation")

local V = 40

-- random models whose greedy tokens vary (the default init gives near-uniform logits and one repeated token)
local function sharpen(m, std)
  engine.no_grad(function()
    for _, p in ipairs(m:parameters()) do
      if p:dim() >= 2 then p:normal_(0, std) end
    end
  end)
  return m
end

local function gpt(extra)
  engine.manual_seed(11)
  local args = { n_layers = 2, dim = 32, n_heads = 4, vocab_size = V, max_seq_len = 24, dropout_p = 0 }
  for k, v in pairs(extra or {}) do args[k] = v end
  return sharpen(nn.Transformer(args), 0.3)
end

local function llama(extra)
  engine.manual_seed(12)
  local args = { dim = 32, n_layers = 2, n_heads = 4, n_kv_heads = 2, vocab_size = V, max_seq_len = 24,
    multiple_of = 16 }
  for k, v in pairs(extra or {}) do args[k] = v end
  return sharpen(nn.Llama(args), 0.3)
end

local function maxdiff(a, b)
  return (a - b):abs():max():item()
end

local function distinct(list, from)
  local seen, n = {}, 0
  for i = from or 1, #list do
    if not seen[list[i]] then seen[list[i]] = true; n = n + 1 end
  end
  return n
end

local PROMPT = { 3, 14, 15, 9, 2 }

-- model m (eval) on random tokens [2, 20]: the full forward's logits, and a KV cache (layers' dtype cache_dtype)
-- with the tokens and the cached logits of a prefill of 6, a chunk of 4 after it (the masked path), then one token
-- at a time.  Under no_grad.
local function cached_run(m, cache_dtype)
  local B, T = 2, 20
  engine.manual_seed(5)
  local x = (engine.rand(B, T) * V):to("i64")
  local full = m(x)                                  -- [B, T, V]
  local layers = {}
  for i = 1, #m.layers do layers[i] = { pos = 0, max_len = T, dtype = cache_dtype } end
  local cache = { pos = 0, max_len = T, layers = layers }
  local got = { m:forward_cached(x:narrow(2, 1, 6), cache), m:forward_cached(x:narrow(2, 7, 4), cache) }
  assert.are.equal(10, cache.pos)
  for t = 11, T do got[#got + 1] = m:forward_cached(x:narrow(2, t, 1), cache) end
  assert.are.equal(T, cache.pos)
  return full, engine.cat(got, 2), cache, x
end

describe("generate", function()
  for _, case in ipairs({ { "GPT", gpt }, { "Llama (grouped-query)", llama } }) do
    local name, make = case[1], case[2]

    describe(name, function()
      it("greedy gives the same tokens with and without the KV cache", function()
        local m = make()
        local a = m:generate(PROMPT, { max_new_tokens = 12, temperature = 0 })
        local b = m:generate(PROMPT, { max_new_tokens = 12, temperature = 0, kv_cache = false })
        assert.are.same(b, a)
        assert.are.equal(#PROMPT + 12, #a)
        for i = 1, #PROMPT do assert.are.equal(PROMPT[i], a[i]) end
        assert.is_true(distinct(a, #PROMPT + 1) >= 3, "the greedy tokens vary: " .. table.concat(a, " "))
      end)

      it("greedy on a prompt batch (B = 2) equals each row alone, with and without the cache", function()
        local m = make()
        local other = { 7, 1, 30, 22, 5 }
        local x = engine.tensor({ PROMPT, other })
        local a = m:generate(x, { max_new_tokens = 10, temperature = 0 })
        local b = m:generate(x, { max_new_tokens = 10, temperature = 0, kv_cache = false })
        assert.are.same({ 2, #PROMPT + 10 }, a:shape())
        assert.are.equal("i64", a.dtype)
        assert.are.same(b:totable(), a:totable())
        local rows = a:totable()
        assert.are.same(m:generate(PROMPT, { max_new_tokens = 10, temperature = 0 }), rows[1])
        assert.are.same(m:generate(other, { max_new_tokens = 10, temperature = 0 }), rows[2])
        assert.are_not.same(rows[1], rows[2])
      end)

      it("runs past max_seq_len (the window slides) with the tokens of the uncached path", function()
        local m = make()
        local a = m:generate(PROMPT, { max_new_tokens = 40, temperature = 0 })
        local b = m:generate(PROMPT, { max_new_tokens = 40, temperature = 0, kv_cache = false })
        assert.are.equal(#PROMPT + 40, #a)
        assert.are.same(b, a)
        -- a prompt longer than max_seq_len: the model sees its last max_seq_len tokens
        local long = {}
        for i = 1, 30 do long[i] = (i * 7) % V end
        local c = m:generate(long, { max_new_tokens = 3, temperature = 0 })
        local d = m:generate(long, { max_new_tokens = 3, temperature = 0, kv_cache = false })
        assert.are.same(d, c)
        assert.are.equal(33, #c)
      end)

      it("a bf16 cache (cache_dtype = \"bf16\"): bf16 keys and values, logits within their rounding", function()
        local m = make()
        m:eval()
        engine.no_grad(function()
          local full, all, cache = cached_run(m, "bf16") -- the chunk's masked path reads the cache widened
          for i = 1, #m.layers do
            assert.are.equal("bf16", cache.layers[i].k.dtype)
            assert.are.equal("bf16", cache.layers[i].v.dtype)
          end
          local d, scale = maxdiff(all, full), full:abs():max():item()
          assert.is_true(d > 0, "the same logits as f32: the bf16 cache was not read")
          assert.is_true(d <= 0.02 * scale, "bf16-cached logits differ from the full forward by " .. d)
        end)
        local a = m:generate(PROMPT, { max_new_tokens = 6, temperature = 0, cache_dtype = "bf16" })
        assert.are.equal(#PROMPT + 6, #a)
        assert.matches('cache_dtype must be nil %(the model\'s%), "bf16"',
          select(2, pcall(m.generate, m, PROMPT, { max_new_tokens = 2, cache_dtype = "i8" })))
      end)

      it("cached logits equal the full forward's at every position (1e-5)", function()
        local m = make()
        m:eval()
        engine.no_grad(function()
          local full, all, cache, x = cached_run(m, nil)
          local B, T = 2, 20
          assert.are.same({ B, T, V }, all:shape())
          local d = maxdiff(all, full)
          assert.is_true(d <= 1e-5, "cached logits differ from the full forward by " .. d)
          -- last_only: the prefill's last position
          cache.pos = 0
          local last = m:forward_cached(x:narrow(2, 1, 8), cache, true)
          assert.are.same({ B, 1, V }, last:shape())
          assert.is_true(maxdiff(last, full:narrow(2, 8, 1)) <= 1e-5)
        end)
      end)

      it("top_k = 1 equals greedy; a seed makes temperature / top_k / top_p sampling reproducible", function()
        local m = make()
        local greedy = m:generate(PROMPT, { max_new_tokens = 10, temperature = 0 })
        assert.are.same(greedy, m:generate(PROMPT, { max_new_tokens = 10, temperature = 0.7, top_k = 1, seed = 4 }))
        local o = { max_new_tokens = 16, temperature = 1.3, top_k = 20, top_p = 0.9, seed = 9 }
        local a, b = m:generate(PROMPT, o), m:generate(PROMPT, o)
        assert.are.same(a, b)
        o.kv_cache = false
        assert.are.same(a, m:generate(PROMPT, o))
        local c = m:generate(PROMPT, { max_new_tokens = 16, temperature = 1.3, top_k = 20, top_p = 0.9, seed = 10 })
        assert.are_not.same(a, c)
        -- a generator: the same draws as the seed, and it advances
        local g = engine.Generator():manual_seed(9)
        assert.are.same(a, m:generate(PROMPT, { max_new_tokens = 16, temperature = 1.3, top_k = 20, top_p = 0.9,
          generator = g }))
        assert.is_true(g:get_offset() > 0)
        -- no seed: the global generator
        engine.manual_seed(9)
        local d = m:generate(PROMPT, { max_new_tokens = 16, temperature = 1.3, top_k = 20, top_p = 0.9 })
        assert.are.same(a, d)
      end)

      it("stops at eos (kept), pads finished rows with it, streams each new token", function()
        local m = make()
        local greedy = m:generate(PROMPT, { max_new_tokens = 10, temperature = 0 })
        local eos = greedy[#PROMPT + 3]
        local first = #PROMPT + 3
        for i = #PROMPT + 1, #PROMPT + 3 do if greedy[i] == eos then first = i; break end end
        local seen = {}
        local r = m:generate(PROMPT, { max_new_tokens = 10, temperature = 0, eos = eos,
          stream = function(id, row) seen[#seen + 1] = id; assert.are.equal(1, row) end })
        assert.are.equal(first, #r)
        assert.are.equal(eos, r[#r])
        assert.are.same({ unpack(greedy, #PROMPT + 1, first) }, seen)
        -- a batch: the row that meets eos first is padded with it until the other stops or the budget ends
        local rows = m:generate({ PROMPT, { 7, 1, 30, 22, 5 } }, { max_new_tokens = 10, temperature = 0, eos = { eos } })
        assert.are.same(greedy, (function()
          local x = {}
          for i = 1, first do x[i] = rows[1][i] end
          for i = first + 1, #rows[1] do assert.are.equal(eos, rows[1][i]) end
          for i = first + 1, #greedy do x[i] = greedy[i] end
          return x
        end)())
        assert.are.equal(#rows[1], #rows[2])
      end)

      it("restores each module's training flag and leaves autograd on", function()
        local m = make()
        m:train()
        m.layers[1]:eval()
        m:generate(PROMPT, { max_new_tokens = 2 })
        assert.is_true(m.training)
        assert.is_false(m.layers[1].training)
        assert.is_true(m.layers[2].training)
        assert.is_true(engine.is_grad_enabled())
      end)
    end)
  end

  it("the cached path uses attention biases (attn_bias, fused or three GEMMs)", function()
    for _, fuse in ipairs({ true, false }) do
      local m = gpt({ attn_bias = true })
      engine.manual_seed(3)
      for _, layer in ipairs(m.layers) do
        local at = layer.attention
        at.fuse_qkv = fuse
        engine.no_grad(function()
          for _, k in ipairs({ "wq", "wk", "wv", "wo" }) do at[k].bias:normal_(0, 0.5) end
        end)
      end
      m:eval()
      engine.no_grad(function()
        local x = engine.tensor({ { 1, 5, 9, 2, 33, 4, 7, 8 } })
        local full = m(x)
        local layers = {}
        for i = 1, #m.layers do layers[i] = { pos = 0, max_len = 8 } end
        local cache = { pos = 0, max_len = 8, layers = layers }
        local got = { m:forward_cached(x:narrow(2, 1, 3), cache) }
        for t = 4, 8 do got[#got + 1] = m:forward_cached(x:narrow(2, t, 1), cache) end
        local d = maxdiff(engine.cat(got, 2), full)
        assert.is_true(d <= 1e-5, "biased cached logits differ by " .. d)
        -- the biases matter: without v's the logits move (k's adds one constant to every score of a query)
        for _, layer in ipairs(m.layers) do engine.no_grad(function() layer.attention.wv.bias:zero_() end) end
        assert.is_true(maxdiff(m(x), full) > 1e-3)
      end)
      local a = m:generate(PROMPT, { max_new_tokens = 8, temperature = 0 })
      assert.are.same(m:generate(PROMPT, { max_new_tokens = 8, temperature = 0, kv_cache = false }), a)
    end
  end)

  it("gives back the form it was given", function()
    local m = llama()
    local t1 = m:generate(engine.tensor(PROMPT), { max_new_tokens = 3, temperature = 0 })
    assert.are.same({ #PROMPT + 3 }, t1:shape())
    assert.are.equal("i64", t1.dtype)
    local l = m:generate(PROMPT, { max_new_tokens = 3, temperature = 0 })
    assert.are.same(l, t1:totable())
    local b = m:generate({ PROMPT, PROMPT }, { max_new_tokens = 3, temperature = 0 })
    assert.are.same({ l, l }, b)
    assert.are.same({ 3, 14, 15, 9, 2 }, PROMPT)   -- the given list is not changed
    assert.are.same(PROMPT, m:generate(PROMPT, { max_new_tokens = 0 }))
  end)

  describe("the sampler (generation.sample)", function()
    -- probabilities 0.5, 0.3, 0.15, 0.05 for tokens 0..3 (logits their logs)
    local logits = engine.tensor({ math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05) })
    local function counts(opts, n)
      local c = { [0] = 0, 0, 0, 0 }
      for s = 1, n do
        local o = { seed = s }
        for k, v in pairs(opts) do o[k] = v end
        local id = generation.sample(logits, o)
        c[id] = c[id] + 1
      end
      return c
    end

    it("greedy at temperature 0; top_k keeps the k largest; top_p is Hugging Face's nucleus", function()
      assert.are.equal(0, generation.sample(logits, { temperature = 0 }))
      local c = counts({}, 400)
      for i = 0, 3 do assert.is_true(c[i] > 0, "token " .. i .. " drawn at temperature 1") end
      assert.is_true(c[0] > c[1] and c[1] > c[2] and c[2] > c[3])
      c = counts({ top_k = 2 }, 200)
      assert.is_true(c[0] > 0 and c[1] > 0 and c[2] == 0 and c[3] == 0)
      -- top_p 0.7: 0.5 < 0.7 keeps token 1; 0.8 >= 0.7 cuts token 2 (HF: ascending cumsum 0.2 <= 0.3)
      c = counts({ top_p = 0.7 }, 200)
      assert.is_true(c[0] > 0 and c[1] > 0 and c[2] == 0 and c[3] == 0)
      c = counts({ top_p = 0.85 }, 300)
      assert.is_true(c[2] > 0 and c[3] == 0)
      -- top_p 0.45: only token 0; 0.55: the token that crosses top_p is kept (0.5 < 0.55 before token 1)
      c = counts({ top_p = 0.45 }, 50)
      assert.are.equal(50, c[0])
      c = counts({ top_p = 0.55 }, 100)
      assert.is_true(c[0] > 0 and c[1] > 0 and c[2] == 0 and c[3] == 0)
      -- a low temperature sharpens, a high one flattens
      local cold, hot = counts({ temperature = 0.2 }, 300), counts({ temperature = 5 }, 300)
      assert.is_true(cold[0] > hot[0] and cold[3] < hot[3])
    end)

    it("keeps the tokens tied with the k-th largest (as Hugging Face's TopKLogitsWarper)", function()
      local l = engine.tensor({ { 1, 1, 1, 0 } })
      local seen = {}
      for s = 1, 100 do seen[generation.sample(l, { top_k = 2, seed = s })[1]] = true end
      assert.is_true(seen[0] and seen[1] and seen[2] and not seen[3])
    end)

    it("draws each row of a batch", function()
      local l = engine.tensor({ { 0, 9, 0 }, { 9, 0, 0 } })
      assert.are.same({ 1, 0 }, generation.sample(l, { temperature = 0 }))
      assert.are.same({ 1, 0 }, generation.sample(l, { temperature = 0.01, seed = 1 }))
    end)
  end)

  describe("errors", function()
    local m = llama()
    local function err(opts, ids)
      local ok, e = pcall(m.generate, m, ids or PROMPT, opts)
      assert.is_false(ok)
      return tostring(e)
    end

    it("names an unknown option and the known ones", function()
      local e = err({ max_new_token = 3 })
      assert.matches("generate: unknown option 'max_new_token'", e, 1, true)
      assert.matches("max_new_tokens", e, 1, true)
      assert.matches("generate", err({ topk = 3 }), 1, true)
    end)

    it("checks each option's value", function()
      assert.matches("temperature must be", err({ temperature = -1 }), 1, true)
      assert.matches("top_k must be a positive integer", err({ top_k = 0 }), 1, true)
      assert.matches("top_k must be a positive integer", err({ top_k = 2.5 }), 1, true)
      assert.matches("top_p must be a number in (0, 1]", err({ top_p = 0 }), 1, true)
      assert.matches("top_p must be a number in (0, 1]", err({ top_p = 1.5 }), 1, true)
      assert.matches("max_new_tokens must be", err({ max_new_tokens = -1 }), 1, true)
      assert.matches("either seed or generator", err({ seed = 1, generator = engine.Generator() }), 1, true)
      assert.matches("generator must be an engine.Generator", err({ generator = 3 }), 1, true)
      assert.matches("eos must be a token id", err({ eos = "x" }), 1, true)
      assert.matches("kv_cache must be a boolean", err({ kv_cache = 1 }), 1, true)
      assert.matches("stream must be a function", err({ stream = true }), 1, true)
      assert.matches("options must be a table", err(5), 1, true)
    end)

    it("checks the ids", function()
      assert.matches("the prompt is empty", err({}, {}), 1, true)
      assert.matches("must have one length", err({}, { { 1, 2 }, { 3 } }), 1, true)
      assert.matches("token id 40 (row 1, position 2) is not in [0, 40)", err({}, { 1, 40 }), 1, true)
      assert.matches("token id -1", err({}, { -1 }), 1, true)
      assert.matches("expected token ids [T] or [B, T]", err({}, engine.zeros(1, 2, 3):to("i64")), 1, true)
      assert.matches("expected an integer tensor", err({}, engine.zeros(3)), 1, true)
      assert.matches("expected token ids", err({}, "hello"), 1, true)
    end)

    it("points at the caller's line", function()
      local ok, e = pcall(function() m:generate(PROMPT, { bogus = 1 }) end)
      assert.is_false(ok)
      assert.matches("generate_spec.lua:%d+: generate: unknown option", tostring(e))
    end)

    it("the sampler refuses generate's loop options", function()
      local ok, e = pcall(generation.sample, engine.zeros(2, 3), { max_new_tokens = 3 })
      assert.is_false(ok)
      assert.matches("option 'max_new_tokens' is generate's", tostring(e), 1, true)
    end)
  end)
end)

describe("engine._decode_attention (decoding over a bf16 KV cache)", function()
  it("equals f64 attention over the same bf16 keys and values (1e-5); grouped rows, cache views", function()
    local F = nn.functional
    engine.manual_seed(21)
    for _, c in ipairs({ { 2, 3, 2, 37, 64, 48 }, { 1, 4, 1, 1, 16, 16 }, { 1, 2, 4, 130, 32, 64 } }) do
      local B, H, R, S, E, Ev = c[1], c[2], c[3], c[4], c[5], c[6]
      local q = engine.randn(B, H, R, E)
      local kc, vc = engine.randn(B, H, S + 5, E):to("bf16"), engine.randn(B, H, S + 5, Ev):to("bf16")
      local k, v = kc:narrow(3, 1, S), vc:narrow(3, 1, S) -- the cache's first S positions (rows S + 5 apart)
      local o = engine._decode_attention(q, k, v)
      assert.are.same({ B, H, R, Ev }, o:shape())
      local r = F.scaled_dot_product_attention(q:double(), k:double(), v:double(), nil, 0, false)
      -- f32 arithmetic against f64 on the same bf16 values: 7e-7 at most on the optimized build (the softmax of
      -- scores up to about 16 for scale 0.5 amplifies the rounding); 1e-5 leaves room for other compilers' rounding
      assert.is_true(maxdiff(o:double(), r) <= 1e-5, table.concat(c, "x") .. ": " .. maxdiff(o:double(), r))
      local o2 = engine._decode_attention(q, k, v, 0.5)
      local r2 = F.scaled_dot_product_attention(q:double(), k:double(), v:double(), nil, 0, false, 0.5)
      assert.is_true(maxdiff(o2:double(), r2) <= 1e-5, table.concat(c, "x") .. " scale 0.5: " .. maxdiff(o2:double(), r2))
    end
    local q, k = engine.randn(1, 2, 1, 16), engine.randn(1, 2, 5, 16)
    assert.matches("expected f32 q %[B, H, R, E%] and bf16 k",
      select(2, pcall(engine._decode_attention, q, k, k)))
    assert.matches("shapes do not match",
      select(2, pcall(engine._decode_attention, q, k:to("bf16"), engine.randn(1, 3, 5, 16):to("bf16"))))
    assert.matches("contiguous rows",
      select(2, pcall(engine._decode_attention, q, engine.randn(1, 2, 16, 5):to("bf16"):transpose(3, 4),
        k:to("bf16"))))
  end)
end)

describe("generate on the GPU #gpu", function()
  -- the cached path on CUDA (the cache buffers, their narrow + copy_ writes, one-row attention) gives the CPU's greedy
  -- tokens, and the logits of each cached step equal the CPU's within GPU rounding
  local function both(build)
    engine.manual_seed(11)
    local m = build()
    m:eval()
    local prompt = { 3, 17, 5, 9, 22, 1 }
    local cpu = m:generate(prompt, { max_new_tokens = 12, temperature = 0 })
    m:to("cuda")
    local gpu = m:generate(prompt, { max_new_tokens = 12, temperature = 0 })
    local gpu_nocache = m:generate(prompt, { max_new_tokens = 12, temperature = 0, kv_cache = false })
    return cpu, gpu, gpu_nocache
  end
  it("GPT and Llama: the CPU's greedy tokens, with and without the cache", function()
    if not engine.cuda.is_available() then pending("no GPU: " .. engine.cuda.unavailable_reason()) end
    local nn = engine.nn
    for _, build in ipairs({
      function() return nn.Transformer{ n_layers = 2, dim = 32, n_heads = 4, vocab_size = 40, max_seq_len = 32,
        dropout_p = 0, attn_bias = true } end,
      function() return nn.Llama{ dim = 32, n_layers = 2, n_heads = 4, n_kv_heads = 2, vocab_size = 40,
        max_seq_len = 32 } end }) do
      local cpu, gpu, nocache = both(build)
      assert.are.same(cpu, gpu)
      assert.are.same(cpu, nocache)
    end
  end)
end)
