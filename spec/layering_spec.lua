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
  core = { cuda = true },
  autograd = { core = true },
  ops = { core = true, autograd = true, cuda = true, sharding = true },
  io = { core = true },
  comm = { core = true, cuda = true },
  dtensor = { core = true, autograd = true, comm = true, sharding = true, ops = true },
  sharding = { core = true, autograd = true, comm = true, dtensor = true, ops = true },
  cuda = { core = true, ops = true },
  sharded_tensor = { core = true, comm = true, dtensor = true },
  checkpoint = { core = true, io = true, comm = true, dtensor = true, sharded_tensor = true },
  fsdp = { core = true, autograd = true, comm = true, dtensor = true },
  ddp = { core = true, autograd = true, comm = true },
}
-- Upward includes that exist today, each with its reason; a new one must be added here on purpose.
local EXCEPTIONS = {
  ["core/tensor.c"] = { sharding = "the op guard of copy_/fill_/element access routes DTensors to the dispatcher" },
  ["core/meta.c"] = { sharding = "meta operands run through the op defs' shape functions" },
  ["core/rng.c"] = { dtensor = "in-place random fills of a DTensor draw the shard's slice of the global tensor" },
}

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
    for _, f in ipairs(files) do if f:match("%.h$") then headers[f:match("[^/]+$")] = f end end
    local checked = 0
    for _, f in ipairs(files) do
      local dir = f:match("^([%w_]+)/")
      for inc in read(SRC .. "/" .. f):gmatch('#include "([^"]+)"') do
        if not inc:match("^kernels/") and inc ~= "engine.h" then
          local idir, name = inc:match("^([%w_]+)/([^/]+)$")
          assert(idir, f .. ": private include \"" .. inc .. "\" must name its folder (e.g. \"core/internal.h\")")
          assert(headers[name] == inc, f .. ": \"" .. inc .. "\" is not a header under " .. SRC)
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
