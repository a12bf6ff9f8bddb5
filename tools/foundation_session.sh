#!/usr/bin/env bash
# foundation_session.sh - one call on the GPU machine: the CUDA tests, the kernel lab's checks, a
# profiled step, and a same-run before/after of the timed rows (binaries of the previous tree in
# gpu/base, of this one in gpu/new: built on the development machine and carried).
#   tools/foundation_session.sh test profile compare
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tsys_out}; mkdir -p "$OUT"
export TSYS_PROGRESS=0
B=gpu/base N=gpu/new
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
# total_ms of the one jsonl row a command prints (fwd+bwd_ms for attn)
ms() { grep -o "\"$1\": [0-9.]*" | head -1 | awk '{print $2}'; }
for part in "$@"; do
  echo "=== $part ($(date +%T))"
  case "$part" in
  test) timeout 400 $N/test_cuda > "$OUT/test_cuda.log" 2>&1; grep -v " ok$" "$OUT/test_cuda.log" | tail -45
        timeout 200 $N/flash_lab test > "$OUT/flash_lab_test.log" 2>&1; grep -E "FAIL|passed|impl" "$OUT/flash_lab_test.log" | tail -8 ;;
  profile) mkdir -p "$OUT/prof"
        timeout 300 $N/e2e_cuda --model 2.7B --context-length 256 --mode train --dtype bf16 --warmup 3 --steps 5 --no-sgemm --profile "$OUT/prof" > "$OUT/profile.log" 2>&1
        head -c 6000 "$OUT/profile.log"; cp "$OUT"/prof/*.md "$OUT/" 2>/dev/null; gzip -c "$OUT"/prof/*.json > "$OUT/trace_2.7B_bf16.json.gz" 2>/dev/null; rm -rf "$OUT/prof" ;;
  compare)
    E="--context-length 256 --mode train --dtype bf16 --compile yes --warmup 3 --steps 10 --no-sgemm --format jsonl"
    for round in 1 2; do
      for v in base new; do
        d=$B; [ $v = new ] && d=$N
        a=$(timeout 200 $d/e2e_cuda --model 2.7B $E 2>/dev/null | ms total_ms)
        s=$(timeout 100 $d/e2e_cuda --model small $E 2>/dev/null | ms total_ms)
        l=$(timeout 100 $d/attn_cuda --sweep leaderboard --format jsonl 2>/dev/null | grep "\"impl\": \"flash\"" | ms fwd+bwd_ms)
        echo "round $round $v: 2.7B bf16 compiled train ${a:-?} ms | small bf16 compiled train ${s:-?} ms | flash leaderboard fwd+bwd ${l:-?} ms" | tee -a "$OUT/compare.log"
      done
    done ;;
  *) echo "unknown part $part" ;;
  esac
done
