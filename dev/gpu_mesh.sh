#!/usr/bin/env bash
# 4 GPUs, one call: test_mesh_cuda through NCCL at 4 and 2 ranks, then mesh_lab rows (2.7B) as a table.
# G holds the binaries, built here (no GPU needed):
#   make BUILD=$G CUDA_ARCH="-gencode arch=compute_90a,code=sm_90a" $G/test_mesh_cuda
#   nvcc -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Xcompiler -fopenmp -DTSYS_WITH_CUDA -I. -DTSYS_DIST_NCCL -D_GNU_SOURCE \
#        -DTSYS_DIST_MPI $(mpicc --showme:compile) -DTSYS_LINKED_IMPL -x cu -c dev/mesh_lab.c -o $G/mesh_lab.o
#   nvcc -gencode arch=compute_90a,code=sm_90a $G/mesh_lab.o $G/tsys_impl_cuda.o -o $G/mesh_lab -lcublasLt -lcublas -lopenblas -lgomp \
#        -lnccl $(mpicc --showme:link)
# Logs go to $OUT (default /tmp/tsys_out).
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_base_warn_component_unused=0 TSYS_DIST_TIMEOUT=180
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tsys_out}; mkdir -p "$OUT"
G=${G:-build/g8}
mp="mpirun --oversubscribe --bind-to none"
{ timeout 300 $mp -np 4 $G/test_mesh_cuda; timeout 200 $mp -np 2 $G/test_mesh_cuda tp; } > $OUT/test_mesh_cuda.log 2>&1
grep -E "rank\(s\)|passed, |FAIL" $OUT/test_mesh_cuda.log | head -20
echo "| layout | dp | tp | model | context | batch | step_ms | peak_MiB | plan peak_MiB | plan compute_ms | tp comm ms: plan 340 GB/s / plan fitted / alone | dp comm ms: the same | links fitted (alpha ms + beta GB/s): dp / tp |"
echo "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|"
if [ -n "${MESH_CFGS:-}" ]; then IFS=';' read -ra cfgs <<< "$MESH_CFGS"   # "tp 4 2.7B 1024 4;fsdp 1 2.7B 1024 4"
else cfgs=("tp 4 2.7B 1024 4" "tp 2 2.7B 1024 4" "dp_tp 2 2.7B 1024 4" "fsdp_tp 2 2.7B 1024 4" "hsdp 2 2.7B 1024 4" "fsdp 1 2.7B 1024 4"
           "tp 4 2.7B 4096 1" "fsdp_tp 2 2.7B 4096 1" "hsdp 2 2.7B 4096 1" "fsdp 1 2.7B 4096 1"); fi
for cfg in "${cfgs[@]}"; do
  timeout 150 $mp -np ${NP:-4} $G/mesh_lab $cfg 5 > $OUT/lab.out 2> $OUT/lab.err || echo "| $cfg: failed: $(grep -m1 -E 'mesh_lab|error' $OUT/lab.err | head -c 200) |"
  grep '^|' $OUT/lab.out; cat $OUT/lab.out >> $OUT/mesh_lab.log; cat $OUT/lab.err >> $OUT/mesh_lab.err
done
# PyTorch's rows in the same call (torchtitan-style: tests/ref/torch_tp.py), when torch is there; TORCH=0 skips them.
# TORCH_CFGS: "MODEL CONTEXT BATCH LAYOUTS;..." (LAYOUTS as torch_tp.py's --layout)
if [ "${TORCH:-1}" = 1 ] && command -v torchrun > /dev/null; then
  IFS=';' read -ra tcfgs <<< "${TORCH_CFGS:-2.7B 1024 4 tp:4,fsdp_tp:2,fsdp:1,hsdp:2;2.7B 4096 1 tp:4,fsdp_tp:2,fsdp:1,hsdp:2}"
  for tc in "${tcfgs[@]}"; do
    read -r tm tt tb tl <<< "$tc"
    timeout 400 torchrun --nproc_per_node ${NP:-4} tests/ref/torch_tp.py --device cuda --model $tm --context-length $tt --batch-size $tb \
      --layout $tl > $OUT/torch_tp.out 2>&1
    grep -E '^\| torch|Error' $OUT/torch_tp.out | head -12; cat $OUT/torch_tp.out >> $OUT/torch_tp.log
  done
fi
