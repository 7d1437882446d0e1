#!/usr/bin/env bash
# Runs the libFuzzer targets of spec/fuzz (built by `make fuzz-build` into FUZZ_BUILD/fuzz) one after the
# other, each for SECONDS, starting from its committed seed corpus spec/fuzz/corpus/<name>.
#
#   tools/fuzz.sh [FUZZ_BUILD] [SECONDS] [--test] [TARGET...]
#
# Default: a campaign (make fuzz, FUZZ_SECONDS=SECONDS, default 60): new inputs go to FUZZ_BUILD/corpus/<name>
# (kept between runs), crashes to FUZZ_BUILD/artifacts/; prints each target's executions and the last line
# "fuzz: N targets, E executions, N crashed".  --test (tools/run-tests.sh): the committed corpus read-only, new
# inputs into a temporary folder, and the last line "N passed, N failed, N skipped".  Without clang's libFuzzer
# or the fuzz build each target is skipped with the reason.
#
# Lua targets (no libFuzzer; run by the engine host: build-asan/engine with the sanitizer runtime preloaded when
# it is built, else build/engine): spec/fuzz/fuzz_*.lua (fuzz_dcp_metadata: the dist.checkpoint metadata reader
# written in Lua, mutating spec/fuzz/corpus/dcp_metadata with a seeded PRNG; --test: one fixed pass), and in a
# campaign only, api_sweep (spec/fuzz/api_sweep.lua: random calls of the whole Lua API for SECONDS; make test
# runs a fixed budget of it as spec/api_sweep_spec.lua).  ENGINE_FUZZ_SEED sets their seed (default: a fresh
# one per campaign, printed; 1 under --test).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
FB=build-fuzz; SECS=""; TEST=0; ONLY=()
for a in "$@"; do
  case "$a" in
    --test) TEST=1 ;;
    [0-9]*) SECS=$a ;;
    fuzz_*|api_sweep) ONLY+=("$a") ;;
    *) FB=$a ;;
  esac
done
[ -z "$SECS" ] && { [ "$TEST" = 1 ] && SECS=3 || SECS=60; }
TARGETS=()
for src in spec/fuzz/fuzz_*.c; do
  n=$(basename "$src" .c)
  if [ ${#ONLY[@]} -gt 0 ]; then case " ${ONLY[*]} " in *" $n "*) ;; *) continue ;; esac; fi
  TARGETS+=("$n")
done
passed=0; failed=0; skipped=0; total=0
why=""
if [ ! -d "$FB/fuzz" ]; then
  if ! command -v clang >/dev/null 2>&1; then why="clang is not installed (tools/install-deps.sh installs clang and libclang-rt-dev)"
  elif [ ! -f "$(clang -print-file-name=libclang_rt.fuzzer-x86_64.a 2>/dev/null)" ] &&
       ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
    why="clang's libFuzzer runtime is missing (Debian package libclang-rt-dev)"
  else why="no fuzz build in $FB (make fuzz-build)"; fi
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
for n in "${TARGETS[@]}"; do
  name=${n#fuzz_}
  bin="$FB/fuzz/$n"
  if [ -n "$why" ] || [ ! -x "$bin" ]; then
    echo "fuzz $name: skipped: ${why:-$bin not built (make fuzz-build)}"; skipped=$((skipped + 1)); continue
  fi
  dict=()
  [ -f "spec/fuzz/$name.dict" ] && dict=(-dict="spec/fuzz/$name.dict")
  case $name in safetensors|checkpoint_meta) dict=(-dict=spec/fuzz/json.dict) ;; esac
  if [ "$TEST" = 1 ]; then work="$TMP/$name"; else work="$FB/corpus/$name"; fi
  art="$FB/artifacts/"
  mkdir -p "$work" "$art"
  log="$TMP/$name.log"
  # ASan/UBSan as in the sanitizer stage; libFuzzer's own leak check stays on
  ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1} UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
    "$bin" "${dict[@]}" -max_total_time="$SECS" -timeout=25 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$art" "$work" "spec/fuzz/corpus/$name" > "$log" 2>&1
  rc=$?
  runs=$(grep -E '^stat::number_of_executed_units:' "$log" | awk '{print $2}' | tail -1)
  runs=${runs:-0}
  total=$((total + runs))
  if [ $rc -eq 0 ]; then
    echo "fuzz $name: $runs executions in ${SECS}s, no crash ($(grep -E '^#[0-9]+.*DONE' "$log" | sed -E 's/.*(cov: [0-9]+).*(corp: [^ ]+).*/\1, \2/' | tail -1))"
    passed=$((passed + 1))
  else
    echo "fuzz $name: FAILED (rc=$rc) after $runs executions; the report:"
    grep -vE '^(INFO|#[0-9]+|MS:|Loaded|stat::)' "$log" | head -40
    ls -1 "$art" 2>/dev/null | grep -E '^(crash|leak|timeout|oom|slow-unit)-' | sed "s|^|  artifact: $art|"
    failed=$((failed + 1))
  fi
done
# Lua targets
LUA_TARGETS=()
for src in spec/fuzz/fuzz_*.lua; do [ -f "$src" ] && LUA_TARGETS+=("$(basename "$src" .lua)"); done
[ "$TEST" = 0 ] && LUA_TARGETS+=(api_sweep)
if [ ${#ONLY[@]} -gt 0 ]; then
  sel=(); for n in "${LUA_TARGETS[@]}"; do case " ${ONLY[*]} " in *" $n "*) sel+=("$n") ;; esac; done
  LUA_TARGETS=("${sel[@]+"${sel[@]}"}")
fi
if [ -x build-asan/engine ]; then
  LENGINE=(env LD_PRELOAD="$(gcc -print-file-name=libasan.so)"
    ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:max_allocation_size_mb=4096}"
    UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}" build-asan/engine)
  lwhy=""; LMEM=""          # (ASan reserves terabytes of address space: no ulimit -v under it)
elif [ -x build/engine ]; then LENGINE=(build/engine); lwhy=""; LMEM=33554432
else lwhy="no engine host (make build or make asan-build)"; fi
if [ "$TEST" = 1 ]; then LSEED=${ENGINE_FUZZ_SEED:-1}; else LSEED=${ENGINE_FUZZ_SEED:-$(( $(date +%s) % 1000000 ))}; fi
for n in "${LUA_TARGETS[@]+"${LUA_TARGETS[@]}"}"; do
  name=${n#fuzz_}
  if [ -n "$lwhy" ]; then echo "fuzz $name: skipped: $lwhy"; skipped=$((skipped + 1)); continue; fi
  log="$TMP/$name.log"
  if [ "$n" = api_sweep ]; then
    # the sweep's own memory cap: no call may take gigabytes (under ASan: max_allocation_size_mb above)
    ( [ -n "$LMEM" ] && ulimit -v "$LMEM" 2>/dev/null; timeout $((SECS + 120)) "${LENGINE[@]}" spec/fuzz/api_sweep.lua "$LSEED" 1000000000 1 "$SECS" ) > "$log" 2>&1
  elif [ "$TEST" = 1 ]; then
    timeout 300 "${LENGINE[@]}" "spec/fuzz/$n.lua" 0 "$LSEED" --test > "$log" 2>&1
  else
    timeout $((SECS + 120)) "${LENGINE[@]}" "spec/fuzz/$n.lua" "$SECS" "$LSEED" > "$log" 2>&1
  fi
  rc=$?
  runs=$(grep -E '^stat::number_of_executed_units:' "$log" | awk '{print $2}' | tail -1)
  [ -z "$runs" ] && runs=$(grep -E '^api sweep: seed' "$log" | sed -E 's/.*, ([0-9]+) calls from.*/\1/' | tail -1)
  runs=${runs:-0}
  total=$((total + runs))
  if [ $rc -eq 0 ]; then
    echo "fuzz $name (Lua, seed $LSEED): $runs executions$([ "$TEST" = 1 ] && echo " (one pass)" || echo " in ${SECS}s"), no finding"
    passed=$((passed + 1))
  else
    echo "fuzz $name (Lua, seed $LSEED): FAILED (rc=$rc) after $runs executions; the report:"
    grep -vE '^(stat::|call [0-9]+:)' "$log" | tail -40
    failed=$((failed + 1))
  fi
done
echo
if [ "$TEST" = 1 ]; then echo "$passed passed, $failed failed, $skipped skipped"
else echo "fuzz: $((${#TARGETS[@]} + ${#LUA_TARGETS[@]})) targets, $total executions, $failed crashed, $skipped skipped"; fi
[ "$failed" -eq 0 ]
