#!/usr/bin/env bash
# Runs the whole test suite: C-level tests, single-process busted specs under
# the engine host, and multi-process specs under mpirun (2 and 4 ranks).
# Ends with one line "N passed, N failed" (skipped counted separately).
set -u
BUILD=${1:-build}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
ENGINE="$BUILD/engine"
BUSTED=$(command -v busted || echo /usr/bin/busted)
MPIRUN="mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader --mca pml ob1 -x MALLOC_MMAP_MAX_=0 -x MALLOC_TRIM_THRESHOLD_=1073741824 -x ENGINE_SUMMARY_DIR"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
passed=0; failed=0; skipped=0

add() { passed=$((passed + $1)); failed=$((failed + $2)); skipped=$((skipped + ${3:-0})); }

# 1. C-level tests: each binary prints "N passed, N failed" as its last line.
for t in "$BUILD"/ctests/*; do
  [ -x "$t" ] || continue
  out=$("$t" 2>&1); rc=$?
  echo "$out" | tail -n 20
  line=$(echo "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed' | tail -1)
  if [ -n "$line" ] && [ $rc -eq 0 -o -n "$line" ]; then
    p=$(echo "$line" | sed -E 's/^([0-9]+) passed, ([0-9]+) failed.*/\1/')
    f=$(echo "$line" | sed -E 's/^([0-9]+) passed, ([0-9]+) failed.*/\2/')
    [ $rc -ne 0 ] && [ "$f" = 0 ] && f=1
    add "$p" "$f"
  else
    echo "ctest $(basename "$t"): crashed or printed no summary (rc=$rc)"; add 0 1
  fi
done

# 2. Single-process specs (spec/*_spec.lua) under the engine host.
run_busted() { # label, summary file, command...
  local label=$1 sum=$2; shift 2
  echo "== $label"
  ENGINE_SUMMARY_FILE=$sum timeout 1800 "$@"
  local rc=$?
  if [ -f "$sum" ]; then read -r p f s < "$sum"; add "$p" "$f" "$s"
  else echo "$label: no summary (rc=$rc)"; add 0 1; fi
}
run_busted "single-process specs" "$TMP/single" "$ENGINE" "$BUSTED" --ignore-lua -o tools/passfail.lua spec

# 3. Multi-process specs (spec/dist/*_spec.lua) under mpirun, when present.
if ls spec/dist/*_spec.lua >/dev/null 2>&1; then
  for np in 2 4; do
    export ENGINE_SUMMARY_DIR="$TMP/np$np"; mkdir -p "$ENGINE_SUMMARY_DIR"
    echo "== multi-process specs, $np ranks"
    timeout 1800 $MPIRUN -np $np "$ENGINE" "$BUSTED" --ignore-lua -o tools/passfail_dist.lua spec/dist
    rc=$?
    if [ -f "$ENGINE_SUMMARY_DIR/merged" ]; then read -r p f s < "$ENGINE_SUMMARY_DIR/merged"; add "$p" "$f" "$s"
    else echo "multi-process specs ($np ranks): no merged summary (rc=$rc)"; add 0 1; fi
    [ $rc -ne 0 ] && [ -f "$ENGINE_SUMMARY_DIR/merged" ] && read -r p f s < "$ENGINE_SUMMARY_DIR/merged" && [ "$f" = 0 ] && add 0 1
  done
fi

echo
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
