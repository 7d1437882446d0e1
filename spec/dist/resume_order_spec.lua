-- Resume in PyTorch's order: a distributed checkpoint loaded into the optimizer's state
-- dict in place restores everything the state dict holds, the step counts included (0-dim f32 CPU tensors,
-- as PyTorch keeps state["step"]; they were Lua numbers outside the table, left stale by an in-place load).
-- Adapted from PyTorch's DCP flows (torch.distributed.checkpoint's e2e save/load tests and its tutorial):
--   state = {model = model:state_dict(), optim = get_optimizer_state_dict(model, opt)}   (or opt:state_dict())
--   dcp.load(state, dir); model:load_state_dict(state.model); opt:load_state_dict(state.optim)
-- Train N steps, save, train on (the uninterrupted run); a fresh run and a run that already stepped (other
-- data, another lr) load in that order and give the same losses and parameters as the uninterrupted run, bit
-- for bit on the CPU, with plain and FSDP models, at 1, 2 and 4 ranks; also dcp.load alone (the moments and
-- steps come back in place, as in PyTorch), get_state_dict / set_state_dict, and a checkpoint whose steps
-- were saved as numbers (before they were tensors).
local engine = require("engine")
local nn, optim = engine.nn, engine.optim
local F = nn.functional
local dist = engine.distributed
local dcp = dist.checkpoint
local util = require("spec.dist.helpers.util")
local W, R = dist.world_size(), dist.rank()

local root, newdir = require("spec.dist.helpers.util").dirs("resume_order_spec")

local mesh = dist.init_device_mesh("cpu", { W })
local N, M, B, D = 3, 3, 2 * W, 8   -- steps before the save, after it; global batch rows; width

local function build(kind, seed, lr)
  engine.manual_seed(seed)
  local m = nn.Sequential(nn.Linear(D, 16), nn.Tanh(), nn.Linear(16, 4))
  if kind == "fsdp" then
    dist.fully_shard(m[1], { mesh = mesh }); dist.fully_shard(m[3], { mesh = mesh }); dist.fully_shard(m, { mesh = mesh })
  end
  return m, optim.AdamW(m:parameters(), { lr = lr or 1e-2, weight_decay = 0.1 })
end

-- one step on batch i: a plain model takes the global batch on every rank, FSDP this rank's rows of it;
-- returns this rank's loss
local function step(kind, m, opt, i)
  engine.manual_seed(1000 + i)
  local x, y = engine.randn(B, D), engine.randn(B, 4)
  if kind == "fsdp" then
    local b = B / W
    x, y = x:narrow(1, R * b + 1, b), y:narrow(1, R * b + 1, b)
  end
  local l = F.mse_loss(m(x), y)
  l:backward()
  opt:step()
  opt:zero_grad()
  return l:item()
end

local function full(t) return dist.is_dtensor(t) and t:full_tensor() or t end

local function params_of(m)
  local out = {}
  for name, p in m:named_parameters() do out[name] = full(p):clone() end
  return out
end

-- the uninterrupted run: N steps, save (form "names": get_optimizer_state_dict; "index": opt:state_dict()),
-- M more steps; its losses after the save and its final parameters
local function reference(kind, form, dir)
  local m, opt = build(kind, 1)
  for i = 1, N do step(kind, m, opt, i) end
  local osd = form == "index" and opt:state_dict() or dcp.get_optimizer_state_dict(m, opt)
  dcp.save({ model = m:state_dict(), optim = osd }, dir)
  local losses = {}
  for i = N + 1, N + M do losses[#losses + 1] = step(kind, m, opt, i) end
  return losses, params_of(m)
end

-- a run that loads dir by `load(m, opt)` after `pre` steps of other batches with lr 0.5 (0: a fresh run)
local function resumed(kind, pre, load)
  local m, opt = build(kind, 7, pre > 0 and 0.5 or 1e-2)
  for i = 1, pre do step(kind, m, opt, 500 + i) end
  load(m, opt)
  local losses = {}
  for i = N + 1, N + M do losses[#losses + 1] = step(kind, m, opt, i) end
  return losses, params_of(m), opt
end

local function same(label, want_l, want_p, got_l, got_p)
  for i = 1, M do
    assert(got_l[i] == want_l[i], string.format("%s: loss %d after the resume %.17g, uninterrupted %.17g", label, i,
      got_l[i], want_l[i]))
  end
  for name, p in pairs(want_p) do
    local d = util.diff(got_p[name], p)
    assert(d == 0, string.format("%s: parameter %s differs by %g", label, name, d))
  end
end

describe("resume in PyTorch's order (" .. W .. " ranks)", function()
  teardown(function()
    dist.barrier()
    if R == 0 then os.execute("rm -rf '" .. root .. "'") end
  end)

  for _, kind in ipairs({ "plain", "fsdp" }) do
    it(kind .. ": dcp.load, model:load_state_dict, opt:load_state_dict give the uninterrupted run, fresh or stepped",
      function()
        local dir = newdir()
        local want_l, want_p = reference(kind, "names", dir)
        for _, pre in ipairs({ 0, 2 }) do
          local got_l, got_p, opt = resumed(kind, pre, function(m, opt)
            local state = { model = m:state_dict(), optim = dcp.get_optimizer_state_dict(m, opt) }
            dcp.load(state, dir)
            m:load_state_dict(state.model)
            opt:load_state_dict(state.optim)
          end)
          same(string.format("%s, %d steps before the load", kind, pre), want_l, want_p, got_l, got_p)
          assert.are.equal(1e-2, opt.param_groups[1].lr)
          local st = opt.state[opt.param_groups[1].params[1]].step
          assert.are.same({ 0, "f32", "cpu", N + M }, { st:dim(), st.dtype, st.device, st:item() })
        end
      end)

    it(kind .. ": dcp.load alone restores the moments and the step counts in place (PyTorch's in-place load)",
      function()
        local dir = newdir()
        local want_l, want_p = reference(kind, "names", dir)
        for _, pre in ipairs({ 0, 2 }) do
          local got_l, got_p, opt = resumed(kind, pre, function(m, opt)
            if pre > 0 then for _, g in ipairs(opt.param_groups) do g.lr = 1e-2 end end -- hyperparameters are copies
            local state = { model = m:state_dict(), optim = dcp.get_optimizer_state_dict(m, opt) }
            dcp.load(state, dir)
            -- the table held the live step tensors: the optimizer sees the loaded counts
            for _, p in ipairs(opt.param_groups[1].params) do assert.are.equal(N, opt.state[p].step:item()) end
          end)
          same(string.format("%s, load only, %d steps before", kind, pre), want_l, want_p, got_l, got_p)
          assert.are.equal(N + M, opt.state[opt.param_groups[1].params[2]].step:item())
        end
      end)

    it(kind .. ": get_state_dict, dcp.load, set_state_dict (the DCP tutorial's flow) give the uninterrupted run",
      function()
        local dir = newdir()
        local want_l, want_p = reference(kind, "names", dir)
        for _, pre in ipairs({ 0, 2 }) do
          local got_l, got_p = resumed(kind, pre, function(m, opt)
            local msd, osd = dist.get_state_dict(m, opt)
            local state = { model = msd, optim = osd }
            dcp.load(state, dir)
            dist.set_state_dict(m, opt, { model_state_dict = state.model, optim_state_dict = state.optim })
          end)
          same(string.format("%s, get/set_state_dict, %d steps before", kind, pre), want_l, want_p, got_l, got_p)
        end
      end)
  end

  it("plain: opt:state_dict() (parameters numbered) of a stepped optimizer, loaded in place, resumes exactly", function()
    local dir = newdir()
    local want_l, want_p = reference("plain", "index", dir)
    local got_l, got_p = resumed("plain", 2, function(m, opt)
      local state = { model = m:state_dict(), optim = opt:state_dict() }
      dcp.load(state, dir)
      m:load_state_dict(state.model)
      opt:load_state_dict(state.optim)
    end)
    same("plain, opt:state_dict()", want_l, want_p, got_l, got_p)
  end)

  it("a checkpoint whose step counts were saved as numbers (before they were tensors) loads into the tensors", function()
    for _, kind in ipairs({ "plain", "fsdp" }) do
      local dir = newdir()
      local m, opt = build(kind, 1)
      for i = 1, N do step(kind, m, opt, i) end
      local osd = dcp.get_optimizer_state_dict(m, opt)
      for _, s in pairs(osd.state) do s.step = s.step:item() end -- the old form: a value in the metadata
      dcp.save({ model = m:state_dict(), optim = osd }, dir)
      assert.is_not_nil(dcp.read_metadata(dir).values["optim.state.0.weight.step"])
      local want_l = {}
      for i = N + 1, N + M do want_l[#want_l + 1] = step(kind, m, opt, i) end
      local want_p = params_of(m)
      local got_l, got_p = resumed(kind, 2, function(m2, opt2)
        local state = { model = m2:state_dict(), optim = dcp.get_optimizer_state_dict(m2, opt2) }
        dcp.load(state, dir)
        m2:load_state_dict(state.model)
        opt2:load_state_dict(state.optim)
      end)
      same(kind .. ", steps saved as numbers", want_l, want_p, got_l, got_p)
    end
  end)
end)
