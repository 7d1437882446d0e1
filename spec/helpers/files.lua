-- spec/helpers/files.lua: the small file and text helpers several specs need.
local M = {}

-- read(path) -> the file's bytes, or nil when it cannot be opened
function M.read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

-- must_read(path) -> the file's bytes; an error naming the file when it cannot be opened
function M.must_read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

-- write(path, s): the file's whole content
function M.write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

-- count(s, sub) -> how many times sub occurs in s (plain text, not overlapping)
function M.count(s, sub)
  local n, i = 0, 1
  while true do
    local a, b = s:find(sub, i, true)
    if not a then return n end
    n, i = n + 1, b + 1
  end
end

return M
