-- engine.distributed.implicit_replication: PyTorch's implicit_replication()
-- context (semantics C15) as a scoped function.
--
--   local out = dist.implicit_replication(function() return model(dtensor_tokens) end)
--
-- Inside fn, a plain tensor used in an op together with DTensors counts as a
-- Replicate DTensor on their mesh (e.g. positions made with engine.arange in a
-- model whose input is a DTensor); outside, that is the error "mixed DTensor
-- and Tensor arguments".  The flag is per thread and restored when fn returns
-- or raises; calls nest.  Returns fn's results.
local core = require("engine.core")
local C = core.C

local M = {}

local function finish(prev, ok, ...)
  C.eng_dtensor_set_implicit_replication(prev)
  if not ok then error((...), 0) end
  return ...
end

function M.implicit_replication(fn, ...)
  if type(fn) ~= "function" then
    error("implicit_replication: expected a function to run, got " .. type(fn), 2)
  end
  local prev = C.eng_dtensor_set_implicit_replication(1)
  return finish(prev, pcall(fn, ...))
end

return M
