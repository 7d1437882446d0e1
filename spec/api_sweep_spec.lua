-- A random sweep of the public Lua API (issue 26; the sweep itself: spec/fuzz/api_sweep.lua): a fixed budget of
-- seeded calls in make test, in the Release build and again in the ASan+UBSan stage; tools/fuzz.sh runs it
-- longer (make fuzz).  Every call returns or raises a string error naming its operation; a failure prints the
-- seed, the call number and the call, and `build/engine spec/fuzz/api_sweep.lua SEED 1 CALL` replays it alone.
-- ENGINE_SWEEP_CALLS changes the budget per seed (default 10000; the seeds are 1 to 6).
package.path = "./?.lua;" .. package.path
local sweep = require("spec.fuzz.api_sweep")

describe("API sweep", function()
  local calls = tonumber(os.getenv("ENGINE_SWEEP_CALLS") or "") or 10000
  for seed = 1, 6 do
    it(string.format("seed %d: %d random calls return or raise an error naming the operation", seed, calls), function()
      local res = sweep.run{ seed = seed, calls = calls, log = function() end }
      assert(#res.failures == 0, string.format("%d of %d calls failed (seed %d):\n%s", #res.failures, res.calls, seed,
        table.concat(res.failures, "\n")))
      assert.is_true(res.ok > calls / 10, "too few calls succeeded: the sweep no longer reaches the ops")
    end)
  end
end)
