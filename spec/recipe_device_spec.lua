-- The recipes' --device option (recipes/common.lua: check_device, to_device): without a GPU, --device=cuda fails
-- at once with the runtime's reason and a wrong device names the option; on a GPU ("#gpu"), gpt.lua, fsdp_gpt.lua
-- and llama.lua train on CUDA to the CPU run's losses, and fsdp_gpt.lua (2 ranks), tp_gpt.lua (2) and gpt_2d.lua (4)
-- on CUDA meshes to the CPU meshes' (f32, 3 steps, relative 1e-3: GPU and CPU kernels round differently).
local engine = require("engine")
local proc = require("spec.helpers.proc")

local COMMON = { "--steps=3", "--log_every=1", "--sample_len=0", "--eval_batches=1", "--eval_every=0", "--ckpt_every=-1",
  "--n_layers=2", "--dim=64", "--seq=32", "--batch=4", "--log_exact=1" }

local function args(extra)
  local a = {}
  for _, v in ipairs(COMMON) do a[#a + 1] = v end
  for _, v in ipairs(extra or {}) do a[#a + 1] = v end
  return a
end

local function losses(out)
  local r = {}
  for v in out:gmatch("| loss ([%d%.e%-+]+) |") do r[#r + 1] = tonumber(v) end
  return r
end

describe("recipes --device", function()
  it("--device=cuda without a GPU fails at once with the reason; a wrong device names the option", function()
    if engine.cuda.is_available() then pending("a GPU is present: covered by the #gpu tests") end
    local out, st = proc.job(0, "recipes/gpt.lua", args({ "--device=cuda" }))
    assert.are_not.equal(0, st)
    assert.matches("gpt: %-%-device=cuda: CUDA is not available", out)
    out, st = proc.job(0, "recipes/fsdp_gpt.lua", args({ "--device=cuda" }))
    assert.are_not.equal(0, st)
    assert.matches("fsdp_gpt: %-%-device=cuda: CUDA is not available", out)
    out, st = proc.job(0, "recipes/gpt.lua", args({ "--device=tpu" }))
    assert.are_not.equal(0, st)
    assert.matches("%-%-device must be one of cpu, cuda, got 'tpu'", out)
  end)
end)

describe("recipes on the GPU #gpu", function()
  local function same_losses(label, np, script, extra)
    local cpu_out = proc.job(np, script, args(extra))
    local gpu_extra = { "--device=cuda" }
    for _, v in ipairs(extra or {}) do gpu_extra[#gpu_extra + 1] = v end
    -- more ranks than GPUs: each rank its own NCCL host id (NCCL refuses two ranks of one host on one GPU)
    local shared = np > 1 and engine.cuda.device_count() < np
    local gpu_out, st = proc.job(np, script, args(gpu_extra), { own_nccl_host = shared })
    assert.are.equal(0, st, gpu_out)
    local a, b = losses(cpu_out), losses(gpu_out)
    assert.are.equal(3, #a, cpu_out)
    assert.are.equal(#a, #b, gpu_out)
    for i = 1, #a do
      assert(math.abs(a[i] - b[i]) <= 1e-3 * math.abs(a[i]), string.format("%s step %d: cpu %.9g, cuda %.9g", label, i, a[i], b[i]))
    end
  end

  it("gpt.lua trains on one GPU to the CPU's losses", function()
    if not engine.cuda.is_available() then pending("no GPU: " .. engine.cuda.unavailable_reason()) end
    same_losses("gpt", 0, "recipes/gpt.lua")
  end)

  it("fsdp_gpt.lua (one rank) trains on the GPU to the CPU's losses", function()
    if not engine.cuda.is_available() then pending("no GPU: " .. engine.cuda.unavailable_reason()) end
    same_losses("fsdp_gpt", 0, "recipes/fsdp_gpt.lua")
  end)

  it("llama.lua trains on one GPU to the CPU's losses", function()
    if not engine.cuda.is_available() then pending("no GPU: " .. engine.cuda.unavailable_reason()) end
    same_losses("llama", 0, "recipes/llama.lua")
  end)

  -- the distributed recipes on CUDA meshes (NCCL), against the same recipe on CPU meshes at the same ranks
  for _, case in ipairs({ { "fsdp_gpt", 2 }, { "tp_gpt", 2 }, { "gpt_2d", 4 } }) do
    it(case[1] .. ".lua at " .. case[2] .. " ranks trains on CUDA meshes to the CPU meshes' losses", function()
      if not engine.cuda.is_available() then pending("no GPU: " .. engine.cuda.unavailable_reason()) end
      if not proc.have_mpirun() then pending("no mpirun") end
      same_losses(case[1], case[2], "recipes/" .. case[1] .. ".lua")
    end)
  end
end)
