-- engine.distributed.loss_parallel: vocab-parallel cross entropy (Megatron's
-- parallel cross entropy; the local op behind cross_entropy on logits sharded
-- on the class dim).
--
--   local loss = dist.cross_entropy_vocab_parallel(logits_local, targets, {
--     vocab_offset = off, vocab_total = V, group = mesh:get_group(1),
--     ignore_index = -100, reduction = "mean"})
--
-- logits_local [..., V_local] holds classes off .. off + V_local - 1 (0-based,
-- like targets) of the last dim; targets [...] are the same on every rank.
-- Three all_reduces forward (row max, sum of exp, target logit), none backward;
-- the loss is the same on every rank, the gradient of logits_local is this
-- rank's slice of the full logits gradient.
local core = require("engine.core")
local C = core.C
local wrap, ct = core.wrap, core.ct

local M = {}

local reductions = { none = 0, mean = 1, sum = 2 }
local known = { vocab_offset = true, vocab_total = true, group = true, mesh_dim = true, ignore_index = true,
  reduction = true }

local function int_opt(v, default, op, name)
  if v == nil then v = default end
  if type(v) ~= "number" or v % 1 ~= 0 then
    error(string.format("%s: %s must be an integer, got %s", op, name, tostring(v)), 3)
  end
  return v
end

function M.cross_entropy_vocab_parallel(logits, target, opts)
  local op = "cross_entropy_vocab_parallel"
  local x, t = ct(logits, op, 1), ct(target, op, 2)
  opts = opts or {}
  if type(opts) ~= "table" then error(op .. ": options must be a table", 2) end
  for k in pairs(opts) do
    if not known[k] then error(string.format("%s: unknown option '%s'", op, tostring(k)), 2) end
  end
  local off = int_opt(opts.vocab_offset, nil, op, "vocab_offset")
  local vt = int_opt(opts.vocab_total, nil, op, "vocab_total")
  local ignore = int_opt(opts.ignore_index, -100, op, "ignore_index")
  local red = reductions[opts.reduction or "mean"]
  if red == nil then
    error(string.format("%s: reduction must be \"none\", \"mean\" or \"sum\", got %s", op, tostring(opts.reduction)), 2)
  end
  local g = opts.group
  local pg = nil
  if g ~= nil then
    if type(g) == "table" and type(g.get_group) == "function" then g = g:get_group(opts.mesh_dim) end
    if type(g) ~= "table" or g._c == nil then error(op .. ": opts.group must be a ProcessGroup or a DeviceMesh", 2) end
    pg = g._c
  end
  return wrap(C.eng_cross_entropy_vocab_parallel(x, t, off, vt, pg, ignore, red))
end

return M
