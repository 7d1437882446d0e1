-- Memory that Lua's collector keeps bounded.  A Tensor is a small Lua table whose
-- storage the collector does not see, so a loop that drops its activations every iteration grew until
-- the Lua heap alone triggered a collection (200 no_grad forwards of the reference Transformer reached
-- 2.6 GB).  The allocator's live bytes now drive the collector (docs/design.md "Allocator"): these specs
-- run plain loops, with no collectgarbage() of their own, and check the allocator's peak against the
-- footprint of one iteration (measured with nothing collected during it).
local engine = require("engine")
local nn, F, optim = engine.nn, engine.nn.functional, engine.optim

local MiB = 2 ^ 20

local self_exe = require("spec.helpers.proc").self_exe

-- The reference model of recipes/gpt.lua (3.25M parameters).
local function reference_model()
  engine.manual_seed(0)
  return nn.Transformer{ n_layers = 4, dim = 256, n_heads = 4, vocab_size = 256, max_seq_len = 128 }
end

local function batch(b, t)
  local ids = (engine.rand(b, t + 1) * 255.99):to("i64")
  return ids:narrow(2, 1, t), ids:narrow(2, 2, t)
end

-- Peak allocated bytes of fn() run once from a clean heap with no collection during it (the
-- collector pressure switched off where it exists), so: the live bytes plus everything one
-- iteration allocates.
local function footprint(fn)
  collectgarbage(); collectgarbage()
  local prev = engine.set_gc_threshold and engine.set_gc_threshold{ ratio = 0 }
  engine.reset_peak_memory()
  fn()
  local peak = engine.memory_stats().peak_allocated
  collectgarbage(); collectgarbage()
  if prev then engine.set_gc_threshold(prev) end   -- (re-arms the threshold from the live bytes)
  return peak
end

-- Peak allocated bytes over n runs of fn(), with no collectgarbage() in the loop.
local function loop_peak(n, fn)
  collectgarbage(); collectgarbage()
  engine.reset_peak_memory()
  for i = 1, n do fn(i) end
  local s = engine.memory_stats()
  collectgarbage(); collectgarbage()
  return s.peak_allocated, s
end

describe("memory: tensor bytes drive Lua's collector", function()
  -- The threshold is max(2 x live, live + 64 MiB) after each collection; pacing (which raises the 64 MiB
  -- while collections cost over 1% of the time) is off in the two model loops so that their bound does
  -- not depend on the machine's speed or on the Lua heap that earlier specs left; the 1 MiB loop checks
  -- the defaults' cap.
  it("200 no_grad forwards of the reference Transformer peak within 2x one forward's footprint", function()
    local prev = engine.set_gc_threshold and engine.set_gc_threshold{ max_fraction = 0 }
    finally(function() if prev then engine.set_gc_threshold(prev) end end)
    local m = reference_model()
    m:eval()
    local x = batch(8, 128)
    local function forward() engine.no_grad(function() local _ = m(x) end) end
    forward()
    local one = footprint(forward)
    local peak, s = loop_peak(200, forward)
    assert.is_true(peak <= 2 * one, string.format("peak %.1f MiB over 200 forwards, one forward %.1f MiB",
      peak / MiB, one / MiB))
    assert.is_true(engine.live_tensors() < 1000, "live tensors: " .. engine.live_tensors())
    assert.is_true(s.gc_collections > 0)
  end)

  it("a training loop (AdamW, 30 steps) peaks within 3x one step's footprint", function()
    local prev = engine.set_gc_threshold and engine.set_gc_threshold{ max_fraction = 0 }
    finally(function() if prev then engine.set_gc_threshold(prev) end end)
    local m = reference_model()
    local opt = optim.AdamW(m:parameters(), { lr = 1e-3, weight_decay = 0.1 })
    local x, y = batch(4, 128)
    local function step()
      local loss = F.cross_entropy(m(x):reshape(-1, 256), y:reshape(-1))
      loss:backward()
      opt:step()
      opt:zero_grad()
    end
    step()   -- the optimizer state exists from here on
    local one = footprint(step)
    local peak = loop_peak(30, step)
    assert.is_true(peak <= 3 * one, string.format("peak %.1f MiB over 30 steps, one step %.1f MiB",
      peak / MiB, one / MiB))
  end)

  it("a loop of dropped 1 MiB tensors peaks near the threshold (pacing off), under its cap (defaults)", function()
    local function loop() return loop_peak(4000, function() local _ = engine.empty(MiB / 4) end) end
    local prev = engine.set_gc_threshold and engine.set_gc_threshold{ max_fraction = 0 }
    local live = engine.memory_stats().allocated
    local peak = loop()
    if prev then engine.set_gc_threshold(prev) end
    assert.is_true(peak <= live + 66 * MiB, string.format("peak %.1f MiB, live %.1f MiB", peak / MiB, live / MiB))
    -- with the defaults, collections here cost far more than 1% of the loop's time: pacing doubles the
    -- 64 MiB floor up to its cap, 16 x 64 MiB
    peak = loop()
    assert.is_true(peak <= live + 1026 * MiB, string.format("peak %.1f MiB, live %.1f MiB", peak / MiB, live / MiB))
    assert.is_true(peak >= live + 128 * MiB, string.format("peak %.1f MiB, live %.1f MiB", peak / MiB, live / MiB))
  end)

  it("counts storage bytes, not views, and exposes the threshold", function()
    collectgarbage(); collectgarbage()
    local b0 = engine.memory_stats().gc_bytes
    local t = engine.empty(1024)        -- 4 KiB
    local v = t:view(32, 32):narrow(1, 1, 4)
    assert.are.equal(b0 + 4096, engine.memory_stats().gc_bytes)
    t, v = nil, nil
    collectgarbage()
    assert.are.equal(b0, engine.memory_stats().gc_bytes)
    local s = engine.memory_stats()
    assert.is_true(s.gc_threshold >= s.gc_bytes + 64 * MiB or s.gc_threshold >= 2 * s.gc_bytes)
  end)

  it("set_gc_threshold: returns the previous settings, ratio 0 turns it off, bad input is an error", function()
    local prev = engine.set_gc_threshold{ ratio = 0 }
    assert.are.same({ ratio = 2, min_bytes = 64 * MiB, max_fraction = 0.01, backward = 4, backward_fraction = 0.05 }, prev)
    assert.are.equal(-1, engine.memory_stats().gc_threshold)
    local off = engine.set_gc_threshold{ ratio = 3, min_bytes = 16 * MiB }
    assert.are.equal(0, off.ratio)
    local s = engine.memory_stats()
    assert.are.equal(math.max(3 * s.gc_bytes, s.gc_bytes + 16 * MiB), s.gc_threshold)
    engine.set_gc_threshold(prev)
    assert.has_error(function() engine.set_gc_threshold{ ratio = 0.5 } end,
      "set_gc_threshold: ratio must be a finite number >= 0 (0: off, else >= 1), got 0.5")
    assert.has_error(function() engine.set_gc_threshold{ pause = 2 } end,
      "set_gc_threshold: unknown field 'pause' (known: ratio, min_bytes, max_fraction, backward, backward_fraction)")
    assert.has_error(function() engine.set_gc_threshold(2) end,
      "set_gc_threshold: expected a table {ratio =, min_bytes =, max_fraction =, backward =, backward_fraction =}, got number")
    assert.are.same(prev, engine.set_gc_threshold{})
  end)

  it("backward collects the forward's garbage first, so saved tensors are freed as their nodes run", function()
    -- a chain of 8 MiB intermediates whose Lua wrappers are garbage when backward starts: the graph's
    -- references are the only ones left after the collection, so they are gone when backward returns
    local function after_backward(settings)
      local prev = engine.set_gc_threshold(settings)
      collectgarbage(); collectgarbage()
      local x = engine.rand(2 * MiB):requires_grad_()   -- 8 MiB of f32
      local base = engine.memory_stats().gc_bytes
      local loss
      do
        local y = x
        for _ = 1, 8 do y = (y * 0.5):tanh() end
        loss = y:sum()
      end
      local n0 = engine.memory_stats().gc_backward_collections
      loss:backward()
      local grown = engine.memory_stats().gc_bytes - base
      local n1 = engine.memory_stats().gc_backward_collections
      engine.set_gc_threshold(prev)
      x.grad = nil
      return grown / MiB, n1 - n0
    end
    local big = 1024 * MiB   -- no allocator-driven collection in between
    local on, n_on = after_backward{ min_bytes = big, backward = 4, backward_fraction = 1e9 }
    local off, n_off = after_backward{ min_bytes = big, backward = 0 }
    assert.are.equal(1, n_on)
    assert.are.equal(0, n_off)
    assert.is_true(on < 10, "with the collection: " .. on .. " MiB left after backward (x.grad: 8)")
    assert.is_true(off > 70, "without it: " .. off .. " MiB left after backward (16 intermediates of 8 MiB)")
  end)

  it("a loop over named_parameters() does not keep the parameters alive after they are replaced (JIT trace)", function()
    -- in a fresh process the loop's trace is specialised to the iterator closure (its prototype has made few
    -- closures yet) and keeps it alive; the closure must not keep the parameter list (fully_shard and the TP
    -- plans replace every parameter: the originals, the whole model, stayed alive on every rank)
    local path = os.tmpname()
    local f = assert(io.open(path, "w"))
    f:write([[
local e = require('engine')
local nn = e.nn
local mods = {}
for i = 1, 40 do mods[i] = nn.Linear(64, 64) end
local m = nn.Sequential(unpack(mods))
mods = nil
local n = 0
for _, p in m:named_parameters() do n = n + p:numel() end
for _, lin in ipairs(m:children()) do
  lin.weight = nn.Parameter(e.zeros(1))
  lin.bias = nn.Parameter(e.zeros(1))
end
for _ = 1, 4 do collectgarbage() end
print(n, e.memory_stats().allocated)
]])
    f:close()
    local p = io.popen("'" .. self_exe() .. "' " .. path .. " 2>&1")
    local out = p:read("*a")
    p:close()
    os.remove(path)
    local n, bytes = out:match("^(%d+)\t(%d+)")
    assert.are.equal("166400", n, out)
    assert.is_true(tonumber(bytes) < 100000, "bytes still allocated: " .. tostring(bytes) .. " (the 80 originals: 665600)")
  end)

  it("ENGINE_GC_* environment variables set the policy at start-up", function()
    local p = io.popen("ENGINE_GC_RATIO=4 ENGINE_GC_MIN_MB=8 '" .. self_exe() .. "' -e " ..
      "\"local e = require('engine'); local s = e.set_gc_threshold{}; print(s.ratio, s.min_bytes)\" 2>&1")
    local out = p:read("*a")
    p:close()
    assert.are.equal("4\t8388608\n", out)
  end)
end)
