#!/usr/bin/env bash
# tools/gpu-check.sh OUTDIR [--bundle DIR] [--build BUILD] [--bench all|engine|none] [--budget SECONDS] [--only REGEX]
#                    [--nps "1 2 4"] [--single 0|1] [--jobs N]
#
# The prepared GPU check: on a machine with an NVIDIA GPU, in one go,
#   1. makes the runtime available: when luajit, busted or mpirun are missing it unpacks the offline bundle's
#      Debian packages (tools/offline-bundle.sh DIR; default .gpubundle) into DIR/prefix with `dpkg -x` and
#      points PATH, LD_LIBRARY_PATH, LUA_PATH/CPATH and OPAL_PREFIX there; finds libnccl/libcublasLt in the
#      CUDA toolkit or PyTorch's wheels when the loader does not;
#   2. uses BUILD (default build) when it holds an engine, else the bundle's prebuilt tree, else builds with nvcc;
#   3. runs the C tests, every GPU-tagged single-process spec, the multi-rank CUDA specs at 2 and 4 ranks on
#      whatever GPUs there are (and at 1 rank) (several ranks on one GPU: each rank its own NCCL_HOSTID with NCCL's P2P and SHM
#      transports off, so NCCL connects them through sockets over the loopback), a probe of what NCCL says
#      without NCCL_HOSTID, and the GPU benchmarks (--bench: all = engine + PyTorch eager/compile, engine =
#      the engine alone, none);
#   4. writes the logs and OUTDIR/summary.md: GPU, driver, commit, then one line per suite
#      "<spec file> np=<N> device=cuda: <P> passed, <F> failed, <S> skipped", then the benchmarks' last lines.
# Each stage has a time limit; stages are skipped, and say so, once --budget (default 450 s) is spent.
# With the benchmarks it also tries the opt-in kernels listed in GPU_CHECK_OPT_IN (default ENGINE_GEMM_AUTOTUNE=1
# ENGINE_GELU_EPILOGUE=0 ENGINE_NORM_BWD=wide (the defaults' alternatives to time); the attention ones measured on 2026-11-28, ENGINE_ATTN_BWD=split
# ENGINE_ATTN_FWD_ROWS=128 ENGINE_ATTN_DQ_ROWS=128, are still understood; empty: none): the kernel's checks (the
# attention spec; for ENGINE_NORM_*, ctests/test_cuda_norm and the norm specs; for ENGINE_GELU_*, the linear_gelu
# spec; for ENGINE_GEMM_*, the cuBLASLt spec and the linear specs) and the engine's step with each variable, beside
# the default step, and the op alone.
# --only REGEX runs only the spec files whose path matches (grep -E), and no C tests (for quick reruns).
# --nps LIST: the rank counts of the multi-rank specs (default "1 2 4"); --single 0 skips the single-process specs.
# --jobs N (or GPU_CHECK_JOBS): how many suites run at once on the machine (default 4: the C tests, the single-process
# specs and the multi-rank suites share the GPU and the cores; one at a time, every suite in a row, did not fit the
# 450 s budget); --jobs 1 runs them one after another.
# Exit status 0 when every suite ran and nothing failed.
set -u
OUT=${1:?usage: tools/gpu-check.sh OUTDIR [--bundle DIR] [--build BUILD] [--bench all|engine|none] [--budget S]}
shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUNDLE=$ROOT/.gpubundle
BUILD=build
BENCH=engine
BUDGET=450
ONLY=""
NPS="1 2 4"
SINGLE_SPECS=1
JOBS=${GPU_CHECK_JOBS:-4}
# opt-in kernels to measure against the default (each: spec line, default step, step with the variable)
OPT_IN=${GPU_CHECK_OPT_IN-ENGINE_GEMM_AUTOTUNE=1 ENGINE_GELU_EPILOGUE=0 ENGINE_NORM_BWD=wide}
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) BUNDLE=${2:?}; shift 2 ;;
    --build) BUILD=${2:?}; shift 2 ;;
    --bench) BENCH=${2:?}; shift 2 ;;
    --budget) BUDGET=${2:?}; shift 2 ;;
    --only) ONLY=${2:?}; shift 2 ;;
    --nps) NPS=${2:?}; shift 2 ;;
    --single) SINGLE_SPECS=${2:?}; shift 2 ;;
    --jobs) JOBS=${2:?}; shift 2 ;;
    *) echo "gpu-check.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT"
T0=$(date +%s)
SUMMARY=$OUT/summary.md
LINES=$OUT/.lines
: > "$LINES"
status=0
log() { echo "[gpu-check $(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

# ------------------------------------------------------------------ 1. runtime
PFX=""
if ! command -v luajit >/dev/null || ! command -v mpirun >/dev/null || ! { command -v busted >/dev/null || [ -f /usr/bin/busted ]; }; then
  if ls "$BUNDLE"/debs/*.deb >/dev/null 2>&1; then
    PFX=$BUNDLE/prefix
    if [ ! -f "$PFX/.unpacked" ]; then
      log "unpacking $(ls "$BUNDLE"/debs/*.deb | wc -l) packages of $BUNDLE into $PFX"
      rm -rf "$PFX"; mkdir -p "$PFX"
      for d in "$BUNDLE"/debs/*.deb; do dpkg-deb -x "$d" "$PFX" || { echo "dpkg-deb -x $d failed"; exit 1; }; done
      ln -sf orterun "$PFX/usr/bin/mpirun"
      touch "$PFX/.unpacked"
    fi
    L=$PFX/usr/lib/x86_64-linux-gnu
    export PATH=$PFX/usr/bin:$PATH
    export LD_LIBRARY_PATH=$L:$L/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export OPAL_PREFIX=$PFX/usr PMIX_PREFIX=$L/pmix2 PMIX_MCA_pcompress_base_silence_warning=1
    export LUA_PATH="$PFX/usr/share/lua/5.1/?.lua;$PFX/usr/share/lua/5.1/?/init.lua;;"
    export LUA_CPATH="$L/lua/5.1/?.so;;"
  else
    log "luajit, busted or mpirun missing and no bundle at $BUNDLE (tools/offline-bundle.sh $BUNDLE); trying the build as is"
  fi
fi
BUSTED=$(command -v busted || echo /usr/bin/busted)

# ------------------------------------------------------------------ 2. build
if [ ! -x "$BUILD/engine" ]; then
  if [ -x "$BUNDLE/build/engine" ]; then
    log "using the bundle's prebuilt tree ($(grep '^commit' "$BUNDLE/MANIFEST" 2>/dev/null))"
    BUILD=$BUNDLE/build
  else
    log "building $BUILD with nvcc"
    { cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DENGINE_NATIVE=OFF -DCMAKE_CUDA_ARCHITECTURES=90 &&
      cmake --build "$BUILD" -j "$(nproc)"; } > "$OUT/build.log" 2>&1 || { log "build failed (build.log)"; exit 1; }
  fi
fi
export LD_LIBRARY_PATH=$ROOT/$BUILD:$BUILD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for lib in libnccl.so.2 libcublasLt.so; do
  if ldd "$BUILD/libengine.so" | grep "$lib" | grep -q "not found"; then
    d=$(find /usr/local/cuda*/lib* /usr/local/cuda*/targets/*/lib /opt /usr/lib/python3* /usr/local/lib/python3* \
          -name "$lib*" 2>/dev/null | head -1)
    [ -n "$d" ] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$(dirname "$d") && log "$lib from $(dirname "$d")"
  fi
done
ENGINE=$BUILD/engine
# the environment of this check, for further commands on the same machine: . OUTDIR/env.sh
{
  for v in PATH LD_LIBRARY_PATH LUA_PATH LUA_CPATH OPAL_PREFIX PMIX_PREFIX PMIX_MCA_pcompress_base_silence_warning; do
    [ -n "${!v:-}" ] && printf 'export %s=%q\n' "$v" "${!v}"
  done
  case "$ENGINE" in /*) printf 'ENGINE=%q\n' "$ENGINE" ;; *) printf 'ENGINE=%q\n' "$ROOT/$ENGINE" ;; esac
} > "$OUT/env.sh"

# ------------------------------------------------------------------ header
GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || grep '^commit' "$BUNDLE/MANIFEST" 2>/dev/null | cut -d' ' -f2)
DIRTY=$(git diff --quiet HEAD 2>/dev/null || echo " + uncommitted changes")
NCCLV=$("$ENGINE" -e 'local e=require("engine"); io.write(e.cuda.is_available() and "cuda available" or e.cuda.unavailable_reason())' 2>&1 | tail -1)
log "GPU: ${GPU:-none} (x$NGPU); commit $COMMIT$DIRTY; $NCCLV"

MPIRUN="mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader --mca pml ob1"
# several ranks on one GPU: each rank its own NCCL host id, sockets over the loopback
PASS=""
for v in LD_LIBRARY_PATH PATH LUA_PATH LUA_CPATH OPAL_PREFIX PMIX_PREFIX PMIX_MCA_pcompress_base_silence_warning; do
  [ -n "${!v:-}" ] && PASS="$PASS -x $v"
done
SHARE="-x NCCL_P2P_DISABLE=1 -x NCCL_SHM_DISABLE=1 -x NCCL_SOCKET_IFNAME=lo$PASS"

# ------------------------------------------------------------------ 3a-3c. the suites, JOBS at a time
# Each suite is a job writing its summary line to OUT/.line_<key> (and its wall time to OUT/timings.txt); the lines
# are gathered in the fixed order below once every job has ended.  Concurrent multi-rank jobs give their ranks
# distinct NCCL host ids (gpucheck<job>r<rank>).
KEYS=()
line_of() { # key name np p f s
  echo "$2 np=$3 device=cuda: $4 passed, $5 failed, $6 skipped" > "$OUT/.line_$1"
  log "$2 np=$3: $4 passed, $5 failed, $6 skipped"
}
timed() { # key cmd...: runs cmd, appends "key seconds" to timings.txt
  local k=$1 t=$(date +%s); shift
  "$@"
  echo "$k $(( $(date +%s) - t )) s" >> "$OUT/timings.txt"
}
ctest_job() { # key binary
  local n out rc line p f
  n=$(basename "$2")
  out=$(timeout 120 "$2" 2>&1); rc=$?
  echo "$out" > "$OUT/ctest_$n.log"
  line=$(echo "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed' | tail -1)
  if [ -n "$line" ]; then
    read -r p _ f _ <<< "$line"; [ $rc -ne 0 ] && [ "$f" = 0 ] && f=1
    line_of "$1" "ctests/$n" 1 "$p" "${f%,}" 0
  else line_of "$1" "ctests/$n" 1 0 1 0; fi
}
single_job() { # key spec
  local n sum p f sk
  n=$(basename "$2" .lua)
  sum=$OUT/.sum_$n
  rm -f "$sum"
  ENGINE_SUMMARY_FILE=$sum timeout 300 "$ENGINE" "$BUSTED" --ignore-lua -o tools/passfail.lua --tags=gpu "$2" \
    > "$OUT/$n.np1.log" 2>&1
  if [ -f "$sum" ]; then read -r p f sk < "$sum"; line_of "$1" "$2" 1 "$p" "$f" "$sk"
  else line_of "$1" "$2" 1 0 1 0; tail -5 "$OUT/$n.np1.log"; fi
}
dist_job() { # key spec np job-id
  local n dir p f sk SH HW
  n=$(basename "$2" .lua)
  dir=$OUT/.sum_${n}_$3
  rm -rf "$dir"; mkdir -p "$dir"
  SH=$SHARE; HW=(sh -c "NCCL_HOSTID=gpucheck${4}r\$OMPI_COMM_WORLD_RANK; export NCCL_HOSTID; exec \"\$@\"" sh)
  if [ "$NGPU" -ge "$3" ]; then SH=$PASS; HW=(); fi
  ENGINE_SUMMARY_DIR=$dir timeout 120 $MPIRUN $SH -x ENGINE_SUMMARY_DIR -np "$3" "${HW[@]}" "$ENGINE" "$BUSTED" \
    --ignore-lua -o tools/passfail_dist.lua --tags=gpu "$2" > "$OUT/$n.np$3.log" 2>&1
  if [ -f "$dir/merged" ]; then read -r p f sk < "$dir/merged"; line_of "$1" "$2" "$3" "$p" "$f" "$sk"
  else line_of "$1" "$2" "$3" 0 1 0; tail -5 "$OUT/$n.np$3.log"; fi
}
# launch KEY NAME NP CMD...: a job once fewer than JOBS run (the suite is marked not run once the budget is spent)
launch() {
  local k=$1 name=$2 np=$3; shift 3
  KEYS+=("$k")
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
  if [ "$(left)" -le 30 ]; then
    log "budget spent: $name np=$np skipped"
    echo "$name np=$np device=cuda: not run (time budget)" > "$OUT/.line_$k"
    return
  fi
  timed "$k" "$@" &
}
rm -f "$OUT"/.line_* "$OUT/timings.txt"
if [ -z "$ONLY" ]; then
  for t in "$BUILD"/ctests/*; do
    [ -x "$t" ] && launch "c_$(basename "$t")" "ctests/$(basename "$t")" 1 ctest_job "c_$(basename "$t")" "$t"
  done
fi
SINGLE=$(grep -lE '(describe|it)\(".*#gpu|\.\. "[^"]*#gpu' spec/*_spec.lua 2>/dev/null | grep -E "${ONLY:-.}")
[ "$SINGLE_SPECS" = 1 ] || SINGLE=""
for s in $SINGLE; do launch "s_$(basename "$s" .lua)" "$s" 1 single_job "s_$(basename "$s" .lua)" "$s"; done
DIST=$(grep -lE '(describe|it)\(".*#gpu|\.\. "[^"]*#gpu' spec/dist/*_spec.lua 2>/dev/null | grep -E "${ONLY:-.}")
jid=0
for np in $NPS; do
  for s in $DIST; do
    jid=$((jid + 1))
    launch "d_$(basename "$s" .lua)_$np" "$s" "$np" dist_job "d_$(basename "$s" .lua)_$np" "$s" "$np" "$jid"
  done
done
wait
for k in "${KEYS[@]}"; do
  if [ -f "$OUT/.line_$k" ]; then cat "$OUT/.line_$k" >> "$LINES"; else echo "$k: no result (the job ended without a line)" >> "$LINES"; fi
done
rm -f "$OUT"/.line_*
grep -qE ', [1-9][0-9]* failed|not run|no result' "$LINES" && status=1

# ------------------------------------------------------------------ 3d. what NCCL says to two ranks on one GPU
if [ "$NGPU" -lt 2 ] && [ "$(left)" -gt 40 ] && [ -z "$ONLY" ]; then
  timeout 60 $MPIRUN $PASS -np 2 "$ENGINE" -e '
    local e = require("engine"); local d = e.distributed
    local ok, err = pcall(function() local x = e.ones(4, { device = "cuda" }); d.all_reduce(x); return x:to("cpu"):get(1) end)
    print(string.format("rank %d: all_reduce: %s %s", d.rank(), ok and "ok" or "error", tostring(err)))
    ok, err = pcall(d.init_device_mesh, "cuda", { d.world_size() })
    print(string.format("rank %d: init_device_mesh: %s %s", d.rank(), ok and "ok" or "error", tostring(err)))' \
    > "$OUT/nccl_same_gpu_probe.log" 2>&1
  echo "probe (2 ranks on one GPU without NCCL_HOSTID, rc $?): $(grep -m1 'rank 0: all_reduce' "$OUT/nccl_same_gpu_probe.log" | cut -c1-300)" >> "$LINES"
  echo "probe: $(grep -m1 'rank 0: init_device_mesh' "$OUT/nccl_same_gpu_probe.log" | cut -c1-400)" >> "$LINES"
fi

# ------------------------------------------------------------------ 3e. benchmarks
BENCHLINES=""
if [ "$BENCH" != none ]; then
  if [ "$(left)" -gt 60 ]; then
    args=""; [ "$BENCH" = engine ] && args="--torch=0"
    timeout $(( $(left) > 300 ? 300 : $(left) )) "$ENGINE" recipes/bench/gpu_step.lua $args > "$OUT/gpu_step.log" 2>&1
    BENCHLINES="$(grep -E '^gpu_step|tok/s|MFU|tp=1' "$OUT/gpu_step.log" | tail -6)"
    # the Llama of comparable size, engine against PyTorch (issue 28)
    if [ "$(left)" -gt 90 ]; then
      timeout $(( $(left) > 240 ? 240 : $(left) )) "$ENGINE" recipes/bench/gpu_step.lua --model=llama --tp1=0 $args \
        > "$OUT/gpu_step_llama.log" 2>&1
      BENCHLINES="$BENCHLINES
$(grep -E 'tok/s|MFU' "$OUT/gpu_step_llama.log" | tail -4 | sed 's/^/llama: /')"
    fi
    # 300 steps of GPT-2 124M in bf16 with f32 master weights against fp32 on the KJV shards (final loss within 1%)
    if [ -f data/kjv_train.bin ] && [ "$(left)" -gt 120 ]; then
      timeout 150 "$ENGINE" tools/bf16_vs_f32.lua > "$OUT/bf16_vs_f32.log" 2>&1
      BENCHLINES="$BENCHLINES
$(grep -E '^bf16_vs_f32' "$OUT/bf16_vs_f32.log" | tail -1)"
    fi
    # each op of the step alone: time per call and the bandwidth / FLOP rate it reaches
    if [ "$(left)" -gt 60 ]; then
      timeout 120 "$ENGINE" recipes/bench/gpu_kernels.lua > "$OUT/gpu_kernels.log" 2>&1
      BENCHLINES="$BENCHLINES
$(grep -E ' us ' "$OUT/gpu_kernels.log")"
    fi
    # DTensor host overhead per op on a CUDA mesh (target: <= 1 us)
    timeout 60 "$ENGINE" recipes/bench/dtensor_dispatch.lua --device=cuda --n=5000 --runs=3 > "$OUT/dtensor_dispatch.log" 2>&1
    BENCHLINES="$BENCHLINES
dtensor_dispatch (cuda): $(grep -m1 'overhead' "$OUT/dtensor_dispatch.log" | sed 's/^ *//')"
    # opt-in kernels not yet measured (docs/gpu-runs/PENDING.md): the kernel's checks, the engine's step and the op
    # alone with each variable set, beside the default measured again in the same loop
    for var in $OPT_IN; do
      [ "$(left)" -gt 60 ] || break
      f=$OUT/optin_$(echo "$var" | tr -c 'A-Za-z0-9_\n' '_').log
      { case "$var" in
          ENGINE_NORM_*) # the norm kernels: their bit-exact C test and the norm specs
            env "$var" timeout 60 "$BUILD/ctests/test_cuda_norm" 2>&1 | tail -1
            env "$var" timeout 60 "$ENGINE" "$BUSTED" --ignore-lua -o tools/passfail.lua --tags=gpu --filter='layer_norm and rms_norm' \
              spec/cuda_spec.lua 2>&1 | tail -1 ;;
          ENGINE_GEMM_*) # cuBLASLt's algorithm choice: the GEMM kernel spec and the linear/matmul conformance
            env "$var" timeout 60 "$ENGINE" "$BUSTED" --ignore-lua -o tools/passfail.lua --tags=gpu \
              --filter='cuBLASLt GEMM' spec/cuda_spec.lua 2>&1 | tail -1
            env "$var" timeout 60 "$ENGINE" "$BUSTED" --ignore-lua -o tools/passfail.lua --tags=gpu \
              --filter='matmul' --filter='linear_gelu' spec/cuda_ops_spec.lua 2>&1 | tail -1 ;;
          ENGINE_GELU_*) # linear + GELU: the composition instead of cuBLASLt's epilogue
            env "$var" timeout 60 "$ENGINE" "$BUSTED" --ignore-lua -o tools/passfail.lua --tags=gpu \
              --filter='linear_gelu' spec/cuda_ops_spec.lua 2>&1 | tail -1 ;;
          *) env "$var" timeout 60 "$ENGINE" "$BUSTED" --ignore-lua -o tools/passfail.lua --tags=gpu \
              --filter='flash attention' spec/cuda_spec.lua 2>&1 | tail -1 ;;
        esac
        timeout 90 "$ENGINE" recipes/bench/gpu_step.lua --torch=0 --tp1=0 2>&1 | grep -E '^engine \('
        env "$var" timeout 90 "$ENGINE" recipes/bench/gpu_step.lua --torch=0 --tp1=0 2>&1 | grep -E '^engine \('
        # the kernel's op alone, without and with the variable (recipes/bench/gpu_kernels.lua)
        case "$var" in ENGINE_NORM_*) k='layer_norm' ;; ENGINE_GELU_*) k='linear_gelu' ;; ENGINE_GEMM_*) k='linear' ;;
          *) k='sdpa' ;; esac
        timeout 60 "$ENGINE" recipes/bench/gpu_kernels.lua --only="$k" 2>&1 | grep -E ' us ' | sed 's/^/default: /'
        env "$var" timeout 60 "$ENGINE" recipes/bench/gpu_kernels.lua --only="$k" 2>&1 | grep -E ' us ' | sed 's/^/with it: /'
      } > "$f" 2>&1
      BENCHLINES="$BENCHLINES
$(sed "s|^|opt-in $var: |" "$f")"
    done
    # the profiler's table of the engine's step (commit it with the run summary), then each kernel's own GPU time
    # (CUPTI) over the same kind of run without the op profiler's events
    if [ "$(left)" -gt 40 ]; then
      ENGINE_PROFILE=1 timeout 120 "$ENGINE" recipes/bench/gpu_step.lua --torch=0 --tp1=0 --steps=5 --warmup=2 \
        > "$OUT/gpu_step_profile.log" 2>&1
      BENCHLINES="$BENCHLINES
$(grep -A 25 '^profile (rank 0)' "$OUT/gpu_step_profile.log")"
    fi
    if [ "$(left)" -gt 30 ]; then
      ENGINE_PROFILE_KERNELS=1 timeout 120 "$ENGINE" recipes/bench/gpu_step.lua --torch=0 --tp1=1 --steps=10 --warmup=2 \
        > "$OUT/gpu_step_kernels.log" 2>&1
      BENCHLINES="$BENCHLINES
$(grep -E -A 32 '^kernel trace' "$OUT/gpu_step_kernels.log" | cut -c1-130)"
    fi
  else
    BENCHLINES="gpu_step: not run (time budget)"
  fi
fi

# ------------------------------------------------------------------ 4. summary
{
  echo "# GPU check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo "- GPU: ${GPU:-none} (x$NGPU); CUDA runtime: $NCCLV"
  echo "- commit: $COMMIT$DIRTY; build: $BUILD; runtime packages: ${PFX:-installed on the machine}"
  echo "- several ranks on one GPU: each rank NCCL_HOSTID=gpucheck<job>r<rank>, NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo"
  echo "- wall time: $(( $(date +%s) - T0 )) s; suites $JOBS at a time; the slowest: $(sort -k2 -n -r "$OUT/timings.txt" 2>/dev/null | head -3 | tr '\n' ';' | sed 's/;$//')"
  echo
  echo '```'
  cat "$LINES"
  [ -n "$BENCHLINES" ] && echo "$BENCHLINES"
  echo '```'
} > "$SUMMARY"
rm -f "$LINES"
cat "$SUMMARY"
exit $status
