-- Helpers for the recipe specs (spec/dist/*_recipe_spec.lua): run a recipe in this process and collect the
-- losses rank 0 printed; make a run's own small token shards (the suite does not need data/).
local engine = require("engine")
local dist = engine.distributed

local M = {}

-- run(file, argv, nsteps) -> the per-step training losses rank 0 printed (on every rank: all-reduced, other
-- ranks contribute 0) and the printed lines.  The recipe runs in the global environment (busted insulates the
-- spec's), with print captured and `arg` set to argv.
function M.run(file, argv, nsteps)
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

return M
