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
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
FB=build-fuzz; SECS=""; TEST=0; ONLY=()
for a in "$@"; do
  case "$a" in
    --test) TEST=1 ;;
    [0-9]*) SECS=$a ;;
    fuzz_*) ONLY+=("$a") ;;
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
echo
if [ "$TEST" = 1 ]; then echo "$passed passed, $failed failed, $skipped skipped"
else echo "fuzz: ${#TARGETS[@]} targets, $total executions, $failed crashed, $skipped skipped"; fi
[ "$failed" -eq 0 ]
