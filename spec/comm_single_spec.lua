-- Single-process specs of the distributed runtime (world size 1): the C API's
-- argument checks, world-size-1 semantics of every collective, staging
-- buffers, the flight recorder, debug mode, the watchdog and os.exit.
-- The multi-rank behaviour is covered by spec/dist/*_spec.lua under mpirun.
local engine = require("engine")
local dist = engine.distributed
local ffi, C = engine.ffi, engine.C

local W = dist.world_size()
local function flat(t) return (t:tolist_flat()) end
local function single() if W ~= 1 then pending("single-process spec (world size 1)") end end
local function err() return ffi.string(C.eng_last_error()) end

local self_exe = require("spec.helpers.proc").self_exe

-- Runs `engine -e code` in a child process: output (stdout+stderr), exit code.
local function child(code)
  local exe = self_exe()
  local home = rawget(_G, "ENGINE_HOME") or os.getenv("ENGINE_HOME") or "."
  local cmd = string.format("ENGINE_HOME='%s' '%s' -e '%s' 2>&1; echo \"rc=$?\"", home, exe, code)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  local rc = tonumber(out:match("rc=(%d+)%s*$"))
  return out, rc
end

describe("comm names", function()
  it("reduce ops and collective kinds", function()
    local names = { "sum", "avg", "max", "min", "prod" }
    for i, n in ipairs(names) do
      assert.equal(n, ffi.string(C.eng_reduce_op_name(i - 1)))
      assert.equal(i - 1, C.eng_reduce_op_from_name(n))
    end
    assert.equal(1, C.eng_reduce_op_from_name("mean"))
    assert.equal(4, C.eng_reduce_op_from_name("product"))
    assert.equal(-1, C.eng_reduce_op_from_name("median"))
    assert.equal("reduce op: unknown op 'median' (expected sum, avg, max, min or prod)", err())
    assert.is_true(C.eng_reduce_op_name(5) == nil)
    assert.is_true(C.eng_reduce_op_name(-1) == nil)
    local kinds = { "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "scatter", "barrier",
      "gather" }
    for i, k in ipairs(kinds) do assert.equal(k, ffi.string(C.eng_coll_kind_name(i - 1))) end
    assert.is_true(C.eng_coll_kind_name(8) == nil)
    assert.same(kinds, dist.collective_kinds)
  end)
end)

describe("collectives on a world of one", function()
  it("all_gather, reduce_scatter and all_to_all return new tensors equal to the input", function()
    single()
    local t = engine.tensor({ { 1, 2 }, { 3, 4 } }, "f32")
    for _, f in ipairs({ function(x) return dist.all_gather(x) end, function(x) return dist.reduce_scatter(x, "avg") end,
      function(x) return dist.all_to_all(x) end }) do
      local r = f(t)
      assert.are_not.equal(t, r)
      assert.same({ 2, 2 }, r:shape())
      assert.same({ 1, 2, 3, 4 }, flat(r))
      r:fill_(0)
      assert.same({ 1, 2, 3, 4 }, flat(t)) -- not aliased
    end
  end)

  it("all_reduce (every op), broadcast, scatter and barrier", function()
    single()
    for _, op in ipairs({ "sum", "avg", "max", "min", "prod" }) do
      local t = engine.tensor({ 1.5, -2 }, "f32")
      dist.all_reduce(t, op)
      assert.same({ 1.5, -2 }, flat(t))
    end
    local b = engine.tensor({ 7, 8 }, "i32")
    dist.broadcast(b, 0)
    assert.same({ 7, 8 }, flat(b))
    local out = engine.zeros(2, { dtype = "i32" })
    dist.scatter(out, b, 0)
    assert.same({ 7, 8 }, flat(out))
    local g = dist.gather(b, nil, 0)
    assert.are_not.equal(b, g)
    assert.same({ 7, 8 }, flat(g))
    dist.barrier()
  end)
end)

describe("C API argument checks", function()
  it("process groups", function()
    local pg = C.eng_pg_world()
    assert.is_true(pg ~= nil)
    local t = engine.ones(2)
    assert.equal(-1, C.eng_pg_all_reduce(nil, t._c, 0, nil))
    assert.equal("all_reduce: process group is nil/NULL", err())
    assert.equal(-1, C.eng_pg_all_reduce(pg, nil, 0, nil))
    assert.equal("all_reduce: the tensor is nil/NULL", err())
    assert.equal(-1, C.eng_pg_all_reduce(pg, t._c, 9, nil))
    assert.equal("all_reduce: invalid reduce op code 9", err())
    assert.is_true(C.eng_pg_all_gather(pg, nil, nil) == nil)
    assert.equal("all_gather: input tensor is nil/NULL", err())
    assert.is_true(C.eng_pg_all_gather(nil, t._c, nil) == nil)
    assert.equal(-1, C.eng_pg_scatter(pg, t._c, nil, 0, nil))
    assert.equal("scatter: the root (group rank 0) must pass the input tensor", err())
    assert.equal(-1, C.eng_pg_gather(pg, nil, t._c, 0, nil))
    assert.equal("gather: the destination (group rank 0) must pass the output tensor", err())
    assert.equal(-1, C.eng_pg_gather(pg, t._c, nil, 0, nil))
    assert.equal("gather: input tensor is nil/NULL", err())
    assert.equal(-1, C.eng_pg_gather(pg, t._c, t._c, 1, nil))
    assert.matches("gather: root 1 is out of range for group world of size 1", err())
    assert.equal(-1, C.eng_pg_broadcast(pg, t._c, -1, nil))
    assert.equal(-1, C.eng_pg_rank(nil))
    assert.equal(-1, C.eng_pg_size(nil))
    assert.equal(0, C.eng_pg_is_member(nil))
    assert.equal(-1, C.eng_pg_ranks(nil, nil, 0))
    assert.equal(-1, C.eng_pg_group_rank(pg, 5))
    assert.equal("global rank 5 is not part of group world", err())
    assert.equal(-1, C.eng_work_wait(nil))
    assert.equal(-1, C.eng_work_is_completed(nil))
    assert.is_true(C.eng_work_result(nil) == nil)
    C.eng_work_release(nil)
    C.eng_pg_release(nil)
    assert.is_true(C.eng_pg_split(nil, 0, 0) == nil)
    assert.equal(-1, C.eng_pg_raw_collective(pg, 9, nil, nil, 0, 0, 0, 0))
    assert.equal(-1, C.eng_pg_raw_collective(pg, 0, nil, nil, 0, 0, 1, 0))
    assert.equal("raw_collective: op 1 is not supported (sum, max, min, prod)", err())
    assert.equal(-1, C.eng_pg_raw_collective(nil, 0, nil, nil, 0, 0, 0, 0))
    assert.equal(-1, C.eng_comm_set_timeout(0))
    assert.equal(-1, C.eng_dist_allreduce_counts(nil, 2))
    C.eng_pg_release(pg)
  end)

  it("split: a color < 0 gives a non-member group, members get a new group", function()
    single()
    local w = dist.world_group()
    local g = dist._wrap_pg(C.eng_pg_split(w._c, 0, 0))
    assert.is_true(g:is_member())
    assert.same({ 0 }, g:ranks())
    assert.matches("^group%[0%]$", g:name())
    local n = dist._wrap_pg(C.eng_pg_split(w._c, -1, 0))
    assert.is_false(n:is_member())
    assert.equal("(not a member)", n:name())
    assert.equal("ProcessGroup((not a member))", tostring(n))
    -- splitting a non-member gives a non-member without communicating
    local nn = dist._wrap_pg(C.eng_pg_split(n._c, 0, 0))
    assert.is_false(nn:is_member())
    assert.has_error(function() n:group_rank(0) end, "global rank 0 is not part of group (not a member)")
    assert.has_error(function() g:global_rank(3) end, "global_rank: group rank 3 is out of range for group[0]")
  end)

  it("meshes", function()
    local shape = ffi.new("int64_t[2]", { 1, 1 })
    assert.is_true(C.eng_mesh_new(0, 0, shape, nil, nil) == nil)
    assert.equal("init_device_mesh: a mesh has 1 to 8 dims, got 0", err())
    assert.is_true(C.eng_mesh_new(0, 1, nil, nil, nil) == nil)
    assert.equal("init_device_mesh: mesh shape is NULL", err())
    assert.is_true(C.eng_mesh_new(7, 1, shape, nil, nil) == nil)
    assert.equal("init_device_mesh: invalid device code 7", err())
    local names = ffi.new("const char*[2]")
    names[0] = "a"
    names[1] = nil
    assert.is_true(C.eng_mesh_new(0, 2, shape, nil, names) == nil)
    assert.equal("init_device_mesh: mesh_dim_names[1] is empty", err())
    assert.equal(-1, C.eng_mesh_size(nil, 0))
    assert.equal(-1, C.eng_mesh_ndim(nil))
    assert.equal(0, C.eng_mesh_get_coordinate(nil, nil))
    assert.is_true(C.eng_mesh_get_group(nil, 0) == nil)
    assert.is_true(C.eng_mesh_slice(nil, 1, nil) == nil)
    assert.is_true(C.eng_mesh_dim_name(nil, 0) == nil)
    assert.equal(-1, C.eng_mesh_dim_index(nil, "a"))
    assert.equal(1, C.eng_mesh_equal(nil, nil))
    local buf = ffi.new("char[16]")
    assert.equal("DeviceMesh(nil)", ffi.string(C.eng_mesh_describe(nil, buf, 16)))
    C.eng_mesh_release(nil)
  end)

  it("a mesh description truncates safely into a small buffer", function()
    single()
    local m = dist.init_device_mesh("cpu", { 1, 1 }, { "dp", "tp" })
    assert.equal("DeviceMesh('cpu', [[0]], mesh_dim_names=('dp', 'tp'))", tostring(m))
    local buf = ffi.new("char[12]")
    assert.equal("DeviceMesh(", ffi.string(C.eng_mesh_describe(m._c, buf, 12)))
    assert.is_true(C.eng_mesh_get_group(m._c, 5) == nil)
    assert.equal("DeviceMesh.get_group: mesh dim 5 out of range for a 2-d mesh", err())
  end)
end)

describe("DeviceMesh on a world of one", function()
  it("1x1 mesh: coordinates, groups of one, slices, flatten", function()
    single()
    local m = dist.init_device_mesh("cpu", { 1, 1 }, { "dp", "tp" })
    assert.same({ 0, 0 }, m:get_coordinate())
    assert.equal(1, m:get_group("dp"):size())
    assert.same({ 0 }, m["tp"]:ranks())
    assert.same({ "dp_tp" }, m:flatten().mesh_dim_names)
    local t = engine.ones(3)
    dist.all_reduce(t, "avg", { group = m, mesh_dim = "tp" })
    assert.same({ 1, 1, 1 }, flat(t))
    assert.has_error(function() m:flatten(5) end, "DeviceMesh.flatten: name must be a string")
    assert.is_true(C.eng_mesh_flatten(m._c, "") == nil)
    assert.equal("DeviceMesh flatten: the name must have 1 to 63 characters", err())
  end)
end)

describe("communication buffers", function()
  it("staged collectives reuse persistent buffers (no new system allocations)", function()
    single()
    local base = engine.ones(256, 512)
    local v = base:t() -- non-contiguous: staged through a buffer
    dist.all_reduce(v, "sum")
    local bf = engine.ones(128, 64, { dtype = "bf16" })
    dist.all_reduce(bf, "sum") -- widened to f32 in a buffer
    local before = engine.memory_stats().n_system_allocs
    for _ = 1, 20 do
      dist.all_reduce(v, "avg")
      dist.all_reduce(bf, "sum")
      dist.broadcast(v, 0)
    end
    assert.equal(before, engine.memory_stats().n_system_allocs)
    assert.same({ 1, 1 }, { base:get(1, 1), bf:get(1, 1) })
  end)

  it("more async staged collectives in flight than buffers in the pool", function()
    single()
    local bases, works = {}, {}
    for i = 1, 40 do
      bases[i] = engine.full({ 4, 3 }, i, { dtype = "bf16" })
      works[i] = dist.all_reduce(bases[i]:t(), "sum", { async = true })
    end
    for i = 40, 1, -1 do works[i]:wait() end
    for i = 1, 40 do assert.equal(i, bases[i]:get(2, 3)) end
  end)
end)

describe("flight recorder, debug mode, timeout", function()
  it("format, history access and errors", function()
    single()
    dist.barrier()
    local n = C.eng_comm_history_len()
    assert.is_true(n >= 1)
    local rec = ffi.new("eng_coll_record")
    assert.equal(0, C.eng_comm_history_get(n - 1, rec))
    assert.equal(6, rec.kind)
    assert.equal(1, rec.state)
    assert.equal(-1, C.eng_comm_history_get(n, rec))
    assert.matches("out of range", err())
    assert.equal("?", ffi.string(C.eng_comm_history_group_name(-1)))
    assert.matches("world seq %d+ barrier completed", ffi.string(C.eng_comm_history_format(1)))
    local _, text = dist.dump_collectives()
    assert.matches("^collective flight recorder, rank 0: last %d+ of %d+ collectives", text)
  end)

  it("debug mode on a world of one and its settings", function()
    single()
    dist.set_debug(true, { timeout = 30 })
    local ok, e = pcall(function()
      local t = engine.ones(2)
      dist.all_reduce(t)
      dist.all_gather(t)
      assert.same({ 1, 1 }, flat(t))
    end)
    dist.set_debug(false)
    assert.is_true(ok, e)
    assert.has_error(function() dist.set_comm_timeout(-1) end,
      "comm: timeout must be a positive number of seconds, got -1")
    assert.has_error(function() dist.set_comm_timeout("x") end, "set_comm_timeout: seconds must be a number")
    dist.set_comm_timeout(300)
  end)
end)

describe("process exit and the watchdog", function()
  local function under_mpirun() return os.getenv("OMPI_COMM_WORLD_SIZE") ~= nil end

  it("the watchdog ends a stuck process with exit code 3 and says why", function()
    if under_mpirun() then pending("spawns a child process; run without mpirun") end
    local out, rc = child([[local d = require("engine").distributed; d.watchdog(0.2, "spin test"); ]] ..
      [[local t = require("engine").time() + 30; while require("engine").time() < t do end]])
    assert.equal(3, rc)
    assert.matches("%[rank 0%] watchdog: 'spin test' did not finish in time", out)
    assert.matches("collective flight recorder, rank 0", out)
  end)

  it("a disarmed watchdog does nothing", function()
    if under_mpirun() then pending("spawns a child process; run without mpirun") end
    local out, rc = child([[local e = require("engine"); local d = e.distributed; d.watchdog(0.2, "x"); ]] ..
      [[d.watchdog_disarm(); local t = e.time() + 0.5; while e.time() < t do end; print("done")]])
    assert.equal(0, rc)
    assert.matches("done", out)
    assert.has_error(function() dist.watchdog(0) end, "watchdog: seconds must be positive, got 0")
  end)

  it("os.exit finalizes MPI and keeps the exit code", function()
    if under_mpirun() then pending("spawns a child process; run without mpirun") end
    local out, rc = child([[local d = require("engine").distributed; d.barrier(); io.write("bye\n"); os.exit(0)]])
    assert.equal(0, rc)
    assert.matches("bye", out)
    local _, rc5 = child([[local d = require("engine").distributed; os.exit(5)]])
    assert.equal(5, rc5)
    local _, rc1 = child([[local d = require("engine").distributed; os.exit(false)]])
    assert.equal(1, rc1)
  end)
end)

describe("CUDA / NCCL availability", function()
  it("reports no GPU and no NCCL in a CPU-only build", function()
    local n = C.eng_comm_cuda_device_count()
    assert.is_true(n >= 0)
    if C.eng_comm_have_nccl() == 0 then
      assert.equal(0, n)
      local ok, e = pcall(dist.init_device_mesh, "cuda", { W })
      assert.is_false(ok)
      assert.matches("and this build has no CUDA/NCCL backend", e)
    end
  end)
end)
