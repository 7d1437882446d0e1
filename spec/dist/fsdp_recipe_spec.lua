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
local HOME = (ENGINE_HOME and ENGINE_HOME ~= "") and ENGINE_HOME or "."

local rhelp = require("spec.dist.helpers.recipe")
local function run(file, argv, nsteps) return rhelp.run(file, argv, nsteps or STEPS) end
-- its own small token shards (the suite does not need data/), written by rank 0
local base_path, train_bin, val_bin = rhelp.tiny_data("fsdp_recipe", 11)

local B = 2    -- rows per rank per microbatch
local common = { "--n_layers=2", "--dim=32", "--n_heads=4", "--seq=16", "--log_every=1", "--eval_every=0",
  "--eval_batches=1", "--warmup=1", "--lr=3e-3", "--threads=1", "--train=" .. train_bin,
  "--val=" .. val_bin }
local function argv(extra)
  local a = {}
  for _, v in ipairs(common) do a[#a + 1] = v end
  for _, v in ipairs(extra) do a[#a + 1] = v end
  local has = {}
  for _, v in ipairs(a) do has[v:match("^%-%-([%w_]+)=") or ""] = true end
  if not has.steps then a[#a + 1] = "--steps=" .. STEPS end
  if not has.ckpt_every then a[#a + 1] = "--ckpt_every=-1" end
  return a
end
-- the single-process references: recipes/gpt.lua with the global batch of one step (B x W rows; B x 2 x W
-- for grad_accum=2)
local ref_rows = { B * W, 2 * B * W }
local function ref_argv(rows) return argv({ "--batch=" .. rows, "--sample_len=0", "--ckpt_every=-1" }) end

-- rank 0 starts the child now and reads it at the end (it runs while this process trains)
local child
if R == 0 and W > 1 then
  local exe = require("spec.helpers.proc").self_exe()
  local code = { "local R = {}" }
  for i, rows in ipairs(ref_rows) do
    local a = {}
    for _, v in ipairs(ref_argv(rows)) do a[#a + 1] = string.format("%q", v) end
    code[#code + 1] = string.format("arg = { [0] = 'recipes/gpt.lua', %s }; print('__ref %d'); dofile('recipes/gpt.lua')",
      table.concat(a, ", "), i)
  end
  local script = base_path .. "_ref.lua"
  local f = assert(io.open(script, "w"))
  f:write(table.concat(code, "\n"), "\n")
  f:close()
  -- the MPI launcher's environment (OMPI_*, PMIX_*) must not leak into the child (else MPI_Init joins this job)
  child = io.popen(string.format("cd '%s' && env $(env | sed -n 's/^\\(OMPI_[^=]*\\|PMIX_[^=]*\\)=.*/-u \\1/p') "
    .. "'%s' '%s' 2>&1; echo __rc=$?", HOME, exe, script))
end

local refs     -- refs[i][step] on every rank
local function references()
  if refs then return refs end
  refs = {}
  if W == 1 then
    for i, rows in ipairs(ref_rows) do refs[i] = run("recipes/gpt.lua", ref_argv(rows)) end
    return refs
  end
  local vals = {}
  if R == 0 then
    local out = child:read("*a")
    child:close()
    local which, per = 0, {}
    for line in out:gmatch("[^\n]+") do
      local k = line:match("^__ref (%d+)")
      if k then which = tonumber(k); per[which] = {} end
      local step, loss = line:match("^step%s+(%d+) | loss ([%d.]+)")
      if step and which > 0 then per[which][tonumber(step)] = tonumber(loss) end
    end
    local ok = out:match("__rc=0") and per[#ref_rows] and per[#ref_rows][STEPS]
    for i = 1, #ref_rows do
      for s = 1, STEPS do vals[#vals + 1] = ok and per[i][s] or 0 / 0 end
    end
    if not ok then io.stderr:write("fsdp_recipe_spec: the single-process reference failed:\n" .. out .. "\n") end
  else
    for _ = 1, #ref_rows * STEPS do vals[#vals + 1] = 0 end
  end
  local t = engine.tensor(vals, "f64")
  dist.all_reduce(t, "sum")
  local tl = t:totable()
  for i = 1, #ref_rows do
    refs[i] = {}
    for s = 1, STEPS do refs[i][s] = tl[(i - 1) * STEPS + s] end
  end
  return refs
end

local function check_equal(name, got, want)
  for s = 1, STEPS do
    assert.is_true(want[s] == want[s], name .. ": no single-process reference (see stderr)")
    assert.is_true(math.abs(got[s] - want[s]) <= 1e-5 * math.abs(want[s]),
      string.format("%s step %d: %.7f with FSDP at %d ranks vs %.7f on one process", name, s, got[s], W, want[s]))
  end
end

describe("recipes/fsdp_gpt.lua", function()
  teardown(function()
    if child then pcall(function() child:read("*a"); child:close() end) end
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
      check_equal(cfg.name, losses, references()[cfg.ref])
    end)
  end

  it("mixed precision (param_dtype=bf16, reduce_dtype=f32): bf16 compute, close to the f32 losses", function()
    local losses = run("recipes/fsdp_gpt.lua", argv({ "--batch=" .. B, "--sample_len=0", "--param_dtype=bf16",
      "--reduce_dtype=f32" }))
    local want, differs = references()[1], false
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
    local mem, val, sample = 0, 0, false
    for _, l in ipairs(r.lines) do
      local p, g, o = l:match("^fsdp_gpt: rank %d+ local shards: parameters ([%d.]+) MiB, gradients ([%d.]+) MiB, "
        .. "optimizer state ([%d.]+) MiB")
      if p then
        mem = mem + 1
        -- AdamW: two states per parameter, gradients the parameters' size (sharded: about 1/W each)
        assert.is_true(math.abs(tonumber(o) - 2 * tonumber(p)) <= 0.02 and math.abs(tonumber(g) - tonumber(p)) <= 0.01, l)
      end
      if l:match("^step +%d+ | val loss [%d.]+") then val = val + 1 end
      if l:match("^fsdp_gpt: sample") then sample = true end
    end
    assert.are.equal(W, mem)
    assert.are.equal(2, val)
    assert.is_true(sample, "no sample printed")
  end)

  it("resumes from its distributed checkpoint with the uninterrupted run's losses", function()
    local d = base_path .. "_ckpt"
    local full_run = run("recipes/fsdp_gpt.lua", argv({ "--batch=" .. B, "--sample_len=0", "--steps=4",
      "--ckpt_every=2", "--ckpt_dir=" .. d }), 4)
    local resumed = run("recipes/fsdp_gpt.lua", argv({ "--batch=" .. B, "--sample_len=0", "--steps=4",
      "--ckpt_every=-1", "--resume=" .. d .. "/step_00000002" }), 4)
    for s = 3, 4 do
      assert.is_true(math.abs(resumed[s] - full_run[s]) <= 1e-6 * full_run[s],
        string.format("step %d: %.7f resumed vs %.7f", s, resumed[s], full_run[s]))
    end
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
