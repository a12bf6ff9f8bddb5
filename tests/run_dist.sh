#!/usr/bin/env bash
# The distributed tests, as `make test` runs them: every program of TSYS_DIST_TESTS at 2 and 4 ranks on
# every CPU engine (shared memory; MPI without it; TCP without it, through the built-in launcher), the
# same under ThreadSanitizer (TSYS_DIST_TSAN_TESTS), test_dist and test_fsdp also alone (a group of one),
# test_dist through the launcher, its failure modes (tests/test_dist_fail.sh), and last the three
# programs across two simulated hosts (tests/test_netns.sh: network namespaces joined by a veth pair,
# TCP and MPI; skipped without root unless CI_REQUIRE_NETNS=1). Prints each run's output and, last,
# the sum of their "N passed, N failed" lines.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
tests=${TSYS_DIST_TESTS:-$BUILD/test_dist}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1   # CI runs as root
export OMPI_MCA_btl_base_warn_component_unused=0
export TSYS_DIST_TIMEOUT=${TSYS_DIST_TIMEOUT:-60}                  # a hang fails in a minute, not five
# test_ddp's and test_fsdp's sharded snapshots (tests/state_dist.h): each world size leaves its snapshot
# here and resumes from the other sizes' (2 -> 4 in the runs below, 4 -> 2 and both -> 1 after them)
own_state_dir=; [ -z "${TSYS_TEST_STATE_DIR:-}" ] && own_state_dir=$(mktemp -d) && export TSYS_TEST_STATE_DIR=$own_state_dir
pass=0; fail=0
run() {
  echo "== $*"
  if declare -F "$1" >/dev/null; then out=$("$@" 2>&1); rc=$?   # a function of this script (its commands have their own limits)
  else out=$(timeout 900 "$@" 2>&1); rc=$?; fi
  echo "$out"
  line=$(echo "$out" | tail -n 1)
  p=$(echo "$line" | sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed$/\1/p')
  f=$(echo "$line" | sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed$/\2/p')
  if [ -z "$p" ]; then p=0; f=1; echo "$* did not finish (exit $rc)";
  elif [ $rc -ne 0 ] && [ "$f" -eq 0 ]; then f=1; echo "$* exited $rc after its summary (a sanitizer report?)"; fi
  pass=$((pass + p)); fail=$((fail + f))
}
uses_mpi() { command -v mpirun >/dev/null && ldd "$1" 2>/dev/null | grep -q libmpi; }
# One program at 2 and 4 ranks on each engine: shared memory (mpirun, or the launcher without MPI),
# MPI alone and TCP alone (TSYS_DIST_SHM=0: the path ranks on different hosts take).
engines() {
  local t=$1 n
  for n in 2 4; do
    if uses_mpi "$t"; then
      run mpirun --oversubscribe -np $n "$t"
      run mpirun --oversubscribe -x TSYS_DIST_SHM=0 -np $n "$t"
    else
      run "$t" --nproc $n
    fi
    run env TSYS_DIST_SHM=0 "$t" --nproc $n
  done
}
for t in $tests; do engines "$t"; done
for t in $tests; do case "$t" in */test_ddp|*/test_fsdp) run "$t" --nproc 2 state_sharded ;; esac; done   # 4 -> 2
# ThreadSanitizer: a report fails the run (exit 66 after the summary, or no summary)
export TSAN_OPTIONS="halt_on_error=1 exitcode=66 ignore_noninstrumented_modules=1 suppressions=$PWD/tests/tsan.supp"
for t in ${TSYS_DIST_TSAN_TESTS:-}; do engines "$t"; done
unset TSAN_OPTIONS
run "$BUILD/test_dist"
run "$BUILD/test_dist" --nproc 3
# sub-groups and meshes of an odd world (3 x 1, groups of one and two), alone and at 3 ranks
case " $tests " in *"/test_mesh "*) run "$BUILD/test_mesh"; run "$BUILD/test_mesh" --nproc 3; run env TSYS_DIST_SHM=0 "$BUILD/test_mesh" --nproc 3 ;; esac
# a world size that is not a power of two: FSDP's fp32 steps bit for bit against the micro-batch average
case " $tests " in *"/test_fsdp "*)
  if uses_mpi "$BUILD/test_fsdp"; then run mpirun --oversubscribe -np 3 "$BUILD/test_fsdp" _fp32; else run "$BUILD/test_fsdp" --nproc 3 _fp32; fi ;; esac
run "$BUILD/test_rendezvous"        # who may join a TCP rendezvous (it starts its own ranks)
# FSDP in a group of one takes its own path (casts and sums in place of collectives, units kept from
# forward to backward): alone too
case " $tests " in *"/test_fsdp "*) run "$BUILD/test_fsdp" ;; esac
# torchrun-style variables set by hand (no launcher): rank 1 first, it retries until rank 0 listens
torchrun_style() {
  local port=$((20000 + RANDOM % 20000))
  RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 MASTER_ADDR=localhost MASTER_PORT=$port timeout 300 "$BUILD/test_dist" all_reduce_f32 > /dev/null 2>&1 &
  local pid=$!
  sleep 0.3
  RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=localhost MASTER_PORT=$port timeout 300 "$BUILD/test_dist" all_reduce_f32
  local rc=$?
  wait $pid || rc=1
  return $rc
}
run torchrun_style
run tests/test_dist_fail.sh
run tests/test_netns.sh "$BUILD"   # two hosts: the rendezvous, MPI and TCP across a veth pair (2-3 min on 2 cores)
[ -n "$own_state_dir" ] && rm -rf "$own_state_dir"
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
