-- engine.ops.nn: the functional neural-network ops (nn.functional builds on them).
--
--   a:matmul(b) / engine.matmul(a, b)      torch.matmul: dot, mv, mm, batched with broadcast batch dims
--   engine.linear(x, w [, b])              x[..., in] @ w[out, in]^T + b[out]
--   t:softmax(dim) / t:log_softmax(dim)    dims are 1-based (-1 = last); engine.softmax(t, dim) too
--   engine.cross_entropy(logits, target, {ignore_index = -100, reduction = "mean", label_smoothing = 0})
--       logits [N, C], [C] or [N, C, d1, ...] (classes in dim 2, 1-based); target holds 0-BASED
--       class ids (i64/i32), like token ids: they are data, not Lua indices
--   engine.fused_classifier(logits, target, {ignore_index, reduction, label_smoothing})   bf16/f16 logits
--       [N, C] -> f32 loss without f32 logits (llm.c's fused classifier); others: cross_entropy(logits:float())
--   engine.scaled_dot_product_attention(q, k, v, {attn_mask = nil, dropout_p = 0, is_causal = false,
--       scale = 1/sqrt(E)})             q [..., L, E], k [..., S, E], v [..., S, Ev]; bool mask: true = attend
--
-- One table M, one section per op family; each function is also a Tensor
-- method where that reads naturally.
local core = require("engine.core")
local Tensor = require("engine.tensor")
local C = core.C
local wrap, ct, ct_opt = core.wrap, core.ct, core.ct_opt
local methods = Tensor.methods

local M = {}

-- Options table check: unknown keys are errors (catches typos such as
-- {reduce = "sum"}).
local function opts_arg(opts, op, allowed)
  if opts == nil then return {} end
  if type(opts) ~= "table" or core.is_tensor(opts) then
    error(string.format("%s: options must be a table, got %s", op, core.is_tensor(opts) and "a tensor" or type(opts)), 3)
  end
  for k in pairs(opts) do
    if not allowed[k] then
      local names = {}
      for n in pairs(allowed) do names[#names + 1] = n end
      table.sort(names)
      error(string.format("%s: unknown option '%s' (valid: %s)", op, tostring(k), table.concat(names, ", ")), 3)
    end
  end
  return opts
end

local function number_opt(v, default, op, name)
  if v == nil then return default end
  if type(v) ~= "number" then
    error(string.format("%s: option %s must be a number, got %s", op, name, type(v)), 3)
  end
  return v
end

-- ============================================================ matmul / linear
function M.matmul(a, b)
  return wrap(C.eng_matmul(ct(a, "matmul", 1), ct(b, "matmul", 2)))
end
methods.matmul = M.matmul

function M.linear(x, w, b)
  return wrap(C.eng_linear(ct(x, "linear", 1), ct(w, "linear", 2), ct_opt(b, "linear", 3)))
end

-- linear_gelu(x, w [, b [, approximate = "none" | "tanh"]]) = gelu(linear(x, w, b)), fused on the CPU
-- (eng_linear_gelu): the same values and gradients, one pass fewer over the activations each way.
function M.linear_gelu(x, w, b, approximate)
  local a = approximate == nil and "none" or approximate
  if a ~= "none" and a ~= "tanh" then
    error("linear_gelu: approximate must be \"none\" or \"tanh\", got " .. tostring(approximate), 2)
  end
  return wrap(C.eng_linear_gelu(ct(x, "linear_gelu", 1), ct(w, "linear_gelu", 2), ct_opt(b, "linear_gelu", 3),
    a == "tanh" and 1 or 0))
end

-- ============================================================ softmax / log_softmax
local function softmax_fn(name, cfun)
  return function(t, d)
    local c = ct(t, name, 1)
    if d == nil then
      error(name .. ": dim is required (1-based; -1 for the last dim)", 2)
    end
    return wrap(cfun(c, core.dim(d, c.ndim, name, 0, 3)))
  end
end
M.softmax = softmax_fn("softmax", C.eng_softmax)
M.log_softmax = softmax_fn("log_softmax", C.eng_log_softmax)
methods.softmax = M.softmax
methods.log_softmax = M.log_softmax

-- ============================================================ cross_entropy
local reductions = { none = 0, mean = 1, sum = 2 }
local ce_opts = { ignore_index = true, reduction = true, label_smoothing = true }

-- The options of cross_entropy and fused_classifier, then the C op cfn.  Always tail-called: its errors
-- (levels 2 and 3 of the helpers) then point at the caller's line, as from the public function itself.
local function ce_call(op, cfn, logits, target, opts)
  local x, t = ct(logits, op, 1), ct(target, op, 2)
  opts = opts_arg(opts, op, ce_opts)
  local ignore = number_opt(opts.ignore_index, -100, op, "ignore_index")
  if ignore % 1 ~= 0 then error(op .. ": ignore_index must be an integer, got " .. ignore, 2) end
  local red = opts.reduction or "mean"
  local code = reductions[red]
  if code == nil then
    error(string.format("%s: reduction must be \"none\", \"mean\" or \"sum\", got %s", op, tostring(red)), 2)
  end
  local ls = number_opt(opts.label_smoothing, 0, op, "label_smoothing")
  return wrap(cfn(x, t, ignore, code, ls))
end

function M.cross_entropy(logits, target, opts)
  return ce_call("cross_entropy", C.eng_cross_entropy, logits, target, opts)
end

-- fused_classifier(logits, target [, {ignore_index = -100, reduction = "mean", label_smoothing = 0}]):
-- llm.c's fused classifier (eng_fused_classifier): cross entropy of bf16/f16 logits [N, C] without an f32
-- copy of them; the loss is f32, the logits' gradient keeps their dtype.  Other logits and DTensors give
-- cross_entropy(logits:float(), ...).
function M.fused_classifier(logits, target, opts)
  return ce_call("fused_classifier", C.eng_fused_classifier, logits, target, opts)
end

-- ============================================================ scaled_dot_product_attention
local sdpa_opts = { attn_mask = true, dropout_p = true, is_causal = true, scale = true, enable_gqa = true }

-- enable_gqa (PyTorch 2.5's grouped-query attention): q [..., Hq, L, E] against k, v [..., Hkv, S, E] with Hkv
-- dividing Hq, query head h attending with k/v head floor(h / (Hq / Hkv)) (k.repeat_interleave(Hq / Hkv, -3)).  On
-- the CPU without copies: q viewed as [..., Hkv, rep, L, E] against k, v as [..., Hkv, 1, S, E], broadcast over
-- rep (the backward sums each kv head's gradient over its query heads in place, runs of query heads in parallel);
-- the CUDA kernels take equal head counts, so there k and v are expanded to Hq heads first.  The mask (broadcast
-- to [..., Hq, L, S]) follows q.  Returns q, k, v, mask for the call, and the function that gives the output
-- its [..., Hq, L, Ev] shape; nil when the head counts are equal.
local function gqa_operands(q, k, v, mask, op)
  local qs, ks, vs = q:shape(), k:shape(), v:shape()
  local nq, nk, nv = #qs, #ks, #vs
  if nq < 3 or nk < 3 or nv < 3 then
    error(string.format("%s: enable_gqa needs q, k and v with a head dim (the third from last), got q %s, k %s, "
      .. "v %s", op, tostring(q), tostring(k), tostring(v)), 3)
  end
  local hq, hk, hv = qs[nq - 2], ks[nk - 2], vs[nv - 2]
  if hk ~= hv or hk == 0 or hq % hk ~= 0 then
    error(string.format("%s: enable_gqa: k and v need the same number of heads, dividing q's; got %d q heads, %d "
      .. "k heads, %d v heads", op, hq, hk, hv), 3)
  end
  if hq == hk then return nil end
  local rep = hq / hk
  if q.device == "cuda" then
    local function widen(t, s)
      local e, n = {}, #s
      for d = 1, n - 2 do e[d] = s[d] end
      e[n - 1], e[n], e[n + 1] = rep, s[n - 1], s[n]
      local w = {}
      for d = 1, n do w[d] = s[d] end
      w[n - 2] = hq
      return t:unsqueeze(n - 1):expand(e):reshape(w)
    end
    return q, widen(k, ks), widen(v, vs), mask, nil
  end
  local function split_heads(s, n) -- [..., Hq, X, Y] -> [..., Hkv, rep, X, Y]
    local r = {}
    for d = 1, n - 3 do r[d] = s[d] end
    r[n - 2], r[n - 1], r[n], r[n + 1] = hk, rep, s[n - 1], s[n]
    return r
  end
  if mask ~= nil then
    local ms = mask:shape()
    local nm = #ms
    if nm >= 3 and ms[nm - 2] == hq then
      mask = mask:reshape(split_heads(ms, nm))
    elseif nm >= 3 then
      mask = mask:unsqueeze(nm - 1)
    end
  end
  local function back(out)
    local os = out:shape()
    local n = #os
    local o = {}
    for d = 1, n - 4 do o[d] = os[d] end
    o[n - 3], o[n - 2], o[n - 1] = hq, os[n - 1], os[n]
    return out:reshape(o)
  end
  return q:reshape(split_heads(qs, nq)), k:unsqueeze(nk - 1), v:unsqueeze(nv - 1), mask, back
end

function M.scaled_dot_product_attention(q, k, v, opts)
  local op = "scaled_dot_product_attention"
  ct(q, op, 1); ct(k, op, 2); ct(v, op, 3)
  opts = opts_arg(opts, op, sdpa_opts)
  local mask = opts.attn_mask
  if mask ~= nil and not core.is_tensor(mask) then
    error(op .. ": attn_mask must be a tensor (bool: true = attend; float: added), got " .. type(mask), 2)
  end
  local p = number_opt(opts.dropout_p, 0, op, "dropout_p")
  local causal = opts.is_causal
  if causal ~= nil and type(causal) ~= "boolean" then
    error(op .. ": is_causal must be a boolean, got " .. type(causal), 2)
  end
  local scale = opts.scale
  if scale ~= nil then
    scale = number_opt(scale, nil, op, "scale")
    if not (scale > 0) then error(op .. ": scale must be positive, got " .. tostring(scale), 2) end
  end
  local gqa = opts.enable_gqa
  if gqa ~= nil and type(gqa) ~= "boolean" then
    error(op .. ": enable_gqa must be a boolean, got " .. type(gqa), 2)
  end
  local back
  if gqa then
    local q2, k2, v2, m2, b2 = gqa_operands(q, k, v, mask, op)
    if q2 ~= nil then q, k, v, mask, back = q2, k2, v2, m2, b2 end
  end
  local out = wrap(C.eng_scaled_dot_product_attention(q._c, k._c, v._c, mask and mask._c or nil, p,
    causal and 1 or 0, scale or 0))
  if back then return back(out) end
  return out
end

-- _decode_attention(q, k, v [, scale]): generation's attention of f32 queries q [B, H, R, E] (R rows per cached
-- head) over a bf16 KV cache k [B, H, S, E], v [B, H, S, Ev] (views of it), without widening the cache first
-- (eng_decode_attention); CPU, no autograd.  models.kv_attention calls it for cache_dtype = "bf16".
function M._decode_attention(q, k, v, scale)
  local op = "decode_attention"
  return wrap(C.eng_decode_attention(ct(q, op, 1), ct(k, op, 2), ct(v, op, 3), scale or 0))
end


-- ============================================================ (helper C2) dropout, norms, embedding, optimizer kernels
--   engine.dropout(x, p = 0.5, training = true)    inverted dropout; mask from the global counter-based
--       generator (consumes numel offsets); p = 0 or training = false returns x itself
--   engine.layer_norm(x, normalized_shape, weight, bias, eps = 1e-5)   normalized_shape: number or table
--       (the last dims of x); weight/bias optional (nil)
--   engine.rms_norm(x, normalized_shape, weight, eps)   eps nil: machine epsilon of x's dtype (PyTorch)
--   engine.embedding(weight, idx, padding_idx)      weight [num, dim], idx i32/i64 of 0-BASED ids (data,
--       like token ids), any shape -> [..., dim]; padding_idx (0-based, negative counts from num) rows
--       get no gradient
--   engine.adamw_step(params, grads, exp_avgs, exp_avg_sqs, {lr, betas = {b1, b2} or beta1/beta2, eps,
--       weight_decay, step, master_params})       fused torch.optim.AdamW update, in place; master_params
--       (a list, holes allowed): f32 master weights of bf16/f16 params (eng_adamw_step_master)
--   engine.sgd_step(params, grads, momentum_bufs, {lr, momentum, dampening, weight_decay, nesterov,
--       first_step})                              fused torch.optim.SGD update, in place
--   engine.global_norm(tensors, p = 2) -> number  total p-norm (p: number, math.huge or "inf")
--   engine.clip_grad_norm_(params, max_norm, p = 2) -> total norm before clipping (scales the .grad's)
-- Lists are Lua lists; an entry of grads may be nil/false (that parameter is skipped).
local c2_ffi = core.ffi

local function c2_opts(opts, op, allowed)
  if opts == nil then return {} end
  if type(opts) ~= "table" or core.is_tensor(opts) then
    error(string.format("%s: options must be a table, got %s", op, core.is_tensor(opts) and "a tensor" or type(opts)), 3)
  end
  for k in pairs(opts) do
    if not allowed[k] then
      local names = {}
      for n in pairs(allowed) do names[#names + 1] = n end
      table.sort(names)
      error(string.format("%s: unknown option '%s' (valid: %s)", op, tostring(k), table.concat(names, ", ")), 3)
    end
  end
  return opts
end

local function c2_num(v, default, op, name)
  if v == nil then
    if default == nil then error(string.format("%s: option %s is required", op, name), 3) end
    return default
  end
  if type(v) ~= "number" then error(string.format("%s: %s must be a number, got %s", op, name, type(v)), 3) end
  return v
end

function M.dropout(x, p, training)
  local cx = ct(x, "dropout", 1)
  if p == nil then p = 0.5 end
  if type(p) ~= "number" then error("dropout: p must be a number, got " .. type(p), 2) end
  if training == nil then training = true end
  return wrap(C.eng_dropout(cx, p, training and 1 or 0))
end

-- engine.rotary_emb(x, cos, sin): rotary position embedding on interleaved pairs in one pass (torchtitan's
-- apply_rotary_emb fused): x [B, T, H, D], cos / sin [T, D / 2]; out[.., 2i] = x[2i] cos - x[2i+1] sin,
-- out[.., 2i+1] = x[2i] sin + x[2i+1] cos.  Differentiable in x.  DTensors: x sharded on B, T (the tables then
-- row-sharded alike) or H runs on its shards; meta tensors give meta results.
function M.rotary_emb(x, cos, sin)
  return wrap(C.eng_rotary_emb(ct(x, "rotary_emb", 1), ct(cos, "rotary_emb", 2), ct(sin, "rotary_emb", 3)))
end

-- engine.silu_mul(a, b) = silu(a) * b, a SwiGLU feed-forward's product (a = w1(x), b = w3(x)), as one op: a and b
-- of one shape and dtype.  The same values and gradients as the two ops, one pass each way on the CPU (f32, f64).
-- DTensors: a and b sharded alike run on their shards.
function M.silu_mul(a, b)
  return wrap(C.eng_silu_mul(ct(a, "silu_mul", 1), ct(b, "silu_mul", 2)))
end

-- Number of normalized dims, checked against x's trailing dims.
local function c2_norm_dims(op, cx, shape)
  local list = type(shape) == "number" and { shape } or shape
  if type(list) ~= "table" or core.is_tensor(list) or #list == 0 then
    error(op .. ": normalized_shape must be a number or a non-empty table of sizes", 3)
  end
  local n, nd = #list, cx.ndim
  local gshape = cx.dist ~= nil and cx.dist.shape or cx.shape -- DTensor: the global shape
  local ok = n <= nd
  for i = 1, n do
    if type(list[i]) ~= "number" then error(op .. ": normalized_shape entries must be numbers", 3) end
    if ok and list[i] ~= tonumber(gshape[nd - n + i - 1]) then ok = false end
  end
  if not ok then
    local sh = {}
    for i = 0, nd - 1 do sh[#sh + 1] = tostring(tonumber(gshape[i])) end
    error(string.format("%s: normalized_shape {%s} does not match the last dims of input %s[%s]", op,
      table.concat(list, ","), core.dtype_names[cx.dtype], table.concat(sh, ",")), 3)
  end
  return n
end

function M.layer_norm(x, normalized_shape, weight, bias, eps)
  local op = "layer_norm"
  local cx = ct(x, op, 1)
  local n = c2_norm_dims(op, cx, normalized_shape)
  if eps ~= nil and type(eps) ~= "number" then error(op .. ": eps must be a number", 2) end
  return wrap(C.eng_layer_norm(cx, n, ct_opt(weight, op, 3), ct_opt(bias, op, 4), eps or 1e-5))
end

-- add_layer_norm(x, r, normalized_shape, weight, bias [, eps = 1e-5]) -> y, h: h = x + r and
-- y = layer_norm(h) as one op (eng_add_layer_norm: one pass each way on the CPU; the same values and
-- gradients as the add and the norm).
local sum_out = c2_ffi.new("eng_tensor*[1]")
function M.add_layer_norm(x, r, normalized_shape, weight, bias, eps)
  local op = "add_layer_norm"
  local cx, cr = ct(x, op, 1), ct(r, op, 2)
  local n = c2_norm_dims(op, cx, normalized_shape)
  if eps ~= nil and type(eps) ~= "number" then error(op .. ": eps must be a number", 2) end
  sum_out[0] = nil
  local y = C.eng_add_layer_norm(cx, cr, n, ct_opt(weight, op, 4), ct_opt(bias, op, 5), eps or 1e-5, sum_out)
  local h = sum_out[0]
  sum_out[0] = nil
  y = wrap(y)
  return y, wrap(h)
end

local c2_finfo_eps = { [0] = 1.1920928955078125e-07, 2.220446049250313e-16, 0.0078125, 0.0009765625 }

function M.rms_norm(x, normalized_shape, weight, eps)
  local op = "rms_norm"
  local cx = ct(x, op, 1)
  local n = c2_norm_dims(op, cx, normalized_shape)
  if eps ~= nil and type(eps) ~= "number" then error(op .. ": eps must be a number", 2) end
  eps = eps or c2_finfo_eps[cx.dtype] or 1.1920928955078125e-07
  return wrap(C.eng_rms_norm(cx, n, ct_opt(weight, op, 3), eps))
end

function M.embedding(weight, idx, padding_idx)
  local op = "embedding"
  local cw, ci = ct(weight, op, 1), ct(idx, op, 2)
  local pad = -1
  if padding_idx ~= nil then
    if type(padding_idx) ~= "number" or padding_idx % 1 ~= 0 then
      error(op .. ": padding_idx must be an integer (0-based row id), got " .. tostring(padding_idx), 2)
    end
    local num = cw.ndim >= 1 and tonumber(cw.shape[0]) or 0
    pad = padding_idx
    if pad < 0 then
      if pad < -num then
        error(string.format("%s: padding_idx %d out of range for %d embeddings (valid -%d..%d)", op,
          padding_idx, num, num, num - 1), 2)
      end
      pad = num + pad
    end
  end
  return wrap(C.eng_embedding(cw, ci, pad))
end

-- embedding_masked(weight_shard, idx, row_offset): the local op of a row-sharded
-- embedding.  weight_shard holds rows row_offset .. row_offset + rows - 1 (0-based
-- row ids, like idx) of the full table; other indices give zero rows and the
-- backward adds gradient only into owned rows.
function M.embedding_masked(weight, idx, row_offset)
  local op = "embedding_masked"
  local cw, ci = ct(weight, op, 1), ct(idx, op, 2)
  if type(row_offset) ~= "number" or row_offset % 1 ~= 0 then
    error(op .. ": row_offset must be an integer (0-based row id), got " .. tostring(row_offset), 2)
  end
  return wrap(C.eng_embedding_masked(cw, ci, row_offset))
end

-- eng_tensor*[n] from a Lua list of n entries; nil/false entries become NULL
-- when holes are allowed.
local function c2_list(list, n, op, what, holes)
  if type(list) ~= "table" or core.is_tensor(list) then
    error(string.format("%s: %s must be a list of tensors", op, what), 3)
  end
  local arr = c2_ffi.new("eng_tensor*[?]", n > 0 and n or 1)
  for i = 1, n do
    local t = list[i]
    if t then
      if not core.is_tensor(t) then
        error(string.format("%s: %s[%d] must be a tensor, got %s", op, what, i, type(t)), 3)
      end
      arr[i - 1] = t._c
    elseif not holes then
      error(string.format("%s: %s[%d] is missing", op, what, i), 3)
    end
  end
  return arr
end

local adamw_opts = { lr = true, betas = true, beta1 = true, beta2 = true, eps = true, weight_decay = true,
  step = true, master_params = true }

function M.adamw_step(params, grads, exp_avgs, exp_avg_sqs, opts)
  local op = "adamw_step"
  if type(params) ~= "table" then error(op .. ": params must be a list of tensors", 2) end
  local n = #params
  local P = c2_list(params, n, op, "params", false)
  local G = c2_list(grads, n, op, "grads", true)
  local Mm = c2_list(exp_avgs, n, op, "exp_avgs", true)
  local V = c2_list(exp_avg_sqs, n, op, "exp_avg_sqs", true)
  opts = c2_opts(opts, op, adamw_opts)
  local b1, b2 = opts.beta1, opts.beta2
  if opts.betas ~= nil then
    if type(opts.betas) ~= "table" or #opts.betas ~= 2 then error(op .. ": betas must be a table {beta1, beta2}", 2) end
    b1, b2 = opts.betas[1], opts.betas[2]
  end
  local lr = c2_num(opts.lr, 1e-3, op, "lr")
  b1, b2 = c2_num(b1, 0.9, op, "beta1"), c2_num(b2, 0.999, op, "beta2")
  local eps = c2_num(opts.eps, 1e-8, op, "eps")
  local wd = c2_num(opts.weight_decay, 1e-2, op, "weight_decay")
  local step = c2_num(opts.step, nil, op, "step")
  if step % 1 ~= 0 then error(op .. ": step must be an integer, got " .. step, 2) end
  if opts.master_params ~= nil then
    local W = c2_list(opts.master_params, n, op, "master_params", true)
    core.check(C.eng_adamw_step_master(n, P, G, Mm, V, W, lr, b1, b2, eps, wd, step))
  else
    core.check(C.eng_adamw_step(n, P, G, Mm, V, lr, b1, b2, eps, wd, step))
  end
end

local sgd_opts = { lr = true, momentum = true, dampening = true, weight_decay = true, nesterov = true,
  first_step = true }

function M.sgd_step(params, grads, momentum_bufs, opts)
  local op = "sgd_step"
  if type(params) ~= "table" then error(op .. ": params must be a list of tensors", 2) end
  local n = #params
  local P = c2_list(params, n, op, "params", false)
  local G = c2_list(grads, n, op, "grads", true)
  local B = momentum_bufs ~= nil and c2_list(momentum_bufs, n, op, "momentum_bufs", true) or nil
  opts = c2_opts(opts, op, sgd_opts)
  local lr = c2_num(opts.lr, nil, op, "lr")
  local mom = c2_num(opts.momentum, 0, op, "momentum")
  local damp = c2_num(opts.dampening, 0, op, "dampening")
  local wd = c2_num(opts.weight_decay, 0, op, "weight_decay")
  core.check(C.eng_sgd_step(n, P, G, B, lr, mom, damp, wd, opts.nesterov and 1 or 0, opts.first_step and 1 or 0))
end

local function c2_order(p, op)
  if p == nil then return 2 end
  if p == "inf" then return math.huge end
  if p == "-inf" then return -math.huge end
  if type(p) ~= "number" then error(op .. ": norm order p must be a number or \"inf\", got " .. tostring(p), 3) end
  return p
end

local c2_out = c2_ffi.new("double[1]")

function M.global_norm(tensors, p)
  local op = "global_norm"
  if type(tensors) ~= "table" or core.is_tensor(tensors) then error(op .. ": expected a list of tensors", 2) end
  local n = #tensors
  local arr = c2_list(tensors, n, op, "tensors", false)
  core.check(C.eng_global_norm(n, arr, c2_order(p, op), c2_out))
  return c2_out[0]
end

function M.clip_grad_norm_(params, max_norm, p)
  local op = "clip_grad_norm_"
  if type(params) ~= "table" or core.is_tensor(params) then error(op .. ": expected a list of parameters", 2) end
  if type(max_norm) ~= "number" then error(op .. ": max_norm must be a number, got " .. type(max_norm), 2) end
  local n = #params
  local arr = c2_list(params, n, op, "params", false)
  core.check(C.eng_clip_grad_norm_(n, arr, max_norm, c2_order(p, op), c2_out))
  return c2_out[0]
end
-- ============================================================ (end of helper C2's section)

return M
