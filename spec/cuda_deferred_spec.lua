-- Device error checks without host synchronisation (engine/src/cuda/deferred.c, issue 28 item 2): embedding
-- and cross entropy on CUDA write an error flag instead of reading it back; the host raises the op's message at
-- the next host sync (item(), synchronize, a copy to the host), optimizer step (no wait) or
-- engine.cuda.check_errors() (waits).  The bookkeeping is checked on every machine through host-memory test
-- checks; the #gpu tests check the real ops (the same messages as before, at the check points) and that a
-- training step performs no host synchronisation (the runtime's sync counter).
local engine = require("engine")
local C = engine.C
local ffi = require("ffi")
local nn, optim = engine.nn, engine.optim
local F = nn.functional
local cuda = engine.cuda

local has_gpu = C.eng_cuda_is_available() == 1
local function gpu_it(name, fn)
  if has_gpu then it(name .. " #gpu", fn) else pending(name .. " #gpu (no GPU here: " .. cuda.unavailable_reason() .. ")") end
end

local function last_error() return ffi.string(C.eng_last_error()) end

describe("deferred device checks (host-memory test checks, any machine)", function()
  before_each(function() C.eng_cuda_poll_errors() end)

  it("retire clean checks and raise the first bad one with its op's message, dropping the rest", function()
    assert.are.equal(0, cuda.pending_checks())
    local a = C.eng_deferred_test_flag("embedding", 5, 7)
    assert.is_true(a ~= nil)
    assert.are.equal(1, cuda.pending_checks())
    assert.are.equal(0, C.eng_cuda_poll_errors())
    assert.are.equal(0, cuda.pending_checks())
    local f1 = C.eng_deferred_test_flag("embedding", 1, 2)
    local f2 = C.eng_deferred_test_flag("cross_entropy", 3, -100)
    local f3 = C.eng_deferred_test_flag("cross_entropy", 4, -100)
    f2[0] = 1
    f3[0] = 1
    assert.is_true(f1 ~= nil)
    assert.are.equal(3, cuda.pending_checks())
    assert.are.equal(-1, C.eng_cuda_poll_errors())
    assert.are.equal("cross_entropy: test check failed (a = 3, b = -100)", last_error())
    assert.are.equal(0, cuda.pending_checks())
    assert.are.equal(0, C.eng_cuda_poll_errors())   -- raised once
    local f4 = C.eng_deferred_test_flag("x", 9, 9)
    f4[0] = 1
    assert.has_error(function() cuda.check_errors() end, "x: test check failed (a = 9, b = 9)")
    cuda.check_errors()
  end)

  it("keep working past the ring's size without a poll (the oldest are retired when it is full)", function()
    local last
    for i = 1, 3000 do last = C.eng_deferred_test_flag("op" .. i, i, 0) end
    assert.is_true(cuda.pending_checks() <= 1024)
    last[0] = 1
    assert.are.equal(-1, C.eng_cuda_poll_errors())
    assert.are.equal("op3000: test check failed (a = 3000, b = 0)", last_error())
  end)

  it("are raised by the optimizer's step (its check point) with the op's message", function()
    local p = nn.Parameter(engine.ones(3))
    local opt = optim.AdamW({ p }, { lr = 0.1 })
    p.grad = engine.ones(3)
    local f = C.eng_deferred_test_flag("embedding", 11, 0)
    f[0] = 1
    assert.has_error(function() opt:step() end, "embedding: test check failed (a = 11, b = 0)")
    opt:step()   -- nothing pending: steps
    assert.is_true(p:get(1) < 1)
  end)

  it("leave the CPU ops as they were: bad indices raise at once", function()
    local w = engine.randn(4, 3)
    assert.has_error(function() F.embedding(engine.tensor({ 0, 4 }, "i64"), w) end)
    assert.has_error(function() F.cross_entropy(engine.randn(2, 4), engine.tensor({ 0, 7 }, "i64")) end)
    assert.are.equal(0, cuda.pending_checks())
    assert.are.equal(0, cuda.sync_count())   -- no device: the runtime never synchronised
  end)
end)

describe("deferred device checks on the GPU", function()
  local function cpu_message(fn)
    local ok, err = pcall(fn)
    assert.is_false(ok)
    return tostring(err)
  end

  gpu_it("embedding: a bad index raises the op's message at item(), not at the op", function()
    cuda.check_errors()
    local w = engine.randn(10, 4):cuda()
    local idx = engine.tensor({ 1, 12, 3 }, "i64"):cuda()
    local before = cuda.sync_count()
    local out = F.embedding(idx, w)          -- no error, no sync here
    assert.are.equal(before, cuda.sync_count())
    assert.are.equal(1, cuda.pending_checks())
    local ok, err = pcall(function() return out:sum():item() end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("an index is out of range for a weight of 10 rows (valid 0..9)", 1, true), err)
    assert.are.equal(0, cuda.pending_checks())
    -- the same through check_errors()
    F.embedding(idx, w)
    assert.has_error(function() cuda.check_errors() end)
    -- and a good index raises nothing
    F.embedding(engine.tensor({ 1, 2 }, "i64"):cuda(), w)
    cuda.check_errors()
    assert.is_not_nil(cpu_message)
  end)

  gpu_it("cross entropy: a bad target raises the op's message at check_errors() and at optimizer step", function()
    cuda.check_errors()
    local x = engine.randn(3, 5):cuda()
    local t = engine.tensor({ 0, 9, 1 }, "i64"):cuda()
    F.cross_entropy(x, t)
    local ok, err = pcall(function() cuda.check_errors() end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("a target is out of range for 5 classes (valid: 0..4, or ignore_index -100)", 1,
      true), err)
    -- the step raises it once the kernel is done (the poll does not wait: synchronise first)
    local p = nn.Parameter(engine.ones(3):cuda())
    local opt = optim.AdamW({ p }, { lr = 0.1 })
    p.grad = engine.ones(3):cuda()
    F.cross_entropy(x, t)
    C.eng_cuda_stream_synchronize(0)   -- raises here already (a host sync); check the step path too:
    F.cross_entropy(x, t)
    local deadline = os.clock() + 5
    while C.eng_cuda_pending_checks() > 0 and os.clock() < deadline do
      local ok2 = pcall(function() opt:step() end)
      if not ok2 then break end
    end
    assert.are.equal(0, cuda.pending_checks())
  end)

  gpu_it("a training step (forward, loss, backward, AdamW step, zero_grad) performs no host synchronisation", function()
    cuda.check_errors()
    engine.manual_seed(0)
    local model = nn.Transformer{ n_layers = 2, dim = 64, n_heads = 4, vocab_size = 128, max_seq_len = 32,
      dropout_p = 0, gelu = "tanh" }
    model:to("cuda")
    local opt = optim.AdamW(model:parameters(), { lr = 1e-3 })
    local x = (engine.rand(4, 32) * 128):long():clamp(0, 127):cuda()
    local y = (engine.rand(4, 32) * 128):long():clamp(0, 127):cuda()
    local function step()
      local _, loss = model(x, y)
      loss:backward()
      opt:step()
      opt:zero_grad()
      return loss
    end
    step(); step()
    cuda.synchronize()
    local before = cuda.sync_count()
    local loss
    for _ = 1, 3 do loss = step() end
    local during = cuda.sync_count() - before
    assert.are.equal(0, during, "host synchronisations in 3 training steps: " .. during)
    -- The optimizer polls the checks without waiting, so on a fast GPU they may all be retired by now; a
    -- forward and backward alone leave the embedding / cross-entropy checks pending until the next sync.
    local _, l2 = model(x, y)
    l2:backward()
    assert.is_true(cuda.pending_checks() > 0, "pending checks after forward and backward")
    local v = l2:item()
    opt:zero_grad()
    assert.is_true(v == v)
    assert.are.equal(0, cuda.pending_checks())
  end)
end)
