-- recipes/llama.lua (recipes/gpt.lua with the Llama model): trains, evaluates, samples and resumes from
-- its full-tensor checkpoint with the losses of an uninterrupted run, with DTensor data parallelism
-- (the default: Replicate parameters, Shard(1) batches; plain tensors at 1 rank), with TP (torchtitan's
-- plan) and TP x DP; DTensor data parallelism prints the losses of the plain all_reduce path.
local engine = require("engine")
local dist = engine.distributed
local W, R = dist.world_size(), dist.rank()

local rhelp = require("spec.dist.helpers.recipe")
-- Runs the recipe in this process with argv; returns the training losses rank 0 printed (on every rank) and the
-- printed lines.
local function run(argv, nsteps) return rhelp.run("recipes/llama.lua", argv, nsteps) end
-- its own small token shards (the suite does not need data/), written by rank 0; ck: the base of the paths
local ck, train_bin, val_bin = rhelp.tiny_data("llama_recipe", 13)

local base = { "--n_layers=1", "--dim=32", "--n_heads=4", "--n_kv_heads=2", "--multiple_of=16", "--seq=16", "--batch=2",
  "--log_every=1", "--eval_every=0", "--eval_batches=1", "--warmup=2", "--lr=3e-3", "--train=" .. train_bin,
  "--val=" .. val_bin }
local argv = rhelp.argv_builder(base)

describe("recipes/llama.lua", function()
  teardown(function()
    dist.barrier()
    if R == 0 then os.execute("rm -rf '" .. ck .. "'* 2>/dev/null") end
  end)

  for _, cfg in ipairs({ { name = "DTensor DP", args = {}, ranks = 1 }, { name = "TP", args = { "--tp=0", "--n_heads=8", "--n_kv_heads=4" }, ranks = 2 },
                          { name = "TP x DP (2x2)", args = { "--tp=2" }, ranks = 4, exact = true },
                          { name = "TP SP", args = { "--tp=0", "--sp=1", "--n_heads=8", "--n_kv_heads=4" }, ranks = 2 } }) do
    it(cfg.name .. ": trains, samples, resumes from its checkpoint with the uninterrupted run's losses", function()
      if W < cfg.ranks or (cfg.exact and W ~= cfg.ranks) then return end
      local d = ck .. "_" .. cfg.name:gsub("%W", "")
      local a = argv({ "--steps=6", "--ckpt_every=3", "--sample_len=8", "--ckpt_dir=" .. d })
      for _, x in ipairs(cfg.args) do a[#a + 1] = x end
      local b = argv({ "--steps=6", "--ckpt_every=-1", "--sample_len=0", "--ckpt_dir=" .. d,
        "--resume=" .. d .. "/step_00000003" })
      for _, x in ipairs(cfg.args) do b[#b + 1] = x end
      local full_run, lines = rhelp.check_resume(cfg.name, "recipes/llama.lua", a, b, 4, 6)
      if R == 0 then
        local sampled, described = false, false
        for _, l in ipairs(lines) do
          if l:match("^llama: sample") then sampled = true end
          if l:match("^llama: %d+ params %(1 layers, dim 32, %d heads, %d kv heads") then described = true end
        end
        assert.is_true(sampled, "no sample printed")
        assert.is_true(described, "no model line printed")
      end
      assert.is_true(full_run[6] < full_run[1], "the loss does not fall")
    end)
  end

  it("DTensor data parallelism prints the losses of plain all_reduce data parallelism", function()
    local a = run(argv({ "--steps=4", "--ckpt_every=-1", "--sample_len=0" }), 4)
    local b = run(argv({ "--steps=4", "--ckpt_every=-1", "--sample_len=0", "--dtensor_dp=0" }), 4)
    for s = 1, 4 do
      assert.is_true(math.abs(a[s] - b[s]) <= 1e-5, string.format("step %d: %.7f DTensor vs %.7f plain", s, a[s], b[s]))
    end
  end)

  it("--fsdp=1 (recipes/fsdp_gpt.lua with the Llama; FSDP over TP with --tp=2 at 4 ranks) prints the same losses", function()
    local a = run(argv({ "--steps=3", "--ckpt_every=-1", "--sample_len=0" }), 3)
    local runs = { { "--fsdp=1" } }
    if W == 4 then runs[2] = { "--fsdp=1", "--tp=2" } end
    for _, extra in ipairs(runs) do
      local args = argv({ "--steps=3", "--ckpt_every=-1", "--sample_len=0" })
      if extra[2] then args[#args + 1] = "--batch=4" end   -- 2 dp rows of 4: the same global batch of 8
      for _, x in ipairs(extra) do args[#args + 1] = x end
      local b = run(args, 3)
      for s = 1, 3 do
        assert.is_true(math.abs(a[s] - b[s]) <= 1e-5 * math.max(1, a[s]),
          string.format("%s step %d: %.7f vs %.7f", table.concat(extra, " "), s, b[s], a[s]))
      end
    end
  end)

  it("--sp=1 (torchtitan's sequence parallelism) prints the losses of TP without it", function()
    if W < 2 then return end
    local tpa = { "--tp=0", "--n_heads=8", "--n_kv_heads=4", "--steps=3", "--ckpt_every=-1", "--sample_len=0" }
    local a = run(argv(tpa), 3)
    local with_sp = argv(tpa)
    with_sp[#with_sp + 1] = "--sp=1"
    local b = run(with_sp, 3)
    for s = 1, 3 do
      assert.is_true(math.abs(a[s] - b[s]) <= 1e-5 * math.max(1, a[s]), string.format("step %d: %.7f SP vs %.7f TP", s, b[s], a[s]))
    end
    if W == 4 then   -- FSDP over TP with SP on a 2x2 mesh: the losses of FSDP over TP
      local f = argv({ "--fsdp=1", "--tp=2", "--batch=4", "--steps=3", "--ckpt_every=-1", "--sample_len=0" })
      local fa = run(f, 3)
      f[#f + 1] = "--sp=1"
      local fb = run(f, 3)
      for s = 1, 3 do
        assert.is_true(math.abs(fa[s] - fb[s]) <= 1e-5 * math.max(1, fa[s]), string.format("FSDP step %d: %.7f SP vs %.7f", s, fb[s], fa[s]))
      end
    end
  end)

  it("refuses --dropout for the Llama, and kv heads that do not divide the heads", function()
    local ok, e = pcall(run, argv({ "--steps=1", "--dropout=0.1", "--ckpt_every=-1", "--sample_len=0" }), 1)
    assert.is_false(ok)
    assert.is_truthy(tostring(e):find("--dropout does not apply", 1, true), tostring(e))
    ok, e = pcall(run, argv({ "--steps=1", "--n_kv_heads=3", "--ckpt_every=-1", "--sample_len=0" }), 1)
    assert.is_false(ok)
    assert.is_truthy(tostring(e):find("n_heads (4) must be divisible by n_kv_heads (3)", 1, true), tostring(e))
  end)
end)
