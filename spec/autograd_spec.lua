-- The autograd engine itself: accumulation, graph shapes, retain_graph,
-- grad mode, detach, hooks, retain_grad, autograd.grad, Lua Functions,
-- saved-tensor version checks and graph memory release.
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local autograd = engine.autograd

local function leaf(v, dt) return engine.tensor(v, { dtype = dt or "f64", requires_grad = true }) end

describe("autograd", function()
  it("accumulates into .grad over two backward calls", function()
    local x = leaf({ 1, 2, 3 })
    ;(x * x):sum():backward()
    assert.are.same({ 2, 4, 6 }, x.grad:totable())
    ;(x * 3):sum():backward()
    assert.are.same({ 5, 7, 9 }, x.grad:totable())
    x.grad = nil
    assert.is_nil(x.grad)
    x:sum():backward()
    assert.are.same({ 1, 1, 1 }, x.grad:totable())
  end)

  it("does not alias the caller's gradient tensor in .grad", function()
    local x = leaf({ 1, 2 })
    local g = engine.tensor({ 1, 1 }, "f64")
    local y = x * 1
    y:backward(g)
    y = x * 1
    y:backward(g)
    assert.are.same({ 2, 2 }, x.grad:totable())
    assert.are.same({ 1, 1 }, g:totable(), "the gradient passed in stays unchanged")
    local z = leaf({ 1, 2 })
    z:backward(g)
    z:backward(g)
    assert.are.same({ 2, 2 }, z.grad:totable())
    assert.are.same({ 1, 1 }, g:totable())
  end)

  it("handles diamond graphs (a node used by several consumers)", function()
    local x = leaf({ 1, 2 })
    local a = x * 2
    local b = x * 3
    local c = a * b            -- 6 x^2 -> 12 x
    local d = c + a            -- + 2
    d:sum():backward()
    assert.are.same({ 14, 26 }, x.grad:totable())
    -- a shared intermediate feeding both sides of a product
    local y = leaf({ 3 })
    local s = y:exp()
    local r = s * s + s        -- e^{2y} + e^y
    r:backward(engine.tensor({ 1 }, "f64"))
    assert.are.near(2 * math.exp(6) + math.exp(3), y.grad:item(), 1e-9)
  end)

  it("follows the deepest branch first and handles long chains", function()
    local x = leaf({ 0.5 })
    local y = x
    for _ = 1, 200 do y = y * 1.01 end
    y:sum():backward()
    assert.are.near(1.01 ^ 200, x.grad:item(), 1e-9)
  end)

  it("retain_graph keeps saved tensors; a second backward without it errors", function()
    local x = leaf({ 1, 2 })
    local y = (x * x):sum()
    y:backward({ retain_graph = true })
    y:backward()
    assert.are.same({ 4, 8 }, x.grad:totable())
    local ok, err = pcall(function() y:backward() end)
    assert.is_false(ok)
    assert.matches("backward through", err)
    assert.matches("a second time", err)
    assert.matches("retain_graph", err)
    -- autograd.backward with several roots and retain_graph
    local z = leaf({ 1 })
    local u, v = z * 2, z * 3
    autograd.backward({ u, v }, { engine.tensor({ 1 }, "f64"), engine.tensor({ 1 }, "f64") }, { retain_graph = true })
    assert.are.same({ 5 }, z.grad:totable())
  end)

  it("no_grad turns recording off and restores the mode (also after errors)", function()
    local x = leaf({ 1, 2 })
    assert.is_true(engine.is_grad_enabled())
    local y, flag = engine.no_grad(function() return x * 2, engine.is_grad_enabled() end)
    assert.is_false(flag)
    assert.is_false(y.requires_grad)
    assert.is_nil(y.grad_fn)
    assert.is_true(engine.is_grad_enabled())
    assert.has_error(function() engine.no_grad(function() error("boom") end) end)
    assert.is_true(engine.is_grad_enabled())
    local inner = engine.no_grad(function() return engine.enable_grad(function() return x * 2 end) end)
    assert.are.equal("MulBackward", inner.grad_fn)
    engine.set_grad_enabled(false)
    assert.is_false((x * 2).requires_grad)
    engine.set_grad_enabled(true)
    assert.is_true((x * 2).requires_grad)
  end)

  it("detach shares storage and cuts the graph", function()
    local x = leaf({ 1, 2 })
    local y = x * 2
    local d = y:detach()
    assert.is_false(d.requires_grad)
    assert.is_nil(d.grad_fn)
    assert.is_true(d.is_leaf)
    d:fill_(7)
    assert.are.same({ 7, 7 }, y:totable(), "same storage")
    local z = (x:detach() * x):sum()
    z:backward()
    assert.are.same({ 1, 2 }, x.grad:totable(), "the detached factor is a constant")
  end)

  it("requires_grad_ and the requires_grad property", function()
    local x = engine.tensor({ 1, 2 }, "f32")
    assert.is_false(x.requires_grad)
    x:requires_grad_()
    assert.is_true(x.requires_grad)
    x.requires_grad = false
    assert.is_false(x.requires_grad)
    assert.has_error(function() engine.tensor({ 1, 2 }):requires_grad_() end,
      "requires_grad_: only floating point tensors can require gradients, got i64[2]")
    assert.has_error(function() engine.tensor({ true }):requires_grad_(true) end)
    assert.has_error(function() engine.zeros(2, { dtype = "i32", requires_grad = true }) end)
    local y = leaf({ 1 }) * 2
    assert.has_error(function() y:requires_grad_(false) end,
      "requires_grad_: f64[1] is not a leaf (it has grad_fn MulBackward); use detach()")
    assert.has_error(function() engine.tensor({ 1.5 }):backward() end,
      "backward: tensor 0 (f32[1]) does not require grad and has no grad_fn")
    assert.has_error(function() leaf({ 1, 2 }):backward() end,
      "backward: grad can be implicitly created only for one-element outputs, got f64[2] (pass a gradient)")
    assert.has_error(function() leaf({ 1, 2 }):backward(engine.ones(3, { dtype = "f64" })) end,
      "backward: gradient f64[3] does not match output f64[2]")
  end)

  it("tensor hooks see and may replace gradients", function()
    local x = leaf({ 1, 2 })
    local seen
    local h = x:register_hook(function(g) seen = g:totable(); return g * 10 end)
    ;(x * 3):sum():backward()
    assert.are.same({ 3, 3 }, seen)
    assert.are.same({ 30, 30 }, x.grad:totable())
    h:remove()
    x.grad = nil
    ;(x * 3):sum():backward()
    assert.are.same({ 3, 3 }, x.grad:totable())
    -- hook on a non-leaf changes what flows further back
    local a = leaf({ 1, 2 })
    local b = a * 2
    b:register_hook(function(g) return g * 0 + 1 end)
    local c = (b * b):sum()     -- dc/db = 2b = {4, 8}, replaced by ones
    c:backward()
    assert.are.same({ 2, 2 }, a.grad:totable())
    -- a hook returning nil keeps the gradient
    local k = leaf({ 5 })
    local calls = 0
    k:register_hook(function() calls = calls + 1 end)
    ;(k * 2):sum():backward()
    assert.are.equal(1, calls)
    assert.are.same({ 2 }, k.grad:totable())
  end)

  it("hook errors surface as Lua errors", function()
    assert.has_error(function() engine.ones(2):register_hook(function() end) end,
      "register_hook: cannot register a hook on f32[2], which does not require grad")
    assert.has_error(function() leaf({ 1 }):register_hook(5) end, "register_hook: expected a function")
    local x = leaf({ 1, 2 })
    x:register_hook(function(g) return engine.ones(3, { dtype = "f64" }) end)
    local ok, err = pcall(function() (x * 2):sum():backward() end)
    assert.is_false(ok)
    assert.matches("hook: returned gradient f64%[3%] does not match the gradient f64%[2%]", err)
    local y = leaf({ 1 })
    y:register_hook(function() error("hook failed on purpose") end)
    ok, err = pcall(function() (y * 2):sum():backward() end)
    assert.is_false(ok)
    assert.matches("hook failed on purpose", err)
    local z = leaf({ 1 })
    z:register_hook(function() return 42 end)
    ok, err = pcall(function() (z * 2):sum():backward() end)
    assert.is_false(ok)
    assert.matches("hook returned a number where a tensor or nil was expected", err)
  end)

  it("post-accumulate-grad hooks run after .grad is updated", function()
    local x = leaf({ 1, 2 })
    local seen = {}
    local h = x:register_post_accumulate_grad_hook(function(t) seen[#seen + 1] = t.grad:totable() end)
    ;(x * 2):sum():backward()
    ;(x * 2):sum():backward()
    assert.are.same({ { 2, 2 }, { 4, 4 } }, seen)
    h:remove()
    ;(x * 2):sum():backward()
    assert.are.equal(2, #seen)
    assert.has_error(function() (leaf({ 1 }) * 2):register_post_accumulate_grad_hook(function() end) end)
  end)

  it("retain_grad keeps the gradient of a non-leaf", function()
    local x = leaf({ 1, 2 })
    local y = x * 3
    y:retain_grad()
    local z = y * y
    assert.is_nil(z.grad)
    z:sum():backward()
    assert.are.same({ 6, 12 }, y.grad:totable())
    assert.are.same({ 18, 36 }, x.grad:totable())
    local w = x * 2
    w:sum():backward()
    assert.is_nil(w.grad, "non-leaf without retain_grad has no .grad")
    assert.has_error(function() engine.ones(2):retain_grad() end, "retain_grad: f32[2] does not require grad")
  end)

  it("autograd.grad returns gradients and leaves .grad untouched", function()
    local x = leaf({ 1, 2 })
    local w = leaf({ 3, 4 })
    local y = (x * w):sum()
    local gs = autograd.grad(y, { x, w })
    assert.are.same({ 3, 4 }, gs[1]:totable())
    assert.are.same({ 1, 2 }, gs[2]:totable())
    assert.is_nil(x.grad)
    assert.is_nil(w.grad)
    -- gradient of an intermediate
    local a = leaf({ 2 })
    local b = a * a
    local c = b * 3
    local gb = autograd.grad(c, { b }, engine.tensor({ 1 }, "f64"))
    assert.are.same({ 3 }, gb[1]:totable())
    assert.is_nil(a.grad)
    assert.has_error(function() autograd.grad((x * 2):sum(), { engine.ones(2) }) end,
      "grad: input 0 does not require grad")
  end)

  it("autograd.Function runs a Lua forward and backward", function()
    local Cube = autograd.Function({
      forward = function(ctx, x, k)
        ctx:save_for_backward(x)
        ctx.k = k
        return x * x * x * k
      end,
      backward = function(ctx, g)
        local x = ctx.saved[1]
        return g * x * x * (3 * ctx.k)
      end,
    })
    local x = leaf({ 1, 2 })
    local y = Cube(x, 2)
    assert.are.same({ 2, 16 }, y:totable())
    assert.are.equal("LuaFunctionBackward", y.grad_fn)
    y:sum():backward()
    assert.are.same({ 6, 24 }, x.grad:totable())
    -- two inputs, two outputs, needs_input_grad
    local needs
    local Split = autograd.Function({
      forward = function(ctx, a, b)
        needs = { ctx.needs_input_grad[1], ctx.needs_input_grad[2] }
        return a + b, a - b
      end,
      backward = function(ctx, gs, gd)
        local ga = (gs or 0) + (gd or 0)
        local gb = (gs or 0) - (gd or 0)
        return ga, gb
      end,
    })
    local a = leaf({ 1 })
    local b = engine.tensor({ 5 }, "f64")
    local s, d = Split.apply(a, b)
    assert.are.same({ true, false }, needs)
    ;((s * 2) + (d * 3)):sum():backward()
    assert.are.same({ 5 }, a.grad:totable())
    -- the forward runs without recording
    local Probe = autograd.Function({
      forward = function(ctx, x) return x * 2, engine.is_grad_enabled() end,
      backward = function(ctx, g) return g * 2 end,
    })
    local out, mode = Probe(leaf({ 1 }))
    assert.is_false(mode)
    assert.is_true(out.requires_grad)
    -- a backward error surfaces
    local Bad = autograd.Function({
      forward = function(ctx, x) return x * 1 end,
      backward = function() error("custom backward failed") end,
    })
    local ok, err = pcall(function() Bad(leaf({ 1 })):sum():backward() end)
    assert.is_false(ok)
    assert.matches("custom backward failed", err)
    assert.has_error(function() autograd.Function({ forward = 1 }) end)
  end)

  it("errors when a tensor saved for backward was modified in place", function()
    local x = leaf({ 1, 2 })
    local y = x * 2
    local z = y * y            -- saves y
    engine.no_grad(function() y:add_(1) end)
    local ok, err = pcall(function() z:sum():backward() end)
    assert.is_false(ok)
    assert.matches("modified by an in%-place operation", err)
    local a = leaf({ 0.5 })
    local e = a:exp()          -- saves its output
    local f = e * 1
    engine.no_grad(function() e:mul_(2) end)
    ok, err = pcall(function() f:sum():backward() end)
    assert.is_false(ok)
    assert.matches("ExpBackward", err)
  end)

  it("frees the graph after backward: no growth of live tensors or memory", function()
    local w = leaf({ { 0.1, 0.2, 0.3 }, { 0.4, 0.5, 0.6 } }, "f32")
    local x = engine.ones(4, 2)
    local function step()
      local h = (x:matmul(w)):tanh()
      local loss = (h * h):mean() + h:max() - h:sum(1):mean()
      loss:backward()
      w.grad = nil
    end
    for _ = 1, 5 do step() end
    collectgarbage(); collectgarbage()
    local live0 = engine.live_tensors()
    local mem0 = engine.memory_stats().allocated
    for _ = 1, 50 do step() end
    collectgarbage(); collectgarbage()
    local live1, mem1 = engine.live_tensors(), engine.memory_stats().allocated
    assert(live1 <= live0, string.format("live tensors grew from %d to %d", live0, live1))
    assert(mem1 <= mem0, string.format("allocated bytes grew from %d to %d", mem0, mem1))
    -- a graph that is never backpropagated is freed with its tensors
    do local y = (x:matmul(w) * 2):sum() end
    collectgarbage(); collectgarbage()
    assert(engine.live_tensors() <= live1)
    assert(engine.memory_stats().allocated <= mem1)
  end)
end)
