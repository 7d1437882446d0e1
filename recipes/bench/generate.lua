-- recipes/bench/generate.lua: per-token generation time of the reference GPT with the KV cache, flat in the
-- context length, against recomputing the whole context per token (the old sampler's way).
--
--   build/engine recipes/bench/generate.lua [--threads=2] [--reps=3] [--tokens=32] [--old_tokens=3]
--       [--short=64] [--long=1024] [--n_layers=4] [--dim=256] [--n_heads=4] [--vocab=256] [--batch=1]
--
-- The model: nn.Transformer (n_layers 4, dim 256, n_heads 4, vocab 256, max_seq_len long + 64 = 1088, dropout 0, seed
-- 0, eval).  Each figure is the median over --reps runs of model:generate (greedy) on a fixed prompt of the given
-- context length: the time between the first and the last streamed token divided by the tokens between them
-- (the prefill is not counted; the decode steps include the sampler).  Prints, in one run:
--   1. cached per-token time at context --short (the baseline) and at --long, and their ratio (target <= 1.5x:
--      the per-token cost is flat in the context);
--   2. per-token time recomputing the context at --long (kv_cache = false: the baseline) and the cache's
--      speedup over it (target >= 10x).
local engine = require("engine")
local nn = engine.nn
local ffi = require("ffi")

local o = require("engine.cli").parse(arg, {
  name = "bench/generate",
  description = "Per-token generation time with the KV cache at a short and a long context, and without it.",
  options = {
    { "threads", 2, "BLAS and engine threads", int = true, min = 1 },
    { "reps", 3, "runs per figure (the median is printed)", int = true, min = 1 },
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

local function median(t)
  local s = { unpack(t) }
  table.sort(s)
  local n = #s
  return n % 2 == 1 and s[(n + 1) / 2] or 0.5 * (s[n / 2] + s[n / 2 + 1])
end

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

-- seconds per token (the median of reps runs) generating n tokens after a prompt of ctx tokens
local function per_token(ctx, n, cache)
  local p, runs = prompt(ctx), {}
  for r = 1, o.reps + 1 do       -- the first run warms up (buffers, page faults)
    local stamps = {}
    model:generate(p, { max_new_tokens = n + 1, temperature = 0, kv_cache = cache,
      stream = function(_, row) if row == 1 then stamps[#stamps + 1] = now() end end })
    if r > 1 then runs[#runs + 1] = (stamps[#stamps] - stamps[1]) / (#stamps - 1) end
  end
  return median(runs)
end

local short = per_token(o.short, o.tokens, true)
local long = per_token(o.long, o.tokens, true)
local old = per_token(o.long, o.old_tokens, false)
local ratio, speedup = long / short, old / long
print(string.format("bench/generate: KV cache, context %4d: %8.3f ms/token  (baseline)", o.short, short * 1e3))
print(string.format("bench/generate: KV cache, context %4d: %8.3f ms/token  = %.2fx the context-%d time (target <= 1.5x): %s",
  o.long, long * 1e3, ratio, o.short, ratio <= 1.5 and "met" or "MISSED"))
print(string.format("bench/generate: recompute, context %4d: %8.3f ms/token  (baseline: the old sampler's way)",
  o.long, old * 1e3))
print(string.format("bench/generate: KV cache speedup at context %d: %.1fx (target >= 10x): %s", o.long, speedup,
  speedup >= 10 and "met" or "MISSED"))
