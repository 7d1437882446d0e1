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

-- dirs(name) -> root, newdir: a folder name every rank agrees on (a time stamp broadcast from rank 0; collective),
-- TMPDIR/<name>_<stamp>_w<world size>, and newdir() -> root/c1, root/c2, ... (not created)
function M.dirs(name)
  local engine = require("engine")
  local dist = engine.distributed
  local stamp = engine.tensor({ math.floor(engine.time() * 1000) % 100000000 }, "f64")
  dist.broadcast(stamp, 0)
  local root = string.format("%s/%s_%d_w%d", os.getenv("TMPDIR") or "/tmp", name, stamp:item(), dist.world_size())
  local n = 0
  return root, function()
    n = n + 1
    return string.format("%s/c%d", root, n)
  end
end

-- For the "#gpu" multi-process specs: pending (with the reason) unless every rank can use a GPU through NCCL:
-- a GPU at all, and one per rank, or several ranks on one GPU made to look like different hosts to NCCL
-- (each rank its own NCCL_HOSTID, with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1: tools/gpu-check.sh, docs/cuda.md).
-- Pass busted's `pending` (a spec-file global that required modules do not see).
function M.need_cuda_ranks(pending)
  local engine = require("engine")
  local W = engine.distributed.world_size()
  if not engine.cuda.is_available() then pending("no GPU: " .. engine.cuda.unavailable_reason()) end
  local n = engine.cuda.device_count()
  if n < W and not os.getenv("NCCL_HOSTID") then
    pending(string.format("%d GPU(s) for %d ranks: NCCL needs one GPU per rank, or a distinct NCCL_HOSTID per "
      .. "rank to share one (tools/gpu-check.sh)", n, W))
  end
end

return M
