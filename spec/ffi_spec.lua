-- The FFI declarations come from the public header; every function the header
-- declares must exist in the library, and the host must behave as documented.
local F = require("engine.ffi")

describe("ffi bindings", function()
  it("declares every public function of the header and resolves it in libengine", function()
    local decls = F.declarations()
    local names, missing = {}, {}
    for name in decls:gmatch("[%s%*](eng_[%w_]+)%s*%(") do names[name] = true end
    local count = 0
    for name in pairs(names) do
      count = count + 1
      local ok = pcall(function() return F.C[name] end)
      if not ok then missing[#missing + 1] = name end
    end
    table.sort(missing)
    assert.is_true(count > 100, "expected the header to declare many functions, found " .. count)
    assert.are.same({}, missing)
  end)

  it("keeps the struct layout the C side uses", function()
    local ffi = F.ffi
    local t = ffi.new("eng_tensor")
    assert.are.equal(8, ffi.sizeof(t.shape) / ffi.sizeof("int64_t"))
    assert.is_true(ffi.offsetof("eng_tensor", "storage") > ffi.offsetof("eng_tensor", "numel"))
  end)
end)

describe("engine host", function()
  local engine_bin = arg and arg[-1] or "build/engine"
  local function run(args)
    local p = io.popen(engine_bin .. " " .. args .. " 2>&1; echo \"rc=$?\"")
    local out = p:read("*a")
    p:close()
    return out, tonumber(out:match("rc=(%d+)%s*$"))
  end
  local is_host = engine_bin:match("engine$") ~= nil

  it("prints its version", function()
    if not is_host then return pending("not running under the engine host") end
    local out, rc = run("--version")
    assert.are.equal(0, rc)
    assert.truthy(out:match("^engine %d+%.%d+%.%d+"))
  end)

  it("runs -e code with arguments in arg", function()
    if not is_host then return pending("not running under the engine host") end
    local out, rc = run("-e 'print(arg[1], arg[2], require(\"engine\").ones(2):sum():item())' a b")
    assert.are.equal(0, rc)
    assert.truthy(out:match("a%s+b%s+2"))
  end)

  it("exits non-zero with a traceback on a Lua error", function()
    if not is_host then return pending("not running under the engine host") end
    local f = os.tmpname()
    local fh = io.open(f, "w")
    fh:write("local engine = require('engine')\nlocal function g() return engine.ones(2, 3) + engine.ones(4) end\ng()\n")
    fh:close()
    local out, rc = run(f)
    os.remove(f)
    assert.are.equal(1, rc)
    assert.truthy(out:match("do not broadcast"), out)
    assert.truthy(out:match("stack traceback"), out)
    assert.truthy(out:match(":2:"), "error should point at the recipe line: " .. out)
  end)

  it("exits quietly with the status of os.exit and of a nil error (busted's failure exit)", function()
    if not is_host then return pending("not running under the engine host") end
    local out, rc = run("-e 'print(\"before\"); os.exit(3)'")
    assert.are.equal(3, rc)
    assert.are.equal("before\nrc=3\n", out)
    out, rc = run("-e 'print(\"before\"); error()'")
    assert.are.equal(1, rc)
    assert.are.equal("before\nrc=1\n", out)
    -- a non-string error object is still reported, with a traceback
    out, rc = run("-e 'error({})'")
    assert.are.equal(1, rc)
    assert.truthy(out:match("error object is a table value"), out)
    assert.truthy(out:match("stack traceback"), out)
  end)

  it("exits non-zero for a missing script", function()
    if not is_host then return pending("not running under the engine host") end
    local out, rc = run("/nonexistent/recipe.lua")
    assert.are.equal(1, rc)
    assert.truthy(out:match("cannot open"), out)
  end)
end)
