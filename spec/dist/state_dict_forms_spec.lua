-- State dicts in three forms (PyTorch's get_state_dict/set_state_dict; lua/engine/distributed/state_dict.lua): model:state_dict()
-- (sharded DTensors), dist.get_state_dict(..., {full = true, cpu_offload, rank0_only}) (full tensors,
-- gathered one at a time: the allocator's peak is measured) and the ShardedTensor form ({sharded = true},
-- tensor/parallel/fsdp.py's path), each saved from a plain (one process), FSDP, TP and 2-D (FSDP over TP) model, loaded
-- by dist.set_state_dict into every other layout: equal full_tensor()s of parameters and AdamW states
-- (keyed by parameter name, in the parameter's layout), and one more step equal to the source's.  Bad
-- input fails on every rank.  Meshes: (2, 2) at 4 ranks, (W, 1) below; FSDP and TP alone on W ranks.
local engine = require("engine")
local nn = engine.nn
local F = nn.functional
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local errmsg = util.errmsg

local W, R = dist.world_size(), dist.rank()
local TPN = W == 4 and 2 or 1
local DPN = W / TPN
local world = dist.init_device_mesh("cpu", { W })
local mesh = dist.init_device_mesh("cpu", { DPN, TPN }, { "dp", "tp" })
local dp, tp = mesh["dp"], mesh["tp"]

local function full(t) if dist.is_dtensor(t) then return t:full_tensor() end return t end
local function pl_str(t)
  if not dist.is_dtensor(t) then return "plain" end
  local s = {}
  for i, p in ipairs(t.placements) do s[i] = tostring(p) end
  return table.concat(s, ",")
end

local D = 3
local function mlp(seed)
  engine.manual_seed(seed)
  local m = nn.Module:extend("MLP")()
  m.net1 = nn.Linear(D, 4 * D)
  m.net2 = nn.Linear(4 * D, D)
  function m:forward(x) return self.net2(F.relu(self.net1(x))) end
  return m
end

local layouts = {
  plain = function(m) return m end,
  fsdp = function(m)
    dist.fully_shard(m.net1, { mesh = world }); dist.fully_shard(m.net2, { mesh = world }); dist.fully_shard(m, { mesh = world })
    return m
  end,
  tp = function(m)
    dist.parallelize_module(m, world, { net1 = dist.ColwiseParallel(), net2 = dist.RowwiseParallel() })
    return m
  end,
  ["2d"] = function(m)
    dist.parallelize_module(m, tp, { net1 = dist.ColwiseParallel(), net2 = dist.RowwiseParallel() })
    dist.fully_shard(m.net1, { mesh = dp }); dist.fully_shard(m.net2, { mesh = dp }); dist.fully_shard(m, { mesh = dp })
    return m
  end,
}
local order = { "plain", "fsdp", "tp", "2d" }

local function batch(seed)
  engine.manual_seed(seed)
  return engine.randn(4, D), engine.randn(4, D)
end

-- every rank passes the whole batch: FSDP's mean over dp ranks of equal gradients is the one-process gradient
local function step(m, opt, seed)
  local x, y = batch(seed)
  F.mse_loss(m(x), y):backward()
  opt:step()
  opt:zero_grad()
end

local function build(kind, seed, lr)
  local m = layouts[kind](mlp(seed))
  return m, engine.optim.AdamW(m:parameters(), { lr = lr or 1e-2, weight_decay = 0.01 })
end

local function rel(a, b)
  a, b = full(a):to("f64"), full(b):to("f64")
  return (a - b):abs():max():item() / math.max(1e-6, b:abs():max():item())
end

describe("state dicts in three forms, every layout into every other", function()
  for _, src_kind in ipairs(order) do
    it("saved from " .. src_kind .. ": DTensor, full and ShardedTensor forms load into plain, fsdp, tp and 2d", function()
      local sm, sopt = build(src_kind, 11)
      step(sm, sopt, 101)
      -- reference values: full tensors of the source's parameters and states
      local want, want_state = {}, {}
      for name, p in sm:named_parameters() do
        want[name] = full(p):clone()
        local st = sopt.state[p]
        want_state[name] = { step = st.step:item(), exp_avg = full(st.exp_avg):clone(), exp_avg_sq = full(st.exp_avg_sq):clone() }
      end
      local forms = {
        dtensor = { dist.get_state_dict(sm, sopt) },
        full = { dist.get_state_dict(sm, sopt, { full = true, cpu_offload = true }) },
        sharded = { dist.get_state_dict(sm, sopt, { sharded = true }) },
      }
      -- the forms look as they should
      for name, p in sm:named_parameters() do
        local fv = forms.full[1][name]
        assert.is_false(dist.is_dtensor(fv), name)
        assert.are.equal(0, util.diff(fv, want[name]), name)
        assert.are.equal(0, util.diff(forms.full[2].state[name].exp_avg, want_state[name].exp_avg), name)
        assert.are.equal(pl_str(p), pl_str(forms.dtensor[1][name]), name)
        assert.is_true(dist.is_sharded_tensor(forms.sharded[1][name]), name)
        assert.is_true(dist.is_sharded_tensor(forms.sharded[2].state[name].exp_avg), name)
        assert.are.equal(sopt.state[p].step:item(), forms.sharded[2].state[name].step:item())
      end
      assert.are.same({ "net1.weight", "net1.bias", "net2.weight", "net2.bias" }, forms.full[2].param_groups[1].params)
      -- the source's parameters after one more step (a copy of it, so the source keeps its state)
      local after = {}
      do
        local cm, copt = build(src_kind, 11)
        step(cm, copt, 101)
        step(cm, copt, 102)
        for name, p in cm:named_parameters() do after[name] = full(p):clone() end
      end
      for _, fname in ipairs({ "dtensor", "full", "sharded" }) do
        for _, dst_kind in ipairs(order) do
          local label = string.format("%s form from %s into %s", fname, src_kind, dst_kind)
          local tm, topt = build(dst_kind, 22, 0.5)
          local sd = forms[fname]
          local c = dist.count_collectives(function()
            dist.set_state_dict(tm, topt, { model_state_dict = sd[1], optim_state_dict = sd[2] })
          end)
          if fname == "full" then
            -- full tensors: every rank copies its part, no collective (the checks' agreement is not one)
            local n = 0
            for _, v in pairs(c) do n = n + v end
            assert.are.equal(0, n, label .. ": collectives")
          end
          assert.are.equal(1e-2, topt.param_groups[1].lr, label)
          for name, p in tm:named_parameters() do
            assert.are.equal(0, util.diff(full(p), want[name]), label .. ": " .. name)
            local st = topt.state[p]
            assert.are.equal(want_state[name].step, st.step:item(), label)
            for _, k in ipairs({ "exp_avg", "exp_avg_sq" }) do
              assert.are.equal(0, util.diff(full(st[k]), want_state[name][k]), label .. ": " .. name .. "." .. k)
              assert.are.equal(pl_str(p), pl_str(st[k]), label .. ": layout of " .. name .. "." .. k)
            end
          end
          -- the loaded optimizer steps as the source does
          step(tm, topt, 102)
          for name, p in tm:named_parameters() do
            assert.is_true(rel(p, after[name]) < 1e-5, label .. ": after a step: " .. name)
          end
        end
      end
    end)
  end
end)

describe("state dicts: the full form holds one full tensor at a time", function()
  -- FSDP (Shard(1) on W ranks), TP (Colwise Shard(1) / Rowwise Shard(2) on W ranks) and FSDP over TP
  -- ([_StridedShard(1), Shard(1)] and [Shard(1), Shard(2)] on the (dp, tp) mesh)
  local N = 128
  local mem_layouts = {
    fsdp = function(m)
      for _, c in ipairs(m:children()) do dist.fully_shard(c, { mesh = world }) end
      dist.fully_shard(m, { mesh = world })
    end,
    tp = function(m)
      dist.parallelize_module(m, world, { ["1"] = dist.ColwiseParallel(), ["2"] = dist.RowwiseParallel(),
        ["3"] = dist.ColwiseParallel(), ["4"] = dist.RowwiseParallel() })
    end,
    ["2d"] = function(m)
      dist.parallelize_module(m, tp, { ["1"] = dist.ColwiseParallel(), ["2"] = dist.RowwiseParallel(),
        ["3"] = dist.ColwiseParallel(), ["4"] = dist.RowwiseParallel() })
      for _, c in ipairs(m:children()) do dist.fully_shard(c, { mesh = dp }) end
      dist.fully_shard(m, { mesh = dp })
    end,
  }
  for _, kind in ipairs({ "fsdp", "tp", "2d" }) do
    it(kind .. ": get_state_dict{full, rank0_only, cpu_offload}: peak over the call (allocator) on every rank", function()
      local m = nn.Sequential(nn.Linear(N, N, { bias = false }), nn.Linear(N, N, { bias = false }),
        nn.Linear(N, N, { bias = false }), nn.Linear(N, N, { bias = false }))
      mem_layouts[kind](m)
      local opt = engine.optim.AdamW(m:parameters(), { lr = 1e-3 })
      engine.manual_seed(3)
      m(engine.randn(2, N)):sum():backward()
      opt:step()
      local P = N * N * 4
      local n_full = 4 * 3   -- parameters and two AdamW states each
      -- the first call flattens the 2-D mesh (a new group, collective): measure the second
      dist.get_state_dict(m, opt, { full = true, rank0_only = true })
      collectgarbage(); collectgarbage()
      engine.reset_peak_memory()
      local base = engine.memory_stats().allocated
      local msd, osd = dist.get_state_dict(m, opt, { full = true, cpu_offload = true, rank0_only = true })
      local peak = engine.memory_stats().peak_allocated - base
      if R == 0 then
        local n = 0
        for _, v in pairs(msd) do n = n + 1; assert.are.same({ N, N }, v:shape()); assert.is_false(dist.is_dtensor(v)) end
        assert.are.equal(4, n)
        for _, st in pairs(osd.state) do assert.are.same({ N, N }, st.exp_avg:shape()) end
        -- the result itself plus at most ~one full tensor in flight
        assert.is_true(peak <= (n_full + 1.5) * P, string.format("rank 0 peak %d bytes (P = %d)", peak, P))
      else
        assert.are.same({}, msd)
        assert.are.same({}, osd.state)
        -- never more than one full tensor (plus small buffers) at a time; all of them would be 12 P
        assert.is_true(peak <= 1.0 * P, string.format("rank %d peak %.2f P over the call", R, peak / P))
      end
      -- without rank0_only every rank holds the results, and at most one more full tensor in flight
      collectgarbage(); collectgarbage()
      engine.reset_peak_memory()
      base = engine.memory_stats().allocated
      msd, osd = dist.get_state_dict(m, opt, { full = true })
      local peak_all = engine.memory_stats().peak_allocated - base
      assert.is_true(peak_all <= (n_full + 1.0) * P, string.format("rank %d peak %.2f P (full on every rank)", R, peak_all / P))
      for name, p in m:named_parameters() do
        assert.are.equal(0, util.diff(msd[name], full(p)), kind .. ": " .. name)
        assert.are.equal(0, util.diff(osd.state[name].exp_avg_sq, full(opt.state[p].exp_avg_sq)), kind .. ": " .. name)
      end
      print(string.format("# state_dict_forms: %s: rank %d: get_state_dict{full, rank0_only} peak %.2f x one full "
        .. "parameter; {full} %.2f x (%d results)", kind, R, peak / P, peak_all / P, n_full))
    end)
  end
end)

describe("state dicts: rank 0's full state dict broadcast into every layout", function()
  it("get_state_dict{full, rank0_only} then set_state_dict{broadcast_from_rank0}: other ranks pass nothing", function()
    local sm, sopt = build("2d", 31)
    step(sm, sopt, 7)
    local msd, osd = dist.get_state_dict(sm, sopt, { full = true, rank0_only = true })
    local want = {}
    for name, p in sm:named_parameters() do want[name] = { full(p):clone(), full(sopt.state[p].exp_avg_sq):clone() } end
    for _, kind in ipairs(order) do
      local tm, topt = build(kind, 41, 0.5)
      local c = dist.count_collectives(function()
        dist.set_state_dict(tm, topt, { model_state_dict = msd, optim_state_dict = osd }, { broadcast_from_rank0 = true })
      end)
      if W > 1 then assert.are.equal(4 + 4 * 2, c.broadcast or 0, kind) end   -- one per tensor (4 parameters, 8 AdamW states)
      assert.are.equal(1e-2, topt.param_groups[1].lr)
      for name, p in tm:named_parameters() do
        assert.are.equal(0, util.diff(full(p), want[name][1]), kind .. ": " .. name)
        assert.are.equal(0, util.diff(full(topt.state[p].exp_avg_sq), want[name][2]), kind .. ": " .. name)
        assert.are.equal(pl_str(p), pl_str(topt.state[p].exp_avg_sq))
      end
    end
    -- rank 0 must hold full tensors
    local dsd = dist.get_state_dict(sm, nil)
    local e = errmsg(dist.set_state_dict, sm, nil, { model_state_dict = dsd }, { broadcast_from_rank0 = true })
    if W > 1 or dist.is_dtensor(dsd["net1.weight"]) then
      assert.is_truthy(e:find("broadcast_from_rank0 loads full tensors", 1, true), e)
    end
  end)
end)

describe("state dicts: bad input fails on every rank", function()
  it("a wrong shape names the key", function()
    local m, opt = build("fsdp", 1)
    local sd = dist.get_state_dict(m, nil, { full = true })
    sd["net1.weight"] = engine.zeros(5, 5)
    local e = errmsg(dist.set_state_dict, m, opt, { model_state_dict = sd })
    assert.is_truthy(e:find("net1.weight: shape [5,5]", 1, true), e)
  end)
  it("a key missing on one rank only fails every rank (agreed before any collective)", function()
    local m, opt = build("2d", 1)
    local sd = dist.get_state_dict(m, nil, { sharded = true })
    if R == W - 1 then sd["net2.bias"] = nil end
    local e = errmsg(dist.set_state_dict, m, opt, { model_state_dict = sd })
    assert.is_truthy(e:find("missing key net2.bias", 1, true) or e:find("rank " .. (W - 1), 1, true), e)
    -- the group is still usable
    local t = engine.ones(1)
    dist.all_reduce(t, "sum")
    assert.are.equal(W, t:item())
  end)
  it("optimizer states keyed by position, unknown options and forms", function()
    local m, opt = build("tp", 1)
    step(m, opt, 5)
    local e = errmsg(dist.set_state_dict, m, opt, { optim_state_dict = opt:state_dict() })
    assert.is_truthy(e:find("states are keyed by parameter name", 1, true), e)
    assert.is_truthy(errmsg(dist.get_state_dict, m, opt, { rank0_only = true }):find("rank0_only needs full = true", 1, true))
    assert.is_truthy(errmsg(dist.get_state_dict, m, opt, { full = true, sharded = true }):find("two different forms", 1, true))
    assert.is_truthy(errmsg(dist.get_state_dict, m, opt, { fulll = true }):find("unknown option 'fulll'", 1, true))
    assert.is_truthy(errmsg(dist.set_state_dict, m, opt, { model = {} }):find("unknown field 'model'", 1, true))
  end)
end)
