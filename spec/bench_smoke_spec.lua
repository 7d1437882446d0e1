-- The GPU benchmarks run where there is no GPU: recipes/bench/gpu_kernels.lua on the CPU with small shapes prints
-- one line per op (time and rate; no timing is asserted), and recipes/bench/gpu_step.lua without a GPU says so and
-- exits 0, also with --model=llama; a bad --model is a usage error.
local engine = require("engine")
local proc = require("spec.helpers.proc")

describe("GPU benchmarks without a GPU", function()
  it("gpu_kernels.lua --device=cpu prints every op's line", function()
    local out, st = proc.job(0, "recipes/bench/gpu_kernels.lua", { "--device=cpu", "--batch=1", "--seq=16", "--dim=32",
      "--heads=4", "--vocab=64", "--reps=1", "--dtype=f32" })
    assert.are.equal(0, st, out)
    for _, op in ipairs({ "layer_norm fwd", "add_layer_norm bwd", "gelu tanh fwd", "linear qkv bwd", "sdpa causal fwd",
      "rotary_emb bwd", "embedding bwd", "classifier", "adamw" }) do
      assert.is_truthy(out:find(op, 1, true), op .. "\n" .. out)
    end
  end)

  it("gpu_step.lua says there is no GPU and exits 0; --model=x is a usage error", function()
    if engine.cuda.is_available() then pending("a GPU is present: tools/gpu-check.sh runs the benchmark") end
    for _, extra in ipairs({ {}, { "--model=llama" } }) do
      local out, st = proc.job(0, "recipes/bench/gpu_step.lua", extra)
      assert.are.equal(0, st, out)
      assert.matches("bench/gpu_step: no GPU, nothing to measure", out, 1, true)
    end
    local out, st = proc.job(0, "recipes/bench/gpu_step.lua", { "--model=x" })
    assert.are.equal(2, st, out)
    assert.matches("bench/gpu_step: --model must be gpt or llama, got 'x'", out, 1, true)
  end)
end)
