-- engine.models: the test models of PyTorch's DTensor tests (common_dtensor.py),
-- ported with their defaults: ModelArgs, RMSNormPython, MLPModule,
-- MLPStacked, Attention, FeedForward, TransformerBlock, Transformer; and a Llama-style model
-- (torchtitan's Llama: LlamaArgs, Llama, Llama.parallelize).  Also exported as nn.Transformer, nn.Llama etc.
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
  use_attn_mask = true, weight_tying = true, checkpoint_activations = false, gelu = "none",
  attn_bias = false, norm_eps = 1e-5,
}
M.ModelArgs_defaults = defaults
-- attn_bias: wq, wk, wv and wo get biases (GPT-2's c_attn and c_proj); norm_eps: the LayerNorms' eps (GPT-2's
-- layer_norm_epsilon).  With gelu = "tanh" and the defaults otherwise this is GPT-2's architecture
-- (engine.hf loads and saves GPT-2 checkpoints of Hugging Face into it).

local kinds = {
  n_layers = "count", vocab_size = "count", max_seq_len = "count", dim = "count", n_heads = "count",
  dropout_p = "prob", use_attn_mask = "boolean", weight_tying = "boolean", checkpoint_activations = "boolean",
  gelu = "gelu", attn_bias = "boolean", norm_eps = "positive",
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
    elseif kind == "positive" and (type(v) ~= "number" or not (v > 0)) then
      error(string.format("ModelArgs: %s must be a positive number, got %s", k, tostring(v)), 2)
    elseif kind == "boolean" and type(v) ~= "boolean" then
      error(string.format("ModelArgs: %s must be a boolean, got %s", k, tostring(v)), 2)
    elseif kind == "gelu" and v ~= "none" and v ~= "tanh" then
      error(string.format("ModelArgs: gelu must be \"none\" (exact) or \"tanh\" (GPT-2's approximation), got %s",
        tostring(v)), 2)
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

-- ---------------------------------------------------------------- fused QKV projection
-- The attention modules keep wq, wk, wv as three nn.Linear (the parameter and state dict names, the TP plans
-- and hooks see three projections, as before), but their weights are views of ONE tensor [q rows; k rows; v
-- rows] (fuse_linear_weights), so the forward runs one GEMM: engine.cat_adjacent of the three weights is a view
-- of that tensor (no copy), its gradient is cat's (each weight gets its rows of the fused gradient), and the
-- output is split into q, k, v (views; split's backward is one cat).  Loading a state dict copies into the views
-- (the fusion stays); module:to(...) converts each parameter and then calls _refuse, which makes them views of
-- one tensor again.  Under tensor parallelism (each of wq, wk, wv under a ColwiseParallel, and no other hook) each
-- rank runs one GEMM on its shards (project_qkv_tp below; a cat of three Shard(0) DTensors is not the head layout
-- of each rank, so it is done on the local shards).  Other DTensor weights (FSDP's sharded parameters) and
-- projections with other hooks run the three GEMMs as before; plain weights that are not adjacent (e.g. FSDP's
-- unsharded parameters) are concatenated (a copy) for the one GEMM.
-- Biases (attn_bias) are fused the same way and the one GEMM adds them.  module.fuse_qkv = false runs the
-- three GEMMs.

-- fuse_linear_weights(linears): makes the weights of the given nn.Linear modules views of one new tensor (their
-- rows in order), in place: each Parameter keeps its identity, flags and gradient (set_data, as module:to).
-- Returns true when the weights are (now) adjacent; false (nothing changed) for DTensors, meta tensors,
-- differing dtypes/devices/column counts or non-leaf weights.  When every module has a bias (attn_bias), the
-- biases are made views of one tensor too (the same conditions), so the fused GEMM adds one fused bias.
-- fuse_rows(ts [, locals]): locals[i] is the data of ts[i] (a DTensor's local shard; default ts itself)
local function fuse_rows(ts, locals)
  locals = locals or ts
  if engine.tensors_adjacent(locals, 1) then return true end
  for _, t in ipairs(locals) do if not t:is_contiguous() then return false end end
  local fused = engine.no_grad(function() return engine.cat(locals, 1) end)
  local off = 1
  for i, t in ipairs(ts) do
    local rows = locals[i]:size(1)
    local v = fused:narrow(1, off, rows)
    if engine.C.eng_tensor_set_data(t._c, v._c) ~= 0 then error("fuse_linear_weights: " .. require("engine.core").last_error(), 3) end
    off = off + rows
  end
  return true
end

local function fusable(ts, dim)
  for i, t in ipairs(ts) do
    if t._c.dist ~= nil or t._c.grad_fn ~= nil or t.is_meta or t:dim() ~= dim then return false end
    if i > 1 and (t.dtype ~= ts[1].dtype or t.device ~= ts[1].device or (dim == 2 and t:size(2) ~= ts[1]:size(2))) then
      return false
    end
  end
  return #ts >= 2
end

-- the modules' weights, and their biases when every module has one (else nil); nil when one has no weight
local function weights_and_biases(mods)
  local ws, bs = {}, {}
  for i, m in ipairs(mods) do
    local p = rawget(m, "_parameters")
    local w = p and p.weight
    if w == nil then return nil end
    ws[i] = w
    if bs and p.bias ~= nil then bs[i] = p.bias else bs = nil end
  end
  return ws, bs
end

function M.fuse_linear_weights(mods)
  local ws, bs = weights_and_biases(mods)
  if not ws or not fusable(ws, 2) or not fuse_rows(ws) then return false end
  if bs and fusable(bs, 1) then fuse_rows(bs) end
  return true
end

-- fuse_linear_shards(linears): fuse_linear_weights for DTensor weights (tensor parallelism: Transformer.parallelize
-- calls it on wq, wk, wv): each rank's local shards of the weights (and of the biases, when every module has one)
-- are made views of one local tensor, rows in order; the DTensors, their layouts and values are unchanged.  The
-- weights must share one mesh and one layout; returns whether they are (now) adjacent.
local function shard_locals(ts, dim)
  local locals = {}
  for i, t in ipairs(ts) do
    if t._c.dist == nil or t._c.grad_fn ~= nil or t.is_meta then return nil end
    local l = engine.no_grad(function() return t:to_local() end)
    if l:dim() ~= dim then return nil end
    if i > 1 then
      local a, b = t.placements, ts[1].placements
      if t.device_mesh ~= ts[1].device_mesh or #a ~= #b or l.dtype ~= locals[1].dtype or l.device ~= locals[1].device
        or (dim == 2 and l:size(2) ~= locals[1]:size(2)) then return nil end
      for j = 1, #a do if a[j] ~= b[j] then return nil end end
    end
    locals[i] = l
  end
  return #ts >= 2 and locals or nil
end

function M.fuse_linear_shards(mods)
  local ws, bs = weights_and_biases(mods)
  if not ws then return false end
  local wl = shard_locals(ws, 2)
  if not wl or not fuse_rows(ws, wl) then return false end
  local bl = bs and shard_locals(bs, 1)
  if bl then fuse_rows(bs, bl) end
  return true
end

-- A module called as a plain function: no forward hooks (tensor parallelism, FSDP and user hooks
-- install them) and its class's own forward.
local hook_count = engine.C.eng_module_hook_count
local function plain(m, class)
  local cm = rawget(m, "_cmod")
  return m.forward == class.forward and (cm == nil or (hook_count(cm, 0) == 0 and hook_count(cm, 1) == 0))
end

-- The ColwiseParallel record of an nn.Linear whose only hooks are that style's (parallel_style.linear_style_of:
-- {style, mesh, input = the pre-hook's step, output = the forward hook's step}), else nil.
local parallel_style
local function colwise_of(m)
  if rawget(m, "_tp_linear") == nil or m.forward ~= nn.Linear.forward then return nil end
  parallel_style = parallel_style or require("engine.distributed.parallel_style")
  local r = parallel_style.linear_style_of(m)
  if r == nil or r.style.__name ~= "ColwiseParallel" then return nil end
  return r
end

-- Tensor parallelism: wq, wk, wv each under a ColwiseParallel of the same layouts (Transformer.parallelize) run
-- one GEMM too.  Each rank's shards of the three weights are [its q rows; its k rows; its v rows] (views of
-- one tensor: fuse_linear_shards), so its GEMM on the replicated input gives its q, k, v heads side by side, as
-- the three column-parallel GEMMs would: the input laid out once by the style's input step (Replicate; its local
-- gradient is a partial sum, to_local's grad_placements Partial, reduced by the input step's backward as each
-- module's would), the weights' local shards concatenated (a view), one local linear, split, and each piece
-- taken back as its module's Shard(-1) output (from_local) and passed through its style's output step.  The
-- values and gradients are those of the three modules.  Returns nil when the layouts do not allow it (the caller
-- runs the three modules).
local function project_qkv_tp(self, x, wq, wk, wv)
  local rq, rk, rv = colwise_of(wq), colwise_of(wk), colwise_of(wv)
  if not (rq and rk and rv) then return nil end
  local sq, sk, sv = rq.style, rk.style, rv.style
  local mesh = rq.mesh
  if mesh:ndim() ~= 1 or rk.mesh ~= mesh or rv.mesh ~= mesh then return nil end
  for _, st in ipairs({ sk, sv }) do
    if st.input_layouts ~= sq.input_layouts or st.output_layouts ~= sq.output_layouts
      or st.use_local_output ~= sq.use_local_output then return nil end
  end
  local dist = require("engine.distributed")
  local S, R = dist.Shard, dist.Replicate
  local ws, bs = { wq.weight, wk.weight, wv.weight }, { wq.bias, wk.bias, wv.bias }
  local W = mesh:size()
  for i = 1, 3 do
    local w = ws[i]
    if not dist.is_dtensor(w) or #w.placements ~= 1 or w.placements[1] ~= S(1) or w.device_mesh ~= mesh
      or w:size(1) % W ~= 0 then return nil end
    local b = bs[i]
    if b ~= nil and (not dist.is_dtensor(b) or #b.placements ~= 1 or b.placements[1] ~= S(1)) then return nil end
  end
  if (bs[1] == nil) ~= (bs[2] == nil) or (bs[1] == nil) ~= (bs[3] == nil) then return nil end
  local xl, nd
  if W == 1 and not dist.is_dtensor(x) and sq.input_layouts == R() then
    -- one rank: from_local(x, Replicate) then to_local with a Partial gradient is x itself (the Partial -> Replicate
    -- of its backward reduces over one rank)
    xl, nd = x, x:dim()
  else
    local xd = rq.input(x)
    if not dist.is_dtensor(xd) or #xd.placements ~= 1 or xd.placements[1] ~= R() then return nil end
    xl, nd = xd:to_local{ grad_placements = { dist.Partial() } }, xd:dim()
  end
  local wl = { ws[1]:to_local(), ws[2]:to_local(), ws[3]:to_local() }
  local bias = nil
  if bs[1] ~= nil then bias = engine.cat_adjacent({ bs[1]:to_local(), bs[2]:to_local(), bs[3]:to_local() }, 1) end
  local parts = F.linear(xl, engine.cat_adjacent(wl, 1), bias):split({ wl[1]:size(1), wl[2]:size(1), wl[3]:size(1) }, -1)
  local shard = S(nd)
  local out = {}
  for i, r in ipairs({ rq, rk, rv }) do
    local st = r.style
    local layout = st.output_layouts
    if layout.kind == "shard" and layout.dim < 0 then layout = S(nd + 1 + layout.dim) end
    if st.use_local_output and layout == shard then
      out[i] = parts[i]   -- from_local then to_local of the same layout: the piece itself
    else
      out[i] = r.output(dist.DTensor.from_local(parts[i], mesh, { shard }))
    end
  end
  return out[1], out[2], out[3]
end

-- q, k, v = project_qkv(attn, x): one GEMM when the three projections allow it (see above), else three.
-- With biases on all three (attn_bias) the GEMM adds their concatenation (a view when fused, as the weights).
local function project_qkv(self, x)
  local wq, wk, wv = self.wq, self.wk, self.wv
  if self.fuse_qkv ~= false and rawget(wq, "_tp_linear") ~= nil then
    local q, k, v = project_qkv_tp(self, x, wq, wk, wv)
    if q ~= nil then return q, k, v end
  end
  if self.fuse_qkv ~= false and x._c.dist == nil and plain(wq, nn.Linear) and plain(wk, nn.Linear)
    and plain(wv, nn.Linear) then
    local a, b, c = wq.weight, wk.weight, wv.weight
    local ba, bb, bc = wq.bias, wk.bias, wv.bias
    local nb = (ba and 1 or 0) + (bb and 1 or 0) + (bc and 1 or 0)
    if a._c.dist == nil and b._c.dist == nil and c._c.dist == nil and (nb == 0 or (nb == 3
      and ba._c.dist == nil and bb._c.dist == nil and bc._c.dist == nil)) then
      local bias = nb == 3 and engine.cat_adjacent({ ba, bb, bc }, 1) or nil
      local parts = F.linear(x, engine.cat_adjacent({ a, b, c }, 1), bias)
        :split({ a:size(1), b:size(1), c:size(1) }, -1)
      return parts[1], parts[2], parts[3]
    end
  end
  return wq(x), wk(x), wv(x)
end
M._project_qkv = project_qkv

local function refuse_qkv(self)
  local mods = { self.wq, self.wk, self.wv }
  if not M.fuse_linear_weights(mods) and rawget(self, "_fuse_shards") then M.fuse_linear_shards(mods) end
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
  local bias = args.attn_bias
  self.wq = nn.Linear(args.dim, args.dim, { bias = bias })
  self.wk = nn.Linear(args.dim, args.dim, { bias = bias })
  self.wv = nn.Linear(args.dim, args.dim, { bias = bias })
  self.wo = nn.Linear(args.dim, args.dim, { bias = bias })
  self.fuse_qkv = true
  M.fuse_linear_weights({ self.wq, self.wk, self.wv })
end

Attention._refuse = refuse_qkv

-- x [bsz, seq_len, dim] -> [bsz, seq_len, dim]; causal when use_attn_mask.  attention(x, kv): the cached
-- path of generation (Attention:forward_cached).
function Attention:forward(x, kv)
  if kv ~= nil then return self:forward_cached(x, kv) end
  local s = x:shape()
  local bsz, seq_len = s[1], s[2]
  local queries, keys, values = project_qkv(self, x)
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

-- ---------------------------------------------------------------- the KV cache of generation
-- kv = {pos =, max_len =, k =, v =}: one layer's cache (engine.generation makes them).  x holds the new
-- positions pos .. pos + t - 1 (0-based); their keys and values are written into the buffers k, v
-- [B, kv heads, max_len, head_dim] (allocated at the first call, in the keys' dtype and device: under tensor
-- parallelism each rank caches its local heads) and the queries attend to the pos + t cached positions.
-- q [B, t, Hq, hd], k, v [B, t, Hkv, hd] (plain tensors: a rank's local heads), n_rep = Hq / Hkv
-- -> [B, t, Hq * hd].
function M.kv_attention(q, k, v, kv, n_rep)
  local B, t, hd = q:size(1), q:size(2), q:size(4)
  local hkv, pos = k:size(3), kv.pos
  if pos + t > kv.max_len then
    error(string.format("kv_attention: positions %d..%d do not fit the cache of %d positions", pos, pos + t - 1,
      kv.max_len), 2)
  end
  if kv.k == nil then -- kv.dtype: generation's cache_dtype (a bf16 cache halves what a decoding step reads)
    kv.k = engine.zeros(B, hkv, kv.max_len, hd, { dtype = kv.dtype or k.dtype, device = k.device })
    kv.v = engine.zeros(B, hkv, kv.max_len, hd, { dtype = kv.dtype or v.dtype, device = v.device })
  end
  kv.k:narrow(3, pos + 1, t):copy_(k:transpose(2, 3))
  kv.v:narrow(3, pos + 1, t):copy_(v:transpose(2, 3))
  local S = pos + t
  local out
  if pos == 0 then
    -- prefill: the new keys themselves, causal (as the training forward)
    out = F.scaled_dot_product_attention(q:transpose(2, 3), M.repeat_kv(k, n_rep):transpose(2, 3),
      M.repeat_kv(v, n_rep):transpose(2, 3), nil, 0, true)
  elseif t == 1 then
    -- one new token: it attends to every cached position (no mask); with grouped-query attention the
    -- n_rep query heads of a k/v head are the rows of one product with that head's cached keys (no copy of
    -- the cache: head h uses k/v head floor(h / n_rep), as repeat_kv)
    local keys, values = kv.k:narrow(3, 1, S), kv.v:narrow(3, 1, S)   -- [B, Hkv, S, hd] views
    local qh = q:reshape(B, hkv, n_rep, hd)
    if keys.dtype == qh.dtype then
      out = F.scaled_dot_product_attention(qh, keys, values, nil, 0, false)
    elseif keys.device == "cpu" and keys.dtype == "bf16" and qh.dtype == "f32" then
      out = engine._decode_attention(qh, keys, values) -- the bf16 cache read as it is
    else
      out = F.scaled_dot_product_attention(qh, keys:to(qh.dtype), values:to(qh.dtype), nil, 0, false)
    end
    return out:reshape(B, 1, hkv * n_rep * hd)
  else
    -- t new positions after pos cached ones: query i sees keys 0 .. pos + i (a bottom-right causal mask)
    local keys = M.repeat_kv(kv.k:narrow(3, 1, S):to(q.dtype):transpose(2, 3), n_rep):transpose(2, 3)
    local values = M.repeat_kv(kv.v:narrow(3, 1, S):to(q.dtype):transpose(2, 3), n_rep):transpose(2, 3)
    local mask = engine.arange(0, S, { device = q.device }):view(1, S)
      :le(engine.arange(pos, S, { device = q.device }):view(t, 1))
    out = F.scaled_dot_product_attention(q:transpose(2, 3), keys, values, mask, 0, false)
  end
  return out:transpose(2, 3):contiguous():view(B, t, -1)
end

-- attention(x, kv) (generation's cached path; see M.kv_attention): x [B, t, dim] at positions kv.pos ..
-- kv.pos + t - 1 -> [B, t, dim].  The projections are the training forward's (biases included; under tensor
-- parallelism their DTensor outputs are taken as the local heads).
function Attention:forward_cached(x, kv)
  local s = x:shape()
  local B, t, hd = s[1], s[2], self.head_dim
  local q, k, v = project_qkv(self, x)
  if q._c.dist ~= nil then q, k, v = q:to_local(), k:to_local(), v:to_local() end
  local out = M.kv_attention(q:view(B, t, -1, hd), k:view(B, t, -1, hd), v:view(B, t, -1, hd), kv, 1)
  return self.resid_dropout(self.wo(out))
end

-- ---------------------------------------------------------------- FeedForward
local FeedForward = nn.Module:extend("FeedForward")
M.FeedForward = FeedForward

-- FeedForward(dim, hidden_dim, dropout_p [, gelu = "none" | "tanh"]): tanh is GPT-2's GELU (PyTorch's
-- approximate="tanh"; nn.GELU("tanh")).
function FeedForward:__init(dim, hidden_dim, dropout_p, gelu)
  self.w1 = nn.Linear(dim, hidden_dim)
  self.gelu = nn.GELU{ approximate = gelu or "none" }
  self.w2 = nn.Linear(hidden_dim, dim)
  self.resid_dropout = nn.Dropout(dropout_p)
end

function FeedForward:forward(x)
  local w1, gelu = self.w1, self.gelu
  if plain(gelu, nn.GELU) then
    if plain(w1, nn.Linear) then
      -- w1 and its gelu as one op (F.linear_gelu: the same values and gradients)
      return self.resid_dropout(self.w2(F.linear_gelu(x, w1.weight, w1.bias, gelu.approximate)))
    end
    local r = colwise_of(w1)
    if r then
      -- w1 under ColwiseParallel (and no other hook): the same op between the style's input and output steps
      -- (linear_gelu's DTensor rule never gives a Partial output, and the output step only redistributes a
      -- Shard or Replicate and takes the local shard, which commute with the elementwise gelu)
      return self.resid_dropout(self.w2(r.output(F.linear_gelu(r.input(x), w1.weight, w1.bias, gelu.approximate))))
    end
  end
  return self.resid_dropout(self.w2(self.gelu(self.w1(x))))
end

-- ---------------------------------------------------------------- TransformerBlock
local TransformerBlock = nn.Module:extend("TransformerBlock")
M.TransformerBlock = TransformerBlock

function TransformerBlock:__init(args)
  args = args_of(args)
  self.attention_norm = nn.LayerNorm(args.dim, { eps = args.norm_eps })
  self.attention = Attention(args)
  self.ffn_norm = nn.LayerNorm(args.dim, { eps = args.norm_eps })
  self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.dropout_p, args.gelu)
end

-- block(x) or block(x, kv) (generation: the attention's KV cache, see M.kv_attention)
function TransformerBlock:forward(x, kv)
  local a
  if kv == nil then a = self.attention(self.attention_norm(x)) else a = self.attention(self.attention_norm(x), kv) end
  local norm = self.ffn_norm
  if plain(norm, nn.LayerNorm) then
    -- the residual add and ffn_norm as one op (F.add_layer_norm: the same values and gradients)
    local n, h = F.add_layer_norm(x, a, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    return h + self.feed_forward(n)
  end
  local h = x + a
  return h + self.feed_forward(norm(h))
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
  self.norm = nn.LayerNorm(args.dim, { eps = args.norm_eps })
  self.output = nn.Linear(args.dim, args.vocab_size, { bias = false })
  if args.weight_tying then
    self.output.weight = self.tok_embeddings.weight
  end
  self.checkpoint_activations = args.checkpoint_activations
end

-- tokens i64 [bsz, seq_len] (0-based ids) -> logits f32 [bsz, seq_len, vocab_size]
-- model(tokens, targets) (nanoGPT's model(idx, targets)) -> logits in the model's dtype, loss: the mean
-- cross entropy against targets [bsz, seq_len] through the fused classifier (F.fused_classifier: bf16/f16
-- logits are never copied to f32; the loss is f32).
function Transformer:forward(tokens, targets)
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
  local logits = self.output(h)
  if targets ~= nil then return logits, F.fused_classifier(logits, targets) end
  return logits:float()
end

-- model:forward_cached(tokens, cache [, last_only]) (generation, engine.generation): tokens i64 [B, t] at
-- positions cache.pos .. cache.pos + t - 1 (learned position rows pos + 1 ..), the earlier positions' keys and
-- values in cache = {pos =, max_len =, layers = {kv per layer}} -> logits f32 [B, t, vocab_size] ([B, 1,
-- vocab_size]: the last position only, with last_only); cache.pos advances by t.
function Transformer:forward_cached(tokens, cache, last_only)
  local t, pos = tokens:size(2), cache.pos
  if pos + t > self.max_seq_len then
    error(string.format("Transformer: positions %d..%d exceed max_seq_len %d", pos, pos + t - 1, self.max_seq_len), 2)
  end
  local h = self.tok_embeddings(tokens) + self.pos_embeddings(engine.arange(pos, pos + t, { device = tokens.device }))
  h = self.dropout(h)
  for i, layer in ipairs(self.layers) do
    local kv = cache.layers[i]
    kv.pos = pos
    h = layer(h, kv)
  end
  if last_only and t > 1 then h = h:narrow(2, t, 1) end
  local logits = self.output(self.norm(h))
  cache.pos = pos + t
  if logits._c.dist ~= nil then logits = logits:full_tensor() end
  return logits:float()
end

-- ---------------------------------------------------------------- tensor-parallel plans
-- After a plan: each rank's shards of every block's wq, wk, wv side by side (fuse_linear_shards; again after
-- module:to), so the one GEMM of project_qkv_tp reads them without a copy.
local function fuse_qkv_shards(model)
  for _, layer in ipairs(model.layers) do
    local attn = layer.attention
    rawset(attn, "_fuse_shards", true)
    M.fuse_linear_shards({ attn.wq, attn.wk, attn.wv })
  end
end

-- Transformer.parallelize(model, tp_mesh, {use_seq_parallel = false, local_output_for_attn = false})
-- (or Transformer.parallelize(model, tp_mesh, use_seq_parallel)): the plan of common_dtensor.py's test model.
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
  fuse_qkv_shards(model)
  if local_attn then
    for _, layer in ipairs(model.layers) do layer.attention.n_heads = math.floor(args.n_heads / tp) end
  end
  if args.weight_tying then model.output.weight = model.tok_embeddings.weight end
  return model
end

-- ================================================================ Llama
-- A Llama-style decoder as torchtitan writes it (torchtitan/models/llama/model.py): RMSNorm before
-- attention and feed-forward, rotary position embeddings on q and k (interleaved pairs, the
-- view_as_complex convention), grouped-query attention (n_kv_heads k/v heads, each repeated
-- n_heads / n_kv_heads times), SwiGLU feed-forward w2(silu(w1 x) * w3 x), no biases, untied output.
--
--   local model = nn.Llama{dim = 256, n_layers = 4, n_heads = 4, n_kv_heads = 2, vocab_size = 256,
--     max_seq_len = 128}
--   local logits = model(tokens)           -- tokens i64 [B, T] (0-based ids) -> f32 [B, T, vocab_size]
--
-- Parameter names are torchtitan's (tok_embeddings.weight, layers.0.attention.wq.weight, ...,
-- layers.0.feed_forward.w1/w2/w3.weight, layers.0.attention_norm.weight, layers.0.ffn_norm.weight,
-- norm.weight, output.weight).  The rotary tables are non-persistent buffers rope_cos / rope_sin
-- [2 max_seq_len, head_dim / 2] computed in double precision with Lua's math (torchtitan keeps a
-- complex64 freqs_cis computed in float32; the angles agree to ~1e-6 for these lengths).
local llama_defaults = {
  dim = 256, n_layers = 4, n_heads = 4, n_kv_heads = false, vocab_size = 256, multiple_of = 256,
  ffn_dim_multiplier = false, norm_eps = 1e-5, rope_theta = 10000, max_seq_len = 2048, depth_init = true,
  ffn_hidden_dim = false, weight_tying = false,
}
-- ffn_hidden_dim: the SwiGLU hidden size itself (Hugging Face's intermediate_size), instead of the one
-- multiple_of and ffn_dim_multiplier derive; weight_tying: output.weight IS tok_embeddings.weight
-- (tie_word_embeddings).
M.LlamaArgs_defaults = llama_defaults

-- LlamaArgs{...}: torchtitan's ModelArgs (n_kv_heads nil: n_heads; ffn_dim_multiplier nil: none).
function M.LlamaArgs(t)
  if t ~= nil and type(t) ~= "table" then error("LlamaArgs: expected a table of fields, got " .. type(t), 2) end
  local a = {}
  for k, v in pairs(llama_defaults) do a[k] = v end
  for k, v in pairs(t or {}) do
    if llama_defaults[k] == nil then
      local names = {}
      for n in pairs(llama_defaults) do names[#names + 1] = n end
      table.sort(names)
      error(string.format("Llama: unknown field '%s' (fields: %s)", tostring(k), table.concat(names, ", ")), 2)
    end
    a[k] = v
  end
  for _, k in ipairs({ "dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len" }) do
    local v = a[k]
    if type(v) ~= "number" or v % 1 ~= 0 or v < (k == "n_layers" and 0 or 1) then
      error(string.format("Llama: %s must be a positive integer, got %s", k, tostring(v)), 2)
    end
  end
  if not a.n_kv_heads then a.n_kv_heads = a.n_heads end
  local kv = a.n_kv_heads
  if type(kv) ~= "number" or kv % 1 ~= 0 or kv < 1 then
    error(string.format("Llama: n_kv_heads must be a positive integer, got %s", tostring(kv)), 2)
  end
  if a.dim % a.n_heads ~= 0 then
    error(string.format("Llama: dim (%d) must be divisible by n_heads (%d)", a.dim, a.n_heads), 2)
  end
  if a.n_heads % kv ~= 0 then
    error(string.format("Llama: n_heads (%d) must be divisible by n_kv_heads (%d)", a.n_heads, kv), 2)
  end
  if (a.dim / a.n_heads) % 2 ~= 0 then
    error(string.format("Llama: the head dim (dim / n_heads = %d) must be even for rotary embeddings",
      a.dim / a.n_heads), 2)
  end
  for _, k in ipairs({ "norm_eps", "rope_theta" }) do
    if type(a[k]) ~= "number" or not (a[k] > 0) then
      error(string.format("Llama: %s must be a positive number, got %s", k, tostring(a[k])), 2)
    end
  end
  if a.ffn_dim_multiplier and (type(a.ffn_dim_multiplier) ~= "number" or not (a.ffn_dim_multiplier > 0)) then
    error("Llama: ffn_dim_multiplier must be a positive number or nil, got " .. tostring(a.ffn_dim_multiplier), 2)
  end
  if type(a.depth_init) ~= "boolean" then error("Llama: depth_init must be a boolean", 2) end
  if type(a.weight_tying) ~= "boolean" then error("Llama: weight_tying must be a boolean", 2) end
  local fh = a.ffn_hidden_dim
  if fh and (type(fh) ~= "number" or fh % 1 ~= 0 or fh < 1) then
    error("Llama: ffn_hidden_dim must be a positive integer or nil, got " .. tostring(fh), 2)
  end
  return a
end

-- SwiGLU hidden size (torchtitan: int(2 * 4 dim / 3), times ffn_dim_multiplier, rounded up to multiple_of).
function M.llama_ffn_dim(a)
  if a.ffn_hidden_dim then return a.ffn_hidden_dim end
  local hidden = math.floor(2 * (4 * a.dim) / 3)
  if a.ffn_dim_multiplier then hidden = math.floor(a.ffn_dim_multiplier * hidden) end
  return a.multiple_of * math.floor((hidden + a.multiple_of - 1) / a.multiple_of)
end

-- cos and sin of the rotary angles t * theta^(-2i / head_dim), t = 0 .. n-1, i = 0 .. head_dim/2 - 1:
-- two f64 tensors [n, head_dim / 2] (torchtitan's precompute_freqs_cis, as real tables).
function M.rope_tables(head_dim, n, theta)
  local half = head_dim / 2
  local c, s = {}, {}
  for t = 0, n - 1 do
    local rc, rs = {}, {}
    for i = 0, half - 1 do
      local ang = t * (1 / theta ^ ((2 * i) / head_dim))
      rc[i + 1], rs[i + 1] = math.cos(ang), math.sin(ang)
    end
    c[t + 1], s[t + 1] = rc, rs
  end
  return engine.tensor(c, "f64"), engine.tensor(s, "f64")
end

-- The tables of apply_rotary_emb in interleaved form: cos / sin [T, D/2] -> [T, 1, D] with
-- c2[t, 2i] = c2[t, 2i+1] = cos[t, i] and s2[t, 2i] = -sin[t, i], s2[t, 2i+1] = sin[t, i].
function M.rope_interleave(cos, sin)
  local T, h = cos:size(1), cos:size(2)
  local c2 = cos:view(T, h, 1):expand(T, h, 2):reshape(T, 1, 2 * h)
  local s1 = sin:view(T, h, 1)
  local s2 = engine.cat({ s1 * -1, s1 }, 3):reshape(T, 1, 2 * h)
  return c2, s2
end

-- index [1, 0, 3, 2, ...] (0-based) of the last dim: swaps the elements of each pair
local swap_cache = {}
local function pair_swap_index(D, device)
  local key = D .. ":" .. device
  local idx = swap_cache[key]
  if not idx then
    local perm = {}
    for i = 0, D / 2 - 1 do perm[2 * i + 1], perm[2 * i + 2] = 2 * i + 1, 2 * i end
    idx = engine.tensor(perm, { dtype = "i64", device = device })
    swap_cache[key] = idx
  end
  return idx
end

-- x [B, T, H, D] with pairs (x[2i], x[2i+1]) rotated by the angle of (t, i):
-- (x0 cos - x1 sin, x0 sin + x1 cos).  cos / sin are the [T, D/2] tables, or their interleaved [T, 1, D] form
-- (rope_interleave); H may be the local heads of a rank.  With the [T, D/2] tables and a 4-D x it is one fused
-- pass (engine.rotary_emb), a DTensor x included (batch, sequence or head sharded x rotates its shards; plain
-- tables count as replicated under dist.implicit_replication, as DTensor data parallelism and FSDP run the model)
-- and meta x; with the interleaved tables x * c2 + swap_pairs(x) * s2.
function M.apply_rotary_emb(x, cos, sin)
  if cos:dim() == 2 and x:dim() == 4 then return engine.rotary_emb(x, cos, sin) end
  local c2, s2 = cos, sin
  if cos:dim() == 2 then c2, s2 = M.rope_interleave(cos, sin) end
  return x * c2 + x:index_select(4, pair_swap_index(x:size(4), x.device)) * s2
end

-- x [B, T, Hkv, D] -> [B, T, Hkv * n_rep, D], each k/v head repeated n_rep times in place
-- (torchtitan's repeat_kv: unsqueeze, expand, reshape).
function M.repeat_kv(x, n_rep)
  if n_rep == 1 then return x end
  local s = x:shape()
  return x:unsqueeze(4):expand(s[1], s[2], s[3], n_rep, s[4]):reshape(s[1], s[2], s[3] * n_rep, s[4])
end

local LlamaAttention = nn.Module:extend("LlamaAttention")
M.LlamaAttention = LlamaAttention

function LlamaAttention:__init(a)
  self.n_heads, self.n_kv_heads = a.n_heads, a.n_kv_heads
  self.n_rep = a.n_heads / a.n_kv_heads
  self.head_dim = a.dim / a.n_heads
  self.wq = nn.Linear(a.dim, a.n_heads * self.head_dim, { bias = false })
  self.wk = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, { bias = false })
  self.wv = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, { bias = false })
  self.wo = nn.Linear(a.n_heads * self.head_dim, a.dim, { bias = false })
  self.fuse_qkv = true   -- one GEMM for q, k, v (see "fused QKV projection" above)
  M.fuse_linear_weights({ self.wq, self.wk, self.wv })
end

LlamaAttention._refuse = refuse_qkv

-- x [B, T, dim], cos / sin the rotary tables ([T, 1, head_dim] interleaved, or [T, head_dim / 2]) -> [B, T, dim].  The head counts come from the
-- projections' sizes (-1), so under tensor parallelism each rank runs its local q and k/v heads.
-- attention(x, cos, sin, kv): generation's cached path (M.kv_attention; cos / sin the rows of x's positions).
function LlamaAttention:forward(x, cos, sin, kv)
  local s = x:shape()
  local B, T, hd = s[1], s[2], self.head_dim
  local q, k, v = project_qkv(self, x)
  if kv ~= nil then
    if q._c.dist ~= nil then q, k, v = q:to_local(), k:to_local(), v:to_local() end
    local xq, xk = M.apply_rotary_emb(q:view(B, T, -1, hd), cos, sin), M.apply_rotary_emb(k:view(B, T, -1, hd), cos, sin)
    return self.wo(M.kv_attention(xq, xk, v:view(B, T, -1, hd), kv, self.n_rep))
  end
  local xq, xk, xv = q:view(B, T, -1, hd), k:view(B, T, -1, hd), v:view(B, T, -1, hd)
  xq, xk = M.apply_rotary_emb(xq, cos, sin), M.apply_rotary_emb(xk, cos, sin)
  -- grouped-query attention without repeating k and v in memory (enable_gqa; torchtitan's repeat_kv gives the same)
  local out = F.scaled_dot_product_attention(xq:transpose(2, 3), xk:transpose(2, 3), xv:transpose(2, 3),
    { is_causal = true, enable_gqa = true })
  return self.wo(out:transpose(2, 3):contiguous():view(B, T, -1))
end

local LlamaFeedForward = nn.Module:extend("LlamaFeedForward")
M.LlamaFeedForward = LlamaFeedForward

function LlamaFeedForward:__init(dim, hidden_dim)
  self.w1 = nn.Linear(dim, hidden_dim, { bias = false })
  self.w2 = nn.Linear(hidden_dim, dim, { bias = false })
  self.w3 = nn.Linear(dim, hidden_dim, { bias = false })
end

-- silu(w1 x) * w3 x as one op (F.silu_mul: the same values and gradients as the two ops, one pass each way)
function LlamaFeedForward:forward(x)
  return self.w2(F.silu_mul(self.w1(x), self.w3(x)))
end

local LlamaBlock = nn.Module:extend("LlamaBlock")
M.LlamaBlock = LlamaBlock

function LlamaBlock:__init(layer_id, a)
  self.layer_id = layer_id
  self.attention = LlamaAttention(a)
  self.feed_forward = LlamaFeedForward(a.dim, M.llama_ffn_dim(a))
  self.attention_norm = nn.RMSNorm(a.dim, { eps = a.norm_eps })
  self.ffn_norm = nn.RMSNorm(a.dim, { eps = a.norm_eps })
  -- torchtitan: depth_init scales the output projections by the layer's depth
  self.weight_init_std = a.depth_init and 0.02 / math.sqrt(2 * (layer_id + 1)) or 0.02 / math.sqrt(2 * a.n_layers)
end

function LlamaBlock:forward(x, cos, sin, kv)
  local h
  if kv == nil then h = x + self.attention(self.attention_norm(x), cos, sin)
  else h = x + self.attention(self.attention_norm(x), cos, sin, kv) end
  return h + self.feed_forward(self.ffn_norm(h))
end

local Llama = nn.Module:extend("Llama")
M.Llama = Llama

-- Llama{dim, n_layers, n_heads, n_kv_heads, vocab_size, multiple_of, ffn_dim_multiplier, norm_eps,
-- rope_theta, max_seq_len, depth_init, ffn_hidden_dim, weight_tying} (torchtitan's ModelArgs and defaults,
-- vocab_size 256 and dim 256 here; the last two for Hugging Face's Llamas, see engine.hf).  Initialised as torchtitan's init_weights: embeddings N(0, 1); wq/wk/wv/w1 N(0, 0.02);
-- wo/w2/w3 N(0, weight_init_std); norms 1; output N(0, dim^-0.5).  (torchtitan draws the output weight
-- from a normal truncated at 3 std; the others' truncation at +-2 is > 60 std: a plain normal.)
function Llama:__init(args)
  local a = M.LlamaArgs(args)
  self.model_args = a
  self.max_seq_len = a.max_seq_len
  self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
  self.layers = nn.ModuleList()
  for i = 0, a.n_layers - 1 do self.layers:append(LlamaBlock(i, a)) end
  self.norm = nn.RMSNorm(a.dim, { eps = a.norm_eps })
  self.output = nn.Linear(a.dim, a.vocab_size, { bias = false })
  if a.weight_tying then self.output.weight = self.tok_embeddings.weight end
  local c, s = M.rope_tables(a.dim / a.n_heads, 2 * a.max_seq_len, a.rope_theta)
  self:register_buffer("rope_cos", c:float(), false)
  self:register_buffer("rope_sin", s:float(), false)
  self._rope_dtype = "f32"
  self:init_weights()
end

-- After a dtype change (model:double()) the tables are recomputed from the f64 values rather than
-- widened from their f32 rounding.
function Llama:_rope()
  local c, s = self.rope_cos, self.rope_sin
  if c.dtype ~= self._rope_dtype and not c.is_meta then
    local a = self.model_args
    local c64, s64 = M.rope_tables(a.dim / a.n_heads, 2 * a.max_seq_len, a.rope_theta)
    engine.no_grad(function() c:copy_(c64); s:copy_(s64) end)
    self._rope_dtype = c.dtype
  end
  return c, s
end

-- init_weights([{generator = g}]): torchtitan's initialisation (see Llama{...}).
function Llama:init_weights(opts)
  local init = require("engine.nn.initializers")
  local g = type(opts) == "table" and opts.generator or nil
  local a = self.model_args
  init.normal_(self.tok_embeddings.weight, 0, 1, g)
  for _, layer in ipairs(self.layers) do
    local std = layer.weight_init_std
    local at, ff = layer.attention, layer.feed_forward
    for _, lin in ipairs({ at.wq, at.wk, at.wv, ff.w1 }) do init.normal_(lin.weight, 0, 0.02, g) end
    for _, lin in ipairs({ at.wo, ff.w2, ff.w3 }) do init.normal_(lin.weight, 0, std, g) end
    init.ones_(layer.attention_norm.weight)
    init.ones_(layer.ffn_norm.weight)
  end
  init.ones_(self.norm.weight)
  if not a.weight_tying then init.normal_(self.output.weight, 0, a.dim ^ -0.5, g) end
end

-- tokens i64 [B, T] (0-based ids) -> logits f32 [B, T, vocab_size] (opts.float == false keeps the
-- model's dtype, e.g. f64 for gradient checks)
function Llama:forward(tokens, opts)
  if not engine.is_tensor(tokens) then
    error("Llama: expected a tensor of token ids [batch, seq_len], got " .. type(tokens), 2)
  end
  local s = tokens:shape()
  if #s ~= 2 then
    error(string.format("Llama: expected token ids of shape [batch, seq_len], got %s[%s]", tokens.dtype,
      table.concat(s, ",")), 2)
  end
  local T = s[2]
  if T > self.max_seq_len then
    error(string.format("Llama: sequence length %d exceeds max_seq_len %d", T, self.max_seq_len), 2)
  end
  local cos, sin = self:_rope()
  cos, sin = cos:narrow(1, 1, T), sin:narrow(1, 1, T)   -- [T, head_dim / 2]: apply_rotary_emb's fused form
  local h = self.tok_embeddings(tokens)
  for _, layer in ipairs(self.layers) do h = layer(h, cos, sin) end
  local out = self.output(self.norm(h))
  if type(opts) == "table" and opts.float == false then return out end
  return out:float()
end

-- model:forward_cached(tokens, cache [, last_only]): generation's forward, as Transformer:forward_cached (the
-- rotary rows pos + 1 .. pos + t of the tables).
function Llama:forward_cached(tokens, cache, last_only)
  local t, pos = tokens:size(2), cache.pos
  if pos + t > self.max_seq_len then
    error(string.format("Llama: positions %d..%d exceed max_seq_len %d", pos, pos + t - 1, self.max_seq_len), 2)
  end
  local cos, sin = self:_rope()
  cos, sin = cos:narrow(1, pos + 1, t), sin:narrow(1, pos + 1, t)
  local h = self.tok_embeddings(tokens)
  for i, layer in ipairs(self.layers) do
    local kv = cache.layers[i]
    kv.pos = pos
    h = layer(h, cos, sin, kv)
  end
  if last_only and t > 1 then h = h:narrow(2, t, 1) end
  local out = self.output(self.norm(h))
  cache.pos = pos + t
  if out._c.dist ~= nil then out = out:full_tensor() end
  return out:float()
end

-- Llama.parallelize(model, tp_mesh [, {loss_parallel = false, use_seq_parallel = false}]): torchtitan's
-- apply_tp for Llama: tok_embeddings RowwiseParallel (input Replicate, output Replicate); per block
-- wq/wk/wv/w1/w3 ColwiseParallel, wo/w2 RowwiseParallel (local outputs: attention runs on its
-- n_heads / tp local q heads and n_kv_heads / tp local k/v heads, rotary applied per local head); the
-- output projection ColwiseParallel with Replicate output (Shard(-1) with loss_parallel).  The norms
-- stay plain (replicated by the same seed).  use_seq_parallel (torchtitan's sequence parallelism): the
-- token embeddings give Shard(seq) output, the norms (attention_norm, ffn_norm, norm) are
-- SequenceParallel, attention and feed_forward get PrepareModuleInput (Shard(seq) -> Replicate; the
-- rotary tables pass as they are), wo and w2 give Shard(seq) output and the output projection takes
-- Shard(seq) input: between the blocks each rank holds its seq_len / tp positions (seq_len must be
-- divisible by the tp size).  n_heads and n_kv_heads must be divisible by the tp size.
function Llama.parallelize(model, mesh, opts)
  local dist = require("engine.distributed")
  opts = opts or {}
  for k in pairs(opts) do
    if k ~= "loss_parallel" and k ~= "use_seq_parallel" then
      error("Llama.parallelize: unknown option '" .. tostring(k) .. "' (loss_parallel, use_seq_parallel)", 2)
    end
  end
  if type(model) ~= "table" or not require("engine.distributed.parallel_style")._has_class(model, "Llama") then
    error("Llama.parallelize: requires a Llama, got " .. tostring(model and model.__name or type(model)), 2)
  end
  if not dist.is_mesh(mesh) then
    error("Llama.parallelize: expected a 1-D DeviceMesh (e.g. mesh[\"tp\"]), got " .. type(mesh), 2)
  end
  local tp, a = mesh:size(), model.model_args
  for _, k in ipairs({ "n_heads", "n_kv_heads" }) do
    if a[k] % tp ~= 0 then
      error(string.format("Llama.parallelize: %s (%d) must be divisible by the tensor-parallel size (%d)", k, a[k], tp), 2)
    end
  end
  local R, S = dist.Replicate, dist.Shard
  local sp = opts.use_seq_parallel == true
  local seq = sp and S(2) or R()    -- the layout of the activations between the blocks ([B, T, dim])
  local plan = {
    tok_embeddings = dist.RowwiseParallel{ input_layouts = R(), output_layouts = seq },
    output = dist.ColwiseParallel{ input_layouts = seq, output_layouts = opts.loss_parallel and S(-1) or R(),
      use_local_output = not opts.loss_parallel },
    ["layers.*.attention.wq"] = dist.ColwiseParallel(),
    ["layers.*.attention.wk"] = dist.ColwiseParallel(),
    ["layers.*.attention.wv"] = dist.ColwiseParallel(),
    ["layers.*.attention.wo"] = dist.RowwiseParallel{ output_layouts = seq },
    ["layers.*.feed_forward.w1"] = dist.ColwiseParallel(),
    ["layers.*.feed_forward.w2"] = dist.RowwiseParallel{ output_layouts = seq },
    ["layers.*.feed_forward.w3"] = dist.ColwiseParallel(),
  }
  if sp then
    local NONE = dist.NONE
    plan.norm = dist.SequenceParallel()
    plan["layers.*.attention_norm"] = dist.SequenceParallel()
    plan["layers.*.ffn_norm"] = dist.SequenceParallel()
    -- attention(x, cos, sin): x gathered; the rotary tables are plain tensors of the whole sequence
    plan["layers.*.attention"] = dist.PrepareModuleInput{ input_layouts = { S(2), NONE, NONE },
      desired_input_layouts = { R(), NONE, NONE } }
    plan["layers.*.feed_forward"] = dist.PrepareModuleInput{ input_layouts = { S(2) }, desired_input_layouts = { R() } }
  end
  dist.parallelize_module(model, mesh, plan)
  fuse_qkv_shards(model)
  if a.weight_tying then model.output.weight = model.tok_embeddings.weight end
  return model
end

-- models.apply_ac(model, mode) -> the number of blocks marked: activation checkpointing of a Transformer's or
-- a Llama's blocks (model.layers), torchtitan's --activation_checkpoint.mode: "none" (removes the blocks' marks),
-- "full" (every block), or an integer N >= 1 (every Nth block: layers N-1, 2N-1, ... (0-based names), torchtitan's
-- per-layer selective AC).  Through nn.apply_activation_checkpointing: the blocks are marked in place (names,
-- state dicts and checkpoints unchanged); call it before or after parallelize / fully_shard.  Also
-- Transformer.apply_ac and Llama.apply_ac.
function M.apply_ac(model, mode)
  if type(model) ~= "table" or not nn.is_module(model) or not nn.is_module(model.layers) then
    error("apply_ac: expected a model with its blocks in model.layers (Transformer, Llama), got "
      .. tostring(type(model) == "table" and model.__name or type(model)), 2)
  end
  local every
  if mode == "full" then every = 1
  elseif type(mode) == "number" and mode % 1 == 0 and mode >= 1 then every = mode
  elseif mode ~= "none" then
    error("apply_ac: mode must be \"none\", \"full\" or an integer N >= 1 (every Nth block), got " .. tostring(mode), 2)
  end
  local blocks = {}
  for _, b in ipairs(model.layers:children()) do blocks[b] = true end
  local function is_block(m) return blocks[m] == true end
  nn.apply_activation_checkpointing(model, { check_fn = is_block, enabled = false })
  if not every then return 0 end
  return nn.apply_activation_checkpointing(model, { check_fn = is_block, every = every })
end
Transformer.apply_ac = M.apply_ac
Llama.apply_ac = M.apply_ac

-- model:generate(ids, opts): sampling with a KV cache (engine.generation)
local generation = require("engine.generation")
Transformer.generate = generation.generate
Llama.generate = generation.generate

-- The plans PyTorch's DTensor tests give its MLPs: MLPModule.tp_plan() = {net1 = Colwise, net2 = Rowwise};
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
