-- engine.data: tokenizers (byte-level, GPT-2 style BPE), llm.c token shards, batch samplers.
--   local tok = data.load_tokenizer("data/tokenizers/kjv-bpe-4k")  -- or "byte", a tokenizer.json, vocab.json
--   local ids = tok:encode("text" [, {tensor = true}]); tok:decode(ids); tok.vocab_size, tok.eot, tok.name
--   local data = require("engine").data
--   data.write_shard("train.bin", data.encode(text))
--   local train = data.BatchSampler(data.read_shard("train.bin"), {batch_size = 8, seq_len = 128, seed = 0})
--   local x, y = train:next()                       -- i64 [8, 128] each
--   for x, y in data.ValLoader(data.read_shard("val.bin"), {batch_size = 8, seq_len = 128}):batches() do ... end
local tokenizer = require("engine.data.tokenizer")
local shards = require("engine.data.shards")
local sampler = require("engine.data.sampler")
local bpe = require("engine.data.bpe")

local data = {}
data.ByteTokenizer = tokenizer.ByteTokenizer
data.encode = tokenizer.encode
data.decode = tokenizer.decode
data.vocab_size = tokenizer.vocab_size
data.BPETokenizer = bpe.BPETokenizer

-- load_tokenizer(spec [, merges_path]) -> a tokenizer with encode(s [, {tensor = true}]), decode(ids or
-- tensor), vocab_size, eot (end-of-text id or nil), name.  spec: "byte" (the byte-level tokenizer), a Hugging
-- Face tokenizer.json (byte-level BPE, as GPT-2's), a folder holding tokenizer.json or vocab.json +
-- merges.txt, a vocab.json (with merges_path, or the merges.txt next to it), or a tokenizer (returned as is).
function data.load_tokenizer(spec, merges_path)
  if type(spec) == "table" and type(spec.encode) == "function" and type(spec.decode) == "function" then
    return spec
  end
  if type(spec) ~= "string" or spec == "" then
    error("load_tokenizer: expected \"byte\" or a path, got " .. (spec == "" and "an empty string" or type(spec)), 2)
  end
  if spec == "byte" and merges_path == nil then return tokenizer.ByteTokenizer() end
  local ok, t = pcall(bpe.load, spec, merges_path)
  if not ok then error(t, 2) end
  return t
end

-- tokenizer_name(spec) -> the name of a tokenizer spec in data file names: the folder's name for .../<name>/
-- tokenizer.json or .../<name>/vocab.json (and for the folder itself), else the file's name without .json
-- (tools/prepare_data.lua names its BPE shards <stem>_<name>_{train,val}.bin; the recipes' default data agrees)
function data.tokenizer_name(spec)
  local p = spec:gsub("/+$", "")
  local function base(x) return x:match("([^/]+)$") or x end
  if base(p) == "tokenizer.json" or base(p) == "vocab.json" then p = p:match("^(.*)/[^/]*$") or "." end
  return (base(p):gsub("%.json$", ""))
end

data.Shard = shards.Shard
data.write_shard = shards.write_shard
data.read_shard = shards.read_shard
data.SHARD_MAGIC, data.SHARD_VERSION = shards.MAGIC, shards.VERSION

data.SHARD_MAGIC_U32, data.SHARD_VERSION_U32 = shards.MAGIC_U32, shards.VERSION_U32
data.shard_info = shards.shard_info
-- read_shards(path, glob or {paths}) -> list of Shards, with .n (total tokens), .paths, .vocab_size
data.read_shards = shards.read_shards
data.expand_paths = shards.expand

data.BatchSampler = sampler.BatchSampler
data.ValLoader = sampler.ValLoader

return data
