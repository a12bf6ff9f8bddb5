#!/bin/bash
# gpu_check.sh - on the GPU machine: report what the machine has (GPU, CBLAS), build
# build/test_cuda and run it. Logs go to $OUT when it is set (the device runner), else build/.
#   dev/gpu_check.sh [test-name-filter]
#   SANITIZE="cuda_norms cuda_losses" dev/gpu_check.sh   # also run those under compute-sanitizer
set -o pipefail
LOG=${OUT:-build}
mkdir -p build "$LOG"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "== CBLAS / OpenBLAS on this machine:"
ls /usr/include/cblas.h /usr/include/x86_64-linux-gnu/cblas.h /usr/include/openblas/cblas.h /usr/lib/x86_64-linux-gnu/*openblas* 2>&1 | sed 's/^/   /'
start=$(date +%s)
if [ -e /usr/include/cblas.h ] || [ -e /usr/include/x86_64-linux-gnu/cblas.h ] || [ -e /usr/include/openblas/cblas.h ]; then
    make build/test_cuda 2>&1 | tee "$LOG/build.log" | grep -E "error|warning" | head -40
else
    echo "== no cblas.h: building with TSYS_NO_CBLAS"
    nvcc -O2 -std=c++17 -gencode arch=compute_90,code=sm_90 -Xcompiler -fopenmp -DTSYS_NO_CBLAS tests/test_cuda.cu \
        -o build/test_cuda -lcublasLt -lcublas -lgomp 2>&1 | tee "$LOG/build.log" | grep -E "error|warning" | head -40
fi
[ -x build/test_cuda ] || { echo "build failed"; tail -30 "$LOG/build.log"; exit 1; }
echo "== built in $(( $(date +%s) - start )) s"
timeout 240 build/test_cuda "$@" 2>&1 | tee "$LOG/test_cuda.log"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1)
[ -n "$SANITIZE" ] && [ -z "$CS" ] && echo "== no compute-sanitizer on this machine"
for t in $SANITIZE; do
    [ -n "$CS" ] || break
    echo "== compute-sanitizer memcheck: $t"
    timeout 90 "$CS" --tool memcheck --error-exitcode 3 build/test_cuda "$t" 2>&1 | tail -4 | tee -a "$LOG/sanitize.log"
done
