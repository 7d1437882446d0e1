-- DTensor layouts of the matmul family, indexing and shape
-- ops, losses and activations): every input placement (for ops of several inputs the
-- bounded cover of spec/dist/helpers/converter.lua that shards every input)
-- on a 1-D mesh of the world and (4 ranks) a 2x2 mesh gives the single-process
-- result, forward and backward (spec/dist/helpers/converter.lua).  gather, scatter,
-- scatter_add, index_add and index_copy run on their rules (sharding/index.c),
-- softplus / leaky_relu / elu / hardtanh on the pointwise unary rule, the losses
-- on the rules of sharding/loss.c; the others are composites of ops with rules; nonzero / masked_select (data-dependent
-- sizes) come back Replicate.
local engine = require("engine")
local dist = engine.distributed
local conv = require("spec.dist.helpers.converter")

local function randn(...) return engine.randn({ ... }, { dtype = "f64" }) end
-- several inputs: the bounded cover of conv.cover_cases (every input sharded, alike
-- and in pairs), not the first cases of the odometer
local COVER = { cover = true, partial = true }

describe("sharding: gather / scatter / index_add / index_copy", function()
  it("gather along either dim; uneven sizes", function()
    engine.manual_seed(1)
    local x = randn(4, 3)
    conv.check("gather dim 2", function(a, i) return a:gather(2, i) end, { x, engine.tensor({ { 2, 0 }, { 1, 1 }, { 0, 2 }, { 2, 2 } }) })
    conv.check("gather dim 1", function(a, i) return a:gather(1, i) end, { x, engine.tensor({ { 3, 0, 1 }, { 1, 2, 0 } }) })
    conv.check("gather same shape", function(a, i) return a:gather(2, i) end, { randn(5, 3), engine.tensor({ { 0, 1, 2 }, { 2, 1, 0 }, { 1, 1, 1 }, { 0, 0, 0 }, { 2, 2, 2 } }) })
  end)
  it("scatter / scatter_add / index_add / index_copy", function()
    engine.manual_seed(2)
    local x = randn(4, 3)
    local idx = engine.tensor({ { 2, 0 }, { 1, 1 }, { 0, 2 }, { 2, 2 } })
    local src = randn(4, 2)
    conv.check("scatter", function(a, i, s) return a:scatter(2, i, s) end, { x, engine.tensor({ { 2, 0 }, { 1, 2 }, { 0, 1 }, { 1, 0 } }), src }, COVER)
    conv.check("scatter_add", function(a, i, s) return a:scatter_add(2, i, s) end, { x, idx, src }, COVER)
    conv.check("scatter_add full shape", function(a, i, s) return a:scatter_add(1, i, s) end,
      { x, engine.tensor({ { 0, 1, 2 }, { 3, 3, 3 }, { 0, 0, 1 }, { 2, 1, 0 } }), randn(4, 3) }, COVER)
    conv.check("index_add", function(a, i, s) return a:index_add(1, i, s, { alpha = 0.5 }) end,
      { x, engine.tensor({ 3, 0, 3 }), randn(3, 3) }, COVER)
    conv.check("index_add dim 2", function(a, i, s) return a:index_add(2, i, s) end, { x, engine.tensor({ 1, 1 }), randn(4, 2) }, COVER)
    conv.check("index_copy", function(a, i, s) return a:index_copy(1, i, s) end, { x, engine.tensor({ 2, 0 }), randn(2, 3) }, COVER)
  end)
  it("in-place forms keep the target's layout", function()
    local mesh = conv.meshes("1d")[1]
    engine.manual_seed(3)
    local full, src = randn(4, 3), randn(4, 2)
    local idx = engine.tensor({ { 2, 0 }, { 1, 1 }, { 0, 2 }, { 2, 2 } })
    local ref = full:clone():scatter_add_(2, idx, src)
    local x = dist.distribute_tensor(full, mesh, { dist.Shard(1) })
    local r = x:scatter_add_(2, dist.distribute_tensor(idx, mesh, { dist.Replicate() }), dist.distribute_tensor(src, mesh, { dist.Replicate() }))
    assert.are.equal(x, r)
    assert.are.equal("Shard(1)", tostring(x.placements[1]))
    assert.is_true((x:full_tensor() - ref):abs():max():item() < 1e-12)
    local y = dist.distribute_tensor(full, mesh, { dist.Shard(2) })
    y:index_copy_(1, dist.distribute_tensor(engine.tensor({ 3 }), mesh, { dist.Replicate() }),
      dist.distribute_tensor(engine.ones(1, 3, { dtype = "f64" }), mesh, { dist.Replicate() }))
    assert.are.same({ 1, 1, 1 }, y:full_tensor()[4]:totable())
  end)
  it("Partial inputs: gather / scatter / scatter_add / index_add / index_copy equal one process, layouts", function()
    local mesh = conv.meshes("1d")[1]
    local W, r = dist.world_size(), dist.get_rank()
    local P, Rep = dist.Partial, dist.Replicate
    -- a Partial of t split unevenly over the ranks (weights 1 : 2 : ... : W); max/min: t on the last rank,
    -- below (max) or above (min) elsewhere
    local function part(t, op)
      op = op or "sum"
      local l
      if op == "sum" then l = t * ((r + 1) * 2 / (W * (W + 1)))
      elseif op == "avg" then l = t * ((r + 1) * 2 / (W + 1))
      else l = (r == W - 1) and t or (op == "max" and t - 1 or t + 1) end
      return dist.DTensor.from_local(l, mesh, { P(op) })
    end
    local function rep(t) return dist.distribute_tensor(t, mesh, { Rep() }) end
    local function same(d, ref, placement, what)
      local e = (d:full_tensor() - ref):abs():max():item()
      assert(e < 1e-12, string.format("%s: differs by %g (layout %s)", what, e, tostring(d.placements[1])))
      if placement then assert.are.equal(placement, tostring(d.placements[1]), what) end
    end
    engine.manual_seed(31)
    local x, s2, s3 = randn(4, 3), randn(4, 2), randn(2, 3)
    local gi = engine.tensor({ { 2, 0 }, { 1, 1 }, { 0, 2 }, { 2, 2 } })
    local si = engine.tensor({ { 2, 0 }, { 1, 2 }, { 0, 1 }, { 1, 0 } })
    local ii = engine.tensor({ 3, 1 })
    -- gather is linear in x: a Partial(sum/avg) x stays Partial, no communication; max is reduced first
    same(part(x):gather(2, rep(gi)), x:gather(2, gi), "Partial(sum)", "gather P(sum)")
    same(part(x, "avg"):gather(2, rep(gi)), x:gather(2, gi), "Partial(avg)", "gather P(avg)")
    same(part(x, "max"):gather(2, rep(gi)), x:gather(2, gi), "Replicate()", "gather P(max)")
    -- scatter / scatter_add / index_add / index_copy: linear in (x, src) for a fixed index, so Partial when
    -- both are Partial (a Replicate one is split into a Partial of the same op first); a Partial(max) is reduced
    for _, op in ipairs({ "sum", "avg" }) do
      local want = "Partial(" .. op .. ")"
      local refs = {
        { "scatter", function(a, b) return a:scatter(2, rep(si), b) end, x:scatter(2, si, s2), s2 },
        { "scatter_add", function(a, b) return a:scatter_add(2, rep(gi), b) end, x:scatter_add(2, gi, s2), s2 },
        { "index_add", function(a, b) return a:index_add(1, rep(ii), b, { alpha = 0.5 }) end,
          x:index_add(1, ii, s3, { alpha = 0.5 }), s3 },
        { "index_copy", function(a, b) return a:index_copy(1, rep(ii), b) end, x:index_copy(1, ii, s3), s3 },
      }
      for _, c in ipairs(refs) do
        local name, f, ref, src = c[1], c[2], c[3], c[4]
        same(f(part(x, op), part(src, op)), ref, want, name .. " x P src P " .. op)
        same(f(part(x, op), rep(src)), ref, want, name .. " x P src R " .. op)
        same(f(rep(x), part(src, op)), ref, want, name .. " x R src P " .. op)
      end
    end
    same(part(x, "max"):scatter(2, rep(si), rep(s2)), x:scatter(2, si, s2), "Replicate()", "scatter x P(max)")
    same(rep(x):scatter_add(2, rep(gi), part(s2, "min")), x:scatter_add(2, gi, s2), "Replicate()", "scatter_add src P(min)")
    -- Partials of different ops: both reduced
    same(part(x, "sum"):index_add(1, rep(ii), part(s3, "avg")), x:index_add(1, ii, s3), "Replicate()", "index_add P(sum) P(avg)")
    -- a Shard target beside a Partial src (dim other than the indexed one): sharded rows, src reduced
    local xs = dist.distribute_tensor(x, mesh, { dist.Shard(1) })
    same(xs:scatter_add(2, rep(gi), part(s2)), x:scatter_add(2, gi, s2), nil, "scatter_add x S(1) src P")
  end)
  it("an index out of range on one layout fails every rank naming it", function()
    local x = dist.distribute_tensor(randn(4, 3), conv.meshes("1d")[1], { dist.Shard(1) })
    local i = dist.distribute_tensor(engine.tensor({ { 0 }, { 1 }, { 2 }, { 5 } }), conv.meshes("1d")[1], { dist.Shard(1) })
    local ok, e = pcall(function() return x:gather(2, i) end)
    assert.is_false(ok)
    assert.is_truthy(tostring(e):find("gather", 1, true), tostring(e))
    assert.is_truthy(tostring(e):find("index 5", 1, true), tostring(e))
  end)
end)

describe("sharding: composite indexing and shape ops", function()
  it("triu / tril / repeat / repeat_interleave / roll / flip / movedim / unflatten / unbind", function()
    engine.manual_seed(3)
    local x = randn(4, 6)
    conv.check("triu", function(a) return a:triu(1) end, { x })
    conv.check("tril", function(a) return a:tril(-1) end, { randn(2, 3, 3) })
    conv.check("repeat", function(a) return a:repeat_tensor(2, 1, 2) end, { x })
    conv.check("repeat_interleave", function(a) return a:repeat_interleave(2, 2) end, { x })
    conv.check("repeat_interleave tensor", function(a) return a:repeat_interleave(engine.tensor({ 1, 0, 2, 1 }), 1) end, { x })
    conv.check("roll", function(a) return a:roll({ 1, -2 }, { 1, 2 }) end, { x })
    conv.check("flip", function(a) return a:flip(1, 2) end, { x })
    conv.check("movedim", function(a) return a:movedim(1, 3) end, { randn(2, 3, 4) })
    conv.check("unflatten", function(a) return a:unflatten(2, { 2, 3 }) end, { x })
    conv.check("unbind", function(a) local u = a:unbind(2); return u[2] * u[5] end, { x })
    conv.check("one_hot", function(a) return engine.one_hot(a, 4) end, { engine.tensor({ { 0, 3 }, { 2, 1 } }) }, { grad = false })
  end)
  it("nonzero and masked_select come back Replicate", function()
    engine.manual_seed(4)
    local x = randn(4, 3)
    conv.check("masked_select", function(a) return a:masked_select(a:gt(0)) end, { x })
    conv.check("nonzero", function(a) return engine.nonzero(a:gt(0)) end, { x }, { grad = false })
  end)
  it("Torch7 indexing of a replicated DTensor", function()
    local d = dist.distribute_tensor(engine.arange(6, { dtype = "f64" }):view(2, 3), conv.meshes("1d")[1], { dist.Replicate() })
    assert.are.equal(4, d[2][2])
    assert.are.same({ 3, 4, 5 }, d[2]:full_tensor():totable())
  end)
end)

describe("sharding: matmul family", function()
  it("mm / bmm / addmm / baddbmm / outer", function()
    engine.manual_seed(5)
    conv.check("mm", engine.mm, { randn(4, 6), randn(6, 2) })
    conv.check("bmm", engine.bmm, { randn(2, 4, 3), randn(2, 3, 4) }, COVER)
    conv.check("addmm", function(c, a, b) return engine.addmm(c, a, b, { beta = 0.5, alpha = 2 }) end, { randn(4), randn(4, 6), randn(6, 4) }, COVER)
    conv.check("baddbmm", function(c, a, b) return engine.baddbmm(c, a, b) end, { randn(2, 4, 4), randn(2, 4, 3), randn(2, 3, 4) }, COVER)
    conv.check("outer", engine.outer, { randn(4), randn(6) })
  end)
  it("einsum transformer contractions", function()
    engine.manual_seed(6)
    conv.check("einsum bld,hd->blh", function(a, b) return engine.einsum("bld,hd->blh", a, b) end, { randn(2, 4, 4), randn(6, 4) }, COVER)
    conv.check("einsum bhqd,bhkd->bhqk", function(a, b) return engine.einsum("bhqd,bhkd->bhqk", a, b) end,
      { randn(2, 2, 4, 4), randn(2, 2, 4, 4) }, COVER)
    conv.check("einsum ij,jk->ki", function(a, b) return engine.einsum("ij,jk->ki", a, b) end, { randn(4, 2), randn(2, 4) })
  end)
end)

describe("sharding: losses and activations", function()
  -- nll_loss and the elementwise losses are fused C ops (engine/src/ops/loss_ext.c) on the rules of
  -- sharding/loss.c: batch-sharded nll_loss / elementwise inputs sharded alike give S (none) or
  -- Partial(sum) with the global divisor; the cover adds Partial inputs (replicated first)
  it("nll_loss / cross_entropy (weights, smoothing, ignore_index)", function()
    engine.manual_seed(7)
    local x = randn(4, 5)
    local t = engine.tensor({ 1, -100, 4, 0 })
    local w = engine.tensor({ 0.5, 1, 2, 1, 3 }, "f64")
    conv.check("nll_loss", function(a, tt) return engine.nll_loss(a:log_softmax(2), tt, { weight = w }) end, { x, t }, COVER)
    conv.check("nll_loss none", function(a, tt) return engine.nll_loss(a, tt, { reduction = "none" }) end, { x, t }, COVER)
    conv.check("nll_loss sum", function(a, tt) return engine.nll_loss(a, tt, { weight = w, reduction = "sum" }) end, { x, t }, COVER)
    conv.check("nll_loss mean, no weight", function(a, tt) return engine.nll_loss(a, tt) end, { x, t }, COVER)
    conv.check("nll_loss 3-d ignore 2", function(a, tt) return engine.nll_loss(a, tt, { weight = engine.tensor({ 1, 2, 0.5 }, "f64"), ignore_index = 2 }) end,
      { randn(4, 3, 2), engine.tensor({ { 0, 2 }, { 1, 1 }, { 2, 2 }, { 0, 1 } }) }, COVER)
    conv.check("cross_entropy weight smoothing", function(a, tt)
      return engine.cross_entropy(a, tt, { weight = w, label_smoothing = 0.1 }) end, { x, t }, COVER)
    conv.check("cross_entropy weight none", function(a, tt)
      return engine.cross_entropy(a, tt, { weight = w, reduction = "none" }) end, { x, t }, COVER)
    conv.check("cross_entropy 3-d weight smoothing sum", function(a, tt)
      return engine.cross_entropy(a, tt, { weight = engine.tensor({ 1, 2, 0.5 }, "f64"), label_smoothing = 0.2, reduction = "sum" }) end,
      { randn(4, 3, 2), engine.tensor({ { 0, 2 }, { 1, 1 }, { 2, -100 }, { 0, 1 } }) }, COVER)
    conv.check("cross_entropy probabilities", function(a, p) return engine.cross_entropy(a, p) end, { x, randn(4, 5):softmax(2) })
  end)
  it("bce / bce_with_logits / kl_div / smooth_l1 / huber", function()
    engine.manual_seed(8)
    local x, y = randn(4, 4), randn(4, 4)
    local pw = engine.tensor({ 1, 2, 0.5, 3 }, "f64")
    conv.check("binary_cross_entropy", function(a, b) return engine.binary_cross_entropy(a:sigmoid(), b:sigmoid()) end, { x, y }, COVER)
    conv.check("binary_cross_entropy weight none", function(a, b)
      return engine.binary_cross_entropy(a:sigmoid(), b:sigmoid(), { weight = pw, reduction = "none" }) end, { x, y }, COVER)
    conv.check("bce_with_logits", function(a, b)
      return engine.binary_cross_entropy_with_logits(a, b:sigmoid(), { pos_weight = pw }) end, { x, y }, COVER)
    conv.check("bce_with_logits weight sum", function(a, b)
      return engine.binary_cross_entropy_with_logits(a, b:sigmoid(), { weight = pw, reduction = "sum" }) end, { x, y }, COVER)
    conv.check("kl_div", function(a, b) return engine.kl_div(a:log_softmax(2), b:softmax(2), { reduction = "batchmean" }) end, { x, y }, COVER)
    conv.check("kl_div log_target none", function(a, b) return engine.kl_div(a, b, { log_target = true, reduction = "none" }) end, { x, y }, COVER)
    conv.check("kl_div mean", function(a, b) return engine.kl_div(a, b:softmax(1)) end, { x, y }, COVER)
    conv.check("smooth_l1_loss", function(a, b) return engine.smooth_l1_loss(a, b, { beta = 0.5 }) end, { x, y }, COVER)
    conv.check("huber_loss", function(a, b) return engine.huber_loss(a, b, { delta = 0.8, reduction = "none" }) end, { x, y }, COVER)
  end)
  it("range errors raise on every rank (agreed): binary_cross_entropy input, nll_loss target", function()
    local W = dist.get_world_size()
    local mesh = conv.meshes("1d")[1]
    local p = engine.full({ 2 * W }, 0.5, { dtype = "f64" })
    p[2 * W] = 1.5  -- on the last rank's shard only
    local dp = dist.distribute_tensor(p, mesh, { dist.Shard(1) })
    local dy = dist.distribute_tensor(engine.zeros(2 * W, { dtype = "f64" }), mesh, { dist.Shard(1) })
    local ok, e = pcall(engine.binary_cross_entropy, dp, dy)
    assert.is_false(ok)
    assert.matches("binary_cross_entropy", tostring(e))
    local t = engine.zeros(2 * W, { dtype = "i64" })
    t[2 * W] = 3
    local dx = dist.distribute_tensor(randn(2 * W, 3), mesh, { dist.Shard(1) })
    local dt = dist.distribute_tensor(t, mesh, { dist.Shard(1) })
    ok, e = pcall(engine.nll_loss, dx, dt)
    assert.is_false(ok)
    assert.matches("nll_loss", tostring(e))
    -- the group still works afterwards
    assert.are.equal(2 * W, dist.distribute_tensor(engine.ones(2 * W), mesh, { dist.Shard(1) }):sum():full_tensor():item())
  end)
  it("softplus / leaky_relu / elu / hardtanh / glu", function()
    engine.manual_seed(9)
    local x = randn(4, 6) * 3
    -- softplus / leaky_relu / elu / hardtanh are C unary ops on the pointwise rule: Partial inputs too
    conv.check("softplus", function(a) return engine.softplus(a, 2, 3) end, { x }, COVER)
    conv.check("leaky_relu", function(a) return engine.leaky_relu(a, 0.1) end, { x }, COVER)
    conv.check("elu", function(a) return engine.elu(a) end, { x }, COVER)
    conv.check("hardtanh", function(a) return engine.hardtanh(a, -0.5, 0.5) end, { x }, COVER)
    conv.check("relu6", function(a) return engine.relu6(a * 3) end, { x }, COVER)
    conv.check("glu", function(a) return engine.glu(a) end, { x })
  end)
end)
