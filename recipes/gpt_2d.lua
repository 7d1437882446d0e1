-- recipes/gpt_2d.lua: the KJV GPT of recipes/gpt.lua (common_dtensor.py's Transformer, byte tokens) trained with 2-D
-- parallelism, FSDP over tensor parallelism (PyTorch's fully_shard over parallelize_module): the
-- ranks form a (dp, tp) mesh; models.Transformer.parallelize shards each attention and MLP weight and the
-- embeddings over the tp ranks of a dp row (mesh["tp"]), then dist.fully_shard shards every block and the root
-- over the dp ranks of a tp column (mesh["dp"]): each parameter is a 2-D DTensor ([Shard(1), tp placement], or
-- [_StridedShard(1, sf=tp), Shard(1)] where both shard dim 1) and each rank holds 1/(dp x tp) of it.  FSDP's
-- all-gathers and reduce-scatters run within a tp column, TP's collectives within a dp row.
--
--   build/engine tools/prepare_data.lua                                  # data/kjv_{train,val}.bin (make data)
--   mpirun -np 4 build/engine recipes/gpt_2d.lua                         # 2 x 2: dp 2, tp 2
--   mpirun -np 4 build/engine recipes/gpt_2d.lua --sp=1                  # with sequence parallelism
--   mpirun -np 8 build/engine recipes/gpt_2d.lua --hsdp=2                # HSDP + TP: mesh (2, 2, 2)
--   make run RECIPE=gpt_2d NP=4 ARGS="--steps=100"
--
-- Options: those of recipes/fsdp_gpt.lua (the model, training, data, logging, sampling and checkpoint options
-- of recipes/gpt.lua, and --reshard_after_forward (true or false here: N is not supported with TP)
-- --param_dtype --reduce_dtype --grad_accum), and
--   --tp=N     ranks per tensor-parallel group (default 2; 1 gives a (W, 1) mesh: FSDP alone through the 2-D path);
--              the data-parallel size is dp = W / N
--   --sp=1     sequence parallelism under TP (the norms and the residual stream sharded over the sequence;
--              --seq divisible by N)
--   --hsdp=R   HSDP + TP: a 3-D mesh (R, dp / R, tp) named (replicate, shard, tp): fully_shard on
--              mesh{"replicate", "shard"} (parameters sharded over dp / R ranks, replicated over R)
-- --batch is the rows per data-parallel rank: the global batch is batch x grad_accum x dp; the tp ranks of one dp
-- row read the same rows.  The run equals recipes/gpt.lua on one process with --batch=batch*grad_accum*dp (the
-- same initial weights and global batches; spec/dist/gpt_2d_recipe_spec.lua checks the losses to 1e-5).
-- Logging, validation, the sample and the distributed checkpoints are recipes/fsdp_gpt.lua's (this file runs it):
-- a checkpoint saved here loads into recipes/fsdp_gpt.lua, recipes/tp_gpt.lua or recipes/gpt.lua and back, at any
-- mesh.
--
-- The 2 x 2 mesh of `mpirun -np 4` (rank = dp * tp_size + tp):
--
--                 tp 0     tp 1
--              +--------+--------+
--        dp 0  | rank 0 | rank 1 |   <- a dp row: one TP group (mesh["tp"]), the same batch rows
--              +--------+--------+
--        dp 1  | rank 2 | rank 3 |
--              +--------+--------+
--                  ^ a tp column: one FSDP group (mesh["dp"]): all-gather / reduce-scatter of the tp shard
FSDP_GPT = { name = "gpt_2d", defaults = { tp = 2, sp = 0 }, two_d = true }
local here = (arg and arg[0] or "recipes/gpt_2d.lua"):match("^(.*)/[^/]*$") or "."
local ok, err = pcall(dofile, here .. "/fsdp_gpt.lua")
FSDP_GPT = nil
if not ok then error(err, 0) end
