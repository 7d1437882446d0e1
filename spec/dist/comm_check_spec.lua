-- Reliability of collectives under mpirun (1, 2 and 4 ranks), with the default settings (no debug mode):
--  * every collective's signature (seq, kind, op, root, dtype, shape) is checked across its group, so a
--    mismatch is an error on every rank naming both sides and each rank's last collectives;
--  * validations that may fail on one rank only and precede a collective are agreed first, so every rank
--    fails naming that rank (11.4): batch-sharded cross_entropy, clip_grad_norm_ over DTensor shards;
--  * element access on DTensors follows the global tensor or is an error naming full_tensor()/to_local();
--    collectives on DTensors are errors naming redistribute (11.5).
-- Each mismatch is made inside pcall on every rank and the assertions come after it, so a regression
-- fails (the test watchdog of tools/passfail_dist.lua ends a hang) instead of leaving a rank waiting.
local engine = require("engine")
local dist = engine.distributed

local R, W = dist.rank(), dist.world_size()
local LAST = W - 1

local function flat(t) return (t:tolist_flat()) end
local function range(n) local r = {} for i = 1, n do r[i] = i - 1 end return r end
local function multi() if W == 1 then pending("needs 2+ ranks") end end

-- Runs fn on every rank; returns its error message (fails when it did not raise).
local function fails(fn)
  local ok, err = pcall(fn)
  assert.is_false(ok, "expected an error on rank " .. R)
  return tostring(err)
end

-- The world (and a new group) is still usable: a sum over it gives W.
local function still_usable(g)
  local t = engine.ones(2)
  dist.all_reduce(t, "sum", { group = g })
  assert.same({ W, W }, flat(t))
end

describe("collective signatures (always on)", function()
  it("are checked by default", function()
    assert.is_true(dist.get_comm_check())
    assert.is_false(dist.get_debug())
    assert.equal(300, dist.get_comm_timeout())
  end)

  it("a rank calling all_reduce while another calls all_gather fails on every rank, naming both", function()
    multi()
    dist.barrier()
    local err = fails(function()
      if R == 0 then dist.all_reduce(engine.ones(2)) else dist.all_gather(engine.ones(2)) end
    end)
    assert.matches("collective mismatch on group world: rank 0: #%d+ all_reduce f32%[2%] op=sum; ranks? 1[%d,]*: " ..
      "#%d+ all_gather f32%[2%]", err)
    -- each rank's last collectives: the barrier before
    assert.matches("last collectives of rank 0:\n.-barrier", err)
    assert.matches("last collectives of rank 1:\n.-barrier", err)
    still_usable()
  end)

  it("an op mismatch (sum vs max) is an error, not different values per rank", function()
    multi()
    local t = engine.ones(2)
    local err = fails(function() dist.all_reduce(t, R == 0 and "sum" or "max") end)
    assert.matches("rank 0: #%d+ all_reduce f32%[2%] op=sum; ranks? 1[%d,]*: #%d+ all_reduce f32%[2%] op=max", err)
    assert.same({ 1, 1 }, flat(t)) -- nothing was reduced
    still_usable()
  end)

  it("a broadcast root mismatch is an error", function()
    multi()
    local err = fails(function() dist.broadcast(engine.ones(2), R == 0 and 0 or 1) end)
    assert.matches("broadcast f32%[2%] root=0; ranks? 1[%d,]*: #%d+ broadcast f32%[2%] root=1", err)
    still_usable()
  end)

  it("a gather dst mismatch is an error on every rank", function()
    multi()
    local err = fails(function() dist.gather(engine.ones(2), R == 0 and engine.empty(2 * W) or nil, R == 0 and 0 or 1) end)
    assert.matches("gather f32%[2%] root=0; ranks? 1[%d,]*: #%d+ gather f32%[2%] root=1", err)
    still_usable()
  end)

  it("dtype and shape mismatches are errors, async ones at issue", function()
    multi()
    local err = fails(function() dist.all_gather(engine.ones(2, { dtype = R == 0 and "f32" or "bf16" })) end)
    assert.matches("rank 0: #%d+ all_gather f32%[2%]; ranks? 1[%d,]*: #%d+ all_gather bf16%[2%]", err)
    err = fails(function() dist.all_reduce(engine.ones(R == LAST and 3 or 2), { async = true }):wait() end)
    assert.matches("all_reduce f32%[2%] op=sum; rank " .. LAST .. ": #%d+ all_reduce f32%[3%] op=sum", err)
    still_usable()
  end)

  it("on a subgroup, every member fails and the group stays usable", function()
    multi()
    local g = dist.new_group(range(W))
    local err = fails(function()
      if R == LAST then dist.reduce_scatter(engine.ones(W, 2), { group = g })
      else dist.all_to_all(engine.ones(W, 2), { group = g }) end
    end)
    assert.matches("collective mismatch on group group%[", err)
    assert.matches("#0 all_to_all f32%[" .. W .. ",2%]", err)
    assert.matches("#0 reduce_scatter f32%[" .. W .. ",2%] op=sum", err)
    still_usable(g)
    assert.equal(2, g:seq())
  end)

  it("a Lua-side argument error on one rank fails the collective on every rank", function()
    multi()
    local err = fails(function() dist.all_reduce(R == LAST and "x" or engine.ones(2)) end)
    if R ~= LAST then
      assert.matches("all_reduce: rank " .. LAST .. " %(group rank " .. LAST .. " of world%) failed its checks: " ..
        "all_reduce: argument 1 must be a tensor, got string", err)
    end
    still_usable()
  end)

  it("can be turned off and on again (set the same way on every rank)", function()
    dist.set_comm_check(false)
    assert.is_false(dist.get_comm_check())
    local t = engine.ones(1)
    dist.all_reduce(t)
    dist.set_comm_check(true)
    assert.same({ W }, flat(t))
  end)
end)

describe("validations before a collective are agreed (one-rank faults)", function()
  it("batch-sharded cross_entropy with an out-of-range target on one rank fails on every rank", function()
    multi()
    local mesh = dist.init_device_mesh("cpu", { W })
    engine.manual_seed(3)
    local logits = dist.distribute_tensor(engine.randn(2 * W, 5), mesh, { dist.Shard(1) })
    local tl = {}
    for i = 1, 2 do tl[i] = (R == LAST and i == 2) and 7 or i end
    local target = dist.DTensor.from_local(engine.tensor(tl, "i64"), mesh, { dist.Shard(1) })
    local err = fails(function() return engine.cross_entropy(logits, target) end)
    assert.matches("out of range", err)
    if R ~= LAST then assert.matches("rank " .. LAST .. " %(group rank " .. LAST .. " of", err) end
    still_usable()
    -- the same call with valid targets works afterwards
    local ok = dist.DTensor.from_local(engine.tensor({ 1, 2 }, "i64"), mesh, { dist.Shard(1) })
    local loss = engine.cross_entropy(logits, ok)
    assert.is_true(loss:full_tensor():item() > 0)
  end)

  it("ops whose local function checks per-rank data (embedding, index_select, cross_entropy with reduction none) "
    .. "fail on every rank when one rank's indices are bad", function()
    multi()
    local mesh = dist.init_device_mesh("cpu", { W })
    local sub = W >= 4 and dist.init_device_mesh("cpu", { 2, math.floor(W / 2) }, { "a", "b" })["b"] or nil
    engine.manual_seed(4)
    local w = dist.distribute_tensor(engine.randn(10, 3), mesh, { dist.Replicate() })
    local function ids(bad) return engine.tensor({ { 1, 2 }, { 3, (R == LAST and bad) and 50 or 4 } }, "i64") end
    -- weight Replicate, ids sharded on the batch: the lookup fails on the last rank only
    local err = fails(function()
      return engine.nn.functional.embedding(dist.DTensor.from_local(ids(true), mesh, { dist.Shard(1) }), w):full_tensor()
    end)
    assert.matches("out of range", err)
    if R ~= LAST then assert.matches("rank " .. LAST .. " %(group rank " .. LAST .. " of", err) end
    still_usable()
    local y = engine.nn.functional.embedding(dist.DTensor.from_local(ids(false), mesh, { dist.Shard(1) }), w)
    assert.are.same({ 2 * W, 2, 3 }, y:full_tensor():shape())
    -- index_select with a sharded index
    err = fails(function()
      local idx = dist.DTensor.from_local(engine.tensor({ 0, (R == LAST) and 99 or 1 }, "i64"), mesh, { dist.Shard(1) })
      return w:index_select(1, idx):full_tensor()
    end)
    assert.matches("out of range", err)
    still_usable()
    -- cross_entropy, reduction none, batch sharded: no collective of its own, still agreed
    local logits = dist.distribute_tensor(engine.randn(2 * W, 5), mesh, { dist.Shard(1) })
    err = fails(function()
      local t = dist.DTensor.from_local(engine.tensor({ 1, (R == LAST) and 9 or 2 }, "i64"), mesh, { dist.Shard(1) })
      return engine.cross_entropy(logits, t, { reduction = "none" }):full_tensor()
    end)
    assert.matches("out of range", err)
    still_usable()
    if sub then -- on a sub-mesh group: only its members agree, the other rows are unaffected
      local ws = dist.distribute_tensor(engine.randn(10, 3), sub, { dist.Replicate() })
      local function lookup()
        local i = engine.tensor({ { 1 }, { (R == LAST) and 50 or 2 } }, "i64")
        return engine.nn.functional.embedding(dist.DTensor.from_local(i, sub, { dist.Shard(1) }), ws):full_tensor()
      end
      if R >= W / 2 then assert.matches("out of range", fails(lookup))   -- the last rank's row
      else assert.are.same({ 4, 1, 3 }, lookup():shape()) end             -- the other row is unaffected
      still_usable()
    end
  end)

  it("clip_grad_norm_ over DTensor shards: a bad gradient on one rank fails on every rank", function()
    multi()
    local mesh = dist.init_device_mesh("cpu", { W })
    local p = dist.distribute_tensor(engine.ones(2 * W, 3), mesh, { dist.Shard(1) })
    p.requires_grad = true
    p:sum():backward()
    local n = engine.optim.clip_grad_norm_({ p }, 1e9)
    assert.near(math.sqrt(6 * W), n:item(), 1e-6)
    if R == LAST then p.grad = dist.DTensor.from_local(engine.ones(2, 3), mesh, { dist.Partial() }) end
    local err = fails(function() return engine.optim.clip_grad_norm_({ p }, 1.0) end)
    assert.matches("Partial placement has no norm", err)
    if R ~= LAST then assert.matches("rank " .. LAST .. " %(group rank " .. LAST .. " of", err) end
    still_usable()
  end)

  it("clip_grad_norm_ over DTensor shards: a rank without gradients takes part instead of leaving the others", function()
    multi()
    local mesh = dist.init_device_mesh("cpu", { W })
    local p = dist.distribute_tensor(engine.ones(2 * W, 3), mesh, { dist.Shard(1) })
    p.requires_grad = true
    p:sum():backward()
    if R == LAST then p.grad = nil end
    local n = engine.optim.clip_grad_norm_({ p }, 1e9)
    assert.near(math.sqrt(6 * (W - 1)), n:item(), 1e-6)
    still_usable()
  end)
end)

describe("DTensors: local and global views", function()
  local mesh, full, d
  before_each(function()
    mesh = dist.init_device_mesh("cpu", { W })
    full = engine.arange(8):float():view(4, 2)
    d = dist.distribute_tensor(full, mesh, { dist.Shard(2) })
  end)

  it("get/set/item/totable on a sharded DTensor are errors naming full_tensor() and to_local()", function()
    if W == 1 then d = dist.distribute_tensor(full, mesh, { dist.Shard(1) }) end
    local cases = {
      { "get", function() local v = d:get(1, 1); return v end },
      { "set", function() d:set(5, 1, 1); return d end },
      { "totable", function() local v = d:totable(); return v end },
      { "item", function() local v = d:sum():item(); return v end }, -- Partial(sum)
    }
    for _, case in ipairs(cases) do
      local name, fn = case[1], case[2]
      if W > 1 or name ~= "item" then -- on one rank the sum is Replicate
        local err = fails(fn)
        assert.matches("^[^\n]-comm_check_spec.lua:%d+: " .. name .. ": DTensor f32", err) -- points at the caller
        assert.matches("full_tensor%(%)", err)
        assert.matches("to_local%(%)", err)
      end
    end
    assert.equal(8, d:numel())
    assert.same({ { 0, 1 }, { 2, 3 }, { 4, 5 }, { 6, 7 } }, d:full_tensor():totable())
  end)

  it("element access on a Replicate DTensor reads the global tensor", function()
    local r = dist.distribute_tensor(full, mesh, { dist.Replicate() })
    assert.equal(7, r:get(4, 2))
    assert.same({ { 0, 1 }, { 2, 3 }, { 4, 5 }, { 6, 7 } }, r:totable())
    assert.equal(28, d:sum():full_tensor():item())
  end)

  it("copy_ between a DTensor and a plain tensor is an error naming the global layout", function()
    local err = fails(function() d:copy_(engine.zeros(4, 2)) end)
    assert.matches("copy_: the destination is DTensor f32%[4,2%] on mesh", err)
    assert.matches("distribute_tensor", err)
    err = fails(function() engine.zeros(4, 2):copy_(d) end)
    assert.matches("full_tensor%(%)", err)
    -- DTensor to DTensor and a 0-d fill still work
    d:copy_(dist.distribute_tensor(full * 2, mesh, { dist.Shard(2) }))
    assert.same({ { 0, 2 }, { 4, 6 }, { 8, 10 }, { 12, 14 } }, d:full_tensor():totable())
    d:copy_(engine.tensor(1.5))
    assert.equal(12, d:full_tensor():sum():item())
  end)

  it("collectives on a DTensor are errors naming redistribute", function()
    for _, fn in ipairs({ function() dist.all_reduce(d) end, function() dist.all_gather(d) end,
      function() dist.broadcast(d, 0) end }) do
      local err = fails(fn)
      assert.matches("is a DTensor %(f32%[4,2%] on mesh", err)
      assert.matches("redistribute", err)
    end
    still_usable()
  end)
end)

describe("deferred signature checks (NCCL's default; ENGINE_COMM_CHECK=async everywhere)", function()
  -- the check's all_reduce starts and the collective is issued without waiting for it (no host round trip in
  -- front of an NCCL call); the next call on the group completes it: a mismatch fails that call on every rank and
  -- aborts the group, which says so afterwards. Exercised here on MPI through the async mode.
  local C = engine.C
  local function with_async(fn)
    C.eng_comm_set_check(3)
    local ok, err = pcall(fn)
    C.eng_comm_set_check(1)
    assert(ok, err)
  end

  it("agreeing collectives give the same results and counts as blocking checks", function()
    with_async(function()
      local t = engine.tensor({ R + 1, 2 * (R + 1) })
      local c = dist.count_collectives(function()
        dist.all_reduce(t, "sum")
        dist.all_reduce(t, "max")
        dist.barrier()
      end)
      local s = W * (W + 1) / 2
      assert.same({ s, 2 * s }, flat(t))
      assert.equal(2, c.all_reduce)
    end)
  end)

  it("a mismatch fails the next call on the group on every rank, names both sides, and aborts the group", function()
    multi()
    with_async(function()
      local g = dist.new_group(range(W))
      local t = engine.ones(3)
      -- same sizes, different ops: MPI completes it, the deferred check sees the difference
      dist.all_reduce(t, R == 0 and "sum" or "max", { group = g })
      local err = fails(function() dist.all_reduce(engine.ones(2), "sum", { group = g }) end)
      assert.matches("deferred signature check", err)
      assert.matches("sum", err)
      assert.matches("max", err)
      err = fails(function() dist.all_reduce(engine.ones(2), "sum", { group = g }) end)
      assert.matches("is unusable: the ranks issued different collectives at #", err)
      still_usable() -- the world group is unaffected
      still_usable(dist.new_group(range(W)))
    end)
  end)
end)
