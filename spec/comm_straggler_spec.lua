-- The straggler report (ENGINE_COMM_STRAGGLER, dist.set_comm_straggler): a rank that has waited that long in a
-- collective for members that are in no collective (computing, or stuck outside the comm layer) prints once what
-- each member does and goes on waiting; the job is not ended (that is the comm timeout's), and the lowest waiting
-- rank of the group is the only one that prints.  Child mpirun jobs of 2 and 4 ranks (stderr is what is checked).
local engine = require("engine")
local proc = require("spec.helpers.proc")

local TMP = os.tmpname()
os.remove(TMP)
os.execute("mkdir -p " .. TMP)
local SCRIPT = TMP .. "/straggler.lua"
do
  local f = assert(io.open(SCRIPT, "w"))
  f:write([[
local engine = require("engine")
local dist = engine.distributed
dist.init()
local t = engine.ones(4)
dist.all_reduce(t)
if dist.rank() == dist.world_size() - 1 then   -- the last rank computes for 3 s before the next collective
  local t0, x = engine.time(), 0
  while engine.time() - t0 < 3 do x = x + 1 end
end
dist.all_reduce(t)
print(string.format("rank %d done: %g", dist.rank(), t:sum():item()))
]])
  f:close()
end

local count = require("spec.helpers.files").count

describe("the comm straggler report", function()
  teardown(function() os.execute("rm -rf '" .. TMP .. "'") end)

  it("names the member in no collective once, and the collective completes", function()
    if not proc.have_mpirun() then return pending("needs mpirun") end
    local out, rc = proc.job(2, SCRIPT, {}, { env = { ENGINE_COMM_STRAGGLER = 1 } })
    assert.are.equal(0, rc, out)
    assert.are.equal(1, count(out, "for members that are in no collective"), out)
    assert.is_truthy(out:find("[rank 0] all_reduce: waited 1 s in #1 all_reduce f32[4] op=sum on group world", 1, true), out)
    assert.is_truthy(out:find("rank 1: waits in no collective (computing or stuck outside the comm layer", 1, true), out)
    assert.are.equal(2, count(out, "done: 16"), out)
  end)

  it("at 4 ranks only the lowest waiting rank reports, naming the others' waits", function()
    if not proc.have_mpirun() then return pending("needs mpirun") end
    local out, rc = proc.job(4, SCRIPT, {}, { env = { ENGINE_COMM_STRAGGLER = 2 } })
    assert.are.equal(0, rc, out)
    assert.are.equal(1, count(out, "for members that are in no collective"), out)
    assert.is_truthy(out:find("[rank 0] all_reduce: waited 2 s", 1, true), out)
    assert.is_truthy(out:find("rank 3: waits in no collective", 1, true), out)
    assert.is_truthy(out:find("rank 1: waits in #1 all_reduce", 1, true), out)
    assert.are.equal(4, count(out, "done: 64"), out)
  end)

  it("is off with 0, and the setting is checked", function()
    if not proc.have_mpirun() then return pending("needs mpirun") end
    local out, rc = proc.job(2, SCRIPT, {}, { env = { ENGINE_COMM_STRAGGLER = 0 } })
    assert.are.equal(0, rc, out)
    assert.are.equal(0, count(out, "in no collective"), out)
    local dist = engine.distributed
    local before = dist.get_comm_straggler()
    assert.has_error(function() dist.set_comm_straggler(-1) end)
    dist.set_comm_straggler(5)
    assert.are.equal(5, dist.get_comm_straggler())
    dist.set_comm_straggler(before)
  end)
end)
