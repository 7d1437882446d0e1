-- spec/helpers/proc.lua: the engine binary running this spec, for specs that start child processes
-- (a recipe, a crashing snippet, a 2-rank mpirun job).
local M = {}

local exe
-- Path of this process's executable (the engine host), read once from /proc.
function M.self_exe()
  if exe then return exe end
  local f = assert(io.open("/proc/self/stat", "r"))
  local pid = f:read("*l"):match("^(%d+)")
  f:close()
  local q = assert(io.popen("readlink /proc/" .. pid .. "/exe"))
  exe = q:read("*l")
  q:close()
  return exe
end

-- snippet(code, unset, env, args) -> the output of `engine <code as a file> args` run as a child (stdout and stderr),
-- after asserting that it exited 0.  unset: names of variables to drop; env: "NAME='value' ..." to set; this
-- process's MPI variables are dropped too (an MPI singleton's variables confuse a child's own MPI start-up).
local snippets = {}
function M.snippet(code, unset, env, args)
  local path = snippets[code]
  if not path then
    path = os.tmpname()
    local f = assert(io.open(path, "w"))
    f:write(code)
    f:close()
    snippets[code] = path
  end
  local drop = {}
  for _, name in ipairs(unset or {}) do drop[#drop + 1] = "-u " .. name end
  local cmd = string.format("env %s $(env | grep -o '^\\(OMPI\\|PMIX\\|OPAL\\|ORTE\\)[A-Za-z0-9_]*' | "
    .. "sed 's/^/-u /') %s timeout -k 5 120 '%s' '%s' %s 2>&1; echo \"__rc=$?\"", table.concat(drop, " "), env or "",
    M.self_exe(), path, args or "")
  local p = assert(io.popen(cmd))
  local out = p:read("*a")
  p:close()
  local rc = tonumber(out:match("__rc=(%d+)%s*$"))
  assert(rc == 0, "child failed (" .. tostring(rc) .. "): " .. cmd .. "\n" .. out)
  return out
end

-- remove_snippets() removes the files snippet wrote.
function M.remove_snippets()
  for code, path in pairs(snippets) do os.remove(path); snippets[code] = nil end
end

-- have_mpirun() -> whether mpirun is on the PATH
function M.have_mpirun()
  local p = io.popen("command -v mpirun")
  local s = p:read("*a")
  p:close()
  return s ~= ""
end

-- job(np, script, args, {env = {NAME = value}, timeout = 120, own_nccl_host = false}) -> output (stdout and stderr),
-- exit status.  own_nccl_host: each rank its own NCCL_HOSTID, NCCL over sockets on the loopback (several ranks on
-- one GPU, docs/cuda.md).
-- Runs `engine script args...` in ENGINE_HOME as a child job: under `mpirun -np np` (np >= 1) or alone (np = 0),
-- killed after timeout seconds (status 124, or 137 when it had to be killed).  The MPI variables of this process
-- are dropped (a child mpirun inside an MPI singleton or job fails otherwise), except those a singleton was started
-- with and where OpenMPI and PMIx are installed (OPAL_PREFIX, PMIX_PREFIX: an unpacked offline bundle); env is set
-- for every rank.
function M.job(np, script, args, opts)
  opts = opts or {}
  local home = rawget(_G, "ENGINE_HOME") or os.getenv("ENGINE_HOME") or "."
  local envs, xs = {}, {}
  local names = {}
  for k in pairs(opts.env or {}) do names[#names + 1] = k end
  table.sort(names)
  for _, k in ipairs(names) do
    envs[#envs + 1] = string.format("%s='%s'", k, (tostring(opts.env[k]):gsub("'", "'\\''")))
    xs[#xs + 1] = "-x " .. k
  end
  if os.getenv("ENGINE_HOME") then xs[#xs + 1] = "-x ENGINE_HOME" end
  -- Under the sanitizer stage LD_PRELOAD holds libasan for the engine: it goes to the ranks (-x), not to mpirun
  -- itself (OpenMPI's launcher is not ours to check, and its abort path reads freed memory under ASan).
  local preload = os.getenv("LD_PRELOAD")
  local unset = ""
  if np > 0 and preload and preload ~= "" then
    unset = "-u LD_PRELOAD "
    xs[#xs + 1] = string.format("-x LD_PRELOAD='%s'", preload)
  end
  -- kept: the variables this process had before MPI_Init when it is a singleton (ENGINE_PRE_MPI_ENV, bindings/host.c),
  -- and where OpenMPI and PMIx are installed
  local keep = { "-e OPAL_PREFIX", "-e PMIX_PREFIX" }
  for name in (os.getenv("ENGINE_PRE_MPI_ENV") or ""):gmatch("[%w_]+") do keep[#keep + 1] = "-e " .. name end
  local launcher = string.format("env %s$(env | grep -o '^\\(OMPI\\|PMIX\\|OPAL\\|ORTE\\)[A-Za-z0-9_]*' | %ssed 's/^/-u /') %s "
    .. "timeout -k 5 %d ", unset, "grep -v -x -F " .. table.concat(keep, " ") .. " | ", table.concat(envs, " "),
    opts.timeout or 120)
  local wrap = ""
  if np > 0 then
    if opts.own_nccl_host then
      xs[#xs + 1] = "-x NCCL_P2P_DISABLE=1 -x NCCL_SHM_DISABLE=1 -x NCCL_SOCKET_IFNAME=lo"
      wrap = "sh -c 'NCCL_HOSTID=spec$OMPI_COMM_WORLD_RANK; export NCCL_HOSTID; exec \"$@\"' sh "
    end
    launcher = launcher .. "mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader --mca pml ob1 "
      .. table.concat(xs, " ") .. " -np " .. np .. " " .. wrap
  end
  local cmd = string.format("cd '%s' && %s'%s' %s %s 2>&1; echo \"__rc=$?\"", home, launcher, M.self_exe(), script,
    table.concat(args or {}, " "))
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  local rc = tonumber(out:match("__rc=(%d+)%s*$"))
  if rc ~= 0 and os.getenv("CKPT_SPEC_DEBUG") then io.stderr:write(cmd, "\n", out, "\n") end
  return (out:gsub("__rc=%d+%s*$", "")), rc
end

return M
