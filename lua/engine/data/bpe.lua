-- engine.data.bpe: GPT-2 style byte-level BPE tokenizers (Hugging Face tokenizer.json, or vocab.json + merges.txt).
--
--   local tok = data.load_tokenizer("data/tokenizers/kjv-bpe-4k")   -- a folder, a tokenizer.json, or "byte"
--   local ids = tok:encode("In the beginning")        -- Lua list of 0-based ids; {tensor = true}: an i64 tensor
--   tok:decode(ids) == "In the beginning"             -- ids: a list or an integer tensor
--   tok.vocab_size, tok.eot (<|endoftext|>'s id or nil), tok.name, tok.special (content -> id)
--
-- Encoding is that of the `tokenizers` package (and GPT-2's encoder.py) for these tokenizers:
-- 1. Added tokens (tokenizer.json's added_tokens, e.g. <|endoftext|>) are found in the text first, leftmost
--    and, at one position, longest first; they become their own ids and the text between them is encoded
--    piece by piece.  (Like the package, and unlike tiktoken's default, special tokens in the text are matched.)
-- 2. Pre-tokenization: GPT-2's regex
--      's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
--    over UTF-8 characters, hand-written below.  The classes \p{L}, \p{N} and \s of every code point come
--    from engine.data.unicode_classes, measured from the package's own regex (Unicode 16 tables), so
--    non-ASCII text splits as the package splits it.  Bytes that are not valid UTF-8 (which a Python str
--    cannot hold) count as one "other" character each; every byte string still encodes and decodes back.
-- 3. Each piece's bytes map to GPT-2's byte symbols (bytes_to_unicode) and are merged by BPE: the adjacent
--    pair with the lowest merge rank first, leftmost first among equals, until no pair has a rank.  Results
--    are cached per piece.
-- encode never adds BOS/EOS (the post-processor of a tokenizer.json is ignored: add_special_tokens=False).
-- decode concatenates the tokens' bytes; special tokens decode to their text (skip_special_tokens=False).
-- Supported tokenizer.json: model.type "BPE" (no dropout, no continuing_subword_prefix / end_of_word_suffix;
-- ignore_merges honoured), normalizer null, pre_tokenizer ByteLevel with use_regex (add_prefix_space
-- honoured; also inside a Sequence of that one ByteLevel), decoder ByteLevel or null.  Others (Llama 3's Split
-- regex, SentencePiece's Metaspace, WordPiece, a normalizer) are an error that names what was found.
-- vocab.json + merges.txt: every vocabulary entry of the form <|...|> is a special token (GPT-2's
-- <|endoftext|> is one), as the package's tokenizer.json form of such a tokenizer has it.
local core = require("engine.core")
local json = require("engine.json")
local uclasses = require("engine.data.unicode_classes")
local ffi, C = core.ffi, core.C

local byte, sub, char, find, concat = string.byte, string.sub, string.char, string.find, table.concat
local floor = math.floor

local M = {}

-- ------------------------------------------------------------------ character classes
local L, N, S, O = 1, 2, 3, 4
local KIND = { L = L, N = N, S = S, O = O }
local starts = uclasses.starts
local nstarts = #starts
local range_class = {}
for i = 1, nstarts do range_class[i] = KIND[uclasses.classes:sub(i, i)] end
assert(starts[1] == 0 and #uclasses.classes == nstarts, "engine.data.unicode_classes: bad table")

local function class_search(cp)
  local lo, hi = 1, nstarts
  while lo < hi do
    local mid = floor((lo + hi + 1) / 2)
    if starts[mid] <= cp then lo = mid else hi = mid - 1 end
  end
  return range_class[lo]
end

local ascii = ffi.new("uint8_t[128]")
for b = 0, 127 do ascii[b] = class_search(b) end
local cp_cache = {}
local function cp_class(cp)
  local c = cp_cache[cp]
  if not c then c = class_search(cp); cp_cache[cp] = c end
  return c
end
M.class_of = function(cp) return ({ "L", "N", "S", "O" })[cp < 128 and ascii[cp] or cp_class(cp)] end

-- Class and byte length of the UTF-8 character at 0-based offset i of p (n bytes); an invalid byte is
-- one "other" character.
local function char_at(p, i, n)
  local b = p[i]
  if b < 0x80 then return ascii[b], 1 end
  local cp, len
  if b >= 0xC2 and b <= 0xDF then cp, len = b - 0xC0, 2
  elseif b >= 0xE0 and b <= 0xEF then cp, len = b - 0xE0, 3
  elseif b >= 0xF0 and b <= 0xF4 then cp, len = b - 0xF0, 4
  else return O, 1 end
  if i + len > n then return O, 1 end
  for k = 1, len - 1 do
    local c = p[i + k]
    if c < 0x80 or c > 0xBF then return O, 1 end
    cp = cp * 64 + (c - 0x80)
  end
  if len == 3 then
    if cp < 0x800 or (cp >= 0xD800 and cp <= 0xDFFF) then return O, 1 end
  elseif len == 4 then
    if cp < 0x10000 or cp > 0x10FFFF then return O, 1 end
  end
  return cp_class(cp), len
end

-- ------------------------------------------------------------------ GPT-2's byte symbols
-- bytes_to_unicode: printable bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves, the other 68 bytes
-- for U+0100.. in byte order.  SYMBOL[b] is the UTF-8 of byte b's symbol; BYTE_OF[symbol] = b.
local function utf8_char(c)
  if c < 0x80 then return char(c) end
  if c < 0x800 then return char(0xC0 + floor(c / 64), 0x80 + c % 64) end
  return char(0xE0 + floor(c / 4096), 0x80 + floor(c / 64) % 64, 0x80 + c % 64)
end
local SYMBOL, BYTE_OF = {}, {}
do
  local extra = 0
  for b = 0, 255 do
    local printable = (b >= 33 and b <= 126) or (b >= 161 and b <= 172) or (b >= 174 and b <= 255)
    local cp = printable and b or 256 + extra
    if not printable then extra = extra + 1 end
    SYMBOL[b] = utf8_char(cp)
    BYTE_OF[SYMBOL[b]] = b
  end
end
M.byte_symbol = function(b) return SYMBOL[b] end

-- The bytes a vocabulary string stands for (characters outside the 256 symbols stand for their own UTF-8).
local function symbols_to_bytes(s)
  if not find(s, "[\128-\255]") then
    -- ASCII symbols: printable ones are themselves; control bytes and space are not symbols
    return s
  end
  local out, k = {}, 0
  for ch in s:gmatch("[%z\1-\127\192-\255][\128-\191]*") do
    k = k + 1
    local b = BYTE_OF[ch]
    out[k] = b and char(b) or ch
  end
  return concat(out)
end

-- ------------------------------------------------------------------ the tokenizer object
local BPETokenizer = {}
BPETokenizer.__index = BPETokenizer
M.BPETokenizer = BPETokenizer

local EOT_NAMES = { "<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>" }
local CACHE_MAX = 262144

-- new{vocab = {symbol string -> id}, merges = {{a, b}, ...} (rank order), added = {{id =, content =,
--   special =, lstrip =, rstrip =, single_word =}, ...}, name =, add_prefix_space =, ignore_merges =}
function M.new(spec, op)
  op = op or "load_tokenizer"
  local self = setmetatable({ name = spec.name, add_prefix_space = spec.add_prefix_space and true or false,
    ignore_merges = spec.ignore_merges and true or false }, BPETokenizer)
  local id_bytes, piece_id, max_id = {}, {}, -1
  for symbols, id in pairs(spec.vocab) do
    if type(id) ~= "number" or id % 1 ~= 0 or id < 0 then
      error(string.format("%s: %s: the vocabulary gives %q the id %s (expected a non-negative integer)", op,
        spec.name, symbols, tostring(id)), 0)
    end
    if id_bytes[id] ~= nil then
      error(string.format("%s: %s: id %d is given to two vocabulary entries", op, spec.name, id), 0)
    end
    local b = symbols_to_bytes(symbols)
    id_bytes[id] = b
    piece_id[b] = id
    if id > max_id then max_id = id end
  end
  local special, added = {}, {}
  for _, a in ipairs(spec.added or {}) do
    local id = a.id
    if type(id) ~= "number" or id % 1 ~= 0 or id < 0 or type(a.content) ~= "string" or a.content == "" then
      error(string.format("%s: %s: bad added token %s (expected an id and a non-empty content)", op, spec.name,
        tostring(a.content)), 0)
    end
    if id_bytes[id] ~= nil and piece_id[id_bytes[id]] == id and id_bytes[id] ~= a.content then
      piece_id[id_bytes[id]] = nil   -- the added token replaces the model's entry for its id
    end
    id_bytes[id] = a.content
    if id > max_id then max_id = id end
    added[#added + 1] = { id = id, content = a.content, lstrip = a.lstrip, rstrip = a.rstrip,
      single_word = a.single_word }
    if a.special ~= false then special[a.content] = id end
  end
  if max_id < 0 then error(op .. ": " .. spec.name .. ": the vocabulary is empty", 0) end
  self.vocab_size = max_id + 1
  self._id_bytes, self._piece_id, self._added, self.special = id_bytes, piece_id, added, special
  self._added_by_id = {}
  for _, a in ipairs(added) do self._added_by_id[a.id] = a end
  -- byte symbols
  local byte_id = {}
  for b = 0, 255 do byte_id[b] = piece_id[char(b)] end
  self._byte_id = byte_id
  -- merges: key left * V + right -> rank, merged id
  local V = self.vocab_size
  local rank, merged = {}, {}
  for r, m in ipairs(spec.merges) do
    local a, b = m[1], m[2]
    local ia, ib, iab = spec.vocab[a], spec.vocab[b], spec.vocab[a .. b]
    if not (ia and ib and iab) then
      local missing = not ia and a or not ib and b or a .. b
      error(string.format("%s: %s: merge %d (%s %s): %q is not in the vocabulary", op, spec.name, r, a, b,
        missing), 0)
    end
    local key = ia * V + ib
    if not rank[key] then rank[key], merged[key] = r, iab end
  end
  self._rank, self._merged, self._V = rank, merged, V
  self._cache, self._cache_n = {}, 0
  for _, name in ipairs(EOT_NAMES) do
    if special[name] then self.eot = special[name]; break end
  end
  if not self.eot then
    for _, name in ipairs(EOT_NAMES) do
      if piece_id[name] then self.eot = piece_id[name]; break end
    end
  end
  return self
end

-- BPE of one piece (a byte string): a number (one id) or a list of ids.
local function bpe_small(self, piece, sym, m)
  local rank, merged, V = self._rank, self._merged, self._V
  while m > 1 do
    local best, bi = math.huge, 0
    for t = 1, m - 1 do
      local r = rank[sym[t] * V + sym[t + 1]]
      if r and r < best then best, bi = r, t end
    end
    if bi == 0 then break end
    sym[bi] = merged[sym[bi] * V + sym[bi + 1]]
    for t = bi + 1, m - 1 do sym[t] = sym[t + 1] end
    sym[m] = nil
    m = m - 1
  end
  return sym, m
end

-- The same for long pieces in O(m log m): symbols in a linked list, candidate pairs in a binary heap
-- ordered by (rank, position); stale entries are skipped when popped.
local function bpe_large(self, piece, sym, m)
  local rank, merged, V = self._rank, self._merged, self._V
  local nxt, prv, alive = {}, {}, {}
  for t = 1, m do nxt[t], prv[t], alive[t] = t + 1, t - 1, true end
  nxt[m] = 0
  local hr, hp, hk, hn = {}, {}, {}, 0   -- heap: rank, left position, pair key
  local function less(i, j) return hr[i] < hr[j] or (hr[i] == hr[j] and hp[i] < hp[j]) end
  local function swap(i, j) hr[i], hr[j] = hr[j], hr[i]; hp[i], hp[j] = hp[j], hp[i]; hk[i], hk[j] = hk[j], hk[i] end
  local function push(pos)
    local q = nxt[pos]
    if q == 0 then return end
    local key = sym[pos] * V + sym[q]
    local r = rank[key]
    if not r then return end
    hn = hn + 1
    hr[hn], hp[hn], hk[hn] = r, pos, key
    local i = hn
    while i > 1 do
      local parent = floor(i / 2)
      if less(i, parent) then swap(i, parent); i = parent else break end
    end
  end
  local function pop()
    local r, p, k = hr[1], hp[1], hk[1]
    hr[1], hp[1], hk[1] = hr[hn], hp[hn], hk[hn]
    hr[hn], hp[hn], hk[hn] = nil, nil, nil
    hn = hn - 1
    local i = 1
    while true do
      local l, rr, s = 2 * i, 2 * i + 1, i
      if l <= hn and less(l, s) then s = l end
      if rr <= hn and less(rr, s) then s = rr end
      if s == i then break end
      swap(i, s)
      i = s
    end
    return r, p, k
  end
  for t = 1, m - 1 do push(t) end
  while hn > 0 do
    local _, pos, key = pop()
    local q = nxt[pos]
    if alive[pos] and q ~= 0 and sym[pos] * V + sym[q] == key then
      sym[pos] = merged[key]
      alive[q] = false
      nxt[pos] = nxt[q]
      if nxt[q] ~= 0 then prv[nxt[q]] = pos end
      if prv[pos] ~= 0 then push(prv[pos]) end
      push(pos)
    end
  end
  local out, k, t = {}, 0, 1
  while t ~= 0 do k = k + 1; out[k] = sym[t]; t = nxt[t] end
  return out, k
end

function BPETokenizer:_bpe(piece)
  local n = #piece
  if self.ignore_merges then
    local whole = self._piece_id[piece]
    if whole then return whole end
  end
  local byte_id = self._byte_id
  local sym = {}
  for t = 1, n do
    local id = byte_id[byte(piece, t)]
    if not id then
      error(string.format("encode: %s: byte %d has no token in the vocabulary (not a byte-level vocabulary?)",
        self.name, byte(piece, t)), 0)
    end
    sym[t] = id
  end
  local out, m
  if n <= 48 then out, m = bpe_small(self, piece, sym, n) else out, m = bpe_large(self, piece, sym, n) end
  if m == 1 then return out[1] end
  return out
end

-- Encodes bytes [i, n) of s (p = its bytes), appending ids to out from index k + 1; returns the new k.
local function encode_text(self, s, p, i, n, out, k)
  local cache = self._cache
  while i < n do
    local b = p[i]
    local j
    if b == 39 and i + 1 < n then   -- 's 't 're 've 'm 'll 'd
      local b1 = p[i + 1]
      if b1 == 115 or b1 == 116 or b1 == 109 or b1 == 100 then j = i + 2
      elseif i + 2 < n then
        local b2 = p[i + 2]
        if (b2 == 101 and (b1 == 114 or b1 == 118)) or (b1 == 108 and b2 == 108) then j = i + 3 end
      end
    end
    if not j then
      local c, len = char_at(p, i, n)
      local run = i
      if b == 32 and i + 1 < n then      -- " ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+"
        local c2, len2 = char_at(p, i + 1, n)
        if c2 ~= S then c, len, run = c2, len2, i + 1 end
      end
      j = run + len
      if c ~= S then
        while j < n do
          local c3, l3 = char_at(p, j, n)
          if c3 ~= c then break end
          j = j + l3
        end
      else                               -- "\s+(?!\S)", then "\s+"
        local last = i
        while j < n do
          local c3, l3 = char_at(p, j, n)
          if c3 ~= S then break end
          last = j
          j = j + l3
        end
        if j < n and last > i then j = last end
      end
    end
    local piece = sub(s, i + 1, j)
    local ids = cache[piece]
    if not ids then
      ids = self:_bpe(piece)
      if self._cache_n >= CACHE_MAX then self._cache, self._cache_n, cache = {}, 0, {} end
      cache = self._cache
      cache[piece] = ids
      self._cache_n = self._cache_n + 1
    end
    if type(ids) == "number" then
      k = k + 1
      out[k] = ids
    else
      for t = 1, #ids do out[k + t] = ids[t] end
      k = k + #ids
    end
    i = j
  end
  return k
end

local function is_space(b) return b == 32 or (b >= 9 and b <= 13) end
local function is_word(b) return b >= 128 or (b >= 48 and b <= 57) or (b >= 65 and b <= 90) or (b >= 97 and b <= 122) or b == 95 end

-- The next added-token match at or after 0-based offset pos: start, end (exclusive, with lstrip/rstrip
-- whitespace), id; nil when none.
local function next_added(self, s, n, pos, state)
  local best_s, best_e, best_id, best_len
  for idx, a in ipairs(self._added) do
    local at = state[idx]
    if at ~= false and (at == nil or at < pos) then
      local from, len = pos, #a.content
      at = false
      while true do
        local f = find(s, a.content, from + 1, true)
        if not f then break end
        local st, e = f - 1, f - 1 + len
        if a.single_word and ((st > 0 and is_word(byte(s, st)) and is_word(byte(s, st + 1))) or
            (e < n and is_word(byte(s, e + 1)) and is_word(byte(s, e)))) then
          from = st + 1   -- inside a word: look further
        else
          at = st
          break
        end
      end
      state[idx] = at
    end
    if at and (not best_s or at < best_s or (at == best_s and #a.content > best_len)) then
      best_s, best_len, best_id, best_e = at, #a.content, a.id, at + #a.content
    end
  end
  if best_s then
    local a = self._added_by_id[best_id]
    if a.lstrip then while best_s > pos and is_space(byte(s, best_s)) do best_s = best_s - 1 end end
    if a.rstrip then while best_e < n and is_space(byte(s, best_e + 1)) do best_e = best_e + 1 end end
  end
  return best_s, best_e, best_id
end

local function check_encode_opts(opts)
  if opts == nil then return false end
  if type(opts) ~= "table" then error("encode: options must be a table, got " .. type(opts), 3) end
  for k in pairs(opts) do
    if k ~= "tensor" then error("encode: unknown option '" .. tostring(k) .. "' (known: tensor)", 3) end
  end
  return opts.tensor
end
M.check_encode_opts = check_encode_opts

local function to_tensor(out, k)
  local shape = ffi.new("int64_t[1]", k)
  local t = core.wrap(C.eng_tensor_empty(1, shape, 5, 0))
  local p = ffi.cast("int64_t*", C.eng_tensor_data(t._c))
  for i = 0, k - 1 do p[i] = out[i + 1] end
  return t
end
M.to_tensor = to_tensor

-- encode(s [, {tensor = false}]) -> list of 0-based ids, or an i64 tensor [n]
function BPETokenizer:encode(s, opts)
  if type(s) ~= "string" then error("encode: expected a string, got " .. type(s), 2) end
  local as_tensor = check_encode_opts(opts)
  local out, k = {}, 0
  local n = #s
  local function text(i, j)   -- bytes [i, j)
    if i >= j then return end
    if self.add_prefix_space and byte(s, i + 1) ~= 32 then
      local t = " " .. sub(s, i + 1, j)
      k = encode_text(self, t, ffi.cast("const uint8_t*", t), 0, #t, out, k)
    else
      k = encode_text(self, s, ffi.cast("const uint8_t*", s), i, j, out, k)
    end
  end
  local ok, e = pcall(function()
    if #self._added == 0 then
      text(0, n)
    else
      local pos, state = 0, {}
      while pos < n do
        local ms, me, id = next_added(self, s, n, pos, state)
        if not ms then text(pos, n); break end
        text(pos, ms)
        k = k + 1
        out[k] = id
        pos = me
      end
    end
  end)
  if not ok then error(e, 2) end
  if as_tensor then return to_tensor(out, k) end
  return out
end

-- Reads ids from a list or an integer tensor: returns count, getter(i) (1-based).
local function id_source(tokens, op)
  if core.is_tensor(tokens) then
    local n = tokens:numel()
    local buf = ffi.new("int64_t[?]", n > 0 and n or 1)
    core.check(C.eng_tensor_read(tokens._c, buf, 5, n), 3)
    return n, function(i) return tonumber(buf[i - 1]) end
  elseif type(tokens) == "table" then
    return #tokens, function(i) return tokens[i] end
  end
  error(op .. ": expected a list of token ids or a tensor, got " .. type(tokens), 3)
end
M.id_source = id_source

-- decode(ids) -> string: ids is a list or an integer tensor (any shape, row-major).
function BPETokenizer:decode(tokens)
  local n, get = id_source(tokens, "decode")
  local id_bytes, V = self._id_bytes, self.vocab_size
  local parts = {}
  for i = 1, n do
    local v = get(i)
    local b = type(v) == "number" and id_bytes[v]
    if not b then
      if type(v) == "number" and v % 1 == 0 and v >= 0 and v < V then
        error(string.format("decode: token %d at position %d has no entry in %s's vocabulary", v, i, self.name), 2)
      end
      error(string.format("decode: token %s at position %d is out of range [0, %d) of %s", tostring(v), i, V,
        self.name), 2)
    end
    parts[i] = b
  end
  return concat(parts)
end

-- token(id) -> the bytes of one id (nil when it has none)
function BPETokenizer:token(id) return self._id_bytes[id] end

function BPETokenizer:__tostring()
  return string.format("BPETokenizer(%s, vocab %d%s)", self.name, self.vocab_size,
    self.eot and ", eot " .. self.eot or "")
end

-- ------------------------------------------------------------------ loading
local function read_file(path, op)
  local f, err = io.open(path, "rb")
  if not f then error(op .. ": cannot open " .. path .. ": " .. tostring(err), 0) end
  local s, rerr = f:read("*a")
  f:close()
  if not s then error(op .. ": cannot read " .. path .. ": " .. tostring(rerr), 0) end
  return s
end

-- "file", "dir" or nil
local function kind_of(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local ok, _, code = f:read(0)
  f:close()
  if ok == nil and code == 21 then return "dir" end   -- EISDIR
  return "file"
end

local function decode_json(s, path, op)
  local ok, v = pcall(json.decode, s)
  if not ok then error(op .. ": " .. path .. ": " .. tostring(v), 0) end
  return v
end

local function typename(x)
  if x == nil or x == json.null then return "null" end
  if type(x) == "table" then return tostring(x.type) end
  return tostring(x)
end

-- tokenizer.json -> spec for M.new
local function from_tokenizer_json(path, op)
  local j = decode_json(read_file(path, op), path, op)
  if type(j) ~= "table" or type(j.model) ~= "table" then
    error(op .. ": " .. path .. ": not a Hugging Face tokenizer.json (no \"model\" object)", 0)
  end
  local m = j.model
  local mtype = m.type
  if mtype == nil and m.merges ~= nil then mtype = "BPE" end
  if mtype ~= "BPE" then
    error(string.format("%s: %s: model type %s is not supported (only BPE)", op, path, tostring(mtype)), 0)
  end
  local function unsupported(what, only)
    error(op .. ": " .. path .. ": " .. what .. " is not supported" .. (only and " (only " .. only .. ")" or ""), 0)
  end
  if m.dropout ~= nil and m.dropout ~= json.null and m.dropout ~= 0 then unsupported("BPE dropout") end
  for _, k in ipairs({ "continuing_subword_prefix", "end_of_word_suffix" }) do
    if m[k] ~= nil and m[k] ~= json.null and m[k] ~= "" then unsupported("BPE " .. k .. " " .. tostring(m[k])) end
  end
  if j.normalizer ~= nil and j.normalizer ~= json.null then
    unsupported("normalizer " .. typename(j.normalizer), "null")
  end
  local pre = j.pre_tokenizer
  if type(pre) == "table" and pre.type == "Sequence" and type(pre.pretokenizers) == "table"
      and #pre.pretokenizers == 1 then
    pre = pre.pretokenizers[1]
  end
  if type(pre) ~= "table" or pre.type ~= "ByteLevel" or pre.use_regex == false then
    local desc = typename(pre)
    if type(pre) == "table" and pre.type == "Sequence" and type(pre.pretokenizers) == "table" then
      local parts = {}
      for i, x in ipairs(pre.pretokenizers) do parts[i] = typename(x) end
      desc = "Sequence(" .. concat(parts, ", ") .. ")"
    elseif type(pre) == "table" and pre.type == "ByteLevel" then
      desc = "ByteLevel without GPT-2's regex (use_regex false)"
    end
    unsupported("pre_tokenizer " .. desc, "GPT-2's ByteLevel with its regex")
  end
  local dec = j.decoder
  if dec ~= nil and dec ~= json.null and (type(dec) ~= "table" or dec.type ~= "ByteLevel") then
    unsupported("decoder " .. typename(dec), "ByteLevel")
  end
  if type(m.vocab) ~= "table" then error(op .. ": " .. path .. ": model.vocab is missing", 0) end
  local merges = {}
  for i, x in ipairs(m.merges or {}) do
    local a, b
    if type(x) == "string" then a, b = x:match("^([^ ]+) ([^ ]+)$")
    elseif type(x) == "table" and type(x[1]) == "string" and type(x[2]) == "string" and x[3] == nil then a, b = x[1], x[2] end
    if not a then
      error(string.format("%s: %s: bad merge %d: %s (expected \"left right\" or [left, right])", op, path, i,
        type(x) == "table" and json.encode(x) or tostring(x)), 0)
    end
    merges[i] = { a, b }
  end
  local added = {}
  for i, a in ipairs(type(j.added_tokens) == "table" and j.added_tokens or {}) do
    added[i] = { id = a.id, content = a.content, special = a.special == true, lstrip = a.lstrip == true,
      rstrip = a.rstrip == true, single_word = a.single_word == true }
  end
  return { name = path, vocab = m.vocab, merges = merges, added = added,
    add_prefix_space = pre.add_prefix_space == true, ignore_merges = m.ignore_merges == true }
end

-- vocab.json + merges.txt -> spec for M.new
local function from_vocab_merges(vocab_path, merges_path, op, name)
  local vocab = decode_json(read_file(vocab_path, op), vocab_path, op)
  if type(vocab) ~= "table" or json.is_array(vocab) or (next(vocab) ~= nil and #vocab > 0) then
    error(op .. ": " .. vocab_path .. ": expected a JSON object of token -> id", 0)
  end
  local merges, ln = {}, 0
  local text = read_file(merges_path, op)
  for line in (text .. "\n"):gmatch("([^\n]*)\n") do
    ln = ln + 1
    line = line:gsub("\r$", "")
    if not (ln == 1 and line:match("^#version")) and line ~= "" then
      local a, b = line:match("^([^ ]+) ([^ ]+)$")
      if not a then
        error(string.format("%s: %s: bad merges line %d: %q (expected two tokens separated by one space)", op,
          merges_path, ln, line), 0)
      end
      merges[#merges + 1] = { a, b }
    end
  end
  local added = {}
  for tok, id in pairs(vocab) do
    if type(tok) == "string" and tok:match("^<|.*|>$") then
      added[#added + 1] = { id = id, content = tok, special = true }
    end
  end
  table.sort(added, function(x, y) return x.id < y.id end)
  return { name = name, vocab = vocab, merges = merges, added = added }
end

-- load(spec [, merges_path]) -> BPETokenizer: spec is a tokenizer.json, a folder holding tokenizer.json or
-- vocab.json + merges.txt, or a vocab.json whose merges.txt is merges_path (or next to it).
function M.load(spec, merges_path, op)
  op = op or "load_tokenizer"
  if merges_path ~= nil then
    if type(merges_path) ~= "string" then error(op .. ": the merges path must be a string", 0) end
    for _, p in ipairs({ spec, merges_path }) do
      if kind_of(p) ~= "file" then error(op .. ": " .. p .. ": no such file", 0) end
    end
    return M.new(from_vocab_merges(spec, merges_path, op, spec), op)
  end
  local kind = kind_of(spec)
  if kind == "dir" then
    local dir = spec:gsub("/+$", "")
    if kind_of(dir .. "/tokenizer.json") == "file" then
      local t = M.new(from_tokenizer_json(dir .. "/tokenizer.json", op), op)
      t.name = spec
      return t
    end
    if kind_of(dir .. "/vocab.json") == "file" and kind_of(dir .. "/merges.txt") == "file" then
      return M.new(from_vocab_merges(dir .. "/vocab.json", dir .. "/merges.txt", op, spec), op)
    end
    error(op .. ": " .. spec .. ": the folder has neither tokenizer.json nor vocab.json + merges.txt", 0)
  elseif kind == "file" then
    if spec:match("vocab%.json$") then
      local mp = (spec:match("^(.*/)") or "") .. "merges.txt"
      if kind_of(mp) ~= "file" then
        error(op .. ": " .. spec .. ": a vocab.json needs its merges.txt (" .. mp .. " does not exist)", 0)
      end
      return M.new(from_vocab_merges(spec, mp, op, spec), op)
    end
    return M.new(from_tokenizer_json(spec, op), op)
  end
  error(op .. ": " .. spec .. ": no such file or folder (expected \"byte\", a tokenizer.json, or a folder with " ..
    "tokenizer.json or vocab.json + merges.txt)", 0)
end

return M
