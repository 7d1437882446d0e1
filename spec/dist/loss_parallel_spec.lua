-- Vocab-parallel cross entropy (dist.cross_entropy_vocab_parallel, Megatron's
-- parallel cross entropy): every rank holds a torch.chunk slice of the class
-- (last) dim; loss and the gathered logits gradient must equal
-- engine.cross_entropy on the full logits, for even and uneven vocab splits
-- (V = 13 and 5 over 4 ranks: empty slices too), ignore_index and every
-- reduction; exactly 3 all_reduces forward and no collective backward.  Through loss_parallel (PyTorch's
-- usage): a plain target, a class weight, a class dim that is not the last, a 2-D mesh; [Partial, Shard(class)]
-- logits are refused with PyTorch's reason.
local engine = require("engine")
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local diff, errmsg = util.diff, util.errmsg

local R, W = dist.rank(), dist.world_size()
local S = dist.Shard


local mesh = dist.init_device_mesh("cpu", { W })
local group = mesh:get_group()

-- Same data on every rank (same seed); targets cover every rank's slice, plus ignored rows.
local function data(shape, V, dtype, ignore)
  engine.manual_seed(1234)
  local full = (engine.randn(shape, { dtype = "f64" }) * 3):to(dtype)
  local tshape = {}
  for i = 1, #shape - 1 do tshape[i] = shape[i] end
  local n = 1
  for i = 1, #tshape do n = n * tshape[i] end
  local t = {}
  for i = 1, n do t[i] = ((i - 1) * 7 + 3) % V end
  if ignore then t[2] = ignore; if n > 4 then t[n - 1] = ignore end end
  local tgt = engine.tensor(t):view(tshape)
  local g = engine.randn(tshape, { dtype = "f64" }):to(dtype)
  return full, tgt, g
end

-- Runs both paths; returns loss_vp, loss_ref, gathered grad, ref grad, forward counts, backward counts.
local function run(shape, V, red, dtype, ignore)
  local full, tgt, g = data(shape, V, dtype, ignore)
  local nd = #shape
  local size, off = dist.local_shard_size_and_offset(V, W, R)
  local loc = full:narrow(nd, off + 1, size):clone()
  loc.requires_grad = true
  local ref_in = full:clone()
  ref_in.requires_grad = true
  local opts = { vocab_offset = off, vocab_total = V, group = group, reduction = red, ignore_index = ignore }
  local fc, loss = dist.count_collectives(dist.cross_entropy_vocab_parallel, loc, tgt, opts)
  local flat_ref = nd == 2 and ref_in or ref_in:view(-1, V)
  local ref = engine.cross_entropy(flat_ref, tgt:view(-1), { reduction = red, ignore_index = ignore })
  if red == "none" then ref = ref:view(tgt:shape()) end
  local bc = dist.count_collectives(function()
    if red == "none" then (loss * g):sum():backward() else loss:backward() end
  end)
  if red == "none" then (ref * g):sum():backward() else ref:backward() end
  local stride, s = {}, 1
  for i = nd, 1, -1 do stride[i] = s; s = s * shape[i] end
  local gathered = dist.DTensor.from_local(loc.grad, mesh, { S(nd) }, { shape = shape, stride = stride }):full_tensor()
  return loss, ref, gathered, ref_in.grad, fc, bc
end

local function total(c) local n = 0 for _, v in pairs(c) do n = n + v end return n end

describe("cross_entropy_vocab_parallel", function()
  for _, V in ipairs({ 13, 5, 4 * W }) do
    for _, red in ipairs({ "mean", "sum", "none" }) do
      for _, ign in ipairs({ -100, 3 }) do
        it(string.format("[7, %d] f64, reduction %s, ignore_index %d: loss and grad equal cross_entropy", V, red, ign), function()
          local loss, ref, gathered, rg, fc, bc = run({ 7, V }, V, red, "f64", ign)
          assert.is_true(diff(loss, ref) < 1e-12, "loss differs: " .. diff(loss, ref))
          assert.is_true(diff(gathered, rg) < 1e-12, "grad differs: " .. diff(gathered, rg))
          if W > 1 then
            assert.are.same({ all_reduce = 3 }, fc)
          end
          assert.are.equal(0, total(bc))
        end)
      end
    end
  end

  it("[2, 3, 13] (batch, time, vocab) f32, reduction mean, uneven split", function()
    local loss, ref, gathered, rg = run({ 2, 3, 13 }, 13, "mean", "f32", -100)
    assert.is_true(diff(loss, ref) < 1e-5, "loss differs: " .. diff(loss, ref))
    assert.is_true(diff(gathered, rg) < 1e-6, "grad differs: " .. diff(gathered, rg))
  end)

  it("[2, 3, 13] f64, reduction none", function()
    local loss, ref, gathered, rg = run({ 2, 3, 13 }, 13, "none", "f64", 5)
    assert.are.same({ 2, 3 }, loss:shape())
    assert.is_true(diff(loss, ref) < 1e-12)
    assert.is_true(diff(gathered, rg) < 1e-12)
  end)

  it("all rows ignored: mean is NaN like cross_entropy, sum is 0", function()
    local size, off = dist.local_shard_size_and_offset(6, W, R)
    local x = engine.randn({ 3, 6 }, { dtype = "f64" }):narrow(2, off + 1, size):clone()
    local t = engine.tensor({ -100, -100, -100 })
    local m = dist.cross_entropy_vocab_parallel(x, t, { vocab_offset = off, vocab_total = 6, group = group })
    assert.is_true(m:item() ~= m:item())
    local s = dist.cross_entropy_vocab_parallel(x, t, { vocab_offset = off, vocab_total = 6, group = group,
      reduction = "sum" })
    assert.are.equal(0, s:item())
  end)

  it("every rank fails with the same error for a target out of range", function()
    local size, off = dist.local_shard_size_and_offset(6, W, R)
    local x = engine.randn({ 2, size }, { dtype = "f64" })
    local e = errmsg(dist.cross_entropy_vocab_parallel, x, engine.tensor({ 1, 6 }),
      { vocab_offset = off, vocab_total = 6, group = group })
    assert.is_truthy(e:find("target 6 at flat position 2 is out of range for 6 classes"), e)
  end)

  it("a wrong vocab slice on one rank fails on every rank", function()
    local size, off = dist.local_shard_size_and_offset(8, W, R)
    if R == W - 1 then off = off + 1 end
    local x = engine.randn({ 2, size }, { dtype = "f64" })
    local e = errmsg(dist.cross_entropy_vocab_parallel, x, engine.tensor({ 1, 2 }),
      { vocab_offset = off, vocab_total = 8, group = group })
    if W > 1 then
      assert.is_truthy(e:find("vocab slice") or e:find("another rank"), e)
    else
      assert.is_truthy(e:find("vocab slice"), e)
    end
  end)

  it("local vocab sizes that do not add up to vocab_total fail on every rank", function()
    local x = engine.randn({ 2, 2 }, { dtype = "f64" })
    local e = errmsg(dist.cross_entropy_vocab_parallel, x, engine.tensor({ 0, 1 }),
      { vocab_offset = 0, vocab_total = 2 * W + 1, group = group })
    if W == 1 then
      assert.is_truthy(e:find("add up to 2, not vocab_total = 3"), e)
    else
      assert.is_truthy(e:find("vocab slice") or e:find("another rank") or e:find("add up to"), e)
    end
  end)

  it("a DTensor argument outside local mode is an error", function()
    local d = dist.distribute_tensor(engine.randn({ 2, 4 * W }, { dtype = "f64" }), mesh, { S(2) })
    local e = errmsg(dist.cross_entropy_vocab_parallel, d, engine.tensor({ 0, 1 }),
      { vocab_offset = 0, vocab_total = 4 * W, group = group })
    assert.is_truthy(e:find("cross_entropy_vocab_parallel: takes this rank's local logits"), e)
  end)
end)

describe("loss_parallel as PyTorch code uses it", function()
  local F = engine.nn.functional
  local function ref_case()
    engine.manual_seed(7)
    local logits = engine.randn(6, 12)
    local y = engine.tensor({ 0, 3, 5, 7, 11, 2 }, "i64")
    local l = logits:clone():requires_grad_()
    local lr = F.cross_entropy(l, y)
    lr:backward()
    return logits, y, lr:item(), l.grad
  end

  it("class-sharded DTensor logits with a plain target: vocab parallel (3 all_reduces), the reference loss and grad",
    function()
      local logits, y, want, gwant = ref_case()
      local d = dist.distribute_tensor(logits, mesh, { S(2) }):requires_grad_()
      local counts, loss = util.counted(function()
        local l = dist.loss_parallel(function() return F.cross_entropy(d, y) end)
        l:backward()
        return l
      end)
      assert.is_true(math.abs(loss:full_tensor():item() - want) < 1e-5)
      assert.is_true(diff(d.grad:full_tensor(), gwant) < 1e-6)
      assert.are.equal("all_reduce=3", counts) -- the three of the vocab-parallel path, no all_gather of the logits
    end)

  it("[Partial, Shard(class)] logits fail on every rank with PyTorch's reason (Shard or Replicate only)", function()
    local logits, y = ref_case()
    local m2 = dist.init_device_mesh("cpu", { 1, W })
    local loc = dist.distribute_tensor(logits, m2, { dist.Replicate(), S(2) }):to_local()
    local p = dist.DTensor.from_local(loc, m2, { dist.Partial(), S(2) })
    local counts, e = util.counted(function()
      return errmsg(dist.loss_parallel, function() return F.cross_entropy(p, y) end)
    end)
    assert.is_truthy(e:find("accepts only Shard or Replicate on the other mesh dims, got Partial(sum) on mesh dim 1",
      1, true), e)
    assert.is_falsy(e:find("two mesh dims", 1, true), e)
    assert.are.equal("", counts) -- before any communication
    -- the weighted form says the same
    e = errmsg(dist.loss_parallel, function() return F.cross_entropy(p, y, { weight = engine.ones(12) }) end)
    assert.is_truthy(e:find("accepts only Shard or Replicate", 1, true), e)
  end)

  -- one process's loss and logits gradient for logits of shape `shape` (class dim 2 when 2+ dims), targets and
  -- options (a weight as a plain tensor)
  local function reference(logits, y, opts)
    local l = logits:clone():requires_grad_()
    local lr = F.cross_entropy(l, y, opts)
    if lr:dim() > 0 then lr = (lr * engine.arange(lr:numel()):float():view(unpack(lr:shape())):add(1)):sum() end
    lr:backward()
    return lr:item(), l.grad
  end
  local function parallel(logits, y, opts, class_dim)
    local d = dist.distribute_tensor(logits, mesh, { S(class_dim) }):requires_grad_()
    local counts, loss = util.counted(function()
      return dist.loss_parallel(function() return F.cross_entropy(d, y, opts) end)
    end)
    local sc = nil
    if loss:dim() > 0 then
      sc = dist.distribute_tensor(engine.arange(loss:numel()):float():view(unpack(loss:shape())):add(1), mesh,
        { dist.Replicate() })
    end
    local bcounts = util.counted(function()
      local l = loss
      if sc then l = (l * sc):sum() end
      l:backward()
    end)
    local v = loss:full_tensor()
    if v:dim() > 0 then v = (v * engine.arange(v:numel()):float():view(unpack(v:shape())):add(1)):sum() end
    return v:item(), d.grad:full_tensor(), counts, bcounts
  end

  local function weights(n) local t = {} for i = 1, n do t[i] = 0.25 + (i * 7 % 5) * 0.3 end return engine.tensor(t) end

  for _, red in ipairs({ "mean", "sum", "none" }) do
    it("a class weight (plain tensor), reduction " .. red .. ": vocab parallel (3 all_reduces), one process's loss and "
      .. "gradient", function()
      local logits, y = ref_case()
      local y2 = y:clone(); y2[3] = -100  -- an ignored row too
      local opts = { weight = weights(12), reduction = red }
      for _, t in ipairs({ y, y2 }) do
        local want, gwant = reference(logits, t, opts)
        local got, g, counts, bcounts = parallel(logits, t, opts, 2)
        assert.is_true(math.abs(got - want) < 1e-5 * math.max(1, math.abs(want)), got .. " vs " .. want)
        local gmax = math.max(1, gwant:abs():max():item())  -- f32, upstream gradients up to 12 for "none"
        assert.is_true(diff(g, gwant) < 1e-6 * gmax, "grad differs: " .. diff(g, gwant))
        assert.are.equal("all_reduce=3", counts) -- no all_gather of the logits
        assert.are.equal("", bcounts)
      end
    end)
  end

  for _, red in ipairs({ "mean", "none" }) do
    it("logits [N, C, d] sharded on the class dim 2 (not last), reduction " .. red .. ", with and without a weight: "
      .. "vocab parallel, one process's loss and gradient", function()
      engine.manual_seed(8)
      local logits = engine.randn(3, 12, 4)
      local y = engine.tensor({ { 0, 11, 5, 7 }, { 2, 3, -100, 9 }, { 10, 1, 6, 4 } }, "i64")
      for _, w in ipairs({ false, true }) do
        local opts = { reduction = red, weight = w and weights(12) or nil }
        local want, gwant = reference(logits, y, opts)
        local got, g, counts, bcounts = parallel(logits, y, opts, 2)
        assert.is_true(math.abs(got - want) < 1e-5 * math.max(1, math.abs(want)), got .. " vs " .. want)
        local gmax = math.max(1, gwant:abs():max():item())  -- f32, upstream gradients up to 12 for "none"
        assert.is_true(diff(g, gwant) < 1e-6 * gmax, "grad differs: " .. diff(g, gwant))
        assert.are.equal("all_reduce=3", counts)
        assert.are.equal("", bcounts)
      end
    end)
  end

  it("2-D mesh [Shard(batch), Shard(class)] with a weight, mean: equal to one process; class group 3 all_reduces, "
    .. "the batch group the divisor's", function()
    if W ~= 4 then return end
    local m2 = dist.init_device_mesh("cpu", { 2, 2 }, { "dp", "tp" })
    local logits, y = ref_case()
    local opts = { weight = weights(12) }
    local want, gwant = reference(logits, y, opts)
    local d = dist.distribute_tensor(logits, m2, { S(1), S(2) }):requires_grad_()
    local yd = dist.distribute_tensor(y, m2, { S(1), dist.Replicate() })
    local wd = dist.distribute_tensor(opts.weight, m2, { dist.Replicate(), dist.Replicate() })
    local loss = F.cross_entropy(d, yd, { weight = wd })
    loss:backward()
    local got = loss:full_tensor():item()
    assert.is_true(math.abs(got - want) < 1e-5, got .. " vs " .. want)
    assert.is_true(diff(d.grad:full_tensor(), gwant) < 1e-6)
    local kinds = {}
    local l0 = dist.dump_collectives()
    local last = l0[#l0].id
    local c = dist.count_collectives(function() F.cross_entropy(d, yd, { weight = wd }) end)
    for _, e in ipairs(dist.dump_collectives()) do
      if e.id > last and e.kind ~= "barrier" then
        local k = e.kind .. " " .. (e.group:match("^(%a+):") or e.group)
        kinds[k] = (kinds[k] or 0) + 1
      end
    end
    assert.is_nil(c.all_gather, "no all_gather of the logits")
    assert.are.equal(3, kinds["all_reduce tp"])
  end)
end)
