-- The BLAS kernels the engine host chooses from the CPU's features (engine/src/core/blas_core.c, docs/design.md
-- "BLAS kernels"): on a CPU with AVX-512 an AVX-512 core runs, whatever OpenBLAS picked by itself or from a preset
-- OPENBLAS_CORETYPE; ENGINE_BLAS_CORETYPE=keep keeps a preset; and sgemm on the chosen core runs at least 60% as fast
-- as on the best core measured in the same run (a ratio of two child processes' best-of timings, not a time).
-- Each case runs `engine` as a child with its own environment: OpenBLAS reads OPENBLAS_CORETYPE once, when it loads.
local proc = require("spec.helpers.proc")

local function cpu_flags()
  local f = io.open("/proc/cpuinfo", "r")
  local t = {}
  if not f then return t end
  local s = f:read("*a")
  f:close()
  for w in (s:match("flags%s*:%s*([^\n]*)") or ""):gmatch("%S+") do t[w] = true end
  return t
end
local flags = cpu_flags()
local x86 = flags.sse2 ~= nil
local avx512 = flags.avx512f and flags.avx512bw and flags.avx512vl and flags.avx512dq
local avx2 = flags.avx2 and flags.fma
local AVX512_CORES = { skylakex = true, cooperlake = true, sapphirerapids = true }
local function is_avx512_core(name) return AVX512_CORES[name:lower()] == true end

-- The child: the core, why, and with "bench" the best-of GFLOP/s of a 512x512 f32 matmul on one thread.
local CHILD = [[
local e = require("engine")
io.write("core=", e.blas_corename(), "\nwhy=", e.blas_core_reason(), "\n")
if arg[1] == "bench" then
  e.set_num_threads(1)
  local n = 512
  local a, b = e.randn(n, n), e.randn(n, n)
  for _ = 1, 3 do a:matmul(b) end
  local best = math.huge
  for _ = 1, 15 do
    local t0 = e.time()
    a:matmul(b)
    local dt = e.time() - t0
    if dt < best then best = dt end
  end
  io.write(string.format("gflops=%.3f\n", 2 * n ^ 3 / best / 1e9))
end
]]

local function child(env, bench)
  local sets = {}
  for k, v in pairs(env) do sets[#sets + 1] = string.format("%s='%s'", k, v) end
  table.sort(sets)
  -- The variables that choose the core are unset unless env sets them.
  local out = proc.snippet(CHILD, { "OPENBLAS_CORETYPE", "ENGINE_BLAS_CORETYPE", "ENGINE_BLAS_REEXEC",
    "ENGINE_BLAS_NOBETTER" }, table.concat(sets, " "), bench and "bench" or "")
  local r = { core = out:match("core=([^\n]*)"), why = out:match("why=([^\n]*)"),
    gflops = tonumber(out:match("gflops=([%d%.]+)")) }
  assert(r.core and r.why, "no core reported: " .. out)
  return r
end

-- The best core for this CPU's features that this OpenBLAS accepts by name (as the host's list orders them).
local accepted_cache = {}
local function accepted(name)
  if accepted_cache[name] == nil then
    accepted_cache[name] = child({ ENGINE_BLAS_CORETYPE = name }).core:lower() == name:lower()
  end
  return accepted_cache[name]
end
local function best_core()
  local list = {}
  if avx512 and flags.avx512_bf16 and flags.amx_bf16 and flags.amx_tile then list[#list + 1] = "SapphireRapids" end
  if avx512 and flags.avx512_bf16 then list[#list + 1] = "Cooperlake" end
  if avx512 then list[#list + 1] = "SkylakeX" end
  if avx2 then list[#list + 1] = "Haswell" end
  for _, name in ipairs(list) do
    if accepted(name) then return name end
  end
end

-- The sgemm runs, interleaved over two rounds (each configuration keeps its best), once per spec run.
local runs
local function measure()
  if runs then return runs end
  local configs = {
    default = {},
    preset_prescott = { OPENBLAS_CORETYPE = "Prescott" },
    keep_prescott = { OPENBLAS_CORETYPE = "Prescott", ENGINE_BLAS_CORETYPE = "keep" },
  }
  if avx512 then configs.skylakex = { ENGINE_BLAS_CORETYPE = "SkylakeX" } end
  if avx512 and flags.avx512_bf16 then configs.cooperlake = { ENGINE_BLAS_CORETYPE = "Cooperlake" } end
  if avx2 and not avx512 then configs.haswell = { ENGINE_BLAS_CORETYPE = "Haswell" } end
  local names = {}
  for k in pairs(configs) do names[#names + 1] = k end
  table.sort(names)
  runs = {}
  for _ = 1, 2 do
    for _, k in ipairs(names) do
      local r = child(configs[k], true)
      if not runs[k] or r.gflops > runs[k].gflops then runs[k] = r end
    end
  end
  local line = {}
  for _, k in ipairs(names) do line[#line + 1] = string.format("%s %s %.1f", k, runs[k].core, runs[k].gflops) end
  io.stderr:write("\nblas_core_spec: sgemm 512 GFLOP/s (1 thread, best of 15 x 2): ", table.concat(line, "; "), "\n")
  return runs
end

describe("BLAS core selection", function()
  local is_host = proc.self_exe():match("engine$") ~= nil

  teardown(function() proc.remove_snippets() end)

  it("names the core in use and why", function()
    local engine = require("engine")
    assert.is_string(engine.blas_corename())
    assert.truthy(#engine.blas_core_reason() > 0)
    assert.are.equal(engine.blas_corename() .. " (" .. engine.blas_core_reason() .. ")", engine.blas_core())
  end)

  it("chooses an AVX-512 core on a CPU with AVX-512 (OPENBLAS_CORETYPE unset)", function()
    if not is_host then return pending("not running under the engine host") end
    if not avx512 then return pending("the CPU has no AVX-512 (avx512f/bw/vl/dq not all in /proc/cpuinfo flags)") end
    local r = child({})
    assert.is_true(is_avx512_core(r.core), r.core .. " (" .. r.why .. ")")
    local engine = require("engine")
    local pref = os.getenv("ENGINE_BLAS_CORETYPE")
    if not pref or pref == "" or pref == "auto" then -- this process too, whatever the suite's environment preset
      assert.is_true(is_avx512_core(engine.blas_corename()), engine.blas_core())
    end
  end)

  it("ends on the best core for the CPU's features when OPENBLAS_CORETYPE=Prescott is preset", function()
    if not is_host then return pending("not running under the engine host") end
    if not avx2 then return pending("the CPU has neither AVX-512 nor AVX2+FMA: Prescott may be its best core") end
    local r = child({ OPENBLAS_CORETYPE = "Prescott" })
    local want = best_core()
    assert.is_string(want, "this OpenBLAS accepts none of the cores for the CPU's features")
    assert.are.equal(want:lower(), r.core:lower(), r.why)
    assert.truthy(r.why:match("OpenBLAS picked Prescott"), r.why)
    if avx512 then assert.is_true(is_avx512_core(r.core)) end
  end)

  it("keeps a preset core with ENGINE_BLAS_CORETYPE=keep", function()
    if not is_host then return pending("not running under the engine host") end
    if not x86 then return pending("not an x86 CPU: OpenBLAS has no Prescott core here") end
    local r = child({ OPENBLAS_CORETYPE = "Prescott", ENGINE_BLAS_CORETYPE = "keep" })
    assert.are.equal("Prescott", r.core)
    assert.truthy(r.why:match("ENGINE_BLAS_CORETYPE=keep"), r.why)
  end)

  it("ignores an explicit core the CPU cannot run", function()
    if not is_host then return pending("not running under the engine host") end
    if not x86 then return pending("not an x86 CPU") end
    if flags.amx_bf16 and flags.amx_tile then return pending("the CPU has AMX: every x86 core can run here") end
    local r = child({ ENGINE_BLAS_CORETYPE = "SapphireRapids" })
    assert.are_not.equal("sapphirerapids", r.core:lower())
    assert.truthy(r.why:match("ENGINE_BLAS_CORETYPE=SapphireRapids ignored"), r.why)
  end)

  it("runs sgemm on the chosen core at >= 60% of the best core measured here", function()
    if not is_host then return pending("not running under the engine host") end
    if not avx2 then return pending("the CPU has neither AVX-512 nor AVX2+FMA: no better core to compare with") end
    local m = measure()
    local best, best_k = 0, nil
    for k, r in pairs(m) do
      if r.gflops > best then best, best_k = r.gflops, k end
    end
    for _, k in ipairs({ "default", "preset_prescott" }) do
      local ratio = m[k].gflops / best
      assert.is_true(ratio >= 0.6, string.format("%s (%s, %s): %.1f GFLOP/s, %.2f of %s's %.1f", k, m[k].core,
        m[k].why, m[k].gflops, ratio, best_k, best))
    end
  end)
end)
