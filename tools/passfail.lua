-- busted output handler: the plain terminal output, then one closing line
-- "N passed, N failed, N skipped" (errors count as failures) that CI reads.
-- With ENGINE_SUMMARY_FILE set, the counts are also written there so the
-- test runner can add up several busted runs.
return function(options)
  local busted = require("busted")
  local handler = require("busted.outputHandlers.plainTerminal")(options)
  busted.subscribe({ "suite", "end" }, function()
    local s, f, e, p = #handler.successes, #handler.failures, #handler.errors, #handler.pendings
    io.write(string.format("\n%d passed, %d failed, %d skipped\n", s, f + e, p))
    io.flush()
    local path = os.getenv("ENGINE_SUMMARY_FILE")
    if path then
      local fh = io.open(path, "w")
      if fh then fh:write(string.format("%d %d %d\n", s, f + e, p)); fh:close() end
    end
    return nil, true
  end)
  return handler
end
