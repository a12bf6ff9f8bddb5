#!/usr/bin/env bash
# gpu_step.sh - one call on the GPU machine for the single-GPU work: build, the CUDA tests and the kernel lab's
# checks, the end-to-end sweep beside PyTorch (same call), memory and profiles, and a same-run before/after.
#   dev/gpu_step.sh build test e2e torch compile table ...
# Parts:
#   build       make cuda here (or carry binaries built elsewhere in $BIN and skip it)
#   test        $BIN/test_cuda (name filter: $FILTER) and $BIN/flash_lab test
#   e2e         our end-to-end sweep ($MODELS, $MODES, $DTYPES, $COMPILE, $ATTN) as JSON lines, then its table
#   torch, compile, torch_bf16   the PyTorch eager / torch.compile / bf16 baselines (tests/ref/torch_baseline.py)
#   table       our rows beside PyTorch's of this call (dev/e2e_table.py)
#   memory      the memory sweep ($MEM_MODELS, $MEM_CONTEXT) beside PyTorch's peaks
#   profile     a profiled training step ($PROF_MODELS; more e2e flags in $PROF_ARGS): the kernel tables
#   grads       the compiled bf16 training step ($MODELS, kept copies) with fp32 and bf16 weight gradients
#               (--lowp-grads no,yes) and the optimizer after or inside backward (--opt-in-backward $IN_BACKWARD,
#               default no), alternating, $ROUNDS times (default 2)
#   ab          before/after in one call: the binaries of the previous tree in $BASE (default gpu/base) against
#               $BIN's, alternating, $ROUNDS times: the bf16 compiled training step of $AB_MODELS (default 2.7B,small;
#               more e2e flags in $AB_ARGS) and, where attn_cuda was carried, the flash leaderboard fwd+bwd
# Binaries come from $BIN (default build); logs and JSON lines go to $OUT; a short summary prints as each part ends.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tsys_out}; mkdir -p "$OUT"
BIN=${BIN:-build}; BASE=${BASE:-gpu/base}
export RESULTS_DIR="$OUT" PYTHONUNBUFFERED=1
MODELS=${MODELS:-small,medium,large,xl,2.7B}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
ms() { grep -o "\"$1\": [0-9.]*" | head -1 | awk '{print $2}'; }   # the first value of a key in JSON lines
for part in "$@"; do
  echo "=== $part ($(date +%T))"
  case "$part" in
  build) make -j16 cuda > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; } ;;
  test) timeout 400 $BIN/test_cuda ${FILTER:-} > "$OUT/test_cuda.log" 2>&1; grep -v " ok$" "$OUT/test_cuda.log" | grep -v "^    " | tail -40
        timeout 300 $BIN/flash_lab test > "$OUT/flash_lab_test.log" 2>&1; grep -E "FAIL|passed|implementation" "$OUT/flash_lab_test.log" | tail -8 ;;
  e2e) timeout ${E2E_TIMEOUT:-500} $BIN/e2e_cuda --model "$MODELS" --context-length 256 --mode ${MODES:-forward,forward-backward,train} \
         --dtype ${DTYPES:-fp32,bf16} --compile ${COMPILE:-no,yes} --attn ${ATTN:-naive} --warmup ${WARMUP:-3} --steps ${STEPS:-10} --format jsonl > "$OUT/e2e.jsonl"
     python3 dev/e2e_table.py "$OUT/e2e.jsonl" ;;
  torch) timeout ${TORCH_TIMEOUT:-500} python3 tests/ref/torch_baseline.py e2e > "$OUT/torch_e2e.log" 2>&1; grep -c '{' "$OUT/torch_e2e.log" ;;
  compile) timeout ${TORCH_TIMEOUT:-500} python3 tests/ref/torch_baseline.py compile ${TORCH_MODELS:-} > "$OUT/torch_compile.log" 2>&1; grep -c '{' "$OUT/torch_compile.log" ;;
  torch_bf16) timeout ${TORCH_TIMEOUT:-500} python3 tests/ref/torch_baseline.py e2e_bf16 ${TORCH_MODELS:-} > "$OUT/torch_bf16.log" 2>&1; grep -c '{' "$OUT/torch_bf16.log" ;;
  table) python3 dev/e2e_table.py "$OUT/e2e.jsonl" "$OUT"/torch_*.log ;;
  memory)
    mkdir -p "$OUT/mem"
    timeout 420 $BIN/memory_cuda --model "${MEM_MODELS:-2.7B}" --context-length "${MEM_CONTEXT:-128,256,512}" --mode forward,train --dtype fp32,bf16 \
        --out "$OUT/mem" --format csv --oom-ok > "$OUT/memory.csv" 2> "$OUT/memory_details.md"
    cat "$OUT/memory.csv"
    if python3 -c 'import torch' 2>/dev/null; then
      timeout 420 python3 tests/ref/memory_torch.py --model "${MEM_MODELS:-2.7B}" --context-length "${MEM_CONTEXT:-128,256,512}" --mode forward,train \
          --dtype fp32,bf16 --format csv > "$OUT/memory_torch.csv" 2>&1
      cat "$OUT/memory_torch.csv"
    fi
    (cd "$OUT/mem" && tar czf "$OUT/memory_plots.tgz" *.svg 2>/dev/null); rm -rf "$OUT/mem" ;;
  profile)
    mkdir -p "$OUT/prof"
    timeout 300 $BIN/e2e_cuda --model ${PROF_MODELS:-2.7B} --context-length 256 --dtype bf16 --mode train --warmup 2 --steps 3 --no-sgemm ${PROF_ARGS:-} \
      --format csv --profile "$OUT/prof" > "$OUT/prof_rows.csv" 2> "$OUT/prof.log"; rm -f "$OUT"/prof/*.json
    for f in "$OUT"/prof/*.md; do sed -n '/^| kernel |/,/^$/p' "$f" | head -24; done ;;
  grads)
    for round in $(seq ${ROUNDS:-2}); do
      for g in no yes; do
        timeout 300 $BIN/e2e_cuda --model "$MODELS" --context-length 256 --mode train --dtype bf16 --compile yes --lowp-copies yes --lowp-grads $g \
          --opt-in-backward ${IN_BACKWARD:-no} --warmup 3 --steps ${STEPS:-10} --no-sgemm --format jsonl 2>> "$OUT/grads.log" | tee -a "$OUT/grads.jsonl" \
          | python3 -c 'import json,sys
for l in sys.stdin:
    r = json.loads(l); print("round '$round' lowp-grads %-3s opt-in-backward %-3s %-6s %s ms  peak %s MiB (predicted %s)" % (r["lowp_grads"], r["opt_in_bwd"], r["model"], r["total_ms"], r["peak_MiB"], r["pred_MiB"]))'
      done
    done ;;
  ab)
    E="--context-length 256 --mode train --dtype bf16 --compile yes --warmup 3 --steps 10 --no-sgemm --format jsonl ${AB_ARGS:-}"
    for round in $(seq ${ROUNDS:-2}); do
      for v in base new; do
        d=$BASE; [ $v = new ] && d=$BIN
        rows=$(timeout 400 $d/e2e_cuda --model "${AB_MODELS:-2.7B,small}" $E 2>> "$OUT/ab.err" | tee -a "$OUT/ab_$v.jsonl" \
               | python3 -c 'import json,sys; print("  ".join("%s %s" % (r["model"], r["total_ms"]) for r in map(json.loads, sys.stdin)))')
        l=""; [ -x $d/attn_cuda ] && l=" | flash leaderboard fwd+bwd $(timeout 100 $d/attn_cuda --sweep leaderboard --format jsonl 2>/dev/null | grep "\"impl\": \"flash\"" | ms fwd+bwd_ms) ms"
        echo "round $round $v: bf16 compiled train ms: ${rows:-?}$l" | tee -a "$OUT/ab.log"
      done
    done ;;
  *) echo "unknown part $part" ;;
  esac
done
