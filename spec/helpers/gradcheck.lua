-- Finite-difference gradient checks in float64.
--   local gc = require("spec.helpers.gradcheck")
--   gc.check(function(x, w) return x:matmul(w) end, {x, w}, {eps = 1e-6, tol = 1e-6})
-- Inputs must be f64 tensors; those with requires_grad are checked.  The
-- function's output o is reduced to L = sum(o * r) with a fixed random r, the
-- analytic gradient comes from o:backward(r), the numeric one from central
-- differences of L.  Returns true or raises an error naming the input, the
-- element and both values.
package.path = "./?.lua;" .. package.path
local engine = require("engine")

local M = {}

local function flat(t)
  local v = t:tolist_flat()
  return v
end

local function dot(a, b)
  local s = 0
  for i = 1, #a do s = s + a[i] * b[i] end
  return s
end

-- Deterministic pseudo-random weights in [-1, 1) (no engine RNG involved).
local function weights(n, seed)
  local w, x = {}, seed or 12345
  for i = 1, n do
    x = (x * 1103515245 + 12345) % 2147483648
    w[i] = (x / 2147483648) * 2 - 1
  end
  return w
end

function M.check(fn, inputs, opts)
  opts = opts or {}
  local eps, tol = opts.eps or 1e-6, opts.tol or 1e-5
  local out = fn(unpack(inputs))
  local outs = engine.is_tensor(out) and { out } or out
  local ws, wts = {}, {}
  for k, o in ipairs(outs) do
    ws[k] = weights(o:numel(), 1000 + k)
    wts[k] = engine.tensor(ws[k], "f64"):view(o:numel() > 0 and o:shape() or { 0 })
    if o:dim() == 0 then wts[k] = engine.tensor(ws[k][1], "f64") end
  end
  for _, x in ipairs(inputs) do if engine.is_tensor(x) and x.requires_grad then x.grad = nil end end
  local anys = {}
  for k, o in ipairs(outs) do if o.requires_grad then anys[#anys + 1] = k end end
  assert(#anys > 0, "gradcheck: no output requires grad")
  local ts, gs = {}, {}
  for _, k in ipairs(anys) do ts[#ts + 1] = outs[k]; gs[#gs + 1] = wts[k] end
  engine.autograd.backward(ts, gs)
  local function loss()
    local r = engine.no_grad(fn, unpack(inputs))
    local rs = engine.is_tensor(r) and { r } or r
    local s = 0
    for k, o in ipairs(rs) do s = s + dot(flat(o:double()), ws[k]) end
    return s
  end
  for idx, x in ipairs(inputs) do
    if engine.is_tensor(x) and x.requires_grad then
      assert(x.dtype == "f64", "gradcheck: input " .. idx .. " must be f64")
      local g = x.grad
      local gflat = g and flat(g) or nil
      local shape = x:shape()
      local n = x:numel()
      local strides, s = {}, 1
      for d = #shape, 1, -1 do strides[d] = s; s = s * shape[d] end
      for e = 1, n do
        local index, rem = {}, e - 1
        for d = 1, #shape do index[d] = math.floor(rem / strides[d]) + 1; rem = rem % strides[d] end
        local orig = x:get(unpack(index))
        engine.no_grad(function() x:set(orig + eps, unpack(index)) end)
        local lp = loss()
        engine.no_grad(function() x:set(orig - eps, unpack(index)) end)
        local lm = loss()
        engine.no_grad(function() x:set(orig, unpack(index)) end)
        local num = (lp - lm) / (2 * eps)
        local ana = gflat and gflat[e] or 0
        local err = math.abs(num - ana) / math.max(1, math.abs(num))
        if err > tol then
          error(string.format("gradcheck: input %d element %d {%s}: analytic %.10g vs numeric %.10g (err %.3g)",
            idx, e, table.concat(index, ","), ana, num, err), 2)
        end
      end
    end
  end
  return true
end

return M
