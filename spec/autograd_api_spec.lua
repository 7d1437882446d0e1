-- Autograd ergonomics: ctx.saved_tensors in Lua autograd Functions (ctx.saved kept as
-- an alias), engine.autograd.grad(outputs, inputs, {grad_outputs, retain_graph, create_graph,
-- allow_unused, materialize_grads}) and Module:register_full_backward_hook (PyTorch's semantics:
-- grad_input / grad_output per tensor input / output, a returned list replaces grad_input).
local engine = require("engine")
local nn = engine.nn
local autograd = engine.autograd

local function leaf(v) return engine.tensor(v, "f64"):requires_grad_() end
local function close(a, b, tol)
  return (a:double() - b:double()):abs():max():item() <= (tol or 1e-12)
end
local function errmsg(fn, ...)
  local ok, e = pcall(fn, ...)
  assert(not ok, "expected an error")
  return tostring(e)
end

describe("autograd.Function ctx.saved_tensors", function()
  it("saved_tensors is what save_for_backward stored (ctx.saved is the same list)", function()
    local same
    local Mul = autograd.Function({
      forward = function(ctx, a, b) ctx:save_for_backward(a, b); return a * b end,
      backward = function(ctx, g)
        same = rawequal(ctx.saved, ctx.saved_tensors)
        local a, b = ctx.saved_tensors[1], ctx.saved_tensors[2]
        return g * b, g * a
      end,
    })
    local a, b = leaf({ 1, 2 }), leaf({ 3, 5 })
    Mul(a, b):sum():backward()
    assert.is_true(same)
    assert.are.same({ 3, 5 }, a.grad:totable())
    assert.are.same({ 1, 2 }, b.grad:totable())
    -- nothing saved: an empty list under both names
    local seen
    local Id = autograd.Function({
      forward = function(ctx, x) return x * 1 end,
      backward = function(ctx, g) seen = #ctx.saved_tensors + #ctx.saved; return g end,
    })
    Id(leaf({ 1 })):sum():backward()
    assert.are.equal(0, seen)
  end)
end)

describe("autograd.grad with an option table", function()
  it("grad_outputs, retain_graph: the gradients PyTorch gives, .grad untouched", function()
    local x = leaf({ 1, 2, 3 })
    local y = x * x * x                                          -- dy/dx = 3 x^2
    local g = autograd.grad(y, { x }, { grad_outputs = engine.tensor({ 1, 10, 100 }, "f64"), retain_graph = true })
    assert.are.same({ 3, 120, 2700 }, g[1]:totable())
    assert.is_nil(x.grad)
    local g2 = autograd.grad({ y }, x, { grad_outputs = { engine.ones(3, { dtype = "f64" }) } })  -- graph retained
    assert.are.same({ 3, 12, 27 }, g2[1]:totable())
  end)

  it("a scalar output needs no grad_outputs; several inputs; the old positional form still works", function()
    local a, b = leaf({ 2 }), leaf({ 5 })
    local z = (a * b + a * a):sum()
    local g = autograd.grad(z, { a, b }, { retain_graph = true })
    assert.are.same({ 9 }, g[1]:totable())
    assert.are.same({ 2 }, g[2]:totable())
    g = autograd.grad(z, { b }, engine.tensor(3, "f64"))
    assert.are.same({ 6 }, g[1]:totable())
  end)

  it("unused inputs: an error by default, nil with allow_unused, zeros with materialize_grads", function()
    local x, u = leaf({ 1, 2 }), leaf({ 7, 7, 7 })
    local y = (x * 2):sum()
    assert.matches("input 2 %(f64%[3%]%) was not used in the graph", errmsg(autograd.grad, y, { x, u },
      { retain_graph = true }))
    local g = autograd.grad(y, { x, u }, { allow_unused = true, retain_graph = true })
    assert.are.same({ 2, 2 }, g[1]:totable())
    assert.is_nil(g[2])
    g = autograd.grad(y, { x, u }, { materialize_grads = true })
    assert.are.same({ 0, 0, 0 }, g[2]:totable())
  end)

  it("without retain_graph the graph is freed, as backward (a second grad through it fails)", function()
    local x = leaf({ 1, 2 })
    local y = (x * x):sum()
    autograd.grad({ y }, { x })
    assert.matches("second time", errmsg(function() autograd.grad({ y }, { x }) end))
    local z = (x * x):sum()
    autograd.grad({ z }, { x }, { retain_graph = true })
    local g = autograd.grad({ z }, { x })
    assert.is_true(close(g[1], leaf({ 2, 4 }), 0))
  end)

  it("create_graph = true and unknown options are refused", function()
    local x = leaf({ 1 })
    local y = (x * x):sum()
    assert.matches("create_graph = true is not supported", errmsg(autograd.grad, y, { x }, { create_graph = true }))
    assert.matches("unknown option 'retain'", errmsg(autograd.grad, y, { x }, { retain = true }))
  end)
end)

describe("Module:register_full_backward_hook", function()
  it("grad_input / grad_output are the gradients w.r.t. the module's input and output", function()
    engine.manual_seed(1)
    local lin = nn.Linear(3, 2):double()
    local calls, gin, gout, who = 0, nil, nil, nil
    local h = lin:register_full_backward_hook(function(m, grad_input, grad_output)
      calls, who = calls + 1, m
      gin, gout = grad_input[1], grad_output[1]
    end)
    local x = engine.randn(4, 3, { dtype = "f64" }):requires_grad_()
    local w = engine.randn(4, 2, { dtype = "f64" })
    local y = lin(x)
    local ref_gx = w:matmul(lin.weight:detach())                 -- y = x W^T + b: dL/dx = dL/dy W
    ;(y * w):sum():backward()
    assert.are.equal(1, calls)
    assert.are.equal(lin, who)
    assert.is_true(close(gout, w))
    assert.is_true(close(gin, ref_gx))
    assert.is_true(close(x.grad, ref_gx))
    h:remove()
    lin(x):sum():backward()
    assert.are.equal(1, calls)
  end)

  it("a returned list replaces grad_input", function()
    engine.manual_seed(2)
    local lin = nn.Linear(3, 3):double()
    lin:register_full_backward_hook(function(_, grad_input) return { grad_input[1] * 0.5 } end)
    local x = engine.randn(2, 3, { dtype = "f64" }):requires_grad_()
    lin(x):sum():backward()
    local x2 = x:detach():clone():requires_grad_()
    local lin2 = nn.Linear(3, 3):double()
    lin2:load_state_dict(lin:state_dict())
    lin2(x2):sum():backward()
    assert.is_true(close(x.grad, x2.grad * 0.5))
    assert.is_true(close(lin.weight.grad, lin2.weight.grad))  -- parameters' gradients are unaffected
  end)

  it("input without grad: the hook runs once with grad_input nil; several inputs and outputs", function()
    local Two = nn.Module:extend("TwoInOut")
    function Two:__init() self.w = nn.Parameter(engine.ones(2, { dtype = "f64" })) end
    function Two:forward(a, b) return a * self.w + b, a * b end
    local m = Two()
    local got = {}
    m:register_full_backward_hook(function(_, gi, go) got[#got + 1] = { gi = gi, go = go } end)
    local a = engine.tensor({ 1, 2 }, "f64")              -- no grad
    local out1 = m(a, engine.tensor({ 3, 4 }, "f64"))
    ;(out1 * 3):sum():backward()
    assert.are.equal(1, #got)
    assert.is_nil(got[1].gi[1])
    assert.are.same({ 3, 3 }, got[1].go[1]:totable())
    local a2, b2 = leaf({ 1, 2 }), leaf({ 3, 4 })
    local p, q = m(a2, b2)
    ;(p * 2 + q * 10):sum():backward()
    assert.are.equal(2, #got)
    assert.are.same({ 2 + 10 * 3, 2 + 10 * 4 }, got[2].gi[1]:totable())   -- d/da: w*2 + b*10
    assert.are.same({ 2 + 10 * 1, 2 + 10 * 2 }, got[2].gi[2]:totable())   -- d/db: 2 + a*10
    assert.are.same({ 2, 2 }, got[2].go[1]:totable())
    assert.are.same({ 10, 10 }, got[2].go[2]:totable())
  end)

  it("nested modules: the inner module's hook runs before the outer one's (reverse forward order)", function()
    engine.manual_seed(3)
    local inner = nn.Linear(2, 2):double()
    local outer = nn.Sequential(inner, nn.ReLU()):double()
    local order = {}
    inner:register_full_backward_hook(function() order[#order + 1] = "inner" end)
    outer:register_full_backward_hook(function() order[#order + 1] = "outer" end)
    outer(leaf({ { 1, 2 } })):sum():backward()
    assert.are.same({ "inner", "outer" }, order)
    assert.matches("expected a function", errmsg(function() inner:register_full_backward_hook(1) end))
  end)
end)
