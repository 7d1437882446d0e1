-- User generators (engine.Generator, PyTorch's torch.Generator): a (seed, offset) pair like the global
-- generator, taken by every random op as `generator =` (or PyTorch's positional generator argument).
-- A generator seeded with s draws what the global generator draws after manual_seed(s), advances by the
-- same counts, and leaves the global generator untouched.
local engine = require("engine")
local nn = engine.nn
local init = nn.init

local function same(a, b) return (a:double() - b:double()):abs():max():item() == 0 end
local function errmsg(fn, ...)
  local ok, e = pcall(fn, ...)
  assert(not ok, "expected an error")
  return tostring(e)
end

describe("engine.Generator", function()
  it("manual_seed returns the generator; state, offset, initial_seed, tostring", function()
    local g = engine.Generator()
    assert.are.equal(67280421310721, g:initial_seed())     -- PyTorch's default seed, as the global one
    assert.are.equal(g, g:manual_seed(42))
    assert.are.same({ seed = 42, offset = 0 }, g:get_state())
    engine.rand(5, { generator = g })
    assert.are.equal(8, g:get_offset())                      -- numel rounded up to 4
    assert.are.equal("Generator(device=cpu, seed=42, offset=8)", tostring(g))
    local s = g:get_state()
    local a = engine.randn(3, { generator = g })
    g:set_state(s)
    assert.is_true(same(a, engine.randn(3, { generator = g })))
    g:set_offset(0)
    assert.are.equal(0, g:get_offset())
    local big = engine.Generator():manual_seed(2 ^ 60)
    assert.are.equal("cdata", type(big:initial_seed()))
    assert.is_true(type(engine.Generator():seed()) == "number")
    assert.are.equal("cuda", engine.Generator("cuda").device)
    assert.matches("unknown device 'tpu'", errmsg(engine.Generator, "tpu"))
    assert.matches("seed must be a non%-negative integer", errmsg(function() g:manual_seed(-1) end))
  end)

  it("draws what the global generator draws after the same seed, and leaves it untouched", function()
    engine.manual_seed(7)
    local before = engine.get_rng_state()
    local g = engine.Generator():manual_seed(123)
    local a = engine.rand(4, 5, { generator = g })
    local b = engine.randn({ 6 }, { generator = g, dtype = "f64" })
    local t = engine.empty(3, 3)
    t:uniform_(-2, 2, g)
    local u = engine.empty(7)
    u:normal_(1, 3, { generator = g })
    assert.are.same(before, engine.get_rng_state())
    engine.manual_seed(123)
    assert.is_true(same(a, engine.rand(4, 5)))
    assert.is_true(same(b, engine.randn(6, { dtype = "f64" })))
    local t2 = engine.empty(3, 3); t2:uniform_(-2, 2)
    local u2 = engine.empty(7); u2:normal_(1, 3)
    assert.is_true(same(t, t2))
    assert.is_true(same(u, u2))
    assert.are.same(engine.get_rng_state(), g:get_state())
  end)

  it("rand_like / randn_like and dropout / F.dropout / nn.Dropout draw from the generator", function()
    engine.manual_seed(7)
    local before = engine.get_rng_state()
    local g = engine.Generator():manual_seed(321)
    local t = engine.empty(3, 5, { dtype = "f64" })
    local a = engine.rand_like(t, { generator = g })
    local b = engine.randn_like(t, { generator = g, dtype = "f32" })
    local x = engine.ones(6, 7, { dtype = "f64" })
    x.requires_grad = true
    local d1 = engine.dropout(x, 0.4, true, { generator = g })
    local d2 = nn.functional.dropout(x, 0.3, true, g)
    local d3 = nn.Dropout(0.5, { generator = g })(x)
    local d4 = nn.Dropout{ p = 0.2, generator = g }(x)
    ;(d1 + d2 * 2 + d3 * 3 + d4 * 4):sum():backward()
    assert.are.same(before, engine.get_rng_state())                   -- the global generator untouched
    engine.manual_seed(321)
    assert.is_true(same(a, engine.rand(3, 5, { dtype = "f64" })))
    assert.are.equal("f64", a.dtype)
    assert.is_true(same(b, engine.randn(3, 5)))
    assert.are.equal("f32", b.dtype)
    local y = engine.ones(6, 7, { dtype = "f64" })
    y.requires_grad = true
    local e1, e2, e3, e4 = engine.dropout(y, 0.4), engine.dropout(y, 0.3), engine.dropout(y, 0.5), engine.dropout(y, 0.2)
    ;(e1 + e2 * 2 + e3 * 3 + e4 * 4):sum():backward()
    for i, p in ipairs({ { d1, e1 }, { d2, e2 }, { d3, e3 }, { d4, e4 } }) do
      assert.is_true(same(p[1], p[2]), "dropout " .. i)
    end
    assert.is_true(same(x.grad, y.grad))
    assert.are.same(engine.get_rng_state(), g:get_state())
    assert.is_false(same(d1, d2))
    -- eval mode and p = 0 draw nothing
    local m = nn.Dropout(0.5, { generator = g })
    m:eval()
    local off = g:get_offset()
    assert.are.equal(x, m(x))
    assert.are.equal(off, g:get_offset())
    assert.matches("generator must be an engine.Generator, got string", errmsg(engine.rand_like, t, { generator = "g" }))
    assert.matches("dropout: expected a generator or an option table", errmsg(engine.dropout, x, 0.5, true, 3))
    assert.matches("Dropout: unknown option 'seed'", errmsg(nn.Dropout, 0.5, { seed = 1 }))
    assert.matches("Dropout: generator must be an engine.Generator", errmsg(nn.Dropout, { p = 0.5, generator = 1 }))
  end)

  it("scaled_dot_product_attention's dropout draws from the generator (extension)", function()
    engine.manual_seed(7)
    local before = engine.get_rng_state()
    local g = engine.Generator():manual_seed(99)
    local q = engine.randn(2, 2, 5, 4, { dtype = "f64", generator = engine.Generator():manual_seed(1) })
    local k = engine.randn(2, 2, 5, 4, { dtype = "f64", generator = engine.Generator():manual_seed(2) })
    local v = engine.randn(2, 2, 5, 4, { dtype = "f64", generator = engine.Generator():manual_seed(3) })
    q.requires_grad = true
    local a = engine.scaled_dot_product_attention(q, k, v, { dropout_p = 0.5, is_causal = true, generator = g })
    local b = nn.functional.scaled_dot_product_attention(q, k, v, { dropout_p = 0.5, generator = g })
    a:sum():backward()
    assert.are.same(before, engine.get_rng_state())                   -- the global generator untouched
    engine.manual_seed(99)
    local a2 = engine.scaled_dot_product_attention(q, k, v, { dropout_p = 0.5, is_causal = true })
    local b2 = engine.scaled_dot_product_attention(q, k, v, { dropout_p = 0.5 })
    assert.is_true(same(a, a2))
    assert.is_true(same(b, b2))
    assert.is_false(same(a, engine.scaled_dot_product_attention(q, k, v, { is_causal = true })))
    assert.are.same(engine.get_rng_state(), g:get_state())
    assert.matches("scaled_dot_product_attention: generator must be an engine.Generator, got number",
      errmsg(engine.scaled_dot_product_attention, q, k, v, { dropout_p = 0.5, generator = 1 }))
  end)

  it("two generators are independent streams", function()
    local g1, g2 = engine.Generator():manual_seed(5), engine.Generator():manual_seed(5)
    local a = engine.rand(10, { generator = g1 })
    engine.rand(100, { generator = g2 })
    local b = engine.rand(10, { generator = g1 })
    local g3 = engine.Generator():manual_seed(5)
    assert.is_true(same(a, engine.rand(10, { generator = g3 })))
    assert.is_true(same(b, engine.rand(10, { generator = g3 })))
    assert.is_false(same(a, b))
  end)

  it("random_slice reads a generator's state without advancing it (offset addressing)", function()
    local g = engine.Generator():manual_seed(99)
    g:set_offset(16)
    local s = engine.random_slice("normal", { 4, 6 }, { 2, 3 }, { 2, 2 }, { generator = g })
    assert.are.equal(16, g:get_offset())
    local whole = engine.randn(4, 6, { generator = g })
    assert.is_true(same(s, whole:narrow(1, 2, 2):narrow(2, 3, 2)))
    assert.matches("either a generator or seed/offset",
      errmsg(engine.random_slice, "uniform", { 2 }, nil, nil, { generator = g, seed = 1 }))
  end)

  it("nn.init functions take the generator (positional as PyTorch, or in the option table)", function()
    local function with_g(fill)
      local w = nn.Parameter(engine.empty(8, 6))
      fill(w, engine.Generator():manual_seed(31))
      return w
    end
    local function with_global(fill)
      local w = nn.Parameter(engine.empty(8, 6))
      engine.manual_seed(31)
      fill(w, nil)
      return w
    end
    local cases = {
      function(w, g) init.uniform_(w, -1, 1, g) end,
      function(w, g) init.normal_(w, 0, 0.02, g) end,
      function(w, g) init.normal_(w, 0, 0.02, { generator = g }) end,
      function(w, g) init.kaiming_uniform_(w, { a = math.sqrt(5), generator = g }) end,
      function(w, g) init.kaiming_normal_(w, { mode = "fan_out", generator = g }) end,
      function(w, g) init.xavier_uniform_(w, 2, g) end,
      function(w, g) init.xavier_normal_(w, { gain = 1.5, generator = g }) end,
    }
    for i, fill in ipairs(cases) do
      engine.manual_seed(1)
      local a = with_g(fill)
      assert.are.same({ seed = 1, offset = 0 }, engine.get_rng_state(), "case " .. i .. " moved the global generator")
      assert.is_true(same(a, with_global(fill)), "case " .. i)
    end
    assert.matches("generator must be an engine.Generator, got string",
      errmsg(init.kaiming_uniform_, nn.Parameter(engine.empty(2, 2)), { generator = "g" }))
    assert.matches("normal_: expected a generator or an option table",
      errmsg(init.normal_, engine.empty(2), 0, 1, 5))
  end)

  it("a failing draw restores the global generator and names the op", function()
    local g = engine.Generator():manual_seed(3)
    engine.manual_seed(11)
    local e = errmsg(function() return engine.rand(-1, { generator = g }) end)
    assert.matches("rand: negative size", e)
    assert.matches("generator_spec.lua", e)                   -- points at the caller's line
    e = errmsg(function() engine.empty(2, { dtype = "i64" }):uniform_(0, 1, g) end)
    assert.matches("uniform_: expects a floating point tensor", e)
    assert.are.same({ seed = 11, offset = 0 }, engine.get_rng_state())
    assert.are.equal(0, g:get_offset())
    local x = engine.rand(3)
    engine.manual_seed(11)
    assert.is_true(same(x, engine.rand(3)))
  end)

  it("a model built with a generator-driven init equals one built after the same global seed", function()
    engine.manual_seed(0)
    local m1 = nn.Llama{ dim = 16, n_layers = 1, n_heads = 2, vocab_size = 8, max_seq_len = 4, multiple_of = 8 }
    m1:init_weights({ generator = engine.Generator():manual_seed(77) })
    engine.manual_seed(77)
    local m2 = nn.Llama{ dim = 16, n_layers = 1, n_heads = 2, vocab_size = 8, max_seq_len = 4, multiple_of = 8 }
    engine.manual_seed(77)
    m2:init_weights()
    for name, p in m1:named_parameters() do
      assert.is_true(same(p, m2:get_parameter(name)), name)
    end
  end)
end)
