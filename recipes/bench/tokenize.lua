-- recipes/bench/tokenize.lua: byte-level BPE encoding speed (engine.data.load_tokenizer), with the Hugging Face
-- `tokenizers` package on the same text as the baseline when tools/.venv has it.
--
--   build/engine recipes/bench/tokenize.lua [--tokenizer=data/tokenizers/kjv-bpe-4k] [--input=data/kjv.txt]
--     [--reps=3] [--python=true]
--
-- Prints the medians of --reps runs:
--   load       data.load_tokenizer (JSON, vocabulary, merges)
--   encode     tok:encode(whole text) with a fresh tokenizer (empty piece cache), in MB/s and seconds
--   warm       the same again on the same tokenizer (every piece cached)
--   decode     tok:decode(ids)
--   python     Tokenizer.from_file + encode(whole text) (one call, as here) and encode_batch(lines) (the
--              package's threads over the lines); the ids of encode must equal the engine's (checked).
-- data/kjv.txt comes from `build/engine tools/prepare_data.lua` (make data).
local engine = require("engine")
local data = engine.data
local cli = require("engine.cli")
local NAME = "bench/tokenize"

local home = rawget(_G, "ENGINE_HOME") or os.getenv("ENGINE_HOME") or "."
local o = cli.parse(arg or {}, { name = NAME,
  description = "Byte-level BPE encoding speed of engine.data, beside the Hugging Face tokenizers package.",
  options = {
    { "tokenizer", home .. "/data/tokenizers/kjv-bpe-4k", "a tokenizer (engine.data.load_tokenizer)" },
    { "input", home .. "/data/kjv.txt", "the text (data/kjv.txt: build/engine tools/prepare_data.lua)" },
    { "reps", 3, "repetitions (medians are printed)", int = true, min = 1 },
    { "python", true, "also time the tokenizers package (tools/.venv/bin/python), when it is there" },
  } })

local f = io.open(o.input, "rb")
if not f then cli.usage_error(NAME, "cannot open %s (make data writes data/kjv.txt)", o.input) end
local text = f:read("*a")
f:close()
local mb = #text / 1e6

local now = engine.time   -- wall-clock seconds

-- the median of the benches (recipes/bench/util.lua)
local median = dofile((debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".") .. "/util.lua").median

local loads, encs, warms, decs = {}, {}, {}, {}
local ids, tok
for r = 1, o.reps do
  collectgarbage()
  local t0 = now()
  tok = data.load_tokenizer(o.tokenizer)
  local t1 = now()
  ids = tok:encode(text)
  local t2 = now()
  tok:encode(text)
  local t3 = now()
  local back = tok:decode(ids)
  local t4 = now()
  assert(back == text, "bench/tokenize: decode(encode(text)) differs from the text")
  loads[r], encs[r], warms[r], decs[r] = t1 - t0, t2 - t1, t3 - t2, t4 - t3
end
print(string.format("bench/tokenize: %s, %.2f MB, tokenizer %s (vocab %d): %d ids, %.2f bytes/id; medians of %d",
  o.input, mb, tok.name, tok.vocab_size, #ids, #text / #ids, o.reps))
print(string.format("  engine load    %8.3f s", median(loads)))
print(string.format("  engine encode  %8.3f s  %7.2f MB/s   (fresh tokenizer: empty piece cache)", median(encs),
  mb / median(encs)))
print(string.format("  engine warm    %8.3f s  %7.2f MB/s   (every piece cached)", median(warms), mb / median(warms)))
print(string.format("  engine decode  %8.3f s  %7.2f MB/s", median(decs), mb / median(decs)))

local py = home .. "/tools/.venv/bin/python"
if o.python and io.open(py, "rb") then
  local tokjson = o.tokenizer
  local fj = io.open(tokjson .. "/tokenizer.json", "rb")
  if fj then fj:close(); tokjson = tokjson .. "/tokenizer.json" end
  local idfile = os.tmpname()
  local fi = assert(io.open(idfile, "wb"))
  fi:write(table.concat(ids, "\n"))
  fi:close()
  local script = string.format([[
import time, statistics, sys
try:
    from tokenizers import Tokenizer
except ImportError:
    print("  python: the tokenizers package is not installed"); sys.exit(0)
text = open(%q, encoding="utf-8").read()
ours = [int(x) for x in open(%q).read().split()]
loads, encs, batches = [], [], []
for r in range(%d):
    t0 = time.perf_counter(); tok = Tokenizer.from_file(%q); t1 = time.perf_counter()
    ids = tok.encode(text).ids; t2 = time.perf_counter()
    lines = text.splitlines(keepends=True)
    t3 = time.perf_counter(); b = tok.encode_batch(lines); t4 = time.perf_counter()
    loads.append(t1 - t0); encs.append(t2 - t1); batches.append(t4 - t3)
mb = len(text.encode()) / 1e6
m = statistics.median
print("  python load    %%8.3f s" %% m(loads))
print("  python encode  %%8.3f s  %%7.2f MB/s   (tokenizers.Tokenizer.encode of the whole text)" %% (m(encs), mb / m(encs)))
print("  python batch   %%8.3f s  %%7.2f MB/s   (encode_batch of its %%d lines, the package's threads)" %% (m(batches), mb / m(batches), len(lines)))
print("  ids equal to the engine's: %%s (%%d and %%d ids)" %% (ids == ours, len(ids), len(ours)))
]], o.input, idfile, o.reps, tokjson)
  local sf = os.tmpname()
  local fs = assert(io.open(sf, "wb"))
  fs:write(script)
  fs:close()
  local p = io.popen("'" .. py .. "' '" .. sf .. "' 2>&1")
  io.write(p:read("*a"))
  p:close()
  os.remove(sf)
  os.remove(idfile)
else
  print("  python: not timed (" .. (o.python and py .. " is missing" or "--python=false") .. ")")
end
