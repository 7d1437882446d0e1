-- Whole-job failure modes of collectives, each in a child 2-rank job started with mpirun
-- from this single-process spec (the environment of the outer MPI singleton removed), under `timeout`,
-- so that a regression fails the spec instead of hanging it:
--  * a rank that ends while another waits for it in a collective: the waiting rank fails within seconds
--    naming the rank that ended and both ranks' last collectives;
--  * a collective mismatch outside pcall: both ranks fail with the mismatch, the job ends;
--  * a rank stuck in compute: the others give up after ENGINE_COMM_TIMEOUT seconds, print their flight
--    recorder and what each member does, and abort the job; the stuck rank says where it stands when the
--    launcher ends it;
--  * ranks waiting on different groups: the comm watchdog ends both within seconds with one verdict.
local engine = require("engine")
local dist = engine.distributed

local proc = require("spec.helpers.proc")

-- Runs `code` on 2 ranks (env: extra variables, {NAME = value}); returns the output (both ranks, stdout and
-- stderr), the exit code and the wall time.
local function job(code, env)
  local f = os.tmpname()
  local h = io.open(f, "w")
  h:write(code)
  h:close()
  local t0 = engine.time()
  local out, rc = proc.job(2, f, {}, { env = env, timeout = 60 })
  os.remove(f)
  return out, rc, engine.time() - t0
end

local function skip()
  if dist.world_size() ~= 1 then pending("single-process spec (starts its own 2-rank jobs)") end
  if not proc.have_mpirun() then pending("needs mpirun") end
end

describe("collective failures end the job instead of hanging", function()
  it("a rank that ends while another waits for it: the waiting rank fails naming it", function()
    skip()
    local out, rc, secs = job([[
      local engine = require("engine"); local dist = engine.distributed
      dist.all_reduce(engine.ones(3))
      if dist.rank() == 1 then return end          -- rank 1's script ends (MPI finalized)
      local ok, err = pcall(dist.all_reduce, engine.ones(2))
      print("rank 0 caught: " .. tostring(err))
      os.exit(ok and 0 or 7)
    ]])
    assert.is_true(secs < 30, "took " .. secs .. " s")
    assert.are_not.equal(0, rc)
    assert.are_not.equal(124, rc) -- not the timeout
    assert.matches("rank 0 caught: all_reduce: rank 1 has ended", out)
    assert.matches("last collectives of rank 1 %(1 in all%):\n  #0 world seq 0 all_reduce f32%[3%] op=sum completed", out)
    assert.matches("last collectives of rank 0:\n  #0 world seq 0 all_reduce f32%[3%]", out)
  end)

  it("a collective mismatch outside pcall ends the job with the mismatch on both ranks", function()
    skip()
    local out, rc, secs = job([[
      local engine = require("engine"); local dist = engine.distributed
      if dist.rank() == 0 then dist.all_reduce(engine.ones(2)) else dist.all_gather(engine.ones(2)) end
      print("not reached")
    ]])
    assert.is_true(secs < 30, "took " .. secs .. " s")
    assert.are_not.equal(0, rc)
    assert.are_not.equal(124, rc)
    assert.is_nil(out:find("not reached", 1, true))
    assert.matches("collective mismatch on group world: rank 0: #0 all_reduce f32%[2%] op=sum; rank 1: #0 all_gather", out)
  end)

  it("a rank stuck in compute: the others abort after ENGINE_COMM_TIMEOUT with their flight recorder", function()
    skip()
    local out, rc, secs = job([[
      local engine = require("engine"); local dist = engine.distributed
      dist.barrier()
      if dist.rank() == 1 then local t = engine.time(); while engine.time() - t < 20 do end end
      dist.all_reduce(engine.ones(2))
    ]], { ENGINE_COMM_TIMEOUT = 2 })
    assert.is_true(secs < 18, "took " .. secs .. " s")
    assert.are_not.equal(0, rc)
    assert.are_not.equal(124, rc)
    assert.matches("%[rank 0%] all_reduce: the other ranks of group world did not join #1 all_reduce f32%[2%] op=sum " ..
      "within 2 s %(ENGINE_COMM_TIMEOUT", out)
    assert.matches("collective flight recorder, rank 0: last 1 of 1 collectives, oldest first:\n  #0 world seq 0 barrier", out)
    -- the waiting rank names what the stuck one does (the watchdog has no record of it waiting) ...
    assert.matches("what the other members of world do:\n  rank 1: waits in no collective", out)
    -- ... and the stuck rank, ended by the launcher, says where it stands (it printed nothing before)
    assert.matches("%[rank 1%] ended by signal 15 %(the launcher ends the job.-this rank waits in no collective's check", out)
    assert.matches("collective flight recorder, rank 1: last 1 of 1 collectives", out)
  end)

  it("ranks waiting on different groups outside pcall: both end within seconds with the same verdict", function()
    skip()
    local out, rc, secs = job([[
      local engine = require("engine"); local dist = engine.distributed
      local g = dist.new_group({0, 1})
      if dist.rank() == 0 then dist.all_reduce(engine.ones(2), "sum", {group = g}) else dist.all_reduce(engine.ones(2)) end
      print("not reached")
    ]])
    assert.is_true(secs < 25, "took " .. secs .. " s")
    assert.are_not.equal(0, rc)
    assert.are_not.equal(124, rc)
    assert.is_nil(out:find("not reached", 1, true))
    local n = 0
    for _ in out:gmatch("deadlock across groups %(found by the comm watchdog") do n = n + 1 end
    assert.equal(2, n, out) -- each rank's error
    assert.matches("rank 0 waits in #0 all_reduce f32%[2%] op=sum on group group%[0,1%] for rank 1; rank 1 waits in " ..
      "#0 all_reduce f32%[2%] op=sum on group world for rank 0", out)
  end)
end)
