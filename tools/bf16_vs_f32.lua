-- tools/bf16_vs_f32.lua: mixed precision against fp32 on the same training run (issue 28, "how it is proven").
--
--   build/engine tools/bf16_vs_f32.lua [--device=cuda] [--steps=300] [--batch=8] [--seq=1024] [--n_layers=12]
--       [--dim=768] [--n_heads=12] [--lr=6e-4] [--warmup=30] [--train=data/kjv_train.bin] [--tol=0.01]
--
-- Trains the GPT (engine.nn.Transformer with GPT-2's tanh GELU, dropout 0, N(0, 0.02) embeddings) twice from the
-- same initial weights on the same batches of the KJV shards (data.BatchSampler, seed 0): once in fp32 (parameters,
-- activations, AdamW
-- states), once in bf16 compute with f32 master weights and f32 AdamW states (optim.AdamW{master_weights = true}:
-- the bf16 parameters are a copy of the f32 masters the optimizer updates; the loss is the fused classifier on the
-- bf16 logits).  Linear warm-up to --lr, then cosine decay to lr / 10; gradients clipped at 1.
-- Prints every 25 steps the two losses, then the mean loss of the last 20 steps of each run and their relative
-- difference; exits 1 when it is above --tol (1%: the bf16 run follows the fp32 loss curve).
-- Default sizes are GPT-2 124M on a GPU (about 2 x 300 steps of 25-60 ms); on a CPU use a small model, e.g.
--   build/engine tools/bf16_vs_f32.lua --device=cpu --steps=40 --n_layers=2 --dim=64 --n_heads=4 --seq=64
local engine = require("engine")
local nn, optim = engine.nn, engine.optim
local F = nn.functional
local data = require("engine.data")
local models = require("engine.models")
local cli = require("engine.cli")
local HOME = rawget(_G, "ENGINE_HOME") or "."

local o = cli.parse(arg, {
  name = "bf16_vs_f32",
  description = "Trains the GPT in fp32 and in bf16 with f32 master weights on the same batches; compares the losses.",
  options = {
    { "device", "cuda", "cpu or cuda", choices = { "cpu", "cuda" } },
    { "steps", 300, "training steps of each run", int = true, min = 21 },
    { "batch", 8, "sequences per step", int = true, min = 1 },
    { "seq", 1024, "tokens per sequence", int = true, min = 2 },
    { "n_layers", 12, "layers", int = true, min = 1 },
    { "dim", 768, "model dim", int = true, min = 8 },
    { "n_heads", 12, "attention heads", int = true, min = 1 },
    { "lr", 6e-4, "peak learning rate", min = 0 },
    { "warmup", 30, "warm-up steps", int = true, min = 0 },
    { "train", HOME .. "/data/kjv_train.bin", "training shards (tools/prepare_data.lua writes the default)" },
    { "vocab", 256, "vocabulary size (the byte-level KJV shards': 256)", int = true, min = 2 },
    { "tol", 0.01, "largest relative difference of the final losses", min = 0 },
  },
})
if o.device == "cuda" and not engine.cuda.is_available() then
  print("bf16_vs_f32: no GPU, nothing to compare: " .. engine.cuda.unavailable_reason())
  return
end

local shards = data.read_shards(o.train)
local vocab = o.vocab

local function lr_at(step)
  if step <= o.warmup then return o.lr * step / math.max(1, o.warmup) end
  local p = (step - o.warmup) / math.max(1, o.steps - o.warmup)
  return o.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
end

local function run(precision)
  engine.manual_seed(0)
  local model = models.Transformer{ n_layers = o.n_layers, dim = o.dim, n_heads = o.n_heads, vocab_size = vocab,
    max_seq_len = o.seq, dropout_p = 0, gelu = "tanh" }
  for name, p in model:named_parameters() do   -- GPT-2's N(0, 0.02) embeddings (as recipes/bench/gpu_step.lua)
    if name:match("embeddings%.weight$") then nn.init.normal_(p, 0, 0.02) end
  end
  if precision == "bf16" then model:to("bf16") end
  if o.device == "cuda" then model:to("cuda") end
  model:train()
  local opt = optim.AdamW(model:parameters(), { lr = o.lr, betas = { 0.9, 0.95 }, weight_decay = 0.1,
    master_weights = precision == "bf16" })
  local sampler = data.BatchSampler(shards, { batch_size = o.batch, seq_len = o.seq, seed = 0 })
  local losses = {}
  local t0 = engine.time()
  for step = 1, o.steps do
    local x, y = sampler:next()
    if o.device == "cuda" then x, y = x:cuda(), y:cuda() end
    local loss
    if precision == "bf16" then
      local _
      _, loss = model(x, y)   -- the fused classifier on the bf16 logits, f32 loss
    else
      loss = F.cross_entropy(model(x):reshape(-1, vocab), y:reshape(-1))
    end
    loss:backward()
    optim.clip_grad_norm_(model:parameters(), 1.0)
    for _, g in ipairs(opt.param_groups) do g.lr = lr_at(step) end
    opt:step()
    opt:zero_grad()
    losses[step] = loss:item()
  end
  return losses, engine.time() - t0
end

local l32, t32 = run("f32")
local l16, t16 = run("bf16")
for step = 1, o.steps do
  if step == 1 or step % 25 == 0 or step == o.steps then
    print(string.format("step %4d | fp32 loss %.4f | bf16 loss %.4f", step, l32[step], l16[step]))
  end
end
local function tail_mean(l)
  local s = 0
  for i = o.steps - 19, o.steps do s = s + l[i] end
  return s / 20
end
local a, b = tail_mean(l32), tail_mean(l16)
local rel = math.abs(b - a) / a
print(string.format("bf16_vs_f32: %s, %d steps of batch %d x %d: fp32 %.1f s, bf16 %.1f s; mean loss of the last 20 "
  .. "steps: fp32 %.4f, bf16 %.4f, relative difference %.2f%% (target <= %.2f%%)", o.device, o.steps, o.batch, o.seq,
  t32, t16, a, b, 100 * rel, 100 * o.tol))
if rel > o.tol then os.exit(1) end
