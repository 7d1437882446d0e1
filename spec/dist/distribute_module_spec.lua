-- distribute_module (pytorch-semantics 1.3 and C17): partition_fn on every
-- submodule, the remaining parameters and buffers replicated, input_fn /
-- output_fn as forward pre/post hooks, parameters stay registered
-- parameters that require grad, a second call is an error.
local engine = require("engine")
local nn = engine.nn
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local errmsg = util.errmsg

local R, W = dist.rank(), dist.world_size()
local S, Rep = dist.Shard, dist.Replicate

local function diff(a, b)
  if a:numel() == 0 then return 0 end
  return (a:double() - b:double()):abs():max():item()
end

local mesh = dist.init_device_mesh("cpu", { W })

local MyModel = nn.Module:extend("MyModel")
function MyModel:__init(n_features, n_layers)
  local layers = {}
  for i = 1, n_layers do layers[i] = nn.Linear(n_features, n_features) end
  self.seq = nn.Sequential(layers)
  self:register_buffer("scale", engine.ones({ n_features }))
end
function MyModel:forward(x) return self.seq(x) end

local function shard_params(mesh_, mod)
  if mod:is_a(nn.Linear) then
    for pname, p in mod:named_parameters("", false) do
      mod:register_parameter(pname, nn.Parameter(dist.distribute_tensor(p, mesh_, { S(1) })))
    end
  end
end

local function placements_of(model)
  local r = {}
  for name, p in model:named_parameters() do
    assert.is_true(dist.is_dtensor(p), name .. " is not a DTensor")
    assert.is_true(nn.is_parameter(p), name .. " is not a parameter")
    assert.is_true(p.requires_grad, name .. " does not require grad")
    r[name] = tostring(p.placements[1])
  end
  return r
end

describe("distribute_module", function()
  it("partition_fn sharding every Linear gives Shard(1) DTensor parameters (C17)", function()
    engine.manual_seed(1)
    local model = MyModel(5 * W, 20)
    local full = {}
    for name, p in model:named_parameters() do full[name] = p:clone() end
    dist.distribute_module(model, mesh, function(_, mod, m) shard_params(m, mod) end)
    local pl = placements_of(model)
    local n = 0
    for name, p in model:named_parameters() do -- a fixed order: full_tensor is a collective
      n = n + 1
      assert.are.equal("Shard(1)", pl[name], name)
      assert.are.same(full[name]:shape(), p:shape())
      assert.are.equal(0, diff(p:full_tensor(), full[name]))
    end
    assert.are.equal(40, n)
    assert.are.equal(40, #model:parameters())
    -- the buffer is replicated
    assert.is_true(dist.is_dtensor(model.scale))
    assert.are.equal("Replicate()", tostring(model.scale.placements[1]))
  end)

  it("without partition_fn every parameter and buffer is Replicate and keeps its value", function()
    engine.manual_seed(2)
    local model = MyModel(5 * W, 20)
    local full = {}
    for name, p in model:named_parameters() do full[name] = p:clone() end
    local c = dist.count_collectives(dist.distribute_module, model, mesh)
    for name, s in pairs(placements_of(model)) do
      assert.are.equal("Replicate()", s, name)
      assert.are.equal(0, diff(model:get_parameter(name):to_local(), full[name]))
    end
    -- replicated from rank 0: one broadcast per parameter and buffer
    if W > 1 then assert.are.same({ broadcast = 41 }, c) end
  end)

  it("sharding only seq.0 and seq.8 leaves the others Replicate", function()
    local model = MyModel(5 * W, 20)
    dist.distribute_module(model, mesh, function(name, mod, m)
      if name == "seq.0" or name == "seq.8" then shard_params(m, mod) end
    end)
    for name, s in pairs(placements_of(model)) do
      local want = (name:match("^seq%.0%.") or name:match("^seq%.8%.")) and "Shard(1)" or "Replicate()"
      assert.are.equal(want, s, name)
    end
  end)

  it("partition_fn sees every submodule once, the model first, with the mesh", function()
    local model = MyModel(4, 3)
    local seen = {}
    dist.distribute_module(model, mesh, function(name, mod, m)
      assert.are.equal(mesh, m)
      assert.is_true(nn.is_module(mod))
      seen[#seen + 1] = name
    end)
    assert.are.same({ "", "seq", "seq.0", "seq.1", "seq.2" }, seen)
  end)

  it("input_fn and output_fn (3 arguments) run as forward pre/post hooks: output is a plain Tensor", function()
    local Id = nn.Module:extend("IdModel")
    function Id:__init() self.w = nn.Parameter(engine.ones({ 2 })) end
    local got_dtensor
    function Id:forward(x) got_dtensor = dist.is_dtensor(x); return x end
    local model = Id()
    local calls = {}
    dist.distribute_module(model, mesh, nil, function(mod, inputs, m)
      calls[#calls + 1] = "in"
      assert.are.equal(model, mod); assert.are.equal(mesh, m)
      return dist.DTensor.from_local(inputs[1], m, { Rep() })
    end, function(mod, outputs, m)
      calls[#calls + 1] = "out"
      assert.are.equal(model, mod); assert.are.equal(mesh, m)
      assert.is_true(dist.is_dtensor(outputs))
      return outputs:to_local()
    end)
    local x = engine.randn({ 5, 20 })
    local y = model(x)
    assert.is_true(got_dtensor)
    assert.is_false(dist.is_dtensor(y))
    assert.are.equal(0, diff(y, x))
    assert.are.same({ "in", "out" }, calls)
    assert.is_true(dist.is_dtensor(model.w))
  end)

  it("two-argument input_fn / output_fn still work (deprecated); other arities are errors", function()
    local Id = nn.Module:extend("IdModel2")
    function Id:forward(x) return x end
    local model = Id()
    dist.distribute_module(model, mesh, nil, function(inputs, m)
      return dist.DTensor.from_local(inputs[1], m, { Rep() })
    end, function(outputs, _) return outputs:to_local() end)
    local y = model(engine.ones({ 3 }))
    assert.is_false(dist.is_dtensor(y))
    local e = errmsg(dist.distribute_module, Id(), mesh, nil, function(x) return x end)
    assert.is_truthy(e:find("input_fn should take in 3 arguments, but got 1 arguments!", 1, true), e)
    e = errmsg(dist.distribute_module, Id(), mesh, nil, nil, function(a, b, c, d) return a end)
    assert.is_truthy(e:find("output_fn should take in 3 arguments, but got 4 arguments!", 1, true), e)
  end)

  it("two-argument input_fn / output_fn give a FutureWarning \"Deprecating ...\" through the warning handler (C17)", function()
    local Id = nn.Module:extend("IdModel3")
    function Id:forward(x) return x end
    local got = {}
    local prev = dist.set_warning_handler(function(category, message) got[#got + 1] = { category, message } end)
    local ok, err = pcall(function()
      local model = dist.distribute_module(Id(), mesh, nil, function(inputs, m)
        return dist.DTensor.from_local(inputs[1], m, { Rep() })
      end, function(outputs, _) return outputs:to_local() end)
      local n_two = #got
      -- three-argument functions are not deprecated
      dist.distribute_module(Id(), mesh, nil, function(_, inputs, _) return inputs end, function(_, outputs, _) return outputs end)
      return { model(engine.ones({ 3 })), n_two, #got }
    end)
    local mine = dist.set_warning_handler(nil)
    local restored = dist.set_warning_handler(prev)
    assert.is_true(ok, tostring(err))
    local y, n_two, n_all = err[1], err[2], err[3]
    assert.is_false(dist.is_dtensor(y))
    assert.are.equal(0, diff(y, engine.ones({ 3 })))
    assert.are.equal(2, n_two)
    assert.are.equal(2, n_all)
    assert.are.equal("FutureWarning", got[1][1])
    assert.are.equal("FutureWarning", got[2][1])
    assert.is_truthy(got[1][2]:find("^Deprecating input_fn that takes two arguments"), got[1][2])
    assert.is_truthy(got[1][2]:find("please use input_fn that takes in (module, inputs/outputs, device_mesh) instead!", 1, true), got[1][2])
    assert.is_truthy(got[2][2]:find("^Deprecating output_fn that takes two arguments"), got[2][2])
    assert.is_truthy(got[2][2]:find("please use output_fn that takes in (module, inputs/outputs, device_mesh) instead!", 1, true), got[2][2])
    assert.are_not.equal(prev, mine)     -- the capturing handler was the one installed
    assert.are.equal("function", type(restored))
    local e = errmsg(dist.set_warning_handler, "stderr")
    assert.is_truthy(e:find("set_warning_handler: expected a function(category, message) or nil, got string", 1, true), e)
  end)

  it("a second call on the same module is an error; bad arguments are errors", function()
    local model = MyModel(4, 1)
    dist.distribute_module(model, mesh)
    local e = errmsg(dist.distribute_module, model, mesh)
    assert.is_truthy(e:find("distribute_module should only be called once on a module", 1, true), e)
    e = errmsg(dist.distribute_module, MyModel(4, 1), "mesh")
    assert.is_truthy(e:find("device_mesh must be a DeviceMesh", 1, true), e)
    e = errmsg(dist.distribute_module, {}, mesh)
    assert.is_truthy(e:find("expected an nn.Module", 1, true), e)
  end)

  it("parameters stay trainable: a backward through the replicated params gives DTensor grads", function()
    local model = MyModel(4, 1)
    dist.distribute_module(model, mesh)
    local w = model.seq[1].weight
    local l = w:to_local():sum()
    l:backward()
    assert.is_true(dist.is_dtensor(w.grad))
    assert.are.equal(0, diff(w.grad:to_local(), engine.ones({ 4, 4 })))
  end)
end)
