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

  it("without a GPU the kernel trace says why, and ENGINE_PROFILE_KERNELS=1 does not stop a CPU run", function()
    if engine.cuda.is_available() then pending("a GPU is here: the #gpu case covers the trace") end
    local ok, err = pcall(engine.profiler.kernel_trace)
    assert.is_false(ok)
    assert.matches("kernel trace: .*CUDA", tostring(err))
    assert.is_false(engine.profiler.kernel_trace_active())
    assert.matches("kernel trace: not started", engine.profiler.kernel_report())
    local out, rc = run("ENGINE_PROFILE_KERNELS=1", BODY .. [[print("done")]])
    assert.are.equal(0, rc, out)
    assert.matches("done", out)
    assert.is_nil(out:match("kernels %(rank"), out)
  end)

  it("ENGINE_PROFILE_KERNELS=1 prints each kernel's own GPU time at exit (CUPTI) #gpu", function()
    if not engine.cuda.is_available() then pending("no GPU: " .. engine.cuda.unavailable_reason()) end
    local code = [[
local e = require("engine")
local a = e.randn(512, 512):cuda()
for _ = 1, 4 do a = a:matmul(a) / 512 end
local h = a:cpu()
print("active " .. tostring(e.profiler.kernel_trace_active()))
]]
    local out, rc = run("ENGINE_PROFILE_KERNELS=1", code)
    assert.are.equal(0, rc, out)
    if out:match("kernel trace did not start: kernel trace: libcupti could not be loaded") then
      pending("no libcupti on this machine: " .. out)
    end
    assert.matches("active true", out)
    assert.matches("kernels %(rank 0%): %d+ names", out)
    assert.matches("kernel%s+calls%s+GPU ms%s+avg us%s+min us%s+max us%s+share", out)
    -- the 4 scalings by 1/512 are one elementwise kernel each; the copy back is one DtoH memcpy at least
    local copies = tonumber(out:match("%[memcpy DtoH%]%s+(%d+)%s"))
    assert.is_true(copies ~= nil and copies >= 1, out)
    local launches = tonumber(out:match("names, (%d+) launches"))
    assert.is_true(launches >= 9, out) -- 4 GEMMs, 4 divisions, the copies and the random fill
    -- in the script: reset, more work, the report counts only that
    local out2, rc2 = run("", [[
local e = require("engine")
e.profiler.kernel_trace()
local a = e.randn(256, 256):cuda()
e.profiler.kernel_reset()
for _ = 1, 3 do a = a:matmul(a) / 256 end
local r = e.profiler.kernel_report()
print(r)
local n = tonumber(r:match("names, (%d+) launches"))
print("n " .. n)
]])
    assert.are.equal(0, rc2, out2)
    local n = tonumber(out2:match("\nn (%d+)"))
    assert.is_true(n ~= nil and n >= 6, out2)
  end)
end)
