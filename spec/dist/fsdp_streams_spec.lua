-- FSDP's all-gathers and reduce-scatters on separate GPU streams (comm/stream_order.c): the order of the stream
-- and event operations is recorded on every device (eng_comm_stream_trace), so the CPU proves it with the CUDA
-- defaults switched on (prefetch, reduce-scatters left in flight):
--  * every all-gather runs on the communication stream (s1), every reduce-scatter on its own stream (s2), each
--    after waiting for the compute stream (s0) that produced its input;
--  * the compute stream waits for an all-gather's event before FSDP copies its output out, and for every
--    reduce-scatter's event before its buffers are released (the caching allocator reuses them in compute order);
--  * an all-gather issued while a reduce-scatter is in flight (backward prefetch) waits for s0 only: it does
--    not queue behind the reduce-scatter.
-- The #gpu case trains on a CUDA mesh with the two streams and matches one process (several ranks on one GPU:
-- tools/gpu-check.sh).  At 1, 2 and 4 ranks:
--   mpirun -np 2 build/engine /usr/bin/busted --ignore-lua -o tools/passfail_dist.lua spec/dist/fsdp_streams_spec.lua
local engine = require("engine")
local ffi = require("ffi")
local nn = engine.nn
local F = nn.functional
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local C = ffi.C

local R, W = dist.rank(), dist.world_size()

local function lines(text)
  local t = {}
  for l in text:gmatch("[^\n]+") do t[#t + 1] = l end
  return t
end

local function build()
  engine.manual_seed(7)
  return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
end

local function batch(step)
  engine.manual_seed(100 + step)
  return engine.randn(4 * W, 8), engine.randn(4 * W, 4)
end

-- trains `steps` steps of the sharded model on this rank's rows; returns the global losses and the trace
local function train(device, steps)
  ffi.cdef [[ int setenv(const char*, const char*, int); int unsetenv(const char*); ]]
  C.setenv("ENGINE_FSDP_PREFETCH", "1", 1)
  C.setenv("ENGINE_FSDP_ASYNC_REDUCE", "1", 1)
  local mesh = dist.init_device_mesh(device, { W })
  local m = build()
  for _, i in ipairs({ 1, 3, 5 }) do dist.fully_shard(m[i], { mesh = mesh }) end
  dist.fully_shard(m, { mesh = mesh })
  C.unsetenv("ENGINE_FSDP_PREFETCH")
  C.unsetenv("ENGINE_FSDP_ASYNC_REDUCE")
  local opt = engine.optim.AdamW(m:parameters(), { lr = 1e-2 })
  local single = C.eng_comm_get_single_copy()
  C.eng_comm_set_single_copy(0) -- every all-gather through the collective path that the trace records
  C.eng_comm_stream_trace(1)
  local losses = {}
  for s = 1, steps do
    local x, y = batch(s)
    x, y = x:narrow(1, R * 4 + 1, 4), y:narrow(1, R * 4 + 1, 4)
    if device == "cuda" then x, y = x:cuda(), y:cuda() end
    local l = F.mse_loss(m(x), y)
    l:backward()
    opt:step()
    opt:zero_grad()
    local t = l:detach():reshape({ 1 }):to("cpu"):clone()
    dist.all_reduce(t, "sum")
    losses[s] = t:item() / W
  end
  local trace = ffi.string(C.eng_comm_stream_trace_text())
  C.eng_comm_stream_trace(0)
  C.eng_comm_set_single_copy(single)
  return losses, lines(trace)
end

local function reference(steps)
  local m = build()
  local opt = engine.optim.AdamW(m:parameters(), { lr = 1e-2 })
  local losses = {}
  for s = 1, steps do
    local x, y = batch(s)
    local l = F.mse_loss(m(x), y)
    l:backward()
    opt:step()
    opt:zero_grad()
    losses[s] = l:item()
  end
  return losses
end

-- the ordering rules above, on a recorded trace
local function check_order(tr)
  local kind_of, stream_of, in_flight_rs = {}, {}, {}
  local n_ag, n_rs, overlapped = 0, 0, 0
  for i, l in ipairs(tr) do
    local seq, kind, s = l:match("^coll #(%d+) (%S+) on s(%d) group")
    if seq then
      local key = kind .. "#" .. seq .. "@" .. l:match("group (.*)$")
      if kind == "all_gather" then
        n_ag = n_ag + 1
        assert.are.equal("1", s, "all-gather not on the communication stream: " .. l)
        if next(in_flight_rs) then overlapped = overlapped + 1 end
      elseif kind == "reduce_scatter" then
        n_rs = n_rs + 1
        assert.are.equal("2", s, "reduce-scatter not on its own stream: " .. l)
        assert.are.equal("fsdp gradients packed", tr[i - 2], "no compute mark before " .. l)
      end
      assert.are.equal("wait s" .. s .. " <- s0", tr[i - 1], "the collective does not wait for compute: " .. l)
      local nxt = tr[i + 1]
      if nxt == "record e" .. seq .. " on s" .. s then
        kind_of[seq] = kind_of[seq] or {}
        table.insert(kind_of[seq], kind)
        stream_of[key] = s
        if kind == "reduce_scatter" then in_flight_rs[seq] = true end
      else
        assert.are.equal("wait s0 <- s" .. s, nxt, "a blocking collective not followed by the compute wait: " .. l)
      end
    end
    local ws = l:match("^wait s0 <%- e(%d+)$")
    if ws then in_flight_rs[ws] = nil end
    if l == "fsdp copy-out" then
      local w = tr[i - 1] and tr[i - 1]:match("^wait s0 <%- e(%d+)$")
      local prev = tr[i - 1] or ""
      assert.truthy(w or prev:match("^wait s0 <%- s1$"), "FSDP copies out before compute waited for the all-gather: " .. prev)
    end
  end
  assert.is_nil(next(in_flight_rs), "a reduce-scatter's event was never waited for by the compute stream")
  return n_ag, n_rs, overlapped
end

describe("FSDP all-gather and reduce-scatter streams (the recorded order)", function()
  it("on the CPU: the order the NCCL backend runs, with prefetch and reduce-scatters in flight", function()
    if W == 1 then pending("needs 2+ ranks (a shard group of one rank issues no collective)") end
    local losses, tr = train("cpu", 3)
    local n_ag, n_rs, overlapped = check_order(tr)
    assert.is_true(n_ag >= 3 * 4, "all-gathers: " .. n_ag)
    assert.is_true(n_rs >= 3 * 3, "reduce-scatters: " .. n_rs)
    assert.is_true(overlapped > 0, "no all-gather was issued while a reduce-scatter was in flight")
    local ref = reference(3)
    for s = 1, 3 do assert.is_true(math.abs(losses[s] - ref[s]) < 1e-5, "step " .. s) end
  end)

  it("on a CUDA mesh #gpu: the two streams train to the one-process losses", function()
    util.need_cuda_ranks(pending)
    local losses, tr = train("cuda", 5)
    if W > 1 then check_order(tr) end
    local ref = reference(5)
    for s = 1, 5 do
      assert.is_true(math.abs(losses[s] - ref[s]) < 1e-5, string.format("step %d: %g vs %g", s, losses[s], ref[s]))
    end
  end)
end)
