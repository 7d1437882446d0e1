-- recipes/dp_gpt.lua: recipes/gpt.lua with DTensor data parallelism as its default (--dtensor_dp=1): the
-- parameters are Replicate DTensors on a 1-D "dp" mesh, each rank's batch is its Shard(1) rows of the global batch
-- (DTensor.from_local), the loss a Partial(sum) DTensor (local sum / global token count), and the gradients are
-- all-reduced by the DTensor autograd (AccumulateGrad redistributes each Partial gradient to its Replicate
-- parameter).  recipes/gpt.lua without --dtensor_dp does the same with plain tensors and DistributedDataParallel.
-- Every option of recipes/gpt.lua applies (--help lists them); the model makes its positions with engine.arange (a
-- plain tensor): the forward runs inside dist.implicit_replication, where plain tensors count as Replicate.
--
--   mpirun -np 2 build/engine recipes/dp_gpt.lua [--key=value ...]     # rank 0 prints the loss
--   build/engine recipes/dp_gpt.lua --steps=20                          # one process (mesh of 1)
--   make run RECIPE=dp NP=2 ARGS="--steps=100"
GPT_DEFAULTS = { dtensor_dp = 1 }
local here = (arg and arg[0] or "recipes/dp_gpt.lua"):match("^(.*)/[^/]*$") or "."
local ok, err = pcall(dofile, here .. "/gpt.lua")
GPT_DEFAULTS = nil
if not ok then error(err, 0) end
