-- engine.nn.functional (nn.functional, usually `local F = nn.functional`):
-- the stateless functions behind the layers, with PyTorch's argument order.
-- Dims are 1-based (negative from the end); class targets and token ids are
-- 0-based.  Options are tables.
local engine = require("engine")
local random_gen = require("engine.ops.random")._generator

local F = {}

local function need_tensor(x, op, pos)
  if not engine.is_tensor(x) then
    error(string.format("%s: argument %d must be a tensor, got %s", op, pos, type(x)), 3)
  end
end

-- linear(x, weight [, bias]): x [..., in] @ weight[out, in]^T + bias[out]
function F.linear(x, weight, bias)
  return engine.linear(x, weight, bias)
end

-- linear_gelu(x, weight [, bias [, approximate = "none" | "tanh"]]): gelu(linear(x, weight, bias)) as one op
-- (the gelu is the GEMM's epilogue on the CPU; the same values and gradients as the two ops)
function F.linear_gelu(x, weight, bias, approximate)
  if type(approximate) == "table" then approximate = approximate.approximate end
  return engine.linear_gelu(x, weight, bias, approximate)
end

-- silu_mul(a, b): silu(a) * b as one op (SwiGLU's product; the same values and gradients as the two ops)
function F.silu_mul(a, b) return engine.silu_mul(a, b) end

function F.relu(x) need_tensor(x, "relu", 1); return x:relu() end
function F.silu(x) need_tensor(x, "silu", 1); return x:silu() end
function F.tanh(x) need_tensor(x, "tanh", 1); return x:tanh() end
function F.sigmoid(x) need_tensor(x, "sigmoid", 1); return x:sigmoid() end

-- gelu(x [, approximate = "none" | "tanh"]) (or {approximate = ...})
function F.gelu(x, approximate)
  need_tensor(x, "gelu", 1)
  if type(approximate) == "table" then approximate = approximate.approximate end
  return x:gelu(approximate or "none")
end

-- softmax(x, dim) / log_softmax(x, dim): dim is required (1-based, -1 = last).
function F.softmax(x, dim)
  need_tensor(x, "softmax", 1)
  if dim == nil then error("softmax: dim is required (1-based; -1 is the last dim)", 2) end
  return x:softmax(dim)
end

function F.log_softmax(x, dim)
  need_tensor(x, "log_softmax", 1)
  if dim == nil then error("log_softmax: dim is required (1-based; -1 is the last dim)", 2) end
  return x:log_softmax(dim)
end

-- add_layer_norm(x, r, normalized_shape, weight, bias [, eps = 1e-5]) -> y, h: h = x + r and y = layer_norm(h)
-- as one op (a pre-norm block's residual add and its next norm; the same values and gradients as the two ops)
function F.add_layer_norm(x, r, normalized_shape, weight, bias, eps)
  return engine.add_layer_norm(x, r, normalized_shape, weight, bias, eps or 1e-5)
end

-- layer_norm(x, normalized_shape, weight, bias [, eps = 1e-5])
function F.layer_norm(x, normalized_shape, weight, bias, eps)
  return engine.layer_norm(x, normalized_shape, weight, bias, eps or 1e-5)
end

-- rms_norm(x, normalized_shape [, weight [, eps]]); eps nil: the machine
-- epsilon of x's dtype (as PyTorch).
function F.rms_norm(x, normalized_shape, weight, eps)
  return engine.rms_norm(x, normalized_shape, weight, eps)
end

-- embedding(indices, weight [, padding_idx]): PyTorch's argument order.
function F.embedding(indices, weight, padding_idx)
  return engine.embedding(weight, indices, padding_idx)
end

-- dropout(x [, p = 0.5 [, training = true [, g | {generator = g}]]]): the mask drawn from the
-- engine.Generator g (default: the global generator)
function F.dropout(x, p, training, gen)
  if gen == false then gen = nil end   -- PyTorch's positional inplace = false
  gen = random_gen.trailing(gen, "dropout")
  if p == nil then p = 0.5 end
  if training == nil then training = true end
  if type(p) ~= "number" or p < 0 or p > 1 then
    error("dropout: probability p must be between 0 and 1, got " .. tostring(p), 2)
  end
  if not training or p == 0 then
    need_tensor(x, "dropout", 1)
    return x
  end
  return engine.dropout(x, p, training, gen)
end

-- cross_entropy(logits, target [, {ignore_index = -100, reduction = "mean", label_smoothing = 0}])
-- logits [N, C] (or [C], or [N, C, d1, ...]) with 0-based class targets, as in
-- PyTorch.  Also accepted: logits [B, T, C] with targets [B, T] (classes in
-- the last dim, the language-model layout): they are flattened to [B*T, C].
function F.cross_entropy(logits, target, opts)
  need_tensor(logits, "cross_entropy", 1)
  need_tensor(target, "cross_entropy", 2)
  local ls, ts = logits:shape(), target:shape()
  if #ls >= 3 and #ts == #ls - 1 then
    local last_layout = true
    for i = 1, #ts do if ts[i] ~= ls[i] then last_layout = false end end
    local torch_layout = ts[1] == ls[1]
    for i = 2, #ts do if ts[i] ~= ls[i + 1] then torch_layout = false end end
    if last_layout and not torch_layout then
      logits = logits:reshape(-1, ls[#ls])
      target = target:reshape(-1)
    end
  end
  return engine.cross_entropy(logits, target, opts)
end

-- fused_classifier(logits, target [, {ignore_index = -100, reduction = "mean", label_smoothing = 0}]):
-- cross entropy for the last layer of a language model with bf16/f16 logits, in one pass over the logits in
-- their dtype (f32 accumulation), an f32 loss and a gradient in the logits' dtype: the value of
-- cross_entropy(logits:float(), ...) without the f32 logits (llm.c's fused classifier).  Logits [N, C] or
-- [B, T, C] with targets [B, T] (flattened).
function F.fused_classifier(logits, target, opts)
  need_tensor(logits, "fused_classifier", 1)
  need_tensor(target, "fused_classifier", 2)
  local ls, ts = logits:shape(), target:shape()
  if #ls >= 3 and #ts == #ls - 1 then
    logits = logits:reshape(-1, ls[#ls])
    target = target:reshape(-1)
  end
  return engine.fused_classifier(logits, target, opts)
end

-- mse_loss(input, target [, {reduction = "mean" | "sum" | "none"}])
function F.mse_loss(input, target, opts)
  need_tensor(input, "mse_loss", 1)
  need_tensor(target, "mse_loss", 2)
  if type(opts) == "table" then require("engine.core").check_opts(opts, { "reduction" }, "mse_loss") end
  local reduction = type(opts) == "table" and (opts.reduction or "mean") or opts or "mean"
  local d = input - target
  local sq = d * d
  if reduction == "mean" then return sq:mean()
  elseif reduction == "sum" then return sq:sum()
  elseif reduction == "none" then return sq end
  error("mse_loss: reduction must be \"mean\", \"sum\" or \"none\", got " .. tostring(reduction), 2)
end

-- scaled_dot_product_attention(q, k, v [, attn_mask [, dropout_p [, is_causal [, scale [, enable_gqa]]]]])
-- or scaled_dot_product_attention(q, k, v, {attn_mask =, dropout_p =, is_causal =, scale =, enable_gqa =}).
-- enable_gqa (PyTorch 2.5): k and v may have fewer heads than q (dividing them; query head h uses k/v head
-- floor(h / (Hq / Hkv))), without repeating them in memory on the CPU.
function F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
  local opts
  if type(attn_mask) == "table" and not engine.is_tensor(attn_mask) then
    opts = attn_mask
  else
    opts = { attn_mask = attn_mask, dropout_p = dropout_p, is_causal = is_causal, scale = scale,
      enable_gqa = enable_gqa }
  end
  return engine.scaled_dot_product_attention(q, k, v, opts)
end

-- Losses and activations of engine.ops.loss (options tables as there; the
-- activations also take their numbers positionally: F.leaky_relu(x, 0.2)).
for _, name in ipairs({ "nll_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
  "smooth_l1_loss", "huber_loss", "softplus", "leaky_relu", "elu", "hardtanh", "relu6", "glu", "one_hot" }) do
  F[name] = engine[name]
end

return F
