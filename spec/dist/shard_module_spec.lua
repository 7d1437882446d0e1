-- Seed 002's module API: shard_parameter (values, gather, reshard, every seed error on every rank),
-- load_with_process_group, shard_module with ShardingPlan / Sharder / output_plan / return_local_tensor
-- (a Megatron MLP: forward, backward and 5 SGD steps equal one process, the same collectives as the
-- DTensor plan), and every error message of the seed.
local engine = require("engine")
local nn = engine.nn
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local W, R = dist.world_size(), dist.rank()

local sharded = require("spec.dist.helpers.sharded")
local ranks, all_ranks, chunk = sharded.ranks, sharded.all_ranks, sharded.chunk
-- max |a - b| relative to max(1, max |b|)
local function rdiff(a, b) return util.diff(a, b) / math.max(1, b:abs():max():item()) end
local counted = util.counted

local MLP = nn.Module:extend("MegatronMLP")
function MLP:__init(d, h)
  self.fc1 = nn.Linear(d, h)
  self.fc2 = nn.Linear(h, d)
end
function MLP:forward(x) return self.fc2(self.fc1(x):relu()) end

local function copy_mlp(src)
  local m = MLP(8, 4 * W)
  for _, n in ipairs({ "fc1", "fc2" }) do
    m[n].weight = nn.Parameter(src[n].weight:detach():clone())
    m[n].bias = nn.Parameter(src[n].bias:detach():clone())
  end
  return m
end

describe("shard_parameter", function()
  it("nn.Linear(12, 12): local shard = the narrowed weight, gather to rank 1, reshard dim 1 -> 2 = a direct shard", function()
    engine.manual_seed(1)
    local m = nn.Linear(12, 12)
    local full = m.weight:detach():clone()
    dist.broadcast(full, 0)
    local spec = chunk(1)
    local st = dist.shard_parameter(m, "weight", spec)
    local s = st:local_shards()[1]
    local o, z = s.metadata.shard_offsets[1], s.metadata.shard_sizes[1]
    assert.are.equal(0, util.diff(s.tensor, full:narrow(1, o + 1, z)))
    -- the parameter is the DTensor of the ShardedTensor, sharing its storage
    assert.is_true(dist.is_dtensor(m.weight) and nn.is_parameter(m.weight) and m.weight.requires_grad)
    assert.are.equal(s.tensor:data_ptr(), m.weight:to_local():data_ptr())
    local dst = W > 1 and 1 or 0
    local g = st:gather(dst)
    if R == dst then assert.are.equal(0, util.diff(g, full)) else assert.is_nil(g) end
    local r = st:reshard(chunk(2))
    assert.are.equal(st, r)                         -- in place, as PyTorch's: the module's parameter follows
    assert.is_true(r:equal(dist.shard_tensor(full, chunk(2))))
    assert.is_true(dist.is_dtensor(m.weight) and nn.is_parameter(m.weight) and m.weight.requires_grad)
    assert.are.equal("Shard(2)", tostring(m.weight.placements[1]))
    -- the state dict holds the ShardedTensor
    local sd = m:state_dict()
    assert.is_true(dist.is_sharded_tensor(sd.weight))
    assert.are.equal(chunk(2), sd.weight:sharding_spec())
    assert.is_true(sd.weight:equal(st))
    assert.is_false(dist.is_sharded_tensor(sd.bias))
    -- the module still computes (DTensor dispatch; a plain input counts as replicated)
    local x = engine.randn(3, 12)
    dist.broadcast(x, 0)
    local y = m(x)
    local want = x:matmul(full:t()) + m.bias:detach()
    assert.is_true(util.diff(dist.is_dtensor(y) and y:full_tensor() or y, want) < 1e-5)
  end)

  it("specs with several shards per rank keep the ShardedTensor in the module, state dict included", function()
    local m = nn.Linear(4, 2 * W + 1)
    local full = m.weight:detach():clone()
    dist.broadcast(full, 0)
    local st = dist.shard_parameter(m, "weight", chunk(1, all_ranks(2)))
    assert.are.equal(st, m.weight)
    assert.are.equal(2, #st:local_shards())
    local sd = m:state_dict()
    assert.are.equal(st, sd.weight)
    assert.are.equal(1, #m:state_dict_keys())     -- bias only: the ShardedTensor is not a registered parameter
    -- load_state_dict takes a ShardedTensor of the same layout back
    local other = dist.sharded_tensor.full(chunk(1, all_ranks(2)), { 2 * W + 1, 4 }, 2)
    m:load_state_dict({ weight = other, bias = m.bias:detach():clone() })
    assert.is_true(st:equal(other))
  end)

  it("every seed error, on every rank (also when only one rank's argument is bad)", function()
    local m = nn.Linear(4, 4)
    local e = util.errmsg(dist.shard_parameter, m, "nope", chunk(1))
    assert.is_truthy(e:find("Linear has no attribute `nope`", 1, true), e)
    e = util.errmsg(dist.shard_parameter, m, "training", chunk(1))
    assert.is_truthy(e:find("Expected Linear.training to be a Tensor, but found bool", 1, true), e)
    assert.is_falsy(e:find("found boolean", 1, true), e)
    m.scale, m.name, m.ratio = 3, "lin", 0.5
    for k, py in pairs({ scale = "int", name = "str", ratio = "float" }) do
      e = util.errmsg(dist.shard_parameter, m, k, chunk(1))
      assert.is_truthy(e:find("Expected Linear." .. k .. " to be a Tensor, but found " .. py, 1, true), e)
    end
    local t = nn.Linear(4, 6)
    t.weight = nn.Parameter(engine.randn(4, 6):t())
    e = util.errmsg(dist.shard_parameter, t, "weight", chunk(1))
    assert.is_truthy(e:find("param: weight is not a contiguous Tensor", 1, true), e)
    -- only the last rank's parameter is not contiguous: every rank fails, naming it
    local u = nn.Linear(4, 6)
    if R == W - 1 then u.weight = nn.Parameter(engine.randn(4, 6):t()) end
    e = util.errmsg(dist.shard_parameter, u, "weight", chunk(1))
    if R == W - 1 then assert.is_truthy(e:find("param: weight is not a contiguous Tensor", 1, true), e)
    else assert.is_truthy(e:find("shard_parameter: rank " .. (W - 1) .. ": param: weight is not a contiguous Tensor", 1, true), e) end
    if W > 1 then
      e = util.errmsg(dist.shard_parameter, nn.Linear(4, 4), "weight", chunk(1), { src_rank = R })
      assert.is_truthy(e:find("does not match with src_rank=", 1, true), e)
      e = util.errmsg(dist.shard_parameter, nn.Linear(4, 4), "weight", chunk(R == 0 and 1 or 2))
      assert.is_truthy(e:find("does not match with sharding_spec=ChunkShardingSpec(dim=", 1, true), e)
    end
    -- everything still agrees afterwards
    local ok = dist.shard_parameter(nn.Linear(4, 4), "weight", chunk(2))
    assert.are.same({ 4, 4 }, ok:size())
  end)

  it("load_with_process_group sets the group for fn; nesting is an error", function()
    local g = dist.new_group(all_ranks())
    local got = dist.load_with_process_group(g, function(pg) return pg, dist._get_current_process_group() end)
    assert.are.equal(g, got)
    assert.is_nil(dist._get_current_process_group())
    local e = util.errmsg(dist.load_with_process_group, g, function()
      return dist.load_with_process_group(g, function() end)
    end)
    assert.is_truthy(e:find('ProcessGroup already set by previous "load_with_process_group" context manager', 1, true), e)
    assert.is_nil(dist._get_current_process_group())
  end)
end)

describe("shard_module", function()
  it("Megatron MLP by a ShardingPlan: forward, backward, 5 SGD steps equal one process; DTensor plan's collectives", function()
    engine.manual_seed(5)
    local ref = MLP(8, 4 * W)
    local m = copy_mlp(ref)
    local tp = copy_mlp(ref)
    local B = 2 * W
    local plan = dist.ShardingPlan{
      plan = { ["fc1.weight"] = chunk(1), ["fc1.bias"] = chunk(1), ["fc2.weight"] = chunk(2) },
      output_plan = { fc2 = chunk(1) },
      return_local_tensor = { "fc2" },
    }
    dist.shard_module(m, plan)
    local mesh = dist.init_device_mesh("cpu", { W })
    dist.parallelize_module(tp, mesh, { fc1 = dist.ColwiseParallel{ use_local_output = false },
      fc2 = dist.RowwiseParallel{ output_layouts = dist.Shard(1) } })
    local opt = engine.optim.SGD(m:parameters(), { lr = 0.05 })
    local ropt = engine.optim.SGD(ref:parameters(), { lr = 0.05 })
    local topt = engine.optim.SGD(tp:parameters(), { lr = 0.05 })
    for step = 1, 5 do
      local x = engine.randn(B, 8)
      dist.broadcast(x, 0)
      local cf, y = counted(function() return m(x) end)
      local tf, ty = counted(function() return tp(x) end)
      assert.is_false(dist.is_dtensor(y))
      assert.are.same({ 2, 8 }, y:shape())
      local ry = ref(x)
      local dy = rdiff(y, ry:narrow(1, 2 * R + 1, 2))
      assert.is_true(dy < 1e-5, "step " .. step .. " diff " .. dy)
      local cb = counted(function() y:sum():backward() end)
      local tb = counted(function() ty:sum():backward() end)
      ry:sum():backward()
      if W > 1 then
        assert.are.equal(tf, cf)
        assert.are.equal(tb, cb)
        assert.are.equal("reduce_scatter=1", cf)
      end
      assert.is_true(rdiff(m.fc1.weight.grad:full_tensor(), ref.fc1.weight.grad) < 1e-5)
      assert.is_true(rdiff(m.fc1.bias.grad:full_tensor(), ref.fc1.bias.grad) < 1e-5)
      assert.is_true(rdiff(m.fc2.weight.grad:full_tensor(), ref.fc2.weight.grad) < 1e-5)
      local b2 = m.fc2.bias.grad
      assert.is_true(rdiff(dist.is_dtensor(b2) and b2:full_tensor() or b2, ref.fc2.bias.grad) < 1e-5)
      for _, o in ipairs({ opt, ropt, topt }) do o:step(); o:zero_grad() end
    end
    for _, n in ipairs({ "fc1", "fc2" }) do
      assert.is_true(rdiff(m[n].weight:full_tensor(), ref[n].weight:detach()) < 1e-5)
      local b = m[n].bias
      assert.is_true(rdiff(dist.is_dtensor(b) and b:full_tensor() or b, ref[n].bias:detach()) < 1e-5)
    end
  end)

  it("a Sharder replaces its module in the parent; a size-1 chunk dim is squeezed by return_local_tensor", function()
    local Wrap = nn.Module:extend("ShardedLinear")
    function Wrap:__init(lin) self.inner = lin end
    function Wrap:forward(x) return self.inner(x) end
    local RowSharder = dist.Sharder:extend("RowSharder")
    function RowSharder:shard(mod)
      dist.shard_parameter(mod, "weight", chunk(1))
      dist.shard_parameter(mod, "bias", chunk(1))
      self.seen = mod
      return Wrap(mod)
    end
    engine.manual_seed(8)
    local root = nn.Sequential(nn.Linear(3, W))
    local ref, ref_b = root[1].weight:detach():clone(), root[1].bias:detach():clone()
    dist.broadcast(ref, 0)   -- (the values src_rank 0 scatters)
    dist.broadcast(ref_b, 0)
    local sharder = RowSharder{}
    dist.shard_module(root, dist.ShardingPlan{ plan = { ["0"] = sharder }, output_plan = { ["0"] = chunk(2) },
      return_local_tensor = { "0" } })
    assert.are.equal("ShardedLinear", root[1].__name)
    assert.are.equal(sharder.seen, root[1].inner)
    local x = engine.randn(5, 3)
    dist.broadcast(x, 0)
    local y = root(x)                             -- [5, W] over W ranks: [5, 1] locally, squeezed to [5]
    assert.are.same({ 5 }, y:shape())
    -- one process's output, column R
    local want = (x:matmul(ref:t()) + ref_b):narrow(2, R + 1, 1):squeeze(2)
    assert.is_true(util.diff(y, want) < 1e-6, "diff " .. util.diff(y, want))
  end)

  it("a module returning a ShardedTensor: hooks keep it one value; _reshard_output / _collect_local_shard (the seed's case)", function()
    local Producer = nn.Module:extend("STProducer")
    function Producer:__init(spec) self.spec = spec end
    function Producer:forward(x) return dist.shard_tensor(x, self.spec) end
    engine.manual_seed(11)
    local x = engine.randn(W, 16)
    dist.broadcast(x, 0)
    -- any forward hook: the output stays the ShardedTensor (not a list of its fields)
    local p = Producer(chunk(1))
    local seen
    p:register_forward_hook(function(_, _, out) seen = out end)
    local y = p(x)
    assert.is_true(dist.is_sharded_tensor(y))
    assert.are.equal(y, seen)
    assert.is_true(y:equal(dist.shard_tensor(x, chunk(1))))
    -- _reshard_output: through the DTensor (dim 1 -> 2) and the overlap blocks (two shards per rank)
    y = dist._reshard_output(Producer(chunk(1)), chunk(2))(x)
    assert.is_true(dist.is_sharded_tensor(y))
    assert.are.equal(chunk(2), y:sharding_spec())
    assert.is_true(y:equal(dist.shard_tensor(x, chunk(2))))
    y = dist._reshard_output(Producer(chunk(1)), chunk(2, all_ranks(2)))(x)
    assert.are.equal(2, #y:local_shards())
    assert.is_true(y:equal(dist.shard_tensor(x, chunk(2, all_ranks(2)))))
    -- _collect_local_shard: [W, 16] over W ranks is [1, 16] locally, squeezed to row R
    y = dist._collect_local_shard(Producer(chunk(1)))(x)
    assert.is_false(dist.is_sharded_tensor(y))
    assert.are.same({ 16 }, y:shape())
    assert.are.equal(0, util.diff(y, x:narrow(1, R + 1, 1):squeeze(1)))
    -- a chunk dim of size > 1 is kept: [2W, 16] gives [2, 16]
    local x2 = engine.randn(2 * W, 16)
    dist.broadcast(x2, 0)
    y = dist._collect_local_shard(Producer(chunk(1)))(x2)
    assert.are.equal(0, util.diff(y, x2:narrow(1, 2 * R + 1, 2)))
    -- several local shards: local_tensor's error (the seed's)
    local e = util.errmsg(dist._collect_local_shard(Producer(chunk(1, all_ranks(2)))), x2)
    assert.is_truthy(e:find("Only single local shard is supported", 1, true), e)
    -- both through a ShardingPlan: reshard to columns, then the squeezed local column
    local xc = engine.randn(12, W)
    dist.broadcast(xc, 0)
    local root = nn.Sequential(Producer(chunk(1)))
    dist.shard_module(root, dist.ShardingPlan{ plan = {}, output_plan = { ["0"] = chunk(2) }, return_local_tensor = { "0" } })
    y = root(xc)
    assert.are.same({ 12 }, y:shape())
    assert.are.equal(0, util.diff(y, xc:narrow(2, R + 1, 1):squeeze(2)))
  end)

  it("a plan error on one rank only, differing plans, a Sharder failing on one rank: every rank fails, no hang", function()
    local prev = dist.get_comm_timeout()
    dist.set_comm_timeout(60)   -- a regression aborts the job in a minute instead of five
    local last = W - 1
    local S = dist.Sharder:extend("KeepSharder")
    function S:shard(mod) return mod end
    local function plan(p) return dist.ShardingPlan{ plan = p } end
    -- only the last rank's plan has an error (the seed's message there, naming it elsewhere); nothing is sharded
    local m = MLP(8, 4 * W)
    local e = util.errmsg(dist.shard_module, m, R == last and plan{ ["fc1.weight"] = chunk(1), [""] = S{} }
      or plan{ ["fc1.weight"] = chunk(1) })
    if R == last then assert.is_truthy(e:find("Module path must not be empty for custom sharder!", 1, true), e)
    else assert.is_truthy(e:find("shard_module: rank " .. last .. ": Module path must not be empty for custom sharder!", 1, true), e) end
    assert.is_false(dist.is_dtensor(m.fc1.weight))
    -- a path that resolves on the other ranks only
    e = util.errmsg(dist.shard_module, m, plan{ [R == last and "fc3.weight" or "fc2.weight"] = chunk(1) })
    if R ~= last then assert.is_truthy(e:find("shard_module: rank " .. last .. ": ", 1, true), e) end
    assert.is_truthy(e:find("get_submodule: MegatronMLP has no attribute `fc3`", 1, true), e)
    e = util.errmsg(dist.shard_module, m, dist.ShardingPlan{ plan = {}, output_plan = { [R == last and "fc3" or "fc2"] = chunk(1) } })
    assert.is_truthy(e:find("has no attribute `fc3`", 1, true), e)
    if W > 1 then
      -- plans that differ (a Sharder name, a spec, src_rank): every rank names the difference
      e = util.errmsg(dist.shard_module, m, plan{ fc1 = R == last and dist.Sharder:extend("OtherSharder"){} or S{} })
      assert.is_truthy(e:find("shard_module: the ShardingPlan (or src_rank) on rank " .. R .. " differs from rank ", 1, true), e)
      e = util.errmsg(dist.shard_module, m, plan{ ["fc1.weight"] = chunk(R == last and 2 or 1) })
      assert.is_truthy(e:find("differs from rank", 1, true), e)
      assert.is_truthy(e:find("ChunkShardingSpec(dim=2", 1, true), e)
      e = util.errmsg(dist.shard_module, m, plan{ ["fc1.weight"] = chunk(1) }, { src_rank = R == last and 1 or 0 })
      assert.is_truthy(e:find("src_rank=", 1, true), e)
      assert.is_false(dist.is_dtensor(m.fc1.weight))
      -- a Sharder that fails on the last rank only, after its own collectives: every rank fails before fc2's
      local Flaky = dist.Sharder:extend("FlakySharder")
      function Flaky:shard(mod)
        dist.shard_parameter(mod, "weight", chunk(1))
        if R == last then error("FlakySharder: no table for this rank", 0) end
        return mod
      end
      local m2 = MLP(8, 4 * W)
      e = util.errmsg(dist.shard_module, m2, plan{ fc1 = Flaky{}, ["fc2.weight"] = chunk(2) })
      assert.is_truthy(e:find("FlakySharder: no table for this rank", 1, true), e)
      if R ~= last then assert.is_truthy(e:find("rank " .. last, 1, true), e) end
      assert.is_false(dist.is_dtensor(m2.fc2.weight))
    end
    -- everything still agrees afterwards
    dist.shard_module(m, plan{ ["fc1.weight"] = chunk(1), fc2 = S{} })
    assert.is_true(dist.is_dtensor(m.fc1.weight))
    dist.set_comm_timeout(prev)
  end)

  it("every error message of the seed's shard_module", function()
    local S = dist.Sharder:extend("NopSharder")
    function S:shard(mod) return mod end
    local m = MLP(8, 4 * W)
    local e = util.errmsg(dist.shard_module, m, dist.ShardingPlan{ plan = { [""] = S{} } })
    assert.is_truthy(e:find("Module path must not be empty for custom sharder!", 1, true), e)
    e = util.errmsg(dist.shard_module, m, dist.ShardingPlan{ plan = { fc1 = S{}, ["fc1.weight"] = chunk(1) } })
    assert.is_truthy(e:find("ShardingPlan is in-valid, trying to shard a parameter: fc1.weight, but there's already a "
      .. "Sharder entry for module fc1, parameter sharding should not conflict with the submodule tree that a Sharder is "
      .. "working with!", 1, true), e)
    e = util.errmsg(dist.shard_module, m, dist.ShardingPlan{ plan = { ["fc1.weight"] = "rowwise" } })
    assert.is_truthy(e:find("Only `ShardingSpec` and `Sharder` are supported to shard 'fc1.weight'", 1, true), e)
    e = util.errmsg(dist.shard_module, m, dist.ShardingPlan{ plan = {}, output_plan = { fc2 = S{} } })
    assert.is_truthy(e:find("Only `ShardingSpec` is supported as output_plan for 'fc2'", 1, true), e)
    e = util.errmsg(dist.shard_module, m, { plan = {} })
    assert.is_truthy(e:find("shard_module: plan must be a ShardingPlan", 1, true), e)
    e = util.errmsg(dist.ShardingPlan, { plan = {}, outputs = {} })
    assert.is_truthy(e:find("ShardingPlan: unknown field 'outputs'", 1, true), e)
    e = util.errmsg(dist.shard_module, m, dist.ShardingPlan{ plan = { ["fc3.weight"] = chunk(1) } })
    assert.is_truthy(e:find("get_submodule: MegatronMLP has no attribute `fc3`", 1, true), e)
  end)
end)
