#!/usr/bin/env bash
# The distributed tests across two simulated hosts: two network namespaces joined by a veth pair
# (host A 10.77.0.1, host B 10.77.0.2), each host's ranks also in a UTS namespace of their own with
# their own hostname, so that tsys (hostname + boot id) sees two hosts: no shared memory between
# them, local ranks per host; the rendezvous, MPI (over its TCP BTL) and the tcp engine cross a real
# interface instead of loopback.
#   - tcp engine: the ranks started here with torchrun-style variables (MASTER_ADDR = host A, a
#     common TSYS_DIST_RUN_ID and TSYS_DIST_SECRET); every rank's output is kept, rank 0's printed;
#   - MPI: mpirun in host A, the daemons of host B started through an rsh agent (this script, called
#     as `test_netns.sh --agent HOST CMD...`) that enters host B's namespaces in place of ssh;
#     --mca btl tcp,self (every message over TCP, within a host too), both TCP components on the
#     veth subnet only;
#   - test_dist, test_mesh, test_ddp and test_fsdp at 2 ranks (one per host) and 4 (two per host) on each;
#     test_dist must report its ranks on 2 hosts;
#   - a rank on host B that exits or stalls: the ranks on host A must fail naming it (mpirun names a
#     rank that exits; a stalled one is "no reply from the group" through MPI) within the timeout.
# Usage: tests/test_netns.sh [BUILD]   (the binaries are BUILD/test_dist etc.; default $BUILD or build)
# Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN), iproute2 and util-linux' unshare; without them it prints
# a skip line and "0 passed, 0 failed", unless CI_REQUIRE_NETNS=1 makes that a failure.
# TSYS_NETNS_TESTS picks the programs (default "test_dist test_mesh test_ddp test_fsdp").
# Prints each run's output and, last, the sum of their "N passed, N failed" lines.
set -u
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")

# ---- the rsh agent mpirun calls in place of ssh: --agent HOST orted-command... (one string for a
# shell, as ssh would pass it); the namespaces and hostnames come from TSYS_NETNS_MAP, which mpirun's
# environment carries here ("addr=netns=hostname ...")
if [ "${1:-}" = --agent ]; then
  host=$2; shift 2
  for m in ${TSYS_NETNS_MAP:-}; do
    IFS== read -r addr ns name <<< "$m"
    if [ "$host" = "$addr" ] || [ "$host" = "$name" ]; then
      exec ip netns exec "$ns" unshare --uts sh -c "hostname $name && $*"
    fi
  done
  echo "test_netns.sh --agent: no namespace for host '$host' (TSYS_NETNS_MAP='${TSYS_NETNS_MAP:-}')" >&2
  exit 255
fi

# --on A|B cmd...: cmd on that simulated host (set up below): its network namespace and a UTS namespace
# with its hostname, both named by TSYS_NETNS_MAP
if [ "${1:-}" = --on ]; then
  set -- "$(echo "${TSYS_NETNS_MAP:-}" | cut -d' ' -f"$([ "$2" = B ] && echo 2 || echo 1)")" "${@:3}"
  IFS== read -r addr ns name <<< "$1"
  shift
  exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$name" "$@"
fi

cd "$(dirname "$0")/.."
BUILD=${1:-${BUILD:-build}}
case $BUILD in /*) ;; *) BUILD=$PWD/$BUILD ;; esac
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_base_warn_component_unused=0
export TSYS_DIST_TIMEOUT=${TSYS_DIST_TIMEOUT:-60}
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID TSYS_DIST_LISTEN_ADDR TSYS_DIST_SHM
T_FAIL=5                           # TSYS_DIST_TIMEOUT of the failure cases
ADDR_A=10.77.0.1 ADDR_B=10.77.0.2 NET=10.77.0.0/24
HOST_A=hostA HOST_B=hostB
t_start=$(date +%s)
pass=0; fail=0

# ---- the two hosts (unique names: veth names have at most 15 characters) ------------------------
tag=tn$$
NS_A=tsys_${tag}_A NS_B=tsys_${tag}_B
TMP=$(mktemp -d /tmp/tsys_netns.XXXXXX)
made=""
cleanup() {
  local p
  for p in $(jobs -p); do kill "$p" 2> /dev/null; done        # ranks and mpiruns of this script still running
  for ns in $made; do                                          # what is left in our namespaces (orted, ranks)
    for p in $(ip netns pids "$ns" 2> /dev/null); do kill -9 "$p" 2> /dev/null; done
  done
  for ns in $made; do ip netns del "$ns" 2> /dev/null; done
  rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

cannot() {
  if [ "${CI_REQUIRE_NETNS:-0}" = 1 ]; then
    echo "test_netns: FAILED: cannot simulate two hosts: $1 (CI_REQUIRE_NETNS=1 requires it)"
    echo "0 passed, 1 failed"; exit 1
  fi
  echo "test_netns: skipped: cannot simulate two hosts: $1 (needs root, iproute2 and unshare; CI_REQUIRE_NETNS=1 makes this a failure)"
  echo "0 passed, 0 failed"; exit 0
}
command -v ip > /dev/null || cannot "no ip command (iproute2)"
command -v unshare > /dev/null || cannot "no unshare command (util-linux)"
err=$(ip netns add "$NS_A" 2>&1) || cannot "ip netns add: $err"
made="$NS_A"
err=$(ip netns add "$NS_B" 2>&1) || cannot "ip netns add: $err"
made="$NS_A $NS_B"
err=$( { ip link add "${tag}a" type veth peer name "${tag}b" &&
         ip link set "${tag}a" netns "$NS_A" && ip link set "${tag}b" netns "$NS_B" &&
         ip -n "$NS_A" addr add $ADDR_A/24 dev "${tag}a" && ip -n "$NS_B" addr add $ADDR_B/24 dev "${tag}b" &&
         ip -n "$NS_A" link set "${tag}a" up && ip -n "$NS_B" link set "${tag}b" up &&
         ip -n "$NS_A" link set lo up && ip -n "$NS_B" link set lo up; } 2>&1) || cannot "veth pair: $err"
err=$(ip netns exec "$NS_A" unshare --uts sh -c "hostname $HOST_A && hostname" 2>&1) && [ "$err" = $HOST_A ] || cannot "unshare --uts: $err"
export TSYS_NETNS_MAP="$ADDR_A=$NS_A=$HOST_A $ADDR_B=$NS_B=$HOST_B"
echo "test_netns: hosts $HOST_A ($NS_A, $ADDR_A) and $HOST_B ($NS_B, $ADDR_B), veth ${tag}a-${tag}b"

# sums a run: its summary line (the last of OUT), its exit code, extra failures
count() {
  local out=$1 rc=$2 extra=$3 what=$4 line p f
  line=$(echo "$out" | tail -n 1)
  p=$(echo "$line" | sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed$/\1/p')
  f=$(echo "$line" | sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed$/\2/p')
  if [ -z "$p" ]; then p=0; f=1; echo "$what did not finish (exit $rc)";
  elif [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; echo "$what exited $rc after its summary"; fi
  pass=$((pass + p)); fail=$((fail + f + extra))
}
# the hosts test_dist reports (rank 0's first line)
hosts_ok() {
  local out=$1 n=$2
  case $(basename "$3") in test_dist) ;; *) return 0 ;; esac
  if echo "$out" | grep -q "^test_dist: $n rank(s) on 2 host(s), paths: \(tcp\|mpi\)$"; then return 0; fi
  echo "FAILED: test_dist did not report its $n ranks on 2 hosts without shared memory (wanted 'test_dist: $n rank(s) on 2 host(s), paths: tcp' or 'mpi')"
  return 1
}

port=$((29500 + RANDOM % 1000))   # host A is a fresh namespace: only this script's jobs listen there
run_id=netns-$$-$RANDOM
secret=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')

# tcp_start PER LIMIT_S prog args...: 2*PER ranks, 0..PER-1 on host A and the rest on host B,
# started with torchrun-style variables; each rank's output in $TMP/rank<r>, its pid in ranks[r]
tcp_start() {
  local per=$1 limit=$2 n=$(($1 * 2)) r h
  shift 2
  port=$((port + 1))
  ranks=()
  for ((r = 0; r < n; r++)); do
    h=A; [ $r -ge "$per" ] && h=B
    RANK=$r WORLD_SIZE=$n LOCAL_RANK=$((r % per)) LOCAL_WORLD_SIZE=$per MASTER_ADDR=$ADDR_A MASTER_PORT=$port \
      TSYS_DIST_RUN_ID=$run_id TSYS_DIST_SECRET=$secret timeout "$limit" "$SELF" --on $h "$@" > "$TMP/rank$r" 2>&1 &
    ranks+=($!)
  done
}
# tcp_wait FROM TO: the exit codes of ranks FROM..TO-1 in rcs[r]
tcp_wait() {
  local r
  for ((r = $1; r < $2; r++)); do wait "${ranks[$r]}"; rcs[$r]=$?; done
}
# the other ranks' output, each line marked with its rank
others() {
  local n=$1 r
  for ((r = 1; r < n; r++)); do [ -s "$TMP/rank$r" ] && sed "s/^/  [rank $r] /" "$TMP/rank$r"; done
}

tcp_test() {   # tcp_test PER prog
  local per=$1 prog=$2 n=$(($1 * 2)) t0 out bad=0 r
  echo "== tcp: $(basename "$prog") at $n ranks, $per per host (torchrun-style variables, MASTER_ADDR=$ADDR_A)"
  t0=$(date +%s)
  rcs=()
  tcp_start "$per" 300 "$prog"
  tcp_wait 0 $n
  out=$(cat "$TMP/rank0")
  echo "$out"; others $n
  for ((r = 1; r < n; r++)); do
    [ "${rcs[$r]}" -ne 0 ] && { echo "FAILED: rank $r exited ${rcs[$r]}"; bad=1; }
  done
  hosts_ok "$out" $n "$prog" || bad=$((bad + 1))
  echo "-- $(( $(date +%s) - t0 )) s"
  count "$out" "${rcs[0]}" $bad "tcp $(basename "$prog") x$n"
}

# ---- MPI: mpirun on host A, orted on host B through the agent ----------------------------------
MPI_OK=""
if ! command -v mpirun > /dev/null; then MPI_NOTE="no mpirun"
elif ! mpirun --version 2>&1 | grep -q 'Open MPI'; then MPI_NOTE="mpirun is not Open MPI (the rsh agent is Open MPI's)"
elif ! ldd "$BUILD/test_dist" 2> /dev/null | grep -q libmpi; then MPI_NOTE="$BUILD/test_dist is built without MPI"
else MPI_OK=1; fi
mpi_run() {   # mpi_run PER LIMIT_S TIMEOUT prog args...: output in $TMP/mpi, exit code in mrc
  local per=$1 limit=$2 tmo=$3
  shift 3
  timeout "$limit" "$SELF" --on A mpirun --allow-run-as-root --oversubscribe -np $((per * 2)) --host $ADDR_A:$per,$ADDR_B:$per \
      --mca plm_rsh_agent "$SELF --agent" --mca btl tcp,self \
      --mca btl_tcp_if_include $NET --mca oob_tcp_if_include $NET \
      -x TSYS_DIST_TIMEOUT="$tmo" -x TSYS_NETNS_MAP "$@" > "$TMP/mpi" 2>&1 &
  wait $!; mrc=$?
}
mpi_test() {   # mpi_test PER prog
  local per=$1 prog=$2 n=$(($1 * 2)) t0 out bad=0
  echo "== mpi: $(basename "$prog") at $n ranks, $per per host (mpirun --host $ADDR_A:$per,$ADDR_B:$per, btl tcp,self)"
  t0=$(date +%s)
  mpi_run "$per" 300 "$TSYS_DIST_TIMEOUT" "$prog"
  # Open MPI's harmless "setpgid failed" warning (the agent's child has exec'd already) is dropped
  out=$(grep -v 'plm:rsh: Warning: setpgid' "$TMP/mpi")
  echo "$out"
  hosts_ok "$out" $n "$prog" || bad=1
  echo "-- $(( $(date +%s) - t0 )) s"
  count "$out" $mrc $bad "mpi $(basename "$prog") x$n"
}

# ---- failure cases: the last rank (on host B) of 4 exits or stalls after the first barrier --------
# fail_verdict NAME OK ELAPSED_MS: the case passes when its output was right (OK=1) and it ended within
# T_FAIL plus a margin for the start of 4 ranks on 2 shared cores
fail_verdict() {
  local name=$1 ok=$2 el=$3
  local limit=$((T_FAIL + 15))
  if [ "$ok" = 1 ] && [ "$el" -lt $((limit * 1000)) ]; then printf '  %-52s ok (%d ms)\n' "$name" "$el"; pass=$((pass + 1))
  else printf '  %-52s FAILED (%d ms, limit %d s)\n' "$name" "$el" "$limit"; fail=$((fail + 1)); fi
}
tcp_fail() {   # tcp_fail die|stall PATTERN
  local mode=$1 pat=$2 t0 el ok=1 r
  echo "== tcp: rank 3 on $HOST_B --$mode (4 ranks, TSYS_DIST_TIMEOUT=$T_FAIL)"
  t0=$(date +%s%N)
  rcs=()
  TSYS_DIST_TIMEOUT=$T_FAIL tcp_start 2 60 "$BUILD/test_dist" --$mode 3
  tcp_wait 0 2                          # host A's ranks end by themselves...
  el=$(( ($(date +%s%N) - t0) / 1000000 ))
  # ...the stalled rank does not (the dead one is gone already): stopped here if it is still our child
  [ "$(ps -o ppid= -p "${ranks[3]}" 2> /dev/null | tr -d ' ')" = $$ ] && kill "${ranks[3]}"
  tcp_wait 2 4
  for ((r = 0; r < 4; r++)); do [ -s "$TMP/rank$r" ] && sed "s/^/  [rank $r] /" "$TMP/rank$r"; done
  for r in 0 1; do
    [ "${rcs[$r]}" -ne 0 ] && [ "${rcs[$r]}" -ne 124 ] && grep -Eq "^rank $r: .*$pat" "$TMP/rank$r" ||
      { ok=0; echo "  rank $r (on $HOST_A) exited ${rcs[$r]} without reporting /$pat/"; }
  done
  fail_verdict "tcp: rank 3 on $HOST_B --$mode, $HOST_A's ranks name it" $ok "$el"
}
mpi_fail() {   # mpi_fail die|stall PATTERN
  local mode=$1 pat=$2 t0 el ok=1
  echo "== mpi: rank 3 on $HOST_B --$mode (4 ranks, TSYS_DIST_TIMEOUT=$T_FAIL)"
  t0=$(date +%s%N)
  mpi_run 2 60 $T_FAIL "$BUILD/test_dist" --$mode 3
  el=$(( ($(date +%s%N) - t0) / 1000000 ))
  grep -v 'plm:rsh: Warning: setpgid' "$TMP/mpi" | sed 's/^/  /'
  [ $mrc -ne 0 ] && [ $mrc -ne 124 ] || { ok=0; echo "  mpirun exited $mrc"; }
  tr '\n' ' ' < "$TMP/mpi" | grep -Eq "$pat" || { ok=0; echo "  no /$pat/ in the output"; }
  fail_verdict "mpi: rank 3 on $HOST_B --$mode, the job stops" $ok "$el"
}

tests=${TSYS_NETNS_TESTS:-test_dist test_mesh test_ddp test_fsdp}
for t in $tests; do
  [ -x "$BUILD/$t" ] || { echo "== $BUILD/$t: missing (make $BUILD/$t)"; fail=$((fail + 1)); }
done
for per in 1 2; do
  for t in $tests; do [ -x "$BUILD/$t" ] && tcp_test $per "$BUILD/$t"; done
done
if [ -x "$BUILD/test_dist" ]; then
  tcp_fail die "rank 3 closed the connection"
  tcp_fail stall "rank 3: nothing received within $T_FAIL s"
fi
if [ -n "$MPI_OK" ]; then
  for per in 1 2; do
    for t in $tests; do [ -x "$BUILD/$t" ] && mpi_test $per "$BUILD/$t"; done
  done
  # a rank that exits: mpirun names it; one that stalls: the others time out ("no reply from the group"). Any of
  # them: the first to report exits non-zero and mpirun stops the rest, which may not have printed yet
  mpi_fail die "process rank 3 |rank 3 \(pid [0-9]+\) exited"
  mpi_fail stall "rank [0-2]: .*no reply from the group within $T_FAIL s"
else
  echo "== mpi: skipped ($MPI_NOTE)"
fi
echo "test_netns: $(( $(date +%s) - t_start )) s"
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
