-- engine.generation: autoregressive sampling for the language models (nn.Transformer, nn.Llama), with a
-- KV cache.  Mixed into both classes as model:generate:
--
--   local ids = model:generate({10, 65, 110, 100}, {max_new_tokens = 100, temperature = 0.8, top_k = 40,
--     top_p = 0.95, seed = 1})                       -- a Lua list of 0-based ids -> the list, prompt included
--   local out = model:generate(prompt_bt, {max_new_tokens = 20, temperature = 0})   -- i64 [B, T] -> [B, T + n]
--
-- ids: a Lua list of 0-based token ids, a list of such lists (a batch: equal lengths), or an i64 tensor [T]
-- or [B, T]; the result has the same form and holds the prompt followed by the new tokens.
-- opts (an unknown key is an error):
--   max_new_tokens = 20   tokens to add to each row
--   temperature = 1       logits / temperature before sampling; 0: greedy (argmax, the first one on ties)
--   top_k = nil           keep the tokens whose (scaled) logit is >= the k-th largest (ties at the k-th kept)
--   top_p = 1             nucleus: in decreasing order of probability, keep the tokens whose preceding
--                         probabilities sum to < top_p (at least one); after top_k, as Hugging Face's
--                         TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper
--   seed = nil            draws from engine.Generator():manual_seed(seed): the same seed gives the same tokens
--   generator = nil       an engine.Generator to draw from (advanced); neither: the global generator
--   eos = nil             a token id (or a list of ids): a row stops at it (the eos is kept); once every row
--                         has stopped, generation ends; rows that stopped earlier are padded with their eos
--   kv_cache = true       false: every token recomputes the whole context (the old way; for comparisons).
--                         Unset under sequence parallelism: false (see below)
--   stream = nil          function(id, row) called for each new token as it is chosen (row: 1-based batch row)
--   cache_dtype = nil     the KV cache's dtype: nil, the model's; "bf16" halves what each decoding step reads of
--                         an f32 model's cache (the keys and values rounded to bf16 once, as llama.cpp's f16 cache;
--                         the tokens can then differ from the f32 cache's); on the CPU decoding reads it as it is
--
-- It runs under no_grad with every module in eval mode, and restores each module's training flag after.
--
-- The KV cache: per layer, buffers [B, heads, max_len, head_dim] for the keys and values (max_len =
-- min(max_seq_len, prompt + max_new_tokens); under tensor parallelism each rank caches its local heads).  The
-- prompt runs as one forward (prefill, only the last position's logits computed), then each new token runs
-- alone at its position (the learned position row or rotary row of that position) attending to the cache.
--
-- Beyond max_seq_len: the model always sees the last max_seq_len tokens (as nanoGPT's sampler and the
-- uncached path: the same tokens either way).  The positions of the window then shift by one each token, and
-- every cached key depends on its position, so once the context is longer than max_seq_len each token
-- recomputes the prefill of the window (the cost of the uncached path; the cache is the fast path up to
-- max_seq_len).  A prompt longer than max_seq_len is likewise cut to its last max_seq_len tokens for the
-- model (the result still holds the whole prompt).
--
-- Distributed models: every rank of the mesh of a sharded parameter (tensor parallelism: Transformer.parallelize,
-- Llama.parallelize; FSDP) calls generate with the same ids and options.  The model's plan runs as in training
-- (the cached step goes through the model's own forward hooks, so FSDP unshards the root's parameters); each
-- rank caches its local heads; the chosen tokens are broadcast from the first rank of that mesh each step, so
-- every rank continues with the same tokens (with the same seed they are the single-process ones).  DTensor
-- parameters run under implicit replication (Replicate-only DTensor data parallelism: each rank may generate
-- alone).  Sequence parallelism (use_seq_parallel: detected by the forward hooks of the model's final norm) shards
-- the positions between the blocks, which one new token cannot be: there the context is recomputed per token
-- (kv_cache = false), padded on the right to a multiple of the mesh size (causal: the padding does not change the
-- logits read) within the largest such multiple <= max_seq_len; kv_cache = true is an error.
local engine = require("engine")

local M = {}

local OPTS = { "max_new_tokens", "temperature", "top_k", "top_p", "seed", "generator", "eos", "kv_cache", "stream",
  "cache_dtype" }
local KNOWN = {}
for _, k in ipairs(OPTS) do KNOWN[k] = true end

local function is_int(v) return type(v) == "number" and v % 1 == 0 and v == v end

-- the options, checked; errors at level `lvl` (the caller of generate)
local function check_opts(opts, lvl)
  if opts == nil then opts = {} end
  if type(opts) ~= "table" or engine.is_tensor(opts) then
    error("generate: options must be a table, got " .. (engine.is_tensor(opts) and "a tensor" or type(opts)), lvl)
  end
  for k in pairs(opts) do
    if not KNOWN[k] then
      error(string.format("generate: unknown option '%s' (options: %s)", tostring(k), table.concat(OPTS, ", ")), lvl)
    end
  end
  local o = {}
  o.max_new_tokens = opts.max_new_tokens == nil and 20 or opts.max_new_tokens
  if not is_int(o.max_new_tokens) or o.max_new_tokens < 0 then
    error("generate: max_new_tokens must be a non-negative integer, got " .. tostring(opts.max_new_tokens), lvl)
  end
  o.temperature = opts.temperature == nil and 1 or opts.temperature
  if type(o.temperature) ~= "number" or not (o.temperature >= 0) or o.temperature == math.huge then
    error("generate: temperature must be a finite number >= 0 (0: greedy), got " .. tostring(opts.temperature), lvl)
  end
  if opts.top_k ~= nil and (not is_int(opts.top_k) or opts.top_k < 1) then
    error("generate: top_k must be a positive integer, got " .. tostring(opts.top_k), lvl)
  end
  o.top_k = opts.top_k
  o.top_p = opts.top_p == nil and 1 or opts.top_p
  if type(o.top_p) ~= "number" or not (o.top_p > 0 and o.top_p <= 1) then
    error("generate: top_p must be a number in (0, 1], got " .. tostring(opts.top_p), lvl)
  end
  if opts.seed ~= nil and opts.generator ~= nil then
    error("generate: give either seed or generator, not both", lvl)
  end
  if opts.seed ~= nil then
    if not is_int(opts.seed) or opts.seed < 0 then
      error("generate: seed must be a non-negative integer, got " .. tostring(opts.seed), lvl)
    end
    o.generator = engine.Generator():manual_seed(opts.seed)
  elseif opts.generator ~= nil then
    if not engine.is_generator(opts.generator) then
      error("generate: generator must be an engine.Generator, got " .. type(opts.generator), lvl)
    end
    o.generator = opts.generator
  end
  local eos = opts.eos
  if eos ~= nil then
    if type(eos) ~= "table" then eos = { eos } end
    if #eos == 0 then error("generate: eos must be a token id or a non-empty list of ids", lvl) end
    o.eos = {}
    for _, e in ipairs(eos) do
      if not is_int(e) or e < 0 then error("generate: eos must be a token id (an integer >= 0), got " .. tostring(e), lvl) end
      o.eos[e] = true
    end
    o.eos_first = eos[1]
  end
  if opts.kv_cache ~= nil and type(opts.kv_cache) ~= "boolean" then
    error("generate: kv_cache must be a boolean, got " .. type(opts.kv_cache), lvl)
  end
  o.kv_cache = opts.kv_cache ~= false
  if opts.stream ~= nil and type(opts.stream) ~= "function" then
    error("generate: stream must be a function(id, row), got " .. type(opts.stream), lvl)
  end
  o.stream = opts.stream
  local cd = opts.cache_dtype
  if cd ~= nil and cd ~= "bf16" and cd ~= "f32" and cd ~= "f64" and cd ~= "f16" then
    error("generate: cache_dtype must be nil (the model's), \"bf16\", \"f16\", \"f32\" or \"f64\", got "
      .. tostring(cd), lvl)
  end
  o.cache_dtype = cd
  return o
end

-- ids -> rows (a list of Lua lists of ids) and the form to give back
local function read_ids(ids, vocab, lvl)
  local rows, form = {}, {}
  if engine.is_tensor(ids) then
    if ids._c.dist ~= nil then error("generate: expected plain token ids, got a DTensor", lvl) end
    local s = ids:shape()
    if #s ~= 1 and #s ~= 2 then
      error(string.format("generate: expected token ids [T] or [B, T], got a tensor [%s]", table.concat(s, ",")), lvl)
    end
    if ids.dtype ~= "i64" and ids.dtype ~= "i32" then
      error("generate: expected an integer tensor of token ids (i64), got " .. ids.dtype, lvl)
    end
    form.tensor, form.ndim, form.device, form.dtype = true, #s, ids.device, ids.dtype
    local t = ids:cpu():to("i64")
    if #s == 1 then t = t:view(1, -1) end
    rows = t:totable()
  elseif type(ids) == "table" then
    if type(ids[1]) == "table" then
      form.batch = true
      for i, r in ipairs(ids) do
        if type(r) ~= "table" then error("generate: a batch of ids must be a list of lists, row " .. i .. " is a " .. type(r), lvl) end
        local copy = {}
        for j, v in ipairs(r) do copy[j] = v end
        rows[i] = copy
      end
    else
      local copy = {}
      for j, v in ipairs(ids) do copy[j] = v end
      rows[1] = copy
    end
  else
    error("generate: expected token ids (a Lua list, a list of lists, or an i64 tensor [T] or [B, T]), got " .. type(ids), lvl)
  end
  local T = #rows[1]
  if #rows == 0 or T == 0 then error("generate: the prompt is empty (give at least one token id)", lvl) end
  for i, r in ipairs(rows) do
    if #r ~= T then
      error(string.format("generate: the prompts of a batch must have one length: row 1 has %d ids, row %d has %d",
        T, i, #r), lvl)
    end
    for j, v in ipairs(r) do
      if not is_int(v) or v < 0 or (vocab and v >= vocab) then
        error(string.format("generate: token id %s (row %d, position %d) is not in [0, %s)", tostring(v), i, j,
          tostring(vocab)), lvl)
      end
    end
  end
  return rows, form
end

local function give_back(rows, form)
  if form.tensor then
    local t = engine.tensor(rows, { dtype = form.dtype })
    if form.ndim == 1 then t = t:view(-1) end
    if form.device ~= "cpu" then t = t:to(form.device) end
    return t
  end
  if form.batch then return rows end
  return rows[1]
end

-- How the model is laid out: {device = the parameters' device, dtensor = any DTensor parameter (run under
-- implicit replication: plain token ids meet Replicate parameters), mesh = the mesh of a sharded parameter (tensor
-- parallelism, FSDP: every rank of it runs each forward, and the chosen tokens are broadcast over it), sp = the
-- final norm has forward hooks (sequence parallelism: the positions are sharded between the blocks)}
local function layout_of(model)
  local L = { device = "cpu" }
  local first = true
  for _, p in ipairs(model:parameters()) do
    local d = p._c.dist
    if d ~= nil then
      L.dtensor = true
      if first then L.device = p:to_local().device end
      if L.mesh == nil then
        for _, pl in ipairs(p.placements) do
          if pl:is_shard() then L.mesh = p.device_mesh; break end
        end
      end
    elseif first then
      L.device = p.device
    end
    first = false
  end
  local norm = model.norm
  local cm = type(norm) == "table" and rawget(norm, "_cmod")
  L.sp = cm ~= nil and cm ~= false and (engine.C.eng_module_hook_count(cm, 0) > 0 or engine.C.eng_module_hook_count(cm, 1) > 0)
  return L
end

-- ---------------------------------------------------------------- sampling
local ffi = require("ffi")

-- the index (0-based) of the largest of p[0 .. n-1], the first on ties
local function argmax(p, n)
  local best, bv = 0, p[0]
  for i = 1, n - 1 do
    local x = p[i]
    if x > bv or (bv ~= bv and x == x) then best, bv = i, x end
  end
  return best
end

-- The nucleus of a row's candidates vals[1..m] (decreasing scaled logits): n, the weights w[1..n] (exp(v - max))
-- and their sum.  Hugging Face's TopPLogitsWarper removes a token when the probabilities up to it in increasing
-- order sum to <= 1 - top_p: in decreasing order, i stays while the probabilities before it sum to < top_p
-- (the first always stays).
local function nucleus(vals, m, top_p)
  local mx = vals[1]
  local w, total = {}, 0
  for i = 1, m do
    local e = math.exp(vals[i] - mx)
    w[i] = e
    total = total + e
  end
  local n = m
  if top_p < 1 then
    local before = 0
    for i = 1, m do
      if i > 1 and before >= top_p * total then n = i - 1; break end
      before = before + w[i]
    end
    total = 0
    for i = 1, n do total = total + w[i] end
  end
  return n, w, total
end

-- The candidates of each row of scaled (f32 [B, V] contiguous on the host, p its data) under top_k / top_p, in
-- decreasing order: {vals, ids, n (kept by the nucleus), w, total} per row; nil when neither filters.
-- top_k keeps every token whose scaled logit is >= the k-th largest (Hugging Face's TopKLogitsWarper: ties kept).
local function candidates(scaled, p, B, V, o)
  local k = o.top_k and math.min(o.top_k, V)
  if not (k and k < V) and o.top_p >= 1 then return nil end
  local sorted_v, sorted_i
  if k and k < V then
    local tv = scaled:topk(k, 2)
    local thr = tv:select(2, k):totable()
    local need = k
    for b = 1, B do
      local row, c = p + (b - 1) * V, 0
      for i = 0, V - 1 do if row[i] >= thr[b] then c = c + 1 end end
      need = math.max(need, c)
    end
    local sv, si = scaled:topk(need, 2)
    sorted_v, sorted_i = sv:totable(), si:totable()
    for b = 1, B do
      local vb, ib = sorted_v[b], sorted_i[b]
      local m = #vb
      while m > 1 and vb[m] < thr[b] do vb[m], ib[m] = nil, nil; m = m - 1 end
    end
  else
    local sv, si = scaled:sort(2, true)
    sorted_v, sorted_i = sv:totable(), si:totable()
  end
  local rows = {}
  for b = 1, B do
    local n, w, total = nucleus(sorted_v[b], #sorted_v[b], o.top_p)
    rows[b] = { vals = sorted_v[b], ids = sorted_i[b], n = n, w = w, total = total }
  end
  return rows
end

-- next token ids (a Lua list, one per row) from logits f32 [B, V] (any device); kept_only: the ids each row
-- may draw (sorted) instead of a draw
local function choose(logits, o, dist_mesh, kept_only)
  local B, V = logits:size(1), logits:size(2)
  local l = logits:float():cpu():contiguous()
  local keep = { l }   -- the tensors read through pointers stay referenced until the end
  local nxt = {}
  if o.temperature == 0 then
    local p = ffi.cast("float*", l:data_ptr())
    for b = 1, B do nxt[b] = argmax(p + (b - 1) * V, V) end
    if kept_only then for b = 1, B do nxt[b] = { nxt[b] } end end
  else
    local scaled = o.temperature == 1 and l or (l / o.temperature):contiguous()
    keep[2] = scaled
    local p = ffi.cast("float*", scaled:data_ptr())
    local rows = candidates(scaled, p, B, V, o)
    if kept_only then
      for b = 1, B do
        local ids = {}
        if rows then for i = 1, rows[b].n do ids[i] = rows[b].ids[i] end else for i = 1, V do ids[i] = i - 1 end end
        table.sort(ids)
        nxt[b] = ids
      end
      return nxt
    end
    local u = engine.rand(B, { dtype = "f64", generator = o.generator }):totable()
    for b = 1, B do
      if rows then
        local r = rows[b]
        local x, pick = u[b] * r.total, r.ids[r.n]
        for i = 1, r.n do
          x = x - r.w[i]
          if x < 0 then pick = r.ids[i]; break end
        end
        nxt[b] = pick
      else
        local row = p + (b - 1) * V
        local mx = row[0]
        for i = 1, V - 1 do if row[i] > mx then mx = row[i] end end
        local total = 0
        for i = 0, V - 1 do total = total + math.exp(row[i] - mx) end
        local x, pick = u[b] * total, V - 1
        for i = 0, V - 1 do
          x = x - math.exp(row[i] - mx)
          if x < 0 then pick = i; break end
        end
        nxt[b] = pick
      end
    end
  end
  if dist_mesh ~= nil then
    -- every rank continues with the first rank's tokens (ranks hold the same logits; this makes it certain)
    local dist = engine.distributed
    local t = engine.tensor(nxt, { dtype = "i64" })
    for d = 1, dist_mesh:ndim() do
      dist.broadcast(t, { group = dist_mesh:get_group(d), group_src = 0 })
    end
    nxt = t:totable()
  end
  keep[1] = nil
  return nxt
end

-- generation.sample(logits [, opts]) -> a Lua list of token ids (0-based), one per row of logits [B, V] (or
-- [V]: one id): the sampler of generate on given logits, with its options temperature, top_k, top_p, seed,
-- generator (the others are errors here).
function M.sample(logits, opts)
  if not engine.is_tensor(logits) or (logits:dim() ~= 1 and logits:dim() ~= 2) then
    error("generation.sample: expected logits [B, V] or [V], got " .. (engine.is_tensor(logits)
      and "a tensor of " .. logits:dim() .. " dims" or type(logits)), 2)
  end
  if type(opts) == "table" then
    for _, k in ipairs({ "max_new_tokens", "eos", "kv_cache", "stream", "cache_dtype" }) do
      if opts[k] ~= nil then error("generation.sample: option '" .. k .. "' is generate's, not sample's", 2) end
    end
  end
  local o = check_opts(opts, 3)
  if logits:dim() == 1 then return choose(logits:view(1, -1), o, nil)[1] end
  return choose(logits, o, nil)
end

-- generation.kept(logits [, opts]) -> for each row of logits [B, V] ([V]: one list), the sorted ids the sampler
-- may draw under opts' temperature, top_k and top_p (temperature 0: the argmax alone); draws nothing
function M.kept(logits, opts)
  if not engine.is_tensor(logits) or (logits:dim() ~= 1 and logits:dim() ~= 2) then
    error("generation.kept: expected logits [B, V] or [V], got " .. (engine.is_tensor(logits)
      and "a tensor of " .. logits:dim() .. " dims" or type(logits)), 2)
  end
  local o = check_opts(opts, 3)
  if logits:dim() == 1 then return choose(logits:view(1, -1), o, nil, true)[1] end
  return choose(logits, o, nil, true)
end

-- ---------------------------------------------------------------- the loop
local function last_tokens(rows, n)
  local out = {}
  for b, r in ipairs(rows) do
    local x = {}
    for i = math.max(1, #r - n + 1), #r do x[#x + 1] = r[i] end
    out[b] = x
  end
  return out
end

-- model:forward_cached(tokens, cache, last_only) called through the model's own forward hooks (FSDP unshards
-- the root's parameters in them): the model's forward is that function for the call
local function call_cached(model, tokens, cache, last_only)
  if rawget(model, "_cmod") == nil then return model:forward_cached(tokens, cache, last_only) end
  local prev = rawget(model, "forward")
  rawset(model, "forward", function(self, x) return self:forward_cached(x, cache, last_only) end)
  local ok, r = pcall(model, tokens)
  rawset(model, "forward", prev)
  if not ok then error(r, 0) end
  return r
end

local function run(model, rows, o, L)
  local M_ctx = model.max_seq_len
  local B, T0 = #rows, #rows[1]
  local done, n_done = {}, 0
  local function ids_tensor(list) return engine.tensor(list, { dtype = "i64", device = L.device }) end
  -- sequence parallelism (uncached): the context padded on the right to a multiple of the mesh size (causal:
  -- the padding does not change the logits read), within the largest such multiple <= max_seq_len
  local pad = L.sp and L.mesh and L.mesh:size() or 1
  local window = M_ctx - M_ctx % pad
  local cache
  local function new_cache()
    local cap = math.min(M_ctx, T0 + o.max_new_tokens)
    local layers = {}
    for i = 1, #model.layers do layers[i] = { pos = 0, max_len = cap, dtype = o.cache_dtype } end
    return { pos = 0, max_len = cap, layers = layers }
  end
  -- the logits [B, V] of the next token after rows, from the whole window
  local function prefill()
    if o.kv_cache then
      cache = cache or new_cache()
      cache.pos = 0
      return call_cached(model, ids_tensor(last_tokens(rows, M_ctx)), cache, true):select(2, 1)
    end
    local ctx = last_tokens(rows, window)
    local n = #ctx[1]
    if n % pad ~= 0 then
      for _, r in ipairs(ctx) do for _ = 1, pad - n % pad do r[#r + 1] = 0 end end
    end
    local logits = model(ids_tensor(ctx))
    if logits._c.dist ~= nil then logits = logits:full_tensor() end
    return logits:select(2, n)
  end
  if o.max_new_tokens == 0 then return end
  local logits = prefill()
  for step = 1, o.max_new_tokens do
    local nxt = choose(logits, o, L.mesh)
    for b = 1, B do
      local id = nxt[b]
      if done[b] then id = done[b] end
      rows[b][#rows[b] + 1] = id
      if not done[b] then
        if o.stream then o.stream(id, b) end
        if o.eos and o.eos[id] then done[b] = id; n_done = n_done + 1 end
      end
    end
    if n_done == B or step == o.max_new_tokens then break end
    if o.kv_cache and cache.pos < cache.max_len then
      local col = {}
      for b = 1, B do col[b] = { rows[b][#rows[b]] } end
      logits = call_cached(model, ids_tensor(col), cache):select(2, 1)
    else
      logits = prefill()
    end
  end
end

-- model:generate(ids [, opts]) -> ids with the new tokens (see the header)
function M.generate(model, ids, opts)
  if type(model) ~= "table" or type(model.forward_cached) ~= "function" then
    error("generate: expected a language model (nn.Transformer or nn.Llama) as self (model:generate(ids, opts))", 2)
  end
  local o = check_opts(opts, 3)
  local a = model.model_args
  local rows, form = read_ids(ids, a and a.vocab_size, 3)
  local L = layout_of(model)
  if L.sp then
    if type(opts) == "table" and opts.kv_cache == true then
      error("generate: kv_cache = true needs the positions whole on each rank, and the model's final norm has "
        .. "forward hooks (sequence parallelism shards them); parallelize without use_seq_parallel, or leave "
        .. "kv_cache unset (the context is then recomputed per token)", 3)
    end
    o.kv_cache = false
  end
  local modes = {}
  for i, m in ipairs(model:modules()) do modes[i] = rawget(m, "training") end
  model:eval()
  local prev = engine.set_grad_enabled(false)
  local ok, err
  if L.dtensor then
    ok, err = pcall(engine.distributed.implicit_replication, run, model, rows, o, L)
  else
    ok, err = pcall(run, model, rows, o, L)
  end
  engine.set_grad_enabled(prev)
  for i, m in ipairs(model:modules()) do rawset(m, "training", modes[i]) end
  if not ok then error(err, 0) end
  return give_back(rows, form)
end

return M
