-- recipes/bench/gc_memory.lua: peak tensor memory of 200 no_grad forwards of the reference GPT (4 layers, dim
-- 256, seq 128, batch 8) with the allocator driving Lua's collector (default) and, in a second run, without it.
--
--   build/engine recipes/bench/gc_memory.lua                     # default pacing
--   ENGINE_GC_RATIO=0 build/engine recipes/bench/gc_memory.lua   # collector not driven by tensor memory
local engine = require("engine")
local nn = engine.nn
engine.manual_seed(0)
local m = nn.Transformer{ n_layers = 4, dim = 256, n_heads = 4, vocab_size = 256, max_seq_len = 128, dropout_p = 0 }
m:eval()
local x = (engine.rand(8, 128) * 256):to("i64")
engine.no_grad(function() m(x) end)
local one = engine.memory_stats().peak_allocated
engine.reset_peak_memory()
engine.no_grad(function() for _ = 1, 200 do m(x) end end)
local st = engine.memory_stats()
print(string.format("gc_memory: one forward peak %.1f MiB; 200 no_grad forwards peak %.1f MiB (%.1fx), %d collections, "
  .. "%.2f s collecting", one / 2 ^ 20, st.peak_allocated / 2 ^ 20, st.peak_allocated / one, st.gc_collections,
  st.gc_seconds))
