-- ShardedTensor state dicts: model:state_dict() holds ShardedTensors for sharded parameters;
-- dist.sharded_tensor.save writes each rank's local shards plus the global metadata; load checks the
-- saved group state against the current group (PyTorch's "Local rank at save time was ..." errors, on
-- every rank) under load_with_process_group's group; load_state_dict takes the ShardedTensors back.
local engine = require("engine")
local nn = engine.nn
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local W, R = dist.world_size(), dist.rank()

local function ranks(list)
  local r = {}
  for i, k in ipairs(list) do r[i] = "rank:" .. k .. "/cpu" end
  return r
end
local function all_ranks(times)
  local l = {}
  for _ = 1, times or 1 do for k = 0, W - 1 do l[#l + 1] = k end end
  return l
end
local function chunk(dim, list) return dist.ChunkShardingSpec{ dim = dim, placements = ranks(list or all_ranks()) } end

-- a directory name shared by the ranks of this run
local function shared_base()
  local t = engine.tensor({ os.time() % 100000, math.floor(os.clock() * 1e6) % 100000 }, "i64")
  dist.broadcast(t, 0)
  local v = t:totable()
  return string.format("/tmp/engine_st_state_%d_%d", v[1], v[2])
end

local Model = nn.Module:extend("TwoLayer")
function Model:__init()
  self.a = nn.Linear(6, 2 * W)
  self.b = nn.Linear(3, 2 * W + 1)
end
function Model:forward(x) return self.a(x) end

local function sharded_model(seed)
  engine.manual_seed(seed)
  local m = Model()
  dist.shard_parameter(m.a, "weight", chunk(1))                 -- a DTensor Parameter
  dist.shard_parameter(m.b, "weight", chunk(1, all_ranks(2)))   -- two shards per rank: the ShardedTensor
  return m
end

describe("ShardedTensor state dicts", function()
  local base = shared_base()
  local path = base .. "_rank{rank}.safetensors"
  local mine = base .. "_rank" .. R .. ".safetensors"

  it("save / load round trip at the same world size, through state_dict / load_state_dict", function()
    local m = sharded_model(1)
    local sd = m:state_dict()
    assert.is_true(dist.is_sharded_tensor(sd["a.weight"]) and dist.is_sharded_tensor(sd["b.weight"]))
    assert.is_false(dist.is_sharded_tensor(sd["a.bias"]))
    dist.sharded_tensor.save(path, sd)
    local t, meta = engine.load(mine)
    assert.is_truthy(meta["sharded:a.weight"])
    assert.are.equal(2, #sd["b.weight"]:local_shards())
    assert.is_truthy(t["b.weight/shard2"])
    local back = dist.sharded_tensor.load(path)
    for _, k in ipairs({ "a.weight", "b.weight" }) do
      assert.is_true(dist.is_sharded_tensor(back[k]), k)
      assert.are.equal(sd[k]:sharding_spec(), back[k]:sharding_spec())
      assert.are.same(sd[k]:metadata(), back[k]:metadata())
      assert.is_true(back[k]:equal(sd[k]), k)
    end
    assert.are.equal(0, util.diff(back["a.bias"], sd["a.bias"]))
    -- into a model with other values
    local m2 = sharded_model(2)
    assert.is_false(m2:state_dict()["a.weight"]:equal(sd["a.weight"]))
    m2:load_state_dict(back)
    local sd2 = m2:state_dict()
    for _, k in ipairs({ "a.weight", "b.weight" }) do assert.is_true(sd2[k]:equal(sd[k]), k) end
    assert.are.equal(0, util.diff(m2.b.bias, m.b.bias))
    assert.is_true(dist.is_dtensor(m2.a.weight) and nn.is_parameter(m2.a.weight))
    -- a ShardedTensor of another layout is refused, naming both
    local other = dist.sharded_tensor.zeros(chunk(2), { 2 * W + 1, 6 })
    local e = util.errmsg(m2.load_state_dict, m2, { ["a.weight"] = other, ["a.bias"] = m.a.bias, ["b.weight"] = back["b.weight"],
      ["b.bias"] = m.b.bias })
    assert.is_truthy(e:find("a.weight: the ShardedTensor in the state dict is [" .. (2 * W + 1) .. ",6] ChunkShardingSpec(dim=2", 1, true), e)
  end)

  it("loading under another group fails on every rank (PyTorch's messages); load_with_process_group selects it", function()
    local m = sharded_model(3)
    dist.sharded_tensor.save(path, m:state_dict())
    -- the same group, given explicitly: loads
    local g = dist.new_group(all_ranks())
    local sd = dist.load_with_process_group(g, function() return dist.sharded_tensor.load(path) end)
    assert.are.equal(g, sd["a.weight"]:process_group())
    if W > 1 then
      -- another rank's file: the rank differs
      local e = util.errmsg(dist.sharded_tensor.load, base .. "_rank" .. ((R + 1) % W) .. ".safetensors")
      assert.is_truthy(e:find("Local rank at save time was " .. ((R + 1) % W) .. ", but at load time was " .. R, 1, true), e)
      -- a group of another size: rank 0 alone
      local g0 = dist.new_group({ 0 })
      e = util.errmsg(dist.load_with_process_group, g0, function() return dist.sharded_tensor.load(path) end)
      if R == 0 then
        assert.is_truthy(e:find("Local world size at save time was " .. W .. ", but at load time was 1", 1, true), e)
      else
        assert.is_truthy(e:find("this rank is not in the process group set by load_with_process_group", 1, true), e)
      end
      -- one rank's file is missing: every rank fails, naming it
      if R == W - 1 then os.remove(mine) end
      e = util.errmsg(dist.sharded_tensor.load, path)
      if R ~= W - 1 then assert.is_truthy(e:find("sharded_tensor.load: rank " .. (W - 1) .. ": ", 1, true), e) end
    end
    local e = util.errmsg(dist.sharded_tensor.save, path, { x = "text" })
    assert.is_truthy(e:find("'x' is a string, not a tensor or a ShardedTensor", 1, true), e)
    dist.barrier()
    os.remove(mine)
  end)
end)
