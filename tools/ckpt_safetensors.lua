-- tools/ckpt_safetensors.lua: a distributed checkpoint (dist.checkpoint directory) to one safetensors
-- file of full tensors, and back.  One process.
--
--   build/engine tools/ckpt_safetensors.lua to CKPT_DIR OUT.safetensors [--prefix=model.]
--   build/engine tools/ckpt_safetensors.lua from IN.safetensors CKPT_DIR [--prefix=model.]
--
-- to: every tensor of the checkpoint whose key starts with the prefix (default "model.": the model's
-- state_dict, whose names are PyTorch's for the models of lua/engine/models.lua) is read in full (all
-- chunks, checksums verified) and written under its key without the prefix; --prefix= (empty) keeps
-- every tensor under its full key (optimizer state too).  The checkpoint's values go into the file's
-- __metadata__ as "<key>" = serialized value (only with an empty prefix).
-- from: every tensor of the file becomes "<prefix><name>" in a new checkpoint (loadable with
-- dist.checkpoint.load at any world size and layout, e.g. state {model = model:state_dict()}).
-- To load a safetensors file straight into a sharded model use engine.load_safetensors(path,
-- model:state_dict()).
local engine = require("engine")
local dist = engine.distributed
local ckpt = dist.checkpoint

local function usage(msg)
  io.stderr:write((msg and ("ckpt_safetensors: " .. msg .. "\n") or "") ..
    "usage: engine tools/ckpt_safetensors.lua to CKPT_DIR OUT.safetensors [--prefix=model.]\n" ..
    "       engine tools/ckpt_safetensors.lua from IN.safetensors CKPT_DIR [--prefix=model.]\n")
  os.exit(2)
end

local args, prefix = {}, "model."
for _, a in ipairs(arg or {}) do
  local p = a:match("^%-%-prefix=(.*)$")
  if p then prefix = p elseif a:match("^%-%-") then usage("unknown option " .. a) else args[#args + 1] = a end
end
if #args ~= 3 then usage() end
local mode, src, dst = args[1], args[2], args[3]
if dist.world_size() ~= 1 then usage("run it as one process") end

local function starts(s, p) return s:sub(1, #p) == p end

if mode == "to" then
  local md = ckpt.read_metadata(src)
  local tensors, meta, n = {}, {}, 0
  for key in pairs(md.tensors) do
    if starts(key, prefix) then
      tensors[key:sub(#prefix + 1)] = ckpt.read_tensor(src, key)
      n = n + 1
    end
  end
  if n == 0 then usage(string.format("no tensor of %s starts with '%s'", src, prefix)) end
  if prefix == "" then
    for key, v in pairs(md.values) do meta[key] = ckpt._serialize(v, key) end
  end
  meta.format = "pt"
  engine.save(dst, tensors, meta)
  print(string.format("ckpt_safetensors: %d tensors of %s (saved at %d ranks) -> %s", n, src, md.world_size, dst))
elseif mode == "from" then
  local tensors = engine.load(src)
  local state, n = {}, 0
  for name, t in pairs(tensors) do
    state[prefix .. name] = t
    n = n + 1
  end
  ckpt.save(state, dst)
  print(string.format("ckpt_safetensors: %d tensors of %s -> %s", n, src, dst))
else
  usage("the mode is 'to' or 'from'")
end
