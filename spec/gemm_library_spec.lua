-- The GEMM library of f32 products (kernels/cpu/gemm.c): oneDNN's sgemm when libdnnl.so.2 loads (Debian's
-- libdnnl2, which tools/install-deps.sh installs), else OpenBLAS; ENGINE_GEMM=openblas keeps OpenBLAS, an unknown
-- value says so and keeps OpenBLAS.  Products agree with float64 to f32 rounding (split over the pool, transposed
-- operands), a linear's output has no NaN, and no OpenMP threads are started beside the engine's own.
-- Each case runs `engine` as a child: the library is chosen once per process.
local proc = require("spec.helpers.proc")

local CHILD = [[
local e = require("engine")
io.write("lib=", e.gemm_library(), "\n")
e.manual_seed(3)
local a, b = e.randn(70, 300), e.randn(300, 90)
local c = a:matmul(b)                              -- 2 threads: split over the pool
local at, bt = a:t():contiguous(), b:t():contiguous()
local c2 = at:t():matmul(bt:t())                   -- transposed operands
local ref = a:double():matmul(b:double())
local function rel(x) return ((x:double() - ref):abs():max() / ref:abs():max()):item() end
io.write(string.format("err=%.3e err_t=%.3e\n", rel(c), rel(c2)))
local l = e.nn.functional.linear(a, b:t():contiguous())
io.write("nan=", l:ne(l):sum():item(), "\n")
local f = io.open("/proc/self/status")
local threads = f and f:read("*a"):match("Threads:%s*(%d+)") or "?"
if f then f:close() end
io.write("threads=", threads, " engine_threads=", e.get_num_threads(), "\n")
]]

local function child(env)
  local out = proc.snippet(CHILD, { "ENGINE_GEMM" }, env)
  return { lib = out:match("lib=([^\n]*)"), err = tonumber(out:match("err=(%S+)")),
    err_t = tonumber(out:match("err_t=(%S+)")), nan = tonumber(out:match("nan=(%d+)")),
    threads = tonumber(out:match("threads=(%d+)")), engine_threads = tonumber(out:match("engine_threads=(%d+)")) }
end

local function have_dnnl()
  local p = io.popen("ldconfig -p 2>/dev/null | grep -c 'libdnnl.so.2 '")
  local n = p and tonumber(p:read("*a")) or 0
  if p then p:close() end
  return n > 0
end

describe("GEMM library of f32 products", function()
  local is_host = proc.self_exe():match("engine$") ~= nil
  teardown(function() proc.remove_snippets() end)

  it("oneDNN when libdnnl2 is installed, OpenBLAS otherwise; products agree with float64", function()
    if not is_host then return pending("not running under the engine host") end
    local r = child()
    if have_dnnl() then
      assert.truthy(r.lib:match("^oneDNN %d+%.%d+%.%d+ for f32, OpenBLAS for f64$"), r.lib)
    else
      assert.truthy(r.lib:match("^OpenBLAS %(oneDNN's libdnnl.so.2 not found: apt%-get install libdnnl2%)$"), r.lib)
    end
    assert.is_true(r.err < 1e-5 and r.err_t < 1e-5, string.format("%g %g", r.err, r.err_t))
    assert.are.equal(0, r.nan)
  end)

  it("ENGINE_GEMM=openblas keeps OpenBLAS, an unknown value says so; the products agree", function()
    if not is_host then return pending("not running under the engine host") end
    local r = child("ENGINE_GEMM=openblas")
    assert.are.equal("OpenBLAS (ENGINE_GEMM=openblas)", r.lib)
    assert.is_true(r.err < 1e-5 and r.err_t < 1e-5)
    r = child("ENGINE_GEMM=mkl")
    assert.are.equal("OpenBLAS (ENGINE_GEMM=mkl is not openblas, onednn or auto)", r.lib)
  end)

  it("starts no OpenMP threads beside the engine's pool", function()
    if not is_host then return pending("not running under the engine host") end
    local a, b = child("ENGINE_GEMM=openblas"), child()
    assert.are.equal(a.threads, b.threads, string.format("threads with OpenBLAS %d, with %s %d", a.threads, b.lib,
      b.threads))
  end)
end)
