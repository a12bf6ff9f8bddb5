#!/usr/bin/env bash
# torchrun_check.sh - on the GPU machine (torch 2.11, 2 GPUs): tsys's CUDA binaries started by the real
# torchrun, whose agent holds MASTER_PORT with its TCPStore (TORCHELASTIC_USE_AGENT_STORE=True), so the
# ranks must rendezvous through that store. Two runs:
#   1. static rendezvous (torchrun's default): build/ddp_cuda, a small model for a couple of steps;
#   2. --standalone (c10d rendezvous, localhost, a random port, a uuid run id): build/test_dist_cuda.
# Builds the two binaries first (make; NO_BUILD=1 skips it). Logs go to $OUT when set, else build/torchrun_check/.
# Prints one verdict line per run ("PASS ..." / "FAIL ..." / "SKIP ..."); exits non-zero when a run failed.
#   dev/torchrun_check.sh
set -u
cd "$(dirname "$0")/.." || exit 1
LOG=${OUT:-build/torchrun_check}
mkdir -p build "$LOG"
export TSYS_DIST_TIMEOUT=${TSYS_DIST_TIMEOUT:-120}   # a rendezvous that does not form fails in 2 minutes
TORCHRUN=${TORCHRUN:-torchrun}
fails=0

if ! command -v "$TORCHRUN" > /dev/null; then echo "SKIP torchrun_check: no torchrun on PATH (set TORCHRUN=...)"; exit 1; fi
gpus=$(nvidia-smi -L 2> /dev/null | grep -c GPU)
echo "torch $(python3 -c 'import torch; print(torch.__version__)' 2> /dev/null || echo '?'), $gpus GPU(s), logs in $LOG"
if [ "$gpus" -lt 2 ]; then echo "SKIP torchrun_check: $gpus GPU(s), the runs need 2"; exit 1; fi

if [ "${NO_BUILD:-0}" != 1 ]; then
  if ! make -j"$(nproc)" build/ddp_cuda build/test_dist_cuda > "$LOG/build.log" 2>&1; then
    echo "FAIL build: make build/ddp_cuda build/test_dist_cuda (see $LOG/build.log)"
    tail -20 "$LOG/build.log"
    exit 1
  fi
fi

# verdict NAME LOG RC OK SUMMARY: PASS when the run exited 0 and OK is 1; else FAIL with the likely cause
verdict() {
  local name=$1 log=$2 rc=$3 ok=$4 summary=$5 why
  if [ "$rc" -eq 0 ] && [ "$ok" -eq 1 ]; then echo "PASS $name ($summary)"; return; fi
  fails=$((fails + 1))
  if grep -q "Address already in use" "$log"; then why="rank 0 tried to bind MASTER_PORT, which torchrun's agent holds"
  elif [ "$rc" -eq 124 ]; then why="timed out"
  else why=$(grep -E "tsys_dist|rendezvous|error|FAIL" "$log" | grep -v '^W[0-9]' | head -n 1 | cut -c1-160); fi
  echo "FAIL $name (exit $rc, $summary: ${why:-no error line}; log $log)"
}

# 1. static rendezvous: MASTER_ADDR=127.0.0.1, MASTER_PORT held by the agent's store, run id "none"
port=$((20000 + RANDOM % 20000))
log1=$LOG/torchrun_ddp_cuda.log
timeout 600 "$TORCHRUN" --nproc_per_node 2 --master_port "$port" --no-python build/ddp_cuda --device cuda --model small \
  --strategy naive,bucketed --bucket-mb 10 --context-length 128 --batch-size 2 --warmup 1 --steps 2 > "$log1" 2>&1
rc=$?
# rank 0 prints "ddp: 2 ranks (engine), cuda (GPU) ..." and one row per configuration (naive, bucketed 10 MB),
# the last column its status
ranks=$(grep -m1 -o 'ddp: 2 ranks ([a-z]*)' "$log1")
okrows=$(grep -cE '\| ok \|$' "$log1")
ok=0; if [ -n "$ranks" ] && [ "$okrows" -eq 2 ]; then ok=1; fi
verdict "torchrun --nproc_per_node 2 build/ddp_cuda" "$log1" $rc $ok "${ranks:-no 'ddp: 2 ranks' line}, $okrows of 2 rows ok"

# 2. --standalone: c10d rendezvous on a random port, MASTER_ADDR=localhost, a uuid run id
log2=$LOG/torchrun_standalone_test_dist_cuda.log
timeout 600 "$TORCHRUN" --standalone --nproc_per_node 2 --no-python build/test_dist_cuda > "$log2" 2>&1
rc=$?
last=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$log2" | tail -n 1)
ok=0; if echo "$last" | grep -q ' 0 failed$'; then ok=1; fi
verdict "torchrun --standalone --nproc_per_node 2 build/test_dist_cuda" "$log2" $rc $ok "${last:-no 'N passed, N failed' line}"

[ $fails -eq 0 ]
