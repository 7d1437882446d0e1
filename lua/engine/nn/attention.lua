-- engine.nn.attention: which implementation scaled_dot_product_attention runs (PyTorch's torch.nn.attention).
--
--   local attention = require("engine").nn.attention
--   local out = attention.sdpa_kernel("math", function() return model(x) end)   -- fn's results
--   attention.sdpa_kernel({ "flash", "math" }, fn)                             -- a list: the kernels where they apply
--
-- Backends (attention.SDPBackend): "flash" (FLASH_ATTENTION: the engine's fused kernels, the default; on CUDA the
-- math path still runs what they do not take: an attn_mask, dropout, f64, other ranks or head dims) and "math"
-- (MATH: the composition of matmul, softmax and dropout ops, PyTorch's _scaled_dot_product_attention_math, on every
-- device; the same dropout masks as the kernels for the same generator state).  The choice is process-wide and is
-- restored when fn returns or raises, as PyTorch's context manager restores it on exit.
local core = require("engine.core")
local C = core.C

local M = {}

M.SDPBackend = { FLASH_ATTENTION = "flash", MATH = "math" }

local CODE = { flash = 0, math = 1 }

-- The backend code for a name or a list of names (the fused kernels when "flash" is allowed).
local function backend_code(b)
  if type(b) == "string" then
    local c = CODE[b]
    if not c then error(string.format("sdpa_kernel: unknown backend %q (\"flash\" or \"math\")", b), 3) end
    return c
  end
  if type(b) ~= "table" or #b == 0 then
    error("sdpa_kernel: expected a backend name or a non-empty list of names (\"flash\", \"math\"), got "
      .. type(b), 3)
  end
  local code = 1
  for i = 1, #b do
    if backend_code(b[i]) == 0 then code = 0 end
  end
  return code
end

-- sdpa_kernel(backends, fn, ...) -> fn(...)'s results, run with the given backends.
function M.sdpa_kernel(backends, fn, ...)
  local code = backend_code(backends)
  if type(fn) ~= "function" then error("sdpa_kernel: expected a function to run, got " .. type(fn), 2) end
  local prev = C.eng_sdpa_get_backend()
  C.eng_sdpa_set_backend(code)
  local res = { pcall(fn, ...) }
  C.eng_sdpa_set_backend(prev)
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

-- The backend in use: "flash" or "math".
function M.current_backend() return C.eng_sdpa_get_backend() == 1 and "math" or "flash" end

return M
