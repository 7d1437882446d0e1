-- PyTorch's matmul family (engine.ops.linalg): mm, bmm, addmm, baddbmm,
-- outer, einsum on the GEMM path; values against matmul/explicit sums, float64 finite
-- differences, f32/bf16, errors naming the shapes or the equation.
package.path = "./?.lua;" .. package.path
local engine = require("engine")
local gc = require("spec.helpers.gradcheck")

local function md(a, b) return (a:double() - b:double()):abs():max():item() end
local function err(f, pat)
  local ok, e = pcall(f)
  assert.is_false(ok, "expected an error matching " .. pat)
  assert.is_truthy(tostring(e):find(pat, 1, true), tostring(e))
end

-- einsum by explicit loops (the reference): ops in a list, equation with "->"
local function einsum_ref(eq, a, b)
  local lhs, out = eq:match("^(.-)%->(.*)$")
  local ins = {}
  for p in (lhs .. ","):gmatch("([^,]*),") do ins[#ins + 1] = p end
  local ops = { a, b }
  local size, letters = {}, {}
  for i, s in ipairs(ins) do
    for d = 1, #s do
      local ch = s:sub(d, d)
      if not size[ch] then letters[#letters + 1] = ch end
      size[ch] = ops[i]:size(d)
    end
  end
  local oshape = {}
  for d = 1, #out do oshape[d] = size[out:sub(d, d)] end
  local res = engine.zeros(#oshape > 0 and oshape or {}, { dtype = "f64" })
  local val = {}
  local function idx(s)
    local r = {}
    for d = 1, #s do r[d] = val[s:sub(d, d)] + 1 end
    return r
  end
  local function rec(k)
    if k > #letters then
      local p = 1
      for i, s in ipairs(ins) do p = p * ops[i]:get(unpack(idx(s))) end
      if #out == 0 then res:fill_(res:item() + p) else res:set(res:get(unpack(idx(out))) + p, unpack(idx(out))) end
      return
    end
    local ch = letters[k]
    for v = 0, size[ch] - 1 do val[ch] = v; rec(k + 1) end
  end
  rec(1)
  return res
end

describe("mm / bmm / addmm / baddbmm / outer", function()
  engine.manual_seed(1)
  local a, b = engine.randn(3, 4, { dtype = "f64" }), engine.randn(4, 5, { dtype = "f64" })
  local A, B = engine.randn(2, 3, 4, { dtype = "f64" }), engine.randn(2, 4, 5, { dtype = "f64" })
  it("values equal matmul (f64, f32, bf16)", function()
    for _, dt in ipairs({ "f64", "f32", "bf16" }) do
      local tol = dt == "bf16" and 0.1 or 1e-5
      assert.is_true(md(engine.mm(a:to(dt), b:to(dt)), a:matmul(b)) < tol)
      assert.is_true(md(engine.bmm(A:to(dt), B:to(dt)), A:matmul(B)) < tol)
      assert.are.equal(dt, engine.mm(a:to(dt), b:to(dt)).dtype)
    end
    local bias = engine.randn(5, { dtype = "f64" })
    assert.is_true(md(engine.addmm(bias, a, b), a:matmul(b) + bias) < 1e-12)
    assert.is_true(md(bias:addmm(a, b, { beta = 0.5, alpha = -2 }), a:matmul(b) * -2 + bias * 0.5) < 1e-12)
    assert.is_true(md(engine.addmm(engine.full({ 3, 5 }, 0 / 0, { dtype = "f64" }), a, b, { beta = 0 }), a:matmul(b)) == 0)
    local bb = engine.randn(2, 3, 5, { dtype = "f64" })
    assert.is_true(md(engine.baddbmm(bb, A, B, { alpha = 3 }), A:matmul(B) * 3 + bb) < 1e-12)
    local u, v = engine.randn(3, { dtype = "f64" }), engine.randn(4, { dtype = "f64" })
    local o = engine.outer(u, v)
    assert.are.same({ 3, 4 }, o:shape())
    assert.is_true(math.abs(o:get(2, 3) - u:get(2) * v:get(3)) < 1e-15)
    assert.are.equal(engine.ger, engine.outer)
  end)
  it("gradients (float64 finite differences)", function()
    local p, q = a:clone(), b:clone(); p.requires_grad = true; q.requires_grad = true
    local bias = engine.randn(3, 5, { dtype = "f64" }); bias.requires_grad = true
    assert.is_true(gc.check(function(x, y) return engine.mm(x, y) end, { p, q }))
    assert.is_true(gc.check(function(c, x, y) return engine.addmm(c, x, y, { beta = 0.3, alpha = 1.7 }) end, { bias, p, q }))
    local P, Q = A:clone(), B:clone(); P.requires_grad = true; Q.requires_grad = true
    local bb = engine.randn(3, 5, { dtype = "f64" }); bb.requires_grad = true
    assert.is_true(gc.check(function(c, x, y) return engine.baddbmm(c, x, y, { beta = 2 }) end, { bb, P, Q }))
    local u, v = engine.randn(3, { dtype = "f64" }), engine.randn(4, { dtype = "f64" })
    u.requires_grad = true; v.requires_grad = true
    assert.is_true(gc.check(engine.outer, { u, v }))
  end)
  it("errors name the op and the shapes", function()
    err(function() engine.mm(a, a) end, "mm: f64[3,4] x f64[3,4]: inner dims 4 and 3 differ")
    err(function() engine.mm(A, b) end, "mm: expects two 2-D tensors, got f64[2,3,4] and f64[4,5]")
    err(function() engine.bmm(A, engine.randn(3, 4, 5)) end, "bmm: f64[2,3,4] x f32[3,4,5]: batch sizes 2 and 3 differ")
    err(function() engine.bmm(A, A) end, "bmm: f64[2,3,4] x f64[2,3,4]: inner dims 4 and 3 differ")
    err(function() engine.outer(a, b) end, "outer: expects two 1-D tensors")
    err(function() engine.addmm(engine.zeros(3, 5), a, b, { gamma = 1 }) end, "addmm: unknown option 'gamma'")
  end)
end)

describe("einsum", function()
  engine.manual_seed(2)
  local R = function(...) return engine.randn({ ... }, { dtype = "f64" }) end
  local cases = {
    { "bld,hd->blh", R(2, 3, 4), R(5, 4) },
    { "bhqd,bhkd->bhqk", R(2, 2, 3, 4), R(2, 2, 5, 4) },
    { "bhqk,bhkd->bhqd", R(2, 2, 3, 5), R(2, 2, 5, 4) },
    { "ij,jk->ik", R(3, 4), R(4, 2) },
    { "ij->ji", R(3, 4) },
    { "ij->", R(3, 4) },
    { "ijk->ki", R(2, 3, 4) },
    { "i,j->ij", R(3), R(4) },
    { "i,i->", R(5), R(5) },
    { "ij,j->i", R(3, 4), R(4) },
    { "aij,ijb->ab", R(2, 3, 4), R(3, 4, 2) },
    { "abk,kcd->dcba", R(2, 3, 4), R(4, 2, 3) },
    { "bij,bjk->bik", R(2, 3, 4), R(2, 4, 2) },
    { "ij,kl->ijkl", R(2, 3), R(2, 2) },
    { "ibj,jk->bk", R(3, 2, 4), R(4, 2) },
  }
  for _, c in ipairs(cases) do
    it(c[1] .. " equals explicit sums and has finite-difference gradients", function()
      local r = engine.einsum(c[1], c[2], c[3])
      local ref = einsum_ref(c[1], c[2], c[3])
      assert.are.same(ref:shape(), r:shape())
      assert.is_true(md(r, ref) < 1e-12)
      local ins = {}
      for i = 2, #c do local t = c[i]:clone(); t.requires_grad = true; ins[#ins + 1] = t end
      assert.is_true(gc.check(function(x, y) return engine.einsum(c[1], x, y) end, ins))
    end)
  end
  it("implicit output (letters seen once, alphabetical) and f32/bf16", function()
    local a, b = R(3, 4), R(4, 2)
    assert.is_true(md(engine.einsum("ij,jk", a, b), a:matmul(b)) < 1e-12)
    assert.is_true(md(engine.einsum("ba", a), a:t()) < 1e-12)
    local r = engine.einsum("ij,jk->ik", a:bfloat16(), b:bfloat16())
    assert.are.equal("bf16", r.dtype)
    assert.is_true(md(r, a:matmul(b)) < 0.1)
  end)
  it("unsupported equations are errors naming the equation", function()
    local a = R(3, 3)
    err(function() engine.einsum("ii->i", a) end, "einsum: 'ii->i': subscript 'i' repeated in one operand")
    err(function() engine.einsum("...ij->ij", a) end, "einsum: '...ij->ij': ellipsis (...) is not supported")
    err(function() engine.einsum("ij,jk,kl->il", a, a, a) end, "einsum: 'ij,jk,kl->il': at most two operands are supported")
    err(function() engine.einsum("ijk->i", a) end, "einsum: 'ijk->i': operand 1 has 2 dims but its subscripts 'ijk' name 3")
    err(function() engine.einsum("ij,jk->ik", a, R(2, 2)) end, "einsum: 'ij,jk->ik': subscript 'j' has size 3 in one operand and 2 in another")
    err(function() engine.einsum("ij->iz", a) end, "einsum: 'ij->iz': output subscript 'z' appears in no operand")
    err(function() engine.einsum("ij,jk->ik", a) end, "einsum: 'ij,jk->ik': 2 operands in the equation, 1 given")
  end)
end)
