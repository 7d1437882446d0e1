-- engine.profiler / ENGINE_PROFILE: per-op calls, host time, GPU time and bytes, the table at
-- exit sorted by total time.  Child processes, since the timing wrapper is installed when the library loads.
local engine = require("engine")
local proc = require("spec.helpers.proc")

local function run(env, code)
  local home = rawget(_G, "ENGINE_HOME") or os.getenv("ENGINE_HOME") or "."
  assert(not code:find("'", 1, true), "the snippet goes inside single quotes")
  local f = io.popen(string.format("cd '%s' && env %s '%s' -e '%s' 2>&1; echo \"rc=$?\"", home, env, proc.self_exe(),
    code))
  local out = f:read("*a")
  f:close()
  return out, tonumber(out:match("rc=(%d+)%s*$"))
end

local BODY = [[
local e = require("engine")
local a = e.randn(64, 32):requires_grad_()
local b = e.randn(32, 16)
for _ = 1, 3 do (a:matmul(b)):sum():backward() end
]]

describe("profiler", function()
  it("ENGINE_PROFILE=1 prints the table at exit: each op's calls, times and bytes, by total time", function()
    local out, rc = run("ENGINE_PROFILE=1", BODY)
    assert.are.equal(0, rc, out)
    assert.matches("profile %(rank 0%): %d+ ops", out)
    assert.matches("op%s+calls%s+GPU ms%s+host ms%s+host us%s+MiB out", out)
    local calls = out:match("\nmatmul%s+(%d+)%s")
    assert.are.equal("3", calls, out)
    assert.is_truthy(out:match("\nMmBackward%s+3%s") or out:match("\n%w*Backward%s+3%s"), out)
    -- the matmul results: 3 x 64 x 16 f32 = 12 KiB
    local mib = tonumber(out:match("\nmatmul%s+%d+%s+[%d%.]+%s+[%d%.]+%s+[%d%.]+%s+([%d%.]+)"))
    assert.is_true(math.abs(mib - 3 * 64 * 16 * 4 / 1048576) < 0.01, out)
    -- sorted by total time: the first data row has the largest host time
    local times = {}
    for t in out:gmatch("\n[%w_]+%s+%d+%s+[%d%.]+%s+([%d%.]+)") do times[#times + 1] = tonumber(t) end
    assert.is_true(#times >= 3)
    for i = 2, #times do assert.is_true(times[i] <= times[i - 1], out) end
  end)

  it("without ENGINE_PROFILE nothing is timed or printed", function()
    local out, rc = run("", BODY .. [[print("n=" .. #e.profiler.entries())]])
    assert.are.equal(0, rc, out)
    assert.is_nil(out:match("profile %(rank"))
    assert.matches("n=0", out)
  end)

  it("ENGINE_PROFILE=0 installs without recording; enable/disable/reset/entries/report in the script", function()
    local code = BODY:gsub("for _ = 1, 3", "local p = e.profiler\nassert(p.installed() and not p.enabled())\n"
      .. "for _ = 1, 2 do (a:matmul(b)):sum():backward() end\np.enable()\nfor _ = 1, 3") .. [[
p.disable()
for _ = 1, 5 do a:matmul(b) end
local n
for _, x in ipairs(p.entries()) do if x.name == "matmul" then n = x.calls end end
print("matmul calls " .. tostring(n))
assert(p.report():match("profile %(rank 0%)"))
p.reset()
print("after reset " .. #p.entries())
]]
    local out, rc = run("ENGINE_PROFILE=0", code)
    assert.are.equal(0, rc, out)
    assert.matches("matmul calls 3", out)
    assert.matches("after reset 0", out)
    assert.is_nil(out:match("profile %(rank 0%): "), "nothing at exit when started with ENGINE_PROFILE=0")
  end)

  it("on a GPU the CUDA ops get GPU time from events #gpu", function()
    if not engine.cuda.is_available() then pending("no GPU: " .. engine.cuda.unavailable_reason()) end
    local code = [[
local e = require("engine")
local a = e.randn(512, 512):cuda()
for _ = 1, 4 do a = a:matmul(a) / 512 end
e.cuda.synchronize()
for _, x in ipairs(e.profiler.entries()) do
  if x.name == "matmul" then print(string.format("matmul %d %d %.6f", x.calls, x.gpu_calls, x.gpu_ms)) end
end
]]
    local out, rc = run("ENGINE_PROFILE=0", (code:gsub("local a =", "e.profiler.enable()\nlocal a =")))
    assert.are.equal(0, rc, out)
    local calls, gcalls, gms = out:match("matmul (%d+) (%d+) ([%d%.]+)")
    assert.are.equal("4", calls, out)
    assert.are.equal("4", gcalls, out)
    assert.is_true(tonumber(gms) > 0, out)
  end)
end)
