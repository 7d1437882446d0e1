-- engine.cuda: the CUDA device runtime from Lua (eng/cuda.h).
--   engine.cuda.is_available()        true when a GPU is usable
--   engine.cuda.device_count()        usable GPUs (0 without)
--   engine.cuda.unavailable_reason()  "" or "CUDA is not available: <reason>"
--   engine.cuda.current_device()      0-based device of this process
--   engine.cuda.synchronize()         waits for all queued GPU work
--   engine.cuda.memory_stats()        the caching allocator's counters (bytes)
--   engine.cuda.empty_cache(), reset_peak_memory_stats(), mem_get_info()
--   engine.cuda.get_device_properties([d]), get_device_name([d])
local core = require("engine.core")
local ffi, C = core.ffi, core.C

local M = {}

function M.is_built() return C.eng_cuda_built() == 1 end
function M.is_available() return C.eng_cuda_is_available() == 1 end
function M.device_count() return tonumber(C.eng_cuda_device_count()) end
function M.unavailable_reason() return ffi.string(C.eng_cuda_unavailable_reason()) end
function M.runtime_version() return tonumber(C.eng_cuda_runtime_version()) end
function M.driver_version() return tonumber(C.eng_cuda_driver_version()) end

local function need(op)
  if C.eng_cuda_is_available() ~= 1 then core.fail("engine.cuda." .. op .. ": " .. M.unavailable_reason()) end
end

function M.current_device()
  need("current_device")
  local d = C.eng_cuda_current_device()
  if d < 0 then core.raise() end
  return d
end

function M.set_device(d)
  need("set_device")
  core.check(C.eng_cuda_set_device(d))
end

function M.synchronize()
  need("synchronize")
  core.check(C.eng_cuda_synchronize())
end

-- Deferred device error checks (docs/cuda.md, "No host synchronisation in a step"): the ops that may find bad
-- input on the GPU (embedding, cross entropy) do not read their flags back; check_errors() waits for the
-- pending checks and raises the first error with the op's message; poll_errors() raises the errors of the
-- kernels that have completed, without waiting (optimizers call it at each step); any host sync (item(),
-- synchronize(), a copy to the host) raises them too.  pending_checks(): how many are pending.
-- sync_count(): host synchronisations performed by the runtime so far (a training step should add none).
function M.check_errors() core.check(C.eng_cuda_check_errors()) end
function M.poll_errors() core.check(C.eng_cuda_poll_errors()) end
function M.pending_checks() return tonumber(C.eng_cuda_pending_checks()) end
function M.sync_count() return tonumber(C.eng_cuda_sync_count()) end

function M.get_device_properties(d)
  need("get_device_properties")
  local p = ffi.new("eng_cuda_device_props")
  core.check(C.eng_cuda_get_device_properties(d or M.current_device(), p))
  return { name = ffi.string(p.name), major = p.major, minor = p.minor, sm_count = p.sm_count,
    clock_khz = p.clock_khz, total_memory = tonumber(p.total_memory), l2_bytes = tonumber(p.l2_bytes) }
end

function M.get_device_name(d) return M.get_device_properties(d).name end

function M.memory_stats()
  local s = ffi.new("eng_cuda_memory_stats")
  core.check(C.eng_cuda_get_memory_stats(s))
  local r = {}
  for _, k in ipairs({ "allocated", "peak_allocated", "reserved", "n_device_allocs", "n_device_frees", "n_allocs",
    "n_cache_hits", "n_ooms", "pinned_reserved" }) do r[k] = tonumber(s[k]) end
  return r
end
function M.memory_allocated() return M.memory_stats().allocated end
function M.max_memory_allocated() return M.memory_stats().peak_allocated end
function M.reset_peak_memory_stats() C.eng_cuda_reset_peak() end

function M.empty_cache()
  need("empty_cache")
  collectgarbage(); collectgarbage()
  core.check(C.eng_cuda_empty_cache())
end

function M.mem_get_info()
  need("mem_get_info")
  local f = ffi.new("int64_t[2]")
  core.check(C.eng_cuda_mem_get_info(f, f + 1))
  return tonumber(f[0]), tonumber(f[1])
end

return M
