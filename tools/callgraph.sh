#!/usr/bin/env bash
# tools/callgraph.sh [BUILD] [--symbols]: the call graph between the folders of engine/src, read from the built
# objects (nm): for each pair "from -> to", how many distinct symbols objects of `from` use that objects of `to`
# define (--symbols: the symbols too).  Calls inside a folder are left out.  spec/layering_spec.lua checks the same
# graph against its table of allowed calls.
set -euo pipefail
B=${1:-build}
SYMS=0
[ "${2:-}" = "--symbols" ] && SYMS=1
D=$B/CMakeFiles/engine.dir/engine/src
[ -d "$D" ] || { echo "callgraph.sh: no objects under $D (build first)" >&2; exit 1; }
# the objects of sources that exist (an old build directory keeps objects of moved or removed files)
objs=()
for o in "$D"/*/*.o; do
  src=engine/src/$(basename "$(dirname "$o")")/$(basename "$o" .o)
  [ -f "$src" ] && objs+=("$o")
done
declare -A def
for o in "${objs[@]}"; do
  f=$(basename "$(dirname "$o")")
  while read -r s; do def[$s]=$f; done < <(nm --defined-only -g "$o" | awk '{print $3}')
done
for o in "${objs[@]}"; do
  f=$(basename "$(dirname "$o")")
  while read -r s; do
    t=${def[$s]:-}
    [ -n "$t" ] && [ "$t" != "$f" ] && echo "$f $t $s"
  done < <(nm -u "$o" | awk '{print $2}')
done | sort -u | awk -v syms=$SYMS '{k=$1" -> "$2; n[k]++; l[k]=l[k]" "$3} END {for (k in n) print k "  (" n[k] ")" (syms ? ":" l[k] : "")}' | sort
