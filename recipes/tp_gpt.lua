-- recipes/tp_gpt.lua: the KJV GPT of recipes/gpt.lua trained tensor-parallel (common_dtensor.py's Transformer
-- plan, models.Transformer.parallelize): every rank holds 1/tp of each attention and MLP weight and of
-- the embeddings; the logits are gathered for the loss.  Same options, logging, validation, sample and
-- checkpoints as recipes/gpt.lua (distributed checkpoints: every rank writes its own shards, and a
-- checkpoint resumes at any world size or --tp, also in recipes/gpt.lua and the other way round;
-- --ckpt_format=full keeps the single file of full tensors, gathered on save and re-sharded on resume).
--
--   mpirun -np 2 build/engine recipes/tp_gpt.lua                  # TP over both ranks
--   mpirun -np 2 build/engine recipes/tp_gpt.lua --sp=1           # with sequence parallelism
--   mpirun -np 4 build/engine recipes/tp_gpt.lua --tp=2           # 2 x 2: TP pairs, data parallel across
--   make run NP=2 RECIPE=tp ARGS="--steps=100"
--
-- Extra options: --tp (0: all ranks, the default here; N: ranks per TP group) --sp (0/1).
GPT_DEFAULTS = { tp = 0 }
local here = (arg and arg[0] or "recipes/tp_gpt.lua"):match("^(.*)/[^/]*$") or "."
dofile(here .. "/gpt.lua")
