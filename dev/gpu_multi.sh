#!/usr/bin/env bash
# gpu_multi.sh - tsys_dist on a machine with several GPUs, ours and torch.distributed in the same
# call. Binaries are built on the development machine and carried in gpu/dist (rebuilt here when one
# does not start). NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the machine's notes ask.
#   dev/gpu_multi.sh topo tests allreduce ddp_ours ddp_torch fsdp captured scaling ce options ...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tsys_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TSYS_DIST_TIMEOUT=${TSYS_DIST_TIMEOUT:-120} PYTHONUNBUFFERED=1
G=${G:-gpu/dist}   # where the binaries are
NG=$(nvidia-smi -L | grep -c GPU)
MODEL=${MODEL:-xl}; DTYPES=${DTYPES:-bf16}; STEPS=${STEPS:-5}; WARMUP=${WARMUP:-3}   # GRAD_COMM: fp32,bf16 (ddp --grad-comm)
# ddp_rows FILE LABEL: a ddp_cuda csv's rows, a line each after LABEL (the file's last lines when it has no table)
ddp_rows() {
  python3 - "$1" "$2" <<'PY'
import csv, sys
lines = open(sys.argv[1]).read().splitlines()
head = next((i for i, l in enumerate(lines) if l.startswith("device,")), len(lines))
if head == len(lines): print("\n".join(lines[-5:]))
for r in csv.DictReader(lines[head:]):
    print(f"{sys.argv[2]} compiled {r['compiled']:3s} step_ms {r['step_ms']:>8s} bwd_comm_ms {r['bwd_comm_ms']:>7s} "
          f"comm_ms {r['comm_ms']:>7s} exposed {r['exposed_ms']:>6s} pred {r.get('pred_comm_ms', ''):>7s} {r['status'][:40]}")
PY
}
for part in "$@"; do
  echo "=== $part ($(date +%T))"
  case "$part" in
  topo) nvidia-smi -L; nvidia-smi topo -m; echo "cpus: $(nproc)" ;;
  tests)  # NCCL with one rank a GPU; two ranks sharing GPU 0 through MPI host staging; the DDP and ZeRO-1 procedures
    timeout 200 mpirun --oversubscribe -np $NG $G/test_dist_cuda > "$OUT/test_dist_cuda_nccl.log" 2>&1; echo "test_dist_cuda, $NG ranks: $(tail -n 1 "$OUT/test_dist_cuda_nccl.log")"
    CUDA_VISIBLE_DEVICES=0 timeout 200 mpirun --oversubscribe -np 2 $G/test_dist_cuda > "$OUT/test_dist_cuda_staged.log" 2>&1; echo "test_dist_cuda, 2 ranks on one GPU: $(tail -n 1 "$OUT/test_dist_cuda_staged.log")"
    timeout 200 $G/test_dist_cuda > "$OUT/test_dist_cuda_1.log" 2>&1; echo "test_dist_cuda, 1 rank: $(tail -n 1 "$OUT/test_dist_cuda_1.log")"
    timeout 300 mpirun --oversubscribe -np $NG $G/test_ddp_cuda > "$OUT/test_ddp_cuda_nccl.log" 2>&1; echo "test_ddp_cuda, $NG ranks: $(tail -n 1 "$OUT/test_ddp_cuda_nccl.log")"
    CUDA_VISIBLE_DEVICES=0 timeout 300 mpirun --oversubscribe -np 2 $G/test_ddp_cuda > "$OUT/test_ddp_cuda_staged.log" 2>&1; echo "test_ddp_cuda, 2 ranks on one GPU: $(tail -n 1 "$OUT/test_ddp_cuda_staged.log")"
    grep -h "FAIL" "$OUT"/test_d*_cuda_*.log | head -20 ;;
  allreduce)
    timeout 200 $G/allreduce_cuda --backend nccl --nproc $NG --sizes 1MB,10MB,100MB,1GB --op all_reduce,reduce_scatter,all_gather --format md > "$OUT/ar_nccl_ours.md" 2>&1; cat "$OUT/ar_nccl_ours.md"
    timeout 300 python3 tests/ref/allreduce_torch.py --backend nccl --nproc $NG --sizes 1MB,10MB,100MB,1GB --op all_reduce,reduce_scatter,all_gather --format md > "$OUT/ar_nccl_torch.md" 2>&1; cat "$OUT/ar_nccl_torch.md" ;;
  window)  # plain buffers against NCCL symmetric windows (tsys_dist_tensor_new), alternating, 100 iterations; then torch
    for k in 1 2; do for b in plain window; do
      echo "== all_reduce, $b buffers ($k)"
      timeout 200 $G/allreduce_cuda --backend nccl --nproc $NG --buffers $b --sizes 256KB,1MB,4MB,10MB,100MB,1GB --iters 100 --format md > "$OUT/ar_${b}_$k.md" 2>&1
      grep "allreduce:\|^| all_reduce" "$OUT/ar_${b}_$k.md"
    done; done
    for b in plain window; do
      echo "== reduce_scatter, all_gather, $b buffers"
      timeout 200 $G/allreduce_cuda --backend nccl --nproc $NG --buffers $b --sizes 1MB,10MB,100MB,1GB --op reduce_scatter,all_gather --iters 50 --format md > "$OUT/rsag_${b}.md" 2>&1
      grep "^| \(reduce\|all_g\)" "$OUT/rsag_${b}.md"
    done
    echo "== torch.distributed, NCCL defaults"
    timeout 300 python3 tests/ref/allreduce_torch.py --backend nccl --nproc $NG --sizes 256KB,1MB,4MB,10MB,100MB,1GB --op all_reduce --iters 100 --format md > "$OUT/ar_torch.md" 2>&1
    grep "all_reduce" "$OUT/ar_torch.md" ;;
  latency)  # where the small all-reduce's time goes: NCCL alone (dev/nccl_latency.c), then tsys_dist with and without
            # its descriptor check, plain buffers and windows, alternating
    timeout 200 mpirun --oversubscribe --bind-to none -np $NG $G/nccl_latency ${ITERS:-200} 2>&1 | grep "^|\|nccl_latency"
    for k in 1 2; do for b in plain window; do for c in default 0; do
      echo "== tsys_dist, $b buffers, TSYS_DIST_CHECK=$c ($k)"
      TSYS_DIST_CHECK=$([ $c = 0 ] && echo 0 || echo "") timeout 200 $G/allreduce_cuda --backend nccl --nproc $NG --buffers $b --sizes 256KB,1MB,4MB --iters ${ITERS:-200} --format md 2>&1 | grep "^| all_reduce"
    done; done; done ;;
  protocols)  # NCCL alone at 256 KB-4 MB under each protocol / algorithm NCCL offers without NVLS, on all GPUs and on
              # two: is NCCL's default pick the small all-reduce's floor? (dev/nccl_latency.c, device time beside host time)
    for np in $NG 2; do for pa in default:default LL:default LL128:default Simple:default default:Ring default:Tree LL:Ring LL:Tree; do
      pr=${pa%%:*}; al=${pa##*:}
      env $([ $pr != default ] && echo NCCL_PROTO=$pr) $([ $al != default ] && echo NCCL_ALGO=$al) \
        timeout 120 mpirun --oversubscribe --bind-to none -np $np $G/nccl_latency ${ITERS:-200} 2>&1 | grep -E "nccl_latency|^\| plain, compute stream +\||rror"
    done; done ;;
  cpu)
    timeout 200 $G/allreduce_cuda --backend mpi --nproc 2 --sizes 4B,1MB,1GB --format md > "$OUT/ar_cpu_ours.md" 2>&1; cat "$OUT/ar_cpu_ours.md"
    timeout 300 python3 tests/ref/allreduce_torch.py --backend gloo --nproc 2 --sizes 4B,1MB,1GB --format md > "$OUT/ar_cpu_gloo.md" 2>&1; cat "$OUT/ar_cpu_gloo.md" ;;
  ddp_ours)
    timeout 300 $G/ddp_cuda --device cuda --nproc 1 --model $MODEL --dtype $DTYPES --strategy flat --warmup $WARMUP --steps $STEPS > "$OUT/ddp_ours_1gpu.md" 2>&1; cat "$OUT/ddp_ours_1gpu.md"
    timeout 500 $G/ddp_cuda --device cuda --nproc $NG --model $MODEL --dtype $DTYPES --strategy ${STRATS:-naive,flat,overlap,bucketed,zero1} --bucket-mb ${BUCKETS:-1,10,100,1000} --grad-comm ${GRAD_COMM:-fp32} \
      --warmup $WARMUP --steps $STEPS > "$OUT/ddp_ours_${NG}gpu.md" 2>&1; cat "$OUT/ddp_ours_${NG}gpu.md" ;;
  ddp_torch)
    timeout 300 torchrun --nproc_per_node 1 tests/ref/torch_ddp.py --part ddp --device cuda --model $MODEL --dtype $DTYPES --strategy flat --warmup $WARMUP --steps $STEPS > "$OUT/ddp_torch_1gpu.md" 2>&1; tail -n 8 "$OUT/ddp_torch_1gpu.md"
    timeout 500 torchrun --nproc_per_node $NG tests/ref/torch_ddp.py --part ddp --device cuda --model $MODEL --dtype $DTYPES --strategy ${TSTRATS:-naive,flat,bucketed,zero1} --bucket-mb ${TBUCKETS:-25,100} \
      --warmup $WARMUP --steps $STEPS > "$OUT/ddp_torch_${NG}gpu.md" 2>&1; tail -n 16 "$OUT/ddp_torch_${NG}gpu.md" ;;
  resume)  # the ddp driver's snapshots through NCCL (DDP plain, ZeRO-1 and FSDP sharded): 4 steps saving at 4 against
            # 2 saving at 2 and 2 more resumed; every file of the two step-4 snapshots byte for byte (the MANIFEST
            # aside: its serial counts the directory's saves)
    for s in flat zero1 fsdp; do
      r="$OUT/resume_$s"; rm -rf "$r"; mkdir -p "$r"
      a=($G/ddp_cuda --device cuda --nproc $NG --model "${RESUME_MODEL:-small}" --dtype bf16 --strategy $s --bucket-mb 25 --warmup 0 --format csv)
      "${a[@]}" --steps 4 --save-every 4 --save-dir "$r/once" > "$r/once.csv" 2>&1 || tail -3 "$r/once.csv"
      "${a[@]}" --steps 2 --save-every 2 --save-dir "$r/twice" > "$r/twice1.csv" 2>&1 || tail -3 "$r/twice1.csv"
      "${a[@]}" --steps 2 --save-every 2 --save-dir "$r/twice" --resume "$r/twice" > "$r/twice2.csv" 2>&1 || tail -3 "$r/twice2.csv"
      for f in $(ls "$r/once/step-000004" | grep -v MANIFEST); do
        cmp -s "$r/once/step-000004/$f" "$r/twice/step-000004/$f" && echo "$s: $f equal byte for byte" || echo "$s: $f DIFFERS"
      done
      rm -rf "$r"/once/step-* "$r"/twice/step-*
    done ;;
  captured)  # the captured steps' tests (DDP flat and bucketed, ZeRO-1, FSDP: eager against captured + replayed, bitwise)
             # at 2 ranks and at every GPU, then the whole DDP and FSDP suites at every GPU
    for np in 2 $NG; do for t in ddp fsdp; do
      timeout 200 mpirun --oversubscribe -np $np $G/test_${t}_cuda trainer_compiled > "$OUT/captured_${t}_${np}.log" 2>&1
      echo "test_${t}_cuda trainer_compiled, $np ranks: $(tail -n 1 "$OUT/captured_${t}_${np}.log")"
    done; done
    for t in ddp fsdp; do
      timeout 300 mpirun --oversubscribe -np $NG $G/test_${t}_cuda > "$OUT/suite_${t}_${NG}.log" 2>&1; echo "test_${t}_cuda, $NG ranks: $(tail -n 1 "$OUT/suite_${t}_${NG}.log")"
    done
    grep -h "FAIL" "$OUT"/captured_*.log "$OUT"/suite_*.log | head -20 ;;
  scaling)  # SCALE_MODELS (default xl) on 1, 2 and every GPU: DDP bucketed (100 MB), ZeRO-1, FSDP, eager and captured
            # (bf16, context 256, batch 4 a GPU); the columns that matter printed last
    for np in 1 2 $NG; do
      timeout 500 $G/ddp_cuda --device cuda --nproc $np --model ${SCALE_MODELS:-xl} --dtype bf16 --strategy bucketed,zero1,fsdp --bucket-mb 100 \
        --compile no,yes --batch-size 4 --context-length 256 --warmup $WARMUP --steps $STEPS --no-compute-ref --format csv \
        > "$OUT/scaling_${np}gpu.csv" 2> "$OUT/scaling_${np}gpu.err"; echo "$np GPU(s): exit $?"
    done
    python3 - "$OUT" <<'PY'
import csv, glob, os, sys
for p in sorted(glob.glob(os.path.join(sys.argv[1], "scaling_*gpu.csv"))):
    for r in csv.DictReader(open(p)):
        print(f"{r['model']:5s} {r['ranks']:>2s} {r['strategy']:9s} compiled {r['compiled']:3s} step_ms {r['step_ms']:>9s} std {r['step_std']:>7s} "
              f"comm_ms {r['comm_ms']:>8s} pred {r['pred_comm_ms']:>8s} peak {r['mem_post_opt_MiB']:>7s} pred {r['pred_peak_MiB']:>7s} {r['status'][:50]}")
PY
    ;;
  channels)  # does NCCL's SM share slow backward down? DDP bucketed (100 MB) xl captured step on 2 and every GPU with
             # NCCL_MAX_NCHANNELS (CTAs an all-reduce takes) at NCCL's default and at 2, 4, 8
    for np in 2 $NG; do for ch in default 2 4 8; do
      env $([ $ch != default ] && echo NCCL_MAX_NCHANNELS=$ch) timeout 120 $G/ddp_cuda --device cuda --nproc $np --model xl --dtype bf16 --strategy bucketed \
        --bucket-mb 100 --compile no,yes --batch-size 4 --context-length 256 --warmup 2 --steps 5 --no-compute-ref --format csv > "$OUT/channels_${np}_$ch.csv" 2>&1
      python3 - "$OUT/channels_${np}_$ch.csv" "$np" "$ch" <<'PY'
import csv, sys
lines = open(sys.argv[1]).read().splitlines()
head = next((i for i, l in enumerate(lines) if l.startswith("device,")), len(lines))
for r in csv.DictReader(lines[head:]):
    print(f"{sys.argv[2]} GPUs, NCCL_MAX_NCHANNELS {sys.argv[3]:7s} compiled {r['compiled']:3s} step_ms {r['step_ms']:>8s} bwd_comm_ms {r['bwd_comm_ms']:>7s} "
          f"comm_ms {r['comm_ms']:>7s} exposed {r['exposed_ms']:>6s} {r['status'][:40]}")
PY
    done; done ;;
  scaling_torch)  # the same rows in PyTorch (tests/ref/torch_ddp.py): DDP bucketed (100 MB) and FSDP2, SDPA attention,
                  # eager and torch.compile, on 2 and every GPU (TORCH_NPS); the columns that matter printed last
    for np in ${TORCH_NPS:-2 $NG}; do
      timeout 560 torchrun --nproc_per_node $np tests/ref/torch_ddp.py --part ddp --device cuda --model ${SCALE_MODELS:-xl} --dtype bf16 \
        --context-length 256 --batch-size 4 --strategy ${TORCH_STRATS:-bucketed,fsdp2} --bucket-mb 100 --attn sdpa --compile no,yes \
        --warmup $WARMUP --steps $STEPS --format csv > "$OUT/scaling_torch_${np}gpu.csv" 2> "$OUT/scaling_torch_${np}gpu.err"; echo "torch, $np GPUs: exit $?"
    done
    python3 - "$OUT" <<'PY'
import csv, glob, os, sys
for p in sorted(glob.glob(os.path.join(sys.argv[1], "scaling_torch_*gpu.csv"))):
    lines = open(p).read().splitlines()
    head = next((i for i, l in enumerate(lines) if l.startswith("device,")), len(lines))   # after torch's version line
    for r in csv.DictReader(l for l in lines[head:] if l.strip()):
        print(f"torch {r.get('model', ''):5s} {r.get('ranks', ''):>2s} {r.get('strategy', ''):9s} {r.get('attn', '')} compiled {r.get('compiled', ''):3s} "
              f"step_ms {r.get('step_ms', ''):>9s} std {r.get('step_std', ''):>7s} comm_ms {r.get('comm_ms', '')} {r.get('status', '')[:60]}")
PY
    ;;
  ce)  # DDP's gradient all-reduce on the copy engines against NCCL beside xl's backward GEMMs (dev/ce_lab.cu, one rank a
       # GPU, twice); the library's copy-engine all-reduce's test; the xl DDP bucketed step on 1 GPU and on every GPU
       # with NCCL's all-reduce and with the copy engines' (TSYS_DIST_CE=1)
    for r in 1 2; do timeout 200 mpirun --oversubscribe --bind-to none -np $NG $G/ce_lab 2>&1 | grep -v "^$" | tail -16; done
    timeout 300 mpirun --oversubscribe --bind-to none -np $NG $G/test_dist_cuda ce_allreduce > "$OUT/ce_test.log" 2>&1
    echo "test_dist_cuda ce_allreduce, $NG ranks: $(tail -n 1 "$OUT/ce_test.log")"
    for run in 1:0:100 $NG:0:100 $NG:1:100 $NG:1:200; do   # GPUs:TSYS_DIST_CE:bucket MB
      IFS=: read -r np ce mb <<< "$run"
      TSYS_DIST_CE=$ce timeout 300 $G/ddp_cuda --device cuda --nproc $np --model xl --dtype bf16 --strategy bucketed --bucket-mb $mb --compile no,yes \
        --batch-size 4 --context-length 256 --warmup 2 --steps 5 --no-compute-ref --format csv > "$OUT/ce_ddp_${np}_${ce}_$mb.csv" 2>&1
      ddp_rows "$OUT/ce_ddp_${np}_${ce}_$mb.csv" "$np GPU(s), TSYS_DIST_CE=$ce, $mb MB, bucketed"
    done ;;
  options)  # the 1-GPU step's options on every rank (docs/BENCHMARKS.md section 14's tables): for each of SCALE_MODELS
             # (default xl), e2e's best 1-GPU step, ddp on 1 rank, then on each of NPS ranks (default 2): DDP gathered and
             # DDP through NCCL with kept copies and AdamW in backward (bf16 gradients where gathered), ZeRO-1 gathered
             # with bf16 gradients, FSDP resharded, FSDP kept with AdamW in backward (through NCCL and on the copy engines:
             # --grad-comm gather), DDP gathered with each bucket's
             # owner pushing bf16 copies (--shard-updates masters) and ZeRO-1 as those owners (100 MB buckets); torch
             # DDP / FSDP2 eager and compiled when TORCH=1
    D="--device cuda --dtype bf16 --batch-size 4 --context-length 256 --warmup 2 --steps 5 --no-compute-ref --format csv"
    O="--lowp-copies yes --lowp-grads yes --opt-in-backward yes"
    for M in $(echo "${SCALE_MODELS:-xl}" | tr , ' '); do
      timeout 200 $G/e2e_cuda --device cuda --mode train --model $M --dtype bf16 --compile yes $O --batch-size 4 --context-length 256 --warmup 3 --steps 10 --no-sgemm --format csv > "$OUT/options_${M}_e2e.csv" 2>&1
      timeout 200 $G/ddp_cuda $D --nproc 1 --model $M --strategy bucketed --bucket-mb 200 $O --compile no,yes > "$OUT/options_${M}_1_ddp.csv" 2>&1
      python3 -c 'import csv, sys; L = open(sys.argv[1]).read().splitlines(); h = next((i for i, l in enumerate(L) if l.startswith("device,")), len(L))
[print(sys.argv[2], "e2e total_ms", r["total_ms"], r["status"]) for r in csv.DictReader(L[h:])]' "$OUT/options_${M}_e2e.csv" "$M"
      ddp_rows "$OUT/options_${M}_1_ddp.csv" "$M 1 ddp"
      for np in ${NPS:-2}; do
        timeout 200 $G/ddp_cuda $D --nproc $np --model $M --strategy bucketed --bucket-mb 200 --grad-comm gather $O --compile no,yes > "$OUT/options_${M}_${np}_ddp.csv" 2>&1
        timeout 200 $G/ddp_cuda $D --nproc $np --model $M --strategy bucketed --bucket-mb 100 --lowp-copies yes --opt-in-backward yes --compile no,yes > "$OUT/options_${M}_${np}_nccl.csv" 2>&1
        timeout 200 $G/ddp_cuda $D --nproc $np --model $M --strategy zero1 --bucket-mb 200 --grad-comm gather --lowp-grads yes --compile no,yes > "$OUT/options_${M}_${np}_zero1.csv" 2>&1
        timeout 200 $G/ddp_cuda $D --nproc $np --model $M --strategy fsdp --compile no,yes > "$OUT/options_${M}_${np}_fsdp.csv" 2>&1
        timeout 200 $G/ddp_cuda $D --nproc $np --model $M --strategy fsdp --fsdp-reshard no --opt-in-backward yes --compile no,yes > "$OUT/options_${M}_${np}_fsdpkept.csv" 2>&1
        timeout 200 $G/ddp_cuda $D --nproc $np --model $M --strategy fsdp --fsdp-reshard no --opt-in-backward yes --grad-comm gather --compile no,yes > "$OUT/options_${M}_${np}_fsdpce.csv" 2>&1
        timeout 200 $G/ddp_cuda $D --nproc $np --model $M --strategy bucketed --bucket-mb 100 --grad-comm gather --shard-updates masters $O --compile no,yes > "$OUT/options_${M}_${np}_masters.csv" 2>&1
        timeout 200 $G/ddp_cuda $D --nproc $np --model $M --strategy zero1 --bucket-mb 100 --grad-comm gather --shard-updates masters $O --compile no,yes > "$OUT/options_${M}_${np}_owners.csv" 2>&1
        for k in ddp nccl zero1 fsdp fsdpkept fsdpce masters owners; do ddp_rows "$OUT/options_${M}_${np}_$k.csv" "$M $np $k"; done
        [ -n "${TORCH:-}" ] || continue
        timeout 500 torchrun --nproc_per_node $np tests/ref/torch_ddp.py --part ddp --device cuda --model $M --dtype bf16 --context-length 256 \
          --batch-size 4 --strategy bucketed,fsdp2 --bucket-mb 100 --attn sdpa --compile no,yes --warmup 3 --steps 5 --format csv > "$OUT/options_${M}_${np}_torch.csv" 2>/dev/null
        python3 -c 'import csv, sys; L = open(sys.argv[1]).read().splitlines(); h = next((i for i, l in enumerate(L) if l.startswith("device,")), len(L))
[print(sys.argv[2], "torch", r.get("strategy", ""), "compiled", r.get("compiled", ""), "step_ms", r.get("step_ms", ""), r.get("status", "")[:60]) for r in csv.DictReader(l for l in L[h:] if l.strip())]' "$OUT/options_${M}_${np}_torch.csv" "$M $np"
      done
    done ;;
  fsdp_ce)  # tsys_fsdp_desc.ce_transfers: test_fsdp_cuda at NPS ranks (default 2) and at 1; then for each of SCALE_MODELS
            # (default xl) e2e's best 1-GPU step, and on NPS ranks FSDP kept with AdamW in backward through NCCL and on the
            # copy engines, beside DDP gathered with each bucket's owner pushing bf16 copies (100 MB buckets), captured
            # (COMPILE=no,yes for the eager rows too); torch FSDP2 eager and compiled when TORCH=1
    for np in ${NPS:-2}; do
      timeout 500 $G/test_fsdp_cuda --nproc $np ${FSDP_TESTS:-} > "$OUT/fsdp_ce_test_$np.log" 2>&1; echo "test_fsdp_cuda, $np ranks: $(tail -n 1 "$OUT/fsdp_ce_test_$np.log")"
    done
    timeout 300 $G/test_fsdp_cuda ${FSDP_TESTS:-} > "$OUT/fsdp_ce_test_1.log" 2>&1; echo "test_fsdp_cuda, 1 rank: $(tail -n 1 "$OUT/fsdp_ce_test_1.log")"
    grep -h "FAIL" "$OUT"/fsdp_ce_test_*.log | head -10
    D="--device cuda --dtype bf16 --batch-size 4 --context-length 256 --warmup 2 --steps ${STEPS} --no-compute-ref --format csv"
    O="--lowp-copies yes --lowp-grads yes --opt-in-backward yes"
    for M in $(echo "${SCALE_MODELS:-xl}" | tr , ' '); do
      timeout 200 $G/e2e_cuda --device cuda --mode train --model $M --dtype bf16 --compile yes $O --batch-size 4 --context-length 256 --warmup 3 --steps 10 --no-sgemm --format csv > "$OUT/fsdp_ce_${M}_e2e.csv" 2>&1
      python3 -c 'import csv, sys; L = open(sys.argv[1]).read().splitlines(); h = next((i for i, l in enumerate(L) if l.startswith("device,")), len(L))
[print(sys.argv[2], "e2e total_ms", r["total_ms"], r["status"]) for r in csv.DictReader(L[h:])]' "$OUT/fsdp_ce_${M}_e2e.csv" "$M"
      for np in ${NPS:-2}; do
        timeout 200 $G/ddp_cuda $D --nproc $np --model $M --strategy fsdp --fsdp-reshard no --opt-in-backward yes --grad-comm fp32,gather --compile ${COMPILE:-yes} > "$OUT/fsdp_ce_${M}_${np}_fsdp.csv" 2>&1
        timeout 200 $G/ddp_cuda $D --nproc $np --model $M --strategy bucketed --bucket-mb 100 --grad-comm gather --shard-updates masters $O --compile ${COMPILE:-yes} > "$OUT/fsdp_ce_${M}_${np}_masters.csv" 2>&1
        for k in fsdp masters; do ddp_rows "$OUT/fsdp_ce_${M}_${np}_$k.csv" "$M $np $k"; done
        [ -n "${TORCH:-}" ] || continue   # torch FSDP2, eager and compiled, SDPA attention
        timeout 300 torchrun --nproc_per_node $np tests/ref/torch_ddp.py --part ddp --device cuda --model $M --dtype bf16 --context-length 256 \
          --batch-size 4 --strategy fsdp2 --attn sdpa --compile no,yes --warmup 3 --steps 5 --format csv > "$OUT/fsdp_ce_${M}_${np}_torch.csv" 2>/dev/null
        python3 -c 'import csv, sys; L = open(sys.argv[1]).read().splitlines(); h = next((i for i, l in enumerate(L) if l.startswith("device,")), len(L))
[print(sys.argv[2], "torch", r.get("strategy", ""), "compiled", r.get("compiled", ""), "step_ms", r.get("step_ms", ""), r.get("status", "")[:60]) for r in csv.DictReader(l for l in L[h:] if l.strip())]' "$OUT/fsdp_ce_${M}_${np}_torch.csv" "$M $np"
      done
    done ;;
  gather)  # tsys_ddp_desc.ce_gather: AdamW's rank sums on GPU 0, the DDP tests at 2 ranks (captured against NCCL, bitwise),
            # then MODEL's step on 1 GPU and on 2 (GATHER_BASE: DDP through NCCL and the copy-engine all-reduce), then GATHER_RUNS
    timeout 200 $G/test_cuda adamw_sums > "$OUT/gather_test_cuda.log" 2>&1; echo "test_cuda adamw_sums: $(tail -n 1 "$OUT/gather_test_cuda.log")"
    timeout 400 mpirun --oversubscribe --bind-to none -np 2 $G/test_ddp_cuda ${GATHER_TESTS:-} > "$OUT/gather_test_ddp.log" 2>&1; echo "test_ddp_cuda, 2 ranks: $(tail -n 1 "$OUT/gather_test_ddp.log")"
    grep -h "FAIL" "$OUT"/gather_test_*.log | head -10
    for run in ${GATHER_BASE:-1:0:fp32:100 2:0:fp32:100 2:1:fp32:200} ${GATHER_RUNS:-2:0:gather:100 2:0:gather:200}; do   # GPUs:TSYS_DIST_CE:--grad-comm:bucket MB[:strategy]
      IFS=: read -r np ce gc mb st <<< "$run"; st=${st:-bucketed}
      TSYS_DIST_CE=$ce timeout 300 $G/ddp_cuda --device cuda --nproc $np --model $MODEL --dtype bf16 --strategy $st --bucket-mb $mb --grad-comm $gc \
        --compile no,yes --batch-size 4 --context-length 256 --warmup 2 --steps 5 --no-compute-ref --format csv > "$OUT/gather_ddp_${MODEL}_${np}_${ce}_${gc}_${mb}_$st.csv" 2>&1
      ddp_rows "$OUT/gather_ddp_${MODEL}_${np}_${ce}_${gc}_${mb}_$st.csv" "$MODEL, $np GPU(s), TSYS_DIST_CE=$ce, $st, $gc, $mb MB,"
    done ;;
  ddpprof)  # rank 0's profile of one eager DDP step (bucketed 100 MB, MODEL, bf16, context 256, batch 4) alone and
            # beside 1 and NG-1 peers: which kernels slow down while NCCL runs (kernel tables by phase)
    for np in 1 2 $NG; do
      timeout 300 $G/ddp_cuda --device cuda --nproc $np --model $MODEL --dtype bf16 --strategy bucketed --bucket-mb 100 --batch-size 4 \
        --context-length 256 --warmup $WARMUP --steps $STEPS --no-compute-ref --profile "$OUT/ddpprof" --format md > "$OUT/ddpprof_${np}.md" 2>&1; echo "$np GPU(s): exit $?"
      grep "^| cuda" "$OUT/ddpprof_${np}.md" | cut -d'|' -f5,14-17
      f=$(ls "$OUT"/ddpprof/*_${np}ranks_bucket-100.md 2>/dev/null | head -1)
      [ -n "$f" ] && { grep "profiled step" "$f"; grep "^| [a-z_0-9]* | cuda" "$f" | head -12 | cut -d'|' -f2,5,6,11-13; }
    done ;;
  account) $G/ddp_cuda --account --device cuda --nproc $NG --model $MODEL --dtype $DTYPES ;;
  fsdp)  # FSDP (ZeRO-3): its tests through NCCL, with 2 ranks on one GPU (staging) and alone; then the xl rows
         # (batch 4 per GPU, context 256) beside DDP's best (bucketed 1000 MB, overlap) and the 1-GPU overhead;
         # last, peak memory per rank against the accounting (needs build/test_fsdp_cuda and build/ddp_cuda in gpu/dist)
    timeout 300 mpirun --oversubscribe -np $NG $G/test_fsdp_cuda > "$OUT/test_fsdp_cuda_nccl.log" 2>&1; echo "test_fsdp_cuda, $NG ranks: $(tail -n 1 "$OUT/test_fsdp_cuda_nccl.log")"
    CUDA_VISIBLE_DEVICES=0 timeout 300 mpirun --oversubscribe -np 2 $G/test_fsdp_cuda > "$OUT/test_fsdp_cuda_staged.log" 2>&1; echo "test_fsdp_cuda, 2 ranks on one GPU: $(tail -n 1 "$OUT/test_fsdp_cuda_staged.log")"
    timeout 200 $G/test_fsdp_cuda > "$OUT/test_fsdp_cuda_1.log" 2>&1; echo "test_fsdp_cuda, 1 rank: $(tail -n 1 "$OUT/test_fsdp_cuda_1.log")"
    grep -h "FAIL" "$OUT"/test_fsdp_cuda_*.log | head -20
    for dt in ${FSDP_DTYPES:-bf16 fp32}; do
      timeout 600 $G/ddp_cuda --device cuda --nproc $NG --model $MODEL --dtype $dt --strategy fsdp,bucketed,overlap --bucket-mb 1000 \
        --batch-size 4 --context-length 256 --warmup $WARMUP --steps $STEPS > "$OUT/fsdp_${MODEL}_${dt}_${NG}gpu.md" 2>&1; cat "$OUT/fsdp_${MODEL}_${dt}_${NG}gpu.md"
    done
    timeout 400 $G/ddp_cuda --device cuda --nproc 1 --model $MODEL --dtype bf16 --strategy flat,fsdp --batch-size 4 --context-length 256 \
      --warmup $WARMUP --steps $STEPS > "$OUT/fsdp_${MODEL}_bf16_1gpu.md" 2>&1; cat "$OUT/fsdp_${MODEL}_bf16_1gpu.md"
    echo "peak memory per rank (MiB) against the accounting:"
    for f in "$OUT"/fsdp_${MODEL}_*gpu.md; do
      awk -F'|' '/^\| device/ { for (i = 2; i < NF; i++) { gsub(/ /, "", $i); c[$i] = i }; next }
        /^\| cuda/ { s = $c["strategy"]; gsub(/ /, "", s); pk = $c["mem_pre_opt_MiB"] + 0; po = $c["mem_post_opt_MiB"] + 0; pp = $c["pred_peak_MiB"] + 0;
          st = $c["state_MiB"] + 0; ps = $c["pred_state_MiB"] + 0; m = (pk > po) ? pk : po;
          printf "  %-9s %-5s ranks %s  step %s ms  peak %.0f, predicted %.0f (%+.1f %%)  state %.0f, predicted %.0f (%+.1f %%)\n", s, $c["dtype"], $c["ranks"], $c["step_ms"], m, pp, (pp > 0) ? 100 * (m - pp) / pp : 0, st, ps, (ps > 0) ? 100 * (st - ps) / ps : 0 }' "$f"
    done ;;
  fsdp_ckpt)  # FSDP's checkpointing tests through NCCL (needs build/test_fsdp_cuda in gpu/dist)
    timeout 300 mpirun --oversubscribe -np $NG $G/test_fsdp_cuda > "$OUT/test_fsdp_cuda_nccl.log" 2>&1; echo "test_fsdp_cuda, $NG ranks: $(tail -n 1 "$OUT/test_fsdp_cuda_nccl.log")"
    grep -h "FAIL\|checkpoint" "$OUT"/test_fsdp_cuda_nccl.log | head -20 ;;
  lbsave)  # the S26 leaderboard model's snapshot under FSDP on 2 GPUs (LB_NP): one step at context LB_T (default 256:
           # the snapshot is the same 12 bytes a parameter at any context), a sharded snapshot after it, its size, then
           # a run resumed from it (LB_DROP=1: the page cache dropped first, where the machine allows)
    S=${SAVE_DIR:-/tmp/tsys_lbsave}; rm -rf "$S"; df -h /tmp | tail -1
    lb=($G/ddp_cuda --device cuda --nproc ${LB_NP:-2} --model custom --d-model 4096 --d-ff 11008 --num-layers 34 --num-heads 32 --vocab-size 151936
        --context-length ${LB_T:-256} --batch-size 1 --dtype bf16 --attn flash --strategy fsdp --loss sum --no-compute-ref --warmup 0 --format csv)
    timeout 400 "${lb[@]}" --steps 1 --save-every 1 --save-dir "$S" > "$OUT/lbsave.csv" 2> "$OUT/lbsave.err"; echo "save: exit $?"
    grep "snapshot step" "$OUT/lbsave.err"; du -sb "$S"/step-* 2>/dev/null; ls -la "$S"/step-* 2>/dev/null | head -8
    if [ -n "${LB_DROP:-}" ]; then sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null && echo "page cache dropped" || echo "page cache NOT dropped"; else echo "page cache kept (LB_DROP=1 drops it)"; fi
    timeout 400 "${lb[@]}" --steps 1 --resume "$S" > "$OUT/lbload.csv" 2> "$OUT/lbload.err"; echo "load: exit $?"
    grep "resumed" "$OUT/lbload.err"; grep -h "error\|OOM" "$OUT"/lbsave.* "$OUT"/lbload.* | head -5; rm -rf "$S" ;;
  leaderboard)  # the S26 leaderboard step: 8.1 B parameters (d 4096, d_ff 11008, 34 layers, 32 heads, vocab 151936),
                # context 32768, batch 2 in all, bf16, causal flash attention, cross_entropy(...).sum(), forward +
                # backward + AdamW, under FSDP with activation checkpointing: each policy of LB_CKPT (comma list,
                # default blocks:1+keep-attn); LB_PROFILE=1: rank 0's profile of one more step of the first one;
                # LB_FUSED=1: the LM head and the loss fused (--fused-loss)
    IFS=, read -ra pols <<< "${LB_CKPT:-blocks:1+keep-attn}"; prof=(--profile "$OUT/lbprof")
    fused=(); [ "${LB_FUSED:-0}" = 1 ] && fused=(--fused-loss)
    for pol in "${pols[@]}"; do
      f="$OUT/leaderboard_${NG}gpu_${pol//[^a-z0-9]/-}${fused:+_fused}.md"
      timeout 560 $G/ddp_cuda --device cuda --nproc $NG --model custom --d-model 4096 --d-ff 11008 --num-layers 34 --num-heads 32 --vocab-size 151936 \
        --context-length 32768 --batch-size $((2 / NG)) --dtype bf16 --attn flash --strategy fsdp --checkpoint "$pol" --loss sum \
        --no-compute-ref --warmup ${LB_WARMUP:-1} --steps ${LB_STEPS:-2} --format md ${LB_PROFILE:+"${prof[@]}"} "${fused[@]}" > "$f" 2>&1
      echo "$pol${fused:+ (fused loss)}: exit $?"
      grep "^| cuda\|error\|profile of" "$f"; prof=()
    done ;;
  *) echo "unknown part $part" ;;
  esac
done
