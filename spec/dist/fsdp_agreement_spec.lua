-- FSDP silent wrong results: load_state_dict failing on one rank inside pcall left that rank's
-- model as it was while the others loaded (now every rank raises before anything is written); load_state_dict
-- into an unsharded FSDP module (reshard_after_forward = false, or the root after forward) was ignored by the
-- next forward, which used its stale all-gathered copy (now the group is resharded first, as FSDP2's to_sharded
-- hooks do; the same for state_dict, so dist.checkpoint.load into model:state_dict() is seen); requires_grad
-- differing per rank was accepted by fully_shard and gave wrong gradients (now refused on every rank); a new
-- Parameter assigned to an FSDP-managed attribute was ignored by forward (now refused).  1, 2 and 4 ranks.
local engine = require("engine")
local nn = engine.nn
local dist = engine.distributed
local fsdp = require("engine.distributed.fsdp")
local util = require("spec.dist.helpers.util")
local errmsg, diff = util.errmsg, util.diff

local W, R = dist.world_size(), dist.rank()
local mesh = dist.init_device_mesh("cpu", { W })

local function full(t) if dist.is_dtensor(t) then return t:full_tensor() end return t end

local MLP = nn.Module:extend("AgreeMLP")
function MLP:__init()
  self.a = nn.Linear(4, 8)
  self.b = nn.Linear(8, 3)
end
function MLP:forward(x) return self.b(self.a(x):relu()) end

local function model(seed, raf)
  engine.manual_seed(seed)
  local m = MLP()
  dist.fully_shard(m.a, { mesh = mesh, reshard_after_forward = raf })
  dist.fully_shard(m, { mesh = mesh, reshard_after_forward = raf })
  return m
end
local function reference(seed)
  engine.manual_seed(seed)
  return MLP()
end
-- the full values of every parameter, by name (in one order on every rank: full_tensor is collective)
local function snapshot(m)
  local r, sd = {}, m:state_dict()
  for _, name in ipairs(m:state_dict_keys()) do r[name] = full(sd[name]):clone() end
  return r
end
local function same_as(m, snap)
  local sd = m:state_dict()
  local same = true
  for _, name in ipairs(m:state_dict_keys()) do
    if diff(full(sd[name]), snap[name]) ~= 0 then same = false end
  end
  return same
end
-- every rank raised, with the same first line length? (the failing rank has its own message, the others
-- "rank N ... failed its checks: <that message>")
local function all_raised(ok)
  local t = engine.tensor({ ok and 1 or 0 }, "f64")
  dist.all_reduce(t, "max")
  return t:item() == 0
end

describe("load_state_dict on an FSDP model agrees before writing", function()
  it("a state dict that fails on one rank inside pcall fails every rank; no rank's model changes", function()
    if W < 2 then pending("needs 2 ranks"); return end
    local m = model(1)
    local x = engine.randn(2, 4)
    m(x)   -- the root stays unsharded after forward
    local before = snapshot(m)
    local sd = snapshot(reference(9))
    if R == W - 1 then sd["b.weight"] = engine.zeros(3, 7) end   -- a wrong shape on the last rank only
    local ok, e = pcall(m.load_state_dict, m, sd)
    assert.is_true(all_raised(ok))
    e = tostring(e)
    assert.truthy(e:find("size mismatch for b.weight", 1, true), e)
    if R ~= W - 1 then
      assert.truthy(e:find("load_state_dict: rank " .. (W - 1) .. " ", 1, true), e)
      assert.truthy(e:find("failed its checks", 1, true), e)
    end
    assert.is_true(same_as(m, before))
    -- and the next forward still runs on every rank with the old values
    local want = engine.no_grad(function() return m(x):clone() end)
    assert.equal(0, diff(want, engine.no_grad(function() return model(1)(x) end)))
  end)

  it("a missing key on one rank, and a DTensor value on one rank only, fail every rank", function()
    if W < 2 then pending("needs 2 ranks"); return end
    local m = model(2)
    local before = snapshot(m)
    local sd = snapshot(reference(5))
    if R == 0 then sd["a.bias"] = nil end
    local ok, e = pcall(m.load_state_dict, m, sd)
    assert.is_true(all_raised(ok))
    assert.truthy(tostring(e):find("Missing key(s) in state_dict: a.bias", 1, true), tostring(e))
    assert.is_true(same_as(m, before))
    -- rank 0 passes a DTensor of another layout (a redistribution), the others a plain tensor
    local sd2 = snapshot(reference(5))
    if R == 0 then  -- (without communication: rank 0 alone makes it)
      sd2["b.weight"] = dist.distribute_tensor(sd2["b.weight"], mesh, { dist.Shard(2) }, { src_data_rank = false })
    end
    ok, e = pcall(m.load_state_dict, m, sd2)
    assert.is_true(all_raised(ok))
    assert.truthy(tostring(e):find("state dicts whose DTensor entries differ in their layouts", 1, true), tostring(e))
    assert.is_true(same_as(m, before))
  end)

  it("the same state dict everywhere loads (plain values and DTensors of another layout)", function()
    local m = model(3)
    local ref = reference(8)
    local sd = snapshot(ref)
    sd["a.weight"] = dist.distribute_tensor(sd["a.weight"], mesh, { dist.Shard(2) })
    m:load_state_dict(sd)
    local x = engine.randn(3, 4)
    assert.is_true(diff(engine.no_grad(function() return m(x) end), engine.no_grad(function() return ref(x) end)) < 1e-6)
  end)

  it("layouts that cannot be copied are named before anything is written", function()
    local m = model(4)
    local before = snapshot(m)
    local sd = snapshot(reference(6))
    -- a DTensor value into a plain parameter: a plain model
    engine.manual_seed(4)
    local plain = MLP()
    local psd = snapshot(reference(6))
    psd["a.weight"] = dist.distribute_tensor(psd["a.weight"], mesh, { dist.Replicate() })
    local e = errmsg(plain.load_state_dict, plain, psd)
    assert.truthy(e:find("a.weight: the value is a DTensor", 1, true) and e:find("layouts differ", 1, true), e)
    -- a DTensor on another mesh (the ranks in reverse order)
    if W > 1 then
      local rev = {}
      for r = W - 1, 0, -1 do rev[#rev + 1] = r end
      sd["b.bias"] = dist.distribute_tensor(sd["b.bias"], dist.DeviceMesh("cpu", rev), { dist.Replicate() })
      e = errmsg(m.load_state_dict, m, sd)
      assert.truthy(e:find("b.bias: the value", 1, true) and e:find("different device meshes", 1, true), e)
      assert.is_true(same_as(m, before))
    end
  end)
end)

describe("load_state_dict and state_dict reshard an unsharded FSDP group first (FSDP2)", function()
  for _, raf in ipairs({ false, true }) do
    it("the next forward uses the loaded values (reshard_after_forward = " .. tostring(raf) .. ")", function()
      local m = model(11, raf)
      local x = engine.randn(2, 4)
      m(x)
      if raf == false then assert.equal("unsharded", fsdp.fsdp_counts(m.a).state) end
      local ref = reference(12)
      m:load_state_dict(snapshot(ref))
      assert.equal("sharded", fsdp.fsdp_counts(m).state)
      local got = engine.no_grad(function() return m(x) end)
      assert.is_true(diff(got, engine.no_grad(function() return ref(x) end)) < 1e-6)
      -- and with gradients: the backward sees the loaded parameters too
      local y = m(x):sum()
      y:backward()
      local ry = ref(x):sum()
      ry:backward()
      assert.is_true(diff(full(m.b.weight.grad), ref.b.weight.grad) < 1e-5)
    end)
  end

  it("dist.checkpoint.load into model:state_dict() is what the next forward computes with", function()
    local stamp = engine.tensor({ math.floor(engine.time() * 1000) % 100000000 }, "f64")
    dist.broadcast(stamp, 0)
    local dir = string.format("%s/fsdp_agree_%d_w%d", os.getenv("TMPDIR") or "/tmp", stamp:item(), W)
    local src = model(21, false)
    dist.checkpoint.save({ model = src:state_dict() }, dir)
    local m = model(22, false)
    local x = engine.randn(2, 4)
    m(x)   -- unsharded now
    dist.checkpoint.load({ model = m:state_dict() }, dir)
    local want = engine.no_grad(function() return src(x) end)
    assert.is_true(diff(engine.no_grad(function() return m(x) end), want) < 1e-6)
    dist.barrier()
    if R == 0 then os.execute("rm -rf '" .. dir .. "'") end
  end)
end)

describe("fully_shard agrees on requires_grad", function()
  it("a parameter frozen on some ranks only is refused on every rank, naming it", function()
    if W < 2 then pending("needs 2 ranks"); return end
    engine.manual_seed(31)
    local m = MLP()
    if R == 0 then m.a.bias.requires_grad = false end
    local ok, e = pcall(dist.fully_shard, m.a, { mesh = mesh })
    assert.is_true(all_raised(ok))
    e = tostring(e)
    assert.truthy(e:find("fully_shard: requires_grad of", 1, true), e)
    assert.truthy(e:find("differs across ranks", 1, true), e)
    assert.truthy(e:find(R == 0 and "frozen on this rank: 'bias'" or "frozen on this rank: none", 1, true), e)
    assert.is_false(fsdp.is_fsdp_module(m.a))
  end)

  it("the same frozen parameters on every rank: accepted, and the frozen one gets no gradient", function()
    engine.manual_seed(32)
    local m = MLP()
    m.a.bias.requires_grad = false
    dist.fully_shard(m.a, { mesh = mesh })
    dist.fully_shard(m, { mesh = mesh })
    engine.manual_seed(32)
    local ref = MLP()
    ref.a.bias.requires_grad = false
    local x = engine.randn(4, 4)
    m(x):sum():backward()
    ref(x):sum():backward()
    assert.is_nil(m.a.bias.grad)
    assert.is_true(diff(full(m.a.weight.grad), ref.a.weight.grad) < 1e-5)
  end)
end)

describe("assigning to an FSDP-managed parameter", function()
  it("a new Parameter, register_parameter or nil is refused with a clear error; forward is unchanged", function()
    local m = model(41)
    local x = engine.randn(2, 4)
    local want = engine.no_grad(function() return m(x):clone() end)
    for _, f in ipairs({
      function() m.b.weight = nn.Parameter(engine.ones(3, 8)) end,
      function() m.b:register_parameter("weight", nn.Parameter(engine.ones(3, 8))) end,
      function() m.a.bias = nil end,
    }) do
      local e = errmsg(f)
      assert.truthy(e:find("cannot assign to parameter '", 1, true), e)
      assert.truthy(e:find("it is managed by fully_shard", 1, true), e)
    end
    assert.equal(0, diff(engine.no_grad(function() return m(x) end), want))
    -- other attributes are still free
    m.b.note = "x"
    assert.equal("x", m.b.note)
  end)
end)
