-- recipes/llama.lua: a byte-level Llama (torchtitan's model: RMSNorm, rotary embeddings, grouped-query
-- attention, SwiGLU; nn.Llama in lua/engine/models.lua) trained on the King James Bible.  It is
-- recipes/gpt.lua with another model: the same options, logging, validation, checkpoints (full tensors)
-- and sample, plus the Llama's own options.
--
--   build/engine tools/prepare_data.lua                          # data/kjv_{train,val}.bin (make data)
--   build/engine recipes/llama.lua [--key=value ...]             # one process
--   mpirun -np 2 build/engine recipes/llama.lua                  # DTensor data parallelism over 2 ranks
--   mpirun -np 2 build/engine recipes/llama.lua --tp=0           # tensor parallel (torchtitan's plan)
--   mpirun -np 4 build/engine recipes/llama.lua --tp=2           # 2 x 2: TP pairs, data parallel across
--   mpirun -np 2 build/engine recipes/llama.lua --fsdp=1         # FSDP (recipes/fsdp_gpt.lua's options)
--   mpirun -np 4 build/engine recipes/llama.lua --fsdp=1 --tp=2  # FSDP over TP on a 2x2 mesh
--
-- Llama options: --n_kv_heads (k/v heads of grouped-query attention) --multiple_of --ffn_dim_multiplier
-- (0: none) --norm_eps --rope_theta; --n_layers --dim --n_heads --seq as in recipes/gpt.lua.
-- Defaults: the issue's reference size (4 layers, dim 256, 4 heads, 2 kv heads, seq 128, batch 8, vocab
-- 256); --dtensor_dp=1 (with several ranks and no --tp, the batch is sharded over a "dp" mesh of
-- Replicate DTensor parameters).  --sp=1 with --tp: torchtitan's sequence parallelism (SequenceParallel
-- norms, sequence-sharded activations between the blocks; --seq divisible by the tp size).  --dropout
-- does not apply (torchtitan's Llama has no dropout).
local engine = require("engine")
local nn = engine.nn

GPT_MODEL = {
  name = "llama",
  description = "A byte-level Llama (torchtitan's model: RMSNorm, rotary embeddings, grouped-query attention, "
    .. "SwiGLU) trained on the King James Bible: recipes/gpt.lua's options and the Llama's own; --fsdp=1 trains it "
    .. "with recipes/fsdp_gpt.lua (FSDP, or FSDP over TP with --tp) and that recipe's options.",
  options = {
    { "n_kv_heads", 2, "key/value heads (grouped-query attention; n_heads must be a multiple)", group = "model",
      int = true, min = 1 },
    { "multiple_of", 256, "the SwiGLU hidden size is rounded up to a multiple of this", group = "model", int = true,
      min = 1 },
    { "ffn_dim_multiplier", 0, "scales the SwiGLU hidden size; 0: none", group = "model", min = 0 },
    { "norm_eps", 1e-5, "RMSNorm epsilon", group = "model", min = 0 },
    { "rope_theta", 10000, "rotary embedding base", group = "model", min = 0 },
    { "fsdp", 0, "1: train with FSDP (recipes/fsdp_gpt.lua)", group = "parallel", int = true, choices = { 0, 1 } },
    { "dtensor_dp", 1 },
  },
  build = function(o)
    if o.dropout ~= 0 then error("llama: --dropout does not apply (the Llama has no dropout)", 0) end
    return nn.Llama{ dim = o.dim, n_layers = o.n_layers, n_heads = o.n_heads, n_kv_heads = o.n_kv_heads,
      vocab_size = o.vocab_size, multiple_of = o.multiple_of,
      ffn_dim_multiplier = o.ffn_dim_multiplier > 0 and o.ffn_dim_multiplier or nil,
      norm_eps = o.norm_eps, rope_theta = o.rope_theta, max_seq_len = o.seq }
  end,
  parallelize = function(model, tp_mesh, o) nn.Llama.parallelize(model, tp_mesh, { use_seq_parallel = o.sp == 1 }) end,
  describe = function(o)
    return string.format("%d layers, dim %d, %d heads, %d kv heads, ffn %d, seq %d, vocab %d", o.n_layers, o.dim,
      o.n_heads, o.n_kv_heads, require("engine.models").llama_ffn_dim({ dim = o.dim, multiple_of = o.multiple_of,
        ffn_dim_multiplier = o.ffn_dim_multiplier > 0 and o.ffn_dim_multiplier or nil }), o.seq, o.vocab_size)
  end,
}
local here = (arg and arg[0] or "recipes/llama.lua"):match("^(.*)/[^/]*$") or "."
-- --fsdp=1: recipes/fsdp_gpt.lua with the Llama (each block and the root fully sharded; its --reshard_after_forward,
-- --param_dtype/--reduce_dtype, --hsdp, --grad_accum and --tp options, checkpoints through dist.checkpoint)
-- --fsdp=1 (or --fsdp 1) picks recipes/fsdp_gpt.lua; the other arguments go to the recipe run
local use_fsdp, rest = false, { [0] = arg and arg[0] }
local argv = arg or {}
local i = 1
while i <= #argv do
  local a = argv[i]
  local v = a:match("^%-%-fsdp=(.*)$")
  if a == "--fsdp" then v = argv[i + 1]; i = i + 1 end
  if v then use_fsdp = v == "1" or v == "true"
  else rest[#rest + 1] = a end
  i = i + 1
end
local ok, err
if use_fsdp then
  local M = GPT_MODEL
  local opts = {}
  for _, o in ipairs(M.options) do if o[1] ~= "dtensor_dp" and o[1] ~= "fsdp" then opts[#opts + 1] = o end end
  FSDP_GPT = { name = "llama", options = opts, defaults = { tp = 1, sp = 0 }, tp_option = true, build = M.build,
    parallelize = M.parallelize, description = M.description }
  local saved = arg
  arg = rest
  ok, err = pcall(dofile, here .. "/fsdp_gpt.lua")
  arg = saved
  FSDP_GPT = nil
else
  ok, err = pcall(dofile, here .. "/gpt.lua")
end
GPT_MODEL = nil   -- (a spec may run recipes/gpt.lua next in the same process)
if not ok then error(err, 0) end
