-- dist.checkpoint inputs that saved "successfully" and could not be loaded, or loaded wrong:
-- a different directory per rank (every rank now fails with the same error and nothing is written), keys
-- holding a NUL or a newline byte (refused at save, naming the key), a load into an expanded tensor (PyTorch's
-- internal-overlap error on every rank, before anything is read).  1, 2 and 4 ranks; an async save nobody waits
-- for is spec/checkpoint_exit_spec.lua (it needs whole jobs).
local engine = require("engine")
local dist = engine.distributed
local ckpt = dist.checkpoint
local util = require("spec.dist.helpers.util")
local diff, errmsg = util.diff, util.errmsg
local W, R = dist.world_size(), dist.rank()

local root, newdir = require("spec.dist.helpers.util").dirs("ckpt_agree")
local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end
local mesh = dist.init_device_mesh("cpu", { W })

-- every rank raised, with the same message (the first line: a rank's own path may follow)
local function same_everywhere(msg)
  local t = engine.tensor({ #msg }, "f64")
  local lo, hi = t:clone(), t:clone()
  dist.all_reduce(lo, "min"); dist.all_reduce(hi, "max")
  assert.equal(lo:item(), hi:item(), "the message differs across ranks: " .. msg)
end

teardown(function()
  dist.barrier()
  if R == 0 then os.execute("rm -rf '" .. root .. "'") end
end)

describe("checkpoint.save agrees on the directory", function()
  it("a different directory per rank fails on every rank, writing nothing; the next save works", function()
    if W < 2 then pending("needs 2 ranks"); return end
    local base = newdir()
    local mine = base .. "_rank" .. R
    local w = dist.distribute_tensor(engine.arange(4 * W, { dtype = "f32" }), mesh, { dist.Shard(1) })
    local e = errmsg(function() ckpt.save({ w = w, step = 1 }, mine) end)
    assert.truthy(e:find("checkpoint.save: the ranks passed different directories (this rank: '" .. mine .. "')",
      1, true), e)
    assert.truthy(e:find("every rank must save into the same dir", 1, true), e)
    dist.barrier()
    for r = 0, W - 1 do
      assert.is_false(exists(ckpt.metadata_file(base .. "_rank" .. r)), "metadata in rank " .. r .. "'s dir")
      assert.is_false(exists(ckpt.data_file(base .. "_rank" .. r, r)), "a data file in rank " .. r .. "'s dir")
    end
    -- the world is usable: the same save into one dir works and loads
    ckpt.save({ w = w, step = 1 }, base)
    local st = { w = dist.zeros({ 4 * W }, { mesh = mesh, placements = { dist.Replicate() } }), step = 0 }
    ckpt.load(st, base)
    assert.equal(0, diff(st.w:full_tensor(), engine.arange(4 * W, { dtype = "f32" })))
    assert.equal(1, st.step)
  end)

  it("an async save with a different directory per rank fails the same way", function()
    if W < 2 then pending("needs 2 ranks"); return end
    local base = newdir()
    local e = errmsg(function() ckpt.save({ b = engine.ones(3) }, base .. "_r" .. R, { async = true }) end)
    assert.truthy(e:find("the ranks passed different directories", 1, true), e)
    same_everywhere(e:gsub("'[^']*'", "''"))
  end)
end)

describe("checkpoint.save refuses keys that cannot be loaded", function()
  for _, case in ipairs({ { "a\0b", "a\\0b", "NUL" }, { "a\nb", "a\\10b", "newline" } }) do
    it("a key with a " .. case[3] .. " byte, at any depth: refused on every rank, naming the key", function()
      for _, state in ipairs({ { [case[1]] = engine.ones(2), step = 1 }, { w = engine.ones(2), [case[1]] = 3 },
        { model = { [case[1]] = engine.ones(2), ok = engine.ones(1) } } }) do
        local dir = newdir()
        local e = errmsg(function() ckpt.save(state, dir) end)
        assert.truthy(e:find("checkpoint.save: the key '", 1, true), e)
        assert.truthy(e:find(case[2], 1, true), e)
        assert.truthy(e:find("holds a " .. case[3] .. " byte", 1, true), e)
        same_everywhere(e)
        dist.barrier()
        assert.is_false(exists(ckpt.metadata_file(dir)))
      end
    end)
  end

  it("inside a plain value (a table without tensors, saved whole) any byte saves and loads", function()
    local dir = newdir()
    ckpt.save({ w = engine.ones(2), extra = { ["a\0b"] = 5, ["c\nd"] = "x\0y\nz" } }, dir)
    local st = { w = engine.zeros(2), extra = {} }
    ckpt.load(st, dir)
    assert.equal(5, st.extra["a\0b"])
    assert.equal("x\0y\nz", st.extra["c\nd"])
  end)

  it("other bytes (tab, '|', ';', ':', quotes, UTF-8) save and load", function()
    local dir = newdir()
    local keys = { "a\tb", "a|b", "a;b", "a:b", "a,b", "a\"b", "\195\169t\195\169", "a\rb" }
    local state = {}
    for i, k in ipairs(keys) do state[k] = engine.full({ 2 }, i) end
    ckpt.save(state, dir)
    local back = {}
    for _, k in ipairs(keys) do back[k] = engine.zeros(2) end
    ckpt.load(back, dir)
    for i, k in ipairs(keys) do assert.equal(0, diff(back[k], engine.full({ 2 }, i)), k) end
  end)
end)

describe("checkpoint.load into an expanded tensor", function()
  it("fails on every rank with PyTorch's internal-overlap error, before anything is read", function()
    local dir = newdir()
    ckpt.save({ w = engine.arange(1, 5, { dtype = "f32" }), step = 3 }, dir)
    local base = engine.zeros(1)
    local st = { w = base:expand(4), step = 0 }
    local e = errmsg(function() ckpt.load(st, dir) end)
    assert.truthy(e:find("checkpoint.load: unsupported operation: more than one element of the written-to tensor " ..
      "refers to a single memory location. Please clone() the tensor before performing the operation.", 1, true), e)
    assert.truthy(e:find("('w')", 1, true), e)
    same_everywhere(e)
    assert.equal(0, base:item())
    assert.equal(0, st.step)
    -- a DTensor whose local shard is expanded: the same
    local loc = engine.zeros(1, 1):expand(1, 4)
    local d = dist.DTensor.from_local(loc, mesh, { dist.Replicate() })
    ckpt.save({ d = engine.ones(1, 4) }, dir .. "_d")
    local e2 = errmsg(function() ckpt.load({ d = d }, dir .. "_d") end)
    assert.truthy(e2:find("more than one element of the written-to tensor", 1, true), e2)
    -- a plain target loads
    local ok = { w = engine.zeros(4), step = 0 }
    ckpt.load(ok, dir)
    assert.equal(0, diff(ok.w, engine.arange(1, 5, { dtype = "f32" })))
  end)
end)
