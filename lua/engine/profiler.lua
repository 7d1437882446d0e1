-- engine.profiler: per-op host and GPU time, like torch.profiler's key_averages() (engine/include/eng/profiler.h).
--
--   ENGINE_PROFILE=1 build/engine recipes/bench/gpu_step.lua    -- the table is printed (stderr, rank 0) at exit
--   ENGINE_PROFILE=all mpirun -np 2 ...                          -- every rank prints its own
--   ENGINE_PROFILE_KERNELS=1 build/engine ...                  -- each GPU kernel's own time (CUPTI), table at exit
--   ENGINE_PROFILE=0 build/engine script.lua                     -- installed, not recording: in the script,
--     engine.profiler.enable(); ...; engine.profiler.disable(); print(engine.profiler.report())
--
-- What is timed: every call the Lua API makes to a function declared in the op headers (ops_*.h, optim.h, rng.h),
-- the collectives, redistribute, from_local / to_local and the device copies (named without their eng_ prefix, e.g. "matmul",
-- "pg_all_reduce"), and every autograd node's backward by its name ("MmBackward"); host time from call to return and,
-- on a GPU, the time between events recorded on the compute stream around the call.  The calls are intercepted at
-- the FFI when the library loads, so ENGINE_PROFILE must be set at launch; enable() / disable() then start and stop
-- recording.  Columns: op, calls, GPU ms, host ms, host us per call, MiB of the tensors returned.
local M = {}

local ffi = require("ffi")

-- The functions to time: those the op headers declare, and a few more.
local HEADERS = { "ops_pointwise.h", "ops_reduce.h", "ops_shape.h", "ops_nn.h", "ops_math.h", "ops_index.h", "optim.h",
  "rng.h" }
local EXTRA_PATTERNS = { "^eng_pg_all_", "^eng_pg_reduce_scatter", "^eng_pg_broadcast$", "^eng_pg_gather",
  "^eng_pg_scatter", "^eng_dtensor_redistribute", "^eng_dtensor_full_tensor$", "^eng_dtensor_distribute_tensor$",
  "^eng_dtensor_from_local$", "^eng_dtensor_to_local$",
  "^eng_tensor_to_device$", "^eng_tensor_to_dtype$", "^eng_tensor_contiguous$", "^eng_tensor_clone$",
  "^eng_tensor_copy_$", "^eng_tensor_fill_$", "^eng_tensor_zero_$", "^eng_backward$", "^eng_work_wait$" }

local function timed_names(home)
  local set = {}
  for _, h in ipairs(HEADERS) do
    local f = io.open(home .. "/engine/include/eng/" .. h, "r")
    if f then
      for name in f:read("*a"):gmatch("(eng_[%w_]+)%s*%(") do set[name] = true end
      f:close()
    end
  end
  return set
end

local function extra(name)
  for _, p in ipairs(EXTRA_PATTERNS) do if name:match(p) then return true end end
  return false
end

-- proxy(C, home) -> a table that resolves symbols like C, with the timed functions wrapped (engine/ffi.lua installs
-- it when ENGINE_PROFILE is set).
function M.proxy(C, home)
  local names = timed_names(home)
  local begin, finish, dsize = C.eng_profiler_begin, C.eng_profiler_end, C.eng_dtype_size
  local tensor_ptr = ffi.typeof("eng_tensor*")
  local function bytes(r)
    if r ~= nil and ffi.istype(tensor_ptr, r) then return tonumber(r.numel) * dsize(r.dtype) end
    return 0
  end
  return setmetatable({}, { __index = function(t, k)
    local f = C[k]
    if type(k) == "string" and (names[k] or extra(k)) and type(f) == "cdata" then
      local label = k:sub(5)
      local w = function(...)
        local tok = begin(label)
        local r = f(...)
        if tok >= 0 then finish(tok, bytes(r)) end
        return r
      end
      rawset(t, k, w)
      return w
    end
    rawset(t, k, f)
    return f
  end })
end

local function C() return require("engine.ffi").C end

function M.installed() return rawget(_G, "ENGINE_PROFILE_INSTALLED") == true end
function M.enable() C().eng_profiler_enable(1, 0) end
function M.disable() C().eng_profiler_enable(0, 0) end
function M.enabled() return C().eng_profiler_enabled() ~= 0 end
function M.reset() C().eng_profiler_reset() end

-- entries() -> {{name, calls, host_ms, gpu_ms, gpu_calls, bytes}, ...} by total time
function M.entries()
  local c = C()
  local n = c.eng_profiler_entries(nil, 0)
  local buf = ffi.new("eng_profile_entry[?]", math.max(n, 1))
  n = c.eng_profiler_entries(buf, n)
  local r = {}
  for i = 0, n - 1 do
    local e = buf[i]
    r[#r + 1] = { name = ffi.string(e.name), calls = tonumber(e.calls), host_ms = tonumber(e.host_ns) / 1e6,
      gpu_ms = tonumber(e.gpu_ns) / 1e6, gpu_calls = tonumber(e.gpu_calls), bytes = tonumber(e.bytes) }
  end
  return r
end

-- the text a C report function (buf, cap) -> length writes
local function text_of(fn)
  local n = tonumber(fn(nil, 0))
  local buf = ffi.new("char[?]", n + 1)
  fn(buf, n + 1)
  return ffi.string(buf)
end

-- report() -> the table as text
function M.report() return text_of(C().eng_profiler_report) end

-- The kernel trace (eng/cuda.h): every kernel, memcpy and memset the GPU ran, with its own GPU time from CUPTI,
-- summed by name (what nsys's cuda_gpu_kern_sum shows).  ENGINE_PROFILE_KERNELS=1 at launch starts it with the device
-- and prints the table at exit; in a script: engine.profiler.kernel_trace() (raises the reason when there is no GPU
-- or no libcupti), then kernel_report() -> the table as text, kernel_reset() to start counting again.
function M.kernel_trace()
  local c = C()
  if c.eng_cuda_kernel_trace_start() ~= 0 then error(ffi.string(c.eng_last_error()), 2) end
end
function M.kernel_trace_active() return C().eng_cuda_kernel_trace_active() ~= 0 end
function M.kernel_reset() C().eng_cuda_kernel_trace_reset() end
function M.kernel_report() return text_of(C().eng_cuda_kernel_trace_report) end

return M
