-- tools/ckpt_safetensors.lua (interop): a distributed checkpoint to one safetensors file of
-- full tensors under the model's (PyTorch's) names and back; the round trip keeps every value, the
-- file loads into a model with engine.load_safetensors, and a checkpoint made from the file loads
-- into a fresh model.
local engine = require("engine")
local nn = engine.nn
local dist = engine.distributed
local ckpt = dist.checkpoint
local self_exe = require("spec.helpers.proc").self_exe

local TMP = os.tmpname()
os.remove(TMP)
os.execute("mkdir -p " .. TMP)

local function tool(args)
  local cmd = string.format("cd '%s' && '%s' tools/ckpt_safetensors.lua %s 2>&1; echo \"__rc=$?\"", ENGINE_HOME or ".",
    self_exe(), args)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  return out, tonumber(out:match("__rc=(%d+)%s*$"))
end

local function model(seed)
  engine.manual_seed(seed)
  return nn.Transformer{ n_layers = 1, dim = 16, n_heads = 2, vocab_size = 32, max_seq_len = 8 }
end

local function same_params(a, b)
  local sb = b:state_dict()
  local n = 0
  for name, t in pairs(a:state_dict()) do
    assert.is_not_nil(sb[name], name)
    assert.equal(0, (t:double() - sb[name]:double()):abs():max():item(), name)
    n = n + 1
  end
  return n
end

describe("tools/ckpt_safetensors.lua", function()
  teardown(function() os.execute("rm -rf '" .. TMP .. "'") end)

  it("checkpoint -> safetensors (model names) -> checkpoint keeps every tensor", function()
    local m = model(1)
    local dir = TMP .. "/ck"
    ckpt.save({ model = m:state_dict(), step = 3 }, dir)
    local out, rc = tool("to " .. dir .. " " .. TMP .. "/m.safetensors")
    assert.equal(0, rc, out)
    local tensors = engine.load(TMP .. "/m.safetensors")
    local names = m:state_dict_keys()
    for _, name in ipairs(names) do assert.is_not_nil(tensors[name], name) end
    assert.is_not_nil(tensors["layers.0.attention.wq.weight"])
    -- the file into a fresh model (any layout: here plain)
    local m2 = model(2)
    engine.load_safetensors(TMP .. "/m.safetensors", m2:state_dict())
    assert.is_true(same_params(m, m2) > 5)
    -- and back into a checkpoint, loaded into a third model
    out, rc = tool("from " .. TMP .. "/m.safetensors " .. TMP .. "/ck2")
    assert.equal(0, rc, out)
    local m3 = model(3)
    ckpt.load({ model = m3:state_dict() }, TMP .. "/ck2")
    same_params(m, m3)
  end)

  it("--prefix= keeps every tensor and the values; bad arguments are errors", function()
    local dir = TMP .. "/ck3"
    ckpt.save({ a = { b = engine.ones(2) }, step = 5 }, dir)
    local out, rc = tool("to " .. dir .. " " .. TMP .. "/all.safetensors --prefix=")
    assert.equal(0, rc, out)
    local t, meta = engine.load(TMP .. "/all.safetensors")
    assert.equal(2, t["a.b"]:sum():item())
    assert.equal("5", meta.step)
    out, rc = tool("to " .. TMP .. "/nothing " .. TMP .. "/x.safetensors")
    assert.is_true(rc ~= 0)
    assert.is_truthy(out:find("no metadata file", 1, true), out)
    out, rc = tool("sideways a b")
    assert.equal(2, rc, out)
  end)
end)
