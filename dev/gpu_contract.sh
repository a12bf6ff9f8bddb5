#!/usr/bin/env bash
# gpu_contract.sh - one call on a GPU machine for what the CPU tests cannot reach: the CUDA drivers
# through the driver contract, the memory_viz snapshot through torch's own tooling beside PyTorch's
# snapshot, a profiler trace through Perfetto's trace processor, a CUDA consumer of the CMake package,
# and test_cuda.
#   dev/gpu_contract.sh link contract memviz perfetto resume consumer test
# Parts:
#   link      $BIN/{e2e,attn,memory}_cuda from $BIN/<driver>_cuda.o and $BIN/tsys_impl_cuda.o (objects built
#             elsewhere: the kernels take minutes to compile) when the programs are not there yet
#   contract  tests/test_contract.sh on the CUDA builds of e2e, attn and memory, and $BIN/precision
#   memviz    memory_cuda --out on the small model (bf16 train), then tests/ref/memviz_check.py --torch small
#   perfetto  e2e_cuda --profile, then tests/ref/perfetto_check.py on the trace (needs the perfetto package
#             and trace_processor_shell: TRACE_PROCESSOR_BIN, or found on the machine)
#   resume    e2e_cuda (small, bf16, eager and compiled): 6 train steps in one run, and 3 then 3 more resumed
#             from the first 3's snapshot; the two step-6 snapshots' files byte for byte (cmp)
#   consumer  $BIN/app_cuda (tests/test_packaging.sh's cuda-build consumer, built with PACKAGING_CUDA_OUT)
#   test      $BIN/test_cuda
# Logs go to $OUT (default /tmp/tsys_out); a line per part says how it went.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tsys_out}; mkdir -p "$OUT"
BIN=${BIN:-build}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
LIBS="-lcublasLt -lcublas -lopenblas -lgomp"
for part in "$@"; do
  echo "=== $part ($(date +%T))"
  case "$part" in
  link)
    for d in e2e attn memory; do
      [ -x "$BIN/${d}_cuda" ] && continue
      # shellcheck disable=SC2086
      nvcc -O2 -gencode arch=compute_90a,code=sm_90a "$BIN/${d}_cuda.o" "$BIN/tsys_impl_cuda.o" -o "$BIN/${d}_cuda" $LIBS \
        > "$OUT/link_$d.log" 2>&1 || { echo "link $d failed"; tail -5 "$OUT/link_$d.log"; }
    done
    ls "$BIN"/*_cuda ;;
  contract)
    mkdir -p "$BIN/contract"
    for d in e2e attn memory; do ln -sf "../${d}_cuda" "$BIN/contract/$d"; done
    ln -sf ../precision "$BIN/contract/precision"
    TSYS_CONTRACT_DRIVERS="e2e attn memory precision" tests/test_contract.sh "$BIN/contract" > "$OUT/contract.log" 2>&1
    tail -8 "$OUT/contract.log" ;;
  memviz)
    rm -rf "$OUT/mem"; mkdir -p "$OUT/mem"
    "$BIN/memory_cuda" --model small --context-length 128 --batch-size 4 --mode train --dtype bf16 --out "$OUT/mem" > "$OUT/memory.md" 2>&1
    head -4 "$OUT/memory.md"
    timeout 300 python3 tests/ref/memviz_check.py "$OUT"/mem/*.pickle --torch small --context-length 128 --batch-size 4 --mode train \
      --dtype bf16 > "$OUT/memviz_check.log" 2>&1; echo "memviz_check exit $?"; tail -12 "$OUT/memviz_check.log" ;;
  perfetto)
    rm -rf "$OUT/prof"
    "$BIN/e2e_cuda" --model small --context-length 128 --batch-size 2 --mode train --dtype bf16 --warmup 1 --steps 1 --no-sgemm \
      --profile "$OUT/prof" > "$OUT/profile.md" 2>&1 || tail -5 "$OUT/profile.md"
    python3 -c "import perfetto; print('perfetto', perfetto.__file__)" 2>&1 | tail -1
    tp=${TRACE_PROCESSOR_BIN:-$(command -v trace_processor_shell || find / -name 'trace_processor*' -type f -perm -u+x 2>/dev/null | head -1)}
    echo "trace_processor: ${tp:-none on this machine}"
    for t in "$OUT"/prof/*.json; do
      TRACE_PROCESSOR_BIN=$tp timeout 120 python3 tests/ref/perfetto_check.py "$t" 2>&1 | tail -4; echo "perfetto_check exit ${PIPESTATUS[0]}"
    done ;;
  resume)
    for c in no yes; do
      r="$OUT/resume_$c"; rm -rf "$r"; mkdir -p "$r"
      a=("$BIN/e2e_cuda" --model small --context-length 256 --batch-size 4 --mode train --dtype bf16 --compile "$c" --warmup 0 --no-sgemm --format csv)
      "${a[@]}" --steps 6 --save-every 6 --save-dir "$r/once" > "$r/once.csv" 2>&1
      "${a[@]}" --steps 3 --save-every 3 --save-dir "$r/twice" > "$r/twice1.csv" 2>&1
      "${a[@]}" --steps 3 --save-every 3 --save-dir "$r/twice" --resume "$r/twice" > "$r/twice2.csv" 2>&1
      for f in model.safetensors train_state.safetensors; do
        cmp -s "$r/once/step-000006/$f" "$r/twice/step-000006/$f" && echo "compile $c: $f equal byte for byte" || echo "compile $c: $f DIFFERS"
      done
      grep -h "save_ms\|^cuda" "$r/once.csv" | head -2
      rm -rf "$r"/once/step-* "$r"/twice/step-*   # 1.5 GB each
    done ;;
  consumer) "$BIN/app_cuda"; echo "app_cuda exit $?" ;;
  test) timeout 400 "$BIN/test_cuda" > "$OUT/test_cuda.log" 2>&1; grep -v " ok$" "$OUT/test_cuda.log" | tail -12 ;;
  *) echo "gpu_contract.sh: unknown part '$part' (link contract memviz perfetto resume consumer test)" >&2; exit 2 ;;
  esac
done
