-- engine: the Lua library of the training engine.
--   local engine = require("engine")
--   local nn, optim, dist = engine.nn, engine.optim, engine.distributed
local core = require("engine.core")
local Tensor = require("engine.tensor")
local autograd = require("engine.autograd")
local C = core.C

C.eng_runtime_init()

local engine = {}
for k, v in pairs(Tensor.functions) do engine[k] = v end

-- Op families register their methods and functions.
for _, mod in ipairs({ "pointwise", "reduce", "shape", "nn", "random", "io", "index", "linalg", "loss", "math" }) do
  local ok, err = pcall(require, "engine.ops." .. mod)
  if not ok and not tostring(err):match("module 'engine.ops." .. mod .. "' not found") then error(err, 0) end
  -- namespace tables (engine.linalg) may get functions from several families: merged
  if ok and type(err) == "table" then
    for k, v in pairs(err) do
      if type(v) == "table" and type(engine[k]) == "table" and getmetatable(v) == nil then
        for kk, vv in pairs(v) do engine[k][kk] = vv end
      else engine[k] = v end
    end
  end
end

engine.Tensor = Tensor
engine.autograd = autograd
engine.no_grad = autograd.no_grad
engine.enable_grad = autograd.enable_grad
engine.is_grad_enabled = autograd.is_grad_enabled
engine.set_grad_enabled = autograd.set_grad_enabled
engine.version = core.ffi.string(C.eng_version())
engine.C = C
engine.ffi = core.ffi

function engine.set_num_threads(n) core.check(C.eng_set_num_threads(n)) end
function engine.get_num_threads() return C.eng_get_num_threads() end
function engine.blas_corename() return core.ffi.string(C.eng_blas_corename()) end
-- Why that core runs ("CPU has AVX-512; OpenBLAS picked Prescott"); engine.blas_core() gives both, for log lines.
function engine.blas_core_reason() return core.ffi.string(C.eng_blas_core_reason()) end
function engine.blas_core() return engine.blas_corename() .. " (" .. engine.blas_core_reason() .. ")" end
-- The library f32 GEMMs run on and why: "oneDNN 2.6.3 for f32, OpenBLAS for f64" when libdnnl2 is present, else
-- "OpenBLAS (...)"; ENGINE_GEMM=openblas keeps OpenBLAS (kernels/cpu/gemm.c).
function engine.gemm_library() return core.ffi.string(core.C.eng_gemm_library()) end
function engine.time() return C.eng_time() end
-- A safetensors file of full tensors into tensors of any layout (dist.checkpoint.load_safetensors).
function engine.load_safetensors(...) return require("engine.distributed").checkpoint.load_safetensors(...) end

-- Memory: the caching allocator's statistics (bytes).
function engine.memory_stats()
  local s = core.ffi.new("eng_alloc_stats")
  C.eng_alloc_get_stats(s)
  return { allocated = tonumber(s.allocated), peak_allocated = tonumber(s.peak_allocated),
    reserved = tonumber(s.reserved), n_system_allocs = tonumber(s.n_system_allocs),
    n_allocs = tonumber(s.n_allocs),
    -- collector pressure (engine.set_gc_threshold): bytes of live tensor storages (CPU and CUDA), the
    -- threshold past which the next tensor wrapped runs a collection, collections so far and their seconds
    gc_bytes = tonumber(C.eng_alloc_gc_bytes()), gc_threshold = tonumber(C.eng_alloc_get_gc_threshold()),
    gc_collections = core.gc.collections, gc_seconds = core.gc.seconds,
    gc_backward_collections = core.gc.backward_collections or 0 }
end
-- Collections driven by tensor memory: engine.set_gc_threshold{ratio = 2, min_bytes = 64 MiB,
-- max_fraction = 0.01, backward = 4 (MiB)} (see lua/engine/core.lua); returns the previous settings.
engine.set_gc_threshold = core.set_gc_threshold
function engine.reset_peak_memory() C.eng_alloc_reset_peak() end
function engine.empty_cache() collectgarbage(); collectgarbage(); C.eng_alloc_empty_cache() end
function engine.live_tensors() return tonumber(C.eng_tensor_live_count()) end

-- Lazily loaded sub-libraries.
local lazy = { nn = "engine.nn", optim = "engine.optim", data = "engine.data", cuda = "engine.cuda",
  distributed = "engine.distributed", models = "engine.models", profiler = "engine.profiler", hf = "engine.hf" }
setmetatable(engine, { __index = function(t, k)
  local m = lazy[k]
  if m then local v = require(m); rawset(t, k, v); return v end
end })

return engine
