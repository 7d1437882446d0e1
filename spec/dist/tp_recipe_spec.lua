-- recipes/tp_gpt.lua (recipes/gpt.lua with --tp): trains, evaluates, samples, and resumes from its
-- full-tensor checkpoint with the losses of an uninterrupted run (TP and TP+SP, and 2 x 2 TP x DP).
local engine = require("engine")
local dist = engine.distributed
local W, R = dist.world_size(), dist.rank()

-- Runs the recipe in this process with argv; returns the training losses rank 0 printed (every rank
-- gets them: broadcast through a file-free all_reduce of the values).
local function run(argv, nsteps)
  local lines = {}
  local G = _G              -- the recipe runs in the global environment, not this spec's
  local real_print = G.print
  G.print = function(...)
    local t = {}
    for i = 1, select("#", ...) do t[i] = tostring(select(i, ...)) end
    lines[#lines + 1] = table.concat(t, "\t")
  end
  local saved_arg = G.arg
  G.arg = argv
  argv[0] = "recipes/tp_gpt.lua"
  local ok, err = pcall(dofile, "recipes/tp_gpt.lua")
  G.print, G.arg = real_print, saved_arg
  G.GPT_DEFAULTS = nil
  assert(ok, tostring(err))
  local losses = {}
  for _, l in ipairs(lines) do
    local step, loss = l:match("^step%s+(%d+) | loss ([%d.]+)")
    if step then losses[tonumber(step)] = tonumber(loss) end
  end
  local n = nsteps or 1
  local vals = {}
  for k = 1, math.max(n, 1) do vals[k] = (R == 0 and losses[k]) or 0 end
  local t = engine.tensor(vals, "f64")
  dist.all_reduce(t, "sum")
  local out = {}
  local tl = t:totable()
  for k = 1, n do out[k] = tl[k] end
  return out, lines
end

local dir = os.getenv("TMPDIR") or "/tmp"
local stamp = engine.tensor({ math.floor(engine.time() * 1000) % 100000000 }, "f64")
dist.broadcast(stamp, 0)                          -- one directory name on every rank
local ck = string.format("%s/tp_recipe_%d", dir, stamp:item())
-- its own small token shards (the suite does not need data/): a pseudo-random word text, written by rank 0
local train_bin, val_bin = ck .. "_train.bin", ck .. "_val.bin"
if R == 0 then
  os.execute("rm -rf '" .. ck .. "'")
  local words = { "In", "the", "beginning", "God", "created", "heaven", "and", "earth.", "And", "was", "without",
    "form,", "void;", "darkness", "upon", "face", "of", "deep." }
  local text, x = {}, 11
  for i = 1, 4000 do
    x = (x * 1103515245 + 12345) % 2147483648
    text[i] = words[x % #words + 1]
  end
  local s = table.concat(text, " ")
  engine.data.write_shard(train_bin, engine.data.encode(s:sub(1, 20000)))
  engine.data.write_shard(val_bin, engine.data.encode(s:sub(20001, 24000)))
end
dist.barrier()

local base = { "--n_layers=1", "--dim=32", "--n_heads=4", "--seq=16", "--batch=2", "--log_every=1", "--eval_every=0",
  "--eval_batches=1", "--warmup=2", "--lr=3e-3", "--train=" .. train_bin, "--val=" .. val_bin }
local function argv(extra)
  local a = {}
  for _, v in ipairs(base) do a[#a + 1] = v end
  for _, v in ipairs(extra) do a[#a + 1] = v end
  return a
end

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
      local full_run, lines = run(a, 6)
      assert.are.equal(6, #full_run)
      local sampled = false
      for _, l in ipairs(lines) do if l:match("^gpt: sample") then sampled = true end end
      if R == 0 then assert.is_true(sampled, "no sample printed") end
      assert.is_true(full_run[6] < full_run[1], "the loss does not fall")
      local b = argv({ "--steps=6", "--ckpt_every=-1", "--sample_len=0", "--ckpt_dir=" .. d,
        "--resume=" .. d .. "/step_00000003" })
      for _, x in ipairs(cfg.args) do b[#b + 1] = x end
      local resumed = run(b, 6)
      for s = 4, 6 do
        assert.is_true(math.abs(resumed[s] - full_run[s]) <= 1e-6 * math.max(1, full_run[s]),
          string.format("%s step %d: %.7f resumed vs %.7f", cfg.name, s, resumed[s], full_run[s]))
      end
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
