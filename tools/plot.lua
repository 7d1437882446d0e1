-- tools/plot.lua: the loss and throughput curves of one or several runs (their metrics.jsonl) to a PNG, through
-- gnuplot.
--
--   build/engine tools/plot.lua runs/gpt-20261128-014530                   # -> runs/gpt-.../plot.png
--   build/engine tools/plot.lua runs/a runs/b --out=compare.png --x=time   # two runs on the same axes
--   make plot RUNS="runs/a runs/b"
--
-- Three panels: the training loss (and the validation loss, as points) against the step (or the time with
-- --x=time), the tokens/s, and the learning rate.  A run is a run folder (or a metrics.jsonl file); its label is
-- the folder's name.
local cli = require("engine.cli")
local run = require("engine.run")
local NAME = "plot"

local o = cli.parse(arg or {}, { name = NAME,
  description = "Draws the loss, throughput and learning-rate curves of runs (run folders with a metrics.jsonl) "
    .. "to a PNG with gnuplot.",
  arguments = { { "runs", "run folders (or metrics.jsonl files)", args = "+" } },
  options = {
    { "out", "", "the PNG; default <first run>/plot.png" },
    { "x", "step", "the x axis: step or time (seconds since the run started)", choices = { "step", "time" } },
    { "width", 1000, "pixels", int = true, min = 200 },
    { "height", 900, "pixels", int = true, min = 200 },
    { "title", "", "the title; default the run names" },
  } })

if os.execute("command -v gnuplot >/dev/null 2>&1") ~= 0 then
  cli.usage_error(NAME, "gnuplot is not installed (Debian: apt-get install gnuplot-nox; tools/install-deps.sh)")
end

local function label_of(path)
  local p = path:gsub("/metrics%.jsonl$", ""):gsub("/+$", "")
  return p:match("([^/]+)$") or p
end

local tmp = os.tmpname()
os.remove(tmp)
os.execute("mkdir -p '" .. tmp .. "'")
local series = {}
for i, path in ipairs(o.runs) do
  local ok, rows = pcall(run.read_metrics, path)
  if not ok then cli.usage_error(NAME, "%s", tostring(rows):gsub("^read_metrics: ", "")) end
  local train, val = {}, {}
  for _, r in ipairs(rows) do
    local x = o.x == "time" and r.time_s or r.step
    if type(x) == "number" then
      if type(r.loss) == "number" then
        train[#train + 1] = string.format("%.10g %.10g %.10g %.10g", x, r.loss, tonumber(r.tokens_per_s) or 0,
          tonumber(r.lr) or 0)
      end
      if type(r.val_loss) == "number" then val[#val + 1] = string.format("%.10g %.10g", x, r.val_loss) end
    end
  end
  if #train == 0 and #val == 0 then cli.usage_error(NAME, "%s has no loss rows", path) end
  local tf, vf = string.format("%s/train%d.dat", tmp, i), string.format("%s/val%d.dat", tmp, i)
  local f = io.open(tf, "w"); f:write(table.concat(train, "\n"), "\n"); f:close()
  f = io.open(vf, "w"); f:write(table.concat(val, "\n"), "\n"); f:close()
  series[i] = { label = label_of(path):gsub("_", "\\\\_"), train = tf, val = vf, ntrain = #train, nval = #val }
end

local out = o.out ~= "" and o.out or ((o.runs[1]:match("%.jsonl$") and o.runs[1]:gsub("/?[^/]*$", "") or o.runs[1])
  .. "/plot.png")
local title = o.title ~= "" and o.title or table.concat((function()
  local t = {}
  for i, s in ipairs(series) do t[i] = s.label end
  return t
end)(), ", ")
local xlabel = o.x == "time" and "time (s)" or "step"

local function plots(col, with_val)
  local parts = {}
  for i, s in ipairs(series) do
    if s.ntrain > 0 then
      parts[#parts + 1] = string.format("'%s' using 1:%d with lines lw 2 lc %d title '%s%s'", s.train, col, i,
        s.label, with_val and " train" or "")
    end
    if with_val and s.nval > 0 then
      parts[#parts + 1] = string.format("'%s' using 1:2 with linespoints pt 7 ps 0.8 dt 2 lc %d title '%s val'",
        s.val, i, s.label)
    end
  end
  return table.concat(parts, ", ")
end

local script = {
  string.format("set terminal pngcairo size %d,%d enhanced font 'sans,10'", o.width, o.height),
  string.format("set output '%s'", out:gsub("'", "''")),
  "set grid", "set key outside right top",
  string.format("set multiplot layout 3,1 title '%s'", title:gsub("'", "''")),
  string.format("set xlabel '%s'", xlabel), "set ylabel 'loss'",
  "plot " .. plots(2, true),
  "set ylabel 'tokens/s'",
  "plot " .. plots(3, false),
  "set ylabel 'learning rate'", "set format y '%.1e'",
  "plot " .. plots(4, false),
  "unset multiplot",
}
local has_train = false
for _, s in ipairs(series) do if s.ntrain > 0 then has_train = true end end
if not has_train then -- validation only
  script = { script[1], script[2], "set grid", string.format("set xlabel '%s'", xlabel), "set ylabel 'val loss'",
    "plot " .. plots(2, true):gsub("[^,]*train[^,]*,? ?", "") }
end
local gp = tmp .. "/plot.gp"
local f = io.open(gp, "w"); f:write(table.concat(script, "\n"), "\n"); f:close()
local rc = os.execute("gnuplot '" .. gp .. "' 2>'" .. tmp .. "/err'")
local ef = io.open(tmp .. "/err")
local err = ef and ef:read("*a") or ""
if ef then ef:close() end
os.execute("rm -rf '" .. tmp .. "'")
if rc ~= 0 then error("plot: gnuplot failed: " .. err, 0) end
print(string.format("plot: %d run(s) -> %s", #series, out))
