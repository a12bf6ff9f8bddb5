#!/usr/bin/env bash
# One GPU, one call: the fused LM head + cross-entropy against the logits path. test_cuda's cases for it
# (the op against linear + cross_entropy on the GPU, SCALE_BY against the CPU, every kernel runs), then
# e2e_cuda's training step with and without --fused-loss on a large vocabulary (ROWS: e2e flags, ';'-separated).
# G holds the binaries, built here (no GPU needed):
#   make BUILD=$G CUDA_ARCH="-gencode arch=compute_90a,code=sm_90a" $G/test_cuda $G/e2e_cuda
# Logs go to $OUT (default /tmp/tsys_out); a table of the e2e rows is printed last.
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tsys_out}; mkdir -p "$OUT"
G=${G:-build/g8}
for t in linear_cross_entropy cuda_elementwise every_kernel; do
  timeout 120 $G/test_cuda $t > $OUT/test_cuda_$t.log 2>&1
  echo "test_cuda $t: $(tail -1 $OUT/test_cuda_$t.log)"
done
IFS=';' read -ra rows <<< "${ROWS:---model small --vocab-size 151936 --context-length 1024 --batch-size 8}"
n=0
for r in "${rows[@]}"; do
  for f in "" --fused-loss; do
    n=$((n + 1))
    timeout 120 $G/e2e_cuda $r --dtype bf16 --mode train --compile yes --warmup 2 --steps 5 --format csv --progress off $f \
      > $OUT/e2e_$n.csv 2> $OUT/e2e_$n.err
    echo "e2e $r $f: exit $?" >> $OUT/e2e_$n.err
  done
done
# one line per row: the head (logits or fused), model, context x batch, step ms, peak / predicted MiB, status
for k in $(seq 1 $n); do
  awk -F, -v head=$([ $((k % 2)) = 0 ] && echo fused || echo logits) '$1 == "device" { for (i = 1; i <= NF; i++) c[$i] = i; next }
    c["model"] && NF > 5 { print "| " head " | " $c["model"] " | " $c["context"] "x" $c["batch"] " | " $c["total_ms"] " | " $c["peak_MiB"] " / " $c["pred_MiB"] " | " $c["status"] " |" }' $OUT/e2e_$k.csv
done
