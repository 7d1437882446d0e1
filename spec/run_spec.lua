-- The command line (engine.cli), config files, run folders (engine.run), metrics.jsonl and the plot tool, as a
-- user meets them: recipes and tools run as child processes of the engine host.
local engine = require("engine")
local cli = require("engine.cli")
local json = require("engine.json")
local run = require("engine.run")
local proc = require("spec.helpers.proc")

local TMP = os.tmpname()
os.remove(TMP)
os.execute("mkdir -p " .. TMP)

local function job(np, script, args) return proc.job(np, script, args, { env = { ENGINE_RUNS_DIR = TMP .. "/runs" } }) end
local files = require("spec.helpers.files")
local count, read = files.count, files.read

describe("engine.cli", function()
  local spec = { name = "t", config = true, options = {
    { "steps", 600, "optimizer steps", int = true, min = 1 },
    { "lr", 2e-3, "peak lr", min = 0 },
    { "device", "cpu", "where", choices = { "cpu", "cuda" } },
    { "compile", false, "a boolean" },
  } }

  it("takes --key=value and --key value, typed by the default", function()
    local o, given = cli.parse({ "--steps", "10", "--lr=1e-3", "--compile=true", "--device", "cuda" }, spec)
    assert.are.same({ 10, 1e-3, true, "cuda" }, { o.steps, o.lr, o.compile, o.device })
    assert.are.equal("cli", given.steps)
    assert.is_true(cli.parse({ "--compile" }, spec).compile)
    assert.is_true(cli.parse({ "--compile", "--steps=3" }, spec).compile)
    assert.is_false(cli.parse({ "--compile", "false" }, spec).compile)
    o, given = cli.parse({}, spec)
    assert.are.same({ 600, 2e-3, false, "cpu" }, { o.steps, o.lr, o.compile, o.device })
    assert.is_nil(next(given))
  end)

  it("names the option and what it must be; suggests a near name", function()
    local function err(argv)
      local ok, e = pcall(cli.parse, argv, spec)
      assert.is_false(ok)
      return e
    end
    assert.matches("t: unknown option '%-%-stepz'\nDid you mean '%-%-steps'%?", err({ "--stepz=3" }))
    assert.matches("t: %-%-steps must be a number, got 'x'", err({ "--steps=x" }))
    assert.matches("t: %-%-steps must be an integer, got '1.5'", err({ "--steps=1.5" }))
    assert.matches("t: %-%-steps must be an integer >= 1, got '0'", err({ "--steps=0" }))
    assert.matches("t: %-%-device must be one of cpu, cuda, got 'tpu'", err({ "--device=tpu" }))
    assert.matches("t: %-%-compile must be true or false", err({ "--compile=maybe" }))
    assert.matches("t: unexpected argument 'steps=3'", err({ "steps=3" }))
    assert.matches("%-%-help lists the options", err({ "--steps=x" }))
    assert.matches("Usage: t", err({ "--help" }))   -- --help ends the script (the host prints it, exit 0)
  end)

  it("reads config files (.lua, .json, .toml); the command line overrides them", function()
    local files = {
      [TMP .. "/c.lua"] = "steps = 7\nlr = 0.5\n",
      [TMP .. "/c2.lua"] = "return { steps = 7, lr = 0.5 }",
      [TMP .. "/c.json"] = '{"steps": 7, "lr": 0.5}',
      [TMP .. "/c.toml"] = "# a run\nsteps = 7 # seven\nlr = 0.5\ndevice = \"cuda\"\n",
    }
    for path, text in pairs(files) do
      local f = io.open(path, "w"); f:write(text); f:close()
      local o, given = cli.parse({ "--config", path, "--lr=0.25" }, spec)
      assert.are.equal(7, o.steps, path)
      assert.are.equal(0.25, o.lr, path)
      assert.are.equal("config", given.steps)
      assert.are.equal("cli", given.lr)
      assert.are.equal(path, o.config)
    end
    local f = io.open(TMP .. "/bad.json", "w"); f:write('{"stepss": 3}'); f:close()
    local ok, e = pcall(cli.parse, { "--config=" .. TMP .. "/bad.json" }, spec)
    assert.is_false(ok)
    assert.matches("unknown option 'stepss'\nDid you mean 'steps'%?", e)
    f = io.open(TMP .. "/bad2.json", "w"); f:write('{"steps": "many"}'); f:close()
    ok, e = pcall(cli.parse, { "--config=" .. TMP .. "/bad2.json" }, spec)
    assert.is_false(ok)
    assert.matches("%-%-steps must be a number, got 'many'", e)
    ok, e = pcall(cli.parse, { "--config=" .. TMP .. "/nope.toml" }, spec)
    assert.is_false(ok)
    assert.matches("cannot open", e)
  end)

  it("help lists every option with its default and meaning", function()
    local h = cli.help(spec)
    for _, s in ipairs({ "--steps <N>", "optimizer steps (default: 600)", "--lr <X>", "(default: 0.002)",
      "--device <cpu|cuda>", "--compile [<BOOL>]", "--config <FILE>", "-h, --help" }) do
      assert.is_truthy(h:find(s, 1, true), s .. " in:\n" .. h)
    end
  end)
end)

describe("recipes: command line, run folders, metrics", function()
  local train_bin, val_bin = TMP .. "/train.bin", TMP .. "/val.bin"
  setup(function()
    local words = { "In", "the", "beginning", "God", "created", "heaven", "and", "earth.", "And", "was" }
    local text, x = {}, 11
    for i = 1, 5000 do
      x = (x * 1103515245 + 12345) % 2147483648
      text[i] = words[x % #words + 1]
    end
    local s = table.concat(text, " ")
    engine.data.write_shard(train_bin, engine.data.encode(s:sub(1, 20000)))
    engine.data.write_shard(val_bin, engine.data.encode(s:sub(20001, 24000)))
  end)
  teardown(function() os.execute("rm -rf '" .. TMP .. "'") end)

  local function tiny(extra)
    local a = { "--n_layers=1", "--dim=16", "--n_heads=2", "--seq=16", "--batch=2", "--lr=3e-3", "--warmup=1",
      "--log_every=1", "--eval_every=2", "--eval_batches=1", "--sample_len=8", "--threads=1",
      "--train=" .. train_bin, "--val=" .. val_bin }
    for _, v in ipairs(extra) do a[#a + 1] = v end
    return a
  end

  it("--help of every recipe and tool lists its options and exits 0", function()
    for _, script in ipairs({ "recipes/gpt.lua", "recipes/fsdp_gpt.lua", "recipes/tp_gpt.lua", "recipes/dp_gpt.lua",
      "recipes/llama.lua", "recipes/gpt_2d.lua", "recipes/sharded_embedding.lua", "tools/plot.lua",
      "tools/ckpt_safetensors.lua" }) do
      local out, rc = job(0, script, { "--help" })
      assert.are.equal(0, rc, script .. ":\n" .. out)
      assert.is_truthy(out:find("Usage: ", 1, true), script .. ":\n" .. out)
      assert.is_nil(out:find("traceback", 1, true), out)
    end
    local out = job(0, "recipes/gpt.lua", { "--help" })
    for _, s in ipairs({ "--steps <N>", "optimizer steps (default: 600)", "--out <S>", "--resume <S>", "--config <FILE>",
      "--tokenizer <S>", "--tp <N>", "--ckpt_format <dcp|full>" }) do
      assert.is_truthy(out:find(s, 1, true), s)
    end
    out = job(0, "recipes/llama.lua", { "--help" })
    assert.is_truthy(out:find("--n_kv_heads <N>", 1, true), out)
    assert.is_truthy(out:find("--fsdp <0|1>", 1, true), out)
  end)

  it("a bad option: printed once (rank 0), no traceback, exit status 2, also at 2 ranks", function()
    local out, rc = job(0, "recipes/gpt.lua", { "--stepz=3" })
    assert.are.equal(2, rc, out)
    assert.is_truthy(out:find("gpt: unknown option '--stepz'\nDid you mean '--steps'?", 1, true), out)
    assert.is_nil(out:find("traceback", 1, true), out)
    if not proc.have_mpirun() then return pending("needs mpirun") end
    out, rc = job(2, "recipes/gpt.lua", { "--stepz=3" })
    assert.are_not.equal(0, rc)
    assert.are.equal(1, count(out, "unknown option '--stepz'"), out)
    assert.is_nil(out:find("traceback", 1, true), out)
    out, rc = job(2, "recipes/tp_gpt.lua", tiny({ "--tp=3" }))
    assert.are_not.equal(0, rc)
    assert.are.equal(1, count(out, "--tp=3 does not divide the 2 ranks"), out)
    assert.is_nil(out:find("traceback", 1, true), out)
  end)

  it("writes a run folder: config, log, metrics.jsonl, checkpoints, samples; never overwrites one", function()
    local dir = TMP .. "/run_a"
    local out, rc = job(0, "recipes/gpt.lua", tiny({ "--steps", "4", "--out=" .. dir }))
    assert.are.equal(0, rc, out)
    local cfg = json.read_file(dir .. "/config.json")
    assert.are.equal(4, cfg.steps)
    assert.are.equal(16, cfg.dim)
    assert.are.equal(dir, cfg.out)
    assert.are.equal(dir .. "/checkpoints", cfg.ckpt_dir)
    assert.is_truthy(run.is_dir(dir .. "/checkpoints/step_00000004"))
    assert.is_truthy(read(dir .. "/samples.txt"):find("And God said", 1, true))
    -- the log holds rank 0's lines
    local log = read(dir .. "/log.txt")
    for line in out:gmatch("[^\n]+") do
      if line:match("^step") then assert.is_truthy(log:find(line, 1, true), line) end
    end
    local rows = run.read_metrics(dir)
    local steps, vals = {}, {}
    for _, r in ipairs(rows) do
      if r.loss then
        steps[#steps + 1] = r.step
        for _, k in ipairs({ "loss", "lr", "grad_norm", "ms_per_step", "tokens_per_s", "mfu", "peak_mem_mib", "time_s",
          "eta_s" }) do
          assert.are.equal("number", type(r[k]), k)
        end
        assert.is_true(r.mfu > 0 and r.mfu < 1.5, tostring(r.mfu))
      end
      if r.val_loss then vals[#vals + 1] = r.step end
    end
    assert.are.same({ 1, 2, 3, 4 }, steps)
    assert.are.same({ 0, 2, 4 }, vals)
    assert.matches("| MFU [%d.]+%% | peak [%d.]+ MiB | ETA %d+s", out)
    -- the same --out again: refused, nothing touched
    local before = read(dir .. "/metrics.jsonl")
    out, rc = job(0, "recipes/gpt.lua", tiny({ "--steps=4", "--out=" .. dir }))
    assert.are.equal(2, rc, out)
    assert.is_truthy(out:find("already holds a run", 1, true), out)
    assert.are.equal(before, read(dir .. "/metrics.jsonl"))
    -- the default run folder: under $ENGINE_RUNS_DIR (runs/ of the current directory for a user)
    out, rc = job(0, "recipes/gpt.lua", tiny({ "--steps=1", "--sample_len=0" }))
    assert.are.equal(0, rc, out)
    local p = io.popen("ls -d '" .. TMP .. "/runs'/gpt-* 2>/dev/null")
    local found = p:read("*a")
    p:close()
    assert.matches("/runs/gpt%-%d%d%d%d%d%d%d%d%-%d%d%d%d%d%d", found)
  end)

  it("--resume=<run folder> continues with the saved options; the model's shape must match", function()
    local dir = TMP .. "/run_b"
    local out, rc = job(0, "recipes/gpt.lua", tiny({ "--steps=3", "--ckpt_every=2", "--lr=4e-3", "--out=" .. dir,
      "--sample_len=0" }))
    assert.are.equal(0, rc, out)
    -- a different model shape: named
    out, rc = job(0, "recipes/gpt.lua", { "--resume=" .. dir, "--dim=32" })
    assert.are.equal(2, rc, out)
    assert.is_truthy(out:find("--dim=32 differs from the resumed run's dim=16", 1, true), out)
    -- continue to 5 steps: every other option (lr, data, sizes) from the run's config.json
    out, rc = job(0, "recipes/gpt.lua", { "--resume=" .. dir, "--steps=5" })
    assert.are.equal(0, rc, out)
    assert.is_truthy(out:find("resumed from " .. dir .. "/checkpoints/step_00000003 at step 3", 1, true), out)
    assert.is_truthy(out:find("lr 0.004", 1, true), out)
    local rows = run.read_metrics(dir)
    local last = 0
    for _, r in ipairs(rows) do if r.loss then last = r.step end end
    assert.are.equal(5, last)
    assert.are.equal(5, json.read_file(dir .. "/config.json").steps)
    -- the saved paths are absolute: continuing from another working directory finds the data
    local cfg = json.read_file(dir .. "/config.json")
    assert.are.equal(train_bin, cfg.train)
    local home = rawget(_G, "ENGINE_HOME") or os.getenv("ENGINE_HOME") or "."
    if home:sub(1, 1) ~= "/" then home = os.getenv("PWD") .. "/" .. home end
    local p = io.popen(string.format("cd / && env $(env | grep -o '^\\(OMPI\\|PMIX\\|OPAL\\|ORTE\\)[A-Za-z0-9_]*' | "
      .. "sed 's/^/-u /') ENGINE_RUNS_DIR='%s/runs' '%s' '%s/recipes/gpt.lua' --resume='%s' --steps=6 2>&1; echo __rc=$?",
      TMP, proc.self_exe(), home, dir))
    out = p:read("*a")
    p:close()
    assert.is_truthy(out:find("__rc=0", 1, true), out)
    assert.is_truthy(out:find("at step 5", 1, true), out)
    -- the checkpoint holds the config too: resuming from it elsewhere keeps the shape
    out, rc = job(0, "recipes/gpt.lua", { "--resume=" .. dir .. "/checkpoints/step_00000005", "--steps=6", "--dim=32",
      "--out=" .. TMP .. "/run_c", "--train=" .. train_bin, "--val=" .. val_bin })
    assert.are.equal(2, rc, out)
    assert.is_truthy(out:find("--dim=32 differs from the resumed run's dim=16", 1, true), out)
  end)

  it("takes a --config file with command-line overrides, and saves the result", function()
    local cfg = TMP .. "/run.toml"
    local f = io.open(cfg, "w")
    f:write("steps = 2\nweight_decay = 0.05\nprompt = \"In the\"\n")
    f:close()
    local dir = TMP .. "/run_d"
    local out, rc = job(0, "recipes/gpt.lua", tiny({ "--config", cfg, "--steps=3", "--out=" .. dir }))
    assert.are.equal(0, rc, out)
    local saved = json.read_file(dir .. "/config.json")
    assert.are.equal(3, saved.steps)
    assert.are.equal(0.05, saved.weight_decay)
    assert.are.equal(3e-3, saved.lr)
    assert.are.equal("In the", saved.prompt)
  end)

  it("--tokenizer: BPE shards train with the tokenizer's vocabulary and decoded samples", function()
    local home = rawget(_G, "ENGINE_HOME") or "."
    local tj = home .. "/data/tokenizers/kjv-bpe-4k/tokenizer.json"
    local tok = engine.data.load_tokenizer(tj)
    local words = { "In", "the", "beginning", "God", "created", "heaven", "and", "earth.", "Let", "there", "be",
      "light:" }
    local text, x = {}, 5
    for i = 1, 3000 do
      x = (x * 1103515245 + 12345) % 2147483648
      text[i] = words[x % #words + 1]
    end
    local ids = tok:encode(table.concat(text, " "))
    local tr, va = {}, {}
    for i, id in ipairs(ids) do if i <= #ids - 400 then tr[#tr + 1] = id else va[#va + 1] = id end end
    engine.data.write_shard(TMP .. "/bpe_train_1.bin", { unpack(tr, 1, 1000) }, { vocab_size = tok.vocab_size })
    engine.data.write_shard(TMP .. "/bpe_train_2.bin", { unpack(tr, 1001) }, { vocab_size = tok.vocab_size })
    engine.data.write_shard(TMP .. "/bpe_val.bin", va, { vocab_size = tok.vocab_size })
    local function args(extra)
      local a = { "--n_layers=1", "--dim=16", "--n_heads=2", "--seq=16", "--batch=2", "--steps=2", "--log_every=1",
        "--eval_batches=1", "--threads=1", "--sample_len=6", "--prompt=God", "--train='" .. TMP .. "/bpe_train_*.bin'",
        "--val=" .. TMP .. "/bpe_val.bin" }
      for _, v in ipairs(extra) do a[#a + 1] = v end
      return a
    end
    -- (the tokenizer's path relative to the working directory: saved absolute in config.json)
    local out, rc = job(0, "recipes/gpt.lua", args({ "--tokenizer=data/tokenizers/kjv-bpe-4k/tokenizer.json",
      "--out=" .. TMP .. "/bpe_a" }))
    assert.are.equal(0, rc, out)
    local saved_tok = json.read_file(TMP .. "/bpe_a/config.json").tokenizer
    assert.are.equal("/", saved_tok:sub(1, 1))
    assert.is_truthy(saved_tok:find("/data/tokenizers/kjv%-bpe%-4k/tokenizer%.json$"), saved_tok)
    assert.is_not_nil(io.open(saved_tok, "rb"), saved_tok)
    assert.is_truthy(out:find("vocab " .. tok.vocab_size .. ")", 1, true), out)
    assert.is_truthy(out:find("train " .. TMP .. "/bpe_train_*.bin (" .. (#tr - 16) .. " tokens)", 1, true), out)
    local sample = out:match("sample %(temperature [^)]*%):\n(God[^\n]*)")
    assert.is_not_nil(sample, out)
    assert.is_true(#sample > #"God" + 3, sample)   -- the prompt and 6 new tokens, decoded to text
    assert.is_nil(out:find("(token ids", 1, true), out)
    -- without the tokenizer the vocabulary still comes from the data (the header), and the sample is ids
    out, rc = job(0, "recipes/gpt.lua", args({ "--out=" .. TMP .. "/bpe_b" }))
    assert.are.equal(0, rc, out)
    assert.is_truthy(out:find("vocab " .. tok.vocab_size .. ")", 1, true), out)
    assert.is_truthy(out:find("(token ids; give --tokenizer to decode them)", 1, true), out)
    -- a tokenizer of another vocabulary than the data's: refused, naming both
    local f = io.open(TMP .. "/vocab.json", "w")
    f:write('{"a": 0, "b": 1, "ab": 2}')
    f:close()
    f = io.open(TMP .. "/merges.txt", "w")
    f:write("#version: 0.2\na b\n")
    f:close()
    out, rc = job(0, "recipes/gpt.lua", args({ "--tokenizer=" .. TMP, "--out=" .. TMP .. "/bpe_c" }))
    assert.are.equal(2, rc, out)
    assert.is_truthy(out:find("has 3 tokens but the data", 1, true), out)
  end)

  it("--tensorboard=1: an events file whose scalars are metrics.jsonl's (engine.tensorboard)", function()
    local tb = require("engine.tensorboard")
    assert.are.equal(0xE3069283, tb.crc32c("123456789"))   -- the CRC-32C check value
    -- PyTorch's SummaryWriter wrote this file (tools/gen_tensorboard_fixture.py): our reader gets its scalars
    local home = rawget(_G, "ENGINE_HOME") or "."
    local ev = tb.read(home .. "/spec/fixtures/tensorboard/torch_events.tfevents")
    assert.are.equal("brain.Event:2", ev[1].file_version)
    local got = {}
    for _, e in ipairs(ev) do
      for tag, v in pairs(e.scalars) do got[#got + 1] = string.format("%d %s %.4g %.2f", e.step, tag, v, e.wall_time) end
    end
    assert.are.same({ "1 train/loss 5.5 1795800001.50", "1 train/lr 0.001 1795800001.50", "2 train/loss 4.25 1795800002.50",
      "2 train/lr 0.002 1795800002.50", "3 train/loss 3.125 1795800003.50", "3 train/lr 0.003 1795800003.50",
      "300 val/loss 3 1795800100.25" }, got)
    -- a flipped byte fails the CRC
    local f = io.open(home .. "/spec/fixtures/tensorboard/torch_events.tfevents", "rb")
    local bytes = f:read("*a")
    f:close()
    local bad = TMP .. "/bad.tfevents"
    f = io.open(bad, "wb")
    f:write(bytes:sub(1, 60) .. string.char((bytes:byte(61) + 1) % 256) .. bytes:sub(62))
    f:close()
    assert.has_error(function() tb.read(bad) end)
    -- the recipe's events: the same numbers as metrics.jsonl (as f32)
    local dir = TMP .. "/run_tb"
    local out, rc = job(0, "recipes/gpt.lua", tiny({ "--steps=4", "--out=" .. dir, "--tensorboard=1", "--sample_len=0" }))
    assert.are.equal(0, rc, out)
    local p = io.popen("ls '" .. dir .. "'/events.out.tfevents.*")
    local path = p:read("*l")
    p:close()
    assert.is_not_nil(path, out)
    local by = {}
    for _, e in ipairs(tb.read(path)) do
      for tag, v in pairs(e.scalars) do by[tag .. "@" .. e.step] = v end
    end
    local n = 0
    for _, r in ipairs(run.read_metrics(dir)) do
      if r.loss then
        assert.is_true(math.abs(by["train/loss@" .. r.step] - r.loss) <= 1e-6 * r.loss, tostring(r.step))
        assert.is_true(math.abs(by["train/lr@" .. r.step] - r.lr) <= 1e-6 * r.lr)
        n = n + 1
      end
      if r.val_loss then assert.is_true(math.abs(by["val/loss@" .. r.step] - r.val_loss) <= 1e-6 * r.val_loss) end
    end
    assert.are.equal(4, n)
  end)

  it("tools/plot.lua draws the curves of runs to a PNG", function()
    if os.execute("command -v gnuplot >/dev/null 2>&1") ~= 0 then return pending("gnuplot is not installed") end
    local a, b = TMP .. "/plot_a", TMP .. "/plot_b"
    for _, d in ipairs({ a, b }) do
      local out, rc = job(0, "recipes/gpt.lua", tiny({ "--steps=6", "--out=" .. d, "--sample_len=0",
        "--ckpt_every=-1" }))
      assert.are.equal(0, rc, out)
    end
    local png = TMP .. "/plot.png"
    local out, rc = job(0, "tools/plot.lua", { a, b, "--out=" .. png })
    assert.are.equal(0, rc, out)
    local s = read(png)
    assert.is_not_nil(s, out)
    assert.are.equal("\137PNG", s:sub(1, 4))
    assert.is_true(#s > 10000, tostring(#s))
    out, rc = job(0, "tools/plot.lua", { TMP .. "/no_such_run" })
    assert.are.equal(2, rc, out)
    assert.is_truthy(out:find("no metrics file", 1, true), out)
  end)
end)
