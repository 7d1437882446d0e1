-- tools/tp1_ops.lua: the ops of one training step of a small GPT, plain and under Transformer.parallelize on a
-- 1-rank CPU mesh (issue 27: a 1-rank tensor-parallel step should issue the plain step's local ops), side by side.
--
--   ENGINE_PROFILE=0 build/engine tools/tp1_ops.lua [--model=gpt|llama] [--dtype=f32|bf16] [--n_layers=2] [--dim=64]
--       [--n_heads=4] [--n_kv_heads=2] [--vocab=256] [--seq=32] [--batch=4] [--steps=1] [--time=0] [--all=0]
--       [--count=1] [--sp=0] [--local_attn=0] [--attn_bias=0]
--
-- --sp=1, --local_attn=1: Transformer.parallelize's use_seq_parallel, local_output_for_attn (--model=llama: --sp is
-- Llama.parallelize's use_seq_parallel); --attn_bias=1: the GPT with biases on its attention projections.
--
-- Prints, per op name (the profiler's entries: every op the Lua API calls, redistribute, collectives, device
-- copies, and every autograd node's backward by name), the calls per step of the plain step and of the TP step
-- and their difference (only the rows that differ, unless --all=1), then the totals and the allocator's requests
-- per step, and a line
--   tp1_ops: plain <P> ops, tp1 <T> ops, extra <T-P>, allocs plain <a> tp1 <b>
-- With --time=N (N > 0) it also times N steps of each, alternately (after 2 warm-up steps each), and prints
--   tp1_ops: time plain <p> ms, tp1 <t> ms, ratio <t/p>   (medians)
-- --count=0: no op counts, only the times (then the profiler is not needed and not installed).
-- Needs ENGINE_PROFILE=0 at launch (the profiler's wrapper is installed when the library loads); without it the
-- script re-runs itself with it.  spec/tp1_ops_spec.lua runs it and holds the difference to its allowance.
local engine = require("engine")
local prof = require("engine.profiler")
local ffi = require("ffi")

local o = { model = "gpt", dtype = "f32", n_layers = 2, dim = 64, n_heads = 4, n_kv_heads = 2, vocab = 256, seq = 32,
  batch = 4, steps = 1, time = 0, all = 0, count = 1, sp = 0, local_attn = 0, attn_bias = 0 }
local home = (ENGINE_HOME and ENGINE_HOME ~= "") and ENGINE_HOME or "."
local U = dofile(home .. "/recipes/bench/util.lua")
U.parse_args("tools/tp1_ops", o, arg)

if o.count ~= 0 and not prof.installed() then
  local a = {}
  for i = 1, #arg do a[i] = "'" .. arg[i]:gsub("'", "'\\''") .. "'" end
  local exe = arg[-1] or (home .. "/build/engine")
  local ok = os.execute(string.format("ENGINE_PROFILE=0 '%s' '%s' %s", exe, arg[0], table.concat(a, " ")))
  os.exit((ok == 0 or ok == true) and 0 or 1)
end

local nn, optim = engine.nn, engine.optim
local F = nn.functional
local models = require("engine.models")
local C = engine.C

local function build()
  local model
  if o.model == "gpt" then
    engine.manual_seed(0)
    model = models.Transformer{ n_layers = o.n_layers, dim = o.dim, n_heads = o.n_heads, vocab_size = o.vocab,
      max_seq_len = o.seq, dropout_p = 0, gelu = "tanh", attn_bias = o.attn_bias ~= 0 }
    for name, p in model:named_parameters() do   -- GPT-2's N(0, 0.02) embeddings, as recipes/bench/util.lua
      if name:match("embeddings%.weight$") then nn.init.normal_(p, 0, 0.02) end
    end
    model:train()
  else
    engine.manual_seed(0)
    model = models.Llama{ dim = o.dim, n_layers = o.n_layers, n_heads = o.n_heads, n_kv_heads = o.n_kv_heads,
      vocab_size = o.vocab, max_seq_len = o.seq }
    model:train()
  end
  if o.dtype ~= "f32" then model:to(o.dtype) end
  return model
end

local function loss_of(model, x, y)
  if o.model == "gpt" then
    local _, loss = model(x, y)
    return loss
  end
  return F.fused_classifier(model(x, { float = false }), y)
end

local x, y = U.batch{ batch = o.batch, seq = o.seq, vocab = o.vocab }

local function stepper(model)
  local opt = optim.AdamW(model:parameters(), { lr = 3e-4, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0.1 })
  return function()
    local loss = loss_of(model, x, y)
    loss:backward()
    opt:step()
    opt:zero_grad()
    return loss
  end
end

local stats = ffi.new("eng_alloc_stats")
local function allocs() C.eng_alloc_get_stats(stats); return tonumber(stats.n_allocs) end

-- counts(step) -> {name = calls per step}, total, allocation requests per step (after one warm-up step)
local function counts(step)
  step()
  collectgarbage()
  prof.reset()
  local a0 = allocs()
  prof.enable()
  for _ = 1, o.steps do step() end
  prof.disable()
  local a1 = allocs()
  local r, total = {}, 0
  for _, e in ipairs(prof.entries()) do
    r[e.name] = e.calls / o.steps
    total = total + e.calls / o.steps
  end
  return r, total, (a1 - a0) / o.steps
end

-- the median step times of the two steps, timed alternately (so that drifts of the machine hit both alike)
local function median_times(s1, s2, n)
  s1(); s2(); s1(); s2()
  local t1, t2 = {}, {}
  for i = 1, n do
    local t0 = engine.time()
    s1()
    t1[i] = engine.time() - t0
    t0 = engine.time()
    s2()
    t2[i] = engine.time() - t0
  end
  return U.median(t1), U.median(t2)
end

local plain = build()
local plain_step = stepper(plain)
local tp = build()
local mesh = engine.distributed.init_device_mesh("cpu", { 1 }, { "tp" })
if o.model == "gpt" then
  models.Transformer.parallelize(tp, mesh, { use_seq_parallel = o.sp ~= 0, local_output_for_attn = o.local_attn ~= 0 })
else
  models.Llama.parallelize(tp, mesh, { use_seq_parallel = o.sp ~= 0 })
end
local tp_step = stepper(tp)

local lp = plain_step():item()
local lt = tp_step():item()
print(string.format("first-step loss plain %.6f tp1 %.6f", lp, lt))
if o.count ~= 0 then
  local pc, pt, pa = counts(plain_step)
  local tc, tt, ta = counts(tp_step)

  local names = {}
  for k in pairs(pc) do names[#names + 1] = k end
  for k in pairs(tc) do if pc[k] == nil then names[#names + 1] = k end end
  table.sort(names)
  print(string.format("%-32s %8s %8s %8s", "op", "plain", "tp1", "extra"))
  for _, k in ipairs(names) do
    local a, b = pc[k] or 0, tc[k] or 0
    if o.all ~= 0 or a ~= b then print(string.format("%-32s %8g %8g %+8g", k, a, b, b - a)) end
  end
  print(string.format("tp1_ops: plain %g ops, tp1 %g ops, extra %g, allocs plain %g tp1 %g", pt, tt, tt - pt, pa, ta))
end
if o.time > 0 then
  local a, b = median_times(plain_step, tp_step, o.time)
  print(string.format("tp1_ops: time plain %.3f ms, tp1 %.3f ms, ratio %.3f", a * 1e3, b * 1e3, b / a))
end
