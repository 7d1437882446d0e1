-- The NCCL path's failure handling, proven on the CPU (comm/gpu_wait.c is device-free: the device calls come
-- through a table that nccl.c fills with NCCL's and these specs with a stub, eng_comm_test_gpu_*):
--  (a) the host-side wait on a GPU collective polls its event and the communicator's async error: a
--      collective that never completes ends at the comm timeout, an async error at once; either aborts the
--      communicator, names the group, the collective and its sequence number, and leaves the group unusable;
--  (b) the wait publishes itself to the comm watchdog: a rank waiting on a GPU collective while the others
--      wait in another operation is a deadlock found within seconds, the same verdict on every rank;
--  (c) communicator creation is agreed: a rank without a GPU fails every rank before NCCL is called; a rank
--      whose ncclCommInitRank fails makes the ranks still creating abort theirs; every rank raises the same
--      error naming the failing rank and NCCL's message.
-- Run at 1, 2 and 4 ranks:
--   mpirun -np 2 build/engine /usr/bin/busted --ignore-lua -o tools/passfail_dist.lua spec/dist/gpu_wait_spec.lua
local engine = require("engine")
local dist = engine.distributed
local ffi = require("ffi")
local C = ffi.C

local R, W = dist.rank(), dist.world_size()

local function multi() if W == 1 then pending("needs 2+ ranks") end end
local function msg() return ffi.string(C.eng_last_error()) end

-- every rank got the same text from `from` on
local function same_everywhere(err, from)
  local i = err:find(from, 1, true)
  assert.truthy(i, err)
  local tail = err:sub(i, i + 300)
  local h = 0
  for k = 1, #tail do h = (h * 31 + tail:byte(k)) % 1000003 end
  local t = engine.tensor({ h }, "f64")
  local lo = t:clone()
  dist.all_reduce(t, "max")
  dist.all_reduce(lo, "min")
  assert.are.equal(t:tolist_flat()[1], lo:tolist_flat()[1], "the ranks raised different errors: " .. err)
end

local function everyone()
  local r = {}
  for i = 0, W - 1 do r[#r + 1] = i end
  return r
end

describe("waits on GPU collectives (stub device)", function()
  local saved
  before_each(function() saved = C.eng_comm_get_timeout() end)
  after_each(function() C.eng_comm_set_timeout(saved) end)

  it("a collective that completes: the wait returns", function()
    local g = dist.new_group(everyone())
    assert.are.equal(0, C.eng_comm_test_gpu_wait(g._c, "complete", 3), msg())
    dist.all_reduce(engine.ones(2), "sum", { group = g }) -- still usable
  end)

  it("a collective that never completes ends at the comm timeout: aborted, named, group unusable", function()
    local g = dist.new_group(everyone())
    C.eng_comm_set_timeout(0.4)
    local aborts = C.eng_comm_test_gpu_aborts()
    local t0 = engine.time()
    assert.are.equal(-1, C.eng_comm_test_gpu_wait(g._c, "never", 7))
    local err, took = msg(), engine.time() - t0
    C.eng_comm_set_timeout(saved)
    assert.truthy(err:find("#7 all_reduce (NCCL, on the GPU) on group", 1, true), err)
    assert.truthy(err:find("has not completed within 0 s", 1, true) or err:find("has not completed within", 1, true), err)
    assert.truthy(err:find("the communicator is aborted", 1, true), err)
    assert.is_true(took >= 0.35 and took < 10, "took " .. took)
    assert.are.equal(aborts + 1, C.eng_comm_test_gpu_aborts())
    -- later calls on the group refuse, naming the first failure; other groups work
    if W > 1 then
      local ok, e2 = pcall(dist.all_reduce, engine.ones(2), "sum", { group = g })
      assert.is_false(ok)
      assert.truthy(tostring(e2):find("is unusable", 1, true), tostring(e2))
      assert.truthy(tostring(e2):find("#7 all_reduce", 1, true), tostring(e2))
    end
    assert.are.equal(-1, C.eng_comm_test_gpu_wait(g._c, "complete", 8))
    assert.truthy(msg():find("is unusable", 1, true), msg())
    local t = engine.ones(2)
    dist.all_reduce(t, "sum")
    assert.are.same({ W, W }, t:tolist_flat())
  end)

  it("an asynchronous NCCL error ends the wait at once, on every rank alike", function()
    local g = dist.new_group(everyone())
    local t0 = engine.time()
    assert.are.equal(-1, C.eng_comm_test_gpu_wait(g._c, "async_error", 12))
    local err = msg()
    assert.is_true(engine.time() - t0 < 5)
    assert.truthy(err:find("#12 all_reduce (NCCL, on the GPU) on group", 1, true), err)
    assert.truthy(err:find("asynchronous error: NCCL error 6", 1, true), err)
    assert.truthy(err:find("is unusable from now on", 1, true), err)
    same_everywhere(err, "#12 all_reduce")
  end)

  it("the watchdog sees the wait: a GPU wait against another operation is a deadlock, found in seconds", function()
    multi()
    local g = dist.new_group(everyone())
    C.eng_comm_set_timeout(30)
    local t0 = engine.time()
    local err
    if R == 0 then
      assert.are.equal(-1, C.eng_comm_test_gpu_wait(g._c, "never", 0))
      err = msg()
    else
      local ok, e = pcall(dist.barrier, { group = g })
      assert.is_false(ok)
      err = tostring(e)
    end
    local took = engine.time() - t0
    assert.truthy(err:find("deadlock across groups", 1, true), err)
    assert.truthy(err:find("#0 all_reduce (NCCL, on the GPU)", 1, true), err)
    assert.is_true(took < 20, "took " .. took)
    same_everywhere(err, "deadlock across groups")
  end)
end)

describe("agreed NCCL communicator creation (stub device)", function()
  it("succeeds when every rank succeeds", function()
    local g = dist.new_group(everyone())
    assert.are.equal(0, C.eng_comm_test_gpu_init(g._c, 0), msg())
  end)

  it("a rank without a GPU fails every rank before NCCL is called, naming it", function()
    multi()
    local g = dist.new_group(everyone())
    local bad = W - 1
    assert.are.equal(-1, C.eng_comm_test_gpu_init(g._c, R == bad and 1 or 0))
    local err = msg()
    assert.truthy(err:find("could not be created (before NCCL was called) on rank " .. bad, 1, true), err)
    assert.truthy(err:find("no GPU (stub", 1, true), err)
    same_everywhere(err, "NCCL communicator for group")
    dist.all_reduce(engine.ones(2), "sum", { group = g }) -- the group itself still works over MPI
  end)

  it("ncclCommInitRank failing on one rank: the ranks still creating abort, every rank raises its message", function()
    multi()
    local g = dist.new_group(everyone())
    local bad = 1 % W
    local aborts = C.eng_comm_test_gpu_aborts()
    local t0 = engine.time()
    -- the failing rank's creation fails after 50 ms; every other rank's would never complete on its own
    assert.are.equal(-1, C.eng_comm_test_gpu_init(g._c, R == bad and 2 or 3))
    local err = msg()
    assert.is_true(engine.time() - t0 < 10)
    assert.truthy(err:find("could not be created (ncclCommInitRank) on rank " .. bad .. ";", 1, true), err)
    assert.truthy(err:find("invalid usage (stub: a bad NCCL_* variable)", 1, true), err)
    if R ~= bad then assert.are.equal(aborts + 1, C.eng_comm_test_gpu_aborts()) end
    local tail = err:sub(1, (err:find("(every member", 1, true)))
    same_everywhere(tail, "NCCL communicator for group")
    -- and the next creation on the group works (no notice left over on its control communicator)
    assert.are.equal(0, C.eng_comm_test_gpu_init(g._c, 0), msg())
    dist.all_reduce(engine.ones(2), "sum", { group = g })
  end)
end)
