-- recipes/gpt.lua and engine.checkpoint: exact resume, checkpoint contents, argument errors.
-- The recipe runs as a child process of the engine host (the binary running this spec).
local engine = require("engine")
local nn, optim, data = engine.nn, engine.optim, engine.data
local checkpoint = require("engine.checkpoint")

-- The engine binary running this spec (/proc/self/exe of this process, read through its pid:
-- a popen'ed shell would see its own /proc/self).
local engine_binary = require("spec.helpers.proc").self_exe

local ENGINE = engine_binary()
local TMP = os.tmpname()
os.remove(TMP)
os.execute("mkdir -p " .. TMP)

-- Runs the recipe with the given argument list; returns the output and the exit status.
local function run_recipe(args)
  local cmd = string.format("cd '%s' && '%s' recipes/gpt.lua %s 2>&1; echo \"__rc=$?\"", ENGINE_HOME or ".",
    ENGINE, table.concat(args, " "))
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  local rc = tonumber(out:match("__rc=(%d+)%s*$"))
  return out:gsub("__rc=%d+%s*$", ""), rc
end

local function lines_matching(out, pat)
  local r = {}
  for line in out:gmatch("[^\n]+") do if line:match(pat) then r[#r + 1] = line end end
  return r
end

-- "step N | loss X | lr Y | grad norm Z" without the timing columns (which differ run to run).
local function loss_lines(out)
  local r = {}
  for line in out:gmatch("[^\n]+") do
    local s, rest = line:match("^step%s+(%d+) | (loss .- | lr .- | grad norm [^|]+)")
    if s then r[tonumber(s)] = rest end
  end
  return r
end

local function val_lines(out)
  local r = {}
  for line in out:gmatch("[^\n]+") do
    local s, v = line:match("^step%s+(%d+) | val loss (%S+)")
    if s then r[tonumber(s)] = v end
  end
  return r
end

describe("recipes/gpt.lua", function()
  local train_bin, val_bin = TMP .. "/train.bin", TMP .. "/val.bin"

  setup(function()
    local text = {}
    local words = { "In", "the", "beginning", "God", "created", "heaven", "and", "earth.", "And", "was",
      "without", "form,", "void;", "darkness", "upon", "face", "of", "deep." }
    local x = 7
    for i = 1, 6000 do
      x = (x * 1103515245 + 12345) % 2147483648
      text[i] = words[x % #words + 1]
    end
    local s = table.concat(text, " ")
    data.write_shard(train_bin, data.encode(s:sub(1, 30000)))
    data.write_shard(val_bin, data.encode(s:sub(30001, 34000)))
  end)

  teardown(function() os.execute("rm -rf '" .. TMP .. "'") end)

  local function tiny(extra)
    local a = { "--n_layers=1", "--dim=32", "--n_heads=2", "--seq=16", "--batch=4", "--lr=3e-3", "--warmup=2",
      "--dropout=0.1", "--log_every=1", "--eval_every=3", "--eval_batches=2", "--sample_len=0", "--threads=1",
      "--ckpt_format=full",
      "--train=" .. train_bin, "--val=" .. val_bin }
    for _, v in ipairs(extra) do a[#a + 1] = v end
    return a
  end

  it("a resumed run prints the same losses as an uninterrupted one and ends in the same state", function()
    local dir_a, dir_b = TMP .. "/ck_a", TMP .. "/ck_b"
    local out_a, rc_a = run_recipe(tiny({ "--steps=8", "--ckpt_every=4", "--ckpt_dir=" .. dir_a }))
    assert.are.equal(0, rc_a, out_a)
    local la = loss_lines(out_a)
    for s = 1, 8 do assert.is_not_nil(la[s], "no log line for step " .. s .. " in:\n" .. out_a) end
    local mid = checkpoint.path(dir_a, 4)
    assert.is_not_nil(io.open(mid, "rb"), "no checkpoint " .. mid)

    local out_b, rc_b = run_recipe(tiny({ "--steps=8", "--ckpt_dir=" .. dir_b, "--resume=" .. mid }))
    assert.are.equal(0, rc_b, out_b)
    assert.is_truthy(out_b:find("resumed from " .. mid .. " at step 4", 1, true), out_b)
    local lb = loss_lines(out_b)
    assert.is_nil(lb[4])
    for s = 5, 8 do assert.are.equal(la[s], lb[s], "step " .. s) end
    local va, vb = val_lines(out_a), val_lines(out_b)
    assert.are.equal(va[6], vb[6])
    assert.are.equal(va[8], vb[8])

    -- the final checkpoints are bit-identical (model, optimizer state, RNG, sampler)
    local ta, ma = engine.load(checkpoint.path(dir_a, 8))
    local tb, mb = engine.load(checkpoint.path(dir_b, 8))
    local n = 0
    for name, t in pairs(ta) do
      assert.is_not_nil(tb[name], name)
      assert.are.equal(0, (t:double() - tb[name]:double()):abs():max():item(), name)
      n = n + 1
    end
    assert.is_true(n > 20)
    -- (the run's options differ: --resume, --ckpt_dir, the run folder; and so the metadata checksum)
    for k, v in pairs(ma) do
      if k ~= "extra.config" and k ~= "metadata_checksum" then assert.are.equal(v, mb[k], k) end
    end
    assert.are.equal(dir_a, require("engine.json").decode(ma["extra.config"]).ckpt_dir)
    assert.are.equal("8", ma.step)
    assert.are.equal("8", ma["sampler.position"])
  end)

  it("--resume=latest picks the newest checkpoint of ckpt_dir", function()
    local dir = TMP .. "/ck_latest"
    local out, rc = run_recipe(tiny({ "--steps=4", "--ckpt_every=2", "--ckpt_dir=" .. dir }))
    assert.are.equal(0, rc, out)
    local path, step = checkpoint.latest(dir)
    assert.are.equal(checkpoint.path(dir, 4), path)
    assert.are.equal(4, step)
    out, rc = run_recipe(tiny({ "--steps=6", "--ckpt_dir=" .. dir, "--resume=latest" }))
    assert.are.equal(0, rc, out)
    assert.is_truthy(out:find("at step 4", 1, true), out)
    assert.are.equal(2, #lines_matching(out, "^step%s+%d+ | loss"))
  end)

  it("prints a seeded sample at the end", function()
    local args = tiny({ "--steps=2", "--ckpt_every=-1", "--sample_len=20", "--prompt=God" })
    local out1, rc1 = run_recipe(args)
    assert.are.equal(0, rc1, out1)
    local s1 = out1:match("sample %(temperature [^)]*%):\n(God[^\n]*)")
    assert.is_not_nil(s1, out1)
    assert.are.equal(23, #s1)
    local out2 = run_recipe(args)
    assert.are.equal(s1, out2:match("sample %(temperature [^)]*%):\n(God[^\n]*)"))
  end)

  it("--act_ckpt=full and =2 print the losses and parameter digest of a run without (dropout on); resume with "
    .. "another --act_ckpt", function()
    local function exact(out)
      local r = {}
      for line in out:gmatch("[^\n]+") do
        local s, l = line:match("^step%s+(%d+) | loss (%S+)")
        if s then r[tonumber(s)] = l end
      end
      return r, out:match("parameter digest (%x+)")
    end
    local base = { "--n_layers=2", "--steps=3", "--ckpt_every=-1", "--log_exact=1" }
    local runs = {}
    for _, mode in ipairs({ "none", "full", "2" }) do
      local a = tiny(base)
      a[#a + 1] = "--act_ckpt=" .. mode
      a[#a + 1] = "--out=" .. TMP .. "/ac_" .. mode
      local out, rc = run_recipe(a)
      assert.are.equal(0, rc, out)
      local losses, digest = exact(out)
      runs[mode] = { losses = losses, digest = digest }
      assert.is_not_nil(digest, out)
      for s = 1, 3 do assert.is_not_nil(losses[s], "no loss for step " .. s .. ":\n" .. out) end
      if mode ~= "none" then
        assert.is_truthy(out:find("activation checkpointing (--act_ckpt=" .. mode .. ") of " .. (mode == "full" and 2 or 1)
          .. " of 2 blocks", 1, true), out)
      end
      -- the resolved config records it
      assert.are.equal(mode, require("engine.json").read_file(TMP .. "/ac_" .. mode .. "/config.json").act_ckpt)
    end
    for _, mode in ipairs({ "full", "2" }) do
      assert.are.same(runs.none.losses, runs[mode].losses, "--act_ckpt=" .. mode)
      assert.are.equal(runs.none.digest, runs[mode].digest, "--act_ckpt=" .. mode)
    end
    -- not a model-shape option: a run saved with --act_ckpt=full resumes with --act_ckpt=none (and the same losses)
    local dir = TMP .. "/ac_ck"
    local a = tiny({ "--n_layers=2", "--steps=2", "--ckpt_every=2", "--log_exact=1", "--act_ckpt=full",
      "--ckpt_dir=" .. dir })
    local out, rc = run_recipe(a)
    assert.are.equal(0, rc, out)
    a = tiny({ "--n_layers=2", "--steps=3", "--ckpt_every=-1", "--log_exact=1", "--act_ckpt=none", "--ckpt_dir=" .. dir,
      "--resume=latest" })
    out, rc = run_recipe(a)
    assert.are.equal(0, rc, out)
    local losses, digest = exact(out)
    assert.are.equal(runs.none.losses[3], losses[3], out)
    assert.are.equal(runs.none.digest, digest)
    -- a bad value is a usage error
    for _, bad in ipairs({ "selective", "0", "1.5" }) do
      out, rc = run_recipe({ "--act_ckpt=" .. bad })
      assert.are.equal(2, rc, out)
      assert.is_truthy(out:find("gpt: --act_ckpt=" .. bad .. ": must be none, full or an integer N >= 1", 1, true), out)
    end
  end)

  it("rejects unknown or malformed options with a clear message", function()
    local out, rc = run_recipe({ "--no_such_option=1" })
    assert.are_not.equal(0, rc)
    assert.is_truthy(out:find("gpt: unknown option '--no_such_option'", 1, true), out)
    assert.is_nil(out:find("traceback", 1, true), out)
    out, rc = run_recipe({ "--steps=abc" })
    assert.are_not.equal(0, rc)
    assert.is_truthy(out:find("--steps must be a number", 1, true), out)
    out, rc = run_recipe({ "steps=3" })
    assert.are_not.equal(0, rc)
    assert.is_truthy(out:find("unexpected argument 'steps=3' (options are --key=value or --key value)", 1, true), out)
    out, rc = run_recipe({ "--train=" .. TMP .. "/missing.bin" })
    assert.are_not.equal(0, rc)
    assert.is_truthy(out:find("missing.bin", 1, true), out)
  end)
end)

describe("engine.checkpoint", function()
  local function setup_model()
    engine.manual_seed(3)
    local model = nn.Transformer{ n_layers = 1, dim = 16, n_heads = 2, vocab_size = 32, max_seq_len = 8,
      dropout_p = 0 }
    local opt = optim.AdamW(model:parameters(), { lr = 1e-2, weight_decay = 0.1 })
    local ids = {}
    for i = 1, 200 do ids[i] = (i * 7) % 32 end
    local sampler = data.BatchSampler(ids, { batch_size = 2, seq_len = 8, seed = 5 })
    return model, opt, sampler
  end

  local function train_step(model, opt, sampler)
    local x, y = sampler:next()
    local loss = nn.functional.cross_entropy(model(x), y)
    loss:backward()
    opt:step()
    opt:zero_grad()
    return loss:item()
  end

  it("round-trips model, optimizer, sampler, RNG and extra values", function()
    local model, opt, sampler = setup_model()
    for _ = 1, 3 do train_step(model, opt, sampler) end
    local big = engine.ffi.new("uint64_t", 2 ^ 60) + 12
    engine.set_rng_state({ seed = 77, offset = big })  -- beyond 2^53: kept exactly
    local path = os.tmpname()
    checkpoint.save(path, { model = model, optimizer = opt, sampler = sampler, step = 3,
      extra = { best = 1.25, name = "x" } })
    local expect = {}
    for i = 1, 3 do expect[i] = train_step(model, opt, sampler) end

    local m2, o2, s2 = setup_model()
    engine.manual_seed(1)
    local info = checkpoint.load(path, { model = m2, optimizer = o2, sampler = s2 })
    os.remove(path)
    assert.are.equal(3, info.step)
    assert.are.equal(1.25, info.extra.best)
    assert.are.equal("x", info.extra.name)
    local r = engine.get_rng_state()
    assert.are.equal(77, r.seed)
    assert.are.equal(tostring(big), tostring(r.offset))
    assert.are.equal(3, s2:state().position)
    assert.are.equal(3, o2.state[o2.param_groups[1].params[1]].step:item())
    for i = 1, 3 do assert.are.equal(expect[i], train_step(m2, o2, s2)) end
  end)

  it("latest() and path()", function()
    local dir = os.tmpname()
    os.remove(dir)
    os.execute("mkdir -p " .. dir)
    assert.is_nil(checkpoint.latest(dir))
    assert.is_nil(checkpoint.latest(dir .. "/nope"))
    for _, s in ipairs({ 5, 120, 40 }) do
      local f = io.open(checkpoint.path(dir, s), "wb"); f:write("x"); f:close()
    end
    local p, s = checkpoint.latest(dir)
    assert.are.equal(dir .. "/step_00000120.safetensors", p)
    assert.are.equal(120, s)
    os.execute("rm -rf " .. dir)
  end)

  it("fails clearly on a missing file, a foreign file and a mismatched model", function()
    local model, opt = setup_model()
    assert.has_error(function() checkpoint.load("/nonexistent/ck.safetensors", { model = model }) end)
    local path = os.tmpname()
    engine.save(path, { w = engine.ones(2) })
    local ok, err = pcall(checkpoint.load, path, { model = model })
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("not a training-state checkpoint", 1, true))
    checkpoint.save(path, { model = model, step = 1 })
    ok, err = pcall(checkpoint.load, path, { model = model, optimizer = opt })
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("no optimizer state", 1, true))
    local other = nn.Transformer{ n_layers = 1, dim = 8, n_heads = 2, vocab_size = 32, max_seq_len = 8 }
    ok, err = pcall(checkpoint.load, path, { model = other })
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("size mismatch", 1, true))
    assert.has_error(function() checkpoint.save(path, {}) end)
    assert.has_error(function() checkpoint.load(path) end)
    os.remove(path)
  end)
end)
