#!/usr/bin/env bash
# Two "nodes" on one machine: runs multi-process specs at 2 nodes x 2 ranks across two network
# namespaces, so that the shared-memory communicator, the node-local ranks and the single-copy path
# (engine/src/comm/cma.c) see two nodes, and the ranks of different nodes talk over TCP.
#
#   tools/multinode.sh [BUILD] [SPEC...]        (tools/run-tests.sh runs it; default specs below)
#
# How: two network namespaces (ip netns) joined by a veth pair with private addresses on a /24
# (ENGINE_MULTINODE_NET, default 10.231.0; nothing outside the two namespaces can reach them), each
# node with its own host name (a UTS namespace, unshare --uts).  mpirun starts in node A; OpenMPI's
# rsh agent (--mca plm_rsh_agent) is this script with --agent, which starts orted inside the namespace
# of the node it is asked for; MPI's out-of-band and TCP traffic are restricted to the veth subnet
# (oob_tcp_if_include, btl_tcp_if_include).  Then the fault cases: the link is taken down in the middle
# of collectives, and every rank must end with an error within the comm timeout (no hang).
# The namespaces are removed on exit (also after a failure or an interrupt); namespaces left by an
# earlier run killed with SIGKILL are removed at the next start.  Without root, ip/unshare, or where
# namespaces or veth pairs are refused, everything is skipped with the reason.
# Environment: ENGINE_MULTINODE_NET (the /24's first three octets), ENGINE_MULTINODE_FAULT_TIMEOUT (the comm
# timeout of the fault cases, default 5 s), ENGINE_DIST_TEST_TIMEOUT (per test, default 120 s).
# Last line: "N passed, N failed, N skipped".
set -u

# ---- the rsh agent: tools/multinode.sh --agent HOST COMMAND...  (OpenMPI calls it like ssh)
if [ "${1:-}" = "--agent" ]; then
  shift
  host=$1; shift
  # ENGINE_MULTINODE_MAP: "ADDR=NETNS=HOSTNAME ..." (set by the run below; inherited through mpirun)
  for e in ${ENGINE_MULTINODE_MAP:-}; do
    a=${e%%=*}; r=${e#*=}; ns=${r%%=*}; hn=${r#*=}
    if [ "$a" = "$host" ] || [ "$hn" = "$host" ]; then
      exec ip netns exec "$ns" unshare --uts sh -c "hostname $hn && exec sh -c \"\$0\"" "$*"
    fi
  done
  echo "multinode agent: unknown host $host (map: ${ENGINE_MULTINODE_MAP:-none})" >&2
  exit 255
fi

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
BUILD=build
SPECS=()
for a in "$@"; do
  case "$a" in
    *_spec.lua|spec/*) SPECS+=("$a") ;; # FILE or "FILE|PATTERN|..." (see below)
    *) BUILD=$a ;;
  esac
done
# The two-node view, then the collective, comm-check, mesh, single-copy, checkpoint, FSDP, tensor-parallel and 2-D
# specs; "FILE|PATTERN|..." runs the tests of FILE whose names match one of the patterns (busted --filter), to
# keep the stage at a few minutes (the heaviest trainings run in the main suite's 4-rank stage).
[ ${#SPECS[@]} -eq 0 ] && SPECS=(spec/multinode/nodes_spec.lua spec/dist/comm_spec.lua spec/dist/comm_check_spec.lua
  spec/dist/mesh_spec.lua spec/dist/single_copy_spec.lua spec/dist/checkpoint_spec.lua
  "spec/dist/fsdp_spec.lua|parity with one process|HSDP on a|mixed precision: bf16 compute|state dict: sharded\
|send buffer"
  "spec/dist/tensor_parallel_spec.lua|parallel styles on one module|2x2"
  "spec/dist/fsdp_2d_spec.lua|FSDP over tensor parallelism MLP dim|clip_grad_norm|bad input")
ENGINE="$ROOT/$BUILD/engine"
BUSTED=$(command -v busted || echo /usr/bin/busted)
NET=${ENGINE_MULTINODE_NET:-10.231.0}
TAG=$$
NSA=engmnA-$TAG; NSB=engmnB-$TAG      # namespaces, named after this script's pid
VA=emA$TAG; VB=emB$TAG                  # the veth ends (at most 15 characters)
HA=node-a; HB=node-b                    # host names of the two nodes
ADDR_A=$NET.1; ADDR_B=$NET.2
SUBNET=$NET.0/24

skip() {
  echo "multi-node: skipped: $1"
  echo
  echo "0 passed, 0 failed, 1 skipped"
  exit 0
}

fail_now() { echo "multi-node: $1"; echo; echo "0 passed, 1 failed, 0 skipped"; exit 1; }
[ -x "$ENGINE" ] || fail_now "$ENGINE not found (build first)"
[ "$(id -u)" = 0 ] || skip "needs root for network namespaces (ip netns) and veth pairs"
for t in ip unshare mpirun; do command -v $t >/dev/null 2>&1 || skip "$t is not installed"; done

# Namespaces of earlier runs whose script is gone (killed with SIGKILL, so its trap did not run).
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^engmn[AB]-[0-9]+$'); do
  pid=${ns#engmn?-}
  if ! kill -0 "$pid" 2>/dev/null; then
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null
  fi
done

TMP=$(mktemp -d)
cleanup() {
  for ns in $NSA $NSB; do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
  done
  ip netns del $NSA 2>/dev/null
  ip netns del $NSB 2>/dev/null # the veth pair goes with its namespaces
  rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# a command in the background and a wait for it: a signal to this script interrupts the wait, so the traps
# run at once (bash runs them only after a foreground command ends) and cleanup ends the ranks
run_bg_wait() { "$@" & wait $!; }

why=$( { ip netns add $NSA && ip netns add $NSB &&
  ip link add $VA type veth peer name $VB &&
  ip link set $VA netns $NSA && ip link set $VB netns $NSB &&
  ip -n $NSA addr add $ADDR_A/24 dev $VA && ip -n $NSB addr add $ADDR_B/24 dev $VB &&
  ip -n $NSA link set $VA up && ip -n $NSB link set $VB up &&
  ip -n $NSA link set lo up && ip -n $NSB link set lo up; } 2>&1 ) ||
  skip "this machine does not allow network namespaces and veth pairs: $(echo "$why" | head -1)"
why=$(ip netns exec $NSA unshare --uts true 2>&1) || skip "this machine does not allow UTS namespaces: $why"
# the link works both ways before anything is launched over it
ip netns exec $NSA ping -c 1 -W 2 $ADDR_B >/dev/null 2>&1 ||
  ip netns exec $NSA bash -c "exec 3<>/dev/tcp/$ADDR_B/9" 2>&1 | grep -q refused ||
  fail_now "the veth link $ADDR_A <-> $ADDR_B does not carry traffic"

export ENGINE_MULTINODE_MAP="$ADDR_A=$NSA=$HA $ADDR_B=$NSB=$HB"
passed=0; failed=0; skipped=0
add() { passed=$((passed + $1)); failed=$((failed + $2)); skipped=$((skipped + ${3:-0})); }

# mpirun in node A (its own host name), 2 ranks per node, ranks 0,1 on node A and 2,3 on node B.
ON_A=(ip netns exec $NSA unshare --uts sh -c 'hostname "$1" && shift && exec "$@"' sh $HA)
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none
  --host "$ADDR_A:2,$ADDR_B:2" -np 4 --map-by slot
  --mca plm_rsh_agent "$ROOT/tools/multinode.sh --agent"
  --mca oob_tcp_if_include $SUBNET --mca btl self,vader,tcp --mca btl_tcp_if_include $SUBNET --mca pml ob1
  -x MALLOC_MMAP_MAX_=0 -x MALLOC_TRIM_THRESHOLD_=1073741824 -x ENGINE_SUMMARY_DIR -x ENGINE_MULTINODE_MAP
  -x PATH)
[ -n "${LD_LIBRARY_PATH:-}" ] && MPIRUN+=(-x LD_LIBRARY_PATH)

echo "== multi-node specs, 2 nodes x 2 ranks ($HA $ADDR_A, $HB $ADDR_B)"
export ENGINE_MULTINODE=2 # spec/multinode/nodes_spec.lua checks that it sees two nodes
export ENGINE_DIST_TEST_TIMEOUT=${ENGINE_DIST_TEST_TIMEOUT:-120}
for entry in "${SPECS[@]}"; do # one mpirun per spec file: a failure or hang stays with its file
  IFS='|' read -r -a parts <<< "$entry"
  spec=${parts[0]}; filters=()
  for pat in "${parts[@]:1}"; do filters+=(--filter "$pat"); done
  export ENGINE_SUMMARY_DIR="$TMP/$(basename "$spec" .lua)"; mkdir -p "$ENGINE_SUMMARY_DIR"
  echo "-- $spec${filters[*]:+ (tests matching: ${entry#*|})}"
  t0=$(date +%s%N)
  run_bg_wait timeout 600 "${ON_A[@]}" "${MPIRUN[@]}" -x ENGINE_MULTINODE -x ENGINE_DIST_TEST_TIMEOUT \
    "$ENGINE" "$BUSTED" --ignore-lua -o tools/passfail_dist.lua "${filters[@]}" "$spec"
  rc=$?
  echo "($spec: $(( ($(date +%s%N) - t0) / 1000000000 )) s)"
  if [ -f "$ENGINE_SUMMARY_DIR/merged" ]; then
    read -r p f s < "$ENGINE_SUMMARY_DIR/merged"; add "$p" "$f" "$s"
    [ $rc -ne 0 ] && [ "$f" = 0 ] && { echo "$spec (2 nodes): exit status $rc"; add 0 1; }
  else echo "$spec (2 nodes): no merged summary (rc=$rc)"; add 0 1; fi
  # a run that timed out may leave ranks behind: end them before the next file
  for ns in $NSA $NSB; do for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done; done
done

# ---- the link fault: the veth link goes down while the ranks run all_reduces across it.  Twice: without
# signature checks (the link can only fail in a collective's data phase: every rank must report the comm
# timeout itself), and as by default (checks on: the fault may be caught by the check's wait; a rank may then
# be ended by mpirun once another rank has reported and aborted the job, see process_group.c's timeout_abort).
FT=${ENGINE_MULTINODE_FAULT_TIMEOUT:-5}   # the comm timeout of those runs, seconds
REPORT="has not completed within|did not join"
engine_pids() { # rank of every engine process still running in the two namespaces
  for ns in $NSA $NSB; do
    for p in $(ip netns pids "$ns" 2>/dev/null); do
      [ "$(readlink "/proc/$p/exe" 2>/dev/null)" = "$(readlink -f "$ENGINE")" ] || continue
      tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | sed -n 's/^OMPI_COMM_WORLD_RANK=//p'
    done
  done
}
fault_case() { # label, ENGINE_MN_FAULT_CHECK (0: checks off)
  local label=$1 check=$2 FD="$TMP/fault$2" t=0
  mkdir -p "$FD"
  echo
  echo "== link fault ($label): the link goes down during all_reduces; every rank must end with an error within ${FT} s"
  ip -n $NSA link set $VA up
  "${ON_A[@]}" "${MPIRUN[@]}" -x ENGINE_MN_FAULT_DIR="$FD" -x ENGINE_MN_FAULT_TIMEOUT="$FT" \
    -x ENGINE_MN_FAULT_CHECK="$check" \
    sh -c 'exec "$0" "$1" > "$2/out$OMPI_COMM_WORLD_RANK" 2>&1' "$ENGINE" spec/multinode/link_fault.lua "$FD" \
    > "$FD/mpirun.log" 2>&1 &
  disown # ended below (bash would report the kill)
  while [ $t -lt 600 ] && [ "$(cat "$FD"/rank? 2>/dev/null | grep -c ready)" -lt 4 ]; do sleep 0.1; t=$((t + 1)); done
  if [ "$(cat "$FD"/rank? 2>/dev/null | grep -c ready)" -lt 4 ]; then
    echo "FAIL link fault ($label): the ranks did not start within 60 s"
    cat "$FD"/mpirun.log "$FD"/out? 2>/dev/null | tail -20; add 0 1
  else
    sleep 0.5
    ip -n $NSA link set $VA down
    local t0 limit left took r node_ok
    t0=$(date +%s%N)
    limit=$((FT + 15)) # the timeout, the moment the ranks of a node give each other to report, scheduling
    while :; do
      left=$(engine_pids | sort | tr '\n' ' ')
      [ -z "$left" ] && break
      [ $(( ($(date +%s%N) - t0) / 1000000000 )) -ge $limit ] && break
      sleep 0.2
    done
    took=$(( ($(date +%s%N) - t0) / 1000000 ))
    for r in 0 1 2 3; do
      if echo " $left " | grep -q " $r "; then
        echo "FAIL link fault ($label): rank $r still runs ${limit} s after the link went down (a hang)"; add 0 1
      elif grep -q "error:" "$FD/rank$r" 2>/dev/null; then
        echo "ok   link fault ($label): rank $r: $(grep -m1 "error:" "$FD/rank$r" | cut -c1-150)"; add 1 0
      elif grep -qE "$REPORT" "$FD/out$r" 2>/dev/null; then
        echo "ok   link fault ($label): rank $r: $(grep -m1 -E "$REPORT" "$FD/out$r" | cut -c1-150)"; add 1 0
      elif [ "$check" != 0 ] && grep -qE "$REPORT" "$FD/out$(( r ^ 1 ))" 2>/dev/null; then
        echo "ok   link fault ($label): rank $r: ended by mpirun after rank $(( r ^ 1 )) (same node) reported"; add 1 0
      elif [ "$check" != 0 ] && reporter=$(grep -lE "$REPORT" "$FD"/out? 2>/dev/null | head -1) && [ -n "$reporter" ]; then
        # with the checks on, the ranks whose check saw the fault first abort the job (after the watchdog's pause);
        # mpirun then ends the ranks of the other node, which may not have reached their own timeout yet: no hang,
        # and the job's error names the fault (one CI run in three saw this order)
        echo "ok   link fault ($label): rank $r: ended by mpirun after rank ${reporter##*out} (other node) reported"
        add 1 0
      else
        echo "FAIL link fault ($label): rank $r ended without reporting the fault:"
        tail -5 "$FD/out$r" "$FD/rank$r" 2>/dev/null; add 0 1
      fi
    done
    if [ -z "$left" ]; then
      echo "link fault ($label): every rank ended $((took / 1000)).$(( (took % 1000) / 100 )) s after the link went down"
    else echo "link fault ($label): ranks $left still ran after ${limit} s"; fi
  fi
  for ns in $NSA $NSB; do for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done; done
}
fault_case "data phase" 0
fault_case "default" 1

echo
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
