#!/usr/bin/env bash
# gpu_session.sh - one call on the GPU machine: build the CUDA binaries, then run the named parts.
#   tools/gpu_session.sh build test e2e torch ...
# Parts: test (CUDA tests), e2e (our end-to-end sweep), torch (PyTorch eager baseline, same run),
# compile (torch.compile baseline), flash (FlashAttention lab + PyTorch SDPA).
# Logs and JSON lines go to $OUT (the device tool brings them back); a short summary prints last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tsys_out}; mkdir -p "$OUT"
export TSYS_PROGRESS=0 RESULTS_DIR="$OUT" PYTHONUNBUFFERED=1
MODELS=${MODELS:-small,medium,large,xl,2.7B}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
for part in "$@"; do
  echo "=== $part ($(date +%T))"
  case "$part" in
  build) make -j16 cuda > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; } ;;
  test) timeout 300 ./build/test_cuda > "$OUT/test_cuda.log" 2>&1; grep -v " ok$" "$OUT/test_cuda.log" | tail -40 ;;
  e2e) timeout ${E2E_TIMEOUT:-500} ./build/e2e_cuda --model "$MODELS" --context-length 256 --mode ${MODES:-forward,forward-backward,train} \
         --dtype ${DTYPES:-fp32,bf16} --compile ${COMPILE:-no,yes} --attn ${ATTN:-naive} --warmup ${WARMUP:-3} --steps ${STEPS:-10} --format jsonl > "$OUT/e2e.jsonl"
     python3 tools/table.py "$OUT/e2e.jsonl" ;;
  torch) timeout 500 python3 tests/ref/torch_baseline.py e2e > "$OUT/torch_e2e.log" 2>&1; grep -c '{' "$OUT/torch_e2e.log" ;;
  compile) timeout ${TORCH_TIMEOUT:-500} python3 tests/ref/torch_baseline.py compile ${TORCH_MODELS:-} > "$OUT/torch_compile.log" 2>&1; grep -c '{' "$OUT/torch_compile.log" ;;
  torch_bf16) timeout ${TORCH_TIMEOUT:-500} python3 tests/ref/torch_baseline.py e2e_bf16 ${TORCH_MODELS:-} > "$OUT/torch_bf16.log" 2>&1; grep -c '{' "$OUT/torch_bf16.log" ;;
  compare) python3 tools/table.py "$OUT/e2e.jsonl" "$OUT"/torch_*.log ;;
  *) echo "unknown part $part" ;;
  esac
done
