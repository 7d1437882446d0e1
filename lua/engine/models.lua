-- engine.models: the test models of seed 003 (PyTorch's common_dtensor.py),
-- ported with their defaults: ModelArgs, RMSNormPython, MLPModule,
-- MLPStacked, Attention, FeedForward, TransformerBlock, Transformer.
-- Also exported as nn.Transformer etc.
--
--   local model = nn.Transformer{n_layers = 2, dim = 256, n_heads = 4, vocab_size = 256, max_seq_len = 128}
--   local logits = model(tokens)           -- tokens i64 [B, T] (0-based ids) -> f32 [B, T, vocab_size]
--
-- Parameter names follow PyTorch ("layers.0.attention.wq.weight"); with
-- weight tying, output.weight IS tok_embeddings.weight (one tensor: it is
-- listed once by parameters(), under both names by state_dict()).
local engine = require("engine")
local nn = require("engine.nn")
local F = nn.functional

local M = {}

-- ---------------------------------------------------------------- ModelArgs
local defaults = {
  n_layers = 2, vocab_size = 8, max_seq_len = 16, dim = 16, n_heads = 4, dropout_p = 0.1,
  use_attn_mask = true, weight_tying = true, checkpoint_activations = false,
}
M.ModelArgs_defaults = defaults

local kinds = {
  n_layers = "count", vocab_size = "count", max_seq_len = "count", dim = "count", n_heads = "count",
  dropout_p = "prob", use_attn_mask = "boolean", weight_tying = "boolean", checkpoint_activations = "boolean",
}

-- ModelArgs{...}: the defaults above, overridden by the given fields.
function M.ModelArgs(t)
  if t ~= nil and type(t) ~= "table" then error("ModelArgs: expected a table of fields, got " .. type(t), 2) end
  local a = {}
  for k, v in pairs(defaults) do a[k] = v end
  for k, v in pairs(t or {}) do
    local kind = kinds[k]
    if not kind then
      local names = {}
      for n in pairs(defaults) do names[#names + 1] = n end
      table.sort(names)
      error(string.format("ModelArgs: unknown field '%s' (fields: %s)", tostring(k), table.concat(names, ", ")), 2)
    end
    if kind == "count" and (type(v) ~= "number" or v % 1 ~= 0 or v < (k == "n_layers" and 0 or 1)) then
      error(string.format("ModelArgs: %s must be a positive integer, got %s", k, tostring(v)), 2)
    elseif kind == "prob" and (type(v) ~= "number" or v < 0 or v > 1) then
      error(string.format("ModelArgs: %s must be a number in [0, 1], got %s", k, tostring(v)), 2)
    elseif kind == "boolean" and type(v) ~= "boolean" then
      error(string.format("ModelArgs: %s must be a boolean, got %s", k, tostring(v)), 2)
    end
    a[k] = v
  end
  if a.dim % a.n_heads ~= 0 then
    error(string.format("ModelArgs: dim (%d) must be divisible by n_heads (%d)", a.dim, a.n_heads), 2)
  end
  return a
end

-- A ModelArgs table (re-validated) or a partial table of fields.
local function args_of(args) return M.ModelArgs(args) end

-- ---------------------------------------------------------------- RMSNormPython
-- The seed's reference RMSNorm written with elementary ops.
local RMSNormPython = nn.Module:extend("RMSNormPython")
M.RMSNormPython = RMSNormPython

function RMSNormPython:__init(dim, eps)
  self.eps = eps or 1e-6
  self.weight = nn.Parameter(engine.ones(dim))
end

function RMSNormPython:_norm(x)
  return x * (x:pow(2):mean(-1, true) + self.eps):rsqrt()
end

function RMSNormPython:forward(x)
  return self:_norm(x) * self.weight
end

-- ---------------------------------------------------------------- MLPModule
local MLPModule = nn.Module:extend("MLPModule")
M.MLPModule = MLPModule

-- MLPModule([device [, bias = true]]) or MLPModule{bias = true}: seeds the
-- generator with 5 (as the seed does), then net1 = Linear(10, 16), ReLU,
-- net2 = Linear(16, 10).
function MLPModule:__init(device, bias)
  if type(device) == "table" then bias = device.bias end
  if bias == nil then bias = true end
  engine.manual_seed(5)
  self.net1 = nn.Linear(10, 16, { bias = bias })
  self.relu = nn.ReLU()
  self.net2 = nn.Linear(16, 10, { bias = bias })
end

function MLPModule:forward(x)
  return self.net2(self.relu(self.net1(x)))
end

function MLPModule:reset_parameters()
  self.net1:reset_parameters()
  self.net2:reset_parameters()
end

-- ---------------------------------------------------------------- MLPStacked
local MLPStacked = nn.Module:extend("MLPStacked")
M.MLPStacked = MLPStacked

-- MLPStacked([device [, n_layers = 2]]) or MLPStacked{n_layers = 2}
function MLPStacked:__init(device, n_layers)
  if type(device) == "table" then n_layers = device.n_layers end
  n_layers = n_layers or 2
  local list = {}
  for i = 1, n_layers do list[i] = MLPModule() end
  self.layers = nn.ModuleList(list)
end

function MLPStacked:forward(x)
  for _, layer in ipairs(self.layers) do x = layer(x) end
  return x
end

-- ---------------------------------------------------------------- Attention
local Attention = nn.Module:extend("Attention")
M.Attention = Attention

function Attention:__init(args)
  args = args_of(args)
  assert(args.dim % args.n_heads == 0, "Attention: dim must be divisible by n_heads")
  self.head_dim = math.floor(args.dim / args.n_heads)
  self.n_heads = args.n_heads
  self.dropout_p = args.dropout_p
  self.resid_dropout = nn.Dropout(args.dropout_p)
  self.use_attn_mask = args.use_attn_mask
  self.wq = nn.Linear(args.dim, args.dim, { bias = false })
  self.wk = nn.Linear(args.dim, args.dim, { bias = false })
  self.wv = nn.Linear(args.dim, args.dim, { bias = false })
  self.wo = nn.Linear(args.dim, args.dim, { bias = false })
end

-- x [bsz, seq_len, dim] -> [bsz, seq_len, dim]; causal when use_attn_mask.
function Attention:forward(x)
  local s = x:shape()
  local bsz, seq_len = s[1], s[2]
  local queries, keys, values = self.wq(x), self.wk(x), self.wv(x)
  -- n_heads from the weight, not self.n_heads: tensor parallelism shards the heads
  local local_dim = queries:size(-1)
  local n_heads = math.floor(local_dim / self.head_dim)
  queries = queries:view(bsz, seq_len, n_heads, self.head_dim):transpose(2, 3)
  keys = keys:view(bsz, seq_len, n_heads, self.head_dim):transpose(2, 3)
  values = values:view(bsz, seq_len, n_heads, self.head_dim):transpose(2, 3)
  local output = F.scaled_dot_product_attention(queries, keys, values, nil,
    self.training and self.dropout_p or 0, self.use_attn_mask)
  output = output:transpose(2, 3):contiguous():view(bsz, seq_len, -1)
  return self.resid_dropout(self.wo(output))
end

-- ---------------------------------------------------------------- FeedForward
local FeedForward = nn.Module:extend("FeedForward")
M.FeedForward = FeedForward

function FeedForward:__init(dim, hidden_dim, dropout_p)
  self.w1 = nn.Linear(dim, hidden_dim)
  self.gelu = nn.GELU()
  self.w2 = nn.Linear(hidden_dim, dim)
  self.resid_dropout = nn.Dropout(dropout_p)
end

function FeedForward:forward(x)
  return self.resid_dropout(self.w2(self.gelu(self.w1(x))))
end

-- ---------------------------------------------------------------- TransformerBlock
local TransformerBlock = nn.Module:extend("TransformerBlock")
M.TransformerBlock = TransformerBlock

function TransformerBlock:__init(args)
  args = args_of(args)
  self.attention_norm = nn.LayerNorm(args.dim)
  self.attention = Attention(args)
  self.ffn_norm = nn.LayerNorm(args.dim)
  self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.dropout_p)
end

function TransformerBlock:forward(x)
  local h = x + self.attention(self.attention_norm(x))
  return h + self.feed_forward(self.ffn_norm(h))
end

-- ---------------------------------------------------------------- Transformer
local Transformer = nn.Module:extend("Transformer")
M.Transformer = Transformer

-- Transformer(ModelArgs{...}) or Transformer{...} (missing fields take the defaults).
function Transformer:__init(args)
  args = args_of(args)
  self.model_args = args
  self.max_seq_len = args.max_seq_len
  self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
  self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
  self.dropout = nn.Dropout(args.dropout_p)
  self.layers = nn.ModuleList()
  for _ = 1, args.n_layers do self.layers:append(TransformerBlock(args)) end
  self.norm = nn.LayerNorm(args.dim)
  self.output = nn.Linear(args.dim, args.vocab_size, { bias = false })
  if args.weight_tying then
    self.output.weight = self.tok_embeddings.weight
  end
  self.checkpoint_activations = args.checkpoint_activations
end

-- tokens i64 [bsz, seq_len] (0-based ids) -> logits f32 [bsz, seq_len, vocab_size]
function Transformer:forward(tokens)
  if not engine.is_tensor(tokens) then
    error("Transformer: expected a tensor of token ids [batch, seq_len], got " .. type(tokens), 2)
  end
  local s = tokens:shape()
  if #s ~= 2 then
    error(string.format("Transformer: expected token ids of shape [batch, seq_len], got %s[%s]", tokens.dtype,
      table.concat(s, ",")), 2)
  end
  local seq_len = s[2]
  if seq_len > self.max_seq_len then
    error(string.format("Transformer: sequence length %d exceeds max_seq_len %d", seq_len, self.max_seq_len), 2)
  end
  local h = self.tok_embeddings(tokens)
  local p = self.pos_embeddings(engine.arange(0, seq_len, { device = tokens.device }))  -- [seq_len, dim]
  h = h + p
  h = self.dropout(h)
  local ckpt = self.checkpoint_activations
  for _, layer in ipairs(self.layers) do
    if ckpt then h = nn.checkpoint(layer, h) else h = layer(h) end
  end
  h = self.norm(h)
  return self.output(h):float()
end

-- ---------------------------------------------------------------- tensor-parallel plans
-- Transformer.parallelize(model, tp_mesh, {use_seq_parallel = false, local_output_for_attn = false})
-- (or Transformer.parallelize(model, tp_mesh, use_seq_parallel)): the plan of seed 003's test model.
-- Embeddings RowwiseParallel (input Replicate; output Replicate, or Shard(seq) with sequence
-- parallelism: Shard(2) for the [B, T, D] token embeddings, Shard(1) for the [T, D] positions);
-- per block wq/wk/wv ColwiseParallel, wo RowwiseParallel, w1 ColwiseParallel, w2 RowwiseParallel;
-- with sequence parallelism the norms are SequenceParallel, attention gets PrepareModuleInput
-- (Shard(2) -> Replicate), w1 takes Shard(2) input, wo and w2 give Shard(2) output, the final norm is
-- SequenceParallel and the output projection takes Shard(2); the output projection gathers the
-- logits (output Replicate).  local_output_for_attn: wq/wk/wv return local tensors and attention
-- runs on its n_heads / tp local heads.  The tied output weight is the token embedding's DTensor.
-- n_heads must be divisible by the tp size.  Returns the model.
function Transformer.parallelize(model, mesh, opts)
  local dist = require("engine.distributed")
  if type(opts) == "boolean" then opts = { use_seq_parallel = opts } end
  opts = opts or {}
  for k in pairs(opts) do
    if k ~= "use_seq_parallel" and k ~= "local_output_for_attn" then
      error("Transformer.parallelize: unknown option '" .. tostring(k) .. "' (use_seq_parallel, local_output_for_attn)", 2)
    end
  end
  if type(model) ~= "table" or not require("engine.distributed.parallel_style")._has_class(model, "Transformer") then
    error("Transformer.parallelize: requires a Transformer, got " .. tostring(model and model.__name or type(model)), 2)
  end
  if not dist.is_mesh(mesh) then
    error("Transformer.parallelize: expected a 1-D DeviceMesh (e.g. mesh[\"tp\"]), got " .. type(mesh), 2)
  end
  local tp = mesh:size()
  local args = model.model_args
  if args.n_heads % tp ~= 0 then
    error(string.format("Transformer.parallelize: n_heads (%d) must be divisible by the tensor-parallel size (%d)",
      args.n_heads, tp), 2)
  end
  local sp, local_attn = opts.use_seq_parallel == true, opts.local_output_for_attn == true
  local S, R = dist.Shard, dist.Replicate
  local root
  if sp then
    root = {
      tok_embeddings = dist.RowwiseParallel{ input_layouts = R(), output_layouts = S(2) },
      pos_embeddings = dist.RowwiseParallel{ input_layouts = R(), output_layouts = S(1) },
      norm = dist.SequenceParallel(),
    }
  else
    root = {
      tok_embeddings = dist.RowwiseParallel{ input_layouts = R(), output_layouts = R() },
      pos_embeddings = dist.RowwiseParallel{ input_layouts = R(), output_layouts = R() },
    }
  end
  root["layers.*.attention.wq"] = dist.ColwiseParallel{ use_local_output = local_attn }
  root["layers.*.attention.wk"] = dist.ColwiseParallel{ use_local_output = local_attn }
  root["layers.*.attention.wv"] = dist.ColwiseParallel{ use_local_output = local_attn }
  if sp then
    root["layers.*.attention"] = dist.PrepareModuleInput{ input_layouts = S(2), desired_input_layouts = R() }
    root["layers.*.attention_norm"] = dist.SequenceParallel()
    root["layers.*.ffn_norm"] = dist.SequenceParallel()
    root["layers.*.attention.wo"] = dist.RowwiseParallel{ output_layouts = S(2) }
    root["layers.*.feed_forward.w1"] = dist.ColwiseParallel{ input_layouts = S(2) }
    root["layers.*.feed_forward.w2"] = dist.RowwiseParallel{ output_layouts = S(2) }
    root.output = dist.ColwiseParallel{ input_layouts = S(2), output_layouts = R() }
  else
    root["layers.*.attention.wo"] = dist.RowwiseParallel()
    root["layers.*.feed_forward.w1"] = dist.ColwiseParallel()
    root["layers.*.feed_forward.w2"] = dist.RowwiseParallel()
    root.output = dist.ColwiseParallel{ output_layouts = R() }
  end
  dist.parallelize_module(model, mesh, root)
  if local_attn then
    for _, layer in ipairs(model.layers) do layer.attention.n_heads = math.floor(args.n_heads / tp) end
  end
  if args.weight_tying then model.output.weight = model.tok_embeddings.weight end
  return model
end

-- The plans seed 003's tests give its MLPs: MLPModule.tp_plan() = {net1 = Colwise, net2 = Rowwise};
-- MLPStacked.tp_plan(n_layers) the same for layers.<i>.net1/net2 (here as one "layers.*" pattern).
function MLPModule.tp_plan()
  local dist = require("engine.distributed")
  return { net1 = dist.ColwiseParallel(), net2 = dist.RowwiseParallel() }
end
function MLPStacked.tp_plan()
  local dist = require("engine.distributed")
  return { ["layers.*.net1"] = dist.ColwiseParallel(), ["layers.*.net2"] = dist.RowwiseParallel() }
end

return M
