-- recipes/gpt_2d.lua (FSDP over tensor parallelism on a (dp, tp) mesh, issue 15 item 4) trains with the losses of
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
local HOME = (ENGINE_HOME and ENGINE_HOME ~= "") and ENGINE_HOME or "."

local rhelp = require("spec.dist.helpers.recipe")
local function run(file, argv, nsteps) return rhelp.run(file, argv, nsteps or STEPS) end
-- its own small token shards (the suite does not need data/), written by rank 0
local base_path, train_bin, val_bin = rhelp.tiny_data("gpt_2d_recipe", 7)

local B = 2    -- rows per data-parallel rank
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
  if not has.sample_len then a[#a + 1] = "--sample_len=0" end
  return a
end

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
local function ref_argv(rows) return argv({ "--batch=" .. rows }) end

-- rank 0 starts the child now and reads it at the end (it runs while this process trains)
local child
if R == 0 and W > 1 then
  local exe = require("spec.helpers.proc").self_exe()
  local code = {}
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
    child = nil
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
    if not ok then io.stderr:write("gpt_2d_recipe_spec: the single-process reference failed:\n" .. out .. "\n") end
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
      string.format("%s step %d: %.7f with FSDP + TP at %d ranks vs %.7f on one process", name, s, got[s], W, want[s]))
  end
end

describe("recipes/gpt_2d.lua", function()
  teardown(function()
    if child then pcall(function() child:read("*a"); child:close() end) end
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
      check_equal(cfg.name, losses, references()[ref_of[cfg.dp]])
    end)
  end

  it("logs the mesh, each rank's local shard memory, the validation loss and a sample", function()
    local r = results[1]
    assert.is_truthy(r and r.cfg == configs[1], "the first run did not complete")
    if R ~= 0 then return end
    local tp = W / r.cfg.dp
    local mem, val, sample, mesh_line = 0, 0, false, false
    for _, l in ipairs(r.lines) do
      local p, g, o = l:match("^gpt_2d: rank %d+ local shards: parameters ([%d.]+) MiB, gradients ([%d.]+) MiB, "
        .. "optimizer state ([%d.]+) MiB")
      if p then
        mem = mem + 1
        assert.is_true(math.abs(tonumber(o) - 2 * tonumber(p)) <= 0.02 and math.abs(tonumber(g) - tonumber(p)) <= 0.01, l)
      end
      if l:match("^step +%d+ | val loss [%d.]+") then val = val + 1 end
      if l:match("^gpt_2d: sample") then sample = true end
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
    local full_run = run("recipes/gpt_2d.lua", argv({ tp, "--batch=" .. B, "--steps=4", "--ckpt_every=2",
      "--ckpt_dir=" .. d }), 4)
    local resumed = run("recipes/gpt_2d.lua", argv({ tp, "--batch=" .. B, "--steps=4", "--ckpt_every=-1",
      "--resume=" .. d .. "/step_00000002" }), 4)
    for s = 3, 4 do
      assert.is_true(math.abs(resumed[s] - full_run[s]) <= 1e-6 * full_run[s],
        string.format("step %d: %.7f resumed vs %.7f", s, resumed[s], full_run[s]))
    end
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
    fails({ "--batch=2", "--tp=0" }, "--tp must be a positive integer")
    if W >= 2 then
      fails({ "--batch=2", "--tp=2", "--sp=1", "--seq=15" }, "--seq=15 must be divisible by --tp=2")
    end
    if W == 4 then
      fails({ "--batch=2", "--tp=2", "--hsdp=4" }, "--hsdp=4 does not divide the 2 data-parallel ranks (4 ranks / --tp=2)")
    end
    -- recipes/fsdp_gpt.lua itself has no --tp (FSDP_GPT is only set while gpt_2d.lua runs)
    local ok, e = pcall(run, "recipes/fsdp_gpt.lua", argv({ "--batch=2", "--tp=2" }))
    assert.is_false(ok)
    assert.is_truthy(tostring(e):find("fsdp_gpt: unknown option --tp", 1, true), tostring(e))
  end)
end)
