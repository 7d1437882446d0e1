-- recipes/bench/gpu_kernels.lua: each op of the GPT-2 step alone, timed in a loop, with the bandwidth or FLOP rate it
-- reaches: the kernel-level view the step's profile cannot give (its per-op GPU times include the time the GPU waits
-- for the host when the ops are small).
--
--   build/engine recipes/bench/gpu_kernels.lua [--device=cuda] [--batch=8] [--seq=1024] [--dim=768] [--heads=12]
--       [--vocab=50304] [--dtype=bf16] [--reps=50] [--only=<Lua pattern>]
--
-- Shapes are GPT-2 124M's at batch 8 x 1024 (rows N = batch x seq).  Each line: op, microseconds per call (median of
-- 5 timings of --reps calls, the device synchronised around each timing), and the rate against what the op must
-- move (GB/s: bytes read + written once) or compute (TFLOP/s).  "bwd" lines time forward + backward and subtract
-- the forward's time.  Compare a kernel's GB/s with the device's memory bandwidth (H100 SXM about 3.3 TB/s, H200
-- about 4.8 TB/s) and a product's TFLOP/s with the bf16 peak gpu_step.lua measures.  --device=cpu runs the same
-- ops on the CPU (a smoke test with small shapes: --batch=1 --seq=64).
local engine = require("engine")
local F = engine.nn.functional
local o = require("engine.cli").parse(arg, {
  name = "bench/gpu_kernels",
  description = "The GPT-2 step's ops one by one: time per call and the bandwidth or FLOP rate reached.",
  options = {
    { "device", "cuda", "cuda or cpu", choices = { "cuda", "cpu" } },
    { "batch", 8, "sequences", int = true, min = 1 },
    { "seq", 1024, "tokens per sequence", int = true, min = 1 },
    { "dim", 768, "model dim", int = true, min = 8 },
    { "heads", 12, "attention heads", int = true, min = 1 },
    { "vocab", 50304, "vocabulary (the classifier)", int = true, min = 2 },
    { "dtype", "bf16", "activations' and weights' dtype", choices = { "bf16", "f16", "f32" } },
    { "reps", 50, "calls per timing", int = true, min = 1 },
    { "only", "", "run the ops whose name matches this Lua pattern" },
  },
})
local dev, dt = o.device, o.dtype
if dev == "cuda" and not engine.cuda.is_available() then
  print("bench/gpu_kernels: no GPU, nothing to measure: " .. engine.cuda.unavailable_reason())
  return
end
local function sync() if dev == "cuda" then engine.cuda.synchronize() end end
local N, C, H, T, B = o.batch * o.seq, o.dim, o.heads, o.seq, o.batch
local es = dt == "f32" and 4 or 2
local MB = 1e6

local function rnd(...) return (engine.randn(...) * 0.5):to(dt):to(dev) end

-- median of 5 timings of reps calls of f, in seconds per call
local function time_of(f)
  f(); sync()
  local ts = {}
  for k = 1, 5 do
    sync()
    local t0 = engine.time()
    for _ = 1, o.reps do f() end
    sync()
    ts[k] = (engine.time() - t0) / o.reps
  end
  table.sort(ts)
  return ts[3]
end

local function line(name, s, bytes, flops)
  local rate = flops and string.format("%8.1f TFLOP/s", flops / s / 1e12) or string.format("%8.1f GB/s", bytes / s / 1e9)
  print(string.format("%-34s %10.1f us   %s", name, s * 1e6, rate))
end

local function case(name, fwd, bytes_f, bwd_setup, bytes_b, flops_f, flops_b)
  if o.only ~= "" and not name:match(o.only) then return end
  local tf = engine.no_grad(function() return time_of(fwd) end)
  line(name .. " fwd", tf, bytes_f, flops_f)
  if bwd_setup then
    local tfb = time_of(bwd_setup)
    line(name .. " bwd", math.max(tfb - tf, 1e-9), bytes_b, flops_b)
  end
end

print(string.format("bench/gpu_kernels: %s, %s, N = %d rows x %d, %d heads, vocab %d, %d calls per timing",
  dev == "cuda" and engine.cuda.get_device_name() or "cpu", dt, N, C, H, o.vocab, o.reps))

-- layer_norm: reads x, writes y (and f32 mean/rstd); backward reads dy, x, writes dx and the weight / bias sums
do
  local x, w, b = rnd(N, C):requires_grad_(), rnd(C):requires_grad_(), rnd(C):requires_grad_()
  local g = rnd(N, C)
  case("layer_norm", function() return F.layer_norm(x, { C }, w, b) end, 2 * N * C * es,
    function() F.layer_norm(x, { C }, w, b):backward(g) end, 3 * N * C * es)
  local r = rnd(N, C):requires_grad_()
  case("add_layer_norm", function() return F.add_layer_norm(x, r, { C }, w, b) end, 4 * N * C * es,
    function() local y, h = F.add_layer_norm(x, r, { C }, w, b); (y * g + h * g):sum():backward() end, 5 * N * C * es)
end

-- residual add, tanh GELU on the 4C activations
do
  local a, b = rnd(N, C):requires_grad_(), rnd(N, C):requires_grad_()
  case("add", function() return a + b end, 3 * N * C * es)
  local x = rnd(N, 4 * C):requires_grad_()
  local g = rnd(N, 4 * C)
  case("gelu tanh", function() return F.gelu(x, "tanh") end, 2 * N * 4 * C * es,
    function() F.gelu(x, "tanh"):backward(g) end, 3 * N * 4 * C * es)
end

-- the GEMMs of a block (fused QKV, the MLP's two) and the classifier's
do
  for _, s in ipairs({ { "linear qkv", C, 3 * C }, { "linear_gelu fc", C, 4 * C }, { "linear proj", 4 * C, C } }) do
    local x, w = rnd(N, s[2]):requires_grad_(), rnd(s[3], s[2]):requires_grad_()
    local g = rnd(N, s[3])
    local fl = 2 * N * s[2] * s[3]
    if s[1]:match("gelu") then
      local bias = rnd(s[3]):requires_grad_()
      case(s[1], function() return F.linear_gelu(x, w, bias, "tanh") end, nil,
        function() F.linear_gelu(x, w, bias, "tanh"):backward(g) end, nil, fl, 2 * fl)
    else
      case(s[1], function() return F.linear(x, w) end, nil, function() F.linear(x, w):backward(g) end, nil, fl, 2 * fl)
    end
  end
  local x, w = rnd(N, C):requires_grad_(), rnd(o.vocab, C):requires_grad_()
  local y = (engine.rand(N) * o.vocab):long():clamp(0, o.vocab - 1):to(dev)
  local fl = 2 * N * C * o.vocab
  case("classifier (linear + fused CE)", function() return F.fused_classifier(F.linear(x, w), y) end, nil,
    function() F.fused_classifier(F.linear(x, w), y):backward() end, nil, fl, 2 * fl)
end

-- causal attention [B, H, T, D] (the kernels' FLOPs: 4 B H T^2 D / 2 forward, 2.5x that backward)
do
  local D = math.floor(C / H)
  local q, k, v = rnd(B, H, T, D):requires_grad_(), rnd(B, H, T, D):requires_grad_(), rnd(B, H, T, D):requires_grad_()
  local g = rnd(B, H, T, D)
  local fl = 4 * B * H * T * T * D / 2
  case("sdpa causal", function() return F.scaled_dot_product_attention(q, k, v, nil, 0, true) end, nil,
    function() F.scaled_dot_product_attention(q, k, v, nil, 0, true):backward(g) end, nil, fl, 2.5 * fl)
end

-- the fused rotary embedding on q-shaped [B, T, H, D] (Llama)
do
  local D = math.floor(C / H)
  local x = rnd(B, T, H, D):requires_grad_()
  local ang = engine.randn(T, D / 2)
  local cs, sn = ang:cos():to(dt):to(dev), ang:sin():to(dt):to(dev)
  local g = rnd(B, T, H, D)
  case("rotary_emb", function() return engine.rotary_emb(x, cs, sn) end, 2 * N * C * es,
    function() engine.rotary_emb(x, cs, sn):backward(g) end, 2 * N * C * es)
end

-- embedding gather and its backward (the token table)
do
  local w = rnd(o.vocab, C):requires_grad_()
  local idx = (engine.rand(B, T) * o.vocab):long():clamp(0, o.vocab - 1):to(dev)
  local g = rnd(B, T, C)
  case("embedding", function() return F.embedding(idx, w) end, 2 * N * C * es,
    function() F.embedding(idx, w):backward(g) end, (N * C + o.vocab * C) * es)
end

-- AdamW over GPT-2's 124M parameters in the step's dtype (bf16 states: the all-half kernel)
if o.only == "" or ("adamw"):match(o.only) then
  local n = 124439040
  if dev == "cpu" then n = 1000000 end
  local p = engine.zeros(n):to(dt):to(dev):requires_grad_()
  p.grad = rnd(n)
  local opt = engine.optim.AdamW({ p }, { lr = 1e-4, weight_decay = 0.1 })
  local t = time_of(function() opt:step() end)
  line(string.format("adamw (%d params, %s states)", n, dt), t, 7 * n * es)
end
