#!/usr/bin/env bash
# 4 GPUs, one call: test_mesh_cuda through NCCL at 4 and 2 ranks (TESTS=0 skips it), the mesh driver's rows, then
# PyTorch's torchtitan-style rows on the same GPUs (tests/ref/torch_tp.py; TORCH=0 skips them).
# G holds the binaries, built here (no GPU needed):
#   make BUILD=$G CUDA_ARCH="-gencode arch=compute_90a,code=sm_90a" $G/test_mesh_cuda $G/mesh_cuda
# MESH_ROWS and TORCH_ROWS: "MODEL CONTEXT BATCH LAYOUTS;..." (LAYOUTS as each program's --layout; " ": none).
# Logs go to $OUT (default /tmp/tsys_out).
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_base_warn_component_unused=0 TSYS_DIST_TIMEOUT=180
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tsys_out}; mkdir -p "$OUT"
G=${G:-build/g8}
NP=${NP:-4}
mp="mpirun --oversubscribe --bind-to none"
if [ "${TESTS:-1}" = 1 ]; then
  { timeout 300 $mp -np $NP $G/test_mesh_cuda; timeout 200 $mp -np 2 $G/test_mesh_cuda tp; } > $OUT/test_mesh_cuda.log 2>&1
  grep -E "rank\(s\)|passed, |FAIL" $OUT/test_mesh_cuda.log | head -20
fi
IFS=';' read -ra rows <<< "${MESH_ROWS:-2.7B 1024 4 tp:4,tp_sp:4,tp:2,dp_tp:2,fsdp_tp:2,fsdp_tp_sp:2,hsdp:2,fsdp;2.7B 4096 1 tp:4,fsdp_tp:2,hsdp:2,fsdp;xl 1024 4 fsdp,hsdp:2;xl 4096 1 fsdp,hsdp:2}"
for r in "${rows[@]}"; do
  read -r m t b l <<< "$r"
  [ -n "$m" ] || continue   # MESH_ROWS=" ": PyTorch's rows only
  timeout 500 $mp -np $NP $G/mesh_cuda --device cuda --model $m --context-length $t --batch-size $b --dtype bf16 --layout $l \
    --format csv --progress off > $OUT/mesh.out 2> $OUT/mesh.err
  echo "mesh $r: exit $?"; cat $OUT/mesh.out >> $OUT/mesh.csv; cat $OUT/mesh.err >> $OUT/mesh.log
done
[ -f $OUT/mesh.csv ] && awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i } $1 != "device" {
  print "| " $c["model"] " | " $c["layout"] " | " $c["context"] "x" $c["batch"] " | " $c["step_ms"] " | " $c["peak_MiB"] " / " $c["pred_peak_MiB"] " | " \
        $c["tp_comm_ms"] " / " $c["pred_tp_comm_ms"] " / " $c["fit_tp_comm_ms"] " | " $c["dp_comm_ms"] " / " $c["pred_dp_comm_ms"] " / " $c["fit_dp_comm_ms"] " | " $c["status"] " |" }' $OUT/mesh.csv
if [ "${TORCH:-1}" = 1 ] && command -v torchrun > /dev/null; then
  IFS=';' read -ra tcfgs <<< "${TORCH_ROWS:-2.7B 1024 4 tp:4,fsdp_tp:2,fsdp:1,hsdp:2;2.7B 4096 1 tp:4,fsdp_tp:2,fsdp:1,hsdp:2;xl 1024 4 fsdp:1,hsdp:2;xl 4096 1 fsdp:1,hsdp:2}"
  for tc in "${tcfgs[@]}"; do
    read -r tm tt tb tl <<< "$tc"
    [ -n "$tm" ] || continue
    timeout 400 torchrun --nproc_per_node $NP tests/ref/torch_tp.py --device cuda --model $tm --context-length $tt --batch-size $tb \
      --layout $tl > $OUT/torch_tp.out 2>&1
    grep -E '^\| torch|Error' $OUT/torch_tp.out | head -12; cat $OUT/torch_tp.out >> $OUT/torch_tp.log
  done
fi
