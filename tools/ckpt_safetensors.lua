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

local cli = require("engine.cli")
local NAME = "ckpt_safetensors"
local o = cli.parse(arg or {}, { name = NAME,
  description = "A distributed checkpoint (dist.checkpoint folder) to one safetensors file of full tensors (to "
    .. "CKPT_DIR OUT.safetensors), and back (from IN.safetensors CKPT_DIR).  One process.",
  arguments = { { "mode", "to or from", choices = { "to", "from" } }, { "src", "what to read" },
    { "dst", "what to write" } },
  options = { { "prefix", "model.", "the keys of the checkpoint that are converted (to: the prefix is dropped; "
    .. "from: it is added); empty: every tensor under its full key, values in the file's metadata" } } })
local mode, src, dst, prefix = o.mode, o.src, o.dst, o.prefix
local function usage(msg) cli.usage_error(NAME, "%s", msg) end
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
end
