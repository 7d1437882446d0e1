-- recipes/bench/gpu_step.lua: GPU training-step throughput of a GPT-2-small-shaped model against PyTorch.
--
--   build/engine recipes/bench/gpu_step.lua [--model=gpt|llama] [--steps=20] [--warmup=5] [--batch=8] [--seq=1024]
--       [--n_layers=12] [--dim=768] [--n_heads=12] [--n_kv_heads=4] [--vocab=50304] [--torch=1] [--compile=1]
--       [--peak_n=8192] [--tp1=1]
--
-- --model=llama: engine.nn.Llama at a comparable size (12 layers, dim 768, 12 query heads over 4 k/v heads, SwiGLU
-- hidden 2048, RMSNorm, rotary positions, untied output; about 153M parameters), loss F.fused_classifier on its
-- bf16 logits; PyTorch runs the same Llama (tools/bench_gpu_torch.py --model=llama).
-- --tp1=1 also times the model under its DTensor tensor-parallel plan on a CUDA mesh of one rank
-- (Transformer.parallelize / Llama.parallelize): the host cost of DTensor dispatch on a GPU step (target <= 1.03x
-- the plain step, issue 27).
--
-- Model: engine.nn.Transformer (common_dtensor.py's architecture: learned position embeddings, pre-LayerNorm blocks,
-- bias-free attention projections (one fused QKV GEMM), 4x GELU MLP (tanh, as GPT-2), tied output weights) with 12 layers, dim 768, 12 heads,
-- seq 1024, vocab 50304, dropout 0; parameters, activations and AdamW states in bf16; random tokens; batch 8.
-- One step = forward + cross entropy + backward + AdamW step + zero_grad, timed to a device sync.  The engine's
-- loss is model(x, y): the fused classifier on the bf16 logits (F.fused_classifier, f32 loss).
--
-- Prints, in one run on the same GPU:
--   1. the device and its measured bf16 peak: the best of a few 8192^3 bf16 GEMMs through the engine's
--      cuBLASLt path (kernels/cuda/gemm.cu), in TFLOP/s;
--   2. engine: median tokens/s and MFU, with
--        FLOPs per token = 6 * params + 12 * n_layers * dim * seq   (PaLM / nanoGPT estimate; tied weights
--        counted once), MFU = FLOPs per token * tokens/s / measured peak;
--   3. PyTorch (tools/bench_gpu_torch.py, the same model written in torch, F.scaled_dot_product_attention,
--      fused AdamW): eager and torch.compile, tokens/s and MFU over the same peak;
--   4. the ratios against issue 28's targets (>= 1.3x eager, >= 1.0x compile, MFU >= 40% of the datasheet peak,
--      peak memory <= eager's), then the line
--        gpu_step: engine <E> tok/s, eager <P> tok/s, compile <C> tok/s, engine/compile <R>, MFU <M>%
--      (MFU against the datasheet peak), which tools/gpu-check.sh copies into the run summary.
-- Without a GPU (or without the CUDA backend) it says so and exits with status 0: nothing to measure.
local engine = require("engine")
local ffi = require("ffi")
local nn, optim = engine.nn, engine.optim
local F = nn.functional
local C = engine.C

local o = { model = "gpt", steps = 20, warmup = 5, batch = 8, seq = 1024, n_layers = 12, dim = 768, n_heads = 12,
  n_kv_heads = 4, vocab = 50304, torch = 1, compile = 1, peak_n = 8192, tp1 = 1,
  gelu = "tanh" }   -- GPT-2's GELU (PyTorch's approximate="tanh")
local U = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/util.lua")
U.parse_args("bench/gpu_step", o, arg)
if o.model ~= "gpt" and o.model ~= "llama" then
  require("engine.cli").usage_error("bench/gpu_step", "--model must be gpt or llama, got '%s'", tostring(o.model))
end
local models = require("engine.models")

if C.eng_cuda_is_available() ~= 1 then
  print("bench/gpu_step: no GPU, nothing to measure: " .. ffi.string(C.eng_cuda_unavailable_reason()))
  print("bench/gpu_step: run it on a machine with an NVIDIA GPU and a CUDA build (see docs/cuda.md)")
  return
end

local function median(t)
  local s = { unpack(t) }
  table.sort(s)
  local n = #s
  return n % 2 == 1 and s[(n + 1) / 2] or 0.5 * (s[n / 2] + s[n / 2 + 1])
end
local function check(rc) if rc ~= 0 then error("bench/gpu_step: " .. ffi.string(C.eng_last_error()), 0) end end

-- ---------------------------------------------------------------- 1. device and bf16 peak
local props = ffi.new("eng_cuda_device_props")
local dev = C.eng_cuda_current_device()
check(C.eng_cuda_get_device_properties(dev, props))
print(string.format("bench/gpu_step: %s, device %d: %s (sm_%d%d, %d SMs, %.1f GiB), CUDA runtime %d, driver %d",
  engine.version, dev, ffi.string(props.name), props.major, props.minor, props.sm_count,
  tonumber(props.total_memory) / 2 ^ 30, C.eng_cuda_runtime_version(), C.eng_cuda_driver_version()))

do -- declarations of kernels/cuda/kcuda.h (preprocessor lines and C++ guards dropped)
  local f = assert(io.open((ENGINE_HOME or ".") .. "/kernels/cuda/kcuda.h"))
  local src = f:read("*a")
  f:close()
  local out, skip = {}, {}
  for line in (src .. "\n"):gmatch("([^\n]*)\n") do
    local d = line:match("^%s*#%s*(%a+)")
    if d == "ifdef" or d == "ifndef" or d == "if" then skip[#skip + 1] = line:match("__cplusplus") ~= nil
    elseif d == "endif" then skip[#skip] = nil
    elseif not d then
      local active = true
      for i = 1, #skip do if skip[i] then active = false end end
      if active then out[#out + 1] = line end
    end
  end
  pcall(ffi.cdef, "typedef struct CUstream_st* cudaStream_t;")
  pcall(ffi.cdef, table.concat(out, "\n"))
end

local function measure_peak(n)
  local ctx = ffi.cast("kcu_gemm_ctx*", C.eng_cuda_gemm_context())
  if ctx == nil then error("bench/gpu_step: " .. ffi.string(C.eng_last_error()), 0) end
  local bytes = n * n * 2
  local A, B, Cm = C.eng_cuda_malloc(bytes), C.eng_cuda_malloc(bytes), C.eng_cuda_malloc(bytes)
  if A == nil or B == nil or Cm == nil then error("bench/gpu_step: " .. ffi.string(C.eng_last_error()), 0) end
  check(C.eng_cuda_memset(A, 0x3c, bytes)) -- bf16 0x3c3c ~ 0.0115: finite values
  check(C.eng_cuda_memset(B, 0x3c, bytes))
  local a = ffi.new("kcu_gemm_args")
  a.M, a.N, a.K, a.abdt, a.cdt, a.alpha, a.beta = n, n, n, 2, 2, 1, 0
  a.A, a.lda, a.B, a.ldb, a.C, a.ldc = A, n, B, n, Cm, n
  local s = ffi.cast("cudaStream_t", C.eng_cuda_stream(0))
  local best = 0
  for trial = 1, 4 do
    local reps = 10
    check(C.eng_cuda_synchronize())
    local t0 = engine.time()
    for _ = 1, reps do
      local st = C.kcu_gemm(ctx, a, s)
      if st ~= 0 then error("bench/gpu_step: bf16 GEMM failed: " .. ffi.string(C.kcu_status_string(st)), 0) end
    end
    check(C.eng_cuda_synchronize())
    local dt = engine.time() - t0
    if trial > 1 then best = math.max(best, 2 * n ^ 3 * reps / dt) end
  end
  C.eng_cuda_free(A); C.eng_cuda_free(B); C.eng_cuda_free(Cm)
  return best
end

local peak = measure_peak(o.peak_n)
print(string.format("bf16 peak (measured, cuBLASLt %d^3 GEMM): %.1f TFLOP/s", o.peak_n, peak / 1e12))

local tokens = o.batch * o.seq
local function flops_per_token(nparams) return 6 * nparams + 12 * o.n_layers * o.dim * o.seq end

-- ---------------------------------------------------------------- 2. engine
-- the model in bf16 on the GPU, and its step: forward, fused classifier on the bf16 logits, backward
local function build()
  local model
  if o.model == "gpt" then
    model = U.build_model(o)   -- seed 0, N(0, 0.02) embeddings, train mode
  else
    engine.manual_seed(0)
    model = models.Llama{ dim = o.dim, n_layers = o.n_layers, n_heads = o.n_heads, n_kv_heads = o.n_kv_heads,
      vocab_size = o.vocab, max_seq_len = o.seq }
    model:train()
  end
  model:to("bf16")
  model:to("cuda")
  return model
end
local function loss_of(model, x, y)
  if o.model == "gpt" then
    local _, loss = model(x, y)   -- bf16 logits into the fused classifier: no f32 copy of the logits
    return loss
  end
  return F.fused_classifier(model(x, { float = false }), y)
end
-- with the kernel trace on (ENGINE_PROFILE_KERNELS=1), each run's timed steps get their own kernel table
local prof = engine.profiler
local function run_steps(model, x, y, label)
  local opt = optim.AdamW(model:parameters(), { lr = 3e-4, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0.1 })
  local times, loss0, lossn = {}, nil, nil
  local traced = prof.kernel_trace_active()
  for i = 1, o.warmup + o.steps do
    if traced and i == o.warmup + 1 then prof.kernel_reset() end
    check(C.eng_cuda_synchronize())
    local t0 = engine.time()
    local loss = loss_of(model, x, y)
    loss:backward()
    opt:step()
    opt:zero_grad()
    check(C.eng_cuda_synchronize())
    local dt = engine.time() - t0
    if i == 1 then loss0 = loss:item() end
    if i == o.warmup + o.steps then lossn = loss:item() end
    if i > o.warmup then times[#times + 1] = dt end
  end
  if traced then
    print(string.format("kernel trace of the %d timed steps of %s (per step: divide by %d)", o.steps, label, o.steps))
    io.write(prof.kernel_report())
    prof.kernel_reset()
  end
  return median(times), loss0, lossn
end

local eng_tps, eng_mfu, eng_err, eng_mfu_sheet, eng_mem
do
  local probe_ok, probe_err = pcall(function() return engine.zeros(2):to("cuda") end)
  if not probe_ok then
    eng_err = "engine tensors cannot be moved to the GPU in this build yet (" .. tostring(probe_err) .. ")"
  else
    local ok, err = pcall(function()
      local model = build()
      local nparams = model:num_parameters()
      local seq = (engine.rand(o.batch, o.seq + 1) * o.vocab):long():clamp(0, o.vocab - 1)
      local x = seq:narrow(2, 1, o.seq):contiguous():to("cuda")
      local y = seq:narrow(2, 2, o.seq):contiguous():to("cuda")
      local med, loss0, lossn = run_steps(model, x, y, "the engine's " .. o.model)
      eng_tps = tokens / med
      eng_mfu = flops_per_token(nparams) * eng_tps / peak
      local st = ffi.new("eng_cuda_memory_stats")
      check(C.eng_cuda_get_memory_stats(st))
      local sheet, sheet_how = require("engine.run").peak_flops("cuda")
      print(string.format("engine (%s): median %.1f ms/step over %d steps after %d warm-up, %d params, %d tokens/step, "
        .. "%.0f tokens/s, MFU %.1f%%, loss %.4f -> %.4f, peak device memory %.2f GiB", o.model, med * 1e3, o.steps,
        o.warmup, nparams, tokens, eng_tps, 100 * eng_mfu, loss0, lossn, tonumber(st.peak_allocated) / 2 ^ 30))
      eng_mfu_sheet = sheet and flops_per_token(nparams) * eng_tps / sheet or nil
      eng_mem = tonumber(st.peak_allocated) / 2 ^ 30
      print(sheet and string.format("engine: MFU %.1f%% of the datasheet's %s", 100 * eng_mfu_sheet, sheet_how)
        or ("engine: no datasheet peak: " .. tostring(sheet_how)))
      if o.tp1 ~= 0 then
        -- the same model under its tensor-parallel plan on a one-rank CUDA mesh, same batch
        model, st = nil, nil
        collectgarbage()
        local m1 = build()
        local mesh = engine.distributed.init_device_mesh("cuda", { 1 }, { "tp" })
        if o.model == "gpt" then models.Transformer.parallelize(m1, mesh) else models.Llama.parallelize(m1, mesh) end
        local med1 = run_steps(m1, x, y, "the tp=1 plan")
        print(string.format("engine tp=1: median %.1f ms/step (DTensor TP plan on a 1-rank CUDA mesh), %.3fx the plain "
          .. "step (target <= 1.03)", med1 * 1e3, med1 / med))
      end
    end)
    if not ok then eng_err = "engine training step failed: " .. tostring(err) end
  end
  if eng_err then print("engine: NOT MEASURED: " .. eng_err) end
end

-- ---------------------------------------------------------------- 3. PyTorch
local torch_res = {}
if o.torch ~= 0 then
  local python = os.getenv("PYTHON") or "python3"
  local home = (ENGINE_HOME and ENGINE_HOME ~= "") and ENGINE_HOME or "."
  local cmd = string.format("%s '%s/tools/bench_gpu_torch.py' --model=%s --steps=%d --warmup=%d --batch=%d --seq=%d "
    .. "--n_layers=%d --dim=%d --n_heads=%d --n_kv_heads=%d --vocab=%d --modes=%s --peak_tflops=%.3f --gelu=%s 2>&1",
    python, home, o.model, o.steps, o.warmup, o.batch, o.seq, o.n_layers, o.dim, o.n_heads, o.n_kv_heads, o.vocab,
    o.compile ~= 0 and "eager,compile" or "eager", peak / 1e12, o.gelu)
  print("pytorch: " .. cmd)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  for line in out:gmatch("[^\n]+") do
    print("  torch> " .. line)
    local mode = line:match("^RESULT mode=(%w+)")
    if mode then
      torch_res[mode] = { tps = tonumber(line:match("tokens_per_s=([%d%.]+)")), mfu = tonumber(line:match("mfu=([%d%.]+)")),
        mem = tonumber(line:match("peak_mem_gib=([%d%.]+)")) }
    end
  end
  if not next(torch_res) then print("pytorch: no result (output above)") end
end

-- ---------------------------------------------------------------- 4. summary
local function fmt(tps, mfu) return tps and string.format("%.0f tok/s (MFU %.1f%%)", tps, 100 * mfu) or "n/a" end
print(string.format("summary: engine %s | torch eager %s | torch.compile %s | peak %.1f TFLOP/s",
  eng_tps and fmt(eng_tps, eng_mfu) or "NOT MEASURED", fmt(torch_res.eager and torch_res.eager.tps,
  torch_res.eager and torch_res.eager.mfu), fmt(torch_res.compile and torch_res.compile.tps,
  torch_res.compile and torch_res.compile.mfu), peak / 1e12))
if eng_tps then
  local e, c = torch_res.eager, torch_res.compile
  local function ratio(x) return x and x.tps and string.format("%.2f", eng_tps / x.tps) or "n/a" end
  local sheet = eng_mfu_sheet and string.format("%.1f%%", 100 * eng_mfu_sheet) or "n/a"
  -- issue 28's targets: >= 1.3x eager, >= 1.0x compile, MFU >= 40% of the datasheet peak, memory <= eager's
  print(string.format("targets: engine/eager %s (>= 1.3), engine/compile %s (>= 1.0), MFU %s of the datasheet peak "
    .. "(>= 40%%; %.1f%% of the measured one), peak memory %.2f GiB vs eager %s (<=)", ratio(e), ratio(c), sheet,
    100 * eng_mfu, eng_mem or 0, e and e.mem and string.format("%.2f GiB", e.mem) or "n/a"))
  print(string.format("gpu_step: engine %.0f tok/s, eager %s tok/s, compile %s tok/s, engine/compile %s, MFU %s", eng_tps,
    e and e.tps and string.format("%.0f", e.tps) or "n/a", c and c.tps and string.format("%.0f", c.tps) or "n/a",
    ratio(c), eng_mfu_sheet and string.format("%.1f%%", 100 * eng_mfu_sheet) or "n/a"))
else
  print("bench/gpu_step: the engine step was not measured: " .. eng_err)
  os.exit(1)
end
