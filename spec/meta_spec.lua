-- The meta device (PyTorch's device="meta"): tensors with shape, dtype and
-- strides but no data.  Geometry works, ops compute output shapes and dtypes (as
-- the CPU op would), reading values fails naming the op; modules built on meta are materialised with to_empty and
-- initialised with reset_parameters, giving the values a CPU build would.
local engine = require("engine")
local nn = engine.nn

local function errmsg(fn, ...)
  local ok, e = pcall(fn, ...)
  if ok then return nil end
  return tostring(e)
end

local function meta(...) return engine.empty({ ... }, { device = "meta" }) end

describe("meta tensors", function()
  it("are created by every factory without data, with shape, dtype and strides", function()
    local before = engine.memory_stats().allocated
    local t = engine.empty({ 4096, 4096 }, { device = "meta" })
    local z = engine.zeros({ 3, 5 }, { device = "meta", dtype = "bf16" })
    local o = engine.ones({ 2 }, { device = "meta" })
    local f = engine.full({ 2, 2 }, 7, { device = "meta", dtype = "i64" })
    local r = engine.randn({ 6, 7 }, { device = "meta" })
    local a = engine.arange(10, { device = "meta" })
    assert.equal(before, engine.memory_stats().allocated) -- 64 MiB of f32 and nothing allocated
    assert.is_true(t.is_meta)
    assert.equal("meta", t.device)
    assert.same({ 4096, 4096 }, t:shape())
    assert.same({ 4096, 1 }, t:stride())
    assert.equal(4096 * 4096, t:numel())
    assert.equal("bf16", z.dtype)
    assert.equal("i64", f.dtype)
    assert.same({ 6, 7 }, r:shape())
    assert.same({ 10 }, a:shape())
    assert.is_true(o.is_meta and f.is_meta and r.is_meta and a.is_meta)
    assert.is_false(engine.ones(2).is_meta)
    assert.equal("tensor(..., f32[2,3], device=meta)", tostring(meta(2, 3)))
  end)

  it("support views, reshapes, casts, clone, cat and stack (shapes only)", function()
    local t = meta(6, 4)
    local v = t:view(4, 6):transpose(1, 2)
    assert.same({ 6, 4 }, v:shape())
    assert.is_false(v:is_contiguous())
    assert.same({ 24 }, v:reshape(-1):shape()) -- a copy on CPU: shapes only here
    assert.is_true(v:contiguous():is_contiguous())
    assert.same({ 3, 4 }, t:narrow(1, 2, 3):shape())
    assert.same({ 4 }, t:select(1, 1):shape())
    assert.same({ 6, 1, 4 }, t:unsqueeze(2):shape())
    assert.same({ 4, 6 }, t:permute(2, 1):shape())
    assert.same({ 2, 6, 4 }, t:unsqueeze(1):expand(2, 6, 4):shape())
    assert.equal("f64", t:to("f64").dtype)
    assert.is_true(t:to("bf16").is_meta)
    assert.is_true(t:clone().is_meta)
    assert.same({ 12, 4 }, engine.cat({ t, t }, 1):shape())
    assert.same({ 2, 6, 4 }, engine.stack({ t, t }, 1):shape())
    local parts = t:chunk(3, 1)
    assert.equal(3, #parts)
    assert.same({ 2, 4 }, parts[1]:shape())
    assert.is_true(t:detach().is_meta)
  end)

  it("fill, zero and copy into a meta tensor are no-ops; copying out of one is an error", function()
    local t = meta(3)
    t:fill_(2)
    t:zero_()
    t:copy_(engine.ones(3))
    assert.is_true(t.is_meta)
    local e = errmsg(function() engine.ones(3):copy_(meta(3)) end)
    assert.is_truthy(e and e:find("copy_: cannot copy out of meta tensor f32[3]@meta", 1, true), e)
    local e2 = errmsg(function() return meta(2, 2):cpu() end)
    assert.is_truthy(e2 and e2:find("cannot copy out of meta tensor", 1, true), e2)
  end)

  it("moving a tensor to meta keeps its shape and dtype only", function()
    local c = engine.tensor({ { 1, 2 }, { 3, 4 } }, "f64")
    local m = c:to("meta")
    assert.is_true(m.is_meta)
    assert.same({ 2, 2 }, m:shape())
    assert.equal("f64", m.dtype)
    assert.equal(m, m:to("meta")) -- already there: itself
    local e = engine.empty_like(m, { device = "cpu" })
    assert.is_false(e.is_meta)
    assert.same({ 2, 2 }, e:shape())
    assert.equal("f64", e.dtype)
    assert.is_true(engine.zeros_like(c, { device = "meta" }).is_meta)
    assert.is_true(engine.empty_like(m).is_meta)
  end)

  -- every op with a DTensor op def computes its output shapes and dtypes on meta; the
  -- results must be what the same op gives on CPU tensors of the same shapes and dtypes
  local F = nn.functional
  local function cpu_inputs()
    engine.manual_seed(3)
    return {
      a = engine.randn(2, 3), b = engine.randn(3), c = engine.randn(3, 4), d = engine.randn(5, 2, 3),
      v = engine.randn(3), i = engine.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }), f64 = engine.randn(2, 3, { dtype = "f64" }),
      bf = engine.randn(2, 3, { dtype = "bf16" }), m = engine.tensor({ { true, false, true }, { false, true, false } }),
      w = engine.randn(4, 3), bias = engine.randn(4), emb = engine.randn(10, 4), idx = engine.tensor({ { 1, 2 }, { 3, 9 } }),
      tgt = engine.tensor({ 0, 2 }), q = engine.randn(2, 2, 5, 4), k = engine.randn(2, 2, 6, 4), vv = engine.randn(2, 2, 6, 3),
      ln_w = engine.randn(3), ln_b = engine.randn(3),
    }
  end
  local ops = {
    { "neg", function(x) return -x.a end }, { "exp", function(x) return x.a:exp() end },
    { "exp of i64", function(x) return x.i:exp() end }, { "abs of i64", function(x) return x.i:abs() end },
    { "gelu tanh", function(x) return x.a:gelu("tanh") end }, { "clamp", function(x) return x.a:clamp(-1, 1) end },
    { "relu bf16", function(x) return x.bf:relu() end },
    { "add broadcast", function(x) return x.a + x.b end }, { "mul 3-d broadcast", function(x) return x.d * x.a end },
    { "f32 + f64", function(x) return x.a + x.f64 end }, { "i64 + f32", function(x) return x.i + x.a end },
    { "i64 * i64", function(x) return x.i * x.i end }, { "i64 / 2", function(x) return x.i / 2 end },
    { "i64 + 1.5", function(x) return x.i + 1.5 end }, { "2 ^ a", function(x) return 2 ^ x.a end },
    { "bf16 * 3", function(x) return x.bf * 3 end }, { "maximum", function(x) return x.a:maximum(x.b) end },
    { "eq", function(x) return x.a:eq(x.b) end }, { "lt scalar", function(x) return x.i:lt(3) end },
    { "where", function(x) return engine.where(x.m, x.a, x.f64) end },
    { "masked_fill", function(x) return x.a:masked_fill(x.m, 0) end },
    { "sum", function(x) return x.a:sum() end }, { "sum dim", function(x) return x.d:sum(2) end },
    { "sum keepdim", function(x) return x.d:sum(-1, true) end }, { "sum i64", function(x) return x.i:sum() end },
    { "sum bool", function(x) return x.m:sum(1) end }, { "mean dim", function(x) return x.d:mean(1) end },
    { "max", function(x) return x.a:max() end }, { "argmax", function(x) return x.a:argmax() end },
    { "argmax dim", function(x) return x.d:argmax(3, true) end },
    { "max dim (values, indices)", function(x) return x.d:max(2) end },
    { "softmax", function(x) return x.d:softmax(-1) end }, { "log_softmax", function(x) return x.a:log_softmax(1) end },
    { "layer_norm", function(x) return F.layer_norm(x.d, { 3 }, x.ln_w, x.ln_b) end },
    { "rms_norm", function(x) return F.rms_norm(x.d, { 3 }, x.ln_w) end },
    { "matmul 2-d", function(x) return x.a:matmul(x.c) end }, { "matmul 1-d . 1-d", function(x) return x.v:matmul(x.b) end },
    { "matmul 2-d x 1-d", function(x) return x.a:matmul(x.b) end },
    { "matmul batched", function(x) return x.d:matmul(x.c) end },
    { "linear", function(x) return F.linear(x.d, x.w, x.bias) end }, { "linear no bias", function(x) return F.linear(x.a, x.w) end },
    { "embedding", function(x) return F.embedding(x.idx, x.emb) end },
    { "cross_entropy", function(x) return F.cross_entropy(x.a, x.tgt) end },
    { "cross_entropy none", function(x) return F.cross_entropy(x.a, x.tgt, { reduction = "none" }) end },
    { "dropout", function(x) return F.dropout(x.a, 0.5, true) end },
    { "sdpa causal", function(x) return F.scaled_dot_product_attention(x.q, x.k, x.vv, nil, 0, true) end },
    { "clone", function(x) return x.a:clone() end }, { "to f64", function(x) return x.a:to("f64") end },
    { "index_select", function(x) return x.c:index_select(2, x.tgt) end },
    { "cat mixed dtypes", function(x) return engine.cat({ x.a, x.f64 }, 1) end },
  }
  local function as_meta(x)
    local r = {}
    for k, v in pairs(x) do r[k] = v:to("meta") end
    return r
  end

  it("ops compute the output shapes and dtypes the CPU op gives", function()
    local x = cpu_inputs()
    local mx = as_meta(x)
    for _, op in ipairs(ops) do
      local want = { op[2](x) }
      local got = { op[2](mx) }
      assert.equal(#want, #got, op[1])
      for j = 1, #want do
        assert.is_true(got[j].is_meta, op[1])
        assert.is_false(want[j].is_meta, op[1])
        assert.same(want[j]:shape(), got[j]:shape(), op[1])
        assert.equal(want[j].dtype, got[j].dtype, op[1])
        assert.is_nil(got[j].grad_fn, op[1])
      end
    end
  end)

  it("meta ops raise the errors the CPU op raises (shapes and dtypes)", function()
    local x = as_meta(cpu_inputs())
    local cases = {
      { "matmul", function() return x.a:matmul(x.a) end, "cannot be multiplied" },
      { "add", function() return x.a + x.c end, "broadcast" },
      { "softmax", function() return x.i:softmax(1) end, "floating point" },
      { "mean", function() return x.i:mean() end, "floating point" },
      { "linear", function() return F.linear(x.c, x.w) end, "do not match" },
      { "cross_entropy", function() return F.cross_entropy(x.a, x.idx) end, "target" },
    }
    for _, c in ipairs(cases) do
      local e = errmsg(c[2])
      assert.is_truthy(e and e:find(c[1], 1, true) and e:find(c[3], 1, true), c[1] .. ": " .. tostring(e))
    end
  end)

  it("meta ops do not advance the generator (dropout draws nothing)", function()
    engine.manual_seed(9)
    local _ = F.dropout(meta(100), 0.5, true)
    local r = engine.rand(4)
    engine.manual_seed(9)
    assert.equal(0, (engine.rand(4) - r):abs():max():item())
  end)

  it("in-place arithmetic into a meta tensor checks broadcasting and writes nothing", function()
    local t = meta(2, 3)
    t:add_(meta(3))
    t:mul_(2)
    local e = errmsg(function() t:add_(meta(4)) end)
    assert.is_truthy(e and e:find("add_", 1, true), e)
  end)

  it("ops without meta support, and reading values, fail naming the op", function()
    local a = meta(2, 3)
    local cases = {
      { "sum_to_size", function() return a:sum_to_size(1, 3) end },
      { "addcmul_", function() a:addcmul_(a, a, 1) end },
      { "item", function() return meta(1):item() end },
      { "get", function() return a:get(1, 1) end },
    }
    for _, c in ipairs(cases) do
      local e = errmsg(c[2])
      assert.is_truthy(e and e:find(c[1] .. ":", 1, true) and e:find("meta tensor", 1, true), c[1] .. ": " .. tostring(e))
    end
  end)

  it("mixing a meta and a CPU tensor is a device error naming both", function()
    local e = errmsg(function() return engine.ones(2) + meta(2) end)
    assert.is_truthy(e and e:find("add: tensors on different devices", 1, true) and e:find("f32[2]@meta", 1, true), e)
  end)

  it("random initialisers are no-ops on meta and do not advance the generator", function()
    engine.manual_seed(5)
    local t = meta(100)
    nn.init.uniform_(t)
    nn.init.normal_(t)
    nn.init.kaiming_uniform_(meta(4, 4), { a = math.sqrt(5) })
    local _ = engine.randn({ 1000 }, { device = "meta" })
    local x = engine.rand(3)
    engine.manual_seed(5)
    assert.equal(0, (engine.rand(3) - x):abs():max():item())
  end)
end)

describe("default device", function()
  after_each(function() engine.set_default_device("cpu") end)

  it("set_default_device and with_device route factories without a device", function()
    assert.equal("cpu", engine.get_default_device())
    local t = engine.with_device("meta", function() return engine.zeros(2, 3) end)
    assert.is_true(t.is_meta)
    assert.equal("cpu", engine.get_default_device())
    engine.set_default_device("meta")
    assert.is_true(engine.ones(2).is_meta)
    assert.is_false(engine.ones(2, { device = "cpu" }).is_meta)
    engine.set_default_device("cpu")
    assert.is_false(engine.ones(2).is_meta)
  end)

  it("with_device restores the default after an error and passes results through", function()
    local e = errmsg(engine.with_device, "meta", function() error("boom") end)
    assert.is_truthy(e and e:find("boom", 1, true), e)
    assert.equal("cpu", engine.get_default_device())
    local a, b = engine.with_device("meta", function(x) return x, x + 1 end, 41)
    assert.equal(41, a)
    assert.equal(42, b)
  end)

  it("unknown devices are errors", function()
    local e = errmsg(engine.set_default_device, "tpu")
    assert.is_truthy(e and e:find("unknown device 'tpu'", 1, true) and e:find("meta", 1, true), e)
    local e2 = errmsg(engine.empty, { 2 }, { device = "gpu" })
    assert.is_truthy(e2 and e2:find("empty: unknown device 'gpu'", 1, true), e2)
  end)
end)

describe("modules on the meta device", function()
  local function build()
    local m = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8), nn.Embedding(10, 4))
    return m
  end

  it("build without data, then to_empty + reset_parameters give the CPU initialisation", function()
    engine.manual_seed(11)
    local ref = build()
    engine.manual_seed(11)
    local before = engine.memory_stats().allocated
    local m = engine.with_device("meta", build)
    assert.equal(before, engine.memory_stats().allocated)
    local params = m:parameters()
    for _, p in ipairs(params) do assert.is_true(p.is_meta) end
    local w = m[1].weight
    assert.is_true(w.requires_grad)
    assert.is_true(nn.is_parameter(w))
    m:to_empty({ device = "cpu" })
    assert.equal(w, m[1].weight) -- the same parameter object
    assert.is_false(w.is_meta)
    assert.is_true(w.requires_grad)
    for _, sub in ipairs(m:modules()) do
      if sub.reset_parameters then sub:reset_parameters() end
    end
    local rp = ref:parameters()
    for i, p in ipairs(m:parameters()) do
      assert.same(rp[i]:shape(), p:shape())
      assert.equal(0, (p - rp[i]):abs():max():item())
    end
  end)

  it("a meta module runs on meta inputs (shapes), and after to_empty on CPU (forward and backward)", function()
    local m = engine.with_device("meta", function() return nn.Linear(4, 3) end)
    local ym = m(engine.empty({ 2, 4 }, { device = "meta" }))
    assert.is_true(ym.is_meta)
    assert.same({ 2, 3 }, ym:shape())
    local e = errmsg(function() return m(engine.ones(2, 4)) end)
    assert.is_truthy(e and e:find("different devices", 1, true), e)
    m:to_empty("cpu")
    m:reset_parameters()
    local y = m(engine.ones(2, 4))
    y:sum():backward()
    assert.same({ 3, 4 }, m.weight.grad:shape())
  end)

  it("module:to('meta') drops the data; optimizers and checkpoints refuse meta parameters", function()
    local m = nn.Linear(3, 2)
    m:to("meta")
    assert.is_true(m.weight.is_meta)
    local opt = engine.optim.SGD(m:parameters(), { lr = 0.1 })
    m.weight.grad = engine.empty({ 2, 3 }, { device = "meta" })
    m.bias.grad = engine.empty({ 2 }, { device = "meta" })
    local e = errmsg(function() opt:step() end)
    assert.is_truthy(e and e:find("meta tensor", 1, true), e)
    local e2 = errmsg(engine.save_safetensors or function() error("no save") end, os.tmpname(), m:state_dict())
    assert.is_truthy(e2 and (e2:find("meta tensor", 1, true) or e2:find("no save", 1, true)), e2)
  end)

  it("to_empty rejects unknown devices before changing anything", function()
    local m = engine.with_device("meta", function() return nn.Linear(2, 2) end)
    local e = errmsg(function() m:to_empty({ device = "disk" }) end)
    assert.is_truthy(e and e:find("to_empty: unknown device 'disk'", 1, true), e)
    assert.is_true(m.weight.is_meta)
  end)
end)
