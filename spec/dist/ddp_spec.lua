-- DistributedDataParallel (lua/engine/distributed/ddp.lua, engine/src/ddp/ddp.c), at 1, 2 and 4 ranks: training
-- equals one process on the global batch, one all_reduce per bucket per backward with PyTorch's buckets (a fixture
-- made by PyTorch), buckets start during backward, no_sync accumulates without communication, errors agreed on
-- every rank.
local engine = require("engine")
local nn = engine.nn
local F = nn.functional
local dist = engine.distributed
local models = require("engine.models")
local util = require("spec.dist.helpers.util")

local R, W = dist.rank(), dist.world_size()
local V, T = 32, 8

local function tokens(b, seed)
  engine.manual_seed(seed)
  return (engine.rand(b, T) * V):to("i64")
end
local function rows(x) local b = x:size(1) / W; return x:narrow(1, R * b + 1, b):contiguous() end
local function rel(a, b) return math.abs(a - b) / math.max(1, math.abs(b)) end
local function build(seed)
  engine.manual_seed(seed or 3)
  return models.Transformer{ n_layers = 2, vocab_size = V, max_seq_len = T, dim = 16, n_heads = 4, dropout_p = 0 }
end
local function ce(m, x, y) return F.cross_entropy(m(x):reshape(-1, V), y:reshape(-1)) end
local function global_mean(v)
  local t = engine.tensor({ v }, "f64")
  dist.all_reduce(t, "avg")
  return t:item()
end
local function grad_bytes(m)
  local n = 0
  for _, p in m:named_parameters() do n = n + p:numel() * p:element_size() end
  return n
end

describe("DistributedDataParallel", function()
  it("trains like one process on the global batch (5 AdamW steps; losses, gradients, parameters)", function()
    local ref = build()
    local net = build(100 + R) -- different on every rank: DDP starts everyone from rank 0's weights...
    if R == 0 then net = build() end -- ...which are ref's
    local m = dist.DistributedDataParallel(net, { bucket_cap_mb = 0.01 })
    local opt_r = engine.optim.AdamW(ref:parameters(), { lr = 1e-2, weight_decay = 0.1 })
    local opt_m = engine.optim.AdamW(m:parameters(), { lr = 1e-2, weight_decay = 0.1 })
    for step = 1, 5 do
      local x, y = tokens(4 * W, 10 + step), tokens(4 * W, 20 + step)
      local lm = ce(m, rows(x), rows(y)); lm:backward()
      local lr = ce(ref, x, y); lr:backward()
      local a, b = global_mean(lm:item()), lr:item()
      assert(rel(a, b) <= 1e-5, string.format("step %d: loss %.9g vs %.9g", step, a, b))
      for name, p in net:named_parameters() do
        local d = util.diff(p.grad, ref:get_parameter(name).grad)
        assert(d <= 1e-5, string.format("step %d: grad of %s differs by %g", step, name, d))
      end
      opt_m:step(); opt_m:zero_grad(); opt_r:step(); opt_r:zero_grad()
    end
    for name, p in net:named_parameters() do
      assert(util.diff(p, ref:get_parameter(name)) <= 1e-4, name)
    end
    assert.is_truthy(m:state_dict()["module.norm.weight"])
  end)

  it("buckets as PyTorch's: one bucket, then rebuilt in gradient order, the first at 1 MiB; find_unused_parameters, "
    .. "static_graph (fixture)", function()
    -- spec/fixtures/ddp_buckets.lua (tools/gen_ddp_bucket_fixture.py): per step, every bucket PyTorch launched,
    -- its parameters (registration positions, in bucket order) and bytes; the engine issues the same all_reduces
    local FIX = dofile("spec/fixtures/ddp_buckets.lua")
    for _, case in ipairs(FIX) do
      local c = case.config
      engine.manual_seed(3)
      local net = models.Transformer{ n_layers = c.n_layers, vocab_size = c.vocab_size, max_seq_len = c.max_seq_len,
        dim = c.dim, n_heads = c.n_heads, dropout_p = 0 }
      local m = dist.DistributedDataParallel(net, { bucket_cap_mb = case.bucket_cap_mb,
        find_unused_parameters = case.find_unused_parameters, static_graph = case.static_graph })
      local what = case.name .. " bucket_cap_mb=" .. tostring(case.bucket_cap_mb) .. " find_unused_parameters="
        .. tostring(case.find_unused_parameters) .. " static_graph=" .. tostring(case.static_graph)
      local launched = m:comm_stats() -- the buckets of the first backward
      for step, want in ipairs(case.steps) do
        assert.are.equal(#want, launched.buckets, what .. " step " .. step)
        for k, b in ipairs(want) do
          assert.are.same(b.params, launched.bucket_indices[k], what .. " step " .. step .. " bucket " .. k)
          assert.are.equal(b.bytes, launched.bucket_bytes[k], what .. " step " .. step .. " bucket " .. k)
        end
        engine.manual_seed(step)
        local x = (engine.rand(W, c.max_seq_len) * c.vocab_size):to("i64")
        local counts = util.counted(function()
          F.cross_entropy(m(rows(x)):reshape(-1, c.vocab_size), rows(x):reshape(-1)):backward()
        end)
        local s = m:comm_stats()
        assert.are.equal("all_reduce=" .. #want, counts, what .. " step " .. step)
        assert.are.equal(#want, s.collectives)
        assert.are.equal(grad_bytes(net), s.bytes)
        net:zero_grad()
        launched = s
      end
    end
  end)

  it("at most floor(gradient bytes / bucket size) + 2 all_reduces; a bucket passes the cap by one parameter", function()
    for _, cap in ipairs({ 25, 0.004, 0.001 }) do
      local net = build()
      local m = dist.DistributedDataParallel(net, { bucket_cap_mb = cap })
      local x, y = tokens(2 * W, 1), tokens(2 * W, 2)
      ce(m, rows(x), rows(y)):backward() -- the first backward: one bucket; then rebuilt
      local s = m:comm_stats()
      local bytes, capb = grad_bytes(net), math.floor(cap * 1048576)
      assert.are.equal(1, s.collectives)
      assert(s.buckets <= math.floor(bytes / capb) + 2, cap .. ": " .. s.buckets .. " buckets")
      if cap == 25 then assert.are.equal(1, s.buckets) end
      local sum = 0
      for k = 1, s.buckets do
        sum = sum + s.bucket_bytes[k]
        local last = net:parameters()[s.bucket_indices[k][#s.bucket_indices[k]]]
        if k < s.buckets then -- closed at the cap, not before
          assert(s.bucket_bytes[k] >= capb, "bucket " .. k .. " closed under the cap")
          assert(s.bucket_bytes[k] - last:numel() * last:element_size() < capb, "bucket " .. k .. " closed late")
        end
      end
      assert.are.equal(bytes, sum)
      local counts = util.counted(function() ce(m, rows(x), rows(y)):backward() end)
      assert.are.equal("all_reduce=" .. s.buckets, counts)
    end
  end)

  it("with activation checkpointing (every block, every 2nd) trains like one process without it", function()
    for _, mode in ipairs({ "full", 2 }) do
      local ref, net = build(), build()
      assert.is_true(models.apply_ac(net, mode) > 0)
      local m = dist.DistributedDataParallel(net, { bucket_cap_mb = 0.004, static_graph = mode == "full" })
      local om = engine.optim.AdamW(m:parameters(), { lr = 1e-2 })
      local orf = engine.optim.AdamW(ref:parameters(), { lr = 1e-2 })
      for step = 1, 3 do
        local x, y = tokens(2 * W, 90 + step), tokens(2 * W, 95 + step)
        ce(m, rows(x), rows(y)):backward()
        ce(ref, x, y):backward()
        for name, p in net:named_parameters() do
          local d = util.diff(p.grad, ref:get_parameter(name).grad)
          assert(d <= 1e-5, tostring(mode) .. " step " .. step .. ": grad of " .. name .. " differs by " .. d)
        end
        om:step(); om:zero_grad(); orf:step(); orf:zero_grad()
      end
      assert(m:comm_stats().buckets > 1, tostring(mode) .. ": rebuilt into several buckets")
    end
  end)

  it("starts buckets during backward, before the first parameter's gradient exists", function()
    local net = build()
    local first = net:parameters()[1] -- registered first: its gradient comes last, its bucket is the last one
    local seen
    -- registered before the reducer's hook, so it runs first: the buckets started by then are the earlier ones
    first:register_post_accumulate_grad_hook(function() seen = dist.comm_count("all_reduce") end)
    local m = dist.DistributedDataParallel(net, { bucket_cap_mb = 0.001 })
    ce(m, rows(tokens(2 * W, 5)), rows(tokens(2 * W, 6))):backward() -- the first backward: one bucket, at its end
    assert.are.equal(1, m:comm_stats().collectives)
    seen = nil
    net:zero_grad()
    dist.reset_comm_counts()
    ce(m, rows(tokens(2 * W, 3)), rows(tokens(2 * W, 4))):backward()
    local s = m:comm_stats()
    assert(s.buckets >= 3)
    assert(seen and seen >= 1, "no bucket had started when the last gradient arrived")
    assert(seen < s.buckets, "every bucket had started before the last gradient arrived")
  end)

  it("no_sync accumulates locally; the next backward reduces the sum (gradient accumulation)", function()
    local ref = build()
    local net = build()
    local m = dist.DistributedDataParallel(net, { bucket_cap_mb = 0.01 })
    local xs, ys = {}, {}
    for i = 1, 3 do xs[i], ys[i] = tokens(2 * W, 30 + i), tokens(2 * W, 40 + i) end
    local inside = util.counted(function()
      m:no_sync(function()
        for i = 1, 2 do ce(m, rows(xs[i]), rows(ys[i])):backward() end
      end)
    end)
    assert.are.equal("", inside)
    ce(m, rows(xs[3]), rows(ys[3])):backward()
    for i = 1, 3 do ce(ref, xs[i], ys[i]):backward() end
    for name, p in net:named_parameters() do
      assert(util.diff(p.grad, ref:get_parameter(name).grad) <= 1e-5, name)
    end
  end)

  it("a parameter no rank uses keeps no gradient; frozen parameters are left out", function()
    local net = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    net.spare = nn.Linear(3, 3)
    net[2].bias:requires_grad_(false)
    local fwd = function(x) return net[2](net[1](x)) end
    local m = dist.DistributedDataParallel(net, { bucket_cap_mb = 0.0001 })
    engine.manual_seed(5 + R)
    local x = engine.randn(2, 4)
    local _ = m -- forward through the wrapped network's pieces: the reducer sees only gradients
    fwd(x):sum():backward()
    assert.is_nil(net.spare.weight.grad)
    assert.is_nil(net[2].bias.grad)
    -- the averaged gradient of net[1].weight: the mean over ranks of each rank's own
    local g = net[1].weight.grad:clone()
    engine.manual_seed(5 + R)
    local x2 = engine.randn(2, 4)
    local ref = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    ref:load_state_dict({ ["0.weight"] = net[1].weight:detach(), ["0.bias"] = net[1].bias:detach(),
      ["1.weight"] = net[2].weight:detach(), ["1.bias"] = net[2].bias:detach() })
    ref(x2):sum():backward()
    local mine = ref[1].weight.grad:clone()
    dist.all_reduce(mine, "avg")
    assert(util.diff(g, mine) <= 1e-6)
  end)

  it("a parameter only some ranks use gets the same gradient on every rank: the ranks never diverge", function()
    local function make() engine.manual_seed(7); return nn.Sequential(nn.Linear(4, 3), nn.Linear(4, 3)) end
    for k, opts in ipairs({ {}, { gradient_as_bucket_view = true }, { find_unused_parameters = true },
                            { bucket_cap_mb = 0.00001 } }) do
      local net, ref = make(), make()
      local m = dist.DistributedDataParallel(net, opts)
      local om = engine.optim.AdamW(m:parameters(), { lr = 1e-2 })
      local orf = engine.optim.AdamW(ref:parameters(), { lr = 1e-2 })
      local what = "options set " .. k
      for step = 1, 3 do
        engine.manual_seed(50 + step)
        local x = engine.randn(W, 4)
        -- rank r runs only layer r % 2 + 1: at one rank the second layer is never used and keeps no gradient
        net[R % 2 + 1](x:narrow(1, R + 1, 1)):sum():backward()
        local total
        for r = 0, W - 1 do
          local l = ref[r % 2 + 1](x:narrow(1, r + 1, 1)):sum()
          total = total and total + l or l
        end
        (total / W):backward()
        for name, p in net:named_parameters() do
          local rg = ref:get_parameter(name).grad
          if rg == nil then assert.is_nil(p.grad, what .. " " .. name)
          else
            assert(p.grad ~= nil, what .. " step " .. step .. ": " .. name .. " has no gradient on rank " .. R)
            assert(util.diff(p.grad, rg) <= 1e-6, what .. " step " .. step .. ": " .. name)
          end
        end
        om:step(); om:zero_grad(); orf:step(); orf:zero_grad()
      end
      for name, p in net:named_parameters() do
        assert(util.diff(p, ref:get_parameter(name)) <= 1e-6, what .. ": " .. name)
      end
    end
  end)

  it("gradient_as_bucket_view: gradients are the buckets' slices and train as the copying reducer does", function()
    local ffi = require("ffi")
    local function addr(t) return tonumber(ffi.cast("uintptr_t", t:data_ptr())) end
    for _, set_to_none in ipairs({ false, true }) do
      local a, b = build(), build()
      local ma = dist.DistributedDataParallel(a, { bucket_cap_mb = 25 })
      local mb = dist.DistributedDataParallel(b, { bucket_cap_mb = 25, gradient_as_bucket_view = true })
      local oa = engine.optim.AdamW(ma:parameters(), { lr = 1e-2, weight_decay = 0.1 })
      local ob = engine.optim.AdamW(mb:parameters(), { lr = 1e-2, weight_decay = 0.1 })
      for step = 1, 4 do
        local x, y = tokens(2 * W, 50 + step), tokens(2 * W, 60 + step)
        ce(ma, rows(x), rows(y)):backward()
        ce(mb, rows(x), rows(y)):backward()
        local pb = b:parameters()
        for i, p in ipairs(a:parameters()) do
          assert.are.equal(0, util.diff(p.grad, pb[i].grad), "step " .. step .. " parameter " .. i)
        end
        -- one bucket (rebuilt after step 1 in gradient order): each gradient sits right after the one before it
        local s = mb:comm_stats()
        assert.are.equal(1, s.buckets)
        local order = s.bucket_indices[1]
        if step > 1 then assert.are_not.same(order[1], 1) end -- rebuilt: the first parameter's gradient comes last
        for j = 2, #order do
          local prev, cur = pb[order[j - 1]], pb[order[j]]
          assert.are.equal(addr(prev.grad) + prev:numel() * prev:element_size(), addr(cur.grad),
            "step " .. step .. ": gradient " .. order[j] .. " is not its bucket slice")
        end
        oa:step(); oa:zero_grad(set_to_none); ob:step(); ob:zero_grad(set_to_none)
      end
      for name, p in a:named_parameters() do assert.are.equal(0, util.diff(p, b:get_parameter(name)), name) end
    end
    -- accumulation under no_sync, and a parameter no rank uses keeps no gradient
    local ref, net = build(), build()
    net.spare = nn.Linear(3, 3)
    local m = dist.DistributedDataParallel(net, { bucket_cap_mb = 0.01, gradient_as_bucket_view = true })
    for i = 1, 3 do
      local x, y = tokens(2 * W, 70 + i), tokens(2 * W, 80 + i)
      if i < 3 then m:no_sync(function() ce(m, rows(x), rows(y)):backward() end)
      else ce(m, rows(x), rows(y)):backward() end
      ce(ref, x, y):backward()
    end
    for name, p in ref:named_parameters() do
      assert(util.diff(net:get_parameter(name).grad, p.grad) <= 1e-5, name)
    end
    assert.is_nil(net.spare.weight.grad)
    assert.matches("gradient_as_bucket_view must be a boolean",
      util.errmsg(dist.DistributedDataParallel, build(), { gradient_as_bucket_view = 1 }))
    assert.matches("find_unused_parameters must be a boolean",
      util.errmsg(dist.DistributedDataParallel, build(), { find_unused_parameters = "yes" }))
    assert.matches("static_graph must be a boolean",
      util.errmsg(dist.DistributedDataParallel, build(), { static_graph = 0 }))
  end)

  it("broadcasts parameters and buffers coalesced; rank 0's buffers before each forward (broadcast_buffers)", function()
    local RunningMean = nn.Module:extend("RunningMean")
    function RunningMean:__init()
      self.lin = nn.Linear(4, 3)
      self:register_buffer("running", engine.zeros(4))
    end
    function RunningMean:forward(x)
      engine.no_grad(function() self.running:mul_(0.9):add_(x:mean(1):mul(0.1)) end)
      return self.lin(x)
    end
    local function data(step, r) engine.manual_seed(100 * step + r); return engine.randn(2, 4) end
    engine.manual_seed(11 + R) -- different weights on every rank: the construction gives everyone rank 0's
    local net = RunningMean()
    local counts = util.counted(function() dist.DistributedDataParallel(net, { bucket_cap_mb = 25 }) end)
    assert.are.equal("broadcast=1", counts) -- PyTorch's _sync_module_states: one flat f32 buffer
    engine.manual_seed(11)
    local r0 = RunningMean()
    for name, p in r0:named_parameters() do assert.are.equal(0, util.diff(net:get_parameter(name), p), name) end
    local m = dist.DistributedDataParallel(net)
    local running0 = engine.zeros(4) -- rank 0's buffer, followed on every rank
    for step = 1, 3 do
      local before = running0
      counts = util.counted(function() m(data(step, R)):sum():backward() end)
      assert.matches("broadcast=1", counts, 1, true)
      -- this rank updated rank 0's buffer with its own batch
      local want = before:mul(0.9):add(data(step, R):mean(1):mul(0.1))
      assert(util.diff(net.running, want) <= 1e-6, "step " .. step)
      running0 = before:mul(0.9):add(data(step, 0):mean(1):mul(0.1))
    end
    -- as PyTorch: a forward without gradients syncs once (the last training forward asked for it), then not
    assert.are.equal("broadcast=1", util.counted(function() engine.no_grad(function() m(data(9, R)) end) end))
    assert.are.equal("", util.counted(function() engine.no_grad(function() m(data(9, R)) end) end))
    -- no_sync: the forward inside it syncs (the training forward before asked for it) and asks for none after it
    m(data(10, R)):sum():backward()
    assert.are.equal("broadcast=1", util.counted(function() m:no_sync(function() m(data(11, R)) end) end))
    assert.are.equal("", util.counted(function() m(data(12, R)) end))
    -- broadcast_buffers = false: never
    local m2 = dist.DistributedDataParallel(RunningMean(), { broadcast_buffers = false })
    local c2 = util.counted(function() m2(data(1, R)):sum():backward() end)
    assert.are.equal("all_reduce=1", c2)
  end)

  it("register_comm_hook with the built-in hooks: fp16 / bf16 compression averages in half precision", function()
    local hooks = dist.algorithms.ddp_comm_hooks.default_hooks
    local function grads(hook)
      local net = build()
      local m = dist.DistributedDataParallel(net, { bucket_cap_mb = 0.004 })
      if hook then m:register_comm_hook(nil, hooks[hook]) end
      local x, y = tokens(2 * W, 7), tokens(2 * W, 8)
      for _ = 1, 2 do -- the second backward runs on the rebuilt buckets
        net:zero_grad()
        ce(m, rows(x), rows(y)):backward()
      end
      local g = {}
      for name, p in net:named_parameters() do g[name] = p.grad:clone() end
      return g, m:comm_stats()
    end
    local g0, s0 = grads(nil)
    local g1, s1 = grads("allreduce_hook")
    for name, g in pairs(g0) do assert.are.equal(0, util.diff(g, g1[name]), name) end
    assert.are.equal(s0.bytes, s1.bytes)
    for _, case in ipairs({ { "fp16_compress_hook", "f16", 2 ^ -10 }, { "bf16_compress_hook", "bf16", 2 ^ -7 } }) do
      local g, s = grads(case[1])
      assert.are.equal(s0.bytes / 2, s.bytes, case[1] .. ": half the bytes")
      assert.are.equal(s0.collectives, s.collectives)
      local rounded = false
      for name, ref in pairs(g0) do
        rounded = rounded or util.diff(g[name], ref) > 0
        -- each rank's gradient rounded to the half dtype, averaged there and rounded again: within a few of its ulps
        local want = (W > 1) and ref or ref:to(case[2]):to("f32")
        local tol = 3 * case[3] * ref:abs():max():item() + 1e-30
        assert(util.diff(g[name], want) <= tol, case[1] .. " " .. name .. ": " .. util.diff(g[name], want))
      end
      assert(rounded, case[1] .. ": the gradients are the f32 average: no half precision on the way")
    end
    local m = dist.DistributedDataParallel(build())
    m:register_comm_hook(nil, hooks.bf16_compress_hook)
    assert.matches("can only be registered once", util.errmsg(m.register_comm_hook, m, nil, hooks.fp16_compress_hook))
    assert.matches("a Lua function cannot run inside the C reducer",
      util.errmsg(m.register_comm_hook, dist.DistributedDataParallel(build()), nil, function() end))
    assert.matches("pass it to DistributedDataParallel:register_comm_hook", util.errmsg(hooks.fp16_compress_hook))
  end)

  it("rejects bad input with the same error on every rank", function()
    assert.matches("unknown option 'bucket_size'", util.errmsg(dist.DistributedDataParallel, build(), { bucket_size = 1 }))
    assert.matches("bucket_cap_mb must be a positive number",
      util.errmsg(dist.DistributedDataParallel, build(), { bucket_cap_mb = 0 }))
    assert.matches("expected an nn.Module", util.errmsg(dist.DistributedDataParallel, 3))
    -- PyTorch's device_ids: one element, the GPU of a module on one GPU; a CPU module takes none
    assert.matches("device_ids and output_device only work with a module on one GPU, got device_ids 0 and module "
      .. "parameters on cpu", util.errmsg(dist.DistributedDataParallel, build(), { device_ids = { 0 } }), 1, true)
    assert.matches("device_ids can only be nil or contain a single element, got 2 elements",
      util.errmsg(dist.DistributedDataParallel, build(), { device_ids = { 0, 1 } }), 1, true)
    assert.matches("output_device must be a CUDA device index or \"cuda:N\", got gpu",
      util.errmsg(dist.DistributedDataParallel, build(), { output_device = "gpu" }), 1, true)
    if W > 1 then
      -- rank 0's network has one more layer: the agreement fails on every rank (no rank waits in a collective)
      local net = R == 0 and nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)) or nn.Sequential(nn.Linear(3, 3))
      local e = util.errmsg(dist.DistributedDataParallel, net, { init_sync = false })
      assert.matches("DistributedDataParallel", e)
      -- the group still works
      local t = engine.ones(2)
      dist.all_reduce(t)
      assert.are.equal(W, t:get(1))
    end
  end)
end)
