-- Small helpers shared by the multi-process specs (spec/dist/*_spec.lua).
local M = {}

-- Max absolute difference of two tensors (math.huge when the shapes differ; 0 for empty ones).
function M.diff(a, b)
  local sa, sb = a:shape(), b:shape()
  if #sa ~= #sb then return math.huge end
  for i = 1, #sa do if sa[i] ~= sb[i] then return math.huge end end
  if a:numel() == 0 then return 0 end
  return (a:double() - b:double()):abs():max():item()
end

-- The message of the error fn(...) raises; fails the spec when it raises none.
function M.errmsg(fn, ...)
  local ok, e = pcall(fn, ...)
  assert(not ok, "expected an error")
  return tostring(e)
end

-- counted(fn) -> the collectives fn issued on this rank as "kind=n" sorted by kind (dist.count_collectives),
-- then fn's results
function M.counted(fn)
  local res = { require("engine").distributed.count_collectives(fn) }
  local keys = {}
  for k, v in pairs(res[1]) do keys[#keys + 1] = k .. "=" .. v end
  table.sort(keys)
  return table.concat(keys, " "), unpack(res, 2, table.maxn(res))
end

return M
