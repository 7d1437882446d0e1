-- spec/helpers/errors.lua: catching and reading error messages in specs.
local M = {}

-- The error message of f(...); fails the spec when f returns.
function M.err_of(f, ...)
  local ok, e = pcall(f, ...)
  assert(not ok, "expected an error, got " .. tostring(e))
  return tostring(e)
end

-- Fails unless every string (plain text, not a pattern) is in msg.
function M.has(msg, ...)
  for _, s in ipairs({ ... }) do
    assert(msg:find(s, 1, true), string.format("expected %q in the message: %s", s, msg))
  end
end

-- err(fn, ...): fn() raises an error whose message holds every string (plain text); returns the message.
function M.err(fn, ...)
  local msg = M.err_of(fn)
  M.has(msg, ...)
  return msg
end

return M
