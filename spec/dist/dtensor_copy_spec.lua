-- copy_ between DTensors of different layouts and clone() of _StridedShard DTensors, PyTorch's copy_ strategy, adapted
-- from PyTorch's test_tensor_ops.py (DistTensorOpsTest.test_copy_) and FSDP2's test_fully_shard_state_dict.py
-- (test_dp_tp_state_dict_save_load, test_hsdp_tp_state_dict_save_load): the source of copy_ is redistributed to
-- the destination's layout (broadcasting, Partial kept when both are Partial), a clone keeps its layout, and
-- model:load_state_dict(clone of model:state_dict()) works for FSDP over TP (dp x tp and HSDP x TP).
local engine = require("engine")
local nn = engine.nn
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local diff, errmsg = util.diff, util.errmsg

local W, R = dist.world_size(), dist.rank()
local S, Rep, Part, SS = dist.Shard, dist.Replicate, dist.Partial, dist._StridedShard

local function pls(t) local r = {} for i, p in ipairs(t.placements) do r[i] = tostring(p) end return table.concat(r, ",") end

describe("DTensor copy_ (PyTorch's test_copy_)", function()
  local mesh = dist.init_device_mesh("cpu", { W })

  it("the source is redistributed to the destination's layout; the destination keeps its layout", function()
    engine.manual_seed(3)
    local src_t, dst_t = engine.randn(12, 12), engine.zeros(12, 12)
    for _, case in ipairs({ { { Rep() }, { Rep() } }, { { S(1) }, { S(2) } }, { { S(2) }, { Rep() } },
      { { Rep() }, { S(1) } }, { { S(1) }, { S(1) } } }) do
      local src = dist.distribute_tensor(src_t, mesh, case[1])
      local dst = dist.distribute_tensor(dst_t, mesh, case[2])
      dst:copy_(src)
      local what = pls(src) .. " -> " .. pls(dst)
      assert.are.equal(tostring(case[2][1]), pls(dst), what)
      assert.are.equal(0, diff(dst:full_tensor(), src_t), what)
      -- the source is left as it was
      assert.are.equal(tostring(case[1][1]), pls(src), what)
    end
  end)

  it("simple broadcasting and an incompatible source layout: redistributed", function()
    engine.manual_seed(4)
    local v = engine.randn(16)
    for _, case in ipairs({ { { S(1) }, { Rep() } }, { { Rep() }, { S(2) } }, { { S(1) }, { S(2) } } }) do
      local src = dist.distribute_tensor(v, mesh, case[1])
      local dst = dist.distribute_tensor(engine.zeros(8, 16), mesh, case[2])
      dst:copy_(src)
      assert.are.equal(0, diff(dst:full_tensor(), v:view(1, 16):expand(8, 16)), pls(src) .. " -> " .. pls(dst))
    end
    -- PyTorch's [64, 1] into [16, 32, 64, 128] (smaller here): Shard(2) of the source onto each target layout
    local col = engine.randn(8, 1)
    for _, to in ipairs({ { Rep() }, { S(1) }, { S(2) }, { S(3) } }) do
      local src = dist.distribute_tensor(col, mesh, { S(2) })
      local dst = dist.distribute_tensor(engine.zeros(2, 4, 8, 6), mesh, to)
      dst:copy_(src)
      assert.are.equal(0, diff(dst:full_tensor(), col:view(1, 1, 8, 1):expand(2, 4, 8, 6)), pls(dst))
    end
  end)

  it("Partial into Partial is kept without communication; a plain source is still refused", function()
    engine.manual_seed(5)
    local col = engine.randn(8, 1)
    local src = dist.DTensor.from_local(col, mesh, { Part() })
    local dst = dist.DTensor.from_local(engine.zeros(2, 4, 8, 6), mesh, { Part() })
    local counts = dist.count_collectives(function() dst:copy_(src) end)
    assert.are.same({}, counts)
    assert.are.equal("Partial(sum)", pls(dst))
    assert.are.equal(0, diff(dst:to_local(), col:view(1, 1, 8, 1):expand(2, 4, 8, 6)))
    -- a Partial source into a sharded destination: reduced (PyTorch's P -> S)
    local full = engine.randn(8, 6)
    local d2 = dist.distribute_tensor(engine.zeros(8, 6), mesh, { S(1) })
    d2:copy_(dist.DTensor.from_local(full, mesh, { Part() }))
    assert.are.equal(0, diff(d2:full_tensor(), full * W))
    -- into a Partial destination only from its own layout: the refusal says the layouts differ and what to
    -- redistribute (it was the dispatcher's "no sharding strategy")
    local e = errmsg(function() dst:copy_(dist.distribute_tensor(engine.zeros(2, 4, 8, 6), mesh, { Rep() })) end)
    assert.is_truthy(e:find("is Partial(sum) on mesh dim 1 and the source", 1, true), e)
    assert.is_truthy(e:find("layouts differ, and a source cannot be redistributed to Partial; redistribute the "
      .. "destination first", 1, true), e)
    e = errmsg(function() d2:copy_(engine.zeros(8, 6)) end)
    assert.is_truthy(e:find("copy_: the destination is DTensor", 1, true), e)
  end)

  it("_StridedShard: copy_ in and out of it, and clone() keeps it (no communication)", function()
    if W < 2 then pending("a _StridedShard needs 2 ranks"); return end
    local mesh2 = dist.init_device_mesh("cpu", { 2, W / 2 }, { "dp", "tp" })
    engine.manual_seed(6)
    local full = engine.randn(8, 6)
    local layouts = { { SS(1, W / 2), S(1) }, { S(1), S(1) }, { Rep(), S(2) }, { Rep(), Rep() } }
    for _, a in ipairs(layouts) do
      for _, b in ipairs(layouts) do
        local src = dist.distribute_tensor(full, mesh2, a)
        local dst = dist.distribute_tensor(engine.zeros(8, 6), mesh2, b)
        dst:copy_(src)
        local what = pls(src) .. " -> " .. pls(dst)
        assert.are.equal(0, diff(dst:full_tensor(), full), what)
        local counts, c = dist.count_collectives(function() return dst:clone() end)
        assert.are.same({}, counts, what)
        assert.are.equal(pls(dst), pls(c), what)
        assert.are.equal(0, diff(c:to_local(), dst:to_local()), what)
        assert.are_not.equal(c:to_local():data_ptr(), dst:to_local():data_ptr())
      end
    end
  end)
end)

-- FSDP2's _test_state_dict_save_load over TP: a clone of the state dict, filled with new values, loads back into
-- the same local storage.
local MLP = nn.Module:extend("StateDictMLP")
function MLP:__init(d)
  self.in_proj = nn.Linear(d, 4 * d)
  self.out_proj = nn.Linear(4 * d, d)
end
function MLP:forward(x) return self.out_proj(self.in_proj(x):relu()) end

local function save_load(model)
  local old, new = 1, 42 + R
  engine.no_grad(function() for _, p in ipairs(model:parameters()) do p:fill_(old) end end)
  local ptr, layout = {}, {}
  for name, p in model:named_parameters() do
    assert.is_true(dist.is_dtensor(p), name)
    ptr[name], layout[name] = p:to_local():data_ptr(), pls(p)
  end
  local sd = model:state_dict()
  local keys = {}
  for k, v in pairs(sd) do
    keys[#keys + 1] = k
    assert.is_true(dist.is_dtensor(v), k)
    assert.are.equal(layout[k], pls(v), k)
    if v:to_local():numel() > 0 then assert.are.equal(ptr[k], v:to_local():data_ptr(), k) end
  end
  table.sort(keys)
  local new_sd = {}
  for _, k in ipairs(keys) do
    local c = sd[k]:detach():clone()
    assert.are.equal(layout[k], pls(c), k .. ": clone keeps the layout")
    new_sd[k] = engine.no_grad(function() return c:fill_(new) end)
  end
  for _, p in ipairs(model:parameters()) do assert.are.equal(0, diff(p:to_local(), engine.ones_like(p:to_local()) * old)) end
  model:load_state_dict(new_sd)
  for name, p in model:named_parameters() do
    assert.are.equal(0, diff(p:to_local(), engine.ones_like(p:to_local()) * new), name)
    assert.are.equal(layout[name], pls(p), name)
    if p:to_local():numel() > 0 then assert.are.equal(ptr[name], p:to_local():data_ptr(), name) end
  end
end

local function tp_model(tp_mesh, d)
  engine.manual_seed(7)
  local model = nn.Sequential(MLP(d), MLP(d), MLP(d))
  local plan = {}
  for i = 0, 2 do
    plan[i .. ".in_proj"] = dist.ColwiseParallel()
    plan[i .. ".out_proj"] = dist.RowwiseParallel()
  end
  dist.parallelize_module(model, tp_mesh, plan)
  return model
end

describe("FSDP over TP state dicts (FSDP2's test_dp_tp / test_hsdp_tp_state_dict_save_load)", function()
  local TPN = W >= 2 and 2 or 1
  it("dp x tp: load_state_dict(clone of state_dict())", function()
    local mesh = dist.init_device_mesh("cpu", { W / TPN, TPN }, { "dp", "tp" })
    local model = tp_model(mesh["tp"], 8)
    for _, m in ipairs(model:children()) do dist.fully_shard(m, { mesh = mesh["dp"] }) end
    dist.fully_shard(model, { mesh = mesh["dp"] })
    if W == 4 then assert.are.equal("_StridedShard(dim=1, sf=2),Shard(1)", pls(model[1].in_proj.weight)) end
    save_load(model)
  end)

  it("HSDP x tp: load_state_dict(clone of state_dict())", function()
    local mesh = dist.init_device_mesh("cpu", ({ [1] = { 1, 1, 1 }, [2] = { 2, 1, 1 }, [4] = { 2, 1, 2 } })[W],
      { "replicate", "shard", "tp" })
    local model = tp_model(mesh["tp"], 8)
    local fm = mesh({ "replicate", "shard" })
    for _, m in ipairs(model:children()) do dist.fully_shard(m, { mesh = fm }) end
    dist.fully_shard(model, { mesh = fm })
    save_load(model)
  end)

  it("HSDP x tp with a real shard dim: load_state_dict(clone of state_dict())", function()
    if W < 4 then pending("(1, 2, 2) needs 4 ranks"); return end
    local mesh = dist.init_device_mesh("cpu", { 1, 2, 2 }, { "replicate", "shard", "tp" })
    local model = tp_model(mesh["tp"], 8)
    local fm = mesh({ "replicate", "shard" })
    for _, m in ipairs(model:children()) do dist.fully_shard(m, { mesh = fm }) end
    dist.fully_shard(model, { mesh = fm })
    assert.are.equal("Replicate(),_StridedShard(dim=1, sf=2),Shard(1)", pls(model[1].in_proj.weight))
    save_load(model)
  end)
end)

-- Issue 26 item 2: a DTensor on a mesh of the same shape whose ranks come in another order ({0, 1} and {1, 0}):
-- shard i lives on another rank, so copying local to local would permute the data.  copy_ refuses it as `+`
-- does (PyTorch: "DTensor does not support cross-mesh operation"), naming both meshes' ranks, with no
-- communication and the destination left as it was; redistribute onto the other mesh refuses it too.
describe("DTensor copy_ across meshes whose rank order differs", function()
  it("refuses as `+` does, naming both rank orders; nothing is written", function()
    if W < 2 then pending("needs 2 ranks"); return end
    local fwd, rev = {}, {}
    for r = 0, W - 1 do fwd[#fwd + 1] = r; rev[#rev + 1] = W - 1 - r end
    local m1, m2 = dist.DeviceMesh("cpu", fwd), dist.DeviceMesh("cpu", rev)
    local full = engine.arange(4 * W, { dtype = "f32" })
    for _, pl in ipairs({ { S(1) }, { Rep() } }) do
      local src = dist.distribute_tensor(full, m1, pl)
      local dst = dist.distribute_tensor(engine.zeros(4 * W), m2, pl)
      local rev_s = "[" .. table.concat(rev, ", ") .. "]"
      local fwd_s = "[" .. table.concat(fwd, ", ") .. "]"
      local counts = dist.count_collectives(function()
        local e_add = errmsg(function() return dst + src end)
        local e_copy = errmsg(function() dst:copy_(src) end)
        for _, e in ipairs({ e_add, e_copy }) do
          assert.truthy(e:find("DTensor arguments on different device meshes", 1, true), e)
          assert.truthy(e:find("DeviceMesh('cpu', " .. rev_s .. ")", 1, true), e)
          assert.truthy(e:find("DeviceMesh('cpu', " .. fwd_s .. ")", 1, true), e)
          assert.truthy(e:find("another rank order", 1, true), e)
        end
        assert.truthy(e_copy:find("^[^\n]*copy_: "), e_copy)
        local e_red = errmsg(function() return src:redistribute(m2, pl) end)
        assert.truthy(e_red:find("Cross device mesh", 1, true) and e_red:find("another rank order", 1, true), e_red)
      end)
      assert.are.same({}, counts)
      assert.are.equal(0, dst:to_local():abs():sum():item())
      assert.are.equal(0, diff(dst:full_tensor(), engine.zeros(4 * W)))
    end
  end)
end)
