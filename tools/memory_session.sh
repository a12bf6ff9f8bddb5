#!/usr/bin/env bash
# memory_session.sh - one call on the GPU machine for the profiling and memory work: the CUDA tests of
# the memory tracker and profiler, the memory_profiling sweep beside PyTorch's peaks, a part of the
# nsys_profile sweep, and a same-run before/after of timed e2e rows (binaries of the previous tree in
# gpu/base, of this one in gpu/new: built on the development machine and carried).
#   tools/memory_session.sh test memory profile compare overlap
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tsys_out}; mkdir -p "$OUT"
export TSYS_PROGRESS=0
B=gpu/base N=gpu/new
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ms() { grep -o "\"$1\": [0-9.]*" | head -1 | awk '{print $2}'; }
for part in "$@"; do
  echo "=== $part ($(date +%T))"
  case "$part" in
  test)
    for f in memory profiler graph alloc model; do   # name filters of test_cuda
      timeout 300 $N/test_cuda $f > "$OUT/test_cuda_$f.log" 2>&1; echo "test_cuda $f: $(tail -n 1 "$OUT/test_cuda_$f.log")"; grep -A3 FAIL "$OUT/test_cuda_$f.log" | head -20
    done ;;
  memory)
    mkdir -p "$OUT/mem"
    timeout 420 $N/memory_cuda --model "${MEM_MODELS:-2.7B}" --context-length "${MEM_CONTEXT:-128,256,512}" --mode forward,train --dtype fp32,bf16 \
        --out "$OUT/mem" --format csv --oom-ok > "$OUT/memory.csv" 2> "$OUT/memory_details.md"
    cat "$OUT/memory.csv"
    if python3 -c 'import torch' 2>/dev/null; then
      timeout 420 python3 tests/ref/memory_torch.py --model "${MEM_MODELS:-2.7B}" --context-length "${MEM_CONTEXT:-128,256,512}" --mode forward,train \
          --dtype fp32,bf16 --format csv > "$OUT/memory_torch.csv" 2>&1
      cat "$OUT/memory_torch.csv"
    fi
    (cd "$OUT/mem" && tar czf "$OUT/memory_plots.tgz" *.svg cuda_*_ctx256_train_bf16_*.json 2>/dev/null); rm -rf "$OUT/mem" ;;
  profile)
    mkdir -p "$OUT/prof"
    timeout 400 $N/e2e_cuda --model "${PROF_MODELS:-small,2.7B}" --context-length "${PROF_CONTEXT:-128,512}" --mode forward,forward-backward,train \
        --dtype fp32 --attn naive --warmup 2 --steps 3 --no-sgemm --format csv --oom-ok --profile "$OUT/prof" > "$OUT/profile_rows.csv" 2> "$OUT/profile.log"
    cat "$OUT/profile_rows.csv"; cat "$OUT/prof/summary.csv"
    tar czf "$OUT/profile_tables.tgz" -C "$OUT/prof" $(cd "$OUT/prof" && ls *.md) 2>/dev/null; rm -f "$OUT"/prof/*.json ;;
  overlap)   # the optimizer inside backward: its CUDA tests, then the training step with and without it, same call
    for f in optimizer graph_train; do
      timeout 300 $N/test_cuda $f > "$OUT/test_cuda_$f.log" 2>&1; echo "test_cuda $f: $(tail -n 1 "$OUT/test_cuda_$f.log")"; grep -A3 FAIL "$OUT/test_cuda_$f.log" | head -20
    done
    timeout 400 $N/e2e_cuda --model ${OV_MODELS:-small,xl,2.7B} --context-length 256 --mode train --dtype bf16 --compile no,yes --opt-in-backward no,yes \
        --warmup 3 --steps 10 --no-sgemm --format csv > "$OUT/overlap.csv" 2> "$OUT/overlap.log"; cut -d, -f2,8,9,11,15,16,21 "$OUT/overlap.csv" ;;
  compare)
    E="--context-length 256 --mode train --dtype bf16 --compile yes --warmup 3 --steps 10 --no-sgemm --format jsonl"
    for round in 1 2; do
      for v in base new; do
        d=$B; [ $v = new ] && d=$N
        a=$(timeout 200 $d/e2e_cuda --model 2.7B $E 2>/dev/null | ms total_ms)
        e=$(timeout 200 $d/e2e_cuda --model 2.7B ${E/--compile yes/--compile no} 2>/dev/null | ms total_ms)
        s=$(timeout 100 $d/e2e_cuda --model small $E 2>/dev/null | ms total_ms)
        echo "round $round $v: 2.7B bf16 train compiled ${a:-?} ms, eager ${e:-?} ms | small bf16 compiled train ${s:-?} ms" | tee -a "$OUT/compare.log"
      done
    done ;;
  *) echo "unknown part $part" ;;
  esac
done
