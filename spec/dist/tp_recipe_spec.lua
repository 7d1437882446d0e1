-- recipes/tp_gpt.lua (recipes/gpt.lua with --tp): trains, evaluates, samples, and resumes from its
-- full-tensor checkpoint with the losses of an uninterrupted run (TP and TP+SP, and 2 x 2 TP x DP).
local engine = require("engine")
local dist = engine.distributed
local W, R = dist.world_size(), dist.rank()

local rhelp = require("spec.dist.helpers.recipe")
-- Runs the recipe in this process with argv; returns the training losses rank 0 printed (on every rank) and the
-- printed lines.
local function run(argv, nsteps) return rhelp.run("recipes/tp_gpt.lua", argv, nsteps) end
-- its own small token shards (the suite does not need data/), written by rank 0; ck: the base of the paths
local ck, train_bin, val_bin = rhelp.tiny_data("tp_recipe", 11)

local base = { "--n_layers=1", "--dim=32", "--n_heads=4", "--seq=16", "--batch=2", "--log_every=1", "--eval_every=0",
  "--eval_batches=1", "--warmup=2", "--lr=3e-3", "--train=" .. train_bin, "--val=" .. val_bin }
local argv = rhelp.argv_builder(base)

describe("recipes/tp_gpt.lua", function()
  teardown(function()
    dist.barrier()
    if R == 0 then os.execute("rm -rf '" .. ck .. "'* 2>/dev/null") end
  end)

  for _, cfg in ipairs({ { name = "TP", args = {} }, { name = "TP+SP", args = { "--sp=1" } },
                          { name = "TP x DP (2x2)", args = { "--tp=2" }, ranks = 4 } }) do
    it(cfg.name .. ": resumes from its checkpoint with the uninterrupted run's losses", function()
      if W < (cfg.ranks or 2) or (cfg.ranks and W ~= cfg.ranks) then return end
      local d = ck .. "_" .. cfg.name:gsub("%W", "")
      local a = argv({ "--steps=6", "--ckpt_every=3", "--sample_len=8", "--ckpt_dir=" .. d })
      for _, x in ipairs(cfg.args) do a[#a + 1] = x end
      local b = argv({ "--steps=6", "--ckpt_every=-1", "--sample_len=0", "--ckpt_dir=" .. d,
        "--resume=" .. d .. "/step_00000003" })
      for _, x in ipairs(cfg.args) do b[#b + 1] = x end
      local full_run, lines = rhelp.check_resume(cfg.name, "recipes/tp_gpt.lua", a, b, 4, 6)
      assert.are.equal(6, #full_run)
      local sampled = false
      for _, l in ipairs(lines) do if l:match("^gpt: sample") then sampled = true end end
      if R == 0 then assert.is_true(sampled, "no sample printed") end
      assert.is_true(full_run[6] < full_run[1], "the loss does not fall")
    end)
  end

  it("refuses --sp=1 when tp does not divide the sequence, and --tp that does not divide the ranks", function()
    if W < 2 then return end
    local ok, e = pcall(run, argv({ "--steps=1", "--sp=1", "--seq=" .. (2 * W + 1), "--ckpt_every=-1", "--sample_len=0" }))
    assert.is_false(ok)
    assert.is_truthy(tostring(e):find("must be divisible by the tp size", 1, true), tostring(e))
    ok, e = pcall(run, argv({ "--steps=1", "--tp=" .. (W + 1), "--ckpt_every=-1", "--sample_len=0" }))
    assert.is_false(ok)
    assert.is_truthy(tostring(e):find("does not divide the " .. W .. " ranks", 1, true), tostring(e))
  end)
end)
