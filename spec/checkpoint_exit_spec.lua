-- An async dist.checkpoint save whose handle is never waited: the job used to end with exit
-- code 0 and an empty folder.  Now the save is finished when the script ends (the engine host's end of the
-- recipe, or os.exit(0)), as PyTorch's async_save completes at exit: the checkpoint is complete and loads; a
-- save that fails there fails the run (its error on stderr, a non-zero exit code).  Whole jobs: 1 process alone
-- and 2 processes under mpirun.
local proc = require("spec.helpers.proc")

local TMP = os.tmpname()
os.remove(TMP)
os.execute("mkdir -p " .. TMP)

-- `job.lua save DIR [exit]`: an async save never waited (then os.exit(0) when "exit"); `job.lua load DIR`
local JOB = [==[
local engine = require("engine")
local dist = engine.distributed
local ckpt = dist.checkpoint
dist.init()
local W, R = dist.world_size(), dist.rank()
local mesh = dist.init_device_mesh("cpu", { W })
local full = engine.arange(64 * W, { dtype = "f32" })
if arg[1] == "save" then
  ckpt.save({ w = dist.distribute_tensor(full, mesh, { dist.Shard(1) }), step = 42 }, arg[2], { async = true })
  print("returned rank " .. R)
  if arg[3] == "exit" then os.exit(0) end
else
  local st = { w = dist.zeros({ 64 * W }, { mesh = mesh, placements = { dist.Replicate() } }), step = 0 }
  ckpt.load(st, arg[2])
  local ok = (st.w:full_tensor() - full):abs():sum():item() == 0
  print(string.format("loaded rank %d: %s step %d", R, ok and "ok" or "WRONG", st.step))
end
]==]

local function count(out, pat)
  local n = 0
  for _ in out:gmatch(pat) do n = n + 1 end
  return n
end

describe("an async checkpoint save never waited", function()
  local job = TMP .. "/job.lua"
  setup(function()
    local f = assert(io.open(job, "w"))
    f:write(JOB)
    f:close()
  end)
  teardown(function() os.execute("rm -rf '" .. TMP .. "'") end)

  for _, np in ipairs({ 0, 2 }) do
    for _, how in ipairs({ "end", "exit" }) do
      local n = math.max(np, 1)
      it(string.format("is finished at the script's %s (%d process%s): the checkpoint loads", how == "end" and
        "end" or "os.exit(0)", n, n > 1 and "es" or ""), function()
        if np > 0 and not proc.have_mpirun() then pending("needs mpirun"); return end
        local dir = string.format("%s/np%d_%s", TMP, np, how)
        local out, rc = proc.job(np, job, { "save", dir, how == "exit" and "exit" or nil })
        assert.equal(0, rc, out)
        assert.equal(n, count(out, "returned rank %d"), out)
        local f = io.open(dir .. "/.metadata", "rb")
        assert.is_truthy(f, "no metadata after the job:\n" .. out)
        f:close()
        out, rc = proc.job(np, job, { "load", dir })
        assert.equal(0, rc, out)
        assert.equal(n, count(out, "loaded rank %d: ok step 42"), out)
      end)
    end
  end

  it("a save that fails when it is finished at exit fails the run, with its error", function()
    local dir = TMP .. "/failing"
    -- the writer of this directory's data file fails (the checkpoint test hook: a full disk)
    local out, rc = proc.job(0, job, { "save", dir }, { env = { ENGINE_CKPT_TEST_FAIL = "failing/__0_0" } })
    assert.are_not.equal(0, rc, out)
    assert.is_truthy(out:find("checkpoint.save", 1, true), out)
    local f = io.open(dir .. "/.metadata", "rb")
    if f then f:close() end
    assert.is_nil(f, "a failed save left metadata")
  end)
end)
