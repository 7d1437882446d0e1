-- Tensor parallelism on a 1-rank mesh issues the plain model's local ops (issue 27): tools/tp1_ops.lua counts the
-- ops of one training step (forward, fused classifier loss, backward, AdamW, zero_grad) of a small GPT / Llama,
-- plain and under Transformer.parallelize / Llama.parallelize on a 1-rank CPU mesh, through the profiler's entries
-- (every op the Lua API calls, redistribute, from_local / to_local, the collectives, and every autograd node's
-- backward by name).  A child process, since the profiler's wrapper is installed when the library loads.
--
-- What the TP step may have in addition (the allowance) is DTensor bookkeeping only: from_local, to_local,
-- redistribute and their backward nodes, which on one rank are views without data movement (the layouts at the
-- parallel styles' boundaries, see ALLOW).  Every other op (the compute: GEMMs, fused QKV projection, linear_gelu,
-- add_layer_norm, attention, embedding, the fused classifier, the optimizer) must be called exactly as often as in
-- the plain step, a DTensor transpose (a permute of the local view) counting as a transpose.  The first step's
-- loss is the same to the bit, and the allocator serves at most ALLOCS more requests per step: autograd sums two
-- DTensor gradients out of place (the tied embedding's two gradients in the GPT; in Llama, per block, the two
-- Partial input gradients of w1 and w3).
local proc = require("spec.helpers.proc")

local BOOKKEEPING = { dtensor_from_local = true, dtensor_to_local = true, dtensor_redistribute = true,
  FromLocalBackward = true, ToLocalBackward = true, RedistributeBackward = true }
local ALIAS = { PermuteBackward = "TransposeBackward" }

-- The bookkeeping ops per step allowed: fixed + per_layer * n_layers.  GPT, default plan, per block: the fused QKV
-- projection's 3 weight to_local and 3 output from_local (q, k, v stay DTensors for the attention); wo and w2
-- (RowwiseParallel): from_local of the input, Partial -> Replicate, to_local; w1 (ColwiseParallel, fused with its
-- gelu): from_local, to_local; 14 calls and 13 backward nodes.  Fixed: the two embeddings (from_local of the ids,
-- Partial -> Replicate, to_local) and the output projection (from_local, Shard -> Replicate, to_local) with
-- their backward nodes.  local_output_for_attn: q, k, v are the local pieces (4 fewer per block); attn_bias: the
-- 3 bias to_local and their nodes.  Llama (no fused QKV in either): wq, wk, wv, w1, w3 column-parallel, wo, w2
-- row-parallel.
local CASES = {
  { name = "GPT", args = {}, fixed = 16, per_layer = 27, allocs = { 1, 0 } },
  { name = "GPT, local_output_for_attn", args = { "--local_attn=1" }, fixed = 16, per_layer = 23, allocs = { 1, 0 } },
  { name = "GPT with attention biases", args = { "--attn_bias=1" }, fixed = 16, per_layer = 34, allocs = { 1, 0 } },
  { name = "Llama", args = { "--model=llama" }, fixed = 11, per_layer = 26, allocs = { 0, 1 } },
}
local N_LAYERS = 2

local function run(args)
  local a = { "--n_layers=" .. N_LAYERS, "--all=1" }
  for _, x in ipairs(args) do a[#a + 1] = x end
  local out, rc = proc.job(0, "tools/tp1_ops.lua", a, { env = { ENGINE_PROFILE = "0" }, timeout = 120 })
  assert.are.equal(0, rc, out)
  local plain, tp = {}, {}
  for name, p, t in out:gmatch("\n([%w_]+)%s+([%d%.]+)%s+([%d%.]+)%s+[%+%-][%d%.]+") do
    name = ALIAS[name] or name
    plain[name] = (plain[name] or 0) + tonumber(p)
    tp[name] = (tp[name] or 0) + tonumber(t)
  end
  return out, plain, tp
end

describe("tensor parallelism on a 1-rank mesh", function()
  for _, case in ipairs(CASES) do
    it(case.name .. ": the plain step's ops, plus DTensor bookkeeping within its allowance", function()
      local out, plain, tp = run(case.args)
      assert.is_truthy(plain.linear and plain.linear > 0, out)
      local names = {}
      for k in pairs(plain) do names[k] = true end
      for k in pairs(tp) do names[k] = true end
      local extra = 0
      for k in pairs(names) do
        local a, b = plain[k] or 0, tp[k] or 0
        if BOOKKEEPING[k] then
          assert.are.equal(0, a, k .. " in the plain step\n" .. out)
          extra = extra + b
        else
          assert.are.equal(a, b, string.format("%s: %g calls in the plain step, %g in the TP step\n%s", k, a, b, out))
        end
      end
      local allow = case.fixed + case.per_layer * N_LAYERS
      assert.is_true(extra <= allow, string.format("%d bookkeeping ops per step, allowed %d\n%s", extra, allow, out))
      local lp, lt = out:match("first%-step loss plain (%S+) tp1 (%S+)")
      assert.is_truthy(lp, out)
      assert.are.equal(lp, lt, out)
      local ap, at = out:match("allocs plain (%S+) tp1 (%S+)")
      local more = case.allocs[1] + case.allocs[2] * N_LAYERS   -- ALLOCS: fixed, per block
      assert.is_true(tonumber(at) <= tonumber(ap) + more, string.format("%s allocations per step, plain %s, allowed "
        .. "%d more\n%s", at, ap, more, out))
    end)
  end
end)
