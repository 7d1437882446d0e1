-- Helpers for the recipe specs (spec/dist/*_recipe_spec.lua): run a recipe in this process and collect the
-- losses rank 0 printed; make a run's own small token shards (the suite does not need data/); build argument
-- lists; run the single-process references (recipes/gpt.lua) in a child engine; compare losses; check a resume.
local engine = require("engine")
local dist = engine.distributed
local assert = require("luassert")   -- busted's assert (the spec's global is insulated from this module)

local M = {}

-- run(file, argv, nsteps) -> the per-step training losses (steps 1..nsteps, default 1) rank 0 printed (on every
-- rank: all-reduced, other ranks contribute 0) and the printed lines.  The recipe runs in the global environment
-- (busted insulates the spec's), with print captured and `arg` set to argv; the globals the wrapper recipes set
-- for the recipe they run (GPT_DEFAULTS, GPT_MODEL, FSDP_GPT) are cleared afterwards.
function M.run(file, argv, nsteps)
  nsteps = nsteps or 1
  local W, R = dist.world_size(), dist.rank()
  local lines = {}
  local G = _G
  local real_print = G.print
  G.print = function(...)
    local t = {}
    for i = 1, select("#", ...) do t[i] = tostring(select(i, ...)) end
    lines[#lines + 1] = table.concat(t, "\t")
  end
  local saved_arg = G.arg
  G.arg = argv
  argv[0] = file
  local ok, err = pcall(dofile, file)
  G.print, G.arg = real_print, saved_arg
  G.GPT_DEFAULTS, G.GPT_MODEL, G.FSDP_GPT = nil, nil, nil
  if not ok then error(err, 0) end
  local losses = {}
  for _, l in ipairs(lines) do
    local step, loss = l:match("^step%s+(%d+) | loss ([%d.]+)")
    if step then losses[tonumber(step)] = tonumber(loss) end
  end
  local vals = {}
  for k = 1, nsteps do vals[k] = (R == 0 and losses[k]) or 0 end
  local t = engine.tensor(vals, "f64")
  if W > 1 then dist.all_reduce(t, "sum") end
  return t:totable(), lines
end

-- tiny_data(name, seed) -> base path, train file, val file: a pseudo-random word text written by rank 0 under
-- $TMPDIR with a time stamp every rank agrees on.
function M.tiny_data(name, seed)
  local W, R = dist.world_size(), dist.rank()
  local dir = os.getenv("TMPDIR") or "/tmp"
  local stamp = engine.tensor({ math.floor(engine.time() * 1000) % 100000000 }, "f64")
  if W > 1 then dist.broadcast(stamp, 0) end
  local base = string.format("%s/%s_%d", dir, name, stamp:item())
  local train_bin, val_bin = base .. "_train.bin", base .. "_val.bin"
  if R == 0 then
    local words = { "In", "the", "beginning", "God", "created", "heaven", "and", "earth.", "And", "was", "without",
      "form,", "void;", "darkness", "upon", "face", "of", "deep." }
    local text, x = {}, seed
    for i = 1, 4000 do
      x = (x * 1103515245 + 12345) % 2147483648
      text[i] = words[x % #words + 1]
    end
    local s = table.concat(text, " ")
    engine.data.write_shard(train_bin, engine.data.encode(s:sub(1, 20000)))
    engine.data.write_shard(val_bin, engine.data.encode(s:sub(20001, 24000)))
  end
  if W > 1 then dist.barrier() end
  return base, train_bin, val_bin
end

-- argv_builder(base, fill) -> argv(extra): the arguments base, then extra, then those of fill ({key, value} pairs
-- in order) whose key neither gave
function M.argv_builder(base, fill)
  return function(extra)
    local a = {}
    for _, v in ipairs(base) do a[#a + 1] = v end
    for _, v in ipairs(extra) do a[#a + 1] = v end
    local has = {}
    for _, v in ipairs(a) do has[v:match("^%-%-([%w_]+)=") or ""] = true end
    for _, kv in ipairs(fill or {}) do
      if not has[kv[1]] then a[#a + 1] = "--" .. kv[1] .. "=" .. kv[2] end
    end
    return a
  end
end

-- references(spec, base_path, argvs, steps) -> ref: the single-process recipes/gpt.lua run with each of argvs.
-- With several ranks rank 0 starts them now in a child engine (mpirun's environment removed, so it is a world of
-- one) that runs while this process trains; at 1 rank they run in this process when asked.  ref.get() ->
-- refs[i][step] (steps 1..steps) on every rank (NaN where the child failed; its output goes to stderr);
-- ref.close() (in a teardown) reaps a child never read.
function M.references(spec, base_path, argvs, steps)
  local W, R = dist.world_size(), dist.rank()
  local HOME = (ENGINE_HOME and ENGINE_HOME ~= "") and ENGINE_HOME or "."
  local child, refs
  if R == 0 and W > 1 then
    local exe = require("spec.helpers.proc").self_exe()
    local code = {}
    for i, argv in ipairs(argvs) do
      local a = {}
      for _, v in ipairs(argv) do a[#a + 1] = string.format("%q", v) end
      code[#code + 1] = string.format("arg = { [0] = 'recipes/gpt.lua', %s }; print('__ref %d'); dofile('recipes/gpt.lua')",
        table.concat(a, ", "), i)
    end
    local script = base_path .. "_ref.lua"
    local f = assert(io.open(script, "w"))
    f:write(table.concat(code, "\n"), "\n")
    f:close()
    -- the MPI launcher's environment (OMPI_*, PMIX_*) must not leak into the child (else MPI_Init joins this job)
    child = io.popen(string.format("cd '%s' && env $(env | sed -n 's/^\\(OMPI_[^=]*\\|PMIX_[^=]*\\)=.*/-u \\1/p') "
      .. "'%s' '%s' 2>&1; echo __rc=$?", HOME, exe, script))
  end
  local ref = {}
  function ref.get()
    if refs then return refs end
    refs = {}
    if W == 1 then
      for i, argv in ipairs(argvs) do refs[i] = M.run("recipes/gpt.lua", argv, steps) end
      return refs
    end
    local vals = {}
    if R == 0 then
      local out = child:read("*a")
      child:close()
      child = nil
      local which, per = 0, {}
      for line in out:gmatch("[^\n]+") do
        local k = line:match("^__ref (%d+)")
        if k then which = tonumber(k); per[which] = {} end
        local step, loss = line:match("^step%s+(%d+) | loss ([%d.]+)")
        if step and which > 0 then per[which][tonumber(step)] = tonumber(loss) end
      end
      local ok = out:match("__rc=0") and per[#argvs] and per[#argvs][steps]
      for i = 1, #argvs do
        for s = 1, steps do vals[#vals + 1] = ok and per[i][s] or 0 / 0 end
      end
      if not ok then io.stderr:write(spec .. ": the single-process reference failed:\n" .. out .. "\n") end
    else
      for _ = 1, #argvs * steps do vals[#vals + 1] = 0 end
    end
    local t = engine.tensor(vals, "f64")
    dist.all_reduce(t, "sum")
    local tl = t:totable()
    for i = 1, #argvs do
      refs[i] = {}
      for s = 1, steps do refs[i][s] = tl[(i - 1) * steps + s] end
    end
    return refs
  end
  function ref.close()
    if child then pcall(function() child:read("*a"); child:close() end) end
    child = nil
  end
  return ref
end

-- check_equal(name, got, want, what): got[s] within 1e-5 relative of the single-process reference want[s] for
-- every step of want; `what` names the parallel run in the message
function M.check_equal(name, got, want, what)
  for s = 1, #want do
    assert.is_true(want[s] == want[s], name .. ": no single-process reference (see stderr)")
    assert.is_true(math.abs(got[s] - want[s]) <= 1e-5 * math.abs(want[s]),
      string.format("%s step %d: %.7f with %s at %d ranks vs %.7f on one process", name, s, got[s], what,
        dist.world_size(), want[s]))
  end
end

-- check_resume(name, file, full_argv, resumed_argv, from, steps) -> the full run's losses and lines: runs file
-- with full_argv (which saves a checkpoint at step from - 1) and with resumed_argv (which resumes from it); the
-- resumed losses of steps from..steps equal the full run's to 1e-6 (relative, absolute below 1)
function M.check_resume(name, file, full_argv, resumed_argv, from, steps)
  local full_run, lines = M.run(file, full_argv, steps)
  local resumed = M.run(file, resumed_argv, steps)
  for s = from, steps do
    assert.is_true(math.abs(resumed[s] - full_run[s]) <= 1e-6 * math.max(1, full_run[s]),
      string.format("%s step %d: %.7f resumed vs %.7f", name, s, resumed[s], full_run[s]))
  end
  return full_run, lines
end

-- shard_log(name, lines) -> the number of "<name>: rank r local shards" lines, of validation lines, and whether
-- a sample was printed; each shard line must show AdamW's two states per parameter and gradients the size of the
-- parameters (sharded: about 1/W each)
function M.shard_log(name, lines)
  local mem, val, sample = 0, 0, false
  for _, l in ipairs(lines) do
    local p, g, o = l:match("^" .. name .. ": rank %d+ local shards: parameters ([%d.]+) MiB, gradients ([%d.]+) MiB, "
      .. "optimizer state ([%d.]+) MiB")
    if p then
      mem = mem + 1
      assert.is_true(math.abs(tonumber(o) - 2 * tonumber(p)) <= 0.02 and math.abs(tonumber(g) - tonumber(p)) <= 0.01, l)
    end
    if l:match("^step +%d+ | val loss [%d.]+") then val = val + 1 end
    if l:match("^" .. name .. ": sample") then sample = true end
  end
  return mem, val, sample
end

return M
