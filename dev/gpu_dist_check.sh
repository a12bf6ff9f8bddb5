#!/usr/bin/env bash
# gpu_dist_check.sh - tsys_dist on a 2-GPU machine as it behaves between hosts: NCCL forced onto its
# network transport (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1), the distributed tests and the xl step that
# way beside the default transport, and a rank killed mid-step (the survivor must end with an error
# naming it within TSYS_DIST_TIMEOUT, not hang). Objects built on the development machine come in
# build/gpu (tsys_impl_cuda.o and the programs' objects) and are linked here.
#   dev/gpu_dist_check.sh link tests step kill
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tsys_out}; mkdir -p "$OUT"
G=build/gpu
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
NET="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"
summary=()
note() { summary+=("$*"); echo "$*"; }
for part in "$@"; do
  echo "=== $part ($(date +%T))"
  case "$part" in
  link)
    for p in ${LINK:-test_dist test_ddp test_fsdp ddp}; do
      nvcc -O2 -gencode arch=compute_90a,code=sm_90a $G/${p}_cuda.o $G/tsys_impl_cuda.o -o $G/${p}_cuda -lcublasLt -lcublas -lgomp -lnccl $(mpicc --showme:link) || note "link $p: FAILED"
    done ;;
  tests)
    for t in test_dist test_ddp test_fsdp; do
      for tr in ${TRANSPORTS:-net default}; do
        log="$OUT/${t}_${tr}.log"
        env $([ $tr = net ] && echo $NET) NCCL_DEBUG=INFO TSYS_DIST_TIMEOUT=120 timeout 400 mpirun --oversubscribe -np 2 $G/${t}_cuda > "$log" 2>&1
        via=$(grep -o "via NET/[A-Za-z]*\|via P2P/[A-Za-z/]*\|via SHM" "$log" | sort | uniq -c | tr '\n' ' ')
        note "$t nccl 2 ranks, $tr transport: $(tail -n 1 "$log") [$via]"
      done
    done ;;
  step)   # the xl training step, bf16, 2 ranks, each strategy: the default transport and the network one
    for tr in default net; do
      env $([ $tr = net ] && echo $NET) TSYS_DIST_TIMEOUT=120 timeout 500 $G/ddp_cuda --device cuda --nproc 2 --model xl --dtype bf16 \
        --strategy ${STRATEGIES:-flat,bucketed,zero1,fsdp} --bucket-mb 100 --warmup 3 --steps 5 --format md > "$OUT/step_$tr.md" 2>&1
      echo "--- $tr"; grep "^|" "$OUT/step_$tr.md"
      note "xl step, $tr transport: exit $? ($(grep -c '^| ' "$OUT/step_$tr.md") table lines)"
    done ;;
  kill)   # two ranks started by hand (no launcher to stop the survivor); rank 1 killed with SIGKILL mid-step
    KB=${KILL_BIN:-ddp}   # ddp_oldsync: the driver as it was, waiting with tsys_sync
    for tr in ${TRANSPORTS:-net default}; do
      port=$((20000 + RANDOM % 20000))
      common="WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port TSYS_DIST_RUN_ID=killtest TSYS_DIST_TIMEOUT=60"
      env $([ $tr = net ] && echo $NET) $common RANK=1 LOCAL_RANK=1 $G/${KB}_cuda --device cuda --model xl --dtype bf16 --strategy bucketed --bucket-mb 100 --warmup 2 --steps 3000 --progress on > "$OUT/kill_${KB}_${tr}_r1.log" 2>&1 &
      p1=$!
      env $([ $tr = net ] && echo $NET) $common RANK=0 LOCAL_RANK=0 timeout ${KILL_LIMIT:-300} $G/${KB}_cuda --device cuda --model xl --dtype bf16 --strategy bucketed --bucket-mb 100 --warmup 2 --steps 3000 --progress on > "$OUT/kill_${KB}_${tr}_r0.log" 2>&1 &
      p0=$!
      for i in $(seq 1 120); do grep -q "step [1-9][0-9]* of" "$OUT/kill_${KB}_${tr}_r0.log" 2>/dev/null && break; sleep 1; done
      sleep 5
      kill -9 $p1; t0=$(date +%s.%N)
      wait $p0; rc=$?; t1=$(date +%s.%N)
      wait $p1 2>/dev/null
      err=$(tr '\r' '\n' < "$OUT/kill_${KB}_${tr}_r0.log" | grep -o "error: .*" | head -n 2 | tr '\n' ' ' | cut -c1-300)
      note "$KB: kill rank 1 mid-step, $tr transport: rank 0 exit $rc after $(awk "BEGIN{printf \"%.1f\", $t1 - $t0}") s (124 = hung until timeout): $err"
    done ;;
  torchrun)
    cp $G/ddp_cuda $G/test_dist_cuda build/
    NO_BUILD=1 dev/torchrun_check.sh > "$OUT/torchrun.log" 2>&1; cat "$OUT/torchrun.log"
    note "torchrun: $(grep -E '^(PASS|FAIL|SKIP)' "$OUT/torchrun.log" | tr '\n' ' ')" ;;
  esac
done
echo "=== summary"
printf '%s\n' "${summary[@]}"
