-- Vocab-parallel cross entropy and the masked (row-sharded) embedding on the device: the local phases run as CUDA
-- kernels (kernels/cuda/vocab_parallel.cu, embedding.cu) and the three all_reduces on the device buffers (NCCL); the
-- CPU path is the reference: loss to 1e-5, logits / weight gradients to 1e-6, the same collective counts (forward
-- "all_reduce=3", backward none).  Cases: direct calls (f32/f64, every reduction, ignore_index, uneven and empty
-- slices), loss_parallel with a class weight and with the class dim not last (logits [N, C, d]), embedding_masked
-- (out-of-range rows zeroed, owned-row gradients, bf16, the negative-index error) and a row-sharded embedding on a
-- CUDA mesh.  Tagged "#gpu" (pending without a GPU; several ranks on one GPU need NCCL_HOSTID: tools/gpu-check.sh).
--   mpirun -np 2 ... build/engine /usr/bin/busted --ignore-lua -o tools/passfail_dist.lua --tags=gpu spec/dist/cuda_vocab_parallel_spec.lua
local engine = require("engine")
local F = engine.nn.functional
local dist = engine.distributed
local util = require("spec.dist.helpers.util")

local R, W = dist.rank(), dist.world_size()
local S = dist.Shard

local meshes = {}
local function mesh(dev)
  if not meshes[dev] then meshes[dev] = dist.init_device_mesh(dev, { W }) end
  return meshes[dev]
end
local function host(t) if dist.is_dtensor(t) then t = t:full_tensor() end return t:to("cpu") end
local function diff(a, b) return util.diff(host(a):double(), host(b):double()) end

local function data(shape, V, dtype, ignore)
  engine.manual_seed(1234)
  local full = (engine.randn(shape, { dtype = "f64" }) * 3):to(dtype)
  local tshape, n = {}, 1
  for i = 1, #shape - 1 do tshape[i] = shape[i]; n = n * shape[i] end
  local t = {}
  for i = 1, n do t[i] = ((i - 1) * 7 + 3) % V end
  if ignore then t[2] = ignore end
  return full, engine.tensor(t):view(tshape), engine.randn(tshape, { dtype = "f64" }):to(dtype)
end

-- this rank's loss and local logits gradient on device dev; forward and backward collective counts
local function direct(dev, shape, V, red, dtype, ignore)
  local full, tgt, g = data(shape, V, dtype, ignore)
  local nd = #shape
  local size, off = dist.local_shard_size_and_offset(V, W, R)
  local loc = full:narrow(nd, off + 1, size):clone():to(dev):requires_grad_()
  local opts = { vocab_offset = off, vocab_total = V, group = mesh(dev):get_group(), reduction = red,
    ignore_index = ignore }
  local fc, loss = util.counted(function()
    return dist.cross_entropy_vocab_parallel(loc, tgt:to(dev), opts)
  end)
  local bc = util.counted(function()
    if red == "none" then (loss * g:to(dev)):sum():backward() else loss:backward() end
  end)
  return loss, loc.grad, fc, bc
end

describe("vocab-parallel cross entropy on CUDA #gpu", function()
  it("direct calls: the device kernels and NCCL give the CPU path's loss and gradient, 3 all_reduces", function()
    util.need_cuda_ranks(pending)
    for _, V in ipairs({ 13, 5, 4 * W }) do
      for _, red in ipairs({ "mean", "sum", "none" }) do
        for _, dtype in ipairs({ "f32", "f64" }) do
          for _, ign in ipairs({ -100, 3 }) do
            local what = string.format("V %d %s %s ignore %d", V, red, dtype, ign)
            local lc, gc, fcc, bcc = direct("cpu", { 7, V }, V, red, dtype, ign)
            local lg, gg, fcg, bcg = direct("cuda", { 7, V }, V, red, dtype, ign)
            assert.are.equal("cuda", lg.device, what)
            assert.are.equal("cuda", gg.device, what)
            assert(diff(lc, lg) < 1e-5 * math.max(1, host(lc):abs():max():item()), what .. ": loss " .. diff(lc, lg))
            assert(diff(gc, gg) < 1e-6, what .. ": grad " .. diff(gc, gg))
            assert.are.equal(fcc, fcg, what)
            assert.are.equal("all_reduce=3", fcg, what)
            assert.are.equal("", bcg, what)
          end
        end
      end
    end
    -- a 3-D batch (B, T, V)
    local lc, gc = direct("cpu", { 2, 3, 13 }, 13, "mean", "f32", -100)
    local lg, gg = direct("cuda", { 2, 3, 13 }, 13, "mean", "f32", -100)
    assert(diff(lc, lg) < 1e-5 and diff(gc, gg) < 1e-6)
  end)

  it("errors agree on every rank (a target out of range), with no host copy needed on success", function()
    util.need_cuda_ranks(pending)
    local full = engine.randn(4, 8):cuda()
    local size, off = dist.local_shard_size_and_offset(8, W, R)
    local ok, e = pcall(dist.cross_entropy_vocab_parallel, full:narrow(2, off + 1, size):contiguous(),
      engine.tensor({ 1, 9, 2, 3 }, "i64"):cuda(), { vocab_offset = off, vocab_total = 8, group = mesh("cuda"):get_group() })
    assert.is_false(ok)
    assert.truthy(tostring(e):find("target 9 at flat position 2 is out of range", 1, true), tostring(e))
  end)

  local function weights(n) local t = {} for i = 1, n do t[i] = 0.25 + (i * 7 % 5) * 0.3 end return engine.tensor(t) end
  -- loss (scalar, or weighted sum for none) and the gathered logits gradient through loss_parallel on a mesh of dev
  local function through_loss_parallel(dev, logits, y, opts, class_dim)
    local o = {}
    for k, v in pairs(opts) do o[k] = v end
    if o.weight then o.weight = o.weight:to(dev) end
    local d = dist.distribute_tensor(logits:to(dev), mesh(dev), { S(class_dim) }):requires_grad_()
    local counts, loss = util.counted(function()
      return dist.loss_parallel(function() return F.cross_entropy(d, y:to(dev), o) end)
    end)
    local l = loss
    if loss:dim() > 0 then
      local sc = engine.arange(loss:numel()):float():view(unpack(loss:shape())):add(1)
      l = (loss * dist.distribute_tensor(sc:to(dev), mesh(dev), { dist.Replicate() })):sum()
    end
    local bcounts = util.counted(function() l:backward() end)
    return host(l):item(), d.grad:full_tensor(), counts, bcounts
  end

  for _, red in ipairs({ "mean", "sum", "none" }) do
    it("loss_parallel with a class weight, reduction " .. red .. ": CUDA mesh = CPU mesh", function()
      util.need_cuda_ranks(pending)
      engine.manual_seed(5)
      local logits = engine.randn(6, 12)
      local y = engine.tensor({ 0, 11, -100, 7, 3, 5 }, "i64")
      local opts = { weight = weights(12), reduction = red }
      local lc, gc, cc = through_loss_parallel("cpu", logits, y, opts, 2)
      local lg, gg, cg, bg = through_loss_parallel("cuda", logits, y, opts, 2)
      assert(math.abs(lc - lg) < 1e-5 * math.max(1, math.abs(lc)), lc .. " vs " .. lg)
      assert(diff(gc, gg) < 1e-6 * math.max(1, host(gc):abs():max():item()), "grad " .. diff(gc, gg))
      assert.are.equal(cc, cg)
      assert.are.equal("all_reduce=3", cg)
      assert.are.equal("", bg)
    end)
  end

  it("loss_parallel with the class dim not last ([N, C, d] sharded on C), with and without a weight", function()
    util.need_cuda_ranks(pending)
    engine.manual_seed(8)
    local logits = engine.randn(3, 12, 4)
    local y = engine.tensor({ { 0, 11, 5, 7 }, { 2, 3, -100, 9 }, { 10, 1, 6, 4 } }, "i64")
    for _, red in ipairs({ "mean", "none" }) do
      for _, w in ipairs({ false, true }) do
        local opts = { reduction = red, weight = w and weights(12) or nil }
        local lc, gc = through_loss_parallel("cpu", logits, y, opts, 2)
        local lg, gg, cg = through_loss_parallel("cuda", logits, y, opts, 2)
        assert(math.abs(lc - lg) < 1e-5 * math.max(1, math.abs(lc)), red .. tostring(w) .. ": " .. lc .. " vs " .. lg)
        assert(diff(gc, gg) < 1e-6 * math.max(1, host(gc):abs():max():item()), "grad " .. diff(gc, gg))
        assert.are.equal("all_reduce=3", cg)
      end
    end
  end)
end)

describe("masked embedding on CUDA #gpu", function()
  it("embedding_masked: owned rows gathered, others zero; gradient only into owned rows; = CPU", function()
    util.need_cuda_ranks(pending)
    engine.manual_seed(3)
    local idx = engine.tensor({ { 0, 3, 9, 4 }, { 5, 5, 2, 8 } }, "i64")
    for _, dtype in ipairs({ "f32", "f64", "bf16" }) do
      for _, off in ipairs({ 0, 3, 7, 12 }) do
        local wfull = engine.randn(4, 6):to(dtype)
        local wc = wfull:clone():requires_grad_()
        local wg = wfull:cuda():requires_grad_()
        local g = engine.randn(2, 4, 6):to(dtype)
        local oc = engine.embedding_masked(wc, idx, off)
        local og = engine.embedding_masked(wg, idx:cuda(), off)
        assert.are.equal("cuda", og.device)
        assert.are.equal(0, diff(oc, og), dtype .. " off " .. off)
        ;(oc * g):sum():backward()
        ;(og * g:cuda()):sum():backward()
        local tol = dtype == "bf16" and 1e-2 or 1e-6
        assert(diff(wc.grad, wg.grad) < tol, dtype .. " off " .. off .. ": grad " .. diff(wc.grad, wg.grad))
      end
    end
    local ok, e = pcall(engine.embedding_masked, engine.randn(4, 3):cuda(), engine.tensor({ 1, -2 }, "i64"):cuda(), 0)
    assert.is_false(ok)
    assert.truthy(tostring(e):find("index -2 at flat position 2", 1, true), tostring(e))
  end)

  it("a row-sharded embedding (weight Shard(1)) on a CUDA mesh equals the CPU mesh, forward and weight gradient", function()
    util.need_cuda_ranks(pending)
    engine.manual_seed(4)
    local w = engine.randn(11, 5)
    local idx = engine.tensor({ { 0, 10, 4 }, { 7, 7, 2 } }, "i64")
    local function run(dev)
      local dw = dist.distribute_tensor(w:to(dev), mesh(dev), { S(1) }):requires_grad_()
      local di = dist.distribute_tensor(idx:to(dev), mesh(dev), { dist.Replicate() })
      local out = F.embedding(di, dw)
      out:full_tensor():sum():backward()
      return out:full_tensor(), dw.grad:full_tensor()
    end
    local oc, gc = run("cpu")
    local og, gg = run("cuda")
    assert(diff(oc, og) < 1e-6 and diff(gc, gg) < 1e-6)
    local bad = dist.distribute_tensor(engine.tensor({ 1, 11 }, "i64"):cuda(), mesh("cuda"), { dist.Replicate() })
    local dw = dist.distribute_tensor(w:cuda(), mesh("cuda"), { S(1) })
    local ok, e = pcall(F.embedding, bad, dw)
    assert.is_false(ok)
    assert.truthy(tostring(e):find("index 11 out of range for weight of 11 rows", 1, true), tostring(e))
  end)
end)
