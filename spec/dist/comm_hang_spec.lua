-- Hangs that now end within seconds with the same error on every rank (1, 2 and 4 ranks; each case inside
-- pcall on every rank, the assertions after it):
--  (a) agreements meeting other operations on the same group: a rank in dist.checkpoint.save while another
--      calls all_reduce, load against save.  Before: "MPI Error in NBC subrequest" on one rank (the checks'
--      exchanges differed in size) while the other never returned.  Now every check and agreement exchanges
--      the same fixed record, so it is a mismatch naming both, and the group is usable afterwards (its
--      sequence numbers are re-aligned);
--  (b) ranks that disagree on fully_shard's mp_policy (before: a hang in the first forward);
--  (c) group or mesh creation on some ranks only (new_group, init_device_mesh, fully_shard's default mesh):
--      their world agreement is now an agreement on the world group, checked like any collective;
--  (d) ranks waiting on different groups (a forward run on one rank only, parallelize_module on one rank
--      only, an error caught by pcall on one rank, a ShardedTensor reshard whose spec differs per rank):
--      before, only the 300 s comm timeout ended them; now the comm watchdog (ENGINE_COMM_WATCHDOG, 1 s)
--      finds the ranks waiting on different groups for each other and every one of them raises the same
--      verdict within seconds; the groups involved then refuse calls, saying so, and other groups work.
-- The comm timeout is lowered to 30 s here, so that a regression ends the job (a failure) instead of hanging.
local engine = require("engine")
local nn = engine.nn
local dist = engine.distributed

local R, W = dist.rank(), dist.world_size()

local function multi() if W == 1 then pending("needs 2+ ranks") end end
local function flat(t) return (t:tolist_flat()) end

-- Runs fn on every rank; returns its error message and the seconds it took (fails when it did not raise).
local function fails(fn)
  local t0 = engine.time()
  local ok, err = pcall(fn)
  assert.is_false(ok, "expected an error on rank " .. R)
  return tostring(err), engine.time() - t0
end

-- Every rank got the same text (after the first occurrence of `from`).
local function same_everywhere(err, from)
  local i = err:find(from, 1, true)
  assert.truthy(i, err)
  local tail = err:sub(i)
  local h = 0
  for k = 1, #tail do h = (h * 31 + tail:byte(k)) % 1000003 end
  local t = engine.tensor({ h, -h }, "f64")
  dist.all_reduce(t, "max")
  assert.equal(h, t:tolist_flat()[1], "rank " .. R .. " got another message: " .. err)
  assert.equal(-h, t:tolist_flat()[2], "rank " .. R .. " got another message: " .. err)
end

local function world_usable()
  local t = engine.ones(2)
  dist.all_reduce(t)
  assert.same({ W, W }, flat(t))
end

local tmp = os.getenv("TMPDIR") or "/tmp"
local saved_timeout

describe("comm hangs end within seconds on every rank", function()
  setup(function()
    saved_timeout = dist.get_comm_timeout()
    dist.set_comm_timeout(30)
  end)
  teardown(function() dist.set_comm_timeout(saved_timeout) end)

  it("the watchdog is on by default (1 s)", function()
    assert.equal(1, dist.get_comm_watchdog())
  end)

  describe("(a) agreements meeting other operations", function()
    it("checkpoint.save on rank 0 while the others all_reduce: a mismatch on every rank, the world usable after", function()
      multi()
      local stamp = engine.tensor({ math.floor(engine.time() * 1000) % 100000000 }, "f64")
      dist.broadcast(stamp, 0)
      local dir = string.format("%s/comm_hang_a1_%d", tmp, stamp:item())
      local err, secs = fails(function()
        if R == 0 then dist.checkpoint.save({ x = engine.ones(4) }, dir) else dist.all_reduce(engine.ones(2)) end
      end)
      assert.is_true(secs < 10, "took " .. secs .. " s")
      assert.matches("collective mismatch on group world: rank 0: #%d+ agreement %(checkpoint.save%); ranks? 1[%d,]*: " ..
        "#%d+ all_reduce f32%[2%] op=sum", err)
      same_everywhere(err, "collective mismatch")
      world_usable()
      world_usable()
      dist.checkpoint.save({ x = engine.ones(4) }, dir) -- the agreements work again too
      if R == 0 then os.execute("rm -rf '" .. dir .. "'") end
    end)

    it("checkpoint.load against save: both fail naming both operations, the world usable after", function()
      multi()
      local stamp = engine.tensor({ math.floor(engine.time() * 1000) % 100000000 }, "f64")
      dist.broadcast(stamp, 0)
      local dir = string.format("%s/comm_hang_a2_%d", tmp, stamp:item())
      dist.checkpoint.save({ x = engine.ones(4) }, dir)
      local err, secs = fails(function()
        if R == 0 then dist.checkpoint.save({ x = engine.ones(4) }, dir .. "b")
        else dist.checkpoint.load({ x = engine.zeros(4) }, dir) end
      end)
      assert.is_true(secs < 10, "took " .. secs .. " s")
      assert.matches("rank 0: #%d+ agreement %(checkpoint.save%); ranks? 1[%d,]*: #%d+ agreement %(checkpoint.load%)", err)
      same_everywhere(err, "collective mismatch")
      world_usable()
      local x = engine.zeros(4)
      dist.checkpoint.load({ x = x }, dir)
      assert.same({ 1, 1, 1, 1 }, flat(x))
      if R == 0 then os.execute("rm -rf '" .. dir .. "' '" .. dir .. "b'") end
    end)
  end)

  describe("(b) fully_shard's mp_policy", function()
    it("ranks that disagree fail in fully_shard, naming mp_policy", function()
      multi()
      local mesh = dist.init_device_mesh("cpu", { W })
      local m = nn.Linear(4, 8)
      local err, secs = fails(function()
        dist.fully_shard(m, { mesh = mesh,
          mp_policy = R == 0 and dist.MixedPrecisionPolicy{ param_dtype = "bf16" } or nil })
        m(engine.ones(2, 4))
      end)
      assert.is_true(secs < 10, "took " .. secs .. " s")
      assert.matches("fully_shard: the ranks disagree on .- or mp_policy", err)
      world_usable()
    end)
  end)

  describe("(c) group or mesh creation on some ranks only", function()
    local cases = {
      { "new_group", function() local r = {} for i = 1, W do r[i] = i - 1 end dist.new_group(r) end },
      { "init_device_mesh", function() dist.init_device_mesh("cpu", { W }) end },
      { "init_device_mesh", function() dist.fully_shard(nn.Linear(4, 4)) end }, -- its default mesh
    }
    for _, c in ipairs(cases) do
      it(c[1] .. " on rank 0 while the others all_reduce: a mismatch on every rank, the world usable after", function()
        multi()
        local err, secs = fails(function()
          if R == 0 then c[2]() else dist.all_reduce(engine.ones(2)) end
        end)
        assert.is_true(secs < 10, "took " .. secs .. " s")
        assert.matches("collective mismatch on group world: rank 0: #%d+ agreement %(" .. c[1] .. "%); ranks? 1[%d,]*: " ..
          "#%d+ all_reduce f32%[2%] op=sum", err)
        same_everywhere(err, "collective mismatch")
        world_usable()
      end)
    end
  end)

  describe("(d) ranks waiting on different groups: the watchdog's verdict", function()
    local function all_ranks() local r = {} for i = 1, W do r[i] = i - 1 end return r end

    -- the verdict on every rank, within 10 s; then both groups refuse calls, saying why, and a new group works
    local function verdict(fn, g1, g2)
      local err, secs = fails(fn)
      assert.is_true(secs < 10, "took " .. secs .. " s: " .. err)
      assert.matches("deadlock across groups %(found by the comm watchdog", err)
      same_everywhere(err, "deadlock across groups")
      for _, g in ipairs({ g1, g2 }) do
        local e = fails(function() dist.all_reduce(engine.ones(2), "sum", { group = g }) end)
        assert.matches("is unusable: the comm watchdog found it in a deadlock", e)
      end
      local g = dist.new_group(all_ranks())
      local t = engine.ones(2)
      dist.all_reduce(t, "sum", { group = g })
      assert.same({ W, W }, flat(t))
      world_usable()
      return err
    end

    it("rank 0 in a collective of one group, the others in another", function()
      multi()
      local g1, g2 = dist.new_group(all_ranks()), dist.new_group(all_ranks())
      local err = verdict(function()
        if R == 0 then dist.all_reduce(engine.ones(2), "sum", { group = g1 })
        else dist.all_reduce(engine.ones(3), "sum", { group = g2 }) end
      end, g1, g2)
      local members = table.concat(all_ranks(), ",")
      assert.matches("rank 0 waits in #0 all_reduce f32%[2%] op=sum on group group%[" .. members .. "%] for ranks? 1", err)
      assert.matches("rank 1 waits in #0 all_reduce f32%[3%] op=sum on group group%[" .. members .. "%] for rank 0", err)
    end)

    it("an FSDP forward on rank 0 only", function()
      multi()
      local mesh = dist.init_device_mesh("cpu", { W })
      local m = nn.Linear(4, 8)
      dist.fully_shard(m, { mesh = mesh })
      local g = dist.new_group(all_ranks())
      local err = verdict(function()
        if R == 0 then m(engine.ones(2, 4)) end
        dist.all_reduce(engine.ones(2), "sum", { group = g })
      end, mesh:get_group(1), g)
      assert.matches("rank 0 waits in #0 .- on group dim0:group", err)
    end)

    it("parallelize_module on rank 0 only", function()
      multi()
      local mesh = dist.init_device_mesh("cpu", { W })
      local m = nn.Sequential(nn.Linear(4, 8))
      local g = dist.new_group(all_ranks())
      verdict(function()
        if R == 0 then dist.parallelize_module(m, mesh, { ["0"] = dist.ColwiseParallel() }) end
        dist.all_reduce(m(engine.ones(2, 4)), "sum", { group = g })
      end, mesh:get_group(1), g)
    end)

    it("an error caught by pcall on rank 0 while the others go on", function()
      multi()
      local g1, g2 = dist.new_group(all_ranks()), dist.new_group(all_ranks())
      local ok0, e0 = pcall(function()
        if R == 0 then error("local failure on rank 0") end
        dist.all_reduce(engine.ones(2), "sum", { group = g1 })
      end)
      -- rank 0 goes on to the next group; the others wait in g1: both get the verdict
      local err = verdict(function()
        if R == 0 then
          assert(not ok0 and tostring(e0):find("local failure"), tostring(e0))
          dist.all_reduce(engine.ones(2), "sum", { group = g2 })
        else
          error(e0, 0) -- the others' error is the verdict from g1
        end
      end, g1, g2)
      if R ~= 0 then assert.matches("deadlock across groups", tostring(e0)) end
      assert.matches("rank 0 waits in #0 all_reduce f32%[2%] op=sum on group", err)
    end)

    it("a ShardedTensor reshard whose spec differs per rank fails on every rank (agreed first)", function()
      multi()
      local placements = {}
      for i = 1, W do placements[i] = "rank:" .. (i - 1) .. "/cpu" end
      engine.manual_seed(1)
      local st = dist.shard_tensor(engine.rand({ 8, 4 * W }), dist.ChunkShardingSpec{ dim = 1, placements = placements })
      local err, secs = fails(function()
        st:reshard(dist.ChunkShardingSpec{ dim = R == 0 and 1 or 2, placements = placements })
      end)
      assert.is_true(secs < 10, "took " .. secs .. " s")
      assert.matches("reshard: the ranks passed different resharding specs", err)
      world_usable()
    end)
  end)
end)
