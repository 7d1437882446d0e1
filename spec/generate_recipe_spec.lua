-- recipes/generate.lua (child processes of the engine host): text from a run folder or a checkpoint of
-- recipes/gpt.lua and recipes/llama.lua (the sample the training run printed, from the same seed), from a Hugging
-- Face folder (transformers' greedy tokens, spec/fixtures/generate/hf.lua) and with a BPE tokenizer beside it;
-- tensor parallel over 2 ranks; usage errors.
local engine = require("engine")
local nn, data = engine.nn, engine.data
local hf = require("engine.hf")
local proc = require("spec.helpers.proc")

local ENGINE = proc.self_exe()
local HOME = rawget(_G, "ENGINE_HOME") or os.getenv("ENGINE_HOME") or "."
local TMP = os.tmpname()
os.remove(TMP)
os.execute("mkdir -p " .. TMP)
local FIX = dofile("spec/fixtures/generate/hf.lua")

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- runs `engine script args` alone: stdout, stderr, exit status
local function run(script, args)
  local err = TMP .. "/stderr.txt"
  local a = {}
  for i, v in ipairs(args) do a[i] = q(v) end
  local p = io.popen(string.format("cd %s && timeout -k 5 120 %s %s %s 2>%s; echo \"__rc=$?\"", q(HOME), q(ENGINE),
    script, table.concat(a, " "), q(err)))
  local out = p:read("*a")
  p:close()
  local f = io.open(err, "rb")
  local e = f and f:read("*a") or ""
  if f then f:close() end
  local rc = tonumber(out:match("__rc=(%d+)%s*$"))
  return (out:gsub("__rc=%d+%s*$", "")), e, rc
end

local read = require("spec.helpers.files").must_read

-- the text of a recipe's samples.txt entry ("step N, temperature T, prompt "...":\n<text>\n\n")
local function sample_of(run_dir)
  local s = read(run_dir .. "/samples.txt")
  return s:match("^step %d+, temperature [^\n]-:\n(.*)\n\n$")
end

describe("recipes/generate.lua", function()
  local train_bin, val_bin = TMP .. "/train.bin", TMP .. "/val.bin"

  setup(function()
    local words = { "In", "the", "beginning", "God", "created", "heaven", "and", "earth.", "And", "was" }
    local text, x = {}, 7
    for i = 1, 3000 do
      x = (x * 1103515245 + 12345) % 2147483648
      text[i] = words[x % #words + 1]
    end
    local s = table.concat(text, " ")
    data.write_shard(train_bin, data.encode(s:sub(1, 15000)))
    data.write_shard(val_bin, data.encode(s:sub(15001, 18000)))
  end)

  teardown(function() os.execute("rm -rf " .. q(TMP)) end)

  local function train(recipe, out, extra)
    local a = { "--n_layers=1", "--dim=32", "--n_heads=4", "--seq=32", "--batch=4", "--steps=6", "--warmup=2",
      "--log_every=3", "--eval_every=0", "--eval_batches=1", "--sample_len=40", "--temperature=0.9",
      "--prompt=And God", "--threads=1", "--train=" .. train_bin, "--val=" .. val_bin, "--out=" .. out }
    for _, v in ipairs(extra or {}) do a[#a + 1] = v end
    local o, e, rc = run(recipe, a)
    assert.are.equal(0, rc, o .. e)
  end

  -- the recipe's own sample again: the same prompt, seed (the recipe samples with --seed + 1) and length
  local SAME = { "--prompt=And God", "--temperature=0.9", "--max_new_tokens=40", "--seed=1338", "--stream=0" }
  local function args(...)
    local a = {}
    for _, v in ipairs({ ... }) do a[#a + 1] = v end
    for _, v in ipairs(SAME) do a[#a + 1] = v end
    return a
  end

  it("continues a gpt.lua run folder and its checkpoint as the run's own sample (cached and not)", function()
    local dir = TMP .. "/gpt"
    train("recipes/gpt.lua", dir)
    local want = sample_of(dir)
    assert.is_true(want ~= nil and #want > 40, "the run's sample")
    local out, err, rc = run("recipes/generate.lua", args("--checkpoint=" .. dir))
    assert.are.equal(0, rc, err)
    assert.are.equal(want .. "\n", out)
    assert.matches("generate: gpt %(.-step_00000006%)", err)
    assert.matches("40 tokens in", err, 1, true)
    out = run("recipes/generate.lua", args("--checkpoint=" .. dir .. "/checkpoints/step_00000006", "--kv_cache=0"))
    assert.are.equal(want .. "\n", out)
  end)

  it("continues a llama.lua full-format checkpoint as the run's own sample; 2 ranks (tensor parallel) too", function()
    local dir = TMP .. "/llama"
    train("recipes/llama.lua", dir, { "--n_kv_heads=2", "--multiple_of=16", "--ckpt_format=full" })
    local want = sample_of(dir)
    local ck = dir .. "/checkpoints/step_00000006.safetensors"
    local out, err, rc = run("recipes/generate.lua", args("--checkpoint=" .. ck))
    assert.are.equal(0, rc, err)
    assert.are.equal(want .. "\n", out)
    assert.matches("generate: llama", err, 1, true)
    if proc.have_mpirun() then
      local a = args("--checkpoint=" .. dir)
      for i, v in ipairs(a) do a[i] = q(v) end
      local o2, rc2 = proc.job(2, "recipes/generate.lua", a)
      assert.are.equal(0, rc2, o2)
      assert.matches("2 rank(s) (tensor parallel)", o2, 1, true)
      assert.is_truthy(o2:find(want, 1, true), o2)
    end
  end)

  for _, name in ipairs({ "gpt2-tiny", "llama-tiny" }) do
    it("a Hugging Face folder (" .. name .. "): transformers' greedy tokens", function()
      for b, prompt in ipairs(FIX.prompts) do
        local out, err, rc = run("recipes/generate.lua", { "--checkpoint=spec/fixtures/hf/" .. name,
          "--prompt_ids=" .. table.concat(prompt, ","), "--print_ids=1", "--temperature=0",
          "--max_new_tokens=" .. FIX.new_tokens })
        assert.are.equal(0, rc, err)
        assert.are.equal(table.concat(FIX.greedy[name].sequences[b], ",") .. "\n", out)
      end
    end)
  end

  it("a Hugging Face folder with its tokenizer.json: the folder's tokenizer by default", function()
    local tok = data.load_tokenizer(HOME .. "/data/tokenizers/kjv-bpe-4k/tokenizer.json")
    engine.manual_seed(4)
    local m = nn.Transformer{ n_layers = 1, dim = 32, n_heads = 4, vocab_size = tok.vocab_size, max_seq_len = 48,
      dropout_p = 0 }
    local dir = TMP .. "/hf-bpe"
    hf.save(m, dir)
    os.execute(string.format("cp %s %s/", q(HOME .. "/data/tokenizers/kjv-bpe-4k/tokenizer.json"), q(dir)))
    local out, err, rc = run("recipes/generate.lua", { "--checkpoint=" .. dir, "--prompt=In the beginning God",
      "--max_new_tokens=12", "--top_k=50", "--top_p=0.9", "--seed=5", "--stop_at_eot=0" })
    assert.are.equal(0, rc, err)
    local ids = m:generate(tok:encode("In the beginning God"), { max_new_tokens = 12, top_k = 50, top_p = 0.9,
      temperature = 0.8, seed = 5 })
    assert.are.equal(tok:decode(ids) .. "\n", out)
    assert.matches("vocab 4096, tokenizer " .. dir, err, 1, true)
  end)

  it("usage errors: printed once, no traceback, status 2", function()
    local function fails(a, pat)
      local out, err, rc = run("recipes/generate.lua", a)
      assert.are.equal(2, rc, out .. err)
      assert.matches(pat, err, 1, true)
      assert.is_nil(err:find("traceback", 1, true))
    end
    fails({}, "--checkpoint is required")
    fails({ "--checkpoint=" .. TMP .. "/nothing" }, "no such file or folder")
    fails({ "--checkpoint=" .. TMP }, "not a run folder")
    fails({ "--checkpoint=spec/fixtures/hf/gpt2-tiny" }, "more than the model's vocabulary of 96")
    fails({ "--checkpoint=spec/fixtures/hf/gpt2-tiny", "--prompt_ids=1,96", "--print_ids=1" },
      "'96' is not a token id in [0, 96)")
    fails({ "--checkpoint=spec/fixtures/hf/gpt2-tiny", "--max_new_token=3" }, "Did you mean '--max_new_tokens'?")
  end)
end)
