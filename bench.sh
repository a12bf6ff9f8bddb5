#!/usr/bin/env bash
# bench.sh - sweeps that print the tables of the CS336 report.
#   ./bench.sh [section ...]      sections: e2e warmup precision attn flash leaderboard ddp checkpoint (default: all)
#     attn         CS336 pytorch_attention: naive vs flash, batch 8, d x seq, fp32, memory before backward
#     flash        CS336 flash_benchmarking: batch 1, causal, seq 128..65536, d 16..128, bf16 + fp32
#     leaderboard  the CS336 FlashAttention-2 leaderboard shape (16 heads x 16384 x 64, bf16, causal)
#     allreduce    CS336 distributed_communication_single_node (not in the default list): all-reduce of
#                  float32 over NPROCS ranks (cpu: 2,4 through shared memory; cuda: 2,4,6 GPUs, NCCL),
#                  AR_SIZES (1MB,10MB,100MB,1GB), AR_OPS (all_reduce), with a torch.distributed row
#                  (gloo / nccl, tests/ref/allreduce_torch.py) for each when python3 has torch
#     memory       CS336 memory_profiling (not in the default list): MEM_MODELS (2.7B on cuda, small on cpu) x
#                  MEM_CONTEXT (128,256,512) x forward, train x fp32, bf16: the peak table, its breakdown, the
#                  prediction, the largest allocations, and a timeline plot (SVG) per row in $OUT/memory (or
#                  ./memory-profile); on cuda with torch, torch.cuda.max_memory_allocated beside each row
#     profile      CS336 nsys_profile (not in the default list): PROF_MODELS (every preset) x PROF_CONTEXT
#                  (128,256,512,1024) x forward, forward-backward, train, PROF_DTYPES (fp32), naive attention,
#                  profiled by the built-in profiler (tables + Chrome traces in $OUT/profile or ./profile), then
#                  one summary table per question of the report
#     ddp          CS336 naive/flat/overlap/bucketed DDP and ZeRO-1 (problems 14-19, 22) on DDP_NPROC ranks
#                  (default: 2 CPU ranks, or one rank per GPU; the built-in launcher); on GPUs the fastest captured step
#                  on 1 rank and on DDP_NPROC (2: DDP with bf16 gradients gathered, kept copies, AdamW in backward; more:
#                  FSDP with units kept and AdamW in backward); then the accounting prediction (problem 22, DDP vs ZeRO-1/2/3)
#     checkpoint   CS336 (S26) gradient_checkpointing: the xl block's accounting at context 2048, batch 4, fp32 per policy
#                  (the reference's 3651 / 14605 / 160 MiB), then step time, bytes kept and peak per policy (CKPT_POLICIES;
#                  cuda: xl fp32 context 2048 and 2.7B bf16 context 1024; cpu: the first model of MODELS at CONTEXT)
# Environment: DEVICE=cpu|cuda (default: cuda when a GPU and nvcc are present), MODELS, CONTEXT, COMPILE (no,yes),
# STEPS, WARMUP, FORMAT (md|csv|jsonl), OUT (a folder: every table is also saved there);
# ddp: DDP_NPROC, DDP_MODELS (default xl on cuda, small on cpu), DDP_DTYPES, DDP_CONTEXT (256), DDP_BUCKETS (1,10,100,1000), DDP_STEPS/DDP_WARMUP
# (default STEPS/WARMUP on cuda; 3 and 1 on cpu, where a small-model step takes seconds per rank);
# attention sections: ATTN_SEQ, ATTN_D, ATTN_BATCH, ATTN_REPS override the sizes (on the CPU they
# default to small ones so that the sweeps finish in minutes).
# Out-of-memory rows are expected in these sweeps (2.7B, long sequences) and pass (--oom-ok); a
# section with an error row fails, the others still run, and bench.sh then exits 1.
set -euo pipefail
# --help: the comment above, which is the reference; a section name that is not one is refused before
# anything is built (exit 2, as the drivers' bad usage)
known=" e2e warmup precision attn flash leaderboard allreduce memory profile ddp checkpoint "
for a in "$@"; do
  case "$a" in
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) [[ "$known" == *" $a "* ]] || { echo "bench.sh: unknown section '$a' (bench.sh --help lists them)" >&2; exit 2; } ;;
  esac
done
cd "$(dirname "$0")"
if [ -z "${DEVICE:-}" ]; then
  if command -v nvcc >/dev/null && nvidia-smi -L 2>/dev/null | grep -q GPU; then DEVICE=cuda; else DEVICE=cpu; fi
fi
if [ "$DEVICE" = cuda ]; then
  make -s build/e2e_cuda build/precision build/attn_cuda; E2E=build/e2e_cuda; ATTN=build/attn_cuda
  CONTEXT=${CONTEXT:-128,256,512,1024}; COMPILE=${COMPILE:-no,yes}
  MODELS=${MODELS:-small,medium,large,xl,2.7B}; DTYPES=${DTYPES:-fp32,bf16}
  attn_args=(); flash_args=(); lb_args=()   # the presets' own sizes
else
  make -s all; E2E=build/e2e; ATTN=build/attn
  MODELS=${MODELS:-small}; DTYPES=${DTYPES:-fp32,bf16}   # larger presets take minutes per step on a CPU
  # the CPU flash attention is the fp32 reference (no bf16) and slow: small sizes, few repeats
  attn_args=(--batch 2 --seq 256,1024 --d 16,64 --warmup 1 --reps 3)
  flash_args=(--seq 128,256,512,1024 --d 16,64 --dtype fp32 --warmup 1 --reps 3)
  lb_args=(--seq 512 --dtype fp32 --warmup 1 --reps 3)
fi
CONTEXT=${CONTEXT:-256}; COMPILE=${COMPILE:-no}; STEPS=${STEPS:-10}; WARMUP=${WARMUP:-5}; FORMAT=${FORMAT:-md}
OUT=${OUT:-}
[ -n "$OUT" ] && mkdir -p "$OUT"
sections=("$@"); [ ${#sections[@]} -eq 0 ] && sections=(e2e warmup precision attn flash leaderboard ddp checkpoint)
# explicit sizes for the attention sections (the same for all three)
attn_env=()
[ -n "${ATTN_SEQ:-}" ] && attn_env+=(--seq "$ATTN_SEQ")
[ -n "${ATTN_D:-}" ] && attn_env+=(--d "$ATTN_D")
[ -n "${ATTN_BATCH:-}" ] && attn_env+=(--batch "$ATTN_BATCH")
[ -n "${ATTN_REPS:-}" ] && attn_env+=(--reps "$ATTN_REPS")

save() { if [ -n "$OUT" ]; then tee "$OUT/$1"; else cat; fi; }

failed=()
for s in "${sections[@]}"; do
  rc=0
  case "$s" in
  e2e)
    echo "## End-to-end: models x contexts x modes x dtypes x compiled ($DEVICE, batch 4, warmup $WARMUP, $STEPS steps)"
    $E2E --device "$DEVICE" --model "$MODELS" --context-length "$CONTEXT" --mode forward,forward-backward,train --compile "$COMPILE" \
         --dtype "$DTYPES" --warmup "$WARMUP" --steps "$STEPS" --format "$FORMAT" --oom-ok | save e2e.$FORMAT || rc=$? ;;
  warmup)
    echo "## Warmup steps 0, 1, 2, 5 (forward-backward, fp32, first model of MODELS)"
    ( st=0
      for w in 0 1 2 5; do
        $E2E --device "$DEVICE" --model "${MODELS%%,*}" --context-length "$CONTEXT" --mode forward-backward --warmup $w --steps "$STEPS" \
             --format csv --no-sgemm --oom-ok || st=$?
      done
      exit $st ) | awk 'NR == 1 || !/^device,/' | save warmup.csv || rc=$? ;;
  precision)
    build/precision | save precision.md || rc=$? ;;
  attn)
    echo "## pytorch_attention: naive vs flash attention, fp32, no head dim ($DEVICE)"
    $ATTN --device "$DEVICE" --sweep pytorch_attention ${attn_args[@]+"${attn_args[@]}"} ${attn_env[@]+"${attn_env[@]}"} --format "$FORMAT" --oom-ok \
      | save attn.$FORMAT || rc=$? ;;
  flash)
    echo "## flash_benchmarking: batch 1, causal, naive vs flash ($DEVICE)"
    $ATTN --device "$DEVICE" --sweep flash_benchmarking ${flash_args[@]+"${flash_args[@]}"} ${attn_env[@]+"${attn_env[@]}"} --format "$FORMAT" --oom-ok \
      | save flash.$FORMAT || rc=$? ;;
  leaderboard)
    echo "## FlashAttention-2 leaderboard shape: o = attention(q, k, v, causal); o.sum().backward() ($DEVICE)"
    $ATTN --device "$DEVICE" --sweep leaderboard ${lb_args[@]+"${lb_args[@]}"} ${attn_env[@]+"${attn_env[@]}"} --format "$FORMAT" --oom-ok \
      | save leaderboard.$FORMAT || rc=$? ;;
  allreduce)
    if [ "$DEVICE" = cuda ]; then make -s build/allreduce_cuda; AR=(build/allreduce_cuda --backend nccl); TB=nccl
      gpus=$(nvidia-smi -L | grep -c GPU); NPROCS=${NPROCS:-$(for n in 2 4 6; do [ "$n" -le "$gpus" ] && printf '%s,' $n; done)}
    else make -s build/allreduce; AR=(build/allreduce --backend mpi); TB=gloo; NPROCS=${NPROCS:-2,4}; fi
    echo "## distributed_communication_single_node: ${AR_OPS:-all_reduce}, float32, ranks ${NPROCS%,} ($DEVICE; busbw = algbw x 2(n-1)/n)"
    for n in ${NPROCS//,/ }; do
      "${AR[@]}" --nproc "$n" --sizes "${AR_SIZES:-1MB,10MB,100MB,1GB}" --op "${AR_OPS:-all_reduce}" --warmup "$WARMUP" --format "$FORMAT"
      if python3 -c 'import torch' 2>/dev/null; then
        python3 tests/ref/allreduce_torch.py --backend $TB --nproc "$n" --sizes "${AR_SIZES:-1MB,10MB,100MB,1GB}" --op "${AR_OPS:-all_reduce}" --warmup "$WARMUP" --format md
      fi
    done | save allreduce.$FORMAT || rc=$? ;;
  ddp)
    if [ "$DEVICE" = cuda ]; then make -s build/ddp_cuda; DDP=build/ddp_cuda; DDP_MODELS=${DDP_MODELS:-xl}; DDP_DTYPES=${DDP_DTYPES:-fp32,bf16}
    else make -s build/ddp; DDP=build/ddp; DDP_MODELS=${DDP_MODELS:-small}; DDP_DTYPES=${DDP_DTYPES:-fp32}; DDP_STEPS=${DDP_STEPS:-3}; DDP_WARMUP=${DDP_WARMUP:-1}; fi
    DDP_CONTEXT=${DDP_CONTEXT:-256}
    if [ "$DEVICE" = cuda ]; then DDP_NPROC=${DDP_NPROC:-$(nvidia-smi -L | grep -c GPU)}; fi   # NCCL: one rank per GPU
    DDP_NPROC=${DDP_NPROC:-2}; DDP_BUCKETS=${DDP_BUCKETS:-1,10,100,1000}; DDP_STEPS=${DDP_STEPS:-$STEPS}; DDP_WARMUP=${DDP_WARMUP:-$WARMUP}
    echo "## DDP: naive, flat, overlap, bucketed ($DDP_BUCKETS MB), ZeRO-1 ($DEVICE, $DDP_NPROC ranks, $DDP_MODELS, batch 4 per rank, context $DDP_CONTEXT, warmup $DDP_WARMUP, $DDP_STEPS steps)"
    $DDP --device "$DEVICE" --nproc "$DDP_NPROC" --model "$DDP_MODELS" --strategy naive,flat,overlap,bucketed,zero1 --bucket-mb "$DDP_BUCKETS" \
         --dtype "$DDP_DTYPES" --context-length "$DDP_CONTEXT" --warmup "$DDP_WARMUP" --steps "$DDP_STEPS" --format "$FORMAT" | save ddp.$FORMAT || rc=$?
    if [ "$DEVICE" = cuda ] && [ "$DDP_NPROC" -ge 2 ]; then   # the fastest captured step of 1 GPU and of DDP_NPROC (BENCHMARKS section 14)
      O=(--model "$DDP_MODELS" --dtype bf16 --compile yes --context-length "$DDP_CONTEXT" --warmup "$DDP_WARMUP" --steps "$DDP_STEPS" --format "$FORMAT")
      K=(--lowp-copies yes --lowp-grads yes --opt-in-backward yes)
      echo
      echo "## The fastest captured step: 1 rank with the 1-GPU step's options (kept copies, bf16 gradients, AdamW in backward); $DDP_NPROC ranks:" \
           "$([ "$DDP_NPROC" -eq 2 ] && echo "DDP, gradients gathered, each bucket updated by its owner, weights sent as their bf16 copies; FSDP, units on the copy engines" || echo "FSDP, units kept, AdamW in backward")"
      $DDP --device cuda --nproc 1 --strategy bucketed --bucket-mb 200 "${K[@]}" "${O[@]}" | save ddp_fastest_1.$FORMAT || rc=$?
      if [ "$DDP_NPROC" -eq 2 ]; then   # the gather moves (ranks - 1) x the gradients a rank: for 2 ranks
        $DDP --device cuda --nproc 2 --strategy bucketed --bucket-mb 100 --grad-comm gather --shard-updates masters "${K[@]}" "${O[@]}"
        $DDP --device cuda --nproc 2 --strategy fsdp --fsdp-reshard no --opt-in-backward yes --grad-comm gather "${O[@]}"   # FSDP, units on the copy engines
      else
        $DDP --device cuda --nproc "$DDP_NPROC" --strategy fsdp --fsdp-reshard no --opt-in-backward yes "${O[@]}"
      fi | save ddp_fastest_$DDP_NPROC.$FORMAT || rc=$?
    fi
    echo
    echo "## Accounting: bytes per rank and sent per step, DDP vs ZeRO-1 (ZeRO-2/3 on paper), $DDP_NPROC ranks"
    $DDP --account --device "$DEVICE" --nproc "$DDP_NPROC" --model "$DDP_MODELS" --dtype "$DDP_DTYPES" --context-length "$DDP_CONTEXT" --format "$FORMAT" | save ddp_account.$FORMAT || rc=$? ;;
  checkpoint)
    pols=${CKPT_POLICIES:-none,selective,blocks:1,blocks:2,sqrt,nested,nested+selective}
    echo "## gradient_checkpointing: what the xl (S26) block keeps, context 2048, batch 4, fp32, naive attention (torch: 3651.31 MiB a block)"
    { $E2E --model 2.7B --context-length 2048 --attn naive --mode train --checkpoint "$pols,auto:70GiB" --plan --format "$FORMAT"
      echo; echo "four blocks (torch: 14605.25 MiB; two checkpoint(two_blocks): 160.00 MiB)"
      $E2E --model 2.7B --num-layers 4 --context-length 2048 --attn naive --mode train --checkpoint none,blocks:2 --plan --format "$FORMAT"; } | save ckpt_plan.$FORMAT || rc=$?
    echo
    echo "## Activation checkpointing per policy: step time, bytes kept (saved_MiB), predicted and measured peak ($DEVICE)"
    if [ "$DEVICE" = cuda ]; then
      { $E2E --device cuda --model 2.7B --context-length 2048 --attn naive --mode train --checkpoint "$pols" --warmup 1 --steps 3 --format "$FORMAT" --no-sgemm --oom-ok
        $E2E --device cuda --model 2.7B --context-length 1024 --dtype bf16 --mode train --checkpoint none,blocks:1,selective,nested+selective \
             --warmup 2 --steps "$STEPS" --format "$FORMAT" --no-sgemm --oom-ok; } | save ckpt.$FORMAT || rc=$?
    else
      $E2E --device cpu --model "${MODELS%%,*}" --context-length "$CONTEXT" --mode train --checkpoint "$pols" --warmup 1 --steps 3 \
           --format "$FORMAT" --oom-ok | save ckpt.$FORMAT || rc=$?
    fi ;;
  memory)
    if [ "$DEVICE" = cuda ]; then make -s build/memory_cuda; MEM=build/memory_cuda; MEM_MODELS=${MEM_MODELS:-2.7B}
    else make -s build/memory; MEM=build/memory; MEM_MODELS=${MEM_MODELS:-small}; fi
    mdir=${OUT:+$OUT/}memory-profile; MEM_CONTEXT=${MEM_CONTEXT:-128,256,512}; MEM_DTYPES=${MEM_DTYPES:-fp32,bf16}
    echo "## memory_profiling: $MEM_MODELS, contexts $MEM_CONTEXT, forward and a full training step, $MEM_DTYPES ($DEVICE, batch 4); plots in $mdir"
    $MEM --device "$DEVICE" --model "$MEM_MODELS" --context-length "$MEM_CONTEXT" --mode forward,train --dtype "$MEM_DTYPES" --out "$mdir" \
         --format csv --oom-ok >"$mdir.csv" 2>"$mdir.details.md" || rc=$?
    if [ "$DEVICE" = cuda ] && python3 -c 'import torch' 2>/dev/null; then   # PyTorch's peak for the same rows, then the two side by side
      python3 tests/ref/memory_torch.py --model "$MEM_MODELS" --context-length "$MEM_CONTEXT" --mode forward,train --dtype "$MEM_DTYPES" --format csv >"$mdir.torch.csv" || rc=$?
    else : >"$mdir.torch.csv"; fi
    awk -F, 'FNR == 1 { for (i = 1; i <= NF; i++) col[FILENAME, $i] = i; next }
             FILENAME ~ /torch/ { torch[$1 "," $2 "," $3 "," $4] = $(col[FILENAME, "torch_peak_MiB"]); next }
             { k = $2 "," $3 "," $5 "," $6; rows[++n] = $0; key[n] = k }
             END { printf "| model | context | mode | dtype | peak MiB | predicted MiB | diff % | params | grads | optimizer | activations | temporaries | workspace | cached | fwd peak | bwd peak | opt peak | peak in | residual MiB | torch MiB | tsys / torch | status |\n"
                   printf "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|\n"
                   for (r = 1; r <= n; r++) { split(rows[r], c, ","); t = (key[r] in torch) ? torch[key[r]] : "";
                     ratio = (t != "" && t + 0 > 0 && c[8] + 0 > 0) ? sprintf("%.3f", c[8] / t) : "-"
                     printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", c[2], c[3], c[5], c[6], c[8], c[9], c[10],
                            c[11], c[12], c[13], c[14], c[15], c[16], c[17], c[18], c[19], c[20], c[21], c[22], (t == "" ? "-" : t), ratio, c[23] } }' \
        "$mdir.torch.csv" "$mdir.csv" | save memory.md
    echo; cat "$mdir.details.md" ;;
  profile)
    E2EP=$E2E; [ "$DEVICE" = cuda ] || make -s build/e2e
    pdir=${OUT:+$OUT/}profile; rm -f "$pdir/summary.csv"
    PROF_MODELS=${PROF_MODELS:-$([ "$DEVICE" = cuda ] && echo small,medium,large,xl,2.7B || echo small)}
    PROF_CONTEXT=${PROF_CONTEXT:-$([ "$DEVICE" = cuda ] && echo 128,256,512,1024 || echo 128,256)}; PROF_DTYPES=${PROF_DTYPES:-fp32}
    echo "## nsys_profile with the built-in profiler: $PROF_MODELS x contexts $PROF_CONTEXT x forward, forward-backward, train ($DEVICE, $PROF_DTYPES, naive attention); tables and traces in $pdir"
    $E2EP --device "$DEVICE" --model "$PROF_MODELS" --context-length "$PROF_CONTEXT" --mode forward,forward-backward,train --dtype "$PROF_DTYPES" \
          --attn naive --warmup "$WARMUP" --steps "$STEPS" --format csv --oom-ok --profile "$pdir" >"$pdir.csv" 2>"$pdir.log" || rc=$?
    [ -s "$pdir/summary.csv" ] || { echo "bench.sh: no profile summary in $pdir (see $pdir.log)" >&2; rc=1; }
    {
      q() { awk -F, -v want="$1" -v cols="$2" -v head="$3" 'BEGIN { n = split(cols, cs, " "); printf "%s\n|", head; for (i = 1; i <= n; i++) printf " %s |", cs[i]; printf "\n|"; for (i = 1; i <= n; i++) printf "---|"; printf "\n" }
            NR == 1 { for (i = 1; i <= NF; i++) ix[$i] = i; next }
            $1 ~ want { printf "|"; for (i = 1; i <= n; i++) printf " %s |", $(ix[cs[i]]); printf "\n" }' "$pdir/summary.csv"; echo; }
      q '_forward_' 'config step_ms fwd_kernel_ms' '### (a) forward pass: step time under the profiler vs the kernels'"'"' device time (timed rows: '"$pdir"'.csv)'
      q '_forward_' 'config fwd_top_kernel fwd_top_calls fwd_top_ms fwd_kernel_ms' '### (b) the kernel with the most forward time, its launches'
      q '_forward-backward_' 'config step_top_kernel step_top_calls step_top_ms kernel_ms' '### (b) ... and in forward + backward'
      q '_forward_' 'config fwd_matmul_pct fwd_top_other fwd_top_other_ms' '### (c) forward: the matmuls'"'"' share and the largest non-matmul kernel'
      q '_train_' 'config fwd_matmul_pct step_matmul_pct step_top_kernel step_top_ms' '### (d) a training step: the matmuls'"'"' share in forward and in the whole step'
      q '_forward_' 'config softmax_ms attn_matmul_ms fwd_kernel_ms' '### (e) attention (forward): softmax vs its two matmuls (QK^T and PV). Matmul FLOPs / softmax FLOPs = 4 d_head / ~5 (~51 at d_head 64)'
    } | save profile.md ;;
  esac
  if [ $rc -ne 0 ]; then echo "bench.sh: section '$s' failed (exit $rc); going on" >&2; failed+=("$s"); fi
  echo
done
if [ ${#failed[@]} -gt 0 ]; then echo "bench.sh: failed sections: ${failed[*]}" >&2; exit 1; fi
