-- tools/bf16_vs_f32.lua (issue 28: a bf16 run with f32 master weights follows the fp32 loss curve): on the CPU with a
-- small model the two runs' final losses agree within the tool's 1%, and the tool fails (status 1) when they do not.
local proc = require("spec.helpers.proc")

local SMALL = { "--device=cpu", "--steps=30", "--n_layers=2", "--dim=32", "--n_heads=4", "--seq=32", "--batch=4",
  "--warmup=5", "--lr=3e-3" }

describe("tools/bf16_vs_f32.lua", function()
  it("fp32 and bf16 with master weights end within 1% on the same batches", function()
    local out, st = proc.job(0, "tools/bf16_vs_f32.lua", SMALL)
    assert.are.equal(0, st, out)
    local a, b = out:match("fp32 ([%d%.]+), bf16 ([%d%.]+), relative difference")
    assert.is_truthy(a, out)
    assert.is_true(math.abs(tonumber(a) - tonumber(b)) <= 0.01 * tonumber(a), out)
    assert.matches("step   30 | fp32 loss", out, 1, true)
  end)

  it("exits 1 when the difference is above --tol", function()
    local args = { "--tol=0" }
    for _, v in ipairs(SMALL) do args[#args + 1] = v end
    local out, st = proc.job(0, "tools/bf16_vs_f32.lua", args)
    -- a bf16 run equal to the fp32 one to the last digit would pass even --tol=0; it never is (rounding)
    assert.are.equal(1, st, out)
    assert.matches("relative difference", out, 1, true)
  end)
end)
