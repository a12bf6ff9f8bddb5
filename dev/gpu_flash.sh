#!/usr/bin/env bash
# gpu_flash.sh - one call on the GPU machine for the FlashAttention kernels: the lab's checks and timings, PyTorch
# SDPA at the same shapes (same call), the flash_benchmarking sweep beside SDPA, and an ncu look at a kernel.
#   dev/gpu_flash.sh build test lb torch pad tf32 lbfused pdl sweep ncu testcuda
# `test` checks every flash implementation the device can run (mma, wgmma, ws) and the backward's switches;
# `testcuda` runs build/test_cuda; `lb` and `torch` may repeat (each run writes its own numbered log, so
# interleaved runs show the call-to-call spread); `lbnows` / `lbmma` time the leaderboard rows on the cp.async
# wgmma / mma.sync kernels (build/flash_lab's second word picks one); `perf` the lab's timing rows; `tf32` checks
# and times the TF32 forward; `pad` the zero-padded d 16 / 32 / 80 / 96 path; `lbfused` the fused backward against
# the 7-matmul kernels; `pdl` the tail-launched dK/dV kernel against ordinary launches; `nondet` the fused backward's
# dQ in a fixed order against arrival order; `sweep` is the
# flash_benchmarking sweep beside PyTorch SDPA (build/attn_cuda and tests/ref/torch_fa_sweep.py, one table by
# dev/flash_sweep_table.py) for SWEEP_DTYPES (default fp32) and SWEEP_DS (default 16,32,64,128).
# build/flash_lab may be built beforehand (make build/flash_lab) and carried; `build` (re)builds it here. LAB names
# another lab binary; LAB_B a second one (another version of the kernels) that the parts `lbB` and `lbfusedB` time,
# so that two versions are compared in one call.
# Logs go to $OUT; the lines that matter print as each part ends.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tsys_out}; mkdir -p "$OUT"
LAB=${LAB:-build/flash_lab}; LAB_B=${LAB_B:-}; ATTN=${ATTN:-build/attn_cuda}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
for part in "$@"; do
  echo "=== $part ($(date +%T))"
  case "$part" in
  build) nvcc -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a -DTSYS_WITH_CUDA -DTSYS_NO_CBLAS -I. \
           dev/flash_lab.cu -o "$LAB" -lcublasLt -lcublas -lgomp -Xcompiler -fopenmp > "$OUT/build.log" 2>&1 \
           || { tail -30 "$OUT/build.log"; exit 1; } ;;
  test) timeout 300 $LAB test > "$OUT/flash_test.log" 2>&1; grep -v "^  ok" "$OUT/flash_test.log" | tail -25 ;;
  testcuda) timeout 400 build/test_cuda > "$OUT/test_cuda.log" 2>&1; grep -v " ok$" "$OUT/test_cuda.log" | grep -v "^    " | tail -20 ;;
  tf32) timeout 200 $LAB tf32fwd ws > "$OUT/flash_tf32fwd.log" 2>&1; cat "$OUT/flash_tf32fwd.log" ;;
  sweep) dt=${SWEEP_DTYPES:-fp32}; ds=${SWEEP_DS:-16,32,64,128}; tag=${dt//,/_}_d${ds//,/_}
         timeout 300 $ATTN --device cuda --sweep flash_benchmarking --dtype "$dt" --d "$ds" --grad sum --oom-ok --format csv \
           > "$OUT/attn_sweep_$tag.csv" 2> "$OUT/attn_sweep_$tag.err"; grep -c ",ok$" "$OUT/attn_sweep_$tag.csv"
         timeout 400 python3 tests/ref/torch_fa_sweep.py 128,256,512,1024,2048,4096,8192,16384,32768,65536 "$ds" "$dt" \
           > "$OUT/torch_fa_sweep_$tag.jsonl" 2>&1; grep -c fwd_ms "$OUT/torch_fa_sweep_$tag.jsonl"
         python3 dev/flash_sweep_table.py "$OUT/attn_sweep_$tag.csv" "$OUT/torch_fa_sweep_$tag.jsonl" "$OUT/sweep_${tag}_full.md" > "$OUT/sweep_${tag}_table.md"
         cat "$OUT/sweep_${tag}_table.md" ;;
  pad) timeout 200 $LAB pad > "$OUT/flash_pad.log" 2>&1; cat "$OUT/flash_pad.log" ;;
  lb) lbn=$((${lbn:-0} + 1)); timeout 120 $LAB lb > "$OUT/flash_lb_$lbn.log" 2>&1; cat "$OUT/flash_lb_$lbn.log" ;;
  lbB) lbbn=$((${lbbn:-0} + 1)); timeout 120 $LAB_B lb > "$OUT/flash_lbB_$lbbn.log" 2>&1; cat "$OUT/flash_lbB_$lbbn.log" ;;
  lbnows) timeout 120 $LAB lb wgmma > "$OUT/flash_lb_nows.log" 2>&1; cat "$OUT/flash_lb_nows.log" ;;
  lbmma) timeout 120 $LAB lb mma > "$OUT/flash_lb_mma.log" 2>&1; cat "$OUT/flash_lb_mma.log" ;;
  lbfused) timeout 300 $LAB lbfused > "$OUT/flash_lbfused.log" 2>&1; cat "$OUT/flash_lbfused.log" ;;
  lbfusedB) timeout 300 $LAB_B lbfused > "$OUT/flash_lbfusedB.log" 2>&1; cat "$OUT/flash_lbfusedB.log" ;;
  pdl) timeout 300 $LAB pdl > "$OUT/flash_pdl.log" 2>&1; cat "$OUT/flash_pdl.log" ;;
  nondet) timeout 300 $LAB nondet > "$OUT/flash_nondet.log" 2>&1; cat "$OUT/flash_nondet.log" ;;
  perf) timeout 300 $LAB perf > "$OUT/flash_perf.log" 2>&1; cat "$OUT/flash_perf.log" ;;
  torch) tn=$((${tn:-0} + 1)); timeout 300 python3 tests/ref/torch_fa_lb.py > "$OUT/torch_fa_lb_$tn.log" 2>&1; cat "$OUT/torch_fa_lb_$tn.log" ;;
  ncu) for k in ${NCU_KERNELS:-fwd_wg dkdv_wg dq_wg}; do
         timeout 200 ncu --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
           --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -k regex:$k --launch-skip 3 --launch-count 1 $LAB lb > "$OUT/ncu_$k.log" 2>&1
         grep -E "Duration|Registers|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Warp Cycles Per Issued|Block Limit|stalled" "$OUT/ncu_$k.log" \
           | awk '$NF+0 > 0.05 || !/stalled/' | head -40
       done ;;
  *) echo "unknown part $part" ;;
  esac
done
