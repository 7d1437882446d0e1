#!/usr/bin/env bash
# Runs the benchmarks (recipes/bench/*.lua) and prints their figures with the machine and BLAS setup:
# dispatch.lua and step.lua (the GPT, then --model=llama) in one process, comm.lua and redistribute.lua
# under mpirun with 4 ranks (BENCH_NP), tokenize.lua and generate.lua (issue 29: BPE encoding of the KJV, generation
# with the KV cache), tp_step.lua (tensor parallelism against one process and PyTorch) on 2 ranks, and
# gpu_step.lua when a CUDA device is usable.  `make bench` runs it.
#   tools/bench.sh [BUILD_DIR] [-- extra args for recipes/bench/step.lua]
# Example: tools/bench.sh build -- --steps=30 --threads=2
# Nothing else should run on the machine meanwhile (2 cores: any other load shows up in the timings).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-build}
[ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
cd "$ROOT"
ENGINE="$BUILD/engine"
if [ ! -x "$ENGINE" ]; then echo "bench.sh: $ENGINE not found (run make build first)"; exit 1; fi
echo "== machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), avx512f: $(grep -q avx512f /proc/cpuinfo && echo yes || echo no)"
echo "== OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-(unset)} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-(unset)}"
echo "== git: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (modified tree)')"
rc=0
echo "== recipes/bench/dispatch.lua"
"$ENGINE" recipes/bench/dispatch.lua || rc=1
echo "== recipes/bench/step.lua $*"
"$ENGINE" recipes/bench/step.lua "$@" || rc=1
echo "== recipes/bench/step.lua --model=llama $*"
"$ENGINE" recipes/bench/step.lua --model=llama "$@" || rc=1
NP=${BENCH_NP:-4}
MPIRUN="mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader --mca pml ob1 -x MALLOC_MMAP_MAX_=0 -x MALLOC_TRIM_THRESHOLD_=1073741824"
for b in comm redistribute; do
  echo "== recipes/bench/$b.lua ($NP ranks)"
  $MPIRUN -np "$NP" "$ENGINE" "recipes/bench/$b.lua" || rc=1
done
echo "== recipes/bench/tokenize.lua (the KJV through the committed BPE tokenizer; Python tokenizers when in tools/.venv)"
"$ENGINE" recipes/bench/tokenize.lua || rc=1
echo "== recipes/bench/generate.lua (per-token time with the KV cache at context 64 and 1024, and without it)"
"$ENGINE" recipes/bench/generate.lua || rc=1
echo "== recipes/bench/tp_step.lua (2 ranks; PyTorch from tools/.venv when tools/install-torch.sh put it there)"
$MPIRUN -np 2 "$ENGINE" recipes/bench/tp_step.lua || rc=1
ngpu=$("$ENGINE" -e 'io.write(tonumber(require("engine").C.eng_comm_cuda_device_count()))' 2>/dev/null)
if [ "${ngpu:-0}" -gt 0 ] 2>/dev/null; then
  echo "== recipes/bench/gpu_step.lua"
  "$ENGINE" recipes/bench/gpu_step.lua || rc=1
else
  echo "== recipes/bench/gpu_step.lua: skipped (no usable CUDA device)"
fi
exit $rc
