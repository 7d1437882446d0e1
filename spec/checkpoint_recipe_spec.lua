-- recipes/gpt.lua, recipes/tp_gpt.lua, recipes/fsdp_gpt.lua, recipes/gpt_2d.lua and recipes/dp_gpt.lua with
-- distributed checkpoints: a run saved at 4 ranks resumes at 4 bit for bit (the uninterrupted run's
-- losses printed with %.17g by --log_exact=1 equal as text, and the same digest of the final parameters), at 2
-- and at 1 rank (gpt_2d: as 1x2, 2x1 and 1x1) with the losses of an uninterrupted run at that world size and
-- layout within 1e-6; --resume=latest, --ckpt_keep, --ckpt_async; a diverging run names its last good
-- checkpoint; a rank SIGKILLed while writing its data file ends the job (no hang), the previous checkpoint
-- resumes (at 4 and at 2 ranks) and the partial directory is refused naming the partial file.
-- Each run is a child job (mpirun -np N of this engine binary) on synthetic token shards this spec
-- writes, so the world size changes between runs as it does for a user.
local engine = require("engine")
local data = engine.data
local proc = require("spec.helpers.proc")
local have_mpirun = proc.have_mpirun

local TMP = os.tmpname()
os.remove(TMP)
os.execute("mkdir -p " .. TMP)

local function run(np, recipe, args, opts) return proc.job(np, recipe, args, opts) end

local function losses(out)
  local r = {}
  for line in out:gmatch("[^\n]+") do
    local s, l = line:match("^step%s+(%d+) | loss (%S+)")
    if s then r[tonumber(s)] = l end
  end
  return r
end
local function digest(out) return out:match("parameter digest (%x+)") end

describe("recipes with distributed checkpoints", function()
  local train_bin, val_bin = TMP .. "/train.bin", TMP .. "/val.bin"
  setup(function()
    local words = { "In", "the", "beginning", "God", "created", "heaven", "and", "earth.", "And", "was", "without",
      "form,", "void;", "darkness", "upon", "face", "of", "deep." }
    local text, x = {}, 7
    for i = 1, 4000 do
      x = (x * 1103515245 + 12345) % 2147483648
      text[i] = words[x % #words + 1]
    end
    local s = table.concat(text, " ")
    data.write_shard(train_bin, data.encode(s:sub(1, 20000)))
    data.write_shard(val_bin, data.encode(s:sub(20001, 24000)))
  end)
  teardown(function() os.execute("rm -rf '" .. TMP .. "'") end)

  local function tiny(extra)
    local a = { "--n_layers=1", "--dim=32", "--n_heads=4", "--seq=16", "--lr=3e-3", "--warmup=1", "--log_every=1",
      "--eval_every=0", "--eval_batches=1", "--sample_len=0", "--threads=1", "--train=" .. train_bin,
      "--val=" .. val_bin }
    for _, v in ipairs(extra) do a[#a + 1] = v end
    return a
  end

  local function close(a, b) return math.abs(tonumber(a) - tonumber(b)) <= 1e-6 * math.max(1, math.abs(tonumber(a))) end

  -- the uninterrupted 4-step runs (no checkpoints), one per recipe, world size and layout
  local plain = {}
  local function uninterrupted(recipe, np, args)
    local key = recipe .. " " .. np .. " " .. table.concat(args, " ")
    if not plain[key] then
      local a = { "--steps=4", "--ckpt_every=-1", "--log_exact=1" }
      for _, v in ipairs(args) do a[#a + 1] = v end
      local out, rc = run(np, recipe, tiny(a))
      assert.equal(0, rc, out)
      plain[key] = { losses = losses(out), digest = digest(out) }
      assert.is_not_nil(plain[key].losses[4], out)
    end
    return plain[key]
  end

  -- saved at 4 ranks (save.args), resumed at each of `at` ({np, args, label}); the global batch stays 4 rows
  local cases = {
    -- TP over all ranks (dp = 1: every world size reads the same batches)
    { name = "tp_gpt (TP over all ranks)", recipe = "recipes/tp_gpt.lua", save = { "--batch=2" },
      at = { { 4, { "--batch=2" } }, { 2, { "--batch=2" } }, { 1, { "--batch=2" } } } },
    -- data parallel: batch rows per rank
    { name = "gpt (data parallel)", recipe = "recipes/gpt.lua", save = { "--batch=1" },
      at = { { 4, { "--batch=1" } }, { 2, { "--batch=2" } }, { 1, { "--batch=4" } } } },
    -- FSDP: batch rows per rank
    { name = "fsdp_gpt (FSDP)", recipe = "recipes/fsdp_gpt.lua", save = { "--batch=1" },
      at = { { 4, { "--batch=1" } }, { 2, { "--batch=2" } }, { 1, { "--batch=4" } } } },
    -- FSDP over TP: saved on the 2x2 (dp, tp) mesh, resumed on 2x2, 1x2, 2x1 and 1x1 (batch rows per dp rank)
    { name = "gpt_2d (FSDP + TP, saved as 2x2)", recipe = "recipes/gpt_2d.lua", save = { "--tp=2", "--batch=2" },
      at = { { 4, { "--tp=2", "--batch=2" }, "2x2" }, { 2, { "--tp=2", "--batch=4" }, "1x2" },
        { 2, { "--tp=1", "--batch=2" }, "2x1" }, { 1, { "--tp=1", "--batch=4" }, "1x1" } } },
  }
  local dirs = {}
  for _, c in ipairs(cases) do
    local where = {}
    for _, a in ipairs(c.at) do where[#where + 1] = a[3] or tostring(a[1]) end
    it(c.name .. ": saved at 4 ranks, resumed at " .. table.concat(where, ", ") .. " (4: bit for bit)", function()
      if not have_mpirun() then pending("needs mpirun"); return end
      local dir = TMP .. "/" .. c.recipe:gsub("%W", "_")
      dirs[c.recipe] = dir
      local a = { "--steps=4", "--ckpt_every=2", "--ckpt_dir=" .. dir, "--log_exact=1" }
      for _, v in ipairs(c.save) do a[#a + 1] = v end
      local out, rc = run(4, c.recipe, tiny(a))
      assert.equal(0, rc, out)
      local full = { losses = losses(out), digest = digest(out) }
      assert.is_not_nil(full.losses[4], out)
      assert.is_not_nil(full.digest, out)
      assert.is_not_nil(io.open(dir .. "/step_00000002/.metadata", "rb"), "no checkpoint at step 2")
      -- (saving does not change the run: the same losses and parameters as without checkpoints, bit for bit)
      local ref4 = uninterrupted(c.recipe, 4, c.save)
      assert.same(ref4, full)
      for _, at in ipairs(c.at) do
        local np, args, label = at[1], at[2], at[3] or (at[1] .. " ranks")
        local ra = { "--steps=4", "--ckpt_every=-1", "--ckpt_dir=" .. dir, "--resume=" .. dir .. "/step_00000002",
          "--log_exact=1" }
        for _, v in ipairs(args) do ra[#ra + 1] = v end
        local o2, rc2 = run(np, c.recipe, tiny(ra))
        assert.equal(0, rc2, o2)
        assert.is_truthy(o2:find("at step 2", 1, true), o2)
        local l = losses(o2)
        assert.is_nil(l[2])
        local ref = uninterrupted(c.recipe, np, args)
        for s = 3, 4 do
          assert.is_not_nil(l[s], o2)
          if np == 4 then
            assert.equal(ref.losses[s], l[s], "step " .. s .. " at " .. label .. ": not bit for bit")
          else
            assert.is_true(close(ref.losses[s], l[s]), string.format("step %d at %s: %s resumed vs %s uninterrupted", s,
              label, l[s], ref.losses[s]))
          end
        end
        if np == 4 then assert.equal(ref.digest, digest(o2), "the final parameters at 4 ranks: not bit for bit") end
      end
    end)
  end

  it("dp_gpt (DTensor data parallel): saved at 4 ranks, resumed at 2 and 1 with the global batch kept", function()
    if not have_mpirun() then pending("needs mpirun"); return end
    local dir = TMP .. "/dp"
    local function args(np, extra)
      local a = { "--n_layers=1", "--dim=32", "--n_heads=4", "--seq=16", "--lr=3e-3", "--log_every=1", "--threads=1",
        "--steps=4", "--train=" .. train_bin, "--val=" .. val_bin, "--eval_batches=1", "--sample_len=0", "--ckpt_dir=" .. dir,
        "--batch=" .. math.floor(4 / np) }
      for _, v in ipairs(extra) do a[#a + 1] = v end
      return a
    end
    local out, rc = run(4, "recipes/dp_gpt.lua", args(4, { "--ckpt_every=2" }))
    assert.equal(0, rc, out)
    local full = losses(out)
    for _, np in ipairs({ 2, 1 }) do
      local o2, rc2 = run(np, "recipes/dp_gpt.lua", args(np, { "--ckpt_every=-1", "--resume=" .. dir .. "/step_00000002" }))
      assert.equal(0, rc2, o2)
      local l = losses(o2)
      assert.is_nil(l[2])
      for s = 3, 4 do
        assert.is_true(close(full[s], l[s]), string.format("step %d at %d ranks: %s vs %s", s, np, tostring(l[s]), full[s]))
      end
    end
  end)

  it("--resume=latest, --ckpt_keep and --ckpt_async (2 ranks)", function()
    if not have_mpirun() then pending("needs mpirun"); return end
    local dir = TMP .. "/keep"
    local out, rc = run(2, "recipes/tp_gpt.lua", tiny({ "--batch=2", "--steps=4", "--ckpt_every=1", "--ckpt_keep=2",
      "--ckpt_async=1", "--ckpt_dir=" .. dir }))
    assert.equal(0, rc, out)
    local full = losses(out)
    assert.is_nil(io.open(dir .. "/step_00000002/.metadata", "rb"))
    assert.is_not_nil(io.open(dir .. "/step_00000003/.metadata", "rb"))
    assert.is_not_nil(io.open(dir .. "/step_00000004/.metadata", "rb"))
    os.execute("rm -rf '" .. dir .. "/step_00000004'")
    local o2, rc2 = run(1, "recipes/tp_gpt.lua", tiny({ "--batch=2", "--steps=4", "--ckpt_every=-1", "--ckpt_dir=" .. dir,
      "--resume=latest" }))
    assert.equal(0, rc2, o2)
    assert.is_truthy(o2:find("step_00000003 at step 3", 1, true), o2)
    assert.is_true(close(full[4], losses(o2)[4]), o2)
  end)

  it("a diverging run stops naming the step and the last good checkpoint", function()
    local dir = TMP .. "/keep"    -- (the checkpoints of the test above: the newest is step 3)
    local out, rc = run(0, "recipes/tp_gpt.lua", tiny({ "--batch=2", "--steps=30", "--ckpt_every=-1", "--ckpt_dir=" .. dir,
      "--resume=latest", "--lr=1e30", "--grad_clip=0", "--warmup=0" }))
    assert.is_true(rc ~= 0, out)
    assert.is_truthy(out:find("at step %d+") and out:find("last good checkpoint: " .. dir .. "/step_00000003", 1, true), out)
  end)

  it("fsdp_gpt and gpt_2d: a diverging run names the step and the last good checkpoint (resumed or saved)", function()
    if not have_mpirun() then pending("needs mpirun"); return end
    local diverge = { "--steps=30", "--lr=1e30", "--grad_clip=0", "--warmup=0" }
    -- resumed at 2 ranks from the newest checkpoint of the FSDP case above (its final save, step 4)
    local dir = dirs["recipes/fsdp_gpt.lua"]
    assert.is_truthy(dir, "the fsdp_gpt case did not run")
    local a = tiny({ "--batch=2", "--ckpt_every=-1", "--ckpt_dir=" .. dir, "--resume=latest", unpack(diverge) })
    local out, rc = run(2, "recipes/fsdp_gpt.lua", a)
    assert.is_true(rc ~= 0, out)
    assert.is_truthy(out:find("fsdp_gpt: the loss is %S+ at step %d+") and
      out:find("last good checkpoint: " .. dir .. "/step_00000004)", 1, true), out)
    -- gpt_2d on one process, a fresh run saving every step: the step-1 checkpoint is named when step 2 diverges
    local dir2 = TMP .. "/diverge_2d"
    out, rc = run(0, "recipes/gpt_2d.lua", tiny({ "--tp=1", "--batch=4", "--ckpt_every=1", "--ckpt_dir=" .. dir2,
      unpack(diverge) }))
    assert.is_true(rc ~= 0, out)
    assert.is_truthy(out:find("gpt_2d: the loss is %S+ at step 2 ") and
      out:find("last good checkpoint: " .. dir2 .. "/step_00000001)", 1, true), out)
  end)

  it("fsdp_gpt: a rank SIGKILLed while writing its data file ends the job; the previous checkpoint resumes at 4 "
    .. "and 2 ranks; the partial directory is refused naming the file", function()
    if not have_mpirun() then pending("needs mpirun"); return end
    local dir = TMP .. "/killed"
    -- rank 3 writes half of its first chunk of step 3's checkpoint, then kill(getpid(), SIGKILL)
    local t0 = engine.time()
    local out, rc = run(4, "recipes/fsdp_gpt.lua", tiny({ "--batch=1", "--steps=4", "--ckpt_every=1", "--log_exact=1",
      "--ckpt_dir=" .. dir }), { env = { ENGINE_CKPT_TEST_KILL = "step_00000003/__3_0.distcp" }, timeout = 60 })
    local took = engine.time() - t0
    assert.is_true(rc ~= 0 and rc ~= 124, out)
    assert.is_true(took < 55, string.format("the job took %.1f s: a hang ended by the timeout", took))
    assert.is_truthy(out:find("signal 9", 1, true), out)    -- mpirun: "exited on signal 9 (Killed)"
    assert.is_nil(out:find("saved " .. dir .. "/step_00000003", 1, true), out)
    assert.is_not_nil(io.open(dir .. "/step_00000002/.metadata", "rb"), "step 2 was not committed")
    assert.is_nil(io.open(dir .. "/step_00000003/.metadata", "rb"), "step 3 was committed")
    -- the partial directory: refused on every rank, naming the partial data file
    local o1, rc1 = run(2, "recipes/fsdp_gpt.lua", tiny({ "--batch=2", "--steps=4", "--ckpt_every=-1",
      "--resume=" .. dir .. "/step_00000003" }))
    assert.is_true(rc1 ~= 0, o1)
    assert.is_truthy(o1:find("no metadata file", 1, true) and
      o1:find(("partial data file(s) " .. dir .. "/step_00000003/__3_0.distcp.tmp"):gsub("%p", "%%%0") ..
        "%d+ left by an interrupted save"), o1)
    -- --resume=latest skips it: step 2, then the uninterrupted runs' losses (4 ranks: bit for bit)
    for _, at in ipairs({ { 4, { "--batch=1" } }, { 2, { "--batch=2" } } }) do
      local np, args = at[1], at[2]
      local o2, rc2 = run(np, "recipes/fsdp_gpt.lua", tiny({ "--steps=4", "--ckpt_every=-1", "--ckpt_dir=" .. dir,
        "--resume=latest", "--log_exact=1", unpack(args) }))
      assert.equal(0, rc2, o2)
      assert.is_truthy(o2:find("resumed from " .. dir .. "/step_00000002 at step 2", 1, true), o2)
      local l, ref = losses(o2), uninterrupted("recipes/fsdp_gpt.lua", np, args)
      for s = 3, 4 do
        if np == 4 then assert.equal(ref.losses[s], l[s], "step " .. s .. " at 4 ranks")
        else assert.is_true(close(ref.losses[s], l[s]), string.format("step %d at %d ranks: %s vs %s", s, np,
          tostring(l[s]), ref.losses[s])) end
      end
    end
  end)
end)
