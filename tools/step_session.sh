#!/usr/bin/env bash
# step_session.sh - one device call for the training-step work: CUDA tests, kernel rates, the bf16
# step sweep, the fp32 step's memory with the optimizer in backward, torch.compile in the same call.
#   tools/step_session.sh test perf e2e ctx mem torch
# Binaries come from $BIN (default gpu/step: built on the dev machine, carried over); $OUT gets the
# logs and CSVs; a short table of each part prints as it ends.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tsys_out}; mkdir -p "$OUT"
BIN=${BIN:-gpu/step}
export TSYS_PROGRESS=0 RESULTS_DIR="$OUT" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
cols() { python3 - "$1" <<'EOF'
import csv, sys
keep = ["model", "context", "dtype", "compiled", "opt_in_bwd", "lowp_copies", "ckpt", "fwd_ms", "bwd_ms", "opt_ms", "total_ms", "peak_MiB", "pred_MiB", "status"]
rows = list(csv.DictReader(open(sys.argv[1])))
print(" | ".join(keep))
for r in rows: print(" | ".join(r.get(k, "") for k in keep))
EOF
}
E="--mode train --warmup 3 --steps 10 --no-sgemm --format csv"
for part in "$@"; do
  echo "=== $part ($(date +%T))"
  case "$part" in
  test) timeout 400 $BIN/test_cuda > "$OUT/test_cuda.log" 2>&1; grep -v " ok$" "$OUT/test_cuda.log" | grep -v "^    " | tail -30 ;;
  perf) timeout 120 $BIN/test_cuda perf_kernels > "$OUT/perf_kernels.log" 2>&1; grep -E "adamw|rmsnorm|rope|transpose|copy" "$OUT/perf_kernels.log" ;;
  e2e) timeout 500 $BIN/e2e_cuda --model small,xl,2.7B --context-length 256 --dtype bf16 --compile no,yes --lowp-copies yes $E > "$OUT/e2e.csv" 2> "$OUT/e2e.log"
       cols "$OUT/e2e.csv" ;;
  ctx) timeout 500 $BIN/e2e_cuda --model small,2.7B --context-length 128,512,1024 --dtype bf16 --compile yes --lowp-copies yes $E > "$OUT/ctx.csv" 2> "$OUT/ctx.log"
       cols "$OUT/ctx.csv" ;;
  mem) timeout 500 $BIN/e2e_cuda --model 2.7B --context-length 256 --dtype fp32 --compile yes --opt-in-backward no,free --checkpoint none,selective --mode train --warmup 2 --steps 5 --no-sgemm --format csv \
         > "$OUT/mem.csv" 2> "$OUT/mem.log"; cols "$OUT/mem.csv" ;;
  prof) mkdir -p "$OUT/prof"
        timeout 300 $BIN/e2e_cuda --model ${PROF_MODELS:-2.7B} --context-length 256 --dtype bf16 --lowp-copies yes --mode train --warmup 2 --steps 3 --no-sgemm \
          --format csv --profile "$OUT/prof" > "$OUT/prof_rows.csv" 2> "$OUT/prof.log"; rm -f "$OUT"/prof/*.json
        for f in "$OUT"/prof/*.md; do sed -n '/^| kernel |/,/^$/p' "$f" | head -24; done ;;
  torch) timeout ${TORCH_TIMEOUT:-500} python3 tests/ref/torch_baseline.py compile ${TORCH_MODELS:-small,xl,2.7B} > "$OUT/torch_compile.log" 2>&1; grep '{' "$OUT/torch_compile.log" ;;
  torch_ctx) timeout ${TORCH_TIMEOUT:-550} python3 tests/ref/torch_baseline.py compile_ctx ${TORCH_MODELS:-small,2.7B} ${TORCH_CTX:-128,512,1024} > "$OUT/torch_compile_ctx.log" 2>&1; grep '{' "$OUT/torch_compile_ctx.log" ;;
  *) echo "unknown part $part" ;;
  esac
done
