-- busted output handler for multi-process specs (spec/dist under mpirun).
--
-- Rank 0 prints the usual plain-terminal output; the other ranks print only
-- their failures and errors, prefixed with their rank.  At the end the ranks
-- merge their results per test, in run order (a test fails if it failed on any
-- rank, is skipped if it was pending on any rank, passes otherwise; errors
-- outside tests count as failures on each rank that had them), and rank 0
-- prints "N passed, N failed, N skipped" and writes the same three numbers to
-- "$ENGINE_SUMMARY_DIR/merged" for tools/run-tests.sh.  Then MPI is
-- finalized on every rank, so a rank with failures can exit non-zero without
-- hanging or aborting the others.
--
-- The ranks must define the same tests in the same order.  They meet at the
-- end of every test (a small all-reduce), so they stay in step.  A rank whose
-- test failed waits at most ENGINE_DIST_FAIL_WAIT seconds (default 10) there:
-- if the others do not arrive (they wait in a collective the failing rank
-- skipped), it prints why and aborts the job instead of letting it hang.
-- A watchdog covers every spec file and test: a rank that does not finish one
-- within ENGINE_DIST_TEST_TIMEOUT seconds (default 120; a collective that
-- never matches) prints what it was doing and its recent collectives and
-- exits, and mpirun stops the job.
return function(options)
  local busted = require("busted")
  local engine = require("engine")
  local dist = engine.distributed
  local C = engine.C
  local rank, world = dist.rank(), dist.world_size()
  local timeout = tonumber(os.getenv("ENGINE_DIST_TEST_TIMEOUT") or "") or 120
  local fail_wait = math.min(tonumber(os.getenv("ENGINE_DIST_FAIL_WAIT") or "") or 10, timeout / 2)
  local sync_buf = engine.ffi.new("int64_t[2]")

  local handler
  if rank == 0 then
    handler = require("busted.outputHandlers.plainTerminal")(options)
  else
    handler = require("busted.outputHandlers.base")()
  end

  local statuses = {} -- per test in run order: 0 passed, 1 pending, 2 failed
  local outside_errors = 0
  local code = { success = 0, pending = 1, failure = 2, error = 2 }

  local function label(element)
    local name = handler.getFullName and handler.getFullName(element) or (element and element.name) or "?"
    local src = element and element.trace and element.trace.short_src
    return src and (src .. ": " .. name) or name
  end

  local function failure_text(f, what)
    local t = f.element and f.element.trace
    local where = t and t.short_src and (t.short_src .. " @ " .. tostring(t.currentline)) or "?"
    local msg = type(f.message) == "string" and f.message or require("pl.pretty").write(f.message)
    return string.format("\n[rank %d] %s -> %s\n%s\n%s\n", rank, what, where, tostring(f.name), tostring(msg))
  end

  busted.subscribe({ "file", "start" }, function(file)
    dist.watchdog(timeout, "loading spec file " .. tostring(file and file.name))
    return nil, true
  end)
  busted.subscribe({ "file", "end" }, function()
    dist.watchdog_disarm()
    return nil, true
  end)
  busted.subscribe({ "test", "start" }, function(element)
    dist.watchdog(timeout, "test " .. label(element))
    return nil, true
  end)
  busted.subscribe({ "test", "end" }, function(element, parent, status)
    local s = code[status] or 2
    statuses[#statuses + 1] = s
    -- meet the other ranks at the end of the test
    sync_buf[0], sync_buf[1] = s == 2 and 1 or 0, #statuses
    local rc = C.eng_dist_allreduce_counts_timeout(sync_buf, 2, s == 2 and fail_wait or timeout)
    if rc == 1 then
      local last = (#handler.failures > 0 or #handler.errors > 0) and s == 2 and
        (handler.errors[#handler.errors] or handler.failures[#handler.failures])
      if last then io.stderr:write(failure_text(last, "Failure")) end
      io.stderr:write(string.format("\n[rank %d] the other ranks did not reach the end of test '%s' within %g s%s. " ..
        "Aborting the job.\n%s", rank, label(element), s == 2 and fail_wait or timeout,
        s == 2 and " after it failed on this rank (they probably wait in a collective this rank skipped)" or "",
        engine.ffi.string(C.eng_comm_history_format(8))))
      dist.abort(4)
    elseif world > 1 and rc == 0 and sync_buf[1] ~= #statuses * world then
      io.stderr:write(string.format("\n[rank %d] the ranks are out of step after test '%s' (they must define the " ..
        "same tests in the same order). Aborting the job.\n", rank, label(element)))
      dist.abort(4)
    end
    dist.watchdog(timeout, "after test " .. label(element))
    return nil, true
  end)
  local function outside(element, parent, message)
    outside_errors = outside_errors + 1
    if rank ~= 0 then
      io.write(string.format("\n[rank %d] Error -> %s\n%s\n", rank, label(element), tostring(message)))
      io.flush()
    end
    return nil, true
  end
  for _, kind in ipairs({ "error", "failure" }) do
    for _, where in ipairs({ "file", "describe" }) do busted.subscribe({ kind, where }, outside) end
  end

  busted.subscribe({ "suite", "end" }, function()
    dist.watchdog(timeout, "merging the test results of all ranks")
    if rank ~= 0 then
      for _, f in ipairs(handler.failures) do io.write(failure_text(f, "Failure")) end
      for _, f in ipairs(handler.errors) do
        if f.element and f.element.descriptor == "it" then io.write(failure_text(f, "Error")) end
      end
      io.flush()
    end
    -- Do all ranks have the same number of tests?  Then merge per test.
    local n = #statuses
    local mm = dist.allreduce_counts({ n, -n })
    local passed, failed, skipped
    if world > 1 and mm[1] == n * world and -mm[2] == n * world then
      local buf = engine.ffi.new("int64_t[?]", 3 * n + 1)
      -- one-hot per test: sums tell whether any rank failed or skipped it
      for i = 1, n do
        local s = statuses[i]
        buf[3 * (i - 1) + s] = 1
      end
      buf[3 * n] = outside_errors
      if C.eng_dist_allreduce_counts(buf, 3 * n + 1) ~= 0 then error(engine.ffi.string(C.eng_last_error())) end
      passed, failed, skipped = 0, 0, 0
      for i = 1, n do
        local f, p = buf[3 * (i - 1) + 2], buf[3 * (i - 1) + 1]
        if f > 0 then failed = failed + 1 elseif p > 0 then skipped = skipped + 1 else passed = passed + 1 end
      end
      failed = failed + tonumber(buf[3 * n])
    else
      -- different test lists on different ranks: add everything up
      local s, f, p = 0, 0, 0
      for i = 1, n do
        if statuses[i] == 0 then s = s + 1 elseif statuses[i] == 1 then p = p + 1 else f = f + 1 end
      end
      local r = dist.allreduce_counts({ s, f + outside_errors, p })
      passed, failed, skipped = r[1], r[2], r[3]
      if world > 1 and rank == 0 then
        io.write("\n(the ranks ran different numbers of tests; counts are summed over ranks)\n")
      end
    end
    if rank == 0 then
      io.write(string.format("\n%d passed, %d failed, %d skipped\n", passed, failed, skipped))
      io.flush()
      local dir = os.getenv("ENGINE_SUMMARY_DIR")
      if dir and dir ~= "" then
        local fh = io.open(dir .. "/merged", "w")
        if fh then fh:write(string.format("%d %d %d\n", passed, failed, skipped)); fh:close() end
      end
      local single = os.getenv("ENGINE_SUMMARY_FILE")
      if single and single ~= "" then
        local fh = io.open(single, "w")
        if fh then fh:write(string.format("%d %d %d\n", passed, failed, skipped)); fh:close() end
      end
    end
    -- rank 0 has written the summary before anyone leaves
    dist.allreduce_counts({ 0 })
    dist.watchdog_disarm()
    io.stdout:flush()
    io.stderr:flush()
    dist.finalize()
    return nil, true
  end)
  return handler
end
