#!/usr/bin/env bash
# bench.sh - sweeps that print the tables of the CS336 report.
#   ./bench.sh [section ...]      sections: e2e warmup precision (default: all three)
# Environment: DEVICE=cpu|cuda (default: cuda when a GPU and nvcc are present), MODELS, CONTEXT,
# STEPS, WARMUP, FORMAT (md|csv|jsonl), OUT (a folder: every table is also saved there).
set -euo pipefail
cd "$(dirname "$0")"
if [ -z "${DEVICE:-}" ]; then
  if command -v nvcc >/dev/null && nvidia-smi -L 2>/dev/null | grep -q GPU; then DEVICE=cuda; else DEVICE=cpu; fi
fi
if [ "$DEVICE" = cuda ]; then
  make -s build/e2e_cuda build/precision; E2E=build/e2e_cuda
  MODELS=${MODELS:-small,medium,large,xl,2.7B}; DTYPES=${DTYPES:-fp32,bf16}
else
  make -s all; E2E=build/e2e
  MODELS=${MODELS:-small}; DTYPES=${DTYPES:-fp32,bf16}   # larger presets take minutes per step on a CPU
fi
CONTEXT=${CONTEXT:-256}; STEPS=${STEPS:-10}; WARMUP=${WARMUP:-5}; FORMAT=${FORMAT:-md}
OUT=${OUT:-}
[ -n "$OUT" ] && mkdir -p "$OUT"
sections=("$@"); [ ${#sections[@]} -eq 0 ] && sections=(e2e warmup precision)

save() { if [ -n "$OUT" ]; then tee "$OUT/$1"; else cat; fi; }

for s in "${sections[@]}"; do
  case "$s" in
  e2e)
    echo "## End-to-end: models x modes x dtypes ($DEVICE, context $CONTEXT, batch 4, warmup $WARMUP, $STEPS steps)"
    $E2E --device "$DEVICE" --model "$MODELS" --context-length "$CONTEXT" --mode forward,forward-backward,train \
         --dtype "$DTYPES" --warmup "$WARMUP" --steps "$STEPS" --format "$FORMAT" | save e2e.$FORMAT ;;
  warmup)
    echo "## Warmup steps 0, 1, 2, 5 (forward-backward, fp32, first model of MODELS)"
    for w in 0 1 2 5; do
      $E2E --device "$DEVICE" --model "${MODELS%%,*}" --context-length "$CONTEXT" --mode forward-backward --warmup $w --steps "$STEPS" --format csv --no-sgemm
    done | awk 'NR == 1 || !/^device,/' | save warmup.csv ;;
  precision)
    build/precision | save precision.md ;;
  *) echo "bench.sh: unknown section '$s' (e2e, warmup, precision)" >&2; exit 2 ;;
  esac
  echo
done
