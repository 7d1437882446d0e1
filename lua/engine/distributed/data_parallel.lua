-- engine.distributed.data_parallel: data parallelism with DTensors.
--
--   dist.replicate_parameters(model, mesh)     -- every parameter -> Replicate DTensor (tied ones stay tied)
--   local x = dist.distribute_tensor(tokens, mesh, {dist.Shard(1)})   -- the batch dim sharded
--   local logits = dist.implicit_replication(function() return model(x) end)
--   local loss = F.cross_entropy(logits, dist.distribute_tensor(targets, mesh, {dist.Shard(1)}))
--   loss:backward()      -- Partial(sum) parameter gradients are all-reduced into the Replicate .grad
--   print(loss:full_tensor():item())
--
-- The loss of a batch-sharded cross_entropy (mean) is Partial(sum) of local sum /
-- GLOBAL count of targets, so it equals the single-process loss of the whole batch,
-- and so do the gradients (AccumulateGrad redistributes them to the parameter's
-- Replicate spec: one all_reduce per parameter).  Unlike distribute_module (which,
-- as PyTorch's, replaces each submodule's parameters separately), tied parameters
-- (one tensor under several names, e.g. the reference Transformer's output.weight and
-- tok_embeddings.weight) become ONE DTensor, so the model keeps its weight tying.
local core = require("engine.core")
local ffi, C = core.ffi, core.C
local meshmod = require("engine.distributed.mesh")
local dtensor = require("engine.distributed.dtensor")
local P = require("engine.distributed.placements")

local M = {}

function M.replicate_parameters(module, mesh)
  local op = "replicate_parameters"
  local nn = require("engine.nn")
  if not nn.is_module(module) then core.fail(op .. ": expected an nn.Module, got " .. type(module)) end
  if not meshmod.is_mesh(mesh) then
    core.fail(op .. ": mesh must be a DeviceMesh (dist.init_device_mesh), got " .. type(mesh))
  end
  local full = {}
  for i = 1, mesh:ndim() do full[i] = P.Replicate() end
  local memo = {}
  for _, sub in module:named_modules() do
    local params = rawget(sub, "_parameters")
    for _, name in ipairs(rawget(sub, "_param_names")) do
      local p = params[name]
      if p ~= nil and p._c.dist == nil then
        local key = tostring(ffi.cast("void*", p._c))
        local d = memo[key]
        if d == nil then
          d = dtensor.distribute_tensor(p:detach(), mesh, full)
          d._c.is_param = 1
          if p._c.requires_grad ~= 0 then core.check(C.eng_tensor_set_requires_grad(d._c, 1), 3) end
          memo[key] = d
        end
        params[name] = d
      end
    end
  end
  return module
end

-- all_reduce_gradients(model, group_or_mesh [, {op = "avg"}]): data parallelism over a mesh dim the
-- parameters are not laid out on (e.g. "dp" of a 2-D mesh whose "tp" dim holds tensor-parallel
-- DTensors): every parameter's local gradient is reduced over the group in place (one all_reduce
-- per gradient, in named_parameters order; parameters without a gradient are skipped the same way
-- on every rank when every rank ran the same model).  A DeviceMesh must be 1-D (mesh["dp"]).
function M.all_reduce_gradients(module, group, opts)
  local op = "all_reduce_gradients"
  local nn = require("engine.nn")
  local comm = require("engine.distributed.comm")
  if not nn.is_module(module) then core.fail(op .. ": expected an nn.Module, got " .. type(module)) end
  if meshmod.is_mesh(group) then
    if group:ndim() ~= 1 then core.fail(op .. ": a DeviceMesh of one dim is needed (mesh[\"dp\"]), got " .. tostring(group)) end
    group = group:get_group()
  end
  opts = opts or {}
  local rop = opts.op or "avg"
  for _, p in module:named_parameters() do
    local g = p.grad
    if g ~= nil then
      local l = dtensor.is_dtensor(g) and g:to_local() or g
      comm.all_reduce(l, rop, { group = group })
    end
  end
  return module
end

return M
