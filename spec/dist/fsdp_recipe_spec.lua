-- recipes/fsdp_gpt.lua (each block and the root fully sharded) trains with the losses of the single-process
-- recipe (recipes/gpt.lua on one process with the global batch) to 1e-5 relative: default options,
-- reshard_after_forward=false, grad_accum=2 (against one process with the whole step's rows) and HSDP 2x2 at 4
-- ranks, reshard_after_forward=2 at 4 ranks; bf16 mixed precision stays close; it evaluates, samples and logs
-- each rank's shard memory; it resumes exactly from its dist.checkpoint; bad options fail on every rank.
-- The single-process reference runs in a child engine started by rank 0 (mpirun's environment removed, so it
-- is a world of one) while the FSDP runs go on; at 1 rank the reference runs in this process.
local engine = require("engine")
local dist = engine.distributed
local W, R = dist.world_size(), dist.rank()

local STEPS = 3

local rhelp = require("spec.dist.helpers.recipe")
local function run(file, argv, nsteps) return rhelp.run(file, argv, nsteps or STEPS) end
-- its own small token shards (the suite does not need data/), written by rank 0
local base_path, train_bin, val_bin = rhelp.tiny_data("fsdp_recipe", 11)

local B = 2    -- rows per rank per microbatch
local argv = rhelp.argv_builder({ "--n_layers=2", "--dim=32", "--n_heads=4", "--seq=16", "--log_every=1",
  "--eval_every=0", "--eval_batches=1", "--warmup=1", "--lr=3e-3", "--threads=1", "--train=" .. train_bin,
  "--val=" .. val_bin }, { { "steps", STEPS }, { "ckpt_every", -1 } })
-- the single-process references: recipes/gpt.lua with the global batch of one step (B x W rows; B x 2 x W
-- for grad_accum=2), started now by rank 0 in a child engine
local ref = rhelp.references("fsdp_recipe_spec", base_path, {
  argv({ "--batch=" .. B * W, "--sample_len=0", "--ckpt_every=-1" }),
  argv({ "--batch=" .. 2 * B * W, "--sample_len=0", "--ckpt_every=-1" }) }, STEPS)
local function check_equal(name, got, want) rhelp.check_equal(name, got, want, "FSDP") end

describe("recipes/fsdp_gpt.lua", function()
  teardown(function()
    ref.close()
    if W > 1 then dist.barrier() end
    if R == 0 then os.execute("rm -rf '" .. base_path .. "'_* 2>/dev/null") end
  end)

  local results = {}
  local configs = {
    { name = "default", args = {}, ref = 1 },
    { name = "reshard_after_forward=false", args = { "--reshard_after_forward=false" }, ref = 1 },
    { name = "grad_accum=2", args = { "--grad_accum=2" }, ref = 2 },
    { name = "HSDP 2x2", args = { "--hsdp=2" }, ref = 1, ranks = 4 },
    { name = "reshard_after_forward=2", args = { "--reshard_after_forward=2" }, ref = 1, ranks = 4 },
  }
  for _, cfg in ipairs(configs) do
    it(cfg.name .. ": the losses of the single-process recipe on the global batch", function()
      if cfg.ranks and W ~= cfg.ranks then return end
      local a = argv({ "--batch=" .. B, cfg.name == "default" and "--sample_len=6" or "--sample_len=0" })
      for _, x in ipairs(cfg.args) do a[#a + 1] = x end
      local losses, lines = run("recipes/fsdp_gpt.lua", a)
      results[cfg.name] = { losses = losses, lines = lines }
      assert.is_true(losses[STEPS] < losses[1], "the loss does not fall")
      check_equal(cfg.name, losses, ref.get()[cfg.ref])
    end)
  end

  it("mixed precision (param_dtype=bf16, reduce_dtype=f32): bf16 compute, close to the f32 losses", function()
    local losses = run("recipes/fsdp_gpt.lua", argv({ "--batch=" .. B, "--sample_len=0", "--param_dtype=bf16",
      "--reduce_dtype=f32" }))
    local want, differs = ref.get()[1], false
    for s = 1, STEPS do
      assert.is_true(math.abs(losses[s] - want[s]) <= 2e-3 * want[s],
        string.format("bf16 step %d: %.6f vs f32 %.6f", s, losses[s], want[s]))
      if losses[s] ~= want[s] then differs = true end
    end
    assert.is_true(differs, "bf16 losses identical to f32: the policy is not applied")
  end)

  it("logs each rank's local shard memory, the validation loss and a sample", function()
    local r = results.default
    assert.is_truthy(r, "the default run did not complete")
    if R ~= 0 then return end
    local mem, val, sample = rhelp.shard_log("fsdp_gpt", r.lines)
    assert.are.equal(W, mem)
    assert.are.equal(2, val)
    assert.is_true(sample, "no sample printed")
  end)

  it("resumes from its distributed checkpoint with the uninterrupted run's losses", function()
    local d = base_path .. "_ckpt"
    rhelp.check_resume("fsdp_gpt", "recipes/fsdp_gpt.lua",
      argv({ "--batch=" .. B, "--sample_len=0", "--steps=4", "--ckpt_every=2", "--ckpt_dir=" .. d }),
      argv({ "--batch=" .. B, "--sample_len=0", "--steps=4", "--ckpt_every=-1", "--resume=" .. d .. "/step_00000002" }),
      3, 4)
    if W > 1 then dist.barrier() end
    if R == 0 then os.execute("rm -rf '" .. d .. "'") end
  end)

  it("refuses bad options on every rank", function()
    local ok, e = pcall(run, "recipes/fsdp_gpt.lua", argv({ "--batch=2", "--hsdp=" .. (W + 1) }))
    assert.is_false(ok)
    assert.is_truthy(tostring(e):find("does not divide the " .. W .. " ranks", 1, true), tostring(e))
    ok, e = pcall(run, "recipes/fsdp_gpt.lua", argv({ "--batch=2", "--reshard_after_forward=maybe" }))
    assert.is_false(ok)
    assert.is_truthy(tostring(e):find("--reshard_after_forward must be true, false or a rank count", 1, true), tostring(e))
  end)
end)
