-- recipes/bench/step.lua: training-step time of the reference model against its floors and PyTorch.
--
--   build/engine recipes/bench/step.lua [--steps=20] [--warmup=3] [--threads=2] [--torch=1]
--       [--n_layers=4] [--dim=256] [--n_heads=4] [--seq=128] [--batch=8] [--gemm_reps=5]
--       [--model=gpt|llama] [--n_kv_heads=2] [--multiple_of=256] [--fused=1]
--   make bench
--
-- --fused=0 runs the GPT through the unfused ops (a no-op forward hook on each block's w1 and ffn_norm makes the
-- blocks call linear, gelu, add and layer_norm one by one instead of linear_gelu and add_layer_norm): the
-- before/after of those fusions in one build.
-- --model=llama times nn.Llama (torchtitan's model: RMSNorm, rotary, grouped-query attention with
-- --n_kv_heads k/v heads, SwiGLU of hidden size multiple_of-rounded 8 dim / 3, untied output) at the same
-- size, its GEMM floor over its own Linear shapes, and PyTorch 2.x running the same model
-- (tools/bench_llama_torch.py under tools/.venv/bin/python, torch.set_num_threads(--threads)).
--
-- Prints, in one run:
--   1. engine: median ms per training step (forward + cross entropy + backward + grad clipping-free
--      AdamW step + zero_grad, fixed random batch) after `warmup` steps, for seq 003's Transformer
--      (4 layers, dim 256, 4 heads, seq 128, batch 8, vocab 256, fp32, dropout 0, tied output weights).
--   2. GEMM floor: the measured sgemm rate of the engine's matmul/linear on every GEMM shape of one
--      step (each Linear's forward x W^T, grad-input g W and grad-weight g^T x at M = batch x seq),
--      and 6 x params x tokens / that rate: the time a step would take if it were nothing but GEMMs
--      at that rate.  Also the measured time of those GEMMs themselves (attention excluded).
--   3. PyTorch: tools/bench_step_torch.py with the same model, batch and init under tools/.venv/bin/python
--      (PyTorch 2.x from tools/install-torch.sh, MKL, torch.set_num_threads(--threads)), else under
--      /usr/bin/python3 (torch.set_num_threads(1), OpenBLAS with --threads threads) when torch is importable
--      there; both medians and the ratio.
-- The BLAS core and why it runs (engine.blas_core()) and thread counts are logged: OPENBLAS_CORETYPE changes
-- sgemm speed by up to 1.8x on the same machine (shared/reference/environment.md section 5).
local engine = require("engine")
local nn, optim = engine.nn, engine.optim
local F = nn.functional

local o = require("engine.cli").parse(arg or {}, { name = "bench/step",
  description = "The reference GPT (or Llama) training step against its GEMM floor and PyTorch's step.",
  options = {
    { "steps", 20, "timed steps", int = true, min = 1 },
    { "warmup", 3, "untimed steps first", int = true, min = 0 },
    { "threads", 2, "BLAS and engine threads", int = true, min = 1 },
    { "torch", 1, "1: run PyTorch's step too (tools/.venv)", int = true, choices = { 0, 1 } },
    { "n_layers", 4, "layers", int = true, min = 1 },
    { "dim", 256, "model dim", int = true, min = 1 },
    { "n_heads", 4, "heads", int = true, min = 1 },
    { "seq", 128, "sequence length", int = true, min = 1 },
    { "batch", 8, "batch", int = true, min = 1 },
    { "vocab", 256, "vocabulary", int = true, min = 2 },
    { "gemm_reps", 5, "repetitions of the GEMM-floor measurement", int = true, min = 1 },
    { "model", "gpt", "the model", choices = { "gpt", "llama" } },
    { "n_kv_heads", 2, "Llama's k/v heads", int = true, min = 1 },
    { "multiple_of", 256, "Llama's FFN rounding", int = true, min = 1 },
    { "fused", 1, "1: the fused paths (QKV, linear+GELU, add+LayerNorm)", int = true, choices = { 0, 1 } },
  } })
local llama = o.model == "llama"

local function median(t)
  local s = { unpack(t) }
  table.sort(s)
  local n = #s
  return n % 2 == 1 and s[(n + 1) / 2] or 0.5 * (s[n / 2] + s[n / 2 + 1])
end

engine.set_num_threads(o.threads)
print(string.format("bench/step: engine %s, BLAS core %s, GEMM %s, %d threads, OPENBLAS_CORETYPE=%s", engine.version,
  engine.blas_core(), engine.gemm_library(), engine.get_num_threads(), os.getenv("OPENBLAS_CORETYPE") or "(unset)"))

-- ---------------------------------------------------------------- 1. training step
engine.manual_seed(0)
local model, ffn
if llama then
  model = nn.Llama{ n_layers = o.n_layers, dim = o.dim, n_heads = o.n_heads, n_kv_heads = o.n_kv_heads,
    vocab_size = o.vocab, max_seq_len = o.seq, multiple_of = o.multiple_of }   -- torchtitan's init
  ffn = require("engine.models").llama_ffn_dim(model.model_args)
  print(string.format("bench/step: model llama (%d layers, dim %d, %d heads, %d kv heads, ffn %d, seq %d, batch %d, vocab %d)",
    o.n_layers, o.dim, o.n_heads, o.n_kv_heads, ffn, o.seq, o.batch, o.vocab))
else
  model = nn.Transformer{ n_layers = o.n_layers, dim = o.dim, n_heads = o.n_heads, vocab_size = o.vocab,
    max_seq_len = o.seq, dropout_p = 0 }
  for name, p in model:named_parameters() do  -- GPT-2 style init, as recipes/gpt.lua and the torch script
    if name:match("embeddings%.weight$") then nn.init.normal_(p, 0, 0.02) end
  end
  if o.fused == 0 then
    for _, layer in ipairs(model.layers) do
      layer.feed_forward.w1:register_forward_hook(function() end)
      layer.ffn_norm:register_forward_hook(function() end)
    end
  end
end
model:train()
local params = model:parameters()
local nparams = model:num_parameters()
local opt = optim.AdamW(params, { lr = 3e-4, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0.1 })
local seq = (engine.rand(o.batch, o.seq + 1) * o.vocab):long():clamp(0, o.vocab - 1)
local x = seq:narrow(2, 1, o.seq):contiguous()
local y = seq:narrow(2, 2, o.seq):contiguous()
local tokens = o.batch * o.seq

local times, losses = {}, {}
for i = 1, o.warmup + o.steps do
  local t0 = engine.time()
  local loss = F.cross_entropy(model(x), y)
  loss:backward()
  opt:step()
  opt:zero_grad()
  losses[#losses + 1] = loss:item()
  local dt = engine.time() - t0
  if i > o.warmup then times[#times + 1] = dt * 1e3 end
end
local eng_ms = median(times)
table.sort(times)
print(string.format("engine step: median %.1f ms (min %.1f, max %.1f) over %d steps after %d warm-up; "
  .. "%d params, %d tokens/step, %.0f tok/s, loss %.4f -> %.4f, peak %.1f MiB",
  eng_ms, times[1], times[#times], o.steps, o.warmup, nparams, tokens, tokens / eng_ms * 1e3, losses[1],
  losses[#losses], engine.memory_stats().peak_allocated / 2 ^ 20))

-- ---------------------------------------------------------------- 2. GEMM floor
-- The Linear layers of one step (in, out): per block wq, wk, wv, wo (dim, dim), w1 (dim, 4 dim),
-- w2 (4 dim, dim); the output projection (dim, vocab).
local shapes = {}
for _ = 1, o.n_layers do
  if llama then  -- wq, wk, wv (kv heads), wo; w1, w3 (dim -> ffn), w2 (ffn -> dim)
    local kv = o.n_kv_heads * (o.dim / o.n_heads)
    shapes[#shapes + 1] = { o.dim, o.dim }
    shapes[#shapes + 1] = { o.dim, kv }
    shapes[#shapes + 1] = { o.dim, kv }
    shapes[#shapes + 1] = { o.dim, o.dim }
    shapes[#shapes + 1] = { o.dim, ffn }
    shapes[#shapes + 1] = { o.dim, ffn }
    shapes[#shapes + 1] = { ffn, o.dim }
  else
    for _ = 1, 4 do shapes[#shapes + 1] = { o.dim, o.dim } end
    shapes[#shapes + 1] = { o.dim, 4 * o.dim }
    shapes[#shapes + 1] = { 4 * o.dim, o.dim }
  end
end
shapes[#shapes + 1] = { o.dim, o.vocab }
local M = tokens
local cache = {}
local function operands(i, n)
  local key = i .. "x" .. n
  if not cache[key] then
    cache[key] = { x = engine.randn(M, i), w = engine.randn(n, i), g = engine.randn(M, n) }
  end
  return cache[key]
end
local gemm_flops, gemm_times = 0, {}
engine.no_grad(function()
  for _, s in ipairs(shapes) do
    local op = operands(s[1], s[2])
    gemm_flops = gemm_flops + 3 * 2 * M * s[1] * s[2]
    local _ = engine.linear(op.x, op.w):sum()  -- warm-up of each shape
  end
  for r = 1, o.gemm_reps + 1 do
    local t0 = engine.time()
    for _, s in ipairs(shapes) do
      local op = operands(s[1], s[2])
      local _ = engine.linear(op.x, op.w)            -- forward:     [M, in] x [out, in]^T
      local _ = engine.matmul(op.g, op.w)            -- grad input:  [M, out] x [out, in]
      local _ = engine.matmul(op.g:t(), op.x)        -- grad weight: [M, out]^T x [M, in]
    end
    if r > 1 then gemm_times[#gemm_times + 1] = engine.time() - t0 end
    collectgarbage()
  end
end)
local gemm_s = median(gemm_times)
local rate = gemm_flops / gemm_s
local floor_ms = 6 * nparams * tokens / rate * 1e3
print(string.format("sgemm: %.1f GFLOP/s over the %d GEMM shapes of a step (%d GEMMs, %.2f GFLOP, %.1f ms measured)",
  rate / 1e9, #shapes, 3 * #shapes, gemm_flops / 1e9, gemm_s * 1e3))
print(string.format("GEMM floor: 6 x %d params x %d tokens / %.1f GFLOP/s = %.1f ms; engine step = %.2f x floor",
  nparams, tokens, rate / 1e9, floor_ms, eng_ms / floor_ms))

-- ---------------------------------------------------------------- 3. PyTorch
local torch_ms
if o.torch ~= 0 and llama then
  local home = (ENGINE_HOME and ENGINE_HOME ~= "") and ENGINE_HOME or "."
  local py = home .. "/tools/.venv/bin/python"
  local has = os.execute("'" .. py .. "' -c 'import torch; torch.nn.RMSNorm' >/dev/null 2>&1")
  if has == 0 or has == true then
    collectgarbage()
    local cmd = string.format("'%s' '%s/tools/bench_llama_torch.py' --steps=%d --warmup=%d --threads=%d "
      .. "--n_layers=%d --dim=%d --n_heads=%d --n_kv_heads=%d --seq=%d --batch=%d --vocab=%d --multiple_of=%d 2>&1",
      py, home, o.steps, o.warmup, o.threads, o.n_layers, o.dim, o.n_heads, o.n_kv_heads, o.seq, o.batch, o.vocab,
      o.multiple_of)
    local p = io.popen(cmd)
    local out = p:read("*a")
    p:close()
    for line in out:gmatch("[^\n]+") do print("  torch> " .. line) end
    torch_ms = tonumber(out:match("torch_step_ms median=([%d%.]+)"))
    if not torch_ms then print("bench/step: the PyTorch benchmark failed (output above)") end
  else
    print("bench/step: no torch 2.x in tools/.venv (tools/install-torch.sh): PyTorch baseline skipped")
  end
elseif o.torch ~= 0 then
  -- PyTorch 2.x from tools/.venv (tools/install-torch.sh: MKL, torch.set_num_threads(--threads)) when it is
  -- there, else the system's torch (Debian's: OpenBLAS at --threads threads, one torch thread)
  local home = (ENGINE_HOME and ENGINE_HOME ~= "") and ENGINE_HOME or "."
  local venv = home .. "/tools/.venv/bin/python"
  local has_venv = os.execute("'" .. venv .. "' -c 'import torch' >/dev/null 2>&1")
  has_venv = has_venv == 0 or has_venv == true
  local has = has_venv or os.execute("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1")
  if has == 0 or has == true then
    collectgarbage()
    local py = has_venv and venv or "/usr/bin/python3"
    local tt = has_venv and o.threads or 1
    local cmd = string.format("OMP_NUM_THREADS=%d MKL_NUM_THREADS=%d OPENBLAS_NUM_THREADS=%d '%s' "
      .. "'%s/tools/bench_step_torch.py' --steps=%d --warmup=%d --torch_threads=%d --blas_threads=%d "
      .. "--n_layers=%d --dim=%d --n_heads=%d --seq=%d --batch=%d --vocab=%d 2>&1", tt, o.threads, o.threads, py,
      home, o.steps, o.warmup, tt, o.threads, o.n_layers, o.dim, o.n_heads, o.seq, o.batch, o.vocab)
    local p = io.popen(cmd)
    local out = p:read("*a")
    p:close()
    for line in out:gmatch("[^\n]+") do print("  torch> " .. line) end
    torch_ms = tonumber(out:match("torch_step_ms median=([%d%.]+)"))
    if not torch_ms then print("bench/step: the PyTorch benchmark failed (output above)") end
  else
    print("bench/step: no torch in tools/.venv (tools/install-torch.sh) or /usr/bin/python3: PyTorch baseline skipped")
  end
end

print(string.format("summary: engine%s %.1f ms/step | GEMM floor %.1f ms (%.1f GFLOP/s) | PyTorch %s | "
  .. "engine/PyTorch %s | BLAS %s, GEMM %s, %d threads", o.fused == 0 and " (unfused)" or "", eng_ms, floor_ms,
  rate / 1e9, torch_ms and string.format("%.1f ms/step", torch_ms) or "n/a",
  torch_ms and string.format("%.2f", eng_ms / torch_ms) or "n/a", engine.blas_corename(),
  engine.gemm_library():match("^(%S+)"), o.threads))
