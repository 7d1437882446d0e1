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

return M
