-- redistribute's forward_dtype / backward_dtype (pytorch-semantics 1.3, D10):
-- the local shard is cast before the communication (the collective carries
-- that dtype: checked with the byte counters), the gradient is cast to
-- backward_dtype (default: the input's dtype) before the backward
-- communication, and the input's gradient comes back in its own dtype.
local engine = require("engine")
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local diff, errmsg = util.diff, util.errmsg

local R, W = dist.rank(), dist.world_size()
local S, Rep = dist.Shard, dist.Replicate

-- collectives and bytes issued by fn
local function traffic(fn)
  dist.reset_comm_counts()
  local r = fn()
  return dist.comm_counts(), dist.comm_bytes(), r
end

local mesh = dist.init_device_mesh("cpu", { W })
local SHAPE = { 4 * W, 6 }  -- even: every shard [4, 6]
local LOCAL_NUMEL = 24

local function input(pl)
  engine.manual_seed(5)
  local full = engine.randn(SHAPE)
  local d = dist.distribute_tensor(full:clone(), mesh, pl, { src_data_rank = false })
  d.requires_grad = true
  return d, full
end

local dtypes = { "bf16", "f32", false }

describe("redistribute forward_dtype / backward_dtype", function()
  for _, fwd in ipairs(dtypes) do
    for _, bwd in ipairs(dtypes) do
      local name = string.format("forward_dtype %s, backward_dtype %s", tostring(fwd or "nil"), tostring(bwd or "nil"))
      it("Shard -> Replicate, " .. name, function()
        local d, full = input({ S(1) })
        local opts = { forward_dtype = fwd or nil, backward_dtype = bwd or nil }
        local c, bytes, out = traffic(function() return d:redistribute(mesh, { Rep() }, opts) end)
        assert.are.equal(fwd or "f32", out.dtype)
        assert.are.equal(0, diff(out:to_local(), full:to(fwd or "f32")))
        if W > 1 then
          assert.are.same({ all_gather = 1 }, c)
          assert.are.equal(LOCAL_NUMEL * (fwd == "bf16" and 2 or 4), bytes.all_gather)
        end
        -- backward of S -> R: no communication, grad in the input's dtype
        local bc = dist.count_collectives(function() out:to_local():sum():backward() end)
        assert.are.same({}, bc)
        assert.are.equal("f32", d.grad.dtype)
        assert.is_true(dist.is_dtensor(d.grad))
        assert.are.equal(0, diff(d.grad:full_tensor(), engine.ones(SHAPE)))
      end)

      it("Replicate -> Shard (backward all_gather), " .. name, function()
        local d, full = input({ Rep() })
        local out = d:redistribute({ S(1) }, { forward_dtype = fwd or nil, backward_dtype = bwd or nil })
        assert.are.equal(fwd or "f32", out.dtype)
        local size, off = dist.local_shard_size_and_offset(SHAPE[1], W, R)
        assert.are.equal(0, diff(out:to_local(), full:narrow(1, off + 1, size):to(fwd or "f32")))
        engine.manual_seed(9)
        local g = engine.randn({ size, 6 }):to(fwd or "f32")
        local c, bytes = traffic(function() (out:to_local() * g):sum():backward() end)
        if W > 1 then
          assert.are.same({ all_gather = 1 }, c)
          assert.are.equal(LOCAL_NUMEL * (bwd == "bf16" and 2 or 4), bytes.all_gather)
        end
        assert.are.equal("f32", d.grad.dtype)
        -- the gradient went through backward_dtype (default f32) before the all_gather
        local gathered = dist.DTensor.from_local(g:to(bwd or "f32"):float(), mesh, { S(1) }):full_tensor()
        assert.are.equal(0, diff(d.grad:to_local(), gathered))
      end)
    end
  end

  -- D10, Replicate -> Replicate: a cast only; no collective forward or backward.
  for _, fwd in ipairs(dtypes) do
    for _, bwd in ipairs(dtypes) do
      local name = string.format("forward_dtype %s, backward_dtype %s", tostring(fwd or "nil"), tostring(bwd or "nil"))
      it("Replicate -> Replicate (no communication forward or backward), " .. name, function()
        local d, full = input({ Rep() })
        local opts = { forward_dtype = fwd or nil, backward_dtype = bwd or nil }
        local fc, out = dist.count_collectives(function() return d:redistribute({ Rep() }, opts) end)
        local bc = dist.count_collectives(function() out:to_local():sum():backward() end)
        assert.are.same({}, fc)
        assert.are.same({}, bc)
        assert.is_true(dist.is_dtensor(out))
        assert.are.same({ Rep() }, out.placements)
        assert.are.equal(fwd or "f32", out.dtype)
        assert.are.same(SHAPE, out:shape())
        assert.are.equal(0, diff(out:to_local(), full:to(fwd or "f32")))
        assert.is_true(dist.is_dtensor(d.grad))
        assert.are.same({ Rep() }, d.grad.placements)
        assert.are.equal("f32", d.grad.dtype)
        assert.are.equal(0, diff(d.grad:to_local(), engine.ones(SHAPE)))
      end)
    end
  end

  it("Replicate -> Replicate with forward_dtype casts without communication", function()
    local d, full = input({ Rep() })
    local c, _, out = traffic(function() return d:redistribute({ Rep() }, { forward_dtype = "bf16" }) end)
    assert.are.same({}, c)
    assert.are.equal("bf16", out.dtype)
    assert.are.equal(0, diff(out:to_local(), full:to("bf16")))
    out:to_local():float():sum():backward()
    assert.are.equal("f32", d.grad.dtype)
    assert.are.equal(0, diff(d.grad:to_local(), engine.ones(SHAPE)))
  end)

  it("bf16 values equal the f32 redistribute up to bf16 rounding", function()
    local d = input({ S(2) })
    local a = d:redistribute({ Rep() }, { forward_dtype = "bf16" }):to_local():float()
    local b = d:redistribute({ Rep() }):to_local()
    local rel = ((a - b):abs() / (b:abs() + 1e-30)):max():item()
    assert.is_true(rel <= 2 ^ -8, "relative error " .. rel)
  end)

  -- the group's backward reduce dtype (FSDP's reduce_dtype over tensor parallelism): a bf16 Partial gradient's
  -- all_reduce carries f32 and the sum is rounded to bf16 once
  it("set_backward_reduce_dtype: a bf16 gradient's backward all_reduce runs in f32 (rounded once)", function()
    engine.manual_seed(21)
    local xf, wf = engine.randn(16, 8):to("bf16"), engine.randn(8, 2 * W):to("bf16")
    local w = dist.distribute_tensor(wf, mesh, { S(2) }, { src_data_rank = false })
    engine.manual_seed(100 + R)
    local go = engine.randn(16, 2):to("bf16")
    -- this rank's partial gradient, computed the plain way
    local xl = xf:clone(); xl.requires_grad = true
    local prod = xl:mm(w:to_local()) * go
    prod:sum():backward()
    local parts = dist.all_gather(xl.grad:float())  -- [W*16, 8], rank order
    local want = parts:narrow(1, 1, 16):clone()
    for i = 2, W do want = want + parts:narrow(1, 16 * i - 15, 16) end
    want = want:to("bf16")
    for _, rdt in ipairs({ "f32", false }) do
      dist.set_backward_reduce_dtype(mesh, rdt or nil)
      assert.are.equal(rdt or nil, dist.get_backward_reduce_dtype(mesh))
      local x = dist.distribute_tensor(xf:clone(), mesh, { Rep() }, { src_data_rank = false })
      x.requires_grad = true
      local out = x:mm(w)
      local c, bytes = traffic(function() (out:to_local() * go):sum():backward() end)
      assert.are.equal("bf16", x.grad.dtype)
      if W > 1 then
        assert.are.same({ all_reduce = 1 }, c)
        assert.are.equal(128 * (rdt and 4 or 2), bytes.all_reduce)
      end
      if rdt then assert.are.equal(0, diff(x.grad:to_local(), want)) end
    end
    -- an explicit backward_dtype keeps its own
    dist.set_backward_reduce_dtype(mesh, "f32")
    local x = dist.distribute_tensor(xf:clone():float(), mesh, { Rep() }, { src_data_rank = false })
    x.requires_grad = true
    local out = x:redistribute({ Rep() }, { forward_dtype = "bf16", backward_dtype = "bf16" }):mm(w)
    local c, bytes = traffic(function() (out:to_local() * go):sum():backward() end)
    if W > 1 then
      assert.are.same({ all_reduce = 1 }, c)
      assert.are.equal(128 * 2, bytes.all_reduce)
    end
    dist.set_backward_reduce_dtype(mesh, nil)
    assert.is_nil(dist.get_backward_reduce_dtype(mesh))
    assert.is_truthy(errmsg(dist.set_backward_reduce_dtype, mesh, "i32"):find("i32 is not a floating dtype", 1, true))
  end)

  it("rejects a non-floating dtype", function()
    local d = input({ S(1) })
    local e = errmsg(function() d:redistribute({ Rep() }, { forward_dtype = "i32" }) end)
    assert.is_truthy(e:find("forward_dtype i32 is invalid", 1, true), e)
    e = errmsg(function() d:redistribute({ Rep() }, { backward_dtype = "i64" }) end)
    assert.is_truthy(e:find("backward_dtype i64 is invalid", 1, true), e)
  end)
end)
