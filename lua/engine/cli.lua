-- engine.cli: the command line and config files of every recipe and tool, on Debian's lua-argparse.
--
--   local cli = require("engine.cli")
--   local o, given = cli.parse(arg, {
--     name = "gpt", description = "A byte-level GPT trained on the King James Bible.",
--     options = {
--       { "steps", 600, "optimizer steps", group = "training", int = true, min = 1 },
--       { "lr", 2e-3, "peak learning rate", min = 0 },
--       { "device", "cpu", "where the model runs", choices = { "cpu", "cuda" } },
--       { "compile", false, "a boolean: --compile, --compile=true|false|1|0, --compile false" },
--     },
--     arguments = { { "runs", "run folders", args = "+" } },   -- positional arguments (argparse's args: "?",
--                                                                 -- "*", "+", N), given as lists when several
--     config = true,        -- adds --config FILE (a .lua, .json or .toml file of option values)
--   })
--
-- Each option's type comes from its default (number, string, boolean).  The command line takes --key=value and
-- --key value; --help (-h) lists every option with its default and meaning, in groups; an unknown option gets
-- "Did you mean ...?"; a bad value names the option and what it must be.  Values come from the defaults, then the
-- config file, then the command line (which wins).  `given` is the set of keys the config file or the command
-- line set.
--
-- Errors: cli.parse raises a Lua error whose message is the whole usage message (so a spec running a recipe in
-- its own process can match it).  Run as a script by the engine host, such an error (and --help) is not a
-- crash: the host prints it once, on rank 0, without a traceback, and every rank exits with status 2 (0 for
-- --help) when all ranks agree (a deterministic usage error; otherwise the job is aborted as for any error).
-- cli.usage_error(name, fmt, ...) raises the same kind of error for a recipe's own checks of its options.
local M = {}

local argparse_ok, argparse = pcall(require, "argparse")

-- ------------------------------------------------------------------ quiet usage errors
-- The messages raised as usage errors (with their exit code and stream), read by the host's error hook.
local usage = setmetatable({}, { __mode = "k" })
local last_usage = nil

local function raise(msg, code, stream)
  last_usage = { msg = msg, code = code or 2, stream = stream or "stderr" }
  error(msg, 0)
end

-- The host calls __engine_error_hook(msg) for an error that ends a script: a usage error gives its exit code
-- and stream (it is then printed once, without a traceback); anything else gives nil.
rawset(_G, "__engine_error_hook", function(msg)
  if last_usage and msg == last_usage.msg then return last_usage.code, last_usage.stream end
  return nil
end)

-- fail(msg [, code = 1]): raises msg as an error every rank reaches alike (a run that cannot go on, e.g. a diverged
-- loss that all ranks see): printed once by rank 0, without a traceback, every rank exiting with code
function M.fail(msg, code) raise(msg, code or 1) end

-- usage_error(name, fmt, ...): raises "name: <message>" as a usage error
function M.usage_error(name, fmt, ...)
  local msg = select("#", ...) > 0 and string.format(fmt, ...) or fmt
  raise((name and name ~= "" and (name .. ": ") or "") .. msg .. "\n(--help lists the options)", 2)
end

-- ------------------------------------------------------------------ helpers
local function levenshtein(a, b)
  local la, lb = #a, #b
  local prev, cur = {}, {}
  for j = 0, lb do prev[j] = j end
  for i = 1, la do
    cur[0] = i
    for j = 1, lb do
      local cost = a:byte(i) == b:byte(j) and 0 or 1
      cur[j] = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
    end
    prev, cur = cur, prev
  end
  return prev[lb]
end

-- suggest(word, names) -> the closest name (edit distance at most max(2, #word / 3)), or nil
function M.suggest(word, names)
  local best, bd = nil, math.max(2, math.floor(#word / 3)) + 1
  for _, n in ipairs(names) do
    local d = levenshtein(word, n)
    if d < bd then best, bd = n, d end
  end
  return best
end

local function show(v)
  if type(v) == "string" then return v == "" and '""' or v end
  return tostring(v)
end

local function kind_of(opt)
  local d = opt[2]
  local t = type(d)
  if t ~= "number" and t ~= "string" and t ~= "boolean" then
    error(string.format("cli: option '%s': the default must be a number, string or boolean, got %s", tostring(opt[1]),
      t), 3)
  end
  return t
end

-- convert(opt, raw, where) -> the typed value of a string (command line) or a value (config file), or raises
local function convert(name, opt, raw, where)
  local key, kind = opt[1], kind_of(opt)
  local function bad(what)
    M.usage_error(name, "%s--%s must be %s, got '%s'", where ~= "" and (where .. " ") or "", key, what, tostring(raw))
  end
  local v = raw
  if kind == "number" then
    v = tonumber(raw)
    if v == nil or v ~= v then bad("a number") end
    if opt.int and v % 1 ~= 0 then bad("an integer") end
    if opt.min and v < opt.min then bad((opt.int and "an integer" or "a number") .. " >= " .. opt.min) end
    if opt.max and v > opt.max then bad((opt.int and "an integer" or "a number") .. " <= " .. opt.max) end
  elseif kind == "boolean" then
    if type(raw) ~= "boolean" then
      local s = tostring(raw):lower()
      if s == "true" or s == "1" or s == "yes" then v = true
      elseif s == "false" or s == "0" or s == "no" then v = false
      else bad("true or false (1 or 0)") end
    end
  else
    if type(raw) ~= "string" then
      if type(raw) == "number" then v = tostring(raw) else bad("a string") end
    end
  end
  if opt.choices then
    local ok = false
    for _, c in ipairs(opt.choices) do if c == v then ok = true end end
    if not ok then
      local cs = {}
      for i, c in ipairs(opt.choices) do cs[i] = show(c) end
      bad("one of " .. table.concat(cs, ", "))
    end
  end
  return v
end

-- ------------------------------------------------------------------ config files
-- A minimal TOML: key = value lines (strings "..." or '...', numbers, true/false), comments, blank lines;
-- [tables] are not options and are refused.
local function parse_toml(text, path)
  local t = {}
  local n = 0
  for line in (text .. "\n"):gmatch("([^\n]*)\n") do
    n = n + 1
    local s = line:gsub("^%s+", ""):gsub("%s+$", "")
    if s ~= "" and s:sub(1, 1) ~= "#" then
      if s:sub(1, 1) == "[" then error(string.format("%s:%d: TOML tables are not options: %s", path, n, s), 0) end
      local k, v = s:match("^([%w_%-]+)%s*=%s*(.-)$")
      if not k then error(string.format("%s:%d: expected key = value, got: %s", path, n, s), 0) end
      local val
      local q = v:match('^"(.-)"%s*$') or v:match("^'(.-)'%s*$")
      if q then val = q:gsub('\\"', '"'):gsub("\\\\", "\\")
      else
        v = v:gsub("%s*#.*$", "")
        if v == "true" then val = true elseif v == "false" then val = false
        else val = tonumber((v:gsub("_", ""))) end
        if val == nil then error(string.format("%s:%d: bad value for %s: %s", path, n, k, v), 0) end
      end
      t[k] = val
    end
  end
  return t
end

-- load_config(path) -> the table of option values of a config file: .lua (a chunk returning a table, or setting
-- globals `key = value` in an empty environment), .json (an object) or .toml
function M.load_config(path, name)
  local f = io.open(path, "rb")
  if not f then M.usage_error(name, "--config: cannot open %s", path) end
  local text = f:read("*a")
  f:close()
  local ok, t
  if path:match("%.json$") then
    ok, t = pcall(require("engine.json").decode, text)
  elseif path:match("%.toml$") then
    ok, t = pcall(parse_toml, text, path)
  elseif path:match("%.lua$") then
    local env = {}
    local chunk, err = loadstring(text, "@" .. path)
    if not chunk then ok, t = false, err
    else
      setfenv(chunk, env)
      ok, t = pcall(chunk)
      if ok and t == nil then t = env end
    end
  else
    M.usage_error(name, "--config: %s: expected a .lua, .json or .toml file", path)
  end
  if not ok then M.usage_error(name, "--config: %s", tostring(t)) end
  if type(t) ~= "table" then M.usage_error(name, "--config: %s must give a table of option values", path) end
  return t
end

-- ------------------------------------------------------------------ parse
local function options_of(spec)
  local list, by = {}, {}
  for _, opt in ipairs(spec.options or {}) do
    local key = opt[1]
    if type(key) ~= "string" or not key:match("^[%a][%w_]*$") then
      error("cli: bad option name " .. tostring(key), 3)
    end
    kind_of(opt)
    if by[key] then
      -- a later entry replaces an earlier one (a recipe changes a shared option's default)
      for i, o2 in ipairs(list) do if o2[1] == key then list[i] = opt end end
    else
      list[#list + 1] = opt
    end
    by[key] = opt
  end
  return list, by
end

-- build(spec) -> an argparse parser of the spec's options
local function build(spec, list)
  local p = argparse(spec.name or "script", spec.description)
  p:help_max_width(100)
  if spec.epilog then p:epilog(spec.epilog) end
  p:add_help(false)
  local groups, order = {}, {}
  local function add(grp, el)
    if not groups[grp] then groups[grp] = {}; order[#order + 1] = grp end
    table.insert(groups[grp], el)
  end
  for _, opt in ipairs(list) do
    local key, default, help = opt[1], opt[2], opt[3] or ""
    local kind = type(default)
    local meta = kind == "number" and (opt.int and "N" or "X") or kind == "boolean" and "BOOL" or "S"
    if opt.choices then
      local cs = {}
      for i, c in ipairs(opt.choices) do cs[i] = show(c) end
      meta = table.concat(cs, "|")
    end
    local text = help .. " (default: " .. show(default) .. ")"
    -- (a boolean also stands alone: --compile is --compile=true)
    local el = p:option("--" .. key, text):argname(kind == "boolean" and "<BOOL>" or ("<" .. meta .. ">"))
      :args(kind == "boolean" and "?" or 1):count("0-1")
    add(opt.group or "options", el)
  end
  if spec.config then
    add("run", p:option("--config", "a file of option values (.lua, .json or .toml); the command line overrides it")
      :argname("<FILE>"):args(1):count("0-1"))
  end
  for _, a in ipairs(spec.arguments or {}) do
    local el = p:argument(a[1], a[2])
    if a.args then el:args(a.args) end
    if a.choices then el:choices(a.choices) end
  end
  add("help", p:flag("-h --help", "show this help and exit"))
  for _, g in ipairs(order) do
    local title = g:sub(1, 1):upper() .. g:sub(2)
    p:group(title, unpack(groups[g]))
  end
  return p
end

-- help(spec) -> the help text
function M.help(spec)
  if not argparse_ok then return (spec.name or "script") .. ": lua-argparse is not installed" end
  local list = options_of(spec)
  return build(spec, list):get_help()
end

-- parse(argv, spec) -> o, given (see the header)
function M.parse(argv, spec)
  if type(spec) ~= "table" then error("cli.parse: expected a spec table", 2) end
  for k in pairs(spec) do
    if k ~= "name" and k ~= "description" and k ~= "epilog" and k ~= "options" and k ~= "config" and k ~= "arguments"
    then
      error("cli.parse: unknown spec field '" .. tostring(k) .. "' (fields: name, description, epilog, options, "
        .. "arguments, config)", 2)
    end
  end
  local name = spec.name or "script"
  if not argparse_ok then
    error(name .. ": the command line needs lua-argparse (Debian package lua-argparse; tools/install-deps.sh)", 0)
  end
  local list, by = options_of(spec)
  local args = {}
  for i = 1, #(argv or {}) do args[i] = argv[i] end
  -- --help anywhere wins (argparse would first complain about another argument)
  for _, a in ipairs(args) do
    if a == "--help" or a == "-h" then raise(build(spec, list):get_help(), 0, "stdout") end
  end
  -- a stray word (e.g. steps=3) where only options are taken: say so plainly (argparse says "too many arguments")
  if not spec.arguments or #spec.arguments == 0 then
    local i = 1
    while i <= #args do
      local a = args[i]
      if a:sub(1, 2) == "--" then
        if not a:find("=", 1, true) and (by[a:sub(3)] or a == "--config") then i = i + 1 end
      elseif a:sub(1, 1) ~= "-" then
        raise(string.format("%s: unexpected argument '%s' (options are --key=value or --key value)\n(--help lists "
          .. "the options)", name, a), 2)
      end
      i = i + 1
    end
  end
  local p = build(spec, list)
  local ok, r = p:pparse(args)
  if not ok then
    raise(name .. ": " .. r .. "\n(--help lists the options)", 2)
  end
  local o, given = {}, {}
  for _, opt in ipairs(list) do o[opt[1]] = opt[2] end
  if spec.config and r.config then
    local t = M.load_config(r.config, name)
    local keys = {}
    for k in pairs(t) do keys[#keys + 1] = k end
    table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
    for _, k in ipairs(keys) do
      local opt = by[k]
      if not opt then
        local names = {}
        for _, o2 in ipairs(list) do names[#names + 1] = o2[1] end
        local s = type(k) == "string" and M.suggest(k, names)
        M.usage_error(name, "--config %s: unknown option '%s'%s", r.config, tostring(k),
          s and ("\nDid you mean '" .. s .. "'?") or "")
      end
      o[k] = convert(name, opt, t[k], "in " .. r.config .. ":")
      given[k] = "config"
    end
    o.config = r.config
  end
  for _, a in ipairs(spec.arguments or {}) do o[a[1]] = r[a[1]] end
  for _, opt in ipairs(list) do
    local v = r[opt[1]]
    if type(v) == "table" then v = #v == 0 and true or v[1] end   -- a boolean's optional value
    if v ~= nil then
      o[opt[1]] = convert(name, opt, v, "")
      given[opt[1]] = "cli"
    end
  end
  for _, opt in ipairs(list) do
    if opt.check then
      local err = opt.check(o[opt[1]], o)
      if err then M.usage_error(name, "--%s=%s: %s", opt[1], show(o[opt[1]]), err) end
    end
  end
  return o, given
end

-- save_config(path, o [, extra]): the resolved options as JSON (sorted keys), with the extra fields
function M.save_config(path, o, extra)
  require("engine.json").write_file(path, M.config_table(o, extra))
end

-- config_table(o [, extra]) -> the option values of o (numbers, strings, booleans: what a recipe added to o
-- besides, such as a tokenizer object, is left out) and the extra fields
function M.config_table(o, extra)
  local t = {}
  for k, v in pairs(o) do
    local tv = type(v)
    if type(k) == "string" and (tv == "number" or tv == "string" or tv == "boolean") then t[k] = v end
  end
  for k, v in pairs(extra or {}) do t[k] = v end
  return t
end

return M
