-- nn: Module (registration, naming, state dicts, hooks, modes, conversion),
-- the layers, nn.functional, nn.init and activation checkpointing.
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local nn = engine.nn
local F = nn.functional
local gc = require("spec.helpers.gradcheck")

-- pcall fn; the error must contain every given plain substring.
local function err(fn, ...)
  local ok, msg = pcall(fn)
  assert.is_false(ok, "expected an error")
  msg = tostring(msg)
  for i = 1, select("#", ...) do
    local s = select(i, ...)
    assert.is_truthy(msg:find(s, 1, true), "error message '" .. msg .. "' does not contain '" .. s .. "'")
  end
  return msg
end

local function close(a, b, tol, what)
  local av = engine.is_tensor(a) and a:tolist_flat() or a
  local bv = engine.is_tensor(b) and b:tolist_flat() or b
  assert.are.equal(#bv, #av, (what or "") .. ": sizes differ")
  for i = 1, #av do
    if math.abs(av[i] - bv[i]) > (tol or 1e-6) then
      error(string.format("%s: element %d: %.10g vs %.10g", what or "values", i, av[i], bv[i]), 2)
    end
  end
end

local function names_of(iter)
  local out = {}
  for n in iter do out[#out + 1] = n end
  return out
end

local function same_storage(a, b) return a._c.storage == b._c.storage end

-- A small module with parameters, a buffer and submodules, registered out of alphabetical order.
local Toy = nn.Module:extend("Toy")
function Toy:__init()
  self.zeta = nn.Parameter(engine.ones(2))
  self.alpha = nn.Parameter(engine.zeros(3))
  self.not_a_param = 5
  self.plain = engine.ones(1)  -- a plain tensor: not registered
  self:register_buffer("running", engine.full({ 2 }, 7))
  self:register_buffer("scratch", engine.zeros(2), false)
  self.second = nn.Linear(2, 2)
  self.first = nn.Linear(2, 3, { bias = false })
end
function Toy:forward(x) return self.first(self.second(x)) end

describe("nn.Module registration", function()
  it("registers parameters, buffers and submodules in assignment order", function()
    local m = Toy()
    assert.are.same({ "zeta", "alpha", "second.weight", "second.bias", "first.weight" }, names_of(m:named_parameters()))
    assert.are.same({ "second", "first" }, names_of(m:named_children()))
    assert.are.same({ "", "second", "first" }, names_of(m:named_modules()))
    assert.are.same({ "running", "scratch" }, names_of(m:named_buffers()))
    assert.are.equal(5, m.not_a_param)
    assert.are.equal(5, #m:parameters())
    assert.are.equal(3, #m:modules())
    assert.are.equal(2 + 3 + 4 + 2 + 6, m:num_parameters())
    assert.is_true(m.zeta.requires_grad)
    assert.is_true(nn.is_parameter(m.zeta))
    assert.is_false(nn.is_parameter(m.plain))
  end)

  it("keeps the position of a re-assigned parameter and removes one assigned nil", function()
    local m = Toy()
    local new = nn.Parameter(engine.full({ 2 }, 3))
    m.zeta = new
    assert.are.equal(new, m.zeta)
    assert.are.same({ "zeta", "alpha" }, names_of(m:named_parameters(nil, false)))
    m.alpha = nil
    assert.is_nil(m.alpha)
    assert.are.same({ "zeta" }, names_of(m:named_parameters(nil, false)))
    m.alpha = nn.Parameter(engine.ones(1))
    assert.are.same({ "zeta", "alpha" }, names_of(m:named_parameters(nil, false)))
    m.second = nil
    assert.are.same({ "first" }, names_of(m:named_children()))
  end)

  it("rejects a plain tensor or a number assigned to a parameter or submodule", function()
    local m = Toy()
    err(function() m.zeta = engine.ones(2) end, "cannot assign a plain tensor to parameter 'zeta'", "nn.Parameter")
    err(function() m.zeta = 3 end, "cannot assign a number to parameter 'zeta'")
    err(function() m.first = 3 end, "cannot assign a number to submodule 'first'")
    err(function() m:register_parameter("x", engine.ones(1)) end, "expected nn.Parameter or nil")
    err(function() m:register_parameter("a.b", nn.Parameter(engine.ones(1))) end, "must not contain '.'")
    err(function() m:register_module("m", 4) end, "expected a Module")
    err(function() nn.Parameter(3) end, "nn.Parameter: expected a tensor")
  end)

  it("makes a Parameter a leaf sharing storage with its source", function()
    local t = engine.ones(3)
    local p = nn.Parameter(t)
    assert.is_true(same_storage(t, p))
    assert.is_true(p.is_leaf)
    assert.is_true(p.requires_grad)
    assert.is_false(nn.Parameter(t, false).requires_grad)
    local q = nn.Parameter(engine.ones(2, { requires_grad = true }) * 2)
    assert.is_true(q.is_leaf)
  end)

  it("supports subclassing a layer and is_a", function()
    local Scaled = nn.Linear:extend("ScaledLinear")
    function Scaled:__init(i, o) nn.Linear.__init(self, i, o); self.scale = nn.Parameter(engine.full({ o }, 2)) end
    function Scaled:forward(x) return nn.Linear.forward(self, x) * self.scale end
    local m = Scaled(3, 2)
    assert.are.same({ "weight", "bias", "scale" }, names_of(m:named_parameters()))
    assert.is_true(m:is_a(nn.Linear))
    assert.is_true(m:is_a(nn.Module))
    assert.is_false(m:is_a(nn.Embedding))
    local x = engine.randn(4, 3)
    close(m(x), F.linear(x, m.weight, m.bias) * 2, 1e-6, "ScaledLinear")
    err(function() nn.Module()(x) end, "forward is not implemented")
  end)
end)

describe("nn.Module names and traversal", function()
  it("names ModuleList children 0, 1, ... (PyTorch's state-dict names)", function()
    local m = engine.models.MLPStacked()
    local names = names_of(m:named_parameters())
    assert.are.same({ "layers.0.net1.weight", "layers.0.net1.bias", "layers.0.net2.weight", "layers.0.net2.bias",
      "layers.1.net1.weight", "layers.1.net1.bias", "layers.1.net2.weight", "layers.1.net2.bias" }, names)
    assert.are.equal(m.layers[1], m:get_submodule("layers.0"))
    assert.are.equal(m.layers[2].net1, m:get_submodule("layers.1.net1"))
    assert.are.equal(m.layers[2].net2.bias, m:get_parameter("layers.1.net2.bias"))
    err(function() m:get_submodule("layers.2") end, "ModuleList has no attribute `2`", "children: 0, 1")
    err(function() m:get_parameter("layers.0.net1.nope") end, "has no parameter 'nope'")
  end)

  it("deduplicates tied parameters in parameters() but not in state_dict()", function()
    local m = nn.Transformer()
    local names = names_of(m:named_parameters())
    local has_output = false
    for _, n in ipairs(names) do if n == "output.weight" then has_output = true end end
    assert.is_false(has_output)
    local sd, keys = m:state_dict(), m:state_dict_keys()
    assert.is_truthy(sd["output.weight"])
    assert.is_truthy(sd["tok_embeddings.weight"])
    assert.are.equal(#names + 1, #keys)
    assert.is_true(same_storage(sd["output.weight"], sd["tok_embeddings.weight"]))
    assert.are.equal(#names, #names_of(m:named_parameters(nil, true, false)) - 1)
  end)

  it("applies a function to every module, children first", function()
    local m = Toy()
    local seen = {}
    m:apply(function(x) seen[#seen + 1] = x.__name end)
    assert.are.same({ "Linear", "Linear", "Toy" }, seen)
  end)

  it("prints a readable tree", function()
    local s = tostring(Toy())
    assert.is_truthy(s:find("Toy(", 1, true))
    assert.is_truthy(s:find("(second): Linear(in_features=2, out_features=2, bias=true)", 1, true))
    assert.is_truthy(s:find("(first): Linear(in_features=2, out_features=3, bias=false)", 1, true))
    assert.is_truthy(tostring(nn.Sequential(nn.ReLU(), nn.GELU("tanh"))):find("(1): GELU(approximate='tanh')", 1, true))
  end)
end)

describe("nn.Module state dicts", function()
  it("round-trips: a fresh model loaded from another's state dict computes the same", function()
    engine.manual_seed(1)
    local a = Toy()
    engine.manual_seed(2)
    local b = Toy()
    local x = engine.randn(4, 2)
    assert.is_true((a(x) - b(x)):abs():max():item() > 1e-3)
    local sd, keys = a:state_dict(), a:state_dict_keys()
    assert.are.same({ "zeta", "alpha", "running", "second.weight", "second.bias", "first.weight" }, keys)
    assert.is_nil(sd.scratch)  -- non-persistent buffer
    assert.is_true(same_storage(sd.zeta, a.zeta))
    assert.is_false(sd.zeta.requires_grad)
    local res = b:load_state_dict(sd)
    assert.are.same({}, res.missing_keys)
    assert.are.same({}, res.unexpected_keys)
    close(b(x), a(x), 0, "outputs after load")
    close(b.running, engine.full({ 2 }, 7), 0, "buffer")
    assert.is_false(same_storage(b.zeta, a.zeta))  -- values were copied
    assert.is_true(b.zeta.requires_grad and b.zeta.is_leaf)
  end)

  it("converts dtypes when loading", function()
    local a = Toy()
    local b = Toy():double()
    b:load_state_dict(a:state_dict())
    assert.are.equal("f64", b.second.weight.dtype)
    close(b.second.weight, a.second.weight, 1e-7, "converted weight")
  end)

  it("reports missing, unexpected and mis-shaped entries together and copies nothing", function()
    local a = Toy()
    local sd = a:state_dict()
    sd.zeta = nil
    sd.extra = engine.ones(1)
    sd["second.weight"] = engine.ones(5, 5)
    local b = Toy()
    local before = b.alpha:clone()
    sd.alpha = engine.full({ 3 }, 9)
    local msg = err(function() b:load_state_dict(sd) end, "error(s) in loading state_dict for Toy",
      "Missing key(s) in state_dict: zeta", "Unexpected key(s) in state_dict: extra",
      "size mismatch for second.weight: copying a param with shape [5, 5] from checkpoint, the shape in current model is [2, 2]")
    assert.is_truthy(msg)
    close(b.alpha, before, 0, "nothing copied")
    -- non-strict: missing/unexpected are returned, shape mismatches still fail
    err(function() b:load_state_dict(sd, { strict = false }) end, "size mismatch for second.weight")
    sd["second.weight"] = nil
    local res = b:load_state_dict(sd, { strict = false })
    assert.are.same({ "zeta", "second.weight" }, res.missing_keys)
    assert.are.same({ "extra" }, res.unexpected_keys)
    close(b.alpha, engine.full({ 3 }, 9), 0, "copied in non-strict mode")
    err(function() b:load_state_dict(5) end, "expected a table")
  end)
end)

describe("nn.Module hooks", function()
  it("lets a forward-pre hook replace the input and a forward hook replace the output", function()
    local m = nn.Linear(2, 2)
    local x = engine.randn(3, 2)
    local plain = m(x)
    local seen_mod, seen_in
    local h1 = m:register_forward_pre_hook(function(mod, inputs)
      seen_mod, seen_in = mod, inputs
      return inputs[1] * 2
    end)
    local y = m(x)
    assert.are.equal(m, seen_mod)
    assert.are.equal(1, #seen_in)
    close(seen_in[1], x, 0, "pre hook input")
    close(y, F.linear(x * 2, m.weight, m.bias), 1e-6, "input replaced")
    h1:remove()
    close(m(x * 2), F.linear(x * 2, m.weight, m.bias), 1e-6, "hook removed")
    local out_seen
    local h2 = m:register_forward_hook(function(mod, inputs, output)
      out_seen = { mod, inputs[1], output }
      return output + 1
    end)
    local z = m(x)
    close(z, plain + 1, 1e-6, "output replaced")
    assert.are.equal(m, out_seen[1])
    close(out_seen[2], x, 0, "forward hook sees the inputs")
    close(out_seen[3], plain, 1e-6, "forward hook sees the output")
    h2:remove()
    h2:remove()  -- removing twice is harmless
    close(m(x), plain, 1e-6, "hook removed")
  end)

  it("runs hooks in registration order (prepend puts one first) and keeps nil results", function()
    local m = nn.ReLU()
    local order = {}
    m:register_forward_pre_hook(function() order[#order + 1] = "a" end)
    m:register_forward_pre_hook(function() order[#order + 1] = "b" end)
    m:register_forward_pre_hook(function() order[#order + 1] = "first" end, { prepend = true })
    m:register_forward_hook(function() order[#order + 1] = "post" end)
    local x = engine.tensor({ -1, 2 }, "f32")
    close(m(x), { 0, 2 }, 0, "relu through nil-returning hooks")
    assert.are.same({ "first", "a", "b", "post" }, order)
  end)

  it("passes non-tensor arguments through and hooks only the tensors", function()
    local M2 = nn.Module:extend("TwoArgs")
    function M2:forward(a, scale, b) return a * scale + b end
    local m = M2()
    m:register_forward_pre_hook(function(_, inputs)
      assert.are.equal(2, #inputs)
      return { nil, inputs[2] * 10 }
    end)
    close(m(engine.tensor({ 1.0 }, "f32"), 3, engine.tensor({ 1.0 }, "f32")), { 13 }, 0, "second tensor replaced")
  end)

  it("propagates errors raised in hooks and recovers", function()
    local m = nn.ReLU()
    local h = m:register_forward_pre_hook(function() error("boom in hook") end)
    err(function() m(engine.ones(2)) end, "boom in hook", "forward-pre hook of module ReLU")
    h:remove()
    close(m(engine.ones(2)), { 1, 1 }, 0, "after removal")
    m:register_forward_hook(function() return 5 end)
    err(function() m(engine.ones(2)) end, "hook returned a number")
  end)

  it("does not keep the module alive through its hooks", function()
    local weak = setmetatable({}, { __mode = "v" })
    do
      local m = nn.Linear(2, 2)
      m:register_forward_hook(function(mod, _, out) return out end)
      weak[1] = m
    end
    collectgarbage(); collectgarbage()
    assert.is_nil(weak[1])
  end)

  it("still records gradients through replaced tensors", function()
    local m = nn.Linear(2, 1)
    m:register_forward_hook(function(_, _, out) return out * 3 end)
    local x = engine.ones(1, 2)
    m(x):sum():backward()
    close(m.weight.grad, { 3, 3 }, 1e-6, "grad through the hook")
  end)
end)

describe("nn.Module modes, gradients and conversion", function()
  it("train/eval set the flag recursively and switch dropout", function()
    local m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    assert.is_true(m.training and m[2].training)
    assert.are.equal(m, m:eval())
    assert.is_false(m.training or m[1].training or m[2].training)
    local x = engine.ones(64, 4)
    close(m(x), m(x), 0, "eval is deterministic")
    close(m[2](x), x, 0, "dropout is the identity in eval mode")
    m:train()
    assert.is_true(m[2].training)
    local y = m[2](x)
    local zeros = (y:eq(0)):sum():item()
    assert.is_true(zeros > 40 and zeros < 216, "about half dropped, got " .. zeros)
    local kept = y:sum():item() / (256 - zeros)
    assert.is_true(math.abs(kept - 2) < 1e-6, "kept values scaled by 1/(1-p)")
  end)

  it("zero_grad sets gradients to none or zero", function()
    local m = nn.Linear(2, 2)
    m(engine.ones(1, 2)):sum():backward()
    assert.is_truthy(m.weight.grad)
    m:zero_grad(false)
    close(m.weight.grad, { 0, 0, 0, 0 }, 0, "zeroed")
    m:zero_grad()
    assert.is_nil(m.weight.grad)
    assert.is_nil(m.bias.grad)
  end)

  it("to(dtype) converts floating parameters and buffers and keeps tied weights tied", function()
    local m = nn.Transformer()
    local w = m.tok_embeddings.weight:clone()
    m:to("f64")
    assert.are.equal("f64", m.tok_embeddings.weight.dtype)
    assert.are.equal(m.tok_embeddings.weight, m.output.weight)
    assert.is_true(nn.is_parameter(m.output.weight) and m.output.weight.requires_grad)
    close(m.tok_embeddings.weight, w, 1e-7, "values kept")
    local out = m(engine.tensor({ { 1, 2, 3 } }))
    assert.are.equal("f32", out.dtype)  -- the model's forward ends with :float()
    local n = 0
    for _ in m:named_parameters() do n = n + 1 end
    assert.are.equal(#m:parameters(), n)
    local t = Toy():double()
    assert.are.equal("f64", t.running.dtype)
  end)

  it("requires_grad_(false) freezes every parameter", function()
    local m = nn.Linear(2, 2):requires_grad_(false)
    assert.is_false(m.weight.requires_grad or m.bias.requires_grad)
    assert.are.equal(0, m:num_parameters(true))
  end)
end)

describe("nn layers", function()
  it("Linear computes x W^T + b and initialises within +-1/sqrt(in)", function()
    engine.manual_seed(0)
    local m = nn.Linear(50, 40)
    local bound = 1 / math.sqrt(50)
    local wmax = m.weight:abs():max():item()
    assert.is_true(wmax <= bound and wmax > 0.9 * bound, "weight bound " .. wmax)
    assert.is_true(math.abs(m.weight:mean():item()) < 0.02)
    assert.is_true(m.bias:abs():max():item() <= bound)
    engine.no_grad(function()
      m = nn.Linear(2, 3)
      m.weight:copy_(engine.tensor({ { 1, 2 }, { 3, 4 }, { 5, 6 } }))
      m.bias:copy_(engine.tensor({ 0.5, -1, 2 }))
    end)
    close(m(engine.tensor({ { 1.0, -1.0 }, { 2.0, 0.5 } }, "f32")), { -0.5, -2, 1, 3.5, 7, 15 }, 1e-6, "Linear")
    close(m(engine.tensor({ 1.0, 1.0 }, "f32")), { 3.5, 6, 13 }, 1e-6, "Linear on a vector")
    local nb = nn.Linear(3, 2, { bias = false })
    assert.is_nil(nb.bias)
    assert.are.same({ "weight" }, names_of(nb:named_parameters()))
    assert.are.equal("f64", nn.Linear(2, 2, { dtype = "f64" }).weight.dtype)
    err(function() nn.Linear(-1, 2) end, "in_features must be a non-negative integer")
    err(function() nn.Linear(2, 1.5) end, "out_features must be a non-negative integer")
    err(function() nn.Linear(2, 3)(engine.ones(4, 5)) end, "linear")
  end)

  it("Linear gradients pass a float64 gradcheck", function()
    local m = nn.Linear(3, 2, { dtype = "f64" })
    local x = engine.randn(4, 3, { dtype = "f64" }):requires_grad_()
    gc.check(function(a, w, b) return F.linear(a, w, b) end, { x, m.weight, m.bias })
  end)

  it("LayerNorm matches the hand-computed normalisation", function()
    local m = nn.LayerNorm(4)
    local x = engine.tensor({ { 1.0, 2, 3, 4 }, { -2.0, 0, 0, 2 } }, "f32")
    local s1 = math.sqrt(1.25 + 1e-5)
    local s2 = math.sqrt(2 + 1e-5)
    close(m(x), { -1.5 / s1, -0.5 / s1, 0.5 / s1, 1.5 / s1, -2 / s2, 0, 0, 2 / s2 }, 1e-5, "LayerNorm")
    engine.no_grad(function()
      m.weight:copy_(engine.tensor({ 1.0, 2, 3, 4 }))
      m.bias:copy_(engine.tensor({ 1.0, 1, 1, 1 }))
    end)
    close(m(x):select(1, 1), { 1 - 1.5 / s1, 1 - 1 / s1, 1 + 1.5 / s1, 1 + 6 / s1 }, 1e-5, "affine")
    local na = nn.LayerNorm({ 2, 2 }, { elementwise_affine = false, eps = 0 })
    assert.are.equal(0, #na:parameters())
    close(na(x:view(2, 2, 2)):view(2, 4), { -1.5 / math.sqrt(1.25), -0.5 / math.sqrt(1.25), 0.5 / math.sqrt(1.25),
      1.5 / math.sqrt(1.25), -math.sqrt(2), 0, 0, math.sqrt(2) }, 1e-5, "no affine, 2 normalised dims")
    assert.are.same({ "weight" }, names_of(nn.LayerNorm(3, { bias = false }):named_parameters()))
    err(function() nn.LayerNorm(0) end, "normalized_shape")
    err(function() nn.LayerNorm(3)(engine.ones(2, 4)) end, "normalized_shape")
  end)

  it("RMSNorm matches the seed's elementary RMSNormPython", function()
    local x = engine.randn(3, 8)
    local ref = engine.models.RMSNormPython(8, 1e-6)
    local m = nn.RMSNorm(8, { eps = 1e-6 })
    close(m(x), ref(x), 1e-5, "RMSNorm")
    local row = x:select(1, 1):tolist_flat()
    local ms = 0
    for i = 1, 8 do ms = ms + row[i] * row[i] end
    ms = ms / 8
    local expect = {}
    for i = 1, 8 do expect[i] = row[i] / math.sqrt(ms + 1.1920928955078125e-07) end
    close(nn.RMSNorm(8)(x):select(1, 1), expect, 1e-5, "RMSNorm with the default eps")
  end)

  it("Embedding looks up rows and keeps the padding row at zero with no gradient", function()
    local m = nn.Embedding(5, 3, { padding_idx = 1 })
    close(m.weight:select(1, 2), { 0, 0, 0 }, 0, "padding row zero")
    local idx = engine.tensor({ { 0, 1 }, { 4, 0 } })
    local out = m(idx)
    assert.are.same({ 2, 2, 3 }, out:shape())
    close(out:select(1, 2):select(1, 1), m.weight:select(1, 5), 0, "row 4")
    out:sum():backward()
    close(m.weight.grad:select(1, 1), { 2, 2, 2 }, 0, "row 0 used twice")
    close(m.weight.grad:select(1, 2), { 0, 0, 0 }, 0, "padding row gets no gradient")
    assert.are.equal(4, nn.Embedding(5, 3, { padding_idx = -1 }).padding_idx)
    err(function() nn.Embedding(5, 3, { padding_idx = 5 }) end, "padding_idx 5 must be within")
    err(function() nn.Embedding(5, 3)(engine.tensor({ 5 })) end, "embedding")
  end)

  it("activations compute their formulas", function()
    local x = engine.tensor({ -2.0, -0.5, 0, 1, 3 }, "f32")
    close(nn.ReLU()(x), { 0, 0, 0, 1, 3 }, 0, "relu")
    local erf_gelu, tanh_gelu, silu = {}, {}, {}
    local function erf(v)  -- Abramowitz-Stegun 7.1.26 is too coarse; use a series
      local s, term, k = 0, v, 0
      while math.abs(term) > 1e-17 and k < 200 do
        s = s + term / (2 * k + 1)
        k = k + 1
        term = -term * v * v / k
      end
      return 2 / math.sqrt(math.pi) * s
    end
    for i, v in ipairs(x:tolist_flat()) do
      erf_gelu[i] = 0.5 * v * (1 + erf(v / math.sqrt(2)))
      tanh_gelu[i] = 0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ^ 3)))
      silu[i] = v / (1 + math.exp(-v))
    end
    close(nn.GELU()(x), erf_gelu, 1e-6, "gelu")
    close(nn.GELU({ approximate = "tanh" })(x), tanh_gelu, 1e-6, "gelu tanh")
    close(nn.SiLU()(x), silu, 1e-6, "silu")
    close(nn.Softmax(-1)(engine.tensor({ 0.0, 0.0 }, "f32")), { 0.5, 0.5 }, 1e-7, "softmax")
    err(function() nn.GELU("sigmoid") end, "approximate must be")
    err(function() nn.Dropout(1.5) end, "probability p must be between 0 and 1")
  end)

  it("Sequential chains and ModuleList holds modules with Lua indexing", function()
    local s = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert.are.equal(3, #s)
    local x = engine.randn(4, 2)
    close(s(x), s[3](s[2](s[1](x))), 0, "Sequential")
    assert.are.same({ "0.weight", "0.bias", "2.weight", "2.bias" }, names_of(s:named_parameters()))
    local l = nn.ModuleList({ nn.ReLU() })
    l:append(nn.Linear(1, 1))
    l:insert(1, nn.Tanh())
    assert.are.equal(3, #l)
    local kinds = {}
    for i, m in ipairs(l) do kinds[i] = m.__name end
    assert.are.same({ "Tanh", "ReLU", "Linear" }, kinds)
    assert.are.same({ "2.weight", "2.bias" }, names_of(l:named_parameters()))
    assert.are.same({ "0", "1", "2" }, names_of(l:named_children()))
    err(function() l:append(5) end, "is a number, not a Module")
    err(function() nn.ModuleList({ 1 }) end, "not a Module")
    err(function() l(x) end, "ModuleList: a ModuleList has no forward")
    local d = nn.ModuleDict({ b = nn.ReLU(), a = nn.Tanh() })
    assert.are.same({ "a", "b" }, d:keys())
    assert.are.equal("ReLU", d.b.__name)
  end)
end)

describe("nn.functional", function()
  it("cross_entropy accepts the language-model layout [B, T, C] with targets [B, T]", function()
    local logits = engine.randn(2, 3, 5)
    local target = engine.tensor({ { 0, 4, 2 }, { 1, 1, 3 } })
    local a = F.cross_entropy(logits, target)
    local b = F.cross_entropy(logits:reshape(6, 5), target:reshape(6))
    close(a, b, 1e-6, "flattened")
    local none = F.cross_entropy(logits:reshape(6, 5), target:reshape(6), { reduction = "none" })
    local lsm = logits:reshape(6, 5):log_softmax(-1)
    local tv = target:reshape(6):tolist_flat()
    local expect = {}
    for i = 1, 6 do expect[i] = -lsm:get(i, tv[i] + 1) end
    close(none, expect, 1e-5, "per-token loss")
    -- PyTorch's layout [N, C, d] still works
    local tl = engine.randn(2, 5, 3)
    close(F.cross_entropy(tl, target), F.cross_entropy(tl:transpose(2, 3):reshape(6, 5), target:reshape(6)), 1e-6,
      "classes in dim 2")
  end)

  it("mse_loss reduces like PyTorch", function()
    local a, b = engine.tensor({ 1.0, 2, 3 }, "f32"), engine.tensor({ 1.0, 0, 6 }, "f32")
    close(F.mse_loss(a, b), { 13 / 3 }, 1e-6, "mean")
    close(F.mse_loss(a, b, { reduction = "sum" }), { 13 }, 1e-6, "sum")
    close(F.mse_loss(a, b, { reduction = "none" }), { 0, 4, 9 }, 1e-6, "none")
    err(function() F.mse_loss(a, b, { reduction = "avg" }) end, "reduction must be")
  end)

  it("scaled_dot_product_attention takes positional or table options", function()
    local q, k, v = engine.randn(1, 2, 4, 8), engine.randn(1, 2, 4, 8), engine.randn(1, 2, 4, 8)
    close(F.scaled_dot_product_attention(q, k, v, nil, 0, true),
      F.scaled_dot_product_attention(q, k, v, { is_causal = true }), 0, "positional vs table")
    -- causal: the first query attends only to the first key
    local out = F.scaled_dot_product_attention(q, k, v, nil, 0, true)
    close(out:select(3, 1), v:select(3, 1), 1e-6, "first position")
  end)

  it("dropout with p = 0 or training = false returns the input", function()
    local x = engine.ones(3)
    assert.are.equal(x, F.dropout(x, 0))
    assert.are.equal(x, F.dropout(x, 0.5, false))
    err(function() F.dropout(x, 2) end, "between 0 and 1")
    err(function() F.relu(3) end, "relu: argument 1 must be a tensor")
    err(function() F.softmax(x) end, "dim is required")
  end)
end)

describe("nn.init", function()
  it("kaiming and xavier draw within their bounds", function()
    local w = engine.empty(64, 100)
    nn.init.kaiming_uniform_(w, { nonlinearity = "relu" })
    local b = math.sqrt(2) * math.sqrt(3 / 100)
    assert.is_true(w:abs():max():item() <= b and w:abs():max():item() > 0.9 * b)
    nn.init.xavier_uniform_(w)
    local a = math.sqrt(6 / 164)
    assert.is_true(w:abs():max():item() <= a and w:abs():max():item() > 0.9 * a)
    nn.init.constant_(w, 0.25)
    close(w:max(), { 0.25 }, 0, "constant")
    local p = nn.Parameter(engine.empty(3, 3))
    nn.init.zeros_(p)  -- in place on a parameter works (runs without recording)
    close(p:sum(), { 0 }, 0, "zeros_")
    assert.are.same({ 100, 64 }, { nn.init.calculate_fan_in_and_fan_out(w) })
    err(function() nn.init.calculate_fan_in_and_fan_out(engine.ones(3)) end, "fewer than 2 dims")
    err(function() nn.init.calculate_gain("nope") end, "unsupported nonlinearity")
  end)
end)

describe("nn.checkpoint", function()
  local function run(ckpt, seed)
    engine.manual_seed(seed)
    local model = nn.Transformer({ dim = 16, n_heads = 2, dropout_p = 0.3, checkpoint_activations = ckpt })
    local tokens = engine.tensor({ { 1, 2, 3, 4, 5 }, { 7, 6, 5, 4, 3 } })
    engine.manual_seed(seed + 100)
    local loss = F.cross_entropy(model(tokens), tokens)
    loss:backward()
    local grads = {}
    for name, p in model:named_parameters() do grads[name] = p.grad end
    return loss:item(), grads, engine.get_rng_state()
  end

  it("gives the same loss and gradients as without checkpointing, with dropout on", function()
    local l1, g1, rng1 = run(false, 11)
    local l2, g2, rng2 = run(true, 11)
    assert.are.equal(l1, l2)
    local n = 0
    for name, g in pairs(g1) do
      assert.is_truthy(g2[name], "no gradient for " .. name .. " with checkpointing")
      close(g2[name], g, 0, name)  -- bitwise identical
      n = n + 1
    end
    assert.are.equal(28, n)
    assert.are.same(rng1, rng2)  -- recomputation does not disturb the generator
  end)

  it("checkpoints a plain function of several tensors", function()
    local w = nn.Parameter(engine.randn(3, 3, { dtype = "f64" }))
    local a = engine.randn(2, 3, { dtype = "f64" }):requires_grad_()
    local b = engine.randn(2, 3, { dtype = "f64" }):requires_grad_()
    local function f(x, scale, y) return (x:matmul(w) * scale + y):tanh() end
    local out = nn.checkpoint(f, a, 2, b)
    assert.is_truthy(out.grad_fn)
    out:sum():backward()
    local ga, gb, gw = a.grad:clone(), b.grad:clone(), w.grad:clone()
    a.grad, b.grad, w.grad = nil, nil, nil
    f(a, 2, b):sum():backward()
    close(ga, a.grad, 1e-12, "grad a")
    close(gb, b.grad, 1e-12, "grad b")
    close(gw, w.grad, 1e-12, "grad w (closed over)")
    err(function() nn.checkpoint(5, a) end, "expected a Module or a function")
  end)

  it("a region whose inputs do not require grad: the parameters it reads get their gradients (module, function)", function()
    engine.manual_seed(5)
    local m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    local x = engine.randn(5, 3)   -- data: no grad
    m(x):sum():backward()
    local want = {}
    for name, p in m:named_parameters() do want[name] = p.grad:clone(); p.grad = nil end
    for _, form in ipairs({ "module", "function" }) do
      local out = form == "module" and nn.checkpoint(m, x) or nn.checkpoint(function(h) return m(h) end, x)
      assert.is_true(out.requires_grad, form)
      out:sum():backward()
      for name, p in m:named_parameters() do
        close(p.grad, want[name], 1e-6, form .. " " .. name)
        p.grad = nil
      end
    end
  end)

  it("under no_grad just runs the function", function()
    local m = nn.Linear(2, 2)
    local y = engine.no_grad(nn.checkpoint, m, engine.ones(1, 2))
    assert.is_nil(y.grad_fn)
  end)
end)
