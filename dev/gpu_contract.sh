#!/usr/bin/env bash
# gpu_contract.sh - one call on a GPU machine for what the CPU tests cannot reach: the CUDA drivers
# through the driver contract, the memory_viz snapshot through torch's own tooling beside PyTorch's
# snapshot, a profiler trace through Perfetto's trace processor, a CUDA consumer of the CMake package,
# and test_cuda.
#   dev/gpu_contract.sh link contract memviz perfetto resume savecost savehold consumer test
# Parts:
#   link      $BIN/{e2e,attn,memory}_cuda from $BIN/<driver>_cuda.o and $BIN/tsys_impl_cuda.o (objects built
#             elsewhere: the kernels take minutes to compile) when the programs are not there yet
#   contract  tests/test_contract.sh on the CUDA builds of e2e, attn and memory, and $BIN/precision
#   memviz    memory_cuda --out on the small model (bf16 train), then tests/ref/memviz_check.py --torch small
#   perfetto  e2e_cuda --profile, then tests/ref/perfetto_check.py on the trace (needs the perfetto package
#             and trace_processor_shell: TRACE_PROCESSOR_BIN, or found on the machine)
#   resume    e2e_cuda (small, bf16, eager and compiled): 6 train steps in one run, and 3 then 3 more resumed
#             from the first 3's snapshot; the two step-6 snapshots' files byte for byte (cmp), and against
#             the same 6 steps saved synchronously (--save-async no)
#   savecost  dd's rate on the save disk; e2e_cuda 2.7B and xl with snapshots every 10 steps (asynchronous,
#             synchronous; xl), at the end only, and none; dev/torch_save_rate.py (torch.save, DCP), small state
#   savehold  e2e_cuda large, eager and compiled: the host clock's hold of a snapshot staged on the host
#             and on the device, against none; then the load time of the snapshot (HOLD_BIG=1: only a 2.7B
#             snapshot staged on the device, and its load)
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
      "${a[@]}" --steps 6 --save-every 6 --save-dir "$r/sync" --save-async no > "$r/sync.csv" 2>&1
      "${a[@]}" --steps 3 --save-every 3 --save-dir "$r/twice" > "$r/twice1.csv" 2>&1
      "${a[@]}" --steps 3 --save-every 3 --save-dir "$r/twice" --resume "$r/twice" > "$r/twice2.csv" 2>&1
      for f in model.safetensors train_state.safetensors; do
        cmp -s "$r/once/step-000006/$f" "$r/twice/step-000006/$f" && echo "compile $c: $f equal byte for byte" || echo "compile $c: $f DIFFERS"
        cmp -s "$r/once/step-000006/$f" "$r/sync/step-000006/$f" && echo "compile $c: $f asynchronous = synchronous" || echo "compile $c: $f async/sync DIFFER"
      done
      grep -h "save_ms\|^cuda" "$r/once.csv" "$r/sync.csv" | head -3
      rm -rf "$r"/once/step-* "$r"/twice/step-* "$r"/sync/step-*   # 1.5 GB each
    done ;;
  savecost)
    # The disk's own rate, then e2e_cuda's compiled bf16 step (context 256, batch 4, 20 steps) with and
    # without snapshots (12 bytes a parameter): on 2.7B one at the end only (what one costs the caller, the
    # write rate); on xl one every 10 steps (two: they must both fit the disk), asynchronous and
    # synchronous, and one at the end. Then dev/torch_save_rate.py on the small model's state.
    S=${SAVE_DIR:-/tmp/tsys_save}; rm -rf "$S"; mkdir -p "$S"
    df -h "$S" | tail -1
    dd if=/dev/zero of="$S/dd" bs=1M count=4096 conv=fsync 2>&1 | tail -1; rm -f "$S/dd"
    run() {
      local m=$1 tag=$2; shift 2
      "$BIN/e2e_cuda" --model "$m" --context-length 256 --batch-size 4 --mode train --dtype bf16 --compile yes --lowp-copies yes \
        --warmup 1 --steps 19 --no-sgemm --format csv "$@" > "$OUT/save_${m}_$tag.csv" 2> "$OUT/save_${m}_$tag.err"
      echo "$m $tag exit $?"; rm -rf "$S"/snap
    }
    run 2.7B none
    run 2.7B end_async --save-every 20 --save-dir "$S/snap" --keep-last 1
    run xl none
    run xl every10_async --save-every 10 --save-dir "$S/snap" --keep-last 1
    run xl every10_sync --save-every 10 --save-dir "$S/snap" --keep-last 1 --save-async no
    run xl end_async --save-every 20 --save-dir "$S/snap" --keep-last 1
    python3 - "$OUT" <<'PY'
import csv, glob, os, sys
for p in sorted(glob.glob(os.path.join(sys.argv[1], "save_*.csv"))):
    r = list(csv.DictReader(open(p))) if os.path.getsize(p) else []
    r = r[0] if r else {}
    print(f"{os.path.basename(p)[5:-4]:18s} total_ms {r.get('total_ms')} std {r.get('total_std')} save_ms {r.get('save_ms', '-')} "
          f"save_GBps {r.get('save_GBps', '-')} {r.get('status', 'no row')[:80]}")
PY
    timeout 300 python3 dev/torch_save_rate.py --model small --dir "$S/torch" > "$OUT/torch_save.md" 2> "$OUT/torch_save.err"; tail -5 "$OUT/torch_save.md"
    rm -rf "$S" ;;
  savehold)
    # What a snapshot holds training up: e2e_cuda large (bf16, context 256, batch 4; eager and compiled),
    # 19 timed steps with a snapshot at step 10 (and, as always, after the last) staged on the host
    # (--save-async yes) or on the device (device), against none (a snapshot after the last step only).
    # The hold is the host clock's excess over none, the save calls aside (two snapshots against one):
    # 19 x (wall_ms - wall_ms(none)) - (2 x save_ms - save_ms(none)). Then the load: --resume from
    # the last snapshot (page cache dropped first where the machine allows), large and (HOLD_BIG) 2.7B.
    S=${SAVE_DIR:-/tmp/tsys_save}; rm -rf "$S"; mkdir -p "$S"
    hold() {
      local m=$1 c=$2 tag=$3; shift 3
      "$BIN/e2e_cuda" --model "$m" --context-length 256 --batch-size 4 --mode train --dtype bf16 --compile "$c" --lowp-copies yes \
        --warmup 1 --steps 19 --no-sgemm --format csv "$@" > "$OUT/hold_${m}_${c}_$tag.csv" 2> "$OUT/hold_${m}_${c}_$tag.err"
      echo "$m $c $tag exit $?"
    }
    load() {
      local m=$1
      sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null && echo "page cache dropped" || echo "page cache NOT dropped"
      "$BIN/e2e_cuda" --model "$m" --context-length 256 --batch-size 4 --mode train --dtype bf16 --lowp-copies yes --warmup 0 --steps 1 \
        --no-sgemm --format csv --resume "$S/snap_$m" > "$OUT/load_$m.csv" 2> "$OUT/load_$m.err"
      echo "load $m exit $?: $(grep resumed "$OUT/load_$m.err" | head -1)"; rm -rf "$S/snap_$m"
    }
    [ -z "${HOLD_BIG:-}" ] && for c in no yes; do
      hold large "$c" none --save-every 1000 --save-dir "$S/none" --keep-last 1
      for a in yes device; do hold large "$c" "$a" --save-every 10 --save-dir "$S/snap_large" --keep-last 1 --save-async "$a"; done
    done
    if [ -z "${HOLD_BIG:-}" ]; then
      f=$(ls "$S"/snap_large/step-*/train_state.safetensors | head -1)   # the disk's rate for our own bytes (dd's zeros may be cheaper)
      echo "dd of a snapshot file ($f): $(dd if="$f" of="$S/ddcopy" bs=1M conv=fsync 2>&1 | tail -1)"; rm -f "$S/ddcopy"
      echo "dd of zeros: $(dd if=/dev/zero of="$S/ddzero" bs=1M count=4096 conv=fsync 2>&1 | tail -1)"; rm -f "$S/ddzero"
      load large
    fi
    if [ -n "${HOLD_BIG:-}" ]; then
      hold 2.7B yes device --save-every 1000 --save-dir "$S/snap_2.7B" --keep-last 1 --save-async device   # one snapshot, at the end
      grep -h "snapshot step" "$OUT"/hold_2.7B_*.err
      load 2.7B
    fi
    python3 - "$OUT" <<'PY'
import csv, glob, os, sys
rows = {}
for p in sorted(glob.glob(os.path.join(sys.argv[1], "hold_*.csv"))):
    r = list(csv.DictReader(open(p))) if os.path.getsize(p) else []
    rows[os.path.basename(p)[5:-4]] = r[0] if r else {}
for k, r in rows.items():
    none = rows.get(k.rsplit("_", 1)[0] + "_none", {}) if not k.endswith("_none") else {}
    try:
        hold = 19 * (float(r["wall_ms"]) - float(none["wall_ms"])) - (2 * float(r["save_ms"]) - float(none["save_ms"]))
        extra = f"wall_ms {r['wall_ms']} save_ms {r['save_ms']} hold {hold:.0f} ms"
    except (KeyError, ValueError):
        extra = f"wall_ms {r.get('wall_ms', '-')}"
    print(f"{k:22s} total_ms {r.get('total_ms')} {extra} {r.get('status', 'no row')[:60]}")
PY
    grep -h "snapshot step" "$OUT"/hold_*.err | head -12
    rm -rf "$S" ;;
  consumer) "$BIN/app_cuda"; echo "app_cuda exit $?" ;;
  test) timeout 400 "$BIN/test_cuda" > "$OUT/test_cuda.log" 2>&1; grep -v " ok$" "$OUT/test_cuda.log" | tail -12 ;;
  *) echo "gpu_contract.sh: unknown part '$part' (link contract memviz perfetto resume savecost savehold consumer test)" >&2; exit 2 ;;
  esac
done
