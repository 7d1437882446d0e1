-- engine.ffi: the one FFI declaration module.
-- It reads the public C header (engine/include/engine.h and the headers it
-- includes, in order) and hands the declarations to ffi.cdef, so the Lua side
-- can never drift from the header.  Then it finds the library: symbols already
-- in the process (the `engine` host links libengine) or build/libengine.so.
local ffi = require("ffi")

local M = { ffi = ffi }

local function script_home()
  local src = debug.getinfo(1, "S").source
  local dir = src:match("^@(.*)/lua/engine/ffi%.lua$")
  return dir
end

local home = rawget(_G, "ENGINE_HOME") or os.getenv("ENGINE_HOME") or script_home() or "."
M.home = home

local function read(path)
  local f, err = io.open(path, "r")
  if not f then error("engine.ffi: cannot read header " .. path .. ": " .. tostring(err), 0) end
  local s = f:read("*a")
  f:close()
  return s
end

-- Collects declarations: preprocessor lines are dropped, #include "x" is
-- followed, and #ifdef __cplusplus blocks are skipped.
local function collect(path, out, seen)
  if seen[path] then return end
  seen[path] = true
  local dir = path:match("^(.*)/[^/]*$") or "."
  local skip = {}
  for line in (read(path) .. "\n"):gmatch("([^\n]*)\n") do
    local directive = line:match("^%s*#%s*(%a+)")
    if directive then
      if directive == "ifdef" or directive == "ifndef" or directive == "if" then
        skip[#skip + 1] = line:match("__cplusplus") ~= nil
      elseif directive == "endif" then
        skip[#skip] = nil
      elseif directive == "include" then
        local inc = line:match('^%s*#%s*include%s+"([^"]+)"')
        local active = true
        for i = 1, #skip do if skip[i] then active = false end end
        if inc and active then collect(dir .. "/" .. inc, out, seen) end
      end
    else
      local active = true
      for i = 1, #skip do if skip[i] then active = false end end
      if active then out[#out + 1] = line end
    end
  end
end

function M.declarations()
  local out = {}
  collect(home .. "/engine/include/engine.h", out, {})
  return table.concat(out, "\n")
end

ffi.cdef(M.declarations())

local function try_global()
  local ok = pcall(function() return ffi.C.eng_version end)
  return ok and ffi.C or nil
end

local C = try_global()
if not C then
  local candidates = {}
  if os.getenv("ENGINE_LIB") then candidates[#candidates + 1] = os.getenv("ENGINE_LIB") end
  candidates[#candidates + 1] = home .. "/build/libengine.so"
  local errs = {}
  for _, p in ipairs(candidates) do
    local ok, lib = pcall(ffi.load, p, true)
    if ok then C = lib; break end
    errs[#errs + 1] = tostring(lib)
  end
  if not C then
    error("engine.ffi: cannot load libengine (build it with `make build`): " .. table.concat(errs, "; "), 0)
  end
end
-- ENGINE_PROFILE (set at launch): the op calls go through the profiler's timing wrapper (lua/engine/profiler.lua);
-- any value but "0"/"off" also starts recording and prints the table at exit
local prof = os.getenv("ENGINE_PROFILE")
if prof and prof ~= "" then
  local raw = C
  C = require("engine.profiler").proxy(raw, home)
  rawset(_G, "ENGINE_PROFILE_INSTALLED", true)
  if prof ~= "0" and prof ~= "off" then raw.eng_profiler_enable(1, 1) end
end
M.C = C
return M
