-- Reliability on bad input: no crash, no silent wrong answer,
-- errors that name the op in the Lua convention.  Cases that crashed the process before the fix run
-- in a child `engine -e` so that a regression fails one test instead of the whole file.
local engine = require("engine")
local ffi = engine.ffi
local nn, F = engine.nn, engine.nn.functional

local self_exe = require("spec.helpers.proc").self_exe
local EXE = self_exe()
local HOME = rawget(_G, "ENGINE_HOME") or os.getenv("ENGINE_HOME") or "."

-- Runs code in a child engine; returns its output (stdout + stderr) and exit status.
local function child(code)
  local path = os.tmpname()
  local f = assert(io.open(path, "w"))
  f:write(code)
  f:close()
  local p = io.popen(string.format("cd '%s' && ENGINE_HOME='%s' '%s' '%s' 2>&1; echo \"__rc=$?\"", HOME, HOME, EXE, path))
  local out = p:read("*a")
  p:close()
  os.remove(path)
  local rc = tonumber(out:match("__rc=(%d+)%s*$"))
  return out:gsub("__rc=%d+%s*$", ""), rc
end

local err_of, has = require("spec.helpers.errors").err_of, require("spec.helpers.errors").has
local function hasnt(msg, ...)
  for _, s in ipairs({ ... }) do
    assert(not msg:find(s, 1, true), string.format("did not expect %q in the message: %s", s, msg))
  end
end

-- ===================================================================== item 1: NaN payloads
describe("NaN payloads crossing into Lua", function()
  -- Writes raw bit patterns into a tensor of dtype dt, then reads it every way Lua can.
  local prelude = [[
local e = require("engine")
local ffi = require("ffi")
local function poison(dt)
  local t = e.zeros({2}, {dtype = dt})
  local p = t:data_ptr()
  if dt == "f32" then local u = ffi.cast("uint32_t*", p); u[0] = 0xFFD00000; u[1] = 0xFFFFFFFF
  elseif dt == "f64" then local u = ffi.cast("uint64_t*", p); u[0] = 0xFFFA000000000000ULL; u[1] = 0xFFFFFFFFFFD00000ULL
  else local u = ffi.cast("uint16_t*", p); u[0] = dt == "bf16" and 0xFFD0 or 0xFE80; u[1] = 0xFFFF end
  return t
end
local function isnan(v) return type(v) == "number" and v ~= v end
]]

  for _, dt in ipairs({ "f32", "f64", "bf16", "f16" }) do
    it(dt .. ": item, get, totable, tostring and reductions give NaN numbers", function()
      local out, rc = child(prelude .. [[
local t = poison("]] .. dt .. [[")
for i = 1, 200 do  -- long enough for the JIT to compile the loop
  assert(isnan(t:narrow(1, 1, 1):item()), "item")
  assert(isnan(t:get(1)) and isnan(t:get(2)), "get")
  local tt = t:totable()
  assert(isnan(tt[1]) and isnan(tt[2]), "totable")
  assert(isnan(t:tolist_flat()[1]), "tolist_flat")
  assert(isnan(t:sum():item()), "sum")
  assert(isnan(t:max():item()), "max")
end
assert(tostring(t):find("nan"), "tostring")
print("OK")
]])
      assert.equal(0, rc, out)
      assert.truthy(out:find("OK"), out)
    end)
  end

  it("the issue's reproducer (an i64 fill reused as f32 by the caching allocator)", function()
    local out, rc = child([[
local e = require("engine")
for i = 1, 50 do
  do local t = e.full({4096}, -3145728, {dtype = "i64"}) end
  collectgarbage()
  local v = e.empty(8192):sum():item()
  assert(type(v) == "number")
end
print("OK")
]])
    assert.equal(0, rc, out)
    assert.truthy(out:find("OK"), out)
  end)

  it("a NaN gradient norm is a NaN", function()
    local out, rc = child(prelude .. [[
local p = e.zeros(2)
p.requires_grad = true
p.grad = poison("f32")
for i = 1, 100 do assert(isnan(e.optim.grad_norm({p}):item())) end
print("OK")
]])
    assert.equal(0, rc, out)
    assert.truthy(out:find("OK"), out)
  end)
end)

-- ===================================================================== item 2: shape arithmetic
describe("shape arithmetic overflow", function()
  local big = {
    { "zeros(2^62, 2^62)", function() return engine.zeros(2 ^ 62, 2 ^ 62) end, "zeros" },
    { "zeros(2^32, 2^32)", function() return engine.zeros(2 ^ 32, 2 ^ 32) end, "zeros" },
    { "empty(2^62, 4)", function() return engine.empty(2 ^ 62, 4) end, "empty" },
    { "ones(2^61, 2^61, 4)", function() return engine.ones(2 ^ 61, 2 ^ 61, 4) end, "full" },
    { "randn(2^31, 2^31, 4)", function() return engine.randn(2 ^ 31, 2 ^ 31, 4) end, "randn" },
    { "rand(2^40, 2^40)", function() return engine.rand(2 ^ 40, 2 ^ 40) end, "rand" },
    { "full({2^62, 2^62}, 1)", function() return engine.full({ 2 ^ 62, 2 ^ 62 }, 1) end, "full" },
    { "expand(2^62, 2^62, 4)", function() return engine.ones(1, 1, 4):expand(2 ^ 62, 2 ^ 62, 4) end, "expand" },
    { "expand(2^31, 2^31, 2^31)", function() return engine.ones(1):expand(2 ^ 31, 2 ^ 31, 2 ^ 31) end, "expand" },
    { "meta zeros(2^62, 2^62)", function() return engine.zeros(2 ^ 62, 2 ^ 62, { device = "meta" }) end, "zeros" },
    { "reshape(-1, 2^62, 2^62)", function() return engine.ones(4):reshape(-1, 2 ^ 62, 2 ^ 62) end, "reshape" },
    { "view(2^62, 2^62, 0)", function() return engine.ones(0):view(2 ^ 62, 2 ^ 62, 0) end, nil },
  }
  for _, c in ipairs(big) do
    it(c[1] .. " is an error naming the op and the shape (or a valid empty tensor)", function()
      local ok, r = pcall(c[2])
      if c[3] == nil then -- a zero in the shape makes the product small: must be valid
        if ok then assert.equal(0, r:numel()) end
        return
      end
      assert.is_false(ok, "expected an error, got a tensor")
      has(tostring(r), c[3] .. ":")
      assert.truthy(tostring(r):find("too large") or tostring(r):find("overflow"), tostring(r))
    end)
  end

  it("a size outside int64 is an error, not a wrap (zeros(1e30), zeros(2^63), -2^64)", function()
    for _, s in ipairs({ 1e30, 2 ^ 63, -2 ^ 64 }) do
      local msg = err_of(engine.zeros, s)
      has(msg, "zeros:", "out of range")
      hasnt(msg, "-9223372036854775808")
    end
    has(err_of(function() engine.ones(2, 3):view(1e30) end), "view:", "out of range")
    has(err_of(function() engine.ones(2, 3):expand(2 ^ 70, 3) end), "expand:", "out of range")
  end)

  it("huge tensors that were made no longer crash later ops (child process)", function()
    local out, rc = child([[
local e = require("engine")
for _, f in ipairs({
  function() return e.zeros(2^62, 2^62):select(1, 2) end,
  function() return e.zeros(2^62, 2^62):fill_(1) end,
  function() return e.zeros(2^62, 2^62):narrow(1, 2, 3) end,
  function() return e.zeros(2^62, 2^62):sum() end,
  function() return e.ones(4):reshape(-1, 2^62, 2^62) end,
  function() return e.ones(4):view(-1, 2^63 - 1024) end,
}) do assert(not pcall(f)) end
print("OK")
]])
    assert.equal(0, rc, out)
    assert.truthy(out:find("OK"), out)
  end)

  it("the largest tensors that fit are still allowed on meta (2^40 elements)", function()
    local t = engine.empty(2 ^ 20, 2 ^ 20, { device = "meta" })
    assert.equal(2 ^ 40, t:numel())
    local e = engine.ones(1):expand(2 ^ 30, 2 ^ 30)
    assert.equal(2 ^ 60, e:numel())
  end)
end)

describe("out-of-range conversions of Lua numbers", function()
  it("tensor() refuses values that do not fit the integer dtype", function()
    has(err_of(engine.tensor, { 1e20 }, "i64"), "tensor:", "1e+20", "i64")
    has(err_of(engine.tensor, { 2 ^ 63 }, "i64"), "tensor:", "i64")
    has(err_of(engine.tensor, { 1, 300 }, "u8"), "tensor:", "300", "u8")
    has(err_of(engine.tensor, { -1 }, "u8"), "tensor:", "u8")
    has(err_of(engine.tensor, { 2 ^ 31 }, "i32"), "tensor:", "i32")
    has(err_of(engine.tensor, { 0 / 0 }, "i64"), "tensor:", "nan", "i64")
    has(err_of(engine.tensor, { math.huge }, "i32"), "tensor:", "inf", "i32")
    -- limits themselves are fine
    assert.same({ 255, 0 }, engine.tensor({ 255, 0 }, "u8"):totable())
    assert.same({ 2147483647, -2147483648 }, engine.tensor({ 2 ^ 31 - 1, -2 ^ 31 }, "i32"):totable())
    assert.same({ -2 ^ 63 }, engine.tensor({ -2 ^ 63 }, "i64"):totable())
    -- floating and bool dtypes take any number
    assert.equal(1, #engine.tensor({ 1e300 }, "f64"):totable())
    assert.same({ true, false }, engine.tensor({ 300, 0 }, "bool"):totable())
  end)

  it("full, fill_, set, arange and masked_fill refuse out-of-range values for integer dtypes", function()
    has(err_of(engine.full, { 2 }, 1e20, { dtype = "i64" }), "full:", "i64")
    has(err_of(engine.full, { 2 }, 0 / 0, { dtype = "i32" }), "full:", "nan")
    has(err_of(function() engine.zeros(2, { dtype = "u8" }):fill_(256) end), "fill_:", "256", "u8")
    has(err_of(function() engine.zeros(2, { dtype = "i32" }):set(2 ^ 40, 1) end), "set:", "i32")
    has(err_of(engine.arange, 0, 300, 1, { dtype = "u8" }), "arange:", "u8")
    local m = engine.tensor({ true, false })
    has(err_of(function() engine.zeros(2, { dtype = "u8" }):masked_fill(m, 999) end), "masked_fill:", "u8")
    -- in range still works
    assert.same({ 7, 7 }, engine.zeros(2, { dtype = "u8" }):fill_(7):totable())
    assert.same({ 255, 0 }, engine.zeros(2, { dtype = "u8" }):masked_fill(m, 255):totable())
  end)

  it("manual_seed refuses seeds outside [0, 2^64)", function()
    has(err_of(engine.manual_seed, 2 ^ 64), "manual_seed:", "2^64")
    has(err_of(engine.manual_seed, -1), "manual_seed:")
    has(err_of(engine.manual_seed, 0 / 0), "manual_seed:")
    engine.manual_seed(2 ^ 64 - 2048) -- the largest double below 2^64
    local a = engine.rand(4):totable()
    engine.manual_seed(0)
    assert.are_not.same(a, engine.rand(4):totable())
  end)
end)

-- ===================================================================== item 7: error messages
describe("error messages follow the Lua convention", function()
  local t = engine.ones(2, 3)
  it("select, narrow, permute, cat, expand, reshape report 1-based dims and indices", function()
    local m = err_of(function() t:select(1, 3) end)
    has(m, "select:", "index 3", "dim 1 ")
    hasnt(m, "index 2", "dim 0")
    m = err_of(function() t:select(2, -4) end)
    has(m, "select:", "index -4", "dim 2 ")
    m = err_of(function() t:narrow(2, 3, 2) end)
    has(m, "narrow:", "dim 2 ", "start 3")
    hasnt(m, "dim 1 ")
    m = err_of(function() t:narrow(1, 4, 1) end)
    has(m, "narrow:", "start 4", "dim 1 ")
    m = err_of(function() t:permute(1, 1) end)
    has(m, "permute:", "dim 1 is repeated", "[1,1]")
    hasnt(m, "dim 0", "[0,0]")
    m = err_of(function() engine.cat({ engine.ones(2, 3), engine.ones(2, 4) }, 1) end)
    has(m, "cat:", "except in dim 1", "at dim 2", "tensor 2")
    hasnt(m, "dim 0")
    m = err_of(function() t:expand(2, 4) end)
    has(m, "expand:", "non-singleton dim 2")
    m = err_of(function() t:expand(-1, 2, 3) end)
    has(m, "expand:", "leading dim 1")
    m = err_of(function() engine.ones(6):reshape(2, -2) end)
    has(m, "reshape:", "at dim 2")
    m = err_of(function() return engine.ones(2, 3) + engine.ones(4) end)
    has(m, "add:", "dim 2")
    hasnt(m, "0-based")
    m = err_of(function() t:get(1, 4) end)
    has(m, "get:", "index 4", "dim 2")
    m = err_of(function() F.cross_entropy(engine.ones(2, 3), engine.tensor({ 1, 0, 1 })) end)
    has(m, "class dim 2")
  end)

  it("C errors raised through the C API directly are 1-based too", function()
    local C = engine.C
    local idx = ffi.new("int64_t[2]", { 0, 5 })
    local out = ffi.new("double[1]")
    assert.equal(-1, C.eng_tensor_get(t._c, idx, out))
    local m = ffi.string(C.eng_last_error())
    has(m, "get:", "index 6", "dim 2 ")
  end)

  it("no doubled prefixes", function()
    local C = engine.C
    -- a prefix added on top of a message that already names the op keeps one op name
    local m = err_of(function() F.cross_entropy(engine.ones(2, 3), engine.tensor({ 5, 0 })) end)
    hasnt(m, "cross_entropy: cross_entropy:")
    m = err_of(function() t:to("bogus") end)
    hasnt(m, "to: dtype:")
    m = err_of(engine.tensor, { 1 }, "f33")
    hasnt(m, "tensor: tensor:", "dtype: dtype:")
    local e2 = engine.distributed
    local mesh = e2.init_device_mesh("cpu", { 1 })
    local d = e2.distribute_tensor(engine.ones(2, 3), mesh, { e2.Shard(1) })
    m = err_of(function() F.cross_entropy(d, engine.tensor({ 5, 0 })) end)
    hasnt(m, "cross_entropy: cross_entropy:")
    has(m, "cross_entropy:")
    assert.is_true(C ~= nil)
  end)

  it("to(\"gpu\") says unknown device", function()
    local m = err_of(function() t:to("gpu") end)
    has(m, "to:", "unknown device", "gpu")
    hasnt(m, "unknown dtype")
    m = err_of(function() t:to("f33") end)
    has(m, "f33")
    assert.equal("f64", t:to("f64").dtype)
    assert.equal("cpu", t:to("cpu").device)
  end)
end)

-- ===================================================================== item 8: state dicts and checkpoints
describe("state dict helpers and checkpoints", function()
  local checkpoint = require("engine.checkpoint")
  local TMP = os.tmpname()
  os.remove(TMP)
  os.execute("mkdir -p " .. TMP)
  teardown(function() os.execute("rm -rf '" .. TMP .. "'") end)

  it("engine.save(path, model:state_dict()) round-trips", function()
    engine.manual_seed(3)
    local m = nn.Linear(3, 2)
    local p = TMP .. "/sd.safetensors"
    engine.save(p, m:state_dict())
    local back = engine.load(p)
    assert.same(m.weight:totable(), back.weight:totable())
    assert.same(m.bias:totable(), back.bias:totable())
    assert.equal(1, select("#", m:state_dict()))
  end)

  it("engine.save names the problem when metadata is a list", function()
    local m = err_of(engine.save, TMP .. "/x.safetensors", { a = engine.ones(1) }, { "a", "b" })
    has(m, "save:", "metadata")
  end)

  it("checkpoint.save refuses DTensor parameters and points at full_tensor()", function()
    local dist = engine.distributed
    local mesh = dist.init_device_mesh("cpu", { 1 })
    local m = nn.Linear(4, 2)
    m.weight = nn.Parameter(dist.distribute_tensor(m.weight:detach(), mesh, { dist.Shard(1) }))
    local p = TMP .. "/dt.safetensors"
    local msg = err_of(checkpoint.save, p, { model = m, step = 1 })
    has(msg, "checkpoint.save", "weight", "DTensor", "full_tensor()")
    assert.is_nil(io.open(p, "r"), "nothing written")
  end)

  it("checkpoints carry a checksum per tensor, verified on load", function()
    engine.manual_seed(1)
    local m = nn.Linear(8, 8)
    local opt = engine.optim.AdamW(m:parameters(), { lr = 1e-3 })
    m(engine.randn(2, 8)):sum():backward()
    opt:step()
    local p = TMP .. "/ck.safetensors"
    checkpoint.save(p, { model = m, optimizer = opt, step = 1 })
    local _, meta = engine.load(p)
    local n = 0
    for k in pairs(meta) do if k:match("^checksum%.") then n = n + 1 end end
    assert.equal(2 + 4, n) -- weight, bias, and exp_avg / exp_avg_sq of each
    -- a clean file loads
    local m2 = nn.Linear(8, 8)
    checkpoint.load(p, { model = m2 })
    assert.same(m.weight:totable(), m2.weight:totable())
    -- flip one byte inside the data of the last tensor (the end of the file)
    local f = assert(io.open(p, "r+b"))
    local size = f:seek("end")
    f:seek("set", size - 3)
    local b = f:read(1)
    f:seek("set", size - 3)
    f:write(string.char((b:byte() + 1) % 256))
    f:close()
    local msg = err_of(checkpoint.load, p, { model = nn.Linear(8, 8), optimizer = engine.optim.AdamW(nn.Linear(8, 8):parameters()) })
    has(msg, "checkpoint.load", "checksum")
  end)

  -- a metadata value changed on disk (the step) used to load silently
  it("checkpoint metadata (the step, hyperparameters) is checksummed; format /1 files still load", function()
    engine.manual_seed(2)
    local m = nn.Linear(4, 4)
    local p = TMP .. "/ckmeta.safetensors"
    checkpoint.save(p, { model = m, step = 15 })
    local f = assert(io.open(p, "rb"))
    local s = f:read("*a")
    f:close()
    local s2, n = s:gsub('"step":"15"', '"step":"16"')
    assert.equal(1, n)
    f = assert(io.open(p, "wb"))
    f:write(s2)
    f:close()
    local msg = err_of(checkpoint.load, p, { model = nn.Linear(4, 4) })
    has(msg, "checkpoint.load", "ckmeta.safetensors", "metadata fails its checksum", "step")
    -- the same file as format /1 wrote it (no metadata checksum) loads
    local tensors, meta = engine.load(p)
    meta.metadata_checksum, meta.format = nil, "engine-training-state/1"
    engine.save(p, tensors, meta)
    local info = checkpoint.load(p, { model = nn.Linear(4, 4) })
    assert.equal(16, info.step)
  end)

  it("engine.tensor_checksum is stable across layouts and differs on a change", function()
    local a = engine.arange(12, { dtype = "f32" }):view(3, 4)
    local b = a:t():contiguous():t()
    assert.equal(engine.tensor_checksum(a), engine.tensor_checksum(b))
    local c = a:clone()
    c:set(99, 2, 2)
    assert.are_not.equal(engine.tensor_checksum(a), engine.tensor_checksum(c))
    assert.equal("string", type(engine.tensor_checksum(a)))
  end)

  it("XXH64 (distributed checkpoint chunks) is xxHash64 bit for bit, fed whole or in pieces", function()
    local ffi = require("ffi")
    local C = require("engine.core").C
    -- xxhash.xxh64(b).hexdigest() (the reference implementation, seed 0)
    local big = {}
    for i = 0, 767 do big[#big + 1] = string.char(i % 256) end
    big = table.concat(big) .. "xyz"
    local cases = { { "", "ef46db3751d8e999" }, { "a", "d24ec4f1a98c6e5b" }, { "abc", "44bc2cf5ad770999" },
      { big, "e921a1b45bd779f8" } }
    for _, c in ipairs(cases) do assert.equal(c[2], bit.tohex(C.eng_xxh64(c[1], #c[1]), 16)) end
    local st = ffi.new("eng_xxh64_state")
    for _, cut in ipairs({ 0, 1, 7, 31, 32, 33, 100, 400, 768 }) do
      C.eng_xxh64_reset(st)
      C.eng_xxh64_update(st, big, cut)
      C.eng_xxh64_update(st, ffi.cast("const char*", big) + cut, 3)
      C.eng_xxh64_update(st, ffi.cast("const char*", big) + cut + 3, #big - cut - 3)
      assert.equal("e921a1b45bd779f8", bit.tohex(C.eng_xxh64_digest(st), 16))
    end
  end)
end)

describe("a run whose loss turns NaN stops", function()
  local TMP = os.tmpname()
  os.remove(TMP)
  os.execute("mkdir -p " .. TMP)
  teardown(function() os.execute("rm -rf '" .. TMP .. "'") end)
  it("recipes/gpt.lua with a diverging lr stops naming the step", function()
    local data = engine.data
    local s = ("In the beginning God created the heaven and the earth. "):rep(200)
    data.write_shard(TMP .. "/train.bin", data.encode(s:sub(1, 8000)))
    data.write_shard(TMP .. "/val.bin", data.encode(s:sub(8001, 10000)))
    local p = io.popen(string.format("cd '%s' && '%s' recipes/gpt.lua --n_layers=1 --dim=16 --n_heads=2 --seq=16 " ..
      "--batch=2 --steps=50 --lr=1e30 --warmup=0 --grad_clip=0 --eval_every=0 --eval_batches=1 --log_every=1 " ..
      "--sample_len=0 --ckpt_every=-1 --train=%s/train.bin --val=%s/val.bin 2>&1; echo \"__rc=$?\"",
      HOME, EXE, TMP, TMP))
    local out = p:read("*a")
    p:close()
    local rc = tonumber(out:match("__rc=(%d+)%s*$"))
    assert.are.equal(1, rc, out)
    assert.truthy(out:match("loss is %S+ at step %d+"), out)
    assert.is_nil(out:find("traceback", 1, true), out)   -- a run error, not a crash: printed once, plainly
    local last = 0
    for st in out:gmatch("step%s+(%d+) | loss") do last = tonumber(st) end
    assert.is_true(last < 50, out)
  end)
end)

-- ===================================================================== item 10: README snippets
describe("README snippets run standalone", function()
  local readme = assert(io.open(HOME .. "/README.md")):read("*a")
  it("the meta-device snippet", function()
    local code = readme:match("%-%-%-%-meta%-snippet%-%-%-%-.-```lua[^\n]*\n(.-)```")
      or readme:match("```lua[^\n]*\n(local m = engine.with_device.-)```")
      or readme:match("```lua[^\n]*\n([^`]-with_device%(\"meta\".-)```")
    assert.truthy(code, "meta-device snippet not found")
    local out, rc = child(code)
    assert.equal(0, rc, out)
  end)
  it("the quick example trains: the loss it prints falls, and the text gives its first and last values", function()
    local code = readme:match("## Using it.-```lua\n(.-)```")
    assert.truthy(code)
    local out, rc = child(code)
    assert.equal(0, rc, out)
    local losses = {}
    for st, v in out:gmatch("(%d+)%s+([%d%.]+)") do losses[#losses + 1] = { tonumber(st), tonumber(v) } end
    assert.is_true(#losses >= 2, out)
    local first, last = losses[1][2], losses[#losses][2]
    assert.is_true(last < first / 4, out)
    assert.truthy(readme:find(string.format("%.1f at step 1", first), 1, true), "README states the first loss " .. first)
    assert.truthy(readme:find(string.format("about %.1f at step %d", last, losses[#losses][1]), 1, true),
      "README states the last loss " .. last)
  end)
  it("--eval_batches says per rank", function()
    assert.truthy(readme:find("eval_batches` %(20[^)]*per rank") or readme:find("%-%-eval_batches[^\n]*per rank"))
  end)
end)
