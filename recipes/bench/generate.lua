-- recipes/bench/generate.lua: per-token generation time of the reference GPT with the KV cache, flat in the
-- context length, against recomputing the whole context per token (the old sampler's way).
--
--   build/engine recipes/bench/generate.lua [--threads=2] [--reps=5] [--tokens=32] [--old_tokens=3]
--       [--short=64] [--long=1024] [--n_layers=4] [--dim=256] [--n_heads=4] [--vocab=256] [--batch=1]
--
-- The model: nn.Transformer (n_layers 4, dim 256, n_heads 4, vocab 256, max_seq_len long + 64 = 1088, dropout 0, seed
-- 0, eval).  Each figure is the median over --reps runs of model:generate (greedy) on a fixed prompt of the given
-- context length: the time between the first and the last streamed token divided by the tokens between them
-- (the prefill is not counted; the decode steps include the sampler); the three figures' runs are interleaved.
-- Prints, in one run:
--   1. cached per-token time at context --short (the baseline) and at --long, and their ratio (target <= 1.5x:
--      the per-token cost is flat in the context), with the bytes a decode step reads (all the weights, and the
--      f32 keys and values of the context: their ratio is what a step bound by memory bandwidth would show);
--   2. the bound of this machine: the time to only read what a decode step reads (every layer's parameters, then
--      that layer's cached keys and values as [batch, heads, context, head_dim] f32 tensors, then the final norm and
--      the output weights: one sum each, no other arithmetic), at --short and --long, its ratio (what a step that
--      only waited for memory would show on this machine), and the cached step's time beyond that read;
--   3. per-token time recomputing the context at --long (kv_cache = false: the baseline) and the cache's
--      speedup over it (target >= 10x);
--   4. the cached times with cache_dtype = "bf16" (half the keys' and values' bytes) at --short and --long, their
--      ratio and the bytes' ratio.
local engine = require("engine")
local nn = engine.nn
local ffi = require("ffi")

local o = require("engine.cli").parse(arg, {
  name = "bench/generate",
  description = "Per-token generation time with the KV cache at a short and a long context, and without it.",
  options = {
    { "threads", 2, "BLAS and engine threads", int = true, min = 1 },
    { "reps", 5, "runs per figure (the median is printed)", int = true, min = 1 },
    { "tokens", 32, "tokens timed per cached run", int = true, min = 2 },
    { "old_tokens", 3, "tokens timed per uncached run", int = true, min = 2 },
    { "short", 64, "the short context (tokens)", int = true, min = 1 },
    { "long", 1024, "the long context (tokens)", int = true, min = 1 },
    { "n_layers", 4, "layers", int = true, min = 1 },
    { "dim", 256, "model dim", int = true, min = 1 },
    { "n_heads", 4, "attention heads", int = true, min = 1 },
    { "vocab", 256, "vocabulary size", int = true, min = 2 },
    { "batch", 1, "prompts generated together", int = true, min = 1 },
  },
})

pcall(ffi.cdef, "typedef struct { long tv_sec; long tv_nsec; } bench_gen_ts; int clock_gettime(int, bench_gen_ts*);")
local ts = ffi.new("bench_gen_ts")
local function now()
  ffi.C.clock_gettime(1, ts)   -- CLOCK_MONOTONIC
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end

-- the median of the benches (recipes/bench/util.lua)
local median = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/util.lua").median

engine.set_num_threads(o.threads)
local max_seq_len = math.max(o.long, o.short) + math.max(64, o.tokens + 1, o.old_tokens + 1)
engine.manual_seed(0)
local model = nn.Transformer{ n_layers = o.n_layers, dim = o.dim, n_heads = o.n_heads, vocab_size = o.vocab,
  max_seq_len = max_seq_len, dropout_p = 0 }
for name, p in model:named_parameters() do  -- GPT-2 style init, as recipes/bench/step.lua
  if name:match("embeddings%.weight$") then nn.init.normal_(p, 0, 0.02) end
end
model:eval()
print(string.format("bench/generate: %s, BLAS core %s, %d threads, load %s", engine.version,
  engine.blas_core(), engine.get_num_threads(), (io.open("/proc/loadavg") or { read = function() return "?" end })
  :read("*l") or "?"))
print(string.format("bench/generate: GPT %d layers, dim %d, %d heads, vocab %d, max_seq_len %d, batch %d, greedy",
  o.n_layers, o.dim, o.n_heads, o.vocab, max_seq_len, o.batch))

-- a fixed prompt batch of ctx tokens
local function prompt(ctx)
  local rows = {}
  for b = 1, o.batch do
    local r = {}
    for i = 1, ctx do r[i] = (i * 37 + b * 11) % o.vocab end
    rows[b] = r
  end
  return rows
end

-- seconds per token of one run generating n tokens after a prompt of ctx tokens
local function per_token(ctx, n, cache, cache_dtype)
  local stamps = {}
  model:generate(prompt(ctx), { max_new_tokens = n + 1, temperature = 0, kv_cache = cache, cache_dtype = cache_dtype,
    stream = function(_, row) if row == 1 then stamps[#stamps + 1] = now() end end })
  return (stamps[#stamps] - stamps[1]) / (#stamps - 1)
end

-- what a decode step reads at context ctx, in its order: per layer the parameters, then the keys and values
local layer_params = {}
for i, layer in ipairs(model.layers) do layer_params[i] = layer:parameters() end
local tail_params = model.norm:parameters()
tail_params[#tail_params + 1] = model.output.weight
local hd = o.dim / o.n_heads
local function read_set(ctx)
  local kv = {}
  for i = 1, o.n_layers do
    kv[i] = { engine.randn(o.batch, o.n_heads, ctx, hd), engine.randn(o.batch, o.n_heads, ctx, hd) }
  end
  return kv
end
local read_kv = { short = read_set(o.short), long = read_set(o.long) }
-- seconds of one pass reading a step's bytes (the median of 9 passes after 3)
local function read_pass(kv)
  local t = {}
  engine.no_grad(function()
    for r = 1, 12 do
      local t0 = now()
      for i = 1, o.n_layers do
        for _, p in ipairs(layer_params[i]) do p:sum() end
        kv[i][1]:sum(); kv[i][2]:sum()
      end
      for _, p in ipairs(tail_params) do p:sum() end
      if r > 3 then t[#t + 1] = now() - t0 end
    end
  end)
  return median(t)
end

-- the three figures, interleaved run by run (a slow phase of the machine touches each alike), after one warm-up
-- run of each (buffers, page faults); the medians over --reps
per_token(o.short, 4, true); per_token(o.long, 4, true); per_token(o.long, 2, false)
per_token(o.short, 4, true, "bf16"); per_token(o.long, 4, true, "bf16")
local runs = { short = {}, long = {}, old = {}, read_short = {}, read_long = {}, short16 = {}, long16 = {} }
for _ = 1, o.reps do
  runs.short[#runs.short + 1] = per_token(o.short, o.tokens, true)
  runs.read_short[#runs.read_short + 1] = read_pass(read_kv.short)
  runs.long[#runs.long + 1] = per_token(o.long, o.tokens, true)
  runs.read_long[#runs.read_long + 1] = read_pass(read_kv.long)
  runs.old[#runs.old + 1] = per_token(o.long, o.old_tokens, false)
  runs.short16[#runs.short16 + 1] = per_token(o.short, o.tokens, true, "bf16")
  runs.long16[#runs.long16 + 1] = per_token(o.long, o.tokens, true, "bf16")
end
local short, long, old = median(runs.short), median(runs.long), median(runs.old)
local read_short, read_long = median(runs.read_short), median(runs.read_long)
local ratio, speedup = long / short, old / long
print(string.format("bench/generate: KV cache, context %4d: %8.3f ms/token  (baseline)", o.short, short * 1e3))
print(string.format("bench/generate: KV cache, context %4d: %8.3f ms/token  = %.2fx the context-%d time (target <= 1.5x): %s",
  o.long, long * 1e3, ratio, o.short, ratio <= 1.5 and "met" or "MISSED"))
-- what a decode step must read: every weight once, and the cached keys and values of every layer (f32)
local wbytes = model:num_parameters() * 4
local function kvbytes(ctx) return o.n_layers * 2 * ctx * o.dim * 4 * o.batch end
print(string.format("bench/generate: bytes read per token: weights %.1f MiB + keys/values %.1f MiB (context %d) or "
  .. "%.1f MiB (context %d): a step bound by memory bandwidth would take %.2fx as long at %d", wbytes / 2 ^ 20,
  kvbytes(o.short) / 2 ^ 20, o.short, kvbytes(o.long) / 2 ^ 20, o.long,
  (wbytes + kvbytes(o.long)) / (wbytes + kvbytes(o.short)), o.long))
print(string.format("bench/generate: reading those bytes alone (one sum per tensor, in a step's order): %.3f ms at "
  .. "context %d, %.3f ms at %d = %.2fx (what a step that only waited for memory would show); the step beyond "
  .. "that read: %.3f ms at %d, %.3f ms at %d", read_short * 1e3, o.short, read_long * 1e3, o.long,
  read_long / read_short, (short - read_short) * 1e3, o.short, (long - read_long) * 1e3, o.long))
print(string.format("bench/generate: recompute, context %4d: %8.3f ms/token  (baseline: the old sampler's way)",
  o.long, old * 1e3))
print(string.format("bench/generate: KV cache speedup at context %d: %.1fx (target >= 10x): %s", o.long, speedup,
  speedup >= 10 and "met" or "MISSED"))
-- the same with cache_dtype = "bf16": half the keys' and values' bytes
local short16, long16 = median(runs.short16), median(runs.long16)
print(string.format("bench/generate: bf16 KV cache (cache_dtype = \"bf16\"), context %4d: %8.3f ms/token, context %4d: "
  .. "%8.3f ms/token = %.2fx (target <= 1.5x: %s; bytes %.2fx)", o.short, short16 * 1e3, o.long, long16 * 1e3,
  long16 / short16, long16 / short16 <= 1.5 and "met" or "MISSED",
  (wbytes + kvbytes(o.long) / 2) / (wbytes + kvbytes(o.short) / 2)))
