-- README.md runs as written: every fenced ```lua and ```sh block is extracted and run, each as a user would paste
-- it, and a failing block fails here naming its line in README.md, its text and its output.
--
-- How a block runs (README.md, "The examples in this README", says the same to the reader):
--   ```lua            saved as a file and run by the engine host (this spec's own binary, build/engine):
--                     `build/engine block.lua`
--   ```lua {np=N}     the same under `mpirun -np N build/engine block.lua` (a distributed example)
--   ```sh             run by bash
--   ```sh {no-test: why}  not run (`make run` and `make test` themselves, which CI runs); listed as skipped with why
--   ``` or ```text    not code (a diagram, a log excerpt): ignored
-- Every block runs in a fresh temporary folder that looks like the repository root (a symlink to each of its
-- top-level entries, except runs/ and checkpoints/; data/ a folder of links to data/'s files), so relative paths
-- (build/engine, recipes/, data/, spec/fixtures) work as from the root while what a block writes (runs/,
-- checkpoints, data/ files, converted files) lands in the temporary folder; ENGINE_HOME is the repository root and ENGINE_RUNS_DIR is unset (runs/ is the block's own folder).
-- The Open MPI variables the README tells root users and small machines to export (OMPI_ALLOW_RUN_AS_ROOT,
-- OMPI_ALLOW_RUN_AS_ROOT_CONFIRM, OMPI_MCA_rmaps_base_oversubscribe, OMPI_MCA_hwloc_base_binding_policy=none) are
-- set for every block, and this process's own MPI variables are dropped (a child mpirun inside an MPI singleton fails
-- otherwise).  Blocks needing mpirun (np > 1, or an sh block that calls mpirun) are skipped, saying so, where mpirun
-- is not installed.
--
-- The blocks run in the main suite stage only: under the sanitizer stage (LD_PRELOAD holding libasan) they are
-- skipped, saying so (the README's commands name build/engine, the Release build, and would only be run twice).
-- Each block has a time limit (README_SPEC_TIMEOUT seconds, default 240); README examples that are about an option
-- use short runs (--steps=20 ...), so the whole file takes a few minutes on a 2-core machine.
-- README_SPEC_FILE=path runs the blocks of another markdown file (docs/*.md), from the same root;
-- README_SPEC_VERBOSE=1 prints each block's time.
local proc = require("spec.helpers.proc")

local HOME = rawget(_G, "ENGINE_HOME") or os.getenv("ENGINE_HOME") or "."
local FILE = os.getenv("README_SPEC_FILE") or "README.md"
local TIMEOUT = tonumber(os.getenv("README_SPEC_TIMEOUT") or "") or 240

local function sh_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local files = require("spec.helpers.files")
local read, write = files.read, files.write

-- blocks(text) -> list of {line (of the opening fence), lang, attrs = {no_test = reason, np = N}, body, info}
local function blocks(text)
  local list, cur = {}, nil
  local n = 0
  for line in (text .. "\n"):gmatch("([^\n]*)\n") do
    n = n + 1
    if cur then
      if line:match("^%s*```%s*$") then
        cur.body = table.concat(cur.lines, "\n") .. "\n"
        cur.lines = nil
        list[#list + 1] = cur
        cur = nil
      else
        cur.lines[#cur.lines + 1] = line
      end
    else
      local info = line:match("^%s*```(.*)$")
      if info and not info:find("`", 1, true) then  -- (CommonMark: a fence's info string has no backtick)
        local lang, rest = info:match("^%s*([%w_+-]*)%s*(.-)%s*$")
        local attrs = {}
        local inner = rest:match("^{(.*)}$")
        if rest ~= "" and not inner then
          error(string.format("%s:%d: unknown info string '%s' (expected {no-test: why} or {np=N})", FILE, n, info))
        end
        if inner then
          local why = inner:match("^%s*no%-test%s*:%s*(.-)%s*$")
          local np = inner:match("^%s*np%s*=%s*(%d+)%s*$")
          if why and why ~= "" then attrs.no_test = why
          elseif np then attrs.np = tonumber(np)
          else
            error(string.format("%s:%d: unknown block attribute {%s} (expected {no-test: why} or {np=N})", FILE, n,
              inner))
          end
        end
        cur = { line = n, lang = lang:lower(), attrs = attrs, lines = {}, info = info }
      end
    end
  end
  if cur then error(string.format("%s:%d: a code block that is never closed", FILE, cur.line)) end
  return list
end

-- link(src_dir, dst_dir, skip): a symlink in dst_dir to each entry of src_dir not in skip
local function link_entries(src, dst, skip)
  local p = io.popen("ls -A " .. sh_quote(src))
  for entry in p:lines() do
    if not skip[entry] then
      os.execute(string.format("ln -s %s %s", sh_quote(src .. "/" .. entry), sh_quote(dst .. "/" .. entry)))
    end
  end
  p:close()
end

-- a fresh folder that looks like the repository root: data/ is a folder of its own (links to the prepared files)
-- so that what a block writes there stays in the temporary folder
local function workdir()
  local dir = os.tmpname()
  os.remove(dir)
  assert(os.execute("mkdir -p " .. sh_quote(dir .. "/data")) == 0)
  link_entries(HOME, dir, { runs = true, checkpoints = true, [".git"] = true, data = true })
  link_entries(HOME .. "/data", dir .. "/data", {})
  return dir
end

-- the environment of a block: this process's MPI variables dropped, the README's Open MPI settings, ENGINE_HOME
local function env_prefix()
  return "env $(env | grep -o '^\\(OMPI\\|PMIX\\|OPAL\\|ORTE\\)[A-Za-z0-9_]*' | sed 's/^/-u /') -u ENGINE_RUNS_DIR "
    .. "-u ENGINE_SUMMARY_FILE -u ENGINE_SUMMARY_DIR "
    .. "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 "
    .. "OMPI_MCA_hwloc_base_binding_policy=none ENGINE_HOME=" .. sh_quote(HOME) .. " "
end

-- run(block) -> output, exit status
local function run(b)
  local dir = workdir()
  local cmd
  if b.lang == "lua" then
    write(dir .. "/readme_block.lua", b.body)
    local launch = b.attrs.np and ("mpirun -np " .. b.attrs.np .. " ") or ""
    cmd = string.format("%stimeout -k 5 %d %s%s readme_block.lua", env_prefix(), TIMEOUT, launch,
      sh_quote(proc.self_exe()))
  else
    write(dir .. "/readme_block.sh", "set -e\n" .. b.body)
    cmd = string.format("%stimeout -k 5 %d bash readme_block.sh", env_prefix(), TIMEOUT)
  end
  local p = io.popen(string.format("cd %s && %s < /dev/null 2>&1; echo \"__rc=$?\"", sh_quote(dir), cmd))
  local out = p:read("*a")
  p:close()
  os.execute("rm -rf " .. sh_quote(dir))
  local rc = tonumber(out:match("__rc=(%d+)%s*$"))
  return (out:gsub("__rc=%d+%s*$", "")), rc
end

local function numbered(body, first)
  local r, n = {}, first
  for line in body:gmatch("([^\n]*)\n") do
    n = n + 1
    r[#r + 1] = string.format("%5d | %s", n, line)
  end
  return table.concat(r, "\n")
end

local function tail(s, max_lines)
  local lines = {}
  for line in s:gmatch("([^\n]*)\n?") do lines[#lines + 1] = line end
  while #lines > 0 and lines[#lines] == "" do lines[#lines] = nil end
  if #lines <= max_lines then return table.concat(lines, "\n") end
  return "(... " .. (#lines - max_lines) .. " lines)\n" .. table.concat(lines, "\n", #lines - max_lines + 1)
end

local PATH = FILE:sub(1, 1) == "/" and FILE or (HOME .. "/" .. FILE)
local text = assert(read(PATH), "readme_spec: cannot read " .. PATH)
local all = blocks(text)
local sanitized = (os.getenv("LD_PRELOAD") or ""):find("asan", 1, true) ~= nil
local have_mpirun = proc.have_mpirun()

describe(FILE .. " code blocks", function()
  it("are found, each lua and sh block run or marked {no-test: why}", function()
    local runnable, skipped = 0, {}
    for _, b in ipairs(all) do
      if b.lang == "lua" or b.lang == "sh" or b.lang == "bash" then
        if b.attrs.no_test then skipped[#skipped + 1] = b.line .. " (" .. b.attrs.no_test .. ")"
        else runnable = runnable + 1 end
      elseif b.lang ~= "" and b.lang ~= "text" then
        error(string.format("%s:%d: a ```%s block: the README's code blocks are lua, sh, or text (not run)", FILE,
          b.line, b.lang))
      end
      if b.attrs.np and b.lang ~= "lua" then
        error(string.format("%s:%d: {np=N} is for lua blocks (an sh block writes its mpirun itself)", FILE, b.line))
      end
    end
    assert.is_true(runnable > 0, FILE .. ": no runnable block found")
    local f = io.open(HOME .. "/data/kjv_train.bin", "rb")
    if f then f:close() end
    assert.is_not_nil(f, "data/kjv_train.bin is missing: the README's examples "
      .. "train on the KJV shards that make data (and make run, make test) write")
    print(string.format("\n%s: %d blocks to run; not run ({no-test}): %s", FILE, runnable,
      #skipped > 0 and table.concat(skipped, ", ") or "none"))
  end)

  if sanitized then
    pending(FILE .. ": the blocks run in the main suite stage only, not under the sanitizer")
    return
  end
  for _, b in ipairs(all) do
    local code = b.lang == "lua" or b.lang == "sh" or b.lang == "bash"
    local name = string.format("%s:%d ```%s%s", FILE, b.line, b.lang, b.attrs.np and (" {np=" .. b.attrs.np .. "}") or "")
    local needs_mpi = (b.attrs.np and b.attrs.np > 0) or (b.lang ~= "lua" and b.body:find("mpirun", 1, true))
    if not code then
      -- not code: nothing to run
    elseif b.attrs.no_test then
      pending(name .. ": not run here: " .. b.attrs.no_test)
    elseif needs_mpi and not have_mpirun then
      pending(name .. ": needs mpirun, which is not installed")
    else
      it(name .. " runs as written", function()
        local t0 = os.time()
        local out, rc = run(b)
        if os.getenv("README_SPEC_VERBOSE") then
          io.stderr:write(string.format("\n%s: exit %s in %d s\n", name, tostring(rc), os.time() - t0))
        end
        if rc ~= 0 then
          error(string.format("%s:%d: the %s block failed (exit status %s%s) after %d s\n%s\n--- its output ---\n%s",
            FILE, b.line, b.lang, tostring(rc), (rc == 124 or rc == 137) and (": timed out after " .. TIMEOUT .. " s")
            or "", os.time() - t0, numbered(b.body, b.line), tail(out, 60)), 0)
        end
      end)
    end
  end
end)
