-- Collectives on CUDA tensors through NCCL (comm/nccl.c), at 1, 2 and 4 ranks: every result equals the same
-- collective on CPU tensors through MPI, and the collective counts are the same on both devices.
-- Tagged "#gpu": pending without a GPU, or with fewer GPUs than ranks unless each rank has its own
-- NCCL_HOSTID (several ranks on one GPU, tools/gpu-check.sh).
--   build/engine /usr/bin/busted --ignore-lua -o tools/passfail.lua --tags=gpu spec/dist/cuda_comm_spec.lua
local engine = require("engine")
local dist = engine.distributed
local util = require("spec.dist.helpers.util")

local R, W = dist.rank(), dist.world_size()

-- exact in every dtype used below: small integers, halves
local function vals(n, r, salt)
  local t = {}
  for i = 1, n do t[i] = ((i * 7 + r * 13 + (salt or 0)) % 17) - 8 + ((i % 2 == 0) and 0.5 or 0) end
  return t
end
local function ints(n, r)
  local t = {}
  for i = 1, n do t[i] = (i * 5 + r * 11) % 23 - 11 end
  return t
end

local function same(cpu, gpu, what)
  local g = gpu:to("cpu")
  assert.are.same(cpu:shape(), g:shape(), what .. ": shape")
  local d = util.diff(cpu, g)
  assert(d == 0, string.format("%s: cuda result differs from the cpu result by %g", what, d))
end

describe("collectives on CUDA tensors #gpu", function()
  it("all_reduce: every op in f32, bf16, f64 and i64 equals MPI on the CPU", function()
    util.need_cuda_ranks(pending)
    for _, dt in ipairs({ "f32", "bf16", "f64", "i64" }) do
      for _, op in ipairs({ "sum", "max", "min", "avg" }) do
        if not (op == "avg" and dt == "i64") then
          local src = dt == "i64" and engine.tensor(ints(37, R), "i64") or engine.tensor(vals(37, R), dt)
          local c, g = src:clone(), src:cuda()
          dist.all_reduce(c, op)
          dist.all_reduce(g, op)
          assert.are.equal("cuda", g.device)
          same(c, g, "all_reduce " .. op .. " " .. dt)
        end
      end
    end
  end)

  it("all_gather, reduce_scatter, all_to_all and broadcast equal MPI on the CPU", function()
    util.need_cuda_ranks(pending)
    local x = engine.tensor(vals(W * 6, R, 3), "f32"):view({ W * 3, 2 })
    local xg = x:cuda()
    same(dist.all_gather(x), dist.all_gather(xg), "all_gather")
    same(dist.reduce_scatter(x, "sum"), dist.reduce_scatter(xg, "sum"), "reduce_scatter sum")
    same(dist.reduce_scatter(x, "max"), dist.reduce_scatter(xg, "max"), "reduce_scatter max")
    same(dist.all_to_all(x), dist.all_to_all(xg), "all_to_all")
    local out_c, out_g = engine.zeros(W * W * 3, 2), engine.zeros(W * W * 3, 2, { device = "cuda" })
    dist.all_gather_into(out_c, x)
    dist.all_gather_into(out_g, xg)
    same(out_c, out_g, "all_gather_into")
    local b_c, b_g = x:clone(), x:cuda()
    dist.broadcast(b_c, W - 1)
    dist.broadcast(b_g, W - 1)
    same(b_c, b_g, "broadcast from the last rank")
  end)

  it("async collectives: wait() orders the result before later kernels; several in flight", function()
    util.need_cuda_ranks(pending)
    local xs, ws = {}, {}
    for i = 1, 4 do
      xs[i] = engine.tensor(vals(1000, R, i), "f32"):cuda()
      ws[i] = dist.all_reduce(xs[i], "sum", { async_op = true })
    end
    for i = 4, 1, -1 do
      ws[i]:wait()
      local c = engine.tensor(vals(1000, R, i), "f32")
      dist.all_reduce(c, "sum")
      same(c * 2, xs[i] * 2, "async all_reduce " .. i .. " then a kernel")
    end
  end)

  it("subgroups: an all_reduce on the even ranks and one on a 1-rank group", function()
    util.need_cuda_ranks(pending)
    local evens = {}
    for r = 0, W - 1, 2 do evens[#evens + 1] = r end
    local pg = dist.new_group(evens)
    local self_pg = dist.new_group({ 0 }) -- collective: every rank names the same members
    local x = engine.tensor(vals(64, R), "f32")
    local xc, xg = x:clone(), x:cuda()
    dist.all_reduce(xc, "sum", { group = pg })
    dist.all_reduce(xg, "sum", { group = pg })
    same(xc, xg, "all_reduce on the even ranks")
    local yg = x:cuda()
    dist.all_reduce(yg, "sum", { group = self_pg }) -- a no-op off the group, as in PyTorch
    same(x, yg, "all_reduce on a group of one")
  end)

  it("counts: the same collectives are counted on CUDA as on the CPU", function()
    util.need_cuda_ranks(pending)
    local function body(dev)
      return function()
        local x = engine.tensor(vals(W * 4, R), "f32")
        if dev == "cuda" then x = x:cuda() end
        dist.all_reduce(x, "sum")
        dist.all_gather(x)
        dist.reduce_scatter(x, "sum")
        dist.broadcast(x, 0)
      end
    end
    local cc = util.counted(body("cpu"))
    local cg = util.counted(body("cuda"))
    assert.are.equal(cc, cg)
  end)

  it("strided CUDA views: NCCL works on contiguous stand-ins and writes the results back into the views", function()
    util.need_cuda_ranks(pending)
    local base = engine.tensor(vals(24, R), "f32"):view({ 4, 6 })
    local c, g = base:t(), base:cuda():t()  -- [6, 4] views with strides {1, 6}
    dist.all_reduce(c, "sum")
    dist.all_reduce(g, "sum")
    same(c, g, "all_reduce of a transposed view")
    local xc = engine.tensor(vals(W * 12, R, 5), "f32"):view({ 6, 2 * W }):t()
    local xg = engine.tensor(vals(W * 12, R, 5), "f32"):view({ 6, 2 * W }):cuda():t()
    same(dist.all_gather(xc), dist.all_gather(xg), "all_gather of a transposed view")
    same(dist.reduce_scatter(xc, "sum"), dist.reduce_scatter(xg, "sum"), "reduce_scatter of a transposed view")
    local oc = engine.zeros(6, 2 * W * W):t()
    local og = engine.zeros(6, 2 * W * W, { device = "cuda" }):t()
    dist.all_gather_into(oc, xc)
    dist.all_gather_into(og, xg)
    same(oc, og, "all_gather_into a transposed output")
  end)
end)
