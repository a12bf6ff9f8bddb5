#!/usr/bin/env bash
# checkpoint_session.sh [BINDIR] - the activation-checkpointing measurements of issue 13 on one H100
# (or H200), in about 8 minutes, with binaries built beforehand:
#
#   make build/test_cuda build/e2e_cuda        # on any machine with nvcc (they run on the GPU machine)
#   tools/checkpoint_session.sh build           # on the GPU machine, from the repository root
#
# What it runs (every e2e row is also kept as CSV in $OUT, default /tmp/tsys_ckpt_<time>):
#   1. the CUDA checkpoint tests (bitwise gradients for every policy, fp32/bf16, naive/flash; the
#      recompute inside a captured CUDA graph) and the CUDA model tests as a sanity check
#   2. 2.7B, bf16, context 1024, batch 4: train step with flash (none, blocks:1, selective,
#      nested+selective) and forward-backward with naive attention (none, selective, blocks:1):
#      step time and peak; the targets: blocks:1 <= +33%, selective <= +7% saving >= 50%
#   3. the largest context at which the 2.7B bf16 train step fits, without and with checkpointing
#      (--oom-ok: out-of-memory rows are the answer)
#   4. the CS336 gradient_checkpointing table: xl (S26 shape = tsys's 2.7B preset) at context 2048,
#      batch 4, fp32, naive attention: the accounting per policy (--plan), then peak memory and step
#      time per policy
# and prints a short summary table at the end. Rows past the time budget (TIME_BUDGET seconds,
# default 450) are skipped, longest last, so the session ends in time.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${1:-build}
OUT=${OUT:-/tmp/tsys_ckpt_$(date +%H%M%S)}
BUDGET=${TIME_BUDGET:-450}
mkdir -p "$OUT"
for f in test_cuda e2e_cuda; do
  [ -x "$B/$f" ] || { echo "checkpoint_session: $B/$f is missing (make $B/test_cuda $B/e2e_cuda)"; exit 2; }
done
export TSYS_PROGRESS=0
t0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
E2E=("$B/e2e_cuda" --device cuda --no-sgemm --format csv --oom-ok)

# rows FILE SECONDS_NEEDED ARGS...: one e2e call whose rows go to FILE (appended; the header once)
rows() {
  local file=$1 need=$2; shift 2
  if [ "$(left)" -lt "$need" ]; then echo "  (skipped for time: $*)"; return; fi
  local tmp="$OUT/.rows"
  "${E2E[@]}" "$@" >"$tmp" 2>>"$OUT/stderr.log"
  if [ -s "$file" ]; then tail -n +2 "$tmp" >>"$file"; else cat "$tmp" >"$file"; fi
  awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; next }   # columns by name
            { printf "  %s T=%s %s %s %s %s: total %s ms, saved %s MiB, peak %s MiB (predicted %s) %s\n", $c["model"], $c["context"], $c["mode"], $c["dtype"], $c["attn"],
                     $c["ckpt"], $c["total_ms"], $c["saved_MiB"], $c["peak_MiB"], $c["pred_MiB"], ($c["status"] == "ok" ? "" : $c["status"]) }' "$tmp"
}

echo "== 1. CUDA tests ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
"$B/test_cuda" cuda_checkpoint 2>&1 | tee "$OUT/test_cuda.log" | tail -n 8
"$B/test_cuda" cuda_model 2>&1 | tail -n 1

echo "== 2. 2.7B bf16 context 1024 batch 4"
rows "$OUT/t1024.csv" 60 --model 2.7B --context-length 1024 --dtype bf16 --attn flash --mode train --warmup 2 --steps 5 \
     --checkpoint none,blocks:1,selective,nested+selective
rows "$OUT/t1024_naive.csv" 60 --model 2.7B --context-length 1024 --dtype bf16 --attn naive --mode forward-backward --warmup 2 --steps 5 \
     --checkpoint none,selective,blocks:1

echo "== 3. largest context of the 2.7B bf16 train step (batch 4, flash)"
rows "$OUT/ctx.csv" 40 --model 2.7B --context-length 1024,2048,4096 --dtype bf16 --attn flash --mode train --warmup 1 --steps 1 --checkpoint none
rows "$OUT/ctx.csv" 90 --model 2.7B --context-length 4096,8192,16384 --dtype bf16 --attn flash --mode train --warmup 1 --steps 1 --checkpoint blocks:1
rows "$OUT/ctx.csv" 80 --model 2.7B --context-length 16384 --dtype bf16 --attn flash --mode train --warmup 1 --steps 1 --checkpoint nested+selective

echo "== 4. CS336 gradient_checkpointing: xl (S26) context 2048 batch 4 fp32 naive"
"$B/e2e_cuda" --device cuda --model 2.7B --context-length 2048 --attn naive --mode train \
  --checkpoint none,selective,blocks:1,blocks:2,sqrt,nested,nested+selective,auto:70GiB --plan 2>/dev/null | tee "$OUT/xl_plan.md" | tail -n +3
"$B/e2e_cuda" --device cuda --model 2.7B --num-layers 4 --context-length 2048 --attn naive --mode train --checkpoint none,blocks:2 --plan --format csv 2>/dev/null |
  awk -F, 'NR > 1 { printf "  4 blocks, %s: %s MiB kept by the blocks (torch: %s)\n", $7, $10, ($7 == "none" ? "14605.25" : "160.00") }'
rows "$OUT/xl.csv" 150 --model 2.7B --context-length 2048 --attn naive --mode train --warmup 1 --steps 2 \
     --checkpoint none,selective,blocks:1,nested,nested+selective,blocks:2
rows "$OUT/xl.csv" 50 --model 2.7B --context-length 2048 --attn naive --mode train --warmup 1 --steps 2 --checkpoint sqrt
rows "$OUT/ctx.csv" 100 --model 2.7B --context-length 32768 --dtype bf16 --attn flash --mode train --warmup 0 --steps 1 --checkpoint nested+selective

echo
echo "== summary ($(( $(date +%s) - t0 )) s; rows in $OUT)"
summ() {   # FILE: policy, total ms and saved MiB (against the first row that ran), peak
  [ -s "$1" ] || return
  awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; next }   # columns by name
           { ok = ($c["status"] == "ok"); t = $c["total_ms"]; sv = $c["saved_MiB"] }
           ok && !t0 { t0 = t; s0 = sv }   # the first row that ran is the baseline
           { printf "| %-22s | %5s | %9s | %8s %-8s | %8s %-9s | %8s | %s\n", $c["ckpt"], $c["context"], $c["mode"], ok ? t : "-", (ok && t0 > 0 ? sprintf("(%+.1f%%)", 100 * (t - t0) / t0) : ""),
                    ok ? sv : "-", (ok && s0 > 0 ? sprintf("(-%.0f%%)", 100 * (s0 - sv) / s0) : ""), ok ? $c["peak_MiB"] : "-", ok ? "" : substr($c["status"], 1, 40) }' "$1"
}
echo "| policy                 |  ctx  |   mode    | step ms            | saved MiB          | peak MiB | status"
summ "$OUT/t1024.csv"; summ "$OUT/t1024_naive.csv"; summ "$OUT/xl.csv"
if [ -s "$OUT/ctx.csv" ]; then
  echo "largest context that fit (2.7B bf16 train, batch 4):"
  awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; next }
           $c["status"] == "ok" { if ($c["context"] + 0 > best[$c["ckpt"]]) best[$c["ckpt"]] = $c["context"] + 0 } { seen[$c["ckpt"]] = 1 }
           END { for (p in seen) printf "  %-20s %s\n", p, (p in best) ? best[p] : "none fit"; }' "$OUT/ctx.csv"
fi
grep -E '^[0-9]+ passed' "$OUT/test_cuda.log" | sed 's/^/CUDA checkpoint tests: /'
