-- engine.nn.embedding: Embedding (a lookup table of vectors).
local engine = require("engine")
local core = require("engine.core")
local mod = require("engine.nn.module")
local init = require("engine.nn.initializers")
local F = require("engine.nn.functional")
local Module, Parameter = mod.Module, mod.Parameter

local M = {}

local Embedding = Module:extend("Embedding")
M.Embedding = Embedding

-- Embedding(num_embeddings, embedding_dim [, {padding_idx = nil, dtype = "f32"}])
-- weight [num, dim] ~ N(0, 1); the padding_idx row (a 0-based token id; negative
-- counts from the end) is zero and gets no gradient.  Indices are 0-based token ids.
function Embedding:__init(num_embeddings, embedding_dim, opts)
  opts = core.check_opts(opts, { "padding_idx", "dtype" }, "Embedding")
  for _, v in ipairs({ { num_embeddings, "num_embeddings" }, { embedding_dim, "embedding_dim" } }) do
    if type(v[1]) ~= "number" or v[1] % 1 ~= 0 or v[1] < 0 then
      error(string.format("Embedding: %s must be a non-negative integer, got %s", v[2], tostring(v[1])), 3)
    end
  end
  self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
  local pad = opts.padding_idx
  if pad ~= nil then
    if type(pad) ~= "number" or pad % 1 ~= 0 or pad >= num_embeddings or pad < -num_embeddings then
      error(string.format("Embedding: padding_idx %s must be within [-%d, %d) (a 0-based token id)",
        tostring(pad), num_embeddings, num_embeddings), 3)
    end
    if pad < 0 then pad = num_embeddings + pad end
  end
  self.padding_idx = pad
  self.weight = Parameter(engine.empty(num_embeddings, embedding_dim, { dtype = opts.dtype or "f32" }))
  self:reset_parameters()
end

function Embedding:reset_parameters()
  init.normal_(self.weight, 0, 1)
  if self.padding_idx ~= nil then
    engine.no_grad(function() self.weight:select(1, self.padding_idx + 1):zero_() end)
  end
end

function Embedding:forward(idx)
  return F.embedding(idx, self.weight, self.padding_idx)
end

function Embedding:extra_repr()
  local s = string.format("%d, %d", self.num_embeddings, self.embedding_dim)
  if self.padding_idx ~= nil then s = s .. ", padding_idx=" .. self.padding_idx end
  return s
end

return M
