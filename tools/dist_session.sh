#!/usr/bin/env bash
# dist_session.sh - one call on the GPU machine for tsys_dist.h, with binaries built elsewhere (or
# here, when they do not start): the CUDA tests (NCCL in a group of one; two ranks sharing the GPU
# through host staging, under mpirun and the launcher) and the CPU all-reduce against torch Gloo in
# the same run.
#   tools/dist_session.sh [test] [cpu] [nccl]
# Logs and JSON lines go to $OUT; a summary prints.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tsys_out}; mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TSYS_DIST_TIMEOUT=${TSYS_DIST_TIMEOUT:-120} PYTHONUNBUFFERED=1
nvidia-smi -L; echo "cpus: $(nproc), $(lscpu | sed -n 's/^Model name: *//p')"
bins="build/test_dist_cuda build/allreduce_cuda build/allreduce build/test_dist"
if ! for b in $bins; do [ -x "$b" ] && ! ldd "$b" | grep -q "not found" || exit 1; done; then
  echo "rebuilding (a carried binary is missing or does not link here)"
  make $([ -f build/tsys_impl_cuda.o ] && echo -o build/tsys_impl_cuda.o) -j16 $bins > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
SIZES=${SIZES:-4B,64KB,1MB,10MB,100MB,1GB}
parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(test cpu nccl)
for part in "${parts[@]}"; do
  echo "=== $part ($(date +%T))"
  case "$part" in
  test)
    timeout 300 build/test_dist_cuda > "$OUT/test_dist_cuda_1.log" 2>&1; tail -n 1 "$OUT/test_dist_cuda_1.log"; grep -v " ok$" "$OUT/test_dist_cuda_1.log" | head -30
    timeout 300 mpirun --oversubscribe -np 2 build/test_dist_cuda > "$OUT/test_dist_cuda_mpi2.log" 2>&1; tail -n 1 "$OUT/test_dist_cuda_mpi2.log"; grep -v " ok$" "$OUT/test_dist_cuda_mpi2.log" | head -30
    timeout 300 build/test_dist_cuda --nproc 2 > "$OUT/test_dist_cuda_tcp2.log" 2>&1; tail -n 1 "$OUT/test_dist_cuda_tcp2.log"; grep -v " ok$" "$OUT/test_dist_cuda_tcp2.log" | head -30 ;;
  cpu)
    for n in ${NPROCS:-2}; do
      timeout 300 build/allreduce --nproc $n --sizes "$SIZES" --format jsonl > "$OUT/ar_shm_$n.jsonl" 2>&1
      timeout 300 mpirun -np $n build/allreduce --shm no --sizes "$SIZES" --format jsonl > "$OUT/ar_mpi_$n.jsonl" 2>&1
      timeout 300 mpirun -np $n -x OMPI_MCA_coll_tuned_use_dynamic_rules=1 -x OMPI_MCA_coll_tuned_allreduce_algorithm=4 build/allreduce --shm no --sizes "$SIZES" --format jsonl > "$OUT/ar_mpiring_$n.jsonl" 2>&1
      timeout 400 python3 tests/ref/allreduce_torch.py --backend gloo --nproc $n --sizes "$SIZES" > "$OUT/ar_gloo_$n.jsonl" 2>&1
      for f in shm mpi mpiring gloo; do echo "-- $f, $n ranks"; grep '^{' "$OUT/ar_${f}_$n.jsonl" | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l); bw = r.get("busbw_GB/s", r.get("busbw"))
    print("  %-8s %6s  time %10.4f ms  min %10.4f  busbw %8.3f GB/s  %s" % (r["op"], r["size"], r["time_ms"], r["min_ms"], bw, r.get("check", "")))'; head -n 1 "$OUT/ar_${f}_$n.jsonl" | grep -v '^{'; done
    done ;;
  nccl)
    timeout 300 build/allreduce_cuda --backend nccl --sizes 1MB,1GB --op all_reduce,reduce_scatter,all_gather > "$OUT/ar_nccl_1.md" 2>&1; cat "$OUT/ar_nccl_1.md" ;;
  *) echo "unknown part $part" ;;
  esac
done
