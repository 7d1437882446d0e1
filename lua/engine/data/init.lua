-- engine.data: byte-level tokenizer, llm.c token shards, batch samplers.
--   local data = require("engine").data
--   data.write_shard("train.bin", data.encode(text))
--   local train = data.BatchSampler(data.read_shard("train.bin"), {batch_size = 8, seq_len = 128, seed = 0})
--   local x, y = train:next()                       -- i64 [8, 128] each
--   for x, y in data.ValLoader(data.read_shard("val.bin"), {batch_size = 8, seq_len = 128}):batches() do ... end
local tokenizer = require("engine.data.tokenizer")
local shards = require("engine.data.shards")
local sampler = require("engine.data.sampler")

local data = {}
data.ByteTokenizer = tokenizer.ByteTokenizer
data.encode = tokenizer.encode
data.decode = tokenizer.decode
data.vocab_size = tokenizer.vocab_size

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
