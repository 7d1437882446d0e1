-- FSDP (FSDP2's fully_shard): layout equivalence with one process on the global batch
-- (losses, gradients and parameters over AdamW steps) for every reshard_after_forward, HSDP, activation
-- checkpointing, a module used twice, explicit prefetch, gradient accumulation and mixed precision;
-- collective counts per step; the registered parameters' states; state dicts; clip_grad_norm; errors.
local engine = require("engine")
local ffi = require("ffi")
local nn = engine.nn
local F = nn.functional
local dist = engine.distributed
local models = require("engine.models")
local util = require("spec.dist.helpers.util")
local errmsg = util.errmsg

local W, rank = dist.world_size(), dist.rank()
local mesh = dist.init_device_mesh("cpu", { W })

local function full(t) if dist.is_dtensor(t) then return t:full_tensor() end return t end
local function rel(a, b)
  a, b = full(a):to("f64"), full(b):to("f64")
  return (a - b):abs():max():item() / math.max(1e-6, b:abs():max():item())
end

local function counted(fn)
  local c, r = dist.count_collectives(fn)
  return c, r
end
local function cnt(c, k) return c[k] or 0 end
-- FSDP's own all-gathers / reduce-scatters: none at 1 rank, where the shard group is one rank and nothing moves
-- (PyTorch's (world_size, 1) meshes)
local function moved(k) return W > 1 and k or 0 end
local function moved_list(t) return W > 1 and t or {} end

-- the collectives fn issued on this rank (dist.dump_collectives' records: kind, dtype, shape), then fn's results
local function logged(fn)
  local before = dist.dump_collectives()
  local last = #before > 0 and before[#before].id or -1
  local out = { fn() }
  local recs = {}
  for _, e in ipairs(dist.dump_collectives()) do if e.id > last then recs[#recs + 1] = e end end
  return recs, unpack(out)
end
local function dtypes_of(recs, kind)
  local r = {}
  for _, e in ipairs(recs) do if e.kind == kind then r[#r + 1] = e.dtype end end
  return r
end

-- this rank's rows of a global batch
local function local_rows(t, n_ranks, r)
  local b = t:shape()[1] / n_ranks
  return t:narrow(1, r * b + 1, b)
end

-- the global loss from each rank's mean loss over an equal share of the batch
local function global_loss(l)
  local t = l:detach():reshape({ 1 }):clone()
  dist.all_reduce(t, "sum")
  return t:item() / W
end

local function mlp(a, b, c)
  return function()
    engine.manual_seed(7)
    return nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c))
  end
end

local function shard_mlp(m, opts)
  dist.fully_shard(m[1], opts)
  dist.fully_shard(m[3], opts)
  dist.fully_shard(m, opts)
  return m
end

-- Trains ref (one process, global batch) and the sharded model (local batches) side by side.
-- o: build, shard(model), batch(step) -> x, y (global), loss(model, x, y), steps, tol, check_counts(c, step),
-- optim(params) -> optimizer (AdamW by default)
local function parity(o)
  local ref, m = o.build(), o.build()
  o.shard(m)
  local make_opt = o.optim or function(params) return engine.optim.AdamW(params, { lr = 1e-2, weight_decay = 0.01 }) end
  local opt_r, opt_m = make_opt(ref:parameters()), make_opt(m:parameters())
  local tol = o.tol or 1e-5
  for step = 1, o.steps or 10 do
    local x, y = o.batch(step)
    local lr = o.loss(ref, x, y)
    lr:backward()
    local c, l = counted(function()
      local l = o.loss(m, local_rows(x, W, rank), local_rows(y, W, rank))
      l:backward()
      return l
    end)
    if o.check_counts then o.check_counts(c, step, m) end
    assert.is_true(math.abs(global_loss(l) - lr:item()) <= tol * math.max(1, math.abs(lr:item())),
      string.format("step %d loss %.9g vs %.9g", step, global_loss(l), lr:item()))
    local rp = {}
    for name, p in ref:named_parameters() do rp[name] = p end
    for name, p in m:named_parameters() do
      assert.is_true(dist.is_dtensor(p), name)
      if rp[name].grad == nil then
        assert.is_nil(p.grad, name)   -- frozen: no gradient on either side
      else
        assert.is_true(rel(p.grad, rp[name].grad) < tol, string.format("step %d grad %s: %g", step, name, rel(p.grad, rp[name].grad)))
      end
    end
    opt_r:step(); opt_m:step()
    local none = step % 2 == 0
    opt_r:zero_grad(none); opt_m:zero_grad(none)
  end
  local rp = {}
  for name, p in ref:named_parameters() do rp[name] = p end
  for name, p in m:named_parameters() do
    assert.is_true(rel(p, rp[name]) < tol, "param " .. name .. ": " .. rel(p, rp[name]))
  end
  return m, ref
end

local function mlp_batch(a, c)
  return function(step)
    engine.manual_seed(100 + step)
    return engine.randn(4 * W, a), engine.randn(4 * W, c)
  end
end
local function mse(model, x, y) return F.mse_loss(model(x), y) end

describe("fully_shard parity with one process (Linear-ReLU-Linear, AdamW, 10 steps)", function()
  for _, dims in ipairs({ { 7, 15, 3 }, { 16, 17, 8 } }) do
    local raf_values = { true, false }
    if W == 4 then raf_values[3] = 2 end
    for _, raf in ipairs(raf_values) do
      it(string.format("%dx%dx%d, reshard_after_forward = %s: losses, grads, params; counts", dims[1], dims[2], dims[3], tostring(raf)), function()
        parity({
          build = mlp(dims[1], dims[2], dims[3]),
          shard = function(m) shard_mlp(m, { mesh = mesh, reshard_after_forward = raf }) end,
          batch = mlp_batch(dims[1], dims[3]), loss = mse,
          check_counts = function(c)
            -- 2 groups with parameters (the root has none): forward 2 all-gathers; backward 2 reduce-scatters;
            -- backward all-gathers: every group that resharded (true / N), none with false
            local bw_ag = raf == false and 0 or 2
            assert.are.equal(moved(2 + bw_ag), cnt(c, "all_gather"))
            assert.are.equal(moved(2), cnt(c, "reduce_scatter"))
            assert.are.equal(0, cnt(c, "all_reduce"))
          end,
        })
      end)
    end
  end

  it("with implicit prefetch and reduce-scatters in flight (set_overlap; the CUDA default)", function()
    parity({
      build = mlp(7, 15, 3),
      shard = function(m) shard_mlp(m, { mesh = mesh }); m:set_overlap({ implicit_prefetch = true, async_reduce = true }) end,
      batch = mlp_batch(7, 3), loss = mse, steps = 5,
      check_counts = function(c)
        assert.are.equal(moved(4), cnt(c, "all_gather"))
        assert.are.equal(moved(2), cnt(c, "reduce_scatter"))
      end,
    })
  end)

  it("a root with parameters keeps them unsharded after forward (no backward all-gather for it)", function()
    local function build()
      engine.manual_seed(3)
      local m = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 5), nn.Linear(5, 3))
      return m
    end
    parity({
      build = build,
      shard = function(m) dist.fully_shard(m[1], { mesh = mesh }); dist.fully_shard(m, { mesh = mesh }) end,
      batch = mlp_batch(6, 3), loss = mse, steps = 4,
      check_counts = function(c)
        assert.are.equal(moved(2 + 1), cnt(c, "all_gather"))   -- forward: block + root; backward: block only
        assert.are.equal(moved(2), cnt(c, "reduce_scatter"))
      end,
    })
  end)
end)

describe("fully_shard on common_dtensor.py's Transformer (3 layers, each block + root)", function()
  local function build(extra)
    return function()
      engine.manual_seed(11)
      local a = { n_layers = 3, dim = 16, n_heads = 4, vocab_size = 32, max_seq_len = 8, dropout_p = 0 }
      for k, v in pairs(extra or {}) do a[k] = v end
      return models.Transformer(a)
    end
  end
  local function shard(m, opts)
    for _, b in ipairs(m.layers:children()) do dist.fully_shard(b, opts) end
    dist.fully_shard(m, opts)
  end
  local function batch(step)
    engine.manual_seed(200 + step)
    local x = (engine.rand(2 * W, 8) * 32):to("i64")
    local y = (engine.rand(2 * W, 8) * 32):to("i64")
    return x, y
  end
  local function loss(model, x, y)
    local logits = model(x)
    return F.cross_entropy(logits:reshape({ -1, 32 }), y:reshape({ -1 }))
  end
  it("trains equal to one process (weight tying kept; 4 groups: 3 forward + 3 backward all-gathers + root's 1)", function()
    local m = parity({ build = build(), shard = function(m) shard(m, { mesh = mesh }) end, batch = batch, loss = loss, steps = 5,
      check_counts = function(c)
        assert.are.equal(moved(4 + 3), cnt(c, "all_gather"))
        assert.are.equal(moved(4), cnt(c, "reduce_scatter"))
      end })
    assert.are.equal(m.output.weight, m.tok_embeddings.weight)
  end)
  it("trains equal to one process with reshard_after_forward = true on the root too (4 + 4 all-gathers)", function()
    parity({ build = build(), shard = function(m) shard(m, { mesh = mesh, reshard_after_forward = true }) end,
      batch = batch, loss = loss, steps = 3,
      check_counts = function(c)
        assert.are.equal(moved(4 + 4), cnt(c, "all_gather"))
        assert.are.equal(moved(4), cnt(c, "reduce_scatter"))
      end })
  end)

  -- PyTorch's test_fully_shard_communication_count and test_set_reshard_after_forward (test_fully_shard_comm.py):
  -- two blocks and the root, counts per forward and per backward; only the default (nil, never set) keeps the
  -- root unsharded after forward (FSDP2's _auto_reshard_after_forward); true, an integer and
  -- set_reshard_after_forward reshard it too (FSDP2's set_reshard_after_forward)
  local function fwd_bwd(m)
    engine.manual_seed(300 + rank)
    local x = (engine.rand(2, 8) * 32):to("i64")
    local cf, l = counted(function() return m(x) end)
    local state = dist.fsdp_counts(m).state
    local cb = counted(function() l:sum():backward() end)
    return cf, cb, state
  end
  local function two_blocks() return build({ n_layers = 2 })() end
  it("reshard_after_forward on the root: nil keeps it unsharded, true / false / an int are honoured (counts)", function()
    -- value, backward all-gathers, the root's state after forward
    local cases = { { nil, 2, "unsharded" }, { true, 3, "sharded" }, { false, 0, "unsharded" } }
    if W == 4 then cases[#cases + 1] = { 2, 3, "post_forward" } end
    for _, case in ipairs(cases) do
      local m = two_blocks()
      shard(m, { mesh = mesh, reshard_after_forward = case[1] })
      local cf, cb, state = fwd_bwd(m)
      local what = "reshard_after_forward = " .. tostring(case[1])
      assert.are.equal(moved(3), cnt(cf, "all_gather"), what)
      assert.are.equal(0, cnt(cf, "reduce_scatter"), what)
      assert.are.equal(moved(case[2]), cnt(cb, "all_gather"), what)
      assert.are.equal(moved(3), cnt(cb, "reduce_scatter"), what)
      assert.are.equal(case[3], state, what)
    end
  end)
  it("set_reshard_after_forward (recurse or the root alone) is honoured on the root (counts)", function()
    for _, set in ipairs({ true, false, "none" }) do
      for _, recurse in ipairs({ true, false }) do
        local m = two_blocks()
        if set == "none" then shard(m, { mesh = mesh })
        else
          shard(m, { mesh = mesh, reshard_after_forward = not set })
          m:set_reshard_after_forward(set, { recurse = recurse })
        end
        local want = set == "none" and 2 or set == true and (recurse and 3 or 1) or (recurse and 0 or 2)
        local cf, cb = fwd_bwd(m)
        local what = string.format("set_reshard_after_forward(%s, recurse = %s)", tostring(set), tostring(recurse))
        assert.are.equal(moved(3), cnt(cf, "all_gather"), what)
        assert.are.equal(moved(want), cnt(cb, "all_gather"), what)
        assert.are.equal(moved(3), cnt(cb, "reduce_scatter"), what)
      end
    end
    -- after the lazy init too: the root kept by default, then resharded once set
    local m = two_blocks()
    shard(m, { mesh = mesh })
    local _, cb = fwd_bwd(m)
    assert.are.equal(moved(2), cnt(cb, "all_gather"))
    m:set_reshard_after_forward(true, { recurse = false })
    _, cb = fwd_bwd(m)
    assert.are.equal(moved(3), cnt(cb, "all_gather"))
  end)

  it("with activation checkpointing (the recompute all-gathers again, once)", function()
    parity({ build = build({ checkpoint_activations = true }), shard = function(m) shard(m, { mesh = mesh }) end,
      batch = batch, loss = loss, steps = 3,
      check_counts = function(c)
        assert.are.equal(moved(4 + 3), cnt(c, "all_gather"))
        assert.are.equal(moved(4), cnt(c, "reduce_scatter"))
      end })
  end)
  it("with explicit prefetch of 2 groups forward and backward", function()
    parity({ build = build(), batch = batch, loss = loss, steps = 3,
      shard = function(m)
        shard(m, { mesh = mesh })
        local L = m.layers:children()
        L[1]:set_modules_to_forward_prefetch({ L[2], L[3] })
        L[3]:set_modules_to_backward_prefetch({ L[2], L[1] })
      end,
      check_counts = function(c)
        assert.are.equal(moved(4 + 3), cnt(c, "all_gather"))
        assert.are.equal(moved(4), cnt(c, "reduce_scatter"))
      end })
  end)
end)

describe("fully_shard: more layouts and controls", function()
  it("a module used twice per forward", function()
    local Twice = nn.Module:extend("Twice")
    function Twice:__init() self.a = nn.Linear(6, 6); self.b = nn.Linear(6, 3) end
    function Twice:forward(x) return self.b(F.relu(self.a(F.relu(self.a(x))))) end
    parity({
      build = function() engine.manual_seed(5); return Twice() end,
      shard = function(m) dist.fully_shard(m.a, { mesh = mesh }); dist.fully_shard(m, { mesh = mesh }) end,
      batch = mlp_batch(6, 3), loss = mse, steps = 4,
      check_counts = function(c) assert.are.equal(moved(2), cnt(c, "reduce_scatter")) end,
    })
  end)

  it("HSDP on a (replicate, shard) mesh: Replicate + Shard parameters, reduce-scatter then all-reduce", function()
    if W ~= 4 then return end
    local m2 = dist.init_device_mesh("cpu", { 2, 2 }, { "replicate", "shard" })
    local m = parity({
      build = mlp(7, 15, 3),
      shard = function(m) shard_mlp(m, { mesh = m2 }) end,
      batch = mlp_batch(7, 3), loss = mse,
      check_counts = function(c)
        assert.are.equal(moved(4), cnt(c, "all_gather"))
        assert.are.equal(moved(2), cnt(c, "reduce_scatter"))
        assert.are.equal(2, cnt(c, "all_reduce"))
      end,
    })
    assert.are.equal("Replicate()", tostring(m[1].weight.placements[1]))
    assert.are.equal("Shard(1)", tostring(m[1].weight.placements[2]))
  end)

  it("gradient accumulation: 3 microbatches, reduce-scatters only on the last; equal to one process", function()
    local ref, m = mlp(7, 15, 3)(), mlp(7, 15, 3)()
    shard_mlp(m, { mesh = mesh })
    local x, y = mlp_batch(7, 3)(1)
    for k = 1, 3 do
      local xs, ys = x:narrow(2, 1, 7), y
      local lr = mse(ref, xs * k, ys) * (1 / 3)
      lr:backward()
      m:set_requires_gradient_sync(k == 3)
      local c = counted(function()
        local l = mse(m, local_rows(xs * k, W, rank), local_rows(ys, W, rank)) * (1 / 3)
        l:backward()
      end)
      assert.are.equal(moved(k == 3 and 2 or 0), cnt(c, "reduce_scatter"))
    end
    for name, p in m:named_parameters() do
      assert.is_true(rel(p.grad, ref:get_parameter(name).grad) < 1e-5, name)
    end
  end)

  -- a size-1 FSDP group (PyTorch's (world_size, 1) meshes of test_set_reduce_scatter_divide_factor
  -- and its dp size 1 of TestFullyShardNDTraining at 2 GPUs): the dp dim of a (W, 1) mesh; nothing to move
  for _, raf in ipairs({ true, false }) do
    it(string.format("a shard group of one rank (dp of a (W, 1) mesh, reshard_after_forward = %s) issues no "
      .. "collective; each rank trains equal to one process on its rows", tostring(raf)), function()
      local m2 = dist.init_device_mesh("cpu", { W, 1 }, { "rep", "dp" })
      local ref, m = mlp(7, 15, 3)(), shard_mlp(mlp(7, 15, 3)(), { mesh = m2["dp"], reshard_after_forward = raf })
      local opt_r = engine.optim.AdamW(ref:parameters(), { lr = 1e-2 })
      local opt_m = engine.optim.AdamW(m:parameters(), { lr = 1e-2 })
      for step = 1, 3 do
        local x, y = mlp_batch(7, 3)(step)
        x, y = local_rows(x, W, rank), local_rows(y, W, rank)
        local lr = mse(ref, x, y)
        lr:backward()
        local c, l = counted(function() local l = mse(m, x, y); l:backward(); return l end)
        assert.are.same({}, c)   -- no all-gather, reduce-scatter or all-reduce (a count of each kind issued)
        assert.are.equal(lr:item(), l:item())
        for name, p in m:named_parameters() do
          assert.are.equal("Shard(1)", tostring(p.placements[1]), name)
          assert.is_true(rel(p.grad:to_local(), ref:get_parameter(name).grad) < 1e-6, name)
        end
        opt_r:step(); opt_m:step(); opt_r:zero_grad(); opt_m:zero_grad()
      end
      for _, g in ipairs({ m, m[1], m[3] }) do
        local k = dist.fsdp_counts(g)
        assert.are.equal(0, k.all_gather); assert.are.equal(0, k.reduce_scatter)
      end
      for name, p in m:named_parameters() do
        assert.is_true(rel(p:to_local(), ref:get_parameter(name)) < 1e-6, "param " .. name)
      end
    end)
  end

  it("mixed precision: bf16 compute, f32 reduce-scatter, f32 master parameters and gradients", function()
    local ref, work, m = mlp(8, 16, 4)(), mlp(8, 16, 4)(), mlp(8, 16, 4)()
    work:to("bf16")
    local mp = dist.MixedPrecisionPolicy({ param_dtype = "bf16", reduce_dtype = "f32" })
    shard_mlp(m, { mesh = mesh, mp_policy = mp })
    local opt_r = engine.optim.AdamW(ref:parameters(), { lr = 1e-2 })
    local opt_m = engine.optim.AdamW(m:parameters(), { lr = 1e-2 })
    for step = 1, 3 do
      local x, y = mlp_batch(8, 4)(step)
      work:load_state_dict(ref:state_dict())
      local lr = F.mse_loss(work(x:to("bf16")):to("f32"), y)
      lr:backward()
      for name, p in ref:named_parameters() do p.grad = work:get_parameter(name).grad:to("f32") end
      work:zero_grad()
      local recs, l = logged(function()
        local l = F.mse_loss(m(local_rows(x, W, rank)):to("f32"), local_rows(y, W, rank))
        l:backward()
        return l
      end)
      -- all-gathers in param_dtype (forward and backward), reduce-scatters in reduce_dtype
      assert.are.same(moved_list({ "bf16", "bf16", "bf16", "bf16" }), dtypes_of(recs, "all_gather"))
      assert.are.same(moved_list({ "f32", "f32" }), dtypes_of(recs, "reduce_scatter"))
      assert.is_true(math.abs(global_loss(l) - lr:item()) < 2e-2 * math.max(1, math.abs(lr:item())))
      for name, p in m:named_parameters() do
        assert.are.equal("f32", p.dtype); assert.are.equal("f32", p.grad.dtype)
        assert.is_true(rel(p.grad, ref:get_parameter(name).grad) < 5e-2, name)
      end
      opt_r:step(); opt_m:step(); opt_r:zero_grad(); opt_m:zero_grad()
    end
    for name, p in m:named_parameters() do assert.is_true(rel(p, ref:get_parameter(name)) < 2e-2, name) end
  end)

  it("registered parameters after forward and backward follow reshard_after_forward (seed docstring)", function()
    for _, raf in ipairs({ true, false }) do
      local m = mlp(4, 8, 2)()
      shard_mlp(m, { mesh = mesh, reshard_after_forward = raf })
      assert.is_true(dist.is_dtensor(m[1].weight))
      local out = m(engine.randn(2, 4))
      -- true: the sharded DTensors (this rank's chunk of rows); false: the unsharded plain tensors
      for _, w in ipairs({ m[1].weight, m[3].weight }) do
        local rows = w:shape()[1]
        local mine = math.max(0, math.min(math.ceil(rows / W), rows - rank * math.ceil(rows / W)))
        if raf then
          assert.is_true(dist.is_dtensor(w))
          assert.are.equal(mine, w:to_local():shape()[1])
        else
          assert.is_false(dist.is_dtensor(w))
          assert.are.equal(rows, w:shape()[1])
        end
      end
      assert.are.equal(raf and "sharded" or "unsharded", dist.fsdp_counts(m[3]).state)
      out:sum():backward()
      assert.is_true(dist.is_dtensor(m[1].weight))
      -- reshard() / unshard()
      m[1]:unshard()
      assert.is_false(dist.is_dtensor(m[1].weight))
      assert.are.same({ 8, 4 }, m[1].weight:shape())
      m[1]:reshard()
      assert.is_true(dist.is_dtensor(m[1].weight))
      local h = m[1]:unshard({ async_op = true })
      h:wait()
      assert.is_false(dist.is_dtensor(m[1].weight))
      m[1]:reshard()
    end
  end)

  it("reshard_after_forward = N: after forward the registered parameters live on the (W/N, N) mesh", function()
    if W ~= 4 then return end
    local m = mlp(5, 7, 3)()
    shard_mlp(m, { mesh = mesh, reshard_after_forward = 2 })
    local out = m(engine.randn(2, 5))
    local w = m[1].weight
    assert.is_true(dist.is_dtensor(w))
    assert.are.same({ 2, 2 }, w.device_mesh:shape())
    assert.are.equal("Replicate()", tostring(w.placements[1]))
    assert.are.equal("Shard(1)", tostring(w.placements[2]))
    assert.are.same({ 7, 5 }, w:shape())
    assert.are.same({ rank % 2 == 0 and 4 or 3, 5 }, w:to_local():shape())
    local ref = mlp(5, 7, 3)()
    assert.is_true(rel(w:full_tensor(), ref[1].weight) == 0)
    local c = counted(function() out:sum():backward() end)
    assert.are.equal(moved(2), cnt(c, "all_gather"))
    assert.is_true(dist.is_dtensor(m[1].weight))
    assert.are.equal(1, m[1].weight.device_mesh:ndim())
  end)

  it("reshard_after_forward as an int (the seed's reading): 1 is false, the shard size is true, a non-factor errs", function()
    local function bw_all_gathers(raf)
      local m = shard_mlp(mlp(4, 8, 2)(), { mesh = mesh, reshard_after_forward = raf })
      local x = engine.randn(2, 4)
      local c = counted(function() m(x):sum():backward() end)
      return cnt(c, "all_gather") - moved(2), m
    end
    local n, m = bw_all_gathers(1)
    assert.are.equal(0, n)   -- kept unsharded after forward: no backward all-gather
    m(engine.randn(2, 4))
    assert.is_false(dist.is_dtensor(m[1].weight))
    if W > 1 then assert.are.equal(2, bw_all_gathers(W)) end   -- resharded to the whole shard group
    assert.is_truthy(errmsg(dist.fully_shard, nn.Linear(4, 4), { mesh = mesh, reshard_after_forward = W + 1 })
      :find("should be a factor of " .. W .. ", not " .. (W + 1), 1, true))
    -- set_reshard_after_forward reads an int the same way
    local m2 = shard_mlp(mlp(4, 8, 2)(), { mesh = mesh })
    m2:set_reshard_after_forward(1)
    local c = counted(function() m2(engine.randn(2, 4)):sum():backward() end)
    assert.are.equal(moved(2), cnt(c, "all_gather"))   -- forward only
  end)

  it("set_reshard_after_forward and reshard() change the backward all-gathers; register_fsdp_forward_method", function()
    local m = mlp(4, 6, 2)()
    shard_mlp(m, { mesh = mesh })
    local x = engine.randn(2, 4)
    local c = counted(function() m(x):sum():backward() end)
    assert.are.equal(moved(4), cnt(c, "all_gather"))
    m:set_reshard_after_forward(false)
    c = counted(function() m(x):sum():backward() end)
    assert.are.equal(moved(2), cnt(c, "all_gather"))
    -- reshard() after forward: the backward all-gathers again for that group
    c = counted(function()
      local y = m(x)
      m[1]:reshard()
      y:sum():backward()
    end)
    assert.are.equal(moved(3), cnt(c, "all_gather"))
    m:set_reshard_after_forward(true)
    -- a method other than forward runs under the hooks too
    local lin = nn.Linear(4, 3)
    function lin:project(v) return F.linear(v, self.weight) * 2 end
    dist.fully_shard(lin, { mesh = mesh })
    dist.register_fsdp_forward_method(lin, "project")
    local y
    c = counted(function() y = lin:project(x) end)
    assert.are.equal(moved(1), cnt(c, "all_gather"))
    assert.are.same({ 2, 3 }, y:shape())
    assert.is_truthy(errmsg(dist.register_fsdp_forward_method, lin, "nope"):find("has no method 'nope'", 1, true))
  end)

  it("no_grad forwards, unused parameters, state dict round trip, clip_grad_norm, to(dtype)", function()
    local Unused = nn.Module:extend("Unused")
    function Unused:__init() self.a = nn.Linear(5, 7); self.spare = nn.Linear(3, 3) end
    function Unused:forward(x) return self.a(x) end
    engine.manual_seed(1)
    local ref = Unused()
    engine.manual_seed(1)
    local m = Unused()
    dist.fully_shard(m, { mesh = mesh })
    engine.no_grad(function() m(engine.randn(2, 5)) end)
    assert.is_true(dist.is_dtensor(m.a.weight))
    engine.manual_seed(4)
    local x = engine.randn(2 * W, 5)
    ref(x):mean():backward()
    m(local_rows(x, W, rank)):mean():backward()
    assert.is_nil(m.spare.weight.grad)
    assert.is_true(rel(m.a.weight.grad, ref.a.weight.grad) < 1e-5)
    for _, norm in ipairs({ 2, 1, math.huge }) do
      local a = nn.utils.clip_grad_norm_(ref.a:parameters(), 1e9, norm)
      local b = nn.utils.clip_grad_norm_(m.a:parameters(), 1e9, norm)
      local function num(v) return full(v):item() end
      assert.is_true(math.abs(num(b) - num(a)) < 1e-5 * math.max(1, num(a)), tostring(norm))
    end
    -- state dict: sharded DTensors sharing storage; full tensors load too
    local sd = m:state_dict()
    assert.is_true(dist.is_dtensor(sd["a.weight"]))
    local saved = {}
    local keys = {}
    for k in pairs(sd) do keys[#keys + 1] = k end
    table.sort(keys)   -- the same collectives in the same order on every rank
    for _, k in ipairs(keys) do saved[k] = sd[k]:full_tensor():clone() end
    for _, p in ipairs(m:parameters()) do engine.no_grad(function() p:fill_(0.5) end) end
    m:load_state_dict(saved)
    local sd2 = m:state_dict()
    for _, k in ipairs(keys) do assert.is_true(rel(sd2[k], saved[k]) == 0, k) end
    m:to("f64")
    assert.is_true(dist.is_dtensor(m.a.weight))
    assert.are.equal("f64", m.a.weight.dtype)
    local y = m(local_rows(x, W, rank):to("f64"))
    assert.are.equal("f64", y.dtype)
    assert.is_true(rel(y:to("f32"), local_rows(ref(x), W, rank)) < 1e-5)
  end)

  it("HSDP with set_requires_all_reduce(false): reduce-scatter only, kept unreduced until the next all-reduce "
    .. "carries it to the other replicas (not each replica's own sum)", function()
    local shape = ({ [4] = { 2, 2 }, [2] = { 2, 1 } })[W]
    if not shape then return end
    local m2 = dist.init_device_mesh("cpu", shape, { "replicate", "shard" })
    local ref, m = mlp(4, 6, 2)(), shard_mlp(mlp(4, 6, 2)(), { mesh = m2 })
    m:set_requires_all_reduce(false)
    local x1, y1 = mlp_batch(4, 2)(1)
    F.mse_loss(ref(x1), y1):backward()
    local c = counted(function() F.mse_loss(m(local_rows(x1, W, rank)), local_rows(y1, W, rank)):backward() end)
    assert.are.equal(shape[2] > 1 and 2 or 0, cnt(c, "reduce_scatter"))
    assert.are.equal(0, cnt(c, "all_reduce"))
    -- the reduce-scatter's output is the group's partial sum, not .grad (PyTorch's partial reduce output)
    for name, p in m:named_parameters() do assert.is_nil(p.grad, name) end
    m:set_requires_all_reduce(true)
    local x2, y2 = mlp_batch(4, 2)(2)
    F.mse_loss(ref(x2), y2):backward()
    c = counted(function() F.mse_loss(m(local_rows(x2, W, rank)), local_rows(y2, W, rank)):backward() end)
    assert.are.equal(2, cnt(c, "all_reduce"))
    -- one all-reduce carried both microbatches to every replica: equal to one process over both
    for name, p in m:named_parameters() do
      assert.is_true(rel(p.grad, ref:get_parameter(name).grad) < 1e-5, name .. ": " .. rel(p.grad, ref:get_parameter(name).grad))
    end
  end)

  -- PyTorch's test_gradient_accumulation (test_fully_shard_training.py) with reduce_scatter_only on HSDP meshes:
  -- Linear + 3 MLPs, each MLP a group, the root gets the Linear; 3 microbatches with all-reduce on only for the
  -- last (every group, or the root's alone); 2 iterations (AdamW steps, .grad set to none, then zeroed)
  local hsdp_shapes = ({ [4] = { { 2, 2 }, { 4, 1 }, { 1, 4 } }, [2] = { { 2, 1 }, { 1, 2 } } })[W] or { { 1, 1 } }
  for _, shape in ipairs(hsdp_shapes) do
    for _, mode in ipairs({ "all", "root_only" }) do
      it(string.format("HSDP (%d, %d) gradient accumulation, all-reduce on the last microbatch only (%s): every "
        .. "microbatch reaches every replica; equal to one process", shape[1], shape[2], mode), function()
        local R, S = shape[1], shape[2]
        local m2 = dist.init_device_mesh("cpu", shape, { "replicate", "shard" })
        local function build()
          engine.manual_seed(42)
          local mods = { nn.Linear(8, 8) }
          for i = 2, 4 do mods[i] = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) end
          return nn.Sequential(unpack(mods))
        end
        local ref, m = build(), build()
        for i = 2, 4 do dist.fully_shard(m[i], { mesh = m2 }) end
        dist.fully_shard(m, { mesh = m2 })
        local opt_r = engine.optim.AdamW(ref:parameters(), { lr = 1e-2 })
        local opt_m = engine.optim.AdamW(m:parameters(), { lr = 1e-2 })
        local groups, nmb = 4, 3
        for iter = 1, 2 do
          local c_all = {}
          for k = 1, nmb do
            local last = k == nmb
            if mode == "all" then m:set_requires_all_reduce(last) else m:set_requires_all_reduce(last, { recurse = false }) end
            engine.manual_seed(1000 + 10 * iter + k)
            local x, y = engine.randn(2 * W, 8), engine.randn(2 * W, 8)
            F.mse_loss(ref(x), y):backward()
            local c = counted(function() F.mse_loss(m(local_rows(x, W, rank)), local_rows(y, W, rank)):backward() end)
            for kind, v in pairs(c) do c_all[kind] = (c_all[kind] or 0) + v end
            if iter == 1 and not last then
              -- a group with all-reduce off holds its partial sum: .grad untouched (nil before the first step)
              assert.is_nil(m[1].weight.grad)
              assert.are.equal(mode == "root_only", m[2][1].weight.grad ~= nil)
            end
          end
          -- every group reduce-scatters every microbatch (none over a shard group of one rank); all-reduces only
          -- where all-reduce is on, none over a replicate group of one rank
          assert.are.equal(S > 1 and groups * nmb or 0, cnt(c_all, "reduce_scatter"))
          local ar = mode == "all" and groups or groups * nmb - (nmb - 1)
          assert.are.equal(R > 1 and ar or 0, cnt(c_all, "all_reduce"))
          for name, p in m:named_parameters() do
            local e = rel(p.grad, ref:get_parameter(name).grad)
            assert.is_true(e < 1e-5, string.format("iteration %d grad %s: %g", iter, name, e))
          end
          opt_r:step(); opt_m:step()
          opt_r:zero_grad(iter % 2 == 0); opt_m:zero_grad(iter % 2 == 0)
        end
        for name, p in m:named_parameters() do
          assert.is_true(rel(p, ref:get_parameter(name)) < 1e-5, "param " .. name)
        end
      end)
    end
  end

  it("output_dtype casts the outputs; CPUOffloadPolicy on a CPU mesh is accepted (nothing to offload)", function()
    local m = mlp(4, 6, 2)()
    dist.fully_shard(m[1], { mesh = mesh }); dist.fully_shard(m[3], { mesh = mesh })
    dist.fully_shard(m, { mesh = mesh, mp_policy = dist.MixedPrecisionPolicy({ output_dtype = "f64" }),
      offload_policy = dist.CPUOffloadPolicy({ pin_memory = false }) })
    local y = m(engine.randn(2, 4))
    assert.are.equal("f64", y.dtype)
    y:sum():backward()
    assert.are.equal("f32", m[1].weight.grad.dtype)
    assert.is_truthy(errmsg(dist.MixedPrecisionPolicy, { param_dtype = "i32" }):find("must be a floating dtype", 1, true))
    assert.is_truthy(errmsg(dist.fully_shard, nn.Linear(2, 2), { mesh = mesh, mp_policy = {} }):find("MixedPrecisionPolicy", 1, true))
  end)

  it("prints which modules are FSDP modules; deep copy refused", function()
    local m = shard_mlp(mlp(4, 6, 2)(), { mesh = mesh })
    assert.is_truthy(tostring(m):find("FSDPSequential", 1, true))
    assert.is_truthy(tostring(m):find("FSDPLinear", 1, true))
    assert.is_truthy(errmsg(function() m:deepcopy() end):find("FSDP does not support deepcopy", 1, true))
  end)
end)

-- PyTorch's test_train_parity_hsdp (test_fully_shard_training.py) with use_activation_checkpointing: every module
-- of LayerNorm + 3 MLPs is checkpointed and an FSDP group, so the first block's input (the data) does not require
-- grad; its parameters must train all the same.  On the 1-D mesh and on the HSDP mesh PyTorch's
-- test uses (shard 2 where W > 2, else 1), both reshard_after_forward values, MLP dims 3 and 16, the checkpoint
-- given the module or a function calling it; 3 microbatches with gradient sync on the last, 3 AdamW steps.
describe("fully_shard under activation checkpointing, inputs not requiring grad", function()
  local CkptSeq = nn.Module:extend("CkptSeq")
  function CkptSeq:__init(d, ckpt)
    self.norm = nn.LayerNorm(d, { bias = false })
    local function mlp_(k) return nn.Sequential(nn.Linear(d, k * d), nn.ReLU(), nn.Linear(k * d, d)) end
    self.mlp1, self.mlp2, self.mlp3 = mlp_(3), mlp_(1), mlp_(3)
    self.ckpt = ckpt
  end
  function CkptSeq:forward(x)
    for _, name in ipairs({ "norm", "mlp1", "mlp2", "mlp3" }) do
      local block = self[name]
      if self.ckpt == "module" then x = nn.checkpoint(block, x)
      elseif self.ckpt == "function" then x = nn.checkpoint(function(h) return block(h) end, x)
      else x = block(x) end
    end
    return x
  end
  local S = W > 2 and 2 or 1
  for _, mshape in ipairs({ { W }, { W / S, S } }) do
    for _, raf in ipairs({ true, false }) do
      for _, d in ipairs({ 3, 16 }) do
        for _, form in ipairs({ "module", "function" }) do
          it(string.format("mesh (%s), reshard_after_forward = %s, dim %d, checkpoint of the %s: equal to one process",
            table.concat(mshape, ", "), tostring(raf), d, form), function()
            local fm = #mshape == 1 and mesh or dist.init_device_mesh("cpu", mshape, { "replicate", "shard" })
            local function build(ckpt) engine.manual_seed(42); return CkptSeq(d, ckpt) end
            local ref, m = build(nil), build(form)
            for _, name in ipairs({ "norm", "mlp1", "mlp2", "mlp3" }) do
              dist.fully_shard(m[name], { mesh = fm, reshard_after_forward = raf })
            end
            dist.fully_shard(m, { mesh = fm, reshard_after_forward = raf })
            local opt_r = engine.optim.AdamW(ref:parameters(), { lr = 1e-2 })
            local opt_m = engine.optim.AdamW(m:parameters(), { lr = 1e-2 })
            for iter = 1, 3 do
              for k = 1, 3 do
                m:set_requires_gradient_sync(k == 3)
                engine.manual_seed(700 + 10 * iter + k)
                local x, y = engine.randn(2 * W, d), engine.randn(2 * W, d)
                local lr = F.mse_loss(ref(x), y)
                lr:backward()
                local l = F.mse_loss(m(local_rows(x, W, rank)), local_rows(y, W, rank))
                assert.is_true(l.requires_grad, "the checkpointed blocks' output requires grad")
                l:backward()
                assert.is_true(math.abs(global_loss(l) - lr:item()) <= 1e-5 * math.max(1, math.abs(lr:item())),
                  string.format("iteration %d microbatch %d: loss %.9g vs %.9g", iter, k, global_loss(l), lr:item()))
              end
              for name, p in m:named_parameters() do
                assert.is_not_nil(p.grad, name .. " has no gradient")
                local e = rel(p.grad, ref:get_parameter(name).grad)
                assert.is_true(e < 1e-5, string.format("iteration %d grad %s: %g", iter, name, e))
              end
              opt_r:step(); opt_m:step(); opt_r:zero_grad(); opt_m:zero_grad()
            end
            for name, p in m:named_parameters() do
              assert.is_true(rel(p, ref:get_parameter(name)) < 1e-5, "param " .. name)
            end
          end)
        end
      end
    end
  end
end)

describe("fully_shard: forward methods, frozen parameters", function()
  it("register_fsdp_forward_method on a non-root block: its outputs arm the backward all-gather; equal to one process", function()
    local Inner = nn.Linear:extend("ProjLinear")
    function Inner:project(v) return F.relu(F.linear(v, self.weight, self.bias)) * 2 end
    local Outer = nn.Module:extend("ProjOuter")
    function Outer:__init() self.inner = Inner(7, 9); self.head = nn.Linear(9, 3) end
    function Outer:forward(x) return self.head(self.inner:project(x)) end
    parity({
      build = function() engine.manual_seed(13); return Outer() end,
      shard = function(m)
        dist.fully_shard(m.inner, { mesh = mesh })
        dist.register_fsdp_forward_method(m.inner, "project")
        dist.fully_shard(m, { mesh = mesh })
      end,
      batch = mlp_batch(7, 3), loss = mse, steps = 4,
      check_counts = function(c, _, m)
        -- forward: inner + root; backward: inner again (it resharded after its method's forward)
        assert.are.equal(moved(2 + 1), cnt(c, "all_gather"))
        assert.are.equal(moved(2), cnt(c, "reduce_scatter"))
        assert.are.equal("sharded", dist.fsdp_counts(m.inner).state)
      end,
    })
    -- a method returning a list of tensors: each is armed
    local ref, m = Outer(), Outer()
    m:load_state_dict(ref:state_dict())
    function Inner:both(v) return { F.linear(v, self.weight, self.bias):tanh(), F.linear(v, self.weight) } end
    dist.fully_shard(m.inner, { mesh = mesh })
    dist.register_fsdp_forward_method(m.inner, "project")
    dist.register_fsdp_forward_method(m.inner, "both")
    dist.fully_shard(m, { mesh = mesh })
    engine.manual_seed(21)
    local x = engine.randn(2 * W, 7)
    local r = ref.inner:both(x)
    ;((r[1]:sum() + r[2]:sum()) * (1 / W)):backward()   -- FSDP averages the ranks' gradients
    m(local_rows(x, W, rank))   -- lazy init from the root first
    local o = m.inner:both(local_rows(x, W, rank))
    assert.are.equal("sharded", dist.fsdp_counts(m.inner).state)
    ;(o[1]:sum() + o[2]:sum()):backward()
    assert.is_true(rel(m.inner.weight.grad, ref.inner.weight.grad) < 1e-5)
    -- not an FSDP module: nothing happens (the seed's no-op), even for a missing method
    local plain = nn.Linear(2, 2)
    dist.register_fsdp_forward_method(plain, "nope")
    assert.is_nil(rawget(plain, "nope"))
  end)

  it("frozen parameters (requires_grad false before or after fully_shard) train equal to one process, grads nil", function()
    local function build()
      local m = mlp(7, 15, 3)()
      m[1].bias:requires_grad_(false)
      return m
    end
    local m = parity({
      build = function()
        local m = build()
        m[3].weight:requires_grad_(false)
        return m
      end,
      shard = function(m)
        m[3].weight:requires_grad_(true)   -- shard it trainable, freeze the sharded DTensor afterwards
        shard_mlp(m, { mesh = mesh })
        m[3].weight:requires_grad_(false)
      end,
      batch = mlp_batch(7, 3), loss = mse, steps = 3,   -- the last zero_grad keeps zeros
      check_counts = function(c)
        assert.are.equal(moved(4), cnt(c, "all_gather"))
        assert.are.equal(moved(2), cnt(c, "reduce_scatter"))
      end,
    })
    assert.is_nil(m[1].bias.grad); assert.is_nil(m[3].weight.grad)
    assert.is_false(m[1].bias.requires_grad)
    assert.is_not_nil(m[1].weight.grad); assert.is_not_nil(m[3].bias.grad)
  end)
end)

describe("fully_shard: gradients and state", function()
  it("mixed precision reduce_dtype = bf16: the reduce-scatter runs in bf16, the gradients are stored f32", function()
    local m = shard_mlp(mlp(8, 16, 4)(), { mesh = mesh,
      mp_policy = dist.MixedPrecisionPolicy({ param_dtype = "f32", reduce_dtype = "bf16" }) })
    local recs = logged(function() F.mse_loss(m(engine.randn(2, 8)), engine.randn(2, 4)):backward() end)
    assert.are.same(moved_list({ "f32", "f32", "f32", "f32" }), dtypes_of(recs, "all_gather"))
    assert.are.same(moved_list({ "bf16", "bf16" }), dtypes_of(recs, "reduce_scatter"))
    assert.are.equal("f32", m[1].weight.grad.dtype)
  end)

  it("gradient accumulation under mp_policy {bf16, f32}: the unsharded gradients accumulate in f32 over 3 microbatches", function()
    local mp = dist.MixedPrecisionPolicy({ param_dtype = "bf16", reduce_dtype = "f32" })
    local m = shard_mlp(mlp(8, 16, 4)(), { mesh = mesh, mp_policy = mp })
    local work = mlp(8, 16, 4)()
    work:to("bf16")
    -- reference: each rank's bf16 gradient of each microbatch, summed in f64, averaged over the ranks
    local sum = {}
    for k = 1, 3 do
      local x, y = mlp_batch(8, 4)(10 + k)
      for r = 0, W - 1 do
        work:zero_grad()
        local l = F.mse_loss(work(local_rows(x, W, r):to("bf16")):to("f32"), local_rows(y, W, r)) * (1 / 3)
        l:backward()
        for name, p in work:named_parameters() do
          local g = p.grad:to("f64")
          sum[name] = sum[name] and sum[name] + g or g
        end
      end
      m:set_requires_gradient_sync(k == 3)
      local c = counted(function()
        local l = F.mse_loss(m(local_rows(x, W, rank)):to("f32"), local_rows(y, W, rank)) * (1 / 3)
        l:backward()
      end)
      assert.are.equal(moved(k == 3 and 2 or 0), cnt(c, "reduce_scatter"))
    end
    for name, p in m:named_parameters() do
      assert.are.equal("f32", p.grad.dtype)
      -- bf16 accumulation would be off by ~3e-3 (measured); f32 sums agree to rounding
      local e = rel(p.grad, sum[name] * (1 / W))
      assert.is_true(e < 1e-5, name .. ": " .. e)
    end
  end)

  it("clip_grad_norm_ with max_norm below the norm (types 2, 1, inf): clipped gradients equal to one process", function()
    local ref, m = mlp(7, 15, 3)(), mlp(7, 15, 3)()
    shard_mlp(m, { mesh = mesh })
    local x, y = mlp_batch(7, 3)(3)
    for _, norm in ipairs({ 2, 1, math.huge }) do
      ref:zero_grad(true); m:zero_grad(true)
      mse(ref, x, y):backward()
      mse(m, local_rows(x, W, rank), local_rows(y, W, rank)):backward()
      local function num(v) return full(v):item() end
      local total = num(nn.utils.clip_grad_norm_(ref:parameters(), 1e9, norm))
      local a = num(nn.utils.clip_grad_norm_(ref:parameters(), total / 3, norm))
      -- PyTorch's test_clip_grad_norm_1d: the norm is a DTensor (here Replicate), one all_reduce per placement
      local bt
      local c = dist.count_collectives(function() bt = nn.utils.clip_grad_norm_(m:parameters(), total / 3, norm) end)
      assert.is_true(dist.is_dtensor(bt) and bt.placements[1]:is_replicate() and bt:dim() == 0, tostring(bt))
      assert.are.same(W > 1 and { all_reduce = #bt.placements } or {}, c)
      local b = num(bt)
      assert.is_true(math.abs(b - a) < 1e-5 * math.max(1, a), tostring(norm))
      for name, p in m:named_parameters() do
        local e = rel(p.grad, ref:get_parameter(name).grad)
        assert.is_true(e < 1e-5, string.format("norm %s %s: %g", tostring(norm), name, e))
      end
      -- clipped: the norm is now max_norm
      local after = num(nn.utils.clip_grad_norm_(m:parameters(), 1e9, norm))
      assert.is_true(math.abs(after - total / 3) < 1e-4 * total, tostring(norm))
    end
  end)

  it("state dict: sharded DTensors load, entries share storage with the parameters, padding-only ranks hold empty locals", function()
    -- out_features 3 over W ranks: at 4 ranks rank 3 holds only padding
    local function build(seed) engine.manual_seed(seed); return nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2)) end
    local m, other, ref = build(1), build(2), build(2)
    dist.fully_shard(m[1], { mesh = mesh }); dist.fully_shard(m, { mesh = mesh })
    dist.fully_shard(other[1], { mesh = mesh }); dist.fully_shard(other, { mesh = mesh })
    local sd = m:state_dict()
    local w = sd["0.weight"]
    assert.is_true(dist.is_dtensor(w))
    local rows = math.max(0, math.min(math.ceil(3 / W), 3 - rank * math.ceil(3 / W)))
    assert.are.same({ rows, 5 }, w:to_local():shape())
    assert.are.same({ rows }, sd["0.bias"]:to_local():shape())
    if W == 4 and rank == 3 then assert.are.equal(0, w:to_local():numel()) end
    -- shared storage: writing through the state dict entry changes the parameter
    engine.no_grad(function() sd["0.bias"]:to_local():fill_(0.25) end)
    assert.is_true(rel(m[1].bias, engine.full({ 3 }, 0.25)) == 0)
    -- sharded DTensors from another FSDP model of the same layout
    m:load_state_dict(other:state_dict())
    for name, p in m:named_parameters() do
      assert.is_true(dist.is_dtensor(p), name)
      assert.is_true(rel(p, ref:get_parameter(name)) == 0, name)
    end
    -- and the model still trains with those values (padding-only ranks take part)
    engine.manual_seed(9)
    local x = engine.randn(2 * W, 5)
    ref(x):sum():backward()
    m(local_rows(x, W, rank)):sum():backward()
    for name, p in m:named_parameters() do
      assert.is_true(rel(p.grad * W, ref:get_parameter(name).grad) < 1e-5, name)
    end
  end)

  it("set_reshard_after_backward(false) keeps the groups unsharded between microbatches (no all-gather)", function()
    local ref, m = mlp(7, 15, 3)(), mlp(7, 15, 3)()
    shard_mlp(m, { mesh = mesh, reshard_after_forward = false })
    local x, y = mlp_batch(7, 3)(4)
    for k = 1, 3 do
      local xs = x * k
      ;(mse(ref, xs, y) * (1 / 3)):backward()
      m:set_requires_gradient_sync(k == 3)
      m:set_reshard_after_backward(k == 3)
      local c = counted(function() (mse(m, local_rows(xs, W, rank), local_rows(y, W, rank)) * (1 / 3)):backward() end)
      -- only the first forward all-gathers; the groups stay unsharded after the non-syncing backwards
      assert.are.equal(moved(k == 1 and 2 or 0), cnt(c, "all_gather"), "microbatch " .. k)
      assert.are.equal(moved(k == 3 and 2 or 0), cnt(c, "reduce_scatter"), "microbatch " .. k)
      assert.are.equal(k == 3 and "sharded" or "unsharded", dist.fsdp_counts(m[1]).state, "microbatch " .. k)
      assert.are.equal(k ~= 3, not dist.is_dtensor(m[1].weight))
    end
    for name, p in m:named_parameters() do
      assert.is_true(rel(p.grad, ref:get_parameter(name).grad) < 1e-5, name)
    end
  end)

  it("set_gradient_divide_factor(f): the reduced gradients are the ranks' sum divided by f", function()
    for _, f in ipairs({ 1, 3 }) do
      local ref, m = mlp(6, 10, 2)(), mlp(6, 10, 2)()
      shard_mlp(m, { mesh = mesh })
      m:set_gradient_divide_factor(f)
      local x, y = mlp_batch(6, 2)(5)
      mse(ref, x, y):backward()
      mse(m, local_rows(x, W, rank), local_rows(y, W, rank)):backward()
      for name, p in m:named_parameters() do
        -- each rank's mean loss over its rows: the ranks' sum is W x the global-batch gradient
        local e = rel(p.grad, ref:get_parameter(name).grad * (W / f))
        assert.is_true(e < 1e-5, string.format("f = %g %s: %g", f, name, e))
      end
    end
    assert.is_truthy(errmsg(function() shard_mlp(mlp(2, 2, 2)(), { mesh = mesh }):set_gradient_divide_factor(0) end)
      :find("expected a positive number", 1, true))
  end)

  it("a pending unshard{async_op = true} is waited for in forward-pre (no second all-gather)", function()
    local ref, m = mlp(7, 15, 3)(), mlp(7, 15, 3)()
    shard_mlp(m, { mesh = mesh })
    local x = mlp_batch(7, 3)(6)
    local c, y = counted(function()
      local h = m[1]:unshard({ async_op = true })
      assert.is_not_nil(h)
      local y = m(local_rows(x, W, rank))
      h:wait()   -- already finished: a no-op
      return y
    end)
    assert.are.equal(moved(2), cnt(c, "all_gather"))   -- m[1]'s (the async one) and m[3]'s
    assert.is_true(rel(y, local_rows(ref(x), W, rank)) < 1e-5)
    assert.are.equal("sharded", dist.fsdp_counts(m[1]).state)
  end)

  it("set_is_last_backward(false): the end of backward leaves the reduce-scatters in flight; the last one waits", function()
    local ref, m = mlp(7, 15, 3)(), mlp(7, 15, 3)()
    shard_mlp(m, { mesh = mesh })
    m:set_overlap({ async_reduce = true })   -- reduce-scatters left in flight (the CUDA default)
    local x, y = mlp_batch(7, 3)(7)
    local function micro(k)
      local xs = x * k
      ;(mse(ref, xs, y) * (1 / 3)):backward()
      ;(mse(m, local_rows(xs, W, rank), local_rows(y, W, rank)) * (1 / 3)):backward()
    end
    local function check_grads()
      for name, p in m:named_parameters() do
        assert.is_true(rel(p.grad, ref:get_parameter(name).grad) < 1e-5, name)
      end
    end
    m:set_is_last_backward(false)
    micro(1)
    -- m[3] reduced first (finished when m[1]'s was issued), m[1] last: still in flight, .grad not written
    -- (at 1 rank nothing is reduced: the gradients are in .grad at once)
    assert.are.equal(W > 1, dist.fsdp_counts(m[1]).reduce_pending)
    if W > 1 then assert.is_nil(m[1].weight.grad) end
    assert.is_false(dist.fsdp_counts(m[3]).reduce_pending)
    assert.is_not_nil(m[3].weight.grad)
    m:set_is_last_backward(true)
    micro(2)   -- finishes the first backward's reduction on its way, and waits for its own at the end
    assert.is_false(dist.fsdp_counts(m[1]).reduce_pending)
    check_grads()
    -- an explicit wait finishes what a non-last backward left
    m[3]:set_is_last_backward(false)   -- the flag is the tree's: set on a block, read by the root
    micro(3)
    assert.are.equal(W > 1, dist.fsdp_counts(m[1]).reduce_pending)
    m:wait_for_reductions()
    assert.is_false(dist.fsdp_counts(m[1]).reduce_pending)
    check_grads()
  end)

  it("set_post_optim_event: accepted on a CPU mesh, kept by the root and dropped at its next forward", function()
    local m = shard_mlp(mlp(4, 6, 2)(), { mesh = mesh })
    local x = engine.randn(2, 4)
    m(x):sum():backward()
    local ev = { recorded_after = "optimizer step" }   -- no event objects on a CPU run: any value
    m[1]:set_post_optim_event(ev)                      -- on any module of the tree: the root's
    assert.are.equal(ev, rawget(m, "_fsdp").post_optim_event)
    local c = counted(function() m(x):sum():backward() end)
    assert.is_nil(rawget(m, "_fsdp").post_optim_event)
    assert.are.equal(moved(4), cnt(c, "all_gather"))
  end)

  it("optim.SGD (momentum, weight decay) steps the sharded parameters equal to one process", function()
    parity({
      build = mlp(7, 15, 3),
      shard = function(m) shard_mlp(m, { mesh = mesh }) end,
      optim = function(params) return engine.optim.SGD(params, { lr = 0.05, momentum = 0.9, weight_decay = 0.01 }) end,
      batch = mlp_batch(7, 3), loss = mse, steps = 5,
    })
  end)
end)

describe("fully_shard bad input", function()
  it("containers without forward, meshes of 3 dims, twice on one module, bad options", function()
    assert.is_truthy(errmsg(dist.fully_shard, nn.ModuleList({ nn.Linear(2, 2) }), { mesh = mesh })
      :find("fully_shard does not support containers that do not implement forward", 1, true))
    if W == 4 then
      local m3 = dist.init_device_mesh("cpu", { 1, 2, 2 })
      assert.is_truthy(errmsg(dist.fully_shard, nn.Linear(2, 2), { mesh = m3 })
        :find("fully_shard expects a 1D or 2D DeviceMesh but got", 1, true))
      assert.is_truthy(errmsg(dist.fully_shard, nn.Linear(4, 4), { mesh = mesh, reshard_after_forward = 3 })
        :find("non-trivial divisor", 1, true))
    end
    local l = nn.Linear(2, 2)
    dist.fully_shard(l, { mesh = mesh })
    assert.is_truthy(errmsg(dist.fully_shard, l, { mesh = mesh }):find("already an FSDP module", 1, true))
    assert.is_truthy(errmsg(dist.fully_shard, nn.Linear(2, 2), { mesh = mesh, bogus = 1 }):find("unknown option 'bogus'", 1, true))
    assert.is_truthy(errmsg(dist.fully_shard, nn.Linear(2, 2), { mesh = mesh, shard_placement_fn = function() return dist.Shard(3) end })
      :find("Shard(3) is out of range", 1, true))
    assert.is_truthy(errmsg(dist.fully_shard, nn.Linear(2, 2), { mesh = mesh, shard_placement_fn = function() return dist.Replicate() end })
      :find("must return dist.Shard(dim)", 1, true))
  end)

  it("a parameter shared across two FSDP groups is an error", function()
    local Two = nn.Module:extend("Two")
    function Two:__init() self.a = nn.Linear(3, 3); self.b = nn.Linear(3, 3); self.b.weight = self.a.weight end
    function Two:forward(x) return self.b(self.a(x)) end
    local t = Two()
    dist.fully_shard(t.a, { mesh = mesh })
    assert.is_truthy(errmsg(dist.fully_shard, t.b, { mesh = mesh }):find("shared across two FSDP groups", 1, true))
  end)

  it("a parent sharded before its child: the child's call says to shard bottom-up", function()
    local m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    dist.fully_shard(m, { mesh = mesh })
    local msg = errmsg(dist.fully_shard, m[1], { mesh = mesh })
    assert.is_truthy(msg:find("call fully_shard bottom-up", 1, true), msg)
    assert.is_truthy(msg:find("already sharded by fully_shard on FSDPSequential", 1, true), msg)
  end)

  it("a mesh without this rank fails every rank, naming the rank (not a nil index)", function()
    if W == 1 then return end
    local part = dist.DeviceMesh("cpu", { 0 })
    local msg = errmsg(dist.fully_shard, nn.Linear(3, 3), { mesh = part })
    assert.is_falsy(msg:find("nil value", 1, true), msg)
    assert.is_truthy(msg:find("rank %d+ is not in the mesh DeviceMesh%(.cpu., %[0%]%)"), msg)
    assert.is_truthy(msg:find("must belong to its mesh", 1, true), msg)
  end)

  it("a check that fails on one rank only fails every rank, naming it", function()
    if W == 1 then return end
    local msg = errmsg(dist.fully_shard, nn.Linear(3, 3), { mesh = mesh,
      shard_placement_fn = function() if rank == 1 then return dist.Replicate() end end })
    assert.is_truthy(msg:find("must return dist.Shard(dim)", 1, true), msg)
    if rank ~= 1 then assert.is_truthy(msg:find("rank 1", 1, true), msg) end
  end)

  it("distinct meshes of equal shape over the same ranks fail on every rank (not a hang in forward)", function()
    if W == 1 then return end
    local a = dist.init_device_mesh("cpu", { W })
    local b = dist.init_device_mesh("cpu", { W })
    local msg = errmsg(dist.fully_shard, nn.Linear(4, 4), { mesh = rank == 0 and a or b })
    assert.is_truthy(msg:find("the ranks passed different meshes", 1, true), msg)
    -- the same object on every rank (or the default mesh) is fine
    local l = dist.fully_shard(nn.Linear(4, 4), { mesh = a })
    l(engine.randn(2, 4)):sum():backward()
  end)

  it("ranks that shard different parameters fail on every rank", function()
    if W == 1 then return end
    local m = nn.Linear(4, rank == 0 and 4 or 6)
    assert.is_truthy(errmsg(dist.fully_shard, m, { mesh = mesh }):find("ranks disagree", 1, true))
  end)

  it("a group's shards view one buffer (the all-gather's send buffer, no copy-in); new data breaks it safely", function()
    local C = require("engine.core").C
    local build = mlp(7, 15, 3)
    local ref = build()
    local m = build()
    dist.fully_shard(m, { mesh = mesh })
    local x = engine.randn(4, 7)
    local ps = m:parameters()
    -- every local shard with data lies in one buffer of this rank's chunk: 15x7 + 15 + 3x15 + 3 elements split in
    -- ceil(rows / W) row blocks (padding rows included)
    local lo, hi = math.huge, -math.huge
    for _, p in ipairs(ps) do
      local l = p:to_local()
      if l:numel() > 0 then
        local a = tonumber(ffi.cast("intptr_t", l:data_ptr()))
        lo, hi = math.min(lo, a), math.max(hi, a + l:numel() * 4)
      end
    end
    local ceil = function(n) return math.ceil(n / W) end
    local chunk = (ceil(15) * 7 + ceil(15) + ceil(3) * 15 + ceil(3)) * 4
    if lo < math.huge then assert.is_true(hi - lo <= chunk, string.format("span %d > chunk %d", hi - lo, chunk)) end
    -- on one node the all-gather reads each peer's chunk straight into the unsharded parameters (single copy)
    local one_node = W > 1 and dist.world_group():single_copy_usable()
    local sc = dist.single_copy_count()
    assert.is_true(rel(m(x), ref(x)) < 1e-6)
    assert.equal(one_node and 1 or 0, dist.single_copy_count() - sc)
    -- new data for the first weight (set_data: a new storage) on rank 0 only, the same values: its chunk is no
    -- longer current, so every rank takes the MPI all-gather (agreed: no hang), with the same result
    local w = ps[1]
    if rank == 0 then assert.equal(0, C.eng_tensor_set_data(w._c, w:to_local():clone()._c)) end
    m:reshard()   -- (the root kept its parameters unsharded after forward)
    sc = dist.single_copy_count()
    assert.is_true(rel(m(x), ref(x)) < 1e-6)
    assert.equal(0, dist.single_copy_count() - sc)
    -- new data on every rank: the unshard packs a send buffer
    local nw = engine.randn(15, 7)
    local l = w:to_local()
    local rows = l:shape()[1]
    local mine = nw:narrow(1, rank * ceil(15) + 1, rows):clone()
    assert.equal(0, C.eng_tensor_set_data(w._c, mine._c))
    ref[1].weight:detach():copy_(nw)
    m:reshard()
    assert.is_true(rel(m(x), ref(x)) < 1e-6)
  end)

  it("shard_placement_fn shards on another dim", function()
    parity({
      build = mlp(6, 8, 4),
      shard = function(m) shard_mlp(m, { mesh = mesh, shard_placement_fn = function(p) if #p:shape() == 2 then return dist.Shard(2) end end }) end,
      batch = mlp_batch(6, 4), loss = mse, steps = 3,
    })
  end)
end)
