-- recipes/gpt_2d.lua (FSDP over tensor parallelism on a (dp, tp) mesh) trains with the losses of
-- the single-process recipe (recipes/gpt.lua on one process with the global batch: batch x dp rows) to 1e-5
-- relative: at 4 ranks on the 2x2 mesh with and without --sp, and HSDP + TP on the (replicate, shard, tp) mesh
-- (2, 1, 2); at 2 ranks on (2, 1) and (1, 2) (with and without --sp); at 1 rank on (1, 1).  It logs the mesh, each
-- rank's local shard memory, the validation loss and a sample; it resumes exactly from its distributed
-- checkpoint; bad options fail on every rank.
-- The single-process references run in a child engine started by rank 0 (mpirun's environment removed, so it is
-- a world of one) while the 2-D runs go on; at 1 rank they run in this process.
local engine = require("engine")
local dist = engine.distributed
local W, R = dist.world_size(), dist.rank()

local STEPS = 3

local rhelp = require("spec.dist.helpers.recipe")
local function run(file, argv, nsteps) return rhelp.run(file, argv, nsteps or STEPS) end
-- its own small token shards (the suite does not need data/), written by rank 0
local base_path, train_bin, val_bin = rhelp.tiny_data("gpt_2d_recipe", 7)

local B = 2    -- rows per data-parallel rank
local argv = rhelp.argv_builder({ "--n_layers=2", "--dim=32", "--n_heads=4", "--seq=16", "--log_every=1",
  "--eval_every=0", "--eval_batches=1", "--warmup=1", "--lr=3e-3", "--threads=1", "--train=" .. train_bin,
  "--val=" .. val_bin }, { { "steps", STEPS }, { "ckpt_every", -1 }, { "sample_len", 0 } })

-- the meshes of this world size: {name, args, dp (the data-parallel size: the reference's batch is B x dp)}
local configs
if W == 4 then
  configs = {
    { name = "2x2", args = { "--tp=2", "--sample_len=6" }, dp = 2 },
    { name = "2x2 --sp=1", args = { "--tp=2", "--sp=1", "--sample_len=6" }, dp = 2 },
    { name = "HSDP + TP (2, 1, 2)", args = { "--tp=2", "--hsdp=2" }, dp = 2 },
    { name = "HSDP + TP + SP (2, 1, 2)", args = { "--tp=2", "--hsdp=2", "--sp=1" }, dp = 2 },
  }
elseif W == 2 then
  configs = {
    { name = "(2, 1)", args = { "--tp=1", "--sample_len=6" }, dp = 2 },
    { name = "(1, 2)", args = { "--tp=2", "--sample_len=6" }, dp = 1 },
    { name = "(1, 2) --sp=1", args = { "--tp=2", "--sp=1" }, dp = 1 },
  }
else
  configs = { { name = "(" .. W .. ", 1)", args = { "--tp=1", "--sample_len=6" }, dp = W } }
end
-- the single-process references: recipes/gpt.lua with the global batch of one step, one per dp size in use
local ref_rows, ref_of = {}, {}
for _, c in ipairs(configs) do
  if not ref_of[c.dp] then ref_rows[#ref_rows + 1] = B * c.dp; ref_of[c.dp] = #ref_rows end
end
-- (started now by rank 0 in a child engine)
local ref_argvs = {}
for i, rows in ipairs(ref_rows) do ref_argvs[i] = argv({ "--batch=" .. rows }) end
local ref = rhelp.references("gpt_2d_recipe_spec", base_path, ref_argvs, STEPS)

describe("recipes/gpt_2d.lua", function()
  teardown(function()
    ref.close()
    if W > 1 then dist.barrier() end
    if R == 0 then os.execute("rm -rf '" .. base_path .. "'_* 2>/dev/null") end
  end)

  local results = {}
  for _, cfg in ipairs(configs) do
    it(cfg.name .. ": the losses of the single-process recipe on the global batch", function()
      local extra = { "--batch=" .. B }
      for _, x in ipairs(cfg.args) do extra[#extra + 1] = x end
      local losses, lines = run("recipes/gpt_2d.lua", argv(extra))
      results[#results + 1] = { cfg = cfg, lines = lines }
      assert.is_true(losses[STEPS] < losses[1], "the loss does not fall")
      rhelp.check_equal(cfg.name, losses, ref.get()[ref_of[cfg.dp]], "FSDP + TP")
    end)
  end

  it("logs the mesh, each rank's local shard memory, the validation loss and a sample", function()
    local r = results[1]
    assert.is_truthy(r and r.cfg == configs[1], "the first run did not complete")
    if R ~= 0 then return end
    local tp = W / r.cfg.dp
    local mem, val, sample = rhelp.shard_log("gpt_2d", r.lines)
    local mesh_line = false
    for _, l in ipairs(r.lines) do
      if l:find(string.format("tensor parallel over %d rank(s)", tp), 1, true)
        and l:find(string.format("data parallel over %d", r.cfg.dp), 1, true) then mesh_line = true end
    end
    assert.are.equal(W, mem)
    assert.are.equal(2, val)
    assert.is_true(sample, "no sample printed")
    assert.is_true(mesh_line, "no mesh line")
  end)

  it("resumes from its distributed checkpoint with the uninterrupted run's losses", function()
    local d = base_path .. "_ckpt"
    local tp = W >= 2 and "--tp=2" or "--tp=1"
    rhelp.check_resume("gpt_2d", "recipes/gpt_2d.lua",
      argv({ tp, "--batch=" .. B, "--steps=4", "--ckpt_every=2", "--ckpt_dir=" .. d }),
      argv({ tp, "--batch=" .. B, "--steps=4", "--ckpt_every=-1", "--resume=" .. d .. "/step_00000002" }), 3, 4)
    if W > 1 then dist.barrier() end
    if R == 0 then os.execute("rm -rf '" .. d .. "'") end
  end)

  it("refuses bad options on every rank", function()
    local function fails(extra, msg)
      local ok, e = pcall(run, "recipes/gpt_2d.lua", argv(extra))
      assert.is_false(ok)
      assert.is_truthy(tostring(e):find(msg, 1, true), tostring(e))
    end
    fails({ "--batch=2", "--tp=" .. (W + 1) }, "gpt_2d: --tp=" .. (W + 1) .. " does not divide the " .. W .. " ranks")
    fails({ "--batch=2", "--tp=1", "--hsdp=" .. (W + 1) }, "does not divide the " .. W .. " ranks")
    fails({ "--batch=2", "--tp=1", "--sp=1" }, "--sp=1 needs tensor parallelism")
    fails({ "--batch=2", "--tp=0" }, "--tp must be an integer >= 1, got '0'")
    if W >= 2 then
      fails({ "--batch=2", "--tp=2", "--sp=1", "--seq=15" }, "--seq=15 must be divisible by --tp=2")
    end
    if W == 4 then
      fails({ "--batch=2", "--tp=2", "--hsdp=4" }, "--hsdp=4 does not divide the 2 data-parallel ranks (4 ranks / --tp=2)")
    end
    -- recipes/fsdp_gpt.lua itself has no --tp (FSDP_GPT is only set while gpt_2d.lua runs)
    local ok, e = pcall(run, "recipes/fsdp_gpt.lua", argv({ "--batch=2", "--tp=2" }))
    assert.is_false(ok)
    assert.is_truthy(tostring(e):find("fsdp_gpt: unknown option '--tp'", 1, true), tostring(e))
  end)
end)
