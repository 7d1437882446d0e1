-- The link-fault case of tools/multinode.sh (not a busted spec: every rank of it ends by design).
-- 2 nodes x 2 ranks; the ranks warm up the TCP connections between the nodes, tell the script they
-- are ready (a file per rank in ENGINE_MN_FAULT_DIR), then run all_reduces of 1 MiB in a loop, each
-- crossing the link.  The script takes the link down while they run.  What must follow: every rank
-- ends within the comm timeout (ENGINE_MN_FAULT_TIMEOUT seconds, set here with set_comm_timeout) plus
-- a moment, each with the timeout report on its stderr (or a Lua error, written to its file), and
-- no rank hangs.  A rank whose loop ends without an error writes "no error" (a failure).
local engine = require("engine")
local dist = engine.distributed
dist.init()
local R = dist.rank()
local dir = assert(os.getenv("ENGINE_MN_FAULT_DIR"), "ENGINE_MN_FAULT_DIR is not set")
local timeout = tonumber(os.getenv("ENGINE_MN_FAULT_TIMEOUT") or "") or 5
dist.set_comm_timeout(timeout)
-- ENGINE_MN_FAULT_CHECK=0: no signature checks, so the link can only fail in a collective's data phase
if os.getenv("ENGINE_MN_FAULT_CHECK") == "0" then dist.set_comm_check(false) end

local function note(s)
  local f = assert(io.open(dir .. "/rank" .. R, "a"))
  f:write(s, "\n")
  f:close()
end

local x = engine.ones({ 262144 }) -- 1 MiB
for _ = 1, 5 do dist.all_reduce(x) end
dist.barrier()
note("ready")
local t0 = os.time()
local ok, err = pcall(function()
  for i = 1, 1e9 do
    x:fill_(1)
    dist.all_reduce(x)
    if i % 64 == 0 and os.time() - t0 > 60 then return end -- the link never went down
  end
end)
if ok then note("no error") else note("error: " .. tostring(err)) end
io.stdout:flush()
io.stderr:flush()
os.exit(ok and 0 or 1, false) -- no MPI_Finalize across a dead link
