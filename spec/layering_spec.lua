-- The engine's source tree: one folder per subsystem under engine/src/, private
-- includes named by folder, and the arrows between subsystems (docs/design.md,
-- "Source layout").  A file that includes a header of a subsystem its own may
-- not call fails here, as does autograd naming the DTensor layer.
local SRC = "engine/src"

local function ls(cmd)
  local out = {}
  local p = assert(io.popen(cmd))
  for line in p:lines() do out[#out + 1] = line end
  p:close()
  return out
end

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

-- subsystem -> the subsystems whose private headers it may include (besides its own)
local ALLOWED = {
  core = {},
  autograd = { core = true },
  ops = { core = true, autograd = true, cuda = true },
  io = { core = true },
  comm = { core = true, cuda = true },
  dtensor = { core = true, autograd = true, comm = true, ops = true },
  sharding = { core = true, autograd = true, comm = true, dtensor = true, ops = true },
  cuda = { core = true },
  sharded_tensor = { core = true, comm = true, dtensor = true },
  checkpoint = { core = true, io = true, comm = true, dtensor = true, sharded_tensor = true },
  fsdp = { core = true, autograd = true, comm = true, dtensor = true, ops = true, cuda = true },
  ddp = { core = true, autograd = true, comm = true },
}
-- Upward includes that exist today, each with its reason; a new one must be added here on purpose.
-- (None today: ops and core reach the DTensor layer through core/dispatch.h.)
local EXCEPTIONS = {}

-- Calls the built objects may make against the table above, each by symbol with its reason.  None today: every
-- upward call goes through a registration point (core/dispatch.h, core/device.h, autograd/dist_hooks.h,
-- autograd/grad_math.h, eng_tensor_set_autograd_free).  A call not listed here that the table forbids fails the
-- spec ("sees real calls").
local KNOWN_CALLS = {}

local files = ls("cd " .. SRC .. " && find . -name '*.[ch]' | sed 's|^./||' | sort")

describe("engine/src layout", function()
  it("has every source file inside a subsystem folder", function()
    assert.is_true(#files > 40)
    for _, f in ipairs(files) do
      local dir = f:match("^([%w_]+)/[^/]+$")
      assert(dir, f .. " is not inside a subsystem folder")
      assert(ALLOWED[dir], f .. ": folder '" .. dir .. "' has no entry in the layering table (add it here and to docs/design.md)")
    end
  end)

  it("names the folder of every private include and keeps the arrows one way", function()
    local headers = {}
    for _, f in ipairs(files) do if f:match("%.h$") then headers[f] = true end end
    local checked = 0
    for _, f in ipairs(files) do
      local dir = f:match("^([%w_]+)/")
      for inc in read(SRC .. "/" .. f):gmatch('#include "([^"]+)"') do
        -- the public headers (eng/*.h, the API the FFI reads) may be included anywhere
        if not inc:match("^kernels/") and not inc:match("^eng/") and inc ~= "engine.h" then
          local idir = inc:match("^([%w_]+)/[^/]+$")
          assert(idir, f .. ": private include \"" .. inc .. "\" must name its folder (e.g. \"core/internal.h\")")
          assert(headers[inc], f .. ": \"" .. inc .. "\" is not a header under " .. SRC)
          if idir ~= dir and not ALLOWED[dir][idir] then
            local why = EXCEPTIONS[f] and EXCEPTIONS[f][idir]
            assert(why, f .. " (" .. dir .. "/) includes " .. inc .. ": " .. dir .. "/ may not call " .. idir .. "/")
          end
          checked = checked + 1
        end
      end
    end
    assert.is_true(checked > 60)
  end)

  it("keeps autograd free of the DTensor layer (registration table only)", function()
    for _, f in ipairs(files) do
      if f:match("^autograd/") then
        local s = read(SRC .. "/" .. f)
        assert.is_nil(s:match('#include "dtensor/'), f)
        assert.is_nil(s:match('#include "sharding/'), f)
        for name in s:gmatch("(eng_dtensor_[%w_]+)%s*%(") do error(f .. " calls " .. name .. " by name") end
        for name in s:gmatch("(eng_dist_[%w_]+)%s*%(") do error(f .. " calls " .. name .. " by name") end
        for name in s:gmatch("(eng_dispatch[%w_]*)%s*%(") do error(f .. " calls " .. name .. " by name") end
      end
    end
  end)

  it("includes the public API header by header (no engine.h inside the library)", function()
    for _, f in ipairs(files) do
      assert.is_nil(read(SRC .. "/" .. f):match('#include "engine.h"'), f .. " includes engine.h: include the "
        .. "eng/*.h headers of what it calls")
    end
  end)

  it("keeps ops and core free of the DTensor layer (one dispatch boundary: core/dispatch.h)", function()
    for _, f in ipairs(files) do
      if f:match("^ops/") or f:match("^core/") then
        local s = read(SRC .. "/" .. f)
        assert.is_nil(s:match('#include "dtensor/'), f .. " includes a dtensor/ header")
        assert.is_nil(s:match('#include "sharding/'), f .. " includes a sharding/ header")
        for name in s:gmatch("(eng_dt_[%w_]+)%s*%(") do error(f .. " calls " .. name .. " by name") end
        for name in s:gmatch("(eng_dtensor_[%w_]+)%s*%(") do error(f .. " calls " .. name .. " by name") end
        for name in s:gmatch("(eng_dispatch[%w_]*)%s*%(") do
          if not name:match("^eng_dispatch_local_mode$") and not name:match("^eng_dispatch_set_local_mode$")
            and not name:match("^eng_dispatcher_install$") then
            error(f .. " calls the dispatcher's " .. name .. " by name (use eng_op_dispatch with an op id)")
          end
        end
        assert.is_nil(s:match("eng_opdef_"), f .. " names an op def (op defs are registered by op id)")
      end
    end
  end)

  it("keeps core free of device runtimes (devices behind core/device.h)", function()
    for _, f in ipairs(files) do
      if f:match("^core/") then
        local code = read(SRC .. "/" .. f):gsub("/%*.-%*/", ""):gsub("//[^\n]*", "")
        assert.is_nil(code:match("ENG_CUDA"), f .. " branches on ENG_CUDA (call the device table instead)")
        for name in code:gmatch("(eng_cuda?_[%w_]+)%s*%(") do error(f .. " calls the CUDA runtime's " .. name) end
        assert.is_nil(code:match('#include "cuda/'), f .. " includes a cuda/ header")
      end
    end
  end)

  it("the built objects call across folders only what the table allows (nm: sees real calls)", function()
    -- the objects of the library this process runs (build/, build-asan/ ...)
    local exe = require("spec.helpers.proc").self_exe()
    local objdir = exe:match("^(.*)/[^/]+$") .. "/CMakeFiles/engine.dir/engine/src"
    local probe = io.popen("ls " .. objdir .. "/*/*.o 2>/dev/null | head -1; command -v nm")
    local first, nm = probe:read("*l"), probe:read("*l")
    probe:close()
    if not first or first == "" or not nm then pending("no objects under " .. objdir .. " or no nm") end
    local def, uses = {}, {}
    for _, o in ipairs(ls("ls " .. objdir .. "/*/*.o")) do
      local dir = o:match("/([%w_]+)/[^/]+%.o$")
      local src = SRC .. "/" .. dir .. "/" .. o:match("([^/]+)%.o$")
      -- an object whose source was moved or removed is stale (an old build directory): not part of the library
      local f = io.open(src)
      if f then
        f:close()
        for _, line in ipairs(ls("nm --defined-only -g '" .. o .. "'")) do
          local sym = line:match("%S+%s+%S+%s+(%S+)$")
          if sym then def[sym] = dir end
        end
        uses[#uses + 1] = { dir = dir, obj = o:match("[^/]+$"), syms = ls("nm -u '" .. o .. "' | awk '{print $2}'") }
      end
    end
    local checked, bad = 0, {}
    for _, u in ipairs(uses) do
      for _, sym in ipairs(u.syms) do
        local to = def[sym]
        if to and to ~= u.dir then
          checked = checked + 1
          if not ALLOWED[u.dir][to] then
            local k = KNOWN_CALLS[u.dir .. "->" .. to]
            local listed = false
            for _, s in ipairs(k and k.syms or {}) do if s == sym then listed = true end end
            if not listed then bad[#bad + 1] = string.format("%s/%s calls %s (defined in %s/): %s/ may not call %s/",
              u.dir, u.obj, sym, to, u.dir, to) end
          end
        end
      end
    end
    assert.is_true(checked > 300, "only " .. checked .. " cross-folder calls seen")
    assert(#bad == 0, table.concat(bad, "\n"))
    -- each folder's private headers declare only what that folder defines (a function declared in dir/x.h is
    -- defined by an object of dir/)
    local declared, misplaced = 0, {}
    for _, f in ipairs(files) do
      local dir = f:match("^([%w_]+)/[^/]+%.h$")
      if dir then
        local code = read(SRC .. "/" .. f):gsub("/%*.-%*/", "")
        for line in code:gmatch("[^\n]+") do
          local name = not line:match("^%s") and not line:match("static") and not line:match("^#")
            and not line:match("^typedef") and line:match("^[%w_][%w_ %*]-[%s%*]([%w_]+)%s*%(")
          if name and def[name] then
            declared = declared + 1
            if def[name] ~= dir then
              misplaced[#misplaced + 1] = f .. " declares " .. name .. ", which " .. def[name] .. "/ defines"
            end
          end
        end
      end
    end
    assert.is_true(declared > 100, "only " .. declared .. " private declarations checked")
    assert(#misplaced == 0, table.concat(misplaced, "\n"))
  end)

  it("opens each subsystem's main file with what it owns and may call", function()
    local main = { core = "core/tensor.c", autograd = "autograd/autograd.c", ops = "ops/ops.h", io = "io/safetensors.c",
      comm = "comm/process_group.c", dtensor = "dtensor/dtensor.c", sharding = "sharding/sharding.h",
      cuda = "cuda/runtime.c", sharded_tensor = "sharded_tensor/metadata.c",
      fsdp = "fsdp/fsdp.c", checkpoint = "checkpoint/files.c", ddp = "ddp/ddp.c" }
    for dir in pairs(ALLOWED) do
      local f = assert(main[dir], dir)
      local head = read(SRC .. "/" .. f):sub(1, 1500)
      assert(head:match("Subsystem " .. dir .. "/"), f .. " must open with 'Subsystem " .. dir .. "/: ...'")
      assert(head:match("May call"), f .. " must say what the subsystem may call")
    end
  end)

  it("loads Lua modules at the top: no lazy require of the engine, nn names no FSDP", function()
    for _, f in ipairs(ls("find lua/engine -name '*.lua' | sort")) do
      local n = 0
      for line in io.lines(f) do
        n = n + 1
        local code = line:gsub("%-%-.*$", "")
        -- require("engine") inside a function body (an indented line, or after other code on the line) dodges
        -- a require cycle: the module belongs below the engine or should require it at the top
        if code:match('require%("engine"%)') and not code:match('^local [%w_]+ = require%("engine"%)%s*$') then
          error(f .. ":" .. n .. ": lazy require(\"engine\"): require it at the top (or the module it needs)")
        end
        if f:match("^lua/engine/nn/") then
          assert(not code:match("engine%.distributed%.fsdp") and not code:match("_fsdp"),
            f .. ":" .. n .. ": nn names FSDP (FSDP registers with nn.Module._register_param_views)")
        end
      end
    end
  end)

  it("lists exactly the existing modules in engine.distributed", function()
    local src = read("lua/engine/distributed/init.lua")
    assert.is_nil(src:match("pcall%(require"), "engine.distributed must not skip missing modules")
    local block = src:match("local modules = (%b{})")
    for name in block:gmatch('"([%w_]+)"') do
      assert(io.open("lua/engine/distributed/" .. name .. ".lua"), "engine.distributed lists missing module " .. name)
    end
    for _, f in ipairs(ls("ls lua/engine/distributed/*.lua")) do
      local name = f:match("([%w_]+)%.lua$")
      if name ~= "init" then
        assert(block:match('"' .. name .. '"'), "lua/engine/distributed/" .. name .. ".lua is not listed in init.lua")
      end
    end
  end)
end)
