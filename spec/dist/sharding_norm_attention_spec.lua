-- Sharding propagation of softmax / log_softmax, layer_norm / rms_norm, dropout
-- and scaled_dot_product_attention: every input layout on a 1-D mesh of the
-- world and (4 ranks) a 2x2 mesh, even and uneven sizes, forward and backward
-- against the single-process result (spec/dist/helpers/converter.lua); dropout
-- draws the same mask as one process for every layout (and advances the
-- generator by the global numel); collective counts of a sequence-sharded
-- layer_norm.
local engine = require("engine")
local dist = engine.distributed
local conv = require("spec.dist.helpers.converter")

local W = dist.world_size()
local S, Rep, Part = dist.Shard, dist.Replicate, dist.Partial
local F = engine.nn.functional
local mesh1 = conv.meshes("1d")[1]

local function randn(...) return engine.randn({ ... }, { dtype = "f64" }) end
local function diff(a, b) return (a:double() - b:double()):abs():max():item() end
local function c(t) if W > 1 then return t end return {} end

-- placement lists for a "parameter" input: all Replicate, or Shard(1) on every mesh dim
local function param_choices(mnd)
  local r, s = {}, {}
  for k = 1, mnd do r[k] = Rep(); s[k] = S(1) end
  return { r, s }
end

describe("sharding: softmax / log_softmax", function()
  for _, sz in ipairs({ { 4, 6 }, { 5, 3 } }) do
    local tag = string.format("[%d,%d]", sz[1], sz[2])
    it("over each dim " .. tag, function()
      engine.manual_seed(31)
      local x = randn(sz[1], sz[2])
      for _, d in ipairs({ 1, 2, -1 }) do
        conv.check("softmax " .. d, function(a) return a:softmax(d) end, { x })
        conv.check("log_softmax " .. d, function(a) return F.log_softmax(a, d) end, { x })
      end
    end)
  end
  it("3-d [2,5,4], softmax over the middle dim", function()
    engine.manual_seed(32)
    local x = randn(2, 5, 4)
    conv.check("softmax 2 (3-d)", function(a) return a:softmax(2) end, { x })
    conv.check("log_softmax -1 (3-d)", function(a) return a:log_softmax(-1) end, { x })
  end)
  it("keeps Shard on other dims with 0 collectives; Partial input is reduced first", function()
    engine.manual_seed(33)
    local x = randn(8, 5)
    local d = dist.distribute_tensor(x, mesh1, { S(1) })
    local cnt, y = dist.count_collectives(function() return d:softmax(2) end)
    assert.same({}, cnt)
    assert.same({ S(1) }, y.placements)
    assert.is_true(diff(y:full_tensor(), x:softmax(2)) < 1e-12)
    local d2 = dist.distribute_tensor(x, mesh1, { S(2) })
    local c2, y2 = dist.count_collectives(function() return d2:softmax(2) end)
    assert.same(c({ all_gather = 1 }), c2)
    assert.same({ Rep() }, y2.placements)
    -- a Partial(sum) whose full value is x
    local p = dist.DTensor.from_local(x / W, mesh1, { Part() })
    local y3 = p:log_softmax(-1)
    assert.same({ Rep() }, y3.placements)
    assert.is_true(diff(y3:full_tensor(), x:log_softmax(-1)) < 1e-12)
  end)
end)

describe("sharding: layer_norm / rms_norm", function()
  for _, sz in ipairs({ { 4, 4, 6 }, { 5, 3, 4 } }) do
    local B, T, C = sz[1], sz[2], sz[3]
    local tag = string.format("[%d,%d,%d]", B, T, C)
    it("layer_norm over the last dim and the last two dims " .. tag, function()
      engine.manual_seed(41)
      local x, w, b = randn(B, T, C), randn(C), randn(C)
      local ch = function(i, t, mnd)
        if i == 1 then return conv.placement_lists(3, mnd) end
        return param_choices(mnd)
      end
      conv.check("layer_norm C", function(a, ww, bb) return F.layer_norm(a, { C }, ww, bb) end, { x, w, b },
        { choices = ch })
      local w2, b2 = randn(T, C), randn(T, C)
      local ch2 = function(i, t, mnd)
        if i == 1 then return conv.placement_lists(3, mnd) end
        return { param_choices(mnd)[1] }
      end
      conv.check("layer_norm T,C", function(a, ww, bb) return F.layer_norm(a, { T, C }, ww, bb, 1e-3) end,
        { x, w2, b2 }, { choices = ch2 })
      conv.check("layer_norm no affine", function(a) return F.layer_norm(a, C) end, { x })
    end)
    it("rms_norm with and without weight " .. tag, function()
      engine.manual_seed(42)
      local x, w = randn(B, T, C), randn(C)
      local ch = function(i, t, mnd)
        if i == 1 then return conv.placement_lists(3, mnd) end
        return param_choices(mnd)
      end
      conv.check("rms_norm", function(a, ww) return F.rms_norm(a, { C }, ww, 1e-6) end, { x, w }, { choices = ch })
      conv.check("rms_norm no weight", function(a) return F.rms_norm(a, { C }) end, { x })
    end)
  end

  it("Shard(2) of [B,T,C]: 0 collectives forward; weight and bias grads all-reduced once each", function()
    engine.manual_seed(43)
    local x, w, b = randn(2, 8, 6), randn(6), randn(6)
    local dx = dist.distribute_tensor(x, mesh1, { S(2) })
    dx.requires_grad = true
    local dw = dist.distribute_tensor(w, mesh1, { Rep() }); dw.requires_grad = true
    local db = dist.distribute_tensor(b, mesh1, { Rep() }); db.requires_grad = true
    local cf, y = dist.count_collectives(function() return F.layer_norm(dx, { 6 }, dw, db) end)
    assert.same({}, cf)
    assert.same({ S(2) }, y.placements)
    engine.manual_seed(44)
    local g = randn(2, 8, 6)
    local dg = dist.distribute_tensor(g, mesh1, { S(2) })
    local cb = dist.count_collectives(function() (y * dg):sum():backward() end)
    assert.same(c({ all_reduce = 2 }), cb) -- one for the weight, one for the bias
    assert.same({ Rep() }, dw.grad.placements)
    assert.same({ Rep() }, db.grad.placements)
    assert.same({ S(2) }, dx.grad.placements)
    -- against one process
    local rx, rw, rb = x:clone(), w:clone(), b:clone()
    rx.requires_grad = true; rw.requires_grad = true; rb.requires_grad = true
    local ry = F.layer_norm(rx, { 6 }, rw, rb)
    ;(ry * g):sum():backward()
    assert.is_true(diff(y:full_tensor(), ry) < 1e-12)
    assert.is_true(diff(dw.grad:to_local(), rw.grad) < 1e-12)
    assert.is_true(diff(db.grad:to_local(), rb.grad) < 1e-12)
    assert.is_true(diff(dx.grad:full_tensor(), rx.grad) < 1e-12)
  end)

  it("errors name the op and the layouts", function()
    local x = dist.distribute_tensor(randn(4, 6), mesh1, { S(1) })
    local ok, err = pcall(F.layer_norm, x, { 5 }, nil, nil)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("layer_norm", 1, true))
    local ok2, err2 = pcall(F.layer_norm, x, { 6 }, randn(6), nil)
    assert.is_false(ok2)
    assert.truthy(tostring(err2):find("mixed DTensor and Tensor", 1, true))
  end)
end)

describe("sharding: dropout", function()
  -- two dropouts after one seed: the second mask depends on how far the first advanced the generator
  local function drop2(a)
    engine.manual_seed(77)
    return F.dropout(F.dropout(a, 0.3), 0.5) * 1.5
  end
  for _, sz in ipairs({ { 4, 6 }, { 5, 3 }, { 3, 5, 2 } }) do
    it("same mask as one process for every layout, forward and backward [" .. table.concat(sz, ",") .. "]", function()
      engine.manual_seed(51)
      local x = engine.randn(sz, { dtype = "f64" })
      conv.check("dropout", drop2, { x })
    end)
  end
  it("the full result is the single-process dropout; later random calls agree", function()
    engine.manual_seed(52)
    local x = randn(7, 5)
    engine.manual_seed(9)
    local ref = F.dropout(x, 0.4)
    local ref_next = engine.rand({ 3 }, { dtype = "f64" })
    local zeros = ref:eq(0):double():sum():item()
    assert.is_true(zeros > 0 and zeros < 35) -- the mask is not trivial
    for _, mesh in ipairs(conv.meshes()) do
      for _, pl in ipairs(conv.placement_lists(2, mesh:ndim())) do
        local d = dist.distribute_tensor(x, mesh, pl)
        engine.manual_seed(9)
        local y = F.dropout(d, 0.4)
        local nxt = engine.rand({ 3 }, { dtype = "f64" })
        assert.same(pl, y.placements)
        assert.is_true(diff(y:full_tensor(), ref) == 0)
        assert.is_true(diff(nxt, ref_next) == 0)
      end
    end
  end)
  it("Partial input is reduced first; p = 0 and eval mode return the input", function()
    engine.manual_seed(53)
    local x = randn(4, 4)
    local p = dist.DTensor.from_local(x / W, mesh1, { Part() })
    engine.manual_seed(3)
    local y = F.dropout(p, 0.5)
    engine.manual_seed(3)
    local ref = F.dropout(x, 0.5)
    assert.same({ Rep() }, y.placements)
    assert.is_true(diff(y:full_tensor(), ref) < 1e-12)
    local d = dist.distribute_tensor(x, mesh1, { S(1) })
    assert.equal(d, F.dropout(d, 0))
    assert.equal(d, F.dropout(d, 0.5, false))
  end)
end)

describe("sharding: scaled_dot_product_attention", function()
  -- every placement list applied to q, k and v alike (and to the mask), plus mixed cases
  local function check_same(name, fn, inputs, nd)
    for _, mesh in ipairs(conv.meshes()) do
      local which = mesh:ndim() == 1 and "1d" or "2d"
      for _, pl in ipairs(conv.placement_lists(nd, mesh:ndim())) do
        conv.check(name, fn, inputs, { meshes = which, choices = function(i, t)
          if t:dim() == nd then return { pl } end
          local r = {}
          for k = 1, mesh:ndim() do r[k] = Rep() end
          return { r }
        end })
      end
    end
  end
  for _, sz in ipairs({ { 2, 4, 4, 2 }, { 3, 5, 3, 2 } }) do
    local B, H, T, D = sz[1], sz[2], sz[3], sz[4]
    local tag = string.format("[%d,%d,%d,%d]", B, H, T, D)
    it("plain and causal, same layout on q, k, v " .. tag, function()
      engine.manual_seed(61)
      local q, k, v = randn(B, H, T, D), randn(B, H, T, D), randn(B, H, T, D)
      check_same("sdpa", function(a, b, cc) return F.scaled_dot_product_attention(a, b, cc) end, { q, k, v }, 4)
      check_same("sdpa causal", function(a, b, cc)
        return F.scaled_dot_product_attention(a, b, cc, nil, 0, true)
      end, { q, k, v }, 4)
    end)
    it("dropout inside attention draws the single-process mask " .. tag, function()
      engine.manual_seed(62)
      local q, k, v = randn(B, H, T, D), randn(B, H, T, D), randn(B, H, T, D)
      check_same("sdpa dropout", function(a, b, cc)
        engine.manual_seed(5)
        local o = F.scaled_dot_product_attention(a, b, cc, { dropout_p = 0.4, is_causal = true })
        return F.dropout(o, 0.2) -- the generator advanced by the global count
      end, { q, k, v }, 4)
    end)
  end
  it("the math path (sdpa_kernel \"math\", CUDA's route for masks and dropout): dropout draws the single-process "
    .. "mask in every layout", function()
    engine.manual_seed(64)
    local q, k, v = randn(3, 5, 3, 2), randn(3, 5, 3, 2), randn(3, 5, 3, 2)
    check_same("sdpa math dropout", function(a, b, cc)
      return engine.nn.attention.sdpa_kernel("math", function()
        engine.manual_seed(5)
        local o = F.scaled_dot_product_attention(a, b, cc, { dropout_p = 0.4, is_causal = true })
        return F.dropout(o, 0.2)
      end)
    end, { q, k, v }, 4)
  end)
  it("mixed layouts and a float mask sharded with the batch", function()
    engine.manual_seed(63)
    local q, k, v = randn(2, 4, 3, 2), randn(2, 4, 5, 2), randn(2, 4, 5, 3)
    local m = randn(2, 1, 3, 5)
    local n = conv.check("sdpa mixed", function(a, b, cc, mm)
      return F.scaled_dot_product_attention(a, b, cc, { attn_mask = mm })
    end, { q, k, v, m }, {
      meshes = "1d",
      choices = function(i, t)
        if i == 4 then return { { Rep() }, { S(1) } } end
        return { { Rep() }, { S(1) }, { S(2) }, { S(3) } }
      end,
    })
    assert.is_true(n > 100)
    -- B sharded on q, k, v: output Shard(1), no collective
    local dq = dist.distribute_tensor(randn(4, 2, 3, 2), mesh1, { S(2) })
    local dk = dist.distribute_tensor(randn(4, 2, 3, 2), mesh1, { S(2) })
    local dv = dist.distribute_tensor(randn(4, 2, 3, 2), mesh1, { S(2) })
    local cnt, o = dist.count_collectives(function() return F.scaled_dot_product_attention(dq, dk, dv) end)
    assert.same({}, cnt)
    assert.same({ S(2) }, o.placements)
    -- T sharded: replicated first
    local tq = dist.distribute_tensor(randn(2, 2, 4, 2), mesh1, { S(3) })
    local tk = dist.distribute_tensor(randn(2, 2, 4, 2), mesh1, { Rep() })
    local o2 = F.scaled_dot_product_attention(tq, tk, tk)
    assert.same({ Rep() }, o2.placements)
  end)
end)

describe("sharding: ranks outside the mesh", function()
  it("get empty outputs and advance the generator like the members", function()
    if W < 4 then pending("needs 4 ranks") return end
    local R = dist.rank()
    local sub = dist.init_device_mesh("cpu", { 2 }, nil, { ranks = { 0, 1 } })
    engine.manual_seed(81)
    local x, w = randn(3, 4, 5), randn(5)
    local q = randn(2, 3, 4, 2)
    engine.manual_seed(10)
    local rd = F.dropout(x, 0.5)
    local ra = F.scaled_dot_product_attention(q, q, q, { dropout_p = 0.3 })
    local rnext = engine.rand({ 4 }, { dtype = "f64" })
    local d = dist.distribute_tensor(x, sub, { S(2) }, { src_data_rank = false })
    local dq = dist.distribute_tensor(q, sub, { S(2) }, { src_data_rank = false })
    local dw = dist.distribute_tensor(w, sub, { Rep() }, { src_data_rank = false })
    engine.manual_seed(10)
    local y1 = F.dropout(d, 0.5)
    local y2 = F.scaled_dot_product_attention(dq, dq, dq, { dropout_p = 0.3 })
    local nxt = engine.rand({ 4 }, { dtype = "f64" })
    local y3 = F.layer_norm(d, { 5 }, dw, nil)
    local y4 = d:softmax(3)
    assert.is_true(diff(nxt, rnext) == 0)
    if R < 2 then
      assert.is_true(diff(y1:full_tensor(), rd) == 0)
      assert.is_true(diff(y2:full_tensor(), ra) < 1e-12)
      assert.is_true(diff(y3:full_tensor(), F.layer_norm(x, { 5 }, w, nil)) < 1e-12)
      assert.is_true(diff(y4:full_tensor(), x:softmax(3)) < 1e-12)
    else
      for _, y in ipairs({ y1, y2, y3, y4 }) do
        assert.equal(0, y:to_local():numel())
        assert.equal(y.placements and #y:shape() or 0, y:to_local():dim())
      end
    end
  end)
end)
