-- engine.checkpoint: save and restore the whole training state in one safetensors file, for exact
-- resume (a resumed run continues bit for bit like an uninterrupted one).
--
--   local checkpoint = require("engine.checkpoint")
--   checkpoint.save(path, {model = model, optimizer = opt, sampler = train_sampler, step = step,
--                          scheduler = sched, extra = {best_val = 1.7}})
--   local info = checkpoint.load(path, {model = model, optimizer = opt, sampler = train_sampler})
--   -- info.step, info.extra (strings), info.meta (all metadata)
--   local path = checkpoint.latest(dir)               -- newest "step_%08d.safetensors" in dir, or nil
--   checkpoint.path(dir, step)                        -- dir .. "/step_00000500.safetensors"
--
-- What is stored (engine.save: tensors plus string metadata):
--   tensors  "model.<name>"            every entry of model:state_dict() (tied weights under each name)
--            "optim.state.<i>.<key>"   optimizer state tensors (Optimizer:flatten_state_dict, PyTorch's
--                                      parameter numbering), e.g. optim.state.0.exp_avg
--   metadata "format"                  "engine-training-state/1"
--            "step"                    the training step count
--            "rng.seed", "rng.offset"  the global counter-based generator (engine.get_rng_state), as
--                                      exact decimal integers
--            "optim.*"                 optimizer hyperparameters and scalar state (step counts)
--            "sampler.<k>"             numbers from sampler:state() (e.g. position, seed)
--            "scheduler.<k>"           numbers from scheduler:state_dict() (e.g. last_epoch)
--            "extra.<k>"               caller's values (strings; numbers are written with %.17g)
--            "checksum.<tensor name>"  engine.tensor_checksum of each tensor (16 hex digits), verified by
--                                      load: a corrupt tensor is an error naming it (files without
--                                      checksums still load)
--            "metadata_checksum"       engine.metadata_checksum of every other metadata entry (format /2):
--                                      a changed value (the step, a hyperparameter, the RNG offset) or a
--                                      removed tensor checksum is an error, not a silent resume (format /1
--                                      files, without it, still load)
-- DTensors are refused: this format holds whole tensors, and a DTensor's local shard stored under the
-- full name could not be loaded back.  Save model:state_dict() after full_tensor() (e.g. a plain copy
-- of the model), or use the sharded (distributed) checkpoint format for sharded models.
-- engine.save writes under a temporary name and renames, so an interrupted save never leaves a
-- half-written checkpoint.  Numbers are written with 17 significant digits, so they read back exactly.
local engine = require("engine")
local ffi = require("ffi")

local M = {}
M.FORMAT = "engine-training-state/2"
local FORMAT_V1 = "engine-training-state/1"
local META_SUM = "metadata_checksum"

local u64 = ffi.typeof("uint64_t")

-- Exact decimal string of a non-negative integer (Lua number < 2^53 or uint64 cdata).
local function int_string(v)
  if type(v) == "number" then return string.format("%.0f", v) end
  return (tostring(u64(v)):gsub("ULL$", ""))
end

-- Lua number when below 2^53, else uint64 cdata (what engine.set_rng_state accepts).
local function parse_int(s, what)
  if type(s) ~= "string" or not s:match("^%d+$") then
    error(string.format("checkpoint: bad integer for %s: %s", what, tostring(s)), 3)
  end
  local v = u64(0)
  for i = 1, #s do v = v * 10 + (s:byte(i) - 48) end
  if v < u64(2 ^ 53) then return tonumber(v) end
  return v
end

local function num_string(v)
  if type(v) == "number" then
    if v % 1 == 0 and math.abs(v) < 2 ^ 53 then return string.format("%.0f", v) end
    return string.format("%.17g", v)
  end
  if type(v) == "boolean" then return v and "true" or "false" end
  return tostring(v)
end

local function parse_value(s)
  if s == "true" then return true elseif s == "false" then return false end
  return tonumber(s) or s
end

function M.path(dir, step)
  return string.format("%s/step_%08d.safetensors", dir, step)
end

-- latest(dir) -> path of the checkpoint with the highest step in dir, and that step; nil if none.
function M.latest(dir)
  local p = io.popen("ls -1 '" .. dir:gsub("'", "'\\''") .. "' 2>/dev/null")
  if not p then return nil end
  local best, best_step
  for name in p:lines() do
    local s = name:match("^step_(%d+)%.safetensors$")
    if s and (not best_step or tonumber(s) > best_step) then best, best_step = dir .. "/" .. name, tonumber(s) end
  end
  p:close()
  return best, best_step
end

-- save(path, state): state.model (required), state.optimizer, state.sampler, state.scheduler,
-- state.step (number, default 0), state.extra (table of scalars), state.rng (default true).
function M.save(path, state)
  if type(path) ~= "string" then error("checkpoint.save: path must be a string", 2) end
  if type(state) ~= "table" or state.model == nil then
    error("checkpoint.save: expected a table {model = ..., optimizer = ..., step = ...}", 2)
  end
  local tensors, meta = {}, { format = M.FORMAT, step = int_string(state.step or 0) }
  local sd = state.model:state_dict()
  for name, t in pairs(sd) do tensors["model." .. name] = t end
  if state.optimizer then
    local ot, om = state.optimizer:flatten_state_dict("optim.")
    for k, v in pairs(ot) do tensors[k] = v end
    for k, v in pairs(om) do meta[k] = v end
  end
  local names = {}
  for name in pairs(tensors) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do
    local t = tensors[name]
    if t._c.dist ~= nil then
      error(string.format("checkpoint.save: %s: '%s' is a DTensor (%s); this format stores whole tensors and " ..
        "cannot hold a sharded one: save a plain copy of the model made with full_tensor() (on every rank), " ..
        "or use the sharded (distributed) checkpoint format", path, name:gsub("^model%.", ""), tostring(t)), 2)
    end
    meta["checksum." .. name] = engine.tensor_checksum(t)
  end
  if state.rng ~= false then
    local r = engine.get_rng_state()
    meta["rng.seed"], meta["rng.offset"] = int_string(r.seed), int_string(r.offset)
  end
  if state.sampler then
    for k, v in pairs(state.sampler:state()) do meta["sampler." .. k] = num_string(v) end
  end
  if state.scheduler then
    for k, v in pairs(state.scheduler:state_dict()) do
      if type(v) ~= "table" then meta["scheduler." .. k] = num_string(v) end
    end
  end
  for k, v in pairs(state.extra or {}) do meta["extra." .. k] = num_string(v) end
  meta[META_SUM] = engine.metadata_checksum(meta, META_SUM)
  engine.save(path, tensors, meta)
  return path
end

-- load(path, state): restores into state.model / optimizer / sampler / scheduler (each optional
-- except model) and the global RNG (unless state.rng == false).  Returns
-- {step = n, extra = {k = value}, meta = metadata}.
function M.load(path, state)
  if type(path) ~= "string" then error("checkpoint.load: path must be a string", 2) end
  if type(state) ~= "table" or state.model == nil then
    error("checkpoint.load: expected a table {model = ..., optimizer = ...}", 2)
  end
  local ok, tensors, meta = pcall(engine.load, path)
  if not ok then error("checkpoint.load: " .. tostring(tensors), 2) end
  if meta.format == M.FORMAT then
    local got = engine.metadata_checksum(meta, META_SUM)
    if meta[META_SUM] ~= got then
      error(string.format("checkpoint.load: %s: the metadata fails its checksum (stored %s, computed %s): a value "
        .. "(e.g. the step) or a tensor's checksum changed since it was saved; the file is corrupt", path,
        tostring(meta[META_SUM]), got), 2)
    end
  end
  local names = {}
  for name in pairs(tensors) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do
    local want = meta["checksum." .. name]
    if want ~= nil then
      local got = engine.tensor_checksum(tensors[name])
      if got ~= want then
        error(string.format("checkpoint.load: %s: tensor '%s' fails its checksum (stored %s, computed %s): the " ..
          "file is corrupt", path, name, want, got), 2)
      end
    end
  end
  if meta.format ~= M.FORMAT and meta.format ~= FORMAT_V1 then
    error(string.format("checkpoint.load: %s is not a training-state checkpoint (format %s, expected %s or %s)", path,
      tostring(meta.format), M.FORMAT, FORMAT_V1), 2)
  end
  local sd = {}
  for name, t in pairs(tensors) do
    local n = name:match("^model%.(.+)$")
    if n then sd[n] = t end
  end
  local lok, lerr = pcall(state.model.load_state_dict, state.model, sd)
  if not lok then error("checkpoint.load: " .. path .. ": " .. tostring(lerr), 2) end
  if state.optimizer then
    local has = false
    for k in pairs(meta) do if k:match("^optim%.") then has = true; break end end
    if not has then error("checkpoint.load: " .. path .. " has no optimizer state", 2) end
    local ot, om = {}, {}
    for k, v in pairs(tensors) do if k:match("^optim%.") then ot[k] = v end end
    for k, v in pairs(meta) do if k:match("^optim%.") then om[k] = v end end
    local ook, oerr = pcall(state.optimizer.load_flat_state_dict, state.optimizer, ot, om, "optim.")
    if not ook then error("checkpoint.load: " .. path .. ": " .. tostring(oerr), 2) end
  end
  if state.rng ~= false and meta["rng.seed"] then
    engine.set_rng_state({ seed = parse_int(meta["rng.seed"], "rng.seed"),
      offset = parse_int(meta["rng.offset"], "rng.offset") })
  end
  if state.sampler then
    local st = {}
    for k, v in pairs(meta) do
      local sk = k:match("^sampler%.(.+)$")
      if sk then st[sk] = parse_value(v) end
    end
    if next(st) == nil then error("checkpoint.load: " .. path .. " has no sampler state", 2) end
    state.sampler:set_state(st)
  end
  if state.scheduler then
    local st = {}
    for k, v in pairs(meta) do
      local sk = k:match("^scheduler%.(.+)$")
      if sk then st[sk] = parse_value(v) end
    end
    state.scheduler:load_state_dict(st)
  end
  local extra = {}
  for k, v in pairs(meta) do
    local ek = k:match("^extra%.(.+)$")
    if ek then extra[ek] = parse_value(v) end
  end
  return { step = parse_int(meta.step or "0", "step"), extra = extra, meta = meta }
end

return M
