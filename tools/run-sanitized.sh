#!/usr/bin/env bash
# Runs the C-level tests, the single-process specs and the multi-process specs (2 ranks) on an
# ASan+UBSan build (cmake -DENGINE_SANITIZE=ON; `make sanitize` builds it), with the sanitizer runtime
# preloaded into the LuaJIT host.  Any sanitizer report stops the process and fails the run.
# Ends with "N passed, N failed, N skipped", like tools/run-tests.sh (which runs this same stage
# after the main suite when given --sanitize DIR, as `make test` does).
# Usage: tools/run-sanitized.sh [build-asan]
exec "$(dirname "$0")/run-tests.sh" --sanitize-only "${1:-build-asan}"
